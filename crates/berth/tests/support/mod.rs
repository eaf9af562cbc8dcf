//! Test support shared by the end-to-end tests: a real `berth serve` on a
//! loopback port with its own data dir, plus polling helpers.
//!
//! Every instance a test starts is killed when its [`Node`] is dropped, via
//! the shims' state files, so no test leaves a process behind.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const BERTH: &str = env!("CARGO_BIN_EXE_berth");

/// Polls `check` every 25 ms until it returns `Some`, or panics with `what`
/// after `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A config file body with the test's listen address and data dir filled in.
pub fn config_with(data_dir: &Path, extra: &str) -> String {
    format!(
        "listen = \"127.0.0.1:0\"\ndata_dir = \"{}\"\n{extra}\n",
        data_dir.display()
    )
}

/// How [`Node::start_with_options`] runs berth.
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

/// A running `berth serve` and its data dir.
pub struct Node {
    child: Option<Child>,
    pub url: String,
    pub token: String,
    pub dir: PathBuf,
    pub data_dir: PathBuf,
    pub http: reqwest::Client,
}

impl Node {
    /// Starts berth in `dir` with `extra` TOML appended to the base config.
    pub fn start(dir: &Path, extra: &str) -> Node {
        Self::start_with_config(dir, &config_with(&dir.join("data"), extra))
    }

    /// Writes `config` to `dir/berth.toml` and runs `berth serve` on it; its
    /// data dir must be `dir/data`.
    fn start_with_config(dir: &Path, config: &str) -> Node {
        std::fs::create_dir_all(dir).unwrap();
        let path = dir.join("berth.toml");
        std::fs::write(&path, config).unwrap();
        Self::start_with_args(
            dir,
            &["serve", "--config", path.to_str().unwrap()],
            &dir.join("data"),
        )
    }

    /// Starts `berth <args>` in `dir` and waits for its "listening" line.
    pub fn start_with_args(dir: &Path, args: &[&str], data_dir: &Path) -> Node {
        Self::start_with_options(dir, args, data_dir, &StartOptions::default())
    }

    /// [`Node::start_with_args`] with `options`.
    pub fn start_with_options(
        dir: &Path,
        args: &[&str],
        data_dir: &Path,
        options: &StartOptions,
    ) -> Node {
        // Run as root, berth gives every user's instances a uid of their
        // own (isolation mode `user`), which must be able to pass through
        // the test's private temporary directory to its data root.
        reachable_by_instances(dir);
        let mut command = match options.wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(BERTH);
                c
            }
            None => Command::new(BERTH),
        };
        command
            .args(args)
            .current_dir(dir)
            .env("RUST_LOG", "info,berth=debug")
            .envs(options.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        match &options.stderr {
            Some(path) => command.stderr(std::fs::File::create(path).unwrap()),
            None => command.stderr(Stdio::inherit()),
        };
        if let Some(uid) = options.run_as {
            use std::os::unix::process::CommandExt;
            command.uid(uid).gid(uid);
        }
        let mut child = command.spawn().expect("berth starts");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let url = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(url) = line.strip_prefix("berth: listening on ") {
                        break url.trim().to_owned();
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
                .unwrap()
                .trim()
                .to_owned(),
        };
        Node {
            child: Some(child),
            url,
            token,
            dir: dir.to_owned(),
            data_dir: data_dir.to_owned(),
            http: reqwest::Client::new(),
        }
    }

    /// Starts berth in `dir` on exactly `config` (whose data dir must be
    /// `dir/data`), with `options`.
    pub fn start_configured(dir: &Path, config: &str, options: &StartOptions) -> Node {
        std::fs::create_dir_all(dir).unwrap();
        let path = dir.join("berth.toml");
        std::fs::write(&path, config).unwrap();
        Self::start_with_options(
            dir,
            &["serve", "--config", path.to_str().unwrap()],
            &dir.join("data"),
            options,
        )
    }

    pub fn api(&self, path: &str) -> String {
        format!("{}/api/v1{path}", self.url)
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let r = self
            .http
            .get(self.api(path))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .http
            .post(self.api(path))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    pub async fn delete(&self, path: &str) -> u16 {
        self.http
            .delete(self.api(path))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    }

    /// The user's main record, or `Null`.
    pub async fn main_of(&self, user: &str) -> Value {
        self.get(&format!("/users/{user}/instance")).await.1["main"].clone()
    }

    /// Polls until the user's main is running with a pid different from
    /// `not_pid`, and returns the record.
    pub async fn running_main(&self, user: &str, not_pid: Option<u64>) -> Value {
        eventually(
            Duration::from_secs(30),
            &format!("{user} running"),
            || async {
                let main = self.main_of(user).await;
                let fresh = main["pid"].as_u64().is_some() && main["pid"].as_u64() != not_pid;
                (main["status"] == "running" && main["ready"] == true && fresh).then_some(main)
            },
        )
        .await
    }

    pub async fn status_of(&self, user: &str) -> String {
        self.main_of(user).await["status"]
            .as_str()
            .unwrap_or("none")
            .to_owned()
    }

    /// Runs a client command of the same binary against this node.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        Command::new(BERTH)
            .args(args)
            .env("BERTH_URL", &self.url)
            .env("BERTH_DATA_DIR", &self.data_dir)
            .env_remove("BERTH_TOKEN")
            .output()
            .unwrap()
    }

    /// `kill -9` of berth itself; its instances keep running.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// SIGTERM and wait: a graceful stop.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        signal(child.id(), nix::sys::signal::Signal::SIGTERM);
        child.wait().unwrap()
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
        remove_isolation_leftovers(&self.data_dir);
    }
}

/// What berth at level `user` or `sandbox` leaves in the kernel on purpose
/// when it stops (instances outlive it, guarded and limited): its nftables
/// table and its cgroups. A test's berth is gone for good, so they go too,
/// after its instances (the cgroups of shims killed by
/// [`kill_instances_under`] are never removed by those shims).
pub fn remove_isolation_leftovers(data_dir: &Path) {
    if !nix::unistd::geteuid().is_root() {
        return;
    }
    let Ok(canonical) = data_dir.canonicalize() else {
        return;
    };
    let table = berth_local::isolation::nft_table_name(&canonical);
    let _ = Command::new("nft")
        .args(["delete", "table", "inet", &table])
        .stderr(Stdio::null())
        .status();
    let parent = format!("berth-{}", table.trim_start_matches("berth_"));
    let Ok(own) = std::fs::read_to_string("/proc/self/cgroup") else {
        return;
    };
    for line in own.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let path = path.trim_start_matches('/');
        for mount in controllers.split(',').chain([controllers]) {
            let mount = if mount.is_empty() { "unified" } else { mount };
            let dir = Path::new("/sys/fs/cgroup")
                .join(mount)
                .join(path)
                .join(&parent);
            let Ok(leaves) = std::fs::read_dir(&dir) else {
                continue;
            };
            let deadline = Instant::now() + Duration::from_secs(5);
            for leaf in leaves
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            {
                // Busy while its last processes finish dying.
                while std::fs::remove_dir(leaf.path()).is_err() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            let _ = std::fs::remove_dir(&dir);
        }
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
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode | 0o011)).unwrap();
    }
}

pub fn signal(pid: u32, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
}

/// Kills the shim and the program group of every state file under
/// `<data_dir>/run`.
pub fn kill_instances_under(data_dir: &Path) {
    let Ok(slugs) = std::fs::read_dir(data_dir.join("run")) else {
        return;
    };
    for slug in slugs.flatten() {
        let Ok(files) = std::fs::read_dir(slug.path()) else {
            continue;
        };
        for file in files.flatten() {
            let path = file.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let Ok(state) = std::fs::read_to_string(&path) else {
                continue;
            };
            let Ok(state) = serde_json::from_str::<Value>(&state) else {
                continue;
            };
            if let Some(pid) = state["pid"].as_i64() {
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            if let Some(pid) = state["shim_pid"].as_i64() {
                signal(pid as u32, nix::sys::signal::Signal::SIGKILL);
            }
        }
    }
}

/// The shim zygote (`berth shim`) that the `berth serve` with pid `berth`
/// started, if it runs.
pub fn zygote_of(berth: u32) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.find_map(|entry| {
        let pid: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let ppid: u32 = stat
            .rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let is_shim = cmdline.split(|&b| b == 0).nth(1) == Some(b"shim".as_slice());
        (ppid == berth && is_shim && alive(u64::from(pid))).then_some(pid)
    })
}

/// True while a process with this pid exists and is not a zombie.
pub fn alive(pid: u64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Pids of live processes whose environment has `BERTH_USER=<user>` and
/// `BERTH_ROLE=<role>`, and whose data dir is `data_dir`.
pub fn instance_pids(data_dir: &Path, user: &str, role: &str) -> Vec<u32> {
    let want_user = format!("BERTH_USER={user}");
    let want_role = format!("BERTH_ROLE={role}");
    let data_dir = data_dir
        .canonicalize()
        .unwrap_or_else(|_| data_dir.to_owned());
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let vars: Vec<&[u8]> = environ.split(|b| *b == 0).collect();
        let has = |want: &str| vars.contains(&want.as_bytes());
        let home_under = vars.iter().any(|v| {
            v.strip_prefix(b"HOME=").is_some_and(|h| {
                Path::new(std::str::from_utf8(h).unwrap_or("")).starts_with(&data_dir)
            })
        });
        if has(&want_user) && has(&want_role) && home_under && alive(u64::from(pid)) {
            pids.push(pid);
        }
    }
    pids
}

/// A TCP port nobody listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Sends `request_head` (and no body) over a fresh TCP connection exactly as
/// written — no URL normalisation — and returns the status and body.
pub async fn raw_request(url: &str, request_head: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request_head.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

impl Node {
    /// The pid of `berth serve` itself, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Mints a user token through the API.
    pub async fn user_token(&self, user: &str) -> String {
        let (status, body) = self
            .post(&format!("/users/{user}/tokens"), serde_json::json!({}))
            .await;
        assert_eq!(status, 201, "{body}");
        body["token"].as_str().expect("a token").to_owned()
    }
}

/// Lease timings short enough for tests to see expiry and failover in
/// seconds (TTL > 2 × renew, fence_after < TTL).
pub const CLUSTER_LEASE: &str = "ttl_ms = 3000\nrenew_ms = 1000\nfence_after_ms = 2000\n";

/// A config body for one node of a cluster on `pg_url`: its own data dir
/// under `dir`, a port range of its own (nodes on one host must not race
/// for ports), short lease timings plus `lease_extra` (e.g. `takeover =
/// "manual"`), and `extra` TOML (top-level keys or whole tables, but not
/// `[lease]`).
pub fn cluster_config(
    dir: &Path,
    pg_url: &str,
    node_id: &str,
    secret: &str,
    lease_extra: &str,
    extra: &str,
) -> String {
    use std::sync::atomic::{AtomicU16, Ordering};
    // Blocks of 150 ports per node, distinct within this test process.
    static NEXT_BLOCK: AtomicU16 = AtomicU16::new(0);
    let block = NEXT_BLOCK.fetch_add(1, Ordering::Relaxed) % 200;
    let first = 30_000 + block * 150;
    let last = first + 149;
    format!(
        "store = \"{pg_url}\"\nnode_id = \"{node_id}\"\ncluster_secret = \"{secret}\"\n{}\n\
         [instance]\nport_range = [{first}, {last}]\n\n[lease]\n{CLUSTER_LEASE}{lease_extra}\n",
        config_with(&dir.join("data"), extra)
    )
}

impl Node {
    /// Starts a cluster node (PostgreSQL store) in `dir`; see
    /// [`cluster_config`].
    pub fn start_cluster(
        dir: &Path,
        pg_url: &str,
        node_id: &str,
        secret: &str,
        extra: &str,
    ) -> Node {
        Self::start_cluster_with_lease(dir, pg_url, node_id, secret, "", extra)
    }

    /// [`Node::start_cluster`] with extra `[lease]` keys.
    pub fn start_cluster_with_lease(
        dir: &Path,
        pg_url: &str,
        node_id: &str,
        secret: &str,
        lease_extra: &str,
        extra: &str,
    ) -> Node {
        Self::start_with_config(
            dir,
            &cluster_config(dir, pg_url, node_id, secret, lease_extra, extra),
        )
    }
}

/// Resident memory of a process in KiB (`VmRSS` in /proc/<pid>/status).
pub fn rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// [`cluster_config`] with its `[lease]` timings replaced by `lease` (whole
/// `key = value` lines, e.g. a longer TTL) and `instance` lines added to
/// its `[instance]` table (e.g. a `command`). The port block still comes
/// from [`cluster_config`], so nodes made either way never share ports.
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

impl Node {
    /// A cluster node configured by [`cluster_config_custom`].
    pub fn start_cluster_custom(
        dir: &Path,
        pg_url: &str,
        node_id: &str,
        secret: &str,
        lease: &str,
        instance: &str,
        extra: &str,
    ) -> Node {
        Self::start_with_config(
            dir,
            &cluster_config_custom(dir, pg_url, node_id, secret, lease, instance, extra),
        )
    }

    /// True while `berth serve` itself runs (an exited one is a zombie until
    /// reaped, which [`alive`] does not count).
    pub fn is_running(&self) -> bool {
        self.pid().is_some_and(|pid| alive(u64::from(pid)))
    }
}

/// The scheduler state letter of a process (`R`, `S`, `T` stopped, …), if
/// it exists.
pub fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}
