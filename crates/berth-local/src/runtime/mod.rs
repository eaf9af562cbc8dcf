//! [`LocalRuntime`]: the local runtime. It runs each instance as a
//! program on this host under its own shim, and implements
//! [`berth_core::runtime::Runtime`]: start a spec, stop, kill, freeze,
//! thaw and extend a fence deadline by reference, discover the shims a
//! previous berth left, and read and follow logs.
//!
//! It owns what depends on running programs *here*: the command line and
//! environment ([`crate::template`]), the user's directories
//! ([`crate::paths`]), ports ([`crate::ports`]), readiness probes
//! ([`crate::readiness`], plus the shim's ready regex) and the shims
//! themselves ([`crate::shim`]). It knows nothing of the store, leases or
//! crash policy: the controller decides, this runs.
//!
//! Ports are reserved per *instance id*, from its first start until the
//! controller [`releases`](Runtime::release) it, so a crash restart (same
//! id) can keep the user's endpoint and no other instance is handed the
//! port meanwhile. At levels `user` and `sandbox` each reserved port is
//! also granted, in the port guard, to the account of the user it is
//! reserved for, and to nobody else.

mod accounts;
mod discover;
mod hook;
mod run;
mod spec;

use std::collections::HashMap;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use berth_core::egress::{EgressBook, EgressPolicy};
use berth_core::runtime::{
    Capabilities, Capacity, Discovered, EVENT_BUFFER, HookCall, HookOutcome, InstanceSpec, Runtime,
    RuntimeError, RuntimeRef, Started,
};
use berth_core::{Endpoint, Reach, Role, Slug, UserId};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::isolation::{Account, Isolator, Limits, UidRange, leftovers};
use crate::paths::{UserPaths, check_socket_room, create_private_dir};
use crate::ports::{PortPool, bind_free};
use crate::shim::{ShimCommand, ShimError, ShimLauncher, procfs};
use crate::{Isolation, LocalError};
use berth_core::Readiness;
use berth_core::program::ProgramSettings;

pub use self::accounts::Accounts;
use self::accounts::Isolated;
use self::discover::FoundShim;
use self::run::{Follow, Run, Runs};

/// Everything the local runtime needs: how to run the program, where, on
/// which ports. The controller's settings (crash policy, lease, reaping)
/// are not here.
#[derive(Debug, Clone)]
pub struct LocalRuntimeConfig {
    /// Root of all state: `users/<slug>/…` (user data) and `run/<slug>/…`
    /// (shim sockets and state files, owned by berth).
    pub data_dir: PathBuf,
    /// The program, as every runtime is given it.
    pub program: ProgramSettings,
    /// Names of berth's own environment variables passed through
    /// (e.g. `PATH`, `LANG`).
    pub env_allowlist: Vec<String>,
    /// Ports handed to instances; each checked free before use.
    pub port_range: RangeInclusive<u16>,
    /// The most ports of `port_range` one instance's account may hold (its
    /// own included) once no port is free (levels `user` and `sandbox`).
    pub max_ports: usize,
    /// The most bytes of each instance's log kept on disk (the log and
    /// the file it was last rotated to).
    pub log_max_bytes: u64,
    /// How instances are isolated.
    pub isolation: Isolation,
    /// The host uids of instance accounts (levels `user` and `sandbox`).
    pub uids: UidRange,
    /// Per-instance limits: through the instance's cgroup, and rlimits.
    pub limits: Limits,
    /// berth's own listeners, and how many connections one instance's
    /// account may hold open to them (levels `user` and `sandbox`).
    pub listeners: crate::ListenerCap,
    /// Where instances may connect (levels `user` and `sandbox`; see the
    /// egress guard).
    pub egress: berth_core::egress::EgressPolicy,
    /// The egress proxy's port on loopback, where the guard sends an
    /// instance's connections to the allowed domains' ports; known once
    /// berth has bound it. `None`: no proxy listens, and a policy that
    /// allows a domain is refused.
    pub egress_proxy: Option<u16>,
    /// The host's name servers, which instances reach on port 53 unless
    /// their policy confines them; the binary reads them once, for the
    /// guard and the egress proxy alike.
    pub name_servers: Vec<std::net::IpAddr>,
    /// The `nft` program of the guards; `None`: looked up in `PATH`,
    /// `/usr/sbin` and `/sbin`.
    pub nft: Option<PathBuf>,
    /// The executable and leading arguments that run berth's helper
    /// processes: the shim zygote (which forks every shim) and the guard's
    /// `nft` runner; normally `current_exe()` and `["shim"]`.
    pub shim_command: Vec<String>,
}

impl LocalRuntimeConfig {
    fn check(&self) -> Result<(), LocalError> {
        if self.shim_command.is_empty() {
            return Err(LocalError::Config("the shim command is empty".into()));
        }
        self.validate()
            .map_err(|e| LocalError::Config(e.to_string()))
    }
}

/// How long a start waits for the ports of the instances it killed for
/// holding too many to be free.
const PORT_HOG_GRACE: Duration = Duration::from_secs(5);

/// What [`LocalRuntime::reserve_port`] gave a start.
struct Reserved {
    port: u16,
    /// Reserved just now (to be given back if the start fails).
    new: bool,
    /// Ports given up on the way, whose guard grants go too.
    given_up: Vec<u16>,
}

/// A port kept for one instance id across its runs.
#[derive(Debug, Clone)]
struct Reservation {
    /// The user's slug (the name of its directories).
    slug: String,
    port: u16,
}

/// Runs users' instances as local programs under shims. See the module
/// docs.
pub struct LocalRuntime {
    config: LocalRuntimeConfig,
    shims: ShimLauncher,
    ports: PortPool,
    /// Instance id → its port (mains only).
    reservations: Mutex<HashMap<String, Reservation>>,
    /// The runs this runtime follows, by reference.
    runs: Runs,
    /// What the last [`Runtime::discover`] found and has not been adopted
    /// or removed yet.
    found: Mutex<HashMap<RuntimeRef, FoundShim>>,
    /// Accounts and the port guard; `None` at level `none`.
    isolated: Option<Isolated>,
    tracker: TaskTracker,
    cancel: CancellationToken,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A run's reference: its program's pid and start time, which together
/// never name another process.
fn ref_of(pid: u32, pid_start: u64) -> RuntimeRef {
    RuntimeRef::new(format!("pid {pid} start {pid_start}"))
}

fn spawn_failed(e: ShimError) -> RuntimeError {
    match e {
        ShimError::SpawnFailed(message) => RuntimeError::SpawnFailed(message),
        other => RuntimeError::SpawnFailed(other.to_string()),
    }
}

impl LocalRuntime {
    /// Removes the nftables tables and cgroup parents that other berths
    /// of this host left behind and no instance needs (see
    /// [`crate::isolation::leftovers`]): as root, where `nft` is found.
    /// `in_use` tells whether a live process holds a data dir's lock.
    /// Returns the tables removed.
    pub async fn sweep_leftovers(
        &self,
        in_use: &(dyn Fn(&Path) -> bool + Sync),
    ) -> Result<Vec<String>, LocalError> {
        let nft = crate::isolation::resolve_nft(self.config.nft.as_deref());
        let Some(nft) = nft.filter(|_| nix::unistd::geteuid().is_root()) else {
            return Ok(Vec::new());
        };
        let own = crate::isolation::nft_table_name(&self.config.data_dir);
        Ok(leftovers::sweep(&nft, &own, in_use)
            .await
            .map_err(crate::isolation::HostError::from)?)
    }

    /// Checks the settings, prepares the data dir and, at levels `user`
    /// and `sandbox`, the host (the guards' table, the cgroup parents: see
    /// [`crate::isolation`]); `accounts` gives each user's uid there.
    /// Starts no program: the shim zygote is started on the first launch.
    pub async fn new(
        mut config: LocalRuntimeConfig,
        accounts: Option<Arc<dyn Accounts>>,
    ) -> Result<Arc<LocalRuntime>, LocalError> {
        config.check()?;
        let io = |path: &std::path::Path| {
            let path = path.to_owned();
            move |source| LocalError::Io { path, source }
        };
        std::fs::create_dir_all(&config.data_dir).map_err(io(&config.data_dir))?;
        // Absolute from here on: a sandbox mounts over these paths.
        config.data_dir = std::fs::canonicalize(&config.data_dir).map_err(io(&config.data_dir))?;
        check_socket_room(&config.data_dir).map_err(LocalError::Config)?;
        // Instances found running get their users' own policies in the
        // same transaction that makes the table: none runs on with more
        // reach for a moment.
        let own_egress = match &accounts {
            Some(accounts) if config.isolation != Isolation::None => {
                accounts.all_egress().await.map_err(|e| {
                    LocalError::Config(format!("cannot read the users' egress policies: {e}"))
                })?
            }
            _ => Vec::new(),
        };
        let own: Vec<(u32, EgressPolicy)> = own_egress
            .iter()
            .map(|(uid, _, policy)| (*uid, policy.clone()))
            .collect();
        let isolator = Isolator::prepare(&config, &own).await?;
        let isolated = match (isolator, accounts) {
            (None, _) => {
                tracing::debug!("instances are not isolated (level none)");
                None
            }
            (Some(isolator), Some(accounts)) => {
                tracing::info!(level = %isolator.level,
                    table = %format!("inet {}", isolator.guard.table()),
                    cgroups = ?isolator.cgroups.as_ref().map(|p| p.dirs()),
                    "instances are isolated");
                let book = Arc::new(EgressBook::new(config.egress.clone()));
                for (uid, slug, policy) in own_egress {
                    book.set(uid, &slug, Some(policy));
                }
                Some(Isolated::new(isolator, book, accounts, config.uids))
            }
            (Some(isolator), None) => {
                return Err(LocalError::Config(format!(
                    "isolation level {} needs the accounts of users, and none were given",
                    isolator.level
                )));
            }
        };
        // Private to berth; at levels with accounts, others may pass
        // through (not list) the data dir and `users/` to reach their own
        // roots, which are theirs and 0700.
        let shared = if isolated.is_some() { 0o711 } else { 0o700 };
        for (dir, mode) in [
            (config.data_dir.clone(), shared),
            (config.data_dir.join("users"), shared),
            (config.data_dir.join("run"), 0o700),
        ] {
            use std::os::unix::fs::PermissionsExt;
            create_private_dir(&dir).map_err(io(&dir))?;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode))
                .map_err(io(&dir))?;
        }
        let shims = {
            let mut parts = config.shim_command.iter().cloned();
            let exe = parts.next().unwrap_or_default();
            ShimLauncher::new(exe, parts.collect())
        };
        Ok(Arc::new(LocalRuntime {
            ports: PortPool::new(config.port_range.clone()),
            config,
            shims,
            reservations: Mutex::new(HashMap::new()),
            runs: Runs::default(),
            found: Mutex::new(HashMap::new()),
            isolated,
            tracker: TaskTracker::new(),
            cancel: CancellationToken::new(),
        }))
    }

    /// Each instance account's egress policy, which the egress proxy
    /// checks; `None` at level `none`, where berth guards no egress.
    pub fn egress_book(&self) -> Option<Arc<EgressBook>> {
        self.isolated.as_ref().map(|i| i.book.clone())
    }

    /// The parents of instance cgroups, when instances get cgroups.
    fn cgroup_parents(&self) -> Option<&crate::isolation::cgroup::Parents> {
        self.isolated.as_ref()?.isolator.cgroups.as_ref()
    }

    fn paths(&self, slug: &Slug) -> UserPaths {
        UserPaths::new(&self.config.data_dir, slug)
    }

    fn no_free_port(&self) -> RuntimeError {
        let r = self.ports.range();
        RuntimeError::CapacityExhausted(format!("no free port in {}-{}", r.start(), r.end()))
    }

    /// The port `spec` (a main) runs on, and whether it was reserved just
    /// now (to be given back if the start fails). A crash restart keeps its
    /// instance's port when its hint names it and it is still free. Ports
    /// given up on the way (stale, or replaced) are returned, for their
    /// guard grants to be taken back.
    fn reserve_port(&self, spec: &InstanceSpec) -> Result<Reserved, RuntimeError> {
        let mut reservations = lock(&self.reservations);
        // One main per user on this node: a reservation left by another
        // instance of the same user is stale (that instance was replaced).
        let stale: Vec<String> = reservations
            .iter()
            .filter(|(id, r)| r.slug == spec.slug.as_str() && **id != spec.instance_id)
            .map(|(id, _)| id.clone())
            .collect();
        let mut given_up = Vec::new();
        for id in stale {
            if let Some(r) = reservations.remove(&id) {
                self.ports.release(r.port);
                given_up.push(r.port);
            }
        }
        let own = reservations.get(&spec.instance_id).map(|r| r.port);
        if let Some(own) = own.filter(|p| spec.port_hint == Some(*p) && bind_free(*p)) {
            return Ok(Reserved {
                port: own,
                new: false,
                given_up,
            });
        }
        // A new instance, or one whose port is held by some other process
        // now, or which asked for a fresh one.
        let hint = spec.port_hint.filter(|p| Some(*p) != own);
        let port = self
            .ports
            .allocate(hint)
            .ok_or_else(|| self.no_free_port())?;
        if let Some(own) = own {
            self.ports.release(own);
            given_up.push(own);
        }
        reservations.insert(
            spec.instance_id.clone(),
            Reservation {
                slug: spec.slug.as_str().to_owned(),
                port,
            },
        );
        Ok(Reserved {
            port,
            new: own.is_none(),
            given_up,
        })
    }

    /// Kills every instance whose account holds more than `max_ports`
    /// ports of the instance range (levels `user` and `sandbox`), and
    /// waits (a bounded time) for their ports to be free. Whether it found
    /// any. Asked when no port is free: an instance may listen on ports of
    /// the range besides its own, but not take so many that no one else
    /// can start. No kernel hook refuses a bind by count, so the cap is
    /// enforced where it matters, at the next start that needs a port.
    async fn stop_port_hogs(&self) -> bool {
        if self.isolated.is_none() {
            return false;
        }
        let (range, uids, cap) = (
            self.config.port_range.clone(),
            self.config.uids,
            self.config.max_ports,
        );
        let hogs = move || crate::ports::port_hogs(&range, uids, cap);
        let found = tokio::task::spawn_blocking(hogs.clone())
            .await
            .unwrap_or_default();
        if found.is_empty() {
            return false;
        }
        for &(uid, held) in &found {
            let runs = self.runs.of_uid(uid);
            tracing::warn!(
                uid,
                held,
                max_ports = cap,
                runs = runs.len(),
                "an instance holds more ports of the instance range than max_ports; killing it"
            );
            for run in &runs {
                if let Err(e) = self.ending(run, ShimCommand::Kill).await {
                    tracing::warn!(%run, error = %e, "could not kill an instance holding ports");
                }
            }
            if runs.is_empty() {
                // Processes of an account no run of this berth follows.
                let _ = tokio::task::spawn_blocking(move || crate::isolation::sweep::kill_all(uid))
                    .await;
            }
        }
        // Their sockets close as their processes die.
        let deadline = tokio::time::Instant::now() + PORT_HOG_GRACE;
        loop {
            let left = tokio::task::spawn_blocking(hogs.clone())
                .await
                .unwrap_or_default();
            if !left
                .iter()
                .any(|(uid, _)| found.iter().any(|(u, _)| u == uid))
                || tokio::time::Instant::now() > deadline
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Gives `instance_id`'s port up, and its guard grant.
    async fn unreserve(&self, instance_id: &str) {
        let released = lock(&self.reservations).remove(instance_id);
        if let Some(r) = released {
            self.ports.release(r.port);
            self.revoke(&[r.port]).await;
        }
    }

    async fn revoke(&self, ports: &[u16]) {
        if let Some(isolated) = &self.isolated {
            for port in ports {
                isolated.revoke(*port).await;
            }
        }
    }

    /// The account `slug`'s programs run under; `None` at level `none`.
    async fn account(&self, slug: &Slug) -> Result<Option<Account>, RuntimeError> {
        match &self.isolated {
            Some(isolated) => isolated.account(slug).await.map(Some),
            None => Ok(None),
        }
    }

    /// Reserves `port` for an instance found running (or ended) at start.
    fn reserve_found(&self, instance_id: &str, slug: &str, port: u16) {
        let mut reservations = lock(&self.reservations);
        if reservations.contains_key(instance_id) {
            return;
        }
        self.ports.reserve(port);
        reservations.insert(
            instance_id.to_owned(),
            Reservation {
                slug: slug.to_owned(),
                port,
            },
        );
    }

    /// The port of `slug`'s main, if one is reserved: a watchdog's `{port}`.
    fn main_port_of(&self, slug: &Slug) -> Option<u16> {
        lock(&self.reservations)
            .values()
            .find(|r| r.slug == slug.as_str())
            .map(|r| r.port)
    }

    /// How a main is probed for readiness here, if it is probed at all
    /// (the token regex is matched by the shim instead).
    fn probe_for(&self, role: Role) -> Option<Readiness> {
        match (&self.config.program.readiness, role) {
            (Readiness::TokenRegex(_), _) | (_, Role::Watchdog) => None,
            (readiness, Role::Main) => Some(readiness.clone()),
        }
    }

    /// Follows a run: registers it and starts the task that turns its
    /// shim's events (and readiness probes) into [`RuntimeEvent`]s.
    ///
    /// [`RuntimeEvent`]: berth_core::runtime::RuntimeEvent
    fn follow(
        &self,
        follow: Follow,
        run: Run,
    ) -> mpsc::Receiver<berth_core::runtime::RuntimeEvent> {
        self.runs.insert(follow.runtime_ref.clone(), run);
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let runs = self.runs.clone();
        let cancel = self.cancel.child_token();
        self.tracker
            .spawn(async move { run::pump(follow, tx, runs, cancel).await });
        rx
    }

    async fn start_reserved(
        &self,
        spec: &InstanceSpec,
        port: Option<u16>,
        account: Option<&Account>,
    ) -> Result<Started, RuntimeError> {
        let paths = self.paths(&spec.slug);
        let var_port = port.or_else(|| self.main_port_of(&spec.slug)).unwrap_or(0);
        let prepare = spec::prepare(&paths, &self.config.program.patch_ext, spec, account);
        // The port grant (an `nft` run) goes alongside the preparation, and
        // is done before the program runs, so it can always reach its own
        // port.
        let grant = async {
            match (&self.isolated, account, port) {
                (Some(isolated), Some(account), Some(port)) => isolated.grant(account, port).await,
                _ => Ok(()),
            }
        };
        let (granted, patch) = tokio::join!(grant, prepare);
        granted?;
        let patch = patch?;
        let isolation = self
            .isolated
            .as_ref()
            .zip(account)
            .map(|(isolated, account)| {
                spec::isolation_spec(&isolated.isolator, &self.config, &paths, account)
            });
        let shim_spec = spec::shim_spec(
            &self.config,
            spec,
            &paths,
            spec::Placement {
                var_port,
                own_port: port,
                patch,
                account,
                isolation,
            },
        )?;
        let (handle, state) = self.shims.spawn(&shim_spec).await.map_err(spawn_failed)?;
        let runtime_ref = ref_of(state.pid, state.pid_start);
        let by_regex = shim_spec.ready_regex.is_some();
        // Isolated, the program runs as its account: only a socket of that
        // account's is the instance (or, in a sandbox, any socket of its own
        // network namespace).
        let reach = reach_of(
            state.shim_pid,
            self.isolated.as_ref().and(account).map(|a| a.uid),
        );
        let run = Run {
            control: handle.control(),
            pid: state.pid,
            pid_start: state.pid_start,
            shim_pid: state.shim_pid,
            uid: account.map(|a| a.uid),
            state_path: shim_spec.state_path.clone(),
            port,
            reach: reach.clone(),
        };
        let follow = Follow {
            handle,
            state_path: shim_spec.state_path,
            instance_id: spec.instance_id.clone(),
            runtime_ref: runtime_ref.clone(),
            port,
            reach: reach.clone(),
            probe: self.probe_for(spec.role),
            by_regex,
            ready: by_regex && state.ready,
            token: state.token,
            frozen: false,
        };
        let events = self.follow(follow, run);
        Ok(Started {
            runtime_ref,
            pid: Some(state.pid),
            endpoint: port.map(|port| local_endpoint(port, reach.clone())),
            events,
        })
    }

    /// The run `instance` names, if this runtime follows it.
    fn run_of(&self, instance: &RuntimeRef) -> Result<Run, RuntimeError> {
        self.runs
            .get(instance)
            .ok_or_else(|| RuntimeError::Gone(instance.clone()))
    }

    /// Sends `command` to the run's shim.
    async fn command(
        &self,
        instance: &RuntimeRef,
        command: ShimCommand,
    ) -> Result<(), RuntimeError> {
        let run = self.run_of(instance)?;
        run.control.send(command).await.map_err(|e| match e {
            // The shim has exited, so the instance has ended: its exit is
            // on its way as an event.
            ShimError::Gone(_) => RuntimeError::Gone(instance.clone()),
            e => RuntimeError::Failed(format!("the shim of {instance} does not answer: {e}")),
        })
    }
}

impl LocalRuntime {
    /// Sends a command that ends the run; a shim that does not take it has
    /// the run killed directly (by pid and start time, never a reused pid).
    async fn ending(
        &self,
        instance: &RuntimeRef,
        command: ShimCommand,
    ) -> Result<(), RuntimeError> {
        match self.command(instance, command).await {
            Err(RuntimeError::Gone(_)) if self.run_of(instance).is_ok() => {
                // The shim is gone but the run is still on the books: make
                // sure of the end (by pid and start time), as below.
                tracing::warn!(%instance, "the shim has exited; killing directly");
                self.run_of(instance)?.kill_directly();
                Ok(())
            }
            Err(RuntimeError::Failed(why)) => {
                tracing::warn!(%instance, %why, "the shim did not take the command; killing directly");
                self.run_of(instance)?.kill_directly();
                Ok(())
            }
            other => other,
        }
    }
}

/// How a main whose shim is `shim_pid` is reached: inside the shim's
/// network namespace when it is not berth's own (a sandbox's, where only
/// the instance's own programs listen), else on berth's loopback through
/// a socket of the instance's account (`account_uid`), when it has one.
fn reach_of(shim_pid: u32, account_uid: Option<u32>) -> Reach {
    use std::os::unix::fs::MetadataExt;
    // berth's own namespace never changes: read once.
    static OURS: std::sync::OnceLock<Option<(u64, u64)>> = std::sync::OnceLock::new();
    let theirs = PathBuf::from(format!("/proc/{shim_pid}/ns/net"));
    let namespace = |path: &Path| std::fs::metadata(path).map(|m| (m.dev(), m.ino())).ok();
    let ours = *OURS.get_or_init(|| namespace(Path::new("/proc/self/ns/net")));
    match (namespace(&theirs), ours) {
        (Some(theirs_id), Some(ours)) if theirs_id != ours => Reach {
            owner: None,
            netns: Some(theirs),
        },
        _ => Reach {
            owner: account_uid,
            netns: None,
        },
    }
}

/// Where a main listens, and how it is reached ([`reach_of`]).
fn local_endpoint(port: u16, reach: Reach) -> Endpoint {
    Endpoint {
        host: "127.0.0.1".into(),
        port,
        reach,
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[async_trait]
impl Runtime for LocalRuntime {
    fn name(&self) -> &'static str {
        "local"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            freeze: true,
            fence_deadline: true,
            exec: true,
            egress: self.isolated.is_some(),
            egress_names: self.isolated.is_some(),
        }
    }

    fn capacity(&self) -> Option<Capacity> {
        let r = self.ports.range();
        Some(Capacity {
            instances: self.ports.capacity(),
            reason: format!("one per port of {}-{}", r.start(), r.end()),
        })
    }

    async fn start(&self, spec: InstanceSpec) -> Result<Started, RuntimeError> {
        if self.cancel.is_cancelled() {
            return Err(RuntimeError::Failed(
                "the local runtime is shutting down; nothing new is started".into(),
            ));
        }
        if berth_core::normalize_folder(Some(&spec.folder)).as_deref() != Ok(spec.folder.as_str()) {
            return Err(RuntimeError::SpawnFailed(format!(
                "folder {:?} is not a normalised path inside the workspace",
                spec.folder
            )));
        }
        let account = self.account(&spec.slug).await?;
        // The policy the controller read for this start: an instance never
        // runs with more reach than its user was given, even by another node.
        if let (Some(isolated), Some(account)) = (&self.isolated, &account) {
            isolated.set_egress(account, spec.egress.clone()).await?;
        }
        let reserved = match spec.role {
            Role::Main => Some(match self.reserve_port(&spec) {
                // Every port taken: by instances holding more than their
                // share, perhaps, which are stopped to free them.
                Err(RuntimeError::CapacityExhausted(why)) => {
                    if !self.stop_port_hogs().await {
                        return Err(RuntimeError::CapacityExhausted(why));
                    }
                    self.reserve_port(&spec)?
                }
                other => other?,
            }),
            Role::Watchdog => None,
        };
        if let Some(reserved) = &reserved {
            self.revoke(&reserved.given_up).await;
        }
        let started = self
            .start_reserved(&spec, reserved.as_ref().map(|r| r.port), account.as_ref())
            .await;
        if started.is_err() && reserved.is_some_and(|r| r.new) {
            self.unreserve(&spec.instance_id).await;
        }
        started
    }

    async fn stop(&self, instance: &RuntimeRef, grace: Duration) -> Result<(), RuntimeError> {
        let grace_ms = millis(grace);
        self.ending(instance, ShimCommand::Stop { grace_ms }).await
    }

    async fn kill(&self, instance: &RuntimeRef) -> Result<(), RuntimeError> {
        self.ending(instance, ShimCommand::Kill).await
    }

    async fn freeze(&self, instance: &RuntimeRef) -> Result<(), RuntimeError> {
        self.command(instance, ShimCommand::Freeze).await
    }

    async fn thaw(&self, instance: &RuntimeRef) -> Result<(), RuntimeError> {
        self.command(instance, ShimCommand::Thaw).await
    }

    async fn extend_fence(
        &self,
        instance: &RuntimeRef,
        left: Duration,
    ) -> Result<(), RuntimeError> {
        let ms = millis(left);
        self.command(instance, ShimCommand::Extend { ms }).await
    }

    async fn run_hook(
        &self,
        instance: &RuntimeRef,
        call: &HookCall,
    ) -> Result<HookOutcome, RuntimeError> {
        hook::run_hook(instance, &self.run_of(instance)?, call).await
    }

    async fn set_egress(
        &self,
        user: &UserId,
        slug: &Slug,
        policy: Option<&EgressPolicy>,
    ) -> Result<(), RuntimeError> {
        let Some(isolated) = &self.isolated else {
            return Err(self.unsupported("guard egress at isolation level none"));
        };
        let account = isolated.account(slug).await?;
        tracing::info!(%user, uid = account.uid, policy = ?policy, "egress policy changed");
        isolated.set_egress(&account, policy.cloned()).await
    }

    async fn release(&self, instance_id: &str) {
        self.unreserve(instance_id).await;
    }

    async fn has_data(&self, slug: &Slug) -> bool {
        // A link there is not a data root: they are never reached through
        // links.
        tokio::fs::symlink_metadata(&self.paths(slug).root)
            .await
            .is_ok_and(|m| m.is_dir())
    }

    async fn discover(&self) -> Result<Vec<Discovered>, RuntimeError> {
        let shims = discover::scan(self.config.data_dir.join("run")).await;
        // Instance cgroups no running shim uses are left by shims killed
        // before they could remove them.
        if let Some(parents) = self.cgroup_parents() {
            let keep: std::collections::HashSet<String> = shims
                .iter()
                .filter(|s| s.running)
                .filter_map(|s| s.state.as_ref())
                .filter_map(discover::cgroup_leaf)
                .collect();
            let parents = parents.clone();
            // A shim's pid, read from its cgroup's name: a pid reused since
            // counts as alive, which only leaves its cgroup in place.
            let removal = tokio::task::spawn_blocking(move || {
                crate::isolation::cgroup::remove_stale(&parents, &keep, procfs::exists)
            });
            for (dir, e) in removal.await.unwrap_or_default() {
                tracing::warn!(dir = %dir.display(), error = %e, "a stale instance cgroup remains");
            }
        }
        let mut out = Vec::with_capacity(shims.len());
        // The account each live main runs as, as its shim recorded it, and
        // its port: granted again below, all at once.
        let mut grants = Vec::new();
        {
            let mut found = lock(&self.found);
            for shim in shims {
                let discovered = shim.describe();
                if let Some(state) = &shim.state
                    && let Some(port) = state.port.filter(|_| state.role == Role::Main)
                {
                    self.reserve_found(&state.instance_id, &shim.dir_slug, port);
                    if let Some(uid) = state.uid.filter(|_| discovered.alive) {
                        grants.push((uid, port));
                    }
                }
                found.insert(discovered.runtime_ref.clone(), shim);
                out.push(discovered);
            }
        }
        if let Some(isolated) = &self.isolated
            && !grants.is_empty()
        {
            if let Err(e) = isolated.isolator.guard.queue_grants(&grants).await {
                tracing::warn!(error = %e, "could not queue the found instances' port grants");
            }
            isolated.read_all_accounts().await;
        }
        Ok(out)
    }

    async fn adopt(&self, found: &Discovered) -> Result<Started, RuntimeError> {
        let shim = lock(&self.found).remove(&found.runtime_ref);
        let Some(shim) = shim.filter(|shim| shim.state.is_some()) else {
            return Err(RuntimeError::Gone(found.runtime_ref.clone()));
        };
        let Ok((handle, state)) = shim.attach(self.cgroup_parents()).await else {
            return Err(RuntimeError::Gone(found.runtime_ref.clone()));
        };
        let state_path = shim.state_path;
        let by_regex = state.role == Role::Main
            && matches!(self.config.program.readiness, Readiness::TokenRegex(_));
        let port = state.port.filter(|_| state.role == Role::Main);
        // The guard's table was made afresh at start: the adopted instance
        // gets its own port back. `discover` queued the grant already, so
        // this waits for it (a no-op when it was made) and reports it.
        let account = match (&self.isolated, &found.user) {
            (Some(isolated), Some(user)) => Some(isolated.account(&user.slug()).await),
            _ => None,
        };
        if let (Some(isolated), Some(Ok(account))) = (&self.isolated, &account) {
            isolated.book.name(account.uid, &account.name);
        }
        if let (Some(isolated), Some(port), Some(account), Some(user)) =
            (&self.isolated, port, &account, &found.user)
        {
            let granted = match account {
                Ok(account) => isolated.grant(account, port).await,
                Err(e) => Err(e.clone()),
            };
            if let Err(e) = granted {
                tracing::warn!(%user, error = %e, "could not give an adopted instance its port back");
            }
        }
        // The account its program runs as, as the shim recorded it.
        let reach = reach_of(state.shim_pid, self.isolated.as_ref().and(state.uid));
        let run = Run {
            control: handle.control(),
            pid: state.pid,
            pid_start: state.pid_start,
            shim_pid: state.shim_pid,
            uid: account.and_then(Result::ok).map(|a| a.uid),
            state_path: state_path.clone(),
            port,
            reach: reach.clone(),
        };
        let follow = Follow {
            handle,
            state_path,
            instance_id: state.instance_id.clone(),
            runtime_ref: found.runtime_ref.clone(),
            port,
            reach: reach.clone(),
            probe: self.probe_for(state.role),
            by_regex,
            ready: by_regex && state.ready,
            token: state.token.clone(),
            frozen: state.frozen,
        };
        let events = self.follow(follow, run);
        Ok(Started {
            runtime_ref: found.runtime_ref.clone(),
            pid: Some(state.pid),
            endpoint: port.map(|port| local_endpoint(port, reach.clone())),
            events,
        })
    }

    async fn remove(&self, found: &Discovered) -> Result<(), RuntimeError> {
        let shim = lock(&self.found).remove(&found.runtime_ref);
        let Some(shim) = shim else {
            return Err(RuntimeError::Gone(found.runtime_ref.clone()));
        };
        if let Some(state) = &shim.state
            && lock(&self.reservations)
                .get(&state.instance_id)
                .is_some_and(|r| r.slug == shim.dir_slug)
        {
            self.unreserve(&state.instance_id).await;
        }
        shim.remove(self.cgroup_parents()).await;
        Ok(())
    }

    async fn logs(
        &self,
        slug: &Slug,
        role: Role,
        tail: usize,
    ) -> Result<Vec<String>, RuntimeError> {
        // Read as root from the user's own root: never through a link the
        // user put there (it could point at any file of the host's).
        let paths = self.paths(slug);
        let read = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<String>> {
            let tail_of = |open: std::io::Result<std::fs::File>, n| match open {
                Ok(mut file) => crate::logs::tail_lines(&mut file, n),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
                Err(e) => Err(e),
            };
            let mut lines = tail_of(paths.open_log(role), tail)?;
            // Just after a rotation the log is short: the lines before are
            // in the rotated file, and come first.
            if lines.len() < tail {
                let mut earlier = tail_of(paths.open_rotated_log(role), tail - lines.len())?;
                earlier.append(&mut lines);
                lines = earlier;
            }
            Ok(lines)
        })
        .await
        .map_err(|e| RuntimeError::Failed(format!("the log reader failed: {e}")))?;
        read.map_err(|e| RuntimeError::Failed(format!("cannot read the log: {e}")))
    }

    async fn follow_logs(
        &self,
        slug: &Slug,
        role: Role,
        tail: usize,
    ) -> Result<mpsc::Receiver<String>, RuntimeError> {
        // Like `logs`: never through a link the user put in their root.
        let paths = self.paths(slug);
        let open: crate::follow::Opener = Arc::new(move || paths.open_log(role));
        crate::follow::follow(open, tail, &self.tracker, self.cancel.child_token())
            .await
            .map_err(|e| RuntimeError::Failed(format!("cannot read the log: {e}")))
    }

    async fn shutdown(&self) {
        self.cancel.cancel();
        self.tracker.close();
        self.tracker.wait().await;
        self.shims.shutdown().await;
        if let Some(isolated) = &self.isolated {
            let isolator = &isolated.isolator;
            // Found but not yet adopted counts too: those shims run.
            let runs_left = self.runs.len() + lock(&self.found).len();
            leftovers::remove_own(&isolator.guard, isolator.cgroups.as_ref(), runs_left).await;
        }
    }
}

impl Drop for LocalRuntime {
    fn drop(&mut self) {
        // The event pumps hold no reference to the runtime, but they would
        // keep following shims nobody listens to.
        self.cancel.cancel();
    }
}
