//! One run of a program as the runtime follows it: the handle to its shim
//! and the task that turns the shim's events and the readiness probes into
//! [`RuntimeEvent`]s for the controller.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use berth_core::Reach;
use berth_core::runtime::{ExitStatus, OutOfMemory, RuntimeEvent, RuntimeRef};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::ports::bind_free;
use crate::process::kill_instance;
use crate::readiness::{PROBE_INTERVAL, probe};
use crate::shim::{ExitInfo, ShimControl, ShimEvent, ShimHandle};
use berth_core::Readiness;

/// How often, and how far apart, a port is found held after its program
/// exited before the exit counts as "another process holds the port": the
/// program's own group is killed by its shim before the exit is reported,
/// so a port still bound after this is someone else's.
const PORT_CHECKS: u32 = 3;
const PORT_CHECK_GAP: Duration = Duration::from_millis(50);

/// What the runtime keeps about a run it follows.
#[derive(Clone)]
pub(super) struct Run {
    pub control: ShimControl,
    pub pid: u32,
    pub pid_start: u64,
    pub shim_pid: u32,
    /// The account it runs under (levels `user` and `sandbox`).
    pub uid: Option<u32>,
    /// Its shim's state file, to connect to the shim anew.
    pub state_path: PathBuf,
    /// The main's port (watchdogs have none), and how it is reached.
    pub port: Option<u16>,
    pub reach: Reach,
}

impl Run {
    /// SIGKILLs the program's group and its shim directly, when the shim
    /// does not answer (guarded against pid reuse by the start time).
    pub fn kill_directly(&self) {
        kill_instance(Some(self.pid), Some(self.pid_start), Some(self.shim_pid));
    }
}

/// The runs being followed, shared with their event pumps (which drop a
/// run once it has exited).
#[derive(Clone, Default)]
pub(super) struct Runs(Arc<Mutex<HashMap<RuntimeRef, Run>>>);

impl Runs {
    /// How many runs are followed.
    pub fn len(&self) -> usize {
        self.lock().len()
    }
    pub fn insert(&self, r: RuntimeRef, run: Run) {
        self.lock().insert(r, run);
    }
    pub fn get(&self, r: &RuntimeRef) -> Option<Run> {
        self.lock().get(r).cloned()
    }
    /// The runs under the account `uid` (a user's main and watchdog).
    pub fn of_uid(&self, uid: u32) -> Vec<RuntimeRef> {
        self.lock()
            .iter()
            .filter(|(_, run)| run.uid == Some(uid))
            .map(|(r, _)| r.clone())
            .collect()
    }
    fn remove(&self, r: &RuntimeRef) {
        self.lock().remove(r);
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RuntimeRef, Run>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Everything the event pump of one run needs.
pub(super) struct Follow {
    pub handle: ShimHandle,
    pub state_path: PathBuf,
    pub instance_id: String,
    pub runtime_ref: RuntimeRef,
    /// The main's port (watchdogs have none).
    pub port: Option<u16>,
    /// How `port` is reached ([`super::reach_of`]): the account that must
    /// own the socket there, and the network namespace it is in. Readiness
    /// probes count no other account's listener.
    pub reach: Reach,
    /// An HTTP or TCP probe to run until ready (`None`: the shim's ready
    /// regex decides, or nothing does).
    pub probe: Option<Readiness>,
    /// Readiness comes from the shim's ready regex.
    pub by_regex: bool,
    /// Ready already (the shim saw its line before berth connected).
    pub ready: bool,
    pub token: Option<String>,
    /// Frozen already (by the shim's own deadline while berth was away).
    pub frozen: bool,
}

/// Follows one run until it exits (then reports [`RuntimeEvent::Exited`],
/// always, and forgets the run), the controller stops listening, or the
/// runtime shuts down (the program keeps running).
pub(super) async fn pump(
    mut f: Follow,
    tx: mpsc::Sender<RuntimeEvent>,
    runs: Runs,
    cancel: CancellationToken,
) {
    let mut ready = f.ready;
    let mut opening = Vec::new();
    if ready {
        opening.push(RuntimeEvent::Ready {
            token: f.token.take(),
        });
    }
    if f.frozen {
        opening.push(RuntimeEvent::Frozen);
    }
    for event in opening {
        if tx.send(event).await.is_err() {
            return;
        }
    }
    let probed = f
        .probe
        .clone()
        .zip(f.port)
        .map(|(r, port)| (r, port, f.reach.clone()));
    let mut next_probe = Box::pin(probe_after(probed.clone(), Duration::ZERO));
    let (exit, stderr_tail) = loop {
        let event = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            _ = tx.closed() => return,
            event = f.handle.next_event() => event,
            ok = &mut next_probe, if !ready && probed.is_some() => {
                if ok {
                    ready = true;
                    if tx.send(RuntimeEvent::Ready { token: None }).await.is_err() {
                        return;
                    }
                } else {
                    next_probe = Box::pin(probe_after(probed.clone(), PROBE_INTERVAL));
                }
                continue;
            }
        };
        let forward = match event {
            Some(ShimEvent::Ready { token }) if f.by_regex && !ready => {
                ready = true;
                RuntimeEvent::Ready { token }
            }
            Some(ShimEvent::Frozen) => RuntimeEvent::Frozen,
            Some(ShimEvent::Thawed) => RuntimeEvent::Thawed,
            Some(ShimEvent::Exited { exit, stderr_tail }) => break (Some(exit), stderr_tail),
            Some(ShimEvent::Hello { state }) if state.exit.is_some() => {
                break (state.exit, state.stderr_tail);
            }
            Some(_) => continue,
            None => break exit_from_state(&f.state_path, &f.instance_id),
        };
        if tx.send(forward).await.is_err() {
            return;
        }
    };
    runs.remove(&f.runtime_ref);
    let port_in_use = match f.port {
        Some(port) if !ready => port_held(port).await,
        _ => false,
    };
    let status = ExitStatus {
        code: exit.and_then(|e| e.code),
        signal: exit.and_then(|e| e.signal),
        stderr_tail: if exit.is_none() && stderr_tail.is_empty() {
            "the shim went away without recording how the program ended".to_owned()
        } else {
            stderr_tail
        },
        out_of_memory: exit
            .and_then(|e| e.oom_limit_mb)
            .map(|limit_mb| OutOfMemory { limit_mb }),
        port_in_use,
    };
    let _ = tx.send(RuntimeEvent::Exited(status)).await;
}

/// One probe after `delay`; false when there is nothing to probe.
async fn probe_after(probed: Option<(Readiness, u16, Reach)>, delay: Duration) -> bool {
    let Some((readiness, port, reach)) = probed else {
        return std::future::pending().await;
    };
    tokio::time::sleep(delay).await;
    probe(&readiness, port, &reach).await == Some(true)
}

/// The exit a shim recorded in its state file, when its connection closed
/// without an `Exited` event.
fn exit_from_state(state_path: &std::path::Path, instance_id: &str) -> (Option<ExitInfo>, String) {
    match ShimHandle::read_state(state_path) {
        Ok(state) if state.instance_id == instance_id => (state.exit, state.stderr_tail),
        _ => (None, String::new()),
    }
}

/// Whether another process holds `port`, judged over a few looks.
async fn port_held(port: u16) -> bool {
    for look in 0..PORT_CHECKS {
        if look > 0 {
            tokio::time::sleep(PORT_CHECK_GAP).await;
        }
        if bind_free(port) {
            return false;
        }
    }
    true
}
