//! The shim's wire types. Everything is JSON, one value per line.

use std::path::PathBuf;

pub use berth_core::shim_wire::{ExitInfo, ShimCommand, ShimEvent, ShimState};
use berth_core::{Epoch, Role};
use serde::{Deserialize, Serialize};

fn default_log_max_bytes() -> u64 {
    crate::DEFAULT_LOG_MAX_BYTES
}

use crate::isolation::IsolationSpec;

/// Everything a shim needs to run one instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimSpec {
    /// The instance's id, unique per launch; it names the instance's
    /// cgroup and shows in the shim's log.
    pub instance_id: String,
    /// The raw user id (for reports only; paths use the slug).
    pub user: String,
    /// Whether the instance is the user's workspace or a watchdog run.
    pub role: Role,
    /// The lease epoch the instance runs under (0 for a watchdog), which
    /// a restarted berth reads back when it adopts the instance.
    pub epoch: Epoch,
    /// The program and its arguments; `argv[0]` is looked up in `PATH` of
    /// [`ShimSpec::env`] when it has no `/`.
    pub argv: Vec<String>,
    /// The program's whole environment (nothing is inherited).
    pub env: Vec<(String, String)>,
    /// The program's working directory.
    pub cwd: PathBuf,
    /// stdout and stderr of the program, appended.
    pub log_path: PathBuf,
    /// The most bytes of the log kept on disk: the file and the one it
    /// was rotated from (see `shim::log_file`).
    #[serde(default = "default_log_max_bytes")]
    pub log_max_bytes: u64,
    /// Where the shim keeps its [`ShimState`].
    pub state_path: PathBuf,
    /// The control socket.
    pub socket_path: PathBuf,
    /// First capture group = launch token; a match means "ready".
    pub ready_regex: Option<String>,
    /// Fence deadline in ms from start, extended by [`ShimCommand::Extend`].
    /// `None` switches fencing off (single node).
    pub fence_ms: Option<u64>,
    /// The user's data root, which the user's programs can change: the
    /// shim opens [`ShimSpec::log_path`] below it without following any
    /// symbolic link. `None`: the log path is trusted as it is.
    #[serde(default)]
    pub user_root: Option<PathBuf>,
    /// How the program is isolated; `None` at level `none` (it runs as the
    /// shim's own user).
    #[serde(default)]
    pub isolation: Option<IsolationSpec>,
    /// The port the program was given, recorded in the state file so a
    /// restarted berth knows which port an adopted instance holds.
    #[serde(default)]
    pub port: Option<u16>,
}

/// The shim's first and only stdout line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum SpawnReport {
    /// The program runs; the socket is listening and the state file exists.
    Spawned {
        /// The state as written to the state file.
        state: ShimState,
    },
    /// The program could not be started (missing, not executable, bad cwd).
    /// The message names the program. The shim exits right after.
    Failed {
        /// Why, naming the program.
        error: String,
    },
}
