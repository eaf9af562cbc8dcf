//! Lease benchmarks (not tests): how long one node's renew tick (renew-all,
//! one statement) takes with 10 000 and with 100 000 leases, and how many
//! claims per second 8 concurrent claimers get, on SQLite and on
//! PostgreSQL.
//!
//! ```text
//! cargo run --release -p berth-store --example lease_bench
//! ```
//!
//! PostgreSQL is a throwaway cluster from `berth-testkit` (`fsync=off`,
//! `synchronous_commit=off`), or the server `BERTH_TEST_PG_URL` names.
//! SQLite is a file in a temporary directory, in WAL mode as berth runs it.
//! Knobs: `BENCH_LEASES` (lease counts, comma-separated: `10000,100000`),
//! `BENCH_TICKS` (11), `BENCH_SECS` (3).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a measurement tool: a failure ends the run with its message"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_core::{Epoch, UserId};
use berth_store::{ClaimOutcome, PgStore, SqliteStore, Store, TakeoverPolicy};
use berth_testkit::PgCluster;

const TTL: Duration = Duration::from_secs(30);
const CLAIMERS: usize = 8;

fn knob(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn user(i: usize, prefix: &str) -> UserId {
    match UserId::parse(&format!("{prefix}-{i:06}")) {
        Ok(u) => u,
        Err(e) => panic!("bench user id: {e}"),
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Claims `n` leases for one node (8 at a time), then times `ticks` renews
/// of all of them in one statement each.
async fn renew_tick(store: Arc<dyn Store>, n: usize, ticks: usize) -> (Duration, Duration) {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (0..CLAIMERS)
        .map(|_| {
            let store = store.clone();
            let next = next.clone();
            tokio::spawn(async move {
                let mut held = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= n {
                        return held;
                    }
                    let u = user(i, "renew");
                    match store
                        .claim_lease(&u, "node-a", TTL, TakeoverPolicy::Evidence)
                        .await
                    {
                        Ok(ClaimOutcome::Claimed { epoch }) => held.push((u, epoch)),
                        other => panic!("claim {u}: {other:?}"),
                    }
                }
            })
        })
        .collect();
    let mut held: Vec<(UserId, Epoch)> = Vec::with_capacity(n);
    for t in tasks {
        held.extend(t.await.unwrap_or_default());
    }
    let mut times = Vec::with_capacity(ticks);
    for _ in 0..ticks {
        let started = Instant::now();
        let renewed = store.renew_leases("node-a", &held, TTL).await;
        times.push(started.elapsed());
        match renewed {
            Ok(r) if r.len() == n => {}
            other => panic!("renewed {:?} of {n}", other.map(|r| r.len())),
        }
    }
    let min = times.iter().min().copied().unwrap_or_default();
    (median(times), min)
}

/// Claims per second for `secs` with 8 claimers: each on its own users
/// (every claim a new user: insert + update), or all on one user (one
/// wins, the others are told it is busy; the winner re-claims, bumping the
/// epoch).
async fn claims_per_sec(store: Arc<dyn Store>, contended: bool, secs: u64) -> (f64, u64) {
    let stop = Instant::now() + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..CLAIMERS)
        .map(|c| {
            let store = store.clone();
            tokio::spawn(async move {
                let node = format!("node-{c}");
                let (mut attempts, mut wins) = (0u64, 0u64);
                let mut i = 0;
                while Instant::now() < stop {
                    let u = if contended {
                        user(0, "hot")
                    } else {
                        user(i, &format!("c{c}"))
                    };
                    i += 1;
                    match store
                        .claim_lease(&u, &node, TTL, TakeoverPolicy::Evidence)
                        .await
                    {
                        Ok(ClaimOutcome::Claimed { .. }) => wins += 1,
                        Ok(ClaimOutcome::Busy { .. }) => {}
                        Err(e) => panic!("claim: {e}"),
                    }
                    attempts += 1;
                }
                (attempts, wins)
            })
        })
        .collect();
    let started = Instant::now();
    let (mut attempts, mut wins) = (0, 0);
    for t in tasks {
        let (a, w) = t.await.unwrap_or_default();
        attempts += a;
        wins += w;
    }
    (attempts as f64 / started.elapsed().as_secs_f64(), wins)
}

/// The lease counts to time renew-all at.
fn lease_counts() -> Vec<usize> {
    let text = std::env::var("BENCH_LEASES").unwrap_or_else(|_| "10000,100000".to_owned());
    text.split(',')
        .filter_map(|n| n.trim().parse().ok())
        .collect()
}

async fn bench(name: &str, open: impl AsyncFn() -> Arc<dyn Store>) {
    let ticks = knob("BENCH_TICKS", 11) as usize;
    let secs = knob("BENCH_SECS", 3);
    for n in lease_counts() {
        let (med, min) = renew_tick(open().await, n, ticks).await;
        println!(
            "{name:<10} renew-all, {n} leases, one statement: median {:.1} ms, min {:.1} ms ({ticks} ticks)",
            med.as_secs_f64() * 1e3,
            min.as_secs_f64() * 1e3
        );
    }
    let (rate, wins) = claims_per_sec(open().await, false, secs).await;
    println!(
        "{name:<10} claims/s, {CLAIMERS} claimers, distinct users: {rate:.0} ({wins} claimed)"
    );
    let (rate, wins) = claims_per_sec(open().await, true, secs).await;
    println!(
        "{name:<10} claims/s, {CLAIMERS} claimers, one contended user: {rate:.0} attempts ({wins} won)"
    );
}

#[tokio::main]
async fn main() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "lease_bench: {cores} cores, release={}",
        !cfg!(debug_assertions)
    );

    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => panic!("temp dir: {e}"),
    };
    let counter = std::sync::atomic::AtomicUsize::new(0);
    bench("sqlite", async || {
        let i = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let url = format!("sqlite://{}", dir.path().join(format!("b{i}.db")).display());
        match SqliteStore::open(&url).await {
            Ok(s) => Arc::new(s) as Arc<dyn Store>,
            Err(e) => panic!("{e}"),
        }
    })
    .await;

    let cluster = match PgCluster::start() {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    bench("postgres", async || {
        let url = cluster.fresh_database().await;
        match PgStore::open(&url).await {
            Ok(s) => Arc::new(s) as Arc<dyn Store>,
            Err(e) => panic!("{e}"),
        }
    })
    .await;
}
