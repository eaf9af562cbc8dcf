//! Waiting on conditions instead of sleeping.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often [`eventually`] checks.
const POLL_EVERY: Duration = Duration::from_millis(25);

/// Polls `check` every 25 ms until it returns `Some`, and returns that
/// value; panics naming `what` once `timeout` has passed.
///
/// The timeout only bounds a hang: make it generous, since a loaded CI
/// machine is slow, and never assert on how long the wait took.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    match poll_until(timeout, check).await {
        Some(value) => value,
        None => panic!("timed out waiting for {what}"),
    }
}

/// [`eventually`] that answers `None` once `timeout` has passed instead of
/// panicking, for a test that reports what it found either way.
pub async fn poll_until<T, F, Fut>(timeout: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}
