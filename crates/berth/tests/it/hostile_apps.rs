//! A user's app as the attacker, against the real `berth` binary and the
//! programs it really launches (`tests/programs/upstream.py`, which answers
//! whatever headers a test asks for): what its answers may do to a browser
//! on the origin (path mode) or site (host mode) it shares, what a page of
//! one app may make a browser send to another app, cookies planted to
//! shadow berth's, and escape sequences in what the CLI prints.
//!
//! The browser attacks run in headless Chromium (`support/browser.rs`);
//! the same rules are also checked header by header, which needs no
//! browser.

use crate::support;
use crate::support::browser;

use std::net::SocketAddr;
use std::time::Duration;

use browser::{BASE, Browser};
use fantoccini::Client;
use serde_json::{Value, json};
use support::{Node, eventually};

const PATIENCE: Duration = Duration::from_secs(60);

/// A config on ports of its own running `upstream.py`, plus `instance`
/// keys and whole tables in `extra`.
fn config(n: u16, instance: &str, extra: &str) -> String {
    support::upstream_config(
        berth_testkit::port_block_for(&format!("{} {n}", module_path!()), 20),
        instance,
        extra,
    )
}

fn host_mode(n: u16, instance: &str) -> String {
    config(n, instance, &format!("[proxy]\nbase_domain = \"{BASE}\"\n"))
}

fn addr(node: &Node) -> SocketAddr {
    node.url.trim_start_matches("http://").parse().unwrap()
}

/// `http://<host>:<port>` of the node under `host`.
fn origin(node: &Node, host: &str) -> String {
    format!("http://{host}:{}", addr(node).port())
}

/// A client that resolves the test host names to the node and follows no
/// redirects.
fn client(node: &Node) -> reqwest::Client {
    let mut builder = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none());
    for host in [
        BASE.to_owned(),
        format!("alice.{BASE}"),
        format!("bob.{BASE}"),
    ] {
        builder = builder.resolve(&host, addr(node));
    }
    builder.build().unwrap()
}

/// `…/say?…`: a URL (absolute, or a path when `base` is one) on which
/// upstream.py answers with `headers`, `kind` and `body`.
fn say(base: &str, headers: &[&str], kind: &str, body: &str) -> String {
    let placeholder = reqwest::Url::parse("http://placeholder.invalid/").unwrap();
    let mut url = placeholder.join(&format!("{base}say")).unwrap();
    {
        let mut query = url.query_pairs_mut();
        for h in headers {
            query.append_pair("h", h);
        }
        query.append_pair("type", kind).append_pair("body", body);
    }
    match url.host_str() {
        Some("placeholder.invalid") => format!("{}?{}", url.path(), url.query().unwrap_or("")),
        _ => url.to_string(),
    }
}

fn values(r: &reqwest::Response, name: &str) -> Vec<String> {
    r.headers()
        .get_all(name)
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect()
}

async fn run_script(c: &Client, js: &str) -> Value {
    c.execute_async(js, vec![]).await.expect("the script runs")
}

/// Starts `user`'s app and opens it in the browser with a link carrying
/// their token: the browser then holds the user cookie, as after any shared
/// link. (Started first, so no "starting" page reloads under a script.)
async fn open_app(c: &Client, node: &Node, app_origin: &str, user: &str) {
    let (status, body) = node
        .post(&format!("/users/{user}/instance"), json!({}))
        .await;
    assert!(status == 200 || status == 201, "{body}");
    node.running_main(user, None).await;
    let token = node.user_token(user).await;
    c.goto(&format!("{app_origin}?berth_token={token}"))
        .await
        .unwrap();
    let url = c.current_url().await.unwrap();
    assert_eq!(url.as_str(), app_origin, "the link became a cookie");
}

// --- path mode: an app's answer and the shared origin -------------------------

/// alice's app answers with every header that would act on berth's whole
/// origin; what reaches the browser is confined to `/u/alice/`.
#[tokio::test(flavor = "multi_thread")]
async fn path_mode_an_apps_headers_cannot_act_on_the_shared_origin() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(0, "", ""));
    let alice = node.user_token("alice").await;
    let hostile = [
        "Service-Worker-Allowed: /",
        "Clear-Site-Data: \"*\"",
        "Set-Cookie: wide=1; Path=/; HttpOnly",
        "Set-Cookie: sibling=1; Path=/u/bob/",
        "Set-Cookie: parent=1; Domain=127.0.0.1; Path=/u/alice/",
        "Set-Cookie: berth_session=planted; Path=/",
        "Set-Cookie: own=1",
        "Refresh: 0; url=/admin/",
        "Link: </admin/>; rel=prefetch, </u/alice/app.css>; rel=preload; as=style",
        "NEL: {\"report_to\":\"spy\",\"max_age\":86400,\"success_fraction\":1.0}",
        "Report-To: {\"group\":\"spy\",\"max_age\":86400,\"endpoints\":[{\"url\":\"http://spy.test/\"}]}",
        "Strict-Transport-Security: max-age=31536000; includeSubDomains",
        "X-App: yes",
    ];
    let r = node
        .http
        .get(say(
            &format!("{}/u/alice/", node.url),
            &hostile,
            "text/plain",
            "hi",
        ))
        .bearer_auth(&alice)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    for gone in [
        "service-worker-allowed",
        "clear-site-data",
        "refresh",
        "nel",
        "report-to",
        "strict-transport-security",
    ] {
        assert!(r.headers().get(gone).is_none(), "{gone}: {:?}", r.headers());
    }
    assert_eq!(
        values(&r, "set-cookie"),
        [
            "wide=1; Path=/u/alice/; HttpOnly",
            "sibling=1; Path=/u/alice/",
            "parent=1; Path=/u/alice/",
            "own=1"
        ]
    );
    assert_eq!(
        values(&r, "link"),
        ["</u/alice/app.css>; rel=preload; as=style"]
    );
    assert_eq!(values(&r, "x-app"), ["yes"]);
}

/// alice's page registers a service worker for `/` (its script says
/// `Service-Worker-Allowed: /`): it would see the admin page's requests
/// and their Bearer token. The browser refuses it; within `/u/alice/` a
/// worker still registers.
#[tokio::test(flavor = "multi_thread")]
async fn path_mode_an_apps_service_worker_cannot_cover_the_admin_page() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(1, "", ""));
    let browser = Browser::start().await;
    let c = browser.client();
    // 127.0.0.1 is a secure context: service workers work over plain HTTP.
    let app = format!("{}/u/alice/", node.url);
    open_app(c, &node, &app, "alice").await;
    let worker = say(
        "/u/alice/",
        &["Service-Worker-Allowed: /"],
        "text/javascript",
        "self.addEventListener('fetch', (e) => e.respondWith(fetch(e.request)));",
    );
    let register = |scope: &str| {
        format!(
            "const done = arguments[arguments.length - 1];
             navigator.serviceWorker.register({worker:?}, {{ scope: {scope:?} }})
               .then((r) => done('registered ' + new URL(r.scope).pathname),
                     (e) => done('refused ' + e.name));"
        )
    };
    let whole = run_script(c, &register("/")).await;
    assert_eq!(whole, json!("refused SecurityError"), "a worker for /");
    let covering = run_script(
        c,
        "const done = arguments[arguments.length - 1];
         navigator.serviceWorker.getRegistration('/admin/')
           .then((r) => done(r === undefined ? 'none' : r.scope));",
    )
    .await;
    assert_eq!(covering, json!("none"), "nothing covers the admin page");
    let own = run_script(c, &register("/u/alice/")).await;
    assert_eq!(own, json!("registered /u/alice/"), "its own base path");
    browser.close().await;
}

// --- host mode: other apps' pages ---------------------------------------------

/// bob's browser holds bob's cookie; bob opens a link to alice's app, whose
/// page posts to bob's app and opens a WebSocket to it (the cookie rides
/// along: the hosts are one site). Neither reaches bob's program; bob's own
/// page still does both.
#[tokio::test(flavor = "multi_thread")]
async fn host_mode_alices_page_cannot_post_or_open_a_websocket_to_bobs_app() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &host_mode(2, ""));
    let bob_app = format!("{}/", origin(&node, &format!("bob.{BASE}")));
    let alice_app = format!("{}/", origin(&node, &format!("alice.{BASE}")));
    let bob = node.user_token("bob").await;
    let pokes = || async {
        let r = client(&node)
            .get(format!("{bob_app}pokes"))
            .bearer_auth(&bob)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()
    };
    let browser = Browser::start().await;
    let c = browser.client();
    open_app(c, &node, &bob_app, "bob").await;
    open_app(c, &node, &alice_app, "alice").await;
    let attack = format!(
        "const done = arguments[arguments.length - 1];
         fetch('{bob_app}poke', {{ method: 'POST', mode: 'no-cors', credentials: 'include', body: 'x' }})
           .then(() => 'sent', (e) => 'failed')
           .then((post) => {{
             const ws = new WebSocket('{ws}poke');
             ws.onclose = () => done(post + ', closed');
           }});",
        ws = bob_app.replacen("http", "ws", 1)
    );
    assert_eq!(run_script(c, &attack).await, json!("sent, closed"));
    assert_eq!(pokes().await, json!({}), "nothing reached bob's app");

    // bob's own page, the same requests: they get through.
    c.goto(&bob_app).await.unwrap();
    assert_eq!(run_script(c, &attack).await, json!("sent, closed"));
    assert_eq!(pokes().await, json!({"POST": 1, "upgrade": 1}));
    browser.close().await;
}

/// The same requests, header by header: 403 with the proxy's JSON error
/// (or its page, for a form's navigation), and nothing woken; the app's
/// own origin, clients that are not browsers and reads pass; a program
/// that allows cross-origin requests gets them all. Domain cookies become
/// host-only.
#[tokio::test(flavor = "multi_thread")]
async fn host_mode_requests_from_other_origins_are_refused_header_by_header() {
    for (n, allow) in [(3, false), (4, true)] {
        let dir = tempfile::tempdir().unwrap();
        let instance = format!("allow_cross_origin_requests = {allow}\n");
        let node = Node::start(dir.path(), &host_mode(n, &instance));
        let http = client(&node);
        let bob = node.user_token("bob").await;
        let bob_app = format!("{}/", origin(&node, &format!("bob.{BASE}")));
        let alice_origin = origin(&node, &format!("alice.{BASE}"));
        let post = |origin: Option<&str>, fetch_site: Option<&str>| {
            let mut request = http
                .post(format!("{bob_app}poke"))
                .header("Cookie", format!("berth_token={bob}"))
                .body("x");
            if let Some(origin) = origin {
                request = request.header("Origin", origin);
            }
            if let Some(site) = fetch_site {
                request = request.header("Sec-Fetch-Site", site);
            }
            request
        };
        let r = post(Some(&alice_origin), Some("same-site"))
            .send()
            .await
            .unwrap();
        if allow {
            assert_eq!(r.status(), 200, "allowed by the program's config");
            continue;
        }
        assert_eq!(r.status(), 403);
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"], "forbidden", "{body}");
        assert!(
            body["message"].as_str().unwrap().contains("another origin"),
            "{body}"
        );
        assert_eq!(node.status_of("bob").await, "none", "nothing was woken");
        let r = post(None, Some("cross-site"))
            .header("Sec-Fetch-Mode", "navigate")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403);
        assert!(
            r.text().await.unwrap().contains("<h1>Forbidden</h1>"),
            "a page for a form's navigation"
        );
        let r = post(Some("null"), None).send().await.unwrap();
        assert_eq!(r.status(), 403, "an opaque origin");
        let own = origin(&node, &format!("bob.{BASE}"));
        for (origin, site) in [
            (Some(own.as_str()), Some("same-origin")),
            (None, Some("none")),
            (None, None),
        ] {
            let r = post(origin, site).send().await.unwrap();
            assert_eq!(r.status(), 200, "{origin:?} {site:?}");
        }
        let r = http
            .get(format!("{bob_app}pokes"))
            .header("Cookie", format!("berth_token={bob}"))
            .header("Origin", &alice_origin)
            .header("Sec-Fetch-Site", "same-site")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "reads are not refused");
        assert_eq!(r.json::<Value>().await.unwrap(), json!({"POST": 3}));

        // A WebSocket handshake from alice's origin, and from bob's own.
        let handshake = |origin: &str| {
            format!(
                "GET /poke HTTP/1.1\r\nHost: bob.{BASE}:{port}\r\nCookie: berth_token={bob}\r\n\
                 Origin: {origin}\r\nConnection: Upgrade, close\r\nUpgrade: websocket\r\n\
                 Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
                port = addr(&node).port()
            )
        };
        let (status, _) = support::raw_request(&node.url, &handshake(&alice_origin)).await;
        assert_eq!(status, 403, "a WebSocket from another origin");
        let (status, _) = support::raw_request(&node.url, &handshake(&own)).await;
        assert_eq!(status, 200, "upstream.py answers the upgrade itself");

        // A cookie for the whole domain becomes bob's host's alone.
        let r = http
            .get(say(
                &bob_app,
                &["Set-Cookie: wide=1; Domain=berth.test; Path=/"],
                "text/plain",
                "",
            ))
            .bearer_auth(&bob)
            .send()
            .await
            .unwrap();
        assert_eq!(values(&r, "set-cookie"), ["wide=1; Path=/"]);
    }
}

// --- cookies planted to shadow berth's -----------------------------------------

/// The admin signs in to the admin page (host mode, plain HTTP); alice's
/// app page plants a `berth_session` for the whole domain, on a path the
/// browser sends first. The admin's API calls keep working.
#[tokio::test(flavor = "multi_thread")]
async fn a_planted_session_cookie_cannot_lock_the_admin_out() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &host_mode(5, ""));
    let berth = origin(&node, BASE);
    let browser = Browser::start().await;
    let c = browser.client();
    c.goto(&format!("{berth}/admin/")).await.unwrap();
    let sign_in = format!(
        "const done = arguments[arguments.length - 1];
         fetch('/api/v1/session', {{ method: 'POST', headers: {{ Authorization: 'Bearer {}' }} }})
           .then((r) => done(r.status));",
        node.token
    );
    assert_eq!(run_script(c, &sign_in).await, json!(201));
    let list = "const done = arguments[arguments.length - 1];
         fetch('/api/v1/instances').then((r) => done(r.status));";
    assert_eq!(run_script(c, list).await, json!(200), "signed in");

    open_app(
        c,
        &node,
        &format!("{}/", origin(&node, &format!("alice.{BASE}"))),
        "alice",
    )
    .await;
    // One for the whole path, one for the API's path, which the browser
    // sends before the admin's own.
    let plant = format!(
        "const done = arguments[arguments.length - 1];
         document.cookie = 'berth_session=planted; domain={BASE}; path=/';
         document.cookie = 'berth_session=first; domain={BASE}; path=/api/';
         done(null);"
    );
    assert_eq!(run_script(c, &plant).await, Value::Null);

    c.goto(&format!("{berth}/admin/")).await.unwrap();
    let seen = run_script(
        c,
        "const done = arguments[arguments.length - 1]; done(document.cookie);",
    )
    .await;
    assert_eq!(seen, json!("berth_session=planted"), "the plant took");
    assert_eq!(run_script(c, list).await, json!(200), "still signed in");
    browser.close().await;
}

/// The same, header by header: two `berth_session` cookies (the planted
/// one first) and two user cookies reach their owners.
#[tokio::test(flavor = "multi_thread")]
async fn planted_cookies_shadow_nothing_header_by_header() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &host_mode(6, ""));
    let http = client(&node);
    let berth = origin(&node, BASE);
    let r = http
        .post(format!("{berth}/api/v1/session"))
        .bearer_auth(&node.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let cookie = values(&r, "set-cookie")[0].clone();
    let session = cookie.split(';').next().unwrap().to_owned();
    let r = http
        .get(format!("{berth}/api/v1/instances"))
        .header("Cookie", format!("berth_session=planted; {session}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());

    let alice = node.user_token("alice").await;
    let r = http
        .get(format!("{}/", origin(&node, &format!("alice.{BASE}"))))
        .header(
            "Cookie",
            format!("berth_token=planted; berth_token={alice}"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

// --- what the CLI prints ------------------------------------------------------

/// Text a program writes to its log, or a server sends: an OSC 52
/// clipboard write, a one-byte CSI and a screen clear.
const ESCAPES: &str = "\u{1b}]52;c;cm0gLXJmIH4=\u{7} \u{9b}2J \u{1b}[2J";
/// The same, as the CLI must show it.
const SHOWN: &str = "\\x1b]52;c;cm0gLXJmIH4=\\x07 \\u{9b}2J \\x1b[2J";

fn no_controls(out: &[u8]) -> String {
    let text = String::from_utf8(out.to_vec()).unwrap();
    assert!(
        !text
            .chars()
            .any(|c| c.is_control() && c != '\n' && c != '\t'),
        "raw control characters: {text:?}"
    );
    text
}

/// alice's program prints escape sequences; `berth logs alice` shows them
/// as text, in every output form.
#[tokio::test(flavor = "multi_thread")]
async fn berth_logs_shows_a_programs_escape_sequences_as_text() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(7, "", ""));
    let alice = node.user_token("alice").await;
    let mut url = reqwest::Url::parse(&format!("{}/u/alice/print", node.url)).unwrap();
    url.query_pairs_mut().append_pair("text", ESCAPES);
    let r = node.http.get(url).bearer_auth(&alice).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let token = node.token.clone();
    let logs = |json: bool| {
        let mut args = vec!["logs", "alice", "--token", &token];
        if json {
            args.push("--json");
        }
        node.cli(&args)
    };
    let out = eventually(PATIENCE, "the line in the log", || async {
        let out = logs(false);
        (out.status.success() && String::from_utf8_lossy(&out.stdout).contains("cm0gLXJmIH4="))
            .then_some(out)
    })
    .await;
    assert!(no_controls(&out.stdout).contains(SHOWN));
    let out = logs(true);
    assert!(out.status.success());
    let printed = no_controls(&out.stdout);
    let answer: Value = serde_json::from_str(&printed).unwrap();
    let lines = answer["lines"].as_array().unwrap();
    assert!(
        lines.iter().any(|l| l.as_str() == Some(ESCAPES)),
        "JSON keeps the value exactly: {printed}"
    );
}

/// A server whose answers carry escape sequences (a status field, an
/// error message): `berth status` shows them as text.
#[tokio::test(flavor = "multi_thread")]
async fn berth_status_shows_a_servers_escape_sequences_as_text() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    // A whole record: the CLI shows for people only an answer it reads.
    let status = json!({
        "user": "alice",
        "main": {"id": "alice-1", "user": "alice", "role": "main", "status": "crashed",
                 "node": ESCAPES, "epoch": 1, "port": null, "pid": null, "folder": ESCAPES,
                 "started_at": 0, "ready": false, "restarts": 1, "last_error": ESCAPES,
                 "exit_code": 1, "last_active": 0},
        "breaker": null,
        "watchdog": null,
    });
    let error = json!({"error": "not_found", "message": ESCAPES});
    let answers = [(200, status.to_string()), (404, error.to_string())];
    let server = tokio::spawn(async move {
        for (code, body) in answers {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = stream.read(&mut buf).await.unwrap();
            let answer = format!(
                "HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            stream.write_all(answer.as_bytes()).await.unwrap();
        }
    });
    let run = move || {
        let out = std::process::Command::new(support::BERTH)
            .args(["status", "alice", "--url", &url, "--token", "t"])
            .env_remove("BERTH_URL")
            .env_remove("BERTH_TOKEN")
            .output()
            .unwrap();
        (no_controls(&out.stdout), no_controls(&out.stderr))
    };
    let (shown, error) = tokio::task::spawn_blocking(move || (run(), run()))
        .await
        .unwrap();
    for line in ["node", "folder", "last error"] {
        assert!(
            shown.0.contains(&format!("{line:<10}  {SHOWN}\n")),
            "{shown:?}"
        );
    }
    assert!(error.1.contains(SHOWN), "{error:?}");
    server.await.unwrap();
}

// --- the program's own credential ------------------------------------------------

/// With `credential_header`, berth presents the program's launch token on
/// every request it forwards, whatever the client sent in its place; and a
/// program that echoes its token back (redirect, cookie, header, a body
/// that splits it across chunks) gives it away to nobody.
#[tokio::test(flavor = "multi_thread")]
async fn the_launch_token_is_presented_upstream_and_never_reaches_the_browser() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(
        dir.path(),
        &support::upstream_config_with_launch_token(
            berth_testkit::port_block_for(&format!("{} 9", module_path!()), 20),
            "credential_header = \"Authorization: token {launch_token}\"",
            "",
        ),
    );
    let (status, body) = node.post("/users/alice/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    assert!(
        !body.to_string().contains("token="),
        "the launch answer names no token: {body}"
    );
    let token = support::launch_token_in_log(&node, "alice").await;
    assert!(!body.to_string().contains(&token), "{body}");
    let alice = node.user_token("alice").await;
    let http = client(&node);
    let app = format!("{}/u/alice/", node.url);

    // Presented: the program sees its own token, not the client's forgery.
    let r = http
        .get(format!("{app}echo"))
        .header("Cookie", format!("berth_token={alice}"))
        .header("Authorization", "token forged-by-the-client")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen: Value = r.json().await.unwrap();
    // (The echo of the header itself comes back scrubbed: the program
    // judges it.)
    assert_eq!(seen["token_presented"], true, "{seen}");

    // Never shown: every way the program gives it away comes back without it.
    let r = http
        .get(format!("{app}leak"))
        .header("Cookie", format!("berth_token={alice}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 302);
    let headers = format!("{:?}", r.headers());
    // Each copy becomes `*` (a byte no hex token holds).
    assert_eq!(values(&r, "location"), ["/lab?token=*"], "{headers}");
    assert_eq!(values(&r, "x-token"), ["*"], "{headers}");
    assert!(!headers.contains(&token), "{headers}");
    let page = r.text().await.unwrap();
    assert_eq!(
        page, "<a href=\"?token=*\">lab</a> *.",
        "the body without the token"
    );
}
