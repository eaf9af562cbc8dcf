//! The runtime contract suite against a **real** Kubernetes cluster: a
//! program an operator runs, not a test, since no cluster runs where
//! berth's tests do. It runs every contract case in turn and exits 0 when
//! all hold; the first that fails ends it with its reason.
//!
//! ```text
//! KUBECONFIG=~/.kube/config \
//! BERTH_K8S_TEST_NAMESPACE=berth-test \      # must exist; default berth-test
//! BERTH_K8S_TEST_IMAGE=busybox:1.36 \        # needs sh, printf, sleep
//! BERTH_K8S_TEST_CLAIM=berth-data \          # optional: shared storage mode
//! BERTH_K8S_TEST_SHIM=/usr/local/bin/berth \  # optional: berth in the image
//!   cargo run -p berth-k8s --example real-cluster-contract
//! ```
//!
//! With `BERTH_K8S_TEST_SHIM` (an image with berth's binary there, such as
//! one built from the `Containerfile` with `sh`, `printf` and `sleep`
//! added), pods run under berth's shim, and the contract's freeze, fence
//! deadline, frozen-stop and hook cases run through it: hibernation,
//! resume and the fence deadline on a real cluster. Without it those cases
//! return early, as for any runtime that does not declare them.
//!
//! Without `BERTH_K8S_TEST_CLAIM` every test user gets its own claim,
//! which needs a default storage class; the claims are deleted at the end.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "an operator's check: a failure ends it with the reason"
)]

use berth_core::program::ProgramSettings;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use berth_core::Readiness;
use berth_core::runtime::{Runtime, RuntimeRef};
use berth_core::runtime_contract::{self, Harness, Program};
use berth_k8s::config::StorageMode;
use berth_k8s::{K8sRuntime, K8sRuntimeConfig, KubernetesConfig};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, ListParams};

struct ClusterHarness {
    client: kube::Client,
    namespace: String,
    image: String,
    claim: Option<String>,
    /// berth's binary in the image, to run pods under berth's shim.
    shim: Option<String>,
}

#[async_trait]
impl Harness for ClusterHarness {
    async fn runtime(&self, program: &Program) -> Arc<dyn Runtime> {
        let command = runtime_contract::sh_command(program);
        let mut kubernetes = KubernetesConfig::with_image(self.image.clone());
        kubernetes.namespace = self.namespace.clone();
        kubernetes.start_timeout_s = 180;
        if let Some(claim) = &self.claim {
            kubernetes.storage.mode = StorageMode::Shared;
            kubernetes.storage.claim = Some(claim.clone());
        }
        let config = K8sRuntimeConfig {
            kubernetes,
            node: "berth-e2e".into(),
            program: ProgramSettings {
                command,
                env: BTreeMap::new(),
                readiness: Readiness::TokenRegex(runtime_contract::token_pattern()),
                watchdog_command: None,
                patch_ext: "toml".into(),
            },
            stop_grace: Duration::from_secs(5),
            egress: Default::default(),
            egress_proxy_key: None,
            shim_key: None,
        };
        let mut config = config;
        if let Some(path) = &self.shim {
            config.kubernetes.shim = Some(berth_k8s::config::ShimConfig {
                path: path.clone(),
                port: 7079,
            });
            config.shim_key = Some(berth_core::credential::ShimKey::new(
                b"a cluster secret for the cluster test",
            ));
        }
        K8sRuntime::new(self.client.clone(), config).unwrap()
    }

    async fn running(&self, runtime_ref: &RuntimeRef, _pid: Option<u32>) -> bool {
        let mut parts = runtime_ref.as_str().split('/');
        let (Some(name), Some(uid)) = (parts.next(), parts.next()) else {
            return false;
        };
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        pods.get_opt(name)
            .await
            .ok()
            .flatten()
            .is_some_and(|p| p.metadata.uid.as_deref() == Some(uid))
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::var_os("KUBECONFIG").is_none() {
        eprintln!(
            "KUBECONFIG is not set: set it (and BERTH_K8S_TEST_NAMESPACE, BERTH_K8S_TEST_IMAGE) \
             to name the cluster to check"
        );
        std::process::exit(2);
    }
    let env = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let harness = ClusterHarness {
        client: kube::Client::try_default()
            .await
            .expect("a client from KUBECONFIG"),
        namespace: env("BERTH_K8S_TEST_NAMESPACE", "berth-test"),
        image: env("BERTH_K8S_TEST_IMAGE", "busybox:1.36"),
        claim: std::env::var("BERTH_K8S_TEST_CLAIM").ok(),
        shim: std::env::var("BERTH_K8S_TEST_SHIM").ok(),
    };
    let h = &harness;
    runtime_contract::a_started_program_becomes_ready_and_stops_gracefully(h).await;
    runtime_contract::kill_ends_a_program_that_ignores_term(h).await;
    runtime_contract::stop_kills_after_the_grace_period(h).await;
    runtime_contract::an_exit_is_reported_with_its_code_and_stderr(h).await;
    runtime_contract::a_missing_program_fails_to_start_and_is_named(h).await;
    runtime_contract::a_restarted_runtime_discovers_and_adopts_a_running_instance(h).await;
    runtime_contract::remove_ends_an_orphan(h).await;
    runtime_contract::logs_are_read_and_followed(h).await;
    runtime_contract::freeze_and_thaw_when_declared(h).await;
    runtime_contract::a_frozen_instance_is_killed_without_running_again(h).await;
    runtime_contract::the_fence_deadline_freezes_when_declared(h).await;
    runtime_contract::a_hook_runs_beside_the_program_when_declared(h).await;

    // The ended pods of the exit cases go once released; then the claims.
    let cleanup = h.runtime(&Program::Serve).await;
    for id in ["i-1", "i-adopt", "i-orphan"] {
        cleanup.release(id).await;
    }
    cleanup.shutdown().await;
    if harness.claim.is_none() {
        let claims: Api<PersistentVolumeClaim> =
            Api::namespaced(harness.client.clone(), &harness.namespace);
        let managed = ListParams::default().labels(&berth_k8s::names::managed_selector());
        let _ = claims
            .delete_collection(&DeleteParams::default(), &managed)
            .await;
    }
    println!("the runtime contract holds on this cluster");
}
