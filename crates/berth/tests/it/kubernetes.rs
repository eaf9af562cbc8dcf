//! The Kubernetes runtime in the real binary: `berth serve` processes whose
//! `[kubernetes]` table (from the shipped `examples/kubernetes.toml`) points
//! them at a **double** of the Kubernetes API server, because no API server
//! can run on these machines.
//!
//! The double (`berth_k8s::testing::ApiServerDouble`) cannot run inside the
//! berth binary, so it runs in this test process, as a listener on a local
//! port; each berth reaches it through a kubeconfig file naming that port,
//! exactly as it would reach a real cluster, with kube's real client. The
//! double's stand-in kubelet runs each pod's command as a real local
//! process (here the real `berth demo-app`), on a free local port, and its
//! EndpointSlices map each user's Service to that port: berth runs with
//! `endpoint = "endpoint_slice"`, so its proxy reaches the pod through
//! that mapping, where in a cluster it would use the pod's address.
//!
//! The replicas share a real PostgreSQL database (`berth-testkit`), with
//! short lease timings (TTL 3 s) so that a takeover happens in seconds.
//! Everything polls until a deadline; nothing asserts on timing.
//!
//! Every pod here runs berth's shim, which runs the program under a uid of
//! the pod's own (`run_as_user`): only root may, so each test needs root.

use crate::support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_k8s::testing::{ApiServerDouble, Kind};
use berth_testkit::PgCluster;
use serde_json::{Value, json};
use support::{BERTH, Node, eventually};

const SECRET: &str = berth_testkit::TEST_CLUSTER_SECRET;
/// Bound for anything that should happen "soon"; only a hang reaches it.
const PATIENCE: Duration = Duration::from_secs(60);

fn example_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/kubernetes.toml")
}

/// A kubeconfig that points kube's client at the double.
pub(crate) fn kubeconfig(double: &ApiServerDouble, dir: &Path) -> PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(&path, double.kubeconfig()).unwrap();
    path
}

/// The shipped example, with only what must differ on this machine
/// replaced: where berth listens and keeps its data, its store and node id
/// (`store` is `None` for SQLite), short lease timings, the kubeconfig of
/// the double, the program's path (this build's `berth`, where the example
/// names the image's `/usr/local/bin/berth`), the shim turned on, and the EndpointSlice
/// endpoints (the double's Service-to-port mapping).
pub(crate) fn config_from_example(
    dir: &Path,
    kubeconfig: &Path,
    store: Option<&str>,
    node: &str,
) -> String {
    let text = std::fs::read_to_string(example_path()).unwrap();
    let mut config: toml::Table = toml::from_str(&text).unwrap();
    let set = |table: &mut toml::Table, key: &str, value: toml::Value| {
        table.insert(key.to_owned(), value);
    };
    set(&mut config, "listen", "127.0.0.1:0".into());
    set(
        &mut config,
        "data_dir",
        dir.join("data").to_str().unwrap().into(),
    );
    set(&mut config, "node_id", node.into());
    // The deploy's Secret gives it (the pods' shim credentials derive
    // from it).
    set(&mut config, "cluster_secret", SECRET.into());
    if let Some(store) = store {
        set(&mut config, "store", store.into());
        let lease: toml::Table =
            toml::from_str("ttl_ms = 3000\nrenew_ms = 1000\nfence_after_ms = 2000\n").unwrap();
        set(&mut config, "lease", lease.into());
    }
    let k8s = config["kubernetes"].as_table_mut().unwrap();
    set(k8s, "kubeconfig", kubeconfig.to_str().unwrap().into());
    set(k8s, "endpoint", "endpoint_slice".into());
    let command = k8s["command"].as_array_mut().unwrap();
    assert_eq!(command[0].as_str(), Some("/usr/local/bin/berth"));
    command[0] = BERTH.into();
    // The shim, as the example's comment says to turn it on, with this
    // build's berth for the image's.
    let shim: toml::Table = toml::from_str(&format!("path = {BERTH:?}\nport = 7079\n")).unwrap();
    assert!(
        text.contains("# [kubernetes.shim]\n# path = \"/usr/local/bin/berth\"\n# port = 7079\n"),
        "the example no longer shows the shim"
    );
    set(k8s, "shim", shim.into());
    toml::to_string(&config).unwrap()
}

/// The double, and a directory for berths with a kubeconfig of it.
struct Cluster {
    double: ApiServerDouble,
    root: tempfile::TempDir,
    kubeconfig: PathBuf,
}

impl Cluster {
    async fn start() -> Cluster {
        let double = ApiServerDouble::start().await;
        let root = tempfile::tempdir().unwrap();
        let kubeconfig = kubeconfig(&double, root.path());
        Cluster {
            double,
            root,
            kubeconfig,
        }
    }

    /// [`config_from_example`] for node `node`, in a directory of its
    /// name; that directory and the config.
    fn config(&self, store: Option<&str>, node: &str) -> (PathBuf, String) {
        let dir = self.root.path().join(node);
        let config = config_from_example(&dir, &self.kubeconfig, store, node);
        (dir, config)
    }
}

/// Starts a berth on the example config in `dir` (off the async threads:
/// starting blocks until berth listens).
async fn start(dir: PathBuf, config: String) -> Node {
    tokio::task::spawn_blocking(move || {
        Node::from(support::berth().node(&dir).config(&config).start())
    })
    .await
    .unwrap()
}

/// A fresh database on the shared test server (started on first use).
async fn fresh_db() -> String {
    tokio::task::spawn_blocking(|| PgCluster::shared().map(|_| ()).map_err(|e| e.to_string()))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("no PostgreSQL for the Kubernetes tests: {e}"));
    PgCluster::shared().unwrap().fresh_database().await
}

/// The pod `name` in the double's `berth` namespace.
fn pod(double: &ApiServerDouble, name: &str) -> Option<Value> {
    double.object(Kind::Pod, "berth", name)
}

fn annotation(pod: &Value, key: &str) -> String {
    pod["metadata"]["annotations"][key]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

fn uid(pod: &Value) -> String {
    pod["metadata"]["uid"].as_str().unwrap().to_owned()
}

/// GET `path` through `node`'s proxy with `token`: status and body.
async fn through_proxy(node: &Node, path: &str, token: &str) -> (u16, String) {
    let r = node
        .http
        .get(format!("{}{path}", node.url))
        .bearer_auth(token)
        .send()
        .await
        .expect("berth answers");
    (r.status().as_u16(), r.text().await.unwrap_or_default())
}

/// The lease of `user` as `node` lists it.
async fn lease_of(node: &Node, user: &str) -> Value {
    let (status, body) = node.get("/leases").await;
    assert_eq!(status, 200, "{body}");
    body["leases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["user"] == user)
        .cloned()
        .unwrap_or(Value::Null)
}

/// Two replicas on one PostgreSQL database manage alice's pod through
/// exactly one of them; when that one dies (`kill -9`), the other takes
/// the same pod over without restarting it: the pod's UID stays, nothing
/// is created, and the lease's epoch rises by exactly one.
#[tokio::test(flavor = "multi_thread")]
async fn two_replicas_share_a_pod_and_a_takeover_keeps_it_running() {
    if !support::root("kubernetes::two_replicas_share_a_pod_and_a_takeover_keeps_it_running") {
        return;
    }
    let double = ApiServerDouble::start().await;
    let db = fresh_db().await;
    let root = tempfile::tempdir().unwrap();
    let kubeconfig = kubeconfig(&double, root.path());
    let mut nodes = Vec::new();
    for id in ["replica-a", "replica-b"] {
        let dir = root.path().join(id);
        let config = config_from_example(&dir, &kubeconfig, Some(&db), id);
        nodes.push(start(dir, config).await);
    }

    let (status, body) = nodes[0].post("/users/alice/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["instance"]["node"], "replica-a", "{body}");
    let before = pod(&double, "berth-alice").expect("alice's pod");
    let pod_uid = uid(&before);
    assert_eq!(annotation(&before, "berth.dev/node"), "replica-a");
    assert!(double.running(&pod_uid), "alice's program runs");
    let lease = lease_of(&nodes[1], "alice").await;
    assert_eq!(lease["holder"], "replica-a", "{lease}");
    let epoch = lease["epoch"].as_i64().unwrap();
    assert_eq!(annotation(&before, "berth.dev/epoch"), epoch.to_string());

    // Exactly one replica manages her: the other answers with the
    // owner's record, has made nothing of its own, and its proxy reaches
    // the pod through the owner.
    let main = nodes[1].main_of("alice").await;
    assert_eq!(main["node"], "replica-a", "{main}");
    assert_eq!(main["status"], "running", "{main}");
    let (status, page) = through_proxy(&nodes[1], "/u/alice/", &nodes[1].token).await;
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("berth demo app") && page.contains("alice"),
        "{page}"
    );
    assert_eq!(double.creates(Kind::Pod), 1);
    assert_eq!(double.objects(Kind::Pod).len(), 1);

    nodes[0].kill9();
    let b = &nodes[1];
    let main = eventually(PATIENCE, "alice taken over by replica-b", || async {
        let main = b.main_of("alice").await;
        (main["node"] == "replica-b" && main["status"] == "running" && main["ready"] == true)
            .then_some(main)
    })
    .await;
    let lease = lease_of(b, "alice").await;
    assert_eq!(lease["holder"], "replica-b", "{lease}");
    assert_eq!(lease["epoch"].as_i64(), Some(epoch + 1), "{lease}");
    assert_eq!(main["epoch"].as_i64(), Some(epoch + 1), "{main}");

    // The same pod, taken over in place: same UID, the new holder and
    // epoch on it, its program never stopped, nothing created.
    let after = pod(&double, "berth-alice").expect("alice's pod");
    assert_eq!(uid(&after), pod_uid, "the pod was replaced: {after}");
    assert_eq!(annotation(&after, "berth.dev/node"), "replica-b");
    assert_eq!(
        annotation(&after, "berth.dev/epoch"),
        (epoch + 1).to_string()
    );
    assert!(double.running(&pod_uid), "alice's program still runs");
    assert_eq!(
        after["status"]["containerStatuses"][0]["restartCount"],
        json!(0),
        "{after}"
    );
    assert_eq!(double.creates(Kind::Pod), 1, "no pod was created");

    // The survivor's proxy reaches the pod itself now, and its log (the
    // pod log API) is the program's, from its start before the takeover.
    let (status, page) = through_proxy(b, "/u/alice/", &b.token).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("alice"), "{page}");
    let (status, logs) = b.get("/users/alice/instance/logs").await;
    assert_eq!(status, 200, "{logs}");
    let ready_lines = logs["lines"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| {
            l.as_str()
                .is_some_and(|l| l.starts_with("berth-demo: http://"))
        })
        .count();
    assert_eq!(ready_lines, 1, "one start of the program: {logs}");
}

/// A request for a user with no pod wakes one, as it wakes a local
/// instance, and is answered by the pod's program in one round trip; a
/// browser gets the starting page until the pod answers; a restarted
/// berth adopts the running pods and creates nothing; a stopped user's
/// pod is gone and the next request wakes a new one.
#[tokio::test(flavor = "multi_thread")]
async fn the_proxy_wakes_a_pod_and_reaches_it_through_its_service() {
    if !support::root("kubernetes::the_proxy_wakes_a_pod_and_reaches_it_through_its_service") {
        return;
    }
    let cluster = Cluster::start().await;
    let double = &cluster.double;
    let (dir, config) = cluster.config(None, "solo");
    let mut node = start(dir.clone(), config.clone()).await;
    let bob = node.user_token("bob").await;
    assert_eq!(node.status_of("bob").await, "none");
    assert!(pod(double, "berth-bob").is_none());

    let (status, page) = through_proxy(&node, "/u/bob/", &bob).await;
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("berth demo app") && page.contains("bob"),
        "{page}"
    );
    assert_eq!(node.status_of("bob").await, "running");
    let first = pod(double, "berth-bob").expect("bob's pod");
    assert_eq!(double.creates(Kind::Pod), 1);
    // The page came from that pod: the Service's slice names its port.
    let slice_port = double
        .endpoint("berth", "berth-bob")
        .expect("bob's Service maps to a local port");
    let direct = reqwest::get(format!("http://{slice_port}/"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(direct.contains("bob"), "{direct}");

    // A browser that navigates to a user with no pod gets the starting
    // page, which reloads until the app answers, as for a local instance.
    let carol = node.user_token("carol").await;
    let navigate = || {
        node.http
            .get(format!("{}/u/carol/", node.url))
            .header("Cookie", format!("berth_token={carol}"))
            .header("Accept", "text/html")
            .header("Sec-Fetch-Mode", "navigate")
            .send()
    };
    let r = navigate().await.unwrap();
    assert_eq!(r.status(), 202);
    let page = r.text().await.unwrap();
    assert!(page.contains("Starting the workspace of carol"), "{page}");
    let page = eventually(PATIENCE, "carol's app after reloads", || async {
        let r = navigate().await.unwrap();
        if r.status() == 200 {
            return Some(r.text().await.unwrap());
        }
        assert_eq!(r.status(), 202, "only the starting page in between");
        None
    })
    .await;
    assert!(page.contains("carol"), "{page}");
    assert!(pod(double, "berth-carol").is_some());
    assert_eq!(double.creates(Kind::Pod), 2);

    // A restarted berth adopts the pods: nothing is created, bob is still
    // served, by the same pod. It serves while it adopts, so until bob is
    // adopted a client is told he is starting, and never launches him
    // again.
    node.kill9();
    drop(node);
    let node = start(dir, config).await;
    let page = eventually(PATIENCE, "bob served after the restart", || async {
        let (status, page) = through_proxy(&node, "/u/bob/", &bob).await;
        if status == 200 {
            return Some(page);
        }
        assert_eq!(status, 503, "only 'starting' while adopting: {page}");
        assert!(page.contains("\"instance_starting\""), "{page}");
        None
    })
    .await;
    assert!(page.contains("bob"), "{page}");
    let adopted = pod(double, "berth-bob").expect("bob's pod");
    assert_eq!(uid(&adopted), uid(&first));
    assert_eq!(double.creates(Kind::Pod), 2, "adoption created a pod");

    // Stopped: the pod goes; the next request wakes a new one.
    assert_eq!(node.delete("/users/bob/instance").await, 204);
    eventually(PATIENCE, "bob's pod deleted", || async {
        pod(double, "berth-bob").is_none().then_some(())
    })
    .await;
    let (status, page) = through_proxy(&node, "/u/bob/", &bob).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("bob"), "{page}");
    let second = pod(double, "berth-bob").expect("bob's new pod");
    assert_ne!(uid(&second), uid(&first));
    assert_eq!(double.creates(Kind::Pod), 3);
}

// --- berth's shim in the pod: hibernation, the fence deadline, attacks ---

/// Three ways out of a program's process group, each appending a line to
/// a journal every 10 ms (see the script).
const ESCAPES: &str = include_str!("support/escapes.py");

/// `config` with the example's program replaced by the demo app, after a
/// python that leaves [`ESCAPES`]' three processes behind, writing to
/// `escapes.log` in the user's volume.
fn with_escapes(config: &str) -> String {
    let mut config: toml::Table = toml::from_str(config).unwrap();
    let k8s = config["kubernetes"].as_table_mut().unwrap();
    let argv = [
        "/bin/sh",
        "-c",
        "python3 -c \"$3\" \"$2\" & exec \"$0\" demo-app --host 0.0.0.0 --port \"$1\"",
        BERTH,
        "{port}",
        "/home/berth/escapes.log",
        ESCAPES,
    ];
    let argv = argv.iter().map(|a| toml::Value::from(*a)).collect();
    k8s.insert("command".into(), toml::Value::Array(argv));
    toml::to_string(&config).unwrap()
}

/// Lines in alice's escapes journal so far.
fn escape_lines(double: &ApiServerDouble) -> usize {
    let journal = double.claim_dir("berth-alice").join("escapes.log");
    std::fs::read_to_string(journal).map_or(0, |text| text.lines().count())
}

/// The processes of the pod `pod_uid`'s program: every process of the uid
/// its shim runs it as.
fn program_processes(double: &ApiServerDouble, pod_uid: &str) -> Vec<u32> {
    let uid = double.program_uid(pod_uid).expect("the pod's program uid");
    support::processes_of_account(uid, |_| true)
}

/// Waits until every process of the pod's program (the demo app and the
/// three escapes) is stopped by the kernel; the journal's length then.
async fn every_process_frozen(double: &ApiServerDouble, pod_uid: &str) -> usize {
    eventually(
        PATIENCE,
        "every process of alice's program frozen",
        || async {
            let pids = program_processes(double, pod_uid);
            (pids.len() >= 4 && pids.iter().all(|p| support::frozen(*p))).then_some(())
        },
    )
    .await;
    escape_lines(double)
}

/// Launches alice on [`with_escapes`]' program and waits until her
/// escapes write; her pod's UID.
async fn launch_escaping_alice(node: &Node, double: &ApiServerDouble) -> String {
    let (status, body) = node.post("/users/alice/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    let pod_uid = uid(&pod(double, "berth-alice").expect("alice's pod"));
    eventually(PATIENCE, "alice's escapes writing", || async {
        (escape_lines(double) >= 30).then_some(())
    })
    .await;
    pod_uid
}

/// A frozen program writes nothing while this passes; running, its
/// escapes write about 300 lines.
const FROZEN_WINDOW: Duration = Duration::from_secs(1);

/// The demo app's in-memory count, through the proxy.
async fn count(node: &Node, token: &str) -> u64 {
    let (status, body) = through_proxy(node, "/u/alice/counter", token).await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str::<Value>(&body).unwrap()["count"]
        .as_u64()
        .unwrap()
}

/// On Kubernetes with berth's shim as the pod's entrypoint, hibernation
/// freezes every process of the program inside the pod, `setsid` and
/// double-forked ones too, and a request resumes the same pod with its
/// memory: the same UID, no pod created, the demo app's count going on
/// from where it was, across a restart of berth in between, which adopts
/// the pod hibernated. A stop of the hibernated pod then kills it frozen:
/// not one more line is written, and none of its processes is left.
#[tokio::test(flavor = "multi_thread")]
async fn a_hibernated_pod_is_frozen_whole_and_a_request_resumes_the_same_pod() {
    if !support::root(
        "kubernetes::a_hibernated_pod_is_frozen_whole_and_a_request_resumes_the_same_pod",
    ) {
        return;
    }
    let cluster = Cluster::start().await;
    let double = &cluster.double;
    let (dir, config) = cluster.config(None, "solo");
    let mut node = start(dir, with_escapes(&config)).await;
    let alice = node.user_token("alice").await;
    let pod_uid = launch_escaping_alice(&node, double).await;
    let before = count(&node, &alice).await;

    let (status, body) = node
        .post("/users/alice/instance/hibernate", json!({}))
        .await;
    assert_eq!(status, 200, "{body}");
    let frozen_at = every_process_frozen(double, &pod_uid).await;
    tokio::time::sleep(FROZEN_WINDOW).await;
    assert_eq!(escape_lines(double), frozen_at, "a frozen process wrote");
    assert_eq!(node.status_of("alice").await, "hibernated");

    // A restarted berth adopts the pod hibernated (its shim says frozen):
    // it stays frozen until a request resumes it.
    node.kill9();
    node.restart();
    node.adopted().await;
    assert_eq!(node.status_of("alice").await, "hibernated");
    assert_eq!(escape_lines(double), frozen_at, "a frozen process wrote");

    assert_eq!(count(&node, &alice).await, before + 1, "memory kept");
    // The record follows the resume on a task of its own.
    eventually(PATIENCE, "alice recorded running", || async {
        (node.status_of("alice").await == "running").then_some(())
    })
    .await;
    assert_eq!(uid(&pod(double, "berth-alice").unwrap()), pod_uid);
    assert_eq!(double.creates(Kind::Pod), 1, "a pod was created to resume");
    eventually(PATIENCE, "alice's escapes writing again", || async {
        (escape_lines(double) > frozen_at + 30).then_some(())
    })
    .await;

    let (status, body) = node
        .post("/users/alice/instance/hibernate", json!({}))
        .await;
    assert_eq!(status, 200, "{body}");
    let frozen_at = every_process_frozen(double, &pod_uid).await;
    assert_eq!(node.delete("/users/alice/instance").await, 204);
    eventually(PATIENCE, "alice's pod gone", || async {
        pod(double, "berth-alice").is_none().then_some(())
    })
    .await;
    eventually(PATIENCE, "no process of alice's program left", || async {
        program_processes(double, &pod_uid).is_empty().then_some(())
    })
    .await;
    assert_eq!(
        escape_lines(double),
        frozen_at,
        "the stopped pod ran again before it died"
    );
}

/// A replica that can reach nothing (stopped: no store, no API server, no
/// pod) has its pod's program frozen by the pod's own shim at the fence
/// deadline, every process of it, and it stays frozen.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_cut_off_from_everything_has_its_pod_frozen_at_the_fence_deadline() {
    if !support::root(
        "kubernetes::a_replica_cut_off_from_everything_has_its_pod_frozen_at_the_fence_deadline",
    ) {
        return;
    }
    let cluster = Cluster::start().await;
    let double = &cluster.double;
    let db = fresh_db().await;
    let (dir, config) = cluster.config(Some(&db), "replica-a");
    let mut node = start(dir, with_escapes(&config)).await;
    let pod_uid = launch_escaping_alice(&node, double).await;

    let berth = nix::unistd::Pid::from_raw(i32::try_from(node.pid().unwrap()).unwrap());
    nix::sys::signal::kill(berth, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let frozen_at = every_process_frozen(double, &pod_uid).await;
    tokio::time::sleep(FROZEN_WINDOW).await;
    assert_eq!(escape_lines(double), frozen_at, "a fenced process wrote");
    nix::sys::signal::kill(berth, nix::sys::signal::Signal::SIGCONT).unwrap();
    node.kill9();
}

/// What the program in a pod tries against its shim, as its own uid: read
/// the shim's environment (where its credential is), kill or stop it, and
/// find the credential in its own environment. It writes what happened
/// to `attack.json` in its volume, then becomes the demo app.
const ATTACK: &str = r#"
import json, os, signal, sys
shim = os.getppid()
found = {}
try:
    found["environ"] = open("/proc/%d/environ" % shim, "rb").read().decode(errors="replace")
except OSError as e:
    found["environ"] = "refused: %s" % e.strerror
for name in ("SIGKILL", "SIGSTOP", "SIGTERM"):
    try:
        os.kill(shim, getattr(signal, name))
        found[name] = "sent"
    except OSError as e:
        found[name] = "refused: %s" % e.strerror
found["own"] = sorted(k for k in os.environ if k.startswith("BERTH_SHIM"))
found["uid"] = os.getuid()
with open(os.path.join(os.environ["HOME"], "attack.json"), "w") as f:
    json.dump(found, f)
os.execv(sys.argv[1], [sys.argv[1], "demo-app", "--host", "0.0.0.0", "--port", sys.argv[2]])
"#;

/// The shim's boundary, attacked from both sides. From inside, as the
/// program's uid: it cannot read the shim's environment, signal it, or
/// find the credential in its own. From outside, as a client that does
/// not hold the credential: a wrong one, none, or a command sent as the
/// first line is refused, and the program runs on; the same port serves
/// the right credential, so those refusals are the check's, not a closed
/// port's.
#[tokio::test(flavor = "multi_thread")]
async fn a_pods_program_cannot_reach_its_shims_credential_and_no_stranger_commands_it() {
    if !support::root(
        "kubernetes::a_pods_program_cannot_reach_its_shims_credential_and_no_stranger_commands_it",
    ) {
        return;
    }
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

    let cluster = Cluster::start().await;
    let double = &cluster.double;
    let (dir, config) = cluster.config(None, "solo");
    let mut config: toml::Table = toml::from_str(&config).unwrap();
    let argv = ["/usr/bin/python3", "-c", ATTACK, BERTH, "{port}"];
    config["kubernetes"].as_table_mut().unwrap().insert(
        "command".into(),
        toml::Value::Array(argv.iter().map(|a| toml::Value::from(*a)).collect()),
    );
    let node = start(dir, toml::to_string(&config).unwrap()).await;
    let (status, body) = node.post("/users/alice/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    let alice = pod(double, "berth-alice").expect("alice's pod");
    let pod_uid = uid(&alice);

    let report: Value = serde_json::from_str(
        &std::fs::read_to_string(double.claim_dir("berth-alice").join("attack.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        report["uid"],
        double.program_uid(&pod_uid).unwrap(),
        "{report}"
    );
    for what in ["environ", "SIGKILL", "SIGSTOP", "SIGTERM"] {
        let outcome = report[what].as_str().unwrap();
        assert!(outcome.starts_with("refused"), "{what}: {report}");
    }
    assert_eq!(report["own"], json!([]), "{report}");

    let port = double.shim_port(&pod_uid).expect("the shim's port");
    let credential = berth_core::credential::ShimKey::new(SECRET.as_bytes()).credential(
        "berth-alice",
        &annotation(&alice, berth_k8s::names::SHIM_NONCE_ANNOTATION),
    );
    let wrong = "0".repeat(credential.len());
    for first in [wrong.as_str(), "", r#"{"cmd":"kill"}"#] {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let attempt = format!("{first}\n{{\"cmd\":\"kill\"}}\n{{\"cmd\":\"freeze\"}}\n");
        let _ = stream.write_all(attempt.as_bytes()).await;
        let mut answer = String::new();
        let _ = BufReader::new(stream).read_line(&mut answer).await;
        assert_eq!(answer, "", "served after {first:?}");
    }
    let (status, page) = through_proxy(&node, "/u/alice/", &node.user_token("alice").await).await;
    assert_eq!(status, 200, "{page}");
    assert!(double.running(&pod_uid), "alice's pod ended");
    assert!(
        program_processes(double, &pod_uid)
            .iter()
            .all(|p| !support::frozen(*p)),
        "alice's program was frozen"
    );

    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    stream
        .write_all(format!("{credential}\n").as_bytes())
        .await
        .unwrap();
    let mut hello = String::new();
    BufReader::new(stream).read_line(&mut hello).await.unwrap();
    assert!(hello.contains("\"event\":\"hello\""), "{hello}");
}
