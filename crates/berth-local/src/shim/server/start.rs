//! Starting the program: everything up to a running program, a listening
//! socket and a state file, with nothing left running on failure.

use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use nix::sys::signal::{self, SigHandler, Signal};
use nix::unistd::AccessFlags;
use regex::Regex;
use tokio::net::UnixListener;
use tokio::process::Child;

use super::{pid_of, program_name};
use crate::isolation::access::may_execute;
use crate::isolation::cgroup::InstanceCgroup;
use crate::isolation::child::{self, ChildPlan, ShimEnds};
use crate::isolation::relay;
use crate::shim::log_file::LogFile;
use crate::shim::protocol::{ShimSpec, ShimState};
use crate::shim::{procfs, state_file};

/// `sun_path` is 108 bytes on Linux, including the terminating NUL.
const MAX_SOCKET_PATH: usize = 108;

/// A program that runs, with everything the shim set up around it.
pub(super) struct Started {
    pub(super) child: Child,
    pub(super) state: ShimState,
    pub(super) listener: UnixListener,
    pub(super) log: LogFile,
    pub(super) ready_regex: Option<Regex>,
    /// The program's cgroup (levels `user` and `sandbox`), removed once it
    /// has ended.
    pub(super) cgroup: Option<InstanceCgroup>,
    /// The shim's ends of the isolation setup's pipes.
    pub(super) ends: Option<ShimEnds>,
    /// The memory limit in MiB, to report an OOM kill with.
    pub(super) memory_max_mb: Option<u64>,
    /// A sandbox's relay. It lives outside the program's pid namespace,
    /// so the program's end does not end it; it is in the instance's
    /// cgroup, so the kill of everything left there at the end does.
    pub(super) relay: Option<Relay>,
}

/// A sandbox's relay ([`crate::isolation::relay`]): its process, also
/// killed when this is dropped, and the shim's ends of its setup's pipes.
pub(super) struct Relay {
    _child: Child,
    /// Where it listens on the sandbox's loopback.
    port: u16,
    _ends: ShimEnds,
}

/// Everything up to a running program, a listening socket and a state
/// file. On error nothing is left running.
pub(super) fn start(spec: &ShimSpec, compiled: Option<Regex>) -> Result<Started, String> {
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
    let (plan, mut ends, relay) = match plan {
        Some((plan, ends, relay)) => (Some(plan), Some(ends), relay),
        None => (None, None, None),
    };
    let proxy_env = relay
        .as_ref()
        .map(|relay| relay::proxy_env(relay.port))
        .unwrap_or_default();
    let spawned = spawn_program(spec, &program, plan, &proxy_env);
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
        relay,
        memory_max_mb: isolation
            .and_then(|i| i.cgroup.as_ref())
            .map(|c| c.limits.memory_max_mb),
    })
}

/// The plan of the isolated child, made in the shim. For a sandbox the
/// shim first moves into a network namespace of its own, with its loopback
/// up and nothing else (berth reaches the program there through
/// `/proc/<shim>/ns/net`; no other account's program can listen on, or
/// connect to, anything in it), starts the sandbox's relay (its way out,
/// listening on that loopback), and gives its next
/// child a pid namespace of its own (the child becomes its init).
fn prepare_isolation(
    isolation: &crate::isolation::IsolationSpec,
    cwd: &Path,
    cgroup: Option<&InstanceCgroup>,
) -> Result<(ChildPlan, ShimEnds, Option<Relay>), String> {
    let (plan, ends) = ChildPlan::build(isolation, cwd, cgroup)?;
    let mut relay = None;
    if isolation.sandbox.is_some() {
        // Opened before this thread leaves it: the relay goes back to it.
        let host_net = child::open_fd(
            Path::new("/proc/thread-self/ns/net"),
            nix::libc::O_RDONLY,
            "the host's network namespace",
        )?;
        // Only this thread moves (the blocking pool's threads stay where
        // they are): the program is spawned on this very thread.
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| format!("cannot create a network namespace: {e}"))?;
        berth_localnet::loopback_up()
            .map_err(|e| format!("cannot bring up the sandbox's loopback: {}", describe(&e)))?;
        // Before the pid namespace: the relay must not become its init.
        relay = Some(start_relay(isolation, cwd, cgroup, host_net)?);
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
    Ok((plan, ends, relay))
}

/// Starts a sandbox's relay: its listener bound on the loopback of the
/// network namespace this thread is in now (the sandbox's), and its
/// process (`berth shim relay`, the listener as its stdin) back in
/// `host_net`, as the instance's account, in its cgroup, with its
/// rlimits.
fn start_relay(
    isolation: &crate::isolation::IsolationSpec,
    cwd: &Path,
    cgroup: Option<&InstanceCgroup>,
    host_net: std::os::fd::OwnedFd,
) -> Result<Relay, String> {
    let listener = std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| format!("cannot listen for the sandbox's relay: {}", describe(&e)))?;
    let port = listener
        .local_addr()
        .map_err(|e| format!("cannot listen for the sandbox's relay: {}", describe(&e)))?
        .port();
    // Outside the sandbox: no mounts of its own, no namespace to join.
    let outside = crate::isolation::IsolationSpec {
        sandbox: None,
        ..isolation.clone()
    };
    let (plan, mut ends) = ChildPlan::beside(&outside, cwd, cgroup, 0)?;
    let exe = std::env::current_exe()
        .map_err(|e| format!("cannot find berth's executable for the relay: {e}"))?;
    let mut command = tokio::process::Command::new(exe);
    command
        .args(["shim", relay::RELAY_ARG])
        .env_clear()
        .stdin(Stdio::from(std::os::fd::OwnedFd::from(listener)))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    // SAFETY: runs between fork and exec: setns(2) on a descriptor the
    // closure owns (open until exec), then the plan's `enter`, written for
    // exactly this place (see `isolation::child`); a plan made by `beside`
    // without a sandbox makes none and never forks.
    unsafe {
        command.pre_exec(move || {
            use std::os::fd::AsRawFd;
            if nix::libc::setns(host_net.as_raw_fd(), nix::libc::CLONE_NEWNET) != 0 {
                return Err(io::Error::last_os_error());
            }
            plan.enter()
        });
    }
    let spawned = command.spawn();
    ends.child_only.clear();
    let child = spawned.map_err(|e| {
        let step = String::from_utf8_lossy(&child::read_pipe(&ends.diag)).into_owned();
        format!(
            "cannot start the sandbox's relay ({step}): {}",
            describe(&e)
        )
    })?;
    Ok(Relay {
        _child: child,
        port,
        _ends: ends,
    })
}

/// The directory that hides `program` inside a sandbox (a private `/tmp`
/// or `/dev/shm`, or berth's data dir but the user's root), if any.
pub(super) fn hidden_in_sandbox(
    program: &Path,
    data_dir: &Path,
    user_root: &Path,
) -> Option<PathBuf> {
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
    resolve(argv0, spec)
}

/// The file `argv0` names for a process run like `spec`'s program: as its
/// account, in its working directory, with its `PATH`.
pub(super) fn resolve(argv0: &str, spec: &ShimSpec) -> Result<PathBuf, String> {
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
pub(super) fn describe(e: &io::Error) -> String {
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

/// Spawns the program, with `extra_env` after its own (a sandbox's proxy
/// variables).
fn spawn_program(
    spec: &ShimSpec,
    program: &Path,
    plan: Option<ChildPlan>,
    extra_env: &[(String, String)],
) -> io::Result<Child> {
    let mut cmd = tokio::process::Command::new(program);
    cmd.arg0(program_name(spec))
        .args(spec.argv.iter().skip(1))
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .envs(extra_env.iter().map(|(k, v)| (k, v)));
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
    die_with_shim(&mut cmd);
    cmd.spawn()
}

/// Has the process `cmd` starts killed when the shim dies (level `none`;
/// an isolated one gets this from its plan).
pub(super) fn die_with_shim(cmd: &mut tokio::process::Command) {
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
}
