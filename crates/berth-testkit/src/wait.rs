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
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(POLL_EVERY).await;
    }
}
