//! The objects of one user, as pure functions of the config and plain
//! per-instance data: a Pod per role, a headless Service, a ConfigMap for
//! the patch (and one for a watchdog's handoff), a NetworkPolicy, and a
//! PersistentVolumeClaim in `per_user` storage mode.
//!
//! Each builder writes the object as JSON and converts it to its
//! k8s-openapi type with [`strict`](crate::config::strict), so a field
//! name Kubernetes does not know fails the build (and the tests) instead
//! of vanishing. `tests/it/schema.rs` validates every object against the
//! official JSON schemas of the oldest and newest supported API version.

use std::collections::BTreeMap;

use berth_core::egress::{EgressPolicy, METADATA_V4, METADATA_V6, PRIVATE_V4, PRIVATE_V6};
use berth_core::program::{self, ProgramFacts, Variable};
use berth_core::{Epoch, Readiness, Role, Slug, UserId};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use crate::config::{
    ConfigError, K8sRuntimeConfig, KubernetesConfig, Network, ShimConfig, StorageMode,
    extra_pod_spec, strict,
};
use crate::names::{self, EPOCH_ANNOTATION, INSTANCE_ANNOTATION, NODE_ANNOTATION};

/// Where the patch ConfigMap is mounted.
pub const PATCH_DIR: &str = "/berth/patch";
/// Where a watchdog's handoff ConfigMap is mounted.
pub const HANDOFF_DIR: &str = "/berth/handoff";
/// The handoff's key (and file name).
pub const HANDOFF_KEY: &str = "handoff.json";
/// The program's container.
pub const MAIN_CONTAINER: &str = "main";
/// The file-service sidecar's container.
pub const FILES_CONTAINER: &str = "files";

/// What one pod is made for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInput<'a> {
    /// The user the pod runs for.
    pub user: &'a UserId,
    /// The user's slug, which names the pod and the user's objects.
    pub slug: &'a Slug,
    /// The program, or its watchdog.
    pub role: Role,
    /// The instance the pod runs, kept in an annotation.
    pub instance_id: &'a str,
    /// The lease epoch the pod starts under, kept in an annotation.
    pub epoch: Epoch,
    /// Relative to the user's volume (validated by the controller).
    pub folder: &'a str,
    /// The replica that manages the pod.
    pub node: &'a str,
    /// A hash of the patch it starts with (see [`patch_hash`]).
    pub patch_hash: &'a str,
    /// Whether the user has a patch (else `BERTH_PATCH` is empty).
    pub has_patch: bool,
    /// Extra environment from the controller.
    pub env: &'a [(String, String)],
    /// For a main pod with berth's shim (`[kubernetes.shim]`): what its
    /// shim is given.
    pub shim: Option<ShimInput<'a>>,
}

/// What a pod's shim is given besides the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShimInput<'a> {
    /// The pod's shim nonce (see [`names::SHIM_NONCE_ANNOTATION`]).
    pub nonce: &'a str,
    /// The fence deadline from the shim's start; `None`: no fencing.
    pub fence_ms: Option<u64>,
}

/// The key of the pod's Secret that holds its shim credential.
pub const SHIM_CREDENTIAL_KEY: &str = "credential";

fn meta(config: &KubernetesConfig, name: &str, user: &UserId, slug: &Slug) -> Value {
    json!({
        "name": name,
        "namespace": config.namespace,
        "labels": names::user_labels(slug),
        "annotations": { names::USER_ANNOTATION: user.as_str() },
    })
}

/// The file name of the patch inside [`PATCH_DIR`].
pub fn patch_file(patch_ext: &str) -> String {
    format!("main.{patch_ext}")
}

/// A hash of patch content (or its absence), recorded on the pod.
pub fn patch_hash(content: Option<&str>) -> String {
    let mut hasher = Sha256::new();
    match content {
        Some(text) => {
            hasher.update(b"set:");
            hasher.update(text.as_bytes());
        }
        None => hasher.update(b"none"),
    }
    hex::encode(&hasher.finalize()[..12])
}

/// Replaces the `{name}` placeholders of a configured argument by the
/// kubelet's `$(VAR)` references to the variables they stand for, so no
/// value is ever pasted into the command line (the kubelet fills them in,
/// once).
pub fn template_arg(arg: &str) -> String {
    program::substitute(arg, |p| format!("$({})", p.variable().name()))
}

fn env_value(name: &str, value: &str) -> Value {
    json!({ "name": name, "value": value })
}

fn env_annotation(name: &str, annotation: &str) -> Value {
    json!({
        "name": name,
        "valueFrom": { "fieldRef": { "fieldPath": format!("metadata.annotations['{annotation}']") } },
    })
}

/// The working directory: `folder` inside the user's volume.
fn working_dir(mount_path: &str, folder: &str) -> String {
    let folder = folder.trim_matches('/');
    if folder.is_empty() {
        mount_path.to_owned()
    } else {
        format!("{}/{folder}", mount_path.trim_end_matches('/'))
    }
}

fn container_security(config: &KubernetesConfig) -> Value {
    json!({
        "allowPrivilegeEscalation": false,
        "capabilities": { "drop": ["ALL"] },
        "runAsNonRoot": true,
        "readOnlyRootFilesystem": config.security.read_only_root_filesystem,
    })
}

/// The name of the shim's port, in the pod and in the user's Service.
pub const SHIM_PORT_NAME: &str = "berth-shim";

/// The shim's part of the container's command: `berth shim pod --`.
fn shim_command(config: &ShimConfig) -> [String; 4] {
    [
        config.path.clone(),
        "shim".into(),
        "pod".into(),
        "--".into(),
    ]
}

/// The shim's own variables (which it takes out of the program's
/// environment): its credential from the pod's Secret, never written in
/// the pod itself; the instance, epoch and fence deadline from the pod's
/// annotations, so that the template does not change with them.
fn shim_env(
    runtime: &K8sRuntimeConfig,
    pod_name: &str,
    input: &PodInput<'_>,
    shim: ShimInput<'_>,
) -> Vec<(String, Value)> {
    use berth_core::shim_wire::pod_env as v;
    let k = &runtime.kubernetes;
    let Some(config) = &k.shim else {
        return Vec::new();
    };
    let mut env = vec![
        (
            v::CONTROL,
            env_value(v::CONTROL, &format!("0.0.0.0:{}", config.port)),
        ),
        (
            v::CREDENTIAL,
            json!({
                "name": v::CREDENTIAL,
                "valueFrom": { "secretKeyRef": { "name": pod_name, "key": SHIM_CREDENTIAL_KEY } },
            }),
        ),
        (
            v::RUN_AS,
            env_value(
                v::RUN_AS,
                &format!("{}:{}", k.security.run_as_user, k.security.group()),
            ),
        ),
        (
            v::INSTANCE,
            env_annotation(v::INSTANCE, INSTANCE_ANNOTATION),
        ),
        (v::EPOCH, env_annotation(v::EPOCH, EPOCH_ANNOTATION)),
        (v::USER, env_value(v::USER, input.user.as_str())),
        (v::ROLE, env_value(v::ROLE, input.role.as_str())),
        (
            v::STOP_GRACE_MS,
            env_value(
                v::STOP_GRACE_MS,
                &runtime.stop_grace.as_millis().to_string(),
            ),
        ),
        (v::STATE_DIR, env_value(v::STATE_DIR, "/tmp")),
    ];
    if shim.fence_ms.is_some() {
        env.push((
            v::FENCE_MS,
            env_annotation(v::FENCE_MS, names::SHIM_FENCE_ANNOTATION),
        ));
    }
    env.into_iter().map(|(n, e)| (n.to_owned(), e)).collect()
}

/// The shim's container: root, to start the program under its own uid and
/// to signal it, with no other capability.
fn shim_security(config: &KubernetesConfig) -> Value {
    json!({
        "allowPrivilegeEscalation": false,
        "capabilities": { "drop": ["ALL"], "add": ["SETUID", "SETGID", "KILL"] },
        "runAsNonRoot": false,
        "runAsUser": 0,
        "runAsGroup": 0,
        "readOnlyRootFilesystem": config.security.read_only_root_filesystem,
    })
}

/// The Secret that holds the shim credential of pod `pod_name`: the
/// kubelet puts it in the shim's environment alone.
pub fn shim_secret(
    config: &KubernetesConfig,
    user: &UserId,
    slug: &Slug,
    pod_name: &str,
    credential: &str,
) -> Result<Secret, ConfigError> {
    strict(
        &json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": meta(config, pod_name, user, slug),
            "type": "Opaque",
            "data": { SHIM_CREDENTIAL_KEY: k8s_openapi::ByteString(credential.as_bytes().to_vec()) },
        }),
        "secret",
    )
}

fn data_mount(config: &KubernetesConfig, slug: &Slug) -> Value {
    let mut mount = json!({ "name": "data", "mountPath": config.storage.mount_path });
    if config.storage.mode == StorageMode::Shared {
        mount["subPath"] = json!(format!("users/{slug}"));
    }
    mount
}

fn quantities(map: &BTreeMap<String, String>) -> Value {
    Value::Object(
        map.iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect(),
    )
}

/// The pod of `input.role`. `None` when no command is configured for the
/// role (a watchdog without `[watchdog] command`).
pub fn pod(config: &K8sRuntimeConfig, input: &PodInput<'_>) -> Result<Option<Pod>, ConfigError> {
    let k = &config.kubernetes;
    let command = match input.role {
        Role::Main => k.command.as_ref().unwrap_or(&config.program.command),
        Role::Watchdog => match &config.program.watchdog_command {
            Some(command) => command,
            None => return Ok(None),
        },
    };
    let name = names::pod(input.slug, input.role);
    let mut metadata = meta(k, &name, input.user, input.slug);
    metadata["labels"] = json!(names::pod_labels(input.slug, input.role));
    metadata["annotations"] = json!({
        names::USER_ANNOTATION: input.user.as_str(),
        INSTANCE_ANNOTATION: input.instance_id,
        EPOCH_ANNOTATION: input.epoch.to_string(),
        NODE_ANNOTATION: input.node,
        names::PATCH_ANNOTATION: input.patch_hash,
    });
    metadata["finalizers"] = json!([names::FINALIZER]);
    let shim = k
        .shim
        .as_ref()
        .filter(|_| input.role == Role::Main)
        .zip(input.shim);
    if let Some((_, shim)) = shim {
        metadata["annotations"][names::SHIM_NONCE_ANNOTATION] = json!(shim.nonce);
        if let Some(ms) = shim.fence_ms {
            metadata["annotations"][names::SHIM_FENCE_ANNOTATION] = json!(ms.to_string());
        }
    }

    // Configured variables first, then the controller's, then berth's own,
    // which win (a config cannot spoof BERTH_USER). The epoch and instance
    // id come from the pod's annotations, so the template does not change
    // with them.
    let mut env: BTreeMap<String, Value> = BTreeMap::new();
    for (key, value) in config
        .program
        .env
        .iter()
        .chain(input.env.iter().map(|(k, v)| (k, v)))
    {
        env.insert(key.clone(), env_value(key, value));
    }
    let patch_path = format!("{PATCH_DIR}/{}", patch_file(&config.program.patch_ext));
    let handoff_path = format!("{HANDOFF_DIR}/{HANDOFF_KEY}");
    let folder = working_dir(&k.storage.mount_path, input.folder);
    let facts = ProgramFacts {
        user: input.user,
        slug: input.slug,
        role: input.role,
        port: k.port,
        home: &k.storage.mount_path,
        folder: &folder,
        patch: input.has_patch.then_some(patch_path.as_str()),
        epoch: input.epoch,
        instance_id: input.instance_id,
        handoff: Some(&handoff_path),
    };
    for (variable, value) in facts.environment() {
        let name = variable.name();
        let entry = match variable {
            Variable::Epoch => env_annotation(name, EPOCH_ANNOTATION),
            Variable::InstanceId => env_annotation(name, INSTANCE_ANNOTATION),
            _ => env_value(name, &value),
        };
        env.insert(name.to_owned(), entry);
    }

    let mut mounts = vec![
        data_mount(k, input.slug),
        json!({ "name": "patch", "mountPath": PATCH_DIR, "readOnly": true }),
    ];
    let mut volumes = vec![
        match k.storage.mode {
            StorageMode::PerUser => json!({
                "name": "data",
                "persistentVolumeClaim": { "claimName": names::user_object(input.slug) },
            }),
            StorageMode::Shared => json!({
                "name": "data",
                "persistentVolumeClaim": { "claimName": k.storage.claim },
            }),
        },
        json!({
            "name": "patch",
            "configMap": { "name": names::user_object(input.slug), "optional": true },
        }),
    ];
    if input.role == Role::Watchdog {
        mounts.push(json!({ "name": "handoff", "mountPath": HANDOFF_DIR, "readOnly": true }));
        volumes.push(json!({
            "name": "handoff",
            "configMap": { "name": names::watchdog_config_map(input.slug), "optional": true },
        }));
    }
    if k.security.read_only_root_filesystem {
        mounts.push(json!({ "name": "tmp", "mountPath": "/tmp" }));
        volumes.push(json!({ "name": "tmp", "emptyDir": {} }));
    }

    let mut command: Vec<String> = command.iter().map(|a| template_arg(a)).collect();
    let mut security = container_security(k);
    if let Some((shim_config, shim)) = shim {
        command.splice(0..0, shim_command(shim_config));
        for (var, value) in shim_env(config, &name, input, shim) {
            env.insert(var, value);
        }
        security = shim_security(k);
    }
    let mut main = json!({
        "name": MAIN_CONTAINER,
        "image": k.image,
        "command": command,
        "env": env.into_values().collect::<Vec<_>>(),
        "workingDir": folder,
        "volumeMounts": mounts,
        "securityContext": security,
        // Kubernetes cannot tell stderr from stdout; on a failure its last
        // lines become the exit's message, berth's stderr tail.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    });
    if let Some(policy) = &k.image_pull_policy {
        main["imagePullPolicy"] = json!(policy);
    }
    if !k.resources.requests.is_empty() || !k.resources.limits.is_empty() {
        let mut resources = Map::new();
        if !k.resources.requests.is_empty() {
            resources.insert("requests".into(), quantities(&k.resources.requests));
        }
        if !k.resources.limits.is_empty() {
            resources.insert("limits".into(), quantities(&k.resources.limits));
        }
        main["resources"] = Value::Object(resources);
    }
    if input.role == Role::Main {
        main["ports"] = json!([{ "name": "http", "containerPort": k.port }]);
        if let Some((shim_config, _)) = shim
            && let Some(ports) = main["ports"].as_array_mut()
        {
            ports.push(json!({ "name": SHIM_PORT_NAME, "containerPort": shim_config.port }));
        }
        let probe = match &config.program.readiness {
            Readiness::TokenRegex(_) => None,
            Readiness::Http { path } => {
                Some(json!({ "httpGet": { "path": path, "port": "http" } }))
            }
            Readiness::Tcp => Some(json!({ "tcpSocket": { "port": "http" } })),
        };
        if let Some(mut probe) = probe {
            probe["periodSeconds"] = json!(1);
            probe["failureThreshold"] = json!(1);
            main["readinessProbe"] = probe;
        }
    }
    let mut containers = vec![main];
    if let (Role::Main, Some(files)) = (input.role, &k.file_service) {
        let mut sidecar = json!({
            "name": FILES_CONTAINER,
            "image": files.image,
            "env": [
                env_value(Variable::User.name(), input.user.as_str()),
                env_value(Variable::Slug.name(), input.slug.as_str()),
                env_value(Variable::Port.name(), &files.port.to_string()),
                env_value(Variable::Home.name(), &k.storage.mount_path),
            ],
            "ports": [{ "name": "files", "containerPort": files.port }],
            "volumeMounts": [data_mount(k, input.slug)],
            "securityContext": container_security(k),
        });
        if let Some(command) = &files.command {
            sidecar["command"] = json!(command.iter().map(|a| template_arg(a)).collect::<Vec<_>>());
        }
        containers.push(sidecar);
    }

    let mut spec = extra_pod_spec(k)?;
    let own = json!({
        "containers": containers,
        "volumes": volumes,
        // berth's crash policy and breaker decide restarts (see the crate
        // docs), so the kubelet never restarts a container itself.
        "restartPolicy": "Never",
        "automountServiceAccountToken": false,
        "enableServiceLinks": false,
        "terminationGracePeriodSeconds": config.stop_grace.as_secs().max(1),
        "securityContext": {
            "runAsNonRoot": true,
            "runAsUser": k.security.run_as_user,
            "runAsGroup": k.security.group(),
            "fsGroup": k.security.fs_group(),
            "seccompProfile": { "type": "RuntimeDefault" },
        },
    });
    if let Value::Object(own) = own {
        spec.extend(own);
    }
    if let Some(account) = &k.service_account {
        spec.insert("serviceAccountName".into(), json!(account));
    }
    if !k.node_selector.is_empty() {
        spec.insert("nodeSelector".into(), json!(k.node_selector));
    }
    if !k.tolerations.is_empty() {
        spec.insert("tolerations".into(), json!(k.tolerations));
    }
    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": spec,
    });
    let mut pod: Pod = strict(&pod, "pod")?;
    let hash = template_hash(&pod);
    pod.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(names::TEMPLATE_ANNOTATION.into(), hash);
    Ok(Some(pod))
}

/// A hash of what a pod is made from: its spec, labels and user, not the
/// annotations that change when another replica or epoch takes it over.
pub fn template_hash(pod: &Pod) -> String {
    let mut hasher = Sha256::new();
    let labels = serde_json::to_vec(&pod.metadata.labels).unwrap_or_default();
    let spec = serde_json::to_vec(&pod.spec).unwrap_or_default();
    let user = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(names::USER_ANNOTATION))
        .map(String::as_bytes)
        .unwrap_or_default();
    for part in [&labels[..], &spec[..], user] {
        hasher.update((part.len() as u64).to_le_bytes());
        hasher.update(part);
    }
    hex::encode(&hasher.finalize()[..12])
}

/// The user's headless Service: its DNS name resolves to the main pod
/// once it is ready.
pub fn service(
    config: &KubernetesConfig,
    user: &UserId,
    slug: &Slug,
) -> Result<Service, ConfigError> {
    let mut ports = vec![json!({ "name": "http", "port": config.port, "targetPort": "http" })];
    if let Some(files) = &config.file_service {
        ports.push(json!({ "name": "files", "port": files.port, "targetPort": "files" }));
    }
    if let Some(shim) = &config.shim {
        ports.push(
            json!({ "name": SHIM_PORT_NAME, "port": shim.port, "targetPort": SHIM_PORT_NAME }),
        );
    }
    strict(
        &json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta(config, &names::user_object(slug), user, slug),
            "spec": {
                "clusterIP": "None",
                "selector": names::pod_labels(slug, Role::Main),
                "ports": ports,
            },
        }),
        "service",
    )
}

/// The user's patch, as the file [`patch_file`] in [`PATCH_DIR`]; no key
/// when there is none.
pub fn patch_config_map(
    config: &KubernetesConfig,
    user: &UserId,
    slug: &Slug,
    patch_ext: &str,
    content: Option<&str>,
) -> Result<ConfigMap, ConfigError> {
    let data: BTreeMap<String, &str> = content
        .map(|text| (patch_file(patch_ext), text))
        .into_iter()
        .collect();
    strict(
        &json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta(config, &names::user_object(slug), user, slug),
            "data": data,
        }),
        "configmap",
    )
}

/// A watchdog's handoff (the crashed main's record).
pub fn handoff_config_map(
    config: &KubernetesConfig,
    user: &UserId,
    slug: &Slug,
    handoff: &str,
) -> Result<ConfigMap, ConfigError> {
    strict(
        &json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta(config, &names::watchdog_config_map(slug), user, slug),
            "data": { HANDOFF_KEY: handoff },
        }),
        "configmap",
    )
}

/// The private ranges, and the metadata addresses outside them (Azure's
/// wire server): what `0.0.0.0/0` excepts when private egress is off.
fn private_and_metadata(private: &[&'static str], metadata: &[&'static str]) -> Vec<&'static str> {
    let ranges: Vec<ipnet::IpNet> = private.iter().filter_map(|r| r.parse().ok()).collect();
    let outside = metadata.iter().filter(|m| {
        m.parse::<ipnet::IpNet>()
            .is_ok_and(|m| !ranges.iter().any(|r| r.contains(&m)))
    });
    private.iter().chain(outside).copied().collect()
}

fn ip_block(cidr: &str, except: &[&str]) -> Value {
    if except.is_empty() {
        json!({ "ipBlock": { "cidr": cidr } })
    } else {
        json!({ "ipBlock": { "cidr": cidr, "except": except } })
    }
}

/// The user's NetworkPolicy: ingress only from berth's pods, on the
/// Service's ports. Egress as `policy` says, for networks: under
/// `allow_all` the internet but not private ranges or metadata services
/// (unless `network` allows them), under a confining mode nothing; then
/// each allowed network, on its port (TCP and UDP) or on every port, with
/// the metadata addresses inside it excepted unless allowed; then, when
/// the policy names domains, berth's pods on the egress proxy's port
/// (which reaches those names for the pod); then the cluster's DNS where
/// allowed. Pods reach nothing else, other pods included.
pub fn network_policy(
    config: &KubernetesConfig,
    user: &UserId,
    slug: &Slug,
    policy: &EgressPolicy,
) -> Result<NetworkPolicy, ConfigError> {
    let n = &config.network;
    let from = berth_pods(n);
    let mut ports = vec![json!({ "protocol": "TCP", "port": config.port })];
    if let Some(files) = &config.file_service {
        ports.push(json!({ "protocol": "TCP", "port": files.port }));
    }
    if let Some(shim) = &config.shim {
        ports.push(json!({ "protocol": "TCP", "port": shim.port }));
    }
    let mut egress = Vec::new();
    if !policy.mode.confined() {
        egress.push(json!({ "to": internet(n) }));
    }
    for (port, nets) in policy.networks_by_port() {
        let to: Vec<Value> = nets
            .iter()
            .filter_map(|net| allowed_block(*net, n.allow_metadata_egress))
            .collect();
        if to.is_empty() {
            continue;
        }
        let mut rule = json!({ "to": to });
        if let Some(port) = port {
            rule["ports"] = json!([
                { "protocol": "TCP", "port": port },
                { "protocol": "UDP", "port": port },
            ]);
        }
        egress.push(rule);
    }
    if let Some((_, port)) = n.egress_proxy()
        && policy.needs_proxy()
    {
        egress
            .push(json!({ "to": [berth_pods(n)], "ports": [{ "protocol": "TCP", "port": port }] }));
    }
    if n.allow_dns {
        egress.push(json!({
            "to": [{
                "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": "kube-system" } },
                "podSelector": { "matchLabels": { "k8s-app": "kube-dns" } },
            }],
            "ports": [{ "protocol": "UDP", "port": 53 }, { "protocol": "TCP", "port": 53 }],
        }));
    }
    strict(
        &json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta(config, &names::user_object(slug), user, slug),
            "spec": {
                "podSelector": { "matchLabels": names::user_labels(slug) },
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [{ "from": [from], "ports": ports }],
                "egress": egress,
            },
        }),
        "networkpolicy",
    )
}

/// berth's own pods, as a NetworkPolicy peer.
fn berth_pods(n: &Network) -> Value {
    let mut peer = json!({ "podSelector": { "matchLabels": n.berth_pod_labels } });
    if let Some(ns) = &n.berth_namespace {
        peer["namespaceSelector"] = json!({ "matchLabels": { "kubernetes.io/metadata.name": ns } });
    }
    peer
}

/// The proxy variables of a pod whose `policy` confines it, where berth
/// runs the egress proxy for pods: its URL with `user`'s credential. A
/// pod under `allow_all` goes out directly and gets none. Given to every
/// confined pod, not only one whose policy names domains now, so that a
/// policy changed to allow one applies from the pod's next request.
pub fn egress_proxy_env(
    config: &K8sRuntimeConfig,
    user: &UserId,
    policy: &EgressPolicy,
) -> Vec<(String, String)> {
    let (Some((host, port)), Some(key)) = (
        config.kubernetes.network.egress_proxy(),
        &config.egress_proxy_key,
    ) else {
        return Vec::new();
    };
    if !policy.mode.confined() {
        return Vec::new();
    }
    let credential = key.credential(user);
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    berth_core::egress::proxy_env(&format!(
        "http://{}:{}@{host}:{port}",
        credential.name, credential.password
    ))
}

/// `allow_all`'s destinations: every address but the private ranges and
/// the metadata services, each unless `network` allows it.
fn internet(n: &Network) -> Vec<Value> {
    let (except_v4, except_v6) = match (n.allow_private_egress, n.allow_metadata_egress) {
        (false, _) => (
            private_and_metadata(PRIVATE_V4, METADATA_V4),
            private_and_metadata(PRIVATE_V6, METADATA_V6),
        ),
        (true, false) => (METADATA_V4.to_vec(), METADATA_V6.to_vec()),
        (true, true) => (Vec::new(), Vec::new()),
    };
    let mut to = vec![
        ip_block("0.0.0.0/0", &except_v4),
        ip_block("::/0", &except_v6),
    ];
    if !n.allow_private_egress && n.allow_metadata_egress {
        to.extend(
            METADATA_V4
                .iter()
                .chain(METADATA_V6)
                .map(|c| ip_block(c, &[])),
        );
    }
    to
}

/// An allowed network as a NetworkPolicy peer, with the metadata
/// addresses inside it excepted (as the local guard refuses them before
/// any policy), unless they are allowed; `None` for a network that is
/// all metadata.
fn allowed_block(net: IpNet, metadata_allowed: bool) -> Option<Value> {
    if metadata_allowed {
        return Some(ip_block(&net.to_string(), &[]));
    }
    let metadata = berth_core::egress::metadata();
    if metadata.iter().any(|m| m.contains(&net)) {
        return None;
    }
    let inside: Vec<String> = metadata
        .iter()
        .filter(|m| net.contains(*m))
        .map(ToString::to_string)
        .collect();
    let inside: Vec<&str> = inside.iter().map(String::as_str).collect();
    Some(ip_block(&net.to_string(), &inside))
}

/// The user's own claim (`per_user` storage); `None` in `shared` mode,
/// whose claim the operator made.
pub fn claim(
    config: &KubernetesConfig,
    user: &UserId,
    slug: &Slug,
) -> Result<Option<PersistentVolumeClaim>, ConfigError> {
    if config.storage.mode != StorageMode::PerUser {
        return Ok(None);
    }
    let mut spec = json!({
        "accessModes": ["ReadWriteOnce"],
        "resources": { "requests": { "storage": config.storage.size } },
    });
    if let Some(class) = &config.storage.storage_class {
        spec["storageClassName"] = json!(class);
    }
    strict(
        &json!({
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": meta(config, &names::user_object(slug), user, slug),
            "spec": spec,
        }),
        "persistentvolumeclaim",
    )
    .map(Some)
}

#[cfg(test)]
mod tests;
