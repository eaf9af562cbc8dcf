//! The shim's wire protocol: what a shim records about itself, the
//! commands berth sends it and the events it answers with. JSON, one value
//! per line. A host's shim speaks it over a local socket; a pod's shim
//! (the Kubernetes runtime's) over the pod network, after a credential.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::runtime::HookOutcome;
use crate::{Epoch, Role};

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
    /// The instance id the shim spec gave.
    pub instance_id: String,
    /// The user the shim spec gave.
    pub user: String,
    /// The role the shim spec gave.
    pub role: Role,
    /// The epoch the shim spec gave.
    pub epoch: Epoch,
    /// Where the shim listens for commands (the shim spec's socket path; unused in a pod).
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
    /// The port the shim spec gave.
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

/// The variables a pod's shim (`berth shim pod -- PROGRAM…`) is started
/// with: the Kubernetes runtime's manifest sets them, and the shim takes
/// every one of them out of the program's environment.
pub mod pod_env {
    /// Every one of them starts with this.
    pub const PREFIX: &str = "BERTH_SHIM_";
    /// `host:port` the shim listens on for berth.
    pub const CONTROL: &str = "BERTH_SHIM_CONTROL";
    /// What berth shows as the first line of a control connection.
    pub const CREDENTIAL: &str = "BERTH_SHIM_CREDENTIAL";
    /// `uid:gid` the program runs as.
    pub const RUN_AS: &str = "BERTH_SHIM_RUN_AS";
    /// The instance id, for the shim's state.
    pub const INSTANCE: &str = "BERTH_SHIM_INSTANCE";
    /// The user id, for the shim's state.
    pub const USER: &str = "BERTH_SHIM_USER";
    /// `main` or `watchdog`.
    pub const ROLE: &str = "BERTH_SHIM_ROLE";
    /// The lease epoch the pod started under.
    pub const EPOCH: &str = "BERTH_SHIM_EPOCH";
    /// The fence deadline in ms from the shim's start; absent: no fencing.
    pub const FENCE_MS: &str = "BERTH_SHIM_FENCE_MS";
    /// The program's grace after SIGTERM, in ms, when the pod ends.
    pub const STOP_GRACE_MS: &str = "BERTH_SHIM_STOP_GRACE_MS";
    /// A directory the shim may write (its state goes in a private
    /// directory it makes below); `/tmp` when absent.
    pub const STATE_DIR: &str = "BERTH_SHIM_STATE_DIR";
    /// The shim's exit code when it could not start the program (missing,
    /// not executable, a bad working directory), as a shell's for a
    /// missing command; its last log line says why.
    pub const COULD_NOT_START: i32 = 127;
}
