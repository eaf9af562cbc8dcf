//! The per-node user-token cache and its purge.

use std::collections::HashMap;
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use berth_core::UserId;

use super::secret::TokenHash;
use super::user_token::UserTokenInfo;

/// hash → user, bounded, with a time to live no longer than the token's
/// own. Reads take a shared lock; writes happen only on a miss and on a
/// purge.
pub(super) struct TokenCache {
    entries: RwLock<HashMap<TokenHash, CachedToken>>,
    /// Bumped by every purge (under the write lock), so that a lookup that
    /// began before a purge cannot put a stale answer back afterwards.
    generation: AtomicU64,
    capacity: usize,
    ttl: Duration,
}

struct CachedToken {
    user: UserId,
    id: Box<str>,
    /// The earlier of the cache's TTL and the token's own expiry.
    until: Instant,
}

impl TokenCache {
    pub(super) fn new(capacity: usize, ttl: Duration) -> Self {
        Self {
            entries: RwLock::new(HashMap::new()),
            generation: AtomicU64::new(0),
            capacity,
            ttl,
        }
    }

    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub(super) fn get<T>(&self, hash: &TokenHash, f: impl FnOnce(&UserId, &str) -> T) -> Option<T> {
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let entry = entries.get(hash)?;
        (Instant::now() < entry.until).then(|| f(&entry.user, &entry.id))
    }

    pub(super) fn insert(&self, hash: TokenHash, info: &UserTokenInfo, generation: u64) {
        let now = Instant::now();
        let until = now + self.ttl.min(info.expires_in);
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        if self.generation.load(Ordering::Acquire) != generation {
            return;
        }
        if entries.len() >= self.capacity && !entries.contains_key(&hash) {
            entries.retain(|_, entry| now < entry.until);
            if entries.len() >= self.capacity {
                // Full of live entries: forgetting them all costs one store
                // query per active token, and keeps this O(1) amortised
                // without an LRU list on the read path.
                entries.clear();
            }
        }
        entries.insert(
            hash,
            CachedToken {
                user: info.user.clone(),
                id: info.id.as_str().into(),
                until,
            },
        );
    }

    pub(super) fn purge(&self) {
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::AcqRel);
        entries.clear();
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.entries.read().map(|e| e.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::test_support::user;

    /// A lookup that was in flight when a purge ran must not put its
    /// (possibly pre-revocation) answer into the cache.
    #[test]
    fn a_purge_wins_over_a_lookup_in_flight() {
        let cache = TokenCache::new(10, Duration::from_secs(60));
        let info = UserTokenInfo {
            user: user("alice"),
            id: "t1".into(),
            expires_in: Duration::from_secs(60),
        };
        let hash = TokenHash::of("t");
        let before = cache.generation();
        cache.purge();
        cache.insert(hash, &info, before);
        assert_eq!(cache.get(&hash, |u, _| u.clone()), None);
        cache.insert(hash, &info, cache.generation());
        assert_eq!(cache.get(&hash, |u, _| u.clone()), Some(user("alice")));
    }

    #[test]
    fn cached_tokens_live_no_longer_than_the_token() {
        let cache = TokenCache::new(10, Duration::from_secs(60));
        let hash = TokenHash::of("t");
        let info = UserTokenInfo {
            user: user("alice"),
            id: "t1".into(),
            expires_in: Duration::ZERO,
        };
        cache.insert(hash, &info, cache.generation());
        assert_eq!(cache.get(&hash, |u, _| u.clone()), None, "already expired");
    }

    /// A full cache makes room by dropping its expired entries first, and
    /// keeps the live ones.
    #[test]
    fn a_full_cache_drops_the_expired_and_keeps_the_live() {
        let cache = TokenCache::new(2, Duration::from_secs(60));
        let token = |id: &str, expires_in| UserTokenInfo {
            user: user(id),
            id: id.into(),
            expires_in,
        };
        let (expired, live, new) = (TokenHash::of("a"), TokenHash::of("b"), TokenHash::of("c"));
        cache.insert(expired, &token("alice", Duration::ZERO), cache.generation());
        cache.insert(
            live,
            &token("bob", Duration::from_secs(60)),
            cache.generation(),
        );
        cache.insert(
            new,
            &token("carol", Duration::from_secs(60)),
            cache.generation(),
        );
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.get(&live, |u, _| u.clone()), Some(user("bob")));
        assert_eq!(cache.get(&new, |u, _| u.clone()), Some(user("carol")));
        // Full of live entries, it starts again rather than grow.
        cache.insert(
            expired,
            &token("alice", Duration::from_secs(60)),
            cache.generation(),
        );
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.get(&expired, |u, _| u.clone()), Some(user("alice")));
    }
}
