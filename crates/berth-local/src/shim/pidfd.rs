//! Process file descriptors (Linux ≥ 5.3): a handle on one process that,
//! unlike its pid, never names another process after it has exited. berth
//! kills a shim it has to give up on through one, because the zygote reaps
//! its shims at once and frees their pids for reuse.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use nix::libc;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::Signal;

/// A pidfd.
#[derive(Debug)]
pub(crate) struct PidFd(OwnedFd);

impl PidFd {
    /// Opens a pidfd for `pid`; `None` if the kernel has no `pidfd_open`
    /// or the process is gone.
    pub(crate) fn open(pid: u32) -> Option<PidFd> {
        let pid = libc::pid_t::try_from(pid).ok().filter(|&p| p > 0)?;
        // SAFETY: pidfd_open(2) takes a pid and a flags word and returns a
        // new descriptor or -1; no memory is passed.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        let fd = i32::try_from(fd).ok().filter(|&fd| fd >= 0)?;
        // SAFETY: the kernel has just installed `fd` for this process;
        // nothing else owns it.
        Some(PidFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Takes a pidfd received from another process.
    pub(crate) fn from_owned(fd: OwnedFd) -> PidFd {
        PidFd(fd)
    }

    pub(crate) fn as_owned(&self) -> &OwnedFd {
        &self.0
    }

    /// Sends `signal`; `Ok(false)` if the process has already exited.
    pub(crate) fn signal(&self, signal: Signal) -> io::Result<bool> {
        // SAFETY: pidfd_send_signal(2) with a descriptor this value owns
        // (open for its whole life), a signal number, a null siginfo (the
        // kernel then fills one in as kill(2) would) and no flags.
        let sent = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                signal as libc::c_int,
                std::ptr::null::<libc::siginfo_t>(),
                0 as libc::c_uint,
            )
        };
        if sent == 0 {
            return Ok(true);
        }
        match io::Error::last_os_error() {
            e if e.raw_os_error() == Some(libc::ESRCH) => Ok(false),
            e => Err(e),
        }
    }

    /// Whether the process has exited (a pidfd polls readable then).
    pub(crate) fn exited(&self) -> bool {
        let mut fds = [PollFd::new(self.0.as_fd(), PollFlags::POLLIN)];
        matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pidfd_signals_its_process_and_sees_it_exit() {
        let mut child = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .unwrap();
        let pidfd = PidFd::open(child.id()).expect("pidfd_open (Linux >= 5.3)");
        assert!(!pidfd.exited());
        assert!(pidfd.signal(Signal::SIGKILL).unwrap());
        child.wait().unwrap();
        assert!(pidfd.exited());
        // Reaped: its pid may now be anyone's, the pidfd still names it.
        assert!(!pidfd.signal(Signal::SIGKILL).unwrap());
        assert!(PidFd::open(0).is_none());
    }
}
