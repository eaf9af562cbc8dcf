//! `berth demo-app` as a real process: the ready line, the page, the
//! WebSocket echo, the streaming endpoints and the test flags.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;

const DEADLINE: Duration = Duration::from_secs(20);

/// A demo app that is killed when the test ends, however it ends.
struct Demo {
    child: Child,
    port: u16,
    lines: Option<mpsc::Receiver<String>>,
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port")
}

fn start(args: &[&str], env: &[(&str, &str)]) -> Demo {
    let port = free_port();
    let mut command = Command::new(env!("CARGO_BIN_EXE_berth"));
    command
        .args(["demo-app", "--port", &port.to_string()])
        .args(args)
        .env_remove("BERTH_EPOCH")
        .env_remove("BERTH_BASE_PATH")
        .env_remove("BERTH_USER")
        .env_remove("BERTH_DEMO_ECHO")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command.spawn().expect("cannot start berth demo-app");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            match line {
                Ok(line) => {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
                Err(_) => break,
            }
        }
    });
    Demo {
        child,
        port,
        lines: Some(rx),
    }
}

impl Demo {
    fn ready_line(&mut self) -> String {
        let rx = self.lines.as_ref().expect("stdout reader");
        rx.recv_timeout(DEADLINE)
            .expect("the demo app printed no ready line")
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "the demo app did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// GETs `url` until the app answers at all (it may not listen yet).
async fn get_when_listening(url: &str) -> reqwest::Response {
    let deadline = Instant::now() + DEADLINE;
    loop {
        match reqwest::get(url).await {
            Ok(response) => return response,
            Err(e) => {
                assert!(Instant::now() < deadline, "{url} never answered: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

fn is_token_line(line: &str, port: u16) -> bool {
    let prefix = format!("berth-demo: http://127.0.0.1:{port}/?token=");
    line.strip_prefix(&prefix).is_some_and(|token| {
        !token.is_empty()
            && token
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    })
}

#[tokio::test]
async fn prints_the_ready_line_and_serves_the_page() {
    let mut demo = start(
        &[],
        &[
            ("BERTH_USER", "alice-<test>"),
            ("BERTH_BASE_PATH", "/u/alice-<test>/"),
            ("BERTH_EPOCH", "4"),
        ],
    );
    let line = demo.ready_line();
    assert!(is_token_line(&line, demo.port), "unexpected line {line:?}");

    // The ready line comes after the listener exists: no retry needed.
    for path in ["/", "/u/alice-<test>/", "/some/deep/path"] {
        let response = reqwest::get(format!("{}{path}", demo.base()))
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{path}");
        let html = response.text().await.unwrap();
        assert!(html.contains("alice-&lt;test&gt;"), "{path}: {html}");
        assert!(html.contains("new WebSocket"), "{path}");
    }
}

#[tokio::test]
async fn websocket_echoes_under_any_prefix() {
    let mut demo = start(&[], &[("BERTH_BASE_PATH", "/u/bob/")]);
    demo.ready_line();
    for path in ["/u/bob/ws", "/ws"] {
        let url = format!("ws://127.0.0.1:{}{path}", demo.port);
        let (mut ws, _) = tokio_tungstenite::connect_async(url.as_str())
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"));
        for text in ["hello", "", "ünïcödé ✓"] {
            ws.send(Message::text(text)).await.unwrap();
            let reply = ws.next().await.expect("an echo").unwrap();
            assert_eq!(reply, Message::text(text));
        }
        let blob = vec![0u8, 1, 2, 255];
        ws.send(Message::binary(blob.clone())).await.unwrap();
        let reply = ws.next().await.expect("an echo").unwrap();
        assert_eq!(reply, Message::binary(blob));
        ws.close(None).await.unwrap();
    }
}

#[tokio::test]
async fn sse_bytes_and_upload_stream() {
    let mut demo = start(&[], &[]);
    demo.ready_line();
    let base = demo.base();

    let response = reqwest::get(format!("{base}/u/x/sse?n=3")).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    let body = response.text().await.unwrap();
    let events: Vec<&str> = body.lines().filter(|l| l.starts_with("data:")).collect();
    assert_eq!(events, ["data: event 0", "data: event 1", "data: event 2"]);

    let n = 300_000;
    let response = reqwest::get(format!("{base}/bytes?n={n}")).await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.headers().get("content-length").is_none());
    assert_eq!(
        response.headers()["transfer-encoding"].to_str().unwrap(),
        "chunked"
    );
    let body = response.bytes().await.unwrap();
    assert_eq!(body.len(), n);
    assert!(body.iter().all(|&b| b == 0));

    let upload = vec![7u8; 123_457];
    let response = reqwest::Client::new()
        .post(format!("{base}/u/x/upload"))
        .body(upload)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let json: serde_json::Value = response.json().await.unwrap();
    assert_eq!(json, serde_json::json!({ "bytes": 123_457 }));
}

/// `…/echo` reports exactly what the program received — here a header the
/// test sent and a variable of its environment — and only when asked for.
#[tokio::test]
async fn echo_reports_headers_and_environment_only_when_enabled() {
    let probe = |demo: &Demo| {
        reqwest::Client::new()
            .get(format!("{}/u/carol/echo?x=1", demo.base()))
            .header("x-probe", "seen-by-the-app")
            .header("x-probe", "twice")
            .send()
    };
    for enable in [
        (vec!["--echo"], vec![]),
        (vec![], vec![("BERTH_DEMO_ECHO", "1")]),
    ] {
        let (args, mut env) = enable;
        env.extend([
            ("BERTH_BASE_PATH", "/u/carol/"),
            ("DEMO_ECHO_PROBE", "env-probe"),
        ]);
        let mut demo = start(&args, &env);
        demo.ready_line();
        let response = probe(&demo).await.unwrap();
        assert_eq!(response.status(), 200, "{args:?} {env:?}");
        let echo: serde_json::Value = response.json().await.unwrap();
        assert_eq!(echo["method"], "GET", "{echo}");
        assert_eq!(echo["uri"], "/u/carol/echo?x=1", "{echo}");
        let probes: Vec<&serde_json::Value> = echo["headers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|h| h[0] == "x-probe")
            .map(|h| &h[1])
            .collect();
        assert_eq!(probes, ["seen-by-the-app", "twice"], "{echo}");
        assert_eq!(echo["env"]["DEMO_ECHO_PROBE"], "env-probe", "{echo}");
        assert_eq!(echo["env"]["BERTH_BASE_PATH"], "/u/carol/", "{echo}");
    }

    // Off by default, and off when the variable says so: the page.
    for env in [vec![], vec![("BERTH_DEMO_ECHO", "0")]] {
        let mut demo = start(&[], &env);
        demo.ready_line();
        let response = probe(&demo).await.unwrap();
        assert_eq!(response.status(), 200);
        let body = response.text().await.unwrap();
        assert!(body.contains("berth demo app"), "{env:?}: {body}");
        assert!(!body.contains("seen-by-the-app"), "{env:?}: {body}");
    }
}

#[test]
fn crash_after_ms_exits_with_the_exit_code() {
    let mut demo = start(&["--crash-after-ms", "200", "--exit-code", "3"], &[]);
    let status = demo.wait_exit();
    assert_eq!(status.code(), Some(3), "{status:?}");
}

#[tokio::test]
async fn never_ready_answers_503_and_prints_nothing() {
    let mut demo = start(&["--never-ready"], &[]);
    let response = get_when_listening(&format!("{}/", demo.base())).await;
    assert_eq!(response.status(), 503);
    // A ready app prints its line before it serves anything, so once a
    // request was answered, an empty stdout means no line will come.
    demo.child.kill().unwrap();
    demo.child.wait().unwrap();
    let rx = demo.lines.take().expect("stdout reader");
    let printed: Vec<String> = rx.iter().collect();
    assert!(printed.is_empty(), "printed {printed:?}");
}

#[test]
fn journal_appends_epoch_and_counter() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal.txt");
    std::fs::write(&journal, "old line\n").unwrap();
    let _demo = start(
        &["--journal", journal.to_str().unwrap()],
        &[("BERTH_EPOCH", "7")],
    );
    let lines = wait_for_lines(&journal, 3);
    assert_eq!(lines[..3], ["old line", "7 1", "7 2"]);
}

/// With `--journal-on-term`, SIGTERM appends one more line, then the app
/// exits 0; without it, SIGTERM ends the app with no line (the default
/// action), so the fencing tests can tell the handler ran.
#[test]
fn journal_on_term_writes_a_last_line() {
    let dir = tempfile::tempdir().unwrap();
    for (flag, last) in [(true, Some(0)), (false, None)] {
        let journal = dir.path().join(format!("journal-{flag}.txt"));
        let path = journal.to_str().unwrap();
        let mut args = vec!["--journal", path];
        if flag {
            args.push("--journal-on-term");
        }
        let mut demo = start(&args, &[("BERTH_EPOCH", "4")]);
        let before = wait_for_lines(&journal, 1);
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(demo.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let status = demo.child.wait().unwrap();
        assert_eq!(status.code(), last, "{status:?}");
        let after = wait_for_lines(&journal, before.len());
        if flag {
            // At least the handler's line (a tick may have come first), and
            // the counter goes on.
            assert!(after.len() > before.len(), "{after:?}");
            assert_eq!(after.last().unwrap(), &format!("4 {}", after.len()));
        }
    }
}

fn wait_for_lines(path: &Path, n: usize) -> Vec<String> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let mut text = String::new();
        if let Ok(mut file) = std::fs::File::open(path) {
            let _ = file.read_to_string(&mut text);
        }
        // Only whole lines count: the last one may still be being written.
        let complete: Vec<String> = text
            .split_inclusive('\n')
            .filter(|l| l.ends_with('\n'))
            .map(|l| l.trim_end().to_owned())
            .collect();
        if complete.len() >= n {
            return complete;
        }
        assert!(Instant::now() < deadline, "journal has only {complete:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
