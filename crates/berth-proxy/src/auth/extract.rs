//! Reading berth's credentials from a request: the Bearer token and
//! berth's cookies.

use cookie::Cookie;
use hyper::header::{self, HeaderMap};

use super::cookies::{SESSION_COOKIE, SESSION_COOKIE_HOST, USER_COOKIE, USER_COOKIE_HOST};

/// The token in `Authorization: Bearer …`, if any.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
}

fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    // The scheme is case-insensitive (RFC 9110 §11.1).
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// berth's cookies in a request, by name: every cookie of each name, in
/// the order the browser sent them. Empty values (deleted cookies) are
/// left out.
///
/// A request may carry several cookies of one name: one set by berth,
/// others planted by a script of another app (a cookie for the parent
/// domain, or for a longer path, which browsers send first). The reader
/// keeps them all, and whoever checks them tries each, so that a planted
/// cookie can neither shadow the real one nor get the request refused.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BerthCookies<'a> {
    /// Every [`USER_COOKIE`] value.
    pub user: Vec<&'a str>,
    /// Every [`USER_COOKIE_HOST`] value: user cookies no other origin can
    /// have set.
    pub user_host: Vec<&'a str>,
    /// Every [`SESSION_COOKIE`] value.
    pub session: Vec<&'a str>,
    /// Every [`SESSION_COOKIE_HOST`] value.
    pub session_host: Vec<&'a str>,
}

impl<'a> BerthCookies<'a> {
    /// The user cookies to try: the `__Host-` ones first, since no other
    /// origin can have set them.
    pub fn user_tokens(&self) -> impl Iterator<Item = &'a str> + '_ {
        distinct(self.user_host.iter().chain(&self.user))
    }

    /// The session cookies to try, the `__Host-` ones first.
    pub fn session_tokens(&self) -> impl Iterator<Item = &'a str> + '_ {
        distinct(self.session_host.iter().chain(&self.session))
    }

    fn slot(&mut self, name: &str) -> Option<&mut Vec<&'a str>> {
        match name {
            USER_COOKIE => Some(&mut self.user),
            USER_COOKIE_HOST => Some(&mut self.user_host),
            SESSION_COOKIE => Some(&mut self.session),
            SESSION_COOKIE_HOST => Some(&mut self.session_host),
            _ => None,
        }
    }
}

/// `values` without repeats: the same planted value sent twice is checked
/// once.
fn distinct<'a, 'b>(
    values: impl Iterator<Item = &'b &'a str> + 'b,
) -> impl Iterator<Item = &'a str> + 'b
where
    'a: 'b,
{
    let mut seen: Vec<&'a str> = Vec::new();
    values.copied().filter(move |v| {
        if seen.contains(v) {
            return false;
        }
        seen.push(v);
        true
    })
}

/// berth's cookies among the request's `Cookie` headers.
pub fn berth_cookies(headers: &HeaderMap) -> BerthCookies<'_> {
    let mut found = BerthCookies::default();
    for value in headers.get_all(header::COOKIE) {
        let Ok(value) = value.to_str() else { continue };
        for cookie in Cookie::split_parse(value).flatten() {
            let (Some(name), Some(raw)) = (cookie.name_raw(), cookie.value_raw()) else {
                continue;
            };
            let Some(slot) = found.slot(name) else {
                continue;
            };
            let raw = raw.trim_matches('"');
            if !raw.is_empty() {
                slot.push(raw);
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::test_support::cookies;
    use hyper::header::HeaderValue;

    #[test]
    fn bearer_tokens_are_read_case_insensitively() {
        let mut headers = HeaderMap::new();
        assert_eq!(bearer(&headers), None);
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic abc"));
        assert_eq!(bearer(&headers), None);
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer  frombearer "),
        );
        assert_eq!(bearer(&headers), Some("frombearer"));
    }

    #[test]
    fn berth_cookies_are_found_by_exact_name() {
        let headers = cookies(&[
            "a=b; berth_token=plain; Berth_Token=other",
            "__Host-berth_token=\"hosted\"; berth_session=s",
        ]);
        let found = berth_cookies(&headers);
        assert_eq!(found.user, ["plain"]);
        assert_eq!(found.user_host, ["hosted"]);
        assert_eq!(
            found.user_tokens().collect::<Vec<_>>(),
            ["hosted", "plain"],
            "__Host- first"
        );
        assert_eq!(found.session_tokens().collect::<Vec<_>>(), ["s"]);
        let headers = cookies(&["other=1; berth_token="]);
        let none = berth_cookies(&headers);
        assert_eq!(
            none.user_tokens().next(),
            None,
            "an empty value is no credential"
        );
        assert_eq!(berth_cookies(&HeaderMap::new()), BerthCookies::default());
    }

    #[test]
    fn every_cookie_of_one_name_is_kept_to_be_tried() {
        let headers = cookies(&[
            "berth_session=planted; berth_token=a; berth_session=real",
            "x=1; berth_token=b; berth_session=planted",
        ]);
        let found = berth_cookies(&headers);
        assert_eq!(found.user_tokens().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(
            found.session_tokens().collect::<Vec<_>>(),
            ["planted", "real"],
            "in the order sent, each value once"
        );
    }
}
