//! End-to-end acceptance of the proxy: the real binary, real
//! instances (`berth demo-app`, Python's http.server, Jupyter Server),
//! real sockets.

use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use futures_util::{SinkExt, StreamExt};
use support::{Node, eventually, rss_kib, signal, websocket};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;

/// Bound for anything that should happen "soon"; only a hang reaches it.
const PATIENCE: Duration = Duration::from_secs(60);
const GIB: u64 = 1024 * 1024 * 1024;

/// A config with its own port range (tests run in parallel) plus extra
/// `[instance]` and `[proxy]` keys.
fn config(n: u16, instance: &str, proxy: &str) -> String {
    let start = berth_testkit::port_block_for(&format!("{} {n}", module_path!()), 20);
    format!(
        "[instance]\nport_range = [{start}, {}]\n{instance}\n[proxy]\n{proxy}\n",
        start + 19
    )
}

fn addr(node: &Node) -> SocketAddr {
    node.url
        .trim_start_matches("http://")
        .parse()
        .expect("berth listens on an IP address")
}

fn no_redirects() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

async fn get(node: &Node, path: &str, token: &str) -> reqwest::Response {
    node.http
        .get(format!("{}{path}", node.url))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
}

/// Sends raw bytes and reads until berth closes the connection.
async fn raw(node: &Node, request: &[u8]) -> (u16, String) {
    let mut stream = TcpStream::connect(addr(node)).await.unwrap();
    stream.write_all(request).await.unwrap();
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
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_demo_page_behind_auth_with_wake_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(0, "", ""));
    let alice = node.user_token("alice").await;
    assert_eq!(node.status_of("alice").await, "none");

    // A stopped user: the request starts the instance and is answered in
    // one round trip.
    let r = get(&node, "/u/alice/", &alice).await;
    assert_eq!(r.status(), 200);
    let page = r.text().await.unwrap();
    assert!(
        page.contains("berth demo app") && page.contains("alice"),
        "{page}"
    );
    assert_eq!(node.status_of("alice").await, "running");

    // No token: 401, as JSON for API clients and as a page for browsers.
    let r = node
        .http
        .get(format!("{}/u/alice/", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"], "unauthorized");
    let r = node
        .http
        .get(format!("{}/u/alice/", node.url))
        .header("Accept", "text/html,application/xhtml+xml")
        .header("Sec-Fetch-Mode", "navigate")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    assert!(r.text().await.unwrap().contains("Unauthorized"));

    // Alice's token reaches only alice; the admin's reaches everyone.
    let r = get(&node, "/u/bob/", &alice).await;
    assert_eq!(r.status(), 403);
    assert_eq!(
        r.json::<serde_json::Value>().await.unwrap()["error"],
        "forbidden"
    );
    assert_eq!(
        node.status_of("bob").await,
        "none",
        "a refused request wakes nothing"
    );
    let r = get(&node, "/u/bob/", &node.token).await;
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("bob"));
    assert_eq!(get(&node, "/u/alice/", &node.token).await.status(), 200);

    // The one-shot query token becomes a cookie and a redirect.
    let browser = no_redirects();
    let r = browser
        .get(format!("{}/u/alice/?berth_token={alice}", node.url))
        .send()
        .await
        .unwrap();
    assert!(matches!(r.status().as_u16(), 302 | 303), "{}", r.status());
    assert_eq!(r.headers()["location"], "/u/alice/");
    let cookie = r.headers()["set-cookie"].to_str().unwrap().to_owned();
    for attr in ["HttpOnly", "SameSite=Lax", "Path=/u/alice/"] {
        assert!(cookie.contains(attr), "{cookie}");
    }
    let jar = cookie.split(';').next().unwrap();
    let r = browser
        .get(format!("{}/u/alice/", node.url))
        .header("Cookie", jar)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("alice"));
}

/// A browser that navigates to a stopped user's app gets the starting
/// page, which reloads itself until the app answers. (It polls: the API's
/// progress stream takes no browser cookie, and the user cookie belongs to
/// the app's own path.)
#[tokio::test(flavor = "multi_thread")]
async fn a_browser_follows_the_starting_page_to_the_app() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(1, "", ""));
    let carol = node.user_token("carol").await;
    let cookie = format!("berth_token={carol}");
    let navigate = |path: &str| {
        node.http
            .get(format!("{}{path}", node.url))
            .header("Cookie", &cookie)
            .header("Accept", "text/html")
            .header("Sec-Fetch-Mode", "navigate")
            .send()
    };
    let r = navigate("/u/carol/").await.unwrap();
    assert_eq!(r.status(), 202);
    let page = r.text().await.unwrap();
    assert!(page.contains("Starting the workspace of carol"), "{page}");
    assert!(page.contains("location.reload()"), "{page}");
    assert!(
        !page.contains(r#"<meta name="berth-progress""#),
        "no stream the browser could not open: {page}"
    );

    // What the page does: reload until the app answers.
    let page = eventually(PATIENCE, "carol's app after reloads", || async {
        let r = navigate("/u/carol/").await.unwrap();
        if r.status() == 200 {
            return Some(r.text().await.unwrap());
        }
        assert_eq!(r.status(), 202, "only the starting page in between");
        None
    })
    .await;
    assert!(page.contains("carol"), "{page}");
}

#[tokio::test(flavor = "multi_thread")]
async fn websockets_echo_a_thousand_messages() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(2, "", ""));
    let mut ws = websocket(addr(&node), "/u/alice/ws", &node.token)
        .await
        .expect("the WebSocket handshake goes through berth (waking alice)");
    for i in 0..1000 {
        ws.send(Message::text(format!("message {i}")))
            .await
            .unwrap();
        let echo = tokio::time::timeout(PATIENCE, ws.next())
            .await
            .expect("an echo")
            .expect("the socket is open")
            .unwrap();
        assert_eq!(echo, Message::text(format!("message {i}")));
    }
    ws.close(None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn chunked_and_sse_responses_stream() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(3, "", ""));
    let r = get(&node, "/u/alice/bytes?n=1000000", &node.token).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["transfer-encoding"], "chunked");
    assert_eq!(r.bytes().await.unwrap().len(), 1_000_000);

    // 50 events 100 ms apart: the first arrives alone, long before the last
    // is even produced.
    let r = get(&node, "/u/alice/sse?n=50", &node.token).await;
    assert_eq!(r.status(), 200);
    let mut stream = r.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    let first = String::from_utf8_lossy(&first).into_owned();
    assert!(first.contains("data: event 0"), "{first}");
    assert!(
        !first.contains("event 49"),
        "the stream was buffered: {first}"
    );
    let mut rest = String::new();
    while let Some(chunk) = stream.next().await {
        rest.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    assert!(rest.contains("data: event 49"), "{rest}");
}

/// Samples the RSS of `pid` until `done`, keeping the maximum.
fn sample_rss(pid: u32, done: Arc<AtomicBool>, max: Arc<AtomicU64>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while !done.load(Ordering::Relaxed) {
            if let Some(kib) = rss_kib(pid) {
                max.fetch_max(kib, Ordering::Relaxed);
            }
            // The sampling rate of the measurement.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gigabyte_streams_each_way_in_flat_memory() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(4, "", ""));
    let pid = node.pid().unwrap();
    // Warm up: instance running, pool and buffers allocated.
    assert_eq!(
        get(&node, "/u/alice/bytes?n=10000000", &node.token)
            .await
            .bytes()
            .await
            .unwrap()
            .len(),
        10_000_000
    );
    let baseline = rss_kib(pid).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let max = Arc::new(AtomicU64::new(baseline));
    let sampler = sample_rss(pid, done.clone(), max.clone());

    let r = get(&node, &format!("/u/alice/bytes?n={GIB}"), &node.token).await;
    assert_eq!(r.status(), 200);
    let mut stream = r.bytes_stream();
    let mut downloaded = 0u64;
    while let Some(chunk) = stream.next().await {
        downloaded += chunk.unwrap().len() as u64;
    }
    assert_eq!(downloaded, GIB);

    let chunk = Bytes::from(vec![7u8; 256 * 1024]);
    let chunks = GIB / chunk.len() as u64;
    let body = futures_util::stream::iter(
        (0..chunks).map(move |_| Ok::<_, std::io::Error>(chunk.clone())),
    );
    let r = node
        .http
        .post(format!("{}/u/alice/upload", node.url))
        .bearer_auth(&node.token)
        .body(reqwest::Body::wrap_stream(body))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let counted: serde_json::Value = r.json().await.unwrap();
    assert_eq!(counted["bytes"].as_u64(), Some(GIB));

    done.store(true, Ordering::Relaxed);
    sampler.await.unwrap();
    let growth_mib = max.load(Ordering::Relaxed).saturating_sub(baseline) / 1024;
    assert!(
        growth_mib < 64,
        "berth's RSS grew by {growth_mib} MiB while streaming"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_instance_fails_only_its_own_stream_and_comes_back() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(5, "", ""));
    let open_stream = |user: &'static str| {
        let node = &node;
        async move {
            let r = get(node, &format!("/u/{user}/sse?n=100000"), &node.token).await;
            assert_eq!(r.status(), 200);
            let mut stream = r.bytes_stream();
            let first = stream.next().await.unwrap().unwrap();
            assert!(String::from_utf8_lossy(&first).contains("event 0"));
            stream
        }
    };
    let mut alice = open_stream("alice").await;
    let mut bob = open_stream("bob").await;
    let before = node.running_main("alice", None).await;
    let pid = before["pid"].as_u64().unwrap();
    signal(pid as u32, nix::sys::signal::Signal::SIGKILL);

    // Alice's stream ends in an error: no clean end, no made-up events.
    let ended = tokio::time::timeout(PATIENCE, async {
        loop {
            match alice.next().await {
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(e),
                None => return Ok(()),
            }
        }
    })
    .await
    .expect("alice's stream ends when her instance dies");
    assert!(ended.is_err(), "a cut stream must not look complete");

    // Bob's goes on.
    let mut more = String::new();
    while !more.contains("event 3") {
        let chunk = tokio::time::timeout(PATIENCE, bob.next())
            .await
            .expect("bob's events keep coming")
            .expect("bob's stream is open")
            .unwrap();
        more.push_str(&String::from_utf8_lossy(&chunk));
    }

    // The restarted instance is reached on its (new) port.
    let after = node.running_main("alice", Some(pid)).await;
    let port = after["port"].as_u64().unwrap();
    eventually(PATIENCE, "alice reachable after her restart", || async {
        let r = get(&node, "/u/alice/", &node.token).await;
        (r.status() == 200).then_some(())
    })
    .await;
    // The record still names the port the proxy just reached.
    assert_eq!(
        node.running_main("alice", Some(pid)).await["port"].as_u64(),
        Some(port)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_get_4xx_and_berth_lives_on() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(6, "", ""));
    let token = node.token.clone();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "bad Host",
            format!("GET /u/alice/ HTTP/1.1\r\nHost: bad host!\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n").into_bytes(),
        ),
        (
            "70 KB header",
            format!(
                "GET /u/alice/ HTTP/1.1\r\nHost: h\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
                "x".repeat(70 * 1024)
            )
            .into_bytes(),
        ),
        (
            "invalid percent-encoding",
            format!("GET /u/%E0%zz/ HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n").into_bytes(),
        ),
        ("HTTP/1.0 without Host", b"GET /u/alice/ HTTP/1.0\r\n\r\n".to_vec()),
    ];
    for (what, request) in cases {
        let (status, text) = raw(&node, &request).await;
        assert!(
            (400..500).contains(&status),
            "{what}: {}",
            &text[..text.len().min(300)]
        );
        if what == "70 KB header" {
            assert_eq!(status, 431, "{what}");
        }
    }
    assert_eq!(node.healthz().await, 200);
    assert_eq!(get(&node, "/u/alice/", &token).await.status(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slowloris_client_is_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(7, "", "header_timeout_ms = 500"));
    let stream = TcpStream::connect(addr(&node)).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let dribble = tokio::spawn(async move {
        let head = b"GET /u/alice/ HTTP/1.1\r\nHost: h\r\nX-Slow: ";
        for byte in head.iter().chain(std::iter::repeat(&b'a')) {
            if write.write_all(std::slice::from_ref(byte)).await.is_err() {
                return;
            }
            // The slowloris attack itself: one byte per 100 ms.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let mut buf = Vec::new();
    let cut = tokio::time::timeout(PATIENCE, read.read_to_end(&mut buf)).await;
    dribble.abort();
    assert!(cut.is_ok(), "berth never cut the slow client off");
    assert_eq!(node.healthz().await, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn python_http_server_behind_strip_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let instance = r#"command = ["python3", "-m", "http.server", "{port}", "--bind", "127.0.0.1", "--directory", "{folder}"]
ready_http_path = "/"
ready_timeout_s = 30
stop_grace_s = 2"#;
    let node = Node::start(dir.path(), &config(8, instance, "strip_prefix = true"));
    let r = get(&node, "/u/alice/", &node.token).await;
    assert_eq!(r.status(), 200);
    let listing = r.text().await.unwrap();
    assert!(listing.contains("Directory listing for /"), "{listing}");
    let r = get(&node, "/u/alice/no-such-file", &node.token).await;
    assert_eq!(r.status(), 404, "http.server answers for its own paths");
}

#[tokio::test(flavor = "multi_thread")]
async fn jupyter_server_behind_berth() {
    if !support::jupyter("proxy::jupyter_server_behind_berth") {
        return;
    }
    // The shipped example, unchanged: as root, berth runs Jupyter under
    // alice's own account (isolation mode `user`), so Jupyter's refusal to
    // run as root never comes up. Only where to listen and keep data is
    // given on the command line.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let example =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/jupyter.toml");
    let node = Node::from(
        support::berth()
            .node(dir.path())
            .args(
                &[
                    "serve",
                    "--config",
                    example.to_str().unwrap(),
                    "--listen",
                    "127.0.0.1:0",
                    "--data-dir",
                    data.to_str().unwrap(),
                ],
                &data,
            )
            .start(),
    );
    let (status, body) = node
        .post("/users/alice/instance", serde_json::json!({}))
        .await;
    assert_eq!(status, 201, "{body}");
    let url = body["url"].as_str().unwrap();
    assert_eq!(url, format!("{}/u/alice/", node.url), "no launch token");
    // berth's credential as the user cookie, and nothing of Jupyter's:
    // berth presents Jupyter's token itself (`credential_header`).
    let alice = node.user_token("alice").await;
    let r = node
        .http
        .get(format!("{}/u/alice/api/status", node.url))
        .header("Cookie", format!("berth_token={alice}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let status: serde_json::Value = r.json().await.unwrap();
    assert!(status.get("started").is_some(), "{status}");
}

/// An e-mail-like id: every URL berth hands out, the path the proxy
/// forwards (`strip_prefix = false`) and the program's `BERTH_BASE_PATH`
/// all use the same percent-encoded form, so an app routing on its base
/// path finds its own pages.
#[tokio::test(flavor = "multi_thread")]
async fn an_email_like_user_reaches_the_app_under_its_encoded_base_path() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(10, "", ""));
    let (status, body) = node
        .post("/users/a%40b.c/tokens", serde_json::json!({}))
        .await;
    assert_eq!(status, 201, "{body}");
    let token = body["token"].as_str().unwrap().to_owned();
    assert_eq!(
        body["url"].as_str().unwrap(),
        format!("{}/u/a%40b.c/?berth_token={token}", node.url)
    );

    let r = get(&node, "/u/a%40b.c/", &token).await;
    assert_eq!(r.status(), 200);
    let page = r.text().await.unwrap();
    assert!(page.contains(r#"data-base="/u/a%40b.c/""#), "{page}");
    assert!(page.contains("a@b.c"), "{page}");

    let r = get(&node, "/u/a%40b.c/bytes?n=5", &token).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.bytes().await.unwrap().len(), 5);

    let pids = support::instance_pids(&node.data_dir, "a@b.c", "main");
    assert_eq!(pids.len(), 1, "{pids:?}");
    let environ = std::fs::read(format!("/proc/{}/environ", pids[0])).unwrap();
    assert!(
        environ
            .split(|b| *b == 0)
            .any(|v| v == b"BERTH_BASE_PATH=/u/a%40b.c/"),
        "BERTH_BASE_PATH is the encoded base path"
    );
    node.kill_instances();
}

/// berth serves while it adopts. After a `kill -9`, a new berth listens
/// before it has adopted every instance: `/healthz` answers, a user
/// already adopted is served, and a user not adopted yet gets the
/// starting page (a browser) or `503 instance_starting` (an API client),
/// never a second instance. What keeps one user's adoption waiting is its
/// shim, stopped by the test: it takes berth's connection and does not
/// greet it until the test lets it run again.
#[tokio::test(flavor = "multi_thread")]
async fn berth_serves_while_it_adopts_and_never_starts_a_second_instance() {
    let dir = tempfile::tempdir().unwrap();
    let mut node = Node::start(dir.path(), &config(11, "", ""));
    let mut before = Vec::new();
    for user in ["held", "free"] {
        let (status, body) = node
            .post(&format!("/users/{user}/instance"), serde_json::json!({}))
            .await;
        assert_eq!(status, 201, "{body}");
        let pid = body["instance"]["pid"].as_u64().unwrap();
        let programs = support::instance_pids(&node.data_dir, user, "main");
        assert!(!programs.is_empty(), "{user} runs");
        before.push((user, pid, programs));
    }
    node.kill9();
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(node.data_dir.join("run/held/main.json")).unwrap())
            .unwrap();
    let held_shim = u32::try_from(state["shim_pid"].as_u64().unwrap()).unwrap();
    signal(held_shim, nix::sys::signal::Signal::SIGSTOP);
    node.restart();

    // `free` is adopted and served while `held` still waits.
    assert_eq!(node.healthz().await, 200);
    let free_token = node.user_token("free").await;
    let page = eventually(PATIENCE, "free's app, once adopted", || async {
        let r = get(&node, "/u/free/", &free_token).await;
        if r.status() == 200 {
            return Some(r.text().await.unwrap());
        }
        assert_eq!(r.status(), 503, "only `starting` before");
        None
    })
    .await;
    assert!(page.contains("free"), "{page}");
    let free = node.running_main("free", None).await;
    assert_eq!(free["pid"].as_u64(), Some(before[1].1), "free adopted");
    assert_eq!(
        node.metric("berth_instances_awaiting_adoption").await,
        Some(1.0),
        "held waits on its shim"
    );

    let (_, held_pid, held_programs) = &before[0];
    let held_token = node.user_token("held").await;
    let cookie = format!("berth_token={held_token}");
    let navigate = || {
        node.http
            .get(format!("{}/u/held/", node.url))
            .header("Cookie", &cookie)
            .header("Accept", "text/html")
            .header("Sec-Fetch-Mode", "navigate")
            .send()
    };
    let r = navigate().await.unwrap();
    assert_eq!(r.status(), 202);
    let page = r.text().await.unwrap();
    assert!(page.contains("Starting the workspace of held"), "{page}");
    let (status, body) = node
        .post("/users/held/instance", serde_json::json!({}))
        .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"], "instance_starting", "{body}");
    let r = get(&node, "/u/held/", &held_token).await;
    assert_eq!(r.status(), 503, "an API client is told to retry");
    assert_eq!(
        &support::instance_pids(&node.data_dir, "held", "main"),
        held_programs,
        "no second instance"
    );

    signal(held_shim, nix::sys::signal::Signal::SIGCONT);
    let held = node.running_main("held", None).await;
    assert_eq!(held["pid"].as_u64(), Some(*held_pid), "held adopted");
    let page = eventually(PATIENCE, "held's app", || async {
        let r = navigate().await.unwrap();
        (r.status() == 200).then_some(())?;
        Some(r.text().await.unwrap())
    })
    .await;
    assert!(page.contains("held"), "{page}");
    assert_eq!(
        node.metric("berth_instances_awaiting_adoption").await,
        Some(0.0)
    );
    for (user, _, programs) in [&before[0], &before[1]] {
        assert_eq!(
            &support::instance_pids(&node.data_dir, user, "main"),
            programs,
            "{user} runs the one instance it had"
        );
    }
}
