use std::time::Duration;

use crate::{InstanceStatus, UnixMillis};

/// What the reaper does with a main that has been idle long enough.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IdleAction {
    /// Freeze it with its memory intact after `hibernate_after`; stop it
    /// after `stop_after` hibernated. Where the runtime cannot freeze, the
    /// reaper acts as with [`IdleAction::Stop`].
    #[default]
    Hibernate,
    /// Stop it after `idle_ttl`.
    Stop,
}

impl IdleAction {
    /// The action's name, as the config file and a user's status spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            IdleAction::Hibernate => "hibernate",
            IdleAction::Stop => "stop",
        }
    }
}

/// The idle reaper's numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReapPolicy {
    /// Stop running mains idle longer than this when they are not
    /// hibernated instead; `None` never does.
    pub idle_ttl: Option<Duration>,
    /// Keep at most this many idle running mains warm; `0` means no cap. An
    /// instance counts as idle when it saw no activity during the last
    /// `interval`.
    pub max_idle: usize,
    /// How often the reaper runs.
    pub interval: Duration,
    /// Whether idle mains are hibernated or stopped.
    pub idle_action: IdleAction,
    /// Hibernate running mains idle longer than this; `None` never does.
    pub hibernate_after: Option<Duration>,
    /// Stop mains hibernated longer than this; `None` never does.
    pub stop_after: Option<Duration>,
    /// Keep at most this many mains hibernated on the node; `0` means no
    /// cap. Past it the longest-hibernated are stopped first.
    pub max_hibernated: usize,
}

impl Default for ReapPolicy {
    fn default() -> Self {
        Self {
            idle_ttl: Some(Duration::from_secs(3600)),
            max_idle: 0,
            interval: Duration::from_secs(60),
            idle_action: IdleAction::Hibernate,
            hibernate_after: Some(Duration::from_secs(300)),
            stop_after: Some(Duration::from_secs(3600)),
            max_hibernated: 0,
        }
    }
}

impl ReapPolicy {
    /// What the reaper really does on a runtime that can (or cannot)
    /// freeze: hibernation needs the freeze capability.
    pub fn effective_action(&self, can_freeze: bool) -> IdleAction {
        match self.idle_action {
            IdleAction::Hibernate if can_freeze => IdleAction::Hibernate,
            _ => IdleAction::Stop,
        }
    }
}

/// One main the reaper looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReapCandidate<K> {
    /// The caller's handle on the main, handed back in the plan.
    pub key: K,
    /// `running` or `hibernated` (anything else is not looked at).
    pub status: InstanceStatus,
    /// When it last saw activity (a request, a message, a touch).
    pub last_active: UnixMillis,
    /// Since when it is hibernated (for a hibernated main).
    pub hibernated_at: Option<UnixMillis>,
}

/// What the reaper decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReapPlan<K> {
    /// Running mains to freeze.
    pub hibernate: Vec<K>,
    /// Mains to stop (running or hibernated).
    pub stop: Vec<K>,
}

impl<K> Default for ReapPlan<K> {
    fn default() -> Self {
        Self {
            hibernate: Vec::new(),
            stop: Vec::new(),
        }
    }
}

fn age(now: UnixMillis, since: UnixMillis) -> Duration {
    Duration::from_millis(u64::try_from(now.saturating_sub(since)).unwrap_or(0))
}

/// Decides, at `now`, which mains to hibernate and which to stop.
///
/// With [`IdleAction::Hibernate`] on a runtime that can freeze: running
/// mains idle past `hibernate_after` are hibernated; hibernated mains past
/// `stop_after` are stopped; then, if more than `max_hibernated` would stay
/// hibernated (the newly hibernated included), the longest-hibernated are
/// stopped until the cap holds. `max_idle` still caps idle running mains.
///
/// Otherwise (or for a main already hibernated when the action changed),
/// [`select_for_reaping`]'s rules stop running mains, and hibernated ones
/// still follow `stop_after` and `max_hibernated`.
pub fn plan_reaping<K: Clone + PartialEq>(
    policy: &ReapPolicy,
    can_freeze: bool,
    now: UnixMillis,
    mains: &[ReapCandidate<K>],
) -> ReapPlan<K> {
    let mut plan = ReapPlan::default();
    let hibernating = policy.effective_action(can_freeze) == IdleAction::Hibernate;
    // Hibernated mains that stay hibernated, with since when.
    let mut kept: Vec<(K, UnixMillis)> = Vec::new();
    let mut running: Vec<(K, UnixMillis)> = Vec::new();
    for main in mains {
        match main.status {
            InstanceStatus::Hibernated => {
                let since = main.hibernated_at.unwrap_or(main.last_active);
                if policy.stop_after.is_some_and(|d| age(now, since) > d) {
                    plan.stop.push(main.key.clone());
                } else {
                    kept.push((main.key.clone(), since));
                }
            }
            InstanceStatus::Running => running.push((main.key.clone(), main.last_active)),
            _ => {}
        }
    }
    if hibernating {
        let mut awake = Vec::new();
        for (key, t) in running {
            if policy.hibernate_after.is_some_and(|d| age(now, t) >= d) {
                plan.hibernate.push(key.clone());
                kept.push((key, now));
            } else {
                awake.push((key, t));
            }
        }
        plan.stop.extend(select_for_reaping(
            &ReapPolicy {
                idle_ttl: None,
                ..policy.clone()
            },
            now,
            &awake,
        ));
    } else {
        plan.stop.extend(select_for_reaping(policy, now, &running));
    }
    if policy.max_hibernated > 0 && kept.len() > policy.max_hibernated {
        // Oldest first; ties (e.g. several hibernated in this very plan)
        // keep their input order, so the result is deterministic.
        kept.sort_by_key(|(_, since)| *since);
        let excess = kept.len() - policy.max_hibernated;
        for (key, _) in kept.into_iter().take(excess) {
            // One hibernated in this plan and over the cap at once is not
            // worth freezing first: stop it instead.
            if let Some(pos) = plan.hibernate.iter().position(|k| *k == key) {
                plan.hibernate.remove(pos);
            }
            plan.stop.push(key);
        }
    }
    plan
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
    let idle_for = |t: UnixMillis| age(now, t);
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

    const SEC: i64 = 1000;
    const MIN: i64 = 60 * SEC;

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
            ..ReapPolicy::default()
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

    fn running(key: &'static str, last_active: i64) -> ReapCandidate<&'static str> {
        ReapCandidate {
            key,
            status: InstanceStatus::Running,
            last_active,
            hibernated_at: None,
        }
    }

    fn hibernated(key: &'static str, since: i64) -> ReapCandidate<&'static str> {
        ReapCandidate {
            key,
            status: InstanceStatus::Hibernated,
            last_active: since - 2 * SEC,
            hibernated_at: Some(since),
        }
    }

    fn policy(hibernate_after_s: u64, stop_after_s: u64, max_hibernated: usize) -> ReapPolicy {
        ReapPolicy {
            idle_ttl: Some(Duration::from_secs(3600)),
            max_idle: 0,
            interval: Duration::from_secs(1),
            idle_action: IdleAction::Hibernate,
            hibernate_after: Some(Duration::from_secs(hibernate_after_s)),
            stop_after: Some(Duration::from_secs(stop_after_s)),
            max_hibernated,
        }
    }

    #[test]
    fn reaping_table() {
        let now = 1000 * MIN;
        type Case = (
            &'static str,
            ReapPolicy,
            bool,
            Vec<ReapCandidate<&'static str>>,
            Vec<&'static str>,
            Vec<&'static str>,
        );
        let cases: Vec<Case> = vec![
            (
                "idle past hibernate_after hibernates; busy stays",
                policy(2, 60, 0),
                true,
                vec![running("idle", now - 2 * SEC), running("busy", now - SEC)],
                vec!["idle"],
                vec![],
            ),
            (
                "hibernated past stop_after stops; younger stays",
                policy(2, 60, 0),
                true,
                vec![
                    hibernated("old", now - 61 * SEC),
                    hibernated("young", now - 59 * SEC),
                ],
                vec![],
                vec!["old"],
            ),
            (
                "a runtime that cannot freeze stops after idle_ttl instead",
                policy(2, 60, 0),
                false,
                vec![
                    running("idle", now - 2 * SEC),
                    running("gone", now - 61 * MIN),
                ],
                vec![],
                vec!["gone"],
            ),
            (
                "idle_action stop ignores hibernate_after",
                ReapPolicy {
                    idle_action: IdleAction::Stop,
                    ..policy(2, 60, 0)
                },
                true,
                vec![
                    running("idle", now - 2 * SEC),
                    running("gone", now - 61 * MIN),
                ],
                vec![],
                vec!["gone"],
            ),
            (
                "hibernating, idle_ttl does not stop running mains",
                policy(7200, 60, 0),
                true,
                vec![running("long", now - 61 * MIN)],
                vec![],
                vec![],
            ),
            (
                "max_hibernated stops the longest-hibernated first",
                policy(2, 600, 2),
                true,
                vec![
                    hibernated("h30", now - 30 * SEC),
                    hibernated("h50", now - 50 * SEC),
                    hibernated("h10", now - 10 * SEC),
                ],
                vec![],
                vec!["h50"],
            ),
            (
                "the newly hibernated count against max_hibernated, youngest kept",
                policy(2, 600, 2),
                true,
                vec![
                    hibernated("h30", now - 30 * SEC),
                    hibernated("h50", now - 50 * SEC),
                    running("idle", now - 5 * SEC),
                ],
                vec!["idle"],
                vec!["h50"],
            ),
            (
                "over the cap by new ones alone: the extra is stopped, not frozen",
                policy(2, 600, 1),
                true,
                vec![running("a", now - 5 * SEC), running("b", now - 5 * SEC)],
                vec!["b"],
                vec!["a"],
            ),
            (
                "no stop_after: hibernated for ever",
                ReapPolicy {
                    stop_after: None,
                    ..policy(2, 60, 0)
                },
                true,
                vec![hibernated("old", now - 1000 * MIN + SEC)],
                vec![],
                vec![],
            ),
            (
                "no hibernate_after: nothing hibernates",
                ReapPolicy {
                    hibernate_after: None,
                    ..policy(2, 60, 0)
                },
                true,
                vec![running("idle", now - 30 * MIN)],
                vec![],
                vec![],
            ),
        ];
        for (name, policy, can_freeze, mains, hibernate, stop) in cases {
            let plan = plan_reaping(&policy, can_freeze, now, &mains);
            assert_eq!(plan.hibernate, hibernate, "{name}: hibernate");
            assert_eq!(plan.stop, stop, "{name}: stop");
        }
    }
}
