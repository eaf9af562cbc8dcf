//! From an [`InstanceSpec`] to a [`ShimSpec`]: the user's directories, the
//! materialised patch and handoff, the command line and the environment.

use std::path::{Path, PathBuf};

use berth_core::Role;
use berth_core::runtime::{InstanceSpec, Patch, RuntimeError};

use super::LocalRuntimeConfig;
use crate::Readiness;
use crate::paths::{UserPaths, create_private_dir};
use crate::shim::ShimSpec;
use crate::template::{self, Vars};

fn path_string(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn io_error(what: &str, path: &Path, e: std::io::Error) -> RuntimeError {
    RuntimeError::Failed(format!("cannot {what} {}: {e}", path.display()))
}

/// Creates the user's directories and working folder, materialises the
/// patch (or removes it) and, for a watchdog, the handoff file. Returns the
/// patch file the program is given, if any. mkdir and chmod block, for long
/// on a busy disk (a new user needs seven directories): on the runtime's
/// few worker threads, a burst of launches would hold up every other
/// request and event meanwhile, so this runs on the blocking pool.
pub(super) async fn prepare(
    paths: &UserPaths,
    patch_ext: &str,
    spec: &InstanceSpec,
) -> Result<Option<PathBuf>, RuntimeError> {
    let paths = paths.clone();
    let cwd = paths.workdir(&spec.folder);
    let patch_file = paths.patch_file(patch_ext);
    let patch = spec.patch.clone();
    let handoff = spec.handoff.clone();
    tokio::task::spawn_blocking(move || {
        paths
            .prepare()
            .map_err(|e| io_error("create", &paths.root, e))?;
        create_private_dir(&cwd).map_err(|e| io_error("create", &cwd, e))?;
        if let Some(handoff) = handoff {
            let file = paths.handoff();
            std::fs::write(&file, handoff).map_err(|e| io_error("write", &file, e))?;
        }
        match patch {
            Patch::Set(Some(content)) => {
                std::fs::write(&patch_file, content)
                    .map_err(|e| io_error("write", &patch_file, e))?;
                Ok(Some(patch_file))
            }
            Patch::Set(None) => match std::fs::remove_file(&patch_file) {
                Ok(()) => Ok(None),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(io_error("remove", &patch_file, e)),
            },
            Patch::Unchanged => Ok(patch_file.exists().then_some(patch_file)),
        }
    })
    .await
    .map_err(|e| RuntimeError::Failed(format!("preparing the directories failed: {e}")))?
}

/// The shim spec that runs `spec`. `var_port` is what `{port}` and
/// `BERTH_PORT` say (a watchdog gets its main's); `own_port` is the port
/// the instance itself holds (mains only).
pub(super) fn shim_spec(
    config: &LocalRuntimeConfig,
    spec: &InstanceSpec,
    paths: &UserPaths,
    var_port: u16,
    own_port: Option<u16>,
    patch: Option<PathBuf>,
) -> Result<ShimSpec, RuntimeError> {
    let (command, extra): (&[String], Vec<(String, String)>) = match spec.role {
        Role::Main => (&config.command, Vec::new()),
        Role::Watchdog => (
            config.watchdog_command.as_deref().ok_or_else(|| {
                RuntimeError::SpawnFailed("no watchdog command is configured".into())
            })?,
            vec![("BERTH_HANDOFF".into(), path_string(&paths.handoff()))],
        ),
    };
    let cwd = paths.workdir(&spec.folder);
    let home = paths.home();
    let base_path = spec.user.base_path();
    let vars = Vars {
        user: spec.user.as_str().to_owned(),
        slug: spec.slug.as_str().to_owned(),
        port: var_port,
        home: path_string(&home),
        folder: path_string(&cwd),
        patch: patch.as_deref().map(path_string).unwrap_or_default(),
        base_path: base_path.clone(),
    };
    let berth_vars = [
        ("BERTH_USER", spec.user.as_str().to_owned()),
        ("BERTH_PORT", var_port.to_string()),
        ("BERTH_BASE_PATH", base_path),
        ("BERTH_ROLE", spec.role.as_str().to_owned()),
        ("BERTH_EPOCH", spec.epoch.to_string()),
        ("BERTH_INSTANCE_ID", spec.instance_id.clone()),
        ("HOME", path_string(&home)),
        ("TMPDIR", path_string(&paths.tmp())),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .chain(extra)
    .chain(spec.env.iter().cloned());
    let env = template::build_env(
        &config.env_allowlist,
        template::own_env(),
        &config.env,
        berth_vars,
    );
    let ready_regex = match (&config.readiness, spec.role) {
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
        argv: template::render_command(command, &vars),
        env,
        cwd,
        log_path: paths.log(spec.role),
        state_path: paths.state_file(spec.role),
        socket_path: paths.socket(spec.role),
        ready_regex,
        fence_ms,
        port: own_port,
    })
}
