//! berth's cookie names, and where the user cookie is scoped: which
//! origin or base path it is set for, and how it is deleted again.

use cookie::{Cookie, SameSite};
use hyper::header::HeaderName;

/// The user cookie: a user token, for the proxy only.
pub const USER_COOKIE: &str = "berth_token";
/// The user cookie's name over https in host mode: the `__Host-` prefix
/// makes browsers refuse it unless it is host-only, `Secure` and `Path=/`,
/// so a sibling subdomain cannot plant one.
pub const USER_COOKIE_HOST: &str = "__Host-berth_token";
/// The admin page's session cookie, for the API only.
pub const SESSION_COOKIE: &str = "berth_session";
/// The session cookie's name over https.
pub const SESSION_COOKIE_HOST: &str = "__Host-berth_session";
/// Every cookie name berth uses. None of them ever reaches a program, and
/// a program may set none of them.
pub const BERTH_COOKIES: [&str; 4] = [
    USER_COOKIE,
    USER_COOKIE_HOST,
    SESSION_COOKIE,
    SESSION_COOKIE_HOST,
];
/// The header the admin page sends its CSRF token in.
pub static CSRF_HEADER: HeaderName = HeaderName::from_static("x-berth-csrf");

/// Where the user cookie lives: the origin a request was routed by.
/// Borrowed from the request, so that judging a request allocates nothing;
/// the cookie's path is built only when a cookie is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CookieScope<'a> {
    /// `<slug>.<base_domain>`: a host-only cookie for `Path=/`.
    Host,
    /// `/u/<segment>/` on a shared host: `Path=` that base path, with the
    /// segment exactly as the request spelled it (the browser compares
    /// paths byte for byte).
    Path {
        /// The `<segment>` of `/u/<segment>/`, byte for byte as requested.
        segment: &'a str,
    },
}

impl CookieScope<'_> {
    fn path(&self) -> String {
        match self {
            CookieScope::Host => "/".to_owned(),
            CookieScope::Path { segment } => format!("/u/{segment}/"),
        }
    }

    /// The user cookie's name: `__Host-` prefixed over https in host mode.
    fn user_cookie_name(&self, https: bool) -> &'static str {
        match self {
            CookieScope::Host if https => USER_COOKIE_HOST,
            _ => USER_COOKIE,
        }
    }

    /// The `Set-Cookie` value that stores `token` in a browser.
    pub fn user_cookie(&self, token: &str, https: bool) -> Cookie<'static> {
        Cookie::build((self.user_cookie_name(https), token.to_owned()))
            .path(self.path())
            .http_only(true)
            .same_site(SameSite::Lax)
            .secure(https)
            .build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_cookies_are_scoped_to_their_origin_or_base_path() {
        let host = CookieScope::Host.user_cookie("t0k", true).to_string();
        for part in [
            "__Host-berth_token=t0k",
            "Path=/",
            "HttpOnly",
            "SameSite=Lax",
            "Secure",
        ] {
            assert!(host.contains(part), "{host}");
        }
        assert!(!host.contains("Domain"), "host-only: {host}");
        let plain = CookieScope::Host.user_cookie("t0k", false).to_string();
        assert!(plain.starts_with("berth_token=t0k"), "{plain}");
        assert!(!plain.contains("Secure"), "{plain}");
        let path = CookieScope::Path { segment: "a%40b" }
            .user_cookie("t0k", false)
            .to_string();
        for part in [
            "berth_token=t0k",
            "Path=/u/a%40b/",
            "HttpOnly",
            "SameSite=Lax",
        ] {
            assert!(path.contains(part), "{path}");
        }
    }
}
