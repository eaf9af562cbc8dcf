//! The admin page (`/admin/`) in a real browser: headless Chromium driven
//! through chromedriver (WebDriver), against the real `berth` binary.
//!
//! Each flow signs in with the admin token, sees alice running, stops her
//! from the page and sees it without a reload, starts bob from the page,
//! follows bob's log, opens bob's app through the page's link, and saves
//! screenshots at 1280 px and at phone width under
//! `target/test-artifacts/`. Host mode (`base_domain = "berth.test"`,
//! which Chromium resolves to loopback by `--host-resolver-rules`) signs
//! in with the admin session; path mode keeps the token in the page's
//! memory. Both check, from inside the browser, that the page stored no
//! credential where an app could read it; host mode also has bob's app
//! post to the API with the admin's cookie, which must fail.
//!
//! Needs Debian's `chromium` and `chromium-driver` (`scripts/test`
//! installs them); without them the browser tests fail, saying so.

use crate::support;
use crate::support::browser;

use std::path::{Path, PathBuf};
use std::time::Duration;

use browser::{BASE, Browser, WIDE};
use fantoccini::{Client, Locator};
use serde_json::{Value, json};
use support::{Node, eventually};

const PATIENCE: Duration = Duration::from_secs(60);
const PHONE: (u32, u32) = (390, 844);

/// A config with its own port range (tests run in parallel) plus `extra`.
fn config(n: u16, extra: &str) -> String {
    let start = berth_testkit::port_block_for(&format!("{} {n}", module_path!()), 20);
    format!(
        "[instance]\nport_range = [{start}, {}]\n{extra}\n",
        start + 19
    )
}

fn port(node: &Node) -> u16 {
    node.url.rsplit(':').next().unwrap().parse().unwrap()
}

/// Where screenshots go: `target/test-artifacts/`.
fn artifacts() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target dir")
        .join("test-artifacts");
    std::fs::create_dir_all(&dir).expect("cannot create target/test-artifacts");
    dir
}

/// The admin page's row of `user`'s main instance: its `data-status`.
async fn status_on_page(c: &Client, user: &str) -> Option<String> {
    let row = c
        .find(Locator::Css(&format!(
            r#"#instances tr[data-user="{user}"][data-role="main"]"#
        )))
        .await
        .ok()?;
    row.attr("data-status").await.ok()?
}

async fn wait_status(c: &Client, user: &str, want: &str) {
    eventually(PATIENCE, &format!("{user} {want} on the page"), || async {
        (status_on_page(c, user).await.as_deref() == Some(want)).then_some(())
    })
    .await;
}

/// Clicks `action` in `user`'s row (once its buttons are enabled).
async fn click_action(c: &Client, user: &str, action: &str) {
    let css = format!(
        r#"#instances tr[data-user="{user}"][data-role="main"] button[data-action="{action}"]"#
    );
    eventually(PATIENCE, &format!("{action} for {user}"), || async {
        let button = c.find(Locator::Css(&css)).await.ok()?;
        if !button.is_enabled().await.ok()? {
            return None;
        }
        button.click().await.ok()
    })
    .await;
}

async fn click(c: &Client, css: &str) {
    eventually(PATIENCE, &format!("click {css}"), || async {
        let element = c.find(Locator::Css(css)).await.ok()?;
        if !element.is_displayed().await.ok()? {
            return None;
        }
        element.click().await.ok()
    })
    .await;
}

async fn script(c: &Client, js: &str) -> Value {
    c.execute(js, vec![]).await.expect("the script runs")
}

async fn screenshot(c: &Client, name: &str, (width, height): (u32, u32)) {
    c.set_window_size(width, height).await.unwrap();
    // Notices fade by themselves; the picture is of the page.
    eventually(PATIENCE, "the notices to fade", || async {
        let toasts = c.find_all(Locator::Css("#toasts > *")).await.ok()?;
        toasts.is_empty().then_some(())
    })
    .await;
    // Wait for the layout to follow the window.
    eventually(PATIENCE, "the new width", || async {
        let inner = script(c, "return window.innerWidth").await.as_u64()?;
        (inner <= u64::from(width) && inner + 40 >= u64::from(width)).then_some(())
    })
    .await;
    let png = c.screenshot().await.expect("a screenshot");
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    std::fs::write(artifacts().join(name), png).expect("the screenshot is saved");
}

/// What a page of the origin could find of a credential: storage and
/// script-readable cookies.
async fn readable_credentials(c: &Client) -> Value {
    script(
        c,
        "return {local: localStorage.length, session: sessionStorage.length, \
         cookies: document.cookie}",
    )
    .await
}

/// A path segment, every byte but letters and digits percent-encoded.
fn urlencode(segment: &str) -> String {
    segment
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Host,
    Path,
}

/// The whole flow, in `mode`.
async fn admin_flow(mode: Mode, n: u16) {
    let dir = tempfile::tempdir().unwrap();
    let extra = match mode {
        Mode::Host => format!("[proxy]\nbase_domain = \"{BASE}\"\n"),
        Mode::Path => String::new(),
    };
    let node = Node::start(dir.path(), &config(n, &extra));
    let port = port(&node);
    let origin = match mode {
        Mode::Host => format!("http://{BASE}:{port}"),
        Mode::Path => node.url.clone(),
    };
    let (status, body) = node.post("/users/alice/instance", json!({})).await;
    assert!(status == 201 || status == 200, "{body}");
    node.running_main("alice", None).await;
    // A user whose id is markup: the page must show it as text.
    const MARKUP: &str = "<img src=x onerror=window.pwned=1>";
    if mode == Mode::Path {
        let path = format!("/users/{}/instance?wait=false", urlencode(MARKUP));
        let (status, body) = node.post(&path, json!({})).await;
        assert_eq!(status, 201, "{body}");
    }

    let browser = Browser::start().await;
    let c = browser.client();
    c.goto(&format!("{origin}/admin")).await.unwrap();
    // `/admin` redirects to the page; before signing in it shows nothing
    // but the form.
    assert_eq!(
        c.current_url().await.unwrap().as_str(),
        format!("{origin}/admin/")
    );
    let token_input = c.wait().for_element(Locator::Id("token")).await.unwrap();
    let source = c.source().await.unwrap();
    assert!(!source.contains("alice"), "no data before signing in");
    assert!(
        !c.find(Locator::Id("app"))
            .await
            .unwrap()
            .is_displayed()
            .await
            .unwrap()
    );

    // A wrong token is refused on the page.
    token_input.send_keys("not-the-token").await.unwrap();
    click(c, "#sign-in").await;
    eventually(PATIENCE, "the refusal", || async {
        let text = c
            .find(Locator::Id("login-error"))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        text.contains("unauthorized").then_some(())
    })
    .await;

    // Sign in; alice is running.
    let token_input = c.find(Locator::Id("token")).await.unwrap();
    token_input.clear().await.unwrap();
    token_input.send_keys(&node.token).await.unwrap();
    click(c, "#sign-in").await;
    wait_status(c, "alice", "running").await;
    assert_eq!(
        c.find(Locator::Id("token"))
            .await
            .unwrap()
            .prop("value")
            .await
            .unwrap()
            .as_deref(),
        Some(""),
        "the token does not stay in the form"
    );
    // No credential where another page of this origin could read it.
    let found = readable_credentials(c).await;
    assert_eq!(
        found,
        json!({"local": 0, "session": 0, "cookies": ""}),
        "{found}"
    );
    let cookies: Vec<String> = c
        .get_all_cookies()
        .await
        .unwrap()
        .iter()
        .map(|k| k.name().to_owned())
        .collect();
    match mode {
        // The session cookie (HttpOnly: invisible to scripts, above).
        Mode::Host => assert_eq!(cookies, ["berth_session"]),
        // No session while apps share the origin: nothing at all.
        Mode::Path => assert!(cookies.is_empty(), "{cookies:?}"),
    }
    if mode == Mode::Path {
        let shown = eventually(PATIENCE, "the markup user's row", || async {
            let css = format!(r#"#instances tr[data-user="{MARKUP}"] td[data-field="user"]"#);
            c.find(Locator::Css(&css)).await.ok()?.text().await.ok()
        })
        .await;
        assert_eq!(shown, MARKUP, "shown as text");
        let injected = script(
            c,
            "return [document.querySelectorAll('main img').length, window.pwned === undefined]",
        )
        .await;
        assert_eq!(
            injected,
            json!([0, true]),
            "no element, no script from data"
        );
        node.delete(&format!("/users/{}/instance", urlencode(MARKUP)))
            .await;
    }
    let prefix = match mode {
        Mode::Host => "admin-host",
        Mode::Path => "admin-path",
    };
    screenshot(c, &format!("{prefix}-1280.png"), WIDE).await;

    // Stop alice from the page, confirming; the page updates by itself.
    script(c, "window.notReloaded = true; return null").await;
    click_action(c, "alice", "stop").await;
    let question = c
        .wait()
        .for_element(Locator::Id("confirm-text"))
        .await
        .unwrap();
    assert!(question.text().await.unwrap().contains("Stop alice"));
    click(c, "#confirm-ok").await;
    wait_status(c, "alice", "stopped").await;
    assert_eq!(
        script(c, "return window.notReloaded === true").await,
        json!(true)
    );
    assert_eq!(node.status_of("alice").await, "stopped");

    // Start bob from the page.
    let input = c.find(Locator::Id("start-user")).await.unwrap();
    input.send_keys("bob").await.unwrap();
    click(c, "#start-submit").await;
    wait_status(c, "bob", "running").await;
    assert_eq!(node.status_of("bob").await, "running");

    // Hibernate bob from the page, then resume him: the same process.
    let pid = node.main_of("bob").await["pid"].clone();
    click_action(c, "bob", "hibernate").await;
    wait_status(c, "bob", "hibernated").await;
    assert_eq!(node.status_of("bob").await, "hibernated");
    click_action(c, "bob", "resume").await;
    wait_status(c, "bob", "running").await;
    assert_eq!(
        node.main_of("bob").await["pid"],
        pid,
        "resumed, not restarted"
    );

    // bob's log: its last lines, then what it writes next (a restart's
    // new ready line), in the open view.
    click_action(c, "bob", "logs").await;
    let ready_lines = || async {
        let text = c
            .find(Locator::Id("logs-lines"))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        Some(text.matches("berth-demo: http://127.0.0.1:").count())
    };
    eventually(PATIENCE, "bob's log on the page", || async {
        (ready_lines().await? == 1).then_some(())
    })
    .await;
    if mode == Mode::Host {
        click_action(c, "bob", "restart").await;
        click(c, "#confirm-ok").await;
        eventually(PATIENCE, "the restart's line in the open log", || async {
            (ready_lines().await? == 2).then_some(())
        })
        .await;
        wait_status(c, "bob", "running").await;
    }
    screenshot(c, &format!("{prefix}-logs-1280.png"), WIDE).await;
    click(c, "#logs-close").await;

    // Open bob's app through the page's link: a token of bob's.
    click_action(c, "bob", "open").await;
    let link = c
        .wait()
        .for_element(Locator::Id("opener-link"))
        .await
        .unwrap();
    let href = eventually(PATIENCE, "the link", || async {
        link.attr("href")
            .await
            .ok()?
            .filter(|h| h.contains("berth_token="))
    })
    .await;
    let app = match mode {
        Mode::Host => format!("http://bob.{BASE}:{port}/"),
        Mode::Path => format!("{}/u/bob/", node.url),
    };
    assert!(href.starts_with(&format!("{app}?berth_token=")), "{href}");
    assert!(!href.contains(&node.token), "never the admin token");
    let admin_window = c.window().await.unwrap();
    click(c, "#opener-link").await;
    let app_window = eventually(PATIENCE, "the app's window", || async {
        let windows = c.windows().await.ok()?;
        windows.into_iter().find(|w| *w != admin_window)
    })
    .await;
    c.switch_to_window(app_window).await.unwrap();
    eventually(PATIENCE, "bob's app", || async {
        let title = c.title().await.ok()?;
        (title == "berth demo — bob").then_some(())
    })
    .await;
    // The link's token became bob's cookie and left the address bar.
    assert_eq!(c.current_url().await.unwrap().as_str(), app);
    // The app was opened without a handle on the admin's tab.
    assert_eq!(
        script(c, "return window.opener === null").await,
        json!(true)
    );

    if mode == Mode::Host {
        // bob's app posts to the API with the admin's session cookie (its
        // host is same-site: the browser sends it) and without the CSRF
        // token it cannot know: berth refuses, nothing starts.
        let attack = format!(
            "const done = arguments[arguments.length - 1];
             fetch('{origin}/api/v1/users/carol/instance',
                   {{method: 'POST', mode: 'no-cors', credentials: 'include'}})
               .then(() => done('sent'), (e) => done('failed: ' + e));"
        );
        let sent = c.execute_async(&attack, vec![]).await.unwrap();
        assert_eq!(sent, json!("sent"), "the request was made");
        let read = "const done = arguments[arguments.length - 1];
             fetch(ORIGIN + '/api/v1/instances', {credentials: 'include'})
               .then((r) => r.text().then((t) => done('read: ' + t)), (e) => done('blocked'));";
        let read = read.replace("ORIGIN", &format!("'{origin}'"));
        assert_eq!(
            c.execute_async(&read, vec![]).await.unwrap(),
            json!("blocked"),
            "another origin reads nothing"
        );
        assert!(node.main_of("carol").await.is_null(), "carol never started");
    }

    // Back on the admin page, at phone width.
    c.switch_to_window(admin_window).await.unwrap();
    wait_status(c, "bob", "running").await;
    screenshot(c, &format!("{prefix}-phone.png"), PHONE).await;
    let overflow = script(
        c,
        "return document.documentElement.scrollWidth - document.documentElement.clientWidth",
    )
    .await;
    assert_eq!(overflow, json!(0), "nothing wider than a phone");

    // A reload: the session resumes in host mode; in path mode the token
    // was in memory only, so the page asks for it again.
    c.refresh().await.unwrap();
    match mode {
        Mode::Host => wait_status(c, "bob", "running").await,
        Mode::Path => {
            c.wait().for_element(Locator::Id("token")).await.unwrap();
            eventually(PATIENCE, "the sign-in form", || async {
                let form = c.find(Locator::Id("login")).await.ok()?;
                form.is_displayed().await.ok()?.then_some(())
            })
            .await;
            assert!(status_on_page(c, "bob").await.is_none(), "nothing shown");
        }
    }
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_admin_page_in_host_mode() {
    admin_flow(Mode::Host, 0).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_admin_page_in_path_mode() {
    admin_flow(Mode::Path, 1).await;
}

/// `/admin` without credentials: the static page and nothing else; its
/// data comes only from authenticated API calls.
#[tokio::test(flavor = "multi_thread")]
async fn the_admin_page_without_credentials_leaks_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(2, ""));
    let (status, _) = node.post("/users/alice/instance", json!({})).await;
    assert!(status == 201 || status == 200);
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let r = http
        .get(format!("{}/admin", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 308);
    assert_eq!(r.headers()["location"], "admin/");
    let shipped = [
        (
            "/admin/",
            include_str!("../../assets/admin/index.html"),
            "text/html",
        ),
        (
            "/admin/admin.js",
            include_str!("../../assets/admin/admin.js"),
            "text/javascript",
        ),
        (
            "/admin/admin.css",
            include_str!("../../assets/admin/admin.css"),
            "text/css",
        ),
    ];
    for (path, content, mime) in shipped {
        let r = http
            .get(format!("{}{path}", node.url))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        let headers = r.headers().clone();
        assert!(headers["content-type"].to_str().unwrap().starts_with(mime));
        let csp = headers["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("frame-ancestors 'none'") && csp.contains("script-src 'self'"));
        assert_eq!(headers["x-frame-options"], "DENY");
        let body = r.text().await.unwrap();
        assert_eq!(body, content, "{path} is the shipped file, as it is");
        assert!(!body.contains("alice") && !body.contains(&node.token));
    }
    // Every piece of data is behind the API's authentication.
    for path in ["/events", "/instances", "/nodes", "/leases"] {
        let r = http.get(node.api(path)).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path}");
    }
    // A user token is not the admin.
    let bob = node.user_token("bob").await;
    let r = http
        .get(node.api("/events"))
        .bearer_auth(&bob)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
}

/// The event stream: a first snapshot at once, a new one when an instance
/// changes, and at most a fixed number of streams per node.
#[tokio::test(flavor = "multi_thread")]
async fn the_event_stream_is_live_and_bounded() {
    use futures_util::StreamExt;
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(3, ""));
    let open = || async {
        node.http
            .get(node.api("/events"))
            .bearer_auth(&node.token)
            .send()
            .await
            .unwrap()
    };
    let first = open().await;
    assert_eq!(first.status(), 200);
    assert!(
        first.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let mut body = first.bytes_stream();
    let mut buffer = String::new();
    // The next snapshot on the stream.
    let mut next_snapshot = async || -> Value {
        loop {
            if let Some(end) = buffer.find("\n\n") {
                let block: String = buffer.drain(..end + 2).collect();
                if let Some(data) = block
                    .lines()
                    .find_map(|l| l.strip_prefix("data: "))
                    .filter(|_| block.starts_with("event: snapshot"))
                {
                    return serde_json::from_str(data).unwrap();
                }
                continue;
            }
            let chunk = tokio::time::timeout(PATIENCE, body.next())
                .await
                .expect("an event in time")
                .expect("the stream goes on")
                .unwrap();
            buffer.push_str(&String::from_utf8_lossy(&chunk));
        }
    };
    let snapshot = next_snapshot().await;
    assert!(snapshot["now"].as_i64().is_some());
    assert_eq!(snapshot["nodes"].as_array().unwrap().len(), 1);
    assert!(snapshot["instances"].as_array().unwrap().is_empty());

    // A launch shows up on the stream.
    let (status, _) = node.post("/users/dora/instance", json!({})).await;
    assert!(status == 201 || status == 200);
    let seen = loop {
        let s = next_snapshot().await;
        let running = s["instances"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["user"] == "dora" && i["status"] == "running" && i["ready"] == true)
            .cloned();
        if let Some(instance) = running {
            break (s, instance);
        }
    };
    assert_eq!(seen.1["node"], seen.0["node"]);
    assert!(
        seen.0["leases"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l["user"] == "dora")
    );

    // Seven more streams fill the node's eight; a ninth is refused.
    let mut others = Vec::new();
    for _ in 0..7 {
        let r = open().await;
        assert_eq!(r.status(), 200);
        others.push(r);
    }
    let refused = open().await;
    assert_eq!(refused.status(), 503);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"], "capacity_exhausted", "{body}");
    // A closed stream frees its slot.
    drop(others.pop());
    eventually(PATIENCE, "a free slot", || async {
        let r = open().await;
        (r.status() == 200).then_some(())
    })
    .await;
}

/// The text of `user`'s main row's `field` cell on the page.
async fn cell_on_page(c: &Client, user: &str, field: &str) -> Option<String> {
    let css =
        format!(r#"#instances tr[data-user="{user}"][data-role="main"] td[data-field="{field}"]"#);
    c.find(Locator::Css(&css)).await.ok()?.text().await.ok()
}

/// A cluster of two nodes (PostgreSQL, `takeover = "manual"`), the page
/// on the node that does not run alice: it shows both nodes and alice on
/// the other; its stop reaches her there; when her node dies, her lease
/// shows expired, and the page takes it over onto its own node.
#[tokio::test(flavor = "multi_thread")]
async fn the_admin_page_drives_a_cluster() {
    use berth_testkit::PgCluster;
    const SECRET: &str = berth_testkit::TEST_CLUSTER_SECRET;
    tokio::task::spawn_blocking(|| PgCluster::shared().map(|_| ()).map_err(|e| e.to_string()))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("no PostgreSQL for the cluster test: {e}"));
    let db = PgCluster::shared().unwrap().fresh_database().await;
    let root = tempfile::tempdir().unwrap();
    let mut nodes = Vec::new();
    for id in ["node-a", "node-b"] {
        let dir = root.path().join(id);
        let db = db.clone();
        nodes.push(
            tokio::task::spawn_blocking(move || {
                Node::from(
                    support::berth()
                        .node(&dir)
                        .config(&support::cluster_config(
                            &dir,
                            &db,
                            id,
                            SECRET,
                            "takeover = \"manual\"\n",
                            "",
                        ))
                        .start(),
                )
            })
            .await
            .unwrap(),
        );
    }
    let (status, body) = nodes[0].post("/users/alice/instance", json!({})).await;
    assert!(status == 201 || status == 200, "{body}");
    let holder_id = body["instance"]["node"].as_str().unwrap().to_owned();
    let holder = usize::from(holder_id == "node-b");
    let page = 1 - holder;
    let page_id = ["node-a", "node-b"][page];

    let browser = Browser::start().await;
    let c = browser.client();
    c.goto(&format!("{}/admin/", nodes[page].url))
        .await
        .unwrap();
    let input = c.wait().for_element(Locator::Id("token")).await.unwrap();
    input.send_keys(&nodes[page].token).await.unwrap();
    click(c, "#sign-in").await;
    wait_status(c, "alice", "running").await;
    assert_eq!(cell_on_page(c, "alice", "node").await.unwrap(), holder_id);
    let node_rows = c.find_all(Locator::Css("#nodes tbody tr")).await.unwrap();
    assert_eq!(node_rows.len(), 2);

    // Stop from the page: the owner node stops her.
    click_action(c, "alice", "stop").await;
    click(c, "#confirm-ok").await;
    wait_status(c, "alice", "stopped").await;
    assert!(support::instance_pids(&nodes[holder].data_dir, "alice", "main").is_empty());

    // Start from the row: sticky to her node.
    click_action(c, "alice", "start").await;
    wait_status(c, "alice", "running").await;
    assert_eq!(cell_on_page(c, "alice", "node").await.unwrap(), holder_id);

    // Her node dies; her lease runs out and is shown as such.
    nodes[holder].kill9();
    let expired = r#"#leases tr[data-user="alice"].expired button[data-action="takeover"]"#;
    c.wait()
        .at_most(PATIENCE)
        .for_element(Locator::Css(expired))
        .await
        .expect("the expired lease, highlighted, with its takeover");
    screenshot(c, "admin-cluster-1280.png", WIDE).await;
    click(c, expired).await;
    let question = c.find(Locator::Id("confirm-text")).await.unwrap();
    assert!(question.text().await.unwrap().contains(&holder_id));
    click(c, "#confirm-ok").await;
    eventually(PATIENCE, "alice taken over by the page's node", || async {
        let node = cell_on_page(c, "alice", "node").await?;
        let status = status_on_page(c, "alice").await?;
        (node == page_id && status == "running").then_some(())
    })
    .await;
    assert_eq!(
        support::instance_pids(&nodes[page].data_dir, "alice", "main").len(),
        1
    );
    browser.close().await;
}
