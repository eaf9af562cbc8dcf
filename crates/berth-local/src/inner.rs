//! The spawner's shared in-memory state and the few helpers every
//! lifecycle path uses to change it: one place that updates a record,
//! persists it, refreshes the route table and publishes the change.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use berth_core::{
    Endpoint, Epoch, Instance, InstanceEvent, InstanceStatus, Role, Slug, SpawnError, UserId,
    unix_millis_now,
};
use berth_store::lease::LeaseKeeper;
use berth_store::{NodeStatus, Store, StoreError};
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::isolation::cgroup::CgroupSpec;
use crate::isolation::{Account, IsolationSpec, Isolator, SandboxSpec};
use crate::metrics::Metrics;
use crate::paths::UserPaths;
use crate::ports::PortPool;
use crate::shim::ShimLauncher;
use crate::shim::{ShimControl, ShimSpec};
use crate::template::{self, Vars};
use crate::{LocalConfig, Readiness};

/// Capacity of the instance-event broadcast; slow subscribers lag rather
/// than hold up the spawner.
pub(crate) const EVENT_CAPACITY: usize = 1024;
/// `last_error` keeps at most this many characters (design §4.1).
pub(crate) const MAX_ERROR_CHARS: usize = 500;

/// Why an instance is being stopped; decides the shim command and what the
/// record says afterwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StopKind {
    /// API stop, restart, reaper: TERM, then KILL after the grace period.
    Requested(&'static str),
    /// The lease is lost: KILL at once, and do not release the lease.
    Fenced,
}

/// One instance this node supervises (or last supervised, once terminal).
pub(crate) struct Live {
    pub instance: Instance,
    pub control: Option<ShimControl>,
    pub shim_pid: Option<u32>,
    /// The materialised patch, kept for crash restarts and `restart_main`.
    pub patch: Option<PathBuf>,
    /// Cancelled to ask the supervisor to stop the instance.
    pub stop: CancellationToken,
    pub stop_kind: Option<StopKind>,
    /// The supervisor task; taken by whoever waits for the stop.
    pub task: Option<JoinHandle<()>>,
}

impl Live {
    pub fn new(instance: Instance, patch: Option<PathBuf>) -> Self {
        Self {
            instance,
            control: None,
            shim_pid: None,
            patch,
            stop: CancellationToken::new(),
            stop_kind: None,
            task: None,
        }
    }
}

#[derive(Default)]
pub(crate) struct SlotState {
    pub main: Option<Live>,
    pub watchdog: Option<Live>,
}

impl SlotState {
    pub fn get(&self, role: Role) -> Option<&Live> {
        match role {
            Role::Main => self.main.as_ref(),
            Role::Watchdog => self.watchdog.as_ref(),
        }
    }
    pub fn get_mut(&mut self, role: Role) -> &mut Option<Live> {
        match role {
            Role::Main => &mut self.main,
            Role::Watchdog => &mut self.watchdog,
        }
    }
}

/// Everything about one user. Slots are created on first use and kept.
pub(crate) struct UserSlot {
    pub user: UserId,
    /// The slug the store recorded for the user (design §9), which names
    /// every path of theirs: never recomputed from the id, so a user whose
    /// data root an earlier slug rule named keeps it.
    pub slug: Slug,
    pub paths: UserPaths,
    /// Serialises lifecycle operations (launch, stop, restart) of this user.
    /// Never taken on the proxy's hot path.
    pub lifecycle: tokio::sync::Mutex<()>,
    /// Keeps two watchdog spawns (explicit and after a crash) apart.
    pub watchdog_lock: tokio::sync::Mutex<()>,
    pub state: Mutex<SlotState>,
    /// Last activity, written by `touch` without any lock.
    pub last_active: AtomicI64,
    /// The last activity time already written to the store.
    pub flushed_active: AtomicI64,
    /// The main's current record, for `wait_for_ready`.
    pub main_watch: watch::Sender<Option<Instance>>,
    /// The user's account, once read from (or allocated in) the store.
    pub account: OnceLock<Account>,
}

impl UserSlot {
    pub fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn record(&self, role: Role) -> Option<Instance> {
        self.lock().get(role).map(|l| l.instance.clone())
    }

    pub fn live_record(&self, role: Role) -> Option<Instance> {
        self.record(role).filter(|i| i.status.is_live())
    }

    pub fn touch(&self, at: i64) {
        self.last_active.fetch_max(at, Ordering::Relaxed);
    }
}

pub(crate) struct Inner {
    pub config: LocalConfig,
    pub store: Arc<dyn Store>,
    pub lease: LeaseKeeper,
    pub slots: RwLock<HashMap<UserId, Arc<UserSlot>>>,
    /// The proxy's route table: only running, ready mains.
    pub routes: RwLock<HashMap<UserId, Endpoint>>,
    pub tokens: RwLock<HashMap<UserId, String>>,
    pub ports: PortPool,
    pub events: broadcast::Sender<InstanceEvent>,
    pub tracker: TaskTracker,
    pub cancel: CancellationToken,
    pub metrics: Metrics,
    /// Mains whose program is frozen, with the epoch they held: frozen by
    /// berth's self-fence deadline, or by the shim's own (reported by its
    /// `Frozen` event or its Hello). A good renew thaws them.
    pub frozen: Mutex<HashMap<UserId, Epoch>>,
    /// What the heartbeat says about this node: `up`, or `draining` when an
    /// operator asked it to take nothing new.
    pub node_status: Mutex<NodeStatus>,
    /// How many mains this node offers to run (the heartbeat's capacity).
    pub capacity: AtomicU32,
    /// One heartbeat at a time, each reading the status when it writes: a
    /// tick's row built before a drain must not land after the drain's.
    pub heartbeat_lock: tokio::sync::Mutex<()>,
    /// Starts every shim (through one zygote process).
    pub shims: ShimLauncher,
    /// What isolates instances; `None` at level `none`.
    pub isolator: Option<Isolator>,
    /// Users whose main is being launched and not yet installed: with the
    /// live mains, what counts against the node's capacity.
    pub launching: Mutex<HashSet<UserId>>,
}

/// A place under the node's capacity, held while a launch runs.
pub(crate) struct Admission<'a> {
    inner: &'a Inner,
    user: UserId,
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        let mut launching = self
            .inner
            .launching
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        launching.remove(&self.user);
    }
}

impl Inner {
    pub fn node(&self) -> &str {
        &self.config.node_id
    }

    /// The user's slot, created (with the slug the store records for the
    /// user, recording it first if need be) on first use. Only the first
    /// use of a user per process asks the store.
    pub async fn slot(&self, user: &UserId) -> Result<Arc<UserSlot>, SpawnError> {
        if let Some(slot) = self.existing_slot(user) {
            return Ok(slot);
        }
        let slug = self.recorded_slug(user).await?;
        let mut slots = self.slots.write().unwrap_or_else(|e| e.into_inner());
        let slot = slots.entry(user.clone()).or_insert_with(|| {
            Arc::new(UserSlot {
                user: user.clone(),
                paths: UserPaths::new(&self.config.data_dir, &slug),
                slug,
                lifecycle: tokio::sync::Mutex::new(()),
                watchdog_lock: tokio::sync::Mutex::new(()),
                state: Mutex::new(SlotState::default()),
                last_active: AtomicI64::new(0),
                flushed_active: AtomicI64::new(0),
                main_watch: watch::channel(None).0,
                account: OnceLock::new(),
            })
        });
        Ok(slot.clone())
    }

    /// The slug the store records for `user`, recorded now if none is.
    ///
    /// The first record chooses (design §9, and the upgrade from 8-hex-digit
    /// slugs) the slug [`Inner::first_slug`] names: an earlier slug whose
    /// data root this node has, else today's [`UserId::slug`]. If another
    /// user already holds that earlier slug (two ids that shared it under
    /// the old rule), the first to be recorded keeps the directory and the
    /// other starts afresh under today's slug. The store decides every
    /// race, between this node's tasks or between nodes.
    pub async fn recorded_slug(&self, user: &UserId) -> Result<Slug, StoreError> {
        if let Some(slug) = self.store.user_slug(user).await? {
            return Ok(slug);
        }
        let today = user.slug();
        let first = self.first_slug(user).await;
        if first != today {
            match self.store.record_user_slug(user, &first).await {
                Ok(slug) => {
                    if slug == first {
                        tracing::info!(%user, slug = %first, "kept the data root of an earlier slug");
                    }
                    return Ok(slug);
                }
                Err(StoreError::SlugTaken { .. }) => {
                    tracing::warn!(%user, slug = %first,
                        "another user holds this earlier slug and its data root; this user gets a new one");
                }
                Err(e) => return Err(e),
            }
        }
        self.store.record_user_slug(user, &today).await
    }

    /// The slug a first record of `user` made on this node asks for,
    /// without recording it: the user's [`UserId::legacy_slug`] if this
    /// node has a data root under it (made by a berth before slugs were
    /// recorded), else today's [`UserId::slug`].
    pub async fn first_slug(&self, user: &UserId) -> Slug {
        let legacy = user.legacy_slug();
        if legacy != user.slug() && self.has_data_root(&legacy).await {
            legacy
        } else {
            user.slug()
        }
    }

    /// The slug that names `user`'s files, if one is recorded (by this
    /// node's slot or in the store); `None` records nothing.
    pub async fn known_slug(&self, user: &UserId) -> Result<Option<Slug>, StoreError> {
        match self.existing_slot(user) {
            Some(slot) => Ok(Some(slot.slug.clone())),
            None => self.store.user_slug(user).await,
        }
    }

    /// Whether `<data_dir>/users/<slug>` is a directory on this node (a
    /// link there is not one: data roots are never reached through links).
    pub async fn has_data_root(&self, slug: &Slug) -> bool {
        let root = self.config.data_dir.join("users").join(slug.as_str());
        tokio::fs::symlink_metadata(root)
            .await
            .is_ok_and(|m| m.is_dir())
    }

    pub fn existing_slot(&self, user: &UserId) -> Option<Arc<UserSlot>> {
        let slots = self.slots.read().unwrap_or_else(|e| e.into_inner());
        slots.get(user).cloned()
    }

    pub fn all_slots(&self) -> Vec<Arc<UserSlot>> {
        let slots = self.slots.read().unwrap_or_else(|e| e.into_inner());
        slots.values().cloned().collect()
    }

    /// Puts `live` in the slot as the current instance of its role.
    pub fn install(&self, slot: &UserSlot, live: Live) {
        let role = live.instance.role;
        let new = live.instance.status;
        let old = {
            let mut state = slot.lock();
            let old = state.get(role).map(|l| l.instance.status);
            *state.get_mut(role) = Some(live);
            old
        };
        self.metrics.transition(role, old, Some(new));
    }

    /// Applies `change` to the current instance of `role` if it is still
    /// instance `id`, then persists and publishes the result.
    pub async fn modify(
        &self,
        slot: &UserSlot,
        role: Role,
        id: &str,
        message: Option<String>,
        change: impl FnOnce(&mut Live),
    ) -> Option<Instance> {
        let (old, instance) = {
            let mut state = slot.lock();
            let live = state
                .get_mut(role)
                .as_mut()
                .filter(|l| l.instance.id == id)?;
            let old = live.instance.status;
            change(live);
            (old, live.instance.clone())
        };
        self.metrics
            .transition(role, Some(old), Some(instance.status));
        self.publish(slot, &instance, message).await;
        Some(instance)
    }

    /// Mirrors `instance` everywhere: first the store (a failure is logged:
    /// memory stays the truth for this node), so that whoever is woken by
    /// the change finds it recorded; then the route table, the ready watch
    /// and the event stream.
    pub async fn publish(&self, slot: &UserSlot, instance: &Instance, message: Option<String>) {
        let stored = if instance.role == Role::Watchdog && instance.status.is_terminal() {
            self.store
                .delete_instance(&instance.user, Role::Watchdog)
                .await
        } else {
            self.store.put_instance(instance).await
        };
        if let Err(e) = stored {
            if let StoreError::Fenced { current_node, .. } = &e {
                // The record belongs to a newer lease. Written by another
                // node, that means this node's lease is lost, whatever the
                // renew tick has seen so far: fence now. Written by this node,
                // this was a stale write of its own, rightly dropped.
                tracing::warn!(user = %instance.user, error = %e, "instance record refused");
                if current_node != self.node() {
                    self.fence_lost(&instance.user);
                }
            } else {
                self.metrics.store_errors.inc();
                tracing::warn!(user = %instance.user, role = %instance.role, error = %e,
                    "could not save the instance record");
            }
        }
        let endpoint = self.refresh_route(instance);
        if instance.role == Role::Main {
            slot.main_watch.send_replace(Some(instance.clone()));
        }
        let _ = self.events.send(InstanceEvent {
            user: instance.user.clone(),
            role: instance.role,
            status: instance.status,
            ready: instance.ready,
            endpoint,
            message,
        });
    }

    /// Updates the route table for a main and returns its endpoint, if it
    /// is reachable.
    pub fn refresh_route(&self, instance: &Instance) -> Option<Endpoint> {
        if instance.role != Role::Main {
            return None;
        }
        let endpoint = match (instance.status, instance.ready, instance.port) {
            (InstanceStatus::Running, true, Some(port)) => Some(Endpoint {
                host: "127.0.0.1".into(),
                port,
            }),
            _ => None,
        };
        {
            let mut routes = self.routes.write().unwrap_or_else(|e| e.into_inner());
            match &endpoint {
                Some(e) => routes.insert(instance.user.clone(), e.clone()),
                None => routes.remove(&instance.user),
            };
        }
        if instance.status.is_terminal() {
            let mut tokens = self.tokens.write().unwrap_or_else(|e| e.into_inner());
            tokens.remove(&instance.user);
        }
        endpoint
    }

    pub fn set_token(&self, user: &UserId, token: Option<String>) {
        let mut tokens = self.tokens.write().unwrap_or_else(|e| e.into_inner());
        match token {
            Some(t) => tokens.insert(user.clone(), t),
            None => tokens.remove(user),
        };
    }

    /// The shim spec that runs `instance` (main or watchdog).
    pub fn shim_spec(
        &self,
        slot: &UserSlot,
        instance: &Instance,
        var_port: u16,
        patch: Option<&Path>,
        account: Option<&Account>,
    ) -> Result<ShimSpec, SpawnError> {
        let (command, extra): (&[String], Vec<(String, String)>) = match instance.role {
            Role::Main => (&self.config.command, Vec::new()),
            Role::Watchdog => (
                self.config
                    .watchdog_command
                    .as_deref()
                    .ok_or_else(|| SpawnError::NotFound {
                        user: slot.user.clone(),
                        what: "watchdog command",
                    })?,
                vec![("BERTH_HANDOFF".into(), path_string(&slot.paths.handoff()))],
            ),
        };
        let cwd = workdir(&slot.paths, &instance.folder);
        let home = slot.paths.home();
        let base_path = LocalConfig::base_path(&slot.user);
        let vars = Vars {
            user: slot.user.as_str().to_owned(),
            slug: slot.slug.as_str().to_owned(),
            port: var_port,
            home: path_string(&home),
            folder: path_string(&cwd),
            patch: patch.map(path_string).unwrap_or_default(),
            base_path: base_path.clone(),
        };
        let berth_vars = [
            ("BERTH_USER", slot.user.as_str().to_owned()),
            ("BERTH_PORT", var_port.to_string()),
            ("BERTH_BASE_PATH", base_path),
            ("BERTH_ROLE", instance.role.as_str().to_owned()),
            ("BERTH_EPOCH", instance.epoch.to_string()),
            ("BERTH_INSTANCE_ID", instance.id.clone()),
            ("HOME", path_string(&home)),
            ("TMPDIR", path_string(&slot.paths.tmp())),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .chain(account.into_iter().flat_map(|a| {
            [
                ("USER".to_owned(), a.name.clone()),
                ("LOGNAME".to_owned(), a.name.clone()),
            ]
        }))
        .chain(extra);
        let env = template::build_env(
            &self.config.env_allowlist,
            template::own_env(),
            &self.config.env,
            berth_vars,
        );
        let ready_regex = match (&self.config.readiness, instance.role) {
            (Readiness::TokenRegex(re), Role::Main) => Some(re.as_str().to_owned()),
            _ => None,
        };
        // The program may run only as long as the lease is proven: until the
        // last successful renew's send time + fence_after, not a fresh
        // fence_after from now (a restart after failed renews would
        // otherwise outlive the lease).
        let fence_ms = (self.config.fence && instance.role == Role::Main).then(|| {
            match self.lease.fence_deadline() {
                Some(deadline) => {
                    millis(deadline.saturating_duration_since(std::time::Instant::now()))
                }
                None => millis(self.config.lease.fence_after()),
            }
        });
        Ok(ShimSpec {
            instance_id: instance.id.clone(),
            user: slot.user.as_str().to_owned(),
            role: instance.role,
            epoch: instance.epoch,
            argv: template::render_command(command, &vars),
            env,
            cwd,
            log_path: slot.paths.log(instance.role),
            state_path: slot.paths.state_file(instance.role),
            socket_path: slot.paths.socket(instance.role),
            ready_regex,
            fence_ms,
            user_root: Some(slot.paths.root.clone()),
            isolation: self.isolation_spec(slot, account),
        })
    }

    /// The isolation part of a shim spec.
    fn isolation_spec(&self, slot: &UserSlot, account: Option<&Account>) -> Option<IsolationSpec> {
        let isolator = self.isolator.as_ref()?;
        let account = account?;
        let limits = self.config.limits;
        Some(IsolationSpec {
            uid: account.uid,
            gid: account.gid,
            name: account.name.clone(),
            limits,
            sandbox: isolator.cgroups.as_ref().map(|parents| SandboxSpec {
                cgroup: CgroupSpec {
                    parents: parents.clone(),
                    limits,
                },
                data_dir: self.config.data_dir.clone(),
                user_root: slot.paths.root.clone(),
                home: slot.paths.home(),
            }),
        })
    }

    /// Takes a place under the node's capacity for a new main of `user`,
    /// or refuses: live mains and launches in flight together never exceed
    /// it, however many launches race.
    pub fn admit(&self, user: &UserId) -> Result<Admission<'_>, SpawnError> {
        let capacity = self.capacity.load(Ordering::Relaxed);
        let live: HashSet<UserId> = self
            .all_slots()
            .iter()
            .filter(|s| s.live_record(Role::Main).is_some())
            .map(|s| s.user.clone())
            .collect();
        let mut launching = self.launching.lock().unwrap_or_else(|e| e.into_inner());
        let used = live.union(&launching).filter(|u| *u != user).count();
        // A capacity of one main per port or more is what the port range
        // enforces anyway (with its own message, naming the range).
        if capacity < self.ports.capacity()
            && used >= usize::try_from(capacity).unwrap_or(usize::MAX)
        {
            return Err(SpawnError::CapacityExhausted(format!(
                "node {} runs {used} instance(s), its capacity ([cluster] capacity) is {capacity}",
                self.node()
            )));
        }
        launching.insert(user.clone());
        Ok(Admission {
            inner: self,
            user: user.clone(),
        })
    }

    /// The account `slot`'s instances run under (`None` at level `none`),
    /// allocated in the store on first use and remembered.
    pub async fn account(&self, slot: &UserSlot) -> Result<Option<Account>, SpawnError> {
        if self.isolator.is_none() {
            return Ok(None);
        }
        if let Some(account) = slot.account.get() {
            return Ok(Some(account.clone()));
        }
        // Keyed by the recorded slug, like every path of the user's: a user
        // who kept an earlier slug keeps that slug's account (and uid).
        let slug = &slot.slug;
        let uid = self
            .store
            .account_uid(slug.as_str(), self.config.uids)
            .await?;
        let account = Account {
            uid,
            gid: uid,
            name: slug.as_str().to_owned(),
        };
        Ok(Some(slot.account.get_or_init(|| account).clone()))
    }

    /// Lets the account connect to its own instance's `port` (port guard).
    pub async fn grant_port(&self, account: Option<&Account>, port: u16) -> Result<(), SpawnError> {
        let (Some(isolator), Some(account)) = (&self.isolator, account) else {
            return Ok(());
        };
        isolator
            .guard
            .grant(account.uid, port)
            .await
            .map_err(|e| SpawnError::SpawnFailed(e.to_string()))
    }

    /// Takes back the port guard's pair on `port`, if any.
    pub async fn revoke_port(&self, port: u16) {
        if let Some(isolator) = &self.isolator {
            if let Err(e) = isolator.guard.revoke(port).await {
                tracing::warn!(port, error = %e, "could not take back a port grant");
            }
        }
    }

    /// Number of live mains, for the node heartbeat.
    pub fn live_mains(&self) -> u32 {
        let count = self
            .all_slots()
            .iter()
            .filter(|s| s.live_record(Role::Main).is_some())
            .count();
        u32::try_from(count).unwrap_or(u32::MAX)
    }

    pub fn now() -> i64 {
        unix_millis_now()
    }
}

pub(crate) fn workdir(paths: &UserPaths, folder: &str) -> PathBuf {
    if folder.is_empty() {
        paths.ws()
    } else {
        paths.ws().join(folder)
    }
}

pub(crate) fn path_string(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

pub(crate) fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The last `MAX_ERROR_CHARS` characters of `text`.
pub(crate) fn error_tail(text: &str) -> String {
    let text = text.trim_end();
    let count = text.chars().count();
    text.chars()
        .skip(count.saturating_sub(MAX_ERROR_CHARS))
        .collect()
}

/// A fresh random instance id.
pub(crate) fn new_instance_id() -> String {
    let mut bytes = [0u8; 12];
    if getrandom::fill(&mut bytes).is_err() {
        // No OS randomness: time plus a counter is still unique per node.
        static COUNTER: AtomicI64 = AtomicI64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        return format!("{:x}-{n:x}", unix_millis_now());
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A random number in `[-1, 1]` for backoff jitter.
pub(crate) fn random_unit() -> f64 {
    match getrandom::u64() {
        Ok(x) => (x as f64 / u64::MAX as f64) * 2.0 - 1.0,
        Err(_) => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_tails_keep_the_end() {
        let long = format!("{}END", "x".repeat(1000));
        let tail = error_tail(&long);
        assert_eq!(tail.chars().count(), MAX_ERROR_CHARS);
        assert!(tail.ends_with("END"));
        assert_eq!(error_tail("short\n"), "short");
        assert_eq!(error_tail(&"é".repeat(600)).chars().count(), 500);
    }

    #[test]
    fn ids_are_unique_and_random_units_bounded() {
        assert_ne!(new_instance_id(), new_instance_id());
        for _ in 0..100 {
            let u = random_unit();
            assert!((-1.0..=1.0).contains(&u));
        }
    }
}
