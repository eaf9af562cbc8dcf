//! Checking tokens: the admin token in constant time, user tokens through
//! the [`TokenStore`] behind a short-lived per-node cache.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use berth_core::UserId;

use super::cache::TokenCache;
use super::caller::{Access, Caller};
use super::secret::TokenHash;
use super::user_token::UserTokenInfo;

/// Why a credential could not be checked (not: why it was refused).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The store could not be asked; the text says why.
    #[error("the token store is unavailable: {0}")]
    Store(String),
}

/// Where user token hashes are looked up; the binary implements it over the
/// store.
#[async_trait]
pub trait TokenStore: Send + Sync + 'static {
    /// The live user token whose hash (lowercase hex SHA-256) this is.
    async fn lookup(&self, hash_hex: &str) -> Result<Option<UserTokenInfo>, AuthError>;

    /// Spends the one-time sign-in code whose hash this is, and answers
    /// the user it was made for with a fresh token of theirs for the
    /// user cookie. `None`: no such live code (unknown, expired, or spent).
    /// Without sign-in there are no codes.
    async fn redeem_hop(&self, _code_hash_hex: &str) -> Result<Option<Redeemed>, AuthError> {
        Ok(None)
    }
}

/// What a spent sign-in code gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redeemed {
    /// The user the code was made for.
    pub user: UserId,
    /// A user token of `user`, for the cookie.
    pub token: String,
}

/// Checks tokens: the admin hash in constant time, user tokens through a
/// bounded, short-lived cache in front of the [`TokenStore`].
#[derive(Clone)]
pub struct Authenticator {
    admin_hash: TokenHash,
    store: Arc<dyn TokenStore>,
    cache: Arc<TokenCache>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator").finish_non_exhaustive()
    }
}

/// Default bound of the user token cache.
pub const DEFAULT_CACHE_ENTRIES: usize = 10_000;
/// How long a cached user token stays trusted without asking the store
/// again (`[auth] token_cache_s`). A revocation empties the caches of the
/// nodes it reaches at once; this bounds how long a node it could not reach
/// may go on accepting the token.
pub const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(10);

impl Authenticator {
    /// Checks against `admin_token` and `store`, with the default cache
    /// bounds ([`DEFAULT_CACHE_ENTRIES`], [`DEFAULT_CACHE_TTL`]).
    pub fn new(admin_token: &str, store: Arc<dyn TokenStore>) -> Self {
        Self::with_cache(admin_token, store, DEFAULT_CACHE_ENTRIES, DEFAULT_CACHE_TTL)
    }

    /// Like [`Self::new`], with a user-token cache of at most `entries`
    /// tokens (at least one), each trusted for at most `ttl`.
    pub fn with_cache(
        admin_token: &str,
        store: Arc<dyn TokenStore>,
        entries: usize,
        ttl: Duration,
    ) -> Self {
        Self {
            admin_hash: TokenHash::of(admin_token),
            store,
            cache: Arc::new(TokenCache::new(entries.max(1), ttl)),
        }
    }

    /// Whether `token` is the admin token (constant time).
    pub fn is_admin(&self, token: &str) -> bool {
        TokenHash::of(token).ct_eq(&self.admin_hash)
    }

    /// Identifies the holder of `token`; `None` if it is not valid.
    pub async fn identify(&self, token: &str) -> Result<Option<Caller>, AuthError> {
        let hash = TokenHash::of(token);
        if hash.ct_eq(&self.admin_hash) {
            return Ok(Some(Caller::Admin));
        }
        let caller = |user: &UserId, id: &str| Caller::User {
            user: user.clone(),
            token_id: id.to_owned(),
        };
        if let Some(found) = self.cache.get(&hash, caller) {
            return Ok(Some(found));
        }
        Ok(self
            .fetch(hash)
            .await?
            .map(|info| caller(&info.user, &info.id)))
    }

    /// What `token` allows on `target`. A cache hit takes a read lock and
    /// allocates nothing.
    pub async fn access(&self, token: &str, target: &UserId) -> Result<Access, AuthError> {
        let hash = TokenHash::of(token);
        if hash.ct_eq(&self.admin_hash) {
            return Ok(Access::Admin);
        }
        let verdict = |user: &UserId, _: &str| {
            if user == target {
                Access::Allowed
            } else {
                Access::Forbidden
            }
        };
        if let Some(access) = self.cache.get(&hash, verdict) {
            return Ok(access);
        }
        Ok(match self.fetch(hash).await? {
            Some(info) => verdict(&info.user, &info.id),
            None => Access::Unauthenticated,
        })
    }

    /// Spends a one-time sign-in code ([`TokenStore::redeem_hop`]).
    pub async fn redeem_hop(&self, code: &str) -> Result<Option<Redeemed>, AuthError> {
        self.store.redeem_hop(&TokenHash::of(code).to_hex()).await
    }

    /// Forgets every cached user token, so the next use of each asks the
    /// store. Called on this node after a revocation, and by the node that
    /// revoked through `/internal/v1/tokens/purge` on every other node. A
    /// lookup that was in flight while this ran does not fill the cache.
    pub fn purge(&self) {
        self.cache.purge();
    }

    async fn fetch(&self, hash: TokenHash) -> Result<Option<UserTokenInfo>, AuthError> {
        // Read before the store is asked: a purge during the query means
        // the answer may predate a revocation, and it is not cached.
        let generation = self.cache.generation();
        let info = self.store.lookup(&hash.to_hex()).await?;
        // Only hits are cached: caching misses would let random tokens
        // evict the real ones.
        if let Some(info) = &info {
            self.cache.insert(hash, info, generation);
        }
        Ok(info)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::test_support::user;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Test double: a fixed token → user table that counts its lookups.
    struct Tokens {
        known: Vec<(String, UserId)>,
        lookups: AtomicUsize,
    }

    #[async_trait]
    impl TokenStore for Tokens {
        async fn lookup(&self, hash: &str) -> Result<Option<UserTokenInfo>, AuthError> {
            self.lookups.fetch_add(1, Ordering::Relaxed);
            Ok(self
                .known
                .iter()
                .find(|(t, _)| TokenHash::of(t).to_hex() == hash)
                .map(|(t, u)| UserTokenInfo {
                    user: u.clone(),
                    id: format!("id-{t}"),
                    expires_in: Duration::from_secs(3600),
                }))
        }
    }

    fn authenticator() -> (Authenticator, Arc<Tokens>) {
        let tokens = Arc::new(Tokens {
            known: vec![("alice-token".into(), user("alice"))],
            lookups: AtomicUsize::new(0),
        });
        (Authenticator::new("admin-secret", tokens.clone()), tokens)
    }

    #[tokio::test]
    async fn admin_reaches_everyone_and_users_only_themselves() {
        let (auth, _) = authenticator();
        assert_eq!(
            auth.access("admin-secret", &user("bob")).await,
            Ok(Access::Admin)
        );
        assert_eq!(
            auth.access("alice-token", &user("alice")).await,
            Ok(Access::Allowed)
        );
        assert_eq!(
            auth.access("alice-token", &user("bob")).await,
            Ok(Access::Forbidden)
        );
        assert_eq!(
            auth.access("nope", &user("alice")).await,
            Ok(Access::Unauthenticated)
        );
        assert_eq!(auth.identify("admin-secret").await, Ok(Some(Caller::Admin)));
        assert_eq!(
            auth.identify("alice-token").await,
            Ok(Some(Caller::User {
                user: user("alice"),
                token_id: "id-alice-token".into()
            }))
        );
        assert_eq!(auth.identify("admin-secret ").await, Ok(None));
        assert!(auth.is_admin("admin-secret") && !auth.is_admin("alice-token"));
    }

    #[tokio::test]
    async fn user_tokens_hit_the_store_only_on_a_miss() {
        let (auth, tokens) = authenticator();
        for _ in 0..5 {
            assert_eq!(
                auth.access("alice-token", &user("alice")).await,
                Ok(Access::Allowed)
            );
        }
        assert_eq!(tokens.lookups.load(Ordering::Relaxed), 1);
        // Invalid tokens are not cached, so they cannot crowd out valid ones.
        for _ in 0..3 {
            let _ = auth.access("wrong", &user("alice")).await;
        }
        assert_eq!(tokens.lookups.load(Ordering::Relaxed), 4);
        assert_eq!(auth.cache.len(), 1);
        // A purge (a revocation somewhere) sends the next use to the store.
        auth.purge();
        assert_eq!(auth.cache.len(), 0);
        let _ = auth.access("alice-token", &user("alice")).await;
        assert_eq!(tokens.lookups.load(Ordering::Relaxed), 5);
    }

    #[tokio::test]
    async fn the_cache_is_bounded_and_expires() {
        let known = (0..10)
            .map(|i| (format!("t{i}"), user(&format!("u{i}"))))
            .collect();
        let tokens = Arc::new(Tokens {
            known,
            lookups: AtomicUsize::new(0),
        });
        let auth = Authenticator::with_cache("admin", tokens.clone(), 4, Duration::from_secs(60));
        for i in 0..10 {
            auth.identify(&format!("t{i}")).await.unwrap();
            assert!(auth.cache.len() <= 4);
        }
        let auth = Authenticator::with_cache("admin", tokens.clone(), 4, Duration::ZERO);
        let before = tokens.lookups.load(Ordering::Relaxed);
        auth.identify("t1").await.unwrap();
        auth.identify("t1").await.unwrap();
        assert_eq!(
            tokens.lookups.load(Ordering::Relaxed),
            before + 2,
            "expired entries are refetched"
        );
    }
}
