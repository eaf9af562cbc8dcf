//! The one-shot `?berth_token=` link: finding the token in the query,
//! whether it fits in a cookie, and where the redirect that drops it goes.

/// The one-shot query parameter that becomes the user cookie.
pub const TOKEN_QUERY: &str = "berth_token";
/// The one-time sign-in code that carries a signed-in user from the berth
/// host to their app's own host, where it becomes the user cookie.
pub const HOP_QUERY: &str = "berth_hop";

/// A `berth_token` found in a query string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryToken {
    /// The percent-decoded token.
    pub token: String,
    /// The query without the token parameter; empty if nothing is left.
    pub rest: String,
}

/// Finds `berth_token=` in `query`. `None` when absent (the common case,
/// which allocates nothing).
pub fn query_token(query: &str) -> Option<QueryToken> {
    query_param(query, TOKEN_QUERY)
}

/// Finds `berth_hop=` in `query`, the same way.
pub fn query_hop(query: &str) -> Option<QueryToken> {
    query_param(query, HOP_QUERY)
}

fn query_param(query: &str, param: &str) -> Option<QueryToken> {
    let mut found: Option<&str> = None;
    for pair in query.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if name == param {
            found = Some(value);
        }
    }
    let raw = found?;
    let token = percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .ok()?
        .into_owned();
    let rest = query
        .split('&')
        .filter(|pair| {
            let name = pair.split_once('=').map_or(*pair, |(n, _)| n);
            name != param && !pair.is_empty()
        })
        .collect::<Vec<_>>()
        .join("&");
    Some(QueryToken { token, rest })
}

/// True if `token` may be put in a cookie value as is (RFC 6265 cookie-octets).
pub fn is_cookie_safe(token: &str) -> bool {
    !token.is_empty()
        && token
            .bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'"' | b',' | b';' | b'\\'))
}

/// The `Location` of the redirect that drops `?berth_token=`: a path on the
/// same host, never a network-path reference. Leading slashes (and the
/// backslashes browsers read as slashes) collapse into one, so
/// `//evil.example/x` becomes `/evil.example/x`.
pub fn same_host_location(path: &str, query: &str) -> String {
    let rest = path.trim_start_matches(['/', '\\']);
    let mut location = String::with_capacity(rest.len() + query.len() + 2);
    location.push('/');
    location.push_str(rest);
    if !query.is_empty() {
        location.push('?');
        location.push_str(query);
    }
    location
}

/// Where a browser without a credential for an app goes to sign in: the
/// berth host's sign-in page, told to come back to `path_and_query` on
/// `host`. In path mode the berth host is the same host; in host mode it
/// is the app's host without its first label (the base domain, port kept).
/// `None` when the host has no label to drop.
pub fn sign_in_location(
    host_mode: bool,
    host: &str,
    path_and_query: &str,
    https: bool,
) -> Option<String> {
    use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
    if !host_mode {
        let next = utf8_percent_encode(path_and_query, NON_ALPHANUMERIC);
        return Some(format!("/login?next={next}"));
    }
    let scheme = if https { "https" } else { "http" };
    let (_, berth_host) = host.split_once('.')?;
    if berth_host.is_empty() || berth_host.starts_with('.') {
        return None;
    }
    let here = format!("{scheme}://{host}{path_and_query}");
    let next = utf8_percent_encode(&here, NON_ALPHANUMERIC);
    Some(format!("{scheme}://{berth_host}/login?next={next}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_in_goes_to_the_berth_host() {
        assert_eq!(
            sign_in_location(false, "127.0.0.1:8000", "/u/alice/lab?x=1", false).unwrap(),
            "/login?next=%2Fu%2Falice%2Flab%3Fx%3D1"
        );
        assert_eq!(
            sign_in_location(true, "alice.berth.test:8123", "/lab", true).unwrap(),
            "https://berth.test:8123/login?next=https%3A%2F%2Falice%2Eberth%2Etest%3A8123%2Flab"
        );
        assert_eq!(sign_in_location(true, "localhost", "/", false), None);
    }

    #[test]
    fn query_token_is_found_and_removed() {
        assert_eq!(query_token("a=1&b=2"), None);
        let q = query_token("a=1&berth_token=abc%2Bd&b=2").unwrap();
        assert_eq!(q.token, "abc+d");
        assert_eq!(q.rest, "a=1&b=2");
        let q = query_token("berth_token=x").unwrap();
        assert_eq!((q.token.as_str(), q.rest.as_str()), ("x", ""));
        assert_eq!(query_token("berth_token=%FF"), None, "not UTF-8");
    }

    #[test]
    fn redirects_stay_on_the_same_host() {
        for (path, query, want) in [
            ("/u/alice/", "", "/u/alice/"),
            ("/lab", "a=1", "/lab?a=1"),
            ("//evil.example/x", "", "/evil.example/x"),
            ("///evil.example", "q", "/evil.example?q"),
            ("/\\evil.example", "", "/evil.example"),
            ("\\/evil.example", "", "/evil.example"),
            ("/", "", "/"),
            ("", "", "/"),
        ] {
            assert_eq!(same_host_location(path, query), want, "{path:?}");
        }
    }

    #[test]
    fn cookie_safety() {
        assert!(is_cookie_safe("0123abcdef"));
        for bad in ["", "a b", "a;b", "a,b", "a\"b"] {
            assert!(!is_cookie_safe(bad), "{bad:?}");
        }
    }
}
