//! Who is calling, and may they reach this user (design §8.2).
//!
//! berth keeps two kinds of credential apart:
//!
//! * **Tokens**, shown as `Authorization: Bearer …`: the admin token
//!   (compared in constant time against its SHA-256 in memory) and user
//!   tokens (looked up in the store by their SHA-256, so a secret never
//!   meets a timing-dependent comparison). The API and the proxy accept
//!   both, the proxy only for the token's own user.
//! * **Browser cookies**, each for one purpose. The *user cookie*
//!   ([`USER_COOKIE`], or [`USER_COOKIE_HOST`] over https in host mode)
//!   holds a user token and is accepted by the proxy alone, for that user
//!   alone; it is set when a browser first opens a link carrying
//!   `?berth_token=` and is scoped to the user's own origin or base path.
//!   The admin page's *session cookie* ([`SESSION_COOKIE`]) is the API's,
//!   checked in the binary. The proxy never accepts the admin token from a
//!   cookie or a link: an admin opens a user's app with a token scoped to
//!   that user.
//!
//! In `auth = "header"` mode, `X-Forwarded-User` from a trusted peer (and,
//! if configured, with the proxy's shared secret) names the user.
//!
//! User-token lookups are cached per node for a short time
//! ([`DEFAULT_CACHE_TTL`]) so that a proxied request costs no store query;
//! a revocation empties the cache of every node it can reach
//! ([`Authenticator::purge`]), and the cache's lifetime bounds how long an
//! unreachable node may go on accepting a revoked token.

use std::collections::HashMap;
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use berth_core::{ErrorCode, UserId};
use cookie::{Cookie, SameSite};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Response, StatusCode, Uri};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::forward::ConnInfo;
use crate::respond::{self, ProxyBody};

/// The user cookie: a user token, for the proxy only.
pub const USER_COOKIE: &str = "berth_token";
/// The user cookie's name over https in host mode: the `__Host-` prefix
/// makes browsers refuse it unless it is host-only, `Secure` and `Path=/`,
/// so a sibling subdomain cannot plant one.
pub const USER_COOKIE_HOST: &str = "__Host-berth_token";
/// The admin page's session cookie, for the API only.
pub const SESSION_COOKIE: &str = "berth_session";
/// The session cookie's name over https.
pub const SESSION_COOKIE_HOST: &str = "__Host-berth_session";
/// Every cookie name berth uses. None of them ever reaches a program, and
/// a program may set none of them.
pub const BERTH_COOKIES: [&str; 4] = [
    USER_COOKIE,
    USER_COOKIE_HOST,
    SESSION_COOKIE,
    SESSION_COOKIE_HOST,
];
/// The one-shot query parameter that becomes the user cookie.
pub const TOKEN_QUERY: &str = "berth_token";
/// The header an SSO proxy names the user in (`auth = "header"`).
pub static FORWARDED_USER: HeaderName = HeaderName::from_static("x-forwarded-user");
/// The header an SSO proxy proves itself with, when `[proxy] header_secret`
/// is set.
pub static PROXY_SECRET: HeaderName = HeaderName::from_static("x-berth-proxy-secret");
/// The header the admin page sends its CSRF token in.
pub static CSRF_HEADER: HeaderName = HeaderName::from_static("x-berth-csrf");

/// The header a node proves itself with on node-to-node calls: the
/// cluster secret (design §8.2).
pub static CLUSTER_SECRET: HeaderName = HeaderName::from_static("x-berth-cluster-secret");
/// The user a request forwarded by another node acts for. Believed only
/// together with a valid [`CLUSTER_SECRET`].
pub static CLUSTER_USER: HeaderName = HeaderName::from_static("x-berth-forwarded-user");

/// A secret shared with a peer (another node, or the SSO proxy) and sent in
/// a header. Kept as its SHA-256 so a presented value is compared in
/// constant time whatever its length.
#[derive(Clone)]
pub struct SharedSecret {
    hash: TokenHash,
    header: HeaderValue,
}

/// The secret the nodes of a cluster share.
pub type ClusterSecret = SharedSecret;

impl std::fmt::Debug for SharedSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedSecret(…)")
    }
}

/// A secret that cannot be sent in an HTTP header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a shared secret must be visible ASCII without spaces (it is sent as an HTTP header)")]
pub struct InvalidSecret;

/// The old name of [`InvalidSecret`].
pub type InvalidClusterSecret = InvalidSecret;

impl SharedSecret {
    pub fn new(secret: &str) -> Result<Self, InvalidSecret> {
        let secret = secret.trim();
        if secret.is_empty() || !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(InvalidSecret);
        }
        let mut header = HeaderValue::from_str(secret).map_err(|_| InvalidSecret)?;
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
        self.verify_in(headers, &CLUSTER_SECRET)
    }

    /// Whether `headers` carry exactly one `name` header, holding the
    /// secret.
    pub fn verify_in(&self, headers: &HeaderMap, name: &HeaderName) -> bool {
        let mut values = headers.get_all(name).iter();
        match (values.next(), values.next()) {
            (Some(value), None) => self.matches(value.as_bytes()),
            _ => false,
        }
    }

    /// The value to send in the header.
    pub fn header_value(&self) -> &HeaderValue {
        &self.header
    }
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    Admin,
    /// The holder of user token `token_id` (its public id).
    User {
        user: UserId,
        token_id: String,
    },
}

impl Caller {
    /// May this caller act on `user`'s own resources?
    pub fn may_act_for(&self, user: &UserId) -> bool {
        match self {
            Caller::Admin => true,
            Caller::User { user: own, .. } => own == user,
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

    /// Constant-time equality.
    pub fn ct_eq(&self, other: &TokenHash) -> bool {
        self.0.ct_eq(&other.0).into()
    }
}

impl std::fmt::Debug for TokenHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Short on purpose: a hash in a log line is enough to correlate.
        write!(f, "TokenHash({}…)", hex::encode(&self.0[..4]))
    }
}

/// The token in `Authorization: Bearer …`, if any.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
}

fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    // The scheme is case-insensitive (RFC 9110 §11.1).
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// berth's cookies in a request, by name. Empty values count as absent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BerthCookies<'a> {
    pub user: Option<&'a str>,
    pub user_host: Option<&'a str>,
    pub session: Option<&'a str>,
    pub session_host: Option<&'a str>,
}

impl<'a> BerthCookies<'a> {
    /// The user cookie: the `__Host-` one first, since no other origin can
    /// have set it.
    pub fn user_token(&self) -> Option<&'a str> {
        self.user_host.or(self.user)
    }

    /// The session cookie, the `__Host-` one first.
    pub fn session_token(&self) -> Option<&'a str> {
        self.session_host.or(self.session)
    }

    fn slot(&mut self, name: &str) -> Option<&mut Option<&'a str>> {
        match name {
            USER_COOKIE => Some(&mut self.user),
            USER_COOKIE_HOST => Some(&mut self.user_host),
            SESSION_COOKIE => Some(&mut self.session),
            SESSION_COOKIE_HOST => Some(&mut self.session_host),
            _ => None,
        }
    }
}

/// A request carried two cookies of one of berth's names. Which one the
/// browser meant cannot be told (one may have been planted by another
/// site's script), so the request is refused rather than guessed at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the request carries two {0} cookies; berth cannot tell which one is yours")]
pub struct DuplicateCookie(pub &'static str);

/// berth's cookies among the request's `Cookie` headers.
pub fn berth_cookies(headers: &HeaderMap) -> Result<BerthCookies<'_>, DuplicateCookie> {
    let mut found = BerthCookies::default();
    for value in headers.get_all(header::COOKIE) {
        let Ok(value) = value.to_str() else { continue };
        for cookie in Cookie::split_parse(value).flatten() {
            let (Some(name), Some(raw)) = (cookie.name_raw(), cookie.value_raw()) else {
                continue;
            };
            let Some(slot) = found.slot(name) else {
                continue;
            };
            if slot.is_some() {
                let name = BERTH_COOKIES
                    .into_iter()
                    .find(|n| *n == name)
                    .unwrap_or(USER_COOKIE);
                return Err(DuplicateCookie(name));
            }
            let raw = raw.trim_matches('"');
            *slot = Some(raw);
        }
    }
    // An empty value is a deleted cookie, not a credential; it still
    // counted above, so two of one name are refused whatever they hold.
    for slot in [
        &mut found.user,
        &mut found.user_host,
        &mut found.session,
        &mut found.session_host,
    ] {
        if slot.is_some_and(str::is_empty) {
            *slot = None;
        }
    }
    Ok(found)
}

/// Whether a response's `Set-Cookie` value would set one of berth's
/// cookies. Names are compared without regard to case (browsers treat the
/// `__Host-` prefix so), and a nameless cookie whose value starts with one
/// of berth's names counts too: browsers send `=berth_token=x` as
/// `berth_token=x`.
pub fn sets_berth_cookie(set_cookie: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(set_cookie) else {
        // Not UTF-8: no cookie crate or browser reads a berth name in it
        // reliably; refusing it costs the program nothing legitimate.
        return true;
    };
    let name = match Cookie::parse(text) {
        Ok(cookie) => cookie.name().to_owned(),
        Err(_) => {
            // No name (`=berth_token=x`) or no `=` at all: what a browser
            // would send is the value itself.
            let pair = text.split(';').next().unwrap_or_default().trim();
            let pair = pair.strip_prefix('=').unwrap_or(pair).trim_start();
            pair.split('=').next().unwrap_or_default().trim().to_owned()
        }
    };
    BERTH_COOKIES.iter().any(|b| b.eq_ignore_ascii_case(&name))
}

/// Removes every `Set-Cookie` of the response that would set one of
/// berth's cookies: a program must not be able to log its user out, fix
/// their login, or plant a cookie for a sibling subdomain.
pub fn drop_berth_set_cookies(headers: &mut HeaderMap) {
    if !headers.contains_key(header::SET_COOKIE) {
        return;
    }
    let all: Vec<HeaderValue> = headers
        .get_all(header::SET_COOKIE)
        .iter()
        .cloned()
        .collect();
    if !all.iter().any(|v| sets_berth_cookie(v.as_bytes())) {
        return;
    }
    headers.remove(header::SET_COOKIE);
    for value in all {
        if sets_berth_cookie(value.as_bytes()) {
            tracing::debug!("dropped a program's Set-Cookie for one of berth's cookies");
        } else {
            headers.append(header::SET_COOKIE, value);
        }
    }
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

/// The `Location` of the redirect that drops `?berth_token=`: a path on the
/// same host, never a network-path reference. Leading slashes (and the
/// backslashes browsers read as slashes) collapse into one, so
/// `//evil.example/x` becomes `/evil.example/x`.
pub fn same_host_location(path: &str, query: &str) -> String {
    let rest = path.trim_start_matches(['/', '\\']);
    let mut location = String::with_capacity(rest.len() + query.len() + 2);
    location.push('/');
    location.push_str(rest);
    if !query.is_empty() {
        location.push('?');
        location.push_str(query);
    }
    location
}

/// Why a credential could not be checked (not: why it was refused).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("the token store is unavailable: {0}")]
    Store(String),
}

/// A live user token, as the store knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserTokenInfo {
    pub user: UserId,
    /// The token's public id.
    pub id: String,
    /// How long it has left, by the store's clock.
    pub expires_in: Duration,
}

/// Where user token hashes are looked up; the binary implements it over the
/// store.
#[async_trait]
pub trait TokenStore: Send + Sync + 'static {
    /// The live user token whose hash (lowercase hex SHA-256) this is.
    async fn lookup(&self, hash_hex: &str) -> Result<Option<UserTokenInfo>, AuthError>;
}

/// What a token allows on a given user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The admin token: everything, where the admin token is accepted.
    Admin,
    /// A token of the user themself.
    Allowed,
    /// A valid token of another user.
    Forbidden,
    /// No valid token.
    Unauthenticated,
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

/// hash → user, bounded, with a time to live no longer than the token's
/// own. Reads take a shared lock; writes happen only on a miss and on a
/// purge.
struct TokenCache {
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
    fn new(capacity: usize, ttl: Duration) -> Self {
        Self {
            entries: RwLock::new(HashMap::new()),
            generation: AtomicU64::new(0),
            capacity,
            ttl,
        }
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn get<T>(&self, hash: &TokenHash, f: impl FnOnce(&UserId, &str) -> T) -> Option<T> {
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let entry = entries.get(hash)?;
        (Instant::now() < entry.until).then(|| f(&entry.user, &entry.id))
    }

    fn insert(&self, hash: TokenHash, info: &UserTokenInfo, generation: u64) {
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

    fn purge(&self) {
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::AcqRel);
        entries.clear();
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.read().map(|e| e.len()).unwrap_or(0)
    }
}

/// A `trusted_proxies` entry that is not an IP address or CIDR block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an IP address or CIDR block")]
pub struct InvalidIpNet(pub String);

/// `10.0.0.0/8`, or a bare address (a /32 or /128).
fn parse_net(s: &str) -> Result<ipnet::IpNet, InvalidIpNet> {
    let s = s.trim();
    s.parse::<ipnet::IpNet>()
        .or_else(|_| s.parse::<IpAddr>().map(ipnet::IpNet::from))
        .map_err(|_| InvalidIpNet(s.to_owned()))
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
pub struct TrustedProxies(Vec<ipnet::IpNet>);

impl TrustedProxies {
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, InvalidIpNet> {
        entries
            .iter()
            .map(|e| parse_net(e.as_ref()))
            .collect::<Result<_, _>>()
            .map(Self)
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.0.iter().any(|net| net.contains(&ip))
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
/// the program must never see them (a token would let it act as its user
/// in the API, a secret as a node or the SSO proxy). berth's cookies and
/// the proxy secret always go; `Authorization` only if berth consumed it
/// (otherwise it is the program's own).
pub fn strip_credentials(headers: &mut HeaderMap, used: Credential) {
    if used == Credential::Bearer {
        headers.remove(header::AUTHORIZATION);
    }
    if used == Credential::Cluster {
        // The cluster secret would let the program act as any node.
        headers.remove(&CLUSTER_SECRET);
        headers.remove(&CLUSTER_USER);
    }
    headers.remove(&PROXY_SECRET);
    let carries_ours = headers.get_all(header::COOKIE).iter().any(|v| {
        // Every berth cookie name contains "berth_".
        v.as_bytes().windows(6).any(|w| w == b"berth_")
    });
    if !carries_ours {
        return;
    }
    let kept: Vec<String> = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|pair| !pair.is_empty())
        .filter(|pair| match Cookie::parse(*pair) {
            Ok(cookie) => !BERTH_COOKIES.contains(&cookie.name()),
            // Not a name=value pair: not ours, and passed on as it came.
            Err(_) => true,
        })
        .map(str::to_owned)
        .collect();
    headers.remove(header::COOKIE);
    if let Ok(value) = HeaderValue::try_from(kept.join("; ")) {
        if !value.is_empty() {
            headers.insert(header::COOKIE, value);
        }
    }
}

/// Where the user cookie lives: the origin a request was routed by.
/// Borrowed from the request, so that judging a request allocates nothing;
/// the cookie's path is built only when a cookie is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CookieScope<'a> {
    /// `<slug>.<base_domain>`: a host-only cookie for `Path=/`.
    Host,
    /// `/u/<segment>/` on a shared host: `Path=` that base path, with the
    /// segment exactly as the request spelled it (the browser compares
    /// paths byte for byte).
    Path { segment: &'a str },
}

impl CookieScope<'_> {
    fn path(&self) -> String {
        match self {
            CookieScope::Host => "/".to_owned(),
            CookieScope::Path { segment } => format!("/u/{segment}/"),
        }
    }

    /// The user cookie's name: `__Host-` prefixed over https in host mode.
    fn user_cookie_name(&self, https: bool) -> &'static str {
        match self {
            CookieScope::Host if https => USER_COOKIE_HOST,
            _ => USER_COOKIE,
        }
    }

    /// The `Set-Cookie` value that stores `token` in a browser.
    pub fn user_cookie(&self, token: &str, https: bool) -> Cookie<'static> {
        Cookie::build((self.user_cookie_name(https), token.to_owned()))
            .path(self.path())
            .http_only(true)
            .same_site(SameSite::Lax)
            .secure(https)
            .build()
    }

    /// `Set-Cookie` values that delete the user cookie under every name and
    /// path berth has used here, including the `Path=/` cookie of versions
    /// before per-user paths. In host mode, `parent_domain` (the base
    /// domain) also deletes a plain cookie another subdomain's script
    /// planted for the whole domain; the `__Host-` cookie of https cannot
    /// be planted at all.
    pub fn user_cookie_removals(
        &self,
        https: bool,
        parent_domain: Option<&str>,
    ) -> Vec<Cookie<'static>> {
        let mut removals = Vec::new();
        let mut paths = vec![("/".to_owned(), None)];
        match self {
            CookieScope::Path { .. } => paths.push((self.path(), None)),
            CookieScope::Host => {
                if let Some(domain) = parent_domain {
                    paths.push(("/".to_owned(), Some(domain.to_owned())));
                }
            }
        }
        for (path, domain) in paths {
            let mut builder = Cookie::build((USER_COOKIE, ""))
                .path(path)
                .http_only(true)
                .same_site(SameSite::Lax)
                .secure(https);
            if let Some(domain) = domain {
                builder = builder.domain(domain);
            }
            let mut cookie = builder.build();
            cookie.make_removal();
            removals.push(cookie);
        }
        if https && *self == CookieScope::Host {
            let mut cookie = Cookie::build((USER_COOKIE_HOST, ""))
                .path("/")
                .http_only(true)
                .same_site(SameSite::Lax)
                .secure(true)
                .build();
            cookie.make_removal();
            removals.push(cookie);
        }
        removals
    }
}

/// Whether the client reached berth over https: said by a trusted proxy in
/// `X-Forwarded-Proto` (berth itself listens on plain HTTP).
pub fn is_https(headers: &HeaderMap, conn: &ConnInfo) -> bool {
    conn.trusted
        && headers
            .get("x-forwarded-proto")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"))
}

/// What the gate decided about a request it lets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    pub credential: Credential,
    /// Pass `X-Forwarded-User` on to the program: it came from the trusted
    /// SSO proxy (header mode).
    pub keep_forwarded_user: bool,
}

/// The proxy's auth layer: decides whether a request may reach `user`.
#[derive(Debug, Clone)]
pub struct Gate {
    auth: Authenticator,
    mode: AuthMode,
    trusted: TrustedProxies,
    cluster: Option<ClusterSecret>,
    header_secret: Option<SharedSecret>,
    /// The base domain of host routing, for deleting planted cookies.
    base_domain: Option<String>,
}

impl Gate {
    pub fn new(auth: Authenticator, mode: AuthMode, trusted: TrustedProxies) -> Self {
        Self {
            auth,
            mode,
            trusted,
            cluster: None,
            header_secret: None,
            base_domain: None,
        }
    }

    /// The base domain apps live under (host routing), if any.
    pub fn with_base_domain(mut self, base_domain: Option<&str>) -> Self {
        self.base_domain = base_domain.map(str::to_owned);
        self
    }

    /// Also accepts requests forwarded by another node: a valid cluster
    /// secret plus [`CLUSTER_USER`] naming the target user.
    pub fn with_cluster(mut self, secret: ClusterSecret) -> Self {
        self.cluster = Some(secret);
        self
    }

    /// In header mode, believes `X-Forwarded-User` only next to this secret
    /// in [`PROXY_SECRET`], so that another process on a trusted address
    /// cannot name a user.
    pub fn with_header_secret(mut self, secret: Option<SharedSecret>) -> Self {
        self.header_secret = secret;
        self
    }

    pub fn trusted(&self) -> &TrustedProxies {
        &self.trusted
    }

    /// The `X-Forwarded-User` header, if it is to be believed: header mode,
    /// a trusted peer, and the proxy secret when one is configured.
    fn forwarded_user<'h>(
        &self,
        headers: &'h HeaderMap,
        conn: &ConnInfo,
    ) -> Option<&'h HeaderValue> {
        if self.mode != AuthMode::Header || !conn.trusted {
            return None;
        }
        if let Some(secret) = &self.header_secret {
            if !secret.verify_in(headers, &PROXY_SECRET) {
                return None;
            }
        }
        headers.get(&FORWARDED_USER)
    }

    /// `Ok` lets the request through and says which credential did; `Err`
    /// is the answer instead: a 400, 401 or 403, or the redirect that
    /// turns `?berth_token=` into the user cookie of `scope`.
    ///
    /// A Bearer token that is not a berth token may belong to the app, so
    /// the cookie is tried next.
    pub async fn check(
        &self,
        headers: &HeaderMap,
        uri: &Uri,
        conn: &ConnInfo,
        user: &UserId,
        scope: &CookieScope<'_>,
    ) -> Result<Pass, Response<ProxyBody>> {
        let navigation = respond::is_navigation(headers);
        if headers.get_all(&FORWARDED_USER).iter().nth(1).is_some() {
            // Which of two names would the app believe? Refuse instead.
            return Err(respond::code_error(
                ErrorCode::InvalidRequest,
                "the request carries two X-Forwarded-User headers",
            ));
        }
        let pass = |credential| Pass {
            credential,
            keep_forwarded_user: self.forwarded_user(headers, conn).is_some(),
        };
        if let Some(secret) = &self.cluster {
            if let Some(presented) = headers.get(&CLUSTER_SECRET) {
                // Whoever sends the header claims to be a node: it alone
                // decides, so a wrong secret is a 401 even next to a token.
                if !secret.matches(presented.as_bytes()) {
                    return Err(respond::unauthorized(navigation));
                }
                return match headers.get(&CLUSTER_USER) {
                    Some(name) if name.as_bytes() == user.as_str().as_bytes() => {
                        Ok(pass(Credential::Cluster))
                    }
                    _ => Err(respond::forbidden(navigation)),
                };
            }
        }
        let cookies = match berth_cookies(headers) {
            Ok(cookies) => cookies,
            Err(duplicate) => {
                let parent = self.base_domain.as_deref();
                return Err(duplicate_cookie(&duplicate, scope, parent, headers, conn));
            }
        };
        if let Some(q) = uri.query().and_then(query_token) {
            return Err(self
                .exchange_query_token(q, uri, conn, headers, user, scope, navigation)
                .await);
        }
        if let Some(token) = bearer(headers) {
            match self.auth.access(token, user).await {
                // API clients (and berth's own tests) send the admin token
                // as a header; a browser never does on its own.
                Ok(Access::Admin | Access::Allowed) => return Ok(pass(Credential::Bearer)),
                Ok(Access::Forbidden) => return Err(respond::forbidden(navigation)),
                Ok(Access::Unauthenticated) => {}
                Err(e) => return Err(store_unavailable(&e)),
            }
        }
        if let Some(token) = cookies.user_token() {
            match self.auth.access(token, user).await {
                Ok(Access::Allowed) => return Ok(pass(Credential::Cookie)),
                Ok(Access::Forbidden) => return Err(respond::forbidden(navigation)),
                // The admin token never counts from a cookie: any page the
                // browser opens could ride on it.
                Ok(Access::Admin | Access::Unauthenticated) => {}
                Err(e) => return Err(store_unavailable(&e)),
            }
        }
        if let Some(name) = self.forwarded_user(headers, conn) {
            return if name.as_bytes() == user.as_str().as_bytes() {
                Ok(pass(Credential::ForwardedUser))
            } else {
                Err(respond::forbidden(navigation))
            };
        }
        Err(respond::unauthorized(navigation))
    }

    #[allow(clippy::too_many_arguments)]
    async fn exchange_query_token(
        &self,
        q: QueryToken,
        uri: &Uri,
        conn: &ConnInfo,
        headers: &HeaderMap,
        user: &UserId,
        scope: &CookieScope<'_>,
        navigation: bool,
    ) -> Response<ProxyBody> {
        match self.auth.access(&q.token, user).await {
            Ok(Access::Allowed) => {}
            Ok(Access::Admin) => {
                return respond::forbidden_because(
                    navigation,
                    "The admin token cannot open an app in a browser: it would become a cookie \
                     that this app's pages could use. Open a link scoped to this user instead \
                     (berth token USER).",
                );
            }
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
        let https = is_https(headers, conn);
        let cookie = scope.user_cookie(&q.token, https).to_string();
        let location = same_host_location(uri.path(), &q.rest);
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

/// 400 for two cookies of one berth name, deleting the user cookie under
/// each name and path berth uses here so that the next link works.
fn duplicate_cookie(
    duplicate: &DuplicateCookie,
    scope: &CookieScope<'_>,
    parent_domain: Option<&str>,
    headers: &HeaderMap,
    conn: &ConnInfo,
) -> Response<ProxyBody> {
    let mut response = respond::code_error(
        ErrorCode::InvalidRequest,
        &format!(
            "{duplicate}; berth has deleted its cookies here: open your link (with ?berth_token=) again"
        ),
    );
    for removal in scope.user_cookie_removals(is_https(headers, conn), parent_domain) {
        if let Ok(value) = HeaderValue::try_from(removal.to_string()) {
            response.headers_mut().append(header::SET_COOKIE, value);
        }
    }
    response
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
    use std::sync::atomic::AtomicUsize;

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

    fn cookies(values: &[&'static str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(header::COOKIE, HeaderValue::from_static(v));
        }
        headers
    }

    #[test]
    fn bearer_tokens_are_read_case_insensitively() {
        let mut headers = HeaderMap::new();
        assert_eq!(bearer(&headers), None);
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic abc"));
        assert_eq!(bearer(&headers), None);
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer  frombearer "),
        );
        assert_eq!(bearer(&headers), Some("frombearer"));
    }

    #[test]
    fn berth_cookies_are_found_by_exact_name() {
        let headers = cookies(&[
            "a=b; berth_token=plain; Berth_Token=other",
            "__Host-berth_token=\"hosted\"; berth_session=s",
        ]);
        let found = berth_cookies(&headers).unwrap();
        assert_eq!(found.user, Some("plain"));
        assert_eq!(found.user_host, Some("hosted"));
        assert_eq!(found.user_token(), Some("hosted"), "__Host- wins");
        assert_eq!(found.session_token(), Some("s"));
        let headers = cookies(&["other=1; berth_token="]);
        let none = berth_cookies(&headers).unwrap();
        assert_eq!(none.user_token(), None, "an empty value is no credential");
        assert_eq!(
            berth_cookies(&HeaderMap::new()).unwrap(),
            BerthCookies::default()
        );
    }

    #[test]
    fn two_cookies_of_one_name_are_refused() {
        for values in [
            &["berth_token=a; berth_token=b"][..],
            &["berth_token=a", "x=1; berth_token=b"],
            &["berth_session=a; berth_session="],
            &["__Host-berth_token=a; __Host-berth_token=a"],
        ] {
            assert!(berth_cookies(&cookies(values)).is_err(), "{values:?}");
        }
        let err = berth_cookies(&cookies(&["berth_token=a; berth_token=b"])).unwrap_err();
        assert_eq!(err, DuplicateCookie(USER_COOKIE));
        assert!(err.to_string().contains("two berth_token cookies"), "{err}");
        // One of each name is fine.
        assert!(berth_cookies(&cookies(&["berth_token=a; __Host-berth_token=b"])).is_ok());
    }

    #[test]
    fn programs_cannot_set_berths_cookies() {
        for ours in [
            "berth_token=x; Path=/u/",
            "berth_token=x",
            " berth_token = x ; Domain=example.test",
            "__Host-berth_token=x; Path=/; Secure",
            "__host-berth_token=x; Path=/; Secure",
            "BERTH_SESSION=x",
            "=berth_token=x",
            "= berth_session=x; Path=/",
            "berth_token",
        ] {
            assert!(sets_berth_cookie(ours.as_bytes()), "{ours:?}");
        }
        for theirs in [
            "app=1; Path=/",
            "berth_token_x=1",
            "xberth_token=1",
            "session=berth_token",
        ] {
            assert!(!sets_berth_cookie(theirs.as_bytes()), "{theirs:?}");
        }
        assert!(sets_berth_cookie(b"\xffberth_token=1"), "not UTF-8");

        let mut h = HeaderMap::new();
        h.append(header::SET_COOKIE, HeaderValue::from_static("app=1"));
        h.append(
            header::SET_COOKIE,
            HeaderValue::from_static("berth_token=evil; Path=/"),
        );
        h.append(header::SET_COOKIE, HeaderValue::from_static("other=2"));
        drop_berth_set_cookies(&mut h);
        let left: Vec<_> = h.get_all(header::SET_COOKIE).iter().collect();
        assert_eq!(left, ["app=1", "other=2"]);
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
    fn redirects_stay_on_the_same_host() {
        for (path, query, want) in [
            ("/u/alice/", "", "/u/alice/"),
            ("/lab", "a=1", "/lab?a=1"),
            ("//evil.example/x", "", "/evil.example/x"),
            ("///evil.example", "q", "/evil.example?q"),
            ("/\\evil.example", "", "/evil.example"),
            ("\\/evil.example", "", "/evil.example"),
            ("/", "", "/"),
            ("", "", "/"),
        ] {
            assert_eq!(same_host_location(path, query), want, "{path:?}");
        }
    }

    #[test]
    fn berth_credentials_never_reach_the_instance() {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer x"));
        h.append(
            header::COOKIE,
            HeaderValue::from_static("a=1; berth_token=secret; __Host-berth_token=s2"),
        );
        h.append(
            header::COOKIE,
            HeaderValue::from_static("b=2; berth_session=s3; justavalue"),
        );
        h.insert(PROXY_SECRET.clone(), HeaderValue::from_static("sso"));
        strip_credentials(&mut h, Credential::Cookie);
        assert_eq!(h[header::AUTHORIZATION], "Bearer x", "not ours: the app's");
        assert_eq!(h[header::COOKIE], "a=1; b=2; justavalue");
        assert!(!h.contains_key(&PROXY_SECRET));
        strip_credentials(&mut h, Credential::Bearer);
        assert!(!h.contains_key(header::AUTHORIZATION));
        let mut only = cookies(&["berth_token=secret"]);
        strip_credentials(&mut only, Credential::Cookie);
        assert!(!only.contains_key(header::COOKIE));
    }

    #[test]
    fn user_cookies_are_scoped_to_their_origin_or_base_path() {
        let host = CookieScope::Host.user_cookie("t0k", true).to_string();
        for part in [
            "__Host-berth_token=t0k",
            "Path=/",
            "HttpOnly",
            "SameSite=Lax",
            "Secure",
        ] {
            assert!(host.contains(part), "{host}");
        }
        assert!(!host.contains("Domain"), "host-only: {host}");
        let plain = CookieScope::Host.user_cookie("t0k", false).to_string();
        assert!(plain.starts_with("berth_token=t0k"), "{plain}");
        assert!(!plain.contains("Secure"), "{plain}");
        let path = CookieScope::Path { segment: "a%40b" }
            .user_cookie("t0k", false)
            .to_string();
        for part in [
            "berth_token=t0k",
            "Path=/u/a%40b/",
            "HttpOnly",
            "SameSite=Lax",
        ] {
            assert!(path.contains(part), "{path}");
        }
        let removals: Vec<String> = CookieScope::Path { segment: "a" }
            .user_cookie_removals(false, None)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(removals.len(), 2, "{removals:?}");
        assert!(
            removals.iter().all(|r| r.contains("Max-Age=0")),
            "{removals:?}"
        );
        assert!(
            removals.iter().any(|r| r.contains("Path=/u/a/")),
            "{removals:?}"
        );
        let removals: Vec<String> = CookieScope::Host
            .user_cookie_removals(true, Some("berth.example"))
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(removals.len(), 3, "{removals:?}");
        assert!(
            removals.iter().any(|r| r.contains("Domain=berth.example")),
            "a cookie planted for the whole domain is deleted: {removals:?}"
        );
        assert!(
            removals
                .iter()
                .any(|r| r.starts_with("__Host-berth_token=") && r.contains("Secure")),
            "{removals:?}"
        );
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
    fn trusted_proxies_match_addresses_and_blocks() {
        let trusted =
            TrustedProxies::parse(&["127.0.0.1", "fd00::/8", "10.0.0.0/8", " 192.168.1.7 "])
                .unwrap();
        assert!(trusted.contains("127.0.0.1".parse().unwrap()));
        assert!(trusted.contains("fd12::1".parse().unwrap()));
        assert!(trusted.contains("10.1.2.3".parse().unwrap()));
        assert!(
            trusted.contains("::ffff:10.1.2.3".parse().unwrap()),
            "v4-mapped"
        );
        assert!(trusted.contains("192.168.1.7".parse().unwrap()));
        assert!(!trusted.contains("127.0.0.2".parse().unwrap()));
        assert!(!trusted.contains("11.0.0.1".parse().unwrap()));
        let all = TrustedProxies::parse(&["0.0.0.0/0"]).unwrap();
        assert!(all.contains("192.168.0.1".parse().unwrap()));
        for bad in ["10.0.0.0/33", "x", "::1/129", "1.2.3.4/", ""] {
            assert_eq!(
                TrustedProxies::parse(&[bad]).unwrap_err(),
                InvalidIpNet(bad.trim().to_owned()),
                "{bad}"
            );
        }
    }

    #[test]
    fn shared_secrets_match_exactly_and_never_reach_the_program() {
        assert!(SharedSecret::new("").is_err());
        assert!(SharedSecret::new("has space").is_err());
        assert!(SharedSecret::new("tab\tin").is_err());
        let secret = SharedSecret::new("s3cret").unwrap();
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
        headers.append(CLUSTER_SECRET.clone(), secret.header_value().clone());
        assert!(!secret.verify(&headers), "two secret headers are refused");
        strip_credentials(&mut headers, Credential::Cluster);
        assert!(headers.get(&CLUSTER_SECRET).is_none());
        assert!(headers.get(&CLUSTER_USER).is_none());
    }
}
