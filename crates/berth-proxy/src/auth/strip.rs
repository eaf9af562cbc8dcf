//! berth's credentials never reach a program, and a program cannot set
//! them (invariant 21 in ARCHITECTURE.md).

use cookie::Cookie;
use hyper::header::{self, HeaderMap, HeaderValue};

use super::caller::Credential;
use super::cookies::BERTH_COOKIES;
use super::trusted::PROXY_SECRET;

/// Removes berth's own credentials before a request goes to an instance:
/// the program must never see them (a token would let it act as its user
/// in the API, a secret as a node or the SSO proxy). berth's cookies and
/// the proxy secret always go; `Authorization` only if berth consumed it
/// (otherwise it is the program's own).
pub fn strip_credentials(headers: &mut HeaderMap, used: Credential) {
    if used == Credential::Bearer {
        headers.remove(header::AUTHORIZATION);
    }
    if used == Credential::Cluster {
        // A node's signature is spent once checked, but the program has no
        // business with it (nor with the user it was signed for).
        for name in crate::peer_auth::node_headers() {
            headers.remove(name);
        }
    }
    headers.remove(&PROXY_SECRET);
    let carries_ours = headers.get_all(header::COOKIE).iter().any(|v| {
        // Every berth cookie name contains "berth_".
        v.as_bytes().windows(6).any(|w| w == b"berth_")
    });
    if !carries_ours {
        return;
    }
    let kept: Vec<String> = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|pair| !pair.is_empty())
        .filter(|pair| match Cookie::parse(*pair) {
            Ok(cookie) => !BERTH_COOKIES.contains(&cookie.name()),
            // Not a name=value pair: not ours, and passed on as it came.
            Err(_) => true,
        })
        .map(str::to_owned)
        .collect();
    headers.remove(header::COOKIE);
    if let Ok(value) = HeaderValue::try_from(kept.join("; "))
        && !value.is_empty()
    {
        headers.insert(header::COOKIE, value);
    }
}

/// Whether a response's `Set-Cookie` value would set one of berth's
/// cookies (`crate::shield` drops such a header from every answer of a
/// program: it must not log its user out, fix their login, or plant a
/// second cookie of that name). Names are compared without regard to case
/// (browsers treat the `__Host-` prefix so), and a nameless cookie whose
/// value starts with one of berth's names counts too: browsers send
/// `=berth_token=x` as `berth_token=x`.
pub fn sets_berth_cookie(set_cookie: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(set_cookie) else {
        // Not UTF-8: no cookie crate or browser reads a berth name in it
        // reliably; refusing it costs the program nothing legitimate.
        return true;
    };
    let name = match Cookie::parse(text) {
        Ok(cookie) => cookie.name().to_owned(),
        Err(_) => {
            // No name (`=berth_token=x`) or no `=` at all: what a browser
            // would send is the value itself.
            let pair = text.split(';').next().unwrap_or_default().trim();
            let pair = pair.strip_prefix('=').unwrap_or(pair).trim_start();
            pair.split('=').next().unwrap_or_default().trim().to_owned()
        }
    };
    BERTH_COOKIES.iter().any(|b| b.eq_ignore_ascii_case(&name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::test_support::cookies;

    #[test]
    fn programs_cannot_set_berths_cookies() {
        for ours in [
            "berth_token=x; Path=/u/",
            "berth_token=x",
            " berth_token = x ; Domain=example.test",
            "__Host-berth_token=x; Path=/; Secure",
            "__host-berth_token=x; Path=/; Secure",
            "BERTH_SESSION=x",
            "=berth_token=x",
            "= berth_session=x; Path=/",
            "berth_token",
        ] {
            assert!(sets_berth_cookie(ours.as_bytes()), "{ours:?}");
        }
        for theirs in [
            "app=1; Path=/",
            "berth_token_x=1",
            "xberth_token=1",
            "session=berth_token",
        ] {
            assert!(!sets_berth_cookie(theirs.as_bytes()), "{theirs:?}");
        }
        assert!(sets_berth_cookie(b"\xffberth_token=1"), "not UTF-8");
    }

    #[test]
    fn berth_credentials_never_reach_the_instance() {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer x"));
        h.append(
            header::COOKIE,
            HeaderValue::from_static("a=1; berth_token=secret; __Host-berth_token=s2"),
        );
        h.append(
            header::COOKIE,
            HeaderValue::from_static("b=2; berth_session=s3; justavalue"),
        );
        h.insert(PROXY_SECRET.clone(), HeaderValue::from_static("sso"));
        strip_credentials(&mut h, Credential::Cookie);
        assert_eq!(h[header::AUTHORIZATION], "Bearer x", "not ours: the app's");
        assert_eq!(h[header::COOKIE], "a=1; b=2; justavalue");
        assert!(!h.contains_key(&PROXY_SECRET));
        strip_credentials(&mut h, Credential::Bearer);
        assert!(!h.contains_key(header::AUTHORIZATION));
        let mut only = cookies(&["berth_token=secret"]);
        strip_credentials(&mut only, Credential::Cookie);
        assert!(!only.contains_key(header::COOKIE));
    }
}
