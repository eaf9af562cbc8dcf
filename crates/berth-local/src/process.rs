//! Last-resort signals sent by berth itself (when a shim does not answer),
//! guarded against pid reuse, and the fire-and-forget operator hooks.

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

/// Start time of `pid` in clock ticks since boot (`/proc/<pid>/stat` field
/// 22), or `None` when the process does not exist.
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_start_time(&stat)
}

/// Field 22 of a `/proc/<pid>/stat` line. The command name (field 2) may
/// contain spaces and parentheses, so fields are counted after its last `)`.
pub(crate) fn parse_start_time(stat: &str) -> Option<u64> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    // After the name come field 3 (state) onwards; field 22 is the 20th.
    after_comm.split_whitespace().nth(19)?.parse().ok()
}

/// SIGKILLs the program's process group and its shim, but only if `pid`
/// still is the process that started at `pid_start`.
pub(crate) fn kill_instance(pid: Option<u32>, pid_start: Option<u64>, shim_pid: Option<u32>) {
    let (Some(pid), Some(pid_start)) = (pid, pid_start) else {
        return;
    };
    if start_time(pid) != Some(pid_start) {
        return;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_field_22_even_with_odd_names() {
        let stat =
            "123 (a) b (c)) S 1 123 123 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 98765 1000 10";
        assert_eq!(parse_start_time(stat), Some(98765));
        assert_eq!(parse_start_time("garbage"), None);
    }

    #[test]
    fn reads_our_own_start_time() {
        assert!(start_time(std::process::id()).is_some());
        assert_eq!(start_time(u32::MAX), None);
    }
}
