//! The crash policy and breaker through the store: crash history is persisted,
//! so a restarted berth does not hand a crash-looping user a fresh budget. The
//! decisions are `berth_core::policy::CrashPolicy`'s; this part loads, saves
//! and runs the operator's hook.

use std::sync::Arc;
use std::time::Duration;

use berth_core::policy::{CrashDecision, CrashPolicy, CrashState, LaunchKind};
use berth_core::{BreakerInfo, SpawnError, UnixMillis, UserId};
use berth_store::LaunchStore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::BreakerHook;
use crate::metrics::Metrics;

pub(crate) struct Breaker {
    store: Arc<dyn LaunchStore>,
    policy: CrashPolicy,
    hook: Option<BreakerHook>,
    metrics: Metrics,
}

/// A launch the breaker let through: the crash state before, and as it is
/// to be saved once the launch goes ahead (a `force` clears the breaker).
pub(crate) struct Admission {
    before: CrashState,
    after: CrashState,
}

impl Breaker {
    pub fn new(
        store: Arc<dyn LaunchStore>,
        policy: CrashPolicy,
        hook: Option<BreakerHook>,
        metrics: Metrics,
    ) -> Self {
        Self {
            store,
            policy,
            hook,
            metrics,
        }
    }

    /// `instance_circuit_open` during a cooldown, unless `kind` is a force.
    pub async fn admit(
        &self,
        user: &UserId,
        kind: LaunchKind,
        now: UnixMillis,
    ) -> Result<Admission, SpawnError> {
        let before = self.store.load_crash_state(user).await?;
        let after = self
            .policy
            .admit_launch(&before, now, kind)
            .map_err(|open| SpawnError::CircuitOpen {
                user: user.clone(),
                opens: open.opens,
                retry_at: open.cooldown_until,
            })?;
        Ok(Admission { before, after })
    }

    /// Saves what an admitted launch changed.
    pub async fn commit(&self, user: &UserId, admission: &Admission) -> Result<(), SpawnError> {
        if admission.after != admission.before {
            self.store.save_crash_state(user, &admission.after).await?;
        }
        Ok(())
    }

    /// Counts a crash after `uptime` and decides what follows. A store
    /// failure is logged and decided on a clean history: restarting beats
    /// leaving the user down because the database blinked.
    pub async fn on_crash(
        &self,
        user: &UserId,
        uptime: Duration,
        now: UnixMillis,
    ) -> CrashDecision {
        let mut state = match self.store.load_crash_state(user).await {
            Ok(state) => state,
            Err(e) => {
                self.metrics.store_errors.inc();
                tracing::warn!(%user, error = %e, "could not load the crash state; counting from zero");
                CrashState::default()
            }
        };
        let decision = self.policy.on_crash(&mut state, now, uptime);
        if let Err(e) = self.store.save_crash_state(user, &state).await {
            self.metrics.store_errors.inc();
            tracing::warn!(%user, error = %e, "could not save the crash state");
        }
        decision
    }

    /// Clears the crash streak and the restarts in the window after an
    /// explicit operation. The breaker itself (open count and a running
    /// cooldown) is kept: only `force` and `reset` clear it.
    pub async fn reset_counters(&self, user: &UserId) -> Result<(), SpawnError> {
        let state = self.store.load_crash_state(user).await?;
        let reset = CrashState {
            streak: 0,
            restarts: Vec::new(),
            ..state.clone()
        };
        if reset != state {
            self.store.save_crash_state(user, &reset).await?;
        }
        Ok(())
    }

    /// Clears the breaker and the crash counters.
    pub async fn reset(&self, user: &UserId) -> Result<(), SpawnError> {
        Ok(self
            .store
            .save_crash_state(user, &CrashState::default())
            .await?)
    }

    pub async fn info(
        &self,
        user: &UserId,
        now: UnixMillis,
    ) -> Result<Option<BreakerInfo>, SpawnError> {
        Ok(self.store.load_crash_state(user).await?.breaker_at(now))
    }

    /// Records that the breaker opened: a log line, a metric and the
    /// operator's hook (run, not waited on).
    pub fn opened(
        &self,
        user: &UserId,
        opens: u32,
        cooldown_until: UnixMillis,
        tasks: &TaskTracker,
        cancel: &CancellationToken,
    ) {
        tracing::warn!(%user, opens, cooldown_until, "crash breaker opened: instance failed");
        self.metrics.breaker_opens.inc();
        let Some((program, args)) = self.hook.as_ref().and_then(|h| h.command.split_first()) else {
            return;
        };
        let env = self.hook.iter().flat_map(|h| h.env.iter().cloned()).chain([
            ("BERTH_USER".to_owned(), user.as_str().to_owned()),
            ("BERTH_BREAKER_OPENS".to_owned(), opens.to_string()),
            (
                "BERTH_BREAKER_COOLDOWN_UNTIL".to_owned(),
                cooldown_until.to_string(),
            ),
        ]);
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
                let cancel = cancel.clone();
                let user = user.clone();
                tasks.spawn(async move {
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
