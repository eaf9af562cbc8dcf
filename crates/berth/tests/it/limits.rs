//! Resource exhaustion, replayed against the real binary: half-sent
//! unauthenticated bodies, a trickled body, one user holding many
//! WebSockets, progress streams or followed logs, and one address holding
//! many connections.

use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use support::{Node, eventually, rss_kib, websocket};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_tungstenite::tungstenite::Message;

/// Bound for anything that should happen "soon"; only a hang reaches it.
const PATIENCE: Duration = Duration::from_secs(60);
const MIB: usize = 1024 * 1024;

/// A config with its own port range plus extra `[instance]` and `[proxy]`
/// keys.
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

/// What a client that never finishes its request saw.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// An HTTP answer with this status, then the connection closed.
    Answered(u16),
    /// Closed (or reset) without an answer.
    Closed,
}

/// Sends `head`, then `body_part` of the body it announces, never the
/// rest; returns what came back by the time berth closed the connection.
async fn half_send(to: SocketAddr, head: String, body_part: Arc<Vec<u8>>) -> Outcome {
    let stream = TcpStream::connect(to).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let writer = tokio::spawn(async move {
        if write.write_all(head.as_bytes()).await.is_ok() {
            // berth may stop reading (and close) at any point.
            let _ = write.write_all(&body_part).await;
        }
        // Hold the write side open: the client just goes quiet.
        std::future::pending::<()>().await;
        drop(write);
    });
    let mut got = Vec::new();
    let read_all = tokio::time::timeout(PATIENCE, read.read_to_end(&mut got)).await;
    writer.abort();
    assert!(read_all.is_ok(), "berth neither answered nor closed");
    let text = String::from_utf8_lossy(&got);
    match text.strip_prefix("HTTP/1.1 ") {
        Some(rest) => Outcome::Answered(rest[..3].parse().unwrap()),
        None => Outcome::Closed,
    }
}

/// Samples the RSS of `pid` until `done`, keeping the maximum.
fn sample_rss(pid: u32, done: Arc<AtomicBool>, max: Arc<AtomicU64>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while !done.load(Ordering::Relaxed) {
            if let Some(kib) = rss_kib(pid) {
                max.fetch_max(kib, Ordering::Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
}

/// The attack: 200 clients announce 1 MiB bodies without a
/// token, send half and go quiet. berth must answer each 401 without
/// reading (let alone buffering) the body, and close: its memory barely
/// moves. A third go to the API, a third to the proxy, and a third to the
/// node-to-node routes (which a single node answers 404, unread, too).
#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_half_sent_unauthenticated_bodies_get_401_in_flat_memory() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(0, "", "body_grace_ms = 5000"));
    let to = addr(&node);
    let pid = node.pid().unwrap();
    assert_eq!(node.healthz().await, 200);
    let baseline = rss_kib(pid).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let max = Arc::new(AtomicU64::new(baseline));
    let sampler = sample_rss(pid, done.clone(), max.clone());

    let half = Arc::new(vec![b'{'; MIB / 2]);
    let targets = [
        ("/api/v1/users/alice/instance", 401),
        ("/u/alice/upload", 401),
        ("/internal/v1/users/alice/launch", 404),
    ];
    let clients: Vec<_> = (0..200)
        .map(|i| {
            let path = targets[i % 3].0;
            let head = format!(
                "POST {path} HTTP/1.1\r\nHost: berth.test\r\nContent-Type: application/json\r\n\
                 Content-Length: {MIB}\r\n\r\n"
            );
            tokio::spawn(half_send(to, head, half.clone()))
        })
        .collect();
    let mut outcomes = Vec::new();
    for client in clients {
        outcomes.push(client.await.unwrap());
    }
    done.store(true, Ordering::Relaxed);
    sampler.await.unwrap();

    for (i, outcome) in outcomes.iter().enumerate() {
        let (path, status) = targets[i % 3];
        assert_eq!(*outcome, Outcome::Answered(status), "client {i}: {path}");
    }
    let growth_mib = max.load(Ordering::Relaxed).saturating_sub(baseline) / 1024;
    eprintln!("berth's RSS: {baseline} KiB before, +{growth_mib} MiB at most during the attack");
    assert!(
        growth_mib < 32,
        "berth's RSS grew by {growth_mib} MiB (from {baseline} KiB)"
    );
    // Nothing was launched for anyone, and berth serves on.
    assert_eq!(node.status_of("alice").await, "none");
}

/// Sends `head` and then one body byte every 2 s until berth answers or
/// closes; returns the answer's status (0: closed without one).
async fn trickle(to: SocketAddr, head: String) -> u16 {
    let stream = TcpStream::connect(to).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let writer = tokio::spawn(async move {
        if write.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        loop {
            if write.write_all(b" ").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    });
    let mut got = Vec::new();
    let read_all = tokio::time::timeout(PATIENCE, read.read_to_end(&mut got)).await;
    writer.abort();
    assert!(read_all.is_ok(), "a trickled body was never cut off");
    let text = String::from_utf8_lossy(&got);
    text.strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest[..3].parse().ok())
        .unwrap_or(0)
}

/// A body trickled at one byte every 2 s, to a running instance through the
/// proxy and to the API, is cut off: the client gets 408 (or an error) and
/// the connection closes, while a body sent at a normal pace goes through.
#[tokio::test(flavor = "multi_thread")]
async fn a_body_trickled_at_one_byte_per_two_seconds_is_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(
        dir.path(),
        &config(1, "", "body_min_bytes_per_s = 100\nbody_grace_ms = 3000"),
    );
    let to = addr(&node);
    let token = &node.token;
    // alice runs, so the proxied request goes straight to her upload page.
    let r = node
        .http
        .get(format!("{}/u/alice/", node.url))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let proxied = trickle(
        to,
        format!(
            "POST /u/alice/upload HTTP/1.1\r\nHost: berth.test\r\nAuthorization: Bearer {token}\r\n\
             Content-Length: 1000\r\n\r\n"
        ),
    );
    let api = trickle(
        to,
        format!(
            "POST /api/v1/users/bob/instance HTTP/1.1\r\nHost: berth.test\r\n\
             Authorization: Bearer {token}\r\nContent-Type: application/json\r\n\
             Content-Length: 1000\r\n\r\n"
        ),
    );
    let (proxied, api) = tokio::join!(proxied, api);
    assert_eq!(proxied, 408, "the proxy answers a trickled body 408");
    assert_eq!(api, 408, "so does the API");
    assert_eq!(node.status_of("bob").await, "none", "nothing was launched");

    // A body at a normal pace is untouched by the bound.
    let r = node
        .http
        .post(format!("{}/u/alice/upload", node.url))
        .bearer_auth(token)
        .body(vec![7u8; 4 * MIB])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let counted: serde_json::Value = r.json().await.unwrap();
    assert_eq!(counted["bytes"].as_u64(), Some(4 * MIB as u64));
    // The API still bounds the paced bodies it reads by size: a chunked
    // body (no length to refuse up front) is cut at 1 MiB. Its one chunk,
    // one byte over, is sent whole and nothing after it, so berth reads
    // every byte sent before it answers and closes.
    let mut stream = TcpStream::connect(to).await.unwrap();
    let head = format!(
        "POST /api/v1/users/bob/instance HTTP/1.1\r\nHost: berth.test\r\n\
         Authorization: Bearer {token}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\n\r\n{:x}\r\n",
        MIB + 1
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&vec![b' '; MIB + 1]).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(PATIENCE, stream.read_to_end(&mut answer))
        .await
        .expect("berth answers and closes")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("payload_too_large"), "{answer}");
    assert_eq!(node.status_of("bob").await, "none", "nothing was launched");
}

fn refused_status(err: &tokio_tungstenite::tungstenite::Error) -> Option<u16> {
    match err {
        tokio_tungstenite::tungstenite::Error::Http(response) => Some(response.status().as_u16()),
        _ => None,
    }
}

async fn echo(ws: &mut tokio_tungstenite::WebSocketStream<TcpStream>, text: &str) {
    ws.send(Message::text(text)).await.unwrap();
    let back = tokio::time::timeout(PATIENCE, ws.next())
        .await
        .expect("an echo")
        .expect("the socket is open")
        .unwrap();
    assert_eq!(back, Message::text(text));
}

/// With a per-user cap of 5, alice's five open WebSockets stop her sixth
/// (429) but not bob's first; closing one of hers gives her a slot back.
#[tokio::test(flavor = "multi_thread")]
async fn alices_five_websockets_leave_bob_his() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(2, "", "max_upgrades_per_user = 5"));
    let to = addr(&node);
    let alice = node.user_token("alice").await;
    let bob = node.user_token("bob").await;
    let mut alices = Vec::new();
    for i in 0..5 {
        let mut ws = websocket(to, "/u/alice/ws", &alice).await.unwrap();
        echo(&mut ws, &format!("alice {i}")).await;
        alices.push(ws);
    }
    let err = websocket(to, "/u/alice/ws", &alice).await.unwrap_err();
    assert_eq!(refused_status(&err), Some(429), "{err}");
    // The admin opening alice's app counts against alice's cap too: the
    // cap is per user whose app it is, whoever asks.
    let err = websocket(to, "/u/alice/ws", &node.token).await.unwrap_err();
    assert_eq!(refused_status(&err), Some(429), "{err}");

    let mut bobs = websocket(to, "/u/bob/ws", &bob)
        .await
        .expect("alice's cap leaves bob his WebSocket");
    echo(&mut bobs, "bob").await;
    for (i, ws) in alices.iter_mut().enumerate() {
        echo(ws, &format!("alice still {i}")).await;
    }

    let mut first = alices.remove(0);
    first.close(None).await.unwrap();
    drop(first);
    let mut again = eventually(PATIENCE, "alice's slot back", || async {
        websocket(to, "/u/alice/ws", &alice).await.ok()
    })
    .await;
    echo(&mut again, "alice again").await;
}

/// Opens `GET …/instance/progress` and returns the response once its
/// head is in (the stream stays open while the response lives).
async fn progress(node: &Node, user: &str, token: &str) -> reqwest::Response {
    node.http
        .get(node.api(&format!("/users/{user}/instance/progress")))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
}

/// `GET …/instance/logs?follow=true`: a followed log, a long-lived stream
/// like progress.
async fn follow_logs(node: &Node, user: &str, token: &str) -> reqwest::Response {
    node.http
        .get(node.api(&format!("/users/{user}/instance/logs?follow=true")))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
}

/// Progress streams and followed logs count against the same per-user cap:
/// five open progress streams of a user whose instance is still starting
/// stop a sixth and a followed log (429) but not another user's; one
/// closed gives a slot back.
#[tokio::test(flavor = "multi_thread")]
async fn progress_streams_are_capped_per_user() {
    let dir = tempfile::tempdir().unwrap();
    // An instance that never becomes ready: its progress streams stay open.
    let instance = "command = [\"sleep\", \"600\"]\nready_tcp = true\nready_timeout_s = 600";
    let node = Node::start(
        dir.path(),
        &config(3, instance, "max_upgrades_per_user = 5"),
    );
    let (status, body) = node
        .post("/users/carol/instance?wait=false", serde_json::json!({}))
        .await;
    assert_eq!(status, 201, "{body}");
    let carol = node.user_token("carol").await;
    let mut streams = Vec::new();
    for _ in 0..5 {
        let r = progress(&node, "carol", &carol).await;
        assert_eq!(r.status(), 200);
        streams.push(r);
    }
    for (what, r) in [
        ("progress", progress(&node, "carol", &carol).await),
        ("a followed log", follow_logs(&node, "carol", &carol).await),
    ] {
        assert_eq!(r.status(), 429, "{what}");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["error"], "too_many_streams", "{what}");
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .contains("max_upgrades_per_user"),
            "{what}: {body}"
        );
    }
    let dave = node.user_token("dave").await;
    let r = progress(&node, "dave", &dave).await;
    assert_eq!(r.status(), 200, "carol's cap leaves dave his stream");
    assert!(r.text().await.unwrap().contains("\"status\":\"none\""));
    let r = follow_logs(&node, "dave", &dave).await;
    assert_eq!(r.status(), 200, "and his followed log");
    drop(r);

    drop(streams.pop());
    let followed = eventually(PATIENCE, "carol's slot back", || async {
        let r = follow_logs(&node, "carol", &carol).await;
        (r.status() == 200).then_some(r)
    })
    .await;
    // The followed log holds it: a progress stream is refused again.
    assert_eq!(progress(&node, "carol", &carol).await.status(), 429);
    drop(followed);
    eventually(PATIENCE, "carol's slot back again", || async {
        let r = progress(&node, "carol", &carol).await;
        (r.status() == 200).then_some(())
    })
    .await;
    assert_eq!(node.delete("/users/carol/instance").await, 204);
}

/// Connects from `from` (any 127.x address is this host) and sends a
/// keep-alive health check; `Some(stream)` (still open) if berth answered.
async fn healthy_connection(from: &str, to: SocketAddr) -> Option<TcpStream> {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    let mut stream = socket.connect(to).await.unwrap();
    if stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: berth.test\r\n\r\n")
        .await
        .is_err()
    {
        return None;
    }
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(PATIENCE, stream.read(&mut buf))
        .await
        .expect("berth answers or closes")
        .unwrap_or(0);
    String::from_utf8_lossy(&buf[..n])
        .starts_with("HTTP/1.1 200")
        .then_some(stream)
}

/// With at most 4 connections per address and 12 in all, a fifth from one
/// address is closed unanswered while other addresses are served, and a
/// thirteenth from a fresh address is closed too; a closed connection
/// gives its slot back.
#[tokio::test(flavor = "multi_thread")]
async fn connections_are_capped_per_address_and_in_all() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(
        dir.path(),
        &config(
            4,
            "",
            "max_connections = 12\nmax_connections_per_ip = 4\nheader_timeout_ms = 120000",
        ),
    );
    let to = addr(&node);
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(healthy_connection("127.0.0.1", to).await.expect("admitted"));
    }
    assert!(
        healthy_connection("127.0.0.1", to).await.is_none(),
        "a fifth connection from one address is closed"
    );
    for from in ["127.0.0.2", "127.0.0.3"] {
        for _ in 0..4 {
            held.push(
                healthy_connection(from, to)
                    .await
                    .expect("another address is served"),
            );
        }
    }
    assert!(
        healthy_connection("127.0.0.4", to).await.is_none(),
        "the thirteenth connection is over the total"
    );
    drop(held.remove(0));
    let back = eventually(PATIENCE, "a slot back for 127.0.0.1", || async {
        healthy_connection("127.0.0.1", to).await
    })
    .await;
    drop(back);
}
