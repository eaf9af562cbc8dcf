//! The HTTP API: `/api/v1` for clients (a contract), on the
//! public listener ([`router`]), and `/internal/v1` for other nodes
//! ([`internal`]), on a listener of its own ([`internal_router`]).
//!
//! Every route is an axum route. A route about a user is declared once in
//! [`crate::wire::operation`] (its public and node-to-node paths, their
//! methods, who may call it), and its handler takes a
//! [`UserCall`](extract::UserCall) first: the caller is authenticated,
//! then the id is decoded and validated (`400 invalid_user`), then a user
//! token is held to what the declaration allows
//! ([`user_may`](crate::wire::operation::user_may)). Every success answer
//! is a type of [`crate::wire`]. Handlers do no lifecycle work
//! themselves: they call the use cases in `ops`, which run them on the
//! node that owns the user. Adding an endpoint is a declaration, a
//! handler and its answer type (ARCHITECTURE.md, "How to add …", an
//! endpoint).

mod credentials;
mod error;
pub mod events;
mod extract;
mod internal;
pub mod scrape;
mod signin;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::handler::Handler;
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, get, on, post};
use berth_core::egress::EgressPolicy;
use berth_core::{ErrorCode, InstanceStatus, LaunchRequest, SpawnError, UserId};
use berth_proxy::limits::{StreamPermit, StreamRefused};
use berth_store::{InstanceFilter, NodeStatus, Store};
use futures_util::stream::BoxStream;
use futures_util::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::Value;

pub use error::{ApiError, ApiResult};
use extract::{Admin, Https, QueryOf, UserCall, parse_json, parse_user_segment, read_body};

use super::auth::{Authenticator, Caller};
use super::cluster::{Cluster, NodeControl};
use super::metrics::Metrics;
use super::ops::{Ops, Via};
use crate::sse::{LOG_LINE_EVENT, STAGE_EVENT};
use crate::wire::operation::{self as op, Internal, Operation, Public, Verb};
use crate::wire::{
    InstanceAnswer, InstanceList, LaunchAnswer, Launched, LeaseList, LogLines, NodeChanged,
    NodeList, RestartAll, UserStatus,
};

/// What every handler shares.
pub struct ApiState {
    /// The use cases.
    pub ops: Arc<Ops>,
    pub store: Arc<dyn Store>,
    pub auth: Authenticator,
    pub metrics: Arc<Metrics>,
    /// How clients reach this node, e.g. `http://127.0.0.1:8000`.
    pub public_url: String,
    pub node_id: String,
    pub lease_ttl: Duration,
    /// Cluster mode (PostgreSQL store): token purges, the nodes' view.
    pub cluster: Option<Arc<Cluster>>,
    /// Checks node-to-node calls (`/internal/v1/…`), sharing its nonces
    /// with the proxy's check of forwarded requests; `None` on a single
    /// node, which serves no node-to-node routes.
    pub peer_auth: Option<Arc<berth_proxy::peer_auth::PeerAuth>>,
    /// This node's status (drain/undrain).
    pub node_control: Arc<dyn NodeControl>,
    /// Where users' apps live: `<slug>.<base_domain>` when set.
    pub base_domain: Option<String>,
    /// Whether `/u/<user>/` on the berth host routes to apps.
    pub path_routing: bool,
    /// The slots of the admin page's event streams (`/api/v1/events`).
    pub event_streams: events::EventStreams,
    /// Who may read `/metrics` besides the admin.
    pub scrapers: scrape::Scrapers,
    /// Long-lived streams per user and in all, shared with the proxy's
    /// WebSockets: a progress or log stream takes a slot for as long as it
    /// is open (on each node it passes through).
    pub streams: Arc<berth_proxy::limits::StreamLimits>,
    /// Sign-in through an OpenID provider (`[auth.oidc]`).
    pub login: Option<Arc<super::login::Oidc>>,
}

type AppState = State<Arc<ApiState>>;

/// The API router.
pub fn router(state: Arc<ApiState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(scrape::metrics))
        .route(
            "/api/v1/session",
            post(credentials::start_session)
                .get(credentials::show_session)
                .delete(credentials::end_session),
        )
        .public(&op::STATUS, status)
        .public(&op::LAUNCH, launch)
        .public(&op::STOP, stop)
        .public(&op::RESTART, restart)
        .public(&op::HIBERNATE, hibernate)
        .public(&op::RESUME, resume)
        .public(&op::PROBE, probe)
        .public(&op::PROGRESS, progress)
        .public(&op::LOGS, logs)
        .public(&op::WATCHDOG, watchdog)
        .public(&op::RESET_BREAKER, reset_breaker)
        .public(&op::SET_EGRESS, set_egress)
        .public(&op::CLEAR_EGRESS, clear_egress)
        .public(&op::MINT_TOKEN, credentials::mint_token)
        .public(&op::LIST_TOKENS, credentials::list_tokens)
        .public(&op::REVOKE_TOKEN, credentials::revoke_token)
        .route("/api/v1/instances", get(list_instances))
        .route("/api/v1/instances/restart-all", post(restart_all))
        .route("/api/v1/nodes", get(list_nodes))
        .route("/api/v1/leases", get(list_leases))
        .route("/api/v1/leases/{user}/takeover", post(take_over))
        .route("/api/v1/node/drain", post(drain))
        .route("/api/v1/node/undrain", post(undrain))
        .route("/api/v1/events", get(events::events))
        .merge(super::admin::routes())
        .merge(signin::routes())
        .merge(super::home::routes())
        .fallback(no_such_route)
        .method_not_allowed_fallback(no_such_route)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            error::count_errors,
        ))
        // Outermost: a form or text body is refused before anything else
        // looks at the request.
        .layer(axum::middleware::from_fn(extract::refuse_non_json_bodies))
        .with_state(state)
}

/// Routes declared in [`crate::wire::operation`]: the route of an
/// operation and its method come from its one declaration. Each takes
/// only an operation with that route, so a handler for a route an
/// operation lacks does not compile.
trait DeclaredRoutes: Sized {
    /// `operation`'s public route (`/api/v1/users/{user}/…`) to `handler`.
    fn public<I, H, T>(self, operation: &Operation<Public, I>, handler: H) -> Self
    where
        H: Handler<T, Arc<ApiState>>,
        T: 'static;
    /// `operation`'s node-to-node route (`/internal/v1/users/{user}/…`)
    /// to `handler`.
    fn internal<P, H, T>(self, operation: &Operation<P, Internal>, handler: H) -> Self
    where
        H: Handler<T, Arc<ApiState>>,
        T: 'static;
}

impl DeclaredRoutes for Router<Arc<ApiState>> {
    fn public<I, H, T>(self, operation: &Operation<Public, I>, handler: H) -> Self
    where
        H: Handler<T, Arc<ApiState>>,
        T: 'static,
    {
        let public = &operation.public;
        self.route(&public.route(), on(method_filter(public.verb), handler))
    }

    fn internal<P, H, T>(self, operation: &Operation<P, Internal>, handler: H) -> Self
    where
        H: Handler<T, Arc<ApiState>>,
        T: 'static,
    {
        let internal = &operation.internal;
        self.route(&internal.route(), on(method_filter(internal.verb), handler))
    }
}

/// Operations are declared with a [`Verb`], a closed set, so unlike a
/// `Method` each has its filter.
fn method_filter(verb: Verb) -> MethodFilter {
    match verb {
        Verb::Get => MethodFilter::GET,
        Verb::Post => MethodFilter::POST,
        Verb::Put => MethodFilter::PUT,
        Verb::Delete => MethodFilter::DELETE,
    }
}

/// The node-to-node API, alone: what the cluster's own listener serves.
/// Anything else there is 404, as `/internal/…` is on the public listener.
pub fn internal_router(state: Arc<ApiState>) -> Router {
    internal::routes(state.clone())
        .fallback(no_such_internal_route)
        .method_not_allowed_fallback(no_such_internal_route)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            error::count_errors,
        ))
        .layer(axum::middleware::from_fn(extract::refuse_non_json_bodies))
        .with_state(state)
}

async fn no_such_internal_route(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("no such node-to-node route: {method} {}", uri.path()),
    )
}

/// No route (or no such method on it). Under `/api/v1/users/`, the caller
/// is authenticated first and an unroutable user segment (an empty one)
/// gets the same `400 invalid_user` as any invalid id.
async fn no_such_route(
    State(state): AppState,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> ApiResult {
    if let Some(rest) = uri.path().strip_prefix("/api/v1/users/") {
        state.caller(&method, &headers).await?;
        parse_user_segment(rest.split('/').next().unwrap_or_default())?;
    }
    Err(ApiError::new(
        ErrorCode::NotFound,
        format!("no such route: {method} {}", uri.path()),
    ))
}

impl ApiState {
    async fn caller(&self, method: &Method, headers: &HeaderMap) -> ApiResult<Caller> {
        Ok(self.auth.caller(method, headers).await?)
    }

    /// One of this node's slots for a long-lived stream of `user`'s (one
    /// user's streams cannot starve the others): `429
    /// too_many_streams` at the user's cap, `503 capacity_exhausted` when
    /// the node is full. The stream that holds it gives it back when it
    /// ends or its client leaves ([`holding`]).
    fn stream_slot(&self, user: &UserId) -> ApiResult<StreamPermit> {
        self.streams.acquire(user).map_err(|refused| {
            let message = refused.to_string();
            let error = match refused {
                StreamRefused::Total(_) => SpawnError::CapacityExhausted(message),
                StreamRefused::PerUser { .. } => SpawnError::TooManyStreams(message),
            };
            error.into()
        })
    }

    /// Where `user`'s app is opened: `<slug>.<base_domain>` on the port
    /// the client used to reach this API, or, with path routing, the base
    /// path on this node's public URL.
    fn app_url(&self, user: &UserId, headers: &HeaderMap, https: bool) -> String {
        match &self.base_domain {
            Some(base) if !self.path_routing => {
                let scheme = if https || self.public_url.starts_with("https://") {
                    "https"
                } else {
                    "http"
                };
                let port = headers
                    .get(header::HOST)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|h| h.rsplit_once(':'))
                    .map(|(_, port)| port)
                    .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
                let port = port.map(|p| format!(":{p}")).unwrap_or_default();
                format!("{scheme}://{}.{base}{port}/", user.slug())
            }
            _ => format!(
                "{}{}",
                self.public_url.trim_end_matches('/'),
                user.base_path()
            ),
        }
    }

    /// The [`LaunchAnswer`] of a launch or restart (201 for a new
    /// instance): with the URL of the user's app.
    fn launched(
        &self,
        user: &UserId,
        launched: Launched,
        headers: &HeaderMap,
        https: bool,
    ) -> Response {
        let url = self.app_url(user, headers, https);
        let status = if launched.created {
            StatusCode::CREATED
        } else {
            StatusCode::OK
        };
        let answer = LaunchAnswer {
            instance: launched.instance,
            url,
            sign_in: self.login.is_some(),
        };
        (status, axum::Json(answer)).into_response()
    }
}

// --- one user ------------------------------------------------------------------

#[derive(Debug, Default, Deserialize)]
struct LaunchQuery {
    wait: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
struct ProgressQuery {
    next: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
struct LogsQuery {
    tail: Option<usize>,
    follow: Option<bool>,
}

impl LogsQuery {
    fn tail(&self) -> usize {
        self.tail.unwrap_or(100)
    }
}

/// `GET …/instance`: `{user, main, watchdog, breaker}`, as the node that
/// runs the user knows them.
async fn status(UserCall { user, .. }: UserCall, State(state): AppState) -> ApiResult {
    let state = state.ops.status(&user, Via::Client).await?;
    Ok(axum::Json(UserStatus {
        user,
        main: state.main,
        watchdog: state.watchdog,
        breaker: state.breaker,
        idle_action: state.idle_action,
        egress: state.egress,
    })
    .into_response())
}

/// `POST …/instance`: ensure running, where the lease and placement say;
/// 201 new, 200 existing; waits for ready unless `?wait=false`.
async fn launch(
    UserCall { caller, user }: UserCall,
    State(state): AppState,
    Https(https): Https,
    QueryOf(query): QueryOf<LaunchQuery>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
    let request = parse_launch_body(&read_body(&headers, body).await?)?;
    if matches!(caller, Caller::User { .. }) && !state.auth.settings().users_may_patch {
        let asks = [
            ("patch", request.patch.is_some()),
            (
                "folder",
                request.folder.as_deref().is_some_and(|f| !f.is_empty()),
            ),
            ("force", request.force),
        ];
        if let Some((what, _)) = asks.iter().find(|(_, asked)| *asked) {
            return Err(ApiError::new(
                ErrorCode::Forbidden,
                format!(
                    "a user token launches with the configured defaults: {what} is for the \
                     admin ([auth] users_may_patch = false)"
                ),
            ));
        }
    }
    let wait = query.wait.unwrap_or(true);
    let launched = state
        .ops
        .ensure_running(&user, request, wait, Via::Client)
        .await?;
    Ok(state.launched(&user, launched, &headers, https))
}

/// `DELETE …/instance`: stops the user on the node that runs them; 204 once
/// the process is gone.
async fn stop(UserCall { user, .. }: UserCall, State(state): AppState) -> ApiResult {
    state.ops.stop(&user, Via::Client).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `POST …/instance/hibernate`: freezes the running instance with its
/// memory intact (after its `pre_hibernate` hook); `{instance}`.
async fn hibernate(UserCall { user, .. }: UserCall, State(state): AppState) -> ApiResult {
    let instance = state.ops.hibernate(&user, Via::Client).await?;
    Ok(axum::Json(InstanceAnswer { instance }).into_response())
}

/// `POST …/instance/resume`: thaws a hibernated instance; `{instance}`.
async fn resume(UserCall { user, .. }: UserCall, State(state): AppState) -> ApiResult {
    let instance = state.ops.resume(&user, Via::Client).await?;
    Ok(axum::Json(InstanceAnswer { instance }).into_response())
}

/// `POST …/instance/restart`: a new process, ready.
async fn restart(
    UserCall { user, .. }: UserCall,
    State(state): AppState,
    Https(https): Https,
    headers: HeaderMap,
) -> ApiResult {
    let launched = state.ops.restart(&user, Via::Client).await?;
    Ok(state.launched(&user, launched, &headers, https))
}

/// `POST …/instance/probe`: `{ok, reason}`.
async fn probe(UserCall { user, .. }: UserCall, State(state): AppState) -> ApiResult {
    let report = state.ops.probe(&user, Via::Client).await?;
    Ok(axum::Json(report).into_response())
}

/// `GET …/instance/progress[?next=true]`: Server-Sent Events (`status`,
/// each with its `stage`) from the current stage until the instance is
/// ready or has ended; with `next`, a stream that finds no spawn under way
/// waits for the next. The stream holds one of the user's stream slots
/// while it is open.
async fn progress(
    UserCall { user, .. }: UserCall,
    State(state): AppState,
    QueryOf(query): QueryOf<ProgressQuery>,
) -> ApiResult {
    let slot = state.stream_slot(&user)?;
    let stages = state
        .ops
        .progress(&user, query.next.unwrap_or(false), Via::Client)
        .await?;
    Ok(stage_events(holding(stages, slot)).into_response())
}

/// `GET …/instance/logs?tail=N`: the last N lines (`{user, lines}`); with
/// `&follow=true`, Server-Sent Events (`line`, each a JSON string): those
/// lines, then every new one until the client leaves.
async fn logs(
    UserCall { user, .. }: UserCall,
    State(state): AppState,
    QueryOf(query): QueryOf<LogsQuery>,
) -> ApiResult {
    if query.follow.unwrap_or(false) {
        // A followed log is a long-lived stream like progress: it holds
        // one of the user's stream slots.
        let slot = state.stream_slot(&user)?;
        let lines = state
            .ops
            .follow_logs(&user, query.tail(), Via::Client)
            .await?;
        return Ok(line_events(holding(lines, slot)).into_response());
    }
    let lines = state.ops.logs(&user, query.tail(), Via::Client).await?;
    Ok(axum::Json(LogLines { user, lines }).into_response())
}

/// `POST …/watchdog`: 201 with the watchdog's record.
async fn watchdog(UserCall { user, .. }: UserCall, State(state): AppState) -> ApiResult {
    let instance = state.ops.watchdog(&user, Via::Client).await?;
    Ok((StatusCode::CREATED, axum::Json(instance)).into_response())
}

/// `POST …/breaker/reset`: 204.
async fn reset_breaker(UserCall { user, .. }: UserCall, State(state): AppState) -> ApiResult {
    state.ops.reset_breaker(&user, Via::Client).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `PUT …/egress` with an egress policy (`{"mode": …, "allow": […]}`):
/// the user's own from their instances' next connection on, wherever
/// they run; 200 with the policy they now have.
async fn set_egress(
    UserCall { user, .. }: UserCall,
    State(state): AppState,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
    let policy: EgressPolicy = parse_json(&read_body(&headers, body).await?, "egress policy")?;
    let changed = state
        .ops
        .set_egress(&user, Some(policy), Via::Client)
        .await?;
    Ok(axum::Json(changed).into_response())
}

/// `DELETE …/egress`: the node's egress policy again; 200 with it.
async fn clear_egress(UserCall { user, .. }: UserCall, State(state): AppState) -> ApiResult {
    let changed = state.ops.set_egress(&user, None, Via::Client).await?;
    Ok(axum::Json(changed).into_response())
}

/// `stream`, holding `slot` until the stream is dropped: it ended, or
/// its client left.
fn holding<T: Send + 'static>(
    stream: BoxStream<'static, T>,
    slot: StreamPermit,
) -> BoxStream<'static, T> {
    stream
        .map(move |item| {
            let _held = &slot;
            item
        })
        .boxed()
}

/// Stages as Server-Sent Events (`event: status`).
fn stage_events(
    stages: BoxStream<'static, Value>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let events =
        stages.map(|stage| Ok(Event::default().event(STAGE_EVENT).data(stage.to_string())));
    Sse::new(events).keep_alive(KeepAlive::default())
}

/// Log lines as Server-Sent Events (`event: line`, the line as a JSON
/// string, so any byte of it survives the `data:` field).
fn line_events(
    lines: BoxStream<'static, String>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let events = lines.map(|line| {
        Ok(Event::default()
            .event(LOG_LINE_EVENT)
            .data(Value::String(line).to_string()))
    });
    Sse::new(events).keep_alive(KeepAlive::default())
}

fn parse_launch_body(body: &[u8]) -> ApiResult<LaunchRequest> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(LaunchRequest::default());
    }
    parse_json(body, "launch body")
}

// --- the admin's ------------------------------------------------------------------

#[derive(Debug, Default, Deserialize)]
struct InstancesQuery {
    status: Option<String>,
    node: Option<String>,
}

async fn list_instances(
    _: Admin,
    State(state): AppState,
    QueryOf(q): QueryOf<InstancesQuery>,
) -> ApiResult {
    let status = match q.status.as_deref() {
        None | Some("") => None,
        Some(s) => Some(
            s.parse::<InstanceStatus>()
                .map_err(|e| ApiError::new(ErrorCode::InvalidRequest, e))?,
        ),
    };
    let filter = InstanceFilter {
        status,
        node: q.node.filter(|n| !n.is_empty()),
        role: None,
    };
    let instances = state.store.list_instances(&filter).await?;
    let large = instances.len() >= super::heap::LARGE_LISTING;
    let answer = axum::Json(InstanceList { instances }).into_response();
    if large {
        // The records are freed by now; the answer is one block, which
        // glibc gives back by itself when it is freed.
        super::heap::give_back_freed().await;
    }
    Ok(answer)
}

/// `POST /api/v1/instances/restart-all`: every running main of the
/// cluster, `{results: [{user, node, ok, error?}]}`.
async fn restart_all(_: Admin, State(state): AppState) -> ApiResult {
    let results = state.ops.restart_all(Via::Client).await?;
    Ok(axum::Json(RestartAll { results }).into_response())
}

async fn list_nodes(_: Admin, State(state): AppState) -> ApiResult {
    let nodes = state.store.list_nodes().await?;
    Ok(axum::Json(NodeList { nodes }).into_response())
}

#[derive(Debug, Default, Deserialize)]
struct LeasesQuery {
    expired: Option<bool>,
}

async fn list_leases(
    _: Admin,
    State(state): AppState,
    QueryOf(q): QueryOf<LeasesQuery>,
) -> ApiResult {
    // Liveness is judged by the lease TTL, the window an evidence claim uses.
    let leases = state
        .store
        .list_leases(q.expired.unwrap_or(false), state.lease_ttl)
        .await?;
    Ok(axum::Json(LeaseList { leases }).into_response())
}

/// `POST /api/v1/leases/{user}/takeover`: an operator moves an expired
/// lease to this node and starts the user here. Admin only (a user token
/// may not: see `user_may`).
async fn take_over(
    UserCall { user, .. }: UserCall,
    State(state): AppState,
    Https(https): Https,
    headers: HeaderMap,
) -> ApiResult {
    let launched = state.ops.take_over(&user).await?;
    Ok(state.launched(
        &user,
        Launched {
            created: false,
            ..launched
        },
        &headers,
        https,
    ))
}

/// `POST /api/v1/node/drain`: this node takes no new instances (it keeps
/// what it runs). Heartbeats at once so placement elsewhere sees it.
async fn drain(_: Admin, State(state): AppState) -> ApiResult {
    set_draining(&state, true).await
}

/// `POST /api/v1/node/undrain`: this node takes new instances again.
async fn undrain(_: Admin, State(state): AppState) -> ApiResult {
    set_draining(&state, false).await
}

async fn set_draining(state: &ApiState, draining: bool) -> ApiResult {
    state.node_control.set_draining(draining);
    state.node_control.heartbeat_now().await?;
    if let Some(cluster) = &state.cluster {
        cluster.invalidate_nodes();
    }
    let (status, word) = if draining {
        (NodeStatus::Draining, "draining")
    } else {
        (NodeStatus::Up, "up")
    };
    tracing::info!(node = %state.node_id, status = word, "node status changed");
    Ok(axum::Json(NodeChanged {
        node: state.node_id.clone(),
        status,
    })
    .into_response())
}
