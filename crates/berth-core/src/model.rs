use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::{UnixMillis, UserId};

/// A lease's fencing token: +1 on every successful claim.
pub type Epoch = i64;

/// Patches larger than this are refused with `payload_too_large`.
pub const MAX_PATCH_BYTES: usize = 256 * 1024;

/// What an instance is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The user's workspace.
    Main,
    /// A one-shot repair run after a crash.
    Watchdog,
}

impl Role {
    /// The role's name, as records, events and the API spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Main => "main",
            Role::Watchdog => "watchdog",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "main" => Ok(Role::Main),
            "watchdog" => Ok(Role::Watchdog),
            other => Err(format!("unknown role {other:?}")),
        }
    }
}

/// Where an instance is in its lifecycle.
///
/// `starting → running ⇄ hibernated`, `running → (crashed → starting …) |
/// stopped | failed`, `hibernated → stopped`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InstanceStatus {
    /// Spawned, not yet ready.
    Starting,
    /// Ready; the proxy forwards to it.
    Running,
    /// Ready, but frozen while idle: memory and sockets kept, lease
    /// held. The proxy still routes to it, resuming it first.
    Hibernated,
    /// Exited without being asked to; a restart is scheduled.
    Crashed,
    /// Stopped on purpose (API, reaper, fence). Terminal.
    Stopped,
    /// The breaker opened, or spawning itself failed. Terminal.
    Failed,
}

impl InstanceStatus {
    /// The status's name, as records, events and the API spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceStatus::Starting => "starting",
            InstanceStatus::Running => "running",
            InstanceStatus::Hibernated => "hibernated",
            InstanceStatus::Crashed => "crashed",
            InstanceStatus::Stopped => "stopped",
            InstanceStatus::Failed => "failed",
        }
    }

    /// Live instances hold a lease, a port and (between crashes) a process.
    pub fn is_live(self) -> bool {
        matches!(
            self,
            InstanceStatus::Starting
                | InstanceStatus::Running
                | InstanceStatus::Hibernated
                | InstanceStatus::Crashed
        )
    }

    /// Whether the proxy may send traffic to it (once ready): running, or
    /// hibernated (resumed on the way).
    pub fn is_routable(self) -> bool {
        matches!(self, InstanceStatus::Running | InstanceStatus::Hibernated)
    }

    /// Stopped or failed: nothing of the instance runs or is held, and
    /// nothing more happens to it.
    pub fn is_terminal(self) -> bool {
        !self.is_live()
    }
}

impl fmt::Display for InstanceStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for InstanceStatus {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "starting" => InstanceStatus::Starting,
            "running" => InstanceStatus::Running,
            "hibernated" => InstanceStatus::Hibernated,
            "crashed" => InstanceStatus::Crashed,
            "stopped" => InstanceStatus::Stopped,
            "failed" => InstanceStatus::Failed,
            other => return Err(format!("unknown instance status {other:?}")),
        })
    }
}

/// One running copy of the configured program for one user.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    /// Unique per launch; a crash restart keeps it, a new launch replaces it.
    pub id: String,
    /// Whose instance it is.
    pub user: UserId,
    /// Main or watchdog.
    pub role: Role,
    /// Where it is in its lifecycle.
    pub status: InstanceStatus,
    /// The node that runs it.
    pub node: String,
    /// The lease epoch it runs under (0 for watchdogs, which hold no lease).
    pub epoch: Epoch,
    /// The port of its endpoint, when the current run has one.
    pub port: Option<u16>,
    /// The program's process id, where the runtime has one; shown to
    /// operators. The instance's identity is `runtime_ref`, never this.
    pub pid: Option<u32>,
    /// The runtime's own name for the current run (see
    /// [`crate::runtime::RuntimeRef`]): what adoption compares, so a reused
    /// pid is never mistaken for the instance. `None` until it runs.
    #[serde(default)]
    pub runtime_ref: Option<crate::runtime::RuntimeRef>,
    /// Working directory, relative to the user's workspace.
    pub folder: String,
    /// When the current run started (a crash restart sets it anew).
    pub started_at: UnixMillis,
    /// The runtime reported the current run ready.
    pub ready: bool,
    /// Crash restarts since this launch.
    pub restarts: u32,
    /// Tail of stderr, at most 500 characters.
    pub last_error: Option<String>,
    /// The exit code of the last run that ended, when the runtime reported
    /// one.
    pub exit_code: Option<i32>,
    /// When its user last used it (proxied traffic, or a touch); the
    /// reaper measures idleness from it.
    pub last_active: UnixMillis,
    /// When it was last hibernated; set while `status` is `hibernated`.
    #[serde(default)]
    pub hibernated_at: Option<UnixMillis>,
}

/// A user's main and watchdog instances.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserStatus {
    /// The main's record, if the user has one.
    pub main: Option<Instance>,
    /// The watchdog's record, if the user has one.
    pub watchdog: Option<Instance>,
    /// What the node that runs the user does with an idle instance:
    /// `hibernate`, or `stop` (configured so, or its runtime cannot freeze).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_action: Option<String>,
}

/// Where the proxy sends a user's traffic.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Endpoint {
    /// A host name or IP address.
    pub host: String,
    /// The TCP port.
    pub port: u16,
    /// How the address must be dialled and checked.
    #[serde(flatten, default)]
    pub reach: Reach,
}

/// How an address on this host must be reached, when it is not simply
/// dialled from berth's own network namespace to whatever listens there.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Reach {
    /// The account whose socket must answer at the address, where other
    /// accounts could bind it: every connection is checked against this
    /// uid before a byte is sent (`None`: the runtime vouches for the
    /// address itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<u32>,
    /// The network namespace the address is in (a namespace file, such as
    /// `/proc/<pid>/ns/net`), when it is not berth's own: a sandboxed
    /// instance's, where only its own programs listen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<std::path::PathBuf>,
}

impl Endpoint {
    /// `host:port` as a URI authority: an IPv6 literal gets its brackets
    /// (unless it already has them), which `host:port` text would lack.
    pub fn authority(&self) -> String {
        if self.host.contains(':') && !self.host.starts_with('[') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// An open crash breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BreakerInfo {
    /// How many times the breaker has opened for this user.
    pub opens: u32,
    /// When it last opened (wall clock).
    pub opened_at: UnixMillis,
    /// When its cooldown ends (wall clock); launches are refused until
    /// then unless forced.
    pub cooldown_until: UnixMillis,
}

/// What a client asks for when it launches a user's main instance.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaunchRequest {
    /// Working directory relative to the user's workspace; default: its root.
    #[serde(default)]
    pub folder: Option<String>,
    /// Configuration content materialised for the program (≤ 256 KiB).
    #[serde(default)]
    pub patch: Option<String>,
    /// Launch even while the crash breaker is open, and clear it.
    #[serde(default)]
    pub force: bool,
}

/// The answer of `restart_and_probe`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeReport {
    /// The main became ready and was still running after the settle time.
    pub ok: bool,
    /// What happened, in words, for either answer.
    pub reason: String,
}

/// One user's outcome in `restart_all_mains`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartResult {
    /// Whose main it was.
    pub user: UserId,
    /// The restart succeeded.
    pub ok: bool,
    /// Why it did not, when it did not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Where a spawn of a main is, as its progress stream reports it (the API's
/// `…/instance/progress`):
///
/// `queued → spawning → waiting_for_ready → ready`, or `failed` with the
/// reason at any point. A crashed main whose restart waits for its backoff
/// is `queued` again; a stop ends a spawn as `stopped`. `ready`, `failed`
/// and `stopped` are final.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Accepted, waiting for its turn: capacity, the breaker, the lease, or
    /// a crashed main's backoff.
    Queued,
    /// The runtime is starting the program.
    Spawning,
    /// The program runs; berth waits for its readiness.
    WaitingForReady,
    /// Ready: the proxy forwards to it.
    Ready,
    /// The spawn failed (the event's message says why).
    Failed,
    /// Stopped on purpose.
    Stopped,
}

impl Stage {
    /// The stage's name, as progress streams spell it (`snake_case`).
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Queued => "queued",
            Stage::Spawning => "spawning",
            Stage::WaitingForReady => "waiting_for_ready",
            Stage::Ready => "ready",
            Stage::Failed => "failed",
            Stage::Stopped => "stopped",
        }
    }

    /// The stage an instance record shows. `queued` and `spawning` come
    /// before there is a record of the run, so only the controller
    /// announces them.
    pub fn of(status: InstanceStatus, ready: bool) -> Stage {
        match status {
            InstanceStatus::Running if ready => Stage::Ready,
            InstanceStatus::Starting | InstanceStatus::Running => Stage::WaitingForReady,
            // Frozen with its memory intact, and ready again on its next
            // request: a spawn that reached it ended ready.
            InstanceStatus::Hibernated => Stage::Ready,
            InstanceStatus::Crashed => Stage::Queued,
            InstanceStatus::Stopped => Stage::Stopped,
            InstanceStatus::Failed => Stage::Failed,
        }
    }

    /// A progress stream ends after a final stage.
    pub fn is_final(self) -> bool {
        matches!(self, Stage::Ready | Stage::Failed | Stage::Stopped)
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A change to an instance, published to the proxy's route table and to
/// progress streams (and read back from another node's stream).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceEvent {
    /// Whose instance changed.
    pub user: UserId,
    /// Which of the user's instances.
    pub role: Role,
    /// Its status after the change.
    pub status: InstanceStatus,
    /// Whether it is ready after the change.
    pub ready: bool,
    /// Set while the instance is running and reachable.
    pub endpoint: Option<Endpoint>,
    /// Why it changed, when that is worth saying (a crash's error, a
    /// refused launch's reason, "restarted").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Where a spawn of the instance is; for a record's change,
    /// [`Stage::of`] its status.
    pub stage: Stage,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_shows_its_stage_and_the_wire_names_are_fixed() {
        use InstanceStatus::*;
        let cases = [
            (Starting, false, Stage::WaitingForReady, "waiting_for_ready"),
            (Running, false, Stage::WaitingForReady, "waiting_for_ready"),
            (Running, true, Stage::Ready, "ready"),
            (Crashed, false, Stage::Queued, "queued"),
            (Stopped, false, Stage::Stopped, "stopped"),
            (Failed, false, Stage::Failed, "failed"),
        ];
        for (status, ready, stage, name) in cases {
            assert_eq!(Stage::of(status, ready), stage, "{status} {ready}");
            assert_eq!(stage.as_str(), name);
            assert_eq!(serde_json::to_value(stage).unwrap(), name);
        }
        assert_eq!(Stage::Spawning.as_str(), "spawning");
        assert_eq!(serde_json::to_value(Stage::Spawning).unwrap(), "spawning");
        let finals: Vec<Stage> = [
            Stage::Queued,
            Stage::Spawning,
            Stage::WaitingForReady,
            Stage::Ready,
            Stage::Failed,
            Stage::Stopped,
        ]
        .into_iter()
        .filter(|s| s.is_final())
        .collect();
        assert_eq!(finals, [Stage::Ready, Stage::Failed, Stage::Stopped]);
    }
}
