//! The file format: [`Config`] and its sections, one struct per TOML
//! table, with their defaults (README, "Configure it").

use std::collections::BTreeMap;
use std::path::PathBuf;

use berth_store::TakeoverPolicy;
use serde::{Deserialize, Serialize};

use super::provenance::Provenance;

/// The whole configuration. Field names are the TOML keys.
/// The `[kubernetes]` table, as the Kubernetes runtime reads it.
#[cfg(feature = "kubernetes")]
pub type KubernetesTable = berth_k8s::KubernetesConfig;
/// The `[kubernetes]` table of a berth built without the `kubernetes`
/// feature: any table, which validation refuses by name.
#[cfg(not(feature = "kubernetes"))]
pub type KubernetesTable = toml::Table;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub listen: String,
    pub data_dir: PathBuf,
    /// `sqlite://…` or `postgres://…`; default `sqlite://<data_dir>/berth.db`.
    pub store: Option<String>,
    /// A file (mode 0600) whose content is the store URL: the way to give
    /// berth a URL with a password outside its config file.
    pub store_file: Option<PathBuf>,
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
    /// `[isolation]`: the local runtime's own table.
    pub isolation: berth_local::IsolationTable,
    pub proxy: ProxyConfig,
    pub auth: AuthSection,
    pub cluster: ClusterSection,
    pub metrics: MetricsSection,
    /// `[kubernetes]`: its presence runs every instance as a pod
    /// (`berth-k8s`) instead of a local process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<KubernetesTable>,
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
    /// `Name: value` with `{launch_token}` in the value: the header the
    /// proxy adds to every request it forwards to the instance, so that
    /// the program's own login never shows (needs `ready_token_regex`).
    pub credential_header: Option<String>,
    pub ready_http_path: Option<String>,
    /// Neither regex nor HTTP path: wait for a TCP connect.
    pub ready_tcp: bool,
    pub ready_timeout_s: u64,
    pub port_range: [u16; 2],
    pub stop_grace_s: u64,
    pub patch_ext: String,
    pub no_restart_exit_codes: Vec<i32>,
    pub on_breaker_open: Option<Vec<String>>,
    /// Run before the instance is hibernated: a command (a list) or a path
    /// on the instance (a string starting with `/`, asked with `POST`).
    pub pre_hibernate: Option<HookConfig>,
    /// Run before a running instance is stopped gracefully; the same forms.
    pub pre_stop: Option<HookConfig>,
    /// How long a hook may take before it is cut off.
    pub hook_grace_s: u64,
    /// Whether a page of another origin (another user's app among them)
    /// may make a browser send this program state-changing requests and
    /// WebSocket upgrades. Off, the proxy answers them 403: for programs
    /// whose apps do not call each other.
    pub allow_cross_origin_requests: bool,
    /// The most bytes of an instance's log kept on disk: the log is
    /// rotated at half of this, and one rotated file is kept.
    pub log_max_bytes: u64,
}

/// `pre_hibernate` / `pre_stop`: a command, or a path on the instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum HookConfig {
    Command(Vec<String>),
    Http(String),
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
    /// `"hibernate"` (where the runtime can freeze) or `"stop"`.
    pub idle_action: IdleActionConfig,
    /// Idle time before a main is hibernated; 0 = never.
    pub hibernate_after_s: u64,
    /// Time hibernated before a main is stopped; 0 = never.
    pub stop_after_s: u64,
    /// Mains hibernated at once on this node; 0 = no cap.
    pub max_hibernated: usize,
    /// Whether server-to-client traffic (pushes, pings) counts as
    /// activity; by default only client-to-instance traffic does.
    pub server_traffic_is_activity: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IdleActionConfig {
    #[default]
    Hibernate,
    Stop,
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

/// `[auth]`: user tokens and admin sessions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthSection {
    /// How long a user token lives. A token minted with a user token lives
    /// no longer than that one.
    pub user_token_ttl_s: u64,
    /// Whether a user token may launch with `patch`, `folder` or `force`,
    /// and reset its breaker. Off: only the admin may.
    pub users_may_patch: bool,
    /// The most live tokens one user may have; minting one more is refused
    /// (409 `too_many_tokens`) until one is revoked or expires.
    pub max_tokens_per_user: u32,
    /// How long a node trusts a user token it looked up without asking
    /// the store again. A revocation clears every reachable node at once;
    /// this bounds how long a node it could not reach may accept the token.
    /// 0: every use asks the store.
    pub token_cache_s: u64,
    /// How long a session lasts: the admin page's, and a signed-in
    /// user's (their app cookies end with it).
    pub session_ttl_s: u64,
    /// Sign-in through an OpenID provider; `None`: no sign-in page.
    pub oidc: Option<OidcSection>,
}

/// `[auth.oidc]`: sign-in through an OpenID Connect provider
/// (authorization code flow with PKCE, `state` and `nonce`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OidcSection {
    /// The provider's issuer URL; its discovery document is fetched from
    /// `<issuer>/.well-known/openid-configuration`.
    pub issuer: String,
    pub client_id: String,
    /// A file (mode 0600) holding the client secret. Else the secret comes
    /// from `BERTH_OIDC_CLIENT_SECRET`; never from the config text.
    pub client_secret_file: Option<PathBuf>,
    /// The secret itself, read from the environment or the file.
    #[serde(skip)]
    pub client_secret: Option<String>,
    pub scopes: Vec<String>,
    /// The ID token claim that names the berth user: `sub`, `email`,
    /// `preferred_username`, or a claim outside the standard set.
    pub user_claim: String,
    /// The claim that lists a user's groups (an array of strings).
    pub groups_claim: String,
    /// Who may sign in: these user ids, and members of these groups.
    pub allowed_users: Vec<String>,
    pub allowed_groups: Vec<String>,
    /// Lets every user the provider authenticates sign in (both lists
    /// empty is refused without it).
    pub allow_any_user: bool,
    /// Members of this group also get the admin page.
    pub admin_group: Option<String>,
    /// Where the provider sends the browser back:
    /// `<berth host URL>/login/callback`, registered at the provider.
    /// Default: this node's public URL plus `/login/callback`.
    pub redirect_url: Option<String>,
    /// How far the provider's clock may be ahead or behind.
    pub clock_skew_s: u64,
}

impl Default for OidcSection {
    fn default() -> Self {
        Self {
            issuer: String::new(),
            client_id: String::new(),
            client_secret_file: None,
            client_secret: None,
            scopes: ["openid", "profile", "email"]
                .into_iter()
                .map(str::to_owned)
                .collect(),
            user_claim: "preferred_username".to_owned(),
            groups_claim: "groups".to_owned(),
            allowed_users: Vec::new(),
            allowed_groups: Vec::new(),
            allow_any_user: false,
            admin_group: None,
            redirect_url: None,
            clock_skew_s: 60,
        }
    }
}

impl Default for AuthSection {
    fn default() -> Self {
        Self {
            user_token_ttl_s: 30 * 24 * 3600,
            users_may_patch: false,
            max_tokens_per_user: 20,
            token_cache_s: 10,
            session_ttl_s: 12 * 3600,
            oidc: None,
        }
    }
}

/// `[cluster]`: this node's part in a cluster (PostgreSQL store).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterSection {
    /// How many mains this node offers to run; placement sends new
    /// instances to the node with the most room. Default: the size of
    /// `instance.port_range` (one port per instance).
    pub capacity: Option<u32>,
    /// Where this node serves the node-to-node API (`/internal/v1/…`),
    /// which the public listener never serves. Port 0: any free port (it
    /// is advertised to the other nodes through the store).
    pub internal_listen: String,
    /// The URL other nodes call that API at. Default:
    /// `http://<internal_listen address>`, as bound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub internal_advertise_url: Option<String>,
}

impl Default for ClusterSection {
    fn default() -> Self {
        Self {
            capacity: None,
            // Loopback: only nodes on this host can call it until the
            // operator names an address of the private network.
            internal_listen: "127.0.0.1:0".into(),
            internal_advertise_url: None,
        }
    }
}

/// `[metrics]`: who may read `/metrics` besides the admin.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSection {
    /// A read-only token for a Prometheus scraper: as Bearer, it opens
    /// `GET /metrics` and nothing else.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// Also serve `/metrics`, without authentication, on this address
    /// (e.g. `127.0.0.1:9464`), for a scraper that holds no token. Only
    /// `/metrics` is served there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProxyConfig {
    pub base_domain: String,
    /// `/u/<user>/` on the berth host: `"auto"` (on unless `base_domain`
    /// is set), `"on"` or `"off"`. On, every app shares the API's origin.
    pub path_routing: String,
    pub strip_prefix: bool,
    /// `"token"` or `"header"`.
    pub auth: String,
    pub trusted_proxies: Vec<String>,
    /// `auth = "header"`: `X-Forwarded-User` counts only next to this
    /// secret in `X-Berth-Proxy-Secret`, proving the request came through
    /// the SSO proxy rather than another process on a trusted address.
    pub header_secret: Option<String>,
    /// A client must send its request head within this time (slowloris).
    pub header_timeout_ms: u64,
    /// Largest request head in bytes; larger gets `431`.
    pub max_header_bytes: usize,
    /// Concurrent long-lived streams on this node: WebSockets (and other
    /// upgrades) and API progress streams; more get `503`.
    pub max_upgrades: usize,

    // --- exhaustion limits -------------------------------------------------
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
            store_file: None,
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
            isolation: berth_local::IsolationTable::default(),
            proxy: ProxyConfig::default(),
            auth: AuthSection::default(),
            cluster: ClusterSection::default(),
            metrics: MetricsSection::default(),
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
            credential_header: None,
            ready_http_path: None,
            ready_tcp: false,
            ready_timeout_s: 60,
            port_range: [20000, 29999],
            stop_grace_s: 5,
            patch_ext: "yaml".to_owned(),
            no_restart_exit_codes: Vec::new(),
            on_breaker_open: None,
            pre_hibernate: None,
            pre_stop: None,
            hook_grace_s: 10,
            allow_cross_origin_requests: false,
            log_max_bytes: berth_local::DEFAULT_LOG_MAX_BYTES,
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
            idle_action: IdleActionConfig::Hibernate,
            hibernate_after_s: 300,
            stop_after_s: 3600,
            max_hibernated: 0,
            server_traffic_is_activity: false,
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

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            base_domain: String::new(),
            path_routing: "auto".to_owned(),
            strip_prefix: false,
            auth: "token".to_owned(),
            trusted_proxies: Vec::new(),
            header_secret: None,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::parse;
    use berth_core::policy::{CrashPolicy, ReapPolicy};
    use berth_local::{Isolation, UidRange};

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
        assert_eq!(c.isolation.mode, None);
        assert_eq!(c.isolation_level(true).unwrap(), Isolation::User);
        assert_eq!(c.isolation_level(false).unwrap(), Isolation::None);
        assert_eq!(
            (c.isolation.memory_max_mb, c.isolation.pids_max),
            (1024, 256)
        );
        assert_eq!(
            c.isolation.uids(),
            UidRange {
                first: 200_000,
                count: 100_000
            }
        );
        assert_eq!(c.proxy.auth, "token");
        assert!(!c.proxy.strip_prefix);
        assert!(c.proxy.base_domain.is_empty());
        assert_eq!(c.proxy.path_routing, "auto");
        assert!(c.path_routing(), "no domain: path routing");
        assert_eq!(c.auth.user_token_ttl_s, 2_592_000);
        assert!(!c.auth.users_may_patch);
    }

    #[test]
    fn empty_file_is_the_defaults() {
        assert_eq!(parse("").unwrap(), Config::default());
        assert_eq!(parse("# nothing\n").unwrap(), Config::default());
    }
}
