//! berth's side of the shim: spawning one, attaching to one, talking to it.

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal;
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::Mutex;

use super::pidfd::PidFd;
use super::protocol::{ShimCommand, ShimEvent, ShimSpec, ShimState, SpawnReport};

/// How long a new shim may take to start the program and report.
const REPORT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a shim may take to greet a new connection.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a command may wait for the socket to take it. The shim always
/// reads promptly, so hitting this means it is wedged.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// Why talking to a shim failed.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    /// The program could not be started; the message names it.
    #[error("{0}")]
    SpawnFailed(String),
    /// The shim process itself could not be started or misbehaved.
    #[error("shim failed: {0}")]
    Shim(String),
    /// No live shim answers at this state file / socket.
    #[error("no live shim: {0}")]
    Gone(String),
    /// A shim took the connection but did not greet in time. It was
    /// killed, and its program with it: berth cannot supervise it, and
    /// must not start a second instance beside it.
    #[error("silent shim, killed: {0}")]
    Silent(String),
    /// Reading a state file or talking over the socket failed in a way
    /// none of the above accounts for.
    #[error("shim i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// The read buffer of a shim connection. Events are short lines (a longer
/// one is read in several fills), and berth keeps one connection per
/// instance: the default 8 KiB would cost a node of 10,000 instances 80 MiB.
const EVENT_BUFFER: usize = 1024;

/// A connection to one shim: receives its events.
pub struct ShimHandle {
    /// `None` when the shim had already finished by the time we connected:
    /// there are no events to wait for, the state file has the exit.
    events: Option<Lines<BufReader<OwnedReadHalf>>>,
    control: ShimControl,
}

/// Sends commands to one shim. Cheap to clone; usable while another task
/// owns the [`ShimHandle`].
#[derive(Clone)]
pub struct ShimControl {
    writer: Arc<Mutex<Option<OwnedWriteHalf>>>,
}

impl ShimHandle {
    /// Completes the start of a shim that berth's [`super::ShimLauncher`]
    /// had forked (`None`: unknown, and maybe not forked at all), with
    /// `report` the pipe it writes its [`SpawnReport`] to: reads
    /// the report and connects to the shim's socket. Returns once the
    /// program is spawned (not ready).
    ///
    /// A program that exits at once may have taken its shim with it before
    /// the connection is made. That is not an error: the returned handle's
    /// [`ShimHandle::next_event`] then yields `None` straight away and
    /// [`ShimHandle::read_state`] on `spec.state_path` holds the exit.
    ///
    /// On every error the shim is gone when this returns (killed if need
    /// be, which takes its program with it), so nothing runs unowned.
    pub(super) async fn finish_spawn(
        report: impl tokio::io::AsyncRead + Unpin,
        shim: Option<ForkedShim>,
        spec: &ShimSpec,
    ) -> Result<(ShimHandle, ShimState), ShimError> {
        let mut line = String::new();
        let mut report = BufReader::new(report);
        let read = tokio::time::timeout(REPORT_TIMEOUT, report.read_line(&mut line)).await;
        let report = match read {
            Ok(Ok(n)) if n > 0 => line,
            // The pipe's write end closed unwritten: the shim is gone (and
            // its program, if any, with it) or was never forked. Nothing to
            // kill, and its pid may already be someone else's.
            Ok(Ok(_)) | Ok(Err(_)) => {
                return Err(ShimError::Shim(match shim {
                    Some(_) => "the shim exited without a report".to_owned(),
                    None => "the shim zygote died while starting the shim".to_owned(),
                }));
            }
            Err(_) => {
                // Killing the shim takes the program with it (parent-death
                // signal).
                kill_and_wait(shim.map(Doomed::from)).await;
                return Err(ShimError::Shim(format!(
                    "no report from the shim within {}s",
                    REPORT_TIMEOUT.as_secs()
                )));
            }
        };
        // Past this point the shim is left alone on success and killed on
        // every failure.
        let state = match serde_json::from_str::<SpawnReport>(&report) {
            Ok(SpawnReport::Spawned { state }) => state,
            Ok(SpawnReport::Failed { error }) => return Err(ShimError::SpawnFailed(error)),
            Err(e) => {
                kill_and_wait(shim.map(Doomed::from)).await;
                return Err(ShimError::Shim(format!(
                    "bad report {:?}: {e}",
                    report.trim_end()
                )));
            }
        };
        let error = match connect(&state, HELLO_TIMEOUT).await {
            Ok(connected) => return Ok(connected),
            Err(ShimError::Gone(why)) => match Self::read_state(&spec.state_path) {
                Ok(recorded) if recorded.exit.is_some() && same_program(&recorded, &state) => {
                    // The program already exited: nothing runs unowned.
                    let handle = ShimHandle {
                        events: None,
                        control: ShimControl::closed(),
                    };
                    return Ok((handle, recorded));
                }
                Ok(_) => ShimError::Gone(why),
                Err(e) => e,
            },
            Err(e) => e,
        };
        // The program runs but we hold no connection to its shim. Returning
        // the error alone would leave it running unowned while the caller
        // releases its lease and port (two instances). Killing the shim
        // takes the program with it (parent-death signal). The report,
        // which only our shim can have written, names it if the zygote
        // could not.
        kill_and_wait(Some(shim.map_or(Doomed::Pid(state.shim_pid), Doomed::from))).await;
        Err(error)
    }

    /// Connects to the live shim whose state file is `state_path`.
    ///
    /// Fails with [`ShimError::Gone`] when the shim is not running (its
    /// state file may still hold the program's exit: see
    /// [`ShimHandle::read_state`]).
    pub async fn attach(state_path: &Path) -> Result<(ShimHandle, ShimState), ShimError> {
        Self::attach_within(state_path, HELLO_TIMEOUT).await
    }

    /// [`ShimHandle::attach`], waiting up to `patience` for the greeting.
    /// A shim that takes the connection and stays silent that long is
    /// killed ([`ShimError::Silent`]).
    pub async fn attach_within(
        state_path: &Path,
        patience: Duration,
    ) -> Result<(ShimHandle, ShimState), ShimError> {
        let state = match Self::read_state(state_path) {
            Err(ShimError::Io(e)) if e.kind() == io::ErrorKind::NotFound => {
                return Err(ShimError::Gone(format!("no state file {state_path:?}")));
            }
            other => other?,
        };
        Self::check_running(&state)?;
        connect(&state, patience).await
    }

    /// Whether the shim `state` describes still runs, as far as the state
    /// file and the process table tell without asking it: its program's
    /// exit is not recorded and its pid exists (a pid reused since is
    /// told apart only by connecting).
    pub fn check_running(state: &ShimState) -> Result<(), ShimError> {
        if let Some(exit) = state.exit {
            return Err(ShimError::Gone(format!(
                "program of {} has exited ({exit:?})",
                state.instance_id
            )));
        }
        let shim_pid = Pid::from_raw(i32::try_from(state.shim_pid).unwrap_or(i32::MAX));
        // EPERM still means the process exists.
        if let Err(nix::errno::Errno::ESRCH) = signal::kill(shim_pid, None) {
            return Err(ShimError::Gone(format!(
                "shim {} of {} is not running",
                state.shim_pid, state.instance_id
            )));
        }
        Ok(())
    }

    /// Reads a state file without connecting.
    pub fn read_state(state_path: &Path) -> Result<ShimState, ShimError> {
        let text = std::fs::read_to_string(state_path)?;
        serde_json::from_str(&text)
            .map_err(|e| ShimError::Shim(format!("bad state file {state_path:?}: {e}")))
    }

    /// The next event; `None` once the shim has gone away (its connection
    /// closed). After `None`, [`ShimHandle::read_state`] tells how the
    /// program ended, if the shim recorded it.
    ///
    /// Cancel safe: usable as a `tokio::select!` branch.
    pub async fn next_event(&mut self) -> Option<ShimEvent> {
        let events = self.events.as_mut()?;
        loop {
            match events.next_line().await {
                Ok(Some(line)) => match serde_json::from_str(&line) {
                    Ok(event) => return Some(event),
                    // A newer shim may know events this berth does not.
                    Err(e) => tracing::warn!(%e, line, "ignoring unknown shim event"),
                },
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(%e, "shim connection failed");
                    break;
                }
            }
        }
        self.events = None;
        None
    }

    /// A sender of commands to this shim, to keep while another task
    /// waits for its events.
    pub fn control(&self) -> ShimControl {
        self.control.clone()
    }
}

impl ShimControl {
    fn closed() -> ShimControl {
        ShimControl {
            writer: Arc::new(Mutex::new(None)),
        }
    }

    /// Writes `command` to the shim's socket. A shim that has gone, or
    /// takes no command for a while, is an error; after any error the
    /// connection takes no more commands.
    pub async fn send(&self, command: ShimCommand) -> Result<(), ShimError> {
        let mut line = serde_json::to_vec(&command)
            .map_err(|e| ShimError::Shim(format!("cannot encode command: {e}")))?;
        line.push(b'\n');
        let mut writer = self.writer.lock().await;
        let Some(stream) = writer.as_mut() else {
            return Err(ShimError::Gone("the shim has exited".to_owned()));
        };
        let result = match tokio::time::timeout(SEND_TIMEOUT, stream.write_all(&line)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) if is_disconnect(&e) => {
                Err(ShimError::Gone(format!("the shim closed its socket: {e}")))
            }
            Ok(Err(e)) => Err(ShimError::Io(e)),
            Err(_) => Err(ShimError::Shim(format!(
                "the shim took no command for {}s",
                SEND_TIMEOUT.as_secs()
            ))),
        };
        if result.is_err() {
            // A partly written line would garble the next command.
            *writer = None;
        }
        result
    }
}

fn is_disconnect(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::NotFound
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
    )
}

/// A shim the zygote forked for berth: its pid, and a pidfd where the
/// kernel has them.
pub(super) struct ForkedShim {
    pub pid: u32,
    pub pidfd: Option<PidFd>,
}

/// A shim to kill: through its pidfd where there is one (it can never hit
/// another process), else by pid.
enum Doomed {
    PidFd(PidFd),
    Pid(u32),
}

impl From<ForkedShim> for Doomed {
    fn from(shim: ForkedShim) -> Doomed {
        match shim.pidfd {
            Some(pidfd) => Doomed::PidFd(pidfd),
            None => Doomed::Pid(shim.pid),
        }
    }
}

impl Doomed {
    /// Sends SIGKILL; false if there is nothing to wait for (gone already,
    /// or the signal could not be sent).
    fn kill(&self) -> bool {
        match self {
            Doomed::PidFd(pidfd) => match pidfd.signal(signal::Signal::SIGKILL) {
                Ok(sent) => sent,
                Err(e) => {
                    tracing::warn!(%e, "cannot kill the shim");
                    false
                }
            },
            Doomed::Pid(pid) => {
                // Never 0 (or negative): kill(2) would signal a whole group.
                let Some(pid) = i32::try_from(*pid).ok().filter(|&p| p > 0) else {
                    tracing::warn!(pid, "not a shim pid; nothing killed");
                    return false;
                };
                match signal::kill(Pid::from_raw(pid), signal::Signal::SIGKILL) {
                    Ok(()) => true,
                    Err(nix::errno::Errno::ESRCH) => false,
                    Err(e) => {
                        tracing::warn!(%e, pid, "cannot kill the shim");
                        false
                    }
                }
            }
        }
    }

    fn exited(&self) -> bool {
        match self {
            Doomed::PidFd(pidfd) => pidfd.exited(),
            Doomed::Pid(pid) => i32::try_from(*pid)
                .map_or(true, |pid| signal::kill(Pid::from_raw(pid), None).is_err()),
        }
    }
}

/// SIGKILLs a shim we started and waits (bounded) for it to be gone, so
/// its program has received the parent-death signal by the time we return.
/// The zygote, its parent, reaps it.
async fn kill_and_wait(shim: Option<Doomed>) {
    let Some(shim) = shim else {
        tracing::warn!("the shim's pid is unknown; nothing killed");
        return;
    };
    if !shim.kill() {
        return;
    }
    let gone = async {
        while !shim.exited() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(5), gone)
        .await
        .is_err()
    {
        tracing::warn!("the killed shim has not exited within 5s");
    }
}

/// Whether two states describe the same run of the same program.
fn same_program(a: &ShimState, b: &ShimState) -> bool {
    a.instance_id == b.instance_id && a.pid == b.pid && a.pid_start == b.pid_start
}

/// Connects to the shim `expected` describes and checks that its Hello is
/// about the same program, so a stale state file or a reused pid is never
/// mistaken for the instance. A shim silent for `patience` is killed.
async fn connect(
    expected: &ShimState,
    patience: Duration,
) -> Result<(ShimHandle, ShimState), ShimError> {
    let socket = &expected.socket_path;
    let stream = match UnixStream::connect(socket).await {
        Ok(stream) => stream,
        Err(e) if is_disconnect(&e) => {
            return Err(ShimError::Gone(format!(
                "nothing listens on {socket:?}: {e}"
            )));
        }
        Err(e) => return Err(ShimError::Io(e)),
    };
    // The process that took the connection: only the shim binds its
    // socket. While the connection stays open its pid is not reused, so a
    // pidfd opened once it has been silent too long still names it.
    let listener = stream
        .peer_cred()
        .ok()
        .and_then(|cred| cred.pid())
        .and_then(|pid| u32::try_from(pid).ok())
        .filter(|&pid| pid == expected.shim_pid);
    let (read, write) = stream.into_split();
    let mut events = BufReader::with_capacity(EVENT_BUFFER, read).lines();
    let first = match tokio::time::timeout(patience, events.next_line()).await {
        Ok(Ok(Some(line))) => line,
        Ok(Ok(None)) => {
            return Err(ShimError::Gone(format!(
                "{socket:?} closed before greeting"
            )));
        }
        Ok(Err(e)) if is_disconnect(&e) => {
            return Err(ShimError::Gone(format!(
                "{socket:?} closed before greeting: {e}"
            )));
        }
        Ok(Err(e)) => return Err(ShimError::Io(e)),
        Err(_) => {
            let Some(listener) = listener else {
                return Err(ShimError::Shim(format!(
                    "no greeting on {socket:?}, whose listener is not shim {}",
                    expected.shim_pid
                )));
            };
            // Killing the shim takes the program with it (parent-death
            // signal).
            let doomed = PidFd::open(listener).map_or(Doomed::Pid(listener), Doomed::PidFd);
            kill_and_wait(Some(doomed)).await;
            return Err(ShimError::Silent(format!(
                "no greeting on {socket:?} within {:.1}s",
                patience.as_secs_f64()
            )));
        }
    };
    let state = match serde_json::from_str::<ShimEvent>(&first) {
        Ok(ShimEvent::Hello { state }) => state,
        Ok(other) => {
            return Err(ShimError::Shim(format!(
                "expected a greeting on {socket:?}, got {other:?}"
            )));
        }
        Err(e) => {
            return Err(ShimError::Shim(format!("bad greeting on {socket:?}: {e}")));
        }
    };
    if !same_program(&state, expected) {
        return Err(ShimError::Gone(format!(
            "the shim on {socket:?} runs {} pid {} (started {}), not {} pid {} (started {}): \
             stale state file or reused pid",
            state.instance_id,
            state.pid,
            state.pid_start,
            expected.instance_id,
            expected.pid,
            expected.pid_start
        )));
    }
    let handle = ShimHandle {
        events: Some(events),
        control: ShimControl {
            writer: Arc::new(Mutex::new(Some(write))),
        },
    };
    Ok((handle, state))
}
