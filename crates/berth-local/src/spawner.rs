//! The local spawner. (Implementation pending: agreed API below.)

use std::sync::Arc;

use berth_store::Store;

use crate::LocalConfig;

/// Why the local spawner could not start.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("{0}")]
    Config(String),
    #[error("cannot prepare {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] berth_store::StoreError),
}

/// Runs users' instances as local processes. Implements
/// [`berth_core::Spawner`].
pub struct LocalSpawner {
    _store: Arc<dyn Store>,
}

impl LocalSpawner {
    /// Prepares directories, re-attaches to the shims left by a previous
    /// berth on this data dir (checking each against the store), and starts
    /// the background tasks (lease renew, reaper, activity flush).
    pub async fn start(
        _config: LocalConfig,
        _store: Arc<dyn Store>,
    ) -> Result<Arc<LocalSpawner>, LocalError> {
        todo!()
    }

    /// Prometheus metrics of this spawner.
    pub fn register_metrics(&self, _registry: &mut prometheus_client::registry::Registry) {
        todo!()
    }
}
