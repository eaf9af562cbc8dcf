//! Hibernation: an idle main is frozen with its memory and sockets
//! intact, its lease still held and renewed, and resumed by the next
//! request within milliseconds.
//!
//! Two reasons keep a main frozen, and each is kept apart: hibernation
//! (here, `Slot::is_hibernated`) and fencing (the fencer's frozen map, set
//! when no renew succeeded within `fence_after`). The program runs again
//! only when neither remains: a renew clears the fence reason and thaws
//! only a main that is not hibernated; a resume clears the hibernation
//! reason and thaws only a main that is not fenced. A stop of a hibernated
//! main kills it while frozen, like a fenced one (its `pre_hibernate` hook
//! already had its chance to flush).
//!
//! The hot path reads `Slot::is_hibernated` (an atomic) and nothing else;
//! a resume thaws through the runtime at once and writes the record to the
//! store afterwards, on a task of its own.

use std::sync::Arc;
use std::time::Instant;

use berth_core::runtime::{HookAction, HookCall, RuntimeError, RuntimeRef};
use berth_core::{Instance, InstanceStatus, Role, SpawnError, UserId, unix_millis_now};

use crate::Shared;
use crate::users::Slot;

/// Who asks for a hibernation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HibernateBy {
    /// The reaper, which saw the main idle with this last activity: any
    /// activity after it calls the hibernation off.
    Reaper { seen: i64 },
    /// An operator (`berth hibernate`): only activity while the flag is
    /// being set calls it off (a request then may have missed the flag).
    Request,
}

/// The main's record and run, if it runs ready (or is hibernated).
fn routable_run(slot: &Slot) -> Option<(Instance, RuntimeRef)> {
    let state = slot.lock();
    let entry = state.main.as_ref()?;
    let i = &entry.instance;
    if !(i.status.is_routable() && i.ready) {
        return None;
    }
    Some((i.clone(), i.runtime_ref.clone()?))
}

impl Shared {
    /// Hibernates `slot`'s main. The caller holds the lifecycle lock.
    /// `Ok(None)`: called off (activity arrived meanwhile).
    pub(crate) async fn hibernate_locked(
        &self,
        slot: &Slot,
        by: HibernateBy,
    ) -> Result<Option<Instance>, SpawnError> {
        let user = &slot.user;
        if !self.capabilities.freeze {
            return Err(SpawnError::InvalidRequest(format!(
                "the {} runtime cannot freeze instances, so idle instances are stopped instead",
                self.runtime.name()
            )));
        }
        let Some((instance, run)) = routable_run(slot) else {
            return Err(SpawnError::NotFound {
                user: user.clone(),
                what: "running instance".into(),
            });
        };
        if slot.is_hibernated() {
            return Ok(Some(instance));
        }
        if let Some(hook) = &self.config.pre_hibernate {
            self.run_hook("pre_hibernate", hook, slot, &run).await;
        }
        // Set before the last look at the activity (see `Slot::hibernated`):
        // a request that touched before it may not have seen the flag, and
        // would be forwarded to a frozen program.
        let seen = match by {
            HibernateBy::Reaper { seen } => seen,
            HibernateBy::Request => slot.last_active(),
        };
        slot.set_hibernated(true);
        if slot.last_active() > seen {
            slot.set_hibernated(false);
            return Ok(None);
        }
        if let Err(e) = self.runtime.freeze(&run).await {
            slot.set_hibernated(false);
            return Err(match e {
                // It ended (a crash) between the look above and the freeze:
                // there is no running instance to hibernate.
                RuntimeError::Gone(_) => SpawnError::NotFound {
                    user: user.clone(),
                    what: "running instance".into(),
                },
                e => SpawnError::Internal(format!("could not freeze the instance: {e}")),
            });
        }
        self.metrics.hibernation.hibernations.inc();
        tracing::info!(%user, "instance hibernated");
        let now = unix_millis_now();
        let hibernated = self
            .modify(
                slot,
                Role::Main,
                &instance.id,
                Some("hibernated".into()),
                |entry| {
                    let i = &mut entry.instance;
                    if i.status == InstanceStatus::Running {
                        i.status = InstanceStatus::Hibernated;
                        i.hibernated_at = Some(now);
                    }
                },
            )
            .await;
        Ok(hibernated)
    }

    /// Resumes `slot`'s main if it is hibernated: thaws it (unless it is
    /// also frozen for fencing, which only a renew lifts) and records it
    /// running. `Ok(false)`: it was not hibernated.
    pub(crate) async fn resume(self: &Arc<Self>, slot: &Arc<Slot>) -> Result<bool, SpawnError> {
        if !slot.is_hibernated() {
            return Ok(false);
        }
        let asked = Instant::now();
        let _guard = slot.lifecycle.lock().await;
        if !slot.is_hibernated() {
            return Ok(false);
        }
        let user = &slot.user;
        let run = routable_run(slot).map(|(_, run)| run);
        slot.set_hibernated(false);
        if self.fencer.is_fenced(user) {
            tracing::info!(%user, "resume asked while fenced: the instance thaws once a renew proves its lease");
        } else if let Some(run) = run
            && let Err(e) = self.runtime.thaw(&run).await
        {
            tracing::warn!(%user, error = %e, "could not thaw the instance");
        }
        let metrics = &self.metrics.hibernation;
        metrics.resumes.inc();
        metrics
            .resume_latency
            .observe(asked.elapsed().as_secs_f64());
        // The record follows on a task of its own: the request that woke
        // the instance is forwarded now. It takes the lifecycle lock, so a
        // hibernation after this one records after it, too.
        let (this, slot) = (Arc::clone(self), Arc::clone(slot));
        self.tasks.spawn(async move {
            let _guard = slot.lifecycle.lock().await;
            if slot.is_hibernated() {
                return;
            }
            let Some(id) = slot.record(Role::Main).map(|i| i.id) else {
                return;
            };
            this.modify(&slot, Role::Main, &id, Some("resumed".into()), |entry| {
                let i = &mut entry.instance;
                // `modify` clears `hibernated_at` off hibernation.
                if i.status == InstanceStatus::Hibernated {
                    i.status = InstanceStatus::Running;
                }
            })
            .await;
        });
        Ok(true)
    }

    /// Runs `hook` for `slot`'s main through the runtime, where the
    /// program runs, cut off at the hook grace. Failures are logged: a
    /// hook gives the program a chance to flush, it never holds up
    /// hibernation or a stop.
    pub(crate) async fn run_hook(
        &self,
        name: &'static str,
        hook: &HookAction,
        slot: &Slot,
        run: &RuntimeRef,
    ) {
        let user = &slot.user;
        let call = HookCall {
            name,
            action: hook.clone(),
            grace: self.config.hook_grace,
        };
        match self.runtime.run_hook(run, &call).await {
            Ok(outcome) if outcome.succeeded(&call.action) => {
                tracing::info!(%user, hook = name, "hook done");
            }
            Ok(outcome) => tracing::warn!(%user, hook = name, code = ?outcome.code,
                signal = ?outcome.signal, timed_out = outcome.timed_out,
                output = %outcome.output_tail, "hook failed"),
            Err(e) => tracing::warn!(%user, hook = name, error = %e, "hook failed"),
        }
    }
}

/// Whether `user` would be routed to a hibernated main here (the proxy's
/// question on every request; an atomic read after the slot lookup).
pub(crate) fn hibernated(shared: &Shared, user: &UserId) -> bool {
    shared
        .users
        .existing(user)
        .is_some_and(|slot| slot.is_hibernated())
}
