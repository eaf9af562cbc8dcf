//! The per-instance supervisor task: follows one shim's events, decides
//! readiness, applies the crash policy, restarts after the backoff, and
//! carries out stops. One task per live instance, owned by the spawner's
//! `TaskTracker` and cancelled (leaving the process running) on teardown.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_core::policy::{CrashDecision, CrashPolicy};
use berth_core::{Instance, InstanceStatus, Role};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::Readiness;
use crate::inner::{Inner, StopKind, UserSlot, error_tail, millis, random_unit};
use crate::ports::bind_free;
use crate::process::kill_instance;
use crate::readiness::{self, PROBE_INTERVAL};
use crate::shim::{ExitInfo, ShimCommand, ShimEvent, ShimHandle};

/// Extra time after the stop grace for the shim to report the exit before
/// berth kills the process group itself.
const STOP_MARGIN: Duration = Duration::from_secs(2);
/// Events buffered between a shim connection and its supervisor.
const EVENT_BUFFER: usize = 16;

pub(crate) const FENCED_ERROR: &str = "lease lost: fenced";

/// Where a main's supervisor begins.
pub(crate) enum Start {
    /// A shim runs the program. `spawned_at` is set for fresh spawns (for
    /// the spawn-to-ready metric); `token` is one the shim already saw.
    Attached {
        handle: ShimHandle,
        spawned_at: Option<Instant>,
        token: Option<String>,
        /// The shim saw the ready line before berth connected.
        shim_ready: bool,
    },
    /// The program is gone and the crash is not yet counted.
    Crashed {
        exit: Option<ExitInfo>,
        stderr_tail: String,
        note: Option<String>,
    },
    /// The crash is counted already: start the program again now.
    Respawn,
}

enum End {
    /// berth is shutting down: leave the instance as it is.
    Detached,
    Stopped {
        exit: Option<ExitInfo>,
    },
    Exited {
        exit: Option<ExitInfo>,
        stderr_tail: String,
        note: Option<String>,
    },
}

/// How often a restart postponed for an unproven lease looks again.
const LEASE_UNPROVEN_RECHECK: Duration = Duration::from_millis(200);

enum Pause {
    Elapsed,
    Stopped,
    Detached,
}

struct Ctx {
    inner: Arc<Inner>,
    slot: Arc<UserSlot>,
    id: String,
    role: Role,
    stop: CancellationToken,
}

/// Starts the supervisor of main instance `id` and hands its join handle
/// to the instance's entry, for `stop` to wait on.
pub(crate) fn start_main(
    inner: &Arc<Inner>,
    slot: &Arc<UserSlot>,
    id: &str,
    stop: CancellationToken,
    start: Start,
) {
    let ctx = Ctx {
        inner: inner.clone(),
        slot: slot.clone(),
        id: id.to_owned(),
        role: Role::Main,
        stop,
    };
    let task = inner.tracker.spawn(run_main(ctx, start));
    keep_task(slot, Role::Main, id, task);
}

pub(crate) fn start_watchdog(
    inner: &Arc<Inner>,
    slot: &Arc<UserSlot>,
    id: &str,
    stop: CancellationToken,
    handle: ShimHandle,
) {
    let ctx = Ctx {
        inner: inner.clone(),
        slot: slot.clone(),
        id: id.to_owned(),
        role: Role::Watchdog,
        stop,
    };
    let task = inner.tracker.spawn(run_watchdog(ctx, handle));
    keep_task(slot, Role::Watchdog, id, task);
}

fn keep_task(slot: &UserSlot, role: Role, id: &str, task: tokio::task::JoinHandle<()>) {
    let mut state = slot.lock();
    if let Some(live) = state.get_mut(role).as_mut().filter(|l| l.instance.id == id) {
        live.task = Some(task);
    }
}

async fn run_main(ctx: Ctx, start: Start) {
    let mut next = start;
    // One watchdog per crash episode: an episode ends with a stable run.
    let mut watchdog_ran = false;
    loop {
        next = match next {
            Start::Attached {
                handle,
                spawned_at,
                token,
                shim_ready,
            } => match ctx.watch(handle, spawned_at, token, shim_ready).await {
                End::Detached => return,
                End::Stopped { exit } => {
                    ctx.finish_stopped(exit).await;
                    return;
                }
                End::Exited {
                    exit,
                    stderr_tail,
                    note,
                } => Start::Crashed {
                    exit,
                    stderr_tail,
                    note,
                },
            },
            Start::Crashed {
                exit,
                stderr_tail,
                note,
            } => {
                let Some(delay) = ctx
                    .on_crash(exit, &stderr_tail, note, &mut watchdog_ran)
                    .await
                else {
                    return;
                };
                match ctx.pause(delay).await {
                    Pause::Elapsed => Start::Respawn,
                    Pause::Detached => return,
                    Pause::Stopped => {
                        ctx.finish_stopped(None).await;
                        return;
                    }
                }
            }
            Start::Respawn => match ctx.respawn().await {
                Some(start) => start,
                None => return,
            },
        }
    }
}

async fn run_watchdog(ctx: Ctx, handle: ShimHandle) {
    let inner = &ctx.inner;
    let (mut events, _reader) = ctx.follow(handle);
    let mut kill_at: Option<tokio::time::Instant> = None;
    let exit = loop {
        let deadline = kill_at.unwrap_or_else(far_future);
        tokio::select! {
            biased;
            _ = inner.cancel.cancelled() => return,
            _ = ctx.stop.cancelled(), if kill_at.is_none() => {
                kill_at = Some(from_now(inner.config.stop_grace.saturating_add(STOP_MARGIN)));
                ctx.send_stop().await;
            }
            _ = tokio::time::sleep_until(deadline), if kill_at.is_some() => {
                ctx.kill_directly();
                break None;
            }
            event = events.recv() => match event {
                Some(ShimEvent::Exited { exit, .. }) => break Some(exit),
                Some(ShimEvent::Hello { state }) if state.exit.is_some() => break state.exit,
                Some(_) => {}
                None => break ctx.exit_from_state().0,
            },
        }
    };
    // A watchdog is a one-shot job: once it exits its record goes away.
    let finished = inner
        .modify(&ctx.slot, Role::Watchdog, &ctx.id, None, |live| {
            live.instance.status = InstanceStatus::Stopped;
            live.instance.exit_code = exit.and_then(|e| e.code);
            live.control = None;
        })
        .await;
    if finished.is_some() {
        let removed = {
            let mut state = ctx.slot.lock();
            match &state.watchdog {
                Some(live) if live.instance.id == ctx.id => state.watchdog.take(),
                _ => None,
            }
        };
        if let Some(live) = removed {
            inner
                .metrics
                .transition(Role::Watchdog, Some(live.instance.status), None);
        }
    }
}

/// Forwards a shim's events into a bounded channel, so the supervisor can
/// select on them without depending on `next_event` being cancel-safe.
async fn forward_events(
    mut handle: ShimHandle,
    tx: mpsc::Sender<ShimEvent>,
    cancel: CancellationToken,
) {
    loop {
        let event = tokio::select! {
            _ = cancel.cancelled() => return,
            event = handle.next_event() => event,
        };
        let Some(event) = event else { return };
        if tx.send(event).await.is_err() {
            return;
        }
    }
}

fn far_future() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(86_400 * 365)
}

/// `now + d`, capped at [`far_future`]: a configured duration near
/// `u64::MAX` ms must not panic the supervisor with an `Instant` overflow.
fn from_now(d: Duration) -> tokio::time::Instant {
    tokio::time::Instant::now()
        .checked_add(d)
        .map_or_else(far_future, |at| at.min(far_future()))
}

fn describe_exit(exit: Option<ExitInfo>, stderr_tail: &str, note: Option<&str>) -> String {
    if let Some(limit) = exit.and_then(|e| e.oom_limit_mb) {
        // What the program printed is beside the point: the kernel killed
        // it for its memory.
        return format!("out of memory (limit {limit} MiB)");
    }
    let how = match exit {
        Some(ExitInfo {
            code: Some(code), ..
        }) => format!("exited with code {code}"),
        Some(ExitInfo {
            signal: Some(sig), ..
        }) => format!("killed by signal {sig}"),
        _ => "exited".to_owned(),
    };
    let mut text = note.map(|n| format!("{n}; ")).unwrap_or_default();
    if stderr_tail.trim().is_empty() {
        text.push_str(&how);
    } else {
        text.push_str(stderr_tail.trim_end());
    }
    error_tail(&text)
}

type ProbeFuture<'a> = Pin<Box<dyn Future<Output = Option<bool>> + Send + 'a>>;

impl Ctx {
    fn current(&self) -> Option<Instance> {
        self.slot.record(self.role).filter(|i| i.id == self.id)
    }

    /// Keeps `inner.frozen` in step with the shim, whoever froze it (berth's
    /// deadline or the shim's own), so the renew tick thaws every frozen
    /// main whose lease is still held under the same epoch.
    fn note_frozen(&self, frozen: bool) {
        if self.role != Role::Main {
            return;
        }
        let Some(epoch) = self.current().map(|i| i.epoch) else {
            return;
        };
        let mut map = self.inner.frozen.lock().unwrap_or_else(|e| e.into_inner());
        if frozen {
            map.insert(self.slot.user.clone(), epoch);
        } else if map.get(&self.slot.user) == Some(&epoch) {
            map.remove(&self.slot.user);
        }
    }

    fn follow(
        &self,
        handle: ShimHandle,
    ) -> (mpsc::Receiver<ShimEvent>, tokio_util::sync::DropGuard) {
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let cancel = self.inner.cancel.child_token();
        self.inner
            .tracker
            .spawn(forward_events(handle, tx, cancel.clone()));
        (rx, cancel.drop_guard())
    }

    fn stop_kind(&self) -> StopKind {
        let state = self.slot.lock();
        state
            .get(self.role)
            .filter(|l| l.instance.id == self.id)
            .and_then(|l| l.stop_kind)
            .unwrap_or(StopKind::Requested("stop"))
    }

    async fn send(&self, command: ShimCommand) -> bool {
        let control = {
            let state = self.slot.lock();
            state
                .get(self.role)
                .filter(|l| l.instance.id == self.id)
                .and_then(|l| l.control.clone())
        };
        match control {
            Some(control) => control.send(command).await.is_ok(),
            None => false,
        }
    }

    async fn send_stop(&self) {
        let command = match self.stop_kind() {
            StopKind::Fenced => ShimCommand::Kill,
            StopKind::Requested(_) => ShimCommand::Stop {
                grace_ms: millis(self.inner.config.stop_grace),
            },
        };
        if !self.send(command).await {
            self.kill_directly();
        }
    }

    fn kill_directly(&self) {
        let target = {
            let state = self.slot.lock();
            state
                .get(self.role)
                .filter(|l| l.instance.id == self.id)
                .map(|l| (l.instance.pid, l.instance.pid_start, l.shim_pid))
        };
        if let Some((pid, pid_start, shim_pid)) = target {
            tracing::warn!(user = %self.slot.user, role = %self.role, ?pid,
                "shim did not report the exit in time; killing the instance directly");
            kill_instance(pid, pid_start, shim_pid);
        }
    }

    /// The exit a shim recorded in its state file, when its connection
    /// closed without an `Exited` event.
    fn exit_from_state(&self) -> (Option<ExitInfo>, String) {
        match ShimHandle::read_state(&self.slot.paths.state_file(self.role)) {
            Ok(state) if state.instance_id == self.id => (state.exit, state.stderr_tail),
            _ => (None, String::new()),
        }
    }

    fn ended(&self, exit: Option<ExitInfo>, stderr_tail: String, timed_out: bool) -> End {
        if self.stop.is_cancelled() {
            return End::Stopped { exit };
        }
        let note = timed_out.then(|| {
            format!(
                "not ready within {} s",
                self.inner.config.ready_timeout.as_secs_f64()
            )
        });
        End::Exited {
            exit,
            stderr_tail,
            note,
        }
    }

    /// Follows a running shim until its program ends, a stop is carried
    /// out, or berth shuts down.
    async fn watch(
        &self,
        handle: ShimHandle,
        spawned_at: Option<Instant>,
        token: Option<String>,
        shim_ready: bool,
    ) -> End {
        let inner = &self.inner;
        let config = &inner.config;
        let (mut events, _reader) = self.follow(handle);
        let Some(instance) = self.current() else {
            return End::Detached;
        };
        if spawned_at.is_none() {
            // Re-attached: the Hello was consumed by the identity check, so
            // whether the shim froze itself while berth was away is read
            // from its state file.
            if let Ok(state) = ShimHandle::read_state(&self.slot.paths.state_file(self.role)) {
                if state.instance_id == self.id && state.frozen {
                    self.note_frozen(true);
                }
            }
        }
        let port = instance.port.unwrap_or(0);
        let by_token = matches!(config.readiness, Readiness::TokenRegex(_));
        let mut ready = instance.ready;
        if token.is_some() {
            inner.set_token(&self.slot.user, token.clone());
        }
        if by_token && shim_ready && !ready {
            ready = true;
            self.mark_ready(None, spawned_at).await;
        }
        let ready_deadline = {
            let elapsed = crate::inner::Inner::now().saturating_sub(instance.started_at);
            let left = config
                .ready_timeout
                .saturating_sub(Duration::from_millis(u64::try_from(elapsed).unwrap_or(0)));
            tokio::time::Instant::now() + left
        };
        let readiness = &config.readiness;
        let mut probe: ProbeFuture<'_> = Box::pin(readiness::probe(readiness, port));
        let mut kill_at: Option<tokio::time::Instant> = None;
        let mut timed_out = false;
        loop {
            let kill_deadline = kill_at.unwrap_or_else(far_future);
            tokio::select! {
                biased;
                _ = inner.cancel.cancelled() => return End::Detached,
                _ = self.stop.cancelled(), if kill_at.is_none() => {
                    kill_at = Some(from_now(config.stop_grace.saturating_add(STOP_MARGIN)));
                    self.send_stop().await;
                }
                _ = tokio::time::sleep_until(kill_deadline), if kill_at.is_some() => {
                    self.kill_directly();
                    return self.ended(None, String::new(), timed_out);
                }
                event = events.recv() => match event {
                    Some(ShimEvent::Ready { token }) => {
                        if token.is_some() {
                            inner.set_token(&self.slot.user, token.clone());
                        }
                        if by_token && !ready {
                            ready = true;
                            self.mark_ready(token, spawned_at).await;
                        }
                    }
                    Some(ShimEvent::Hello { state }) => {
                        if state.exit.is_some() {
                            return self.ended(state.exit, state.stderr_tail, timed_out);
                        }
                        // A shim found frozen on (re-)attach froze itself
                        // while berth was away: the next good renew thaws it.
                        self.note_frozen(state.frozen);
                        if state.token.is_some() {
                            inner.set_token(&self.slot.user, state.token.clone());
                            if by_token && !ready {
                                ready = true;
                                self.mark_ready(state.token, spawned_at).await;
                            }
                        }
                    }
                    Some(ShimEvent::Exited { exit, stderr_tail }) => {
                        return self.ended(Some(exit), stderr_tail, timed_out);
                    }
                    Some(ShimEvent::Frozen) => self.note_frozen(true),
                    Some(ShimEvent::Thawed) => self.note_frozen(false),
                    None => {
                        let (exit, tail) = self.exit_from_state();
                        return self.ended(exit, tail, timed_out);
                    }
                },
                _ = tokio::time::sleep_until(ready_deadline), if !ready && !timed_out && kill_at.is_none() => {
                    timed_out = true;
                    tracing::warn!(user = %self.slot.user, timeout_s = config.ready_timeout.as_secs_f64(),
                        "instance not ready in time; killing it");
                    kill_at = Some(tokio::time::Instant::now() + STOP_MARGIN);
                    if !self.send(ShimCommand::Kill).await {
                        self.kill_directly();
                    }
                }
                result = &mut probe, if !by_token && !ready && !timed_out && kill_at.is_none() => {
                    if result == Some(true) {
                        ready = true;
                        self.mark_ready(None, spawned_at).await;
                    } else {
                        probe = Box::pin(async move {
                            tokio::time::sleep(PROBE_INTERVAL).await;
                            readiness::probe(readiness, port).await
                        });
                    }
                }
            }
        }
    }

    async fn mark_ready(&self, token: Option<String>, spawned_at: Option<Instant>) {
        if token.is_some() {
            self.inner.set_token(&self.slot.user, token);
        }
        let done = self
            .inner
            .modify(&self.slot, Role::Main, &self.id, None, |live| {
                live.instance.status = InstanceStatus::Running;
                live.instance.ready = true;
            })
            .await;
        if let (Some(_), Some(at)) = (done, spawned_at) {
            self.inner
                .metrics
                .spawn_to_ready
                .observe(at.elapsed().as_secs_f64());
        }
    }

    fn uptime(&self) -> Duration {
        let started = self.current().map_or(0, |i| i.started_at);
        let ms = Inner::now().saturating_sub(started);
        Duration::from_millis(u64::try_from(ms).unwrap_or(0))
    }

    /// Makes the instance terminal. The port and the lease are given up
    /// *before* the record turns terminal: once it does, a new launch may
    /// claim the lease again and must not lose it to this release.
    async fn finish(
        &self,
        status: InstanceStatus,
        exit_code: Option<i32>,
        last_error: Option<String>,
        release_lease: bool,
        message: Option<String>,
    ) {
        let inner = &self.inner;
        let user = &self.slot.user;
        if let Some(port) = self.current().and_then(|i| i.port) {
            inner.revoke_port(port).await;
            inner.ports.release(port);
        }
        {
            let mut frozen = inner.frozen.lock().unwrap_or_else(|e| e.into_inner());
            frozen.remove(user);
        }
        if release_lease {
            inner.release_lease(user).await;
        } else {
            inner.lease.forget(user);
        }
        inner
            .modify(&self.slot, Role::Main, &self.id, message, |live| {
                live.instance.status = status;
                live.instance.ready = false;
                if exit_code.is_some() {
                    live.instance.exit_code = exit_code;
                }
                if last_error.is_some() {
                    live.instance.last_error = last_error;
                }
                live.control = None;
            })
            .await;
    }

    async fn finish_stopped(&self, exit: Option<ExitInfo>) {
        let code = exit.and_then(|e| e.code);
        match self.stop_kind() {
            StopKind::Fenced => {
                tracing::warn!(user = %self.slot.user, "lease lost: instance fenced");
                self.inner.metrics.fenced.inc();
                self.finish(
                    InstanceStatus::Stopped,
                    code,
                    Some(FENCED_ERROR.into()),
                    false,
                    Some(FENCED_ERROR.into()),
                )
                .await;
            }
            StopKind::Requested(reason) => {
                self.finish(
                    InstanceStatus::Stopped,
                    code,
                    None,
                    true,
                    Some(reason.into()),
                )
                .await;
            }
        }
    }

    /// Applies the crash policy; returns the restart delay, or `None` when
    /// the instance is now terminal.
    async fn on_crash(
        &self,
        exit: Option<ExitInfo>,
        stderr_tail: &str,
        note: Option<String>,
        watchdog_ran: &mut bool,
    ) -> Option<Duration> {
        let inner = &self.inner;
        let config = &inner.config;
        let user = &self.slot.user;
        let uptime = self.uptime();
        if uptime >= config.crash.stable {
            *watchdog_ran = false;
        }
        let code = exit.and_then(|e| e.code);
        let description = describe_exit(exit, stderr_tail, note.as_deref());
        if code.is_some_and(|c| config.no_restart_exit_codes.contains(&c)) {
            tracing::info!(%user, ?code, "instance exited with a no-restart code");
            self.finish(
                InstanceStatus::Stopped,
                code,
                Some(description),
                true,
                Some("exit code means do not restart".into()),
            )
            .await;
            return None;
        }
        let mut state = match inner.store.load_crash_state(user).await {
            Ok(state) => state,
            Err(e) => {
                inner.metrics.store_errors.inc();
                tracing::warn!(%user, error = %e, "could not load the crash state; counting from zero");
                Default::default()
            }
        };
        let now = Inner::now();
        let decision = config.crash.on_crash(&mut state, now, uptime);
        if let Err(e) = inner.store.save_crash_state(user, &state).await {
            inner.metrics.store_errors.inc();
            tracing::warn!(%user, error = %e, "could not save the crash state");
        }
        match decision {
            CrashDecision::Restart { delay } => {
                let crashed = inner
                    .modify(
                        &self.slot,
                        Role::Main,
                        &self.id,
                        Some(description.clone()),
                        |live| {
                            live.instance.status = InstanceStatus::Crashed;
                            live.instance.ready = false;
                            live.instance.restarts = live.instance.restarts.saturating_add(1);
                            live.instance.last_error = Some(description.clone());
                            live.instance.exit_code = code;
                            live.control = None;
                        },
                    )
                    .await?;
                inner.metrics.restarts.inc();
                // `?`: the description is the program's own output, which
                // must not forge lines or send control codes to berth's log.
                tracing::info!(%user, restarts = crashed.restarts, delay_ms = millis(delay),
                    error = ?description, "instance crashed; restarting after backoff");
                if config.watchdog_command.is_some() && !*watchdog_ran {
                    *watchdog_ran = true;
                    if let Err(e) = inner.spawn_watchdog(&self.slot, Some(crashed)).await {
                        tracing::warn!(%user, error = %e, "could not start the watchdog after a crash");
                    }
                }
                Some(CrashPolicy::jitter(delay, random_unit()))
            }
            CrashDecision::OpenBreaker {
                opens,
                cooldown_until,
            } => {
                tracing::warn!(%user, opens, cooldown_until, error = ?description,
                    "crash breaker opened: instance failed");
                inner.metrics.breaker_opens.inc();
                inner.run_breaker_hook(user, opens, cooldown_until);
                self.finish(
                    InstanceStatus::Failed,
                    code,
                    Some(description),
                    true,
                    Some(format!("crash breaker open until {cooldown_until}")),
                )
                .await;
                None
            }
        }
    }

    async fn pause(&self, delay: Duration) -> Pause {
        tokio::select! {
            biased;
            _ = self.inner.cancel.cancelled() => Pause::Detached,
            _ = self.stop.cancelled() => Pause::Stopped,
            _ = tokio::time::sleep(delay) => Pause::Elapsed,
        }
    }

    /// Starts the program again under the same lease epoch and instance id,
    /// on the same port when it is still free.
    ///
    /// With fencing on, a restart waits while the lease is unproven (no renew
    /// sent within `fence_after` has succeeded): another node may hold it by
    /// now, and a program started then would run next to that node's. It
    /// goes ahead after the next good renew, ends as fenced when the renew
    /// finds the lease lost, and ends as stopped when asked to stop.
    /// Waiting, rather than giving up, keeps a short store outage from
    /// stopping every crashed user's instance for good.
    async fn respawn(&self) -> Option<Start> {
        let inner = &self.inner;
        let user = &self.slot.user;
        let mut postponed = false;
        let instance = loop {
            if self.stop.is_cancelled() {
                self.finish_stopped(None).await;
                return None;
            }
            let instance = self.current()?;
            if inner.lease.epoch_of(user) != Some(instance.epoch) {
                self.finish(
                    InstanceStatus::Stopped,
                    None,
                    Some(FENCED_ERROR.into()),
                    false,
                    Some(FENCED_ERROR.into()),
                )
                .await;
                return None;
            }
            if !(inner.config.fence && inner.lease.fence_due(Instant::now())) {
                break instance;
            }
            if !postponed {
                postponed = true;
                tracing::warn!(%user, epoch = instance.epoch,
                    "lease unproven (no successful renew within fence_after); postponing the restart");
            }
            match self
                .pause(LEASE_UNPROVEN_RECHECK.min(inner.config.lease.renew()))
                .await
            {
                Pause::Elapsed => {}
                Pause::Detached => return None,
                // Checked at the top of the loop.
                Pause::Stopped => {}
            }
        };
        let port = match instance.port.filter(|p| bind_free(*p)) {
            Some(port) => port,
            None => match inner.ports.allocate(None, &Default::default()) {
                Some(port) => {
                    if let Some(old) = instance.port {
                        inner.revoke_port(old).await;
                        inner.ports.release(old);
                    }
                    // Record the new port now so `finish` frees the right one.
                    inner
                        .modify(&self.slot, Role::Main, &self.id, None, |live| {
                            live.instance.port = Some(port);
                        })
                        .await;
                    port
                }
                None => {
                    let message = format!("no free port in {}", inner.port_range_text());
                    self.finish(
                        InstanceStatus::Failed,
                        None,
                        Some(message.clone()),
                        true,
                        Some(message),
                    )
                    .await;
                    return None;
                }
            },
        };
        let patch = {
            let state = self.slot.lock();
            state.main.as_ref().and_then(|l| l.patch.clone())
        };
        let mut next = instance.clone();
        next.port = Some(port);
        let spawned = async {
            let account = inner.account(&self.slot).await.map_err(|e| e.to_string())?;
            let spec = inner
                .shim_spec(&self.slot, &next, port, patch.as_deref(), account.as_ref())
                .map_err(|e| e.to_string())?;
            inner
                .grant_port(account.as_ref(), port)
                .await
                .map_err(|e| e.to_string())?;
            inner.shims.spawn(&spec).await.map_err(|e| match e {
                crate::shim::ShimError::SpawnFailed(m) => m,
                other => other.to_string(),
            })
        }
        .await;
        match spawned {
            Ok((handle, state)) => {
                let control = handle.control();
                inner.set_token(user, None);
                inner
                    .modify(
                        &self.slot,
                        Role::Main,
                        &self.id,
                        Some("restarted".into()),
                        |live| {
                            live.instance.status = InstanceStatus::Starting;
                            live.instance.ready = false;
                            live.instance.port = Some(port);
                            live.instance.pid = Some(state.pid);
                            live.instance.pid_start = Some(state.pid_start);
                            live.instance.started_at = Inner::now();
                            live.control = Some(control);
                            live.shim_pid = Some(state.shim_pid);
                        },
                    )
                    .await?;
                Some(Start::Attached {
                    handle,
                    spawned_at: Some(Instant::now()),
                    shim_ready: state.ready,
                    token: state.token,
                })
            }
            Err(message) => {
                tracing::warn!(%user, error = ?message, "could not restart the instance");
                self.finish(
                    InstanceStatus::Failed,
                    None,
                    Some(error_tail(&message)),
                    true,
                    Some(message),
                )
                .await;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_descriptions_prefer_stderr() {
        let code = Some(ExitInfo {
            code: Some(3),
            signal: None,
            oom_limit_mb: None,
        });
        assert_eq!(describe_exit(code, "", None), "exited with code 3");
        assert_eq!(describe_exit(code, "boom\n", None), "boom");
        let sig = Some(ExitInfo {
            code: None,
            signal: Some(9),
            oom_limit_mb: None,
        });
        assert_eq!(describe_exit(sig, " ", None), "killed by signal 9");
        assert_eq!(
            describe_exit(None, "", Some("not ready within 1 s")),
            "not ready within 1 s; exited"
        );
        let oom = Some(ExitInfo {
            code: None,
            signal: Some(9),
            oom_limit_mb: Some(64),
        });
        assert_eq!(
            describe_exit(oom, "MemoryError\n", None),
            "out of memory (limit 64 MiB)"
        );
    }
}
