//! The shim as a pod's entrypoint (`berth shim pod -- PROGRAM ARGS…`): the
//! same supervision as on a host (the program as its child, under another
//! uid, frozen and thawed by sweeps of that uid, a fence deadline, hooks,
//! a stop that never thaws), reached over the pod network instead of a
//! local socket.
//!
//! Why the shim may be trusted with this inside a pod the user's program
//! shares:
//! * The shim runs as root in the container and the program as
//!   `RUN_AS`'s uid, with no capabilities and `no_new_privs`: the program
//!   can neither signal nor trace the shim, and every process it starts
//!   keeps its uid, so a sweep of that uid holds all of them, `setsid` or
//!   not. The program dies with the shim (its parent-death signal); so the
//!   only way to stop the shim is to end the pod.
//! * berth reaches the shim on `CONTROL`'s port. A client is served only
//!   after its first line is the pod's credential (`CREDENTIAL`), which
//!   the kubelet gives the shim from a Secret. The shim takes every
//!   `BERTH_SHIM_*` variable out of the program's environment, and a
//!   process's environment is readable only by its own uid: the program
//!   never sees the credential.
//!
//! Everything the shim needs comes in the variables of
//! [`berth_core::shim_wire::pod_env`], which the Kubernetes runtime's
//! manifest sets; the program's output goes to the
//! shim's own (the container's log, which the runtime reads).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use berth_core::shim_wire::pod_env::{
    CONTROL, CREDENTIAL, EPOCH, FENCE_MS, INSTANCE, PREFIX, ROLE, RUN_AS, STATE_DIR, STOP_GRACE_MS,
    USER,
};
use berth_core::{Epoch, Role};

use super::protocol::ShimSpec;
use crate::isolation::{IsolationSpec, Limits};

/// The mode argument: `berth shim pod`.
pub const POD_ARG: &str = "pod";

/// Why a pod's shim cannot start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodShimError {
    /// A variable the shim needs is missing.
    #[error("{0} is not set")]
    Missing(&'static str),
    /// A variable has a value the shim cannot use.
    #[error("{name}={value:?}: {why}")]
    Invalid {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What was expected.
        why: &'static str,
    },
    /// No program after `--`.
    #[error("no program given: berth shim pod -- PROGRAM [ARGS…]")]
    NoProgram,
    /// The program's uid is the shim's: it could then signal the shim and
    /// read its credential.
    #[error(
        "the program would run as the shim's own uid {0}; run the pod as root and set {RUN_AS} to another uid"
    )]
    SameUid(u32),
}

/// What the shim runs, read from its environment and arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodShim {
    /// The program's spec, as a host's shim gets it.
    pub spec: ShimSpec,
    /// Where to listen for berth.
    pub control: SocketAddr,
    /// What a client must show.
    pub credential: String,
    /// The program's grace after SIGTERM.
    pub stop_grace_ms: u64,
}

impl PodShim {
    /// Reads `vars` (the shim's environment) and `argv` (the program and
    /// its arguments), for a shim whose own uid is `own_uid`. `state_dir`
    /// is the private directory the shim's state goes in; `cwd`, the
    /// container's working directory.
    pub fn parse(
        vars: impl IntoIterator<Item = (String, String)>,
        argv: Vec<String>,
        own_uid: u32,
        private_dir: impl FnOnce(&str) -> PathBuf,
        cwd: PathBuf,
    ) -> Result<PodShim, PodShimError> {
        let all: BTreeMap<String, String> = vars.into_iter().collect();
        let get = |name: &'static str| all.get(name).ok_or(PodShimError::Missing(name));
        let invalid = |name: &'static str, why: &'static str| PodShimError::Invalid {
            name,
            value: all.get(name).cloned().unwrap_or_default(),
            why,
        };
        let number = |name: &'static str| -> Result<u64, PodShimError> {
            get(name)?
                .parse()
                .map_err(|_| invalid(name, "a whole number"))
        };
        if argv.is_empty() {
            return Err(PodShimError::NoProgram);
        }
        let control: SocketAddr = get(CONTROL)?
            .parse()
            .map_err(|_| invalid(CONTROL, "host:port"))?;
        let credential = get(CREDENTIAL)?.clone();
        if credential.len() < 32 || credential.contains(['\n', '\r']) {
            return Err(invalid(CREDENTIAL, "32 characters or more, on one line"));
        }
        let (uid, gid) = get(RUN_AS)?
            .split_once(':')
            .and_then(|(u, g)| Some((u.parse::<u32>().ok()?, g.parse::<u32>().ok()?)))
            .ok_or_else(|| invalid(RUN_AS, "uid:gid"))?;
        if uid == own_uid {
            return Err(PodShimError::SameUid(uid));
        }
        let role = match get(ROLE)?.as_str() {
            "main" => Role::Main,
            "watchdog" => Role::Watchdog,
            _ => return Err(invalid(ROLE, "main or watchdog")),
        };
        let epoch: Epoch = get(EPOCH)?
            .parse()
            .ok()
            .filter(|e: &Epoch| *e >= 0)
            .ok_or_else(|| invalid(EPOCH, "a whole number"))?;
        let fence_ms = match all.get(FENCE_MS) {
            Some(_) => Some(number(FENCE_MS)?),
            None => None,
        };
        let stop_grace_ms = number(STOP_GRACE_MS)?;
        let instance_id = get(INSTANCE)?.clone();
        let user = get(USER)?.clone();
        let state_dir = private_dir(all.get(STATE_DIR).map_or("/tmp", String::as_str));
        let env: Vec<(String, String)> = all
            .iter()
            .filter(|(name, _)| !name.starts_with(PREFIX))
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        let spec = ShimSpec {
            instance_id,
            user,
            role,
            epoch,
            argv,
            env,
            cwd,
            // The shim's stdout is the container's log.
            log_path: PathBuf::from("/dev/stdout"),
            log_max_bytes: u64::MAX,
            state_path: state_dir.join("state.json"),
            socket_path: state_dir.join("control.sock"),
            ready_regex: None,
            fence_ms,
            user_root: None,
            isolation: Some(IsolationSpec {
                uid,
                gid,
                name: format!("uid{uid}"),
                limits: Limits {
                    // The pod's own limits bound memory, processes and
                    // CPU; RLIMIT_NPROC counts a uid across the node.
                    memory_max_mb: 0,
                    pids_max: u64::MAX,
                    cpu_max_percent: 0,
                    open_files_max: crate::isolation::DEFAULT_OPEN_FILES_MAX,
                },
                cgroup: None,
                sandbox: None,
            }),
            port: None,
        };
        Ok(PodShim {
            spec,
            control,
            credential,
            stop_grace_ms,
        })
    }
}

/// Makes a directory only the shim can enter below `parent`, under a name
/// nobody can have prepared (a program of an earlier run of the container
/// may have written in `parent`).
fn private_dir(parent: &str) -> PathBuf {
    use std::os::unix::fs::DirBuilderExt;
    let base = PathBuf::from(parent);
    for attempt in 0u32.. {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = base.join(format!(
            "berth-shim.{}.{nanos}.{attempt}",
            std::process::id()
        ));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return dir,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 64 => {}
            Err(e) => {
                diag!("cannot make a private directory in {parent}: {e}");
                return dir;
            }
        }
    }
    base
}

/// `berth shim pod -- PROGRAM ARGS…`: the exit code of the pod.
pub(super) fn run(args: impl Iterator<Item = std::ffi::OsString>) -> i32 {
    let argv: Vec<String> = args
        .skip_while(|a| a != "--")
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let vars = std::env::vars_os().map(|(n, v)| {
        (
            n.to_string_lossy().into_owned(),
            v.to_string_lossy().into_owned(),
        )
    });
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
    let own_uid = nix::unistd::geteuid().as_raw();
    let shim = match PodShim::parse(vars, argv, own_uid, private_dir, cwd) {
        Ok(shim) => shim,
        Err(e) => {
            diag!("{e}");
            return 2;
        }
    };
    let control = shim.control;
    super::server::run_in_pod(
        shim.spec,
        move || std::net::TcpListener::bind(control),
        Arc::from(shim.credential),
        shim.stop_grace_ms,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars() -> Vec<(String, String)> {
        [
            (CONTROL, "0.0.0.0:7079"),
            (CREDENTIAL, "0123456789abcdef0123456789abcdef"),
            (RUN_AS, "1000:1000"),
            (INSTANCE, "i-1"),
            (USER, "alice"),
            (ROLE, "main"),
            (EPOCH, "7"),
            (FENCE_MS, "3000"),
            (STOP_GRACE_MS, "5000"),
            ("PATH", "/usr/bin"),
            ("BERTH_PORT", "8888"),
        ]
        .into_iter()
        .map(|(n, v)| (n.to_owned(), v.to_owned()))
        .collect()
    }

    fn parse(vars: Vec<(String, String)>, own: u32) -> Result<PodShim, PodShimError> {
        PodShim::parse(
            vars,
            vec!["python3".into(), "app.py".into()],
            own,
            |_| PathBuf::from("/tmp/x"),
            PathBuf::from("/work"),
        )
    }

    #[test]
    fn the_program_gets_its_environment_without_the_shims_variables() {
        let shim = parse(vars(), 0).unwrap();
        assert_eq!(shim.control.port(), 7079);
        assert_eq!(shim.stop_grace_ms, 5000);
        assert_eq!(shim.spec.fence_ms, Some(3000));
        assert_eq!(shim.spec.epoch, 7);
        assert_eq!(shim.spec.argv, ["python3", "app.py"]);
        let isolation = shim.spec.isolation.unwrap();
        assert_eq!((isolation.uid, isolation.gid), (1000, 1000));
        assert!(isolation.cgroup.is_none());
        assert_eq!(
            shim.spec.env,
            [
                ("BERTH_PORT".to_owned(), "8888".to_owned()),
                ("PATH".to_owned(), "/usr/bin".to_owned())
            ]
        );
        assert_eq!(shim.spec.state_path, PathBuf::from("/tmp/x/state.json"));
    }

    #[test]
    fn bad_or_missing_settings_are_named() {
        let without = |name: &str| vars().into_iter().filter(|(n, _)| n != name).collect();
        assert_eq!(
            parse(without(CREDENTIAL), 0),
            Err(PodShimError::Missing(CREDENTIAL))
        );
        assert!(parse(without(FENCE_MS), 0).unwrap().spec.fence_ms.is_none());
        let with = |name: &str, value: &str| {
            let mut v = vars();
            v.retain(|(n, _)| n != name);
            v.push((name.to_owned(), value.to_owned()));
            v
        };
        for (name, value) in [
            (RUN_AS, "1000"),
            (CONTROL, "7079"),
            (ROLE, "admin"),
            (EPOCH, "-1"),
            (CREDENTIAL, "short"),
        ] {
            assert!(
                matches!(parse(with(name, value), 0), Err(PodShimError::Invalid { name: n, .. }) if n == name),
                "{name}={value}"
            );
        }
        // The program may never be the shim's own uid.
        assert_eq!(parse(vars(), 1000), Err(PodShimError::SameUid(1000)));
        assert_eq!(
            PodShim::parse(vars(), vec![], 0, |_| PathBuf::new(), PathBuf::new()),
            Err(PodShimError::NoProgram)
        );
    }
}
