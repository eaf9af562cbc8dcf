//! Isolation, proven by attack: every boundary is crossed, or
//! rather tried, from inside a program berth started, the hostile program
//! of `support/breach.py`, driven by the test through berth's own proxy.
//!
//! These tests need root (berth gives each user's instances a uid of their
//! own) and nftables; CI runs them as root. Run elsewhere without root,
//! they say so and pass without testing anything; with `CI` set they fail.

use crate::support;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use support::{
    Node, StartOptions, alive, eventually, instance_pids, privileged, proc_state,
    processes_of_uids, zygote_of,
};

const BREACH: &str = include_str!("support/breach.py");
const PATIENCE: Duration = Duration::from_secs(60);

/// A port block and an account range of the test's own, so tests running
/// at once never share a port or a uid.
struct Slot {
    ports: u16,
    base_uid: u32,
}

fn slot() -> Slot {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    // Accounts of their own per run too: a host whose init never reaps
    // leaves an earlier run's orphans as zombies, which would count
    // against the same account's process limits here.
    let run = std::process::id() % 400;
    Slot {
        ports: berth_testkit::port_block(40),
        base_uid: 400_000 + run * 50_000 + u32::from(n) * 1000,
    }
}

/// A config running the breach program at `mode`, with `extra` lines for
/// `[isolation]` and `tail` appended (other tables).
fn breach_config(dir: &Path, slot: &Slot, mode: &str, isolation: &str, tail: &str) -> String {
    let script = serde_json::to_string(BREACH).unwrap();
    format!(
        "listen = \"127.0.0.1:0\"\ndata_dir = \"{data}\"\n\n\
         [instance]\ncommand = [\"python3\", \"-c\", {script}, \"{{port}}\"]\n\
         ready_http_path = \"/ping\"\nready_timeout_s = 30\nstop_grace_s = 2\n\
         port_range = [{first}, {last}]\n\n\
         [crash]\nbackoff_base_ms = 100\nbackoff_max_ms = 400\n\n\
         [isolation]\nmode = \"{mode}\"\nbase_uid = {uid}\nuid_count = 1000\n{isolation}\n\
         {tail}\n",
        data = dir.join("data").display(),
        first = slot.ports,
        last = slot.ports + 39,
        uid = slot.base_uid,
    )
}

fn start(dir: &Path, config: &str) -> Node {
    Node::from(support::berth().node(dir).config(config).start())
}

async fn launch(node: &Node, user: &str) -> Value {
    let (status, body) = node
        .post(&format!("/users/{user}/instance"), json!({}))
        .await;
    assert_eq!(status, 201, "{user}: {body}");
    body["instance"].clone()
}

/// Asks `user`'s instance, through berth's proxy, to run `probe`.
async fn probe(node: &Node, user: &str, probe: &str, query: &[(&str, &str)]) -> Value {
    let r = node
        .http
        .get(format!("{}/u/{user}/{probe}", node.url))
        .query(query)
        .bearer_auth(&node.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{user} {probe} {query:?}");
    r.json().await.unwrap()
}

fn refused(outcome: &Value, errnos: &[&str]) -> bool {
    outcome["ok"] == false && errnos.contains(&outcome["errno"].as_str().unwrap_or(""))
}

/// The port berth's API and proxy listen on.
fn port_of(node: &Node) -> String {
    node.url
        .rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .to_owned()
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn uid_of_process(pid: u32) -> Option<u32> {
    std::fs::metadata(format!("/proc/{pid}"))
        .ok()
        .map(|m| m.uid())
}

/// Every task (thread) of every process run by `uid`.
fn tasks_of(uid: u32) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| uid_of_process(pid) == Some(uid))
        .map(|pid| std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count()))
        .sum()
}

/// Live processes run by a uid of `[first, first + 1000)`.
fn processes_in_range(first: u32) -> Vec<u32> {
    processes_of_uids(first..first + 1000)
        .into_iter()
        .map(|(pid, _)| pid)
        .collect()
}

/// The pairs in the port guard's set of the berth on `data_dir`.
fn own_ports_elements(data_dir: &Path) -> Vec<Value> {
    let table = berth_local::isolation::nft_table_name(&data_dir.canonicalize().unwrap());
    let out = Command::new("nft")
        .args(["-j", "list", "set", "inet", &table, "own_ports"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    listed["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|item| item["set"]["elem"].as_array().cloned())
        .unwrap_or_default()
}

/// The shim state of `user`'s main.
fn state_of(node: &Node, user: &str) -> Value {
    let path = node.data_dir.join(format!("run/{user}/main.json"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

// --- filesystem -----------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn at_level_user_an_instance_runs_as_its_own_account_and_reaches_nothing_of_others() {
    if !privileged("filesystem, user") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let node = start(
        dir.path(),
        &breach_config(dir.path(), &slot, "user", "", ""),
    );
    launch(&node, "alice").await;
    launch(&node, "bob").await;

    let me = probe(&node, "alice", "whoami", &[]).await;
    let uid = me["uid"].as_u64().unwrap() as u32;
    let bob_uid = probe(&node, "bob", "whoami", &[]).await["uid"]
        .as_u64()
        .unwrap() as u32;
    assert!((slot.base_uid..slot.base_uid + 1000).contains(&uid), "{me}");
    assert_ne!(uid, bob_uid, "two users never share a uid");
    assert_eq!(me["euid"], uid);
    assert_eq!(me["gid"], uid, "gid = uid");
    assert_eq!(me["groups"], json!([]), "no supplementary groups");
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(me["status"][cap], "0000000000000000", "{cap}: {me}");
    }
    assert_eq!(me["status"]["NoNewPrivs"], "1");
    let home = node.data_dir.join("users/alice/home");
    assert_eq!(me["env"]["HOME"], path_str(&home));
    assert_eq!(me["env"]["USER"], "alice");
    assert_eq!(me["env"]["LOGNAME"], "alice");
    // The data root belongs to the account, 0700.
    let root = std::fs::metadata(node.data_dir.join("users/alice")).unwrap();
    assert_eq!(
        (root.uid(), root.gid(), root.mode() & 0o7777),
        (uid, uid, 0o700)
    );

    // Nothing of bob's, nothing of berth's.
    let bob_root = node.data_dir.join("users/bob");
    for target in [
        bob_root.clone(),
        bob_root.join("home"),
        node.data_dir.join("run"),
    ] {
        let listed = probe(&node, "alice", "list", &[("path", path_str(&target))]).await;
        assert!(refused(&listed, &["EACCES"]), "{target:?}: {listed}");
    }
    for target in [
        node.data_dir.join("admin.token"),
        node.data_dir.join("berth.db"),
        node.data_dir.join("berth.db-wal"),
        bob_root.join("logs/main.log"),
    ] {
        let read = probe(&node, "alice", "read", &[("path", path_str(&target))]).await;
        assert!(refused(&read, &["EACCES"]), "{target:?}: {read}");
    }
    // berth's own files are 0600, its data dir only passable.
    for file in ["admin.token", "berth.db"] {
        let mode = std::fs::metadata(node.data_dir.join(file)).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600, "{file}");
    }
    let mode = std::fs::metadata(&node.data_dir).unwrap().mode() & 0o777;
    assert_eq!(mode, 0o711);
    // No writing to the system.
    for target in ["/usr/berth-breach", "/etc/berth-breach"] {
        let wrote = probe(&node, "alice", "write", &[("path", target)]).await;
        assert!(refused(&wrote, &["EACCES"]), "{target}: {wrote}");
        assert!(!Path::new(target).exists());
    }
    // It can still use what is its own (the probes are not just broken).
    let own = home.join("notes");
    let wrote = probe(&node, "alice", "write", &[("path", path_str(&own))]).await;
    assert_eq!(wrote["ok"], true, "{wrote}");
    assert_eq!(std::fs::metadata(&own).unwrap().uid(), uid);
    node.kill_instances();
}

#[tokio::test(flavor = "multi_thread")]
async fn in_a_sandbox_the_system_is_read_only_and_only_own_processes_are_seen() {
    if !privileged("filesystem, sandbox") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let node = start(
        dir.path(),
        &breach_config(dir.path(), &slot, "sandbox", "", ""),
    );
    launch(&node, "alice").await;
    launch(&node, "bob").await;
    let me = probe(&node, "alice", "whoami", &[]).await;
    let uid = me["uid"].as_u64().unwrap() as u32;
    // The synthesized passwd entry: programs that look themselves up work.
    assert_eq!(me["passwd_name"], "alice", "{me}");
    assert_eq!(me["status"]["CapEff"], "0000000000000000");

    // Only its own processes: the pid namespace's init and the program.
    let seen = probe(&node, "alice", "processes", &[]).await;
    let seen = seen.as_array().unwrap();
    assert!(!seen.is_empty() && seen.len() < 10, "{seen:?}");
    for entry in seen {
        assert_eq!(
            entry[1], uid,
            "a process of another user is visible: {seen:?}"
        );
    }
    assert!(
        seen.iter().any(|e| e[0] == 1),
        "its init is pid 1: {seen:?}"
    );

    // Others' data and berth's are not even there.
    for target in [
        node.data_dir.join("users/bob"),
        node.data_dir.join("admin.token"),
        node.data_dir.join("berth.db"),
        node.data_dir.join("run/alice/main.json"),
        PathBuf::from("/etc/shadow"),
    ] {
        let read = probe(&node, "alice", "read", &[("path", path_str(&target))]).await;
        assert!(
            refused(&read, &["ENOENT", "EACCES", "EISDIR"]),
            "{target:?}: {read}"
        );
        assert_ne!(read["errno"], "EISDIR", "{target:?} is visible: {read}");
    }
    // A read-only system, a private /tmp, and its own root writable.
    for target in [
        "/usr/berth-breach",
        "/etc/berth-breach",
        "/var/berth-breach",
    ] {
        let wrote = probe(&node, "alice", "write", &[("path", target)]).await;
        assert!(refused(&wrote, &["EROFS", "EACCES"]), "{target}: {wrote}");
        assert!(!Path::new(target).exists());
    }
    let in_tmp = probe(&node, "alice", "write", &[("path", "/tmp/alice-was-here")]).await;
    assert_eq!(in_tmp["ok"], true, "{in_tmp}");
    assert!(
        !Path::new("/tmp/alice-was-here").exists(),
        "/tmp is private"
    );
    let home = node.data_dir.join("users/alice/home/notes");
    let wrote = probe(&node, "alice", "write", &[("path", path_str(&home))]).await;
    assert_eq!(wrote["ok"], true, "{wrote}");
    assert!(home.exists(), "the user's root is the real one");
    node.kill_instances();
}

/// A sandbox's `/tmp` and `/dev/shm` are its own: what alice writes
/// there neither bob's sandbox nor the host sees, and what the host (or
/// any other account) keeps in its own is not there for her.
#[tokio::test(flavor = "multi_thread")]
async fn in_a_sandbox_tmp_and_dev_shm_are_private_to_the_instance() {
    if !privileged("private /tmp and /dev/shm, sandbox") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let node = start(
        dir.path(),
        &breach_config(dir.path(), &slot, "sandbox", "", ""),
    );
    launch(&node, "alice").await;
    launch(&node, "bob").await;
    let tag = format!("berth-private-{}-{}", std::process::id(), slot.base_uid);
    // The host's own, world-readable and writable: a host's /dev/shm holds
    // other programs' shared memory.
    let host_shm = PathBuf::from(format!("/dev/shm/{tag}-host"));
    let host_tmp = PathBuf::from(format!("/tmp/{tag}-host"));
    for planted in [&host_shm, &host_tmp] {
        std::fs::write(planted, "the host's").unwrap();
        std::fs::set_permissions(planted, std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    for shared in ["/dev/shm", "/tmp"] {
        let hers = format!("{shared}/{tag}-alice");
        let wrote = probe(&node, "alice", "write", &[("path", &hers)]).await;
        assert_eq!(wrote["ok"], true, "alice writes her {shared}: {wrote}");
        let read = probe(&node, "alice", "read", &[("path", &hers)]).await;
        assert_eq!(read["value"], 6, "alice reads her {shared}: {read}");
        let read = probe(&node, "bob", "read", &[("path", &hers)]).await;
        assert!(
            refused(&read, &["ENOENT"]),
            "bob sees alice's {hers}: {read}"
        );
        assert!(!Path::new(&hers).exists(), "{hers} is on the host");
        // Bob's file of that name is his own, alice's is left alone.
        let wrote = probe(&node, "bob", "write", &[("path", &hers)]).await;
        assert_eq!(wrote["ok"], true, "bob writes his {shared}: {wrote}");
        let read = probe(&node, "alice", "read", &[("path", &hers)]).await;
        assert_eq!(read["value"], 6, "{read}");
    }
    for planted in [&host_shm, &host_tmp] {
        let read = probe(&node, "alice", "read", &[("path", path_str(planted))]).await;
        assert!(
            refused(&read, &["ENOENT"]),
            "alice sees {planted:?}: {read}"
        );
        let wrote = probe(&node, "alice", "write", &[("path", path_str(planted))]).await;
        assert_eq!(wrote["ok"], true, "{wrote}");
        assert_eq!(std::fs::read_to_string(planted).unwrap(), "the host's");
        std::fs::remove_file(planted).unwrap();
    }
    node.kill_instances();
}

// --- secrets ---------------------------------------------------------------

async fn secrets_stay_out_of_reach(mode: &str) {
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let token = format!("admintok{}", std::process::id());
    let secret = format!(
        "clustersecret{}-{}",
        slot.base_uid,
        berth_testkit::TEST_CLUSTER_SECRET
    );
    let options = StartOptions {
        env: vec![
            ("BERTH_ADMIN_TOKEN".into(), token.clone()),
            ("BERTH_CLUSTER_SECRET".into(), secret.clone()),
        ],
        ..StartOptions::default()
    };
    let node = Node::from(
        support::berth()
            .node(dir.path())
            .config(&breach_config(dir.path(), &slot, mode, "", ""))
            .options(options)
            .start(),
    );
    let alice = launch(&node, "alice").await;
    let bob = launch(&node, "bob").await;

    // From inside: every environ the program may read.
    let needles = [("needle", token.as_str()), ("needle", secret.as_str())];
    let scan = probe(&node, "alice", "environ", &needles).await;
    assert!(
        scan["readable"].as_u64().unwrap() >= 1,
        "it reads its own: {scan}"
    );
    assert_eq!(scan["leaks"], json!([]), "{scan}");

    // And as root, every process of berth's: berth, its zygote, the shims
    // and the programs.
    let berth = node.pid().unwrap();
    let zygote = zygote_of(berth).expect("the zygote runs");
    let mut checked = vec![berth, zygote];
    for user in ["alice", "bob"] {
        let state = state_of(&node, user);
        checked.push(state["shim_pid"].as_u64().unwrap() as u32);
        checked.extend(instance_pids(&node.data_dir, user, "main"));
    }
    for pid in &checked {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        let text = String::from_utf8_lossy(&environ);
        assert!(
            !text.contains(&token) && !text.contains(&secret),
            "pid {pid} shows a secret"
        );
    }

    // The program cannot command its own shim, nor bob's.
    for user in ["alice", "bob"] {
        let socket = node.data_dir.join(format!("run/{user}/main.sock"));
        for command in [
            json!({"cmd": "kill"}),
            json!({"cmd": "freeze"}),
            json!({"cmd": "extend", "ms": 999_999_999u64}),
        ] {
            let tried = probe(
                &node,
                "alice",
                "shim",
                &[
                    ("path", path_str(&socket)),
                    ("command", &command.to_string()),
                ],
            )
            .await;
            let greeted = tried["ok"] == true && tried["value"]["greeted"] == true;
            assert!(!greeted, "{user} {command}: {tried}");
            assert!(
                refused(&tried, &["EACCES", "ENOENT"]),
                "{user} {command}: {tried}"
            );
        }
    }
    // Both keep running, unfrozen, as the same processes.
    for (user, before) in [("alice", &alice), ("bob", &bob)] {
        let main = node.main_of(user).await;
        assert_eq!(main["status"], "running", "{main}");
        assert_eq!(main["pid"], before["pid"], "{main}");
        let pid = main["pid"].as_u64().unwrap() as u32;
        assert_ne!(proc_state(pid), Some('T'), "{user} was frozen");
        assert_eq!(probe(&node, user, "ping", &[]).await["ok"], true);
    }
    node.kill_instances();
}

#[tokio::test(flavor = "multi_thread")]
async fn no_secret_reaches_a_program_and_no_program_commands_a_shim_at_level_user() {
    if privileged("secrets, user") {
        secrets_stay_out_of_reach("user").await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn no_secret_reaches_a_program_and_no_program_commands_a_shim_in_a_sandbox() {
    if privileged("secrets, sandbox") {
        secrets_stay_out_of_reach("sandbox").await;
    }
}

// --- signals and debugging -------------------------------------------------

/// What signals and traces from inside alice's instance at `mode` may
/// reach: nothing of bob's, of berth's or of any shim (`EPERM` at `user`,
/// where every process is visible; `ESRCH` or `EPERM` in a sandbox, whose
/// pid namespace holds none of them), while her own processes are hers to
/// signal and trace, and a `kill(-1, SIGKILL)` of hers leaves everyone
/// else running.
async fn no_signal_or_trace_crosses_accounts(mode: &str) {
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let node = start(dir.path(), &breach_config(dir.path(), &slot, mode, "", ""));
    let alice = launch(&node, "alice").await;
    let bob = launch(&node, "bob").await;
    let bob_pid = bob["pid"].as_u64().unwrap() as u32;
    let berth = node.pid().unwrap();
    let zygote = zygote_of(berth).expect("the zygote runs");
    let shim_of = |user: &str| state_of(&node, user)["shim_pid"].as_u64().unwrap() as u32;
    let (alice_shim, bob_shim) = (shim_of("alice"), shim_of("bob"));
    let uid = probe(&node, "bob", "whoami", &[]).await["uid"].clone();
    assert_eq!(uid_of_process(bob_pid).map(Value::from), Some(uid));
    let refusals: &[&str] = match mode {
        "user" => &["EPERM"],
        _ => &["EPERM", "ESRCH"],
    };
    // The probes work: her own program answers both.
    let own = probe(&node, "alice", "whoami", &[]).await["pid"].to_string();
    let tried = probe(&node, "alice", "signal", &[("pid", &own), ("sig", "0")]).await;
    assert_eq!(tried["ok"], true, "{tried}");
    let tried = probe(&node, "alice", "traceown", &[]).await;
    assert_eq!(tried["ok"], true, "tracing her own child: {tried}");

    let targets = [
        ("bob's program", bob_pid),
        ("bob's shim", bob_shim),
        ("her own shim", alice_shim),
        ("berth", berth),
        ("the zygote", zygote),
    ];
    for (what, pid) in targets {
        let pid = pid.to_string();
        // 0 asks the kernel for the permission alone; SIGCONT is the one a
        // process may send to others of its session whatever their uid.
        for sig in ["0", "18", "19", "15", "9"] {
            // Her program shares its shim's session (the shim made it),
            // where the kernel lets any process continue any other: a
            // SIGCONT to a running shim does nothing.
            if sig == "18" && pid == alice_shim.to_string() {
                continue;
            }
            let tried = probe(&node, "alice", "signal", &[("pid", &pid), ("sig", sig)]).await;
            assert!(refused(&tried, refusals), "signal {sig} to {what}: {tried}");
        }
        let tried = probe(&node, "alice", "trace", &[("pid", &pid)]).await;
        assert!(refused(&tried, refusals), "tracing {what}: {tried}");
    }
    // Everything she may signal, at once: her program itself lives on
    // (the kernel spares the sender), and so does everyone else.
    // (`ESRCH`: there was nothing she may signal but herself.)
    let tried = probe(&node, "alice", "killall", &[]).await;
    assert!(tried["ok"] == true || tried["errno"] == "ESRCH", "{tried}");
    for (what, pid) in targets {
        assert!(alive(u64::from(pid)), "{what} was killed");
        assert_ne!(proc_state(pid), Some('T'), "{what} was stopped");
    }
    for (user, before) in [("alice", &alice), ("bob", &bob)] {
        let main = node.main_of(user).await;
        assert_eq!(main["status"], "running", "{main}");
        assert_eq!(main["pid"], before["pid"], "{user} was restarted: {main}");
        assert_eq!(probe(&node, user, "ping", &[]).await["ok"], true);
    }
    assert_eq!(node.healthz().await, 200);
    node.kill_instances();
}

#[tokio::test(flavor = "multi_thread")]
async fn at_level_user_an_instance_can_neither_signal_nor_trace_another_accounts_processes() {
    if privileged("signals and ptrace, user") {
        no_signal_or_trace_crosses_accounts("user").await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn in_a_sandbox_an_instance_can_neither_signal_nor_trace_another_accounts_processes() {
    if privileged("signals and ptrace, sandbox") {
        no_signal_or_trace_crosses_accounts("sandbox").await;
    }
}

/// Program output in berth's log is escaped: a program cannot forge a
/// line of berth's or put terminal control codes in it.
#[tokio::test(flavor = "multi_thread")]
async fn program_output_cannot_forge_berths_log() {
    if !privileged("log escaping") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let log = dir.path().join("berth.log");
    let options = StartOptions {
        stderr: Some(log.clone()),
        ..StartOptions::default()
    };
    let node = Node::from(
        support::berth()
            .node(dir.path())
            .config(&breach_config(dir.path(), &slot, "user", "", ""))
            .options(options)
            .start(),
    );
    let first = launch(&node, "alice").await;
    // The program writes its forgery to stderr and exits: a crash.
    let _ = node
        .http
        .get(format!("{}/u/alice/forge", node.url))
        .bearer_auth(&node.token)
        .send()
        .await;
    let pid = first["pid"].as_u64();
    node.running_main("alice", pid).await;
    let text = eventually(PATIENCE, "the crash in berth's log", || async {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.contains("FORGED").then_some(text)
    })
    .await;
    // berth colours its log only on a terminal, so any escape would be
    // the program's.
    assert!(
        !text.contains('\u{1b}'),
        "an escape code reached berth's log"
    );
    assert!(
        !text.contains('\u{7}'),
        "a control code reached berth's log"
    );
    for line in text.lines() {
        assert!(
            !line.starts_with("2030-01-01T00:00:00"),
            "a forged line: {line}"
        );
    }
    node.kill_instances();
}

// --- symlinks ----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn links_planted_in_a_root_never_lead_berth_outside_it() {
    if !privileged("symlinks") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let node = start(
        dir.path(),
        &breach_config(dir.path(), &slot, "user", "", ""),
    );
    // What a hostile user would aim at: a directory of root's.
    let victim = dir.path().join("victim");
    std::fs::create_dir(&victim).unwrap();
    std::fs::write(victim.join("keep"), "original").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o750)).unwrap();

    launch(&node, "alice").await;
    // Reading goes through no link either: the log berth serves alice
    // would otherwise be any file of root's.
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "root's secret").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let log = node.data_dir.join("users/alice/logs/main.log");
    let linked = probe(
        &node,
        "alice",
        "filelink",
        &[("path", path_str(&log)), ("target", path_str(&secret))],
    )
    .await;
    assert_eq!(linked["ok"], true, "{linked}");
    let r = node
        .http
        .get(node.api("/users/alice/instance/logs?tail=10"))
        .bearer_auth(&node.token)
        .send()
        .await
        .unwrap();
    let body = r.text().await.unwrap();
    assert!(!body.contains("root's secret"), "{body}");
    for name in ["tmp", "patches", "logs"] {
        let linked = probe(
            &node,
            "alice",
            "link",
            &[("name", name), ("target", path_str(&victim))],
        )
        .await;
        assert_eq!(linked["ok"], true, "{name}: {linked}");
        assert!(
            std::fs::symlink_metadata(node.data_dir.join("users/alice").join(name))
                .unwrap()
                .is_symlink()
        );
    }
    // Relaunch with a patch: berth chmods, chowns and writes in the root.
    assert_eq!(node.delete("/users/alice/instance").await, 204);
    let (status, body) = node
        .post("/users/alice/instance", json!({"patch": "planted: no"}))
        .await;
    assert_eq!(status, 201, "{body}");
    probe(&node, "alice", "ping", &[]).await;

    let meta = std::fs::metadata(&victim).unwrap();
    assert_eq!(
        (meta.mode() & 0o7777, meta.uid(), meta.gid()),
        (0o750, 0, 0),
        "the target's mode and owner"
    );
    let entries: Vec<_> = std::fs::read_dir(&victim)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(entries, vec!["keep"], "nothing written into the target");
    assert_eq!(
        std::fs::read_to_string(victim.join("keep")).unwrap(),
        "original"
    );
    // The root got real directories back, with the patch in its place.
    for name in ["tmp", "patches", "logs"] {
        let meta = std::fs::symlink_metadata(node.data_dir.join("users/alice").join(name)).unwrap();
        assert!(meta.is_dir() && !meta.is_symlink(), "{name}");
    }
    assert_eq!(
        std::fs::read_to_string(node.data_dir.join("users/alice/patches/main.yaml")).unwrap(),
        "planted: no"
    );
    node.kill_instances();
}

// --- resources ---------------------------------------------------------------

/// alice's instance at `mode` allocates past `memory_max_mb`: it is
/// killed, reported as out of memory and restarted, and bob and berth
/// never notice. Then bob's program is killed by a SIGKILL of the test's:
/// that is not reported as out of memory.
async fn past_the_memory_limit(mode: &str) {
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let node = start(
        dir.path(),
        &breach_config(dir.path(), &slot, mode, "memory_max_mb = 64\n", ""),
    );
    let alice = launch(&node, "alice").await;
    launch(&node, "bob").await;
    let pid = alice["pid"].as_u64();
    // The request dies with the program.
    let _ = node
        .http
        .get(format!("{}/u/alice/alloc?mb=256", node.url))
        .bearer_auth(&node.token)
        .send()
        .await;
    let crashed = eventually(PATIENCE, "alice's OOM kill recorded", || async {
        let main = node.main_of("alice").await;
        (main["restarts"].as_u64() >= Some(1)).then_some(main)
    })
    .await;
    assert_eq!(
        crashed["last_error"], "out of memory (limit 64 MiB)",
        "{crashed}"
    );
    // Restarted under the crash policy, and the others never noticed.
    node.running_main("alice", pid).await;
    assert_eq!(probe(&node, "bob", "ping", &[]).await["ok"], true);
    assert_eq!(node.healthz().await, 200);
    let main = node.main_of("alice").await;
    assert_eq!(main["last_error"], "out of memory (limit 64 MiB)", "{main}");
    // A SIGKILL that is not the kernel's out-of-memory kill is not
    // reported as one, under the same limit.
    let bob = node.main_of("bob").await;
    let bob_pid = u32::try_from(bob["pid"].as_u64().unwrap()).unwrap();
    berth_testkit::signal(bob_pid, nix::sys::signal::Signal::SIGKILL);
    let crashed = eventually(PATIENCE, "bob's kill recorded", || async {
        let main = node.main_of("bob").await;
        (main["restarts"].as_u64() >= Some(1)).then_some(main)
    })
    .await;
    let error = crashed["last_error"].as_str().unwrap_or_default();
    assert!(
        !error.contains("out of memory") && error.contains('9'),
        "bob, killed by SIGKILL: {crashed}"
    );
    node.kill_instances();
}

#[tokio::test(flavor = "multi_thread")]
async fn an_instance_past_its_memory_limit_is_killed_reported_and_restarted() {
    if privileged("memory, sandbox") {
        past_the_memory_limit("sandbox").await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn at_level_user_an_instance_past_its_memory_limit_is_killed_reported_and_restarted() {
    if privileged("memory, user") {
        past_the_memory_limit("user").await;
    }
}

/// A fork bomb in alice's instance at `mode` fills it up to `pids_max`
/// and never past it, while berth, bob and the host go on.
async fn a_fork_bomb_is_capped(mode: &str) {
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let pids_max = 40;
    let node = start(
        dir.path(),
        &breach_config(
            dir.path(),
            &slot,
            mode,
            &format!("pids_max = {pids_max}\n"),
            "",
        ),
    );
    launch(&node, "alice").await;
    launch(&node, "bob").await;
    let uid = probe(&node, "alice", "whoami", &[]).await["uid"]
        .as_u64()
        .unwrap() as u32;
    let cgroups = state_of(&node, "alice")["cgroup"].clone();
    let pids_cgroup = cgroups
        .as_array()
        .unwrap()
        .iter()
        .map(|d| PathBuf::from(d.as_str().unwrap()))
        .find(|d| d.join("pids.max").exists())
        .expect("a pids cgroup");
    assert_eq!(
        std::fs::read_to_string(pids_cgroup.join("pids.max"))
            .unwrap()
            .trim(),
        pids_max.to_string()
    );
    // The other two limits, at their defaults: 1024 MiB and one CPU.
    let dirs: Vec<PathBuf> = cgroups
        .as_array()
        .unwrap()
        .iter()
        .map(|d| PathBuf::from(d.as_str().unwrap()))
        .collect();
    let read_in = |file: &str| {
        dirs.iter()
            .find_map(|d| std::fs::read_to_string(d.join(file)).ok())
            .unwrap_or_else(|| panic!("no {file} in {dirs:?}"))
    };
    if dirs
        .iter()
        .any(|d| d.join("memory.limit_in_bytes").exists())
    {
        assert_eq!(
            read_in("memory.limit_in_bytes").trim(),
            (1024u64 << 20).to_string()
        );
        assert_eq!(read_in("cpu.cfs_quota_us").trim(), "100000");
        // Not written: the kernel's default, which the quota is against.
        assert_eq!(read_in("cpu.cfs_period_us").trim(), "100000");
    } else {
        assert_eq!(read_in("memory.max").trim(), (1024u64 << 20).to_string());
        assert_eq!(read_in("cpu.max").trim(), "100000 100000");
    }
    assert_eq!(probe(&node, "alice", "forkbomb", &[]).await, true);
    // The bomb fills the instance up to the cap (the account's
    // RLIMIT_NPROC and the cgroup's pids.max are both pids_max)...
    eventually(PATIENCE, "the bomb to reach the cap", || async {
        (tasks_of(uid) + 2 >= pids_max).then_some(())
    })
    .await;
    // ...and never past it.
    for _ in 0..20 {
        let tasks = tasks_of(uid);
        assert!(tasks <= pids_max, "{tasks} tasks of alice's uid");
        let current: usize = std::fs::read_to_string(pids_cgroup.join("pids.current"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(current <= pids_max, "pids.current {current}");
        // berth, bob and the host's own processes go on meanwhile.
        assert_eq!(node.healthz().await, 200);
        assert_eq!(probe(&node, "bob", "ping", &[]).await["ok"], true);
        assert!(Command::new("true").status().unwrap().success());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Stopping alice takes the whole bomb with it.
    assert_eq!(node.delete("/users/alice/instance").await, 204);
    eventually(PATIENCE, "alice's processes gone", || async {
        (tasks_of(uid) == 0).then_some(())
    })
    .await;
    node.kill_instances();
}

#[tokio::test(flavor = "multi_thread")]
async fn in_a_sandbox_a_fork_bomb_is_capped_by_pids_max() {
    if privileged("fork bomb, sandbox") {
        a_fork_bomb_is_capped("sandbox").await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn at_level_user_a_fork_bomb_is_capped_by_pids_max() {
    if privileged("fork bomb, user") {
        a_fork_bomb_is_capped("user").await;
    }
}

/// CPU time a process has run, from the scheduler's own count.
fn cpu_time_of(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/schedstat")).unwrap();
    Duration::from_nanos(stat.split_whitespace().next().unwrap().parse().unwrap())
}

/// How many periods the kernel has throttled the cgroup `dir` in.
fn times_throttled(dir: &Path) -> u64 {
    let stat = std::fs::read_to_string(dir.join("cpu.stat")).unwrap();
    stat.lines()
        .find_map(|l| l.strip_prefix("nr_throttled "))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// alice's instance at level `user`, limited to 20 % of one CPU, spins
/// two processes: the quota is written, the kernel throttles her cgroup,
/// and over a few seconds her spinners take well under half a CPU, where
/// unlimited they would take up to two.
#[tokio::test(flavor = "multi_thread")]
async fn at_level_user_a_spinning_instance_is_held_to_cpu_max_percent() {
    if !privileged("cpu limit, user") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let node = start(
        dir.path(),
        &breach_config(dir.path(), &slot, "user", "cpu_max_percent = 20\n", ""),
    );
    launch(&node, "alice").await;
    let cpu_dir = state_of(&node, "alice")["cgroup"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| PathBuf::from(d.as_str().unwrap()))
        .find(|d| d.join("cpu.cfs_quota_us").exists() || d.join("cpu.max").exists())
        .expect("a cpu cgroup");
    let quota = match std::fs::read_to_string(cpu_dir.join("cpu.cfs_quota_us")) {
        Ok(v1) => v1,
        Err(_) => std::fs::read_to_string(cpu_dir.join("cpu.max")).unwrap(),
    };
    assert!(
        ["20000", "20000 100000"].contains(&quota.trim()),
        "the quota: {quota}"
    );
    let spun = probe(&node, "alice", "spin", &[("n", "2")]).await;
    let spinners: Vec<u32> = spun["value"]
        .as_array()
        .unwrap_or_else(|| panic!("{spun}"))
        .iter()
        .map(|p| p.as_u64().unwrap() as u32)
        .collect();
    let throttled = times_throttled(&cpu_dir);
    let used = || spinners.iter().map(|&p| cpu_time_of(p)).sum::<Duration>();
    let (before, since) = (used(), std::time::Instant::now());
    // A window to measure over, not a wait for anything.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (spent, window) = (used() - before, since.elapsed());
    assert!(!spent.is_zero(), "the spinners never ran");
    assert!(
        spent < window / 2,
        "{spent:?} of CPU in {window:?} under a limit of 20 %"
    );
    assert!(
        times_throttled(&cpu_dir) > throttled,
        "the kernel never throttled alice's cgroup"
    );
    node.kill_instances();
}

// --- guards -------------------------------------------------------------------

async fn the_port_guard_holds(mode: &str) {
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let node = start(dir.path(), &breach_config(dir.path(), &slot, mode, "", ""));
    let alice = launch(&node, "alice").await;
    let bob = launch(&node, "bob").await;
    let alice_port = alice["port"].as_u64().unwrap().to_string();
    let bob_port = bob["port"].as_u64().unwrap().to_string();
    let to_bob = probe(
        &node,
        "alice",
        "connect",
        &[("host", "127.0.0.1"), ("port", &bob_port)],
    )
    .await;
    assert!(
        refused(&to_bob, &["ECONNREFUSED"]),
        "alice reached bob: {to_bob}"
    );
    // Not "block everything": her own port answers her.
    let to_self = probe(
        &node,
        "alice",
        "connect",
        &[("host", "127.0.0.1"), ("port", &alice_port)],
    )
    .await;
    assert_eq!(to_self["ok"], true, "{to_self}");
    // berth's proxy reaches both.
    for user in ["alice", "bob"] {
        assert_eq!(probe(&node, user, "ping", &[]).await["ok"], true);
    }
    if mode == "user" {
        // The same over IPv6: bob listens on his port of ::1 too, which
        // answers him, never alice, by either spelling.
        let listened = probe(&node, "bob", "listen6", &[("port", &bob_port)]).await;
        assert_eq!(listened["ok"], true, "{listened}");
        let to_self = probe(
            &node,
            "bob",
            "connect",
            &[("host", "::1"), ("port", &bob_port)],
        )
        .await;
        assert_eq!(to_self["ok"], true, "{to_self}");
        for host in ["::1", "::ffff:127.0.0.1"] {
            let to_bob = probe(
                &node,
                "alice",
                "connect",
                &[("host", host), ("port", &bob_port)],
            )
            .await;
            assert!(
                refused(&to_bob, &["ECONNREFUSED"]),
                "alice reached bob at {host}: {to_bob}"
            );
        }
    }
    // Root on the host reaches bob's port at `user`; a sandbox's port is in
    // its own network namespace, and nothing listens there on the host.
    let from_host =
        std::net::TcpStream::connect(("127.0.0.1", bob["port"].as_u64().unwrap() as u16));
    assert_eq!(from_host.is_ok(), mode == "user", "{from_host:?}");
    node.kill_instances();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_port_guard_keeps_instances_off_each_others_ports_at_level_user() {
    if privileged("port guard, user") {
        the_port_guard_holds("user").await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_port_guard_keeps_instances_off_each_others_ports_in_a_sandbox() {
    if privileged("port guard, sandbox") {
        the_port_guard_holds("sandbox").await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_guard_grants_and_revokes_ports_without_running_nft() {
    if !privileged("port pairs over netlink") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // berth's `nft` is a wrapper that writes down every script it is given
    // before the real `nft` runs it.
    let scripts = dir.path().join("nft-scripts");
    let wrapper = dir.path().join("nft");
    let real = ["/usr/sbin/nft", "/sbin/nft", "/usr/bin/nft"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
        .unwrap();
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\ntee -a {scripts} | exec {real} \"$@\"\n",
            scripts = scripts.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let slot = slot();
    let node = start(
        dir.path(),
        &breach_config(
            dir.path(),
            &slot,
            "user",
            &format!("nft = \"{}\"", wrapper.display()),
            "",
        ),
    );
    let made = std::fs::read_to_string(&scripts).unwrap();
    assert!(made.contains("set own_ports"), "the table: {made}");
    let alice = launch(&node, "alice").await;
    let bob = launch(&node, "bob").await;
    let bob_port = bob["port"].as_u64().unwrap();
    let holds = |port: u64| {
        own_ports_elements(&node.data_dir)
            .iter()
            .any(|pair| pair["concat"][1] == port)
    };
    assert!(holds(bob_port), "bob's pair is not in own_ports");
    let to_bob = probe(
        &node,
        "alice",
        "connect",
        &[("host", "127.0.0.1"), ("port", &bob_port.to_string())],
    )
    .await;
    assert!(
        refused(&to_bob, &["ECONNREFUSED"]),
        "alice reached bob: {to_bob}"
    );
    let bob_to_self = probe(
        &node,
        "bob",
        "connect",
        &[("host", "127.0.0.1"), ("port", &bob_port.to_string())],
    )
    .await;
    assert_eq!(bob_to_self["ok"], true, "{bob_to_self}");
    // A revoke is made the same way: alice's pair goes.
    let alice_port = alice["port"].as_u64().unwrap();
    assert!(holds(alice_port), "alice's pair is not in own_ports");
    assert_eq!(node.delete("/users/alice/instance").await, 204);
    eventually(PATIENCE, "alice's pair revoked", || async {
        (!holds(alice_port)).then_some(())
    })
    .await;
    // Two grants and a revoke, and no `nft` run made any of them.
    let run = std::fs::read_to_string(&scripts).unwrap();
    assert!(!run.contains("element"), "nft ran port changes: {run}");
    node.kill_instances();
}

/// Two network namespaces: `host` (where berth runs, with a non-loopback
/// address of its own and a name server of its own in `resolv.conf`) and
/// `outside`, reached through a veth pair, which holds a test host at an
/// address of every range the egress guard refuses, the name server, and
/// an ordinary outside address. Nothing of the real host's network is
/// touched.
struct Netns {
    host: String,
    outside: String,
    /// The `host` end of the veth pair, through which `outside`'s
    /// link-local address [`LINK_LOCAL_V6`] is reached.
    veth_host: String,
}

const HOST_ADDR: &str = "10.231.0.1";
const OUTSIDE_ADDR: &str = "198.51.100.7";
/// The `host` namespace's name server (in a private range).
const NAME_SERVER: &str = "10.253.0.53";
/// The cloud metadata and host-agent addresses.
const METADATA: [&str; 4] = [
    "169.254.169.254",
    "169.254.170.2",
    "100.100.100.200",
    "168.63.129.16",
];
/// A host in each private, shared and link-local range.
const PRIVATE: [&str; 6] = [
    "10.254.0.7",
    "172.16.254.7",
    "192.168.254.7",
    "100.64.254.7",
    "169.254.254.7",
    "fd12:3456::7",
];
/// IPv6 hosts of `outside`: the metadata address, one beside it in its
/// network, a unique local host the test's `egress_allow` lets
/// instances reach, and a public one.
const METADATA_V6: &str = "fd00:ec2::254";
const BESIDE_METADATA_V6: &str = "fd00:ec2::7";
const ALLOWED_PRIVATE_V6: &str = "fd77::7";
const OUTSIDE_V6: &str = "2001:db8::7";
/// A link-local address of `outside`, on its end of the veth pair.
const LINK_LOCAL_V6: &str = "fe80::7";
/// A public IPv6 address of the `host` namespace's own (on its loopback
/// device): refused as the host's, not as a private address.
const HOST_V6: &str = "2001:db8:1::1";
/// A private host the test's `egress_allow` lets instances reach.
const ALLOWED_PRIVATE: &str = "192.168.77.7";
/// A public host with a name an allowlist allows (`allowed.test`) and one
/// it does not (`other.test`), and another public host (`denied.test`).
const NAMED_HOST: &str = "198.51.100.8";
const DENIED_HOST: &str = "198.51.100.9";
/// The `host` namespace's names, as its `/etc/hosts`: besides the public
/// ones, an allowed name for a private host and one for a metadata
/// address.
const HOSTS: &str = "198.51.100.8 allowed.test other.test\n\
                     198.51.100.9 denied.test\n\
                     10.254.0.7 inside.test\n\
                     169.254.169.254 meta.test\n";

impl Netns {
    fn ip(args: &[&str]) {
        let out = Command::new("ip").args(args).output().expect("ip runs");
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn create() -> Netns {
        // Unique per test in this process: names and links are host-wide.
        static MADE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let made = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!("{}x{made}", std::process::id());
        let ns = Netns {
            host: format!("berth-eg-h{tag}"),
            outside: format!("berth-eg-o{tag}"),
            veth_host: format!("bv{tag}h"),
        };
        let (h, o) = (ns.host.as_str(), ns.outside.as_str());
        Self::ip(&["netns", "add", h]);
        Self::ip(&["netns", "add", o]);
        // `ip netns exec` shows this file as the namespace's /etc/resolv.conf.
        let etc = format!("/etc/netns/{h}");
        std::fs::create_dir_all(&etc).unwrap();
        std::fs::write(
            format!("{etc}/resolv.conf"),
            format!("nameserver {NAME_SERVER}\n"),
        )
        .unwrap();
        std::fs::write(
            format!("{etc}/hosts"),
            format!("127.0.0.1 localhost\n{HOSTS}"),
        )
        .unwrap();
        let veth_h = format!("bv{tag}h");
        let veth_o = format!("bv{tag}o");
        Self::ip(&[
            "-n", h, "link", "add", &veth_h, "type", "veth", "peer", "name", &veth_o, "netns", o,
        ]);
        // The test hosts, each an address of `outside`'s loopback.
        let hosts: Vec<String> = METADATA
            .iter()
            .chain(&PRIVATE)
            .chain(&[
                ALLOWED_PRIVATE,
                NAME_SERVER,
                OUTSIDE_ADDR,
                NAMED_HOST,
                DENIED_HOST,
                METADATA_V6,
                BESIDE_METADATA_V6,
                ALLOWED_PRIVATE_V6,
                OUTSIDE_V6,
            ])
            .map(|addr| match addr.contains(':') {
                true => format!("{addr}/128"),
                false => format!("{addr}/32"),
            })
            .collect();
        let mut steps = vec![
            (h, vec!["link", "set", "lo", "up"]),
            (o, vec!["link", "set", "lo", "up"]),
            (h, vec!["addr", "add", "10.231.0.1/24", "dev", &veth_h]),
            (o, vec!["addr", "add", "10.231.0.2/24", "dev", &veth_o]),
            (
                h,
                vec!["addr", "add", "fd99::1/64", "dev", &veth_h, "nodad"],
            ),
            (
                o,
                vec!["addr", "add", "fd99::2/64", "dev", &veth_o, "nodad"],
            ),
            (h, vec!["link", "set", &veth_h, "up"]),
            (o, vec!["link", "set", &veth_o, "up"]),
            (h, vec!["route", "add", "default", "via", "10.231.0.2"]),
            (h, vec!["-6", "route", "add", "default", "via", "fd99::2"]),
            (
                h,
                vec!["addr", "add", "2001:db8:1::1/128", "dev", "lo", "nodad"],
            ),
            (
                o,
                vec!["addr", "add", "fe80::7/64", "dev", &veth_o, "nodad"],
            ),
        ];
        // An IPv6 address is tentative, and cannot be bound, until
        // duplicate address detection ends, unless it is told not to run.
        steps.extend(hosts.iter().map(|host| {
            let mut add = vec!["addr", "add", host.as_str(), "dev", "lo"];
            if host.contains(':') {
                add.push("nodad");
            }
            (o, add)
        }));
        for (n, cmd) in steps {
            let mut args = vec!["-n", n];
            args.extend(cmd);
            Self::ip(&args);
        }
        ns
    }

    /// The namespaces of one egress test, or `None` where it cannot run
    /// here (said; under CI a failure).
    fn for_test(test: &str) -> Option<Netns> {
        if !privileged(test) {
            return None;
        }
        let ip = Command::new("ip").arg("-V").output().is_ok();
        if !support::runs_here(test, ip, "`ip` (iproute2; scripts/test installs it)") {
            return None;
        }
        Some(Netns::create())
    }

    /// Runs berth in `host` at level `user`, with `isolation` added to its
    /// `[isolation]` table, launches alice (the breach program), and hands
    /// the node and berth's log file to `check`, on a runtime in that
    /// namespace.
    fn with_alice(
        &self,
        isolation: &'static str,
        check: impl AsyncFnOnce(&mut Node, &Path) + Send + 'static,
    ) {
        self.with_alice_at("user", isolation, check);
    }

    /// [`Netns::with_alice`] at isolation level `mode`.
    fn with_alice_at(
        &self,
        mode: &'static str,
        isolation: &'static str,
        check: impl AsyncFnOnce(&mut Node, &Path) + Send + 'static,
    ) {
        let host = self.host.clone();
        Self::run_in(&self.host, move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let dir = tempfile::tempdir().unwrap();
                let slot = slot();
                let log = dir.path().join("berth.log");
                let options = Netns::berth_in(&host, &log);
                let mut node = Node::from(
                    support::berth()
                        .node(dir.path())
                        .config(&breach_config(dir.path(), &slot, mode, isolation, ""))
                        .options(options)
                        .start(),
                );
                launch(&node, "alice").await;
                check(&mut node, &log).await;
                node.kill_instances();
            });
        })
        .join()
        .unwrap();
    }

    /// How berth starts in namespace `host`, its stderr in `log`: what `ip
    /// netns exec` does for names, without remounting `/sys` (and losing
    /// the cgroups a sandbox needs): the namespace's hosts and resolv.conf
    /// in a mount namespace of berth's own, then its network namespace.
    fn berth_in(host: &str, log: &Path) -> StartOptions {
        let enter = format!(
            "mount --bind /etc/netns/{host}/hosts /etc/hosts && \
             mount --bind /etc/netns/{host}/resolv.conf /etc/resolv.conf && \
             exec nsenter --net=/run/netns/{host} \"$@\""
        );
        StartOptions {
            wrapper: ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
                .iter()
                .map(|a| (*a).to_owned())
                .chain([enter, "sh".to_owned()])
                .collect(),
            stderr: Some(log.to_owned()),
            ..StartOptions::default()
        }
    }

    /// A name server on UDP port 53 of `addr` inside `name` that answers
    /// every query (with no records) and records the names asked for.
    fn answer_dns(name: &str, addr: &'static str) -> Arc<Mutex<Vec<String>>> {
        let asked = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let record = asked.clone();
        Self::run_in(name, move || {
            let socket = std::net::UdpSocket::bind((addr, 53)).unwrap();
            ready_tx.send(()).unwrap();
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = socket.recv_from(&mut buf) {
                let mut labels = Vec::new();
                let mut at = 12;
                while let Some(&len) = buf.get(at).filter(|&&l| l > 0 && at < n) {
                    let len = usize::from(len);
                    labels.push(String::from_utf8_lossy(&buf[at + 1..at + 1 + len]).into_owned());
                    at += 1 + len;
                }
                record.lock().unwrap().push(labels.join("."));
                let mut answer = buf[..n].to_vec();
                answer[2] |= 0x80;
                let _ = socket.send_to(&answer, from);
            }
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("name server up");
        asked
    }

    /// Runs `f` on a thread that has entered namespace `name`.
    fn run_in<T: Send + 'static>(
        name: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let path = format!("/run/netns/{name}");
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&path).unwrap();
            // SAFETY: setns(2) with a namespace descriptor that lives for
            // the call; it moves only this thread (network namespaces are
            // per thread), so the rest of the test process stays put.
            let ret = unsafe {
                nix::libc::setns(
                    std::os::fd::AsRawFd::as_raw_fd(&ns),
                    nix::libc::CLONE_NEWNET,
                )
            };
            assert_eq!(ret, 0, "setns: {}", std::io::Error::last_os_error());
            f()
        })
    }

    /// An HTTP-ish listener on `addr` inside `name`, answering every
    /// connection, for the rest of the test process.
    fn listen(name: &str, addr: &'static str, port: u16) {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        Self::run_in(name, move || {
            let listener = std::net::TcpListener::bind((addr, port)).unwrap();
            ready_tx.send(()).unwrap();
            for stream in listener.incoming().flatten() {
                use std::io::Write;
                let mut stream = stream;
                let _ = stream.write_all(b"HTTP/1.0 200 OK\r\n\r\n");
            }
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("listener up");
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for name in [&self.host, &self.outside] {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
        let _ = std::fs::remove_dir_all(format!("/etc/netns/{}", self.host));
    }
}

/// The egress guard from inside an instance at level `user`: every
/// metadata address, every private range and the host's own address are
/// refused; the outside, the host's name server (on port 53 only) and a
/// private network the operator allowed are reached, though an allowance
/// never opens a metadata address. berth itself reaches them all.
#[test]
fn the_egress_guard_refuses_metadata_private_ranges_and_the_host_but_not_the_outside() {
    let Some(ns) = Netns::for_test("egress guard") else {
        return;
    };
    let mut targets: Vec<(&'static str, &'static str, bool)> = Vec::new();
    targets.extend(METADATA.iter().map(|a| (*a, "80", false)));
    targets.extend(PRIVATE.iter().map(|a| (*a, "80", false)));
    targets.extend([
        (HOST_ADDR, "8080", false),
        (NAME_SERVER, "80", false),
        (NAME_SERVER, "53", true),
        (ALLOWED_PRIVATE, "80", true),
        (OUTSIDE_ADDR, "80", true),
    ]);
    for (addr, port, _) in &targets {
        if *addr != HOST_ADDR {
            Netns::listen(&ns.outside, addr, port.parse().unwrap());
        }
    }
    Netns::listen(&ns.host, HOST_ADDR, 8080);
    // 169.254.170.0/24 holds a metadata address: allowing it opens the rest
    // of that network, never the metadata address.
    let allow = "egress_allow = [\"192.168.77.0/24\", \"169.254.170.0/24\"]";
    ns.with_alice(allow, async move |node: &mut Node, _log: &Path| {
        for (host, port, allowed) in targets {
            let addr = std::net::SocketAddr::new(host.parse().unwrap(), port.parse().unwrap());
            // berth's own uid reaches every one of them...
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
                .unwrap_or_else(|e| panic!("root cannot reach {addr}: {e}"));
            // ...the instance only those allowed.
            let tried = probe(node, "alice", "connect", &[("host", host), ("port", port)]).await;
            if allowed {
                assert_eq!(tried["ok"], true, "{addr}: {tried}");
            } else {
                assert!(
                    refused(&tried, &["ECONNREFUSED", "EHOSTUNREACH", "ENETUNREACH"]),
                    "the instance reached {addr}: {tried}"
                );
            }
        }
    });
}

/// The egress guard's IPv6 rules, from inside an instance at level
/// `user`: the metadata address `fd00:ec2::254` (though its network is
/// allowed), a unique local host, a link-local one, a public address of
/// the host's own, and
/// IPv4 metadata and private hosts asked for as IPv4-mapped IPv6
/// addresses are refused; a public IPv6 host, an allowed unique local
/// network and the metadata address's neighbour in it are reached. berth
/// itself reaches them all.
#[test]
fn the_egress_guard_refuses_ipv6_metadata_private_ranges_and_the_host_but_not_the_outside() {
    let Some(ns) = Netns::for_test("egress guard, IPv6") else {
        return;
    };
    // (address, port, reached by the instance)
    let targets: [(&'static str, &'static str, bool); 8] = [
        (METADATA_V6, "80", false),
        ("fd12:3456::7", "80", false),
        (HOST_V6, "8080", false),
        ("::ffff:169.254.169.254", "80", false),
        ("::ffff:10.254.0.7", "80", false),
        (BESIDE_METADATA_V6, "80", true),
        (ALLOWED_PRIVATE_V6, "80", true),
        (OUTSIDE_V6, "80", true),
    ];
    for (addr, port) in [
        (METADATA_V6, 80),
        ("fd12:3456::7", 80),
        ("169.254.169.254", 80),
        ("10.254.0.7", 80),
        (BESIDE_METADATA_V6, 80),
        (ALLOWED_PRIVATE_V6, 80),
        (OUTSIDE_V6, 80),
    ] {
        Netns::listen(&ns.outside, addr, port);
    }
    Netns::listen(&ns.host, HOST_V6, 8080);
    // Every address of `outside`, its link-local one included.
    Netns::listen(&ns.outside, "::", 8081);
    let link_local = format!("{LINK_LOCAL_V6}%{}", ns.veth_host);
    let allow = "egress_allow = [\"fd77::/64\", \"fd00:ec2::/120\"]";
    ns.with_alice(allow, async move |node: &mut Node, _log: &Path| {
        // Link-local: reached through one interface, named after a `%`.
        let index: u32 = {
            let out = Command::new("ip")
                .args(["-o", "link", "show", link_local.split('%').nth(1).unwrap()])
                .output()
                .unwrap();
            let listed = String::from_utf8_lossy(&out.stdout);
            listed.split(':').next().unwrap().trim().parse().unwrap()
        };
        let addr = std::net::SocketAddrV6::new(LINK_LOCAL_V6.parse().unwrap(), 8081, 0, index);
        std::net::TcpStream::connect_timeout(&addr.into(), Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("root cannot reach {link_local}: {e}"));
        let tried = probe(
            node,
            "alice",
            "connect",
            &[("host", &link_local), ("port", "8081")],
        )
        .await;
        // The guard's rejection of a link-local destination never reaches
        // the program: its connection times out instead (`None`, the
        // probe's 5 s), blocked all the same, where berth's uid gets in.
        assert!(
            refused(
                &tried,
                &[
                    "ECONNREFUSED",
                    "EHOSTUNREACH",
                    "ENETUNREACH",
                    "EACCES",
                    "None"
                ]
            ),
            "the instance reached {link_local}: {tried}"
        );
        for (host, port, allowed) in targets {
            let addr = std::net::SocketAddr::new(host.parse().unwrap(), port.parse().unwrap());
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
                .unwrap_or_else(|e| panic!("root cannot reach {addr}: {e}"));
            let tried = probe(node, "alice", "connect", &[("host", host), ("port", port)]).await;
            if allowed {
                assert_eq!(tried["ok"], true, "{addr}: {tried}");
            } else {
                assert!(
                    refused(
                        &tried,
                        &["ECONNREFUSED", "EHOSTUNREACH", "ENETUNREACH", "EACCES"]
                    ),
                    "the instance reached {addr}: {tried}"
                );
            }
        }
    });
}

/// An instance confined to an allowlist of names: it reaches an allowed
/// name over HTTP and TLS, through the egress proxy, and an allowed
/// network directly; it does not reach the allowed name's host by its
/// raw address or by another name, a name not on the list, an allowed
/// name that resolves to a private or metadata address, or any other
/// port of the internet. berth itself still reaches every host.
#[test]
fn an_instance_confined_to_an_allowlist_reaches_only_the_allowed_names() {
    let Some(ns) = Netns::for_test("egress allowlist") else {
        return;
    };
    for (addr, port) in [
        (NAMED_HOST, 80),
        (NAMED_HOST, 443),
        (DENIED_HOST, 80),
        ("10.254.0.7", 80),
        ("169.254.169.254", 80),
        (ALLOWED_PRIVATE, 80),
        (OUTSIDE_ADDR, 8080),
        (NAME_SERVER, 53),
        (OUTSIDE_V6, 80),
        (OUTSIDE_V6, 443),
    ] {
        Netns::listen(&ns.outside, addr, port);
    }
    let asked = Netns::answer_dns(&ns.outside, NAME_SERVER);
    // (host to connect to, port, name asked for, over TLS, reached)
    let fetches = [
        ("allowed.test", "80", "allowed.test", "0", true),
        ("allowed.test", "443", "allowed.test", "1", true),
        (NAMED_HOST, "80", NAMED_HOST, "0", false),
        (NAMED_HOST, "80", "other.test", "0", false),
        ("other.test", "443", "other.test", "1", false),
        ("denied.test", "80", "denied.test", "0", false),
        ("inside.test", "80", "inside.test", "0", false),
        ("meta.test", "80", "meta.test", "0", false),
        (ALLOWED_PRIVATE, "80", "anything", "0", true),
    ];
    let isolation = "egress = \"allowlist\"\negress_allow = [\"allowed.test\", \
                     \"inside.test\", \"meta.test\", \"192.168.77.0/24:80\"]";
    ns.with_alice(isolation, async move |node: &mut Node, log: &Path| {
        // The status says what the instance may reach.
        let (code, status) = node.get("/users/alice/instance").await;
        assert_eq!(code, 200, "{status}");
        assert_eq!(
            status["egress"],
            json!({"mode": "allowlist", "allow":
                ["allowed.test", "inside.test", "meta.test", "192.168.77.0/24:80"]}),
            "{status}"
        );
        for (host, port, name, tls, reached) in fetches {
            let query = [("host", host), ("port", port), ("name", name), ("tls", tls)];
            let tried = probe(node, "alice", "fetch", &query).await;
            if reached {
                assert_eq!(tried["ok"], true, "{query:?}: {tried}");
            } else {
                assert!(
                    refused(&tried, &["ECONNABORTED", "ECONNRESET", "ECONNREFUSED"]),
                    "the instance reached {query:?}: {tried}"
                );
            }
        }
        // DNS: a query for an allowed name reaches the host's name server;
        // any other is refused by berth, even sent to a resolver on
        // loopback, and never leaves; DNS over TCP is refused.
        for (server, name, code) in [
            (NAME_SERVER, "allowed.test", 0),
            (NAME_SERVER, "secret.exfil.example", 5),
            ("127.0.0.53", "loopback.exfil.example", 5),
        ] {
            let tried = probe(
                node,
                "alice",
                "lookup",
                &[("server", server), ("name", name)],
            )
            .await;
            assert_eq!(tried["value"], code, "{server} {name}: {tried}");
        }
        assert_eq!(*asked.lock().unwrap(), ["allowed.test"]);
        let query = [("host", NAME_SERVER), ("port", "53")];
        let tried = probe(node, "alice", "connect", &query).await;
        assert!(refused(&tried, &["ECONNREFUSED"]), "{tried}");
        // Any other port of the internet is refused outright, and IPv6,
        // which the egress proxy does not take, even to the allowed
        // names' ports...
        for (host, port) in [
            (OUTSIDE_ADDR, "8080"),
            (OUTSIDE_V6, "80"),
            (OUTSIDE_V6, "443"),
        ] {
            let tried = probe(node, "alice", "connect", &[("host", host), ("port", port)]).await;
            assert!(refused(&tried, &["ECONNREFUSED"]), "{host} {port}: {tried}");
        }
        // ...though berth's own uid reaches it and every host above.
        for addr in [
            "198.51.100.7:8080",
            "198.51.100.8:80",
            "198.51.100.9:80",
            "10.254.0.7:80",
            "[2001:db8::7]:80",
        ] {
            std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(5))
                .unwrap_or_else(|e| panic!("root cannot reach {addr}: {e}"));
        }
        let metrics = node.metrics_text().await;
        assert!(
            metrics.contains("berth_egress_connections_total{verdict=\"refused\"}"),
            "{metrics}"
        );
        // A refusal is logged with the instance's account and where it
        // went.
        let pid = node.main_of("alice").await["pid"].as_u64().unwrap();
        let uid = uid_of_process(u32::try_from(pid).unwrap()).unwrap();
        let text = std::fs::read_to_string(log).unwrap();
        let line = text
            .lines()
            .find(|l| l.contains("egress refused") && l.contains("denied.test"))
            .unwrap_or_else(|| panic!("no refusal of denied.test logged:\n{text}"));
        assert!(
            line.contains(&format!("uid={uid}")) && line.contains("198.51.100.9:80"),
            "{line}"
        );
    });
}

/// `PUT` of a JSON body to an API path as admin: status and JSON body.
async fn put(node: &Node, path: &str, body: Value) -> (u16, Value) {
    let r = node
        .http
        .put(node.api(path))
        .bearer_auth(&node.token)
        .json(&body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// Whether `user`'s instance reaches `host:port` now, by a new connection.
async fn reaches(node: &Node, user: &str, host: &str, port: &str) -> bool {
    let tried = probe(node, user, "connect", &[("host", host), ("port", port)]).await;
    if tried["ok"] == true {
        return true;
    }
    assert!(
        refused(&tried, &["ECONNREFUSED", "ECONNRESET", "ECONNABORTED"]),
        "neither reached nor refused: {tried}"
    );
    false
}

/// An operator confines one running user to an allowlist through the API:
/// from the next connection on, alice reaches only the allowed name,
/// while bob, on the node's policy, still
/// reaches the outside. Her status shows her policy, refusals name her,
/// a relaunch and a restart of berth (which adopts her instance) keep
/// her confined, a policy that means nothing is refused and changes
/// nothing, and clearing it gives her the node's policy again.
#[test]
fn a_policy_changed_through_the_api_applies_to_the_running_instance_from_its_next_connection() {
    let Some(ns) = Netns::for_test("egress change") else {
        return;
    };
    Netns::listen(&ns.outside, NAMED_HOST, 80);
    Netns::listen(&ns.outside, OUTSIDE_ADDR, 8080);
    let asked = Netns::answer_dns(&ns.outside, NAME_SERVER);
    ns.with_alice("", async move |node: &mut Node, log: &Path| {
        launch(node, "bob").await;
        assert!(reaches(node, "alice", OUTSIDE_ADDR, "8080").await);
        let confined = json!({"mode": "allowlist", "allow": ["allowed.test"]});
        let (code, changed) = put(node, "/users/alice/egress", confined.clone()).await;
        assert_eq!(code, 200, "{changed}");
        assert_eq!(
            changed,
            json!({"user": "alice", "egress": confined, "own": true})
        );
        // The same through the CLI, which prints what she now has.
        let out = node.cli(&[
            "egress",
            "alice",
            "--mode",
            "allowlist",
            "--allow",
            "allowed.test",
        ]);
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "alice: only allowed.test (own)\n"
        );
        let pid = node.main_of("alice").await["pid"].clone();
        // The same instance, from its next connection on.
        assert!(!reaches(node, "alice", OUTSIDE_ADDR, "8080").await);
        let fetch = [
            ("host", NAMED_HOST),
            ("port", "80"),
            ("name", "allowed.test"),
            ("tls", "0"),
        ];
        assert_eq!(probe(node, "alice", "fetch", &fetch).await["ok"], true);
        let other = [
            ("host", NAMED_HOST),
            ("port", "80"),
            ("name", "other.test"),
            ("tls", "0"),
        ];
        let tried = probe(node, "alice", "fetch", &other).await;
        assert!(refused(&tried, &["ECONNRESET", "ECONNABORTED"]), "{tried}");
        for (name, code) in [("allowed.test", 0), ("exfil.example", 5)] {
            let query = [("server", NAME_SERVER), ("name", name)];
            let tried = probe(node, "alice", "lookup", &query).await;
            assert_eq!(tried["value"], code, "{name}: {tried}");
        }
        assert_eq!(*asked.lock().unwrap(), ["allowed.test"]);
        assert_eq!(node.main_of("alice").await["pid"], pid, "not restarted");
        // Bob keeps the node's policy.
        assert!(reaches(node, "bob", OUTSIDE_ADDR, "8080").await);
        let (_, status) = node.get("/users/alice/instance").await;
        assert_eq!(status["egress"], confined, "{status}");
        let (_, status) = node.get("/users/bob/instance").await;
        assert_eq!(status["egress"], json!({"mode": "allow_all", "allow": []}));
        // Refusals name the user, for the connection and the lookup.
        let text = std::fs::read_to_string(log).unwrap();
        for what in ["other.test:80 is not allowed", "lookup of exfil.example"] {
            assert!(
                text.lines().any(|l| l.contains("egress refused")
                    && l.contains(what)
                    && l.contains("user=alice")),
                "no refusal of {what} naming alice:\n{text}"
            );
        }
        // A policy that would not mean what it says, or is not one, is
        // refused and changes nothing.
        for bad in [
            json!({"mode": "allow_all", "allow": ["allowed.test"]}),
            json!({"mode": "allowlist", "allow": ["not a name!"]}),
            json!({"mode": "everything"}),
            json!({"mode": "deny_all", "allow": [], "extra": 1}),
        ] {
            let (code, body) = put(node, "/users/alice/egress", bad.clone()).await;
            assert_eq!(
                (code, body["error"].as_str()),
                (400, Some("invalid_request")),
                "{bad}: {body}"
            );
        }
        assert!(!reaches(node, "alice", OUTSIDE_ADDR, "8080").await);
        // A relaunch starts confined.
        assert_eq!(node.delete("/users/alice/instance").await, 204);
        launch(node, "alice").await;
        assert!(!reaches(node, "alice", OUTSIDE_ADDR, "8080").await);
        // A policy set for a user who never ran is only stored: their
        // first instance starts under it.
        let closed = json!({"mode": "deny_all", "allow": []});
        let (code, body) = put(node, "/users/carol/egress", closed.clone()).await;
        assert_eq!((code, &body["own"]), (200, &json!(true)), "{body}");
        launch(node, "carol").await;
        assert!(!reaches(node, "carol", OUTSIDE_ADDR, "8080").await);
        // Clearing it (here with the CLI) gives back the node's policy;
        // clearing a user who has none changes nothing.
        let out = node.cli(&["egress", "alice", "--clear"]);
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "alice: internet, nothing private (the node's)\n"
        );
        assert!(reaches(node, "alice", OUTSIDE_ADDR, "8080").await);
        assert_eq!(node.delete("/users/bob/egress").await, 200);
        assert!(reaches(node, "bob", OUTSIDE_ADDR, "8080").await);
        let (_, status) = node.get("/users/alice/instance").await;
        assert_eq!(status["egress"], json!({"mode": "allow_all", "allow": []}));
    });
}

/// berth remakes its guard's table at start: an instance adopted after a
/// `kill -9` of berth keeps its user's own policy from the first packet,
/// never the node's for a moment.
#[test]
fn an_adopted_instance_keeps_its_users_own_policy_across_a_restart_of_berth() {
    let Some(ns) = Netns::for_test("egress adoption") else {
        return;
    };
    Netns::listen(&ns.outside, OUTSIDE_ADDR, 8080);
    ns.with_alice("", async move |node: &mut Node, _log: &Path| {
        let closed = json!({"mode": "deny_all", "allow": []});
        let (code, body) = put(node, "/users/alice/egress", closed).await;
        assert_eq!(code, 200, "{body}");
        assert!(!reaches(node, "alice", OUTSIDE_ADDR, "8080").await);
        let pid = node.main_of("alice").await["pid"].clone();
        node.kill9();
        node.restart();
        node.adopted().await;
        assert_eq!(
            node.main_of("alice").await["pid"],
            pid,
            "adopted, not restarted"
        );
        assert!(!reaches(node, "alice", OUTSIDE_ADDR, "8080").await);
    });
}

/// Asks alice's sandbox relay for `target` (host:port), then for `name`
/// behind it.
async fn relayed(node: &Node, target: &str, name: &str) -> Value {
    probe(
        node,
        "alice",
        "relayed",
        &[("target", target), ("name", name)],
    )
    .await
}

/// One request to an explicit proxy on `port` of loopback, and all it
/// answers (its answer, then the upstream's, until either side closes).
#[cfg(feature = "kubernetes")]
async fn through_proxy(port: u16, request: String) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("the egress proxy for pods listens");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(PATIENCE, stream.read_to_end(&mut answer))
        .await
        .expect("the proxy or the upstream closes")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// A CONNECT to `target` with `credential` (`name:password`, or none).
#[cfg(feature = "kubernetes")]
fn connect_request(target: &str, credential: Option<&str>) -> String {
    let auth = credential.map_or(String::new(), |c| {
        format!(
            "Proxy-Authorization: Basic {}\r\n",
            data_encoding::BASE64.encode(c.as_bytes())
        )
    });
    format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n")
}

/// The egress proxy for pods, in the real binary on the Kubernetes runtime
/// (the API server **double**, as in `kubernetes.rs`), with everything in
/// the test's network namespace: the double, the pods its kubelet runs,
/// berth, and the hosts. A confined user's pod carries a credential in
/// its proxy variables; with it, the proxy reaches an allowed name (by a
/// tunnel and by a plain request), but not a name it does not allow, not
/// the allowed host by its raw address or another name, and not an
/// allowed name that resolves to a metadata or private address. Without
/// it, or with another user's, nothing. The NetworkPolicy lets the pod
/// reach the proxy's port, and a policy changed through the API applies
/// from the next request. Refusals are logged with the user.
#[cfg(feature = "kubernetes")]
#[test]
fn a_confined_pod_reaches_allowed_names_only_through_the_egress_proxy_with_its_own_credential() {
    let Some(ns) = Netns::for_test("egress proxy for pods") else {
        return;
    };
    Netns::listen(&ns.outside, NAMED_HOST, 80);
    Netns::listen(&ns.outside, DENIED_HOST, 80);
    let host = ns.host.clone();
    Netns::run_in(&ns.host, move || {
        // Worker threads start from this one, in the namespace: the
        // double's listener and the pods its kubelet runs are there too.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let double = berth_k8s::testing::ApiServerDouble::start().await;
            let root = tempfile::tempdir().unwrap();
            let kubeconfig = crate::kubernetes::kubeconfig(&double, root.path());
            let dir = root.path().join("node");
            let text = crate::kubernetes::config_from_example(&dir, &kubeconfig, None, "solo");
            let mut config: toml::Table = toml::from_str(&text).unwrap();
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            config.insert(
                "cluster_secret".into(),
                berth_testkit::TEST_CLUSTER_SECRET.into(),
            );
            let isolation: toml::Table = toml::from_str(
                "egress = \"allowlist\"\n\
                 egress_allow = [\"allowed.test\", \"meta.test\", \"inside.test\"]\n",
            )
            .unwrap();
            config.insert("isolation".into(), isolation.into());
            config["kubernetes"]["network"]
                .as_table_mut()
                .unwrap()
                .insert("egress_proxy".into(), format!("127.0.0.1:{port}").into());
            let config = toml::to_string(&config).unwrap();
            let log = root.path().join("berth.log");
            let options = Netns::berth_in(&host, &log);
            let node = tokio::task::spawn_blocking(move || {
                Node::from(
                    support::berth()
                        .node(&dir)
                        .config(&config)
                        .options(options)
                        .start(),
                )
            })
            .await
            .unwrap();
            launch(&node, "alice").await;
            let pod = eventually(PATIENCE, "alice's pod", || async {
                double.object(berth_k8s::testing::Kind::Pod, "berth", "berth-alice")
            })
            .await;
            let proxy_url = pod["spec"]["containers"][0]["env"]
                .as_array()
                .unwrap()
                .iter()
                .find(|v| v["name"] == "HTTPS_PROXY")
                .and_then(|v| v["value"].as_str())
                .expect("a confined pod's proxy variables")
                .to_owned();
            let (credential, at) = proxy_url
                .strip_prefix("http://")
                .unwrap()
                .split_once('@')
                .unwrap();
            assert_eq!(at, format!("127.0.0.1:{port}"));
            let (name, _) = credential.split_once(':').unwrap();
            let alice = Some(credential);
            let ask = |target: &str, credential: Option<&str>| {
                through_proxy(port, connect_request(target, credential))
            };

            // The allowed name, by a tunnel and by a plain request.
            let reached = ask("allowed.test:80", alice).await;
            assert!(
                reached.starts_with("HTTP/1.1 200 Connection established")
                    && reached.contains("HTTP/1.0 200 OK"),
                "{reached}"
            );
            let plain = through_proxy(
                port,
                format!(
                    "GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\
                     Proxy-Authorization: Basic {}\r\n\r\n",
                    data_encoding::BASE64.encode(credential.as_bytes())
                ),
            )
            .await;
            assert!(plain.starts_with("HTTP/1.0 200 OK"), "{plain}");
            // Nothing else, whatever it is called.
            for target in [
                "denied.test:80",
                "other.test:80",
                &format!("{NAMED_HOST}:80"),
            ] {
                let refused = ask(target, alice).await;
                assert!(refused.starts_with("HTTP/1.1 403"), "{target}: {refused}");
            }
            for target in ["meta.test:80", "inside.test:80"] {
                let refused = ask(target, alice).await;
                assert!(refused.starts_with("HTTP/1.1 502"), "{target}: {refused}");
            }
            // No credential, or not alice's own: nothing at all.
            let forged = format!("{name}:{}", "0".repeat(64));
            let bobs = format!("Ym9i:{}", credential.split_once(':').unwrap().1);
            for credential in [None, Some(forged.as_str()), Some(bobs.as_str())] {
                let refused = ask("allowed.test:80", credential).await;
                assert!(
                    refused.starts_with("HTTP/1.1 407")
                        && refused.contains("Proxy-Authenticate: Basic"),
                    "{credential:?}: {refused}"
                );
            }
            // Her NetworkPolicy lets her pod reach the proxy's port.
            let policy = double
                .object(
                    berth_k8s::testing::Kind::NetworkPolicy,
                    "berth",
                    "berth-alice",
                )
                .unwrap();
            assert!(
                policy["spec"]["egress"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|r| r["ports"][0]["port"] == port),
                "{policy}"
            );

            // Changed through the API: from the next request.
            let other = json!({"mode": "allowlist", "allow": ["denied.test"]});
            let (code, body) = put(&node, "/users/alice/egress", other).await;
            assert_eq!(code, 200, "{body}");
            let reached = ask("denied.test:80", alice).await;
            assert!(reached.contains("HTTP/1.0 200 OK"), "{reached}");
            let refused = ask("allowed.test:80", alice).await;
            assert!(refused.starts_with("HTTP/1.1 403"), "{refused}");

            let logged = std::fs::read_to_string(&log).unwrap();
            assert!(
                logged.lines().any(|l| l.contains("egress refused (pod)")
                    && l.contains("user=alice")
                    && l.contains("other.test:80")),
                "{logged}"
            );
            drop(node);
        });
    })
    .join()
    .unwrap();
}

/// A sandboxed instance has no route out: it reaches the outside only
/// through its relay, which connects as the instance's own account, so the
/// egress guard holds for it exactly as at level `user` (every metadata
/// address, private range and the host refused, the outside reached), and
/// so does a policy an operator gives the user while it runs. The relay
/// ends with the instance, leaving no process of its account.
#[test]
fn a_sandboxed_instance_reaches_out_only_through_its_relay_under_the_egress_guard() {
    let Some(ns) = Netns::for_test("sandbox egress") else {
        return;
    };
    let mut refused_targets: Vec<String> = Vec::new();
    for addr in METADATA
        .iter()
        .chain(PRIVATE.iter().filter(|a| !a.contains(':')))
    {
        Netns::listen(&ns.outside, addr, 80);
        refused_targets.push(format!("{addr}:80"));
    }
    Netns::listen(&ns.host, HOST_ADDR, 8080);
    refused_targets.push(format!("{HOST_ADDR}:8080"));
    Netns::listen(&ns.outside, OUTSIDE_ADDR, 80);
    Netns::listen(&ns.outside, OUTSIDE_ADDR, 8080);
    Netns::listen(&ns.outside, NAMED_HOST, 80);
    ns.with_alice_at("sandbox", "", async move |node: &mut Node, _log: &Path| {
        // No route of its own...
        let direct = [("host", OUTSIDE_ADDR), ("port", "80")];
        let tried = probe(node, "alice", "connect", &direct).await;
        assert!(refused(&tried, &["ENETUNREACH"]), "{tried}");
        // ...but its relay reaches the outside, and nothing the guard refuses.
        let outside = format!("{OUTSIDE_ADDR}:80");
        let tried = relayed(node, &outside, "any.test").await;
        assert_eq!(tried["ok"], true, "{tried}");
        for target in &refused_targets {
            let tried = relayed(node, target, "any.test").await;
            assert_eq!(tried["status"], "502", "{target}: {tried}");
        }
        // Never the host's loopback, where berth and the host's services
        // listen, by any name.
        let berth_port = port_of(node);
        for target in ["127.0.0.1", "localhost", "0.0.0.0", "[::ffff:127.0.0.1]"] {
            let target = format!("{target}:{berth_port}");
            let tried = relayed(node, &target, "any.test").await;
            assert_eq!(tried["status"], "403", "{target}: {tried}");
        }
        // An allowlist of one name, given while it runs.
        let confined = json!({"mode": "allowlist", "allow": ["allowed.test"]});
        let (code, body) = put(node, "/users/alice/egress", confined).await;
        assert_eq!(code, 200, "{body}");
        assert_eq!(
            relayed(node, "allowed.test:80", "allowed.test").await["ok"],
            true
        );
        let tried = relayed(node, &outside, "other.test").await;
        assert_eq!(tried["errno"], "ECONNABORTED", "{tried}");
        let tried = relayed(node, &format!("{OUTSIDE_ADDR}:8080"), "any.test").await;
        assert_eq!(tried["status"], "502", "{tried}");
        // The relay is the account's, in the instance's cgroup (frozen and
        // killed with it), and goes with the instance.
        let pid = u32::try_from(node.main_of("alice").await["pid"].as_u64().unwrap()).unwrap();
        let uid = uid_of_process(pid).unwrap();
        let relays = support::processes_of_account(uid, support::is_relay);
        assert_eq!(relays.len(), 1, "{relays:?}");
        let cgroups = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        assert_eq!(cgroups(relays[0]), cgroups(pid));
        assert_eq!(node.delete("/users/alice/instance").await, 204);
        eventually(
            Duration::from_secs(10),
            "alice's processes to end",
            || async {
                support::processes_of_uids(uid..uid + 1)
                    .is_empty()
                    .then_some(())
            },
        )
        .await;
        // Its cgroup goes with it: the relay had ended before.
        let left = support::instance_cgroups(&node.data_dir);
        assert!(left.is_empty(), "cgroups left: {left:?}");
    });
}

/// The egress guard's IPv6 rules hold for a sandbox's relay too: it
/// reaches a public IPv6 host, and never the IPv6 metadata address, a
/// unique local host, a public address of the host's own, IPv4 metadata
/// asked for as an IPv4-mapped address, or the host's `::1`.
#[test]
fn a_sandboxed_instances_relay_is_held_by_the_egress_guards_ipv6_rules() {
    let Some(ns) = Netns::for_test("sandbox egress, IPv6") else {
        return;
    };
    for addr in [METADATA_V6, "fd12:3456::7", "169.254.169.254", OUTSIDE_V6] {
        Netns::listen(&ns.outside, addr, 80);
    }
    Netns::listen(&ns.host, HOST_V6, 8080);
    ns.with_alice_at("sandbox", "", async move |node: &mut Node, _log: &Path| {
        let tried = relayed(node, &format!("[{OUTSIDE_V6}]:80"), "any.test").await;
        assert_eq!(tried["ok"], true, "{tried}");
        let berth_port = port_of(node);
        for target in [
            format!("[{METADATA_V6}]:80"),
            "[fd12:3456::7]:80".to_owned(),
            format!("[{HOST_V6}]:8080"),
            "[::ffff:169.254.169.254]:80".to_owned(),
            format!("[::1]:{berth_port}"),
        ] {
            let tried = relayed(node, &target, "any.test").await;
            assert!(
                tried["ok"] == false
                    && ["403", "502"].contains(&tried["status"].as_str().unwrap_or("")),
                "{target}: {tried}"
            );
        }
    });
}

// --- capacity ------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn past_the_nodes_capacity_a_launch_gets_503_and_starts_nothing() {
    if !privileged("capacity") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    // No mode configured: as root, instances run at level `user`.
    let node = Node::start(
        dir.path(),
        &format!(
            "[instance]\nport_range = [{}, {}]\n\n[cluster]\ncapacity = 3\n\n\
             [isolation]\nbase_uid = {}\nuid_count = 1000\n",
            slot.ports,
            slot.ports + 39,
            slot.base_uid
        ),
    );
    for user in ["c1", "c2", "c3"] {
        let instance = launch(&node, user).await;
        let pid = instance["pid"].as_u64().unwrap() as u32;
        let uid = uid_of_process(pid).unwrap();
        assert!(
            (slot.base_uid..slot.base_uid + 1000).contains(&uid),
            "the default level as root is `user`: {user} runs as {uid}"
        );
    }
    let (status, body) = node.post("/users/c4/instance", json!({})).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (503, Some("capacity_exhausted")),
        "{body}"
    );
    assert!(
        body["message"].as_str().unwrap().contains("capacity"),
        "{body}"
    );
    assert!(node.main_of("c4").await.is_null(), "nothing recorded");
    assert!(instance_pids(&node.data_dir, "c4", "main").is_empty());
    assert!(
        !node.data_dir.join("run/c4").exists(),
        "no shim was started"
    );
    assert!(!node.data_dir.join("users/c4").exists(), "no root was made");
    // A place freed is a place taken.
    assert_eq!(node.delete("/users/c1/instance").await, 204);
    launch(&node, "c4").await;
    node.kill_instances();
}

// --- freezing ------------------------------------------------------------------

/// A heartbeat that escapes the program's session: a double fork with a
/// `setsid` between, then a counter written to `$HOME/beat` every 50 ms.
const ESCAPEE: &str = "\
import os, time
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
beat = os.path.join(os.environ['HOME'], 'beat')
i = 0
while True:
    i += 1
    with open(beat + '.tmp', 'w') as f:
        f.write(str(i))
    os.replace(beat + '.tmp', beat)
    time.sleep(0.05)
";

/// The demo app at level `sandbox`, started by a shell that first lets
/// [`ESCAPEE`] loose; hibernation only by hand.
fn escapee_config(slot: &Slot) -> String {
    let script = serde_json::to_string(ESCAPEE).unwrap();
    let berth = serde_json::to_string(support::BERTH).unwrap();
    format!(
        "[instance]\nport_range = [{first}, {last}]\n\
         command = [\"/bin/sh\", \"-c\", 'python3 -c \"$2\" & exec \"$0\" demo-app --port \"$1\"', {berth}, \"{{port}}\", {script}]\n\
         ready_token_regex = 'berth-demo: http://127\\.0\\.0\\.1:\\d+/\\?token=([A-Za-z0-9_-]+)'\n\n\
         [reap]\nhibernate_after_s = 0\n\n\
         [isolation]\nmode = \"sandbox\"\nbase_uid = {uid}\nuid_count = 1000\n",
        first = slot.ports,
        last = slot.ports + 39,
        uid = slot.base_uid,
    )
}

/// berth started where no cgroup hierarchy is mounted (a mount namespace
/// of its own with `/sys/fs/cgroup` unmounted): a host that gives
/// instances no cgroup.
fn without_cgroups() -> StartOptions {
    StartOptions {
        wrapper: [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            "umount -R /sys/fs/cgroup && exec \"$@\"",
            "sh",
        ]
        .iter()
        .map(|a| (*a).to_owned())
        .collect(),
        ..StartOptions::default()
    }
}

/// At level `user` on a host that gives instances no cgroup, a shim found
/// silent after a restart of berth is killed, and with it every process
/// of its account: the program's `setsid` escapee too, which nothing but
/// the account holds. (berth runs where no cgroup hierarchy is mounted.)
#[tokio::test(flavor = "multi_thread")]
async fn without_cgroups_a_silent_shims_escaped_session_dies_with_it() {
    if !privileged("silent shim without cgroups") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let config = escapee_config(&slot).replace("mode = \"sandbox\"", "mode = \"user\"");
    let mut node = Node::from(
        support::berth()
            .node(dir.path())
            .extra(&config)
            .options(without_cgroups())
            .start(),
    );
    launch(&node, "alice").await;
    let state = state_of(&node, "alice");
    assert_eq!(state["cgroup"], json!([]), "no cgroup: {state}");
    beats_past(&node, "alice", 0).await;
    let uid = u32::try_from(state["uid"].as_u64().unwrap()).unwrap();
    let escapee = *support::processes_of_account(uid, |cmdline| cmdline.starts_with(b"python3"))
        .first()
        .expect("the escapee runs");
    let shim = i32::try_from(state["shim_pid"].as_u64().unwrap()).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(shim),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    node.kill9();
    node.restart_with(&without_cgroups());
    eventually(Duration::from_secs(90), "the escapee to die", || async {
        (!alive(u64::from(escapee))).then_some(())
    })
    .await;
    node.kill_instances();
}

/// The session id of a process (`/proc/<pid>/stat`, field 6).
fn session_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()
}

/// The freezer of `user`'s instance cgroup, from its shim's state file:
/// its directory under the v1 `freezer` controller, else (v2) its one
/// directory.
fn freezer_of(node: &Node, user: &str) -> berth_local::isolation::cgroup::CgroupFreezer {
    use berth_local::isolation::cgroup::{CgroupFreezer, FreezerKind};
    let dirs: Vec<PathBuf> = state_of(node, user)["cgroup"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| PathBuf::from(d.as_str().unwrap()))
        .collect();
    match dirs.iter().find(|d| d.join("freezer.state").exists()) {
        Some(dir) => CgroupFreezer {
            kind: FreezerKind::V1,
            dir: dir.clone(),
        },
        None => {
            assert_eq!(dirs.len(), 1, "one v2 directory, or a v1 freezer: {dirs:?}");
            CgroupFreezer {
                kind: FreezerKind::V2,
                dir: dirs[0].clone(),
            }
        }
    }
}

/// The escapee's count.
fn beat(node: &Node, user: &str) -> Option<u64> {
    std::fs::read_to_string(node.data_dir.join(format!("users/{user}/home/beat")))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Waits until the escapee's count goes past `after`.
async fn beats_past(node: &Node, user: &str, after: u64) -> u64 {
    eventually(PATIENCE, "the escapee's heartbeat", || async {
        beat(node, user).filter(|b| *b > after)
    })
    .await
}

/// Every process of `user`'s instance, the escaped session included, is in
/// its frozen cgroup, and the escapee's count stands still.
async fn assert_all_frozen(
    node: &Node,
    user: &str,
    freezer: &berth_local::isolation::cgroup::CgroupFreezer,
    pids: &[u32],
) {
    eventually(PATIENCE, "the instance's cgroup frozen", || async {
        freezer.is_frozen().unwrap().then_some(())
    })
    .await;
    let members = freezer.tasks().unwrap();
    assert!(
        pids.iter().all(|p| members.contains(p)),
        "{pids:?} all in {members:?}"
    );
    for pid in pids {
        assert_ne!(proc_state(*pid), Some('R'), "{pid} is frozen");
    }
    // Nothing to wait for: a frozen heartbeat is one that stays the same
    // over twenty of its periods.
    let frozen_at = beat(node, user);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(beat(node, user), frozen_at, "the escapee made no progress");
}

#[tokio::test(flavor = "multi_thread")]
async fn in_a_sandbox_hibernation_freezes_processes_that_left_the_session() {
    if !privileged("freezing, sandbox") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let config = escapee_config(&slot);
    let mut node = Node::start(dir.path(), &config);
    let main = launch(&node, "alice").await;
    let program = u32::try_from(main["pid"].as_u64().unwrap()).unwrap();
    let first = beats_past(&node, "alice", 0).await;
    let mut pids = instance_pids(&node.data_dir, "alice", "main");
    pids.sort_unstable();
    let escaped: Vec<u32> = pids
        .iter()
        .copied()
        .filter(|p| session_of(*p) != session_of(program))
        .collect();
    assert_eq!(escaped.len(), 1, "the escapee left the session: {pids:?}");
    let freezer = freezer_of(&node, "alice");

    let out = node.cli(&["hibernate", "alice"]);
    assert!(out.status.success(), "{out:?}");
    assert_all_frozen(&node, "alice", &freezer, &pids).await;

    // A restart of berth adopts alice as hibernated, still frozen.
    node.kill9();
    let node = Node::start(dir.path(), &config);
    eventually(PATIENCE, "alice adopted as hibernated", || async {
        (node.status_of("alice").await == "hibernated").then_some(())
    })
    .await;
    assert_all_frozen(&node, "alice", &freezer, &pids).await;

    // A resume thaws every process, the escapee too, with the same pids.
    let out = node.cli(&["resume", "alice"]);
    assert!(out.status.success(), "{out:?}");
    let frozen_at = beat(&node, "alice").unwrap_or(first);
    beats_past(&node, "alice", frozen_at).await;
    assert!(!freezer.is_frozen().unwrap());
    let mut after = instance_pids(&node.data_dir, "alice", "main");
    after.sort_unstable();
    assert_eq!(after, pids, "the same processes run again");
    assert_eq!(node.main_of("alice").await["restarts"], 0);

    // Frozen again, then stopped: killed while frozen, never thawed to run;
    // nothing of the instance is left, its cgroups neither.
    let out = node.cli(&["hibernate", "alice"]);
    assert!(out.status.success(), "{out:?}");
    assert_all_frozen(&node, "alice", &freezer, &pids).await;
    let stopped_at = beat(&node, "alice");
    assert_eq!(node.delete("/users/alice/instance").await, 204);
    eventually(PATIENCE, "every process of alice gone", || async {
        pids.iter().all(|p| !alive(u64::from(*p))).then_some(())
    })
    .await;
    assert_eq!(beat(&node, "alice"), stopped_at, "no beat after the kill");
    eventually(PATIENCE, "alice's cgroups removed", || async {
        (!freezer.dir.exists()).then_some(())
    })
    .await;
    node.kill_instances();
}

// --- cleanup and survival ---------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_hundred_start_stop_cycles_leave_nothing_behind() {
    if !privileged("no leaks") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    // The built-in demo app: quick to start, so the cycles are many.
    let node = Node::start(
        dir.path(),
        &format!(
            "[instance]\nport_range = [{}, {}]\n\n\
             [isolation]\nmode = \"sandbox\"\nbase_uid = {}\nuid_count = 1000\n",
            slot.ports,
            slot.ports + 39,
            slot.base_uid
        ),
    );
    let berth = node.pid().unwrap();
    let mounts = || std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mounts_under_data = || {
        mounts()
            .lines()
            .filter(|l| l.contains(node.data_dir.to_str().unwrap()))
            .count()
    };
    // One cycle first, to learn where the cgroups go.
    launch(&node, "cycler").await;
    let parents: Vec<PathBuf> = state_of(&node, "cycler")["cgroup"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| Path::new(d.as_str().unwrap()).parent().unwrap().to_owned())
        .collect();
    // A pure v2 host has one hierarchy; v1 (or a hybrid) has one per
    // controller berth uses.
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    assert_eq!(
        parents.len(),
        if v2 { 1 } else { 4 },
        "one parent per hierarchy: memory, pids, cpu and freezer on v1: {parents:?}"
    );
    assert_eq!(own_ports_elements(&node.data_dir).len(), 1);
    assert_eq!(node.delete("/users/cycler/instance").await, 204);
    let cgroups = || -> usize {
        parents
            .iter()
            .map(|p| {
                std::fs::read_dir(p)
                    .unwrap()
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .count()
            })
            .sum()
    };
    let zygote = zygote_of(berth).expect("the zygote runs");
    let shims = || -> usize {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                    s.rsplit_once(')')
                        .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                        == Some(&zygote.to_string())
                })
            })
            .count()
    };
    let before = (
        cgroups(),
        own_ports_elements(&node.data_dir).len(),
        mounts_under_data(),
        processes_in_range(slot.base_uid).len(),
        shims(),
    );
    assert_eq!(before, (0, 0, 0, 0, 0));
    for i in 0..100 {
        let user = format!("cycle{}", i % 7);
        launch(&node, &user).await;
        assert_eq!(node.delete(&format!("/users/{user}/instance")).await, 204);
    }
    let after = (
        cgroups(),
        own_ports_elements(&node.data_dir).len(),
        mounts_under_data(),
        processes_in_range(slot.base_uid).len(),
        shims(),
    );
    assert_eq!(
        after, before,
        "(cgroups, port-guard pairs, mounts, instance processes, shims)"
    );
}

/// Whether the nftables table of the berth with `data_dir` exists.
fn table_listed(data_dir: &Path) -> bool {
    let table = berth_local::isolation::nft_table_name(&data_dir.canonicalize().unwrap());
    let out = Command::new("nft")
        .args(["list", "tables", "inet"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.trim() == format!("table inet {table}"))
}

/// What a berth at `user` leaves in the kernel: its table and cgroup
/// parents stay while an instance of it may be adopted, and go once none
/// can be: at its graceful stop with none left, else at the start of the
/// next berth on the host once it is gone (killed, or its data dir
/// deleted) with none left.
#[tokio::test(flavor = "multi_thread")]
async fn leftovers_stay_while_an_instance_may_need_them_and_go_after() {
    if !privileged("leftovers") {
        return;
    }
    let slot = slot();
    let config = |ports: u16, uids: u32| {
        format!(
            "[instance]\nport_range = [{ports}, {}]\n\n\
             [isolation]\nmode = \"user\"\nbase_uid = {uids}\nuid_count = 100\n",
            ports + 9,
        )
    };
    let leftovers = |node: &Node| {
        (
            table_listed(&node.data_dir),
            support::cgroup_parents(&node.data_dir).len(),
        )
    };
    let start_one = |i: u16, dir: &Path| {
        Node::start(
            dir,
            &config(slot.ports + i * 10, slot.base_uid + u32::from(i) * 100),
        )
    };
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();

    // A stops gracefully with no instance left: nothing stays.
    let mut a = start_one(0, dirs[0].path());
    launch(&a, "passing").await;
    assert_eq!(
        leftovers(&a),
        (true, 4),
        "table, and memory, pids, cpu, freezer"
    );
    assert_eq!(a.delete("/users/passing/instance").await, 204);
    assert!(a.terminate().success());
    assert_eq!(leftovers(&a), (false, 0));

    // B is killed with an instance running, C and D with none; then D's
    // data dir is deleted.
    let mut b = start_one(1, dirs[1].path());
    let staying = launch(&b, "staying").await;
    b.kill9();
    let mut gone = Vec::new();
    for (i, dir) in [(2, dirs[2].path()), (3, dirs[3].path())] {
        let mut node = start_one(i, dir);
        launch(&node, "brief").await;
        assert_eq!(node.delete("/users/brief/instance").await, 204);
        node.kill9();
        gone.push(node);
    }
    let d_parents: Vec<PathBuf> = support::cgroup_parents(&gone[1].data_dir)
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    let d_table = berth_local::isolation::nft_table_name(&gone[1].data_dir.canonicalize().unwrap());
    std::fs::remove_dir_all(&gone[1].data_dir).unwrap();

    // The next berth on the host removes C's and D's, and keeps B's.
    let next_dir = tempfile::tempdir().unwrap();
    let next = start_one(0, next_dir.path());
    assert_eq!(leftovers(&gone[0]), (false, 0), "C: its berth is gone");
    let listed = Command::new("nft")
        .args(["list", "tables"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&listed.stdout).contains(&d_table),
        "D: its data dir is gone"
    );
    assert!(d_parents.iter().all(|p| !p.exists()), "{d_parents:?}");
    assert_eq!(leftovers(&b), (true, 4), "B's instance may be adopted");
    assert!(alive(staying["pid"].as_u64().unwrap()));
    assert!(table_listed(&next.data_dir));

    b.kill_instances();
    support::remove_isolation_leftovers(&b.data_dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn adopted_instances_stay_confined_and_keep_their_limits_after_a_restart() {
    if !privileged("survival") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let config = breach_config(dir.path(), &slot, "sandbox", "memory_max_mb = 64\n", "");
    let mut node = start(dir.path(), &config);
    let alice = launch(&node, "alice").await;
    let bob = launch(&node, "bob").await;
    let uid = probe(&node, "alice", "whoami", &[]).await["uid"].clone();

    node.kill9();
    let node = start(dir.path(), &config);
    node.adopted().await;
    let main = node.running_main("alice", None).await;
    assert_eq!(main["pid"], alice["pid"], "adopted, not restarted");

    // Same account, same pid namespace, same guard.
    assert_eq!(probe(&node, "alice", "whoami", &[]).await["uid"], uid);
    let seen = probe(&node, "alice", "processes", &[]).await;
    assert!(
        seen.as_array().unwrap().iter().all(|e| e[1] == uid),
        "{seen}"
    );
    let bob_port = bob["port"].as_u64().unwrap().to_string();
    let alice_port = alice["port"].as_u64().unwrap().to_string();
    let to_bob = probe(
        &node,
        "alice",
        "connect",
        &[("host", "127.0.0.1"), ("port", &bob_port)],
    )
    .await;
    assert!(refused(&to_bob, &["ECONNREFUSED"]), "{to_bob}");
    let to_self = probe(
        &node,
        "alice",
        "connect",
        &[("host", "127.0.0.1"), ("port", &alice_port)],
    )
    .await;
    assert_eq!(
        to_self["ok"], true,
        "its own port was given back: {to_self}"
    );
    // Same memory limit, enforced and reported by the new berth.
    let _ = node
        .http
        .get(format!("{}/u/alice/alloc?mb=256", node.url))
        .bearer_auth(&node.token)
        .send()
        .await;
    let crashed = eventually(PATIENCE, "alice's OOM kill recorded", || async {
        let main = node.main_of("alice").await;
        (main["restarts"].as_u64() >= Some(1)).then_some(main)
    })
    .await;
    assert_eq!(
        crashed["last_error"], "out of memory (limit 64 MiB)",
        "{crashed}"
    );
    assert_eq!(probe(&node, "bob", "ping", &[]).await["ok"], true);
    node.kill_instances();
}

// --- clear errors ---------------------------------------------------------------------

fn berth_fails(dir: &Path, config: &str, uid: Option<u32>) -> String {
    std::fs::write(dir.join("berth.toml"), config).unwrap();
    let mut command = Command::new(support::BERTH);
    command
        .args(["serve", "--config"])
        .arg(dir.join("berth.toml"))
        .current_dir(dir);
    if let Some(uid) = uid {
        use std::os::unix::process::CommandExt;
        command.uid(uid).gid(uid);
    }
    let out = command.output().unwrap();
    assert_eq!(out.status.code(), Some(1), "berth must refuse to start");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn user_and_sandbox_without_root_or_nft_are_startup_errors_that_say_so() {
    if !privileged("startup errors") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    for path in [dir.path(), data.as_path()] {
        nix::unistd::chown(path, Some(65_534.into()), Some(65_534.into())).unwrap();
    }
    for mode in ["user", "sandbox"] {
        let config = format!(
            "listen = \"127.0.0.1:0\"\ndata_dir = \"{}\"\n[isolation]\nmode = \"{mode}\"\n",
            data.display()
        );
        let stderr = berth_fails(dir.path(), &config, Some(65_534));
        assert!(
            stderr.contains(&format!(
                "isolation mode \"{mode}\" needs berth to run as root"
            )),
            "{stderr}"
        );
    }
    let config = format!(
        "listen = \"127.0.0.1:0\"\ndata_dir = \"{}\"\n[isolation]\nmode = \"user\"\nnft = \"/nonexistent/nft\"\n",
        data.display()
    );
    let stderr = berth_fails(dir.path(), &config, None);
    assert!(
        stderr.contains("needs nftables") && stderr.contains("/nonexistent/nft"),
        "{stderr}"
    );
    // And the failed start left nothing in the kernel: no cgroup parent.
    let table = berth_local::isolation::nft_table_name(&data.canonicalize().unwrap());
    let parent = table.replacen("berth_", "berth-", 1);
    let found = dirs_named(Path::new("/sys/fs/cgroup"), &parent, 4);
    assert!(found.is_empty(), "a failed start left {found:?}");
}

/// Directories named `name` under `root`, at most `depth` levels down.
fn dirs_named(root: &Path, name: &str, depth: usize) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(root) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        if entry.file_name() == name {
            found.push(path.clone());
        }
        if depth > 1 {
            found.extend(dirs_named(&path, name, depth - 1));
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread")]
async fn level_none_warns_that_instances_are_not_isolated() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("berth.log");
    let options = StartOptions {
        stderr: Some(log.clone()),
        ..StartOptions::default()
    };
    let node = Node::from(
        support::berth()
            .node(dir.path())
            .config(&format!(
                "listen = \"127.0.0.1:0\"\ndata_dir = \"{}\"\n[isolation]\nmode = \"none\"\n",
                dir.path().join("data").display()
            ))
            .options(options)
            .start(),
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("WARN") && text.contains("NOT isolated from berth or from each other"),
        "{text}"
    );
    drop(node);
}

// --- every process of an instance: setsid, double forks, forks in flight ---------

/// Lines `support/escapes.py` writes: three processes that left the
/// program's process group, one of them a new process for every line.
const ESCAPES: &str = include_str!("support/escapes.py");

/// The demo app at `mode`, started by a shell that first lets the
/// [`ESCAPES`] loose; hibernation only by hand.
fn escapes_config(slot: &Slot, mode: &str) -> String {
    let script = serde_json::to_string(ESCAPES).unwrap();
    let berth = serde_json::to_string(support::BERTH).unwrap();
    format!(
        "[instance]\nport_range = [{first}, {last}]\nstop_grace_s = 2\n\
         command = [\"/bin/sh\", \"-c\", 'python3 -c \"$2\" & exec \"$0\" demo-app --port \"$1\"', {berth}, \"{{port}}\", {script}]\n\
         ready_token_regex = 'berth-demo: http://127\\.0\\.0\\.1:\\d+/\\?token=([A-Za-z0-9_-]+)'\n\n\
         [reap]\nhibernate_after_s = 0\n\n\
         [isolation]\nmode = \"{mode}\"\nbase_uid = {uid}\nuid_count = 1000\n",
        first = slot.ports,
        last = slot.ports + 39,
        uid = slot.base_uid,
    )
}

/// `user`'s journal of escapes: lines per kind.
fn escape_lines(node: &Node, user: &str) -> std::collections::BTreeMap<String, usize> {
    let text =
        std::fs::read_to_string(node.data_dir.join(format!("users/{user}/home/escapes.log")))
            .unwrap_or_default();
    let mut kinds = std::collections::BTreeMap::new();
    for line in text.lines() {
        if let Some(kind) = line.split_whitespace().nth(1) {
            *kinds.entry(kind.to_owned()).or_insert(0) += 1;
        }
    }
    kinds
}

fn escape_total(node: &Node, user: &str) -> usize {
    escape_lines(node, user).values().sum()
}

/// Hibernates alice and shows her frozen: once her shim reports the
/// freeze, her journal stands still while bob's grows by a hundred lines
/// (a second of alice's writing). Returns her journal's length.
async fn hibernate_and_hold_still(node: &Node, mode: &str) -> usize {
    let out = node.cli(&["hibernate", "alice"]);
    assert!(out.status.success(), "{out:?}");
    // The API answers once the freeze is asked for; the shim records it
    // once the kernel has frozen every process.
    eventually(PATIENCE, "alice's shim reporting her frozen", || async {
        (state_of(node, "alice")["frozen"] == true).then_some(())
    })
    .await;
    let frozen_at = escape_total(node, "alice");
    let bob = escape_total(node, "bob");
    eventually(PATIENCE, "bob's escapes writing on", || async {
        (escape_total(node, "bob") >= bob + 100).then_some(())
    })
    .await;
    assert_eq!(
        escape_total(node, "alice"),
        frozen_at,
        "{mode}: a process of alice's hibernated instance wrote: {:?}",
        escape_lines(node, "alice")
    );
    frozen_at
}

/// Waits until each of the three escapes has written `n` lines more than
/// `base` says.
async fn escapes_write(node: &Node, user: &str, n: usize) {
    let base = escape_lines(node, user);
    eventually(PATIENCE, &format!("{user}'s escapes writing"), || async {
        let now = escape_lines(node, user);
        ["setsid", "double", "racer"]
            .iter()
            .all(|k| now.get(*k).copied().unwrap_or(0) >= base.get(*k).copied().unwrap_or(0) + n)
            .then_some(())
    })
    .await;
}

/// The uid `user`'s instance runs as, from its shim's state.
fn instance_uid(node: &Node, user: &str) -> u32 {
    u32::try_from(state_of(node, user)["uid"].as_u64().unwrap()).unwrap()
}

/// Live (not zombie) processes of `uid`, by any of their uids.
fn live_processes_of(uid: u32) -> Vec<u32> {
    berth_local::isolation::sweep::members(uid)
        .into_iter()
        .filter(|m| !matches!(m.state, 'Z' | 'X'))
        .map(|m| m.pid)
        .collect()
}

/// The attack of a program whose processes leave its group (as every
/// Jupyter kernel does), at `mode`, on a host that gives instances
/// cgroups or not:
/// hibernation freezes all of them, a resume runs all of them again, a
/// stop of the frozen instance kills all of them without a thaw, and a
/// stop of a running one leaves none. The oracle is the journal the
/// escapes write every 10 ms: frozen, its length stands still while
/// bob's, a second instance of the same program, grows by a hundred
/// lines; resumed, each escape writes again; killed, no process of
/// alice's uid is left and the length never moved from the freeze on.
async fn every_process_of_an_instance_is_frozen_and_stopped(mode: &str, cgroups: bool) {
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let options = if cgroups {
        StartOptions::default()
    } else {
        without_cgroups()
    };
    let node = Node::from(
        support::berth()
            .node(dir.path())
            .extra(&escapes_config(&slot, mode))
            .options(options)
            .start(),
    );
    launch(&node, "alice").await;
    launch(&node, "bob").await;
    let held_by = state_of(&node, "alice")["cgroup"].clone();
    assert_eq!(held_by != json!([]), cgroups, "alice's cgroups: {held_by}");
    escapes_write(&node, "alice", 3).await;
    escapes_write(&node, "bob", 3).await;
    let uid = instance_uid(&node, "alice");
    // The shim writes the program's log from its blocking pool, which a
    // sandbox's shim must have started before it entered a pid namespace.
    let logs = node.cli(&["logs", "alice"]);
    assert!(
        String::from_utf8_lossy(&logs.stdout).contains("berth-demo: http://"),
        "{mode}: alice's log holds her program's output: {logs:?}"
    );

    let frozen_at = hibernate_and_hold_still(&node, mode).await;
    assert!(!live_processes_of(uid).is_empty(), "frozen, not killed");

    // A resume runs every escape again, and a second hibernation freezes
    // them all again.
    let out = node.cli(&["resume", "alice"]);
    assert!(out.status.success(), "{out:?}");
    eventually(PATIENCE, "alice's shim reporting her thawed", || async {
        (state_of(&node, "alice")["frozen"] == false).then_some(())
    })
    .await;
    escapes_write(&node, "alice", 3).await;
    assert!(escape_total(&node, "alice") > frozen_at, "{mode}: resumed");
    let frozen_at = hibernate_and_hold_still(&node, mode).await;

    // A stop of the frozen instance: killed without being thawed.
    assert_eq!(node.delete("/users/alice/instance").await, 204);
    eventually(PATIENCE, "every process of alice's uid gone", || async {
        live_processes_of(uid).is_empty().then_some(())
    })
    .await;
    assert_eq!(
        escape_total(&node, "alice"),
        frozen_at,
        "{mode}: alice's frozen instance ran again before it died"
    );

    // A stop of a running instance leaves none of its processes either.
    launch(&node, "alice").await;
    escapes_write(&node, "alice", 3).await;
    assert_eq!(node.delete("/users/alice/instance").await, 204);
    eventually(PATIENCE, "every process of alice's uid gone", || async {
        live_processes_of(uid).is_empty().then_some(())
    })
    .await;
    // Not even a zombie: the orphans an instance leaves are reaped by its
    // shim, whatever the host's init does, so none counts against the
    // account's process limits.
    eventually(PATIENCE, "no zombie of alice's uid left", || async {
        berth_local::isolation::sweep::members(uid)
            .is_empty()
            .then_some(())
    })
    .await;
    let stopped_at = escape_total(&node, "alice");
    let bob = escape_total(&node, "bob");
    eventually(PATIENCE, "bob's escapes writing on", || async {
        (escape_total(&node, "bob") >= bob + 100).then_some(())
    })
    .await;
    assert_eq!(escape_total(&node, "alice"), stopped_at);
    assert_eq!(node.delete("/users/bob/instance").await, 204);
    let bob_uid = slot.base_uid..slot.base_uid + 1000;
    eventually(PATIENCE, "no process of any instance left", || async {
        processes_in_range(bob_uid.start).is_empty().then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn at_level_user_every_process_of_an_instance_is_frozen_and_stopped() {
    if privileged("escapes, user") {
        every_process_of_an_instance_is_frozen_and_stopped("user", true).await;
    }
}

/// The same at level `user` on a host that gives instances no cgroup:
/// the account alone holds them, so a freeze stops each of its processes
/// by SIGSTOP, a resume continues each, and a stop kills each.
#[tokio::test(flavor = "multi_thread")]
async fn without_cgroups_every_process_of_an_instance_is_frozen_and_stopped() {
    if privileged("escapes, user, no cgroups") {
        every_process_of_an_instance_is_frozen_and_stopped("user", false).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn in_a_sandbox_every_process_of_an_instance_is_frozen_and_stopped() {
    if privileged("escapes, sandbox") {
        every_process_of_an_instance_is_frozen_and_stopped("sandbox", true).await;
    }
}

/// Starts [`ESCAPES`] as `uid` (its own group too), writing to `journal`.
fn escapes_as(uid: u32, journal: &Path) {
    use std::os::unix::process::CommandExt;
    let status = Command::new("/usr/bin/python3")
        .args(["-c", ESCAPES])
        .arg(journal)
        .uid(uid)
        .gid(uid)
        .env("HOME", "/")
        .current_dir("/")
        .status()
        .unwrap();
    assert!(status.success(), "{status:?}");
}

fn journal_lines(journal: &Path) -> usize {
    std::fs::read_to_string(journal).map_or(0, |t| t.lines().count())
}

/// The handle at level `user` on a host that gives instances no cgroup:
/// the account. A sweep of SIGSTOP reaches every process of the uid (the
/// escapes of `support/escapes.py`, a fork in flight included), a sweep of
/// SIGKILL ends them all without letting one run again, and another
/// account's processes run on untouched, as the clock of the test.
#[tokio::test(flavor = "multi_thread")]
async fn a_sweep_of_an_account_freezes_and_kills_every_one_of_its_processes() {
    use berth_local::isolation::sweep;
    if !privileged("sweep of an account") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let slot = slot();
    let (uid, clock_uid) = (slot.base_uid + 7, slot.base_uid + 8);
    let (journal, clock) = (dir.path().join("escapes.log"), dir.path().join("clock.log"));
    escapes_as(uid, &journal);
    escapes_as(clock_uid, &clock);
    eventually(PATIENCE, "the escapes writing", || async {
        (journal_lines(&journal) >= 9 && journal_lines(&clock) >= 9).then_some(())
    })
    .await;

    assert_eq!(sweep::stop_all(uid), vec![], "every process stopped");
    let frozen_at = journal_lines(&journal);
    let members = sweep::members(uid);
    assert!(!members.is_empty());
    assert!(
        members.iter().all(|m| matches!(m.state, 'T' | 'Z')),
        "{members:?}"
    );
    let tick = journal_lines(&clock);
    eventually(PATIENCE, "the other account writing on", || async {
        (journal_lines(&clock) >= tick + 100).then_some(())
    })
    .await;
    assert_eq!(
        journal_lines(&journal),
        frozen_at,
        "a stopped process wrote"
    );

    assert_eq!(sweep::kill_all(uid), vec![], "every process killed");
    assert_eq!(live_processes_of(uid), Vec::<u32>::new());
    assert_eq!(journal_lines(&journal), frozen_at, "killed without running");
    assert!(
        !live_processes_of(clock_uid).is_empty(),
        "the other account untouched"
    );
    assert_eq!(sweep::kill_all(clock_uid), vec![]);
}

// --- ports: a stolen port is useless -------------------------------------------

/// [`breach_config`] whose programs start only once `$HOME/gate` exists,
/// so that a test decides when each binds its port.
fn gated_config(dir: &Path, slot: &Slot, mode: &str) -> String {
    let script = serde_json::to_string(BREACH).unwrap();
    let gated = serde_json::to_string(
        "while [ ! -e \"$HOME/gate\" ]; do sleep 0.02; done; exec python3 -c \"$1\" \"$0\"",
    )
    .unwrap();
    breach_config(dir, slot, mode, "", "").replace(
        &format!("command = [\"python3\", \"-c\", {script}, \"{{port}}\"]"),
        &format!("command = [\"/bin/sh\", \"-c\", {gated}, \"{{port}}\", {script}]"),
    )
}

/// Lets `user`'s gated program start, once berth has made its home.
async fn open_gate(node: &Node, user: &str) {
    let home = node.data_dir.join(format!("users/{user}/home"));
    eventually(PATIENCE, &format!("{user}'s home made"), || async {
        home.is_dir().then_some(())
    })
    .await;
    std::fs::write(home.join("gate"), "").unwrap();
}

/// Port theft, tried as a hostile user would: alice's program binds the
/// port berth has just given bob, before bob's program (which binds late)
/// can. At `user` the kernel lets her bind it and accept connections
/// there, but berth asks the kernel who owns the socket it reached and
/// sends nothing to one that is not bob's account's: her listener answers
/// neither the readiness probe nor bob's requests; bob's program fails to
/// bind and is restarted on another port. In a sandbox her bind lands in
/// her own network namespace, and bob keeps his port in his. Either way
/// everything sent to bob reaches bob, and her listener never receives a
/// request.
async fn a_stolen_port_is_never_reached(mode: &str) {
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let node = start(dir.path(), &gated_config(dir.path(), &slot, mode));
    tokio::join!(launch(&node, "alice"), open_gate(&node, "alice"));
    let alice_uid = probe(&node, "alice", "whoami", &[]).await["uid"].clone();
    let bob_launch = {
        let http = node.http.clone();
        let url = node.api("/users/bob/instance");
        let token = node.token.clone();
        tokio::spawn(async move {
            http.post(url)
                .bearer_auth(token)
                .json(&json!({}))
                .send()
                .await
                .map(|r| r.status().as_u16())
        })
    };
    let port = eventually(PATIENCE, "bob's port chosen", || async {
        node.main_of("bob").await["port"].as_u64()
    })
    .await;
    let theft = probe(&node, "alice", "steal", &[("port", &port.to_string())]).await;
    assert_eq!(
        theft["ok"], true,
        "the kernel lets alice bind bob's port: {theft}"
    );
    open_gate(&node, "bob").await;
    let launched = bob_launch.await.unwrap();
    assert!(launched.is_ok(), "bob's launch got no answer: {launched:?}");

    let moved = mode == "user";
    eventually(PATIENCE, "bob running on a port of his own", || async {
        let main = node.main_of("bob").await;
        (main["status"] == "running"
            && main["ready"] == true
            && (main["port"].as_u64() != Some(port)) == moved)
            .then_some(())
    })
    .await;
    let whoami = probe(&node, "bob", "whoami", &[]).await;
    assert_ne!(
        whoami["stolen"], true,
        "bob's request reached alice: {whoami}"
    );
    assert!(whoami["uid"].is_u64(), "{whoami}");
    assert_ne!(whoami["uid"], alice_uid, "{whoami}");
    let stolen = probe(&node, "alice", "stolen", &[]).await;
    assert_eq!(
        stolen["value"], 0,
        "alice's listener on bob's port got requests"
    );
    node.kill_instances();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_port_stolen_at_level_user_answers_nobody() {
    if privileged("port theft, user") {
        a_stolen_port_is_never_reached("user").await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_port_stolen_in_a_sandbox_answers_nobody() {
    if privileged("port theft, sandbox") {
        a_stolen_port_is_never_reached("sandbox").await;
    }
}

// --- the sandbox's network ------------------------------------------------------

/// At `user` every instance shares the host's network namespace (README
/// says what that shares). A sandbox has one of its own, with nothing but
/// its loopback: bob's services beside his port (one outside the
/// instance port range, one on an abstract unix socket) are out of
/// alice's reach, and her `/proc/net` lists none of his sockets, while
/// bob reaches and sees his own.
#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_reaches_and_sees_no_other_tenants_sockets() {
    if !privileged("sandbox network") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let node = start(
        dir.path(),
        &breach_config(dir.path(), &slot, "sandbox", "", ""),
    );
    launch(&node, "alice").await;
    launch(&node, "bob").await;
    // Outside the instance port range, where no port guard looks.
    let extra = (slot.ports + 100).to_string();
    let name = format!("berth-test-bob-{}", slot.base_uid);
    let listening = probe(&node, "bob", "listen", &[("port", &extra), ("name", &name)]).await;
    assert_eq!(listening["ok"], true, "{listening}");
    let tcp = [("host", "127.0.0.1"), ("port", extra.as_str())];
    let unix = [("name", name.as_str())];
    let tcp_table = format!(":{:04X}", slot.ports + 100);
    for (user, reaches) in [("bob", true), ("alice", false)] {
        let to_tcp = probe(&node, user, "connect", &tcp).await;
        let to_unix = probe(&node, user, "uconnect", &unix).await;
        if reaches {
            assert_eq!(to_tcp["ok"], true, "{user}: {to_tcp}");
            assert_eq!(to_unix["ok"], true, "{user}: {to_unix}");
        } else {
            assert!(
                refused(&to_tcp, &["ECONNREFUSED"]),
                "{user} reached bob: {to_tcp}"
            );
            assert!(
                refused(&to_unix, &["ECONNREFUSED"]),
                "{user} reached bob: {to_unix}"
            );
        }
        for (table, needle) in [
            ("/proc/net/tcp", tcp_table.as_str()),
            ("/proc/net/unix", &name),
        ] {
            let seen = probe(
                &node,
                user,
                "mentions",
                &[("path", table), ("needle", needle)],
            )
            .await;
            assert_eq!(seen["value"], reaches, "{user} in {table}: {seen}");
        }
    }
    node.kill_instances();
}

// --- one instance against every other: resources it must not exhaust ------

/// Distinct files (by inode) and their sizes: the entries of `dir`, and
/// the files `pid` holds open there, deleted ones included.
fn log_bytes_on_disk(dir: &Path, pid: u32) -> u64 {
    let mut files = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        if let Ok(meta) = entry.metadata() {
            files.insert((meta.dev(), meta.ino()), meta.len());
        }
    }
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        let Ok(target) = std::fs::read_link(fd.path()) else {
            continue;
        };
        if target.starts_with(dir)
            && let Ok(meta) = std::fs::metadata(fd.path())
        {
            files.insert((meta.dev(), meta.ino()), meta.len());
        }
    }
    files.values().sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_program_printing_without_end_leaves_at_most_log_max_bytes_on_disk() {
    if !privileged("log bound") {
        return;
    }
    const CAP: u64 = 1024 * 1024;
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let config = breach_config(dir.path(), &slot, "user", "", "").replace(
        "[instance]\n",
        &format!("[instance]\nlog_max_bytes = {CAP}\n"),
    );
    let node = start(dir.path(), &config);
    launch(&node, "alice").await;
    let logs = node.data_dir.join("users/alice/logs");
    let state: Value =
        serde_json::from_slice(&std::fs::read(node.data_dir.join("run/alice/main.json")).unwrap())
            .unwrap();
    let shim = u32::try_from(state["shim_pid"].as_u64().unwrap()).unwrap();
    // The program's user deletes the log the shim (root) writes: before
    // the bound, it kept growing where nobody saw it.
    let log = logs.join("main.log");
    let unlinked = probe(&node, "alice", "unlink", &[("path", path_str(&log))]).await;
    assert_eq!(unlinked["ok"], true, "{unlinked}");
    assert_eq!(probe(&node, "alice", "spew", &[("mb", "24")]).await, true);
    // `berth logs` shows the newest lines: the last one printed.
    let last = eventually(PATIENCE, "alice's last line in `logs`", || async {
        let (status, body) = node.get("/users/alice/instance/logs?tail=3").await;
        assert_eq!(status, 200, "{body}");
        let lines = body["lines"].as_array().cloned().unwrap_or_default();
        (lines.last().and_then(Value::as_str) == Some("spew done")).then_some(lines)
    })
    .await;
    assert!(
        last[..2]
            .iter()
            .all(|l| l.as_str().unwrap().starts_with("spew 00")),
        "{last:?}"
    );
    let on_disk = log_bytes_on_disk(&logs, shim);
    assert!(
        on_disk <= CAP,
        "{on_disk} bytes of alice's log on disk, bound {CAP}"
    );
    assert!(on_disk > CAP / 4, "the log is kept, not dropped: {on_disk}");
    node.kill_instances();
}

#[tokio::test(flavor = "multi_thread")]
async fn an_instance_cannot_fill_berths_connections_from_many_loopback_addresses() {
    if !privileged("connections per account") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    // Idle connections are not closed during the test.
    let proxy =
        "[proxy]\nmax_connections = 40\nmax_connections_per_ip = 10\nheader_timeout_ms = 120000\n";
    let node = start(
        dir.path(),
        &breach_config(dir.path(), &slot, "user", "", proxy),
    );
    launch(&node, "alice").await;
    launch(&node, "bob").await;
    let berth_port = port_of(&node);
    // 8 source addresses × 10: within the cap of each address, twice
    // berth's whole capacity.
    let flood = probe(
        &node,
        "alice",
        "connectmany",
        &[("port", &berth_port), ("sources", "8"), ("each", "10")],
    )
    .await;
    assert_eq!(flood["ok"], true, "{flood}");
    let opened = flood["value"]["opened"].as_u64().unwrap();
    assert!(
        opened <= 10,
        "alice holds {opened} connections to berth: {flood}"
    );
    // bob's app and the API still answer.
    assert_eq!(probe(&node, "bob", "ping", &[]).await["ok"], true);
    let (status, _) = node.get("/users/bob/instance").await;
    assert_eq!(status, 200);
    node.kill_instances();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_berth_whose_uid_range_overlaps_a_live_berths_is_refused_naming_it() {
    if !privileged("uid ranges") {
        return;
    }
    let slot = slot();
    // Ranges of 100 within the slot's 1000 uids.
    let config = |dir: &Path, first: u32| {
        format!(
            "listen = \"127.0.0.1:0\"\ndata_dir = \"{}\"\n[instance]\nport_range = [{}, {}]\n\
             [isolation]\nmode = \"user\"\nbase_uid = {first}\nuid_count = 100\n",
            dir.join("data").display(),
            slot.ports,
            slot.ports + 39,
        )
    };
    let first = tempfile::tempdir().unwrap();
    let live = start(first.path(), &config(first.path(), slot.base_uid));
    // Half of its range, on a store of its own: refused, naming the
    // other berth's data dir and range.
    let second = tempfile::tempdir().unwrap();
    support::reachable_by_instances(second.path());
    let stderr = refused_at_start(second.path(), &config(second.path(), slot.base_uid + 50));
    let live_data = live.data_dir.canonicalize().unwrap();
    for needle in [
        format!(
            "the instance uid range {}-{}",
            slot.base_uid + 50,
            slot.base_uid + 149
        ),
        format!(
            "overlaps the range {}-{}",
            slot.base_uid,
            slot.base_uid + 99
        ),
        format!("data dir {}", live_data.display()),
    ] {
        assert!(stderr.contains(&needle), "{needle} missing from {stderr}");
    }
    // Nothing of it was made: no table, no instance.
    assert!(!second.path().join("data/run").exists(), "{stderr}");
    // The next range along starts beside it.
    let beside = start(second.path(), &config(second.path(), slot.base_uid + 100));
    assert_healthy(&beside).await;
    drop(beside);
    // A killed berth's range is free at once.
    drop(live);
    let third = tempfile::tempdir().unwrap();
    let after = start(third.path(), &config(third.path(), slot.base_uid + 50));
    assert_healthy(&after).await;
}

/// berth's stderr when it refuses to start on `config`, written in `dir`;
/// a berth that starts instead fails the test (and is killed).
fn refused_at_start(dir: &Path, config: &str) -> String {
    std::fs::write(dir.join("berth.toml"), config).unwrap();
    let mut child = Command::new(support::BERTH)
        .args(["serve", "--config"])
        .arg(dir.join("berth.toml"))
        .current_dir(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A refusal comes before anything is set up, in well under a second.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("berth started where it must refuse");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(
        status.code(),
        Some(1),
        "berth must refuse to start: {stderr}"
    );
    stderr
}

async fn assert_healthy(node: &Node) {
    let health = reqwest::get(format!("{}/healthz", node.url)).await.unwrap();
    assert_eq!(health.text().await.unwrap(), "ok");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_instance_holding_the_port_range_cannot_keep_others_from_starting() {
    if !privileged("ports per instance") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let slot = slot();
    let node = start(
        dir.path(),
        &breach_config(dir.path(), &slot, "user", "max_ports = 4\n", ""),
    );
    launch(&node, "alice").await;
    // alice's program listens on every free port of the range.
    let (first, last) = (slot.ports.to_string(), (slot.ports + 39).to_string());
    let held = probe(
        &node,
        "alice",
        "bindmany",
        &[("first", &first), ("last", &last)],
    )
    .await;
    assert_eq!(held["ok"], true, "{held}");
    assert!(held["value"].as_u64().unwrap() >= 30, "{held}");
    // bob starts all the same, and answers.
    let (status, body) = node.post("/users/bob/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    eventually(PATIENCE, "bob running", || async {
        (node.status_of("bob").await == "running").then_some(())
    })
    .await;
    assert_eq!(probe(&node, "bob", "ping", &[]).await["ok"], true);
    node.kill_instances();
}

// --- hooks ----------------------------------------------------------------

/// A `pre_stop` hook run at `mode` acts as the program would and no more:
/// it runs as the instance's account, in its cgroup, sees the private
/// `/tmp` the program wrote to, and reaches the program on its loopback
/// (in a sandbox, the instance's own network namespace). Each is written
/// by the hook itself into the instance's folder, which only the
/// instance's account and root may write.
async fn a_hook_runs_inside_the_instance(mode: &str) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let slot = slot();
    let marker = format!("/tmp/berth-hook-probe-{}", slot.base_uid);
    let berth = serde_json::to_string(support::BERTH).unwrap();
    let hook = format!(
        "id -u > hook.uid; cat /proc/self/cgroup > hook.cgroup; cat {marker} > hook.tmp; \
         python3 -c \"import os, urllib.request; print(urllib.request.urlopen('http://127.0.0.1:%s/counter' \
         % os.environ['BERTH_PORT'], timeout=10).status)\" > hook.port 2>&1; echo \"$BERTH_HOOK\" > hook.name"
    );
    let config = format!(
        "listen = \"127.0.0.1:0\"\ndata_dir = \"{data}\"\n\n\
         [instance]\nport_range = [{first}, {last}]\nstop_grace_s = 2\n\
         command = [\"/bin/sh\", \"-c\", 'echo program > {marker}; exec \"$0\" demo-app --port \"$1\"', {berth}, \"{{port}}\"]\n\
         ready_token_regex = 'berth-demo: http://127\\.0\\.0\\.1:\\d+/\\?token=([A-Za-z0-9_-]+)'\n\
         pre_stop = [\"/bin/sh\", \"-c\", {hook}]\n\n\
         [isolation]\nmode = \"{mode}\"\nbase_uid = {uid}\nuid_count = 1000\n",
        data = dir.path().join("data").display(),
        first = slot.ports,
        last = slot.ports + 39,
        uid = slot.base_uid,
        hook = serde_json::to_string(&hook).unwrap(),
    );
    let node = start(dir.path(), &config);
    launch(&node, "alice").await;
    let state = state_of(&node, "alice");
    let uid = instance_uid(&node, "alice");
    assert_eq!(node.delete("/users/alice/instance").await, 204);
    let ws = node.data_dir.join("users/alice/ws");
    let read = |name: &str| {
        std::fs::read_to_string(ws.join(name))
            .unwrap_or_else(|e| panic!("the hook wrote no {name}: {e}"))
    };
    assert_eq!(read("hook.name").trim(), "pre_stop");
    assert_eq!(
        read("hook.uid").trim(),
        uid.to_string(),
        "the hook's account"
    );
    let cgroups = read("hook.cgroup");
    for dir in state["cgroup"].as_array().unwrap() {
        let leaf = Path::new(dir.as_str().unwrap()).file_name().unwrap();
        assert!(
            cgroups.contains(leaf.to_str().unwrap()),
            "the hook is not in {dir}: {cgroups}"
        );
    }
    assert_eq!(read("hook.tmp").trim(), "program", "the program's /tmp");
    assert_eq!(read("hook.port").trim(), "200", "the program's loopback");
    if mode == "sandbox" {
        assert!(
            !Path::new(&marker).exists(),
            "the sandbox's /tmp is the host's"
        );
    }
    let _ = std::fs::remove_file(&marker);
}

#[tokio::test(flavor = "multi_thread")]
async fn at_level_user_a_hook_runs_as_the_instance_in_its_cgroup() {
    if privileged("hooks, user") {
        a_hook_runs_inside_the_instance("user").await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn in_a_sandbox_a_hook_runs_inside_the_instances_namespaces() {
    if privileged("hooks, sandbox") {
        a_hook_runs_inside_the_instance("sandbox").await;
    }
}
