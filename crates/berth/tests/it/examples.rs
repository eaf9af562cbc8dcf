//! The shipped `examples/` serve through berth exactly as shipped: each
//! file is loaded as it is (only `--listen` and `--data-dir` are given on
//! the command line), with berth running as root (so instances run at the
//! default level `user`, under accounts of their own) and as an
//! unprivileged user (level `none`).
//!
//! One test runs them one after the other: the examples share a port
//! range, and berths started at once would hand out the same first port.
//! `dsh.toml` names the original system's program, which is not available
//! to install; `tests/config.rs` checks that preset instead.

use crate::support;

use std::time::Duration;

use serde_json::json;
use support::{Node, StartOptions};

const NOBODY: u32 = 65_534;

/// Starts berth on the shipped `name`, as `run_as` (the test's own user
/// when `None`), in a fresh directory. The directory comes first, so it is
/// dropped last: the node's drop kills its instances through the state
/// files in it.
fn serve(name: &str, run_as: Option<u32>) -> (tempfile::TempDir, Node) {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    if let Some(uid) = run_as {
        std::fs::create_dir(&data).unwrap();
        for path in [dir.path(), data.as_path()] {
            nix::unistd::chown(path, Some(uid.into()), Some(uid.into())).unwrap();
        }
    }
    let config = support::example(name);
    let options = StartOptions {
        run_as,
        ..StartOptions::default()
    };
    let node = Node::from(
        support::berth()
            .node(dir.path())
            .args(
                &[
                    "serve",
                    "--config",
                    config.to_str().unwrap(),
                    "--listen",
                    "127.0.0.1:0",
                    "--data-dir",
                    data.to_str().unwrap(),
                ],
                &data,
            )
            .options(options)
            .start(),
    );
    (dir, node)
}

/// Launches alice and returns the URL berth hands out.
async fn launch(node: &Node, what: &str) -> String {
    let (status, body) = node.post("/users/alice/instance", json!({})).await;
    assert_eq!(status, 201, "{what}: {body}");
    body["url"].as_str().unwrap().to_owned()
}

async fn demo(node: &Node, what: &str) {
    launch(node, what).await;
    let r = node
        .http
        .get(format!("{}/u/alice/", node.url))
        .bearer_auth(&node.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{what}");
    let page = r.text().await.unwrap();
    assert!(page.contains(r#"data-base="/u/alice/""#), "{what}: {page}");
}

async fn http_server(node: &Node, what: &str) {
    launch(node, what).await;
    let r = node
        .http
        .get(format!("{}/u/alice/", node.url))
        .bearer_auth(&node.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{what}");
    let listing = r.text().await.unwrap();
    assert!(
        listing.contains("Directory listing for /"),
        "{what}: {listing}"
    );
}

async fn jupyter(node: &Node, what: &str) {
    let url = launch(node, what).await;
    // The launch token is Jupyter's secret: berth hands out the app's
    // address only, and presents the token to Jupyter itself.
    assert!(!url.contains("token"), "{what}: {url}");
    let token = support::launch_token_in_log(node, "alice").await;
    // alice's berth cookie alone: Jupyter asks for nothing more, since
    // berth adds `Authorization: token …` on the way.
    let alice = node.user_token("alice").await;
    let get = |path: &str| {
        node.http
            .get(format!("{}/u/alice/{path}", node.url))
            .header("Cookie", format!("berth_token={alice}"))
            .timeout(Duration::from_secs(60))
            .send()
    };
    let r = get("api/status").await.unwrap();
    assert_eq!(r.status(), 200, "{what}");
    let status: serde_json::Value = r.json().await.unwrap();
    assert!(status.get("started").is_some(), "{what}: {status}");
    // Nothing Jupyter answers carries its token to the browser.
    for path in ["", "tree", "api/me", "login?next=%2Fu%2Falice%2Ftree"] {
        let r = get(path).await.unwrap();
        let head = format!("{:?}", r.headers());
        let body = r.text().await.unwrap();
        assert!(!head.contains(&token), "{what}: /{path} headers: {head}");
        assert!(
            !body.contains(&token),
            "{what}: /{path} body carries the token"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_example_serves_as_shipped_as_root_and_as_an_unprivileged_user() {
    let root = nix::unistd::geteuid().is_root();
    let mut users = vec![None];
    if root {
        // As root, the unprivileged run is nobody's.
        users.push(Some(NOBODY));
    }
    let with_jupyter = support::jupyter("the Jupyter example");
    for run_as in users {
        for name in ["demo.toml", "http-server.toml", "jupyter.toml"] {
            if name == "jupyter.toml" && !with_jupyter {
                continue;
            }
            let who = match run_as {
                Some(uid) => format!("uid {uid}"),
                None if root => "root".to_owned(),
                None => "this user".to_owned(),
            };
            let what = format!("{name} with berth as {who}");
            let (_dir, node) = serve(name, run_as);
            match name {
                "demo.toml" => demo(&node, &what).await,
                "http-server.toml" => http_server(&node, &what).await,
                _ => jupyter(&node, &what).await,
            }
            // As root the program runs under alice's account, not root.
            let pid = node.main_of("alice").await["pid"].as_u64().unwrap();
            let uid = std::os::unix::fs::MetadataExt::uid(
                &std::fs::metadata(format!("/proc/{pid}")).unwrap(),
            );
            match run_as {
                None if root => assert_ne!(uid, 0, "{what}: the program runs as root"),
                Some(expected) => assert_eq!(uid, expected, "{what}"),
                None => {}
            }
            assert_eq!(node.delete("/users/alice/instance").await, 204, "{what}");
        }
    }
}

/// `agent-sandbox.toml` as shipped (berth as root, as it says): the agent
/// runs under an account of its own, and the guard holds its allowlist:
/// the four names' web ports go to the egress proxy, and everything else
/// is refused.
#[tokio::test(flavor = "multi_thread")]
async fn the_agent_sandbox_example_confines_its_agent_to_its_allowlist() {
    if !support::privileged("agent sandbox example") {
        return;
    }
    let (_dir, node) = serve("agent-sandbox.toml", None);
    demo(&node, "agent-sandbox.toml").await;
    let pid = node.main_of("alice").await["pid"].as_u64().unwrap();
    let uid =
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(format!("/proc/{pid}")).unwrap());
    assert_ne!(uid, 0, "the agent runs as root");
    // Sandboxed, with its relay beside it as its own account.
    let relays = support::processes_of_account(uid, support::is_relay);
    assert_eq!(relays.len(), 1, "{relays:?}");
    let table = berth_local::isolation::nft_table_name(&node.data_dir.canonicalize().unwrap());
    let listed = std::process::Command::new("nft")
        .args(["list", "table", "inet", &table])
        .output()
        .unwrap();
    let rules = String::from_utf8_lossy(&listed.stdout);
    assert!(
        rules.contains("tcp dport { 80, 443 } redirect to :"),
        "{rules}"
    );
    let instance = rules.split("chain instance").nth(1).unwrap();
    let instance = instance.split("chain output").next().unwrap();
    assert!(
        instance
            .trim_end()
            .trim_end_matches('}')
            .trim_end()
            .ends_with("reject"),
        "{instance}"
    );
    assert_eq!(node.delete("/users/alice/instance").await, 204);
}
