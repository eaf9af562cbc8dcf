//! berth's persistent state.
//!
//! * [`Store`]: the one trait every backend implements — instance records,
//!   the fenced lease (design §3), crash/breaker state, tokens and nodes;
//! * [`SqliteStore`]: the embedded single-node backend;
//! * [`PgStore`]: the PostgreSQL backend a cluster of nodes shares;
//! * [`lease`]: the validated lease settings and [`lease::LeaseKeeper`], the
//!   node-side holder of leases that renews them in bulk and knows when to
//!   fence itself;
//! * `contract` (feature `contract-tests`): one test suite every backend
//!   must pass.
//!
//! Lease decisions are single conditional statements judged by whether a
//! row came back, never read-then-write, and expiry is measured with the
//! store's own clock.

#[cfg(feature = "contract-tests")]
pub mod contract;
pub mod lease;
mod postgres;
mod sqlite;

use std::time::Duration;

use async_trait::async_trait;
use berth_core::policy::CrashState;
use berth_core::{Epoch, Instance, InstanceStatus, Role, UnixMillis, UserId};
use serde::{Deserialize, Serialize};

pub use postgres::{PgStore, PgStoreOptions};
pub use sqlite::SqliteStore;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached or refused the connection.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// A query failed for another reason (constraint, corrupt row, …).
    #[error("store query failed: {0}")]
    Query(String),
    /// A stored value could not be decoded.
    #[error("corrupt store record: {0}")]
    Corrupt(String),
    /// The store URL is not one this build understands.
    #[error("unsupported store URL {0:?}: expected sqlite://… or postgres://…")]
    UnsupportedUrl(String),
}

impl From<StoreError> for berth_core::SpawnError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(m) => berth_core::SpawnError::StoreUnavailable(m),
            other => berth_core::SpawnError::Internal(other.to_string()),
        }
    }
}

/// How a node may claim a lease that expired while another node held it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TakeoverPolicy {
    /// Only with evidence that the holder is gone: its last heartbeat is
    /// older than one lease TTL by the store's clock.
    #[default]
    Evidence,
    /// Never automatically; an operator takes the lease over explicitly.
    Manual,
}

/// The result of a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// This node now holds the lease under `epoch`.
    Claimed { epoch: Epoch },
    /// Another node holds it. `expired` is true when its lease ran out but
    /// there is no evidence it is gone (see [`TakeoverPolicy`]).
    Busy { holder: String, expired: bool },
}

/// One user's lease row, as reported to operators.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    pub user: UserId,
    /// The holder, kept as a sticky hint after release.
    pub holder: Option<String>,
    pub epoch: Epoch,
    /// When the lease ends, by the store's clock.
    pub lease_until: Option<UnixMillis>,
    /// Released on purpose (as opposed to run out).
    pub released: bool,
    /// Past `lease_until` by the store's clock, and not released.
    pub expired: bool,
}

/// Which instance records to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InstanceFilter {
    pub status: Option<InstanceStatus>,
    pub node: Option<String>,
    pub role: Option<Role>,
}

/// Whether a node takes new instances.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeStatus {
    #[default]
    Up,
    Draining,
    Down,
}

/// A node's row in the `nodes` table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub id: String,
    pub advertise_url: String,
    /// How many mains it is willing to run.
    pub capacity: u32,
    /// How many mains it runs now.
    pub load: u32,
    pub status: NodeStatus,
    /// Last heartbeat, by the store's clock (set by the store).
    pub heartbeat: UnixMillis,
}

/// berth's persistent state. One implementation per database.
///
/// All lease methods are single conditional statements; success is judged
/// by whether a row was written, and every time comparison uses the
/// store's clock ([`Store::now`]).
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// The store's clock, in Unix milliseconds.
    async fn now(&self) -> Result<UnixMillis, StoreError>;

    // --- instance records: one row per (user, role) -----------------------

    /// Inserts or replaces the record for `(instance.user, instance.role)`.
    async fn put_instance(&self, instance: &Instance) -> Result<(), StoreError>;
    async fn get_instance(&self, user: &UserId, role: Role)
    -> Result<Option<Instance>, StoreError>;
    async fn list_instances(&self, filter: &InstanceFilter) -> Result<Vec<Instance>, StoreError>;
    async fn delete_instance(&self, user: &UserId, role: Role) -> Result<(), StoreError>;
    /// Raises `last_active` of the users' mains to the given times, in one
    /// statement.
    async fn record_activity(&self, activity: &[(UserId, UnixMillis)]) -> Result<(), StoreError>;

    // --- the lease (design §3) ----------------------------------------------

    /// Claims the main lease of `user` for `node` for `ttl`: creates the row
    /// if needed, then one conditional update. Succeeds when the lease is
    /// free, released, already `node`'s own (epoch bumps), or expired with
    /// takeover allowed by `takeover`.
    async fn claim_lease(
        &self,
        user: &UserId,
        node: &str,
        ttl: Duration,
        takeover: TakeoverPolicy,
    ) -> Result<ClaimOutcome, StoreError>;

    /// Takes over an *expired* lease on an operator's word, whoever held it.
    async fn take_over_lease(
        &self,
        user: &UserId,
        node: &str,
        ttl: Duration,
    ) -> Result<ClaimOutcome, StoreError>;

    /// Extends every lease in `held` that `node` still holds at the given
    /// epoch, in one statement. Returns the users whose lease was extended;
    /// the others are lost.
    async fn renew_leases(
        &self,
        node: &str,
        held: &[(UserId, Epoch)],
        ttl: Duration,
    ) -> Result<Vec<UserId>, StoreError>;

    /// Ends the lease now, if `node` holds it at `epoch`. Keeps `node` as
    /// the sticky holder hint. Returns whether it was released.
    async fn release_lease(
        &self,
        user: &UserId,
        node: &str,
        epoch: Epoch,
    ) -> Result<bool, StoreError>;

    async fn get_lease(&self, user: &UserId) -> Result<Option<LeaseRecord>, StoreError>;
    /// Every lease row; only expired ones with `expired_only`.
    async fn list_leases(&self, expired_only: bool) -> Result<Vec<LeaseRecord>, StoreError>;
    /// The live leases `node` holds, in one query.
    async fn leases_held_by(&self, node: &str) -> Result<Vec<LeaseRecord>, StoreError>;

    // --- crash history and breaker (design §4.3) ----------------------------

    async fn load_crash_state(&self, user: &UserId) -> Result<CrashState, StoreError>;
    /// Saves the state; a clear state deletes the row.
    async fn save_crash_state(&self, user: &UserId, state: &CrashState) -> Result<(), StoreError>;

    // --- user tokens (stored hashed; design §8.2) ---------------------------

    async fn put_token(&self, user: &UserId, token_hash: &str) -> Result<(), StoreError>;
    async fn user_for_token(&self, token_hash: &str) -> Result<Option<UserId>, StoreError>;

    // --- nodes (design §8.1) -------------------------------------------------

    /// Inserts or updates the node's row and stamps its heartbeat with the
    /// store's clock.
    async fn heartbeat(&self, node: &NodeRecord) -> Result<(), StoreError>;
    async fn list_nodes(&self) -> Result<Vec<NodeRecord>, StoreError>;
}

/// Opens the store a URL names (`sqlite://PATH`, `postgres://…` or
/// `postgresql://…`), creating (SQLite) and migrating it.
pub async fn open(url: &str) -> Result<std::sync::Arc<dyn Store>, StoreError> {
    if url.starts_with("sqlite:") {
        Ok(std::sync::Arc::new(SqliteStore::open(url).await?))
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(std::sync::Arc::new(PgStore::open(url).await?))
    } else {
        Err(StoreError::UnsupportedUrl(postgres::redact_url(url)))
    }
}
