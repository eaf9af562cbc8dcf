//! The local runtime (`berth_local::LocalRuntime`) for real: the runtime
//! contract suite (`berth_core::runtime_contract`, which the Kubernetes
//! runtime runs too) against real shims started by the real `berth shim`,
//! running real `sh` programs, plus what only the local runtime has: ports
//! kept across a crash restart and given back, a port taken by another
//! process, the watchdog's handoff and its capacity.
//!
//! Each harness has its own data dir and its own port range, so the cases
//! run in parallel; a guard SIGKILLs whatever a failing case left behind.

use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use berth_core::Readiness;
use berth_core::runtime::{
    Capacity, InstanceSpec, Patch, Runtime, RuntimeError, RuntimeEvent, RuntimeRef,
};
use berth_core::runtime_contract::{self, Harness, Program};
use berth_core::{Role, UserId};
use berth_local::{Isolation, Limits, LocalRuntime, LocalRuntimeConfig, UidRange};

const BERTH: &str = env!("CARGO_BIN_EXE_berth");

fn sh(script: &str) -> Vec<String> {
    vec!["sh".into(), "-c".into(), script.into()]
}

/// A data dir and a port range shared by every runtime the harness makes.
struct LocalHarness {
    dir: tempfile::TempDir,
    ports: RangeInclusive<u16>,
}

impl LocalHarness {
    fn new() -> LocalHarness {
        let start = berth_testkit::port_block(10);
        LocalHarness {
            dir: tempfile::tempdir().unwrap(),
            ports: start..=start + 9,
        }
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn config(&self, command: Vec<String>, readiness: Readiness) -> LocalRuntimeConfig {
        LocalRuntimeConfig {
            data_dir: self.data(),
            program: berth_core::runtime_contract::program_settings(command, readiness),
            env_allowlist: vec!["PATH".into()],
            max_ports: berth_local::DEFAULT_MAX_PORTS,
            log_max_bytes: berth_local::DEFAULT_LOG_MAX_BYTES,
            port_range: self.ports.clone(),
            isolation: Isolation::None,
            uids: UidRange {
                first: 200_000,
                count: 1000,
            },
            limits: Limits::default(),
            listeners: berth_local::ListenerCap::default(),
            nft: None,
            egress: Default::default(),
            egress_proxy: None,
            name_servers: Vec::new(),
            shim_command: vec![BERTH.into(), "shim".into()],
        }
    }

    async fn local(&self, config: LocalRuntimeConfig) -> Arc<LocalRuntime> {
        LocalRuntime::new(config, None).await.unwrap()
    }
}

fn token_regex() -> Readiness {
    Readiness::TokenRegex(runtime_contract::token_pattern())
}

#[async_trait]
impl Harness for LocalHarness {
    async fn runtime(&self, program: &Program) -> Arc<dyn Runtime> {
        let command = runtime_contract::sh_command(program);
        self.local(self.config(command, token_regex())).await
    }

    async fn running(&self, _runtime_ref: &RuntimeRef, pid: Option<u32>) -> bool {
        pid.is_some_and(|pid| berth_testkit::alive(u64::from(pid)))
    }
}

impl Drop for LocalHarness {
    fn drop(&mut self) {
        berth_testkit::kill_instances_under(&self.data());
    }
}

berth_core::runtime_contract_tests!(LocalHarness::new());

// --- what only the local runtime has -----------------------------------------

fn user(id: &str) -> UserId {
    UserId::parse(id).unwrap()
}

fn ready_line() -> Vec<String> {
    sh("echo ready token=t; exec sleep 1000")
}

async fn exited(started: &mut berth_core::runtime::Started) -> berth_core::runtime::ExitStatus {
    runtime_contract::exit_of(&mut started.events, |_| false).await
}

/// A crash restart (same instance id, the old port as its hint) keeps the
/// port; a fresh port is given when asked for, and the old one goes back;
/// once released, another instance may have it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ports_are_kept_across_runs_until_released() {
    let h = LocalHarness::new();
    let runtime = h.local(h.config(ready_line(), token_regex())).await;
    let alice = user("alice");
    let mut first = runtime
        .start(runtime_contract::spec(&alice, "a-1"))
        .await
        .unwrap();
    let port = first.endpoint.clone().expect("a main has an endpoint").port;
    assert!(h.ports.contains(&port));
    runtime.kill(&first.runtime_ref).await.unwrap();
    exited(&mut first).await;

    // Another user, meanwhile, does not get the crashed instance's port.
    let bob = user("bob");
    let other = runtime
        .start(runtime_contract::spec(&bob, "b-1"))
        .await
        .unwrap();
    assert_ne!(other.endpoint.as_ref().unwrap().port, port);

    let mut restart = runtime_contract::spec(&alice, "a-1");
    restart.port_hint = Some(port);
    restart.patch = Patch::Unchanged;
    let mut second = runtime.start(restart.clone()).await.unwrap();
    assert_eq!(second.endpoint.as_ref().unwrap().port, port);
    assert_ne!(
        second.runtime_ref, first.runtime_ref,
        "a new run, a new ref"
    );
    runtime.kill(&second.runtime_ref).await.unwrap();
    exited(&mut second).await;

    restart.port_hint = None;
    let mut fresh = runtime.start(restart).await.unwrap();
    let fresh_port = fresh.endpoint.as_ref().unwrap().port;
    assert_ne!(fresh_port, port);
    runtime.kill(&fresh.runtime_ref).await.unwrap();
    exited(&mut fresh).await;

    // Released: the range has room for every other instance again.
    runtime.release("a-1").await;
    let mut others = Vec::new();
    for n in 0..9 {
        let u = user(&format!("u{n}"));
        others.push(
            runtime
                .start(runtime_contract::spec(&u, &format!("u-{n}")))
                .await
                .unwrap(),
        );
    }
    let full = runtime
        .start(runtime_contract::spec(&user("late"), "late-1"))
        .await;
    let r = h.ports.clone();
    assert_eq!(
        full.err(),
        Some(RuntimeError::CapacityExhausted(format!(
            "no free port in {}-{}",
            r.start(),
            r.end()
        )))
    );
    assert!(
        !h.data().join("users/late").exists(),
        "a refused start leaves nothing on disk"
    );
    assert_eq!(
        runtime.capacity(),
        Some(Capacity {
            instances: 10,
            reason: format!("one per port of {}-{}", r.start(), r.end())
        })
    );
    others.push(other);
    for mut s in others {
        runtime.kill(&s.runtime_ref).await.unwrap();
        exited(&mut s).await;
    }
    runtime.shutdown().await;
}

/// A program that exits before it is ready while another process holds
/// its port is reported with `port_in_use`; one that fails for another
/// reason is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exit_with_the_port_held_by_another_process_is_told_apart() {
    let h = LocalHarness::new();
    // The program waits for a go file, then tries to listen on its port.
    let go = h.dir.path().join("go");
    let script = format!(
        r#"while [ ! -e "{go}" ]; do sleep 0.02; done; exec "{BERTH}" demo-app --port "$BERTH_PORT""#,
        go = go.display()
    );
    let demo = Readiness::TokenRegex(
        regex::Regex::new(r"berth-demo: http://127\.0\.0\.1:\d+/\?token=(\S+)").unwrap(),
    );
    let runtime = h.local(h.config(sh(&script), demo)).await;
    let mut started = runtime
        .start(runtime_contract::spec(&user("carl"), "c-1"))
        .await
        .unwrap();
    let port = started.endpoint.as_ref().unwrap().port;
    let thief = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    std::fs::write(&go, "").unwrap();
    let exit = runtime_contract::exit_of(&mut started.events, |e| {
        matches!(e, RuntimeEvent::Ready { .. })
    })
    .await;
    assert!(exit.port_in_use, "{exit:?}");
    assert!(exit.stderr_tail.contains("cannot listen"), "{exit:?}");

    // Asked for a fresh port (no hint), the same instance comes up.
    drop(started);
    let mut again = runtime_contract::spec(&user("carl"), "c-1");
    again.patch = Patch::Unchanged;
    let mut started = runtime.start(again).await.unwrap();
    assert_ne!(started.endpoint.as_ref().unwrap().port, port);
    runtime_contract::expect_event(&mut started.events, "ready", |e| {
        matches!(e, RuntimeEvent::Ready { .. })
    })
    .await;
    runtime.kill(&started.runtime_ref).await.unwrap();
    exited(&mut started).await;
    drop(thief);

    // Failing for its own reasons, with its port free, is a plain exit.
    let runtime = h
        .local(h.config(sh("echo no >&2; exit 1"), token_regex()))
        .await;
    let mut started = runtime
        .start(runtime_contract::spec(&user("dora"), "d-1"))
        .await
        .unwrap();
    assert!(!exited(&mut started).await.port_in_use);
    runtime.shutdown().await;
}

/// A watchdog gets its main's port, the handoff materialised and named in
/// `BERTH_HANDOFF`, the patch the main was given, and no port of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watchdog_gets_the_handoff_the_patch_and_its_mains_port() {
    let h = LocalHarness::new();
    let mut config = h.config(ready_line(), token_regex());
    config.program.watchdog_command = Some(sh(
        r#"echo "port=$BERTH_PORT role=$BERTH_ROLE extra=$EXTRA"; cat "$BERTH_HANDOFF"; echo; cat "$1"; echo"#,
    ));
    if let Some(c) = config.program.watchdog_command.as_mut() {
        c.extend(["sh".into(), "{patch}".into()]);
    }
    let runtime = h.local(config).await;
    let eve = user("eve");
    let mut spec = runtime_contract::spec(&eve, "e-1");
    spec.patch = Patch::Set(Some("answer = 42".into()));
    let mut main = runtime.start(spec).await.unwrap();
    let port = main.endpoint.as_ref().unwrap().port;

    let dog = InstanceSpec {
        instance_id: "e-dog".into(),
        role: Role::Watchdog,
        epoch: 0,
        patch: Patch::Unchanged,
        handoff: Some(r#"{"exit_code":7}"#.into()),
        ..runtime_contract::spec(&eve, "e-dog")
    };
    let mut watchdog = runtime.start(dog).await.unwrap();
    assert_eq!(watchdog.endpoint, None);
    let exit = exited(&mut watchdog).await;
    assert_eq!(exit.code, Some(0), "{exit:?}");
    let log = runtime.logs(&eve.slug(), Role::Watchdog, 10).await.unwrap();
    assert_eq!(
        log,
        [
            format!("port={port} role=watchdog extra=from-config"),
            r#"{"exit_code":7}"#.to_owned(),
            "answer = 42".to_owned(),
        ]
    );
    runtime.kill(&main.runtime_ref).await.unwrap();
    exited(&mut main).await;

    // Without a watchdog command, none starts.
    let plain = h.local(h.config(ready_line(), token_regex())).await;
    let err = plain
        .start(InstanceSpec {
            role: Role::Watchdog,
            ..runtime_contract::spec(&eve, "e-dog-2")
        })
        .await
        .unwrap_err();
    assert_eq!(
        err,
        RuntimeError::SpawnFailed("no watchdog command is configured".into())
    );
    runtime.shutdown().await;
}
