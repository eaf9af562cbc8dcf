//! The node-local surface: [`Spawner`] on top of the lifecycle operations
//! and the in-memory tables. The API, the proxy and the cluster glue use
//! this; a request for a user another node owns is forwarded there before
//! it gets here.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use berth_core::egress::EgressPolicy;
use berth_core::policy::LaunchKind;
use berth_core::policy::supervision::StopKind;
use berth_core::runtime::Patch;
use berth_core::{
    BreakerInfo, Endpoint, Epoch, Instance, InstanceEvent, InstanceStatus, LaunchRequest,
    ProbeReport, RestartResult, Role, SpawnError, Spawner, Traffic, UserId, UserStatus,
    unix_millis_now,
};
use berth_store::InstanceFilter;
use futures_util::StreamExt;
use tokio::sync::{broadcast, mpsc};

use crate::fencer::Claim;
use crate::lifecycle::validate;
use crate::users::Slot;
use crate::{Controller, Shared};

/// The answer to a launch, restart or watchdog start asked for after
/// teardown began.
fn shutting_down() -> SpawnError {
    SpawnError::Internal("berth is shutting down; nothing new is started".to_owned())
}

/// Waits until the main of `slot` is no longer live, up to `timeout`.
async fn wait_not_live(slot: &Slot, timeout: Duration) -> bool {
    let mut watch = slot.main_watch.subscribe();
    let wait = async {
        loop {
            let live = watch
                .borrow_and_update()
                .as_ref()
                .is_some_and(|i| i.status.is_live());
            if !live || watch.changed().await.is_err() {
                return;
            }
        }
    };
    tokio::time::timeout(timeout, wait).await.is_ok()
}

impl Controller {
    /// The record of `role`: memory first (it is this node's truth), else
    /// the store.
    async fn record(&self, user: &UserId, role: Role) -> Result<Option<Instance>, SpawnError> {
        if let Some(slot) = self.shared.users.existing(user)
            && let Some(mut instance) = slot.record(role)
        {
            instance.last_active = instance.last_active.max(slot.last_active());
            return Ok(Some(instance));
        }
        Ok(self.shared.store.get_instance(user, role).await?)
    }

    /// A launch under the user's lifecycle lock, claiming the lease the way
    /// `claim` says: an ordinary claim, or an operator's takeover.
    async fn launch_claiming(
        &self,
        user: &UserId,
        request: LaunchRequest,
        claim: Claim,
    ) -> Result<Instance, SpawnError> {
        let folder = validate(request.folder.as_deref(), request.patch.as_deref())?;
        let kind = if request.force {
            LaunchKind::Force
        } else {
            LaunchKind::Implicit
        };
        self.run_locked(user, move |shared, slot| async move {
            shared
                .launch_locked(&slot, folder, Patch::Set(request.patch), kind, claim)
                .await
        })
        .await
    }

    /// Runs `work` detached (see [`Controller::run_detached`]) under
    /// `user`'s lifecycle lock, unless berth began to stop meanwhile.
    async fn run_locked<T, W, Fut>(&self, user: &UserId, work: W) -> Result<T, SpawnError>
    where
        W: FnOnce(Arc<Shared>, Arc<Slot>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, SpawnError>> + Send,
        T: Send + 'static,
    {
        let shared = Arc::clone(&self.shared);
        let user = user.clone();
        self.run_detached(async move {
            let slot = shared.slot(&user).await?;
            let _guard = slot.lifecycle.lock().await;
            // Waited for the lock while berth began to stop: start nothing.
            if shared.cancel.is_cancelled() {
                return Err(shutting_down());
            }
            work(Arc::clone(&shared), Arc::clone(&slot)).await
        })
        .await
    }

    /// Runs `work` on a task of the controller's own and waits for it. A
    /// caller that stops waiting (an API client that hangs up mid-launch)
    /// does not cut a launch short: half done, it would leave a claimed
    /// lease and a started run that nothing tracks.
    async fn run_detached<T, F>(&self, work: F) -> Result<T, SpawnError>
    where
        F: Future<Output = Result<T, SpawnError>> + Send + 'static,
        T: Send + 'static,
    {
        if self.shared.cancel.is_cancelled() {
            return Err(shutting_down());
        }
        self.shared
            .tasks
            .spawn(work)
            .await
            .unwrap_or_else(|e| Err(SpawnError::Internal(format!("the task failed: {e}"))))
    }
}

#[async_trait]
impl Traffic for Controller {
    async fn launch(&self, user: &UserId, request: LaunchRequest) -> Result<Instance, SpawnError> {
        // A launch is activity: a hibernated main is resumed, and then
        // already running.
        if let Some(slot) = self.shared.users.existing(user) {
            slot.touch(unix_millis_now());
            // Its instance runs and is being adopted: the lifecycle lock
            // would keep a second launch out anyway, but the client is
            // told at once rather than made to wait for the adoption.
            if slot.awaits_adoption() {
                return Err(SpawnError::Starting {
                    user: user.clone(),
                    retry_after_ms: berth_core::STARTING_RETRY_MS,
                });
            }
            self.shared.resume(&slot).await?;
        }
        self.launch_claiming(user, request, Claim::Acquire).await
    }

    async fn breaker_info(&self, user: &UserId) -> Result<Option<BreakerInfo>, SpawnError> {
        self.shared.breaker.info(user, unix_millis_now()).await
    }

    async fn list(&self) -> Result<Vec<Instance>, SpawnError> {
        let filter = InstanceFilter {
            node: Some(self.shared.node_id().to_owned()),
            ..InstanceFilter::default()
        };
        let mut list = self.shared.store.list_instances(&filter).await?;
        for instance in &mut list {
            if let Some(slot) = self.shared.users.existing(&instance.user)
                && let Some(current) = slot.record(instance.role)
            {
                *instance = current;
            }
        }
        Ok(list)
    }

    fn endpoint_for(&self, user: &UserId) -> Option<Endpoint> {
        self.shared.publisher.endpoint_for(user)
    }

    fn launch_token(&self, user: &UserId) -> Option<String> {
        self.shared.publisher.token(user)
    }

    async fn wait_for_ready(
        &self,
        user: &UserId,
        timeout: Duration,
    ) -> Result<Option<Instance>, SpawnError> {
        let Some(slot) = self.shared.users.existing(user) else {
            return self.record(user, Role::Main).await;
        };
        let mut watch = slot.main_watch.subscribe();
        let wait = async {
            loop {
                let current = watch.borrow_and_update().clone();
                match current {
                    None => return None,
                    Some(i) if i.status.is_routable() && i.ready => return Some(i),
                    Some(i) if i.status.is_terminal() || i.status == InstanceStatus::Crashed => {
                        return Some(i);
                    }
                    Some(_) => {}
                }
                if watch.changed().await.is_err() {
                    return None;
                }
            }
        };
        match tokio::time::timeout(timeout, wait).await {
            Ok(Some(instance)) => Ok(Some(instance)),
            Ok(None) => self.record(user, Role::Main).await,
            Err(_) => Err(SpawnError::Starting {
                user: user.clone(),
                retry_after_ms: 1000,
            }),
        }
    }

    fn touch(&self, user: &UserId) -> bool {
        self.shared.users.existing(user).is_some_and(|slot| {
            slot.touch(unix_millis_now());
            slot.is_hibernated()
        })
    }

    async fn resume(&self, user: &UserId) -> Result<Instance, SpawnError> {
        let not_found = || SpawnError::NotFound {
            user: user.clone(),
            what: "live instance".into(),
        };
        let slot = self.shared.users.existing(user).ok_or_else(not_found)?;
        slot.touch(unix_millis_now());
        self.shared.resume(&slot).await?;
        let mut record = slot.live_record(Role::Main).ok_or_else(not_found)?;
        // The record catches up on its own task; the answer says what is
        // true now.
        if record.status == InstanceStatus::Hibernated && !slot.is_hibernated() {
            record.status = InstanceStatus::Running;
            record.hibernated_at = None;
        }
        Ok(record)
    }

    fn subscribe(&self) -> broadcast::Receiver<InstanceEvent> {
        self.shared.publisher.subscribe()
    }
}

#[async_trait]
impl Spawner for Controller {
    async fn take_over(
        &self,
        user: &UserId,
        request: LaunchRequest,
    ) -> Result<Instance, SpawnError> {
        self.launch_claiming(user, request, Claim::TakeOver).await
    }

    async fn restart_main(&self, user: &UserId) -> Result<Instance, SpawnError> {
        // A user this node has never seen has no main here to restart (and
        // gets no slug recorded for asking).
        if self.shared.users.existing(user).is_none() {
            return Err(SpawnError::NotFound {
                user: user.clone(),
                what: "live main instance".into(),
            });
        }
        self.run_locked(user, |shared, slot| async move {
            let folder = match slot.live_record(Role::Main) {
                Some(live) => live.folder,
                None => {
                    return Err(SpawnError::NotFound {
                        user: slot.user.clone(),
                        what: "live main instance".into(),
                    });
                }
            };
            shared
                .stop_locked(&slot, StopKind::Requested("restart"))
                .await;
            shared
                .launch_locked(
                    &slot,
                    folder,
                    Patch::Unchanged,
                    LaunchKind::Implicit,
                    Claim::Acquire,
                )
                .await
        })
        .await
    }

    async fn reset_breaker(&self, user: &UserId) -> Result<(), SpawnError> {
        self.shared.breaker.reset(user).await
    }

    async fn set_egress(
        &self,
        user: &UserId,
        policy: Option<&EgressPolicy>,
    ) -> Result<(), SpawnError> {
        let runtime = &self.shared.runtime;
        if !runtime.capabilities().egress {
            return Err(SpawnError::InvalidRequest(format!(
                "the {} runtime here does not guard its instances' egress",
                runtime.name()
            )));
        }
        if let Some(name) = policy.and_then(|p| p.allow.iter().find(|d| d.is_domain()))
            && !runtime.capabilities().egress_names
        {
            return Err(SpawnError::InvalidRequest(format!(
                "{name} is a domain name, and the {} runtime here lets programs reach \
                 networks only",
                runtime.name()
            )));
        }
        self.shared.store.set_user_egress(user, policy).await?;
        // A user who never ran has no slug, and no account to change: a
        // start reads the stored policy.
        if let Some(slug) = self.shared.known_slug(user).await? {
            runtime
                .set_egress(user, &slug, policy)
                .await
                .map_err(|e| SpawnError::Internal(format!("the egress guard refused: {e}")))?;
        }
        Ok(())
    }

    async fn restart_all_mains(&self) -> Vec<RestartResult> {
        let users: Vec<UserId> = self
            .shared
            .users
            .all()
            .iter()
            .filter(|s| s.record(Role::Main).is_some_and(|i| i.status.is_routable()))
            .map(|s| s.user.clone())
            .collect();
        let limit = self.shared.config.restart_all_concurrency.max(1);
        futures_util::stream::iter(users)
            .map(|user| async move {
                match self.restart_main(&user).await {
                    Ok(_) => RestartResult {
                        user,
                        ok: true,
                        error: None,
                    },
                    Err(e) => {
                        tracing::warn!(%user, error = %e, "restart-all: restart failed");
                        RestartResult {
                            user,
                            ok: false,
                            error: Some(e.to_string()),
                        }
                    }
                }
            })
            .buffer_unordered(limit)
            .collect()
            .await
    }

    async fn spawn_watchdog(&self, user: &UserId) -> Result<Instance, SpawnError> {
        // Refused before anything is recorded (invariant 14).
        if !self.shared.config.watchdog {
            return Err(SpawnError::NotFound {
                user: user.clone(),
                what: "watchdog command".into(),
            });
        }
        let shared = Arc::clone(&self.shared);
        let user = user.clone();
        self.run_detached(async move {
            let slot = shared.slot(&user).await?;
            shared.spawn_watchdog(&slot, None).await
        })
        .await
    }

    async fn status(&self, user: &UserId) -> Result<UserStatus, SpawnError> {
        // A user whose main this node supervises has its watchdog here too,
        // if any: memory answers both, and a node cut off from the store
        // still knows what it runs.
        if let Some(slot) = self.shared.users.existing(user)
            && slot.record(Role::Main).is_some()
        {
            return Ok(UserStatus {
                main: self.record(user, Role::Main).await?,
                watchdog: slot.record(Role::Watchdog),
                idle_action: Some(self.shared.idle_action().as_str().to_owned()),
            });
        }
        Ok(UserStatus {
            main: self.record(user, Role::Main).await?,
            watchdog: self.record(user, Role::Watchdog).await?,
            idle_action: Some(self.shared.idle_action().as_str().to_owned()),
        })
    }

    async fn stop(&self, user: &UserId) -> Result<(), SpawnError> {
        let Some(slot) = self.shared.users.existing(user) else {
            return Ok(());
        };
        let _guard = slot.lifecycle.lock().await;
        self.shared
            .stop_locked(&slot, StopKind::Requested("stop"))
            .await;
        // The stop is done; counters that cannot be reset now (the store is
        // away) only mean the next crash is judged on an older history.
        if let Err(e) = self.shared.breaker.reset_counters(user).await {
            tracing::warn!(%user, error = %e, "could not reset the crash counters after a stop");
        }
        Ok(())
    }

    async fn teardown(&self) {
        self.shared.cancel.cancel();
        self.shared.tasks.close();
        self.shared.tasks.wait().await;
        self.shared.runtime.shutdown().await;
    }

    async fn restart_and_probe(&self, user: &UserId) -> ProbeReport {
        let config = &self.shared.config;
        let fail = |reason: String| ProbeReport { ok: false, reason };
        let live = self
            .shared
            .users
            .existing(user)
            .and_then(|s| s.live_record(Role::Main))
            .is_some();
        let started = if live {
            self.restart_main(user).await
        } else {
            let request = LaunchRequest {
                force: true,
                ..LaunchRequest::default()
            };
            self.launch(user, request).await
        };
        let started = match started {
            Ok(instance) => instance,
            Err(e) => return fail(format!("could not start the instance: {e}")),
        };
        let ready = match self.wait_for_ready(user, config.probe_budget).await {
            Ok(Some(i)) if i.status == InstanceStatus::Running && i.ready => i,
            Ok(Some(i)) => {
                return fail(format!(
                    "the instance did not become ready: it is {}{}",
                    i.status,
                    i.last_error.map(|e| format!(" ({e})")).unwrap_or_default()
                ));
            }
            Ok(None) => return fail("the instance disappeared while starting".into()),
            Err(e) => {
                return fail(format!(
                    "the instance was not ready within {} s: {e}",
                    config.probe_budget.as_secs_f64()
                ));
            }
        };
        tokio::time::sleep(config.probe_settle).await;
        match self.record(user, Role::Main).await {
            Ok(Some(now))
                if now.id == started.id
                    && now.status == InstanceStatus::Running
                    && now.runtime_ref == ready.runtime_ref =>
            {
                ProbeReport {
                    ok: true,
                    reason: format!(
                        "ready and still running after {} s (pid {})",
                        config.probe_settle.as_secs_f64(),
                        now.pid.unwrap_or(0)
                    ),
                }
            }
            Ok(Some(now)) => fail(format!(
                "the instance did not stay up: it is {} (pid {:?}, was {:?}){}",
                now.status,
                now.pid,
                ready.pid,
                now.last_error.map(|e| format!(": {e}")).unwrap_or_default()
            )),
            Ok(None) => fail("the instance disappeared after becoming ready".into()),
            Err(e) => fail(format!("could not read the instance status: {e}")),
        }
    }

    async fn hibernate(&self, user: &UserId) -> Result<Instance, SpawnError> {
        self.run_locked(user, |shared, slot| async move {
            let user = slot.user.clone();
            match shared
                .hibernate_locked(&slot, crate::hibernation::HibernateBy::Request)
                .await?
            {
                Some(hibernated) => Ok(hibernated),
                // A request arrived meanwhile: it stays running, and says so.
                None => slot.live_record(Role::Main).ok_or(SpawnError::NotFound {
                    user,
                    what: "running instance".into(),
                }),
            }
        })
        .await
    }

    async fn logs(&self, user: &UserId, tail: usize) -> Result<Vec<String>, SpawnError> {
        // The recorded slug names the log; a user without one never ran.
        let Some(slug) = self.shared.known_slug(user).await? else {
            return Ok(Vec::new());
        };
        self.shared
            .runtime
            .logs(&slug, Role::Main, tail)
            .await
            .map_err(|e| SpawnError::Internal(e.to_string()))
    }

    async fn follow_logs(
        &self,
        user: &UserId,
        tail: usize,
    ) -> Result<mpsc::Receiver<String>, SpawnError> {
        // A user without a recorded slug has not run yet: follow where
        // their first launch here will write (nothing is recorded for
        // asking).
        let slug = match self.shared.known_slug(user).await? {
            Some(slug) => slug,
            None => self.shared.first_slug(user).await?,
        };
        self.shared
            .runtime
            .follow_logs(&slug, Role::Main, tail)
            .await
            .map_err(|e| SpawnError::Internal(e.to_string()))
    }

    fn last_main_event(&self, user: &UserId) -> Option<InstanceEvent> {
        self.shared.users.existing(user)?.last_main_event()
    }

    async fn fence(&self, user: &UserId, epoch: Epoch) -> Result<bool, SpawnError> {
        let Some(slot) = self.shared.users.existing(user) else {
            return Ok(false);
        };
        // Same path as a renew that found the lease lost: the driver kills
        // the instance (frozen or not), records "lease lost: fenced" and
        // forgets the lease without releasing it.
        let fenced = slot.request_fence(Some(epoch));
        if fenced {
            tracing::warn!(%user, epoch, "fenced on another node's request");
            let budget = self.shared.config.stop_grace + Duration::from_secs(5);
            if !wait_not_live(&slot, budget).await {
                tracing::warn!(%user, epoch, "the fenced instance has not ended yet");
            }
        }
        Ok(fenced)
    }
}
