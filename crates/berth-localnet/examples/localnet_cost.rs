//! What reaching an instance costs per new connection: a plain loopback
//! connect, the same with the owner check (`peer_owner`), and a connect
//! made inside another network namespace (`connect_in`, root only).
//!
//! `cargo run --release -p berth-localnet --example localnet_cost`

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a measurement tool: a failure ends the run with its message"
)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const ROUNDS: u32 = 5_000;

fn per_round(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e6 / f64::from(ROUNDS)
}

fn main() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback listener");
    let addr = listener.local_addr().expect("its address");
    // Accepted connections are kept open: a connection the other end has
    // closed has no owner left to tell.
    let accepting = std::thread::spawn(move || {
        listener
            .incoming()
            .take(2 * ROUNDS as usize)
            .collect::<Vec<_>>()
    });

    let start = Instant::now();
    for _ in 0..ROUNDS {
        drop(TcpStream::connect(addr).expect("connect"));
    }
    println!("connect                  {:>8.1} µs", per_round(start));

    let start = Instant::now();
    for _ in 0..ROUNDS {
        let stream = TcpStream::connect(addr).expect("connect");
        let local = stream.local_addr().expect("local");
        berth_localnet::peer_owner(local, addr).expect("an owner");
    }
    println!("connect + peer_owner     {:>8.1} µs", per_round(start));
    accepting.join().expect("the acceptor");

    match namespace_with_listener() {
        Some((netns, inside)) => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            let start = Instant::now();
            runtime.block_on(async {
                for _ in 0..ROUNDS {
                    berth_localnet::connect_in(&netns, inside, Duration::from_secs(5))
                        .await
                        .expect("connect inside");
                }
            });
            println!("connect_in (netns)       {:>8.1} µs", per_round(start));
        }
        None => println!("connect_in (netns)       (needs root)"),
    }
}

/// A thread of its own in a new network namespace, accepting forever.
fn namespace_with_listener() -> Option<(PathBuf, SocketAddr)> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let made = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
            .ok()
            .and_then(|()| berth_localnet::loopback_up().ok())
            .and_then(|()| TcpListener::bind("127.0.0.1:0").ok());
        let Some(listener) = made else {
            let _ = tx.send(None);
            return;
        };
        let tid = nix::unistd::gettid();
        let path = PathBuf::from(format!("/proc/{}/task/{tid}/ns/net", std::process::id()));
        let addr = listener.local_addr().ok();
        let _ = tx.send(addr.map(|a| (path, a)));
        let _kept: Vec<_> = listener.incoming().collect();
    });
    rx.recv().ok().flatten()
}
