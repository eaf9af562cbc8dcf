//! What the configuration means for each part of berth: the store URL,
//! the node's identity and capacity, the proxy's routing, and the
//! conversions into each crate's settings (crash and reap policies, the
//! lease, readiness, [`LocalConfig`], the pace of request bodies).

use berth_core::program::ProgramSettings;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use berth_controller::{BreakerHook, ControllerConfig};
use berth_core::Readiness;
use berth_core::policy::{CrashPolicy, IdleAction, ReapPolicy};
use berth_core::runtime::HookAction;
use berth_local::{Isolation, LocalRuntimeConfig};
use berth_store::lease::LeaseConfig;

use super::error::ConfigError;
use super::sections::{Config, HookConfig, IdleActionConfig};

/// Matches the line `berth demo-app` prints once it listens; the capture is
/// the launch token.
pub const DEMO_READY_REGEX: &str = r"berth-demo: http://127\.0\.0\.1:\d+/\?token=([A-Za-z0-9_-]+)";

/// Processes and threads an instance takes at least: its shim (the
/// process and the three threads it keeps) and its program.
pub const PIDS_PER_INSTANCE: u64 = 5;
/// berth's descriptors per instance at least: the shim's socket, a pooled
/// connection to the program, and a client's connection.
pub const FILES_PER_INSTANCE: u64 = 3;

impl Config {
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

    /// Whether `/u/<user>/` is routed on the berth host: `[proxy]
    /// path_routing`, where `"auto"` means on unless a base domain is set.
    pub fn path_routing(&self) -> bool {
        match self.proxy.path_routing.as_str() {
            "on" => true,
            "off" => false,
            _ => self.proxy.base_domain.is_empty(),
        }
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

    /// `[cluster] internal_listen`: where the node-to-node API is served.
    pub fn internal_listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        let listen = &self.cluster.internal_listen;
        listen.parse().map_err(|_| {
            self.invalid(
                "cluster.internal_listen",
                format!("{listen:?} is not a socket address (expected e.g. \"10.0.0.5:8001\")"),
            )
        })
    }

    /// Why other hosts' nodes may be unable to call this one, if they may:
    /// the node-to-node listener is on loopback while the node advertises
    /// a URL other hosts use. Nodes on one host are fine; berth warns
    /// rather than refuse.
    pub fn internal_listener_warning(&self) -> Option<String> {
        let addr = self.internal_listen_addr().ok()?;
        if !addr.ip().is_loopback() || self.cluster.internal_advertise_url.is_some() {
            return None;
        }
        let url = reqwest::Url::parse(self.advertise_url.as_deref()?).ok()?;
        let host = url
            .host_str()?
            .trim_start_matches('[')
            .trim_end_matches(']');
        let public_host_is_local = host.eq_ignore_ascii_case("localhost")
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback());
        (!public_host_is_local).then(|| {
            format!(
                "the node-to-node API listens on loopback ({addr}, [cluster] internal_listen) while \
                 this node advertises {url}: nodes on other hosts cannot call it; set \
                 [cluster] internal_listen to this host's address on the nodes' private network"
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
            idle_action: match r.idle_action {
                IdleActionConfig::Hibernate => IdleAction::Hibernate,
                IdleActionConfig::Stop => IdleAction::Stop,
            },
            hibernate_after: (r.hibernate_after_s > 0)
                .then(|| Duration::from_secs(r.hibernate_after_s)),
            stop_after: (r.stop_after_s > 0).then(|| Duration::from_secs(r.stop_after_s)),
            max_hibernated: r.max_hibernated,
        }
    }

    /// The lease timing, checked. The rules live in `LeaseConfig::new`;
    /// this only names the key (and its line) that each refusal is about.
    pub fn lease_config(&self) -> Result<LeaseConfig, ConfigError> {
        use berth_store::lease::LeaseConfigError as E;
        let l = &self.lease;
        LeaseConfig::new(
            Duration::from_millis(l.ttl_ms),
            Duration::from_millis(l.renew_ms),
            Duration::from_millis(l.fence_after_ms),
            l.takeover,
        )
        .map_err(|e| {
            let key = match e {
                E::ZeroRenew => "lease.renew_ms",
                E::TtlTooShort { .. } | E::TtlTooLong { .. } => "lease.ttl_ms",
                E::FenceAfterTooLong { .. } => "lease.fence_after_ms",
            };
            self.invalid(key, e.to_string())
        })
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

    /// How instances are judged ready. A configured regex or HTTP path
    /// wins; the default command gets the demo-app's token line; any other
    /// command is ready when `GET /` answers.
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

    pub(super) fn compile_ready_regex(&self, pattern: &str) -> Result<regex::Regex, ConfigError> {
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

    /// The program as every runtime is given it, with the `command` and
    /// `readiness` the runtime runs it by.
    fn program(&self, command: Vec<String>, readiness: Readiness) -> ProgramSettings {
        ProgramSettings {
            command,
            env: self.instance.env.clone(),
            readiness,
            watchdog_command: self.watchdog.command.clone(),
            patch_ext: self.instance.patch_ext.clone(),
        }
    }

    /// The local runtime's settings: how, where and on which ports the
    /// program runs. `shim_command` runs the shim zygote (normally this
    /// executable and `shim`).
    pub fn runtime_config(
        &self,
        shim_command: Vec<String>,
    ) -> Result<LocalRuntimeConfig, ConfigError> {
        let i = &self.instance;
        let config = LocalRuntimeConfig {
            data_dir: self.data_dir.clone(),
            program: self.program(self.instance_command()?, self.readiness()?),
            env_allowlist: i.env_allowlist.clone(),
            port_range: i.port_range[0]..=i.port_range[1],
            log_max_bytes: i.log_max_bytes,
            max_ports: self.isolation.max_ports,
            isolation: self.isolation_level(nix::unistd::geteuid().is_root())?,
            uids: self.isolation.uids(),
            limits: self.isolation.limits(),
            nft: self.isolation.nft.clone(),
            // With [kubernetes], the policy is the pods' (their
            // NetworkPolicy), whatever this host's level.
            egress: match self.kubernetes {
                Some(_) => berth_core::egress::EgressPolicy::default(),
                None => self.isolation.egress_policy(),
            },
            egress_proxy: None,
            name_servers: Vec::new(),
            // The ports are known once berth has bound them.
            listeners: berth_local::ListenerCap {
                ports: Vec::new(),
                per_account: u32::try_from(self.proxy.max_connections_per_ip).unwrap_or(u32::MAX),
            },
            shim_command,
        };
        config
            .validate()
            .map_err(|e| self.invalid(e.key, e.reason))?;
        Ok(config)
    }

    #[cfg(feature = "kubernetes")]
    /// The Kubernetes runtime's settings (`[kubernetes]`, with the
    /// `[instance]` and `[watchdog]` keys that apply to pods), for node
    /// `node_id`; `None` without a `[kubernetes]` table. Every refusal
    /// names its key (`kubernetes.…`) and the line that set it.
    pub fn k8s_runtime_config(
        &self,
        node_id: &str,
    ) -> Result<Option<berth_k8s::K8sRuntimeConfig>, ConfigError> {
        let Some(kubernetes) = &self.kubernetes else {
            return Ok(None);
        };
        let i = &self.instance;
        // The default instance command runs this host's berth binary,
        // which no image holds at that path: a pod's command is explicit.
        let command = match (&kubernetes.command, &i.command) {
            (Some(_), _) => Vec::new(),
            (None, Some(command)) => command.clone(),
            (None, None) => {
                return Err(self.invalid(
                    "kubernetes.command",
                    "a pod needs a command: set kubernetes.command (or [instance] command)",
                ));
            }
        };
        if let Some(command) = &kubernetes.command {
            self.check_command("kubernetes.command", command)?;
        }
        let readiness = match self.readiness()? {
            // Without a regex, HTTP path or TCP, the local default is the
            // demo app's token line, which only the default command prints.
            Readiness::TokenRegex(_) if i.ready_token_regex.is_none() => Readiness::Http {
                path: "/".to_owned(),
            },
            readiness => readiness,
        };
        let config = berth_k8s::K8sRuntimeConfig {
            kubernetes: kubernetes.clone(),
            node: node_id.to_owned(),
            program: self.program(command, readiness),
            stop_grace: Duration::from_secs(i.stop_grace_s),
            egress: self.isolation.egress_policy(),
            egress_proxy_key: self
                .cluster_secret
                .as_ref()
                .filter(|_| kubernetes.network.egress_proxy.is_some())
                .map(|secret| berth_core::egress::ProxyKey::new(secret.as_bytes())),
            shim_key: self
                .cluster_secret
                .as_ref()
                .filter(|_| kubernetes.shim.is_some())
                .map(|secret| berth_core::credential::ShimKey::new(secret.as_bytes())),
        };
        config.validate().map_err(|e| {
            let key = format!("kubernetes.{}", e.key);
            // `tolerations[0].effect` is located by `tolerations`' line.
            let at = self
                .provenance
                .locate(key.split('[').next().unwrap_or(&key));
            ConfigError::Invalid {
                at,
                key,
                reason: e.reason,
            }
        })?;
        Ok(Some(config))
    }

    /// The controller's settings for node `node_id`.
    pub fn controller_config(
        &self,
        node_id: impl Into<String>,
    ) -> Result<ControllerConfig, ConfigError> {
        let i = &self.instance;
        Ok(ControllerConfig {
            node_id: node_id.into(),
            // Empty when unset: serve.rs knows the bound address and may
            // fill in a default.
            advertise_url: self.advertise_url.clone().unwrap_or_default(),
            // Filled in by serve.rs once the node-to-node listener is bound.
            internal_url: String::new(),
            ready_timeout: Duration::from_secs(i.ready_timeout_s),
            stop_grace: Duration::from_secs(i.stop_grace_s),
            crash: self.crash_policy(),
            no_restart_exit_codes: i.no_restart_exit_codes.clone(),
            on_breaker_open: i.on_breaker_open.clone().map(|command| BreakerHook {
                command,
                env: self.hook_env(),
            }),
            reap: self.reap_policy(),
            lease: self.lease_config()?,
            fencing: self.is_postgres(),
            watchdog: self.watchdog.command.is_some(),
            capacity: self.cluster.capacity,
            probe_settle: Duration::from_millis(2500),
            probe_budget: Duration::from_secs(60),
            restart_all_concurrency: 4,
            pre_hibernate: i.pre_hibernate.clone().map(hook),
            pre_stop: i.pre_stop.clone().map(hook),
            hook_grace: Duration::from_secs(i.hook_grace_s),
        })
    }

    /// The environment of the `on_breaker_open` hook: the allowlisted part
    /// of berth's own, then `[instance] env` (the controller adds the
    /// breaker's variables). Nothing else of berth's reaches it.
    fn hook_env(&self) -> Vec<(String, String)> {
        let allow = &self.instance.env_allowlist;
        let mut env: BTreeMap<String, String> = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .filter(|(k, _)| allow.contains(k))
            .collect();
        env.extend(self.instance.env.clone());
        env.into_iter().collect()
    }

    /// A warning when `[instance] port_range` overlaps `ephemeral`, the
    /// kernel's range for the local ports of outgoing connections: any
    /// connection on the host may take an instance's port between berth's
    /// check and the program's bind. berth then starts the program again
    /// on another port, but a range outside the ephemeral one avoids the
    /// race (and the restart) altogether.
    pub fn port_range_warning(&self, ephemeral: Option<(u16, u16)>) -> Option<String> {
        let (low, high) = ephemeral?;
        let [start, end] = self.instance.port_range;
        let (from, to) = (start.max(low), end.min(high));
        (from <= to).then(|| {
            format!(
                "instance.port_range {start}-{end} overlaps the kernel's ephemeral port range \
                 {low}-{high} (net.ipv4.ip_local_port_range) in {from}-{to}: outgoing connections \
                 may take an instance's port just before it binds (berth then restarts it on \
                 another port); choose a range outside it, or narrow the kernel's"
            )
        })
    }

    /// A warning when the instances this node may run could together hold
    /// more open files than the host's `fs.file-max` (`file_max`), at the
    /// levels that give each program `open_files_max` (run as root when
    /// `root`). Warned, not refused: the product is a bound few hosts
    /// could ever reach by use, and refusing would refuse the defaults on
    /// most hosts; the operator decides.
    pub fn open_files_warning(&self, root: bool, file_max: Option<u64>) -> Option<String> {
        let level = self.isolation_level(root).ok()?;
        if level == berth_local::Isolation::None || self.kubernetes.is_some() {
            return None;
        }
        berth_local::open_files_warning(
            self.isolation.open_files_max,
            u64::from(self.local_capacity()),
            file_max?,
        )
    }

    /// How many instances this node may run: `[cluster] capacity`, else
    /// one per port of the instance port range.
    fn local_capacity(&self) -> u32 {
        let [start, end] = self.instance.port_range;
        self.cluster
            .capacity
            .unwrap_or_else(|| u32::from(end).saturating_sub(u32::from(start)) + 1)
    }

    /// A warning when this host cannot hold as many instances as berth
    /// may run here: the kernel's `pid_max` (each instance takes
    /// [`PIDS_PER_INSTANCE`] at least) or berth's own open-files limit
    /// (`own_open_files`, after raising it; each instance holds
    /// [`FILES_PER_INSTANCE`] of berth's descriptors). Programs run on
    /// this host only without `[kubernetes]`.
    pub fn host_limits_warning(
        &self,
        pid_max: Option<u64>,
        own_open_files: Option<u64>,
    ) -> Option<String> {
        if self.kubernetes.is_some() {
            return None;
        }
        let capacity = u64::from(self.local_capacity());
        let mut short = Vec::new();
        if let Some(pid_max) = pid_max.filter(|&m| m < capacity * PIDS_PER_INSTANCE) {
            short.push(format!(
                "kernel.pid_max is {pid_max}, below {} (sysctl kernel.pid_max)",
                capacity * PIDS_PER_INSTANCE
            ));
        }
        if let Some(files) = own_open_files.filter(|&f| f < capacity * FILES_PER_INSTANCE) {
            short.push(format!(
                "berth may open {files} files, below {} (LimitNOFILE= in its unit, or ulimit -n)",
                capacity * FILES_PER_INSTANCE
            ));
        }
        (!short.is_empty()).then(|| {
            format!(
                "up to {capacity} instances may run here ([cluster] capacity, or the size of \
                 port_range), more than this host holds: {}; launches past that fail. Raise \
                 the limits or lower the capacity",
                short.join("; ")
            )
        })
    }

    /// `[proxy] body_min_bytes_per_s` and `body_grace_ms` (a grace of 0: no
    /// bound), for the API's bodies and for the bodies the proxy forwards
    /// alike.
    pub fn body_pace(&self) -> Option<berth_proxy::BodyPace> {
        let p = &self.proxy;
        (p.body_grace_ms > 0).then(|| berth_proxy::BodyPace {
            min_bytes_per_s: p.body_min_bytes_per_s,
            grace: Duration::from_millis(p.body_grace_ms),
        })
    }

    /// The isolation level: the configured one, else `user` when berth runs
    /// as root (`root`) and `none` otherwise.
    pub fn isolation_level(&self, root: bool) -> Result<Isolation, ConfigError> {
        self.isolation
            .level(root)
            .map_err(|e| self.invalid(e.key, e.reason))
    }
}

/// A hook as the controller runs it.
fn hook(config: HookConfig) -> HookAction {
    match config {
        HookConfig::Command(argv) => HookAction::Command(argv),
        HookConfig::Http(path) => HookAction::Post(path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::parse;

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

    #[cfg(feature = "kubernetes")]
    #[test]
    fn kubernetes_takes_its_command_and_readiness_from_the_config() {
        assert!(
            parse("")
                .unwrap()
                .k8s_runtime_config("n")
                .unwrap()
                .is_none()
        );
        let base = "[kubernetes]\nimage = \"app:1\"\ncommand = [\"app\", \"{port}\"]\n";
        let k8s = parse(base)
            .unwrap()
            .k8s_runtime_config("node-a")
            .unwrap()
            .unwrap();
        assert_eq!(k8s.node, "node-a");
        assert!(
            k8s.program.command.is_empty(),
            "kubernetes.command is the pod's"
        );
        // Not the demo app's token line: the pod runs another program.
        assert!(
            matches!(&k8s.program.readiness, Readiness::Http { path } if path == "/"),
            "{:?}",
            k8s.program.readiness
        );
        let text =
            format!("[instance]\nready_token_regex = 'tok=(\\w+)'\nstop_grace_s = 7\n{base}");
        let k8s = parse(&text)
            .unwrap()
            .k8s_runtime_config("n")
            .unwrap()
            .unwrap();
        assert!(matches!(k8s.program.readiness, Readiness::TokenRegex(_)));
        assert_eq!(k8s.stop_grace, Duration::from_secs(7));
        // [instance] command serves when the table has none.
        let text =
            "[instance]\ncommand = [\"x\"]\nready_tcp = true\n[kubernetes]\nimage = \"app:1\"\n";
        let k8s = parse(text)
            .unwrap()
            .k8s_runtime_config("n")
            .unwrap()
            .unwrap();
        assert_eq!(k8s.program.command, ["x"]);
        assert!(matches!(k8s.program.readiness, Readiness::Tcp));
    }

    #[test]
    fn open_files_past_the_hosts_file_max_are_warned_about_with_the_numbers() {
        let c = parse(
            "[isolation]\nmode = \"user\"\nopen_files_max = 1000\n[cluster]\ncapacity = 50\n",
        )
        .unwrap();
        assert_eq!(c.open_files_warning(true, Some(50_000)), None);
        let warning = c.open_files_warning(true, Some(49_999)).unwrap();
        for number in ["1000", "50 may run", "50000 in all", "(49999)"] {
            assert!(warning.contains(number), "{number}: {warning}");
        }
        // Without a capacity, one instance per port of the range.
        let c = parse("[instance]\nport_range = [100, 199]\n[isolation]\nmode = \"sandbox\"\n")
            .unwrap();
        assert!(
            c.open_files_warning(true, Some(6_553_599))
                .unwrap()
                .contains("100 may run")
        );
        // Level none sets no limit of its own, and an unreadable file-max
        // warns of nothing.
        let none = parse("[isolation]\nmode = \"none\"\n").unwrap();
        assert_eq!(none.open_files_warning(true, Some(1)), None);
        assert_eq!(c.open_files_warning(true, None), None);
    }

    #[test]
    fn a_capacity_past_the_hosts_limits_is_warned_about_with_the_numbers() {
        let c = parse("[cluster]\ncapacity = 10000\n").unwrap();
        assert_eq!(c.host_limits_warning(Some(50_000), Some(30_000)), None);
        assert_eq!(
            c.host_limits_warning(None, None),
            None,
            "unreadable: no word"
        );
        let warning = c.host_limits_warning(Some(32_768), Some(1024)).unwrap();
        for part in [
            "10000 instances",
            "pid_max is 32768, below 50000",
            "1024 files, below 30000",
        ] {
            assert!(warning.contains(part), "{part}: {warning}");
        }
        let pids_only = c.host_limits_warning(Some(32_768), Some(1 << 20)).unwrap();
        assert!(!pids_only.contains("files"), "{pids_only}");
        // Without a capacity, one instance per port of the range.
        let ranged = parse("[instance]\nport_range = [30000, 30149]\n").unwrap();
        assert_eq!(ranged.host_limits_warning(Some(750), Some(450)), None);
        assert!(ranged.host_limits_warning(Some(749), None).is_some());
    }

    #[test]
    fn a_port_range_inside_the_ephemeral_range_is_warned_about() {
        let c = parse("[instance]\nport_range = [20000, 29999]\n").unwrap();
        assert_eq!(c.port_range_warning(Some((32768, 60999))), None);
        assert_eq!(c.port_range_warning(None), None);
        let warning = c.port_range_warning(Some((29000, 40000))).unwrap();
        assert!(
            warning.contains("20000-29999") && warning.contains("in 29000-29999"),
            "{warning}"
        );
        let inside = parse("[instance]\nport_range = [40000, 40009]\n").unwrap();
        assert!(inside.port_range_warning(Some((32768, 60999))).is_some());
        assert_eq!(
            parse("[instance]\nport_range = [29999, 29999]\n")
                .unwrap()
                .port_range_warning(Some((30000, 30001))),
            None
        );
    }

    #[test]
    fn body_pace_is_the_two_keys_and_a_zero_grace_turns_it_off() {
        let c = parse("[proxy]\nbody_min_bytes_per_s = 100\nbody_grace_ms = 3000\n").unwrap();
        assert_eq!(
            c.body_pace(),
            Some(berth_proxy::BodyPace {
                min_bytes_per_s: 100,
                grace: Duration::from_secs(3),
            })
        );
        let c = parse("[proxy]\nbody_grace_ms = 0\n").unwrap();
        assert_eq!(c.body_pace(), None);
    }

    #[test]
    fn path_routing_follows_the_domain_unless_told() {
        let on = |text: &str| parse(text).unwrap().path_routing();
        assert!(on(""));
        assert!(!on("[proxy]\nbase_domain = \"b.example\"\n"));
        assert!(on(
            "[proxy]\nbase_domain = \"b.example\"\npath_routing = \"on\"\n"
        ));
        assert!(!on(
            "[proxy]\nbase_domain = \"b.example\"\npath_routing = \"off\"\n"
        ));
        for bad in [
            "[proxy]\npath_routing = \"off\"\n",
            "[proxy]\npath_routing = \"sometimes\"\n",
        ] {
            let err = parse(bad).unwrap().validate().unwrap_err().to_string();
            assert!(
                err.contains("proxy.path_routing") && err.contains("line 2"),
                "{err}"
            );
        }
    }
}
