//! Test support of the end-to-end tests: a thin layer over `berth-testkit`,
//! where the helpers live (so every crate's tests can use them), that
//! supplies this crate's `berth` binary.
//!
//! [`Node`] is the testkit's node started with [`BERTH`]; everything else
//! is re-exported as it is.

#![allow(dead_code, unused_imports)]

pub mod browser;
pub mod oidc;

use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub use berth_testkit::{
    Berth, CLUSTER_LEASE, StartOptions, alive, cluster_config, cluster_config_custom, config_with,
    eventually, free_port, frozen, instance_of, instance_pids, instance_processes,
    kill_instances_under, poll_until, proc_state, processes_of_uids, raw_request,
    reachable_by_instances, rss_kib, signal, zygote_of,
};

/// The `berth` binary cargo built for these tests.
pub const BERTH: &str = env!("CARGO_BIN_EXE_berth");

/// A launcher of [`BERTH`], for nodes that need more than [`Node`]'s
/// starters give (extra environment, say).
pub fn berth() -> Berth {
    Berth::new(BERTH)
}

/// A running `berth serve` of [`BERTH`]: [`berth_testkit::Node`]. Dropping it kills
/// berth and every instance under its data dir, then removes what an
/// isolated berth leaves in the kernel on purpose (see
/// [`remove_isolation_leftovers`]).
#[derive(Debug)]
pub struct Node(pub berth_testkit::Node);

impl Deref for Node {
    type Target = berth_testkit::Node;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl DerefMut for Node {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl From<berth_testkit::Node> for Node {
    fn from(node: berth_testkit::Node) -> Self {
        Node(node)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Instances first: their cgroups are busy while they run.
        self.0.kill9();
        self.0.kill_instances();
        remove_isolation_leftovers(&self.0.data_dir);
    }
}

impl Node {
    /// Starts berth in `dir` with `extra` TOML appended to the base config:
    /// most tests' node. Any other is started from [`berth`]`().node(dir)`
    /// ([`berth_testkit::NodeBuilder`]) and wrapped with `Node::from`.
    pub fn start(dir: &Path, extra: &str) -> Node {
        Node(berth().node(dir).extra(extra).start())
    }
}

/// A config running `tests/programs/upstream.py` as every user's program
/// on the 20 ports from `first_port` (tests run in parallel, each on its
/// own ports), plus `[instance]` keys in `instance` and whole tables in
/// `extra`.
pub fn upstream_config(first_port: u16, instance: &str, extra: &str) -> String {
    upstream_config_ready_by(first_port, "^upstream: listening", instance, extra)
}

/// [`upstream_config`] whose ready line also gives berth the program's
/// launch token (`token=…`).
pub fn upstream_config_with_launch_token(first_port: u16, instance: &str, extra: &str) -> String {
    upstream_config_ready_by(
        first_port,
        "^upstream: listening on \\\\d+ token=(\\\\w+)",
        instance,
        extra,
    )
}

fn upstream_config_ready_by(first_port: u16, regex: &str, instance: &str, extra: &str) -> String {
    let script =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/programs/upstream.py");
    format!(
        "[instance]\nport_range = [{first_port}, {}]\ncommand = [\"python3\", \"{}\", \"{{port}}\"]\n\
         ready_token_regex = \"{regex}\"\n{instance}\n{extra}\n",
        first_port + 19,
        script.display()
    )
}

/// The shipped `examples/<name>`.
pub fn example(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples")
        .join(name)
        .canonicalize()
        .unwrap()
}

/// The launch token `user`'s program printed (`token=…` in its ready
/// line), read from its log file under `data_dir` as only berth's own user
/// can: berth shows it to nobody, the API's log lines included, which this
/// checks on the way.
pub async fn launch_token_in_log(node: &berth_testkit::Node, user: &str) -> String {
    let log = node.data_dir.join("users").join(user).join("logs/main.log");
    let text = std::fs::read_to_string(&log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
    let token = text
        .lines()
        .find_map(|l| l.split("token=").nth(1))
        .map(|t| {
            t.split(|c: char| !c.is_ascii_alphanumeric() && c != '_' && c != '-')
                .next()
                .unwrap_or_default()
                .to_owned()
        })
        .unwrap_or_else(|| panic!("no launch token in {}", log.display()));
    let (_, logs) = node
        .get(&format!("/users/{user}/instance/logs?tail=200"))
        .await;
    assert!(
        !logs.to_string().contains(&token),
        "the API's log lines carry the launch token: {logs}"
    );
    token
}

/// Whether this test can run here: as root. In CI it must (CI runs as root).
pub fn root(test: &str) -> bool {
    runs_here(test, nix::unistd::geteuid().is_root(), "root")
}

/// Whether this test can run here: root and `nft`. In CI both are a must.
pub fn privileged(test: &str) -> bool {
    let nft = ["/usr/sbin/nft", "/sbin/nft", "/usr/bin/nft"]
        .iter()
        .any(|p| Path::new(p).is_file());
    runs_here(
        test,
        nix::unistd::geteuid().is_root() && nft,
        "root and nftables (scripts/test installs nftables)",
    )
}

/// Whether `test` can run here, given whether the host has what it
/// `needs`: a skip by name for a missing host feature, which fails under
/// `CI`, where a skipped test would pass silently.
pub fn runs_here(test: &str, can: bool, needs: &str) -> bool {
    if can {
        return true;
    }
    assert!(std::env::var_os("CI").is_none(), "{test} needs {needs}");
    println!("SKIPPED {test}: needs {needs}");
    false
}

/// Whether this test can run here: `jupyter lab` on `PATH` (scripts/test
/// installs it in its venv).
pub fn jupyter(test: &str) -> bool {
    let installed = std::process::Command::new("jupyter")
        .args(["lab", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    runs_here(test, installed, "`jupyter lab` (scripts/test installs it)")
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
    let parents = cgroup_parents(data_dir);
    // A program frozen by the v1 freezer takes the SIGKILL of its shim's
    // death only once thawed: kill and thaw every leaf before removing any.
    for (mount, parent) in &parents {
        if mount != "freezer" {
            continue;
        }
        for leaf in leaves(parent) {
            let freezer = berth_local::isolation::cgroup::CgroupFreezer {
                kind: berth_local::isolation::cgroup::FreezerKind::V1,
                dir: leaf,
            };
            let _ = freezer.kill_all();
        }
    }
    for (_, parent) in &parents {
        let deadline = Instant::now() + Duration::from_secs(5);
        for leaf in leaves(parent) {
            // Busy while its last processes finish dying.
            while std::fs::remove_dir(&leaf).is_err() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = std::fs::remove_dir(parent);
    }
}

/// The instance cgroups that the berth with `data_dir` has now, in every
/// hierarchy: one directory per instance and controller mount (v1), or
/// one per instance (v2). Empty once every instance is gone, as its shim
/// removes them.
pub fn instance_cgroups(data_dir: &Path) -> Vec<std::path::PathBuf> {
    cgroup_parents(data_dir)
        .iter()
        .flat_map(|(_, parent)| leaves(parent))
        .collect()
}

/// The directories under which the berth with `data_dir` makes its
/// instances' cgroups, as (mount name, path), in every hierarchy this
/// process belongs to (berth runs in the test's own cgroups) where they
/// exist.
pub fn cgroup_parents(data_dir: &Path) -> Vec<(String, std::path::PathBuf)> {
    let Ok(canonical) = data_dir.canonicalize() else {
        return Vec::new();
    };
    let table = berth_local::isolation::nft_table_name(&canonical);
    let parent = format!("berth-{}", table.trim_start_matches("berth_"));
    let Ok(own) = std::fs::read_to_string("/proc/self/cgroup") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for line in own.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let path = path.trim_start_matches('/');
        // A v1 hierarchy of several controllers is mounted under its joined
        // name, often with a link per controller (one directory either way);
        // v2 at `unified` on a hybrid host, at the top on a pure v2 one.
        let mounts: Vec<&str> = if controllers.is_empty() {
            vec!["unified", ""]
        } else {
            controllers.split(',').chain([controllers]).collect()
        };
        for mount in mounts {
            let dir = Path::new("/sys/fs/cgroup")
                .join(mount)
                .join(path)
                .join(&parent);
            if let Ok(dir) = dir.canonicalize()
                && !found.iter().any(|(_, d)| *d == dir)
            {
                found.push((mount.to_owned(), dir));
            }
        }
    }
    found
}

/// The subdirectories of a cgroup directory: its child cgroups.
fn leaves(dir: &Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect()
}

/// A WebSocket client's stream, as [`websocket`] opens it.
pub type WebSocket = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

/// Opens a WebSocket to `path` on the berth at `to`, with `token` as
/// Bearer: the handshake goes through berth's proxy (and may wake the
/// instance). `Err` is the handshake's answer, e.g. a refusal's status.
pub async fn websocket(
    to: std::net::SocketAddr,
    path: &str,
    token: &str,
) -> Result<WebSocket, tokio_tungstenite::tungstenite::Error> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut request = format!("ws://{to}{path}").into_client_request()?;
    request.headers_mut().insert(
        "authorization",
        format!("Bearer {token}")
            .parse()
            .expect("a token is a header value"),
    );
    let stream = tokio::net::TcpStream::connect(to)
        .await
        .expect("berth accepts connections");
    tokio_tungstenite::client_async(request, stream)
        .await
        .map(|(ws, _)| ws)
}

/// The processes of account `uid` whose command line (`/proc/<pid>/cmdline`,
/// NUL-separated) `matches`.
pub fn processes_of_account(uid: u32, matches: impl Fn(&[u8]) -> bool) -> Vec<u32> {
    processes_of_uids(uid..uid + 1)
        .into_iter()
        .map(|(pid, _)| pid)
        .filter(|pid| matches(&std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default()))
        .collect()
}

/// Whether a command line is a sandbox's relay (`berth shim relay`).
pub fn is_relay(cmdline: &[u8]) -> bool {
    cmdline.ends_with(b"shim\0relay\0")
}
