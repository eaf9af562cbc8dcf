//! One shim: the process the zygote forks for each instance.
//!
//! `run` makes the forked process a shim (its own session, its signals,
//! its runtime and blocking pool), then hands over to `start` (everything
//! up to a running program, its socket and its state file) and to
//! `supervise` (the program's life until it exits: commands, the fence
//! deadline, freezing, killing and the exit report). `control` serves each
//! connection to the shim's socket.

mod control;
mod hook;
mod start;
mod supervise;

use std::fs;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::{self, SigHandler, Signal};
use nix::unistd::Pid;
use regex::Regex;

use super::protocol::{ExitInfo, ShimSpec, SpawnReport};
use start::start;
use supervise::supervise;

/// How berth reaches a shim that is a pod's entrypoint, and how it stops.
pub(crate) struct PodControl {
    /// The control port, bound before the program starts.
    pub listener: tokio::net::TcpListener,
    /// What a client shows, as its first line, to be served.
    pub credential: Arc<str>,
    /// How long the program gets after SIGTERM when the kubelet ends the
    /// pod (SIGTERM to the shim).
    pub stop_grace_ms: u64,
}

/// Runs one shim in a process the zygote has just forked, whose stdout is
/// the pipe berth reads the [`SpawnReport`] from. `ready_regex` is
/// `spec.ready_regex` already compiled, if the zygote had it. Never returns
/// until the program has exited; the caller exits with the returned code.
pub(super) fn run(spec: ShimSpec, ready_regex: Option<Regex>) -> i32 {
    // A new session: berth's death, its terminal and signals sent to its
    // process group must not reach the shim. Fails only if the shim already
    // leads a process group, in which case it is on its own anyway.
    let _ = nix::unistd::setsid();
    let runtime = match shim_process() {
        Ok(runtime) => runtime,
        Err(e) => {
            let _ = report(&SpawnReport::Failed {
                error: format!(
                    "shim for program {:?}: cannot start runtime: {e}",
                    program_name(&spec)
                ),
            });
            return 2;
        }
    };
    runtime.block_on(shim_main(spec, ready_regex))
}

/// What every shim's process does first, wherever it runs: ignore SIGPIPE
/// and SIGHUP, become the program's subreaper, and build its runtime.
fn shim_process() -> std::io::Result<tokio::runtime::Runtime> {
    ignore_signal(Signal::SIGPIPE);
    ignore_signal(Signal::SIGHUP);
    // The program's orphans (a daemon that double-forked, a kernel that
    // left its session) become the shim's children, not the host init's:
    // the shim reaps them, so none lingers as a zombie that counts against
    // the account's process limits on a host whose init does not reap.
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        diag!("cannot become the program's subreaper: {e}");
    }
    // Single-threaded on purpose: the program's parent-death signal fires
    // when the thread that spawned it exits, so that thread must be the one
    // that lives as long as the shim.
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(BLOCKING_THREADS)
        .thread_keep_alive(BLOCKING_KEEP_ALIVE)
        .build()
}

fn ignore_signal(sig: Signal) {
    // SAFETY: SIG_IGN installs no handler, so no code of ours ever runs in
    // signal context; this happens before any other thread exists.
    if let Err(e) = unsafe { signal::signal(sig, SigHandler::SigIgn) } {
        diag!("cannot ignore {sig}: {e}");
    }
}

/// Sends the one report line to the spawner; false if it could not be
/// delivered (berth closed its end: it gave up on this shim, or is gone).
fn report(report: &SpawnReport) -> bool {
    let line = match serde_json::to_string(report) {
        Ok(line) => line,
        Err(e) => format!(r#"{{"result":"failed","error":"shim: cannot encode report: {e}"}}"#),
    };
    let mut stdout = io::stdout().lock();
    writeln!(stdout, "{line}")
        .and_then(|()| stdout.flush())
        .is_ok()
}

/// Points stdin at /dev/null and stdout/stderr at `<state_path>.shim.log`,
/// so the shim holds none of berth's pipes once berth has its report.
fn detach_stdio(state_path: &Path) {
    let mut log_path = state_path.as_os_str().to_os_string();
    log_path.push(".shim.log");
    let out = fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(&log_path)
        .or_else(|_| fs::OpenOptions::new().write(true).open("/dev/null"));
    if let Ok(out) = out {
        let _ = nix::unistd::dup2(out.as_raw_fd(), 1);
        let _ = nix::unistd::dup2(out.as_raw_fd(), 2);
    }
    if let Ok(null) = fs::File::open("/dev/null") {
        let _ = nix::unistd::dup2(null.as_raw_fd(), 0);
    }
}

fn program_name(spec: &ShimSpec) -> &str {
    spec.argv.first().map_or("", String::as_str)
}

/// Threads of the blocking pool (log writes, sweeps and kills of the
/// instance), all started before the program and kept for the shim's life:
/// once a sandbox's shim has entered a new pid namespace for its children
/// (`unshare(CLONE_NEWPID)`), the kernel refuses it any new thread.
const BLOCKING_THREADS: usize = 3;

/// Long enough that no pool thread ends while the shim lives.
const BLOCKING_KEEP_ALIVE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Starts every thread of the blocking pool now: tokio starts one for a
/// task that finds none idle, so as many tasks that wait for each other
/// make as many threads.
async fn start_blocking_pool() {
    let all_running = Arc::new(std::sync::Barrier::new(BLOCKING_THREADS));
    let tasks: Vec<_> = (0..BLOCKING_THREADS)
        .map(|_| {
            let all_running = Arc::clone(&all_running);
            tokio::task::spawn_blocking(move || {
                all_running.wait();
            })
        })
        .collect();
    for task in tasks {
        let _ = task.await;
    }
}

async fn shim_main(spec: ShimSpec, ready_regex: Option<Regex>) -> i32 {
    start_blocking_pool().await;
    let started = match start(&spec, ready_regex) {
        Ok(started) => started,
        Err(error) => {
            let _ = report(&SpawnReport::Failed { error });
            return 1;
        }
    };
    let delivered = report(&SpawnReport::Spawned {
        state: started.state.clone(),
    });
    detach_stdio(&spec.state_path);
    if !delivered {
        // Nobody will track this program (berth timed out on the report or
        // went away mid-launch), so it must not run. Supervising on records
        // its exit in the state file like any other.
        diag!(
            "berth did not take the report; stopping {} pid {}",
            spec.instance_id,
            started.state.pid
        );
        let _ = signal::killpg(pid_of(started.state.pid), Signal::SIGKILL);
    }
    diag!(
        "supervising {} pid {} ({:?})",
        spec.instance_id,
        started.state.pid,
        program_name(&spec)
    );
    supervise(spec, started, None).await;
    0
}

/// Runs the shim as a pod's entrypoint, in the calling process: the
/// program starts at once, no one reads a report, and the shim's own
/// output stays the container's. `bind` gives the control port once the
/// runtime runs. Returns the pod's exit code: the program's.
pub(crate) fn run_in_pod(
    spec: ShimSpec,
    bind: impl FnOnce() -> std::io::Result<std::net::TcpListener>,
    credential: Arc<str>,
    stop_grace_ms: u64,
) -> i32 {
    let runtime = match shim_process() {
        Ok(runtime) => runtime,
        Err(e) => {
            diag!("cannot start the runtime: {e}");
            return 2;
        }
    };
    runtime.block_on(async move {
        start_blocking_pool().await;
        let listener = match bind().and_then(|l| {
            l.set_nonblocking(true)?;
            tokio::net::TcpListener::from_std(l)
        }) {
            Ok(listener) => listener,
            Err(e) => {
                diag!("cannot listen for berth: {e}");
                return 2;
            }
        };
        let started = match start(&spec, None) {
            Ok(started) => started,
            Err(error) => {
                diag!("{error}");
                return berth_core::shim_wire::pod_env::COULD_NOT_START;
            }
        };
        diag!(
            "supervising {} pid {} ({:?}) in a pod",
            spec.instance_id,
            started.state.pid,
            program_name(&spec)
        );
        let pod = PodControl {
            listener,
            credential,
            stop_grace_ms,
        };
        pod_exit_code(supervise(spec, started, Some(pod)).await)
    })
}

/// A container's exit code for the program's end, as a shell gives it: the
/// code, or 128 + the signal.
fn pod_exit_code(exit: ExitInfo) -> i32 {
    match (exit.code, exit.signal) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => 1,
    }
}

fn pid_of(pid: u32) -> Pid {
    Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX))
}
