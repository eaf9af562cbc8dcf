//! What each backend's own tests check alike, beyond the contract suite:
//! a store's data survives closing and reopening it, and the upgrade from
//! before schema version 5 gives old tokens an id and an expiry. Each
//! backend supplies only how it opens its database.

use std::time::Duration;

use berth_core::{UnixMillis, UserId};

use super::driver::Driver;
use crate::{MintOutcome, NewToken, Store};

const DAY_MS: i64 = 24 * 3600 * 1000;

/// Tokens of alice as a schema before version 5 held them: hash and age.
const OLD_TOKENS: [(&str, i64); 2] = [
    ("0123456789abcdef0000", DAY_MS),
    ("fedcba98765432100000", 31 * DAY_MS),
];

/// Writes [`OLD_TOKENS`], as minted `now` less their age, into a database
/// whose schema predates version 5.
pub(crate) async fn insert_old_tokens<DB: Driver>(conn: &mut DB::Connection, now: UnixMillis) {
    for (hash, age) in OLD_TOKENS {
        let insert = sqlx::query(
            "INSERT INTO tokens (token_hash, user_id, created_at) VALUES ($1, 'alice', $2)",
        );
        let insert = DB::bind_int(DB::bind_text(insert, Some(hash)), Some(now - age));
        DB::execute(insert, &mut *conn).await.unwrap();
    }
}

/// After the upgrade, [`OLD_TOKENS`] inserted at `now`: the day-old one has
/// an id (a prefix of its hash) and expires 30 days after it was minted;
/// the other has expired.
pub(crate) async fn check_old_tokens_upgraded(store: &dyn Store, now: UnixMillis) {
    let alice = UserId::parse("alice").unwrap();
    let listed = store.list_tokens(&alice).await.unwrap();
    assert_eq!(listed.len(), 1, "the 31-day-old token expired: {listed:?}");
    assert_eq!(listed[0].id, "0123456789abcdef");
    assert_eq!(listed[0].expires_at, now - DAY_MS + 30 * DAY_MS);
    let [(live, _), (expired, _)] = OLD_TOKENS;
    assert!(store.use_token(live).await.unwrap().is_some());
    assert!(store.use_token(expired).await.unwrap().is_none());
}

/// Mints a token of alice's, for [`check_token_kept`] to find after the
/// store is reopened.
pub(crate) async fn mint_a_token(store: &dyn Store) {
    let alice = UserId::parse("alice").unwrap();
    let minted = store
        .mint_token(&NewToken {
            id: "t1",
            user: &alice,
            token_hash: "h",
            ttl: Duration::from_secs(60),
            parent: None,
            max_live: 5,
        })
        .await
        .unwrap();
    assert!(matches!(minted, MintOutcome::Minted(_)), "{minted:?}");
}

/// The token of [`mint_a_token`] is still alice's.
pub(crate) async fn check_token_kept(store: &dyn Store) {
    let owner = store.use_token("h").await.unwrap().unwrap();
    assert_eq!(owner.user.as_str(), "alice");
}
