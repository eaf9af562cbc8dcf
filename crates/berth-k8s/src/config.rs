//! The `[kubernetes]` table and what the runtime needs from the rest of the
//! config. [`KubernetesConfig::validate`] checks every value before any
//! object is made, and each error names its key.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use berth_core::credential::ShimKey;
use berth_core::egress::{EgressPolicy, ProxyKey};
use berth_core::program::ProgramSettings;
use k8s_openapi::api::core::v1::{PodSpec, Toleration};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::names::is_dns_label;

/// A bad `[kubernetes]` value; the message names the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("kubernetes.{key}: {reason}")]
pub struct ConfigError {
    /// The key at fault, under `kubernetes.` (`storage.claim`).
    pub key: String,
    /// What is wrong with its value, for a person to read.
    pub reason: String,
}

fn bad(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.into(),
        reason: reason.into(),
    }
}

/// The `[kubernetes]` table. Its presence selects this runtime.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// The kubeconfig file berth connects with; unset: `KUBECONFIG`,
    /// `~/.kube/config`, or the pod's service account when berth runs in
    /// the cluster (kube's inference).
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig's context to use; its current one when unset.
    pub context: Option<String>,
    /// Where every object of every user goes.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// The container image of the program.
    pub image: String,
    /// `Always`, `IfNotPresent` or `Never`; Kubernetes' default when unset.
    pub image_pull_policy: Option<String>,
    /// The container's command, with the same placeholders as
    /// `[instance] command`; that one when unset.
    pub command: Option<Vec<String>>,
    /// The port the program listens on inside its pod (`{port}`,
    /// `BERTH_PORT`), and the Service's port.
    #[serde(default = "default_port")]
    pub port: u16,
    /// The program container's requests and limits.
    #[serde(default)]
    pub resources: Resources,
    /// Where each user's data lives.
    #[serde(default)]
    pub storage: Storage,
    /// Who the program runs as.
    #[serde(default)]
    pub security: Security,
    /// What the user's NetworkPolicy lets in and out.
    #[serde(default)]
    pub network: Network,
    /// Node labels a pod must be placed on (its `nodeSelector`).
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    /// Kubernetes tolerations, as in a pod spec (`key`, `operator`,
    /// `value`, `effect`, `tolerationSeconds`).
    #[serde(default)]
    pub tolerations: Vec<Value>,
    /// The pod's service account. Its token is never mounted.
    pub service_account: Option<String>,
    /// Further pod-spec fields (Kubernetes' own names), merged into every
    /// pod. They may not replace a field berth sets.
    #[serde(default)]
    pub pod_spec: BTreeMap<String, Value>,
    /// A file-service sidecar next to the program, with the user's volume.
    pub file_service: Option<FileService>,
    /// How long a pod may take to start running (scheduling, image pull)
    /// before its start fails.
    #[serde(default = "default_start_timeout")]
    pub start_timeout_s: u64,
    /// The cluster's DNS domain, for the Service's name.
    #[serde(default = "default_cluster_domain")]
    pub cluster_domain: String,
    /// How the proxy reaches a user's pod.
    #[serde(default)]
    pub endpoint: EndpointMode,
    /// berth's shim as every pod's entrypoint, so that pods hibernate with
    /// their memory, keep a fence deadline and run hooks (see
    /// [`ShimConfig`]). Unset: the program is the entrypoint, and idle pods
    /// are stopped.
    pub shim: Option<ShimConfig>,
}

/// `[kubernetes.shim]`: berth's own binary, in the program's image, runs
/// as the pod's entrypoint (`berth shim pod -- PROGRAM…`) and supervises
/// the program as its child under `security.run_as_user`. The container
/// then runs as root with only the capabilities that needs (`SETUID`,
/// `SETGID`, `KILL`): the Pod Security "baseline" level, not
/// "restricted". berth reaches the shim on `port` of the pod's address,
/// with a credential only it and the shim hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShimConfig {
    /// Where berth's binary is in the program's image.
    pub path: String,
    /// The port the shim listens on for berth.
    #[serde(default = "default_shim_port")]
    pub port: u16,
}

fn default_shim_port() -> u16 {
    7079
}

/// How the proxy reaches a user's pod.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndpointMode {
    /// The headless Service's cluster DNS name
    /// (`berth-<slug>.<namespace>.svc.<cluster_domain>`), which resolves
    /// to the pod's address: for berth running inside the cluster.
    #[default]
    ServiceDns,
    /// The address and port the Service's EndpointSlice lists for the
    /// pod, read from the API server: for berth on the pod network
    /// without the cluster's DNS (and how tests reach pods through the
    /// API-server double, whose slices map a Service to a local port).
    EndpointSlice,
}

fn default_namespace() -> String {
    "berth".into()
}
fn default_port() -> u16 {
    8080
}
fn default_start_timeout() -> u64 {
    300
}
fn default_cluster_domain() -> String {
    "cluster.local".into()
}

/// Container resources: quantities by resource name (`cpu = "500m"`,
/// `memory = "1Gi"`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    /// What the scheduler sets aside for the container.
    #[serde(default)]
    pub requests: BTreeMap<String, String>,
    /// The most the container may use; a `memory` limit is also what an
    /// out-of-memory exit reports.
    #[serde(default)]
    pub limits: BTreeMap<String, String>,
}

/// Where a user's data lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Storage {
    /// A claim per user, or one shared claim.
    #[serde(default)]
    pub mode: StorageMode,
    /// `per_user`: each claim's size.
    #[serde(default = "default_size")]
    pub size: String,
    /// `per_user`: the claims' storage class (the cluster's default when
    /// unset).
    pub storage_class: Option<String>,
    /// `shared`: the existing claim every user's `subPath` is in.
    pub claim: Option<String>,
    /// Where the volume is mounted in the container; also `HOME`.
    #[serde(default = "default_mount_path")]
    pub mount_path: String,
}

impl Default for Storage {
    fn default() -> Self {
        Self {
            mode: StorageMode::default(),
            size: default_size(),
            storage_class: None,
            claim: None,
            mount_path: default_mount_path(),
        }
    }
}

fn default_size() -> String {
    "1Gi".into()
}
fn default_mount_path() -> String {
    "/home/berth".into()
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
/// How users' volumes are provided (`storage.mode`).
#[serde(rename_all = "snake_case")]
pub enum StorageMode {
    /// A PersistentVolumeClaim `berth-<slug>` per user, never deleted by
    /// berth.
    #[default]
    PerUser,
    /// One existing claim (`storage.claim`), each user in `subPath`
    /// `users/<slug>`.
    Shared,
}

/// Who the program runs as. Pods always run non-root, with every
/// capability dropped, the runtime's default seccomp profile and no
/// service-account token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Security {
    /// The uid the program runs as; never root.
    #[serde(default = "default_uid")]
    pub run_as_user: i64,
    /// `run_as_user` when unset.
    pub run_as_group: Option<i64>,
    /// `run_as_group` when unset: the volume is made writable for it.
    pub fs_group: Option<i64>,
    /// Mount the container's root filesystem read-only; `/tmp` then gets a
    /// scratch volume of its own.
    #[serde(default)]
    pub read_only_root_filesystem: bool,
}

impl Default for Security {
    fn default() -> Self {
        Self {
            run_as_user: default_uid(),
            run_as_group: None,
            fs_group: None,
            read_only_root_filesystem: false,
        }
    }
}

fn default_uid() -> i64 {
    1000
}

impl Security {
    /// The gid the program runs as: `run_as_group`, else the uid.
    pub fn group(&self) -> i64 {
        self.run_as_group.unwrap_or(self.run_as_user)
    }
    /// The group the volume is made writable for: `fs_group`, else
    /// [`Security::group`].
    pub fn fs_group(&self) -> i64 {
        self.fs_group.unwrap_or_else(|| self.group())
    }
}

/// The user's NetworkPolicy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Network {
    /// Labels of berth's own pods: the only ones that may connect to a
    /// user's pod.
    #[serde(default = "default_berth_labels")]
    pub berth_pod_labels: BTreeMap<String, String>,
    /// berth's namespace, when it is not `namespace`.
    pub berth_namespace: Option<String>,
    /// Let programs reach private ranges (RFC 1918, shared 100.64/10,
    /// link-local, IPv6 ULA and link-local).
    #[serde(default)]
    pub allow_private_egress: bool,
    /// Let programs reach the cloud metadata services and host agents
    /// (`berth_core::egress::METADATA_V4` and `METADATA_V6`).
    #[serde(default)]
    pub allow_metadata_egress: bool,
    /// Let programs ask the cluster's DNS (kube-system's `k8s-app=kube-dns`
    /// pods, port 53).
    #[serde(default = "yes")]
    pub allow_dns: bool,
    /// `host:port` of berth's egress proxy for pods, as pods reach it (a
    /// Service in front of berth's pods): berth listens on that port, and
    /// a pod whose policy allows domain names goes there for them.
    pub egress_proxy: Option<String>,
}

impl Network {
    /// [`Network::egress_proxy`]'s host and port, when it is set and
    /// well formed (see validation).
    pub fn egress_proxy(&self) -> Option<(&str, u16)> {
        let (host, port) = self.egress_proxy.as_deref()?.rsplit_once(':')?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
        let named =
            berth_core::egress::is_host_name(host) || host.parse::<std::net::IpAddr>().is_ok();
        named.then_some((host, port))
    }
}

impl Default for Network {
    fn default() -> Self {
        Self {
            berth_pod_labels: default_berth_labels(),
            berth_namespace: None,
            allow_private_egress: false,
            allow_metadata_egress: false,
            allow_dns: true,
            egress_proxy: None,
        }
    }
}

fn default_berth_labels() -> BTreeMap<String, String> {
    BTreeMap::from([("app.kubernetes.io/name".to_owned(), "berth".to_owned())])
}
fn yes() -> bool {
    true
}

/// The optional file-service sidecar (`[kubernetes] file_service`): a
/// second container with the user's volume, reachable through the
/// user's Service on port `port` (named `files`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileService {
    /// The sidecar's container image.
    pub image: String,
    /// Its command (placeholders as for the program); the image's own when
    /// unset.
    pub command: Option<Vec<String>>,
    /// The port it listens on, which the Service names `files`; it must
    /// differ from the program's port.
    #[serde(default = "default_files_port")]
    pub port: u16,
}

fn default_files_port() -> u16 {
    8081
}

/// Top-level pod-spec fields berth sets itself, which `pod_spec` may not
/// replace.
pub const BERTH_POD_FIELDS: &[&str] = &[
    "containers",
    "restartPolicy",
    "securityContext",
    "automountServiceAccountToken",
    "serviceAccount",
    "serviceAccountName",
    "enableServiceLinks",
    "volumes",
    "hostname",
    "subdomain",
    "terminationGracePeriodSeconds",
    "nodeSelector",
    "tolerations",
    "hostNetwork",
    "hostPID",
    "hostIPC",
];

impl KubernetesConfig {
    /// A config with every default and this image.
    pub fn with_image(image: impl Into<String>) -> Self {
        Self {
            kubeconfig: None,
            context: None,
            namespace: default_namespace(),
            image: image.into(),
            image_pull_policy: None,
            command: None,
            port: default_port(),
            resources: Resources::default(),
            storage: Storage::default(),
            security: Security::default(),
            network: Network::default(),
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            service_account: None,
            pod_spec: BTreeMap::new(),
            file_service: None,
            start_timeout_s: default_start_timeout(),
            cluster_domain: default_cluster_domain(),
            endpoint: EndpointMode::default(),
            shim: None,
        }
    }

    /// `start_timeout_s` as a [`Duration`].
    pub fn start_timeout(&self) -> Duration {
        Duration::from_secs(self.start_timeout_s)
    }

    /// Checks every value; the first problem, naming its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self
            .kubeconfig
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty())
        {
            return Err(bad("kubeconfig", "must not be empty"));
        }
        if self.context.as_ref().is_some_and(|c| c.trim().is_empty()) {
            return Err(bad("context", "must not be empty"));
        }
        if !is_dns_label(&self.namespace) {
            return Err(bad(
                "namespace",
                format!(
                    "{:?} is not a DNS label (a-z, 0-9, '-', at most 63)",
                    self.namespace
                ),
            ));
        }
        if self.image.trim().is_empty() {
            return Err(bad("image", "must name a container image"));
        }
        if let Some(policy) = &self.image_pull_policy
            && !["Always", "IfNotPresent", "Never"].contains(&policy.as_str())
        {
            return Err(bad(
                "image_pull_policy",
                format!("{policy:?} is not Always, IfNotPresent or Never"),
            ));
        }
        if self.command.as_ref().is_some_and(Vec::is_empty) {
            return Err(bad("command", "must not be empty"));
        }
        if self.port == 0 {
            return Err(bad("port", "must be 1-65535"));
        }
        for (table, map) in [
            ("resources.requests", &self.resources.requests),
            ("resources.limits", &self.resources.limits),
        ] {
            for (name, quantity) in map {
                if parse_quantity(quantity).is_none() {
                    return Err(bad(
                        format!("{table}.{name}"),
                        format!(
                            "{quantity:?} is not a Kubernetes quantity (e.g. \"500m\", \"1Gi\")"
                        ),
                    ));
                }
            }
        }
        self.validate_storage()?;
        self.validate_security()?;
        self.validate_network()?;
        for (key, value) in &self.node_selector {
            if key.is_empty() || !crate::names::is_label_value(value) {
                return Err(bad(
                    format!("node_selector.{key}"),
                    format!("{value:?} is not a label value"),
                ));
            }
        }
        self.tolerations()?;
        if let Some(account) = &self.service_account
            && !is_dns_subdomain(account)
        {
            return Err(bad(
                "service_account",
                format!("{account:?} is not a valid name"),
            ));
        }
        for key in self.pod_spec.keys() {
            if BERTH_POD_FIELDS.contains(&key.as_str()) {
                return Err(bad(
                    format!("pod_spec.{key}"),
                    "berth sets this field itself (see the [kubernetes] keys)",
                ));
            }
        }
        extra_pod_spec(self)?;
        if let Some(files) = &self.file_service {
            if files.image.trim().is_empty() {
                return Err(bad("file_service.image", "must name a container image"));
            }
            if files.port == 0 || files.port == self.port {
                return Err(bad(
                    "file_service.port",
                    format!("must be 1-65535 and differ from port {}", self.port),
                ));
            }
        }
        if let Some(shim) = &self.shim {
            if self.security.fs_group() != self.security.group() {
                return Err(bad(
                    "security.fs_group",
                    "must be the program's group with [kubernetes.shim]: the shim starts the \
                     program with its group alone",
                ));
            }
            if !shim.path.starts_with('/') {
                return Err(bad(
                    "shim.path",
                    "must be the absolute path of berth's binary in the image",
                ));
            }
            let taken = [Some(self.port), self.file_service.as_ref().map(|f| f.port)];
            if shim.port == 0 || taken.contains(&Some(shim.port)) {
                return Err(bad(
                    "shim.port",
                    "must be 1-65535 and differ from the program's and the file service's",
                ));
            }
        }
        if self.start_timeout_s == 0 {
            return Err(bad("start_timeout_s", "must be at least 1"));
        }
        if !self.cluster_domain.split('.').all(is_dns_label) {
            return Err(bad(
                "cluster_domain",
                format!("{:?} is not a DNS name", self.cluster_domain),
            ));
        }
        Ok(())
    }

    fn validate_storage(&self) -> Result<(), ConfigError> {
        let s = &self.storage;
        if !s.mount_path.starts_with('/') || s.mount_path.contains("/../") {
            return Err(bad(
                "storage.mount_path",
                format!("{:?} is not an absolute path", s.mount_path),
            ));
        }
        match s.mode {
            StorageMode::PerUser => {
                if parse_quantity(&s.size).is_none() {
                    return Err(bad(
                        "storage.size",
                        format!("{:?} is not a Kubernetes quantity", s.size),
                    ));
                }
                if let Some(class) = &s.storage_class
                    && !is_dns_subdomain(class)
                {
                    return Err(bad(
                        "storage.storage_class",
                        format!("{class:?} is not a valid name"),
                    ));
                }
                if s.claim.is_some() {
                    return Err(bad("storage.claim", "only for mode = \"shared\""));
                }
            }
            StorageMode::Shared => match &s.claim {
                None => return Err(bad("storage.claim", "mode = \"shared\" needs a claim name")),
                Some(claim) if !is_dns_subdomain(claim) => {
                    return Err(bad(
                        "storage.claim",
                        format!("{claim:?} is not a valid name"),
                    ));
                }
                Some(_) => {}
            },
        }
        Ok(())
    }

    fn validate_security(&self) -> Result<(), ConfigError> {
        let s = &self.security;
        for (key, id) in [
            ("run_as_user", Some(s.run_as_user)),
            ("run_as_group", s.run_as_group),
            ("fs_group", s.fs_group),
        ] {
            if let Some(id) = id
                && !(1..=i64::from(u32::MAX - 1)).contains(&id)
            {
                return Err(bad(
                    format!("security.{key}"),
                    format!("{id} is not a non-root id (1-4294967294)"),
                ));
            }
        }
        Ok(())
    }

    fn validate_network(&self) -> Result<(), ConfigError> {
        let n = &self.network;
        if n.berth_pod_labels.is_empty() {
            return Err(bad(
                "network.berth_pod_labels",
                "must name at least one label of berth's pods",
            ));
        }
        for (key, value) in &n.berth_pod_labels {
            if key.is_empty() || !crate::names::is_label_value(value) {
                return Err(bad(
                    format!("network.berth_pod_labels.{key}"),
                    format!("{value:?} is not a label value"),
                ));
            }
        }
        if let Some(ns) = &n.berth_namespace
            && !is_dns_label(ns)
        {
            return Err(bad(
                "network.berth_namespace",
                format!("{ns:?} is not a namespace name"),
            ));
        }
        if let Some(proxy) = &n.egress_proxy
            && n.egress_proxy().is_none()
        {
            return Err(bad(
                "network.egress_proxy",
                format!("{proxy:?} is not host:port (a DNS name or an address, a port 1-65535)"),
            ));
        }
        Ok(())
    }

    /// The tolerations as Kubernetes objects; a key Kubernetes does not
    /// know is an error rather than dropped.
    pub fn tolerations(&self) -> Result<Vec<Toleration>, ConfigError> {
        self.tolerations
            .iter()
            .enumerate()
            .map(|(i, value)| strict(value, &format!("tolerations[{i}]")))
            .collect()
    }

    /// The memory limit in MiB, for reporting an out-of-memory kill.
    pub fn memory_limit_mb(&self) -> Option<u64> {
        let bytes = parse_quantity(self.resources.limits.get("memory")?)?;
        Some((bytes / (1024.0 * 1024.0)).round() as u64)
    }
}

/// Everything the runtime needs: the `[kubernetes]` table and what it
/// shares with every runtime.
#[derive(Debug, Clone)]
pub struct K8sRuntimeConfig {
    /// The `[kubernetes]` table.
    pub kubernetes: KubernetesConfig,
    /// This replica's node id: the pods it manages carry it, and it
    /// discovers only those.
    pub node: String,
    /// The program; its command is used unless `kubernetes.command` is
    /// set.
    pub program: ProgramSettings,
    /// The pods' termination grace period (a stop passes its own).
    pub stop_grace: Duration,
    /// The node's egress policy: a user without one of their own has it.
    pub egress: EgressPolicy,
    /// The key of the pods' credentials for the egress proxy, where
    /// `network.egress_proxy` is set.
    pub egress_proxy_key: Option<ProxyKey>,
    /// The key of the pods' shim credentials, where `shim` is set.
    pub shim_key: Option<ShimKey>,
}

impl K8sRuntimeConfig {
    /// Checks the `[kubernetes]` table and the rest.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.kubernetes.validate()?;
        if self.kubernetes.network.egress_proxy.is_some() && self.egress_proxy_key.is_none() {
            return Err(ConfigError {
                key: "network.egress_proxy".into(),
                reason: "needs cluster_secret: the pods' credentials for the proxy are derived \
                         from it, so that every replica checks every pod's"
                    .into(),
            });
        }
        if self.kubernetes.shim.is_some() && self.shim_key.is_none() {
            return Err(ConfigError {
                key: "shim".into(),
                reason: "needs cluster_secret: each pod's credential for its shim is derived \
                         from it, so that every replica can command every pod's shim"
                    .into(),
            });
        }
        if self.kubernetes.command.is_none() && self.program.command.is_empty() {
            return Err(ConfigError {
                key: "command".into(),
                reason: "no command: set kubernetes.command or [instance] command".into(),
            });
        }
        Ok(())
    }
}

/// The extra `pod_spec` fields as a JSON object, checked to be pod-spec
/// fields.
pub(crate) fn extra_pod_spec(config: &KubernetesConfig) -> Result<Map<String, Value>, ConfigError> {
    let extra: Map<String, Value> = config
        .pod_spec
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    // Checked on a minimal spec, so only the extra fields can be dropped.
    let mut probe = extra.clone();
    probe.insert("containers".into(), json!([{ "name": "probe" }]));
    strict::<PodSpec>(&Value::Object(probe), "pod_spec")?;
    Ok(extra)
}

/// Deserializes `value` into `T`, refusing keys `T` would silently drop
/// (k8s-openapi's types ignore unknown fields).
pub(crate) fn strict<T>(value: &Value, key: &str) -> Result<T, ConfigError>
where
    T: serde::de::DeserializeOwned + serde::Serialize,
{
    let typed: T = serde_json::from_value(value.clone()).map_err(|e| bad(key, format!("{e}")))?;
    let back = serde_json::to_value(&typed).map_err(|e| bad(key, format!("{e}")))?;
    if let Some(path) = dropped_key(value, &back) {
        return Err(bad(
            format!("{key}{path}"),
            "is not a field Kubernetes knows here",
        ));
    }
    Ok(typed)
}

/// The path of the first key of `given` missing from `kept`.
fn dropped_key(given: &Value, kept: &Value) -> Option<String> {
    match (given, kept) {
        (Value::Object(g), Value::Object(k)) => {
            g.iter().find_map(|(key, value)| match k.get(key) {
                None if !value.is_null() => Some(format!(".{key}")),
                None => None,
                Some(inner) => dropped_key(value, inner).map(|p| format!(".{key}{p}")),
            })
        }
        (Value::Array(g), Value::Array(k)) => g
            .iter()
            .zip(k)
            .enumerate()
            .find_map(|(i, (g, k))| dropped_key(g, k).map(|p| format!("[{i}]{p}"))),
        _ => None,
    }
}

/// A DNS-1123 subdomain: dot-separated labels, at most 253 characters.
pub(crate) fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// A Kubernetes quantity (`"1.5"`, `"500m"`, `"1Gi"`, `"2e3"`), in base
/// units; `None` when it is not one.
pub fn parse_quantity(text: &str) -> Option<f64> {
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    if number.is_empty() || number.matches('.').count() > 1 {
        return None;
    }
    let value: f64 = number.parse().ok()?;
    let factor = match suffix {
        "" => 1.0,
        "n" => 1e-9,
        "u" => 1e-6,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024.0,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        exp if exp.starts_with(['e', 'E']) => 10f64.powi(exp[1..].parse().ok()?),
        _ => return None,
    };
    (value >= 0.0).then_some(value * factor)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> KubernetesConfig {
        toml::from_str(text).unwrap()
    }

    fn error_of(text: &str) -> String {
        let config: KubernetesConfig = match toml::from_str(text) {
            Ok(config) => config,
            Err(e) => return e.to_string(),
        };
        config.validate().unwrap_err().to_string()
    }

    #[test]
    fn the_defaults_are_valid() {
        let config = parse(r#"image = "example/app:1""#);
        config.validate().unwrap();
        assert_eq!(config, KubernetesConfig::with_image("example/app:1"));
        assert_eq!(config.namespace, "berth");
        assert_eq!(config.storage.mode, StorageMode::PerUser);
        assert_eq!(config.security.fs_group(), 1000);
        assert!(!config.network.allow_private_egress);
    }

    #[test]
    fn every_bad_value_names_its_key() {
        let cases = [
            (
                "namespace = \"Berth\"",
                "kubernetes.namespace: \"Berth\" is not a DNS label",
            ),
            (
                "image_pull_policy = \"Sometimes\"",
                "kubernetes.image_pull_policy",
            ),
            ("command = []", "kubernetes.command: must not be empty"),
            ("port = 0", "kubernetes.port"),
            (
                "resources.limits.memory = \"lots\"",
                "kubernetes.resources.limits.memory: \"lots\" is not a Kubernetes quantity",
            ),
            (
                "storage.mode = \"shared\"",
                "kubernetes.storage.claim: mode = \"shared\" needs a claim name",
            ),
            (
                "storage.claim = \"x\"",
                "kubernetes.storage.claim: only for mode = \"shared\"",
            ),
            (
                "storage.mount_path = \"home\"",
                "kubernetes.storage.mount_path",
            ),
            (
                "security.run_as_user = 0",
                "kubernetes.security.run_as_user: 0 is not a non-root id",
            ),
            ("security.fs_group = -1", "kubernetes.security.fs_group"),
            (
                "network.berth_namespace = \"A\"",
                "kubernetes.network.berth_namespace",
            ),
            (
                "node_selector.zone = \"a b\"",
                "kubernetes.node_selector.zone",
            ),
            (
                "tolerations = [{ key = \"gpu\", operator = \"Exists\", efect = \"NoSchedule\" }]",
                "kubernetes.tolerations[0].efect: is not a field Kubernetes knows here",
            ),
            ("service_account = \"Robot\"", "kubernetes.service_account"),
            (
                "pod_spec.restartPolicy = \"Always\"",
                "kubernetes.pod_spec.restartPolicy: berth sets this field itself",
            ),
            (
                "pod_spec.securityContext = { runAsUser = 0 }",
                "kubernetes.pod_spec.securityContext: berth sets this field itself",
            ),
            (
                "pod_spec.priorityClasName = \"high\"",
                "kubernetes.pod_spec.priorityClasName: is not a field Kubernetes knows here",
            ),
            (
                "file_service = { image = \"f\", port = 8080 }",
                "kubernetes.file_service.port",
            ),
            ("start_timeout_s = 0", "kubernetes.start_timeout_s"),
            ("cluster_domain = \"-x\"", "kubernetes.cluster_domain"),
        ];
        for (line, want) in cases {
            let text = format!("image = \"example/app:1\"\n{line}");
            let got = error_of(&text);
            assert!(got.starts_with(want), "{line}: {got}");
        }
        assert!(error_of("imag = \"x\"").contains("unknown field `imag`"));
        assert!(error_of("").contains("missing field `image`"));
    }

    #[test]
    fn quantities_parse_like_kubernetes() {
        assert_eq!(parse_quantity("1Gi"), Some(1024f64.powi(3)));
        assert_eq!(parse_quantity("500m"), Some(0.5));
        assert_eq!(parse_quantity("2"), Some(2.0));
        assert_eq!(parse_quantity("1.5G"), Some(1.5e9));
        assert_eq!(parse_quantity("3e2"), Some(300.0));
        for bad in ["", "Gi", "1GB", "1..2", "-1", "one"] {
            assert_eq!(parse_quantity(bad), None, "{bad:?}");
        }
        let mut config = KubernetesConfig::with_image("x");
        config
            .resources
            .limits
            .insert("memory".into(), "512Mi".into());
        assert_eq!(config.memory_limit_mb(), Some(512));
    }

    #[test]
    fn tolerations_and_extra_fields_are_kubernetes_objects() {
        let config = parse(
            r#"
            image = "x"
            tolerations = [{ key = "gpu", operator = "Exists", effect = "NoSchedule", tolerationSeconds = 30 }]
            pod_spec = { priorityClassName = "high", runtimeClassName = "gvisor" }
            "#,
        );
        config.validate().unwrap();
        let t = &config.tolerations().unwrap()[0];
        assert_eq!(t.key.as_deref(), Some("gpu"));
        assert_eq!(t.toleration_seconds, Some(30));
    }
}
