//! From an [`InstanceSpec`] to a [`ShimSpec`]: the user's directories, the
//! materialised patch and handoff, the command line, the environment and
//! the isolation the shim sets up.

use std::path::{Path, PathBuf};

use berth_core::Role;
use berth_core::runtime::{InstanceSpec, Patch, RuntimeError};

use super::LocalRuntimeConfig;
use crate::environment;
use crate::isolation::cgroup::CgroupSpec;
use crate::isolation::fsafe::Owner;
use crate::isolation::{Account, Isolation, IsolationSpec, Isolator, SandboxSpec};
use crate::paths::UserPaths;
use crate::shim::ShimSpec;
use berth_core::Readiness;
use berth_core::program::ProgramFacts;

fn path_string(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn owner_of(account: &Account) -> Owner {
    Owner {
        uid: account.uid,
        gid: account.gid,
    }
}

/// Creates the user's directories and working folder (owned by the
/// account, never through a link the user planted: see `paths.rs`),
/// materialises the patch and, for a watchdog, the handoff
/// file. Returns the patch file the program is given, if any. mkdir and
/// chmod block, for long on a busy disk (a new user needs seven
/// directories): on the runtime's few worker threads, a burst of launches
/// would hold up every other request and event meanwhile, so this runs on
/// the blocking pool.
pub(super) async fn prepare(
    paths: &UserPaths,
    patch_ext: &str,
    spec: &InstanceSpec,
    account: Option<&Account>,
) -> Result<Option<PathBuf>, RuntimeError> {
    let paths = paths.clone();
    let folder = spec.folder.clone();
    let patch_file = paths.patch_file(patch_ext);
    let patch = spec.patch.clone();
    let handoff = spec.handoff.clone();
    let owner = account.map(owner_of);
    tokio::task::spawn_blocking(move || {
        paths.prepare(&folder, owner).map_err(|e| {
            // A link on the way to the folder is the request's problem.
            if e.kind() == std::io::ErrorKind::InvalidInput {
                RuntimeError::SpawnFailed(e.to_string())
            } else {
                RuntimeError::Failed(format!("cannot prepare the user's directories: {e}"))
            }
        })?;
        let write = |dir: Option<&str>, name: &str, bytes: &[u8]| {
            paths
                .write_file(dir, name, bytes, owner)
                .map_err(|e| RuntimeError::Failed(format!("cannot write {name}: {e}")))
        };
        if let Some(handoff) = handoff {
            write(None, "handoff.json", handoff.as_bytes())?;
        }
        let name = patch_file
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("main")
            .to_owned();
        match patch {
            Patch::Set(Some(content)) => {
                write(Some("patches"), &name, content.as_bytes())?;
                Ok(Some(patch_file))
            }
            // A previous patch stays on disk (berth deletes nothing in a
            // user's root), but the program is given none.
            Patch::Set(None) => Ok(None),
            Patch::Unchanged => Ok(patch_file.exists().then_some(patch_file)),
        }
    })
    .await
    .map_err(|e| RuntimeError::Failed(format!("preparing the directories failed: {e}")))?
}

/// The isolation part of a shim spec, at levels `user` and `sandbox`.
pub(super) fn isolation_spec(
    isolator: &Isolator,
    config: &LocalRuntimeConfig,
    paths: &UserPaths,
    account: &Account,
) -> IsolationSpec {
    let limits = config.limits;
    IsolationSpec {
        uid: account.uid,
        gid: account.gid,
        name: account.name.clone(),
        limits,
        cgroup: isolator.cgroups.as_ref().map(|parents| CgroupSpec {
            parents: parents.clone(),
            limits,
        }),
        sandbox: (isolator.level == Isolation::Sandbox).then(|| SandboxSpec {
            data_dir: config.data_dir.clone(),
            user_root: paths.root.clone(),
            home: paths.home(),
        }),
    }
}

/// Where and as whom one start of an instance runs.
pub(super) struct Placement<'a> {
    /// What `{port}` and `BERTH_PORT` say (a watchdog gets its main's).
    pub var_port: u16,
    /// The port the instance itself holds (mains only).
    pub own_port: Option<u16>,
    /// The materialised patch, if any.
    pub patch: Option<PathBuf>,
    pub account: Option<&'a Account>,
    pub isolation: Option<IsolationSpec>,
}

/// The shim spec that runs `spec`.
pub(super) fn shim_spec(
    config: &LocalRuntimeConfig,
    spec: &InstanceSpec,
    paths: &UserPaths,
    placement: Placement<'_>,
) -> Result<ShimSpec, RuntimeError> {
    let Placement {
        var_port,
        own_port,
        patch,
        account,
        isolation,
    } = placement;
    let command =
        match spec.role {
            Role::Main => &config.program.command,
            Role::Watchdog => config.program.watchdog_command.as_deref().ok_or_else(|| {
                RuntimeError::SpawnFailed("no watchdog command is configured".into())
            })?,
        };
    let cwd = paths.workdir(&spec.folder);
    let (home, folder) = (path_string(&paths.home()), path_string(&cwd));
    let patch = patch.as_deref().map(path_string);
    let handoff = path_string(&paths.handoff());
    let facts = ProgramFacts {
        user: &spec.user,
        slug: &spec.slug,
        role: spec.role,
        port: var_port,
        home: &home,
        folder: &folder,
        patch: patch.as_deref(),
        epoch: spec.epoch,
        instance_id: &spec.instance_id,
        handoff: Some(&handoff),
    };
    // The launch's extra variables, what only a local program gets (its
    // own temporary directory and, with an account, its name), then the
    // contract's variables, which win.
    let berth_vars = spec
        .env
        .iter()
        .cloned()
        .chain([("TMPDIR".to_owned(), path_string(&paths.tmp()))])
        .chain(account.into_iter().flat_map(|a| {
            [
                ("USER".to_owned(), a.name.clone()),
                ("LOGNAME".to_owned(), a.name.clone()),
            ]
        }))
        .chain(
            facts
                .environment()
                .into_iter()
                .map(|(variable, value)| (variable.name().to_owned(), value)),
        );
    let env = environment::build_env(
        &config.env_allowlist,
        environment::own_env(),
        &config.program.env,
        berth_vars,
    );
    let ready_regex = match (&config.program.readiness, spec.role) {
        (Readiness::TokenRegex(re), Role::Main) => Some(re.as_str().to_owned()),
        _ => None,
    };
    let fence_ms = spec
        .fence
        .filter(|_| spec.role == Role::Main)
        .map(super::millis);
    Ok(ShimSpec {
        instance_id: spec.instance_id.clone(),
        user: spec.user.as_str().to_owned(),
        role: spec.role,
        epoch: spec.epoch,
        argv: facts.render(command),
        env,
        cwd,
        log_path: paths.log(spec.role),
        log_max_bytes: config.log_max_bytes,
        state_path: paths.state_file(spec.role),
        socket_path: paths.socket(spec.role),
        ready_regex,
        fence_ms,
        user_root: Some(paths.root.clone()),
        isolation,
        port: own_port,
    })
}
