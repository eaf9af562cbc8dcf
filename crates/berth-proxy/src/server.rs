//! The HTTP/1.1 server in front of everything: accepts connections, applies
//! connection-level limits, and sends each request to the proxy or to the
//! fallback service (berth's API). [`serve_plain`] serves a fallback alone
//! under the same limits (berth's node-to-node API, on its own listener).
//!
//! Limits: a cap on open connections, in all and per client address (a
//! connection over either is closed at once, before anything is read; one
//! on which a request proved, by its signature, that another node sent it
//! stops counting against its address: [`ConnInfo::exempt_from_address_cap`]); a
//! header read timeout (a slowloris client is cut off; it also closes
//! idle keep-alive connections); a request header size limit (hyper
//! answers `431`); a minimum pace for request bodies (a trickling client
//! is cut off, see [`crate::pace`]); and the proxy's caps on long-lived
//! streams. On shutdown the listener closes, idle connections close,
//! in-flight requests get `shutdown_grace` to finish, and whatever is left
//! is then cut.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Either;
use hyper::body::{Body, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower_service::Service;

use crate::conn::ConnInfo;
use crate::limits::ConnLimits;
use crate::pace::{BodyPace, PacedBody};
use crate::proxy::{Proxy, route_error};
use crate::respond::ProxyBody;
use crate::route::Class;

/// The request bodies the server hands its fallback (berth's API): the
/// client's stream, bounded in pace ([`crate::pace`]). The proxy paces the
/// bodies it forwards itself, and only those it has to read.
pub type RequestBody = PacedBody<Incoming>;

/// Connection-level settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// A client must send its complete request head within this time.
    pub header_read_timeout: Duration,
    /// Largest request head (request line and headers); larger gets 431.
    pub max_header_bytes: usize,
    /// How long in-flight requests may run on after shutdown begins.
    pub shutdown_grace: Duration,
    /// Open client connections at most; one more is closed at once.
    pub max_connections: usize,
    /// Open connections at most from one client address (an IPv4 address
    /// or an IPv6 /64); trusted proxies, and connections that carried a
    /// request signed by another node, count only towards the total.
    pub max_connections_per_ip: usize,
    /// How fast the bodies of requests for the fallback (berth's API) must
    /// arrive; `None`: no bound. The proxy's own are paced by
    /// [`crate::forward::ForwardConfig::body_pace`].
    pub body_pace: Option<BodyPace>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            max_header_bytes: 64 * 1024,
            shutdown_grace: Duration::from_secs(10),
            max_connections: 10_000,
            max_connections_per_ip: 1000,
            body_pace: Some(BodyPace::default()),
        }
    }
}

/// The response body of the server: the proxy's or the fallback's.
pub type ServerBody<B> = Either<ProxyBody, B>;

struct Shared<F> {
    /// `None`: every request goes to the fallback ([`serve_plain`]).
    proxy: Option<Arc<Proxy>>,
    fallback: F,
    /// For the fallback's bodies; the proxy paces the bodies it forwards
    /// itself (only those it reads).
    body_pace: Option<BodyPace>,
}

impl<F, B> Shared<F>
where
    F: Service<Request<RequestBody>, Response = Response<B>, Error = Infallible> + Clone,
{
    async fn dispatch(&self, req: Request<Incoming>, conn: &ConnInfo) -> Response<ServerBody<B>> {
        let class = match &self.proxy {
            Some(proxy) => proxy.classify(&req),
            None => Class::Fallback,
        };
        match class {
            Class::Proxy => match &self.proxy {
                Some(proxy) => proxy.handle(req, conn).await.map(Either::Left),
                None => unreachable!("only a proxy classifies a request as its own"),
            },
            Class::Fallback => {
                let mut req = req;
                // The API reads the peer's facts (is it a trusted proxy
                // that says https?) from here.
                req.extensions_mut().insert(conn.clone());
                let mut service = self.fallback.clone();
                if let Err(never) = std::future::poll_fn(|cx| service.poll_ready(cx)).await {
                    match never {}
                }
                let req = req.map(|body| PacedBody::new(body, self.body_pace));
                match service.call(req).await {
                    Ok(response) => response.map(Either::Right),
                    Err(never) => match never {},
                }
            }
            Class::Reject(error) => route_error(&error, &req).map(Either::Left),
        }
    }
}

/// Serves `listener` until `shutdown` completes, then drains.
///
/// Requests for user routes go to `proxy`; everything else to `fallback`
/// (for berth, the API router, with its bodies paced by
/// [`ServerConfig::body_pace`]). Does not stop the proxy's own background
/// tasks: call [`Proxy::shutdown`] afterwards.
pub async fn serve<F, B>(
    listener: TcpListener,
    config: ServerConfig,
    proxy: Arc<Proxy>,
    fallback: F,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()>
where
    F: Service<Request<RequestBody>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    F::Future: Send,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    serve_with(listener, config, Some(proxy), fallback, shutdown).await
}

/// [`serve`] without a proxy: every request goes to `fallback`, under the
/// same connection limits, timeouts, body pace and drain.
pub async fn serve_plain<F, B>(
    listener: TcpListener,
    config: ServerConfig,
    fallback: F,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()>
where
    F: Service<Request<RequestBody>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    F::Future: Send,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    serve_with(listener, config, None, fallback, shutdown).await
}

async fn serve_with<F, B>(
    listener: TcpListener,
    config: ServerConfig,
    proxy: Option<Arc<Proxy>>,
    fallback: F,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()>
where
    F: Service<Request<RequestBody>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    F::Future: Send,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(config.header_read_timeout)
        .max_header_size(config.max_header_bytes)
        .keep_alive(true);
    let http = Arc::new(http);
    let shared = Arc::new(Shared {
        proxy,
        fallback,
        body_pace: config.body_pace,
    });
    let limits = ConnLimits::new(config.max_connections, config.max_connections_per_ip);
    let connections = TaskTracker::new();
    let draining = CancellationToken::new();
    let cut = CancellationToken::new();

    tokio::pin!(shutdown);
    let mut accept_backoff = Duration::from_millis(5);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => {
                    accept_backoff = Duration::from_millis(5);
                    accepted
                }
                Err(e) => {
                    // Out of file descriptors and the like: keep serving the
                    // connections we have and try again shortly.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(accept_backoff).await;
                    accept_backoff = (accept_backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            },
        };
        let conn = match &shared.proxy {
            Some(proxy) => proxy.conn_info(peer),
            None => ConnInfo::new(peer, false),
        };
        let permit = match limits.admit(peer.ip(), conn.trusted) {
            Ok(permit) => permit,
            Err(refused) => {
                // Closed before anything is read or spent on it. Debug, not
                // warn: a flood would otherwise flood the log too.
                tracing::debug!(%peer, %refused, "connection refused");
                drop(stream);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        // The permit lives as long as the connection's requests can reach
        // it: a request that proves another node sent it lifts the
        // per-address count.
        let conn = Arc::new(conn.with_permit(Arc::new(permit)));
        let shared = shared.clone();
        let http = http.clone();
        let draining = draining.clone();
        let cut = cut.clone();
        connections.spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let shared = shared.clone();
                let conn = conn.clone();
                async move { Ok::<_, Infallible>(shared.dispatch(req, &conn).await) }
            });
            let connection = http
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            tokio::pin!(connection);
            let result = tokio::select! {
                result = connection.as_mut() => result,
                () = draining.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    tokio::select! {
                        result = connection.as_mut() => result,
                        () = cut.cancelled() => Ok(()),
                    }
                }
            };
            if let Err(e) = result {
                // Timeouts, resets and malformed requests are the client's
                // business; hyper has answered what could be answered.
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }

    drop(listener);
    tracing::debug!(open = connections.len(), "draining connections");
    draining.cancel();
    connections.close();
    if tokio::time::timeout(config.shutdown_grace, connections.wait())
        .await
        .is_err()
    {
        tracing::info!(
            open = connections.len(),
            "shutdown grace period over; closing the remaining connections"
        );
        cut.cancel();
        connections.wait().await;
    }
    Ok(())
}
