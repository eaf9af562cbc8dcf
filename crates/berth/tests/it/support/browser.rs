//! Headless Chromium driven through chromedriver (WebDriver), for the
//! tests that need a real browser: the admin page's, and the attacks of a
//! hostile app on other users' browsers. Included by those test files
//! alone (`#[path]`), so the others do not build it.
//!
//! Test host names `berth.test` and `*.berth.test` resolve to loopback
//! (`--host-resolver-rules`), so host mode runs as it would on a domain.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder};
use serde_json::json;

use crate::support::{eventually, free_port};

const PATIENCE: Duration = Duration::from_secs(60);
/// The base domain the browser resolves to loopback.
pub const BASE: &str = "berth.test";
/// The window size a browser starts with.
pub const WIDE: (u32, u32) = (1280, 900);

/// Finds a program on PATH, or fails the test with what to install.
fn require(program: &str) -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|path| path.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "{program} is missing: the browser tests need Debian's chromium and \
             chromium-driver (apt-get install --no-install-recommends chromium chromium-driver; \
             scripts/test does this)"
        )
    })
}

/// chromedriver and the headless Chromium it drives, with a fresh
/// profile; both end when this is dropped.
pub struct Browser {
    client: Option<Client>,
    driver: Child,
    _profile: tempfile::TempDir,
}

impl Browser {
    pub async fn start() -> Browser {
        let chromium = require("chromium");
        let chromedriver = require("chromedriver");
        let profile = tempfile::tempdir().unwrap();
        let port = free_port();
        // A process group of its own: chromedriver and every Chromium
        // process it starts end together when the test does.
        let driver = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let webdriver = format!("http://127.0.0.1:{port}");
        // The machine's network is closed: every background connection
        // Chromium would make is switched off, and test host names resolve
        // to loopback.
        let args = vec![
            "--headless".to_owned(),
            "--no-sandbox".to_owned(),
            "--disable-gpu".to_owned(),
            "--disable-quic".to_owned(),
            "--no-first-run".to_owned(),
            "--disable-background-networking".to_owned(),
            "--disable-component-update".to_owned(),
            "--disable-sync".to_owned(),
            "--disable-dev-shm-usage".to_owned(),
            "--no-proxy-server".to_owned(),
            format!("--host-resolver-rules=MAP {BASE} 127.0.0.1, MAP *.{BASE} 127.0.0.1"),
            format!("--window-size={},{}", WIDE.0, WIDE.1),
            format!("--user-data-dir={}", profile.path().display()),
        ];
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".into(),
            json!({ "binary": chromium, "args": args }),
        );
        let mut builder =
            ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new());
        builder.capabilities(capabilities);
        // chromedriver needs a moment to listen.
        let client = eventually(PATIENCE, "a WebDriver session", || async {
            builder.connect(&webdriver).await.ok()
        })
        .await;
        Browser {
            client: Some(client),
            driver,
            _profile: profile,
        }
    }

    pub fn client(&self) -> &Client {
        self.client.as_ref().expect("a session")
    }

    /// Ends the WebDriver session (dropping ends the processes anyway).
    pub async fn close(&self) {
        if let Some(client) = self.client.clone() {
            client.close().await.unwrap();
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // The whole group: chromedriver and its Chromium, even when a
        // failed test never closed the session.
        let group = nix::unistd::Pid::from_raw(i32::try_from(self.driver.id()).unwrap());
        let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
        let _ = self.driver.wait();
    }
}
