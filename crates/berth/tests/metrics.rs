//! `/metrics` for a Prometheus scraper: its own read-only token
//! (`[metrics] token`), which opens `/metrics` and nothing else, or an
//! unauthenticated address of its own (`[metrics] listen`), which serves
//! nothing else; and the proxy's request-duration histogram.

mod support;

use serde_json::json;
use support::{Node, free_port};

const SCRAPER: &str = "scraper-token-0123456789";

fn config(n: u16, extra: &str) -> String {
    let start = 28_800 + n * 20;
    format!(
        "[instance]\nport_range = [{start}, {}]\n{extra}\n",
        start + 19
    )
}

/// The value of the series line `name` (labels included), if present.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let value = line.strip_prefix(name)?.strip_prefix(' ')?;
        value.split_whitespace().next()?.parse().ok()
    })
}

async fn get(node: &Node, path: &str, token: Option<&str>) -> (u16, String) {
    let mut request = node.http.get(format!("{}{path}", node.url));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let r = request.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_metrics_token_opens_metrics_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(
        dir.path(),
        &config(0, &format!("[metrics]\ntoken = \"{SCRAPER}\"\n")),
    );
    let (status, text) = get(&node, "/metrics", Some(SCRAPER)).await;
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains("berth_proxy_request_duration_seconds"),
        "{text}"
    );
    // The admin still may; nobody else.
    assert_eq!(get(&node, "/metrics", Some(&node.token)).await.0, 200);
    assert_eq!(get(&node, "/metrics", None).await.0, 401);
    assert_eq!(get(&node, "/metrics", Some("wrong")).await.0, 401);
    let alice = node.user_token("alice").await;
    assert_eq!(get(&node, "/metrics", Some(&alice)).await.0, 403);
    // The scraper's token is no admin's, and no user's.
    for path in [
        "/api/v1/instances",
        "/api/v1/nodes",
        "/api/v1/events",
        "/api/v1/users/alice/instance",
    ] {
        let (status, body) = get(&node, path, Some(SCRAPER)).await;
        assert_eq!(status, 401, "{path}: {body}");
    }
    let r = node
        .http
        .post(node.api("/users/alice/instance"))
        .bearer_auth(SCRAPER)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert!(node.main_of("alice").await.is_null(), "nothing started");
    let (status, _) = get(&node, "/u/alice/", Some(SCRAPER)).await;
    assert_eq!(status, 401, "nor does it open an app");
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_listen_serves_metrics_alone_without_auth() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let node = Node::start(
        dir.path(),
        &config(1, &format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n")),
    );
    let http = reqwest::Client::new();
    let r = http
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text")
    );
    assert!(r.text().await.unwrap().contains("# EOF"));
    // Only /metrics: not the API, not an app, not the admin page.
    for path in ["/api/v1/instances", "/u/alice/", "/admin/", "/"] {
        let r = http
            .get(format!("http://127.0.0.1:{port}{path}"))
            .bearer_auth(&node.token)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{path}");
    }
    // The main address still wants a credential.
    assert_eq!(get(&node, "/metrics", None).await.0, 401);
}

#[tokio::test(flavor = "multi_thread")]
async fn proxied_requests_are_timed_by_status_class() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(2, ""));
    let (status, body) = node.post("/users/alice/instance", json!({})).await;
    assert!(status == 201 || status == 200, "{body}");
    let alice = node.user_token("alice").await;
    for _ in 0..100 {
        let (status, _) = get(&node, "/u/alice/", Some(&alice)).await;
        assert_eq!(status, 200);
    }
    for _ in 0..3 {
        let (status, _) = get(&node, "/u/alice/", Some("not-a-token")).await;
        assert_eq!(status, 401);
    }
    let (_, text) = get(&node, "/metrics", Some(&node.token)).await;
    let count = |class: &str| {
        sample(
            &text,
            &format!("berth_proxy_request_duration_seconds_count{{class=\"{class}\"}}"),
        )
    };
    assert_eq!(count("2xx"), Some(100.0), "{text}");
    assert_eq!(count("4xx"), Some(3.0), "{text}");
    // Every request falls in the last bucket; the buckets are cumulative.
    let inf = sample(
        &text,
        "berth_proxy_request_duration_seconds_bucket{le=\"+Inf\",class=\"2xx\"}",
    );
    assert_eq!(inf, Some(100.0), "{text}");
    let sum = sample(
        &text,
        "berth_proxy_request_duration_seconds_sum{class=\"2xx\"}",
    )
    .unwrap();
    assert!(sum > 0.0, "{text}");
    // One name, no per-user label.
    assert_eq!(
        text.matches("# TYPE berth_proxy_request_duration_seconds histogram")
            .count(),
        1
    );
    assert!(!text.contains("alice"), "{text}");
}
