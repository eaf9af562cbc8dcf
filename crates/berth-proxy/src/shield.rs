//! What an app may say to the browser, and which browser requests may
//! reach an app: the proxy's rules against hostile programs, as pure
//! functions over plain data.
//!
//! Every program berth runs, and every byte it answers, is treated as an
//! attacker's. Two places matter:
//!
//! * **Response headers** ([`judge_response_header`], applied by
//!   [`confine_response`]). In path mode every app shares berth's origin,
//!   so a header that acts on the whole origin would act on berth's own
//!   pages (the admin page) and on every other user's app. In host mode
//!   each app has its own origin, but all apps (and berth) are one *site*:
//!   cookies with `Domain=` and `Clear-Site-Data: "cookies"` reach across
//!   the whole site.
//! * **Requests** ([`foreign_request`]): in host mode a page of one app can
//!   make a browser send requests to another app, with that app's cookie
//!   (`SameSite=Lax` does not tell sibling subdomains apart). A request
//!   that changes state, or opens a WebSocket, from another origin is
//!   refused unless the program asked for cross-origin requests.

use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Uri};

use crate::auth::sets_berth_cookie;

/// Where an app lives, as far as the browser is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppSite<'a> {
    /// `<slug>.<base_domain>`: an origin of the app's own, on a site it
    /// shares with every other app and with berth.
    Host,
    /// `/u/<segment>/` on berth's own origin, shared with berth and every
    /// other app. `base` is that path, the segment spelled as the request
    /// spelled it (browsers compare paths byte for byte).
    Path {
        /// The app's base path, `/u/<segment>/`.
        base: &'a str,
    },
}

/// What becomes of one response header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Passed on as the app sent it.
    Keep,
    /// Removed, for this reason (logged at debug level).
    Drop(&'static str),
    /// Replaced by this value.
    Rewrite(HeaderValue),
}

static SERVICE_WORKER_ALLOWED: HeaderName = HeaderName::from_static("service-worker-allowed");
static CLEAR_SITE_DATA: HeaderName = HeaderName::from_static("clear-site-data");
static REFRESH: HeaderName = HeaderName::from_static("refresh");
static NEL: HeaderName = HeaderName::from_static("nel");
static REPORT_TO: HeaderName = HeaderName::from_static("report-to");
static ALT_SVC: HeaderName = HeaderName::from_static("alt-svc");
static ACCEPT_CH: HeaderName = HeaderName::from_static("accept-ch");
static SPECULATION_RULES: HeaderName = HeaderName::from_static("speculation-rules");

/// The one rule for an app's response header `name: value` when the app
/// lives at `site`. Header names are lowercase (as `HeaderName` keeps
/// them).
///
/// Both modes:
/// * `Set-Cookie` naming one of berth's cookies is dropped: a program must
///   not log its user out, fix their login, or plant a second cookie of
///   that name for berth's own pages. Any other `Set-Cookie` loses its
///   `Domain` attribute, so the cookie is host-only: a cookie for the whole
///   domain would reach every other app (and berth).
///
/// Host mode (the app's own origin, a site shared with all):
/// * `Clear-Site-Data` loses `"cookies"` (browsers clear cookies of the
///   whole registrable domain: every app's and the admin's session), and
///   `"*"` becomes the types that act on the app's own origin only.
/// * Everything else is the app's business on its own origin.
///
/// Path mode (berth's origin, shared), dropped outright:
/// * `Service-Worker-Allowed`: without it a worker's scope is capped at
///   its script's folder, inside the app's base path; with `/` a worker
///   would see every request to the origin, the admin page's Bearer token
///   included.
/// * `Clear-Site-Data`: it would wipe berth's and every app's storage,
///   caches and cookies on the origin.
/// * `NEL`, `Report-To`: an origin-wide reporting policy would send the
///   URLs of other users' requests (`?berth_token=` links among them) to
///   the app's collector.
/// * `Alt-Svc`, `Strict-Transport-Security`, `Accept-CH`: origin-wide
///   choices (where to connect, https only, which hints to send) that are
///   berth's to make, not one app's.
/// * `Speculation-Rules`: its rules may prefetch or prerender any path of
///   the origin.
///
/// Path mode, narrowed to the app's base path:
/// * `Set-Cookie` with a `Path` outside the base path gets the base path
///   (a cookie for `/` would reach berth and every other app).
/// * `Refresh` that would take the page outside the base path is dropped.
/// * `Link` keeps only the links that stay within the base path (a preload
///   or prefetch elsewhere would fetch other apps' or berth's pages); a
///   URL on another host is dropped too, since the proxy cannot tell
///   whether that host is its own.
pub fn judge_response_header(name: &HeaderName, value: &[u8], site: AppSite<'_>) -> Verdict {
    if name == header::SET_COOKIE {
        return judge_set_cookie(value, site);
    }
    if name == CLEAR_SITE_DATA {
        return match site {
            AppSite::Path { .. } => Verdict::Drop("Clear-Site-Data on the shared origin"),
            AppSite::Host => own_origin_site_data(value),
        };
    }
    let AppSite::Path { base } = site else {
        return Verdict::Keep;
    };
    if name == SERVICE_WORKER_ALLOWED {
        return Verdict::Drop("Service-Worker-Allowed on the shared origin");
    }
    if name == NEL || name == REPORT_TO {
        return Verdict::Drop("an origin-wide reporting policy");
    }
    if name == ALT_SVC || name == header::STRICT_TRANSPORT_SECURITY || name == ACCEPT_CH {
        return Verdict::Drop("an origin-wide setting");
    }
    if name == SPECULATION_RULES {
        return Verdict::Drop("speculation rules on the shared origin");
    }
    if name == REFRESH {
        return match std::str::from_utf8(value).ok().and_then(refresh_target) {
            Some(target) if stays_within(target, base) => Verdict::Keep,
            _ => Verdict::Drop("Refresh outside the app's base path"),
        };
    }
    if name == header::LINK {
        return links_within(value, base);
    }
    Verdict::Keep
}

/// Applies [`judge_response_header`] to every header of an app's response.
/// An answer the rules leave alone (nearly all) is only read, never
/// rebuilt.
pub fn confine_response(headers: &mut HeaderMap, site: AppSite<'_>) {
    let judged = |name: &HeaderName, value: &HeaderValue| {
        judge_response_header(name, value.as_bytes(), site) != Verdict::Keep
    };
    if !headers.iter().any(|(name, value)| judged(name, value)) {
        return;
    }
    let mut names: Vec<HeaderName> = headers
        .iter()
        .filter(|(name, value)| judged(name, value))
        .map(|(name, _)| name.clone())
        .collect();
    names.dedup();
    for name in names {
        let values: Vec<HeaderValue> = headers.get_all(&name).iter().cloned().collect();
        let verdicts: Vec<Verdict> = values
            .iter()
            .map(|v| judge_response_header(&name, v.as_bytes(), site))
            .collect();
        headers.remove(&name);
        for (value, verdict) in values.into_iter().zip(verdicts) {
            match verdict {
                Verdict::Keep => {
                    headers.append(&name, value);
                }
                Verdict::Rewrite(new) => {
                    tracing::debug!(header = %name, "rewrote an app's response header");
                    headers.append(&name, new);
                }
                Verdict::Drop(why) => {
                    tracing::debug!(header = %name, why, "dropped an app's response header");
                }
            }
        }
    }
}

/// `Set-Cookie`: berth's names dropped, `Domain` removed, and in path mode
/// a `Path` outside the base path replaced by it. Attributes are edited as
/// text, so the ones this does not know survive as the app wrote them.
fn judge_set_cookie(value: &[u8], site: AppSite<'_>) -> Verdict {
    if sets_berth_cookie(value) {
        return Verdict::Drop("a Set-Cookie for one of berth's cookies");
    }
    // `sets_berth_cookie` refuses what is not UTF-8.
    let Ok(text) = std::str::from_utf8(value) else {
        return Verdict::Drop("a Set-Cookie that is not UTF-8");
    };
    let mut parts = text.split(';');
    let pair = parts.next().unwrap_or_default();
    if !parts
        .clone()
        .any(|a| cookie_attribute(a, site) != Attribute::Keep)
    {
        return Verdict::Keep;
    }
    let mut out = String::with_capacity(text.len() + 16);
    out.push_str(pair);
    for attribute in parts {
        match cookie_attribute(attribute, site) {
            Attribute::Keep => {
                out.push(';');
                out.push_str(attribute);
            }
            Attribute::Remove => {}
            Attribute::BasePath(base) => {
                out.push_str("; Path=");
                out.push_str(base);
            }
        }
    }
    match HeaderValue::try_from(out) {
        Ok(value) => Verdict::Rewrite(value),
        Err(_) => Verdict::Drop("a Set-Cookie that cannot be rewritten"),
    }
}

/// What becomes of one `Set-Cookie` attribute.
#[derive(Debug, PartialEq, Eq)]
enum Attribute<'a> {
    Keep,
    Remove,
    /// `Path=` this base path instead.
    BasePath(&'a str),
}

fn cookie_attribute<'a>(attribute: &str, site: AppSite<'a>) -> Attribute<'a> {
    let (name, value) = attribute.split_once('=').unwrap_or((attribute, ""));
    let name = name.trim();
    if name.eq_ignore_ascii_case("domain") {
        // Host-only, as if no Domain had been given.
        return Attribute::Remove;
    }
    if let AppSite::Path { base } = site
        && name.eq_ignore_ascii_case("path")
    {
        let path = value.trim();
        // A path not starting with `/` is ignored by browsers in favour of
        // the request's own folder, which is inside the base path.
        if path.starts_with('/') && !path.starts_with(base) {
            return Attribute::BasePath(base);
        }
    }
    Attribute::Keep
}

/// The `Clear-Site-Data` types that act on the response's origin alone.
const OWN_ORIGIN_SITE_DATA: [&str; 3] = ["\"cache\"", "\"storage\"", "\"executionContexts\""];

/// Host mode's `Clear-Site-Data`: without `"cookies"`, `"*"` narrowed to
/// [`OWN_ORIGIN_SITE_DATA`].
fn own_origin_site_data(value: &[u8]) -> Verdict {
    let Ok(text) = std::str::from_utf8(value) else {
        return Verdict::Drop("a Clear-Site-Data that is not UTF-8");
    };
    let mut kept: Vec<&str> = Vec::new();
    let mut changed = false;
    for token in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        if token.eq_ignore_ascii_case("\"cookies\"") {
            changed = true;
        } else if token == "\"*\"" {
            changed = true;
            kept.extend(OWN_ORIGIN_SITE_DATA);
        } else {
            kept.push(token);
        }
    }
    if !changed {
        return Verdict::Keep;
    }
    kept.dedup();
    if kept.is_empty() {
        return Verdict::Drop("Clear-Site-Data of the site's cookies");
    }
    match HeaderValue::try_from(kept.join(", ")) {
        Ok(value) => Verdict::Rewrite(value),
        Err(_) => Verdict::Drop("a Clear-Site-Data that cannot be rewritten"),
    }
}

/// The URL a `Refresh` value (`5; url=/next`) goes to: `Some("")` when it
/// reloads the page itself, `None` when it cannot be read (then it is
/// dropped: what a browser would make of it is not worth guessing).
fn refresh_target(value: &str) -> Option<&str> {
    let value = value.trim();
    let digits = value
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(value.len());
    let rest = value[digits..].trim_start();
    if rest.is_empty() {
        return Some("");
    }
    let rest = rest.strip_prefix([';', ','])?.trim_start();
    let url = match rest.get(..3) {
        Some(key) if key.eq_ignore_ascii_case("url") => {
            let after = rest[3..].trim_start();
            match after.strip_prefix('=') {
                Some(url) => url.trim_start(),
                // `url` is the start of a URL of that name, then.
                None => rest,
            }
        }
        _ => rest,
    };
    let url = url
        .strip_prefix('\'')
        .map(|u| u.split('\'').next().unwrap_or_default())
        .or_else(|| {
            url.strip_prefix('"')
                .map(|u| u.split('"').next().unwrap_or_default())
        })
        .unwrap_or(url);
    Some(url.trim())
}

/// Whether `url`, resolved against a page inside `base` (a path ending in
/// `/`), stays inside `base`. Conservative: anything a browser might
/// resolve elsewhere counts as leaving.
fn stays_within(url: &str, base: &str) -> bool {
    // Browsers drop tabs and newlines from URLs and read `\` as `/`.
    if url.chars().any(|c| c.is_control() || c == '\\') {
        return false;
    }
    let path = url.split(['?', '#']).next().unwrap_or_default();
    // `..` climbs out, and `%2e` may be read as a dot.
    if path.split('/').any(|segment| segment == "..") || path.to_ascii_lowercase().contains("%2e") {
        return false;
    }
    if path.starts_with("//") {
        return false;
    }
    if path.starts_with('/') {
        return path.starts_with(base);
    }
    // A scheme (`http:`, `javascript:`) before any `/`: another origin,
    // or none of the proxy's business.
    let first = path.split('/').next().unwrap_or_default();
    !first.contains(':')
}

/// `Link`: the link-values whose target stays within `base`.
fn links_within(value: &[u8], base: &str) -> Verdict {
    let Ok(text) = std::str::from_utf8(value) else {
        return Verdict::Drop("a Link that is not UTF-8");
    };
    let Some(links) = split_links(text) else {
        return Verdict::Drop("a Link that cannot be read");
    };
    let total = links.len();
    let kept: Vec<&str> = links
        .into_iter()
        .filter(|link| {
            let target = link
                .trim_start()
                .strip_prefix('<')
                .and_then(|l| l.split_once('>'))
                .map(|(target, _)| target);
            target.is_some_and(|t| stays_within(t.trim(), base))
        })
        .collect();
    if kept.len() == total {
        return Verdict::Keep;
    }
    if kept.is_empty() {
        return Verdict::Drop("Link to a path outside the app's base path");
    }
    match HeaderValue::try_from(kept.iter().map(|l| l.trim()).collect::<Vec<_>>().join(", ")) {
        Ok(value) => Verdict::Rewrite(value),
        Err(_) => Verdict::Drop("a Link that cannot be rewritten"),
    }
}

/// A `Link` value's link-values: split at commas outside `<…>` and quoted
/// strings. `None` when a `<` or a quote is never closed.
fn split_links(text: &str) -> Option<Vec<&str>> {
    let mut links = Vec::new();
    let (mut start, mut in_target, mut in_quote, mut escaped) = (0, false, false, false);
    for (i, c) in text.char_indices() {
        if in_quote {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_quote = false,
                _ => {}
            }
            continue;
        }
        match c {
            '<' if !in_target => in_target = true,
            '>' if in_target => in_target = false,
            '"' if !in_target => in_quote = true,
            ',' if !in_target => {
                links.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if in_target || in_quote {
        return None;
    }
    links.push(&text[start..]);
    Some(links.into_iter().filter(|l| !l.trim().is_empty()).collect())
}

/// A request header the rules read: absent, given once, or given more
/// than once (which no browser does, and which is refused rather than
/// guessed at).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Single<'a> {
    /// Not sent.
    Absent,
    /// Sent once, with this value.
    Once(&'a [u8]),
    /// Sent more than once.
    Several,
}

impl<'a> Single<'a> {
    /// The `name` header of `headers`.
    pub fn of(headers: &'a HeaderMap, name: &HeaderName) -> Single<'a> {
        let mut values = headers.get_all(name).iter();
        match (values.next(), values.next()) {
            (None, _) => Single::Absent,
            (Some(v), None) => Single::Once(v.as_bytes()),
            (Some(_), Some(_)) => Single::Several,
        }
    }
}

/// What the proxy knows of a request's provenance, as the browser told it.
#[derive(Debug, Clone, Copy)]
pub struct RequestSite<'a> {
    /// The request's method.
    pub method: &'a Method,
    /// An upgrade (WebSocket) handshake.
    pub upgrade: bool,
    /// The `Host` the request was routed by.
    pub host: Option<&'a [u8]>,
    /// The `Origin` header.
    pub origin: Single<'a>,
    /// The `Sec-Fetch-Site` header.
    pub fetch_site: Single<'a>,
}

impl<'a> RequestSite<'a> {
    /// Reads the facts from a request's method, target and headers. The
    /// host is `Host`, else the authority of an absolute-form target (the
    /// router has refused the two naming different hosts).
    pub fn of(
        method: &'a Method,
        uri: &'a Uri,
        headers: &'a HeaderMap,
        upgrade: bool,
    ) -> RequestSite<'a> {
        static SEC_FETCH_SITE: HeaderName = HeaderName::from_static("sec-fetch-site");
        RequestSite {
            method,
            upgrade,
            host: headers
                .get(header::HOST)
                .map(HeaderValue::as_bytes)
                .or_else(|| uri.authority().map(|a| a.as_str().as_bytes())),
            origin: Single::of(headers, &header::ORIGIN),
            fetch_site: Single::of(headers, &SEC_FETCH_SITE),
        }
    }
}

/// Why a request to an app is refused as coming from another origin, or
/// `None` to let it through.
///
/// Only requests that change state (any method but GET, HEAD and OPTIONS;
/// OPTIONS is the CORS preflight, which the app answers) and upgrades
/// (WebSockets: browsers apply no same-origin rule to them) are judged.
/// They are refused when `Sec-Fetch-Site` says anything but `same-origin`
/// or `none` (typed in, bookmarked), or when `Origin` is not the request's
/// own host (any scheme: berth cannot see the client's, behind a TLS
/// front) or is `null` (a sandboxed or redirected page). A request without
/// either header comes from no browser page (curl, an API client) and is
/// let through: there is no browser whose cookie it could be riding on.
pub fn foreign_request(request: &RequestSite<'_>) -> Option<&'static str> {
    let safe = matches!(
        *request.method,
        Method::GET | Method::HEAD | Method::OPTIONS
    );
    if safe && !request.upgrade {
        return None;
    }
    match request.fetch_site {
        Single::Absent => {}
        Single::Once(site)
            if site.eq_ignore_ascii_case(b"same-origin") || site.eq_ignore_ascii_case(b"none") => {}
        Single::Once(_) => {
            return Some("the request was sent by a page of another origin (Sec-Fetch-Site)");
        }
        Single::Several => return Some("the request carries more than one Sec-Fetch-Site header"),
    }
    match request.origin {
        Single::Absent => None,
        Single::Once(origin) if origin_is_host(origin, request.host) => None,
        Single::Once(_) => Some("the request was sent by a page of another origin (Origin)"),
        Single::Several => Some("the request carries more than one Origin header"),
    }
}

/// `Origin: http(s)://<host>` naming exactly the request's `Host`.
fn origin_is_host(origin: &[u8], host: Option<&[u8]>) -> bool {
    let Some(host) = host else {
        return false;
    };
    let strip = |scheme: &[u8]| {
        (origin.len() > scheme.len() && origin[..scheme.len()].eq_ignore_ascii_case(scheme))
            .then(|| &origin[scheme.len()..])
    };
    let authority = strip(b"https://").or_else(|| strip(b"http://"));
    authority.is_some_and(|a| a.eq_ignore_ascii_case(host.trim_ascii()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALICE: AppSite<'static> = AppSite::Path { base: "/u/alice/" };

    fn judge(name: &'static str, value: &str, site: AppSite<'_>) -> Verdict {
        judge_response_header(&HeaderName::from_static(name), value.as_bytes(), site)
    }

    fn rewritten(verdict: Verdict) -> String {
        match verdict {
            Verdict::Rewrite(v) => v.to_str().unwrap().to_owned(),
            other => panic!("not a rewrite: {other:?}"),
        }
    }

    #[test]
    fn path_mode_drops_origin_wide_headers() {
        for (name, value) in [
            ("service-worker-allowed", "/"),
            ("service-worker-allowed", "/u/alice/"),
            ("clear-site-data", "\"*\""),
            ("nel", "{\"report_to\":\"x\",\"max_age\":1}"),
            ("report-to", "{\"group\":\"x\"}"),
            ("alt-svc", "h2=\":443\""),
            ("strict-transport-security", "max-age=1; includeSubDomains"),
            ("accept-ch", "Sec-CH-UA-Model"),
            ("speculation-rules", "\"/rules.json\""),
        ] {
            assert!(
                matches!(judge(name, value, ALICE), Verdict::Drop(_)),
                "{name}: {value}"
            );
            if name != "clear-site-data" {
                assert_eq!(judge(name, value, AppSite::Host), Verdict::Keep, "{name}");
            }
        }
        assert_eq!(judge("x-app", "1", ALICE), Verdict::Keep);
        assert_eq!(judge("location", "/admin/", ALICE), Verdict::Keep);
    }

    #[test]
    fn cookies_stay_host_only_and_in_the_base_path() {
        assert!(matches!(
            judge("set-cookie", "berth_session=x; Path=/", AppSite::Host),
            Verdict::Drop(_)
        ));
        assert!(matches!(
            judge("set-cookie", "__Host-berth_token=x", ALICE),
            Verdict::Drop(_)
        ));
        assert_eq!(
            rewritten(judge(
                "set-cookie",
                "s=1; Domain=berth.test; Path=/; HttpOnly",
                AppSite::Host
            )),
            "s=1; Path=/; HttpOnly"
        );
        assert_eq!(
            judge("set-cookie", "s=1; Path=/; HttpOnly", AppSite::Host),
            Verdict::Keep
        );
        assert_eq!(
            rewritten(judge("set-cookie", "s=1; path=/; HttpOnly", ALICE)),
            "s=1; Path=/u/alice/; HttpOnly"
        );
        assert_eq!(
            rewritten(judge("set-cookie", "s=1; Path=/u/bob/; DOMAIN=.x", ALICE)),
            "s=1; Path=/u/alice/"
        );
        assert_eq!(
            rewritten(judge("set-cookie", "s=1; Path=/u/alicex", ALICE)),
            "s=1; Path=/u/alice/"
        );
        for kept in [
            "s=1",
            "s=1; Path=/u/alice/",
            "s=1; Path=/u/alice/deeper; Secure",
            "s=1; Path=relative",
            "s=1; Max-Age=10; Partitioned; Priority=High",
        ] {
            assert_eq!(judge("set-cookie", kept, ALICE), Verdict::Keep, "{kept}");
        }
        // Browsers use the last Path: every one outside is replaced.
        assert_eq!(
            rewritten(judge("set-cookie", "s=1; Path=/u/alice/; Path=/", ALICE)),
            "s=1; Path=/u/alice/; Path=/u/alice/"
        );
    }

    #[test]
    fn host_mode_clears_no_cookies_of_the_site() {
        assert!(matches!(
            judge("clear-site-data", "\"cookies\"", AppSite::Host),
            Verdict::Drop(_)
        ));
        assert_eq!(
            rewritten(judge(
                "clear-site-data",
                "\"cache\", \"cookies\"",
                AppSite::Host
            )),
            "\"cache\""
        );
        assert_eq!(
            rewritten(judge("clear-site-data", "\"*\"", AppSite::Host)),
            "\"cache\", \"storage\", \"executionContexts\""
        );
        assert_eq!(
            judge("clear-site-data", "\"storage\"", AppSite::Host),
            Verdict::Keep
        );
    }

    #[test]
    fn refresh_and_links_stay_in_the_base_path() {
        for kept in [
            "5",
            "0; url=next",
            "0;URL='/u/alice/x'",
            "1, url=\"page?a=1\"",
            "0; url=?q=1",
        ] {
            assert_eq!(judge("refresh", kept, ALICE), Verdict::Keep, "{kept}");
        }
        for dropped in [
            "0; url=/admin/",
            "0; url=/u/bob/",
            "0; url=../bob/",
            "0; url=%2e%2e/bob/",
            "0; url=//evil.test/",
            "0; url=http://127.0.0.1/admin/",
            "0; url=/u/alice/..\\..\\admin",
            "0; url=javascript:alert(1)",
            "soon",
        ] {
            assert!(
                matches!(judge("refresh", dropped, ALICE), Verdict::Drop(_)),
                "{dropped}"
            );
        }
        assert_eq!(
            judge("refresh", "0; url=/admin/", AppSite::Host),
            Verdict::Keep
        );
        assert_eq!(
            judge("link", "</u/alice/app.js>; rel=preload; as=script", ALICE),
            Verdict::Keep
        );
        assert_eq!(
            rewritten(judge(
                "link",
                "</u/alice/a.css>; rel=preload, </admin/>; rel=prefetch, <style.css>; rel=\"pre, load\"",
                ALICE
            )),
            "</u/alice/a.css>; rel=preload, <style.css>; rel=\"pre, load\""
        );
        for dropped in [
            "</admin/>; rel=prefetch",
            "<https://cdn.test/x.js>; rel=preload",
            "</u/bob/>; rel=prerender",
            "<../bob/>; rel=prefetch",
            "</u/alice/x, rel=preload",
        ] {
            assert!(
                matches!(judge("link", dropped, ALICE), Verdict::Drop(_)),
                "{dropped}"
            );
        }
    }

    #[test]
    fn confining_a_response_edits_only_what_it_must() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("set-cookie", "a=1; Path=/"),
            ("set-cookie", "berth_token=x"),
            ("set-cookie", "b=2"),
            ("service-worker-allowed", "/"),
            ("x-app", "yes"),
        ] {
            h.append(k, HeaderValue::from_static(v));
        }
        confine_response(&mut h, ALICE);
        let cookies: Vec<_> = h.get_all("set-cookie").iter().collect();
        assert_eq!(cookies, ["a=1; Path=/u/alice/", "b=2"]);
        assert!(!h.contains_key("service-worker-allowed"));
        assert_eq!(h["x-app"], "yes");
    }

    fn site<'a>(
        method: &'a Method,
        upgrade: bool,
        origin: Option<&'a [u8]>,
        fetch_site: Option<&'a [u8]>,
    ) -> RequestSite<'a> {
        RequestSite {
            method,
            upgrade,
            host: Some(b"bob.berth.test:8000"),
            origin: origin.map_or(Single::Absent, Single::Once),
            fetch_site: fetch_site.map_or(Single::Absent, Single::Once),
        }
    }

    #[test]
    fn foreign_state_changes_and_websockets_are_refused() {
        let (post, get) = (Method::POST, Method::GET);
        let foreign = Some(&b"http://alice.berth.test:8000"[..]);
        let own = Some(&b"http://bob.berth.test:8000"[..]);
        let same_site = Some(&b"same-site"[..]);
        let same_origin = Some(&b"same-origin"[..]);
        for refused in [
            site(&post, false, foreign, None),
            site(&post, false, None, same_site),
            site(&post, false, None, Some(b"cross-site")),
            site(&post, false, Some(b"null"), None),
            site(&post, false, own, same_site),
            site(&Method::DELETE, false, foreign, None),
            site(&Method::PUT, false, foreign, same_origin),
            site(&get, true, foreign, None),
            site(&get, true, own, same_site),
            RequestSite {
                origin: Single::Several,
                ..site(&post, false, None, None)
            },
            RequestSite {
                fetch_site: Single::Several,
                ..site(&post, false, None, None)
            },
            RequestSite {
                host: None,
                ..site(&post, false, own, None)
            },
        ] {
            assert!(foreign_request(&refused).is_some(), "{refused:?}");
        }
        // Let through: the app's own pages, typed-in navigations, clients
        // that are not browsers, and reads.
        for allowed in [
            site(&post, false, own, same_origin),
            site(&post, false, Some(b"HTTPS://BOB.berth.test:8000"), None),
            site(&post, false, None, Some(b"none")),
            site(&post, false, None, None),
            site(&get, true, own, same_origin),
            site(&get, true, None, None),
            site(&get, false, foreign, same_site),
            site(&Method::HEAD, false, foreign, same_site),
            site(&Method::OPTIONS, false, foreign, same_site),
        ] {
            assert!(foreign_request(&allowed).is_none(), "{allowed:?}");
        }
    }

    #[test]
    fn the_host_is_hosts_or_an_absolute_targets() {
        let uri: Uri = "http://bob.berth.test:8000/x".parse().unwrap();
        let mut h = HeaderMap::new();
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://bob.berth.test:8000"),
        );
        let post = Method::POST;
        assert!(foreign_request(&RequestSite::of(&post, &uri, &h, false)).is_none());
        h.insert(
            header::HOST,
            HeaderValue::from_static("alice.berth.test:8000"),
        );
        assert!(foreign_request(&RequestSite::of(&post, &uri, &h, false)).is_some());
    }
}
