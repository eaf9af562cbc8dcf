//! SQLite backend: the embedded single-node store.
//!
//! One database file in WAL mode behind a small connection pool. Every lease
//! decision is one conditional statement whose time comparisons use SQLite's
//! own clock (see [`now_ms!`]), and success is judged by whether a row came
//! back.

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use berth_core::policy::CrashState;
use berth_core::{Epoch, Instance, InstanceStatus, Role, Slug, UnixMillis, UserId};
use sqlx::migrate::Migrator;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use crate::common::{
    EmbeddedMigrations, get, instance_from_row, lease_from_row, node_from_row, node_status_str,
    parse_slug, parse_user, slug_taken, ttl_ms, widen,
};
use crate::{
    ClaimOutcome, InstanceFilter, LaunchParams, LeaseRecord, NodeRecord, Store, StoreError,
    TakeoverPolicy, check_patch_size,
};

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
static MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "init",
        include_str!("../migrations/sqlite/0001_init.sql"),
    ),
    (
        2,
        "launch_params",
        include_str!("../migrations/sqlite/0002_launch_params.sql"),
    ),
    (
        3,
        "users",
        include_str!("../migrations/sqlite/0003_users.sql"),
    ),
];

/// The embedded single-node store.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
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
        Ok(Self { pool })
    }

    /// Closes the pool, waiting for connections in use to come back.
    pub async fn close(&self) {
        self.pool.close().await;
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
                _ => db_err(e),
            })
    }

    /// One conditional claim statement (`sql` binds user, node, ttl and,
    /// for an ordinary claim, whether evidence allows a takeover), judged by
    /// whether a row came back.
    async fn conditional_claim(
        &self,
        sql: &'static str,
        user: &UserId,
        node: &str,
        ttl: Duration,
        evidence: Option<i64>,
    ) -> Result<ClaimOutcome, StoreError> {
        self.ensure_lease_row(user).await?;
        let mut query = sqlx::query(sql)
            .bind(user.as_str())
            .bind(node)
            .bind(ttl_ms(ttl));
        if let Some(evidence) = evidence {
            query = query.bind(evidence);
        }
        let row = query.fetch_optional(&self.pool).await.map_err(db_err)?;
        match row {
            Some(row) => Ok(ClaimOutcome::Claimed {
                epoch: get(&row, "epoch")?,
            }),
            None => self.busy_report(user).await,
        }
    }

    async fn ensure_lease_row(&self, user: &UserId) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO leases (user_id) VALUES (?1) ON CONFLICT (user_id) DO NOTHING")
            .bind(user.as_str())
            .execute(&self.pool)
            .await
            .map_err(db_err)?;
        Ok(())
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

macro_rules! instance_columns {
    () => {
        "user_id, role, id, status, node, epoch, port, pid, pid_start, folder, started_at, \
         ready, restarts, last_error, exit_code, last_active"
    };
}

/// Inserts or replaces a (user, role) record. An upsert on the primary key
/// only: a clash on the live (node, port) index still fails, where
/// `INSERT OR REPLACE` would silently delete the other user's record.
///
/// A main's record is fenced: the update applies only over a record written
/// under a lower epoch, or the same epoch by the same node. A refused update
/// changes no row, which is how the caller tells.
const INSTANCE_UPSERT_SQL: &str = concat!(
    "INSERT INTO instances (",
    instance_columns!(),
    ") VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16) ",
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
     WHERE user_id = ?1 AND role = 'main' AND (epoch < ?3 OR (epoch = ?3 AND node = ?2))";

const INSTANCE_GET_SQL: &str = concat!(
    "SELECT ",
    instance_columns!(),
    " FROM instances WHERE user_id = ?1 AND role = ?2"
);

const INSTANCE_LIST_SQL: &str = concat!(
    "SELECT ",
    instance_columns!(),
    " FROM instances WHERE (?1 IS NULL OR status = ?1) AND (?2 IS NULL OR node = ?2) ",
    "AND (?3 IS NULL OR role = ?3) ORDER BY user_id, role"
);

/// The lease columns up to `holder_alive`, which each query adds. `expired`
/// is computed in SQL so it uses the store's clock.
macro_rules! lease_columns {
    () => {
        concat!(
            "SELECT user_id, holder, epoch, lease_until, released, ",
            "(holder IS NOT NULL AND released = 0 AND lease_until < ",
            now_ms!(),
            ") AS expired, "
        )
    };
}

const LEASE_GET_SQL: &str = concat!(
    lease_columns!(),
    "NULL AS holder_alive FROM leases WHERE user_id = ?1"
);

/// `?2` is the TTL that judges the holder alive: the same test as the
/// claim's evidence clause in [`CLAIM_SQL`], so "expired and holder not
/// alive" is exactly what an evidence claim with that TTL may take.
const LEASE_LIST_SQL: &str = concat!(
    lease_columns!(),
    "CASE WHEN holder IS NULL THEN NULL ELSE EXISTS (SELECT 1 FROM nodes ",
    "WHERE nodes.id = leases.holder AND nodes.heartbeat >= ",
    now_ms!(),
    " - ?2) END AS holder_alive FROM leases",
    " WHERE ?1 = 0 OR (holder IS NOT NULL AND released = 0 AND lease_until < ",
    now_ms!(),
    ") ORDER BY user_id"
);

/// Live leases only: an expired one is no longer this node's to run, even
/// if nobody has taken it yet; the node must claim it again.
const LEASE_HELD_SQL: &str = concat!(
    lease_columns!(),
    "NULL AS holder_alive FROM leases",
    " WHERE holder = ?1 AND released = 0 AND lease_until >= ",
    now_ms!(),
    " ORDER BY user_id"
);

/// The claim's conditional update. `?4` is 1 when expired leases may be
/// taken from a holder whose heartbeat is older than one TTL (or which never
/// registered a heartbeat at all).
const CLAIM_SQL: &str = concat!(
    "UPDATE leases SET holder = ?2, epoch = epoch + 1, lease_until = ",
    now_ms!(),
    " + ?3, released = 0 ",
    "WHERE user_id = ?1 AND (",
    "holder IS NULL OR holder = ?2 OR released = 1 OR (",
    "?4 = 1 AND lease_until < ",
    now_ms!(),
    " AND NOT EXISTS (SELECT 1 FROM nodes WHERE nodes.id = leases.holder AND nodes.heartbeat >= ",
    now_ms!(),
    " - ?3))",
    ") RETURNING epoch"
);

/// An operator's takeover: any free, released or expired lease, whoever held
/// it. A released lease's `lease_until` is already in the past.
const TAKE_OVER_SQL: &str = concat!(
    "UPDATE leases SET holder = ?2, epoch = epoch + 1, lease_until = ",
    now_ms!(),
    " + ?3, released = 0 ",
    "WHERE user_id = ?1 AND (holder IS NULL OR released = 1 OR lease_until < ",
    now_ms!(),
    ") RETURNING epoch"
);

/// Bulk renew. `?3` is a JSON array of `[user, epoch]` pairs: one bind
/// however many leases, and the row-value `IN` is answered from an index
/// SQLite builds over the subquery, so the cost stays O(n log n).
/// Released leases are not revived: release ended them on purpose.
const RENEW_SQL: &str = concat!(
    "UPDATE leases SET lease_until = ",
    now_ms!(),
    " + ?2 ",
    "WHERE holder = ?1 AND released = 0 AND (user_id, epoch) IN (",
    "SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each(?3)",
    ") RETURNING user_id"
);

const RELEASE_SQL: &str = concat!(
    "UPDATE leases SET lease_until = ",
    now_ms!(),
    " - 1, released = 1 ",
    "WHERE user_id = ?1 AND holder = ?2 AND epoch = ?3 AND released = 0 ",
    "RETURNING user_id"
);

/// `?1` is a JSON array of `[user, millis]` pairs. Grouping first means a
/// user named twice gets the larger time rather than whichever row the join
/// happened to pick.
const ACTIVITY_SQL: &str = "UPDATE instances SET last_active = activity.t \
     FROM (SELECT json_extract(value, '$[0]') AS u, max(json_extract(value, '$[1]')) AS t \
           FROM json_each(?1) GROUP BY u) AS activity \
     WHERE instances.user_id = activity.u AND instances.role = 'main' \
       AND activity.t > instances.last_active";

#[async_trait]
impl Store for SqliteStore {
    async fn now(&self) -> Result<UnixMillis, StoreError> {
        let row = sqlx::query(concat!("SELECT ", now_ms!(), " AS now"))
            .fetch_one(&self.pool)
            .await
            .map_err(db_err)?;
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
            .map_err(db_err)?;
        row.as_ref().map(instance_from_row).transpose()
    }

    async fn list_instances(&self, filter: &InstanceFilter) -> Result<Vec<Instance>, StoreError> {
        let rows = sqlx::query(INSTANCE_LIST_SQL)
            .bind(filter.status.map(InstanceStatus::as_str))
            .bind(filter.node.as_deref())
            .bind(filter.role.map(Role::as_str))
            .fetch_all(&self.pool)
            .await
            .map_err(db_err)?;
        rows.iter().map(instance_from_row).collect()
    }

    async fn delete_instance(&self, user: &UserId, role: Role) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM instances WHERE user_id = ?1 AND role = ?2")
            .bind(user.as_str())
            .bind(role.as_str())
            .execute(&self.pool)
            .await
            .map_err(db_err)?;
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
            .map_err(db_err)?
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
        let pairs: Vec<(&str, UnixMillis)> =
            activity.iter().map(|(u, t)| (u.as_str(), *t)).collect();
        let json = serde_json::to_string(&pairs).map_err(|e| StoreError::Query(e.to_string()))?;
        sqlx::query(ACTIVITY_SQL)
            .bind(json)
            .execute(&self.pool)
            .await
            .map_err(db_err)?;
        Ok(())
    }

    async fn claim_lease(
        &self,
        user: &UserId,
        node: &str,
        ttl: Duration,
        takeover: TakeoverPolicy,
    ) -> Result<ClaimOutcome, StoreError> {
        let evidence = i64::from(takeover == TakeoverPolicy::Evidence);
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
        let pairs: Vec<(&str, Epoch)> = held.iter().map(|(u, e)| (u.as_str(), *e)).collect();
        let json = serde_json::to_string(&pairs).map_err(|e| StoreError::Query(e.to_string()))?;
        let rows = sqlx::query(RENEW_SQL)
            .bind(node)
            .bind(ttl_ms(ttl))
            .bind(json)
            .fetch_all(&self.pool)
            .await
            .map_err(db_err)?;
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
            .map_err(db_err)?;
        Ok(row.is_some())
    }

    async fn get_lease(&self, user: &UserId) -> Result<Option<LeaseRecord>, StoreError> {
        let row = sqlx::query(LEASE_GET_SQL)
            .bind(user.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(db_err)?;
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
            .map_err(db_err)?;
        rows.iter().map(lease_from_row).collect()
    }

    async fn leases_held_by(&self, node: &str) -> Result<Vec<LeaseRecord>, StoreError> {
        let rows = sqlx::query(LEASE_HELD_SQL)
            .bind(node)
            .fetch_all(&self.pool)
            .await
            .map_err(db_err)?;
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
            "INSERT INTO launch_params (user_id, folder, patch, updated_at) VALUES (?1, ?2, ?3, ",
            now_ms!(),
            ") ON CONFLICT (user_id) DO UPDATE SET folder = excluded.folder, ",
            "patch = excluded.patch, updated_at = excluded.updated_at"
        ))
        .bind(user.as_str())
        .bind(folder)
        .bind(patch)
        .execute(&self.pool)
        .await
        .map_err(db_err)?;
        Ok(())
    }

    async fn get_launch_params(&self, user: &UserId) -> Result<Option<LaunchParams>, StoreError> {
        let row = sqlx::query("SELECT folder, patch FROM launch_params WHERE user_id = ?1")
            .bind(user.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(db_err)?;
        row.map(|row| {
            Ok(LaunchParams {
                folder: get(&row, "folder")?,
                patch: get(&row, "patch")?,
            })
        })
        .transpose()
    }

    async fn load_crash_state(&self, user: &UserId) -> Result<CrashState, StoreError> {
        let row = sqlx::query("SELECT state FROM crash_state WHERE user_id = ?1")
            .bind(user.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(db_err)?;
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
            sqlx::query("DELETE FROM crash_state WHERE user_id = ?1")
                .bind(user.as_str())
                .execute(&self.pool)
                .await
                .map_err(db_err)?;
            return Ok(());
        }
        let json = serde_json::to_string(state).map_err(|e| StoreError::Query(e.to_string()))?;
        sqlx::query(
            "INSERT INTO crash_state (user_id, state) VALUES (?1, ?2) \
             ON CONFLICT (user_id) DO UPDATE SET state = excluded.state",
        )
        .bind(user.as_str())
        .bind(json)
        .execute(&self.pool)
        .await
        .map_err(db_err)?;
        Ok(())
    }

    async fn put_token(&self, user: &UserId, token_hash: &str) -> Result<(), StoreError> {
        sqlx::query(concat!(
            "INSERT INTO tokens (token_hash, user_id, created_at) VALUES (?1, ?2, ",
            now_ms!(),
            ") ON CONFLICT (token_hash) DO UPDATE SET user_id = excluded.user_id"
        ))
        .bind(token_hash)
        .bind(user.as_str())
        .execute(&self.pool)
        .await
        .map_err(db_err)?;
        Ok(())
    }

    async fn user_for_token(&self, token_hash: &str) -> Result<Option<UserId>, StoreError> {
        let row = sqlx::query("SELECT user_id FROM tokens WHERE token_hash = ?1")
            .bind(token_hash)
            .fetch_optional(&self.pool)
            .await
            .map_err(db_err)?;
        row.map(|row| parse_user(get(&row, "user_id")?)).transpose()
    }

    async fn user_slug(&self, user: &UserId) -> Result<Option<Slug>, StoreError> {
        let row = sqlx::query("SELECT slug FROM users WHERE user_id = ?1")
            .bind(user.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(db_err)?;
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
            "INSERT INTO users (user_id, slug, created_at) VALUES (?1, ?2, ",
            now_ms!(),
            ") ON CONFLICT (user_id) DO NOTHING RETURNING slug"
        ))
        .bind(user.as_str())
        .bind(slug.as_str())
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| slug_taken(&e, user, slug).unwrap_or_else(|| db_err(e)))?;
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
            "VALUES (?1, ?2, ?3, ?4, ?5, ",
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
        .map_err(db_err)?;
        Ok(())
    }

    async fn list_nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, advertise_url, capacity, load, status, heartbeat FROM nodes ORDER BY id",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(db_err)?;
        rows.iter().map(node_from_row).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

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
            .fetch_one(&store.pool)
            .await
            .unwrap();
        assert_eq!(mode, "wal");
        let fk: i64 = sqlx::query_scalar("PRAGMA foreign_keys")
            .fetch_one(&store.pool)
            .await
            .unwrap();
        assert_eq!(fk, 1);
        let busy: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
            .fetch_one(&store.pool)
            .await
            .unwrap();
        assert!(busy >= 1000, "{busy}");
        store
            .put_token(&UserId::parse("alice").unwrap(), "h")
            .await
            .unwrap();
        store.close().await;

        // Migrations are recorded, so opening again neither fails nor loses data.
        let store = SqliteStore::open(&url).await.unwrap();
        assert_eq!(
            store.user_for_token("h").await.unwrap(),
            Some(UserId::parse("alice").unwrap())
        );
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

    #[tokio::test]
    async fn in_memory_store_works() {
        let store = SqliteStore::open("sqlite::memory:").await.unwrap();
        let alice = UserId::parse("alice").unwrap();
        let outcome = store
            .claim_lease(
                &alice,
                "n",
                Duration::from_secs(30),
                TakeoverPolicy::Evidence,
            )
            .await
            .unwrap();
        assert_eq!(outcome, ClaimOutcome::Claimed { epoch: 1 });
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
        .execute(&store.pool)
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
                    .execute(&store.pool)
                    .await;
            assert!(result.is_err(), "{bad:?} was accepted");
        }
        let longest = "a".repeat(43);
        sqlx::query("INSERT INTO users (user_id, slug, created_at) VALUES ('u', ?1, 0)")
            .bind(&longest)
            .execute(&store.pool)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn out_of_range_pid_start_is_refused_not_wrapped() {
        let store = SqliteStore::open("sqlite::memory:").await.unwrap();
        let instance = Instance {
            id: "i".into(),
            user: UserId::parse("alice").unwrap(),
            role: Role::Main,
            status: InstanceStatus::Running,
            node: "n".into(),
            epoch: 1,
            port: None,
            pid: None,
            pid_start: Some(u64::MAX),
            folder: String::new(),
            started_at: 0,
            ready: true,
            restarts: 0,
            last_error: None,
            exit_code: None,
            last_active: 0,
        };
        assert!(matches!(
            store.put_instance(&instance).await,
            Err(StoreError::Query(_))
        ));
    }
}
