//! PostgreSQL backend: the store a cluster of berth nodes shares.
//!
//! Same semantics as the SQLite backend, statement for statement: the store
//! operations and their statements are shared (`sql/`), every lease decision
//! is one conditional statement whose time comparisons use the database's
//! clock (`clock_timestamp()`, see [`now_ms!`]), and success is judged by
//! whether a row came back. This file connects and migrates, and says how
//! PostgreSQL spells what the shared statements cannot: bulk operations
//! (renew, activity) ship their lists as two parallel arrays and `unnest`
//! them, so one tick is one statement however many leases a node holds;
//! mints of one user take turns under an advisory lock.
//!
//! Errors that mean "the database cannot be used right now" (refused, DNS,
//! timeout, shut down, pool exhausted) become [`StoreError::Unavailable`]
//! naming the server with its password redacted; everything else is a
//! [`StoreError::Query`].

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::Connection;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions, PgQueryResult, Postgres};

use crate::StoreError;
use crate::sql::rows::{EmbeddedMigrations, embedded_migrations};
use crate::sql::{Dialect, Query, SqlBackend, SqlDb};

/// The store's clock in Unix milliseconds, as SQL text. `clock_timestamp()`
/// is the time the expression is evaluated; `now()` would be the start of
/// the transaction and make a claim that waited on a row lock judge expiry
/// by a stale clock. A macro so it can be spliced into `concat!` and every
/// query stays a `&'static str` the prepared-statement cache can key on.
macro_rules! now_ms {
    () => {
        "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
    };
}

/// The PostgreSQL schema, embedded so a deployed binary needs no files
/// beside it.
static MIGRATIONS: &[(i64, &str, &str)] = embedded_migrations!("postgres");

/// Upper bound the server enforces on one statement of the pool. Lease
/// statements touch a handful of indexed rows and take milliseconds; 5 s is
/// far above that and below the default renew interval (10 s), so one slow
/// statement fails before the next renew tick is due.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Connection settings of a [`PgStore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgStoreOptions {
    /// Upper bound on open connections from this node.
    pub max_connections: u32,
    /// How long an operation waits for a connection (including connecting
    /// to a server that is not there) before it fails as
    /// [`StoreError::Unavailable`]. Also bounds the first connect in
    /// [`PgStore::open_with`].
    pub acquire_timeout: Duration,
}

impl Default for PgStoreOptions {
    fn default() -> Self {
        Self {
            // A node's steady load is one renew per tick plus API and proxy
            // lookups; ten leaves room for bursts of claims without letting
            // a large cluster exhaust the server's max_connections (100).
            max_connections: 10,
            // Short against the lease timings (renew every 10 s, fence after
            // 20 s): a node learns the database is gone well before it must
            // fence, and an API caller gets its 503 promptly.
            acquire_timeout: Duration::from_secs(5),
        }
    }
}

/// The store a cluster of nodes shares.
#[derive(Debug, Clone)]
pub struct PgStore {
    db: SqlDb<Postgres>,
    /// The server, as `postgres://user@host:port/db`, for error messages.
    target: Arc<str>,
    acquire_timeout: Duration,
}

impl PgStore {
    /// Connects to the database a `postgres://` URL names and brings its
    /// schema up to date, with default [`PgStoreOptions`].
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        Self::open_with(url, PgStoreOptions::default()).await
    }

    /// Connects with the given options and migrates.
    ///
    /// The first connection is made directly rather than through the pool so
    /// an unreachable server is reported at once with its real cause
    /// (refused, DNS, timeout) instead of after the pool's retries.
    /// Migrations run on that connection, under sqlx's advisory lock, so
    /// nodes starting together against one database take turns; closing the
    /// connection afterwards releases the lock even if migrating failed
    /// half-way.
    pub async fn open_with(url: &str, options: PgStoreOptions) -> Result<Self, StoreError> {
        let connect = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::UnsupportedUrl(format!("{}: {e}", redact_url(url))))?
            .application_name("berth");
        let target: Arc<str> = describe(&connect).into();
        let unavailable = |what: &str, e: &dyn std::fmt::Display| {
            StoreError::Unavailable(format!("{what} PostgreSQL at {target}: {e}"))
        };

        let mut conn = match tokio::time::timeout(
            options.acquire_timeout,
            PgConnection::connect_with(&connect),
        )
        .await
        {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => return Err(unavailable("cannot connect to", &e)),
            Err(_) => {
                return Err(unavailable(
                    "cannot connect to",
                    &format_args!("no answer within {:?}", options.acquire_timeout),
                ));
            }
        };
        let migrator = Migrator::new(EmbeddedMigrations(MIGRATIONS))
            .await
            .map_err(|e| unavailable("cannot load migrations for", &e))?;
        let migrated = migrator.run_direct(&mut conn).await;
        // Dropping would also end the session, but only eventually; closing
        // ends it now and with it the advisory lock.
        let _ = conn.close().await;
        migrated.map_err(|e| unavailable("cannot migrate", &e))?;

        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections.max(1))
            .acquire_timeout(options.acquire_timeout)
            // Pinging a pooled connection before use costs one round trip
            // and is what lets the pool drop connections a server restart
            // killed, instead of failing the next operation with them.
            .test_before_acquire(true)
            // Server-side bound on every statement of the pool (not the
            // migration connection above: migrating may take longer). A
            // lease statement stuck behind a lock or an overloaded server
            // then fails well inside fence_after instead of holding the
            // renew tick; a connection that is black-holed altogether is
            // bounded by the callers' own timeouts. (sqlx 0.8 has no
            // client-side TCP keepalive setting for PostgreSQL.)
            .connect_lazy_with(connect.options([(
                "statement_timeout",
                format!("{}ms", STATEMENT_TIMEOUT.as_millis()),
            )]));
        Ok(Self {
            db: SqlDb::new(pool),
            target,
            acquire_timeout: options.acquire_timeout,
        })
    }

    /// Closes the pool, waiting for connections in use to come back.
    pub async fn close(&self) {
        self.db.pool.close().await;
    }
}

/// SQLSTATEs that mean the server cannot serve us now, as opposed to a
/// query being wrong: connection exceptions (08), insufficient resources
/// (53: too many connections, disk full), operator intervention (57P01–03:
/// shutting down, crashed, starting up; 57014: cancelled, e.g. by a
/// statement timeout), system errors (58: I/O), failed authorisation (28),
/// a missing database (3D000), and a read-only server (25006), which is a
/// standby answering after a failover.
fn unavailable_sqlstate(code: &str) -> bool {
    ["08", "53", "58", "28"]
        .iter()
        .any(|class| code.starts_with(class))
        || matches!(
            code,
            "57P01" | "57P02" | "57P03" | "57014" | "3D000" | "25006"
        )
}

/// `postgres://user@host:port/db`, or the socket directory: enough to tell
/// an operator which server is meant, never the password.
fn describe(options: &PgConnectOptions) -> String {
    let db = options.get_database().unwrap_or(options.get_username());
    match options.get_socket() {
        Some(socket) => format!(
            "postgres://{}@{}:{}/{db}",
            options.get_username(),
            socket.display(),
            options.get_port()
        ),
        None => format!(
            "postgres://{}@{}:{}/{db}",
            options.get_username(),
            options.get_host(),
            options.get_port()
        ),
    }
}

/// The URL with any password (in the user-info part or a `password=` query
/// parameter) replaced by `***`, for messages about URLs that did not parse.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => (&url[..i + 3], &url[i + 3..]),
        None => ("", url),
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rfind('@') {
        Some(at) => {
            let (userinfo, host) = authority.split_at(at);
            match userinfo.find(':') {
                Some(colon) => format!("{}:***{host}", &userinfo[..colon]),
                None => authority.to_owned(),
            }
        }
        None => authority.to_owned(),
    };
    let tail = match tail.find('?') {
        Some(q) => {
            let (path, query) = tail.split_at(q + 1);
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) if key.eq_ignore_ascii_case("password") => {
                        format!("{key}=***")
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}{}", query.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{scheme}{authority}{tail}")
}

impl SqlBackend for PgStore {
    type Db = Postgres;

    fn db(&self) -> &SqlDb<Postgres> {
        &self.db
    }

    /// Maps a sqlx error onto the store's error kinds. Connection trouble
    /// is `Unavailable` and names the server; decode failures mean a row
    /// holds something berth never wrote.
    fn err(&self, e: sqlx::Error) -> StoreError {
        let unavailable = |e: &dyn std::fmt::Display| {
            StoreError::Unavailable(format!("PostgreSQL at {}: {e}", self.target))
        };
        match &e {
            sqlx::Error::Database(db) => match db.code().as_deref() {
                Some(code) if unavailable_sqlstate(code) => unavailable(&e),
                _ => StoreError::Query(e.to_string()),
            },
            sqlx::Error::PoolTimedOut => unavailable(&format_args!(
                "no connection within {:?}: the server is unreachable or every connection is busy",
                self.acquire_timeout
            )),
            sqlx::Error::Io(_)
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::Configuration(_) => unavailable(&e),
            sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) => {
                StoreError::Corrupt(e.to_string())
            }
            _ => StoreError::Query(e.to_string()),
        }
    }
}

impl Dialect for Postgres {
    const NOW_MS: &'static str = now_ms!();

    /// `$3`/`$4` are the held users and their epochs as parallel arrays, so
    /// 10 000 leases are one statement with four binds. The clock is read
    /// once for the whole statement (a one-row join), so every renewed
    /// lease gets the same `lease_until`.
    const RENEW: &'static str = concat!(
        "UPDATE leases SET lease_until = clock.now + $2 ",
        "FROM (SELECT ",
        now_ms!(),
        " AS now) AS clock, ",
        "unnest($3::text[], $4::bigint[]) AS held(user_id, epoch) ",
        "WHERE leases.user_id = held.user_id AND leases.epoch = held.epoch ",
        "AND leases.holder = $1 AND NOT leases.released ",
        "RETURNING leases.user_id"
    );

    /// `$1`/`$2` are users and times as parallel arrays. Grouping first
    /// means a user named twice gets the larger time rather than whichever
    /// row the join happened to pick.
    const ACTIVITY: &'static str = "UPDATE instances SET last_active = activity.t \
         FROM (SELECT u, max(t) AS t FROM unnest($1::text[], $2::bigint[]) AS a(u, t) GROUP BY u) \
              AS activity \
         WHERE instances.user_id = activity.u AND instances.role = 'main' \
           AND activity.t > instances.last_active";

    /// Mints of one user take turns, whichever node they run on: under READ
    /// COMMITTED two concurrent inserts would both see room under the cap.
    /// Other users are not held up.
    const LOCK_USER_TOKENS: Option<&'static str> =
        Some("SELECT pg_advisory_xact_lock(hashtextextended('berth-tokens:' || $1, 0))");

    /// Placements take turns, whichever node they run on: under READ
    /// COMMITTED two concurrent ones would count the same loads and choose
    /// the same node. Each statement after the lock reads afresh, so it
    /// sees the reservations committed before it.
    const LOCK_PLACEMENTS: Option<&'static str> =
        Some("SELECT pg_advisory_xact_lock(hashtextextended('berth-placements', 0))");

    fn bind_pairs<'q>(
        query: Query<'q, Self>,
        pairs: Vec<(&'q str, i64)>,
    ) -> Result<Query<'q, Self>, StoreError> {
        let (texts, integers): (Vec<&str>, Vec<i64>) = pairs.into_iter().unzip();
        Ok(query.bind(texts).bind(integers))
    }

    fn rows_affected(done: &PgQueryResult) -> u64 {
        done.rows_affected()
    }
}

#[cfg(test)]
mod tests {
    use sqlx::Row;

    use super::*;
    use crate::sql::test_support;

    #[test]
    fn redact_hides_passwords_and_keeps_the_rest() {
        assert_eq!(
            redact_url("postgres://berth:s3cr%2Ft@db.internal:5432/berth?sslmode=require"),
            "postgres://berth:***@db.internal:5432/berth?sslmode=require"
        );
        assert_eq!(
            redact_url("postgresql://u:p@ss@host/db"),
            "postgresql://u:***@host/db"
        );
        assert_eq!(
            redact_url("postgres://host/db?user=u&password=hunter2&x=1"),
            "postgres://host/db?user=u&password=***&x=1"
        );
        assert_eq!(redact_url("postgres://u@host/db"), "postgres://u@host/db");
        assert_eq!(redact_url("not a url"), "not a url");
    }

    #[test]
    fn connection_sqlstates_are_unavailable_others_are_not() {
        for code in [
            "08006", "08001", "57P01", "57P03", "53300", "28P01", "3D000", "25006",
        ] {
            assert!(unavailable_sqlstate(code), "{code}");
        }
        for code in ["23505", "42601", "40001", "22P02"] {
            assert!(!unavailable_sqlstate(code), "{code}");
        }
    }

    #[test]
    fn describe_names_the_server_without_the_password() {
        let options =
            PgConnectOptions::from_str("postgres://berth:hunter2@db.internal:6543/leases").unwrap();
        let text = describe(&options);
        assert_eq!(text, "postgres://berth@db.internal:6543/leases");
    }

    /// `clock_timestamp()` advances inside one transaction, where `now()`
    /// would not: the store's clock is the time of the statement.
    #[tokio::test]
    async fn store_clock_advances_within_a_transaction() {
        let cluster = berth_testkit::PgCluster::shared().unwrap();
        let url = cluster.fresh_database().await;
        let store = PgStore::open(&url).await.unwrap();
        let mut tx = store.db.pool.begin().await.unwrap();
        let read = concat!(
            "SELECT ",
            now_ms!(),
            " AS clock, (extract(epoch FROM now()) * 1000)::bigint AS frozen"
        );
        let a = sqlx::query(read).fetch_one(&mut *tx).await.unwrap();
        sqlx::query("SELECT pg_sleep(0.05)")
            .execute(&mut *tx)
            .await
            .unwrap();
        let b = sqlx::query(read).fetch_one(&mut *tx).await.unwrap();
        let (a_clock, a_frozen): (i64, i64) = (a.get("clock"), a.get("frozen"));
        let (b_clock, b_frozen): (i64, i64) = (b.get("clock"), b.get("frozen"));
        assert_eq!(a_frozen, b_frozen, "now() is frozen in a transaction");
        assert!(b_clock - a_clock >= 40, "{a_clock} then {b_clock}");
        tx.rollback().await.unwrap();
    }

    #[tokio::test]
    async fn migrations_are_recorded_and_reopen_keeps_data() {
        let cluster = berth_testkit::PgCluster::shared().unwrap();
        let url = cluster.fresh_database().await;
        let store = PgStore::open(&url).await.unwrap();
        test_support::mint_a_token(&store).await;
        store.close().await;
        let store = PgStore::open(&url).await.unwrap();
        test_support::check_token_kept(&store).await;
        let versions: Vec<i64> =
            sqlx::query_scalar("SELECT version FROM _sqlx_migrations ORDER BY version")
                .fetch_all(&store.db.pool)
                .await
                .unwrap();
        // Every embedded migration, in order (also when versions are merged
        // in from parallel work).
        let embedded: Vec<i64> = MIGRATIONS.iter().map(|m| m.0).collect();
        assert_eq!(versions, embedded);
        assert!(embedded.contains(&4), "the accounts migration is applied");
        assert!(embedded.contains(&3), "the users migration is applied");
    }

    /// Tokens minted before schema version 5 get an id (a prefix of their
    /// hash) and expire 30 days after they were minted.
    #[tokio::test]
    async fn tokens_from_before_version_5_get_an_id_and_an_expiry() {
        let cluster = berth_testkit::PgCluster::shared().unwrap();
        let url = cluster.fresh_database().await;
        let mut conn = PgConnection::connect(&url).await.unwrap();
        Migrator::new(EmbeddedMigrations(&MIGRATIONS[..2]))
            .await
            .unwrap()
            .run_direct(&mut conn)
            .await
            .unwrap();
        let now = berth_core::unix_millis_now();
        test_support::insert_old_tokens::<Postgres>(&mut conn, now).await;
        conn.close().await.unwrap();
        let store = PgStore::open(&url).await.unwrap();
        test_support::check_old_tokens_upgraded(&store, now).await;
    }
}
