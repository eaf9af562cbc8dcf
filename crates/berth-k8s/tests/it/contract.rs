//! The runtime contract suite (`berth_core::runtime_contract`, the one the
//! local runtime runs) against the Kubernetes runtime, on the API server
//! **double**. Each case gets its own double; the programs are real `sh`
//! scripts that the double's stand-in kubelet runs as pods.

use crate::support;

use std::sync::Arc;

use async_trait::async_trait;
use berth_core::runtime::{Runtime, RuntimeRef};
use berth_core::runtime_contract::{Harness, Program, sh_command};
use berth_k8s::testing::ApiServerDouble;
use support::{config, present, token_regex};

struct DoubleHarness {
    double: ApiServerDouble,
}

impl DoubleHarness {
    async fn new() -> DoubleHarness {
        DoubleHarness {
            double: ApiServerDouble::start().await,
        }
    }
}

#[async_trait]
impl Harness for DoubleHarness {
    async fn runtime(&self, program: &Program) -> Arc<dyn Runtime> {
        support::runtime(
            &self.double,
            config(sh_command(program), token_regex(), "node-a"),
        )
    }

    async fn running(&self, runtime_ref: &RuntimeRef, _pid: Option<u32>) -> bool {
        present(&self.double, runtime_ref)
    }
}

berth_core::runtime_contract_tests!(DoubleHarness::new().await);
