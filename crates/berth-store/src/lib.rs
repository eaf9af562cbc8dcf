//! berth's persistent state.
//!
//! * [`Store`]: the one trait every backend implements — instance records
//!   (a main's fenced by its lease epoch), the fenced lease (design §3),
//!   launch parameters, crash/breaker state, tokens, nodes, and each user's
//!   recorded slug (design §9);
//! * [`SqliteStore`]: the embedded single-node backend;
//! * [`PgStore`]: the PostgreSQL backend a cluster of nodes shares;
//! * [`lease`]: the validated lease settings and [`lease::LeaseKeeper`], the
//!   node-side holder of leases that renews them in bulk and knows when to
//!   fence itself;
//! * `contract` (feature `contract-tests`): one test suite every backend
//!   must pass;
//! * `testing` (feature `contract-tests`): test doubles that wrap a real
//!   store to inject faults, e.g. failing or held lease renews.
//!
//! Lease decisions, and writes of a main's record, are single conditional
//! statements judged by whether a row was written or came back, never
//! read-then-write, and expiry and liveness are measured with the store's
//! own clock.

mod common;
#[cfg(feature = "contract-tests")]
pub mod contract;
pub mod lease;
mod postgres;
mod sqlite;
#[cfg(feature = "contract-tests")]
pub mod testing;

use std::time::Duration;

use async_trait::async_trait;
use berth_core::policy::{CrashState, NodeState, NodeView};
use berth_core::{Epoch, Instance, InstanceStatus, Role, Slug, UnixMillis, UserId};
use serde::{Deserialize, Serialize};

pub use postgres::{PgStore, PgStoreOptions, redact_url};
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
    /// A write or delete of `user`'s main record under lease `epoch` was
    /// refused: the stored record was written under a newer lease (or the
    /// same epoch by another node). The writer has lost the lease.
    #[error(
        "the main record of {user} belongs to a newer lease (epoch {current_epoch} on node \
         {current_node:?}); refused the change made under epoch {epoch}"
    )]
    Fenced {
        user: UserId,
        /// The epoch the refused write carried.
        epoch: Epoch,
        /// The stored record's epoch and node.
        current_epoch: Epoch,
        current_node: String,
    },
    /// `slug` is already recorded for another user: two ids never share a
    /// slug (design §9), so `user` was not given it. Nothing changed.
    #[error("the slug {slug:?} is already recorded for another user; refused it for {user}")]
    SlugTaken { user: UserId, slug: String },
}

impl StoreError {
    /// The refusal of a change to `user`'s main record under `epoch`, given
    /// the record that stands in its way.
    fn fenced(user: &UserId, epoch: Epoch, current: &Instance) -> Self {
        StoreError::Fenced {
            user: user.clone(),
            epoch,
            current_epoch: current.epoch,
            current_node: current.node.clone(),
        }
    }
}

impl From<StoreError> for berth_core::SpawnError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(m) => berth_core::SpawnError::StoreUnavailable(m),
            // The record belongs to whoever holds the newer lease: to the
            // caller that is the same answer as a claim refused by a live
            // holder.
            StoreError::Fenced {
                user, current_node, ..
            } => berth_core::SpawnError::LeaseBusy {
                user,
                holder: current_node,
                expired: false,
            },
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
    /// Whether the holder's last heartbeat is at most the TTL given to
    /// [`Store::list_leases`] old, by the store's clock: the same test a claim
    /// under [`TakeoverPolicy::Evidence`] applies, so an expired lease whose
    /// holder is not alive is one such a claim may take, and an expired
    /// lease whose holder is alive needs an operator's takeover. `None`
    /// when there is no holder, and in the answers of [`Store::get_lease`]
    /// and [`Store::leases_held_by`], which are not given a TTL.
    pub holder_alive: Option<bool>,
}

/// What a user's main was last launched with, kept so that another node can
/// relaunch it the same way after a failover.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchParams {
    /// The normalised working folder, relative to the user's workspace.
    pub folder: String,
    /// The patch content (at most [`berth_core::MAX_PATCH_BYTES`]); `None`
    /// for a launch without one.
    pub patch: Option<String>,
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

impl From<NodeStatus> for NodeState {
    fn from(status: NodeStatus) -> Self {
        match status {
            NodeStatus::Up => NodeState::Up,
            NodeStatus::Draining => NodeState::Draining,
            NodeStatus::Down => NodeState::Down,
        }
    }
}

impl NodeRecord {
    /// The node as placement sees it (`berth_core::policy::place`), `now`
    /// being [`Store::now`] read by the caller: the heartbeat is stamped by
    /// the store's clock, so its age must be measured by the same clock.
    pub fn view(&self, now: UnixMillis) -> NodeView {
        NodeView {
            id: self.id.clone(),
            status: self.status.into(),
            capacity: self.capacity,
            load: self.load,
            heartbeat_age_ms: now.saturating_sub(self.heartbeat),
        }
    }
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
    ///
    /// A main's record is fenced by its lease: it replaces the stored one
    /// only if that was written under a lower epoch, or under the same epoch
    /// by the same node; otherwise nothing changes and the answer is
    /// [`StoreError::Fenced`]. So a node that lost the lease can never
    /// overwrite the record of the node that holds it now. Watchdog records
    /// hold no lease (epoch 0) and are replaced unconditionally.
    async fn put_instance(&self, instance: &Instance) -> Result<(), StoreError>;
    async fn get_instance(&self, user: &UserId, role: Role)
    -> Result<Option<Instance>, StoreError>;
    async fn list_instances(&self, filter: &InstanceFilter) -> Result<Vec<Instance>, StoreError>;
    /// Deletes the record of `(user, role)`, whoever wrote it; deleting
    /// nothing is not an error. For watchdogs, which hold no lease, and
    /// for an operator's cleanup: a node acting under a lease deletes its
    /// main's record with [`Store::delete_instance_fenced`].
    async fn delete_instance(&self, user: &UserId, role: Role) -> Result<(), StoreError>;
    /// Deletes `user`'s main record if `node` may still change it under
    /// `epoch`, by the rule of [`Store::put_instance`]. A record written
    /// under a newer lease is kept and the answer is
    /// [`StoreError::Fenced`]; no record at all is not an error.
    async fn delete_instance_fenced(
        &self,
        user: &UserId,
        node: &str,
        epoch: Epoch,
    ) -> Result<(), StoreError>;
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
    /// Every lease row; only expired ones with `expired_only`. Each row's
    /// [`LeaseRecord::holder_alive`] says whether its holder's last
    /// heartbeat is at most `ttl` old (pass the lease TTL: the evidence
    /// window of a claim).
    async fn list_leases(
        &self,
        expired_only: bool,
        ttl: Duration,
    ) -> Result<Vec<LeaseRecord>, StoreError>;
    /// The live leases `node` holds, in one query.
    async fn leases_held_by(&self, node: &str) -> Result<Vec<LeaseRecord>, StoreError>;

    // --- launch parameters --------------------------------------------------

    /// Records what `user`'s main was launched with, replacing what was
    /// there, so any node can relaunch it the same way after a failover.
    /// A patch longer than [`berth_core::MAX_PATCH_BYTES`] is refused.
    async fn put_launch_params(
        &self,
        user: &UserId,
        folder: &str,
        patch: Option<&str>,
    ) -> Result<(), StoreError>;
    async fn get_launch_params(&self, user: &UserId) -> Result<Option<LaunchParams>, StoreError>;

    // --- crash history and breaker (design §4.3) ----------------------------

    async fn load_crash_state(&self, user: &UserId) -> Result<CrashState, StoreError>;
    /// Saves the state; a clear state deletes the row.
    async fn save_crash_state(&self, user: &UserId, state: &CrashState) -> Result<(), StoreError>;

    // --- user tokens (stored hashed; design §8.2) ---------------------------

    async fn put_token(&self, user: &UserId, token_hash: &str) -> Result<(), StoreError>;
    async fn user_for_token(&self, token_hash: &str) -> Result<Option<UserId>, StoreError>;

    // --- users and their slugs (design §9) ------------------------------------

    /// The slug recorded for `user`, if one is.
    async fn user_slug(&self, user: &UserId) -> Result<Option<Slug>, StoreError>;
    /// Records `slug` for `user` unless a slug is recorded for them
    /// already, and returns the user's recorded slug: the one recorded
    /// before (whatever `slug` says: a user's slug never changes), else
    /// `slug`. A slug recorded for another user is refused with
    /// [`StoreError::SlugTaken`] and nothing changes. Atomic across nodes:
    /// the table's two unique constraints decide every race.
    async fn record_user_slug(&self, user: &UserId, slug: &Slug) -> Result<Slug, StoreError>;

    // --- nodes (design §8.1) -------------------------------------------------

    /// Inserts or updates the node's row and stamps its heartbeat with the
    /// store's clock.
    async fn heartbeat(&self, node: &NodeRecord) -> Result<(), StoreError>;
    /// Every node's row. For placement and liveness, turn each into a
    /// [`NodeView`] with [`NodeRecord::view`], passing [`Store::now`]: a
    /// heartbeat's age is measured by the store's clock.
    async fn list_nodes(&self) -> Result<Vec<NodeRecord>, StoreError>;
}

/// Refuses a patch larger than design §9 allows before it reaches SQL; the
/// schema checks the same bound.
fn check_patch_size(user: &UserId, patch: Option<&str>) -> Result<(), StoreError> {
    match patch {
        Some(p) if p.len() > berth_core::MAX_PATCH_BYTES => Err(StoreError::Query(format!(
            "patch of {user} is {} bytes; the limit is {}",
            p.len(),
            berth_core::MAX_PATCH_BYTES
        ))),
        _ => Ok(()),
    }
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

#[cfg(test)]
mod tests {
    use berth_core::policy::place;

    use super::*;

    #[test]
    fn node_view_measures_heartbeat_age_by_the_given_store_time() {
        let record = NodeRecord {
            id: "node-a".into(),
            advertise_url: "http://a:8080".into(),
            capacity: 10,
            load: 4,
            status: NodeStatus::Draining,
            heartbeat: 1_700_000_000_000,
        };
        let view = record.view(1_700_000_012_500);
        assert_eq!(
            view,
            NodeView {
                id: "node-a".into(),
                status: NodeState::Draining,
                capacity: 10,
                load: 4,
                heartbeat_age_ms: 12_500,
            }
        );
        for (status, state) in [
            (NodeStatus::Up, NodeState::Up),
            (NodeStatus::Draining, NodeState::Draining),
            (NodeStatus::Down, NodeState::Down),
        ] {
            assert_eq!(NodeState::from(status), state);
        }
        // A heartbeat stamped after `now` was read is simply fresh.
        assert_eq!(record.view(record.heartbeat - 5).heartbeat_age_ms, -5);
        // Extreme values saturate instead of overflowing.
        assert_eq!(
            NodeRecord {
                heartbeat: i64::MIN,
                ..record.clone()
            }
            .view(i64::MAX)
            .heartbeat_age_ms,
            i64::MAX
        );
        let up = NodeRecord {
            status: NodeStatus::Up,
            ..record
        };
        assert_eq!(
            place(None, &[up.view(up.heartbeat + 1_000)], 30_000).as_deref(),
            Some("node-a")
        );
    }

    #[test]
    fn fenced_reads_as_a_busy_lease_and_names_both_epochs() {
        let err = StoreError::Fenced {
            user: UserId::parse("alice").unwrap(),
            epoch: 3,
            current_epoch: 4,
            current_node: "node-b".into(),
        };
        let msg = err.to_string();
        for part in ["alice", "newer lease", "epoch 4", "node-b", "epoch 3"] {
            assert!(msg.contains(part), "{part:?} missing from {msg}");
        }
        assert_eq!(
            berth_core::SpawnError::from(err),
            berth_core::SpawnError::LeaseBusy {
                user: UserId::parse("alice").unwrap(),
                holder: "node-b".into(),
                expired: false,
            }
        );
    }
}
