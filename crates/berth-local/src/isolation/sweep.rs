//! Freezing and killing every process of an instance's uid: the handle on
//! an instance at level `user` on a host that gives it no cgroup.
//!
//! A program under its own account cannot change its uid (no
//! capabilities, `no_new_privs`), so "every process whose real, effective,
//! saved or filesystem uid is the account's" holds all of it, whatever its
//! session or group. A sweep signals all of them at once, as the account
//! itself (`kill(-1, …)`), and reads `/proc` until two reads in a row find
//! nothing left to do; one that is stopped (or being killed) forks no
//! more, so the sweep ends.
//!
//! A user's watchdog runs under the same account as its main: at this
//! level a sweep of one reaches the other. Both never run at once in
//! practice (a watchdog runs while its main is down).

use std::fs;
use std::time::{Duration, Instant};

use nix::libc;
use nix::sys::signal::Signal;

/// How long a sweep goes on before it reports the processes it could not
/// bring to the wanted state.
const SWEEP_LIMIT: Duration = Duration::from_secs(5);

/// The pause between two passes, so that signals sent in one are acted on
/// before the next reads the states.
const SWEEP_PAUSE: Duration = Duration::from_millis(1);

/// One process of the account, as `/proc/<pid>/status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// Its process id.
    pub pid: u32,
    /// The state letter: `R`, `S`, `D`, `T` (stopped), `t` (traced), `Z`…
    pub state: char,
}

impl Member {
    /// Stopped by a signal (or by a tracer): runs no instruction.
    fn is_stopped(self) -> bool {
        matches!(self.state, 'T' | 't')
    }

    /// Dead already, waiting to be reaped.
    fn is_dead(self) -> bool {
        matches!(self.state, 'Z' | 'X')
    }
}

/// Whether a `/proc/<pid>/status` text belongs to `uid` (any of its four
/// uids), and if so the process's state letter.
pub fn member_state(status: &str, uid: u32) -> Option<char> {
    let mut state = None;
    let mut owned = false;
    for line in status.lines() {
        if let Some(rest) = line.strip_prefix("State:") {
            state = rest.trim().chars().next();
        } else if let Some(rest) = line.strip_prefix("Uid:") {
            owned = rest
                .split_whitespace()
                .any(|u| u.parse::<u32>().ok() == Some(uid));
        }
    }
    if owned { state } else { None }
}

/// Every process of `uid` now.
pub fn members(uid: u32) -> Vec<Member> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            Some(Member {
                pid,
                state: member_state(&status, uid)?,
            })
        })
        .collect()
}

/// `sig` to every process of `uid` at once: `kill(-1, sig)` sent by a
/// child forked for it that has become `uid`. The kernel delivers it to
/// every process the sender may signal (those of its own uid) under one
/// lock that `fork` also takes, so no process forked in between escapes
/// it, and a process that is forking when it arrives has its fork undone
/// and retried after the signal. Returns whether the child ran.
fn signal_account(uid: u32, sig: Signal) -> bool {
    let sig = sig as libc::c_int;
    // SAFETY: the child calls only async-signal-safe raw system calls
    // (setresuid, kill, _exit) before it exits, so the locks other threads
    // of this process held at the fork do not matter to it.
    match unsafe { nix::unistd::fork() } {
        Ok(nix::unistd::ForkResult::Child) => {
            // SAFETY: raw system calls on integers; the glibc wrapper of
            // setresuid is avoided (it signals threads this child lacks).
            unsafe {
                if libc::syscall(libc::SYS_setresuid, uid, uid, uid) == 0 {
                    libc::kill(-1, sig);
                }
                libc::_exit(0)
            }
        }
        Ok(nix::unistd::ForkResult::Parent { child }) => loop {
            match nix::sys::wait::waitpid(child, None) {
                Err(nix::errno::Errno::EINTR) => continue,
                other => break other.is_ok(),
            }
        },
        Err(_) => false,
    }
}

/// Signals every process of `uid` with `sig` until `done` holds for all of
/// them in two reads in a row; the members it never held for when
/// [`SWEEP_LIMIT`] ran out. One read is not enough: the members are read
/// one after another, and one read as done early could have been undone
/// (a stopped process continued by the kernel when its process group was
/// orphaned) before that one was read; a second read, with no signal
/// sent in between, sees it again.
fn sweep(uid: u32, sig: Signal, done: impl Fn(Member) -> bool) -> Vec<Member> {
    let until = Instant::now() + SWEEP_LIMIT;
    let mut clean_reads = 0;
    loop {
        let pending: Vec<Member> = members(uid).into_iter().filter(|m| !done(*m)).collect();
        if pending.is_empty() {
            clean_reads += 1;
            if clean_reads == 2 {
                return pending;
            }
            continue;
        }
        clean_reads = 0;
        if Instant::now() >= until {
            return pending;
        }
        signal_account(uid, sig);
        std::thread::sleep(SWEEP_PAUSE);
    }
}

/// SIGSTOP to every process of `uid` until all are stopped. Returns those
/// that were not (an uninterruptible sleep that outlasts the sweep; it
/// stops before it returns to user space, its SIGSTOP being pending).
pub fn stop_all(uid: u32) -> Vec<Member> {
    sweep(uid, Signal::SIGSTOP, |m| m.is_stopped() || m.is_dead())
}

/// SIGCONT to every process of `uid`, each by its pid. Not as the
/// account with `kill(-1, …)`, as the other sweeps: the kernel lets a
/// process send SIGCONT to any process of its own session whatever its
/// uid, so that would also continue the stopped processes of other
/// accounts in the sweeper's session (pods that share a host's sessions).
/// A stopped process forks nothing, so none is missed between the listing
/// and the signals.
pub fn continue_all(uid: u32) {
    for member in members(uid) {
        if let Ok(pid) = i32::try_from(member.pid) {
            // Gone already is fine.
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGCONT);
        }
    }
}

/// SIGKILL to every process of `uid` until none is left alive. A stopped
/// process dies of SIGKILL without running again. Returns the survivors.
pub fn kill_all(uid: u32) -> Vec<Member> {
    sweep(uid, Signal::SIGKILL, Member::is_dead)
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str = "Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t42\n\
                          Uid:\t400001\t400001\t400001\t400001\nGid:\t400001\t400001\t400001\t400001\n";

    #[test]
    fn a_status_names_its_state_for_its_own_uid_only() {
        assert_eq!(member_state(STATUS, 400_001), Some('S'));
        assert_eq!(member_state(STATUS, 400_002), None);
        let stopped = STATUS.replace("S (sleeping)", "T (stopped)");
        assert_eq!(member_state(&stopped, 400_001), Some('T'));
        // Any of the four uids counts: a process cannot hide behind one.
        let saved = "State:\tR (running)\nUid:\t0\t0\t400001\t0\n";
        assert_eq!(member_state(saved, 400_001), Some('R'));
        assert_eq!(member_state("garbage", 400_001), None);
    }

    /// The state letter of `pid` now.
    fn state_of(pid: u32) -> char {
        let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let line = status.lines().find(|l| l.starts_with("State:")).unwrap();
        line["State:".len()..].trim().chars().next().unwrap()
    }

    #[test]
    fn a_thaw_continues_its_own_account_only_even_within_one_session() {
        if !crate::test_host::has(nix::unistd::geteuid().is_root(), "root") {
            return;
        }
        use std::os::unix::process::CommandExt;
        // Two accounts of nobody else's, their processes in this test's
        // session (no setsid), as the pods of one host can be.
        let (ours, theirs) = (4_170_001, 4_170_002);
        let mut children: Vec<std::process::Child> = [ours, theirs]
            .into_iter()
            .map(|uid| {
                std::process::Command::new("sleep")
                    .arg("600")
                    .uid(uid)
                    .gid(uid)
                    .spawn()
                    .unwrap()
            })
            .collect();
        let pids: Vec<u32> = children.iter().map(std::process::Child::id).collect();
        assert!(stop_all(ours).is_empty() && stop_all(theirs).is_empty());
        assert_eq!((state_of(pids[0]), state_of(pids[1])), ('T', 'T'));

        continue_all(ours);
        // Ours leaves `T`. Any SIGCONT that reached theirs was sent in the
        // same call, so by then it has left `T` too, or does within
        // microseconds: it is watched for 20 ms more.
        let deadline = Instant::now() + Duration::from_secs(10);
        while state_of(pids[0]) == 'T' && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let ours_state = state_of(pids[0]);
        let theirs_states: Vec<char> = (0..20)
            .map(|_| {
                std::thread::sleep(Duration::from_millis(1));
                state_of(pids[1])
            })
            .collect();
        for uid in [ours, theirs] {
            assert!(kill_all(uid).is_empty());
        }
        for child in &mut children {
            child.wait().unwrap();
        }
        assert_ne!(
            ours_state, 'T',
            "the thawed account's process is still stopped"
        );
        assert!(
            theirs_states.iter().all(|s| *s == 'T'),
            "a thaw of one account continued another's process: {theirs_states:?}"
        );
    }

    #[test]
    fn stopped_and_dead_states() {
        let m = |state| Member { pid: 1, state };
        assert!(m('T').is_stopped() && m('t').is_stopped());
        assert!(!m('R').is_stopped() && !m('D').is_stopped());
        assert!(m('Z').is_dead() && m('X').is_dead() && !m('T').is_dead());
    }
}
