//! Launch robustness at scale: 500 users launched at once on
//! one real `berth serve` all come up, with no failures: no store pool
//! starved, no descriptor limit hit, no port given twice.
//!
//! The port range lies below the kernel's ephemeral range, as `config
//! check` advises: inside it, a burst of outgoing connections (this test's
//! own 500 clients, which the kernel numbers consecutively) may occupy a
//! block of the range and leave too few ports, which is running out of
//! ports, not the race the fresh-port restart handles (`controller.rs`
//! takes a launch's port just before the program binds it).

use crate::support;

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};
use support::Node;

const USERS: usize = 500;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_users_at_once_all_come_up() {
    let dir = tempfile::tempdir().unwrap();
    // 600 ports of the test process's own.
    let low = berth_testkit::port_block(600);
    let high = low + 599;
    let node = Node::start(
        dir.path(),
        &format!("[instance]\nport_range = [{low}, {high}]\n"),
    );
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let launches = (0..USERS).map(|i| {
        let (http, url, token) = (
            http.clone(),
            node.api(&format!("/users/u{i}/instance")),
            node.token.clone(),
        );
        async move {
            let r = http
                .post(url)
                .bearer_auth(token)
                .json(&json!({}))
                .send()
                .await;
            match r {
                Ok(r) => (
                    r.status().as_u16(),
                    r.json::<Value>().await.unwrap_or(Value::Null),
                ),
                Err(e) => (0, json!(e.to_string())),
            }
        }
    });
    let answers = futures_util::future::join_all(launches).await;
    let failed: Vec<(usize, &(u16, Value))> = answers
        .iter()
        .enumerate()
        .filter(|(_, (status, _))| *status != 201)
        .collect();
    assert!(failed.is_empty(), "{} failed: {failed:?}", failed.len());

    let (status, body) = node.get("/instances").await;
    assert_eq!(status, 200, "{body}");
    let mains: Vec<&Value> = body["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["role"] == "main")
        .collect();
    assert_eq!(mains.len(), USERS);
    let not_running: Vec<&&Value> = mains
        .iter()
        .filter(|i| i["status"] != "running" || i["ready"] != true)
        .collect();
    assert!(not_running.is_empty(), "{not_running:?}");
    let ports: BTreeSet<u64> = mains.iter().filter_map(|i| i["port"].as_u64()).collect();
    assert_eq!(ports.len(), USERS, "every main has a port of its own");
    assert!(
        ports
            .iter()
            .all(|p| (u64::from(low)..=u64::from(high)).contains(p))
    );
    // Each answers on its route, through the proxy.
    for i in [0, USERS / 2, USERS - 1] {
        let r = node
            .http
            .get(format!("{}/u/u{i}/", node.url))
            .bearer_auth(&node.token)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200, "u{i}");
    }
}
