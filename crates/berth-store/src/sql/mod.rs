//! The one [`Store`](crate::Store) implementation over SQL, shared by the
//! SQLite and PostgreSQL backends.
//!
//! What the two backends have in common is written once here: the logic of
//! every store operation (`store.rs`), the text of every statement they run
//! alike (`statements.rs`), the mapping of rows onto records and the
//! conversions of stored integers (`rows.rs`), and the sqlx plumbing that
//! binds and runs a statement on either database (`driver.rs`).
//!
//! What differs is explicit, in two small traits each backend implements:
//!
//! * [`Dialect`], on sqlx's database type: the store's clock as SQL, the two
//!   bulk statements (renew, activity) whose lists SQLite takes as one JSON
//!   object and PostgreSQL as parallel arrays, and the locks that make mints
//!   of one user, and placements, take turns where the database does not
//!   serialise writers;
//! * [`SqlBackend`], on the store type: its connection pool and how it
//!   reports a database error (PostgreSQL names its server).
//!
//! Everything else about a backend (opening, migrating, checking the
//! database) stays in `sqlite.rs` and `postgres.rs`.

mod driver;
pub(crate) mod rows;
mod statements;
mod store;
#[cfg(test)]
pub(crate) mod test_support;

use std::fmt;
use std::sync::Arc;

use sqlx::{Database, Pool};

use crate::StoreError;

pub(crate) use driver::Query;
pub(crate) use rows::RecordRow;
pub(crate) use statements::Statements;

/// How one database spells what the shared statements cannot: implemented
/// on sqlx's database type (`Sqlite`, `Postgres`).
pub(crate) trait Dialect: Database<Row: RecordRow> {
    /// The store's clock in Unix milliseconds, as an SQL expression.
    const NOW_MS: &'static str;

    /// Extends the leases of `$1` (the node) by `$2` (milliseconds) that it
    /// holds at the epochs given by [`Dialect::bind_pairs`] (user, epoch),
    /// returning the `user_id` of each lease extended. Released leases are
    /// not revived: release ended them on purpose.
    const RENEW: &'static str;

    /// Raises `last_active` of the users' mains to the times given by
    /// [`Dialect::bind_pairs`] (user, time), the larger one for a user
    /// named twice.
    const ACTIVITY: &'static str;

    /// Run first in a mint's transaction, with the user bound as `$1`, so
    /// that mints of one user take turns across nodes; `None` where the
    /// database already serialises the transaction's writes.
    const LOCK_USER_TOKENS: Option<&'static str>;

    /// Run first in a placement's transaction, so that placements take
    /// turns across nodes and each counts the places the ones before it
    /// reserved; `None` where the database already serialises the
    /// transaction's writes.
    const LOCK_PLACEMENTS: Option<&'static str>;

    /// Binds a list of (text, integer) pairs as the next argument(s) of
    /// [`Dialect::RENEW`] and [`Dialect::ACTIVITY`]: one bind however long
    /// the list, so one statement covers every lease a node holds.
    fn bind_pairs<'q>(
        query: Query<'q, Self>,
        pairs: Vec<(&'q str, i64)>,
    ) -> Result<Query<'q, Self>, StoreError>;

    /// How many rows a statement wrote.
    fn rows_affected(done: &Self::QueryResult) -> u64;
}

/// A backend's connection pool and the shared statements in its dialect,
/// made together so that no backend runs one without the other.
pub(crate) struct SqlDb<DB: Dialect> {
    pub(crate) pool: Pool<DB>,
    sql: Arc<Statements>,
}

impl<DB: Dialect> SqlDb<DB> {
    pub(crate) fn new(pool: Pool<DB>) -> Self {
        Self {
            pool,
            sql: Arc::new(Statements::with_clock(DB::NOW_MS)),
        }
    }
}

impl<DB: Dialect> Clone for SqlDb<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            sql: Arc::clone(&self.sql),
        }
    }
}

impl<DB: Dialect> fmt::Debug for SqlDb<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlDb")
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

/// A store over one SQL database: what the shared implementation needs of
/// [`SqliteStore`](crate::SqliteStore) and [`PgStore`](crate::PgStore).
/// Every type with this trait is a [`Store`](crate::Store).
pub(crate) trait SqlBackend: Send + Sync + 'static {
    type Db: driver::Driver;

    fn db(&self) -> &SqlDb<Self::Db>;

    /// Maps a sqlx error onto the store's error kinds.
    fn err(&self, e: sqlx::Error) -> StoreError;

    fn pool(&self) -> &Pool<Self::Db> {
        &self.db().pool
    }

    /// The shared statements, in this backend's dialect.
    fn sql(&self) -> &Statements {
        &self.db().sql
    }

    /// A statement to run on the pool.
    fn stmt<'a>(&'a self, sql: &'a str) -> driver::Stmt<'a, Self>
    where
        Self: Sized,
    {
        driver::Stmt::new(self, driver::On::Pool(self.pool()), sql)
    }
}
