//! Discovery at start: the shims a previous berth left under
//! `<data_dir>/run/<slug>/<role>.json`, attached to when alive.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::StreamExt;

use berth_core::runtime::{Discovered, ExitStatus, OutOfMemory, RuntimeRef};
use berth_core::{Role, UserId};

use crate::shim::{ShimCommand, ShimHandle, ShimState};

/// How long [`FoundShim::remove`] waits for a killed shim to go.
const REMOVE_WAIT: Duration = Duration::from_secs(5);

/// A shim state file found on disk.
pub(super) struct FoundShim {
    /// The directory it was found in.
    pub dir_slug: String,
    pub role: Role,
    pub state_path: PathBuf,
    /// `None` when the state file could not be read.
    pub state: Option<ShimState>,
    /// The connection, when a live shim answered.
    pub handle: Option<ShimHandle>,
}

/// Shims attached to at once: each attach waits on its shim's answer.
const ATTACH_CONCURRENCY: usize = 256;

/// Every shim state file under `run_dir`, attached to when alive, in the
/// order of their directories' names.
pub(super) async fn scan(run_dir: &Path) -> Vec<FoundShim> {
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
    futures_util::stream::iter(files)
        .map(|(dir_slug, role, state_path)| async move {
            let (state, handle) = match ShimHandle::attach(&state_path).await {
                Ok((handle, state)) => (Some(state), Some(handle)),
                Err(_) => (ShimHandle::read_state(&state_path).ok(), None),
            };
            FoundShim {
                dir_slug,
                role,
                state_path,
                state,
                handle,
            }
        })
        .buffered(ATTACH_CONCURRENCY)
        .collect()
        .await
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
            alive: self.handle.is_some() && state.role == self.role,
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

    /// Ends a live shim's program (SIGKILL through the shim), waits for the
    /// shim to go, and deletes its state file and socket.
    pub async fn remove(self) {
        if let Some(mut handle) = self.handle {
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
        let _ = std::fs::remove_file(&self.state_path);
        let _ = std::fs::remove_file(self.state_path.with_extension("sock"));
    }
}
