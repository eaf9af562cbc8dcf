//! berth's end-to-end tests, one binary: each module drives the real
//! `berth` binary (or its crates) through real processes, sockets, SQLite
//! and PostgreSQL, and `support` holds what they share. The modules run
//! in one test process, so everything a test takes from the host (ports,
//! account ranges) comes from `berth_testkit`'s process-wide allocators.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test: an unwrap is its assertion"
)]

mod support;

mod admin_page;
mod api;
mod cli_client;
mod cli_output;
mod cluster;
mod cluster_faults;
mod config;
mod controller;
mod demo_app;
mod examples;
mod front_door;
mod hibernate;
mod hostile_apps;
mod isolation;
#[cfg(feature = "kubernetes")]
mod kubernetes;
#[cfg(feature = "kubernetes")]
mod kubernetes_shim;
mod launch_burst;
mod limits;
mod local_runtime;
mod login;
mod metrics;
mod oidc_provider;
mod proxy;
mod proxy_e2e;
mod review_attacks;
mod shim;
mod slugs;
mod soak;
