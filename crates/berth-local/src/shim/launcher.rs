//! berth's side of the zygote: starts it, asks it for shims, and replaces
//! it if it dies.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nix::fcntl::{FcntlArg, OFlag, fcntl};
use nix::sys::socket::{
    AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, recvmsg, sendmsg, socketpair,
};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::Mutex;

use super::ShimError;
use super::client::{ForkedShim, ShimHandle};
use super::pidfd::PidFd;
use super::protocol::{ShimSpec, ShimState};
use super::zygote::{MAX_REQUEST_BYTES, received_fds};

/// How long the zygote may take to answer a fork request. It answers
/// right after `fork`, so hitting this means it is wedged.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the zygote gets to exit after its socket closes.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// Starts shims. Owns one zygote process (`exe args…`, normally
/// `berth shim`), started on first use and restarted if it dies; each
/// [`ShimLauncher::spawn`] has it fork one shim.
///
/// ```no_run
/// # async fn demo(spec: berth_local::shim::ShimSpec) -> Result<(), berth_local::shim::ShimError> {
/// use berth_local::shim::ShimLauncher;
///
/// let launcher = ShimLauncher::new("/usr/local/bin/berth", vec!["shim".to_owned()]);
/// let (mut handle, state) = launcher.spawn(&spec).await?;
/// println!("program pid {} under shim {}", state.pid, state.shim_pid);
/// while let Some(event) = handle.next_event().await {
///     println!("{event:?}");
/// }
/// # Ok(()) }
/// ```
pub struct ShimLauncher {
    exe: PathBuf,
    args: Vec<String>,
    /// One request at a time: the zygote answers in order, and a request
    /// cut short (its future dropped) takes the zygote with it, so an
    /// answer is never read by the wrong request.
    zygote: Mutex<Option<Zygote>>,
    /// Set by [`ShimLauncher::shutdown`]: no zygote is started after it.
    closed: AtomicBool,
}

struct Zygote {
    socket: AsyncFd<OwnedFd>,
    /// Killed when dropped; shims it forked live on (own session).
    process: tokio::process::Child,
}

impl ShimLauncher {
    /// A launcher whose zygote is `exe args…`; nothing starts until the
    /// first [`ShimLauncher::spawn`].
    pub fn new(exe: impl Into<PathBuf>, args: Vec<String>) -> ShimLauncher {
        ShimLauncher {
            exe: exe.into(),
            args,
            zygote: Mutex::new(None),
            closed: AtomicBool::new(false),
        }
    }

    /// Starts a shim for `spec` and connects to it. Returns once the program
    /// is spawned (not ready); see [`ShimHandle`] for what follows.
    ///
    /// On error nothing is left running.
    pub async fn spawn(&self, spec: &ShimSpec) -> Result<(ShimHandle, ShimState), ShimError> {
        let request = serde_json::to_vec(spec)
            .map_err(|e| ShimError::Shim(format!("cannot encode spec: {e}")))?;
        if request.len() > MAX_REQUEST_BYTES {
            return Err(ShimError::Shim(format!(
                "the spec is {} bytes, over the limit of {MAX_REQUEST_BYTES} (command and environment too large)",
                request.len()
            )));
        }
        let (report, report_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC)
            .map_err(|e| ShimError::Shim(format!("cannot make a pipe: {e}")))?;
        let report = tokio::net::unix::pipe::Receiver::from_owned_fd(report)?;
        let shim = self.fork(&request, report_write).await?;
        ShimHandle::finish_spawn(report, shim, spec).await
    }

    /// The zygote's pid, if one runs (for diagnostics and tests).
    pub async fn zygote_pid(&self) -> Option<u32> {
        self.zygote
            .lock()
            .await
            .as_ref()
            .and_then(|z| z.process.id())
    }

    /// Stops the zygote and waits for it to be gone. Shims it started keep
    /// running.
    pub async fn shutdown(&self) {
        let mut slot = self.zygote.lock().await;
        self.closed.store(true, Ordering::Relaxed);
        let Some(Zygote {
            socket,
            mut process,
        }) = slot.take()
        else {
            return;
        };
        drop(slot);
        // End of its request stream: it exits on its own.
        drop(socket);
        if tokio::time::timeout(SHUTDOWN_GRACE, process.wait())
            .await
            .is_err()
        {
            tracing::warn!("the shim zygote did not exit; killing it");
            if let Err(e) = process.kill().await {
                tracing::warn!(error = %e, "cannot kill the shim zygote");
            }
        }
    }

    /// Has the zygote fork a shim writing its report to `report`; returns
    /// the shim, or `None` when the zygote died with the request in
    /// flight (it may or may not have forked; the report pipe tells). A
    /// zygote found dead when sending is replaced once: it cannot have
    /// forked for a request it never took.
    async fn fork(&self, request: &[u8], report: OwnedFd) -> Result<Option<ForkedShim>, ShimError> {
        let mut slot = self.zygote.lock().await;
        // Read under the lock `shutdown` sets it under: no zygote is
        // started after the last one was stopped.
        if self.closed.load(Ordering::Relaxed) {
            return Err(ShimError::Shim(
                "berth is shutting down; no shim is started".to_owned(),
            ));
        }
        let mut retried = false;
        loop {
            let zygote = match slot.take() {
                Some(zygote) => zygote,
                None => Zygote::start(&self.exe, &self.args)?,
            };
            if let Err(e) = zygote.send(request, &report).await {
                if !is_gone(&e) {
                    // The zygote is fine; this request could not be sent.
                    *slot = Some(zygote);
                    return Err(ShimError::Shim(format!(
                        "cannot send the spec to the shim zygote: {e}"
                    )));
                }
                if retried {
                    return Err(ShimError::Shim(format!(
                        "the shim zygote ({:?}) exits as soon as it starts: {e}",
                        self.exe
                    )));
                }
                tracing::warn!(error = %e, "the shim zygote is gone; starting a new one");
                retried = true;
                continue;
            }
            return match zygote.answer().await {
                Ok((answer, pidfd)) => {
                    *slot = Some(zygote);
                    parse_answer(&answer).map(|pid| {
                        Some(ForkedShim {
                            pid,
                            pidfd: pidfd.map(PidFd::from_owned),
                        })
                    })
                }
                // Never sent again: a second shim for the same instance
                // could be the result. The report settles it.
                Err(e) => {
                    tracing::warn!(error = %e, "the shim zygote failed with a request in flight");
                    Ok(None)
                }
            };
        }
    }
}

impl Zygote {
    fn start(exe: &PathBuf, args: &[String]) -> Result<Zygote, ShimError> {
        let cannot = |what: &str, e: &dyn std::fmt::Display| {
            ShimError::Shim(format!("cannot start the shim zygote {exe:?}: {what}: {e}"))
        };
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| cannot("socketpair", &e))?;
        // Only our end: the zygote reads its end blocking.
        fcntl(ours.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK))
            .map_err(|e| cannot("fcntl", &e))?;
        let process = tokio::process::Command::new(exe)
            .args(args)
            // Nothing of berth's environment (its secrets among it) reaches
            // the zygote, its shims or, through them, a program: a shim
            // gives its program exactly the spec's environment.
            .env_clear()
            .envs(std::env::vars_os().filter(|(k, _)| k == "RUST_BACKTRACE"))
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            // Its diagnostics, and each shim's until it has detached.
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| cannot("spawn", &e))?;
        // SAFETY: the `OwnedFd` is moved into the `AsyncFd`, so the
        // descriptor stays open, and is the same, until the `AsyncFd` drops
        // it; nothing else holds this end of the pair.
        let socket = unsafe { AsyncFd::register(ours) }.map_err(|e| cannot("register", &e))?;
        Ok(Zygote { socket, process })
    }

    /// Sends one request, with `report` attached.
    async fn send(&self, request: &[u8], report: &OwnedFd) -> io::Result<()> {
        let fds = [report.as_raw_fd()];
        self.socket
            .async_io(Interest::WRITABLE, |fd| {
                sendmsg::<()>(
                    fd.as_raw_fd(),
                    &[IoSlice::new(request)],
                    &[ControlMessage::ScmRights(&fds)],
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                )
                .map_err(io::Error::from)
            })
            .await
            .map(drop)
    }

    /// Reads the answer to the request just sent, with the shim's pidfd if
    /// the zygote sent one.
    async fn answer(&self) -> io::Result<(String, Option<OwnedFd>)> {
        let mut answer = [0u8; 512];
        let read = self.socket.async_io(Interest::READABLE, |fd| {
            let mut iov = [IoSliceMut::new(&mut answer)];
            let mut cmsg = nix::cmsg_space!([RawFd; 1]);
            let msg = recvmsg::<()>(
                fd.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            )?;
            let pidfd = received_fds(msg.cmsgs()?).into_iter().next();
            Ok((msg.bytes, pidfd))
        });
        let (n, pidfd) = tokio::time::timeout(ANSWER_TIMEOUT, read)
            .await
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no answer within {}s", ANSWER_TIMEOUT.as_secs()),
                )
            })??;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the zygote exited",
            ));
        }
        Ok((String::from_utf8_lossy(&answer[..n]).into_owned(), pidfd))
    }
}

/// Whether a send failed because the zygote is no longer there.
fn is_gone(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset | io::ErrorKind::NotConnected
    )
}

/// `pid <n>` or `error <why>`.
fn parse_answer(answer: &str) -> Result<u32, ShimError> {
    if let Some(pid) = answer.strip_prefix("pid ") {
        return pid
            .parse()
            .map_err(|_| ShimError::Shim(format!("the shim zygote answered {answer:?}")));
    }
    Err(ShimError::Shim(match answer.strip_prefix("error ") {
        Some(why) => format!("the shim zygote cannot start a shim: {why}"),
        None => format!("the shim zygote answered {answer:?}"),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_parse() {
        assert_eq!(parse_answer("pid 42").unwrap(), 42);
        let err = parse_answer("error invalid spec: eof")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cannot start a shim: invalid spec: eof"),
            "{err}"
        );
        let err = parse_answer("pid x").unwrap_err().to_string();
        assert!(err.contains("answered \"pid x\""), "{err}");
        assert!(parse_answer("").is_err());
    }
}
