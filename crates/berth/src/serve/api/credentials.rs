//! The routes that hand out or take back credentials: user tokens
//! (`/api/v1/users/{user}/tokens`) and the admin page's session
//! (`/api/v1/session`). Their answers are never cached.

use std::time::Duration;

use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use berth_core::{ErrorCode, UserId};

use super::super::auth::{Caller, Minted};
use super::extract::{Https, UserCall, parse_json, read_body};
use super::{ApiError, ApiResult, ApiState, AppState};
use crate::wire::{
    MintRequest, MintedToken, Revoked, Routing, SessionInfo, SessionStarted, TokenList,
};

/// Answers about credentials are never cached.
fn no_store(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// `POST /api/v1/users/{user}/tokens`: a token for `user`, its id and
/// expiry, and the link that opens the user's app with it.
pub async fn mint_token(
    UserCall { caller, user }: UserCall,
    State(state): AppState,
    Https(https): Https,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
    let body = read_body(&headers, body).await?;
    let MintRequest { ttl_s } = if body.iter().all(u8::is_ascii_whitespace) {
        MintRequest::default()
    } else {
        parse_json(&body, "token body")?
    };
    if ttl_s == Some(0) {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "ttl_s must be at least 1",
        ));
    }
    let parent = match &caller {
        Caller::Admin => None,
        // A signed-in user's own tokens live their own life, not the
        // sign-in's: they are not minted under its root.
        Caller::User { token_id, .. }
            if token_id.starts_with(crate::serve::auth::LOGIN_TOKEN_PREFIX) =>
        {
            None
        }
        Caller::User { token_id, .. } => Some(token_id.as_str()),
    };
    let ttl = ttl_s.map(Duration::from_secs);
    match state.auth.mint_user_token(&user, parent, ttl).await? {
        Minted::Token { token, record } => {
            let url = format!(
                "{}?berth_token={token}",
                state.app_url(&user, &headers, https)
            );
            let routing = if state.path_routing {
                Routing::Path
            } else {
                Routing::Host
            };
            let minted = MintedToken {
                user,
                token,
                id: record.id,
                created_at: record.created_at,
                expires_at: record.expires_at,
                parent: record.parent,
                url,
                routing,
            };
            Ok(no_store(
                (StatusCode::CREATED, axum::Json(minted)).into_response(),
            ))
        }
        Minted::TooMany { live } => Err(ApiError::new(
            ErrorCode::TooManyTokens,
            format!(
                "{user} already has {live} live tokens, the most [auth] max_tokens_per_user \
                 allows; revoke one (berth token {} --revoke ID) or wait for one to expire",
                user.as_str()
            ),
        )),
        Minted::ParentGone => Err(ApiError::new(
            ErrorCode::Unauthorized,
            "the token this request was made with has expired or been revoked",
        )),
    }
}

/// `GET /api/v1/users/{user}/tokens`: id, created, expires, last used
/// (never a secret).
pub async fn list_tokens(UserCall { user, .. }: UserCall, State(state): AppState) -> ApiResult {
    let tokens = state.store.list_tokens(&user).await?;
    Ok(no_store(
        axum::Json(TokenList { user, tokens }).into_response(),
    ))
}

/// `DELETE /api/v1/users/{user}/tokens/{id}`: deletes the token and every
/// token minted with it, then empties the token caches of this node and of
/// every other node that answers, so none accepts it from now on. A node
/// that does not answer is named; it drops the token within `[auth]
/// token_cache_s`.
pub async fn revoke_token(
    UserCall { user, .. }: UserCall,
    State(state): AppState,
    path: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult {
    let Path((_, id)) =
        path.map_err(|e| ApiError::new(ErrorCode::InvalidRequest, e.body_text()))?;
    revoke(&state, &user, &id).await.map(no_store)
}

pub(super) async fn revoke(state: &ApiState, user: &UserId, id: &str) -> ApiResult {
    let revoked = state.store.revoke_token(user, id).await?;
    if revoked.is_empty() {
        return Err(ApiError::new(
            ErrorCode::NotFound,
            format!("{user} has no token {id:?}"),
        ));
    }
    state.auth.purge_cache();
    let unreached = match &state.cluster {
        Some(cluster) => cluster.purge_token_caches().await,
        None => Vec::new(),
    };
    if !unreached.is_empty() {
        tracing::warn!(
            %user,
            nodes = ?unreached,
            "revoked a token, but could not tell every node to drop it; they will within [auth] token_cache_s"
        );
    }
    Ok(axum::Json(Revoked {
        user: user.clone(),
        revoked,
        unreached_nodes: unreached,
    })
    .into_response())
}

/// `POST /api/v1/session`: the admin page signs in with the admin token
/// (as Bearer) and gets the session cookie and its CSRF token.
pub async fn start_session(
    State(state): AppState,
    Https(https): Https,
    headers: HeaderMap,
) -> ApiResult {
    let Some(token) = berth_proxy::auth::bearer(&headers) else {
        return Err(ApiError::new(
            ErrorCode::Unauthorized,
            "sign in with the admin token as Authorization: Bearer",
        ));
    };
    if !state.auth.shared().is_admin(token) {
        return Err(ApiError::new(
            ErrorCode::Unauthorized,
            "only the admin token opens a session",
        ));
    }
    let session = state.auth.start_session(https).await?;
    let mut response = (
        StatusCode::CREATED,
        axum::Json(SessionStarted {
            csrf_token: session.csrf_token,
            expires_at: session.expires_at,
        }),
    )
        .into_response();
    if let Ok(cookie) = HeaderValue::try_from(session.cookie) {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    Ok(no_store(response))
}

/// `GET /api/v1/session`: the current session's CSRF token and expiry, for
/// an admin page that was reloaded.
pub async fn show_session(
    State(state): AppState,
    Https(https): Https,
    method: Method,
    headers: HeaderMap,
) -> ApiResult {
    let session = state.auth.session(&method, &headers).await?;
    let user = session.owner.user.as_ref();
    let info = SessionInfo {
        admin: matches!(session.caller(), Caller::Admin),
        app_url: user.map(|u| state.app_url(u, &headers, https)),
        user: user.cloned(),
        csrf_token: session.csrf_token,
        expires_at: session.expires_at,
    };
    Ok(no_store(axum::Json(info).into_response()))
}

/// `DELETE /api/v1/session`: signs out (CSRF rules apply).
pub async fn end_session(
    State(state): AppState,
    Https(https): Https,
    method: Method,
    headers: HeaderMap,
) -> ApiResult {
    let session = state.auth.session(&method, &headers).await?;
    let removal = state.auth.end_session(&session, https).await?;
    let mut response = StatusCode::NO_CONTENT.into_response();
    if let Ok(cookie) = HeaderValue::try_from(removal) {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    Ok(no_store(response))
}
