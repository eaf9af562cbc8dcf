//! Store test doubles for fault injection, for berth's own tests (feature
//! `contract-tests`): a real store with one call intercepted.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use berth_core::egress::EgressPolicy;
use berth_core::policy::CrashState;
use berth_core::{Epoch, Instance, Role, Slug, UnixMillis, UserId};

use crate::{
    AuthStore, ChooseNode, ClaimOutcome, InstanceFilter, InstanceStore, LaunchParams, LaunchStore,
    LeaseRecord, LeaseStore, LoginAttempt, MintOutcome, NewToken, NodeClaim, NodeRecord, NodeStore,
    Placement, SessionOwner, SessionRecord, Store, StoreError, TakeoverPolicy, TokenOwner,
    TokenRecord, UidRange, UserStore,
};

/// What runs before every `renew_leases` of an [`InterceptRenew`]: it may
/// wait (to act while a renew is in flight) or fail the renew.
#[async_trait]
pub trait RenewHook: Send + Sync + 'static {
    /// Runs before the renew reaches the store; an error is the renew's
    /// answer, and the store is not asked.
    async fn before_renew(&self) -> Result<(), StoreError>;
}

/// A test double of a store: every call goes to `inner`, except that
/// `renew_leases` first runs `hook`.
pub struct InterceptRenew<H> {
    /// The real store every call reaches.
    pub inner: Arc<dyn Store>,
    /// Run before each `renew_leases`.
    pub hook: H,
}

#[async_trait]
impl<H: RenewHook> LeaseStore for InterceptRenew<H> {
    async fn claim_lease(
        &self,
        u: &UserId,
        n: &str,
        ttl: Duration,
        t: TakeoverPolicy,
    ) -> Result<ClaimOutcome, StoreError> {
        self.inner.claim_lease(u, n, ttl, t).await
    }
    async fn take_over_lease(
        &self,
        u: &UserId,
        n: &str,
        ttl: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        self.inner.take_over_lease(u, n, ttl).await
    }
    async fn renew_leases(
        &self,
        n: &str,
        held: &[(UserId, Epoch)],
        ttl: Duration,
    ) -> Result<Vec<UserId>, StoreError> {
        self.hook.before_renew().await?;
        self.inner.renew_leases(n, held, ttl).await
    }
    async fn release_lease(&self, u: &UserId, n: &str, e: Epoch) -> Result<bool, StoreError> {
        self.inner.release_lease(u, n, e).await
    }
    async fn get_lease(&self, u: &UserId) -> Result<Option<LeaseRecord>, StoreError> {
        self.inner.get_lease(u).await
    }
    async fn list_leases(&self, e: bool, ttl: Duration) -> Result<Vec<LeaseRecord>, StoreError> {
        self.inner.list_leases(e, ttl).await
    }
    async fn leases_held_by(&self, n: &str) -> Result<Vec<LeaseRecord>, StoreError> {
        self.inner.leases_held_by(n).await
    }
}

// The other roles only pass every call on to `inner`.

#[async_trait]
impl<H: RenewHook> InstanceStore for InterceptRenew<H> {
    async fn put_instance(&self, i: &Instance) -> Result<(), StoreError> {
        self.inner.put_instance(i).await
    }
    async fn get_instance(&self, u: &UserId, r: Role) -> Result<Option<Instance>, StoreError> {
        self.inner.get_instance(u, r).await
    }
    async fn list_instances(&self, f: &InstanceFilter) -> Result<Vec<Instance>, StoreError> {
        self.inner.list_instances(f).await
    }
    async fn delete_instance(&self, u: &UserId, r: Role) -> Result<(), StoreError> {
        self.inner.delete_instance(u, r).await
    }
    async fn delete_instance_fenced(
        &self,
        u: &UserId,
        n: &str,
        e: Epoch,
    ) -> Result<(), StoreError> {
        self.inner.delete_instance_fenced(u, n, e).await
    }
    async fn record_activity(&self, a: &[(UserId, UnixMillis)]) -> Result<(), StoreError> {
        self.inner.record_activity(a).await
    }
}

#[async_trait]
impl<H: RenewHook> LaunchStore for InterceptRenew<H> {
    async fn put_launch_params(
        &self,
        u: &UserId,
        f: &str,
        p: Option<&str>,
    ) -> Result<(), StoreError> {
        self.inner.put_launch_params(u, f, p).await
    }
    async fn get_launch_params(&self, u: &UserId) -> Result<Option<LaunchParams>, StoreError> {
        self.inner.get_launch_params(u).await
    }
    async fn load_crash_state(&self, u: &UserId) -> Result<CrashState, StoreError> {
        self.inner.load_crash_state(u).await
    }
    async fn save_crash_state(&self, u: &UserId, s: &CrashState) -> Result<(), StoreError> {
        self.inner.save_crash_state(u, s).await
    }
}

#[async_trait]
impl<H: RenewHook> AuthStore for InterceptRenew<H> {
    async fn mint_token(&self, t: &NewToken<'_>) -> Result<MintOutcome, StoreError> {
        self.inner.mint_token(t).await
    }
    async fn use_token(&self, h: &str) -> Result<Option<TokenOwner>, StoreError> {
        self.inner.use_token(h).await
    }
    async fn list_tokens(&self, u: &UserId) -> Result<Vec<TokenRecord>, StoreError> {
        self.inner.list_tokens(u).await
    }
    async fn revoke_token(&self, u: &UserId, id: &str) -> Result<Vec<String>, StoreError> {
        self.inner.revoke_token(u, id).await
    }
    async fn create_session(
        &self,
        h: &str,
        o: &SessionOwner,
        ttl: Duration,
    ) -> Result<UnixMillis, StoreError> {
        self.inner.create_session(h, o, ttl).await
    }
    async fn session(&self, h: &str) -> Result<Option<SessionRecord>, StoreError> {
        self.inner.session(h).await
    }
    async fn create_login_attempt(
        &self,
        h: &str,
        a: &LoginAttempt,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.inner.create_login_attempt(h, a, ttl).await
    }
    async fn take_login_attempt(&self, h: &str) -> Result<Option<LoginAttempt>, StoreError> {
        self.inner.take_login_attempt(h).await
    }
    async fn create_login_hop(
        &self,
        h: &str,
        u: &UserId,
        t: &str,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.inner.create_login_hop(h, u, t, ttl).await
    }
    async fn take_login_hop(&self, h: &str) -> Result<Option<(UserId, String)>, StoreError> {
        self.inner.take_login_hop(h).await
    }
    async fn delete_session(&self, h: &str) -> Result<bool, StoreError> {
        self.inner.delete_session(h).await
    }
}

#[async_trait]
impl<H: RenewHook> UserStore for InterceptRenew<H> {
    async fn user_slug(&self, u: &UserId) -> Result<Option<Slug>, StoreError> {
        self.inner.user_slug(u).await
    }
    async fn user_slugs_on(&self, n: &str) -> Result<Vec<(UserId, Slug)>, StoreError> {
        self.inner.user_slugs_on(n).await
    }
    async fn record_user_slug(&self, u: &UserId, s: &Slug) -> Result<Slug, StoreError> {
        self.inner.record_user_slug(u, s).await
    }
    async fn account_uid(&self, s: &str, r: UidRange) -> Result<u32, StoreError> {
        self.inner.account_uid(s, r).await
    }
    async fn list_accounts(&self) -> Result<Vec<(String, u32)>, StoreError> {
        self.inner.list_accounts().await
    }
    async fn user_egress(&self, u: &UserId) -> Result<Option<EgressPolicy>, StoreError> {
        self.inner.user_egress(u).await
    }
    async fn set_user_egress(
        &self,
        u: &UserId,
        p: Option<&EgressPolicy>,
    ) -> Result<(), StoreError> {
        self.inner.set_user_egress(u, p).await
    }
    async fn account_egress(&self) -> Result<Vec<(u32, String, EgressPolicy)>, StoreError> {
        self.inner.account_egress().await
    }
}

#[async_trait]
impl<H: RenewHook> NodeStore for InterceptRenew<H> {
    async fn now(&self) -> Result<UnixMillis, StoreError> {
        self.inner.now().await
    }
    async fn heartbeat(&self, n: &NodeRecord) -> Result<(), StoreError> {
        self.inner.heartbeat(n).await
    }
    async fn list_nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.inner.list_nodes().await
    }
    async fn claim_node(&self, n: &str, d: &str, ttl: Duration) -> Result<NodeClaim, StoreError> {
        self.inner.claim_node(n, d, ttl).await
    }
    async fn reserve_place(
        &self,
        u: &UserId,
        hold: Duration,
        choose: &ChooseNode<'_>,
    ) -> Result<Placement, StoreError> {
        self.inner.reserve_place(u, hold, choose).await
    }
}
