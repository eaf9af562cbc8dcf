//! Binding and running a statement on either database. The shared store
//! logic is written against [`Stmt`] and [`Tx`]; sqlx's generic bounds
//! are stated once, on the blanket [`Driver`] impl, instead of on every
//! function that runs a statement.

use std::future::Future;
use std::pin::Pin;

use sqlx::database::HasStatementCache;
use sqlx::pool::PoolConnection;
use sqlx::{Database, Encode, Executor, IntoArguments, Pool, Transaction, Type};

use super::{Dialect, SqlBackend};
use crate::StoreError;

/// A statement with its arguments bound so far.
pub(crate) type Query<'q, DB> = sqlx::query::Query<'q, DB, <DB as Database>::Arguments<'q>>;

/// A row of a backend's database.
pub(crate) type Row<B> = <<B as SqlBackend>::Db as Database>::Row;

type BoxFuture<'e, T> = Pin<Box<dyn Future<Output = T> + Send + 'e>>;

/// Where a statement runs.
pub(crate) enum On<'e, DB: Database> {
    /// On a connection taken from the pool when the statement runs.
    Pool(&'e Pool<DB>),
    /// On the connection of an open transaction.
    Transaction(&'e mut DB::Connection),
}

impl<'e, DB: Database> On<'e, DB> {
    async fn connection(self) -> Result<Conn<'e, DB>, sqlx::Error> {
        Ok(match self {
            On::Pool(pool) => Conn::Pooled(pool.acquire().await?),
            On::Transaction(conn) => Conn::Borrowed(conn),
        })
    }
}

/// A connection to run one statement on: what a pool's own executor does
/// (take a connection, run, give it back), or a transaction's.
enum Conn<'e, DB: Database> {
    Pooled(PoolConnection<DB>),
    Borrowed(&'e mut DB::Connection),
}

impl<DB: Database> Conn<'_, DB> {
    fn get(&mut self) -> &mut DB::Connection {
        match self {
            Conn::Pooled(conn) => conn,
            Conn::Borrowed(conn) => conn,
        }
    }
}

/// A [`Dialect`] whose sqlx driver binds berth's argument types and runs
/// statements. Every dialect is one, through the blanket impl below; shared
/// code then needs only `B::Db: Driver`.
pub(crate) trait Driver: Dialect + HasStatementCache {
    fn bind_text<'q>(query: Query<'q, Self>, value: Option<&'q str>) -> Query<'q, Self>;
    fn bind_int<'q>(query: Query<'q, Self>, value: Option<i64>) -> Query<'q, Self>;
    fn bind_bool<'q>(query: Query<'q, Self>, value: bool) -> Query<'q, Self>;

    fn fetch_optional<'e, 'q: 'e>(
        query: Query<'q, Self>,
        conn: &'e mut Self::Connection,
    ) -> BoxFuture<'e, Result<Option<Self::Row>, sqlx::Error>>;
    fn fetch_all<'e, 'q: 'e>(
        query: Query<'q, Self>,
        conn: &'e mut Self::Connection,
    ) -> BoxFuture<'e, Result<Vec<Self::Row>, sqlx::Error>>;
    fn execute<'e, 'q: 'e>(
        query: Query<'q, Self>,
        conn: &'e mut Self::Connection,
    ) -> BoxFuture<'e, Result<Self::QueryResult, sqlx::Error>>;
}

impl<DB> Driver for DB
where
    DB: Dialect + HasStatementCache,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    for<'q> Option<&'q str>: Encode<'q, DB> + Type<DB>,
    for<'q> Option<i64>: Encode<'q, DB> + Type<DB>,
    for<'q> bool: Encode<'q, DB> + Type<DB>,
{
    fn bind_text<'q>(query: Query<'q, Self>, value: Option<&'q str>) -> Query<'q, Self> {
        query.bind(value)
    }

    fn bind_int<'q>(query: Query<'q, Self>, value: Option<i64>) -> Query<'q, Self> {
        query.bind(value)
    }

    fn bind_bool<'q>(query: Query<'q, Self>, value: bool) -> Query<'q, Self> {
        query.bind(value)
    }

    fn fetch_optional<'e, 'q: 'e>(
        query: Query<'q, Self>,
        conn: &'e mut Self::Connection,
    ) -> BoxFuture<'e, Result<Option<Self::Row>, sqlx::Error>> {
        conn.fetch_optional(query)
    }

    fn fetch_all<'e, 'q: 'e>(
        query: Query<'q, Self>,
        conn: &'e mut Self::Connection,
    ) -> BoxFuture<'e, Result<Vec<Self::Row>, sqlx::Error>> {
        conn.fetch_all(query)
    }

    fn execute<'e, 'q: 'e>(
        query: Query<'q, Self>,
        conn: &'e mut Self::Connection,
    ) -> BoxFuture<'e, Result<Self::QueryResult, sqlx::Error>> {
        conn.execute(query)
    }
}

/// A value the store binds: text, an integer or a boolean.
pub(crate) trait Param<'q> {
    fn bind_to<DB: Driver>(self, query: Query<'q, DB>) -> Query<'q, DB>;
}

impl<'q> Param<'q> for &'q str {
    fn bind_to<DB: Driver>(self, query: Query<'q, DB>) -> Query<'q, DB> {
        DB::bind_text(query, Some(self))
    }
}

impl<'q> Param<'q> for &'q String {
    fn bind_to<DB: Driver>(self, query: Query<'q, DB>) -> Query<'q, DB> {
        DB::bind_text(query, Some(self))
    }
}

impl<'q> Param<'q> for Option<&'q str> {
    fn bind_to<DB: Driver>(self, query: Query<'q, DB>) -> Query<'q, DB> {
        DB::bind_text(query, self)
    }
}

impl Param<'_> for i64 {
    fn bind_to<DB: Driver>(self, query: Query<'_, DB>) -> Query<'_, DB> {
        DB::bind_int(query, Some(self))
    }
}

impl Param<'_> for Option<i64> {
    fn bind_to<DB: Driver>(self, query: Query<'_, DB>) -> Query<'_, DB> {
        DB::bind_int(query, self)
    }
}

impl Param<'_> for bool {
    fn bind_to<DB: Driver>(self, query: Query<'_, DB>) -> Query<'_, DB> {
        DB::bind_bool(query, self)
    }
}

/// A statement being bound; it runs where it was made (the pool, or a
/// transaction), and its errors are the backend's.
pub(crate) struct Stmt<'a, B: SqlBackend> {
    backend: &'a B,
    on: On<'a, B::Db>,
    query: Query<'a, B::Db>,
}

impl<'a, B: SqlBackend> Stmt<'a, B> {
    pub(crate) fn new(backend: &'a B, on: On<'a, B::Db>, sql: &'a str) -> Self {
        Self {
            backend,
            on,
            query: sqlx::query(sql),
        }
    }

    /// Binds the next argument.
    pub(crate) fn bind(self, value: impl Param<'a>) -> Self {
        Self {
            query: value.bind_to(self.query),
            ..self
        }
    }

    /// Prepares the statement for this run only, so the database plans it
    /// with the values bound. For the bulk statements, whose best plan
    /// depends on how long their lists are: PostgreSQL switches a cached
    /// statement to a generic plan after five runs, and for renew-all that
    /// plan (an index lookup per lease, for a list of unknown length) took
    /// nearly twice as long at 100,000 leases as the hash join it picks
    /// when it sees the list.
    pub(crate) fn one_off(self) -> Self {
        Self {
            query: self.query.persistent(false),
            ..self
        }
    }

    /// Binds a list of pairs the dialect's way ([`Dialect::bind_pairs`]).
    pub(crate) fn bind_pairs(self, pairs: Vec<(&'a str, i64)>) -> Result<Self, StoreError> {
        Ok(Self {
            query: B::Db::bind_pairs(self.query, pairs)?,
            ..self
        })
    }

    pub(crate) async fn fetch_optional(self) -> Result<Option<Row<B>>, StoreError> {
        let backend = self.backend;
        let (query, mut conn) = self.ready().await.map_err(|e| backend.err(e))?;
        B::Db::fetch_optional(query, conn.get())
            .await
            .map_err(|e| backend.err(e))
    }

    /// [`Stmt::fetch_optional`] for a statement that always returns a row.
    pub(crate) async fn fetch_one(self) -> Result<Row<B>, StoreError> {
        let backend = self.backend;
        self.fetch_optional()
            .await?
            .ok_or_else(|| backend.err(sqlx::Error::RowNotFound))
    }

    pub(crate) async fn fetch_all(self) -> Result<Vec<Row<B>>, StoreError> {
        let backend = self.backend;
        let (query, mut conn) = self.ready().await.map_err(|e| backend.err(e))?;
        B::Db::fetch_all(query, conn.get())
            .await
            .map_err(|e| backend.err(e))
    }

    /// Runs the statement; how many rows it wrote.
    pub(crate) async fn execute(self) -> Result<u64, StoreError> {
        let backend = self.backend;
        self.execute_or_sqlx_error()
            .await
            .map_err(|e| backend.err(e))
    }

    /// [`Stmt::execute`], leaving the sqlx error for the caller to map.
    pub(crate) async fn execute_or_sqlx_error(self) -> Result<u64, sqlx::Error> {
        let (query, mut conn) = self.ready().await?;
        let done = B::Db::execute(query, conn.get()).await?;
        Ok(B::Db::rows_affected(&done))
    }

    /// The bound query, and the connection to run it on.
    async fn ready(self) -> Result<(Query<'a, B::Db>, Conn<'a, B::Db>), sqlx::Error> {
        Ok((self.query, self.on.connection().await?))
    }
}

/// An open transaction: statements made with [`Tx::stmt`] run in it, and
/// nothing they did counts before [`Tx::commit`].
pub(crate) struct Tx<'a, B: SqlBackend> {
    backend: &'a B,
    tx: Transaction<'static, B::Db>,
}

impl<'a, B: SqlBackend> Tx<'a, B> {
    pub(crate) async fn begin(backend: &'a B) -> Result<Self, StoreError> {
        let tx = backend.pool().begin().await.map_err(|e| backend.err(e))?;
        Ok(Self { backend, tx })
    }

    pub(crate) fn stmt<'s>(&'s mut self, sql: &'s str) -> Stmt<'s, B> {
        Stmt::new(self.backend, On::Transaction(&mut *self.tx), sql)
    }

    pub(crate) async fn commit(self) -> Result<(), StoreError> {
        let backend = self.backend;
        self.tx.commit().await.map_err(|e| backend.err(e))
    }
}
