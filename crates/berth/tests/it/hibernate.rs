//! Hibernation: an idle instance is frozen with its memory
//! intact and resumed by the next request, end to end with the real
//! binary, real instances and real sockets. Frozen means stopped by the
//! kernel: every process of the instance shows state `T` in
//! `/proc/<pid>/stat` (these run at level `none`, frozen by SIGSTOP to the
//! program's group), and the same pids run again after the resume. The
//! cgroup freezer of level `sandbox` is tested in `isolation.rs`.

use crate::support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use support::{BERTH, Node, alive, eventually, frozen, instance_pids, websocket};
use tokio_tungstenite::tungstenite::Message;
/// Bound for anything that should happen "soon"; only a hang reaches it.
const PATIENCE: Duration = Duration::from_secs(60);

/// The instance: a shell that leaves a second process in the instance's
/// group (`sleep`), then becomes the demo app. So "every process of the
/// instance" is more than one.
fn instance(n: u16, extra: &str) -> String {
    let start = berth_testkit::port_block_for(&format!("{} {n}", module_path!()), 20);
    format!(
        "[instance]\nport_range = [{start}, {}]\n\
         command = [\"/bin/sh\", \"-c\", 'sleep 1000 & exec \"$0\" demo-app --port \"$1\"', \"{BERTH}\", \"{{port}}\"]\n\
         ready_token_regex = 'berth-demo: http://127\\.0\\.0\\.1:\\d+/\\?token=([A-Za-z0-9_-]+)'\n{extra}\n",
        start + 19
    )
}

/// Hibernation after 2 idle seconds, looked at every second, renews every
/// second (so a test sees several renews while alice is frozen).
fn config(n: u16, instance_extra: &str, reap_extra: &str) -> String {
    format!(
        "{}\n[reap]\ninterval_s = 1\nhibernate_after_s = 2\n{reap_extra}\n\n\
         [lease]\nttl_ms = 3000\nrenew_ms = 1000\nfence_after_ms = 2000\n",
        instance(n, instance_extra)
    )
}

fn addr(node: &Node) -> SocketAddr {
    node.url
        .trim_start_matches("http://")
        .parse()
        .expect("berth listens on an IP address")
}

/// `GET /u/<user>/counter`: the demo app's in-memory count and its pid.
async fn counter(node: &Node, user: &str) -> (u64, u64) {
    let r = node
        .http
        .get(format!("{}/u/{user}/counter", node.url))
        .bearer_auth(&node.token)
        .timeout(PATIENCE)
        .send()
        .await
        .expect("berth answers");
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    (
        body["count"].as_u64().unwrap(),
        body["pid"].as_u64().unwrap(),
    )
}

fn pids_of(node: &Node, user: &str) -> BTreeSet<u32> {
    instance_pids(&node.data_dir, user, "main")
        .into_iter()
        .collect()
}

/// Waits until `user`'s main has the API status `status`; the record.
async fn status_is(node: &Node, user: &str, status: &str) -> Value {
    eventually(PATIENCE, &format!("{user} {status}"), || async {
        let main = node.main_of(user).await;
        (main["status"] == status).then_some(main)
    })
    .await
}

fn all_stopped(pids: &BTreeSet<u32>) -> bool {
    pids.iter().all(|p| frozen(*p))
}

fn none_stopped(pids: &BTreeSet<u32>) -> bool {
    pids.iter().all(|p| alive(u64::from(*p)) && !frozen(*p))
}

/// Waits for every process of `user`'s instance to be stopped by the
/// kernel (state `T`), and returns them.
async fn frozen_pids(node: &Node, user: &str) -> BTreeSet<u32> {
    eventually(PATIENCE, &format!("{user}'s processes frozen"), || async {
        let pids = pids_of(node, user);
        (pids.len() >= 2 && all_stopped(&pids)).then_some(pids)
    })
    .await
}

/// The `lease_until` of `user`'s lease, as the API shows it.
async fn lease_until(node: &Node, user: &str) -> i64 {
    let (status, body) = node.get("/leases").await;
    assert_eq!(status, 200, "{body}");
    let leases = body["leases"].as_array().cloned().unwrap_or_default();
    leases
        .iter()
        .find(|l| l["user"] == user)
        .and_then(|l| l["lease_until"].as_i64())
        .unwrap_or_default()
}

/// Waits for two more renews of `user`'s lease.
async fn two_renews(node: &Node, user: &str) {
    for _ in 0..2 {
        let before = lease_until(node, user).await;
        eventually(PATIENCE, "a lease renew", || async {
            (lease_until(node, user).await > before).then_some(())
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_idle_instance_hibernates_and_resumes_where_it_left_off() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(0, "", ""));
    let (first, pid) = counter(&node, "alice").await;
    let (second, same) = counter(&node, "alice").await;
    assert_eq!((first, second, same), (1, 2, pid));

    let main = status_is(&node, "alice", "hibernated").await;
    assert!(main["hibernated_at"].as_i64().is_some(), "{main}");
    assert_eq!(main["ready"], true, "{main}");
    let frozen = frozen_pids(&node, "alice").await;
    assert!(frozen.contains(&u32::try_from(pid).unwrap()), "{frozen:?}");
    assert_eq!(node.metric("berth_hibernated_instances").await, Some(1.0));

    // The next request is answered by the same process, which remembers.
    let (third, after) = counter(&node, "alice").await;
    assert_eq!(
        (third, after),
        (3, pid),
        "the count goes on in the same process"
    );
    assert_eq!(pids_of(&node, "alice"), frozen, "the same processes");
    assert!(none_stopped(&frozen), "every process runs again");
    let main = status_is(&node, "alice", "running").await;
    assert_eq!(main["restarts"], 0, "{main}");
    assert_eq!(main["hibernated_at"], Value::Null, "{main}");
    assert!(node.metric("berth_hibernations_total").await >= Some(1.0));
    assert!(node.metric("berth_resumes_total").await >= Some(1.0));
    assert!(node.metric("berth_resume_latency_seconds_count").await >= Some(1.0));

    // And it hibernates again once idle.
    status_is(&node, "alice", "hibernated").await;
    frozen_pids(&node, "alice").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_websocket_that_only_receives_lets_alice_sleep_one_that_sends_keeps_her_awake() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(1, "", ""));
    let open = |route: &'static str| {
        let node = &node;
        async move {
            websocket(addr(node), &format!("/u/alice/{route}"), &node.token)
                .await
                .expect("the WebSocket handshake goes through berth")
        }
    };

    // The app pushes a tick every 200 ms; the client only reads.
    let mut ticks = open("ticks").await;
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let reader = tokio::spawn({
        let seen = seen.clone();
        async move {
            while let Some(Ok(_)) = ticks.next().await {
                seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    status_is(&node, "alice", "hibernated").await;
    frozen_pids(&node, "alice").await;
    reader.abort();
    // The socket carried ticks: she slept with traffic flowing to her
    // client, not on an idle connection.
    assert!(
        seen.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "no tick reached the client before alice slept"
    );

    // A client that sends keeps her awake: every echo comes back (a
    // frozen app echoes nothing), across several hibernate_after periods.
    let (_, pid) = counter(&node, "alice").await;
    let mut echo = open("ws").await;
    for i in 0..20 {
        echo.send(Message::text(format!("m{i}"))).await.unwrap();
        let reply = tokio::time::timeout(PATIENCE, echo.next())
            .await
            .expect("an echo")
            .expect("the socket is open")
            .unwrap();
        assert_eq!(reply, Message::text(format!("m{i}")));
        assert_ne!(node.status_of("alice").await, "hibernated", "after m{i}");
        // The client's pace, not a wait for berth: 20 × 300 ms is three
        // times hibernate_after.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let pids = pids_of(&node, "alice");
    assert!(none_stopped(&pids), "{pids:?}");
    // Once it stops sending, alice sleeps, the socket still open.
    status_is(&node, "alice", "hibernated").await;
    let (_, same) = counter(&node, "alice").await;
    assert_eq!(same, pid);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hibernated_instance_stays_frozen_through_renews_and_a_restart_of_berth() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(2, "", "");
    // By hand this time (and never by the reaper: alice would hibernate
    // anyway, but the CLI is what is under test).
    let config = config.replace("hibernate_after_s = 2", "hibernate_after_s = 0");
    let mut node = Node::start(dir.path(), &config);
    let (_, pid) = counter(&node, "alice").await;
    let out = node.cli(&["hibernate", "alice"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "alice is hibernated\n"
    );
    let frozen = frozen_pids(&node, "alice").await;

    two_renews(&node, "alice").await;
    assert!(all_stopped(&frozen), "no renew thaws a hibernated instance");
    assert_eq!(node.status_of("alice").await, "hibernated");

    // berth goes away and comes back: alice is adopted as hibernated.
    node.kill9();
    assert!(all_stopped(&frozen), "instances outlive berth, frozen");
    let node = Node::start(dir.path(), &config);
    status_is(&node, "alice", "hibernated").await;
    two_renews(&node, "alice").await;
    assert!(all_stopped(&frozen), "adoption and renews thaw nothing");
    assert_eq!(pids_of(&node, "alice"), frozen);

    let out = node.cli(&["resume", "alice"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "alice is running\n");
    // The resume answers once the thaw is sent; the shim delivers it.
    eventually(PATIENCE, "alice thawed", || async {
        none_stopped(&frozen).then_some(())
    })
    .await;
    let (count, same) = counter(&node, "alice").await;
    assert_eq!((count, same), (2, pid));
    assert_eq!(node.main_of("alice").await["restarts"], 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn hibernating_or_resuming_nothing_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    // By hand only: alice must not hibernate on her own here.
    let config = config(3, "", "").replace("hibernate_after_s = 2", "hibernate_after_s = 0");
    let node = Node::start(dir.path(), &config);
    let (status, body) = node
        .post("/users/nobody/instance/hibernate", serde_json::json!({}))
        .await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"], "not_found");
    assert_eq!(body["message"], "user nobody has no running instance");
    let (status, body) = node
        .post("/users/nobody/instance/resume", serde_json::json!({}))
        .await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["message"], "user nobody has no live instance");
    let (status, body) = node
        .post("/users/.bad/instance/resume", serde_json::json!({}))
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"], "invalid_user");

    // Status says what this node does with idle instances.
    counter(&node, "alice").await;
    let (_, body) = node.get("/users/alice/instance").await;
    assert_eq!(body["idle_action"], "hibernate", "{body}");

    // A user may hibernate and resume their own instance, never another's.
    let bob = node.user_token("bob").await;
    for verb in ["hibernate", "resume"] {
        let r = node
            .http
            .post(node.api(&format!("/users/alice/instance/{verb}")))
            .bearer_auth(&bob)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "bob may not {verb} alice");
    }
    assert_eq!(node.status_of("alice").await, "running");
    let alice = node.user_token("alice").await;
    let r = node
        .http
        .post(node.api("/users/alice/instance/hibernate"))
        .bearer_auth(&alice)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(node.status_of("alice").await, "hibernated");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_long_hibernated_instance_is_stopped_after_stop_after_s() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(4, "", "stop_after_s = 2\n"));
    counter(&node, "alice").await;
    status_is(&node, "alice", "hibernated").await;
    let frozen = frozen_pids(&node, "alice").await;
    let main = status_is(&node, "alice", "stopped").await;
    assert_eq!(main["restarts"], 0, "{main}");
    eventually(PATIENCE, "alice's processes gone", || async {
        frozen.iter().all(|p| !alive(u64::from(*p))).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn max_hibernated_stops_the_longest_hibernated_first() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(5, "", "max_hibernated = 1\n"));
    counter(&node, "alice").await;
    status_is(&node, "alice", "hibernated").await;
    let alice = frozen_pids(&node, "alice").await;
    counter(&node, "bob").await;
    status_is(&node, "bob", "hibernated").await;
    status_is(&node, "alice", "stopped").await;
    eventually(PATIENCE, "alice's processes gone", || async {
        alice.iter().all(|p| !alive(u64::from(*p))).then_some(())
    })
    .await;
    frozen_pids(&node, "bob").await;
    assert_eq!(node.status_of("bob").await, "hibernated");
}

/// A `pre_hibernate` command that asks the instance itself for its count:
/// it can only succeed while the instance runs (frozen, the request would
/// hang past the hook's own 5 s timeout), and only then writes `flushed`
/// and its uid into its working directory, the instance's folder.
fn flushing_hook() -> String {
    "pre_hibernate = [\"python3\", \"-c\", \"import os, urllib.request; \
     urllib.request.urlopen('http://127.0.0.1:%s/counter' % os.environ['BERTH_PORT'], timeout=5).read(); \
     open('hook.log', 'a').write(os.environ['BERTH_HOOK'] + ' ' + os.environ['BERTH_USER'] + ' flushed as ' + str(os.getuid()) + '\\\\n')\"]\n"
        .to_owned()
}

/// What the hook wrote into `user`'s folder.
fn hook_log(node: &Node, user: &str) -> String {
    std::fs::read_to_string(node.data_dir.join(format!("users/{user}/ws/hook.log")))
        .expect("the hook ran")
}

/// The uid `user`'s program runs as, from its shim's state: its account's
/// (as root), or berth's own.
fn program_uid(node: &Node, user: &str) -> u32 {
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(node.data_dir.join(format!("run/{user}/main.json"))).unwrap(),
    )
    .unwrap();
    state["uid"].as_u64().map_or_else(
        || nix::unistd::geteuid().as_raw(),
        |u| u32::try_from(u).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn the_pre_hibernate_hook_runs_before_the_freeze() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(6, &flushing_hook(), ""));
    counter(&node, "alice").await;
    status_is(&node, "alice", "hibernated").await;
    let uid = program_uid(&node, "alice");
    assert_eq!(
        hook_log(&node, "alice"),
        format!("pre_hibernate alice flushed as {uid}\n")
    );
    // The hook's own request counted in the app's memory.
    let (count, _) = counter(&node, "alice").await;
    assert_eq!(count, 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hook_that_hangs_is_cut_off_at_its_grace() {
    let dir = tempfile::tempdir().unwrap();
    let hook = "pre_hibernate = [\"/bin/sh\", \"-c\", \"echo $$ > hook.pid; exec sleep 1000\"]\nhook_grace_s = 1\n";
    let node = Node::start(dir.path(), &config(7, hook, ""));
    counter(&node, "alice").await;
    // Hibernated at all means the hook was cut off: it sleeps for 1000 s.
    status_is(&node, "alice", "hibernated").await;
    frozen_pids(&node, "alice").await;
    let hook_pid: u64 = std::fs::read_to_string(node.data_dir.join("users/alice/ws/hook.pid"))
        .expect("the hook ran")
        .trim()
        .parse()
        .unwrap();
    eventually(PATIENCE, "the hung hook killed", || async {
        (!alive(hook_pid)).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_pre_stop_hook_runs_before_a_stop() {
    let dir = tempfile::tempdir().unwrap();
    let hook = flushing_hook().replace("pre_hibernate", "pre_stop");
    let config = config(8, &hook, "").replace("hibernate_after_s = 2", "hibernate_after_s = 0");
    let node = Node::start(dir.path(), &config);
    counter(&node, "alice").await;
    let uid = program_uid(&node, "alice");
    assert_eq!(node.delete("/users/alice/instance").await, 204);
    assert_eq!(
        hook_log(&node, "alice"),
        format!("pre_stop alice flushed as {uid}\n"),
        "written before the stop answered"
    );
    assert_eq!(node.status_of("alice").await, "stopped");
}

/// A request that reaches alice while her `pre_hibernate` hook runs calls
/// the reaper's hibernation off: she was idle when the reaper looked, and
/// is not any more. The hook waits, the first time only, for a file the
/// test writes after its request; then it logs a line. Alice hibernates
/// later, on the reaper's next look, so the first time she reads
/// `hibernated` the hook has run twice.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_during_the_pre_hibernate_hook_calls_the_hibernation_off() {
    let dir = tempfile::tempdir().unwrap();
    let hook = "pre_hibernate = [\"/bin/sh\", \"-c\", \"[ -e called ] || { touch called; \
                while [ ! -e go ]; do sleep 0.05; done; }; echo ran >> hooks.log\"]\n\
                hook_grace_s = 60\n";
    let node = Node::start(dir.path(), &config(17, hook, ""));
    counter(&node, "alice").await;
    let ws = node.data_dir.join("users/alice/ws");
    eventually(PATIENCE, "the first pre_hibernate hook running", || async {
        ws.join("called").exists().then_some(())
    })
    .await;
    let (count, _) = counter(&node, "alice").await;
    assert_eq!(count, 2, "the request reached the running program");
    std::fs::write(ws.join("go"), "").unwrap();
    status_is(&node, "alice", "hibernated").await;
    assert_eq!(
        std::fs::read_to_string(ws.join("hooks.log")).unwrap(),
        "ran\nran\n",
        "the first hibernation, asked for before the request, was called off"
    );
    frozen_pids(&node, "alice").await;
}

/// A stop the reaper planned is called off by a request that comes while
/// the reaper is still busy: with `max_hibernated = 1`, the plan that
/// hibernates bob also stops alice, hibernated before him. Bob's
/// `pre_hibernate` hook waits, the first time, for a file the test writes
/// after a request to alice, which resumes her. The reaper must then
/// leave her running; hibernated later on her own, she is the one kept,
/// and bob, the older, is stopped.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_while_the_reaper_is_busy_calls_off_a_stop_it_planned() {
    let dir = tempfile::tempdir().unwrap();
    let hook = "pre_hibernate = [\"/bin/sh\", \"-c\", \"[ \\\"$BERTH_USER\\\" != bob ] || \
                [ -e called ] || { touch called; while [ ! -e go ]; do sleep 0.05; done; }\"]\n\
                hook_grace_s = 60\n";
    let node = Node::start(dir.path(), &config(18, hook, "max_hibernated = 1\n"));
    let (_, alice_pid) = counter(&node, "alice").await;
    status_is(&node, "alice", "hibernated").await;
    counter(&node, "bob").await;
    let bobs = node.data_dir.join("users/bob/ws");
    eventually(PATIENCE, "bob's hook running", || async {
        bobs.join("called").exists().then_some(())
    })
    .await;
    assert_eq!(
        counter(&node, "alice").await,
        (2, alice_pid),
        "alice resumed where she left off"
    );
    std::fs::write(bobs.join("go"), "").unwrap();
    status_is(&node, "bob", "stopped").await;
    status_is(&node, "alice", "hibernated").await;
    assert_eq!(
        counter(&node, "alice").await,
        (3, alice_pid),
        "alice was never stopped"
    );
}

/// A program that runs but is not yet ready (`starting`) cannot be
/// hibernated: freezing it would hold up its own start. The program waits for a file before it
/// becomes the demo app, so the test holds it between start and ready.
#[tokio::test(flavor = "multi_thread")]
async fn a_started_instance_that_is_not_ready_cannot_be_hibernated() {
    let dir = tempfile::tempdir().unwrap();
    let gate = dir.path().join("go");
    let config = config(16, "", "")
        .replace("hibernate_after_s = 2", "hibernate_after_s = 0")
        .replace(
            "'sleep 1000 & exec",
            &format!(
                "'while [ ! -e {} ]; do sleep 0.05; done; sleep 1000 & exec",
                gate.display()
            ),
        );
    let node = Node::start(dir.path(), &config);
    let launch = tokio::spawn({
        let (http, url, token) = (
            node.http.clone(),
            node.api("/users/alice/instance"),
            node.token.clone(),
        );
        async move {
            let r = http
                .post(url)
                .bearer_auth(token)
                .json(&serde_json::json!({}))
                .send()
                .await;
            r.map(|r| r.status().as_u16()).map_err(|e| e.to_string())
        }
    });
    eventually(PATIENCE, "alice started, not ready", || async {
        let main = node.main_of("alice").await;
        (main["status"] == "starting" && main["ready"] == false && main["pid"].is_u64())
            .then_some(())
    })
    .await;
    let (status, body) = node
        .post("/users/alice/instance/hibernate", serde_json::json!({}))
        .await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["message"], "user alice has no running instance");

    std::fs::write(&gate, "").unwrap();
    assert_eq!(launch.await.unwrap(), Ok(201));
    assert_eq!(node.main_of("alice").await["status"], "running");
    assert!(none_stopped(&pids_of(&node, "alice")));
}

/// What a browser does in a background tab of a Jupyter-like app: it
/// only reads, but answers every server ping with a pong on its own. The
/// pongs are the WebSocket's, not the user's: alice still hibernates.
#[tokio::test(flavor = "multi_thread")]
async fn a_tab_that_only_answers_pings_lets_alice_sleep() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(15, "", ""));
    let mut ticks = websocket(addr(&node), "/u/alice/ticks?ping_ms=200", &node.token)
        .await
        .expect("the WebSocket handshake goes through berth");
    // The client only reads; tungstenite answers each ping as it reads
    // (a pong every 200 ms, ten times per hibernate_after). The app
    // reports the pongs it got in each tick: "tick N pongs P".
    let (pongs_tx, pongs) = tokio::sync::watch::channel(0u64);
    let (pings_tx, pings) = tokio::sync::watch::channel(0u64);
    let reader = tokio::spawn(async move {
        while let Some(Ok(message)) = ticks.next().await {
            match message {
                Message::Ping(_) => pings_tx.send_modify(|n| *n += 1),
                Message::Text(text) => {
                    let reported = text
                        .rsplit_once(" pongs ")
                        .and_then(|(_, p)| p.parse().ok())
                        .expect("ticks report pongs");
                    pongs_tx.send_replace(reported);
                }
                _ => {}
            }
        }
    });
    status_is(&node, "alice", "hibernated").await;
    frozen_pids(&node, "alice").await;
    // The app was pinging all along (every 200 ms for at least
    // hibernate_after), and the pongs reached it through berth: the last
    // tick before the freeze counted at least half as many as this client
    // had seen pings.
    let pings_seen = *pings.borrow();
    let pongs_seen = *pongs.borrow();
    assert!(pings_seen >= 5, "{pings_seen} pings in over 2 s");
    assert!(
        pongs_seen >= pings_seen / 2,
        "{pongs_seen} pongs reached the app, {pings_seen} pings"
    );
    // Frozen, the app sends nothing more, and the socket stays open.
    assert!(!reader.is_finished(), "the WebSocket is still open");
    reader.abort();
}
