//! Node-to-node routes (`/internal/v1/…`, design §7.3): what another node
//! asks of this one, authenticated by the cluster secret alone
//! ([`PeerCall`], [`Peer`]). Each runs the use case here with
//! [`Via::Peer`]: never forwarded again, and answered with `lease_busy`
//! when another node holds the user's lease, so the caller follows it.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use berth_core::{ErrorCode, LaunchRequest};
use serde::Deserialize;
use serde_json::json;

use super::super::ops::{LogLines, RestartAll, Via};
use super::extract::{Peer, PeerCall, QueryOf, read_body};
use super::{
    ApiError, ApiResult, ApiState, AppState, LaunchQuery, LogsQuery, holding, line_events,
    parse_launch_body, stage_events,
};

/// The node-to-node routes.
pub fn routes() -> Router<Arc<ApiState>> {
    Router::new()
        .route("/internal/v1/users/{user}/status", get(status))
        .route("/internal/v1/users/{user}/launch", post(launch))
        .route("/internal/v1/users/{user}/stop", post(stop))
        .route("/internal/v1/users/{user}/restart", post(restart))
        .route("/internal/v1/users/{user}/probe", post(probe))
        .route("/internal/v1/users/{user}/logs", get(logs))
        .route("/internal/v1/users/{user}/watchdog", post(watchdog))
        .route(
            "/internal/v1/users/{user}/breaker/reset",
            post(reset_breaker),
        )
        .route("/internal/v1/users/{user}/progress", get(progress))
        .route("/internal/v1/users/{user}/fence", post(fence))
        .route("/internal/v1/instances/restart-all", post(restart_all))
        .route("/internal/v1/tokens/purge", post(purge))
}

async fn status(PeerCall { user }: PeerCall, State(state): AppState) -> ApiResult {
    let state = state.ops.status(&user, Via::Peer).await?;
    Ok(axum::Json(state).into_response())
}

/// A launch here (waiting for ready unless `?wait=false`): the caller
/// decided this node should run it.
async fn launch(
    PeerCall { user }: PeerCall,
    State(state): AppState,
    QueryOf(query): QueryOf<LaunchQuery>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
    let request: LaunchRequest = parse_launch_body(&read_body(&headers, body).await?)?;
    let wait = query.wait.unwrap_or(true);
    let launched = state
        .ops
        .ensure_running(&user, request, wait, Via::Peer)
        .await?;
    Ok(axum::Json(launched).into_response())
}

async fn stop(PeerCall { user }: PeerCall, State(state): AppState) -> ApiResult {
    state.ops.stop(&user, Via::Peer).await?;
    Ok(axum::Json(json!({})).into_response())
}

async fn restart(PeerCall { user }: PeerCall, State(state): AppState) -> ApiResult {
    let launched = state.ops.restart(&user, Via::Peer).await?;
    Ok(axum::Json(launched).into_response())
}

async fn probe(PeerCall { user }: PeerCall, State(state): AppState) -> ApiResult {
    let report = state.ops.probe(&user, Via::Peer).await?;
    Ok(axum::Json(report).into_response())
}

async fn logs(
    PeerCall { user }: PeerCall,
    State(state): AppState,
    QueryOf(query): QueryOf<LogsQuery>,
) -> ApiResult {
    let tail = query.tail();
    if query.follow.unwrap_or(false) {
        // Counted here too: see `progress`.
        let slot = state.stream_slot(&user)?;
        let lines = state.ops.follow_logs(&user, tail, Via::Peer).await?;
        return Ok(line_events(holding(lines, slot)).into_response());
    }
    let lines = state.ops.logs(&user, tail, Via::Peer).await?;
    Ok(axum::Json(LogLines { user, lines }).into_response())
}

async fn watchdog(PeerCall { user }: PeerCall, State(state): AppState) -> ApiResult {
    let instance = state.ops.watchdog(&user, Via::Peer).await?;
    Ok((StatusCode::CREATED, axum::Json(instance)).into_response())
}

async fn reset_breaker(PeerCall { user }: PeerCall, State(state): AppState) -> ApiResult {
    state.ops.reset_breaker(&user, Via::Peer).await?;
    Ok(axum::Json(json!({})).into_response())
}

/// A stream relayed for another node's client. It holds resources here
/// (a subscription, a response stream, a connection) as much as on the
/// node the client reached, so it takes one of the user's stream slots
/// here too: however many nodes a user's clients come through, the node
/// that runs the user holds at most `max_upgrades_per_user` of their
/// streams. A refusal travels back with its code (`too_many_streams`).
async fn progress(PeerCall { user }: PeerCall, State(state): AppState) -> ApiResult {
    let slot = state.stream_slot(&user)?;
    let stages = state.ops.progress(&user, Via::Peer).await?;
    Ok(stage_events(holding(stages, slot)).into_response())
}

#[derive(Debug, Deserialize)]
struct FenceBody {
    epoch: berth_core::Epoch,
}

/// `{"epoch": N}` → kills the main here only if it runs under exactly
/// epoch N (`{"fenced": bool}`).
async fn fence(
    PeerCall { user }: PeerCall,
    State(state): AppState,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
    let body = read_body(&headers, body).await?;
    let FenceBody { epoch } = serde_json::from_slice(&body).map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidRequest,
            format!("invalid fence body: {e}"),
        )
    })?;
    let fenced = state.ops.fence(&user, epoch).await?;
    Ok(axum::Json(json!({ "user": user, "epoch": epoch, "fenced": fenced })).into_response())
}

/// Restarts every main this node runs (the caller asks every node).
async fn restart_all(_: Peer, State(state): AppState) -> ApiResult {
    let results = state.ops.restart_all(Via::Peer).await?;
    Ok(axum::Json(RestartAll { results }).into_response())
}

/// Another node revoked a token: forget every cached user token here.
async fn purge(_: Peer, State(state): AppState) -> Response {
    state.auth.purge_cache();
    axum::Json(json!({ "purged": true })).into_response()
}
