//! SQLite backend. (Implementation pending.)

use crate::StoreError;

/// The embedded single-node store.
pub struct SqliteStore {
    _private: (),
}

impl SqliteStore {
    pub async fn open(_url: &str) -> Result<Self, StoreError> {
        todo!()
    }
}
