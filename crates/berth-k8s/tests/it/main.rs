//! The Kubernetes runtime's integration tests, one binary: against the
//! API-server double (`berth_k8s::testing`), and `cluster` against a real
//! cluster when `KUBECONFIG` names one.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test: an unwrap is its assertion"
)]

mod support;

mod cluster;
mod contract;
mod controller;
mod deploy;
mod runtime;
mod schema;
