//! The runtime seam: how a program is run, and nothing else.
//!
//! A [`Runtime`] starts an [`InstanceSpec`] and hands back a [`Started`]
//! handle: an opaque [`RuntimeRef`] the controller records, where the
//! instance will listen, and a bounded stream of [`RuntimeEvent`]s
//! (readiness, freeze, exit). It stops, kills and (when it declares the
//! [`Capabilities`]) freezes, thaws and extends a fence deadline by that
//! reference; it runs the operator's hooks beside the program
//! ([`Runtime::run_hook`]); it guards, per user, where a program may
//! connect ([`Runtime::set_egress`]); it discovers what it already runs so a restarted berth can
//! adopt it; and it reads and follows logs.
//!
//! Everything that does not depend on *where* a program runs — the lease,
//! fencing, the crash policy and breaker, reaping, placement, forwarding —
//! belongs to the controller, which is written once for every runtime. The
//! shape follows the Container Runtime Interface's RuntimeService (start,
//! stop with a grace period, status, list) and containerd's per-instance
//! shim (events, exit status kept for the supervisor).
//!
//! Optional capabilities are declared, never faked: a runtime without
//! freeze answers [`RuntimeError::Unsupported`], and the controller, which
//! reads [`Runtime::capabilities`] first, does not ask.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::egress::EgressPolicy;
use crate::{Endpoint, Epoch, Role, Slug, UserId};

/// Events a runtime may buffer for one instance before it blocks; the
/// controller drains them promptly, so this only bounds a stall.
pub const EVENT_BUFFER: usize = 64;

/// A runtime's own name for one instance: a shim's pids and start time, a
/// pod's UID. The controller stores it with the instance record and hands
/// it back; only the runtime that made it reads it. Two refs are the same
/// instance only when they are equal, so a reused pid never passes for the
/// instance it replaced.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RuntimeRef(String);

impl RuntimeRef {
    /// Wraps the runtime's own text; only the runtime that made it gives
    /// it meaning.
    pub fn new(text: impl Into<String>) -> Self {
        Self(text.into())
    }

    /// The text, as stored with the instance record.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RuntimeRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a runtime can do beyond the required surface.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    /// [`Runtime::freeze`] and [`Runtime::thaw`]: the program keeps its
    /// memory and sockets but is not scheduled.
    pub freeze: bool,
    /// [`Runtime::extend_fence`]: the runtime freezes the instance on its
    /// own when its deadline passes, even while berth is down.
    pub fence_deadline: bool,
    /// [`Runtime::run_hook`] runs a [`HookAction::Command`] where the
    /// program runs: as its account, in its isolation, with its
    /// environment.
    pub exec: bool,
    /// [`Runtime::set_egress`]: the runtime guards where a program may
    /// connect, per user, and changes it while the program runs.
    pub egress: bool,
    /// That guard also lets a program reach the domain names a policy
    /// allows (else a policy may allow networks only).
    pub egress_names: bool,
}

/// What an operator's hook does (`pre_hibernate`, `pre_stop`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HookAction {
    /// A program and its arguments, run beside the instance's program
    /// (where the runtime declares [`Capabilities::exec`]).
    Command(Vec<String>),
    /// A path on the instance, asked with `POST` on its endpoint; any
    /// answer counts as done.
    Post(String),
}

/// One run of a hook for one instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookCall {
    /// The hook's name (`pre_hibernate`), which a command finds in
    /// [`crate::program::Variable::Hook`].
    pub name: &'static str,
    /// What it does.
    pub action: HookAction,
    /// How long it may take: a command still running then is killed,
    /// with everything it started in its process group.
    pub grace: Duration,
}

/// How a hook ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HookOutcome {
    /// A command's exit code, or a `POST`'s HTTP status.
    pub code: Option<i32>,
    /// The signal that ended a command, if one did.
    pub signal: Option<i32>,
    /// It was cut off at its grace.
    pub timed_out: bool,
    /// The last ≤ 500 characters a command wrote (stdout and stderr).
    pub output_tail: String,
}

impl HookOutcome {
    /// How a `POST` hook ended: `Some(status)` when an answer (or none,
    /// the connection failing) came within the grace, `None` when the
    /// grace ran out first.
    pub fn of_post(answer: Option<Option<u16>>) -> Self {
        HookOutcome {
            code: answer.flatten().map(i32::from),
            signal: None,
            timed_out: answer.is_none(),
            output_tail: String::new(),
        }
    }

    /// Whether the hook did its job: a command that exited with 0, or a
    /// `POST` that got any answer in time.
    pub fn succeeded(&self, action: &HookAction) -> bool {
        !self.timed_out
            && match action {
                HookAction::Command(_) => self.code == Some(0),
                HookAction::Post(_) => self.code.is_some(),
            }
    }
}

/// A limit on how many mains run at once, and where it comes from (for the
/// `capacity_exhausted` message an operator reads).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capacity {
    /// How many mains, at most.
    pub instances: u32,
    /// E.g. "one per port of 20000-29999".
    pub reason: String,
}

/// The patch of an instance: content for a new launch, or whatever the
/// runtime materialised last time, for a restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Patch {
    /// Use what the previous start of this user's role materialised.
    Unchanged,
    /// Materialise this content (≤ [`crate::MAX_PATCH_BYTES`]); `None`:
    /// the program is given no patch.
    Set(Option<String>),
}

/// Everything a runtime needs to start one instance. Plain data: the
/// runtime adds what depends on where the program runs (the command line,
/// paths, ports, isolation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceSpec {
    /// Unique per launch; a crash restart keeps it.
    pub instance_id: String,
    /// Whose instance it is.
    pub user: UserId,
    /// The user's recorded slug: the only form of the id that may name a
    /// file, a DNS label or a Kubernetes object.
    pub slug: Slug,
    /// Main or watchdog.
    pub role: Role,
    /// The lease epoch it runs under (0 for watchdogs).
    pub epoch: Epoch,
    /// Working directory relative to the user's workspace (validated).
    pub folder: String,
    /// The patch to give the program, or the one given last time.
    pub patch: Patch,
    /// The port the previous start of this instance listened on; a runtime
    /// that allocates ports reuses it when it is still free, so a crash
    /// restart keeps the user's endpoint. `None` asks for a fresh port (the
    /// previous one is held by some other process), giving the old one up.
    pub port_hint: Option<u16>,
    /// How long the instance may run before its fence deadline, when the
    /// runtime enforces one ([`Capabilities::fence_deadline`]); `None`
    /// switches it off (one node: nobody else can take the lease).
    pub fence: Option<Duration>,
    /// Extra environment for the program.
    pub env: Vec<(String, String)>,
    /// For a watchdog: what it is to repair (the crashed main's record, as
    /// JSON), which the runtime materialises and names in `BERTH_HANDOFF`.
    pub handoff: Option<String>,
    /// The egress policy the user has of their own, as the store holds it
    /// at this start (`None`: the node's), for a runtime that guards
    /// egress ([`Capabilities::egress`]): another node may have changed
    /// it since this one last ran the user.
    pub egress: Option<EgressPolicy>,
}

/// A started (or adopted) instance.
#[derive(Debug)]
pub struct Started {
    /// The runtime's name for this run, which the controller records and
    /// hands back to address it.
    pub runtime_ref: RuntimeRef,
    /// The program's process id, where there is one (`berth ls` shows
    /// it to operators); identity is `runtime_ref`, never this.
    pub pid: Option<u32>,
    /// Where the instance listens, once ready; `None` for watchdogs.
    pub endpoint: Option<Endpoint>,
    /// Everything that happens to the instance from here on. The stream
    /// ends after [`RuntimeEvent::Exited`], or early when the runtime loses
    /// track of the instance (then ask [`Runtime::discover`]).
    pub events: mpsc::Receiver<RuntimeEvent>,
}

/// How a program ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitStatus {
    /// The exit code, when the runtime reports one.
    pub code: Option<i32>,
    /// The signal that ended it, when the runtime knows of one.
    pub signal: Option<i32>,
    /// The last ≤ 500 characters of its stderr.
    pub stderr_tail: String,
    /// The runtime knows it was killed for exceeding its memory limit.
    pub out_of_memory: Option<OutOfMemory>,
    /// After the exit, another process held the instance's port: a start
    /// that lost a race for its port, not a fault of the program.
    pub port_in_use: bool,
}

/// An out-of-memory kill and the limit it hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutOfMemory {
    /// The memory limit, in MiB.
    pub limit_mb: u64,
}

/// What a runtime reports about an instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuntimeEvent {
    /// The instance passed the runtime's readiness check (a launch-token
    /// line, an HTTP or TCP probe, a pod's Ready condition); `token` is
    /// the captured launch token, if any.
    Ready {
        /// The launch token the program announced, which the proxy
        /// presents to it on every request.
        token: Option<String>,
    },
    /// The instance is frozen (by berth, or by the runtime's own fence
    /// deadline).
    Frozen,
    /// The instance runs again after a freeze.
    Thawed,
    /// The program ended. Nothing follows.
    Exited(ExitStatus),
}

/// One instance a runtime found running (or recently ended) when berth
/// started: the input of adoption.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovered {
    /// The user id the runtime recorded when it started the instance, or
    /// `None` when its records are unreadable (an orphan to remove).
    pub user: Option<UserId>,
    /// The slug the instance was filed under.
    pub slug: String,
    /// The role it was started as.
    pub role: Role,
    /// The instance id it was started with ([`InstanceSpec::instance_id`]).
    pub instance_id: String,
    /// The lease epoch it was started under.
    pub epoch: Epoch,
    /// The runtime's name for it, compared with the stored record's.
    pub runtime_ref: RuntimeRef,
    /// Whether the instance still runs (a live shim, an existing pod).
    pub alive: bool,
    /// It is frozen now.
    pub frozen: bool,
    /// It passed its readiness check.
    pub ready: bool,
    /// The launch token it announced when it became ready, if any.
    pub token: Option<String>,
    /// Set once it has ended.
    pub exit: Option<ExitStatus>,
}

/// Why a runtime operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuntimeError {
    /// The program could not be started; the message names it and why.
    #[error("{0}")]
    SpawnFailed(String),
    /// Nothing left to run it on (no free port, no room).
    #[error("{0}")]
    CapacityExhausted(String),
    /// The runtime does not offer this capability.
    #[error("the {runtime} runtime cannot {what}")]
    Unsupported {
        /// The runtime's name.
        runtime: &'static str,
        /// What it was asked to do, in words.
        what: &'static str,
    },
    /// The instance is gone (or was never this runtime's).
    #[error("instance {0} is gone")]
    Gone(RuntimeRef),
    /// Any other failure of the operation; the message says what.
    #[error("{0}")]
    Failed(String),
}

/// How a program is run. See the module docs.
#[async_trait]
pub trait Runtime: Send + Sync + 'static {
    /// A short name for logs and errors (`local`, `kubernetes`).
    fn name(&self) -> &'static str;

    /// The optional operations this runtime really offers; the controller
    /// asks for no other.
    fn capabilities(&self) -> Capabilities;

    /// Starts `spec`. Returns once the program runs (not once it is
    /// ready: readiness arrives as [`RuntimeEvent::Ready`]). On error
    /// nothing is left running.
    async fn start(&self, spec: InstanceSpec) -> Result<Started, RuntimeError>;

    /// Asks the instance to end: SIGTERM or its equivalent, then a kill
    /// after `grace`. Returns once asked; the exit arrives as an event.
    async fn stop(&self, instance: &RuntimeRef, grace: Duration) -> Result<(), RuntimeError>;

    /// Ends the instance at once, frozen or not, without letting it act
    /// on a signal first.
    async fn kill(&self, instance: &RuntimeRef) -> Result<(), RuntimeError>;

    /// Stops the instance from being scheduled, keeping its memory.
    async fn freeze(&self, instance: &RuntimeRef) -> Result<(), RuntimeError> {
        let _ = instance;
        Err(self.unsupported("freeze"))
    }

    /// Lets a frozen instance run again.
    async fn thaw(&self, instance: &RuntimeRef) -> Result<(), RuntimeError> {
        let _ = instance;
        Err(self.unsupported("thaw"))
    }

    /// Moves the instance's own fence deadline to `left` from now.
    async fn extend_fence(
        &self,
        instance: &RuntimeRef,
        left: Duration,
    ) -> Result<(), RuntimeError> {
        let _ = (instance, left);
        Err(self.unsupported("enforce a fence deadline"))
    }

    /// Runs `hook` for the running instance, where its program runs, and
    /// waits for it (at most its grace, plus the runtime's own overhead).
    /// A command gets the program's environment plus
    /// [`crate::program::Variable::Hook`]; a `POST` reaches the endpoint
    /// the way the proxy does. A frozen instance runs no hook: the answer
    /// is [`RuntimeError::Failed`].
    async fn run_hook(
        &self,
        instance: &RuntimeRef,
        hook: &HookCall,
    ) -> Result<HookOutcome, RuntimeError> {
        let _ = (instance, hook);
        Err(self.unsupported("run hooks"))
    }

    /// Gives `user`'s instances (their account, filed under `slug`) the
    /// egress `policy` (`None`: the node's) from their next connection
    /// on, whether one runs now or not; a start is given the user's
    /// policy again ([`InstanceSpec::egress`]), so one set while none
    /// runs applies when one starts.
    async fn set_egress(
        &self,
        user: &UserId,
        slug: &Slug,
        policy: Option<&EgressPolicy>,
    ) -> Result<(), RuntimeError> {
        let _ = (user, slug, policy);
        Err(self.unsupported("guard egress"))
    }

    /// How many mains this runtime can run at once, if it has a limit of
    /// its own (the local runtime: one per port of its range). The
    /// controller's node capacity defaults to it.
    fn capacity(&self) -> Option<Capacity> {
        None
    }

    /// Gives up what the runtime kept for instance `instance_id` between
    /// its runs (the local runtime: its port, so a crash restart can keep
    /// the user's endpoint), once the controller is done with it. Called
    /// after its last run has exited; releasing an unknown id does nothing.
    async fn release(&self, instance_id: &str) {
        let _ = instance_id;
    }

    /// Whether this runtime keeps data of a user under `slug` here (a data
    /// root, a volume): a user recorded for the first time keeps an earlier
    /// slug whose data is here.
    async fn has_data(&self, slug: &Slug) -> bool {
        let _ = slug;
        false
    }

    /// Everything this runtime runs (or last ran) for this node, for
    /// adoption after a restart of berth.
    async fn discover(&self) -> Result<Vec<Discovered>, RuntimeError>;

    /// Follows an instance [`Runtime::discover`] found, as if it had just
    /// been started.
    async fn adopt(&self, found: &Discovered) -> Result<Started, RuntimeError>;

    /// Ends and forgets an instance berth does not own (an orphan), or
    /// removes what an ended one left behind.
    async fn remove(&self, found: &Discovered) -> Result<(), RuntimeError>;

    /// The last `tail` lines of output of `slug`'s `role` (they outlive the
    /// instance).
    async fn logs(&self, slug: &Slug, role: Role, tail: usize)
    -> Result<Vec<String>, RuntimeError>;

    /// The last `tail` lines, then every new line until the receiver is
    /// dropped.
    async fn follow_logs(
        &self,
        slug: &Slug,
        role: Role,
        tail: usize,
    ) -> Result<mpsc::Receiver<String>, RuntimeError>;

    /// Releases the runtime's own resources; instances keep running.
    async fn shutdown(&self) {}

    /// The error for a capability this runtime lacks.
    fn unsupported(&self, what: &'static str) -> RuntimeError {
        RuntimeError::Unsupported {
            runtime: self.name(),
            what,
        }
    }
}
