//! Test support of the end-to-end tests: a thin layer over `berth-testkit`,
//! where the helpers live (so every crate's tests can use them), that
//! supplies this crate's `berth` binary.
//!
//! [`Node`] is the testkit's node started with [`BERTH`]; everything else
//! is re-exported as it is.

#![allow(dead_code, unused_imports)]

use std::ops::{Deref, DerefMut};
use std::path::Path;

pub use berth_testkit::{
    Berth, CLUSTER_LEASE, alive, cluster_config, cluster_config_custom, config_with, eventually,
    free_port, instance_pids, kill_instances_under, proc_state, raw_request, rss_kib, signal,
    zygote_of,
};

/// The `berth` binary cargo built for these tests.
pub const BERTH: &str = env!("CARGO_BIN_EXE_berth");

/// A launcher of [`BERTH`], for nodes that need more than [`Node`]'s
/// starters give (extra environment, say).
pub fn berth() -> Berth {
    Berth::new(BERTH)
}

/// A running `berth serve` of [`BERTH`]: [`berth_testkit::Node`], with the
/// starters this crate's tests call as `Node::start…`. Dropping it kills
/// berth and every instance under its data dir.
#[derive(Debug)]
pub struct Node(pub berth_testkit::Node);

impl Deref for Node {
    type Target = berth_testkit::Node;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl DerefMut for Node {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl From<berth_testkit::Node> for Node {
    fn from(node: berth_testkit::Node) -> Self {
        Node(node)
    }
}

impl Node {
    /// Starts berth in `dir` with `extra` TOML appended to the base config.
    pub fn start(dir: &Path, extra: &str) -> Node {
        Node(berth().start(dir, extra))
    }

    /// Starts `berth <args>` in `dir` and waits for its "listening" line.
    pub fn start_with_args(dir: &Path, args: &[&str], data_dir: &Path) -> Node {
        Node(berth().start_with_args(dir, args, data_dir))
    }

    /// Starts a cluster node (PostgreSQL store) in `dir`; see
    /// [`cluster_config`].
    pub fn start_cluster(
        dir: &Path,
        pg_url: &str,
        node_id: &str,
        secret: &str,
        extra: &str,
    ) -> Node {
        Node(berth().start_cluster(dir, pg_url, node_id, secret, extra))
    }

    /// [`Node::start_cluster`] with extra `[lease]` keys.
    pub fn start_cluster_with_lease(
        dir: &Path,
        pg_url: &str,
        node_id: &str,
        secret: &str,
        lease_extra: &str,
        extra: &str,
    ) -> Node {
        Node(berth().start_cluster_with_lease(dir, pg_url, node_id, secret, lease_extra, extra))
    }

    /// A cluster node configured by [`cluster_config_custom`].
    pub fn start_cluster_custom(
        dir: &Path,
        pg_url: &str,
        node_id: &str,
        secret: &str,
        lease: &str,
        instance: &str,
        extra: &str,
    ) -> Node {
        Node(berth().start_cluster_custom(dir, pg_url, node_id, secret, lease, instance, extra))
    }
}
