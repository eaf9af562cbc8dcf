//! A pod's shim (`[kubernetes.shim]`): berth's one connection to it per
//! followed run, which carries berth's commands (freeze, thaw, extend the
//! fence deadline) and brings back what the shim reports (frozen, thawed,
//! a hook's end) as the run's events.
//!
//! The shim serves a connection only after its first line is the pod's
//! credential: the HMAC, under a key derived from the cluster secret, of
//! the pod's name and the nonce it was created with (an annotation). Any
//! replica makes it, for any pod it takes over; berth writes it into the
//! pod's Secret before the pod is created, and the kubelet gives it to the
//! shim's environment alone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_core::Endpoint;
use berth_core::Role;
use berth_core::runtime::{HookOutcome, InstanceSpec, RuntimeError, RuntimeEvent, RuntimeRef};
use berth_core::shim_wire::{ShimCommand, ShimEvent};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::{Inner, failed, lock};
use crate::manifest::{self, SHIM_PORT_NAME};
use crate::observe::{self, PodView};

/// How long a connection to the shim may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a command waits for the link to the shim to be up (a command
/// right after a start, or after the link broke).
const LINK_WAIT: Duration = Duration::from_secs(10);
/// The exit code of a pod's shim that could not start its program (as a
/// shell's for a missing command).
const SHIM_COULD_NOT_START: i32 = berth_core::shim_wire::pod_env::COULD_NOT_START;

/// The pause before the link is tried again.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// The writing end of the link, while it is up.
type Writer = Arc<tokio::sync::Mutex<OwnedWriteHalf>>;

/// Where a hook's end is reported: the shim's answer, or why it did not run.
type HookDone = oneshot::Sender<Result<HookOutcome, String>>;

/// The hooks asked of a shim and not answered yet, by id.
type PendingHooks = Arc<Mutex<HashMap<u64, HookDone>>>;

/// berth's side of one run's link to its pod's shim.
#[derive(Clone)]
pub(super) struct ShimLink {
    writer: watch::Sender<Option<Writer>>,
    /// How many times the shim has reported frozen or thawed, and which
    /// it said last.
    reports: watch::Sender<(u64, bool)>,
    /// Hooks asked of the shim and not answered yet.
    hooks: PendingHooks,
}

impl ShimLink {
    pub(super) fn new() -> ShimLink {
        ShimLink {
            writer: watch::channel(None).0,
            reports: watch::channel((0, false)).0,
            hooks: Arc::default(),
        }
    }

    /// Notes the shim's report that the program is `frozen` (or thawed).
    fn reported(&self, frozen: bool) {
        self.reports.send_modify(|(count, last)| {
            *count += 1;
            *last = frozen;
        });
    }

    /// Sends a freeze or a thaw and waits until the shim reports it done.
    /// What berth asks next, through the API server (a stop is SIGTERM to
    /// the shim), can then not overtake it.
    async fn confirmed(&self, command: &ShimCommand, frozen: bool) -> Result<(), RuntimeError> {
        let mut reports = self.reports.subscribe();
        let (before, _) = *reports.borrow_and_update();
        self.send(command).await?;
        let done = reports.wait_for(|(count, last)| *count > before && *last == frozen);
        match tokio::time::timeout(LINK_WAIT, done).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(RuntimeError::Failed(format!(
                "the pod's shim did not report the program {}",
                if frozen { "frozen" } else { "thawed" }
            ))),
        }
    }

    /// Sends `command` to the shim, waiting up to [`LINK_WAIT`] for the
    /// link to be up.
    async fn send(&self, command: &ShimCommand) -> Result<(), RuntimeError> {
        let mut line = serde_json::to_string(command)
            .map_err(|e| RuntimeError::Failed(format!("cannot encode a shim command: {e}")))?;
        line.push('\n');
        let mut up = self.writer.subscribe();
        let writer = tokio::time::timeout(LINK_WAIT, up.wait_for(Option::is_some))
            .await
            .ok()
            .and_then(Result::ok)
            .and_then(|w| w.clone())
            .ok_or_else(|| RuntimeError::Failed("the pod's shim cannot be reached".into()))?;
        let written = writer.lock().await.write_all(line.as_bytes()).await;
        written.map_err(|e| failed("cannot write to the pod's shim", e))
    }
}

/// A connection to a pod's shim: the lines it sends, and its writing end.
type ShimLines = (
    tokio::io::Lines<BufReader<tokio::net::tcp::OwnedReadHalf>>,
    OwnedWriteHalf,
);

/// Why a pod's shim could not be dialled.
enum Undialed {
    /// The pod has no shim nonce (or berth no shim key): no credential.
    NoShim,
    /// Its `berth-shim` endpoint is not known.
    NotFound(String),
    /// The endpoint did not take the connection.
    Unreachable(std::io::Error),
}

/// The pod's shim answers on `endpoint` once shown `credential`: its lines.
async fn connect(endpoint: &Endpoint, credential: &str) -> std::io::Result<ShimLines> {
    let address = (endpoint.host.as_str(), endpoint.port);
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    stream.set_nodelay(true)?;
    let (read, mut write) = stream.into_split();
    write
        .write_all(format!("{credential}\n").as_bytes())
        .await?;
    Ok((BufReader::new(read).lines(), write))
}

impl Inner {
    /// For a main pod with berth's shim: a fresh nonce for the pod named
    /// `pod` that `spec` is about to create, with its credential already
    /// in the pod's Secret (the kubelet reads it when the container
    /// starts). `None` without the shim.
    pub(super) async fn shim_nonce(
        &self,
        spec: &InstanceSpec,
        pod: &str,
    ) -> Result<Option<String>, RuntimeError> {
        let (Some(key), Role::Main) = (&self.config.shim_key, spec.role) else {
            return Ok(None);
        };
        if self.config.kubernetes.shim.is_none() {
            return Ok(None);
        }
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes)
            .map_err(|e| RuntimeError::Failed(format!("no randomness for the pod's nonce: {e}")))?;
        let nonce = hex::encode(bytes);
        let secret = manifest::shim_secret(
            &self.config.kubernetes,
            &spec.user,
            &spec.slug,
            pod,
            &key.credential(pod, &nonce),
        )
        .map_err(|e| RuntimeError::SpawnFailed(e.to_string()))?;
        self.ensure_secret(&secret)
            .await
            .map_err(|e| failed("cannot write the pod's shim Secret", e))?;
        Ok(Some(nonce))
    }

    /// Waits until the shim of the run `name` (`uid`) has answered, which
    /// it does only once the program runs: a start with berth's shim ends
    /// there, or fails with why the pod ended (the shim could not start
    /// the program, which its last log lines name).
    pub(super) async fn await_shim(
        &self,
        name: &str,
        uid: &str,
        deadline: tokio::time::Instant,
    ) -> Result<(), RuntimeError> {
        let link = lock(&self.state)
            .runs
            .get(name)
            .filter(|run| run.uid == uid)
            .and_then(|run| run.shim.clone());
        let Some(link) = link else {
            return Ok(());
        };
        let mut up = link.writer.subscribe();
        let mut changes = self.changes.subscribe();
        loop {
            if up.borrow_and_update().is_some() {
                return Ok(());
            }
            if let Some(view) = self.cached_view(name).filter(|v| v.uid == uid)
                && (view.gone || view.ended())
            {
                // Ended before it answered: a program that ran and exited
                // at once is reported by the run's events; one the shim
                // could not start, by the shim's exit code, here.
                let Some(exit) = view
                    .exit(None)
                    .filter(|e| e.code == Some(SHIM_COULD_NOT_START))
                else {
                    return Ok(());
                };
                return Err(RuntimeError::SpawnFailed(format!(
                    "the program did not start in pod {name}: {}",
                    exit.stderr_tail.trim()
                )));
            }
            tokio::select! {
                _ = up.changed() => {}
                _ = changes.changed() => {}
                () = tokio::time::sleep_until(deadline) => {
                    return Err(RuntimeError::SpawnFailed(format!(
                        "the shim of pod {name} did not answer in time"
                    )));
                }
            }
        }
    }

    /// Whether `view`'s shim says its program is frozen: what a restarted
    /// replica's discovery reports, so that a hibernated pod is adopted
    /// hibernated. `None`: no shim, or no answer in time.
    pub(super) async fn shim_says_frozen(&self, view: &PodView) -> Option<bool> {
        let (mut lines, _write) = self.dial_shim(view).await.ok()?;
        let hello = tokio::time::timeout(CONNECT_TIMEOUT, lines.next_line())
            .await
            .ok()?
            .ok()??;
        match serde_json::from_str::<ShimEvent>(&hello).ok()? {
            ShimEvent::Hello { state } => Some(state.frozen),
            _ => None,
        }
    }

    /// Connects to `view`'s shim and shows it the pod's credential.
    async fn dial_shim(&self, view: &PodView) -> Result<ShimLines, Undialed> {
        let (Some(slug), Some(credential)) = (view.slug.as_deref(), self.shim_credential(view))
        else {
            return Err(Undialed::NoShim);
        };
        let deadline = tokio::time::Instant::now() + CONNECT_TIMEOUT;
        let endpoint = self
            .endpoint_on(slug, &view.uid, SHIM_PORT_NAME, deadline)
            .await
            .map_err(|e| Undialed::NotFound(e.to_string()))?;
        connect(&endpoint, &credential)
            .await
            .map_err(Undialed::Unreachable)
    }

    /// The credential of `view`'s shim, if the pod has one.
    fn shim_credential(&self, view: &PodView) -> Option<String> {
        let key = self.config.shim_key.as_ref()?;
        Some(key.credential(&view.name, view.shim_nonce.as_deref()?))
    }

    /// The link of the run `r` names, while it is followed.
    fn link_of(&self, r: &RuntimeRef) -> Result<ShimLink, RuntimeError> {
        let gone = || RuntimeError::Gone(r.clone());
        let (name, uid, _) = observe::parse_ref(r).ok_or_else(gone)?;
        let state = lock(&self.state);
        let run = state.runs.get(name).filter(|run| run.uid == uid);
        run.and_then(|run| run.shim.clone()).ok_or_else(gone)
    }

    /// Sends `command` to the shim of the run `r` names; a freeze or a
    /// thaw returns once the shim reports it done.
    pub(super) async fn shim_command(
        &self,
        r: &RuntimeRef,
        command: ShimCommand,
    ) -> Result<(), RuntimeError> {
        let link = self.link_of(r)?;
        match command {
            ShimCommand::Freeze => link.confirmed(&command, true).await,
            ShimCommand::Thaw => link.confirmed(&command, false).await,
            _ => link.send(&command).await,
        }
    }

    /// Runs a hook through the shim of the run `r` names: answered when
    /// the shim reports it done, or after `grace` and a little more.
    pub(super) async fn shim_hook(
        &self,
        r: &RuntimeRef,
        name: &str,
        argv: Vec<String>,
        grace: Duration,
    ) -> Result<HookOutcome, RuntimeError> {
        let link = self.link_of(r)?;
        let id = self
            .next_hook
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (done, answer) = oneshot::channel();
        lock_hooks(&link).insert(id, done);
        let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        let command = ShimCommand::Hook {
            id,
            name: name.to_owned(),
            argv,
            grace_ms,
        };
        let sent = link.send(&command).await;
        let outcome = match sent {
            Ok(()) => tokio::time::timeout(grace + LINK_WAIT, answer).await,
            Err(e) => {
                lock_hooks(&link).remove(&id);
                return Err(e);
            }
        };
        lock_hooks(&link).remove(&id);
        match outcome {
            Ok(Ok(Ok(outcome))) => Ok(outcome),
            Ok(Ok(Err(why))) => Err(RuntimeError::Failed(format!("the hook did not run: {why}"))),
            Ok(Err(_)) | Err(_) => Err(RuntimeError::Failed(
                "the pod's shim did not report the hook's end".into(),
            )),
        }
    }

    /// Keeps run `name` (`uid`)'s link to its shim up while the run is
    /// followed (until `cancel`): connects once the container runs, and
    /// again whenever the connection ends while the pod lives. What the
    /// shim reports goes to `events`; a shim found frozen when a
    /// connection opens is reported `Frozen` (its fence deadline passed
    /// while nobody listened, or another replica froze it).
    pub(super) async fn keep_shim_link(
        self: Arc<Self>,
        (name, uid): (String, String),
        link: ShimLink,
        mut views: watch::Receiver<PodView>,
        events: mpsc::Sender<RuntimeEvent>,
        cancel: CancellationToken,
    ) {
        loop {
            let view = tokio::select! {
                () = cancel.cancelled() => return,
                view = views.wait_for(|v| v.gone || v.ended() || v.main.running) => match view {
                    Ok(view) => view.clone(),
                    Err(_) => return,
                },
            };
            if view.gone || view.ended() {
                return;
            }
            let connected = match self.dial_shim(&view).await {
                Ok(connected) => Some(connected),
                Err(Undialed::NoShim) => {
                    tracing::warn!(pod = %name, "the pod has no shim nonce; it cannot be frozen or fenced");
                    return;
                }
                Err(Undialed::NotFound(e)) => {
                    tracing::debug!(pod = %name, error = %e, "cannot find the pod's shim");
                    None
                }
                Err(Undialed::Unreachable(e)) => {
                    tracing::debug!(pod = %name, error = %e, "cannot reach the pod's shim");
                    None
                }
            };
            if let Some((mut lines, write)) = connected {
                // Published once the shim says hello, which it does only
                // once the program runs (before, the kernel may already
                // have taken the connection for it).
                let mut unpublished = Some(write);
                loop {
                    let line = tokio::select! {
                        () = cancel.cancelled() => None,
                        line = lines.next_line() => line.ok().flatten(),
                    };
                    let Some(line) = line else { break };
                    let Ok(event) = serde_json::from_str::<ShimEvent>(&line) else {
                        continue;
                    };
                    if let (ShimEvent::Hello { .. }, Some(write)) = (&event, unpublished.take()) {
                        tracing::debug!(pod = %name, uid = %uid, "linked to the pod's shim");
                        // `send_replace`: stored even while no command
                        // waits (`send` would drop it for want of a receiver).
                        link.writer
                            .send_replace(Some(Arc::new(tokio::sync::Mutex::new(write))));
                    }
                    let report = match event {
                        ShimEvent::Hello { state } if state.frozen => Some(RuntimeEvent::Frozen),
                        ShimEvent::Frozen => {
                            link.reported(true);
                            Some(RuntimeEvent::Frozen)
                        }
                        ShimEvent::Thawed => {
                            link.reported(false);
                            Some(RuntimeEvent::Thawed)
                        }
                        ShimEvent::HookDone { id, outcome } => {
                            if let Some(done) = lock_hooks(&link).remove(&id) {
                                let _ = done.send(outcome);
                            }
                            None
                        }
                        ShimEvent::Hello { .. }
                        | ShimEvent::Ready { .. }
                        | ShimEvent::Exited { .. } => None,
                    };
                    if let Some(report) = report
                        && events.send(report).await.is_err()
                    {
                        return;
                    }
                }
                link.writer.send_replace(None);
                tracing::debug!(pod = %name, "the link to the pod's shim ended");
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(RETRY_PAUSE) => {}
            }
        }
    }
}

fn lock_hooks(link: &ShimLink) -> std::sync::MutexGuard<'_, HashMap<u64, HookDone>> {
    link.hooks
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
