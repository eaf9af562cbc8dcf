//! The API-server **double**, on its own: a stand-in for a Kubernetes API
//! server, on a free local port, whose stand-in kubelet runs each pod's
//! command as a real local process. It is not Kubernetes (see
//! `berth_k8s::testing`); it lets anyone try berth's Kubernetes mode
//! without a cluster:
//!
//! ```sh
//! cargo run -p berth-k8s --features test-double --example apiserver-double -- \
//!     --kubeconfig /tmp/double.kubeconfig
//! ```
//!
//! then point `[kubernetes] kubeconfig` at that file, with
//! `endpoint = "endpoint_slice"` and a `command` this machine can run. It
//! serves until interrupted (Ctrl-C or SIGTERM), then kills the programs
//! it runs.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test tool: a panic is its error message"
)]

use std::path::PathBuf;

use berth_k8s::testing::ApiServerDouble;

fn kubeconfig_path() -> PathBuf {
    let mut args = std::env::args().skip(1);
    match (args.next().as_deref(), args.next(), args.next()) {
        (Some("--kubeconfig"), Some(path), None) => PathBuf::from(path),
        _ => {
            eprintln!("usage: apiserver-double --kubeconfig PATH");
            std::process::exit(2);
        }
    }
}

#[tokio::main]
async fn main() {
    let path = kubeconfig_path();
    let double = ApiServerDouble::start().await;
    std::fs::write(&path, double.kubeconfig())
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    println!(
        "API-server double (not Kubernetes) at {}; kubeconfig in {}",
        double.url(),
        path.display()
    );
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    drop(double);
}
