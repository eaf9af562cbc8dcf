//! The store's integration tests, one binary: the backend-independent
//! contract (`berth_store::store_contract_tests!`) against SQLite and
//! against PostgreSQL, plus what only PostgreSQL has.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test: an unwrap is its assertion"
)]

mod lease_model;
mod postgres;
mod sqlite;
