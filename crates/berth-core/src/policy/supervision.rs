//! Supervision of one main instance as a pure state machine.
//!
//! [`Supervision::step`] takes what happened ([`Event`]) and returns what
//! to do ([`Action`]); the controller's per-instance task performs the
//! actions (runtime calls, store writes, timers) and feeds their outcomes
//! back as events. Nothing here reads a clock, a store or a process, so
//! every path — ready, ready timeout, crash and backoff, breaker, fence,
//! stop, adoption — is a table test.
//!
//! One `Supervision` follows one instance id through all its crash
//! restarts, until it ends ([`Action::Finish`]).

use std::time::Duration;

use crate::UnixMillis;
use crate::policy::{CrashDecision, CrashPolicy};
use crate::runtime::ExitStatus;

/// `last_error` keeps at most this many characters.
pub const MAX_ERROR_CHARS: usize = 500;

/// What the record says when a lost lease ended the instance.
pub const FENCED_ERROR: &str = "lease lost: fenced";

/// Restarts on a fresh port, uncharged, that one run may take in a row
/// before an exit with its port held counts as a crash after all: a
/// program that always fails that way (or a runtime that misjudges it)
/// must still meet the breaker.
pub const MAX_PORT_RETRIES: u32 = 3;

/// The supervision settings, from the config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SupervisionConfig {
    /// A start that is not ready within this is killed and counted as a
    /// crash.
    pub ready_timeout: Duration,
    /// SIGTERM, then SIGKILL after this.
    pub stop_grace: Duration,
    /// Extra time after the grace for the runtime to report the exit
    /// before the instance is killed outright.
    pub stop_margin: Duration,
    /// Uptime after which a crash starts a new episode.
    pub stable: Duration,
    /// Exit codes that mean "do not restart".
    pub no_restart_exit_codes: Vec<i32>,
    /// A watchdog command is configured.
    pub watchdog: bool,
    /// The lease must be proven before a crashed main runs again (cluster
    /// mode; on one node nobody else can take it).
    pub fencing: bool,
    /// How often a restart postponed for an unproven lease looks again.
    pub lease_recheck: Duration,
}

impl Default for SupervisionConfig {
    fn default() -> Self {
        Self {
            ready_timeout: Duration::from_secs(60),
            stop_grace: Duration::from_secs(5),
            stop_margin: Duration::from_secs(2),
            stable: CrashPolicy::default().stable,
            no_restart_exit_codes: Vec::new(),
            watchdog: false,
            fencing: false,
            lease_recheck: Duration::from_millis(200),
        }
    }
}

/// Why an instance is being stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopKind {
    /// An API stop, a restart, the reaper: a graceful stop. `reason` ends
    /// up in the event feed.
    Requested(&'static str),
    /// The lease is lost: kill at once, and forget (never release) the
    /// lease, which belongs to another node now.
    Fenced,
}

/// The timers a supervision arms. At most one of each kind is pending;
/// arming again replaces it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Timer {
    /// The ready timeout of the current start.
    Ready,
    /// A stop's grace (plus margin) ran out: kill.
    Kill,
    /// The crash backoff ended: restart.
    Backoff,
    /// Look at the lease again before a postponed restart.
    LeaseRecheck,
}

/// What the controller knows about the lease when asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseCheck {
    /// Held under the instance's epoch, and proven by a recent renew.
    Held,
    /// Held as far as this node knows, but no renew has succeeded within
    /// `fence_after`: another node may hold it by now.
    Unproven,
    /// Held no longer, or under another epoch.
    Lost,
}

/// What happened.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The program runs (a fresh start, a restart or an adoption) since
    /// `started_at`; `ready` when the runtime saw readiness already.
    Started {
        /// When the run began (wall clock); uptime is measured from it.
        started_at: UnixMillis,
        /// The runtime already saw it ready (an adopted run, say).
        ready: bool,
    },
    /// The runtime reports the instance ready.
    Ready,
    /// The runtime reports the instance frozen, or thawed.
    Frozen,
    /// The runtime reports the instance running again after a freeze.
    Thawed,
    /// Someone asks the instance to end.
    Stop(StopKind),
    /// The program ended.
    Exited(ExitStatus),
    /// The outcome of [`Action::DecideCrash`]; `jitter_unit` is a random
    /// number in `[-1, 1]` for the restart delay's ±10 %.
    CrashDecided {
        /// What the crash policy decided.
        decision: CrashDecision,
        /// The random number the restart delay is spread by.
        jitter_unit: f64,
    },
    /// The outcome of [`Action::CheckLease`].
    Lease(LeaseCheck),
    /// [`Action::Respawn`] failed.
    SpawnFailed(String),
    /// A timer armed by [`Action::Arm`] went off.
    Timer(Timer),
}

/// How the lease ends with the instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseEnd {
    /// Give it up (keeping the holder as a sticky hint).
    Release,
    /// Drop it from this node's books without touching the row: it is
    /// another node's now.
    Forget,
}

/// The terminal record of an instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finish {
    /// `stopped` or `failed`.
    pub status: crate::InstanceStatus,
    /// The last run's exit code, if it exited with one.
    pub exit_code: Option<i32>,
    /// What the last run left to say (its stderr tail, or how and why it
    /// ended), at most [`MAX_ERROR_CHARS`] characters; `None` after a
    /// requested stop.
    pub last_error: Option<String>,
    /// What becomes of the lease.
    pub lease: LeaseEnd,
    /// For the event feed.
    pub message: String,
}

/// Which port a restart listens on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortChoice {
    /// The previous port, when it is still free.
    Same,
    /// Another one: the previous port is held by some other process.
    Fresh,
}

/// What to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Start the timer to go off after the duration, replacing a pending
    /// one of its kind.
    Arm(Timer, Duration),
    /// Cancel the timer, if it is pending.
    Disarm(Timer),
    /// Record the instance running and ready, and route to it.
    MarkReady,
    /// Ask the runtime to stop the program gracefully.
    Stop {
        /// How long the program may take before the runtime kills it.
        grace: Duration,
    },
    /// Kill the program at once (frozen or not).
    Kill,
    /// Track the program as frozen (or not) for the fence bookkeeping.
    NoteFrozen(bool),
    /// Load the crash state, apply the crash policy to a crash after
    /// `uptime`, save it, and answer with [`Event::CrashDecided`].
    DecideCrash {
        /// How long the crashed run had been running.
        uptime: Duration,
    },
    /// Record the crash: status `crashed`, one more restart.
    RecordCrash {
        /// The crash described as by [`describe_exit`]: the stderr tail,
        /// or how the program ended.
        last_error: String,
        /// The exit code, if it exited with one.
        exit_code: Option<i32>,
    },
    /// Start the watchdog (at most once per crash episode).
    SpawnWatchdog,
    /// Run the operator's `on_breaker_open` hook: the breaker just opened.
    RunBreakerHook {
        /// How many times the breaker has opened, this one included.
        opens: u32,
        /// When its cooldown ends (wall clock).
        cooldown_until: UnixMillis,
    },
    /// Answer with [`Event::Lease`].
    CheckLease,
    /// Start the program again (same instance id and epoch); answer with
    /// [`Event::Started`] or [`Event::SpawnFailed`].
    Respawn(PortChoice),
    /// The instance is over.
    Finish(Finish),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The program runs (ready or not).
    Running,
    /// A stop was sent; waiting for the exit (or the kill timer).
    Stopping,
    /// The program ended unasked; waiting for the crash decision.
    Deciding,
    /// Waiting out the restart delay.
    BackingOff,
    /// Waiting for a lease check (or its recheck timer) before restarting.
    AwaitingLease,
    /// A restart was asked for; waiting for it to start.
    Respawning,
    Ended,
}

/// The facts of a crash kept until its decision arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Crash {
    description: String,
    exit_code: Option<i32>,
}

/// The supervision of one main instance.
#[derive(Debug, Clone, PartialEq)]
pub struct Supervision {
    phase: Phase,
    /// When the current run started (wall clock, as the record has it).
    run_started: UnixMillis,
    ready: bool,
    /// The current run was killed for missing its ready timeout.
    timed_out: bool,
    stop: Option<StopKind>,
    /// The program is frozen (its runtime said so).
    frozen: bool,
    /// A watchdog ran in this crash episode.
    watchdog_ran: bool,
    /// A restart is postponed for an unproven lease (logged once).
    postponed: bool,
    /// Uncharged fresh-port restarts since the last ready.
    port_retries: u32,
    crash: Option<Crash>,
}

impl Supervision {
    /// A supervision waiting for [`Event::Started`].
    pub fn new() -> Self {
        Self {
            phase: Phase::Respawning,
            run_started: 0,
            ready: false,
            timed_out: false,
            stop: None,
            frozen: false,
            watchdog_ran: false,
            postponed: false,
            port_retries: 0,
            crash: None,
        }
    }

    /// True once [`Action::Finish`] was returned; every later event is
    /// ignored.
    pub fn is_ended(&self) -> bool {
        self.phase == Phase::Ended
    }

    /// True while a restart waits for the lease to be proven.
    pub fn is_postponed(&self) -> bool {
        self.phase == Phase::AwaitingLease && self.postponed
    }

    /// True while the current run is ready and nothing stops or restarts
    /// it.
    pub fn is_ready(&self) -> bool {
        self.ready && self.phase == Phase::Running
    }

    /// Applies `event` at wall-clock `now` and returns what to do.
    pub fn step(
        &mut self,
        config: &SupervisionConfig,
        now: UnixMillis,
        event: Event,
    ) -> Vec<Action> {
        if self.phase == Phase::Ended {
            return Vec::new();
        }
        match event {
            Event::Started { started_at, ready } => self.started(config, now, started_at, ready),
            Event::Ready => self.became_ready(),
            Event::Frozen => {
                self.frozen = true;
                vec![Action::NoteFrozen(true)]
            }
            Event::Thawed => {
                self.frozen = false;
                vec![Action::NoteFrozen(false)]
            }
            Event::Stop(kind) => self.stop_requested(config, kind),
            Event::Exited(exit) => self.exited(config, now, exit),
            Event::CrashDecided {
                decision,
                jitter_unit,
            } => self.crash_decided(config, decision, jitter_unit),
            Event::Lease(check) => self.lease_checked(config, check),
            Event::SpawnFailed(message) => self.spawn_failed(message),
            Event::Timer(timer) => self.timer(config, now, timer),
        }
    }

    fn started(
        &mut self,
        config: &SupervisionConfig,
        now: UnixMillis,
        started_at: UnixMillis,
        ready: bool,
    ) -> Vec<Action> {
        if self.phase != Phase::Respawning {
            return Vec::new();
        }
        self.phase = Phase::Running;
        self.run_started = started_at;
        self.ready = false;
        self.timed_out = false;
        self.frozen = false;
        self.postponed = false;
        if let Some(kind) = self.stop {
            // Asked to stop while the start was under way.
            return self.send_stop(config, kind);
        }
        if ready {
            return self.became_ready();
        }
        let elapsed =
            Duration::from_millis(u64::try_from(now.saturating_sub(started_at)).unwrap_or(0));
        vec![Action::Arm(
            Timer::Ready,
            config.ready_timeout.saturating_sub(elapsed),
        )]
    }

    fn became_ready(&mut self) -> Vec<Action> {
        if self.phase != Phase::Running || self.ready || self.timed_out {
            return Vec::new();
        }
        self.ready = true;
        self.port_retries = 0;
        vec![Action::Disarm(Timer::Ready), Action::MarkReady]
    }

    fn stop_requested(&mut self, config: &SupervisionConfig, kind: StopKind) -> Vec<Action> {
        // A fence overrides a graceful stop already under way; nothing
        // else replaces the first reason.
        let first = self.stop.is_none();
        if first || kind == StopKind::Fenced {
            self.stop = Some(kind);
        }
        match self.phase {
            Phase::Running => self.send_stop(config, kind),
            Phase::Stopping if kind == StopKind::Fenced && !first => vec![Action::Kill],
            Phase::Deciding | Phase::Respawning | Phase::Stopping => Vec::new(),
            Phase::BackingOff | Phase::AwaitingLease => {
                let finish = self.finish_stopped(None);
                vec![
                    Action::Disarm(Timer::Backoff),
                    Action::Disarm(Timer::LeaseRecheck),
                    finish,
                ]
            }
            Phase::Ended => Vec::new(),
        }
    }

    fn send_stop(&mut self, config: &SupervisionConfig, kind: StopKind) -> Vec<Action> {
        self.phase = Phase::Stopping;
        // A frozen program is never thawed to be stopped: frozen for
        // fencing, another node may hold its lease by now, and a program
        // that flushes on SIGTERM would write as a stale holder.
        let signal = match kind {
            StopKind::Fenced => Action::Kill,
            StopKind::Requested(_) if self.frozen => Action::Kill,
            StopKind::Requested(_) => Action::Stop {
                grace: config.stop_grace,
            },
        };
        let wait = match signal {
            Action::Kill => config.stop_margin,
            _ => config.stop_grace.saturating_add(config.stop_margin),
        };
        vec![
            Action::Disarm(Timer::Ready),
            signal,
            Action::Arm(Timer::Kill, wait),
        ]
    }

    fn exited(
        &mut self,
        config: &SupervisionConfig,
        now: UnixMillis,
        exit: ExitStatus,
    ) -> Vec<Action> {
        if !matches!(self.phase, Phase::Running | Phase::Stopping) {
            return Vec::new();
        }
        let mut actions = vec![Action::Disarm(Timer::Ready), Action::Disarm(Timer::Kill)];
        if self.stop.is_some() {
            actions.push(self.finish_stopped(exit.code));
            return actions;
        }
        // The program lost its port to another process before it was
        // ready: not the program's fault, so no crash is counted and the
        // restart takes another port at once.
        if exit.port_in_use && !self.ready && self.port_retries < MAX_PORT_RETRIES {
            self.port_retries += 1;
            self.phase = Phase::Respawning;
            actions.push(Action::Respawn(PortChoice::Fresh));
            return actions;
        }
        let note = self
            .timed_out
            .then(|| format!("not ready within {} s", config.ready_timeout.as_secs_f64()));
        let description = describe_exit(&exit, note.as_deref());
        if exit
            .code
            .is_some_and(|c| config.no_restart_exit_codes.contains(&c))
        {
            self.phase = Phase::Ended;
            actions.push(Action::Finish(Finish {
                status: crate::InstanceStatus::Stopped,
                exit_code: exit.code,
                last_error: Some(description),
                lease: LeaseEnd::Release,
                message: "exit code means do not restart".into(),
            }));
            return actions;
        }
        let uptime =
            Duration::from_millis(u64::try_from(now.saturating_sub(self.run_started)).unwrap_or(0));
        if uptime >= config.stable {
            self.watchdog_ran = false;
        }
        self.phase = Phase::Deciding;
        self.ready = false;
        self.crash = Some(Crash {
            description,
            exit_code: exit.code,
        });
        actions.push(Action::DecideCrash { uptime });
        actions
    }

    fn crash_decided(
        &mut self,
        config: &SupervisionConfig,
        decision: CrashDecision,
        jitter_unit: f64,
    ) -> Vec<Action> {
        if self.phase != Phase::Deciding {
            return Vec::new();
        }
        let crash = self.crash.take().unwrap_or(Crash {
            description: "exited".into(),
            exit_code: None,
        });
        if self.stop.is_some() {
            // Asked to stop while the decision was made: the stop wins.
            return vec![self.finish_stopped(crash.exit_code)];
        }
        match decision {
            CrashDecision::Restart { delay } => {
                self.phase = Phase::BackingOff;
                let mut actions = vec![Action::RecordCrash {
                    last_error: crash.description,
                    exit_code: crash.exit_code,
                }];
                if config.watchdog && !self.watchdog_ran {
                    self.watchdog_ran = true;
                    actions.push(Action::SpawnWatchdog);
                }
                actions.push(Action::Arm(
                    Timer::Backoff,
                    CrashPolicy::jitter(delay, jitter_unit),
                ));
                actions
            }
            CrashDecision::OpenBreaker {
                opens,
                cooldown_until,
            } => {
                self.phase = Phase::Ended;
                vec![
                    Action::RunBreakerHook {
                        opens,
                        cooldown_until,
                    },
                    Action::Finish(Finish {
                        status: crate::InstanceStatus::Failed,
                        exit_code: crash.exit_code,
                        last_error: Some(crash.description),
                        lease: LeaseEnd::Release,
                        message: format!("crash breaker open until {cooldown_until}"),
                    }),
                ]
            }
        }
    }

    fn lease_checked(&mut self, config: &SupervisionConfig, check: LeaseCheck) -> Vec<Action> {
        if self.phase != Phase::AwaitingLease {
            return Vec::new();
        }
        match check {
            LeaseCheck::Held => {
                self.phase = Phase::Respawning;
                vec![Action::Respawn(PortChoice::Same)]
            }
            // With fencing off, a lease this node still holds needs no proof.
            LeaseCheck::Unproven if !config.fencing => {
                self.phase = Phase::Respawning;
                vec![Action::Respawn(PortChoice::Same)]
            }
            LeaseCheck::Unproven => {
                self.postponed = true;
                vec![Action::Arm(Timer::LeaseRecheck, config.lease_recheck)]
            }
            LeaseCheck::Lost => {
                self.phase = Phase::Ended;
                vec![Action::Finish(fenced(None))]
            }
        }
    }

    fn spawn_failed(&mut self, message: String) -> Vec<Action> {
        if self.phase != Phase::Respawning {
            return Vec::new();
        }
        self.phase = Phase::Ended;
        vec![Action::Finish(Finish {
            status: crate::InstanceStatus::Failed,
            exit_code: None,
            last_error: Some(error_tail(&message)),
            lease: LeaseEnd::Release,
            message,
        })]
    }

    fn timer(&mut self, config: &SupervisionConfig, now: UnixMillis, timer: Timer) -> Vec<Action> {
        match (timer, self.phase) {
            (Timer::Ready, Phase::Running) if !self.ready && !self.timed_out => {
                self.timed_out = true;
                vec![Action::Kill, Action::Arm(Timer::Kill, config.stop_margin)]
            }
            (Timer::Kill, Phase::Running | Phase::Stopping) => {
                // The runtime never reported the exit: the kill is assumed
                // to have worked, and the instance ends as it would have.
                let mut actions = vec![Action::Kill];
                actions.extend(self.exited(
                    config,
                    now,
                    ExitStatus {
                        code: None,
                        signal: None,
                        stderr_tail: String::new(),
                        out_of_memory: None,
                        port_in_use: false,
                    },
                ));
                actions
            }
            (Timer::Backoff, Phase::BackingOff) | (Timer::LeaseRecheck, Phase::AwaitingLease) => {
                self.phase = Phase::AwaitingLease;
                vec![Action::CheckLease]
            }
            _ => Vec::new(),
        }
    }

    fn finish_stopped(&mut self, exit_code: Option<i32>) -> Action {
        self.phase = Phase::Ended;
        match self.stop {
            Some(StopKind::Fenced) => Action::Finish(fenced(exit_code)),
            Some(StopKind::Requested(reason)) => Action::Finish(Finish {
                status: crate::InstanceStatus::Stopped,
                exit_code,
                last_error: None,
                lease: LeaseEnd::Release,
                message: reason.into(),
            }),
            None => Action::Finish(Finish {
                status: crate::InstanceStatus::Stopped,
                exit_code,
                last_error: None,
                lease: LeaseEnd::Release,
                message: "stop".into(),
            }),
        }
    }
}

impl Default for Supervision {
    fn default() -> Self {
        Self::new()
    }
}

fn fenced(exit_code: Option<i32>) -> Finish {
    Finish {
        status: crate::InstanceStatus::Stopped,
        exit_code,
        last_error: Some(FENCED_ERROR.into()),
        lease: LeaseEnd::Forget,
        message: FENCED_ERROR.into(),
    }
}

/// The last [`MAX_ERROR_CHARS`] characters of `text`.
pub fn error_tail(text: &str) -> String {
    let count = text.chars().count();
    text.chars()
        .skip(count.saturating_sub(MAX_ERROR_CHARS))
        .collect()
}

/// The record's `last_error` for an exit: an out-of-memory kill by name,
/// else the stderr tail, else how it ended; `note` (e.g. a missed ready
/// timeout) first.
pub fn describe_exit(exit: &ExitStatus, note: Option<&str>) -> String {
    let how = match (exit.out_of_memory, exit.code, exit.signal) {
        (Some(oom), _, _) => format!("out of memory (limit {} MiB)", oom.limit_mb),
        (None, Some(code), _) => format!("exited with code {code}"),
        (None, None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None, None) => "exited".to_owned(),
    };
    let mut text = note.map(|n| format!("{n}; ")).unwrap_or_default();
    if exit.out_of_memory.is_none() && !exit.stderr_tail.trim().is_empty() {
        text.push_str(exit.stderr_tail.trim_end());
    } else {
        text.push_str(&how);
    }
    error_tail(&text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::InstanceStatus;
    use crate::runtime::OutOfMemory;

    const S: i64 = 1000;

    fn config() -> SupervisionConfig {
        SupervisionConfig {
            ready_timeout: Duration::from_secs(60),
            stop_grace: Duration::from_secs(5),
            stop_margin: Duration::from_secs(2),
            stable: Duration::from_secs(60),
            no_restart_exit_codes: vec![42],
            watchdog: true,
            fencing: true,
            lease_recheck: Duration::from_millis(200),
        }
    }

    fn exit(code: i32, stderr: &str) -> ExitStatus {
        ExitStatus {
            code: Some(code),
            signal: None,
            stderr_tail: stderr.into(),
            out_of_memory: None,
            port_in_use: false,
        }
    }

    /// A supervision whose program started at 0 and is ready.
    fn running() -> Supervision {
        let mut s = Supervision::new();
        s.step(
            &config(),
            0,
            Event::Started {
                started_at: 0,
                ready: false,
            },
        );
        s.step(&config(), S, Event::Ready);
        s
    }

    fn finish_of(actions: &[Action]) -> Option<&Finish> {
        actions.iter().find_map(|a| match a {
            Action::Finish(f) => Some(f),
            _ => None,
        })
    }

    /// Runs `(now, event)` pairs and returns each step's actions.
    fn run(s: &mut Supervision, steps: Vec<(i64, Event)>) -> Vec<Vec<Action>> {
        steps
            .into_iter()
            .map(|(now, event)| s.step(&config(), now, event))
            .collect()
    }

    #[test]
    fn a_start_arms_the_ready_timeout_and_readiness_disarms_it() {
        let mut s = Supervision::new();
        let out = run(
            &mut s,
            vec![
                (
                    0,
                    Event::Started {
                        started_at: 0,
                        ready: false,
                    },
                ),
                (3 * S, Event::Ready),
                (4 * S, Event::Ready),
            ],
        );
        assert_eq!(
            out[0],
            vec![Action::Arm(Timer::Ready, Duration::from_secs(60))]
        );
        assert_eq!(
            out[1],
            vec![Action::Disarm(Timer::Ready), Action::MarkReady]
        );
        assert_eq!(out[2], vec![], "ready once");
        assert!(s.is_ready());
    }

    #[test]
    fn an_adopted_start_gets_only_what_is_left_of_its_ready_timeout() {
        let mut s = Supervision::new();
        let out = s.step(
            &config(),
            50 * S,
            Event::Started {
                started_at: 20 * S,
                ready: false,
            },
        );
        assert_eq!(
            out,
            vec![Action::Arm(Timer::Ready, Duration::from_secs(30))]
        );
        let mut s = Supervision::new();
        let out = s.step(
            &config(),
            90 * S,
            Event::Started {
                started_at: 0,
                ready: false,
            },
        );
        assert_eq!(out, vec![Action::Arm(Timer::Ready, Duration::ZERO)]);
        let mut s = Supervision::new();
        let out = s.step(
            &config(),
            90 * S,
            Event::Started {
                started_at: 0,
                ready: true,
            },
        );
        assert_eq!(out, vec![Action::Disarm(Timer::Ready), Action::MarkReady]);
    }

    #[test]
    fn a_missed_ready_timeout_kills_and_counts_as_a_crash_with_a_note() {
        let mut s = Supervision::new();
        let out = run(
            &mut s,
            vec![
                (
                    0,
                    Event::Started {
                        started_at: 0,
                        ready: false,
                    },
                ),
                (60 * S, Event::Timer(Timer::Ready)),
                (60 * S, Event::Ready),
                (
                    61 * S,
                    Event::Exited(ExitStatus {
                        code: None,
                        signal: Some(9),
                        ..exit(0, "")
                    }),
                ),
            ],
        );
        assert_eq!(
            out[1],
            vec![
                Action::Kill,
                Action::Arm(Timer::Kill, Duration::from_secs(2))
            ]
        );
        assert_eq!(out[2], vec![], "too late to be ready");
        assert!(out[3].contains(&Action::DecideCrash {
            uptime: Duration::from_secs(61)
        }));
        let out = s.step(
            &config(),
            61 * S,
            Event::CrashDecided {
                decision: CrashDecision::Restart {
                    delay: Duration::from_secs(1),
                },
                jitter_unit: 0.0,
            },
        );
        assert_eq!(
            out[0],
            Action::RecordCrash {
                last_error: "not ready within 60 s; killed by signal 9".into(),
                exit_code: None
            }
        );
    }

    #[test]
    fn crashes_back_off_restart_after_the_lease_is_proven_and_watchdog_once() {
        let mut s = running();
        let out = run(
            &mut s,
            vec![
                (10 * S, Event::Exited(exit(1, "boom\n"))),
                (
                    10 * S,
                    Event::CrashDecided {
                        decision: CrashDecision::Restart {
                            delay: Duration::from_secs(2),
                        },
                        jitter_unit: 1.0,
                    },
                ),
                (12 * S, Event::Timer(Timer::Backoff)),
                (12 * S, Event::Lease(LeaseCheck::Held)),
                (
                    12 * S,
                    Event::Started {
                        started_at: 12 * S,
                        ready: false,
                    },
                ),
                (13 * S, Event::Exited(exit(1, "boom again"))),
                (
                    13 * S,
                    Event::CrashDecided {
                        decision: CrashDecision::Restart {
                            delay: Duration::from_secs(4),
                        },
                        jitter_unit: -1.0,
                    },
                ),
            ],
        );
        assert_eq!(
            out[0],
            vec![
                Action::Disarm(Timer::Ready),
                Action::Disarm(Timer::Kill),
                Action::DecideCrash {
                    uptime: Duration::from_secs(10)
                }
            ]
        );
        assert_eq!(
            out[1],
            vec![
                Action::RecordCrash {
                    last_error: "boom".into(),
                    exit_code: Some(1)
                },
                Action::SpawnWatchdog,
                Action::Arm(Timer::Backoff, Duration::from_millis(2200)),
            ]
        );
        assert_eq!(out[2], vec![Action::CheckLease]);
        assert_eq!(out[3], vec![Action::Respawn(PortChoice::Same)]);
        assert_eq!(
            out[4],
            vec![Action::Arm(Timer::Ready, Duration::from_secs(60))]
        );
        // Same episode (not stable): no second watchdog.
        assert_eq!(
            out[6],
            vec![
                Action::RecordCrash {
                    last_error: "boom again".into(),
                    exit_code: Some(1)
                },
                Action::Arm(Timer::Backoff, Duration::from_millis(3600)),
            ]
        );
    }

    #[test]
    fn a_stable_run_starts_a_new_episode_with_its_own_watchdog() {
        let mut s = running();
        let decided = |delay| Event::CrashDecided {
            decision: CrashDecision::Restart { delay },
            jitter_unit: 0.0,
        };
        let out = run(
            &mut s,
            vec![
                (5 * S, Event::Exited(exit(1, ""))),
                (5 * S, decided(Duration::from_secs(1))),
                (6 * S, Event::Timer(Timer::Backoff)),
                (6 * S, Event::Lease(LeaseCheck::Held)),
                (
                    6 * S,
                    Event::Started {
                        started_at: 6 * S,
                        ready: true,
                    },
                ),
                (100 * S, Event::Exited(exit(1, ""))),
                (100 * S, decided(Duration::from_secs(1))),
            ],
        );
        assert!(out[1].contains(&Action::SpawnWatchdog));
        assert!(out[6].contains(&Action::SpawnWatchdog), "{:?}", out[6]);
    }

    #[test]
    fn the_breaker_opening_fails_the_instance_and_releases_the_lease() {
        let mut s = running();
        s.step(&config(), 5 * S, Event::Exited(exit(3, "")));
        let out = s.step(
            &config(),
            5 * S,
            Event::CrashDecided {
                decision: CrashDecision::OpenBreaker {
                    opens: 2,
                    cooldown_until: 99,
                },
                jitter_unit: 0.0,
            },
        );
        assert_eq!(
            out,
            vec![
                Action::RunBreakerHook {
                    opens: 2,
                    cooldown_until: 99
                },
                Action::Finish(Finish {
                    status: InstanceStatus::Failed,
                    exit_code: Some(3),
                    last_error: Some("exited with code 3".into()),
                    lease: LeaseEnd::Release,
                    message: "crash breaker open until 99".into(),
                }),
            ]
        );
        assert!(s.is_ended());
        assert_eq!(s.step(&config(), 6 * S, Event::Ready), vec![]);
    }

    #[test]
    fn a_no_restart_exit_code_stops_without_counting_a_crash() {
        let mut s = running();
        let out = s.step(&config(), 5 * S, Event::Exited(exit(42, "bye")));
        let finish = finish_of(&out).unwrap();
        assert_eq!(finish.status, InstanceStatus::Stopped);
        assert_eq!(finish.lease, LeaseEnd::Release);
        assert!(!out.iter().any(|a| matches!(a, Action::DecideCrash { .. })));
    }

    #[test]
    fn a_requested_stop_is_graceful_then_forceful() {
        let mut s = running();
        let out = run(
            &mut s,
            vec![
                (5 * S, Event::Stop(StopKind::Requested("stop"))),
                (5 * S, Event::Stop(StopKind::Requested("idle"))),
                (12 * S, Event::Timer(Timer::Kill)),
            ],
        );
        assert_eq!(
            out[0],
            vec![
                Action::Disarm(Timer::Ready),
                Action::Stop {
                    grace: Duration::from_secs(5)
                },
                Action::Arm(Timer::Kill, Duration::from_secs(7)),
            ]
        );
        assert_eq!(out[1], vec![], "the first reason stays");
        assert_eq!(out[2][0], Action::Kill);
        let finish = finish_of(&out[2]).unwrap();
        assert_eq!(
            (finish.status, finish.lease, finish.message.as_str()),
            (InstanceStatus::Stopped, LeaseEnd::Release, "stop")
        );
    }

    #[test]
    fn a_fence_kills_at_once_and_forgets_the_lease() {
        let mut s = running();
        let out = run(
            &mut s,
            vec![
                (5 * S, Event::Stop(StopKind::Fenced)),
                (
                    5 * S,
                    Event::Exited(ExitStatus {
                        code: None,
                        signal: Some(9),
                        ..exit(0, "")
                    }),
                ),
            ],
        );
        assert_eq!(
            out[0],
            vec![
                Action::Disarm(Timer::Ready),
                Action::Kill,
                Action::Arm(Timer::Kill, Duration::from_secs(2)),
            ]
        );
        let finish = finish_of(&out[1]).unwrap();
        assert_eq!(finish.lease, LeaseEnd::Forget);
        assert_eq!(finish.last_error.as_deref(), Some(FENCED_ERROR));
    }

    #[test]
    fn a_fence_during_a_graceful_stop_kills_and_wins() {
        let mut s = running();
        let out = run(
            &mut s,
            vec![
                (5 * S, Event::Stop(StopKind::Requested("stop"))),
                (6 * S, Event::Stop(StopKind::Fenced)),
                (6 * S, Event::Exited(exit(0, ""))),
            ],
        );
        assert_eq!(out[1], vec![Action::Kill]);
        assert_eq!(finish_of(&out[2]).unwrap().lease, LeaseEnd::Forget);
    }

    #[test]
    fn a_frozen_instance_is_killed_not_thawed_when_stopped() {
        let mut s = running();
        let out = run(
            &mut s,
            vec![
                (5 * S, Event::Frozen),
                (6 * S, Event::Stop(StopKind::Requested("idle"))),
            ],
        );
        assert_eq!(out[0], vec![Action::NoteFrozen(true)]);
        assert!(out[1].contains(&Action::Kill), "{:?}", out[1]);
        assert!(!out[1].iter().any(|a| matches!(a, Action::Stop { .. })));
        // Thawed (a renew proved the lease), a stop is graceful again.
        let mut s = running();
        s.step(&config(), 5 * S, Event::Frozen);
        s.step(&config(), 6 * S, Event::Thawed);
        let out = s.step(&config(), 7 * S, Event::Stop(StopKind::Requested("idle")));
        assert!(out.iter().any(|a| matches!(a, Action::Stop { .. })));
    }

    #[test]
    fn an_unproven_lease_postpones_a_restart_and_a_lost_one_ends_it() {
        let mut s = running();
        let out = run(
            &mut s,
            vec![
                (5 * S, Event::Exited(exit(1, ""))),
                (
                    5 * S,
                    Event::CrashDecided {
                        decision: CrashDecision::Restart {
                            delay: Duration::from_secs(1),
                        },
                        jitter_unit: 0.0,
                    },
                ),
                (6 * S, Event::Timer(Timer::Backoff)),
                (6 * S, Event::Lease(LeaseCheck::Unproven)),
                (6 * S, Event::Timer(Timer::LeaseRecheck)),
                (6 * S, Event::Lease(LeaseCheck::Lost)),
            ],
        );
        assert_eq!(
            out[3],
            vec![Action::Arm(Timer::LeaseRecheck, Duration::from_millis(200))]
        );
        assert_eq!(out[4], vec![Action::CheckLease]);
        let finish = finish_of(&out[5]).unwrap();
        assert_eq!(
            (finish.lease, finish.status),
            (LeaseEnd::Forget, InstanceStatus::Stopped)
        );
    }

    #[test]
    fn without_fencing_an_unproven_lease_does_not_hold_up_a_restart() {
        let config = SupervisionConfig {
            fencing: false,
            ..config()
        };
        let mut s = Supervision::new();
        s.step(
            &config,
            0,
            Event::Started {
                started_at: 0,
                ready: true,
            },
        );
        s.step(&config, S, Event::Exited(exit(1, "")));
        s.step(
            &config,
            S,
            Event::CrashDecided {
                decision: CrashDecision::Restart {
                    delay: Duration::ZERO,
                },
                jitter_unit: 0.0,
            },
        );
        s.step(&config, S, Event::Timer(Timer::Backoff));
        let out = s.step(&config, S, Event::Lease(LeaseCheck::Unproven));
        assert_eq!(out, vec![Action::Respawn(PortChoice::Same)]);
    }

    #[test]
    fn a_stop_during_the_backoff_ends_the_instance_at_once() {
        let mut s = running();
        s.step(&config(), 5 * S, Event::Exited(exit(1, "")));
        s.step(
            &config(),
            5 * S,
            Event::CrashDecided {
                decision: CrashDecision::Restart {
                    delay: Duration::from_secs(8),
                },
                jitter_unit: 0.0,
            },
        );
        let out = s.step(&config(), 6 * S, Event::Stop(StopKind::Requested("stop")));
        assert_eq!(finish_of(&out).unwrap().status, InstanceStatus::Stopped);
        assert!(s.is_ended());
        assert_eq!(
            s.step(&config(), 13 * S, Event::Timer(Timer::Backoff)),
            vec![]
        );
    }

    #[test]
    fn a_port_taken_before_ready_restarts_at_once_on_a_fresh_port_uncharged() {
        let mut s = Supervision::new();
        s.step(
            &config(),
            0,
            Event::Started {
                started_at: 0,
                ready: false,
            },
        );
        let out = s.step(
            &config(),
            S,
            Event::Exited(ExitStatus {
                port_in_use: true,
                ..exit(1, "Address already in use")
            }),
        );
        assert!(out.contains(&Action::Respawn(PortChoice::Fresh)), "{out:?}");
        assert!(!out.iter().any(|a| matches!(a, Action::DecideCrash { .. })));
        // Once ready, a lost port is an ordinary crash.
        let mut s = running();
        let out = s.step(
            &config(),
            5 * S,
            Event::Exited(ExitStatus {
                port_in_use: true,
                ..exit(1, "")
            }),
        );
        assert!(out.iter().any(|a| matches!(a, Action::DecideCrash { .. })));
    }

    #[test]
    fn port_retries_are_bounded_then_count_as_a_crash() {
        let port_taken = || {
            Event::Exited(ExitStatus {
                port_in_use: true,
                ..exit(1, "Address already in use")
            })
        };
        let started = |at| Event::Started {
            started_at: at,
            ready: false,
        };
        let mut s = Supervision::new();
        s.step(&config(), 0, started(0));
        for n in 1..=MAX_PORT_RETRIES {
            let at = i64::from(n) * S;
            let out = s.step(&config(), at, port_taken());
            assert!(
                out.contains(&Action::Respawn(PortChoice::Fresh)),
                "{n}: {out:?}"
            );
            s.step(&config(), at, started(at));
        }
        let out = s.step(&config(), 9 * S, port_taken());
        assert!(
            out.iter().any(|a| matches!(a, Action::DecideCrash { .. })),
            "{out:?}"
        );
        // Readiness starts the count again.
        let mut s = Supervision::new();
        s.step(&config(), 0, started(0));
        for n in 1..=MAX_PORT_RETRIES {
            s.step(&config(), i64::from(n) * S, port_taken());
            s.step(&config(), i64::from(n) * S, started(i64::from(n) * S));
        }
        s.step(&config(), 5 * S, Event::Ready);
        assert_eq!(s.port_retries, 0);
    }

    #[test]
    fn a_failed_restart_fails_the_instance() {
        let mut s = running();
        s.step(&config(), 5 * S, Event::Exited(exit(1, "")));
        s.step(
            &config(),
            5 * S,
            Event::CrashDecided {
                decision: CrashDecision::Restart {
                    delay: Duration::ZERO,
                },
                jitter_unit: 0.0,
            },
        );
        s.step(&config(), 5 * S, Event::Timer(Timer::Backoff));
        s.step(&config(), 5 * S, Event::Lease(LeaseCheck::Held));
        let out = s.step(
            &config(),
            5 * S,
            Event::SpawnFailed("no such program".into()),
        );
        let finish = finish_of(&out).unwrap();
        assert_eq!(finish.status, InstanceStatus::Failed);
        assert_eq!(finish.last_error.as_deref(), Some("no such program"));
    }

    #[test]
    fn an_adopted_instance_that_ended_while_berth_was_away_is_a_crash() {
        // Adoption of a dead program: started, then its recorded exit.
        let mut s = Supervision::new();
        s.step(
            &config(),
            100 * S,
            Event::Started {
                started_at: 10 * S,
                ready: true,
            },
        );
        let out = s.step(&config(), 100 * S, Event::Exited(exit(2, "")));
        assert!(out.contains(&Action::DecideCrash {
            uptime: Duration::from_secs(90)
        }));
    }

    #[test]
    fn an_adopted_frozen_instance_is_tracked_as_frozen() {
        let mut s = Supervision::new();
        s.step(
            &config(),
            0,
            Event::Started {
                started_at: 0,
                ready: true,
            },
        );
        assert_eq!(
            s.step(&config(), 0, Event::Frozen),
            vec![Action::NoteFrozen(true)]
        );
    }

    #[test]
    fn an_out_of_memory_kill_is_named_with_its_limit() {
        let exit = ExitStatus {
            code: None,
            signal: Some(9),
            stderr_tail: "Killed".into(),
            out_of_memory: Some(OutOfMemory { limit_mb: 64 }),
            port_in_use: false,
        };
        assert_eq!(describe_exit(&exit, None), "out of memory (limit 64 MiB)");
    }

    #[test]
    fn exit_descriptions_prefer_stderr_and_keep_the_tail() {
        assert_eq!(describe_exit(&exit(3, ""), None), "exited with code 3");
        assert_eq!(describe_exit(&exit(3, "boom\n"), None), "boom");
        let long = "x".repeat(600) + "end";
        let text = describe_exit(&exit(1, &long), None);
        assert_eq!(text.chars().count(), MAX_ERROR_CHARS);
        assert!(text.ends_with("end"));
    }
}
