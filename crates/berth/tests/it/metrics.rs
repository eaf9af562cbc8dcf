//! `/metrics` for a Prometheus scraper: its own read-only token
//! (`[metrics] token`), which opens `/metrics` and nothing else, or an
//! unauthenticated address of its own (`[metrics] listen`), which serves
//! nothing else; the proxy's request-duration histogram; and, after a
//! scripted scenario, every series berth exports (README, "Metrics")
//! once, under its one name, holding what happened, read with a strict
//! OpenMetrics parser.

use crate::support;

use std::collections::HashMap;

use prometheus_parse::{LineInfo, SampleType, Scrape, Value};
use serde_json::json;
use support::{Node, free_port, signal};

const SCRAPER: &str = "scraper-token-0123456789";

fn config(n: u16, extra: &str) -> String {
    let start = berth_testkit::port_block_for(&format!("{} {n}", module_path!()), 20);
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

/// `/metrics`, read by a Prometheus text-format parser.
struct Scraped {
    text: String,
    /// Every family declared (`# TYPE`), in order, with its type.
    families: Vec<(String, SampleType)>,
    samples: Vec<prometheus_parse::Sample>,
}

async fn scrape(node: &Node) -> Scraped {
    let (status, text) = get(node, "/metrics", Some(&node.token)).await;
    assert_eq!(status, 200, "{text}");
    let mut families = Vec::new();
    for line in text.lines() {
        match LineInfo::parse(line) {
            LineInfo::Type {
                metric_name,
                metric_alias,
                sample_type,
            } => families.push((metric_alias.unwrap_or(metric_name), sample_type)),
            LineInfo::Doc { .. } | LineInfo::Sample { .. } | LineInfo::Empty => {}
            // The two lines OpenMetrics adds to the Prometheus format.
            LineInfo::Ignored => assert!(
                line.starts_with("# UNIT ") || line == "# EOF",
                "not Prometheus text: {line:?}\n{text}"
            ),
        }
    }
    let samples = Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
        .unwrap()
        .samples;
    Scraped {
        text,
        families,
        samples,
    }
}

impl Scraped {
    fn declared(&self, name: &str) -> SampleType {
        let found: Vec<_> = self.families.iter().filter(|(n, _)| n == name).collect();
        match found.as_slice() {
            [(_, kind)] => *kind,
            _ => panic!("{name} declared {} times:\n{}", found.len(), self.text),
        }
    }

    /// The samples named `name` whose labels include `with`.
    fn find(&self, name: &str, with: &[(&str, &str)]) -> Vec<&prometheus_parse::Sample> {
        self.samples
            .iter()
            .filter(|s| s.metric == name && with.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .collect()
    }

    /// The one value of the sample `name` with labels `with`.
    fn value(&self, name: &str, with: &[(&str, &str)]) -> f64 {
        match self.find(name, with).as_slice() {
            [sample] => match sample.value {
                Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
                ref other => panic!("{name}: {other:?}"),
            },
            other => panic!("{name} {with:?}: {other:?}\n{}", self.text),
        }
    }

    /// (count, sum, +Inf bucket) of histogram `name` with labels `with`.
    fn histogram(&self, name: &str, with: &[(&str, &str)]) -> (f64, f64, f64) {
        assert_eq!(self.declared(name), SampleType::Histogram, "{name}");
        let inf = match self.find(name, with).as_slice() {
            [sample] => match &sample.value {
                Value::Histogram(buckets) => buckets
                    .iter()
                    .find(|b| b.less_than == f64::INFINITY)
                    .map(|b| b.count)
                    .unwrap_or_else(|| panic!("{name}: no +Inf bucket")),
                other => panic!("{name}: {other:?}"),
            },
            other => panic!("{name} {with:?}: {other:?}\n{}", self.text),
        };
        (
            self.value(&format!("{name}_count"), with),
            self.value(&format!("{name}_sum"), with),
            inf,
        )
    }
}

/// Two launches, one crash, one stop and 100 proxied requests, then
/// `/metrics`: it parses; each series of README's "Metrics" is there
/// once, with the `berth_` prefix once; and the instance, restart,
/// spawn-to-ready and proxy series count exactly what happened.
#[tokio::test(flavor = "multi_thread")]
async fn a_scripted_scenario_is_counted_under_one_name_each() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(3, ""));

    // Two launches.
    for user in ["alice", "bob"] {
        let (status, body) = node
            .post(&format!("/users/{user}/instance"), json!({}))
            .await;
        assert_eq!(status, 201, "{user}: {body}");
    }
    let alice = node.running_main("alice", None).await;
    node.running_main("bob", None).await;
    let node_id = alice["node"].as_str().unwrap().to_owned();

    // One crash: alice's program is killed; berth restarts it.
    let pid = alice["pid"].as_u64().unwrap();
    signal(pid as u32, nix::sys::signal::Signal::SIGKILL);
    let alice = node.running_main("alice", Some(pid)).await;
    assert_eq!(alice["restarts"], 1, "{alice}");

    // One stop.
    assert_eq!(node.delete("/users/bob/instance").await, 204);

    // 100 proxied requests.
    let token = node.user_token("alice").await;
    for _ in 0..100 {
        let (status, body) = get(&node, "/u/alice/", Some(&token)).await;
        assert_eq!(status, 200, "{body}");
    }

    // One API error: a user id berth refuses (a leading dot), counted by
    // its code.
    let (status, body) = node.post("/users/.hidden/instance", json!({})).await;
    assert_eq!(status, 400, "{body}");
    let code = body["error"].as_str().unwrap().to_owned();

    let scraped = scrape(&node).await;
    let text = &scraped.text;
    assert_eq!(
        scraped.value("berth_api_errors_total", &[("code", &code)]),
        1.0,
        "{text}"
    );

    // Each family once, every name under one `berth_` prefix.
    let mut names: Vec<&str> = scraped.families.iter().map(|(n, _)| n.as_str()).collect();
    let declared = names.len();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), declared, "a family declared twice:\n{text}");
    for name in names
        .iter()
        .copied()
        .chain(scraped.samples.iter().map(|s| s.metric.as_str()))
    {
        assert!(name.starts_with("berth_"), "{name}");
        assert!(
            !name.starts_with("berth_berth"),
            "doubled prefix: {name}\n{text}"
        );
    }

    // The series of README's "Metrics", with their types (a counter's
    // samples end in `_total`).
    for (name, kind) in [
        ("berth_instances", SampleType::Gauge),
        ("berth_spawn_to_ready_seconds", SampleType::Histogram),
        (
            "berth_proxy_request_duration_seconds",
            SampleType::Histogram,
        ),
        ("berth_restarts", SampleType::Counter),
        ("berth_breaker_opens", SampleType::Counter),
        ("berth_lease_renew_failures", SampleType::Counter),
        ("berth_fenced_instances", SampleType::Counter),
        ("berth_expired_leases", SampleType::Gauge),
    ] {
        assert_eq!(scraped.declared(name), kind, "{name}");
    }

    // Instances by status and node: alice running, bob stopped, nothing
    // else; no label names a user.
    let mut instances = HashMap::new();
    for sample in scraped.find("berth_instances", &[]) {
        let Value::Gauge(n) = sample.value else {
            panic!("{sample:?}")
        };
        let mut keys: Vec<&str> = sample.labels.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["node", "role", "status"], "{sample:?}");
        assert_eq!(sample.labels.get("node"), Some(node_id.as_str()));
        if n != 0.0 {
            let status = sample.labels.get("status").unwrap().to_owned();
            let role = sample.labels.get("role").unwrap().to_owned();
            instances.insert((status, role), n);
        }
    }
    assert_eq!(
        instances,
        HashMap::from([
            (("running".to_owned(), "main".to_owned()), 1.0),
            (("stopped".to_owned(), "main".to_owned()), 1.0),
        ]),
        "{text}"
    );

    // One crash, one restart; nothing else went wrong.
    assert_eq!(scraped.value("berth_restarts_total", &[]), 1.0, "{text}");
    assert_eq!(scraped.value("berth_breaker_opens_total", &[]), 0.0);
    assert_eq!(scraped.value("berth_fenced_instances_total", &[]), 0.0);
    assert_eq!(scraped.value("berth_lease_renew_failures_total", &[]), 0.0);

    // Three runs became ready: the two launches and the restart.
    let (count, sum, inf) = scraped.histogram("berth_spawn_to_ready_seconds", &[]);
    assert_eq!((count, inf), (3.0, 3.0), "{text}");
    assert!(sum > 0.0, "{text}");

    // The 100 proxied requests, all answered 2xx.
    let (count, sum, inf) =
        scraped.histogram("berth_proxy_request_duration_seconds", &[("class", "2xx")]);
    assert_eq!((count, inf), (100.0, 100.0), "{text}");
    assert!(sum > 0.0, "{text}");

    // Low cardinality: no user appears anywhere.
    for user in ["alice", "bob"] {
        assert!(!text.contains(user), "{user} in /metrics:\n{text}");
    }
}
