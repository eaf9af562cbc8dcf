//! Fault injection for cluster mode: real `berth serve` nodes on loopback
//! sharing one real PostgreSQL, and faults done for real — `kill -9` and
//! `SIGSTOP` of a node, a TCP relay between a node and the database that is
//! cut and healed, a restart of PostgreSQL.
//!
//! The evidence that a user never had two writers is a *journal*: every
//! instance runs `berth demo-app --journal <dir>/journal-<slug>.log`, which
//! appends `<BERTH_EPOCH> <counter>` once a second. [`check_journal`] proves
//! that once a line of epoch N was written no line of an older epoch ever
//! followed — i.e. the old instance was frozen or gone before the new one
//! wrote anything, and stayed so.
//!
//! Lease timings are short (TTL 3 s, renew 1 s, fence after 2 s unless a
//! test says otherwise), every wait polls until a generous deadline, and
//! nothing asserts on timing. Each test has its own database (the shared
//! throwaway server, or its own server when it restarts it) and its own
//! ports; each `Node`'s drop kills berth and its instances.
//!
//! The faults: a holder killed (failover with evidence; and under
//! `takeover = "manual"`), paused past the TTL, cut from the database for
//! less than the TTL, partitioned with its database answers arriving late,
//! and PostgreSQL restarted under load. `tests/cluster.rs` covers the
//! fault-free paths and the basic failover and manual takeover; the tests
//! here add the faults and the journal.

use crate::support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_testkit::PgCluster;
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use support::{
    BERTH, CLUSTER_LEASE, Node, alive, eventually, frozen, instance_pids, proc_state, signal,
};

pub(super) const SECRET: &str = berth_testkit::TEST_CLUSTER_SECRET;
pub(super) const IDS: [&str; 3] = ["node-a", "node-b", "node-c"];
/// The TTL in [`CLUSTER_LEASE`].
const TTL: Duration = Duration::from_millis(3000);
/// Generous bound for anything that should take a few seconds.
const LONG: Duration = Duration::from_secs(60);

// --- the journal checker ----------------------------------------------------

/// The lines one epoch wrote, in a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct EpochRun {
    epoch: u64,
    lines: usize,
    first: u64,
    last: u64,
    /// Times the counter did not go up: another process wrote under the
    /// same epoch (a restart that kept it).
    counter_resets: usize,
}

/// Checks a demo-app journal, the lines `<epoch> <counter>` that every
/// instance of one user appended: no line of an older epoch may follow a
/// line of a newer one (that would be two writers at once). Returns the
/// epochs in order. A last line without its newline is still being
/// written and is ignored.
pub(super) fn check_journal(text: &str) -> Result<Vec<EpochRun>, String> {
    let complete = text.rfind('\n').map_or("", |end| &text[..=end]);
    let mut runs: Vec<EpochRun> = Vec::new();
    for (i, line) in complete.lines().enumerate() {
        let n = i + 1;
        let (epoch, counter) = line
            .split_once(' ')
            .and_then(|(e, c)| Some((e.parse::<u64>().ok()?, c.parse::<u64>().ok()?)))
            .ok_or_else(|| format!("line {n} is not `<epoch> <counter>`: {line:?}"))?;
        match runs.last_mut() {
            Some(run) if run.epoch == epoch => {
                if counter <= run.last {
                    run.counter_resets += 1;
                }
                run.last = counter;
                run.lines += 1;
            }
            Some(run) if epoch < run.epoch => {
                return Err(format!(
                    "line {n}: epoch {epoch} wrote after epoch {} had started: two writers",
                    run.epoch
                ));
            }
            _ => runs.push(EpochRun {
                epoch,
                lines: 1,
                first: counter,
                last: counter,
                counter_resets: 0,
            }),
        }
    }
    Ok(runs)
}

#[test]
fn journal_checker_accepts_one_writer_at_a_time_and_catches_two() {
    let good = "3 1\n3 2\n3 3\n5 1\n5 2\n";
    assert_eq!(
        check_journal(good).unwrap(),
        vec![
            EpochRun {
                epoch: 3,
                lines: 3,
                first: 1,
                last: 3,
                counter_resets: 0
            },
            EpochRun {
                epoch: 5,
                lines: 2,
                first: 1,
                last: 2,
                counter_resets: 0
            },
        ]
    );
    // The old instance wrote once more after the new one started.
    let err = check_journal("3 1\n3 2\n4 1\n3 3\n4 2\n").unwrap_err();
    assert!(err.contains("line 4") && err.contains("epoch 3"), "{err}");
    // A partly written last line is not judged yet; a garbled full one is.
    assert_eq!(check_journal("3 1\n3").unwrap().len(), 1);
    assert_eq!(check_journal("").unwrap(), vec![]);
    assert!(check_journal("3 1\nx y\n").unwrap_err().contains("line 2"));
    // A second process under the same epoch starts counting again.
    assert_eq!(
        check_journal("3 1\n3 2\n3 1\n").unwrap()[0].counter_resets,
        1
    );
}

// --- harness ----------------------------------------------------------------

/// A fresh database on the shared test server (started on first use; that
/// blocks for a few seconds, so off the async threads).
pub(super) async fn fresh_db() -> String {
    tokio::task::spawn_blocking(|| PgCluster::shared().map(|_| ()).map_err(|e| e.to_string()))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("no PostgreSQL for the cluster tests: {e}"));
    PgCluster::shared().unwrap().fresh_database().await
}

/// The `[instance]` line that runs demo-app with a journal per user in
/// `dir`.
pub(super) fn journal_command(dir: &Path) -> String {
    let journal = format!("{}/journal-{{slug}}.log", dir.display());
    let argv = [BERTH, "demo-app", "--port", "{port}", "--journal", &journal];
    // A JSON array of strings is a TOML array too.
    format!("command = {}\n", serde_json::to_string(&argv).unwrap())
}

/// `[lease]` lines: the tests' short timings plus `extra`.
pub(super) fn lease(extra: &str) -> String {
    format!("{CLUSTER_LEASE}{extra}")
}

/// Starts one node (off the async threads: it waits for berth's output).
async fn start_node(root: &Path, db: &str, id: &str, lease: &str, instance: &str) -> Node {
    start_node_with(root, db, id, lease, instance, "").await
}

/// node-a, started first and alone, reaching `db` only through a relay
/// the test can cut.
async fn start_relayed_node(root: &Path, db: &str, lease: &str, instance: &str) -> (Relay, Node) {
    let relay = Relay::start(upstream_of(db)).await;
    let node = start_node(root, &via_port(db, relay.port), IDS[0], lease, instance).await;
    (relay, node)
}

/// [`start_node`] with `extra` top-level config keys.
async fn start_node_with(
    root: &Path,
    db: &str,
    id: &str,
    lease: &str,
    instance: &str,
    extra: &str,
) -> Node {
    let (dir, db, id, lease, instance, extra) = (
        root.join(id),
        db.to_owned(),
        id.to_owned(),
        lease.to_owned(),
        instance.to_owned(),
        extra.to_owned(),
    );
    tokio::task::spawn_blocking(move || {
        Node::from(
            support::berth()
                .node(&dir)
                .config(&support::cluster_config_custom(
                    &dir, &db, &id, SECRET, &lease, &instance, &extra,
                ))
                .start(),
        )
    })
    .await
    .unwrap()
}

async fn start_nodes(
    root: &Path,
    db: &str,
    ids: &[&str],
    lease: &str,
    instance: &str,
) -> Vec<Node> {
    let mut nodes = Vec::new();
    for id in ids {
        nodes.push(start_node(root, db, id, lease, instance).await);
    }
    nodes
}

/// A test's directories: nodes under `root`, journals in `journals`.
pub(super) struct Dirs {
    root: tempfile::TempDir,
    pub(super) journals: PathBuf,
}

impl Dirs {
    pub(super) fn new() -> Dirs {
        let root = tempfile::tempdir().unwrap();
        let journals = root.path().join("journals");
        std::fs::create_dir_all(&journals).unwrap();
        // Written by the instances, which run under their users' accounts
        // (the same uid on every node: the accounts are in the shared
        // store).
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&journals, std::fs::Permissions::from_mode(0o1777)).unwrap();
        Dirs { root, journals }
    }

    pub(super) fn path(&self) -> &Path {
        self.root.path()
    }

    pub(super) fn journal_text(&self, user: &str) -> String {
        std::fs::read_to_string(self.journals.join(format!("journal-{user}.log")))
            .unwrap_or_default()
    }

    /// The user's journal, checked; panics (with the journal) on two
    /// writers.
    fn journal(&self, user: &str) -> Vec<EpochRun> {
        let text = self.journal_text(user);
        check_journal(&text).unwrap_or_else(|e| panic!("{user}'s journal: {e}\n{text}"))
    }

    /// Lines the user's journal holds under `epoch`.
    fn lines_of(&self, user: &str, epoch: i64) -> usize {
        self.journal(user)
            .iter()
            .filter(|r| i64::try_from(r.epoch) == Ok(epoch))
            .map(|r| r.lines)
            .sum()
    }

    /// Waits until the user's journal holds at least `n` lines under
    /// `epoch` (checking it on every look).
    async fn wait_lines(&self, user: &str, epoch: i64, n: usize) {
        eventually(
            LONG,
            &format!("{n} journal lines of {user} epoch {epoch}"),
            || async { (self.lines_of(user, epoch) >= n).then_some(()) },
        )
        .await;
    }
}

fn index_of(id: &str) -> usize {
    IDS.iter()
        .position(|i| *i == id)
        .unwrap_or_else(|| panic!("unknown node {id:?}"))
}

/// Launches `user` through `node`; returns (holder index, epoch, pid).
async fn launch(nodes: &[Node], via: usize, user: &str) -> (usize, i64, u32) {
    let (status, body) = nodes[via]
        .post(&format!("/users/{user}/instance"), json!({}))
        .await;
    assert_eq!(status, 201, "{body}");
    let holder = index_of(body["instance"]["node"].as_str().unwrap());
    let epoch = body["instance"]["epoch"].as_i64().unwrap();
    let pids = instance_pids(&nodes[holder].data_dir, user, "main");
    assert_eq!(pids.len(), 1, "{user}: {pids:?}");
    (holder, epoch, pids[0])
}

/// `user`'s main processes on every node, as (node index, pid, state),
/// a frozen one's state as `T` whether a signal or a cgroup froze it.
fn mains_everywhere(nodes: &[Node], user: &str) -> Vec<(usize, u32, char)> {
    let mut found = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        for pid in instance_pids(&node.data_dir, user, "main") {
            if let Some(state) = proc_state(pid) {
                let state = if frozen(pid) { 'T' } else { state };
                found.push((i, pid, state));
            }
        }
    }
    found
}

/// The user's lease row as `node`'s API lists it.
async fn lease_of(node: &Node, user: &str) -> Option<Value> {
    let (status, body) = node.get("/leases").await;
    assert_eq!(status, 200, "{body}");
    body["leases"]
        .as_array()?
        .iter()
        .find(|l| l["user"] == user)
        .cloned()
}

/// Frozen: stopped by signal (level `none`) or in a frozen cgroup.
fn stopped(pid: u32) -> bool {
    frozen(pid)
}

/// Whether `pid` has been sent SIGKILL or is exiting (the kernel's
/// `PF_EXITING` flag in `/proc/<pid>/stat`): a killed frozen process is
/// thawed to die and shows `R` for that moment.
pub(super) fn killed(pid: u32) -> bool {
    const PF_EXITING: u64 = 0x4;
    const SIGKILL_BIT: u64 = 1 << (9 - 1);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let flags = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(6)?.parse::<u64>().ok())
        .unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let pending = status.lines().any(|line| {
        ["SigPnd:", "ShdPnd:"].iter().any(|field| {
            line.strip_prefix(field)
                .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
                .is_some_and(|mask| mask & SIGKILL_BIT != 0)
        })
    });
    flags & PF_EXITING != 0 || pending
}

/// Runs none of its own code any more: frozen, killed (a frozen
/// instance is thawed to die, and shows `R` for that moment), or gone.
pub(super) fn stopped_or_gone(pid: u32) -> bool {
    frozen(pid) || killed(pid) || !alive(u64::from(pid))
}

/// Waits until a node other than `old` runs `user` ready under an epoch
/// above `old_epoch`, asking the `askers`; returns (node index, record).
async fn moved(nodes: &[Node], askers: &[usize], user: &str, old_epoch: i64) -> (usize, Value) {
    eventually(LONG, &format!("{user} running on another node"), || async {
        for &i in askers {
            let main = nodes[i].main_of(user).await;
            let fresh = main["epoch"].as_i64().is_some_and(|e| e > old_epoch);
            if fresh && main["status"] == "running" && main["ready"] == true {
                return Some((index_of(main["node"].as_str()?), main));
            }
        }
        None
    })
    .await
}

// --- 1. a node dies: failover with evidence -----------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_is_replaced_and_its_instance_never_writes_again() {
    let db = fresh_db().await;
    let dirs = Dirs::new();
    let instance = journal_command(&dirs.journals);
    let mut nodes = start_nodes(dirs.path(), &db, &IDS, &lease(""), &instance).await;
    let (holder, old_epoch, old_pid) = launch(&nodes, 0, "alice").await;
    dirs.wait_lines("alice", old_epoch, 2).await;

    nodes[holder].kill9();
    let survivors: Vec<usize> = (0..3).filter(|i| *i != holder).collect();
    // Within TTL + heartbeat expiry + a scan, with room for a slow machine.
    let (new, main) = moved(&nodes, &survivors, "alice", old_epoch).await;
    assert_ne!(new, holder, "{main}");
    let new_epoch = main["epoch"].as_i64().unwrap();
    // The shim froze the orphan when its fence deadline passed, before the
    // lease could expire.
    assert!(
        stopped_or_gone(old_pid),
        "old pid {old_pid}: {:?}",
        proc_state(old_pid)
    );

    // Give a stale writer every chance to show up, then read the evidence:
    // nothing of the old epoch after the first line of the new one.
    dirs.wait_lines("alice", new_epoch, 3).await;
    let runs = dirs.journal("alice");
    assert_eq!(
        runs.iter().map(|r| r.epoch as i64).collect::<Vec<_>>(),
        vec![old_epoch, new_epoch],
        "{runs:?}"
    );
    assert!(stopped_or_gone(old_pid));
    // One running instance cluster-wide (the frozen orphan does not run).
    let running: Vec<_> = mains_everywhere(&nodes, "alice")
        .into_iter()
        .filter(|(_, _, s)| *s != 'T')
        .collect();
    assert_eq!(running.len(), 1, "{running:?}");
    assert_eq!(running[0].0, new);
    assert_eq!(main["pid"].as_u64(), Some(u64::from(running[0].1)));
}

// --- 2. a node dies under takeover = "manual" ---------------------------------

/// Extends `cluster.rs`'s manual takeover test with three nodes, the CLI's
/// `leases --expired`, a bounded watch (2 × TTL) that nobody relaunches,
/// and the journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_takeover_waits_for_the_operator_and_moves_the_user() {
    let db = fresh_db().await;
    let dirs = Dirs::new();
    let instance = journal_command(&dirs.journals);
    let lease = lease("takeover = \"manual\"\n");
    let mut nodes = start_nodes(dirs.path(), &db, &IDS, &lease, &instance).await;
    let (holder, old_epoch, old_pid) = launch(&nodes, 0, "alice").await;
    dirs.wait_lines("alice", old_epoch, 1).await;
    nodes[holder].kill9();
    let survivors: Vec<usize> = (0..3).filter(|i| *i != holder).collect();
    let (watcher, operator) = (&nodes[survivors[0]], &nodes[survivors[1]]);

    // Reported expired, holder not alive: the point where "evidence" would
    // relaunch her.
    eventually(LONG, "alice's lease listed expired", || async {
        let (_, body) = watcher.get("/leases?expired=true").await;
        body["leases"]
            .as_array()?
            .iter()
            .any(|l| {
                l["user"] == "alice"
                    && l["expired"] == true
                    && l["holder"] == IDS[holder]
                    && l["holder_alive"] == false
            })
            .then_some(())
    })
    .await;
    let out = watcher.cli(&["leases", "--expired"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("alice ") && l.contains(IDS[holder])),
        "{stdout}"
    );

    // Nobody relaunches her on their own, for 2 × TTL and a renew more.
    let watch_until = tokio::time::Instant::now() + 2 * TTL + Duration::from_secs(1);
    while tokio::time::Instant::now() < watch_until {
        for &i in &survivors {
            let pids = instance_pids(&nodes[i].data_dir, "alice", "main");
            assert!(
                pids.is_empty(),
                "relaunched on {} without an operator",
                IDS[i]
            );
        }
        let row = lease_of(watcher, "alice").await.unwrap();
        assert_eq!(row["holder"], IDS[holder], "{row}");
        assert_eq!(row["epoch"].as_i64(), Some(old_epoch), "{row}");
        // Paces the checks over a window in which nothing may happen.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let out = operator.cli(&["takeover", "alice"]);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let main = operator
        .running_main("alice", Some(u64::from(old_pid)))
        .await;
    assert_eq!(main["node"], IDS[survivors[1]], "{main}");
    let new_epoch = main["epoch"].as_i64().unwrap();
    assert!(new_epoch > old_epoch, "{main}");
    dirs.wait_lines("alice", new_epoch, 3).await;
    let runs = dirs.journal("alice");
    assert_eq!(
        runs.last().map(|r| r.epoch as i64),
        Some(new_epoch),
        "{runs:?}"
    );
    assert!(stopped_or_gone(old_pid));
    assert!(instance_pids(&nodes[survivors[0]].data_dir, "alice", "main").is_empty());
}

// --- 3. a node is paused --------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holder_is_fenced_and_stays_fenced_after_waking() {
    let db = fresh_db().await;
    let dirs = Dirs::new();
    let instance = journal_command(&dirs.journals);
    let nodes = start_nodes(dirs.path(), &db, &IDS, &lease(""), &instance).await;
    let (holder, old_epoch, old_pid) = launch(&nodes, 0, "alice").await;
    dirs.wait_lines("alice", old_epoch, 2).await;
    let survivors: Vec<usize> = (0..3).filter(|i| *i != holder).collect();
    let berth_pid = nodes[holder].pid().unwrap();

    // Paused (a long GC, a VM migration, SIGSTOP): it neither renews nor
    // heartbeats, and its API does not answer, so only the others are asked.
    signal(berth_pid, Signal::SIGSTOP);
    let paused = PauseGuard(berth_pid);
    let watcher = &nodes[survivors[0]];
    // The moment another node holds the lease, the old instance must
    // already be frozen: its shim's deadline passed before the lease did.
    let (new_holder, new_epoch) = eventually(LONG, "alice's lease claimed elsewhere", || async {
        let row = lease_of(watcher, "alice").await?;
        let epoch = row["epoch"].as_i64()?;
        (epoch > old_epoch).then(|| (row["holder"].as_str().unwrap().to_owned(), epoch))
    })
    .await;
    assert!(
        stopped(old_pid),
        "the old instance runs while {new_holder} holds epoch {new_epoch}: {:?}",
        proc_state(old_pid)
    );
    assert_ne!(new_holder, IDS[holder]);
    let new = index_of(&new_holder);
    let main = nodes[new]
        .running_main("alice", Some(u64::from(old_pid)))
        .await;
    assert_eq!(main["epoch"].as_i64(), Some(new_epoch), "{main}");
    let new_pid = main["pid"].as_u64().unwrap();
    // Stay paused well past the TTL while the new instance writes.
    dirs.wait_lines("alice", new_epoch, 2).await;
    assert!(stopped(old_pid));

    drop(paused); // SIGCONT
    // Its first renew finds the lease lost: the old instance is killed.
    eventually(LONG, "the old instance killed", || async {
        (!alive(u64::from(old_pid))).then_some(())
    })
    .await;
    // The woken node neither renews nor takes back the old epoch: over
    // several renew intervals the row stays the new holder's, and moves on.
    let first = lease_of(watcher, "alice").await.unwrap();
    for _ in 0..3 {
        let before = lease_of(watcher, "alice").await.unwrap();
        let row = eventually(LONG, "alice's lease renewed by its holder", || async {
            let row = lease_of(watcher, "alice").await?;
            (row["lease_until"].as_i64() > before["lease_until"].as_i64()).then_some(row)
        })
        .await;
        assert_eq!(row["holder"], new_holder.as_str(), "{row}");
        assert_eq!(row["epoch"].as_i64(), Some(new_epoch), "{row}");
    }
    assert!(
        lease_of(&nodes[holder], "alice").await.unwrap()["lease_until"].as_i64()
            > first["lease_until"].as_i64()
    );
    // The woken node sees the same, and serves nothing of alice's itself.
    let seen = nodes[holder].main_of("alice").await;
    assert!(
        seen["node"] != IDS[holder] || seen["status"] != "running",
        "the old node still claims alice: {seen}"
    );
    assert!(instance_pids(&nodes[holder].data_dir, "alice", "main").is_empty());
    // The new instance was not disturbed, and the journal has no stale line.
    let main = nodes[new].main_of("alice").await;
    assert_eq!(main["pid"].as_u64(), Some(new_pid), "{main}");
    let lines = dirs.lines_of("alice", new_epoch);
    dirs.wait_lines("alice", new_epoch, lines + 2).await;
    let runs = dirs.journal("alice");
    assert_eq!(
        runs.iter().map(|r| r.epoch as i64).collect::<Vec<_>>(),
        vec![old_epoch, new_epoch],
        "{runs:?}"
    );
    assert!(nodes[holder].is_running(), "the woken node exited");
}

/// Sends `SIGCONT` when dropped, so a failing test never leaves a stopped
/// berth behind.
pub(super) struct PauseGuard(pub(super) u32);

impl Drop for PauseGuard {
    fn drop(&mut self) {
        signal(self.0, Signal::SIGCONT);
    }
}

// --- 4. a node loses the database ---------------------------------------------

/// A TCP relay on a loopback port to a PostgreSQL server at `upstream`.
/// Cut, it closes every relayed connection and every new one at once, so
/// clients see errors promptly (not half-open sockets); healed, it relays
/// again. Hung, it keeps every connection open and accepts new ones but
/// passes no byte either way, as a link that stalls without a reset
/// would: clients see nothing at all, not an error, until it heals and
/// what was held goes through late. It can also hold back the server's
/// answers that carry result rows (`DataRow`), as a slow network would:
/// the statement runs at once, its answer arrives late.
pub(super) struct Relay {
    pub(super) port: u16,
    state: Arc<Mutex<RelayState>>,
    /// True while hung.
    hang: tokio::sync::watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct RelayState {
    cut: bool,
    row_delay: Duration,
    conns: Vec<tokio::task::AbortHandle>,
}

impl Relay {
    pub(super) async fn start(upstream: String) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(Mutex::new(RelayState::default()));
        let shared = state.clone();
        let (hang, hung) = tokio::sync::watch::channel(false);
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    // Backs off a failing accept (out of descriptors).
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let mut guard = shared.lock().unwrap();
                if guard.cut {
                    // Accept and close: "refused" without a connect timeout.
                    drop(client);
                    continue;
                }
                guard.conns.retain(|c| !c.is_finished());
                let task = tokio::spawn(relay_one(
                    client,
                    upstream.clone(),
                    shared.clone(),
                    hung.clone(),
                ));
                guard.conns.push(task.abort_handle());
            }
        });
        Relay {
            port,
            state,
            hang,
            accept,
        }
    }

    /// Stops relaying: every open connection is closed (aborting its task
    /// drops both sockets) and new ones are closed on arrival.
    pub(super) fn cut(&self) {
        let mut state = self.state.lock().unwrap();
        state.cut = true;
        for conn in state.conns.drain(..) {
            conn.abort();
        }
    }

    /// Stalls every connection, open or new, without closing any.
    fn hang(&self) {
        self.hang.send_replace(true);
    }

    /// Ends a cut or a hang: bytes a hang held go through now.
    pub(super) fn heal(&self) {
        self.state.lock().unwrap().cut = false;
        self.hang.send_replace(false);
    }

    /// Holds answers carrying result rows back by `delay` from now on.
    fn delay_rows(&self, delay: Duration) {
        self.state.lock().unwrap().row_delay = delay;
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

/// Relays one connection; the server's side in order, each chunk that
/// carries rows held back by the delay in force when it arrived; no byte
/// either way while `hung` says so.
async fn relay_one(
    client: tokio::net::TcpStream,
    upstream: String,
    state: Arc<Mutex<RelayState>>,
    hung: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // Resolves at once unless hung; the sender lives as long as the relay.
    let flowing = |mut hung: tokio::sync::watch::Receiver<bool>| async move {
        let _ = hung.wait_for(|h| !*h).await;
    };
    let up = {
        let hung = hung.clone();
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match client_read.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                flowing(hung.clone()).await;
                if server_write.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            let _ = server_write.shutdown().await;
        }
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let read = async move {
        let mut frames = PgFrames::default();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let delay = if frames.has_rows(&buf[..n]) {
                state.lock().unwrap().row_delay
            } else {
                Duration::ZERO
            };
            let due = tokio::time::Instant::now() + delay;
            if tx.send((due, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    };
    let down = async move {
        while let Some((due, chunk)) = rx.recv().await {
            // The injected fault itself: rows arrive `row_delay` late.
            tokio::time::sleep_until(due).await;
            flowing(hung.clone()).await;
            if client_write.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = client_write.shutdown().await;
    };
    tokio::join!(up, read, down);
}

/// Just enough of the PostgreSQL protocol's framing (server to client,
/// no TLS) to tell whether a chunk carries a `DataRow` message.
#[derive(Default)]
struct PgFrames {
    header: Vec<u8>,
    body_left: usize,
}

impl PgFrames {
    fn has_rows(&mut self, mut chunk: &[u8]) -> bool {
        let mut rows = false;
        while !chunk.is_empty() {
            if self.body_left > 0 {
                let n = self.body_left.min(chunk.len());
                self.body_left -= n;
                chunk = &chunk[n..];
                continue;
            }
            let n = (5 - self.header.len()).min(chunk.len());
            self.header.extend_from_slice(&chunk[..n]);
            chunk = &chunk[n..];
            if self.header.len() == 5 {
                rows |= self.header[0] == b'D';
                let len = u32::from_be_bytes(self.header[1..5].try_into().unwrap());
                self.body_left = (len as usize).saturating_sub(4);
                self.header.clear();
            }
        }
        rows
    }
}

#[test]
fn pg_framing_finds_data_rows_across_chunk_boundaries() {
    let message = |kind: u8, body: &[u8]| {
        let mut m = vec![kind];
        m.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        m.extend_from_slice(body);
        m
    };
    let ready = message(b'Z', b"I");
    let row = message(b'D', b"\0\x01\0\0\0\x05alice");
    let mut frames = PgFrames::default();
    assert!(!frames.has_rows(&ready));
    let stream = [ready.clone(), row, ready.clone()].concat();
    // Split inside the DataRow's header: the row counts where its header
    // is complete (the client cannot read it any earlier).
    let (a, b) = stream.split_at(ready.len() + 2);
    assert!(!frames.has_rows(a));
    assert!(frames.has_rows(b));
    // And in one piece, after the split-up one.
    assert!(frames.has_rows(&stream));
    assert!(!frames.has_rows(&ready));
}

/// The `host:port` a PostgreSQL URL points at.
pub(super) fn upstream_of(url: &str) -> String {
    let parsed = reqwest::Url::parse(url).unwrap();
    format!(
        "{}:{}",
        parsed.host_str().unwrap(),
        parsed.port().unwrap_or(5432)
    )
}

/// `url` pointing at `127.0.0.1:<port>` instead, without TLS (the relay
/// reads the protocol's framing).
pub(super) fn via_port(url: &str, port: u16) -> String {
    let mut parsed = reqwest::Url::parse(url).unwrap();
    parsed.set_host(Some("127.0.0.1")).unwrap();
    parsed.set_port(Some(port)).unwrap();
    parsed.query_pairs_mut().append_pair("sslmode", "disable");
    parsed.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_from_the_database_freezes_then_thaws_without_a_restart() {
    // A TTL well above fence_after, so the cut can outlast fence_after and
    // still heal before the lease runs out (TTL > 2 × renew holds).
    let timings = "ttl_ms = 6000\nrenew_ms = 1000\nfence_after_ms = 2000\n";
    let db = fresh_db().await;
    let dirs = Dirs::new();
    let instance = journal_command(&dirs.journals);

    // node-a, alone at first so both users land on it, reaches the
    // database only through the relay.
    let (relay, node_a) = start_relayed_node(dirs.path(), &db, timings, &instance).await;
    let mut nodes = vec![node_a];
    let users = ["alice", "bob"];
    let mut before = BTreeMap::new();
    for user in users {
        let (holder, epoch, pid) = launch(&nodes, 0, user).await;
        assert_eq!(holder, 0);
        before.insert(user, (epoch, pid));
    }
    for id in &IDS[1..] {
        nodes.push(start_node(dirs.path(), &db, id, timings, &instance).await);
    }
    for user in users {
        dirs.wait_lines(user, before[user].0, 2).await;
    }
    let restarts: BTreeMap<&str, Value> = {
        let mut r = BTreeMap::new();
        for user in users {
            r.insert(user, nodes[0].main_of(user).await["restarts"].clone());
        }
        r
    };

    relay.cut();
    // Past fence_after without a renew: frozen, not killed.
    for user in users {
        let pid = before[user].1;
        eventually(LONG, &format!("{user}'s instance frozen"), || async {
            stopped(pid).then_some(())
        })
        .await;
    }
    let frozen_lines: BTreeMap<&str, usize> = users
        .iter()
        .map(|u| (*u, dirs.lines_of(u, before[u].0)))
        .collect();
    assert!(
        nodes[0].metric("berth_fenced_instances_total").await >= Some(users.len() as f64),
        "each fence is counted"
    );
    relay.heal();

    // A good renew with the epoch unchanged thaws them: same processes.
    for user in users {
        let (epoch, pid) = before[user];
        eventually(LONG, &format!("{user}'s instance thawed"), || async {
            matches!(proc_state(pid), Some('S' | 'R')).then_some(())
        })
        .await;
        let main = nodes[0].main_of(user).await;
        assert_eq!(main["pid"].as_u64(), Some(u64::from(pid)), "{main}");
        assert_eq!(main["epoch"].as_i64(), Some(epoch), "{main}");
        assert_eq!(main["status"], "running", "{main}");
        assert_eq!(main["restarts"], restarts[user], "{main}");
        let row = lease_of(&nodes[1], user).await.unwrap();
        assert_eq!(row["holder"], IDS[0], "{row}");
        assert_eq!(row["epoch"].as_i64(), Some(epoch), "{row}");
        // The journal keeps counting under the same epoch, in one process.
        dirs.wait_lines(user, epoch, frozen_lines[user] + 2).await;
        let runs = dirs.journal(user);
        assert_eq!(runs.len(), 1, "{user}: {runs:?}");
        assert_eq!(runs[0].counter_resets, 0, "{user}: {runs:?}");
        assert_eq!(
            mains_everywhere(&nodes, user)
                .iter()
                .map(|(i, p, _)| (*i, *p))
                .collect::<Vec<_>>(),
            vec![(0, pid)]
        );
    }
    assert!(nodes[0].is_running());
}

/// The fencing hole: a node cut off from the database freezes
/// its instance; an operator then stops that user through the node's own
/// API. The program is killed while frozen, never thawed to act on SIGTERM:
/// its TERM handler (`--journal-on-term`, which writes one last journal
/// line, as a program flushing its state would) never runs, so it writes
/// nothing as a stale holder. It is gone, and once the lease runs out the
/// user's new holder runs the only instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_instance_stopped_through_its_cut_off_node_never_runs_again() {
    let db = fresh_db().await;
    let dirs = Dirs::new();
    let journal = format!("{}/journal-{{slug}}.log", dirs.journals.display());
    let argv = [
        BERTH,
        "demo-app",
        "--port",
        "{port}",
        "--journal",
        &journal,
        "--journal-on-term",
    ];
    let instance = format!("command = {}\n", serde_json::to_string(&argv).unwrap());
    // node-a, alone at first so alice lands on it, reaches the database
    // only through the relay.
    let (relay, node_a) = start_relayed_node(dirs.path(), &db, &lease(""), &instance).await;
    let mut nodes = vec![node_a];
    let (holder, old_epoch, old_pid) = launch(&nodes, 0, "alice").await;
    assert_eq!(holder, 0);
    for id in &IDS[1..] {
        nodes.push(start_node(dirs.path(), &db, id, &lease(""), &instance).await);
    }
    dirs.wait_lines("alice", old_epoch, 2).await;

    relay.cut();
    eventually(LONG, "alice's instance frozen", || async {
        stopped(old_pid).then_some(())
    })
    .await;
    let lines_frozen = dirs.lines_of("alice", old_epoch);

    // The operator's stop, through the cut-off node itself.
    let r = nodes[0]
        .http
        .delete(nodes[0].api("/users/alice/instance"))
        .bearer_auth(&nodes[0].token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204, "{:?}", r.text().await);
    eventually(LONG, "the frozen instance gone", || async {
        (!alive(u64::from(old_pid))).then_some(())
    })
    .await;
    assert_eq!(
        dirs.lines_of("alice", old_epoch),
        lines_frozen,
        "the frozen instance ran again (its TERM handler wrote) after it was frozen"
    );
    assert!(instance_pids(&nodes[0].data_dir, "alice", "main").is_empty());

    // The lease runs out; another node takes alice over (node-a's heartbeat
    // stopped with the cut: the evidence).
    let survivors = [1, 2];
    let (new, main) = moved(&nodes, &survivors, "alice", old_epoch).await;
    let new_epoch = main["epoch"].as_i64().unwrap();
    dirs.wait_lines("alice", new_epoch, 2).await;
    relay.heal();
    let lines = dirs.lines_of("alice", new_epoch);
    dirs.wait_lines("alice", new_epoch, lines + 2).await;
    let runs = dirs.journal("alice");
    assert_eq!(
        runs.iter().map(|r| r.epoch as i64).collect::<Vec<_>>(),
        vec![old_epoch, new_epoch],
        "{runs:?}"
    );
    assert_eq!(dirs.lines_of("alice", old_epoch), lines_frozen);
    let running = mains_everywhere(&nodes, "alice");
    assert_eq!(running.len(), 1, "{running:?}");
    assert_eq!(running[0].0, new);
    assert_eq!(main["pid"].as_u64(), Some(u64::from(running[0].1)));
    assert!(nodes[0].is_running());
}

// --- 4b. a node's database answers arrive late ---------------------------------

/// Context switches of all a process's threads: they move only when it
/// runs, so a frozen process's count stands still until it is thawed (or
/// killed).
fn switches(pid: u32) -> Option<u64> {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let status = std::fs::read_to_string(task.ok()?.path().join("status")).ok()?;
        for line in status.lines() {
            let count = line
                .strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| line.strip_prefix("nonvoluntary_ctxt_switches:"));
            if let Some(count) = count {
                total += count.trim().parse::<u64>().ok()?;
            }
        }
    }
    Some(total)
}

/// node-a of [`a_late_renew_answer_does_not_thaw_an_instance_whose_lease_moved`]:
/// it listens where the test can reach it but advertises an address where
/// nobody answers, so its peers cannot reach it.
async fn start_unreachable(root: &Path, db: &str, instance: &str) -> Node {
    let dir = root.join(IDS[0]);
    std::fs::create_dir_all(&dir).unwrap();
    let advertise = format!(
        "advertise_url = \"http://127.0.0.1:{}\"\n",
        support::free_port()
    );
    let config = dir.join("berth.toml");
    berth_testkit::write_private(
        &config,
        &support::cluster_config_custom(&dir, db, IDS[0], SECRET, &lease(""), instance, &advertise),
        None,
    );
    let listen = format!("127.0.0.1:{}", support::free_port());
    let mut node = tokio::task::spawn_blocking(move || {
        let args = [
            "serve",
            "--config",
            config.to_str().unwrap(),
            "--listen",
            &listen,
        ];
        let mut node = Node::from(
            support::berth()
                .node(&dir)
                .args(&args, &dir.join("data"))
                .start(),
        );
        // It printed the address it advertises.
        node.url = format!("http://{listen}");
        node
    })
    .await
    .unwrap();
    let (status, _) = node.get("/nodes").await;
    assert_eq!(status, 200);
    node.http = reqwest::Client::new();
    node
}

/// A renew that ran in the database but whose answer arrives after the
/// TTL proves nothing any more: another node may hold the lease by then.
/// The late "renewed" must neither thaw the frozen instance nor extend its
/// shim's deadline (ARCHITECTURE.md, invariant 3: the fence clock runs
/// from when the renew was *sent*).
///
/// node-a reaches PostgreSQL through a relay that holds back answers with
/// result rows (the renew's `RETURNING`) longer than the TTL, and
/// advertises an address nobody answers, so no fence message from the
/// new holder can reach it first: a node partitioned from its peers on a
/// slow link to the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_renew_answer_does_not_thaw_an_instance_whose_lease_moved() {
    let db = fresh_db().await;
    let dirs = Dirs::new();
    let instance = journal_command(&dirs.journals);
    let relay = Relay::start(upstream_of(&db)).await;
    let mut nodes =
        vec![start_unreachable(dirs.path(), &via_port(&db, relay.port), &instance).await];
    let (holder, old_epoch, old_pid) = launch(&nodes, 0, "alice").await;
    assert_eq!(holder, 0);
    for id in &IDS[1..] {
        nodes.push(start_node(dirs.path(), &db, id, &lease(""), &instance).await);
    }
    dirs.wait_lines("alice", old_epoch, 2).await;

    // Twice the TTL: a renew that runs now is answered long after the
    // lease it extended ran out.
    relay.delay_rows(2 * TTL);
    let watcher = &nodes[1];
    let (new_holder, new_epoch) = eventually(LONG, "alice's lease claimed elsewhere", || async {
        let row = lease_of(watcher, "alice").await?;
        let epoch = row["epoch"].as_i64()?;
        (epoch > old_epoch).then(|| (row["holder"].as_str().unwrap().to_owned(), epoch))
    })
    .await;
    assert_ne!(new_holder, IDS[0]);
    // Frozen, or already being killed by its shim: the shim's own
    // deadline (a TTL from the last renew sent) falls about when the new
    // holder's claim does. Either way it runs none of its own code any
    // more, and the journal check below proves it wrote nothing.
    assert!(stopped_or_gone(old_pid), "{:?}", proc_state(old_pid));
    let frozen_at = switches(old_pid);
    let lines_frozen = dirs.lines_of("alice", old_epoch);

    // Until node-a learns that it lost the lease and kills its instance,
    // that instance must not run for a moment: it stays stopped, and it is
    // never scheduled (its context switches stand still). Its kill wakes it
    // once more to exit (it shows `R` for that moment), so leaving the
    // stopped state ends the watch; the journal below proves it wrote
    // nothing on the way out (a thawed demo-app writes at once: its missed
    // ticks fire together).
    eventually(LONG, "the old instance no longer stopped", || async {
        let before = stopped(old_pid);
        let count = switches(old_pid);
        let after = stopped(old_pid);
        if !(before && after) {
            return Some(());
        }
        assert_eq!(
            count, frozen_at,
            "the old instance ran (thawed) while {new_holder} holds epoch {new_epoch}"
        );
        None
    })
    .await;
    eventually(LONG, "the old instance reaped", || async {
        (!alive(u64::from(old_pid))).then_some(())
    })
    .await;
    assert_eq!(
        dirs.lines_of("alice", old_epoch),
        lines_frozen,
        "the old instance wrote after it was frozen, while {new_holder} holds epoch {new_epoch}"
    );
    relay.delay_rows(Duration::ZERO);
    let new = index_of(&new_holder);
    let main = nodes[new]
        .running_main("alice", Some(u64::from(old_pid)))
        .await;
    assert_eq!(main["epoch"].as_i64(), Some(new_epoch), "{main}");
    dirs.wait_lines("alice", new_epoch, 2).await;
    let runs = dirs.journal("alice");
    assert_eq!(
        runs.iter().map(|r| r.epoch as i64).collect::<Vec<_>>(),
        vec![old_epoch, new_epoch],
        "{runs:?}"
    );
    assert!(nodes[0].is_running());
}

// --- 5. PostgreSQL restarts under load --------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_restart_under_load_leaves_one_running_instance_per_user() {
    let pg = tokio::task::spawn_blocking(PgCluster::start_throwaway)
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("no PostgreSQL for the restart test: {e}"));
    let pg = Arc::new(pg);
    let db = pg.fresh_database().await;
    let dirs = Dirs::new();
    let instance = journal_command(&dirs.journals);
    let timings = lease("");

    // Nodes join one at a time, each new one getting the next users, so
    // every node runs instances (placement prefers the emptiest node).
    let users: Vec<String> = (0..6).map(|i| format!("u{i}")).collect();
    let mut nodes: Vec<Node> = Vec::new();
    let mut epochs = BTreeMap::new();
    for (n, id) in IDS.iter().enumerate() {
        nodes.push(start_node(dirs.path(), &db, id, &timings, &instance).await);
        for user in &users[2 * n..2 * n + 2] {
            let (holder, epoch, _) = launch(&nodes, n, user).await;
            assert_eq!(holder, n, "{user} placed on {}", IDS[holder]);
            epochs.insert(user.clone(), epoch);
        }
        // Others see this node's load before the next one joins.
        eventually(LONG, "the load heartbeat", || async {
            let (_, body) = nodes[0].get("/nodes").await;
            body["nodes"]
                .as_array()?
                .iter()
                .any(|r| r["id"] == *id && r["load"].as_u64() == Some(2))
                .then_some(())
        })
        .await;
        // No wait beyond that: a placement reads the nodes' loads in the
        // store, in the transaction that reserves its place.
    }

    // A client that keeps asking for and launching users through every
    // node, errors and all, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let answers = Arc::new(Mutex::new(BTreeMap::<String, usize>::new()));
    let client = {
        let stop = stop.clone();
        let answers = answers.clone();
        let targets: Vec<(String, String)> = nodes
            .iter()
            .map(|n| (n.url.clone(), n.token.clone()))
            .collect();
        let users = users.clone();
        tokio::spawn(async move {
            let http = reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap();
            let mut round = 0usize;
            while !stop.load(Ordering::Relaxed) {
                for (u, user) in users.iter().enumerate() {
                    let (url, token) = &targets[(u + round) % targets.len()];
                    let path = format!("{url}/api/v1/users/{user}/instance");
                    let request = if round.is_multiple_of(2) {
                        http.get(&path)
                    } else {
                        http.post(&path).json(&json!({}))
                    };
                    let key = match request.bearer_auth(token).send().await {
                        Ok(r) => r.status().as_u16().to_string(),
                        Err(_) => "transport error".to_owned(),
                    };
                    *answers.lock().unwrap().entry(key).or_default() += 1;
                }
                round += 1;
                // Paces the load: steady traffic, not a flood.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    // The client is under way before the first fault.
    wait_for_answers(&answers, &BTreeMap::new()).await;

    // A quick restart: `restart` is stop -m fast + start, so nothing
    // committed is lost.
    let before = client_answers(&answers);
    let restarting = pg.clone();
    tokio::task::spawn_blocking(move || restarting.restart())
        .await
        .unwrap()
        .expect("PostgreSQL restarts");
    let epochs = recovered(&nodes, &dirs, &users, &epochs).await;
    wait_for_answers(&answers, &before).await;

    // A long one: down until the nodes' instances freeze (past fence_after,
    // maybe past the TTL), then up again. Same checks.
    let before = client_answers(&answers);
    let stopping = pg.clone();
    tokio::task::spawn_blocking(move || stopping.stop())
        .await
        .unwrap()
        .expect("PostgreSQL stops");
    eventually(
        LONG,
        "instances frozen while the database is down",
        || async {
            users
                .iter()
                .flat_map(|u| mains_everywhere(&nodes, u))
                .any(|(_, _, state)| state == 'T')
                .then_some(())
        },
    )
    .await;
    let starting = pg.clone();
    tokio::task::spawn_blocking(move || starting.start_again())
        .await
        .unwrap()
        .expect("PostgreSQL starts again");
    recovered(&nodes, &dirs, &users, &epochs).await;
    wait_for_answers(&answers, &before).await;

    stop.store(true, Ordering::Relaxed);
    client.await.unwrap();
    eprintln!("client answers: {:?}", client_answers(&answers));
    for node in &nodes {
        assert!(node.is_running(), "{} exited", node.url);
    }
    drop(nodes);
    tokio::task::spawn_blocking(move || drop(pg)).await.unwrap();
}

/// What the load client has seen so far, by status.
fn client_answers(answers: &Mutex<BTreeMap<String, usize>>) -> BTreeMap<String, usize> {
    answers.lock().unwrap().clone()
}

/// Waits until the load client got more 200s than in `before`: the API
/// answers again.
async fn wait_for_answers(
    answers: &Mutex<BTreeMap<String, usize>>,
    before: &BTreeMap<String, usize>,
) {
    let ok = |m: &BTreeMap<String, usize>| m.get("200").copied().unwrap_or(0);
    eventually(LONG, "the API answering the client again", || async {
        (ok(&client_answers(answers)) > ok(before) + 6).then_some(())
    })
    .await;
}

/// After the database came back: every user has exactly one instance,
/// running (thawed if it was frozen) and matching the store, under the
/// same epoch unless the TTL passed and it moved; every lease is renewed
/// again by the node running the user; the journals show one writer at a
/// time; every node lives and answers `/healthz`. Returns the epochs.
async fn recovered(
    nodes: &[Node],
    dirs: &Dirs,
    users: &[String],
    epochs: &BTreeMap<String, i64>,
) -> BTreeMap<String, i64> {
    let mut now = BTreeMap::new();
    for user in users {
        let (node, pid) = eventually(LONG, &format!("{user}: one running instance"), || async {
            let mains = mains_everywhere(nodes, user);
            match mains.as_slice() {
                [(i, pid, state)] if !matches!(state, 'T' | 'Z') => Some((*i, *pid)),
                _ => None,
            }
        })
        .await;
        let main = eventually(LONG, &format!("{user}'s record"), || async {
            let main = nodes[(node + 1) % 3].main_of(user).await;
            (main["status"] == "running"
                && main["node"] == IDS[node]
                && main["pid"].as_u64() == Some(u64::from(pid)))
            .then_some(main)
        })
        .await;
        let epoch = main["epoch"].as_i64().unwrap();
        if epoch != epochs[user] {
            eprintln!(
                "{user} moved to {} while the database was away: {main}",
                IDS[node]
            );
        }
        now.insert(user.clone(), epoch);
    }
    // Renewals continue: every lease moves forward again.
    let mut snapshot = BTreeMap::new();
    for user in users {
        snapshot.insert(user.clone(), lease_of(&nodes[0], user).await.unwrap());
    }
    for user in users {
        let row = eventually(LONG, &format!("{user}'s lease renewed"), || async {
            let row = lease_of(&nodes[0], user).await?;
            (row["lease_until"].as_i64() > snapshot[user]["lease_until"].as_i64()).then_some(row)
        })
        .await;
        let mains = mains_everywhere(nodes, user);
        assert_eq!(mains.len(), 1, "{user}: {mains:?}");
        assert_ne!(mains[0].2, 'T', "{user}: {mains:?}");
        assert_eq!(row["holder"], IDS[mains[0].0], "{user}: {row}");
        assert_eq!(row["epoch"].as_i64(), Some(now[user]), "{user}: {row}");
        dirs.wait_lines(user, now[user], 1).await;
        let runs = dirs.journal(user);
        assert_eq!(
            runs.last().map(|r| r.epoch as i64),
            Some(now[user]),
            "{user}: {runs:?}"
        );
    }
    for node in nodes {
        assert!(node.is_running(), "{} exited", node.url);
        assert_eq!(node.healthz().await, 200);
    }
    now
}

// --- hibernation and fencing: two reasons to be frozen -----------------------

/// alice is hibernated on node-a (asked through node-b: it reaches the
/// owner). node-a is then cut from the database past `fence_after`, so the
/// fence freezes her too, and heals: its renews succeed again under the
/// same epoch, which lifts the fence but not the hibernation, so she stays
/// frozen and writes nothing. A request through node-b is forwarded to
/// node-a and resumes her: the same process, its memory intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_then_recovered_node_keeps_a_hibernated_instance_frozen_until_a_request() {
    let timings = "ttl_ms = 6000\nrenew_ms = 1000\nfence_after_ms = 2000\n";
    let db = fresh_db().await;
    let dirs = Dirs::new();
    let instance = journal_command(&dirs.journals);
    let (relay, node_a) = start_relayed_node(dirs.path(), &db, timings, &instance).await;
    let mut nodes = vec![node_a];
    let (holder, epoch, pid) = launch(&nodes, 0, "alice").await;
    assert_eq!(holder, 0);
    nodes.push(start_node(dirs.path(), &db, IDS[1], timings, &instance).await);
    dirs.wait_lines("alice", epoch, 2).await;
    let count = |node: &Node| {
        let request = node
            .http
            .get(format!("{}/u/alice/counter", node.url))
            .bearer_auth(&node.token)
            .timeout(LONG)
            .send();
        async move {
            let r = request.await.expect("berth answers");
            assert_eq!(r.status(), 200);
            let body: Value = r.json().await.unwrap();
            (
                body["count"].as_u64().unwrap(),
                body["pid"].as_u64().unwrap(),
            )
        }
    };
    assert_eq!(count(&nodes[0]).await, (1, u64::from(pid)));

    let (status, body) = nodes[1]
        .post("/users/alice/instance/hibernate", json!({}))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["instance"]["status"], "hibernated", "{body}");
    assert_eq!(body["instance"]["node"], IDS[0], "{body}");
    eventually(LONG, "alice frozen", || async {
        stopped(pid).then_some(())
    })
    .await;
    let lines = dirs.lines_of("alice", epoch);

    // Cut past fence_after: node-a fences (freezing what is frozen already).
    let fenced = nodes[0]
        .metric("berth_fenced_instances_total")
        .await
        .unwrap_or(0.0);
    relay.cut();
    eventually(LONG, "node-a fences alice", || async {
        (nodes[0]
            .metric("berth_fenced_instances_total")
            .await
            .unwrap_or(0.0)
            > fenced)
            .then_some(())
    })
    .await;
    relay.heal();
    // Two renews of the same epoch after the heal: the fence is lifted.
    for _ in 0..2 {
        let before = lease_of(&nodes[1], "alice").await.unwrap()["lease_until"].clone();
        eventually(LONG, "a renew after the heal", || async {
            let row = lease_of(&nodes[1], "alice").await?;
            (row["lease_until"] != before && row["epoch"].as_i64() == Some(epoch)).then_some(())
        })
        .await;
    }
    assert!(stopped(pid), "a renew never thaws a hibernated instance");
    assert_eq!(
        dirs.lines_of("alice", epoch),
        lines,
        "frozen, alice wrote nothing"
    );
    assert_eq!(nodes[1].status_of("alice").await, "hibernated");

    // A request through node-b resumes her on node-a: the same process.
    assert_eq!(count(&nodes[1]).await, (2, u64::from(pid)));
    assert!(!stopped(pid));
    dirs.wait_lines("alice", epoch, lines + 1).await;
    let main = nodes[0].main_of("alice").await;
    assert_eq!(main["restarts"], 0, "{main}");
    assert_eq!(main["epoch"].as_i64(), Some(epoch), "{main}");
    eventually(LONG, "alice recorded running", || async {
        (nodes[1].status_of("alice").await == "running").then_some(())
    })
    .await;
    assert_eq!(
        mains_everywhere(&nodes, "alice")
            .iter()
            .map(|(i, p, _)| (*i, *p))
            .collect::<Vec<_>>(),
        vec![(0, pid)]
    );
}

/// A request never thaws a fenced instance, even one it resumes from
/// hibernation, and even on the node that holds it while that node is
/// still cut off. Hibernated, then fenced by the cut, alice is asked for
/// through her own node: the request lifts the hibernation, but the fence
/// remains, so the program stays frozen. Its context switches stand still
/// (they move only when it runs). Only after the heal, when a renew proves
/// the lease, does the same process run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_to_a_fenced_instance_leaves_it_frozen_while_the_link_stays_cut() {
    let timings = "ttl_ms = 6000\nrenew_ms = 1000\nfence_after_ms = 2000\n";
    let db = fresh_db().await;
    let dirs = Dirs::new();
    let instance = journal_command(&dirs.journals);
    let (relay, node_a) = start_relayed_node(dirs.path(), &db, timings, &instance).await;
    let nodes = [node_a];
    let (holder, epoch, pid) = launch(&nodes, 0, "alice").await;
    assert_eq!(holder, 0);
    dirs.wait_lines("alice", epoch, 2).await;

    let (status, body) = nodes[0]
        .post("/users/alice/instance/hibernate", json!({}))
        .await;
    assert_eq!(status, 200, "{body}");
    eventually(LONG, "alice frozen", || async {
        stopped(pid).then_some(())
    })
    .await;
    relay.cut();
    eventually(LONG, "node-a fences alice", || async {
        (nodes[0].metric("berth_fenced_instances_total").await >= Some(1.0)).then_some(())
    })
    .await;
    assert!(
        nodes[0].metric("berth_lease_renew_failures_total").await >= Some(1.0),
        "the renews the cut failed are counted"
    );
    let lines = dirs.lines_of("alice", epoch);
    let switched = switches(pid).expect("alice's program is there");

    // However the request ends (berth's error, or the client giving up),
    // the frozen program cannot have answered it.
    let answer = nodes[0]
        .http
        .get(format!("{}/u/alice/counter", nodes[0].url))
        .bearer_auth(&nodes[0].token)
        .timeout(Duration::from_secs(3))
        .send()
        .await;
    assert!(
        !matches!(&answer, Ok(r) if r.status().is_success()),
        "a frozen program answered: {answer:?}"
    );
    assert!(stopped(pid), "the request thawed a fenced instance");
    assert_eq!(
        switches(pid),
        Some(switched),
        "the fenced program ran while the link was cut"
    );
    assert_eq!(dirs.lines_of("alice", epoch), lines);
    // The request's activity cannot be recorded while the link is cut.
    eventually(LONG, "a failed activity flush counted", || async {
        (nodes[0].metric("berth_controller_store_errors_total").await >= Some(1.0)).then_some(())
    })
    .await;

    relay.heal();
    // The hibernation was lifted by the request; a renew lifts the fence.
    eventually(LONG, "alice thawed by a renew", || async {
        (!stopped(pid)).then_some(())
    })
    .await;
    dirs.wait_lines("alice", epoch, lines + 1).await;
    let main = nodes[0].main_of("alice").await;
    assert_eq!(main["pid"].as_u64(), Some(u64::from(pid)), "{main}");
    assert_eq!(main["epoch"].as_i64(), Some(epoch), "{main}");
    assert_eq!(main["restarts"], 0, "{main}");
}

// --- 4c. a cut-off node's instance, every process of it --------------------------

/// `support/escapes.py`: three processes that leave the program's group and
/// write `<epoch> <kind> <n>` every 10 ms, one a new process per line.
const ESCAPES: &str = include_str!("support/escapes.py");

/// The demo app with its journal, started by a shell that first lets the
/// [`ESCAPES`] loose on `<dir>/escapes-<slug>.log`.
fn escapes_command(dir: &Path) -> String {
    let journal = format!("{}/journal-{{slug}}.log", dir.display());
    let escapes = format!("{}/escapes-{{slug}}.log", dir.display());
    let argv = [
        "/bin/sh",
        "-c",
        "python3 -c \"$4\" \"$3\" & exec \"$0\" demo-app --port \"$1\" --journal \"$2\"",
        BERTH,
        "{port}",
        &journal,
        &escapes,
        ESCAPES,
    ];
    format!("command = {}\n", serde_json::to_string(&argv).unwrap())
}

/// The epochs of an escapes journal, line by line (a last line without
/// its newline is still being written).
fn escape_epochs(dirs: &Dirs, user: &str) -> Vec<i64> {
    let text = std::fs::read_to_string(dirs.journals.join(format!("escapes-{user}.log")))
        .unwrap_or_default();
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    complete
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect()
}

/// The first line of an older epoch after a newer one: a second writer.
fn stale_write(epochs: &[i64]) -> Option<(usize, i64, i64)> {
    stale_writes(epochs).next()
}

/// Every line of an older epoch after a newer one, as (line index, its
/// epoch, the newest epoch before it).
fn stale_writes(epochs: &[i64]) -> impl Iterator<Item = (usize, i64, i64)> + '_ {
    epochs
        .iter()
        .enumerate()
        .scan(i64::MIN, |newest, (i, &epoch)| {
            let stale = (epoch < *newest).then_some((i, epoch, *newest));
            *newest = (*newest).max(epoch);
            Some(stale)
        })
        .flatten()
}

#[test]
fn a_stale_write_is_found_in_an_escapes_journal() {
    assert_eq!(stale_write(&[3, 3, 4, 4]), None);
    assert_eq!(stale_write(&[3, 4, 3, 4]), Some((2, 3, 4)));
    assert_eq!(stale_write(&[]), None);
    // Every stale line counts, also after a third epoch began.
    assert_eq!(
        stale_writes(&[3, 4, 3, 3, 5, 4, 5]).collect::<Vec<_>>(),
        vec![(2, 3, 4), (3, 3, 4), (5, 4, 5)]
    );
}

/// A node cut off from the database fences its instance at the default
/// level, and the fence holds every process of it: the `setsid` child, the
/// double-forked one and the one that forks anew for every line. Once
/// another node runs the user under a newer epoch (and its own escapes
/// have written a hundred lines), not one line of the old epoch follows;
/// once the cut heals and the old node learns it lost the lease, its
/// instance is killed frozen, and after every user is stopped not one of
/// their processes is left on any node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_holds_every_process_of_an_instance_that_left_its_group() {
    // At level `none`, the default when not root, a fence is a SIGSTOP to
    // the program's group, which a `setsid` escapes by design.
    if !support::privileged("a fence holds every process of an instance") {
        return;
    }
    let db = fresh_db().await;
    let dirs = Dirs::new();
    let instance = escapes_command(&dirs.journals);
    let (relay, node_a) = start_relayed_node(dirs.path(), &db, &lease(""), &instance).await;
    let mut nodes = vec![node_a];
    // Not `launch`: it expects one process of the instance, and this one
    // has several on purpose.
    let (status, body) = nodes[0].post("/users/alice/instance", json!({})).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["instance"]["node"], IDS[0], "{body}");
    let old_epoch = body["instance"]["epoch"].as_i64().unwrap();
    for id in &IDS[1..] {
        nodes.push(start_node(dirs.path(), &db, id, &lease(""), &instance).await);
    }
    eventually(LONG, "alice's escapes writing", || async {
        (escape_epochs(&dirs, "alice").len() >= 30).then_some(())
    })
    .await;

    relay.cut();
    let (_, main) = moved(&nodes, &[1, 2], "alice", old_epoch).await;
    let new_epoch = main["epoch"].as_i64().unwrap();
    eventually(LONG, "the new holder's escapes writing", || async {
        let epochs = escape_epochs(&dirs, "alice");
        (epochs.iter().filter(|e| **e == new_epoch).count() >= 100).then_some(())
    })
    .await;
    let epochs = escape_epochs(&dirs, "alice");
    assert_eq!(
        stale_write(&epochs),
        None,
        "a process of the fenced instance wrote after the new holder"
    );

    relay.heal();
    eventually(LONG, "the fenced instance gone from node-a", || async {
        instance_pids(&nodes[0].data_dir, "alice", "main")
            .is_empty()
            .then_some(())
    })
    .await;
    let holder = index_of(main["node"].as_str().unwrap());
    // The account is the same on every node (the store allocates it).
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(nodes[holder].data_dir.join("run/alice/main.json")).unwrap(),
    )
    .unwrap();
    let uid = u32::try_from(state["uid"].as_u64().expect("an instance uid")).unwrap();
    assert_eq!(nodes[holder].delete("/users/alice/instance").await, 204);
    eventually(LONG, "no process of alice left on any node", || async {
        berth_local::isolation::sweep::members(uid)
            .iter()
            .all(|m| matches!(m.state, 'Z' | 'X'))
            .then_some(())
    })
    .await;
    let epochs = escape_epochs(&dirs, "alice");
    assert_eq!(
        stale_write(&epochs),
        None,
        "{:?}",
        &epochs[epochs.len().saturating_sub(20)..]
    );
}

// --- 6. every fault in a row, at the default level, with escapes ---------------

/// One fault of [`every_fault_in_a_row_leaves_no_stale_writer_and_no_process_behind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// `kill -9` of berth; its shims and programs run on. Healed by
    /// starting it again on the same data dir, as a supervisor would.
    Kill,
    /// SIGSTOP of berth (not of its shims); healed by SIGCONT.
    Pause,
    /// The node's link to the database closed (the relay cut).
    Cut,
    /// The node's link to the database stalled, nothing closed.
    Hang,
    /// PostgreSQL itself restarted at once (`stop -m fast`, then start),
    /// under every node.
    PgRestart,
    /// PostgreSQL stopped until every node has fenced every instance (past
    /// `fence_after`), then started again: each lease is renewed by its
    /// holder, which thaws it, or claimed by another node, whichever the
    /// database lets win.
    PgOutage,
}

/// The faults, in order: every kind twice. A node's fault hits the node
/// that holds the most users at that moment, and lasts until every one of
/// them runs on another node; PostgreSQL's hit every node.
const FAULT_SCRIPT: [Fault; 10] = [
    Fault::Kill,
    Fault::Pause,
    Fault::Cut,
    Fault::Hang,
    Fault::PgRestart,
    Fault::Hang,
    Fault::Kill,
    Fault::PgOutage,
    Fault::Cut,
    Fault::Pause,
];

/// Users of the fault run.
const FAULT_RUN_USERS: usize = 8;

/// Escape lines each moved user's new instance writes before the fault is
/// healed: time for a stale writer to show itself.
const NEW_HOLDER_LINES: usize = 100;

/// Kills, when dropped, every process left of the accounts in its range,
/// frozen or not: a failing fault run (or one run without the protection
/// it tests) must not leave escapes forking on the machine. Dropped after
/// the nodes, which thaw and kill their cgroups first.
pub(super) struct AccountSweep(pub(super) std::ops::Range<u32>);

impl Drop for AccountSweep {
    fn drop(&mut self) {
        let uids: std::collections::BTreeSet<u32> = support::processes_of_uids(self.0.clone())
            .into_iter()
            .map(|(_, uid)| uid)
            .collect();
        for uid in uids {
            berth_local::isolation::sweep::kill_all(uid);
        }
    }
}

/// Every user's main, running and ready on a node in `up`, not frozen, as
/// a node in `up` records it.
async fn settled(nodes: &[Node], up: &[usize], users: &[String]) -> BTreeMap<String, Value> {
    let mut mains = BTreeMap::new();
    for user in users {
        let main = eventually(LONG, &format!("{user} running"), || async {
            for &i in up {
                let main = nodes[i].main_of(user).await;
                let node = main["node"]
                    .as_str()
                    .and_then(|n| IDS.iter().position(|i| *i == n));
                let pid = main["pid"].as_u64().and_then(|p| u32::try_from(p).ok());
                if main["status"] == "running"
                    && main["ready"] == true
                    && node.is_some_and(|n| up.contains(&n))
                    && pid.is_some_and(|p| alive(u64::from(p)) && !frozen(p))
                {
                    return Some(main);
                }
            }
            None
        })
        .await;
        mains.insert(user.clone(), main);
    }
    mains
}

/// Waits until every user's lease has been renewed past where it stood
/// when this was called, as `asker` lists them: the nodes reach the
/// database again.
async fn renewing(asker: &Node, users: &[String]) {
    let mut before = BTreeMap::new();
    for user in users {
        before.insert(
            user,
            lease_of(asker, user).await.unwrap()["lease_until"].clone(),
        );
    }
    for user in users {
        eventually(LONG, &format!("{user}'s lease renewed"), || async {
            let row = lease_of(asker, user).await?;
            (row["lease_until"].as_i64() > before[user].as_i64()).then_some(())
        })
        .await;
    }
}

/// Traffic while the faults happen: a client that asks every user's app
/// for a page and launches every user in turn, through every node (the
/// addresses in `targets`, kept current as killed nodes start again),
/// until `stop`. Answers are counted by status.
fn traffic(
    targets: Arc<Mutex<Vec<(String, String)>>>,
    users: Vec<String>,
    stop: Arc<AtomicBool>,
    answers: Arc<Mutex<BTreeMap<String, usize>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        // A paused node answers nothing: the client gives up on it soon.
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        let mut round = 0usize;
        while !stop.load(Ordering::Relaxed) {
            for (u, user) in users.iter().enumerate() {
                let (url, token) = {
                    let targets = targets.lock().unwrap();
                    targets[(u + round) % targets.len()].clone()
                };
                let request = if round.is_multiple_of(3) {
                    http.post(format!("{url}/api/v1/users/{user}/instance"))
                        .json(&json!({}))
                } else {
                    http.get(format!("{url}/u/{user}/"))
                };
                let key = match request.bearer_auth(token).send().await {
                    Ok(r) => r.status().as_u16().to_string(),
                    Err(_) => "transport error".to_owned(),
                };
                *answers.lock().unwrap().entry(key).or_default() += 1;
            }
            round += 1;
            // Paces the load: steady traffic, not a flood.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

/// The stale lines of one escapes journal: how many, and the first as
/// (line, epoch, newest epoch before it).
struct StaleLines {
    count: usize,
    first: (usize, i64, i64),
}

/// What the users' journals (escapes and demo app) show so far.
struct Journals {
    /// Lines read.
    lines: usize,
    /// Per user with any: the escape lines that came from an older epoch
    /// after a newer one.
    stale: BTreeMap<String, StaleLines>,
    /// Two writers in a demo-app journal, as [`check_journal`] says.
    two_writers: Vec<String>,
}

impl Journals {
    fn read(dirs: &Dirs, users: &[String]) -> Journals {
        let mut journals = Journals {
            lines: 0,
            stale: BTreeMap::new(),
            two_writers: Vec::new(),
        };
        for user in users {
            let epochs = escape_epochs(dirs, user);
            journals.lines += epochs.len();
            if let Some(first) = stale_write(&epochs) {
                let count = stale_writes(&epochs).count();
                journals
                    .stale
                    .insert(user.clone(), StaleLines { count, first });
            }
            match check_journal(&dirs.journal_text(user)) {
                Ok(runs) => journals.lines += runs.iter().map(|r| r.lines).sum::<usize>(),
                Err(e) => journals
                    .two_writers
                    .push(format!("{user}'s demo journal: {e}")),
            }
        }
        journals
    }

    fn stale_lines(&self) -> usize {
        self.stale.values().map(|s| s.count).sum()
    }

    fn assert_one_writer_at_a_time(&self, when: &str) {
        let stale: Vec<String> = self
            .stale
            .iter()
            .map(|(user, s)| {
                let (line, epoch, newer) = s.first;
                format!(
                    "{user}: {} lines, the first at line {line}: epoch {epoch} after {newer}",
                    s.count
                )
            })
            .collect();
        assert!(
            stale.is_empty() && self.two_writers.is_empty(),
            "{when}: {} stale-epoch lines of {} users: {stale:?}; {:?}",
            self.stale_lines(),
            self.stale.len(),
            self.two_writers
        );
    }
}

/// Three nodes share one PostgreSQL at the default isolation level (`user`,
/// as root), each reaching it through a relay of its own. Every one of
/// eight users runs the demo app with [`ESCAPES`]: a `setsid` child, a
/// double-forked one and one that forks anew for every line, each
/// appending its epoch to the user's escapes journal every 10 ms. While a
/// client keeps asking for and launching the users through every node,
/// [`FAULT_SCRIPT`] runs: the busiest node killed, paused, cut from the
/// database and hung from it, each until its users run elsewhere under a
/// newer epoch and wrote there, then healed (the killed node started
/// again); PostgreSQL restarted, and stopped until every instance is
/// fenced.
///
/// The evidence: after every fault, in no user's journal (the escapes'
/// and the demo app's) does a line of an older epoch follow one of a
/// newer epoch; the client never got an internal error; and once every
/// user is stopped and every node shut down, no process of any instance
/// account and no instance cgroup is left on the machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_in_a_row_leaves_no_stale_writer_and_no_process_behind() {
    // Level `user`, as its escapes need (see above), is root's default.
    if !support::privileged("every fault in a row") {
        return;
    }
    let began = std::time::Instant::now();
    let pg = tokio::task::spawn_blocking(PgCluster::start_throwaway)
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("no PostgreSQL for the fault run: {e}"));
    let pg = Arc::new(pg);
    let db = pg.fresh_database().await;
    let dirs = Dirs::new();
    let instance = escapes_command(&dirs.journals);
    // Accounts of the test's own: other tests of this binary run at once
    // on the default range. Per run as well, so zombies an earlier run
    // left on a host whose init never reaps count against nothing here.
    let base_uid = 300_000 + std::process::id() % 100 * 1000;
    let uids = base_uid..base_uid + 1000;
    let isolation = format!("[isolation]\nbase_uid = {base_uid}\nuid_count = 1000\n");
    let _sweep = AccountSweep(uids.clone());
    let mut relays = Vec::new();
    let mut nodes = Vec::new();
    for id in IDS {
        let relay = Relay::start(upstream_of(&db)).await;
        let via = via_port(&db, relay.port);
        nodes.push(start_node_with(dirs.path(), &via, id, &lease(""), &instance, &isolation).await);
        relays.push(relay);
    }
    let users: Vec<String> = (0..FAULT_RUN_USERS).map(|i| format!("f{i}")).collect();
    for (i, user) in users.iter().enumerate() {
        let (status, body) = nodes[i % 3]
            .post(&format!("/users/{user}/instance"), json!({}))
            .await;
        assert_eq!(status, 201, "{user}: {body}");
    }
    let all = [0, 1, 2];
    settled(&nodes, &all, &users).await;

    let stop = Arc::new(AtomicBool::new(false));
    let answers = Arc::new(Mutex::new(BTreeMap::<String, usize>::new()));
    let targets = Arc::new(Mutex::new(
        nodes
            .iter()
            .map(|n| (n.url.clone(), n.token.clone()))
            .collect::<Vec<_>>(),
    ));
    let client = traffic(
        targets.clone(),
        users.clone(),
        stop.clone(),
        answers.clone(),
    );

    let mut moves = 0;
    for fault in FAULT_SCRIPT {
        let before = settled(&nodes, &all, &users).await;
        if matches!(fault, Fault::PgRestart | Fault::PgOutage) {
            let pg = pg.clone();
            if fault == Fault::PgRestart {
                tokio::task::spawn_blocking(move || pg.restart())
                    .await
                    .unwrap()
                    .expect("PostgreSQL restarts");
            } else {
                let stopping = pg.clone();
                tokio::task::spawn_blocking(move || stopping.stop())
                    .await
                    .unwrap()
                    .expect("PostgreSQL stops");
                for (user, main) in &before {
                    let pid = u32::try_from(main["pid"].as_u64().unwrap()).unwrap();
                    eventually(LONG, &format!("{user} fenced"), || async {
                        stopped_or_gone(pid).then_some(())
                    })
                    .await;
                }
                tokio::task::spawn_blocking(move || pg.start_again())
                    .await
                    .unwrap()
                    .expect("PostgreSQL starts again");
            }
            settled(&nodes, &all, &users).await;
            renewing(&nodes[0], &users).await;
            eprintln!("fault {fault:?}: every node reaches the database again");
            Journals::read(&dirs, &users).assert_one_writer_at_a_time(&format!("after {fault:?}"));
            continue;
        }
        let mut load = [0usize; 3];
        for main in before.values() {
            load[index_of(main["node"].as_str().unwrap())] += 1;
        }
        let target = (0..3).max_by_key(|i| load[*i]).unwrap();
        let others: Vec<usize> = all.into_iter().filter(|i| *i != target).collect();
        let moving: Vec<(&String, i64, u32)> = before
            .iter()
            .filter(|(_, main)| main["node"] == IDS[target])
            .map(|(user, main)| {
                let epoch = main["epoch"].as_i64().unwrap();
                let pid = u32::try_from(main["pid"].as_u64().unwrap()).unwrap();
                (user, epoch, pid)
            })
            .collect();
        let mut paused = None;
        match fault {
            Fault::Kill => nodes[target].kill9(),
            Fault::Pause => {
                let pid = nodes[target].pid().unwrap();
                signal(pid, Signal::SIGSTOP);
                paused = Some(PauseGuard(pid));
            }
            Fault::Cut => relays[target].cut(),
            Fault::Hang => relays[target].hang(),
            Fault::PgRestart | Fault::PgOutage => unreachable!("handled above"),
        }
        for &(user, old_epoch, old_pid) in &moving {
            let (_, main) = moved(&nodes, &others, user, old_epoch).await;
            // The old instance was frozen before the lease could move.
            assert!(
                stopped_or_gone(old_pid),
                "{user}'s instance on {} runs while {main} holds it: {:?}",
                IDS[target],
                proc_state(old_pid)
            );
            let new_epoch = main["epoch"].as_i64().unwrap();
            eventually(LONG, &format!("{user}'s new escapes writing"), || async {
                let epochs = escape_epochs(&dirs, user);
                (epochs.iter().filter(|e| **e == new_epoch).count() >= NEW_HOLDER_LINES)
                    .then_some(())
            })
            .await;
            moves += 1;
        }
        match fault {
            Fault::Kill => {
                tokio::task::block_in_place(|| nodes[target].restart());
                targets.lock().unwrap()[target] =
                    (nodes[target].url.clone(), nodes[target].token.clone());
            }
            Fault::Pause => drop(paused.take()),
            _ => relays[target].heal(),
        }
        // Back, the node learns that its leases moved and ends what it
        // ran: killed frozen, never thawed.
        for &(user, _, old_pid) in &moving {
            eventually(LONG, &format!("{user}'s old instance ended"), || async {
                (!alive(u64::from(old_pid))).then_some(())
            })
            .await;
        }
        eprintln!(
            "fault {fault:?} of {}: {} users moved",
            IDS[target],
            moving.len()
        );
        Journals::read(&dirs, &users)
            .assert_one_writer_at_a_time(&format!("after {fault:?} of {}", IDS[target]));
    }
    settled(&nodes, &all, &users).await;
    stop.store(true, Ordering::Relaxed);
    client.await.unwrap();
    let answers = client_answers(&answers);
    assert!(answers.get("200").copied().unwrap_or(0) > 0, "{answers:?}");
    // A node away is a moment's condition the client retries (503), not
    // an internal error.
    assert!(!answers.contains_key("500"), "{answers:?}");

    // Every user stopped, through whichever node; then every node shut down.
    for (i, user) in users.iter().enumerate() {
        let status = nodes[i % 3]
            .delete(&format!("/users/{user}/instance"))
            .await;
        assert_eq!(status, 204, "{user}");
    }
    for user in &users {
        eventually(LONG, &format!("{user} stopped"), || async {
            let status = nodes[0].status_of(user).await;
            matches!(status.as_str(), "stopped" | "none").then_some(())
        })
        .await;
    }
    for node in &mut nodes {
        let status = tokio::task::block_in_place(|| node.terminate());
        assert!(status.success(), "{}: {status}", node.url);
    }
    // What a stop leaves is gone once its shim has exited; the wait only
    // bounds that.
    let leftovers = || {
        let processes = support::processes_of_uids(uids.clone());
        let cgroups: Vec<PathBuf> = nodes
            .iter()
            .flat_map(|n| support::instance_cgroups(&n.data_dir))
            .collect();
        (processes, cgroups)
    };
    support::poll_until(Duration::from_secs(30), || async {
        let (processes, cgroups) = leftovers();
        (processes.is_empty() && cgroups.is_empty()).then_some(())
    })
    .await;
    let (processes, cgroups) = leftovers();

    let journals = Journals::read(&dirs, &users);
    eprintln!(
        "fault run: {} faults, {moves} moves, {} journal lines checked, {} stale lines ({} \
         users), {} processes and {} cgroups left, {:.0?}; client answers {answers:?}",
        FAULT_SCRIPT.len(),
        journals.lines,
        journals.stale_lines(),
        journals.stale.len(),
        processes.len(),
        cgroups.len(),
        began.elapsed(),
    );
    journals.assert_one_writer_at_a_time("at the end");
    assert!(
        processes.is_empty() && cgroups.is_empty(),
        "left after every user was stopped and every node shut down: processes (pid, uid) \
         {processes:?}, cgroups {cgroups:?}"
    );
    drop(nodes);
    tokio::task::spawn_blocking(move || drop(pg)).await.unwrap();
}
