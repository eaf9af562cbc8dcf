use serde_json::json;

use super::*;

fn running(uid: &str) -> PodView {
    PodView {
        name: "berth-alice".into(),
        uid: uid.into(),
        phase: "Running".into(),
        main: ContainerView {
            running: true,
            ..ContainerView::default()
        },
        epoch: Some(3),
        ..PodView::default()
    }
}

fn ready(uid: &str) -> PodView {
    PodView {
        ready: true,
        ..running(uid)
    }
}

fn terminated(code: i32, reason: &str, message: &str) -> Terminated {
    Terminated {
        exit_code: code,
        signal: None,
        reason: Some(reason.into()),
        message: Some(message.into()),
    }
}

fn ended(uid: &str, t: Terminated) -> PodView {
    PodView {
        phase: if t.exit_code == 0 {
            "Succeeded"
        } else {
            "Failed"
        }
        .into(),
        ready: false,
        main: ContainerView {
            terminated: Some(t),
            ..ContainerView::default()
        },
        ..running(uid)
    }
}

fn exit(steps: &[Step]) -> (ExitStatus, bool) {
    match steps {
        [Step::Finish { exit, delete }] => (exit.clone(), *delete),
        other => panic!("expected one Finish, got {other:?}"),
    }
}

#[test]
fn a_ready_line_without_a_token_makes_the_pod_ready_without_one() {
    let mut t = Tracker::new("u1", 3, true, None);
    assert_eq!(t.observe(&ready("u1")), [Step::ScanLog]);
    assert_eq!(
        t.ready_line_found(None, &ready("u1")),
        [Step::Emit(RuntimeEvent::Ready { token: None })]
    );
    assert_eq!(t.ready_line_found(Some("late".into()), &ready("u1")), []);
}

#[test]
fn ready_comes_once_with_the_pods_condition() {
    let mut t = Tracker::new("u1", 3, false, None);
    assert_eq!(t.observe(&running("u1")), []);
    let ready_event = Step::Emit(RuntimeEvent::Ready { token: None });
    assert_eq!(t.observe(&ready("u1")), [ready_event]);
    assert_eq!(t.observe(&ready("u1")), []);
    assert_eq!(t.observe(&running("u1")), [], "not ready again: no event");
}

#[test]
fn with_a_token_regex_ready_waits_for_the_token() {
    let mut t = Tracker::new("u1", 3, true, None);
    let pending = PodView {
        phase: "Pending".into(),
        main: ContainerView::default(),
        ..running("u1")
    };
    assert_eq!(t.observe(&pending), [], "nothing to scan before it starts");
    assert_eq!(t.observe(&ready("u1")), [Step::ScanLog]);
    assert_eq!(t.observe(&ready("u1")), [], "one scan");
    assert_eq!(
        t.ready_line_found(Some("tok".into()), &ready("u1")),
        [Step::Emit(RuntimeEvent::Ready {
            token: Some("tok".into())
        })]
    );
    // Token first, condition later.
    let mut t = Tracker::new("u1", 3, true, None);
    assert_eq!(t.observe(&running("u1")), [Step::ScanLog]);
    assert_eq!(t.ready_line_found(Some("tok".into()), &running("u1")), []);
    assert_eq!(
        t.observe(&ready("u1")),
        [Step::Emit(RuntimeEvent::Ready {
            token: Some("tok".into())
        })]
    );
}

#[test]
fn an_exit_carries_code_message_and_out_of_memory() {
    let mut t = Tracker::new("u1", 3, false, Some(512));
    t.observe(&ready("u1"));
    let (e, delete) = exit(&t.observe(&ended("u1", terminated(3, "Error", "boom\n"))));
    assert_eq!(
        (e.code, e.stderr_tail.as_str(), delete),
        (Some(3), "boom", false)
    );
    assert_eq!(e.out_of_memory, None);
    assert_eq!(
        t.observe(&ended("u1", terminated(3, "Error", ""))),
        [],
        "once"
    );

    let mut t = Tracker::new("u1", 3, false, Some(512));
    let (e, _) = exit(&t.observe(&ended("u1", terminated(137, "OOMKilled", ""))));
    assert_eq!(e.out_of_memory, Some(OutOfMemory { limit_mb: 512 }));

    let long = "x".repeat(2000);
    let mut t = Tracker::new("u1", 3, false, None);
    let (e, _) = exit(&t.observe(&ended("u1", terminated(1, "Error", &long))));
    assert_eq!(e.stderr_tail.chars().count(), TAIL_CHARS);
}

#[test]
fn a_failed_pod_without_container_state_is_an_exit() {
    let evicted = PodView {
        phase: "Failed".into(),
        reason: Some("Evicted".into()),
        message: Some("The node was low on resource: memory.".into()),
        main: ContainerView::default(),
        ..running("u1")
    };
    let mut t = Tracker::new("u1", 3, false, None);
    let (e, _) = exit(&t.observe(&evicted));
    assert_eq!(e.code, None);
    assert!(e.stderr_tail.contains("Evicted"), "{e:?}");
}

#[test]
fn a_pod_deleted_or_replaced_behind_berths_back_ends_the_run() {
    let mut t = Tracker::new("u1", 3, false, None);
    t.observe(&ready("u1"));
    let gone = PodView {
        gone: true,
        ..ready("u1")
    };
    let (e, delete) = exit(&t.observe(&gone));
    assert!(e.stderr_tail.contains("deleted outside berth"), "{e:?}");
    assert!(!delete);

    let mut t = Tracker::new("u1", 3, false, None);
    let (e, delete) = exit(&t.observe(&ready("u2")));
    assert!(e.stderr_tail.contains("another took its name"), "{e:?}");
    assert!(!delete, "the new pod is not this run's to delete");
}

#[test]
fn a_container_restart_is_an_exit_and_the_pod_goes() {
    let mut t = Tracker::new("u1", 3, false, None);
    let mut view = ready("u1");
    view.main.restart_count = 2;
    t.observe(&view);
    view.main.restart_count = 3;
    view.main.last_terminated = Some(terminated(2, "Error", "crashed"));
    let (e, delete) = exit(&t.observe(&view));
    assert_eq!(
        (e.code, e.stderr_tail.as_str(), delete),
        (Some(2), "crashed", true)
    );
}

#[test]
fn a_takeover_by_a_newer_epoch_ends_the_run_without_touching_the_pod() {
    let mut t = Tracker::new("u1", 3, false, None);
    t.observe(&ready("u1"));
    let mut view = ready("u1");
    view.epoch = Some(4);
    let (e, delete) = exit(&t.observe(&view));
    assert!(e.stderr_tail.contains("epoch 4"), "{e:?}");
    assert!(!delete);
}

#[test]
fn a_container_that_cannot_start_fails_the_start() {
    let mut view = running("u1");
    view.main = ContainerView {
        terminated: Some(terminated(
            128,
            "StartError",
            "exec: \"nope\": executable file not found in $PATH",
        )),
        ..ContainerView::default()
    };
    view.phase = "Failed".into();
    assert!(
        matches!(start_outcome(&view), Some(StartOutcome::Failed(m)) if m.contains("\"nope\""))
    );
    let mut view = running("u1");
    view.main = ContainerView {
        waiting: Some(("ErrImagePull".into(), "no such image".into())),
        ..ContainerView::default()
    };
    assert_eq!(
        start_outcome(&view),
        Some(StartOutcome::Failed("ErrImagePull: no such image".into()))
    );
    let mut t = Tracker::new("u1", 3, false, None);
    assert!(
        exit(&t.observe(&view)).1,
        "a pod that can never run is deleted"
    );

    // Pulling or scheduling: not over yet.
    let mut view = running("u1");
    view.main = ContainerView {
        waiting: Some(("ContainerCreating".into(), String::new())),
        ..ContainerView::default()
    };
    view.unschedulable = Some("0/3 nodes are available".into());
    assert_eq!(start_outcome(&view), None);
    assert_eq!(start_outcome(&running("u1")), Some(StartOutcome::Runs));
    let quick_exit = ended("u1", terminated(3, "Error", "boom"));
    assert_eq!(
        start_outcome(&quick_exit),
        Some(StartOutcome::Runs),
        "its exit follows as an event"
    );
}

#[test]
fn a_view_is_read_from_a_pod() {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {
            "name": "berth-alice", "uid": "u1",
            "labels": { "berth.dev/slug": "alice", "berth.dev/role": "main" },
            "annotations": { "berth.dev/user": "Alice", "berth.dev/epoch": "7", "berth.dev/instance": "i-1" },
            "finalizers": ["berth.dev/collect-exit"],
            "deletionTimestamp": "2025-01-01T00:00:00Z",
        },
        "status": {
            "phase": "Running",
            "conditions": [
                { "type": "Ready", "status": "True" },
                { "type": "PodScheduled", "status": "True" },
            ],
            "containerStatuses": [
                { "name": "files", "ready": true, "restartCount": 9, "image": "f", "imageID": "" },
                {
                    "name": "main", "ready": true, "restartCount": 1, "image": "a", "imageID": "",
                    "state": { "running": { "startedAt": "2025-01-01T00:00:00Z" } },
                    "lastState": { "terminated": { "exitCode": 2, "reason": "Error" } },
                },
            ],
        },
    }))
    .unwrap();
    let view = PodView::of(&pod);
    assert_eq!(view.user.as_deref(), Some("Alice"));
    assert_eq!(
        (view.epoch, view.instance.as_deref()),
        (Some(7), Some("i-1"))
    );
    assert!(view.ready && view.deleting && view.finalized && view.alive());
    assert_eq!(
        view.main.restart_count, 1,
        "the program's container, not the sidecar"
    );
    assert_eq!(
        view.main.last_terminated.as_ref().map(|t| t.exit_code),
        Some(2)
    );
    assert_eq!(view.runtime_ref().as_str(), "berth-alice/u1/7");
    assert_eq!(
        parse_ref(&view.runtime_ref()),
        Some(("berth-alice", "u1", 7))
    );
    assert_eq!(parse_ref(&RuntimeRef::new("garbage")), None);
}
