//! The soak: users launched, stopped, crashed, hibernated, resumed and
//! asked for pages and WebSocket echoes at random, for minutes, on one
//! node and on three nodes that are killed, paused and cut from their
//! database meanwhile; and the invariants checked all along, not only at
//! the end.
//!
//! Every operation comes from a seeded generator: the seed is printed, and
//! `BERTH_SOAK_SEED` replays its choices. `BERTH_SOAK_SECS` is how long each of
//! the two soaks runs (150 s by default: the suite runs both, five minutes
//! of soak). A long run sets it, and `BERTH_SOAK_FIRST_PORT` (19000 by
//! default) to keep its ports and accounts apart from a suite running at
//! the same time. `BERTH_SOAK_BINARY` runs another `berth` binary.
//!
//! Checked continuously ([`World::check`], after every operation):
//!
//! - **one live instance per user**: of the main processes found under
//!   every node's data dir, at most one per user runs (not frozen, not
//!   killed), looked at twice to rule out a scan that straddles a move;
//!   no user's demo-app journal has a line of an older epoch after one of
//!   a newer epoch (two writers); and the store, as any node lists it,
//!   has at most one live main record per user;
//! - **nothing left behind**: no process of the soak's accounts whose
//!   parent is not a shim, no shim whose program is gone, no instance
//!   cgroup whose shim is gone, no port-guard element of an account with
//!   nothing running on that node, and no running main the store does not
//!   record. A stop or crash takes a moment to be cleaned up, and a paused
//!   node cannot clean up at all, so each of these counts only once it has
//!   lasted [`GRACE`];
//! - **no growth** ([`flatness`]): berth's descriptors, resident memory
//!   and tasks (and its zygote's descriptors), sampled a dozen times a
//!   run or once a minute, the late samples against the early ones. Only
//!   node-c is ever killed, so node-a and node-b are judged over the
//!   whole run.
//!
//! A violation is printed when it is found, the run goes on, and the test
//! fails at the end with all of them, after the table of samples.

use crate::cluster_faults::{
    AccountSweep, Dirs, IDS, PauseGuard, Relay, SECRET, check_journal, fresh_db, journal_command,
    killed, lease, upstream_of, via_port,
};
use crate::support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use support::{
    Node, StartOptions, alive, frozen, instance_of, processes_of_uids, rss_kib, signal, zygote_of,
};
use tokio_tungstenite::tungstenite::Message;

/// How long an orphan may last before it counts: longer than the longest
/// fault (a paused node cleans nothing up) plus a stop's own cleanup.
const GRACE: Duration = Duration::from_secs(30);
/// Users per soak.
const USERS: usize = 6;
/// Resource samples: the first once every user has run, then a dozen over
/// the run, or one a minute if that is more often.
const SAMPLES: u32 = 12;
/// A client call's bound: a paused node answers nothing, and the soak
/// must go on.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound for start-up and the final clean-up; only a hang reaches it.
const LONG: Duration = Duration::from_secs(90);

/// A small seeded generator (SplitMix64): a run is replayed from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// A number in `[0, 1)`.
    fn fraction(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A duration in `[lo, hi)` milliseconds.
    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next() % (hi - lo))
    }
}

fn seed(soak: &str) -> u64 {
    let seed = std::env::var("BERTH_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("soak {soak}: seed {seed} (BERTH_SOAK_SEED={seed} replays it)");
    seed
}

fn duration() -> Duration {
    let secs = std::env::var("BERTH_SOAK_SECS")
        .ok()
        .map(|s| {
            s.parse::<u64>()
                .expect("BERTH_SOAK_SECS is a number of seconds")
        })
        .unwrap_or(150);
    Duration::from_secs(secs)
}

/// The soak's ports: the one node's 50 from the first, then 50 for each
/// cluster node. Below the testkit's blocks (from 20000), so a soak never
/// shares a port with the other tests, even in another test process.
/// The `berth` binary the soak runs: `BERTH_SOAK_BINARY` (a copy of
/// another build, say, kept apart from rebuilds during a long run, or one
/// broken on purpose), else the one cargo built with this test.
fn binary() -> String {
    std::env::var("BERTH_SOAK_BINARY").unwrap_or_else(|_| support::BERTH.to_owned())
}

fn berth() -> berth_testkit::Berth {
    berth_testkit::Berth::new(binary())
}

/// Every user's program: the demo app of [`binary`], writing its journal.
fn instance_command(journals: &Path) -> String {
    journal_command(journals).replace(support::BERTH, &binary())
}

fn first_port() -> u16 {
    std::env::var("BERTH_SOAK_FIRST_PORT")
        .ok()
        .map(|s| s.parse().expect("BERTH_SOAK_FIRST_PORT is a port"))
        .unwrap_or(19_000)
}

/// The soak's accounts (`which`: 0 the one node, 1 the cluster): above
/// every other test's (the testkit's end below 130 000 000), apart for
/// each first port, and per run (zombies an earlier run left on a host
/// whose init never reaps count against nothing here).
fn base_uid(which: u32) -> u32 {
    140_000_000
        + (u32::from(first_port()) - 16_000) * 1000
        + std::process::id() % 100 * 10_000
        + which * 1000
}

fn port_range(first: u16) -> String {
    format!("port_range = [{first}, {}]", first + 49)
}

/// Tables every soak node has: its accounts, crashes restarted at once and
/// never judged a crash loop (the soak crashes on purpose), and no idle
/// reaping (the soak hibernates and stops by itself).
fn common_tables(uid: u32) -> String {
    format!(
        "[isolation]\nbase_uid = {uid}\nuid_count = 1000\n\n\
         [crash]\nbackoff_base_ms = 100\nbackoff_max_ms = 500\nmax_restarts_in_window = 1000000\n\
         window_s = 1\n\n\
         [reap]\ninterval_s = 1\nidle_ttl_s = 0\nhibernate_after_s = 0\nstop_after_s = 0\n"
    )
}

/// Where a node's log goes (kept out of the test's output: an hour of it
/// is long), and the level: berth's info lines.
fn logged(dir: &Path) -> StartOptions {
    StartOptions {
        env: vec![("RUST_LOG".to_owned(), "info".to_owned())],
        stderr: Some(dir.join("berth.log")),
        ..StartOptions::default()
    }
}

// --- the world: nodes, users, and what is checked -----------------------------

/// One node as the soak sees it.
struct Member {
    node: Node,
    /// Its relay to the database (cluster nodes).
    relay: Option<Relay>,
}

/// A fault in force, healed at `until`.
enum Fault {
    Paused(usize, PauseGuard),
    Cut(usize),
    Killed(usize),
}

/// What the operations got back, by kind and answer.
type Answers = BTreeMap<String, usize>;

/// One resource sample of one node.
#[derive(Debug, Clone)]
struct Sample {
    at: Duration,
    node: usize,
    pid: u32,
    fds: usize,
    rss_kib: u64,
    tasks: usize,
    zygote_fds: usize,
    live: usize,
    ops: usize,
    violations: usize,
}

struct World {
    name: &'static str,
    members: Vec<Member>,
    users: Vec<String>,
    dirs: Dirs,
    uids: std::ops::Range<u32>,
    http: reqwest::Client,
    rng: Rng,
    began: Instant,
    ops: usize,
    answers: Answers,
    violations: Vec<String>,
    /// Orphan candidates and when each was first seen.
    suspects: HashMap<String, Instant>,
    /// Suspects already reported (each once).
    reported: BTreeSet<String>,
    last_orphan_check: Option<Instant>,
    /// Invariant checks made, and orphan suspects that were cleaned up
    /// within the grace (evidence that the orphan checks see something).
    checks: usize,
    cleared: usize,
    samples: Vec<Sample>,
    fault: Option<(Fault, Instant)>,
    next_fault: Option<Instant>,
    faults: BTreeMap<&'static str, usize>,
}

/// A main process found on the machine.
#[derive(Debug, Clone)]
struct MainProcess {
    node: usize,
    user: String,
    pid: u32,
    uid: u32,
}

fn status_field(pid: u32, field: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field).map(|v| v.trim().to_owned()))
}

fn ppid_of(pid: u32) -> Option<u32> {
    status_field(pid, "PPid:")?.parse().ok()
}

fn cmdline(pid: u32) -> Vec<u8> {
    std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default()
}

fn count_dir(path: &str) -> usize {
    std::fs::read_dir(path).map_or(0, Iterator::count)
}

/// Runs its own code: alive, neither frozen nor being killed.
fn runs(pid: u32) -> bool {
    alive(u64::from(pid)) && !frozen(pid) && !killed(pid)
}

/// The `(uid, port)` pairs in the port guard's set of the berth on
/// `data_dir`; empty when it has no table (not root, or not yet).
fn guard_pairs(data_dir: &Path) -> Vec<(u64, u64)> {
    let Ok(canonical) = data_dir.canonicalize() else {
        return Vec::new();
    };
    let table = berth_local::isolation::nft_table_name(&canonical);
    let Ok(out) = std::process::Command::new("nft")
        .args(["-j", "list", "set", "inet", &table, "own_ports"])
        .stderr(std::process::Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    listed["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|item| item["set"]["elem"].as_array())
        .flatten()
        .filter_map(|elem| {
            let pair = elem["concat"].as_array()?;
            Some((pair.first()?.as_u64()?, pair.get(1)?.as_u64()?))
        })
        .collect()
}

impl World {
    fn node(&self, i: usize) -> &Node {
        &self.members[i].node
    }

    /// The nodes that answer now (not killed, not paused).
    fn up(&self) -> Vec<usize> {
        (0..self.members.len())
            .filter(|i| match &self.fault {
                Some((Fault::Paused(n, _) | Fault::Killed(n), _)) => n != i,
                _ => true,
            })
            .collect()
    }

    fn violation(&mut self, what: String) {
        eprintln!(
            "soak {}: VIOLATION at {:.0?}: {what}",
            self.name,
            self.began.elapsed()
        );
        self.violations.push(what);
    }

    fn count(&mut self, op: &str, answer: &str) {
        *self.answers.entry(format!("{op} {answer}")).or_default() += 1;
    }

    /// Every main process of the soak's users under any node's data dir,
    /// in one pass over `/proc`.
    fn mains(&self) -> Vec<MainProcess> {
        let roots: Vec<PathBuf> = self
            .members
            .iter()
            .map(|m| {
                m.node
                    .data_dir
                    .canonicalize()
                    .unwrap_or_else(|_| m.node.data_dir.clone())
            })
            .collect();
        let mut found = Vec::new();
        for (pid, uid) in processes_of_uids(self.uids.clone()) {
            let Some(p) = instance_of(pid).filter(|p| p.role == "main") else {
                continue;
            };
            if let Some(node) = roots.iter().position(|r| p.home.starts_with(r)) {
                found.push(MainProcess {
                    node,
                    user: p.user,
                    pid,
                    uid,
                });
            }
        }
        found
    }

    /// The invariants, checked now.
    async fn check(&mut self) {
        self.checks += 1;
        let mains = self.mains();
        // One running main per user, looked at again so that a scan that
        // straddled a move (the old one frozen, then the new one started)
        // does not count.
        let mut running: BTreeMap<&str, Vec<&MainProcess>> = BTreeMap::new();
        for m in &mains {
            if runs(m.pid) {
                running.entry(&m.user).or_default().push(m);
            }
        }
        let mut found = Vec::new();
        for (user, ms) in running {
            let still: Vec<_> = ms.iter().filter(|m| runs(m.pid)).collect();
            if still.len() > 1 {
                found.push(format!(
                    "{user} runs twice: {:?}",
                    still
                        .iter()
                        .map(|m| (IDS[m.node], m.pid))
                        .collect::<Vec<_>>()
                ));
            }
        }
        for user in &self.users {
            if let Err(e) = check_journal(&self.dirs.journal_text(user)) {
                found.push(format!("{user}'s journal: {e}"));
            }
        }
        for f in found {
            if self.reported.insert(f.clone()) {
                self.violation(f);
            }
        }
        let due = self
            .last_orphan_check
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
        if due {
            self.last_orphan_check = Some(Instant::now());
            self.check_orphans(&mains).await;
        }
    }

    /// What should be gone and is not, and what runs untracked: each a
    /// suspect, a violation once it has lasted [`GRACE`].
    async fn check_orphans(&mut self, mains: &[MainProcess]) {
        let mut suspects = BTreeSet::new();
        let shim_like = |pid: u32| {
            let line = cmdline(pid);
            line.windows(5).any(|w| w == b"shim\0") || line.ends_with(b"shim")
        };
        // Processes of the accounts whose parent is no shim.
        for (pid, uid) in processes_of_uids(self.uids.clone()) {
            let parent = ppid_of(pid);
            if !parent.is_some_and(|p| alive(u64::from(p)) && shim_like(p)) {
                suspects.insert(format!(
                    "process {pid} of account {uid} outside any shim (parent {parent:?}): {:?}",
                    String::from_utf8_lossy(&cmdline(pid))
                ));
            }
        }
        for (i, member) in self.members.iter().enumerate() {
            let data_dir = &member.node.data_dir;
            // Shims whose program is gone, from the state files.
            for path in std::fs::read_dir(data_dir.join("run"))
                .into_iter()
                .flatten()
                .flatten()
                .flat_map(|slug| std::fs::read_dir(slug.path()).into_iter().flatten())
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "json"))
            {
                let Ok(text) = std::fs::read_to_string(&path) else {
                    continue;
                };
                let Ok(state) = serde_json::from_str::<Value>(&text) else {
                    continue;
                };
                let shim = state["shim_pid"].as_u64().unwrap_or(0);
                let program = state["pid"].as_u64().unwrap_or(0);
                if shim != 0 && alive(shim) && (program == 0 || !alive(program)) {
                    suspects.insert(format!(
                        "{}: shim {shim} runs without its program {program} ({})",
                        IDS[i],
                        path.display()
                    ));
                }
            }
            // Cgroups whose shim is gone.
            for leaf in support::instance_cgroups(data_dir) {
                let name = leaf.file_name().unwrap().to_string_lossy().into_owned();
                // Named `<instance>.<role>.<shim pid>`.
                let shim = name
                    .rsplit_once('.')
                    .and_then(|(_, pid)| pid.parse::<u32>().ok());
                if !shim.is_some_and(|s| alive(u64::from(s))) {
                    suspects.insert(format!(
                        "{}: cgroup {} outlives its shim",
                        IDS[i],
                        leaf.display()
                    ));
                }
            }
            // Port-guard pairs of accounts with nothing running here.
            for (uid, port) in guard_pairs(data_dir) {
                let here = mains
                    .iter()
                    .any(|m| m.node == i && u64::from(m.uid) == uid && alive(u64::from(m.pid)));
                if !here {
                    suspects.insert(format!(
                        "{}: port guard pair {uid} . {port} with no instance of that account",
                        IDS[i]
                    ));
                }
            }
        }
        // Running mains the store does not record, and more than one live
        // record per user, as some node that answers lists them.
        let up = self.up();
        if !up.is_empty() {
            let asker = up[self.rng.below(up.len())];
            let node = self.node(asker);
            let listed = self
                .http
                .get(node.api("/instances"))
                .bearer_auth(&node.token)
                .timeout(CALL_TIMEOUT)
                .send()
                .await;
            let listed = match listed {
                Ok(r) if r.status() == 200 => r.json::<Value>().await.ok(),
                _ => None,
            };
            if let Some(listed) = listed {
                let records: Vec<&Value> = listed["instances"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|r| r["role"] == "main")
                    .collect();
                let mut live: BTreeMap<&str, usize> = BTreeMap::new();
                for r in &records {
                    if matches!(
                        r["status"].as_str(),
                        Some("starting" | "running" | "hibernated" | "crashed")
                    ) {
                        *live.entry(r["user"].as_str().unwrap_or("?")).or_default() += 1;
                    }
                }
                let mut found = Vec::new();
                for (user, n) in live {
                    if n > 1 {
                        found.push(format!("{user} has {n} live main records"));
                    }
                }
                for f in found {
                    if self.reported.insert(f.clone()) {
                        self.violation(f);
                    }
                }
                for m in mains {
                    let recorded = records.iter().any(|r| {
                        r["user"] == m.user.as_str()
                            && r["node"] == IDS[m.node]
                            && r["pid"].as_u64() == Some(u64::from(m.pid))
                    });
                    if !recorded && runs(m.pid) {
                        suspects.insert(format!(
                            "{}'s main {} runs on {} and no record names it",
                            m.user, m.pid, IDS[m.node]
                        ));
                    }
                }
            }
        }
        let now = Instant::now();
        let before = self.suspects.len();
        self.suspects.retain(|s, _| suspects.contains(s));
        self.cleared += before - self.suspects.len();
        let mut overdue = Vec::new();
        for s in suspects {
            let since = *self.suspects.entry(s.clone()).or_insert(now);
            if now - since >= GRACE && self.reported.insert(s.clone()) {
                overdue.push(s);
            }
        }
        for s in overdue {
            self.violation(format!("for {GRACE:?}: {s}"));
        }
    }

    /// One resource sample of every node that runs now.
    fn sample(&mut self) {
        let live = self
            .mains()
            .iter()
            .map(|m| m.user.clone())
            .collect::<BTreeSet<_>>()
            .len();
        for i in 0..self.members.len() {
            let Some(pid) = self.node(i).pid() else {
                continue;
            };
            if !alive(u64::from(pid)) {
                continue;
            }
            let sample = Sample {
                at: self.began.elapsed(),
                node: i,
                pid,
                fds: count_dir(&format!("/proc/{pid}/fd")),
                rss_kib: rss_kib(pid).unwrap_or(0),
                tasks: count_dir(&format!("/proc/{pid}/task")),
                zygote_fds: zygote_of(pid).map_or(0, |z| count_dir(&format!("/proc/{z}/fd"))),
                live,
                ops: self.ops,
                violations: self.violations.len(),
            };
            eprintln!("soak {}: sample {sample:?}", self.name);
            self.samples.push(sample);
        }
    }

    // --- operations ---------------------------------------------------------

    /// A node to send a call to: any that answers.
    fn via(&mut self) -> usize {
        let up = self.up();
        up[self.rng.below(up.len())]
    }

    async fn call(&mut self, op: &str, request: reqwest::RequestBuilder) -> Option<u16> {
        let (answer, body) = match request.timeout(CALL_TIMEOUT).send().await {
            Ok(r) => {
                let status = r.status().as_u16();
                (Some(status), r.text().await.unwrap_or_default())
            }
            Err(_) => (None, String::new()),
        };
        let key = answer.map_or_else(|| "no answer".to_owned(), |s| s.to_string());
        self.count(op, &key);
        if answer == Some(500) {
            self.violation(format!("{op}: an internal error: {body}"));
        }
        answer
    }

    async fn operate(&mut self) {
        let user = self.users[self.rng.below(self.users.len())].clone();
        let via = self.via();
        let (url, token) = (self.node(via).url.clone(), self.node(via).token.clone());
        let api = |path: &str| format!("{url}/api/v1/users/{user}/instance{path}");
        let roll = self.rng.below(100);
        match roll {
            0..40 => {
                let r = self
                    .http
                    .get(format!("{url}/u/{user}/counter"))
                    .bearer_auth(&token);
                self.call("request", r).await;
            }
            40..50 => self.websocket(&url, &token, &user).await,
            50..60 => {
                let r = self.http.post(api("")).bearer_auth(&token).json(&json!({}));
                self.call("launch", r).await;
            }
            60..70 => {
                let r = self.http.delete(api("")).bearer_auth(&token);
                self.call("stop", r).await;
            }
            70..80 => {
                let r = self
                    .http
                    .post(api("/hibernate"))
                    .bearer_auth(&token)
                    .json(&json!({}));
                self.call("hibernate", r).await;
            }
            80..90 => {
                let r = self
                    .http
                    .post(api("/resume"))
                    .bearer_auth(&token)
                    .json(&json!({}));
                self.call("resume", r).await;
            }
            _ => {
                // A crash: the running program killed, as if it died.
                let target = self
                    .mains()
                    .into_iter()
                    .find(|m| m.user == user && runs(m.pid));
                match target {
                    Some(m) => {
                        signal(m.pid, Signal::SIGKILL);
                        self.count("crash", "killed");
                    }
                    None => self.count("crash", "nothing running"),
                }
            }
        }
        self.ops += 1;
    }

    /// A WebSocket through the proxy: three echoes, then closed.
    async fn websocket(&mut self, url: &str, token: &str, user: &str) {
        let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
        let path = format!("/u/{user}/ws");
        let exchange = async {
            let mut ws = support::websocket(addr, &path, token)
                .await
                .map_err(|e| format!("handshake: {e}"))?;
            for i in 0..3 {
                let text = format!("m{i}");
                ws.send(Message::text(text.clone()))
                    .await
                    .map_err(|e| format!("send: {e}"))?;
                match ws.next().await {
                    Some(Ok(Message::Text(t))) if t.as_str() == text => {}
                    other => return Err(format!("echo: {other:?}")),
                }
            }
            let _ = ws.close(None).await;
            Ok::<(), String>(())
        };
        let answer = match tokio::time::timeout(CALL_TIMEOUT, exchange).await {
            Ok(Ok(())) => "echoed".to_owned(),
            Ok(Err(e)) if e.starts_with("handshake: HTTP error: 5") => e,
            Ok(Err(_)) => "failed".to_owned(),
            Err(_) => "no answer".to_owned(),
        };
        self.count("websocket", &answer);
    }

    // --- faults (the cluster) -----------------------------------------------

    /// Heals a fault whose time is up, or starts one when one is due.
    fn faults(&mut self) {
        let Some(next) = self.next_fault else {
            return;
        };
        match self.fault.take() {
            Some((fault, until)) if Instant::now() >= until => {
                match fault {
                    Fault::Paused(_, guard) => drop(guard),
                    Fault::Cut(i) => self.members[i].relay.as_ref().unwrap().heal(),
                    Fault::Killed(i) => {
                        let dir = self.node(i).dir.clone();
                        tokio::task::block_in_place(|| {
                            self.members[i].node.restart_with(&logged(&dir));
                        });
                    }
                }
                self.next_fault = Some(Instant::now() + self.rng.millis(10_000, 25_000));
            }
            Some(fault) => self.fault = Some(fault),
            None if Instant::now() >= next => {
                let mut target = self.rng.below(self.members.len());
                // Long enough for the leases to move (past the TTL of 3 s),
                // or not (a cut shorter than the fence).
                let hold = self.rng.millis(1_000, 8_000);
                let fault = match self.rng.below(3) {
                    0 => {
                        // Only node-c is killed: node-a and node-b live the
                        // whole run, so their resources are judged over it.
                        target = 2;
                        self.members[target].node.kill9();
                        *self.faults.entry("kill").or_default() += 1;
                        Fault::Killed(target)
                    }
                    1 => {
                        let pid = self.node(target).pid().unwrap();
                        signal(pid, Signal::SIGSTOP);
                        *self.faults.entry("pause").or_default() += 1;
                        Fault::Paused(target, PauseGuard(pid))
                    }
                    _ => {
                        self.members[target].relay.as_ref().unwrap().cut();
                        *self.faults.entry("database cut").or_default() += 1;
                        Fault::Cut(target)
                    }
                };
                self.fault = Some((fault, Instant::now() + hold));
            }
            None => {}
        }
    }

    // --- the run --------------------------------------------------------------

    async fn run(&mut self, length: Duration) {
        // Every user once, so the first sample sees them all started.
        for user in self.users.clone() {
            let via = self.via();
            let node = self.node(via);
            let r = self
                .http
                .post(node.api(&format!("/users/{user}/instance")))
                .bearer_auth(&node.token)
                .json(&json!({}));
            assert_eq!(self.call("launch", r).await, Some(201), "{user}");
        }
        let every = (length / SAMPLES).min(Duration::from_secs(60));
        let mut next_sample = Instant::now();
        let end = self.began + length;
        while Instant::now() < end {
            if Instant::now() >= next_sample {
                self.sample();
                // Jittered, so that the samples never keep step with a
                // periodic sweep (idle connections closed every so often)
                // and see only its low or high points.
                next_sample = Instant::now() + every.mul_f64(0.75 + 0.5 * self.rng.fraction());
            }
            self.faults();
            self.operate().await;
            self.check().await;
            // Paces the load: steady, not a flood.
            tokio::time::sleep(self.rng.millis(20, 80)).await;
        }
        // The last fault healed, and a last sample.
        if let Some((_, until)) = &mut self.fault {
            *until = Instant::now();
        }
        self.faults();
        self.next_fault = None;
        self.sample();
    }

    /// Stops every user, then waits for nothing to be left: processes,
    /// cgroups, port-guard pairs; then shuts every node down.
    async fn finish(&mut self) {
        for user in self.users.clone() {
            let node = self.node(0);
            let r = self
                .http
                .delete(node.api(&format!("/users/{user}/instance")))
                .bearer_auth(&node.token);
            let status = self.call("final stop", r).await;
            if status != Some(204) {
                self.violation(format!("the final stop of {user}: {status:?}"));
            }
        }
        let leftovers = |w: &World| {
            let processes = processes_of_uids(w.uids.clone());
            let cgroups: Vec<PathBuf> = w
                .members
                .iter()
                .flat_map(|m| support::instance_cgroups(&m.node.data_dir))
                .collect();
            let pairs: Vec<(u64, u64)> = w
                .members
                .iter()
                .flat_map(|m| guard_pairs(&m.node.data_dir))
                .collect();
            (processes, cgroups, pairs)
        };
        let clean = support::poll_until(LONG, || async {
            let (p, c, n) = leftovers(self);
            (p.is_empty() && c.is_empty() && n.is_empty()).then_some(())
        })
        .await;
        if clean.is_none() {
            let left = leftovers(self);
            self.violation(format!(
                "left once every user was stopped: processes {:?}, cgroups {:?}, pairs {:?}",
                left.0, left.1, left.2
            ));
        }
        for member in &mut self.members {
            let status = tokio::task::block_in_place(|| member.node.terminate());
            if !status.success() {
                eprintln!("soak {}: a node exited with {status}", self.name);
            }
        }
    }

    /// The samples as a table, per node, and the flatness verdicts.
    fn report(&mut self) {
        eprintln!(
            "soak {}: {} operations and {} checks in {:.0?}; {} orphan suspects cleaned up \
             within {GRACE:?}; faults {:?}; answers {:?}",
            self.name,
            self.ops,
            self.checks,
            self.began.elapsed(),
            self.cleared,
            self.faults,
            self.answers
        );
        eprintln!(
            "| node | minute | fds | RSS MiB | tasks | zygote fds | users live | operations | violations |"
        );
        eprintln!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        for s in &self.samples {
            eprintln!(
                "| {} | {:.1} | {} | {:.1} | {} | {} | {} | {} | {} |",
                IDS[s.node],
                s.at.as_secs_f64() / 60.0,
                s.fds,
                s.rss_kib as f64 / 1024.0,
                s.tasks,
                s.zygote_fds,
                s.live,
                s.ops,
                s.violations
            );
        }
        for (i, id) in IDS.iter().enumerate().take(self.members.len()) {
            // A killed node starts again as a new process: judged per pid,
            // where it lived long enough to have early and late samples.
            let mut pids: Vec<u32> = self
                .samples
                .iter()
                .filter(|s| s.node == i)
                .map(|s| s.pid)
                .collect();
            pids.dedup();
            for pid in pids {
                let of: Vec<&Sample> = self
                    .samples
                    .iter()
                    .filter(|s| s.node == i && s.pid == pid)
                    .collect();
                match flatness(&of) {
                    Ok(Some(verdict)) => {
                        eprintln!("soak {}: {} (pid {pid}) flat: {verdict}", self.name, id);
                    }
                    Ok(None) => {}
                    Err(e) => self.violation(format!("{} (pid {pid}) grows: {e}", id)),
                }
            }
        }
    }
}

/// Whether a node's samples are flat: the smallest of the last third may
/// exceed the largest of the first third by at most
///
/// - 64 descriptors: connections open at the moment of a sample (clients,
///   the pool's, the database's) come and go by a few dozen; a leak of one
///   per request passes that within seconds of traffic;
/// - a quarter plus 16 MiB of resident memory: the allocator's arenas
///   settle unevenly; a leak of a kilobyte per operation passes that
///   within an hour;
/// - 8 tasks: blocking-pool threads live for seconds after their work.
///
/// Smallest late against largest early, so a moment's spike on either side
/// does not count, and a leak, which only grows, does. `None`: too few
/// samples of this process to judge (a node killed early).
/// A measure: its name, how a sample gives it, and its bound.
type Measure = (&'static str, fn(&Sample) -> u64, fn(u64) -> u64);

fn flatness(samples: &[&Sample]) -> Result<Option<String>, String> {
    if samples.len() < 6 {
        return Ok(None);
    }
    let third = samples.len() / 3;
    let (early, late) = (&samples[..third], &samples[samples.len() - third..]);
    let early_max = |f: fn(&Sample) -> u64| early.iter().map(|s| f(s)).max().unwrap();
    let late_min = |f: fn(&Sample) -> u64| late.iter().map(|s| f(s)).min().unwrap();
    let checks: [Measure; 4] = [
        ("fds", |s| s.fds as u64, |e| e + 64),
        ("RSS KiB", |s| s.rss_kib, |e| e + e / 4 + 16 * 1024),
        ("tasks", |s| s.tasks as u64, |e| e + 8),
        ("zygote fds", |s| s.zygote_fds as u64, |e| e + 64),
    ];
    let mut verdict = Vec::new();
    for (name, field, bound) in checks {
        let (e, l) = (early_max(field), late_min(field));
        if l > bound(e) {
            return Err(format!(
                "{name}: at least {l} late, at most {e} early (bound {})",
                bound(e)
            ));
        }
        verdict.push(format!("{name} {e} → {l}"));
    }
    Ok(Some(verdict.join(", ")))
}

#[test]
fn flatness_catches_growth_and_forgives_spikes() {
    let sample = |fds: usize, rss_kib: u64, tasks: usize| Sample {
        at: Duration::ZERO,
        node: 0,
        pid: 1,
        fds,
        rss_kib,
        tasks,
        zygote_fds: 5,
        live: 0,
        ops: 0,
        violations: 0,
    };
    let flat: Vec<Sample> = (0..12)
        .map(|i| sample(40 + i % 3 * 10, 30_000 + i as u64 % 2 * 4000, 12))
        .collect();
    let mut spiky = flat.clone();
    spiky[10].fds = 500;
    spiky[1].tasks = 40;
    for ok in [&flat, &spiky] {
        assert!(flatness(&ok.iter().collect::<Vec<_>>()).unwrap().is_some());
    }
    let leaking: Vec<Sample> = (0..12).map(|i| sample(40 + i * 20, 30_000, 12)).collect();
    let err = flatness(&leaking.iter().collect::<Vec<_>>()).unwrap_err();
    assert!(err.starts_with("fds"), "{err}");
    let swelling: Vec<Sample> = (0..12)
        .map(|i| sample(40, 30_000 + i as u64 * 8000, 12))
        .collect();
    assert!(
        flatness(&swelling.iter().collect::<Vec<_>>())
            .unwrap_err()
            .starts_with("RSS")
    );
    assert_eq!(flatness(&flat[..5].iter().collect::<Vec<_>>()), Ok(None));
}

// --- the two soaks ----------------------------------------------------------------

fn new_world(
    name: &'static str,
    members: Vec<Member>,
    dirs: Dirs,
    uid: u32,
    prefix: &str,
) -> World {
    let seed = seed(name);
    World {
        name,
        members,
        users: (0..USERS).map(|i| format!("{prefix}{i}")).collect(),
        dirs,
        uids: uid..uid + 1000,
        http: reqwest::Client::new(),
        rng: Rng(seed),
        began: Instant::now(),
        ops: 0,
        answers: Answers::new(),
        violations: Vec::new(),
        suspects: HashMap::new(),
        reported: BTreeSet::new(),
        last_orphan_check: None,
        checks: 0,
        cleared: 0,
        samples: Vec::new(),
        fault: None,
        next_fault: None,
        faults: BTreeMap::new(),
    }
}

async fn soak(mut world: World) {
    let length = duration();
    eprintln!(
        "soak {}: {length:?}, {} users, {} nodes, accounts {:?}",
        world.name,
        world.users.len(),
        world.members.len(),
        world.uids
    );
    world.run(length).await;
    world.finish().await;
    world.report();
    assert!(
        world.violations.is_empty(),
        "soak {}: {} violations: {:#?}",
        world.name,
        world.violations.len(),
        world.violations
    );
}

/// One node on SQLite, at the isolation level root gets (`user`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_one_node() {
    if !support::privileged("soak_one_node") {
        return;
    }
    let dirs = Dirs::new();
    let uid = base_uid(0);
    let _sweep = AccountSweep(uid..uid + 1000);
    let dir = dirs.path().join(IDS[0]);
    let config = support::config_with(
        &dir.join("data"),
        &format!(
            "[instance]\n{}\n{}\n{}",
            port_range(first_port()),
            instance_command(&dirs.journals),
            common_tables(uid)
        ),
    );
    let node = tokio::task::spawn_blocking(move || {
        Node::from(
            berth()
                .node(&dir)
                .config(&config)
                .options(logged(&dir))
                .start(),
        )
    })
    .await
    .unwrap();
    let members = vec![Member { node, relay: None }];
    soak(new_world("one node", members, dirs, uid, "s")).await;
}

/// Three nodes on one PostgreSQL, each through a relay that can be cut;
/// every 10 to 25 s one node is killed (and started again), paused, or cut
/// from the database, for 1 to 8 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_three_nodes_with_faults() {
    if !support::privileged("soak_three_nodes_with_faults") {
        return;
    }
    let db = fresh_db().await;
    let dirs = Dirs::new();
    let uid = base_uid(1);
    let _sweep = AccountSweep(uid..uid + 1000);
    let mut members = Vec::new();
    for (i, id) in IDS.iter().enumerate() {
        let relay = Relay::start(upstream_of(&db)).await;
        let via = via_port(&db, relay.port);
        let dir = dirs.path().join(id);
        let config = support::cluster_config_custom(
            &dir,
            &via,
            id,
            SECRET,
            &lease(""),
            &instance_command(&dirs.journals),
            &common_tables(uid),
        );
        // The soak's own ports in place of the testkit's block.
        let first = first_port() + 50 * (1 + i as u16);
        let config = config
            .lines()
            .map(|l| {
                if l.starts_with("port_range = ") {
                    port_range(first)
                } else {
                    l.to_owned()
                }
            })
            .collect::<Vec<_>>()
            .join("\n");
        let node = tokio::task::spawn_blocking(move || {
            Node::from(
                berth()
                    .node(&dir)
                    .config(&config)
                    .options(logged(&dir))
                    .start(),
            )
        })
        .await
        .unwrap();
        members.push(Member {
            node,
            relay: Some(relay),
        });
    }
    let mut world = new_world("three nodes", members, dirs, uid, "c");
    world.next_fault = Some(Instant::now() + Duration::from_secs(10));
    soak(world).await;
}
