//! A real OpenID Provider for the login tests: npm's `oidc-provider` run by
//! Node.js (`support/oidc_provider.mjs`), with the clients and users a
//! test gives, login pages that check passwords, and test-only controls to
//! rotate its signing keys and to tamper with its ID tokens. Included by
//! the test files that need it (`#[path]`), so the others do not build it.
//!
//! Needs `node` on PATH and oidc-provider installed where
//! `BERTH_TEST_NODE_MODULES` says (`scripts/test` installs it into
//! `target/test-node` and says so), or else in `target/test-node` next to
//! this build; without them the tests fail, saying so.
//!
//! The provider's login page (`/interaction/<uid>`) has a form with
//! `#username`, `#password` and `#submit`; a wrong password answers 401
//! with the form again and `#error`. Consent is granted without a page.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use reqwest::{Url, header};
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::support::{alive, eventually, free_port};

const PATIENCE: Duration = Duration::from_secs(60);
const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/it/support/oidc_provider.mjs"
);

/// The ways the provider's token endpoint can be told to answer wrongly
/// ([`OidcProvider::set_mode`]); `none` answers rightly.
pub const TAMPER_MODES: [&str; 10] = [
    "none",
    // The ID token's signature with bytes flipped.
    "bad_signature",
    // Validly signed by the provider's current key, with one claim wrong:
    // `aud` another client's, `iss` another provider's, `exp` and `iat`
    // more than an hour ago, `nonce` not the client's, or no `nonce`.
    "wrong_audience",
    "wrong_issuer",
    "expired",
    "wrong_nonce",
    "missing_nonce",
    // Unsigned: header `alg` "none" and an empty signature.
    "alg_none",
    // Signed by a key the provider's JWKS does not publish (its own kid).
    "foreign_key",
    // The token request's `code_verifier` altered on its way in, so the
    // provider itself refuses the code: `invalid_grant`.
    "pkce_mismatch",
];

/// A confidential client of the provider (response type `code`, PKCE S256
/// required). It authenticates with `client_secret_basic` unless
/// `token_endpoint_auth_method` says `client_secret_post`.
#[derive(Clone, Debug, Serialize)]
pub struct OidcClient {
    pub client_id: String,
    pub client_secret: String,
    pub redirect_uris: Vec<String>,
    /// Any other client metadata (`post_logout_redirect_uris`,
    /// `token_endpoint_auth_method`, …), passed on as it is.
    #[serde(flatten)]
    pub metadata: Map<String, Value>,
}

impl OidcClient {
    pub fn new(client_id: &str, client_secret: &str, redirect_uris: &[&str]) -> OidcClient {
        OidcClient {
            client_id: client_id.to_owned(),
            client_secret: client_secret.to_owned(),
            redirect_uris: redirect_uris.iter().map(|&uri| uri.to_owned()).collect(),
            metadata: Map::new(),
        }
    }

    /// Sets one more client metadata field.
    pub fn with(mut self, field: &str, value: Value) -> OidcClient {
        self.metadata.insert(field.to_owned(), value);
        self
    }
}

/// A user of the provider: signs in as `username`, else
/// `preferred_username`, else `sub`, with `password`; every other field
/// is a claim, in the ID token when its scope is granted (`email`:
/// `email`, `email_verified`; `profile`: `name`, `preferred_username`;
/// `groups`: `groups`).
#[derive(Clone, Debug, Serialize)]
pub struct OidcUser {
    pub sub: String,
    pub password: String,
    #[serde(flatten)]
    pub claims: Map<String, Value>,
}

impl OidcUser {
    pub fn new(sub: &str, password: &str) -> OidcUser {
        OidcUser {
            sub: sub.to_owned(),
            password: password.to_owned(),
            claims: Map::new(),
        }
    }

    /// The name typed into the login form, when it is neither
    /// `preferred_username` nor `sub`.
    pub fn username(self, name: &str) -> OidcUser {
        self.claim("username", json!(name))
    }

    pub fn email(self, email: &str) -> OidcUser {
        self.claim("email", json!(email))
    }

    pub fn preferred_username(self, name: &str) -> OidcUser {
        self.claim("preferred_username", json!(name))
    }

    pub fn groups(self, groups: &[&str]) -> OidcUser {
        self.claim("groups", json!(groups))
    }

    pub fn claim(mut self, name: &str, value: Value) -> OidcUser {
        self.claims.insert(name.to_owned(), value);
        self
    }
}

/// oidc-provider's folder of node modules: `BERTH_TEST_NODE_MODULES`,
/// else `target/test-node/node_modules` of this build.
fn node_modules() -> PathBuf {
    let dir = match std::env::var_os("BERTH_TEST_NODE_MODULES") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_TARGET_TMPDIR"))
            .parent()
            .expect("the target dir")
            .join("test-node/node_modules"),
    };
    assert!(
        dir.join("oidc-provider/package.json").is_file(),
        "oidc-provider is not installed in {}: the OpenID Connect tests run npm's oidc-provider; \
         run scripts/test (it installs it into target/test-node), or set BERTH_TEST_NODE_MODULES \
         to a node_modules folder that holds it",
        dir.display()
    );
    dir
}

/// `node` on PATH, or fails the test with what to install.
fn node() -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("node"))
            .find(|path| path.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "node is missing: the OpenID Connect tests run oidc-provider under Node.js \
             (apt-get install nodejs npm; scripts/test does this)"
        )
    })
}

/// A running oidc-provider on a loopback port of its own, issuer
/// `http://127.0.0.1:<port>`. Dropping it kills it.
pub struct OidcProvider {
    child: Option<Child>,
    port: u16,
    issuer: String,
    /// What `oidc_provider.mjs` reads from its config file.
    config: Value,
    /// The config file, the private keys (kept across restarts) and the
    /// provider's stderr.
    dir: tempfile::TempDir,
    http: reqwest::Client,
}

impl OidcProvider {
    /// Starts a provider with these clients and users and a fresh RS256
    /// signing key.
    pub async fn start(clients: &[OidcClient], users: &[OidcUser]) -> OidcProvider {
        OidcProvider::start_with_keys(clients, users, None).await
    }

    /// [`OidcProvider::start`] signing with the first key of `jwks`, a
    /// private RS256 JWK set (`{"keys": [...]}`), when given.
    pub async fn start_with_keys(
        clients: &[OidcClient],
        users: &[OidcUser],
        jwks: Option<Value>,
    ) -> OidcProvider {
        let mut config = json!({ "clients": clients, "users": users });
        if let Some(jwks) = jwks {
            config["jwks"] = jwks;
        }
        let dir = tempfile::tempdir().expect("a temporary directory");
        config["keys_file"] = json!(dir.path().join("keys.json"));
        let mut provider = OidcProvider {
            child: None,
            port: 0,
            issuer: String::new(),
            config,
            dir,
            http: reqwest::Client::new(),
        };
        // Another process may take the free port before node binds it:
        // then try another.
        for _ in 0..5 {
            provider.port = free_port();
            provider.issuer = format!("http://127.0.0.1:{}", provider.port);
            provider.config["port"] = json!(provider.port);
            provider.config["issuer"] = json!(provider.issuer);
            provider.write_config();
            match provider.spawn().await {
                Ok(()) => return provider,
                Err(log) if log.contains("EADDRINUSE") => continue,
                Err(log) => panic!("oidc-provider did not start:\n{log}"),
            }
        }
        panic!("oidc-provider found no free port in five tries");
    }

    fn write_config(&self) {
        std::fs::write(self.dir.path().join("config.json"), self.config.to_string())
            .expect("the provider's config is written");
    }

    /// Runs node on the config file until it says it listens; else what
    /// it wrote to stderr.
    async fn spawn(&mut self) -> Result<(), String> {
        let log_path = self.dir.path().join("provider.log");
        let log = std::fs::File::create(&log_path).expect("the provider's log");
        let mut child = Command::new(node())
            .arg(SCRIPT)
            .arg(self.dir.path().join("config.json"))
            .env("BERTH_TEST_NODE_MODULES", node_modules())
            // A process group of its own, so dropping this ends whatever
            // node started too.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("node starts");
        let stdout = child.stdout.take().expect("a piped stdout");
        let (ready, listening) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let mut ready = Some(ready);
            // Keep draining stdout afterwards so node never blocks on a
            // full pipe.
            for line in lines.by_ref().map_while(Result::ok) {
                if let Some(url) = line.strip_prefix("oidc-provider listening on ")
                    && let Some(ready) = ready.take()
                {
                    let _ = ready.send(url.trim().to_owned());
                }
            }
        });
        self.child = Some(child);
        match tokio::time::timeout(PATIENCE, listening).await {
            Ok(Ok(url)) => {
                assert_eq!(url, self.issuer, "the provider's issuer");
                Ok(())
            }
            // stdout closed: node exited.
            Ok(Err(_)) => {
                self.reap().await;
                Err(std::fs::read_to_string(&log_path).unwrap_or_default())
            }
            Err(_) => panic!(
                "oidc-provider did not say it listens within {PATIENCE:?}:\n{}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            ),
        }
    }

    /// Waits until node has exited, and reaps it.
    async fn reap(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = u64::from(child.id());
        eventually(PATIENCE, "oidc-provider to exit", || async move {
            (!alive(pid)).then_some(())
        })
        .await;
        let _ = child.wait();
    }

    /// `http://127.0.0.1:<port>`, also the base of every endpoint.
    pub fn issuer(&self) -> &str {
        &self.issuer
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of `path` (which starts with `/`) on the provider.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.issuer)
    }

    /// The discovery document's URL.
    pub fn discovery_url(&self) -> String {
        self.url("/.well-known/openid-configuration")
    }

    /// Whether node runs.
    pub fn is_running(&self) -> bool {
        self.child
            .as_ref()
            .is_some_and(|child| alive(u64::from(child.id())))
    }

    async fn control(&self, path: &str, body: Value) -> Value {
        let response = self
            .http
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path} to oidc-provider: {e}"));
        let status = response.status();
        let body: Value = response.json().await.expect("a JSON answer");
        assert!(status.is_success(), "POST {path}: {status} {body}");
        body
    }

    /// Makes the token endpoint answer in `mode` (one of [`TAMPER_MODES`])
    /// until told otherwise; `none` answers rightly again.
    pub async fn set_mode(&self, mode: &str) {
        let answer = self.control("/__test/mode", json!({ "mode": mode })).await;
        assert_eq!(answer["mode"], mode);
    }

    /// The tamper mode in force.
    pub async fn mode(&self) -> String {
        let answer: Value = self
            .http
            .get(self.url("/__test/mode"))
            .send()
            .await
            .expect("GET /__test/mode")
            .json()
            .await
            .expect("a JSON answer");
        answer["mode"].as_str().expect("a mode").to_owned()
    }

    /// A new RS256 key (a new kid) signs from now on; the previous keys
    /// stay published in the JWKS. Answers the new kid. Sessions, codes
    /// and grants carry over.
    pub async fn rotate_keys(&self) -> String {
        let answer = self
            .control("/__test/rotate", json!({ "keep_old": true }))
            .await;
        answer["kid"].as_str().expect("a kid").to_owned()
    }

    /// [`OidcProvider::rotate_keys`] that also stops publishing the
    /// previous keys, so what they signed no longer verifies.
    pub async fn rotate_keys_retiring_old(&self) -> String {
        let answer = self
            .control("/__test/rotate", json!({ "keep_old": false }))
            .await;
        answer["kid"].as_str().expect("a kid").to_owned()
    }

    /// Replaces the users (the next sign-in and the next token see the new
    /// claims and passwords), also for a restarted provider.
    pub async fn set_users(&mut self, users: &[OidcUser]) {
        self.control("/__test/users", json!(users)).await;
        self.config["users"] = json!(users);
        self.write_config();
    }

    /// Whether `jwt`'s signature verifies against the published JWKS (its
    /// claims are not looked at): `{"valid": bool, "kid", "error"}`.
    pub async fn verify_signature(&self, jwt: &str) -> Value {
        self.control("/__test/verify", json!({ "jwt": jwt })).await
    }

    /// Stops the provider (SIGTERM, then waits until it has exited): its
    /// port refuses connections until [`OidcProvider::restart`].
    pub async fn stop(&mut self) {
        if let Some(child) = &self.child {
            crate::support::signal(child.id(), nix::sys::signal::Signal::SIGTERM);
        }
        self.reap().await;
    }

    /// Starts the provider again (stopping it first if it runs) on the same
    /// port, with the same clients and the same keys, rotated ones
    /// included, and the users it had; it starts with no sessions, codes or
    /// tokens, in mode `none`.
    pub async fn restart(&mut self) {
        self.stop().await;
        if let Err(log) = self.spawn().await {
            panic!("oidc-provider did not start again:\n{log}");
        }
    }
}

impl Drop for OidcProvider {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let group = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
        let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
        let _ = child.wait();
        // A test that failed while the provider ran shows what it said (one
        // that failed to start it has shown that already).
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.dir.path().join("provider.log"));
            eprintln!("oidc-provider's log:\n{}", log.unwrap_or_default());
        }
    }
}

/// A user agent: follows no redirect by itself and keeps cookies by name
/// (the provider's cookies are few and their paths do not overlap in a
/// way that matters here).
pub struct Agent {
    pub http: reqwest::Client,
    pub cookies: BTreeMap<String, String>,
}

impl Agent {
    pub fn new() -> Agent {
        Agent {
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
            cookies: BTreeMap::new(),
        }
    }

    pub fn cookie_header(&self) -> String {
        let pairs: Vec<String> = self
            .cookies
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        pairs.join("; ")
    }

    pub fn remember(&mut self, response: &reqwest::Response) {
        for set in response.headers().get_all(header::SET_COOKIE) {
            let set = set.to_str().unwrap();
            let (pair, attributes) = set.split_once(';').unwrap_or((set, ""));
            let (name, value) = pair.split_once('=').unwrap();
            let attributes = attributes.to_ascii_lowercase();
            // The provider clears a cookie with an empty value that
            // expired in 1970.
            if value.is_empty() || attributes.contains("expires=thu, 01 jan 1970") {
                self.cookies.remove(name.trim());
            } else {
                self.cookies
                    .insert(name.trim().to_owned(), value.to_owned());
            }
        }
    }

    pub async fn get(&mut self, url: &str) -> reqwest::Response {
        let response = self
            .http
            .get(url)
            .header(header::COOKIE, self.cookie_header())
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        self.remember(&response);
        response
    }

    pub async fn post_form(&mut self, url: &str, form: &[(&str, &str)]) -> reqwest::Response {
        let response = self
            .http
            .post(url)
            .header(header::COOKIE, self.cookie_header())
            .form(form)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {url}: {e}"));
        self.remember(&response);
        response
    }
}

/// The `Location` of a redirect, made absolute against `base`.
pub fn location(response: &reqwest::Response, base: &str) -> String {
    let location = response
        .headers()
        .get(header::LOCATION)
        .expect("a Location")
        .to_str()
        .unwrap();
    Url::parse(base)
        .unwrap()
        .join(location)
        .unwrap()
        .to_string()
}

/// The login form's `action` on the provider's login page.
pub fn form_action(page: &str) -> &str {
    let start = page.find(r#"action=""#).expect("a form") + r#"action=""#.len();
    let end = start + page[start..].find('"').unwrap();
    &page[start..end]
}
