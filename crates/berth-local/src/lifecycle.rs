//! Lifecycle operations on one user: launch, stop, restart and the
//! watchdog. Each runs under the user's lifecycle mutex; the processes are
//! then watched by a supervisor task (see `supervisor`).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use berth_core::policy::{CrashState, LaunchKind};
use berth_core::{Instance, InstanceStatus, MAX_PATCH_BYTES, Role, SpawnError, UserId};
use berth_store::{ClaimOutcome, InstanceFilter};

use crate::inner::{Inner, Live, StopKind, UserSlot, error_tail, new_instance_id};
use crate::isolation::Account;
use crate::isolation::fsafe::Owner;
use crate::paths::{UserPaths, normalize_folder};
use crate::shim::ShimError;
use crate::supervisor::{self, Start};

/// Where the patch of a launch comes from.
pub(crate) enum PatchSource {
    /// New content from the request (`None`: no patch).
    Content(Option<String>),
    /// The file materialised by an earlier launch (restart).
    Keep(Option<PathBuf>),
}

/// How a launch claims the user's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claim {
    /// The normal claim: free, released, or expired under the takeover
    /// policy.
    Acquire,
    /// An operator's explicit takeover of an expired lease, whatever the
    /// policy.
    TakeOver,
}

/// Checks a request before anything is touched: a refused request leaves
/// no trace on disk or in the store.
pub(crate) fn validate(folder: Option<&str>, patch: Option<&str>) -> Result<String, SpawnError> {
    if let Some(patch) = patch {
        if patch.len() > MAX_PATCH_BYTES {
            return Err(SpawnError::PayloadTooLarge {
                size: patch.len(),
                limit: MAX_PATCH_BYTES,
            });
        }
    }
    normalize_folder(folder).map_err(SpawnError::InvalidRequest)
}

fn spawn_error(e: ShimError) -> String {
    match e {
        ShimError::SpawnFailed(msg) => msg,
        other => other.to_string(),
    }
}

impl Inner {
    pub(crate) fn port_range_text(&self) -> String {
        let r = self.ports.range();
        format!("{}-{}", r.start(), r.end())
    }

    /// Ports the store records for live instances on this node.
    async fn recorded_ports(&self) -> Result<BTreeSet<u16>, SpawnError> {
        let filter = InstanceFilter {
            node: Some(self.node().to_owned()),
            ..InstanceFilter::default()
        };
        let records = self.store.list_instances(&filter).await?;
        Ok(records
            .iter()
            .filter(|r| r.status.is_live())
            .filter_map(|r| r.port)
            .collect())
    }

    /// Launches the main of `slot`; the caller holds its lifecycle lock.
    pub(crate) async fn launch_locked(
        self: &Arc<Self>,
        slot: &Arc<UserSlot>,
        folder: String,
        patch: PatchSource,
        kind: LaunchKind,
        claim: Claim,
    ) -> Result<Instance, SpawnError> {
        let user = &slot.user;
        if slot.live_record(Role::Main).is_some() {
            return Err(SpawnError::AlreadyRunning { user: user.clone() });
        }
        // First of all: past the node's capacity nothing is started, and
        // no port, lease or record is touched.
        let _admission = self.admit(user)?;
        let now = Inner::now();
        let crash = self.store.load_crash_state(user).await?;
        let admitted = self
            .config
            .crash
            .admit_launch(&crash, now, kind)
            .map_err(|open| SpawnError::CircuitOpen {
                user: user.clone(),
                opens: open.opens,
                retry_at: open.cooldown_until,
            })?;
        let used = self.recorded_ports().await?;
        let port = self.ports.allocate(None, &used).ok_or_else(|| {
            SpawnError::CapacityExhausted(format!("no free port in {}", self.port_range_text()))
        })?;
        let launched = self
            .launch_on_port(slot, folder, patch, port, (crash, admitted), claim)
            .await;
        if launched.is_err() {
            self.revoke_port(port).await;
            self.ports.release(port);
        }
        launched
    }

    async fn launch_on_port(
        self: &Arc<Self>,
        slot: &Arc<UserSlot>,
        folder: String,
        patch: PatchSource,
        port: u16,
        (crash, admitted): (CrashState, CrashState),
        claim: Claim,
    ) -> Result<Instance, SpawnError> {
        let user = &slot.user;
        // Through the keeper either way, so it renews (and the fence clock
        // covers) exactly the epoch the instance runs under.
        let outcome = match claim {
            Claim::Acquire => self.lease.acquire(user).await?,
            Claim::TakeOver => self.lease.take_over(user).await?,
        };
        let epoch = match outcome {
            ClaimOutcome::Claimed { epoch } => epoch,
            ClaimOutcome::Busy { holder, expired } => {
                return Err(SpawnError::LeaseBusy {
                    user: user.clone(),
                    holder,
                    expired,
                });
            }
        };
        match self
            .spawn_main(slot, folder, patch, port, epoch, crash, admitted)
            .await
        {
            Ok(instance) => Ok(instance),
            Err(e) => {
                self.release_lease(user).await;
                Err(e)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn spawn_main(
        self: &Arc<Self>,
        slot: &Arc<UserSlot>,
        folder: String,
        patch: PatchSource,
        port: u16,
        epoch: i64,
        crash: CrashState,
        admitted: CrashState,
    ) -> Result<Instance, SpawnError> {
        // Recorded only once the lease is ours (a refused launch must not
        // replace the holder's), so any node can relaunch the user the same
        // way after a failover; a restart (`Keep`) leaves them as they are.
        if let PatchSource::Content(content) = &patch {
            self.store
                .put_launch_params(&slot.user, &folder, content.as_deref())
                .await?;
        }
        let paths = &slot.paths;
        let account = self.account(slot).await?;
        let prepare = async {
            prepare_dirs(paths, &folder, account.as_ref()).await?;
            let patch = match patch {
                PatchSource::Keep(path) => path,
                PatchSource::Content(None) => None,
                PatchSource::Content(Some(content)) => {
                    let file = paths.patch_file(&self.config.patch_ext);
                    let name = file
                        .file_name()
                        .and_then(|n| n.to_str())
                        .unwrap_or("main")
                        .to_owned();
                    write_in_root(
                        paths,
                        Some("patches"),
                        name,
                        content.into_bytes(),
                        account.as_ref(),
                    )
                    .await?;
                    Some(file)
                }
            };
            if admitted != crash {
                self.store.save_crash_state(&slot.user, &admitted).await?;
            }
            let now = Inner::now();
            let instance = self.starting_instance(slot, Role::Main, epoch, Some(port), folder, now);
            let spec = self.shim_spec(slot, &instance, port, patch.as_deref(), account.as_ref())?;
            Ok::<_, SpawnError>((patch, instance, spec))
        };
        // The port grant (an `nft` run) goes alongside the preparation, and
        // is done before the program runs, so it can always reach its own
        // port. On any error the caller takes the grant back.
        let (granted, prepared) = tokio::join!(self.grant_port(account.as_ref(), port), prepare);
        granted?;
        let (patch, mut instance, spec) = prepared?;
        self.store.put_instance(&instance).await?;
        let spawned_at = std::time::Instant::now();
        match self.shims.spawn(&spec).await {
            Ok((handle, state)) => {
                instance.pid = Some(state.pid);
                instance.pid_start = Some(state.pid_start);
                slot.touch(instance.started_at);
                let mut live = Live::new(instance.clone(), patch);
                live.control = Some(handle.control());
                live.shim_pid = Some(state.shim_pid);
                let stop = live.stop.clone();
                self.install(slot, live);
                self.set_token(&slot.user, None);
                self.publish(slot, &instance, None).await;
                supervisor::start_main(
                    self,
                    slot,
                    &instance.id,
                    stop,
                    Start::Attached {
                        handle,
                        spawned_at: Some(spawned_at),
                        shim_ready: state.ready,
                        token: state.token,
                    },
                );
                Ok(instance)
            }
            Err(e) => {
                let message = spawn_error(e);
                instance.status = InstanceStatus::Failed;
                instance.last_error = Some(error_tail(&message));
                self.install(slot, Live::new(instance.clone(), patch));
                self.publish(slot, &instance, Some(message.clone())).await;
                Err(SpawnError::SpawnFailed(message))
            }
        }
    }

    pub(crate) async fn release_lease(&self, user: &UserId) {
        if let Err(e) = self.lease.release(user).await {
            self.metrics.store_errors.inc();
            tracing::warn!(%user, error = %e, "could not release the lease");
        }
    }

    /// Stops the user's main (if live) and watchdog, and waits for both.
    /// The caller holds the lifecycle lock, except for fencing.
    pub(crate) async fn stop_locked(&self, slot: &UserSlot, kind: StopKind) {
        for role in [Role::Main, Role::Watchdog] {
            let task = {
                let mut state = slot.lock();
                match state.get_mut(role).as_mut() {
                    Some(live) if live.instance.status.is_live() => {
                        live.stop_kind.get_or_insert(kind);
                        live.stop.cancel();
                        live.task.take()
                    }
                    _ => None,
                }
            };
            let Some(task) = task else { continue };
            // The supervisor bounds its own wait (grace + margin, then a
            // direct kill); this outer bound only guards against a bug.
            let bound = self.config.stop_grace + Duration::from_secs(10);
            if tokio::time::timeout(bound, task).await.is_err() {
                tracing::error!(user = %slot.user, %role, "supervisor did not finish stopping the instance");
            }
        }
    }

    /// Clears the crash streak and the restarts in the window after an
    /// explicit operation. The breaker itself (open count and a running
    /// cooldown) is kept: only `force` and `reset_breaker` clear it.
    pub(crate) async fn reset_crash_counters(&self, user: &UserId) -> Result<(), SpawnError> {
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

    /// Starts the watchdog of `slot`. `after_crash` carries the crashed
    /// main's record for the handoff file.
    pub(crate) async fn spawn_watchdog(
        self: &Arc<Self>,
        slot: &Arc<UserSlot>,
        main: Option<Instance>,
    ) -> Result<Instance, SpawnError> {
        if self.config.watchdog_command.is_none() {
            return Err(SpawnError::NotFound {
                user: slot.user.clone(),
                what: "watchdog command",
            });
        }
        let _guard = slot.watchdog_lock.lock().await;
        if slot.live_record(Role::Watchdog).is_some() {
            return Err(SpawnError::AlreadyRunning {
                user: slot.user.clone(),
            });
        }
        let main = match main.or_else(|| slot.record(Role::Main)) {
            Some(m) => Some(m),
            None => self.store.get_instance(&slot.user, Role::Main).await?,
        };
        let paths = &slot.paths;
        let folder = main.as_ref().map(|m| m.folder.clone()).unwrap_or_default();
        let account = self.account(slot).await?;
        prepare_dirs(paths, &folder, account.as_ref()).await?;
        let handoff = serde_json::json!({
            "user": slot.user.as_str(),
            "instance_id": main.as_ref().map(|m| m.id.clone()),
            "status": main.as_ref().map(|m| m.status.as_str()),
            "exit_code": main.as_ref().and_then(|m| m.exit_code),
            "last_error": main.as_ref().and_then(|m| m.last_error.clone()),
            "at": Inner::now(),
        });
        write_in_root(
            paths,
            None,
            "handoff.json".to_owned(),
            handoff.to_string().into_bytes(),
            account.as_ref(),
        )
        .await?;
        let patch_file = paths.patch_file(&self.config.patch_ext);
        let patch = tokio::fs::try_exists(&patch_file)
            .await
            .unwrap_or(false)
            .then_some(patch_file);
        let now = Inner::now();
        // Watchdogs hold no lease (epoch 0) and listen on no port of their own.
        let mut instance = self.starting_instance(slot, Role::Watchdog, 0, None, folder, now);
        let var_port = main.as_ref().and_then(|m| m.port).unwrap_or(0);
        let spec = self.shim_spec(
            slot,
            &instance,
            var_port,
            patch.as_deref(),
            account.as_ref(),
        )?;
        self.store.put_instance(&instance).await?;
        match self.shims.spawn(&spec).await {
            Ok((handle, state)) => {
                instance.status = InstanceStatus::Running;
                instance.pid = Some(state.pid);
                instance.pid_start = Some(state.pid_start);
                let mut live = Live::new(instance.clone(), patch);
                live.control = Some(handle.control());
                live.shim_pid = Some(state.shim_pid);
                let stop = live.stop.clone();
                self.install(slot, live);
                self.publish(slot, &instance, None).await;
                supervisor::start_watchdog(self, slot, &instance.id, stop, handle);
                Ok(instance)
            }
            Err(e) => {
                let message = spawn_error(e);
                if let Err(e) = self.store.delete_instance(&slot.user, Role::Watchdog).await {
                    tracing::warn!(user = %slot.user, error = %e, "could not delete the watchdog record");
                }
                Err(SpawnError::SpawnFailed(message))
            }
        }
    }
}

impl Inner {
    /// The record of an instance about to be spawned on this node.
    fn starting_instance(
        &self,
        slot: &UserSlot,
        role: Role,
        epoch: i64,
        port: Option<u16>,
        folder: String,
        now: i64,
    ) -> Instance {
        Instance {
            id: new_instance_id(),
            user: slot.user.clone(),
            role,
            status: InstanceStatus::Starting,
            node: self.node().to_owned(),
            epoch,
            port,
            pid: None,
            pid_start: None,
            folder,
            started_at: now,
            ready: false,
            restarts: 0,
            last_error: None,
            exit_code: None,
            last_active: now,
        }
    }
}

/// Creates the user's data root and working folder. mkdir and chmod block,
/// for long on a busy disk (a new user needs seven directories): on the
/// runtime's few worker threads, a burst of launches would hold up every
/// other request and event meanwhile, so this runs on the blocking pool.
async fn prepare_dirs(
    paths: &UserPaths,
    folder: &str,
    account: Option<&Account>,
) -> Result<(), SpawnError> {
    let dirs = paths.clone();
    let folder = folder.to_owned();
    let owner = account.map(owner_of);
    tokio::task::spawn_blocking(move || {
        dirs.prepare(&folder, owner).map_err(|e| {
            // A link on the way to the folder is the request's problem.
            if e.kind() == std::io::ErrorKind::InvalidInput {
                SpawnError::InvalidRequest(e.to_string())
            } else {
                SpawnError::Internal(format!("cannot prepare the user's directories: {e}"))
            }
        })
    })
    .await
    .map_err(|e| SpawnError::Internal(format!("preparing the directories failed: {e}")))?
    .map(drop)
}

/// Writes a file berth hands to the program (the patch, the handoff) into
/// the user's root, never through a link, owned by the account.
async fn write_in_root(
    paths: &UserPaths,
    dir: Option<&'static str>,
    name: String,
    bytes: Vec<u8>,
    account: Option<&Account>,
) -> Result<(), SpawnError> {
    let paths = paths.clone();
    let owner = account.map(owner_of);
    tokio::task::spawn_blocking(move || {
        paths
            .write_file(dir, &name, &bytes, owner)
            .map_err(|e| SpawnError::Internal(e.to_string()))
    })
    .await
    .map_err(|e| SpawnError::Internal(format!("writing into the user's root failed: {e}")))?
}

fn owner_of(account: &Account) -> Owner {
    Owner {
        uid: account.uid,
        gid: account.gid,
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
}
