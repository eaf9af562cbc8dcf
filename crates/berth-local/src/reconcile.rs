//! What to do, at start, with each shim found on disk and each live record
//! the store holds for this node (design §4.7). Pure: the I/O that finds
//! shims and acts on the plan lives in `reattach`.

use std::collections::HashMap;

use berth_core::{Instance, Role, Slug, UserId};

use crate::shim::{ExitInfo, ShimState};

/// A shim state file found under `<data_dir>/run/<slug>/<role>.json`.
#[derive(Debug, Clone)]
pub(crate) struct Found {
    /// The directory it was found in.
    pub dir_slug: String,
    pub role: Role,
    /// Whether a live shim answered on its socket.
    pub alive: bool,
    /// `None` when the state file could not be read.
    pub state: Option<ShimState>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Action {
    /// The shim runs the instance the store knows: supervise it again.
    Adopt { found: usize, record: Instance },
    /// A live shim nobody asked for (no matching record): stop it.
    KillOrphan { found: usize, reason: String },
    /// The store says the instance is live here but its program is gone:
    /// handle it like a crash that happened while berth was away.
    CrashedWhileAway {
        record: Instance,
        exit: Option<ExitInfo>,
        stderr_tail: String,
    },
    /// A dead shim's leftovers with no live record: delete the state file.
    RemoveStale { found: usize },
}

/// Why `state` is not the instance `record` describes, if it is not.
fn mismatch(state: &ShimState, record: &Instance) -> Option<String> {
    let pairs = [
        ("instance id", state.instance_id != record.id),
        ("epoch", state.epoch != record.epoch),
        ("pid", Some(state.pid) != record.pid),
        ("pid start time", Some(state.pid_start) != record.pid_start),
        ("role", state.role != record.role),
    ];
    let differing: Vec<&str> = pairs.iter().filter(|(_, d)| *d).map(|(n, _)| *n).collect();
    (!differing.is_empty())
        .then(|| format!("differs from the store record in {}", differing.join(", ")))
}

/// Plans re-attachment. `records` are this node's instance records;
/// `slugs` the recorded slug of each user with a live one (a shim belongs
/// to its user only in the run directory of that slug).
pub(crate) fn plan(
    found: &[Found],
    records: &[Instance],
    slugs: &HashMap<UserId, Slug>,
) -> Vec<Action> {
    let mut actions = Vec::new();
    let live: Vec<&Instance> = records.iter().filter(|r| r.status.is_live()).collect();
    let mut matched = vec![false; live.len()];

    for (i, f) in found.iter().enumerate() {
        let Some(state) = &f.state else {
            actions.push(if f.alive {
                Action::KillOrphan {
                    found: i,
                    reason: "unreadable state file".into(),
                }
            } else {
                Action::RemoveStale { found: i }
            });
            continue;
        };
        let user = UserId::parse(&state.user).ok();
        let slug_ok = user
            .as_ref()
            .and_then(|u| slugs.get(u))
            .is_some_and(|slug| slug.as_str() == f.dir_slug);
        let candidate = live.iter().position(|r| {
            slug_ok && Some(&r.user) == user.as_ref() && r.role == f.role && r.role == state.role
        });
        let verdict = match candidate {
            None if !slug_ok => Err("its user does not belong to its directory".to_owned()),
            None => Err("no live store record on this node".to_owned()),
            Some(idx) => match mismatch(state, live[idx]) {
                Some(why) => Err(why),
                None => Ok(idx),
            },
        };
        match (verdict, f.alive) {
            (Ok(idx), true) => {
                matched[idx] = true;
                actions.push(Action::Adopt {
                    found: i,
                    record: live[idx].clone(),
                });
            }
            (Ok(idx), false) => {
                matched[idx] = true;
                actions.push(Action::CrashedWhileAway {
                    record: live[idx].clone(),
                    exit: state.exit,
                    stderr_tail: state.stderr_tail.clone(),
                });
            }
            (Err(reason), true) => actions.push(Action::KillOrphan { found: i, reason }),
            (Err(_), false) => actions.push(Action::RemoveStale { found: i }),
        }
    }
    for (idx, record) in live.iter().enumerate() {
        if !matched[idx] {
            actions.push(Action::CrashedWhileAway {
                record: (*record).clone(),
                exit: None,
                stderr_tail: String::new(),
            });
        }
    }
    actions
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_core::InstanceStatus;
    use std::path::PathBuf;

    fn record(user: &str, role: Role, status: InstanceStatus) -> Instance {
        Instance {
            id: format!("id-{user}-{role}"),
            user: UserId::parse(user).unwrap(),
            role,
            status,
            node: "n1".into(),
            epoch: 3,
            port: Some(20000),
            pid: Some(100),
            pid_start: Some(555),
            folder: String::new(),
            started_at: 0,
            ready: true,
            restarts: 0,
            last_error: None,
            exit_code: None,
            last_active: 0,
        }
    }

    fn state_of(r: &Instance) -> ShimState {
        ShimState {
            instance_id: r.id.clone(),
            user: r.user.as_str().into(),
            role: r.role,
            epoch: r.epoch,
            socket_path: PathBuf::from("/x.sock"),
            shim_pid: 99,
            pid: r.pid.unwrap(),
            pid_start: r.pid_start.unwrap(),
            ready: false,
            token: None,
            exit: None,
            stderr_tail: String::new(),
            frozen: false,
            uid: None,
            cgroup: Vec::new(),
        }
    }

    /// Today's slug recorded for each record's user.
    fn slugs(records: &[&Instance]) -> HashMap<UserId, Slug> {
        records
            .iter()
            .map(|r| (r.user.clone(), r.user.slug()))
            .collect()
    }

    fn found(r: &Instance, alive: bool, state: ShimState) -> Found {
        Found {
            dir_slug: r.user.slug().as_str().into(),
            role: r.role,
            alive,
            state: Some(state),
        }
    }

    #[test]
    fn a_matching_live_shim_is_adopted() {
        let r = record("alice", Role::Main, InstanceStatus::Running);
        let plan = plan(
            &[found(&r, true, state_of(&r))],
            std::slice::from_ref(&r),
            &slugs(&[&r]),
        );
        assert_eq!(
            plan,
            [Action::Adopt {
                found: 0,
                record: r
            }]
        );
    }

    #[test]
    fn a_reused_pid_is_not_mistaken_for_the_instance() {
        let r = record("alice", Role::Main, InstanceStatus::Running);
        let mut s = state_of(&r);
        s.pid_start = 1;
        let plan = plan(
            &[found(&r, true, s)],
            std::slice::from_ref(&r),
            &slugs(&[&r]),
        );
        assert!(
            matches!(&plan[0], Action::KillOrphan { reason, .. } if reason.contains("pid start"))
        );
        assert!(matches!(&plan[1], Action::CrashedWhileAway { record, .. } if record.id == r.id));
    }

    #[test]
    fn shims_without_a_live_record_are_orphans_or_leftovers() {
        let r = record("alice", Role::Main, InstanceStatus::Stopped);
        let plan = plan(
            &[
                found(&r, true, state_of(&r)),
                found(&r, false, state_of(&r)),
            ],
            std::slice::from_ref(&r),
            &slugs(&[]),
        );
        assert!(matches!(plan[0], Action::KillOrphan { found: 0, .. }));
        assert_eq!(plan[1], Action::RemoveStale { found: 1 });
        assert_eq!(plan.len(), 2);
    }

    #[test]
    fn a_dead_shim_with_a_live_record_is_a_crash_while_away() {
        let r = record("bob", Role::Main, InstanceStatus::Running);
        let mut s = state_of(&r);
        s.exit = Some(ExitInfo {
            code: Some(3),
            signal: None,
            oom_limit_mb: None,
        });
        s.stderr_tail = "boom".into();
        let plan = plan(
            &[found(&r, false, s)],
            std::slice::from_ref(&r),
            &slugs(&[&r]),
        );
        assert_eq!(
            plan,
            [Action::CrashedWhileAway {
                record: r,
                exit: Some(ExitInfo {
                    code: Some(3),
                    signal: None,
                    oom_limit_mb: None,
                }),
                stderr_tail: "boom".into()
            }]
        );
    }

    #[test]
    fn a_live_record_without_any_shim_is_a_crash_while_away() {
        let main = record("carol", Role::Main, InstanceStatus::Starting);
        let dog = record("carol", Role::Watchdog, InstanceStatus::Running);
        let gone = record("dave", Role::Main, InstanceStatus::Failed);
        let plan = plan(&[], &[main.clone(), dog.clone(), gone], &slugs(&[&main]));
        assert_eq!(plan.len(), 2);
        assert!(
            plan.iter()
                .all(|a| matches!(a, Action::CrashedWhileAway { exit: None, .. }))
        );
    }

    #[test]
    fn a_shim_in_the_wrong_directory_is_an_orphan() {
        let r = record("alice", Role::Main, InstanceStatus::Running);
        let mut f = found(&r, true, state_of(&r));
        f.dir_slug = "mallory".into();
        let plan = plan(&[f], std::slice::from_ref(&r), &slugs(&[&r]));
        assert!(
            matches!(&plan[0], Action::KillOrphan { reason, .. } if reason.contains("directory"))
        );
    }

    /// A user whose recorded slug is an earlier rule's: their shim lives in
    /// that run directory and is adopted there, and a shim claiming the
    /// user from today's slug directory is not theirs.
    #[test]
    fn the_recorded_slug_decides_the_directory() {
        let r = record("alice*{@(.:$*corp", Role::Main, InstanceStatus::Running);
        let legacy = r.user.legacy_slug();
        let recorded = HashMap::from([(r.user.clone(), legacy.clone())]);
        let mut in_legacy = found(&r, true, state_of(&r));
        in_legacy.dir_slug = legacy.as_str().into();
        let plan_legacy = plan(&[in_legacy], std::slice::from_ref(&r), &recorded);
        assert!(
            matches!(&plan_legacy[0], Action::Adopt { found: 0, .. }),
            "{plan_legacy:?}"
        );
        let in_today = found(&r, true, state_of(&r));
        let plan_today = plan(&[in_today], std::slice::from_ref(&r), &recorded);
        assert!(
            matches!(&plan_today[0], Action::KillOrphan { reason, .. } if reason.contains("directory")),
            "{plan_today:?}"
        );
    }
}
