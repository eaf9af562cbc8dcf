//! The controller driving the local runtime, end to end: the real `berth
//! shim`, a real SQLite store in a temp dir, and real programs (`sh`
//! scripts, `berth demo-app`, `python3 -m http.server`).
//!
//! Every test gets its own port range so tests can run in parallel, polls
//! until a deadline instead of sleeping, and stops its users before it
//! ends; a guard also SIGKILLs whatever a failing test left behind.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use berth_controller::{BreakerHook, Controller, ControllerConfig};
use berth_core::Readiness;
use berth_core::policy::{CrashPolicy, IdleAction, ReapPolicy};
use berth_core::{InstanceStatus, LaunchRequest, Role, SpawnError, Spawner, Traffic, UserId};
use berth_local::{Isolation, Limits, LocalRuntime, LocalRuntimeConfig, UidRange};
use berth_store::lease::LeaseConfig;
use berth_store::testing::{InterceptRenew, RenewHook};
use berth_store::{Store, StoreError};

const BERTH: &str = env!("CARGO_BIN_EXE_berth");
const DEMO_READY: &str = r"berth-demo: http://127\.0\.0\.1:\d+/\?token=([A-Za-z0-9_-]+)";
const WAIT: Duration = Duration::from_secs(30);

fn user(id: &str) -> UserId {
    UserId::parse(id).unwrap()
}

fn demo() -> Vec<String> {
    vec![
        BERTH.into(),
        "demo-app".into(),
        "--port".into(),
        "{port}".into(),
    ]
}

fn sh(script: &str) -> Vec<String> {
    vec!["sh".into(), "-c".into(), script.into()]
}

fn token_regex(re: &str) -> Readiness {
    Readiness::TokenRegex(regex::Regex::new(re).unwrap())
}

/// A test's data dir, store and config; kills leftover instances on drop.
/// The first of the ten ports of this file's block `key`.
fn port_block_of(key: u16) -> u16 {
    berth_testkit::port_block_for(&format!("{} {key}", module_path!()), 10)
}

struct Env {
    dir: tempfile::TempDir,
    store: Arc<dyn Store>,
}

impl Env {
    async fn new() -> Env {
        let dir = tempfile::tempdir().unwrap();
        let store = berth_store::open(&format!("sqlite://{}/berth.db", dir.path().display()))
            .await
            .unwrap();
        Env { dir, store }
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// A setup on the ten ports of block `ports` (a key: the same number
    /// gives the same ports).
    fn config(&self, ports: u16, command: Vec<String>, readiness: Readiness) -> Setup {
        let ports = port_block_of(ports);
        let runtime = LocalRuntimeConfig {
            data_dir: self.data(),
            program: berth_core::runtime_contract::program_settings(command, readiness),
            env_allowlist: vec!["PATH".into()],
            max_ports: berth_local::DEFAULT_MAX_PORTS,
            log_max_bytes: berth_local::DEFAULT_LOG_MAX_BYTES,
            port_range: ports..=ports + 9,
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
        };
        let controller = ControllerConfig {
            ready_timeout: Duration::from_secs(20),
            stop_grace: Duration::from_secs(2),
            crash: CrashPolicy {
                backoff_base: Duration::from_millis(50),
                backoff_max: Duration::from_millis(200),
                ..CrashPolicy::default()
            },
            reap: ReapPolicy {
                idle_ttl: None,
                max_idle: 0,
                interval: Duration::from_secs(60),
                hibernate_after: None,
                ..ReapPolicy::default()
            },
            probe_settle: Duration::from_millis(200),
            probe_budget: Duration::from_secs(20),
            ..ControllerConfig::new("test-node")
        };
        Setup {
            runtime,
            controller,
        }
    }

    async fn start(&self, setup: Setup) -> Arc<Controller> {
        self.start_on(setup, self.store.clone()).await
    }

    /// Returns once the adoption at start has ended: these tests look at
    /// what was adopted (serving while adopting is `tests/proxy.rs`'s).
    async fn start_on(&self, setup: Setup, store: Arc<dyn Store>) -> Arc<Controller> {
        let runtime = LocalRuntime::new(setup.runtime, None).await.unwrap();
        start_controller(runtime, store, setup.controller).await
    }
}

/// Starts a controller over `runtime`; returns once the adoption at start
/// has ended.
async fn start_controller(
    runtime: Arc<dyn berth_core::runtime::Runtime>,
    store: Arc<dyn Store>,
    config: ControllerConfig,
) -> Arc<Controller> {
    let controller = Controller::start(runtime, store, config).await.unwrap();
    controller.adopted().await;
    controller
}

/// A test's settings: the local runtime's and the controller's.
#[derive(Clone)]
struct Setup {
    runtime: LocalRuntimeConfig,
    controller: ControllerConfig,
}

impl Drop for Env {
    fn drop(&mut self) {
        // Last resort for a failed test: kill every program and shim the
        // state files name.
        let Ok(dirs) = std::fs::read_dir(self.data().join("run")) else {
            return;
        };
        for dir in dirs.flatten() {
            for role in ["main", "watchdog"] {
                let Ok(text) = std::fs::read_to_string(dir.path().join(format!("{role}.json")))
                else {
                    continue;
                };
                let Ok(state) = serde_json::from_str::<serde_json::Value>(&text) else {
                    continue;
                };
                for (key, group) in [("pid", true), ("shim_pid", false)] {
                    if let Some(pid) = state[key].as_i64().and_then(|p| i32::try_from(p).ok()) {
                        let pid = nix::unistd::Pid::from_raw(pid);
                        let _ = if group {
                            nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGKILL)
                        } else {
                            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL)
                        };
                    }
                }
            }
        }
    }
}

/// A spawner whose program appends its pid to `$HOME/pids`, prints
/// `ready` and sleeps.
async fn pid_logging_spawner(env: &Env, ports: u16) -> Arc<Controller> {
    let script = r#"echo $$ >> "$HOME/pids"; echo ready; exec sleep 1000"#;
    env.start(env.config(ports, sh(script), token_regex("^ready$")))
        .await
}

/// Polls `check` every 25 ms until it returns `Some`, or panics.
async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn main_of(spawner: &Controller, u: &UserId) -> Option<berth_core::Instance> {
    spawner.status(u).await.unwrap().main
}

async fn wait_status(
    spawner: &Controller,
    u: &UserId,
    status: InstanceStatus,
) -> berth_core::Instance {
    eventually(&format!("{u} to be {status}"), || async {
        main_of(spawner, u)
            .await
            .filter(|i| i.status == status && (status != InstanceStatus::Running || i.ready))
    })
    .await
}

fn alive(pid: u32) -> bool {
    // A zombie still answers kill(0); /proc's state tells them apart.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

async fn http_get(port: u16, path: &str) -> reqwest::StatusCode {
    reqwest::get(format!("http://127.0.0.1:{port}{path}"))
        .await
        .unwrap()
        .status()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launch_runs_the_program_and_reports_it() {
    let env = Env::new().await;
    let spawner = env
        .start(env.config(21000, demo(), token_regex(DEMO_READY)))
        .await;
    let alice = user("alice");

    let started = spawner
        .launch(&alice, LaunchRequest::default())
        .await
        .unwrap();
    assert_eq!(started.status, InstanceStatus::Starting);
    let running = spawner
        .wait_for_ready(&alice, WAIT)
        .await
        .unwrap()
        .expect("an instance");
    assert_eq!(running.status, InstanceStatus::Running);
    assert!(running.ready);
    assert_eq!(running.id, started.id);
    let port = running.port.expect("a port");
    let first = port_block_of(21000);
    assert!((first..=first + 9).contains(&port));
    let pid = running.pid.expect("a pid");
    assert!(alive(pid));
    let token = spawner.launch_token(&alice).expect("a launch token");
    assert_eq!(token.len(), 32);
    let endpoint = spawner.endpoint_for(&alice).expect("an endpoint");
    assert_eq!((endpoint.host.as_str(), endpoint.port), ("127.0.0.1", port));
    assert!(http_get(port, "/").await.is_success());
    let logs = spawner.logs(&alice, 10).await.unwrap();
    assert!(logs.iter().any(|l| l.contains(&token)), "{logs:?}");

    let again = spawner.launch(&alice, LaunchRequest::default()).await;
    assert!(
        matches!(again, Err(SpawnError::AlreadyRunning { .. })),
        "{again:?}"
    );

    let stored = env
        .store
        .get_instance(&alice, Role::Main)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (stored.status, stored.pid, stored.port),
        (InstanceStatus::Running, Some(pid), Some(port))
    );
    assert!(
        spawner
            .list()
            .await
            .unwrap()
            .iter()
            .any(|i| i.id == started.id)
    );

    spawner.stop(&alice).await.unwrap();
    let stopped = main_of(&spawner, &alice).await.unwrap();
    assert_eq!(stopped.status, InstanceStatus::Stopped);
    assert_eq!(spawner.endpoint_for(&alice), None);
    eventually("the program to be gone", || async {
        (!alive(pid)).then_some(())
    })
    .await;
    let waited = spawner.wait_for_ready(&alice, WAIT).await.unwrap().unwrap();
    assert_eq!(
        waited.status,
        InstanceStatus::Stopped,
        "returns at once when stopped"
    );
    spawner.stop(&user("nobody")).await.unwrap();
    spawner.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn folder_patch_and_environment_reach_the_program() {
    let env = Env::new().await;
    let script = r#"pwd; cat "$1"; echo; env | grep -E '^(BERTH_|HOME=|EXTRA=)' | sort; echo ready; exec sleep 1000"#;
    let mut command = sh(script);
    command.extend(["sh".into(), "{patch}".into()]);
    let spawner = env
        .start(env.config(21010, command, token_regex("^ready$")))
        .await;
    let bob = user("Bob@Example");
    let slug = bob.slug();

    let bad = spawner
        .launch(
            &bob,
            LaunchRequest {
                folder: Some("../escape".into()),
                ..Default::default()
            },
        )
        .await;
    assert!(matches!(bad, Err(SpawnError::InvalidRequest(_))), "{bad:?}");
    let big = "x".repeat(300 * 1024);
    let too_large = spawner
        .launch(
            &bob,
            LaunchRequest {
                patch: Some(big),
                ..Default::default()
            },
        )
        .await;
    assert_eq!(
        too_large.unwrap_err(),
        SpawnError::PayloadTooLarge {
            size: 300 * 1024,
            limit: berth_core::MAX_PATCH_BYTES
        }
    );
    assert!(
        !env.data().join("users").join(slug.as_str()).exists(),
        "nothing on disk"
    );
    assert_eq!(
        env.store.get_instance(&bob, Role::Main).await.unwrap(),
        None
    );

    let request = LaunchRequest {
        folder: Some("proj/sub".into()),
        patch: Some("answer = 42".into()),
        force: false,
    };
    spawner.launch(&bob, request).await.unwrap();
    let running = wait_status(&spawner, &bob, InstanceStatus::Running).await;
    assert_eq!(running.folder, "proj/sub");
    let root = env.data().join("users").join(slug.as_str());
    let logs = spawner.logs(&bob, 50).await.unwrap().join("\n");
    let ws = root.join("ws/proj/sub");
    assert!(logs.contains(&ws.display().to_string()), "{logs}");
    assert!(logs.contains("answer = 42"), "{logs}");
    assert!(logs.contains("BERTH_USER=Bob@Example"), "{logs}");
    assert!(logs.contains("BERTH_ROLE=main"), "{logs}");
    assert!(logs.contains("BERTH_BASE_PATH=/u/Bob%40Example/"), "{logs}");
    assert!(
        logs.contains(&format!("BERTH_PORT={}", running.port.unwrap())),
        "{logs}"
    );
    assert!(
        logs.contains(&format!("HOME={}", root.join("home").display())),
        "{logs}"
    );
    assert!(logs.contains("EXTRA=from-config"), "{logs}");
    assert_eq!(
        std::fs::read_to_string(root.join("patches/main.toml")).unwrap(),
        "answer = 42"
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&root).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
    assert!(!root.display().to_string().contains('@'));
    assert_eq!(
        spawner.launch_token(&bob),
        None,
        "no capture group, no token"
    );

    spawner.stop(&bob).await.unwrap();
    spawner.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_launches_start_one_process() {
    let env = Env::new().await;
    let spawner = pid_logging_spawner(&env, 21020).await;
    let carol = user("carol");
    let launches = (0..50).map(|_| {
        let spawner = spawner.clone();
        let carol = carol.clone();
        async move { spawner.launch(&carol, LaunchRequest::default()).await }
    });
    let results = futures_util::future::join_all(launches).await;
    let ok = results.iter().filter(|r| r.is_ok()).count();
    let busy = results
        .iter()
        .filter(|r| matches!(r, Err(SpawnError::AlreadyRunning { .. })))
        .count();
    assert_eq!((ok, busy), (1, 49), "{results:?}");
    wait_status(&spawner, &carol, InstanceStatus::Running).await;
    let pids = std::fs::read_to_string(env.data().join("users/carol/home/pids")).unwrap();
    assert_eq!(pids.lines().count(), 1, "{pids}");
    spawner.stop(&carol).await.unwrap();
    spawner.teardown().await;
}

/// A caller that stops waiting (an API client hanging up mid-launch)
/// does not cut the launch short: it completes, and its one program is
/// tracked, not left running unowned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launch_abandoned_by_its_caller_completes_and_is_tracked() {
    let env = Env::new().await;
    let spawner = pid_logging_spawner(&env, 21030).await;
    let dave = user("dave");
    // Polled once, then dropped: the launch is under way, its caller gone.
    let abandoned = tokio::time::timeout(
        Duration::ZERO,
        spawner.launch(&dave, LaunchRequest::default()),
    )
    .await;
    assert!(abandoned.is_err(), "the launch finished within one poll");
    let running = wait_status(&spawner, &dave, InstanceStatus::Running).await;
    let pid = running.pid.expect("a running main has a pid");
    let pids = std::fs::read_to_string(env.data().join("users/dave/home/pids")).unwrap();
    assert_eq!(pids.lines().collect::<Vec<_>>(), [pid.to_string()]);
    spawner.stop(&dave).await.unwrap();
    assert!(!alive(pid), "the program outlived its stop");
    spawner.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_launched_after_teardown() {
    let env = Env::new().await;
    let spawner = pid_logging_spawner(&env, 21040).await;
    spawner.teardown().await;
    let erin = user("erin");
    let err = spawner
        .launch(&erin, LaunchRequest::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("shutting down"), "{err}");
    assert!(!env.data().join("users/erin/home/pids").exists());
    assert!(
        main_of(&spawner, &erin).await.is_none(),
        "a record was written"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_program_is_restarted_with_a_new_pid() {
    let env = Env::new().await;
    let spawner = env
        .start(env.config(21030, demo(), token_regex(DEMO_READY)))
        .await;
    let dave = user("dave");
    spawner
        .launch(&dave, LaunchRequest::default())
        .await
        .unwrap();
    let first = wait_status(&spawner, &dave, InstanceStatus::Running).await;
    let old_pid = first.pid.unwrap();
    let mut events = spawner.subscribe();

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(old_pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let again = eventually("a restart", || async {
        main_of(&spawner, &dave)
            .await
            .filter(|i| i.status == InstanceStatus::Running && i.ready && i.pid != Some(old_pid))
    })
    .await;
    assert_eq!(again.id, first.id, "a crash restart keeps the instance id");
    assert_eq!(again.epoch, first.epoch, "and the lease epoch");
    assert!(again.restarts >= 1);
    assert!(again.last_error.is_some());
    let mut saw_crashed = false;
    while let Ok(event) = events.try_recv() {
        saw_crashed |= event.status == InstanceStatus::Crashed;
    }
    assert!(saw_crashed, "a crashed event was published");
    assert!(http_get(again.port.unwrap(), "/").await.is_success());

    spawner.stop(&dave).await.unwrap();
    spawner.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_opens_the_breaker_which_survives_a_restart_of_berth() {
    let env = Env::new().await;
    let mut config = env.config(21040, sh("echo boom >&2; exit 3"), token_regex("^ready$"));
    let hook_out = env.dir.path().join("hook.out");
    config.controller.on_breaker_open = Some(BreakerHook {
        command: sh(&format!(
            r#"echo "$BERTH_USER $BERTH_BREAKER_OPENS" >> {}"#,
            hook_out.display()
        )),
        env: vec![("PATH".into(), std::env::var("PATH").unwrap())],
    });
    let spawner = env.start(config.clone()).await;
    let erin = user("erin");

    spawner
        .launch(&erin, LaunchRequest::default())
        .await
        .unwrap();
    let failed = wait_status(&spawner, &erin, InstanceStatus::Failed).await;
    assert_eq!(
        failed.restarts, 5,
        "five restarts, the sixth crash opens the breaker"
    );
    assert_eq!(failed.exit_code, Some(3));
    assert!(
        failed.last_error.as_deref().unwrap_or("").contains("boom"),
        "{failed:?}"
    );
    let info = spawner
        .breaker_info(&erin)
        .await
        .unwrap()
        .expect("an open breaker");
    assert_eq!(info.opens, 1);
    let hook = eventually("the on_breaker_open hook", || async {
        std::fs::read_to_string(&hook_out)
            .ok()
            .filter(|t| t.ends_with('\n'))
    })
    .await;
    assert_eq!(hook, "erin 1\n");
    let refused = spawner.launch(&erin, LaunchRequest::default()).await;
    assert!(
        matches!(refused, Err(SpawnError::CircuitOpen { opens: 1, retry_at, .. }) if retry_at == info.cooldown_until),
        "{refused:?}"
    );

    // A new berth on the same data dir and store still refuses.
    spawner.teardown().await;
    drop(spawner);
    let spawner = env.start(config).await;
    let refused = spawner.launch(&erin, LaunchRequest::default()).await;
    assert!(
        matches!(refused, Err(SpawnError::CircuitOpen { .. })),
        "{refused:?}"
    );

    // force launches and clears the breaker.
    let forced = spawner
        .launch(
            &erin,
            LaunchRequest {
                force: true,
                ..Default::default()
            },
        )
        .await;
    assert!(forced.is_ok(), "{forced:?}");
    assert_eq!(spawner.breaker_info(&erin).await.unwrap(), None);
    // It crash-loops again until the breaker reopens, with a longer cooldown.
    wait_status(&spawner, &erin, InstanceStatus::Failed).await;
    let info = spawner
        .breaker_info(&erin)
        .await
        .unwrap()
        .expect("reopened");
    assert_eq!(info.opens, 1, "force forgot the earlier opens");

    spawner.reset_breaker(&erin).await.unwrap();
    assert_eq!(spawner.breaker_info(&erin).await.unwrap(), None);
    assert!(
        spawner
            .launch(&erin, LaunchRequest::default())
            .await
            .is_ok()
    );
    spawner.stop(&erin).await.unwrap();
    spawner.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_program_fails_and_gives_its_port_back() {
    let env = Env::new().await;
    let mut config = env.config(21050, vec!["/nonexistent/prog-xyz".into()], Readiness::Tcp);
    config.runtime.port_range = 21050..=21050;
    let spawner = env.start(config).await;
    let frank = user("frank");
    for _ in 0..2 {
        let err = spawner
            .launch(&frank, LaunchRequest::default())
            .await
            .unwrap_err();
        match &err {
            SpawnError::SpawnFailed(msg) => assert!(msg.contains("prog-xyz"), "{msg}"),
            other => panic!("expected SpawnFailed, got {other:?}"),
        }
        let record = main_of(&spawner, &frank).await.unwrap();
        assert_eq!(record.status, InstanceStatus::Failed);
        assert!(record.last_error.unwrap().contains("prog-xyz"));
        let stored = env
            .store
            .get_instance(&frank, Role::Main)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stored.status, InstanceStatus::Failed);
    }
    let lease = env.store.get_lease(&frank).await.unwrap();
    assert!(lease.is_none_or(|l| l.released), "the lease was released");
    spawner.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_port_range_refuses_the_next_user() {
    let env = Env::new().await;
    let mut config = env.config(
        21060,
        sh("echo ready; exec sleep 1000"),
        token_regex("^ready$"),
    );
    config.runtime.port_range = 21060..=21061;
    let spawner = env.start(config).await;
    let (a, b, c) = (user("gina"), user("hank"), user("ivan"));
    spawner.launch(&a, LaunchRequest::default()).await.unwrap();
    spawner.launch(&b, LaunchRequest::default()).await.unwrap();
    let full = spawner.launch(&c, LaunchRequest::default()).await;
    assert_eq!(
        full.unwrap_err(),
        SpawnError::CapacityExhausted(
            "node test-node runs or starts 2 instances, its capacity (the local runtime's: \
             one per port of 21060-21061)"
                .into()
        )
    );
    assert_eq!(env.store.get_instance(&c, Role::Main).await.unwrap(), None);
    assert_eq!(
        env.store.get_lease(&c).await.unwrap(),
        None,
        "no lease claimed"
    );
    assert!(!env.data().join("users/ivan").exists());
    let pa = wait_status(&spawner, &a, InstanceStatus::Running)
        .await
        .port;
    let pb = wait_status(&spawner, &b, InstanceStatus::Running)
        .await
        .port;
    assert_ne!(pa, pb);
    let none = spawner.spawn_watchdog(&a).await;
    assert!(
        matches!(
            &none,
            Err(SpawnError::NotFound { what, .. }) if what == "watchdog command"
        ),
        "{none:?}"
    );

    // Stopping one frees its port for the third user.
    spawner.stop(&a).await.unwrap();
    spawner.launch(&c, LaunchRequest::default()).await.unwrap();
    let pc = wait_status(&spawner, &c, InstanceStatus::Running)
        .await
        .port;
    assert_eq!(pc, pa);
    spawner.stop(&b).await.unwrap();
    spawner.stop(&c).await.unwrap();
    spawner.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_kills_a_program_that_ignores_sigterm() {
    let env = Env::new().await;
    let script = r#"trap "" TERM; echo ready; while :; do sleep 0.1; done"#;
    let mut config = env.config(21070, sh(script), token_regex("^ready$"));
    config.controller.stop_grace = Duration::from_millis(300);
    let spawner = env.start(config).await;
    let jane = user("jane");
    spawner
        .launch(&jane, LaunchRequest::default())
        .await
        .unwrap();
    let pid = wait_status(&spawner, &jane, InstanceStatus::Running)
        .await
        .pid
        .unwrap();
    spawner.stop(&jane).await.unwrap();
    let stopped = main_of(&spawner, &jane).await.unwrap();
    assert_eq!(stopped.status, InstanceStatus::Stopped);
    eventually("the program to be killed", || async {
        (!alive(pid)).then_some(())
    })
    .await;
    // A stopped user may launch again.
    spawner
        .launch(&jane, LaunchRequest::default())
        .await
        .unwrap();
    wait_status(&spawner, &jane, InstanceStatus::Running).await;
    spawner.stop(&jane).await.unwrap();
    spawner.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_stops_idle_instances_and_keeps_their_data() {
    let env = Env::new().await;
    let mut config = env.config(
        21080,
        sh("echo ready; exec sleep 1000"),
        token_regex("^ready$"),
    );
    config.controller.reap = ReapPolicy {
        idle_ttl: Some(Duration::from_millis(300)),
        max_idle: 0,
        interval: Duration::from_millis(100),
        // This test is about stopping idle mains.
        idle_action: IdleAction::Stop,
        ..ReapPolicy::default()
    };
    let spawner = env.start(config).await;
    let kim = user("kim");
    spawner
        .launch(&kim, LaunchRequest::default())
        .await
        .unwrap();
    let pid = wait_status(&spawner, &kim, InstanceStatus::Running)
        .await
        .pid
        .unwrap();
    let stopped = wait_status(&spawner, &kim, InstanceStatus::Stopped).await;
    assert_eq!(stopped.pid, Some(pid));
    assert!(
        env.data().join("users/kim/ws").is_dir(),
        "user data is kept"
    );
    assert!(env.data().join("users/kim/logs/main.log").is_file());
    eventually("the program to be gone", || async {
        (!alive(pid)).then_some(())
    })
    .await;
    spawner.stop(&kim).await.unwrap();
    spawner.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_runs_the_watchdog_once() {
    let env = Env::new().await;
    let main = r#"if [ -f "$HOME/crashed" ]; then echo ready; exec sleep 1000; fi; touch "$HOME/crashed"; echo broken >&2; exit 7"#;
    let watchdog = r#"echo "role=$BERTH_ROLE" >> "$HOME/watchdog.out"; cat "$BERTH_HANDOFF" >> "$HOME/watchdog.out"; echo >> "$HOME/watchdog.out""#;
    let mut config = env.config(21090, sh(main), token_regex("^ready$"));
    config.runtime.program.watchdog_command = Some(sh(watchdog));
    config.controller.watchdog = true;
    let spawner = env.start(config).await;
    let lou = user("lou");
    spawner
        .launch(&lou, LaunchRequest::default())
        .await
        .unwrap();
    let running = wait_status(&spawner, &lou, InstanceStatus::Running).await;
    assert_eq!(running.restarts, 1);
    let out = env.data().join("users/lou/home/watchdog.out");
    let text = eventually("the watchdog's output", || async {
        std::fs::read_to_string(&out)
            .ok()
            .filter(|t| t.ends_with("\n\n") || t.matches('\n').count() >= 2)
    })
    .await;
    eventually("the watchdog record to be removed", || async {
        spawner
            .status(&lou)
            .await
            .unwrap()
            .watchdog
            .is_none()
            .then_some(())
    })
    .await;
    assert_eq!(
        env.store
            .get_instance(&lou, berth_core::Role::Watchdog)
            .await
            .unwrap(),
        None
    );
    let text = std::fs::read_to_string(&out).unwrap_or(text);
    assert_eq!(text.matches("role=watchdog").count(), 1, "{text}");
    assert!(text.contains("\"exit_code\":7"), "{text}");
    assert!(text.contains("broken"), "{text}");
    assert!(env.data().join("users/lou/handoff.json").is_file());

    // An explicit watchdog runs too, and is not restarted after it exits.
    spawner.spawn_watchdog(&lou).await.unwrap();
    eventually("the second watchdog to finish", || async {
        let text = std::fs::read_to_string(&out).ok()?;
        let done = text.matches("role=watchdog").count() == 2
            && spawner.status(&lou).await.unwrap().watchdog.is_none();
        done.then_some(())
    })
    .await;
    spawner.stop(&lou).await.unwrap();
    spawner.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_berth_adopts_running_instances() {
    let env = Env::new().await;
    let config = env.config(21100, demo(), token_regex(DEMO_READY));
    let first = env.start(config.clone()).await;
    let max = user("max");
    first.launch(&max, LaunchRequest::default()).await.unwrap();
    let before = wait_status(&first, &max, InstanceStatus::Running).await;
    let token = first.launch_token(&max).unwrap();
    first.teardown().await;
    drop(first);
    let pid = before.pid.unwrap();
    assert!(alive(pid), "teardown leaves instances running");

    let second = env.start(config).await;
    let adopted = main_of(&second, &max).await.unwrap();
    assert_eq!(adopted.id, before.id);
    assert_eq!(adopted.pid, Some(pid));
    assert_eq!(adopted.status, InstanceStatus::Running);
    assert_eq!(second.launch_token(&max), Some(token));
    let endpoint = second.endpoint_for(&max).expect("routable after re-attach");
    assert!(http_get(endpoint.port, "/").await.is_success());
    let again = second.launch(&max, LaunchRequest::default()).await;
    assert!(
        matches!(again, Err(SpawnError::AlreadyRunning { .. })),
        "{again:?}"
    );

    // Its exit is still seen and handled.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let restarted = eventually("a restart after re-attach", || async {
        main_of(&second, &max)
            .await
            .filter(|i| i.status == InstanceStatus::Running && i.ready && i.pid != Some(pid))
    })
    .await;
    assert_eq!(restarted.id, before.id);
    second.stop(&max).await.unwrap();
    second.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_died_while_berth_was_away_is_restarted() {
    let env = Env::new().await;
    let config = env.config(
        21110,
        sh("echo ready; exec sleep 1000"),
        token_regex("^ready$"),
    );
    let first = env.start(config.clone()).await;
    let ned = user("ned");
    first.launch(&ned, LaunchRequest::default()).await.unwrap();
    let before = wait_status(&first, &ned, InstanceStatus::Running).await;
    first.teardown().await;
    drop(first);
    let pid = before.pid.unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    eventually("the program to die", || async {
        (!alive(pid)).then_some(())
    })
    .await;

    let second = env.start(config).await;
    let restarted = eventually("a restart after berth was away", || async {
        main_of(&second, &ned)
            .await
            .filter(|i| i.status == InstanceStatus::Running && i.pid != Some(pid))
    })
    .await;
    assert_eq!(restarted.id, before.id);
    assert_eq!(restarted.restarts, 1);
    second.stop(&ned).await.unwrap();
    second.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_readiness_restart_and_probe() {
    let env = Env::new().await;
    let python = std::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .unwrap();
    let python = String::from_utf8(python.stdout).unwrap().trim().to_owned();
    let command = vec![
        python,
        "-m".into(),
        "http.server".into(),
        "{port}".into(),
        "--bind".into(),
        "127.0.0.1".into(),
    ];
    let spawner = env
        .start(env.config(21120, command, Readiness::Http { path: "/".into() }))
        .await;
    let (olga, pete) = (user("olga"), user("pete"));
    spawner
        .launch(&olga, LaunchRequest::default())
        .await
        .unwrap();
    spawner
        .launch(&pete, LaunchRequest::default())
        .await
        .unwrap();
    let first = wait_status(&spawner, &olga, InstanceStatus::Running).await;
    wait_status(&spawner, &pete, InstanceStatus::Running).await;
    assert!(http_get(first.port.unwrap(), "/").await.is_success());

    let report = spawner.restart_and_probe(&olga).await;
    assert!(report.ok, "{report:?}");
    let after = main_of(&spawner, &olga).await.unwrap();
    assert_ne!(after.id, first.id, "a restart is a new instance");

    let restarted = spawner.restart_main(&pete).await.unwrap();
    assert_eq!(restarted.status, InstanceStatus::Starting);
    wait_status(&spawner, &pete, InstanceStatus::Running).await;

    let mut results = spawner.restart_all_mains().await;
    results.sort_by(|a, b| a.user.cmp(&b.user));
    assert_eq!(results.len(), 2);
    assert!(results.iter().all(|r| r.ok), "{results:?}");
    wait_status(&spawner, &olga, InstanceStatus::Running).await;
    wait_status(&spawner, &pete, InstanceStatus::Running).await;

    let missing = spawner.restart_main(&user("quinn")).await;
    assert!(
        matches!(missing, Err(SpawnError::NotFound { .. })),
        "{missing:?}"
    );

    // Registered as the binary does, under its `berth` prefix.
    let mut registry = prometheus_client::registry::Registry::with_prefix("berth");
    spawner.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("# TYPE berth_spawn_to_ready_seconds histogram"),
        "{text}"
    );
    assert!(text.contains("# TYPE berth_instances gauge"), "{text}");
    assert!(!text.contains("berth_berth"), "{text}");

    spawner.stop(&olga).await.unwrap();
    spawner.stop(&pete).await.unwrap();
    spawner.teardown().await;
}

#[tokio::test]
async fn a_data_dir_too_long_for_sockets_is_refused() {
    let env = Env::new().await;
    let mut config = env.config(21130, demo(), Readiness::Tcp);
    config.runtime.data_dir = Path::new("/tmp").join("d".repeat(80));
    let err = match LocalRuntime::new(config.runtime, None).await {
        Err(e) => e,
        Ok(_) => panic!("a too-long data dir was accepted"),
    };
    assert!(
        matches!(err, berth_local::LocalError::Config(ref m) if m.contains("too long")),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_fences_the_instance() {
    let env = Env::new().await;
    let mut config = env.config(
        21140,
        sh("echo ready; exec sleep 1000"),
        token_regex("^ready$"),
    );
    config.controller.lease = LeaseConfig::new(
        Duration::from_secs(2),
        Duration::from_millis(100),
        Duration::from_millis(1500),
        berth_store::TakeoverPolicy::Evidence,
    )
    .unwrap();
    let spawner = env.start(config).await;
    let rita = user("rita");
    spawner
        .launch(&rita, LaunchRequest::default())
        .await
        .unwrap();
    let running = wait_status(&spawner, &rita, InstanceStatus::Running).await;
    let pid = running.pid.unwrap();

    // A claim behind the spawner's back moves the epoch on: its next renew
    // at the old epoch touches no row, so the lease counts as lost.
    let claimed = env
        .store
        .claim_lease(
            &rita,
            "test-node",
            Duration::from_secs(2),
            berth_store::TakeoverPolicy::Evidence,
        )
        .await
        .unwrap();
    assert!(
        matches!(claimed, berth_store::ClaimOutcome::Claimed { .. }),
        "{claimed:?}"
    );
    let fenced = wait_status(&spawner, &rita, InstanceStatus::Stopped).await;
    assert_eq!(fenced.last_error.as_deref(), Some("lease lost: fenced"));
    // The record is written before the route table hears of it.
    eventually("the fenced instance's route removed", || async {
        spawner.endpoint_for(&rita).is_none().then_some(())
    })
    .await;
    eventually("the fenced program to be killed", || async {
        (!alive(pid)).then_some(())
    })
    .await;
    spawner.stop(&rita).await.unwrap();
    spawner.teardown().await;
}

/// A lease-renew hook that can be made to fail: a store outage as the
/// renew tick sees it, with every other call passing through.
#[derive(Default)]
struct FailingRenews(std::sync::atomic::AtomicBool);

#[async_trait::async_trait]
impl RenewHook for FailingRenews {
    async fn before_renew(&self) -> Result<(), StoreError> {
        if self.0.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable("test: renews fail".into()));
        }
        Ok(())
    }
}

/// Puts `config` in cluster mode (fencing on; a lease of `ttl`, renewed
/// every 100 ms, fenced 600 ms after the last good renew) and returns the
/// test's store behind `hook`, which runs before every renew.
fn cluster_mode<H: RenewHook>(
    env: &Env,
    config: &mut Setup,
    ttl: Duration,
    hook: H,
) -> Arc<InterceptRenew<H>> {
    config.controller.fencing = true;
    config.controller.lease = LeaseConfig::new(
        ttl,
        Duration::from_millis(100),
        Duration::from_millis(600),
        berth_store::TakeoverPolicy::Evidence,
    )
    .unwrap();
    Arc::new(InterceptRenew {
        inner: env.store.clone(),
        hook,
    })
}

/// Starts a cluster-mode controller (TTL 2 s) whose lease renews fail once
/// the returned hook is switched on.
async fn start_with_failable_renews(
    env: &Env,
    mut config: Setup,
) -> (Arc<Controller>, Arc<InterceptRenew<FailingRenews>>) {
    let flaky = cluster_mode(
        env,
        &mut config,
        Duration::from_secs(2),
        FailingRenews::default(),
    );
    (env.start_on(config, flaky.clone()).await, flaky)
}

/// A main that crashes while renews have failed for longer than
/// `fence_after` is not restarted until a renew proves the lease again:
/// another node may hold it by then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_is_not_restarted_while_the_lease_is_unproven() {
    let env = Env::new().await;
    let config = env.config(
        21150,
        sh("echo ready; exec sleep 1000"),
        token_regex("^ready$"),
    );
    let (spawner, flaky) = start_with_failable_renews(&env, config).await;
    let rita = user("rita");
    spawner
        .launch(&rita, LaunchRequest::default())
        .await
        .unwrap();
    let running = wait_status(&spawner, &rita, InstanceStatus::Running).await;
    let first_pid = running.pid.unwrap();

    flaky.hook.0.store(true, Ordering::SeqCst);
    // Past fence_after without a good renew the lease is unproven, and the
    // spawner freezes the instance: wait for that.
    eventually("the instance frozen once the lease is unproven", || async {
        (berth_testkit::proc_state(first_pid) == Some('T')).then_some(())
    })
    .await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first_pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    eventually("the killed program to be gone", || async {
        (!alive(first_pid)).then_some(())
    })
    .await;
    // Well past the backoff (≤ 200 ms): still no new program. The sleep is
    // the test: nothing may happen during it.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let held = main_of(&spawner, &rita).await.unwrap();
    assert_eq!(held.status, InstanceStatus::Crashed, "{held:?}");
    assert!(
        held.pid.is_none_or(|p| p == first_pid || !alive(p)),
        "restarted while the lease was unproven: {held:?}"
    );

    // A good renew proves the lease again: the restart goes ahead.
    flaky.hook.0.store(false, Ordering::SeqCst);
    let again = wait_status(&spawner, &rita, InstanceStatus::Running).await;
    assert_ne!(again.pid, Some(first_pid));
    spawner.stop(&rita).await.unwrap();
    spawner.teardown().await;
}

/// Launch robustness: another socket takes a launch's port just
/// before the program binds it. The program fails, its port held by
/// someone else: the launch still comes up, at once, on another port,
/// without charging the crash budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_taken_before_the_program_binds_it_is_replaced_uncharged() {
    let env = Env::new().await;
    let script = format!(
        r#"echo "$BERTH_PORT" >> "$HOME/ports"; while [ ! -e "$HOME/go" ]; do sleep 0.02; done; exec "{BERTH}" demo-app --port "$BERTH_PORT""#
    );
    let spawner = env
        .start(env.config(21160, sh(&script), token_regex(DEMO_READY)))
        .await;
    let sam = user("sam");
    spawner
        .launch(&sam, LaunchRequest::default())
        .await
        .unwrap();
    let home = env.data().join("users/sam/home");
    let taken: u16 = eventually("the program to learn its port", || async {
        std::fs::read_to_string(home.join("ports"))
            .ok()?
            .lines()
            .next()?
            .parse()
            .ok()
    })
    .await;
    let thief = std::net::TcpListener::bind(("127.0.0.1", taken)).unwrap();
    std::fs::write(home.join("go"), "").unwrap();

    // Ready as the proxy sees it: routed.
    let running = spawner
        .wait_for_ready(&sam, WAIT)
        .await
        .unwrap()
        .expect("a record");
    assert_eq!(running.status, InstanceStatus::Running, "{running:?}");
    assert_eq!(
        running.restarts, 0,
        "the lost port was charged: {running:?}"
    );
    assert_ne!(running.port, Some(taken));
    let ports = std::fs::read_to_string(home.join("ports")).unwrap();
    assert_eq!(
        ports.lines().collect::<Vec<_>>(),
        [taken.to_string(), running.port.unwrap().to_string()]
    );
    assert_eq!(
        spawner.endpoint_for(&sam).map(|e| e.port),
        running.port,
        "routed to the new port"
    );
    assert!(http_get(running.port.unwrap(), "/").await.is_success());
    assert_eq!(spawner.breaker_info(&sam).await.unwrap(), None);
    drop(thief);
    spawner.stop(&sam).await.unwrap();
    spawner.teardown().await;
}

/// `[cluster] capacity` is enforced on the node: a launch past it is
/// refused with `capacity_exhausted` and starts nothing; raising it, or a
/// stop, makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_capacity_refuses_launches_past_it() {
    let env = Env::new().await;
    let mut config = env.config(
        21170,
        sh("echo ready; exec sleep 1000"),
        token_regex("^ready$"),
    );
    config.controller.capacity = Some(1);
    let spawner = env.start(config).await;
    let (tom, uma) = (user("tom"), user("uma"));
    spawner
        .launch(&tom, LaunchRequest::default())
        .await
        .unwrap();
    let full = spawner.launch(&uma, LaunchRequest::default()).await;
    assert_eq!(
        full.unwrap_err(),
        SpawnError::CapacityExhausted(
            "node test-node runs or starts 1 instances, its capacity (as configured)".into()
        )
    );
    assert_eq!(env.store.get_lease(&uma).await.unwrap(), None);
    assert!(!env.data().join("users/uma").exists());
    assert_eq!(spawner.node_record().capacity, 1);
    assert_eq!(spawner.node_record().load, 1);

    spawner.set_capacity(2);
    spawner
        .launch(&uma, LaunchRequest::default())
        .await
        .unwrap();
    wait_status(&spawner, &uma, InstanceStatus::Running).await;
    spawner.set_capacity(1);
    spawner.stop(&tom).await.unwrap();
    assert!(
        spawner
            .launch(&tom, LaunchRequest::default())
            .await
            .is_err(),
        "still full: uma runs"
    );
    spawner.stop(&uma).await.unwrap();
    spawner
        .launch(&tom, LaunchRequest::default())
        .await
        .unwrap();
    assert_eq!(spawner.node_record().load, 1);
    spawner.stop(&tom).await.unwrap();
    assert_eq!(spawner.node_record().load, 0);
    spawner.teardown().await;
}

/// A fence names an epoch, and acts on exactly that one: an older epoch
/// leaves the running instance alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_acts_only_on_exactly_its_epoch() {
    let env = Env::new().await;
    let spawner = pid_logging_spawner(&env, 21180).await;
    let vic = user("vic");
    spawner
        .launch(&vic, LaunchRequest::default())
        .await
        .unwrap();
    spawner.stop(&vic).await.unwrap();
    spawner
        .launch(&vic, LaunchRequest::default())
        .await
        .unwrap();
    let running = wait_status(&spawner, &vic, InstanceStatus::Running).await;
    assert!(running.epoch >= 2, "{running:?}");
    let pid = running.pid.unwrap();

    assert!(!spawner.fence(&vic, running.epoch - 1).await.unwrap());
    assert!(!spawner.fence(&vic, running.epoch + 1).await.unwrap());
    assert!(!spawner.fence(&user("nobody"), 1).await.unwrap());
    let still = main_of(&spawner, &vic).await.unwrap();
    assert_eq!(
        (still.status, still.pid),
        (InstanceStatus::Running, Some(pid))
    );
    assert!(alive(pid));

    assert!(spawner.fence(&vic, running.epoch).await.unwrap());
    let fenced = main_of(&spawner, &vic).await.unwrap();
    assert_eq!(fenced.status, InstanceStatus::Stopped);
    assert_eq!(fenced.last_error.as_deref(), Some("lease lost: fenced"));
    eventually("the fenced program to be gone", || async {
        (!alive(pid)).then_some(())
    })
    .await;
    // Fenced means forgotten, not released: the row still names this node
    // at that epoch, for whoever holds it now.
    let lease = env.store.get_lease(&vic).await.unwrap().unwrap();
    assert_eq!(lease.epoch, running.epoch);
    assert!(!lease.released);
    spawner.teardown().await;
}

/// `logs -f`: the tail, then every new line, through the controller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_are_followed_as_they_grow() {
    let env = Env::new().await;
    let script = r#"echo first; echo ready; while [ ! -e "$HOME/more" ]; do sleep 0.02; done; echo second; echo third; exec sleep 1000"#;
    let spawner = env
        .start(env.config(21190, sh(script), token_regex("^ready$")))
        .await;
    let wes = user("wes");
    spawner
        .launch(&wes, LaunchRequest::default())
        .await
        .unwrap();
    wait_status(&spawner, &wes, InstanceStatus::Running).await;
    let mut lines = spawner.follow_logs(&wes, 2).await.unwrap();
    let mut next = async || {
        tokio::time::timeout(WAIT, lines.recv())
            .await
            .expect("a line in time")
            .expect("the stream goes on")
    };
    assert_eq!(
        (next().await, next().await),
        ("first".into(), "ready".into())
    );
    std::fs::write(env.data().join("users/wes/home/more"), "").unwrap();
    assert_eq!(
        (next().await, next().await),
        ("second".into(), "third".into())
    );
    spawner.stop(&wes).await.unwrap();
    spawner.teardown().await;
}

/// The fencing hole: a main frozen because its lease could not
/// be proven is never thawed to be stopped. Its TERM handler, which
/// "flushes state", must not run: the lease may be another node's by then.
/// Asked to stop, it is killed while frozen. The shell only waits once
/// ready: one that keeps starting commands may be frozen mid-`vfork` and
/// then waits in state `D`, not `T`, until the thaw (see
/// `tests/shim.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_main_is_stopped_without_running_again() {
    let env = Env::new().await;
    let script =
        r#"trap 'echo flushed >> "$HOME/term"; exit 0' TERM; sleep 1000 & echo ready; wait"#;
    let config = env.config(21200, sh(script), token_regex("^ready$"));
    let (spawner, flaky) = start_with_failable_renews(&env, config).await;
    let (xia, yan) = (user("xia"), user("yan"));

    // Not frozen, the handler runs on a stop: the check below can fail.
    spawner
        .launch(&xia, LaunchRequest::default())
        .await
        .unwrap();
    wait_status(&spawner, &xia, InstanceStatus::Running).await;
    spawner.stop(&xia).await.unwrap();
    assert!(env.data().join("users/xia/home/term").exists());

    spawner
        .launch(&yan, LaunchRequest::default())
        .await
        .unwrap();
    let pid = wait_status(&spawner, &yan, InstanceStatus::Running)
        .await
        .pid
        .unwrap();
    flaky.hook.0.store(true, Ordering::SeqCst);
    eventually("the instance to be frozen", || async {
        (berth_testkit::proc_state(pid) == Some('T')).then_some(())
    })
    .await;
    spawner.stop(&yan).await.unwrap();
    eventually("the program to be gone", || async {
        (!alive(pid)).then_some(())
    })
    .await;
    assert!(
        !env.data().join("users/yan/home/term").exists(),
        "the frozen program was thawed and ran its TERM handler"
    );
    let stopped = main_of(&spawner, &yan).await.unwrap();
    assert_eq!(stopped.status, InstanceStatus::Stopped);
    spawner.teardown().await;
}

/// Drain and undrain reach the heartbeat's row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_carries_the_node_status() {
    let env = Env::new().await;
    let spawner = pid_logging_spawner(&env, 21210).await;
    spawner.set_node_status(berth_store::NodeStatus::Draining);
    spawner.heartbeat().await.unwrap();
    let row = |nodes: Vec<berth_store::NodeRecord>| {
        nodes.into_iter().find(|n| n.id == "test-node").unwrap()
    };
    let drained = row(env.store.list_nodes().await.unwrap());
    assert_eq!(drained.status, berth_store::NodeStatus::Draining);
    assert_eq!(drained.capacity, 10, "the port range's size by default");
    spawner.set_node_status(berth_store::NodeStatus::Up);
    spawner.heartbeat().await.unwrap();
    assert_eq!(
        row(env.store.list_nodes().await.unwrap()).status,
        berth_store::NodeStatus::Up
    );
    spawner.teardown().await;
}

/// Activity reaches the store: a restarted berth adopts its instances with
/// the `last_active` recorded there (and so does not reap one that was in
/// use a moment before), and the other nodes read it there. A touch is
/// written by a background flush, without a launch or a stop to carry it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn activity_is_flushed_to_the_store() {
    let env = Env::new().await;
    let mut config = env.config(
        21220,
        sh("echo ready; exec sleep 1000"),
        token_regex("^ready$"),
    );
    // Flushed on each reap tick (and each renew), not only at a stop.
    config.controller.reap.interval = Duration::from_millis(100);
    let spawner = env.start(config).await;
    let lee = user("lee");
    spawner
        .launch(&lee, LaunchRequest::default())
        .await
        .unwrap();
    wait_status(&spawner, &lee, InstanceStatus::Running).await;
    let recorded = || async {
        let main = env.store.get_instance(&lee, Role::Main).await;
        main.unwrap().expect("lee's main is recorded").last_active
    };
    let at_launch = recorded().await;
    // A touch in a later millisecond than anything recorded so far.
    eventually("the clock past the recorded activity", || async {
        (berth_core::unix_millis_now() > at_launch).then_some(())
    })
    .await;
    // What the proxy does per request; `true` would ask for a resume.
    assert!(!spawner.touch(&lee), "lee's main is not hibernated");
    eventually("the touch recorded in the store", || async {
        (recorded().await > at_launch).then_some(())
    })
    .await;
    spawner.stop(&lee).await.unwrap();
    spawner.teardown().await;
}

/// A test double of a runtime that keeps no fence deadline of its own: the
/// local runtime, with the deadline taken off every start and
/// `fence_deadline` declared off. Every runtime berth ships that can
/// freeze also holds the deadline itself, so without this double the
/// controller's own fence timer is never the only thing that freezes.
struct NoDeadline(Arc<LocalRuntime>);

#[async_trait::async_trait]
impl berth_core::runtime::Runtime for NoDeadline {
    fn name(&self) -> &'static str {
        "local without a fence deadline (test double)"
    }
    fn capabilities(&self) -> berth_core::runtime::Capabilities {
        berth_core::runtime::Capabilities {
            fence_deadline: false,
            ..self.0.capabilities()
        }
    }
    async fn start(
        &self,
        spec: berth_core::runtime::InstanceSpec,
    ) -> Result<berth_core::runtime::Started, berth_core::runtime::RuntimeError> {
        self.0
            .start(berth_core::runtime::InstanceSpec {
                fence: None,
                ..spec
            })
            .await
    }
    async fn stop(
        &self,
        run: &berth_core::runtime::RuntimeRef,
        grace: Duration,
    ) -> Result<(), berth_core::runtime::RuntimeError> {
        self.0.stop(run, grace).await
    }
    async fn kill(
        &self,
        run: &berth_core::runtime::RuntimeRef,
    ) -> Result<(), berth_core::runtime::RuntimeError> {
        self.0.kill(run).await
    }
    async fn freeze(
        &self,
        run: &berth_core::runtime::RuntimeRef,
    ) -> Result<(), berth_core::runtime::RuntimeError> {
        self.0.freeze(run).await
    }
    async fn thaw(
        &self,
        run: &berth_core::runtime::RuntimeRef,
    ) -> Result<(), berth_core::runtime::RuntimeError> {
        self.0.thaw(run).await
    }
    async fn release(&self, instance_id: &str) {
        self.0.release(instance_id).await;
    }
    async fn discover(
        &self,
    ) -> Result<Vec<berth_core::runtime::Discovered>, berth_core::runtime::RuntimeError> {
        self.0.discover().await
    }
    async fn adopt(
        &self,
        found: &berth_core::runtime::Discovered,
    ) -> Result<berth_core::runtime::Started, berth_core::runtime::RuntimeError> {
        self.0.adopt(found).await
    }
    async fn remove(
        &self,
        found: &berth_core::runtime::Discovered,
    ) -> Result<(), berth_core::runtime::RuntimeError> {
        self.0.remove(found).await
    }
    async fn logs(
        &self,
        slug: &berth_core::Slug,
        role: berth_core::Role,
        tail: usize,
    ) -> Result<Vec<String>, berth_core::runtime::RuntimeError> {
        self.0.logs(slug, role, tail).await
    }
    async fn follow_logs(
        &self,
        slug: &berth_core::Slug,
        role: berth_core::Role,
        tail: usize,
    ) -> Result<tokio::sync::mpsc::Receiver<String>, berth_core::runtime::RuntimeError> {
        self.0.follow_logs(slug, role, tail).await
    }
    async fn shutdown(&self) {
        self.0.shutdown().await;
    }
}

/// A lease-renew hook that can be made to hang: a database link that
/// stalls without an error, as the renew tick sees it.
#[derive(Default)]
struct HangingRenews {
    hang: std::sync::atomic::AtomicBool,
    healed: tokio::sync::Notify,
}

#[async_trait::async_trait]
impl RenewHook for HangingRenews {
    async fn before_renew(&self) -> Result<(), StoreError> {
        let healed = self.healed.notified();
        if self.hang.load(Ordering::SeqCst) {
            healed.await;
        }
        Ok(())
    }
}

/// With a runtime that keeps no fence deadline, the controller's own fence
/// timer is what freezes: a renew that hangs (no error, no answer) must
/// not hold the freeze past `fence_after`. A good renew after the link
/// heals thaws the same program.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_renew_does_not_hold_up_the_fence_without_a_runtime_deadline() {
    let env = Env::new().await;
    let mut config = env.config(
        21230,
        sh("echo ready; exec sleep 1000"),
        token_regex("^ready$"),
    );
    // A TTL well past the hang, so the lease is still this node's after it.
    let stalling = cluster_mode(
        &env,
        &mut config,
        Duration::from_secs(5),
        HangingRenews::default(),
    );
    let runtime = NoDeadline(LocalRuntime::new(config.runtime, None).await.unwrap());
    let spawner = start_controller(Arc::new(runtime), stalling.clone(), config.controller).await;
    let rita = user("rita");
    spawner
        .launch(&rita, LaunchRequest::default())
        .await
        .unwrap();
    let pid = wait_status(&spawner, &rita, InstanceStatus::Running)
        .await
        .pid
        .unwrap();

    stalling.hook.hang.store(true, Ordering::SeqCst);
    eventually("the instance frozen while the renew hangs", || async {
        (berth_testkit::proc_state(pid) == Some('T')).then_some(())
    })
    .await;
    stalling.hook.hang.store(false, Ordering::SeqCst);
    stalling.hook.healed.notify_waiters();
    eventually("the same program thawed by a good renew", || async {
        matches!(berth_testkit::proc_state(pid), Some('S' | 'R')).then_some(())
    })
    .await;
    spawner.stop(&rita).await.unwrap();
    spawner.teardown().await;
}
