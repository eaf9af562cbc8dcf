//! From rows to records, and the conversions around them: the mapping of
//! either backend's result rows onto records, the conversions between
//! stored integers and the model's types, the TTL bound, and the
//! embedded-migration source each backend feeds its schema through.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use berth_core::runtime::RuntimeRef;
use berth_core::{Instance, Slug, UserId};
use sqlx::migrate::{Migration, MigrationSource, MigrationType};
use sqlx::{ColumnIndex, Decode, Row, Type};

use crate::{
    LeaseRecord, MintOutcome, NodeRecord, NodeStatus, StoreError, TokenOwner, TokenRecord,
};

/// Cap on a TTL handed to SQL, so `now + ttl` can overflow neither SQLite's
/// integers (which would silently turn into a float) nor a BIGINT. Ten
/// years.
pub(crate) const MAX_TTL_MS: i64 = 10 * 365 * 24 * 3600 * 1000;

/// Every schema version of the backend whose migrations live in
/// `migrations/<dir>/`, as `(version, description, sql)`, embedded so a
/// deployed binary needs no files beside it. One list for both backends: a
/// version cannot be added to one and forgotten in the other, since each
/// file must exist in both directories.
macro_rules! embedded_migrations {
    ($dir:literal) => {
        &[
            (1, "init", embedded_migrations!(@file $dir, "0001_init.sql")),
            (2, "launch_params", embedded_migrations!(@file $dir, "0002_launch_params.sql")),
            (3, "users", embedded_migrations!(@file $dir, "0003_users.sql")),
            (4, "accounts", embedded_migrations!(@file $dir, "0004_accounts.sql")),
            (5, "tokens", embedded_migrations!(@file $dir, "0005_tokens.sql")),
            (6, "runtime_ref", embedded_migrations!(@file $dir, "0006_runtime_ref.sql")),
            (7, "node_identity", embedded_migrations!(@file $dir, "0007_node_identity.sql")),
            (8, "hibernated", embedded_migrations!(@file $dir, "0008_hibernated.sql")),
            (9, "internal_url", embedded_migrations!(@file $dir, "0009_internal_url.sql")),
            (10, "placements", embedded_migrations!(@file $dir, "0010_placements.sql")),
            (11, "logins", embedded_migrations!(@file $dir, "0011_logins.sql")),
            (12, "user_egress", embedded_migrations!(@file $dir, "0012_user_egress.sql")),
        ]
    };
    (@file $dir:literal, $name:literal) => {
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/", $dir, "/", $name))
    };
}
pub(crate) use embedded_migrations;

/// A backend's schema, embedded so a deployed binary needs no files beside
/// it: `(version, description, sql)`. Fed to sqlx's `Migrator`, which
/// records applied versions and checksums in `_sqlx_migrations`.
#[derive(Debug)]
pub(crate) struct EmbeddedMigrations(pub(crate) &'static [(i64, &'static str, &'static str)]);

impl MigrationSource<'static> for EmbeddedMigrations {
    fn resolve(
        self,
    ) -> Pin<
        Box<dyn Future<Output = Result<Vec<Migration>, sqlx::error::BoxDynError>> + Send + 'static>,
    > {
        Box::pin(async move {
            Ok(self
                .0
                .iter()
                .map(|&(version, description, sql)| {
                    Migration::new(
                        version,
                        Cow::Borrowed(description),
                        MigrationType::Simple,
                        Cow::Borrowed(sql),
                        false,
                    )
                })
                .collect())
        })
    }
}

pub(crate) fn ttl_ms(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis()).map_or(MAX_TTL_MS, |ms| ms.min(MAX_TTL_MS))
}

pub(crate) fn parse_user(raw: String) -> Result<UserId, StoreError> {
    UserId::parse(&raw).map_err(|e| StoreError::Corrupt(format!("user id {raw:?}: {e}")))
}

pub(crate) fn parse_egress(raw: &str) -> Result<berth_core::egress::EgressPolicy, StoreError> {
    serde_json::from_str(raw).map_err(|e| StoreError::Corrupt(format!("user_egress.policy: {e}")))
}

pub(crate) fn parse_slug(raw: String) -> Result<Slug, StoreError> {
    Slug::parse(&raw).map_err(|e| StoreError::Corrupt(format!("users.slug: {e}")))
}

/// The error of an insert into `users` that a unique constraint refused.
/// The insert names `user_id` as its conflict target (a second insert for
/// one user does nothing), so a violation left over is the slug's.
pub(crate) fn slug_taken(e: &sqlx::Error, user: &UserId, slug: &Slug) -> Option<StoreError> {
    match e {
        sqlx::Error::Database(db) if db.kind() == sqlx::error::ErrorKind::UniqueViolation => {
            Some(StoreError::SlugTaken {
                user: user.clone(),
                slug: slug.as_str().to_owned(),
            })
        }
        _ => None,
    }
}

pub(crate) fn narrow<T: TryFrom<i64>>(value: i64, column: &str) -> Result<T, StoreError> {
    T::try_from(value)
        .map_err(|_| StoreError::Corrupt(format!("column {column}: {value} is out of range")))
}

pub(crate) fn narrow_opt<T: TryFrom<i64>>(
    value: Option<i64>,
    column: &str,
) -> Result<Option<T>, StoreError> {
    value.map(|v| narrow(v, column)).transpose()
}

/// One column of a result row, decoded as `T`: what the row mappers below
/// need of either backend's rows.
pub(crate) trait Column<T> {
    fn column(&self, name: &str) -> Result<T, StoreError>;
}

impl<R, T> Column<T> for R
where
    R: Row,
    T: for<'r> Decode<'r, R::Database> + Type<R::Database>,
    for<'n> &'n str: ColumnIndex<R>,
{
    fn column(&self, name: &str) -> Result<T, StoreError> {
        self.try_get(name)
            .map_err(|e| StoreError::Corrupt(format!("column {name}: {e}")))
    }
}

/// A row with every column type berth's records are made of.
pub(crate) trait RecordRow:
    Column<String>
    + Column<Option<String>>
    + Column<i64>
    + Column<Option<i64>>
    + Column<bool>
    + Column<Option<bool>>
{
}

impl<R> RecordRow for R where
    R: Column<String>
        + Column<Option<String>>
        + Column<i64>
        + Column<Option<i64>>
        + Column<bool>
        + Column<Option<bool>>
{
}

/// Column `name` of `row`, decoded as `T`.
pub(crate) fn get<R: Column<T>, T>(row: &R, name: &str) -> Result<T, StoreError> {
    row.column(name)
}

/// An instance record from a row of the backend's `instance_columns!`.
pub(crate) fn instance_from_row<R: RecordRow>(row: &R) -> Result<Instance, StoreError> {
    let role: String = get(row, "role")?;
    let status: String = get(row, "status")?;
    Ok(Instance {
        id: get(row, "id")?,
        user: parse_user(get(row, "user_id")?)?,
        role: role.parse().map_err(StoreError::Corrupt)?,
        status: status.parse().map_err(StoreError::Corrupt)?,
        node: get(row, "node")?,
        epoch: get(row, "epoch")?,
        port: narrow_opt(get(row, "port")?, "port")?,
        pid: narrow_opt(get(row, "pid")?, "pid")?,
        folder: get(row, "folder")?,
        started_at: get(row, "started_at")?,
        ready: get(row, "ready")?,
        restarts: narrow(get(row, "restarts")?, "restarts")?,
        last_error: get(row, "last_error")?,
        exit_code: narrow_opt(get(row, "exit_code")?, "exit_code")?,
        last_active: get(row, "last_active")?,
        runtime_ref: Option::<String>::map(get(row, "runtime_ref")?, RuntimeRef::new),
        hibernated_at: get(row, "hibernated_at")?,
    })
}

/// A lease record from a row of the backend's `lease_columns!` plus
/// `holder_alive`.
pub(crate) fn lease_from_row<R: RecordRow>(row: &R) -> Result<LeaseRecord, StoreError> {
    Ok(LeaseRecord {
        user: parse_user(get(row, "user_id")?)?,
        holder: get(row, "holder")?,
        epoch: get(row, "epoch")?,
        lease_until: get(row, "lease_until")?,
        released: get(row, "released")?,
        expired: get(row, "expired")?,
        holder_alive: get(row, "holder_alive")?,
    })
}

/// How a node's status is stored.
pub(crate) fn node_status_str(status: NodeStatus) -> &'static str {
    status.as_str()
}

/// A node record from a row of the `nodes` table.
pub(crate) fn node_from_row<R: RecordRow>(row: &R) -> Result<NodeRecord, StoreError> {
    let status: String = get(row, "status")?;
    let status = match status.as_str() {
        "up" => NodeStatus::Up,
        "draining" => NodeStatus::Draining,
        "down" => NodeStatus::Down,
        other => {
            return Err(StoreError::Corrupt(format!(
                "unknown node status {other:?}"
            )));
        }
    };
    Ok(NodeRecord {
        id: get(row, "id")?,
        advertise_url: get(row, "advertise_url")?,
        internal_url: get(row, "internal_url")?,
        capacity: narrow(get(row, "capacity")?, "capacity")?,
        load: narrow(get(row, "load")?, "load")?,
        status,
        heartbeat: get(row, "heartbeat")?,
    })
}

/// A token record from a row of `id, user_id, created_at, expires_at,
/// last_used_at, parent_id`.
pub(crate) fn token_from_row<R: RecordRow>(row: &R) -> Result<TokenRecord, StoreError> {
    Ok(TokenRecord {
        id: get(row, "id")?,
        user: parse_user(get(row, "user_id")?)?,
        created_at: get(row, "created_at")?,
        expires_at: get(row, "expires_at")?,
        last_used_at: get(row, "last_used_at")?,
        parent: get(row, "parent_id")?,
    })
}

/// A token's owner from a row of `user_id, id, expires_at, now`.
pub(crate) fn token_owner_from_row<R: RecordRow>(row: &R) -> Result<TokenOwner, StoreError> {
    Ok(TokenOwner {
        user: parse_user(get(row, "user_id")?)?,
        id: get(row, "id")?,
        expires_at: get(row, "expires_at")?,
        now: get(row, "now")?,
    })
}

/// Why a mint that inserted nothing was refused, given the user's live
/// token count read in the same transaction: the cap, else a parent that
/// is gone.
pub(crate) fn refused_mint(live: i64, max_live: u32) -> Result<MintOutcome, StoreError> {
    let live: u32 = narrow(live, "count")?;
    Ok(if live >= max_live {
        MintOutcome::TooMany { live }
    } else {
        MintOutcome::ParentGone
    })
}
