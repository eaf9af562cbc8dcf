//! What a pod's state means for berth, as pure functions over plain data:
//! [`PodView`] is the part of a Pod the runtime reads, [`Tracker`] turns a
//! run's successive views into [`RuntimeEvent`]s, and [`start_outcome`]
//! says when a start is over.
//!
//! The tracker compares *states*, never counts watch events: after a watch
//! is resumed by a relist (a 410 Gone), the listed state alone yields each
//! event that is due, once.

use berth_core::Epoch;
use berth_core::runtime::{ExitStatus, OutOfMemory, RuntimeEvent, RuntimeRef};
use k8s_openapi::api::core::v1::{ContainerState, ContainerStateTerminated, Pod};

use crate::manifest::MAIN_CONTAINER;
use crate::names;

/// How much of a message becomes an exit's `stderr_tail`.
pub const TAIL_CHARS: usize = 500;

/// Waiting reasons after which a container never starts without a change
/// to its pod.
pub const FATAL_WAITING: &[&str] = &[
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
];

/// Terminated reasons of a container that never ran its program.
pub const START_FAILED: &[&str] = &["StartError", "ContainerCannotRun"];

/// How a container ended, as its status tells.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Terminated {
    /// The container's exit code.
    pub exit_code: i32,
    /// The signal that ended it, when the container runtime reports one.
    pub signal: Option<i32>,
    /// Kubernetes' one-word reason (`Error`, `OOMKilled`, `Completed`).
    pub reason: Option<String>,
    /// Kubernetes' message, if any; it becomes the exit's stderr tail.
    pub message: Option<String>,
}

/// The program's container.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerView {
    /// It runs now.
    pub running: bool,
    /// `(reason, message)`.
    pub waiting: Option<(String, String)>,
    /// How it ended, once it has.
    pub terminated: Option<Terminated>,
    /// How its previous run ended, after the kubelet restarted it.
    pub last_terminated: Option<Terminated>,
    /// How many times the kubelet has restarted it.
    pub restart_count: i32,
}

impl ContainerView {
    /// It has run (or tried to run) its program.
    pub fn started(&self) -> bool {
        self.running || self.terminated.is_some() || self.restart_count > 0
    }
}

/// What the runtime reads from a pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodView {
    /// The pod's name.
    pub name: String,
    /// The pod's UID, which tells this object from another of the same name.
    pub uid: String,
    /// The object is gone from the API server.
    pub gone: bool,
    /// It has a deletion timestamp.
    pub deleting: bool,
    /// It still carries berth's finalizer.
    pub finalized: bool,
    /// It has been bound to a node (so a kubelet will end it).
    pub scheduled: bool,
    /// The pod's phase (`Pending`, `Running`, `Succeeded`, `Failed`); empty
    /// before its first status.
    pub phase: String,
    /// The pod's own reason and message (`Evicted`, `DeadlineExceeded`).
    pub reason: Option<String>,
    /// The message that goes with `reason`.
    pub message: Option<String>,
    /// Its `Ready` condition is `True`.
    pub ready: bool,
    /// Why the scheduler cannot place it, while it cannot.
    pub unschedulable: Option<String>,
    /// The program's container.
    pub main: ContainerView,
    /// The raw user id, from its annotation.
    pub user: Option<String>,
    /// The user's slug, from its label.
    pub slug: Option<String>,
    /// `main` or `watchdog`, from its label.
    pub role: Option<String>,
    /// The instance id it runs, from its annotation.
    pub instance: Option<String>,
    /// The lease epoch it is managed under, from its annotation.
    pub epoch: Option<Epoch>,
    /// The berth replica that manages it, from its annotation.
    pub node: Option<String>,
    /// The hash of the manifest it was made from.
    pub template: Option<String>,
    /// The hash of the patch it started with.
    pub patch: Option<String>,
    /// Its shim's nonce, when berth's shim is its entrypoint.
    pub shim_nonce: Option<String>,
}

fn terminated(t: &ContainerStateTerminated) -> Terminated {
    Terminated {
        exit_code: t.exit_code,
        signal: t.signal,
        reason: t.reason.clone(),
        message: t.message.clone(),
    }
}

fn state_parts(
    state: Option<&ContainerState>,
) -> (bool, Option<(String, String)>, Option<Terminated>) {
    let Some(state) = state else {
        return (false, None, None);
    };
    (
        state.running.is_some(),
        state.waiting.as_ref().map(|w| {
            (
                w.reason.clone().unwrap_or_default(),
                w.message.clone().unwrap_or_default(),
            )
        }),
        state.terminated.as_ref().map(terminated),
    )
}

impl PodView {
    /// What `pod` says, with whatever it lacks read as empty or absent.
    pub fn of(pod: &Pod) -> PodView {
        let meta = &pod.metadata;
        let annotation = |key: &str| meta.annotations.as_ref().and_then(|a| a.get(key)).cloned();
        let label = |key: &str| meta.labels.as_ref().and_then(|l| l.get(key)).cloned();
        let status = pod.status.as_ref();
        let condition = |kind: &str| {
            status
                .and_then(|s| s.conditions.as_ref())
                .and_then(|c| c.iter().find(|c| c.type_ == kind))
        };
        let unschedulable = condition("PodScheduled")
            .filter(|c| c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
            .map(|c| c.message.clone().unwrap_or_else(|| "unschedulable".into()));
        let main = status
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|all| all.iter().find(|c| c.name == MAIN_CONTAINER))
            .map(|c| {
                let (running, waiting, terminated) = state_parts(c.state.as_ref());
                let (_, _, last_terminated) = state_parts(c.last_state.as_ref());
                ContainerView {
                    running,
                    waiting,
                    terminated,
                    last_terminated,
                    restart_count: c.restart_count,
                }
            })
            .unwrap_or_default();
        PodView {
            name: meta.name.clone().unwrap_or_default(),
            uid: meta.uid.clone().unwrap_or_default(),
            gone: false,
            deleting: meta.deletion_timestamp.is_some(),
            finalized: meta
                .finalizers
                .as_ref()
                .is_some_and(|f| f.iter().any(|f| f == names::FINALIZER)),
            scheduled: pod.spec.as_ref().is_some_and(|s| s.node_name.is_some()),
            phase: status.and_then(|s| s.phase.clone()).unwrap_or_default(),
            reason: status.and_then(|s| s.reason.clone()),
            message: status.and_then(|s| s.message.clone()),
            ready: condition("Ready").is_some_and(|c| c.status == "True"),
            unschedulable,
            main,
            user: annotation(names::USER_ANNOTATION),
            slug: label(names::SLUG_LABEL),
            role: label(names::ROLE_LABEL),
            instance: annotation(names::INSTANCE_ANNOTATION),
            epoch: annotation(names::EPOCH_ANNOTATION).and_then(|e| e.parse().ok()),
            node: annotation(names::NODE_ANNOTATION),
            template: annotation(names::TEMPLATE_ANNOTATION),
            patch: annotation(names::PATCH_ANNOTATION),
            shim_nonce: annotation(names::SHIM_NONCE_ANNOTATION),
        }
    }

    /// The pod has ended: its program terminated, or the pod failed or
    /// succeeded as a whole.
    pub fn ended(&self) -> bool {
        self.main.terminated.is_some() || matches!(self.phase.as_str(), "Succeeded" | "Failed")
    }

    /// The pod still runs (or will): neither ended nor gone.
    pub fn alive(&self) -> bool {
        !self.gone && !self.ended()
    }

    /// This run's reference: the pod's name, UID and the epoch it is
    /// managed under.
    pub fn runtime_ref(&self) -> RuntimeRef {
        format_ref(&self.name, &self.uid, self.epoch.unwrap_or(0))
    }

    /// How the pod ended, if it has.
    pub fn exit(&self, memory_limit_mb: Option<u64>) -> Option<ExitStatus> {
        if let Some(t) = &self.main.terminated {
            let mut exit = exit_of(t, memory_limit_mb);
            if let Some(reason) = &self.reason {
                // The pod's own reason (an eviction) says more than the
                // kill it caused.
                let why = format!(
                    "{}\nthe pod {reason}: {}",
                    exit.stderr_tail,
                    self.message.as_deref().unwrap_or("")
                );
                exit.stderr_tail = tail(&why);
            }
            return Some(exit);
        }
        self.ended().then(|| ExitStatus {
            code: None,
            signal: None,
            stderr_tail: tail(&format!(
                "the pod {}: {}",
                self.reason.as_deref().unwrap_or("failed"),
                self.message.as_deref().unwrap_or("")
            )),
            out_of_memory: None,
            port_in_use: false,
        })
    }
}

/// `name/uid/epoch`.
pub fn format_ref(name: &str, uid: &str, epoch: Epoch) -> RuntimeRef {
    RuntimeRef::new(format!("{name}/{uid}/{epoch}"))
}

/// The parts of a reference [`format_ref`] made.
pub fn parse_ref(r: &RuntimeRef) -> Option<(&str, &str, Epoch)> {
    let mut parts = r.as_str().splitn(3, '/');
    let name = parts.next().filter(|s| !s.is_empty())?;
    let uid = parts.next().filter(|s| !s.is_empty())?;
    let epoch = parts.next()?.parse().ok()?;
    Some((name, uid, epoch))
}

/// The last [`TAIL_CHARS`] characters of `text`, trimmed.
pub fn tail(text: &str) -> String {
    let text = text.trim();
    let count = text.chars().count();
    text.chars()
        .skip(count.saturating_sub(TAIL_CHARS))
        .collect()
}

fn exit_of(t: &Terminated, memory_limit_mb: Option<u64>) -> ExitStatus {
    let oom = t.reason.as_deref() == Some("OOMKilled");
    ExitStatus {
        code: Some(t.exit_code),
        signal: t.signal,
        stderr_tail: tail(t.message.as_deref().unwrap_or("")),
        out_of_memory: oom.then(|| OutOfMemory {
            limit_mb: memory_limit_mb.unwrap_or(0),
        }),
        port_in_use: false,
    }
}

fn lost(why: impl Into<String>) -> ExitStatus {
    ExitStatus {
        code: None,
        signal: None,
        stderr_tail: why.into(),
        out_of_memory: None,
        port_in_use: false,
    }
}

/// What the runtime does for a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Send this event to the controller.
    Emit(RuntimeEvent),
    /// Read the pod's log for the launch token.
    ScanLog,
    /// The run is over: keep its log, report `exit` (nothing follows), and
    /// let the pod go if it is being deleted; `delete` asks to delete it
    /// first (a pod berth will not let run on).
    Finish {
        /// How the run ended.
        exit: ExitStatus,
        /// Whether to delete the pod before reporting.
        delete: bool,
    },
}

/// One run's view of its pod, from start (or adoption) to exit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tracker {
    uid: String,
    epoch: Epoch,
    needs_ready_line: bool,
    memory_limit_mb: Option<u64>,
    /// The ready line, once seen in the log, and the token it carried.
    ready_line: Option<Option<String>>,
    scanning: bool,
    ready_sent: bool,
    /// The container's restart count when the run began.
    restarts: Option<i32>,
    done: bool,
}

impl Tracker {
    /// A tracker for the pod `uid`, run under `epoch`. With
    /// `needs_ready_line`, readiness also waits for the program's ready
    /// line in its log; `memory_limit_mb` goes into an out-of-memory exit.
    pub fn new(
        uid: &str,
        epoch: Epoch,
        needs_ready_line: bool,
        memory_limit_mb: Option<u64>,
    ) -> Tracker {
        Tracker {
            uid: uid.to_owned(),
            epoch,
            needs_ready_line,
            memory_limit_mb,
            ready_line: None,
            scanning: false,
            ready_sent: false,
            restarts: None,
            done: false,
        }
    }

    /// The run is over: no step follows.
    pub fn is_done(&self) -> bool {
        self.done
    }

    fn finish(&mut self, exit: ExitStatus, delete: bool) -> Vec<Step> {
        self.done = true;
        vec![Step::Finish { exit, delete }]
    }

    /// The steps `view` calls for (the latest state of the run's pod).
    pub fn observe(&mut self, view: &PodView) -> Vec<Step> {
        if self.done {
            return Vec::new();
        }
        if view.uid != self.uid {
            return self.finish(
                lost(format!(
                    "the pod was deleted outside berth and another took its name ({})",
                    view.uid
                )),
                false,
            );
        }
        if let Some(epoch) = view.epoch.filter(|e| *e > self.epoch) {
            return self.finish(
                lost(format!(
                    "the pod is managed under epoch {epoch} now (another berth replica took it over)"
                )),
                false,
            );
        }
        let baseline = *self.restarts.get_or_insert(view.main.restart_count);
        if view.main.restart_count > baseline {
            let exit = view
                .main
                .last_terminated
                .as_ref()
                .map(|t| exit_of(t, self.memory_limit_mb))
                .unwrap_or_else(|| lost("the container restarted"));
            return self.finish(exit, true);
        }
        if let Some(exit) = view.exit(self.memory_limit_mb) {
            return self.finish(exit, false);
        }
        if view.gone {
            return self.finish(lost("the pod was deleted outside berth"), false);
        }
        if let Some((reason, message)) = &view.main.waiting
            && FATAL_WAITING.contains(&reason.as_str())
        {
            return self.finish(lost(tail(&format!("{reason}: {message}"))), true);
        }
        let mut steps = Vec::new();
        if self.needs_ready_line
            && self.ready_line.is_none()
            && !self.scanning
            && view.main.started()
        {
            self.scanning = true;
            steps.push(Step::ScanLog);
        }
        steps.extend(self.ready_if_due(view));
        steps
    }

    /// The ready line was found in the log, with the launch token it
    /// carried, if any.
    pub fn ready_line_found(&mut self, token: Option<String>, view: &PodView) -> Vec<Step> {
        if self.done || self.ready_line.is_some() {
            return Vec::new();
        }
        self.ready_line = Some(token);
        self.ready_if_due(view).into_iter().collect()
    }

    fn ready_if_due(&mut self, view: &PodView) -> Option<Step> {
        let due = !self.ready_sent
            && view.ready
            && view.alive()
            && (!self.needs_ready_line || self.ready_line.is_some());
        due.then(|| {
            self.ready_sent = true;
            Step::Emit(RuntimeEvent::Ready {
                token: self.ready_line.clone().flatten(),
            })
        })
    }
}

/// How a start ends, once it does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartOutcome {
    /// The program runs (or ran: its exit follows as an event).
    Runs,
    /// It never will; the message says why.
    Failed(String),
}

/// Whether a start waiting on this pod is over.
pub fn start_outcome(view: &PodView) -> Option<StartOutcome> {
    if view.gone {
        return Some(StartOutcome::Failed(format!(
            "the pod {} was deleted while it started",
            view.name
        )));
    }
    if let Some(t) = &view.main.terminated
        && t.reason
            .as_deref()
            .is_some_and(|r| START_FAILED.contains(&r))
    {
        return Some(StartOutcome::Failed(tail(&format!(
            "{}: {}",
            t.reason.as_deref().unwrap_or_default(),
            t.message.as_deref().unwrap_or_default()
        ))));
    }
    if let Some((reason, message)) = &view.main.waiting
        && FATAL_WAITING.contains(&reason.as_str())
    {
        return Some(StartOutcome::Failed(tail(&format!("{reason}: {message}"))));
    }
    if view.main.started() {
        return Some(StartOutcome::Runs);
    }
    if view.ended() {
        return Some(StartOutcome::Failed(tail(&format!(
            "the pod {}: {}",
            view.reason.as_deref().unwrap_or("failed"),
            view.message.as_deref().unwrap_or("")
        ))));
    }
    None
}

#[cfg(test)]
mod tests;
