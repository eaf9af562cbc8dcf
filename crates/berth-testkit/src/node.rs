//! A real `berth serve` for end-to-end tests: started on a loopback port
//! with its own data dir, driven over HTTP, and cleaned up when dropped.
//!
//! The `berth` binary is passed in ([`Berth::new`]): only the `berth`
//! crate's own tests know where cargo built it (`CARGO_BIN_EXE_berth`),
//! and this crate must not depend on that binary crate.
//!
//! Every instance a [`Node`] started is killed when the node is dropped,
//! through the shims' state files, so no test leaves a process behind.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Once;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::Value;

use crate::process::{alive, kill_instances_under, signal};
use crate::wait::eventually;

/// A config file body with the test's listen address (a free loopback
/// port) and data dir filled in, plus `extra` TOML.
pub fn config_with(data_dir: &Path, extra: &str) -> String {
    format!(
        "listen = \"127.0.0.1:0\"\ndata_dir = \"{}\"\n{extra}\n",
        data_dir.display()
    )
}

/// An instance account range (first uid, count) of its own for `key` (a
/// store, or a data dir): every berth on a host registers its range, and
/// one whose range overlaps a live berth's on another store is refused, so
/// berths a test process runs at once each need their own. The same key
/// gets the same range again (a restarted node keeps its accounts), and
/// test processes run one after another get different ones (a host whose
/// init never reaps keeps an earlier run's zombies, which count against
/// their account's process limit). A process may ask for 1000 ranges.
pub fn accounts_for(key: &str) -> (u32, u32) {
    static KEYS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut keys = KEYS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let n = match keys.iter().position(|k| k == key) {
        Some(n) => n,
        None => {
            keys.push(key.to_owned());
            keys.len() - 1
        }
    };
    // Past the 1000 ranges of a run, two keys would share one: refused,
    // never wrapped around.
    let n = u32::try_from(n)
        .ok()
        .filter(|&n| n < 1000)
        .unwrap_or_else(|| panic!("more than 1000 account ranges in one test process ({key})"));
    let run = std::process::id() % 100;
    (30_000_000 + run * 1_000_000 + n * 1000, 1000)
}

/// `config` with `[isolation] base_uid` and `uid_count` from
/// [`accounts_for`]`(key)`, unless it sets `base_uid` itself.
pub fn with_own_accounts(config: &str, key: &str) -> String {
    if config.contains("base_uid") {
        return config.to_owned();
    }
    let (first, count) = accounts_for(key);
    let keys = format!("base_uid = {first}\nuid_count = {count}\n");
    match config.find("[isolation]\n") {
        Some(i) => {
            let at = i + "[isolation]\n".len();
            format!("{}{keys}{}", &config[..at], &config[at..])
        }
        None => format!("{config}\n[isolation]\n{keys}"),
    }
}

/// Lease timings short enough for tests to see expiry and failover in
/// seconds (TTL > 2 × renew, fence_after < TTL).
pub const CLUSTER_LEASE: &str = "ttl_ms = 3000\nrenew_ms = 1000\nfence_after_ms = 2000\n";

/// A config body for one node of a cluster on `pg_url`: its own data dir
/// under `dir`, a port range of its own (nodes on one host must not race
/// for ports), short lease timings plus `lease_extra` (e.g. `takeover =
/// "manual"`), and `extra` TOML (top-level keys or whole tables, but not
/// `[lease]` or `[instance]`).
pub fn cluster_config(
    dir: &Path,
    pg_url: &str,
    node_id: &str,
    secret: &str,
    lease_extra: &str,
    extra: &str,
) -> String {
    // 150 ports per node: a login storm puts up to 90 users on one.
    let first = crate::port_block(150);
    let last = first + 149;
    // The nodes of one cluster share its store, and so its accounts.
    with_own_accounts(
        &format!(
            "store = \"{pg_url}\"\nnode_id = \"{node_id}\"\ncluster_secret = \"{secret}\"\n{}\n\
             [instance]\nport_range = [{first}, {last}]\n\n[lease]\n{CLUSTER_LEASE}{lease_extra}\n",
            config_with(&dir.join("data"), extra)
        ),
        pg_url,
    )
}

/// [`cluster_config`] with its `[lease]` timings replaced by `lease` (whole
/// `key = value` lines, e.g. a longer TTL) and `instance` lines added to
/// its `[instance]` table (e.g. a `command`). The port block still comes
/// from [`cluster_config`], so nodes made either way never share ports.
///
/// # Panics
///
/// When `extra` holds an `[instance]` table of its own.
pub fn cluster_config_custom(
    dir: &Path,
    pg_url: &str,
    node_id: &str,
    secret: &str,
    lease: &str,
    instance: &str,
    extra: &str,
) -> String {
    let base = cluster_config(dir, pg_url, node_id, secret, "", extra);
    assert_eq!(
        base.matches(CLUSTER_LEASE).count(),
        1,
        "cluster_config changed shape: {base}"
    );
    assert_eq!(
        base.matches("[instance]\n").count(),
        1,
        "`extra` must not hold an [instance] table: {extra}"
    );
    base.replacen(CLUSTER_LEASE, lease, 1).replacen(
        "[instance]\n",
        &format!("[instance]\n{instance}"),
        1,
    )
}

/// How to run the `berth` binary: its path, and environment variables to
/// add to every process started through it.
#[derive(Debug, Clone)]
pub struct Berth {
    bin: PathBuf,
    env: Vec<(OsString, OsString)>,
}

impl Berth {
    /// `bin` is the `berth` executable (`env!("CARGO_BIN_EXE_berth")` in
    /// the `berth` crate's tests).
    pub fn new(bin: impl Into<PathBuf>) -> Self {
        Self {
            bin: bin.into(),
            env: Vec::new(),
        }
    }

    /// Adds `key=value` to the environment of every process started
    /// through this value (nodes, and their client commands).
    #[must_use]
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// The `berth` executable this value runs.
    pub fn bin(&self) -> &Path {
        &self.bin
    }

    /// A command running the binary, with this value's environment.
    pub fn command(&self) -> Command {
        let mut command = Command::new(&self.bin);
        command.envs(self.env.iter().map(|(k, v)| (k, v)));
        command
    }

    /// A node to start in `dir`: by default `berth serve` on the base
    /// config ([`config_with`]) with its data dir `dir/data`; see
    /// [`NodeBuilder`] for the rest.
    pub fn node(&self, dir: &Path) -> NodeBuilder {
        NodeBuilder {
            berth: self.clone(),
            dir: dir.to_owned(),
            launch: Launch::Config(config_with(&dir.join("data"), "")),
            options: StartOptions::default(),
        }
    }

    /// Runs `berth <args>` in `dir` until it listens: the process, the URL
    /// it listens on, its node-to-node URL (cluster nodes only) and its
    /// admin token.
    fn spawn_serve(
        &self,
        dir: &Path,
        args: &[&str],
        data_dir: &Path,
        options: &StartOptions,
    ) -> (Child, String, Option<String>, String) {
        // Run as root, berth gives every user's instances a uid of their
        // own (isolation level `user`), which must be able to pass through
        // the test's private temporary directory to its data root.
        reachable_by_instances(dir);
        let mut command = match options.wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(&self.bin);
                c.envs(self.env.iter().map(|(k, v)| (k, v)));
                c
            }
            None => self.command(),
        };
        command
            .args(args)
            .current_dir(dir)
            .env("RUST_LOG", "info,berth=debug")
            .envs(options.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        match &options.stderr {
            Some(path) => command.stderr(std::fs::File::create(path).expect("a stderr file")),
            None => command.stderr(Stdio::inherit()),
        };
        if let Some(uid) = options.run_as {
            use std::os::unix::process::CommandExt;
            command.uid(uid).gid(uid);
        }
        let mut child = command.spawn().expect("berth starts");
        let stdout = child.stdout.take().expect("a piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let mut internal_url = None;
        let url = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(url) = line.strip_prefix("berth: listening on ") {
                        break url.trim().to_owned();
                    }
                    // A cluster node says so first.
                    if let Some(url) = line.strip_prefix("berth: node-to-node calls on ") {
                        internal_url = Some(url.trim().to_owned());
                    }
                }
                _ => panic!("berth exited before listening: {:?}", child.wait()),
            }
        };
        // Keep draining stdout so berth never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        let token = match options.env.iter().find(|(k, _)| k == "BERTH_ADMIN_TOKEN") {
            Some((_, token)) => token.clone(),
            None => std::fs::read_to_string(data_dir.join("admin.token"))
                .expect("berth wrote its admin token")
                .trim()
                .to_owned(),
        };
        (child, url, internal_url, token)
    }
}

/// What a [`NodeBuilder`] runs.
#[derive(Debug, Clone)]
enum Launch {
    /// `berth serve` on this config, written to `dir/berth.toml`.
    Config(String),
    /// `berth <args>`, keeping its `admin.token` in this data dir.
    Args(Vec<String>, PathBuf),
}

/// One `berth serve` (or other `berth` command) to start, built up from
/// [`Berth::node`]: every way a test starts a node is one of these.
///
/// ```text
/// berth.node(dir).extra("[reap]\nhibernate_after_s = 2\n").start()
/// berth.node(dir).config(&cluster_config(dir, pg, "node-a", secret, "", "")).start()
/// berth.node(dir).args(&["serve"], &data_dir).options(options).start()
/// ```
#[derive(Debug, Clone)]
#[must_use = "a node starts only with `start`"]
pub struct NodeBuilder {
    berth: Berth,
    dir: PathBuf,
    launch: Launch,
    options: StartOptions,
}

impl NodeBuilder {
    /// The base config ([`config_with`]) with `extra` TOML appended.
    pub fn extra(mut self, extra: &str) -> Self {
        self.launch = Launch::Config(config_with(&self.dir.join("data"), extra));
        self
    }

    /// Exactly `config`, whose data dir must be `dir/data` (e.g. from
    /// [`cluster_config`]). An `[isolation]` account range of the node's
    /// own is added unless it names one ([`with_own_accounts`]).
    pub fn config(mut self, config: &str) -> Self {
        self.launch = Launch::Config(config.to_owned());
        self
    }

    /// `berth <args>` instead of `serve` on a config file; `data_dir` is
    /// where it keeps its `admin.token`.
    pub fn args(mut self, args: &[&str], data_dir: &Path) -> Self {
        let args = args.iter().map(|a| (*a).to_owned()).collect();
        self.launch = Launch::Args(args, data_dir.to_owned());
        self
    }

    /// How berth runs beyond its arguments.
    pub fn options(mut self, options: StartOptions) -> Self {
        self.options = options;
        self
    }

    /// Starts the node and waits until it listens.
    ///
    /// # Panics
    ///
    /// When berth cannot start, or exits before it listens.
    pub fn start(self) -> Node {
        let NodeBuilder {
            berth,
            dir,
            launch,
            options,
        } = self;
        raise_open_files_limit();
        std::fs::create_dir_all(&dir).expect("cannot create the node's directory");
        let (args, data_dir) = match launch {
            Launch::Args(args, data_dir) => (args, data_dir),
            Launch::Config(config) => {
                let path = dir.join("berth.toml");
                // Keyed by the store when the config names one (nodes
                // sharing it share accounts), else by the data dir.
                let key = config
                    .lines()
                    .find(|l| l.trim_start().starts_with("store ="))
                    .map_or_else(|| dir.join("data").display().to_string(), str::to_owned);
                write_private(&path, &with_own_accounts(&config, &key), options.run_as);
                let path = path.to_str().expect("a UTF-8 config path").to_owned();
                let args = vec!["serve".to_owned(), "--config".to_owned(), path];
                (args, dir.join("data"))
            }
        };
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (child, url, internal_url, token) = berth.spawn_serve(&dir, &args, &data_dir, &options);
        Node {
            child: Some(child),
            berth,
            url,
            internal_url,
            token,
            dir,
            data_dir,
            http: reqwest::Client::new(),
        }
    }
}

/// How [`NodeBuilder::start`] runs berth, beyond its arguments.
#[derive(Debug, Clone, Default)]
pub struct StartOptions {
    /// Extra environment.
    pub env: Vec<(String, String)>,
    /// Where berth's stderr (its log) goes; inherited when `None`.
    pub stderr: Option<PathBuf>,
    /// A command berth runs under, e.g. `ip netns exec NAME`.
    pub wrapper: Vec<String>,
    /// Run berth as this uid (and gid) instead of the test's.
    pub run_as: Option<u32>,
}

/// Writes `text` to `path` readable by its owner alone (berth refuses a
/// config file that holds a secret and others can read), owned by `owner`
/// when given (the uid berth will run as).
///
/// # Panics
///
/// When the file cannot be written.
pub fn write_private(path: &Path, text: &str, owner: Option<u32>) {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .expect("cannot create a private file");
    // An existing file keeps its mode through `open`.
    file.set_permissions(std::fs::Permissions::from_mode(0o600))
        .expect("cannot make a file private");
    file.write_all(text.as_bytes())
        .expect("cannot write a private file");
    if let Some(uid) = owner {
        std::os::unix::fs::chown(path, Some(uid), Some(uid)).expect("cannot hand a file over");
    }
}

/// Lets other users search (not list) `dir`, as instance accounts must to
/// reach their data roots below it (tempfile makes its directories 0700).
pub fn reachable_by_instances(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(meta) = std::fs::metadata(dir) else {
        return;
    };
    let mode = meta.permissions().mode();
    if mode & 0o001 == 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode | 0o011))
            .expect("cannot open the test directory to instance accounts");
    }
}

/// A running `berth serve` and its data dir. Dropping it kills berth
/// (`kill -9`) and every instance under its data dir.
pub struct Node {
    child: Option<Child>,
    berth: Berth,
    /// The URL of its public listener (proxy and API), as berth printed
    /// it.
    pub url: String,
    /// Where a cluster node takes node-to-node calls (`/internal/v1/…`):
    /// its own listener, on a free loopback port unless the config says
    /// otherwise. `None` on a single node.
    pub internal_url: Option<String>,
    /// The admin token.
    pub token: String,
    /// The directory it runs in, holding its `berth.toml` when one was
    /// written.
    pub dir: PathBuf,
    /// Its data dir, where it keeps its state and `admin.token`.
    pub data_dir: PathBuf,
    /// A client for calls to it, shared by the helpers that make them.
    pub http: reqwest::Client,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("url", &self.url)
            .field("data_dir", &self.data_dir)
            .field("pid", &self.pid())
            .finish_non_exhaustive()
    }
}

/// Generous bound for an instance to come up; only a hang reaches it.
const RUNNING_PATIENCE: Duration = Duration::from_secs(30);

/// A test process that starts berths also holds their clients'
/// connections: many nodes' worth in the cluster tests, one per user in a
/// launch burst. A login shell's soft open-files limit (often 1024) runs
/// out, so the process raises it to the hard limit once, as berth does for
/// itself.
fn raise_open_files_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    static RAISED: Once = Once::new();
    RAISED.call_once(|| {
        if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
            && soft < hard
        {
            setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
                .expect("cannot raise the open-files limit to the hard one");
        }
    });
}

impl Node {
    /// `<url>/api/v1<path>`.
    pub fn api(&self, path: &str) -> String {
        format!("{}/api/v1{path}", self.url)
    }

    /// `<internal_url>/internal/v1<path>`: a node-to-node route.
    ///
    /// # Panics
    ///
    /// On a single node, which has no node-to-node listener.
    pub fn internal(&self, path: &str) -> String {
        let base = self
            .internal_url
            .as_deref()
            .expect("a cluster node has a node-to-node listener");
        format!("{base}/internal/v1{path}")
    }

    /// GET an API path as admin: status and JSON body (`Null` if none).
    ///
    /// # Panics
    ///
    /// When berth cannot be reached at all.
    pub async fn get(&self, path: &str) -> (u16, Value) {
        let r = self
            .http
            .get(self.api(path))
            .bearer_auth(&self.token)
            .send()
            .await
            .expect("berth answers");
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// POST JSON to an API path as admin: status and JSON body.
    ///
    /// # Panics
    ///
    /// When berth cannot be reached at all.
    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .http
            .post(self.api(path))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await
            .expect("berth answers");
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// DELETE an API path as admin: the status.
    ///
    /// # Panics
    ///
    /// When berth cannot be reached at all.
    pub async fn delete(&self, path: &str) -> u16 {
        self.http
            .delete(self.api(path))
            .bearer_auth(&self.token)
            .send()
            .await
            .expect("berth answers")
            .status()
            .as_u16()
    }

    /// The status `/healthz` answers with (no token needed).
    ///
    /// # Panics
    ///
    /// When the node does not answer.
    pub async fn healthz(&self) -> u16 {
        self.http
            .get(format!("{}/healthz", self.url))
            .send()
            .await
            .expect("GET /healthz")
            .status()
            .as_u16()
    }

    /// Waits until berth has adopted every instance it found at start:
    /// it serves while it adopts, and a user not adopted yet is told
    /// "starting".
    pub async fn adopted(&self) {
        eventually(RUNNING_PATIENCE, "the adoption to end", || async {
            (self.metric("berth_instances_awaiting_adoption").await == Some(0.0)).then_some(())
        })
        .await;
    }

    /// The user's main record, or `Null`.
    pub async fn main_of(&self, user: &str) -> Value {
        self.get(&format!("/users/{user}/instance")).await.1["main"].clone()
    }

    /// Polls until the user's main is running and ready with a pid other
    /// than `not_pid`, and returns the record.
    pub async fn running_main(&self, user: &str, not_pid: Option<u64>) -> Value {
        eventually(RUNNING_PATIENCE, &format!("{user} running"), || async {
            let main = self.main_of(user).await;
            let fresh = main["pid"].as_u64().is_some() && main["pid"].as_u64() != not_pid;
            (main["status"] == "running" && main["ready"] == true && fresh).then_some(main)
        })
        .await
    }

    /// `/metrics` as text, read with the admin token.
    ///
    /// # Panics
    ///
    /// When the node does not answer.
    pub async fn metrics_text(&self) -> String {
        self.http
            .get(format!("{}/metrics", self.url))
            .bearer_auth(&self.token)
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("the body of /metrics")
    }

    /// The value of the sample named exactly `sample` (labels included,
    /// if it has any) in `/metrics`, or `None` when there is none.
    pub async fn metric(&self, sample: &str) -> Option<f64> {
        self.metrics_text()
            .await
            .lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (name, value) = l.rsplit_once(' ')?;
                (name == sample).then(|| value.parse().ok())?
            })
    }

    /// The status of the user's main, or `"none"`.
    pub async fn status_of(&self, user: &str) -> String {
        self.main_of(user).await["status"]
            .as_str()
            .unwrap_or("none")
            .to_owned()
    }

    /// Mints a user token through the API.
    ///
    /// # Panics
    ///
    /// When the API refuses.
    pub async fn user_token(&self, user: &str) -> String {
        let (status, body) = self
            .post(&format!("/users/{user}/tokens"), serde_json::json!({}))
            .await;
        assert_eq!(status, 201, "{body}");
        body["token"].as_str().expect("a token").to_owned()
    }

    /// Runs a client command of the same binary against this node (its
    /// URL and data dir in the environment, no `BERTH_TOKEN`).
    ///
    /// # Panics
    ///
    /// When the binary cannot be run.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        self.berth
            .command()
            .args(args)
            .env("BERTH_URL", &self.url)
            .env("BERTH_DATA_DIR", &self.data_dir)
            .env_remove("BERTH_TOKEN")
            .output()
            .expect("the berth client runs")
    }

    /// The pid of `berth serve` itself, while this value owns it.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// True while `berth serve` itself runs (an exited one is a zombie until
    /// reaped, which [`alive`] does not count).
    pub fn is_running(&self) -> bool {
        self.pid().is_some_and(|pid| alive(u64::from(pid)))
    }

    /// `kill -9` of berth itself; its instances keep running.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts `berth serve` again on the config file it was started with
    /// (`dir/berth.toml`), in place of a berth this value killed: the same
    /// data dir, so it adopts (or ends) the instances its predecessor left.
    /// It listens on new ports; `url`, `internal_url` and `token` follow
    /// it.
    ///
    /// # Panics
    ///
    /// While the previous berth still runs, or when the new one cannot
    /// start.
    pub fn restart(&mut self) {
        self.restart_with(&StartOptions::default());
    }

    /// [`Node::restart`] with `options` (a wrapper, a log file).
    ///
    /// # Panics
    ///
    /// As [`Node::restart`].
    pub fn restart_with(&mut self, options: &StartOptions) {
        assert!(self.child.is_none(), "berth still runs: kill it first");
        let config = self.dir.join("berth.toml");
        let config = config.to_str().expect("a UTF-8 config path");
        let (child, url, internal_url, token) = self.berth.spawn_serve(
            &self.dir,
            &["serve", "--config", config],
            &self.data_dir,
            options,
        );
        self.child = Some(child);
        self.url = url;
        self.internal_url = internal_url;
        self.token = token;
    }

    /// SIGTERM and wait: a graceful stop.
    ///
    /// # Panics
    ///
    /// When berth was already stopped or killed.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        signal(child.id(), Signal::SIGTERM);
        child.wait().expect("berth can be waited for")
    }

    /// Sends `sig` to `berth serve` itself, without waiting.
    pub fn signal(&self, sig: Signal) {
        if let Some(pid) = self.pid() {
            signal(pid, sig);
        }
    }

    /// How `berth serve` ended, once it has (reaping it); `None` while it
    /// runs or after this value stopped owning it.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        self.child = None;
        Some(status)
    }

    /// Kills every shim (and with it every instance) under this data dir.
    pub fn kill_instances(&self) {
        kill_instances_under(&self.data_dir);
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill9();
        self.kill_instances();
    }
}
