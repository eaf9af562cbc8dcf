//! berth's configuration: a TOML file (design §8.6), then environment, then
//! flags. Unknown keys are errors that name the key, the file and the line.
//!
//! Layering: [`Config::load`] reads the file (or starts from the defaults)
//! and applies the `BERTH_*` environment; [`Config::apply_overrides`] applies
//! command-line flags; [`Config::validate`] checks the result. Every key
//! remembers where its value came from, so a bad value is reported against
//! the file line, the environment variable or the flag that set it.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_core::policy::{CrashPolicy, ReapPolicy};
use berth_local::{Isolation, LocalConfig, Readiness};
use berth_store::TakeoverPolicy;
use berth_store::lease::LeaseConfig;
use serde::{Deserialize, Serialize};

/// Matches the line `berth demo-app` prints once it listens; the capture is
/// the launch token.
pub const DEMO_READY_REGEX: &str = r"berth-demo: http://127\.0\.0\.1:\d+/\?token=([A-Za-z0-9_-]+)";

/// Environment variables read by [`Config::load`], by key.
pub const ENV_VARS: &[(&str, &str)] = &[
    ("listen", "BERTH_LISTEN"),
    ("data_dir", "BERTH_DATA_DIR"),
    ("store", "BERTH_STORE"),
    ("node_id", "BERTH_NODE_ID"),
    ("advertise_url", "BERTH_ADVERTISE_URL"),
    ("cluster_secret", "BERTH_CLUSTER_SECRET"),
    ("admin_token", "BERTH_ADMIN_TOKEN"),
    ("log_format", "BERTH_LOG_FORMAT"),
];

/// The whole configuration. Field names are the TOML keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub listen: String,
    pub data_dir: PathBuf,
    /// `sqlite://…` or `postgres://…`; default `sqlite://<data_dir>/berth.db`.
    pub store: Option<String>,
    /// Default: the host name.
    pub node_id: Option<String>,
    pub advertise_url: Option<String>,
    pub cluster_secret: Option<String>,
    /// Default: read or generate `<data_dir>/admin.token`.
    pub admin_token: Option<String>,
    /// `"text"` or `"json"`.
    pub log_format: String,
    pub instance: InstanceConfig,
    pub watchdog: WatchdogConfig,
    pub crash: CrashConfig,
    pub reap: ReapConfig,
    pub lease: LeaseSection,
    pub isolation: IsolationConfig,
    pub proxy: ProxyConfig,
    pub cluster: ClusterSection,
    /// Accepted so that a Kubernetes config is refused with a clear message
    /// rather than as an unknown key; the backend does not exist yet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<toml::Table>,
    /// Where each value came from, for error messages.
    #[serde(skip)]
    pub(crate) provenance: Provenance,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InstanceConfig {
    /// Default: `[<this binary>, "demo-app", "--port", "{port}"]`.
    pub command: Option<Vec<String>>,
    pub env: BTreeMap<String, String>,
    /// berth's own environment variables passed to instances.
    pub env_allowlist: Vec<String>,
    pub ready_token_regex: Option<String>,
    pub ready_http_path: Option<String>,
    /// Neither regex nor HTTP path: wait for a TCP connect.
    pub ready_tcp: bool,
    pub ready_timeout_s: u64,
    pub port_range: [u16; 2],
    pub stop_grace_s: u64,
    pub patch_ext: String,
    pub no_restart_exit_codes: Vec<i32>,
    pub on_breaker_open: Option<Vec<String>>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WatchdogConfig {
    pub command: Option<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CrashConfig {
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
    pub max_restarts_in_window: u32,
    pub window_s: u64,
    pub stable_s: u64,
    pub cooldown_s: u64,
    pub max_cooldown_s: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReapConfig {
    pub interval_s: u64,
    /// 0 = never.
    pub idle_ttl_s: u64,
    /// 0 = no cap.
    pub max_idle: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LeaseSection {
    pub ttl_ms: u64,
    pub renew_ms: u64,
    pub fence_after_ms: u64,
    /// `"evidence"` or `"manual"`.
    pub takeover: berth_store::TakeoverPolicy,
}

/// `[cluster]`: this node's part in a cluster (PostgreSQL store).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterSection {
    /// How many mains this node offers to run; placement sends new
    /// instances to the node with the most room. Default: the size of
    /// `instance.port_range` (one port per instance).
    pub capacity: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IsolationConfig {
    /// `"none"` only, for now; `"user"` and `"sandbox"` are refused with a
    /// clear error until they exist.
    pub mode: String,
    pub memory_max_mb: u64,
    pub pids_max: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProxyConfig {
    pub base_domain: String,
    pub strip_prefix: bool,
    /// `"token"` or `"header"`.
    pub auth: String,
    pub trusted_proxies: Vec<String>,
    /// A client must send its request head within this time (slowloris).
    pub header_timeout_ms: u64,
    /// Largest request head in bytes; larger gets `431`.
    pub max_header_bytes: usize,
    /// Concurrent long-lived streams on this node: WebSockets (and other
    /// upgrades) and API progress streams; more get `503`.
    pub max_upgrades: usize,

    // --- exhaustion limits (issue 9) -----------------------------------------
    /// Open client connections at most; more are closed at once.
    pub max_connections: usize,
    /// Open connections at most from one client address (an IPv4 address
    /// or an IPv6 /64); `trusted_proxies`, and connections that carry the
    /// cluster secret (other nodes), count only towards the total.
    pub max_connections_per_ip: usize,
    /// Concurrent long-lived streams of one user (WebSockets to their app,
    /// progress streams of their instance); more get `429`.
    pub max_upgrades_per_user: usize,
    /// Request bodies must arrive at this average rate at least…
    pub body_min_bytes_per_s: u64,
    /// …and may stall (or fall behind the rate) by at most this long; then
    /// the request fails (`408`) and its connection closes. 0: no bound.
    pub body_grace_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8000".to_owned(),
            data_dir: PathBuf::from("./berth-data"),
            store: None,
            node_id: None,
            advertise_url: None,
            cluster_secret: None,
            admin_token: None,
            log_format: "text".to_owned(),
            instance: InstanceConfig::default(),
            watchdog: WatchdogConfig::default(),
            crash: CrashConfig::default(),
            reap: ReapConfig::default(),
            lease: LeaseSection::default(),
            isolation: IsolationConfig::default(),
            proxy: ProxyConfig::default(),
            cluster: ClusterSection::default(),
            kubernetes: None,
            provenance: Provenance::default(),
        }
    }
}

impl Default for InstanceConfig {
    fn default() -> Self {
        Self {
            command: None,
            env: BTreeMap::new(),
            env_allowlist: ["PATH", "LANG", "LC_ALL", "TZ"]
                .into_iter()
                .map(str::to_owned)
                .collect(),
            ready_token_regex: None,
            ready_http_path: None,
            ready_tcp: false,
            ready_timeout_s: 60,
            port_range: [20000, 29999],
            stop_grace_s: 5,
            patch_ext: "yaml".to_owned(),
            no_restart_exit_codes: Vec::new(),
            on_breaker_open: None,
        }
    }
}

impl Default for CrashConfig {
    fn default() -> Self {
        Self {
            backoff_base_ms: 1000,
            backoff_max_ms: 30_000,
            max_restarts_in_window: 5,
            window_s: 600,
            stable_s: 60,
            cooldown_s: 600,
            max_cooldown_s: 21_600,
        }
    }
}

impl Default for ReapConfig {
    fn default() -> Self {
        Self {
            interval_s: 60,
            idle_ttl_s: 3600,
            max_idle: 0,
        }
    }
}

impl Default for LeaseSection {
    fn default() -> Self {
        Self {
            ttl_ms: 30_000,
            renew_ms: 10_000,
            fence_after_ms: 20_000,
            takeover: TakeoverPolicy::Evidence,
        }
    }
}

impl Default for IsolationConfig {
    fn default() -> Self {
        Self {
            mode: "none".to_owned(),
            memory_max_mb: 1024,
            pids_max: 256,
        }
    }
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            base_domain: String::new(),
            strip_prefix: false,
            auth: "token".to_owned(),
            trusted_proxies: Vec::new(),
            header_timeout_ms: 10_000,
            max_header_bytes: 64 * 1024,
            max_upgrades: 10_000,
            max_connections: 10_000,
            max_connections_per_ip: 1000,
            max_upgrades_per_user: 100,
            body_min_bytes_per_s: 1024,
            body_grace_ms: 10_000,
        }
    }
}

/// Values given on the command line; `None` leaves the lower layers alone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    pub listen: Option<String>,
    pub data_dir: Option<PathBuf>,
    pub store: Option<String>,
    pub node_id: Option<String>,
    pub advertise_url: Option<String>,
}

/// Where a bad value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    File {
        path: PathBuf,
        line: Option<usize>,
    },
    Env(&'static str),
    Flag(&'static str),
    /// A default, or a combination of values with no single origin.
    Unknown,
}

impl fmt::Display for Location {
    /// Renders as a prefix for the reason (ends with `": "` when non-empty).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::File {
                path,
                line: Some(line),
            } => write!(f, "config file {}, line {line}: ", path.display()),
            Location::File { path, line: None } => write!(f, "config file {}: ", path.display()),
            Location::Env(var) => write!(f, "environment variable {var}: "),
            Location::Flag(flag) => write!(f, "flag {flag}: "),
            Location::Unknown => write!(f, "config: "),
        }
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// TOML syntax, unknown keys and values of the wrong type.
    #[error("{at}{message}")]
    Parse { at: Location, message: String },
    /// A well-formed value that berth cannot use.
    #[error("{at}{key}: {reason}")]
    Invalid {
        at: Location,
        key: String,
        reason: String,
    },
    #[error(
        "cannot use the host name as node id ({0}); set node_id in the config or BERTH_NODE_ID"
    )]
    Hostname(String),
    #[error("cannot locate the berth executable for the default instance command: {0}")]
    CurrentExe(String),
}

/// Where each key's value came from. Not part of the configuration's value:
/// two configs with equal settings are equal whatever their origins.
#[derive(Debug, Clone, Default)]
pub(crate) struct Provenance {
    file: Option<PathBuf>,
    keys: BTreeMap<String, Origin>,
}

impl PartialEq for Provenance {
    fn eq(&self, _other: &Self) -> bool {
        true
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Origin {
    File { line: usize },
    Env(&'static str),
    Flag(&'static str),
}

impl Provenance {
    fn locate(&self, key: &str) -> Location {
        // `instance.env.FOO` is reported at `instance.env` when only the
        // table's line is known.
        let mut probe = key;
        loop {
            match self.keys.get(probe) {
                Some(Origin::File { line }) => {
                    return Location::File {
                        path: self.file.clone().unwrap_or_default(),
                        line: Some(*line),
                    };
                }
                Some(Origin::Env(var)) => return Location::Env(var),
                Some(Origin::Flag(flag)) => return Location::Flag(flag),
                None => match probe.rsplit_once('.') {
                    Some((parent, _)) => probe = parent,
                    None => break,
                },
            }
        }
        match &self.file {
            Some(path) => Location::File {
                path: path.clone(),
                line: None,
            },
            None => Location::Unknown,
        }
    }
}

impl Config {
    /// The file (or the defaults when `file` is `None`), then the `BERTH_*`
    /// environment. Not validated: apply flags, then call
    /// [`Config::validate`].
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        Self::load_with_env(file, |name| std::env::var(name).ok())
    }

    /// [`Config::load`] with an explicit environment, for tests.
    pub fn load_with_env(
        file: Option<&Path>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let mut config = match file {
            Some(path) => Self::from_file(path)?,
            None => Self::default(),
        };
        config.apply_env(env);
        Ok(config)
    }

    /// Only the file: no environment, no validation.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text, path)
    }

    /// Parses `text`; `path` names it in errors.
    pub fn from_toml(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let keys = key_lines(text);
        let mut config: Config = toml::from_str(text).map_err(|e| {
            let line = e.span().map(|span| line_of(text, span.start));
            let key = line.and_then(|line| match keys.is_empty() {
                // A syntax error: no document to take keys from.
                true => key_on_broken_line(text, line),
                false => key_at_line(&keys, line),
            });
            // Syntax errors span lines ("invalid string\nexpected `\"`");
            // one line reads better after the location prefix.
            let reason = e.message().trim().replace('\n', "; ");
            ConfigError::Parse {
                at: Location::File {
                    path: path.to_owned(),
                    line,
                },
                message: match key {
                    Some(key) => format!("{key}: {reason}"),
                    None => reason,
                },
            }
        })?;
        let mut provenance = Provenance {
            file: Some(path.to_owned()),
            keys: BTreeMap::new(),
        };
        for (line, key) in keys {
            provenance.keys.entry(key).or_insert(Origin::File { line });
        }
        config.provenance = provenance;
        Ok(config)
    }

    /// Applies the `BERTH_*` variables of [`ENV_VARS`]; empty ones count as
    /// unset.
    pub fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) {
        for &(key, var) in ENV_VARS {
            let Some(value) = env(var).filter(|v| !v.is_empty()) else {
                continue;
            };
            self.set_top_level(key, value);
            self.provenance
                .keys
                .insert(key.to_owned(), Origin::Env(var));
        }
    }

    /// Applies command-line flags, which beat the file and the environment.
    pub fn apply_overrides(&mut self, flags: &Overrides) {
        let pairs = [
            ("listen", "--listen", flags.listen.clone()),
            (
                "data_dir",
                "--data-dir",
                flags
                    .data_dir
                    .as_ref()
                    .map(|p| p.to_string_lossy().into_owned()),
            ),
            ("store", "--store", flags.store.clone()),
            ("node_id", "--node-id", flags.node_id.clone()),
            ("advertise_url", "--advertise", flags.advertise_url.clone()),
        ];
        for (key, flag, value) in pairs {
            if let Some(value) = value {
                self.set_top_level(key, value);
                self.provenance
                    .keys
                    .insert(key.to_owned(), Origin::Flag(flag));
            }
        }
        if let Some(dir) = &flags.data_dir {
            // Keep non-UTF-8 paths intact rather than the lossy string above.
            self.data_dir = dir.clone();
        }
    }

    fn set_top_level(&mut self, key: &str, value: String) {
        match key {
            "listen" => self.listen = value,
            "data_dir" => self.data_dir = PathBuf::from(value),
            "store" => self.store = Some(value),
            "node_id" => self.node_id = Some(value),
            "advertise_url" => self.advertise_url = Some(value),
            "cluster_secret" => self.cluster_secret = Some(value),
            "admin_token" => self.admin_token = Some(value),
            "log_format" => self.log_format = value,
            _ => {}
        }
    }

    /// The store URL: configured, or `sqlite://<data_dir>/berth.db`.
    pub fn store_url(&self) -> String {
        match &self.store {
            Some(url) => url.clone(),
            None => format!("sqlite://{}", self.data_dir.join("berth.db").display()),
        }
    }

    /// True when the store is PostgreSQL, i.e. berth runs as a cluster.
    pub fn is_postgres(&self) -> bool {
        let url = self.store_url();
        url.starts_with("postgres://") || url.starts_with("postgresql://")
    }

    /// This node's id: configured, or the host name.
    pub fn node_id(&self) -> Result<String, ConfigError> {
        if let Some(id) = &self.node_id {
            return Ok(id.clone());
        }
        let name = nix::unistd::gethostname().map_err(|e| ConfigError::Hostname(e.to_string()))?;
        match name.into_string() {
            Ok(name) if !name.is_empty() => Ok(name),
            Ok(_) => Err(ConfigError::Hostname("it is empty".to_owned())),
            Err(_) => Err(ConfigError::Hostname("it is not UTF-8".to_owned())),
        }
    }

    /// The capacity this node reports: `[cluster] capacity`, else one main
    /// per port of the range.
    pub fn capacity(&self) -> u32 {
        self.cluster.capacity.unwrap_or_else(|| {
            let [low, high] = self.instance.port_range;
            u32::from(high.saturating_sub(low)) + 1
        })
    }

    /// The parsed listen address.
    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.listen.parse().map_err(|_| {
            self.invalid(
                "listen",
                format!(
                    "{:?} is not a socket address (expected e.g. \"127.0.0.1:8000\")",
                    self.listen
                ),
            )
        })
    }

    pub fn crash_policy(&self) -> CrashPolicy {
        let c = &self.crash;
        CrashPolicy {
            backoff_base: Duration::from_millis(c.backoff_base_ms),
            backoff_max: Duration::from_millis(c.backoff_max_ms),
            max_restarts_in_window: c.max_restarts_in_window,
            window: Duration::from_secs(c.window_s),
            stable: Duration::from_secs(c.stable_s),
            cooldown: Duration::from_secs(c.cooldown_s),
            max_cooldown: Duration::from_secs(c.max_cooldown_s),
        }
    }

    pub fn reap_policy(&self) -> ReapPolicy {
        let r = &self.reap;
        ReapPolicy {
            idle_ttl: (r.idle_ttl_s > 0).then(|| Duration::from_secs(r.idle_ttl_s)),
            max_idle: r.max_idle,
            interval: Duration::from_secs(r.interval_s),
        }
    }

    /// The lease timing, checked.
    pub fn lease_config(&self) -> Result<LeaseConfig, ConfigError> {
        self.check_lease_numbers()?;
        let l = &self.lease;
        LeaseConfig::new(
            Duration::from_millis(l.ttl_ms),
            Duration::from_millis(l.renew_ms),
            Duration::from_millis(l.fence_after_ms),
            l.takeover,
        )
        .map_err(|e| self.invalid("lease", e.to_string()))
    }

    /// The instance command: configured, or this binary's `demo-app`.
    pub fn instance_command(&self) -> Result<Vec<String>, ConfigError> {
        if let Some(command) = &self.instance.command {
            return Ok(command.clone());
        }
        let exe = std::env::current_exe().map_err(|e| ConfigError::CurrentExe(e.to_string()))?;
        let exe = exe
            .into_os_string()
            .into_string()
            .map_err(|_| ConfigError::CurrentExe("its path is not UTF-8".to_owned()))?;
        Ok(vec![
            exe,
            "demo-app".into(),
            "--port".into(),
            "{port}".into(),
        ])
    }

    /// How instances are judged ready (design §4.2). A configured regex or
    /// HTTP path wins; the default command gets the demo-app's token line;
    /// any other command is ready when `GET /` answers.
    pub fn readiness(&self) -> Result<Readiness, ConfigError> {
        let i = &self.instance;
        if let Some(pattern) = &i.ready_token_regex {
            return Ok(Readiness::TokenRegex(self.compile_ready_regex(pattern)?));
        }
        if let Some(path) = &i.ready_http_path {
            return Ok(Readiness::Http { path: path.clone() });
        }
        if i.ready_tcp {
            return Ok(Readiness::Tcp);
        }
        if i.command.is_none() {
            return Ok(Readiness::TokenRegex(
                self.compile_ready_regex(DEMO_READY_REGEX)?,
            ));
        }
        Ok(Readiness::Http {
            path: "/".to_owned(),
        })
    }

    fn compile_ready_regex(&self, pattern: &str) -> Result<regex::Regex, ConfigError> {
        regex::Regex::new(pattern).map_err(|e| {
            // The regex error is multi-line (pattern, caret, reason); keep
            // it readable on one line.
            let reason = e.to_string().replace('\n', " ");
            self.invalid(
                "instance.ready_token_regex",
                format!("not a valid regular expression: {reason}"),
            )
        })
    }

    /// The local backend's settings. `shim_command` runs a shim (normally
    /// `[current_exe, "shim"]`).
    pub fn local_config(
        &self,
        node_id: impl Into<String>,
        shim_command: Vec<String>,
    ) -> Result<LocalConfig, ConfigError> {
        let i = &self.instance;
        Ok(LocalConfig {
            node_id: node_id.into(),
            // Empty when unset: serve.rs knows the bound address and may
            // fill in a default.
            advertise_url: self.advertise_url.clone().unwrap_or_default(),
            data_dir: self.data_dir.clone(),
            command: self.instance_command()?,
            env: i.env.clone(),
            env_allowlist: i.env_allowlist.clone(),
            readiness: self.readiness()?,
            ready_timeout: Duration::from_secs(i.ready_timeout_s),
            port_range: i.port_range[0]..=i.port_range[1],
            stop_grace: Duration::from_secs(i.stop_grace_s),
            patch_ext: i.patch_ext.clone(),
            watchdog_command: self.watchdog.command.clone(),
            crash: self.crash_policy(),
            no_restart_exit_codes: i.no_restart_exit_codes.clone(),
            on_breaker_open: i.on_breaker_open.clone(),
            reap: self.reap_policy(),
            lease: self.lease_config()?,
            fence: self.is_postgres(),
            isolation: self.isolation()?,
            shim_command,
            probe_settle: Duration::from_millis(2500),
            probe_budget: Duration::from_secs(60),
            restart_all_concurrency: 4,
        })
    }

    fn isolation(&self) -> Result<Isolation, ConfigError> {
        match self.isolation.mode.as_str() {
            "none" => Ok(Isolation::None),
            mode @ ("user" | "sandbox") => Err(self.invalid(
                "isolation.mode",
                format!("isolation mode {mode:?} is not supported yet"),
            )),
            other => Err(self.invalid(
                "isolation.mode",
                format!(
                    "unknown isolation mode {other:?} (expected \"none\", \"user\" or \"sandbox\")"
                ),
            )),
        }
    }

    fn invalid(&self, key: &str, reason: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            at: self.provenance.locate(key),
            key: key.to_owned(),
            reason: reason.into(),
        }
    }

    /// Checks everything that parsing cannot: addresses, ranges, choices and
    /// combinations. Reports the first problem.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.listen_addr()?;
        if self.data_dir.as_os_str().is_empty() {
            return Err(self.invalid("data_dir", "must not be empty"));
        }
        if let Some(store) = &self.store
            && !(store.starts_with("sqlite:")
                || store.starts_with("postgres://")
                || store.starts_with("postgresql://"))
        {
            // The value is not echoed: it may carry a password.
            return Err(self.invalid("store", "must be a sqlite:// or postgres:// URL"));
        }
        if let Some(id) = &self.node_id
            && (id.is_empty() || id.chars().any(|c| c.is_whitespace() || c.is_control()))
        {
            return Err(self.invalid(
                "node_id",
                format!("{id:?} must be non-empty, without spaces or control characters"),
            ));
        }
        if let Some(url) = &self.advertise_url {
            let ok = reqwest::Url::parse(url)
                .is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some());
            if !ok {
                return Err(self.invalid(
                    "advertise_url",
                    format!("{url:?} is not an http:// or https:// URL"),
                ));
            }
        }
        if self
            .cluster_secret
            .as_ref()
            .is_some_and(|s| s.trim().is_empty())
        {
            return Err(self.invalid("cluster_secret", "must not be empty"));
        }
        if self.is_postgres() && self.cluster_secret.is_none() {
            return Err(self.invalid(
                "cluster_secret",
                "required when the store is PostgreSQL (cluster mode): nodes authenticate each other with it; set cluster_secret or BERTH_CLUSTER_SECRET",
            ));
        }
        if let Some(token) = &self.admin_token
            && (token.is_empty() || token.chars().any(|c| c.is_whitespace() || c.is_control()))
        {
            return Err(self.invalid(
                "admin_token",
                "must be non-empty, without spaces or control characters",
            ));
        }
        if !matches!(self.log_format.as_str(), "text" | "json") {
            return Err(self.invalid(
                "log_format",
                format!(
                    "{:?} is not a log format (expected \"text\" or \"json\")",
                    self.log_format
                ),
            ));
        }
        self.validate_instance()?;
        if let Some(command) = &self.watchdog.command {
            self.check_command("watchdog.command", command)?;
        }
        self.validate_policies()?;
        self.isolation()?;
        self.validate_proxy()?;
        if self.kubernetes.is_some() {
            return Err(self.invalid(
                "kubernetes",
                "the Kubernetes backend is not supported yet; remove the [kubernetes] table",
            ));
        }
        // Last: the store crate's own checks of the lease timing.
        self.lease_config()?;
        Ok(())
    }

    fn validate_instance(&self) -> Result<(), ConfigError> {
        let i = &self.instance;
        if let Some(command) = &i.command {
            self.check_command("instance.command", command)?;
        }
        if let Some(command) = &i.on_breaker_open {
            self.check_command("instance.on_breaker_open", command)?;
        }
        for (name, value) in &i.env {
            if name.is_empty() || name.contains('=') || name.contains('\0') {
                return Err(self.invalid(
                    &format!("instance.env.{name}"),
                    format!("{name:?} is not a valid environment variable name"),
                ));
            }
            if value.contains('\0') {
                return Err(self.invalid(
                    &format!("instance.env.{name}"),
                    "the value contains a NUL byte",
                ));
            }
        }
        if let Some(name) = i
            .env_allowlist
            .iter()
            .find(|n| n.is_empty() || n.contains('=') || n.contains('\0'))
        {
            return Err(self.invalid(
                "instance.env_allowlist",
                format!("{name:?} is not a valid environment variable name"),
            ));
        }
        let readiness_given = [
            i.ready_token_regex.is_some(),
            i.ready_http_path.is_some(),
            i.ready_tcp,
        ];
        if readiness_given.iter().filter(|&&b| b).count() > 1 {
            let key = if i.ready_token_regex.is_some() {
                "instance.ready_token_regex"
            } else {
                "instance.ready_http_path"
            };
            return Err(self.invalid(
                key,
                "set at most one of ready_token_regex, ready_http_path and ready_tcp",
            ));
        }
        if let Some(pattern) = &i.ready_token_regex {
            self.compile_ready_regex(pattern)?;
        }
        if let Some(path) = &i.ready_http_path
            && !path.starts_with('/')
        {
            return Err(self.invalid(
                "instance.ready_http_path",
                format!("{path:?} must start with '/'"),
            ));
        }
        if i.ready_timeout_s == 0 {
            return Err(self.invalid("instance.ready_timeout_s", "must be at least 1"));
        }
        let [first, last] = i.port_range;
        if first == 0 {
            return Err(self.invalid("instance.port_range", "port 0 is not a usable port"));
        }
        if first > last {
            return Err(self.invalid(
                "instance.port_range",
                format!("[{first}, {last}] is reversed: the first port must not exceed the last"),
            ));
        }
        if i.patch_ext.is_empty()
            || i.patch_ext.starts_with('.')
            || !i
                .patch_ext
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
        {
            return Err(self.invalid(
                "instance.patch_ext",
                format!(
                    "{:?} is not a file extension (letters, digits, '.', '-', '_'; no leading dot)",
                    i.patch_ext
                ),
            ));
        }
        Ok(())
    }

    fn check_command(&self, key: &str, command: &[String]) -> Result<(), ConfigError> {
        match command.first() {
            None => Err(self.invalid(key, "must name a program (the list is empty)")),
            Some(program) if program.is_empty() => {
                Err(self.invalid(key, "the program name is empty"))
            }
            Some(_) if command.iter().any(|a| a.contains('\0')) => {
                Err(self.invalid(key, "an argument contains a NUL byte"))
            }
            Some(_) => Ok(()),
        }
    }

    fn validate_policies(&self) -> Result<(), ConfigError> {
        let c = &self.crash;
        if c.backoff_base_ms > c.backoff_max_ms {
            return Err(self.invalid(
                "crash.backoff_base_ms",
                format!(
                    "{} exceeds crash.backoff_max_ms ({})",
                    c.backoff_base_ms, c.backoff_max_ms
                ),
            ));
        }
        if c.window_s == 0 {
            return Err(self.invalid("crash.window_s", "must be at least 1"));
        }
        if c.cooldown_s > c.max_cooldown_s {
            return Err(self.invalid(
                "crash.cooldown_s",
                format!(
                    "{} exceeds crash.max_cooldown_s ({})",
                    c.cooldown_s, c.max_cooldown_s
                ),
            ));
        }
        if self.reap.interval_s == 0 {
            return Err(self.invalid("reap.interval_s", "must be at least 1"));
        }
        self.check_lease_numbers()
    }

    /// The lease invariants, checked here too so that the messages name the
    /// keys (and the file line).
    /// The rules live in `LeaseConfig::new`; this only names the key (and
    /// its line) that each refusal is about.
    fn check_lease_numbers(&self) -> Result<(), ConfigError> {
        use berth_store::lease::LeaseConfigError as E;
        let l = &self.lease;
        LeaseConfig::new(
            Duration::from_millis(l.ttl_ms),
            Duration::from_millis(l.renew_ms),
            Duration::from_millis(l.fence_after_ms),
            l.takeover,
        )
        .map(drop)
        .map_err(|e| {
            let key = match e {
                E::ZeroRenew => "lease.renew_ms",
                E::TtlTooShort { .. } | E::TtlTooLong { .. } => "lease.ttl_ms",
                E::FenceAfterTooLong { .. } => "lease.fence_after_ms",
            };
            self.invalid(key, e.to_string())
        })
    }

    fn validate_proxy(&self) -> Result<(), ConfigError> {
        let p = &self.proxy;
        let domain = &p.base_domain;
        if !domain.is_empty()
            && (domain.starts_with('.')
                || domain.ends_with('.')
                || !domain
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-')))
        {
            return Err(self.invalid(
                "proxy.base_domain",
                format!("{domain:?} is not a DNS name (e.g. \"berth.example.com\")"),
            ));
        }
        match p.auth.as_str() {
            "token" => {}
            "header" if p.trusted_proxies.is_empty() => {
                return Err(self.invalid(
                    "proxy.trusted_proxies",
                    "auth = \"header\" needs the addresses of the trusted proxies, or every request is refused",
                ));
            }
            "header" => {}
            other => {
                return Err(self.invalid(
                    "proxy.auth",
                    format!("{other:?} is not an auth mode (expected \"token\" or \"header\")"),
                ));
            }
        }
        if let Some(bad) = p.trusted_proxies.iter().find(|a| !is_ip_or_cidr(a)) {
            return Err(self.invalid(
                "proxy.trusted_proxies",
                format!("{bad:?} is not an IP address or CIDR block"),
            ));
        }
        for (key, value) in [
            ("proxy.max_connections", p.max_connections),
            ("proxy.max_connections_per_ip", p.max_connections_per_ip),
            ("proxy.max_upgrades", p.max_upgrades),
            ("proxy.max_upgrades_per_user", p.max_upgrades_per_user),
        ] {
            if value == 0 {
                return Err(self.invalid(key, "must be at least 1 (0 would refuse everything)"));
            }
        }
        if p.max_connections_per_ip > p.max_connections {
            return Err(self.invalid(
                "proxy.max_connections_per_ip",
                format!(
                    "{} is more than max_connections ({})",
                    p.max_connections_per_ip, p.max_connections
                ),
            ));
        }
        Ok(())
    }
}

fn is_ip_or_cidr(s: &str) -> bool {
    let (addr, prefix) = match s.split_once('/') {
        Some((addr, prefix)) => (addr, Some(prefix)),
        None => (s, None),
    };
    let Ok(ip) = addr.parse::<IpAddr>() else {
        return false;
    };
    let max = if ip.is_ipv4() { 32 } else { 128 };
    prefix.is_none_or(|p| p.parse::<u8>().is_ok_and(|p| p <= max))
}

/// The 1-based line of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// Every key of a TOML document, dotted from the root (table headers
/// included), with the 1-based line it is written on, in line order. Empty
/// for a document that does not parse: its syntax error carries its own
/// line.
fn key_lines(text: &str) -> Vec<(usize, String)> {
    let Ok(document) = toml_edit::ImDocument::parse(text) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    collect_keys(text, document.as_table(), "", &mut found);
    // Stable: a key and the keys inside it on one line keep that order.
    found.sort_by_key(|(line, _)| *line);
    found
}

fn collect_keys(
    text: &str,
    table: &dyn toml_edit::TableLike,
    prefix: &str,
    found: &mut Vec<(usize, String)>,
) {
    for (name, item) in table.iter() {
        let path = if prefix.is_empty() {
            name.to_owned()
        } else {
            format!("{prefix}.{name}")
        };
        // A `[header]` has the span; a `key = …` its key does. The implicit
        // parent of a header (`a` of `[a.b]`) is written nowhere of its own
        // and is not listed (toml_edit gives it the header's key span).
        let span = match item {
            toml_edit::Item::Table(t) if t.is_implicit() && !t.is_dotted() => None,
            toml_edit::Item::Table(t) => t
                .span()
                .or_else(|| table.key(name).and_then(toml_edit::Key::span)),
            _ => table.key(name).and_then(toml_edit::Key::span),
        };
        if let Some(span) = span {
            found.push((line_of(text, span.start), path.clone()));
        }
        match item {
            toml_edit::Item::Table(t) => collect_keys(text, t, &path, found),
            toml_edit::Item::Value(toml_edit::Value::InlineTable(t)) => {
                collect_keys(text, t, &path, found);
            }
            toml_edit::Item::ArrayOfTables(tables) => {
                for t in tables.iter() {
                    collect_keys(text, t, &path, found);
                }
            }
            _ => {}
        }
    }
}

/// For a document that does not parse (a syntax error, an integer beyond
/// TOML's range): the key written on `line`, found by parsing the document
/// again with that line's value replaced by `0`. `None` when the line is
/// not a `key = value` line or the document has other errors.
fn key_on_broken_line(text: &str, line: usize) -> Option<String> {
    let mut lines: Vec<&str> = text.lines().collect();
    let (key, _) = lines.get(line.checked_sub(1)?)?.split_once('=')?;
    let repaired = format!("{key}= 0");
    lines[line - 1] = &repaired;
    key_lines(&lines.join("\n"))
        .into_iter()
        .rev()
        .find(|(l, _)| *l == line)
        .map(|(_, key)| key)
}

/// The key whose definition covers `line`: the closest key or table header
/// at or above it (continuation lines of a multi-line array belong to it).
fn key_at_line(keys: &[(usize, String)], line: usize) -> Option<String> {
    keys.iter()
        .rev()
        .find(|(l, _)| *l <= line)
        .map(|(_, key)| key.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml(text, Path::new("test.toml"))
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn defaults_match_the_design() {
        let c = Config::default();
        assert_eq!(c.listen, "127.0.0.1:8000");
        assert_eq!(c.data_dir, PathBuf::from("./berth-data"));
        assert_eq!(c.store_url(), "sqlite://./berth-data/berth.db");
        assert!(!c.is_postgres());
        assert_eq!(c.log_format, "text");
        assert_eq!(c.instance.port_range, [20000, 29999]);
        assert_eq!(c.instance.ready_timeout_s, 60);
        assert_eq!(c.instance.stop_grace_s, 5);
        assert_eq!(c.instance.patch_ext, "yaml");
        assert_eq!(
            c.instance.env_allowlist,
            vec!["PATH", "LANG", "LC_ALL", "TZ"]
        );
        assert_eq!(c.crash_policy(), CrashPolicy::default());
        assert_eq!(c.reap_policy(), ReapPolicy::default());
        assert_eq!(
            (c.lease.ttl_ms, c.lease.renew_ms, c.lease.fence_after_ms),
            (30_000, 10_000, 20_000)
        );
        assert_eq!(c.lease.takeover, TakeoverPolicy::Evidence);
        assert_eq!(c.isolation.mode, "none");
        assert_eq!(
            (c.isolation.memory_max_mb, c.isolation.pids_max),
            (1024, 256)
        );
        assert_eq!(c.proxy.auth, "token");
        assert!(!c.proxy.strip_prefix);
        assert!(c.proxy.base_domain.is_empty());
    }

    #[test]
    fn empty_file_is_the_defaults() {
        assert_eq!(parse("").unwrap(), Config::default());
        assert_eq!(parse("# nothing\n").unwrap(), Config::default());
    }

    #[test]
    fn default_command_is_demo_app_with_its_token_regex() {
        let c = Config::default();
        let command = c.instance_command().unwrap();
        assert_eq!(&command[1..], ["demo-app", "--port", "{port}"]);
        match c.readiness().unwrap() {
            Readiness::TokenRegex(re) => {
                let line = "berth-demo: http://127.0.0.1:20001/?token=abc_D-9";
                let caps = re.captures(line).unwrap();
                assert_eq!(&caps[1], "abc_D-9");
            }
            other => panic!("unexpected readiness {other:?}"),
        }
    }

    #[test]
    fn custom_command_defaults_to_http_readiness() {
        let c = parse("[instance]\ncommand = [\"x\", \"{port}\"]\n").unwrap();
        match c.readiness().unwrap() {
            Readiness::Http { path } => assert_eq!(path, "/"),
            other => panic!("unexpected readiness {other:?}"),
        }
        let c = parse("[instance]\ncommand = [\"x\"]\nready_tcp = true\n").unwrap();
        assert!(matches!(c.readiness().unwrap(), Readiness::Tcp));
    }

    #[test]
    fn precedence_is_flags_then_env_then_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("berth.toml");
        std::fs::write(
            &file,
            "listen = \"127.0.0.1:1000\"\nnode_id = \"from-file\"\nstore = \"sqlite://file.db\"\ndata_dir = \"/file\"\n",
        )
        .unwrap();
        let env = |name: &str| match name {
            "BERTH_LISTEN" => Some("127.0.0.1:2000".to_owned()),
            "BERTH_NODE_ID" => Some("from-env".to_owned()),
            "BERTH_STORE" => Some(String::new()),
            _ => None,
        };
        let mut c = Config::load_with_env(Some(&file), env).unwrap();
        assert_eq!(c.listen, "127.0.0.1:2000");
        assert_eq!(c.node_id.as_deref(), Some("from-env"));
        // An empty variable does not erase the file's value.
        assert_eq!(c.store_url(), "sqlite://file.db");
        assert_eq!(c.data_dir, PathBuf::from("/file"));

        c.apply_overrides(&Overrides {
            listen: Some("127.0.0.1:3000".into()),
            data_dir: Some("/flag".into()),
            ..Overrides::default()
        });
        assert_eq!(c.listen, "127.0.0.1:3000");
        assert_eq!(c.data_dir, PathBuf::from("/flag"));
        assert_eq!(c.node_id.as_deref(), Some("from-env"));
        assert_eq!(c.node_id().unwrap(), "from-env");
    }

    #[test]
    fn default_store_follows_data_dir() {
        let mut c = Config::load_with_env(None, no_env).unwrap();
        c.apply_overrides(&Overrides {
            data_dir: Some("/var/lib/berth".into()),
            ..Overrides::default()
        });
        assert_eq!(c.store_url(), "sqlite:///var/lib/berth/berth.db");
    }

    #[test]
    fn unknown_key_names_file_line_and_key() {
        let err = parse("listen = \"127.0.0.1:8000\"\n\n[instance]\nbogus = 1\n").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("test.toml"), "{msg}");
        assert!(msg.contains("line 4"), "{msg}");
        assert!(msg.contains("bogus"), "{msg}");
    }

    #[test]
    fn bad_enum_value_names_the_key() {
        let err = parse("[lease]\nttl_ms = 30000\ntakeover = \"sometimes\"\n").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("line 3"), "{msg}");
        assert!(msg.contains("lease.takeover"), "{msg}");
    }

    #[test]
    fn validate_names_key_and_line() {
        let c = parse("# x\n[instance]\nport_range = [30000, 20000]\n").unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("instance.port_range"), "{msg}");
        assert!(msg.contains("line 3"), "{msg}");

        let c = parse("listen = \"nowhere\"\n").unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("listen") && msg.contains("line 1"), "{msg}");
    }

    #[test]
    fn validate_names_the_flag_that_set_a_value() {
        let mut c = parse("listen = \"127.0.0.1:1\"\n").unwrap();
        c.apply_overrides(&Overrides {
            listen: Some("bad".into()),
            ..Overrides::default()
        });
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("--listen"), "{msg}");
        assert!(!msg.contains("line 1"), "{msg}");
    }

    #[test]
    fn readiness_settings_are_exclusive() {
        let c =
            parse("[instance]\nready_token_regex = 'x(.*)'\nready_http_path = \"/\"\n").unwrap();
        assert!(c.validate().is_err());
        let c = parse("[instance]\nready_token_regex = 'x(('\n").unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("ready_token_regex"), "{msg}");
    }

    #[test]
    fn isolation_user_is_refused_clearly() {
        let c = parse("[isolation]\nmode = \"user\"\n").unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(
            msg.contains("isolation mode \"user\" is not supported yet"),
            "{msg}"
        );
    }

    #[test]
    fn lease_numbers_are_checked() {
        let c = parse("[lease]\nttl_ms = 15000\nrenew_ms = 10000\n").unwrap();
        let msg = c.check_lease_numbers().unwrap_err().to_string();
        assert!(
            msg.contains("lease.ttl_ms") && msg.contains("line 2"),
            "{msg}"
        );
        let c = parse("[lease]\nfence_after_ms = 30000\n").unwrap();
        assert!(c.check_lease_numbers().is_err());
        let c = parse("[lease]\nrenew_ms = 0\n").unwrap();
        assert!(c.check_lease_numbers().is_err());
        assert!(Config::default().check_lease_numbers().is_ok());
    }

    #[test]
    fn key_lines_follow_toml_not_line_shapes() {
        let text = "reap.idle_ttl_s = 5\n\
                    [instance]\n\
                    env = { A = \"1\", \"B.C\" = \"2\" }\n\
                    \"port_range\" = [1,\n  2]\n\
                    [lease] # the lease\n\
                    ttl_ms = 1\n";
        let found = key_lines(text);
        let lines: Vec<(usize, &str)> = found
            .iter()
            .map(|(line, key)| (*line, key.as_str()))
            .collect();
        assert_eq!(
            lines,
            [
                (1, "reap"),
                (1, "reap.idle_ttl_s"),
                (2, "instance"),
                (3, "instance.env"),
                (3, "instance.env.A"),
                (3, "instance.env.B.C"),
                (4, "instance.port_range"),
                (6, "lease"),
                (7, "lease.ttl_ms"),
            ]
        );
        // A continuation line belongs to the key above it.
        assert_eq!(
            key_at_line(&key_lines(text), 5).as_deref(),
            Some("instance.port_range")
        );
        assert!(key_lines("[broken\n").is_empty());
        let found = key_lines("[a.b]\nx = 1\n");
        assert_eq!(
            found,
            [(1, "a.b".to_owned()), (2, "a.b.x".to_owned())],
            "an implicit parent table is listed"
        );
    }

    #[test]
    fn a_broken_line_still_names_its_key() {
        let text = "[lease]\nttl_ms = 1\nrenew_ms = \"unterminated\n";
        assert_eq!(
            key_on_broken_line(text, 3).as_deref(),
            Some("lease.renew_ms")
        );
        assert_eq!(key_on_broken_line(text, 1), None, "not a key line");
        assert_eq!(key_on_broken_line(text, 9), None, "past the end");
        assert_eq!(key_on_broken_line(text, 0), None);
    }

    #[test]
    fn a_huge_lease_ttl_is_refused_naming_the_key() {
        // Beyond TOML's i64: refused while parsing, naming key and line.
        let msg = parse("[lease]\nttl_ms = 18446744073709551615\n")
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("lease.ttl_ms") && msg.contains("line 2"),
            "{msg}"
        );
        // The largest TOML integer parses, and LeaseConfig's bound refuses it
        // (instead of an Instant overflow panicking the renew task later).
        let c = parse("[lease]\nttl_ms = 9223372036854775807\n").unwrap();
        let msg = c.check_lease_numbers().unwrap_err().to_string();
        assert!(
            msg.contains("lease.ttl_ms") && msg.contains("line 2") && msg.contains("at most"),
            "{msg}"
        );
        assert!(c.lease_config().is_err());
    }

    #[test]
    fn postgres_needs_a_cluster_secret() {
        let c = Config {
            store: Some("postgres://db/berth".into()),
            ..Config::default()
        };
        assert!(c.is_postgres());
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("cluster_secret"), "{msg}");
    }

    #[test]
    fn header_auth_needs_trusted_proxies() {
        let c = parse("[proxy]\nauth = \"header\"\n").unwrap();
        assert!(c.validate_proxy().is_err());
        let c = parse("[proxy]\nauth = \"header\"\ntrusted_proxies = [\"10.0.0.0/8\", \"::1\"]\n")
            .unwrap();
        assert!(c.validate_proxy().is_ok());
        let c = parse("[proxy]\ntrusted_proxies = [\"10.0.0.0/33\"]\n").unwrap();
        assert!(c.validate_proxy().is_err());
    }

    #[test]
    fn exhaustion_limits_are_read_and_checked_naming_key_and_line() {
        let c = parse(
            "[proxy]
max_connections = 100
max_connections_per_ip = 10
             max_upgrades_per_user = 5
body_min_bytes_per_s = 100
body_grace_ms = 3000
",
        )
        .unwrap();
        assert!(c.validate_proxy().is_ok());
        let p = &c.proxy;
        assert_eq!(
            (
                p.max_connections,
                p.max_connections_per_ip,
                p.max_upgrades_per_user,
                p.body_min_bytes_per_s,
                p.body_grace_ms
            ),
            (100, 10, 5, 100, 3000)
        );
        let d = Config::default().proxy;
        assert_eq!(
            (
                d.max_connections,
                d.max_connections_per_ip,
                d.max_upgrades_per_user
            ),
            (10_000, 1000, 100)
        );
        assert_eq!((d.body_min_bytes_per_s, d.body_grace_ms), (1024, 10_000));
        for (text, key) in [
            (
                "[proxy]
max_connections_per_ip = 0
",
                "proxy.max_connections_per_ip",
            ),
            (
                "[proxy]
max_upgrades_per_user = 0
",
                "proxy.max_upgrades_per_user",
            ),
            (
                "[proxy]
max_connections = 0
",
                "proxy.max_connections",
            ),
        ] {
            let msg = parse(text)
                .unwrap()
                .validate_proxy()
                .unwrap_err()
                .to_string();
            assert!(
                msg.contains(key) && msg.contains("line 2") && msg.contains("at least 1"),
                "{msg}"
            );
        }
        let msg = parse(
            "[proxy]
max_connections = 10
max_connections_per_ip = 20
",
        )
        .unwrap()
        .validate_proxy()
        .unwrap_err()
        .to_string();
        assert!(
            msg.contains("proxy.max_connections_per_ip")
                && msg.contains("more than max_connections"),
            "{msg}"
        );
        let msg = parse(
            "[proxy]
max_upgrades_per_user = -1
",
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("proxy.max_upgrades_per_user"), "{msg}");
    }

    #[test]
    fn multi_line_arrays_belong_to_their_key() {
        let text = "[instance]\ncommand = [\n  \"a\",\n  \"b\",\n]\nready_tcp = true\n";
        let keys = key_lines(text);
        assert_eq!(key_at_line(&keys, 4).as_deref(), Some("instance.command"));
        assert_eq!(key_at_line(&keys, 6).as_deref(), Some("instance.ready_tcp"));
    }
}
