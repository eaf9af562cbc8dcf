//! Test support for berth — never linked into the shipped binary.
//!
//! What every crate's tests share:
//!
//! * [`PgCluster`]: a PostgreSQL server to test against (below);
//! * [`Berth`] and [`Node`]: a real `berth serve` on a loopback port with
//!   its own data dir, single node or one node of a cluster
//!   ([`cluster_config`]), killed with its instances when dropped. The
//!   binary's path is passed in: only the `berth` crate's tests know it;
//! * [`eventually`]: wait on a condition until a deadline, never a fixed
//!   sleep;
//! * process helpers over `/proc` ([`alive`], [`frozen`], [`proc_state`],
//!   [`instance_pids`], [`zygote_of`], [`rss_kib`], …) and
//!   [`raw_request`] for HTTP a client library would not send;
//! * [`signed_request`]: a node-to-node call signed like a node's.
//!
//! # PostgreSQL
//!
//! [`PgCluster`] gives tests and benchmarks a PostgreSQL server:
//!
//! * with `BERTH_TEST_PG_URL` set (`postgres://user:pw@host:port/db`), that
//!   server, on which each test gets its own database;
//! * otherwise a throwaway cluster made with `initdb` and run with `pg_ctl`
//!   in a fresh directory under the system temp dir, listening on a free
//!   loopback TCP port (and a socket inside that directory), with
//!   `fsync=off` and `synchronous_commit=off` because its data is worth
//!   nothing. The binaries are looked up in `BERTH_PG_BIN`, then `PATH`,
//!   then `/usr/lib/postgresql/<version>/bin` (newest first), where
//!   Debian's `postgresql` package puts them. PostgreSQL refuses to run as
//!   root, so when the tests do, every PostgreSQL command runs as the
//!   `postgres` OS user via `runuser`, and the directory is handed to it.
//!
//! [`PgCluster::fresh_database`] creates an empty database per test, so
//! tests sharing a cluster never see each other's rows.
//!
//! # One cluster per test binary, and no orphans
//!
//! `initdb` costs seconds, so [`PgCluster::shared`] starts one cluster per
//! test process, kept in a static. Statics are never dropped, so cleanup
//! cannot hang off `Drop`. Instead every throwaway cluster is born with a
//! *watchdog*: a tiny `sh` child whose stdin is a pipe from the test
//! process, which nothing ever writes to. When the test process ends — by
//! returning, panicking, `exit`, Ctrl-C or `SIGKILL` alike — the kernel
//! closes the write end, the watchdog's `read` sees end-of-file, and it runs
//! `pg_ctl stop -m immediate` and removes the directory. The pipe is
//! close-on-exec, so no other child (PostgreSQL included) keeps it open,
//! and the watchdog runs in its own process group so the Ctrl-C that kills
//! the tests does not kill it first. Clusters that are dropped
//! ([`PgCluster::start_throwaway`]) use the same path synchronously: `Drop`
//! closes the pipe and waits for the watchdog to finish. The watchdog is
//! started before `initdb`, so even a cluster that failed half-way leaves
//! nothing behind.
//!
//! The commands block (they wait for `pg_ctl`), and [`PgCluster::shared`]
//! may take a few seconds the first time; call them from a multi-threaded
//! runtime or `spawn_blocking` when other tasks must keep running.

#![forbid(unsafe_code)]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test support: a panic is the failing test's report"
)]

use std::fs::OpenOptions;
use std::io::Write;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::Connection;

mod http;
mod node;
mod peer;
mod ports;
mod process;
mod wait;

pub use http::raw_request;
pub use node::{
    Berth, CLUSTER_LEASE, Node, NodeBuilder, StartOptions, accounts_for, cluster_config,
    cluster_config_custom, config_with, reachable_by_instances, with_own_accounts, write_private,
};
pub use peer::{
    forward_headers, forward_headers_at, signed_headers, signed_headers_at, signed_request,
    unix_millis,
};
pub use ports::{port_block, port_block_for};
pub use process::{
    InstanceProcess, alive, free_port, frozen, instance_of, instance_pids, instance_processes,
    kill_instances_under, proc_state, processes_of_uids, rss_kib, signal, zygote_of,
};
pub use wait::{eventually, poll_until};

/// A cluster secret strong enough for berth to accept (64 hex digits, as
/// `openssl rand -hex 32` makes), for tests that need one.
pub const TEST_CLUSTER_SECRET: &str =
    "3c9f1a7e5b2d8c4f6e0a9b1d3f5c7e2a4b6d8f0e1c3a5b7d9f2e4c6a8b0d1f3e";

/// Overrides the throwaway cluster with an existing server.
pub const URL_ENV: &str = "BERTH_TEST_PG_URL";
/// Names the directory holding `initdb`, `pg_ctl` and `postgres`.
pub const BIN_ENV: &str = "BERTH_PG_BIN";

/// The OS user PostgreSQL runs as when the tests run as root.
const PG_OS_USER: &str = "postgres";
/// How long `pg_ctl` may wait for the server to start or stop.
const PG_CTL_WAIT_SECS: &str = "60";
/// Attempts at starting on a free port; another process may take the port
/// between our probe and the server's bind.
const START_ATTEMPTS: usize = 4;

/// Why a cluster could not be started or used.
#[derive(Debug, thiserror::Error)]
pub enum PgClusterError {
    /// `initdb`/`pg_ctl` are not installed where we look.
    #[error(
        "PostgreSQL binaries not found ({0}); install the `postgresql` package, set {BIN_ENV}, \
         or point {URL_ENV} at a server"
    )]
    NoBinaries(String),
    /// Running as root but the `postgres` user or `runuser` is missing.
    #[error("cannot run PostgreSQL as root: {0}")]
    NoPostgresUser(String),
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A PostgreSQL command failed; `output` is what it (and the server
    /// log) said.
    #[error("{what} failed: {output}")]
    Command {
        /// The command, or the step it was for.
        what: String,
        /// Its output, with the server log when there is one.
        output: String,
    },
    /// Stopping or starting a server this process does not own.
    #[error("{URL_ENV} names an external server, which tests may not stop or start")]
    External,
    /// Stopping or starting the cluster other tests share.
    #[error("the shared cluster cannot be stopped or started; use PgCluster::start_throwaway")]
    Shared,
    /// Talking to the server failed.
    #[error("{0}")]
    Sql(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> PgClusterError {
    let what = what.into();
    move |source| PgClusterError::Io { what, source }
}

/// A PostgreSQL server for tests; see the [crate docs](crate).
#[derive(Debug)]
pub struct PgCluster {
    server: Server,
    shared: bool,
}

#[derive(Debug)]
enum Server {
    External { url: url::Url },
    Owned(Owned),
}

/// A throwaway cluster this process started.
#[derive(Debug)]
struct Owned {
    dir: PathBuf,
    data: PathBuf,
    log: PathBuf,
    pg_ctl: PathBuf,
    /// `runuser` when PostgreSQL commands must change user.
    runuser: Option<PathBuf>,
    port: u16,
    /// Holds the write end of the watchdog's stdin; see the crate docs.
    watchdog: Mutex<Option<Child>>,
}

static SHARED: OnceLock<Result<PgCluster, String>> = OnceLock::new();
static NEXT_DB: AtomicU64 = AtomicU64::new(0);

impl PgCluster {
    /// The cluster every test in this process shares, started on first use
    /// (see [`PgCluster::start`]). It cannot be stopped or restarted; it
    /// goes away when the process does.
    pub fn shared() -> Result<&'static PgCluster, PgClusterError> {
        let cluster = SHARED.get_or_init(|| {
            Self::start()
                .map(|mut c| {
                    c.shared = true;
                    c
                })
                .map_err(|e| e.to_string())
        });
        cluster.as_ref().map_err(|e| PgClusterError::Command {
            what: "starting the shared PostgreSQL cluster".into(),
            output: e.clone(),
        })
    }

    /// The server `BERTH_TEST_PG_URL` names, or else a new throwaway
    /// cluster owned by the returned value.
    pub fn start() -> Result<PgCluster, PgClusterError> {
        match std::env::var(URL_ENV) {
            Ok(raw) if !raw.trim().is_empty() => {
                let url = url::Url::parse(raw.trim()).map_err(|e| PgClusterError::Command {
                    what: format!("parsing {URL_ENV}"),
                    output: e.to_string(),
                })?;
                Ok(PgCluster {
                    server: Server::External { url },
                    shared: false,
                })
            }
            _ => Self::start_throwaway(),
        }
    }

    /// A new throwaway cluster whatever `BERTH_TEST_PG_URL` says: for tests
    /// that stop and start the server. Dropping it stops the server and
    /// removes its files.
    pub fn start_throwaway() -> Result<PgCluster, PgClusterError> {
        Ok(PgCluster {
            server: Server::Owned(Owned::create()?),
            shared: false,
        })
    }

    /// Whether this process started the server (and may stop it).
    pub fn is_throwaway(&self) -> bool {
        matches!(self.server, Server::Owned(_))
    }

    /// The loopback port of a throwaway cluster.
    pub fn port(&self) -> Option<u16> {
        match &self.server {
            Server::Owned(o) => Some(o.port),
            Server::External { .. } => None,
        }
    }

    /// A URL for a maintenance database, for creating and dropping others.
    pub fn admin_url(&self) -> String {
        self.url_for("postgres")
    }

    /// The URL of database `name` on this server.
    pub fn url_for(&self, name: &str) -> String {
        match &self.server {
            Server::Owned(o) => format!("postgres://postgres@127.0.0.1:{}/{name}", o.port),
            Server::External { url } => {
                let mut url = url.clone();
                if name != "postgres" {
                    url.set_path(&format!("/{name}"));
                }
                url.to_string()
            }
        }
    }

    /// Creates a new empty database and returns its URL.
    ///
    /// # Panics
    ///
    /// When the server refuses; tests have nothing better to do then. Use
    /// [`PgCluster::try_fresh_database`] to handle the error.
    pub async fn fresh_database(&self) -> String {
        match self.try_fresh_database().await {
            Ok(url) => url,
            Err(e) => panic!("cannot create a test database: {e}"),
        }
    }

    /// Creates a new empty database and returns its URL.
    pub async fn try_fresh_database(&self) -> Result<String, PgClusterError> {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        // Process id and a counter keep names unique within a run; the
        // nanoseconds keep them apart from an earlier run's leftovers on an
        // external server.
        let name = format!(
            "berth_test_{}_{}_{nanos}",
            std::process::id(),
            NEXT_DB.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = sqlx::PgConnection::connect(&self.admin_url())
            .await
            .map_err(|e| PgClusterError::Sql(format!("connecting to the test server: {e}")))?;
        let created = sqlx::query(&format!("CREATE DATABASE \"{name}\""))
            .execute(&mut admin)
            .await;
        let _ = admin.close().await;
        created.map_err(|e| PgClusterError::Sql(format!("CREATE DATABASE {name}: {e}")))?;
        Ok(self.url_for(&name))
    }

    /// Stops the server the way an operator would (`-m fast`: clients are
    /// disconnected, everything committed is kept).
    pub fn stop(&self) -> Result<(), PgClusterError> {
        self.owned()?.stop("fast")
    }

    /// Stops the server abruptly (`-m immediate`, as if it crashed). With
    /// `synchronous_commit=off` the last few hundred milliseconds of
    /// commits may be lost, as they would be in a real crash of such a
    /// server.
    pub fn crash(&self) -> Result<(), PgClusterError> {
        self.owned()?.stop("immediate")
    }

    /// Starts a stopped server again, on the same port.
    pub fn start_again(&self) -> Result<(), PgClusterError> {
        self.owned()?.start()
    }

    /// [`stop`](Self::stop), then [`start_again`](Self::start_again).
    pub fn restart(&self) -> Result<(), PgClusterError> {
        let owned = self.owned()?;
        owned.stop("fast")?;
        owned.start()
    }

    fn owned(&self) -> Result<&Owned, PgClusterError> {
        match (&self.server, self.shared) {
            (Server::External { .. }, _) => Err(PgClusterError::External),
            (Server::Owned(_), true) => Err(PgClusterError::Shared),
            (Server::Owned(o), false) => Ok(o),
        }
    }
}

impl Owned {
    fn create() -> Result<Owned, PgClusterError> {
        let bin = find_bin_dir()?;
        let runuser = if nix::unistd::geteuid().is_root() {
            Some(find_runuser()?)
        } else {
            None
        };
        let dir = make_dir()?;
        let pg_ctl = bin.join("pg_ctl");
        let mut owned = Owned {
            data: dir.join("data"),
            log: dir.join("postgres.log"),
            dir,
            pg_ctl,
            runuser,
            port: 0,
            watchdog: Mutex::new(None),
        };
        // From here on a failure drops `owned`, whose watchdog cleans up.
        owned.spawn_watchdog()?;
        if owned.runuser.is_some() {
            hand_to_postgres_user(&owned.dir)?;
        }
        let socket_dir = owned.dir.join("sock");
        std::fs::create_dir(&socket_dir).map_err(io("creating the socket directory"))?;
        if owned.runuser.is_some() {
            hand_to_postgres_user(&socket_dir)?;
        }

        let mut initdb = owned.command(&bin.join("initdb"));
        initdb
            .arg("-D")
            .arg(&owned.data)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-locale"])
            // Nothing here needs to survive a power cut.
            .arg("--no-sync");
        run(initdb, "initdb", None)?;

        let conf = format!(
            "\n# berth-testkit: a throwaway cluster\n\
             listen_addresses = '127.0.0.1'\n\
             unix_socket_directories = '{}'\n\
             fsync = off\n\
             synchronous_commit = off\n\
             full_page_writes = off\n\
             max_connections = 300\n\
             log_min_messages = warning\n",
            socket_dir.display().to_string().replace('\'', "''")
        );
        OpenOptions::new()
            .append(true)
            .open(owned.data.join("postgresql.conf"))
            .and_then(|mut f| f.write_all(conf.as_bytes()))
            .map_err(io("configuring the cluster"))?;

        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            owned.port = probe_port()?;
            match owned.start() {
                Ok(()) => return Ok(owned),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| PgClusterError::Command {
            what: "pg_ctl start".into(),
            output: "no attempt made".into(),
        }))
    }

    /// A command that runs `program` as the PostgreSQL user.
    fn command(&self, program: &Path) -> Command {
        let mut cmd = match &self.runuser {
            Some(runuser) => {
                let mut cmd = Command::new(runuser);
                cmd.args(["-u", PG_OS_USER, "--"]).arg(program);
                cmd
            }
            None => Command::new(program),
        };
        // The postgres user may not be able to enter the caller's working
        // directory, and a locale missing on the machine makes initdb fail.
        cmd.current_dir(&self.dir)
            .env("LC_ALL", "C")
            .stdin(Stdio::null());
        cmd
    }

    fn start(&self) -> Result<(), PgClusterError> {
        let mut cmd = self.command(&self.pg_ctl);
        cmd.arg("start")
            .arg("-D")
            .arg(&self.data)
            .arg("-l")
            .arg(&self.log)
            .args(["-w", "-t", PG_CTL_WAIT_SECS, "-o"])
            .arg(format!("-p {}", self.port));
        run(cmd, "pg_ctl start", Some(&self.log))
    }

    fn stop(&self, mode: &str) -> Result<(), PgClusterError> {
        let mut cmd = self.command(&self.pg_ctl);
        cmd.arg("stop")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", mode, "-w", "-t", PG_CTL_WAIT_SECS]);
        run(cmd, "pg_ctl stop", Some(&self.log))
    }

    fn spawn_watchdog(&self) -> Result<(), PgClusterError> {
        const SCRIPT: &str = r#"
            while read -r _; do :; done
            if [ -n "$BERTH_PG_RUNUSER" ]; then
                "$BERTH_PG_RUNUSER" -u postgres -- "$BERTH_PG_CTL" stop -D "$BERTH_PG_DATA" -m immediate -w -t 60
            else
                "$BERTH_PG_CTL" stop -D "$BERTH_PG_DATA" -m immediate -w -t 60
            fi
            rm -rf -- "$BERTH_PG_DIR"
        "#;
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(SCRIPT)
            .env("BERTH_PG_CTL", &self.pg_ctl)
            .env("BERTH_PG_DATA", &self.data)
            .env("BERTH_PG_DIR", &self.dir)
            .env(
                "BERTH_PG_RUNUSER",
                self.runuser.as_deref().unwrap_or(Path::new("")),
            )
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0);
        let child = cmd.spawn().map_err(io("starting the cluster's watchdog"))?;
        if let Ok(mut slot) = self.watchdog.lock() {
            *slot = Some(child);
        }
        Ok(())
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        let child = match self.watchdog.get_mut() {
            Ok(slot) => slot.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        match child {
            Some(mut child) => {
                // Closing its stdin is the watchdog's signal; waiting makes
                // the cleanup finish before the test moves on.
                drop(child.stdin.take());
                let _ = child.wait();
            }
            None => {
                let _ = std::fs::remove_dir_all(&self.dir);
            }
        }
    }
}

/// Runs a command to completion, turning failure into an error carrying
/// its output and, for server commands, the end of the server log.
fn run(mut cmd: Command, what: &str, log: Option<&Path>) -> Result<(), PgClusterError> {
    let Output {
        status,
        stdout,
        stderr,
    } = cmd.output().map_err(io(format!("running {what}")))?;
    if status.success() {
        return Ok(());
    }
    let mut output = format!(
        "{status}\n{}{}",
        String::from_utf8_lossy(&stdout),
        String::from_utf8_lossy(&stderr)
    );
    if let Some(log) = log.and_then(|l| std::fs::read_to_string(l).ok()) {
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        output.push_str("\nserver log (last lines):\n");
        for line in tail.into_iter().rev() {
            output.push_str(line);
            output.push('\n');
        }
    }
    Err(PgClusterError::Command {
        what: what.into(),
        output,
    })
}

/// The directory with `initdb`, `pg_ctl` and `postgres`.
fn find_bin_dir() -> Result<PathBuf, PgClusterError> {
    let complete = |dir: &Path| {
        ["initdb", "pg_ctl", "postgres"]
            .iter()
            .all(|b| dir.join(b).is_file())
    };
    if let Some(dir) = std::env::var_os(BIN_ENV) {
        let dir = PathBuf::from(dir);
        return if complete(&dir) {
            Ok(dir)
        } else {
            Err(PgClusterError::NoBinaries(format!(
                "{BIN_ENV}={} lacks initdb, pg_ctl or postgres",
                dir.display()
            )))
        };
    }
    // Through symlinks: pg_ctl finds `postgres` beside its real self.
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|d| std::fs::canonicalize(d.join("initdb")).ok())
        .filter_map(|initdb| initdb.parent().map(Path::to_path_buf));
    let mut versioned: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.split('.').next()?.parse().ok()?;
            Some((version, e.path().join("bin")))
        })
        .collect();
    versioned.sort_by_key(|v| std::cmp::Reverse(v.0));
    on_path
        .chain(versioned.into_iter().map(|(_, dir)| dir))
        .find(|d| complete(d))
        .ok_or_else(|| {
            PgClusterError::NoBinaries("looked in PATH and /usr/lib/postgresql/*/bin".into())
        })
}

fn find_runuser() -> Result<PathBuf, PgClusterError> {
    match nix::unistd::User::from_name(PG_OS_USER) {
        Ok(Some(_)) => {}
        _ => {
            return Err(PgClusterError::NoPostgresUser(format!(
                "no `{PG_OS_USER}` OS user (the postgresql package creates it)"
            )));
        }
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from));
    dirs.into_iter()
        .map(|d| d.join("runuser"))
        .find(|p| p.is_file())
        .ok_or_else(|| PgClusterError::NoPostgresUser("`runuser` (util-linux) not found".into()))
}

fn hand_to_postgres_user(path: &Path) -> Result<(), PgClusterError> {
    let user = match nix::unistd::User::from_name(PG_OS_USER) {
        Ok(Some(user)) => user,
        _ => {
            return Err(PgClusterError::NoPostgresUser(format!(
                "no `{PG_OS_USER}` OS user"
            )));
        }
    };
    std::os::unix::fs::chown(path, Some(user.uid.as_raw()), Some(user.gid.as_raw()))
        .map_err(io(format!("handing {} to {PG_OS_USER}", path.display())))
}

/// A new private directory under the temp dir, or under `/tmp` when the
/// `postgres` user could not reach the temp dir (a root-only `TMPDIR`).
fn make_dir() -> Result<PathBuf, PgClusterError> {
    let mut base = std::env::temp_dir();
    if nix::unistd::geteuid().is_root() && !reachable_by_others(&base) {
        base = PathBuf::from("/tmp");
    }
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = base.join(format!(
        "berth-pg-{}-{}-{nanos}",
        std::process::id(),
        NEXT_DB.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir(&dir).map_err(io(format!("creating {}", dir.display())))?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
        .map_err(io(format!("restricting {}", dir.display())))?;
    Ok(dir)
}

/// Whether every directory on the way to `dir` may be entered by others.
fn reachable_by_others(dir: &Path) -> bool {
    dir.ancestors()
        .all(|d| std::fs::metadata(d).is_ok_and(|m| m.permissions().mode() & 0o001 != 0))
}

fn probe_port() -> Result<u16, PgClusterError> {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(io("finding a free port"))
}
