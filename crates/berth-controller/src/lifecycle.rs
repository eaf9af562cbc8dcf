//! Launch, stop and watchdog starts: the operations that change what runs,
//! each under the user's lifecycle lock (the caller holds it). A launch
//! checks everything it can before it claims, writes or starts anything:
//! the request, the node's capacity, the breaker, then the lease.

use std::sync::Arc;
use std::time::Duration;

use berth_core::egress::EgressPolicy;
use berth_core::policy::LaunchKind;
use berth_core::policy::supervision::{StopKind, error_tail};
use berth_core::runtime::{InstanceSpec, Patch, RuntimeError, Started};
use berth_core::{
    Epoch, Instance, InstanceStatus, MAX_PATCH_BYTES, Role, SpawnError, Stage, UserId,
    normalize_folder, unix_millis_now,
};
use berth_store::StoreError;

use crate::Shared;
use crate::driver::{self, Begin, Run};
use crate::fencer::Claim;
use crate::users::{Entry, Slot};

/// Checks a request before anything is touched: a refused request leaves
/// no trace on disk or in the store. Returns the normalised folder.
pub(crate) fn validate(folder: Option<&str>, patch: Option<&str>) -> Result<String, SpawnError> {
    if let Some(patch) = patch
        && patch.len() > MAX_PATCH_BYTES
    {
        return Err(SpawnError::PayloadTooLarge {
            size: patch.len(),
            limit: MAX_PATCH_BYTES,
        });
    }
    normalize_folder(folder).map_err(SpawnError::InvalidRequest)
}

/// A fresh random instance id.
pub(crate) fn new_instance_id() -> String {
    let mut bytes = [0u8; 12];
    if getrandom::fill(&mut bytes).is_err() {
        // No OS randomness: time plus a counter is still unique per node.
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return format!("{:x}-{n:x}", unix_millis_now());
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Shared {
    /// The egress policy `user` has of their own (`None`: the node's),
    /// read afresh for every start where the runtime guards egress:
    /// another node may have changed it since this one last ran the user.
    pub(crate) async fn own_egress(
        &self,
        user: &UserId,
    ) -> Result<Option<EgressPolicy>, StoreError> {
        if !self.capabilities.egress {
            return Ok(None);
        }
        self.store.user_egress(user).await
    }

    /// The record of an instance about to run on this node.
    fn new_record(&self, slot: &Slot, role: Role, epoch: Epoch, folder: String) -> Instance {
        let now = unix_millis_now();
        Instance {
            id: new_instance_id(),
            user: slot.user.clone(),
            role,
            status: InstanceStatus::Starting,
            node: self.node_id().to_owned(),
            epoch,
            port: None,
            pid: None,
            runtime_ref: None,
            folder,
            started_at: now,
            ready: false,
            restarts: 0,
            last_error: None,
            exit_code: None,
            last_active: now,
            hibernated_at: None,
        }
    }

    /// Launches the main of `slot`.
    pub(crate) async fn launch_locked(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        folder: String,
        patch: Patch,
        kind: LaunchKind,
        claim: Claim,
    ) -> Result<Instance, SpawnError> {
        if slot.live_record(Role::Main).is_some() {
            return Err(SpawnError::AlreadyRunning {
                user: slot.user.clone(),
            });
        }
        self.publisher.announce_stage(slot, Stage::Queued, None);
        let launched = self.admit_and_start(slot, folder, patch, kind, claim).await;
        match &launched {
            // Its record says so already, and has been announced.
            Err(SpawnError::SpawnFailed(_)) | Ok(_) => {}
            Err(e) => self
                .publisher
                .announce_stage(slot, Stage::Failed, Some(e.to_string())),
        }
        launched
    }

    /// The part of a launch after `queued`: admission (capacity, breaker,
    /// lease), then the start.
    async fn admit_and_start(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        folder: String,
        patch: Patch,
        kind: LaunchKind,
        claim: Claim,
    ) -> Result<Instance, SpawnError> {
        let user = &slot.user;
        let _place = self.node.admit(self.publisher.live_mains())?;
        let admission = self.breaker.admit(user, kind, unix_millis_now()).await?;
        // Through the keeper either way, so it renews (and the fence clock
        // covers) exactly the epoch the instance runs under.
        let epoch = self.fencer.claim(user, claim).await?;
        let launched = async {
            // Recorded only once the lease is ours (a refused launch must not
            // replace the holder's), so any node can relaunch the user the
            // same way after a failover; a restart (`Unchanged`) leaves them.
            if let Patch::Set(content) = &patch {
                self.store
                    .put_launch_params(user, &folder, content.as_deref())
                    .await?;
            }
            self.breaker.commit(user, &admission).await?;
            self.start_main(slot, folder, patch, epoch).await
        }
        .await;
        if launched.is_err() {
            self.release_lease(user).await;
        }
        launched
    }

    async fn start_main(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        folder: String,
        patch: Patch,
        epoch: Epoch,
    ) -> Result<Instance, SpawnError> {
        let mut instance = self.new_record(slot, Role::Main, epoch, folder);
        let egress = self.own_egress(&slot.user).await?;
        let spec = InstanceSpec {
            instance_id: instance.id.clone(),
            user: slot.user.clone(),
            slug: slot.slug.clone(),
            role: Role::Main,
            epoch,
            folder: instance.folder.clone(),
            patch,
            port_hint: None,
            fence: self.fencer.deadline_for_new_run(),
            env: Vec::new(),
            handoff: None,
            egress,
        };
        self.publisher.announce_stage(slot, Stage::Spawning, None);
        let started = match self.runtime.start(spec).await {
            Ok(started) => started,
            Err(RuntimeError::CapacityExhausted(message)) => {
                return Err(SpawnError::CapacityExhausted(message));
            }
            Err(e) => {
                let message = e.to_string();
                instance.status = InstanceStatus::Failed;
                instance.last_error = Some(error_tail(&message));
                let (entry, _) = Entry::new(instance.clone(), None);
                self.publisher.install(slot, entry);
                let stored = self
                    .publisher
                    .publish(slot, &instance, None, Some(message.clone()))
                    .await;
                self.on_store_refusal(&slot.user, &stored);
                return Err(SpawnError::SpawnFailed(message));
            }
        };
        instance.port = started.endpoint.as_ref().map(|e| e.port);
        instance.pid = started.pid;
        instance.runtime_ref = Some(started.runtime_ref.clone());
        // A run nobody records must not go on: if its record cannot be
        // written, the launch fails and the run ends.
        if let Err(e) = self.publisher.store_record(&instance).await {
            self.abandon(&instance, started).await;
            return Err(e.into());
        }
        slot.touch(instance.started_at);
        let (entry, stops) = Entry::new(instance.clone(), started.endpoint.clone());
        self.publisher.install(slot, entry);
        self.publisher.set_token(&slot.user, None);
        self.publisher
            .announce(slot, &instance, started.endpoint.clone(), None);
        driver::start_main(
            self,
            slot,
            &instance,
            stops,
            Begin::Run {
                run: Run::of(started),
                started_at: instance.started_at,
                ready: false,
                fresh: true,
            },
        );
        Ok(instance)
    }

    /// Ends a run that could not be recorded.
    async fn abandon(&self, instance: &Instance, mut started: Started) {
        tracing::warn!(user = %instance.user, role = %instance.role,
            "the instance record could not be written; ending the run");
        if self.runtime.kill(&started.runtime_ref).await.is_ok() {
            let wait = async { while started.events.recv().await.is_some() {} };
            let _ = tokio::time::timeout(self.config.stop_grace, wait).await;
        }
        self.runtime.release(&instance.id).await;
    }

    /// Stops the user's main (if live) and watchdog, and waits for both.
    /// The caller holds the lifecycle lock.
    pub(crate) async fn stop_locked(&self, slot: &Slot, kind: StopKind) {
        // The pre-stop hook is for a program that runs: a hibernated or
        // fenced one is killed while frozen, and a fence kills at once.
        if let (Some(hook), StopKind::Requested(_)) = (&self.config.pre_stop, kind) {
            let running = slot.lock().main.as_ref().and_then(|e| {
                let i = &e.instance;
                (i.status == InstanceStatus::Running && i.ready)
                    .then(|| i.runtime_ref.clone())
                    .flatten()
            });
            if let Some(run) = running
                && !slot.is_hibernated()
                && !self.fencer.is_fenced(&slot.user)
            {
                self.run_hook("pre_stop", hook, slot, &run).await;
            }
        }
        for role in [Role::Main, Role::Watchdog] {
            let task = {
                let mut state = slot.lock();
                match state.get_mut(role).as_mut() {
                    Some(entry) if entry.instance.status.is_live() => {
                        entry.request_stop(kind);
                        entry.task.take()
                    }
                    _ => None,
                }
            };
            let Some(task) = task else { continue };
            // The driver bounds its own wait (grace + margin, then a kill);
            // this outer bound only guards against a bug.
            let bound = self.config.stop_grace + Duration::from_secs(10);
            if tokio::time::timeout(bound, task).await.is_err() {
                tracing::error!(user = %slot.user, %role, "the driver did not finish stopping the instance");
            }
        }
    }

    /// Starts the watchdog of `slot`. `crashed` is the crashed main's
    /// record, for the handoff.
    pub(crate) async fn spawn_watchdog(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        crashed: Option<Instance>,
    ) -> Result<Instance, SpawnError> {
        if !self.config.watchdog {
            return Err(SpawnError::NotFound {
                user: slot.user.clone(),
                what: "watchdog command".into(),
            });
        }
        let _guard = slot.watchdog_lock.lock().await;
        if slot.live_record(Role::Watchdog).is_some() {
            return Err(SpawnError::AlreadyRunning {
                user: slot.user.clone(),
            });
        }
        let main = match crashed.or_else(|| slot.record(Role::Main)) {
            Some(m) => Some(m),
            None => self.store.get_instance(&slot.user, Role::Main).await?,
        };
        let folder = main.as_ref().map(|m| m.folder.clone()).unwrap_or_default();
        let handoff = serde_json::json!({
            "user": slot.user.as_str(),
            "instance_id": main.as_ref().map(|m| m.id.clone()),
            "status": main.as_ref().map(|m| m.status.as_str()),
            "exit_code": main.as_ref().and_then(|m| m.exit_code),
            "last_error": main.as_ref().and_then(|m| m.last_error.clone()),
            "at": unix_millis_now(),
        });
        // Watchdogs hold no lease (epoch 0) and listen on no port of their own.
        let mut instance = self.new_record(slot, Role::Watchdog, 0, folder);
        let egress = self.own_egress(&slot.user).await?;
        let spec = InstanceSpec {
            instance_id: instance.id.clone(),
            user: slot.user.clone(),
            slug: slot.slug.clone(),
            role: Role::Watchdog,
            epoch: 0,
            folder: instance.folder.clone(),
            patch: Patch::Unchanged,
            port_hint: None,
            fence: None,
            env: Vec::new(),
            handoff: Some(handoff.to_string()),
            egress,
        };
        let started = self
            .runtime
            .start(spec)
            .await
            .map_err(|e| SpawnError::SpawnFailed(e.to_string()))?;
        instance.status = InstanceStatus::Running;
        instance.pid = started.pid;
        instance.runtime_ref = Some(started.runtime_ref.clone());
        if let Err(e) = self.publisher.store_record(&instance).await {
            self.abandon(&instance, started).await;
            return Err(e.into());
        }
        let (entry, stops) = Entry::new(instance.clone(), None);
        self.publisher.install(slot, entry);
        self.publisher.announce(slot, &instance, None, None);
        driver::start_watchdog(self, slot, &instance.id, Run::of(started), stops);
        Ok(instance)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_patches_and_bad_folders_are_refused_first() {
        let big = "x".repeat(300 * 1024);
        assert_eq!(
            validate(None, Some(&big)),
            Err(SpawnError::PayloadTooLarge {
                size: 300 * 1024,
                limit: MAX_PATCH_BYTES
            })
        );
        assert!(matches!(
            validate(Some("../x"), None),
            Err(SpawnError::InvalidRequest(_))
        ));
        assert_eq!(validate(Some("a/b"), Some("k = 1")), Ok("a/b".into()));
        let exact = "x".repeat(MAX_PATCH_BYTES);
        assert!(validate(None, Some(&exact)).is_ok());
    }

    #[test]
    fn ids_are_unique() {
        assert_ne!(new_instance_id(), new_instance_id());
        assert_eq!(new_instance_id().len(), 24);
    }
}
