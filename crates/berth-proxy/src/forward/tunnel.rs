//! The tunnel an upgraded connection (a WebSocket or any other protocol)
//! becomes: bytes copied both ways, with reads reported as the user's
//! activity.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use berth_core::{Traffic, UserId};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::task::TaskTracker;

use crate::ws_activity::ClientFrames;

/// How long a tunnel goes between activity reports. Idle reaping works in
/// minutes, so one `touch` a second per tunnel loses nothing and keeps a
/// busy WebSocket from calling into the spawner on every frame.
const TUNNEL_TOUCH_EVERY: Duration = Duration::from_secs(1);

/// Waits for both sides to finish switching protocols, then copies bytes
/// between them until either closes. Reads from the client are activity
/// (on a WebSocket, only those that carry data frames) and wake a
/// hibernated instance; reads from the instance are activity only when
/// `server_counts`.
pub(super) async fn run(
    client: OnUpgrade,
    upstream: OnUpgrade,
    spawner: Arc<dyn Traffic>,
    user: Arc<UserId>,
    tasks: TaskTracker,
    server_counts: bool,
    websocket: bool,
) {
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
    spawner: Arc<dyn Traffic>,
    user: Arc<UserId>,
    reads: Reads,
    last_touch: Option<Instant>,
    /// A WebSocket client's frames: only reads that carry data frames are
    /// activity. `None`: every read is.
    frames: Option<ClientFrames>,
}

impl<T> Touching<T> {
    fn new(io: T, spawner: Arc<dyn Traffic>, user: Arc<UserId>, reads: Reads) -> Self {
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
