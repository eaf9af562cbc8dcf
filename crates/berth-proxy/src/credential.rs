//! The instance's own credential: presented upstream by the proxy, never
//! shown to the browser.
//!
//! Many programs guard themselves with a token they print at start (the
//! launch token, captured by `ready_token_regex`). A browser that reached
//! the program through berth has already proved who it is, so asking again
//! would be a second login. A program's config can instead name a header
//! ([`CredentialHeader`]) that the proxy adds, with the launch token in it,
//! to every request and WebSocket upgrade it forwards to that instance.
//!
//! The token is the program's secret, not the user's: nothing the proxy
//! sends back carries it. [`Scrubber`] replaces it in response bodies (as
//! they stream) and [`scrub_headers`] in response headers, so a page that
//! prints it (a redirect to `?token=…`, a page config) gives it away to
//! nobody. WebSocket frames are passed on as they are.

use bytes::{Bytes, BytesMut};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};

/// The placeholder a credential template must contain.
pub const LAUNCH_TOKEN_PLACEHOLDER: &str = "{launch_token}";

/// `Name: value template`, the template holding [`LAUNCH_TOKEN_PLACEHOLDER`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CredentialHeader {
    name: HeaderName,
    template: String,
}

/// Why a credential header setting is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CredentialHeaderError {
    /// No `:` between the header's name and its value.
    #[error("expected `Name: value`, such as `Authorization: token {{launch_token}}`")]
    NoColon,
    /// The name is not a valid header name.
    #[error("`{0}` is not a valid header name")]
    BadName(String),
    /// The value does not hold `{launch_token}` exactly once.
    #[error("the value must contain {{launch_token}} exactly once")]
    NoPlaceholder,
    /// The value holds characters a header cannot carry.
    #[error("the value holds characters a header cannot carry")]
    BadValue,
    /// The name is a header the proxy sets or strips itself.
    #[error(
        "`{0}` is a header the proxy manages itself (hop-by-hop, Host, Cookie or forwarding headers)"
    )]
    Reserved(String),
}

/// Headers a credential may not take over: the proxy sets or strips them
/// itself, and a credential in them would be lost or would change routing.
const RESERVED: &[&str] = &[
    "host",
    "cookie",
    "connection",
    "upgrade",
    "te",
    "trailer",
    "transfer-encoding",
    "keep-alive",
    "proxy-connection",
    "content-length",
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-forwarded-user",
];

impl CredentialHeader {
    /// Parses `Name: template`.
    pub fn parse(text: &str) -> Result<Self, CredentialHeaderError> {
        let (name, template) = text.split_once(':').ok_or(CredentialHeaderError::NoColon)?;
        let name = name.trim();
        let template = template.trim();
        let header = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| CredentialHeaderError::BadName(name.to_owned()))?;
        if RESERVED.contains(&header.as_str()) || header.as_str().starts_with("sec-websocket-") {
            return Err(CredentialHeaderError::Reserved(name.to_owned()));
        }
        if template.matches(LAUNCH_TOKEN_PLACEHOLDER).count() != 1 {
            return Err(CredentialHeaderError::NoPlaceholder);
        }
        HeaderValue::from_str(&template.replace(LAUNCH_TOKEN_PLACEHOLDER, "x"))
            .map_err(|_| CredentialHeaderError::BadValue)?;
        Ok(Self {
            name: header,
            template: template.to_owned(),
        })
    }

    /// The header the credential is sent in.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }

    /// The header's value for `launch_token`; `None` if the token cannot
    /// be carried in a header (it then is not sent at all).
    pub fn value(&self, launch_token: &str) -> Option<HeaderValue> {
        let mut value = HeaderValue::from_str(
            &self
                .template
                .replace(LAUNCH_TOKEN_PLACEHOLDER, launch_token),
        )
        .ok()?;
        value.set_sensitive(true);
        Some(value)
    }

    /// Puts the credential on a request bound for the instance, replacing
    /// whatever the client sent under that name: the client's value is
    /// not the program's to judge.
    pub fn present(&self, headers: &mut HeaderMap, launch_token: &str) {
        headers.remove(&self.name);
        if let Some(value) = self.value(launch_token) {
            headers.insert(self.name.clone(), value);
        }
    }
}

/// Replaces every occurrence of one secret in a byte stream cut into
/// arbitrary chunks. It holds back at most `secret.len() - 1` bytes that
/// might begin an occurrence, until the next chunk or the end says.
///
/// Each occurrence becomes one byte that the secret does not contain
/// ([`Scrubber::marker`]). Removing occurrences outright would join their
/// neighbours, and a program that knows its secret could nest it
/// (`s3cr3` + secret + `t`) so that the join is the secret again.
#[derive(Debug)]
pub struct Scrubber {
    secret: Bytes,
    marker: u8,
    held: BytesMut,
}

impl Scrubber {
    /// `None` for an empty secret, which has nothing to replace.
    pub fn new(secret: &str) -> Option<Self> {
        (!secret.is_empty()).then(|| Self {
            secret: Bytes::copy_from_slice(secret.as_bytes()),
            marker: marker_for(secret.as_bytes()),
            held: BytesMut::new(),
        })
    }

    /// The byte each occurrence becomes.
    pub fn marker(&self) -> u8 {
        self.marker
    }

    /// The part of the stream so far that can be passed on.
    pub fn push(&mut self, chunk: &[u8]) -> Bytes {
        self.held.extend_from_slice(chunk);
        let (mut out, rest) = replace_complete(&self.held, &self.secret, self.marker);
        // The longest tail that is a proper prefix of the secret may yet
        // become one: keep it back.
        let keep = longest_prefix_suffix(rest, &self.secret);
        out.extend_from_slice(&rest[..rest.len() - keep]);
        self.held = BytesMut::from(&rest[rest.len() - keep..]);
        Bytes::from(out)
    }

    /// What was held back, at the end of the stream.
    pub fn finish(&mut self) -> Bytes {
        self.held.split().freeze()
    }
}

/// A byte the secret does not contain, from a few that are harmless in
/// HTML, JSON, URLs and headers.
fn marker_for(secret: &[u8]) -> u8 {
    const CANDIDATES: &[u8] = b"*~!^|#.";
    CANDIDATES
        .iter()
        .copied()
        .find(|c| !secret.contains(c))
        .unwrap_or(b'*')
}

/// `text` with every occurrence of `needle` (left to right, not
/// overlapping) replaced by `marker`, up to the end of the last one; and
/// the rest of `text` after it.
fn replace_complete<'t>(text: &'t [u8], needle: &[u8], marker: u8) -> (Vec<u8>, &'t [u8]) {
    let mut out = Vec::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = find(rest, needle) {
        out.extend_from_slice(&rest[..at]);
        out.push(marker);
        rest = &rest[at + needle.len()..];
    }
    (out, rest)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    let first = *needle.first()?;
    haystack
        .windows(needle.len())
        .position(|w| w[0] == first && w == needle)
}

/// The length of the longest suffix of `text` that is a proper prefix of
/// `secret`.
fn longest_prefix_suffix(text: &[u8], secret: &[u8]) -> usize {
    let most = secret.len().saturating_sub(1).min(text.len());
    (1..=most)
        .rev()
        .find(|&n| text[text.len() - n..] == secret[..n])
        .unwrap_or(0)
}

/// `text` with every occurrence of `secret` replaced as [`Scrubber`] does:
/// for what berth shows of an instance besides its answers (its log).
pub fn scrub_text(text: &str, secret: &str) -> String {
    if secret.is_empty() {
        return text.to_owned();
    }
    let marker = char::from(marker_for(secret.as_bytes()));
    text.replace(secret, marker.encode_utf8(&mut [0; 4]))
}

/// Replaces `secret` in every response header value that carries it (a
/// `Location` to `?token=…`, a cookie, a debug header), as [`Scrubber`]
/// does in bodies.
pub fn scrub_headers(headers: &mut HeaderMap, secret: &str) {
    let needle = secret.as_bytes();
    if needle.is_empty() {
        return;
    }
    let marker = marker_for(needle);
    for value in headers.values_mut() {
        if find(value.as_bytes(), needle).is_some() {
            let (mut clean, rest) = replace_complete(value.as_bytes(), needle, marker);
            clean.extend_from_slice(rest);
            if let Ok(clean) = HeaderValue::from_bytes(&clean) {
                *value = clean;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_are_checked() {
        let h = CredentialHeader::parse("Authorization: token {launch_token}").unwrap();
        assert_eq!(h.name(), "authorization");
        assert_eq!(h.value("abc").unwrap(), "token abc");
        assert!(h.value("abc").unwrap().is_sensitive());
        assert_eq!(
            CredentialHeader::parse("Authorization token {launch_token}"),
            Err(CredentialHeaderError::NoColon)
        );
        assert_eq!(
            CredentialHeader::parse("X-Key: fixed"),
            Err(CredentialHeaderError::NoPlaceholder)
        );
        assert_eq!(
            CredentialHeader::parse("X-Key: {launch_token}{launch_token}"),
            Err(CredentialHeaderError::NoPlaceholder)
        );
        assert!(matches!(
            CredentialHeader::parse("Bad Name: {launch_token}"),
            Err(CredentialHeaderError::BadName(_))
        ));
        for reserved in ["Host", "Cookie", "X-Forwarded-User", "Sec-WebSocket-Key"] {
            assert!(
                matches!(
                    CredentialHeader::parse(&format!("{reserved}: {{launch_token}}")),
                    Err(CredentialHeaderError::Reserved(_))
                ),
                "{reserved}"
            );
        }
        assert_eq!(
            CredentialHeader::parse("X-Key: a\u{1}{launch_token}"),
            Err(CredentialHeaderError::BadValue)
        );
    }

    #[test]
    fn the_credential_replaces_what_the_client_sent() {
        let h = CredentialHeader::parse("Authorization: token {launch_token}").unwrap();
        let mut headers = HeaderMap::new();
        headers.append("authorization", HeaderValue::from_static("token forged"));
        headers.append("authorization", HeaderValue::from_static("Basic x"));
        h.present(&mut headers, "real");
        let values: Vec<_> = headers.get_all("authorization").iter().collect();
        assert_eq!(values, ["token real"]);
        // A token a header cannot carry is not sent, and neither is the
        // client's value.
        h.present(&mut headers, "bad\ntoken");
        assert!(headers.get("authorization").is_none());
    }

    /// Every way of cutting the stream gives the same result as replacing
    /// the secret in the whole, and no result carries the secret, however
    /// a program nests it.
    #[test]
    fn scrubbing_does_not_depend_on_chunking() {
        let secret = "s3cr3tT0k";
        let texts = [
            "no secret here".to_owned(),
            format!("a{secret}b{secret}"),
            format!("{secret}{secret}{secret}"),
            format!("s3cr3{secret}tT0k end"),
            format!("s3cr3s3cr3{secret}tT0ktT0k"),
            format!("s3cr3tT0s3cr3tT0k {}", &secret[..5]),
            secret[..secret.len() - 1].to_owned(),
        ];
        for text in &texts {
            let (mut whole, rest) = replace_complete(text.as_bytes(), secret.as_bytes(), b'*');
            whole.extend_from_slice(rest);
            assert!(find(&whole, secret.as_bytes()).is_none(), "{text:?}");
            for size in 1..=text.len().max(1) {
                let mut scrubber = Scrubber::new(secret).unwrap();
                let mut out = Vec::new();
                for chunk in text.as_bytes().chunks(size) {
                    out.extend_from_slice(&scrubber.push(chunk));
                }
                out.extend_from_slice(&scrubber.finish());
                assert_eq!(out, whole, "{text:?} in chunks of {size}");
            }
        }
        assert_eq!(
            Scrubber::new("ab").unwrap().push(b"xaby"),
            Bytes::from_static(b"x*y")
        );
        assert_eq!(Scrubber::new("a*b").unwrap().marker(), b'~');
        assert!(Scrubber::new("").is_none());
    }

    #[test]
    fn text_loses_the_secret() {
        assert_eq!(scrub_text("a tok b tok", "tok"), "a * b *");
        assert_eq!(scrub_text("plain", ""), "plain");
    }

    #[test]
    fn headers_lose_the_secret() {
        let mut headers = HeaderMap::new();
        headers.insert("location", HeaderValue::from_static("/lab?token=T0KEN&x=1"));
        headers.insert("x-other", HeaderValue::from_static("plain"));
        scrub_headers(&mut headers, "T0KEN");
        assert_eq!(headers["location"], "/lab?token=*&x=1");
        assert_eq!(headers["x-other"], "plain");
    }
}
