//! The shim: the small parent process that keeps one instance alive while
//! berth itself comes and goes (in the spirit of containerd-shim and
//! podman's conmon).
//!
//! berth re-executes itself once as the zygote (`berth shim`, see
//! [`ShimLauncher`]), which forks one shim per instance: berth hands it a
//! [`ShimSpec`] and a pipe, and reads back one JSON [`SpawnReport`] line
//! from that pipe. From then on berth and the shim talk over a unix socket
//! ([`ShimSpec::socket_path`]) in newline-delimited JSON: [`ShimCommand`]s
//! in, [`ShimEvent`]s out. The shim:
//!
//! * calls `setsid` so it outlives berth, and runs a single-threaded runtime
//!   (a parent-death signal fires when the spawning *thread* exits);
//! * spawns the program in its own process group with `PR_SET_PDEATHSIG =
//!   SIGKILL`, so the instance dies with its shim and is never unfenced;
//!   at isolation levels `user` and `sandbox` ([`ShimSpec::isolation`]) it
//!   first creates the instance's cgroup and pid namespace, and the forked
//!   child drops to the user's account (and enters the sandbox) before it
//!   executes the program (`crate::isolation::child`); in a sandbox the
//!   shim's child is the pid namespace's init, which reports the program's
//!   exit, and an OOM kill is reported with the memory limit;
//! * appends the program's stdout and stderr to [`ShimSpec::log_path`],
//!   matches [`ShimSpec::ready_regex`] against each line and keeps the first
//!   capture as the launch token, and keeps the last 500 characters of
//!   stderr;
//! * keeps [`ShimState`] in [`ShimSpec::state_path`] (written atomically),
//!   which is how a restarted berth finds and re-attaches to it, and how the
//!   exit status survives when no berth is listening;
//! * enforces the fence deadline when [`ShimSpec::fence_ms`] is set: if berth
//!   does not extend it in time the program is frozen, and no thaw runs it
//!   again until berth extends the deadline;
//! * takes commands only from its own uid, berth's (`SO_PEERCRED`);
//! * when the program exits, kills what is left of its process group,
//!   removes its cgroup, records the exit in the state file, tells
//!   connected clients, and exits.

/// A diagnostic line for the shim's own log (`<state_path>.shim.log` once
/// it has detached), stamped so it can be lined up with berth's logs.
macro_rules! diag {
    ($($arg:tt)*) => {{
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        // One write: stderr is unbuffered, and a line written piecewise
        // costs a syscall per piece.
        let line = format!("{ms} berth shim[{}]: {}\n", std::process::id(), format_args!($($arg)*));
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }};
}

mod client;
mod launcher;
mod log_file;
pub(crate) mod output;
mod pidfd;
pub mod pod;
pub(crate) mod procfs;
mod protocol;
mod server;
mod state_file;
mod zygote;

pub use client::{ShimControl, ShimError, ShimHandle};
pub use launcher::ShimLauncher;
pub use protocol::{ExitInfo, ShimCommand, ShimEvent, ShimSpec, ShimState, SpawnReport};

/// The entry of berth's helper processes, `berth shim …`: the zygote
/// (no further argument), a sandbox's relay (`relay`) or a pod's entrypoint (`pod -- PROGRAM…`,
/// see [`pod`]). Returns the exit code.
pub fn run() -> i32 {
    let mut args = std::env::args_os().skip(2);
    let first = args.next();
    if first.as_deref() == Some(std::ffi::OsStr::new(pod::POD_ARG)) {
        return pod::run(args);
    }
    match (first, args.next()) {
        (None, _) => zygote::run(),
        (Some(mode), None) if mode == crate::isolation::relay::RELAY_ARG => {
            crate::isolation::relay::serve()
        }
        (mode, _) => {
            diag!("unknown helper mode {mode:?}");
            2
        }
    }
}
