//! The double's shared state: its object store and the kubelet's pods,
//! behind one lock, with what the server's tasks share.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde_json::Value;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::ApiUse;
use super::store::{Key, Store};

pub(crate) struct World {
    pub store: Store,
    /// The kubelet's pods, by UID.
    pub runs: HashMap<String, PodRun>,
    pub gone_served: usize,
    pub unschedulable: bool,
    /// A merge patch another client makes to an object just before the
    /// next DELETE of it is answered (see
    /// [`super::ApiServerDouble::patch_before_next_delete`]).
    pub before_delete: Option<(Key, Value)>,
}

pub(crate) struct Shared {
    pub world: Mutex<World>,
    /// Every kind of request answered, as RBAC names it.
    pub api_use: Mutex<BTreeSet<ApiUse>>,
    /// Where volumes and pods' files live.
    pub root: PathBuf,
    pub cancel: CancellationToken,
    pub tasks: TaskTracker,
    /// True while new watches are held back. Changed and read only under
    /// `world`'s lock, so that holding watches and registering one are
    /// ordered (see `server::watch`).
    pub gate: watch::Sender<bool>,
}

pub(crate) fn lock(m: &Mutex<World>) -> MutexGuard<'_, World> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the kubelet knows of one pod, by UID.
pub struct PodRun {
    pub log: Vec<String>,
    /// The program's output has ended.
    pub log_closed: bool,
    pub log_changed: Arc<tokio::sync::Notify>,
    pub port: u16,
    /// The port a pod's shim (`BERTH_SHIM_CONTROL`) is given.
    pub shim_port: u16,
    /// The uid a pod's shim runs its program as.
    pub program_uid: u32,
    /// The pod's entrypoint is berth's shim.
    pub has_shim: bool,
    /// The program's process group, while it runs.
    pub pgid: Option<i32>,
    pub ready_override: Option<bool>,
    pub restarts: i32,
}
