//! Upstream HTTP/1.1 connections, kept per endpoint and driven by the task
//! of the request that uses them.
//!
//! hyper's pooled client runs each upstream connection in a task of its
//! own and talks to it through channels: every proxied request then costs
//! two extra task wake-ups, a channel send each way and a pool checkout
//! under a lock with a waiter queue. Here the connection future is polled
//! by the client's own connection task instead: while waiting for the
//! response head ([`send`]) and then from [`ForwardedBody::poll_frame`]
//! while the response body streams. Once the body is finished the
//! connection goes back to its endpoint's idle list; a connection that
//! cannot be reused (the upstream closes it, or an upload is still being
//! sent) is closed, or finished in a background task.
//!
//! Idle connections are not polled while idle: a checkout first polls one
//! once (with a no-op waker), which reads an upstream's EOF and discards a
//! closed connection; a sweep every `idle_timeout` closes expired and
//! closed ones. The race with an upstream closing a connection just as it
//! is reused remains, as with any pool; the forward layer retries those
//! requests once on a fresh connection.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::http::uri::Authority;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use berth_core::Reach;

use crate::credential::Scrubber;
use crate::upstream_body::UpstreamBody;

/// One upstream connection: the future that does its I/O.
pub(crate) type Connection = http1::Connection<TokioIo<TcpStream>, UpstreamBody>;

/// A connection and its request handle, owned by one request at a time.
pub(crate) struct Conn {
    pub(crate) sender: SendRequest<UpstreamBody>,
    /// `None` once the connection has ended. Boxed once per connection,
    /// so that handing a connection around moves a pointer, not hyper's
    /// whole connection state.
    pub(crate) io: Option<Box<Connection>>,
    /// How the connection was made and checked (the namespace it is in,
    /// the account the other end belongs to): it is lent only to requests
    /// that must reach their instance the same way.
    reach: Reach,
}

impl Conn {
    pub(crate) fn new(sender: SendRequest<UpstreamBody>, io: Connection, reach: Reach) -> Self {
        Self {
            sender,
            io: Some(Box::new(io)),
            reach,
        }
    }

    /// Drives the connection's I/O; `true` while it is open.
    pub(crate) fn poll_io(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(io) = self.io.as_mut() else {
            return false;
        };
        match Pin::new(&mut **io).poll(cx) {
            Poll::Pending => true,
            Poll::Ready(result) => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "upstream connection ended with an error");
                }
                self.io = None;
                false
            }
        }
    }

    /// Open, and idle: ready for its next request.
    fn poll_reusable(&mut self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        self.poll_io(&mut cx) && self.sender.is_ready()
    }
}

struct Idle {
    conn: Conn,
    since: Instant,
}

/// Idle upstream connections by endpoint.
pub(crate) struct Pool {
    /// Keyed by the authority's text: hashing a `str` is one write, an
    /// `Authority` hashes byte by byte.
    idle: Mutex<HashMap<Box<str>, Vec<Idle>>>,
    max_idle_per_host: usize,
    idle_timeout: Duration,
    tasks: TaskTracker,
    cancel: CancellationToken,
}

impl Pool {
    /// Also starts the sweep, which ends (and closes every idle
    /// connection) when `cancel` fires.
    pub(crate) fn start(
        max_idle_per_host: usize,
        idle_timeout: Duration,
        tasks: TaskTracker,
        cancel: CancellationToken,
    ) -> Arc<Self> {
        let pool = Arc::new(Self {
            idle: Mutex::new(HashMap::new()),
            max_idle_per_host,
            idle_timeout,
            tasks: tasks.clone(),
            cancel: cancel.clone(),
        });
        let weak = Arc::downgrade(&pool);
        let period = idle_timeout.max(Duration::from_millis(100));
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = cancel.cancelled() => {
                        if let Some(pool) = weak.upgrade() {
                            pool.clear();
                        }
                        return;
                    }
                    _ = tick.tick() => match Weak::upgrade(&weak) {
                        Some(pool) => pool.sweep(),
                        None => return,
                    },
                }
            }
        });
        pool
    }

    /// An open, idle connection to `key` made and checked as `reach` says,
    /// most recently used first.
    pub(crate) fn checkout(&self, key: &Authority, reach: &Reach) -> Option<Conn> {
        loop {
            let idle = {
                let mut map = self.idle.lock().unwrap_or_else(|e| e.into_inner());
                map.get_mut(key.as_str())?.pop()?
            };
            let mut conn = idle.conn;
            if conn.reach == *reach
                && idle.since.elapsed() < self.idle_timeout
                && conn.poll_reusable()
            {
                return Some(conn);
            }
        }
    }

    /// Returns a connection whose exchange is over: kept if it can take
    /// another request, else closed, or finished in the background when it
    /// still has work (an upload the upstream did not wait for).
    pub(crate) fn release(&self, key: &Authority, mut conn: Conn) {
        // The poll that delivered the end of the body has usually left the
        // connection idle already: then it needs no extra poll.
        let reusable = (conn.io.is_some() && conn.sender.is_ready()) || conn.poll_reusable();
        if reusable && !self.cancel.is_cancelled() {
            let mut map = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            let list = match map.get_mut(key.as_str()) {
                Some(list) => list,
                None => map.entry(key.as_str().into()).or_default(),
            };
            if list.len() < self.max_idle_per_host {
                list.push(Idle {
                    conn,
                    since: Instant::now(),
                });
            }
            return;
        }
        self.finish(conn);
    }

    /// Lets a connection that is still busy run to its end on its own,
    /// like hyper's pooled client would; without its sender it closes then.
    pub(crate) fn finish(&self, conn: Conn) {
        let Conn { sender, io, .. } = conn;
        drop(sender);
        let Some(io) = io else { return };
        if self.cancel.is_cancelled() || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let cancel = self.cancel.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                _ = io => {}
                () = cancel.cancelled() => {}
            }
        });
    }

    /// Closes expired and closed idle connections. Polling and closing
    /// happen outside the lock, so checkouts and releases on the request
    /// path never wait behind them; a checkout meanwhile finds no idle
    /// connection and opens a new one, as after any idle period.
    fn sweep(&self) {
        let mut taken = {
            let mut map = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::take(&mut *map)
        };
        let mut closed = 0usize;
        taken.retain(|_, list| {
            list.retain_mut(|idle| {
                let keep = idle.since.elapsed() < self.idle_timeout && idle.conn.poll_reusable();
                closed += usize::from(!keep);
                keep
            });
            !list.is_empty()
        });
        // Survivors are older than anything released meanwhile, so they go
        // first (checkout pops the newest); a list over its limit loses its
        // oldest, closed after the lock is released.
        let mut surplus = Vec::new();
        if !self.cancel.is_cancelled() {
            let mut map = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            for (key, mut survivors) in taken.drain() {
                let list = map.entry(key).or_default();
                survivors.append(list);
                let over = survivors.len().saturating_sub(self.max_idle_per_host);
                surplus.extend(survivors.drain(..over));
                *list = survivors;
            }
        }
        closed += surplus.len();
        drop(surplus);
        drop(taken);
        if closed > 0 {
            tracing::trace!(closed, "closed idle upstream connections");
        }
    }

    fn clear(&self) {
        let drained: Vec<_> = {
            let mut map = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            map.drain().collect()
        };
        drop(drained);
    }

    #[cfg(test)]
    pub(crate) fn idle_count(&self) -> usize {
        let map = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        map.values().map(Vec::len).sum()
    }
}

/// An upstream response body. While it streams it drives the connection
/// it arrives on; once it has ended the connection goes back to the pool.
pub struct ForwardedBody {
    body: Incoming,
    lease: Option<Lease>,
    /// Replaces the instance's launch token in the body as it streams.
    /// Boxed: rare, and every answer's body carries the field.
    scrub: Option<Box<Scrub>>,
}

struct Scrub {
    scrubber: Scrubber,
    /// A trailers frame that waits for the held-back bytes to go first.
    trailers: Option<Frame<Bytes>>,
    done: bool,
}

struct Lease {
    conn: Conn,
    pool: Arc<Pool>,
    key: Authority,
}

impl ForwardedBody {
    /// A body whose connection is someone else's business (an upgrade).
    pub(crate) fn plain(body: Incoming) -> Self {
        Self {
            body,
            lease: None,
            scrub: None,
        }
    }

    pub(crate) fn pooled(body: Incoming, conn: Conn, pool: Arc<Pool>, key: Authority) -> Self {
        Self {
            body,
            lease: Some(Lease { conn, pool, key }),
            scrub: None,
        }
    }

    /// The same body without any occurrence of `scrubber`'s secret.
    pub(crate) fn scrubbed(mut self, scrubber: Scrubber) -> Self {
        self.scrub = Some(Box::new(Scrub {
            scrubber,
            trailers: None,
            done: false,
        }));
        self
    }

    /// The next frame of the upstream body, driving its connection.
    fn poll_inner(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if let Some(lease) = self.lease.as_mut() {
            lease.conn.poll_io(cx);
        }
        let frame = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(None | Some(Err(_))) = frame {
            self.release();
        } else if self.lease.is_some() && self.body.is_end_stream() {
            self.release();
        }
        frame
    }

    fn release(&mut self) {
        if let Some(lease) = self.lease.take() {
            lease.pool.release(&lease.key, lease.conn);
        }
    }
}

impl Drop for ForwardedBody {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            if self.body.is_end_stream() {
                lease.pool.release(&lease.key, lease.conn);
            } else {
                // The client went away mid-body: the connection is not
                // reusable, and there is nobody left to read for.
                lease.pool.finish(lease.conn);
            }
        }
    }
}

impl std::fmt::Debug for ForwardedBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForwardedBody")
            .field("body", &self.body)
            .field("pooled", &self.lease.is_some())
            .finish()
    }
}

impl Body for ForwardedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if this.scrub.is_none() {
            return this.poll_inner(cx);
        }
        loop {
            if let Some(scrub) = this.scrub.as_mut() {
                if let Some(trailers) = scrub.trailers.take() {
                    return Poll::Ready(Some(Ok(trailers)));
                }
                if scrub.done {
                    return Poll::Ready(None);
                }
            }
            let frame = std::task::ready!(this.poll_inner(cx));
            let Some(scrub) = this.scrub.as_mut() else {
                return Poll::Ready(frame);
            };
            match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        let clean = scrub.scrubber.push(&data);
                        if !clean.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(clean))));
                        }
                    }
                    Err(trailers) => {
                        scrub.trailers = Some(trailers);
                        scrub.done = true;
                        let held = scrub.scrubber.finish();
                        if !held.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(held))));
                        }
                    }
                },
                None => {
                    scrub.done = true;
                    let held = scrub.scrubber.finish();
                    if !held.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(held))));
                    }
                }
                Some(Err(e)) => {
                    scrub.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.scrub {
            None => self.body.is_end_stream(),
            Some(scrub) => scrub.done && scrub.trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self.scrub {
            None => self.body.size_hint(),
            // Scrubbing may shorten the body.
            Some(_) => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Either, Empty};
    use hyper::Request;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// An upstream that answers `answers` requests per connection with
    /// `ok`, then closes it.
    async fn upstream(answers: usize) -> Authority {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    for _ in 0..answers {
                        let mut seen = Vec::new();
                        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                            match s.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => seen.extend_from_slice(&buf[..n]),
                            }
                        }
                        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if s.write_all(ok).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr.to_string().parse().unwrap()
    }

    async fn connect(to: &Authority) -> Conn {
        let stream = TcpStream::connect(to.as_str()).await.unwrap();
        let (sender, io) = http1::handshake(TokioIo::new(stream)).await.unwrap();
        Conn::new(sender, io, Reach::default())
    }

    /// One request on `conn`, its body read through [`ForwardedBody`].
    async fn exchange(pool: &Arc<Pool>, to: &Authority, mut conn: Conn) -> Bytes {
        let req = Request::builder()
            .uri("/")
            .header("host", "h")
            .body(Either::Right(Either::Right(Empty::new())))
            .unwrap();
        let mut response = std::pin::pin!(conn.sender.send_request(req));
        let response = std::future::poll_fn(|cx| {
            conn.poll_io(cx);
            response.as_mut().poll(cx)
        })
        .await
        .unwrap();
        let body = ForwardedBody::pooled(response.into_body(), conn, pool.clone(), to.clone());
        body.collect().await.unwrap().to_bytes()
    }

    fn pool(cancel: &CancellationToken) -> Arc<Pool> {
        Pool::start(
            4,
            Duration::from_secs(60),
            TaskTracker::new(),
            cancel.clone(),
        )
    }

    #[tokio::test]
    async fn a_finished_exchange_returns_its_connection_for_reuse() {
        let cancel = CancellationToken::new();
        let pool = pool(&cancel);
        let to = upstream(usize::MAX).await;
        assert!(pool.checkout(&to, &Reach::default()).is_none());
        let first = connect(&to).await;
        assert_eq!(exchange(&pool, &to, first).await, "ok");
        assert_eq!(pool.idle_count(), 1);
        assert!(
            pool.checkout(
                &to,
                &Reach {
                    owner: Some(1000),
                    netns: None
                }
            )
            .is_none(),
            "a connection not checked for an owner is lent to no request that expects one"
        );
        assert_eq!(pool.idle_count(), 0, "and it is closed");
        let second = connect(&to).await;
        assert_eq!(exchange(&pool, &to, second).await, "ok");
        let again = pool
            .checkout(&to, &Reach::default())
            .expect("the connection is reused");
        assert_eq!(pool.idle_count(), 0);
        assert_eq!(exchange(&pool, &to, again).await, "ok");
        assert_eq!(pool.idle_count(), 1);
        cancel.cancel();
    }

    #[tokio::test]
    async fn closed_connections_are_not_handed_out_and_cancel_clears() {
        let cancel = CancellationToken::new();
        let pool = pool(&cancel);
        let once = upstream(1).await;
        let conn = connect(&once).await;
        assert_eq!(exchange(&pool, &once, conn).await, "ok");
        // The upstream closes after its one answer; a checkout notices.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(pool.checkout(&once, &Reach::default()).is_none());
        assert_eq!(pool.idle_count(), 0);

        let open = upstream(usize::MAX).await;
        let conn = connect(&open).await;
        exchange(&pool, &open, conn).await;
        assert_eq!(pool.idle_count(), 1);
        cancel.cancel();
        for _ in 0..100 {
            if pool.idle_count() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(pool.idle_count(), 0, "shutdown closes idle connections");
    }

    #[tokio::test]
    async fn the_sweep_closes_dead_connections_and_keeps_live_ones() {
        let cancel = CancellationToken::new();
        let pool = pool(&cancel);
        // An upstream that answers once and closes the connection a moment
        // later, after the pool has taken it back as idle.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let once: Authority = listener.local_addr().unwrap().to_string().parse().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = s.read(&mut buf).await;
            let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
            s.write_all(ok).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        });
        let open = upstream(usize::MAX).await;
        let dying = connect(&once).await;
        exchange(&pool, &once, dying).await;
        for _ in 0..2 {
            let live = connect(&open).await;
            exchange(&pool, &open, live).await;
        }
        assert_eq!(pool.idle_count(), 3);
        tokio::time::sleep(Duration::from_millis(100)).await;
        pool.sweep();
        assert_eq!(pool.idle_count(), 2, "only the closed connection went");
        assert!(pool.checkout(&once, &Reach::default()).is_none());
        let live = pool
            .checkout(&open, &Reach::default())
            .expect("survivors are back in the pool");
        assert_eq!(exchange(&pool, &open, live).await, "ok");
        cancel.cancel();
    }
}
