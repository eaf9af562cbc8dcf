//! Cluster mode end to end: several real `berth serve` nodes sharing one
//! PostgreSQL database.
//!
//! One throwaway PostgreSQL cluster serves the whole test binary
//! (`berth-testkit`, or `BERTH_TEST_PG_URL`); every test gets a fresh
//! database. Lease timings are short (TTL 3 s, renew 1 s, fence after
//! 2 s) so expiry is seen in seconds. Everything polls until a deadline;
//! nothing asserts on timing. Each `Node`'s drop kills its instances.

use crate::support;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use berth_testkit::PgCluster;
use serde_json::{Value, json};
use support::{
    BERTH, CLUSTER_LEASE, Node, alive, berth, cluster_config, eventually, frozen, instance_pids,
    instance_processes, proc_state, signal,
};

const SECRET: &str = berth_testkit::TEST_CLUSTER_SECRET;

/// A fresh database on the shared test server (started on first use; that
/// blocks for a few seconds, so off the async threads).
async fn fresh_db() -> String {
    tokio::task::spawn_blocking(|| PgCluster::shared().map(|_| ()).map_err(|e| e.to_string()))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("no PostgreSQL for the cluster tests: {e}"));
    PgCluster::shared().unwrap().fresh_database().await
}

/// Starts `ids.len()` nodes on `db`, each in its own directory under `root`.
async fn start_nodes(root: &Path, db: &str, ids: &[&str], lease_extra: &str) -> Vec<Node> {
    let mut nodes = Vec::new();
    for id in ids {
        let dir = root.join(id);
        let db = db.to_owned();
        let id = (*id).to_owned();
        let lease_extra = lease_extra.to_owned();
        let node = tokio::task::spawn_blocking(move || {
            Node::from(
                support::berth()
                    .node(&dir)
                    .config(&support::cluster_config(
                        &dir,
                        &db,
                        &id,
                        SECRET,
                        &lease_extra,
                        "",
                    ))
                    .start(),
            )
        })
        .await
        .unwrap();
        nodes.push(node);
    }
    nodes
}

/// Pids of `user`'s main across the nodes' data dirs.
fn pids_everywhere(nodes: &[Node], user: &str) -> Vec<(usize, u32)> {
    nodes
        .iter()
        .enumerate()
        .flat_map(|(i, n)| {
            instance_pids(&n.data_dir, user, "main")
                .into_iter()
                .map(move |p| (i, p))
        })
        .collect()
}

/// Every live main program under the nodes' data dirs, by user, with the
/// index of its node: what [`instance_pids`] finds, for every user at once
/// in one pass over `/proc`.
fn mains_by_user(dirs: &[std::path::PathBuf]) -> BTreeMap<String, Vec<(usize, u32)>> {
    let mut mains: BTreeMap<String, Vec<(usize, u32)>> = BTreeMap::new();
    for p in instance_processes() {
        if p.role == "main"
            && let Some(node) = dirs.iter().position(|d| p.home.starts_with(d))
        {
            mains.entry(p.user).or_default().push((node, p.pid));
        }
    }
    mains
}

/// A thread that samples, over and over until stopped, every user's
/// running programs on every node, and keeps each sample in which a user
/// had more than one.
struct BurstWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<(usize, Vec<String>)>,
}

impl BurstWatch {
    fn start(nodes: &[Node]) -> Self {
        use std::sync::atomic::Ordering;
        let dirs: Vec<std::path::PathBuf> = nodes
            .iter()
            .map(|n| n.data_dir.canonicalize().unwrap())
            .collect();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let (mut samples, mut doubles) = (0, Vec::new());
            while !stopped.load(Ordering::Relaxed) {
                for (user, pids) in mains_by_user(&dirs) {
                    if pids.len() > 1 {
                        doubles.push(format!("{user}: {pids:?}"));
                    }
                }
                samples += 1;
                // A cadence, not a wait for anything: a second program
                // lives until fenced, far longer than this.
                std::thread::sleep(Duration::from_millis(20));
            }
            (samples, doubles)
        });
        Self { stop, thread }
    }

    /// The number of samples taken, and the doubles seen.
    fn stop(self) -> (usize, Vec<String>) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

/// Starts nodes whose programs report what they received (`berth demo-app`
/// with `BERTH_DEMO_ECHO=1`: `GET …/echo` shows the request headers and the
/// environment). Each berth also has the cluster secret in its own
/// environment, as the README's "Run a cluster" sets it, so the echo shows
/// whether berth's environment leaks into programs.
async fn start_echo_nodes(root: &Path, db: &str, ids: &[&str]) -> Vec<Node> {
    let mut nodes = Vec::new();
    for id in ids {
        let dir = root.join(id);
        let db = db.to_owned();
        let id = (*id).to_owned();
        let node = tokio::task::spawn_blocking(move || {
            berth()
                .env("BERTH_CLUSTER_SECRET", SECRET)
                .node(&dir)
                .config(&support::cluster_config_custom(
                    &dir,
                    &db,
                    &id,
                    SECRET,
                    CLUSTER_LEASE,
                    "env = { BERTH_DEMO_ECHO = \"1\" }\n",
                    "",
                ))
                .start()
        })
        .await
        .unwrap();
        nodes.push(Node::from(node));
    }
    nodes
}

/// `GET <url>/u/alice/echo` with `headers`: the program's report of what it
/// received, as JSON.
async fn echo(http: &reqwest::Client, url: &str, headers: &[(&str, &str)]) -> Value {
    let mut request = http.get(format!("{url}/u/alice/echo"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    assert_eq!(status, 200, "via {url}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not an echo ({e}): {text}"))
}

/// The values of header `name` in an echo.
fn echoed_header<'a>(echo: &'a Value, name: &str) -> Vec<&'a str> {
    echo["headers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|h| h[0].as_str().is_some_and(|n| n.eq_ignore_ascii_case(name)))
        .filter_map(|h| h[1].as_str())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_node_answers_for_a_user_running_on_another_node() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let nodes = start_echo_nodes(root.path(), &db, &["node-a", "node-b", "node-c"]).await;
    let (status, body) = nodes[0].post("/users/alice/instance", json!({})).await;
    assert!(status == 201 || status == 200, "{status} {body}");
    let owner = body["instance"]["node"].as_str().unwrap().to_owned();
    let epoch = body["instance"]["epoch"].as_i64().unwrap();
    let token = nodes[0].user_token("alice").await;
    let before = pids_everywhere(&nodes, "alice");
    assert_eq!(before.len(), 1, "one instance cluster-wide: {before:?}");

    for node in &nodes {
        let response = node
            .http
            .get(format!("{}/u/alice/", node.url))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let page = response.text().await.unwrap();
        assert_eq!(status, 200, "via {}: {page}", node.url);
        assert!(page.contains(r#"<b id="user">alice</b>"#), "{page}");
        assert!(page.contains(&format!("epoch <b>{epoch}</b>")), "{page}");

        // What the program received through this node (the owner itself,
        // or another node forwarding a signed request): the ordinary
        // header the client sent, and none of berth's credentials or a
        // node's signature, in the headers or in its environment.
        let bearer = format!("Bearer {token}");
        let seen = echo(
            &node.http,
            &node.url,
            &[("authorization", &bearer), ("x-probe", &node.url)],
        )
        .await;
        assert_eq!(
            echoed_header(&seen, "x-probe"),
            [node.url.as_str()],
            "{seen}"
        );
        assert_eq!(seen["env"]["BERTH_USER"], "alice", "{seen}");
        for name in [
            "x-berth-cluster-secret",
            "x-berth-forwarded-user",
            "x-berth-cluster-signature",
            "x-berth-cluster-nonce",
            "x-berth-cluster-timestamp",
            "authorization",
        ] {
            assert!(
                echoed_header(&seen, name).is_empty(),
                "{name} reached the program via {}: {seen}",
                node.url
            );
        }
        assert!(seen["env"].get("BERTH_CLUSTER_SECRET").is_none(), "{seen}");
        let text = seen.to_string();
        for (what, secret) in [
            ("the cluster secret", SECRET),
            ("alice's token", token.as_str()),
            ("the admin token", node.token.as_str()),
        ] {
            assert!(!text.contains(secret), "{what} reached the program: {text}");
        }
    }
    // Served by the same process throughout: nothing was started elsewhere.
    assert_eq!(pids_everywhere(&nodes, "alice"), before, "owner {owner}");

    // The echo would have shown the secret had it arrived: sent straight to
    // the program, past berth, it is there.
    let port = nodes[0].main_of("alice").await["port"].as_u64().unwrap();
    let direct = echo(
        &nodes[0].http,
        &format!("http://127.0.0.1:{port}"),
        &[("x-berth-cluster-secret", SECRET)],
    )
    .await;
    assert_eq!(
        echoed_header(&direct, "x-berth-cluster-secret"),
        [SECRET],
        "{direct}"
    );

    // The API of any node launches through the owner: 200, same instance.
    for node in &nodes {
        let (status, body) = node.post("/users/alice/instance", json!({})).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["instance"]["node"], owner.as_str(), "{body}");
    }
    assert_eq!(pids_everywhere(&nodes, "alice"), before);

    // Nodes advertise their real, bound addresses (public, and the
    // node-to-node listener's) and report their load.
    let (_, listed) = nodes[1].get("/nodes").await;
    let rows = listed["nodes"].as_array().unwrap();
    assert_eq!(rows.len(), 3, "{listed}");
    for node in &nodes {
        let internal = node.internal_url.as_deref().unwrap();
        assert!(
            rows.iter()
                .any(|r| r["advertise_url"] == node.url.as_str() && r["internal_url"] == internal),
            "{} missing from {listed}",
            node.url
        );
        assert_ne!(internal, node.url, "a listener of its own");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_launches_on_three_nodes_leave_one_instance_per_user() {
    const USERS: usize = 50;
    const LAUNCHES_PER_USER: usize = 20;
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let nodes = start_nodes(root.path(), &db, &["node-a", "node-b", "node-c"], "").await;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()
        .unwrap();
    // Watched all through the burst, not only once it settles: a second
    // program of one user, however brief its life, is the failure.
    let watch = BurstWatch::start(&nodes);
    let mut launches = Vec::new();
    for round in 0..LAUNCHES_PER_USER {
        for u in 0..USERS {
            let node = &nodes[(u + round) % nodes.len()];
            let request = client
                .post(node.api(&format!("/users/user{u}/instance")))
                .bearer_auth(&node.token)
                .json(&json!({}));
            launches.push(async move {
                match request.send().await {
                    Ok(r) => {
                        let status = r.status().as_u16();
                        (status, r.json::<Value>().await.unwrap_or(Value::Null))
                    }
                    Err(e) => (0, json!({ "transport": e.to_string() })),
                }
            });
        }
    }
    let answers = futures_util::future::join_all(launches).await;
    let mut by_status = std::collections::BTreeMap::<u16, usize>::new();
    for (status, body) in &answers {
        *by_status.entry(*status).or_default() += 1;
        // Success, or an answer to retry later; never a second instance and
        // never a refused claim leaking out as an error of our own making.
        assert!(
            matches!(status, 200 | 201 | 503),
            "unexpected answer {status}: {body}"
        );
    }
    eprintln!("launch answers by status: {by_status:?}");
    // A launch that only got "come back later" (the machine is slow) is
    // retried once, a few at a time, so every user ends up running.
    for u in 0..USERS {
        let user = format!("user{u}");
        eventually(Duration::from_secs(120), &format!("{user} running"), || {
            let node = &nodes[u % nodes.len()];
            let user = user.clone();
            async move {
                let main = node.main_of(&user).await;
                if main["status"] == "running" && main["ready"] == true {
                    return Some(());
                }
                if main.is_null() || main["status"] == "stopped" || main["status"] == "failed" {
                    let _ = node
                        .post(&format!("/users/{user}/instance?wait=false"), json!({}))
                        .await;
                }
                None
            }
        })
        .await;
    }
    let (samples, doubles) = watch.stop();
    assert!(samples > 1, "the watch sampled the burst");
    assert!(
        doubles.is_empty(),
        "two programs of one user at once: {doubles:?}"
    );
    // Exactly one live instance per user, cluster-wide: by processes and by
    // the store, and the two agree on the node.
    let (status, listed) = nodes[0].get("/instances").await;
    assert_eq!(status, 200);
    let records = listed["instances"].as_array().unwrap();
    let ids = ["node-a", "node-b", "node-c"];
    for u in 0..USERS {
        let user = format!("user{u}");
        let pids = pids_everywhere(&nodes, &user);
        assert_eq!(pids.len(), 1, "{user}: {pids:?}");
        let live: Vec<&Value> = records
            .iter()
            .filter(|r| r["user"] == user.as_str() && r["role"] == "main")
            .filter(|r| {
                matches!(
                    r["status"].as_str(),
                    Some("starting" | "running" | "crashed" | "hibernated")
                )
            })
            .collect();
        assert_eq!(live.len(), 1, "{user}: {live:?}");
        assert_eq!(live[0]["node"], ids[pids[0].0], "{user}");
        assert_eq!(
            live[0]["pid"].as_u64(),
            Some(u64::from(pids[0].1)),
            "{user}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_to_node_calls_need_the_cluster_secret() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let nodes = start_nodes(root.path(), &db, &["node-a"], "").await;
    let node = &nodes[0];
    let http = &node.http;
    for action in ["launch", "fence"] {
        let url = node.internal(&format!("/users/alice/{action}"));
        let body = json!({ "epoch": 1 });
        let attempts = [
            http.post(&url).json(&body),
            http.post(&url)
                .header("x-berth-cluster-secret", "wrong")
                .json(&body),
            // An admin token alone does not open node-to-node routes.
            http.post(&url).bearer_auth(&node.token).json(&body),
            // Nor does a signature made with another secret.
            berth_testkit::signed_request(
                http,
                "another-cluster-secret-0123456789abcdef",
                "node-a",
                reqwest::Method::POST,
                &url,
                Some(&body),
            ),
        ];
        for attempt in attempts {
            let r = attempt.send().await.unwrap();
            assert_eq!(r.status().as_u16(), 401, "{action}");
            let body: Value = r.json().await.unwrap();
            assert_eq!(body["error"], "unauthorized", "{body}");
        }
    }
    // A call signed with the secret opens them.
    assert_eq!(fence(node, "alice", 42).await["fenced"], false);
    // A forwarded proxy request with a wrong secret, or with the right one
    // bare, is refused too, even next to a valid user token.
    let token = node.user_token("alice").await;
    for secret in ["wrong", SECRET] {
        let r = http
            .get(format!("{}/u/alice/", node.url))
            .bearer_auth(&token)
            .header("x-berth-cluster-secret", secret)
            .header("x-berth-forwarded-user", "alice")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 401);
    }
    assert!(instance_pids(&node.data_dir, "alice", "main").is_empty());
}

/// Whoever learns the cluster secret is a node: it can run, stop and fence
/// anyone's instance. The secret used to travel in every node-to-node
/// call, so anyone who could see one call (on the network between nodes)
/// could replay it, or lift the secret from it. Now a call carries a
/// signature alone: the attacker below sends the bare secret (as calls
/// used to carry it), replays a call a node really made (captured by a
/// relay in front of node-b, as a man in the middle would) to node-b and
/// to node-a, replays a signed call with another body, and sends a call
/// signed long ago.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_node_call_can_be_neither_replayed_nor_mined_for_the_secret() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    // node-b advertises, as its node-to-node URL, a relay that records
    // what other nodes send it.
    let b_port = support::free_port();
    let (relay_url, captured) = recording_relay(b_port).await;
    let nodes = start_nodes(root.path(), &db, &["node-a"], "").await;
    let a = &nodes[0];
    let dir_b = root.path().join("node-b");
    let config_b = cluster_config(
        &dir_b,
        &db,
        "node-b",
        SECRET,
        "",
        &format!(
            "[cluster]\ninternal_listen = \"127.0.0.1:{b_port}\"\n\
             internal_advertise_url = \"{relay_url}\"\n"
        ),
    );
    let b = tokio::task::spawn_blocking(move || {
        Node::from(support::berth().node(&dir_b).config(&config_b).start())
    })
    .await
    .unwrap();

    // A real node-to-node call from node-a to node-b: revoking a token on
    // node-a purges node-b's token cache.
    let (status, minted) = a.post("/users/alice/tokens", json!({})).await;
    assert_eq!(status, 201, "{minted}");
    let id = minted["id"].as_str().unwrap();
    let status = a.delete(&format!("/users/alice/tokens/{id}")).await;
    assert_eq!(status, 200);
    let call = eventually(Duration::from_secs(10), "a captured purge", || async {
        captured_head(&captured, "POST /internal/v1/tokens/purge")
    })
    .await;
    let lower = call.to_ascii_lowercase();
    assert!(lower.contains("x-berth-cluster-signature:"), "{call}");
    assert!(!call.contains(SECRET), "the secret travelled: {call}");
    assert!(!lower.contains("x-berth-cluster-secret"), "{call}");

    // Replayed verbatim, straight to node-b: refused.
    let answer = raw(b_port, call.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("replayed"), "{answer}");

    // Played to node-a instead, which never saw its nonce: signed for
    // node-b, so refused too.
    let a_port = reqwest::Url::parse(a.internal_url.as_deref().unwrap())
        .unwrap()
        .port()
        .unwrap();
    let answer = raw(a_port, call.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("meant for this node"), "{answer}");

    // The bare secret, as calls used to carry it: refused.
    let r = b
        .http
        .post(format!(
            "http://127.0.0.1:{b_port}/internal/v1/tokens/purge"
        ))
        .header("x-berth-cluster-secret", SECRET)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["message"].as_str().unwrap().contains("never accepted"),
        "{body}"
    );

    // A signed fence whose body is swapped for another epoch: refused.
    let url = format!("http://127.0.0.1:{b_port}/internal/v1/users/alice/fence");
    let signed = berth_testkit::signed_request(
        &b.http,
        SECRET,
        "node-b",
        reqwest::Method::POST,
        &url,
        Some(&json!({ "epoch": 1 })),
    )
    .build()
    .unwrap();
    let mut swapped = b.http.post(&url).json(&json!({ "epoch": 2 }));
    for (name, value) in signed.headers() {
        if name.as_str().starts_with("x-berth-cluster-") {
            swapped = swapped.header(name, value);
        }
    }
    let r = swapped.send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert!(r.text().await.unwrap().contains("digest"));

    // Signed with the secret, but a minute ago (a call recorded then):
    // refused as stale, though its nonce was never seen.
    let mut stale = b.http.post(format!(
        "http://127.0.0.1:{b_port}/internal/v1/tokens/purge"
    ));
    for (name, value) in berth_testkit::signed_headers_at(
        SECRET,
        "node-b",
        "POST",
        "/internal/v1/tokens/purge",
        b"",
        berth_testkit::unix_millis() - 60_000,
    ) {
        stale = stale.header(name, value);
    }
    let r = stale.send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert!(r.text().await.unwrap().contains("clock"));
}

/// Node-to-node calls used to be served on the public listener, where
/// every client, and every program on the host, could reach them. Now they
/// have a listener of their own, on loopback unless configured otherwise,
/// whose URL the node advertises in the nodes table: the public listener
/// answers 404 to `/internal/…`, even to a correctly signed call, and the
/// node-to-node listener serves nothing else (no API, no app, no admin
/// page, not even `/healthz`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_to_node_api_is_served_only_on_its_own_listener() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let nodes = start_nodes(root.path(), &db, &["node-a"], "").await;
    let node = &nodes[0];
    let http = &node.http;
    let internal = node.internal_url.clone().expect("a node-to-node listener");
    let parsed = reqwest::Url::parse(&internal).unwrap();
    assert_eq!(parsed.host_str(), Some("127.0.0.1"), "loopback by default");
    assert_ne!(
        parsed.port(),
        reqwest::Url::parse(&node.url).unwrap().port(),
        "{internal} vs {}",
        node.url
    );
    let id = id_of(node).await;
    for (base, want) in [(node.url.as_str(), 404), (internal.as_str(), 200)] {
        for path in ["/tokens/purge", "/users/alice/fence"] {
            let body = path.ends_with("fence").then(|| json!({ "epoch": 1 }));
            let r = berth_testkit::signed_request(
                http,
                SECRET,
                &id,
                reqwest::Method::POST,
                &format!("{base}/internal/v1{path}"),
                body.as_ref(),
            )
            .send()
            .await
            .unwrap();
            assert_eq!(r.status().as_u16(), want, "{base}{path}");
        }
    }
    let token = node.user_token("alice").await;
    for (path, bearer) in [
        ("/healthz", node.token.as_str()),
        ("/api/v1/instances", node.token.as_str()),
        ("/metrics", node.token.as_str()),
        ("/admin/", node.token.as_str()),
        ("/u/alice/", token.as_str()),
    ] {
        let r = http
            .get(format!("{internal}{path}"))
            .bearer_auth(bearer)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 404, "{path} on {internal}");
    }
    assert!(instance_pids(&node.data_dir, "alice", "main").is_empty());
}

/// App traffic that one node forwards to the node running the user's
/// instance used to carry the bare cluster secret: whoever saw one such
/// request on the network between nodes could lift the secret and act as
/// any node. Now it carries a one-time signature for that node and that
/// user. node-a advertises a relay (a man in the middle) in front of its
/// public listener; alice's request through node-b is forwarded through it
/// and captured. The capture holds neither the secret nor alice's token;
/// replayed to node-a it is refused (its nonce is spent), played to node-b
/// it is refused (signed for node-a), turned into a request for bob it is
/// refused, and the bare secret opens nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_forwarded_request_can_be_neither_replayed_nor_mined_for_the_secret() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let a_port = support::free_port();
    let (relay_url, captured) = recording_relay(a_port).await;
    let dir_a = root.path().join("node-a");
    let config_a = cluster_config(
        &dir_a,
        &db,
        "node-a",
        SECRET,
        "",
        &format!("advertise_url = \"{relay_url}\"\n"),
    )
    .replacen(
        "listen = \"127.0.0.1:0\"",
        &format!("listen = \"127.0.0.1:{a_port}\""),
        1,
    );
    let a = tokio::task::spawn_blocking(move || {
        Node::from(support::berth().node(&dir_a).config(&config_a).start())
    })
    .await
    .unwrap();
    let others = start_nodes(root.path(), &db, &["node-b"], "").await;
    let b = &others[0];

    // alice runs on node-a, behind the relay: launched there the way
    // another node asks it to, whatever placement would choose.
    let body = launch_signed(&a, "node-a", "alice").await;
    assert_eq!(body["instance"]["node"], "node-a", "{body}");
    let token = a.user_token("alice").await;
    let r = b
        .http
        .get(format!("{}/u/alice/", b.url))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(
        r.text()
            .await
            .unwrap()
            .contains(r#"<b id="user">alice</b>"#)
    );
    let head = eventually(Duration::from_secs(10), "a captured forward", || async {
        captured_head(&captured, "GET /u/alice/ ")
    })
    .await;
    let lower = head.to_ascii_lowercase();
    assert!(lower.contains("x-berth-cluster-signature:"), "{head}");
    assert!(
        lower.contains("x-berth-forwarded-user: alice\r\n"),
        "{head}"
    );
    assert!(!head.contains(SECRET), "the secret travelled: {head}");
    assert!(!lower.contains("x-berth-cluster-secret"), "{head}");
    assert!(!head.contains(&token), "alice's token travelled: {head}");

    // Replayed verbatim, straight to node-a: refused.
    let answer = raw(a_port, head.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("replayed"), "{answer}");
    // Played to node-b, which never saw its nonce: signed for node-a.
    let b_port = reqwest::Url::parse(&b.url).unwrap().port().unwrap();
    let answer = raw(b_port, head.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("meant for this node"), "{answer}");
    // Made into a request for bob's app, path and user both: refused.
    assert!(head.contains("x-berth-forwarded-user: alice"), "{head}");
    let for_bob = head.replacen("GET /u/alice/ ", "GET /u/bob/ ", 1).replacen(
        "x-berth-forwarded-user: alice",
        "x-berth-forwarded-user: bob",
        1,
    );
    let answer = raw(a_port, for_bob.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    // The bare secret, as forwarded requests used to carry it: refused.
    for user in ["alice", "bob"] {
        let request = format!(
            "GET /u/{user}/ HTTP/1.1\r\nHost: 127.0.0.1\r\nx-berth-cluster-secret: {SECRET}\r\n\
             x-berth-forwarded-user: {user}\r\nConnection: close\r\n\r\n"
        );
        let answer = raw(a_port, request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 401"), "{user}: {answer}");
        assert!(answer.contains("never accepted"), "{user}: {answer}");
    }
    for node in [&a, b] {
        assert!(
            instance_pids(&node.data_dir, "bob", "main").is_empty(),
            "bob was woken"
        );
    }
}

/// A relay on a free loopback port that passes every connection on to
/// `port` and records what clients send through it, as a man in the
/// middle on the network between nodes would: its URL and the recording.
async fn recording_relay(port: u16) -> (String, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_url = format!("http://{}", relay.local_addr().unwrap());
    let captured = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
    let record = captured.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut client, _)) = relay.accept().await else {
                return;
            };
            let record = record.clone();
            tokio::spawn(async move {
                let Ok(mut upstream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await
                else {
                    return;
                };
                let (mut client_read, mut client_write) = client.split();
                let (mut up_read, mut up_write) = upstream.split();
                let forward = async {
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        let n = client_read.read(&mut buf).await.unwrap_or(0);
                        if n == 0 {
                            break;
                        }
                        record.lock().unwrap().extend_from_slice(&buf[..n]);
                        if up_write.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    let _ = up_write.shutdown().await;
                };
                let back = async {
                    let _ = tokio::io::copy(&mut up_read, &mut client_write).await;
                    let _ = client_write.shutdown().await;
                };
                tokio::join!(forward, back);
            });
        }
    });
    (relay_url, captured)
}

/// The head of the first request in `captured` whose request line starts
/// with `line`, once it is all in.
fn captured_head(captured: &std::sync::Mutex<Vec<u8>>, line: &str) -> Option<String> {
    let bytes = captured.lock().unwrap().clone();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let start = text.find(line)?;
    let end = text[start..].find("\r\n\r\n")? + start + 4;
    Some(text[start..end].to_owned())
}

/// Sends `request` on a fresh connection to `port` and reads the answer
/// until the server closes it or its head and a short body are in.
async fn raw(port: u16, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    stream.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).await.unwrap_or(0);
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&answer);
        // The API answers JSON errors with a length: enough once it is in.
        if let Some(head_end) = text.find("\r\n\r\n") {
            let length = text[..head_end].lines().find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().parse::<usize>().unwrap_or(0))
            });
            if let Some(length) = length
                && answer.len() >= head_end + 4 + length
            {
                break;
            }
        }
    }
    String::from_utf8_lossy(&answer).into_owned()
}

/// Wrong guesses at the node-to-node API used to be answered as fast as
/// they came (thousands a second) and logged nowhere. Now, past a small
/// burst, a source's failures get `429`, and berth logs the refusals with
/// the source address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_wrong_guesses_is_rate_limited_and_logged() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("node-a");
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("berth.log");
    let config = cluster_config(&dir, &db, "node-a", SECRET, "", "");
    let options = support::StartOptions {
        stderr: Some(log.clone()),
        ..support::StartOptions::default()
    };
    let node = tokio::task::spawn_blocking(move || {
        Node::from(
            support::berth()
                .node(&dir)
                .config(&config)
                .options(options)
                .start(),
        )
    })
    .await
    .unwrap();
    let url = node.internal("/tokens/purge");
    let mut statuses = Vec::new();
    for guess in 0..40 {
        let r = node
            .http
            .post(&url)
            .header("x-berth-cluster-secret", format!("guess-{guess}"))
            .send()
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
    }
    // A fresh source has a burst of 10; one more is earned back a second,
    // far slower than 40 requests take.
    assert!(statuses[..10].iter().all(|s| *s == 401), "{statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == 401 || *s == 429),
        "{statuses:?}"
    );
    assert!(statuses.contains(&429), "no limit: {statuses:?}");
    // Still limited: the answer is the contract's error, with when to retry.
    let r = node
        .http
        .post(&url)
        .header("x-berth-cluster-secret", "one-more-guess")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let body: berth_core::ErrorBody = r.json().await.unwrap();
    assert_eq!(
        body.error,
        berth_core::ErrorCode::TooManyRequests,
        "{body:?}"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("refused a node-to-node call"))
        .unwrap_or_else(|| panic!("no log line: {text}"));
    assert!(line.contains("127.0.0.1"), "{line}");
    // Bounded: not a line per guess.
    let lines = text
        .lines()
        .filter(|l| l.contains("refused a node-to-node call"))
        .count();
    assert!(lines < 10, "{lines} lines");
    // The node's own cluster still works: a signed call passes, even from
    // the address that is being limited.
    assert_eq!(fence(&node, "alice", 7).await["fenced"], false);
}

/// `berth serve` with `args` and `env`, in `dir`, until it listens or
/// exits.
struct Serve {
    child: std::process::Child,
    stderr: std::path::PathBuf,
}

impl Serve {
    fn start(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        support::reachable_by_instances(dir);
        let stderr = dir.join("stderr.log");
        let child = std::process::Command::new(BERTH)
            .arg("serve")
            .args(args)
            .env_remove("BERTH_STORE")
            .env_remove("BERTH_CLUSTER_SECRET")
            .envs(env.iter().copied())
            .current_dir(dir)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        Self { child, stderr }
    }

    /// `Ok(pid)` once it listens, `Err(stderr)` when it exits first.
    fn listening(&mut self) -> Result<u32, String> {
        use std::io::BufRead;
        let stdout = self.child.stdout.take().unwrap();
        for line in std::io::BufReader::new(stdout).lines() {
            if line.unwrap_or_default().starts_with("berth: listening on ") {
                return Ok(self.child.id());
            }
        }
        let status = self.child.wait().unwrap();
        let stderr = std::fs::read_to_string(&self.stderr).unwrap();
        assert!(!status.success(), "{stderr}");
        Err(stderr)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `/proc/<pid>/<file>` as uid and gid 65534 (`nobody`), the way any
/// program berth runs under an account of its own reads it.
fn read_proc_as_nobody(pid: u32, file: &str) -> String {
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "cat"])
        .arg(format!("/proc/{pid}/{file}"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).replace('\0', " ")
}

/// `db`'s URL with a password in it (the test server trusts local
/// connections, so any password opens it).
fn with_password(db: &str, password: &str) -> String {
    let mut url = reqwest::Url::parse(db).unwrap();
    url.set_password(Some(password)).unwrap();
    url.to_string()
}

/// The database's password on berth's command line was readable by every
/// user of the host in `/proc/<berth>/cmdline`, the instances' own
/// accounts included. berth now refuses such a `--store`, saying where
/// the URL may go instead, and never echoes the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_password_on_the_command_line_is_refused() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().to_owned();
    let store = with_password(&db, "hunter2-on-argv");
    let data = dir.join("data");
    let data = data.to_str().unwrap().to_owned();
    let stderr = tokio::task::spawn_blocking(move || {
        let mut serve = Serve::start(
            &dir,
            &[
                "--store",
                &store,
                "--data-dir",
                &data,
                "--listen",
                "127.0.0.1:0",
                "--node-id",
                "node-a",
            ],
            &[("BERTH_CLUSTER_SECRET", SECRET)],
        );
        match serve.listening() {
            Ok(pid) => panic!(
                "berth started; uid 65534 reads its command line: {}",
                read_proc_as_nobody(pid, "cmdline")
            ),
            Err(stderr) => stderr,
        }
    })
    .await
    .unwrap();
    for part in [
        "flag --store",
        "password",
        "BERTH_STORE",
        "BERTH_STORE_FILE",
        "store_file",
    ] {
        assert!(stderr.contains(part), "{part:?} missing: {stderr}");
    }
    assert!(!stderr.contains("hunter2-on-argv"), "{stderr}");
}

/// The ways a store password may reach berth, each checked for what
/// another uid (and berth's own uid) can read afterwards: a store file
/// (`BERTH_STORE_FILE`) must be private, and is refused otherwise naming
/// the `chmod` that fixes it; a private one works, and the password is
/// in neither `/proc/<berth>/cmdline` nor `/proc/<berth>/environ`. Given
/// in `BERTH_STORE`, the password is wiped from berth's environment once
/// read. An admin token file that others can read is refused too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_password_reaches_berth_only_privately() {
    // It reads /proc as another account (setpriv), which only root may be.
    if !support::privileged("a store password reaches berth only privately") {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let root_path = root.path().to_owned();
    let password = "hunter2-in-a-file";
    let store = with_password(&db, password);
    tokio::task::spawn_blocking(move || {
        let common = |dir: &Path, id: &str| {
            vec![
                "--data-dir".to_owned(),
                dir.join("data").to_str().unwrap().to_owned(),
                "--listen".to_owned(),
                "127.0.0.1:0".to_owned(),
                "--node-id".to_owned(),
                id.to_owned(),
            ]
        };

        // A store file others can read: refused, naming it and the fix.
        let dir = root_path.join("file");
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("store.url");
        std::fs::write(&file, format!("{store}\n")).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let file_text = file.to_str().unwrap().to_owned();
        let argv = common(&dir, "node-file");
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let env = [
            ("BERTH_STORE_FILE", file_text.as_str()),
            ("BERTH_CLUSTER_SECRET", SECRET),
        ];
        let stderr = Serve::start(&dir, &argv, &env)
            .listening()
            .expect_err("berth started on a store file that others can read");
        assert!(
            stderr.contains(&format!("chmod 600 {}", file.display())),
            "{stderr}"
        );
        assert!(!stderr.contains(password), "{stderr}");

        // Private: berth runs on it, as a cluster node, and the password
        // shows nowhere in /proc.
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let mut serve = Serve::start(&dir, &argv, &env);
        let pid = serve
            .listening()
            .expect("berth starts on a private store file");
        let cmdline = read_proc_as_nobody(pid, "cmdline");
        assert!(!cmdline.contains(password), "{cmdline}");
        let environ =
            String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/environ")).unwrap())
                .into_owned();
        assert!(!environ.contains(password), "{environ}");
        // The file's store it is, not the default SQLite one.
        assert!(!dir.join("data").join("berth.db").exists());
        drop(serve);

        // In BERTH_STORE: wiped from the environment once read.
        let dir = root_path.join("env");
        let argv = common(&dir, "node-env");
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let mut serve = Serve::start(
            &dir,
            &argv,
            &[
                ("BERTH_STORE", store.as_str()),
                ("BERTH_CLUSTER_SECRET", SECRET),
            ],
        );
        let pid = serve.listening().expect("berth starts with BERTH_STORE");
        let environ =
            String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/environ")).unwrap())
                .into_owned();
        assert!(!environ.contains(password), "BERTH_STORE stayed: {environ}");
        assert!(!read_proc_as_nobody(pid, "cmdline").contains(password));
        drop(serve);

        // An admin token file that others can read: refused.
        let dir = root_path.join("token");
        std::fs::create_dir_all(dir.join("data")).unwrap();
        let token = dir.join("data").join("admin.token");
        std::fs::write(&token, "adm1n\n").unwrap();
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
        let argv = common(&dir, "node-token");
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let stderr = Serve::start(&dir, &argv, &[])
            .listening()
            .expect_err("berth started on an admin token file that others can read");
        assert!(
            stderr.contains(&format!("chmod 600 {}", token.display())),
            "{stderr}"
        );
    })
    .await
    .unwrap();
}

/// The README's cluster example exported `BERTH_CLUSTER_SECRET=change-me`,
/// and berth accepted it: whoever read the README could act as a node.
/// berth refuses it at start, naming the variable and how to make a good
/// secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_example_cluster_secret_is_refused() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().to_owned();
    let stderr = tokio::task::spawn_blocking(move || {
        let data = dir.join("data");
        let mut serve = Serve::start(
            &dir,
            &[
                "--data-dir",
                data.to_str().unwrap(),
                "--listen",
                "127.0.0.1:0",
                "--node-id",
                "node-a",
            ],
            &[
                ("BERTH_STORE", db.as_str()),
                ("BERTH_CLUSTER_SECRET", "change-me"),
            ],
        );
        serve
            .listening()
            .expect_err("berth started with the cluster secret change-me")
    })
    .await
    .unwrap();
    assert!(
        stderr.contains("environment variable BERTH_CLUSTER_SECRET: cluster_secret: "),
        "{stderr}"
    );
    for part in [
        "at least 32",
        "openssl rand -hex 32",
        "head -c32 /dev/urandom | base64",
    ] {
        assert!(stderr.contains(part), "{part:?} missing: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_id_that_is_already_live_is_refused() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let nodes = start_nodes(root.path(), &db, &["node-a"], "").await;
    let dir = root.path().join("impostor");
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("berth.toml");
    berth_testkit::write_private(
        &config,
        &cluster_config(&dir, &db, "node-a", SECRET, "", ""),
        None,
    );
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(BERTH)
            .args(["serve", "--config", config.to_str().unwrap()])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    for part in ["\"node-a\"", "already in use", "heartbeat", &nodes[0].url] {
        assert!(stderr.contains(part), "{part:?} missing from: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_store_is_a_clear_startup_error() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().to_owned();
    let config = dir.join("berth.toml");
    berth_testkit::write_private(
        &config,
        &cluster_config(
            &dir,
            "postgres://berth@127.0.0.1:1/x",
            "node-a",
            SECRET,
            "",
            "",
        ),
        None,
    );
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(BERTH)
            .args(["serve", "--config", config.to_str().unwrap()])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("cannot open the store"), "{stderr}");
    assert!(stderr.contains("127.0.0.1:1"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_node_gets_no_new_instances() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let nodes = start_nodes(root.path(), &db, &["node-a", "node-b"], "").await;
    let (status, body) = nodes[1].post("/node/drain", json!({})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "draining");
    let (_, listed) = nodes[0].get("/nodes").await;
    assert!(
        listed["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["id"] == "node-b" && n["status"] == "draining"),
        "{listed}"
    );
    // No wait for other nodes to notice: a placement reads every node's
    // status in the store, in the transaction that reserves the place.
    for (i, user) in ["d1", "d2", "d3", "d4"].iter().enumerate() {
        let (status, body) = nodes[i % 2]
            .post(&format!("/users/{user}/instance"), json!({}))
            .await;
        assert_eq!(status, 201, "{body}");
        assert_eq!(body["instance"]["node"], "node-a", "{user}: {body}");
    }
    assert!(instance_pids(&nodes[1].data_dir, "d1", "main").is_empty());
    // The proxy places the same way: a woken user lands on node-a too.
    let token = nodes[1].user_token("d5").await;
    let r = nodes[1]
        .http
        .get(format!("{}/u/d5/", nodes[1].url))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(nodes[0].main_of("d5").await["node"], "node-a");

    let (status, body) = nodes[1].post("/node/undrain", json!({})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "up");
    // node-b is now the emptier node: new users go there.
    let (status, body) = nodes[0].post("/users/u6/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["instance"]["node"], "node-b", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_takeover_moves_a_user_whose_holder_was_killed() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let mut nodes = start_nodes(
        root.path(),
        &db,
        &["node-a", "node-b"],
        "takeover = \"manual\"\n",
    )
    .await;
    let (status, body) = nodes[0]
        .post("/users/alice/instance", json!({ "folder": "proj" }))
        .await;
    assert_eq!(status, 201, "{body}");
    // The node that runs alice first, the survivor second.
    let holder = holder_of(&nodes, &body).await;
    nodes.swap(0, holder);
    let survivor = id_of(&nodes[1]).await;
    let old_pid = instance_pids(&nodes[0].data_dir, "alice", "main");
    assert_eq!(old_pid.len(), 1);
    let old_pid = old_pid[0];

    nodes[0].kill9();
    // The lease runs out and the holder's heartbeat goes stale: the survivor reports
    // it, with the holder not alive, but under "manual" does nothing.
    let b = &nodes[1];
    eventually(
        Duration::from_secs(30),
        "alice's lease reported expired",
        || async {
            let (_, leases) = b.get("/leases?expired=true").await;
            leases["leases"]
                .as_array()?
                .iter()
                .any(|l| l["user"] == "alice" && l["holder_alive"] == false)
                .then_some(())
        },
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "the expired-lease gauge",
        || async {
            let text = b
                .http
                .get(format!("{}/metrics", b.url))
                .bearer_auth(&b.token)
                .send()
                .await
                .ok()?
                .text()
                .await
                .ok()?;
            text.lines()
                .any(|l| l.trim() == "berth_expired_leases 1")
                .then_some(())
        },
    )
    .await;
    // The shim froze the orphaned instance when berth stopped extending
    // its deadline.
    eventually(
        Duration::from_secs(10),
        "the old instance frozen",
        || async { (frozen(old_pid) || proc_state(old_pid).is_none()).then_some(()) },
    )
    .await;
    assert!(
        instance_pids(&b.data_dir, "alice", "main").is_empty(),
        "manual: no automatic relaunch"
    );

    let out = b.cli(&["takeover", "alice"]);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let main = b.running_main("alice", Some(u64::from(old_pid))).await;
    assert_eq!(main["node"], survivor.as_str(), "{main}");
    assert_eq!(
        main["folder"], "proj",
        "launched with its parameters: {main}"
    );
    let new_pids = instance_pids(&b.data_dir, "alice", "main");
    assert_eq!(new_pids.len(), 1);
    // The old one never runs again: frozen, or gone.
    assert!(frozen(old_pid) || proc_state(old_pid).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_evidence_a_dead_holders_users_are_relaunched_elsewhere() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let mut nodes = start_nodes(root.path(), &db, &["node-a", "node-b"], "").await;
    let (status, body) = nodes[0]
        .post(
            "/users/alice/instance",
            json!({ "folder": "work", "patch": "k: v\n" }),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    // Placement chose either node (ties go by a hash of the user): the
    // one that runs alice comes first, the survivor second.
    if body["instance"]["node"] == "node-b" {
        nodes.swap(0, 1);
    }
    let survivor = id_of(&nodes[1]).await;
    let old_epoch = body["instance"]["epoch"].as_i64().unwrap();
    let old_pid = instance_pids(&nodes[0].data_dir, "alice", "main")[0];
    let uid_of = |pid: u32| {
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(format!("/proc/{pid}")).unwrap())
    };
    // As root, instances run under the user's account (level `user`).
    let account = uid_of(old_pid);

    nodes[0].kill9();
    let b = &nodes[1];
    let main = eventually(
        Duration::from_secs(60),
        "alice relaunched on the survivor",
        || async {
            let main = b.main_of("alice").await;
            (main["node"] == survivor.as_str()
                && main["status"] == "running"
                && main["ready"] == true)
                .then_some(main)
        },
    )
    .await;
    assert!(main["epoch"].as_i64().unwrap() > old_epoch, "{main}");
    assert_eq!(main["folder"], "work", "{main}");
    let patch = std::fs::read_to_string(b.data_dir.join("users/alice/patches/main.yaml")).unwrap();
    assert_eq!(patch, "k: v\n");
    // The old instance was frozen by its shim before anyone could claim.
    assert!(frozen(old_pid) || proc_state(old_pid).is_none());
    let new_pids = instance_pids(&b.data_dir, "alice", "main");
    assert_eq!(new_pids.len(), 1);
    // The account is the cluster's, not the node's: the same uid here.
    assert_eq!(uid_of(new_pids[0]), account);
    if nix::unistd::geteuid().is_root() {
        assert_ne!(account, 0, "as root, the instance runs under an account");
    }
    assert_eq!(b.metric("berth_failovers_total").await, Some(1.0));
}

/// A GET of `user`'s app sent to `node` the way another node forwards it:
/// signed for `node` and the user, no user token.
async fn forwarded_get(node: &Node, user: &str) -> (u16, String) {
    let target = format!("/u/{user}/");
    let mut request = node.http.get(format!("{}{target}", node.url));
    for (name, value) in
        berth_testkit::forward_headers(SECRET, &id_of(node).await, "GET", &target, user)
    {
        request = request.header(name, value);
    }
    let r = request.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// A request another node forwarded is served where it lands, never
/// forwarded again (ARCHITECTURE.md, invariant 10): nodes
/// whose views differ for a moment cannot bounce a request between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_request_is_never_forwarded_again() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let nodes = start_nodes(root.path(), &db, &["node-a", "node-b"], "").await;

    // alice runs where placement puts her (`a`); `b` is the other node.
    let (status, body) = nodes[0].post("/users/alice/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    let holder = holder_of(&nodes, &body).await;
    let (a, b) = (&nodes[holder], &nodes[1 - holder]);
    let alice = pids_everywhere(&nodes, "alice");
    assert_eq!(alice.len(), 1, "{alice:?}");

    // An ordinary request through `b` is forwarded to `a`…
    let token = a.user_token("alice").await;
    let r = b
        .http
        .get(format!("{}/u/alice/", b.url))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.text().await.unwrap().contains("alice"));
    // …but one that `b` received as forwarded is not: `b` wakes
    // alice itself, and its claim meets `a`'s live lease (a browser's
    // navigation would get the starting page instead, whose reload is
    // routed afresh: `a_browser_through_another_node_…`).
    let (status, body) = forwarded_get(b, "alice").await;
    assert_eq!(status, 409, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"], "lease_busy", "{body}");
    assert_eq!(pids_everywhere(&nodes, "alice"), alice, "alice untouched");

    // bob last ran on the node placement chose for him (`home`; `away` is
    // the other), so placement sends him there again (sticky)…
    let (status, body) = a.post("/users/bob/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    let bob_home = holder_of(&nodes, &body).await;
    let (home, away) = (&nodes[bob_home], &nodes[1 - bob_home]);
    let home_id = id_of(home).await;
    assert_eq!(a.delete("/users/bob/instance").await, 204);
    eventually(Duration::from_secs(30), "bob stopped", || async {
        pids_everywhere(&nodes, "bob").is_empty().then_some(())
    })
    .await;
    let bob_token = a.user_token("bob").await;
    let r = away
        .http
        .get(format!("{}/u/bob/", away.url))
        .bearer_auth(&bob_token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(a.main_of("bob").await["node"], home_id.as_str());
    assert_eq!(a.delete("/users/bob/instance").await, 204);
    eventually(Duration::from_secs(30), "bob stopped again", || async {
        pids_everywhere(&nodes, "bob").is_empty().then_some(())
    })
    .await;
    // …yet a request forwarded to `away` wakes him on `away`, where it
    // landed.
    let (status, page) = forwarded_get(away, "bob").await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains(r#"<b id="user">bob</b>"#), "{page}");
    assert_eq!(b.main_of("bob").await["node"], id_of(away).await.as_str());
    let bob = pids_everywhere(&nodes, "bob");
    assert_eq!(bob.len(), 1, "{bob:?}");
    assert_eq!(bob[0].0, 1 - bob_home, "bob runs on `away`: {bob:?}");
}

/// Which of `nodes` runs the instance a launch answered with (its
/// `instance.node`). Placement breaks ties between equally loaded nodes by
/// a hash of the user, so a new user on an empty cluster may land on any
/// node: a test that needs "the owner" and "another node" takes them from
/// the answer.
async fn holder_of(nodes: &[Node], launched: &Value) -> usize {
    let holder = launched["instance"]["node"]
        .as_str()
        .unwrap_or_else(|| panic!("no node in {launched}"));
    for (i, node) in nodes.iter().enumerate() {
        if id_of(node).await == holder {
            return i;
        }
    }
    panic!("{holder} is none of the nodes: {launched}")
}

/// The id of `node`, as the nodes table has it (what a node-to-node call
/// is signed for): the row that advertises the node's URL.
async fn id_of(node: &Node) -> String {
    let (status, body) = node.get("/nodes").await;
    assert_eq!(status, 200, "{body}");
    body["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["advertise_url"] == node.url.as_str())
        .and_then(|n| n["id"].as_str())
        .unwrap_or_else(|| panic!("{} is not among {body}", node.url))
        .to_owned()
}

/// `POST /internal/v1/users/{user}/fence` as another node sends it.
async fn fence(node: &Node, user: &str, epoch: i64) -> Value {
    let r = berth_testkit::signed_request(
        &node.http,
        SECRET,
        &id_of(node).await,
        reqwest::Method::POST,
        &node.internal(&format!("/users/{user}/fence")),
        Some(&json!({ "epoch": epoch })),
    )
    .send()
    .await
    .unwrap();
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{body}");
    body
}

/// A fence names the holder's epoch: an older one (a late fence from an
/// earlier failover) or a newer one fences nothing and the instance runs
/// on; only exactly the running epoch stops it, on the node that runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_acts_only_on_exactly_the_running_epoch() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let nodes = start_nodes(root.path(), &db, &["node-a", "node-b"], "").await;

    // Two launches, so the running epoch has a real predecessor.
    let (status, body) = nodes[0].post("/users/alice/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    let first = body["instance"]["epoch"].as_i64().unwrap();
    assert_eq!(nodes[0].delete("/users/alice/instance").await, 204);
    let (status, body) = nodes[0].post("/users/alice/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    // `a` runs her (placement's choice), `b` is the other node.
    let holder = holder_of(&nodes, &body).await;
    let (a, b) = (&nodes[holder], &nodes[1 - holder]);
    let epoch = body["instance"]["epoch"].as_i64().unwrap();
    assert!(epoch > first, "{first} then {epoch}");
    let running = a.running_main("alice", None).await;
    let pid = running["pid"].as_u64().unwrap();

    let untouched = |what: &str| {
        let what = what.to_owned();
        async move {
            assert!(alive(pid), "{what}: the instance is gone");
            assert!(!frozen(pid as u32), "{what}: frozen");
            let main = a.main_of("alice").await;
            assert_eq!(main["status"], "running", "{what}: {main}");
            assert_eq!(main["pid"].as_u64(), Some(pid), "{what}: {main}");
            assert_eq!(main["epoch"].as_i64(), Some(epoch), "{what}: {main}");
        }
    };
    for (what, node, wrong) in [
        ("an older epoch", a, first),
        ("the epoch before", a, epoch - 1),
        ("a newer epoch", a, epoch + 1),
        ("the right epoch on the wrong node", b, epoch),
    ] {
        let answer = fence(node, "alice", wrong).await;
        assert_eq!(answer["fenced"], false, "{what}: {answer}");
        untouched(what).await;
    }
    // The instance still serves.
    let token = a.user_token("alice").await;
    let r = a
        .http
        .get(format!("{}/u/alice/", a.url))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);

    // Exactly the running epoch, on its node: fenced, and gone.
    let answer = fence(a, "alice", epoch).await;
    assert_eq!(answer["fenced"], true, "{answer}");
    eventually(
        Duration::from_secs(30),
        "the fenced instance gone",
        || async { (!alive(pid)).then_some(()) },
    )
    .await;
    let main = eventually(Duration::from_secs(30), "the record stopped", || async {
        let main = a.main_of("alice").await;
        (main["status"] == "stopped").then_some(main)
    })
    .await;
    assert!(
        main["last_error"].as_str().unwrap_or("").contains("fenced"),
        "{main}"
    );
    assert!(pids_everywhere(&nodes, "alice").is_empty());
}

/// A revoked token gets 401 at once on every node: the node that revoked
/// it empties the other nodes' token caches before it answers, so a node
/// that had just accepted the token (and cached it) refuses it on the very
/// next request, through the proxy and the API alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_token_gets_401_at_once_on_every_node() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let nodes = start_nodes(root.path(), &db, &["node-a", "node-b"], "").await;
    let (status, body) = nodes[0].post("/users/alice/instance", json!({})).await;
    assert!(status == 201 || status == 200, "{status} {body}");
    let (status, minted) = nodes[0].post("/users/alice/tokens", json!({})).await;
    assert_eq!(status, 201, "{minted}");
    let token = minted["token"].as_str().unwrap().to_owned();
    let id = minted["id"].as_str().unwrap().to_owned();

    let app = |node: &Node| {
        node.http
            .get(format!("{}/u/alice/", node.url))
            .bearer_auth(&token)
            .send()
    };
    let api = |node: &Node| {
        node.http
            .get(node.api("/users/alice/instance"))
            .bearer_auth(&token)
            .send()
    };
    // Every node accepts (and caches) the token.
    for node in &nodes {
        assert_eq!(app(node).await.unwrap().status(), 200, "{}", node.url);
        assert_eq!(api(node).await.unwrap().status(), 200, "{}", node.url);
    }

    // Revoked through node-a; node-b refuses it on the next request.
    let status = nodes[0].delete(&format!("/users/alice/tokens/{id}")).await;
    assert_eq!(status, 200);
    for node in nodes.iter().rev() {
        assert_eq!(app(node).await.unwrap().status(), 401, "{}", node.url);
        assert_eq!(api(node).await.unwrap().status(), 401, "{}", node.url);
    }

    // And the other way round, with a token node-b minted.
    let (_, minted) = nodes[1].post("/users/alice/tokens", json!({})).await;
    let token = minted["token"].as_str().unwrap().to_owned();
    let id = minted["id"].as_str().unwrap().to_owned();
    let app = |node: &Node| {
        node.http
            .get(format!("{}/u/alice/", node.url))
            .bearer_auth(&token)
            .send()
    };
    for node in &nodes {
        assert_eq!(app(node).await.unwrap().status(), 200, "{}", node.url);
    }
    let r = nodes[1]
        .http
        .delete(nodes[1].api(&format!("/users/alice/tokens/{id}")))
        .bearer_auth(&nodes[1].token)
        .send()
        .await
        .unwrap();
    let answer: Value = r.json().await.unwrap();
    assert_eq!(answer["unreached_nodes"], json!([]), "{answer}");
    for node in &nodes {
        assert_eq!(app(node).await.unwrap().status(), 401, "{}", node.url);
    }
}

// --- node identity across restarts -------------------------------------------

/// `config` listening on the address of `url` (a node that ran there
/// before) instead of a free port: a restarted node answers where its
/// predecessor did.
fn config_on_same_address(config: &str, url: &str) -> String {
    let addr = url.strip_prefix("http://").unwrap();
    assert!(config.contains("listen = \"127.0.0.1:0\""), "{config}");
    config.replacen(
        "listen = \"127.0.0.1:0\"",
        &format!("listen = \"{addr}\""),
        1,
    )
}

/// `berth serve` on `config` (written to `dir/other.toml`), expected to
/// refuse to start: its stderr.
async fn refused_start(dir: &Path, config: &str) -> String {
    let path = dir.join("other.toml");
    berth_testkit::write_private(&path, config, None);
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(BERTH)
            .args(["serve", "--config", path.to_str().unwrap()])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "it started: {stderr}");
    stderr
}

/// A node killed with `kill -9` and started again at once with the same
/// node id and data dir proves its predecessor dead (the data dir's lock
/// is free, and its row was claimed from this data dir): it answers well
/// within one lease TTL, not after the old heartbeat expires, and adopts its
/// instances, same pids. While it lives, a second process with its id is
/// refused with a clear message, from its data dir or any other, and so
/// it is while the first is paused (SIGSTOP): a paused process still
/// holds its lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_after_kill_9_starts_at_once_and_adopts_its_instances() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    // A TTL twice the patience below: a restart that waited for the old
    // heartbeat to expire could not answer within it, however fast the
    // machine. How fast a restart is belongs in BENCHMARKS.md.
    let lease = "ttl_ms = 30000\nrenew_ms = 1000\nfence_after_ms = 20000\n";
    let dir = root.path().join("node-a");
    let db_ = db.clone();
    let dir_ = dir.clone();
    let mut first = tokio::task::spawn_blocking(move || {
        Node::from(
            support::berth()
                .node(&dir_)
                .config(&support::cluster_config_custom(
                    &dir_, &db_, "node-a", SECRET, lease, "", "",
                ))
                .start(),
        )
    })
    .await
    .unwrap();
    let mut before = Vec::new();
    for user in ["alice", "bob"] {
        let (status, body) = first
            .post(&format!("/users/{user}/instance"), json!({}))
            .await;
        assert_eq!(status, 201, "{body}");
        let main = first.running_main(user, None).await;
        before.push((user, main["pid"].as_u64().unwrap(), main["epoch"].clone()));
    }
    let url = first.url.clone();
    let original = std::fs::read_to_string(dir.join("berth.toml")).unwrap();
    let same_address = config_on_same_address(&original, &url);

    first.kill9();
    // Nothing the dead berth started holds its lock: its shims and
    // programs run on, yet the lock is free (close-on-exec).
    let lock = std::fs::File::open(first.data_dir.join("node.lock")).unwrap();
    let held = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map_err(|(_, e)| e)
        .expect("the dead berth's lock is free while its instances run");
    drop(held);
    for (user, pid, _) in &before {
        assert!(alive(*pid), "{user} outlived berth");
    }
    let restart = {
        let dir = dir.clone();
        let config = same_address.clone();
        tokio::task::spawn_blocking(move || {
            Node::from(support::berth().node(&dir).config(&config).start())
        })
    };
    let http = reqwest::Client::new();
    eventually(
        Duration::from_secs(15),
        "the restarted node's /healthz",
        || {
            let request = http.get(format!("{url}/healthz")).send();
            async move {
                let r = request.await.ok()?;
                (r.status() == 200).then_some(())
            }
        },
    )
    .await;
    let second = restart.await.unwrap();
    assert_eq!(second.url, url);
    for (user, pid, epoch) in &before {
        let main = second.running_main(user, None).await;
        assert_eq!(main["pid"].as_u64(), Some(*pid), "{user} adopted: {main}");
        assert_eq!(&main["epoch"], epoch, "{user}: the same lease: {main}");
        assert_eq!(main["node"], "node-a", "{main}");
        assert!(alive(*pid), "{user}");
        assert!(!frozen(*pid as u32), "{user} thawed");
    }
    // It serves them.
    let token = second.user_token("alice").await;
    let r = http
        .get(format!("{url}/u/alice/"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // A second process under the same id and data dir, while the first
    // lives: refused by the data dir's lock, naming the holder.
    let pid = second.pid().unwrap();
    let mut other = original.clone();
    let stderr = refused_start(&dir, &other).await;
    for part in [
        "in use by another berth process",
        &format!("(pid {pid})"),
        "node.lock",
    ] {
        assert!(stderr.contains(part), "{part:?} missing from: {stderr}");
    }
    // Another data dir under the same id: refused by the live heartbeat.
    other = other.replace(
        &format!("data_dir = \"{}\"", second.data_dir.display()),
        &format!("data_dir = \"{}\"", root.path().join("elsewhere").display()),
    );
    let stderr = refused_start(&dir, &other).await;
    for part in ["\"node-a\"", "already in use", "heartbeat", &url] {
        assert!(stderr.contains(part), "{part:?} missing from: {stderr}");
    }

    // Paused, the first still holds its lock: a second process is refused
    // however long ago the first last heartbeat.
    second.signal(nix::sys::signal::Signal::SIGSTOP);
    let stderr = refused_start(&dir, &same_address).await;
    assert!(
        stderr.contains(&format!("in use by another berth process (pid {pid})")),
        "{stderr}"
    );
    second.signal(nix::sys::signal::Signal::SIGCONT);
    for (user, pid, _) in &before {
        assert_eq!(
            second.running_main(user, None).await["pid"].as_u64(),
            Some(*pid),
            "{user} untouched"
        );
    }
}

// --- every per-user operation reaches the owner node ----------------------------

/// An instance command that waits while `$HOME/hold` exists, exits 3 at
/// once while `$HOME/crash` exists, and otherwise is `berth demo-app`: the
/// test holds a start (to watch its stages) or makes it crash (to open the
/// breaker) by creating files in the user's home on its node.
fn gated_instance() -> String {
    format!(
        "command = [\"sh\", \"-c\", 'while [ -e \"$HOME/hold\" ]; do sleep 0.05; done; \
         if [ -e \"$HOME/crash\" ]; then exit 3; fi; exec {BERTH} demo-app --port \"$1\"', \
         \"sh\", \"{{port}}\"]\n\
         ready_token_regex = '{}'\n",
        r"berth-demo: http://127\.0\.0\.1:\d+/\?token=([A-Za-z0-9_-]+)"
    )
}

/// Nodes running [`gated_instance`], with a watchdog that notes its run in
/// the user's home, and fast crash restarts.
async fn start_gated_nodes(root: &Path, db: &str, ids: &[&str]) -> Vec<Node> {
    let extra = "[watchdog]\ncommand = [\"sh\", \"-c\", 'echo \"$BERTH_ROLE\" >> \"$HOME/watchdog-ran\"']\n\
                 [crash]\nbackoff_base_ms = 20\nbackoff_max_ms = 100\n";
    let mut nodes = Vec::new();
    for id in ids {
        let (dir, db, id) = (root.join(id), db.to_owned(), (*id).to_owned());
        let instance = gated_instance();
        let node = tokio::task::spawn_blocking(move || {
            berth()
                .node(&dir)
                .config(&support::cluster_config_custom(
                    &dir,
                    &db,
                    &id,
                    SECRET,
                    CLUSTER_LEASE,
                    &instance,
                    extra,
                ))
                .start()
        })
        .await
        .unwrap();
        nodes.push(Node::from(node));
    }
    nodes
}

/// `user`'s home on `node` (where the gate files go).
fn home_of(node: &Node, user: &str) -> std::path::PathBuf {
    node.data_dir.join("users").join(user).join("home")
}

/// Server-Sent Events read off a streamed response.
struct Events {
    response: reqwest::Response,
    buffer: String,
}

impl Events {
    fn new(response: reqwest::Response) -> Self {
        assert_eq!(response.status(), 200);
        let kind = response.headers()["content-type"]
            .to_str()
            .unwrap()
            .to_owned();
        assert!(kind.starts_with("text/event-stream"), "{kind}");
        Self {
            response,
            buffer: String::new(),
        }
    }

    /// The next event's type and data; `None` once the stream has ended.
    async fn next(&mut self) -> Option<(String, String)> {
        let read = async {
            loop {
                while let Some(end) = self.buffer.find("\n\n") {
                    let block: String = self.buffer.drain(..end + 2).collect();
                    let mut event = "message".to_owned();
                    let mut data = None;
                    for line in block.lines() {
                        if let Some(v) = line.strip_prefix("event:") {
                            event = v.trim().to_owned();
                        } else if let Some(v) = line.strip_prefix("data:") {
                            data = Some(v.strip_prefix(' ').unwrap_or(v).to_owned());
                        }
                    }
                    if let Some(data) = data {
                        return Some((event, data));
                    }
                }
                match self.response.chunk().await {
                    Ok(Some(chunk)) => self.buffer.push_str(&String::from_utf8_lossy(&chunk)),
                    _ => return None,
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(60), read)
            .await
            .expect("an event, or the end of the stream")
    }
}

/// Launches `user` on `node` itself, the way another node asks it to.
async fn launch_on(node: &Node, user: &str) -> Value {
    launch_signed(node, &id_of(node).await, user).await
}

/// [`launch_on`] for a node whose id is known (`id_of` finds a node by the
/// URL it advertises, which a node behind a relay does not share).
async fn launch_signed(node: &Node, id: &str, user: &str) -> Value {
    let r = berth_testkit::signed_request(
        &node.http,
        SECRET,
        id,
        reqwest::Method::POST,
        &node.internal(&format!("/users/{user}/launch")),
        Some(&json!({})),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// Across nodes: alice runs on `a` (the node placement chose), bob on `b`, and every
/// request below goes through `b`. Each operation acts on `a`, where
/// alice runs: her logs (and a followed log, streamed), restart (a new pid
/// on `a`), probe, watchdog, restart-all (both nodes, each user with its
/// node), stop (the process is gone when the answer comes, the record is
/// stopped), her stages streamed live, and a breaker reset. `b` never
/// runs anything of alice's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_through_another_node_acts_on_the_owner() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let nodes = start_gated_nodes(root.path(), &db, &["node-a", "node-b"]).await;
    let (status, body) = nodes[0].post("/users/alice/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    // `a` is the node placement chose for alice, `b` the other.
    let holder = holder_of(&nodes, &body).await;
    let (a, b) = (&nodes[holder], &nodes[1 - holder]);
    let (a_id, b_id) = (id_of(a).await, id_of(b).await);
    // bob on `b`: asked of `b` the way another node asks, so he runs there
    // whatever placement would choose.
    let body = launch_on(b, "bob").await;
    assert_eq!(body["instance"]["node"], b_id.as_str(), "{body}");
    let mut alice = a.running_main("alice", None).await;
    let token = a.user_token("alice").await;
    let only_on_a = |pid: u64, what: &str| {
        assert_eq!(
            instance_pids(&a.data_dir, "alice", "main"),
            [pid as u32],
            "{what}: alice on `a`"
        );
        assert!(
            instance_pids(&b.data_dir, "alice", "main").is_empty(),
            "{what}: nothing of alice's on `b`"
        );
    };
    only_on_a(alice["pid"].as_u64().unwrap(), "launched");

    // logs: `a`'s file (`b` has none), with her port on `a`.
    let (status, logs) = b.get("/users/alice/instance/logs?tail=10").await;
    assert_eq!(status, 200, "{logs}");
    let port = alice["port"].as_u64().unwrap();
    let lines = logs["lines"].as_array().unwrap();
    assert!(
        lines.iter().any(|l| l
            .as_str()
            .unwrap()
            .contains(&format!("berth-demo: http://127.0.0.1:{port}/"))),
        "{logs}"
    );

    // logs, followed: one streamed answer through `b`; a restart
    // through `b` (a new pid, on `a`) writes its new token line
    // into it.
    let followed = b
        .http
        .get(b.api("/users/alice/instance/logs?tail=1&follow=true"))
        .bearer_auth(&b.token)
        .send()
        .await
        .unwrap();
    let mut lines = Events::new(followed);
    let (event, first) = lines.next().await.unwrap();
    assert_eq!(event, "line");
    assert!(first.contains("berth-demo: "), "{first}");
    let (status, restarted) = b.post("/users/alice/instance/restart", json!({})).await;
    assert_eq!(status, 200, "{restarted}");
    assert_eq!(restarted["instance"]["node"], a_id.as_str(), "{restarted}");
    let pid = restarted["instance"]["pid"].as_u64().unwrap();
    assert_ne!(Some(pid), alice["pid"].as_u64(), "a new process");
    assert!(
        !alive(alice["pid"].as_u64().unwrap()),
        "the old one is gone"
    );
    only_on_a(pid, "restarted");
    // The new process's ready line (its launch token shown as `*`).
    loop {
        let (event, line) = lines.next().await.expect("the stream goes on");
        assert_eq!(event, "line");
        let line: String = serde_json::from_str(&line).unwrap();
        if line.contains("berth-demo: ") {
            assert!(line.ends_with("?token=*"), "{line}");
            break;
        }
    }
    drop(lines);

    // The CLI follows the same stream: `berth logs alice -f` against `b`
    // prints the last line, then the next start's line when a probe
    // through `b` restarts her on `a`.
    let mut cli = berth()
        .command()
        .args(["logs", "alice", "-f", "--tail", "1"])
        .env("BERTH_URL", &b.url)
        .env("BERTH_TOKEN", &b.token)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (seen, printed) = std::sync::mpsc::channel();
    let stdout = cli.stdout.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if seen.send(line).is_err() {
                break;
            }
        }
    });
    let next_printed = |printed: &std::sync::mpsc::Receiver<String>| {
        printed
            .recv_timeout(Duration::from_secs(60))
            .expect("berth logs -f prints a line")
    };
    // The last line: the restarted process's ready line.
    let line = next_printed(&printed);
    assert!(line.contains("berth-demo: "), "{line}");
    let (status, report) = b.post("/users/alice/instance/probe", json!({})).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["ok"], true, "{report}");
    alice = a.running_main("alice", Some(pid)).await;
    assert_eq!(alice["node"], a_id.as_str(), "{alice}");
    only_on_a(alice["pid"].as_u64().unwrap(), "probed");
    // Every line after it is new: the next ready line is the probed
    // restart's.
    loop {
        let line = next_printed(&printed);
        if line.contains("berth-demo: ") {
            break;
        }
    }
    let _ = cli.kill();
    let _ = cli.wait();

    // watchdog: started on `a`, in alice's home there.
    let (status, watchdog) = b.post("/users/alice/watchdog", json!({})).await;
    assert_eq!(status, 201, "{watchdog}");
    assert_eq!(watchdog["node"], a_id.as_str(), "{watchdog}");
    eventually(Duration::from_secs(30), "the watchdog's run", || async {
        std::fs::read_to_string(home_of(a, "alice").join("watchdog-ran"))
            .ok()
            .filter(|runs| runs.contains("watchdog"))
    })
    .await;
    assert!(!home_of(b, "alice").exists(), "alice has no home on `b`");

    // restart-all: both nodes, each user with its node, each restarted
    // where it runs.
    let bob = b.running_main("bob", None).await;
    let (status, all) = b.post("/instances/restart-all", json!({})).await;
    assert_eq!(status, 200, "{all}");
    let mut results: Vec<(String, String, bool)> = all["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["user"].as_str().unwrap().to_owned(),
                r["node"].as_str().unwrap().to_owned(),
                r["ok"].as_bool().unwrap(),
            )
        })
        .collect();
    results.sort();
    assert_eq!(
        results,
        [
            ("alice".to_owned(), a_id.clone(), true),
            ("bob".to_owned(), b_id.clone(), true)
        ],
        "{all}"
    );
    let restarted_bob = b.running_main("bob", bob["pid"].as_u64()).await;
    assert_eq!(restarted_bob["node"], b_id.as_str());
    assert_eq!(instance_pids(&b.data_dir, "bob", "main").len(), 1);
    let old = alice["pid"].as_u64();
    alice = a.running_main("alice", old).await;
    only_on_a(alice["pid"].as_u64().unwrap(), "restarted by restart-all");

    // stop: when `b` answers, alice's process is gone and her record
    // says stopped.
    let pid = alice["pid"].as_u64().unwrap();
    assert_eq!(b.delete("/users/alice/instance").await, 204);
    assert!(
        !alive(pid),
        "the instance outlived a stop that answered done"
    );
    assert!(instance_pids(&a.data_dir, "alice", "main").is_empty());
    for node in [a, b] {
        assert_eq!(node.status_of("alice").await, "stopped", "via {}", node.url);
    }

    // progress: alice's next start is held on `a`; her stages stream
    // through `b` as they happen, and the stream ends once she is ready.
    std::fs::write(home_of(a, "alice").join("hold"), "").unwrap();
    let (status, body) = b.post("/users/alice/instance?wait=false", json!({})).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["instance"]["node"], a_id.as_str(), "sticky: {body}");
    let progress = b
        .http
        .get(b.api("/users/alice/instance/progress"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    let mut stages = Events::new(progress);
    let (event, first) = stages.next().await.unwrap();
    assert_eq!(event, "status");
    let first: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(
        (
            first["user"].as_str(),
            first["status"].as_str(),
            first["ready"].as_bool()
        ),
        (Some("alice"), Some("starting"), Some(false)),
        "{first}"
    );
    std::fs::remove_file(home_of(a, "alice").join("hold")).unwrap();
    let mut last = first;
    while let Some((event, data)) = stages.next().await {
        assert_eq!(event, "status");
        last = serde_json::from_str(&data).unwrap();
    }
    assert_eq!(
        (last["status"].as_str(), last["ready"].as_bool()),
        (Some("running"), Some(true)),
        "the stream ends when she is ready: {last}"
    );
    alice = a.running_main("alice", None).await;
    only_on_a(alice["pid"].as_u64().unwrap(), "relaunched");

    // breaker/reset: a crash loop on `a` opens alice's breaker; a reset
    // through `b` clears it.
    std::fs::write(home_of(a, "alice").join("crash"), "").unwrap();
    signal(
        alice["pid"].as_u64().unwrap() as u32,
        nix::sys::signal::Signal::SIGKILL,
    );
    eventually(Duration::from_secs(60), "alice's breaker open", || async {
        let (_, state) = b.get("/users/alice/instance").await;
        (!state["breaker"].is_null() && state["main"]["status"] == "failed").then_some(())
    })
    .await;
    let r = b
        .http
        .post(b.api("/users/alice/breaker/reset"))
        .bearer_auth(&b.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    for node in [a, b] {
        let (_, state) = node.get("/users/alice/instance").await;
        assert!(state["breaker"].is_null(), "via {}: {state}", node.url);
    }
    std::fs::remove_file(home_of(a, "alice").join("crash")).unwrap();
    let (status, body) = b.post("/users/alice/instance", json!({})).await;
    assert_eq!(status, 201, "a launch without force: {body}");
    assert_eq!(body["instance"]["node"], a_id.as_str(), "{body}");
    assert!(instance_pids(&b.data_dir, "alice", "main").is_empty());

    // status: dave ran on `b`, stopped, and runs on `a` now; `b`,
    // which remembers him stopped, answers what `a` knows.
    assert_eq!(
        launch_on(b, "dave").await["instance"]["node"],
        b_id.as_str()
    );
    assert_eq!(b.delete("/users/dave/instance").await, 204);
    assert_eq!(
        launch_on(a, "dave").await["instance"]["node"],
        a_id.as_str()
    );
    let main = b.main_of("dave").await;
    assert_eq!(
        (main["node"].as_str(), main["status"].as_str()),
        (Some(a_id.as_str()), Some("running")),
        "{main}"
    );
}

/// A browser opening alice's app through a node that does not run her sees
/// the starting page at once, while her start on node-a takes its time,
/// then her app once she is ready. A request another node forwarded is
/// still never forwarded again: a navigation that lands, forwarded, on a
/// node that does not hold the lease gets the starting page too (its
/// reload is routed afresh), any other request `409 lease_busy`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_through_another_node_sees_the_starting_page_at_once() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let nodes = start_gated_nodes(root.path(), &db, &["node-a", "node-b"]).await;
    // carol has run on one node (placement's choice, `a`): her next start
    // is placed there (sticky), and held.
    let (status, body) = nodes[0].post("/users/carol/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    let (a, b) = if body["instance"]["node"] == "node-b" {
        (&nodes[1], &nodes[0])
    } else {
        (&nodes[0], &nodes[1])
    };
    let a_id = id_of(a).await;
    assert_eq!(a.delete("/users/carol/instance").await, 204);
    std::fs::write(home_of(a, "carol").join("hold"), "").unwrap();

    let token = a.user_token("carol").await;
    let navigate = |node: &Node| {
        node.http
            .get(format!("{}/u/carol/", node.url))
            .bearer_auth(&token)
            .header("accept", "text/html")
            .header("sec-fetch-mode", "navigate")
            .send()
    };
    let r = navigate(b).await.unwrap();
    assert_eq!(r.status(), 202);
    let page = r.text().await.unwrap();
    assert!(page.contains("Starting the workspace of carol"), "{page}");
    // The page came while carol was still starting, on node-a.
    let main = a.main_of("carol").await;
    assert_eq!(
        (main["node"].as_str(), main["status"].as_str()),
        (Some(a_id.as_str()), Some("starting")),
        "{main}"
    );
    assert!(instance_pids(&b.data_dir, "carol", "main").is_empty());

    // Released, she becomes ready; the page's reload shows her app.
    std::fs::remove_file(home_of(a, "carol").join("hold")).unwrap();
    a.running_main("carol", None).await;
    let page = eventually(Duration::from_secs(30), "carol's app", || async {
        let page = navigate(b).await.ok()?.text().await.ok()?;
        page.contains(r#"<b id="user">carol</b>"#).then_some(page)
    })
    .await;
    assert!(!page.contains("Starting the workspace"), "{page}");

    // Forwarded to node-b, which does not hold carol's lease: a navigation
    // gets the starting page, anything else 409; nothing starts on node-b.
    let b_id = id_of(b).await;
    let forwarded = |navigation: bool| {
        let mut request = b.http.get(format!("{}/u/carol/", b.url));
        for (name, value) in
            berth_testkit::forward_headers(SECRET, &b_id, "GET", "/u/carol/", "carol")
        {
            request = request.header(name, value);
        }
        if navigation {
            request = request.header("accept", "text/html");
        }
        request.send()
    };
    let r = forwarded(true).await.unwrap();
    assert_eq!(r.status(), 202);
    let page = r.text().await.unwrap();
    assert!(page.contains("Starting the workspace of carol"), "{page}");
    let r = forwarded(false).await.unwrap();
    assert_eq!(r.status(), 409);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"], "lease_busy", "{body}");
    assert!(instance_pids(&b.data_dir, "carol", "main").is_empty());
    assert_eq!(instance_pids(&a.data_dir, "carol", "main").len(), 1);
}

/// `GET …/users/<user>/instance/logs?follow=true` on `node`, as the admin:
/// the response once its head is in (the stream stays open while it lives).
async fn follow_logs(node: &Node, user: &str) -> reqwest::Response {
    node.http
        .get(node.api(&format!("/users/{user}/instance/logs?tail=1&follow=true")))
        .bearer_auth(&node.token)
        .send()
        .await
        .unwrap()
}

/// The per-user stream cap holds on the node that runs a user however
/// many nodes relay the user's streams: a followed log asked of `b`
/// holds a slot on `b` and one on `a`, alice's owner. With
/// `max_upgrades_per_user = 2`, two streams held on `a` stop a third
/// relayed through `b` (`a`'s `429 too_many_streams` comes back
/// through `b` with its code), and two relayed through `b` stop a
/// third asked of `a` directly, and one more asked of `b`. Closed
/// streams give their slots back on both nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_stream_holds_a_slot_on_both_nodes() {
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let mut nodes = Vec::new();
    for id in ["node-a", "node-b"] {
        let (dir, db) = (root.path().join(id), db.clone());
        let node = tokio::task::spawn_blocking(move || {
            Node::from(
                support::berth()
                    .node(&dir)
                    .config(&support::cluster_config(
                        &dir,
                        &db,
                        id,
                        SECRET,
                        "",
                        "[proxy]\nmax_upgrades_per_user = 2\n",
                    ))
                    .start(),
            )
        })
        .await
        .unwrap();
        nodes.push(node);
    }
    let (status, body) = nodes[0].post("/users/alice/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    // `a` runs alice (placement's choice), `b` relays.
    let holder = holder_of(&nodes, &body).await;
    let (a, b) = (&nodes[holder], &nodes[1 - holder]);
    a.running_main("alice", None).await;
    let refused = |r: reqwest::Response, what: &'static str| async move {
        assert_eq!(r.status(), 429, "{what}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"], "too_many_streams", "{what}: {body}");
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .contains("max_upgrades_per_user"),
            "{what}: {body}"
        );
    };

    // Two held on `a`: `b` admits a third, `a` refuses it.
    let mut direct = Vec::new();
    for _ in 0..2 {
        direct.push(Events::new(follow_logs(a, "alice").await));
    }
    refused(follow_logs(b, "alice").await, "a third, through `b`").await;

    // Those closed, two through `b`: each a live stream of alice's log.
    drop(direct);
    let mut relayed = Vec::new();
    for n in 0..2 {
        let r = eventually(Duration::from_secs(60), "`a`'s slots back", || async {
            let r = follow_logs(b, "alice").await;
            (r.status() == 200).then_some(r)
        })
        .await;
        let mut lines = Events::new(r);
        let (event, first) = lines.next().await.expect("a line");
        assert_eq!(event, "line", "relayed stream {n}");
        assert!(first.contains("berth-demo: "), "{first}");
        relayed.push(lines);
    }
    refused(follow_logs(a, "alice").await, "a third, on `a` itself").await;
    refused(follow_logs(b, "alice").await, "a third, through `b`").await;

    drop(relayed);
    eventually(
        Duration::from_secs(60),
        "both nodes' slots back",
        || async {
            let r = follow_logs(a, "alice").await;
            (r.status() == 200).then_some(())
        },
    )
    .await;
}

/// A login storm: `USERS` users launched at once, a third through each of
/// three nodes (`[cluster] capacity = capacity` on each, or the default,
/// the size of the port range). Every launch is answered 201 (none is
/// refused for capacity), every user runs exactly once, and the live
/// instances per node, by the store's records and by processes, are
/// returned.
async fn launch_storm(capacity: Option<u32>) -> std::collections::BTreeMap<String, usize> {
    const USERS: usize = 90;
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let extra = capacity.map_or_else(String::new, |c| format!("[cluster]\ncapacity = {c}\n"));
    let ids = ["node-a", "node-b", "node-c"];
    let mut nodes = Vec::new();
    for id in ids {
        let (dir, db, extra) = (root.path().join(id), db.clone(), extra.clone());
        // Leases as long as production's: 90 programs starting at once
        // load a small test machine for seconds, which the short test
        // leases would turn into fences and failovers.
        let lease = "ttl_ms = 30000\nrenew_ms = 10000\nfence_after_ms = 20000\n";
        nodes.push(Node::from(
            tokio::task::spawn_blocking(move || {
                berth()
                    .node(&dir)
                    .config(&support::cluster_config_custom(
                        &dir, &db, id, SECRET, lease, "", &extra,
                    ))
                    .start()
            })
            .await
            .unwrap(),
        ));
    }
    // Every node has heartbeaten its capacity before the storm.
    eventually(Duration::from_secs(30), "three nodes listed", || async {
        let (_, listed) = nodes[0].get("/nodes").await;
        let up = listed["nodes"].as_array().map_or(0, |n| {
            n.iter()
                .filter(|n| n["status"] == "up" && n["capacity"].as_u64() > Some(0))
                .count()
        });
        (up == 3).then_some(())
    })
    .await;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(USERS)
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let launches = (0..USERS).map(|u| {
        let node = &nodes[u % nodes.len()];
        let request = client
            .post(node.api(&format!("/users/storm{u}/instance?wait=false")))
            .bearer_auth(&node.token)
            .json(&json!({}));
        async move {
            match request.send().await {
                Ok(r) => (
                    r.status().as_u16(),
                    r.json::<Value>().await.unwrap_or(Value::Null),
                ),
                Err(e) => (0, json!({ "transport": e.to_string() })),
            }
        }
    });
    let answers = futures_util::future::join_all(launches).await;
    let refused: Vec<_> = answers
        .iter()
        .enumerate()
        .filter(|(_, (status, _))| *status != 201)
        .collect();
    assert!(
        refused.is_empty(),
        "{} not created: {refused:?}",
        refused.len()
    );
    // All of them come up.
    eventually(Duration::from_secs(180), "every user running", || async {
        let (_, listed) = nodes[0].get("/instances").await;
        let running = listed["instances"].as_array().map_or(0, |all| {
            all.iter()
                .filter(|r| r["role"] == "main" && r["status"] == "running")
                .count()
        });
        (running == USERS).then_some(())
    })
    .await;
    let (_, listed) = nodes[0].get("/instances").await;
    let mut per_node = std::collections::BTreeMap::<String, usize>::new();
    for record in listed["instances"].as_array().unwrap() {
        if record["role"] == "main" && record["status"] == "running" {
            *per_node
                .entry(record["node"].as_str().unwrap().to_owned())
                .or_default() += 1;
        }
    }
    // The processes agree: one per user, on the node its record names.
    let mut by_process = std::collections::BTreeMap::<String, usize>::new();
    for u in 0..USERS {
        let user = format!("storm{u}");
        let pids = pids_everywhere(&nodes, &user);
        assert_eq!(pids.len(), 1, "{user}: {pids:?}");
        *by_process.entry(ids[pids[0].0].to_owned()).or_default() += 1;
    }
    assert_eq!(per_node, by_process);
    eprintln!("instances per node: {per_node:?}");
    per_node
}

/// Three nodes of 40 take a storm of 90: all run, nothing is refused, no
/// node holds more than 45 (nor more than its 40). Placement counts each
/// node's leases and reserved places live, in the store, so the launches
/// of a burst see each other instead of the nodes' last heartbeats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_storm_spreads_over_nodes_of_forty() {
    let per_node = launch_storm(Some(40)).await;
    assert_eq!(per_node.values().sum::<usize>(), 90, "{per_node:?}");
    assert!(per_node.values().all(|n| *n <= 40), "{per_node:?}");
}

/// Without capacity limits a storm of 90 is spread too: no node above 45.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_storm_spreads_without_capacity_limits() {
    let per_node = launch_storm(None).await;
    assert_eq!(per_node.len(), 3, "{per_node:?}");
    assert!(per_node.values().all(|n| *n <= 45), "{per_node:?}");
}
