//! Attacks a hostile client tries on the front door, kept as regressions,
//! against the real `berth` binary over raw sockets (a client library would
//! tidy the bytes that make the attack): request smuggling, oversized
//! heads, path and Host tricks that aim one user's credential at another
//! user's app, and redirects after a token link that try to leave the host.
//!
//! Every user's program is `tests/programs/upstream.py`, which counts the
//! requests it gets on `…/poke` by method: the oracle for "this request
//! reached an instance".

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value, json};
use support::Node;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Bound for anything that should happen "soon"; only a hang reaches it.
const PATIENCE: Duration = Duration::from_secs(60);

const BASE: &str = "berth.test";

/// A config on ports of its own running `upstream.py`, plus whole tables
/// in `extra`.
fn config(n: u16, extra: &str) -> String {
    support::upstream_config(
        berth_testkit::port_block_for(&format!("{} {n}", module_path!()), 20),
        "",
        extra,
    )
}

fn host_mode(n: u16) -> String {
    config(n, &format!("[proxy]\nbase_domain = \"{BASE}\"\n"))
}

fn addr(node: &Node) -> SocketAddr {
    node.url.trim_start_matches("http://").parse().unwrap()
}

/// Sends `bytes` as they are and reads until berth closes the connection
/// (a reset counts as closed: berth may close on bytes it will not read).
/// A connection berth keeps open fails the test at `PATIENCE`.
async fn exchange(node: &Node, bytes: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr(node)).await.unwrap();
    // berth may answer and close before it has read everything.
    let _ = stream.write_all(bytes).await;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 8192];
    let closed = tokio::time::timeout(PATIENCE, async {
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    assert!(closed.is_ok(), "berth kept the connection open: {answer}");
    answer
}

/// The status codes of every response in `answer`, in order.
fn statuses(answer: &str) -> Vec<u16> {
    answer
        .match_indices("HTTP/1.1 ")
        .filter_map(|(i, _)| answer.get(i + 9..i + 12)?.parse().ok())
        .collect()
}

/// Launches `user` and waits for their program to be ready.
async fn launch(node: &Node, user: &str) {
    let (status, body) = node
        .post(&format!("/users/{user}/instance"), json!({}))
        .await;
    assert!(status == 200 || status == 201, "{body}");
    node.running_main(user, None).await;
}

/// What `user`'s program counted on `…/poke`, by method, asked over a
/// request of its own (`host` is the Host header; in path mode the path
/// names the user).
async fn pokes(node: &Node, user: &str, token: &str, host_routed: bool) -> Value {
    let (target, host) = if host_routed {
        ("/pokes".to_owned(), format!("{user}.{BASE}"))
    } else {
        (format!("/u/{user}/pokes"), BASE.to_owned())
    };
    let answer = exchange(
        node,
        format!(
            "GET {target} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(statuses(&answer), [200], "{answer}");
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {answer}"))
}

// --- smuggling ----------------------------------------------------------------

/// Each request below frames its body two ways at once (or in a way
/// parsers read differently), so that under one reading the body ends
/// early and the rest, a `PUT …/poke`, is a second request. berth refuses
/// the request (400) or answers it once and closes the connection; the
/// smuggled `PUT` never reaches the instance. A plainly pipelined `PUT`
/// does, once, which shows the count would see one.
#[tokio::test(flavor = "multi_thread")]
async fn smuggled_requests_never_reach_an_instance() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(0, ""));
    launch(&node, "alice").await;
    let token = node.user_token("alice").await;

    let head =
        format!("POST /u/alice/poke HTTP/1.1\r\nHost: {BASE}\r\nAuthorization: Bearer {token}\r\n");
    let smuggled = format!(
        "PUT /u/alice/poke HTTP/1.1\r\nHost: {BASE}\r\nAuthorization: Bearer {token}\r\nContent-Length: 0\r\n\r\n"
    );
    // Chunked, an empty body followed by the smuggled request.
    let ends_early = format!("0\r\n\r\n{smuggled}");
    let early = ends_early.len();
    // Chunked, the smuggled request inside one chunk; by the length of the
    // chunk-size line alone, the smuggled request follows the body.
    let size_line = format!("{:x}\r\n", smuggled.len());
    let in_chunk = format!("{size_line}{smuggled}\r\n0\r\n\r\n");
    let size = size_line.len();

    let cases: Vec<(&str, String, &str)> = vec![
        (
            "Content-Length then Transfer-Encoding",
            format!("Content-Length: {early}\r\nTransfer-Encoding: chunked\r\n"),
            &ends_early,
        ),
        (
            "Transfer-Encoding then Content-Length",
            format!("Transfer-Encoding: chunked\r\nContent-Length: {size}\r\n"),
            &in_chunk,
        ),
        (
            "two Content-Lengths that differ",
            format!(
                "Content-Length: 0\r\nContent-Length: {}\r\n",
                smuggled.len()
            ),
            &smuggled,
        ),
        (
            "one Content-Length listing two values",
            format!("Content-Length: 0, {}\r\n", smuggled.len()),
            &smuggled,
        ),
        (
            "Transfer-Encoding: chunked, identity",
            format!("Content-Length: {early}\r\nTransfer-Encoding: chunked, identity\r\n"),
            &ends_early,
        ),
        (
            "Transfer-Encoding with a leading space",
            format!("Content-Length: {early}\r\nTransfer-Encoding:  chunked\r\n"),
            &ends_early,
        ),
        (
            "Transfer-Encoding with a tab",
            format!("Content-Length: {early}\r\nTransfer-Encoding:\tchunked\r\n"),
            &ends_early,
        ),
        (
            "Transfer-Encoding: xchunked",
            format!("Content-Length: {early}\r\nTransfer-Encoding: xchunked\r\n"),
            &ends_early,
        ),
        (
            "space before the colon",
            format!("Content-Length: {early}\r\nTransfer-Encoding : chunked\r\n"),
            &ends_early,
        ),
        (
            "two Transfer-Encoding lines, the last not chunked",
            format!(
                "Content-Length: {early}\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n"
            ),
            &ends_early,
        ),
        (
            "Transfer-Encoding folded onto a continuation line (obs-fold)",
            format!("Content-Length: {early}\r\nX-Pad: a\r\n Transfer-Encoding: chunked\r\n"),
            &ends_early,
        ),
        (
            "Transfer-Encoding value on an obs-fold line",
            format!("Content-Length: {early}\r\nTransfer-Encoding:\r\n chunked\r\n"),
            &ends_early,
        ),
        (
            "Transfer-Encoding behind a bare LF",
            format!("Content-Length: {early}\r\nX-Pad: a\nTransfer-Encoding: chunked\r\n"),
            &ends_early,
        ),
        (
            "Content-Length behind a bare LF",
            "X-Pad: a\nContent-Length: 0\r\nTransfer-Encoding: chunked\r\n".to_owned(),
            &in_chunk,
        ),
    ];
    let mut answered = 0;
    for (what, framing, body) in &cases {
        let request = format!("{head}{framing}\r\n{body}");
        let answer = exchange(&node, request.as_bytes()).await;
        let got = statuses(&answer);
        let counted = pokes(&node, "alice", &token, false).await;
        assert_eq!(
            counted["PUT"],
            Value::Null,
            "{what}: smuggled through ({got:?}): {counted}"
        );
        // Refused, closed unanswered, or answered once (then closed: the
        // exchange returned).
        assert!(
            got.is_empty() || got == [400] || got == [200],
            "{what}: {got:?}\n{answer}"
        );
        if got == [200] {
            answered += 1;
        }
    }
    let counted = pokes(&node, "alice", &token, false).await;
    assert_eq!(
        counted["POST"].as_u64().unwrap_or(0),
        answered,
        "each answered request reached the instance once: {counted}"
    );

    // The oracle sees a second request when there is one: the same PUT,
    // pipelined after a plainly framed POST.
    let last = smuggled.replace("\r\n\r\n", "\r\nConnection: close\r\n\r\n");
    let request = format!("{head}Content-Length: 0\r\n\r\n{last}");
    let answer = exchange(&node, request.as_bytes()).await;
    assert_eq!(statuses(&answer), [200, 200], "{answer}");
    let counted = pokes(&node, "alice", &token, false).await;
    assert_eq!(counted["PUT"], 1, "{counted}");
}

// --- header limits ------------------------------------------------------------

/// A head over the limit (64 KiB by default) gets 431, whether it is one
/// long header or many short ones, and nothing of it reaches the instance.
#[tokio::test(flavor = "multi_thread")]
async fn oversized_heads_get_431_and_reach_no_instance() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(1, ""));
    launch(&node, "alice").await;
    let token = node.user_token("alice").await;
    let head =
        format!("POST /u/alice/poke HTTP/1.1\r\nHost: {BASE}\r\nAuthorization: Bearer {token}\r\n");
    let one_long = format!("X-Big: {}\r\n", "x".repeat(70 * 1024));
    let many_short: String = (0..2_000)
        .map(|i| format!("X-H{i}: {}\r\n", "y".repeat(32)))
        .collect();
    for (what, headers) in [
        ("one long header", one_long),
        ("2,000 short headers", many_short),
    ] {
        let answer = exchange(
            &node,
            format!("{head}{headers}Content-Length: 0\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert_eq!(statuses(&answer), [431], "{what}: {answer}");
    }
    // Many headers under the byte limit are fine.
    let answer = exchange(
        &node,
        format!("{head}X-A: 1\r\nX-B: 2\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await;
    assert_eq!(statuses(&answer), [200], "{answer}");
    assert_eq!(
        pokes(&node, "alice", &token, false).await,
        json!({"POST": 1}),
        "only the request within the limit"
    );
}

// --- path and Host tricks -------------------------------------------------------

/// Path mode: alice's credential, aimed at bob's app through dot segments,
/// encoded dots and slashes, case or empty segments, reaches alice's app
/// or gets a 4xx, and never bob's; no third user is launched.
#[tokio::test(flavor = "multi_thread")]
async fn path_tricks_reach_only_the_user_the_credential_names() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(2, ""));
    launch(&node, "alice").await;
    launch(&node, "bob").await;
    let alice = node.user_token("alice").await;
    let bob = node.user_token("bob").await;
    let targets = [
        "/u/bob/poke",
        "/u/alice/../bob/poke",
        "/u/alice/%2e%2e/bob/poke",
        "/u/alice/%2E%2E/bob/poke",
        "/u/alice/.%2e/bob/poke",
        "/u/alice/..%2fbob/poke",
        "/u/alice%2f..%2fbob/poke",
        "/u/alice%2F..%2Fbob/poke",
        "/u/alice/..;/bob/poke",
        "/u/alice/..\\bob/poke",
        "/u/./bob/poke",
        "/u//bob/poke",
        "/u/%62ob/poke",
        "/U/bob/poke",
        "/U/alice/poke",
        "/u/ALICE/poke",
        "/x/../u/bob/poke",
        "/u/bob/../alice/poke",
        "http://berth.test/u/bob/poke",
    ];
    let mut reached_alice = 0;
    for target in targets {
        let answer = exchange(
            &node,
            format!(
                "POST {target} HTTP/1.1\r\nHost: {BASE}\r\nAuthorization: Bearer {alice}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
        let got = statuses(&answer);
        assert!(
            got == [200] || got.first().is_some_and(|s| (400..500).contains(s)),
            "{target}: {answer}"
        );
        if got == [200] {
            reached_alice += 1;
        }
        assert_eq!(
            pokes(&node, "bob", &bob, false).await,
            json!({}),
            "{target} reached bob's app"
        );
    }
    let counted = pokes(&node, "alice", &alice, false).await;
    assert_eq!(
        counted["POST"].as_u64().unwrap_or(0),
        reached_alice,
        "{counted}"
    );
    let (status, listed) = node.get("/instances").await;
    assert_eq!(status, 200, "{listed}");
    let users: Vec<&str> = listed["instances"]
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|i| i["user"].as_str())
        .collect();
    assert!(
        users.iter().all(|u| *u == "alice" || *u == "bob"),
        "only alice and bob run: {users:?}"
    );
}

/// Host mode: alice's credential with a Host that names bob's app in
/// another spelling (a trailing dot, capitals, a port), two Host headers,
/// or an absolute-form target, reaches alice's app or gets a 4xx, and
/// never bob's.
#[tokio::test(flavor = "multi_thread")]
async fn host_tricks_reach_only_the_user_the_credential_names() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &host_mode(3));
    launch(&node, "alice").await;
    launch(&node, "bob").await;
    let alice = node.user_token("alice").await;
    let bob = node.user_token("bob").await;
    let port = addr(&node).port();
    let heads = [
        ("/poke".to_owned(), format!("Host: bob.{BASE}\r\n")),
        ("/poke".to_owned(), format!("Host: bob.{BASE}.\r\n")),
        ("/poke".to_owned(), format!("Host: bob.{BASE}.:{port}\r\n")),
        (
            "/poke".to_owned(),
            format!("Host: BOB.{}\r\n", BASE.to_uppercase()),
        ),
        ("/poke".to_owned(), format!("Host: bob.{BASE}:1\r\n")),
        (
            "/poke".to_owned(),
            format!("Host: alice.{BASE}\r\nHost: bob.{BASE}\r\n"),
        ),
        (
            "/poke".to_owned(),
            format!("Host: bob.{BASE}\r\nHost: alice.{BASE}\r\n"),
        ),
        (
            "/poke".to_owned(),
            format!("Host: alice.{BASE}@bob.{BASE}\r\n"),
        ),
        ("/poke".to_owned(), format!("Host: bob.alice.{BASE}\r\n")),
        ("/poke".to_owned(), format!("Host: alice.bob.{BASE}\r\n")),
        ("/poke".to_owned(), format!("Host: {BASE}\r\n")),
        ("/u/bob/poke".to_owned(), format!("Host: {BASE}\r\n")),
        ("/u/bob/poke".to_owned(), format!("Host: alice.{BASE}\r\n")),
        (
            format!("http://bob.{BASE}/poke"),
            format!("Host: bob.{BASE}\r\n"),
        ),
        (
            format!("http://bob.{BASE}/poke"),
            format!("Host: alice.{BASE}\r\n"),
        ),
        (
            format!("http://alice.{BASE}/poke"),
            format!("Host: bob.{BASE}\r\n"),
        ),
    ];
    let mut reached_alice = 0;
    for (target, host) in &heads {
        let answer = exchange(
            &node,
            format!(
                "POST {target} HTTP/1.1\r\n{host}Authorization: Bearer {alice}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
        let got = statuses(&answer);
        assert!(
            got == [200] || got.first().is_some_and(|s| (400..500).contains(s)),
            "{target} {host:?}: {answer}"
        );
        if got == [200] {
            reached_alice += 1;
        }
        assert_eq!(
            pokes(&node, "bob", &bob, true).await,
            json!({}),
            "{target} {host:?} reached bob's app"
        );
    }
    let counted = pokes(&node, "alice", &alice, true).await;
    assert_eq!(
        counted["POST"].as_u64().unwrap_or(0),
        reached_alice,
        "{counted}"
    );
}

// --- redirects ------------------------------------------------------------------

/// The redirect after a `?berth_token=` link keeps the browser on the
/// host it asked: a path that a browser would read as another host
/// (`//evil`, `/\evil`, `\/evil`, their encoded forms) is answered with a
/// path on the same host, or refused.
#[tokio::test(flavor = "multi_thread")]
async fn token_link_redirects_stay_on_the_host() {
    for host_routed in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let node = if host_routed {
            Node::start(dir.path(), &host_mode(4))
        } else {
            Node::start(dir.path(), &config(5, ""))
        };
        let alice = node.user_token("alice").await;
        let (host, prefix) = if host_routed {
            (format!("alice.{BASE}"), "")
        } else {
            (BASE.to_owned(), "/u/alice")
        };
        for path in [
            "//evil.example/x",
            "/\\evil.example/x",
            "/\\/evil.example/x",
            "/%5Cevil.example/x",
            "/%5C%5Cevil.example/x",
            "/%2F%2Fevil.example/x",
            "/%2F/evil.example/x",
            "/\t/evil.example/x",
        ] {
            let target = format!("{prefix}{path}?berth_token={alice}&q=1");
            let answer = exchange(
                &node,
                format!("GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await;
            let got = statuses(&answer);
            if got.first().is_some_and(|s| (400..500).contains(s)) {
                continue;
            }
            assert_eq!(got, [303], "{target}: {answer}");
            let location = answer
                .lines()
                .find_map(|l| {
                    l.split_once(':')
                        .filter(|(n, _)| n.eq_ignore_ascii_case("location"))
                        .map(|(_, v)| v.trim().to_owned())
                })
                .unwrap_or_else(|| panic!("no Location: {answer}"));
            // A browser reads `/x` as a path on this host; anything that
            // starts with two slashes (either way round, or after
            // whitespace it strips) names a host.
            let chars: Vec<char> = location
                .chars()
                .filter(|c| !c.is_ascii_whitespace())
                .take(2)
                .collect();
            assert!(
                chars.first() == Some(&'/') && !matches!(chars.get(1), Some('/') | Some('\\')),
                "{target} → {location}"
            );
            assert!(
                location.starts_with(&format!("{prefix}/")),
                "{target} → {location}"
            );
            assert!(
                !location.contains(&alice),
                "the token stays out of the Location"
            );
        }
    }
}
