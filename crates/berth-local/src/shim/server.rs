//! One shim: the process the zygote forks for each instance.

use std::fs;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{self, SigHandler, Signal};
use nix::unistd::{AccessFlags, Pid};
use regex::bytes::Regex;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::process::Child;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::output::{self, StderrTail, Stream};
use super::protocol::{ExitInfo, ShimCommand, ShimEvent, ShimSpec, ShimState, SpawnReport};
use super::{procfs, state_file};

/// `sun_path` is 108 bytes on Linux, including the terminating NUL.
const MAX_SOCKET_PATH: usize = 108;

/// How long output may keep arriving after the program exited (from a
/// process that escaped its group and still holds the pipes).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// How long connected clients get to read the final `Exited` event.
const FAREWELL_TIMEOUT: Duration = Duration::from_secs(2);

/// Events a slow client may fall behind by before it is disconnected.
const EVENT_BACKLOG: usize = 256;

/// Runs one shim in a process the zygote has just forked, whose stdout is
/// the pipe berth reads the [`SpawnReport`] from. `ready_regex` is
/// `spec.ready_regex` already compiled, if the zygote had it. Never returns
/// until the program has exited; the caller exits with the returned code.
pub(super) fn run(spec: ShimSpec, ready_regex: Option<Regex>) -> i32 {
    // A new session: berth's death, its terminal and signals sent to its
    // process group must not reach the shim. Fails only if the shim already
    // leads a process group, in which case it is on its own anyway.
    let _ = nix::unistd::setsid();
    ignore_signal(Signal::SIGPIPE);
    ignore_signal(Signal::SIGHUP);

    // Single-threaded on purpose: the program's parent-death signal fires
    // when the thread that spawned it exits, so that thread must be the one
    // that lives as long as the shim.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
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

async fn shim_main(spec: ShimSpec, ready_regex: Option<Regex>) -> i32 {
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
    supervise(spec, started).await
}

/// A program that runs, with everything the shim set up around it.
struct Started {
    child: Child,
    state: ShimState,
    listener: UnixListener,
    log: tokio::fs::File,
    ready_regex: Option<Regex>,
}

/// Everything up to a running program, a listening socket and a state
/// file. On error nothing is left running.
fn start(spec: &ShimSpec, compiled: Option<Regex>) -> Result<Started, String> {
    let name = program_name(spec);
    let ready_regex = match (compiled, spec.ready_regex.as_deref()) {
        (_, None) => None,
        (Some(compiled), Some(_)) => Some(compiled),
        (None, Some(pattern)) => Some(
            Regex::new(pattern)
                .map_err(|e| format!("invalid ready regex for program {name:?}: {e}"))?,
        ),
    };
    let program = resolve_program(spec)?;
    match fs::metadata(&spec.cwd) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return Err(format!(
                "cannot start program {name:?}: working directory {:?} is not a directory",
                spec.cwd
            ));
        }
        Err(e) => {
            return Err(format!(
                "cannot start program {name:?}: working directory {:?}: {}",
                spec.cwd,
                describe(&e)
            ));
        }
    }
    let log = open_log(&spec.log_path).map_err(|e| {
        format!(
            "cannot open log {:?} for program {name:?}: {}",
            spec.log_path,
            describe(&e)
        )
    })?;
    let listener = bind(&spec.socket_path)?;
    let cleanup = |child: Option<&mut Child>| {
        if let Some(child) = child {
            if let Some(pid) = child.id() {
                let _ = signal::killpg(pid_of(pid), Signal::SIGKILL);
            }
        }
        let _ = fs::remove_file(&spec.socket_path);
    };
    let mut child = match spawn_program(spec, &program) {
        Ok(child) => child,
        Err(e) => {
            cleanup(None);
            return Err(format!("cannot execute {:?}: {}", program, describe(&e)));
        }
    };
    let Some(pid) = child.id() else {
        cleanup(Some(&mut child));
        return Err(format!("program {name:?} vanished right after it started"));
    };
    // Not reaped yet, so /proc/<pid> exists even if it already exited.
    let pid_start = match procfs::read_stat(pid) {
        Ok(stat) => stat.start_time,
        Err(e) => {
            cleanup(Some(&mut child));
            return Err(format!(
                "program {name:?} (pid {pid}): cannot read its start time: {e}"
            ));
        }
    };
    let state = ShimState {
        instance_id: spec.instance_id.clone(),
        user: spec.user.clone(),
        role: spec.role,
        epoch: spec.epoch,
        socket_path: spec.socket_path.clone(),
        shim_pid: std::process::id(),
        pid,
        pid_start,
        ready: false,
        token: None,
        exit: None,
        stderr_tail: String::new(),
        frozen: false,
        port: spec.port,
    };
    // In place before the report, so a berth that restarts right after it
    // finds this shim.
    if let Err(e) = state_file::write(&spec.state_path, &state) {
        cleanup(Some(&mut child));
        return Err(format!(
            "program {name:?}: cannot write state file {:?}: {e}",
            spec.state_path
        ));
    }
    Ok(Started {
        child,
        state,
        listener,
        log,
        ready_regex,
    })
}

/// Finds the file to execute, the way `execvp` would but with the
/// program's own `PATH`, so that a missing program is reported by name
/// instead of as a bare `ENOENT` from `exec`.
fn resolve_program(spec: &ShimSpec) -> Result<PathBuf, String> {
    let Some(argv0) = spec.argv.first() else {
        return Err("no program given (argv is empty)".to_owned());
    };
    if argv0.is_empty() {
        return Err("no program given (argv[0] is empty)".to_owned());
    }
    if argv0.contains('/') {
        let path = spec.cwd.join(argv0);
        return match fs::metadata(&path) {
            Ok(_) => Ok(path),
            Err(e) => Err(format!("program {argv0:?} not found: {}", describe(&e))),
        };
    }
    // Like the exec below, the last definition wins.
    let Some(path_var) = spec
        .env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v)
    else {
        return Err(format!(
            "program {argv0:?} not found: PATH is not set in its environment"
        ));
    };
    let mut denied = None;
    for dir in path_var.split(':') {
        // An empty entry means the current directory, which is the
        // program's working directory, not the shim's.
        let candidate = spec.cwd.join(dir).join(argv0);
        if !fs::metadata(&candidate).is_ok_and(|m| m.is_file()) {
            continue;
        }
        if nix::unistd::access(&candidate, AccessFlags::X_OK).is_ok() {
            return Ok(candidate);
        }
        denied.get_or_insert(candidate);
    }
    match denied {
        Some(path) => Err(format!("cannot execute {path:?}: Permission denied")),
        None => Err(format!("program {argv0:?} not found in PATH")),
    }
}

/// An error as `strerror` words, without Rust's "(os error N)" suffix.
fn describe(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(code) => nix::errno::Errno::from_raw(code).desc().to_owned(),
        None => e.to_string(),
    }
}

fn open_log(path: &Path) -> io::Result<tokio::fs::File> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        state_file::create_private_dir(dir)?;
    }
    let file = fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)?;
    Ok(tokio::fs::File::from_std(file))
}

fn bind(path: &Path) -> Result<UnixListener, String> {
    let len = path.as_os_str().as_bytes().len();
    if len >= MAX_SOCKET_PATH {
        return Err(format!(
            "socket path {path:?} is too long ({len} bytes; a unix socket path must be under {MAX_SOCKET_PATH})"
        ));
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        state_file::create_private_dir(dir)
            .map_err(|e| format!("cannot create socket directory {dir:?}: {}", describe(&e)))?;
    }
    // A socket left by a shim that was killed would make bind fail.
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(format!(
                "cannot remove stale socket {path:?}: {}",
                describe(&e)
            ));
        }
    }
    let listener = UnixListener::bind(path)
        .map_err(|e| format!("cannot listen on {path:?}: {}", describe(&e)))?;
    // Whoever can connect can kill the instance; the directory should
    // already keep others out, this covers one made by someone else.
    if let Err(e) = fs::set_permissions(path, fs::Permissions::from_mode(0o600)) {
        let _ = fs::remove_file(path);
        return Err(format!("cannot restrict {path:?}: {}", describe(&e)));
    }
    Ok(listener)
}

fn spawn_program(spec: &ShimSpec, program: &Path) -> io::Result<Child> {
    let mut cmd = tokio::process::Command::new(program);
    cmd.arg0(program_name(spec))
        .args(spec.argv.iter().skip(1))
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&spec.cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own group, so stop/freeze/kill reach everything it starts.
        .process_group(0)
        .kill_on_drop(false);
    let shim_pid = nix::unistd::getpid();
    // SAFETY: the closure runs in the forked child before exec, where only
    // async-signal-safe calls are allowed (another thread of the shim, e.g.
    // tokio's blocking pool, may have held a lock such as the allocator's at
    // fork time). It makes three system calls — prctl, getppid and
    // signal/sigaction, all async-signal-safe — through nix wrappers that do
    // not allocate, and builds errors from a raw errno, which does not
    // allocate either. It captures only a `Pid` (Copy).
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            // The shim may have died between fork and prctl, in which case
            // the signal will never come. An error here makes std `_exit`
            // the child before exec.
            if nix::unistd::getppid() != shim_pid {
                return Err(io::Error::from_raw_os_error(
                    nix::errno::Errno::ESRCH as i32,
                ));
            }
            // The shim ignores SIGHUP, and an ignored signal survives exec.
            signal::signal(Signal::SIGHUP, SigHandler::SigDfl)?;
            Ok(())
        });
    }
    cmd.spawn()
}

fn pid_of(pid: u32) -> Pid {
    Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX))
}

/// `ms` from now, saturating far in the future instead of overflowing.
fn deadline_after(ms: u64) -> Instant {
    let now = Instant::now();
    now.checked_add(Duration::from_millis(ms))
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
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
    events: broadcast::Sender<Arc<str>>,
    tail: Arc<Mutex<StderrTail>>,
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

    fn freeze(&mut self) {
        self.signal_group(Signal::SIGSTOP);
        self.state.frozen = true;
        self.save();
        self.emit(&ShimEvent::Frozen);
    }

    fn thaw(&mut self) {
        self.signal_group(Signal::SIGCONT);
        self.state.frozen = false;
        self.save();
        self.emit(&ShimEvent::Thawed);
    }

    fn ready(&mut self, token: Option<String>) {
        self.state.ready = true;
        self.state.token.clone_from(&token);
        self.save();
        self.emit(&ShimEvent::Ready { token });
    }

    fn command(
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
                self.signal_group(Signal::SIGKILL);
            }
            ShimCommand::Stop { grace_ms } => {
                self.signal_group(Signal::SIGTERM);
                let at = deadline_after(grace_ms);
                *kill_at = Some(kill_at.map_or(at, |k| k.min(at)));
            }
            ShimCommand::Kill => self.signal_group(Signal::SIGKILL),
            ShimCommand::Freeze => self.freeze(),
            ShimCommand::Thaw => self.thaw(),
            ShimCommand::Extend { ms } => {
                // Deliberately no thaw: only berth knows whether the lease
                // is still its own.
                if self.fencing {
                    *fence = Some(deadline_after(ms));
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
        },
        Err(_) => ExitInfo {
            code: None,
            signal: None,
        },
    }
}

async fn supervise(spec: ShimSpec, started: Started) -> i32 {
    let Started {
        mut child,
        state,
        listener,
        log,
        ready_regex,
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
        let log_path = spec.log_path.clone();
        async move { output::log_writer(piece_rx, log, &log_path, ready_regex, ready_tx, tail).await }
    });

    let (events, _) = broadcast::channel(EVENT_BACKLOG);
    let mut shim = Shim {
        state_path: spec.state_path.clone(),
        fencing: spec.fence_ms.is_some(),
        pgid: pid_of(state.pid),
        state,
        events,
        tail,
    };
    let (cmd_tx, mut cmd_rx) = mpsc::channel(32);
    let mut clients = JoinSet::new();
    let mut fence = spec.fence_ms.map(deadline_after);
    let mut kill_at = None;
    let mut awaiting_ready = true;

    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            token = &mut ready_rx, if awaiting_ready => {
                awaiting_ready = false;
                if let Ok(token) = token {
                    shim.ready(token);
                }
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    // Subscribing and taking the Hello snapshot in one step
                    // means the client misses no event and sees none twice.
                    let events = shim.events.subscribe();
                    if let Some(hello) = shim.hello() {
                        clients.spawn(serve_client(stream, hello, events, cmd_tx.clone()));
                    }
                }
                Err(e) => {
                    diag!("accept: {e}");
                    // E.g. out of descriptors: do not spin.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(command) = cmd_rx.recv() => shim.command(command, &mut fence, &mut kill_at),
            () = sleep_until_opt(fence) => {
                fence = None;
                diag!("fence deadline passed; freezing the program");
                if !shim.state.frozen {
                    shim.freeze();
                }
            }
            () = sleep_until_opt(kill_at) => {
                kill_at = None;
                shim.signal_group(Signal::SIGKILL);
            }
            Some(_) = clients.join_next(), if !clients.is_empty() => {}
        }
    };

    // Never leave orphans: whatever the program started goes with it. Its
    // pid is reaped, but the group id cannot be reused while members live.
    shim.signal_group(Signal::SIGKILL);
    if tokio::time::timeout(DRAIN_TIMEOUT, &mut logger)
        .await
        .is_err()
    {
        diag!("output still open after exit; abandoning it");
        pumps.abort_all();
        logger.abort();
    }
    if awaiting_ready {
        if let Ok(token) = ready_rx.try_recv() {
            shim.ready(token);
        }
    }
    let exit = exit_info(&status);
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
    let farewell = async { while clients.join_next().await.is_some() {} };
    if tokio::time::timeout(FAREWELL_TIMEOUT, farewell)
        .await
        .is_err()
    {
        clients.abort_all();
    }
    0
}

/// One client connection: `hello`, then every event; commands it sends are
/// passed to the main loop.
async fn serve_client(
    stream: UnixStream,
    hello: Arc<str>,
    mut events: broadcast::Receiver<Arc<str>>,
    commands: mpsc::Sender<ShimCommand>,
) {
    let (read, mut write) = stream.into_split();
    if write.write_all(hello.as_bytes()).await.is_err() {
        return;
    }
    let mut lines = BufReader::new(read).lines();
    // A client that has shut down its sending side (e.g. dropped every
    // `ShimControl`) may still be listening for events.
    let mut reading = true;
    loop {
        tokio::select! {
            event = events.recv() => match event {
                Ok(line) => {
                    if write.write_all(line.as_bytes()).await.is_err() {
                        return;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    // Closing tells the client it missed something; it can
                    // re-attach and get a fresh Hello.
                    diag!("client fell {n} events behind; disconnecting it");
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => {
                    let _ = write.shutdown().await;
                    return;
                }
            },
            line = lines.next_line(), if reading => match line {
                Ok(Some(line)) if line.trim().is_empty() => {}
                Ok(Some(line)) => match serde_json::from_str::<ShimCommand>(&line) {
                    Ok(command) => {
                        if commands.send(command).await.is_err() {
                            reading = false;
                        }
                    }
                    Err(e) => diag!("ignoring bad command {line:?}: {e}"),
                },
                Ok(None) | Err(_) => reading = false,
            },
        }
    }
}
