use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock milliseconds since the Unix epoch.
///
/// Used for records shown to people (`started_at`, `last_active`, breaker
/// cooldowns). Lease expiry never uses a node's wall clock: it is judged by
/// the store's clock.
pub type UnixMillis = i64;

/// The current wall-clock time as [`UnixMillis`].
pub fn unix_millis_now() -> UnixMillis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
