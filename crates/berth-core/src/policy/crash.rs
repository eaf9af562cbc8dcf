use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{BreakerInfo, UnixMillis};

/// The crash policy's numbers. `Default` gives the documented defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrashPolicy {
    /// First restart delay; doubled for every crash in the streak.
    pub backoff_base: Duration,
    /// The longest restart delay, however long the streak.
    pub backoff_max: Duration,
    /// Restarts allowed inside `window`; the next crash opens the breaker.
    pub max_restarts_in_window: u32,
    /// How far back restarts are counted against the breaker.
    pub window: Duration,
    /// Continuous uptime that resets the crash streak.
    pub stable: Duration,
    /// Cooldown after the first open; doubled for every further open.
    pub cooldown: Duration,
    /// The longest cooldown, however often the breaker has opened.
    pub max_cooldown: Duration,
}

impl Default for CrashPolicy {
    fn default() -> Self {
        Self {
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(30),
            max_restarts_in_window: 5,
            window: Duration::from_secs(600),
            stable: Duration::from_secs(60),
            cooldown: Duration::from_secs(600),
            max_cooldown: Duration::from_secs(6 * 3600),
        }
    }
}

/// A user's crash history. It is persisted in the store so that restarting
/// berth does not hand a crash-looping user a fresh budget.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CrashState {
    /// Consecutive crashes without a stable run in between.
    pub streak: u32,
    /// When the restarts inside the current window happened.
    pub restarts: Vec<UnixMillis>,
    /// How many times the breaker has opened.
    pub opens: u32,
    /// When the breaker last opened; `None` if it never has, or was
    /// cleared.
    pub opened_at: Option<UnixMillis>,
    /// When the last opening's cooldown ends; the breaker is open until
    /// then.
    pub cooldown_until: Option<UnixMillis>,
}

impl CrashState {
    /// The breaker, if it is open at `now`.
    pub fn breaker_at(&self, now: UnixMillis) -> Option<BreakerInfo> {
        match (self.opened_at, self.cooldown_until) {
            (Some(opened_at), Some(cooldown_until)) if cooldown_until > now => Some(BreakerInfo {
                opens: self.opens,
                opened_at,
                cooldown_until,
            }),
            _ => None,
        }
    }

    /// True when nothing in the state affects future decisions.
    pub fn is_clear(&self) -> bool {
        *self == Self::default()
    }
}

/// What to do about a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashDecision {
    /// Restart after this delay (jitter not yet applied).
    Restart {
        /// How long to wait before the restart.
        delay: Duration,
    },
    /// Too many restarts in the window: mark the instance `failed`.
    OpenBreaker {
        /// How many times the breaker has opened, this one included.
        opens: u32,
        /// When this opening's cooldown ends (wall clock).
        cooldown_until: UnixMillis,
    },
}

/// Who asked for a launch, which decides how the breaker treats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchKind {
    /// An API launch or a wake-on-request: refused during a cooldown.
    Implicit,
    /// `force`: launches during a cooldown and clears the breaker.
    Force,
}

impl CrashPolicy {
    /// `min(base × 2^streak, max)`, before jitter.
    pub fn backoff(&self, streak: u32) -> Duration {
        let factor = 1u32.checked_shl(streak).unwrap_or(u32::MAX);
        self.backoff_base
            .checked_mul(factor)
            .map_or(self.backoff_max, |d| d.min(self.backoff_max))
    }

    /// Spreads `delay` by up to ±10 %. `unit` is a random number in
    /// `[-1.0, 1.0]`; the caller draws it so this stays pure.
    pub fn jitter(delay: Duration, unit: f64) -> Duration {
        delay.mul_f64(1.0 + 0.1 * unit.clamp(-1.0, 1.0))
    }

    /// `min(cooldown × 2^(opens−1), max_cooldown)`.
    pub fn cooldown_for(&self, opens: u32) -> Duration {
        let factor = 1u32
            .checked_shl(opens.saturating_sub(1))
            .unwrap_or(u32::MAX);
        self.cooldown
            .checked_mul(factor)
            .map_or(self.max_cooldown, |d| d.min(self.max_cooldown))
    }

    /// Records a crash at `now` after `uptime` of running and decides what
    /// follows.
    pub fn on_crash(
        &self,
        state: &mut CrashState,
        now: UnixMillis,
        uptime: Duration,
    ) -> CrashDecision {
        if uptime >= self.stable {
            state.streak = 0;
        }
        let window_start = now.saturating_sub(millis(self.window));
        state.restarts.retain(|&t| t > window_start);
        if state.restarts.len() >= self.max_restarts_in_window as usize {
            state.opens = state.opens.saturating_add(1);
            let cooldown_until = now.saturating_add(millis(self.cooldown_for(state.opens)));
            state.opened_at = Some(now);
            state.cooldown_until = Some(cooldown_until);
            state.streak = 0;
            state.restarts.clear();
            return CrashDecision::OpenBreaker {
                opens: state.opens,
                cooldown_until,
            };
        }
        let delay = self.backoff(state.streak);
        state.streak = state.streak.saturating_add(1);
        state.restarts.push(now);
        CrashDecision::Restart { delay }
    }

    /// Decides whether a launch may go ahead at `now`. On success returns
    /// the state the new instance starts with: a launch always begins a
    /// clean crash budget, and a forced one also forgets the breaker.
    pub fn admit_launch(
        &self,
        state: &CrashState,
        now: UnixMillis,
        kind: LaunchKind,
    ) -> Result<CrashState, BreakerInfo> {
        match (kind, state.breaker_at(now)) {
            (LaunchKind::Implicit, Some(open)) => Err(open),
            (LaunchKind::Implicit, None) => Ok(CrashState {
                opens: state.opens,
                ..CrashState::default()
            }),
            (LaunchKind::Force, _) => Ok(CrashState::default()),
        }
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;

    #[test]
    fn restart_delays_double_up_to_thirty_seconds() {
        let policy = CrashPolicy::default();
        let delays: Vec<u64> = (0..7).map(|s| policy.backoff(s).as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(policy.backoff(200), Duration::from_secs(30));
    }

    #[test]
    fn consecutive_crashes_follow_the_backoff_table() {
        let policy = CrashPolicy::default();
        let mut state = CrashState::default();
        let mut delays = Vec::new();
        for i in 0..5 {
            match policy.on_crash(&mut state, i * 1000, Duration::from_secs(1)) {
                CrashDecision::Restart { delay } => delays.push(delay.as_secs()),
                other => panic!("crash {i}: {other:?}"),
            }
        }
        assert_eq!(delays, [1, 2, 4, 8, 16]);
    }

    #[test]
    fn jitter_stays_within_ten_percent() {
        let d = Duration::from_secs(10);
        assert_eq!(CrashPolicy::jitter(d, -1.0), Duration::from_secs(9));
        assert_eq!(CrashPolicy::jitter(d, 1.0), Duration::from_secs(11));
        assert_eq!(CrashPolicy::jitter(d, 0.0), d);
        assert_eq!(CrashPolicy::jitter(d, 7.0), Duration::from_secs(11));
    }

    #[test]
    fn the_sixth_crash_within_ten_minutes_opens_the_breaker() {
        let policy = CrashPolicy::default();
        let mut state = CrashState::default();
        for i in 0..5 {
            let d = policy.on_crash(&mut state, i * MIN, Duration::from_secs(1));
            assert!(
                matches!(d, CrashDecision::Restart { .. }),
                "crash {}",
                i + 1
            );
        }
        let sixth = policy.on_crash(&mut state, 5 * MIN, Duration::from_secs(1));
        assert_eq!(
            sixth,
            CrashDecision::OpenBreaker {
                opens: 1,
                cooldown_until: 5 * MIN + 10 * MIN
            }
        );
        assert_eq!(state.breaker_at(5 * MIN).map(|b| b.opens), Some(1));
        assert_eq!(state.breaker_at(15 * MIN), None, "cooldown over");
    }

    #[test]
    fn crashes_spread_wider_than_the_window_never_open_it() {
        let policy = CrashPolicy::default();
        let mut state = CrashState::default();
        for i in 0..20 {
            let d = policy.on_crash(&mut state, i * 3 * MIN, Duration::from_secs(1));
            assert!(matches!(d, CrashDecision::Restart { .. }), "crash {i}");
        }
    }

    #[test]
    fn cooldowns_double_from_ten_minutes_up_to_six_hours() {
        let policy = CrashPolicy::default();
        let minutes: Vec<u64> = (1..=7)
            .map(|opens| policy.cooldown_for(opens).as_secs() / 60)
            .collect();
        assert_eq!(minutes, [10, 20, 40, 80, 160, 320, 360]);
        assert_eq!(policy.cooldown_for(99), Duration::from_secs(6 * 3600));
    }

    #[test]
    fn sixty_seconds_of_uptime_resets_the_streak() {
        let policy = CrashPolicy::default();
        let mut state = CrashState::default();
        for i in 0..3 {
            policy.on_crash(&mut state, i * 1000, Duration::from_secs(1));
        }
        assert_eq!(state.streak, 3);
        let after_59s = policy.on_crash(&mut state, 4000, Duration::from_secs(59));
        assert_eq!(
            after_59s,
            CrashDecision::Restart {
                delay: Duration::from_secs(8)
            }
        );
        let after_60s = policy.on_crash(&mut state, 70_000, Duration::from_secs(60));
        assert_eq!(
            after_60s,
            CrashDecision::Restart {
                delay: Duration::from_secs(1)
            }
        );
    }

    #[test]
    fn launches_during_cooldown_are_refused_unless_forced() {
        let policy = CrashPolicy::default();
        let open = CrashState {
            opens: 2,
            opened_at: Some(0),
            cooldown_until: Some(20 * MIN),
            ..CrashState::default()
        };
        let refused = policy.admit_launch(&open, MIN, LaunchKind::Implicit);
        assert_eq!(
            refused,
            Err(BreakerInfo {
                opens: 2,
                opened_at: 0,
                cooldown_until: 20 * MIN
            })
        );
        assert_eq!(
            policy.admit_launch(&open, MIN, LaunchKind::Force),
            Ok(CrashState::default())
        );
        let after = policy
            .admit_launch(&open, 20 * MIN, LaunchKind::Implicit)
            .unwrap();
        assert_eq!(after.opens, 2, "the next open keeps doubling");
        assert_eq!(after.breaker_at(20 * MIN), None);
        assert!(
            after.restarts.is_empty() && after.streak == 0,
            "clean budget"
        );
    }
}
