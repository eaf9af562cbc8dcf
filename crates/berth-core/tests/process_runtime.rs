//! The smallest runtime that passes the runtime contract suite: each
//! program is a plain child process in a process group of its own, with no
//! isolation. It is a worked example of the seam, not a runtime to ship:
//! a runtime is one `Runtime` impl over `berth_core::program` (the
//! environment, the placeholders, the ready line), with nothing copied
//! from the other runtimes.
//!
//! All it knows lives on disk under one root, so a second runtime over the
//! same root finds what a first one left, as a restarted berth does:
//!
//! ```text
//! users/<slug>/home, users/<slug>/workspace/<folder>, users/<slug>/patch
//! logs/<slug>.<role>.log   the output of every run, kept
//! runs/<ref>/record.json   who the run is for, its wrapper, its log offset
//! runs/<ref>/exit          the exit code, written by the wrapper
//! runs/<ref>/killed        written before a SIGKILL
//! ```

#![allow(clippy::unwrap_used, reason = "a test: an unwrap is its assertion")]

use std::ffi::OsStr;
use std::io::{ErrorKind, SeekFrom};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use berth_core::program::{ProgramFacts, ready_line};
use berth_core::runtime::{
    Capabilities, Discovered, EVENT_BUFFER, ExitStatus, InstanceSpec, Patch, Runtime, RuntimeError,
    RuntimeEvent, RuntimeRef, Started,
};
use berth_core::runtime_contract::{Harness, Program, sh_command, token_pattern};
use berth_core::{Endpoint, Epoch, Reach, Role, Slug, UserId};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use regex::Regex;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

/// Runs the program (`$2…`) and writes its exit code into the run's
/// directory (`$1`): a runtime that adopts the run is not the program's
/// parent and cannot wait for it. The wrapper leads the run's process
/// group, so a signal to the group reaches the program and everything it
/// started. The wrapper ignores SIGTERM, to outlive a graceful stop and
/// record the exit; the program gets its own SIGTERM back.
const WRAPPER: &str = r#"run=$1; shift
trap '' TERM
(trap - TERM; exec "$@") &
wait "$!"
echo "$?" > "$run/exit.new" && mv "$run/exit.new" "$run/exit""#;

/// How often the files of a run are looked at again.
const POLL: Duration = Duration::from_millis(25);

/// Runs `command` for every user; see the module docs.
struct ProcessRuntime {
    root: PathBuf,
    command: Vec<String>,
    ready: Regex,
    /// The tasks that follow runs and logs, ended by `shutdown`.
    tasks: Mutex<JoinSet<()>>,
}

/// One run: its directory and its `record.json`, written once it runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Run {
    #[serde(skip)]
    dir: PathBuf,
    user: String,
    slug: String,
    role: Role,
    epoch: Epoch,
    instance_id: String,
    port: u16,
    /// The wrapper's pid, which is its process group's id, and its start
    /// time, so that a reused pid is never taken for it.
    group: u32,
    group_start: u64,
    /// The log, and where this run's output starts in it.
    log: PathBuf,
    log_offset: u64,
}

impl Run {
    /// The run in `dir`, if its record was written (a start that failed
    /// leaves none, and nothing running).
    fn load(dir: PathBuf) -> Option<Run> {
        let record = std::fs::read(dir.join("record.json")).ok()?;
        Some(Run {
            dir,
            ..serde_json::from_slice(&record).ok()?
        })
    }

    /// Writes the record whole, so a reader never sees half of it.
    fn save(&self) -> Result<(), RuntimeError> {
        let json = serde_json::to_vec(self).map_err(|e| RuntimeError::Failed(e.to_string()))?;
        let new = self.dir.join("record.new");
        std::fs::write(&new, json)
            .and_then(|()| std::fs::rename(&new, self.dir.join("record.json")))
            .map_err(failed("write the run's record"))
    }

    fn runtime_ref(&self) -> RuntimeRef {
        RuntimeRef::new(self.dir.file_name().unwrap_or_default().to_string_lossy())
    }

    fn alive(&self) -> bool {
        process(self.group).is_some_and(|(state, start)| state != 'Z' && start == self.group_start)
    }

    fn signal(&self, signal: Signal) -> Result<(), RuntimeError> {
        killpg(Pid::from_raw(self.group as i32), signal)
            .map_err(|e| RuntimeError::Failed(format!("cannot signal {}: {e}", self.runtime_ref())))
    }

    /// A SIGKILL ends the wrapper too, before it records anything: the
    /// mark tells that the missing exit code is this kill's.
    fn kill(&self) -> Result<(), RuntimeError> {
        std::fs::write(self.dir.join("killed"), "").map_err(failed("mark the kill"))?;
        self.signal(Signal::SIGKILL)
    }

    /// How the run ended, or `None` while it runs.
    async fn ended(&self) -> Option<ExitStatus> {
        // Liveness first: a wrapper found gone has written all it ever will.
        let alive = self.alive();
        let code = match std::fs::read_to_string(self.dir.join("exit")) {
            Ok(code) => code.trim().parse().ok(),
            Err(_) if alive => return None,
            Err(_) => None,
        };
        let killed = code.is_none() && self.dir.join("killed").exists();
        // Stdout and stderr share the log: the tail is of both.
        let output = lines_from(&self.log, self.log_offset)
            .await
            .map(|(lines, _)| lines.join("\n"))
            .unwrap_or_default();
        let tail = output.char_indices().rev().nth(499).map_or(0, |(at, _)| at);
        Some(ExitStatus {
            code,
            signal: killed.then_some(Signal::SIGKILL as i32),
            stderr_tail: output[tail..].to_owned(),
            out_of_memory: None,
            port_in_use: false,
        })
    }

    /// The launch token of the first ready line after byte `offset` of the
    /// log (`Some(None)`: ready, without a token), and where to look next.
    async fn ready_after(&self, pattern: &Regex, offset: u64) -> (Option<Option<String>>, u64) {
        let Ok((lines, next)) = lines_from(&self.log, offset).await else {
            return (None, offset);
        };
        let token = lines.iter().find_map(|line| ready_line(pattern, line));
        (token.map(|token| token.map(str::to_owned)), next)
    }
}

/// A process's state letter and start time, from the process table.
fn process(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces: count the fields after its `)`,
    // from the state (the 3rd) to the start time (the 22nd).
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    Some((
        fields.first()?.chars().next()?,
        fields.get(19)?.parse().ok()?,
    ))
}

/// The complete lines of `path` from byte `offset` on, and the offset
/// after them; a missing file has none.
async fn lines_from(path: &Path, offset: u64) -> std::io::Result<(Vec<String>, u64)> {
    let mut file = match tokio::fs::File::open(path).await {
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok((Vec::new(), offset)),
        file => file?,
    };
    file.seek(SeekFrom::Start(offset)).await?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).await?;
    let complete = bytes
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(0, |end| end + 1);
    let lines = String::from_utf8_lossy(&bytes[..complete])
        .lines()
        .map(str::to_owned)
        .collect();
    Ok((lines, offset + complete as u64))
}

/// Whether `program` names an executable file, as a path or on `PATH`.
fn executable(program: &str) -> bool {
    let is_executable = |path: &Path| {
        path.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    let path = std::env::var_os("PATH").unwrap_or_default();
    match program.contains('/') {
        true => is_executable(Path::new(program)),
        false => std::env::split_paths(&path).any(|dir| is_executable(&dir.join(program))),
    }
}

/// The hinted port if it is free, else any free one, released for the
/// program to take. (A watchdog gets one too, not its main's: unlike the
/// local runtime, this one keeps no table of its users' ports.)
fn free_port(hint: Option<u16>) -> Result<u16, RuntimeError> {
    let bind = |port| std::net::TcpListener::bind(("127.0.0.1", port));
    bind(hint.unwrap_or(0))
        .or_else(|_| bind(0))
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .map_err(|e| RuntimeError::CapacityExhausted(format!("no free port: {e}")))
}

fn failed(what: &str) -> impl FnOnce(std::io::Error) -> RuntimeError + '_ {
    move |e| RuntimeError::Failed(format!("cannot {what}: {e}"))
}

fn text(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

impl ProcessRuntime {
    fn user_dir(&self, slug: &Slug) -> PathBuf {
        self.root.join("users").join(slug.as_str())
    }

    fn log(&self, slug: &Slug, role: Role) -> PathBuf {
        self.root.join("logs").join(format!("{slug}.{role}.log"))
    }

    /// The run `instance` names (`live`: only while it runs).
    fn run(&self, instance: &RuntimeRef, live: bool) -> Result<Run, RuntimeError> {
        let name = instance.as_str();
        // A ref is one file name, never a path that leads elsewhere.
        let run = (Path::new(name).file_name() == Some(OsStr::new(name)))
            .then(|| Run::load(self.root.join("runs").join(name)))
            .flatten();
        run.filter(|run| !live || run.alive())
            .ok_or_else(|| RuntimeError::Gone(instance.clone()))
    }

    /// Makes the user's home and working directory, and writes, removes
    /// or keeps the user's patch: the paths of the three.
    fn prepare(
        &self,
        spec: &InstanceSpec,
    ) -> Result<(String, String, Option<String>), RuntimeError> {
        let user_dir = self.user_dir(&spec.slug);
        let (home, mut folder) = (user_dir.join("home"), user_dir.join("workspace"));
        if !spec.folder.is_empty() {
            folder.push(&spec.folder);
        }
        for dir in [&home, &folder, &self.root.join("logs")] {
            std::fs::create_dir_all(dir).map_err(failed("create the user's directories"))?;
        }
        let patch = user_dir.join("patch");
        match &spec.patch {
            Patch::Set(Some(content)) => std::fs::write(&patch, content),
            Patch::Set(None) if patch.exists() => std::fs::remove_file(&patch),
            Patch::Set(None) | Patch::Unchanged => Ok(()),
        }
        .map_err(failed("write the patch"))?;
        let patch = patch.exists().then(|| text(&patch));
        Ok((text(&home), text(&folder), patch))
    }

    /// Runs `task` until it ends or the runtime shuts down.
    fn spawn_task(&self, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .spawn(task);
    }

    /// Hands out the events of `run`, the same for a run just started and
    /// one adopted: readiness, from its ready line, then its exit.
    fn follow(&self, run: Run) -> Started {
        let (tx, events) = mpsc::channel(EVENT_BUFFER);
        let started = Started {
            runtime_ref: run.runtime_ref(),
            // The wrapper's: it leads the group the program runs in.
            pid: Some(run.group),
            endpoint: (run.role == Role::Main).then(|| Endpoint {
                host: "127.0.0.1".to_owned(),
                port: run.port,
                reach: Reach::default(),
            }),
            events,
        };
        let pattern = self.ready.clone();
        self.spawn_task(async move {
            let (mut offset, mut ready) = (run.log_offset, false);
            loop {
                // The exit is read before the output, so that every line
                // the program wrote is seen before its exit is told.
                let exit = run.ended().await;
                if !ready {
                    let token;
                    (token, offset) = run.ready_after(&pattern, offset).await;
                    if let Some(token) = token {
                        ready = true;
                        if tx.send(RuntimeEvent::Ready { token }).await.is_err() {
                            return;
                        }
                    }
                }
                if let Some(exit) = exit {
                    let _ = tx.send(RuntimeEvent::Exited(exit)).await;
                    return;
                }
                if tx.is_closed() {
                    return;
                }
                tokio::time::sleep(POLL).await;
            }
        });
        started
    }
}

#[async_trait]
impl Runtime for ProcessRuntime {
    fn name(&self) -> &'static str {
        "process"
    }

    /// No freeze, no fence deadline: the trait's defaults answer
    /// `Unsupported`, and the controller does not ask.
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    async fn start(&self, spec: InstanceSpec) -> Result<Started, RuntimeError> {
        let (home, folder, patch) = self.prepare(&spec)?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let name = format!("{}.{}.{}", spec.slug, spec.role, now.as_nanos());
        let dir = self.root.join("runs").join(name);
        std::fs::create_dir_all(&dir).map_err(failed("create the run's directory"))?;
        let handoff = match &spec.handoff {
            Some(content) => {
                let file = dir.join("handoff.json");
                std::fs::write(&file, content).map_err(failed("write the handoff"))?;
                Some(text(&file))
            }
            None => None,
        };
        let port = free_port(spec.port_hint)?;
        let facts = ProgramFacts {
            user: &spec.user,
            slug: &spec.slug,
            role: spec.role,
            port,
            home: &home,
            folder: &folder,
            patch: patch.as_deref(),
            epoch: spec.epoch,
            instance_id: &spec.instance_id,
            handoff: handoff.as_deref(),
        };
        let argv = facts.render(&self.command);
        let program = argv.first().map_or("", String::as_str);
        if !executable(program) {
            return Err(RuntimeError::SpawnFailed(format!(
                "cannot start {program}: not found"
            )));
        }
        let log = self.log(&spec.slug, spec.role);
        let output = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log);
        let output = output.map_err(failed("open the log"))?;
        let log_offset = output.metadata().map_err(failed("open the log"))?.len();
        let mut command = tokio::process::Command::new("sh");
        command
            .args(["-c", WRAPPER, "sh"])
            .arg(&dir)
            .args(&argv)
            .current_dir(&folder)
            // The program sees PATH, the configured extras and berth's
            // variables (which win), nothing else of berth's environment.
            .env_clear()
            .envs(std::env::var_os("PATH").map(|path| ("PATH", path)))
            .envs(spec.env.iter().cloned())
            .envs(
                facts
                    .environment()
                    .into_iter()
                    .map(|(v, value)| (v.name(), value)),
            )
            .stdin(Stdio::null())
            .stdout(output.try_clone().map_err(failed("open the log"))?)
            .stderr(output)
            .process_group(0);
        let wrapper = command
            .spawn()
            .map_err(|e| RuntimeError::SpawnFailed(format!("cannot start {program}: {e}")))?;
        // Dropping the handle leaves the wrapper running: the run outlives
        // this runtime, as it must outlive berth.
        let group = wrapper.id().unwrap_or_default();
        let group_start = process(group).map_or(0, |(_, start)| start);
        let run = Run {
            dir,
            user: spec.user.as_str().to_owned(),
            slug: spec.slug.to_string(),
            role: spec.role,
            epoch: spec.epoch,
            instance_id: spec.instance_id,
            port,
            group,
            group_start,
            log,
            log_offset,
        };
        if let Err(e) = run.save() {
            let _ = run.signal(Signal::SIGKILL);
            return Err(e);
        }
        Ok(self.follow(run))
    }

    async fn stop(&self, instance: &RuntimeRef, grace: Duration) -> Result<(), RuntimeError> {
        let run = self.run(instance, true)?;
        run.signal(Signal::SIGTERM)?;
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            if run.alive() {
                let _ = run.kill();
            }
        });
        Ok(())
    }

    async fn kill(&self, instance: &RuntimeRef) -> Result<(), RuntimeError> {
        self.run(instance, true)?.kill()
    }

    async fn discover(&self) -> Result<Vec<Discovered>, RuntimeError> {
        let entries = match std::fs::read_dir(self.root.join("runs")) {
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
            entries => entries.map_err(failed("list the runs"))?,
        };
        let mut found = Vec::new();
        for entry in entries {
            let Some(run) = Run::load(entry.map_err(failed("list the runs"))?.path()) else {
                continue;
            };
            let exit = run.ended().await;
            let (token, _) = run.ready_after(&self.ready, run.log_offset).await;
            found.push(Discovered {
                user: UserId::parse(&run.user).ok(),
                slug: run.slug.clone(),
                role: run.role,
                instance_id: run.instance_id.clone(),
                epoch: run.epoch,
                runtime_ref: run.runtime_ref(),
                alive: exit.is_none(),
                frozen: false,
                ready: token.is_some(),
                token: token.flatten(),
                exit,
            });
        }
        Ok(found)
    }

    async fn adopt(&self, found: &Discovered) -> Result<Started, RuntimeError> {
        Ok(self.follow(self.run(&found.runtime_ref, false)?))
    }

    async fn remove(&self, found: &Discovered) -> Result<(), RuntimeError> {
        let run = self.run(&found.runtime_ref, false)?;
        if run.alive() {
            run.kill()?;
        }
        std::fs::remove_dir_all(&run.dir).map_err(failed("remove the run"))
    }

    async fn logs(
        &self,
        slug: &Slug,
        role: Role,
        tail: usize,
    ) -> Result<Vec<String>, RuntimeError> {
        let (mut lines, _) = lines_from(&self.log(slug, role), 0)
            .await
            .map_err(failed("read the log"))?;
        Ok(lines.split_off(lines.len().saturating_sub(tail)))
    }

    async fn follow_logs(
        &self,
        slug: &Slug,
        role: Role,
        tail: usize,
    ) -> Result<mpsc::Receiver<String>, RuntimeError> {
        let path = self.log(slug, role);
        let (mut lines, mut offset) = lines_from(&path, 0).await.map_err(failed("read the log"))?;
        lines = lines.split_off(lines.len().saturating_sub(tail));
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        self.spawn_task(async move {
            loop {
                for line in lines {
                    if tx.send(line).await.is_err() {
                        return;
                    }
                }
                tokio::time::sleep(POLL).await;
                if tx.is_closed() {
                    return;
                }
                let Ok(more) = lines_from(&path, offset).await else {
                    return;
                };
                (lines, offset) = more;
            }
        });
        Ok(rx)
    }

    async fn shutdown(&self) {
        self.tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .abort_all();
    }
}

// --- the harness ------------------------------------------------------------

/// One root for every runtime of a case; when the case ends, whatever it
/// left running is killed.
struct ProcessHarness {
    root: tempfile::TempDir,
}

#[async_trait]
impl Harness for ProcessHarness {
    async fn runtime(&self, program: &Program) -> Arc<dyn Runtime> {
        Arc::new(ProcessRuntime {
            root: self.root.path().to_owned(),
            command: sh_command(program),
            ready: token_pattern(),
            tasks: Mutex::default(),
        })
    }

    async fn running(&self, _runtime_ref: &RuntimeRef, pid: Option<u32>) -> bool {
        pid.and_then(process).is_some_and(|(state, _)| state != 'Z')
    }
}

impl Drop for ProcessHarness {
    fn drop(&mut self) {
        let runs = std::fs::read_dir(self.root.path().join("runs"))
            .into_iter()
            .flatten();
        for run in runs.flatten().filter_map(|entry| Run::load(entry.path())) {
            if run.alive() {
                let _ = run.signal(Signal::SIGKILL);
            }
        }
    }
}

berth_core::runtime_contract_tests!(ProcessHarness {
    root: tempfile::tempdir().unwrap()
});
