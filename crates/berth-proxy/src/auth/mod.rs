//! Who is calling, and may they reach this user.
//!
//! berth keeps two kinds of credential apart:
//!
//! * **Tokens**, shown as `Authorization: Bearer …`: the admin token
//!   (compared in constant time against its SHA-256 in memory) and user
//!   tokens (looked up in the store by their SHA-256, so a secret never
//!   meets a timing-dependent comparison). The API and the proxy accept
//!   both, the proxy only for the token's own user.
//! * **Browser cookies**, each for one purpose. The *user cookie*
//!   ([`USER_COOKIE`], or [`USER_COOKIE_HOST`] over https in host mode)
//!   holds a user token and is accepted by the proxy alone, for that user
//!   alone; it is set when a browser first opens a link carrying
//!   `?berth_token=` and is scoped to the user's own origin or base path.
//!   The admin page's *session cookie* ([`SESSION_COOKIE`]) is the API's,
//!   checked in the binary. The proxy never accepts the admin token from a
//!   cookie or a link: an admin opens a user's app with a token scoped to
//!   that user.
//!
//! In `auth = "header"` mode, `X-Forwarded-User` from a trusted peer (and,
//! if configured, with the proxy's shared secret) names the user.
//!
//! User-token lookups are cached per node for a short time
//! ([`DEFAULT_CACHE_TTL`]) so that a proxied request costs no store query;
//! a revocation empties the cache of every node it can reach
//! ([`Authenticator::purge`]), and the cache's lifetime bounds how long an
//! unreachable node may go on accepting a revoked token.
//!
//! One job per file, everything re-exported here: `caller.rs` (who is
//! calling, and what that allows), `secret.rs` (hashed secrets and their
//! constant-time checks), `cookies.rs` (berth's cookie names and the user
//! cookie's scope), `extract.rs` (the Bearer token and berth's cookies in a
//! request), `link.rs` (the one-shot `?berth_token=` link), `strip.rs`
//! (what never reaches a program, and what a program may not set),
//! `tokens.rs` and `cache.rs` (checking tokens, and the user-token cache
//! with its purge), `user_token.rs` (what the store knows of a user token,
//! which both use), `trusted.rs` (trusted proxies and header mode), and
//! `gate.rs` (the proxy's auth layer, which puts them together).

mod cache;
mod caller;
mod cookies;
mod extract;
mod gate;
mod link;
mod secret;
mod strip;
mod tokens;
mod trusted;
mod user_token;

pub use caller::{Access, Caller, Credential};
pub use cookies::{
    BERTH_COOKIES, CSRF_HEADER, CookieScope, SESSION_COOKIE, SESSION_COOKIE_HOST, USER_COOKIE,
    USER_COOKIE_HOST,
};
pub use extract::{BerthCookies, bearer, berth_cookies};
pub use gate::{Gate, Pass};
pub use link::{
    HOP_QUERY, QueryToken, TOKEN_QUERY, is_cookie_safe, query_hop, query_token, same_host_location,
};
pub use secret::{InvalidSecret, SharedSecret, TokenHash};
pub use strip::{sets_berth_cookie, strip_credentials};
pub use tokens::{
    AuthError, Authenticator, DEFAULT_CACHE_ENTRIES, DEFAULT_CACHE_TTL, Redeemed, TokenStore,
};
pub use trusted::{AuthMode, FORWARDED_USER, InvalidIpNet, PROXY_SECRET, TrustedProxies, is_https};
pub use user_token::UserTokenInfo;

#[cfg(test)]
mod test_support {
    use berth_core::UserId;
    use hyper::header::{self, HeaderMap, HeaderValue};

    pub fn user(s: &str) -> UserId {
        UserId::parse(s).unwrap()
    }

    pub fn cookies(values: &[&'static str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(header::COOKIE, HeaderValue::from_static(v));
        }
        headers
    }
}
