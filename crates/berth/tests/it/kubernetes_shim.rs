//! The runtime contract suite (`berth_core::runtime_contract`, the one
//! every runtime runs) against the Kubernetes runtime with berth's shim as
//! each pod's entrypoint, on the API-server **double**: the shim is this
//! build's `berth` (`berth shim pod`), run by the double's stand-in
//! kubelet as a real process, so freezing, the fence deadline, a stop of
//! a frozen program and hooks are held by the shim in the pod, as they
//! are by the shim on a host. Each case gets its own double.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use berth_core::credential::ShimKey;
use berth_core::runtime::{Runtime, RuntimeRef};
use berth_core::runtime_contract::{self, Harness, Program, sh_command};
use berth_k8s::config::ShimConfig;
use berth_k8s::testing::{ApiServerDouble, Kind};
use berth_k8s::{K8sRuntime, K8sRuntimeConfig, KubernetesConfig};

use crate::support::BERTH;

struct ShimmedDouble {
    double: ApiServerDouble,
}

#[async_trait]
impl Harness for ShimmedDouble {
    async fn runtime(&self, program: &Program) -> Arc<dyn Runtime> {
        let mut kubernetes = KubernetesConfig::with_image("double.invalid/not-pulled:1");
        kubernetes.namespace = "berth".into();
        kubernetes.start_timeout_s = 30;
        kubernetes.shim = Some(ShimConfig {
            path: BERTH.into(),
            port: 7079,
        });
        let readiness = berth_core::Readiness::TokenRegex(runtime_contract::token_pattern());
        let config = K8sRuntimeConfig {
            kubernetes,
            node: "node-a".into(),
            program: runtime_contract::program_settings(sh_command(program), readiness),
            stop_grace: Duration::from_secs(5),
            egress: Default::default(),
            egress_proxy_key: None,
            shim_key: Some(ShimKey::new(berth_testkit::TEST_CLUSTER_SECRET.as_bytes())),
        };
        K8sRuntime::with_resolver(self.double.client(), config, self.double.resolver()).unwrap()
    }

    async fn running(&self, runtime_ref: &RuntimeRef, _pid: Option<u32>) -> bool {
        let uid = runtime_ref.as_str().split('/').nth(1).unwrap_or_default();
        self.double.running(uid)
            || self
                .double
                .objects(Kind::Pod)
                .iter()
                .any(|p| p["metadata"]["uid"] == uid)
    }
}

// The shim runs each pod's program under a uid of the pod's own
// (`run_as_user`), which only root may give.
berth_core::runtime_contract_tests!(
    ShimmedDouble {
        double: ApiServerDouble::start().await,
    },
    runs_here = crate::support::root
);
