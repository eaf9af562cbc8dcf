//! What a handler learns about its request before it runs: who calls
//! ([`UserCall`], [`Admin`], [`PeerCall`], [`Peer`]), for which user, over
//! which scheme ([`Https`]), with which query ([`QueryOf`]); and the body,
//! read only once the caller is known ([`read_body`]).
//!
//! Extractors run in the order of the handler's arguments, so every
//! handler takes its caller first: an unauthenticated client learns
//! nothing about which ids are valid, and no body is read for it.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, MatchedPath, Query};
use axum::http::request::Parts;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use berth_core::{ErrorCode, SpawnError, UserId};
use serde::de::DeserializeOwned;

use super::super::auth::Caller;
use super::{ApiError, ApiState};
use crate::wire::operation::user_may;

/// Request bodies larger than this are refused while they are read. It
/// sits above the patch limit so that an oversized patch gets the precise
/// `payload_too_large` message from the spawner.
const MAX_BODY_BYTES: usize = 1024 * 1024;

/// An authenticated call about one user: the caller, allowed to do this
/// to this user, and the user id of the path (`{user}`), validated. An
/// invalid id is `400 invalid_user`; a user token acting on another user,
/// or on something [`user_may`] does not grant (the route's declaration in
/// [`crate::wire::operation`]), is `403 forbidden`.
#[derive(Debug)]
pub struct UserCall {
    pub caller: Caller,
    pub user: UserId,
}

impl FromRequestParts<Arc<ApiState>> for UserCall {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<ApiState>,
    ) -> Result<Self, ApiError> {
        let caller = state.caller(&parts.method, &parts.headers).await?;
        let (user, action) = path_user(parts)?;
        if let Caller::User { user: own, .. } = &caller {
            let users_may_patch = state.auth.settings().users_may_patch;
            if own != &user || !user_may(&parts.method, &action, users_may_patch) {
                return Err(ApiError::forbidden());
            }
        }
        Ok(Self { caller, user })
    }
}

/// The admin, and only the admin.
#[derive(Debug)]
pub struct Admin;

impl FromRequestParts<Arc<ApiState>> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<ApiState>,
    ) -> Result<Self, ApiError> {
        match state.caller(&parts.method, &parts.headers).await? {
            Caller::Admin => Ok(Admin),
            Caller::User { .. } => Err(ApiError::forbidden()),
        }
    }
}

/// Another node of the cluster: a call whose signature
/// [`super::internal::authenticate`] checked (admin and user tokens do not
/// open node-to-node routes). On a single node these routes do not exist
/// (404).
#[derive(Debug)]
pub struct Peer;

/// Marks a request whose node signature, body included, was checked.
#[derive(Debug, Clone, Copy)]
pub struct SignedByPeer;

impl FromRequestParts<Arc<ApiState>> for Peer {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<ApiState>,
    ) -> Result<Self, ApiError> {
        if state.peer_auth.is_none() {
            return Err(ApiError::new(
                ErrorCode::NotFound,
                "node-to-node routes exist only in cluster mode",
            ));
        }
        // Only the layer over the node-to-node routes sets it; a route
        // left outside that layer refuses everyone.
        if parts.extensions.get::<SignedByPeer>().is_none() {
            return Err(ApiError::new(
                ErrorCode::Unauthorized,
                "node-to-node calls must be signed with the cluster secret",
            ));
        }
        Ok(Peer)
    }
}

/// Another node's call about one user.
#[derive(Debug)]
pub struct PeerCall {
    pub user: UserId,
}

impl FromRequestParts<Arc<ApiState>> for PeerCall {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<ApiState>,
    ) -> Result<Self, ApiError> {
        Peer::from_request_parts(parts, state).await?;
        let (user, _) = path_user(parts)?;
        Ok(Self { user })
    }
}

/// Whether the client reached berth over https (a trusted proxy says so).
#[derive(Debug, Clone, Copy)]
pub struct Https(pub bool);

impl<S: Sync> FromRequestParts<S> for Https {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Https(
            parts
                .extensions
                .get::<berth_proxy::forward::ConnInfo>()
                .is_some_and(|conn| berth_proxy::auth::is_https(&parts.headers, conn)),
        ))
    }
}

/// The query string as `T`; a malformed one is `400 invalid_request`.
#[derive(Debug)]
pub struct QueryOf<T>(pub T);

impl<T: DeserializeOwned, S: Sync> FromRequestParts<S> for QueryOf<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        Query::<T>::try_from_uri(&parts.uri)
            .map(|Query(q)| QueryOf(q))
            .map_err(|e| ApiError::new(ErrorCode::InvalidRequest, e.body_text()))
    }
}

/// The user of the path and the route's action after it: the raw
/// `{user}` segment (found by the route's declared pattern) decoded with
/// the proxy's strict rules.
fn path_user(parts: &Parts) -> Result<(UserId, String), ApiError> {
    let pattern = parts
        .extensions
        .get::<MatchedPath>()
        .map(MatchedPath::as_str)
        .unwrap_or_default();
    let segments: Vec<&str> = pattern.split('/').collect();
    let Some(at) = segments.iter().position(|s| *s == "{user}") else {
        return Err(ApiError::new(
            ErrorCode::Internal,
            format!("route {pattern:?} names no user"),
        ));
    };
    let raw = parts.uri.path().split('/').nth(at).unwrap_or_default();
    let user = parse_user_segment(raw)?;
    Ok((user, segments[at + 1..].join("/")))
}

/// Percent-decodes (with the proxy's strict rules, so both accept the same
/// segments) and validates the user segment of a path.
pub fn parse_user_segment(raw: &str) -> Result<UserId, ApiError> {
    let decoded = berth_proxy::route::decode_segment(raw).map_err(|e| match e {
        berth_proxy::route::RouteError::InvalidUser(why) => {
            ApiError::new(ErrorCode::InvalidUser, format!("invalid user id: {why}"))
        }
        other => ApiError::new(ErrorCode::InvalidUser, format!("invalid user id: {other}")),
    })?;
    UserId::parse(&decoded).map_err(|e| SpawnError::from(e).into())
}

/// A JSON request body read as `T`; `400 invalid_request` naming `what`
/// and why when it is not one.
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::new(ErrorCode::InvalidRequest, format!("invalid {what}: {e}")))
}

/// Reads a request body of at most [`MAX_BODY_BYTES`]. Handlers call it
/// after their caller extractor, so only an authenticated caller's body
/// is ever read. The server paces the API's bodies (`[proxy]
/// body_min_bytes_per_s`, `body_grace_ms`): one that falls behind is `408
/// request_timeout`, and the connection closes with the answer (the rest
/// of the body is never read).
pub async fn read_body(headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!("the request body exceeds {MAX_BODY_BYTES} bytes"),
        )
    };
    // A declared length over the limit is refused without reading a byte.
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return Err(too_large());
    }
    axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|e| {
            let e = e.into_inner();
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                too_large()
            } else if berth_proxy::BodyTooSlow::caused(e.as_ref()) {
                ApiError::new(ErrorCode::RequestTimeout, e.to_string())
            } else {
                ApiError::new(
                    ErrorCode::InvalidRequest,
                    format!("cannot read the request body: {e}"),
                )
            }
        })
}

/// 415 for any request whose body is declared as something other than
/// JSON. Form and text bodies are what a page on another site can send
/// without asking the browser for permission (no CORS preflight), so no
/// endpoint takes them. A request without `Content-Type` is read as JSON.
pub async fn refuse_non_json_bodies(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    // Signing out is a plain form of berth's own pages, with no body to
    // read, and refused from other origins by its handler.
    if request.uri().path() == crate::serve::login::LOGOUT_PATH {
        return next.run(request).await;
    }
    if let Some(value) = request.headers().get(header::CONTENT_TYPE) {
        let text = value.to_str().unwrap_or_default();
        let mime = text
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        let json = mime == "application/json"
            || (mime.starts_with("application/") && mime.ends_with("+json"));
        if !json {
            return ApiError::new(
                ErrorCode::UnsupportedMediaType,
                format!("the API takes JSON bodies (Content-Type: application/json), not {mime:?}"),
            )
            .into_response();
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Method;

    #[test]
    fn user_segments_are_decoded_and_validated() {
        assert_eq!(parse_user_segment("alice").unwrap().as_str(), "alice");
        assert_eq!(parse_user_segment("a%40b.c").unwrap().as_str(), "a@b.c");
        for bad in [
            "", "%2E%2E", "..", "a%00b", "a%0Ab", "a%2Fb", "%zz", "a%4", "%FF",
        ] {
            let err = parse_user_segment(bad).unwrap_err();
            assert_eq!(err.code, ErrorCode::InvalidUser, "{bad:?}");
        }
    }

    #[test]
    fn what_a_user_token_may_do() {
        let cases = [
            (Method::GET, "instance", false, true),
            (Method::POST, "instance", false, true),
            (Method::DELETE, "instance", false, true),
            (Method::GET, "instance/logs", false, true),
            (Method::GET, "instance/progress", false, true),
            (Method::GET, "tokens", false, true),
            (Method::POST, "tokens", false, true),
            (Method::DELETE, "tokens/{id}", false, true),
            (Method::POST, "instance/restart", false, true),
            (Method::POST, "instance/hibernate", false, true),
            (Method::POST, "instance/resume", false, true),
            (Method::POST, "instance/probe", true, false),
            (Method::POST, "watchdog", true, false),
            (Method::POST, "breaker/reset", false, false),
            (Method::POST, "breaker/reset", true, true),
            (Method::POST, "takeover", true, false),
        ];
        for (method, action, may_patch, want) in cases {
            assert_eq!(
                user_may(&method, action, may_patch),
                want,
                "{method} {action} (users_may_patch = {may_patch})"
            );
        }
    }
}
