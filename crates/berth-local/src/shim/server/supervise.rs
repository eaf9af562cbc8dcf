//! Supervising the program once it runs: commands from berth, the fence
//! deadline, freezing, thawing and killing through the instance's handle,
//! reaping orphans, and recording and announcing the exit.

use std::fs;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;

use berth_core::runtime::HookOutcome;

use super::PodControl;
use super::control::{credential_shown, from_own_uid, serve_client};
use super::hook;
use super::pid_of;
use super::start::Started;
use crate::isolation::cgroup::{FreezeMechanism, InstanceCgroup};
use crate::isolation::{child, sweep};
use crate::shim::output::{self, StderrTail, Stream};
use crate::shim::protocol::{ExitInfo, ShimCommand, ShimEvent, ShimSpec, ShimState};
use crate::shim::state_file;

/// How long output may keep arriving after the program exited (from a
/// process that escaped its group and still holds the pipes).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// How long connected clients get to read the final `Exited` event.
const FAREWELL_TIMEOUT: Duration = Duration::from_secs(2);

/// Events a slow client may fall behind by before it is disconnected.
const EVENT_BACKLOG: usize = 256;

/// How long a freeze waits for the cgroup to say every task is frozen
/// before it reports `Frozen` anyway (the request stays in place).
const FREEZE_CONFIRM: Duration = Duration::from_secs(1);

/// How often the cgroup's freezer state is read while a freeze settles.
const FREEZE_POLL: Duration = Duration::from_millis(2);

/// Connections to a pod's control port still to show their credential;
/// past this many, new ones are closed at once.
const MAX_PENDING_CHECKS: usize = 16;

/// How often the shim looks for killed orphans to reap once the program
/// has ended.
const ORPHAN_POLL: Duration = Duration::from_millis(5);

/// The furthest a deadline is set: one further means "never" just as well,
/// and this one can be added to any `Instant` of this host's clock.
const FAR_FUTURE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `ms` (as berth sends it) from now, [`FAR_FUTURE`] at most.
fn deadline_after(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms).min(FAR_FUTURE)
}

/// Reads `is_frozen` every `poll` until it says frozen (`Ok(true)`) or
/// `confirm` has passed (`Ok(false)`: still freezing); an error ends the
/// wait at once.
async fn confirm_frozen<E>(
    mut is_frozen: impl FnMut() -> Result<bool, E>,
    confirm: Duration,
    poll: Duration,
) -> Result<bool, E> {
    let deadline = Instant::now() + confirm;
    loop {
        if is_frozen()? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(poll).await;
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The shim's view of its program while it runs.
struct Shim {
    state_path: PathBuf,
    fencing: bool,
    state: ShimState,
    pgid: Pid,
    /// The handle on every process of the instance.
    freeze_by: FreezeMechanism,
    /// Whether the last freeze was by SIGSTOP (no cgroup freezer, or one
    /// that could not be written), so the thaw sends SIGCONT.
    stopped_by_signal: bool,
    events: broadcast::Sender<Arc<str>>,
    tail: Arc<Mutex<StderrTail>>,
    /// The hook that runs, if one does: its id and process group.
    hook: Option<(u64, u32)>,
    /// The fence deadline passed and no extension came since: the lease
    /// is unproven, so nothing thaws the program until berth extends the
    /// deadline, whatever else asks (a thaw raced with the deadline, or a
    /// berth that thought the program only hibernated).
    fence_passed: bool,
}

impl Shim {
    fn refresh_tail(&mut self) {
        if let Ok(tail) = self.tail.lock() {
            self.state.stderr_tail = tail.text();
        }
    }

    fn save(&mut self) {
        self.refresh_tail();
        if let Err(e) = state_file::write(&self.state_path, &self.state) {
            diag!("writing {}: {e}", self.state_path.display());
        }
    }

    fn emit(&self, event: &ShimEvent) {
        if let Some(line) = event_line(event) {
            // No receivers is fine: nobody is connected right now.
            let _ = self.events.send(line);
        }
    }

    fn hello(&mut self) -> Option<Arc<str>> {
        self.refresh_tail();
        event_line(&ShimEvent::Hello {
            state: self.state.clone(),
        })
    }

    fn signal_group(&self, sig: Signal) {
        match signal::killpg(self.pgid, sig) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
            Err(e) => diag!("{sig} to group {}: {e}", self.pgid),
        }
    }

    /// Freezes the program: through its cgroup where it has one (every
    /// process of the instance, whatever its session or group), else by
    /// SIGSTOP to every process of its account, or (level `none`) to its
    /// process group. `Frozen` is reported once the cgroup says so, or
    /// after [`FREEZE_CONFIRM`]: the request stays in place, and a task not
    /// frozen yet (in an uninterruptible sleep) freezes before it returns
    /// to user space.
    async fn freeze(&mut self) {
        // A hook acts for the program, so it never runs on while the
        // program is frozen (its lease may be in doubt).
        self.cut_off_hook();
        self.stopped_by_signal = false;
        let by_signal = match &self.freeze_by {
            FreezeMechanism::Cgroup(freezer) => match freezer.request(true) {
                Ok(()) => {
                    match confirm_frozen(|| freezer.is_frozen(), FREEZE_CONFIRM, FREEZE_POLL).await
                    {
                        Ok(true) => {}
                        Ok(false) => {
                            diag!("cgroup not frozen after {FREEZE_CONFIRM:?}; still freezing");
                        }
                        Err(e) => diag!("{e}"),
                    }
                    false
                }
                Err(e) => {
                    // Never less than a freeze by signal.
                    diag!("{e}; freezing by SIGSTOP instead");
                    true
                }
            },
            FreezeMechanism::Uid(_) | FreezeMechanism::ProcessGroupSignal => true,
        };
        if by_signal {
            self.signal_all(Signal::SIGSTOP).await;
            self.stopped_by_signal = true;
        }
        self.state.frozen = true;
        self.save();
        self.emit(&ShimEvent::Frozen);
    }

    /// `sig` (SIGSTOP, SIGCONT or SIGKILL) to every process of the
    /// program's account where it has one, else to its process group.
    async fn signal_all(&self, sig: Signal) {
        let Some(uid) = self.state.uid else {
            self.signal_group(sig);
            return;
        };
        let swept = tokio::task::spawn_blocking(move || match sig {
            Signal::SIGSTOP => sweep::stop_all(uid),
            Signal::SIGKILL => sweep::kill_all(uid),
            _ => {
                sweep::continue_all(uid);
                Vec::new()
            }
        })
        .await;
        match swept {
            Ok(left) if left.is_empty() => {}
            Ok(left) => diag!("{sig} to uid {uid}: not taken yet by {left:?}"),
            Err(e) => diag!("{sig} to uid {uid}: {e}"),
        }
    }

    async fn thaw(&mut self) {
        if let FreezeMechanism::Cgroup(freezer) = &self.freeze_by
            && let Err(e) = freezer.request(false)
        {
            diag!("{e}");
        }
        if self.stopped_by_signal {
            self.signal_all(Signal::SIGCONT).await;
        }
        self.stopped_by_signal = false;
        self.state.frozen = false;
        self.save();
        self.emit(&ShimEvent::Thawed);
    }

    /// SIGKILL to the program's group and to every process of the handle
    /// that holds the instance: a stopped process dies of SIGKILL, and so
    /// does a frozen cgroup (see [`crate::isolation::cgroup::CgroupFreezer::kill_all`]). A frozen
    /// program is killed, never thawed to be stopped.
    async fn kill_all(&self) {
        self.cut_off_hook();
        self.signal_group(Signal::SIGKILL);
        match &self.freeze_by {
            FreezeMechanism::Cgroup(freezer) => {
                let freezer = freezer.clone();
                match tokio::task::spawn_blocking(move || freezer.kill_all()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => diag!("{e}"),
                    Err(e) => diag!("killing the cgroup: {e}"),
                }
            }
            FreezeMechanism::Uid(_) => self.signal_all(Signal::SIGKILL).await,
            FreezeMechanism::ProcessGroupSignal => {}
        }
    }

    /// SIGKILL to the running hook's process group, if a hook runs; its
    /// task then reports it killed.
    fn cut_off_hook(&self) {
        if let Some((_, pgid)) = self.hook {
            let _ = signal::killpg(pid_of(pgid), Signal::SIGKILL);
        }
    }

    /// Starts a [`ShimCommand::Hook`] on `hooks`, or answers at once why
    /// it cannot run.
    fn start_hook(
        &mut self,
        spec: &ShimSpec,
        cgroup: Option<&InstanceCgroup>,
        hooks: &mut JoinSet<(u64, HookOutcome)>,
        (id, name, argv, grace_ms): (u64, String, Vec<String>, u64),
    ) {
        let refused = if self.state.frozen {
            Some("the instance is frozen".to_owned())
        } else if self.hook.is_some() {
            Some("another hook is running".to_owned())
        } else {
            match hook::spawn(spec, cgroup, self.state.pid, &name, &argv) {
                Ok(started) => {
                    self.hook = Some((id, started.pgid));
                    let grace = Duration::from_millis(grace_ms);
                    hooks.spawn(async move { (id, hook::finish(started, grace).await) });
                    None
                }
                Err(e) => Some(e),
            }
        };
        if let Some(why) = refused {
            diag!("hook {name} not run: {why}");
            self.emit(&ShimEvent::HookDone {
                id,
                outcome: Err(why),
            });
        }
    }

    fn hook_done(&mut self, done: Result<(u64, HookOutcome), tokio::task::JoinError>) {
        let Some((id, _)) = self.hook.take() else {
            return;
        };
        let outcome = done
            .map(|(_, outcome)| outcome)
            .map_err(|e| format!("the hook's task failed: {e}"));
        self.emit(&ShimEvent::HookDone { id, outcome });
    }

    fn ready(&mut self, token: Option<String>) {
        self.state.ready = true;
        self.state.token.clone_from(&token);
        self.save();
        self.emit(&ShimEvent::Ready { token });
    }

    async fn command(
        &mut self,
        command: ShimCommand,
        fence: &mut Option<Instant>,
        kill_at: &mut Option<Instant>,
    ) {
        match command {
            ShimCommand::Stop { .. } if self.state.frozen => {
                // Never thawed to be stopped: frozen by a fence deadline,
                // its lease may be another node's by now, and a program
                // that flushes on SIGTERM would write as a stale holder.
                // SIGKILL ends a stopped group without running it.
                diag!("stop of a frozen program: killing it without a thaw");
                self.kill_all().await;
            }
            ShimCommand::Stop { grace_ms } => {
                self.signal_group(Signal::SIGTERM);
                let at = deadline_after(grace_ms);
                *kill_at = Some(kill_at.map_or(at, |k| k.min(at)));
            }
            ShimCommand::Kill => self.kill_all().await,
            ShimCommand::Freeze => self.freeze().await,
            ShimCommand::Thaw if self.fence_passed => {
                diag!("thaw refused: the fence deadline passed and was not extended");
                // Said again, so that berth counts the program fenced.
                self.emit(&ShimEvent::Frozen);
            }
            ShimCommand::Thaw => self.thaw().await,
            ShimCommand::Hook { id, .. } => {
                // Started by the supervising loop, which owns the hooks.
                diag!("hook {id} reached the command handler; ignored");
            }
            ShimCommand::Extend { ms } => {
                // Deliberately no thaw: only berth knows whether the lease
                // is still its own.
                if self.fencing {
                    *fence = Some(deadline_after(ms));
                    self.fence_passed = false;
                }
            }
        }
    }
}

fn event_line(event: &ShimEvent) -> Option<Arc<str>> {
    match serde_json::to_string(event) {
        Ok(mut line) => {
            line.push('\n');
            Some(line.into())
        }
        Err(e) => {
            diag!("cannot encode event: {e}");
            None
        }
    }
}

fn exit_info(status: &io::Result<ExitStatus>) -> ExitInfo {
    match status {
        Ok(status) => ExitInfo {
            code: status.code(),
            signal: status.signal(),
            oom_limit_mb: None,
        },
        Err(_) => ExitInfo {
            code: None,
            signal: None,
            oom_limit_mb: None,
        },
    }
}

/// Reaps the exited orphans the shim adopted as subreaper, never the
/// program itself or a running hook (their `Child`ren wait for those).
/// Returns how many children other than the program are left.
fn reap_orphans(program: u32, hook: Option<u32>) -> usize {
    use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
    let Ok(tasks) = fs::read_dir("/proc/self/task") else {
        return 0;
    };
    let mut left = 0;
    for task in tasks.flatten() {
        let Ok(children) = fs::read_to_string(task.path().join("children")) else {
            continue;
        };
        for pid in adopted_orphans(&children, program, hook) {
            // Anything else: reaped now, or not a child any more.
            if let Ok(WaitStatus::StillAlive) = waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                left += 1;
            }
        }
    }
    left
}

/// The orphans in one task's `children` listing: every pid but the
/// program's and a running hook's. Their `Child`ren wait for those two,
/// and a status taken here would be lost to them (the program's exit
/// would then read as unknown).
fn adopted_orphans(children: &str, program: u32, hook: Option<u32>) -> impl Iterator<Item = Pid> {
    children
        .split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .filter(move |&pid| pid != program && Some(pid) != hook)
        .filter_map(|pid| i32::try_from(pid).ok().map(Pid::from_raw))
}

/// Supervises the program until it exits; returns how it ended. `pod`:
/// the shim is a pod's entrypoint (see [`crate::shim::pod`]).
pub(super) async fn supervise(
    spec: ShimSpec,
    started: Started,
    pod: Option<PodControl>,
) -> ExitInfo {
    let Started {
        mut child,
        state,
        listener,
        log,
        ready_regex,
        cgroup,
        ends,
        memory_max_mb,
        relay: _relay,
    } = started;
    let tail = Arc::new(Mutex::new(StderrTail::default()));
    let (piece_tx, piece_rx) = mpsc::channel(64);
    let mut pumps = JoinSet::new();
    if let Some(stdout) = child.stdout.take() {
        pumps.spawn(output::pump(Stream::Stdout, stdout, piece_tx.clone()));
    }
    if let Some(stderr) = child.stderr.take() {
        pumps.spawn(output::pump(Stream::Stderr, stderr, piece_tx.clone()));
    }
    drop(piece_tx);
    let (ready_tx, mut ready_rx) = oneshot::channel();
    let mut logger = tokio::spawn({
        let tail = Arc::clone(&tail);
        async move { output::log_writer(piece_rx, log, ready_regex, ready_tx, tail).await }
    });

    let (events, _) = broadcast::channel(EVENT_BACKLOG);
    let mut shim = Shim {
        state_path: spec.state_path.clone(),
        fencing: spec.fence_ms.is_some(),
        pgid: pid_of(state.pid),
        freeze_by: FreezeMechanism::for_instance(cgroup.as_ref(), state.uid),
        stopped_by_signal: false,
        state,
        events,
        tail,
        hook: None,
        fence_passed: false,
    };
    let mut hooks = JoinSet::new();
    let (cmd_tx, mut cmd_rx) = mpsc::channel(32);
    let mut clients = JoinSet::new();
    let mut fence = spec.fence_ms.map(deadline_after);
    let mut kill_at = None;
    let mut awaiting_ready = true;
    let program_pid = shim.state.pid;
    let mut orphan_exits =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()).ok();
    // In a pod, the kubelet ends the pod by SIGTERM to its entrypoint, the
    // shim: that is a stop, with its grace.
    let mut terminations = match &pod {
        Some(_) => tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok(),
        None => None,
    };
    let (shown_tx, mut shown_rx) = mpsc::channel(8);
    let mut checks = JoinSet::new();

    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            Some(()) = async {
                match orphan_exits.as_mut() {
                    Some(exits) => exits.recv().await,
                    None => std::future::pending().await,
                }
            } => {
                reap_orphans(program_pid, shim.hook.map(|(_, pgid)| pgid));
            }
            token = &mut ready_rx, if awaiting_ready => {
                awaiting_ready = false;
                if let Ok(token) = token {
                    shim.ready(token);
                }
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) if !from_own_uid(&stream) => {
                    // Only berth (the shim's own uid) may command it: a
                    // program must not kill, freeze or extend any instance.
                    drop(stream);
                }
                Ok((stream, _)) => {
                    // Subscribing and taking the Hello snapshot in one step
                    // means the client misses no event and sees none twice.
                    let events = shim.events.subscribe();
                    if let Some(hello) = shim.hello() {
                        let (read, write) = stream.into_split();
                        let read = tokio::io::BufReader::new(read);
                        clients.spawn(serve_client(read, write, hello, events, cmd_tx.clone()));
                    }
                }
                Err(e) => {
                    diag!("accept: {e}");
                    // E.g. out of descriptors: do not spin.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            accepted = accept_remote(pod.as_ref()) => match accepted {
                Ok(stream) if checks.len() < MAX_PENDING_CHECKS => {
                    // The check waits for the client; the loop does not.
                    let credential = pod.as_ref().map(|p| Arc::clone(&p.credential));
                    let shown_tx = shown_tx.clone();
                    checks.spawn(async move {
                        let credential = credential.unwrap_or_else(|| Arc::from(""));
                        if let Some(shown) = credential_shown(stream, &credential).await {
                            let _ = shown_tx.send(shown).await;
                        }
                    });
                }
                Ok(stream) => drop(stream),
                Err(e) => {
                    diag!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some((read, write)) = shown_rx.recv() => {
                let events = shim.events.subscribe();
                if let Some(hello) = shim.hello() {
                    clients.spawn(serve_client(read, write, hello, events, cmd_tx.clone()));
                }
            }
            Some(_) = checks.join_next(), if !checks.is_empty() => {}
            Some(()) = async {
                match terminations.as_mut() {
                    Some(terms) => terms.recv().await,
                    None => std::future::pending().await,
                }
            } => {
                let grace_ms = pod.as_ref().map_or(0, |p| p.stop_grace_ms);
                diag!("SIGTERM: stopping the program");
                shim.command(ShimCommand::Stop { grace_ms }, &mut fence, &mut kill_at).await;
            }
            Some(command) = cmd_rx.recv() => match command {
                ShimCommand::Hook { id, name, argv, grace_ms } => {
                    shim.start_hook(&spec, cgroup.as_ref(), &mut hooks, (id, name, argv, grace_ms));
                }
                command => shim.command(command, &mut fence, &mut kill_at).await,
            },
            Some(done) = hooks.join_next(), if !hooks.is_empty() => shim.hook_done(done),
            () = sleep_until_opt(fence) => {
                fence = None;
                shim.fence_passed = true;
                diag!("fence deadline passed; freezing the program");
                if !shim.state.frozen {
                    shim.freeze().await;
                }
            }
            () = sleep_until_opt(kill_at) => {
                kill_at = None;
                shim.kill_all().await;
            }
            Some(_) = clients.join_next(), if !clients.is_empty() => {}
        }
    };

    // Never leave orphans: whatever the program started goes with it. Its
    // pid is reaped, but the group id cannot be reused while members live.
    shim.kill_all().await;
    // What was killed dies a moment later; its orphans are reaped here.
    let reaping_ends = Instant::now() + DRAIN_TIMEOUT;
    hooks.abort_all();
    while reap_orphans(program_pid, None) > 0 && Instant::now() < reaping_ends {
        tokio::time::sleep(ORPHAN_POLL).await;
    }
    if tokio::time::timeout(DRAIN_TIMEOUT, &mut logger)
        .await
        .is_err()
    {
        diag!("output still open after exit; abandoning it");
        pumps.abort_all();
        logger.abort();
    }
    if awaiting_ready && let Ok(token) = ready_rx.try_recv() {
        shim.ready(token);
    }
    let mut exit = exit_info(&status);
    // In a sandbox the shim's child is the namespace's init, which reports
    // how the program itself ended.
    if let Some(status_pipe) = ends.as_ref().and_then(|e| e.status.as_ref())
        && let Some((code, signal)) = child::decode_status(&child::read_pipe(status_pipe))
    {
        exit.code = code;
        exit.signal = signal;
    }
    if let Some(cgroup) = &cgroup {
        if exit.signal == Some(nix::libc::SIGKILL) && cgroup.oom_kills().unwrap_or(0) > 0 {
            exit.oom_limit_mb = memory_max_mb;
        }
        for (dir, e) in cgroup.remove() {
            diag!("cannot remove cgroup {}: {e}", dir.display());
        }
    }
    drop(ends);
    if let Err(e) = &status {
        diag!("waiting for the program: {e}");
    }
    diag!("program exited: {exit:?}");
    shim.state.exit = Some(exit);
    shim.save();
    drop(listener);
    let _ = fs::remove_file(&spec.socket_path);
    shim.emit(&ShimEvent::Exited {
        exit,
        stderr_tail: shim.state.stderr_tail.clone(),
    });
    // Clients drain what is queued, then see the channel close.
    drop(shim);
    drop(cmd_rx);
    drop(cmd_tx);
    checks.abort_all();
    let farewell = async { while clients.join_next().await.is_some() {} };
    if tokio::time::timeout(FAREWELL_TIMEOUT, farewell)
        .await
        .is_err()
    {
        clients.abort_all();
    }
    exit
}

/// The next connection to a pod's control port; never, outside a pod.
async fn accept_remote(pod: Option<&PodControl>) -> std::io::Result<tokio::net::TcpStream> {
    match pod {
        Some(pod) => pod.listener.accept().await.map(|(stream, _)| stream),
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs [`confirm_frozen`] on a freezer that reads `FREEZING`
    /// `settles_after` times, then `FROZEN`: its answer, how many reads it
    /// took, and how long it waited (by tokio's paused clock, which moves
    /// only by the polls).
    async fn confirm_settling_after(settles_after: usize) -> (Result<bool, ()>, usize, Duration) {
        let mut reads = 0;
        let started = Instant::now();
        let confirmed = confirm_frozen(
            || {
                reads += 1;
                Ok(reads > settles_after)
            },
            FREEZE_CONFIRM,
            FREEZE_POLL,
        )
        .await;
        (confirmed, reads, started.elapsed())
    }

    /// A fence or stop deadline berth sends is a number of milliseconds,
    /// any `u64`: the furthest is a century away.
    #[tokio::test(start_paused = true)]
    async fn a_deadline_is_its_milliseconds_from_now_a_century_at_most() {
        let now = Instant::now();
        assert_eq!(deadline_after(1_500), now + Duration::from_millis(1_500));
        assert_eq!(deadline_after(u64::MAX), now + FAR_FUTURE);
        assert_eq!(FAR_FUTURE.as_secs(), 3_153_600_000);
    }

    #[test]
    fn the_program_and_a_running_hook_are_never_reaped_as_orphans() {
        let orphans = |children, hook| {
            adopted_orphans(children, 12, hook)
                .map(Pid::as_raw)
                .collect::<Vec<_>>()
        };
        assert_eq!(orphans("12 34 56\n", Some(34)), [56]);
        assert_eq!(orphans("34 12 56", None), [34, 56]);
        assert_eq!(orphans("12", Some(34)), [] as [i32; 0]);
        assert_eq!(orphans("", None), [] as [i32; 0]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_freeze_is_confirmed_once_the_cgroup_reads_frozen_and_not_before() {
        let (confirmed, reads, waited) = confirm_settling_after(3).await;
        assert_eq!(confirmed, Ok(true));
        assert_eq!(reads, 4, "three reads of FREEZING, then FROZEN");
        assert_eq!(waited, 3 * FREEZE_POLL);
    }

    #[tokio::test(start_paused = true)]
    async fn a_freeze_that_does_not_settle_is_waited_for_its_whole_confirm_time() {
        let (confirmed, reads, waited) = confirm_settling_after(usize::MAX).await;
        assert_eq!(confirmed, Ok(false), "reported still freezing");
        assert!(waited >= FREEZE_CONFIRM, "gave up after {waited:?}");
        assert!(reads > 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_freezer_that_cannot_be_read_ends_the_wait_at_once() {
        let mut reads = 0;
        let confirmed = confirm_frozen(
            || {
                reads += 1;
                Err::<bool, _>("gone")
            },
            FREEZE_CONFIRM,
            FREEZE_POLL,
        )
        .await;
        assert_eq!(confirmed, Err("gone"));
        assert_eq!(reads, 1);
    }
}
