//! The proxy behaviours `berth-proxy`'s own layer tests cover with a test
//! double (`StaticTraffic`), again on the real binary: a real `berth
//! serve`, its real spawner and shims, and programs it really launches as
//! instances — `berth demo-app` (with `BERTH_DEMO_ECHO=1`, its `…/echo`
//! reports what it received), or `tests/programs/upstream.py` where the
//! demo app cannot play the part (hop-by-hop response headers, a
//! connection dropped under a kept-alive request, a port that refuses).
//!
//! Credential stripping and header auth mode are not here: they are tested
//! with the front door's own tests.

use crate::support;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use support::{Node, WebSocket, eventually, websocket};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;

/// Bound for anything that should happen "soon"; only a hang reaches it.
const PATIENCE: Duration = Duration::from_secs(60);

/// A config with its own port range (tests run in parallel) plus extra
/// `[instance]` and `[proxy]` keys.
fn config(n: u16, instance: &str, proxy: &str) -> String {
    let start = berth_testkit::port_block_for(&format!("{} {n}", module_path!()), 20);
    format!(
        "[instance]\nport_range = [{start}, {}]\n{instance}\n[proxy]\n{proxy}\n",
        start + 19
    )
}

/// `[instance]` keys that run the demo app with its `…/echo` on.
const DEMO_ECHO: &str = "env = { BERTH_DEMO_ECHO = \"1\" }\n";

/// `[instance]` keys that run `tests/programs/upstream.py` with `args`.
fn upstream(args: &str) -> String {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/programs/upstream.py");
    format!(
        "command = [\"python3\", \"{}\", \"{{port}}\"{args}]\nready_token_regex = \"^upstream: listening\"\n",
        script.display()
    )
}

fn addr(node: &Node) -> SocketAddr {
    node.url
        .trim_start_matches("http://")
        .parse()
        .expect("berth listens on an IP address")
}

/// A response read off the wire.
#[derive(Debug)]
struct Raw {
    status: u16,
    /// Status line and headers.
    head: String,
    body: String,
}

impl Raw {
    /// Values of header `name` (case-insensitive), in order.
    fn headers(&self, name: &str) -> Vec<&str> {
        self.head
            .lines()
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .filter(|(n, _)| n.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim())
            .collect()
    }
}

/// Sends `request` exactly as written and reads until berth closes the
/// connection (so `request` should say `Connection: close`).
async fn raw(node: &Node, request: &str) -> Raw {
    let mut stream = TcpStream::connect(addr(node)).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(PATIENCE, stream.read_to_end(&mut buf))
        .await
        .expect("berth answers and closes");
    // berth may reset a connection whose request it did not read whole,
    // but only after its answer.
    if let Err(e) = read {
        assert!(
            !buf.is_empty(),
            "no answer before the connection failed: {e}"
        );
    }
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let chunked = head.lines().skip(1).any(|l| {
        l.split_once(':').is_some_and(|(n, v)| {
            n.trim().eq_ignore_ascii_case("transfer-encoding") && v.trim() == "chunked"
        })
    });
    Raw {
        status,
        head: head.to_owned(),
        body: if chunked {
            dechunk(body)
        } else {
            body.to_owned()
        },
    }
}

/// A chunked body's data. (An instance that prints a launch token has its
/// answers streamed through the proxy's scrubber, which sends them
/// chunked.)
fn dechunk(mut body: &str) -> String {
    let mut data = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || rest.len() < size {
            break;
        }
        data.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    data
}

/// The values of header `name` in a program's report of a request
/// (`[[name, value], …]` under `headers`).
fn seen_header<'a>(seen: &'a Value, name: &str) -> Vec<&'a str> {
    seen["headers"]
        .as_array()
        .expect("a headers list")
        .iter()
        .filter(|h| h[0].as_str().is_some_and(|n| n.eq_ignore_ascii_case(name)))
        .filter_map(|h| h[1].as_str())
        .collect()
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// Lines of `user`'s program log (its stdout and stderr, written by the
/// shim) that contain `needle`.
fn log_lines(node: &Node, slug: &str, needle: &str) -> usize {
    std::fs::read_to_string(node.data_dir.join(format!("users/{slug}/logs/main.log")))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn forwarded_headers_are_set_and_hop_by_hop_headers_removed_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(0, &upstream(""), ""));
    let token = node.user_token("alice").await;
    let r = raw(
        &node,
        &format!(
            "GET /u/alice/x/echo?q=1 HTTP/1.1\r\nHost: berth.test:8000\r\nAuthorization: Bearer {token}\r\n\
             Connection: close, X-Secret\r\nX-Secret: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\n\
             Proxy-Authorization: Basic eA==\r\nProxy-Connection: keep-alive\r\n\
             X-Forwarded-For: 203.0.113.9\r\nX-Forwarded-Proto: https\r\nX-Forwarded-Host: evil.example\r\n\
             X-Custom: kept\r\n\r\n"
        ),
    )
    .await;
    assert_eq!(r.status, 200, "{r:?}");
    let seen = json(&r.body);
    assert_eq!(seen["path"], "/u/alice/x/echo?q=1", "{seen}");
    assert_eq!(seen_header(&seen, "x-custom"), ["kept"], "{seen}");
    // The client's address is appended; from a client that is not a
    // trusted proxy, Proto and Host are berth's own view, not the client's.
    assert_eq!(
        seen_header(&seen, "x-forwarded-for"),
        ["203.0.113.9, 127.0.0.1"],
        "{seen}"
    );
    assert_eq!(seen_header(&seen, "x-forwarded-proto"), ["http"], "{seen}");
    assert_eq!(
        seen_header(&seen, "x-forwarded-host"),
        ["berth.test:8000"],
        "{seen}"
    );
    assert_eq!(
        seen_header(&seen, "host"),
        ["berth.test:8000"],
        "the client's Host is passed on: {seen}"
    );
    for gone in [
        "connection",
        "x-secret",
        "keep-alive",
        "te",
        "proxy-authorization",
        "proxy-connection",
    ] {
        assert!(
            seen_header(&seen, gone).is_empty(),
            "{gone} reached the program: {seen}"
        );
    }

    // The program's own hop-by-hop headers stay between it and berth.
    assert_eq!(r.headers("x-app"), ["yes"], "{}", r.head);
    for gone in ["x-up-secret", "keep-alive", "proxy-authenticate"] {
        assert!(
            r.headers(gone).is_empty(),
            "{gone} reached the client: {}",
            r.head
        );
    }
    for connection in r.headers("connection") {
        assert!(
            !connection.to_ascii_lowercase().contains("x-up-secret"),
            "{}",
            r.head
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn host_routing_reaches_the_user_the_host_names() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(
        dir.path(),
        &config(1, DEMO_ECHO, "base_domain = \"berth.test\"\n"),
    );
    let alice = node.user_token("alice").await;
    // `<user>.<base_domain>`, any case: alice's program, woken by the
    // request, gets the path as sent (host routing never strips).
    let r = raw(
        &node,
        &format!(
            "GET /lab/echo?x=1 HTTP/1.1\r\nHost: Alice.Berth.Test:8000\r\nAuthorization: Bearer {alice}\r\nConnection: close\r\n\r\n"
        ),
    )
    .await;
    assert_eq!(r.status, 200, "{r:?}");
    let seen = json(&r.body);
    assert_eq!(seen["env"]["BERTH_USER"], "alice", "{seen}");
    assert_eq!(seen["uri"], "/lab/echo?x=1", "{seen}");
    assert_eq!(
        seen_header(&seen, "host"),
        ["Alice.Berth.Test:8000"],
        "{seen}"
    );

    // A user whose id is no DNS label is reached by its hashed slug, once
    // berth knows the user; before, that host names nobody.
    let id = "a@b.c";
    let slug = berth_core::UserId::parse(id).unwrap().slug();
    let by_slug = |token: &str| {
        format!(
            "GET /echo HTTP/1.1\r\nHost: {}.berth.test\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n",
            slug.as_str()
        )
    };
    let r = raw(&node, &by_slug(&node.token)).await;
    assert_eq!(r.status, 404, "{r:?}");
    assert_eq!(json(&r.body)["error"], "not_found", "{r:?}");
    assert_eq!(node.status_of("a%40b.c").await, "none");
    let (status, body) = node
        .post("/users/a%40b.c/instance", serde_json::json!({}))
        .await;
    assert_eq!(status, 201, "{body}");
    let token = node.user_token("a%40b.c").await;
    let r = raw(&node, &by_slug(&token)).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(json(&r.body)["env"]["BERTH_USER"], id, "{r:?}");

    // The base domain itself is berth's own.
    let r = raw(
        &node,
        "GET /healthz HTTP/1.1\r\nHost: berth.test\r\nConnection: close\r\n\r\n",
    )
    .await;
    // (A user route would have wanted credentials: 401.)
    assert_eq!(r.status, 200, "{r:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_base_path_without_its_slash_is_redirected_with_308() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(2, "", ""));
    for (path, location) in [
        ("/u/alice", "/u/alice/"),
        ("/u/alice?a=1&b=2", "/u/alice/?a=1&b=2"),
        ("/u/a%40b.c", "/u/a%40b.c/"),
    ] {
        let r = raw(
            &node,
            &format!("GET {path} HTTP/1.1\r\nHost: berth.test\r\nConnection: close\r\n\r\n"),
        )
        .await;
        assert_eq!(r.status, 308, "{path}: {r:?}");
        assert_eq!(r.headers("location"), [location], "{path}: {}", r.head);
    }
    // A redirect needs no credentials and wakes nobody.
    assert_eq!(node.status_of("alice").await, "none");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_for_an_instance_not_ready_in_time_is_503_instance_starting() {
    let dir = tempfile::tempdir().unwrap();
    let never_ready = format!(
        "command = [\"{}\", \"demo-app\", \"--port\", \"{{port}}\", \"--never-ready\"]\n\
         ready_timeout_s = 1\n",
        support::BERTH
    );
    let node = Node::start(dir.path(), &config(3, &never_ready, ""));
    let token = node.user_token("alice").await;
    // Not a browser navigation: the request waits `ready_timeout_s` for the
    // instance, then gets a JSON 503 it can retry, not the program's own
    // "not ready" answer.
    let r = node
        .http
        .get(format!("{}/u/alice/", node.url))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let retry_after: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .expect("Retry-After in seconds");
    assert!(retry_after >= 1, "{retry_after}");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"], "instance_starting", "{body}");
    assert_ne!(
        node.status_of("alice").await,
        "none",
        "the request launched alice"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stale_kept_alive_connection_is_retried_for_idempotent_requests_only() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(4, &upstream(""), ""));
    let token = node.user_token("alice").await;
    let client = reqwest::Client::new();
    let get = || {
        client
            .get(format!("{}/u/alice/flaky", node.url))
            .bearer_auth(&token)
            .send()
    };
    // Every answered /flaky leaves its upstream connection to drop the next
    // request: a GET that meets such a pooled connection is sent again on a
    // fresh one, and the client never notices.
    for i in 0..20 {
        let r = get().await.unwrap();
        let status = r.status();
        // Read to the end, so that berth's upstream connection goes back
        // to its pool.
        let body = r.text().await.unwrap();
        assert_eq!(status, 200, "GET {i}: {body}");
        if log_lines(&node, "alice", "upstream: dropped GET") >= 2 {
            break;
        }
    }
    eventually(PATIENCE, "the program logging dropped GETs", || async {
        (log_lines(&node, "alice", "upstream: dropped GET") >= 2).then_some(())
    })
    .await;

    // A POST with a body is never sent twice: when it meets a dropped
    // connection, the client gets 502.
    let mut answers = Vec::new();
    for _ in 0..20 {
        let r = client
            .post(format!("{}/u/alice/flaky", node.url))
            .bearer_auth(&token)
            .body("payload")
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        answers.push(status);
        if status == 502 {
            let body: Value = r.json().await.unwrap();
            assert_eq!(body["error"], "bad_gateway", "{body}");
            break;
        }
        let body = r.text().await.unwrap();
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(
        answers.last(),
        Some(&502),
        "no POST met a stale connection: {answers:?}"
    );
    eventually(PATIENCE, "the program logging the dropped POST", || async {
        (log_lines(&node, "alice", "upstream: dropped POST") == 1).then_some(())
    })
    .await;
}

/// A WebSocket through berth to alice's demo app.
async fn alice_ws(
    node: &Node,
    token: &str,
) -> Result<WebSocket, tokio_tungstenite::tungstenite::Error> {
    websocket(addr(node), "/u/alice/ws", token).await
}

async fn echo_once(ws: &mut tokio_tungstenite::WebSocketStream<TcpStream>, text: &str) {
    ws.send(Message::text(text)).await.unwrap();
    let echo = tokio::time::timeout(PATIENCE, ws.next())
        .await
        .expect("an echo")
        .expect("the socket is open")
        .unwrap();
    assert_eq!(echo, Message::text(text));
}

#[tokio::test(flavor = "multi_thread")]
async fn upgrades_beyond_max_upgrades_get_503() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(5, "", "max_upgrades = 1\n"));
    let token = node.user_token("alice").await;
    let mut first = alice_ws(&node, &token).await.expect("the first upgrade");
    echo_once(&mut first, "one").await;

    // The one slot is taken: the next upgrade is refused before it reaches
    // the program, while plain requests go on.
    match alice_ws(&node, &token).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status().as_u16(), 503);
            let body = String::from_utf8_lossy(response.body().as_deref().unwrap_or_default())
                .into_owned();
            assert_eq!(json(&body)["error"], "too_many_upgrades", "{body}");
        }
        Err(e) => panic!("refused, but not with 503: {e}"),
        Ok(_) => panic!("a second upgrade went through with max_upgrades = 1"),
    }
    let r = node
        .http
        .get(format!("{}/u/alice/", node.url))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    echo_once(&mut first, "still open").await;

    // Closing the first frees the slot.
    first.close(None).await.unwrap();
    drop(first);
    let mut again = eventually(PATIENCE, "the upgrade slot free again", || async {
        alice_ws(&node, &token).await.ok()
    })
    .await;
    echo_once(&mut again, "again").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_in_flight_requests_finish_and_cuts_the_rest_after_the_grace() {
    let dir = tempfile::tempdir().unwrap();
    let mut node = Node::start(dir.path(), &config(6, "", ""));
    let token = node.user_token("alice").await;
    let stream = |n: u32| {
        node.http
            .get(format!("{}/u/alice/sse?n={n}", node.url))
            .bearer_auth(&token)
            .send()
    };
    // Two streams in flight: one that ends on its own (30 events, 100 ms
    // apart) and one that would run for hours.
    let short = stream(30).await.unwrap();
    let endless = stream(100_000).await.unwrap();
    assert_eq!(
        (short.status().as_u16(), endless.status().as_u16()),
        (200, 200)
    );
    let mut short = short.bytes_stream();
    let mut endless = endless.bytes_stream();
    let first = short.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("data: event 0"));
    endless.next().await.unwrap().unwrap();

    node.signal(nix::sys::signal::Signal::SIGTERM);
    // berth stops listening at once…
    eventually(PATIENCE, "the listener closed", || async {
        TcpStream::connect(addr(&node)).await.is_err().then_some(())
    })
    .await;
    // …the short stream still arrives whole and ends cleanly…
    let mut text = String::from_utf8_lossy(&first).into_owned();
    while let Some(chunk) = short.next().await {
        let chunk = chunk.expect("the in-flight stream ends cleanly, not cut");
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let events = text.matches("data: event ").count();
    assert_eq!(events, 30, "{text}");
    // …the endless one is cut once the grace is over, and berth exits.
    let cut = tokio::time::timeout(PATIENCE, async {
        loop {
            match endless.next().await {
                Some(Ok(_)) => {}
                Some(Err(_)) => return true,
                None => return false,
            }
        }
    })
    .await
    .expect("the endless stream was never cut");
    assert!(cut, "the endless stream was ended as if complete");
    let status = eventually(PATIENCE, "berth exited", || {
        let status = node.exit_status();
        async move { status }
    })
    .await;
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_instance_whose_port_refuses_is_502() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(7, &upstream(", \"--refuse\""), ""));
    let token = node.user_token("alice").await;
    let r = node
        .http
        .get(format!("{}/u/alice/", node.url))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"], "bad_gateway", "{body}");
    // berth answered for the program; the program itself runs on, ready.
    let main = node.main_of("alice").await;
    assert_eq!(main["status"], "running", "{main}");
    assert_eq!(main["ready"], true, "{main}");
    let pid = main["pid"].as_u64().unwrap();
    assert!(support::alive(pid));
}

/// A program may print its ready line a moment before it listens (Jupyter
/// Server does): berth tries a refused connect again, so even a POST with
/// a body gets through, whole.
#[tokio::test(flavor = "multi_thread")]
async fn an_instance_that_listens_a_moment_after_its_ready_line_is_reached() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(
        dir.path(),
        &config(8, &upstream(", \"--listen-late\", \"300\""), ""),
    );
    let token = node.user_token("alice").await;
    let r = node
        .http
        .post(format!("{}/u/alice/echo", node.url))
        .bearer_auth(&token)
        .body("payload=42")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen: Value = r.json().await.unwrap();
    assert_eq!(seen["method"], "POST", "{seen}");
    assert_eq!(seen["body_bytes"], 10, "{seen}");
    // It did bind late: the scenario happened.
    eventually(PATIENCE, "the program's late bind in its log", || async {
        (log_lines(&node, "alice", "upstream: bound at last") == 1).then_some(())
    })
    .await;
}

/// A proxied request for a user whose crash breaker is open is refused
/// with the breaker's own 503, and wakes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn an_open_breaker_is_503_instance_circuit_open() {
    let dir = tempfile::tempdir().unwrap();
    let crashing = format!(
        "command = [\"{}\", \"demo-app\", \"--port\", \"{{port}}\", \"--crash-after-ms\", \"100\"]\n",
        support::BERTH
    );
    let node = Node::start(
        dir.path(),
        &config(
            9,
            &crashing,
            "[crash]\nbackoff_base_ms = 20\nbackoff_max_ms = 100\n",
        ),
    );
    let (status, body) = node
        .post("/users/alice/instance?wait=false", serde_json::json!({}))
        .await;
    assert!(status == 201 || status == 200, "{status} {body}");
    eventually(PATIENCE, "alice's breaker open", || async {
        (node.status_of("alice").await == "failed").then_some(())
    })
    .await;
    let token = node.user_token("alice").await;
    let r = node
        .http
        .get(format!("{}/u/alice/", node.url))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let retry_after: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .expect("Retry-After in seconds");
    assert!(retry_after >= 1, "{retry_after}");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"], "instance_circuit_open", "{body}");
    assert_eq!(body["opens"], 1, "{body}");
    assert_eq!(node.status_of("alice").await, "failed");
}
