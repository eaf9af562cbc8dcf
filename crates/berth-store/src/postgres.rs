//! PostgreSQL backend: the store a cluster of berth nodes shares.
//!
//! Same semantics as the SQLite backend, statement for statement: every
//! lease decision is one conditional statement whose time comparisons use
//! the database's clock (`clock_timestamp()`, see [`now_ms!`]), and success
//! is judged by whether a row came back. Bulk operations (renew, activity)
//! ship their lists as two parallel arrays and `unnest` them, so one tick is
//! one statement however many leases a node holds.
//!
//! Errors that mean "the database cannot be used right now" (refused, DNS,
//! timeout, shut down, pool exhausted) become [`StoreError::Unavailable`]
//! naming the server with its password redacted; everything else is a
//! [`StoreError::Query`].

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use berth_core::policy::CrashState;
use berth_core::{Epoch, Instance, InstanceStatus, Role, Slug, UnixMillis, UserId};
use sqlx::Connection;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};

use crate::common::{
    EmbeddedMigrations, get, instance_from_row, lease_from_row, node_from_row, node_status_str,
    parse_slug, parse_user, slug_taken, ttl_ms, widen,
};
use crate::{
    ClaimOutcome, InstanceFilter, LaunchParams, LeaseRecord, NodeRecord, Store, StoreError,
    TakeoverPolicy, check_patch_size,
};

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
static MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "init",
        include_str!("../migrations/postgres/0001_init.sql"),
    ),
    (
        2,
        "launch_params",
        include_str!("../migrations/postgres/0002_launch_params.sql"),
    ),
    (
        3,
        "users",
        include_str!("../migrations/postgres/0003_users.sql"),
    ),
];

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
    pool: PgPool,
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
            pool,
            target,
            acquire_timeout: options.acquire_timeout,
        })
    }

    /// Closes the pool, waiting for connections in use to come back.
    pub async fn close(&self) {
        self.pool.close().await;
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

    /// Reads the lease row after a failed claim, to say who holds it.
    async fn busy_report(&self, user: &UserId) -> Result<ClaimOutcome, StoreError> {
        match self.get_lease(user).await? {
            Some(LeaseRecord {
                holder: Some(holder),
                expired,
                ..
            }) => Ok(ClaimOutcome::Busy { holder, expired }),
            // Rows are never deleted and holders never cleared, so a claim
            // that failed always leaves a holder to name.
            _ => Err(StoreError::Query(format!(
                "lease of {user} refused the claim but names no holder"
            ))),
        }
    }

    /// Runs the (fenced) upsert; whether it wrote a row.
    async fn upsert_instance(&self, i: &Instance) -> Result<bool, StoreError> {
        sqlx::query(INSTANCE_UPSERT_SQL)
            .bind(i.user.as_str())
            .bind(i.role.as_str())
            .bind(&i.id)
            .bind(i.status.as_str())
            .bind(&i.node)
            .bind(i.epoch)
            .bind(i.port.map(i64::from))
            .bind(i.pid.map(i64::from))
            .bind(i.pid_start.map(|v| widen(v, "pid_start")).transpose()?)
            .bind(&i.folder)
            .bind(i.started_at)
            .bind(i.ready)
            .bind(i64::from(i.restarts))
            .bind(i.last_error.as_deref())
            .bind(i.exit_code.map(i64::from))
            .bind(i.last_active)
            .execute(&self.pool)
            .await
            .map(|done| done.rows_affected() > 0)
            .map_err(|e| match &e {
                sqlx::Error::Database(db)
                    if db.kind() == sqlx::error::ErrorKind::UniqueViolation =>
                {
                    StoreError::Query(format!(
                        "port {} on node {:?} is already recorded for another live instance \
                         (putting {} {}): {e}",
                        i.port.map_or_else(|| "-".to_owned(), |p| p.to_string()),
                        i.node,
                        i.user,
                        i.role
                    ))
                }
                _ => self.err(e),
            })
    }

    async fn ensure_lease_row(&self, user: &UserId) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO leases (user_id) VALUES ($1) ON CONFLICT (user_id) DO NOTHING")
            .bind(user.as_str())
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Runs the claim or takeover update and reports who holds the lease
    /// when no row came back.
    async fn conditional_claim(
        &self,
        sql: &'static str,
        user: &UserId,
        node: &str,
        ttl: Duration,
        evidence: Option<bool>,
    ) -> Result<ClaimOutcome, StoreError> {
        self.ensure_lease_row(user).await?;
        let mut query = sqlx::query(sql)
            .bind(user.as_str())
            .bind(node)
            .bind(ttl_ms(ttl));
        if let Some(evidence) = evidence {
            query = query.bind(evidence);
        }
        let row = query
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        match row {
            Some(row) => Ok(ClaimOutcome::Claimed {
                epoch: get(&row, "epoch")?,
            }),
            None => self.busy_report(user).await,
        }
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

macro_rules! instance_columns {
    () => {
        "user_id, role, id, status, node, epoch, port, pid, pid_start, folder, started_at, \
         ready, restarts, last_error, exit_code, last_active"
    };
}

/// Inserts or replaces a (user, role) record. An upsert on the primary key
/// only: a clash on the live (node, port) index still fails.
///
/// A main's record is fenced: the update applies only over a record written
/// under a lower epoch, or the same epoch by the same node. A refused update
/// changes no row, which is how the caller tells.
const INSTANCE_UPSERT_SQL: &str = concat!(
    "INSERT INTO instances (",
    instance_columns!(),
    ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16) ",
    "ON CONFLICT (user_id, role) DO UPDATE SET id = excluded.id, status = excluded.status, ",
    "node = excluded.node, epoch = excluded.epoch, port = excluded.port, pid = excluded.pid, ",
    "pid_start = excluded.pid_start, folder = excluded.folder, ",
    "started_at = excluded.started_at, ready = excluded.ready, restarts = excluded.restarts, ",
    "last_error = excluded.last_error, exit_code = excluded.exit_code, ",
    "last_active = excluded.last_active ",
    "WHERE excluded.role = 'watchdog' OR instances.epoch < excluded.epoch ",
    "OR (instances.epoch = excluded.epoch AND instances.node = excluded.node)"
);

/// Deletes a main's record under the fencing rule of [`INSTANCE_UPSERT_SQL`].
const INSTANCE_DELETE_FENCED_SQL: &str = "DELETE FROM instances \
     WHERE user_id = $1 AND role = 'main' AND (epoch < $3 OR (epoch = $3 AND node = $2))";

const INSTANCE_GET_SQL: &str = concat!(
    "SELECT ",
    instance_columns!(),
    " FROM instances WHERE user_id = $1 AND role = $2"
);

const INSTANCE_LIST_SQL: &str = concat!(
    "SELECT ",
    instance_columns!(),
    " FROM instances WHERE ($1::text IS NULL OR status = $1) ",
    "AND ($2::text IS NULL OR node = $2) ",
    "AND ($3::text IS NULL OR role = $3) ORDER BY user_id, role"
);

/// The lease columns up to `holder_alive`, which each query adds. `expired`
/// is computed in SQL so it uses the store's clock.
macro_rules! lease_columns {
    () => {
        concat!(
            "SELECT user_id, holder, epoch, lease_until, released, ",
            "COALESCE(holder IS NOT NULL AND NOT released AND lease_until < ",
            now_ms!(),
            ", false) AS expired, "
        )
    };
}

const LEASE_GET_SQL: &str = concat!(
    lease_columns!(),
    "NULL::boolean AS holder_alive FROM leases WHERE user_id = $1"
);

/// `$2` is the TTL that judges the holder alive: the same test as the
/// claim's evidence clause in [`CLAIM_SQL`], so "expired and holder not
/// alive" is exactly what an evidence claim with that TTL may take.
const LEASE_LIST_SQL: &str = concat!(
    lease_columns!(),
    "CASE WHEN holder IS NULL THEN NULL ELSE EXISTS (SELECT 1 FROM nodes ",
    "WHERE nodes.id = leases.holder AND nodes.heartbeat >= ",
    now_ms!(),
    " - $2) END AS holder_alive FROM leases",
    " WHERE NOT $1 OR (holder IS NOT NULL AND NOT released AND lease_until < ",
    now_ms!(),
    ") ORDER BY user_id"
);

/// Live leases only: an expired one is no longer this node's to run, even
/// if nobody has taken it yet; the node must claim it again.
const LEASE_HELD_SQL: &str = concat!(
    lease_columns!(),
    "NULL::boolean AS holder_alive FROM leases",
    " WHERE holder = $1 AND NOT released AND lease_until >= ",
    now_ms!(),
    " ORDER BY user_id"
);

/// The claim's conditional update (design §3, invariant 1). `$4` is true
/// when expired leases may be taken from a holder whose heartbeat is older
/// than one TTL (or which never registered a heartbeat at all).
///
/// Under READ COMMITTED a claimer that finds the row locked by a concurrent
/// claim waits, then re-checks this WHERE against the row as committed, so
/// of several simultaneous claimers exactly one gets a row back.
const CLAIM_SQL: &str = concat!(
    "UPDATE leases SET holder = $2, epoch = epoch + 1, lease_until = ",
    now_ms!(),
    " + $3, released = false ",
    "WHERE user_id = $1 AND (",
    "holder IS NULL OR holder = $2 OR released OR (",
    "$4 AND lease_until < ",
    now_ms!(),
    " AND NOT EXISTS (SELECT 1 FROM nodes WHERE nodes.id = leases.holder AND nodes.heartbeat >= ",
    now_ms!(),
    " - $3))",
    ") RETURNING epoch"
);

/// An operator's takeover: any free, released or expired lease, whoever held
/// it. A released lease's `lease_until` is already in the past.
const TAKE_OVER_SQL: &str = concat!(
    "UPDATE leases SET holder = $2, epoch = epoch + 1, lease_until = ",
    now_ms!(),
    " + $3, released = false ",
    "WHERE user_id = $1 AND (holder IS NULL OR released OR lease_until < ",
    now_ms!(),
    ") RETURNING epoch"
);

/// Bulk renew: `$3`/`$4` are the held users and their epochs as parallel
/// arrays, so 10 000 leases are one statement with four binds. The clock is
/// read once for the whole statement (a one-row join), so every renewed
/// lease gets the same `lease_until`. Released leases are not revived:
/// release ended them on purpose.
const RENEW_SQL: &str = concat!(
    "UPDATE leases SET lease_until = clock.now + $2 ",
    "FROM (SELECT ",
    now_ms!(),
    " AS now) AS clock, ",
    "unnest($3::text[], $4::bigint[]) AS held(user_id, epoch) ",
    "WHERE leases.user_id = held.user_id AND leases.epoch = held.epoch ",
    "AND leases.holder = $1 AND NOT leases.released ",
    "RETURNING leases.user_id"
);

const RELEASE_SQL: &str = concat!(
    "UPDATE leases SET lease_until = ",
    now_ms!(),
    " - 1, released = true ",
    "WHERE user_id = $1 AND holder = $2 AND epoch = $3 AND NOT released ",
    "RETURNING user_id"
);

/// `$1`/`$2` are users and times as parallel arrays. Grouping first means a
/// user named twice gets the larger time rather than whichever row the join
/// happened to pick.
const ACTIVITY_SQL: &str = "UPDATE instances SET last_active = activity.t \
     FROM (SELECT u, max(t) AS t FROM unnest($1::text[], $2::bigint[]) AS a(u, t) GROUP BY u) \
          AS activity \
     WHERE instances.user_id = activity.u AND instances.role = 'main' \
       AND activity.t > instances.last_active";

#[async_trait]
impl Store for PgStore {
    async fn now(&self) -> Result<UnixMillis, StoreError> {
        let row = sqlx::query(concat!("SELECT ", now_ms!(), " AS now"))
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        get(&row, "now")
    }

    async fn put_instance(&self, i: &Instance) -> Result<(), StoreError> {
        // The upsert decides; the read only names the record that refused
        // it. If that record vanished in between (deleted), nothing stands
        // in the way any more and the write is tried once more.
        for _ in 0..2 {
            if self.upsert_instance(i).await? {
                return Ok(());
            }
            if let Some(current) = self.get_instance(&i.user, i.role).await? {
                return Err(StoreError::fenced(&i.user, i.epoch, &current));
            }
        }
        Err(StoreError::Query(format!(
            "the {} record of {} refused the write twice yet is not there",
            i.role, i.user
        )))
    }

    async fn get_instance(
        &self,
        user: &UserId,
        role: Role,
    ) -> Result<Option<Instance>, StoreError> {
        let row = sqlx::query(INSTANCE_GET_SQL)
            .bind(user.as_str())
            .bind(role.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        row.as_ref().map(instance_from_row).transpose()
    }

    async fn list_instances(&self, filter: &InstanceFilter) -> Result<Vec<Instance>, StoreError> {
        let rows = sqlx::query(INSTANCE_LIST_SQL)
            .bind(filter.status.map(InstanceStatus::as_str))
            .bind(filter.node.as_deref())
            .bind(filter.role.map(Role::as_str))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        rows.iter().map(instance_from_row).collect()
    }

    async fn delete_instance(&self, user: &UserId, role: Role) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM instances WHERE user_id = $1 AND role = $2")
            .bind(user.as_str())
            .bind(role.as_str())
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn delete_instance_fenced(
        &self,
        user: &UserId,
        node: &str,
        epoch: Epoch,
    ) -> Result<(), StoreError> {
        let deleted = sqlx::query(INSTANCE_DELETE_FENCED_SQL)
            .bind(user.as_str())
            .bind(node)
            .bind(epoch)
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?
            .rows_affected();
        if deleted > 0 {
            return Ok(());
        }
        // Nothing deleted: either there is no record (fine) or it belongs
        // to a newer lease, which the read names.
        match self.get_instance(user, Role::Main).await? {
            Some(current) => Err(StoreError::fenced(user, epoch, &current)),
            None => Ok(()),
        }
    }

    async fn record_activity(&self, activity: &[(UserId, UnixMillis)]) -> Result<(), StoreError> {
        if activity.is_empty() {
            return Ok(());
        }
        let (users, times): (Vec<&str>, Vec<UnixMillis>) =
            activity.iter().map(|(u, t)| (u.as_str(), *t)).unzip();
        sqlx::query(ACTIVITY_SQL)
            .bind(users)
            .bind(times)
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn claim_lease(
        &self,
        user: &UserId,
        node: &str,
        ttl: Duration,
        takeover: TakeoverPolicy,
    ) -> Result<ClaimOutcome, StoreError> {
        let evidence = takeover == TakeoverPolicy::Evidence;
        self.conditional_claim(CLAIM_SQL, user, node, ttl, Some(evidence))
            .await
    }

    async fn take_over_lease(
        &self,
        user: &UserId,
        node: &str,
        ttl: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        self.conditional_claim(TAKE_OVER_SQL, user, node, ttl, None)
            .await
    }

    async fn renew_leases(
        &self,
        node: &str,
        held: &[(UserId, Epoch)],
        ttl: Duration,
    ) -> Result<Vec<UserId>, StoreError> {
        if held.is_empty() {
            return Ok(Vec::new());
        }
        let (users, epochs): (Vec<&str>, Vec<Epoch>) =
            held.iter().map(|(u, e)| (u.as_str(), *e)).unzip();
        let rows = sqlx::query(RENEW_SQL)
            .bind(node)
            .bind(ttl_ms(ttl))
            .bind(users)
            .bind(epochs)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        rows.iter()
            .map(|row| parse_user(get(row, "user_id")?))
            .collect()
    }

    async fn release_lease(
        &self,
        user: &UserId,
        node: &str,
        epoch: Epoch,
    ) -> Result<bool, StoreError> {
        let row = sqlx::query(RELEASE_SQL)
            .bind(user.as_str())
            .bind(node)
            .bind(epoch)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(row.is_some())
    }

    async fn get_lease(&self, user: &UserId) -> Result<Option<LeaseRecord>, StoreError> {
        let row = sqlx::query(LEASE_GET_SQL)
            .bind(user.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        row.as_ref().map(lease_from_row).transpose()
    }

    async fn list_leases(
        &self,
        expired_only: bool,
        ttl: Duration,
    ) -> Result<Vec<LeaseRecord>, StoreError> {
        let rows = sqlx::query(LEASE_LIST_SQL)
            .bind(expired_only)
            .bind(ttl_ms(ttl))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        rows.iter().map(lease_from_row).collect()
    }

    async fn leases_held_by(&self, node: &str) -> Result<Vec<LeaseRecord>, StoreError> {
        let rows = sqlx::query(LEASE_HELD_SQL)
            .bind(node)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        rows.iter().map(lease_from_row).collect()
    }

    async fn put_launch_params(
        &self,
        user: &UserId,
        folder: &str,
        patch: Option<&str>,
    ) -> Result<(), StoreError> {
        check_patch_size(user, patch)?;
        sqlx::query(concat!(
            "INSERT INTO launch_params (user_id, folder, patch, updated_at) VALUES ($1, $2, $3, ",
            now_ms!(),
            ") ON CONFLICT (user_id) DO UPDATE SET folder = excluded.folder, ",
            "patch = excluded.patch, updated_at = excluded.updated_at"
        ))
        .bind(user.as_str())
        .bind(folder)
        .bind(patch)
        .execute(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn get_launch_params(&self, user: &UserId) -> Result<Option<LaunchParams>, StoreError> {
        let row = sqlx::query("SELECT folder, patch FROM launch_params WHERE user_id = $1")
            .bind(user.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        row.map(|row| {
            Ok(LaunchParams {
                folder: get(&row, "folder")?,
                patch: get(&row, "patch")?,
            })
        })
        .transpose()
    }

    async fn load_crash_state(&self, user: &UserId) -> Result<CrashState, StoreError> {
        let row = sqlx::query("SELECT state FROM crash_state WHERE user_id = $1")
            .bind(user.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        match row {
            None => Ok(CrashState::default()),
            Some(row) => {
                let json: String = get(&row, "state")?;
                serde_json::from_str(&json)
                    .map_err(|e| StoreError::Corrupt(format!("crash state of {user}: {e}")))
            }
        }
    }

    async fn save_crash_state(&self, user: &UserId, state: &CrashState) -> Result<(), StoreError> {
        if state.is_clear() {
            sqlx::query("DELETE FROM crash_state WHERE user_id = $1")
                .bind(user.as_str())
                .execute(&self.pool)
                .await
                .map_err(|e| self.err(e))?;
            return Ok(());
        }
        let json = serde_json::to_string(state).map_err(|e| StoreError::Query(e.to_string()))?;
        sqlx::query(
            "INSERT INTO crash_state (user_id, state) VALUES ($1, $2) \
             ON CONFLICT (user_id) DO UPDATE SET state = excluded.state",
        )
        .bind(user.as_str())
        .bind(json)
        .execute(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn put_token(&self, user: &UserId, token_hash: &str) -> Result<(), StoreError> {
        sqlx::query(concat!(
            "INSERT INTO tokens (token_hash, user_id, created_at) VALUES ($1, $2, ",
            now_ms!(),
            ") ON CONFLICT (token_hash) DO UPDATE SET user_id = excluded.user_id"
        ))
        .bind(token_hash)
        .bind(user.as_str())
        .execute(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn user_for_token(&self, token_hash: &str) -> Result<Option<UserId>, StoreError> {
        let row = sqlx::query("SELECT user_id FROM tokens WHERE token_hash = $1")
            .bind(token_hash)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        row.map(|row| parse_user(get(&row, "user_id")?)).transpose()
    }

    async fn user_slug(&self, user: &UserId) -> Result<Option<Slug>, StoreError> {
        let row = sqlx::query("SELECT slug FROM users WHERE user_id = $1")
            .bind(user.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        row.map(|row| parse_slug(get(&row, "slug")?)).transpose()
    }

    async fn record_user_slug(&self, user: &UserId, slug: &Slug) -> Result<Slug, StoreError> {
        if let Some(recorded) = self.user_slug(user).await? {
            return Ok(recorded);
        }
        // A concurrent first record for the same user makes this insert do
        // nothing (and the read below returns theirs); one for the same
        // slug by another user fails on the slug's unique constraint.
        let inserted = sqlx::query(concat!(
            "INSERT INTO users (user_id, slug, created_at) VALUES ($1, $2, ",
            now_ms!(),
            ") ON CONFLICT (user_id) DO NOTHING RETURNING slug"
        ))
        .bind(user.as_str())
        .bind(slug.as_str())
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| slug_taken(&e, user, slug).unwrap_or_else(|| self.err(e)))?;
        if inserted.is_some() {
            return Ok(slug.clone());
        }
        self.user_slug(user).await?.ok_or_else(|| {
            StoreError::Query(format!(
                "the slug of {user} was recorded concurrently but cannot be read back"
            ))
        })
    }

    async fn heartbeat(&self, node: &NodeRecord) -> Result<(), StoreError> {
        sqlx::query(concat!(
            "INSERT INTO nodes (id, advertise_url, capacity, load, status, heartbeat) ",
            "VALUES ($1, $2, $3, $4, $5, ",
            now_ms!(),
            ") ON CONFLICT (id) DO UPDATE SET advertise_url = excluded.advertise_url, ",
            "capacity = excluded.capacity, load = excluded.load, status = excluded.status, ",
            "heartbeat = excluded.heartbeat"
        ))
        .bind(&node.id)
        .bind(&node.advertise_url)
        .bind(i64::from(node.capacity))
        .bind(i64::from(node.load))
        .bind(node_status_str(node.status))
        .execute(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn list_nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, advertise_url, capacity, load, status, heartbeat FROM nodes ORDER BY id",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        rows.iter().map(node_from_row).collect()
    }
}

#[cfg(test)]
mod tests {
    use sqlx::Row;

    use super::*;

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
        let mut tx = store.pool.begin().await.unwrap();
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
        let alice = UserId::parse("alice").unwrap();
        store.put_token(&alice, "h").await.unwrap();
        store.close().await;
        let store = PgStore::open(&url).await.unwrap();
        assert_eq!(store.user_for_token("h").await.unwrap(), Some(alice));
        let versions: Vec<i64> =
            sqlx::query_scalar("SELECT version FROM _sqlx_migrations ORDER BY version")
                .fetch_all(&store.pool)
                .await
                .unwrap();
        let embedded: Vec<i64> = MIGRATIONS.iter().map(|m| m.0).collect();
        assert_eq!(versions, embedded);
        assert_eq!(versions[..3], [1, 2, 3]);
    }
}
