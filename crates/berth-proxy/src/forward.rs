//! Sends a request to an instance and streams the answer back.
//!
//! * Bodies are hyper [`Incoming`] streams passed through in both
//!   directions, so memory stays flat however large they are, and a slow
//!   reader slows the writer down (backpressure).
//! * Hop-by-hop headers are removed both ways; `X-Forwarded-For` is
//!   appended to and `-Proto`/`-Host` are set (kept as they are when the
//!   peer is a trusted proxy).
//! * Upstream connections are pooled per endpoint ([`crate::pool`]) and
//!   driven by the client connection's own task: no task, channel or
//!   wake-up of their own per request. A bodiless idempotent request that
//!   fails because a pooled connection was stale is sent once more on a
//!   fresh one (any request that a pooled connection closed under before
//!   it was written, too). The connection is set up before the request is
//!   built, so a refused connect (the instance is not listening yet) is
//!   tried again for about 1.5 s whatever the method or body.
//! * An upstream with an `owner` (an instance on this host, under an
//!   account of its own) is reached only through a socket that account
//!   owns: every new connection is checked with the kernel
//!   ([`berth_localnet::peer_owner`]) before a byte is sent, and a pooled
//!   one is lent only to requests for the same owner. A program of another
//!   account that bound the instance's port first never sees a request
//!   (`502`, and a warning in berth's log). A sandboxed instance is
//!   reached inside its own network namespace
//!   ([`berth_localnet::connect_in`]), where no other account listens.
//! * `Connection: upgrade` requests (WebSocket) go over a connection of
//!   their own, checked the same way, whose task hands the upgraded stream
//!   over; it becomes a raw byte tunnel once both sides have switched
//!   protocols; at most
//!   `max_upgrades` long-lived streams exist at a time, and at most
//!   `max_upgrades_per_user` for one user ([`StreamLimits`], which the
//!   API's progress and log streams share). What the client sends through
//!   a WebSocket is activity only in data frames ([`ClientFrames`]: a
//!   browser's automatic pongs are not the user's); through any other
//!   upgrade, every byte is.
//! * A request body that falls behind its pace ([`crate::pace`]) fails the
//!   exchange with `408 request_timeout`, and the client connection closes.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use berth_core::{ErrorCode, Reach, Spawner, UserId};
use bytes::Bytes;
use http_body_util::{Either, Empty};
use hyper::body::{Body as _, Incoming};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::http::uri::{Authority, PathAndQuery, Scheme};
use hyper::{Method, Request, Response, StatusCode, Uri, Version};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::credential::{CredentialHeader, Scrubber, scrub_headers};
use crate::limits::{ConnPermit, StreamLimits, StreamPermit, StreamRefused};
use crate::pace::{BodyPace, BodyTooSlow, PacedBody};
use crate::pool::{Conn, ForwardedBody, Pool};
use crate::respond::{self, ProxyBody};
use crate::ws_activity::ClientFrames;

/// The body sent upstream: the client's as it is (no body to read, as for
/// a GET), the client's paced ([`crate::pace`]; boxed, so that the common
/// bodiless request does not carry the pacer's state through every move),
/// or nothing (a retry).
pub type UpstreamBody = Either<Incoming, Either<Box<PacedBody<Incoming>>, Empty<Bytes>>>;

fn no_body() -> UpstreamBody {
    Either::Right(Either::Right(Empty::new()))
}

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Hop-by-hop headers (RFC 9110 §7.6.1), besides those `Connection` names.
fn hop_by_hop() -> [&'static HeaderName; 9] {
    [
        &header::CONNECTION,
        &KEEP_ALIVE,
        &PROXY_CONNECTION,
        &header::PROXY_AUTHENTICATE,
        &header::PROXY_AUTHORIZATION,
        &header::TE,
        &header::TRAILER,
        &header::TRANSFER_ENCODING,
        &header::UPGRADE,
    ]
}

/// How long a tunnel goes between activity reports. Idle reaping works in
/// minutes, so one `touch` a second per tunnel loses nothing and keeps a
/// busy WebSocket from calling into the spawner on every frame.
const TUNNEL_TOUCH_EVERY: Duration = Duration::from_secs(1);

/// Forwarding settings.
#[derive(Debug, Clone)]
pub struct ForwardConfig {
    /// Concurrent long-lived streams (WebSockets and other upgrades, and
    /// the API's progress and log streams) on this node; more get 503.
    pub max_upgrades: usize,
    /// Concurrent long-lived streams of one user; more get 429.
    pub max_upgrades_per_user: usize,
    /// How fast a request body streamed upstream must arrive; `None`: no
    /// bound.
    pub body_pace: Option<BodyPace>,
    pub connect_timeout: Duration,
    /// How long an unused upstream connection stays in the pool.
    pub pool_idle_timeout: Duration,
    pub pool_max_idle_per_host: usize,
    /// Whether bytes from the instance to the client on an upgraded
    /// connection count as activity (by default only the client's do, so
    /// a tab that only receives lets its instance idle).
    pub server_traffic_is_activity: bool,
    /// The header that presents an instance's launch token to it
    /// ([`crate::credential`]); `None`: the program gets no credential.
    pub credential: Option<CredentialHeader>,
}

impl Default for ForwardConfig {
    fn default() -> Self {
        Self {
            max_upgrades: 10_000,
            max_upgrades_per_user: 100,
            body_pace: Some(BodyPace::default()),
            connect_timeout: Duration::from_secs(5),
            pool_idle_timeout: Duration::from_secs(60),
            pool_max_idle_per_host: 64,
            server_traffic_is_activity: false,
            credential: None,
        }
    }
}

/// What the proxy knows about the client connection.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub peer: SocketAddr,
    /// The peer's IP as a header value, rendered once per connection.
    peer_ip: HeaderValue,
    /// The peer is a trusted proxy: its `X-Forwarded-*` headers stand.
    pub trusted: bool,
    /// The connection's slots under the server's caps, if it has any.
    permit: Option<Arc<ConnPermit>>,
}

impl ConnInfo {
    pub fn new(peer: SocketAddr, trusted: bool) -> Self {
        let peer_ip = HeaderValue::from_str(&peer.ip().to_string())
            .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        Self {
            peer,
            peer_ip,
            trusted,
            permit: None,
        }
    }

    /// The connection holds `permit` (the server's caps).
    #[must_use]
    pub fn with_permit(mut self, permit: Arc<ConnPermit>) -> Self {
        self.permit = Some(permit);
        self
    }

    /// Stops counting the connection against its address, once a request
    /// on it proved (by a valid signature) that another node sent it: a
    /// node may hold many connections to this one from a single address,
    /// and nodes on one host share it with every program there.
    pub fn exempt_from_address_cap(&self) {
        if let Some(permit) = &self.permit {
            permit.exempt();
        }
    }
}

/// Where one request goes.
#[derive(Debug, Clone)]
pub struct Upstream {
    pub user: Arc<UserId>,
    pub authority: Authority,
    pub path_and_query: PathAndQuery,
    /// How the address must be reached ([`berth_core::Endpoint::reach`]).
    pub reach: Reach,
    /// Retry a refused connection with backoff. Right for a local instance
    /// (it may be a moment from listening); wrong for another node, whose
    /// refusal means it is down: waiting there only delays the failover.
    pub retry_refused: bool,
}

/// The forward layer.
pub struct Forwarder {
    /// How long a connect inside a namespace may take (the connector has
    /// its own copy).
    connect_timeout: Duration,
    connector: HttpConnector,
    pool: Arc<Pool>,
    streams: Arc<StreamLimits>,
    body_pace: Option<BodyPace>,
    server_traffic_is_activity: bool,
    credential: Option<CredentialHeader>,
    spawner: Arc<dyn Spawner>,
    tasks: TaskTracker,
    cancel: CancellationToken,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("free_upgrades", &self.streams.free())
            .finish_non_exhaustive()
    }
}

/// Why one upstream attempt failed.
enum Failure {
    /// A pooled connection closed under the request: worth one more try on
    /// a fresh connection.
    Stale(BoxError),
    /// Nothing listens (yet): an instance that was just declared ready, or
    /// is being restarted. Worth a few tries with backoff.
    Refused(BoxError),
    Fatal(BoxError),
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why one exchange on a connection failed.
enum Attempt {
    /// The connection closed before the request was written; here it is
    /// back, body and all. Boxed: this is rare, and keeps every attempt's
    /// result small.
    Unsent(Box<Request<UpstreamBody>>, hyper::Error),
    Failed(Failure),
}

/// A send error after (part of) the request was written.
fn classify(e: hyper::Error) -> Failure {
    if is_stale_hyper(&e) {
        Failure::Stale(e.into())
    } else {
        Failure::Fatal(e.into())
    }
}

/// Connection-refused retries wait 25, 50, … 800 ms: about 1.5 s in all.
/// Some programs announce readiness a moment before they listen (Jupyter
/// Server logs its URL, then binds on the next loop turn).
const FIRST_CONNECT_BACKOFF: Duration = Duration::from_millis(25);
const LAST_CONNECT_BACKOFF: Duration = Duration::from_millis(800);

impl Forwarder {
    /// Background tasks (pool connections, tunnels) go to `tasks` and stop
    /// when `cancel` fires.
    pub fn new(
        config: &ForwardConfig,
        spawner: Arc<dyn Spawner>,
        tasks: TaskTracker,
        cancel: CancellationToken,
    ) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_keepalive(Some(Duration::from_secs(60)));
        let pool = Pool::start(
            config.pool_max_idle_per_host,
            config.pool_idle_timeout,
            tasks.clone(),
            cancel.clone(),
        );
        Self {
            connect_timeout: config.connect_timeout,
            connector,
            pool,
            streams: StreamLimits::new(config.max_upgrades, config.max_upgrades_per_user),
            body_pace: config.body_pace,
            server_traffic_is_activity: config.server_traffic_is_activity,
            credential: config.credential.clone(),
            spawner,
            tasks,
            cancel,
        }
    }

    /// Free upgrade slots (for tests and metrics).
    pub fn free_upgrades(&self) -> usize {
        self.streams.free()
    }

    /// The counts of long-lived streams, which the API's progress and log
    /// streams share with upgrades.
    pub fn streams(&self) -> &Arc<StreamLimits> {
        &self.streams
    }

    /// The client's body as sent upstream: paced, unless there is none.
    fn upstream_body(&self, body: Incoming) -> UpstreamBody {
        match self.body_pace {
            Some(pace) if !body.is_end_stream() => {
                Either::Right(Either::Left(Box::new(PacedBody::new(body, Some(pace)))))
            }
            _ => Either::Left(body),
        }
    }

    /// Forwards `req` to `to` and returns the upstream's response, or a
    /// 502/503 of our own.
    pub async fn forward(
        &self,
        mut req: Request<Incoming>,
        to: Upstream,
        conn: &ConnInfo,
        keep_forwarded_user: bool,
    ) -> Response<ProxyBody> {
        // The touch answers whether the main is hibernated (read after the
        // touch, see the controller's `Slot::hibernated`): a hibernated
        // instance is thawed before its request goes out, with no store on
        // the way.
        let hibernated = self.spawner.touch(&to.user);
        if hibernated && let Err(e) = self.spawner.resume(&to.user).await {
            tracing::warn!(user = %to.user, error = %e, "could not resume the instance");
        }
        let upgrade = wants_upgrade(req.headers());
        let mut upgrade_slot = None;
        let client_upgrade = if upgrade {
            match self.streams.acquire(&to.user) {
                Ok(permit) => upgrade_slot = Some(permit),
                Err(refused) => return stream_refused(&refused),
            }
            Some(hyper::upgrade::on(&mut req))
        } else {
            None
        };

        let (mut parts, body) = req.into_parts();
        let head = parts.method == Method::HEAD;
        rewrite_request_headers(&mut parts.headers, conn, upgrade, keep_forwarded_user);
        parts.version = Version::HTTP_11;
        // The instance's own secret: presented to it, kept from the client.
        let launch_token = self
            .spawner
            .launch_token(&to.user)
            .filter(|t| !t.is_empty());
        if let Some(token) = &launch_token {
            if let Some(credential) = &self.credential {
                credential.present(&mut parts.headers, token);
            }
            // Plain bodies, so that the token can be found in them.
            parts.headers.insert(
                header::ACCEPT_ENCODING,
                HeaderValue::from_static("identity"),
            );
        }

        // Origin-form: the request line carries the path only. The
        // client's Host is passed through as it is: apps check it against
        // Origin (WebSocket) and build absolute URLs from it.
        parts.uri = Uri::from(to.path_and_query.clone());
        let result = if upgrade {
            let body = self.upstream_body(body);
            Box::pin(self.send_upgrade(&to, Request::from_parts(parts, body))).await
        } else {
            self.send(&to, parts, body).await
        };
        let mut response = match result {
            Ok(response) => response,
            Err(Failure::Stale(e) | Failure::Refused(e) | Failure::Fatal(e)) => {
                if BodyTooSlow::caused(e.as_ref()) {
                    tracing::debug!(user = %to.user, error = %e, "request body too slow; cut off");
                    return body_too_slow(&e);
                }
                tracing::debug!(user = %to.user, upstream = %to.authority, error = %e, "upstream request failed");
                return bad_gateway("the instance did not answer");
            }
        };

        let switched = response.status() == StatusCode::SWITCHING_PROTOCOLS;
        if let (true, Some(client_upgrade), Some(permit)) = (switched, client_upgrade, upgrade_slot)
        {
            let upstream_upgrade = hyper::upgrade::on(&mut response);
            // The protocol switched to is the one the answer names.
            let websocket = upgrades_to_websocket(response.headers());
            self.spawn_tunnel(
                client_upgrade,
                upstream_upgrade,
                permit,
                to.user.clone(),
                websocket,
            );
        }
        strip_hop_by_hop(response.headers_mut(), switched);
        if switched {
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        }
        if let Some(token) = &launch_token {
            scrub_headers(response.headers_mut(), token);
            // Only an answer that has a body has one to scrub (and keeps
            // its Content-Length otherwise).
            let bodiless = switched
                || head
                || matches!(
                    response.status(),
                    StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED
                );
            if let Some(scrubber) = Scrubber::new(token).filter(|_| !bodiless) {
                response.headers_mut().remove(header::CONTENT_LENGTH);
                return response.map(|body| Either::Left(body.scrubbed(scrubber)));
            }
        }
        response.map(Either::Left)
    }

    /// Sends a plain (not upgrading) request on a pooled or new upstream
    /// connection, driven by this task until the response head arrives.
    ///
    /// The connection is in hand before the request is built, so a refused
    /// connect (nothing listens yet) has consumed nothing and is retried
    /// with backoff whatever the method or body. Once a request was written
    /// it can only be sent again if it can be rebuilt without its body, so
    /// only a bodiless idempotent request on a pooled connection (which may
    /// have gone stale while idle) keeps a copy of its head for one more
    /// try; everything else moves straight into the request.
    async fn send(
        &self,
        to: &Upstream,
        parts: hyper::http::request::Parts,
        body: Incoming,
    ) -> Result<Response<ForwardedBody>, Failure> {
        let (mut conn, mut reused) = match self.pool.checkout(&to.authority, &to.reach) {
            Some(conn) => (conn, true),
            // Boxed: connecting is rare, and its future is large.
            None => (Box::pin(self.connect_patiently(to)).await?, false),
        };
        let mut again =
            (reused && is_idempotent(&parts.method) && body.is_end_stream()).then(|| {
                (
                    parts.method.clone(),
                    parts.uri.clone(),
                    parts.headers.clone(),
                )
            });
        let mut req = Request::from_parts(parts, self.upstream_body(body));
        loop {
            match self.attempt(&to.authority, conn, req).await {
                Ok(response) => return Ok(response),
                // The pooled connection closed before the request was
                // written: hyper hands it back, so any method goes again.
                Err(Attempt::Unsent(unsent, e)) if reused => {
                    tracing::debug!(error = %e, "pooled upstream connection closed before sending; retrying");
                    req = *unsent;
                }
                Err(Attempt::Unsent(_, e)) => return Err(classify(e)),
                Err(Attempt::Failed(Failure::Stale(e))) => {
                    let Some((method, uri, headers)) = again.take() else {
                        return Err(Failure::Stale(e));
                    };
                    tracing::debug!(user = %to.user, error = %e, "stale upstream connection; retrying once");
                    let mut rebuilt = Request::new(no_body());
                    *rebuilt.method_mut() = method;
                    *rebuilt.uri_mut() = uri;
                    *rebuilt.headers_mut() = headers;
                    *rebuilt.version_mut() = Version::HTTP_11;
                    req = rebuilt;
                }
                Err(Attempt::Failed(failure)) => return Err(failure),
            }
            conn = Box::pin(self.connect_patiently(to)).await?;
            reused = false;
        }
    }

    /// One exchange on `conn`, up to the response head. On success the
    /// connection travels inside the response body and returns to the pool
    /// when that is finished.
    async fn attempt(
        &self,
        to: &Authority,
        mut conn: Conn,
        req: Request<UpstreamBody>,
    ) -> Result<Response<ForwardedBody>, Attempt> {
        let mut response = std::pin::pin!(conn.sender.try_send_request(req));
        let result = std::future::poll_fn(|cx| {
            conn.poll_io(cx);
            response.as_mut().poll(cx)
        })
        .await;
        match result {
            Ok(response) => {
                let pool = self.pool.clone();
                let key = to.clone();
                Ok(response.map(|body| ForwardedBody::pooled(body, conn, pool, key)))
            }
            Err(mut e) => match e.take_message() {
                Some(unsent) => Err(Attempt::Unsent(Box::new(unsent), e.into_error())),
                None => Err(Attempt::Failed(classify(e.into_error()))),
            },
        }
    }

    /// A new connection; a refused one is tried again with backoff (about
    /// 1.5 s in all) when `retry_refused` says the upstream is a local
    /// instance that may be a moment from listening.
    async fn connect_patiently(&self, to: &Upstream) -> Result<Conn, Failure> {
        let stream = self.open_patiently(to).await?;
        let (sender, io) = hyper::client::conn::http1::handshake(stream)
            .await
            .map_err(|e| Failure::Fatal(e.into()))?;
        Ok(Conn::new(sender, io, to.reach.clone()))
    }

    /// [`Self::open`], with the retries of a refused connection that
    /// `retry_refused` asks for.
    async fn open_patiently(&self, to: &Upstream) -> Result<TokioIo<TcpStream>, Failure> {
        let mut backoff = FIRST_CONNECT_BACKOFF;
        loop {
            match self.open(to).await {
                Err(Failure::Refused(_)) if to.retry_refused && backoff <= LAST_CONNECT_BACKOFF => {
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                }
                other => return other,
            }
        }
    }

    /// A new TCP connection to `to`, set up like hyper's pooled client's,
    /// made in `to.reach.netns` and checked to reach a socket of
    /// `to.reach.owner`'s.
    async fn open(&self, to: &Upstream) -> Result<TokioIo<TcpStream>, Failure> {
        if let Some(netns) = &to.reach.netns {
            return self.open_in(netns, to).await;
        }
        let uri = Uri::from_parts({
            let mut p = hyper::http::uri::Parts::default();
            p.scheme = Some(Scheme::HTTP);
            p.authority = Some(to.authority.clone());
            p.path_and_query = Some(PathAndQuery::from_static("/"));
            p
        })
        .map_err(|e| Failure::Fatal(e.into()))?;
        let mut connector = self.connector.clone();
        let io = match tower_service::Service::call(&mut connector, uri).await {
            Ok(io) => io,
            Err(e) => {
                return Err(
                    if error_chain_has(&e, |io| io.kind() == io::ErrorKind::ConnectionRefused) {
                        Failure::Refused(e.into())
                    } else {
                        Failure::Fatal(e.into())
                    },
                );
            }
        };
        if let Some(owner) = to.reach.owner {
            check_owner(io.inner(), to, owner)?;
        }
        Ok(io)
    }

    /// A new TCP connection to `to` inside the network namespace `netns`
    /// (a sandboxed instance's, where no other account's program listens:
    /// no owner to check).
    async fn open_in(&self, netns: &Path, to: &Upstream) -> Result<TokioIo<TcpStream>, Failure> {
        let addr: SocketAddr = to
            .authority
            .as_str()
            .parse()
            .map_err(|e: std::net::AddrParseError| Failure::Fatal(e.into()))?;
        match berth_localnet::connect_in(netns, addr, self.connect_timeout).await {
            Ok(stream) => {
                stream
                    .set_nodelay(true)
                    .map_err(|e| Failure::Fatal(e.into()))?;
                Ok(TokioIo::new(stream))
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                Err(Failure::Refused(e.into()))
            }
            Err(e) => Err(Failure::Fatal(e.into())),
        }
    }

    /// Sends an upgrade request on a connection of its own, whose task
    /// (cancelled at shutdown) hands the upgraded stream over. Never
    /// retried once sent: the client's handshake is not ours to repeat.
    async fn send_upgrade(
        &self,
        to: &Upstream,
        req: Request<UpstreamBody>,
    ) -> Result<Response<ForwardedBody>, Failure> {
        let stream = self.open_patiently(to).await?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(stream)
            .await
            .map_err(|e| Failure::Fatal(e.into()))?;
        let cancel = self.cancel.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                result = connection.with_upgrades() => {
                    if let Err(e) = result {
                        tracing::debug!(error = %e, "upgrade connection ended with an error");
                    }
                }
                () = cancel.cancelled() => {}
            }
        });
        match sender.send_request(req).await {
            Ok(response) => Ok(response.map(ForwardedBody::plain)),
            Err(e) => Err(classify(e)),
        }
    }

    fn spawn_tunnel(
        &self,
        client: hyper::upgrade::OnUpgrade,
        upstream: hyper::upgrade::OnUpgrade,
        permit: StreamPermit,
        user: Arc<UserId>,
        websocket: bool,
    ) {
        let spawner = self.spawner.clone();
        let cancel = self.cancel.clone();
        let server_counts = self.server_traffic_is_activity;
        let tasks = self.tasks.clone();
        self.tasks.spawn(async move {
            let _permit = permit;
            let tunnel = async {
                let (client, upstream) = match tokio::try_join!(client, upstream) {
                    Ok(both) => both,
                    Err(e) => {
                        tracing::debug!(%user, error = %e, "upgrade did not complete");
                        return;
                    }
                };
                // What the client sends is activity, and wakes a hibernated
                // instance (on a WebSocket, its data frames only); what the
                // instance sends counts only if so configured.
                let mut client = Touching::new(
                    TokioIo::new(client),
                    spawner.clone(),
                    user.clone(),
                    Reads::Wake(tasks),
                );
                if websocket {
                    client.frames = Some(ClientFrames::new());
                }
                let upstream_reads = if server_counts {
                    Reads::Touch
                } else {
                    Reads::Ignore
                };
                let mut upstream = Touching::new(
                    TokioIo::new(upstream),
                    spawner,
                    user.clone(),
                    upstream_reads,
                );
                match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
                    Ok((up, down)) => tracing::debug!(%user, up, down, "tunnel closed"),
                    Err(e) => tracing::debug!(%user, error = %e, "tunnel ended with an error"),
                }
            };
            tokio::select! {
                () = tunnel => {}
                () = cancel.cancelled() => {}
            }
        });
    }
}

/// Fails unless the socket at the other end of `stream` belongs to `owner`.
fn check_owner(stream: &TcpStream, to: &Upstream, owner: u32) -> Result<(), Failure> {
    berth_localnet::check_owner(stream, owner).map_err(|e| {
        if matches!(e, berth_localnet::SockDiagError::Foreign { .. }) {
            tracing::warn!(user = %to.user, error = %e, "refusing to forward to a socket of another account");
        }
        Failure::Fatal(e.into())
    })
}

fn bad_gateway(message: &str) -> Response<ProxyBody> {
    respond::json_error(StatusCode::BAD_GATEWAY, "bad_gateway", message, &[])
}

/// An upgrade refused: `503 too_many_upgrades` when the node is full (the
/// proxy's code for it since before the per-user cap), `429
/// too_many_streams` when the user is at their own cap.
fn stream_refused(refused: &StreamRefused) -> Response<ProxyBody> {
    match refused {
        StreamRefused::Total(_) => respond::json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_upgrades",
            &refused.to_string(),
            &[],
        ),
        StreamRefused::PerUser { .. } => {
            respond::code_error(ErrorCode::TooManyStreams, &refused.to_string())
        }
    }
}

/// The client fell behind its body's pace: 408, and the connection closes
/// (the rest of the body is never read).
fn body_too_slow(error: &BoxError) -> Response<ProxyBody> {
    let message = error_chain_text(error.as_ref());
    let mut response = respond::code_error(ErrorCode::RequestTimeout, &message);
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// The message of the [`BodyTooSlow`] in `error`'s chain.
fn error_chain_text(error: &(dyn std::error::Error + 'static)) -> String {
    let mut source = Some(error);
    while let Some(e) = source {
        if let Some(slow) = e.downcast_ref::<BodyTooSlow>() {
            return slow.to_string();
        }
        source = e.source();
    }
    error.to_string()
}

fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE
    )
}

/// Did the request fail because a (pooled) connection was closed under it,
/// before any response arrived?
fn is_stale_hyper(error: &hyper::Error) -> bool {
    is_stale_cause(error)
}

fn is_stale_cause(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(error);
    while let Some(e) = source {
        if let Some(h) = e.downcast_ref::<hyper::Error>()
            && (h.is_incomplete_message() || h.is_canceled())
        {
            return true;
        }
        if let Some(io) = e.downcast_ref::<io::Error>()
            && matches!(
                io.kind(),
                io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
                    | io::ErrorKind::UnexpectedEof
            )
        {
            return true;
        }
        source = e.source();
    }
    false
}

/// Does `error` or any of its causes satisfy `test`?
fn error_chain_has(
    error: &(dyn std::error::Error + 'static),
    test: impl Fn(&io::Error) -> bool,
) -> bool {
    let mut source = Some(error);
    while let Some(e) = source {
        if e.downcast_ref::<io::Error>().is_some_and(&test) {
            return true;
        }
        source = e.source();
    }
    false
}

/// `Connection: upgrade` together with an `Upgrade` header.
pub fn wants_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE) && lists_token(headers, header::CONNECTION, "upgrade")
}

/// `Upgrade: websocket` (a token of the list, in any case).
pub fn upgrades_to_websocket(headers: &HeaderMap) -> bool {
    lists_token(headers, header::UPGRADE, "websocket")
}

/// Whether any `name` header's comma-separated list holds `token` (in any
/// case).
fn lists_token(headers: &HeaderMap, name: header::HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Removes hop-by-hop headers: the fixed set and every header `Connection`
/// names. With `keep_upgrade`, `Upgrade` survives (the caller sets
/// `Connection: upgrade` again).
pub fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    // Most messages carry none of these: one pass over the names is then
    // all it costs, instead of a lookup per hop-by-hop name.
    if !headers.keys().any(is_hop_by_hop_name) {
        return;
    }
    let upgrade = if keep_upgrade {
        headers.get(header::UPGRADE).cloned()
    } else {
        None
    };
    // Browsers send one `Connection` value on nearly every request; only the
    // rare request with several pays for a list.
    let mut connection = headers.get_all(header::CONNECTION).iter();
    let several = connection.next().is_some() && connection.next().is_some();
    if several {
        let values: Vec<HeaderValue> = headers
            .get_all(header::CONNECTION)
            .iter()
            .cloned()
            .collect();
        for value in &values {
            remove_named(headers, value);
        }
    } else if let Some(value) = headers.remove(header::CONNECTION) {
        remove_named(headers, &value);
        // Usually `Connection: keep-alive` was the only one.
        if !headers.keys().any(is_hop_by_hop_name) {
            if let Some(upgrade) = upgrade {
                headers.insert(header::UPGRADE, upgrade);
            }
            return;
        }
    }
    for name in hop_by_hop() {
        headers.remove(name);
    }
    // Any other `Proxy-*`, and a bare `Proxy` (httpoxy: CGI-style programs
    // would read it as HTTP_PROXY). Rare, so only a hit pays for the list.
    let is_proxy_header = |name: &HeaderName| {
        let name = name.as_str();
        name == "proxy" || name.starts_with("proxy-")
    };
    if headers.keys().any(is_proxy_header) {
        let names: Vec<HeaderName> = headers
            .keys()
            .filter(|n| is_proxy_header(n))
            .cloned()
            .collect();
        for name in names {
            headers.remove(name);
        }
    }
    if let Some(upgrade) = upgrade {
        headers.insert(header::UPGRADE, upgrade);
    }
}

/// A fixed hop-by-hop header, `Proxy`, or any `Proxy-*`.
fn is_hop_by_hop_name(name: &HeaderName) -> bool {
    hop_by_hop().into_iter().any(|h| h == name) || {
        let name = name.as_str();
        name == "proxy" || name.starts_with("proxy-")
    }
}

fn remove_named(headers: &mut HeaderMap, connection: &HeaderValue) {
    let Ok(value) = connection.to_str() else {
        return;
    };
    for token in value.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        // `close`, `keep-alive`, `upgrade` are options, not header names
        // worth a lookup (keep-alive and upgrade are removed anyway).
        if ["close", "keep-alive", "upgrade"]
            .iter()
            .any(|o| token.eq_ignore_ascii_case(o))
        {
            continue;
        }
        headers.remove(token);
    }
}

/// The request headers as the instance sees them.
pub fn rewrite_request_headers(
    headers: &mut HeaderMap,
    conn: &ConnInfo,
    upgrade: bool,
    keep_forwarded_user: bool,
) {
    strip_hop_by_hop(headers, upgrade);
    // Room for the X-Forwarded-* headers: one growth at most.
    headers.reserve(3);
    if upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    // berth already answered `Expect: 100-continue` by reading the body.
    headers.remove(header::EXPECT);
    if !keep_forwarded_user {
        headers.remove(&crate::auth::FORWARDED_USER);
    }
    let forwarded_for = match headers.get(&X_FORWARDED_FOR) {
        None => conn.peer_ip.clone(),
        Some(existing) => {
            let mut joined = Vec::with_capacity(existing.len() + 2 + conn.peer_ip.len());
            joined.extend_from_slice(existing.as_bytes());
            joined.extend_from_slice(b", ");
            joined.extend_from_slice(conn.peer_ip.as_bytes());
            HeaderValue::from_maybe_shared(Bytes::from(joined))
                .unwrap_or_else(|_| conn.peer_ip.clone())
        }
    };
    headers.insert(X_FORWARDED_FOR.clone(), forwarded_for);
    if !(conn.trusted && headers.contains_key(&X_FORWARDED_PROTO)) {
        headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
    }
    if !(conn.trusted && headers.contains_key(&X_FORWARDED_HOST)) {
        match headers.get(header::HOST).cloned() {
            Some(host) => {
                headers.insert(X_FORWARDED_HOST.clone(), host);
            }
            None => {
                headers.remove(&X_FORWARDED_HOST);
            }
        }
    }
}

/// What reading from one side of a tunnel means.
enum Reads {
    /// Nothing: the bytes are not activity.
    Ignore,
    /// Activity.
    Touch,
    /// Activity, and a hibernated instance is resumed (on a task of the
    /// proxy's; the bytes wait in the socket until the program runs).
    Wake(TaskTracker),
}

/// An upgraded stream that reports reads as user activity, at most once
/// per [`TUNNEL_TOUCH_EVERY`] (a count, never a store write per frame).
struct Touching<T> {
    io: T,
    spawner: Arc<dyn Spawner>,
    user: Arc<UserId>,
    reads: Reads,
    last_touch: Option<Instant>,
    /// A WebSocket client's frames: only reads that carry data frames are
    /// activity. `None`: every read is.
    frames: Option<ClientFrames>,
}

impl<T> Touching<T> {
    fn new(io: T, spawner: Arc<dyn Spawner>, user: Arc<UserId>, reads: Reads) -> Self {
        Self {
            io,
            spawner,
            user,
            reads,
            last_touch: None,
            frames: None,
        }
    }

    fn report(&mut self) {
        if matches!(self.reads, Reads::Ignore) {
            return;
        }
        let now = Instant::now();
        if self
            .last_touch
            .is_some_and(|last| now.duration_since(last) < TUNNEL_TOUCH_EVERY)
        {
            return;
        }
        self.last_touch = Some(now);
        let hibernated = self.spawner.touch(&self.user);
        if let Reads::Wake(tasks) = &self.reads
            && hibernated
        {
            let (spawner, user) = (self.spawner.clone(), self.user.clone());
            tasks.spawn(async move {
                if let Err(e) = spawner.resume(&user).await {
                    tracing::warn!(%user, error = %e, "could not resume the instance");
                }
            });
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Touching<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let result = Pin::new(&mut this.io).poll_read(cx, buf);
        if matches!(result, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            let active = match &mut this.frames {
                Some(frames) => {
                    let was_opaque = frames.is_opaque();
                    let active = frames.feed(&buf.filled()[before..]);
                    if frames.is_opaque() && !was_opaque {
                        tracing::debug!(user = %this.user, "unreadable WebSocket frames; every byte is activity now");
                    }
                    active
                }
                None => true,
            };
            if active {
                this.report();
            }
        }
        result
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Touching<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(trusted: bool) -> ConnInfo {
        ConnInfo::new("10.1.2.3:5555".parse().unwrap(), trusted)
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut h = headers(&[
            ("connection", "keep-alive, X-Secret"),
            ("connection", "x-other"),
            ("x-secret", "1"),
            ("x-other", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-authorization", "Basic x"),
            ("proxy", "http://evil:3128"),
            ("proxy-whatever", "1"),
            ("te", "trailers"),
            ("trailer", "x"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("host", "berth.test"),
            ("accept", "*/*"),
        ]);
        rewrite_request_headers(&mut h, &conn(false), false, false);
        let mut names: Vec<_> = h.keys().map(|k| k.as_str().to_owned()).collect();
        names.sort();
        assert_eq!(
            names,
            [
                "accept",
                "host",
                "x-forwarded-for",
                "x-forwarded-host",
                "x-forwarded-proto"
            ]
        );
    }

    #[test]
    fn upgrades_keep_upgrade() {
        let mut h = headers(&[
            ("connection", "Upgrade"),
            ("upgrade", "websocket"),
            ("host", "h"),
        ]);
        assert!(wants_upgrade(&h));
        rewrite_request_headers(&mut h, &conn(false), true, false);
        assert_eq!(h[header::UPGRADE], "websocket");
        assert_eq!(h[header::CONNECTION], "upgrade");
        assert!(!wants_upgrade(&headers(&[("upgrade", "websocket")])));
        assert!(!wants_upgrade(&headers(&[("connection", "upgrade")])));
    }

    #[test]
    fn websocket_upgrades_are_told_from_others() {
        assert!(upgrades_to_websocket(&headers(&[("upgrade", "websocket")])));
        assert!(upgrades_to_websocket(&headers(&[("upgrade", "WebSocket")])));
        assert!(upgrades_to_websocket(&headers(&[(
            "upgrade",
            "foo, websocket"
        )])));
        assert!(!upgrades_to_websocket(&headers(&[("upgrade", "h2c")])));
        assert!(!upgrades_to_websocket(&headers(&[(
            "upgrade",
            "websockets"
        )])));
        assert!(!upgrades_to_websocket(&headers(&[])));
    }

    #[test]
    fn forwarded_headers_are_set_or_kept_from_trusted_peers() {
        let spoofed = [
            ("host", "berth.test:8000"),
            ("x-forwarded-for", "1.1.1.1"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "evil"),
            ("x-forwarded-user", "admin"),
        ];
        let mut h = headers(&spoofed);
        rewrite_request_headers(&mut h, &conn(false), false, false);
        assert_eq!(h["x-forwarded-for"], "1.1.1.1, 10.1.2.3");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "berth.test:8000");
        assert!(!h.contains_key("x-forwarded-user"));
        let mut h = headers(&spoofed);
        rewrite_request_headers(&mut h, &conn(true), false, true);
        assert_eq!(h["x-forwarded-proto"], "https");
        assert_eq!(h["x-forwarded-host"], "evil");
        assert_eq!(h["x-forwarded-user"], "admin");
        let mut h = headers(&[("host", "h")]);
        rewrite_request_headers(&mut h, &conn(false), false, false);
        assert_eq!(h["x-forwarded-for"], "10.1.2.3");
    }
}
