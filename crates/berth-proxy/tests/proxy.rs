//! The proxy's layers together against a real upstream hyper server on
//! loopback, through the real server loop. The `Traffic` is a test double
//! (`StaticTraffic`); the real controller (over the local runtime) is
//! exercised end to end in crates/berth/tests/it/proxy.rs and proxy_e2e.rs
//! (README, "Test it", says which behaviour is tested where).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test: an unwrap is its assertion"
)]

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use berth_core::BreakerInfo;
use berth_core::unix_millis_now;
use berth_proxy::auth::{AuthMode, SharedSecret, TrustedProxies};
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http_body_util::BodyExt;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

fn bearer(token: &str) -> (&'static str, String) {
    ("Authorization", format!("Bearer {token}"))
}

async fn get_as(h: &Harness, path: &str, token: &str) -> RawResponse {
    let (k, v) = bearer(token);
    h.get(path, &[(k, &v)]).await
}

// --- route ------------------------------------------------------------------

#[tokio::test]
async fn paths_pass_unchanged_with_forwarded_headers_and_without_hop_by_hop() {
    let h = Harness::start(|_, _| {}).await;
    h.spawner.run("alice");
    let r = h
        .raw(&format!(
            "GET /u/alice/x/y?q=1 HTTP/1.1\r\nHost: berth.test:8000\r\nAuthorization: Bearer {ALICE}\r\n\
             Connection: close, X-Secret\r\nX-Secret: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\n\
             Proxy-Authorization: Basic eA==\r\nX-Forwarded-For: 203.0.113.9\r\nX-Custom: kept\r\n\r\n"
        ))
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    let seen = r.body.to_ascii_lowercase();
    assert!(seen.contains("path: /u/alice/x/y?q=1\n"), "{seen}");
    assert!(seen.contains("x-custom: kept\n"), "{seen}");
    assert!(
        seen.contains("x-forwarded-for: 203.0.113.9, 127.0.0.1\n"),
        "{seen}"
    );
    assert!(seen.contains("x-forwarded-proto: http\n"), "{seen}");
    assert!(
        seen.contains("x-forwarded-host: berth.test:8000\n"),
        "{seen}"
    );
    assert!(
        seen.contains("host: berth.test:8000\n"),
        "the client's Host is passed on: {seen}"
    );
    for gone in [
        "x-secret",
        "keep-alive",
        "\nte:",
        "proxy-authorization",
        "connection:",
    ] {
        assert!(!seen.contains(gone), "{gone} reached the instance: {seen}");
    }
    // …and none of the upstream's hop-by-hop headers reach the client.
    assert_eq!(r.header("x-app"), Some("yes"));
    for gone in ["x-up-secret", "keep-alive", "proxy-authenticate"] {
        assert_eq!(
            r.header(gone),
            None,
            "{gone} reached the client: {}",
            r.head
        );
    }
    assert!(
        h.spawner.touches("alice") >= 1,
        "a forwarded request is activity"
    );
}

#[tokio::test]
async fn strip_prefix_and_host_routing() {
    let h = Harness::start(|c, _| {
        c.strip_prefix = true;
        c.base_domain = Some("berth.test".into());
    })
    .await;
    h.spawner.run("alice");
    let r = get_as(&h, "/u/alice/lab/tree?x=1", ALICE).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.body.contains("path: /lab/tree?x=1\n"), "{}", r.body);
    let r = h
        .raw(&format!(
            "GET /lab HTTP/1.1\r\nHost: Alice.Berth.Test:8000\r\nAuthorization: Bearer {ALICE}\r\nConnection: close\r\n\r\n"
        ))
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.body.contains("path: /lab\n"), "{}", r.body);
    // The base domain itself is berth's own.
    let r = h
        .raw("GET /healthz HTTP/1.1\r\nHost: berth.test\r\nConnection: close\r\n\r\n")
        .await;
    assert_eq!((r.status, r.body.as_str()), (200, "fallback /healthz"));
}

#[tokio::test]
async fn the_user_base_path_gets_its_slash() {
    let h = Harness::start(|_, _| {}).await;
    let r = h.get("/u/alice?a=1", &[]).await;
    assert_eq!(r.status, 308);
    assert_eq!(r.header("location"), Some("/u/alice/?a=1"));
}

#[tokio::test]
async fn a_restarted_instance_is_reached_on_its_new_port() {
    let h = Harness::start(|_, _| {}).await;
    h.spawner.run("alice");
    let r = get_as(&h, "/u/alice/", ALICE).await;
    assert!(r.body.contains("upstream: a\n"), "{}", r.body);
    h.spawner.crash("alice");
    let b = upstream("b").await;
    h.spawner.run_at("alice", b.addr);
    eventually("alice reached on the new port", || async {
        let r = get_as(&h, "/u/alice/", ALICE).await;
        r.body.contains("upstream: b\n").then_some(())
    })
    .await;
}

/// The uid this test runs as: the owner of its own listeners.
fn my_uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").unwrap().uid()
}

/// Port theft: an instance's address is reached only through a socket of
/// the instance's own account. A listener of another account on that port
/// (a program that bound it first) is sent no request and no upgrade
/// handshake, and the client gets 502; the same listener is reached once
/// it is the instance account's.
#[tokio::test]
async fn a_socket_of_another_account_is_sent_nothing() {
    let h = Harness::start(|_, _| {}).await;
    let thief = upstream("thief").await;
    h.spawner
        .run_owned("alice", thief.addr, my_uid().wrapping_add(1));
    let r = get_as(&h, "/u/alice/", ALICE).await;
    assert_eq!(r.status, 502, "{}", r.body);
    let err = websocket(h.addr, "/u/alice/ws", ALICE).await.unwrap_err();
    assert!(err.contains("502"), "{err}");
    assert!(
        thief.connections.load(Ordering::SeqCst) > 0,
        "the proxy did connect: only what it sends is withheld"
    );
    assert_eq!(thief.requests.load(Ordering::SeqCst), 0);

    h.spawner.run_owned("alice", thief.addr, my_uid());
    eventually("alice's own listener reached", || async {
        let r = get_as(&h, "/u/alice/", ALICE).await;
        (r.status == 200 && r.body.contains("upstream: thief\n")).then_some(())
    })
    .await;
    let mut ws = websocket(h.addr, "/u/alice/ws", ALICE).await.unwrap();
    ws.send(Message::text("mine")).await.unwrap();
    assert_eq!(ws.next().await.unwrap().unwrap(), Message::text("mine"));
}

// --- auth -------------------------------------------------------------------

#[tokio::test]
async fn tokens_reach_their_own_user_and_the_admin_everyone() {
    let h = Harness::start(|_, _| {}).await;
    h.spawner.run("alice");
    h.spawner.run("bob");
    assert_eq!(get_as(&h, "/u/alice/", ALICE).await.status, 200);
    let r = get_as(&h, "/u/bob/", ALICE).await;
    assert_eq!(r.status, 403);
    assert!(r.body.contains(r#""error":"forbidden""#), "{}", r.body);
    assert_eq!(get_as(&h, "/u/alice/", ADMIN).await.status, 200);
    assert_eq!(get_as(&h, "/u/bob/", ADMIN).await.status, 200);
    // The cookie works; it never reaches the instance, the app's own do.
    let cookie = format!("app=1; berth_token={BOB}; other=2");
    let r = h.get("/u/bob/", &[("Cookie", &cookie)]).await;
    assert_eq!(r.status, 200);
    assert!(r.body.contains("cookie: app=1; other=2\n"), "{}", r.body);
    assert!(!r.body.contains(BOB), "{}", r.body);
    // An app's own Bearer token is not berth's: the cookie decides, and the
    // app gets its header.
    let r = h
        .get(
            "/u/bob/",
            &[("Cookie", &cookie), ("Authorization", "Bearer app-own")],
        )
        .await;
    assert_eq!(r.status, 200);
    assert!(
        r.body.contains("authorization: Bearer app-own\n"),
        "{}",
        r.body
    );
    assert_eq!(get_as(&h, "/u/alice/", "nonsense").await.status, 401);
}

#[tokio::test]
async fn no_token_is_401_json_or_an_html_page_for_browsers() {
    let h = Harness::start(|_, _| {}).await;
    let r = h.get("/u/alice/", &[]).await;
    assert_eq!(r.status, 401);
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("application/json")
    );
    assert!(
        r.body.starts_with(r#"{"error":"unauthorized""#),
        "{}",
        r.body
    );
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    let r = h
        .get(
            "/u/alice/",
            &[("Accept", "text/html,application/xhtml+xml")],
        )
        .await;
    assert_eq!(r.status, 401);
    assert!(r.header("content-type").unwrap().starts_with("text/html"));
    assert!(r.body.contains("Unauthorized"), "{}", r.body);
    assert_eq!(h.spawner.launches(), 0, "nothing starts for strangers");
}

#[tokio::test]
async fn a_query_token_becomes_a_cookie_and_a_redirect() {
    let h = Harness::start(|_, _| {}).await;
    h.spawner.run("alice");
    let r = h
        .get(&format!("/u/alice/lab?a=1&berth_token={ALICE}&b=2"), &[])
        .await;
    assert!(r.status == 302 || r.status == 303, "{r:?}");
    assert_eq!(r.header("location"), Some("/u/alice/lab?a=1&b=2"));
    let cookie = r.header("set-cookie").unwrap();
    assert!(
        cookie.starts_with(&format!("berth_token={ALICE};")),
        "{cookie}"
    );
    // Path mode: the cookie goes only to alice's own base path.
    for attr in ["HttpOnly", "SameSite=Lax", "Path=/u/alice/"] {
        assert!(cookie.contains(attr), "{cookie}");
    }
    assert!(!cookie.contains("Secure"), "plain HTTP: {cookie}");
    let jar = cookie.split(';').next().unwrap();
    let r = h.get("/u/alice/lab?a=1&b=2", &[("Cookie", jar)]).await;
    assert_eq!(r.status, 200);
    // A query token of someone else sets nothing.
    let r = h.get(&format!("/u/bob/?berth_token={ALICE}"), &[]).await;
    assert_eq!(r.status, 403);
    assert_eq!(r.header("set-cookie"), None);
    let r = h.get("/u/alice/?berth_token=wrong", &[]).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.header("set-cookie"), None);
}

/// The admin token is never turned into, nor accepted as, a cookie: the
/// pages of the app the admin opens could use it.
#[tokio::test]
async fn the_admin_token_never_becomes_a_cookie() {
    let h = Harness::start(|_, _| {}).await;
    h.spawner.run("alice");
    let r = h.get(&format!("/u/alice/?berth_token={ADMIN}"), &[]).await;
    assert_eq!(r.status, 403, "{r:?}");
    assert_eq!(r.header("set-cookie"), None);
    assert!(r.body.contains("berth token USER"), "{}", r.body);
    let cookie = format!("berth_token={ADMIN}");
    let r = h.get("/u/alice/", &[("Cookie", &cookie)]).await;
    assert_eq!(r.status, 401, "{r:?}");
    let cookie = format!("__Host-berth_token={ADMIN}");
    assert_eq!(h.get("/u/alice/", &[("Cookie", &cookie)]).await.status, 401);
    // As a Bearer header (an API client, never a browser on its own) the
    // admin still reaches everyone.
    assert_eq!(get_as(&h, "/u/alice/", ADMIN).await.status, 200);
}

/// Host mode: the cookie is host-only (no Domain), for `Path=/`, and over
/// https `__Host-` prefixed and Secure; the redirect stays on the host.
#[tokio::test]
async fn host_mode_cookies_are_host_only_and_redirects_stay_home() {
    let h = Harness::start(|c, _| {
        c.base_domain = Some("berth.test".into());
        c.path_routing = false;
        c.trusted_proxies = TrustedProxies::parse(&["127.0.0.1"]).unwrap();
    })
    .await;
    h.spawner.run("alice");
    let exchange = |path: &str, proto: &str| {
        format!(
            "GET {path}?berth_token={ALICE} HTTP/1.1\r\nHost: alice.berth.test\r\n\
             X-Forwarded-Proto: {proto}\r\nConnection: close\r\n\r\n"
        )
    };
    let r = h.raw(&exchange("/lab", "https")).await;
    assert_eq!(r.status, 303, "{r:?}");
    assert_eq!(r.header("location"), Some("/lab"));
    let cookie = r.header("set-cookie").unwrap();
    assert!(
        cookie.starts_with(&format!("__Host-berth_token={ALICE};")),
        "{cookie}"
    );
    for attr in ["HttpOnly", "SameSite=Lax", "Secure", "Path=/"] {
        assert!(cookie.contains(attr), "{cookie}");
    }
    assert!(!cookie.contains("Domain"), "{cookie}");
    let r = h.raw(&exchange("/", "http")).await;
    let cookie = r.header("set-cookie").unwrap();
    assert!(cookie.starts_with("berth_token="), "{cookie}");
    assert!(!cookie.contains("Secure"), "{cookie}");
    // `//evil.example/x` would be a network-path reference: it becomes a
    // path on alice's host.
    for (path, want) in [
        ("//evil.example/x", "/evil.example/x"),
        ("///evil.example", "/evil.example"),
    ] {
        let r = h.raw(&exchange(path, "http")).await;
        assert_eq!(r.status, 303, "{r:?}");
        assert_eq!(r.header("location"), Some(want), "{path}");
    }
    // The __Host- cookie is read back.
    let r = h
        .raw(&format!(
            "GET / HTTP/1.1\r\nHost: alice.berth.test\r\nCookie: __Host-berth_token={ALICE}\r\nConnection: close\r\n\r\n"
        ))
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    assert!(
        !r.body.contains(ALICE),
        "the cookie never reaches the app: {}",
        r.body
    );
    // Path routing is off: /u/alice/ on the berth host is not an app.
    let r = h
        .raw(&format!(
            "GET /u/alice/ HTTP/1.1\r\nHost: berth.test\r\nAuthorization: Bearer {ALICE}\r\nConnection: close\r\n\r\n"
        ))
        .await;
    assert_eq!((r.status, r.body.as_str()), (200, "fallback /u/alice/"));
    // An absolute-form target naming another host than Host is refused.
    let r = h
        .raw(&format!(
            "GET http://bob.berth.test/ HTTP/1.1\r\nHost: alice.berth.test\r\nAuthorization: Bearer {ALICE}\r\nConnection: close\r\n\r\n"
        ))
        .await;
    assert_eq!(r.status, 400, "{r:?}");
}

#[tokio::test]
async fn a_planted_user_cookie_cannot_shadow_the_users_own() {
    let h = Harness::start(|_, _| {}).await;
    h.spawner.run("alice");
    for cookie in [
        format!("berth_token=planted; berth_token={ALICE}"),
        format!("berth_token={BOB}; berth_token={ALICE}"),
        format!("berth_token={ALICE}; berth_token={ALICE}"),
    ] {
        let r = h.get("/u/alice/", &[("Cookie", &cookie)]).await;
        assert_eq!(r.status, 200, "{cookie}: {r:?}");
        assert!(!r.body.contains("berth_token"), "{}", r.body);
    }
    let r = h
        .get("/u/alice/", &[("Cookie", &format!("berth_token={BOB}"))])
        .await;
    assert_eq!(r.status, 403, "only another user's cookie: {r:?}");
    let r = h
        .get("/u/alice/", &[("Cookie", "berth_token=planted")])
        .await;
    assert_eq!(r.status, 401, "{r:?}");
}

#[tokio::test]
async fn a_program_cannot_set_berths_cookies() {
    let h = Harness::start(|_, _| {}).await;
    h.spawner.run("alice");
    let r = get_as(&h, "/u/alice/set-cookie", ALICE).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        r.headers("set-cookie"),
        ["app=kept; Path=/u/alice/"],
        "its own, kept to its base path"
    );
}

#[tokio::test]
async fn path_mode_answers_keep_to_their_base_path() {
    let h = Harness::start(|_, _| {}).await;
    h.spawner.run("alice");
    let r = get_as(&h, "/u/alice/hostile", ALICE).await;
    assert_eq!(r.status, 200, "{r:?}");
    for gone in [
        "service-worker-allowed",
        "clear-site-data",
        "refresh",
        "nel",
    ] {
        assert_eq!(r.header(gone), None, "{gone}: {r:?}");
    }
    assert_eq!(r.headers("set-cookie"), ["wide=1; Path=/u/alice/"]);
    assert_eq!(r.headers("link"), ["<own.css>; rel=preload; as=style"]);
    assert_eq!(r.header("x-app"), Some("yes"));
}

#[tokio::test]
async fn host_mode_answers_keep_their_cookies_off_the_site() {
    let h = Harness::start(|c, _| {
        c.base_domain = Some("berth.test".into());
        c.path_routing = false;
    })
    .await;
    h.spawner.run("alice");
    let r = h
        .raw(&format!(
            "GET /hostile HTTP/1.1\r\nHost: alice.berth.test\r\nAuthorization: Bearer {ALICE}\r\nConnection: close\r\n\r\n"
        ))
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.headers("set-cookie"), ["wide=1; Path=/"], "host-only");
    assert_eq!(r.header("clear-site-data"), Some("\"storage\""));
    assert_eq!(
        r.header("service-worker-allowed"),
        Some("/"),
        "its own origin"
    );
}

#[tokio::test]
async fn host_mode_refuses_state_changes_from_other_origins() {
    for allow in [false, true] {
        let h = Harness::start(|c, _| {
            c.base_domain = Some("berth.test".into());
            c.path_routing = false;
            c.allow_cross_origin_requests = allow;
        })
        .await;
        h.spawner.run("bob");
        let post = |extra: &str| {
            format!(
                "POST / HTTP/1.1\r\nHost: bob.berth.test\r\nCookie: berth_token={BOB}\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n"
            )
        };
        let r = h
            .raw(&post(
                "Origin: http://alice.berth.test\r\nSec-Fetch-Site: same-site\r\n",
            ))
            .await;
        if allow {
            assert_eq!(r.status, 200, "{r:?}");
            continue;
        }
        assert_eq!(r.status, 403, "{r:?}");
        assert!(r.body.contains("another origin"), "{}", r.body);
        assert_eq!(h.spawner.touches("bob"), 0, "nothing reached bob's app");
        let r = h
            .raw(&post(
                "Origin: http://bob.berth.test\r\nSec-Fetch-Site: same-origin\r\n",
            ))
            .await;
        assert_eq!(r.status, 200, "its own pages: {r:?}");
        let r = h.raw(&post("")).await;
        assert_eq!(r.status, 200, "not a browser: {r:?}");
        let r = h
            .raw(&format!(
                "GET /ws HTTP/1.1\r\nHost: bob.berth.test\r\nCookie: berth_token={BOB}\r\nOrigin: http://alice.berth.test\r\n\
                 Connection: Upgrade, close\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
            ))
            .await;
        assert_eq!(r.status, 403, "a WebSocket from another origin: {r:?}");
    }
}

#[tokio::test]
async fn header_mode_trusts_only_trusted_peers() {
    let trusted = Harness::start(|c, _| {
        c.auth_mode = AuthMode::Header;
        c.trusted_proxies = TrustedProxies::parse(&["127.0.0.0/8"]).unwrap();
    })
    .await;
    trusted.spawner.run("alice");
    let r = trusted
        .get("/u/alice/", &[("X-Forwarded-User", "alice")])
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.body.contains("x-forwarded-user: alice\n"), "{}", r.body);
    let r = trusted
        .get("/u/bob/", &[("X-Forwarded-User", "alice")])
        .await;
    assert_eq!(r.status, 403);
    // Two names: which would the app believe? Neither.
    let r = trusted
        .get(
            "/u/alice/",
            &[("X-Forwarded-User", "alice"), ("X-Forwarded-User", "bob")],
        )
        .await;
    assert_eq!(r.status, 400, "{r:?}");
    assert!(r.body.contains("two X-Forwarded-User"), "{}", r.body);
    // Tokens still work (API clients, the admin).
    assert_eq!(get_as(&trusted, "/u/alice/", ADMIN).await.status, 200);

    let untrusted = Harness::start(|c, _| {
        c.auth_mode = AuthMode::Header;
        c.trusted_proxies = TrustedProxies::parse(&["10.0.0.0/8"]).unwrap();
    })
    .await;
    untrusted.spawner.run("alice");
    let r = untrusted
        .get("/u/alice/", &[("X-Forwarded-User", "alice")])
        .await;
    assert_eq!(r.status, 401);
    // A token passes, but the spoofed header never reaches the instance.
    let (k, v) = bearer(ALICE);
    let r = untrusted
        .get("/u/alice/", &[(k, &v), ("X-Forwarded-User", "admin")])
        .await;
    assert_eq!(r.status, 200);
    assert!(!r.body.contains("x-forwarded-user"), "{}", r.body);
}

/// With a header secret, a process on a trusted address that does not
/// know it cannot name a user; the secret never reaches the program.
#[tokio::test]
async fn header_mode_with_a_secret_needs_the_secret() {
    let h = Harness::start(|c, _| {
        c.auth_mode = AuthMode::Header;
        c.trusted_proxies = TrustedProxies::parse(&["127.0.0.0/8"]).unwrap();
        c.header_secret = Some(SharedSecret::new("sso-s3cret").unwrap());
    })
    .await;
    h.spawner.run("alice");
    let r = h.get("/u/alice/", &[("X-Forwarded-User", "alice")]).await;
    assert_eq!(r.status, 401, "no secret: {r:?}");
    let r = h
        .get(
            "/u/alice/",
            &[
                ("X-Forwarded-User", "alice"),
                ("X-Berth-Proxy-Secret", "wrong"),
            ],
        )
        .await;
    assert_eq!(r.status, 401, "a wrong secret: {r:?}");
    let r = h
        .get(
            "/u/alice/",
            &[
                ("X-Forwarded-User", "alice"),
                ("X-Berth-Proxy-Secret", "sso-s3cret"),
            ],
        )
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.body.contains("x-forwarded-user: alice\n"), "{}", r.body);
    assert!(!r.body.contains("sso-s3cret"), "{}", r.body);
}

// --- wake -------------------------------------------------------------------

#[tokio::test]
async fn an_api_request_wakes_the_instance_in_one_round_trip() {
    let h = Harness::start(|_, _| {}).await;
    *h.spawner.state().start_delay.lock().unwrap() = Duration::from_millis(300);
    let r = get_as(&h, "/u/carol/hello", ADMIN).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.body.contains("path: /u/carol/hello\n"), "{}", r.body);
    assert_eq!(h.spawner.launches(), 1);
    assert_eq!(get_as(&h, "/u/carol/again", ADMIN).await.status, 200);
    assert_eq!(
        h.spawner.launches(),
        1,
        "a running instance is not launched again"
    );
}

/// The starting page reloads itself until the app answers. It does not
/// follow the API's progress stream: the API accepts no browser cookie, and
/// the user cookie is scoped to the app.
#[tokio::test]
async fn a_browser_gets_the_starting_page_that_reloads() {
    let h = Harness::start(|_, _| {}).await;
    *h.spawner.state().start_delay.lock().unwrap() = Duration::from_secs(3600);
    let cookie = format!("berth_token={ALICE}");
    let r = h
        .get("/u/alice/", &[("Cookie", &cookie), ("Accept", "text/html")])
        .await;
    assert_eq!(r.status, 202, "{r:?}");
    assert!(r.header("content-type").unwrap().starts_with("text/html"));
    assert!(
        !r.body.contains(r#"<meta name="berth-progress""#),
        "{}",
        r.body
    );
    assert!(r.body.contains("location.reload()"), "{}", r.body);
    assert_eq!(h.spawner.launches(), 1);
}

#[tokio::test]
async fn a_slow_start_is_503_instance_starting_with_retry_after() {
    let h = Harness::start(|c, _| c.ready_timeout = Duration::from_millis(100)).await;
    *h.spawner.state().start_delay.lock().unwrap() = Duration::from_secs(3600);
    let r = get_as(&h, "/u/alice/", ALICE).await;
    assert_eq!(r.status, 503, "{r:?}");
    assert!(
        r.body.contains(r#""error":"instance_starting""#),
        "{}",
        r.body
    );
    assert!(r.header("retry-after").is_some());
}

#[tokio::test]
async fn an_open_breaker_is_503_instance_circuit_open() {
    let h = Harness::start(|_, _| {}).await;
    *h.spawner.state().breaker.lock().unwrap() = Some(BreakerInfo {
        opens: 2,
        opened_at: unix_millis_now(),
        cooldown_until: unix_millis_now() + 60_000,
    });
    let r = get_as(&h, "/u/alice/", ALICE).await;
    assert_eq!(r.status, 503, "{r:?}");
    assert!(
        r.body.contains(r#""error":"instance_circuit_open""#),
        "{}",
        r.body
    );
    assert!(r.body.contains(r#""opens":2"#), "{}", r.body);
    let secs: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!(secs > 1 && secs <= 60, "{secs}");
}

// --- forward ----------------------------------------------------------------

#[tokio::test]
async fn chunked_responses_stream_through() {
    let h = Harness::start(|_, _| {}).await;
    h.spawner.run("alice");
    let r = get_as(&h, "/u/alice/chunked", ALICE).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    let mut send = client(h.addr).await;
    let response = send
        .send_request(request("GET", "/u/alice/chunked", ALICE, empty()))
        .await
        .unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, Bytes::from_static(b"one,two,three"));
}

#[tokio::test]
async fn sse_events_arrive_before_the_stream_ends() {
    let h = Harness::start(|_, _| {}).await;
    h.spawner.run("alice");
    let mut send = client(h.addr).await;
    let response = send
        .send_request(request("GET", "/u/alice/sse", ALICE, empty()))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    // The upstream holds the stream open until released: the first event
    // can only arrive here if nothing buffers it.
    let first = tokio::time::timeout(PATIENCE, body.frame())
        .await
        .expect("the first event arrives while the stream is open")
        .unwrap()
        .unwrap();
    assert_eq!(
        first.into_data().unwrap(),
        Bytes::from_static(b"data: first\n\n")
    );
    h.upstream.release.notify_one();
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(rest, Bytes::from_static(b"data: last\n\n"));
}

#[tokio::test]
async fn bodies_stream_both_ways_at_once() {
    let h = Harness::start(|_, _| {}).await;
    h.spawner.run("alice");
    let mut send = client(h.addr).await;
    let (mut tx, body) = channel_body();
    let response = tokio::spawn(send.send_request(request("POST", "/u/alice/echo", ALICE, body)));
    tx.send_data(Bytes::from_static(b"ping-1")).await.unwrap();
    let response = tokio::time::timeout(PATIENCE, response)
        .await
        .expect("the response starts before the upload ends")
        .unwrap()
        .unwrap();
    let mut body = response.into_body();
    // Each chunk comes back before the next is sent: neither direction
    // waits for the whole body.
    for i in 1..=5 {
        let echoed = tokio::time::timeout(PATIENCE, body.frame())
            .await
            .expect("the echo arrives while the upload is open")
            .unwrap()
            .unwrap();
        assert_eq!(
            echoed.into_data().unwrap(),
            Bytes::from(format!("ping-{i}"))
        );
        if i < 5 {
            tx.send_data(Bytes::from(format!("ping-{}", i + 1)))
                .await
                .unwrap();
        }
    }
    drop(tx);
    assert!(body.collect().await.unwrap().to_bytes().is_empty());
}

#[tokio::test]
async fn websockets_are_tunnelled_and_capped() {
    let h = Harness::start(|c, _| c.forward.max_upgrades = 1).await;
    h.spawner.run("alice");
    let touches_before = h.spawner.touches("alice");
    let mut ws = websocket(h.addr, "/u/alice/ws", ALICE).await.unwrap();
    for i in 0..200 {
        ws.send(Message::text(format!("m{i}"))).await.unwrap();
        let echo = ws.next().await.unwrap().unwrap();
        assert_eq!(echo, Message::text(format!("m{i}")));
    }
    assert!(
        h.spawner.touches("alice") >= touches_before + 2,
        "the upgrade and its frames are activity"
    );
    // The one upgrade slot is taken.
    assert_eq!(h.proxy.free_upgrades(), 0);
    let err = websocket(h.addr, "/u/alice/ws", ALICE).await.unwrap_err();
    assert!(err.contains("503"), "{err}");
    ws.close(None).await.unwrap();
    drop(ws);
    eventually("the upgrade slot is free again", || async {
        (h.proxy.free_upgrades() == 1).then_some(())
    })
    .await;
    let mut again = websocket(h.addr, "/u/alice/ws", ALICE).await.unwrap();
    again.send(Message::text("again")).await.unwrap();
    assert_eq!(again.next().await.unwrap().unwrap(), Message::text("again"));
}

/// Touches of alice while an open WebSocket through the proxy sends
/// `frames` (after its handshake, which is activity of its own).
async fn touches_for(h: &Harness, frames: Vec<Message>) -> usize {
    let free = h.proxy.free_upgrades();
    let mut ws = websocket(h.addr, "/u/alice/ws", ALICE).await.unwrap();
    let before = h.spawner.touches("alice");
    for frame in frames {
        ws.send(frame).await.unwrap();
    }
    // The answer to a ping sent last: by then the tunnel has read (and
    // counted) everything sent before it.
    ws.send(Message::Ping("sync".into())).await.unwrap();
    loop {
        match ws.next().await.unwrap().unwrap() {
            Message::Pong(sync) if sync.as_ref() == b"sync" => break,
            _ => {}
        }
    }
    let touches = h.spawner.touches("alice") - before;
    ws.close(None).await.unwrap();
    while let Some(Ok(_)) = ws.next().await {}
    drop(ws);
    eventually("the tunnel ended", || async {
        (h.proxy.free_upgrades() == free).then_some(())
    })
    .await;
    touches
}

#[tokio::test]
async fn a_websocket_clients_pongs_and_pings_are_not_activity_its_messages_are() {
    let h = Harness::start(|_, _| {}).await;
    h.spawner.run("alice");
    // What a browser sends on its own in a tab that only receives.
    let pongs = (0..20)
        .map(|i| Message::Pong(format!("{i}").into_bytes().into()))
        .collect();
    assert_eq!(touches_for(&h, pongs).await, 0, "pongs are not activity");
    assert_eq!(touches_for(&h, vec![]).await, 0, "nor is a ping");
    // Data frames are, text or binary (one touch a second at most).
    let text = vec![Message::text("typed")];
    assert!(touches_for(&h, text).await >= 1, "a message is activity");
    let binary = vec![
        Message::Pong(Vec::new().into()),
        Message::binary(vec![7u8; 70_000]),
    ];
    assert!(touches_for(&h, binary).await >= 1, "so is a binary one");
}

async fn websocket(
    addr: SocketAddr,
    path: &str,
    token: &str,
) -> Result<tokio_tungstenite::WebSocketStream<TcpStream>, String> {
    let mut req = format!("ws://{addr}{path}").into_client_request().unwrap();
    req.headers_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    let stream = TcpStream::connect(addr).await.unwrap();
    tokio_tungstenite::client_async(req, stream)
        .await
        .map(|(ws, _)| ws)
        .map_err(|e| e.to_string())
}

#[tokio::test]
async fn upstream_failures_are_clean_errors_for_that_client_only() {
    let h = Harness::start(|_, _| {}).await;
    h.spawner.run("alice");
    // A broken body after the headers: the client sees the stream end
    // early, not a made-up success.
    let mut send = client(h.addr).await;
    let response = send
        .send_request(request("GET", "/u/alice/abort", ALICE, empty()))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(first, Bytes::from_static(b"partial"));
    h.upstream.release.notify_one();
    assert!(
        body.collect().await.is_err(),
        "the stream ends in an error, not a clean end"
    );
    // Others are unaffected.
    let mut send = client(h.addr).await;
    let response = send
        .send_request(request("GET", "/u/alice/chunked", ALICE, empty()))
        .await
        .unwrap();
    assert_eq!(
        response.into_body().collect().await.unwrap().to_bytes(),
        Bytes::from_static(b"one,two,three")
    );
    // No instance listening at all: 502 before any header.
    let dead = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    h.spawner.run_at("bob", dead_addr);
    let r = get_as(&h, "/u/bob/", BOB).await;
    assert_eq!(r.status, 502, "{r:?}");
    assert!(r.body.contains(r#""error":"bad_gateway""#), "{}", r.body);
}

/// An upstream that answers the first request of each connection and
/// drops the connection on reading the second — what a server whose
/// keep-alive timeout fires just then does.
async fn flaky_upstream() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let dropped = Arc::new(AtomicUsize::new(0));
    let counter = dropped.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let mut seen = Vec::new();
                loop {
                    let Ok(n) = s.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    if let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&seen[..end]).to_ascii_lowercase();
                        let len: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse().ok())
                            .unwrap_or(0);
                        if seen.len() >= end + 4 + len {
                            break;
                        }
                    }
                }
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
                let mut one = [0u8; 1];
                if matches!(s.read(&mut one).await, Ok(1)) {
                    counter.fetch_add(1, Ordering::SeqCst);
                }
                // Dropped without an answer.
            });
        }
    });
    (addr, dropped)
}

#[tokio::test]
async fn a_stale_pooled_connection_is_retried_once_for_idempotent_requests() {
    let h = Harness::start(|_, _| {}).await;
    let (addr, dropped) = flaky_upstream().await;
    h.spawner.run_at("alice", addr);
    // Every GET succeeds, including those that met a dropped connection.
    for _ in 0..50 {
        let r = get_as(&h, "/u/alice/", ALICE).await;
        assert_eq!(r.status, 200, "{r:?}");
        if dropped.load(Ordering::SeqCst) >= 2 {
            break;
        }
    }
    assert!(
        dropped.load(Ordering::SeqCst) >= 2,
        "the test never hit a stale connection"
    );
    // A POST with a body is never sent twice: when it meets a dropped
    // connection, the client gets 502.
    let mut saw_502 = false;
    for _ in 0..50 {
        let before = dropped.load(Ordering::SeqCst);
        let r = h
            .raw(&format!(
                "POST /u/alice/ HTTP/1.1\r\nHost: b\r\nAuthorization: Bearer {ALICE}\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbody"
            ))
            .await;
        if dropped.load(Ordering::SeqCst) > before {
            assert_eq!(r.status, 502, "{r:?}");
            saw_502 = true;
            break;
        }
        assert_eq!(r.status, 200, "{r:?}");
    }
    assert!(saw_502, "no POST met a stale connection");
}

#[tokio::test]
async fn an_instance_that_listens_a_moment_late_is_still_reached() {
    let h = Harness::start(|_, _| {}).await;
    let probe = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let late = probe.local_addr().unwrap();
    drop(probe);
    h.spawner.run_at("alice", late);
    // Starts listening only once the proxy has been refused at least once.
    let (refused_tx, refused_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let _ = refused_rx.await;
        let listener = TcpListener::bind(late).await.unwrap();
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 4096];
        let _ = s.read(&mut buf).await;
        s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nlate")
            .await
            .unwrap();
    });
    let request = get_as(&h, "/u/alice/", ALICE);
    tokio::pin!(request);
    // Let the first connection attempt fail, then open the port. The sleep
    // is the scenario (an instance a moment late) and a check that nothing
    // is answered meanwhile; a refused connect leaves no trace to wait on.
    tokio::select! {
        r = &mut request => panic!("answered before the instance listened: {r:?}"),
        () = tokio::time::sleep(Duration::from_millis(30)) => {}
    }
    refused_tx.send(()).unwrap();
    let r = request.await;
    assert_eq!((r.status, r.body.as_str()), (200, "late"), "{r:?}");
    server.await.unwrap();
}

/// A refused connect consumed nothing, so even a POST with a body waits
/// for an instance that listens late, and its body arrives whole.
#[tokio::test]
async fn a_post_with_a_body_reaches_an_instance_that_listens_late() {
    let h = Harness::start(|_, _| {}).await;
    let probe = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let late = probe.local_addr().unwrap();
    drop(probe);
    h.spawner.run_at("alice", late);
    let server = tokio::spawn(async move {
        // The scenario: the instance listens 200 ms late.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let listener = TcpListener::bind(late).await.unwrap();
        let (mut s, _) = listener.accept().await.unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.ends_with(b"payload=42") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "the upstream saw the whole request");
            got.extend_from_slice(&buf[..n]);
        }
        let text = String::from_utf8_lossy(&got).into_owned();
        s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nposted")
            .await
            .unwrap();
        text
    });
    let (k, v) = bearer(ALICE);
    let started = std::time::Instant::now();
    let r = h
        .raw(&format!(
            "POST /u/alice/form HTTP/1.1\r\nHost: berth.test\r\nConnection: close\r\n{k}: {v}\r\ncontent-length: 10\r\n\r\npayload=42"
        ))
        .await;
    assert_eq!((r.status, r.body.as_str()), (200, "post"), "{r:?}");
    assert!(started.elapsed() >= Duration::from_millis(150));
    let seen = server.await.unwrap();
    assert!(
        seen.starts_with("POST /u/alice/form HTTP/1.1\r\n"),
        "{seen}"
    );
}

// --- server limits ----------------------------------------------------------

#[tokio::test]
async fn bad_requests_get_4xx() {
    let h = Harness::start(|_, _| {}).await;
    h.spawner.run("alice");
    let r = h
        .raw("GET /u/%zz/ HTTP/1.1\r\nHost: berth.test\r\nConnection: close\r\n\r\n")
        .await;
    assert_eq!(r.status, 400, "{r:?}");
    assert!(r.body.contains("invalid_user"), "{}", r.body);
    let r = h
        .raw("GET /u/alice/ HTTP/1.1\r\nHost: exa mple\r\nConnection: close\r\n\r\n")
        .await;
    assert_eq!(r.status, 400, "{r:?}");
    let r = h
        .raw("GET /u/alice/ HTTP/1.1\r\nHost: a@b:1\r\nConnection: close\r\n\r\n")
        .await;
    assert_eq!(r.status, 400, "{r:?}");
    let r = h.raw("GET /u/alice/ HTTP/1.0\r\n\r\n").await;
    assert_eq!(r.status, 400, "{r:?}");
    let r = h.raw("GET /healthz HTTP/1.0\r\n\r\n").await;
    assert_eq!(r.status, 400, "{r:?}");
    let r = h.raw("BREW /u/alice/ HTCPCP/1.0\r\n\r\n").await;
    assert!((400..500).contains(&r.status), "{r:?}");
    // berth still serves.
    assert_eq!(get_as(&h, "/u/alice/", ALICE).await.status, 200);
}

#[tokio::test]
async fn huge_headers_get_431() {
    let h = Harness::start(|_, _| {}).await;
    let big = "a".repeat(70 * 1024);
    let r = h
        .raw(&format!(
            "GET /u/alice/ HTTP/1.1\r\nHost: berth.test\r\nX-Big: {big}\r\nConnection: close\r\n\r\n"
        ))
        .await;
    assert_eq!(r.status, 431, "{r:?}");
    assert_eq!(h.get("/healthz", &[]).await.status, 200);
}

#[tokio::test]
async fn a_slowloris_client_is_cut_off_at_the_header_timeout() {
    let h = Harness::start(|_, s| s.header_read_timeout = Duration::from_millis(300)).await;
    let mut stream = TcpStream::connect(h.addr).await.unwrap();
    stream
        .write_all(b"GET /u/alice/ HTTP/1.1\r\nHost: berth.test\r\n")
        .await
        .unwrap();
    let (mut read, mut write) = stream.into_split();
    let dribble = tokio::spawn(async move {
        loop {
            if write.write_all(b"X").await.is_err() {
                return;
            }
            // The slowloris attack itself: one byte per 50 ms.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let mut buf = Vec::new();
    let cut = tokio::time::timeout(PATIENCE, read.read_to_end(&mut buf)).await;
    dribble.abort();
    assert!(cut.is_ok(), "the connection was never cut");
    assert!(
        !String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 2"),
        "no success for a half request"
    );
    assert_eq!(h.get("/healthz", &[]).await.status, 200);
}

#[tokio::test]
async fn shutdown_drains_and_ends() {
    let mut h = Harness::start(|_, s| s.shutdown_grace = Duration::from_millis(200)).await;
    h.spawner.run("alice");
    // A stream that would never end on its own.
    let mut send = client(h.addr).await;
    let response = send
        .send_request(request("GET", "/u/alice/sse", ALICE, empty()))
        .await
        .unwrap();
    let mut ws = websocket(h.addr, "/u/alice/ws", ALICE).await.unwrap();
    h.shutdown().await.unwrap();
    assert!(
        response.into_body().collect().await.is_err(),
        "the stream was cut"
    );
    let closed = tokio::time::timeout(PATIENCE, ws.next()).await.unwrap();
    assert!(!matches!(closed, Some(Ok(Message::Text(_)))), "{closed:?}");
    assert!(
        TcpStream::connect(h.addr).await.is_err(),
        "the listener is closed"
    );
}
