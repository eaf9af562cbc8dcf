//! Lease settings and the node-side lease holder (design §3).
//!
//! [`LeaseConfig`] checks the timing invariants once, at construction.
//! [`LeaseKeeper`] remembers which leases this node holds and at which epoch,
//! renews all of them in one statement per tick, and tracks the self-fence
//! deadline on the node's monotonic clock.
//!
//! (Implementation pending: the signatures below are the agreed API.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_core::{Epoch, UserId};

use crate::{ClaimOutcome, LeaseRecord, Store, StoreError, TakeoverPolicy};

/// Why lease settings were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseConfigError {
    #[error(
        "lease ttl_ms ({ttl_ms}) must be greater than 2 × renew_ms ({renew_ms}), so one slow renew cannot lose the lease"
    )]
    TtlTooShort { ttl_ms: u128, renew_ms: u128 },
    #[error("lease fence_after_ms ({fence_after_ms}) must be less than ttl_ms ({ttl_ms}), so a holder fences itself before others may claim")]
    FenceAfterTooLong { fence_after_ms: u128, ttl_ms: u128 },
    #[error("lease renew_ms must be greater than 0")]
    ZeroRenew,
}

/// Validated lease timing. Defaults: TTL 30 s, renew 10 s, fence after 20 s,
/// takeover with evidence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    ttl: Duration,
    renew: Duration,
    fence_after: Duration,
    takeover: TakeoverPolicy,
}

impl LeaseConfig {
    pub fn new(
        ttl: Duration,
        renew: Duration,
        fence_after: Duration,
        takeover: TakeoverPolicy,
    ) -> Result<Self, LeaseConfigError> {
        todo!("{ttl:?} {renew:?} {fence_after:?} {takeover:?}")
    }
    pub fn ttl(&self) -> Duration {
        self.ttl
    }
    pub fn renew(&self) -> Duration {
        self.renew
    }
    pub fn fence_after(&self) -> Duration {
        self.fence_after
    }
    pub fn takeover(&self) -> TakeoverPolicy {
        self.takeover
    }
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(30),
            renew: Duration::from_secs(10),
            fence_after: Duration::from_secs(20),
            takeover: TakeoverPolicy::Evidence,
        }
    }
}

/// The outcome of one renew tick.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RenewReport {
    /// Leases extended.
    pub renewed: usize,
    /// Leases this node no longer holds: fence these instances now.
    pub lost: Vec<(UserId, Epoch)>,
}

/// True if `record` says `node` holds the lease at `epoch`.
pub fn still_holder(record: Option<&LeaseRecord>, node: &str, epoch: Epoch) -> bool {
    record.is_some_and(|r| r.holder.as_deref() == Some(node) && r.epoch == epoch)
}

/// The leases one node holds. Cheap to share behind an `Arc`; holds no lock
/// across an `.await`.
pub struct LeaseKeeper {
    _store: Arc<dyn Store>,
}

impl LeaseKeeper {
    pub fn new(_store: Arc<dyn Store>, _node_id: String, _config: LeaseConfig) -> Self {
        todo!()
    }
    pub fn node_id(&self) -> &str {
        todo!()
    }
    pub fn config(&self) -> &LeaseConfig {
        todo!()
    }
    /// Claims `user`'s lease; on success remembers the epoch.
    pub async fn acquire(&self, _user: &UserId) -> Result<ClaimOutcome, StoreError> {
        todo!()
    }
    /// An operator's explicit takeover of an expired lease.
    pub async fn take_over(&self, _user: &UserId) -> Result<ClaimOutcome, StoreError> {
        todo!()
    }
    /// Remembers a lease found in the store at startup (re-attach).
    pub fn adopt(&self, _user: UserId, _epoch: Epoch) {
        todo!()
    }
    /// Renews every held lease in one statement. Forgets and reports the
    /// lost ones. A successful tick moves the fence deadline, measured from
    /// when the renew was *sent*.
    pub async fn renew_all(&self) -> Result<RenewReport, StoreError> {
        todo!()
    }
    /// Releases `user`'s lease (keeping this node as the sticky hint) and
    /// forgets it.
    pub async fn release(&self, _user: &UserId) -> Result<bool, StoreError> {
        todo!()
    }
    /// Forgets a lease without touching the store (after fencing).
    pub fn forget(&self, _user: &UserId) {
        todo!()
    }
    pub fn epoch_of(&self, _user: &UserId) -> Option<Epoch> {
        todo!()
    }
    pub fn holdings(&self) -> Vec<(UserId, Epoch)> {
        todo!()
    }
    /// True when no renew sent within the last `fence_after` has succeeded
    /// (measured from `now`): the node must freeze its instances.
    pub fn fence_due(&self, _now: Instant) -> bool {
        todo!()
    }
}
