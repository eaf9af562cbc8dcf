//! Lease settings and the node-side lease holder.
//!
//! [`LeaseConfig`] checks the timing invariants once, at construction.
//! [`Holdings`] is which leases a node holds, at which epoch, and the
//! self-fence deadline, as plain data. [`LeaseKeeper`] keeps it against the
//! store and the node's monotonic clock: it claims, renews all held leases
//! in one statement per tick, and releases.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use berth_core::{Epoch, UserId};

use crate::{ClaimOutcome, LeaseStore, StoreError, TakeoverPolicy};

/// Why lease settings were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseConfigError {
    /// The TTL is not more than twice the renew interval (invariant 2).
    #[error(
        "lease ttl_ms ({ttl_ms}) must be greater than 2 × renew_ms ({renew_ms}), so one slow renew cannot lose the lease"
    )]
    TtlTooShort {
        /// The TTL given, in milliseconds.
        ttl_ms: u128,
        /// The renew interval given, in milliseconds.
        renew_ms: u128,
    },
    /// The fence deadline is not before the TTL's end (invariant 2).
    #[error(
        "lease fence_after_ms ({fence_after_ms}) must be less than ttl_ms ({ttl_ms}), so a holder fences itself before others may claim"
    )]
    FenceAfterTooLong {
        /// The fence deadline given, in milliseconds.
        fence_after_ms: u128,
        /// The TTL given, in milliseconds.
        ttl_ms: u128,
    },
    /// The renew interval is zero: the node would renew without pause.
    #[error("lease renew_ms must be greater than 0")]
    ZeroRenew,
    /// The TTL is longer than [`MAX_TTL`].
    #[error(
        "lease ttl_ms ({ttl_ms}) must be at most {max_ms} (one day): longer leases leave a dead node's users unserved for that long"
    )]
    TtlTooLong {
        /// The TTL given, in milliseconds.
        ttl_ms: u128,
        /// [`MAX_TTL`], in milliseconds.
        max_ms: u128,
    },
}

/// The longest lease TTL accepted. Bounding the TTL bounds renew and
/// fence_after too (both are below it), so adding any of them to an
/// `Instant` cannot overflow.
pub const MAX_TTL: Duration = Duration::from_secs(24 * 3600);

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
    /// Checked settings: refused unless `ttl > 2 × renew`, `fence_after <
    /// ttl` (invariant 2), `renew` is not zero and `ttl` is at most
    /// [`MAX_TTL`].
    pub fn new(
        ttl: Duration,
        renew: Duration,
        fence_after: Duration,
        takeover: TakeoverPolicy,
    ) -> Result<Self, LeaseConfigError> {
        if renew.is_zero() {
            return Err(LeaseConfigError::ZeroRenew);
        }
        if ttl > MAX_TTL {
            return Err(LeaseConfigError::TtlTooLong {
                ttl_ms: ttl.as_millis(),
                max_ms: MAX_TTL.as_millis(),
            });
        }
        // Compared in full precision: `ttl > 2 × renew` must not pass
        // because of rounding to milliseconds.
        if ttl.as_nanos() <= 2 * renew.as_nanos() {
            return Err(LeaseConfigError::TtlTooShort {
                ttl_ms: ttl.as_millis(),
                renew_ms: renew.as_millis(),
            });
        }
        if fence_after >= ttl {
            return Err(LeaseConfigError::FenceAfterTooLong {
                fence_after_ms: fence_after.as_millis(),
                ttl_ms: ttl.as_millis(),
            });
        }
        Ok(Self {
            ttl,
            renew,
            fence_after,
            takeover,
        })
    }

    /// How long a claim or renew holds the lease, by the store's clock.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// How often the node renews every lease it holds.
    pub fn renew(&self) -> Duration {
        self.renew
    }

    /// How long after the last successful renew was sent the node freezes
    /// its instances, unless another renew succeeds first.
    pub fn fence_after(&self) -> Duration {
        self.fence_after
    }

    /// When this node may claim a lease that ran out under another node.
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

/// An instant on a node's monotonic clock, as [`Holdings`] needs it: only
/// ordered, and moved forward by a duration without overflowing.
///
/// [`Instant`] is the one the node runs on; the lease model in the store's
/// tests drives the same bookkeeping with simulated time.
pub trait NodeInstant: Copy + Ord {
    /// `self + d`, or `None` past what the type can hold.
    fn checked_after(self, d: Duration) -> Option<Self>;
}

impl NodeInstant for Instant {
    fn checked_after(self, d: Duration) -> Option<Self> {
        self.checked_add(d)
    }
}

/// Which leases a node holds, at which epoch, and as of when they are
/// proven: the [`LeaseKeeper`]'s decisions over plain data, with no store
/// and no clock of their own.
///
/// The fence clock is one instant for the whole node, moved only by a
/// renew that succeeded (to the moment it was *sent*), or by the first
/// claim after the node held nothing. It starts unproven: leases adopted
/// at start were proven by the berth before this one, whose shims keep
/// its deadlines; nothing this berth starts may run on them until its own
/// renew proves them.
#[derive(Debug, Clone)]
pub struct Holdings<I> {
    held: HashMap<UserId, Epoch>,
    /// When the last renew that succeeded was sent; `None` before one.
    proven_at: Option<I>,
    fence_after: Duration,
}

impl<I: NodeInstant> Holdings<I> {
    /// Nothing held, nothing proven.
    pub fn new(fence_after: Duration) -> Self {
        Self {
            held: HashMap::new(),
            proven_at: None,
            fence_after,
        }
    }

    fn proven(&mut self, sent: I) {
        self.proven_at = Some(self.proven_at.map_or(sent, |at| at.max(sent)));
    }

    /// A claim of `user`'s lease, sent at `sent`, came back with `epoch`.
    pub fn claimed(&mut self, user: &UserId, epoch: Epoch, sent: I) {
        // With nothing else held, this claim alone decides how fresh the
        // node's leases are; without this a keeper that sat idle longer
        // than `fence_after` would be "due" the moment it claimed.
        if self.held.is_empty() {
            self.proven(sent);
        }
        self.held.insert(user.clone(), epoch);
    }

    /// A lease found in the store at start (re-attach). This does not move
    /// the fence clock: renew adopted leases promptly.
    pub fn adopt(&mut self, user: UserId, epoch: Epoch) {
        self.held.insert(user, epoch);
    }

    /// A renew of `asked`, sent at `sent`, extended the leases of
    /// `renewed`. Forgets and returns the ones lost, and moves the fence
    /// clock to `sent`.
    pub fn renewed(
        &mut self,
        asked: Vec<(UserId, Epoch)>,
        renewed: &HashSet<UserId>,
        sent: I,
    ) -> Vec<(UserId, Epoch)> {
        let mut lost = Vec::new();
        for (user, epoch) in asked {
            if renewed.contains(&user) {
                continue;
            }
            // Only the lease the renew was about is lost: one re-claimed
            // (new epoch) or released while the renew was in flight is not
            // this renew's business.
            if self.held.get(&user) == Some(&epoch) {
                self.held.remove(&user);
                lost.push((user, epoch));
            }
        }
        self.proven(sent);
        lost
    }

    /// Forgets `user`'s lease if it is still held at `epoch`.
    pub fn forget_at(&mut self, user: &UserId, epoch: Epoch) {
        if self.held.get(user) == Some(&epoch) {
            self.held.remove(user);
        }
    }

    /// Forgets `user`'s lease at whatever epoch.
    pub fn forget(&mut self, user: &UserId) {
        self.held.remove(user);
    }

    /// The epoch at which `user`'s lease is held, if it is.
    pub fn epoch_of(&self, user: &UserId) -> Option<Epoch> {
        self.held.get(user).copied()
    }

    /// Every lease held, with its epoch.
    pub fn held(&self) -> Vec<(UserId, Epoch)> {
        self.held.iter().map(|(u, e)| (u.clone(), *e)).collect()
    }

    /// The proven instant + `fence_after`: when the node must freeze its
    /// instances unless another renew succeeds first. `None` while nothing
    /// is proven (and past what `I` can hold).
    pub fn fence_deadline(&self) -> Option<I> {
        self.proven_at?.checked_after(self.fence_after)
    }

    /// True when the node holds a lease and it is unproven, or `now` is at
    /// or past the fence deadline.
    pub fn fence_due(&self, now: I) -> bool {
        !self.held.is_empty() && self.fence_deadline().is_none_or(|deadline| now >= deadline)
    }
}

/// The leases one node holds: [`Holdings`] kept against the store and the
/// node's clock. Cheap to share behind an `Arc`; holds no lock across an
/// `.await`.
pub struct LeaseKeeper {
    store: Arc<dyn LeaseStore>,
    node_id: String,
    config: LeaseConfig,
    holdings: Mutex<Holdings<Instant>>,
}

/// The guarded data is plain values that every critical section leaves
/// consistent, so a panic elsewhere while holding the lock does not make
/// it wrong; carrying on beats turning one panic into many.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl std::fmt::Debug for LeaseKeeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseKeeper")
            .field("node_id", &self.node_id)
            .field("config", &self.config)
            .field("held", &lock(&self.holdings).held().len())
            .finish_non_exhaustive()
    }
}

impl LeaseKeeper {
    /// A keeper holding nothing, with nothing proven.
    pub fn new(store: Arc<dyn LeaseStore>, node_id: String, config: LeaseConfig) -> Self {
        let holdings = Holdings::new(config.fence_after);
        Self {
            store,
            node_id,
            config,
            holdings: Mutex::new(holdings),
        }
    }

    /// Claims `user`'s lease; on success remembers the epoch.
    pub async fn acquire(&self, user: &UserId) -> Result<ClaimOutcome, StoreError> {
        let sent = Instant::now();
        let outcome = self
            .store
            .claim_lease(user, &self.node_id, self.config.ttl, self.config.takeover)
            .await?;
        self.remember_claim(user, &outcome, sent);
        Ok(outcome)
    }

    /// An operator's explicit takeover of an expired lease.
    pub async fn take_over(&self, user: &UserId) -> Result<ClaimOutcome, StoreError> {
        let sent = Instant::now();
        let outcome = self
            .store
            .take_over_lease(user, &self.node_id, self.config.ttl)
            .await?;
        self.remember_claim(user, &outcome, sent);
        Ok(outcome)
    }

    fn remember_claim(&self, user: &UserId, outcome: &ClaimOutcome, sent: Instant) {
        if let ClaimOutcome::Claimed { epoch } = *outcome {
            lock(&self.holdings).claimed(user, epoch, sent);
        }
    }

    /// Remembers a lease found in the store at startup (re-attach).
    ///
    /// This does not move the fence clock: renew adopted leases promptly.
    pub fn adopt(&self, user: UserId, epoch: Epoch) {
        lock(&self.holdings).adopt(user, epoch);
    }

    /// Renews every held lease in one statement. Forgets and reports the
    /// lost ones. A successful tick moves the fence deadline, measured from
    /// when the renew was *sent*.
    pub async fn renew_all(&self) -> Result<RenewReport, StoreError> {
        let sent = Instant::now();
        let asked = self.holdings();
        let renewed = if asked.is_empty() {
            Vec::new()
        } else {
            self.store
                .renew_leases(&self.node_id, &asked, self.config.ttl)
                .await?
        };
        let renewed: HashSet<UserId> = renewed.into_iter().collect();
        let lost = lock(&self.holdings).renewed(asked, &renewed, sent);
        Ok(RenewReport {
            renewed: renewed.len(),
            lost,
        })
    }

    /// Releases `user`'s lease (keeping this node as the sticky hint) and
    /// forgets it. Returns false when this node did not hold it (any more).
    pub async fn release(&self, user: &UserId) -> Result<bool, StoreError> {
        let Some(epoch) = self.epoch_of(user) else {
            return Ok(false);
        };
        let released = self.store.release_lease(user, &self.node_id, epoch).await?;
        // Whether released now or already gone, this node no longer holds
        // the lease at that epoch.
        lock(&self.holdings).forget_at(user, epoch);
        Ok(released)
    }

    /// Forgets a lease without touching the store (after fencing).
    pub fn forget(&self, user: &UserId) {
        lock(&self.holdings).forget(user);
    }

    /// The epoch at which this node holds `user`'s lease, if it does.
    pub fn epoch_of(&self, user: &UserId) -> Option<Epoch> {
        lock(&self.holdings).epoch_of(user)
    }

    /// Every lease this node holds, with its epoch.
    pub fn holdings(&self) -> Vec<(UserId, Epoch)> {
        lock(&self.holdings).held()
    }

    /// When the node must freeze its instances unless another renew
    /// succeeds first: the last successful renew's (or first claim's) *send*
    /// time + `fence_after`. A program started now may run only until then,
    /// so this, not "now + `fence_after`", is the deadline a new shim gets.
    ///
    /// `None` while nothing is proven: no program may start on the leases
    /// held. (Also past what `Instant` can hold, which `LeaseConfig`'s
    /// bounds rule out.)
    pub fn fence_deadline(&self) -> Option<Instant> {
        lock(&self.holdings).fence_deadline()
    }

    /// True when no renew sent within the last `fence_after` has succeeded
    /// (measured from `now`), or none has yet: the node must freeze its
    /// instances. A keeper that holds nothing has nothing to fence.
    pub fn fence_due(&self, now: Instant) -> bool {
        lock(&self.holdings).fence_due(now)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex as StdMutex;

    use async_trait::async_trait;
    use tokio::sync::Notify;

    use super::*;
    use crate::testing::{InterceptRenew, RenewHook};
    use crate::{SqliteStore, Store};

    const MS: Duration = Duration::from_millis(1);

    fn user(id: &str) -> UserId {
        UserId::parse(id).unwrap()
    }

    fn config(ttl_ms: u64, renew_ms: u64, fence_ms: u64) -> LeaseConfig {
        LeaseConfig::new(
            Duration::from_millis(ttl_ms),
            Duration::from_millis(renew_ms),
            Duration::from_millis(fence_ms),
            TakeoverPolicy::Evidence,
        )
        .unwrap()
    }

    async fn sqlite() -> (SqliteStore, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("berth.db").display());
        (SqliteStore::open(&url).await.unwrap(), dir)
    }

    #[test]
    fn config_defaults_are_valid() {
        let d = LeaseConfig::default();
        let checked = LeaseConfig::new(d.ttl(), d.renew(), d.fence_after(), d.takeover()).unwrap();
        assert_eq!(checked, d);
        assert_eq!(
            (d.ttl(), d.renew(), d.fence_after()),
            (
                Duration::from_secs(30),
                Duration::from_secs(10),
                Duration::from_secs(20)
            )
        );
    }

    #[test]
    fn config_ttl_must_exceed_twice_renew_and_error_names_both() {
        let err = LeaseConfig::new(
            Duration::from_secs(20),
            Duration::from_secs(10),
            Duration::from_secs(15),
            TakeoverPolicy::Evidence,
        )
        .unwrap_err();
        assert_eq!(
            err,
            LeaseConfigError::TtlTooShort {
                ttl_ms: 20_000,
                renew_ms: 10_000
            }
        );
        let msg = err.to_string();
        assert!(msg.contains("20000") && msg.contains("10000"), "{msg}");
        // Just over the line is fine, and sub-millisecond excess counts.
        assert!(
            LeaseConfig::new(
                Duration::from_millis(20_001),
                Duration::from_secs(10),
                Duration::from_secs(15),
                TakeoverPolicy::Manual
            )
            .is_ok()
        );
        assert!(
            LeaseConfig::new(
                Duration::from_micros(20_000_001),
                Duration::from_secs(10),
                Duration::from_secs(15),
                TakeoverPolicy::Manual
            )
            .is_ok()
        );
    }

    #[test]
    fn config_rejects_zero_renew_and_late_fence() {
        assert_eq!(
            LeaseConfig::new(
                Duration::from_secs(30),
                Duration::ZERO,
                Duration::from_secs(20),
                TakeoverPolicy::Evidence
            ),
            Err(LeaseConfigError::ZeroRenew)
        );
        let err = LeaseConfig::new(
            Duration::from_secs(30),
            Duration::from_secs(10),
            Duration::from_secs(30),
            TakeoverPolicy::Evidence,
        )
        .unwrap_err();
        assert_eq!(
            err,
            LeaseConfigError::FenceAfterTooLong {
                fence_after_ms: 30_000,
                ttl_ms: 30_000
            }
        );
        let msg = err.to_string();
        assert!(msg.contains("30000"), "{msg}");
    }

    #[test]
    fn config_keeps_the_takeover_policy_and_accepts_ttls_up_to_a_day() {
        let manual = LeaseConfig::new(
            Duration::from_secs(23 * 3600),
            Duration::from_secs(10),
            Duration::from_secs(20),
            TakeoverPolicy::Manual,
        )
        .unwrap();
        assert_eq!(manual.takeover(), TakeoverPolicy::Manual);
        assert_eq!(manual.ttl(), Duration::from_secs(23 * 3600));
        assert_eq!(MAX_TTL, Duration::from_secs(86_400));
    }

    #[test]
    fn config_rejects_huge_durations() {
        let huge = Duration::from_millis(u64::MAX);
        assert_eq!(
            LeaseConfig::new(
                huge,
                Duration::from_secs(10),
                Duration::from_secs(20),
                TakeoverPolicy::Evidence
            ),
            Err(LeaseConfigError::TtlTooLong {
                ttl_ms: u128::from(u64::MAX),
                max_ms: MAX_TTL.as_millis()
            })
        );
        // A huge renew or fence_after cannot slip past with a valid ttl.
        assert!(matches!(
            LeaseConfig::new(
                Duration::from_secs(30),
                huge,
                Duration::from_secs(20),
                TakeoverPolicy::Evidence
            ),
            Err(LeaseConfigError::TtlTooShort { .. })
        ));
        assert!(matches!(
            LeaseConfig::new(
                Duration::from_secs(30),
                Duration::from_secs(10),
                huge,
                TakeoverPolicy::Evidence
            ),
            Err(LeaseConfigError::FenceAfterTooLong { .. })
        ));
        assert!(
            LeaseConfig::new(
                MAX_TTL,
                Duration::from_secs(10),
                Duration::from_secs(20),
                TakeoverPolicy::Evidence
            )
            .is_ok()
        );
    }

    #[tokio::test]
    async fn acquire_renew_release_round_trip() {
        let (store, _dir) = sqlite().await;
        let store: Arc<dyn Store> = Arc::new(store);
        let a = LeaseKeeper::new(store.clone(), "node-a".into(), LeaseConfig::default());
        let b = LeaseKeeper::new(store.clone(), "node-b".into(), LeaseConfig::default());
        let alice = user("alice");

        assert_eq!(
            a.acquire(&alice).await.unwrap(),
            ClaimOutcome::Claimed { epoch: 1 }
        );
        assert_eq!(a.epoch_of(&alice), Some(1));
        assert_eq!(
            b.acquire(&alice).await.unwrap(),
            ClaimOutcome::Busy {
                holder: "node-a".into(),
                expired: false
            }
        );
        assert_eq!(b.epoch_of(&alice), None);
        assert_eq!(
            b.take_over(&alice).await.unwrap(),
            ClaimOutcome::Busy {
                holder: "node-a".into(),
                expired: false
            }
        );

        // Re-acquiring its own lease moves the keeper to the new epoch.
        assert_eq!(
            a.acquire(&alice).await.unwrap(),
            ClaimOutcome::Claimed { epoch: 2 }
        );
        assert_eq!(a.holdings(), vec![(alice.clone(), 2)]);

        let report = a.renew_all().await.unwrap();
        assert_eq!(
            report,
            RenewReport {
                renewed: 1,
                lost: vec![]
            }
        );

        assert!(a.release(&alice).await.unwrap());
        assert_eq!(a.epoch_of(&alice), None);
        assert!(!a.release(&alice).await.unwrap(), "nothing left to release");
        let lease = store.get_lease(&alice).await.unwrap().unwrap();
        assert_eq!(lease.holder.as_deref(), Some("node-a"));
        assert!(lease.released);

        assert_eq!(
            b.acquire(&alice).await.unwrap(),
            ClaimOutcome::Claimed { epoch: 3 }
        );
        // A keeper that holds nothing renews nothing and never asks the store.
        assert_eq!(a.renew_all().await.unwrap(), RenewReport::default());
    }

    #[tokio::test]
    async fn renew_all_reports_and_forgets_lost_leases() {
        let (store, _dir) = sqlite().await;
        let store: Arc<dyn Store> = Arc::new(store);
        let cfg = config(300, 100, 200);
        let a = LeaseKeeper::new(store.clone(), "node-a".into(), cfg.clone());
        let b = LeaseKeeper::new(store.clone(), "node-b".into(), cfg);
        let [alice, bob, carol] = ["alice", "bob", "carol"].map(user);
        for u in [&alice, &bob] {
            assert!(matches!(
                a.acquire(u).await.unwrap(),
                ClaimOutcome::Claimed { .. }
            ));
        }
        // carol is re-claimed behind the keeper's back (as after a crash
        // restart that forgot it): the keeper's epoch 1 is lost too.
        assert!(matches!(
            a.acquire(&carol).await.unwrap(),
            ClaimOutcome::Claimed { epoch: 1 }
        ));
        assert!(matches!(
            store
                .claim_lease(
                    &carol,
                    "node-a",
                    Duration::from_secs(30),
                    TakeoverPolicy::Evidence
                )
                .await
                .unwrap(),
            ClaimOutcome::Claimed { epoch: 2 }
        ));

        // bob's lease runs out and node-b takes it over.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !store.get_lease(&bob).await.unwrap().unwrap().expired {
            assert!(tokio::time::Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            b.take_over(&bob).await.unwrap(),
            ClaimOutcome::Claimed { epoch: 2 }
        );

        let mut report = a.renew_all().await.unwrap();
        report.lost.sort();
        assert_eq!(report.renewed, 1);
        assert_eq!(report.lost, vec![(bob.clone(), 1), (carol.clone(), 1)]);
        assert_eq!(
            a.holdings(),
            vec![(alice.clone(), a.epoch_of(&alice).unwrap())]
        );
        assert_eq!(a.epoch_of(&bob), None);

        // Forgotten leases are not reported twice.
        assert_eq!(a.renew_all().await.unwrap().lost, vec![]);

        a.adopt(bob.clone(), 2);
        assert_eq!(a.epoch_of(&bob), Some(2));
        a.forget(&bob);
        assert_eq!(a.epoch_of(&bob), None);
    }

    #[tokio::test]
    async fn fence_clock_moves_only_on_success_measured_from_send() {
        let (sqlite, _dir) = sqlite().await;
        let gated = Arc::new(Gated::around(Arc::new(sqlite.clone())));
        let fence = Duration::from_millis(200);
        let keeper = Arc::new(LeaseKeeper::new(
            gated.clone(),
            "node-a".into(),
            config(300, 100, 200),
        ));

        // Holding nothing, never due.
        assert!(!keeper.fence_due(Instant::now() + Duration::from_secs(3600)));

        let before_acquire = Instant::now();
        keeper.acquire(&user("alice")).await.unwrap();
        let after_acquire = Instant::now();
        // The claim itself counts as the first success.
        assert!(!keeper.fence_due(before_acquire + fence - MS));
        assert!(keeper.fence_due(after_acquire + fence));

        // A renew held up in flight: the fence clock moves to when it was
        // sent, not to when it came back.
        tokio::time::sleep(5 * MS).await;
        gated.hook.close_gate();
        let renew = tokio::spawn({
            let keeper = keeper.clone();
            async move { keeper.renew_all().await }
        });
        let arrived = gated.hook.wait_arrival().await;
        tokio::time::sleep(50 * MS).await;
        gated.hook.open_gate();
        let report = renew.await.unwrap().unwrap();
        assert_eq!(report.renewed, 1);
        assert!(
            keeper.fence_due(arrived + fence),
            "clock moved past the send"
        );
        assert!(
            !keeper.fence_due(after_acquire + fence),
            "a successful renew moves the fence clock"
        );

        let deadline = keeper.fence_deadline().unwrap();
        assert!(deadline > after_acquire + fence && deadline <= arrived + fence);

        // A failed renew does not move it.
        let stuck_at = Instant::now();
        sqlite.close().await;
        assert!(keeper.renew_all().await.is_err());
        assert!(keeper.fence_due(stuck_at + fence));
        assert_eq!(keeper.fence_deadline(), Some(deadline));
        assert_eq!(keeper.holdings().len(), 1, "an error is not a loss");
    }

    #[test]
    fn holdings_count_and_forget_only_the_epoch_held() {
        let start = Instant::now();
        let mut holdings = Holdings::new(Duration::from_millis(200));
        assert!(holdings.held().is_empty());
        assert!(!holdings.fence_due(start), "nothing held, nothing due");
        holdings.claimed(&user("alice"), 3, start);
        holdings.adopt(user("bob"), 1);
        assert_eq!(holdings.held().len(), 2);
        assert_eq!(
            holdings.fence_deadline(),
            Some(start + Duration::from_millis(200))
        );
        holdings.forget_at(&user("alice"), 2);
        assert_eq!(holdings.epoch_of(&user("alice")), Some(3));
        holdings.forget_at(&user("alice"), 3);
        holdings.forget(&user("bob"));
        assert!(holdings.held().is_empty());
    }

    #[tokio::test]
    async fn adopted_leases_are_unproven_until_a_renew_proves_them() {
        let (store, _dir) = sqlite().await;
        let store: Arc<dyn Store> = Arc::new(store);
        let keeper = LeaseKeeper::new(store.clone(), "node-a".into(), LeaseConfig::default());
        let alice = user("alice");
        assert!(matches!(
            store
                .claim_lease(
                    &alice,
                    "node-a",
                    Duration::from_secs(30),
                    TakeoverPolicy::Evidence
                )
                .await
                .unwrap(),
            ClaimOutcome::Claimed { epoch: 1 }
        ));
        // A restarted berth adopts the lease its predecessor renewed: that
        // renew may be nearly a TTL old, so nothing may start on it yet.
        keeper.adopt(alice.clone(), 1);
        assert_eq!(keeper.fence_deadline(), None);
        assert!(keeper.fence_due(Instant::now()));
        // A claim of another user proves only that lease, not the adopted one.
        keeper.acquire(&user("bob")).await.unwrap();
        assert!(keeper.fence_due(Instant::now()));

        let sent = Instant::now();
        assert_eq!(keeper.renew_all().await.unwrap().renewed, 2);
        let deadline = keeper.fence_deadline().unwrap();
        assert!(deadline >= sent + Duration::from_secs(20));
        assert!(!keeper.fence_due(Instant::now()));
    }

    #[tokio::test]
    async fn leases_acquired_during_a_renew_are_not_reported_lost() {
        let (sqlite, _dir) = sqlite().await;
        let gated = Arc::new(Gated::around(Arc::new(sqlite)));
        let keeper = Arc::new(LeaseKeeper::new(
            gated.clone(),
            "node-a".into(),
            LeaseConfig::default(),
        ));
        let [alice, bob] = ["alice", "bob"].map(user);
        keeper.acquire(&alice).await.unwrap();

        gated.hook.close_gate();
        let renew = tokio::spawn({
            let keeper = keeper.clone();
            async move { keeper.renew_all().await }
        });
        gated.hook.wait_arrival().await;
        // While the renew (of alice@1) is in flight, alice is re-claimed at
        // epoch 2 and bob is claimed.
        assert_eq!(
            keeper.acquire(&alice).await.unwrap(),
            ClaimOutcome::Claimed { epoch: 2 }
        );
        keeper.acquire(&bob).await.unwrap();
        gated.hook.open_gate();
        let report = renew.await.unwrap().unwrap();

        assert_eq!(
            report,
            RenewReport {
                renewed: 0,
                lost: vec![]
            }
        );
        assert_eq!(keeper.epoch_of(&alice), Some(2));
        assert_eq!(keeper.epoch_of(&bob), Some(1));
        assert_eq!(keeper.renew_all().await.unwrap().renewed, 2);
    }

    /// A gate `renew_leases` can be held at, to act while a renew is in
    /// flight; [`Gated::around`] puts it in front of a store.
    struct Gated {
        gate_closed: StdMutex<bool>,
        arrived: Notify,
        arrived_at: StdMutex<Option<Instant>>,
        proceed: Notify,
    }

    impl Gated {
        fn around(inner: Arc<dyn Store>) -> InterceptRenew<Gated> {
            InterceptRenew {
                inner,
                hook: Gated {
                    gate_closed: StdMutex::new(false),
                    arrived: Notify::new(),
                    arrived_at: StdMutex::new(None),
                    proceed: Notify::new(),
                },
            }
        }
        fn close_gate(&self) {
            *self.gate_closed.lock().unwrap() = true;
        }
        fn open_gate(&self) {
            *self.gate_closed.lock().unwrap() = false;
            self.proceed.notify_one();
        }
        async fn wait_arrival(&self) -> Instant {
            self.arrived.notified().await;
            self.arrived_at.lock().unwrap().unwrap()
        }
    }

    #[async_trait]
    impl RenewHook for Gated {
        async fn before_renew(&self) -> Result<(), StoreError> {
            let closed = *self.gate_closed.lock().unwrap();
            if closed {
                *self.arrived_at.lock().unwrap() = Some(Instant::now());
                self.arrived.notify_one();
                self.proceed.notified().await;
            }
            Ok(())
        }
    }
}
