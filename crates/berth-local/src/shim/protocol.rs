//! The shim's wire types. Everything is JSON, one value per line.

use std::path::PathBuf;

use berth_core::{Epoch, Role};
use serde::{Deserialize, Serialize};

fn default_log_max_bytes() -> u64 {
    crate::DEFAULT_LOG_MAX_BYTES
}

use crate::isolation::IsolationSpec;

/// Everything a shim needs to run one instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimSpec {
    pub instance_id: String,
    /// The raw user id (for reports only; paths use the slug).
    pub user: String,
    pub role: Role,
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
    Spawned { state: ShimState },
    /// The program could not be started (missing, not executable, bad cwd).
    /// The message names the program. The shim exits right after.
    Failed { error: String },
}

/// How the program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitInfo {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// Set when the kernel killed the program for going over its cgroup's
    /// memory limit: the limit, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_limit_mb: Option<u64>,
}

/// What the shim records about itself, in its state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimState {
    pub instance_id: String,
    pub user: String,
    pub role: Role,
    pub epoch: Epoch,
    pub socket_path: PathBuf,
    pub shim_pid: u32,
    /// The program's pid, also its process group id.
    pub pid: u32,
    /// Start time of `pid` in clock ticks since boot (`/proc/<pid>/stat`
    /// field 22), to tell a reused pid apart.
    pub pid_start: u64,
    /// The ready regex has matched (with or without a capture).
    #[serde(default)]
    pub ready: bool,
    /// The launch token, once seen.
    pub token: Option<String>,
    /// Set once the program has exited.
    pub exit: Option<ExitInfo>,
    /// The last ≤ 500 characters of stderr.
    pub stderr_tail: String,
    pub frozen: bool,
    /// The uid the program runs as, when isolated.
    #[serde(default)]
    pub uid: Option<u32>,
    /// The program's cgroup directories (levels `user` and `sandbox`).
    #[serde(default)]
    pub cgroup: Vec<PathBuf>,
    /// [`ShimSpec::port`].
    #[serde(default)]
    pub port: Option<u16>,
}

/// berth → shim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum ShimCommand {
    /// SIGTERM to the group, SIGKILL after `grace_ms`. A frozen group is
    /// killed at once instead: it is never thawed to be stopped, since
    /// it may be frozen because its lease is in doubt.
    Stop { grace_ms: u64 },
    /// SIGKILL to the group now (the lease is lost).
    Kill,
    /// SIGSTOP to the group.
    Freeze,
    /// SIGCONT to the group.
    Thaw,
    /// Move the fence deadline to `ms` from now.
    Extend { ms: u64 },
}

/// shim → berth. A client receives `Hello` first, on connecting.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ShimEvent {
    Hello {
        state: ShimState,
    },
    /// The ready regex matched; `token` is its first capture, if any.
    Ready {
        token: Option<String>,
    },
    Frozen,
    Thawed,
    /// The program exited. The shim exits after sending this.
    Exited {
        exit: ExitInfo,
        stderr_tail: String,
    },
}
