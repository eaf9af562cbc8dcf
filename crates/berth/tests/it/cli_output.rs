//! What the client commands print, run as a person or a script would: the
//! `--json` output of the listing commands against the fields README.md
//! documents (read from README itself, so the two cannot drift), plain
//! tables when the output is not a terminal, colour and progress on one
//! (a pseudo-terminal made by util-linux's `script`), and `berth serve
//! --log-format json`.

use crate::support;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use support::{BERTH, Node, StartOptions, eventually};

const PATIENCE: Duration = Duration::from_secs(60);

fn ports(n: u16) -> String {
    let start = berth_testkit::port_block_for(&format!("{} {n}", module_path!()), 20);
    format!("[instance]\nport_range = [{start}, {}]\n", start + 19)
}

fn stdout_of(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// One documented listing: the command's words, the answer's list field,
/// and each element's fields.
#[derive(Debug)]
struct Documented {
    args: Vec<String>,
    list: String,
    fields: BTreeSet<String>,
}

/// The `--json` listings README.md documents between its `cli-json`
/// markers: "- `berth ARGS --json`: `{"LIST": [...]}`, each … with
/// `field`, `field`, …".
fn documented() -> Vec<Documented> {
    let readme = include_str!("../../../../README.md");
    let start = readme
        .find("<!-- cli-json")
        .expect("README documents the --json listings");
    let end = readme[start..].find("<!-- /cli-json -->").unwrap() + start;
    readme[start..end]
        .lines()
        .filter_map(|line| line.strip_prefix("- `berth "))
        .map(|line| {
            let (command, rest) = line.split_once('`').unwrap();
            let args = command
                .split_whitespace()
                .map(|w| if w == "USER" { "alice" } else { w }.to_owned())
                .collect();
            let (shape, fields) = rest.split_once(" with ").unwrap();
            // The list is the quoted name followed by `: [`.
            let quoted: Vec<&str> = shape.split('"').collect();
            let list = quoted
                .windows(2)
                .find(|w| w[1].starts_with(": ["))
                .map(|w| w[0].to_owned())
                .unwrap();
            let fields = fields
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_owned)
                .collect();
            Documented { args, list, fields }
        })
        .collect()
}

fn keys(object: &Value) -> BTreeSet<String> {
    object
        .as_object()
        .expect("an object")
        .keys()
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_listings_json_is_what_readme_documents() {
    let docs = documented();
    let names: Vec<String> = docs.iter().map(|d| d.args.join(" ")).collect();
    assert_eq!(
        names,
        [
            "ls --json",
            "nodes --json",
            "leases --json",
            "token alice --list --json"
        ],
        "README lists these four"
    );
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &ports(0));
    let started = stdout_of(&node.cli(&["start", "alice", "--json"]));
    let started: Value = serde_json::from_str(&started).unwrap();
    assert_eq!(started["instance"]["status"], "running", "{started}");
    node.user_token("alice").await;

    for doc in &docs {
        let args: Vec<&str> = doc.args.iter().map(String::as_str).collect();
        let out = stdout_of(&node.cli(&args));
        let answer: Value = serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("berth {args:?} printed no JSON ({e}): {out}"));
        let items = answer[&doc.list]
            .as_array()
            .unwrap_or_else(|| panic!("{args:?}: no {:?} list in {answer}", doc.list));
        assert!(!items.is_empty(), "{args:?}: {answer}");
        for item in items {
            assert_eq!(keys(item), doc.fields, "{args:?}: {item}");
        }
    }
    // The token list also names its user, as documented.
    let tokens: Value = serde_json::from_str(&stdout_of(
        &node.cli(&["token", "alice", "--list", "--json"]),
    ))
    .unwrap();
    assert_eq!(tokens["user"], "alice");

    // The other commands' --json is the API's answer (or the documented
    // stand-in for an empty one).
    let status: Value =
        serde_json::from_str(&stdout_of(&node.cli(&["status", "alice", "--json"]))).unwrap();
    // `egress` where berth guards the instance: as root, at level user.
    let mut expected: BTreeSet<String> = ["breaker", "idle_action", "main", "user", "watchdog"]
        .map(str::to_owned)
        .into();
    if nix::unistd::geteuid().is_root() {
        expected.insert("egress".to_owned());
    }
    assert_eq!(keys(&status), expected);
    let logs: Value =
        serde_json::from_str(&stdout_of(&node.cli(&["logs", "alice", "--json"]))).unwrap();
    assert!(
        logs["lines"][0]
            .as_str()
            .unwrap()
            .starts_with("berth-demo:")
    );
    let stopped: Value =
        serde_json::from_str(&stdout_of(&node.cli(&["stop", "alice", "--json"]))).unwrap();
    assert_eq!(stopped, json!({"user": "alice", "stopped": true}));
    let config = dir.path().join("berth.toml");
    let checked: Value = serde_json::from_str(&stdout_of(
        &Command::new(BERTH)
            .args(["config", "check", "--json"])
            .arg(&config)
            .output()
            .unwrap(),
    ))
    .unwrap();
    assert_eq!(checked["ok"], true, "{checked}");
    let broken = dir.path().join("broken.toml");
    std::fs::write(&broken, "listen = \"nowhere\"\n").unwrap();
    let out = Command::new(BERTH)
        .args(["config", "check", "--json"])
        .arg(&broken)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let refused: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(refused["ok"], false);
    assert!(
        refused["error"].as_str().unwrap().contains("listen"),
        "{refused}"
    );
}

/// Runs `berth ARGS` on a pseudo-terminal (util-linux `script`, part of
/// every Debian system) against `node`; what the terminal showed.
fn on_a_terminal(node: &Node, args: &str, env: &[(&str, &str)]) -> String {
    let out = Command::new("script")
        .args(["-q", "-e", "-c", &format!("{BERTH} {args}"), "/dev/null"])
        .env("BERTH_URL", &node.url)
        .env("BERTH_DATA_DIR", &node.data_dir)
        .env_remove("BERTH_TOKEN")
        .env_remove("NO_COLOR")
        .env("TERM", "xterm")
        .envs(env.iter().copied())
        .output()
        .expect("script runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    text
}

#[tokio::test(flavor = "multi_thread")]
async fn tables_are_plain_in_a_pipe_and_coloured_on_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &ports(1));
    stdout_of(&node.cli(&["start", "alice"]));

    // In a pipe: aligned columns, no escape codes.
    let listed = stdout_of(&node.cli(&["ls"]));
    assert!(!listed.contains('\x1b'), "{listed:?}");
    let mut lines = listed.lines();
    let header = lines.next().unwrap();
    assert!(
        header.starts_with("USER   ROLE  STATUS   READY"),
        "{listed}"
    );
    let row = lines.next().unwrap();
    assert!(row.starts_with("alice  main  running  true"), "{listed}");
    let leases = stdout_of(&node.cli(&["leases"]));
    assert!(leases.starts_with("USER   HOLDER"), "{leases}");

    // On a terminal: the status is green.
    let shown = on_a_terminal(&node, "ls", &[]);
    assert!(shown.contains("\x1b[32mrunning"), "{shown:?}");
    // NO_COLOR turns colour off, even there.
    let shown = on_a_terminal(&node, "ls", &[("NO_COLOR", "1")]);
    assert!(!shown.contains('\x1b'), "{shown:?}");
    assert!(shown.contains("alice  main  running"), "{shown:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn long_waits_show_progress_only_on_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &ports(2));

    // On a terminal, the progress line, erased before the answer.
    let shown = on_a_terminal(&node, "start bob", &[]);
    assert!(shown.contains("starting bob… "), "{shown:?}");
    assert!(shown.contains("\r\x1b[2Kbob started: "), "{shown:?}");
    let shown = on_a_terminal(&node, "restart-all", &[]);
    assert!(shown.contains("restarting every instance… "), "{shown:?}");
    assert!(shown.contains("1 restarted, 0 failed"), "{shown:?}");

    // In a pipe, the answer alone.
    let out = node.cli(&["start", "carol"]);
    let stdout = stdout_of(&out);
    assert!(stdout.starts_with("carol started: running on "), "{stdout}");
    // Without a sign-in page, how to get a link that opens the app.
    assert!(
        stdout.contains("\nopen: run `berth open carol` for a link"),
        "{stdout}"
    );
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--log-format json`: every line berth logs is one JSON object.
#[tokio::test(flavor = "multi_thread")]
async fn serve_logs_json_lines_with_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::write(
        dir.path().join("berth.toml"),
        support::config_with(&data, &ports(3)),
    )
    .unwrap();
    let log = dir.path().join("stderr.log");
    let node = Node::from(
        support::berth()
            .node(dir.path())
            .args(
                &[
                    "serve",
                    "--config",
                    dir.path().join("berth.toml").to_str().unwrap(),
                    "--log-format",
                    "json",
                ],
                &data,
            )
            .options(
                StartOptions {
                    stderr: Some(log.clone()),
                    ..StartOptions::default()
                }
                .clone(),
            )
            .start(),
    );
    stdout_of(&node.cli(&["start", "alice"]));
    let lines = eventually(PATIENCE, "berth's log", || async {
        let text = std::fs::read_to_string(&log).ok()?;
        text.contains("berth listening").then_some(text)
    })
    .await;
    let mut messages = Vec::new();
    for line in lines.lines() {
        let object: Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        assert!(object["timestamp"].is_string(), "{line}");
        assert!(object["level"].is_string(), "{line}");
        messages.push(
            object["fields"]["message"]
                .as_str()
                .unwrap_or("")
                .to_owned(),
        );
    }
    assert!(
        messages.iter().any(|m| m == "berth listening"),
        "{messages:?}"
    );
    // A bad format is refused before anything starts, naming the choices.
    let out = Command::new(BERTH)
        .args(["serve", "--log-format", "xml"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("xml") && err.contains("json"), "{err}");
}

/// `berth open USER` prints a short-lived link that opens the user's app,
/// and hands it to the desktop's browser where there is a display.
#[tokio::test(flavor = "multi_thread")]
async fn berth_open_prints_a_link_that_opens_the_app_and_hands_it_to_the_desktop() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &ports(9));
    let printed = stdout_of(&node.cli(&["open", "alice", "--no-browser"]));
    let link = printed
        .lines()
        .find_map(|l| l.strip_prefix("open: "))
        .unwrap_or_else(|| panic!("no link in {printed:?}"))
        .to_owned();
    assert!(link.contains("/u/alice/?berth_token="), "{link}");
    assert!(printed.contains("good until"), "{printed}");
    // The link becomes alice's cookie, and the cookie opens her app.
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let hop = http.get(&link).send().await.unwrap();
    assert_eq!(hop.status(), 303);
    let cookie = hop.headers()["set-cookie"].to_str().unwrap().to_owned();
    let pair = cookie.split(';').next().unwrap();
    let app = http
        .get(format!("{}/u/alice/", node.url))
        .header("Cookie", pair)
        .send()
        .await
        .unwrap();
    assert_eq!(app.status(), 200);

    // With a display, the link goes to xdg-open (here a stand-in that
    // writes down what it was given).
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let seen = dir.path().join("opened");
    let opener = bin.join("xdg-open");
    std::fs::write(
        &opener,
        format!("#!/bin/sh\nprintf '%s' \"$1\" > {}\n", seen.display()),
    )
    .unwrap();
    std::fs::set_permissions(&opener, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let out = std::process::Command::new(BERTH)
        .args(["open", "alice"])
        .env("BERTH_URL", &node.url)
        .env("BERTH_DATA_DIR", &node.data_dir)
        .env_remove("BERTH_TOKEN")
        .env("DISPLAY", ":99")
        .env("PATH", path)
        .output()
        .unwrap();
    let printed = stdout_of(&out);
    let link = printed
        .lines()
        .find_map(|l| l.strip_prefix("open: "))
        .unwrap()
        .to_owned();
    let opened = eventually(PATIENCE, "xdg-open to be given the link", || async {
        std::fs::read_to_string(&seen)
            .ok()
            .filter(|s| !s.is_empty())
    })
    .await;
    assert_eq!(opened, link);
}
