//! The backend-independent store contract, run against PostgreSQL, plus
//! what only PostgreSQL has: a server that can be unreachable, go away and
//! come back.
//!
//! Uses the throwaway cluster of `berth-testkit` (or `BERTH_TEST_PG_URL`),
//! one fresh database per test.

use std::net::{Ipv4Addr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_core::UserId;
use berth_store::{
    ClaimOutcome, LeaseStore, NodeStore, PgStore, PgStoreOptions, Store, StoreError, TakeoverPolicy,
};
use berth_testkit::{PgCluster, PgClusterError};

async fn fresh() -> Arc<dyn Store> {
    let url = PgCluster::shared().unwrap().fresh_database().await;
    Arc::new(PgStore::open(&url).await.unwrap())
}

berth_store::store_contract_tests!(fresh().await);

fn closed_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    listener.local_addr().unwrap().port()
}

fn unavailable_message(result: Result<impl Sized, StoreError>) -> String {
    match result {
        Err(StoreError::Unavailable(msg)) => msg,
        Err(other) => panic!("expected Unavailable, got {other:?}"),
        Ok(_) => panic!("expected Unavailable, got success"),
    }
}

#[tokio::test]
async fn unreachable_server_is_unavailable_fast_and_names_it_without_password() {
    let port = closed_port();
    let url = format!("postgres://berth:hunter2@127.0.0.1:{port}/berth");
    let started = Instant::now();
    let msg = unavailable_message(PgStore::open(&url).await);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
    assert!(msg.contains("berth@"), "{msg}");
    assert!(!msg.contains("hunter2"), "password leaked: {msg}");

    // The same through the URL dispatch.
    let msg = unavailable_message(berth_store::open(&url).await.map(|_| ()));
    assert!(!msg.contains("hunter2"), "password leaked: {msg}");
}

#[tokio::test]
async fn unknown_host_is_unavailable() {
    let msg = unavailable_message(
        PgStore::open_with(
            "postgresql://u:pw@no-such-host.invalid:5432/db",
            PgStoreOptions {
                acquire_timeout: Duration::from_secs(5),
                ..Default::default()
            },
        )
        .await,
    );
    assert!(msg.contains("no-such-host.invalid"), "{msg}");
}

#[tokio::test]
async fn malformed_url_is_refused_without_leaking_the_password() {
    match berth_store::open("postgres://u:hunter2@host:notaport/db").await {
        Err(StoreError::UnsupportedUrl(msg)) => assert!(!msg.contains("hunter2"), "{msg}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
}

#[tokio::test]
async fn open_dispatches_postgres_urls() {
    let url = PgCluster::shared().unwrap().fresh_database().await;
    let store = berth_store::open(&url).await.unwrap();
    assert!(store.now().await.unwrap() > 0);
    let url = url.replacen("postgres://", "postgresql://", 1);
    let store = berth_store::open(&url).await.unwrap();
    assert!(store.now().await.unwrap() > 0);
}

/// Three nodes starting at once against one new database: the migrator's
/// advisory lock makes them take turns, and all three come up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_migrate_one_database_at_once() {
    let url = PgCluster::shared().unwrap().fresh_database().await;
    let opens: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { PgStore::open(&url).await })
        })
        .collect();
    let mut stores = Vec::new();
    for open in opens {
        stores.push(open.await.unwrap().unwrap());
    }
    let alice = UserId::parse("alice").unwrap();
    let outcome = stores[2]
        .claim_lease(
            &alice,
            "node-c",
            Duration::from_secs(30),
            TakeoverPolicy::Evidence,
        )
        .await
        .unwrap();
    assert_eq!(outcome, ClaimOutcome::Claimed { epoch: 1 });
}

/// Expiry is judged by the database's clock: a lease whose TTL has passed
/// on the server is reported expired and can be renewed, whatever this
/// process's clock says.
#[tokio::test]
async fn expiry_follows_the_database_clock() {
    let store = fresh().await;
    let alice = UserId::parse("alice").unwrap();
    let ClaimOutcome::Claimed { epoch } = store
        .claim_lease(
            &alice,
            "node-a",
            Duration::from_millis(200),
            TakeoverPolicy::Evidence,
        )
        .await
        .unwrap()
    else {
        panic!("claim failed");
    };
    let lease = store.get_lease(&alice).await.unwrap().unwrap();
    let until = lease.lease_until.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while store.now().await.unwrap() <= until {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(store.get_lease(&alice).await.unwrap().unwrap().expired);
    assert!(store.leases_held_by("node-a").await.unwrap().is_empty());
    assert_eq!(
        store
            .renew_leases("node-a", &[(alice.clone(), epoch)], Duration::from_secs(30))
            .await
            .unwrap(),
        vec![alice]
    );
}

/// The server stops: every operation fails as Unavailable, promptly; it
/// starts again: the pool reconnects by itself and nothing was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_is_unavailable_then_recovers() {
    let cluster = match PgCluster::start_throwaway() {
        Ok(c) => Arc::new(c),
        Err(PgClusterError::NoBinaries(why)) if std::env::var_os("BERTH_TEST_PG_URL").is_some() => {
            eprintln!("skipped: needs a throwaway cluster ({why})");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let url = cluster.fresh_database().await;
    let store = PgStore::open_with(
        &url,
        PgStoreOptions {
            max_connections: 4,
            acquire_timeout: Duration::from_secs(1),
        },
    )
    .await
    .unwrap();
    let alice = UserId::parse("alice").unwrap();
    let ttl = Duration::from_secs(60);
    let ClaimOutcome::Claimed { epoch } = store
        .claim_lease(&alice, "node-a", ttl, TakeoverPolicy::Evidence)
        .await
        .unwrap()
    else {
        panic!("claim failed");
    };
    // Warm several pooled connections, so the restart leaves dead ones behind.
    let warm: Vec<_> = (0..4)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.now().await })
        })
        .collect();
    for w in warm {
        w.await.unwrap().unwrap();
    }

    let c = cluster.clone();
    tokio::task::spawn_blocking(move || c.stop())
        .await
        .unwrap()
        .unwrap();
    for _ in 0..3 {
        let started = Instant::now();
        let msg = unavailable_message(
            store
                .renew_leases("node-a", &[(alice.clone(), epoch)], ttl)
                .await,
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert!(
            msg.contains(&format!("127.0.0.1:{}", cluster.port().unwrap())),
            "{msg}"
        );
    }
    unavailable_message(store.now().await);
    unavailable_message(
        store
            .claim_lease(&alice, "node-b", ttl, TakeoverPolicy::Evidence)
            .await,
    );

    let c = cluster.clone();
    tokio::task::spawn_blocking(move || c.start_again())
        .await
        .unwrap()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let renewed = loop {
        match store
            .renew_leases("node-a", &[(alice.clone(), epoch)], ttl)
            .await
        {
            Ok(renewed) => break renewed,
            Err(StoreError::Unavailable(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("store did not recover: {e}"),
        }
    };
    assert_eq!(renewed, vec![alice.clone()]);
    // Every pooled connection works again, not just the first one.
    let all: Vec<_> = (0..8)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.now().await })
        })
        .collect();
    for a in all {
        a.await.unwrap().unwrap();
    }
    let lease = store.get_lease(&alice).await.unwrap().unwrap();
    assert_eq!(
        (lease.holder.as_deref(), lease.epoch),
        (Some("node-a"), epoch)
    );
    store.close().await;
}
