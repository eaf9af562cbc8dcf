//! Reading berth's credentials from a request: the Bearer token and
//! berth's cookies.

use cookie::Cookie;
use hyper::header::{self, HeaderMap};

use super::cookies::{
    BERTH_COOKIES, SESSION_COOKIE, SESSION_COOKIE_HOST, USER_COOKIE, USER_COOKIE_HOST,
};

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

/// berth's cookies in a request, by name. Empty values count as absent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BerthCookies<'a> {
    pub user: Option<&'a str>,
    pub user_host: Option<&'a str>,
    pub session: Option<&'a str>,
    pub session_host: Option<&'a str>,
}

impl<'a> BerthCookies<'a> {
    /// The user cookie: the `__Host-` one first, since no other origin can
    /// have set it.
    pub fn user_token(&self) -> Option<&'a str> {
        self.user_host.or(self.user)
    }

    /// The session cookie, the `__Host-` one first.
    pub fn session_token(&self) -> Option<&'a str> {
        self.session_host.or(self.session)
    }

    fn slot(&mut self, name: &str) -> Option<&mut Option<&'a str>> {
        match name {
            USER_COOKIE => Some(&mut self.user),
            USER_COOKIE_HOST => Some(&mut self.user_host),
            SESSION_COOKIE => Some(&mut self.session),
            SESSION_COOKIE_HOST => Some(&mut self.session_host),
            _ => None,
        }
    }
}

/// A request carried two cookies of one of berth's names. Which one the
/// browser meant cannot be told (one may have been planted by another
/// site's script), so the request is refused rather than guessed at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the request carries two {0} cookies; berth cannot tell which one is yours")]
pub struct DuplicateCookie(pub &'static str);

/// berth's cookies among the request's `Cookie` headers.
pub fn berth_cookies(headers: &HeaderMap) -> Result<BerthCookies<'_>, DuplicateCookie> {
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
            if slot.is_some() {
                let name = BERTH_COOKIES
                    .into_iter()
                    .find(|n| *n == name)
                    .unwrap_or(USER_COOKIE);
                return Err(DuplicateCookie(name));
            }
            let raw = raw.trim_matches('"');
            *slot = Some(raw);
        }
    }
    // An empty value is a deleted cookie, not a credential; it still
    // counted above, so two of one name are refused whatever they hold.
    for slot in [
        &mut found.user,
        &mut found.user_host,
        &mut found.session,
        &mut found.session_host,
    ] {
        if slot.is_some_and(str::is_empty) {
            *slot = None;
        }
    }
    Ok(found)
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
        let found = berth_cookies(&headers).unwrap();
        assert_eq!(found.user, Some("plain"));
        assert_eq!(found.user_host, Some("hosted"));
        assert_eq!(found.user_token(), Some("hosted"), "__Host- wins");
        assert_eq!(found.session_token(), Some("s"));
        let headers = cookies(&["other=1; berth_token="]);
        let none = berth_cookies(&headers).unwrap();
        assert_eq!(none.user_token(), None, "an empty value is no credential");
        assert_eq!(
            berth_cookies(&HeaderMap::new()).unwrap(),
            BerthCookies::default()
        );
    }

    #[test]
    fn two_cookies_of_one_name_are_refused() {
        for values in [
            &["berth_token=a; berth_token=b"][..],
            &["berth_token=a", "x=1; berth_token=b"],
            &["berth_session=a; berth_session="],
            &["__Host-berth_token=a; __Host-berth_token=a"],
        ] {
            assert!(berth_cookies(&cookies(values)).is_err(), "{values:?}");
        }
        let err = berth_cookies(&cookies(&["berth_token=a; berth_token=b"])).unwrap_err();
        assert_eq!(err, DuplicateCookie(USER_COOKIE));
        assert!(err.to_string().contains("two berth_token cookies"), "{err}");
        // One of each name is fine.
        assert!(berth_cookies(&cookies(&["berth_token=a; __Host-berth_token=b"])).is_ok());
    }
}
