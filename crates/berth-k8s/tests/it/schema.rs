//! Every manifest berth generates validates strictly (no unknown fields,
//! every type right) against the official Kubernetes JSON schemas of the
//! oldest and newest API versions berth supports, with PyPI's
//! `kubernetes-validate`, which works offline. `scripts/test` installs it
//! into `target/test-venv`.

use berth_core::program::ProgramSettings;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use berth_core::Readiness;
use berth_core::egress::EgressPolicy;
use berth_core::{Role, UserId};
use berth_k8s::config::{FileService, StorageMode};
use berth_k8s::manifest::{self, PodInput, ShimInput};
use berth_k8s::{K8sRuntimeConfig, KubernetesConfig};
use serde_json::Value;

/// The oldest and newest Kubernetes versions berth supports.
const VERSIONS: [&str; 2] = ["1.33.0", "1.37.0"];

/// Validates `files` with `validator` against every supported version;
/// panics with what it said when one does not validate.
pub fn validate_strictly(validator: &Path, files: &[PathBuf]) {
    for version in VERSIONS {
        let output = Command::new(validator)
            .args(["--strict", "--quiet", "--kubernetes-version", version])
            .args(files)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "manifests invalid for Kubernetes {version}:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

pub fn validator() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("BERTH_KUBERNETES_VALIDATE") {
        return Some(path.into());
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/test-venv/bin/kubernetes-validate");
    if venv.exists() {
        return Some(venv);
    }
    Command::new("kubernetes-validate")
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| "kubernetes-validate".into())
}

/// Configs that between them use every option the manifests have.
fn configs() -> Vec<K8sRuntimeConfig> {
    let base = |k: KubernetesConfig| K8sRuntimeConfig {
        kubernetes: k,
        node: "node-a".into(),
        program: ProgramSettings {
            command: vec![
                "app".into(),
                "--port".into(),
                "{port}".into(),
                "{patch}".into(),
            ],
            env: [("EXTRA".to_owned(), "1".to_owned())].into(),
            readiness: Readiness::Tcp,
            watchdog_command: Some(vec!["repair".into(), "{user}".into()]),
            patch_ext: "toml".into(),
        },
        stop_grace: Duration::from_secs(5),
        egress: Default::default(),
        egress_proxy_key: None,
        shim_key: None,
    };
    let plain = base(KubernetesConfig::with_image("example/app:1"));
    let full: KubernetesConfig = toml::from_str(
        r#"
        namespace = "users"
        image = "registry.example/app@sha256:0123"
        image_pull_policy = "IfNotPresent"
        command = ["app", "serve", "--port={port}", "--base={base_path}"]
        port = 8888
        service_account = "berth-user"
        node_selector = { pool = "users", "kubernetes.io/arch" = "amd64" }
        tolerations = [{ key = "dedicated", operator = "Equal", value = "users", effect = "NoSchedule" }, { operator = "Exists", effect = "NoExecute", tolerationSeconds = 30 }]
        pod_spec = { priorityClassName = "users", runtimeClassName = "gvisor", imagePullSecrets = [{ name = "registry" }], topologySpreadConstraints = [{ maxSkew = 1, topologyKey = "kubernetes.io/hostname", whenUnsatisfiable = "ScheduleAnyway" }] }
        start_timeout_s = 60
        [resources]
        requests = { cpu = "250m", memory = "256Mi" }
        limits = { cpu = "2", memory = "1Gi", "ephemeral-storage" = "2Gi" }
        [storage]
        size = "10Gi"
        storage_class = "fast-ssd"
        mount_path = "/workspace"
        [security]
        run_as_user = 2000
        run_as_group = 3000
        fs_group = 4000
        read_only_root_filesystem = true
        [network]
        berth_pod_labels = { "app.kubernetes.io/name" = "berth", "app.kubernetes.io/component" = "proxy" }
        berth_namespace = "berth-system"
        allow_metadata_egress = true
        [file_service]
        image = "example/files:1"
        command = ["files", "--root={home}", "--port={port}"]
        port = 9000
        "#,
    )
    .unwrap();
    full.validate().unwrap();
    let mut full = base(full);
    full.program.readiness = Readiness::Http {
        path: "/health".into(),
    };
    full.egress = egress(
        "allow_all",
        &["10.1.2.3/32", "fd12::/64", "192.168.5.0/24:8443"],
    );
    let mut shared = base(KubernetesConfig::with_image("example/app:1"));
    shared.kubernetes.storage.mode = StorageMode::Shared;
    shared.kubernetes.storage.claim = Some("berth-data".into());
    shared.kubernetes.network.allow_private_egress = true;
    shared.kubernetes.network.allow_dns = false;
    shared.kubernetes.file_service = Some(FileService {
        image: "f:1".into(),
        command: None,
        port: 8081,
    });
    shared.program.readiness = Readiness::TokenRegex(regex::Regex::new("token=(.*)").unwrap());
    let mut open = base(KubernetesConfig::with_image("example/app:1"));
    open.kubernetes.network.allow_private_egress = true;
    open.kubernetes.network.allow_metadata_egress = true;
    open.egress = egress("allowlist", &["169.254.0.0/16", "[fd00::/8]:443"]);
    let mut confined = base(KubernetesConfig::with_image("example/app:1"));
    confined.egress = egress(
        "allowlist",
        &[
            "10.8.0.0/24",
            "10.9.0.5:5432",
            "169.254.0.0/16",
            "169.254.169.254",
        ],
    );
    let mut proxied = base(KubernetesConfig::with_image("example/app:1"));
    proxied.kubernetes.network.egress_proxy = Some("berth-egress.berth.svc:3128".into());
    proxied.kubernetes.network.berth_namespace = Some("berth-system".into());
    proxied.egress_proxy_key = Some(berth_core::egress::ProxyKey::new(b"secret"));
    proxied.egress = egress("allowlist", &["pypi.org", "*.github.com:22", "10.8.0.0/24"]);
    let mut closed = base(KubernetesConfig::with_image("example/app:1"));
    closed.kubernetes.network.allow_dns = false;
    closed.egress = egress("deny_all", &[]);
    let mut shimmed = base(KubernetesConfig::with_image("example/app:1"));
    shimmed.kubernetes.shim = Some(berth_k8s::config::ShimConfig {
        path: "/usr/local/bin/berth".into(),
        port: 7079,
    });
    shimmed.kubernetes.security.read_only_root_filesystem = true;
    shimmed.shim_key = Some(berth_core::credential::ShimKey::new(b"secret"));
    vec![
        plain, full, shared, open, confined, proxied, closed, shimmed,
    ]
}

fn egress(mode: &str, allow: &[&str]) -> EgressPolicy {
    serde_json::from_value(serde_json::json!({ "mode": mode, "allow": allow })).unwrap()
}

fn ids() -> Vec<String> {
    vec![
        "alice".into(),
        "Alice".into(),
        "a.b@corp.example".into(),
        "x".repeat(128),
        "--x".into(),
        "_u".into(),
        "日本語のユーザー".into(),
        "alice-wd".into(),
    ]
}

/// Every object of every id under every config, as JSON.
fn manifests() -> Vec<(String, Value)> {
    let mut all = Vec::new();
    for (c, config) in configs().iter().enumerate() {
        let k = &config.kubernetes;
        for raw in ids() {
            let user = UserId::parse(&raw).unwrap();
            let slug = user.slug();
            let mut add =
                |what: &str, value: Value| all.push((format!("{c}-{what}-{slug}"), value));
            let mut env = vec![("FROM_CONTROLLER".to_owned(), "x".to_owned())];
            env.extend(manifest::egress_proxy_env(config, &user, &config.egress));
            for role in [Role::Main, Role::Watchdog] {
                let input = PodInput {
                    user: &user,
                    slug: &slug,
                    role,
                    instance_id: "0193-instance",
                    epoch: 12,
                    folder: "projects/a b",
                    node: "node-a",
                    patch_hash: &manifest::patch_hash(Some("a = 1")),
                    has_patch: true,
                    env: &env,
                    shim: k.shim.as_ref().map(|_| ShimInput {
                        nonce: "0f1e2d3c",
                        fence_ms: Some(3000),
                    }),
                };
                let pod = manifest::pod(config, &input).unwrap().unwrap();
                add(&format!("pod-{role}"), serde_json::to_value(pod).unwrap());
            }
            if k.shim.is_some() {
                let pod = berth_k8s::names::pod(&slug, Role::Main);
                let secret = manifest::shim_secret(k, &user, &slug, &pod, "c0ffee").unwrap();
                add("shim-secret", serde_json::to_value(secret).unwrap());
            }
            add(
                "service",
                serde_json::to_value(manifest::service(k, &user, &slug).unwrap()).unwrap(),
            );
            add(
                "patch",
                serde_json::to_value(
                    manifest::patch_config_map(k, &user, &slug, "toml", Some("a = 1\n")).unwrap(),
                )
                .unwrap(),
            );
            add(
                "nopatch",
                serde_json::to_value(
                    manifest::patch_config_map(k, &user, &slug, "toml", None).unwrap(),
                )
                .unwrap(),
            );
            add(
                "handoff",
                serde_json::to_value(
                    manifest::handoff_config_map(k, &user, &slug, "{\"exit_code\":3}").unwrap(),
                )
                .unwrap(),
            );
            add(
                "policy",
                serde_json::to_value(
                    manifest::network_policy(k, &user, &slug, &config.egress).unwrap(),
                )
                .unwrap(),
            );
            if let Some(claim) = manifest::claim(k, &user, &slug).unwrap() {
                add("claim", serde_json::to_value(claim).unwrap());
            }
        }
    }
    all
}

#[test]
fn names_are_valid_and_unique_per_kind() {
    let mut seen = HashSet::new();
    // `nopatch` is the other form of `patch`, the same object.
    for (what, value) in manifests()
        .into_iter()
        .filter(|(w, _)| !w.contains("-nopatch-"))
    {
        let name = value["metadata"]["name"].as_str().unwrap().to_owned();
        let kind = value["kind"].as_str().unwrap().to_owned();
        assert!(
            name.len() <= 63 && name.starts_with("berth-"),
            "{what}: {name}"
        );
        assert!(berth_k8s::names::is_dns_label(&name), "{what}: {name}");
        let config = what.split('-').next().unwrap().to_owned();
        assert!(
            seen.insert((config, kind, name.clone())),
            "{what}: {name} twice"
        );
        for (key, label) in value["metadata"]["labels"].as_object().unwrap() {
            assert!(
                berth_k8s::names::is_label_value(label.as_str().unwrap()),
                "{what}: {key}"
            );
        }
    }
}

#[test]
fn every_manifest_validates_strictly_against_the_official_schemas() {
    let Some(validator) = validator() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "kubernetes-validate is not installed; scripts/test installs it"
        );
        println!(
            "SKIPPED every_manifest_validates_strictly_against_the_official_schemas: \
             kubernetes-validate is not installed (pip install kubernetes-validate)"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for (what, value) in manifests() {
        let path = dir.path().join(format!("{what}.json"));
        std::fs::write(&path, serde_json::to_string_pretty(&value).unwrap()).unwrap();
        files.push(path);
    }
    assert!(files.len() > 100, "{} manifests", files.len());
    validate_strictly(&validator, &files);
    // The validator must be able to fail: an unknown field is refused.
    let bad = dir.path().join("bad.json");
    let mut pod = manifests()
        .into_iter()
        .find(|(w, _)| w.contains("pod-main"))
        .unwrap()
        .1;
    pod["spec"]["containers"][0]["securityContxt"] = serde_json::json!({});
    std::fs::write(&bad, pod.to_string()).unwrap();
    let output = Command::new(&validator)
        .args(["--strict", "--quiet", "--kubernetes-version", VERSIONS[0]])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!output.status.success(), "an unknown field passed");
}
