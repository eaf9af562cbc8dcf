//! The `[isolation]` table, and the checks of everything the local runtime
//! is given ([`LocalRuntimeConfig::validate`]): each error names the
//! config key at fault, so the binary only has to say where it was set.

use std::path::PathBuf;

use berth_core::egress::{Destination, EgressMode, EgressPolicy};
use serde::{Deserialize, Serialize};

use crate::isolation::{Isolation, Limits, UidRange};
use crate::{DEFAULT_MAX_PORTS, LocalRuntimeConfig, MIN_LOG_MAX_BYTES};

/// A value the local runtime cannot use; the message names its key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {reason}")]
pub struct ConfigError {
    /// The key at fault, with its table (`isolation.base_uid`,
    /// `instance.port_range`).
    pub key: &'static str,
    /// What is wrong with its value, for a person to read.
    pub reason: String,
}

fn bad(key: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        key,
        reason: reason.into(),
    }
}

/// The least `open_files_max`: below it a program cannot even start.
const MIN_OPEN_FILES: u64 = 64;

/// The `[isolation]` table: how instances are kept apart from each other
/// and from berth.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IsolationTable {
    /// `"none"`, `"user"` or `"sandbox"`; unset: `user` when berth runs as
    /// root, `none` otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Memory of one instance (cgroup limit, level `sandbox`).
    pub memory_max_mb: u64,
    /// Processes of one instance: cgroup limit (`sandbox`) and the
    /// account's `RLIMIT_NPROC` (`user` and `sandbox`).
    pub pids_max: u64,
    /// CPU of one instance in percent of one CPU (`sandbox`); 0 = no limit.
    pub cpu_max_percent: u32,
    /// Open files of each process of an instance (`RLIMIT_NOFILE`).
    pub open_files_max: u64,
    /// Ports of `[instance] port_range` one instance may hold, its own
    /// included: when no port is free, instances holding more are killed.
    pub max_ports: usize,
    /// The first host uid of instance accounts; each user gets the next
    /// free one, once, recorded in the store.
    pub base_uid: u32,
    /// How many uids the account range holds.
    pub uid_count: u32,
    /// The `nft` program of the port and egress guards; default: looked up
    /// in `PATH`, `/usr/sbin` and `/sbin`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nft: Option<PathBuf>,
    /// `"allow_all"`: the public internet and what `egress_allow` adds;
    /// `"deny_all"` or `"allowlist"`: only what `egress_allow` allows.
    pub egress: EgressMode,
    /// Destinations instances may reach although the egress guard or the
    /// mode refuses them: networks (`10.8.0.0/24`, an address), and with
    /// a confining mode domain names (`pypi.org`, `*.github.com`), each
    /// with an optional `:port`. Never the metadata addresses or this
    /// host's.
    pub egress_allow: Vec<Destination>,
}

impl Default for IsolationTable {
    fn default() -> Self {
        let limits = Limits::default();
        Self {
            mode: None,
            memory_max_mb: limits.memory_max_mb,
            pids_max: limits.pids_max,
            cpu_max_percent: limits.cpu_max_percent,
            open_files_max: limits.open_files_max,
            max_ports: DEFAULT_MAX_PORTS,
            base_uid: 200_000,
            uid_count: 100_000,
            nft: None,
            egress: EgressMode::AllowAll,
            egress_allow: Vec::new(),
        }
    }
}

impl IsolationTable {
    /// The level: the configured one, else `user` when berth runs as root
    /// (`root`) and `none` otherwise.
    pub fn level(&self, root: bool) -> Result<Isolation, ConfigError> {
        match &self.mode {
            Some(mode) => mode.parse().map_err(|reason| bad("isolation.mode", reason)),
            None if root => Ok(Isolation::User),
            None => Ok(Isolation::None),
        }
    }

    /// The host uids of instance accounts.
    pub fn uids(&self) -> UidRange {
        UidRange {
            first: self.base_uid,
            count: self.uid_count,
        }
    }

    /// The egress policy of every instance.
    pub fn egress_policy(&self) -> EgressPolicy {
        EgressPolicy {
            mode: self.egress,
            allow: self.egress_allow.clone(),
        }
    }

    /// The limits of one instance.
    pub fn limits(&self) -> Limits {
        Limits {
            memory_max_mb: self.memory_max_mb,
            pids_max: self.pids_max,
            cpu_max_percent: self.cpu_max_percent,
            open_files_max: self.open_files_max,
        }
    }
}

impl LocalRuntimeConfig {
    /// Checks every value the runtime is given before anything runs, and
    /// reports the first one it cannot use, by its config key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.program.command.is_empty() {
            return Err(bad("instance.command", "must not be empty"));
        }
        if self
            .program
            .watchdog_command
            .as_ref()
            .is_some_and(Vec::is_empty)
        {
            return Err(bad("watchdog.command", "must not be empty"));
        }
        let (first, last) = (*self.port_range.start(), *self.port_range.end());
        if first == 0 {
            return Err(bad("instance.port_range", "port 0 is not a usable port"));
        }
        if first > last {
            return Err(bad(
                "instance.port_range",
                format!("[{first}, {last}] is reversed: the first port must not exceed the last"),
            ));
        }
        if self.log_max_bytes < MIN_LOG_MAX_BYTES {
            return Err(bad(
                "instance.log_max_bytes",
                format!(
                    "{} is under {MIN_LOG_MAX_BYTES}: the log and its rotated file must each \
                     hold 64 KiB, the longest piece written at once",
                    self.log_max_bytes
                ),
            ));
        }
        if self.uids.first == 0 {
            return Err(bad(
                "isolation.base_uid",
                "must not be 0: instances must never run as root",
            ));
        }
        if self.uids.last().is_none() {
            return Err(bad(
                "isolation.uid_count",
                format!(
                    "{} uids from {} is empty or passes the largest uid (4294967294)",
                    self.uids.count, self.uids.first
                ),
            ));
        }
        if self.limits.memory_max_mb == 0 {
            return Err(bad("isolation.memory_max_mb", "must be at least 1"));
        }
        if self.limits.pids_max == 0 {
            return Err(bad("isolation.pids_max", "must be at least 1"));
        }
        if self.max_ports == 0 {
            return Err(bad(
                "isolation.max_ports",
                "must be at least 1: an instance holds its own port",
            ));
        }
        if let Err(e) = self.egress.check() {
            return Err(bad("isolation.egress_allow", e.to_string()));
        }
        if self.egress.mode.confined() && self.isolation == Isolation::None {
            return Err(bad(
                "isolation.egress",
                "needs isolation mode \"user\": at \"none\" nothing confines a program's \
                 connections",
            ));
        }
        if self.limits.open_files_max < MIN_OPEN_FILES {
            return Err(bad(
                "isolation.open_files_max",
                format!(
                    "must be at least {MIN_OPEN_FILES}: a program cannot run without descriptors"
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_core::program::{ProgramSettings, Readiness};

    fn config(isolation: &IsolationTable) -> LocalRuntimeConfig {
        LocalRuntimeConfig {
            data_dir: PathBuf::from("/var/lib/berth"),
            program: ProgramSettings {
                command: vec!["app".to_owned()],
                env: Default::default(),
                readiness: Readiness::Tcp,
                watchdog_command: None,
                patch_ext: "yaml".to_owned(),
            },
            env_allowlist: Vec::new(),
            port_range: 20000..=29999,
            max_ports: isolation.max_ports,
            log_max_bytes: crate::DEFAULT_LOG_MAX_BYTES,
            isolation: Isolation::User,
            uids: isolation.uids(),
            limits: isolation.limits(),
            listeners: crate::ListenerCap {
                ports: Vec::new(),
                per_account: 1000,
            },
            nft: None,
            egress: isolation.egress_policy(),
            egress_proxy: None,
            name_servers: Vec::new(),
            shim_command: vec!["berth".to_owned(), "shim".to_owned()],
        }
    }

    /// A range written last port first, as a config may hold it.
    fn reversed() -> std::ops::RangeInclusive<u16> {
        let [first, last] = [30000, 20000];
        first..=last
    }

    #[test]
    fn the_defaults_are_valid_and_each_bad_value_names_its_key() {
        let table = IsolationTable::default();
        assert_eq!(config(&table).validate(), Ok(()));
        type Spoil = fn(&mut LocalRuntimeConfig);
        let cases: [(Spoil, &str); 8] = [
            (|c| c.port_range = 0..=10, "instance.port_range"),
            (|c| c.port_range = reversed(), "instance.port_range"),
            (|c| c.log_max_bytes = 1000, "instance.log_max_bytes"),
            (|c| c.uids.first = 0, "isolation.base_uid"),
            (|c| c.uids.first = u32::MAX - 1, "isolation.uid_count"),
            (|c| c.limits.pids_max = 0, "isolation.pids_max"),
            (|c| c.max_ports = 0, "isolation.max_ports"),
            (|c| c.limits.open_files_max = 10, "isolation.open_files_max"),
        ];
        for (spoil, key) in cases {
            let mut c = config(&table);
            spoil(&mut c);
            assert_eq!(c.validate().map_err(|e| e.key), Err(key));
        }
    }

    #[test]
    fn names_need_a_confining_egress_and_confining_needs_accounts() {
        let table = IsolationTable::default();
        let mut c = config(&table);
        c.egress.allow = vec!["pypi.org".parse().unwrap()];
        assert_eq!(
            c.validate().map_err(|e| e.key),
            Err("isolation.egress_allow")
        );
        c.egress.mode = berth_core::egress::EgressMode::Allowlist;
        assert_eq!(c.validate(), Ok(()));
        c.isolation = Isolation::None;
        assert_eq!(c.validate().map_err(|e| e.key), Err("isolation.egress"));
    }

    #[test]
    fn the_level_is_the_configured_one_else_follows_root() {
        let mut table = IsolationTable::default();
        assert_eq!(table.level(true), Ok(Isolation::User));
        assert_eq!(table.level(false), Ok(Isolation::None));
        table.mode = Some("sandbox".to_owned());
        assert_eq!(table.level(false), Ok(Isolation::Sandbox));
        table.mode = Some("jail".to_owned());
        assert_eq!(table.level(true).map_err(|e| e.key), Err("isolation.mode"));
    }
}
