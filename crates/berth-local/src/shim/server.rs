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

use super::log_file::LogFile;
use super::output::{self, StderrTail, Stream};
use super::protocol::{ExitInfo, ShimCommand, ShimEvent, ShimSpec, ShimState, SpawnReport};
use super::{procfs, state_file};
use crate::isolation::access::may_execute;
use crate::isolation::cgroup::{FreezeMechanism, InstanceCgroup};
use crate::isolation::child::{self, ChildPlan, ShimEnds};
use crate::isolation::sweep;

/// `sun_path` is 108 bytes on Linux, including the terminating NUL.
const MAX_SOCKET_PATH: usize = 108;

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
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(BLOCKING_THREADS)
        .thread_keep_alive(BLOCKING_KEEP_ALIVE)
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

/// How often the shim looks for killed orphans to reap once the program
/// has ended.
const ORPHAN_POLL: Duration = Duration::from_millis(5);

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
    supervise(spec, started).await
}

/// A program that runs, with everything the shim set up around it.
struct Started {
    child: Child,
    state: ShimState,
    listener: UnixListener,
    log: LogFile,
    ready_regex: Option<Regex>,
    /// The program's cgroup (levels `user` and `sandbox`), removed once it
    /// has ended.
    cgroup: Option<InstanceCgroup>,
    /// The shim's ends of the isolation setup's pipes.
    ends: Option<ShimEnds>,
    /// The memory limit in MiB, to report an OOM kill with.
    memory_max_mb: Option<u64>,
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
    let isolation = spec.isolation.as_ref();
    let program = resolve_program(spec)?;
    if let Some(sandbox) = isolation.and_then(|i| i.sandbox.as_ref())
        && let Some(hidden) = hidden_in_sandbox(&program, &sandbox.data_dir, &sandbox.user_root)
    {
        return Err(format!(
            "cannot start program {name:?}: {} lies under {}, which the sandbox replaces \
                 with a private one; install the program elsewhere",
            program.display(),
            hidden.display()
        ));
    }
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
    let log = LogFile::open(
        &spec.log_path,
        spec.user_root.as_deref(),
        spec.log_max_bytes,
    )
    .map_err(|e| {
        format!(
            "cannot open log {:?} for program {name:?}: {}",
            spec.log_path,
            describe(&e)
        )
    })?;
    let listener = bind(&spec.socket_path)?;
    let cgroup = match isolation.and_then(|i| i.cgroup.as_ref()) {
        Some(spec_cgroup) => {
            let cgroup = InstanceCgroup::new(
                spec_cgroup.parents.clone(),
                format!(
                    "{}.{}.{}",
                    spec.instance_id,
                    spec.role.as_str(),
                    std::process::id()
                ),
            );
            if let Err(e) = cgroup.create(&spec_cgroup.limits) {
                let _ = fs::remove_file(&spec.socket_path);
                return Err(format!("cannot start program {name:?}: {e}"));
            }
            Some(cgroup)
        }
        None => None,
    };
    let cleanup = |child: Option<&mut Child>| {
        if let Some(child) = child
            && let Some(pid) = child.id()
        {
            let _ = signal::killpg(pid_of(pid), Signal::SIGKILL);
        }
        let _ = fs::remove_file(&spec.socket_path);
        if let Some(cgroup) = &cgroup {
            cgroup.remove();
        }
    };
    let plan = match isolation {
        Some(isolation) => match prepare_isolation(isolation, &spec.cwd, cgroup.as_ref()) {
            Ok(plan) => Some(plan),
            Err(e) => {
                cleanup(None);
                return Err(format!("cannot start program {name:?}: {e}"));
            }
        },
        None => None,
    };
    let (plan, mut ends) = match plan {
        Some((plan, ends)) => (Some(plan), Some(ends)),
        None => (None, None),
    };
    let spawned = spawn_program(spec, &program, plan);
    // The child has its copies (or failed); the shim must not keep them
    // open, or a pipe would never report the end of its writer.
    if let Some(ends) = ends.as_mut() {
        ends.child_only.clear();
    }
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            cleanup(None);
            let step = ends
                .as_ref()
                .map(|ends| String::from_utf8_lossy(&child::read_pipe(&ends.diag)).into_owned())
                .filter(|s| !s.is_empty());
            return Err(match step {
                Some(step) => format!(
                    "cannot start program {name:?}: isolation setup failed ({step}): {}",
                    describe(&e)
                ),
                None => format!("cannot execute {:?}: {}", program, describe(&e)),
            });
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
        uid: isolation.map(|i| i.uid),
        cgroup: cgroup
            .as_ref()
            .map(InstanceCgroup::dirs)
            .unwrap_or_default(),
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
        cgroup,
        ends,
        memory_max_mb: isolation
            .and_then(|i| i.cgroup.as_ref())
            .map(|c| c.limits.memory_max_mb),
    })
}

/// The plan of the isolated child, made in the shim. For a sandbox the
/// shim first moves into a network namespace of its own, with its loopback
/// up and nothing else (berth reaches the program there through
/// `/proc/<shim>/ns/net`; no other account's program can listen on, or
/// connect to, anything in it), and gives its next child a pid namespace
/// of its own (the child becomes its init).
fn prepare_isolation(
    isolation: &crate::isolation::IsolationSpec,
    cwd: &Path,
    cgroup: Option<&InstanceCgroup>,
) -> Result<(ChildPlan, ShimEnds), String> {
    let planned = ChildPlan::build(isolation, cwd, cgroup)?;
    if isolation.sandbox.is_some() {
        // Only this thread moves (the blocking pool's threads stay where
        // they are): the program is spawned on this very thread.
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| format!("cannot create a network namespace: {e}"))?;
        berth_localnet::loopback_up()
            .map_err(|e| format!("cannot bring up the sandbox's loopback: {}", describe(&e)))?;
        // SAFETY: unshare(2) with one flag; CLONE_NEWPID changes only the
        // namespace of this thread's future children (this single-threaded
        // runtime spawns the program on this very thread).
        if unsafe { nix::libc::unshare(nix::libc::CLONE_NEWPID) } != 0 {
            return Err(format!(
                "cannot create a pid namespace: {}",
                describe(&io::Error::last_os_error())
            ));
        }
    }
    Ok(planned)
}

/// The directory that hides `program` inside a sandbox (a private `/tmp`
/// or `/dev/shm`, or berth's data dir but the user's root), if any.
fn hidden_in_sandbox(program: &Path, data_dir: &Path, user_root: &Path) -> Option<PathBuf> {
    let real = fs::canonicalize(program).unwrap_or_else(|_| program.to_owned());
    for private in ["/tmp", "/dev/shm"] {
        if real.starts_with(private) {
            return Some(PathBuf::from(private));
        }
    }
    (real.starts_with(data_dir) && !real.starts_with(user_root)).then(|| data_dir.to_owned())
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
    let account = spec.isolation.as_ref().map(|i| (i.uid, i.gid));
    if argv0.contains('/') {
        let path = spec.cwd.join(argv0);
        return match fs::metadata(&path) {
            Ok(_) => match account {
                Some((uid, gid)) => match may_execute(&path, uid, gid) {
                    Ok(()) => Ok(path),
                    Err(why) => Err(format!("cannot execute {path:?} as uid {uid}: {why}")),
                },
                None => Ok(path),
            },
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
        // Like execvp, a file the program's user may not execute is passed
        // over for a later one it may.
        let allowed = match account {
            Some((uid, gid)) => may_execute(&candidate, uid, gid)
                .map_err(|why| format!("cannot execute {candidate:?} as uid {uid}: {why}")),
            None => nix::unistd::access(&candidate, AccessFlags::X_OK)
                .map_err(|_| format!("cannot execute {candidate:?}: Permission denied")),
        };
        match allowed {
            Ok(()) => return Ok(candidate),
            Err(why) => {
                denied.get_or_insert(why);
            }
        }
    }
    match denied {
        Some(why) => Err(why),
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

fn spawn_program(spec: &ShimSpec, program: &Path, plan: Option<ChildPlan>) -> io::Result<Child> {
    let mut cmd = tokio::process::Command::new(program);
    cmd.arg0(program_name(spec))
        .args(spec.argv.iter().skip(1))
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)));
    if let Some(plan) = plan {
        // The plan enters the working directory itself, after the mounts
        // and as the account.
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(false);
        // SAFETY: `enter` runs between fork and exec and is written for
        // exactly that: raw system calls on data the plan prepared, no
        // allocation, no lock (see `isolation::child`). The closure owns
        // the plan, so its strings and descriptors live until exec.
        unsafe {
            cmd.pre_exec(move || plan.enter());
        }
        return cmd.spawn();
    }
    cmd.current_dir(&spec.cwd)
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
    /// The handle on every process of the instance.
    freeze_by: FreezeMechanism,
    /// Whether the last freeze was by SIGSTOP (no cgroup freezer, or one
    /// that could not be written), so the thaw sends SIGCONT.
    stopped_by_signal: bool,
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

    /// Freezes the program: through its cgroup where it has one (every
    /// process of the instance, whatever its session or group), else by
    /// SIGSTOP to every process of its account, or (level `none`) to its
    /// process group. `Frozen` is reported once the cgroup says so, or
    /// after [`FREEZE_CONFIRM`]: the request stays in place, and a task not
    /// frozen yet (in an uninterruptible sleep) freezes before it returns
    /// to user space.
    async fn freeze(&mut self) {
        self.stopped_by_signal = false;
        let by_signal = match &self.freeze_by {
            FreezeMechanism::Cgroup(freezer) => match freezer.request(true) {
                Ok(()) => {
                    let deadline = Instant::now() + FREEZE_CONFIRM;
                    loop {
                        match freezer.is_frozen() {
                            Ok(true) => break,
                            Ok(false) if Instant::now() < deadline => {
                                tokio::time::sleep(FREEZE_POLL).await;
                            }
                            Ok(false) => {
                                diag!("cgroup not frozen after {FREEZE_CONFIRM:?}; still freezing");
                                break;
                            }
                            Err(e) => {
                                diag!("{e}");
                                break;
                            }
                        }
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
            ShimCommand::Thaw => self.thaw().await,
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
/// program itself (its `Child` waits for that one). Returns how many
/// children other than the program are left.
fn reap_orphans(program: u32) -> usize {
    use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
    let Ok(tasks) = fs::read_dir("/proc/self/task") else {
        return 0;
    };
    let mut left = 0;
    for task in tasks.flatten() {
        let Ok(children) = fs::read_to_string(task.path().join("children")) else {
            continue;
        };
        for pid in children
            .split_whitespace()
            .filter_map(|p| p.parse::<u32>().ok())
        {
            if pid == program {
                continue;
            }
            let Ok(raw) = i32::try_from(pid) else {
                continue;
            };
            // Anything else: reaped now, or not a child any more.
            if let Ok(WaitStatus::StillAlive) =
                waitpid(Pid::from_raw(raw), Some(WaitPidFlag::WNOHANG))
            {
                left += 1;
            }
        }
    }
    left
}

/// Whether the peer of a control connection runs as the shim's own uid
/// (berth's), by its kernel-given credentials (`SO_PEERCRED`).
fn from_own_uid(stream: &UnixStream) -> bool {
    match stream.peer_cred() {
        Ok(cred) if cred.uid() == nix::unistd::geteuid().as_raw() => true,
        Ok(cred) => {
            diag!(
                "refused a control connection from uid {} (pid {:?})",
                cred.uid(),
                cred.pid()
            );
            false
        }
        Err(e) => {
            diag!("refused a control connection with unknown credentials: {e}");
            false
        }
    }
}

async fn supervise(spec: ShimSpec, started: Started) -> i32 {
    let Started {
        mut child,
        state,
        listener,
        log,
        ready_regex,
        cgroup,
        ends,
        memory_max_mb,
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
    };
    let (cmd_tx, mut cmd_rx) = mpsc::channel(32);
    let mut clients = JoinSet::new();
    let mut fence = spec.fence_ms.map(deadline_after);
    let mut kill_at = None;
    let mut awaiting_ready = true;
    let program_pid = shim.state.pid;
    let mut orphan_exits =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()).ok();

    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            Some(()) = async {
                match orphan_exits.as_mut() {
                    Some(exits) => exits.recv().await,
                    None => std::future::pending().await,
                }
            } => {
                reap_orphans(program_pid);
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
                        clients.spawn(serve_client(stream, hello, events, cmd_tx.clone()));
                    }
                }
                Err(e) => {
                    diag!("accept: {e}");
                    // E.g. out of descriptors: do not spin.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(command) = cmd_rx.recv() => shim.command(command, &mut fence, &mut kill_at).await,
            () = sleep_until_opt(fence) => {
                fence = None;
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
    while reap_orphans(program_pid) > 0 && Instant::now() < reaping_ends {
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
