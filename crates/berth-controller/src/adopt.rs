//! Adoption at start: what to do with each instance the runtime still
//! runs (or last ran) and each live record the store holds for this
//! node. [`plan`] and [`in_waves`] are pure; [`Shared::adopt_all`] acts on
//! them, many users at once: each step waits on the store and the
//! runtime, not on the CPU, so one at a time would make a node of
//! thousands wait minutes for its last user.

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::{StreamExt, TryStreamExt};

use berth_core::policy::supervision::FENCED_ERROR;
use berth_core::runtime::{Discovered, ExitStatus};
use berth_core::{Epoch, Instance, InstanceStatus, Role, Slug, UserId};
use berth_store::{InstanceFilter, StoreError};
use tokio::sync::OwnedMutexGuard;

use crate::driver::{self, Begin, Run};
use crate::users::{Entry, Slot};
use crate::{ControllerError, Shared};

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Step {
    /// The runtime runs the instance the store knows: supervise it again.
    Adopt { found: usize, record: Instance },
    /// Something the runtime runs (or left) that no live record matches:
    /// an orphan to end, or leftovers to clean up.
    Remove { found: usize, reason: String },
    /// The store says the instance is live here but its program is gone:
    /// handle it like a crash that happened while berth was away.
    CrashedWhileAway {
        record: Instance,
        exit: Option<ExitStatus>,
    },
}

/// Why `found` is not the instance `record` describes, if it is not.
fn mismatch(found: &Discovered, record: &Instance) -> Option<String> {
    let pairs = [
        ("instance id", found.instance_id != record.id),
        ("epoch", found.epoch != record.epoch),
        (
            "runtime reference",
            record.runtime_ref.as_ref() != Some(&found.runtime_ref),
        ),
    ];
    let differing: Vec<&str> = pairs.iter().filter(|(_, d)| *d).map(|(n, _)| *n).collect();
    (!differing.is_empty())
        .then(|| format!("differs from the store record in {}", differing.join(", ")))
}

/// Plans adoption. `records` are this node's instance records; `slug_of`
/// is the recorded slug of each user with a live record, which names the
/// directory (or object) the user's instances are filed under.
pub(crate) fn plan(
    found: &[Discovered],
    records: &[Instance],
    slug_of: impl Fn(&UserId) -> Option<Slug>,
) -> Vec<Step> {
    let mut steps = Vec::new();
    let live: Vec<&Instance> = records.iter().filter(|r| r.status.is_live()).collect();
    // The store keeps one record per user and role; looked up, not
    // searched, so a node of thousands plans in linear time.
    let live_index: HashMap<(&UserId, Role), usize> = live
        .iter()
        .enumerate()
        .map(|(idx, r)| ((&r.user, r.role), idx))
        .collect();
    let mut matched = vec![false; live.len()];
    for (i, f) in found.iter().enumerate() {
        let Some(user) = &f.user else {
            steps.push(Step::Remove {
                found: i,
                reason: "its records are unreadable".into(),
            });
            continue;
        };
        let verdict = if slug_of(user).is_none_or(|slug| slug.as_str() != f.slug) {
            Err("its user does not belong where it is filed".to_owned())
        } else {
            match live_index.get(&(user, f.role)).copied() {
                None => Err("no live store record on this node".to_owned()),
                Some(idx) if matched[idx] => Err("another instance matched its record".to_owned()),
                Some(idx) => mismatch(f, live[idx]).map_or(Ok(idx), Err),
            }
        };
        match (verdict, f.alive) {
            (Ok(idx), true) => {
                matched[idx] = true;
                steps.push(Step::Adopt {
                    found: i,
                    record: live[idx].clone(),
                });
            }
            (Ok(idx), false) => {
                matched[idx] = true;
                steps.push(Step::CrashedWhileAway {
                    record: live[idx].clone(),
                    exit: f.exit.clone(),
                });
            }
            (Err(reason), _) => steps.push(Step::Remove { found: i, reason }),
        }
    }
    for (idx, record) in live.iter().enumerate() {
        if !matched[idx] {
            steps.push(Step::CrashedWhileAway {
                record: (*record).clone(),
                exit: None,
            });
        }
    }
    steps
}

/// How many users adoption works on at once. Each user's step mostly
/// waits (a local shim's greeting, a store query), so the bound is there
/// to cap what is in flight, not to share the CPU.
const ADOPT_CONCURRENCY: usize = 256;

/// `steps` in the order adoption takes them: first every removal (each
/// alone: they free ports and accounts that a restart may need), then one
/// group per user, its steps in plan order (a main and its watchdog share
/// a slot). Groups of one wave run at once.
pub(crate) fn in_waves(steps: Vec<Step>) -> (Vec<Step>, Vec<Vec<Step>>) {
    let (removals, rest): (Vec<Step>, Vec<Step>) = steps
        .into_iter()
        .partition(|s| matches!(s, Step::Remove { .. }));
    let mut groups: Vec<Vec<Step>> = Vec::new();
    let mut group_of: HashMap<UserId, usize> = HashMap::new();
    for step in rest {
        let user = match &step {
            Step::Adopt { record, .. } | Step::CrashedWhileAway { record, .. } => &record.user,
            Step::Remove { .. } => continue,
        };
        match group_of.get(user) {
            Some(&i) => groups[i].push(step),
            None => {
                group_of.insert(user.clone(), groups.len());
                groups.push(vec![step]);
            }
        }
    }
    (removals, groups)
}

/// The exit of an instance that ended while berth was away without saying
/// how.
fn unknown_exit() -> ExitStatus {
    ExitStatus {
        code: None,
        signal: None,
        stderr_tail: "ended while berth was away".into(),
        out_of_memory: None,
        port_in_use: false,
    }
}

/// Adoption as planned at start, to be carried out while berth serves.
///
/// Every user it will adopt has a slot already, marked as awaiting
/// adoption, whose lifecycle lock this holds: a launch of such a user
/// answers "starting" rather than start a second instance, and a stop or
/// restart waits for the adoption to end.
pub(crate) struct Adoption {
    found: Vec<Discovered>,
    held: HashMap<UserId, Epoch>,
    removals: Vec<Step>,
    groups: Vec<Group>,
}

/// One user's steps, and the lock that keeps the user's other lifecycle
/// operations out until they are taken.
struct Group {
    slot: Option<Arc<Slot>>,
    _lifecycle: Option<OwnedMutexGuard<()>>,
    steps: Vec<Step>,
}

fn step_user(step: &Step) -> Option<&UserId> {
    match step {
        Step::Adopt { record, .. } | Step::CrashedWhileAway { record, .. } => Some(&record.user),
        Step::Remove { .. } => None,
    }
}

impl Shared {
    /// Reads what the store records for this node and what the runtime
    /// still runs, plans adoption, and marks every user it will adopt (see
    /// [`Adoption`]). Starts nothing: [`Shared::adopt_all`] does.
    pub(crate) async fn plan_adoption(self: &Arc<Self>) -> Result<Adoption, ControllerError> {
        let began = std::time::Instant::now();
        let filter = InstanceFilter {
            node: Some(self.node_id().to_owned()),
            ..InstanceFilter::default()
        };
        let records = self.store.list_instances(&filter).await?;
        let held: HashMap<UserId, Epoch> = self
            .store
            .leases_held_by(self.node_id())
            .await?
            .into_iter()
            .map(|l| (l.user, l.epoch))
            .collect();
        let found = self
            .runtime
            .discover()
            .await
            .map_err(|e| ControllerError::Discover {
                runtime: self.runtime.name(),
                message: e.to_string(),
            })?;
        tracing::info!(
            found = found.len(),
            records = records.len(),
            seconds = began.elapsed().as_secs_f64(),
            "listed what the runtime runs and the store records"
        );
        // A live instance is filed under its user's recorded slug; a user
        // recorded by no earlier berth gets one now (keeping an earlier
        // slug's data, see `recorded_slug`).
        let mut live_users: Vec<&UserId> = records
            .iter()
            .filter(|r| r.status.is_live())
            .map(|r| &r.user)
            .collect();
        live_users.sort();
        live_users.dedup();
        // Read in one go; only a user no earlier berth recorded is asked
        // about alone.
        let mut slugs: HashMap<UserId, Slug> = self
            .store
            .user_slugs_on(self.node_id())
            .await?
            .into_iter()
            .collect();
        let unrecorded = live_users.into_iter().filter(|u| !slugs.contains_key(*u));
        let recorded: Vec<(UserId, Slug)> = futures_util::stream::iter(unrecorded)
            .map(|user| async move {
                let slug = self.recorded_slug(user).await?;
                Ok::<_, StoreError>((user.clone(), slug))
            })
            .buffer_unordered(ADOPT_CONCURRENCY)
            .try_collect()
            .await?;
        slugs.extend(recorded);
        let (removals, groups) = in_waves(plan(&found, &records, |u| slugs.get(u).cloned()));
        let mut marked = Vec::with_capacity(groups.len());
        for steps in groups {
            let slot = steps
                .first()
                .and_then(step_user)
                .and_then(|user| Some(self.users.insert(user, slugs.get(user)?.clone())));
            let lifecycle = match &slot {
                Some(slot) => {
                    slot.set_awaiting_adoption(true);
                    Some(Arc::clone(&slot.lifecycle).lock_owned().await)
                }
                None => None,
            };
            marked.push(Group {
                slot,
                _lifecycle: lifecycle,
                steps,
            });
        }
        let awaiting = marked.iter().filter(|g| g.slot.is_some()).count();
        tracing::info!(
            users = awaiting,
            seconds = began.elapsed().as_secs_f64(),
            "adoption planned"
        );
        self.publisher.adoption_pending(awaiting);
        Ok(Adoption {
            found,
            held,
            removals,
            groups: marked,
        })
    }

    /// Carries out `adoption`, many users at once; each user's mark and
    /// lock go as soon as that user's steps are taken. Stops taking new
    /// users when the controller stops (their instances run on, for the
    /// next berth to adopt).
    pub(crate) async fn adopt_all(self: &Arc<Self>, adoption: Adoption) {
        let started = std::time::Instant::now();
        let Adoption {
            found,
            held,
            removals,
            groups,
        } = adoption;
        let users = groups.len();
        let (found, held) = (&found, &held);
        futures_util::stream::iter(removals)
            .for_each_concurrent(ADOPT_CONCURRENCY, |step| self.take(step, found, held))
            .await;
        futures_util::stream::iter(groups)
            .take_until(self.cancel.cancelled())
            .for_each_concurrent(ADOPT_CONCURRENCY, |group| async move {
                for step in group.steps {
                    self.take(step, found, held).await;
                }
                if let Some(slot) = &group.slot {
                    slot.set_awaiting_adoption(false);
                    self.publisher.adoption_ended();
                }
            })
            .await;
        tracing::info!(
            users,
            seconds = started.elapsed().as_secs_f64(),
            "adoption ended"
        );
        self.adopted.send_replace(true);
    }

    /// Carries out one step of the plan.
    async fn take(
        self: &Arc<Self>,
        step: Step,
        found: &[Discovered],
        held: &HashMap<UserId, Epoch>,
    ) {
        match step {
            Step::Adopt { found: i, record } => {
                tracing::info!(user = %record.user, role = %record.role, pid = ?record.pid,
                    "adopting a running instance");
                self.adopt(record, &found[i], held).await;
            }
            Step::Remove { found: i, reason } => {
                let f = &found[i];
                if f.alive {
                    tracing::warn!(slug = %f.slug, role = %f.role, %reason,
                        "ending an instance with no matching record");
                }
                if let Err(e) = self.runtime.remove(f).await {
                    tracing::warn!(slug = %f.slug, error = %e, "could not remove the instance");
                }
            }
            Step::CrashedWhileAway { record, exit } => {
                tracing::warn!(user = %record.user, role = %record.role,
                    "instance ended while berth was away");
                self.recover(record, exit, held).await;
            }
        }
    }

    /// The slot of a live record's user (its slug was recorded before the
    /// plan was made, so this asks the store nothing new).
    async fn prepare_slot(&self, record: &Instance) -> Option<Arc<Slot>> {
        let slot = match self.slot(&record.user).await {
            Ok(slot) => slot,
            Err(e) => {
                tracing::warn!(user = %record.user, error = %e, "cannot prepare the user's slot");
                return None;
            }
        };
        slot.touch(record.last_active);
        slot.flushed(record.last_active);
        Some(slot)
    }

    /// Records `record` as fenced: another node holds its lease now.
    async fn record_fenced(&self, slot: &Slot, mut record: Instance) {
        self.runtime.release(&record.id).await;
        record.status = InstanceStatus::Stopped;
        record.ready = false;
        record.last_error = Some(FENCED_ERROR.into());
        let (entry, _) = Entry::new(record.clone(), None);
        self.publisher.install(slot, entry);
        let stored = self
            .publisher
            .publish(slot, &record, None, Some(FENCED_ERROR.into()))
            .await;
        self.on_store_refusal(&slot.user, &stored);
    }

    async fn adopt(
        self: &Arc<Self>,
        mut record: Instance,
        found: &Discovered,
        held: &HashMap<UserId, Epoch>,
    ) {
        let Some(slot) = self.prepare_slot(&record).await else {
            return;
        };
        let listed = record.clone();
        if record.status == InstanceStatus::Hibernated {
            // Hibernated as recorded and frozen as found: it stays so until
            // a request resumes it (no renew thaws it). Found running, the
            // runtime's word wins.
            if found.frozen {
                slot.set_hibernated(true);
            } else {
                record.status = InstanceStatus::Running;
                record.hibernated_at = None;
            }
        }
        if record.role == Role::Main {
            let Some(epoch) = self.fencer.regain(&record.user, record.epoch, held).await else {
                if let Err(e) = self.runtime.remove(found).await {
                    tracing::warn!(user = %record.user, error = %e, "could not fence the instance");
                }
                self.record_fenced(&slot, record).await;
                return;
            };
            record.epoch = epoch;
        }
        let started = match self.runtime.adopt(found).await {
            Ok(started) => started,
            Err(e) => {
                tracing::warn!(user = %record.user, error = %e, "could not follow the instance");
                self.recover(record, None, held).await;
                return;
            }
        };
        if found.token.is_some() {
            // Before `start` returns, so the open URL can be built at once.
            self.publisher.set_token(&record.user, found.token.clone());
        }
        let ready = record.ready || (found.ready && record.role == Role::Main);
        let (entry, stops) = Entry::new(record.clone(), started.endpoint.clone());
        self.publisher.install(&slot, entry);
        let message = Some("re-attached".to_owned());
        if record == listed {
            // The store holds this record already: a node of thousands
            // adopts without a write per instance.
            self.publisher
                .announce(&slot, &record, started.endpoint.clone(), message);
        } else {
            let stored = self
                .publisher
                .publish(&slot, &record, started.endpoint.clone(), message)
                .await;
            self.on_store_refusal(&slot.user, &stored);
        }
        match record.role {
            Role::Main => driver::start_main(
                self,
                &slot,
                &record,
                stops,
                Begin::Run {
                    run: Run::of(started),
                    started_at: record.started_at,
                    ready,
                    fresh: false,
                },
            ),
            Role::Watchdog => {
                driver::start_watchdog(self, &slot, &record.id, Run::of(started), stops);
            }
        }
    }

    async fn recover(
        self: &Arc<Self>,
        mut record: Instance,
        exit: Option<ExitStatus>,
        held: &HashMap<UserId, Epoch>,
    ) {
        if record.role == Role::Watchdog {
            // Watchdogs are never restarted: forget the record.
            self.runtime.release(&record.id).await;
            if let Err(e) = self
                .store
                .delete_instance(&record.user, Role::Watchdog)
                .await
            {
                tracing::warn!(user = %record.user, error = %e, "could not delete the watchdog record");
            }
            return;
        }
        let Some(slot) = self.prepare_slot(&record).await else {
            return;
        };
        let Some(epoch) = self.fencer.regain(&record.user, record.epoch, held).await else {
            self.record_fenced(&slot, record).await;
            return;
        };
        record.epoch = epoch;
        let counted = record.status == InstanceStatus::Crashed;
        let ready = record.ready;
        record.ready = false;
        let (entry, stops) = Entry::new(record.clone(), None);
        self.publisher.install(&slot, entry);
        self.publisher.announce(&slot, &record, None, None);
        let begin = if counted {
            Begin::Respawn
        } else {
            Begin::Ended {
                started_at: record.started_at,
                ready,
                exit: exit.unwrap_or_else(unknown_exit),
            }
        };
        driver::start_main(self, &slot, &record, stops, begin);
    }
}

#[cfg(test)]
mod tests {
    use berth_core::runtime::RuntimeRef;

    use super::*;

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
            runtime_ref: Some(RuntimeRef::new(format!("ref-{user}-{role}"))),
            folder: String::new(),
            started_at: 0,
            ready: true,
            restarts: 0,
            last_error: None,
            exit_code: None,
            last_active: 0,
            hibernated_at: None,
        }
    }

    fn found(r: &Instance, alive: bool) -> Discovered {
        Discovered {
            user: Some(r.user.clone()),
            slug: r.user.slug().as_str().into(),
            role: r.role,
            instance_id: r.id.clone(),
            epoch: r.epoch,
            runtime_ref: r.runtime_ref.clone().unwrap(),
            alive,
            frozen: false,
            ready: false,
            token: None,
            exit: None,
        }
    }

    #[test]
    fn removals_go_first_then_each_users_steps_together_in_plan_order() {
        let a_main = record("alice", Role::Main, InstanceStatus::Running);
        let a_dog = record("alice", Role::Watchdog, InstanceStatus::Running);
        let b_main = record("bob", Role::Main, InstanceStatus::Running);
        let steps = vec![
            Step::Adopt {
                found: 0,
                record: a_main.clone(),
            },
            Step::Remove {
                found: 1,
                reason: "x".into(),
            },
            Step::CrashedWhileAway {
                record: b_main.clone(),
                exit: None,
            },
            Step::Adopt {
                found: 2,
                record: a_dog.clone(),
            },
            Step::Remove {
                found: 3,
                reason: "y".into(),
            },
        ];
        let (removals, groups) = in_waves(steps);
        assert_eq!(
            removals,
            [
                Step::Remove {
                    found: 1,
                    reason: "x".into()
                },
                Step::Remove {
                    found: 3,
                    reason: "y".into()
                }
            ]
        );
        assert_eq!(
            groups,
            [
                vec![
                    Step::Adopt {
                        found: 0,
                        record: a_main
                    },
                    Step::Adopt {
                        found: 2,
                        record: a_dog
                    }
                ],
                vec![Step::CrashedWhileAway {
                    record: b_main,
                    exit: None
                }],
            ]
        );
    }

    fn plan_of(found: &[Discovered], records: &[Instance]) -> Vec<Step> {
        plan(found, records, |u| Some(u.slug()))
    }

    #[test]
    fn a_matching_live_instance_is_adopted() {
        let r = record("alice", Role::Main, InstanceStatus::Running);
        assert_eq!(
            plan_of(&[found(&r, true)], std::slice::from_ref(&r)),
            [Step::Adopt {
                found: 0,
                record: r
            }]
        );
    }

    #[test]
    fn another_run_under_the_same_id_is_not_mistaken_for_the_instance() {
        // A reused pid: the runtime's reference differs.
        let r = record("alice", Role::Main, InstanceStatus::Running);
        let mut f = found(&r, true);
        f.runtime_ref = RuntimeRef::new("someone else");
        let plan = plan_of(&[f], std::slice::from_ref(&r));
        assert!(
            matches!(&plan[0], Step::Remove { reason, .. } if reason.contains("runtime reference")),
            "{plan:?}"
        );
        assert!(
            matches!(&plan[1], Step::CrashedWhileAway { record, exit: None } if record.id == r.id)
        );
        // A stale epoch or instance id likewise.
        let mut f = found(&r, true);
        f.epoch = 2;
        f.instance_id = "old".into();
        let plan = plan_of(&[f], std::slice::from_ref(&r));
        assert!(
            matches!(&plan[0], Step::Remove { reason, .. } if reason.contains("instance id, epoch")),
            "{plan:?}"
        );
    }

    #[test]
    fn instances_without_a_live_record_are_removed() {
        let r = record("alice", Role::Main, InstanceStatus::Stopped);
        let plan = plan_of(
            &[found(&r, true), found(&r, false)],
            std::slice::from_ref(&r),
        );
        assert!(matches!(plan[0], Step::Remove { found: 0, .. }));
        assert!(matches!(plan[1], Step::Remove { found: 1, .. }));
        assert_eq!(plan.len(), 2);
    }

    #[test]
    fn an_ended_instance_with_a_live_record_is_a_crash_while_away() {
        let r = record("bob", Role::Main, InstanceStatus::Running);
        let mut f = found(&r, false);
        f.exit = Some(ExitStatus {
            code: Some(3),
            signal: None,
            stderr_tail: "boom".into(),
            out_of_memory: None,
            port_in_use: false,
        });
        assert_eq!(
            plan_of(&[f.clone()], std::slice::from_ref(&r)),
            [Step::CrashedWhileAway {
                record: r,
                exit: f.exit
            }]
        );
    }

    #[test]
    fn a_live_record_without_any_instance_is_a_crash_while_away() {
        let main = record("carol", Role::Main, InstanceStatus::Starting);
        let dog = record("carol", Role::Watchdog, InstanceStatus::Running);
        let gone = record("dave", Role::Main, InstanceStatus::Failed);
        let plan = plan_of(&[], &[main, dog, gone]);
        assert_eq!(plan.len(), 2);
        assert!(
            plan.iter()
                .all(|s| matches!(s, Step::CrashedWhileAway { exit: None, .. }))
        );
    }

    #[test]
    fn misfiled_or_unreadable_instances_are_removed() {
        let r = record("alice", Role::Main, InstanceStatus::Running);
        let mut misfiled = found(&r, true);
        misfiled.slug = "mallory".into();
        let mut unreadable = found(&r, false);
        unreadable.user = None;
        let plan = plan_of(&[misfiled, unreadable], std::slice::from_ref(&r));
        assert!(
            matches!(&plan[0], Step::Remove { reason, .. } if reason.contains("filed")),
            "{plan:?}"
        );
        assert!(
            matches!(&plan[1], Step::Remove { reason, .. } if reason.contains("unreadable")),
            "{plan:?}"
        );
        assert!(matches!(plan[2], Step::CrashedWhileAway { .. }));
    }

    #[test]
    fn two_instances_for_one_record_adopt_one() {
        let r = record("erin", Role::Main, InstanceStatus::Running);
        let plan = plan_of(
            &[found(&r, true), found(&r, true)],
            std::slice::from_ref(&r),
        );
        assert!(matches!(plan[0], Step::Adopt { found: 0, .. }));
        assert!(matches!(plan[1], Step::Remove { found: 1, .. }));
    }
}
