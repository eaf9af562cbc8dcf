//! The proxy's auth layer: whether a request may reach a user, and the
//! exchange of a `?berth_token=` link for the user cookie.

use std::sync::Arc;

use berth_core::{ErrorCode, UserId};
use hyper::header::{HeaderMap, HeaderValue};
use hyper::{Method, Response, StatusCode, Uri};

use super::caller::{Access, Credential};
use super::cookies::CookieScope;
use super::extract::{bearer, berth_cookies};
use super::link::{
    QueryToken, is_cookie_safe, query_hop, query_token, same_host_location, sign_in_location,
};
use super::secret::SharedSecret;
use super::tokens::{AuthError, Authenticator};
use super::trusted::{AuthMode, FORWARDED_USER, PROXY_SECRET, TrustedProxies, is_https};
use crate::conn::ConnInfo;
use crate::peer_auth::{self, PeerAuth, Refusal};
use crate::respond::{self, ProxyBody};

/// What the gate decided about a request it lets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// The credential that let the request through. It decides what is
    /// stripped before the program sees the request, and whether the request
    /// may still be forwarded to another node.
    pub credential: Credential,
    /// Pass `X-Forwarded-User` on to the program: it came from the trusted
    /// SSO proxy (header mode).
    pub keep_forwarded_user: bool,
}

/// The proxy's auth layer: decides whether a request may reach `user`.
#[derive(Debug, Clone)]
pub struct Gate {
    auth: Authenticator,
    mode: AuthMode,
    trusted: TrustedProxies,
    cluster: Option<Arc<PeerAuth>>,
    header_secret: Option<SharedSecret>,
    /// Send a browser without a credential to berth's sign-in page
    /// instead of answering 401.
    sign_in: bool,
}

impl Gate {
    /// A gate that checks tokens with `auth`, identifies callers as `mode`
    /// says, and believes forwarded headers only from `trusted`. Sign-in,
    /// cluster calls and the header secret are off until the `with_*`
    /// methods turn them on.
    pub fn new(auth: Authenticator, mode: AuthMode, trusted: TrustedProxies) -> Self {
        Self {
            auth,
            mode,
            trusted,
            cluster: None,
            header_secret: None,
            sign_in: false,
        }
    }

    /// Sends a browser that has no credential for the app to berth's
    /// sign-in page (which brings it back once signed in).
    pub fn with_sign_in(mut self, sign_in: bool) -> Self {
        self.sign_in = sign_in;
        self
    }

    /// Also accepts requests forwarded by another node: signed for this
    /// node and the target user ([`PeerAuth::check_forward`]).
    pub fn with_cluster(mut self, auth: Arc<PeerAuth>) -> Self {
        self.cluster = Some(auth);
        self
    }

    /// In header mode, believes `X-Forwarded-User` only next to this secret
    /// in [`PROXY_SECRET`], so that another process on a trusted address
    /// cannot name a user.
    pub fn with_header_secret(mut self, secret: Option<SharedSecret>) -> Self {
        self.header_secret = secret;
        self
    }

    /// The peers whose `X-Forwarded-*` headers are believed.
    pub fn trusted(&self) -> &TrustedProxies {
        &self.trusted
    }

    /// The `X-Forwarded-User` header, if it is to be believed: header mode,
    /// a trusted peer, and the proxy secret when one is configured.
    fn forwarded_user<'h>(
        &self,
        headers: &'h HeaderMap,
        conn: &ConnInfo,
    ) -> Option<&'h HeaderValue> {
        if self.mode != AuthMode::Header || !conn.trusted {
            return None;
        }
        if let Some(secret) = &self.header_secret
            && !secret.verify_in(headers, &PROXY_SECRET)
        {
            return None;
        }
        headers.get(&FORWARDED_USER)
    }

    /// `Ok` lets the request through and says which credential did; `Err`
    /// is the answer instead: a 400, 401 or 403, or the redirect that
    /// turns `?berth_token=` into the user cookie of `scope`.
    ///
    /// A Bearer token that is not a berth token may belong to the app, so
    /// the cookie is tried next.
    pub async fn check(
        &self,
        method: &Method,
        headers: &HeaderMap,
        uri: &Uri,
        conn: &ConnInfo,
        user: &UserId,
        scope: &CookieScope<'_>,
    ) -> Result<Pass, Response<ProxyBody>> {
        let navigation = respond::is_navigation(headers);
        if headers.get_all(&FORWARDED_USER).iter().nth(1).is_some() {
            // Which of two names would the app believe? Refuse instead.
            return Err(respond::code_error(
                ErrorCode::InvalidRequest,
                "the request carries two X-Forwarded-User headers",
            ));
        }
        let pass = |credential| Pass {
            credential,
            keep_forwarded_user: self.forwarded_user(headers, conn).is_some(),
        };
        if let Some(auth) = &self.cluster
            && peer_auth::claims_a_node(headers)
        {
            // Whoever sends a node's headers claims to be a node: the
            // signature alone decides, so a bad one is refused even next
            // to a valid token.
            let target = uri.path_and_query().map_or("/", |pq| pq.as_str());
            let now = berth_core::unix_millis_now();
            return match auth.check_forward(method.as_str(), target, headers, now) {
                Ok(signed_for) if signed_for.as_bytes() == user.as_str().as_bytes() => {
                    // Another node's connection: it may hold many to this
                    // one from its single address.
                    conn.exempt_from_address_cap();
                    Ok(pass(Credential::Cluster))
                }
                Ok(_) => Err(respond::forbidden(navigation)),
                Err(refusal) => Err(refused_node(auth, conn, &refusal)),
            };
        }
        if let Some(q) = uri.query().and_then(query_token) {
            return Err(self
                .exchange_query_token(q, uri, conn, headers, user, scope, navigation)
                .await);
        }
        if let Some(q) = uri.query().and_then(query_hop) {
            return Err(self
                .exchange_hop(q, uri, conn, headers, user, scope, navigation)
                .await);
        }
        if let Some(token) = bearer(headers) {
            match self.auth.access(token, user).await {
                // API clients (and berth's own tests) send the admin token
                // as a header; a browser never does on its own.
                Ok(Access::Admin | Access::Allowed) => return Ok(pass(Credential::Bearer)),
                Ok(Access::Forbidden) => return Err(respond::forbidden(navigation)),
                Ok(Access::Unauthenticated) => {}
                Err(e) => return Err(store_unavailable(&e)),
            }
        }
        // Every user cookie is tried: one planted by another app's script
        // must not shadow the user's own.
        let mut someone_elses = false;
        for token in berth_cookies(headers).user_tokens() {
            match self.auth.access(token, user).await {
                Ok(Access::Allowed) => return Ok(pass(Credential::Cookie)),
                Ok(Access::Forbidden) => someone_elses = true,
                // The admin token never counts from a cookie: any page the
                // browser opens could ride on it.
                Ok(Access::Admin | Access::Unauthenticated) => {}
                Err(e) => return Err(store_unavailable(&e)),
            }
        }
        if someone_elses {
            return Err(respond::forbidden(navigation));
        }
        if let Some(name) = self.forwarded_user(headers, conn) {
            return if name.as_bytes() == user.as_str().as_bytes() {
                Ok(pass(Credential::ForwardedUser))
            } else {
                Err(respond::forbidden(navigation))
            };
        }
        if self.sign_in && navigation && matches!(*method, Method::GET | Method::HEAD) {
            let host = headers
                .get(hyper::header::HOST)
                .and_then(|h| h.to_str().ok())
                .unwrap_or_default();
            let target = uri.path_and_query().map_or("/", |pq| pq.as_str());
            let host_mode = matches!(scope, CookieScope::Host);
            if let Some(location) =
                sign_in_location(host_mode, host, target, is_https(headers, conn))
                    .and_then(|l| HeaderValue::try_from(l).ok())
            {
                return Err(respond::redirect(StatusCode::SEE_OTHER, location, None));
            }
        }
        Err(respond::unauthorized(navigation))
    }

    /// Spends a one-time sign-in code: the user cookie for the user it was
    /// made for, on this app only.
    #[allow(clippy::too_many_arguments)]
    async fn exchange_hop(
        &self,
        q: QueryToken,
        uri: &Uri,
        conn: &ConnInfo,
        headers: &HeaderMap,
        user: &UserId,
        scope: &CookieScope<'_>,
        navigation: bool,
    ) -> Response<ProxyBody> {
        match self.auth.redeem_hop(&q.token).await {
            Ok(Some(redeemed)) if &redeemed.user == user => cookie_and_redirect(
                &redeemed.token,
                uri,
                &q.rest,
                is_https(headers, conn),
                scope,
            ),
            Ok(Some(_)) => respond::forbidden(navigation),
            Ok(None) => respond::unauthorized_because(
                navigation,
                "This sign-in link was already used or has expired. Sign in again.",
            ),
            Err(e) => store_unavailable(&e),
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn exchange_query_token(
        &self,
        q: QueryToken,
        uri: &Uri,
        conn: &ConnInfo,
        headers: &HeaderMap,
        user: &UserId,
        scope: &CookieScope<'_>,
        navigation: bool,
    ) -> Response<ProxyBody> {
        match self.auth.access(&q.token, user).await {
            Ok(Access::Allowed) => {}
            Ok(Access::Admin) => {
                return respond::forbidden_because(
                    navigation,
                    "The admin token cannot open an app in a browser: it would become a cookie \
                     that this app's pages could use. Open a link scoped to this user instead \
                     (berth token USER).",
                );
            }
            Ok(Access::Forbidden) => return respond::forbidden(navigation),
            Ok(Access::Unauthenticated) => return respond::unauthorized(navigation),
            Err(e) => return store_unavailable(&e),
        }
        if !is_cookie_safe(&q.token) {
            return respond::code_error(
                ErrorCode::InvalidRequest,
                "this token cannot be stored in a cookie; send it as Authorization: Bearer",
            );
        }
        cookie_and_redirect(&q.token, uri, &q.rest, is_https(headers, conn), scope)
    }
}

/// Stores `token` as the user cookie of `scope` and sends the browser on
/// to the same URL without the one-shot parameter (`rest` is the query
/// without it).
fn cookie_and_redirect(
    token: &str,
    uri: &Uri,
    rest: &str,
    https: bool,
    scope: &CookieScope<'_>,
) -> Response<ProxyBody> {
    let cookie = scope.user_cookie(token, https).to_string();
    let location = same_host_location(uri.path(), rest);
    match (
        HeaderValue::try_from(location),
        HeaderValue::try_from(cookie),
    ) {
        (Ok(location), Ok(cookie)) => {
            respond::redirect(StatusCode::SEE_OTHER, location, Some(cookie))
        }
        _ => respond::code_error(ErrorCode::InvalidRequest, "cannot redirect to this URL"),
    }
}

/// The answer to a request whose node signature failed.
fn refused_node(auth: &PeerAuth, conn: &ConnInfo, refusal: &Refusal) -> Response<ProxyBody> {
    respond::body_error(&auth.answer_refusal(conn.peer.ip(), refusal))
}

fn store_unavailable(e: &AuthError) -> Response<ProxyBody> {
    tracing::warn!(error = %e, "cannot check a token");
    let mut response = respond::code_error(ErrorCode::StoreUnavailable, &e.to_string());
    respond::set_retry_after(&mut response, 1000);
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::test_support::user;
    use crate::auth::tokens::{Redeemed, TokenStore};
    use crate::auth::{TokenHash, UserTokenInfo};
    use crate::peer_auth::ClusterKey;
    use async_trait::async_trait;

    /// Test double of berth's store behind the [`TokenStore`] seam: no user
    /// tokens, and one live sign-in code, made for bob.
    struct BobsCode;

    #[async_trait]
    impl TokenStore for BobsCode {
        async fn lookup(&self, _: &str) -> Result<Option<UserTokenInfo>, AuthError> {
            Ok(None)
        }

        async fn redeem_hop(&self, hash: &str) -> Result<Option<Redeemed>, AuthError> {
            Ok(
                (hash == TokenHash::of("bobs-code").to_hex()).then(|| Redeemed {
                    user: user("bob"),
                    token: "bobs-token".into(),
                }),
            )
        }
    }

    fn gate() -> Gate {
        let auth = Authenticator::new("admin-secret", Arc::new(BobsCode));
        Gate::new(auth, AuthMode::Token, TrustedProxies::default())
    }

    fn conn() -> ConnInfo {
        ConnInfo::new(([127, 0, 0, 1], 40_000).into(), false)
    }

    /// `GET target` for `owner`'s app with `headers`, as the gate answers it.
    async fn check(
        gate: &Gate,
        target: &str,
        headers: &HeaderMap,
        owner: &str,
    ) -> Result<Pass, Response<ProxyBody>> {
        let uri: Uri = target.parse().unwrap();
        gate.check(
            &Method::GET,
            headers,
            &uri,
            &conn(),
            &user(owner),
            &CookieScope::Host,
        )
        .await
    }

    #[tokio::test]
    async fn a_sign_in_code_opens_only_the_app_of_the_user_it_was_made_for() {
        let gate = gate();
        let none = HeaderMap::new();
        let answer = check(&gate, "/?berth_hop=bobs-code", &none, "bob")
            .await
            .unwrap_err();
        assert_eq!(answer.status(), StatusCode::SEE_OTHER);
        let cookie = answer.headers()[hyper::header::SET_COOKIE]
            .to_str()
            .unwrap();
        assert!(cookie.contains("bobs-token"), "{cookie}");

        let elsewhere = check(&gate, "/?berth_hop=bobs-code", &none, "alice")
            .await
            .unwrap_err();
        assert_eq!(elsewhere.status(), StatusCode::FORBIDDEN);
        assert!(elsewhere.headers().get(hyper::header::SET_COOKIE).is_none());

        let unknown = check(&gate, "/?berth_hop=guessed", &none, "bob")
            .await
            .unwrap_err();
        assert_eq!(unknown.status(), StatusCode::UNAUTHORIZED);
    }

    #[tokio::test]
    async fn a_forwarded_request_reaches_only_the_user_it_was_signed_for() {
        let key = ClusterKey::new("a-cluster-secret-long-enough-for-tests");
        let gate = gate().with_cluster(Arc::new(PeerAuth::new(key.clone(), "node-b")));
        let signed_for = |owner: &str| {
            let mut headers = HeaderMap::new();
            let signed = key.sign_forward("node-b", "GET", "/page", owner).unwrap();
            for (name, value) in signed.headers {
                headers.insert(name, value);
            }
            headers
        };

        let pass = check(&gate, "/page", &signed_for("alice"), "alice")
            .await
            .unwrap();
        assert_eq!(pass.credential, Credential::Cluster);

        let other = check(&gate, "/page", &signed_for("bob"), "alice")
            .await
            .unwrap_err();
        assert_eq!(other.status(), StatusCode::FORBIDDEN);
    }
}
