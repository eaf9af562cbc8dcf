//! The throwaway cluster starts, serves separate databases, stops and
//! starts, and leaves nothing behind when dropped.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test: an unwrap is its assertion"
)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use berth_testkit::{PgCluster, PgClusterError};
use sqlx::Connection;

async fn count_rows(url: &str) -> i64 {
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM t")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throwaway_cluster_lifecycle() {
    if std::env::var_os("BERTH_TEST_PG_URL").is_some() {
        eprintln!("skipped: BERTH_TEST_PG_URL is set");
        return;
    }
    let cluster = PgCluster::start_throwaway().unwrap();
    assert!(cluster.is_throwaway());
    let port = cluster.port().unwrap();

    let a = cluster.fresh_database().await;
    let b = cluster.fresh_database().await;
    assert_ne!(a, b);
    let mut conn = sqlx::PgConnection::connect(&a).await.unwrap();
    sqlx::query("CREATE TABLE t (x int)")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("INSERT INTO t VALUES (1)")
        .execute(&mut conn)
        .await
        .unwrap();
    let fsync: String = sqlx::query_scalar("SHOW fsync")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(fsync, "off");
    let data_dir: String = sqlx::query_scalar("SHOW data_directory")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    let mut conn = sqlx::PgConnection::connect(&b).await.unwrap();
    assert!(
        sqlx::query("SELECT * FROM t")
            .execute(&mut conn)
            .await
            .is_err()
    );
    conn.close().await.unwrap();

    let cluster = std::sync::Arc::new(cluster);
    let c = cluster.clone();
    tokio::task::spawn_blocking(move || c.restart())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(count_rows(&a).await, 1);
    let c = cluster.clone();
    tokio::task::spawn_blocking(move || c.stop())
        .await
        .unwrap()
        .unwrap();
    assert!(sqlx::PgConnection::connect(&a).await.is_err());
    let c = cluster.clone();
    tokio::task::spawn_blocking(move || c.start_again())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(count_rows(&a).await, 1);

    let dir = PathBuf::from(&data_dir);
    let top = dir.parent().unwrap().to_path_buf();
    assert!(top.exists());
    drop(std::sync::Arc::into_inner(cluster).unwrap());
    assert!(!top.exists(), "{top:?} left behind");
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
        assert!(
            Instant::now() < deadline,
            "server still listening on {port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test]
async fn shared_cluster_refuses_to_stop() {
    let shared = PgCluster::shared().unwrap();
    let url = shared.fresh_database().await;
    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(one, 1);
    conn.close().await.unwrap();
    assert!(matches!(
        shared.stop(),
        Err(PgClusterError::Shared | PgClusterError::External)
    ));
}
