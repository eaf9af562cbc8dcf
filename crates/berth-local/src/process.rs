//! Last-resort signals sent by berth itself (when a shim does not answer),
//! guarded against pid reuse.

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

/// SIGKILLs the program's process group and its shim, but only if `pid`
/// still is the process that started at `pid_start`.
pub(crate) fn kill_instance(pid: Option<u32>, pid_start: Option<u64>, shim_pid: Option<u32>) {
    let (Some(pid), Some(pid_start)) = (pid, pid_start) else {
        return;
    };
    // The same `/proc/<pid>/stat` reading the shim records `pid_start`
    // with, so the two can never disagree on what a start time is.
    match crate::shim::procfs::read_stat(pid) {
        Ok(stat) if stat.start_time == pid_start => {}
        _ => return,
    }
    let Ok(raw) = i32::try_from(pid) else { return };
    if let Err(e) = killpg(Pid::from_raw(raw), Signal::SIGKILL) {
        tracing::debug!(pid, error = %e, "direct kill of the process group failed");
    }
    // The shim exits on its own once its program is gone; a shim that no
    // longer answers is sent away too, while its program's pid still proves
    // the pair is ours.
    if let Some(shim) = shim_pid.and_then(|p| i32::try_from(p).ok()) {
        let _ = kill(Pid::from_raw(shim), Signal::SIGKILL);
    }
}
