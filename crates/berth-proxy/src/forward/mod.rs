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
//!   a WebSocket is activity only in data frames
//!   ([`ClientFrames`](crate::ws_activity::ClientFrames): a browser's
//!   automatic pongs are not the user's); through any other upgrade, every
//!   byte is.
//! * A request body that falls behind its pace ([`crate::pace`]) fails the
//!   exchange with `408 request_timeout`, and the client connection closes.
//!
//! The header rules (what is hop-by-hop, the `X-Forwarded-*` headers,
//! telling an upgrade) are in `headers.rs`; the byte tunnel an upgraded
//! connection becomes, with its activity reports, in `tunnel.rs`.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use berth_core::{ErrorCode, Reach, Traffic, UserId};
use http_body_util::{Either, Empty};
use hyper::body::{Body as _, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::http::uri::{Authority, PathAndQuery, Scheme};
use hyper::{Method, Request, Response, StatusCode, Uri, Version};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::credential::{CredentialHeader, Scrubber, scrub_headers};
use crate::limits::{StreamLimits, StreamPermit, StreamRefused};
use crate::pace::{BodyPace, BodyTooSlow, PacedBody};
use crate::pool::{Conn, ForwardedBody, Pool};
use crate::respond::{self, ProxyBody};

mod headers;
mod tunnel;

pub use crate::conn::ConnInfo;
pub use crate::upstream_body::UpstreamBody;
pub use headers::{
    rewrite_request_headers, strip_hop_by_hop, upgrades_to_websocket, wants_upgrade,
};

fn no_body() -> UpstreamBody {
    Either::Right(Either::Right(Empty::new()))
}

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
    /// How long setting up a new upstream connection may take.
    pub connect_timeout: Duration,
    /// How long an unused upstream connection stays in the pool.
    pub pool_idle_timeout: Duration,
    /// Idle upstream connections kept per endpoint; one more is closed
    /// instead of pooled.
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

/// Where one request goes.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// The user whose instance this is: the request counts as their
    /// activity, and an upgrade against their cap on streams.
    pub user: Arc<UserId>,
    /// The instance's `host:port`.
    pub authority: Authority,
    /// The request target sent upstream: the path (without `/u/<user>` when
    /// the prefix is stripped) and the query.
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
    spawner: Arc<dyn Traffic>,
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
        spawner: Arc<dyn Traffic>,
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
            let tunnel = tunnel::run(
                client,
                upstream,
                spawner,
                user,
                tasks,
                server_counts,
                websocket,
            );
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
    respond::code_error(ErrorCode::BadGateway, message)
}

/// An upgrade refused: `503 too_many_upgrades` when the node is full (the
/// proxy's code for it since before the per-user cap), `429
/// too_many_streams` when the user is at their own cap.
fn stream_refused(refused: &StreamRefused) -> Response<ProxyBody> {
    match refused {
        StreamRefused::Total(_) => {
            respond::code_error(ErrorCode::TooManyUpgrades, &refused.to_string())
        }
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
