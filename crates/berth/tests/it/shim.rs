//! The shim, driven through the real `berth shim` binary (the zygote that
//! forks each shim) with real programs.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use berth_core::Role;
use berth_local::Limits;
use berth_local::isolation::IsolationSpec;
use berth_local::shim::{
    ExitInfo, ShimCommand, ShimError, ShimEvent, ShimHandle, ShimLauncher, ShimSpec, ShimState,
};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

/// Upper bound for anything polled; only ever reached when a test fails.
const PATIENCE: Duration = Duration::from_secs(20);

fn spec(dir: &Path, argv: &[&str]) -> ShimSpec {
    ShimSpec {
        instance_id: "inst-1".to_owned(),
        user: "alice".to_owned(),
        role: Role::Main,
        epoch: 7,
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: vec![("PATH".to_owned(), std::env::var("PATH").unwrap())],
        cwd: dir.to_path_buf(),
        log_path: dir.join("logs/main.log"),
        log_max_bytes: berth_local::DEFAULT_LOG_MAX_BYTES,
        state_path: dir.join("run/main.state.json"),
        socket_path: dir.join("run/main.sock"),
        ready_regex: None,
        fence_ms: None,
        user_root: None,
        isolation: None,
        port: None,
    }
}

fn sh(script: &str) -> Vec<&str> {
    vec!["sh", "-c", script]
}

fn launcher() -> ShimLauncher {
    ShimLauncher::new(env!("CARGO_BIN_EXE_berth"), vec!["shim".to_owned()])
}

/// Spawns through a launcher of its own, whose zygote is gone when this
/// returns: the shim must not need it.
async fn spawn(spec: &ShimSpec) -> Result<(ShimHandle, ShimState, Reaper), ShimError> {
    let (handle, state) = launcher().spawn(spec).await?;
    let reaper = Reaper(vec![(state.pid, state.pid_start), (state.shim_pid, 0)]);
    Ok((handle, state, reaper))
}

/// Kills what a failed test left behind (checking start times, so a reused
/// pid is never hit). A start time of 0 means "any".
struct Reaper(Vec<(u32, u64)>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for &(pid, start) in &self.0 {
            if stat(pid).is_some_and(|(_, s)| start == 0 || s == start) {
                let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
            }
        }
    }
}

/// `(state, start time)` from `/proc/<pid>/stat`.
fn stat(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut fields = text[text.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?.chars().next()?;
    Some((state, fields.nth(18)?.parse().ok()?))
}

/// Whether this very process (not a reused pid) still runs; a zombie does
/// not count, since whoever reaps orphans here may be slow to.
fn alive(pid: u32, start: u64) -> bool {
    stat(pid).is_some_and(|(state, s)| s == start && !matches!(state, 'Z' | 'X'))
}

async fn poll_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "gave up waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn next(handle: &mut ShimHandle) -> Option<ShimEvent> {
    tokio::time::timeout(PATIENCE, handle.next_event())
        .await
        .expect("no shim event in time")
}

/// Skips events until one `want`s it.
async fn expect_event(handle: &mut ShimHandle, want: impl Fn(&ShimEvent) -> bool) -> ShimEvent {
    loop {
        match next(handle).await {
            Some(event) if want(&event) => return event,
            Some(_) => {}
            None => panic!("shim went away while waiting for an event"),
        }
    }
}

/// How the program ended: from `Exited`, or from the state file when the
/// shim was already gone.
async fn exit_of(handle: &mut ShimHandle, state_path: &Path) -> (ExitInfo, String) {
    while let Some(event) = next(handle).await {
        if let ShimEvent::Exited { exit, stderr_tail } = event {
            return (exit, stderr_tail);
        }
    }
    let state = ShimHandle::read_state(state_path).unwrap();
    (
        state.exit.expect("shim gone without recording an exit"),
        state.stderr_tail,
    )
}

fn read_log(spec: &ShimSpec) -> Vec<u8> {
    std::fs::read(&spec.log_path).unwrap_or_default()
}

fn log_contains(spec: &ShimSpec, needle: &str) -> bool {
    String::from_utf8_lossy(&read_log(spec)).contains(needle)
}

async fn send(handle: &ShimHandle, command: ShimCommand) {
    handle.control().send(command).await.unwrap();
}

#[tokio::test]
async fn ready_token_is_captured_and_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = spec(
        dir.path(),
        // Waits for the test's go-ahead, so the token comes after Hello.
        &sh("echo starting
             while [ ! -e go ]; do sleep 0.01; done
             echo 'web: http://127.0.0.1:1/?token=abc123' >&2
             exec sleep 1000"),
    );
    spec.ready_regex = Some(r"\?token=(\w+)".to_owned());
    let (mut handle, state, _reaper) = spawn(&spec).await.unwrap();
    assert_eq!(state.instance_id, "inst-1");
    assert_eq!(state.epoch, 7);
    assert_eq!(stat(state.pid).unwrap().1, state.pid_start);
    assert_eq!(state.token, None);

    std::fs::write(dir.path().join("go"), "").unwrap();
    let event = expect_event(&mut handle, |e| matches!(e, ShimEvent::Ready { .. })).await;
    assert_eq!(
        event,
        ShimEvent::Ready {
            token: Some("abc123".to_owned())
        }
    );
    let recorded = ShimHandle::read_state(&spec.state_path).unwrap();
    assert_eq!(recorded.token.as_deref(), Some("abc123"));
    assert_eq!(recorded.pid, state.pid);
    let mode = std::fs::metadata(&spec.state_path)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);

    send(&handle, ShimCommand::Kill).await;
    let (exit, _) = exit_of(&mut handle, &spec.state_path).await;
    assert_eq!(
        exit,
        ExitInfo {
            code: None,
            signal: Some(9),
            oom_limit_mb: None,
        }
    );
    poll_until("socket removed", || !spec.socket_path.exists()).await;
}

/// A ready line printed before a client connects is still known to one
/// that attaches later: the state file records `ready` and the token the
/// regex's capture group took from that line.
#[tokio::test]
async fn a_ready_line_before_connect_is_recorded_with_its_token() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = spec(
        dir.path(),
        &sh("echo 'listening on http://127.0.0.1:1/?token=early42'; exec sleep 1000"),
    );
    spec.ready_regex = Some(r"^listening on .*\?token=(\w+)".to_owned());
    let (handle, state, _reaper) = spawn(&spec).await.unwrap();
    poll_until("ready recorded", || {
        ShimHandle::read_state(&spec.state_path).is_ok_and(|s| s.ready)
    })
    .await;
    let recorded = ShimHandle::read_state(&spec.state_path).unwrap();
    assert_eq!(recorded.token.as_deref(), Some("early42"), "{recorded:?}");
    let (_late, hello) = ShimHandle::attach(&spec.state_path).await.unwrap();
    assert!(hello.ready, "a client attaching later learns it is ready");
    assert_eq!(hello.token.as_deref(), Some("early42"), "{hello:?}");
    // The first client may or may not have seen the line in its own hello;
    // if it did, it saw the same token.
    if state.ready {
        assert_eq!(state.token.as_deref(), Some("early42"), "{state:?}");
    }
    send(&handle, ShimCommand::Kill).await;
}

/// A ready regex without a capture group marks the program ready and
/// records no token: readiness is the line itself (`^listening`).
#[tokio::test]
async fn a_ready_regex_without_a_capture_group_records_no_token() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = spec(
        dir.path(),
        &sh("echo 'listening on http://127.0.0.1:1/?token=unseen'; exec sleep 1000"),
    );
    spec.ready_regex = Some("^listening".to_owned());
    let (handle, _state, _reaper) = spawn(&spec).await.unwrap();
    poll_until("ready recorded", || {
        ShimHandle::read_state(&spec.state_path).is_ok_and(|s| s.ready)
    })
    .await;
    let recorded = ShimHandle::read_state(&spec.state_path).unwrap();
    assert_eq!(recorded.token, None, "{recorded:?}");
    let (_late, hello) = ShimHandle::attach(&spec.state_path).await.unwrap();
    assert!(hello.ready);
    assert_eq!(hello.token, None, "{hello:?}");
    send(&handle, ShimCommand::Kill).await;
}

#[tokio::test]
async fn exit_code_stderr_tail_and_log_are_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
        echo to-stdout
        printf 'not utf-8: \377\376\n' >&2
        head -c 200000 /dev/zero | tr '\0' x
        echo
        i=0
        while [ $i -lt 100 ]; do printf 'stderr line %03d\n' $i >&2; i=$((i+1)); done
        exit 3
    "#;
    let spec = spec(dir.path(), &sh(script));
    let (mut handle, _state, _reaper) = spawn(&spec).await.unwrap();
    let (exit, tail) = exit_of(&mut handle, &spec.state_path).await;
    assert_eq!(
        exit,
        ExitInfo {
            code: Some(3),
            signal: None,
            oom_limit_mb: None,
        }
    );
    assert_eq!(tail.chars().count(), 500);
    assert!(tail.ends_with("stderr line 099\n"), "{tail:?}");

    let recorded = ShimHandle::read_state(&spec.state_path).unwrap();
    assert_eq!(recorded.exit, Some(exit));
    assert_eq!(recorded.stderr_tail, tail);
    // stdout and stderr are two pipes, so their lines interleave in the
    // log in the order the shim happened to read them (a line longer than
    // a piece, 64 KiB, may have the other stream's lines between its
    // pieces). Each stream on its own is whole and in order.
    let mut stderr_lines = vec![b"not utf-8: \xff\xfe\n".to_vec()];
    stderr_lines.extend((0..100).map(|i| format!("stderr line {i:03}\n").into_bytes()));
    let (stdout, stderr) = split_streams(&read_log(&spec), &stderr_lines);
    assert_eq!(
        stderr,
        stderr_lines.len(),
        "stderr lines missing or out of order"
    );
    let mut expected = b"to-stdout\n".to_vec();
    expected.extend(std::iter::repeat_n(b'x', 200_000));
    expected.push(b'\n');
    assert!(
        stdout == expected,
        "stdout in the log is not the program's: {} bytes, {} x",
        stdout.len(),
        stdout.iter().filter(|&&b| b == b'x').count()
    );
    poll_until("socket removed", || !spec.socket_path.exists()).await;
}

/// Takes `stderr_lines` (in their order) out of a log that merged them
/// with stdout: returns what is left (stdout's bytes) and how many of the
/// lines were found in order.
fn split_streams(log: &[u8], stderr_lines: &[Vec<u8>]) -> (Vec<u8>, usize) {
    let (mut rest, mut found, mut at) = (Vec::new(), 0, 0);
    while at < log.len() {
        match stderr_lines.get(found) {
            Some(line) if log[at..].starts_with(line) => {
                found += 1;
                at += line.len();
            }
            _ => {
                rest.push(log[at]);
                at += 1;
            }
        }
    }
    (rest, found)
}

#[tokio::test]
async fn spawn_failures_name_the_program() {
    let dir = tempfile::tempdir().unwrap();
    let missing = spawn(&spec(dir.path(), &["nope-xyz"])).await.err().unwrap();
    assert!(
        matches!(&missing, ShimError::SpawnFailed(m) if m.contains("\"nope-xyz\"") && m.contains("PATH")),
        "{missing}"
    );

    let script = dir.path().join("not-executable");
    std::fs::write(&script, "#!/bin/sh\n").unwrap();
    let denied = spawn(&spec(dir.path(), &[script.to_str().unwrap()]))
        .await
        .err()
        .unwrap();
    let ShimError::SpawnFailed(message) = &denied else {
        panic!("{denied}")
    };
    assert!(
        message.contains(script.to_str().unwrap()) && message.contains("Permission denied"),
        "{message}"
    );

    let mut bad_cwd = spec(dir.path(), &["sleep", "1"]);
    bad_cwd.cwd = dir.path().join("no-such-dir");
    let error = spawn(&bad_cwd).await.err().unwrap();
    assert!(
        matches!(&error, ShimError::SpawnFailed(m) if m.contains("\"sleep\"") && m.contains("no-such-dir")),
        "{error}"
    );

    let mut long_socket = spec(dir.path(), &["sleep", "1"]);
    long_socket.socket_path = dir.path().join("s".repeat(120));
    let error = spawn(&long_socket).await.err().unwrap();
    assert!(
        matches!(&error, ShimError::SpawnFailed(m) if m.contains("too long")),
        "{error}"
    );
}

#[tokio::test]
async fn stop_sends_term_then_kills_the_group_after_grace() {
    let dir = tempfile::tempdir().unwrap();
    // The program shrugs off TERM; its grandchild ignores TERM outright.
    let script = r#"
        trap 'echo got-term' TERM
        sh -c 'trap "" TERM; exec sleep 1000' &
        echo "grandchild $!"
        while :; do sleep 0.05; done
    "#;
    let spec = spec(dir.path(), &sh(script));
    let (mut handle, state, mut reaper) = spawn(&spec).await.unwrap();
    poll_until("grandchild pid in the log", || {
        log_contains(&spec, "grandchild ")
    })
    .await;
    let text = String::from_utf8_lossy(&read_log(&spec)).into_owned();
    let grandchild: u32 = text
        .split("grandchild ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let grandchild_start = stat(grandchild).unwrap().1;
    reaper.0.push((grandchild, grandchild_start));

    // A long grace: TERM alone must not end it.
    send(&handle, ShimCommand::Stop { grace_ms: 600_000 }).await;
    poll_until("the trap to run", || log_contains(&spec, "got-term")).await;
    assert!(alive(state.pid, state.pid_start));
    // A shorter grace wins; then the group is killed.
    send(&handle, ShimCommand::Stop { grace_ms: 100 }).await;
    let (exit, _) = exit_of(&mut handle, &spec.state_path).await;
    assert_eq!(
        exit,
        ExitInfo {
            code: None,
            signal: Some(9),
            oom_limit_mb: None,
        }
    );
    poll_until("grandchild gone", || !alive(grandchild, grandchild_start)).await;
}

#[tokio::test]
async fn kill_ends_the_program_now() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec(dir.path(), &sh("trap '' TERM; sleep 1000"));
    let (mut handle, state, _reaper) = spawn(&spec).await.unwrap();
    send(&handle, ShimCommand::Kill).await;
    let (exit, _) = exit_of(&mut handle, &spec.state_path).await;
    assert_eq!(exit.signal, Some(9));
    assert!(!alive(state.pid, state.pid_start));
}

/// The orphans a program leaves are its shim's to reap, even one that is
/// still dying when the shim kills the program's group: here an orphan
/// with a gigabyte of memory to give back, which takes the kernel tens of
/// milliseconds after the SIGKILL. At level `none` that kill is one
/// `killpg`, which does not wait, so the shim must look again until the
/// orphan is gone, before it reports the exit. The orphan's output goes
/// elsewhere, so the report does not wait for its pipes to close.
#[tokio::test]
async fn an_orphan_still_dying_when_its_group_is_killed_is_reaped_before_the_exit_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec(
        dir.path(),
        &sh(r#"python3 -c '
import os, time
memory = bytearray(1 << 30)
memory[::4096] = b"\x01" * (len(memory) // 4096)
with open("/proc/self/stat") as stat, open("orphan.part", "w") as f:
    f.write("%d %s" % (os.getpid(), stat.read().rsplit(")", 1)[1].split()[19]))
os.replace("orphan.part", "orphan.pid")
time.sleep(1000)
' >/dev/null 2>&1 &
            while [ ! -e orphan.pid ]; do sleep 0.01; done
            exit 3"#),
    );
    let (mut handle, _state, _reaper) = spawn(&spec).await.unwrap();
    let (exit, _) = exit_of(&mut handle, &spec.state_path).await;
    // Its pid and start time: the pid alone may be another's by now.
    let written = std::fs::read_to_string(dir.path().join("orphan.pid")).unwrap();
    let (pid, start) = written.split_once(' ').unwrap();
    let orphan: (u32, u64) = (pid.parse().unwrap(), start.parse().unwrap());
    let _orphan_reaper = Reaper(vec![orphan]);
    // Looked at once, as the exit arrives: a zombie the shim left would be
    // reaped by the host's init a moment later.
    let left = stat(orphan.0).filter(|(_, start)| *start == orphan.1);
    assert_eq!(left, None, "the orphan outlived its shim's report");
    assert_eq!(exit.code, Some(3), "{exit:?}");
}
#[tokio::test]
async fn freeze_and_thaw() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec(dir.path(), &["sleep", "1000"]);
    let (mut handle, state, _reaper) = spawn(&spec).await.unwrap();

    send(&handle, ShimCommand::Freeze).await;
    assert_eq!(next(&mut handle).await, Some(ShimEvent::Frozen));
    poll_until("stopped", || stat(state.pid).is_some_and(|(s, _)| s == 'T')).await;
    assert!(ShimHandle::read_state(&spec.state_path).unwrap().frozen);

    send(&handle, ShimCommand::Thaw).await;
    assert_eq!(next(&mut handle).await, Some(ShimEvent::Thawed));
    poll_until("running again", || {
        stat(state.pid).is_some_and(|(s, _)| s != 'T')
    })
    .await;
    assert!(!ShimHandle::read_state(&spec.state_path).unwrap().frozen);

    send(&handle, ShimCommand::Kill).await;
    exit_of(&mut handle, &spec.state_path).await;
}

/// A hook acts for the program, so it never runs on while the program is
/// frozen: a hook given ten minutes is killed by the freeze, and its
/// answer says so (SIGKILL, not its grace running out). Here, at level
/// `none`, the hook is in a process group of its own, which a freeze of
/// the program's group does not reach.
#[tokio::test]
async fn a_freeze_cuts_off_a_running_hook() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec(dir.path(), &["sleep", "1000"]);
    let (mut handle, _state, _reaper) = spawn(&spec).await.unwrap();
    let pid_file = dir.path().join("hook.pid");
    let script = format!("echo $$ > {}; exec sleep 600", pid_file.display());
    send(
        &handle,
        ShimCommand::Hook {
            id: 1,
            name: "pre_stop".to_owned(),
            argv: sh(&script).iter().map(|a| (*a).to_owned()).collect(),
            grace_ms: 600_000,
        },
    )
    .await;
    let mut hook = None;
    poll_until("the hook running", || {
        hook = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok())
            .and_then(|pid| Some((pid, stat(pid)?.1)));
        hook.is_some()
    })
    .await;
    let (hook_pid, hook_start) = hook.unwrap();
    let _hook_reaper = Reaper(vec![(hook_pid, hook_start)]);

    send(&handle, ShimCommand::Freeze).await;
    let done = expect_event(&mut handle, |e| matches!(e, ShimEvent::HookDone { .. })).await;
    let ShimEvent::HookDone { id, outcome } = done else {
        unreachable!()
    };
    let outcome = outcome.unwrap();
    assert_eq!((id, outcome.signal, outcome.timed_out), (1, Some(9), false));
    assert!(!alive(hook_pid, hook_start));
    send(&handle, ShimCommand::Kill).await;
    exit_of(&mut handle, &spec.state_path).await;
}

/// The fencing hole (ARCHITECTURE.md, invariant 4): a frozen program
/// asked to stop is killed while frozen, never thawed so that it could
/// act on SIGTERM (its lease may be another node's by then). Its TERM
/// handler writes a file: that file never appears.
///
/// The shell forks its child before it is ready and then only waits: a
/// shell that keeps starting commands (`while :; do sleep 0.05; done`) may
/// be frozen mid-`vfork`, and then waits in state `D` (not `T`) for its
/// stopped child until the thaw; just as frozen, but not what `stat` polls
/// for below.
#[tokio::test]
async fn a_stop_of_a_frozen_program_kills_it_without_a_thaw() {
    let dir = tempfile::tempdir().unwrap();
    let wrote = dir.path().join("term-handler-ran");
    let script = format!(
        r#"trap 'echo flushed > "{}"; exit 0' TERM; sleep 1000 & echo up; wait"#,
        wrote.display()
    );
    let mut spec = spec(dir.path(), &sh(&script));
    spec.ready_regex = Some("^up$".to_owned());
    // Ready means the TERM handler is in place; the shim may have seen the
    // line before this connection (then its Hello says so, and no event
    // follows).
    let (mut handle, state, _reaper) = spawn(&spec).await.unwrap();
    if !state.ready {
        expect_event(&mut handle, |e| matches!(e, ShimEvent::Ready { .. })).await;
    }

    send(&handle, ShimCommand::Freeze).await;
    expect_event(&mut handle, |e| *e == ShimEvent::Frozen).await;
    poll_until("stopped", || stat(state.pid).is_some_and(|(s, _)| s == 'T')).await;
    send(&handle, ShimCommand::Stop { grace_ms: 600_000 }).await;
    let (exit, _) = exit_of(&mut handle, &spec.state_path).await;
    assert_eq!(exit.signal, Some(9), "{exit:?}");
    assert!(
        !wrote.exists(),
        "the TERM handler ran: the program was thawed"
    );
    assert!(!alive(state.pid, state.pid_start));

    // The same program, not frozen, does get to run its handler: the
    // check above can fail.
    let (mut handle, state, _reaper) = spawn(&spec).await.unwrap();
    if !state.ready {
        expect_event(&mut handle, |e| matches!(e, ShimEvent::Ready { .. })).await;
    }
    send(&handle, ShimCommand::Stop { grace_ms: 600_000 }).await;
    let (exit, _) = exit_of(&mut handle, &spec.state_path).await;
    assert_eq!(exit.code, Some(0), "{exit:?}");
    assert!(wrote.exists());
}

#[tokio::test]
async fn fence_deadline_freezes_when_not_extended() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = spec(dir.path(), &["sleep", "1000"]);
    spec.fence_ms = Some(200);
    let (mut handle, state, _reaper) = spawn(&spec).await.unwrap();
    assert_eq!(next(&mut handle).await, Some(ShimEvent::Frozen));
    poll_until("stopped", || stat(state.pid).is_some_and(|(s, _)| s == 'T')).await;
    assert!(ShimHandle::read_state(&spec.state_path).unwrap().frozen);

    // Extending does not thaw; only an explicit Thaw does.
    send(&handle, ShimCommand::Extend { ms: 600_000 }).await;
    send(&handle, ShimCommand::Thaw).await;
    assert_eq!(next(&mut handle).await, Some(ShimEvent::Thawed));
    poll_until("running again", || {
        stat(state.pid).is_some_and(|(s, _)| s != 'T')
    })
    .await;

    send(&handle, ShimCommand::Kill).await;
    exit_of(&mut handle, &spec.state_path).await;
}

#[tokio::test]
async fn fence_deadline_extended_keeps_running() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = spec(dir.path(), &["sleep", "1000"]);
    spec.fence_ms = Some(1500);
    let (mut handle, state, _reaper) = spawn(&spec).await.unwrap();
    let control = handle.control();
    // Renew well past the initial deadline, as berth does on every renew.
    let until = tokio::time::Instant::now() + Duration::from_millis(2500);
    while tokio::time::Instant::now() < until {
        control
            .send(ShimCommand::Extend { ms: 1500 })
            .await
            .unwrap();
        if let Ok(event) =
            tokio::time::timeout(Duration::from_millis(50), handle.next_event()).await
        {
            panic!("unexpected event {event:?}");
        }
    }
    assert_ne!(stat(state.pid).unwrap().0, 'T');
    assert!(!ShimHandle::read_state(&spec.state_path).unwrap().frozen);

    control.send(ShimCommand::Kill).await.unwrap();
    exit_of(&mut handle, &spec.state_path).await;
}

#[tokio::test]
async fn program_dies_with_its_shim_and_attach_says_gone() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec(dir.path(), &["sleep", "1000"]);
    let (mut handle, state, _reaper) = spawn(&spec).await.unwrap();
    kill(Pid::from_raw(state.shim_pid as i32), Signal::SIGKILL).unwrap();
    poll_until("program killed by parent-death signal", || {
        !alive(state.pid, state.pid_start)
    })
    .await;
    assert_eq!(next(&mut handle).await, None);

    let error = ShimHandle::attach(&spec.state_path).await.err().unwrap();
    assert!(matches!(error, ShimError::Gone(_)), "{error}");
}

/// A shim that takes the connection and does not greet is killed, and its
/// program with it: berth cannot supervise it, and must not start a
/// second instance beside it. The test stops the shim (SIGSTOP) to make it
/// silent.
#[tokio::test]
async fn a_silent_shim_is_killed_with_its_program() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec(dir.path(), &["sleep", "1000"]);
    let (_first, state, _reaper) = spawn(&spec).await.unwrap();
    let shim_start = stat(state.shim_pid).unwrap().1;
    kill(Pid::from_raw(state.shim_pid as i32), Signal::SIGSTOP).unwrap();

    let error = ShimHandle::attach_within(&spec.state_path, Duration::from_millis(300))
        .await
        .err()
        .unwrap();
    assert!(matches!(error, ShimError::Silent(_)), "{error}");
    poll_until("the silent shim and its program are gone", || {
        !alive(state.shim_pid, shim_start) && !alive(state.pid, state.pid_start)
    })
    .await;
}

#[tokio::test]
async fn second_client_attaches_and_shares_events() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec(dir.path(), &["sleep", "1000"]);
    let (mut first, state, _reaper) = spawn(&spec).await.unwrap();

    let (mut second, hello) = ShimHandle::attach(&spec.state_path).await.unwrap();
    assert_eq!(
        (hello.pid, hello.pid_start, hello.shim_pid),
        (state.pid, state.pid_start, state.shim_pid)
    );

    send(&second, ShimCommand::Freeze).await;
    assert_eq!(next(&mut first).await, Some(ShimEvent::Frozen));
    assert_eq!(next(&mut second).await, Some(ShimEvent::Frozen));

    // A state file that names another start time of this pid is stale.
    let mut stale = hello.clone();
    stale.pid_start += 1;
    let stale_path = dir.path().join("stale.json");
    std::fs::write(&stale_path, serde_json::to_vec(&stale).unwrap()).unwrap();
    let error = ShimHandle::attach(&stale_path).await.err().unwrap();
    assert!(matches!(error, ShimError::Gone(_)), "{error}");

    send(&first, ShimCommand::Kill).await;
    let (a, _) = exit_of(&mut first, &spec.state_path).await;
    let (b, _) = exit_of(&mut second, &spec.state_path).await;
    assert_eq!(a, b);
    let error = ShimHandle::attach(&spec.state_path).await.err().unwrap();
    assert!(matches!(error, ShimError::Gone(_)), "{error}");
    // Once the connection has closed, commands fail as Gone.
    assert_eq!(next(&mut second).await, None);
    let control = second.control();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !matches!(
        control.send(ShimCommand::Kill).await,
        Err(ShimError::Gone(_))
    ) {
        assert!(tokio::time::Instant::now() < deadline, "send kept working");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn shim_survives_sighup_and_clients_hanging_up() {
    let dir = tempfile::tempdir().unwrap();
    // Output keeps flowing so events and writes race the hang-ups.
    let mut spec = spec(dir.path(), &sh("while :; do echo tick; sleep 0.01; done"));
    spec.ready_regex = Some("(tick)".to_owned());
    let (mut handle, state, _reaper) = spawn(&spec).await.unwrap();
    // The first tick may come before or after Hello.
    if state.token.is_none() {
        expect_event(&mut handle, |e| matches!(e, ShimEvent::Ready { .. })).await;
    }
    drop(handle);
    for _ in 0..5 {
        let (handle, _) = ShimHandle::attach(&spec.state_path).await.unwrap();
        send(&handle, ShimCommand::Freeze).await;
        send(&handle, ShimCommand::Thaw).await;
        drop(handle);
    }
    kill(Pid::from_raw(state.shim_pid as i32), Signal::SIGHUP).unwrap();

    let (mut handle, hello) = ShimHandle::attach(&spec.state_path).await.unwrap();
    assert_eq!(hello.token.as_deref(), Some("tick"));
    assert!(alive(state.pid, state.pid_start));
    send(&handle, ShimCommand::Kill).await;
    let (exit, _) = exit_of(&mut handle, &spec.state_path).await;
    assert_eq!(exit.signal, Some(9));
}

#[tokio::test]
async fn program_gets_only_its_own_environment() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = spec(
        dir.path(),
        &sh("echo \"var=$BERTH_TEST_VAR home=${HOME:-unset} pwd=$(pwd -P)\""),
    );
    spec.env
        .push(("BERTH_TEST_VAR".to_owned(), "hello".to_owned()));
    let (mut handle, _state, _reaper) = spawn(&spec).await.unwrap();
    let (exit, _) = exit_of(&mut handle, &spec.state_path).await;
    assert_eq!(exit.code, Some(0));
    let cwd = dir.path().canonicalize().unwrap();
    assert!(
        log_contains(
            &spec,
            &format!("var=hello home=unset pwd={}", cwd.display())
        ),
        "{:?}",
        String::from_utf8_lossy(&read_log(&spec))
    );
}

/// A test double of the zygote (python3): takes one request, forks a
/// "shim" that writes `report` to the pipe it was given (with
/// `"shim_pid":424242` replaced by its own pid) and then only sleeps, and
/// answers (only if `answers`; otherwise it exits, as a zygote dying with
/// the request in flight would) with the shim's pidfd and a pid:
/// `answered_pid`, or the shim's own.
struct FakeZygote {
    exe: std::path::PathBuf,
    pid_file: std::path::PathBuf,
    starts_file: std::path::PathBuf,
}

impl FakeZygote {
    fn new(dir: &Path, report: &str, answers: bool, answered_pid: Option<u32>) -> FakeZygote {
        let fake = FakeZygote {
            exe: dir.join("fake-zygote"),
            pid_file: dir.join("fake-shim.pid"),
            starts_file: dir.join("fake-zygote.starts"),
        };
        std::fs::write(
            &fake.exe,
            format!(
                r#"#!/usr/bin/env python3
import os, signal, socket
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
with open({starts:?}, "a") as f:
    f.write("started\n")
requests = socket.socket(fileno=0)
_, fds, _, _ = socket.recv_fds(requests, 1 << 17, 1)
pid = os.fork()
if pid == 0:
    os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
    line = {report:?}.replace('"shim_pid":424242', '"shim_pid":%d' % os.getpid())
    os.write(fds[0], line.encode() + b"\n")
    os.execvp("sleep", ["sleep", "1000"])
os.close(fds[0])
with open({pid_file:?}, "w") as f:
    f.write(str(pid))
if {answers}:
    socket.send_fds(requests, [b"pid %d" % ({answered_pid} or pid)], [os.pidfd_open(pid)])
    requests.recv(1)
"#,
                starts = fake.starts_file.display().to_string(),
                pid_file = fake.pid_file.display().to_string(),
                answers = if answers { "True" } else { "False" },
                answered_pid = answered_pid.map_or("None".to_owned(), |p| p.to_string()),
            ),
        )
        .unwrap();
        std::fs::set_permissions(&fake.exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        fake
    }

    /// The pid of the "shim" it forked.
    fn shim_pid(&self) -> u32 {
        std::fs::read_to_string(&self.pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    fn starts(&self) -> usize {
        std::fs::read_to_string(&self.starts_file)
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }
}

/// The state a fake shim reports: `socket` is where nobody listens.
fn fake_state(spec: &ShimSpec, socket: &Path, shim_pid: u32) -> ShimState {
    ShimState {
        instance_id: spec.instance_id.clone(),
        user: spec.user.clone(),
        role: Role::Main,
        epoch: spec.epoch,
        socket_path: socket.to_path_buf(),
        shim_pid,
        pid: 1,
        pid_start: 0,
        ready: false,
        token: None,
        exit: None,
        stderr_tail: String::new(),
        frozen: false,
        uid: None,
        cgroup: Vec::new(),
        port: None,
    }
}

/// Spawns through a [`FakeZygote`] whose "shim" reports `Spawned` with a
/// socket nobody listens on and `shim_pid` as its pid, and returns the
/// error `spawn` must give. The directory holds the fake's files.
async fn spawn_unlistened(
    answers: bool,
    answered_pid: Option<u32>,
    shim_pid: u32,
) -> (FakeZygote, ShimError, tempfile::TempDir) {
    use berth_local::shim::SpawnReport;
    let dir = tempfile::tempdir().unwrap();
    let spec = spec(dir.path(), &["true"]);
    std::fs::create_dir_all(dir.path().join("run")).unwrap();
    let state = fake_state(&spec, &dir.path().join("run/nobody-listens.sock"), shim_pid);
    std::fs::write(&spec.state_path, serde_json::to_vec(&state).unwrap()).unwrap();
    let report = serde_json::to_string(&SpawnReport::Spawned { state }).unwrap();
    let fake = FakeZygote::new(dir.path(), &report, answers, answered_pid);
    let err = match ShimLauncher::new(&fake.exe, vec![]).spawn(&spec).await {
        Ok(_) => panic!("spawn succeeded without a shim listening"),
        Err(e) => e,
    };
    (fake, err, dir)
}

/// A shim that reports `Spawned` but never listens on its socket: `spawn`
/// fails, and must not leave that shim (and so its program) running
/// unowned while the caller releases the lease and port.
#[tokio::test]
async fn spawn_kills_the_shim_when_connecting_after_spawned_fails() {
    // The zygote answers with a decoy's pid and the shim's pidfd (and the
    // report says pid 1): berth must kill through the pidfd, which cannot
    // name another process, and hit neither pid.
    let mut decoy = std::process::Command::new("sleep")
        .arg("1000")
        .spawn()
        .unwrap();
    let (fake, err, _dir) = spawn_unlistened(true, Some(decoy.id()), 1).await;
    assert!(matches!(err, ShimError::Gone(_)), "{err:?}");
    let pid = fake.shim_pid();
    let start = stat(pid).map(|(_, s)| s).unwrap_or(0);
    let _reaper = Reaper(vec![(pid, start)]);
    assert!(
        !alive(pid, start) || stat(pid).is_none(),
        "the shim {pid} still runs after spawn failed"
    );
    assert!(
        decoy.try_wait().unwrap().is_none(),
        "berth killed the answered pid, not the shim's pidfd"
    );
    decoy.kill().unwrap();
    decoy.wait().unwrap();
}

#[tokio::test]
async fn a_dead_zygote_is_replaced_and_its_shims_live_on() {
    let dir = tempfile::tempdir().unwrap();
    let launcher = launcher();
    let first = spec(&dir.path().join("one"), &["sleep", "1000"]);
    std::fs::create_dir_all(&first.cwd).unwrap();
    let (_handle, state) = launcher.spawn(&first).await.unwrap();
    let _reaper = Reaper(vec![(state.pid, state.pid_start), (state.shim_pid, 0)]);
    let zygote = launcher.zygote_pid().await.expect("a zygote runs");
    kill(Pid::from_raw(zygote as i32), Signal::SIGKILL).unwrap();
    poll_until("the zygote is gone", || {
        stat(zygote).is_none_or(|(state, _)| state == 'Z')
    })
    .await;

    let second = spec(&dir.path().join("two"), &["sleep", "1000"]);
    std::fs::create_dir_all(&second.cwd).unwrap();
    let (_handle2, state2) = launcher.spawn(&second).await.unwrap();
    let _reaper2 = Reaper(vec![(state2.pid, state2.pid_start), (state2.shim_pid, 0)]);
    let replacement = launcher.zygote_pid().await.expect("a new zygote runs");
    assert_ne!(replacement, zygote);
    assert!(
        alive(state.pid, state.pid_start),
        "the first program died with the zygote"
    );
    launcher.shutdown().await;
    assert!(
        alive(state2.pid, state2.pid_start),
        "a shim died with the zygote's shutdown"
    );
}

#[tokio::test]
async fn the_program_inherits_no_ignored_signals_or_stray_descriptors() {
    use std::os::fd::AsRawFd;
    // What a berth started from a careless parent would carry: an ignored
    // SIGQUIT and a descriptor without close-on-exec.
    // SAFETY: SIG_IGN installs no handler; nothing of this test binary
    // relies on SIGQUIT.
    unsafe { nix::sys::signal::signal(Signal::SIGQUIT, nix::sys::signal::SigHandler::SigIgn) }
        .unwrap();
    let stray = std::fs::File::open("/dev/zero").unwrap();
    nix::fcntl::fcntl(
        stray.as_raw_fd(),
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let spec = spec(dir.path(), &["sleep", "1000"]);
    let (_handle, state, _reaper) = spawn(&spec).await.unwrap();
    for (who, pid) in [("program", state.pid), ("shim", state.shim_pid)] {
        let descriptors: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
            .collect();
        assert!(
            !descriptors.iter().any(|d| d == Path::new("/dev/zero")),
            "a stray descriptor reached the {who}: {descriptors:?}"
        );
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", state.pid)).unwrap();
    let ignored = status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .map(|mask| u64::from_str_radix(mask.trim(), 16).unwrap())
        .unwrap();
    let bit = |sig: Signal| 1u64 << (sig as i32 - 1);
    assert_eq!(
        ignored & bit(Signal::SIGCHLD),
        0,
        "SIGCHLD ignored: {ignored:x}"
    );
    assert_eq!(
        ignored & bit(Signal::SIGINT),
        0,
        "SIGINT ignored: {ignored:x}"
    );
    assert_eq!(
        ignored & bit(Signal::SIGQUIT),
        0,
        "SIGQUIT ignored: {ignored:x}"
    );
}

#[tokio::test]
async fn an_oversized_spec_is_refused_and_starts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = spec(dir.path(), &["sleep", "1000"]);
    spec.env.push(("HUGE".to_owned(), "x".repeat(200 * 1024)));
    let launcher = launcher();
    let err = match launcher.spawn(&spec).await {
        Ok(_) => panic!("an oversized spec was taken"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("over the limit of 131072"), "{err}");
    assert!(
        launcher.zygote_pid().await.is_none(),
        "a zygote was started for nothing"
    );
    assert!(!spec.state_path.exists());
}

/// The zygote forks, then dies before answering: the request is not sent
/// again (a second shim for one instance could result); the report names
/// the shim, which is then handled like any other. Here it never listens,
/// so it is killed.
#[tokio::test]
async fn a_zygote_dying_with_a_request_in_flight_is_not_asked_again() {
    let (fake, err, _dir) = spawn_unlistened(false, None, 424242).await;
    assert!(matches!(err, ShimError::Gone(_)), "{err:?}");
    assert_eq!(fake.starts(), 1, "the request went to a second zygote");
    let pid = fake.shim_pid();
    let start = stat(pid).map(|(_, s)| s).unwrap_or(0);
    let _reaper = Reaper(vec![(pid, start)]);
    poll_until("the unanswered shim is killed", || !alive(pid, start)).await;
}

/// Speaking the zygote's protocol directly, with a report pipe whose read
/// end is already closed (berth gave up on the shim, or died mid-launch):
/// the shim cannot deliver its report, so it stops the program it started
/// and records the exit.
#[tokio::test]
async fn a_shim_whose_report_nobody_reads_stops_its_program() {
    use nix::sys::socket::{
        AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, recv, sendmsg, socketpair,
    };
    use std::os::fd::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let spec = spec(dir.path(), &["sleep", "1000"]);
    let (ours, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .unwrap();
    let mut zygote = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .arg("shim")
        .stdin(std::process::Stdio::from(theirs))
        .spawn()
        .unwrap();
    let (report_read, report_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
    drop(report_read);
    let request = serde_json::to_vec(&spec).unwrap();
    sendmsg::<()>(
        ours.as_raw_fd(),
        &[std::io::IoSlice::new(&request)],
        &[ControlMessage::ScmRights(&[report_write.as_raw_fd()])],
        MsgFlags::empty(),
        None,
    )
    .unwrap();
    drop(report_write);
    let mut answer = [0u8; 64];
    let n = recv(ours.as_raw_fd(), &mut answer, MsgFlags::empty()).unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]).into_owned();
    let shim_pid: u32 = answer.strip_prefix("pid ").unwrap().parse().unwrap();
    let _reaper = Reaper(vec![(shim_pid, 0)]);

    poll_until("the shim records the program's exit", || {
        ShimHandle::read_state(&spec.state_path).is_ok_and(|s| s.exit.is_some())
    })
    .await;
    let state = ShimHandle::read_state(&spec.state_path).unwrap();
    let _reaper2 = Reaper(vec![(state.pid, state.pid_start)]);
    assert_eq!(state.exit.unwrap().signal, Some(9), "killed, not exited");
    poll_until("the program is gone", || !alive(state.pid, state.pid_start)).await;
    drop(ours);
    assert!(
        zygote.wait().unwrap().success(),
        "the zygote exits cleanly at end of stream"
    );
}

/// A spec for a program isolated at level `user` as `uid`.
fn isolated(dir: &Path, argv: &[&str], uid: u32) -> ShimSpec {
    ShimSpec {
        isolation: Some(IsolationSpec {
            uid,
            gid: uid,
            name: "nobody-test".to_owned(),
            limits: Limits {
                memory_max_mb: 64,
                pids_max: 32,
                open_files_max: 1000,
                cpu_max_percent: 0,
            },
            // No cgroup: the account is the handle on its processes.
            cgroup: None,
            sandbox: None,
        }),
        ..spec(dir, argv)
    }
}

/// The child side of isolation (`isolation::child`, between fork and exec):
/// the program runs as the account, with no groups, no capabilities at all,
/// no_new_privs and the rlimits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_program_runs_as_its_account_with_nothing_more() {
    if !crate::support::root("shim::an_isolated_program_runs_as_its_account_with_nothing_more") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let script = "id -u; id -g; id -G; grep -E '^(Cap|NoNewPrivs)' /proc/self/status; \
                  grep -E '^Max (processes|core|open)' /proc/self/limits; pwd; echo done";
    let spec = isolated(dir.path(), &sh(script), 65_534);
    let (mut handle, state, _reaper) = spawn(&spec).await.unwrap();
    assert_eq!(state.uid, Some(65_534));
    let (exit, _) = exit_of(&mut handle, &spec.state_path).await;
    assert_eq!(
        exit.code,
        Some(0),
        "{}",
        String::from_utf8_lossy(&read_log(&spec))
    );
    let log = String::from_utf8_lossy(&read_log(&spec)).into_owned();
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(&lines[..3], ["65534", "65534", "65534"], "{log}");
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert!(
            log.contains(&format!("{cap}:\t0000000000000000")),
            "{cap}: {log}"
        );
    }
    assert!(log.contains("NoNewPrivs:\t1"), "{log}");
    let limit = |name: &str| {
        log.lines()
            .find(|l| l.starts_with(name))
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .unwrap_or_default()
    };
    assert_eq!(limit("Max processes")[2..4], ["32", "32"], "{log}");
    assert_eq!(limit("Max core file size")[4..6], ["0", "0"], "{log}");
    assert_eq!(limit("Max open files")[3..5], ["1000", "1000"], "{log}");
    assert!(log.contains(dir.path().to_str().unwrap()), "{log}");
}

/// A failing step of the child's setup is named in the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_isolation_step_is_named() {
    if !crate::support::root("shim::a_failing_isolation_step_is_named") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let private = dir.path().join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let mut spec = isolated(dir.path(), &sh("echo never"), 65_534);
    spec.cwd = private;
    let err = spawn(&spec).await.map(drop).unwrap_err().to_string();
    assert!(
        err.contains("isolation setup failed (chdir): Permission denied"),
        "{err}"
    );
}

/// The control socket takes commands from its own uid (berth's) only: a
/// process of another uid that reaches it (the directory and the socket
/// are opened up here on purpose; normally they are berth's alone) gets no
/// greeting, and its `kill` does nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_socket_refuses_every_other_uid() {
    if !crate::support::root("shim::the_control_socket_refuses_every_other_uid") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let spec = spec(dir.path(), &sh("echo up; exec sleep 1000"));
    let (_handle, state, _reaper) = spawn(&spec).await.unwrap();
    for (path, mode) in [
        (dir.path().to_owned(), 0o755),
        (dir.path().join("run"), 0o755),
        (spec.socket_path.clone(), 0o777),
    ] {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let socket = spec.socket_path.clone();
    let answer = std::thread::spawn(move || {
        use std::io::{Read, Write};
        // SAFETY: setresuid(2) as a raw system call changes the credentials
        // of the calling thread only (the glibc wrapper would change every
        // thread's); this thread ends with the closure.
        let ret = unsafe { nix::libc::syscall(nix::libc::SYS_setresuid, 65_534, 65_534, 65_534) };
        assert_eq!(ret, 0, "{}", std::io::Error::last_os_error());
        let mut stream = std::os::unix::net::UnixStream::connect(&socket).expect("reachable");
        let _ = stream.write_all(b"{\"cmd\":\"kill\"}\n{\"cmd\":\"freeze\"}\n");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        answer
    })
    .join()
    .unwrap();
    assert!(
        answer.is_empty(),
        "greeted: {}",
        String::from_utf8_lossy(&answer)
    );
    // Still running, not frozen; berth (this uid) is still greeted.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(alive(state.pid, state.pid_start));
    assert_ne!(stat(state.pid).map(|s| s.0), Some('T'));
    let (_again, hello) = ShimHandle::attach(&spec.state_path).await.unwrap();
    assert_eq!(hello.pid, state.pid);
}
