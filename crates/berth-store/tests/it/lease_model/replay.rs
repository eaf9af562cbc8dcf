//! The store's side of the protocol, against the real stores: random
//! sequences of claims, operator takeovers, renews, releases and reads,
//! each answer compared with the twin's (`table.rs`) on the same sequence.
//!
//! The lease is an hour long, so nothing expires while a sequence runs
//! and the store's clock need not be simulated: expiry and the evidence
//! rule are the model's to search.

use std::sync::Arc;
use std::time::Duration;

use berth_core::{Epoch, UserId};
use berth_store::{SqliteStore, Store, TakeoverPolicy};
use berth_testkit::PgCluster;
use proptest::prelude::*;

use super::table::Table;

const NODES: [&str; 3] = ["node-0", "node-1", "node-2"];
const TTL: Duration = Duration::from_secs(3600);
/// The twin's clock: any instant will do, since nothing expires.
const NOW: i64 = 1_000_000;

#[derive(Debug, Clone)]
enum Call {
    Claim {
        node: usize,
        user: usize,
        evidence: bool,
    },
    TakeOver {
        node: usize,
        user: usize,
    },
    Renew {
        node: usize,
        asked: Vec<(usize, Epoch)>,
    },
    Release {
        node: usize,
        user: usize,
        epoch: Epoch,
    },
}

fn call() -> impl Strategy<Value = Call> {
    let node = 0..NODES.len();
    let user = 0..3usize;
    let epoch = 0..5i64;
    prop_oneof![
        (node.clone(), user.clone(), any::<bool>()).prop_map(|(node, user, evidence)| {
            Call::Claim {
                node,
                user,
                evidence,
            }
        }),
        (node.clone(), user.clone()).prop_map(|(node, user)| Call::TakeOver { node, user }),
        (
            node.clone(),
            prop::collection::vec((user.clone(), epoch.clone()), 0..4)
        )
            .prop_map(|(node, asked)| Call::Renew { node, asked }),
        (node, user, epoch).prop_map(|(node, user, epoch)| Call::Release { node, user, epoch }),
    ]
}

fn user(index: usize) -> UserId {
    UserId::parse(&format!("user-{index}")).unwrap()
}

/// Runs `calls` on `store` and on the twin; the first answer that differs.
async fn differ(store: &dyn Store, calls: &[Call]) -> Result<(), String> {
    let mut twin = Table::default();
    let ttl = i64::try_from(TTL.as_millis()).unwrap();
    for (i, call) in calls.iter().enumerate() {
        let (real, expected) = match call {
            Call::Claim {
                node,
                user: u,
                evidence,
            } => {
                let policy = if *evidence {
                    TakeoverPolicy::Evidence
                } else {
                    TakeoverPolicy::Manual
                };
                let real = store
                    .claim_lease(&user(*u), NODES[*node], TTL, policy)
                    .await;
                let expected = twin.claim(&user(*u), NODES[*node], ttl, *evidence, NOW);
                (
                    format!("{:?}", real.map_err(|e| e.to_string())),
                    format!("{:?}", Ok::<_, String>(expected)),
                )
            }
            Call::TakeOver { node, user: u } => {
                let real = store.take_over_lease(&user(*u), NODES[*node], TTL).await;
                let expected = twin.take_over(&user(*u), NODES[*node], ttl, NOW);
                (
                    format!("{:?}", real.map_err(|e| e.to_string())),
                    format!("{:?}", Ok::<_, String>(expected)),
                )
            }
            Call::Renew { node, asked } => {
                let asked: Vec<(UserId, Epoch)> =
                    asked.iter().map(|(u, e)| (user(*u), *e)).collect();
                let mut real = store
                    .renew_leases(NODES[*node], &asked, TTL)
                    .await
                    .map_err(|e| e.to_string());
                if let Ok(users) = real.as_mut() {
                    users.sort();
                    users.dedup();
                }
                let mut expected = twin.renew(NODES[*node], &asked, ttl, NOW);
                expected.sort();
                expected.dedup();
                (
                    format!("{real:?}"),
                    format!("{:?}", Ok::<_, String>(expected)),
                )
            }
            Call::Release {
                node,
                user: u,
                epoch,
            } => {
                let real = store.release_lease(&user(*u), NODES[*node], *epoch).await;
                let expected = twin.release(&user(*u), NODES[*node], *epoch, NOW);
                (
                    format!("{:?}", real.map_err(|e| e.to_string())),
                    format!("{:?}", Ok::<_, String>(expected)),
                )
            }
        };
        if real != expected {
            return Err(format!(
                "call {i} ({call:?}): the store answered {real}, the twin {expected}"
            ));
        }
        // After every call, every row and every node's holdings agree.
        for u in 0..3 {
            let row = store.get_lease(&user(u)).await.map_err(|e| e.to_string())?;
            let real = row.map(|r| (r.holder, r.epoch, r.released, r.expired));
            let expected = twin
                .row(&user(u))
                .map(|r| (r.holder.clone(), r.epoch, r.released, false));
            if real != expected {
                return Err(format!(
                    "after call {i} ({call:?}), user-{u}'s lease is {real:?} in the store, {expected:?} in the twin"
                ));
            }
        }
        for node in NODES {
            let mut real: Vec<(UserId, Epoch)> = store
                .leases_held_by(node)
                .await
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(|r| (r.user, r.epoch))
                .collect();
            real.sort();
            let mut expected: Vec<(UserId, Epoch)> = twin.held_by(node, NOW).into_iter().collect();
            expected.sort();
            if real != expected {
                return Err(format!(
                    "after call {i} ({call:?}), {node} holds {real:?} in the store, {expected:?} in the twin"
                ));
            }
        }
    }
    Ok(())
}

fn replay<F, Fut>(cases: u32, fresh: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = (Arc<dyn Store>, Option<tempfile::TempDir>)>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut runner = super::fixed_seed_runner(cases);
    let result = runner.run(&prop::collection::vec(call(), 1..40), |calls| {
        runtime.block_on(async {
            let (store, _dir) = fresh().await;
            differ(store.as_ref(), &calls)
                .await
                .map_err(TestCaseError::fail)
        })
    });
    if let Err(e) = result {
        panic!("the store and the twin disagree: {e}");
    }
}

#[test]
fn sqlite_answers_every_lease_call_as_the_twin_does() {
    replay(64, || async {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("berth.db").display());
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open(&url).await.unwrap());
        (store, Some(dir))
    });
}

#[test]
fn postgres_answers_every_lease_call_as_the_twin_does() {
    replay(24, || async {
        let url = PgCluster::shared().unwrap().fresh_database().await;
        let store: Arc<dyn Store> = Arc::new(berth_store::PgStore::open(&url).await.unwrap());
        (store, None)
    });
}
