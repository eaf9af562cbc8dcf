//! End-to-end acceptance of single-node berth: the real binary,
//! real instances (`berth demo-app`), real SQLite, real sockets.

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{Node, alive, eventually, instance_pids};

/// Each test gets its own port range so parallel tests never race for ports.
fn ports(n: u16) -> String {
    let start = berth_testkit::port_block_for(&format!("{} {n}", module_path!()), 20);
    format!("[instance]\nport_range = [{start}, {}]\n", start + 19)
}

async fn launch(node: &Node, user: &str) -> (u16, Value) {
    node.post(&format!("/users/{user}/instance"), json!({}))
        .await
}

#[tokio::test(flavor = "multi_thread")]
async fn launch_reach_and_relaunch_an_instance() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &ports(0));

    let (status, body) = launch(&node, "alice").await;
    assert_eq!(status, 201, "{body}");
    let instance = &body["instance"];
    assert_eq!(instance["status"], "running");
    assert_eq!(instance["ready"], true);
    let port = instance["port"].as_u64().expect("a port");
    let pid = instance["pid"].as_u64().expect("a pid");
    // The app's address; the launch token is the program's, never handed out.
    let url = body["url"].as_str().unwrap();
    assert_eq!(url, format!("{}/u/alice/", node.url));

    let page = reqwest::get(format!("http://127.0.0.1:{port}/"))
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("alice"));

    let (status, again) = launch(&node, "alice").await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["instance"]["pid"].as_u64(), Some(pid));
    assert_eq!(node.delete("/users/alice/instance").await, 204);
    assert!(!alive(pid), "stop kills the instance");
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_concurrent_launches_leave_exactly_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &ports(1));
    let launches = (0..50).map(|_| launch(&node, "crowd"));
    let results = futures_util::future::join_all(launches).await;
    let created = results.iter().filter(|(s, _)| *s == 201).count();
    let existing = results.iter().filter(|(s, _)| *s == 200).count();
    assert_eq!((created, existing), (1, 49), "{results:?}");
    let pids: std::collections::BTreeSet<_> = results
        .iter()
        .map(|(_, b)| b["instance"]["pid"].as_u64())
        .collect();
    assert_eq!(pids.len(), 1, "{pids:?}");
    assert_eq!(instance_pids(&node.data_dir, "crowd", "main").len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_instance_is_restarted_with_backoff() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &ports(2));
    let (_, body) = launch(&node, "crashy").await;
    let pid = body["instance"]["pid"].as_u64().unwrap();
    support::signal(pid as u32, nix::sys::signal::Signal::SIGKILL);
    let main = node.running_main("crashy", Some(pid)).await;
    assert_eq!(main["restarts"], 1);
    assert!(!alive(pid));
    let port = main["port"].as_u64().unwrap();
    let page = reqwest::get(format!("http://127.0.0.1:{port}/"))
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
}

/// A crash loop opens the breaker; force and reset clear it; it survives a
/// berth restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_crash_loop_opens_the_breaker() {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "{}command = [\"{}\", \"demo-app\", \"--port\", \"{{port}}\", \"--crash-after-ms\", \"150\"]\n\
         [crash]\nbackoff_base_ms = 20\nbackoff_max_ms = 100\n",
        ports(3),
        support::BERTH
    );
    let mut node = Node::start(dir.path(), &config);
    let _ = launch(&node, "loop").await;
    eventually(Duration::from_secs(30), "breaker open", || async {
        (node.status_of("loop").await == "failed").then_some(())
    })
    .await;
    let state = node.get("/users/loop/instance").await.1;
    assert_eq!(state["breaker"]["opens"], 1, "{state}");
    assert_eq!(state["main"]["restarts"], 5, "{state}");
    assert_eq!(node.metric("berth_breaker_opens_total").await, Some(1.0));

    let refused = node
        .http
        .post(node.api("/users/loop/instance"))
        .bearer_auth(&node.token)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry_after > 0 && retry_after <= 600, "{retry_after}");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"], "instance_circuit_open");
    assert_eq!(body["opens"], 1);
    assert!(body["retry_after_ms"].as_u64().unwrap() > 0);

    // The breaker is in the store: a new berth still refuses. (A graceful
    // stop takes berth's shim zygote with it.)
    let zygote = support::zygote_of(node.pid().unwrap()).expect("berth runs a shim zygote");
    node.terminate();
    assert!(
        !alive(u64::from(zygote)),
        "the zygote outlived a graceful stop"
    );
    let node = Node::start(dir.path(), &config);
    let (status, body) = launch(&node, "loop").await;
    assert_eq!(
        (status, body["error"].as_str()),
        (503, Some("instance_circuit_open"))
    );

    // A breaker reset clears it…
    let (status, _) = node.post("/users/loop/breaker/reset", json!({})).await;
    assert_eq!(status, 204);
    assert_eq!(
        node.get("/users/loop/instance").await.1["breaker"],
        Value::Null
    );
    let (status, body) = node.post("/users/loop/instance", json!({})).await;
    assert!(status == 201 || status == 503, "{status} {body}");
    eventually(Duration::from_secs(30), "breaker open again", || async {
        (node.status_of("loop").await == "failed").then_some(())
    })
    .await;
    // …and so does a force launch.
    let (status, body) = node
        .post("/users/loop/instance?wait=false", json!({"force": true}))
        .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(
        node.get("/users/loop/instance").await.1["breaker"],
        Value::Null
    );
    node.delete("/users/loop/instance").await;
}

/// `kill -9` of berth while three instances run; a new berth on the same
/// data dir adopts the same pids, reaches them, and still heals crashes.
#[tokio::test(flavor = "multi_thread")]
async fn instances_survive_a_berth_crash_and_are_adopted() {
    let dir = tempfile::tempdir().unwrap();
    let mut node = Node::start(dir.path(), &ports(4));
    let mut before = Vec::new();
    for user in ["u1", "u2", "u3"] {
        let (status, body) = launch(&node, user).await;
        assert_eq!(status, 201, "{body}");
        before.push((
            user,
            body["instance"]["pid"].as_u64().unwrap(),
            body["instance"]["port"].as_u64().unwrap(),
        ));
    }
    let zygote = support::zygote_of(node.pid().unwrap()).expect("berth runs a shim zygote");
    node.kill9();
    for (_, pid, _) in &before {
        assert!(alive(*pid), "instances outlive berth");
    }
    // berth's end of its socket closed with it: the zygote is no orphan.
    support::eventually(Duration::from_secs(20), "the zygote exits", || async {
        (!alive(u64::from(zygote))).then_some(())
    })
    .await;
    let node = Node::start(dir.path(), &ports(4));
    for (user, pid, port) in &before {
        let main = node.running_main(user, None).await;
        assert_eq!(main["pid"].as_u64(), Some(*pid), "{user} adopted");
        let page = reqwest::get(format!("http://127.0.0.1:{port}/"))
            .await
            .unwrap();
        assert_eq!(page.status(), 200);
    }
    let (user, pid, _) = before[0];
    support::signal(pid as u32, nix::sys::signal::Signal::SIGKILL);
    let main = node.running_main(user, Some(pid)).await;
    assert_eq!(main["restarts"], 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_reaper_stops_idle_instances_and_keeps_their_data() {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "{}[reap]\ninterval_s = 1\nidle_ttl_s = 1\nidle_action = \"stop\"\n",
        ports(5)
    );
    let node = Node::start(dir.path(), &config);
    let (_, body) = launch(&node, "sleepy").await;
    let pid = body["instance"]["pid"].as_u64().unwrap();
    // Status says what this node does with idle instances: not the default.
    let (_, status) = node.get("/users/sleepy/instance").await;
    assert_eq!(status["idle_action"], "stop", "{status}");
    let home = node.data_dir.join("users/sleepy/home");
    std::fs::write(home.join("notes.txt"), "keep me").unwrap();
    eventually(Duration::from_secs(30), "reaped", || async {
        (node.status_of("sleepy").await == "stopped").then_some(())
    })
    .await;
    assert!(!alive(pid));
    assert_eq!(
        std::fs::read_to_string(home.join("notes.txt")).unwrap(),
        "keep me"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_watchdog_runs_once_after_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    // In the user's home: the watchdog runs as the user's account, which
    // may write there and nowhere in the test's own directory.
    let config = format!(
        "{}[watchdog]\ncommand = [\"sh\", \"-c\", \"echo \\\"$BERTH_ROLE $BERTH_HANDOFF\\\" >> \\\"$HOME/watchdog-runs\\\"\"]\n",
        ports(6),
    );
    let node = Node::start(dir.path(), &config);
    let marker = node.data_dir.join("users/fragile/home/watchdog-runs");
    let (_, body) = launch(&node, "fragile").await;
    let pid = body["instance"]["pid"].as_u64().unwrap();
    support::signal(pid as u32, nix::sys::signal::Signal::SIGKILL);
    let runs = eventually(Duration::from_secs(30), "watchdog ran", || async {
        std::fs::read_to_string(&marker)
            .ok()
            .filter(|s| !s.is_empty())
    })
    .await;
    node.running_main("fragile", Some(pid)).await;
    // The watchdog exited; it must be gone from the status, not restarted.
    eventually(Duration::from_secs(30), "watchdog removed", || async {
        node.get("/users/fragile/instance").await.1["watchdog"]
            .is_null()
            .then_some(())
    })
    .await;
    let runs_after = std::fs::read_to_string(&marker).unwrap();
    assert_eq!(runs_after.lines().count(), 1, "{runs_after}");
    assert!(runs.starts_with("watchdog "), "{runs}");
    assert!(
        runs.contains(node.data_dir.join("users/fragile").to_str().unwrap()),
        "{runs}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_gets_a_clear_error_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &ports(7));

    // Sent raw: an HTTP client library would normalise `..` away.
    let long = "a".repeat(200);
    for bad in ["..", "%2E%2E", "", long.as_str(), "a%00b", "a%0Ab"] {
        let head = format!(
            "POST /api/v1/users/{bad}/instance HTTP/1.1\r\nHost: x\r\n\
             Authorization: Bearer {}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            node.token
        );
        let (status, body) = support::raw_request(&node.url, &head).await;
        assert_eq!(status, 400, "{bad:?}: {body}");
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["error"], "invalid_user", "{bad:?}: {body}");
    }
    let (_, listed) = node.get("/instances").await;
    assert_eq!(listed["instances"], json!([]), "nothing was recorded");

    let patch = "x".repeat(300 * 1024);
    let (status, body) = node
        .post("/users/big/instance", json!({ "patch": patch }))
        .await;
    assert_eq!(
        (status, body["error"].as_str()),
        (413, Some("payload_too_large")),
        "{body}"
    );
    assert!(node.main_of("big").await.is_null(), "nothing recorded");
    assert!(!node.data_dir.join("users/big/patches/main.yaml").exists());

    // Missing and wrong tokens.
    let anonymous = node
        .http
        .get(node.api("/users/alice/instance"))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
    let wrong = node
        .http
        .get(node.api("/users/alice/instance"))
        .bearer_auth("not-the-token")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let body: Value = wrong.json().await.unwrap();
    assert_eq!(body["error"], "unauthorized");

    // Routes and queries that do not exist, with a valid token: clear
    // JSON errors, and nothing launched.
    for (method, path, status, code) in [
        ("PUT", "/users/alice/instance", 404, "not_found"),
        ("POST", "/users/alice/instance/nope", 404, "not_found"),
        (
            "GET",
            "/users/alice/instance/logs?tail=many",
            400,
            "invalid_request",
        ),
        ("GET", "/users/a%00b/instance/logs", 400, "invalid_user"),
    ] {
        let r = node
            .http
            .request(method.parse().unwrap(), node.api(path))
            .bearer_auth(&node.token)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), status, "{method} {path}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"], code, "{method} {path}: {body}");
    }
    assert!(node.main_of("alice").await.is_null(), "nothing recorded");
}

/// `restart-all` on one node: every running main gets a new process, and
/// each result names its user, this node and the outcome.
#[tokio::test(flavor = "multi_thread")]
async fn restart_all_restarts_every_running_main() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &ports(11));
    let mut before = Vec::new();
    for user in ["ann", "ben"] {
        let (status, body) = launch(&node, user).await;
        assert_eq!(status, 201, "{body}");
        before.push(body["instance"]["pid"].as_u64().unwrap());
    }
    let (_, nodes) = node.get("/nodes").await;
    let me = nodes["nodes"][0]["id"].as_str().unwrap().to_owned();
    let (status, answer) = node.post("/instances/restart-all", json!({})).await;
    assert_eq!(status, 200, "{answer}");
    let mut results = answer["results"].as_array().unwrap().clone();
    results.sort_by_key(|r| r["user"].as_str().unwrap().to_owned());
    assert_eq!(
        results,
        [
            json!({"user": "ann", "node": me, "ok": true}),
            json!({"user": "ben", "node": me, "ok": true}),
        ],
        "{answer}"
    );
    for (user, pid) in ["ann", "ben"].iter().zip(before) {
        let main = node.running_main(user, Some(pid)).await;
        assert!(!alive(pid), "{user}: the old process is gone");
        assert_eq!(
            instance_pids(&node.data_dir, user, "main"),
            [main["pid"].as_u64().unwrap() as u32]
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_program_fails_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "{}command = [\"no-such-program-xyz\", \"--port\", \"{{port}}\"]\n",
        ports(8)
    );
    let node = Node::start(dir.path(), &config);
    let (status, body) = launch(&node, "ghost").await;
    assert_eq!(
        (status, body["error"].as_str()),
        (500, Some("spawn_failed")),
        "{body}"
    );
    let main = node.main_of("ghost").await;
    assert_eq!(main["status"], "failed");
    assert!(
        main["last_error"]
            .as_str()
            .unwrap()
            .contains("no-such-program-xyz"),
        "{main}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_exhausted_port_range_is_capacity_exhausted() {
    let dir = tempfile::tempdir().unwrap();
    let first = berth_testkit::port_block(2);
    let node = Node::start(
        dir.path(),
        &format!("[instance]\nport_range = [{first}, {}]\n", first + 1),
    );
    for user in ["p1", "p2"] {
        assert_eq!(launch(&node, user).await.0, 201);
    }
    let (status, body) = launch(&node, "p3").await;
    assert_eq!(
        (status, body["error"].as_str()),
        (503, Some("capacity_exhausted")),
        "{body}"
    );
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains(&first.to_string()),
        "{body}"
    );
    assert!(
        node.main_of("p3").await.is_null(),
        "nothing recorded for p3"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_drives_a_running_server_with_the_token_file() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &ports(9));
    let ok = |out: std::process::Output| {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let started = ok(node.cli(&["start", "carol"]));
    assert!(started.contains("running"), "{started}");
    let status = ok(node.cli(&["status", "carol"]));
    assert!(
        status.contains("carol") && status.contains("running"),
        "{status}"
    );
    let listed = ok(node.cli(&["ls"]));
    assert!(listed.contains("carol"), "{listed}");
    let logs = ok(node.cli(&["logs", "carol"]));
    assert!(logs.contains("berth-demo: http://127.0.0.1:"), "{logs}");
    let pid = node.main_of("carol").await["pid"].as_u64().unwrap();
    ok(node.cli(&["restart", "carol"]));
    let restarted = node.running_main("carol", Some(pid)).await;
    let probe = ok(node.cli(&["probe", "carol"]));
    assert!(probe.starts_with("probe carol: ok: ready"), "{probe}");
    ok(node.cli(&["stop", "carol"]));
    assert_eq!(node.status_of("carol").await, "stopped");
    assert!(!alive(restarted["pid"].as_u64().unwrap()));
}

/// `berth serve` with no config at all: 127.0.0.1:8000, SQLite under
/// ./berth-data, and an admin token file with mode 0600.
#[tokio::test(flavor = "multi_thread")]
async fn serve_runs_on_embedded_defaults() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("berth-data");
    let node = Node::from(
        support::berth()
            .node(dir.path())
            .args(&["serve"], &data_dir)
            .start(),
    );
    assert_eq!(node.url, "http://127.0.0.1:8000");
    let health = reqwest::get(format!("{}/healthz", node.url)).await.unwrap();
    assert_eq!(health.text().await.unwrap(), "ok");
    assert!(data_dir.join("berth.db").exists());
    let mode = std::fs::metadata(data_dir.join("admin.token"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

/// berth authenticates before it reads a body: a client that sends
/// headers and only half of its body gets its 401 at once, while the
/// rest is still missing; an authenticated one gets 413 for a declared
/// length over the limit, before it sends anything.
#[tokio::test(flavor = "multi_thread")]
async fn the_body_is_read_only_after_authentication() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &ports(10));
    let addr = node.url.trim_start_matches("http://").to_owned();
    let half = vec![b'{'; 512 * 1024];
    for (path, auth) in [
        ("/api/v1/users/alice/instance", String::new()),
        (
            "/api/v1/users/alice/instance",
            "Authorization: Bearer wrong\r\n".to_owned(),
        ),
        ("/internal/v1/users/alice/launch", String::new()),
    ] {
        let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            2 * half.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(&half).await.unwrap();
        // The other half never comes: only an answer that did not wait for
        // it arrives.
        let mut answer = vec![0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(60), stream.read(&mut answer))
            .await
            .unwrap_or_else(|_| panic!("{path}: berth waited for the body"))
            .unwrap();
        let text = String::from_utf8_lossy(&answer[..n]);
        let want = if path.starts_with("/internal") {
            // Single node: node-to-node routes do not exist.
            "HTTP/1.1 404"
        } else {
            "HTTP/1.1 401"
        };
        assert!(text.starts_with(want), "{path} {auth:?}: {text}");
    }
    assert!(node.main_of("alice").await.is_null(), "nothing launched");

    let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "POST /api/v1/users/alice/instance HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        node.token,
        4 * 1024 * 1024
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(60), stream.read(&mut answer))
        .await
        .expect("413 without reading the body")
        .unwrap();
    let text = String::from_utf8_lossy(&answer[..n]);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("payload_too_large"), "{text}");
    assert!(node.main_of("alice").await.is_null(), "nothing launched");
}

/// Opens `user`'s progress stream (`query` appended) as the admin; it is
/// subscribed once the answer's head has arrived.
async fn open_progress(node: &Node, user: &str, query: &str) -> reqwest::Response {
    let r = node
        .http
        .get(node.api(&format!("/users/{user}/instance/progress{query}")))
        .bearer_auth(&node.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let kind = r.headers()["content-type"].to_str().unwrap();
    assert!(kind.starts_with("text/event-stream"), "{kind}");
    r
}

/// Every `status` event of a progress stream, read until the stream ends
/// (after a final stage).
async fn stages_of(stream: reqwest::Response) -> Vec<Value> {
    let text = tokio::time::timeout(Duration::from_secs(60), stream.text())
        .await
        .expect("the progress stream ends after a final stage")
        .unwrap();
    text.split("\n\n")
        .filter(|block| block.lines().any(|l| l == "event: status"))
        .filter_map(|block| block.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|data| serde_json::from_str(data).unwrap())
        .collect()
}

fn names(stages: &[Value]) -> Vec<&str> {
    stages
        .iter()
        .map(|s| s["stage"].as_str().unwrap_or("-"))
        .collect()
}

/// A start, watched from before it begins (`?next=true`): queued,
/// spawning, waiting for ready, ready, in that order, then the stream ends.
/// A stream opened on a ready instance reports `ready` and ends; one
/// without `next` on a user with no instance reports `none` and ends.
#[tokio::test(flavor = "multi_thread")]
async fn progress_reports_each_stage_of_a_start() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &ports(12));
    let stream = open_progress(&node, "alice", "?next=true").await;
    let (status, body) = launch(&node, "alice").await;
    assert_eq!(status, 201, "{body}");
    let stages = stages_of(stream).await;
    assert_eq!(
        names(&stages),
        ["queued", "spawning", "waiting_for_ready", "ready"],
        "{stages:?}"
    );
    let last = stages.last().unwrap();
    assert_eq!(
        (&last["status"], &last["ready"]),
        (&json!("running"), &json!(true))
    );
    assert!(stages.iter().all(|s| s["user"] == "alice"), "{stages:?}");

    let now = stages_of(open_progress(&node, "alice", "").await).await;
    assert_eq!(names(&now), ["ready"], "{now:?}");
    let nobody = stages_of(open_progress(&node, "nobody", "").await).await;
    assert_eq!(nobody, [json!({"status": "none"})]);
}

/// A start that fails reports `failed` with the reason: a program that
/// cannot be run fails while spawning; a launch the node has no room for
/// is refused while queued.
#[tokio::test(flavor = "multi_thread")]
async fn progress_reports_a_failed_start_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "{}command = [\"no-such-program-xyz\", \"--port\", \"{{port}}\"]\n",
        ports(13)
    );
    let node = Node::start(dir.path(), &config);
    let stream = open_progress(&node, "ghost", "?next=true").await;
    let (status, body) = launch(&node, "ghost").await;
    assert_eq!(body["error"], "spawn_failed", "{status} {body}");
    let stages = stages_of(stream).await;
    assert_eq!(
        names(&stages),
        ["queued", "spawning", "failed"],
        "{stages:?}"
    );
    let reason = stages[2]["message"].as_str().unwrap_or_default();
    assert!(reason.contains("no-such-program-xyz"), "{stages:?}");

    // One port: alice takes it, and bob's launch is refused for capacity.
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), "[instance]\nport_range = [21290, 21290]\n");
    assert_eq!(launch(&node, "alice").await.0, 201);
    let stream = open_progress(&node, "bob", "?next=true").await;
    let (status, body) = launch(&node, "bob").await;
    assert_eq!(
        (status, body["error"].as_str()),
        (503, Some("capacity_exhausted")),
        "{body}"
    );
    let stages = stages_of(stream).await;
    assert_eq!(names(&stages), ["queued", "failed"], "{stages:?}");
    let reason = stages[1]["message"].as_str().unwrap_or_default();
    assert!(reason.contains("capacity"), "{stages:?}");
    assert!(
        node.main_of("bob").await.is_null(),
        "a refusal records nothing"
    );
}
