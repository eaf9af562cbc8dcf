//! A lower bound on how fast a request body arrives, so that a
//! client trickling a body cannot hold a connection, an upstream
//! connection and the upstream's attention for as long as it likes.
//!
//! [`PacedBody`] wraps every request body the server hands out, to the
//! proxy and to the API alike. A body has a time budget, at most
//! [`BodyPace::grace`]; time spent waiting for the client's next bytes
//! draws on it, and every byte that arrives adds `1 / min_bytes_per_s`
//! seconds back. A client that keeps up with the minimum rate never runs
//! out; one that stalls for `grace`, or trickles slower than the rate,
//! does, and its body ends with [`BodyTooSlow`]. Capping the budget at
//! `grace` means a fast start banks at most `grace`: sending 1 MiB quickly
//! does not buy a quarter of an hour of trickling.
//!
//! Only time spent *waiting for the client* counts: while the reader (an
//! upstream that reads slowly, a handler that is busy) does not ask for
//! the next chunk, the clock is stopped, so backpressure from berth's side
//! is never blamed on the client. A body that is never read (a request
//! refused before its body is needed, a GET) or never keeps its reader
//! waiting costs no clock, no timer and no allocation: each request
//! carries just 8 bytes of settings until its reader first has to wait.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How fast request bodies must arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyPace {
    /// The slowest accepted average rate; 0: none, `grace` is then only a
    /// bound on each stall.
    pub min_bytes_per_s: u64,
    /// The longest a body may stall, and the most a fast start may bank.
    pub grace: Duration,
}

impl Default for BodyPace {
    fn default() -> Self {
        Self {
            min_bytes_per_s: 1024,
            grace: Duration::from_secs(10),
        }
    }
}

impl BodyPace {
    /// The time `bytes` more bytes buy.
    fn credit(&self, bytes: usize) -> Duration {
        if self.min_bytes_per_s == 0 {
            return self.grace;
        }
        let nanos =
            (bytes as u128).saturating_mul(1_000_000_000) / u128::from(self.min_bytes_per_s);
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }
}

/// The error a [`PacedBody`] ends with when its client fell behind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the request body arrived too slowly (it must average {min_bytes_per_s} bytes/s and never stall for {grace:?})"
)]
pub struct BodyTooSlow {
    /// The average rate the body had to keep ([`BodyPace::min_bytes_per_s`]).
    pub min_bytes_per_s: u64,
    /// The longest stall it was allowed ([`BodyPace::grace`]).
    pub grace: Duration,
}

impl BodyTooSlow {
    /// Whether `error` or any of its causes is a [`BodyTooSlow`].
    pub fn caused(error: &(dyn std::error::Error + 'static)) -> bool {
        let mut source = Some(error);
        while let Some(e) = source {
            if e.is::<BodyTooSlow>() {
                return true;
            }
            source = e.source();
        }
        false
    }
}

/// The clock of one paced body, from the first time its reader waits.
#[derive(Debug)]
struct Clock {
    pace: BodyPace,
    budget: Duration,
    /// Since when the reader has been waiting for the client.
    waiting_since: Option<Instant>,
    /// Fires when the budget is used up; made at the first stall, then
    /// reset at each following one.
    timer: Option<Pin<Box<Sleep>>>,
    expired: bool,
}

/// A [`BodyPace`] in 8 bytes: every request carries one, and the request
/// (with the futures that hold it) is moved several times on its way, so
/// each byte here is copied on every proxied request.
#[derive(Debug, Clone, Copy)]
struct CompactPace {
    min_bytes_per_s: u32,
    grace_ms: u32,
}

impl CompactPace {
    fn of(pace: BodyPace) -> Self {
        Self {
            min_bytes_per_s: u32::try_from(pace.min_bytes_per_s).unwrap_or(u32::MAX),
            grace_ms: u32::try_from(pace.grace.as_millis()).unwrap_or(u32::MAX),
        }
    }

    fn expand(self) -> BodyPace {
        BodyPace {
            min_bytes_per_s: u64::from(self.min_bytes_per_s),
            grace: Duration::from_millis(u64::from(self.grace_ms)),
        }
    }
}

#[derive(Debug)]
enum Pacing {
    Off,
    /// Paced, and the reader has never waited: the budget is still whole
    /// (arriving bytes can only top it up to the grace period), so there
    /// is no clock to keep. A request whose body is never read, or arrives
    /// at once, stays here and never allocates.
    Unstarted(CompactPace),
    Started(Box<Clock>),
}

/// A request body that ends with [`BodyTooSlow`] when its client falls
/// behind its [`BodyPace`]. With no pace it is the body unchanged.
#[derive(Debug)]
pub struct PacedBody<B> {
    inner: B,
    pacing: Pacing,
}

impl<B> PacedBody<B> {
    /// `inner`, held to `pace`; with `None` it is passed through unbounded.
    pub fn new(inner: B, pace: Option<BodyPace>) -> Self {
        Self {
            inner,
            pacing: match pace {
                Some(pace) => Pacing::Unstarted(CompactPace::of(pace)),
                None => Pacing::Off,
            },
        }
    }
}

impl Clock {
    fn new(pace: BodyPace) -> Self {
        Self {
            pace,
            budget: pace.grace,
            waiting_since: None,
            timer: None,
            expired: false,
        }
    }

    fn too_slow(&self) -> BoxError {
        Box::new(BodyTooSlow {
            min_bytes_per_s: self.pace.min_bytes_per_s,
            grace: self.pace.grace,
        })
    }

    /// The reader asked for more and the client has not sent it: start the
    /// clock (if it is not running) and see whether the budget is gone.
    fn on_pending(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.waiting_since.is_none() {
            let now = Instant::now();
            self.waiting_since = Some(now);
            let deadline = now + self.budget;
            match self.timer.as_mut() {
                Some(timer) => timer.as_mut().reset(deadline),
                None => self.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
        }
        let fired = self
            .timer
            .as_mut()
            .is_some_and(|timer| timer.as_mut().poll(cx).is_ready());
        if fired {
            self.expired = true;
            return Poll::Ready(Some(Err(self.too_slow())));
        }
        Poll::Pending
    }

    /// A frame arrived: stop the clock, charge the wait, credit the bytes.
    fn on_frame(&mut self, frame: &Frame<Bytes>) {
        if let Some(since) = self.waiting_since.take() {
            self.budget = self.budget.saturating_sub(since.elapsed());
        }
        if let Some(data) = frame.data_ref() {
            self.budget = (self.budget + self.pace.credit(data.len())).min(self.pace.grace);
        }
    }
}

impl<B> Body for PacedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let inner = Pin::new(&mut this.inner);
        match &mut this.pacing {
            Pacing::Off => inner.poll_frame(cx).map_err(Into::into),
            Pacing::Unstarted(pace) => match inner.poll_frame(cx) {
                Poll::Pending => {
                    let mut clock = Box::new(Clock::new(pace.expand()));
                    let polled = clock.on_pending(cx);
                    this.pacing = Pacing::Started(clock);
                    polled
                }
                ready => ready.map_err(Into::into),
            },
            Pacing::Started(clock) => {
                if clock.expired {
                    return Poll::Ready(Some(Err(clock.too_slow())));
                }
                match inner.poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => {
                        clock.on_frame(&frame);
                        Poll::Ready(Some(Ok(frame)))
                    }
                    Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
                    Poll::Ready(None) => Poll::Ready(None),
                    Poll::Pending => clock.on_pending(cx),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use http_body_util::BodyExt;
    use http_body_util::channel::Channel;

    use super::*;

    const PACE: BodyPace = BodyPace {
        min_bytes_per_s: 100,
        grace: Duration::from_secs(3),
    };

    fn paced() -> (
        http_body_util::channel::Sender<Bytes, Infallible>,
        PacedBody<Channel<Bytes, Infallible>>,
    ) {
        let (tx, body) = Channel::<Bytes, Infallible>::new(16);
        (tx, PacedBody::new(body, Some(PACE)))
    }

    /// Reads frames until the body ends; the error, if it ended with one.
    async fn drain(body: &mut PacedBody<Channel<Bytes, Infallible>>) -> Option<BoxError> {
        loop {
            match body.frame().await {
                Some(Ok(_)) => {}
                Some(Err(e)) => return Some(e),
                None => return None,
            }
        }
    }

    #[test]
    fn credit_is_bytes_over_rate_and_grace_without_a_rate() {
        assert_eq!(PACE.credit(100), Duration::from_secs(1));
        assert_eq!(PACE.credit(1), Duration::from_millis(10));
        let idle_only = BodyPace {
            min_bytes_per_s: 0,
            ..PACE
        };
        assert_eq!(idle_only.credit(1), PACE.grace);
        assert_eq!(
            BodyPace {
                min_bytes_per_s: 1,
                ..PACE
            }
            .credit(usize::MAX),
            Duration::from_nanos(u64::MAX)
        );
    }

    /// One byte every two seconds at a minimum of 100 bytes/s: each byte
    /// buys 10 ms, each wait costs 2 s, so the 3 s budget runs out during
    /// the second wait.
    #[tokio::test(start_paused = true)]
    async fn a_trickle_is_cut_off_once_the_budget_is_spent() {
        let (mut tx, mut body) = paced();
        let started = Instant::now();
        let sender = tokio::spawn(async move {
            loop {
                if tx.send_data(Bytes::from_static(b"x")).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        });
        let err = drain(&mut body).await.expect("cut off");
        assert!(BodyTooSlow::caused(err.as_ref()), "{err}");
        assert!(err.to_string().contains("100 bytes/s"), "{err}");
        let elapsed = started.elapsed();
        assert!(
            elapsed > Duration::from_secs(3) && elapsed < Duration::from_secs(5),
            "{elapsed:?}"
        );
        // It stays failed.
        assert!(body.frame().await.unwrap().is_err());
        sender.abort();
    }

    /// A body at the minimum rate, however long, never runs out; nor does
    /// one whose reader (not the client) is slow.
    #[tokio::test(start_paused = true)]
    async fn a_body_at_the_minimum_rate_or_read_slowly_is_never_cut() {
        let (mut tx, mut body) = paced();
        let sender = tokio::spawn(async move {
            for _ in 0..120 {
                tx.send_data(Bytes::from(vec![b'x'; 50])).await.unwrap();
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        assert!(drain(&mut body).await.is_none(), "a minute at the rate");
        sender.await.unwrap();

        let (mut tx, mut body) = paced();
        tx.send_data(Bytes::from_static(b"x")).await.unwrap();
        tx.send_data(Bytes::from_static(b"y")).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        // The reader takes a minute over the first byte: the client is
        // not charged for it, the second byte is waiting already.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(body.frame().await.unwrap().is_ok());
        drop(tx);
        assert!(drain(&mut body).await.is_none());
    }

    /// A fast start banks at most the grace period.
    #[tokio::test(start_paused = true)]
    async fn a_fast_start_banks_no_more_than_the_grace_period() {
        let (mut tx, mut body) = paced();
        tx.send_data(Bytes::from(vec![b'x'; 10_000])).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        let started = Instant::now();
        let err = drain(&mut body).await.expect("a stall after 10 kB is cut");
        assert!(BodyTooSlow::caused(err.as_ref()));
        let elapsed = started.elapsed();
        assert!(
            elapsed >= PACE.grace && elapsed < PACE.grace + Duration::from_millis(100),
            "{elapsed:?}"
        );
        drop(tx);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_pace_the_body_is_left_alone() {
        let (mut tx, body) = Channel::<Bytes, Infallible>::new(1);
        let mut body = PacedBody::new(body, None);
        let sender = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            tx.send_data(Bytes::from_static(b"late")).await.unwrap();
        });
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "late");
        sender.await.unwrap();
        assert!(body.frame().await.is_none());
    }
}
