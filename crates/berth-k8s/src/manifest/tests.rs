use berth_core::program::ProgramSettings;
use std::time::Duration;

use berth_core::{Role, UserId};
use serde_json::{Value, json};

use super::*;
use crate::config::{FileService, K8sRuntimeConfig, KubernetesConfig, StorageMode};
use berth_core::Readiness;

pub(crate) fn runtime_config(k: KubernetesConfig) -> K8sRuntimeConfig {
    K8sRuntimeConfig {
        kubernetes: k,
        node: "node-a".into(),
        program: ProgramSettings {
            command: vec!["app".into(), "--port".into(), "{port}".into()],
            env: BTreeMap::from([("EXTRA".to_owned(), "1".to_owned())]),
            readiness: Readiness::Tcp,
            watchdog_command: Some(vec!["repair".into()]),
            patch_ext: "toml".into(),
        },
        stop_grace: Duration::from_secs(5),
        egress: EgressPolicy::default(),
        egress_proxy_key: None,
        shim_key: None,
    }
}

fn input<'a>(user: &'a UserId, slug: &'a berth_core::Slug, role: Role) -> PodInput<'a> {
    PodInput {
        user,
        slug,
        role,
        instance_id: "i-1",
        epoch: 3,
        folder: "proj/a",
        node: "node-a",
        patch_hash: "ph",
        has_patch: true,
        env: &[],
        shim: None,
    }
}

fn pod_json(config: &K8sRuntimeConfig, user: &str, role: Role) -> Value {
    let user = UserId::parse(user).unwrap();
    let slug = user.slug();
    let pod = pod(config, &input(&user, &slug, role)).unwrap().unwrap();
    serde_json::to_value(pod).unwrap()
}

fn env_of(container: &Value, name: &str) -> Value {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
        .cloned()
        .unwrap_or(Value::Null)
}

#[test]
fn a_pod_runs_non_root_without_privileges_or_a_token() {
    let pod = pod_json(
        &runtime_config(KubernetesConfig::with_image("app:1")),
        "alice",
        Role::Main,
    );
    let spec = &pod["spec"];
    assert_eq!(spec["restartPolicy"], "Never");
    assert_eq!(spec["automountServiceAccountToken"], false);
    assert_eq!(spec["enableServiceLinks"], false);
    let security = &spec["securityContext"];
    assert_eq!(security["runAsNonRoot"], true);
    assert_eq!(security["runAsUser"], 1000);
    assert_eq!(security["runAsGroup"], 1000);
    assert_eq!(security["fsGroup"], 1000);
    assert_eq!(security["seccompProfile"]["type"], "RuntimeDefault");
    let main = &spec["containers"][0];
    assert_eq!(main["name"], "main");
    assert_eq!(
        main["securityContext"]["capabilities"]["drop"],
        json!(["ALL"])
    );
    assert_eq!(main["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(main["securityContext"]["runAsNonRoot"], true);
    assert_eq!(main["terminationMessagePolicy"], "FallbackToLogsOnError");
    assert_eq!(spec["containers"].as_array().unwrap().len(), 1);
}

#[test]
fn a_pod_is_named_labelled_and_annotated_from_the_slug_and_the_raw_id() {
    let config = runtime_config(KubernetesConfig::with_image("app:1"));
    let raw = "A.B@corp.example";
    let slug = UserId::parse(raw).unwrap().slug();
    let pod = pod_json(&config, raw, Role::Main);
    let meta = &pod["metadata"];
    assert_eq!(meta["name"], format!("berth-{slug}"));
    assert_eq!(meta["namespace"], "berth");
    assert_eq!(meta["labels"]["app.kubernetes.io/managed-by"], "berth");
    assert_eq!(meta["labels"][names::SLUG_LABEL], slug.as_str());
    assert_eq!(meta["labels"][names::ROLE_LABEL], "main");
    assert_eq!(meta["annotations"][names::USER_ANNOTATION], raw);
    assert_eq!(meta["annotations"][names::EPOCH_ANNOTATION], "3");
    assert_eq!(meta["annotations"][names::INSTANCE_ANNOTATION], "i-1");
    assert_eq!(meta["annotations"][names::NODE_ANNOTATION], "node-a");
    assert_eq!(meta["finalizers"], json!([names::FINALIZER]));
    // The raw id is no name and no label, anywhere.
    for value in meta["labels"].as_object().unwrap().values() {
        assert_ne!(value, raw);
    }
    let dog = pod_json(&config, raw, Role::Watchdog);
    assert_eq!(dog["metadata"]["name"], format!("berth-{slug}--wd"));
    assert_eq!(dog["metadata"]["labels"][names::ROLE_LABEL], "watchdog");
}

#[test]
fn the_command_refers_to_the_kubelets_variables() {
    let mut k = KubernetesConfig::with_image("app:1");
    k.command = Some(vec![
        "app".into(),
        "--port={port}".into(),
        "{patch}".into(),
        "{folder}".into(),
        "{unknown}".into(),
        "{user}{port".into(),
    ]);
    let pod = pod_json(&runtime_config(k), "alice", Role::Main);
    let main = &pod["spec"]["containers"][0];
    assert_eq!(
        main["command"],
        json!([
            "app",
            "--port=$(BERTH_PORT)",
            "$(BERTH_PATCH)",
            "$(BERTH_FOLDER)",
            "{unknown}",
            "$(BERTH_USER){port"
        ])
    );
    assert_eq!(env_of(main, "BERTH_PORT")["value"], "8080");
    assert_eq!(env_of(main, "BERTH_USER")["value"], "alice");
    assert_eq!(
        env_of(main, "BERTH_PATCH")["value"],
        "/berth/patch/main.toml"
    );
    assert_eq!(env_of(main, "BERTH_BASE_PATH")["value"], "/u/alice/");
    assert_eq!(env_of(main, "EXTRA")["value"], "1");
    assert_eq!(
        env_of(main, "BERTH_EPOCH")["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.annotations['berth.dev/epoch']"
    );
    // {folder} and the working directory are one absolute path.
    assert_eq!(main["workingDir"], "/home/berth/proj/a");
    assert_eq!(env_of(main, "BERTH_FOLDER")["value"], "/home/berth/proj/a");
    assert_eq!(
        main["ports"],
        json!([{ "name": "http", "containerPort": 8080 }])
    );
    assert_eq!(main["readinessProbe"]["tcpSocket"]["port"], "http");
}

#[test]
fn a_configured_variable_cannot_spoof_berths() {
    let mut config = runtime_config(KubernetesConfig::with_image("app:1"));
    config
        .program
        .env
        .insert("BERTH_USER".into(), "mallory".into());
    let pod = pod_json(&config, "alice", Role::Main);
    let main = &pod["spec"]["containers"][0];
    let users: Vec<&Value> = main["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "BERTH_USER")
        .collect();
    assert_eq!(users, [&json!({ "name": "BERTH_USER", "value": "alice" })]);
}

#[test]
fn readiness_decides_the_probe() {
    let mut config = runtime_config(KubernetesConfig::with_image("app:1"));
    config.program.readiness = Readiness::TokenRegex(regex::Regex::new("token=(.*)").unwrap());
    let pod = pod_json(&config, "alice", Role::Main);
    assert_eq!(pod["spec"]["containers"][0]["readinessProbe"], Value::Null);
    config.program.readiness = Readiness::Http {
        path: "/health".into(),
    };
    let pod = pod_json(&config, "alice", Role::Main);
    assert_eq!(
        pod["spec"]["containers"][0]["readinessProbe"]["httpGet"],
        json!({ "path": "/health", "port": "http" })
    );
}

#[test]
fn storage_is_a_claim_per_user_or_a_subpath_of_a_shared_one() {
    let k = KubernetesConfig::with_image("app:1");
    let alice = UserId::parse("alice").unwrap();
    let pod = pod_json(&runtime_config(k.clone()), "alice", Role::Main);
    assert_eq!(
        pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"],
        "berth-alice"
    );
    assert_eq!(
        pod["spec"]["containers"][0]["volumeMounts"][0],
        json!({ "name": "data", "mountPath": "/home/berth" })
    );
    let claim = claim(&k, &alice, &alice.slug()).unwrap().unwrap();
    let claim = serde_json::to_value(claim).unwrap();
    assert_eq!(claim["metadata"]["name"], "berth-alice");
    assert_eq!(claim["spec"]["resources"]["requests"]["storage"], "1Gi");
    assert_eq!(claim["spec"]["accessModes"], json!(["ReadWriteOnce"]));

    let mut shared = k;
    shared.storage.mode = StorageMode::Shared;
    shared.storage.claim = Some("berth-data".into());
    assert!(
        super::claim(&shared, &alice, &alice.slug())
            .unwrap()
            .is_none()
    );
    let pod = pod_json(&runtime_config(shared), "alice", Role::Main);
    assert_eq!(
        pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"],
        "berth-data"
    );
    assert_eq!(
        pod["spec"]["containers"][0]["volumeMounts"][0]["subPath"],
        "users/alice"
    );
}

#[test]
fn the_watchdog_gets_its_handoff_and_no_port() {
    let pod = pod_json(
        &runtime_config(KubernetesConfig::with_image("app:1")),
        "alice",
        Role::Watchdog,
    );
    let main = &pod["spec"]["containers"][0];
    assert_eq!(main["command"], json!(["repair"]));
    assert_eq!(main["ports"], Value::Null);
    assert_eq!(
        env_of(main, "BERTH_HANDOFF")["value"],
        "/berth/handoff/handoff.json"
    );
    assert!(
        pod["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["configMap"]["name"] == "berth-alice--wd")
    );
    let mut config = runtime_config(KubernetesConfig::with_image("app:1"));
    config.program.watchdog_command = None;
    let alice = UserId::parse("alice").unwrap();
    let slug = alice.slug();
    assert!(
        super::pod(&config, &input(&alice, &slug, Role::Watchdog))
            .unwrap()
            .is_none()
    );
}

#[test]
fn the_file_service_is_a_sidecar_behind_the_same_service() {
    let mut k = KubernetesConfig::with_image("app:1");
    k.file_service = Some(FileService {
        image: "files:1".into(),
        command: Some(vec!["serve".into(), "--port={port}".into()]),
        port: 8081,
    });
    let pod = pod_json(&runtime_config(k.clone()), "alice", Role::Main);
    let files = &pod["spec"]["containers"][1];
    assert_eq!(files["name"], "files");
    assert_eq!(files["command"], json!(["serve", "--port=$(BERTH_PORT)"]));
    assert_eq!(env_of(files, "BERTH_PORT")["value"], "8081");
    assert_eq!(
        files["securityContext"]["capabilities"]["drop"],
        json!(["ALL"])
    );
    let alice = UserId::parse("alice").unwrap();
    let svc = serde_json::to_value(service(&k, &alice, &alice.slug()).unwrap()).unwrap();
    assert_eq!(svc["spec"]["ports"][1]["name"], "files");
    let dog = pod_json(&runtime_config(k), "alice", Role::Watchdog);
    assert_eq!(dog["spec"]["containers"].as_array().unwrap().len(), 1);
}

#[test]
fn placement_and_extra_fields_are_merged() {
    let k: KubernetesConfig = toml::from_str(
        r#"
        image = "app:1"
        service_account = "berth-user"
        node_selector = { pool = "users" }
        tolerations = [{ key = "dedicated", operator = "Equal", value = "users", effect = "NoSchedule" }]
        pod_spec = { priorityClassName = "users", runtimeClassName = "gvisor" }
        resources = { requests = { cpu = "100m" }, limits = { memory = "1Gi" } }
        "#,
    )
    .unwrap();
    k.validate().unwrap();
    let pod = pod_json(&runtime_config(k), "alice", Role::Main);
    let spec = &pod["spec"];
    assert_eq!(spec["serviceAccountName"], "berth-user");
    assert_eq!(spec["automountServiceAccountToken"], false);
    assert_eq!(spec["nodeSelector"], json!({ "pool": "users" }));
    assert_eq!(spec["tolerations"][0]["key"], "dedicated");
    assert_eq!(spec["priorityClassName"], "users");
    assert_eq!(spec["runtimeClassName"], "gvisor");
    assert_eq!(
        spec["containers"][0]["resources"]["limits"]["memory"],
        "1Gi"
    );
    assert_eq!(
        spec["containers"][0]["resources"]["requests"]["cpu"],
        "100m"
    );
}

#[test]
fn the_template_hash_ignores_who_manages_the_pod() {
    let config = runtime_config(KubernetesConfig::with_image("app:1"));
    let alice = UserId::parse("alice").unwrap();
    let slug = alice.slug();
    let a = pod(&config, &input(&alice, &slug, Role::Main))
        .unwrap()
        .unwrap();
    let mut other = input(&alice, &slug, Role::Main);
    other.epoch = 9;
    other.instance_id = "i-2";
    other.node = "node-b";
    other.patch_hash = "other";
    let b = pod(&config, &other).unwrap().unwrap();
    let hash =
        |p: &Pod| p.metadata.annotations.as_ref().unwrap()[names::TEMPLATE_ANNOTATION].clone();
    assert_eq!(hash(&a), hash(&b));
    assert_eq!(hash(&a), template_hash(&a));
    let mut newer = config.clone();
    newer.kubernetes.image = "app:2".into();
    let c = pod(&newer, &input(&alice, &slug, Role::Main))
        .unwrap()
        .unwrap();
    assert_ne!(hash(&a), hash(&c));
    let bob = UserId::parse("bob").unwrap();
    let bob_slug = bob.slug();
    let d = pod(&config, &input(&bob, &bob_slug, Role::Main))
        .unwrap()
        .unwrap();
    assert_ne!(hash(&a), hash(&d));
}

#[test]
fn the_service_is_headless_and_selects_the_main_pod() {
    let k = KubernetesConfig::with_image("app:1");
    let alice = UserId::parse("alice").unwrap();
    let svc = serde_json::to_value(service(&k, &alice, &alice.slug()).unwrap()).unwrap();
    assert_eq!(svc["metadata"]["name"], "berth-alice");
    assert_eq!(svc["spec"]["clusterIP"], "None");
    assert_eq!(
        svc["spec"]["selector"],
        json!({ "app.kubernetes.io/managed-by": "berth", "berth.dev/slug": "alice", "berth.dev/role": "main" })
    );
    assert_eq!(
        svc["spec"]["ports"],
        json!([{ "name": "http", "port": 8080, "targetPort": "http" }])
    );
}

#[test]
fn the_patch_is_a_key_of_the_users_config_map() {
    let k = KubernetesConfig::with_image("app:1");
    let alice = UserId::parse("alice").unwrap();
    let cm = patch_config_map(&k, &alice, &alice.slug(), "toml", Some("a = 1")).unwrap();
    assert_eq!(cm.data.unwrap()["main.toml"], "a = 1");
    let cm = patch_config_map(&k, &alice, &alice.slug(), "toml", None).unwrap();
    assert!(cm.data.unwrap_or_default().is_empty());
    assert_ne!(patch_hash(Some("")), patch_hash(None));
    let handoff = handoff_config_map(&k, &alice, &alice.slug(), "{}").unwrap();
    assert_eq!(handoff.metadata.name.as_deref(), Some("berth-alice--wd"));
}

fn policy(k: &KubernetesConfig) -> Value {
    policy_under(k, &EgressPolicy::default())
}

fn policy_under(k: &KubernetesConfig, egress: &EgressPolicy) -> Value {
    let alice = UserId::parse("alice").unwrap();
    serde_json::to_value(network_policy(k, &alice, &alice.slug(), egress).unwrap()).unwrap()
}

fn egress_policy(mode: &str, allow: &[&str]) -> EgressPolicy {
    serde_json::from_value(json!({ "mode": mode, "allow": allow })).unwrap()
}

fn excepts(policy: &Value, cidr: &str) -> Vec<String> {
    let to = policy["spec"]["egress"][0]["to"].as_array().unwrap();
    let block = to.iter().find(|p| p["ipBlock"]["cidr"] == cidr).unwrap();
    serde_json::from_value(block["ipBlock"]["except"].clone()).unwrap_or_default()
}

#[test]
fn ingress_comes_only_from_berths_pods() {
    let mut k = KubernetesConfig::with_image("app:1");
    let p = policy(&k);
    assert_eq!(
        p["spec"]["podSelector"]["matchLabels"],
        json!({ "app.kubernetes.io/managed-by": "berth", "berth.dev/slug": "alice" })
    );
    assert_eq!(p["spec"]["policyTypes"], json!(["Ingress", "Egress"]));
    let ingress = p["spec"]["ingress"].as_array().unwrap();
    assert_eq!(ingress.len(), 1);
    assert_eq!(
        ingress[0]["from"],
        json!([{ "podSelector": { "matchLabels": { "app.kubernetes.io/name": "berth" } } }])
    );
    assert_eq!(
        ingress[0]["ports"],
        json!([{ "protocol": "TCP", "port": 8080 }])
    );
    k.network.berth_namespace = Some("berth-system".into());
    let p = policy(&k);
    assert_eq!(
        p["spec"]["ingress"][0]["from"][0]["namespaceSelector"],
        json!({ "matchLabels": { "kubernetes.io/metadata.name": "berth-system" } })
    );
}

#[test]
fn egress_avoids_private_ranges_and_metadata_unless_configured() {
    let mut k = KubernetesConfig::with_image("app:1");
    let p = policy(&k);
    // Azure's wire server is the one metadata address outside them.
    let mut refused_v4 = PRIVATE_V4.to_vec();
    refused_v4.push("168.63.129.16/32");
    assert_eq!(excepts(&p, "0.0.0.0/0"), refused_v4);
    assert_eq!(excepts(&p, "::/0"), PRIVATE_V6);
    // The other metadata addresses are inside the excepted ranges.
    for (metadata, range) in [
        ("169.254.169.254/32", "169.254.0.0/16"),
        ("100.100.100.200/32", "100.64.0.0/10"),
        ("fd00:ec2::254/128", "fc00::/7"),
    ] {
        let metadata: ipnet::IpNet = metadata.parse().unwrap();
        let range: ipnet::IpNet = range.parse().unwrap();
        assert!(range.contains(&metadata));
    }
    assert_eq!(
        p["spec"]["egress"][1]["ports"][0],
        json!({ "protocol": "UDP", "port": 53 })
    );

    k.network.allow_private_egress = true;
    let p = policy(&k);
    assert_eq!(excepts(&p, "0.0.0.0/0"), METADATA_V4);
    assert_eq!(excepts(&p, "::/0"), METADATA_V6);

    k.network.allow_metadata_egress = true;
    let p = policy(&k);
    assert!(excepts(&p, "0.0.0.0/0").is_empty());

    k.network.allow_private_egress = false;
    k.network.allow_dns = false;
    let p = policy_under(&k, &egress_policy("allow_all", &["10.1.2.3"]));
    assert_eq!(excepts(&p, "0.0.0.0/0"), refused_v4);
    let to = p["spec"]["egress"][0]["to"].as_array().unwrap();
    for cidr in ["169.254.169.254/32", "100.100.100.200/32"] {
        assert!(to.iter().any(|t| t["ipBlock"]["cidr"] == cidr), "{cidr}");
    }
    assert_eq!(
        p["spec"]["egress"][1],
        json!({ "to": [{ "ipBlock": { "cidr": "10.1.2.3/32" } }] })
    );
    assert_eq!(p["spec"]["egress"].as_array().unwrap().len(), 2);
}

#[test]
fn a_confining_policy_reaches_only_its_networks_on_their_ports_and_never_metadata() {
    let k = KubernetesConfig::with_image("app:1");
    let allow = [
        "10.8.0.0/24",
        "10.9.0.5:5432",
        "[fd00::/8]:443",
        "169.254.0.0/16",
        "169.254.169.254",
    ];
    let p = policy_under(&k, &egress_policy("allowlist", &allow));
    let egress = p["spec"]["egress"].as_array().unwrap();
    // No internet rule: what is allowed, then the cluster's DNS.
    assert_eq!(
        egress[0],
        json!({ "to": [
            { "ipBlock": { "cidr": "10.8.0.0/24" } },
            { "ipBlock": { "cidr": "169.254.0.0/16", "except": ["169.254.169.254/32", "169.254.170.2/32"] } },
        ] })
    );
    assert_eq!(
        egress[1],
        json!({
            "to": [{ "ipBlock": { "cidr": "fd00::/8", "except": ["fd00:ec2::254/128"] } }],
            "ports": [{ "protocol": "TCP", "port": 443 }, { "protocol": "UDP", "port": 443 }],
        })
    );
    assert_eq!(
        egress[2],
        json!({
            "to": [{ "ipBlock": { "cidr": "10.9.0.5/32" } }],
            "ports": [{ "protocol": "TCP", "port": 5432 }, { "protocol": "UDP", "port": 5432 }],
        })
    );
    assert_eq!(
        egress[3]["ports"][0],
        json!({ "protocol": "UDP", "port": 53 })
    );
    assert_eq!(egress.len(), 4, "{egress:#?}");

    // Nothing allowed: the cluster's DNS, or with it refused, no way out.
    let mut k = k;
    k.network.allow_dns = false;
    let p = policy_under(&k, &egress_policy("deny_all", &[]));
    assert_eq!(p["spec"]["egress"], json!([]));
    assert_eq!(p["spec"]["policyTypes"], json!(["Ingress", "Egress"]));
}

#[test]
fn a_confined_pod_reaches_named_hosts_only_through_the_egress_proxy_with_its_credential() {
    let mut k = KubernetesConfig::with_image("app:1");
    k.network.egress_proxy = Some("berth-egress.berth.svc:3128".into());
    let mut config = runtime_config(k.clone());
    let key = berth_core::egress::ProxyKey::new(b"a cluster secret for the test");
    config.egress_proxy_key = Some(key.clone());
    let alice = UserId::parse("alice").unwrap();
    let named = egress_policy("allowlist", &["pypi.org", "10.8.0.0/24"]);

    // The NetworkPolicy lets it reach berth's pods on the proxy's port.
    let p = policy_under(&k, &named);
    let egress = p["spec"]["egress"].as_array().unwrap();
    assert_eq!(
        egress[1],
        json!({
            "to": [{ "podSelector": { "matchLabels": { "app.kubernetes.io/name": "berth" } } }],
            "ports": [{ "protocol": "TCP", "port": 3128 }],
        })
    );
    assert_eq!(egress.len(), 3, "{egress:#?}");

    // Its proxy variables carry its user's credential, which the proxy
    // takes for alice's and nobody else's.
    let env = egress_proxy_env(&config, &alice, &named);
    let url = env
        .iter()
        .find(|(k, _)| k == "HTTPS_PROXY")
        .map(|(_, v)| v.clone())
        .unwrap();
    let (userinfo, host) = url
        .strip_prefix("http://")
        .unwrap()
        .split_once('@')
        .unwrap();
    assert_eq!(host, "berth-egress.berth.svc:3128");
    let (name, password) = userinfo.split_once(':').unwrap();
    assert_eq!(key.verify(name, password), Some(alice.clone()));
    assert!(
        env.iter()
            .any(|(k, v)| k == "no_proxy" && v.contains("127.0.0.1"))
    );

    // A confined pod without names gets the variables too (a name allowed
    // later applies at its next request), but no way to the proxy yet.
    let networks = egress_policy("allowlist", &["10.8.0.0/24"]);
    assert!(!egress_proxy_env(&config, &alice, &networks).is_empty());
    let p = policy_under(&k, &networks);
    assert!(!p.to_string().contains("3128"), "{p}");
    // A pod under allow_all goes out directly; without the proxy, nobody
    // gets the variables.
    assert!(egress_proxy_env(&config, &alice, &EgressPolicy::default()).is_empty());
    config.kubernetes.network.egress_proxy = None;
    assert!(egress_proxy_env(&config, &alice, &named).is_empty());
}
