//! berth's persistent state.
//!
//! * the role traits, one per part of the state and named for who uses
//!   it: [`InstanceStore`] (instance records, a main's fenced by its lease
//!   epoch, and activity), [`LeaseStore`] (the fenced lease),
//!   [`LaunchStore`] (launch parameters, crash/breaker state),
//!   [`AuthStore`] (user tokens, sessions, sign-in steps), [`UserStore`]
//!   (each user's recorded slug, the per-user accounts (host uids) of
//!   isolated instances) and [`NodeStore`] (the store's clock, nodes,
//!   placement);
//! * [`Store`]: all of them as one trait, which every backend implements
//!   (by implementing each role) and [`open`] returns;
//! * [`SqliteStore`]: the embedded single-node backend;
//! * [`PgStore`]: the PostgreSQL backend a cluster of nodes shares; both
//!   are one implementation over SQL (`sql/`: the operations and their
//!   statements written once), each adding only its dialect (clock, bulk
//!   binds, locking) and how it opens its database;
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

#![forbid(unsafe_code)]

#[cfg(feature = "contract-tests")]
pub mod contract;
pub mod lease;
mod postgres;
mod sql;
mod sqlite;
#[cfg(feature = "contract-tests")]
pub mod testing;

use std::time::Duration;

use async_trait::async_trait;
use berth_core::egress::EgressPolicy;
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
    /// Every uid of the account range is taken (see [`UserStore::account_uid`]).
    #[error(
        "no free uid for a new account in {first}-{last}: every one is taken; widen the range \
         ([isolation] base_uid / uid_count)"
    )]
    UidsExhausted {
        /// The range's first uid.
        first: u32,
        /// The range's last uid (inclusive).
        last: u32,
    },
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
        /// Whose main record it is.
        user: UserId,
        /// The epoch the refused write carried.
        epoch: Epoch,
        /// The stored record's epoch and node.
        current_epoch: Epoch,
        /// The node that wrote the stored record.
        current_node: String,
    },
    /// `slug` is already recorded for another user: two ids never share a
    /// slug, so `user` was not given it. Nothing changed.
    #[error("the slug {slug:?} is already recorded for another user; refused it for {user}")]
    SlugTaken {
        /// The user the slug was refused for.
        user: UserId,
        /// The slug another user holds.
        slug: String,
    },
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
    Claimed {
        /// The lease's new epoch, higher than any before it for this
        /// user; the main's record is written under it.
        epoch: Epoch,
    },
    /// Another node holds it. `expired` is true when its lease ran out but
    /// there is no evidence it is gone (see [`TakeoverPolicy`]).
    Busy {
        /// The node that holds it.
        holder: String,
        /// Its lease ran out, but its holder may still be alive.
        expired: bool,
    },
}

/// How a starting node's claim on its id came out ([`NodeStore::claim_node`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeClaim {
    /// The id is this process's now.
    Claimed,
    /// Another process runs under this id, from another data dir (or on
    /// another host), and has heartbeaten within the TTL: its row.
    Live(NodeRecord),
}

/// One user's lease row, as reported to operators.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// Whose lease it is.
    pub user: UserId,
    /// The holder, kept as a sticky hint after release.
    pub holder: Option<String>,
    /// The epoch of the latest claim or takeover. Each raises it by one,
    /// so it tells one holding of the lease from every other (invariants
    /// 6 and 7).
    pub epoch: Epoch,
    /// When the lease ends, by the store's clock.
    pub lease_until: Option<UnixMillis>,
    /// Released on purpose (as opposed to run out).
    pub released: bool,
    /// Past `lease_until` by the store's clock, and not released.
    pub expired: bool,
    /// Whether the holder's last heartbeat is at most the TTL given to
    /// [`LeaseStore::list_leases`] old, by the store's clock: the same test a claim
    /// under [`TakeoverPolicy::Evidence`] applies, so an expired lease whose
    /// holder is not alive is one such a claim may take, and an expired
    /// lease whose holder is alive needs an operator's takeover. `None`
    /// when there is no holder, and in the answers of [`LeaseStore::get_lease`]
    /// and [`LeaseStore::leases_held_by`], which are not given a TTL.
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

/// A user token as it is listed: everything but its secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    /// The public handle, for listing and revoking.
    pub id: String,
    /// Whose token it is.
    pub user: UserId,
    /// The store's clock when it was minted.
    pub created_at: UnixMillis,
    /// By the store's clock; a lookup at or after it finds nothing.
    pub expires_at: UnixMillis,
    /// When a node last looked it up in the store. Nodes cache tokens, so
    /// this is the last use give or take the cache's lifetime.
    pub last_used_at: Option<UnixMillis>,
    /// The token it was minted with; `None` when the admin minted it.
    pub parent: Option<String>,
}

/// A token to mint with [`AuthStore::mint_token`].
#[derive(Debug, Clone, Copy)]
pub struct NewToken<'a> {
    /// A fresh public id (random; unique across all tokens).
    pub id: &'a str,
    /// Whom it is for.
    pub user: &'a UserId,
    /// The SHA-256 of the secret, lowercase hex.
    pub token_hash: &'a str,
    /// How long it lives, from the store's clock.
    pub ttl: Duration,
    /// The id of the user token it is minted with, if any: the new token
    /// then expires no later than that one, and is refused if that one is
    /// no longer live or belongs to another user.
    pub parent: Option<&'a str>,
    /// The most live tokens `user` may have; minting one more is refused.
    pub max_live: u32,
}

/// What [`AuthStore::mint_token`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MintOutcome {
    /// The token is recorded; its listing, with the expiry bounded by the
    /// parent's.
    Minted(TokenRecord),
    /// The user already has `live` live tokens, the cap; nothing changed.
    TooMany {
        /// How many live tokens the user has.
        live: u32,
    },
    /// The parent token is revoked, expired, or another user's.
    ParentGone,
}

/// Who a live token belongs to, as [`AuthStore::use_token`] finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenOwner {
    /// Whose token it is.
    pub user: UserId,
    /// The token's public id.
    pub id: String,
    /// When it stops working, by the store's clock.
    pub expires_at: UnixMillis,
    /// The store's clock at the lookup, so that the caller can tell how
    /// long the token has left by the store's clock.
    pub now: UnixMillis,
}
pub use berth_core::UidRange;

/// Whose a session is: the admin token's, or a signed-in user's.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SessionOwner {
    /// `None`: a session made from the admin token.
    pub user: Option<UserId>,
    /// Whether the session may do what the admin may.
    pub admin: bool,
    /// The user token the login's app cookies are minted under.
    pub token_id: Option<String>,
}

/// A live session, as [`AuthStore::session`] finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRecord {
    /// Whose session it is.
    pub owner: SessionOwner,
    /// When it ends, by the store's clock.
    pub expires_at: UnixMillis,
}

/// What the callback of a sign-in needs, kept between the redirect to the
/// provider and the way back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoginAttempt {
    /// The PKCE secret whose challenge went to the provider; the token
    /// request sends it back to prove the same client asks.
    pub pkce_verifier: String,
    /// The value the provider must put in the ID token, so that a token
    /// issued for another sign-in is refused.
    pub nonce: String,
    /// Where the user goes once signed in (a URL berth made or checked).
    pub return_to: String,
}

/// How often an account allocation retries after losing a race for a uid
/// to another node. Each retry means another account was created, so this
/// bounds only pathological contention.
const ACCOUNT_ATTEMPTS: usize = 64;

/// Which instance records to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InstanceFilter {
    /// Only records in this status; `None`: any.
    pub status: Option<InstanceStatus>,
    /// Only records written by this node; `None`: any.
    pub node: Option<String>,
    /// Only records of this role; `None`: both.
    pub role: Option<Role>,
}

/// Whether a node takes new instances.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeStatus {
    /// Running and taking new instances.
    #[default]
    Up,
    /// Keeps what it runs but takes nothing new (an operator's drain).
    Draining,
    /// Shut down on purpose: it takes nothing new, and its id may be
    /// claimed again at once (see [`NodeStore::claim_node`]).
    Down,
}

impl NodeStatus {
    /// The status's name, as the API and the `nodes` table spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeStatus::Up => "up",
            NodeStatus::Draining => "draining",
            NodeStatus::Down => "down",
        }
    }
}

impl std::fmt::Display for NodeStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A node's row in the `nodes` table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// The node's id, unique in the cluster (invariant 8).
    pub id: String,
    /// Where clients, and other nodes forwarding app traffic, reach it.
    pub advertise_url: String,
    /// Where other nodes call its node-to-node API (`/internal/v1/…`, on a
    /// listener of its own); empty for a node that advertises none.
    #[serde(default)]
    pub internal_url: String,
    /// How many mains it is willing to run.
    pub capacity: u32,
    /// How many mains it runs now.
    pub load: u32,
    /// Whether it takes new instances.
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
    /// being [`NodeStore::now`] read by the caller: the heartbeat is stamped by
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

/// The choice [`NodeStore::reserve_place`] asks for: given every node with its
/// live load (by the store's clock and counts), the node to reserve a
/// place on, or `None` for none. A pure function, such as
/// [`berth_core::policy::place`]; it runs while placements are held.
pub type ChooseNode<'a> = dyn Fn(&[NodeView]) -> Option<String> + Send + Sync + 'a;

/// What [`NodeStore::reserve_place`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The node a place was reserved on; `None` when the choice was none.
    pub node: Option<String>,
    /// The nodes as the choice saw them, loads before this reservation.
    pub nodes: Vec<NodeView>,
}

/// berth's persistent state: every role below, as one object. One
/// implementation per database ([`SqliteStore`], [`PgStore`]), which
/// implements each role once; [`open`] returns it as `Arc<dyn Store>`, and a
/// part that needs only one role takes that role's trait object (trait
/// upcasting turns an `Arc<dyn Store>` into, say, an `Arc<dyn AuthStore>`).
pub trait Store:
    InstanceStore + LeaseStore + LaunchStore + AuthStore + UserStore + NodeStore
{
}

impl<T> Store for T where
    T: InstanceStore + LeaseStore + LaunchStore + AuthStore + UserStore + NodeStore + ?Sized
{
}

/// The instance records, one row per (user, role), and their activity.
///
/// Used by the controller: its publisher (which writes every record), its
/// launches, spawner and adoption (which read and clear records) and its
/// activity flush; by failover, and by the API's listings and event feed.
#[async_trait]
pub trait InstanceStore: Send + Sync + 'static {
    /// Inserts or replaces the record for `(instance.user, instance.role)`.
    ///
    /// A main's record is fenced by its lease: it replaces the stored one
    /// only if that was written under a lower epoch, or under the same epoch
    /// by the same node; otherwise nothing changes and the answer is
    /// [`StoreError::Fenced`]. So a node that lost the lease can never
    /// overwrite the record of the node that holds it now. Watchdog records
    /// hold no lease (epoch 0) and are replaced unconditionally.
    async fn put_instance(&self, instance: &Instance) -> Result<(), StoreError>;
    /// The record of `(user, role)`, if there is one.
    async fn get_instance(&self, user: &UserId, role: Role)
    -> Result<Option<Instance>, StoreError>;
    /// Every record the filter lets through, ordered by user, then role.
    async fn list_instances(&self, filter: &InstanceFilter) -> Result<Vec<Instance>, StoreError>;
    /// Deletes the record of `(user, role)`, whoever wrote it; deleting
    /// nothing is not an error. For watchdogs, which hold no lease, and
    /// for an operator's cleanup: a node acting under a lease deletes its
    /// main's record with [`InstanceStore::delete_instance_fenced`].
    async fn delete_instance(&self, user: &UserId, role: Role) -> Result<(), StoreError>;
    /// Deletes `user`'s main record if `node` may still change it under
    /// `epoch`, by the rule of [`InstanceStore::put_instance`]. A record written
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
}

/// The per-user main lease, fenced by its epoch.
///
/// All its methods are single conditional statements; success is judged
/// by whether a row was written, and every time comparison uses the
/// store's clock ([`NodeStore::now`]).
///
/// Used by the [`lease::LeaseKeeper`] (through which the controller's
/// fencer claims, renews and releases), by the controller's adoption (the
/// leases this node holds) and slugs, by failover (expired leases), and by
/// the cluster's routing and the operator endpoints, API listings and
/// event feed that report leases.
#[async_trait]
pub trait LeaseStore: Send + Sync + 'static {
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

    /// `user`'s lease row, if one was ever claimed; its
    /// [`LeaseRecord::holder_alive`] is `None`.
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
}

/// How each user's main is launched: the parameters it was last launched
/// with, and its crash history and breaker.
///
/// Used by the controller's launches and its breaker, by relaunches
/// (failover's and an operator's) that repeat the last launch, and by the
/// event feed that reports a breaker.
#[async_trait]
pub trait LaunchStore: Send + Sync + 'static {
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
    /// What `user`'s main was last launched with, if anything was recorded.
    async fn get_launch_params(&self, user: &UserId) -> Result<Option<LaunchParams>, StoreError>;

    // --- crash history and breaker ------------------------------------------

    /// `user`'s crash history and breaker; a clear state when none is kept.
    async fn load_crash_state(&self, user: &UserId) -> Result<CrashState, StoreError>;
    /// Saves the state; a clear state deletes the row.
    async fn save_crash_state(&self, user: &UserId, state: &CrashState) -> Result<(), StoreError>;
}

/// User tokens (stored hashed), sessions, and the steps of a sign-in.
///
/// Used by the server's authentication (`serve/auth.rs`: token lookups and
/// minting, sessions), by sign-in (`serve/login.rs`, the sign-in API) and
/// by the credentials API.
#[async_trait]
pub trait AuthStore: Send + Sync + 'static {
    // --- user tokens (stored hashed) ----------------------------------------

    /// Records a new user token, as one atomic step across nodes: drops the
    /// user's expired tokens, refuses when the user already has
    /// [`NewToken::max_live`] live ones or the parent is gone, and bounds
    /// the expiry by the parent's.
    async fn mint_token(&self, new: &NewToken<'_>) -> Result<MintOutcome, StoreError>;
    /// The owner of the live token with this hash, recording the use;
    /// `None` for an unknown, expired or revoked token.
    async fn use_token(&self, token_hash: &str) -> Result<Option<TokenOwner>, StoreError>;
    /// `user`'s live tokens, oldest first.
    async fn list_tokens(&self, user: &UserId) -> Result<Vec<TokenRecord>, StoreError>;
    /// Deletes `user`'s token `id` and every token minted with it, directly
    /// or not. Returns the ids deleted; empty when `user` has no token
    /// `id`.
    async fn revoke_token(&self, user: &UserId, id: &str) -> Result<Vec<String>, StoreError>;

    // --- sessions and sign-in -------------------------------------------------

    /// Records a session by the hash of its secret; drops expired sessions.
    /// Returns when it expires, by the store's clock.
    async fn create_session(
        &self,
        secret_hash: &str,
        owner: &SessionOwner,
        ttl: Duration,
    ) -> Result<UnixMillis, StoreError>;
    /// The live session with this hash; `None` if there is none (unknown,
    /// expired or ended).
    async fn session(&self, secret_hash: &str) -> Result<Option<SessionRecord>, StoreError>;
    /// Ends a session. Returns whether there was one.
    async fn delete_session(&self, secret_hash: &str) -> Result<bool, StoreError>;
    /// Records a sign-in in progress by the hash of its `state`; drops
    /// expired ones.
    async fn create_login_attempt(
        &self,
        state_hash: &str,
        attempt: &LoginAttempt,
        ttl: Duration,
    ) -> Result<(), StoreError>;
    /// Takes (deletes and returns) the live sign-in of this `state` hash:
    /// a second take of one state finds nothing.
    async fn take_login_attempt(
        &self,
        state_hash: &str,
    ) -> Result<Option<LoginAttempt>, StoreError>;
    /// Records a one-time code that opens `user`'s app under token
    /// `token_id`; drops expired codes.
    async fn create_login_hop(
        &self,
        code_hash: &str,
        user: &UserId,
        token_id: &str,
        ttl: Duration,
    ) -> Result<(), StoreError>;
    /// Takes (deletes and returns) the live code of this hash: the user and
    /// the token id it was made for.
    async fn take_login_hop(&self, code_hash: &str)
    -> Result<Option<(UserId, String)>, StoreError>;
}

/// Users: each user's recorded slug, and the host accounts of isolated
/// instances.
///
/// Used by the controller's slugs and adoption (recording and restoring
/// slugs) and by the server's account allocation for isolation (the local
/// runtime's `Accounts`).
#[async_trait]
pub trait UserStore: Send + Sync + 'static {
    // --- users and their slugs ----------------------------------------------

    /// The slug recorded for `user`, if one is.
    async fn user_slug(&self, user: &UserId) -> Result<Option<Slug>, StoreError>;
    /// The recorded slug of every user with an instance record on `node`,
    /// in one read (a restart of a node of thousands asks for them all).
    async fn user_slugs_on(&self, node: &str) -> Result<Vec<(UserId, Slug)>, StoreError>;
    /// Records `slug` for `user` unless a slug is recorded for them
    /// already, and returns the user's recorded slug: the one recorded
    /// before (whatever `slug` says: a user's slug never changes), else
    /// `slug`. A slug recorded for another user is refused with
    /// [`StoreError::SlugTaken`] and nothing changes. Atomic across nodes:
    /// the table's two unique constraints decide every race.
    async fn record_user_slug(&self, user: &UserId, slug: &Slug) -> Result<Slug, StoreError>;

    // --- accounts of isolated instances -------------------------------------

    /// The host uid of `slug`'s account, allocated on first use: the uid
    /// after the highest one of `range` already taken (so uids are handed
    /// out in order and never reused). An existing account keeps its uid
    /// even if `range` no longer contains it: a user's files must keep
    /// their owner. Concurrent callers, on any node, for the same slug get
    /// the same uid, and for different slugs different ones.
    /// [`StoreError::UidsExhausted`] when the range has no uid left.
    async fn account_uid(&self, slug: &str, range: UidRange) -> Result<u32, StoreError>;
    /// Every account, as `(slug, uid)`, ordered by uid.
    async fn list_accounts(&self) -> Result<Vec<(String, u32)>, StoreError>;

    // --- users' own egress policies -----------------------------------------

    /// The egress policy an operator set for `user`; `None`: the node's.
    async fn user_egress(&self, user: &UserId) -> Result<Option<EgressPolicy>, StoreError>;
    /// Sets `user`'s own egress policy, replacing any; `None` gives the
    /// user the node's again.
    async fn set_user_egress(
        &self,
        user: &UserId,
        policy: Option<&EgressPolicy>,
    ) -> Result<(), StoreError>;
    /// Every account whose user has an egress policy of their own, as
    /// `(uid, slug, policy)`, ordered by uid, in one read: a node guards
    /// the instances it adopts with them before they run on.
    async fn account_egress(&self) -> Result<Vec<(u32, String, EgressPolicy)>, StoreError>;
}

/// The cluster's nodes: the store's clock, heartbeats, the claim of a node
/// id, and the reservation of a place for a new instance.
///
/// Used by the controller's heartbeat, by the server's start (claiming its
/// node id), and by the cluster's routing and placement and the API's node
/// listings.
#[async_trait]
pub trait NodeStore: Send + Sync + 'static {
    /// The store's clock, in Unix milliseconds.
    async fn now(&self) -> Result<UnixMillis, StoreError>;

    /// Inserts or updates the node's row and stamps its heartbeat with the
    /// store's clock.
    async fn heartbeat(&self, node: &NodeRecord) -> Result<(), StoreError>;
    /// Every node's row. For placement and liveness, turn each into a
    /// [`NodeView`] with [`NodeRecord::view`], passing [`NodeStore::now`]: a
    /// heartbeat's age is measured by the store's clock.
    async fn list_nodes(&self) -> Result<Vec<NodeRecord>, StoreError>;

    /// Claims node id `node` for a starting process whose data dir has the
    /// identity `data_dir_id`, as one conditional write: it succeeds when
    /// the id has no row, when its row says `down`, when its heartbeat is
    /// older than `ttl` by the store's clock, or when the row was last
    /// claimed from the same data dir. The caller must hold that data dir's
    /// lock (which a live process never gives up), so in the last case
    /// whoever claimed the row before is dead: a node restarted after a
    /// crash starts at once. A successful claim records `data_dir_id` and
    /// stamps the heartbeat (an existing row keeps its URL, capacity and
    /// load until the node's first heartbeat; a `down` row becomes `up`),
    /// so a second process starting with another data dir at the same
    /// moment is refused.
    async fn claim_node(
        &self,
        node: &str,
        data_dir_id: &str,
        ttl: Duration,
    ) -> Result<NodeClaim, StoreError>;

    /// Reserves a place for a new instance of `user` on the node `choose`
    /// picks, for `hold` (by the store's clock), as one step across nodes:
    /// placements take turns, so each sees the places reserved by those
    /// before it. `choose` is given every node's row as a [`NodeView`]
    /// whose `load` is its live count, not the number its last heartbeat
    /// reported: the leases it holds and has not released, plus the places
    /// reserved for it that are still held and whose user's lease has not
    /// been claimed since (the claim's lease counts instead). A user has at
    /// most one reservation; a new one replaces it. Nothing is recorded
    /// when `choose` picks no node.
    async fn reserve_place(
        &self,
        user: &UserId,
        hold: Duration,
        choose: &ChooseNode<'_>,
    ) -> Result<Placement, StoreError>;
}

/// Refuses a patch larger than `berth_core::MAX_PATCH_BYTES` before it
/// reaches SQL; the schema checks the same bound.
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

/// The range's first and last uid as the stores bind them; an empty range
/// (or one past the largest uid) is refused before any SQL runs.
fn account_bounds(range: UidRange) -> Result<(i64, i64), StoreError> {
    match range.last() {
        Some(last) => Ok((i64::from(range.first), i64::from(last))),
        None => Err(StoreError::Query(format!(
            "uid range of {} from {} is empty or passes the largest uid",
            range.count, range.first
        ))),
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
            internal_url: "http://a:8081".into(),
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
            // Its name is the one the API's JSON carries.
            assert_eq!(
                serde_json::to_value(status).unwrap(),
                serde_json::Value::from(status.as_str())
            );
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
            place("alice", None, &[], &[up.view(up.heartbeat + 1_000)], 30_000).as_deref(),
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
