//! The local backend's settings, as plain data. The binary builds this from
//! its config file; tests build it directly.

use std::collections::BTreeMap;
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::time::Duration;

use berth_core::policy::{CrashPolicy, ReapPolicy};
use berth_store::lease::LeaseConfig;

use crate::isolation::{Isolation, Limits, UidRange};

/// How berth decides that a starting instance is ready (design §4.2).
#[derive(Debug, Clone)]
pub enum Readiness {
    /// A stdout/stderr line matches; the first capture group is the launch
    /// token.
    TokenRegex(regex::Regex),
    /// `GET <path>` on the instance's port answers below 500.
    Http { path: String },
    /// A TCP connect to the instance's port succeeds.
    Tcp,
}

/// Everything the local spawner needs.
#[derive(Debug, Clone)]
pub struct LocalConfig {
    /// This node's id (stored in instance records and leases).
    pub node_id: String,
    /// How other nodes reach this one; sent with the heartbeat. Empty on a
    /// single node.
    pub advertise_url: String,
    /// Root of all state: `users/<slug>/…` (user data) and `run/<slug>/…`
    /// (shim sockets and state files, owned by berth).
    pub data_dir: PathBuf,
    /// The program, with placeholders `{user}` `{slug}` `{port}` `{home}`
    /// `{folder}` `{patch}` `{base_path}`.
    pub command: Vec<String>,
    /// Extra environment for the program.
    pub env: BTreeMap<String, String>,
    /// Names of berth's own environment variables passed through
    /// (e.g. `PATH`, `LANG`).
    pub env_allowlist: Vec<String>,
    pub readiness: Readiness,
    pub ready_timeout: Duration,
    /// Ports handed to instances; each checked free before use.
    pub port_range: RangeInclusive<u16>,
    pub stop_grace: Duration,
    /// Extension of the materialised patch file `patches/main.<ext>`.
    pub patch_ext: String,
    /// The watchdog program (design §4.4), same placeholders.
    pub watchdog_command: Option<Vec<String>>,
    pub crash: CrashPolicy,
    /// Exit codes that mean "do not restart".
    pub no_restart_exit_codes: Vec<i32>,
    /// Run (not waited on) when a breaker opens; gets `BERTH_USER`,
    /// `BERTH_BREAKER_OPENS`, `BERTH_BREAKER_COOLDOWN_UNTIL` in its env.
    pub on_breaker_open: Option<Vec<String>>,
    pub reap: ReapPolicy,
    pub lease: LeaseConfig,
    /// Enforce the fence deadline in shims (cluster mode). Off on SQLite.
    pub fence: bool,
    /// How instances are isolated (design §6).
    pub isolation: Isolation,
    /// The host uids of instance accounts (levels `user` and `sandbox`).
    pub uids: UidRange,
    /// Per-instance limits: rlimits at `user`, cgroups at `sandbox`.
    pub limits: Limits,
    /// The `nft` program of the guards; `None`: looked up in `PATH`,
    /// `/usr/sbin` and `/sbin`.
    pub nft: Option<PathBuf>,
    /// The executable and leading arguments that run the shim zygote (which
    /// forks every shim); normally `current_exe()` and `["shim"]`.
    pub shim_command: Vec<String>,
    /// Wait after ready in `restart_and_probe` (2.5 s).
    pub probe_settle: Duration,
    /// Budget of `restart_and_probe` (60 s).
    pub probe_budget: Duration,
    /// Parallel restarts in `restart_all_mains`.
    pub restart_all_concurrency: usize,
}

impl LocalConfig {
    /// The base path the proxy serves `user` under: `/u/<user>/`, with the
    /// id percent-encoded exactly as in every URL berth hands out (and as
    /// the proxy forwards it with `strip_prefix = false`).
    pub fn base_path(user: &berth_core::UserId) -> String {
        user.base_path()
    }
}
