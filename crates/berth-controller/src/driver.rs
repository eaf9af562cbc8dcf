//! The per-instance drivers: one task per live instance, owned by the
//! controller's task tracker.
//!
//! A main's driver runs [`Supervision::step`] (the pure state machine of
//! `berth_core::policy::supervision`) and performs the actions it returns:
//! runtime calls, store writes through the publisher, crash decisions
//! through the breaker, lease checks through the fencer, and timers (one
//! pending deadline per [`Timer`] kind). Outcomes go back into the machine
//! as events. A watchdog's driver only follows its one run to its end.
//!
//! On shutdown a driver returns at once and leaves its instance running,
//! for the next berth to adopt.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_core::policy::supervision::{Action, Event, PortChoice, StopKind, Supervision, Timer};
use berth_core::runtime::{ExitStatus, InstanceSpec, Patch, RuntimeEvent, RuntimeRef, Started};
use berth_core::{Epoch, Instance, InstanceStatus, Role, Stage, UnixMillis, unix_millis_now};
use tokio::sync::{mpsc, watch};

use crate::Shared;
use crate::users::Slot;

/// The run a driver follows: the runtime's reference and its events.
pub(crate) struct Run {
    pub runtime_ref: RuntimeRef,
    pub events: mpsc::Receiver<RuntimeEvent>,
}

impl Run {
    pub fn of(started: Started) -> Run {
        Run {
            runtime_ref: started.runtime_ref,
            events: started.events,
        }
    }
}

/// Where a main's driver begins.
pub(crate) enum Begin {
    /// A run is under way (just started, or adopted). `fresh` runs count
    /// toward the spawn-to-ready metric.
    Run {
        run: Run,
        started_at: UnixMillis,
        ready: bool,
        fresh: bool,
    },
    /// The program ended while berth was away; the crash is not counted.
    Ended {
        started_at: UnixMillis,
        ready: bool,
        exit: ExitStatus,
    },
    /// The crash is counted already: start the program again now.
    Respawn,
}

/// A random number in `[-1, 1]` for the backoff's jitter.
fn random_unit() -> f64 {
    match getrandom::u64() {
        Ok(x) => (x as f64 / u64::MAX as f64) * 2.0 - 1.0,
        Err(_) => 0.0,
    }
}

fn far_future() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(86_400 * 365)
}

/// `now + d`, capped at [`far_future`]: a configured duration near
/// `u64::MAX` ms must not panic a driver with an `Instant` overflow.
fn from_now(d: Duration) -> tokio::time::Instant {
    tokio::time::Instant::now()
        .checked_add(d)
        .map_or_else(far_future, |at| at.min(far_future()))
}

async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn next_event(run: &mut Option<Run>) -> Option<RuntimeEvent> {
    match run {
        Some(run) => run.events.recv().await,
        None => std::future::pending().await,
    }
}

/// What the record says when the runtime's event stream ended without an
/// exit.
const LOST_TRACK: &str = "the runtime lost track of the instance";

/// Starts the driver of main instance `id` (whose entry holds `stops`'
/// sender) and hands its join handle to the entry, for stops to wait on.
pub(crate) fn start_main(
    shared: &Arc<Shared>,
    slot: &Arc<Slot>,
    instance: &Instance,
    stops: watch::Receiver<Option<StopKind>>,
    begin: Begin,
) {
    let driver = MainDriver {
        shared: shared.clone(),
        slot: slot.clone(),
        id: instance.id.clone(),
        epoch: instance.epoch,
        machine: Supervision::new(),
        run: None,
        spawned_at: None,
        timers: HashMap::new(),
        stops,
        stops_open: true,
        crashed: None,
    };
    let task = shared.tasks.spawn(driver.drive(begin));
    keep_task(slot, Role::Main, &instance.id, task);
}

/// Starts the driver of watchdog `id`.
pub(crate) fn start_watchdog(
    shared: &Arc<Shared>,
    slot: &Arc<Slot>,
    id: &str,
    run: Run,
    stops: watch::Receiver<Option<StopKind>>,
) {
    let task = shared.tasks.spawn(drive_watchdog(
        shared.clone(),
        slot.clone(),
        id.to_owned(),
        run,
        stops,
    ));
    keep_task(slot, Role::Watchdog, id, task);
}

fn keep_task(slot: &Slot, role: Role, id: &str, task: tokio::task::JoinHandle<()>) {
    if let Some(entry) = slot.lock().current(role, id) {
        entry.task = Some(task);
    }
}

struct MainDriver {
    shared: Arc<Shared>,
    slot: Arc<Slot>,
    id: String,
    epoch: Epoch,
    machine: Supervision,
    run: Option<Run>,
    /// When the current run was started, for the spawn-to-ready metric.
    spawned_at: Option<Instant>,
    timers: HashMap<Timer, tokio::time::Instant>,
    stops: watch::Receiver<Option<StopKind>>,
    /// False once the entry (and with it the sender) is gone.
    stops_open: bool,
    /// The record as of the last crash, for the watchdog's handoff.
    crashed: Option<Instance>,
}

impl MainDriver {
    async fn drive(mut self, begin: Begin) {
        let mut queue = VecDeque::new();
        match begin {
            Begin::Run {
                run,
                started_at,
                ready,
                fresh,
            } => {
                self.run = Some(run);
                self.spawned_at = fresh.then(Instant::now);
                queue.push_back(Event::Started { started_at, ready });
            }
            Begin::Ended {
                started_at,
                ready,
                exit,
            } => {
                queue.push_back(Event::Started { started_at, ready });
                queue.push_back(Event::Exited(exit));
            }
            Begin::Respawn => {
                // The machine starts out waiting for a start: give it one.
                let event = self.respawn(PortChoice::Same).await;
                queue.push_back(event);
            }
        }
        loop {
            while let Some(event) = queue.pop_front() {
                let actions = self
                    .machine
                    .step(&self.shared.supervision, unix_millis_now(), event);
                for action in actions {
                    if let Some(next) = self.perform(action).await {
                        queue.push_back(next);
                    }
                }
            }
            if self.machine.is_ended() {
                return;
            }
            match self.wait().await {
                Some(event) => queue.push_back(event),
                // Shutting down: the instance keeps running.
                None => return,
            }
        }
    }

    /// The next thing that happens; `None` when berth shuts down.
    async fn wait(&mut self) -> Option<Event> {
        loop {
            let timer = self
                .timers
                .iter()
                .min_by_key(|(_, at)| **at)
                .map(|(kind, at)| (*kind, *at));
            tokio::select! {
                biased;
                _ = self.shared.cancel.cancelled() => return None,
                changed = self.stops.changed(), if self.stops_open => {
                    if changed.is_err() {
                        self.stops_open = false;
                        continue;
                    }
                    if let Some(kind) = *self.stops.borrow_and_update() {
                        return Some(Event::Stop(kind));
                    }
                }
                event = next_event(&mut self.run) => return Some(self.runtime_event(event)),
                () = sleep_until_opt(timer.map(|(_, at)| at)) => {
                    let kind = timer.map(|(kind, _)| kind)?;
                    self.timers.remove(&kind);
                    return Some(Event::Timer(kind));
                }
            }
        }
    }

    fn runtime_event(&mut self, event: Option<RuntimeEvent>) -> Event {
        match event {
            Some(RuntimeEvent::Ready { token }) => {
                if token.is_some() {
                    self.shared.publisher.set_token(&self.slot.user, token);
                }
                Event::Ready
            }
            Some(RuntimeEvent::Frozen) => Event::Frozen,
            Some(RuntimeEvent::Thawed) => Event::Thawed,
            Some(RuntimeEvent::Exited(exit)) => {
                self.run = None;
                Event::Exited(exit)
            }
            None => {
                self.run = None;
                Event::Exited(ExitStatus {
                    code: None,
                    signal: None,
                    stderr_tail: LOST_TRACK.to_owned(),
                    out_of_memory: None,
                    port_in_use: false,
                })
            }
        }
    }

    fn current_ref(&self) -> Option<RuntimeRef> {
        self.run.as_ref().map(|r| r.runtime_ref.clone())
    }

    async fn perform(&mut self, action: Action) -> Option<Event> {
        let shared = self.shared.clone();
        let user = &self.slot.user;
        match action {
            Action::Arm(timer, after) => {
                self.timers.insert(timer, from_now(after));
            }
            Action::Disarm(timer) => {
                self.timers.remove(&timer);
            }
            Action::MarkReady => self.mark_ready().await,
            Action::Stop { grace } => {
                if let Some(r) = self.current_ref()
                    && let Err(e) = shared.runtime.stop(&r, grace).await
                    && !matches!(e, berth_core::runtime::RuntimeError::Gone(_))
                {
                    tracing::warn!(%user, error = %e, "could not stop the instance; killing it");
                    self.kill(&r).await;
                }
            }
            Action::Kill => {
                if let Some(r) = self.current_ref() {
                    self.kill(&r).await;
                }
            }
            // The freeze of a hibernation is not a fence: the fencer tracks
            // only what froze the program for its lease.
            Action::NoteFrozen(true) if self.slot.is_hibernated() => {}
            Action::NoteFrozen(frozen) => {
                if shared.fencer.note_frozen(user, self.epoch, frozen) {
                    shared.metrics.fenced.inc();
                }
            }
            Action::DecideCrash { uptime } => {
                let decision = shared
                    .breaker
                    .on_crash(user, uptime, unix_millis_now())
                    .await;
                return Some(Event::CrashDecided {
                    decision,
                    jitter_unit: random_unit(),
                });
            }
            Action::RecordCrash {
                last_error,
                exit_code,
            } => {
                let crashed = shared
                    .modify(
                        &self.slot,
                        Role::Main,
                        &self.id,
                        Some(last_error.clone()),
                        |entry| {
                            let i = &mut entry.instance;
                            i.status = InstanceStatus::Crashed;
                            i.ready = false;
                            i.restarts = i.restarts.saturating_add(1);
                            i.last_error = Some(last_error.clone());
                            i.exit_code = exit_code;
                        },
                    )
                    .await;
                shared.metrics.restarts.inc();
                // `?`: the description is the program's own output, which
                // must not forge lines or send control codes to berth's log.
                tracing::info!(%user, restarts = crashed.as_ref().map(|c| c.restarts),
                    error = ?last_error, "instance crashed; restarting after backoff");
                self.crashed = crashed;
            }
            Action::SpawnWatchdog => {
                let (shared, slot, crashed) =
                    (self.shared.clone(), self.slot.clone(), self.crashed.clone());
                self.shared.tasks.spawn(async move {
                    if let Err(e) = shared.spawn_watchdog(&slot, crashed).await {
                        tracing::warn!(user = %slot.user, error = %e,
                            "could not start the watchdog after a crash");
                    }
                });
            }
            Action::RunBreakerHook {
                opens,
                cooldown_until,
            } => shared
                .breaker
                .opened(user, opens, cooldown_until, &shared.tasks, &shared.cancel),
            Action::CheckLease => {
                let check = shared.fencer.check(user, self.epoch);
                if check == berth_core::policy::supervision::LeaseCheck::Unproven
                    && !self.machine.is_postponed()
                    && shared.supervision.fencing
                {
                    tracing::warn!(%user, epoch = self.epoch,
                        "lease unproven (no successful renew within fence_after); postponing the restart");
                }
                return Some(Event::Lease(check));
            }
            Action::Respawn(choice) => return Some(self.respawn(choice).await),
            Action::Finish(finish) => shared.finish(&self.slot, &self.id, &finish).await,
        }
        None
    }

    async fn kill(&self, r: &RuntimeRef) {
        match self.shared.runtime.kill(r).await {
            Ok(()) | Err(berth_core::runtime::RuntimeError::Gone(_)) => {}
            Err(e) => {
                tracing::warn!(user = %self.slot.user, error = %e, "could not kill the instance")
            }
        }
    }

    async fn mark_ready(&mut self) {
        // A main adopted as ready is recorded so already: a node of
        // thousands adopts without a store write per instance.
        let recorded_ready = self.slot.record(Role::Main).is_some_and(|i| {
            i.id == self.id
                && i.ready
                && matches!(
                    i.status,
                    InstanceStatus::Running | InstanceStatus::Hibernated
                )
        });
        if recorded_ready {
            return;
        }
        let done = self
            .shared
            .modify(&self.slot, Role::Main, &self.id, None, |entry| {
                // An adopted hibernated main is ready and stays hibernated.
                if entry.instance.status != InstanceStatus::Hibernated {
                    entry.instance.status = InstanceStatus::Running;
                }
                entry.instance.ready = true;
            })
            .await;
        if let (Some(_), Some(at)) = (done, self.spawned_at.take()) {
            self.shared
                .metrics
                .spawn_to_ready
                .observe(at.elapsed().as_secs_f64());
        }
    }

    /// Starts the program again under the same instance id and epoch: on
    /// the same port when it is still free, or on a fresh one.
    async fn respawn(&mut self, choice: PortChoice) -> Event {
        let shared = self.shared.clone();
        let user = &self.slot.user;
        let Some(record) = self.slot.record(Role::Main).filter(|i| i.id == self.id) else {
            return Event::SpawnFailed("the instance's record is gone".into());
        };
        if choice == PortChoice::Fresh {
            tracing::info!(%user, port = ?record.port,
                "another process took the instance's port before it was ready; restarting on a fresh port");
        }
        let egress = match shared.own_egress(user).await {
            Ok(egress) => egress,
            Err(e) => {
                return Event::SpawnFailed(format!("cannot read the user's egress policy: {e}"));
            }
        };
        let spec = InstanceSpec {
            instance_id: self.id.clone(),
            user: user.clone(),
            slug: self.slot.slug.clone(),
            role: Role::Main,
            epoch: self.epoch,
            folder: record.folder.clone(),
            patch: Patch::Unchanged,
            port_hint: match choice {
                PortChoice::Same => record.port,
                PortChoice::Fresh => None,
            },
            fence: shared.fencer.deadline_for_new_run(),
            env: Vec::new(),
            handoff: None,
            egress,
        };
        // A new run is never frozen.
        self.slot.set_hibernated(false);
        shared
            .publisher
            .announce_stage(&self.slot, Stage::Spawning, None);
        match shared.runtime.start(spec).await {
            Ok(started) => {
                let now = unix_millis_now();
                shared.publisher.set_token(user, None);
                let endpoint = started.endpoint.clone();
                let (pid, runtime_ref) = (started.pid, started.runtime_ref.clone());
                shared
                    .modify(
                        &self.slot,
                        Role::Main,
                        &self.id,
                        Some("restarted".into()),
                        |entry| {
                            let i = &mut entry.instance;
                            i.status = InstanceStatus::Starting;
                            i.ready = false;
                            i.port = endpoint.as_ref().map(|e| e.port);
                            i.pid = pid;
                            i.runtime_ref = Some(runtime_ref);
                            i.started_at = now;
                            entry.endpoint = endpoint;
                        },
                    )
                    .await;
                self.run = Some(Run::of(started));
                self.spawned_at = Some(Instant::now());
                Event::Started {
                    started_at: now,
                    ready: false,
                }
            }
            Err(e) => {
                tracing::warn!(%user, error = ?e.to_string(), "could not restart the instance");
                Event::SpawnFailed(e.to_string())
            }
        }
    }
}

/// Follows a watchdog's one run until it ends, carrying out a stop; then
/// its record goes away (a watchdog is a one-shot job, never restarted).
async fn drive_watchdog(
    shared: Arc<Shared>,
    slot: Arc<Slot>,
    id: String,
    mut run: Run,
    mut stops: watch::Receiver<Option<StopKind>>,
) {
    let margin = shared.supervision.stop_margin;
    let mut kill_at: Option<tokio::time::Instant> = None;
    let mut stops_open = true;
    let exit_code = loop {
        tokio::select! {
            biased;
            _ = shared.cancel.cancelled() => return,
            changed = stops.changed(), if stops_open && kill_at.is_none() => {
                if changed.is_err() {
                    stops_open = false;
                    continue;
                }
                let kind = *stops.borrow_and_update();
                let r = &run.runtime_ref;
                match kind {
                    Some(StopKind::Fenced) => {
                        let _ = shared.runtime.kill(r).await;
                        kill_at = Some(from_now(margin));
                    }
                    Some(StopKind::Requested(_)) => {
                        let grace = shared.config.stop_grace;
                        if shared.runtime.stop(r, grace).await.is_err() {
                            let _ = shared.runtime.kill(r).await;
                        }
                        kill_at = Some(from_now(grace.saturating_add(margin)));
                    }
                    None => {}
                }
            }
            () = sleep_until_opt(kill_at), if kill_at.is_some() => {
                let _ = shared.runtime.kill(&run.runtime_ref).await;
                break None;
            }
            event = run.events.recv() => match event {
                Some(RuntimeEvent::Exited(exit)) => break exit.code,
                None => break None,
                Some(_) => {}
            },
        }
    };
    shared
        .modify(&slot, Role::Watchdog, &id, None, |entry| {
            entry.instance.status = InstanceStatus::Stopped;
            entry.instance.exit_code = exit_code;
        })
        .await;
    shared.runtime.release(&id).await;
    shared.publisher.remove(&slot, Role::Watchdog, &id);
}
