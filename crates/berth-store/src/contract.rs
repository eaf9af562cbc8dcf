//! The contract every [`Store`] backend must pass, independent of the
//! database behind it.
//!
//! Each case is a `pub async fn` taking a fresh, empty store and panicking
//! on a violation. [`store_contract_tests!`](crate::store_contract_tests)
//! turns the whole list into `#[tokio::test]`s for one backend:
//!
//! ```text
//! async fn fresh() -> (Arc<dyn Store>, tempfile::TempDir) { … }
//! berth_store::store_contract_tests!(fresh().await);
//! ```
//!
//! The expression is evaluated inside each (async) test, so it may `.await`.
//! It yields either an `Arc<dyn Store>` or a pair `(Arc<dyn Store>, guard)`
//! whose guard (a temporary directory, a test database handle) is kept alive
//! until the case ends; see [`FreshStore`]. The calling crate needs `tokio`
//! (with `macros` and `rt-multi-thread`) among its dev-dependencies.
//!
//! Lease expiry is waited for by polling the store until a deadline, never
//! by asserting on how long something took.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test support: a case's panic is its failure report"
)]

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use berth_core::policy::{CrashState, NodeState, NodeView};
use berth_core::{Epoch, Instance, InstanceStatus, Role, Slug, UnixMillis, UserId};

use crate::{
    ClaimOutcome, InstanceFilter, LaunchParams, LoginAttempt, MintOutcome, NewToken, NodeClaim,
    NodeRecord, NodeStatus, SessionOwner, SessionRecord, Store, StoreError, TakeoverPolicy,
    TokenRecord, UidRange,
};

/// A lease that runs out while a test watches.
const SHORT: Duration = Duration::from_millis(300);
/// A lease that does not run out during a test.
const LONG: Duration = Duration::from_secs(120);
/// How long to wait for the store's clock to pass a point before failing.
const PATIENCE: Duration = Duration::from_secs(20);
const POLL: Duration = Duration::from_millis(25);

/// What a `store_contract_tests!` expression may produce.
pub trait FreshStore {
    /// The store, and whatever must outlive it.
    fn into_parts(self) -> (Arc<dyn Store>, Box<dyn Any + Send>);
}

impl FreshStore for Arc<dyn Store> {
    fn into_parts(self) -> (Arc<dyn Store>, Box<dyn Any + Send>) {
        (self, Box::new(()))
    }
}

impl<G: Send + 'static> FreshStore for (Arc<dyn Store>, G) {
    fn into_parts(self) -> (Arc<dyn Store>, Box<dyn Any + Send>) {
        (self.0, Box::new(self.1))
    }
}

/// Expands to one `#[tokio::test]` per contract case, each given a fresh
/// store from `$fresh` (see the [module docs](crate::contract)).
#[macro_export]
macro_rules! store_contract_tests {
    ($fresh:expr) => {
        $crate::store_contract_tests!(@cases $fresh;
            store_clock_is_plausible,
            instance_round_trip_keeps_every_field,
            instance_list_filters,
            live_port_is_unique_per_node,
            main_record_is_fenced_by_epoch,
            watchdog_records_are_not_fenced,
            delete_of_main_is_fenced,
            launch_params_round_trip_and_size_limit,
            claim_on_fresh_user_gets_epoch_1,
            second_node_is_busy_while_lease_is_live,
            holder_reclaims_own_lease_with_next_epoch,
            renew_with_stale_epoch_or_wrong_node_renews_nothing,
            renew_of_expired_untaken_lease_succeeds,
            renew_does_not_revive_released_lease,
            renew_thousands_in_one_call,
            release_keeps_holder_hint_and_frees_lease,
            expired_lease_with_live_holder_is_busy_expired,
            expired_lease_with_stale_holder_needs_evidence_policy,
            expired_lease_of_unregistered_holder_is_claimable_with_evidence,
            take_over_only_works_on_expired_leases,
            list_leases_and_leases_held_by,
            list_leases_reports_holder_liveness,
            concurrent_claimers_have_one_winner,
            crash_state_round_trip_and_clear_deletes,
            tokens_mint_use_list_and_expire,
            token_cap_holds_under_concurrent_mints,
            child_tokens_never_outlive_their_parent,
            revocation_takes_every_descendant_and_only_them,
            sessions_live_until_they_expire_or_end,
            login_attempts_and_hops_are_taken_once,
            user_slug_is_recorded_once_and_kept,
            user_slugs_on_a_node_are_read_at_once,
            a_slug_recorded_for_one_user_is_refused_for_another,
            concurrent_first_records_agree_on_one_slug,
            nodes_heartbeat_upsert_and_list,
            placement_counts_live_leases_and_reservations,
            concurrent_placements_take_turns,
            node_claims_need_a_stale_row_or_the_same_data_dir,
            record_activity_never_lowers_last_active,
            accounts_get_stable_unique_uids,
            accounts_refuse_a_full_range_and_change_nothing,
            concurrent_account_allocations_never_share_a_uid,
            user_egress_is_set_replaced_and_given_back_per_account,
        );
    };
    (@cases $fresh:expr; $($case:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let (store, guard) = $crate::contract::FreshStore::into_parts($fresh);
                $crate::contract::$case(store).await;
                drop(guard);
            }
        )+
    };
}

fn user(id: &str) -> UserId {
    UserId::parse(id).unwrap()
}

fn instance(u: &str, role: Role, node: &str, port: Option<u16>) -> Instance {
    Instance {
        id: format!("{u}-{role}-1"),
        user: user(u),
        role,
        status: InstanceStatus::Running,
        node: node.to_owned(),
        epoch: 0,
        port,
        pid: None,
        runtime_ref: None,
        folder: String::new(),
        started_at: 1_700_000_000_000,
        ready: false,
        restarts: 0,
        last_error: None,
        exit_code: None,
        last_active: 1_700_000_000_000,
        hibernated_at: None,
    }
}

fn node(id: &str) -> NodeRecord {
    NodeRecord {
        id: id.to_owned(),
        advertise_url: format!("http://{id}.internal:8080"),
        internal_url: format!("http://{id}.internal:8081"),
        capacity: 10,
        load: 0,
        status: NodeStatus::Up,
        heartbeat: 0,
    }
}

async fn claim(store: &Arc<dyn Store>, u: &UserId, node: &str, ttl: Duration) -> ClaimOutcome {
    store
        .claim_lease(u, node, ttl, TakeoverPolicy::Evidence)
        .await
        .unwrap()
}

async fn claimed(store: &Arc<dyn Store>, u: &UserId, node: &str, ttl: Duration) -> Epoch {
    match claim(store, u, node, ttl).await {
        ClaimOutcome::Claimed { epoch } => epoch,
        other => panic!("{node} could not claim {u}: {other:?}"),
    }
}

/// Waits until the store's clock says `u`'s lease has expired.
async fn wait_until_expired(store: &Arc<dyn Store>, u: &UserId) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let lease = store.get_lease(u).await.unwrap().unwrap();
        if lease.expired {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "lease of {u} did not expire: {lease:?}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Waits until `node`'s last heartbeat is more than `age` old by the
/// store's clock.
async fn wait_until_heartbeat_older(store: &Arc<dyn Store>, node: &str, age: Duration) {
    let age = i64::try_from(age.as_millis()).unwrap();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let beat = store
            .list_nodes()
            .await
            .unwrap()
            .into_iter()
            .find(|n| n.id == node)
            .unwrap()
            .heartbeat;
        if store.now().await.unwrap() - beat > age {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "heartbeat of {node} did not age"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// The store's clock reads as Unix milliseconds and does not run backwards.
pub async fn store_clock_is_plausible(store: Arc<dyn Store>) {
    let a = store.now().await.unwrap();
    let b = store.now().await.unwrap();
    // 2020-01-01: catches seconds or microseconds passed off as millis.
    assert!(a > 1_577_836_800_000 && a < 32_503_680_000_000, "{a}");
    assert!(b >= a, "store clock ran backwards: {a} then {b}");
}

/// put/get/delete keep every field of an instance, `Some` and `None` alike,
/// and a second put replaces the record.
pub async fn instance_round_trip_keeps_every_field(store: Arc<dyn Store>) {
    let alice = user("a.b@corp.example");
    let full = Instance {
        id: "inst-1".into(),
        user: alice.clone(),
        role: Role::Main,
        status: InstanceStatus::Crashed,
        node: "node-a".into(),
        epoch: 7,
        port: Some(u16::MAX),
        pid: Some(u32::MAX),
        runtime_ref: Some(berth_core::runtime::RuntimeRef::new(
            "shim 4242 pid 77 started 9",
        )),
        folder: "projects/ü nicode".into(),
        started_at: 1_700_000_000_123,
        ready: true,
        restarts: 3,
        last_error: Some("boom\nline 2 'quoted'".into()),
        exit_code: Some(-9),
        last_active: 1_700_000_999_999,
        hibernated_at: None,
    };
    assert_eq!(store.get_instance(&alice, Role::Main).await.unwrap(), None);
    store.put_instance(&full).await.unwrap();
    assert_eq!(
        store.get_instance(&alice, Role::Main).await.unwrap(),
        Some(full.clone())
    );
    assert_eq!(
        store.get_instance(&alice, Role::Watchdog).await.unwrap(),
        None
    );

    let bare = Instance {
        id: "inst-2".into(),
        status: InstanceStatus::Stopped,
        epoch: 8,
        port: None,
        pid: None,
        runtime_ref: None,
        folder: String::new(),
        ready: false,
        restarts: 0,
        last_error: None,
        exit_code: None,
        ..full.clone()
    };
    store.put_instance(&bare).await.unwrap();
    assert_eq!(
        store.get_instance(&alice, Role::Main).await.unwrap(),
        Some(bare.clone())
    );

    let watchdog = Instance {
        role: Role::Watchdog,
        epoch: 0,
        ..full.clone()
    };
    store.put_instance(&watchdog).await.unwrap();
    let all = store
        .list_instances(&InstanceFilter::default())
        .await
        .unwrap();
    assert_eq!(all.len(), 2, "{all:?}");

    store.delete_instance(&alice, Role::Main).await.unwrap();
    assert_eq!(store.get_instance(&alice, Role::Main).await.unwrap(), None);
    assert_eq!(
        store.get_instance(&alice, Role::Watchdog).await.unwrap(),
        Some(watchdog)
    );
    // Deleting what is not there is not an error.
    store.delete_instance(&alice, Role::Main).await.unwrap();
}

/// list_instances honours each filter and their combination.
pub async fn instance_list_filters(store: Arc<dyn Store>) {
    let mut a = instance("alice", Role::Main, "node-a", Some(4001));
    a.status = InstanceStatus::Running;
    let mut aw = instance("alice", Role::Watchdog, "node-a", Some(4002));
    aw.status = InstanceStatus::Starting;
    let mut b = instance("bob", Role::Main, "node-b", Some(4001));
    b.status = InstanceStatus::Running;
    let mut c = instance("carol", Role::Main, "node-a", None);
    c.status = InstanceStatus::Stopped;
    for i in [&a, &aw, &b, &c] {
        store.put_instance(i).await.unwrap();
    }
    let ids = |v: Vec<Instance>| {
        let mut ids: Vec<String> = v
            .into_iter()
            .map(|i| format!("{}/{}", i.user, i.role))
            .collect();
        ids.sort();
        ids
    };
    let list = |f: InstanceFilter| {
        let store = store.clone();
        async move { ids(store.list_instances(&f).await.unwrap()) }
    };
    assert_eq!(
        list(InstanceFilter::default()).await,
        ["alice/main", "alice/watchdog", "bob/main", "carol/main"]
    );
    assert_eq!(
        list(InstanceFilter {
            status: Some(InstanceStatus::Running),
            ..Default::default()
        })
        .await,
        ["alice/main", "bob/main"]
    );
    assert_eq!(
        list(InstanceFilter {
            node: Some("node-a".into()),
            ..Default::default()
        })
        .await,
        ["alice/main", "alice/watchdog", "carol/main"]
    );
    assert_eq!(
        list(InstanceFilter {
            role: Some(Role::Watchdog),
            ..Default::default()
        })
        .await,
        ["alice/watchdog"]
    );
    assert_eq!(
        list(InstanceFilter {
            status: Some(InstanceStatus::Running),
            node: Some("node-a".into()),
            role: Some(Role::Main),
        })
        .await,
        ["alice/main"]
    );
    assert!(
        list(InstanceFilter {
            node: Some("node-z".into()),
            ..Default::default()
        })
        .await
        .is_empty()
    );
}

/// No (node, port) is recorded for two live instances; terminal ones and
/// other nodes do not count.
pub async fn live_port_is_unique_per_node(store: Arc<dyn Store>) {
    let alice = instance("alice", Role::Main, "node-a", Some(4000));
    store.put_instance(&alice).await.unwrap();
    // Re-putting the same record with the same port is not a clash.
    store.put_instance(&alice).await.unwrap();

    for status in [
        InstanceStatus::Starting,
        InstanceStatus::Running,
        InstanceStatus::Crashed,
    ] {
        let mut bob = instance("bob", Role::Main, "node-a", Some(4000));
        bob.status = status;
        let err = store.put_instance(&bob).await;
        assert!(
            err.is_err(),
            "{status}: second live instance on node-a:4000"
        );
    }
    let mut alice_wd = instance("alice", Role::Watchdog, "node-a", Some(4000));
    alice_wd.status = InstanceStatus::Starting;
    assert!(store.put_instance(&alice_wd).await.is_err());
    // The failed puts left alice's record alone.
    assert_eq!(
        store.get_instance(&alice.user, Role::Main).await.unwrap(),
        Some(alice.clone())
    );

    let bob_other_node = instance("bob", Role::Main, "node-b", Some(4000));
    store.put_instance(&bob_other_node).await.unwrap();
    let mut carol_stopped = instance("carol", Role::Main, "node-a", Some(4000));
    carol_stopped.status = InstanceStatus::Stopped;
    store.put_instance(&carol_stopped).await.unwrap();
    let no_port = [
        instance("dave", Role::Main, "node-a", None),
        instance("erin", Role::Main, "node-a", None),
    ];
    for i in &no_port {
        store.put_instance(i).await.unwrap();
    }

    let mut alice_stopped = alice.clone();
    alice_stopped.status = InstanceStatus::Failed;
    store.put_instance(&alice_stopped).await.unwrap();
    // bob moves to node-a under a newer lease, onto the port alice freed.
    let mut bob = instance("bob", Role::Main, "node-a", Some(4000));
    bob.epoch = 1;
    store.put_instance(&bob).await.unwrap();
}

/// Asserts `result` is the refusal of a change under `epoch`, naming the
/// record that stands in its way.
fn assert_fenced(result: Result<(), StoreError>, u: &UserId, epoch: Epoch, current: (Epoch, &str)) {
    match result {
        Err(StoreError::Fenced {
            user,
            epoch: refused,
            current_epoch,
            current_node,
        }) => assert_eq!(
            (&user, refused, current_epoch, current_node.as_str()),
            (u, epoch, current.0, current.1)
        ),
        other => panic!("expected Fenced at epoch {epoch} by {current:?}, got {other:?}"),
    }
}

/// A main's record only moves forward: a write under an older epoch, or
/// under the same epoch from another node, is refused with `Fenced` and
/// changes nothing; the same node at the same epoch updates it, and a newer
/// epoch from any node replaces it.
pub async fn main_record_is_fenced_by_epoch(store: Arc<dyn Store>) {
    let alice = user("alice");
    let mut a2 = instance("alice", Role::Main, "node-a", Some(4000));
    a2.epoch = 2;
    store.put_instance(&a2).await.unwrap();

    // node-b, paused while it held epoch 1, wakes up and writes.
    let mut b1 = instance("alice", Role::Main, "node-b", Some(4100));
    b1.epoch = 1;
    b1.status = InstanceStatus::Crashed;
    assert_fenced(store.put_instance(&b1).await, &alice, 1, (2, "node-a"));
    // The same epoch from another node is not the holder either.
    let b2 = Instance {
        epoch: 2,
        ..b1.clone()
    };
    assert_fenced(store.put_instance(&b2).await, &alice, 2, (2, "node-a"));
    // node-a itself under an older epoch (a stale task of its own) too.
    let a1 = Instance {
        epoch: 1,
        status: InstanceStatus::Stopped,
        ..a2.clone()
    };
    assert_fenced(store.put_instance(&a1).await, &alice, 1, (2, "node-a"));
    assert_eq!(
        store.get_instance(&alice, Role::Main).await.unwrap(),
        Some(a2.clone())
    );

    // The holder updates its own record under its epoch.
    let a2_ready = Instance {
        ready: true,
        pid: Some(42),
        ..a2.clone()
    };
    store.put_instance(&a2_ready).await.unwrap();
    assert_eq!(
        store.get_instance(&alice, Role::Main).await.unwrap(),
        Some(a2_ready)
    );

    // node-b under a newer lease takes the record over; now node-a is the
    // stale one, and the refusal names node-b.
    let b3 = Instance {
        epoch: 3,
        ..b1.clone()
    };
    store.put_instance(&b3).await.unwrap();
    assert_fenced(store.put_instance(&a2).await, &alice, 2, (3, "node-b"));
    assert_eq!(
        store.get_instance(&alice, Role::Main).await.unwrap(),
        Some(b3.clone())
    );

    // The refusal reads as a busy lease to the spawner's callers.
    let err = store.put_instance(&a2).await.unwrap_err();
    assert!(err.to_string().contains("newer lease"), "{err}");
    assert_eq!(
        berth_core::SpawnError::from(err),
        berth_core::SpawnError::LeaseBusy {
            user: alice.clone(),
            holder: "node-b".into(),
            expired: false
        }
    );

    // Other users are untouched by all of this.
    let bob = instance("bob", Role::Main, "node-a", Some(4001));
    store.put_instance(&bob).await.unwrap();
    assert_eq!(
        store.get_instance(&bob.user, Role::Main).await.unwrap(),
        Some(bob)
    );
}

/// Watchdogs hold no lease: their records are replaced whoever writes, and
/// writing one never disturbs the main's fence.
pub async fn watchdog_records_are_not_fenced(store: Arc<dyn Store>) {
    let alice = user("alice");
    let mut main = instance("alice", Role::Main, "node-a", Some(4000));
    main.epoch = 5;
    store.put_instance(&main).await.unwrap();

    let wa = instance("alice", Role::Watchdog, "node-a", None);
    store.put_instance(&wa).await.unwrap();
    let wb = instance("alice", Role::Watchdog, "node-b", None);
    store.put_instance(&wb).await.unwrap();
    assert_eq!(
        store.get_instance(&alice, Role::Watchdog).await.unwrap(),
        Some(wb)
    );
    store.put_instance(&wa).await.unwrap();
    assert_eq!(
        store.get_instance(&alice, Role::Watchdog).await.unwrap(),
        Some(wa)
    );
    store.delete_instance(&alice, Role::Watchdog).await.unwrap();
    assert_eq!(
        store.get_instance(&alice, Role::Watchdog).await.unwrap(),
        None
    );
    assert_eq!(
        store.get_instance(&alice, Role::Main).await.unwrap(),
        Some(main)
    );
}

/// `delete_instance_fenced` deletes a main's record only under the rule of
/// `put_instance`: never one written under a newer epoch or by another node
/// at the same epoch; an absent record is not an error; watchdogs are not
/// its business.
pub async fn delete_of_main_is_fenced(store: Arc<dyn Store>) {
    let alice = user("alice");
    let mut a2 = instance("alice", Role::Main, "node-a", Some(4000));
    a2.epoch = 2;
    store.put_instance(&a2).await.unwrap();
    let watchdog = instance("alice", Role::Watchdog, "node-a", None);
    store.put_instance(&watchdog).await.unwrap();

    assert_fenced(
        store.delete_instance_fenced(&alice, "node-b", 1).await,
        &alice,
        1,
        (2, "node-a"),
    );
    assert_fenced(
        store.delete_instance_fenced(&alice, "node-b", 2).await,
        &alice,
        2,
        (2, "node-a"),
    );
    assert_fenced(
        store.delete_instance_fenced(&alice, "node-a", 1).await,
        &alice,
        1,
        (2, "node-a"),
    );
    assert_eq!(
        store.get_instance(&alice, Role::Main).await.unwrap(),
        Some(a2.clone())
    );

    store
        .delete_instance_fenced(&alice, "node-a", 2)
        .await
        .unwrap();
    assert_eq!(store.get_instance(&alice, Role::Main).await.unwrap(), None);
    // Nothing there: nothing to refuse.
    store
        .delete_instance_fenced(&alice, "node-a", 2)
        .await
        .unwrap();
    assert_eq!(
        store.get_instance(&alice, Role::Watchdog).await.unwrap(),
        Some(watchdog)
    );

    // A newer lease may clear a stale record another node left behind.
    store.put_instance(&a2).await.unwrap();
    store
        .delete_instance_fenced(&alice, "node-b", 3)
        .await
        .unwrap();
    assert_eq!(store.get_instance(&alice, Role::Main).await.unwrap(), None);
}

/// Launch parameters round-trip exactly, a launch replaces the previous
/// ones, and a patch over the limit is refused without changing anything.
pub async fn launch_params_round_trip_and_size_limit(store: Arc<dyn Store>) {
    let alice = user("alice");
    let bob = user("bob@corp.example");
    assert_eq!(store.get_launch_params(&alice).await.unwrap(), None);

    let patch = "[server]\nname = \"ü nicode\"\n'quoted' \\ back\n";
    store
        .put_launch_params(&alice, "projects/site", Some(patch))
        .await
        .unwrap();
    store.put_launch_params(&bob, "", None).await.unwrap();
    assert_eq!(
        store.get_launch_params(&alice).await.unwrap(),
        Some(LaunchParams {
            folder: "projects/site".into(),
            patch: Some(patch.into())
        })
    );
    assert_eq!(
        store.get_launch_params(&bob).await.unwrap(),
        Some(LaunchParams {
            folder: String::new(),
            patch: None
        })
    );

    // The limit counts bytes: exactly MAX_PATCH_BYTES of them is accepted.
    let max = "é".repeat(berth_core::MAX_PATCH_BYTES / 2);
    assert_eq!(max.len(), berth_core::MAX_PATCH_BYTES);
    store
        .put_launch_params(&alice, "a", Some(&max))
        .await
        .unwrap();
    assert_eq!(
        store.get_launch_params(&alice).await.unwrap(),
        Some(LaunchParams {
            folder: "a".into(),
            patch: Some(max.clone())
        })
    );
    let over = format!("{max}x");
    assert!(matches!(
        store.put_launch_params(&alice, "b", Some(&over)).await,
        Err(StoreError::Query(_))
    ));
    assert_eq!(
        store
            .get_launch_params(&alice)
            .await
            .unwrap()
            .unwrap()
            .folder,
        "a"
    );

    // A launch without a patch clears the old one.
    store.put_launch_params(&alice, "c", None).await.unwrap();
    assert_eq!(
        store.get_launch_params(&alice).await.unwrap(),
        Some(LaunchParams {
            folder: "c".into(),
            patch: None
        })
    );
}

/// The first claim of a user's lease yields epoch 1.
pub async fn claim_on_fresh_user_gets_epoch_1(store: Arc<dyn Store>) {
    let alice = user("alice");
    assert_eq!(store.get_lease(&alice).await.unwrap(), None);
    assert_eq!(
        claim(&store, &alice, "node-a", LONG).await,
        ClaimOutcome::Claimed { epoch: 1 }
    );
    let lease = store.get_lease(&alice).await.unwrap().unwrap();
    assert_eq!(lease.user, alice);
    assert_eq!(lease.holder.as_deref(), Some("node-a"));
    assert_eq!(lease.epoch, 1);
    assert!(!lease.released && !lease.expired, "{lease:?}");
    let now = store.now().await.unwrap();
    assert!(lease.lease_until.unwrap() > now, "{lease:?} at {now}");
}

/// While node-a's lease is live, node-b is told who holds it, under either
/// policy, and the lease is untouched.
pub async fn second_node_is_busy_while_lease_is_live(store: Arc<dyn Store>) {
    let alice = user("alice");
    claimed(&store, &alice, "node-a", LONG).await;
    let before = store.get_lease(&alice).await.unwrap();
    for policy in [TakeoverPolicy::Evidence, TakeoverPolicy::Manual] {
        assert_eq!(
            store
                .claim_lease(&alice, "node-b", LONG, policy)
                .await
                .unwrap(),
            ClaimOutcome::Busy {
                holder: "node-a".into(),
                expired: false
            }
        );
    }
    assert_eq!(store.get_lease(&alice).await.unwrap(), before);
}

/// The holder re-claiming its own live lease bumps the epoch; it is never
/// busy against itself.
pub async fn holder_reclaims_own_lease_with_next_epoch(store: Arc<dyn Store>) {
    let alice = user("alice");
    assert_eq!(claimed(&store, &alice, "node-a", LONG).await, 1);
    assert_eq!(claimed(&store, &alice, "node-a", LONG).await, 2);
    assert_eq!(
        store
            .claim_lease(&alice, "node-a", LONG, TakeoverPolicy::Manual)
            .await
            .unwrap(),
        ClaimOutcome::Claimed { epoch: 3 }
    );
}

/// Renew is fenced on (holder, epoch): an old epoch or another node renews
/// nothing, and an empty list is fine.
pub async fn renew_with_stale_epoch_or_wrong_node_renews_nothing(store: Arc<dyn Store>) {
    let alice = user("alice");
    let old = claimed(&store, &alice, "node-a", LONG).await;
    let new = claimed(&store, &alice, "node-a", LONG).await;
    assert!(new > old);
    assert!(
        store
            .renew_leases("node-a", &[(alice.clone(), old)], LONG)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        store
            .renew_leases("node-b", &[(alice.clone(), new)], LONG)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        store
            .renew_leases("node-a", &[(alice.clone(), new)], LONG)
            .await
            .unwrap(),
        vec![alice.clone()]
    );
    assert!(
        store
            .renew_leases("node-a", &[], LONG)
            .await
            .unwrap()
            .is_empty()
    );
    // A user with no lease row at all is simply not renewed.
    assert!(
        store
            .renew_leases("node-a", &[(user("nobody"), 1)], LONG)
            .await
            .unwrap()
            .is_empty()
    );
}

/// A lease that ran out but was not taken keeps its epoch, so renewing it
/// is safe and succeeds; the renew moves `lease_until` by the store clock.
pub async fn renew_of_expired_untaken_lease_succeeds(store: Arc<dyn Store>) {
    let alice = user("alice");
    let epoch = claimed(&store, &alice, "node-a", SHORT).await;
    wait_until_expired(&store, &alice).await;
    assert_eq!(
        store
            .renew_leases("node-a", &[(alice.clone(), epoch)], LONG)
            .await
            .unwrap(),
        vec![alice.clone()]
    );
    let lease = store.get_lease(&alice).await.unwrap().unwrap();
    assert!(!lease.expired, "{lease:?}");
    assert!(lease.lease_until.unwrap() > store.now().await.unwrap());
}

/// A released lease stays released: renew does not bring it back.
pub async fn renew_does_not_revive_released_lease(store: Arc<dyn Store>) {
    let alice = user("alice");
    let epoch = claimed(&store, &alice, "node-a", LONG).await;
    assert!(store.release_lease(&alice, "node-a", epoch).await.unwrap());
    assert!(
        store
            .renew_leases("node-a", &[(alice.clone(), epoch)], LONG)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(store.get_lease(&alice).await.unwrap().unwrap().released);
}

/// One renew call covers thousands of leases, and reports exactly the ones
/// still held among them.
pub async fn renew_thousands_in_one_call(store: Arc<dyn Store>) {
    const N: usize = 2_000;
    let mut held = Vec::with_capacity(N);
    for i in 0..N {
        let u = user(&format!("user-{i:05}"));
        let epoch = claimed(&store, &u, "node-a", LONG).await;
        held.push((u, epoch));
    }
    // Every 100th lease moves on to a new epoch: those are lost.
    let mut expected: Vec<UserId> = Vec::new();
    for (i, (u, _)) in held.iter().enumerate() {
        if i % 100 == 0 {
            claimed(&store, u, "node-a", LONG).await;
        } else {
            expected.push(u.clone());
        }
    }
    let mut renewed = store.renew_leases("node-a", &held, LONG).await.unwrap();
    renewed.sort();
    assert_eq!(renewed.len(), N - N / 100);
    assert_eq!(renewed, expected);
}

/// Release ends the lease now but keeps the holder as a hint; it is fenced
/// on (holder, epoch); afterwards any node may claim.
pub async fn release_keeps_holder_hint_and_frees_lease(store: Arc<dyn Store>) {
    let alice = user("alice");
    let epoch = claimed(&store, &alice, "node-a", LONG).await;
    assert!(!store.release_lease(&alice, "node-b", epoch).await.unwrap());
    assert!(
        !store
            .release_lease(&alice, "node-a", epoch + 1)
            .await
            .unwrap()
    );
    assert!(store.release_lease(&alice, "node-a", epoch).await.unwrap());
    assert!(!store.release_lease(&alice, "node-a", epoch).await.unwrap());

    let lease = store.get_lease(&alice).await.unwrap().unwrap();
    assert_eq!(lease.holder.as_deref(), Some("node-a"));
    assert_eq!(lease.epoch, epoch);
    assert!(lease.released, "{lease:?}");
    assert!(!lease.expired, "released is not expired: {lease:?}");
    assert!(lease.lease_until.unwrap() < store.now().await.unwrap());
    assert!(store.list_leases(true, LONG).await.unwrap().is_empty());
    assert!(store.leases_held_by("node-a").await.unwrap().is_empty());

    // Released means free, even under Manual and with node-a alive.
    store.heartbeat(&node("node-a")).await.unwrap();
    assert_eq!(
        store
            .claim_lease(&alice, "node-b", LONG, TakeoverPolicy::Manual)
            .await
            .unwrap(),
        ClaimOutcome::Claimed { epoch: epoch + 1 }
    );
    let lease = store.get_lease(&alice).await.unwrap().unwrap();
    assert_eq!(lease.holder.as_deref(), Some("node-b"));
    assert!(!lease.released);
}

/// An expired lease whose holder still heartbeats is reported, not taken,
/// under both policies.
pub async fn expired_lease_with_live_holder_is_busy_expired(store: Arc<dyn Store>) {
    let alice = user("alice");
    store.heartbeat(&node("node-a")).await.unwrap();
    let epoch = claimed(&store, &alice, "node-a", SHORT).await;
    wait_until_expired(&store, &alice).await;
    store.heartbeat(&node("node-a")).await.unwrap();
    // The evidence window is the claimer's TTL: node-a beat well within it.
    for policy in [TakeoverPolicy::Evidence, TakeoverPolicy::Manual] {
        assert_eq!(
            store
                .claim_lease(&alice, "node-b", LONG, policy)
                .await
                .unwrap(),
            ClaimOutcome::Busy {
                holder: "node-a".into(),
                expired: true
            },
            "{policy:?}"
        );
    }
    let lease = store.get_lease(&alice).await.unwrap().unwrap();
    assert_eq!(
        (lease.holder.as_deref(), lease.epoch),
        (Some("node-a"), epoch)
    );
    assert!(lease.expired);
}

/// An expired lease whose holder's heartbeat is older than one TTL may be
/// claimed under Evidence, never under Manual.
pub async fn expired_lease_with_stale_holder_needs_evidence_policy(store: Arc<dyn Store>) {
    let alice = user("alice");
    store.heartbeat(&node("node-a")).await.unwrap();
    let epoch = claimed(&store, &alice, "node-a", SHORT).await;
    wait_until_expired(&store, &alice).await;
    wait_until_heartbeat_older(&store, "node-a", SHORT).await;
    store.heartbeat(&node("node-b")).await.unwrap();

    assert_eq!(
        store
            .claim_lease(&alice, "node-b", SHORT, TakeoverPolicy::Manual)
            .await
            .unwrap(),
        ClaimOutcome::Busy {
            holder: "node-a".into(),
            expired: true
        }
    );
    assert_eq!(
        store
            .claim_lease(&alice, "node-b", LONG, TakeoverPolicy::Evidence)
            .await
            .unwrap(),
        // Judged against the claimer's TTL: a LONG claimer sees node-a's
        // heartbeat as recent enough.
        ClaimOutcome::Busy {
            holder: "node-a".into(),
            expired: true
        }
    );
    assert_eq!(
        store
            .claim_lease(&alice, "node-b", SHORT, TakeoverPolicy::Evidence)
            .await
            .unwrap(),
        ClaimOutcome::Claimed { epoch: epoch + 1 }
    );
    // The old holder is fenced: its epoch renews nothing.
    assert!(
        store
            .renew_leases("node-a", &[(alice.clone(), epoch)], LONG)
            .await
            .unwrap()
            .is_empty()
    );
}

/// A holder that never registered a heartbeat counts as gone.
pub async fn expired_lease_of_unregistered_holder_is_claimable_with_evidence(
    store: Arc<dyn Store>,
) {
    let alice = user("alice");
    let epoch = claimed(&store, &alice, "ghost", SHORT).await;
    wait_until_expired(&store, &alice).await;
    assert_eq!(
        store
            .claim_lease(&alice, "node-b", LONG, TakeoverPolicy::Manual)
            .await
            .unwrap(),
        ClaimOutcome::Busy {
            holder: "ghost".into(),
            expired: true
        }
    );
    assert_eq!(
        store
            .claim_lease(&alice, "node-b", LONG, TakeoverPolicy::Evidence)
            .await
            .unwrap(),
        ClaimOutcome::Claimed { epoch: epoch + 1 }
    );
}

/// An operator's takeover is refused on a live lease and succeeds on an
/// expired one even while its holder still heartbeats.
pub async fn take_over_only_works_on_expired_leases(store: Arc<dyn Store>) {
    let alice = user("alice");
    let bob = user("bob");
    store.heartbeat(&node("node-a")).await.unwrap();
    let a_epoch = claimed(&store, &alice, "node-a", LONG).await;
    assert_eq!(
        store.take_over_lease(&alice, "node-b", LONG).await.unwrap(),
        ClaimOutcome::Busy {
            holder: "node-a".into(),
            expired: false
        }
    );
    assert_eq!(
        store.get_lease(&alice).await.unwrap().unwrap().epoch,
        a_epoch
    );

    let b_epoch = claimed(&store, &bob, "node-a", SHORT).await;
    wait_until_expired(&store, &bob).await;
    store.heartbeat(&node("node-a")).await.unwrap();
    assert_eq!(
        store.take_over_lease(&bob, "node-b", LONG).await.unwrap(),
        ClaimOutcome::Claimed { epoch: b_epoch + 1 }
    );
    let lease = store.get_lease(&bob).await.unwrap().unwrap();
    assert_eq!(lease.holder.as_deref(), Some("node-b"));
    assert!(!lease.expired);
    assert!(
        store
            .renew_leases("node-a", &[(bob.clone(), b_epoch)], LONG)
            .await
            .unwrap()
            .is_empty()
    );

    // A released lease may be taken over too.
    let c = user("carol");
    let c_epoch = claimed(&store, &c, "node-a", LONG).await;
    assert!(store.release_lease(&c, "node-a", c_epoch).await.unwrap());
    assert_eq!(
        store.take_over_lease(&c, "node-b", LONG).await.unwrap(),
        ClaimOutcome::Claimed { epoch: c_epoch + 1 }
    );
}

/// `list_leases(true)` is exactly the expired, unreleased, held leases;
/// `leases_held_by` exactly a node's live ones.
pub async fn list_leases_and_leases_held_by(store: Arc<dyn Store>) {
    let [live, released, expired, other] =
        ["a-live", "b-released", "c-expired", "d-other"].map(user);
    claimed(&store, &live, "node-1", LONG).await;
    let e = claimed(&store, &released, "node-1", LONG).await;
    assert!(store.release_lease(&released, "node-1", e).await.unwrap());
    claimed(&store, &expired, "node-1", SHORT).await;
    claimed(&store, &other, "node-2", LONG).await;
    wait_until_expired(&store, &expired).await;

    let users = |v: Vec<crate::LeaseRecord>| {
        let mut u: Vec<UserId> = v.into_iter().map(|r| r.user).collect();
        u.sort();
        u
    };
    assert_eq!(
        users(store.list_leases(false, LONG).await.unwrap()),
        [
            live.clone(),
            released.clone(),
            expired.clone(),
            other.clone()
        ]
    );
    let expired_list = store.list_leases(true, LONG).await.unwrap();
    assert_eq!(expired_list.len(), 1, "{expired_list:?}");
    assert_eq!(expired_list[0].user, expired);
    assert_eq!(expired_list[0].holder.as_deref(), Some("node-1"));
    assert!(expired_list[0].expired);

    assert_eq!(
        users(store.leases_held_by("node-1").await.unwrap()),
        std::slice::from_ref(&live)
    );
    let held2 = store.leases_held_by("node-2").await.unwrap();
    assert_eq!(held2.len(), 1);
    assert_eq!(held2[0].user, other);
    assert_eq!(held2[0].epoch, 1);
    assert!(store.leases_held_by("node-3").await.unwrap().is_empty());
}

/// `list_leases` says whether each holder is alive by the TTL it is given,
/// with the claim's own evidence test: an expired lease whose holder is not
/// alive is exactly one an evidence claim with that TTL takes. The other
/// lease queries are not given a TTL and leave it `None`.
pub async fn list_leases_reports_holder_liveness(store: Arc<dyn Store>) {
    let [alice, bob, carol] = ["alice", "bob", "carol"].map(user);
    store.heartbeat(&node("node-a")).await.unwrap();
    claimed(&store, &alice, "node-a", SHORT).await;
    // ghost never registers a heartbeat.
    claimed(&store, &bob, "ghost", SHORT).await;
    claimed(&store, &carol, "node-a", LONG).await;
    wait_until_expired(&store, &alice).await;
    wait_until_expired(&store, &bob).await;
    store.heartbeat(&node("node-a")).await.unwrap();

    let alive = |v: Vec<crate::LeaseRecord>| {
        let mut v: Vec<(String, Option<bool>)> = v
            .into_iter()
            .map(|r| (r.user.to_string(), r.holder_alive))
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        alive(store.list_leases(true, LONG).await.unwrap()),
        [("alice".into(), Some(true)), ("bob".into(), Some(false))]
    );
    assert_eq!(
        alive(store.list_leases(false, LONG).await.unwrap()),
        [
            ("alice".into(), Some(true)),
            ("bob".into(), Some(false)),
            ("carol".into(), Some(true))
        ]
    );
    assert_eq!(
        store.get_lease(&alice).await.unwrap().unwrap().holder_alive,
        None
    );
    assert!(
        store
            .leases_held_by("node-a")
            .await
            .unwrap()
            .iter()
            .all(|l| l.holder_alive.is_none())
    );

    // Judged by a short TTL, node-a's heartbeat grows too old: the report
    // calls it dead, and an evidence claim by the same TTL agrees.
    wait_until_heartbeat_older(&store, "node-a", SHORT).await;
    assert_eq!(
        alive(store.list_leases(true, SHORT).await.unwrap()),
        [("alice".into(), Some(false)), ("bob".into(), Some(false))]
    );
    assert!(matches!(
        claim(&store, &alice, "node-b", SHORT).await,
        ClaimOutcome::Claimed { .. }
    ));
    // By the long TTL node-a is alive: reported so, and an evidence claim
    // by that TTL is refused.
    store.heartbeat(&node("node-a")).await.unwrap();
    let dave = user("dave");
    claimed(&store, &dave, "node-a", SHORT).await;
    wait_until_expired(&store, &dave).await;
    let report = store.list_leases(true, LONG).await.unwrap();
    let dave_row = report.iter().find(|r| r.user == dave).unwrap();
    assert_eq!(dave_row.holder_alive, Some(true));
    assert_eq!(
        claim(&store, &dave, "node-b", LONG).await,
        ClaimOutcome::Busy {
            holder: "node-a".into(),
            expired: true
        }
    );
}

/// Eight nodes claiming one user at once: exactly one wins, the rest are
/// told it is the winner that holds it.
pub async fn concurrent_claimers_have_one_winner(store: Arc<dyn Store>) {
    let alice = user("alice");
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let store = store.clone();
            let alice = alice.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                let node = format!("node-{i}");
                barrier.wait().await;
                let outcome = store
                    .claim_lease(&alice, &node, LONG, TakeoverPolicy::Evidence)
                    .await
                    .unwrap();
                (node, outcome)
            })
        })
        .collect();
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    let winners: Vec<&String> = results
        .iter()
        .filter(|(_, o)| matches!(o, ClaimOutcome::Claimed { .. }))
        .map(|(n, _)| n)
        .collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    let winner = winners[0].clone();
    for (node, outcome) in &results {
        if *node == winner {
            assert_eq!(*outcome, ClaimOutcome::Claimed { epoch: 1 });
        } else {
            assert_eq!(
                *outcome,
                ClaimOutcome::Busy {
                    holder: winner.clone(),
                    expired: false
                }
            );
        }
    }
    let lease = store.get_lease(&alice).await.unwrap().unwrap();
    assert_eq!((lease.holder, lease.epoch), (Some(winner), 1));
}

/// Crash state survives a round trip; saving a clear state deletes it.
pub async fn crash_state_round_trip_and_clear_deletes(store: Arc<dyn Store>) {
    let alice = user("alice");
    let bob = user("bob");
    assert_eq!(
        store.load_crash_state(&alice).await.unwrap(),
        CrashState::default()
    );
    let state = CrashState {
        streak: 4,
        restarts: vec![1_700_000_000_000, 1_700_000_001_000, 1_700_000_003_000],
        opens: 2,
        opened_at: Some(1_700_000_004_000),
        cooldown_until: Some(1_700_001_204_000),
    };
    store.save_crash_state(&alice, &state).await.unwrap();
    store.save_crash_state(&bob, &state).await.unwrap();
    assert_eq!(store.load_crash_state(&alice).await.unwrap(), state);
    let next = CrashState {
        streak: 5,
        ..state.clone()
    };
    store.save_crash_state(&alice, &next).await.unwrap();
    assert_eq!(store.load_crash_state(&alice).await.unwrap(), next);
    store
        .save_crash_state(&alice, &CrashState::default())
        .await
        .unwrap();
    assert_eq!(
        store.load_crash_state(&alice).await.unwrap(),
        CrashState::default()
    );
    assert_eq!(store.load_crash_state(&bob).await.unwrap(), state);
}

/// Mints `id` (hash `h-<id>`) for `u`; panics unless it was minted.
async fn mint(
    store: &dyn Store,
    u: &UserId,
    id: &str,
    ttl: Duration,
    parent: Option<&str>,
) -> TokenRecord {
    let hash = format!("h-{id}");
    match store
        .mint_token(&NewToken {
            id,
            user: u,
            token_hash: &hash,
            ttl,
            parent,
            max_live: 100,
        })
        .await
        .unwrap()
    {
        MintOutcome::Minted(record) => record,
        other => panic!("minting {id}: {other:?}"),
    }
}

/// Tokens are found by hash while live, record their use, are listed
/// without their secret, and are gone once expired (by the store's clock).
pub async fn tokens_mint_use_list_and_expire(store: Arc<dyn Store>) {
    let alice = user("alice");
    let bob = user("bob@corp.example");
    let before = store.now().await.unwrap();
    let a1 = mint(store.as_ref(), &alice, "a1", LONG, None).await;
    assert_eq!(a1.id, "a1");
    assert_eq!(a1.user, alice);
    assert!(a1.created_at >= before, "{a1:?}");
    assert_eq!(a1.expires_at - a1.created_at, LONG.as_millis() as i64);
    assert_eq!((a1.last_used_at, a1.parent.as_deref()), (None, None));
    mint(store.as_ref(), &alice, "a2", SHORT, None).await;
    mint(store.as_ref(), &bob, "b1", LONG, None).await;

    let owner = store.use_token("h-a1").await.unwrap().expect("a1 is live");
    assert_eq!((owner.user, owner.id.as_str()), (alice.clone(), "a1"));
    assert_eq!(owner.expires_at, a1.expires_at);
    assert!(owner.now >= a1.created_at && owner.now < owner.expires_at);
    assert_eq!(store.use_token("h-b1").await.unwrap().unwrap().user, bob);
    for unknown in ["h-unknown", "", "a1"] {
        assert_eq!(store.use_token(unknown).await.unwrap(), None, "{unknown:?}");
    }
    let listed = store.list_tokens(&alice).await.unwrap();
    assert_eq!(
        listed.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(),
        ["a1", "a2"]
    );
    assert_eq!(
        listed[0].last_used_at,
        Some(owner.now),
        "the use is recorded"
    );

    // a2 runs out: neither found nor listed, and a1 is untouched.
    let deadline = std::time::Instant::now() + PATIENCE;
    while store.use_token("h-a2").await.unwrap().is_some() {
        assert!(std::time::Instant::now() < deadline, "a2 never expired");
        tokio::time::sleep(POLL).await;
    }
    let listed = store.list_tokens(&alice).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].id, "a1");
    assert!(store.list_tokens(&user("nobody")).await.unwrap().is_empty());
}

/// The per-user cap holds when many mints race, counts only live tokens,
/// and is per user.
pub async fn token_cap_holds_under_concurrent_mints(store: Arc<dyn Store>) {
    let alice = user("alice");
    let mints = (0..12).map(|i| {
        let store = store.clone();
        let alice = alice.clone();
        tokio::spawn(async move {
            let id = format!("race-{i}");
            let hash = format!("h-{id}");
            store
                .mint_token(&NewToken {
                    id: &id,
                    user: &alice,
                    token_hash: &hash,
                    ttl: LONG,
                    parent: None,
                    max_live: 3,
                })
                .await
                .unwrap()
        })
    });
    let outcomes: Vec<MintOutcome> = futures_join(mints).await;
    let minted = outcomes
        .iter()
        .filter(|o| matches!(o, MintOutcome::Minted(_)))
        .count();
    assert_eq!(minted, 3, "{outcomes:?}");
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, MintOutcome::Minted(_) | MintOutcome::TooMany { live: 3 })),
        "{outcomes:?}"
    );
    assert_eq!(store.list_tokens(&alice).await.unwrap().len(), 3);
    // Another user has a cap of their own.
    mint(store.as_ref(), &user("bob"), "b1", LONG, None).await;
    // Revoking one makes room for one.
    let first = store.list_tokens(&alice).await.unwrap()[0].id.clone();
    assert_eq!(store.revoke_token(&alice, &first).await.unwrap(), [first]);
    let again = |id: &'static str| {
        let store = store.clone();
        let alice = alice.clone();
        async move {
            store
                .mint_token(&NewToken {
                    id,
                    user: &alice,
                    token_hash: id,
                    ttl: SHORT,
                    parent: None,
                    max_live: 3,
                })
                .await
                .unwrap()
        }
    };
    assert!(matches!(again("short").await, MintOutcome::Minted(_)));
    assert_eq!(again("one-more").await, MintOutcome::TooMany { live: 3 });
    // Expired tokens do not count.
    let deadline = std::time::Instant::now() + PATIENCE;
    while store.use_token("short").await.unwrap().is_some() {
        assert!(std::time::Instant::now() < deadline, "never expired");
        tokio::time::sleep(POLL).await;
    }
    assert!(matches!(
        again("after-expiry").await,
        MintOutcome::Minted(_)
    ));
}

async fn futures_join<T: Send + 'static>(
    tasks: impl Iterator<Item = tokio::task::JoinHandle<T>>,
) -> Vec<T> {
    let mut out = Vec::new();
    for task in tasks.collect::<Vec<_>>() {
        out.push(task.await.unwrap());
    }
    out
}

/// A token minted with another expires no later than it, and only a live
/// token of the same user can be a parent.
pub async fn child_tokens_never_outlive_their_parent(store: Arc<dyn Store>) {
    let alice = user("alice");
    let parent = mint(
        store.as_ref(),
        &alice,
        "parent",
        Duration::from_secs(60),
        None,
    )
    .await;
    let child = mint(store.as_ref(), &alice, "child", LONG, Some("parent")).await;
    assert_eq!(child.parent.as_deref(), Some("parent"));
    assert_eq!(child.expires_at, parent.expires_at, "bounded by the parent");
    let short = mint(store.as_ref(), &alice, "short", SHORT, Some("parent")).await;
    assert!(
        short.expires_at < parent.expires_at,
        "a shorter life is kept"
    );
    let grandchild = mint(store.as_ref(), &alice, "grandchild", LONG, Some("child")).await;
    assert!(grandchild.expires_at <= child.expires_at);

    let refused = |id: &'static str, who: UserId, parent: &'static str| {
        let store = store.clone();
        async move {
            store
                .mint_token(&NewToken {
                    id,
                    user: &who,
                    token_hash: id,
                    ttl: LONG,
                    parent: Some(parent),
                    max_live: 100,
                })
                .await
                .unwrap()
        }
    };
    assert_eq!(
        refused("x1", alice.clone(), "nope").await,
        MintOutcome::ParentGone
    );
    assert_eq!(
        refused("x2", user("bob"), "parent").await,
        MintOutcome::ParentGone
    );
    let deadline = std::time::Instant::now() + PATIENCE;
    while store.use_token("h-short").await.unwrap().is_some() {
        assert!(std::time::Instant::now() < deadline, "never expired");
        tokio::time::sleep(POLL).await;
    }
    assert_eq!(
        refused("x3", alice.clone(), "short").await,
        MintOutcome::ParentGone
    );
    for id in ["x1", "x2", "x3"] {
        assert_eq!(
            store.use_token(id).await.unwrap(),
            None,
            "{id} was not minted"
        );
    }
}

/// Revoking a token deletes it and everything minted with it, at any
/// depth, and nothing else; another user cannot revoke it.
pub async fn revocation_takes_every_descendant_and_only_them(store: Arc<dyn Store>) {
    let alice = user("alice");
    mint(store.as_ref(), &alice, "root", LONG, None).await;
    mint(store.as_ref(), &alice, "kid", LONG, Some("root")).await;
    mint(store.as_ref(), &alice, "grandkid", LONG, Some("kid")).await;
    mint(store.as_ref(), &alice, "sibling", LONG, None).await;
    mint(store.as_ref(), &user("bob"), "bobs", LONG, None).await;

    assert!(
        store
            .revoke_token(&user("bob"), "root")
            .await
            .unwrap()
            .is_empty()
    );
    assert!(store.revoke_token(&alice, "nope").await.unwrap().is_empty());
    assert!(store.use_token("h-root").await.unwrap().is_some());

    let mut revoked = store.revoke_token(&alice, "kid").await.unwrap();
    revoked.sort();
    assert_eq!(revoked, ["grandkid", "kid"]);
    for (hash, live) in [
        ("h-root", true),
        ("h-kid", false),
        ("h-grandkid", false),
        ("h-sibling", true),
        ("h-bobs", true),
    ] {
        assert_eq!(
            store.use_token(hash).await.unwrap().is_some(),
            live,
            "{hash}"
        );
    }
    let left: Vec<String> = store
        .list_tokens(&alice)
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.id)
        .collect();
    assert_eq!(left, ["root", "sibling"]);
    assert!(
        store.revoke_token(&alice, "kid").await.unwrap().is_empty(),
        "already gone"
    );
}

/// Sessions are found by hash, with their owner, until they expire or are
/// ended.
pub async fn sessions_live_until_they_expire_or_end(store: Arc<dyn Store>) {
    let admin = SessionOwner {
        user: None,
        admin: true,
        token_id: None,
    };
    let alice = SessionOwner {
        user: Some(user("alice")),
        admin: false,
        token_id: Some("root-1".into()),
    };
    let before = store.now().await.unwrap();
    let long = store.create_session("s-long", &admin, LONG).await.unwrap();
    assert!(long >= before + LONG.as_millis() as i64, "{long}");
    store
        .create_session("s-short", &admin, SHORT)
        .await
        .unwrap();
    let signed_in = store.create_session("s-alice", &alice, LONG).await.unwrap();
    let found = |expires_at, owner: &SessionOwner| SessionRecord {
        owner: owner.clone(),
        expires_at,
    };
    assert_eq!(
        store.session("s-long").await.unwrap(),
        Some(found(long, &admin))
    );
    assert_eq!(
        store.session("s-alice").await.unwrap(),
        Some(found(signed_in, &alice))
    );
    assert_eq!(store.session("nope").await.unwrap(), None);
    let deadline = std::time::Instant::now() + PATIENCE;
    while store.session("s-short").await.unwrap().is_some() {
        assert!(std::time::Instant::now() < deadline, "never expired");
        tokio::time::sleep(POLL).await;
    }
    assert!(store.delete_session("s-long").await.unwrap());
    assert!(!store.delete_session("s-long").await.unwrap());
    assert_eq!(store.session("s-long").await.unwrap(), None);
}

/// A sign-in's state and a hop's code are each good once, and only while
/// they live.
pub async fn login_attempts_and_hops_are_taken_once(store: Arc<dyn Store>) {
    let attempt = LoginAttempt {
        pkce_verifier: "verifier".into(),
        nonce: "nonce".into(),
        return_to: "/u/alice/".into(),
    };
    store
        .create_login_attempt("state-1", &attempt, LONG)
        .await
        .unwrap();
    store
        .create_login_attempt("state-short", &attempt, SHORT)
        .await
        .unwrap();
    assert_eq!(
        store.take_login_attempt("state-1").await.unwrap(),
        Some(attempt.clone())
    );
    assert_eq!(store.take_login_attempt("state-1").await.unwrap(), None);
    assert_eq!(store.take_login_attempt("unknown").await.unwrap(), None);
    let alice = user("alice");
    store
        .create_login_hop("code-1", &alice, "root-1", LONG)
        .await
        .unwrap();
    store
        .create_login_hop("code-short", &alice, "root-1", SHORT)
        .await
        .unwrap();
    // Both short ones were made by now.
    let made = store.now().await.unwrap();
    assert_eq!(
        store.take_login_hop("code-1").await.unwrap(),
        Some((alice.clone(), "root-1".to_owned()))
    );
    assert_eq!(store.take_login_hop("code-1").await.unwrap(), None);
    // Past their life, neither is found (and the next create sweeps them).
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        let now = store.now().await.unwrap();
        if now > made + SHORT.as_millis() as i64 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the clock never moved"
        );
        tokio::time::sleep(POLL).await;
    }
    assert_eq!(store.take_login_attempt("state-short").await.unwrap(), None);
    assert_eq!(store.take_login_hop("code-short").await.unwrap(), None);
}

fn slug(s: &str) -> Slug {
    Slug::parse(s).unwrap()
}

/// The first record of a user's slug sticks: a store seeded with a slug
/// (here the 8-hex-digit slug of an earlier berth) keeps it when asked to
/// record another, so no data root moves.
pub async fn user_slug_is_recorded_once_and_kept(store: Arc<dyn Store>) {
    let odd = user("alice*{@(.:$*corp");
    let plain = user("bob");
    assert_eq!(store.user_slug(&odd).await.unwrap(), None);
    let legacy = odd.legacy_slug();
    assert_eq!(legacy.as_str(), "alice-corp---eb9ba467");
    assert_eq!(store.record_user_slug(&odd, &legacy).await.unwrap(), legacy);
    // Asked again with today's rule: the recorded slug wins.
    assert_ne!(odd.slug(), legacy);
    assert_eq!(
        store.record_user_slug(&odd, &odd.slug()).await.unwrap(),
        legacy
    );
    assert_eq!(store.user_slug(&odd).await.unwrap(), Some(legacy.clone()));
    assert_eq!(
        store.record_user_slug(&plain, &plain.slug()).await.unwrap(),
        slug("bob")
    );
    assert_eq!(store.user_slug(&plain).await.unwrap(), Some(slug("bob")));
    assert_eq!(store.user_slug(&user("carol")).await.unwrap(), None);
}

/// One read gives the recorded slug of every user with an instance record
/// on a node (a main, a watchdog or both: once), and no other user's.
pub async fn user_slugs_on_a_node_are_read_at_once(store: Arc<dyn Store>) {
    let odd = user("alice*{@(.:$*corp");
    let legacy = odd.legacy_slug();
    store.record_user_slug(&odd, &legacy).await.unwrap();
    for (u, node) in [("bob", "node-a"), ("carol", "node-b"), ("dave", "node-b")] {
        store.record_user_slug(&user(u), &slug(u)).await.unwrap();
        store
            .put_instance(&instance(u, Role::Main, node, None))
            .await
            .unwrap();
    }
    for role in [Role::Main, Role::Watchdog] {
        let mut i = instance("x", role, "node-a", None);
        i.user = odd.clone();
        store.put_instance(&i).await.unwrap();
    }
    // erin has a slug but no record.
    store
        .record_user_slug(&user("erin"), &slug("erin"))
        .await
        .unwrap();
    let mut on_a = store.user_slugs_on("node-a").await.unwrap();
    on_a.sort();
    assert_eq!(on_a, [(odd, legacy), (user("bob"), slug("bob"))]);
    let mut on_b = store.user_slugs_on("node-b").await.unwrap();
    on_b.sort();
    assert_eq!(
        on_b,
        [(user("carol"), slug("carol")), (user("dave"), slug("dave"))]
    );
    assert_eq!(store.user_slugs_on("node-c").await.unwrap(), []);
}

/// Two ids never share a slug: recording one user's slug for another is
/// refused with a typed error, and changes nothing.
pub async fn a_slug_recorded_for_one_user_is_refused_for_another(store: Arc<dyn Store>) {
    let first = user("alice*{@(.:$*corp");
    let second = user("alice<;|<@(:{corp");
    let shared = first.legacy_slug();
    assert_eq!(
        second.legacy_slug(),
        shared,
        "the old slug rule's collision"
    );
    store.record_user_slug(&first, &shared).await.unwrap();
    let err = store.record_user_slug(&second, &shared).await.unwrap_err();
    match &err {
        StoreError::SlugTaken { user, slug } => {
            assert_eq!((user, slug.as_str()), (&second, shared.as_str()));
        }
        other => panic!("expected SlugTaken, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("alice-corp---eb9ba467") && msg.contains("already recorded for another user"),
        "{msg}"
    );
    assert_eq!(
        store.user_slug(&second).await.unwrap(),
        None,
        "nothing recorded"
    );
    assert_eq!(store.user_slug(&first).await.unwrap(), Some(shared));
    // The second user's own slug is free.
    assert_eq!(
        store
            .record_user_slug(&second, &second.slug())
            .await
            .unwrap(),
        second.slug()
    );
}

/// Eight nodes recording one new user at once, each with a different
/// candidate, then another with the same one: all are told the same slug.
/// Eight users racing for one slug: exactly one gets it, the others are
/// refused.
pub async fn concurrent_first_records_agree_on_one_slug(store: Arc<dyn Store>) {
    // The window in which the same row inserted twice trips the slug's
    // constraint is narrow: many users raise the odds of hitting it.
    for n in 0..64 {
        let bob = user(&format!("bob-{n}"));
        let answers = race(&store, |store, _| {
            let bob = bob.clone();
            async move { store.record_user_slug(&bob, &bob.slug()).await }
        })
        .await;
        for answer in answers {
            assert_eq!(answer.unwrap(), bob.slug(), "{bob}");
        }
    }

    let alice = user("alice");
    let answers = race(&store, |store, i| {
        let alice = alice.clone();
        async move {
            let candidate = slug(&format!("candidate-{i}"));
            store.record_user_slug(&alice, &candidate).await.unwrap()
        }
    })
    .await;
    let recorded = store.user_slug(&alice).await.unwrap().unwrap();
    assert!(answers.iter().all(|a| *a == recorded), "{answers:?}");

    let racer = |i: usize| user(&format!("racer-{i}"));
    let answers = race(&store, |store, i| async move {
        store.record_user_slug(&racer(i), &slug("contested")).await
    })
    .await;
    let mut winners = Vec::new();
    for (i, answer) in answers.into_iter().enumerate() {
        match answer {
            Ok(s) => {
                assert_eq!(s, slug("contested"));
                winners.push(racer(i));
            }
            Err(StoreError::SlugTaken { .. }) => {}
            Err(e) => panic!("{}: {e}", racer(i)),
        }
    }
    assert_eq!(winners.len(), 1, "{winners:?}");
    for i in 0..RACERS {
        let expected = (racer(i) == winners[0]).then(|| slug("contested"));
        assert_eq!(store.user_slug(&racer(i)).await.unwrap(), expected);
    }
}

/// How many nodes [`race`] stands for.
const RACERS: usize = 8;

/// Runs `call(store, i)` for i in `0..RACERS` at once, as many nodes
/// would, all released together; the answers in order of `i`.
async fn race<T, F, Fut>(store: &Arc<dyn Store>, call: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Arc<dyn Store>, usize) -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
    let tasks: Vec<_> = (0..RACERS)
        .map(|i| {
            let (barrier, call) = (barrier.clone(), call(store.clone(), i));
            tokio::spawn(async move {
                barrier.wait().await;
                call.await
            })
        })
        .collect();
    let mut answers = Vec::with_capacity(RACERS);
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    answers
}

/// heartbeat inserts, then updates, a node's row and stamps it with the
/// store's clock; list_nodes returns every node.
pub async fn nodes_heartbeat_upsert_and_list(store: Arc<dyn Store>) {
    assert!(store.list_nodes().await.unwrap().is_empty());
    let before = store.now().await.unwrap();
    let mut n1 = node("node-1");
    n1.capacity = 50;
    n1.load = 3;
    n1.heartbeat = 42; // ignored: the store stamps its own clock
    store.heartbeat(&n1).await.unwrap();
    let nodes = store.list_nodes().await.unwrap();
    assert_eq!(nodes.len(), 1);
    let first = nodes[0].clone();
    assert_eq!(
        (
            first.id.as_str(),
            first.advertise_url.as_str(),
            first.capacity,
            first.load,
            first.status
        ),
        (
            "node-1",
            "http://node-1.internal:8080",
            50,
            3,
            NodeStatus::Up
        )
    );
    assert!(first.heartbeat >= before, "{first:?} vs {before}");
    assert!(first.heartbeat <= store.now().await.unwrap());

    n1.load = 7;
    n1.status = NodeStatus::Draining;
    n1.advertise_url = "http://10.0.0.1:9000".into();
    n1.internal_url = "http://10.0.0.1:9001".into();
    store.heartbeat(&n1).await.unwrap();
    let mut n2 = node("node-2");
    n2.status = NodeStatus::Down;
    store.heartbeat(&n2).await.unwrap();

    let mut nodes = store.list_nodes().await.unwrap();
    nodes.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(nodes.len(), 2, "{nodes:?}");
    assert_eq!(nodes[0].load, 7);
    assert_eq!(nodes[0].status, NodeStatus::Draining);
    assert_eq!(nodes[0].advertise_url, "http://10.0.0.1:9000");
    assert_eq!(nodes[0].internal_url, "http://10.0.0.1:9001");
    assert_eq!(first.internal_url, "http://node-1.internal:8081");
    assert!(nodes[0].heartbeat >= first.heartbeat);
    assert_eq!(nodes[1].id, "node-2");
    assert_eq!(nodes[1].status, NodeStatus::Down);
}

/// Reserves a place for `u` on `pick` (if any); the loads the choice saw,
/// by node.
async fn reserve(
    store: &Arc<dyn Store>,
    u: &UserId,
    hold: Duration,
    pick: Option<&str>,
) -> (Option<String>, Vec<(String, u32)>) {
    let pick = pick.map(str::to_owned);
    let placed = store
        .reserve_place(u, hold, &move |_: &[NodeView]| pick.clone())
        .await
        .unwrap();
    let loads = placed
        .nodes
        .iter()
        .map(|n| (n.id.clone(), n.load))
        .collect();
    (placed.node, loads)
}

fn loads(pairs: &[(&str, u32)]) -> Vec<(String, u32)> {
    pairs.iter().map(|(n, l)| ((*n).to_owned(), *l)).collect()
}

/// A placement sees each node's live load, not its heartbeat's: the
/// leases it holds and has not released (expired ones too), plus the
/// places reserved for it, each user counted once; a claim turns a
/// reservation into its lease, a new choice moves it, and one past its
/// hold counts for nothing. A choice of no node records nothing.
pub async fn placement_counts_live_leases_and_reservations(store: Arc<dyn Store>) {
    let mut a = node("node-a");
    a.load = 7; // the heartbeat's number: not what placement counts
    store.heartbeat(&a).await.unwrap();
    store.heartbeat(&node("node-b")).await.unwrap();
    let (held, released, expired) = (user("held"), user("released"), user("expired"));
    claimed(&store, &held, "node-a", LONG).await;
    let epoch = claimed(&store, &released, "node-a", LONG).await;
    assert!(
        store
            .release_lease(&released, "node-a", epoch)
            .await
            .unwrap()
    );
    claimed(&store, &expired, "node-a", SHORT).await;
    wait_until_expired(&store, &expired).await;

    // The views carry the heartbeat's status, capacity and age.
    let seen = store
        .reserve_place(&user("nobody"), LONG, &|nodes: &[NodeView]| {
            assert_eq!(nodes.len(), 2, "{nodes:?}");
            assert!(
                nodes
                    .iter()
                    .all(|n| n.capacity == 10 && n.status == NodeState::Up)
            );
            assert!(nodes.iter().all(|n| n.is_alive(60_000)), "{nodes:?}");
            None
        })
        .await
        .unwrap();
    assert_eq!(seen.node, None);
    assert_eq!(
        seen.nodes
            .iter()
            .map(|n| (n.id.clone(), n.load))
            .collect::<Vec<_>>(),
        loads(&[("node-a", 2), ("node-b", 0)]),
        "held and expired leases count, a released one does not, nor the heartbeat's load"
    );

    let alice = user("alice");
    let (chosen, before) = reserve(&store, &alice, LONG, Some("node-b")).await;
    assert_eq!(chosen.as_deref(), Some("node-b"));
    assert_eq!(before, loads(&[("node-a", 2), ("node-b", 0)]));
    let (_, seen) = reserve(&store, &user("bob"), LONG, Some("node-b")).await;
    assert_eq!(
        seen,
        loads(&[("node-a", 2), ("node-b", 1)]),
        "alice's place counts"
    );
    // Alice placed again (her node refused): her place moves, not doubles.
    let (_, seen) = reserve(&store, &alice, LONG, Some("node-a")).await;
    assert_eq!(seen, loads(&[("node-a", 2), ("node-b", 2)]));
    let (_, seen) = reserve(&store, &user("carol"), LONG, None).await;
    assert_eq!(
        seen,
        loads(&[("node-a", 3), ("node-b", 1)]),
        "moved to node-a"
    );
    // Her claim on node-a turns the reservation into the lease: one count.
    claimed(&store, &alice, "node-a", LONG).await;
    let (_, seen) = reserve(&store, &user("carol"), LONG, None).await;
    assert_eq!(seen, loads(&[("node-a", 3), ("node-b", 1)]));
    // A released lease reserved again counts until its claim.
    let (_, seen) = reserve(&store, &released, LONG, Some("node-b")).await;
    assert_eq!(seen, loads(&[("node-a", 3), ("node-b", 1)]));
    let (_, seen) = reserve(&store, &user("carol"), LONG, None).await;
    assert_eq!(seen, loads(&[("node-a", 3), ("node-b", 2)]));

    // A place past its hold counts for nothing.
    let dave = user("dave");
    reserve(&store, &dave, SHORT, Some("node-b")).await;
    let (_, seen) = reserve(&store, &user("carol"), LONG, None).await;
    assert_eq!(seen, loads(&[("node-a", 3), ("node-b", 3)]));
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let (_, seen) = reserve(&store, &user("carol"), LONG, None).await;
        if seen == loads(&[("node-a", 3), ("node-b", 2)]) {
            break;
        }
        assert_eq!(seen, loads(&[("node-a", 3), ("node-b", 3)]));
        assert!(
            tokio::time::Instant::now() < deadline,
            "dave's place outlived its hold"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Placements take turns across nodes: 60 at once, each choosing the
/// least loaded node, end 20 to a node, as if made one after another.
/// Counted from the same loads at once, they would pile onto one node.
pub async fn concurrent_placements_take_turns(store: Arc<dyn Store>) {
    const USERS: usize = 60;
    for id in ["node-a", "node-b", "node-c"] {
        let mut n = node(id);
        n.capacity = 1_000;
        store.heartbeat(&n).await.unwrap();
    }
    let placements = (0..USERS).map(|i| {
        let store = store.clone();
        tokio::spawn(async move {
            let u = user(&format!("user-{i:02}"));
            let least_loaded = |nodes: &[NodeView]| {
                nodes
                    .iter()
                    .min_by_key(|n| (n.load, n.id.clone()))
                    .map(|n| n.id.clone())
            };
            store
                .reserve_place(&u, LONG, &least_loaded)
                .await
                .unwrap()
                .node
        })
    });
    let mut chosen = std::collections::BTreeMap::<String, usize>::new();
    for placed in futures_join(placements).await {
        *chosen.entry(placed.unwrap()).or_default() += 1;
    }
    let want: std::collections::BTreeMap<String, usize> = ["node-a", "node-b", "node-c"]
        .iter()
        .map(|n| ((*n).to_owned(), USERS / 3))
        .collect();
    assert_eq!(chosen, want);
}

/// record_activity raises mains' last_active, never lowers it, leaves
/// watchdogs alone, and takes the latest time when a user appears twice.
pub async fn record_activity_never_lowers_last_active(store: Arc<dyn Store>) {
    let mut a = instance("alice", Role::Main, "n", Some(1));
    a.last_active = 1_000;
    let mut aw = instance("alice", Role::Watchdog, "n", Some(2));
    aw.last_active = 1_000;
    let mut b = instance("bob", Role::Main, "n", Some(3));
    b.last_active = 5_000;
    for i in [&a, &aw, &b] {
        store.put_instance(i).await.unwrap();
    }
    store.record_activity(&[]).await.unwrap();
    store
        .record_activity(&[
            (user("alice"), 3_000),
            (user("bob"), 2_000),
            (user("alice"), 4_000),
            (user("alice"), 2_500),
            (user("nobody"), 9_000),
        ])
        .await
        .unwrap();
    let last_active = |u: &'static str, role: Role| {
        let store = store.clone();
        async move {
            store
                .get_instance(&user(u), role)
                .await
                .unwrap()
                .unwrap()
                .last_active
        }
    };
    assert_eq!(last_active("alice", Role::Main).await, 4_000);
    assert_eq!(last_active("alice", Role::Watchdog).await, 1_000);
    assert_eq!(last_active("bob", Role::Main).await, 5_000);
    assert_eq!(
        store
            .get_instance(&user("nobody"), Role::Main)
            .await
            .unwrap(),
        None
    );

    store
        .record_activity(&[(user("alice"), 3_999 as UnixMillis)])
        .await
        .unwrap();
    assert_eq!(last_active("alice", Role::Main).await, 4_000);
}

const UIDS: UidRange = UidRange {
    first: 200_000,
    count: 100,
};

/// The first account gets the range's first uid, the next one the next;
/// asking again returns the same uid, also under another range (a user's
/// files must keep their owner), and `list_accounts` shows them all.
pub async fn accounts_get_stable_unique_uids(store: Arc<dyn Store>) {
    assert_eq!(store.account_uid("alice", UIDS).await.unwrap(), 200_000);
    assert_eq!(store.account_uid("bob", UIDS).await.unwrap(), 200_001);
    assert_eq!(store.account_uid("alice", UIDS).await.unwrap(), 200_000);
    let moved = UidRange {
        first: 500_000,
        count: 10,
    };
    assert_eq!(store.account_uid("alice", moved).await.unwrap(), 200_000);
    assert_eq!(store.account_uid("carol", moved).await.unwrap(), 500_000);
    // Back in the old range, numbering continues after its highest uid.
    assert_eq!(store.account_uid("dave", UIDS).await.unwrap(), 200_002);
    assert_eq!(
        store.list_accounts().await.unwrap(),
        vec![
            ("alice".to_owned(), 200_000),
            ("bob".to_owned(), 200_001),
            ("dave".to_owned(), 200_002),
            ("carol".to_owned(), 500_000),
        ]
    );
}

/// A range with no uid left is a typed error naming the range, and records
/// nothing; an empty or overflowing range is refused before any SQL.
pub async fn accounts_refuse_a_full_range_and_change_nothing(store: Arc<dyn Store>) {
    let two = UidRange {
        first: 300_000,
        count: 2,
    };
    store.account_uid("a", two).await.unwrap();
    store.account_uid("b", two).await.unwrap();
    let err = store.account_uid("c", two).await.unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::UidsExhausted {
                first: 300_000,
                last: 300_001
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("300000-300001"), "{err}");
    assert_eq!(store.list_accounts().await.unwrap().len(), 2);
    // Existing accounts are still served from a full range.
    assert_eq!(store.account_uid("b", two).await.unwrap(), 300_001);
    for bad in [
        UidRange {
            first: 1000,
            count: 0,
        },
        UidRange {
            first: u32::MAX - 1,
            count: 2,
        },
    ] {
        let err = store.account_uid("d", bad).await.unwrap_err();
        assert!(err.to_string().contains("empty"), "{err}");
    }
    assert_eq!(store.list_accounts().await.unwrap().len(), 2);
}

/// Many allocations at once (as many nodes would make them): distinct
/// slugs get distinct, consecutive uids, and one slug asked for by many
/// callers gets one uid.
pub async fn concurrent_account_allocations_never_share_a_uid(store: Arc<dyn Store>) {
    let mut tasks = Vec::new();
    for i in 0..24 {
        let store = store.clone();
        // Every slug asked for twice at once.
        let slug = format!("user-{}", i / 2);
        tasks.push(tokio::spawn(async move {
            let uid = store.account_uid(&slug, UIDS).await.unwrap();
            (slug, uid)
        }));
    }
    let mut got = std::collections::BTreeMap::new();
    for task in tasks {
        let (slug, uid) = task.await.unwrap();
        let first = *got.entry(slug.clone()).or_insert(uid);
        assert_eq!(first, uid, "{slug} got two uids");
    }
    let mut uids: Vec<u32> = got.values().copied().collect();
    uids.sort_unstable();
    let expected: Vec<u32> = (200_000..200_012).collect();
    assert_eq!(uids, expected);
    assert_eq!(store.list_accounts().await.unwrap().len(), 12);
}

/// A node id is claimed by one process at a time: a fresh or `down` row,
/// one whose heartbeat is older than the TTL, or one last claimed from the
/// same data dir (whose lock the claimer holds) may be taken; a live row
/// claimed from another data dir may not. Heartbeats keep the identity.
pub async fn node_claims_need_a_stale_row_or_the_same_data_dir(store: Arc<dyn Store>) {
    let claim = |data_dir: &'static str, ttl: Duration| {
        let store = store.clone();
        async move { store.claim_node("node-1", data_dir, ttl).await.unwrap() }
    };
    let before = store.now().await.unwrap();
    assert_eq!(claim("dir-a", LONG).await, NodeClaim::Claimed, "a new id");
    let rows = store.list_nodes().await.unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].status, NodeStatus::Up);
    assert!(
        rows[0].heartbeat >= before,
        "the claim stamps the heartbeat"
    );
    // The node heartbeats as usual; its identity stays.
    store.heartbeat(&node("node-1")).await.unwrap();

    // Another data dir meets the live row, and changes nothing.
    let NodeClaim::Live(row) = claim("dir-b", LONG).await else {
        panic!("a live row claimed from another data dir");
    };
    assert_eq!(row.id, "node-1");
    assert_eq!(row.advertise_url, "http://node-1.internal:8080");
    // The same data dir: its lock proves the last claimer gone.
    assert_eq!(claim("dir-a", LONG).await, NodeClaim::Claimed);
    assert!(matches!(claim("dir-b", LONG).await, NodeClaim::Live(_)));

    // A node that said `down` may be replaced at once, from anywhere, and
    // the row is `up` again.
    let mut down = node("node-1");
    down.status = NodeStatus::Down;
    store.heartbeat(&down).await.unwrap();
    assert_eq!(claim("dir-b", LONG).await, NodeClaim::Claimed);
    assert_eq!(store.list_nodes().await.unwrap()[0].status, NodeStatus::Up);
    // …and now dir-b's identity is the one recorded.
    assert!(matches!(claim("dir-a", LONG).await, NodeClaim::Live(_)));

    // A heartbeat older than the TTL is no longer live.
    wait_until_heartbeat_older(&store, "node-1", SHORT).await;
    assert_eq!(claim("dir-a", SHORT).await, NodeClaim::Claimed);
    assert!(matches!(claim("dir-b", LONG).await, NodeClaim::Live(_)));
}

/// A user's own egress policy is read back as set, replaced by the next,
/// and gone once cleared; the per-account listing joins it to the
/// account of the user's recorded slug and leaves out a user without
/// one.
pub async fn user_egress_is_set_replaced_and_given_back_per_account(store: Arc<dyn Store>) {
    use berth_core::egress::{EgressMode, EgressPolicy};
    let (alice, bob) = (user("alice"), user("bob"));
    assert_eq!(store.user_egress(&alice).await.unwrap(), None);
    let confined = EgressPolicy {
        mode: EgressMode::Allowlist,
        allow: vec![
            "pypi.org".parse().unwrap(),
            "10.8.0.0/24:5432".parse().unwrap(),
        ],
    };
    store
        .set_user_egress(&alice, Some(&confined))
        .await
        .unwrap();
    assert_eq!(
        store.user_egress(&alice).await.unwrap(),
        Some(confined.clone())
    );
    assert_eq!(
        store.account_egress().await.unwrap(),
        vec![],
        "no account yet"
    );
    store
        .record_user_slug(&alice, &slug("alice"))
        .await
        .unwrap();
    let uid = store.account_uid("alice", UIDS).await.unwrap();
    store.record_user_slug(&bob, &slug("bob")).await.unwrap();
    store.account_uid("bob", UIDS).await.unwrap();
    assert_eq!(
        store.account_egress().await.unwrap(),
        vec![(uid, "alice".to_owned(), confined)]
    );
    let closed = EgressPolicy {
        mode: EgressMode::DenyAll,
        allow: vec![],
    };
    store.set_user_egress(&alice, Some(&closed)).await.unwrap();
    assert_eq!(store.user_egress(&alice).await.unwrap(), Some(closed));
    store.set_user_egress(&alice, None).await.unwrap();
    assert_eq!(store.user_egress(&alice).await.unwrap(), None);
    assert_eq!(store.account_egress().await.unwrap(), vec![]);
    assert_eq!(store.user_egress(&bob).await.unwrap(), None);
}
