//! The layers put together: route target → auth → route lookup → wake →
//! forward.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use berth_core::{ErrorCode, Traffic};
use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::{Request, Response, StatusCode};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::{
    AuthMode, Authenticator, CookieScope, Credential, Gate, SharedSecret, TrustedProxies,
    strip_credentials,
};
use crate::conn::ConnInfo;
use crate::forward::{ForwardConfig, Forwarder, Upstream, wants_upgrade};
use crate::limits::StreamLimits;
use crate::metrics::ProxyMetrics;
use crate::peer_auth::{self, PeerAuth};
use crate::respond::{self, ProxyBody};
use crate::route::{Class, RouteError, RouteTable, Router, Target};
use crate::shield::{AppSite, RequestSite, confine_response, foreign_request};
use crate::wake::{ClusterHook, Locate, Wake, Waker};

/// Proxy settings.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Route `<slug>.<base_domain>` too; `None`: path routing only.
    pub base_domain: Option<String>,
    /// Route `/u/<user>/` on any host (on by default only without a
    /// base domain, since it puts every app on one origin).
    pub path_routing: bool,
    /// Remove `/u/<user>` from the path sent upstream.
    pub strip_prefix: bool,
    /// How callers are identified: by token, or by a trusted SSO proxy's
    /// header.
    pub auth_mode: AuthMode,
    /// The peers whose `X-Forwarded-*` headers are believed.
    pub trusted_proxies: TrustedProxies,
    /// In header mode, `X-Forwarded-User` counts only next to this secret
    /// in `X-Berth-Proxy-Secret`.
    pub header_secret: Option<SharedSecret>,
    /// How long a woken request waits for its instance.
    pub ready_timeout: Duration,
    /// The forward layer's settings.
    pub forward: ForwardConfig,
    /// Let a page of another origin make a browser send state-changing
    /// requests and WebSocket upgrades to an app (for programs whose apps
    /// call each other). Off, they get 403 ([`crate::shield`]).
    pub allow_cross_origin_requests: bool,
    /// Where request durations are recorded.
    pub metrics: ProxyMetrics,
    /// berth serves a sign-in page: a browser without a credential for an
    /// app is sent there rather than answered 401.
    pub sign_in: bool,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            base_domain: None,
            path_routing: true,
            strip_prefix: false,
            auth_mode: AuthMode::default(),
            trusted_proxies: TrustedProxies::default(),
            header_secret: None,
            ready_timeout: Duration::default(),
            forward: ForwardConfig::default(),
            allow_cross_origin_requests: false,
            metrics: ProxyMetrics::default(),
            sign_in: false,
        }
    }
}

/// Cluster mode: where to find users this node does not run, and how
/// forwarded requests are signed (to other nodes) and checked (from them).
#[derive(Clone)]
pub struct ProxyCluster {
    /// Finds (or starts) the instances of users this node does not run.
    pub hook: Arc<dyn ClusterHook>,
    /// Signs requests forwarded to other nodes and checks those forwarded
    /// here.
    pub auth: Arc<PeerAuth>,
}

impl std::fmt::Debug for ProxyCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyCluster").finish_non_exhaustive()
    }
}

/// The reverse proxy: shared by every connection of the server.
pub struct Proxy {
    router: Router,
    gate: Gate,
    waker: Waker,
    forwarder: Forwarder,
    cluster: Option<ProxyCluster>,
    allow_cross_origin_requests: bool,
    metrics: ProxyMetrics,
    tasks: TaskTracker,
    cancel: CancellationToken,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("router", &self.router)
            .field("forwarder", &self.forwarder)
            .finish_non_exhaustive()
    }
}

impl Proxy {
    /// Builds the proxy and starts keeping its route table in step with
    /// `spawner`. Must run inside a Tokio runtime.
    pub fn start(config: ProxyConfig, spawner: Arc<dyn Traffic>, auth: Authenticator) -> Arc<Self> {
        Self::start_clustered(config, spawner, auth, None)
    }

    /// [`Proxy::start`] for a cluster node: a request for a user without a
    /// local instance asks `cluster` where to go, and requests other nodes
    /// forward here are accepted with the cluster secret. `None`: single
    /// node, exactly [`Proxy::start`].
    pub fn start_clustered(
        config: ProxyConfig,
        spawner: Arc<dyn Traffic>,
        auth: Authenticator,
        cluster: Option<ProxyCluster>,
    ) -> Arc<Self> {
        let table = Arc::new(RouteTable::new());
        let tasks = TaskTracker::new();
        let cancel = CancellationToken::new();
        tasks.spawn(table.clone().follow(spawner.clone(), cancel.child_token()));
        Arc::new(Self {
            router: Router::new(
                table.clone(),
                config.base_domain.as_deref(),
                config.strip_prefix,
                config.path_routing,
            ),
            gate: {
                let gate = Gate::new(auth, config.auth_mode, config.trusted_proxies)
                    .with_header_secret(config.header_secret)
                    .with_sign_in(config.sign_in);
                match &cluster {
                    Some(c) => gate.with_cluster(c.auth.clone()),
                    None => gate,
                }
            },
            waker: Waker::new(spawner.clone(), table, config.ready_timeout),
            forwarder: Forwarder::new(&config.forward, spawner, tasks.clone(), cancel.clone()),
            cluster,
            allow_cross_origin_requests: config.allow_cross_origin_requests,
            metrics: config.metrics,
            tasks,
            cancel,
        })
    }

    /// The route table, kept up to date from the spawner's events.
    pub fn routes(&self) -> &Arc<RouteTable> {
        self.router.table()
    }

    /// Free WebSocket/upgrade slots.
    pub fn free_upgrades(&self) -> usize {
        self.forwarder.free_upgrades()
    }

    /// The counts of long-lived streams per user and in all: WebSockets
    /// take a slot here, and so must every other long-lived stream berth
    /// serves (the API's progress and followed-log streams).
    pub fn streams(&self) -> &Arc<StreamLimits> {
        self.forwarder.streams()
    }

    /// Per-connection facts, computed once per connection.
    pub fn conn_info(&self, peer: SocketAddr) -> ConnInfo {
        ConnInfo::new(peer, self.gate.trusted().contains(peer.ip()))
    }

    /// Is this request for a user's instance, for berth itself, or bad?
    pub fn classify<B>(&self, req: &Request<B>) -> Class {
        self.router.classify(req)
    }

    /// Answers a request for a user's instance, and records how long the
    /// answer's head took.
    pub async fn handle(&self, req: Request<Incoming>, conn: &ConnInfo) -> Response<ProxyBody> {
        let started = std::time::Instant::now();
        let response = self.answer(req, conn).await;
        self.metrics.observe(response.status(), started.elapsed());
        response
    }

    async fn answer(&self, req: Request<Incoming>, conn: &ConnInfo) -> Response<ProxyBody> {
        let (route, path_and_query, navigation, pass, base) = {
            let target = match self.router.target(req.headers(), req.uri()) {
                Ok(Some(target)) => target,
                Ok(None) => return respond::code_error(ErrorCode::NotFound, "not a user route"),
                Err(e) => return route_error(&e, &req),
            };
            let route = match self.router.resolve(&target) {
                Ok(route) => route,
                Err(e) => return route_error(&e, &req),
            };
            // Before credentials are even looked at: a page of another
            // origin gets nothing done with this app's cookie, and no
            // instance is woken for it.
            if !self.allow_cross_origin_requests {
                let site = RequestSite::of(
                    req.method(),
                    req.uri(),
                    req.headers(),
                    wants_upgrade(req.headers()),
                );
                if let Some(why) = foreign_request(&site) {
                    tracing::debug!(user = %route.user, why, "refused a request from another origin");
                    return respond::forbidden_because(
                        respond::is_navigation(req.headers()),
                        &format!(
                            "{why}. berth refuses requests that change state or open a WebSocket \
                             when they come from another origin, so that another app's page \
                             cannot act with this app's cookie."
                        ),
                    );
                }
            }
            // Where the app lives decides what its answer may do in the
            // browser; kept past the request, which moves on.
            let base = match &target {
                Target::Host { .. } => None,
                Target::Path { segment, .. } => Some(format!("/u/{segment}/")),
            };
            let scope = match &target {
                Target::Host { .. } => CookieScope::Host,
                Target::Path { segment, .. } => CookieScope::Path { segment },
            };
            let pass = match self
                .gate
                .check(
                    req.method(),
                    req.headers(),
                    req.uri(),
                    conn,
                    &route.user,
                    &scope,
                )
                .await
            {
                Ok(pass) => pass,
                Err(answer) => return answer,
            };
            let Some(path_and_query) = self.router.upstream_path(&target, req.uri(), None) else {
                return respond::code_error(ErrorCode::InvalidRequest, "cannot rewrite the path");
            };
            let navigation = respond::is_navigation(req.headers());
            (route, path_and_query, navigation, pass, base)
        };
        let site = match &base {
            None => AppSite::Host,
            Some(base) => AppSite::Path { base },
        };
        let credential = pass.credential;
        let mut req = req;
        strip_credentials(req.headers_mut(), credential);
        let addr = match self.waker.endpoint(&route.user, route.upstream) {
            Some(addr) => addr,
            None => {
                // A request another node forwarded here is never forwarded
                // again, whatever this node believes: no loops between
                // nodes with different views.
                let cluster = self
                    .cluster
                    .as_ref()
                    .filter(|_| credential != Credential::Cluster);
                if let Some(cluster) = cluster {
                    match cluster.hook.locate(&route.user, !navigation).await {
                        Ok(Locate::Local) => {}
                        Ok(Locate::Remote { endpoint, node }) => {
                            return self
                                .forward_remote(
                                    req, route.user, endpoint, &node, conn, cluster, site,
                                )
                                .await;
                        }
                        Err(e) => {
                            tracing::info!(user = %route.user, error = %e, "cannot locate the instance in the cluster");
                            return respond::spawn_error(&e);
                        }
                    }
                }
                // The starting page polls (reloads) rather than follow the
                // API's progress stream: the API takes no browser cookie,
                // and the user cookie is scoped to the app.
                match self.waker.wake(&route.user, navigation, None).await {
                    Wake::Ready(addr) => addr,
                    Wake::Respond(answer) => return answer,
                }
            }
        };
        let upstream = Upstream {
            user: route.user,
            authority: addr.authority,
            reach: addr.reach,
            path_and_query,
            retry_refused: true,
        };
        let mut response = self
            .forwarder
            .forward(req, upstream, conn, pass.keep_forwarded_user)
            .await;
        confine_response(response.headers_mut(), site);
        response
    }

    /// Forwards `req` to the node that runs `user`'s instance: same path
    /// (that node routes and strips it itself), signed for that node and
    /// the user ([`PeerAuth::check_forward`] there); the secret itself
    /// never travels. berth's own credentials were already removed. The answer is confined to `site` here too: the
    /// owner node confines it as well, but this node vouches for it.
    #[allow(clippy::too_many_arguments)]
    async fn forward_remote(
        &self,
        mut req: Request<Incoming>,
        user: Arc<berth_core::UserId>,
        endpoint: hyper::http::uri::Authority,
        node: &str,
        conn: &ConnInfo,
        cluster: &ProxyCluster,
        site: AppSite<'_>,
    ) -> Response<ProxyBody> {
        let path_and_query = req
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| hyper::http::uri::PathAndQuery::from_static("/"));
        let signed = match cluster.auth.key().sign_forward(
            node,
            req.method().as_str(),
            path_and_query.as_str(),
            user.as_str(),
        ) {
            Ok(signed) => signed,
            Err(e @ peer_auth::CannotSign::User) => {
                return respond::code_error(ErrorCode::InvalidUser, &e.to_string());
            }
            Err(e) => return respond::code_error(ErrorCode::Internal, &e.to_string()),
        };
        let headers = req.headers_mut();
        for name in peer_auth::node_headers() {
            headers.remove(name);
        }
        for (name, value) in signed.headers {
            headers.insert(name, value);
        }
        tracing::debug!(%user, %node, %endpoint, "forwarding to the owner node");
        let upstream = Upstream {
            user,
            authority: endpoint,
            reach: berth_core::Reach::default(),
            path_and_query,
            retry_refused: false,
        };
        let mut response = self.forwarder.forward(req, upstream, conn, false).await;
        confine_response(response.headers_mut(), site);
        response
    }

    /// Stops background work: the route follower, pooled upstream
    /// connections and WebSocket tunnels. Waits until they have ended.
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// The answer to a request that cannot be routed.
pub fn route_error<B>(error: &RouteError, req: &Request<B>) -> Response<ProxyBody> {
    match error {
        RouteError::MissingHost | RouteError::BadHost | RouteError::HostMismatch => {
            respond::code_error(ErrorCode::InvalidRequest, &error.to_string())
        }
        RouteError::InvalidUser(_) => {
            respond::code_error(ErrorCode::InvalidUser, &error.to_string())
        }
        RouteError::UnknownHost => respond::code_error(ErrorCode::NotFound, &error.to_string()),
        RouteError::AddSlash => {
            let uri = req.uri();
            let location = match uri.query() {
                Some(q) => format!("{}/?{q}", uri.path()),
                None => format!("{}/", uri.path()),
            };
            match HeaderValue::try_from(location) {
                Ok(location) => respond::redirect(StatusCode::PERMANENT_REDIRECT, location, None),
                Err(_) => respond::code_error(ErrorCode::InvalidRequest, "bad path"),
            }
        }
    }
}
