//! The Kubernetes runtime's integration tests, one binary, against the
//! API-server double (`berth_k8s::testing`). The same contract against a
//! real cluster is the example `real-cluster-contract`, which an operator
//! runs.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test: an unwrap is its assertion"
)]

mod support;

mod contract;
mod controller;
mod deploy;
mod runtime;
mod schema;
