//! cgroup limits of sandboxed instances, on either hierarchy.
//!
//! * **v1** (one mount per controller, as on this project's CI machines):
//!   the `memory`, `pids` and `cpu` controllers each get a directory
//!   `<mount><berth's own cgroup>/berth-<id>/<instance>`.
//! * **v2** (the unified hierarchy of most production hosts): one directory
//!   `<mount><berth's own cgroup>/berth-<id>/<instance>`. v2 lets only
//!   leaves hold processes, so berth first moves itself into
//!   `<own>/berth-supervisor` (the way a systemd unit with `Delegate=yes`
//!   is meant to be used), then enables the controllers below `<own>`.
//!
//! Which one is used is decided at start from `/proc/self/mountinfo`,
//! `/proc/self/cgroup` and the v2 root's `cgroup.controllers`: v1 when the
//! memory controller is mounted as v1, else v2 when its root offers all
//! three controllers. A missing controller is an error that names it.
//!
//! Everything that decides (parsing, paths, the values written) is pure
//! and tested without I/O; the writers take the directories to write in,
//! so the v2 one is tested against a fake tree where no real v2 controllers
//! exist.
//!
//! **Freezing.** An instance with a cgroup is frozen through it
//! ([`CgroupFreezer`]): v2's `cgroup.freeze` in its own directory, or, on
//! v1, `freezer.state` in a directory of its own under the `freezer`
//! controller (optional: a v1 host without it freezes by signal, and berth
//! says so at start). The cgroup holds every process of the instance
//! whatever its session or process group, so a program that calls `setsid`
//! cannot escape the freeze the way it escapes a SIGSTOP to its group.
//!
//! The module is split by concern: `layout` (the hierarchies, berth's
//! parents and where each instance's cgroup lives), `limits` (memory, pids
//! and CPU, and the OOM counters), `freezer` (freezing, thawing and
//! killing through a cgroup) and `stale` (removing what dead shims and gone
//! berths left behind).

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::Limits;

mod freezer;
mod layout;
mod limits;
mod stale;

pub use freezer::{CgroupFreezer, FreezeError, FreezeMechanism, FreezerKind, parse_procs};
pub use layout::{
    CONTROLLERS, InstanceCgroup, Layout, Parents, detect, detect_host, prepare_parents,
};
pub use limits::{oom_kills, v1_limit_files, v2_limit_files};
pub use stale::{remove_stale, remove_stale_leaf, shim_pid_of_leaf};

/// Why cgroups cannot be used; every message names what is missing.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// A controller berth limits is neither mounted as v1 nor offered by
    /// the v2 root; it names the controller.
    #[error(
        "cgroup {0} controller not mounted (neither as cgroup v1 nor in the cgroup v2 \
         hierarchy); instance cgroups need the memory, pids and cpu controllers"
    )]
    ControllerMissing(&'static str),
    /// `/proc/self/mountinfo` or `/proc/self/cgroup` could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the kernel said.
        source: io::Error,
    },
    /// A cgroup directory could not be made or one of its files written.
    #[error("cgroup {what} {path}: {source}")]
    Write {
        /// The file written (`directory` for a directory made).
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// What the kernel said.
        source: io::Error,
    },
    /// berth could not enable the controllers for its instances on v2:
    /// its cgroup is not delegated to it.
    #[error(
        "cannot enable the memory, pids and cpu controllers below {path}: {source}; in cgroup v2 \
         berth needs a cgroup of its own that holds no other processes (systemd: run it as a \
         service with Delegate=yes)"
    )]
    Delegation {
        /// berth's own cgroup, below which the controllers were asked for.
        path: PathBuf,
        /// What the kernel said.
        source: io::Error,
    },
    /// A v1 host without the `freezer` controller, where instances could
    /// not be frozen through their cgroups.
    #[error(
        "the cgroup v1 freezer controller is not mounted: instances could not be frozen through \
         their cgroups (mount it, or use cgroup v2)"
    )]
    NoFreezer,
    /// `/proc/self/cgroup` names no cgroup of berth's in a hierarchy it
    /// needs; it names the hierarchy.
    #[error("berth's own cgroup is not listed in /proc/self/cgroup for {0}")]
    OwnUnknown(&'static str),
}

/// What the shim needs to give one instance its cgroup.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupSpec {
    /// Where the instance's cgroup goes: under this berth's parents.
    pub parents: Parents,
    /// The memory, pids and CPU limits written to it.
    pub limits: Limits,
}

fn write_file(path: &Path, value: &str, what: &'static str) -> Result<(), CgroupError> {
    let mut file = fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|source| CgroupError::Write {
            what,
            path: path.to_owned(),
            source,
        })?;
    file.write_all(value.as_bytes())
        .map_err(|source| CgroupError::Write {
            what,
            path: path.to_owned(),
            source,
        })
}

/// Makes the directory `path` unless it exists; whether it was made now.
fn mkdir(path: &Path) -> Result<bool, CgroupError> {
    match fs::create_dir(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(source) => Err(CgroupError::Write {
            what: "directory",
            path: path.to_owned(),
            source,
        }),
    }
}
