//! Signing in through a real OpenID provider (npm's `oidc-provider`, run by
//! `support/oidc.rs`) to the real `berth` binary: the refusals, each with
//! its page and status, driven by a plain HTTP user agent; and the whole
//! experience in headless Chromium, in host mode (with the home page, the
//! admin page and logout) and in path mode with JupyterLab from
//! `examples/jupyter.toml` as shipped (its text, with an `[auth.oidc]`
//! table after it).

use crate::support;
use crate::support::browser;
use crate::support::oidc;

use std::path::{Path, PathBuf};
use std::time::Duration;

use browser::{BASE, Browser};
use fantoccini::{Client, Locator};
use oidc::{Agent, OidcClient, OidcProvider, OidcUser, form_action, location};
use reqwest::StatusCode;
use serde_json::Value;
use support::{Node, StartOptions, eventually, free_port};

const PATIENCE: Duration = Duration::from_secs(60);
const CLIENT_ID: &str = "berth";
const CLIENT_SECRET: &str = "the-client-secret-of-berth-in-tests";

/// Where apps live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `/u/<user>/` on `127.0.0.1:<port>`.
    Path,
    /// `<user>.berth.test:<port>`, berth itself on `berth.test:<port>`.
    Host,
}

/// berth with sign-in, and the provider it trusts.
struct Setup {
    node: Node,
    idp: OidcProvider,
    /// The berth host's URL, e.g. `http://berth.test:4000`.
    berth: String,
    port: u16,
    // Dropped last: the node's drop kills instances through files in it.
    _dir: tempfile::TempDir,
}

fn users() -> Vec<OidcUser> {
    vec![
        OidcUser::new("alice", "alice-password")
            .preferred_username("alice")
            .groups(&["staff"]),
        OidcUser::new("bob", "bob-password")
            .preferred_username("bob")
            .groups(&["staff"]),
        OidcUser::new("carol", "carol-password")
            .preferred_username("carol")
            .groups(&["admins"]),
        OidcUser::new("mallory", "mallory-password")
            .preferred_username("mallory")
            .groups(&["visitors"]),
        // Allowed by group, but named by a claim that is no user id.
        OidcUser::new("slash", "slash-password")
            .username("slash")
            .preferred_username("a/b")
            .groups(&["staff"]),
    ]
}

/// The `[instance]` of `tests/programs/upstream.py` on ports of its own.
fn upstream(n: u16) -> String {
    support::upstream_config(
        berth_testkit::port_block_for(&format!("{} {n}", module_path!()), 20),
        "",
        "",
    )
}

/// Starts a provider and berth on `program` (config text with the
/// `[instance]` to run), apps in `mode`.
async fn setup(mode: Mode, program: &str) -> Setup {
    let port = free_port();
    let host = match mode {
        Mode::Path => "127.0.0.1".to_owned(),
        Mode::Host => BASE.to_owned(),
    };
    let berth = format!("http://{host}:{port}");
    let callback = format!("{berth}/login/callback");
    let idp = OidcProvider::start(
        &[OidcClient::new(CLIENT_ID, CLIENT_SECRET, &[&callback])],
        &users(),
    )
    .await;
    let dir = tempfile::Builder::new()
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .tempdir_in("/var/tmp")
        .unwrap();
    let data = dir.path().join("data");
    let proxy = match mode {
        Mode::Path => String::new(),
        Mode::Host => format!("[proxy]\nbase_domain = \"{BASE}\"\n"),
    };
    let config = format!(
        "listen = \"127.0.0.1:{port}\"\ndata_dir = \"{}\"\n{program}\n{proxy}\n\
         [auth.oidc]\nissuer = \"{}\"\nclient_id = \"{CLIENT_ID}\"\n\
         scopes = [\"openid\", \"profile\", \"email\", \"groups\"]\n\
         allowed_groups = [\"staff\"]\nadmin_group = \"admins\"\n\
         redirect_url = \"{callback}\"\n",
        data.display(),
        idp.issuer(),
    );
    let node = Node::from(
        support::berth()
            .node(dir.path())
            .config(&config)
            .options(
                StartOptions {
                    env: vec![(
                        "BERTH_OIDC_CLIENT_SECRET".to_owned(),
                        CLIENT_SECRET.to_owned(),
                    )],
                    ..StartOptions::default()
                }
                .clone(),
            )
            .start(),
    );
    Setup {
        node,
        idp,
        berth,
        port,
        _dir: dir,
    }
}

/// How a sign-in through berth ended: berth's answer to the provider's
/// redirect back (a page, or a redirect onwards), and that redirect's URL.
struct Finished {
    callback: String,
    status: StatusCode,
    location: Option<String>,
    page: String,
}

/// A user agent that resolves the test host names to berth.
fn new_agent(setup: &Setup) -> Agent {
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", setup.port).parse().unwrap();
    let mut builder = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none());
    for host in [
        BASE.to_owned(),
        format!("alice.{BASE}"),
        format!("bob.{BASE}"),
    ] {
        builder = builder.resolve(&host, addr);
    }
    let mut agent = Agent::new();
    agent.http = builder.build().unwrap();
    agent
}

/// Signs in at berth's `/login?next=…` as a browser would, typing
/// `credentials` into the provider's form when it shows one, up to berth's
/// answer to the callback.
async fn sign_in(
    agent: &mut Agent,
    setup: &Setup,
    next: &str,
    credentials: (&str, &str),
) -> Finished {
    let mut url = format!("{}/login?next={next}", setup.berth);
    for _ in 0..12 {
        let response = agent.get(&url).await;
        if url.starts_with(&format!("{}/login/callback", setup.berth)) {
            let status = response.status();
            let location = response
                .status()
                .is_redirection()
                .then(|| location(&response, &url));
            let page = response.text().await.unwrap();
            return Finished {
                callback: url,
                status,
                location,
                page,
            };
        }
        if response.status().is_redirection() {
            url = location(&response, &url);
            continue;
        }
        let status = response.status();
        let page = response.text().await.unwrap();
        assert_eq!(status, StatusCode::OK, "{url}: {page}");
        assert!(
            page.contains(r#"id="password""#),
            "{url}: not a login form: {page}"
        );
        let action = setup.idp.url(form_action(&page));
        let response = agent
            .post_form(
                &action,
                &[("username", credentials.0), ("password", credentials.1)],
            )
            .await;
        assert!(
            response.status().is_redirection(),
            "the provider refused {credentials:?}"
        );
        url = location(&response, &action);
    }
    panic!("more than twelve redirects signing in");
}

/// Asserts a sign-in was refused with `status` and a page saying `why`,
/// and that it left no session behind.
async fn refused(
    agent: &mut Agent,
    setup: &Setup,
    done: &Finished,
    status: u16,
    why: &str,
    what: &str,
) {
    assert_eq!(done.status.as_u16(), status, "{what}: {}", done.page);
    assert!(done.page.contains(why), "{what}: {}", done.page);
    assert!(
        !agent.cookies.contains_key("berth_session"),
        "{what}: a refused sign-in set a session"
    );
    let home = agent.get(&format!("{}/", setup.berth)).await;
    assert_eq!(
        home.status(),
        StatusCode::SEE_OTHER,
        "{what}: the home page needs a sign-in"
    );
}

/// Every way a sign-in can be wrong is refused with its own status and a
/// page that says why, and leaves no session: a tampered signature, a
/// token for another audience or from another issuer, an expired one, a
/// wrong or missing nonce, an unsigned one, one signed by an unknown key,
/// a PKCE verifier the provider refuses, a user outside the allowed list,
/// a claim that is not a user id, and a replayed state.
#[tokio::test(flavor = "multi_thread")]
async fn each_bad_sign_in_is_refused_with_a_clear_page() {
    let setup = setup(Mode::Path, &upstream(0)).await;
    let alice = ("alice", "alice-password");
    for (mode, status, why) in [
        ("bad_signature", 401, "the ID token is not valid"),
        ("wrong_audience", 401, "audiences"),
        ("wrong_issuer", 401, "issuer"),
        ("expired", 401, "xpired"),
        ("wrong_nonce", 401, "nonce"),
        ("missing_nonce", 401, "nonce"),
        ("alg_none", 401, "the ID token is not valid"),
        ("foreign_key", 401, "the ID token is not valid"),
        ("pkce_mismatch", 400, "invalid_grant"),
    ] {
        setup.idp.set_mode(mode).await;
        let mut agent = new_agent(&setup);
        let done = sign_in(&mut agent, &setup, "/", alice).await;
        refused(&mut agent, &setup, &done, status, why, mode).await;
    }
    setup.idp.set_mode("none").await;

    let mut agent = new_agent(&setup);
    let done = sign_in(&mut agent, &setup, "/", ("mallory", "mallory-password")).await;
    refused(
        &mut agent,
        &setup,
        &done,
        403,
        "may not sign in here",
        "mallory",
    )
    .await;

    let mut agent = new_agent(&setup);
    let done = sign_in(&mut agent, &setup, "/", ("slash", "slash-password")).await;
    refused(
        &mut agent,
        &setup,
        &done,
        403,
        "not a valid berth user id",
        "a/b",
    )
    .await;

    // carol is of the admin group, but in path mode every app shares this
    // origin: she gets a user's session, and no admin page.
    let mut carol = new_agent(&setup);
    let done = sign_in(&mut carol, &setup, "/", ("carol", "carol-password")).await;
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.page);
    let admin = carol.get(&format!("{}/admin/", setup.berth)).await;
    assert_eq!(admin.status(), StatusCode::FORBIDDEN);
    assert!(admin.text().await.unwrap().contains("Not an admin"));
    let instances = carol
        .get(&format!("{}/api/v1/instances", setup.berth))
        .await;
    assert_eq!(instances.status(), StatusCode::FORBIDDEN);

    // alice's sign-in works; the same callback again is a replay.
    let mut agent = new_agent(&setup);
    let done = sign_in(&mut agent, &setup, "/", alice).await;
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.page);
    assert_eq!(
        done.location.as_deref(),
        Some(format!("{}/", setup.berth).as_str())
    );
    let mut replayer = new_agent(&setup);
    let replay = replayer.get(&done.callback).await;
    assert_eq!(replay.status(), StatusCode::BAD_REQUEST);
    assert!(
        replay
            .text()
            .await
            .unwrap()
            .contains("already used or has expired")
    );
    assert!(!replayer.cookies.contains_key("berth_session"));
}

/// The client secret, given in berth's environment, is wiped from it once
/// read: a process that may read berth's `/proc/<pid>/environ` does not
/// find it there (the name stays, its value is zeroed), while a sign-in,
/// which needs it, works.
#[tokio::test(flavor = "multi_thread")]
async fn the_client_secret_is_wiped_from_berths_environment() {
    let setup = setup(Mode::Path, &upstream(4)).await;
    let pid = setup.node.pid().unwrap();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let text = String::from_utf8_lossy(&environ);
    assert!(
        !text.contains(CLIENT_SECRET),
        "the secret is in berth's environ"
    );
    let mut agent = new_agent(&setup);
    let done = sign_in(&mut agent, &setup, "/", ("alice", "alice-password")).await;
    assert!(
        done.status.is_redirection(),
        "{}: {}",
        done.status,
        done.page
    );
    assert!(agent.cookies.contains_key("berth_session"));
}

/// A signed-in user keeps their app and their home page while the provider
/// is down; a new sign-in then gets a clear 503. When the provider is back
/// with its keys rotated, berth fetches the new keys and signs people in.
#[tokio::test(flavor = "multi_thread")]
async fn a_provider_that_is_down_stops_new_sign_ins_only() {
    let mut setup = setup(Mode::Path, &upstream(1)).await;
    let mut alice = new_agent(&setup);
    let done = sign_in(
        &mut alice,
        &setup,
        "/u/alice/echo",
        ("alice", "alice-password"),
    )
    .await;
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.page);
    assert_eq!(
        done.location.as_deref(),
        Some(format!("{}/u/alice/echo", setup.berth).as_str())
    );
    let app = format!("{}/u/alice/echo", setup.berth);
    let open = alice.get(&app).await;
    assert_eq!(
        open.status(),
        StatusCode::OK,
        "the app opens with the sign-in's cookie"
    );

    setup.idp.stop().await;
    assert_eq!(alice.get(&app).await.status(), StatusCode::OK);
    assert_eq!(
        alice.get(&format!("{}/", setup.berth)).await.status(),
        StatusCode::OK
    );
    let mut newcomer = new_agent(&setup);
    let login = newcomer.get(&format!("{}/login", setup.berth)).await;
    assert_eq!(login.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(login.text().await.unwrap().contains("cannot be reached"));

    setup.idp.restart().await;
    setup.idp.rotate_keys_retiring_old().await;
    let mut bob = new_agent(&setup);
    let done = sign_in(&mut bob, &setup, "/", ("bob", "bob-password")).await;
    assert_eq!(
        done.status,
        StatusCode::SEE_OTHER,
        "a rotated key is fetched: {}",
        done.page
    );
}

/// Signing out ends the session and every app cookie of the sign-in, on
/// every origin: in host mode the app's own host-only cookie (set through
/// the one-time code) stops working too, and the code is good once.
#[tokio::test(flavor = "multi_thread")]
async fn host_mode_logout_ends_the_app_cookie_too() {
    let setup = setup(Mode::Host, &upstream(2)).await;
    let app = format!("http://alice.{BASE}:{}/echo", setup.port);
    let mut alice = new_agent(&setup);
    let done = sign_in(&mut alice, &setup, &app, ("alice", "alice-password")).await;
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.page);
    let hop = done.location.clone().unwrap();
    assert!(hop.starts_with(&format!("{app}?berth_hop=")), "{hop}");
    let at_app = alice.get(&hop).await;
    assert_eq!(at_app.status(), StatusCode::SEE_OTHER);
    assert_eq!(location(&at_app, &hop), app, "the code became a cookie");
    let cookie = alice
        .cookies
        .get("berth_token")
        .cloned()
        .expect("the app's cookie");
    assert_eq!(alice.get(&app).await.status(), StatusCode::OK);
    // The code was spent.
    let mut thief = new_agent(&setup);
    assert_eq!(thief.get(&hop).await.status(), StatusCode::UNAUTHORIZED);
    // A fresh code of alice's opens nothing on bob's host.
    let mut again = new_agent(&setup);
    let done = sign_in(&mut again, &setup, &app, ("alice", "alice-password")).await;
    let code = done.location.unwrap();
    let code = code.split("berth_hop=").nth(1).unwrap();
    let bobs = format!("http://bob.{BASE}:{}/echo?berth_hop={code}", setup.port);
    assert_eq!(thief.get(&bobs).await.status(), StatusCode::FORBIDDEN);
    assert!(!thief.cookies.contains_key("berth_token"));

    let out = alice
        .post_form(&format!("{}/logout", setup.berth), &[])
        .await;
    assert_eq!(out.status(), StatusCode::OK);
    let http = new_agent(&setup).http;
    let after = http
        .get(&app)
        .header("Cookie", format!("berth_token={cookie}"))
        .header("Accept", "text/html")
        .send()
        .await
        .unwrap();
    assert_eq!(
        after.status(),
        StatusCode::SEE_OTHER,
        "the old cookie is dead: back to sign-in"
    );
    assert!(
        location(&after, &app).starts_with(&format!("http://{BASE}:{}/login?next=", setup.port)),
        "{:?}",
        after.headers()
    );
}

// --- in a browser -------------------------------------------------------------

async fn sign_in_in_browser(c: &Client, user: &str, password: &str) {
    let form = c
        .wait()
        .at_most(PATIENCE)
        .for_element(Locator::Id("password"))
        .await
        .expect("the provider's login form");
    c.find(Locator::Id("username"))
        .await
        .unwrap()
        .send_keys(user)
        .await
        .unwrap();
    form.send_keys(password).await.unwrap();
    click(c, Locator::Id("submit")).await;
}

async fn click(c: &Client, what: Locator<'_>) {
    c.find(what).await.unwrap().click().await.unwrap();
}

/// Moves the focus with Tab until the element `id` has it, then presses
/// Enter: the page works without a pointer.
async fn press_by_keyboard(c: &Client, id: &str) {
    use fantoccini::actions::{InputSource, KeyAction, KeyActions};
    let press = |key: char| {
        KeyActions::new("keyboard".to_owned())
            .then(KeyAction::Down { value: key })
            .then(KeyAction::Up { value: key })
    };
    const TAB: char = '\u{E004}';
    const ENTER: char = '\u{E007}';
    for _ in 0..30 {
        c.perform_actions(press(TAB)).await.unwrap();
        let focused = c.active_element().await.unwrap();
        if focused.attr("id").await.unwrap().as_deref() == Some(id) {
            c.perform_actions(press(ENTER)).await.unwrap();
            return;
        }
    }
    panic!("Tab never reached #{id}");
}

async fn current_path(c: &Client) -> String {
    let url = c.current_url().await.unwrap();
    format!("{}{}", url.host_str().unwrap_or(""), url.path())
}

async fn wait_text(c: &Client, id: &str, wanted: &str) -> String {
    eventually(PATIENCE, &format!("#{id} to say {wanted:?}"), || async {
        let text = c.find(Locator::Id(id)).await.ok()?.text().await.ok()?;
        text.contains(wanted).then_some(text)
    })
    .await
}

fn artifacts() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/test-artifacts");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn screenshot(c: &Client, name: &str) {
    let png = c.screenshot().await.unwrap();
    std::fs::write(artifacts().join(name), png).unwrap();
}

/// Host mode in Chromium: alice signs in with her password and lands in
/// her app on its own host; her home page shows her instance and acts on
/// it; bob reaches only his own app; carol (admin group) reaches the admin
/// page and bob does not; signing out ends alice's app cookie.
#[tokio::test(flavor = "multi_thread")]
async fn host_mode_in_a_browser_sign_in_home_page_admin_and_logout() {
    let setup = setup(Mode::Host, &format!("{}\n", support_demo())).await;
    let app = format!("http://alice.{BASE}:{}/", setup.port);
    let home = format!("{}/", setup.berth);

    let browser = Browser::start().await;
    let c = browser.client();
    c.goto(&app).await.unwrap();
    sign_in_in_browser(c, "alice", "alice-password").await;
    eventually(PATIENCE, "alice's app", || async {
        (c.current_url().await.ok()?.as_str() == app).then_some(())
    })
    .await;
    // The starting page first, then the app itself.
    eventually(PATIENCE, "the demo app's page", || async {
        c.source()
            .await
            .ok()?
            .contains("berth demo app")
            .then_some(())
    })
    .await;

    // The home page: state, actions, log, tokens.
    c.goto(&home).await.unwrap();
    wait_text(c, "who", "signed in as alice").await;
    wait_text(c, "state", "running").await;
    screenshot(c, "home-host-1280.png").await;
    // By keyboard alone: Tab to Hibernate, then Enter.
    press_by_keyboard(c, "hibernate").await;
    wait_text(c, "state", "hibernated").await;
    click(c, Locator::Id("restart")).await;
    wait_text(c, "message", "Restart: done.").await;
    wait_text(c, "state", "running").await;
    click(c, Locator::Css("#mint button")).await;
    let token = eventually(PATIENCE, "a minted token", || async {
        let t = c
            .find(Locator::Id("minted-token"))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        (t.len() == 64).then_some(t)
    })
    .await;
    let (status, _) = setup_request(&setup, &token).await;
    assert_eq!(status, 200, "the minted token works for alice's own status");
    c.set_window_size(390, 844).await.unwrap();
    screenshot(c, "home-host-phone.png").await;
    c.set_window_size(browser::WIDE.0, browser::WIDE.1)
        .await
        .unwrap();

    // bob, in his own browser, reaches his app and not alice's.
    let bob_browser = Browser::start().await;
    let b = bob_browser.client();
    b.goto(&format!("http://bob.{BASE}:{}/", setup.port))
        .await
        .unwrap();
    sign_in_in_browser(b, "bob", "bob-password").await;
    eventually(PATIENCE, "bob's app", || async {
        current_path(b).await.starts_with("bob.").then_some(())
    })
    .await;
    b.goto(&app).await.unwrap();
    let refused = eventually(PATIENCE, "a refusal", || async {
        let s = b.source().await.ok()?;
        s.contains("Not your app").then_some(s)
    })
    .await;
    assert!(refused.contains("signed in as <b>bob</b>"), "{refused}");
    b.goto(&format!("{home}admin/")).await.unwrap();
    let admin_page = b.source().await.unwrap();
    assert!(admin_page.contains("Not an admin"), "{admin_page}");

    // carol, of the admin group, gets the admin page with her session.
    let carol_browser = Browser::start().await;
    let k = carol_browser.client();
    k.goto(&format!("{home}login?next=/admin/")).await.unwrap();
    sign_in_in_browser(k, "carol", "carol-password").await;
    eventually(PATIENCE, "the admin page, signed in", || async {
        let shown = k.find(Locator::Id("app")).await.ok()?;
        shown.is_displayed().await.ok()?.then_some(())
    })
    .await;

    // alice signs out: her app's cookie (host-only on her host) is dead.
    c.goto(&app).await.unwrap();
    let cookie = c
        .get_named_cookie("berth_token")
        .await
        .unwrap()
        .value()
        .to_owned();
    c.goto(&home).await.unwrap();
    wait_text(c, "who", "alice").await;
    click(c, Locator::Css("#sign-out button")).await;
    // Waits for the page's own text: while the browser navigates, its
    // source can be empty, which holds no `who` either.
    let signed_out = eventually(PATIENCE, "the sign-out page", || async {
        let s = c.source().await.ok()?;
        s.contains("You are signed out").then_some(s)
    })
    .await;
    assert!(!signed_out.contains("id=\"who\""), "{signed_out}");
    let after = new_agent(&setup)
        .http
        .get(&app)
        .header("Cookie", format!("berth_token={cookie}"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        after.status(),
        StatusCode::UNAUTHORIZED,
        "the app cookie ended with the sign-in"
    );
    for b in [&browser, &bob_browser, &carol_browser] {
        b.close().await;
    }
}

/// The demo program (`berth demo-app`) of the binary under test, on a
/// port block of its own (the same for every caller, as one config).
fn support_demo() -> String {
    let start = berth_testkit::port_block_for(module_path!(), 20);
    format!(
        "[instance]\ncommand = [\"{}\", \"demo-app\", \"--port\", \"{{port}}\"]\nport_range = [{start}, {}]\n",
        support::BERTH,
        start + 19
    )
}

/// `GET /api/v1/users/alice/instance` with `token` as Bearer.
async fn setup_request(setup: &Setup, token: &str) -> (u16, Value) {
    let r = new_agent(setup)
        .http
        .get(format!("{}/api/v1/users/alice/instance", setup.node.url))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// What a cell prints, run by the signed-in page itself: a kernel started
/// through Jupyter's REST API and an `execute_request` on its WebSocket,
/// both carrying nothing but the browser's own cookies (berth presents
/// Jupyter's token on the way).
const RUN_A_CELL: &str = r#"
const done = arguments[arguments.length - 1];
(async () => {
  const base = '/u/alice/';
  const xsrf = (document.cookie.match(/_xsrf=([^;]+)/) || [])[1] || '';
  const r = await fetch(base + 'api/kernels', {
    method: 'POST', credentials: 'same-origin', body: '{}',
    headers: { 'Content-Type': 'application/json', 'X-XSRFToken': xsrf },
  });
  if (!r.ok) return done('starting a kernel: HTTP ' + r.status);
  const kernel = await r.json();
  const ws = new WebSocket('ws://' + location.host + base + 'api/kernels/' + kernel.id + '/channels');
  const id = 'berth-test-' + Date.now();
  ws.onopen = () => ws.send(JSON.stringify({
    header: { msg_id: id, msg_type: 'execute_request', username: 'alice', session: id,
              version: '5.3', date: new Date().toISOString() },
    parent_header: {}, metadata: {}, channel: 'shell', buffers: [],
    content: { code: 'print(6 * 7)', silent: false, store_history: false,
               user_expressions: {}, allow_stdin: false, stop_on_error: true },
  }));
  ws.onmessage = (e) => {
    const m = JSON.parse(e.data);
    if (m.parent_header && m.parent_header.msg_id === id && m.msg_type === 'stream') done(m.content.text);
  };
  ws.onerror = () => done('the kernel WebSocket failed');
})().catch((e) => done(String(e)));
"#;

/// Path mode in Chromium, with JupyterLab from `examples/jupyter.toml` as
/// shipped: alice signs in with her password, lands in JupyterLab and runs
/// a cell in a kernel, and Jupyter's own login page never shows; bob,
/// signed in, is refused alice's app; alice's sign-out ends her app
/// cookie.
#[tokio::test(flavor = "multi_thread")]
async fn path_mode_in_a_browser_alice_lands_in_jupyterlab_and_runs_a_cell() {
    let shipped = std::fs::read_to_string(support::example("jupyter.toml")).unwrap();
    let setup = setup(Mode::Path, &shipped).await;
    let app = format!("{}/u/alice/", setup.berth);
    let browser = Browser::start().await;
    let c = browser.client();
    c.update_timeouts(fantoccini::wd::TimeoutConfiguration::new(
        Some(Duration::from_secs(120)),
        Some(Duration::from_secs(120)),
        None,
    ))
    .await
    .unwrap();
    c.goto(&app).await.unwrap();
    sign_in_in_browser(c, "alice", "alice-password").await;
    // berth's starting page reloads until Jupyter answers; then the lab.
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    loop {
        let url = c.current_url().await.unwrap();
        assert!(
            !url.path().trim_end_matches('/').ends_with("/login"),
            "Jupyter's own login page showed: {url}"
        );
        if c.find(Locator::Css(".jp-LabShell")).await.is_ok() {
            break;
        }
        if std::time::Instant::now() > deadline {
            panic!(
                "no JupyterLab at {url}: {}",
                c.source().await.unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let url = c.current_url().await.unwrap();
    assert!(url.path().starts_with("/u/alice/lab"), "{url}");
    screenshot(c, "jupyterlab-path-1280.png").await;
    let printed = c.execute_async(RUN_A_CELL, vec![]).await.unwrap();
    assert_eq!(printed.as_str(), Some("42\n"), "{printed}");
    let page = c.source().await.unwrap();
    assert!(
        !page.contains("Password or token"),
        "Jupyter asked to log in"
    );

    // bob signs in and is refused alice's app.
    let bob_browser = Browser::start().await;
    let b = bob_browser.client();
    b.goto(&format!("{}/login?next=/", setup.berth))
        .await
        .unwrap();
    sign_in_in_browser(b, "bob", "bob-password").await;
    wait_text(b, "who", "signed in as bob").await;
    b.goto(&app).await.unwrap();
    let refused = b.source().await.unwrap();
    assert!(refused.contains("Not your app"), "{refused}");

    // alice signs out: her app cookie (Path=/u/alice/) ends with it.
    let cookie = c
        .get_named_cookie("berth_token")
        .await
        .unwrap()
        .value()
        .to_owned();
    c.goto(&format!("{}/", setup.berth)).await.unwrap();
    wait_text(c, "who", "alice").await;
    click(c, Locator::Css("#sign-out button")).await;
    eventually(PATIENCE, "the sign-out page", || async {
        c.source()
            .await
            .ok()?
            .contains("You are signed out")
            .then_some(())
    })
    .await;
    let after = new_agent(&setup)
        .http
        .get(format!("{app}api/status"))
        .header("Cookie", format!("berth_token={cookie}"))
        .send()
        .await
        .unwrap();
    assert_eq!(after.status(), StatusCode::UNAUTHORIZED);
    browser.close().await;
    bob_browser.close().await;
}

/// What a sign-in costs on berth's side when the user's instance already
/// runs and the provider already knows the browser: the time from
/// `/login` to the app's answer, less the time spent waiting on the
/// provider. Printed for BENCHMARKS.md; nothing here is asserted about
/// time.
#[tokio::test(flavor = "multi_thread")]
async fn sign_in_time_is_measured() {
    const ROUNDS: usize = 30;
    let setup = setup(Mode::Path, &upstream(3)).await;
    let app = format!("{}/u/alice/echo", setup.berth);
    // The first sign-in types the password and starts alice's instance.
    let mut warm = new_agent(&setup);
    let done = sign_in(
        &mut warm,
        &setup,
        "/u/alice/echo",
        ("alice", "alice-password"),
    )
    .await;
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.page);
    assert_eq!(warm.get(&app).await.status(), StatusCode::OK);
    let provider_session: Vec<(String, String)> = warm
        .cookies
        .iter()
        .filter(|(name, _)| !name.starts_with("berth_"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let mut totals = Vec::new();
    let mut at_provider = Vec::new();
    for _ in 0..ROUNDS {
        // A browser that is signed in at the provider, not at berth.
        let mut agent = new_agent(&setup);
        agent.cookies.extend(provider_session.iter().cloned());
        let mut url = format!("{}/login?next=/u/alice/echo", setup.berth);
        let mut provider = Duration::ZERO;
        let started = std::time::Instant::now();
        loop {
            let hop = std::time::Instant::now();
            let response = agent.get(&url).await;
            if url.starts_with(setup.idp.issuer()) {
                provider += hop.elapsed();
            }
            if !response.status().is_redirection() {
                assert_eq!(response.status(), StatusCode::OK, "{url}");
                assert_eq!(url, app);
                break;
            }
            url = location(&response, &url);
        }
        totals.push(started.elapsed());
        at_provider.push(provider);
    }
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let berth: Vec<Duration> = totals
        .iter()
        .zip(&at_provider)
        .map(|(t, p)| t.saturating_sub(*p))
        .collect();
    println!(
        "sign-in to a running app, {ROUNDS} rounds: median total {:.1} ms, at the provider {:.1} ms, \
         berth's part {:.1} ms (max {:.1} ms)",
        median(totals).as_secs_f64() * 1000.0,
        median(at_provider).as_secs_f64() * 1000.0,
        median(berth.clone()).as_secs_f64() * 1000.0,
        berth.iter().max().unwrap().as_secs_f64() * 1000.0,
    );
}
