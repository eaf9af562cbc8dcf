//! The berth host's sign-in pages: `/login`, the provider's callback,
//! `/logout`, and the landing in the user's own app.
//!
//! A sign-in makes three things ([`crate::serve::login`] decides who):
//!
//! * a **root token** of the user's (id `login-…`), never given out: every
//!   app cookie of this sign-in is a token minted under it, so revoking it
//!   at logout ends them all, on every origin and node;
//! * a **session** on the berth host (`berth_session`, `SameSite=Lax`),
//!   which names the user and the root; it opens the user's home page and
//!   the API as that user (as the admin for an admin-group member, where
//!   admin sessions may exist);
//! * the **app cookie** (`berth_token`): in path mode set by the landing
//!   itself with `Path=/u/<user>/`; in host mode on the app's own host,
//!   through a one-time code (`?berth_hop=`, 60 s) that the proxy there
//!   spends for a host-only cookie.
//!
//! A signed-in browser that opens another user's app lands here again and
//! is refused (403): the landing only ever opens the session's own user's
//! app.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use berth_core::UserId;
use berth_proxy::auth::{CookieScope, HOP_QUERY, TokenHash};
use berth_proxy::respond::{html_document, html_escape};
use berth_store::SessionOwner;
use serde::Deserialize;

use super::extract::Https;
use super::{ApiState, AppState};
use crate::serve::auth::{mint_login_token, origin_matches_host, random_token};
use crate::serve::login::{CALLBACK_PATH, LOGIN_PATH, LOGOUT_PATH, LoginError};

/// How long a one-time code to an app's host lives.
const HOP_TTL: Duration = Duration::from_secs(60);

/// The sign-in routes; the API router merges them.
pub fn routes() -> Router<Arc<ApiState>> {
    Router::new()
        .route(LOGIN_PATH, get(login))
        .route(CALLBACK_PATH, get(callback))
        .route(LOGOUT_PATH, post(logout).get(signed_out_page))
}

#[derive(Debug, Default, Deserialize)]
struct LoginQuery {
    next: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct CallbackQuery {
    code: Option<String>,
    state: Option<String>,
    error: Option<String>,
    error_description: Option<String>,
}

/// Where a sign-in may end, checked before it starts: a path on the berth
/// host, or in host mode the URL of an app on a subdomain of the base
/// domain. Anything else (another site, a scheme-relative `//host`) is
/// refused, so the sign-in cannot be used to send people elsewhere.
pub fn return_target(next: &str, base_domain: Option<&str>) -> Option<String> {
    if next.chars().any(char::is_control) {
        return None;
    }
    if let Some(rest) = next.strip_prefix('/') {
        return (!rest.starts_with(['/', '\\'])).then(|| next.to_owned());
    }
    let base = base_domain?;
    let url = reqwest::Url::parse(next).ok()?;
    let host = url.host_str()?;
    let label = host.strip_suffix(base).and_then(|h| h.strip_suffix('.'))?;
    let plain = !label.is_empty() && !label.contains('.');
    (matches!(url.scheme(), "http" | "https")
        && plain
        && url.username().is_empty()
        && url.password().is_none())
    .then(|| url.to_string())
}

/// `GET /login?next=…`: with a live session, straight to the landing;
/// else to the provider.
async fn login(
    State(state): AppState,
    Https(https): Https,
    headers: HeaderMap,
    query: Result<Query<LoginQuery>, QueryRejection>,
) -> Response {
    let Some(oidc) = &state.login else {
        return page(
            StatusCode::NOT_FOUND,
            "No sign-in here",
            "This berth has no sign-in configured ([auth.oidc]).",
        );
    };
    let next = query.ok().and_then(|Query(q)| q.next);
    let target = match next {
        None => String::new(),
        Some(next) => match return_target(&next, state.host_mode_domain()) {
            Some(target) => target,
            None => {
                return page(
                    StatusCode::BAD_REQUEST,
                    "Cannot sign in",
                    "The sign-in link names a place berth does not send people to.",
                );
            }
        },
    };
    if let Ok(session) = state.auth.session(&Method::GET, &headers).await
        && let (Some(user), Some(root)) = (&session.owner.user, &session.owner.token_id)
    {
        return state.land(user, root, &target, https, &headers).await;
    }
    match oidc.begin(state.store.as_ref(), &target).await {
        Ok(url) => see_other(&url, None),
        Err(e) => login_failed(&e),
    }
}

/// `GET /login/callback?code&state`: finishes the sign-in at the provider.
async fn callback(
    State(state): AppState,
    Https(https): Https,
    headers: HeaderMap,
    query: Result<Query<CallbackQuery>, QueryRejection>,
) -> Response {
    let Some(oidc) = &state.login else {
        return page(
            StatusCode::NOT_FOUND,
            "No sign-in here",
            "No sign-in is configured.",
        );
    };
    let q = query.map(|Query(q)| q).unwrap_or_default();
    if let Some(error) = q.error {
        let mut why = error;
        if let Some(description) = q.error_description {
            why.push_str(": ");
            why.push_str(&description);
        }
        return login_failed(&LoginError::ProviderRefused(why));
    }
    let (Some(code), Some(st)) = (q.code, q.state) else {
        return login_failed(&LoginError::Malformed);
    };
    let (admitted, target) = match oidc.finish(state.store.as_ref(), &code, &st).await {
        Ok(done) => done,
        Err(e) => return login_failed(&e),
    };
    let ttl = state.auth.settings().session_ttl;
    let root = match mint_login_token(state.store.as_ref(), &admitted.user, None, ttl).await {
        Ok(Some((_, root))) => root,
        Ok(None) => return login_failed(&LoginError::ProviderBroken("no root token".into())),
        Err(e) => return login_failed(&e.into()),
    };
    let owner = SessionOwner {
        user: Some(admitted.user.clone()),
        admin: admitted.admin,
        token_id: Some(root.clone()),
    };
    let session = match state.auth.start_user_session(owner, https).await {
        Ok(session) => session,
        Err(e) => {
            return page(
                StatusCode::SERVICE_UNAVAILABLE,
                "Cannot sign in",
                &e.to_string(),
            );
        }
    };
    tracing::info!(user = %admitted.user, admin = admitted.admin, "signed in");
    let mut response = state
        .land(&admitted.user, &root, &target, https, &headers)
        .await;
    if let Ok(cookie) = HeaderValue::try_from(session.cookie) {
        response.headers_mut().append(header::SET_COOKIE, cookie);
    }
    response
}

/// `GET /logout`: where a page that signed out sends the browser. It ends
/// nothing itself (a link can point here).
async fn signed_out_page() -> Response {
    page(
        StatusCode::OK,
        "Signed out",
        &format!("You are signed out. <a href=\"{LOGIN_PATH}\">Sign in again</a>."),
    )
}

/// `POST /logout`: ends the session and every app cookie of its sign-in.
async fn logout(State(state): AppState, Https(https): Https, headers: HeaderMap) -> Response {
    // A form of the berth host's own pages; another site cannot sign the
    // user out.
    if origin_matches_host(&headers) == Some(false) {
        return page(
            StatusCode::FORBIDDEN,
            "Cannot sign out",
            "Signing out is done from berth's own pages.",
        );
    }
    let mut response = page(
        StatusCode::OK,
        "Signed out",
        &format!("You are signed out. <a href=\"{LOGIN_PATH}\">Sign in again</a>."),
    );
    if let Ok(session) = state.auth.session(&Method::GET, &headers).await {
        if let (Some(user), Some(root)) = (&session.owner.user, &session.owner.token_id)
            && let Err(e) = super::credentials::revoke(&state, user, root).await
        {
            tracing::warn!(%user, error = ?e, "signing out: could not revoke the sign-in's tokens");
        }
        match state.auth.end_session(&session, https).await {
            Ok(removal) => {
                if let Ok(cookie) = HeaderValue::try_from(removal) {
                    response.headers_mut().append(header::SET_COOKIE, cookie);
                }
            }
            Err(e) => tracing::warn!(error = %e, "signing out: could not end the session"),
        }
    }
    response
}

impl ApiState {
    /// The base domain when apps live on their own hosts.
    pub(super) fn host_mode_domain(&self) -> Option<&str> {
        self.base_domain.as_deref().filter(|_| !self.path_routing)
    }

    /// Sends signed-in `user` (sign-in root `root`) to `target` (empty:
    /// their own app), giving their app its cookie on the way.
    async fn land(
        &self,
        user: &UserId,
        root: &str,
        target: &str,
        https: bool,
        headers: &HeaderMap,
    ) -> Response {
        let target = if target.is_empty() {
            match self.host_mode_domain() {
                Some(_) => self.app_url(user, headers, https),
                None => user.base_path(),
            }
        } else {
            target.to_owned()
        };
        let not_yours = || {
            page(
                StatusCode::FORBIDDEN,
                "Not your app",
                &format!(
                    "You are signed in as <b>{}</b>, and this is another user's app. \
                     <a href=\"{}\">Open your own</a>.",
                    html_escape(user.as_str()),
                    html_escape(&user.base_path()),
                ),
            )
        };
        let ttl = self.auth.settings().session_ttl;
        if let Some(rest) = target.strip_prefix("/u/") {
            // Path mode: the app cookie is set here, on the shared host.
            let segment = rest.split(['/', '?']).next().unwrap_or_default();
            let named = berth_proxy::route::decode_segment(segment)
                .ok()
                .and_then(|s| UserId::parse(&s).ok());
            if named.as_ref() != Some(user) {
                return not_yours();
            }
            let token = match mint_login_token(self.store.as_ref(), user, Some(root), ttl).await {
                Ok(Some((token, _))) => token,
                Ok(None) => return signed_out(),
                Err(e) => return login_failed(&e.into()),
            };
            let cookie = CookieScope::Path { segment }.user_cookie(&token, https);
            return see_other(&target, Some(cookie.to_string()));
        }
        if target.starts_with('/') {
            return see_other(&target, None);
        }
        // Host mode: a one-time code carries the user to the app's host.
        let Ok(mut url) = reqwest::Url::parse(&target) else {
            return not_yours();
        };
        let label = url.host_str().and_then(|h| h.split('.').next());
        if label != Some(user.slug().as_str()) {
            return not_yours();
        }
        let Ok(code) = random_token() else {
            return page(
                StatusCode::SERVICE_UNAVAILABLE,
                "Cannot sign in",
                "no randomness",
            );
        };
        if let Err(e) = self
            .store
            .create_login_hop(&TokenHash::of(&code).to_hex(), user, root, HOP_TTL)
            .await
        {
            return login_failed(&e.into());
        }
        url.query_pairs_mut().append_pair(HOP_QUERY, &code);
        see_other(url.as_str(), None)
    }
}

fn signed_out() -> Response {
    page(
        StatusCode::UNAUTHORIZED,
        "Signed out",
        &format!("This sign-in has ended. <a href=\"{LOGIN_PATH}\">Sign in again</a>."),
    )
}

/// The page for a failed sign-in: its status says which kind of failure.
fn login_failed(e: &LoginError) -> Response {
    let status = match e {
        LoginError::ProviderDown(_) | LoginError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
        LoginError::ProviderBroken(_) => StatusCode::BAD_GATEWAY,
        LoginError::ProviderRefused(_) | LoginError::UnknownState | LoginError::Malformed => {
            StatusCode::BAD_REQUEST
        }
        LoginError::BadIdToken(_) => StatusCode::UNAUTHORIZED,
        LoginError::Refused(_) => StatusCode::FORBIDDEN,
    };
    tracing::info!(status = status.as_u16(), error = %e, "a sign-in failed");
    page(
        status,
        "Cannot sign in",
        &format!(
            "{} <a href=\"{LOGIN_PATH}\">Try again</a>.",
            html_escape(&e.to_string())
        ),
    )
}

fn page(status: StatusCode, title: &str, body_html: &str) -> Response {
    let html = html_document(
        &html_escape(title),
        &format!("<h1>{}</h1>\n<p>{body_html}</p>", html_escape(title)),
    );
    let mut response = (status, html).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

fn see_other(location: &str, cookie: Option<String>) -> Response {
    let mut response = StatusCode::SEE_OTHER.into_response();
    let headers = response.headers_mut();
    match HeaderValue::try_from(location) {
        Ok(value) => {
            headers.insert(header::LOCATION, value);
        }
        Err(_) => {
            return page(
                StatusCode::BAD_REQUEST,
                "Cannot sign in",
                "berth cannot send you to this address.",
            );
        }
    }
    if let Some(value) = cookie.and_then(|c| HeaderValue::try_from(c).ok()) {
        headers.insert(header::SET_COOKIE, value);
    }
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_ins_end_only_on_berth_or_its_apps() {
        let base = Some("berth.test");
        assert_eq!(
            return_target("/u/alice/lab", None).as_deref(),
            Some("/u/alice/lab")
        );
        assert_eq!(return_target("/", base).as_deref(), Some("/"));
        for refused in [
            "//evil.example/x",
            "/\\evil.example",
            "https://evil.example/",
            "https://alice.berth.test.evil.example/",
            "https://a.b.berth.test/",
            "https://user:pw@alice.berth.test/",
            "javascript:alert(1)",
            "https://berth.test/",
            "/u/alice/\nSet-Cookie: x",
        ] {
            assert_eq!(return_target(refused, base), None, "{refused}");
        }
        assert_eq!(
            return_target("https://alice.berth.test:8443/lab?x=1", base).as_deref(),
            Some("https://alice.berth.test:8443/lab?x=1")
        );
        assert_eq!(return_target("https://alice.berth.test/", None), None);
    }
}
