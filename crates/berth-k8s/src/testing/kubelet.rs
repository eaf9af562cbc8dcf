//! The double's stand-in kubelet: it runs each pod's `main` container as
//! a local process (its `command` and `args`, after the kubelet's `$(VAR)`
//! expansion, with its env), reports its state in the pod's status, keeps
//! its output as the pod's log, probes its readiness, and ends it on
//! deletion (SIGTERM to its process group, SIGKILL after the grace
//! period).
//!
//! What differs from a real node, because pods share this machine: the
//! image is not run (only the command), every volume is a local directory
//! (paths under a mount path are rewritten to it), other containers
//! (sidecars) are reported running without a process, the pod's first
//! container port becomes a free local port passed in `BERTH_PORT` (and a
//! pod shim's control port another, in `BERTH_SHIM_CONTROL`, which the
//! user's EndpointSlice lists), the process runs as the test's own user
//! (a claim is made the pod's fsGroup's only when that user is root),
//! and pods share this machine's pid namespace (so a pod's shim runs its
//! program under a uid of that pod's own, not the configured one; only
//! root may do that).

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use super::deletion::remove_if_finished;
use super::store::Key;
use super::world::{PodRun, Shared, lock};

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// A TCP port nobody listens on right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// The kubelet's `$(VAR)` expansion: defined variables are replaced, `$$`
/// is a `$`, anything else stays.
pub fn expand(text: &str, env: &HashMap<String, String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(close) = inner.find(')')
            && let Some(value) = env.get(&inner[..close])
        {
            out.push_str(value);
            rest = &inner[close + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The value of a downward-API field path.
fn field(pod: &Value, path: &str) -> String {
    let meta = &pod["metadata"];
    let quoted = |prefix: &str| {
        path.strip_prefix(prefix)
            .and_then(|p| p.strip_suffix("']"))
            .map(str::to_owned)
    };
    let value = if let Some(key) = quoted("metadata.annotations['") {
        &meta["annotations"][key]
    } else if let Some(key) = quoted("metadata.labels['") {
        &meta["labels"][key]
    } else {
        match path {
            "metadata.name" => &meta["name"],
            "metadata.namespace" => &meta["namespace"],
            "metadata.uid" => &meta["uid"],
            "spec.nodeName" => &pod["spec"]["nodeName"],
            "status.podIP" => return "127.0.0.1".into(),
            _ => &Value::Null,
        }
    };
    value.as_str().unwrap_or_default().to_owned()
}

/// How to start a pod's program here.
struct Launch {
    program: Vec<String>,
    env: Vec<(String, String)>,
    cwd: PathBuf,
    probe: Option<Value>,
    port: u16,
    /// The uid its shim runs the program as, for a pod with berth's shim.
    program_uid: Option<u32>,
}

/// A uid for a pod's program here: one per pod, from a range of this
/// process's own (several doubles may run in one test process).
fn next_program_uid() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    760_000 + std::process::id() % 100 * 1_000 + NEXT.fetch_add(1, Ordering::Relaxed) % 1_000
}

/// The value of a `secretKeyRef` (`name`, `key`) in `namespace`.
fn secret_value(
    shared: &Shared,
    namespace: &str,
    reference: &serde_json::Map<String, Value>,
) -> Result<String, String> {
    let name = reference
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let key = reference
        .get("key")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let object_key = (
        super::store::Kind::Secret,
        namespace.to_owned(),
        name.to_owned(),
    );
    let encoded = lock(&shared.world)
        .store
        .objects
        .get(&object_key)
        .and_then(|secret| secret["data"][key].as_str().map(str::to_owned))
        .ok_or_else(|| format!("secret {name:?} has no key {key:?}"))?;
    let bytes: k8s_openapi::ByteString = serde_json::from_value(Value::String(encoded))
        .map_err(|e| format!("secret {name:?} key {key:?}: {e}"))?;
    String::from_utf8(bytes.0).map_err(|e| format!("secret {name:?} key {key:?}: {e}"))
}

/// Local directories for the pod's volumes, and the program's command,
/// env and working directory with container paths rewritten to them.
fn prepare(
    shared: &Shared,
    pod: &Value,
    uid: &str,
    (port, shim_port, program_uid): (u16, u16, u32),
) -> Result<Launch, String> {
    let spec = &pod["spec"];
    let containers = spec["containers"].as_array().cloned().unwrap_or_default();
    let main = containers
        .iter()
        .find(|c| c["name"] == crate::manifest::MAIN_CONTAINER)
        .or_else(|| containers.first())
        .cloned()
        .ok_or("the pod has no container")?;
    let pod_dir = shared.root.join("pods").join(uid);
    let mut volumes: HashMap<String, PathBuf> = HashMap::new();
    let ns = pod["metadata"]["namespace"].as_str().unwrap_or_default();
    for volume in spec["volumes"].as_array().cloned().unwrap_or_default() {
        let name = volume["name"].as_str().unwrap_or_default().to_owned();
        let dir = if let Some(claim) = volume["persistentVolumeClaim"]["claimName"].as_str() {
            let dir = shared.root.join("claims").join(claim);
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            // Like the kubelet, the volume is made the pod's fsGroup's; only
            // root may give a file away, and a test run as another user runs
            // every pod's program as that user anyway.
            if let Some(group) = spec["securityContext"]["fsGroup"].as_u64()
                && nix::unistd::geteuid().is_root()
            {
                let group = u32::try_from(group).map_err(|e| e.to_string())?;
                std::os::unix::fs::chown(&dir, None, Some(group)).map_err(|e| e.to_string())?;
                std::fs::set_permissions(&dir, PermissionsExt::from_mode(0o2775))
                    .map_err(|e| e.to_string())?;
            }
            dir
        } else if let Some(map) = volume["configMap"]["name"].as_str() {
            let dir = pod_dir.join("configmaps").join(&name);
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            let key = (super::store::Kind::ConfigMap, ns.to_owned(), map.to_owned());
            let data = lock(&shared.world)
                .store
                .objects
                .get(&key)
                .map(|m| m["data"].clone());
            if let Some(Value::Object(data)) = data {
                for (file, content) in data {
                    std::fs::write(dir.join(file), content.as_str().unwrap_or_default())
                        .map_err(|e| e.to_string())?;
                }
            }
            dir
        } else {
            // An emptyDir is writable by every uid of the pod.
            let dir = pod_dir.join("volumes").join(&name);
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            std::fs::set_permissions(&dir, PermissionsExt::from_mode(0o1777))
                .map_err(|e| e.to_string())?;
            dir
        };
        volumes.insert(name, dir);
    }
    let mut mounts: Vec<(String, PathBuf)> = Vec::new();
    for mount in main["volumeMounts"].as_array().cloned().unwrap_or_default() {
        let Some(dir) = volumes.get(mount["name"].as_str().unwrap_or_default()) else {
            continue;
        };
        let dir = match mount["subPath"].as_str() {
            Some(sub) => dir.join(sub),
            None => dir.clone(),
        };
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        mounts.push((
            mount["mountPath"].as_str().unwrap_or_default().to_owned(),
            dir,
        ));
    }
    mounts.sort_by_key(|(path, _)| std::cmp::Reverse(path.len()));
    let local = |text: &str| -> String {
        for (path, dir) in &mounts {
            if let Some(rest) = text.strip_prefix(path.as_str())
                && (rest.is_empty() || rest.starts_with('/'))
            {
                return format!("{}{rest}", dir.display());
            }
        }
        text.to_owned()
    };
    let mut env: Vec<(String, String)> = Vec::new();
    let mut defined: HashMap<String, String> = HashMap::new();
    for var in main["env"].as_array().cloned().unwrap_or_default() {
        let name = var["name"].as_str().unwrap_or_default().to_owned();
        let value = if name == "BERTH_PORT" {
            port.to_string()
        } else if name == berth_core::shim_wire::pod_env::RUN_AS {
            // Pods share this machine's pid namespace: a shim's sweeps of
            // its program's uid would reach every pod's program if they
            // shared one, so each pod's program gets a uid of its own (its
            // group, the volume's, stays).
            let value = var["value"].as_str().unwrap_or_default();
            let group = value.split_once(':').map_or("", |(_, g)| g);
            format!("{program_uid}:{group}")
        } else if name == berth_core::shim_wire::pod_env::CONTROL {
            // Pods share this machine's addresses: the shim gets a free
            // local port, which the Service's EndpointSlice lists.
            format!("127.0.0.1:{shim_port}")
        } else if let Some(path) = var["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            field(pod, path)
        } else if let Some(reference) = var["valueFrom"]["secretKeyRef"].as_object() {
            // Like the kubelet, a container whose Secret is missing does
            // not start.
            secret_value(shared, ns, reference)?
        } else {
            local(&expand(var["value"].as_str().unwrap_or_default(), &defined))
        };
        defined.insert(name.clone(), value.clone());
        env.push((name, value));
    }
    let words = |key: &str| -> Vec<String> {
        main[key]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|w| local(&expand(w.as_str().unwrap_or_default(), &defined)))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut program = words("command");
    program.extend(words("args"));
    if program.is_empty() {
        return Err("the double runs a container's command, and this one has none".into());
    }
    let cwd = main["workingDir"]
        .as_str()
        .map(|w| PathBuf::from(local(w)))
        .unwrap_or_else(|| pod_dir.join("cwd"));
    // Like containerd, create a missing working directory.
    std::fs::create_dir_all(&cwd).map_err(|e| e.to_string())?;
    let has_shim = env
        .iter()
        .any(|(name, _)| name == berth_core::shim_wire::pod_env::RUN_AS);
    Ok(Launch {
        program,
        env,
        cwd,
        probe: main.get("readinessProbe").cloned(),
        port,
        program_uid: has_shim.then_some(program_uid),
    })
}

/// Changes the pod `key` if it is still `uid`, records it as MODIFIED,
/// and removes it when it is deleted, ended and no finalizer holds it.
pub fn update(shared: &Shared, key: &Key, uid: &str, change: impl FnOnce(&mut Value)) {
    let mut world = lock(&shared.world);
    let Some(mut pod) = world.store.objects.get(key).cloned() else {
        return;
    };
    if pod["metadata"]["uid"] != uid {
        return;
    }
    change(&mut pod);
    world.store.put(key.clone(), pod, "MODIFIED");
    remove_if_finished(&mut world.store, key);
}

fn container_statuses(pod: &Value, main: Value) -> Value {
    let containers = pod["spec"]["containers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let running = main["state"]["running"].is_object();
    Value::Array(
        containers
            .iter()
            .map(|c| {
                if c["name"] == main["name"] {
                    main.clone()
                } else {
                    // A sidecar the double does not run: shown running while
                    // the program runs.
                    let state = if running {
                        json!({ "running": { "startedAt": now() } })
                    } else {
                        json!({ "waiting": { "reason": "ContainerCreating" } })
                    };
                    json!({
                        "name": c["name"], "image": c["image"], "imageID": "",
                        "ready": running, "restartCount": 0, "started": running, "state": state,
                    })
                }
            })
            .collect(),
    )
}

fn set_status(pod: &mut Value, phase: &str, ready: bool, main: Value) {
    let flag = |b: bool| if b { "True" } else { "False" };
    let statuses = container_statuses(pod, main);
    let status = &mut pod["status"];
    status["phase"] = json!(phase);
    status["podIP"] = json!("127.0.0.1");
    status["conditions"] = json!([
        { "type": "PodScheduled", "status": "True" },
        { "type": "Initialized", "status": "True" },
        { "type": "ContainersReady", "status": flag(ready) },
        { "type": "Ready", "status": flag(ready) },
    ]);
    status["containerStatuses"] = statuses;
}

fn main_status(pod: &Value, ready: bool, restarts: i32, state: Value, last: Value) -> Value {
    let containers = pod["spec"]["containers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let main = containers
        .iter()
        .find(|c| c["name"] == crate::manifest::MAIN_CONTAINER)
        .or_else(|| containers.first())
        .cloned()
        .unwrap_or(Value::Null);
    let mut status = json!({
        "name": main["name"], "image": main["image"], "imageID": "",
        "ready": ready, "restartCount": restarts, "started": state["running"].is_object(),
        "state": state,
    });
    if !last.is_null() {
        status["lastState"] = last;
    }
    status
}

/// Starts pod `key` (`uid`): its program, its log, its probes.
pub fn admit(shared: &Arc<Shared>, key: Key, uid: String) {
    let port = free_port();
    let shim_port = free_port();
    let program_uid = next_program_uid();
    lock(&shared.world).runs.insert(
        uid.clone(),
        PodRun {
            log: Vec::new(),
            log_closed: false,
            log_changed: Arc::new(tokio::sync::Notify::new()),
            port,
            shim_port,
            program_uid,
            has_shim: false,
            pgid: None,
            ready_override: None,
            restarts: 0,
        },
    );
    let shared2 = shared.clone();
    shared.tasks.spawn(async move {
        let cancel = shared2.cancel.clone();
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = run(&shared2, &key, &uid, (port, shim_port, program_uid), Value::Null) => {}
        }
    });
}

/// Runs the pod's program once (and again after a simulated restart).
async fn run(shared: &Arc<Shared>, key: &Key, uid: &str, ports: (u16, u16, u32), mut last: Value) {
    loop {
        let Some(pod) = lock(&shared.world).store.objects.get(key).cloned() else {
            return;
        };
        if pod["metadata"]["uid"] != uid || pod["metadata"]["deletionTimestamp"].is_string() {
            end_unstarted(shared, key, uid);
            return;
        }
        let restarts = lock(&shared.world).runs.get(uid).map_or(0, |r| r.restarts);
        let launch = match prepare(shared, &pod, uid, ports) {
            Ok(launch) => launch,
            Err(message) => {
                fail_start(shared, key, uid, &message, restarts, last);
                return;
            }
        };
        let mut command = tokio::process::Command::new(&launch.program[0]);
        command
            .args(&launch.program[1..])
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(launch.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&launch.cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                // As containerd words it, more or less.
                let message = if e.kind() == std::io::ErrorKind::NotFound {
                    format!(
                        "failed to create containerd task: exec: \"{}\": executable file not found in $PATH: unknown",
                        launch.program[0]
                    )
                } else {
                    format!(
                        "failed to create containerd task: exec: \"{}\": {e}",
                        launch.program[0]
                    )
                };
                fail_start(shared, key, uid, &message, restarts, last);
                return;
            }
        };
        let pgid = child.id().and_then(|p| i32::try_from(p).ok());
        let program_uid = launch.program_uid;
        let readers = {
            let mut world = lock(&shared.world);
            let Some(run) = world.runs.get_mut(uid) else {
                return;
            };
            run.pgid = pgid;
            run.has_shim = program_uid.is_some();
            let notify = run.log_changed.clone();
            drop(world);
            let out = child
                .stdout
                .take()
                .map(|s| read_lines(shared.clone(), uid.to_owned(), s, notify.clone()));
            let err = child
                .stderr
                .take()
                .map(|s| read_lines(shared.clone(), uid.to_owned(), s, notify));
            (out, err)
        };
        let started_at = now();
        let running = json!({ "running": { "startedAt": started_at } });
        let unprobed = launch.probe.is_none();
        update(shared, key, uid, |pod| {
            let main = main_status(pod, unprobed, restarts, running.clone(), last.clone());
            set_status(pod, "Running", unprobed, main);
        });
        // A pod deleted while it was starting is ended now.
        if let Some(grace) = deletion_grace(shared, key, uid) {
            terminate(shared, uid, grace);
        }
        let probing = probe(
            shared.clone(),
            key.clone(),
            uid.to_owned(),
            launch,
            restarts,
            last.clone(),
        );
        let status = tokio::select! {
            status = child.wait() => status,
            () = probing => child.wait().await,
        };
        for reader in [readers.0, readers.1].into_iter().flatten() {
            let _ = reader.await;
        }
        let code = match status {
            Ok(s) => s
                .code()
                .or_else(|| std::os::unix::process::ExitStatusExt::signal(&s).map(|sig| 128 + sig))
                .unwrap_or(-1),
            Err(_) => -1,
        };
        // Whatever is left of the group goes with the program, and, as
        // with a pod's pid namespace, every process of its program's uid.
        if let Some(pgid) = pgid {
            let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
        }
        if let Some(program_uid) = program_uid {
            let _ = tokio::task::spawn_blocking(move || end_namespace(program_uid)).await;
        }
        let (restart, message) = {
            let mut world = lock(&shared.world);
            let Some(run) = world.runs.get_mut(uid) else {
                return;
            };
            run.pgid = None;
            let restart = run.restarts > restarts;
            let tail: Vec<&String> = run.log.iter().rev().take(80).collect();
            let mut message: String = tail.into_iter().rev().map(|l| format!("{l}\n")).collect();
            while message.len() > 2048 {
                message.remove(0);
            }
            if !restart {
                run.log_closed = true;
                run.log_changed.notify_waiters();
            }
            (restart, message)
        };
        let fallback = pod["spec"]["containers"]
            .as_array()
            .and_then(|c| {
                c.iter()
                    .find(|c| c["name"] == crate::manifest::MAIN_CONTAINER)
            })
            .is_some_and(|c| c["terminationMessagePolicy"] == "FallbackToLogsOnError");
        let mut terminated = json!({
            "exitCode": code,
            "reason": if code == 0 { "Completed" } else { "Error" },
            "startedAt": started_at,
            "finishedAt": now(),
        });
        if code != 0 && fallback && !message.is_empty() {
            terminated["message"] = json!(message);
        }
        if restart {
            // A restart the kubelet made (a control of the double): the
            // same pod runs its program again.
            last = json!({ "terminated": terminated });
            continue;
        }
        update(shared, key, uid, |pod| {
            let phase = if code == 0 { "Succeeded" } else { "Failed" };
            let main = main_status(
                pod,
                false,
                restarts,
                json!({ "terminated": terminated }),
                last.clone(),
            );
            set_status(pod, phase, false, main);
        });
        return;
    }
}

fn read_lines<R>(
    shared: Arc<Shared>,
    uid: String,
    stream: R,
    notify: Arc<tokio::sync::Notify>,
) -> tokio::task::JoinHandle<()>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
{
    let tasks = shared.tasks.clone();
    tasks.spawn(async move {
        let mut lines = BufReader::new(stream).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(run) = lock(&shared.world).runs.get_mut(&uid) {
                run.log.push(line);
            }
            notify.notify_waiters();
        }
    })
}

/// The pod never ran its program.
fn fail_start(shared: &Shared, key: &Key, uid: &str, message: &str, restarts: i32, last: Value) {
    if let Some(run) = lock(&shared.world).runs.get_mut(uid) {
        run.log_closed = true;
        run.log_changed.notify_waiters();
    }
    update(shared, key, uid, |pod| {
        let state = json!({ "terminated": {
            "exitCode": 128, "reason": "StartError", "message": message,
            "startedAt": "1970-01-01T00:00:00Z", "finishedAt": now(),
        }});
        let main = main_status(pod, false, restarts, state, last);
        set_status(pod, "Failed", false, main);
    });
}

/// A pod deleted before it ran: it ends without a container state.
fn end_unstarted(shared: &Shared, key: &Key, uid: &str) {
    if let Some(run) = lock(&shared.world).runs.get_mut(uid) {
        run.log_closed = true;
        run.log_changed.notify_waiters();
    }
    update(shared, key, uid, |pod| {
        pod["status"]["phase"] = json!("Failed");
    });
}

fn deletion_grace(shared: &Shared, key: &Key, uid: &str) -> Option<u64> {
    let world = lock(&shared.world);
    let pod = world.store.objects.get(key)?;
    if pod["metadata"]["uid"] != uid || !pod["metadata"]["deletionTimestamp"].is_string() {
        return None;
    }
    pod["metadata"]["deletionGracePeriodSeconds"]
        .as_u64()
        .or(Some(30))
}

/// Probes until the pod is ready (or an override says), then keeps the
/// condition as the override says. Never returns while the program runs.
async fn probe(
    shared: Arc<Shared>,
    key: Key,
    uid: String,
    launch: Launch,
    restarts: i32,
    last: Value,
) {
    let mut ready = launch.probe.is_none();
    loop {
        let override_ = lock(&shared.world)
            .runs
            .get(&uid)
            .and_then(|r| r.ready_override);
        let now_ready = match (override_, &launch.probe) {
            (Some(forced), _) => forced,
            (None, None) => true,
            (None, Some(probe)) => ready || probe_once(probe, launch.port).await,
        };
        if now_ready != ready {
            ready = now_ready;
            update(&shared, &key, &uid, |pod| {
                let state = pod["status"]["containerStatuses"]
                    .as_array()
                    .and_then(|all| {
                        all.iter()
                            .find(|c| c["name"] == crate::manifest::MAIN_CONTAINER)
                    })
                    .map(|c| c["state"].clone())
                    .unwrap_or(Value::Null);
                if state["running"].is_object() {
                    let main = main_status(pod, ready, restarts, state, last.clone());
                    set_status(pod, "Running", ready, main);
                }
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn probe_once(probe: &Value, port: u16) -> bool {
    let connect = tokio::net::TcpStream::connect(("127.0.0.1", port));
    let Ok(Ok(mut stream)) = tokio::time::timeout(Duration::from_secs(1), connect).await else {
        return false;
    };
    let Some(path) = probe["httpGet"]["path"].as_str() else {
        return true;
    };
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    let read = tokio::time::timeout(Duration::from_secs(1), stream.read_exact(&mut head)).await;
    matches!(read, Ok(Ok(_)))
        && std::str::from_utf8(&head[9..12])
            .ok()
            .and_then(|c| c.parse::<u16>().ok())
            .is_some_and(|code| (200..400).contains(&code))
}

/// Ends the program of pod `uid`: SIGTERM, then SIGKILL after `grace`
/// seconds (at once for 0).
pub fn terminate(shared: &Arc<Shared>, uid: &str, grace: u64) {
    let Some(pgid) = lock(&shared.world).runs.get(uid).and_then(|r| r.pgid) else {
        return;
    };
    let group = Pid::from_raw(pgid);
    if grace == 0 {
        let _ = killpg(group, Signal::SIGKILL);
        return;
    }
    let _ = killpg(group, Signal::SIGTERM);
    let (shared2, uid) = (shared.clone(), uid.to_owned());
    shared.tasks.spawn(async move {
        tokio::select! {
            _ = shared2.cancel.cancelled() => {}
            () = tokio::time::sleep(Duration::from_secs(grace)) => {
                let still = lock(&shared2.world).runs.get(&uid).and_then(|r| r.pgid) == Some(pgid);
                if still {
                    let _ = killpg(group, Signal::SIGKILL);
                }
            }
        }
    });
}

/// What ends with a pod's pid namespace here: SIGKILL to every process
/// of `program_uid` (one pod's alone, see [`next_program_uid`]) until none is
/// left, or a second has passed.
fn end_namespace(program_uid: u32) {
    for _ in 0..100 {
        let members: Vec<i32> = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .filter(|pid: &i32| {
                std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|status| {
                    status.lines().any(|l| {
                        l.strip_prefix("Uid:").is_some_and(|uids| {
                            uids.split_whitespace()
                                .any(|u| u.parse() == Ok(program_uid))
                        })
                    }) && !status.lines().any(|l| l.starts_with("State:\tZ"))
                })
            })
            .collect();
        if members.is_empty() {
            return;
        }
        for pid in members {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Kills every program the double runs (on drop).
pub fn kill_all(shared: &Shared) {
    for run in lock(&shared.world).runs.values() {
        if let Some(pgid) = run.pgid {
            let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
        }
        if run.has_shim {
            end_namespace(run.program_uid);
        }
    }
}

/// The directory a claim's data is in.
pub fn claim_dir(root: &Path, claim: &str) -> PathBuf {
    root.join("claims").join(claim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_expand_like_the_kubelets() {
        let env = HashMap::from([("A".to_owned(), "1".to_owned())]);
        assert_eq!(expand("x$(A)y", &env), "x1y");
        assert_eq!(expand("$(B)", &env), "$(B)");
        assert_eq!(expand("$$(A)", &env), "$(A)");
        assert_eq!(expand("a$b$", &env), "a$b$");
        assert_eq!(expand("$(A", &env), "$(A");
    }

    #[test]
    fn field_paths_read_the_pod() {
        let pod = json!({ "metadata": { "name": "p", "annotations": { "berth.dev/epoch": "4" } } });
        assert_eq!(field(&pod, "metadata.annotations['berth.dev/epoch']"), "4");
        assert_eq!(field(&pod, "metadata.name"), "p");
        assert_eq!(field(&pod, "metadata.labels['x']"), "");
    }
}
