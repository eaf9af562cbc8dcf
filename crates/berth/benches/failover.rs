//! Failover benchmark (cluster mode): how long a user is away when the
//! node running them dies.
//!
//! Each run starts three real `berth serve` nodes on one PostgreSQL (a
//! fresh database on the testkit's throwaway server, or on
//! `BERTH_TEST_PG_URL`), launches alice, checks she answers through a node
//! that does not hold her, then `kill -9`s her holder and measures the time
//! until a surviving node's `/u/alice/` answers 200 with her page again —
//! the user-visible failover time. Alongside, it watches (through the
//! third node) for the lease's new epoch: the control plane's part. The kill comes 1.5 s after the launch
//! plus a phase that walks evenly through the renew interval over the runs.
//! Lease timings are the defaults scaled
//! by 1/10, as in the tests: TTL 3 s, renew 1 s, fence after 2 s,
//! `takeover = "evidence"`.
//!
//! ```sh
//! cargo bench -p berth --bench failover            # 20 runs
//! cargo bench -p berth --bench failover -- --runs 5
//! ```
//!
//! A benchmark target rather than an example so that it runs the `berth`
//! binary built with it (`CARGO_BIN_EXE_berth`, release profile).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a measurement tool: a failure ends the run with its message"
)]

#[path = "../tests/it/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use berth_testkit::PgCluster;
use support::{CLUSTER_LEASE, Node};

const SECRET: &str = berth_testkit::TEST_CLUSTER_SECRET;
const IDS: [&str; 3] = ["node-a", "node-b", "node-c"];
/// A run that takes longer than this is a failure, not a sample.
const GIVE_UP: Duration = Duration::from_secs(120);

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut runs = 20usize;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--runs" {
            runs = args.next().and_then(|n| n.parse().ok()).expect("--runs N");
        }
        // `cargo bench` passes `--bench`; anything else is ignored too.
    }
    tokio::task::spawn_blocking(|| PgCluster::shared().map(|_| ()).map_err(|e| e.to_string()))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("no PostgreSQL: {e}"));
    println!(
        "failover: kill -9 of the holder -> 200 from a surviving node's /u/alice/; \
         {runs} runs, 3 nodes, lease {}",
        CLUSTER_LEASE.trim().replace('\n', ", ")
    );
    let mut samples = Vec::new();
    let mut moves = Vec::new();
    for run in 1..=runs {
        // Kill at a different moment of the renew interval each run, spread
        // evenly over it, so the phase of the lease's ticks is not fixed.
        let phase = Duration::from_millis((1000 * (run as u64 - 1) / runs as u64) % 1000);
        let (took, moved) = one_run(phase).await;
        println!(
            "run {run:2} (kill {:3} ms into the interval): answers after {:5.0} ms, lease moved after {:5.0} ms",
            phase.as_millis(),
            took.as_secs_f64() * 1e3,
            moved.as_secs_f64() * 1e3
        );
        samples.push(took);
        moves.push(moved);
    }
    report(
        "lease claimed by a survivor (new epoch in the store)",
        moves,
    );
    report("failover time (alice answers 200 again)", samples);
}

fn report(what: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    println!(
        "{what}, {} runs: min {:.0} ms, median {:.0} ms, p95 {:.0} ms, max {:.0} ms",
        samples.len(),
        ms(samples[0]),
        ms(at(0.5)),
        ms(at(0.95)),
        ms(samples[samples.len() - 1])
    );
}

async fn start_nodes(root: &std::path::Path, db: &str) -> Vec<Node> {
    let mut nodes = Vec::new();
    for id in IDS {
        let (dir, db) = (root.join(id), db.to_owned());
        nodes.push(
            tokio::task::spawn_blocking(move || {
                Node::from(
                    support::berth()
                        .node(&dir)
                        .config(&support::cluster_config(&dir, &db, id, SECRET, "", ""))
                        .start(),
                )
            })
            .await
            .unwrap(),
        );
    }
    nodes
}

/// GET `/u/alice/` through `node`: true on 200 with alice's page.
async fn answers(http: &reqwest::Client, node: &Node, token: &str) -> bool {
    let response = http
        .get(format!("{}/u/alice/", node.url))
        .bearer_auth(token)
        .send()
        .await;
    match response {
        Ok(r) if r.status() == 200 => r
            .text()
            .await
            .is_ok_and(|page| page.contains(r#"<b id="user">alice</b>"#)),
        _ => false,
    }
}

/// One kill: (until alice answers again, until her lease has a new epoch).
async fn one_run(phase: Duration) -> (Duration, Duration) {
    let db = PgCluster::shared().unwrap().fresh_database().await;
    let root = tempfile::tempdir().unwrap();
    let mut nodes = start_nodes(root.path(), &db).await;
    let (status, body) = nodes[0]
        .post("/users/alice/instance", serde_json::json!({}))
        .await;
    assert_eq!(status, 201, "{body}");
    let holder = IDS
        .iter()
        .position(|id| body["instance"]["node"] == *id)
        .expect("a holder");
    let survivor = (holder + 1) % IDS.len();
    let token = nodes[0].user_token("alice").await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    assert!(
        answers(&http, &nodes[survivor], &token).await,
        "alice answers through a non-holder before the kill"
    );

    // The holder has renewed at least once (TTL > 2 × renew), then the
    // phase picks the moment of the kill.
    tokio::time::sleep(Duration::from_millis(1500) + phase).await;
    let (_, body) = nodes[survivor].get("/leases").await;
    let old_epoch = body["leases"][0]["epoch"].as_i64().expect("alice's lease");
    let killed = Instant::now();
    nodes[holder].kill9();
    // The control plane's part, watched through the other survivor.
    let watcher = &nodes[3 - holder - survivor];
    let moved = async {
        loop {
            let (_, body) = watcher.get("/leases").await;
            if body["leases"][0]["epoch"].as_i64() > Some(old_epoch) {
                return killed.elapsed();
            }
            assert!(
                killed.elapsed() < GIVE_UP,
                "no new epoch within {GIVE_UP:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let answered = async {
        loop {
            if answers(&http, &nodes[survivor], &token).await {
                break;
            }
            assert!(killed.elapsed() < GIVE_UP, "no failover within {GIVE_UP:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        killed.elapsed()
    };
    let (took, moved) = tokio::join!(answered, moved);
    drop(nodes);
    (took, moved)
}
