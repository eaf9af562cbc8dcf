//! Test support: a `Traffic` test double, a real upstream hyper server on
//! loopback, the proxy's server on loopback, and raw-socket clients.

#![allow(dead_code)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use berth_core::{
    BreakerInfo, Endpoint, Instance, InstanceEvent, InstanceStatus, LaunchRequest, Role,
    SpawnError, Traffic, UserId, unix_millis_now,
};
use berth_proxy::auth::{AuthError, Authenticator, TokenHash, TokenStore, UserTokenInfo};
use berth_proxy::{Proxy, ProxyConfig, ServerConfig};
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, broadcast, oneshot};

pub const ADMIN: &str = "admin-token";
pub const ALICE: &str = "alice-token";
pub const BOB: &str = "bob-token";

/// Generous bound for anything that should happen "soon"; only a hang
/// reaches it.
pub const PATIENCE: Duration = Duration::from_secs(20);

pub fn user(s: &str) -> UserId {
    UserId::parse(s).unwrap()
}

/// Polls `check` until it returns `Some`, or panics after [`PATIENCE`].
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// --- the Traffic test double ----------------------------------------------

/// Test double: routes to a fixed upstream; the real controller (over
/// the local runtime) is exercised in crates/berth/tests/it/proxy.rs and
/// proxy_e2e.rs.
///
/// `launch` marks the user starting and, after `start_delay`, running on
/// the configured upstream, publishing events like the real spawner.
pub struct StaticTraffic {
    inner: Arc<TrafficState>,
}

pub struct TrafficState {
    upstream: Mutex<Endpoint>,
    instances: Mutex<HashMap<UserId, Instance>>,
    endpoints: Mutex<HashMap<UserId, Endpoint>>,
    events: broadcast::Sender<InstanceEvent>,
    pub start_delay: Mutex<Duration>,
    pub breaker: Mutex<Option<BreakerInfo>>,
    pub launches: AtomicUsize,
    touches: Mutex<HashMap<UserId, usize>>,
}

impl StaticTraffic {
    pub fn new(upstream: SocketAddr) -> Arc<Self> {
        Arc::new(Self {
            inner: Arc::new(TrafficState {
                upstream: Mutex::new(endpoint(upstream)),
                instances: Mutex::new(HashMap::new()),
                endpoints: Mutex::new(HashMap::new()),
                events: broadcast::channel(256).0,
                start_delay: Mutex::new(Duration::from_millis(50)),
                breaker: Mutex::new(None),
                launches: AtomicUsize::new(0),
                touches: Mutex::new(HashMap::new()),
            }),
        })
    }

    pub fn state(&self) -> &TrafficState {
        &self.inner
    }

    /// Marks `user` running on `addr` at once, as a crash + restart on a new
    /// port would end.
    pub fn run_at(&self, name: &str, addr: SocketAddr) {
        self.inner
            .set(&user(name), InstanceStatus::Running, Some(endpoint(addr)));
    }

    /// Marks `user` running on `addr`, where only a socket of `owner`'s
    /// is the instance.
    pub fn run_owned(&self, name: &str, addr: SocketAddr, owner: u32) {
        let endpoint = Endpoint {
            reach: berth_core::Reach {
                owner: Some(owner),
                netns: None,
            },
            ..endpoint(addr)
        };
        self.inner
            .set(&user(name), InstanceStatus::Running, Some(endpoint));
    }

    pub fn run(&self, name: &str) {
        let ep = self.inner.upstream.lock().unwrap().clone();
        self.inner
            .set(&user(name), InstanceStatus::Running, Some(ep));
    }

    pub fn crash(&self, name: &str) {
        self.inner.set(&user(name), InstanceStatus::Crashed, None);
    }

    pub fn touches(&self, name: &str) -> usize {
        self.inner
            .touches
            .lock()
            .unwrap()
            .get(&user(name))
            .copied()
            .unwrap_or(0)
    }

    pub fn launches(&self) -> usize {
        self.inner.launches.load(Ordering::SeqCst)
    }
}

fn endpoint(addr: SocketAddr) -> Endpoint {
    Endpoint {
        host: addr.ip().to_string(),
        port: addr.port(),
        reach: berth_core::Reach::default(),
    }
}

impl TrafficState {
    fn set(&self, user: &UserId, status: InstanceStatus, endpoint: Option<Endpoint>) {
        let ready = status == InstanceStatus::Running;
        let instance = Instance {
            id: format!("i-{user}"),
            user: user.clone(),
            role: Role::Main,
            status,
            node: "test".into(),
            epoch: 1,
            port: endpoint.as_ref().map(|e| e.port),
            pid: None,
            runtime_ref: None,
            folder: String::new(),
            started_at: unix_millis_now(),
            ready,
            restarts: 0,
            last_error: None,
            exit_code: None,
            last_active: unix_millis_now(),
            hibernated_at: None,
        };
        self.instances
            .lock()
            .unwrap()
            .insert(user.clone(), instance);
        let mut endpoints = self.endpoints.lock().unwrap();
        match &endpoint {
            Some(endpoint) => endpoints.insert(user.clone(), endpoint.clone()),
            None => endpoints.remove(user),
        };
        drop(endpoints);
        let _ = self.events.send(InstanceEvent {
            user: user.clone(),
            role: Role::Main,
            status,
            ready,
            endpoint,
            message: None,
            stage: berth_core::Stage::of(status, ready),
        });
    }

    fn current(&self, user: &UserId) -> Option<Instance> {
        self.instances.lock().unwrap().get(user).cloned()
    }
}

#[async_trait]
impl Traffic for StaticTraffic {
    async fn launch(&self, user: &UserId, _r: LaunchRequest) -> Result<Instance, SpawnError> {
        if let Some(open) = *self.inner.breaker.lock().unwrap() {
            return Err(SpawnError::CircuitOpen {
                user: user.clone(),
                opens: open.opens,
                retry_at: open.cooldown_until,
            });
        }
        if self.inner.current(user).is_some_and(|i| i.status.is_live()) {
            return Err(SpawnError::AlreadyRunning { user: user.clone() });
        }
        self.inner.launches.fetch_add(1, Ordering::SeqCst);
        self.inner.set(user, InstanceStatus::Starting, None);
        let starting = self.inner.current(user);
        let state = self.inner.clone();
        let owned = user.clone();
        let delay = *self.inner.start_delay.lock().unwrap();
        tokio::spawn(async move {
            // The double's start-up time (`start_delay`), as a test sets it.
            tokio::time::sleep(delay).await;
            let ep = state.upstream.lock().unwrap().clone();
            state.set(&owned, InstanceStatus::Running, Some(ep));
        });
        starting.ok_or_else(|| SpawnError::Internal("test double: lost the instance".into()))
    }

    async fn breaker_info(&self, _user: &UserId) -> Result<Option<BreakerInfo>, SpawnError> {
        Ok(*self.inner.breaker.lock().unwrap())
    }
    async fn list(&self) -> Result<Vec<Instance>, SpawnError> {
        Ok(self
            .inner
            .instances
            .lock()
            .unwrap()
            .values()
            .cloned()
            .collect())
    }
    fn endpoint_for(&self, user: &UserId) -> Option<Endpoint> {
        let i = self.inner.current(user)?;
        if i.status != InstanceStatus::Running {
            return None;
        }
        self.inner.endpoints.lock().unwrap().get(user).cloned()
    }
    fn launch_token(&self, _user: &UserId) -> Option<String> {
        None
    }
    async fn wait_for_ready(
        &self,
        user: &UserId,
        timeout: Duration,
    ) -> Result<Option<Instance>, SpawnError> {
        let deadline = Instant::now() + timeout;
        loop {
            let current = self.inner.current(user);
            match &current {
                None => return Ok(None),
                Some(i) if i.status != InstanceStatus::Starting => return Ok(current),
                Some(_) => {}
            }
            if Instant::now() >= deadline {
                return Err(SpawnError::Starting {
                    user: user.clone(),
                    retry_after_ms: 1000,
                });
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    fn touch(&self, user: &UserId) -> bool {
        *self
            .inner
            .touches
            .lock()
            .unwrap()
            .entry(user.clone())
            .or_default() += 1;
        false
    }
    fn subscribe(&self) -> broadcast::Receiver<InstanceEvent> {
        self.inner.events.subscribe()
    }
}

/// Test double: a fixed token table.
pub struct Tokens;

#[async_trait]
impl TokenStore for Tokens {
    async fn lookup(&self, hash: &str) -> Result<Option<UserTokenInfo>, AuthError> {
        Ok([(ALICE, "alice"), (BOB, "bob")]
            .iter()
            .find(|(t, _)| TokenHash::of(t).to_hex() == hash)
            .map(|(_, u)| UserTokenInfo {
                user: user(u),
                id: format!("{u}-token"),
                expires_in: Duration::from_secs(3600),
            }))
    }
}

// --- the upstream -----------------------------------------------------------

pub type TestBody = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

fn boxed<B>(body: B) -> TestBody
where
    B: hyper::body::Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    body.map_err(Into::into).boxed()
}

/// A real hyper server standing in for an instance. Routes by path suffix:
/// `…/ws` WebSocket echo, `…/sse` one event then waits for [`Upstream::release`],
/// `…/chunked` three chunks, `POST …/echo` streams the body back, `…/abort`
/// one chunk, then a broken stream once released, `…/hostile` headers that
/// act on the whole origin, anything else: the request head as text.
pub struct Upstream {
    pub addr: SocketAddr,
    pub release: Arc<Notify>,
    pub connections: Arc<AtomicUsize>,
    /// Requests (and upgrade handshakes) it was sent.
    pub requests: Arc<AtomicUsize>,
}

pub async fn upstream(name: &'static str) -> Upstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let release = Arc::new(Notify::new());
    let connections = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(AtomicUsize::new(0));
    let (r, c, q) = (release.clone(), connections.clone(), requests.clone());
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            c.fetch_add(1, Ordering::SeqCst);
            let release = r.clone();
            let requests = q.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    requests.fetch_add(1, Ordering::SeqCst);
                    upstream_handle(name, release.clone(), req)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .with_upgrades()
                    .await;
            });
        }
    });
    Upstream {
        addr,
        release,
        connections,
        requests,
    }
}

async fn upstream_handle(
    name: &'static str,
    release: Arc<Notify>,
    mut req: Request<Incoming>,
) -> Result<Response<TestBody>, Infallible> {
    let path = req.uri().path().to_owned();
    let response = if path.ends_with("/ws") {
        let key = req
            .headers()
            .get("sec-websocket-key")
            .map(|k| tokio_tungstenite::tungstenite::handshake::derive_accept_key(k.as_bytes()))
            .unwrap_or_default();
        let on = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            let Ok(upgraded) = on.await else { return };
            let ws = tokio_tungstenite::WebSocketStream::from_raw_socket(
                TokioIo::new(upgraded),
                tokio_tungstenite::tungstenite::protocol::Role::Server,
                None,
            )
            .await;
            let (mut tx, mut rx) = ws.split();
            while let Some(Ok(msg)) = rx.next().await {
                if msg.is_close() || tx.send(msg).await.is_err() {
                    break;
                }
            }
        });
        Response::builder()
            .status(StatusCode::SWITCHING_PROTOCOLS)
            .header("upgrade", "websocket")
            .header("connection", "Upgrade")
            .header("sec-websocket-accept", key)
            .body(boxed(Full::new(Bytes::new())))
            .unwrap()
    } else if path.ends_with("/sse") {
        let (mut tx, body) = http_body_util::channel::Channel::<Bytes, Infallible>::new(4);
        tokio::spawn(async move {
            let _ = tx.send_data(Bytes::from_static(b"data: first\n\n")).await;
            release.notified().await;
            let _ = tx.send_data(Bytes::from_static(b"data: last\n\n")).await;
        });
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(boxed(body))
            .unwrap()
    } else if path.ends_with("/chunked") {
        let chunks = futures_util::stream::iter(
            ["one,", "two,", "three"]
                .map(|c| Ok::<_, Infallible>(Frame::data(Bytes::from_static(c.as_bytes())))),
        );
        Response::new(boxed(StreamBody::new(chunks)))
    } else if path.ends_with("/set-cookie") {
        // A program trying to set berth's cookies, and one of its own.
        Response::builder()
            .header("set-cookie", "berth_token=planted; Path=/u/")
            .header("set-cookie", "app=kept; Path=/")
            .header("set-cookie", "__Host-berth_token=planted; Path=/; Secure")
            .header("set-cookie", "=berth_session=planted")
            .body(boxed(Full::new(Bytes::from_static(b"cookies set"))))
            .unwrap()
    } else if path.ends_with("/hostile") {
        // Headers that act on the whole origin or site, as a hostile
        // program would send them.
        Response::builder()
            .header("service-worker-allowed", "/")
            .header("clear-site-data", "\"cookies\", \"storage\"")
            .header("set-cookie", "wide=1; Path=/; Domain=berth.test")
            .header("refresh", "0; url=/admin/")
            .header(
                "link",
                "</admin/>; rel=prefetch, <own.css>; rel=preload; as=style",
            )
            .header("nel", "{\"report_to\":\"spy\",\"max_age\":86400}")
            .header("x-app", "yes")
            .body(boxed(Full::new(Bytes::from_static(b"hostile"))))
            .unwrap()
    } else if path.ends_with("/echo") {
        Response::new(boxed(req.into_body()))
    } else if path.ends_with("/abort") {
        let (mut tx, body) = http_body_util::channel::Channel::<Bytes, std::io::Error>::new(1);
        tokio::spawn(async move {
            let _ = tx.send_data(Bytes::from_static(b"partial")).await;
            release.notified().await;
            tx.abort(std::io::Error::other("the instance died"));
        });
        Response::new(boxed(body))
    } else {
        let mut text = format!(
            "upstream: {name}\npath: {}\n",
            req.uri().path_and_query().map_or("/", |p| p.as_str())
        );
        for (k, v) in req.headers() {
            text.push_str(&format!("{k}: {}\n", String::from_utf8_lossy(v.as_bytes())));
        }
        Response::builder()
            .header("connection", "x-up-secret")
            .header("x-up-secret", "1")
            .header("keep-alive", "timeout=5")
            .header("proxy-authenticate", "Basic")
            .header("x-app", "yes")
            .body(boxed(Full::new(Bytes::from(text))))
            .unwrap()
    };
    Ok(response)
}

// --- the proxy under test ---------------------------------------------------

/// A fallback service standing in for berth's API.
#[derive(Clone)]
pub struct Fallback;

impl tower_service::Service<Request<berth_proxy::RequestBody>> for Fallback {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;
    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn call(&mut self, req: Request<berth_proxy::RequestBody>) -> Self::Future {
        let body = format!("fallback {}", req.uri().path());
        std::future::ready(Ok(Response::new(Full::new(Bytes::from(body)))))
    }
}

pub struct Harness {
    pub addr: SocketAddr,
    pub spawner: Arc<StaticTraffic>,
    pub proxy: Arc<Proxy>,
    pub upstream: Upstream,
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl Harness {
    pub async fn start(tune: impl FnOnce(&mut ProxyConfig, &mut ServerConfig)) -> Harness {
        let upstream = upstream("a").await;
        let spawner = StaticTraffic::new(upstream.addr);
        let mut config = ProxyConfig {
            ready_timeout: Duration::from_secs(10),
            ..ProxyConfig::default()
        };
        let mut server = ServerConfig::default();
        tune(&mut config, &mut server);
        let auth = Authenticator::new(ADMIN, Arc::new(Tokens));
        let proxy = Proxy::start(config, spawner.clone(), auth);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(berth_proxy::serve(
            listener,
            server,
            proxy.clone(),
            Fallback,
            async move {
                let _ = stopped.await;
            },
        ));
        Harness {
            addr,
            spawner,
            proxy,
            upstream,
            stop: Some(stop),
            server: Some(server),
        }
    }

    /// Stops the server and the proxy, returning the server's result.
    pub async fn shutdown(&mut self) -> std::io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let result = match self.server.take() {
            Some(server) => tokio::time::timeout(PATIENCE, server)
                .await
                .expect("the server stops")
                .expect("the server task does not panic"),
            None => Ok(()),
        };
        self.proxy.shutdown().await;
        result
    }

    /// Sends `head` (and `body`) on a fresh connection and reads until the
    /// server closes it.
    pub async fn raw(&self, head: &str) -> RawResponse {
        raw(self.addr, head.as_bytes()).await
    }

    pub async fn get(&self, path: &str, headers: &[(&str, &str)]) -> RawResponse {
        let mut head = format!("GET {path} HTTP/1.1\r\nHost: berth.test\r\nConnection: close\r\n");
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        self.raw(&head).await
    }
}

/// A parsed response read off a raw socket.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl RawResponse {
    /// The value of header `name` (lowercase), if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|line| {
            let (k, v) = line.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    /// Every value of header `name` (lowercase), in order.
    pub fn headers(&self, name: &str) -> Vec<&str> {
        self.head
            .lines()
            .skip(1)
            .filter_map(|line| {
                let (k, v) = line.split_once(':')?;
                k.eq_ignore_ascii_case(name).then(|| v.trim())
            })
            .collect()
    }
}

pub async fn raw(addr: SocketAddr, request: &[u8]) -> RawResponse {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut buf = Vec::new();
    // A reset after the answer still leaves the answer in `buf`.
    let _ = tokio::time::timeout(PATIENCE, stream.read_to_end(&mut buf))
        .await
        .expect("the server answers and closes");
    parse(&buf)
}

pub fn parse(buf: &[u8]) -> RawResponse {
    let text = String::from_utf8_lossy(buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    RawResponse {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    }
}

/// A keep-alive HTTP client on a fresh connection, for body tests.
pub async fn client(addr: SocketAddr) -> hyper::client::conn::http1::SendRequest<TestBody> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    send
}

pub fn empty() -> TestBody {
    boxed(Full::new(Bytes::new()))
}

pub fn request(method: &str, path: &str, token: &str, body: TestBody) -> Request<TestBody> {
    Request::builder()
        .method(method)
        .uri(path)
        .header("host", "berth.test")
        .header("authorization", format!("Bearer {token}"))
        .body(body)
        .unwrap()
}

pub fn channel_body() -> (http_body_util::channel::Sender<Bytes>, TestBody) {
    let (tx, body) = http_body_util::channel::Channel::<Bytes, Infallible>::new(1);
    (tx, boxed(body))
}
