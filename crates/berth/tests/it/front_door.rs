//! Front-door security, replayed as an attacker would against
//! the real `berth` binary: a user's app trying to ride on an admin's
//! browser, a page on another origin posting forms, an app planting
//! berth's cookies, tokens that should no longer work, and request targets
//! that try to leave their host.
//!
//! Host mode uses the names `*.berth.test`, which the test client resolves
//! to berth's loopback address, so every request carries the Host header a
//! browser would send.

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value, json};
use support::{Node, eventually, raw_request};

const PATIENCE: Duration = Duration::from_secs(60);
const BASE: &str = "berth.test";

/// A config with its own port range (tests run in parallel) plus extra
/// TOML (whole tables).
fn config(n: u16, extra: &str) -> String {
    let start = berth_testkit::port_block_for(&format!("{} {n}", module_path!()), 20);
    format!(
        "[instance]\nport_range = [{start}, {}]\n{extra}\n",
        start + 19
    )
}

fn host_mode(n: u16, extra: &str) -> String {
    config(n, &format!("[proxy]\nbase_domain = \"{BASE}\"\n{extra}"))
}

fn addr(node: &Node) -> SocketAddr {
    node.url.trim_start_matches("http://").parse().unwrap()
}

fn port(node: &Node) -> u16 {
    addr(node).port()
}

/// A client that resolves `berth.test` and `<user>.berth.test` to the node,
/// and does not follow redirects (a test looks at each).
fn browser(node: &Node) -> reqwest::Client {
    let mut builder = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none());
    for host in [
        "berth.test",
        "alice.berth.test",
        "bob.berth.test",
        "carol.berth.test",
    ] {
        builder = builder.resolve(host, addr(node));
    }
    builder.build().unwrap()
}

/// `http://<host>:<port>` of the node under `host`.
fn origin(node: &Node, host: &str) -> String {
    format!("http://{host}:{}", port(node))
}

async fn json_of(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Mints a token for `user` as `as_token` (admin or a user token).
async fn mint_as(node: &Node, user: &str, as_token: &str, body: Value) -> (u16, Value) {
    json_of(
        node.http
            .post(node.api(&format!("/users/{user}/tokens")))
            .bearer_auth(as_token)
            .json(&body)
            .send()
            .await
            .unwrap(),
    )
    .await
}

async fn token_ids(node: &Node, user: &str) -> Vec<String> {
    let (status, body) = node.get(&format!("/users/{user}/tokens")).await;
    assert_eq!(status, 200, "{body}");
    body["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_str().unwrap().to_owned())
        .collect()
}

/// Status of `GET /api/v1/users/<user>/instance` with `token`.
async fn api_status_as(node: &Node, user: &str, token: &str) -> u16 {
    node.http
        .get(node.api(&format!("/users/{user}/instance")))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// Status of a proxied `GET /u/<user>/headers` with `token`.
async fn app_status_as(node: &Node, user: &str, token: &str) -> u16 {
    node.http
        .get(format!("{}/u/{user}/headers", node.url))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

// --- origins and the admin's credentials -------------------------------------

/// Path mode: every app shares the API's origin. The admin opens alice's
/// app with the admin token; alice's script then tries to mint a token for
/// bob with whatever the browser holds. Nothing works: the admin token
/// never becomes a cookie, the API takes no cookie of the proxy's, and no
/// admin session can exist while apps share the origin.
#[tokio::test(flavor = "multi_thread")]
async fn the_admin_cookie_attack_fails_in_path_mode() {
    let dir = tempfile::tempdir().unwrap();
    // A real admin session, minted while this berth ran with a base
    // domain: refused below, it is refused for path routing, not for
    // being no session at all.
    let (session, csrf) = {
        let host = Node::start(dir.path(), &host_mode(0, ""));
        let browser = browser(&host);
        let berth = origin(&host, BASE);
        let r = browser
            .post(format!("{berth}/api/v1/session"))
            .bearer_auth(&host.token)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        let set_cookie = r.headers()["set-cookie"].to_str().unwrap().to_owned();
        let session = set_cookie.split(';').next().unwrap().to_owned();
        let csrf = r.json::<Value>().await.unwrap()["csrf_token"]
            .as_str()
            .unwrap()
            .to_owned();
        let r = browser
            .get(format!("{berth}/api/v1/session"))
            .header("Cookie", &session)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "the session is live");
        assert_eq!(
            r.json::<Value>().await.unwrap()["csrf_token"],
            csrf.as_str()
        );
        (session, csrf)
    };
    let node = Node::start(dir.path(), &config(0, ""));
    let browser = browser(&node);

    // The admin clicks a link carrying the admin token.
    let r = browser
        .get(format!("{}/u/alice/?berth_token={}", node.url, node.token))
        .header("Sec-Fetch-Mode", "navigate")
        .header("Accept", "text/html")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert!(r.headers().get("set-cookie").is_none(), "no admin cookie");
    assert!(r.text().await.unwrap().contains("berth token USER"));

    // Alice's script, with a same-origin Origin, and every cookie it could
    // hope for: the admin token as the old Path=/ cookie, alice's own.
    let alice = node.user_token("alice").await;
    for cookie in [
        format!("berth_token={}", node.token),
        format!("berth_token={alice}"),
        format!("__Host-berth_token={}", node.token),
    ] {
        let r = browser
            .post(node.api("/users/bob/tokens"))
            .header("Cookie", &cookie)
            .header("Origin", &node.url)
            .header("Content-Type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
        let (status, body) = json_of(r).await;
        assert_eq!(status, 401, "{cookie}: {body}");
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .contains("berth_token cookie"),
            "{body}"
        );
    }
    // No admin session can be had while apps share the API's origin.
    let r = browser
        .post(node.api("/session"))
        .bearer_auth(&node.token)
        .send()
        .await
        .unwrap();
    let (status, body) = json_of(r).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("path routing"),
        "{body}"
    );
    let r = browser
        .post(node.api("/users/bob/tokens"))
        .header("Cookie", &session)
        .header("Origin", &node.url)
        .header("X-Berth-CSRF", &csrf)
        .header("Content-Type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);

    assert!(token_ids(&node, "bob").await.is_empty(), "no token for bob");
}

/// Host mode: the admin has a real session on the berth host. Alice's app,
/// on a sibling subdomain (same site, so the browser sends the session
/// cookie along), cannot use it: not without the CSRF token, not with a
/// stolen one from its own Origin. The admin page itself can.
#[tokio::test(flavor = "multi_thread")]
async fn the_admin_cookie_attack_fails_in_host_mode() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &host_mode(1, ""));
    let browser = browser(&node);
    let berth = origin(&node, BASE);
    let alice_app = origin(&node, "alice.berth.test");

    // The admin signs in on the berth host.
    let r = browser
        .post(format!("{berth}/api/v1/session"))
        .bearer_auth(&node.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let set_cookie = r.headers()["set-cookie"].to_str().unwrap().to_owned();
    for attr in ["berth_session=", "HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(set_cookie.contains(attr), "{set_cookie}");
    }
    assert!(!set_cookie.contains("Domain"), "host-only: {set_cookie}");
    let csrf = r.json::<Value>().await.unwrap()["csrf_token"]
        .as_str()
        .unwrap()
        .to_owned();
    let session = set_cookie.split(';').next().unwrap().to_owned();

    // The admin token never becomes a cookie on alice's host either.
    let r = browser
        .get(format!("{alice_app}/?berth_token={}", node.token))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert!(r.headers().get("set-cookie").is_none());

    // Alice's script posts to the API with the session cookie.
    let attack = |origin: String, csrf: Option<String>| {
        let mut request = browser
            .post(format!("{berth}/api/v1/users/bob/tokens"))
            .header("Cookie", &session)
            .header("Origin", origin)
            .header("Content-Type", "application/json")
            .body("{}");
        if let Some(csrf) = csrf {
            request = request.header("X-Berth-CSRF", csrf);
        }
        request.send()
    };
    for (from, token) in [
        (alice_app.clone(), None),
        (alice_app.clone(), Some("0".repeat(64))),
        (alice_app.clone(), Some(csrf.clone())),
        (berth.clone(), None),
        (berth.clone(), Some("0".repeat(64))),
        ("null".to_owned(), Some(csrf.clone())),
    ] {
        let (status, body) = json_of(attack(from.clone(), token.clone()).await.unwrap()).await;
        assert_eq!(status, 403, "{from} {token:?}: {body}");
    }
    assert!(token_ids(&node, "bob").await.is_empty(), "no token for bob");

    // The admin page (berth's own origin, with the CSRF token) can, so the
    // refusals above were the checks, not a broken session.
    let (status, body) = json_of(attack(berth.clone(), Some(csrf.clone())).await.unwrap()).await;
    assert_eq!(status, 201, "{body}");
    // A GET needs no CSRF token, but a foreign Origin still does not pass.
    let r = browser
        .get(format!("{berth}/api/v1/session"))
        .header("Cookie", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.json::<Value>().await.unwrap()["csrf_token"],
        csrf.as_str()
    );
    let r = browser
        .get(format!("{berth}/api/v1/instances"))
        .header("Cookie", &session)
        .header("Origin", &alice_app)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    // A second session cookie (planted by an app's script) is tried too,
    // and the admin's own still counts.
    let r = browser
        .get(format!("{berth}/api/v1/instances"))
        .header("Cookie", format!("berth_session=planted; {session}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Signing out ends the session on the spot.
    let r = browser
        .delete(format!("{berth}/api/v1/session"))
        .header("Cookie", &session)
        .header("Origin", &berth)
        .header("X-Berth-CSRF", &csrf)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let (status, _) = json_of(attack(berth.clone(), Some(csrf)).await.unwrap()).await;
    assert_eq!(status, 401, "the session is over");
}

/// With a base domain, apps live only on their own hosts: `/u/bob/` on the
/// berth host is berth's own path (404), bob's app answers on
/// `bob.berth.test`, and the link berth mints for bob points there.
#[tokio::test(flavor = "multi_thread")]
async fn with_a_base_domain_apps_live_only_on_their_own_hosts() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &host_mode(2, ""));
    let browser = browser(&node);
    let (status, minted) = mint_as(&node, "bob", &node.token, json!({})).await;
    assert_eq!(status, 201, "{minted}");
    let bob = minted["token"].as_str().unwrap().to_owned();
    let link = minted["url"].as_str().unwrap();
    assert_eq!(
        link,
        format!("http://bob.berth.test:{}/?berth_token={bob}", port(&node))
    );

    for host in [BASE.to_owned(), format!("127.0.0.1:{}", port(&node))] {
        let r = browser
            .get(format!("http://{host}/u/bob/"))
            .bearer_auth(&bob)
            .send()
            .await
            .unwrap();
        let (status, body) = json_of(r).await;
        assert_eq!(
            (status, body["error"].as_str()),
            (404, Some("not_found")),
            "{host}"
        );
    }
    assert_eq!(node.status_of("bob").await, "none", "nothing woke bob");

    // The link: cookie and redirect on bob's host, then bob's app.
    let r = browser.get(link).send().await.unwrap();
    assert_eq!(r.status(), 303);
    assert_eq!(r.headers()["location"], "/");
    let cookie = r.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(
        cookie.contains("Path=/") && !cookie.contains("Domain"),
        "{cookie}"
    );
    let jar = cookie.split(';').next().unwrap().to_owned();
    let page = eventually(PATIENCE, "bob's app on bob's host", || async {
        let r = browser
            .get(origin(&node, "bob.berth.test"))
            .header("Cookie", &jar)
            .send()
            .await
            .unwrap();
        (r.status() == 200).then_some(r)
    })
    .await
    .text()
    .await
    .unwrap();
    assert!(page.contains(r#"<b id="user">bob</b>"#), "{page}");
    // Bob's cookie does not open alice's host.
    let r = browser
        .get(origin(&node, "alice.berth.test"))
        .header("Cookie", &jar)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
}

/// The redirect after `?berth_token=` stays on the host: a path of
/// `//evil.example/x` becomes `/evil.example/x`. An absolute-form target
/// naming another host than `Host` gets 400.
#[tokio::test(flavor = "multi_thread")]
async fn redirects_and_request_targets_stay_on_their_host() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &host_mode(3, ""));
    let alice = node.user_token("alice").await;
    let bob = node.user_token("bob").await;
    for (path, want) in [
        ("//evil.example/x", "/evil.example/x"),
        ("///evil.example/x", "/evil.example/x"),
        ("/lab", "/lab"),
    ] {
        let head = format!(
            "GET {path}?berth_token={alice}&q=1 HTTP/1.1\r\nHost: alice.{BASE}:{}\r\nConnection: close\r\n\r\n",
            port(&node)
        );
        let text = raw_text(&node, &head).await;
        assert!(text.starts_with("http/1.1 303"), "{path}: {text}");
        let location = text
            .lines()
            .find_map(|l| l.strip_prefix("location: "))
            .unwrap_or_else(|| panic!("no Location: {text}"));
        assert_eq!(location, format!("{want}?q=1"), "{path}");
    }
    let head = format!(
        "GET http://alice.{BASE}/ HTTP/1.1\r\nHost: bob.{BASE}\r\nAuthorization: Bearer {bob}\r\nConnection: close\r\n\r\n"
    );
    let (status, body) = raw_request(&node.url, &head).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("differs from the Host header"), "{body}");
    assert_eq!(node.status_of("alice").await, "none");
    assert_eq!(node.status_of("bob").await, "none");
}

/// The whole answer to a raw request, head included.
async fn raw_text(node: &Node, head: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr(node)).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf).await.unwrap();
    String::from_utf8_lossy(&buf).to_ascii_lowercase()
}

// --- cookies -----------------------------------------------------------------

/// An app's `Set-Cookie` for any of berth's names never reaches the
/// browser, in either mode; its own cookies do, and berth's credentials
/// never reach the app.
#[tokio::test(flavor = "multi_thread")]
async fn an_apps_berth_cookies_never_reach_the_browser() {
    for (n, host_routed) in [(4, false), (5, true)] {
        let dir = tempfile::tempdir().unwrap();
        let extra = if host_routed {
            host_mode(n, "")
        } else {
            config(n, "")
        };
        let node = Node::start(dir.path(), &extra);
        let browser = browser(&node);
        let alice = node.user_token("alice").await;
        let base = if host_routed {
            format!("{}/", origin(&node, "alice.berth.test"))
        } else {
            format!("{}/u/alice/", node.url)
        };
        let r = browser
            .get(format!("{base}set-cookie"))
            .header("Cookie", format!("berth_token={alice}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "host routed: {host_routed}");
        let set: Vec<_> = r
            .headers()
            .get_all("set-cookie")
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect();
        // In path mode the app's cookie is kept to its base path.
        let want = if host_routed {
            "demo=1; Path=/"
        } else {
            "demo=1; Path=/u/alice/"
        };
        assert_eq!(set, [want], "host routed: {host_routed}");

        let r = browser
            .get(format!("{base}headers"))
            .header("Cookie", format!("app=1; berth_token={alice}; other=2"))
            .send()
            .await
            .unwrap();
        let seen = r.text().await.unwrap();
        assert!(seen.contains("cookie: app=1; other=2\n"), "{seen}");
        assert!(!seen.contains(&alice), "{seen}");
    }
}

/// A second `berth_token` (planted by another app's script) neither
/// shadows the user's own nor gets the request refused: each is tried.
#[tokio::test(flavor = "multi_thread")]
async fn a_planted_berth_token_cookie_shadows_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(6, ""));
    let alice = node.user_token("alice").await;
    let r = node
        .http
        .get(format!("{}/u/alice/headers", node.url))
        .header(
            "Cookie",
            format!("berth_token=planted; berth_token={alice}"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = r.text().await.unwrap();
    assert!(!seen.contains("berth_token"), "{seen}");
}

// --- CSRF --------------------------------------------------------------------

/// A page on another origin posts a form to restart everything, with the
/// admin's session cookie riding along: 415, and nothing restarts. A JSON
/// body sent as `text/plain` (what a cross-site `fetch` can send without a
/// preflight) gets 415 too, even with the admin's Bearer token.
#[tokio::test(flavor = "multi_thread")]
async fn a_cross_origin_form_cannot_restart_everything() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &host_mode(7, ""));
    let browser = browser(&node);
    let berth = origin(&node, BASE);
    let (status, body) = node.post("/users/alice/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    let before = node.running_main("alice", None).await;

    let r = browser
        .post(format!("{berth}/api/v1/session"))
        .bearer_auth(&node.token)
        .send()
        .await
        .unwrap();
    let session = r.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned();

    let restart_all = format!("{berth}/api/v1/instances/restart-all");
    for (content_type, body) in [
        ("application/x-www-form-urlencoded", "confirm=yes"),
        (
            "multipart/form-data; boundary=x",
            "--x\r\n\r\nyes\r\n--x--\r\n",
        ),
        ("text/plain", "{}"),
        ("text/plain;charset=UTF-8", "{\"force\":true}"),
    ] {
        let r = browser
            .post(&restart_all)
            .header("Cookie", &session)
            .header("Origin", origin(&node, "alice.berth.test"))
            .header("Content-Type", content_type)
            .body(body)
            .send()
            .await
            .unwrap();
        let (status, answer) = json_of(r).await;
        assert_eq!(status, 415, "{content_type}: {answer}");
        assert_eq!(answer["error"], "unsupported_media_type", "{answer}");
    }
    // Even the admin's own token cannot make the API read a text body.
    let r = node
        .http
        .post(node.api("/users/alice/instance"))
        .bearer_auth(&node.token)
        .header("Content-Type", "text/plain")
        .body(r#"{"force": true}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 415);
    // Without a form body, the cross-origin POST still lacks the CSRF
    // token and the Origin.
    let r = browser
        .post(&restart_all)
        .header("Cookie", &session)
        .header("Origin", origin(&node, "alice.berth.test"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);

    let after = node.main_of("alice").await;
    assert_eq!(after["pid"], before["pid"], "alice was not restarted");
    assert_eq!(after["restarts"], before["restarts"]);
}

// --- tokens ------------------------------------------------------------------

/// A token stops working when it expires, on the API and through the proxy
/// (where it was cached): the cache never outlives the token.
#[tokio::test(flavor = "multi_thread")]
async fn an_expired_token_gets_401() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(8, ""));
    let (status, body) = node.post("/users/alice/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    // Short-lived on purpose; five seconds is ample for the two requests
    // that prove it worked.
    let (status, minted) = mint_as(&node, "alice", &node.token, json!({"ttl_s": 5})).await;
    assert_eq!(status, 201, "{minted}");
    let token = minted["token"].as_str().unwrap().to_owned();
    assert_eq!(
        minted["expires_at"].as_i64().unwrap() - minted["created_at"].as_i64().unwrap(),
        5000
    );
    assert_eq!(app_status_as(&node, "alice", &token).await, 200);
    assert_eq!(api_status_as(&node, "alice", &token).await, 200);
    // Waited for on the clock, not on berth: the proxy caches a token it
    // checked for 10 s, longer than this one lives, so a cache that
    // ignored the token's own expiry would still let the next request in.
    let expires_at = minted["expires_at"].as_i64().unwrap();
    eventually(PATIENCE, "the token's expiry to pass", || async {
        (now_ms() > expires_at).then_some(())
    })
    .await;
    assert_eq!(
        app_status_as(&node, "alice", &token).await,
        401,
        "the first request after the token's expiry"
    );
    assert_eq!(api_status_as(&node, "alice", &token).await, 401);
    assert!(token_ids(&node, "alice").await.is_empty(), "not listed");
    // A longer-lived token is capped by the configured TTL.
    let (_, long) = mint_as(&node, "alice", &node.token, json!({"ttl_s": 1u64 << 40})).await;
    assert_eq!(
        long["expires_at"].as_i64().unwrap() - long["created_at"].as_i64().unwrap(),
        30 * 24 * 3600 * 1000
    );
}

/// Revoking a token stops it at once, through the proxy (where it is
/// cached) and the API, and stops every token minted with it. Listing
/// shows ids and times, never secrets; the CLI lists and revokes.
#[tokio::test(flavor = "multi_thread")]
async fn a_revoked_token_gets_401_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(9, ""));
    let (status, body) = node.post("/users/alice/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    let (_, parent) = mint_as(&node, "alice", &node.token, json!({})).await;
    let parent_token = parent["token"].as_str().unwrap().to_owned();
    let (status, child) = mint_as(&node, "alice", &parent_token, json!({})).await;
    assert_eq!(status, 201, "a user mints a token for themself: {child}");
    let child_token = child["token"].as_str().unwrap().to_owned();
    assert_eq!(child["parent"], parent["id"]);
    assert!(child["expires_at"].as_i64() <= parent["expires_at"].as_i64());
    let (status, _) = mint_as(&node, "bob", &parent_token, json!({})).await;
    assert_eq!(status, 403, "but not for bob");
    for token in [&parent_token, &child_token] {
        assert_eq!(app_status_as(&node, "alice", token).await, 200);
        assert_eq!(api_status_as(&node, "alice", token).await, 200);
    }

    // The list: ids and times, no secrets.
    let (status, listed) = node.get("/users/alice/tokens").await;
    assert_eq!(status, 200);
    let text = listed.to_string();
    assert!(
        !text.contains(&parent_token) && !text.contains(&child_token),
        "{text}"
    );
    let rows = listed["tokens"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{listed}");
    for field in ["id", "created_at", "expires_at", "last_used_at"] {
        assert!(!rows[0][field].is_null(), "{field} in {listed}");
    }
    let cli = node.cli(&["token", "alice", "--list"]);
    let out = String::from_utf8_lossy(&cli.stdout);
    assert!(
        cli.status.success(),
        "{}",
        String::from_utf8_lossy(&cli.stderr)
    );
    assert!(out.contains(parent["id"].as_str().unwrap()), "{out}");
    assert!(out.contains("LAST USED"), "{out}");

    // Revoke the parent with the CLI: both stop at once.
    let id = parent["id"].as_str().unwrap();
    let cli = node.cli(&["token", "alice", "--revoke", id]);
    assert!(
        cli.status.success(),
        "{}",
        String::from_utf8_lossy(&cli.stderr)
    );
    let out = String::from_utf8_lossy(&cli.stdout);
    assert!(
        out.contains(child["id"].as_str().unwrap()),
        "the child too: {out}"
    );
    for token in [&parent_token, &child_token] {
        assert_eq!(app_status_as(&node, "alice", token).await, 401);
        assert_eq!(api_status_as(&node, "alice", token).await, 401);
    }
    assert!(token_ids(&node, "alice").await.is_empty());
    let cli = node.cli(&["token", "alice", "--revoke", id]);
    assert!(!cli.status.success());
    assert!(String::from_utf8_lossy(&cli.stderr).contains("not_found"));
}

/// The per-user cap holds under concurrent mints (refused, not the oldest
/// dropped), counts only live tokens, and frees a place on revocation.
#[tokio::test(flavor = "multi_thread")]
async fn the_token_cap_holds() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(10, "[auth]\nmax_tokens_per_user = 3\n"));
    let mints = (0..8).map(|_| mint_as(&node, "alice", &node.token, json!({})));
    let results = futures_util::future::join_all(mints).await;
    let minted: Vec<_> = results.iter().filter(|(s, _)| *s == 201).collect();
    assert_eq!(minted.len(), 3, "{results:?}");
    for (status, body) in results.iter().filter(|(s, _)| *s != 201) {
        assert_eq!(*status, 409, "{body}");
        assert_eq!(body["error"], "too_many_tokens");
        assert!(
            body["message"].as_str().unwrap().contains("--revoke"),
            "{body}"
        );
    }
    let ids = token_ids(&node, "alice").await;
    assert_eq!(ids.len(), 3);
    // The first tokens still work: nothing was dropped to make room.
    let first = minted[0].1["token"].as_str().unwrap();
    assert_eq!(api_status_as(&node, "alice", first).await, 200);
    assert_eq!(
        mint_as(&node, "bob", &node.token, json!({})).await.0,
        201,
        "per user"
    );
    assert_eq!(
        node.delete(&format!("/users/alice/tokens/{}", ids[1]))
            .await,
        200
    );
    assert_eq!(mint_as(&node, "alice", &node.token, json!({})).await.0, 201);
    assert_eq!(mint_as(&node, "alice", &node.token, json!({})).await.0, 409);
}

/// A user token launches and stops its own instance with the configured
/// defaults and reads its status and logs; `patch`, `folder`, `force` (even
/// during a cooldown, where it would bypass the breaker) and a breaker
/// reset are the admin's, as is everything about other users.
#[tokio::test(flavor = "multi_thread")]
async fn a_user_token_launches_only_with_the_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let crashing = format!(
        "command = [\"{}\", \"demo-app\", \"--port\", \"{{port}}\", \"--crash-after-ms\", \"150\"]\n\
         [crash]\nbackoff_base_ms = 20\nbackoff_max_ms = 100\n",
        support::BERTH
    );
    let node = Node::start(dir.path(), &config(11, &crashing));
    let alice = node.user_token("alice").await;
    let launch = |body: Value| {
        let node = &node;
        let alice = alice.clone();
        async move {
            json_of(
                node.http
                    .post(node.api("/users/alice/instance?wait=false"))
                    .bearer_auth(&alice)
                    .json(&body)
                    .send()
                    .await
                    .unwrap(),
            )
            .await
        }
    };
    for body in [
        json!({"patch": "x: 1"}),
        json!({"folder": "work"}),
        json!({"force": true}),
    ] {
        let (status, answer) = launch(body.clone()).await;
        assert_eq!(status, 403, "{body}: {answer}");
        assert!(
            answer["message"]
                .as_str()
                .unwrap()
                .contains("users_may_patch"),
            "{answer}"
        );
    }
    assert!(node.main_of("alice").await.is_null(), "nothing launched");

    // The defaults are alice's to use: the crash loop opens her breaker.
    let (status, answer) = launch(json!({})).await;
    assert_eq!(status, 201, "{answer}");
    eventually(PATIENCE, "the breaker to open", || async {
        (node.status_of("alice").await == "failed").then_some(())
    })
    .await;
    let (status, answer) = launch(json!({"force": true})).await;
    assert_eq!(status, 403, "force during a cooldown: {answer}");
    let (status, answer) = launch(json!({})).await;
    assert_eq!(
        (status, answer["error"].as_str()),
        (503, Some("instance_circuit_open"))
    );
    let r = node
        .http
        .post(node.api("/users/alice/breaker/reset"))
        .bearer_auth(&alice)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert!(
        !node.get("/users/alice/instance").await.1["breaker"].is_null(),
        "still open"
    );

    // Her own status and logs, yes (and restart: tests/login.rs); probe,
    // watchdog and the admin's lists, no; bob, nothing.
    for (method, path, want) in [
        ("GET", "/users/alice/instance", 200),
        ("GET", "/users/alice/instance/logs", 200),
        ("GET", "/users/alice/tokens", 200),
        ("POST", "/users/alice/instance/probe", 403),
        ("POST", "/users/alice/watchdog", 403),
        ("GET", "/instances", 403),
        ("POST", "/instances/restart-all", 403),
        ("GET", "/users/bob/instance", 403),
        ("POST", "/users/bob/tokens", 403),
    ] {
        let r = node
            .http
            .request(method.parse().unwrap(), node.api(path))
            .bearer_auth(&alice)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), want, "{method} {path}");
    }
}

/// `[auth] users_may_patch = true` hands patch, folder, force and the
/// breaker reset to the user.
#[tokio::test(flavor = "multi_thread")]
async fn users_may_patch_when_configured() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(12, "[auth]\nusers_may_patch = true\n"));
    let alice = node.user_token("alice").await;
    let r = node
        .http
        .post(node.api("/users/alice/instance"))
        .bearer_auth(&alice)
        .json(&json!({"patch": "x: 1", "force": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert!(node.data_dir.join("users/alice/patches/main.yaml").exists());
    let r = node
        .http
        .post(node.api("/users/alice/breaker/reset"))
        .bearer_auth(&alice)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    // And, as for any user, stopping their own instance.
    let r = node
        .http
        .delete(node.api("/users/alice/instance"))
        .bearer_auth(&alice)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(node.status_of("alice").await, "stopped");
}

// --- header mode --------------------------------------------------------------

/// Header mode: duplicate `X-Forwarded-User` headers get 400, and with a
/// header secret a process on the trusted address that does not know it
/// cannot name a user (trusting loopback trusts every local process).
#[tokio::test(flavor = "multi_thread")]
async fn header_mode_refuses_duplicates_and_wants_the_secret() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(
        dir.path(),
        &config(
            13,
            "[proxy]\nauth = \"header\"\ntrusted_proxies = [\"127.0.0.1\"]\nheader_secret = \"sso-s3cret\"\n",
        ),
    );
    let get = |headers: Vec<(&'static str, &'static str)>| {
        let mut request = node.http.get(format!("{}/u/alice/headers", node.url));
        for (k, v) in headers {
            request = request.header(k, v);
        }
        request.send()
    };
    let r = get(vec![("X-Forwarded-User", "alice")]).await.unwrap();
    assert_eq!(r.status(), 401, "no secret");
    let r = get(vec![
        ("X-Forwarded-User", "alice"),
        ("X-Berth-Proxy-Secret", "guess"),
    ])
    .await
    .unwrap();
    assert_eq!(r.status(), 401, "a wrong secret");
    let r = get(vec![
        ("X-Forwarded-User", "alice"),
        ("X-Forwarded-User", "bob"),
        ("X-Berth-Proxy-Secret", "sso-s3cret"),
    ])
    .await
    .unwrap();
    assert_eq!(r.status(), 400, "two names");
    assert_eq!(node.status_of("alice").await, "none");
    let r = get(vec![
        ("X-Forwarded-User", "alice"),
        ("X-Berth-Proxy-Secret", "sso-s3cret"),
    ])
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    let seen = r.text().await.unwrap();
    assert!(seen.contains("x-forwarded-user: alice\n"), "{seen}");
    assert!(
        !seen.contains("sso-s3cret"),
        "the secret never reaches the app: {seen}"
    );
}

/// Milliseconds since the Unix epoch, as berth's timestamps count them.
fn now_ms() -> i64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    i64::try_from(since.as_millis()).unwrap()
}

/// Path routing serves every app on the API's own origin, so berth says
/// at start that it suits only users who trust each other; with a domain
/// (host mode) it says nothing of the kind.
#[tokio::test(flavor = "multi_thread")]
async fn path_mode_warns_at_start_that_apps_share_the_apis_origin() {
    for (proxy, warned) in [
        ("", true),
        ("[proxy]\nbase_domain = \"berth.test\"\n", false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("berth.log");
        let node = Node::from(
            support::berth()
                .node(dir.path())
                .config(&format!(
                    "listen = \"127.0.0.1:0\"\ndata_dir = \"{}\"\n{proxy}",
                    dir.path().join("data").display()
                ))
                .options(support::StartOptions {
                    stderr: Some(log.clone()),
                    ..support::StartOptions::default()
                })
                .start(),
        );
        assert_eq!(node.healthz().await, 200);
        let text = std::fs::read_to_string(&log).unwrap();
        let warning = text
            .lines()
            .any(|l| l.contains("WARN") && l.contains("only users who trust each other"));
        assert_eq!(warning, warned, "{proxy:?}: {text}");
    }
}
