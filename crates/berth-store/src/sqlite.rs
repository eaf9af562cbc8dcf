//! SQLite backend: the embedded single-node store.
//!
//! One database file in WAL mode behind a small connection pool. The store
//! operations and their statements are shared with PostgreSQL (`sql/`);
//! this file opens and checks the database and says how SQLite spells what
//! the shared statements cannot: its clock ([`now_ms!`]), the bulk renew and
//! activity statements, which take their lists as one JSON object, and how
//! its errors map onto [`StoreError`].

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::sqlite::{
    Sqlite, SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteQueryResult, SqliteSynchronous,
};

use crate::StoreError;
use crate::sql::rows::{EmbeddedMigrations, embedded_migrations, get};
use crate::sql::{Dialect, Query, SqlBackend, SqlDb};

/// The store's clock in Unix milliseconds, as SQL text (SQLite ≥ 3.42 for
/// `'subsec'`; the bundled library is 3.46). A macro rather than a `const`
/// so it can be spliced into `concat!` and every query stays a `&'static str`
/// that the statement cache can key on.
macro_rules! now_ms {
    () => {
        "CAST(unixepoch('subsec') * 1000 AS INTEGER)"
    };
}

/// How long a connection waits on another writer's lock before the query
/// fails with [`StoreError::Unavailable`]. Lease writes are tiny, so a wait
/// this long means something is wrong rather than merely busy.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// SQLite serialises writers anyway; a few connections let readers (the
/// API, the proxy's lookups) proceed alongside the renew tick.
const MAX_CONNECTIONS: u32 = 4;
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// The SQLite schema, embedded so a deployed binary needs no files beside it.
static MIGRATIONS: &[(i64, &str, &str)] = embedded_migrations!("sqlite");

/// The embedded single-node store.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    db: SqlDb<Sqlite>,
}

impl SqliteStore {
    /// Opens (creating if missing) the database a `sqlite://PATH` URL names
    /// and brings its schema up to date.
    ///
    /// The file's directory must exist and be writable; otherwise this fails
    /// with [`StoreError::Unavailable`] naming the path.
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url)
            .map_err(|e| StoreError::UnsupportedUrl(format!("{url}: {e}")))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // NORMAL is durable across application crashes in WAL mode and
            // only risks the last commits on power loss, after which every
            // lease has expired anyway.
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true);
        let path = options.get_filename().display().to_string();
        let unavailable = |what: &str, e: &dyn std::fmt::Display| {
            StoreError::Unavailable(format!("{what} SQLite database {path:?}: {e}"))
        };
        if let Some(dir) = Path::new(&path)
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
        {
            // SQLite's own error is a bare "unable to open database file";
            // saying which directory is missing saves an operator a guess.
            if !dir.is_dir() {
                return Err(StoreError::Unavailable(format!(
                    "cannot open SQLite database {path:?}: {:?} is not an existing directory",
                    dir.display().to_string()
                )));
            }
        }
        let pool = SqlitePoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_with(options)
            .await
            .map_err(|e| unavailable("cannot open", &e))?;
        check_clock(&pool).await?;
        let migrator = Migrator::new(EmbeddedMigrations(MIGRATIONS))
            .await
            .map_err(|e| unavailable("cannot load migrations for", &e))?;
        migrator
            .run(&pool)
            .await
            .map_err(|e| unavailable("cannot migrate", &e))?;
        Ok(Self {
            db: SqlDb::new(pool),
        })
    }

    /// Closes the pool, waiting for connections in use to come back.
    pub async fn close(&self) {
        self.db.pool.close().await;
    }
}

/// Refuses an SQLite without `unixepoch('subsec')` (older than 3.42, as a
/// system library might be): there the store clock reads NULL, and every
/// lease comparison against NULL would quietly come out false.
async fn check_clock(pool: &SqlitePool) -> Result<(), StoreError> {
    let row = sqlx::query(concat!(
        "SELECT sqlite_version() AS version, ",
        now_ms!(),
        " AS now"
    ))
    .fetch_one(pool)
    .await
    .map_err(db_err)?;
    let version: String = get(&row, "version")?;
    let now: Option<i64> = get(&row, "now")?;
    match now {
        Some(_) => Ok(()),
        None => Err(StoreError::Unavailable(format!(
            "SQLite {version} cannot read its clock in milliseconds; berth needs SQLite 3.42 or newer"
        ))),
    }
}

/// Maps a sqlx error onto the store's error kinds: lock, I/O and pool
/// failures mean the database cannot be used right now; decode failures mean
/// a row holds something berth never wrote.
fn db_err(e: sqlx::Error) -> StoreError {
    match &e {
        sqlx::Error::Database(db) => {
            let primary = db
                .code()
                .and_then(|c| c.parse::<i32>().ok())
                .map(|c| c & 0xff);
            match primary {
                // BUSY, LOCKED, READONLY, IOERR, CORRUPT, FULL, CANTOPEN, NOTADB
                Some(5 | 6 | 8 | 10 | 11 | 13 | 14 | 26) => StoreError::Unavailable(e.to_string()),
                _ => StoreError::Query(e.to_string()),
            }
        }
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Configuration(_) => StoreError::Unavailable(e.to_string()),
        sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) => {
            StoreError::Corrupt(e.to_string())
        }
        _ => StoreError::Query(e.to_string()),
    }
}

/// (text, integer) pairs written as one JSON object, `{"text": integer, …}`,
/// in order and keeping repeated keys: `json_each` then yields each pair as
/// its `key` and `value`, with no per-pair parse of an inner array.
struct KeyedPairs<'a, 'q>(&'a [(&'q str, i64)]);

impl serde::Serialize for KeyedPairs<'_, '_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(k, v)| (*k, *v)))
    }
}

impl SqlBackend for SqliteStore {
    type Db = Sqlite;

    fn db(&self) -> &SqlDb<Sqlite> {
        &self.db
    }

    fn err(&self, e: sqlx::Error) -> StoreError {
        db_err(e)
    }
}

impl Dialect for Sqlite {
    const NOW_MS: &'static str = now_ms!();

    /// `$3` is a JSON object mapping each user to the epoch it is held at:
    /// one bind however many leases. The statement walks that object and
    /// looks each user up by primary key, so it costs one parse of the
    /// object and one lookup per lease. The unary `+` on `holder` keeps
    /// SQLite from driving the update from the holder index instead, which
    /// would scan the whole object once per lease the node holds.
    const RENEW: &'static str = concat!(
        "UPDATE leases SET lease_until = ",
        now_ms!(),
        " + $2 FROM json_each($3) AS held ",
        "WHERE leases.user_id = held.key AND leases.epoch = held.value ",
        "AND +leases.holder = $1 AND NOT leases.released RETURNING leases.user_id"
    );

    /// `$1` is a JSON object mapping users to times; a user may be named
    /// twice (the object keeps both). Grouping first means such a user gets
    /// the larger time rather than whichever row the join happened to pick.
    const ACTIVITY: &'static str = "UPDATE instances SET last_active = activity.t \
         FROM (SELECT key AS u, max(value) AS t FROM json_each($1) GROUP BY key) AS activity \
         WHERE instances.user_id = activity.u AND instances.role = 'main' \
           AND activity.t > instances.last_active";

    /// None needed: SQLite has one writer at a time and a mint's
    /// transaction writes first (it drops expired tokens), so its count,
    /// parent check and insert see no concurrent mint of the same user.
    const LOCK_USER_TOKENS: Option<&'static str> = None;

    /// None needed: a placement's transaction writes first (it drops
    /// expired reservations), which takes SQLite's one write lock before it
    /// counts.
    const LOCK_PLACEMENTS: Option<&'static str> = None;

    fn bind_pairs<'q>(
        query: Query<'q, Self>,
        pairs: Vec<(&'q str, i64)>,
    ) -> Result<Query<'q, Self>, StoreError> {
        let json = serde_json::to_string(&KeyedPairs(&pairs))
            .map_err(|e| StoreError::Query(e.to_string()))?;
        Ok(query.bind(json))
    }

    fn rows_affected(done: &SqliteQueryResult) -> u64 {
        done.rows_affected()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use berth_core::{Epoch, UserId};

    use super::*;
    use crate::Store;
    use crate::sql::test_support;

    fn url_in(dir: &Path) -> String {
        format!("sqlite://{}", dir.join("berth.db").display())
    }

    fn assert_unavailable_naming(err: StoreError, path: &Path) {
        match err {
            StoreError::Unavailable(msg) => {
                assert!(
                    msg.contains(&path.display().to_string()),
                    "message does not name {path:?}: {msg}"
                );
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn open_creates_file_in_wal_mode_and_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let url = url_in(dir.path());
        let store = SqliteStore::open(&url).await.unwrap();
        assert!(dir.path().join("berth.db").is_file());
        let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(&store.db.pool)
            .await
            .unwrap();
        assert_eq!(mode, "wal");
        let fk: i64 = sqlx::query_scalar("PRAGMA foreign_keys")
            .fetch_one(&store.db.pool)
            .await
            .unwrap();
        assert_eq!(fk, 1);
        let busy: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
            .fetch_one(&store.db.pool)
            .await
            .unwrap();
        assert!(busy >= 1000, "{busy}");
        test_support::mint_a_token(&store).await;
        store.close().await;

        // Migrations are recorded, so opening again neither fails nor loses data.
        let store = SqliteStore::open(&url).await.unwrap();
        test_support::check_token_kept(&store).await;
    }

    /// Tokens minted before schema version 5 get an id (a prefix of their
    /// hash) and expire 30 days after they were minted.
    #[tokio::test]
    async fn tokens_from_before_version_5_get_an_id_and_an_expiry() {
        let dir = tempfile::tempdir().unwrap();
        let url = url_in(dir.path());
        let options = SqliteConnectOptions::from_str(&url)
            .unwrap()
            .create_if_missing(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .unwrap();
        Migrator::new(EmbeddedMigrations(&MIGRATIONS[..2]))
            .await
            .unwrap()
            .run(&pool)
            .await
            .unwrap();
        let now = berth_core::unix_millis_now();
        test_support::insert_old_tokens::<Sqlite>(&mut pool.acquire().await.unwrap(), now).await;
        pool.close().await;
        let store = SqliteStore::open(&url).await.unwrap();
        test_support::check_old_tokens_upgraded(&store, now).await;
    }

    #[tokio::test]
    async fn open_in_missing_directory_is_unavailable_naming_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no").join("such").join("dir");
        let err = SqliteStore::open(&url_in(&missing)).await.unwrap_err();
        assert_unavailable_naming(err, &missing.join("berth.db"));
        assert!(!missing.exists(), "open must not create directories");
    }

    #[tokio::test]
    async fn open_under_a_file_is_unavailable_naming_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("plain-file");
        std::fs::write(&file, b"not a directory").unwrap();
        let err = SqliteStore::open(&url_in(&file)).await.unwrap_err();
        assert_unavailable_naming(err, &file.join("berth.db"));
    }

    #[tokio::test]
    async fn open_in_unwritable_directory_is_unavailable_naming_the_path() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let ro = dir.path().join("read-only");
        std::fs::create_dir(&ro).unwrap();
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
        // Root (and CAP_DAC_OVERRIDE) ignores directory permissions; there
        // is nothing to observe then.
        if std::fs::write(ro.join("probe"), b"").is_ok() {
            eprintln!("skipped: running with permission to write anywhere");
            return;
        }
        let err = SqliteStore::open(&url_in(&ro)).await.unwrap_err();
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_unavailable_naming(err, &ro.join("berth.db"));
    }

    #[tokio::test]
    async fn open_by_url_picks_sqlite_and_refuses_others() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::open(&url_in(dir.path())).await.unwrap();
        assert!(store.now().await.unwrap() > 0);
        match crate::open("mysql://localhost/berth").await {
            Err(StoreError::UnsupportedUrl(u)) => assert!(u.contains("mysql")),
            other => panic!("{:?}", other.map(|_| ())),
        }
    }

    /// An in-memory database is one database for every connection of the
    /// pool, migrated like a file.
    #[tokio::test]
    async fn in_memory_store_works() {
        let store = SqliteStore::open("sqlite::memory:").await.unwrap();
        crate::contract::claim_on_fresh_user_gets_epoch_1(Arc::new(store)).await;
    }

    /// 10 000 leases renew in one statement with one bind (SQLite allows at
    /// most 32 766 binds per statement, so one bind per pair would not scale).
    #[tokio::test]
    async fn renews_ten_thousand_leases_in_one_statement() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&url_in(dir.path())).await.unwrap();
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 9999) \
             INSERT INTO leases (user_id, holder, epoch, lease_until, released) \
             SELECT printf('user-%05d', i), 'node-a', 3, 0, 0 FROM n",
        )
        .execute(&store.db.pool)
        .await
        .unwrap();
        let held: Vec<(UserId, Epoch)> = (0..10_000)
            .map(|i| (UserId::parse(&format!("user-{i:05}")).unwrap(), 3))
            .collect();
        let store: Arc<dyn Store> = Arc::new(store);
        let renewed = store
            .renew_leases("node-a", &held, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(renewed.len(), 10_000);
        assert!(
            store
                .list_leases(true, Duration::from_secs(30))
                .await
                .unwrap()
                .is_empty()
        );
        assert_eq!(store.leases_held_by("node-a").await.unwrap().len(), 10_000);
    }

    /// The schema refuses a slug that is not a DNS label even from a writer
    /// that bypasses `Slug::parse`: a stored slug becomes a path.
    #[tokio::test]
    async fn the_users_table_refuses_slugs_that_are_not_dns_labels() {
        let store = SqliteStore::open("sqlite::memory:").await.unwrap();
        let too_long = "a".repeat(44);
        for bad in ["", "a/b", "..", "-a", "a-", "A", too_long.as_str()] {
            let result =
                sqlx::query("INSERT INTO users (user_id, slug, created_at) VALUES ('u', ?1, 0)")
                    .bind(bad)
                    .execute(&store.db.pool)
                    .await;
            assert!(result.is_err(), "{bad:?} was accepted");
        }
        let longest = "a".repeat(43);
        sqlx::query("INSERT INTO users (user_id, slug, created_at) VALUES ('u', ?1, 0)")
            .bind(&longest)
            .execute(&store.db.pool)
            .await
            .unwrap();
    }

    /// Migration 6 carries a local instance's identity over: a record
    /// written with a pid and its start time gets the runtime reference the
    /// local runtime names that run by, so an upgrade of berth adopts its
    /// running instances instead of ending them.
    #[tokio::test]
    async fn migration_6_turns_pid_and_start_time_into_the_runtime_ref() {
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        for (_, _, sql) in MIGRATIONS.iter().filter(|(v, _, _)| *v < 6) {
            sqlx::raw_sql(sql).execute(&pool).await.unwrap();
        }
        sqlx::raw_sql(
            "INSERT INTO instances (user_id, role, id, status, node, epoch, port, pid, pid_start, \
             folder, started_at, ready, restarts, last_active) VALUES \
             ('alice', 'main', 'i1', 'running', 'n', 1, 20000, 4242, 987654, '', 0, 1, 0, 0), \
             ('bob', 'main', 'i2', 'stopped', 'n', 1, NULL, NULL, NULL, '', 0, 0, 0, 0)",
        )
        .execute(&pool)
        .await
        .unwrap();
        let (_, _, sql) = MIGRATIONS.iter().find(|(v, _, _)| *v == 6).unwrap();
        sqlx::raw_sql(sql).execute(&pool).await.unwrap();
        let refs: Vec<(String, Option<String>)> =
            sqlx::query_as("SELECT user_id, runtime_ref FROM instances ORDER BY user_id")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(
            refs,
            [
                ("alice".to_owned(), Some("pid 4242 start 987654".to_owned())),
                ("bob".to_owned(), None)
            ]
        );
        let columns: Vec<String> =
            sqlx::query_scalar("SELECT name FROM pragma_table_info('instances')")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert!(!columns.iter().any(|c| c == "pid_start"), "{columns:?}");
    }
}
