//! The HTTP API under `/api/v1` (design §8.4, a contract).
//!
//! User routes are parsed from the raw path rather than by the router's
//! extractor, so that every malformed user id — empty, `..`, a `%00`, an
//! invalid percent-encoding — gets the same `400 invalid_user` instead of a
//! bare 404.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use berth_core::{
    ErrorCode, Instance, InstanceEvent, InstanceStatus, LaunchRequest, SpawnError, Spawner, UserId,
    unix_millis_now,
};
use berth_store::{InstanceFilter, Store};
use futures_util::stream::{self, Stream};
use serde::Deserialize;
use serde_json::{Value, json};

use super::auth::{Authenticator, Caller};
use super::cluster::{Cluster, Decision, NodeControl};
use super::metrics::{ApiLabels, Metrics};
use super::peer::PeerAnswer;

/// Request bodies larger than this are refused before parsing. It sits
/// above the patch limit so that an oversized patch gets the precise
/// `payload_too_large` message from the spawner.
const MAX_BODY_BYTES: usize = 1024 * 1024;

/// What every handler shares.
pub struct ApiState {
    pub spawner: Arc<dyn Spawner>,
    pub store: Arc<dyn Store>,
    pub auth: Authenticator,
    pub metrics: Arc<Metrics>,
    /// How clients reach this node, e.g. `http://127.0.0.1:8000`.
    pub public_url: String,
    pub node_id: String,
    pub ready_timeout: Duration,
    pub lease_ttl: Duration,
    /// Cluster mode (PostgreSQL store): routing, remote launches, fencing.
    pub cluster: Option<Arc<Cluster>>,
    /// Authenticates node-to-node calls (`/internal/v1/…`); `None` on a
    /// single node, where those routes do not exist.
    pub cluster_secret: Option<berth_proxy::auth::ClusterSecret>,
    /// This node's status (drain/undrain).
    pub node_control: Arc<dyn NodeControl>,
    /// Long-lived streams per user and in all, shared with the proxy's
    /// WebSockets: a progress stream takes a slot for as long as it is open.
    pub streams: Arc<berth_proxy::limits::StreamLimits>,
}

type AppState = State<Arc<ApiState>>;

/// The API router.
pub fn router(state: Arc<ApiState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .route("/api/v1/users/{*rest}", axum::routing::any(user_route))
        .route("/api/v1/instances", get(list_instances))
        .route("/api/v1/instances/restart-all", post(restart_all))
        .route("/api/v1/nodes", get(list_nodes))
        .route("/api/v1/leases", get(list_leases))
        .route("/api/v1/leases/{*rest}", post(take_over))
        .route("/api/v1/node/drain", post(drain))
        .route("/api/v1/node/undrain", post(undrain))
        // Node-to-node calls: only the cluster secret opens them, never an
        // admin or user token.
        .route("/internal/v1/users/{*rest}", post(internal_route))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// An error answered as `{"error": code, "message": …, …}`.
#[derive(Debug)]
pub struct ApiError {
    code: ErrorCode,
    message: String,
    extra: Vec<(&'static str, Value)>,
    retry_after_ms: Option<u64>,
}

impl ApiError {
    fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            extra: Vec::new(),
            retry_after_ms: None,
        }
    }

    fn unauthorized() -> Self {
        Self::new(
            ErrorCode::Unauthorized,
            "a valid token is required (Authorization: Bearer <token>, or the berth_token cookie)",
        )
    }

    fn forbidden() -> Self {
        Self::new(ErrorCode::Forbidden, "this token may not do that")
    }
}

impl From<SpawnError> for ApiError {
    fn from(e: SpawnError) -> Self {
        let retry_after_ms = e.retry_after_ms(unix_millis_now());
        let mut err = ApiError::new(e.code(), e.to_string());
        err.retry_after_ms = retry_after_ms;
        match &e {
            SpawnError::CircuitOpen { opens, .. } => {
                err.extra.push(("opens", json!(opens)));
                err.extra.push(("retry_after_ms", json!(retry_after_ms)));
            }
            SpawnError::Starting { retry_after_ms, .. } => {
                err.extra.push(("retry_after_ms", json!(retry_after_ms)));
            }
            SpawnError::LeaseBusy {
                holder, expired, ..
            } => {
                err.extra.push(("holder", json!(holder)));
                err.extra.push(("expired", json!(expired)));
            }
            _ => {}
        }
        err
    }
}

impl From<berth_store::StoreError> for ApiError {
    fn from(e: berth_store::StoreError) -> Self {
        SpawnError::from(e).into()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = serde_json::Map::new();
        body.insert("error".into(), json!(self.code.as_str()));
        body.insert("message".into(), json!(self.message));
        for (k, v) in self.extra {
            body.insert(k.into(), v);
        }
        let status = StatusCode::from_u16(self.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, axum::Json(Value::Object(body))).into_response();
        if let Some(ms) = self.retry_after_ms {
            let secs = ms.div_ceil(1000).max(1);
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        if self.code == ErrorCode::Unauthorized {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

type ApiResult<T = Response> = Result<T, ApiError>;

impl ApiState {
    async fn caller(&self, headers: &HeaderMap) -> ApiResult<Caller> {
        self.auth
            .identify(headers)
            .await?
            .ok_or_else(ApiError::unauthorized)
    }

    async fn require_admin(&self, headers: &HeaderMap) -> ApiResult<()> {
        match self.caller(headers).await? {
            Caller::Admin => Ok(()),
            Caller::User(_) => Err(ApiError::forbidden()),
        }
    }

    /// The URL a user opens: their base path, carrying the launch token.
    fn open_url(&self, user: &UserId) -> String {
        let base = format!(
            "{}{}",
            self.public_url.trim_end_matches('/'),
            user.base_path()
        );
        match self.spawner.launch_token(user) {
            Some(token) => format!("{base}?token={token}"),
            None => base,
        }
    }

    fn count_error(&self, code: ErrorCode) {
        self.metrics
            .api_errors
            .get_or_create(&ApiLabels {
                code: code.as_str().to_owned(),
            })
            .inc();
    }
}

async fn metrics(State(state): AppState, headers: HeaderMap) -> ApiResult {
    state.require_admin(&headers).await?;
    let text = state
        .metrics
        .encode()
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

#[derive(Debug, Default, Deserialize)]
struct UserQuery {
    wait: Option<bool>,
    tail: Option<usize>,
}

/// Dispatches `/api/v1/users/<user>/<action>`. The caller is
/// authenticated before a byte of the body is read (design §8.2): an
/// anonymous client cannot make berth buffer anything.
async fn user_route(State(state): AppState, req: axum::extract::Request) -> Response {
    let (parts, body) = req.into_parts();
    let result = match Query::<UserQuery>::try_from_uri(&parts.uri) {
        Ok(Query(query)) => match state.caller(&parts.headers).await {
            Ok(caller) => match read_body(body).await {
                Ok(body) => {
                    dispatch_user_route(&state, caller, parts.method, &parts.uri, query, body).await
                }
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        },
        Err(e) => Err(ApiError::new(ErrorCode::InvalidRequest, e.body_text())),
    };
    match result {
        Ok(response) => response,
        Err(err) => {
            state.count_error(err.code);
            err.into_response()
        }
    }
}

/// Reads a request body of at most [`MAX_BODY_BYTES`].
async fn read_body(body: axum::body::Body) -> ApiResult<Bytes> {
    axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|e| {
            let cause = std::error::Error::source(&e);
            if cause.is_some_and(|c| c.is::<http_body_util::LengthLimitError>()) {
                ApiError::new(
                    ErrorCode::PayloadTooLarge,
                    format!("the request body is larger than {MAX_BODY_BYTES} bytes"),
                )
            } else if cause.is_some_and(berth_proxy::BodyTooSlow::caused) {
                ApiError::new(ErrorCode::RequestTimeout, e.to_string())
            } else {
                ApiError::new(
                    ErrorCode::InvalidRequest,
                    format!("cannot read the body: {e}"),
                )
            }
        })
}

async fn dispatch_user_route(
    state: &Arc<ApiState>,
    caller: Caller,
    method: Method,
    uri: &Uri,
    query: UserQuery,
    body: Bytes,
) -> ApiResult {
    let rest = uri
        .path()
        .strip_prefix("/api/v1/users/")
        .unwrap_or_default();
    let (raw_user, action) = rest.split_once('/').unwrap_or((rest, ""));
    // The caller was authenticated before validating input, so
    // unauthenticated callers learn nothing about which ids exist or are
    // valid.
    let user = parse_user_segment(raw_user)?;
    let self_service = matches!(
        (&method, action),
        (&Method::GET, "instance")
            | (&Method::POST, "instance")
            | (&Method::GET, "instance/progress")
            | (&Method::POST, "tokens")
    );
    let allowed = match &caller {
        Caller::Admin => true,
        Caller::User(_) => self_service && caller.may_act_for(&user),
    };
    if !allowed {
        return Err(ApiError::forbidden());
    }
    let spawner = &state.spawner;
    match (method, action) {
        (Method::GET, "instance") => {
            let status = spawner.status(&user).await?;
            let breaker = spawner.breaker_info(&user).await?;
            Ok(axum::Json(json!({
                "user": user,
                "main": status.main,
                "watchdog": status.watchdog,
                "breaker": breaker,
            }))
            .into_response())
        }
        (Method::POST, "instance") => launch(state, &user, query.wait.unwrap_or(true), &body).await,
        (Method::DELETE, "instance") => {
            spawner.stop(&user).await?;
            Ok(StatusCode::NO_CONTENT.into_response())
        }
        (Method::POST, "instance/restart") => {
            let instance = spawner.restart_main(&user).await?;
            let instance = wait_until_ready(state, &user, instance, true).await?;
            Ok(instance_response(state, &user, StatusCode::OK, instance))
        }
        (Method::POST, "instance/probe") => {
            Ok(axum::Json(spawner.restart_and_probe(&user).await).into_response())
        }
        (Method::GET, "instance/progress") => Ok(progress(state, user).await?.into_response()),
        (Method::GET, "instance/logs") => {
            let lines = spawner.logs(&user, query.tail.unwrap_or(100)).await?;
            Ok(axum::Json(json!({ "user": user, "lines": lines })).into_response())
        }
        (Method::POST, "watchdog") => {
            let instance = spawner.spawn_watchdog(&user).await?;
            Ok((StatusCode::CREATED, axum::Json(instance)).into_response())
        }
        (Method::POST, "breaker/reset") => {
            spawner.reset_breaker(&user).await?;
            Ok(StatusCode::NO_CONTENT.into_response())
        }
        (Method::POST, "tokens") => {
            let token = state
                .auth
                .mint_user_token(&user)
                .await
                .map_err(|e| ApiError::new(ErrorCode::StoreUnavailable, format!("{e:#}")))?;
            let url = format!(
                "{}{}?berth_token={token}",
                state.public_url.trim_end_matches('/'),
                user.base_path()
            );
            Ok((
                StatusCode::CREATED,
                axum::Json(json!({ "user": user, "token": token, "url": url })),
            )
                .into_response())
        }
        (_, action) => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("no such route: {action:?}"),
        )),
    }
}

/// Percent-decodes (with the proxy's strict rules, so both accept the same
/// segments) and validates the user segment of a path.
fn parse_user_segment(raw: &str) -> ApiResult<UserId> {
    let decoded = berth_proxy::route::decode_segment(raw).map_err(|e| match e {
        berth_proxy::route::RouteError::InvalidUser(why) => {
            ApiError::new(ErrorCode::InvalidUser, format!("invalid user id: {why}"))
        }
        other => ApiError::new(ErrorCode::InvalidUser, format!("invalid user id: {other}")),
    })?;
    UserId::parse(&decoded).map_err(|e| SpawnError::from(e).into())
}

fn parse_launch_body(body: &[u8]) -> ApiResult<LaunchRequest> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(LaunchRequest::default());
    }
    serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidRequest,
            format!("invalid launch body: {e}"),
        )
    })
}

/// `POST …/instance`: on a single node a local launch; in a cluster, where
/// the lease and placement say (design §7.3).
async fn launch(state: &Arc<ApiState>, user: &UserId, wait: bool, body: &[u8]) -> ApiResult {
    let request = parse_launch_body(body)?;
    match &state.cluster {
        None => Ok(local_launch(state, user, request, wait).await?),
        Some(cluster) => cluster_launch(state, cluster, user, request, wait).await,
    }
}

/// Launches on this node: 201 new, 200 existing, waiting for ready with
/// `wait`.
async fn local_launch(
    state: &Arc<ApiState>,
    user: &UserId,
    request: LaunchRequest,
    wait: bool,
) -> Result<Response, SpawnError> {
    let (status, instance) = match state.spawner.launch(user, request).await {
        Ok(instance) => (StatusCode::CREATED, instance),
        Err(SpawnError::AlreadyRunning { .. }) => {
            let current =
                state.spawner.status(user).await?.main.ok_or_else(|| {
                    SpawnError::Internal("instance vanished during launch".into())
                })?;
            (StatusCode::OK, current)
        }
        Err(e) => return Err(e),
    };
    let instance = wait_until_ready(state, user, instance, wait).await?;
    Ok(instance_response(state, user, status, instance))
}

/// A launch through the cluster: the live lease's holder answers it (its
/// answer is passed through: same status, same body); without a live lease
/// placement chooses. A claim lost to a node that was faster is followed
/// to that node, a bounded number of times.
async fn cluster_launch(
    state: &Arc<ApiState>,
    cluster: &Cluster,
    user: &UserId,
    request: LaunchRequest,
    wait: bool,
) -> ApiResult {
    let me = cluster.node_id();
    let mut decision = cluster.decide(user).await?;
    for _ in 0..3 {
        let node = match decision {
            Decision::Local => match local_launch(state, user, request.clone(), wait).await {
                Err(SpawnError::LeaseBusy {
                    holder,
                    expired: false,
                    ..
                }) if !holder.is_empty() && holder != me => {
                    decision = Decision::Owner(holder);
                    continue;
                }
                other => return Ok(other?),
            },
            Decision::Owner(node) | Decision::Place(node) => node,
            Decision::NoCapacity => return Err(super::cluster::no_capacity().into()),
        };
        let answer = cluster.launch_on(&node, user, &request, wait).await?;
        match answer.error(user) {
            Some(SpawnError::LeaseBusy {
                holder,
                expired: false,
                ..
            }) if !holder.is_empty() && holder != node => {
                decision = if holder == me {
                    Decision::Local
                } else {
                    Decision::Owner(holder)
                };
            }
            _ => return Ok(peer_response(answer)),
        }
    }
    Err(SpawnError::Starting {
        user: user.clone(),
        retry_after_ms: 1000,
    }
    .into())
}

/// Another node's answer, passed on as it came.
fn peer_response(answer: PeerAnswer) -> Response {
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut response = (status, axum::Json(answer.body)).into_response();
    if let Some(v) = answer
        .retry_after
        .and_then(|v| HeaderValue::from_str(&v).ok())
    {
        response.headers_mut().insert(header::RETRY_AFTER, v);
    }
    response
}

/// With `wait`, waits up to `ready_timeout` for the instance to be ready.
/// A still-starting instance then gets `503 instance_starting`; one that
/// failed gets its error.
async fn wait_until_ready(
    state: &Arc<ApiState>,
    user: &UserId,
    instance: Instance,
    wait: bool,
) -> Result<Instance, SpawnError> {
    if !wait || instance.ready {
        return Ok(instance);
    }
    let current = state
        .spawner
        .wait_for_ready(user, state.ready_timeout)
        .await?
        .unwrap_or(instance);
    match current.status {
        InstanceStatus::Running if current.ready => Ok(current),
        InstanceStatus::Failed => {
            if let Some(open) = state.spawner.breaker_info(user).await? {
                return Err(SpawnError::CircuitOpen {
                    user: user.clone(),
                    opens: open.opens,
                    retry_at: open.cooldown_until,
                });
            }
            Err(SpawnError::SpawnFailed(current.last_error.unwrap_or_else(
                || "the instance failed to start".to_owned(),
            )))
        }
        InstanceStatus::Stopped => Err(SpawnError::SpawnFailed(format!(
            "the instance stopped before it was ready{}",
            current
                .last_error
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        ))),
        _ => Err(SpawnError::Starting {
            user: user.clone(),
            retry_after_ms: 2000,
        }),
    }
}

fn instance_response(
    state: &ApiState,
    user: &UserId,
    status: StatusCode,
    instance: Instance,
) -> Response {
    let url = state.open_url(user);
    (
        status,
        axum::Json(json!({ "instance": instance, "url": url })),
    )
        .into_response()
}

/// `GET …/instance/progress`: Server-Sent Events from the current status
/// until the instance is ready or has ended.
async fn progress(
    state: &Arc<ApiState>,
    user: UserId,
) -> ApiResult<Sse<impl Stream<Item = Result<Event, Infallible>> + use<>>> {
    // A slot for as long as the stream is open (the stream owns it), so
    // one user's many streams cannot starve the others.
    let permit = state.streams.acquire(&user).map_err(|refused| {
        let code = match refused {
            berth_proxy::limits::StreamRefused::Total(_) => ErrorCode::CapacityExhausted,
            berth_proxy::limits::StreamRefused::PerUser { .. } => ErrorCode::TooManyStreams,
        };
        ApiError::new(code, refused.to_string())
    })?;
    // Subscribe before reading the status so no change falls in between.
    let events = state.spawner.subscribe();
    let main = state.spawner.status(&user).await?.main;
    let first = main.as_ref().map(|m| InstanceEvent {
        user: user.clone(),
        role: m.role,
        status: m.status,
        ready: m.ready,
        endpoint: None,
        message: m.last_error.clone(),
    });
    let done_already = first.as_ref().is_none_or(is_final);
    // An instance on another node publishes its events there, not here:
    // follow its record in the shared store instead.
    let poll = main
        .as_ref()
        .filter(|m| state.cluster.is_some() && m.node != state.node_id)
        .map(|m| (state.spawner.clone(), (m.status, m.ready)));
    let first_event = first.map_or_else(
        || {
            Event::default()
                .event("status")
                .data(r#"{"status":"none"}"#)
        },
        |e| to_sse(&e),
    );
    struct Follow {
        events: tokio::sync::broadcast::Receiver<InstanceEvent>,
        user: UserId,
        done: bool,
        /// Polled instead of `events`: the spawner (whose `status` reads
        /// the store for another node's instance) and the last state sent.
        poll: Option<(Arc<dyn Spawner>, (InstanceStatus, bool))>,
        /// Held until the stream is dropped (finished, or the client left).
        _permit: berth_proxy::limits::StreamPermit,
    }
    let follow = stream::unfold(
        Follow {
            events,
            user,
            done: done_already,
            poll,
            _permit: permit,
        },
        |mut f| async move {
            loop {
                if f.done {
                    return None;
                }
                if let Some((spawner, last)) = f.poll.as_mut() {
                    tokio::time::sleep(REMOTE_PROGRESS_POLL).await;
                    let Ok(Some(m)) = spawner.status(&f.user).await.map(|s| s.main) else {
                        continue;
                    };
                    if (m.status, m.ready) == *last {
                        continue;
                    }
                    *last = (m.status, m.ready);
                    let e = InstanceEvent {
                        user: f.user.clone(),
                        role: m.role,
                        status: m.status,
                        ready: m.ready,
                        endpoint: None,
                        message: m.last_error,
                    };
                    f.done = is_final(&e);
                    return Some((Ok(to_sse(&e)), f));
                }
                match f.events.recv().await {
                    Ok(e) if e.user == f.user && e.role == berth_core::Role::Main => {
                        f.done = is_final(&e);
                        return Some((Ok(to_sse(&e)), f));
                    }
                    Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
                }
            }
        },
    );
    let stream = stream::once(async move { Ok(first_event) });
    Ok(Sse::new(futures_util::StreamExt::chain(stream, follow)).keep_alive(KeepAlive::default()))
}

/// How often the progress of an instance on another node is read from the
/// store.
const REMOTE_PROGRESS_POLL: Duration = Duration::from_millis(500);

fn is_final(e: &InstanceEvent) -> bool {
    (e.status == InstanceStatus::Running && e.ready) || e.status.is_terminal()
}

fn to_sse(e: &InstanceEvent) -> Event {
    Event::default()
        .event("status")
        .data(serde_json::to_string(e).unwrap_or_default())
}

#[derive(Debug, Default, Deserialize)]
struct InstancesQuery {
    status: Option<String>,
    node: Option<String>,
}

async fn list_instances(
    State(state): AppState,
    headers: HeaderMap,
    Query(q): Query<InstancesQuery>,
) -> ApiResult {
    state.require_admin(&headers).await?;
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
    Ok(axum::Json(json!({ "instances": instances })).into_response())
}

async fn restart_all(State(state): AppState, headers: HeaderMap) -> ApiResult {
    state.require_admin(&headers).await?;
    let results = state.spawner.restart_all_mains().await;
    Ok(axum::Json(json!({ "results": results })).into_response())
}

async fn list_nodes(State(state): AppState, headers: HeaderMap) -> ApiResult {
    state.require_admin(&headers).await?;
    let nodes = state.store.list_nodes().await?;
    Ok(axum::Json(json!({ "nodes": nodes })).into_response())
}

#[derive(Debug, Default, Deserialize)]
struct LeasesQuery {
    expired: Option<bool>,
}

async fn list_leases(
    State(state): AppState,
    headers: HeaderMap,
    Query(q): Query<LeasesQuery>,
) -> ApiResult {
    state.require_admin(&headers).await?;
    // Liveness is judged by the lease TTL, the window an evidence claim uses.
    let leases = state
        .store
        .list_leases(q.expired.unwrap_or(false), state.lease_ttl)
        .await?;
    Ok(axum::Json(json!({ "leases": leases })).into_response())
}

/// `POST /api/v1/leases/<user>/takeover`: an operator moves an expired lease
/// to this node and starts the user here.
async fn take_over(State(state): AppState, uri: Uri, headers: HeaderMap) -> ApiResult {
    state.require_admin(&headers).await?;
    let rest = uri
        .path()
        .strip_prefix("/api/v1/leases/")
        .unwrap_or_default();
    let Some(raw_user) = rest.strip_suffix("/takeover") else {
        return Err(ApiError::new(ErrorCode::NotFound, "no such route"));
    };
    let user = parse_user_segment(raw_user)?;
    // Read before the claim: the fence must name the old holder and the
    // old epoch, never whoever holds the row afterwards.
    let before = state.store.get_lease(&user).await?;
    let request = launch_request_from_store(state.store.as_ref(), &user).await?;
    // The spawner claims and launches as one step under the user's
    // lifecycle lock, through its lease keeper: claiming here directly
    // would leave the keeper unaware of the new epoch (never renewed,
    // never released, and a launch that re-claims it). A lease that is not
    // expired comes back as `lease_busy`.
    let instance = match state.spawner.take_over(&user, request).await {
        Ok(instance) => instance,
        // Nothing was claimed: a main already runs here, so the old holder
        // is not fenced on its account.
        Err(SpawnError::AlreadyRunning { .. }) => {
            let main = state.spawner.status(&user).await?.main;
            let instance = main.ok_or_else(|| {
                ApiError::new(ErrorCode::Internal, "instance vanished during launch")
            })?;
            return Ok(instance_response(&state, &user, StatusCode::OK, instance));
        }
        Err(e) => return Err(e.into()),
    };
    // The lease has moved past the old epoch: tell the old holder to stop
    // whatever still runs under exactly that epoch (best effort; its next
    // renew would find the lease lost anyway).
    if let (Some(cluster), Some(old)) = (&state.cluster, &before) {
        if let Some(holder) = old.holder.as_deref() {
            cluster.fence_remote(holder, &user, old.epoch).await;
        }
    }
    Ok(instance_response(&state, &user, StatusCode::OK, instance))
}

/// The request that relaunches `user` as they were last launched (folder
/// and patch kept in the store), e.g. on another node after a failover.
pub(crate) async fn launch_request_from_store(
    store: &dyn Store,
    user: &UserId,
) -> Result<LaunchRequest, SpawnError> {
    Ok(match store.get_launch_params(user).await? {
        Some(p) => LaunchRequest {
            folder: Some(p.folder).filter(|f| !f.is_empty()),
            patch: p.patch,
            force: false,
        },
        None => LaunchRequest::default(),
    })
}

/// `POST /api/v1/node/drain`: this node takes no new instances (it keeps
/// what it runs). Heartbeats at once so placement elsewhere sees it.
async fn drain(State(state): AppState, headers: HeaderMap) -> ApiResult {
    set_draining(&state, &headers, true).await
}

/// `POST /api/v1/node/undrain`: this node takes new instances again.
async fn undrain(State(state): AppState, headers: HeaderMap) -> ApiResult {
    set_draining(&state, &headers, false).await
}

async fn set_draining(state: &ApiState, headers: &HeaderMap, draining: bool) -> ApiResult {
    state.require_admin(headers).await?;
    state.node_control.set_draining(draining);
    state.node_control.heartbeat_now().await?;
    if let Some(cluster) = &state.cluster {
        cluster.invalidate_nodes();
    }
    let status = if draining { "draining" } else { "up" };
    tracing::info!(node = %state.node_id, status, "node status changed");
    Ok(axum::Json(json!({ "node": state.node_id, "status": status })).into_response())
}

#[derive(Debug, Deserialize)]
struct FenceBody {
    epoch: berth_core::Epoch,
}

/// `/internal/v1/users/<user>/{launch,fence}`: calls from other nodes,
/// authenticated by the cluster secret alone.
async fn internal_route(State(state): AppState, req: axum::extract::Request) -> Response {
    // The secret is checked before a byte of the body is read.
    let (parts, body) = req.into_parts();
    let result = match check_cluster_secret(&state, &parts.headers) {
        Ok(()) => match read_body(body).await {
            Ok(body) => internal_dispatch(&state, &parts.uri, &body).await,
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    };
    match result {
        Ok(response) => response,
        Err(err) => {
            state.count_error(err.code);
            err.into_response()
        }
    }
}

/// Node-to-node routes exist only in cluster mode, and only for callers
/// with the cluster secret.
fn check_cluster_secret(state: &ApiState, headers: &HeaderMap) -> ApiResult<()> {
    let Some(secret) = &state.cluster_secret else {
        return Err(ApiError::new(
            ErrorCode::NotFound,
            "node-to-node routes exist only in cluster mode",
        ));
    };
    if !secret.verify(headers) {
        return Err(ApiError::new(
            ErrorCode::Unauthorized,
            "node-to-node calls need the cluster secret in X-Berth-Cluster-Secret",
        ));
    }
    Ok(())
}

async fn internal_dispatch(state: &Arc<ApiState>, uri: &Uri, body: &[u8]) -> ApiResult {
    let rest = uri
        .path()
        .strip_prefix("/internal/v1/users/")
        .unwrap_or_default();
    let (raw_user, action) = rest.rsplit_once('/').unwrap_or((rest, ""));
    let user = parse_user_segment(raw_user)?;
    match action {
        "launch" => {
            let query = Query::<UserQuery>::try_from_uri(uri)
                .map_err(|e| ApiError::new(ErrorCode::InvalidRequest, e.body_text()))?;
            let request = parse_launch_body(body)?;
            // Local only: the caller already decided this node should run
            // it, and a call that forwarded again could loop.
            Ok(local_launch(state, &user, request, query.0.wait.unwrap_or(true)).await?)
        }
        "fence" => {
            let FenceBody { epoch } = serde_json::from_slice(body).map_err(|e| {
                ApiError::new(
                    ErrorCode::InvalidRequest,
                    format!("invalid fence body: {e}"),
                )
            })?;
            let fenced = state.spawner.fence(&user, epoch).await?;
            Ok(
                axum::Json(json!({ "user": user, "epoch": epoch, "fenced": fenced }))
                    .into_response(),
            )
        }
        other => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("no such route: {other:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
