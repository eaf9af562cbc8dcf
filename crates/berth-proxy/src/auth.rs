//! Who is calling, and may they reach this user (design §8.2).
//!
//! This module is shared by the proxy and the HTTP API so that both accept
//! exactly the same credentials:
//!
//! * a token as `Authorization: Bearer …`, as the `berth_token` cookie, or
//!   once as the `?berth_token=` query parameter (the proxy turns that into
//!   the cookie and redirects, see [`crate::Proxy`]);
//! * in `auth = "header"` mode, `X-Forwarded-User` from a trusted peer.
//!
//! berth keeps only SHA-256 hashes of tokens: the admin token's in memory
//! (compared in constant time), user tokens' in the store. User tokens are
//! looked up by hash, so the secret never meets a timing-dependent
//! comparison, and the answer is cached in a small bounded map so that a
//! request does not cost a store query.

use std::collections::HashMap;
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use berth_core::{ErrorCode, UserId};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Response, StatusCode, Uri};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::forward::ConnInfo;
use crate::respond::{self, ProxyBody};

/// The cookie a browser carries its token in.
pub const TOKEN_COOKIE: &str = "berth_token";
/// The one-shot query parameter that becomes the cookie.
pub const TOKEN_QUERY: &str = "berth_token";
/// The header an SSO proxy names the user in (`auth = "header"`).
pub static FORWARDED_USER: HeaderName = HeaderName::from_static("x-forwarded-user");

/// The header a node proves itself with on node-to-node calls: the
/// cluster secret (design §8.2).
pub static CLUSTER_SECRET: HeaderName = HeaderName::from_static("x-berth-cluster-secret");
/// The user a request forwarded by another node acts for. Believed only
/// together with a valid [`CLUSTER_SECRET`].
pub static CLUSTER_USER: HeaderName = HeaderName::from_static("x-berth-forwarded-user");

/// The secret the nodes of a cluster share. Kept as its SHA-256 so a
/// presented value is compared in constant time whatever its length.
#[derive(Clone)]
pub struct ClusterSecret {
    hash: TokenHash,
    header: HeaderValue,
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(…)")
    }
}

/// A cluster secret that cannot be sent in an HTTP header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the cluster secret must be visible ASCII without spaces (it is sent as an HTTP header)")]
pub struct InvalidClusterSecret;

impl ClusterSecret {
    pub fn new(secret: &str) -> Result<Self, InvalidClusterSecret> {
        let secret = secret.trim();
        if secret.is_empty() || !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(InvalidClusterSecret);
        }
        let mut header = HeaderValue::from_str(secret).map_err(|_| InvalidClusterSecret)?;
        header.set_sensitive(true);
        Ok(Self {
            hash: TokenHash::of(secret),
            header,
        })
    }

    /// Whether `presented` is the secret (constant time).
    pub fn matches(&self, presented: &[u8]) -> bool {
        TokenHash(Sha256::digest(presented).into()).ct_eq(&self.hash)
    }

    /// Whether `headers` carry the secret in [`CLUSTER_SECRET`].
    pub fn verify(&self, headers: &HeaderMap) -> bool {
        headers
            .get(&CLUSTER_SECRET)
            .is_some_and(|v| self.matches(v.as_bytes()))
    }

    /// The value to send in [`CLUSTER_SECRET`].
    pub fn header_value(&self) -> &HeaderValue {
        &self.header
    }
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    Admin,
    User(UserId),
}

impl Caller {
    /// May this caller act on `user`'s own resources?
    pub fn may_act_for(&self, user: &UserId) -> bool {
        match self {
            Caller::Admin => true,
            Caller::User(own) => own == user,
        }
    }
}

/// The SHA-256 of a token: what berth stores and compares.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenHash([u8; 32]);

impl TokenHash {
    pub fn of(token: &str) -> Self {
        Self(Sha256::digest(token.as_bytes()).into())
    }

    /// Lowercase hex, the store's representation.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    fn ct_eq(&self, other: &TokenHash) -> bool {
        self.0.ct_eq(&other.0).into()
    }
}

impl std::fmt::Debug for TokenHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Short on purpose: a hash in a log line is enough to correlate.
        write!(f, "TokenHash({}…)", hex::encode(&self.0[..4]))
    }
}

/// The token in `Authorization: Bearer …`, else in the `berth_token` cookie.
pub fn presented_token(headers: &HeaderMap) -> Option<&str> {
    if let Some(bearer) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
    {
        return Some(bearer);
    }
    cookie_token(headers)
}

fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    // The scheme is case-insensitive (RFC 9110 §11.1).
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The value of the `berth_token` cookie, if any.
pub fn cookie_token(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == TOKEN_COOKIE)
        .map(|(_, value)| value.trim_matches('"'))
        .filter(|v| !v.is_empty())
}

/// A `berth_token` found in a query string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryToken {
    /// The percent-decoded token.
    pub token: String,
    /// The query without the token parameter; empty if nothing is left.
    pub rest: String,
}

/// Finds `berth_token=` in `query`. `None` when absent (the common case,
/// which allocates nothing).
pub fn query_token(query: &str) -> Option<QueryToken> {
    let mut found: Option<&str> = None;
    for pair in query.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if name == TOKEN_QUERY {
            found = Some(value);
        }
    }
    let raw = found?;
    let token = percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .ok()?
        .into_owned();
    let rest = query
        .split('&')
        .filter(|pair| {
            let name = pair.split_once('=').map_or(*pair, |(n, _)| n);
            name != TOKEN_QUERY && !pair.is_empty()
        })
        .collect::<Vec<_>>()
        .join("&");
    Some(QueryToken { token, rest })
}

/// True if `token` may be put in a cookie value as is (RFC 6265 cookie-octets).
pub fn is_cookie_safe(token: &str) -> bool {
    !token.is_empty()
        && token
            .bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'"' | b',' | b';' | b'\\'))
}

/// Why a credential could not be checked (not: why it was refused).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("the token store is unavailable: {0}")]
    Store(String),
}

/// Where user token hashes are looked up; the binary implements it over the
/// store.
#[async_trait]
pub trait TokenStore: Send + Sync + 'static {
    /// The user a token hash (lowercase hex SHA-256) belongs to.
    async fn user_for_token_hash(&self, hash_hex: &str) -> Result<Option<UserId>, AuthError>;
}

/// What a credential allows on a given user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The admin, or the user themself.
    Allowed,
    /// A valid credential of another user.
    Forbidden,
    /// No credential, or an invalid one.
    Unauthenticated,
}

/// Checks tokens: the admin hash in constant time, user tokens through a
/// bounded cache in front of the [`TokenStore`].
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
/// again. Bounds how long a token deleted from the store keeps working.
pub const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(300);

impl Authenticator {
    pub fn new(admin_token: &str, store: Arc<dyn TokenStore>) -> Self {
        Self::with_cache(admin_token, store, DEFAULT_CACHE_ENTRIES, DEFAULT_CACHE_TTL)
    }

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

    /// Identifies the holder of `token`; `None` if it is not valid.
    pub async fn identify(&self, token: &str) -> Result<Option<Caller>, AuthError> {
        let hash = TokenHash::of(token);
        if hash.ct_eq(&self.admin_hash) {
            return Ok(Some(Caller::Admin));
        }
        if let Some(user) = self.cache.get(&hash, |user| user.clone()) {
            return Ok(Some(Caller::User(user)));
        }
        Ok(self.fetch(hash).await?.map(Caller::User))
    }

    /// Identifies the caller from its headers (Bearer, then cookie).
    pub async fn identify_headers(&self, headers: &HeaderMap) -> Result<Option<Caller>, AuthError> {
        match presented_token(headers) {
            Some(token) => self.identify(token).await,
            None => Ok(None),
        }
    }

    /// What `token` allows on `target`. A cache hit takes a read lock and
    /// allocates nothing.
    pub async fn access(&self, token: &str, target: &UserId) -> Result<Access, AuthError> {
        let hash = TokenHash::of(token);
        if hash.ct_eq(&self.admin_hash) {
            return Ok(Access::Allowed);
        }
        let verdict = |user: &UserId| {
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
            Some(user) => verdict(&user),
            None => Access::Unauthenticated,
        })
    }

    async fn fetch(&self, hash: TokenHash) -> Result<Option<UserId>, AuthError> {
        let user = self.store.user_for_token_hash(&hash.to_hex()).await?;
        // Only hits are cached: caching misses would let random tokens
        // evict the real ones.
        if let Some(user) = &user {
            self.cache.insert(hash, user.clone());
        }
        Ok(user)
    }
}

/// hash → user, bounded, with a time to live. Reads take a shared lock;
/// writes happen only on a miss.
struct TokenCache {
    entries: RwLock<HashMap<TokenHash, (UserId, Instant)>>,
    capacity: usize,
    ttl: Duration,
}

impl TokenCache {
    fn new(capacity: usize, ttl: Duration) -> Self {
        Self {
            entries: RwLock::new(HashMap::new()),
            capacity,
            ttl,
        }
    }

    fn get<T>(&self, hash: &TokenHash, f: impl FnOnce(&UserId) -> T) -> Option<T> {
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let (user, added) = entries.get(hash)?;
        (added.elapsed() < self.ttl).then(|| f(user))
    }

    fn insert(&self, hash: TokenHash, user: UserId) {
        let now = Instant::now();
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        if entries.len() >= self.capacity && !entries.contains_key(&hash) {
            entries.retain(|_, (_, added)| now.duration_since(*added) < self.ttl);
            if entries.len() >= self.capacity {
                // Full of live entries: forgetting them all costs one store
                // query per active token, and keeps this O(1) amortised
                // without an LRU list on the read path.
                entries.clear();
            }
        }
        entries.insert(hash, (user, now));
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.read().map(|e| e.len()).unwrap_or(0)
    }
}

/// An IP network (`10.0.0.0/8`, `::1`), for `trusted_proxies`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpNet {
    addr: IpAddr,
    prefix: u8,
}

/// A `trusted_proxies` entry that is not an IP address or CIDR block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an IP address or CIDR block")]
pub struct InvalidIpNet(pub String);

impl FromStr for IpNet {
    type Err = InvalidIpNet;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || InvalidIpNet(s.to_owned());
        let (addr, prefix) = match s.trim().split_once('/') {
            Some((a, p)) => (a, Some(p.parse::<u8>().map_err(|_| bad())?)),
            None => (s.trim(), None),
        };
        let addr = canonical(addr.parse::<IpAddr>().map_err(|_| bad())?);
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = prefix.unwrap_or(max);
        if prefix > max {
            return Err(bad());
        }
        Ok(Self { addr, prefix })
    }
}

impl IpNet {
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// IPv4-mapped IPv6 peers (`::ffff:10.0.0.1`, from dual-stack listeners)
/// are their IPv4 address, so `10.0.0.0/8` matches them.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// How the proxy identifies callers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AuthMode {
    /// Tokens only.
    #[default]
    Token,
    /// Tokens, and `X-Forwarded-User` from a trusted proxy.
    Header,
}

impl FromStr for AuthMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "token" => Ok(AuthMode::Token),
            "header" => Ok(AuthMode::Header),
            other => Err(format!(
                "{other:?} is not an auth mode (expected \"token\" or \"header\")"
            )),
        }
    }
}

/// The addresses whose `X-Forwarded-*` headers berth believes.
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies(Vec<IpNet>);

impl TrustedProxies {
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, InvalidIpNet> {
        entries
            .iter()
            .map(|e| e.as_ref().parse())
            .collect::<Result<_, _>>()
            .map(Self)
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.iter().any(|net| net.contains(ip))
    }
}

/// The credential that let a request through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Credential {
    Bearer,
    Cookie,
    ForwardedUser,
    /// Another node of the cluster forwarded the request for the user it
    /// names; such a request is never forwarded again.
    Cluster,
}

/// Removes berth's own credentials before a request goes to an instance:
/// the program must never see them (an admin's token would otherwise hand
/// the user's program the keys to every other user). The `berth_token`
/// cookie always goes; `Authorization` only if berth consumed it.
pub fn strip_credentials(headers: &mut HeaderMap, used: Credential) {
    if used == Credential::Bearer {
        headers.remove(header::AUTHORIZATION);
    }
    if used == Credential::Cluster {
        // The cluster secret would let the program act as any node.
        headers.remove(&CLUSTER_SECRET);
        headers.remove(&CLUSTER_USER);
    }
    let carries_ours = headers.get_all(header::COOKIE).iter().any(|v| {
        v.as_bytes()
            .windows(TOKEN_COOKIE.len())
            .any(|w| w == TOKEN_COOKIE.as_bytes())
    });
    if !carries_ours {
        return;
    }
    let kept: Vec<&str> = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|pair| {
            !pair.is_empty() && pair.split_once('=').is_none_or(|(n, _)| n != TOKEN_COOKIE)
        })
        .collect();
    let joined = kept.join("; ");
    headers.remove(header::COOKIE);
    if let Ok(value) = HeaderValue::try_from(joined) {
        if !value.is_empty() {
            headers.insert(header::COOKIE, value);
        }
    }
}

/// The proxy's auth layer: decides whether a request may reach `user`.
#[derive(Debug, Clone)]
pub struct Gate {
    auth: Authenticator,
    mode: AuthMode,
    trusted: TrustedProxies,
    cluster: Option<ClusterSecret>,
}

impl Gate {
    pub fn new(auth: Authenticator, mode: AuthMode, trusted: TrustedProxies) -> Self {
        Self {
            auth,
            mode,
            trusted,
            cluster: None,
        }
    }

    /// Also accepts requests forwarded by another node: a valid cluster
    /// secret plus [`CLUSTER_USER`] naming the target user.
    pub fn with_cluster(mut self, secret: ClusterSecret) -> Self {
        self.cluster = Some(secret);
        self
    }

    pub fn trusted(&self) -> &TrustedProxies {
        &self.trusted
    }

    /// In header mode, a trusted peer's `X-Forwarded-User` stands and is
    /// passed on; anyone else's is dropped.
    pub fn keeps_forwarded_user(&self, conn: &ConnInfo) -> bool {
        self.mode == AuthMode::Header && conn.trusted
    }

    /// `Ok` lets the request through and says which credential did; `Err`
    /// is the answer instead: a 401, a 403, or the redirect that turns
    /// `?berth_token=` into a cookie.
    ///
    /// A Bearer token that is not a berth token may belong to the app, so
    /// the cookie is tried next.
    pub async fn check(
        &self,
        headers: &HeaderMap,
        uri: &Uri,
        conn: &ConnInfo,
        user: &UserId,
    ) -> Result<Credential, Response<ProxyBody>> {
        let navigation = respond::is_navigation(headers);
        if let Some(secret) = &self.cluster {
            if let Some(presented) = headers.get(&CLUSTER_SECRET) {
                // Whoever sends the header claims to be a node: it alone
                // decides, so a wrong secret is a 401 even next to a token.
                if !secret.matches(presented.as_bytes()) {
                    return Err(respond::unauthorized(navigation));
                }
                return match headers.get(&CLUSTER_USER) {
                    Some(name) if name.as_bytes() == user.as_str().as_bytes() => {
                        Ok(Credential::Cluster)
                    }
                    _ => Err(respond::forbidden(navigation)),
                };
            }
        }
        if let Some(q) = uri.query().and_then(query_token) {
            return Err(self
                .exchange_query_token(q, uri, conn, headers, user, navigation)
                .await);
        }
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token);
        let candidates = [
            (bearer, Credential::Bearer),
            (cookie_token(headers), Credential::Cookie),
        ];
        for (token, credential) in candidates {
            let Some(token) = token else { continue };
            match self.auth.access(token, user).await {
                Ok(Access::Allowed) => return Ok(credential),
                Ok(Access::Forbidden) => return Err(respond::forbidden(navigation)),
                Ok(Access::Unauthenticated) => {}
                Err(e) => return Err(store_unavailable(&e)),
            }
        }
        if self.keeps_forwarded_user(conn) {
            if let Some(name) = headers.get(&FORWARDED_USER) {
                return if name.as_bytes() == user.as_str().as_bytes() {
                    Ok(Credential::ForwardedUser)
                } else {
                    Err(respond::forbidden(navigation))
                };
            }
        }
        Err(respond::unauthorized(navigation))
    }

    async fn exchange_query_token(
        &self,
        q: QueryToken,
        uri: &Uri,
        conn: &ConnInfo,
        headers: &HeaderMap,
        user: &UserId,
        navigation: bool,
    ) -> Response<ProxyBody> {
        match self.auth.access(&q.token, user).await {
            Ok(Access::Allowed) => {}
            Ok(Access::Forbidden) => return respond::forbidden(navigation),
            Ok(Access::Unauthenticated) => return respond::unauthorized(navigation),
            Err(e) => return store_unavailable(&e),
        }
        if !is_cookie_safe(&q.token) {
            return respond::json_error(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidRequest.as_str(),
                "this token cannot be stored in a cookie; send it as Authorization: Bearer",
                &[],
            );
        }
        let https = conn.trusted
            && headers
                .get("x-forwarded-proto")
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
        let cookie = format!(
            "{TOKEN_COOKIE}={}; Path=/; HttpOnly; SameSite=Lax{}",
            q.token,
            if https { "; Secure" } else { "" }
        );
        let location = if q.rest.is_empty() {
            uri.path().to_owned()
        } else {
            format!("{}?{}", uri.path(), q.rest)
        };
        match (
            HeaderValue::try_from(location),
            HeaderValue::try_from(cookie),
        ) {
            (Ok(location), Ok(cookie)) => {
                respond::redirect(StatusCode::SEE_OTHER, location, Some(cookie))
            }
            _ => respond::json_error(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidRequest.as_str(),
                "cannot redirect to this URL",
                &[],
            ),
        }
    }
}

fn store_unavailable(e: &AuthError) -> Response<ProxyBody> {
    tracing::warn!(error = %e, "cannot check a token");
    let mut response = respond::code_error(ErrorCode::StoreUnavailable, &e.to_string());
    respond::set_retry_after(&mut response, 1000);
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Test double: a fixed token → user table that counts its lookups.
    struct Tokens {
        known: Vec<(String, UserId)>,
        lookups: AtomicUsize,
    }

    #[async_trait]
    impl TokenStore for Tokens {
        async fn user_for_token_hash(&self, hash: &str) -> Result<Option<UserId>, AuthError> {
            self.lookups.fetch_add(1, Ordering::Relaxed);
            Ok(self
                .known
                .iter()
                .find(|(t, _)| TokenHash::of(t).to_hex() == hash)
                .map(|(_, u)| u.clone()))
        }
    }

    fn user(s: &str) -> UserId {
        UserId::parse(s).unwrap()
    }

    fn authenticator() -> (Authenticator, Arc<Tokens>) {
        let tokens = Arc::new(Tokens {
            known: vec![("alice-token".into(), user("alice"))],
            lookups: AtomicUsize::new(0),
        });
        (Authenticator::new("admin-secret", tokens.clone()), tokens)
    }

    #[test]
    fn bearer_wins_over_cookie() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("a=b; berth_token=fromcookie"),
        );
        assert_eq!(presented_token(&headers), Some("fromcookie"));
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer frombearer"),
        );
        assert_eq!(presented_token(&headers), Some("frombearer"));
    }

    #[test]
    fn no_token_is_none() {
        let mut headers = HeaderMap::new();
        assert_eq!(presented_token(&headers), None);
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic abc"));
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("other=1; berth_token="),
        );
        assert_eq!(presented_token(&headers), None);
    }

    #[test]
    fn query_token_is_found_and_removed() {
        assert_eq!(query_token("a=1&b=2"), None);
        let q = query_token("a=1&berth_token=abc%2Bd&b=2").unwrap();
        assert_eq!(q.token, "abc+d");
        assert_eq!(q.rest, "a=1&b=2");
        let q = query_token("berth_token=x").unwrap();
        assert_eq!((q.token.as_str(), q.rest.as_str()), ("x", ""));
        assert_eq!(query_token("berth_token=%FF"), None, "not UTF-8");
    }

    #[test]
    fn berth_credentials_never_reach_the_instance() {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer x"));
        h.append(
            header::COOKIE,
            HeaderValue::from_static("a=1; berth_token=secret"),
        );
        h.append(header::COOKIE, HeaderValue::from_static("b=2"));
        strip_credentials(&mut h, Credential::Cookie);
        assert_eq!(h[header::AUTHORIZATION], "Bearer x", "not ours: the app's");
        assert_eq!(h[header::COOKIE], "a=1; b=2");
        strip_credentials(&mut h, Credential::Bearer);
        assert!(!h.contains_key(header::AUTHORIZATION));
        let mut only = HeaderMap::new();
        only.insert(
            header::COOKIE,
            HeaderValue::from_static("berth_token=secret"),
        );
        strip_credentials(&mut only, Credential::Cookie);
        assert!(!only.contains_key(header::COOKIE));
    }

    #[test]
    fn cookie_safety() {
        assert!(is_cookie_safe("0123abcdef"));
        for bad in ["", "a b", "a;b", "a,b", "a\"b"] {
            assert!(!is_cookie_safe(bad), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn admin_reaches_everyone_and_users_only_themselves() {
        let (auth, _) = authenticator();
        assert_eq!(
            auth.access("admin-secret", &user("bob")).await,
            Ok(Access::Allowed)
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
            Ok(Some(Caller::User(user("alice"))))
        );
        assert_eq!(auth.identify("admin-secret ").await, Ok(None));
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

    #[test]
    fn ip_nets() {
        let net: IpNet = "10.0.0.0/8".parse().unwrap();
        assert!(net.contains("10.1.2.3".parse().unwrap()));
        assert!(net.contains("::ffff:10.1.2.3".parse().unwrap()));
        assert!(!net.contains("11.0.0.1".parse().unwrap()));
        let one: IpNet = "::1".parse().unwrap();
        assert!(one.contains("::1".parse().unwrap()));
        assert!(!one.contains("::2".parse().unwrap()));
        let all: IpNet = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("192.168.0.1".parse().unwrap()));
        for bad in ["10.0.0.0/33", "x", "::1/129", "1.2.3.4/"] {
            assert!(bad.parse::<IpNet>().is_err(), "{bad}");
        }
        let trusted = TrustedProxies::parse(&["127.0.0.1", "fd00::/8"]).unwrap();
        assert!(trusted.contains("127.0.0.1".parse().unwrap()));
        assert!(trusted.contains("fd12::1".parse().unwrap()));
        assert!(!trusted.contains("127.0.0.2".parse().unwrap()));
    }

    #[test]
    fn cluster_secrets_match_exactly_and_never_reach_the_program() {
        assert!(ClusterSecret::new("").is_err());
        assert!(ClusterSecret::new("has space").is_err());
        assert!(ClusterSecret::new("tab\tin").is_err());
        let secret = ClusterSecret::new("s3cret").unwrap();
        assert!(secret.matches(b"s3cret"));
        for wrong in [
            &b""[..],
            b"s3cre",
            b"s3cret ",
            b"S3CRET",
            b"s3cret-and-more",
        ] {
            assert!(!secret.matches(wrong), "{wrong:?}");
        }
        assert!(!format!("{secret:?}").contains("s3cret"));
        let mut headers = HeaderMap::new();
        assert!(!secret.verify(&headers));
        headers.insert(CLUSTER_SECRET.clone(), secret.header_value().clone());
        headers.insert(CLUSTER_USER.clone(), HeaderValue::from_static("alice"));
        assert!(secret.verify(&headers));
        strip_credentials(&mut headers, Credential::Cluster);
        assert!(headers.get(&CLUSTER_SECRET).is_none());
        assert!(headers.get(&CLUSTER_USER).is_none());
    }
}
