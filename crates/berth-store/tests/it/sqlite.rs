//! The backend-independent store contract, run against SQLite.

use std::sync::Arc;

use berth_store::{SqliteStore, Store};
use tempfile::TempDir;

/// A fresh database in its own directory; the directory lives as long as
/// the test holds the returned guard.
async fn fresh() -> (Arc<dyn Store>, TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("berth.db").display());
    let store = SqliteStore::open(&url).await.unwrap();
    (Arc::new(store), dir)
}

berth_store::store_contract_tests!(fresh().await);
