//! berth's configuration: a TOML file (design §8.6), then environment, then
//! flags. Unknown keys are errors that name the key, the file and the line.
//!
//! (Loading pending: the types below are the agreed shape.)

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

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
}
