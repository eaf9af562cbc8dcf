//! Node-to-node routes (`/internal/v1/…`): what another node asks of
//! this one, on the listener of their own (`[cluster]
//! internal_listen`), signed with the cluster secret ([`authenticate`],
//! then [`PeerCall`], [`Peer`]). Each runs the use case here with
//! [`Via::Peer`]: never forwarded again, and answered with `lease_busy`
//! when another node holds the user's lease, so the caller follows it.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use berth_core::LaunchRequest;

use super::super::ops::Via;
use super::extract::{Peer, PeerCall, QueryOf, SignedByPeer, parse_json, read_body};
use super::{
    ApiError, ApiResult, ApiState, AppState, DeclaredRoutes, LaunchQuery, LogsQuery, ProgressQuery,
    holding, line_events, parse_launch_body, stage_events,
};
use crate::wire::operation as op;
use crate::wire::{Done, EgressChange, FenceRequest, Fenced, LogLines, Purged, RestartAll};
use berth_proxy::peer_auth::{PeerAuth, Refusal};

/// The node-to-node routes, each behind [`authenticate`].
pub fn routes(state: Arc<ApiState>) -> Router<Arc<ApiState>> {
    Router::new()
        .internal(&op::STATUS, status)
        .internal(&op::LAUNCH, launch)
        .internal(&op::STOP, stop)
        .internal(&op::RESTART, restart)
        .internal(&op::HIBERNATE, hibernate)
        .internal(&op::RESUME, resume)
        .internal(&op::PROBE, probe)
        .internal(&op::LOGS, logs)
        .internal(&op::WATCHDOG, watchdog)
        .internal(&op::RESET_BREAKER, reset_breaker)
        .internal(&op::SET_EGRESS, set_egress)
        .internal(&op::PROGRESS, progress)
        .internal(&op::FENCE, fence)
        .route(
            &format!("/internal/v1/{}", op::NODE_RESTART_ALL),
            post(restart_all),
        )
        .route(
            &format!("/internal/v1/{}", op::NODE_PURGE_TOKENS),
            post(purge),
        )
        .route_layer(axum::middleware::from_fn_with_state(state, authenticate))
}

/// Checks a node-to-node call's signature before its handler runs: the
/// headers first (nothing of an unsigned call's body is read), then the
/// body against its signed digest. A refusal is counted against the
/// source address: past a burst it is `429`, and refusals are logged with
/// the source at a bounded rate. A signed call is let through even from a
/// source past its limit: a signature cannot be guessed (the secret is
/// long and random, refused at start otherwise), while refusing it would
/// let any program on a node's host, which shares the node's address,
/// cut that node off from the others by failing on purpose.
pub async fn authenticate(
    State(state): AppState,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(auth) = &state.peer_auth else {
        // A single node: the routes answer 404 themselves.
        return next.run(request).await;
    };
    let conn = request
        .extensions()
        .get::<berth_proxy::forward::ConnInfo>()
        .cloned();
    let source = conn.as_ref().map(|conn| conn.peer.ip());
    let (parts, body) = request.into_parts();
    let target = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path(), |pq| pq.as_str());
    let checked = auth.check_headers(
        parts.method.as_str(),
        target,
        &parts.headers,
        berth_core::unix_millis_now(),
    );
    let signed = match checked {
        Ok(signed) => signed,
        Err(refusal) => return refuse(auth, source, &refusal),
    };
    let body = match read_body(&parts.headers, body).await {
        Ok(body) => body,
        Err(e) => return e.into_response(),
    };
    if let Err(refusal) = PeerAuth::check_body(&signed, &body) {
        return refuse(auth, source, &refusal);
    }
    if let Some(conn) = &conn {
        // Another node's connection: nodes on one host share its address
        // with each other (and with every program there).
        conn.exempt_from_address_cap();
    }
    let mut request = axum::extract::Request::from_parts(parts, Body::from(body));
    request.extensions_mut().insert(SignedByPeer);
    next.run(request).await
}

/// The answer to a refused node-to-node call, counted and maybe logged.
fn refuse(auth: &PeerAuth, source: Option<std::net::IpAddr>, refusal: &Refusal) -> Response {
    let source = source.unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
    ApiError::from(auth.answer_refusal(source, refusal)).into_response()
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
    Ok(axum::Json(Done {}).into_response())
}

async fn hibernate(PeerCall { user }: PeerCall, State(state): AppState) -> ApiResult {
    let instance = state.ops.hibernate(&user, Via::Peer).await?;
    Ok(axum::Json(instance).into_response())
}

async fn resume(PeerCall { user }: PeerCall, State(state): AppState) -> ApiResult {
    let instance = state.ops.resume(&user, Via::Peer).await?;
    Ok(axum::Json(instance).into_response())
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
    Ok(axum::Json(Done {}).into_response())
}

/// A stream relayed for another node's client. It holds resources here
/// (a subscription, a response stream, a connection) as much as on the
/// node the client reached, so it takes one of the user's stream slots
/// here too: however many nodes a user's clients come through, the node
/// that runs the user holds at most `max_upgrades_per_user` of their
/// streams. A refusal travels back with its code (`too_many_streams`).
async fn progress(
    PeerCall { user }: PeerCall,
    State(state): AppState,
    QueryOf(query): QueryOf<ProgressQuery>,
) -> ApiResult {
    let slot = state.stream_slot(&user)?;
    let stages = state
        .ops
        .progress(&user, query.next.unwrap_or(false), Via::Peer)
        .await?;
    Ok(stage_events(holding(stages, slot)).into_response())
}

/// `{"policy": …}` → the user's own egress policy (`null`: the node's),
/// recorded and applied here.
async fn set_egress(
    PeerCall { user }: PeerCall,
    State(state): AppState,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
    let EgressChange { policy } = parse_json(&read_body(&headers, body).await?, "egress change")?;
    let changed = state.ops.set_egress(&user, policy, Via::Peer).await?;
    Ok(axum::Json(changed).into_response())
}

/// `{"epoch": N}` → kills the main here only if it runs under exactly
/// epoch N (`{"fenced": bool}`).
async fn fence(
    PeerCall { user }: PeerCall,
    State(state): AppState,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
    let FenceRequest { epoch } = parse_json(&read_body(&headers, body).await?, "fence body")?;
    let fenced = state.ops.fence(&user, epoch).await?;
    Ok(axum::Json(Fenced {
        user,
        epoch,
        fenced,
    })
    .into_response())
}

/// Restarts every main this node runs (the caller asks every node).
async fn restart_all(_: Peer, State(state): AppState) -> ApiResult {
    let results = state.ops.restart_all(Via::Peer).await?;
    Ok(axum::Json(RestartAll { results }).into_response())
}

/// Another node revoked a token: forget every cached user token here.
async fn purge(_: Peer, State(state): AppState) -> Response {
    state.auth.purge_cache();
    axum::Json(Purged { purged: true }).into_response()
}
