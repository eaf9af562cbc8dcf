//! What the Kubernetes runtime's tests share: a runtime over the API
//! server **double** (`berth_k8s::testing::ApiServerDouble`), whose
//! stand-in kubelet runs each pod's command as a real local process.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use berth_core::Readiness;
use berth_core::UserId;
use berth_core::runtime::{RuntimeEvent, RuntimeRef, Started};
use berth_core::runtime_contract;
use berth_k8s::testing::{ApiServerDouble, Kind};
use berth_k8s::{K8sRuntime, K8sRuntimeConfig, KubernetesConfig};

pub const NS: &str = "berth";
pub const WAIT: Duration = Duration::from_secs(30);

pub fn user(id: &str) -> UserId {
    UserId::parse(id).unwrap()
}

pub fn sh(script: &str) -> Vec<String> {
    vec!["sh".into(), "-c".into(), script.into()]
}

pub fn token_regex() -> Readiness {
    Readiness::TokenRegex(berth_core::runtime_contract::token_pattern())
}

/// A runtime config for `command`, managed as `node`.
pub fn config(command: Vec<String>, readiness: Readiness, node: &str) -> K8sRuntimeConfig {
    let mut kubernetes = KubernetesConfig::with_image("double.invalid/not-pulled:1");
    kubernetes.namespace = NS.into();
    kubernetes.start_timeout_s = 30;
    K8sRuntimeConfig {
        kubernetes,
        node: node.into(),
        program: berth_core::runtime_contract::program_settings(command, readiness),
        stop_grace: Duration::from_secs(5),
        egress: Default::default(),
        egress_proxy_key: None,
        shim_key: None,
    }
}

pub fn runtime(double: &ApiServerDouble, config: K8sRuntimeConfig) -> Arc<K8sRuntime> {
    K8sRuntime::with_resolver(double.client(), config, double.resolver()).unwrap()
}

/// The pod UID in a runtime reference (`name/uid/epoch`).
pub fn uid_of(r: &RuntimeRef) -> String {
    r.as_str().split('/').nth(1).unwrap().to_owned()
}

/// Whether the run is still there, seen from the double: its pod object,
/// or its program.
pub fn present(double: &ApiServerDouble, r: &RuntimeRef) -> bool {
    let uid = uid_of(r);
    double.running(&uid)
        || double
            .objects(Kind::Pod)
            .iter()
            .any(|p| p["metadata"]["uid"] == uid.as_str())
}

/// Polls `check` until it holds; panics naming `what` after [`WAIT`].
pub async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn ready(started: &mut Started) -> Option<String> {
    match runtime_contract::expect_event(&mut started.events, "ready", |e| {
        matches!(e, RuntimeEvent::Ready { .. })
    })
    .await
    {
        RuntimeEvent::Ready { token } => token,
        _ => unreachable!(),
    }
}

pub async fn exited(started: &mut Started) -> berth_core::runtime::ExitStatus {
    runtime_contract::exit_of(&mut started.events, |_| false).await
}
