//! Discovery at start: the shims a previous berth left under
//! `<data_dir>/run/<slug>/<role>.json`. Listing reads their state files
//! only; each is attached to in its own user's adoption step, so one
//! slow shim holds up its own user and no other.

use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_core::runtime::{Discovered, ExitStatus, OutOfMemory, RuntimeRef};
use berth_core::{Role, UserId};

use crate::isolation::cgroup::{self, Parents};
use crate::shim::{ShimCommand, ShimError, ShimHandle, ShimState, procfs};

/// How long [`FoundShim::remove`] waits for a killed shim to go.
const REMOVE_WAIT: Duration = Duration::from_secs(5);

/// How long a found shim may take to greet berth before it is killed (see
/// [`ShimError::Silent`]). Generous, because only its own user waits
/// meanwhile (on the starting page), and killing it costs that user's
/// program its memory.
const GREETING_PATIENCE: Duration = Duration::from_secs(30);

/// [`GREETING_PATIENCE`] for a shim adoption ends anyway: removals come
/// before every user's adoption, so a silent one would hold up them all.
const REMOVAL_PATIENCE: Duration = Duration::from_secs(5);

/// A shim state file found on disk.
pub(super) struct FoundShim {
    /// The directory it was found in.
    pub dir_slug: String,
    pub role: Role,
    pub state_path: PathBuf,
    /// `None` when the state file could not be read.
    pub state: Option<ShimState>,
    /// Whether its shim runs, as far as [`ShimHandle::check_running`]
    /// tells without asking it.
    pub running: bool,
}

/// Every shim state file under `run_dir`, in the order of their
/// directories' names.
pub(super) async fn scan(run_dir: PathBuf) -> Vec<FoundShim> {
    tokio::task::spawn_blocking(move || scan_now(&run_dir))
        .await
        .unwrap_or_default()
}

fn scan_now(run_dir: &Path) -> Vec<FoundShim> {
    let Ok(entries) = std::fs::read_dir(run_dir) else {
        return Vec::new();
    };
    let mut dirs: Vec<(String, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| Some((e.file_name().into_string().ok()?, e.path())))
        .collect();
    dirs.sort();
    let files: Vec<(String, Role, PathBuf)> = dirs
        .into_iter()
        .flat_map(|(slug, dir)| {
            [Role::Main, Role::Watchdog].map(|role| {
                let state_path = dir.join(format!("{}.json", role.as_str()));
                (slug.clone(), role, state_path)
            })
        })
        .filter(|(_, _, state_path)| state_path.exists())
        .collect();
    files
        .into_iter()
        .map(|(dir_slug, role, state_path)| {
            let state = ShimHandle::read_state(&state_path).ok();
            let running = state
                .as_ref()
                .is_some_and(|state| ShimHandle::check_running(state).is_ok());
            FoundShim {
                dir_slug,
                role,
                state_path,
                state,
                running,
            }
        })
        .collect()
}

impl FoundShim {
    /// A reference for a state file that names no run (unreadable): unique
    /// per file, and never equal to a run's.
    fn unreadable_ref(&self) -> RuntimeRef {
        RuntimeRef::new(format!("unreadable {}", self.state_path.display()))
    }

    pub fn describe(&self) -> Discovered {
        let Some(state) = &self.state else {
            return Discovered {
                user: None,
                slug: self.dir_slug.clone(),
                role: self.role,
                instance_id: String::new(),
                epoch: 0,
                runtime_ref: self.unreadable_ref(),
                alive: false,
                frozen: false,
                ready: false,
                token: None,
                exit: None,
            };
        };
        Discovered {
            user: UserId::parse(&state.user).ok(),
            slug: self.dir_slug.clone(),
            // The file's name and its content must agree; a state file that
            // says otherwise is not trusted with either role.
            role: self.role,
            instance_id: state.instance_id.clone(),
            epoch: state.epoch,
            runtime_ref: super::ref_of(state.pid, state.pid_start),
            alive: self.running && state.role == self.role,
            frozen: state.frozen,
            ready: state.ready,
            token: state.token.clone(),
            exit: state.exit.map(|exit| ExitStatus {
                code: exit.code,
                signal: exit.signal,
                stderr_tail: state.stderr_tail.clone(),
                out_of_memory: exit.oom_limit_mb.map(|limit_mb| OutOfMemory { limit_mb }),
                port_in_use: false,
            }),
        }
    }

    /// Connects to the shim. One that stays silent is killed, and what it
    /// leaves (its files, and its cgroup with anything still in it, or
    /// without a cgroup every process of its account) is removed: berth
    /// cannot supervise it, and the user's next instance must not start
    /// beside it.
    pub async fn attach(
        &self,
        cgroups: Option<&Parents>,
    ) -> Result<(ShimHandle, ShimState), ShimError> {
        self.attach_within(cgroups, GREETING_PATIENCE).await
    }

    async fn attach_within(
        &self,
        cgroups: Option<&Parents>,
        patience: Duration,
    ) -> Result<(ShimHandle, ShimState), ShimError> {
        let attached = ShimHandle::attach_within(&self.state_path, patience).await;
        if let Err(e @ ShimError::Silent(_)) = &attached {
            tracing::warn!(path = %self.state_path.display(), error = %e,
                "a found shim did not answer");
            self.remove_leftovers(cgroups);
            self.sweep_account().await;
        }
        attached
    }

    /// Kills every process of a silent shim's account when it recorded no
    /// cgroup (level `user` on a host that gives instances none): its
    /// program dies with it, but what the program moved into a session of
    /// its own (`setsid`) does not, and the account is then the only hold
    /// on it. At this level the account is the user's alone.
    async fn sweep_account(&self) {
        let Some(uid) = self
            .state
            .as_ref()
            .filter(|state| state.cgroup.is_empty())
            .and_then(|state| state.uid)
        else {
            return;
        };
        let swept = tokio::task::spawn_blocking(move || crate::isolation::sweep::kill_all(uid));
        match swept.await {
            Ok(left) if left.is_empty() => {}
            Ok(left) => tracing::warn!(
                uid,
                left = left.len(),
                "processes of a silent shim's account survived the sweep"
            ),
            Err(e) => tracing::warn!(uid, error = %e, "could not sweep a silent shim's account"),
        }
    }

    /// Ends a live shim's program (SIGKILL through the shim), waits for the
    /// shim to go, and deletes its state file and socket.
    pub async fn remove(self, cgroups: Option<&Parents>) {
        if let Ok((mut handle, _)) = self.attach_within(cgroups, REMOVAL_PATIENCE).await {
            if let Err(e) = handle.control().send(ShimCommand::Kill).await {
                tracing::warn!(path = %self.state_path.display(), error = %e,
                    "could not stop the shim");
            }
            let gone = async { while handle.next_event().await.is_some() {} };
            if tokio::time::timeout(REMOVE_WAIT, gone).await.is_err() {
                tracing::warn!(path = %self.state_path.display(),
                    "the removed shim has not exited yet");
            }
        }
        self.remove_leftovers(None);
    }

    /// Deletes the state file and socket and, given the cgroup parents,
    /// the instance's cgroup, killing what runs in it once its shim is
    /// gone.
    fn remove_leftovers(&self, cgroups: Option<&Parents>) {
        let _ = std::fs::remove_file(&self.state_path);
        let _ = std::fs::remove_file(self.state_path.with_extension("sock"));
        let leaf = self.state.as_ref().and_then(cgroup_leaf);
        if let (Some(parents), Some(leaf)) = (cgroups, leaf) {
            for (dir, e) in cgroup::remove_stale_leaf(parents, &leaf, procfs::exists) {
                tracing::warn!(dir = %dir.display(), error = %e, "a silent shim's cgroup remains");
            }
        }
    }
}

/// The name of the instance cgroup a shim recorded (one name under every
/// controller's parent).
pub(super) fn cgroup_leaf(state: &ShimState) -> Option<String> {
    let dir = state.cgroup.first()?;
    Some(dir.file_name()?.to_string_lossy().into_owned())
}
