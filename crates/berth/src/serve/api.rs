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
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
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

use super::auth::{Authenticator, Caller, Minted, Refusal};
use super::cluster::{Cluster, Decision, NodeControl};
use super::metrics::{ApiLabels, Metrics};
use super::peer::PeerAnswer;

/// Request bodies larger than this are refused while they are read. It
/// sits above the patch limit so that an oversized patch gets the precise
/// `payload_too_large` message from the spawner.
///
/// No handler takes a body extractor: each reads its body with
/// [`read_body`] only once the caller is authenticated (design §8.2), so an
/// anonymous client cannot make berth buffer anything.
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
    /// Where users' apps live: `<slug>.<base_domain>` when set.
    pub base_domain: Option<String>,
    /// Whether `/u/<user>/` on the berth host routes to apps.
    pub path_routing: bool,
}

type AppState = State<Arc<ApiState>>;

/// The API router.
pub fn router(state: Arc<ApiState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .route(
            "/api/v1/session",
            post(start_session).get(show_session).delete(end_session),
        )
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
        .route("/internal/v1/tokens/purge", post(internal_purge))
        .fallback(no_such_route)
        // Outermost: a form or text body is refused before anything else
        // looks at the request.
        .layer(axum::middleware::from_fn(refuse_non_json_bodies))
        .with_state(state)
}

/// 415 for any request whose body is declared as something other than
/// JSON. Form and text bodies are what a page on another site can send
/// without asking the browser for permission (no CORS preflight), so no
/// endpoint takes them (design §8.2). A request without `Content-Type` is
/// read as JSON.
async fn refuse_non_json_bodies(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
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

async fn no_such_route(uri: Uri) -> Response {
    ApiError::new(
        ErrorCode::NotFound,
        format!("no such route: {}", uri.path()),
    )
    .into_response()
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

    fn forbidden() -> Self {
        Self::new(ErrorCode::Forbidden, "this token may not do that")
    }
}

impl From<Refusal> for ApiError {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::Unauthenticated(m) => ApiError::new(ErrorCode::Unauthorized, m),
            Refusal::Forbidden(m) => ApiError::new(ErrorCode::Forbidden, m),
            Refusal::BadRequest(m) => ApiError::new(ErrorCode::InvalidRequest, m),
            Refusal::Store(e) => e.into(),
        }
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
    async fn caller(&self, method: &Method, headers: &HeaderMap) -> ApiResult<Caller> {
        Ok(self.auth.caller(method, headers).await?)
    }

    async fn require_admin(&self, method: &Method, headers: &HeaderMap) -> ApiResult<()> {
        match self.caller(method, headers).await? {
            Caller::Admin => Ok(()),
            Caller::User { .. } => Err(ApiError::forbidden()),
        }
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

    /// The URL a user opens: their app, carrying the launch token.
    fn open_url(&self, user: &UserId, headers: &HeaderMap, https: bool) -> String {
        let base = self.app_url(user, headers, https);
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

async fn metrics(State(state): AppState, method: Method, headers: HeaderMap) -> ApiResult {
    state.require_admin(&method, &headers).await?;
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

/// Reads a request body of at most [`MAX_BODY_BYTES`]. Call it only after
/// the caller is authenticated.
async fn read_body(headers: &HeaderMap, body: Body) -> ApiResult<Bytes> {
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
            } else {
                ApiError::new(
                    ErrorCode::InvalidRequest,
                    format!("cannot read the request body: {e}"),
                )
            }
        })
}

/// Dispatches `/api/v1/users/<user>/<action>`.
async fn user_route(State(state): AppState, request: axum::extract::Request) -> Response {
    let https = is_https(&request);
    let (parts, body) = request.into_parts();
    let (method, uri, headers) = (parts.method, parts.uri, parts.headers);
    let result = match Query::<UserQuery>::try_from_uri(&uri) {
        Ok(Query(query)) => {
            let request = UserRequest {
                method,
                uri: &uri,
                headers: &headers,
                query,
                https,
            };
            dispatch_user_route(&state, request, body).await
        }
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

/// Whether the client reached berth over https (a trusted proxy says so).
fn is_https(request: &axum::extract::Request) -> bool {
    request
        .extensions()
        .get::<berth_proxy::forward::ConnInfo>()
        .is_some_and(|conn| berth_proxy::auth::is_https(request.headers(), conn))
}

/// The head of a request to `/api/v1/users/…`.
struct UserRequest<'a> {
    method: Method,
    uri: &'a Uri,
    headers: &'a HeaderMap,
    query: UserQuery,
    https: bool,
}

/// What a user token may do on its own user (design §8.2); everything
/// else is the admin's. `patch`, `folder` and `force` are checked on the
/// launch body itself.
fn user_may(method: &Method, action: &str, users_may_patch: bool) -> bool {
    match (method, action) {
        (&Method::GET, "instance" | "instance/progress" | "instance/logs" | "tokens")
        | (&Method::POST, "instance" | "tokens")
        | (&Method::DELETE, "instance") => true,
        (&Method::DELETE, action) => action
            .strip_prefix("tokens/")
            .is_some_and(|id| !id.is_empty()),
        (&Method::POST, "breaker/reset") => users_may_patch,
        _ => false,
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct MintBody {
    /// A shorter life than `[auth] user_token_ttl_s`.
    ttl_s: Option<u64>,
}

async fn dispatch_user_route(
    state: &Arc<ApiState>,
    request: UserRequest<'_>,
    body: Body,
) -> ApiResult {
    let UserRequest {
        method,
        uri,
        headers,
        query,
        https,
    } = request;
    let rest = uri
        .path()
        .strip_prefix("/api/v1/users/")
        .unwrap_or_default();
    let (raw_user, action) = rest.split_once('/').unwrap_or((rest, ""));
    // Authenticate before validating input, so unauthenticated callers learn
    // nothing about which ids exist or are valid.
    let caller = state.caller(&method, headers).await?;
    let user = parse_user_segment(raw_user)?;
    let users_may_patch = state.auth.settings().users_may_patch;
    if let Caller::User { user: own, .. } = &caller {
        if own != &user || !user_may(&method, action, users_may_patch) {
            return Err(ApiError::forbidden());
        }
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
        (Method::POST, "instance") => {
            let body = read_body(headers, body).await?;
            let request = parse_launch_body(&body)?;
            if matches!(caller, Caller::User { .. }) && !users_may_patch {
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
            let launch = LaunchContext {
                wait: query.wait.unwrap_or(true),
                headers,
                https,
            };
            launch_instance(state, &user, request, &launch).await
        }
        (Method::DELETE, "instance") => {
            spawner.stop(&user).await?;
            Ok(StatusCode::NO_CONTENT.into_response())
        }
        (Method::POST, "instance/restart") => {
            let instance = spawner.restart_main(&user).await?;
            let instance = wait_until_ready(state, &user, instance, true).await?;
            Ok(instance_response(
                state,
                &user,
                StatusCode::OK,
                instance,
                headers,
                https,
            ))
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
            let body = read_body(headers, body).await?;
            let MintBody { ttl_s } = if body.iter().all(u8::is_ascii_whitespace) {
                MintBody::default()
            } else {
                serde_json::from_slice(&body).map_err(|e| {
                    ApiError::new(
                        ErrorCode::InvalidRequest,
                        format!("invalid token body: {e}"),
                    )
                })?
            };
            if ttl_s == Some(0) {
                return Err(ApiError::new(
                    ErrorCode::InvalidRequest,
                    "ttl_s must be at least 1",
                ));
            }
            mint_token(
                state,
                &caller,
                &user,
                ttl_s.map(Duration::from_secs),
                headers,
                https,
            )
            .await
        }
        (Method::GET, "tokens") => {
            let tokens = state.store.list_tokens(&user).await?;
            Ok(axum::Json(json!({ "user": user, "tokens": tokens })).into_response())
        }
        (Method::DELETE, action) if action.starts_with("tokens/") => {
            let id = &action["tokens/".len()..];
            revoke_token(state, &user, id).await
        }
        (_, action) => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("no such route: {action:?}"),
        )),
    }
}

/// `POST /api/v1/users/{user}/tokens`: a token for `user`, its id and
/// expiry, and the link that opens the user's app with it.
async fn mint_token(
    state: &ApiState,
    caller: &Caller,
    user: &UserId,
    ttl: Option<Duration>,
    headers: &HeaderMap,
    https: bool,
) -> ApiResult {
    let parent = match caller {
        Caller::Admin => None,
        Caller::User { token_id, .. } => Some(token_id.as_str()),
    };
    match state.auth.mint_user_token(user, parent, ttl).await? {
        Minted::Token { token, record } => {
            let url = format!(
                "{}?berth_token={token}",
                state.app_url(user, headers, https)
            );
            let routing = if state.path_routing { "path" } else { "host" };
            Ok((
                StatusCode::CREATED,
                axum::Json(json!({
                    "user": user,
                    "token": token,
                    "id": record.id,
                    "created_at": record.created_at,
                    "expires_at": record.expires_at,
                    "parent": record.parent,
                    "url": url,
                    "routing": routing,
                })),
            )
                .into_response())
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

/// `DELETE /api/v1/users/{user}/tokens/{id}`: deletes the token and every
/// token minted with it, then empties the token caches of this node and of
/// every other node that answers, so none accepts it from now on. A node
/// that does not answer is named; it drops the token within `[auth]
/// token_cache_s`.
async fn revoke_token(state: &ApiState, user: &UserId, id: &str) -> ApiResult {
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
    Ok(axum::Json(json!({
        "user": user,
        "revoked": revoked,
        "unreached_nodes": unreached,
    }))
    .into_response())
}

/// `POST /api/v1/session`: the admin page signs in with the admin token
/// (as Bearer) and gets the session cookie and its CSRF token.
async fn start_session(State(state): AppState, request: axum::extract::Request) -> Response {
    let https = is_https(&request);
    let headers = request.headers();
    let result: ApiResult = async {
        let Some(token) = berth_proxy::auth::bearer(headers) else {
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
            axum::Json(json!({
                "csrf_token": session.csrf_token,
                "expires_at": session.expires_at,
            })),
        )
            .into_response();
        if let Ok(cookie) = HeaderValue::try_from(session.cookie) {
            response.headers_mut().insert(header::SET_COOKIE, cookie);
        }
        Ok(response)
    }
    .await;
    finish(&state, result)
}

/// `GET /api/v1/session`: the current session's CSRF token and expiry, for
/// an admin page that was reloaded.
async fn show_session(State(state): AppState, method: Method, headers: HeaderMap) -> Response {
    let result: ApiResult = async {
        let session = state.auth.session(&method, &headers).await?;
        Ok(axum::Json(json!({
            "csrf_token": session.csrf_token,
            "expires_at": session.expires_at,
        }))
        .into_response())
    }
    .await;
    finish(&state, result)
}

/// `DELETE /api/v1/session`: signs out (CSRF rules apply).
async fn end_session(State(state): AppState, request: axum::extract::Request) -> Response {
    let https = is_https(&request);
    let (method, headers) = (request.method().clone(), request.headers().clone());
    let result: ApiResult = async {
        let session = state.auth.session(&method, &headers).await?;
        let removal = state.auth.end_session(&session, https).await?;
        let mut response = StatusCode::NO_CONTENT.into_response();
        if let Ok(cookie) = HeaderValue::try_from(removal) {
            response.headers_mut().insert(header::SET_COOKIE, cookie);
        }
        Ok(response)
    }
    .await;
    finish(&state, result)
}

/// The answer, counting an error.
fn finish(state: &ApiState, result: ApiResult) -> Response {
    match result {
        Ok(mut response) => {
            // Answers about credentials are never cached.
            response
                .headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            response
        }
        Err(err) => {
            state.count_error(err.code);
            err.into_response()
        }
    }
}

/// `POST /internal/v1/tokens/purge`: another node revoked a token; forget
/// every cached user token here.
async fn internal_purge(State(state): AppState, headers: HeaderMap) -> Response {
    let result: ApiResult = async {
        let Some(secret) = &state.cluster_secret else {
            return Err(ApiError::new(
                ErrorCode::NotFound,
                "node-to-node routes exist only in cluster mode",
            ));
        };
        if !secret.verify(&headers) {
            return Err(ApiError::new(
                ErrorCode::Unauthorized,
                "node-to-node calls need the cluster secret in X-Berth-Cluster-Secret",
            ));
        }
        state.auth.purge_cache();
        Ok(axum::Json(json!({ "purged": true })).into_response())
    }
    .await;
    finish(&state, result)
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

/// How a launch is answered: whether to wait for ready, and what the
/// app's URL is built from.
struct LaunchContext<'a> {
    wait: bool,
    headers: &'a HeaderMap,
    https: bool,
}

/// `POST …/instance`: on a single node a local launch; in a cluster, where
/// the lease and placement say (design §7.3).
async fn launch_instance(
    state: &Arc<ApiState>,
    user: &UserId,
    request: LaunchRequest,
    launch: &LaunchContext<'_>,
) -> ApiResult {
    match &state.cluster {
        None => Ok(local_launch(state, user, request, launch).await?),
        Some(cluster) => cluster_launch(state, cluster, user, request, launch).await,
    }
}

/// Launches on this node: 201 new, 200 existing, waiting for ready with
/// `wait`.
async fn local_launch(
    state: &Arc<ApiState>,
    user: &UserId,
    request: LaunchRequest,
    launch: &LaunchContext<'_>,
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
    let instance = wait_until_ready(state, user, instance, launch.wait).await?;
    Ok(instance_response(
        state,
        user,
        status,
        instance,
        launch.headers,
        launch.https,
    ))
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
    launch: &LaunchContext<'_>,
) -> ApiResult {
    let wait = launch.wait;
    let me = cluster.node_id();
    let mut decision = cluster.decide(user).await?;
    for _ in 0..3 {
        let node = match decision {
            Decision::Local => match local_launch(state, user, request.clone(), launch).await {
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
    headers: &HeaderMap,
    https: bool,
) -> Response {
    let url = state.open_url(user, headers, https);
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
    }
    let follow = stream::unfold(
        Follow {
            events,
            user,
            done: done_already,
            poll,
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
    method: Method,
    headers: HeaderMap,
    Query(q): Query<InstancesQuery>,
) -> ApiResult {
    state.require_admin(&method, &headers).await?;
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

async fn restart_all(State(state): AppState, method: Method, headers: HeaderMap) -> ApiResult {
    state.require_admin(&method, &headers).await?;
    let results = state.spawner.restart_all_mains().await;
    Ok(axum::Json(json!({ "results": results })).into_response())
}

async fn list_nodes(State(state): AppState, method: Method, headers: HeaderMap) -> ApiResult {
    state.require_admin(&method, &headers).await?;
    let nodes = state.store.list_nodes().await?;
    Ok(axum::Json(json!({ "nodes": nodes })).into_response())
}

#[derive(Debug, Default, Deserialize)]
struct LeasesQuery {
    expired: Option<bool>,
}

async fn list_leases(
    State(state): AppState,
    method: Method,
    headers: HeaderMap,
    Query(q): Query<LeasesQuery>,
) -> ApiResult {
    state.require_admin(&method, &headers).await?;
    // Liveness is judged by the lease TTL, the window an evidence claim uses.
    let leases = state
        .store
        .list_leases(q.expired.unwrap_or(false), state.lease_ttl)
        .await?;
    Ok(axum::Json(json!({ "leases": leases })).into_response())
}

/// `POST /api/v1/leases/<user>/takeover`: an operator moves an expired lease
/// to this node and starts the user here.
async fn take_over(
    State(state): AppState,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> ApiResult {
    state.require_admin(&method, &headers).await?;
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
            return Ok(instance_response(
                &state,
                &user,
                StatusCode::OK,
                instance,
                &headers,
                false,
            ));
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
    Ok(instance_response(
        &state,
        &user,
        StatusCode::OK,
        instance,
        &headers,
        false,
    ))
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
async fn drain(State(state): AppState, method: Method, headers: HeaderMap) -> ApiResult {
    set_draining(&state, &method, &headers, true).await
}

/// `POST /api/v1/node/undrain`: this node takes new instances again.
async fn undrain(State(state): AppState, method: Method, headers: HeaderMap) -> ApiResult {
    set_draining(&state, &method, &headers, false).await
}

async fn set_draining(
    state: &ApiState,
    method: &Method,
    headers: &HeaderMap,
    draining: bool,
) -> ApiResult {
    state.require_admin(method, headers).await?;
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
async fn internal_route(State(state): AppState, request: axum::extract::Request) -> Response {
    let (parts, body) = request.into_parts();
    let result = internal_dispatch(&state, &parts.uri, &parts.headers, body).await;
    match result {
        Ok(response) => response,
        Err(err) => {
            state.count_error(err.code);
            err.into_response()
        }
    }
}

async fn internal_dispatch(
    state: &Arc<ApiState>,
    uri: &Uri,
    headers: &HeaderMap,
    body: Body,
) -> ApiResult {
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
    let rest = uri
        .path()
        .strip_prefix("/internal/v1/users/")
        .unwrap_or_default();
    let (raw_user, action) = rest.rsplit_once('/').unwrap_or((rest, ""));
    let user = parse_user_segment(raw_user)?;
    // Read only now that the caller has proved to be a node.
    let body = read_body(headers, body).await?;
    match action {
        "launch" => {
            let query = Query::<UserQuery>::try_from_uri(uri)
                .map_err(|e| ApiError::new(ErrorCode::InvalidRequest, e.body_text()))?;
            let request = parse_launch_body(&body)?;
            // Local only: the caller already decided this node should run
            // it, and a call that forwarded again could loop.
            let launch = LaunchContext {
                wait: query.0.wait.unwrap_or(true),
                headers,
                https: false,
            };
            Ok(local_launch(state, &user, request, &launch).await?)
        }
        "fence" => {
            let FenceBody { epoch } = serde_json::from_slice(&body).map_err(|e| {
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
