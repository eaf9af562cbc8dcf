//! The spawner's periodic work: the lease renew tick (with fencing, thaw,
//! fence-deadline extension and the node heartbeat), the idle reaper, and
//! flushing in-memory activity to the store. Plus the breaker hook.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use berth_core::policy::select_for_reaping;
use berth_core::{InstanceStatus, Role, UserId};
use berth_store::NodeRecord;

use crate::inner::{Inner, StopKind, millis};
use crate::shim::{ShimCommand, ShimControl};
use crate::template;

impl Inner {
    pub(crate) fn start_background(self: &Arc<Self>) {
        let this = self.clone();
        self.tracker.spawn(async move { this.renew_loop().await });
        let this = self.clone();
        self.tracker.spawn(async move { this.reap_loop().await });
    }

    async fn renew_loop(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.config.lease.renew());
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
                    .config
                    .fence
                    .then(|| self.lease.fence_deadline())
                    .flatten()
                    .filter(|d| frozen_for != Some(*d));
                tokio::select! {
                    _ = self.cancel.cancelled() => return,
                    () = &mut renew => break,
                    () = sleep_until_opt(fence_at) => {
                        frozen_for = fence_at;
                        if self.lease.fence_due(Instant::now()) {
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

    /// Control handles of this node's live mains.
    fn main_controls(&self) -> Vec<(UserId, ShimControl)> {
        self.all_slots()
            .iter()
            .filter_map(|slot| {
                let state = slot.lock();
                let live = state.main.as_ref()?;
                if !live.instance.status.is_live() {
                    return None;
                }
                Some((slot.user.clone(), live.control.clone()?))
            })
            .collect()
    }

    /// One renew tick: renew every lease in one statement, fence the lost
    /// ones, freeze everything when the self-fence deadline passed, thaw
    /// after a good renew, extend the shims' deadlines, heartbeat.
    pub(crate) async fn renew_tick(self: &Arc<Self>) {
        // A renew proves the leases this node's only as of when it was
        // *sent* (design §3): an answer that arrives after `fence_after`
        // (a slow link, a paused process) may describe leases that have
        // expired and been claimed by another node since. So the deadline
        // it earns runs from here, not from when the answer came, and a
        // late answer neither thaws nor extends anything. Taken before the
        // keeper's own clock, so never later than it.
        let sent = Instant::now();
        let fence_after = self.config.lease.fence_after();
        let deadline = saturating_add(sent, fence_after);
        // No timeout here, on purpose: the fence timer in `renew_loop`
        // freezes on time while this waits. Giving up and renewing again
        // would be worse: every renew sent still lands in the database, so
        // a node on a slow link would keep extending a lease it can never
        // prove, and its frozen users would never fail over. Renews stay
        // one at a time, so such a node's lease runs out.
        let renewed = match self.lease.renew_all().await {
            Ok(report) => {
                for (user, epoch) in &report.lost {
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
            // Extend before thawing: a shim whose deadline passed must not
            // find it still passed the moment its program runs again.
            if self.config.fence {
                for (user, control) in self.main_controls() {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    let ms = millis(left);
                    if let Err(e) = control.send(ShimCommand::Extend { ms }).await {
                        tracing::debug!(%user, error = %e, "could not extend the shim's fence deadline");
                    }
                }
            }
            self.thaw_unchanged(deadline).await;
        }
        // Freezing guards against another node taking over; with fencing
        // off (one node, SQLite) nobody can, and a slow disk must not stop
        // every instance.
        if self.config.fence && self.lease.fence_due(Instant::now()) {
            self.freeze_all().await;
        }
        let renew_every = self.config.lease.renew();
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

    /// This node's row as the heartbeat writes it: its own load, capacity,
    /// status and advertised URL.
    pub(crate) fn node_record(&self) -> NodeRecord {
        NodeRecord {
            id: self.config.node_id.clone(),
            advertise_url: self.config.advertise_url.clone(),
            capacity: self.capacity.load(Ordering::Relaxed),
            load: self.live_mains(),
            status: *self.node_status.lock().unwrap_or_else(|e| e.into_inner()),
            heartbeat: 0,
        }
    }

    /// Writes this node's row, stamped with the store's clock.
    pub(crate) async fn heartbeat(&self) -> Result<(), berth_store::StoreError> {
        let _one_at_a_time = self.heartbeat_lock.lock().await;
        let node = self.node_record();
        let result = self.store.heartbeat(&node).await;
        if result.is_err() {
            self.metrics.store_errors.inc();
        }
        result
    }

    /// Kills the main whose lease is lost; its supervisor records the
    /// instance as stopped ("lease lost: fenced") and forgets the lease.
    pub(crate) fn fence_lost(&self, user: &UserId) {
        let Some(slot) = self.existing_slot(user) else {
            self.lease.forget(user);
            return;
        };
        let mut state = slot.lock();
        match state.main.as_mut() {
            Some(live) if live.instance.status.is_live() => {
                live.stop_kind = Some(StopKind::Fenced);
                live.stop.cancel();
            }
            _ => self.lease.forget(user),
        }
    }

    async fn freeze_all(&self) {
        let held: HashSet<UserId> = self.lease.holdings().into_iter().map(|(u, _)| u).collect();
        for (user, control) in self.main_controls() {
            if !held.contains(&user) {
                continue;
            }
            let Some(epoch) = self.lease.epoch_of(&user) else {
                continue;
            };
            let newly = {
                let mut frozen = self.frozen.lock().unwrap_or_else(|e| e.into_inner());
                frozen.insert(user.clone(), epoch).is_none()
            };
            if !newly {
                continue;
            }
            tracing::warn!(%user, epoch, "no successful lease renew within fence_after; freezing the instance");
            self.metrics.fenced.inc();
            if let Err(e) = control.send(ShimCommand::Freeze).await {
                tracing::warn!(%user, error = %e, "could not freeze the instance");
            }
        }
    }

    /// Thaws the frozen mains whose lease this node still holds under the
    /// same epoch, until `deadline` (the end of what the last renew proved).
    async fn thaw_unchanged(&self, deadline: Instant) {
        let frozen: Vec<(UserId, i64)> = {
            let frozen = self.frozen.lock().unwrap_or_else(|e| e.into_inner());
            frozen.iter().map(|(u, e)| (u.clone(), *e)).collect()
        };
        if frozen.is_empty() {
            return;
        }
        let controls: std::collections::HashMap<UserId, ShimControl> =
            self.main_controls().into_iter().collect();
        for (user, epoch) in frozen {
            if Instant::now() >= deadline {
                return;
            }
            if self.lease.epoch_of(&user) != Some(epoch) {
                continue;
            }
            {
                let mut f = self.frozen.lock().unwrap_or_else(|e| e.into_inner());
                f.remove(&user);
            }
            if let Some(control) = controls.get(&user) {
                tracing::info!(%user, epoch, "lease renewed with the same epoch; thawing the instance");
                if let Err(e) = control.send(ShimCommand::Thaw).await {
                    tracing::warn!(%user, error = %e, "could not thaw the instance");
                }
            }
        }
    }

    /// Writes activity newer than the last flush, in one statement.
    pub(crate) async fn flush_activity(&self) {
        let batch: Vec<(Arc<crate::inner::UserSlot>, i64)> = self
            .all_slots()
            .into_iter()
            .filter_map(|slot| {
                let t = slot.last_active.load(Ordering::Relaxed);
                (t > slot.flushed_active.load(Ordering::Relaxed)).then_some((slot, t))
            })
            .collect();
        if batch.is_empty() {
            return;
        }
        let rows: Vec<(UserId, i64)> = batch.iter().map(|(s, t)| (s.user.clone(), *t)).collect();
        match self.store.record_activity(&rows).await {
            Ok(()) => {
                for (slot, t) in batch {
                    slot.flushed_active.fetch_max(t, Ordering::Relaxed);
                }
            }
            Err(e) => {
                self.metrics.store_errors.inc();
                tracing::warn!(error = %e, "could not record activity");
            }
        }
    }

    /// Stops the running mains the reap policy selects.
    async fn reap_once(self: &Arc<Self>) {
        let candidates: Vec<(UserId, i64)> = self
            .all_slots()
            .iter()
            .filter(|slot| {
                slot.record(Role::Main)
                    .is_some_and(|i| i.status == InstanceStatus::Running)
            })
            .map(|slot| (slot.user.clone(), slot.last_active.load(Ordering::Relaxed)))
            .collect();
        let chosen = select_for_reaping(&self.config.reap, Inner::now(), &candidates);
        for user in chosen {
            tracing::info!(%user, "stopping idle instance");
            // Candidates come from the slots, so the slot exists.
            let Some(slot) = self.existing_slot(&user) else {
                continue;
            };
            let _guard = slot.lifecycle.lock().await;
            // Activity may have arrived while waiting for the lock.
            let seen = candidates
                .iter()
                .find(|(u, _)| *u == user)
                .map_or(0, |(_, t)| *t);
            if slot.last_active.load(Ordering::Relaxed) > seen {
                continue;
            }
            self.stop_locked(&slot, StopKind::Requested("idle")).await;
        }
    }

    /// Runs the operator's `on_breaker_open` command; not waited on.
    pub(crate) fn run_breaker_hook(&self, user: &UserId, opens: u32, cooldown_until: i64) {
        let Some((program, args)) = self
            .config
            .on_breaker_open
            .as_ref()
            .and_then(|c| c.split_first())
        else {
            return;
        };
        let env = template::build_env(
            &self.config.env_allowlist,
            template::own_env(),
            &self.config.env,
            [
                ("BERTH_USER".to_owned(), user.as_str().to_owned()),
                ("BERTH_BREAKER_OPENS".to_owned(), opens.to_string()),
                (
                    "BERTH_BREAKER_COOLDOWN_UNTIL".to_owned(),
                    cooldown_until.to_string(),
                ),
            ],
        );
        let spawned = tokio::process::Command::new(program)
            .args(args)
            .env_clear()
            .envs(env)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn();
        match spawned {
            Ok(mut child) => {
                let cancel = self.cancel.clone();
                let user = user.clone();
                self.tracker.spawn(async move {
                    tokio::select! {
                        _ = cancel.cancelled() => {}
                        status = child.wait() => match status {
                            Ok(s) if s.success() => {}
                            Ok(s) => tracing::warn!(%user, status = %s, "on_breaker_open hook failed"),
                            Err(e) => tracing::warn!(%user, error = %e, "on_breaker_open hook failed"),
                        }
                    }
                });
            }
            Err(e) => tracing::warn!(%user, error = %e, "could not run the on_breaker_open hook"),
        }
    }
}

/// `instant + d`, or as far as `Instant` reaches (`LeaseConfig`'s bounds
/// keep config durations far below that; this only keeps a bad value from
/// panicking the renew task). Falling back to `instant` itself errs on the
/// side of fencing early.
pub(crate) fn saturating_add(instant: Instant, d: std::time::Duration) -> Instant {
    instant
        .checked_add(d)
        .or_else(|| instant.checked_add(std::time::Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(instant)
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
        None => std::future::pending().await,
    }
}
