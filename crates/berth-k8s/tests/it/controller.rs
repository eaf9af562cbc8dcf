//! berth's controller (written once for every runtime) driving the
//! Kubernetes runtime on the API server **double**, with a real SQLite
//! store: a restarted berth adopts its pods and recreates nothing, an
//! orphan pod is removed, a pod deleted behind berth's back is restarted
//! through the crash policy, a crash-looping pod opens the breaker, and a
//! user's own egress policy is their pods' NetworkPolicy.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_controller::{Controller, ControllerConfig};
use berth_core::egress::EgressPolicy;
use berth_core::policy::{CrashPolicy, ReapPolicy};
use berth_core::runtime::Runtime;
use berth_core::runtime_contract;
use berth_core::{Instance, InstanceStatus, LaunchRequest, SpawnError, Spawner, Traffic, UserId};
use berth_k8s::names;
use berth_k8s::testing::{ApiServerDouble, Kind};
use berth_store::Store;
use support::*;

pub(crate) struct Env {
    _dir: tempfile::TempDir,
    pub store: Arc<dyn Store>,
    pub double: ApiServerDouble,
}

impl Env {
    pub async fn new() -> Env {
        let dir = tempfile::tempdir().unwrap();
        let store = berth_store::open(&format!("sqlite://{}/berth.db", dir.path().display()))
            .await
            .unwrap();
        Env {
            _dir: dir,
            store,
            double: ApiServerDouble::start().await,
        }
    }

    pub async fn controller(&self, command: Vec<String>, crash: CrashPolicy) -> Arc<Controller> {
        self.controller_with(config(command, token_regex(), "node-a"), crash)
            .await
    }

    /// A controller over a runtime with `config`.
    pub async fn controller_with(
        &self,
        config: berth_k8s::K8sRuntimeConfig,
        crash: CrashPolicy,
    ) -> Arc<Controller> {
        let runtime = runtime(&self.double, config);
        let config = ControllerConfig {
            ready_timeout: Duration::from_secs(20),
            stop_grace: Duration::from_secs(2),
            crash,
            reap: ReapPolicy {
                idle_ttl: None,
                max_idle: 0,
                interval: Duration::from_secs(60),
                hibernate_after: None,
                ..ReapPolicy::default()
            },
            ..ControllerConfig::new("node-a")
        };
        Controller::start(runtime, self.store.clone(), config)
            .await
            .unwrap()
    }
}

fn quick_crashes() -> CrashPolicy {
    CrashPolicy {
        backoff_base: Duration::from_millis(20),
        backoff_max: Duration::from_millis(50),
        ..CrashPolicy::default()
    }
}

async fn main_of(controller: &Controller, u: &UserId) -> Option<Instance> {
    controller.status(u).await.unwrap().main
}

pub(crate) async fn wait_for(
    controller: &Controller,
    u: &UserId,
    what: &str,
    check: impl Fn(&Instance) -> bool,
) -> Instance {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(main) = main_of(controller, u).await.filter(|i| check(i)) {
            return main;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {u} to be {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub(crate) async fn running(controller: &Controller, u: &UserId) -> Instance {
    wait_for(controller, u, "running", |i| {
        i.status == InstanceStatus::Running && i.ready
    })
    .await
}

fn pod_uid(double: &ApiServerDouble, u: &UserId) -> Option<String> {
    double
        .object(Kind::Pod, NS, &names::user_object(&u.slug()))
        .and_then(|p| p["metadata"]["uid"].as_str().map(str::to_owned))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_berth_adopts_its_pods_recreates_nothing_and_removes_orphans() {
    let env = Env::new().await;
    let command = sh(&format!(
        "echo ready token={}; exec sleep 1000",
        runtime_contract::TOKEN
    ));
    let first = env.controller(command.clone(), quick_crashes()).await;
    let alice = user("alice");
    first
        .launch(&alice, LaunchRequest::default())
        .await
        .unwrap();
    let before = running(&first, &alice).await;
    // The configured idle action is the default, hibernate; Kubernetes
    // cannot freeze a pod, so idle instances are stopped, and status says so.
    let status = first.status(&alice).await.unwrap();
    assert_eq!(status.idle_action.as_deref(), Some("stop"), "{status:?}");
    let uid = pod_uid(&env.double, &alice).unwrap();
    first.teardown().await;

    // A pod of this node that no record knows: an orphan.
    let stray = runtime(
        &env.double,
        config(command.clone(), token_regex(), "node-a"),
    );
    let zed = user("zed");
    let mut orphan = stray
        .start(runtime_contract::spec(&zed, "stray"))
        .await
        .unwrap();
    ready(&mut orphan).await;
    stray.shutdown().await;

    let second = env.controller(command, quick_crashes()).await;
    // The controller adopts after it starts: alice's record says running
    // before and after, her route says she is adopted.
    eventually("alice to be adopted", || {
        second.endpoint_for(&alice).is_some()
    })
    .await;
    let after = running(&second, &alice).await;
    assert_eq!(
        pod_uid(&env.double, &alice).as_deref(),
        Some(uid.as_str()),
        "the same pod"
    );
    assert_eq!(after.runtime_ref, before.runtime_ref);
    assert_eq!(
        (after.id.as_str(), after.epoch, after.restarts),
        (before.id.as_str(), before.epoch, 0)
    );
    assert_eq!(
        second.launch_token(&alice).as_deref(),
        Some(runtime_contract::TOKEN)
    );
    eventually("the orphan to be removed", || {
        pod_uid(&env.double, &zed).is_none()
    })
    .await;
    assert_eq!(
        env.double.creates(Kind::Pod),
        2,
        "alice's pod and the orphan, nothing else"
    );
    assert!(env.double.running(&uid));

    second.stop(&alice).await.unwrap();
    wait_for(&second, &alice, "stopped", |i| {
        i.status == InstanceStatus::Stopped
    })
    .await;
    eventually("alice's pod to go", || {
        pod_uid(&env.double, &alice).is_none()
    })
    .await;
    second.teardown().await;
}

/// A pod deleted behind berth's back is a crash: the crash policy
/// restarts it as a new pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleted_behind_berths_back_is_restarted_by_the_crash_policy() {
    let env = Env::new().await;
    let command = sh("echo ready token=t; exec sleep 1000");
    let controller = env.controller(command, quick_crashes()).await;
    let bob = user("bob");
    controller
        .launch(&bob, LaunchRequest::default())
        .await
        .unwrap();
    running(&controller, &bob).await;
    let uid = pod_uid(&env.double, &bob).unwrap();
    env.double
        .delete_behind_back(Kind::Pod, NS, &names::user_object(&bob.slug()));
    let again = wait_for(&controller, &bob, "restarted", |i| {
        i.restarts == 1 && i.status == InstanceStatus::Running && i.ready
    })
    .await;
    assert!(
        again
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("deleted outside berth")),
        "{again:?}"
    );
    let new_uid = pod_uid(&env.double, &bob).unwrap();
    assert_ne!(new_uid, uid);
    assert!(env.double.running(&new_uid));
    controller.stop(&bob).await.unwrap();
    controller.teardown().await;
}

/// Every exit of a crash-looping pod reaches the crash policy: the
/// breaker opens after the window's budget, and shows in the status and
/// the breaker fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_looping_pod_opens_the_breaker() {
    let env = Env::new().await;
    let command = sh("echo 'cannot read config' >&2; exit 2");
    let crash = CrashPolicy {
        max_restarts_in_window: 3,
        ..quick_crashes()
    };
    let controller = env.controller(command, crash).await;
    let carol = user("carol");
    controller
        .launch(&carol, LaunchRequest::default())
        .await
        .unwrap();
    let failed = wait_for(&controller, &carol, "failed", |i| {
        i.status == InstanceStatus::Failed
    })
    .await;
    assert_eq!(failed.restarts, 3, "{failed:?}");
    assert_eq!(failed.exit_code, Some(2));
    assert!(
        failed
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("cannot read config")),
        "{failed:?}"
    );
    let breaker = controller
        .breaker_info(&carol)
        .await
        .unwrap()
        .expect("an open breaker");
    assert_eq!(breaker.opens, 1);
    assert_eq!(env.double.creates(Kind::Pod), 4, "one pod per run");
    match controller.launch(&carol, LaunchRequest::default()).await {
        Err(berth_core::SpawnError::CircuitOpen { opens, .. }) => assert_eq!(opens, 1),
        other => panic!("expected the open breaker, got {other:?}"),
    }
    // The failed instance's last pod is given back once the controller is
    // done with it; its log stays readable.
    eventually("the last pod to go", || {
        pod_uid(&env.double, &carol).is_none()
    })
    .await;
    let logs = controller.logs(&carol, 5).await.unwrap();
    assert_eq!(logs, ["cannot read config"]);
    controller.teardown().await;
}

fn egress(mode: &str, allow: &[&str]) -> EgressPolicy {
    serde_json::from_value(serde_json::json!({ "mode": mode, "allow": allow })).unwrap()
}

/// The egress rules of `u`'s NetworkPolicy, as the API server holds them.
fn egress_rules(double: &ApiServerDouble, u: &UserId) -> Option<serde_json::Value> {
    double
        .object(Kind::NetworkPolicy, NS, &names::user_object(&u.slug()))
        .map(|p| p["spec"]["egress"].clone())
}

/// A user's own egress policy is their pods' NetworkPolicy: set before
/// their first start, it guards that start; changed while the pod runs,
/// the NetworkPolicy is replaced and the same pod goes on; a domain name,
/// which a NetworkPolicy cannot hold, is refused and changes nothing;
/// cleared, the node's policy (the internet, nothing private) is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_own_egress_policy_is_their_pods_network_policy_and_changes_while_it_runs() {
    let env = Env::new().await;
    let controller = env
        .controller(sh("echo ready token=t; exec sleep 1000"), quick_crashes())
        .await;
    let carol = user("carol");
    let dns = |rules: &serde_json::Value| {
        rules
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["ports"][0]["port"] == 53)
            .count()
    };

    let mirror = egress("allowlist", &["10.8.0.5:5432"]);
    controller.set_egress(&carol, Some(&mirror)).await.unwrap();
    assert_eq!(
        egress_rules(&env.double, &carol),
        None,
        "nothing before a start"
    );
    controller
        .launch(&carol, LaunchRequest::default())
        .await
        .unwrap();
    running(&controller, &carol).await;
    let rules = egress_rules(&env.double, &carol).unwrap();
    assert_eq!(
        rules[0],
        serde_json::json!({
            "to": [{ "ipBlock": { "cidr": "10.8.0.5/32" } }],
            "ports": [{ "protocol": "TCP", "port": 5432 }, { "protocol": "UDP", "port": 5432 }],
        })
    );
    assert_eq!((rules.as_array().unwrap().len(), dns(&rules)), (2, 1));
    let pod = pod_uid(&env.double, &carol).unwrap();

    controller
        .set_egress(&carol, Some(&egress("deny_all", &[])))
        .await
        .unwrap();
    let rules = egress_rules(&env.double, &carol).unwrap();
    assert_eq!(
        (rules.as_array().unwrap().len(), dns(&rules)),
        (1, 1),
        "{rules}"
    );
    assert_eq!(pod_uid(&env.double, &carol).as_deref(), Some(pod.as_str()));
    assert!(env.double.running(&pod));

    let err = controller
        .set_egress(&carol, Some(&egress("allowlist", &["pypi.org"])))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, SpawnError::InvalidRequest(why) if why.contains("pypi.org is a domain name")),
        "{err}"
    );
    assert_eq!(
        env.store.user_egress(&carol).await.unwrap(),
        Some(egress("deny_all", &[]))
    );
    assert_eq!(egress_rules(&env.double, &carol), Some(rules));

    controller.set_egress(&carol, None).await.unwrap();
    let rules = egress_rules(&env.double, &carol).unwrap();
    assert_eq!(rules[0]["to"][0]["ipBlock"]["cidr"], "0.0.0.0/0", "{rules}");
    assert_eq!(env.store.user_egress(&carol).await.unwrap(), None);
    assert!(env.double.running(&pod));
    controller.teardown().await;
}
