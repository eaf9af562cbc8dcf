//! What `deploy/kubernetes/` ships: every manifest validates strictly
//! against the official schemas, the kustomization names every one, and
//! the Role grants exactly what the runtime asks of the API server. That
//! last is shown on the API-server **double**, which records every kind of
//! request it answers: berth's whole lifecycle of a user's pod (start,
//! logs, a policy change, a Service changed behind its back, a restart
//! with a new patch, a stop, an orphan removed by a restarted controller)
//! must need no rule the Role lacks and leave none unused.

use crate::schema::{validate_strictly, validator};
use crate::support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::controller::{Env, running};
use berth_core::policy::CrashPolicy;
use berth_core::runtime::Runtime;
use berth_core::{LaunchRequest, Role, Spawner, Traffic};
use berth_k8s::names;
use berth_k8s::testing::{ApiUse, Kind};
use support::*;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes")
}

/// The manifests: every YAML file but the kustomization.
fn manifests() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "yaml")
                && p.file_name().is_some_and(|n| n != "kustomization.yaml")
        })
        .collect();
    files.sort();
    files
}

#[test]
fn every_deploy_manifest_validates_strictly_and_the_kustomization_names_each() {
    let files = manifests();
    assert!(files.len() >= 8, "{files:?}");
    let kustomization = std::fs::read_to_string(deploy_dir().join("kustomization.yaml")).unwrap();
    for file in &files {
        let name = file.file_name().unwrap().to_str().unwrap();
        assert!(
            kustomization.contains(&format!("  - {name}\n")),
            "kustomization.yaml does not name {name}"
        );
    }
    let Some(validator) = validator() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "kubernetes-validate is not installed; scripts/test installs it"
        );
        println!("SKIPPED deploy manifests: kubernetes-validate is not installed");
        return;
    };
    validate_strictly(&validator, &files);
}

/// The Role's rules, one `(group, resource, verb)` each. `role.yaml` writes
/// each of a rule's lists as a JSON array on one line, which this reads;
/// another layout finds no rule and fails here, never passes.
fn granted() -> BTreeSet<ApiUse> {
    let text = std::fs::read_to_string(deploy_dir().join("role.yaml")).unwrap();
    let list = |line: &str, key: &str| -> Option<Vec<String>> {
        let rest = line.trim().trim_start_matches("- ").strip_prefix(key)?;
        Some(serde_json::from_str(rest.trim()).unwrap())
    };
    let (mut groups, mut resources) = (Vec::new(), Vec::new());
    let mut rules = BTreeSet::new();
    for line in text.lines() {
        if let Some(g) = list(line, "apiGroups:") {
            groups = g;
        } else if let Some(r) = list(line, "resources:") {
            resources = r;
        } else if let Some(verbs) = list(line, "verbs:") {
            for g in &groups {
                for r in &resources {
                    for v in &verbs {
                        rules.insert((g.clone(), r.clone(), v.clone()));
                    }
                }
            }
        }
    }
    assert!(!rules.is_empty(), "no rule read from role.yaml");
    rules
}

/// A stand-in for berth's shim in the pod (`PATH shim pod -- PROGRAM…`):
/// it runs the program without the shim's environment, and answers each
/// connection to its control port with a hello once it has read a line.
const STAND_IN_SHIM: &str = r#"#!/usr/bin/env python3
import json, os, socket, subprocess, sys, threading
host, port = os.environ["BERTH_SHIM_CONTROL"].rsplit(":", 1)
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind((host, int(port)))
listener.listen()
env = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_SHIM_")}
program = subprocess.Popen(sys.argv[4:], env=env)
state = {"instance_id": "", "user": "", "role": "main", "epoch": 0, "socket_path": "",
         "shim_pid": os.getpid(), "pid": program.pid, "pid_start": 0,
         "stderr_tail": "", "frozen": False}
def serve():
    while True:
        conn, _ = listener.accept()
        conn.makefile().readline()
        conn.sendall((json.dumps({"event": "hello", "state": state}) + "\n").encode())
threading.Thread(target=serve, daemon=True).start()
sys.exit(program.wait())
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_role_grants_exactly_what_berths_lifecycle_of_a_pod_asks_for() {
    let env = Env::new().await;
    let double = &env.double;
    let command = sh(&format!(
        "echo ready token={}; exec sleep 1000",
        berth_core::runtime_contract::TOKEN
    ));
    // With the shim, as the shipped config shows it. This crate's tests
    // have no berth binary, so a script stands in for the shim (a test
    // double, named so): it runs the program and greets berth's link. What
    // counts here is what the runtime asks of the API server (the pod's
    // Secret among it).
    let scratch = tempfile::tempdir().unwrap();
    let stand_in = scratch.path().join("shim");
    std::fs::write(&stand_in, STAND_IN_SHIM).unwrap();
    std::fs::set_permissions(
        &stand_in,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let mut shimmed = config(command.clone(), token_regex(), "node-a");
    shimmed.kubernetes.shim = Some(berth_k8s::config::ShimConfig {
        path: stand_in.to_str().unwrap().to_owned(),
        port: 7079,
    });
    shimmed.shim_key = Some(berth_core::credential::ShimKey::new(b"cluster secret"));
    let first = env.controller_with(shimmed, CrashPolicy::default()).await;
    // A runtime beside the controller's (its logs, then an orphan's pod):
    // what it asks counts as berth's too.
    let other = runtime(double, config(command.clone(), token_regex(), "node-a"));
    let alice = user("alice");
    let with_patch = |patch: &str| LaunchRequest {
        patch: Some(patch.to_owned()),
        ..LaunchRequest::default()
    };

    first.launch(&alice, with_patch("a = 1")).await.unwrap();
    running(&first, &alice).await;
    other.logs(&alice.slug(), Role::Main, 10).await.unwrap();
    let closed =
        serde_json::from_value(serde_json::json!({"mode": "deny_all", "allow": []})).unwrap();
    first.set_egress(&alice, Some(&closed)).await.unwrap();
    // Another client changes her Service; her next start puts it back.
    let service = names::user_object(&alice.slug());
    double.patch_behind_back(
        Kind::Service,
        NS,
        &service,
        &serde_json::json!({ "spec": { "ports": [{ "port": 1, "protocol": "TCP" }] } }),
    );
    first.stop(&alice).await.unwrap();
    eventually("alice's pod to go", || {
        double.object(Kind::Pod, NS, &service).is_none()
    })
    .await;
    first.launch(&alice, with_patch("a = 2")).await.unwrap();
    running(&first, &alice).await;
    let ports = double.object(Kind::Service, NS, &service).unwrap()["spec"]["ports"].clone();
    assert_ne!(ports[0]["port"], 1, "{ports}");
    first.teardown().await;

    // A pod no record knows, which a restarted controller removes.
    let zed = user("zed");
    let mut orphan = other
        .start(berth_core::runtime_contract::spec(&zed, "stray"))
        .await
        .unwrap();
    ready(&mut orphan).await;
    other.shutdown().await;
    let second = env.controller(command, CrashPolicy::default()).await;
    eventually("the orphan to go", || {
        double
            .object(Kind::Pod, NS, &names::user_object(&zed.slug()))
            .is_none()
    })
    .await;
    second.stop(&alice).await.unwrap();
    second.teardown().await;

    let used = double.api_use();
    let granted = granted();
    let missing: Vec<&ApiUse> = used.difference(&granted).collect();
    let unused: Vec<&ApiUse> = granted.difference(&used).collect();
    assert!(
        missing.is_empty() && unused.is_empty(),
        "used but not granted: {missing:?}; granted but unused: {unused:?}"
    );
}
