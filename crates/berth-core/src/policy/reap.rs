use std::time::Duration;

use crate::UnixMillis;

/// The idle reaper's numbers (design §4.5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReapPolicy {
    /// Stop mains idle longer than this; `None` never does.
    pub idle_ttl: Option<Duration>,
    /// Keep at most this many idle mains warm; `0` means no cap. An instance
    /// counts as idle when it saw no activity during the last `interval`.
    pub max_idle: usize,
    /// How often the reaper runs.
    pub interval: Duration,
}

impl Default for ReapPolicy {
    fn default() -> Self {
        Self {
            idle_ttl: Some(Duration::from_secs(3600)),
            max_idle: 0,
            interval: Duration::from_secs(60),
        }
    }
}

/// Picks the running mains to stop at `now`, given each one's last activity.
///
/// First every main idle longer than `idle_ttl`; then, if more than
/// `max_idle` idle mains remain, the least recently active of them.
pub fn select_for_reaping<K: Clone>(
    policy: &ReapPolicy,
    now: UnixMillis,
    last_active: &[(K, UnixMillis)],
) -> Vec<K> {
    let idle_for = |t: UnixMillis| Duration::from_millis(u64::try_from(now - t).unwrap_or(0));
    let mut reaped = Vec::new();
    let mut idle = Vec::new();
    for (key, t) in last_active {
        if policy.idle_ttl.is_some_and(|ttl| idle_for(*t) > ttl) {
            reaped.push(key.clone());
        } else if idle_for(*t) >= policy.interval {
            idle.push((key, *t));
        }
    }
    if policy.max_idle > 0 && idle.len() > policy.max_idle {
        idle.sort_by_key(|(_, t)| *t);
        let excess = idle.len() - policy.max_idle;
        reaped.extend(idle.into_iter().take(excess).map(|(key, _)| key.clone()));
    }
    reaped
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;

    #[test]
    fn stops_only_mains_idle_past_the_ttl() {
        let policy = ReapPolicy::default();
        let now = 120 * MIN;
        let seen = [
            ("fresh", now - MIN),
            ("edge", now - 60 * MIN),
            ("old", now - 61 * MIN),
        ];
        assert_eq!(select_for_reaping(&policy, now, &seen), ["old"]);
    }

    #[test]
    fn a_zero_ttl_never_reaps_by_age() {
        let policy = ReapPolicy {
            idle_ttl: None,
            ..ReapPolicy::default()
        };
        assert!(select_for_reaping(&policy, 1000 * MIN, &[("a", 0)]).is_empty());
    }

    #[test]
    fn caps_idle_mains_by_stopping_the_least_recently_active() {
        let policy = ReapPolicy {
            idle_ttl: None,
            max_idle: 2,
            interval: Duration::from_secs(60),
        };
        let now = 100 * MIN;
        let seen = [
            ("busy", now - 1000),
            ("idle3", now - 3 * MIN),
            ("idle9", now - 9 * MIN),
            ("idle5", now - 5 * MIN),
            ("idle7", now - 7 * MIN),
        ];
        let mut reaped = select_for_reaping(&policy, now, &seen);
        reaped.sort();
        assert_eq!(reaped, ["idle7", "idle9"], "busy mains do not count");
    }
}
