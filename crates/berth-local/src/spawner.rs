//! The local spawner: the public face of the backend. It validates the
//! config, wires the shared state, re-attaches to running shims, starts the
//! background work, and implements [`Spawner`] on top of the lifecycle
//! operations and the in-memory tables.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use berth_core::policy::{CrashState, LaunchKind};
use berth_core::{
    BreakerInfo, Endpoint, Epoch, Instance, InstanceEvent, InstanceStatus, LaunchRequest,
    ProbeReport, RestartResult, Role, SpawnError, Spawner, UserId, UserStatus,
};
use berth_store::lease::LeaseKeeper;
use berth_store::{InstanceFilter, NodeRecord, NodeStatus, Store};
use futures_util::StreamExt;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::LocalConfig;
use crate::inner::{EVENT_CAPACITY, Inner, StopKind, UserSlot};
use crate::isolation::Isolator;
use crate::lifecycle::{Claim, PatchSource, validate};
use crate::logs::tail_lines;
use crate::metrics::Metrics;
use crate::paths::{check_socket_room, create_private_dir};
use crate::ports::PortPool;
use crate::shim::ShimLauncher;

/// Why the local spawner could not start.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("{0}")]
    Config(String),
    #[error("cannot prepare {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] berth_store::StoreError),
    #[error(transparent)]
    Host(#[from] crate::isolation::HostError),
}

/// Runs users' instances as local processes. Implements
/// [`berth_core::Spawner`].
pub struct LocalSpawner {
    inner: Arc<Inner>,
}

fn check_config(config: &LocalConfig) -> Result<(), LocalError> {
    let fail = |m: String| Err(LocalError::Config(m));
    if config.node_id.is_empty() {
        return fail("node_id must not be empty".into());
    }
    if config.command.is_empty() {
        return fail("the instance command is empty".into());
    }
    if config.shim_command.is_empty() {
        return fail("the shim command is empty".into());
    }
    if config.watchdog_command.as_ref().is_some_and(Vec::is_empty) {
        return fail("the watchdog command is empty".into());
    }
    if config.port_range.is_empty() {
        return fail(format!(
            "port_range {}-{} is empty",
            config.port_range.start(),
            config.port_range.end()
        ));
    }
    check_socket_room(&config.data_dir).map_err(LocalError::Config)
}

impl LocalSpawner {
    /// Prepares directories, re-attaches to the shims left by a previous
    /// berth on this data dir (checking each against the store), and starts
    /// the background tasks (lease renew, reaper, activity flush).
    pub async fn start(
        mut config: LocalConfig,
        store: Arc<dyn Store>,
    ) -> Result<Arc<LocalSpawner>, LocalError> {
        check_config(&config)?;
        let io = |path: &std::path::Path| {
            let path = path.to_owned();
            move |source| LocalError::Io { path, source }
        };
        std::fs::create_dir_all(&config.data_dir).map_err(io(&config.data_dir))?;
        // Absolute from here on: a sandbox mounts over these paths.
        config.data_dir = std::fs::canonicalize(&config.data_dir).map_err(io(&config.data_dir))?;
        check_socket_room(&config.data_dir).map_err(LocalError::Config)?;
        let isolator = Isolator::prepare(
            config.isolation,
            &config.data_dir,
            config.uids,
            &config.port_range,
            config.nft.as_deref(),
        )
        .await?;
        match &isolator {
            Some(isolator) => tracing::info!(level = %isolator.level,
                table = %format!("inet {}", isolator.guard.table()),
                cgroups = ?isolator.cgroups.as_ref().map(|p| p.dirs()),
                "instances are isolated"),
            None => tracing::debug!("instances are not isolated (level none)"),
        }
        // Private to berth; at levels with accounts, others may pass
        // through (not list) the data dir and `users/` to reach their own
        // roots, which are theirs and 0700.
        let shared = if isolator.is_some() { 0o711 } else { 0o700 };
        for (dir, mode) in [
            (config.data_dir.clone(), shared),
            (config.data_dir.join("users"), shared),
            (config.data_dir.join("run"), 0o700),
        ] {
            create_private_dir(&dir).map_err(io(&dir))?;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode))
                .map_err(io(&dir))?;
        }
        let lease = LeaseKeeper::new(store.clone(), config.node_id.clone(), config.lease.clone());
        let ports = PortPool::new(config.port_range.clone());
        let shims = {
            let mut parts = config.shim_command.iter().cloned();
            let exe = parts.next().unwrap_or_default();
            ShimLauncher::new(exe, parts.collect())
        };
        // The default capacity: one main per port (see `set_capacity`).
        let ports_capacity = ports.capacity();
        let inner = Arc::new(Inner {
            ports,
            metrics: Metrics::new(&config.node_id),
            config,
            store,
            lease,
            slots: RwLock::new(HashMap::new()),
            routes: RwLock::new(HashMap::new()),
            tokens: RwLock::new(HashMap::new()),
            events: broadcast::channel(EVENT_CAPACITY).0,
            tracker: TaskTracker::new(),
            cancel: CancellationToken::new(),
            frozen: Mutex::new(HashMap::new()),
            node_status: Mutex::new(NodeStatus::Up),
            capacity: AtomicU32::new(ports_capacity),
            heartbeat_lock: tokio::sync::Mutex::new(()),
            shims,
            isolator,
            launching: Mutex::new(HashSet::new()),
        });
        inner.keep_earlier_data_roots().await;
        if let Err(e) = inner.reattach().await {
            // Supervisors started for instances adopted so far must not
            // outlive a spawner that failed to start.
            inner.cancel.cancel();
            inner.tracker.close();
            inner.tracker.wait().await;
            return Err(e);
        }
        inner.remove_stale_cgroups();
        inner.start_background();
        Ok(Arc::new(LocalSpawner { inner }))
    }

    /// Prometheus metrics of this spawner.
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        self.inner.metrics.register(registry);
    }

    /// Sets the capacity the heartbeat reports (default: the size of the
    /// port range). Call [`LocalSpawner::heartbeat`] to publish it at once.
    pub fn set_capacity(&self, capacity: u32) {
        self.inner.capacity.store(capacity, Ordering::Relaxed);
    }

    /// Sets this node's status (`up` or `draining`); the heartbeat carries
    /// it, and placement sends no new instances to a draining node.
    pub fn set_node_status(&self, status: NodeStatus) {
        *self
            .inner
            .node_status
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = status;
    }

    /// This node's row as the next heartbeat will write it.
    pub fn node_record(&self) -> NodeRecord {
        self.inner.node_record()
    }

    /// Heartbeats now, outside the renew tick (at start, and right after a
    /// status change so the cluster sees it without waiting a tick).
    pub async fn heartbeat(&self) -> Result<(), berth_store::StoreError> {
        self.inner.heartbeat().await
    }

    /// Waits until the main of `slot` is no longer live, up to `timeout`.
    async fn wait_not_live(slot: &crate::inner::UserSlot, timeout: Duration) -> bool {
        let mut watch = slot.main_watch.subscribe();
        let wait = async {
            loop {
                let live = watch
                    .borrow_and_update()
                    .as_ref()
                    .is_some_and(|i| i.status.is_live());
                if !live {
                    return;
                }
                if watch.changed().await.is_err() {
                    return;
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.is_ok()
    }
}

impl Drop for LocalSpawner {
    fn drop(&mut self) {
        // Background tasks hold the shared state; without this they would
        // keep running after the last handle is gone.
        self.inner.cancel.cancel();
    }
}

impl LocalSpawner {
    /// The record of `role`: memory first (it is this node's truth), else
    /// the store.
    async fn record(&self, user: &UserId, role: Role) -> Result<Option<Instance>, SpawnError> {
        if let Some(slot) = self.inner.existing_slot(user) {
            if let Some(mut instance) = slot.record(role) {
                instance.last_active = instance
                    .last_active
                    .max(slot.last_active.load(Ordering::Relaxed));
                return Ok(Some(instance));
            }
        }
        Ok(self.inner.store.get_instance(user, role).await?)
    }
}

impl LocalSpawner {
    /// A launch under the user's lifecycle lock, claiming the lease the way
    /// `claim` says: an ordinary claim, or an operator's takeover.
    async fn launch_claiming(
        &self,
        user: &UserId,
        request: LaunchRequest,
        claim: Claim,
    ) -> Result<Instance, SpawnError> {
        let folder = validate(request.folder.as_deref(), request.patch.as_deref())?;
        self.run_locked(user, move |inner, slot| async move {
            let kind = if request.force {
                LaunchKind::Force
            } else {
                LaunchKind::Implicit
            };
            inner
                .launch_locked(
                    &slot,
                    folder,
                    PatchSource::Content(request.patch),
                    kind,
                    claim,
                )
                .await
        })
        .await
    }

    /// Runs `work` detached (see [`LocalSpawner::run_detached`]) under
    /// `user`'s lifecycle lock, unless berth began to stop meanwhile.
    async fn run_locked<T, W, Fut>(&self, user: &UserId, work: W) -> Result<T, SpawnError>
    where
        W: FnOnce(Arc<Inner>, Arc<UserSlot>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, SpawnError>> + Send,
        T: Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        let user = user.clone();
        self.run_detached(async move {
            let slot = inner.slot(&user).await?;
            let _guard = slot.lifecycle.lock().await;
            // Waited for the lock while berth began to stop: start nothing.
            if inner.cancel.is_cancelled() {
                return Err(shutting_down());
            }
            work(Arc::clone(&inner), Arc::clone(&slot)).await
        })
        .await
    }

    /// Runs `work` on a task of the spawner's own and waits for it. A caller
    /// that stops waiting (an API client that hangs up mid-launch) does not
    /// cut a launch short: half done, it would leave a claimed lease, a
    /// reserved port and a started shim that nothing tracks.
    async fn run_detached<T, F>(&self, work: F) -> Result<T, SpawnError>
    where
        F: Future<Output = Result<T, SpawnError>> + Send + 'static,
        T: Send + 'static,
    {
        if self.inner.cancel.is_cancelled() {
            return Err(shutting_down());
        }
        self.inner
            .tracker
            .spawn(work)
            .await
            .unwrap_or_else(|e| Err(SpawnError::Internal(format!("the task failed: {e}"))))
    }
}

#[async_trait]
impl Spawner for LocalSpawner {
    async fn launch(&self, user: &UserId, request: LaunchRequest) -> Result<Instance, SpawnError> {
        self.launch_claiming(user, request, Claim::Acquire).await
    }

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
        if self.inner.existing_slot(user).is_none() {
            return Err(SpawnError::NotFound {
                user: user.clone(),
                what: "live main instance",
            });
        }
        self.run_locked(user, |inner, slot| async move {
            let (folder, patch) = {
                let state = slot.lock();
                match state.main.as_ref() {
                    Some(live) if live.instance.status.is_live() => {
                        (live.instance.folder.clone(), live.patch.clone())
                    }
                    _ => {
                        return Err(SpawnError::NotFound {
                            user: slot.user.clone(),
                            what: "live main instance",
                        });
                    }
                }
            };
            inner
                .stop_locked(&slot, StopKind::Requested("restart"))
                .await;
            inner
                .launch_locked(
                    &slot,
                    folder,
                    PatchSource::Keep(patch),
                    LaunchKind::Implicit,
                    Claim::Acquire,
                )
                .await
        })
        .await
    }

    async fn breaker_info(&self, user: &UserId) -> Result<Option<BreakerInfo>, SpawnError> {
        let state = self.inner.store.load_crash_state(user).await?;
        Ok(state.breaker_at(Inner::now()))
    }

    async fn reset_breaker(&self, user: &UserId) -> Result<(), SpawnError> {
        Ok(self
            .inner
            .store
            .save_crash_state(user, &CrashState::default())
            .await?)
    }

    async fn restart_all_mains(&self) -> Vec<RestartResult> {
        let users: Vec<UserId> = self
            .inner
            .all_slots()
            .iter()
            .filter(|s| {
                s.record(Role::Main)
                    .is_some_and(|i| i.status == InstanceStatus::Running)
            })
            .map(|s| s.user.clone())
            .collect();
        let limit = self.inner.config.restart_all_concurrency.max(1);
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
        // Refused before anything is recorded (invariant 6).
        if self.inner.config.watchdog_command.is_none() {
            return Err(SpawnError::NotFound {
                user: user.clone(),
                what: "watchdog command",
            });
        }
        let inner = Arc::clone(&self.inner);
        let user = user.clone();
        self.run_detached(async move {
            let slot = inner.slot(&user).await?;
            inner.spawn_watchdog(&slot, None).await
        })
        .await
    }

    async fn status(&self, user: &UserId) -> Result<UserStatus, SpawnError> {
        Ok(UserStatus {
            main: self.record(user, Role::Main).await?,
            watchdog: self.record(user, Role::Watchdog).await?,
        })
    }

    async fn list(&self) -> Result<Vec<Instance>, SpawnError> {
        let filter = InstanceFilter {
            node: Some(self.inner.node().to_owned()),
            ..InstanceFilter::default()
        };
        let mut list = self.inner.store.list_instances(&filter).await?;
        for instance in &mut list {
            if let Some(slot) = self.inner.existing_slot(&instance.user) {
                if let Some(current) = slot.record(instance.role) {
                    *instance = current;
                }
            }
        }
        Ok(list)
    }

    fn endpoint_for(&self, user: &UserId) -> Option<Endpoint> {
        let routes = self.inner.routes.read().unwrap_or_else(|e| e.into_inner());
        routes.get(user).cloned()
    }

    fn launch_token(&self, user: &UserId) -> Option<String> {
        let tokens = self.inner.tokens.read().unwrap_or_else(|e| e.into_inner());
        tokens.get(user).cloned()
    }

    async fn stop(&self, user: &UserId) -> Result<(), SpawnError> {
        let Some(slot) = self.inner.existing_slot(user) else {
            return Ok(());
        };
        let _guard = slot.lifecycle.lock().await;
        self.inner
            .stop_locked(&slot, StopKind::Requested("stop"))
            .await;
        self.inner.reset_crash_counters(user).await
    }

    async fn teardown(&self) {
        self.inner.cancel.cancel();
        self.inner.tracker.close();
        self.inner.tracker.wait().await;
        self.inner.shims.shutdown().await;
    }

    async fn wait_for_ready(
        &self,
        user: &UserId,
        timeout: Duration,
    ) -> Result<Option<Instance>, SpawnError> {
        let Some(slot) = self.inner.existing_slot(user) else {
            return self.record(user, Role::Main).await;
        };
        let mut watch = slot.main_watch.subscribe();
        let wait = async {
            loop {
                let current = watch.borrow_and_update().clone();
                match current {
                    None => return None,
                    Some(i) if i.status == InstanceStatus::Running && i.ready => return Some(i),
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

    async fn restart_and_probe(&self, user: &UserId) -> ProbeReport {
        let config = &self.inner.config;
        let fail = |reason: String| ProbeReport { ok: false, reason };
        let live = self
            .inner
            .existing_slot(user)
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
                    && now.pid == ready.pid =>
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

    fn touch(&self, user: &UserId) {
        if let Some(slot) = self.inner.existing_slot(user) {
            slot.touch(Inner::now());
        }
    }

    async fn logs(&self, user: &UserId, tail: usize) -> Result<Vec<String>, SpawnError> {
        // The recorded slug names the log; a user without one never ran.
        let Some(slug) = self.inner.known_slug(user).await? else {
            return Ok(Vec::new());
        };
        let paths = crate::paths::UserPaths::new(&self.inner.config.data_dir, &slug);
        // Read as root from the user's own root: never through a link the
        // user put there (it could point at any file of the host's).
        let read = tokio::task::spawn_blocking(move || match paths.open_log(Role::Main) {
            Ok(mut file) => tail_lines(&mut file, tail),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e),
        })
        .await
        .map_err(|e| SpawnError::Internal(format!("log reader failed: {e}")))?;
        read.map_err(|e| SpawnError::Internal(format!("cannot read the log: {e}")))
    }

    async fn follow_logs(
        &self,
        user: &UserId,
        tail: usize,
    ) -> Result<tokio::sync::mpsc::Receiver<String>, SpawnError> {
        // The recorded slug names the log. A user without one has not run
        // yet: follow where their first launch here will write it (nothing
        // is recorded for asking).
        let slug = match self.inner.known_slug(user).await? {
            Some(slug) => slug,
            None => self.inner.first_slug(user).await,
        };
        let paths = crate::paths::UserPaths::new(&self.inner.config.data_dir, &slug);
        // Like `logs`: never through a link the user put in their root.
        let open: crate::follow::Opener = std::sync::Arc::new(move || paths.open_log(Role::Main));
        crate::follow::follow(
            open,
            tail,
            &self.inner.tracker,
            self.inner.cancel.child_token(),
        )
        .await
        .map_err(|e| SpawnError::Internal(format!("cannot read the log: {e}")))
    }

    fn subscribe(&self) -> broadcast::Receiver<InstanceEvent> {
        self.inner.events.subscribe()
    }

    async fn fence(&self, user: &UserId, epoch: Epoch) -> Result<bool, SpawnError> {
        let Some(slot) = self.inner.existing_slot(user) else {
            return Ok(false);
        };
        // Same path as a renew that found the lease lost: the supervisor
        // kills the group (SIGKILL works on a frozen one too), records
        // "lease lost: fenced" and forgets the lease without releasing it.
        let fenced = {
            let mut state = slot.lock();
            match state.main.as_mut() {
                Some(live) if live.instance.status.is_live() && live.instance.epoch == epoch => {
                    live.stop_kind = Some(StopKind::Fenced);
                    live.stop.cancel();
                    true
                }
                _ => false,
            }
        };
        if fenced {
            tracing::warn!(%user, epoch, "fenced on another node's request");
            let budget = self.inner.config.stop_grace + Duration::from_secs(5);
            if !Self::wait_not_live(&slot, budget).await {
                tracing::warn!(%user, epoch, "the fenced instance has not ended yet");
            }
        }
        Ok(fenced)
    }
}

/// The answer to a launch, restart or watchdog start asked for after
/// teardown began.
fn shutting_down() -> SpawnError {
    SpawnError::Internal("berth is shutting down; nothing new is started".to_owned())
}
