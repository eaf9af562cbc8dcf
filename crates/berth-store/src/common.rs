//! What the SQLite and PostgreSQL backends share outside their SQL: the
//! embedded-migration source, the TTL bound, and the conversions between
//! stored integers and the model's types. The SQL text itself stays with
//! each backend (placeholder styles and clocks differ).

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use berth_core::UserId;
use sqlx::migrate::{Migration, MigrationSource, MigrationType};

use crate::StoreError;

/// Cap on a TTL handed to SQL, so `now + ttl` can overflow neither SQLite's
/// integers (which would silently turn into a float) nor a BIGINT. Ten
/// years.
pub(crate) const MAX_TTL_MS: i64 = 10 * 365 * 24 * 3600 * 1000;

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

pub(crate) fn widen<T: TryInto<i64> + Copy + std::fmt::Display>(
    value: T,
    what: &str,
) -> Result<i64, StoreError> {
    value
        .try_into()
        .map_err(|_| StoreError::Query(format!("{what} {value} does not fit the store")))
}
