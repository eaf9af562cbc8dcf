//! The contract every [`Runtime`] must pass (feature `runtime-contract`),
//! whatever runs the programs: local shims, or Kubernetes pods behind an
//! API server (a double of one in tests).
//!
//! Each case is a `pub async fn` taking a [`Harness`] and panicking on a
//! violation. [`runtime_contract_tests!`](crate::runtime_contract_tests)
//! turns the whole list into `#[tokio::test]`s for one runtime:
//!
//! ```text
//! async fn harness() -> MyHarness { … }
//! berth_core::runtime_contract_tests!(harness().await);
//! ```
//!
//! A harness makes runtimes whose configured program behaves like a
//! [`Program`], all sharing one backing state (a data dir, an API server),
//! so that a second runtime sees what the first one left, as a restarted
//! berth does. Every wait polls until a generous deadline; nothing asserts
//! on timing.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test support: a case's panic is its failure report"
)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::mpsc;

use crate::program::{Placeholder, Variable};
use crate::runtime::{
    Discovered, ExitStatus, HookAction, HookCall, InstanceSpec, Patch, Runtime, RuntimeError,
    RuntimeEvent, RuntimeRef, Started,
};
use crate::{Role, UserId};

/// Upper bound for anything awaited; reached only when a case fails.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// The launch token [`Program::Serve`] announces when ready.
pub const TOKEN: &str = "contract-token-0123456789";

/// What the configured program does. The harness maps each to a real
/// program (or a simulated pod) of its runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Program {
    /// Writes `hello` to its output, becomes ready with launch token
    /// [`TOKEN`], then writes `tick` every 100 ms until SIGTERM (or its
    /// equivalent), on which it exits with code 0.
    Serve,
    /// Like [`Program::Serve`], but ignores SIGTERM: only a kill ends it.
    IgnoresTerm,
    /// Writes `stderr` to its stderr and exits at once with `code`.
    Exits {
        /// The exit code.
        code: i32,
        /// What it writes to its stderr before exiting.
        stderr: String,
    },
    /// A program that does not exist, named `name`.
    Missing {
        /// The name the runtime is configured to run; its error must name
        /// it.
        name: String,
    },
    /// Shows what berth told it, one line each, then becomes ready like
    /// [`Program::Serve`]:
    /// * `arg <name>=<value>` for each placeholder, given on its command
    ///   line as `<name>={<name>}`;
    /// * `env NAME=value` for `HOME` and each `BERTH_*` variable it has;
    /// * `cwd <dir>`, its working directory, and `folder <dir>`, where
    ///   `BERTH_FOLDER` leads (both with links resolved);
    /// * `patch <content>` of the file `BERTH_PATCH` names, when set.
    ShowsContract,
}

/// The program settings a harness configures its runtime with: `command`
/// and `readiness`, one extra variable (`EXTRA=from-config`, which the
/// contract's environment case expects), and patch files ending `.toml`.
pub fn program_settings(
    command: Vec<String>,
    readiness: crate::Readiness,
) -> crate::program::ProgramSettings {
    crate::program::ProgramSettings {
        command,
        env: BTreeMap::from([("EXTRA".to_owned(), "from-config".to_owned())]),
        readiness,
        watchdog_command: None,
        patch_ext: "toml".into(),
    }
}

/// The pattern of the ready line [`sh_command`]'s programs print; its
/// group is the launch token.
pub fn token_pattern() -> regex::Regex {
    regex::Regex::new(r"^ready token=(\S+)$").unwrap()
}

/// A command line that behaves like `program`, for a runtime whose
/// programs are real processes with a POSIX `sh`; announces readiness in
/// lines [`token_pattern`] matches.
pub fn sh_command(program: &Program) -> Vec<String> {
    let sh = |script: String| vec!["sh".to_owned(), "-c".to_owned(), script];
    let serving = |on_term: &str| {
        format!(
            "trap {on_term} TERM; echo hello; echo ready token={TOKEN}; \
             while :; do echo tick; sleep 0.1; done"
        )
    };
    match program {
        Program::Serve => sh(serving("'exit 0'")),
        Program::IgnoresTerm => sh(serving("''")),
        Program::Exits { code, stderr } => {
            sh(format!("printf '%s\\n' '{stderr}' >&2; exit {code}"))
        }
        Program::Missing { name } => vec![name.clone()],
        Program::ShowsContract => {
            let show = "for a in \"$@\"; do echo \"arg $a\"; done; \
                env | grep -E '^(HOME|BERTH_[A-Z_]+)=' | sed 's/^/env /'; \
                echo \"cwd $(pwd -P)\"; echo \"folder $(cd \"$BERTH_FOLDER\" && pwd -P)\"; \
                if [ -n \"$BERTH_PATCH\" ]; then echo \"patch $(cat \"$BERTH_PATCH\")\"; fi; ";
            let mut command = sh(format!("{show}{}", serving("'exit 0'")));
            command.push("sh".to_owned());
            command.extend(
                Placeholder::ALL
                    .into_iter()
                    .map(|p| format!("{0}={{{0}}}", p.name())),
            );
            command
        }
    }
}

/// What a runtime under test comes with.
#[async_trait]
pub trait Harness: Send + Sync {
    /// A new runtime running `program`, over this harness's shared state.
    async fn runtime(&self, program: &Program) -> Arc<dyn Runtime>;
    /// Whether the run `started` describes is still there, checked from
    /// outside the runtime (the process table, the API server).
    async fn running(&self, runtime_ref: &RuntimeRef, pid: Option<u32>) -> bool;
}

/// Expands to one `#[tokio::test]` per contract case, each given a fresh
/// harness from `$harness` (an expression evaluated inside each async
/// test, so it may `.await`).
///
/// A runtime that cannot run on every host adds `runs_here = $check`: a
/// function of the case's name, called before the harness is made, that
/// says whether the case can run (and reports a skip itself when not).
#[macro_export]
macro_rules! runtime_contract_tests {
    ($harness:expr) => {
        $crate::runtime_contract_tests!($harness, runs_here = |_case: &str| true);
    };
    ($harness:expr, runs_here = $runs_here:expr) => {
        $crate::runtime_contract_tests!(@cases $harness; $runs_here;
            a_started_program_becomes_ready_and_stops_gracefully,
            kill_ends_a_program_that_ignores_term,
            stop_kills_after_the_grace_period,
            an_exit_is_reported_with_its_code_and_stderr,
            a_missing_program_fails_to_start_and_is_named,
            a_restarted_runtime_discovers_and_adopts_a_running_instance,
            remove_ends_an_orphan,
            logs_are_read_and_followed,
            freeze_and_thaw_when_declared,
            a_frozen_instance_is_killed_without_running_again,
            the_fence_deadline_freezes_when_declared,
            the_program_is_told_the_contract,
            a_hook_runs_beside_the_program_when_declared,
        );
    };
    (@cases $harness:expr; $runs_here:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                if !($runs_here)(concat!(module_path!(), "::", stringify!($case))) {
                    return;
                }
                let harness = $harness;
                $crate::runtime_contract::$case(&harness).await;
            }
        )*
    };
}

fn user(id: &str) -> UserId {
    UserId::parse(id).unwrap()
}

/// A main's spec for `user`.
pub fn spec(user: &UserId, instance_id: &str) -> InstanceSpec {
    InstanceSpec {
        instance_id: instance_id.to_owned(),
        user: user.clone(),
        slug: user.slug(),
        role: Role::Main,
        epoch: 1,
        folder: String::new(),
        patch: Patch::Set(None),
        port_hint: None,
        fence: None,
        env: Vec::new(),
        handoff: None,
        egress: None,
    }
}

async fn next_event(events: &mut mpsc::Receiver<RuntimeEvent>) -> Option<RuntimeEvent> {
    tokio::time::timeout(PATIENCE, events.recv())
        .await
        .expect("no runtime event in time")
}

/// Skips events until one `want`s it; panics if the stream ends first.
pub async fn expect_event(
    events: &mut mpsc::Receiver<RuntimeEvent>,
    what: &str,
    want: impl Fn(&RuntimeEvent) -> bool,
) -> RuntimeEvent {
    loop {
        match next_event(events).await {
            Some(event) if want(&event) => return event,
            Some(_) => {}
            None => panic!("the event stream ended while waiting for {what}"),
        }
    }
}

/// Waits for the exit, failing on any event in `forbidden` on the way.
pub async fn exit_of(
    events: &mut mpsc::Receiver<RuntimeEvent>,
    forbidden: impl Fn(&RuntimeEvent) -> bool,
) -> ExitStatus {
    loop {
        match next_event(events).await {
            Some(RuntimeEvent::Exited(exit)) => return exit,
            Some(event) if forbidden(&event) => panic!("unexpected {event:?} before the exit"),
            Some(_) => {}
            None => panic!("the event stream ended without an exit"),
        }
    }
}

async fn ready(started: &mut Started) -> Option<String> {
    match expect_event(&mut started.events, "readiness", |e| {
        matches!(e, RuntimeEvent::Ready { .. })
    })
    .await
    {
        RuntimeEvent::Ready { token } => token,
        _ => unreachable!(),
    }
}

async fn gone(h: &dyn Harness, started: &Started) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while h.running(&started.runtime_ref, started.pid).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} still runs",
            started.runtime_ref
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// start → ready with the token → graceful stop → exited with code 0, and
/// the run is gone.
pub async fn a_started_program_becomes_ready_and_stops_gracefully(h: &dyn Harness) {
    let runtime = h.runtime(&Program::Serve).await;
    let alice = user("alice");
    let mut started = runtime.start(spec(&alice, "i-1")).await.unwrap();
    assert!(h.running(&started.runtime_ref, started.pid).await);
    assert_eq!(ready(&mut started).await.as_deref(), Some(TOKEN));
    runtime
        .stop(&started.runtime_ref, Duration::from_secs(20))
        .await
        .unwrap();
    let exit = exit_of(&mut started.events, |_| false).await;
    assert_eq!(exit.code, Some(0), "{exit:?}");
    assert!(!exit.port_in_use);
    assert!(
        next_event(&mut started.events).await.is_none(),
        "nothing follows the exit"
    );
    gone(h, &started).await;
    // A run that ended is no longer the runtime's to act on.
    assert!(matches!(
        runtime.kill(&started.runtime_ref).await,
        Err(RuntimeError::Gone(_)) | Ok(())
    ));
    runtime.shutdown().await;
}

/// Starts [`Program::IgnoresTerm`] for `user`, ends it with `end`, and
/// checks that it was killed and is gone.
async fn killed_by(
    h: &dyn Harness,
    user_id: &str,
    end: impl AsyncFnOnce(&dyn Runtime, &RuntimeRef),
) {
    let runtime = h.runtime(&Program::IgnoresTerm).await;
    let mut started = runtime.start(spec(&user(user_id), "i-1")).await.unwrap();
    ready(&mut started).await;
    end(runtime.as_ref(), &started.runtime_ref).await;
    let exit = exit_of(&mut started.events, |_| false).await;
    assert!(
        exit.signal == Some(9) || exit.code == Some(137),
        "not killed: {exit:?}"
    );
    gone(h, &started).await;
    runtime.shutdown().await;
}

/// A kill ends a program that ignores SIGTERM, and the run is gone.
pub async fn kill_ends_a_program_that_ignores_term(h: &dyn Harness) {
    killed_by(h, "bob", async |runtime, r| runtime.kill(r).await.unwrap()).await;
}

/// A stop whose grace runs out kills a program that ignores SIGTERM.
pub async fn stop_kills_after_the_grace_period(h: &dyn Harness) {
    killed_by(h, "carol", async |runtime, r| {
        runtime.stop(r, Duration::from_millis(300)).await.unwrap();
    })
    .await;
}

/// A program that exits by itself is reported exited with its own code
/// and the tail of its stderr, not as a lost port race.
pub async fn an_exit_is_reported_with_its_code_and_stderr(h: &dyn Harness) {
    let program = Program::Exits {
        code: 3,
        stderr: "boom: the disk is on fire".into(),
    };
    let runtime = h.runtime(&program).await;
    let mut started = runtime.start(spec(&user("dave"), "i-1")).await.unwrap();
    let exit = exit_of(&mut started.events, |e| {
        matches!(e, RuntimeEvent::Ready { .. })
    })
    .await;
    assert_eq!(exit.code, Some(3), "{exit:?}");
    assert!(exit.stderr_tail.contains("the disk is on fire"), "{exit:?}");
    assert!(!exit.port_in_use, "{exit:?}");
    runtime.shutdown().await;
}

/// A program that does not exist fails the start with
/// [`RuntimeError::SpawnFailed`], whose message names it.
pub async fn a_missing_program_fails_to_start_and_is_named(h: &dyn Harness) {
    let name = "no-such-program-xyz".to_owned();
    let runtime = h.runtime(&Program::Missing { name: name.clone() }).await;
    match runtime.start(spec(&user("erin"), "i-1")).await {
        Err(RuntimeError::SpawnFailed(message)) => {
            assert!(message.contains(&name), "{message}");
        }
        Err(other) => panic!("expected SpawnFailed, got {other:?}"),
        Ok(started) => panic!("a missing program started: {started:?}"),
    }
    runtime.shutdown().await;
}

/// The discovered entry for `instance_id`, if any.
async fn discovered(runtime: &dyn Runtime, instance_id: &str) -> Option<Discovered> {
    runtime
        .discover()
        .await
        .unwrap()
        .into_iter()
        .find(|d| d.instance_id == instance_id)
}

/// A run outlives its runtime's shutdown; a new runtime discovers it with
/// its user, role, epoch, reference and token, adopts it, and can stop it;
/// once ended it is discovered dead with its exit, or not at all.
pub async fn a_restarted_runtime_discovers_and_adopts_a_running_instance(h: &dyn Harness) {
    let first = h.runtime(&Program::Serve).await;
    let frank = user("frank");
    let mut spec = spec(&frank, "i-adopt");
    spec.epoch = 7;
    let mut started = first.start(spec).await.unwrap();
    ready(&mut started).await;
    let (runtime_ref, pid) = (started.runtime_ref.clone(), started.pid);
    drop(started);
    first.shutdown().await;
    drop(first);
    assert!(h.running(&runtime_ref, pid).await, "shutdown ended the run");

    let second = h.runtime(&Program::Serve).await;
    let found = discovered(second.as_ref(), "i-adopt")
        .await
        .expect("the running instance is discovered");
    assert_eq!(found.user.as_ref(), Some(&frank));
    assert_eq!(found.slug, frank.slug().as_str());
    assert_eq!(
        (found.role, found.epoch, &found.runtime_ref),
        (Role::Main, 7, &runtime_ref)
    );
    assert!(found.alive && found.ready && !found.frozen, "{found:?}");
    assert_eq!(found.token.as_deref(), Some(TOKEN));
    assert_eq!(found.exit, None);

    let mut adopted = second.adopt(&found).await.unwrap();
    assert_eq!(adopted.runtime_ref, runtime_ref);
    assert_eq!(adopted.pid, pid);
    second
        .stop(&adopted.runtime_ref, Duration::from_secs(20))
        .await
        .unwrap();
    let exit = exit_of(&mut adopted.events, |_| false).await;
    assert_eq!(exit.code, Some(0), "{exit:?}");
    gone(h, &adopted).await;
    // What is left of it is found ended, with its exit.
    let third = h.runtime(&Program::Serve).await;
    if let Some(found) = discovered(third.as_ref(), "i-adopt").await {
        assert!(!found.alive, "{found:?}");
        assert_eq!(found.exit.as_ref().map(|e| e.code), Some(Some(0)));
    }
    second.shutdown().await;
    third.shutdown().await;
}

/// [`Runtime::remove`] ends a discovered instance nobody follows, and it
/// is never discovered alive again.
pub async fn remove_ends_an_orphan(h: &dyn Harness) {
    let first = h.runtime(&Program::Serve).await;
    let mut started = first.start(spec(&user("gina"), "i-orphan")).await.unwrap();
    ready(&mut started).await;
    drop(started.events);
    first.shutdown().await;

    let second = h.runtime(&Program::Serve).await;
    let found = discovered(second.as_ref(), "i-orphan").await.unwrap();
    second.remove(&found).await.unwrap();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while h.running(&found.runtime_ref, started.pid).await {
        assert!(tokio::time::Instant::now() < deadline, "the orphan runs on");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let third = h.runtime(&Program::Serve).await;
    assert!(
        discovered(third.as_ref(), "i-orphan")
            .await
            .is_none_or(|f| !f.alive),
        "a removed orphan is discovered alive"
    );
    second.shutdown().await;
    third.shutdown().await;
}

/// Logs are read with a tail, followed as new lines come, kept after the
/// program ends, and empty for a user who never ran.
pub async fn logs_are_read_and_followed(h: &dyn Harness) {
    let runtime = h.runtime(&Program::Serve).await;
    let hank = user("hank");
    let mut started = runtime.start(spec(&hank, "i-1")).await.unwrap();
    ready(&mut started).await;
    let slug = hank.slug();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let lines = runtime.logs(&slug, Role::Main, 1000).await.unwrap();
        if lines.iter().any(|l| l == "hello") && lines.iter().any(|l| l == "tick") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{lines:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let two = runtime.logs(&slug, Role::Main, 2).await.unwrap();
    assert_eq!(two.len(), 2, "{two:?}");

    let mut follow = runtime.follow_logs(&slug, Role::Main, 1).await.unwrap();
    let first = tokio::time::timeout(PATIENCE, follow.recv())
        .await
        .unwrap()
        .expect("the tail");
    assert!(!first.is_empty());
    // New output keeps coming while it runs.
    for _ in 0..3 {
        let line = tokio::time::timeout(PATIENCE, follow.recv())
            .await
            .expect("a new line in time")
            .expect("a line");
        assert_eq!(line, "tick");
    }
    drop(follow);
    // Logs outlive the instance.
    runtime.kill(&started.runtime_ref).await.unwrap();
    exit_of(&mut started.events, |_| false).await;
    let after = runtime.logs(&slug, Role::Main, 1000).await.unwrap();
    assert!(after.iter().any(|l| l == "hello"), "{after:?}");
    let nobody = runtime.logs(&user("nobody").slug(), Role::Main, 10).await;
    assert_eq!(nobody.unwrap(), Vec::<String>::new());
    runtime.shutdown().await;
}

/// A runtime that declares freezing freezes and thaws, reporting both,
/// and the thawed program still stops gracefully; one that does not
/// answers [`RuntimeError::Unsupported`] to both.
pub async fn freeze_and_thaw_when_declared(h: &dyn Harness) {
    let runtime = h.runtime(&Program::Serve).await;
    let mut started = runtime.start(spec(&user("ivan"), "i-1")).await.unwrap();
    ready(&mut started).await;
    let r = started.runtime_ref.clone();
    if !runtime.capabilities().freeze {
        assert!(matches!(
            runtime.freeze(&r).await,
            Err(RuntimeError::Unsupported { .. })
        ));
        assert!(matches!(
            runtime.thaw(&r).await,
            Err(RuntimeError::Unsupported { .. })
        ));
    } else {
        runtime.freeze(&r).await.unwrap();
        expect_event(&mut started.events, "frozen", |e| {
            *e == RuntimeEvent::Frozen
        })
        .await;
        runtime.thaw(&r).await.unwrap();
        expect_event(&mut started.events, "thawed", |e| {
            *e == RuntimeEvent::Thawed
        })
        .await;
    }
    runtime.stop(&r, Duration::from_secs(20)).await.unwrap();
    let exit = exit_of(&mut started.events, |_| false).await;
    assert_eq!(exit.code, Some(0), "a thawed program stops gracefully");
    runtime.shutdown().await;
}

/// The fencing hole: a frozen instance asked to stop, or killed, ends
/// without running again: no `Thawed` comes before its exit, and not one
/// `tick` (one every 100 ms while it runs) reaches its log between the
/// freeze and its end, which a thaw the runtime does not report would
/// show too.
pub async fn a_frozen_instance_is_killed_without_running_again(h: &dyn Harness) {
    let runtime = h.runtime(&Program::Serve).await;
    if !runtime.capabilities().freeze {
        runtime.shutdown().await;
        return;
    }
    let judy = user("judy");
    for (n, stop) in [(1, true), (2, false)] {
        let mut started = runtime.start(spec(&judy, &format!("i-{n}"))).await.unwrap();
        ready(&mut started).await;
        let r = started.runtime_ref.clone();
        runtime.freeze(&r).await.unwrap();
        expect_event(&mut started.events, "frozen", |e| {
            *e == RuntimeEvent::Frozen
        })
        .await;
        let frozen_at = settled_ticks(runtime.as_ref(), &judy).await;
        if stop {
            runtime.stop(&r, Duration::from_secs(20)).await.unwrap();
        } else {
            runtime.kill(&r).await.unwrap();
        }
        let exit = exit_of(&mut started.events, |e| *e == RuntimeEvent::Thawed).await;
        assert_ne!(exit.code, Some(0), "it ran its TERM handler: {exit:?}");
        gone(h, &started).await;
        assert_eq!(
            ticks(runtime.as_ref(), &judy).await,
            frozen_at,
            "the frozen program ran again before it ended (stop: {stop})"
        );
    }
    runtime.shutdown().await;
}

/// The `tick` lines in `user`'s main log so far.
async fn ticks(runtime: &dyn Runtime, user: &UserId) -> usize {
    let lines = runtime
        .logs(&user.slug(), Role::Main, 1_000_000)
        .await
        .unwrap();
    lines.iter().filter(|l| *l == "tick").count()
}

/// [`ticks`] once they have stopped growing: the same for a whole second,
/// long enough for output written before a freeze to reach the log, and
/// ten ticks of a program that still runs.
async fn settled_ticks(runtime: &dyn Runtime, user: &UserId) -> usize {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let mut last = ticks(runtime, user).await;
    let mut since = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = ticks(runtime, user).await;
        if now != last {
            (last, since) = (now, tokio::time::Instant::now());
        } else if since.elapsed() >= Duration::from_secs(1) {
            return now;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a frozen program's log still grows"
        );
    }
}

/// A runtime that declares a fence deadline freezes the instance on its
/// own when the deadline passes, refuses to thaw it until the deadline is
/// extended, and extending the deadline does not thaw it; one that does
/// not answers [`RuntimeError::Unsupported`] to [`Runtime::extend_fence`].
pub async fn the_fence_deadline_freezes_when_declared(h: &dyn Harness) {
    let runtime = h.runtime(&Program::Serve).await;
    let kate = user("kate");
    let mut spec = spec(&kate, "i-1");
    spec.fence = Some(Duration::from_millis(400));
    let mut started = runtime.start(spec).await.unwrap();
    let r = started.runtime_ref.clone();
    if !runtime.capabilities().fence_deadline {
        assert!(matches!(
            runtime.extend_fence(&r, Duration::from_secs(1)).await,
            Err(RuntimeError::Unsupported { .. })
        ));
    } else {
        // Nobody extends it: the runtime freezes the instance by itself.
        expect_event(&mut started.events, "frozen by the deadline", |e| {
            *e == RuntimeEvent::Frozen
        })
        .await;
        // Past the deadline the lease is unproven: a thaw before an
        // extension (one that raced the deadline, say) is refused, as an
        // error or as `Frozen` said again. The program writes nothing.
        let frozen_at = settled_ticks(runtime.as_ref(), &kate).await;
        if runtime.thaw(&r).await.is_ok() {
            let answer = expect_event(&mut started.events, "the thaw's answer", |e| {
                matches!(e, RuntimeEvent::Frozen | RuntimeEvent::Thawed)
            })
            .await;
            assert_eq!(
                answer,
                RuntimeEvent::Frozen,
                "thawed past the fence deadline"
            );
        }
        assert_eq!(
            ticks(runtime.as_ref(), &kate).await,
            frozen_at,
            "the program ran past its fence deadline"
        );
        // Extending does not thaw (only the controller knows whether the
        // lease is still held); an explicit thaw does.
        runtime
            .extend_fence(&r, Duration::from_secs(600))
            .await
            .unwrap();
        runtime.thaw(&r).await.unwrap();
        expect_event(&mut started.events, "thawed", |e| {
            *e == RuntimeEvent::Thawed
        })
        .await;
    }
    runtime.kill(&r).await.unwrap();
    exit_of(&mut started.events, |_| false).await;
    runtime.shutdown().await;
}

/// What a [`Program::ShowsContract`] run showed, once it is ready.
struct Shown {
    args: BTreeMap<String, String>,
    env: BTreeMap<String, String>,
    cwd: String,
    folder: String,
    patch: Option<String>,
}

/// What the last run of `user`'s [`Program::ShowsContract`] showed: the
/// log from its first line (`arg user=…`), once its ready line is there.
async fn shown(runtime: &dyn Runtime, user: &UserId, instance_id: &str) -> Shown {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let run_id = format!("env {}={instance_id}", Variable::InstanceId.name());
    let lines = loop {
        let lines = runtime.logs(&user.slug(), Role::Main, 1000).await.unwrap();
        let start = lines.iter().rposition(|l| l.starts_with("arg user="));
        if let Some(run) = start.map(|start| &lines[start..])
            && run.contains(&run_id)
            && run.iter().any(|l| l.starts_with("ready token="))
        {
            break run.to_vec();
        }
        assert!(tokio::time::Instant::now() < deadline, "{lines:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    let pairs = |prefix: &str| -> BTreeMap<String, String> {
        lines
            .iter()
            .filter_map(|l| l.strip_prefix(prefix)?.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    };
    let one = |prefix: &str| {
        lines
            .iter()
            .find_map(|l| l.strip_prefix(prefix).map(str::to_owned))
    };
    Shown {
        args: pairs("arg "),
        env: pairs("env "),
        cwd: one("cwd ").expect("the working directory"),
        folder: one("folder ").expect("where BERTH_FOLDER leads"),
        patch: one("patch "),
    }
}

/// A program is told the program contract (`crate::program`): exactly
/// `HOME` and the `BERTH_*` variables of a main, with their meaning (the
/// folder is its working directory, the patch names the user's patch
/// file, or is empty when there is none), and each placeholder of its
/// command line is its variable's value.
pub async fn the_program_is_told_the_contract(h: &dyn Harness) {
    let runtime = h.runtime(&Program::ShowsContract).await;
    let ivy = user("ivy.lee@example.com");
    let mut with_patch = spec(&ivy, "c-1");
    with_patch.epoch = 7;
    with_patch.folder = "proj/a".to_owned();
    with_patch.patch = Patch::Set(Some("answer = 42".to_owned()));
    let mut started = runtime.start(with_patch).await.unwrap();
    assert_eq!(ready(&mut started).await.as_deref(), Some(TOKEN));
    let seen = shown(runtime.as_ref(), &ivy, "c-1").await;

    let want: Vec<&str> = Variable::ALL
        .into_iter()
        .filter(|v| ![Variable::Handoff, Variable::Hook].contains(v))
        .map(Variable::name)
        .collect();
    let got: Vec<&str> = seen.env.keys().map(String::as_str).collect();
    let mut want_sorted = want.clone();
    want_sorted.sort_unstable();
    assert_eq!(got, want_sorted, "{:?}", seen.env);
    let env = |v: Variable| seen.env[v.name()].as_str();
    assert_eq!(env(Variable::User), "ivy.lee@example.com");
    assert_eq!(env(Variable::Slug), ivy.slug().as_str());
    assert_eq!(env(Variable::BasePath), ivy.base_path());
    assert_eq!(env(Variable::Role), "main");
    assert_eq!(env(Variable::Epoch), "7");
    assert_eq!(env(Variable::InstanceId), "c-1");
    assert!(
        env(Variable::Port).parse::<u16>().is_ok_and(|p| p > 0),
        "{:?}",
        seen.env
    );
    assert!(env(Variable::Home).starts_with('/'), "{:?}", seen.env);
    assert!(env(Variable::Folder).starts_with('/'), "{:?}", seen.env);
    assert!(env(Variable::Folder).ends_with("/proj/a"), "{:?}", seen.env);
    assert_eq!(
        seen.folder, seen.cwd,
        "BERTH_FOLDER is the working directory"
    );
    assert_eq!(seen.patch.as_deref(), Some("answer = 42"));
    for p in Placeholder::ALL {
        assert_eq!(
            seen.args.get(p.name()).map(String::as_str),
            Some(env(p.variable())),
            "{{{}}}: {:?}",
            p.name(),
            seen.args
        );
    }
    runtime.kill(&started.runtime_ref).await.unwrap();
    exit_of(&mut started.events, |_| false).await;
    gone(h, &started).await;

    // Without a patch, BERTH_PATCH and {patch} are empty.
    let mut without = spec(&ivy, "c-2");
    without.patch = Patch::Set(None);
    let mut started = runtime.start(without).await.unwrap();
    ready(&mut started).await;
    let seen = shown(runtime.as_ref(), &ivy, "c-2").await;
    assert_eq!(seen.env[Variable::Patch.name()], "", "{:?}", seen.env);
    assert_eq!(seen.args.get("patch").map(String::as_str), Some(""));
    assert_eq!(seen.patch, None);
    runtime.kill(&started.runtime_ref).await.unwrap();
    exit_of(&mut started.events, |_| false).await;
    runtime.shutdown().await;
}

/// A command hook of `script` for `sh`, cut off after `grace`.
fn sh_hook(script: &str, grace: Duration) -> HookCall {
    HookCall {
        name: "pre_stop",
        action: HookAction::Command(vec!["sh".to_owned(), "-c".to_owned(), script.to_owned()]),
        grace,
    }
}

/// A runtime that declares `exec` runs a command hook beside the program:
/// with the program's environment and working directory plus
/// `BERTH_HOOK`, reporting its exit code and output; a hook that outlives
/// its grace is cut off with everything it started; a frozen instance
/// runs no hook. One that does not declare it answers
/// [`RuntimeError::Unsupported`].
pub async fn a_hook_runs_beside_the_program_when_declared(h: &dyn Harness) {
    let runtime = h.runtime(&Program::Serve).await;
    let mut started = runtime.start(spec(&user("liam"), "i-1")).await.unwrap();
    ready(&mut started).await;
    let r = started.runtime_ref.clone();
    let long = Duration::from_secs(20);
    if !runtime.capabilities().exec {
        assert!(matches!(
            runtime.run_hook(&r, &sh_hook("true", long)).await,
            Err(RuntimeError::Unsupported { .. })
        ));
    } else {
        let told = sh_hook(
            "echo \"hook=$BERTH_HOOK id=$BERTH_INSTANCE_ID\"; \
             [ \"$(pwd -P)\" = \"$(cd \"$BERTH_FOLDER\" && pwd -P)\" ] && echo in-folder; \
             echo oops >&2; exit 4",
            long,
        );
        let outcome = runtime.run_hook(&r, &told).await.unwrap();
        assert_eq!(
            (outcome.code, outcome.timed_out),
            (Some(4), false),
            "{outcome:?}"
        );
        assert!(!outcome.succeeded(&told.action));
        for want in ["hook=pre_stop id=i-1", "in-folder", "oops"] {
            assert!(outcome.output_tail.contains(want), "{want}: {outcome:?}");
        }

        // Cut off at its grace, with the child it left in the background.
        let hung = sh_hook(
            "sleep 1000 & echo \"child=$!\"; wait",
            Duration::from_millis(300),
        );
        let outcome = runtime.run_hook(&r, &hung).await.unwrap();
        assert!(outcome.timed_out, "{outcome:?}");
        let child = outcome
            .output_tail
            .lines()
            .find_map(|l| l.strip_prefix("child="))
            .expect("the hook named its child")
            .to_owned();
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let look = sh_hook(
                &format!("if kill -0 {child} 2>/dev/null; then echo alive; else echo gone; fi"),
                long,
            );
            let seen = runtime.run_hook(&r, &look).await.unwrap().output_tail;
            if seen.trim() == "gone" {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the hook's child runs on: {seen}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }

        if runtime.capabilities().freeze {
            runtime.freeze(&r).await.unwrap();
            expect_event(&mut started.events, "frozen", |e| {
                *e == RuntimeEvent::Frozen
            })
            .await;
            assert!(
                runtime.run_hook(&r, &sh_hook("true", long)).await.is_err(),
                "a hook ran in a frozen instance"
            );
            runtime.thaw(&r).await.unwrap();
        }
    }
    runtime.stop(&r, long).await.unwrap();
    let exit = exit_of(&mut started.events, |_| false).await;
    assert_eq!(
        exit.code,
        Some(0),
        "the hooks left the program alone: {exit:?}"
    );
    runtime.shutdown().await;
}
