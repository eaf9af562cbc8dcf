//! The zygote (`berth shim`): one long-lived, single-threaded process per
//! berth that forks a shim for every instance.
//!
//! Executing berth costs every process start here a few milliseconds of
//! loader, relocation and CPU-feature probing; a fork of a small process
//! that has already paid it costs a tenth of that. So berth re-executes
//! itself once, as the zygote, and the zygote forks (without exec) one shim
//! per instance.
//!
//! Protocol, over the `SOCK_SEQPACKET` socket that is the zygote's stdin:
//! berth sends one message per shim, the [`ShimSpec`] as JSON with the
//! write end of a pipe attached (`SCM_RIGHTS`); the zygote forks, and the
//! child becomes the shim with that pipe as its stdout, on which it writes
//! its [`super::SpawnReport`]. The zygote answers each request with one
//! message, `pid <shim pid>` or `error <why>`, and exits when berth closes
//! the socket. Forked shims are never the zygote's to wait for: it ignores
//! `SIGCHLD`, so the kernel reaps them, and they outlive it (they are in
//! their own session).

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::signal::{self, SigHandler, Signal};
use nix::sys::socket::{
    CmsgIterator, ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg,
};
use nix::unistd::ForkResult;
use regex::Regex;

use super::ShimSpec;
use super::pidfd::PidFd;

/// Largest request (a spec's JSON) the zygote takes.
pub(crate) const MAX_REQUEST_BYTES: usize = 128 * 1024;

/// The request socket: the zygote's stdin.
const REQUESTS: RawFd = 0;

/// Signals the zygote ignores. `SIGCHLD` among them makes the kernel reap
/// the forked shims: the zygote never waits for one.
const ZYGOTE_IGNORES: [Signal; 4] = [
    Signal::SIGPIPE,
    Signal::SIGCHLD,
    Signal::SIGHUP,
    Signal::SIGINT,
];

/// Ready patterns kept compiled. Every instance of a berth usually shares
/// one (the configured command's), so each shim inherits it compiled
/// instead of compiling it again (a few hundred microseconds).
const MAX_CACHED_PATTERNS: usize = 16;

/// Serves fork requests on stdin until berth closes it. Returns the exit
/// code.
pub(super) fn run() -> i32 {
    // Start every shim from a clean slate, whatever berth was started with:
    // no ignored signals (SIG_IGN survives exec into the program) and no
    // stray descriptors (one inherited from berth's parent would be held by
    // every shim, and reach every program).
    for sig in Signal::iterator() {
        if !matches!(sig, Signal::SIGKILL | Signal::SIGSTOP) {
            set_signal(sig, SigHandler::SigDfl);
        }
    }
    close_stray_descriptors();
    // Then the zygote's own: it ends when berth closes its socket, not on
    // a signal to berth's process group or terminal. A shim puts these
    // back to their defaults (see `become_shim`).
    for sig in ZYGOTE_IGNORES {
        set_signal(sig, SigHandler::SigIgn);
    }
    let mut buf = vec![0u8; MAX_REQUEST_BYTES];
    let mut patterns = HashMap::new();
    loop {
        let request = match receive(&mut buf) {
            Ok(Some(request)) => request,
            // berth closed the socket: it is stopping.
            Ok(None) => return 0,
            Err(e) => {
                diag!("zygote: cannot read requests: {e}");
                return 1;
            }
        };
        let (answer, pidfd) = match request {
            Ok((spec, report)) => {
                let ready_regex = compiled(&mut patterns, spec.ready_regex.as_deref());
                fork_shim(spec, ready_regex, report)
            }
            Err(why) => (format!("error {why}"), None),
        };
        let pidfd = pidfd.as_ref().map(|p| [p.as_owned().as_raw_fd()]);
        let rights: Vec<ControlMessage> = pidfd
            .iter()
            .map(|fd| ControlMessage::ScmRights(fd))
            .collect();
        if let Err(e) = sendmsg::<()>(
            REQUESTS,
            &[IoSlice::new(answer.as_bytes())],
            &rights,
            MsgFlags::empty(),
            None,
        ) {
            diag!("zygote: cannot answer: {e}");
            return 1;
        }
    }
}

/// One request: `Ok(None)` at end of stream, `Ok(Err(why))` for a request
/// that cannot be served (answered, then the next one is read).
#[allow(clippy::type_complexity)]
fn receive(buf: &mut [u8]) -> nix::Result<Option<Result<(ShimSpec, OwnedFd), String>>> {
    let mut cmsg = nix::cmsg_space!([RawFd; 2]);
    let (bytes, flags, mut fds) = loop {
        let mut iov = [IoSliceMut::new(buf)];
        match recvmsg::<()>(
            REQUESTS,
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(msg) => {
                let fds = received_fds(msg.cmsgs()?);
                break (msg.bytes, msg.flags, fds);
            }
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e),
        }
    };
    if bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    if flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC) {
        return Ok(Some(Err(format!("request over {MAX_REQUEST_BYTES} bytes"))));
    }
    if fds.len() != 1 {
        return Ok(Some(Err(format!(
            "request carries {} descriptors, not 1",
            fds.len()
        ))));
    }
    let report = fds.remove(0);
    match serde_json::from_slice(&buf[..bytes]) {
        Ok(spec) => Ok(Some(Ok((spec, report)))),
        Err(e) => Ok(Some(Err(format!("invalid spec: {e}")))),
    }
}

/// `pattern` compiled, from the cache or newly (and then cached while there
/// is room). `None` for no pattern or an invalid one: the shim compiles it
/// itself and reports the error.
fn compiled(cache: &mut HashMap<String, Regex>, pattern: Option<&str>) -> Option<Regex> {
    let pattern = pattern?;
    if let Some(regex) = cache.get(pattern) {
        return Some(regex.clone());
    }
    let regex = Regex::new(pattern).ok()?;
    if cache.len() < MAX_CACHED_PATTERNS {
        cache.insert(pattern.to_owned(), regex.clone());
    }
    Some(regex)
}

/// The descriptors a received message carried (`SCM_RIGHTS`), owned.
pub(super) fn received_fds(cmsgs: CmsgIterator<'_>) -> Vec<OwnedFd> {
    let mut fds = Vec::new();
    for c in cmsgs {
        if let ControlMessageOwned::ScmRights(received) = c {
            for fd in received {
                // SAFETY: SCM_RIGHTS installed `fd` in this process just
                // now; nothing else owns it.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    fds
}

/// Forks the shim for `spec`; returns the answer for berth, with a pidfd
/// of the shim to send along where the kernel has them.
fn fork_shim(
    spec: ShimSpec,
    ready_regex: Option<Regex>,
    report: OwnedFd,
) -> (String, Option<PidFd>) {
    // SAFETY: the zygote is single-threaded (it never starts a thread or a
    // runtime), so the child is a complete copy of a consistent process and
    // may run any code, not only async-signal-safe functions.
    match unsafe { nix::unistd::fork() } {
        Ok(ForkResult::Child) => {
            let code = become_shim(spec, ready_regex, report);
            std::process::exit(code)
        }
        // Opened right after the fork: the shim is alive, or exited an
        // instant ago (reaped at once: `pidfd_open` then fails); its pid
        // cannot have been handed to another process that soon.
        Ok(ForkResult::Parent { child }) => (
            format!("pid {child}"),
            u32::try_from(child.as_raw()).ok().and_then(PidFd::open),
        ),
        Err(e) => (format!("error cannot fork a shim: {e}"), None),
    }
}

/// In the forked child: give up the zygote's descriptors and dispositions,
/// then run the shim with `report` as stdout.
fn become_shim(spec: ShimSpec, ready_regex: Option<Regex>, report: OwnedFd) -> i32 {
    // The request socket must not stay open in every shim (berth would
    // never see the zygote's end close), and the program must not inherit
    // the zygote's ignored signals (SIG_IGN survives exec).
    if let Err(e) = redirect_null(REQUESTS) {
        diag!("shim: cannot detach from the zygote: {e}");
        return 2;
    }
    for sig in ZYGOTE_IGNORES {
        set_signal(sig, SigHandler::SigDfl);
    }
    if let Err(e) = nix::unistd::dup2(report.as_raw_fd(), 1) {
        diag!("shim: cannot take its report pipe: {e}");
        return 2;
    }
    drop(report);
    super::server::run(spec, ready_regex)
}

fn redirect_null(fd: RawFd) -> nix::Result<()> {
    let null = nix::fcntl::open(
        "/dev/null",
        nix::fcntl::OFlag::O_RDWR | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )?;
    // SAFETY: `open` just returned this descriptor; it is owned here alone.
    let null = unsafe { OwnedFd::from_raw_fd(null) };
    nix::unistd::dup2(null.as_raw_fd(), fd).map(drop)
}

/// Closes every descriptor above stderr. The zygote calls it before it
/// opens any of its own, so each one is a stray inherited from berth's
/// parent.
fn close_stray_descriptors() {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<RawFd> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|&fd| fd > 2)
        .collect();
    for fd in fds {
        // The directory's own descriptor is among them, closed by now:
        // EBADF is expected and harmless.
        let _ = nix::unistd::close(fd);
    }
}

fn set_signal(sig: Signal, handler: SigHandler) {
    // SAFETY: SIG_IGN and SIG_DFL install no handler, so no code of ours
    // ever runs in signal context; the process is single-threaded.
    if let Err(e) = unsafe { signal::signal(sig, handler) } {
        diag!("zygote: cannot set the disposition of {sig}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_are_compiled_once_and_the_cache_is_bounded() {
        let mut cache = HashMap::new();
        assert!(compiled(&mut cache, None).is_none());
        assert!(
            compiled(&mut cache, Some("(")).is_none(),
            "invalid compiles"
        );
        assert!(cache.is_empty(), "an invalid pattern was cached");
        let first = compiled(&mut cache, Some(r"token=(\w+)")).unwrap();
        assert!(first.is_match("token=abc"));
        assert_eq!(cache.len(), 1);
        compiled(&mut cache, Some(r"token=(\w+)")).unwrap();
        assert_eq!(cache.len(), 1);
        for i in 0..MAX_CACHED_PATTERNS * 2 {
            let pattern = format!("p{i}");
            assert!(
                compiled(&mut cache, Some(&pattern))
                    .unwrap()
                    .is_match(&pattern)
            );
        }
        assert_eq!(cache.len(), MAX_CACHED_PATTERNS);
    }
}
