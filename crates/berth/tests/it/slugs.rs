//! Slugs end to end: two ids that shared one 32-bit slug under
//! earlier versions get distinct slugs and distinct data roots through
//! the real binary; the slug berth uses is the one the store recorded, so
//! a data root made under an earlier slug stays where it is.

use crate::support;
use berth_core::program::ProgramSettings;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use berth_controller::{Controller, ControllerConfig};
use berth_core::Readiness;
use berth_core::policy::ReapPolicy;
use berth_core::{InstanceStatus, LaunchRequest, Spawner, Traffic, UserId};
use berth_local::{Isolation, Limits, LocalRuntime, LocalRuntimeConfig, UidRange};
use berth_store::{Store, TakeoverPolicy};
use serde_json::json;
use support::{BERTH, Node, eventually, instance_pids};

const PATIENCE: Duration = Duration::from_secs(60);
/// Two ids that collided under the old slug rule: both were `alice-corp---eb9ba467` before.
const FIRST: &str = "alice*{@(.:$*corp";
const SECOND: &str = "alice<;|<@(:{corp";

fn user(id: &str) -> UserId {
    UserId::parse(id).unwrap()
}

fn config(n: u16) -> String {
    let start = berth_testkit::port_block_for(&format!("{} {n}", module_path!()), 20);
    format!("[instance]\nport_range = [{start}, {}]\n", start + 19)
}

/// Launches `id` through the API and waits until it runs.
async fn launch(node: &Node, id: &str) {
    let segment = user(id).path_segment();
    let (status, body) = node
        .post(&format!("/users/{segment}/instance"), json!({}))
        .await;
    assert!(status == 200 || status == 201, "{status} {body}");
    node.running_main(&segment, None).await;
}

/// The `HOME` of `id`'s running main, read from the process itself.
async fn home_of(node: &Node, id: &str) -> PathBuf {
    let pid = eventually(PATIENCE, &format!("{id}'s program"), || async {
        instance_pids(&node.data_dir, id, "main").first().copied()
    })
    .await;
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let home = environ
        .split(|b| *b == 0)
        .find_map(|v| v.strip_prefix(b"HOME="))
        .expect("HOME is set");
    PathBuf::from(std::str::from_utf8(home).unwrap())
}

/// `<data_dir>/users/<slug>` of a HOME (`…/users/<slug>/home`).
fn data_root(home: &Path) -> &Path {
    home.parent().expect("HOME is inside the data root")
}

#[tokio::test(flavor = "multi_thread")]
async fn the_colliding_ids_of_issue_9_get_distinct_slugs_and_data_roots() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(0));
    launch(&node, FIRST).await;
    launch(&node, SECOND).await;
    let first = home_of(&node, FIRST).await;
    let second = home_of(&node, SECOND).await;
    let (first_root, second_root) = (data_root(&first), data_root(&second));
    assert_ne!(first_root, second_root);
    let users = node.data_dir.join("users");
    for (id, root) in [(FIRST, first_root), (SECOND, second_root)] {
        assert_eq!(root.parent(), Some(users.as_path()), "{}", root.display());
        let slug = root.file_name().unwrap().to_str().unwrap();
        assert_eq!(slug, user(id).slug().as_str());
        assert!(
            slug.starts_with("alice-corp---") && slug.len() <= 43,
            "{slug}"
        );
        assert!(node.data_dir.join("run").join(slug).is_dir());
    }
    assert!(
        !users.join("alice-corp---eb9ba467").exists(),
        "nobody uses the old shared slug"
    );
    // One user's files are invisible to the other.
    std::fs::write(first_root.join("ws/secret.txt"), "first's").unwrap();
    assert!(!second_root.join("ws/secret.txt").exists());
}

/// Records in the store of the node whose data dir is `data` that each
/// of `ids` ran under an earlier berth: a lease row, last held (and
/// released) by another node, as every launch of an earlier berth left.
/// Released and another node's, so no start of this node records their
/// slugs ahead of a launch.
async fn ran_before(data: &Path, ids: &[&str]) {
    std::fs::create_dir_all(data).unwrap();
    let store = berth_store::open(&format!("sqlite://{}/berth.db", data.display()))
        .await
        .unwrap();
    for id in ids {
        let claimed = store
            .claim_lease(
                &user(id),
                "node-before-the-upgrade",
                Duration::from_secs(30),
                TakeoverPolicy::Evidence,
            )
            .await
            .unwrap();
        let berth_store::ClaimOutcome::Claimed { epoch } = claimed else {
            panic!("{id}: {claimed:?}");
        };
        assert!(
            store
                .release_lease(&user(id), "node-before-the-upgrade", epoch)
                .await
                .unwrap()
        );
    }
}

/// An upgrade from a berth with 8-hex-digit slugs: the data root
/// `users/alice-corp---eb9ba467` exists, and both ids ran under the earlier
/// berth (sharing that root, as its 32-bit slugs made them). The first of
/// the two to be recorded keeps it; the other starts afresh under its own
/// slug; after a restart both are where they were.
#[tokio::test(flavor = "multi_thread")]
async fn a_data_root_of_an_earlier_slug_stays_with_the_first_user_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let old_root = dir.path().join("data/users/alice-corp---eb9ba467");
    std::fs::create_dir_all(old_root.join("ws")).unwrap();
    std::fs::write(old_root.join("ws/notes.txt"), "kept across the upgrade").unwrap();
    ran_before(&dir.path().join("data"), &[FIRST, SECOND]).await;

    let mut node = Node::start(dir.path(), &config(1));
    launch(&node, FIRST).await;
    let first = home_of(&node, FIRST).await;
    assert_eq!(data_root(&first), old_root);
    launch(&node, SECOND).await;
    let second = home_of(&node, SECOND).await;
    assert_eq!(
        data_root(&second),
        node.data_dir
            .join("users")
            .join(user(SECOND).slug().as_str())
    );
    assert!(!data_root(&second).join("ws/notes.txt").exists());

    // The recorded slug survives berth: stopped and restarted, each user
    // is launched into the same root again.
    for id in [FIRST, SECOND] {
        assert_eq!(
            node.delete(&format!("/users/{}/instance", user(id).path_segment()))
                .await,
            204
        );
    }
    assert_eq!(node.terminate().code(), Some(0));
    drop(node);
    let node = Node::start(dir.path(), &config(1));
    launch(&node, SECOND).await;
    launch(&node, FIRST).await;
    assert_eq!(data_root(&home_of(&node, FIRST).await), old_root);
    assert_eq!(
        std::fs::read_to_string(old_root.join("ws/notes.txt")).unwrap(),
        "kept across the upgrade"
    );
    assert_eq!(data_root(&home_of(&node, SECOND).await), data_root(&second));
    // And the logs are read from the recorded root, followed or not.
    let (status, body) = node
        .get(&format!(
            "/users/{}/instance/logs",
            user(FIRST).path_segment()
        ))
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(old_root.join("logs/main.log").is_file());
    let demo_lines = |text: &str| text.matches("berth-demo: ").count();
    let lines = body["lines"].as_array().unwrap();
    assert!(
        lines.iter().any(|l| demo_lines(l.as_str().unwrap()) > 0),
        "{body}"
    );
    let mut followed = node
        .http
        .get(node.api(&format!(
            "/users/{}/instance/logs?follow=true&tail=10",
            user(FIRST).path_segment()
        )))
        .bearer_auth(&node.token)
        .send()
        .await
        .unwrap();
    assert_eq!(followed.status(), 200);
    let mut seen = String::new();
    while demo_lines(&seen) == 0 {
        let chunk = tokio::time::timeout(PATIENCE, followed.chunk())
            .await
            .expect("the followed log's lines")
            .unwrap()
            .expect("the stream stays open");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
}

/// An earlier berth's slugs ended in 32 bits of SHA-256, so anyone can
/// make an id whose earlier slug is another user's, and the first id
/// recorded with data under an earlier slug used to keep that data,
/// whoever it was. Here `users/alice-corp---eb9ba467` is FIRST's, who ran
/// before the upgrade; SECOND, an id never seen before that shares the
/// earlier slug, comes first, with a token of its own. Following its log
/// before its first launch shows none of FIRST's old output, and once
/// launched it runs in a fresh root, without FIRST's files. FIRST then
/// launches into the old root, files intact.
#[tokio::test(flavor = "multi_thread")]
async fn an_id_made_to_share_an_earlier_slug_gets_none_of_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let old_root = data.join("users/alice-corp---eb9ba467");
    std::fs::create_dir_all(old_root.join("ws")).unwrap();
    std::fs::create_dir_all(old_root.join("logs")).unwrap();
    std::fs::write(old_root.join("ws/diary.txt"), "FIRST's own notes").unwrap();
    std::fs::write(old_root.join("logs/main.log"), "FIRST's old output\n").unwrap();
    ran_before(&data, &[FIRST]).await;
    let node = Node::start(dir.path(), &config(2));

    // The attacker follows its own log before it ever ran, then launches:
    // the stream shows its own program's lines, none of FIRST's.
    let segment = user(SECOND).path_segment();
    let token = node.user_token(&segment).await;
    let mut followed = node
        .http
        .get(node.api(&format!(
            "/users/{segment}/instance/logs?follow=true&tail=10"
        )))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(followed.status(), 200);
    let r = node
        .http
        .post(node.api(&format!("/users/{segment}/instance")))
        .bearer_auth(&token)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let mut seen = String::new();
    while !seen.contains("berth-demo: ") {
        let chunk = tokio::time::timeout(PATIENCE, followed.chunk())
            .await
            .expect("the attacker's own log lines")
            .unwrap()
            .expect("the stream stays open");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(!seen.contains("FIRST's old output"), "{seen}");
    drop(followed);
    let second = home_of(&node, SECOND).await;
    assert_eq!(
        data_root(&second),
        data.join("users").join(user(SECOND).slug().as_str())
    );
    assert!(!data_root(&second).join("ws/diary.txt").exists());

    launch(&node, FIRST).await;
    assert_eq!(data_root(&home_of(&node, FIRST).await), old_root);
    assert_eq!(
        std::fs::read_to_string(old_root.join("ws/diary.txt")).unwrap(),
        "FIRST's own notes"
    );
}

/// A controller over the local runtime, running the demo app from `data`
/// on ports `ports`…`ports + 9`.
async fn controller(data: &Path, ports: u16, store: Arc<dyn Store>) -> Arc<Controller> {
    let ports = berth_testkit::port_block_for(&format!("{} {ports}", module_path!()), 10);
    let runtime = LocalRuntimeConfig {
        data_dir: data.to_owned(),
        program: ProgramSettings {
            command: vec![
                BERTH.into(),
                "demo-app".into(),
                "--port".into(),
                "{port}".into(),
            ],
            env: BTreeMap::new(),
            readiness: Readiness::TokenRegex(
                regex::Regex::new(r"berth-demo: http://127\.0\.0\.1:\d+/\?token=([A-Za-z0-9_-]+)")
                    .unwrap(),
            ),
            watchdog_command: None,
            patch_ext: "toml".into(),
        },
        env_allowlist: vec!["PATH".into()],
        max_ports: berth_local::DEFAULT_MAX_PORTS,
        log_max_bytes: berth_local::DEFAULT_LOG_MAX_BYTES,
        port_range: ports..=ports + 9,
        isolation: Isolation::None,
        uids: UidRange {
            first: 200_000,
            count: 100_000,
        },
        limits: Limits::default(),
        listeners: berth_local::ListenerCap::default(),
        nft: None,
        egress: Default::default(),
        egress_proxy: None,
        name_servers: Vec::new(),
        shim_command: vec![BERTH.into(), "shim".into()],
    };
    let config = ControllerConfig {
        ready_timeout: Duration::from_secs(20),
        stop_grace: Duration::from_secs(2),
        reap: ReapPolicy {
            idle_ttl: None,
            max_idle: 0,
            interval: Duration::from_secs(60),
            hibernate_after: None,
            ..ReapPolicy::default()
        },
        probe_settle: Duration::from_millis(200),
        probe_budget: Duration::from_secs(20),
        ..ControllerConfig::new("node-a")
    };
    let runtime = LocalRuntime::new(runtime, None).await.unwrap();
    let controller = Controller::start(runtime, store, config).await.unwrap();
    // What these tests look at is the adoption's outcome.
    controller.adopted().await;
    controller
}

/// A node that starts over a store whose lease rows name it (the sticky
/// holder of users it ran before the upgrade) records the earlier slug of
/// those of its users whose data root is here, before anyone launches
/// them; a user whose earlier root is elsewhere, or whose lease another
/// node held, is left to their first launch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starting_node_keeps_the_earlier_data_roots_of_its_users() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let store: Arc<dyn Store> =
        berth_store::open(&format!("sqlite://{}/berth.db", dir.path().display()))
            .await
            .unwrap();
    let ours = user("Carol@Corp");
    let elsewhere = user("Dave@Corp");
    let plain = user("erin");
    for (u, node) in [
        (&ours, "node-a"),
        (&elsewhere, "node-b"),
        (&plain, "node-a"),
    ] {
        store
            .claim_lease(u, node, Duration::from_secs(30), TakeoverPolicy::Evidence)
            .await
            .unwrap();
        std::fs::create_dir_all(data.join("users").join(u.legacy_slug().as_str())).unwrap();
    }
    let spawner = controller(&data, 28300, store.clone()).await;
    assert_eq!(
        store.user_slug(&ours).await.unwrap(),
        Some(ours.legacy_slug())
    );
    assert_eq!(store.user_slug(&elsewhere).await.unwrap(), None);
    assert_eq!(
        store.user_slug(&plain).await.unwrap(),
        None,
        "plain ids need nothing"
    );

    // Launched, Carol runs in her old root; and a controller that
    // recorded a slug never recomputes it.
    spawner
        .launch(&ours, LaunchRequest::default())
        .await
        .unwrap();
    let running = eventually(PATIENCE, "carol running", || async {
        let main = spawner.status(&ours).await.unwrap().main?;
        (main.status == InstanceStatus::Running && main.ready).then_some(main)
    })
    .await;
    let environ = std::fs::read(format!("/proc/{}/environ", running.pid.unwrap())).unwrap();
    let home = format!(
        "HOME={}",
        data.join("users")
            .join(ours.legacy_slug().as_str())
            .join("home")
            .display()
    );
    assert!(
        environ.split(|b| *b == 0).any(|v| v == home.as_bytes()),
        "{home} not in the program's environment"
    );
    spawner.stop(&ours).await.unwrap();
    spawner.teardown().await;
}
