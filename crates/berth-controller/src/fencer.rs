//! The node's side of the lease: claims through the [`LeaseKeeper`] (so
//! it renews exactly the epochs instances run under), the question "may
//! this instance run?", and the bookkeeping of frozen mains that a good
//! renew thaws.
//!
//! The runtime calls themselves (freeze, thaw, extend, kill) are made by
//! the renew tick (`background.rs`); this part only decides whom they are
//! for.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use berth_core::policy::supervision::LeaseCheck;
use berth_core::{Epoch, SpawnError, UserId};
use berth_store::lease::{LeaseConfig, LeaseKeeper};
use berth_store::{ClaimOutcome, LeaseStore, StoreError};

/// How a launch claims the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claim {
    /// An ordinary claim: free, released, this node's own, or expired
    /// under the takeover policy.
    Acquire,
    /// An operator's explicit takeover of an expired lease, whatever the
    /// policy.
    TakeOver,
}

pub(crate) struct Fencer {
    lease: LeaseKeeper,
    config: LeaseConfig,
    fencing: bool,
    /// Mains whose program is frozen, with the epoch they held: frozen by
    /// this node's fence deadline, or by the runtime's own (its `Frozen`
    /// event). A good renew thaws them.
    frozen: Mutex<HashMap<UserId, Epoch>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `instant + d`, or as far as `Instant` reaches (`LeaseConfig`'s bounds
/// keep config durations far below that; this only keeps a bad value from
/// panicking). Falling back to `instant` itself errs on the side of
/// fencing early.
pub(crate) fn saturating_add(instant: Instant, d: Duration) -> Instant {
    instant
        .checked_add(d)
        .or_else(|| instant.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(instant)
}

impl Fencer {
    pub fn new(
        store: Arc<dyn LeaseStore>,
        node: String,
        config: LeaseConfig,
        fencing: bool,
    ) -> Self {
        Self {
            lease: LeaseKeeper::new(store, node, config.clone()),
            config,
            fencing,
            frozen: Mutex::new(HashMap::new()),
        }
    }

    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    /// Claims `user`'s lease; the epoch, or `lease_busy` naming the holder.
    pub async fn claim(&self, user: &UserId, claim: Claim) -> Result<Epoch, SpawnError> {
        let outcome = match claim {
            Claim::Acquire => self.lease.acquire(user).await?,
            Claim::TakeOver => self.lease.take_over(user).await?,
        };
        match outcome {
            ClaimOutcome::Claimed { epoch } => Ok(epoch),
            ClaimOutcome::Busy { holder, expired } => Err(SpawnError::LeaseBusy {
                user: user.clone(),
                holder,
                expired,
            }),
        }
    }

    /// Gives the lease up (keeping this node as the sticky holder hint).
    pub async fn release(&self, user: &UserId) -> Result<(), StoreError> {
        self.lease.release(user).await.map(drop)
    }

    /// Drops the lease from this node's books without touching the row: it
    /// is another node's now.
    pub fn forget(&self, user: &UserId) {
        self.lease.forget(user);
    }

    /// Makes sure this node holds `user`'s lease for an instance found at
    /// start under `epoch`: adopts it if the store says it is held at that
    /// epoch (`held`), else claims it again (it ran out while berth was
    /// away and nobody took it). `None`: another node holds it.
    pub async fn regain(
        &self,
        user: &UserId,
        epoch: Epoch,
        held: &HashMap<UserId, Epoch>,
    ) -> Option<Epoch> {
        if held.get(user) == Some(&epoch) {
            self.lease.adopt(user.clone(), epoch);
            return Some(epoch);
        }
        match self.lease.acquire(user).await {
            Ok(ClaimOutcome::Claimed { epoch }) => Some(epoch),
            Ok(ClaimOutcome::Busy { holder, .. }) => {
                tracing::warn!(%user, %holder, "the lease moved to another node while berth was away");
                None
            }
            Err(e) => {
                tracing::warn!(%user, error = %e, "could not re-claim the lease");
                None
            }
        }
    }

    /// May a main of `user` under `epoch` run (again) now?
    pub fn check(&self, user: &UserId, epoch: Epoch) -> LeaseCheck {
        if self.lease.epoch_of(user) != Some(epoch) {
            LeaseCheck::Lost
        } else if self.fence_due() {
            LeaseCheck::Unproven
        } else {
            LeaseCheck::Held
        }
    }

    /// The fence deadline a new run gets (cluster mode): it may run only as
    /// long as the lease is proven, until the last successful renew's send
    /// time + `fence_after`, not a fresh `fence_after` from now (a restart
    /// after failed renews would otherwise outlive the lease). Nothing
    /// proven yet (a berth that adopted leases and has not renewed them):
    /// no time at all, so the run starts frozen until a renew thaws it.
    pub fn deadline_for_new_run(&self) -> Option<Duration> {
        if !self.fencing {
            return None;
        }
        Some(
            self.lease
                .fence_deadline()
                .map_or(Duration::ZERO, |deadline| {
                    deadline.saturating_duration_since(Instant::now())
                }),
        )
    }

    /// When this node must freeze its instances unless a renew succeeds
    /// first (cluster mode only).
    pub fn fence_deadline(&self) -> Option<Instant> {
        self.fencing.then(|| self.lease.fence_deadline()).flatten()
    }

    /// No renew sent within `fence_after` has succeeded (cluster mode).
    pub fn fence_due(&self) -> bool {
        self.fencing && self.lease.fence_due(Instant::now())
    }

    /// Renews every held lease in one statement; the ones found lost.
    pub async fn renew_all(&self) -> Result<Vec<(UserId, Epoch)>, StoreError> {
        Ok(self.lease.renew_all().await?.lost)
    }

    /// Tracks `user`'s main under `epoch` as frozen or not, whoever froze
    /// it. True when this newly fences it (the runtime's own deadline froze
    /// it before this node's timer did), so that the fence is counted once
    /// whoever froze it first.
    pub fn note_frozen(&self, user: &UserId, epoch: Epoch, frozen: bool) -> bool {
        let mut map = lock(&self.frozen);
        if frozen {
            map.insert(user.clone(), epoch).is_none()
        } else {
            if map.get(user) == Some(&epoch) {
                map.remove(user);
            }
            false
        }
    }

    /// Whether `user`'s main is frozen for fencing (whatever else froze it).
    pub fn is_fenced(&self, user: &UserId) -> bool {
        lock(&self.frozen).contains_key(user)
    }

    pub fn forget_frozen(&self, user: &UserId) {
        lock(&self.frozen).remove(user);
    }

    /// Marks `user`'s main frozen by this node's deadline, if its lease is
    /// held; its epoch when it was not frozen yet (so it is to be frozen
    /// now).
    pub fn freeze(&self, user: &UserId) -> Option<Epoch> {
        let epoch = self.lease.epoch_of(user)?;
        lock(&self.frozen)
            .insert(user.clone(), epoch)
            .is_none()
            .then_some(epoch)
    }

    /// The frozen mains whose lease this node still holds under the same
    /// epoch: to be thawed (and forgotten as frozen).
    pub fn thawable(&self) -> Vec<(UserId, Epoch)> {
        let frozen: Vec<(UserId, Epoch)> = lock(&self.frozen)
            .iter()
            .map(|(u, e)| (u.clone(), *e))
            .collect();
        frozen
            .into_iter()
            .filter(|(user, epoch)| self.lease.epoch_of(user) == Some(*epoch))
            .collect()
    }

    /// Forgets `user` as frozen under `epoch` (it is being thawed).
    pub fn thawing(&self, user: &UserId, epoch: Epoch) -> bool {
        let mut map = lock(&self.frozen);
        if map.get(user) == Some(&epoch) {
            map.remove(user);
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    //! The fencer against a real SQLite store: its answers are what the
    //! supervision and the renew tick act on, so each is pinned here (the
    //! CI's mutation run of this file leans on these tests).

    use berth_store::{SqliteStore, Store, TakeoverPolicy};

    use super::*;

    // Not the default TTL, so a config that is not the one given shows.
    const TTL: Duration = Duration::from_secs(31);

    fn user(id: &str) -> UserId {
        UserId::parse(id).unwrap()
    }

    fn config() -> LeaseConfig {
        LeaseConfig::new(
            TTL,
            Duration::from_secs(10),
            Duration::from_secs(20),
            TakeoverPolicy::Evidence,
        )
        .unwrap()
    }

    async fn store() -> (Arc<dyn Store>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("berth.db").display());
        (Arc::new(SqliteStore::open(&url).await.unwrap()), dir)
    }

    fn fencer(store: &Arc<dyn Store>, node: &str, fencing: bool) -> Fencer {
        Fencer::new(store.clone(), node.into(), config(), fencing)
    }

    #[tokio::test]
    async fn claims_checks_and_releases() {
        let (store, _dir) = store().await;
        let a = fencer(&store, "node-a", true);
        let b = fencer(&store, "node-b", true);
        let alice = user("alice");
        assert_eq!(a.config().ttl(), TTL);

        assert_eq!(a.claim(&alice, Claim::Acquire).await.unwrap(), 1);
        assert_eq!(a.check(&alice, 1), LeaseCheck::Held);
        assert_eq!(a.check(&alice, 2), LeaseCheck::Lost);
        match b.claim(&alice, Claim::Acquire).await {
            Err(SpawnError::LeaseBusy {
                holder, expired, ..
            }) => assert_eq!((holder.as_str(), expired), ("node-a", false)),
            other => panic!("expected lease_busy, got {other:?}"),
        }
        assert!(matches!(
            b.claim(&alice, Claim::TakeOver).await,
            Err(SpawnError::LeaseBusy { .. })
        ));
        assert_eq!(b.check(&alice, 1), LeaseCheck::Lost);

        a.release(&alice).await.unwrap();
        assert_eq!(a.check(&alice, 1), LeaseCheck::Lost);
        assert_eq!(b.claim(&alice, Claim::Acquire).await.unwrap(), 2);

        // Forgotten (fenced by another node): no longer this node's.
        b.forget(&alice);
        assert_eq!(b.check(&alice, 2), LeaseCheck::Lost);
        assert_eq!(b.renew_all().await.unwrap(), vec![]);
    }

    #[tokio::test]
    async fn renew_reports_the_leases_lost() {
        let (store, _dir) = store().await;
        let a = fencer(&store, "node-a", true);
        let [alice, bob] = ["alice", "bob"].map(user);
        a.claim(&alice, Claim::Acquire).await.unwrap();
        a.claim(&bob, Claim::Acquire).await.unwrap();
        // bob's lease is claimed again behind this fencer's back.
        store
            .claim_lease(&bob, "node-a", TTL, TakeoverPolicy::Evidence)
            .await
            .unwrap();
        assert_eq!(a.renew_all().await.unwrap(), vec![(bob.clone(), 1)]);
        assert_eq!(a.check(&bob, 1), LeaseCheck::Lost);
        assert_eq!(a.check(&alice, 1), LeaseCheck::Held);
    }

    #[tokio::test]
    async fn regain_adopts_the_held_epoch_claims_a_free_lease_and_yields_a_taken_one() {
        let (store, _dir) = store().await;
        let [alice, bob, carol] = ["alice", "bob", "carol"].map(user);
        let before = fencer(&store, "node-a", true);
        before.claim(&alice, Claim::Acquire).await.unwrap();
        fencer(&store, "node-b", true)
            .claim(&carol, Claim::Acquire)
            .await
            .unwrap();

        // A restarted node-a: alice's lease is still its own at epoch 1.
        let a = fencer(&store, "node-a", true);
        let held = HashMap::from([(alice.clone(), 1)]);
        assert_eq!(a.regain(&alice, 1, &held).await, Some(1));
        assert_eq!(a.lease.epoch_of(&alice), Some(1));
        // bob's ran out unclaimed: claimed again, under a new epoch.
        assert_eq!(a.regain(&bob, 7, &held).await, Some(1));
        // carol's is node-b's.
        assert_eq!(a.regain(&carol, 1, &held).await, None);
        assert_eq!(a.lease.epoch_of(&carol), None);
    }

    #[tokio::test]
    async fn an_adopted_lease_is_unproven_until_a_renew() {
        let (store, _dir) = store().await;
        let alice = user("alice");
        fencer(&store, "node-a", true)
            .claim(&alice, Claim::Acquire)
            .await
            .unwrap();
        let a = fencer(&store, "node-a", true);
        a.regain(&alice, 1, &HashMap::from([(alice.clone(), 1)]))
            .await
            .unwrap();
        assert_eq!(a.check(&alice, 1), LeaseCheck::Unproven);
        assert!(a.fence_due());
        assert_eq!(a.fence_deadline(), None);
        assert_eq!(a.deadline_for_new_run(), Some(Duration::ZERO));

        let sent = Instant::now();
        a.renew_all().await.unwrap();
        assert_eq!(a.check(&alice, 1), LeaseCheck::Held);
        assert!(!a.fence_due());
        let deadline = a.fence_deadline().unwrap();
        assert!(deadline >= sent + Duration::from_secs(20));
        assert!(deadline <= Instant::now() + Duration::from_secs(20));
        let left = a.deadline_for_new_run().unwrap();
        assert!(left > Duration::from_secs(10) && left <= Duration::from_secs(20));

        // Without fencing there is no deadline, and nothing is ever due.
        let single = fencer(&store, "node-a", false);
        single
            .regain(&alice, 1, &HashMap::from([(alice.clone(), 1)]))
            .await
            .unwrap();
        assert!(!single.fence_due());
        assert_eq!(single.fence_deadline(), None);
        assert_eq!(single.deadline_for_new_run(), None);
    }

    #[tokio::test]
    async fn frozen_mains_are_tracked_by_epoch_and_thawed_only_under_it() {
        let (store, _dir) = store().await;
        let a = fencer(&store, "node-a", true);
        let [alice, bob, carol] = ["alice", "bob", "carol"].map(user);
        a.claim(&alice, Claim::Acquire).await.unwrap();
        a.claim(&bob, Claim::Acquire).await.unwrap();

        // The deadline freezes alice once: a second freeze is no news.
        assert_eq!(a.freeze(&alice), Some(1));
        assert_eq!(a.freeze(&alice), None);
        assert!(a.is_fenced(&alice));
        // No lease here, nothing to freeze.
        assert_eq!(a.freeze(&carol), None);
        assert!(!a.is_fenced(&carol));

        // The runtime reports bob frozen under an old epoch: not thawable.
        assert!(a.note_frozen(&bob, 9, true), "newly fenced");
        assert!(!a.note_frozen(&bob, 9, true), "fenced already");
        assert!(a.is_fenced(&bob));
        assert_eq!(a.thawable(), vec![(alice.clone(), 1)]);
        // A thaw report for another epoch leaves the entry.
        assert!(!a.note_frozen(&bob, 8, false));
        assert!(a.is_fenced(&bob));
        assert!(!a.note_frozen(&bob, 9, false));
        assert!(!a.is_fenced(&bob));

        assert!(!a.thawing(&alice, 2));
        assert!(a.thawing(&alice, 1));
        assert!(!a.thawing(&alice, 1), "thawed once");
        assert!(!a.is_fenced(&alice));
        assert!(a.note_frozen(&alice, 1, true));
        a.forget_frozen(&alice);
        assert!(!a.is_fenced(&alice));
        assert_eq!(a.thawable(), vec![]);
    }

    #[test]
    fn saturating_add_never_panics_and_reaches_far() {
        let now = Instant::now();
        assert_eq!(
            saturating_add(now, Duration::from_secs(5)),
            now + Duration::from_secs(5)
        );
        let far = saturating_add(now, Duration::MAX);
        assert!(
            far >= now + Duration::from_secs(99 * 365 * 24 * 3600),
            "{far:?}"
        );
    }
}
