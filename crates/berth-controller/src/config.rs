//! The controller's settings, as plain data. The binary builds them from
//! its config file; tests build them directly. What depends on *how* a
//! program runs (its command, ports, paths) is the runtime's, not here.

use std::time::Duration;

use berth_core::policy::supervision::SupervisionConfig;
use berth_core::policy::{CrashPolicy, ReapPolicy};
use berth_core::runtime::HookAction;
use berth_store::lease::LeaseConfig;

/// Extra time after the stop grace for the runtime to report the exit
/// before the controller kills the instance outright.
const STOP_MARGIN: Duration = Duration::from_secs(2);

/// How often a restart postponed for an unproven lease looks again (at
/// most: never less often than the renew interval).
const LEASE_RECHECK: Duration = Duration::from_millis(200);

/// The operator's `on_breaker_open` hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerHook {
    /// The program and its arguments; not waited on.
    pub command: Vec<String>,
    /// Its environment, to which `BERTH_USER`, `BERTH_BREAKER_OPENS` and
    /// `BERTH_BREAKER_COOLDOWN_UNTIL` are added (nothing else is inherited).
    pub env: Vec<(String, String)>,
}

/// Everything the controller decides with.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// This node's id (stored in instance records and leases).
    pub node_id: String,
    /// How other nodes reach this one; sent with the heartbeat. Empty on a
    /// single node.
    pub advertise_url: String,
    /// Where other nodes call this one's node-to-node API (its own
    /// listener); sent with the heartbeat. Empty on a single node.
    pub internal_url: String,
    /// A start that is not ready within this is killed and counted as a
    /// crash.
    pub ready_timeout: Duration,
    /// SIGTERM (or its equivalent), then a kill after this.
    pub stop_grace: Duration,
    /// Restart backoff and the circuit breaker's thresholds.
    pub crash: CrashPolicy,
    /// Exit codes that mean "do not restart".
    pub no_restart_exit_codes: Vec<i32>,
    /// Run each time a user's breaker opens; `None` runs nothing.
    pub on_breaker_open: Option<BreakerHook>,
    /// When idle mains are hibernated or stopped, and how many are kept.
    pub reap: ReapPolicy,
    /// The lease's timing (TTL, renew interval, fence deadline), already
    /// checked against invariant 2.
    pub lease: LeaseConfig,
    /// Cluster mode (PostgreSQL): an instance runs only while its lease is
    /// proven, so the fence deadline is enforced, a node freezes its
    /// instances when it cannot renew, and a crashed main is not restarted
    /// on an unproven lease. Off on one node (SQLite): nobody else can take
    /// a lease over.
    pub fencing: bool,
    /// A watchdog command is configured (the runtime runs it).
    pub watchdog: bool,
    /// How many mains this node runs at most (`[cluster] capacity`);
    /// `None`: the runtime's own limit ([`Runtime::capacity`]), if it has
    /// one.
    ///
    /// [`Runtime::capacity`]: berth_core::runtime::Runtime::capacity
    pub capacity: Option<u32>,
    /// Wait after ready in `restart_and_probe` (2.5 s).
    pub probe_settle: Duration,
    /// Budget of `restart_and_probe` (60 s).
    pub probe_budget: Duration,
    /// Parallel restarts in `restart_all_mains`.
    pub restart_all_concurrency: usize,
    /// Run before an instance is frozen for hibernation.
    pub pre_hibernate: Option<HookAction>,
    /// Run before a running instance is stopped gracefully (a stop, the
    /// reaper; never before a fence's or a frozen instance's kill).
    pub pre_stop: Option<HookAction>,
    /// How long a hook may take before it is cut off.
    pub hook_grace: Duration,
}

impl ControllerConfig {
    /// The default settings for node `node_id`.
    pub fn new(node_id: impl Into<String>) -> Self {
        Self {
            node_id: node_id.into(),
            advertise_url: String::new(),
            internal_url: String::new(),
            ready_timeout: Duration::from_secs(60),
            stop_grace: Duration::from_secs(5),
            crash: CrashPolicy::default(),
            no_restart_exit_codes: Vec::new(),
            on_breaker_open: None,
            reap: ReapPolicy::default(),
            lease: LeaseConfig::default(),
            fencing: false,
            watchdog: false,
            capacity: None,
            probe_settle: Duration::from_millis(2500),
            probe_budget: Duration::from_secs(60),
            restart_all_concurrency: 4,
            pre_hibernate: None,
            pre_stop: None,
            hook_grace: Duration::from_secs(10),
        }
    }

    /// The settings of the supervision state machine.
    pub(crate) fn supervision(&self) -> SupervisionConfig {
        SupervisionConfig {
            ready_timeout: self.ready_timeout,
            stop_grace: self.stop_grace,
            stop_margin: STOP_MARGIN,
            stable: self.crash.stable,
            no_restart_exit_codes: self.no_restart_exit_codes.clone(),
            watchdog: self.watchdog,
            fencing: self.fencing,
            lease_recheck: LEASE_RECHECK.min(self.lease.renew()),
        }
    }

    pub(crate) fn check(&self) -> Result<(), crate::ControllerError> {
        if self.node_id.is_empty() {
            return Err(crate::ControllerError::Config(
                "node_id must not be empty".into(),
            ));
        }
        if self
            .on_breaker_open
            .as_ref()
            .is_some_and(|h| h.command.is_empty())
        {
            return Err(crate::ControllerError::Config(
                "the on_breaker_open command is empty".into(),
            ));
        }
        for (name, hook) in [
            ("pre_hibernate", &self.pre_hibernate),
            ("pre_stop", &self.pre_stop),
        ] {
            if matches!(hook, Some(HookAction::Command(c)) if c.is_empty()) {
                return Err(crate::ControllerError::Config(format!(
                    "the {name} command is empty"
                )));
            }
        }
        Ok(())
    }
}
