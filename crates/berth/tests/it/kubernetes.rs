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
/// names the image's `/usr/local/bin/berth`), and the EndpointSlice
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
    if let Some(store) = store {
        set(&mut config, "store", store.into());
        set(&mut config, "cluster_secret", SECRET.into());
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
    toml::to_string(&config).unwrap()
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
    let double = ApiServerDouble::start().await;
    let root = tempfile::tempdir().unwrap();
    let kubeconfig = kubeconfig(&double, root.path());
    let dir = root.path().join("node");
    let config = config_from_example(&dir, &kubeconfig, None, "solo");
    let mut node = start(dir.clone(), config.clone()).await;
    let bob = node.user_token("bob").await;
    assert_eq!(node.status_of("bob").await, "none");
    assert!(pod(&double, "berth-bob").is_none());

    let (status, page) = through_proxy(&node, "/u/bob/", &bob).await;
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("berth demo app") && page.contains("bob"),
        "{page}"
    );
    assert_eq!(node.status_of("bob").await, "running");
    let first = pod(&double, "berth-bob").expect("bob's pod");
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
    assert!(pod(&double, "berth-carol").is_some());
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
    let adopted = pod(&double, "berth-bob").expect("bob's pod");
    assert_eq!(uid(&adopted), uid(&first));
    assert_eq!(double.creates(Kind::Pod), 2, "adoption created a pod");

    // Stopped: the pod goes; the next request wakes a new one.
    assert_eq!(node.delete("/users/bob/instance").await, 204);
    eventually(PATIENCE, "bob's pod deleted", || async {
        pod(&double, "berth-bob").is_none().then_some(())
    })
    .await;
    let (status, page) = through_proxy(&node, "/u/bob/", &bob).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("bob"), "{page}");
    let second = pod(&double, "berth-bob").expect("bob's new pod");
    assert_ne!(uid(&second), uid(&first));
    assert_eq!(double.creates(Kind::Pod), 3);
}
