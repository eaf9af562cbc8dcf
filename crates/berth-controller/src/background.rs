//! The controller's periodic work: the lease renew tick (with fencing,
//! thaw, the runtime's fence-deadline extension and the node heartbeat),
//! the idle reaper, and flushing in-memory activity to the store.

use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_core::policy::supervision::StopKind;
use berth_core::policy::{IdleAction, ReapCandidate, plan_reaping};
use berth_core::runtime::RuntimeRef;
use berth_core::{InstanceStatus, Role, UserId, unix_millis_now};

use crate::Shared;
use crate::fencer::saturating_add;
use crate::users::Slot;

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
        None => std::future::pending().await,
    }
}

impl Shared {
    pub(crate) fn start_background(self: &Arc<Self>) {
        let this = self.clone();
        self.tasks.spawn(async move { this.renew_loop().await });
        let this = self.clone();
        self.tasks.spawn(async move { this.reap_loop().await });
    }

    async fn renew_loop(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.fencer.config().renew());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The fence deadline the timer below last acted on, so a passed
        // deadline freezes once instead of spinning until the next renew.
        let mut frozen_for: Option<Instant> = None;
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            // The tick runs next to the fence timer, not before it: a renew
            // or heartbeat stuck on a black-holed connection must not keep
            // this node from freezing its instances on time.
            let renew = self.renew_tick();
            tokio::pin!(renew);
            loop {
                let fence_at = self
                    .fencer
                    .fence_deadline()
                    .filter(|d| frozen_for != Some(*d));
                tokio::select! {
                    _ = self.cancel.cancelled() => return,
                    () = &mut renew => break,
                    () = sleep_until_opt(fence_at) => {
                        frozen_for = fence_at;
                        if self.fencer.fence_due() {
                            self.freeze_all().await;
                        }
                    }
                }
            }
        }
    }

    async fn reap_loop(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.config.reap.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick fires at once; reaping right at start is pointless.
        tick.tick().await;
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            self.flush_activity().await;
            let reap = self.reap_once();
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = reap => {}
            }
        }
    }

    /// The runs of this node's live mains.
    fn main_runs(&self) -> Vec<(UserId, RuntimeRef)> {
        self.users
            .all()
            .iter()
            .filter_map(|slot| {
                let state = slot.lock();
                let entry = state.main.as_ref()?;
                if !entry.instance.status.is_live() {
                    return None;
                }
                Some((slot.user.clone(), entry.instance.runtime_ref.clone()?))
            })
            .collect()
    }

    /// One renew tick: renew every lease in one statement, fence the lost
    /// ones, freeze everything when the self-fence deadline passed, thaw
    /// after a good renew, extend the runtime's deadlines, heartbeat.
    pub(crate) async fn renew_tick(self: &Arc<Self>) {
        // A renew proves the leases this node's only as of when it was
        // *sent*: an answer that arrives after `fence_after` (a slow link,
        // a paused process) may describe leases that have expired and been
        // claimed by another node since. So the deadline it earns runs
        // from here, not from when the answer came, and a late answer
        // neither thaws nor extends anything. Taken before the keeper's
        // own clock, so never later than it.
        let sent = Instant::now();
        let deadline = saturating_add(sent, self.fencer.config().fence_after());
        // No timeout here, on purpose: the fence timer in `renew_loop`
        // freezes on time while this waits. Giving up and renewing again
        // would be worse: every renew sent still lands in the database, so
        // a node on a slow link would keep extending a lease it can never
        // prove, and its frozen users would never fail over. Renews stay
        // one at a time, so such a node's lease runs out.
        let renewed = match self.fencer.renew_all().await {
            Ok(lost) => {
                for (user, epoch) in &lost {
                    tracing::warn!(%user, epoch, "lease lost; fencing the instance");
                    self.fence_lost(user);
                }
                true
            }
            Err(e) => {
                self.metrics.lease_renew_failures.inc();
                tracing::warn!(error = %e, "lease renew failed");
                false
            }
        };
        if renewed && Instant::now() >= deadline {
            tracing::warn!(
                late_ms = millis(sent.elapsed()),
                "the lease renew was answered after fence_after; not thawing or extending on it"
            );
        } else if renewed {
            // Extend before thawing: a runtime whose deadline passed must
            // not find it still passed the moment its program runs again.
            if self.config.fencing && self.capabilities.fence_deadline {
                for (user, run) in self.main_runs() {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    if let Err(e) = self.runtime.extend_fence(&run, left).await {
                        tracing::debug!(%user, error = %e, "could not extend the fence deadline");
                    }
                }
            }
            self.thaw_unchanged(deadline).await;
        }
        // Freezing guards against another node taking over; with fencing
        // off (one node, SQLite) nobody can, and a slow disk must not stop
        // every instance.
        if self.fencer.fence_due() {
            self.freeze_all().await;
        }
        let renew_every = self.fencer.config().renew();
        match tokio::time::timeout(renew_every, self.heartbeat()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "node heartbeat failed"),
            Err(_) => tracing::warn!(timeout_ms = millis(renew_every), "node heartbeat timed out"),
        }
        // Last, and bounded: activity is bookkeeping, the lease is safety.
        if tokio::time::timeout(renew_every, self.flush_activity())
            .await
            .is_err()
        {
            tracing::warn!(
                timeout_ms = millis(renew_every),
                "recording activity timed out"
            );
        }
    }

    /// Freezes every live main whose lease this node holds and which is not
    /// frozen yet. A runtime that cannot freeze is left alone: it declares
    /// so, and keeps one instance per user by other means (the Kubernetes
    /// API server's one object per name).
    async fn freeze_all(&self) {
        for (user, run) in self.main_runs() {
            let Some(epoch) = self.fencer.freeze(&user) else {
                continue;
            };
            tracing::warn!(%user, epoch, "no successful lease renew within fence_after; freezing the instance");
            self.metrics.fenced.inc();
            if !self.capabilities.freeze || self.hibernated(&user) {
                // A hibernated program is frozen already; the fence is now
                // a second reason to keep it so.
                continue;
            }
            if let Err(e) = self.runtime.freeze(&run).await {
                tracing::warn!(%user, error = %e, "could not freeze the instance");
            }
        }
    }

    /// Thaws the frozen mains whose lease this node still holds under the
    /// same epoch, until `deadline` (the end of what the last renew proved).
    async fn thaw_unchanged(&self, deadline: Instant) {
        let thawable = self.fencer.thawable();
        if thawable.is_empty() {
            return;
        }
        let runs: std::collections::HashMap<UserId, RuntimeRef> =
            self.main_runs().into_iter().collect();
        for (user, epoch) in thawable {
            if Instant::now() >= deadline {
                return;
            }
            if !self.fencer.thawing(&user, epoch) {
                continue;
            }
            if self.hibernated(&user) {
                // Hibernated too: the renew lifts the fence only, and the
                // program stays frozen until a request resumes it.
                tracing::info!(%user, epoch, "lease renewed; the instance stays hibernated");
                continue;
            }
            if let (true, Some(run)) = (self.capabilities.freeze, runs.get(&user)) {
                tracing::info!(%user, epoch, "lease renewed with the same epoch; thawing the instance");
                if let Err(e) = self.runtime.thaw(run).await {
                    tracing::warn!(%user, error = %e, "could not thaw the instance");
                }
            }
        }
    }

    /// Writes activity newer than the last flush, in one statement.
    pub(crate) async fn flush_activity(&self) {
        let batch: Vec<(Arc<Slot>, i64)> = self
            .users
            .all()
            .into_iter()
            .filter_map(|slot| slot.unflushed().map(|t| (slot, t)))
            .collect();
        if batch.is_empty() {
            return;
        }
        let rows: Vec<(UserId, i64)> = batch.iter().map(|(s, t)| (s.user.clone(), *t)).collect();
        match self.store.record_activity(&rows).await {
            Ok(()) => {
                for (slot, t) in batch {
                    slot.flushed(t);
                }
            }
            Err(e) => {
                self.metrics.store_errors.inc();
                tracing::warn!(error = %e, "could not record activity");
            }
        }
    }

    fn hibernated(&self, user: &UserId) -> bool {
        crate::hibernation::hibernated(self, user)
    }

    /// Hibernates and stops the mains the reap policy selects.
    async fn reap_once(self: &Arc<Self>) {
        let candidates: Vec<ReapCandidate<UserId>> = self
            .users
            .all()
            .iter()
            .filter_map(|slot| {
                let main = slot.record(Role::Main)?;
                let status = reaped_as(main.status, main.ready, slot.is_hibernated())?;
                Some(ReapCandidate {
                    key: slot.user.clone(),
                    status,
                    last_active: slot.last_active(),
                    hibernated_at: main.hibernated_at,
                })
            })
            .collect();
        let policy = &self.config.reap;
        let plan = plan_reaping(
            policy,
            self.capabilities.freeze,
            unix_millis_now(),
            &candidates,
        );
        let seen = |user: &UserId| {
            candidates
                .iter()
                .find(|c| c.key == *user)
                .map_or(0, |c| c.last_active)
        };
        for user in plan.hibernate {
            let Some(slot) = self.users.existing(&user) else {
                continue;
            };
            let _guard = slot.lifecycle.lock().await;
            let by = crate::hibernation::HibernateBy::Reaper { seen: seen(&user) };
            match self.hibernate_locked(&slot, by).await {
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(%user, error = %e, "could not hibernate the idle instance")
                }
            }
        }
        for user in plan.stop {
            let Some(slot) = self.users.existing(&user) else {
                continue;
            };
            let _guard = slot.lifecycle.lock().await;
            // Activity may have arrived while waiting for the lock (a
            // hibernated main is resumed by it, and so not stopped).
            if slot.last_active() > seen(&user) {
                continue;
            }
            let reason = if slot.is_hibernated() {
                tracing::info!(%user, "stopping a long-hibernated instance");
                "hibernated too long"
            } else {
                tracing::info!(%user, "stopping idle instance");
                "idle"
            };
            self.stop_locked(&slot, StopKind::Requested(reason)).await;
        }
    }

    /// What the reaper does with idle mains here, for status and logs.
    pub(crate) fn idle_action(&self) -> IdleAction {
        self.config.reap.effective_action(self.capabilities.freeze)
    }
}

/// What the reaper counts a main as, from its record's status and
/// readiness and the slot's hibernation flag; `None`: not looked at.
/// The flag is the truth: a resume clears it at once and updates the
/// record on a task of its own, so a record still reading `hibernated`
/// under a clear flag is a main that runs again.
fn reaped_as(record: InstanceStatus, ready: bool, hibernated: bool) -> Option<InstanceStatus> {
    match record {
        InstanceStatus::Hibernated if hibernated => Some(InstanceStatus::Hibernated),
        InstanceStatus::Running | InstanceStatus::Hibernated if ready => {
            Some(InstanceStatus::Running)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_main_whose_resume_is_not_yet_recorded_is_reaped_as_running() {
        use InstanceStatus::{Hibernated, Running, Starting};
        assert_eq!(reaped_as(Hibernated, true, true), Some(Hibernated));
        assert_eq!(reaped_as(Hibernated, true, false), Some(Running));
        assert_eq!(reaped_as(Running, true, false), Some(Running));
        assert_eq!(reaped_as(Running, false, false), None);
        assert_eq!(reaped_as(Starting, false, false), None);
    }
}
