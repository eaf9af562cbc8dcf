//! What only the Kubernetes runtime has, on the API server **double**:
//! the user's objects, a watch resumed after 410 Gone, pods changed
//! behind berth's back, the create-or-replace rules (an ended pod is
//! collected, a live one of the same template is taken over in place, an
//! outdated one replaced), epoch-fenced deletes, scheduling failures, the
//! Service's endpoint, and watchdog pods.

use crate::support;

use std::time::Duration;

use berth_core::Readiness;
use berth_core::Role;
use berth_core::runtime::{
    HookAction, HookCall, InstanceSpec, Patch, Runtime, RuntimeError, RuntimeEvent,
};
use berth_core::runtime_contract::{self, TOKEN};
use berth_k8s::testing::{ApiServerDouble, Kind};
use berth_k8s::{K8sRuntime, names};
use support::*;

fn spec(user: &berth_core::UserId, instance: &str, epoch: i64) -> InstanceSpec {
    let mut spec = runtime_contract::spec(user, instance);
    spec.epoch = epoch;
    spec
}

fn pod_of(double: &ApiServerDouble, slug: &berth_core::Slug) -> Option<serde_json::Value> {
    double.object(Kind::Pod, NS, &names::user_object(slug))
}

fn ready_line() -> Vec<String> {
    sh(&format!("echo ready token={TOKEN}; exec sleep 1000"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_makes_the_users_objects_and_the_program_sees_its_patch() {
    let double = ApiServerDouble::start().await;
    let command = sh(
        r#"cat "$BERTH_PATCH"; echo; echo "user=$BERTH_USER epoch=$BERTH_EPOCH role=$BERTH_ROLE extra=$EXTRA"; pwd; echo ready token=t; exec sleep 1000"#,
    );
    let runtime = runtime(&double, config(command, token_regex(), "node-a"));
    let raw = "a.b@corp.example";
    let alice = user(raw);
    let slug = alice.slug();
    let mut first = spec(&alice, "i-1", 4);
    first.patch = Patch::Set(Some("answer = 42".into()));
    first.folder = "proj".into();
    let mut started = runtime.start(first).await.unwrap();
    assert_eq!(ready(&mut started).await.as_deref(), Some("t"));
    let name = names::user_object(&slug);
    for kind in [
        Kind::Pod,
        Kind::Service,
        Kind::ConfigMap,
        Kind::NetworkPolicy,
        Kind::PersistentVolumeClaim,
    ] {
        let object = double
            .object(kind, NS, &name)
            .unwrap_or_else(|| panic!("no {kind:?} {name}"));
        assert_eq!(
            object["metadata"]["labels"][names::SLUG_LABEL],
            slug.as_str()
        );
        assert_eq!(object["metadata"]["labels"][names::MANAGED_BY], "berth");
        assert_eq!(
            object["metadata"]["annotations"][names::USER_ANNOTATION],
            raw
        );
    }
    let map = double.object(Kind::ConfigMap, NS, &name).unwrap();
    assert_eq!(map["data"]["main.toml"], "answer = 42");
    let lines = runtime.logs(&slug, Role::Main, 10).await.unwrap();
    assert_eq!(lines[0], "answer = 42");
    assert_eq!(
        lines[1],
        format!("user={raw} epoch=4 role=main extra=from-config")
    );
    assert!(
        lines[2].ends_with(&format!("claims/{name}/proj")),
        "{lines:?}"
    );
    runtime.kill(&started.runtime_ref).await.unwrap();
    exited(&mut started).await;

    // A restart keeps the patch; a new launch without one removes it.
    let mut again = spec(&alice, "i-1", 4);
    again.patch = Patch::Unchanged;
    let mut started = runtime.start(again).await.unwrap();
    ready(&mut started).await;
    assert_eq!(
        runtime.logs(&slug, Role::Main, 10).await.unwrap()[0],
        "answer = 42"
    );
    runtime.kill(&started.runtime_ref).await.unwrap();
    exited(&mut started).await;
    let mut started = runtime.start(spec(&alice, "i-2", 5)).await.unwrap();
    ready(&mut started).await;
    let map = double.object(Kind::ConfigMap, NS, &name).unwrap();
    assert!(map["data"].get("main.toml").is_none(), "{map}");
    // The user's claim was made once and never replaced.
    assert_eq!(double.creates(Kind::PersistentVolumeClaim), 1);
    assert_eq!(double.creates(Kind::Pod), 3);
    runtime.kill(&started.runtime_ref).await.unwrap();
    exited(&mut started).await;
    runtime.shutdown().await;
}

/// The watch is cut and its history compacted while the pod changes: the
/// runtime's resume gets 410 Gone, it lists again, and the change still
/// arrives, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_ended_by_410_gone_is_resumed_by_a_relist_and_no_event_is_lost() {
    let double = ApiServerDouble::start().await;
    // It never listens: its TCP probe keeps it unready until the double
    // is told otherwise.
    let command = sh("exec sleep 1000");
    let runtime = runtime(&double, config(command, Readiness::Tcp, "node-a"));
    let alice = user("alice");
    let name = names::user_object(&alice.slug());
    let mut started = runtime.start(spec(&alice, "i-1", 1)).await.unwrap();

    // Ready while nobody watches, with the history gone.
    let gone_before = double.gone_served();
    double.hold_watches();
    double.close_watches();
    double.set_ready(NS, &name, Some(true));
    eventually("the pod to be ready", || {
        pod_of(&double, &alice.slug()).is_some_and(|p| {
            p["status"]["conditions"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
        })
    })
    .await;
    double.compact();
    double.release_watches();
    assert_eq!(ready(&mut started).await, None);
    assert!(
        double.gone_served() > gone_before,
        "the resume was not answered 410"
    );

    // And its exit, the same way.
    let gone_before = double.gone_served();
    double.hold_watches();
    double.close_watches();
    double.evict(NS, &name);
    eventually("the eviction", || {
        pod_of(&double, &alice.slug()).is_some_and(|p| p["status"]["phase"] == "Failed")
    })
    .await;
    double.compact();
    double.release_watches();
    let exit = runtime_contract::exit_of(&mut started.events, |e| {
        matches!(e, RuntimeEvent::Ready { .. })
    })
    .await;
    assert!(exit.stderr_tail.contains("Evicted"), "{exit:?}");
    assert!(
        double.gone_served() > gone_before,
        "the resume was not answered 410"
    );
    runtime.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleted_behind_berths_back_is_an_exit_and_the_next_start_makes_a_new_one() {
    let double = ApiServerDouble::start().await;
    let runtime = runtime(&double, config(ready_line(), token_regex(), "node-a"));
    let bob = user("bob");
    let mut started = runtime.start(spec(&bob, "i-1", 1)).await.unwrap();
    ready(&mut started).await;
    double.delete_behind_back(Kind::Pod, NS, &names::user_object(&bob.slug()));
    let exit = exited(&mut started).await;
    assert!(
        exit.stderr_tail.contains("deleted outside berth"),
        "{exit:?}"
    );
    assert_eq!(exit.code, None);
    let mut again = spec(&bob, "i-1", 1);
    again.patch = Patch::Unchanged;
    let mut next = runtime.start(again).await.unwrap();
    ready(&mut next).await;
    assert_ne!(uid_of(&next.runtime_ref), uid_of(&started.runtime_ref));
    assert_eq!(double.creates(Kind::Pod), 2);
    runtime.kill(&next.runtime_ref).await.unwrap();
    exited(&mut next).await;
    runtime.shutdown().await;
}

/// berth's crash policy decides restarts: a restart the kubelet made
/// anyway is reported as the exit it was, and the pod goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_restart_is_an_exit_and_its_pod_is_deleted() {
    let double = ApiServerDouble::start().await;
    let runtime = runtime(&double, config(ready_line(), token_regex(), "node-a"));
    let carol = user("carol");
    let mut started = runtime.start(spec(&carol, "i-1", 1)).await.unwrap();
    ready(&mut started).await;
    double.restart_container(NS, &names::user_object(&carol.slug()));
    let exit = exited(&mut started).await;
    assert_eq!(exit.code, Some(137), "{exit:?}");
    eventually("the restarted pod to be gone", || {
        !present(&double, &started.runtime_ref)
    })
    .await;
    runtime.shutdown().await;
}

/// An ended pod keeps its name (and its log) until the next start, which
/// collects it and makes a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_pod_is_collected_by_the_next_start() {
    let double = ApiServerDouble::start().await;
    let command = sh("echo starting >&2; echo 'no config' >&2; exit 3");
    let runtime = runtime(&double, config(command, token_regex(), "node-a"));
    let dave = user("dave");
    let mut started = runtime.start(spec(&dave, "i-1", 1)).await.unwrap();
    let exit = exited(&mut started).await;
    assert_eq!(
        (exit.code, exit.stderr_tail.as_str()),
        (Some(3), "starting\nno config")
    );
    let pod = pod_of(&double, &dave.slug()).expect("the ended pod stays");
    assert_eq!(pod["status"]["phase"], "Failed");
    let logs = runtime.logs(&dave.slug(), Role::Main, 10).await.unwrap();
    assert_eq!(logs, ["starting", "no config"]);
    let mut again = spec(&dave, "i-1", 1);
    again.patch = Patch::Unchanged;
    let mut next = runtime.start(again).await.unwrap();
    assert_ne!(uid_of(&next.runtime_ref), uid_of(&started.runtime_ref));
    exited(&mut next).await;
    assert_eq!(double.creates(Kind::Pod), 2);
    // Released, the ended pod goes; its log stays readable.
    runtime.release("i-1").await;
    eventually("the ended pod to go", || {
        pod_of(&double, &dave.slug()).is_none()
    })
    .await;
    let logs = runtime.logs(&dave.slug(), Role::Main, 1).await.unwrap();
    assert_eq!(logs, ["no config"]);
    runtime.shutdown().await;
}

/// Another replica starting the user under a newer epoch takes the live
/// pod over without restarting it; the replica that lost it can no longer
/// delete it, and no longer discovers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_pod_is_taken_over_in_place_and_the_old_epoch_cannot_delete_it() {
    let double = ApiServerDouble::start().await;
    let a = runtime(&double, config(ready_line(), token_regex(), "node-a"));
    let b = runtime(&double, config(ready_line(), token_regex(), "node-b"));
    let erin = user("erin");
    let mut old = spec(&erin, "i-a", 1);
    old.patch = Patch::Set(Some("p".into()));
    let mut on_a = a.start(old).await.unwrap();
    ready(&mut on_a).await;

    let mut new = spec(&erin, "i-b", 2);
    new.patch = Patch::Set(Some("p".into()));
    let mut on_b = b.start(new).await.unwrap();
    assert_eq!(
        uid_of(&on_b.runtime_ref),
        uid_of(&on_a.runtime_ref),
        "the same pod"
    );
    assert_eq!(ready(&mut on_b).await.as_deref(), Some(TOKEN));
    assert_eq!(double.creates(Kind::Pod), 1, "nothing was recreated");
    let pod = pod_of(&double, &erin.slug()).unwrap();
    assert_eq!(pod["metadata"]["annotations"][names::EPOCH_ANNOTATION], "2");
    assert_eq!(
        pod["metadata"]["annotations"][names::NODE_ANNOTATION],
        "node-b"
    );
    assert_eq!(
        pod["metadata"]["annotations"][names::INSTANCE_ANNOTATION],
        "i-b"
    );

    // The old replica's run ends without touching the pod.
    let exit = exited(&mut on_a).await;
    assert!(exit.stderr_tail.contains("epoch 2"), "{exit:?}");
    assert_eq!(
        a.kill(&on_a.runtime_ref).await,
        Err(RuntimeError::Gone(on_a.runtime_ref.clone()))
    );
    assert_eq!(
        a.stop(&on_a.runtime_ref, Duration::from_secs(1)).await,
        Err(RuntimeError::Gone(on_a.runtime_ref.clone()))
    );
    assert!(double.running(&uid_of(&on_b.runtime_ref)));
    assert!(
        a.discover().await.unwrap().is_empty(),
        "node-a discovers node-b's pod"
    );
    let found = b.discover().await.unwrap();
    assert_eq!(found.len(), 1, "{:#?}", double.objects(Kind::Pod));
    assert_eq!((found[0].epoch, found[0].instance_id.as_str()), (2, "i-b"));
    assert_eq!(found[0].runtime_ref, on_b.runtime_ref);

    // An older epoch never takes it back.
    let err = a.start(spec(&erin, "i-a", 1)).await.unwrap_err();
    assert!(err.to_string().contains("managed under epoch 2"), "{err}");
    b.stop(&on_b.runtime_ref, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(exited(&mut on_b).await.code, Some(143), "ended by SIGTERM");
    a.shutdown().await;
    b.shutdown().await;
}

/// The race the epoch-fenced delete closes: another replica takes the pod
/// over (a newer epoch) after this replica read it and before its DELETE
/// lands. The DELETE is conditional on the resourceVersion read, so it is
/// refused; the replica reads again, finds the newer epoch, and leaves the
/// pod to its new holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_between_the_read_and_the_delete_keeps_the_pod() {
    let double = ApiServerDouble::start().await;
    let a = runtime(&double, config(ready_line(), token_regex(), "node-a"));
    let fay = user("fay");
    let mut on_a = a.start(spec(&fay, "i-a", 1)).await.unwrap();
    ready(&mut on_a).await;
    let name = names::user_object(&fay.slug());
    double.patch_before_next_delete(
        Kind::Pod,
        NS,
        &name,
        serde_json::json!({"metadata": {"annotations": {
            names::EPOCH_ANNOTATION: "2",
            names::NODE_ANNOTATION: "node-b",
        }}}),
    );
    assert_eq!(
        a.stop(&on_a.runtime_ref, Duration::from_secs(1)).await,
        Err(RuntimeError::Gone(on_a.runtime_ref.clone()))
    );
    let pod = pod_of(&double, &fay.slug()).expect("the pod is still there");
    assert_eq!(
        pod["metadata"]["uid"].as_str(),
        Some(uid_of(&on_a.runtime_ref).as_str())
    );
    assert_eq!(pod["metadata"]["annotations"][names::EPOCH_ANNOTATION], "2");
    assert!(
        pod["metadata"]["deletionTimestamp"].is_null(),
        "the new holder's pod is being deleted: {pod:#}"
    );
    assert!(double.running(&uid_of(&on_a.runtime_ref)));
    a.shutdown().await;
}

/// A live pod made from another template (a new image) or with another
/// patch is replaced, not taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_from_another_template_is_replaced() {
    let double = ApiServerDouble::start().await;
    let a = runtime(&double, config(ready_line(), token_regex(), "node-a"));
    let frank = user("frank");
    let mut first = a.start(spec(&frank, "i-1", 1)).await.unwrap();
    ready(&mut first).await;
    let mut newer = config(ready_line(), token_regex(), "node-a");
    newer.kubernetes.image = "double.invalid/not-pulled:2".into();
    let b = runtime(&double, newer);
    let mut second = b.start(spec(&frank, "i-2", 2)).await.unwrap();
    assert_ne!(uid_of(&second.runtime_ref), uid_of(&first.runtime_ref));
    assert_eq!(double.creates(Kind::Pod), 2);
    ready(&mut second).await;
    exited(&mut first).await;
    b.kill(&second.runtime_ref).await.unwrap();
    exited(&mut second).await;
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unschedulable_pod_fails_its_start_as_capacity_exhausted_and_leaves_nothing() {
    let double = ApiServerDouble::start().await;
    let mut config = config(ready_line(), token_regex(), "node-a");
    config.kubernetes.start_timeout_s = 1;
    let runtime = runtime(&double, config);
    double.set_unschedulable(true);
    let gina = user("gina");
    match runtime.start(spec(&gina, "i-1", 1)).await {
        Err(RuntimeError::CapacityExhausted(message)) => {
            assert!(
                message.contains("could not be scheduled within 1s"),
                "{message}"
            );
            assert!(message.contains("Insufficient memory"), "{message}");
        }
        other => panic!("expected CapacityExhausted, got {other:?}"),
    }
    eventually("the unscheduled pod to go", || {
        pod_of(&double, &gina.slug()).is_none()
    })
    .await;
    runtime.shutdown().await;
}

/// The endpoint names the user's Service; through the double's mapping
/// it reaches the real program, which becomes ready by its probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_reaches_the_program_behind_the_service() {
    let double = ApiServerDouble::start().await;
    let command = vec![
        "python3".into(),
        "-m".into(),
        "http.server".into(),
        "--bind".into(),
        "127.0.0.1".into(),
        "{port}".into(),
    ];
    let runtime = runtime(
        &double,
        config(
            command.clone(),
            Readiness::Http { path: "/".into() },
            "node-a",
        ),
    );
    let hank = user("hank");
    let mut started = runtime.start(spec(&hank, "i-1", 1)).await.unwrap();
    assert_eq!(ready(&mut started).await, None);
    let endpoint = started.endpoint.clone().unwrap();
    assert_eq!(
        Some(std::net::SocketAddr::from(([127, 0, 0, 1], endpoint.port))),
        double.endpoint(NS, &names::user_object(&hank.slug()))
    );
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(endpoint.authority())
        .await
        .unwrap();
    stream.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    // A hook's POST reaches the same program: python's server answers
    // 501 to a POST, and logs the request.
    let post = HookCall {
        name: "pre_stop",
        action: HookAction::Post("/flush".into()),
        grace: Duration::from_secs(20),
    };
    let outcome = runtime.run_hook(&started.runtime_ref, &post).await.unwrap();
    assert_eq!((outcome.code, outcome.timed_out), (Some(501), false));
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let lines = runtime.logs(&hank.slug(), Role::Main, 100).await.unwrap();
        if lines
            .iter()
            .any(|l| l.contains("\"POST /flush HTTP/1.1\" 501"))
        {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{lines:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    runtime
        .stop(&started.runtime_ref, Duration::from_secs(5))
        .await
        .unwrap();
    exited(&mut started).await;
    runtime.shutdown().await;

    // In a cluster, the endpoint is the Service's DNS name.
    let dns = K8sRuntime::new(double.client(), config(command, Readiness::Tcp, "node-a")).unwrap();
    let mut started = dns.start(spec(&hank, "i-2", 2)).await.unwrap();
    let endpoint = started.endpoint.clone().unwrap();
    assert_eq!(
        (endpoint.host.as_str(), endpoint.port),
        ("berth-hank.berth.svc.cluster.local", 8080)
    );
    dns.kill(&started.runtime_ref).await.unwrap();
    exited(&mut started).await;
    dns.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watchdog_pod_gets_its_handoff_and_the_patch() {
    let double = ApiServerDouble::start().await;
    let mut config = config(ready_line(), token_regex(), "node-a");
    config.program.watchdog_command = Some(sh(
        r#"echo "role=$BERTH_ROLE"; cat "$BERTH_HANDOFF"; echo; cat "$BERTH_PATCH"; echo"#,
    ));
    let runtime = runtime(&double, config);
    let ivan = user("ivan");
    let mut main = spec(&ivan, "i-1", 1);
    main.patch = Patch::Set(Some("answer = 42".into()));
    let mut main = runtime.start(main).await.unwrap();
    ready(&mut main).await;
    let dog = InstanceSpec {
        instance_id: "i-dog".into(),
        role: Role::Watchdog,
        epoch: 0,
        patch: Patch::Unchanged,
        handoff: Some(r#"{"exit_code":7}"#.into()),
        ..runtime_contract::spec(&ivan, "i-dog")
    };
    let mut watchdog = runtime.start(dog).await.unwrap();
    assert_eq!(watchdog.endpoint, None);
    assert_eq!(exited(&mut watchdog).await.code, Some(0));
    assert!(
        double
            .object(Kind::Pod, NS, &format!("berth-{}--wd", ivan.slug()))
            .is_some()
    );
    let log = runtime
        .logs(&ivan.slug(), Role::Watchdog, 10)
        .await
        .unwrap();
    assert_eq!(log, ["role=watchdog", r#"{"exit_code":7}"#, "answer = 42"]);
    runtime.kill(&main.runtime_ref).await.unwrap();
    exited(&mut main).await;
    runtime.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_a_message_and_changes_nothing() {
    let double = ApiServerDouble::start().await;
    let mut bad = config(ready_line(), token_regex(), "node-a");
    bad.kubernetes.namespace = "Not_A_Namespace".into();
    let err = K8sRuntime::new(double.client(), bad).err().unwrap();
    assert_eq!(
        err.to_string(),
        "kubernetes.namespace: \"Not_A_Namespace\" is not a DNS label (a-z, 0-9, '-', at most 63)"
    );
    let runtime = runtime(&double, config(ready_line(), token_regex(), "node-a"));
    let dog = InstanceSpec {
        role: Role::Watchdog,
        ..runtime_contract::spec(&user("judy"), "i-dog")
    };
    assert_eq!(
        runtime.start(dog).await.unwrap_err(),
        RuntimeError::SpawnFailed("no watchdog command is configured".into())
    );
    assert!(double.objects(Kind::Pod).is_empty());
    assert!(double.objects(Kind::ConfigMap).is_empty());
    runtime.shutdown().await;
}
