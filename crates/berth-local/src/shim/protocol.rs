//! The shim's wire types. Everything is JSON, one value per line.

use std::path::PathBuf;

use berth_core::runtime::HookOutcome;
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

/// How the program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitInfo {
    /// The exit code, when the program exited rather than being killed.
    pub code: Option<i32>,
    /// The signal that killed the program, if one did.
    pub signal: Option<i32>,
    /// Set when the kernel killed the program for going over its cgroup's
    /// memory limit: the limit, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_limit_mb: Option<u64>,
}

/// What the shim records about itself, in its state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimState {
    /// [`ShimSpec::instance_id`].
    pub instance_id: String,
    /// [`ShimSpec::user`].
    pub user: String,
    /// [`ShimSpec::role`].
    pub role: Role,
    /// [`ShimSpec::epoch`].
    pub epoch: Epoch,
    /// Where the shim listens for commands ([`ShimSpec::socket_path`]).
    pub socket_path: PathBuf,
    /// The shim's own pid, which a restarted berth checks before it
    /// connects.
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
    /// The program is frozen. Kept here, never read back from `/proc`,
    /// where a process frozen by its cgroup does not look stopped.
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
    Stop {
        /// How long the program gets to exit after SIGTERM, in ms.
        grace_ms: u64,
    },
    /// SIGKILL to the group and every process of the instance now (the
    /// lease is lost).
    Kill,
    /// Freeze every process of the instance (through its cgroup, its
    /// account, or at level `none` SIGSTOP to its group).
    Freeze,
    /// Undo [`ShimCommand::Freeze`].
    Thaw,
    /// Move the fence deadline to `ms` from now.
    Extend {
        /// The new deadline, in ms from now.
        ms: u64,
    },
    /// Run an operator's hook beside the program: as its account, in its
    /// cgroup and sandbox, in its working directory, with its environment
    /// and `BERTH_HOOK`. Answered by [`ShimEvent::HookDone`] with the same
    /// `id`. Refused while the program is frozen or another hook runs.
    Hook {
        /// Chosen by the asker, to tell its answer apart.
        id: u64,
        /// The hook's name, given in `BERTH_HOOK`.
        name: String,
        /// The command and its arguments; `argv[0]` is looked up in the
        /// program's `PATH`.
        argv: Vec<String>,
        /// Its process group is killed after this many ms.
        grace_ms: u64,
    },
}

/// shim → berth. A client receives `Hello` first, on connecting.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ShimEvent {
    /// The greeting of a new connection: the shim's state as of now, so
    /// the client misses nothing that happened before it connected.
    Hello {
        /// The state, as the state file would hold it.
        state: ShimState,
    },
    /// The ready regex matched; `token` is its first capture, if any.
    Ready {
        /// The launch token.
        token: Option<String>,
    },
    /// The program is frozen (confirmed by its cgroup, or its request has
    /// been in place for the confirmation's timeout).
    Frozen,
    /// The program runs again after a freeze.
    Thawed,
    /// A [`ShimCommand::Hook`] ended, or could not run.
    HookDone {
        /// The command's `id`.
        id: u64,
        /// How it ended; `Err` says why it did not run.
        outcome: Result<HookOutcome, String>,
    },
    /// The program exited. The shim exits after sending this.
    Exited {
        /// How it ended.
        exit: ExitInfo,
        /// The last ≤ 500 characters of its stderr.
        stderr_tail: String,
    },
}
