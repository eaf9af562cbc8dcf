//! Who is calling the API, and the credentials berth mints.
//!
//! The API accepts two credentials and nothing else:
//!
//! * `Authorization: Bearer <token>`: the admin token or a user token,
//!   checked by `berth_proxy::auth` (shared with the proxy: same rules, same
//!   cache);
//! * the admin page's **session cookie** ([`SESSION_COOKIE`]), made by
//!   `POST /api/v1/session` from the admin token. For any method but GET and
//!   HEAD it counts only with an `Origin` naming the berth host and the
//!   session's CSRF token in `X-Berth-CSRF`, which a page on another origin
//!   (a user's app on a sibling subdomain included) can neither send
//!   without a preflight nor know. Sessions exist only when no app shares
//!   the API's origin (path routing off): a same-origin app could read and
//!   send whatever the admin page can.
//!
//! The user cookie (`berth_token`) is the proxy's, for one user's app, and
//! is never accepted here.
//!
//! Secrets are stored as SHA-256 hashes: the admin token's in memory, user
//! tokens' and sessions' in the store. A session's CSRF token is derived
//! from its secret, so it needs no storage of its own.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use async_trait::async_trait;
use axum::http::{HeaderMap, Method, header};
use berth_core::{UnixMillis, UserId};
use berth_proxy::auth::{
    AuthError, CSRF_HEADER, SESSION_COOKIE, SESSION_COOKIE_HOST, TokenHash, TokenStore,
    UserTokenInfo, bearer, berth_cookies,
};
use berth_store::{AuthStore, MintOutcome, NewToken, SessionOwner, StoreError, TokenRecord};
use cookie::{Cookie, SameSite};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

// One implementation for API and proxy: token extraction, the constant-time
// admin compare and the cached user-token lookup live in berth_proxy.
pub use berth_proxy::auth::Caller;

/// The name of the admin token file inside the data dir.
pub const ADMIN_TOKEN_FILE: &str = "admin.token";

/// User tokens, looked up in the store (only on a cache miss).
struct StoreTokens {
    store: Arc<dyn AuthStore>,
    /// How long a sign-in's tokens may live (each is capped by the
    /// sign-in's root token).
    session_ttl: Duration,
}

#[async_trait]
impl TokenStore for StoreTokens {
    async fn redeem_hop(
        &self,
        code_hash_hex: &str,
    ) -> Result<Option<berth_proxy::auth::Redeemed>, AuthError> {
        let unavailable = |e: StoreError| AuthError::Store(e.to_string());
        let Some((user, root_id)) = self
            .store
            .take_login_hop(code_hash_hex)
            .await
            .map_err(unavailable)?
        else {
            return Ok(None);
        };
        match mint_login_token(self.store.as_ref(), &user, Some(&root_id), self.session_ttl)
            .await
            .map_err(unavailable)?
        {
            Some((token, _)) => Ok(Some(berth_proxy::auth::Redeemed { user, token })),
            // The sign-in ended (logout) between the code and its use.
            None => Ok(None),
        }
    }

    async fn lookup(&self, hash_hex: &str) -> Result<Option<UserTokenInfo>, AuthError> {
        let owner = self
            .store
            .use_token(hash_hex)
            .await
            .map_err(|e| AuthError::Store(e.to_string()))?;
        Ok(owner.map(|o| UserTokenInfo {
            // Measured by the store's clock, then counted down locally.
            expires_in: Duration::from_millis(
                u64::try_from(o.expires_at.saturating_sub(o.now)).unwrap_or(0),
            ),
            user: o.user,
            id: o.id,
        }))
    }
}

/// The `[auth]` settings, plus whether sessions may exist.
#[derive(Debug, Clone)]
pub struct AuthSettings {
    pub user_token_ttl: Duration,
    pub max_tokens_per_user: u32,
    pub token_cache: Duration,
    pub session_ttl: Duration,
    pub users_may_patch: bool,
    /// False while path routing puts apps on the API's origin.
    pub sessions: bool,
}

/// Why the API refuses a caller.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// 401: no valid credential.
    #[error("{0}")]
    Unauthenticated(String),
    /// 403: a valid credential that may not do this here.
    #[error("{0}")]
    Forbidden(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<AuthError> for Refusal {
    fn from(AuthError::Store(message): AuthError) -> Self {
        Refusal::Store(StoreError::Unavailable(message))
    }
}

/// What `POST /api/v1/session` made.
#[derive(Debug, Clone)]
pub struct NewSession {
    /// The `Set-Cookie` value.
    pub cookie: String,
    pub csrf_token: String,
    pub expires_at: UnixMillis,
}

/// A live session, found by the cookie a request carries.
#[derive(Debug, Clone)]
pub struct Session {
    secret_hash: String,
    pub csrf_token: String,
    pub expires_at: UnixMillis,
    pub owner: SessionOwner,
}

impl Session {
    /// Who the session acts as in the API.
    pub fn caller(&self) -> Caller {
        match (&self.owner.user, self.owner.admin) {
            (Some(user), false) => Caller::User {
                user: user.clone(),
                token_id: self.owner.token_id.clone().unwrap_or_default(),
            },
            _ => Caller::Admin,
        }
    }
}

/// Checks credentials, mints user tokens and sessions.
#[derive(Clone)]
pub struct Authenticator {
    shared: berth_proxy::auth::Authenticator,
    store: Arc<dyn AuthStore>,
    settings: AuthSettings,
}

impl Authenticator {
    pub fn new(admin_token: &str, store: Arc<dyn AuthStore>, settings: AuthSettings) -> Self {
        Self {
            shared: berth_proxy::auth::Authenticator::with_cache(
                admin_token,
                Arc::new(StoreTokens {
                    store: store.clone(),
                    session_ttl: settings.session_ttl,
                }),
                berth_proxy::auth::DEFAULT_CACHE_ENTRIES,
                settings.token_cache,
            ),
            store,
            settings,
        }
    }

    /// The shared checker (and its cache), for the proxy.
    pub fn shared(&self) -> berth_proxy::auth::Authenticator {
        self.shared.clone()
    }

    pub fn settings(&self) -> &AuthSettings {
        &self.settings
    }

    /// Forgets this node's cached user tokens (after a revocation).
    pub fn purge_cache(&self) {
        self.shared.purge();
    }

    /// The caller of an API request: a Bearer token, else the admin
    /// session cookie under the same-origin and CSRF rules.
    pub async fn caller(&self, method: &Method, headers: &HeaderMap) -> Result<Caller, Refusal> {
        if let Some(token) = bearer(headers) {
            // An explicit token decides alone: a wrong one is not rescued
            // by a cookie the browser happened to send along.
            return self.shared.identify(token).await?.ok_or_else(|| {
                Refusal::Unauthenticated(
                    "the Bearer token is not valid (unknown, expired or revoked)".into(),
                )
            });
        }
        let cookies = berth_cookies(headers);
        if cookies.session_tokens().next().is_some() {
            return Ok(self.session(method, headers).await?.caller());
        }
        if cookies.user_tokens().next().is_some() {
            return Err(Refusal::Unauthenticated(
                "the API does not accept the berth_token cookie (it opens one user's app, nothing \
                 else); send Authorization: Bearer <token>"
                    .into(),
            ));
        }
        Err(Refusal::Unauthenticated(
            "a valid token is required: Authorization: Bearer <token>".into(),
        ))
    }

    /// The live session of the request's session cookie, checked for
    /// `method`: any `Origin` must be the berth host, and a method other
    /// than GET/HEAD needs that `Origin` and the CSRF header.
    pub async fn session(&self, method: &Method, headers: &HeaderMap) -> Result<Session, Refusal> {
        // Every session cookie is tried, in the order sent: an app's script
        // on a sibling subdomain can plant one for the whole domain over
        // plain HTTP, and it must neither shadow the user's own nor lock
        // them out.
        let cookies = berth_cookies(headers);
        let mut live = None;
        let mut any = false;
        for secret in cookies.session_tokens() {
            any = true;
            let secret_hash = TokenHash::of(secret).to_hex();
            if let Some(record) = self.store.session(&secret_hash).await? {
                // An admin session never counts while apps share the
                // API's origin (none can be made then; this holds one
                // made before path routing was switched on).
                if record.owner.admin && !self.settings.sessions {
                    continue;
                }
                live = Some((secret, secret_hash, record));
                break;
            }
        }
        let Some((secret, secret_hash, record)) = live else {
            return Err(Refusal::Unauthenticated(if !self.settings.sessions {
                SESSIONS_OFF.into()
            } else if any {
                "the session has ended; sign in again".into()
            } else {
                "no session cookie".into()
            }));
        };
        let expires_at = record.expires_at;
        let csrf_token = csrf_token_for(secret);
        let safe = matches!(*method, Method::GET | Method::HEAD);
        match origin_matches_host(headers) {
            Some(true) => {}
            None if safe => {}
            Some(false) | None => {
                return Err(Refusal::Forbidden(
                    "the session cookie counts only on requests from the berth host's own pages \
                     (Origin must be this host)"
                        .into(),
                ));
            }
        }
        if !safe {
            let presented = headers
                .get(&CSRF_HEADER)
                .map(|v| v.as_bytes())
                .unwrap_or_default();
            if !bool::from(presented.ct_eq(csrf_token.as_bytes())) {
                return Err(Refusal::Forbidden(
                    "the session cookie needs the session's CSRF token in X-Berth-CSRF for this \
                     method"
                        .into(),
                ));
            }
        }
        Ok(Session {
            secret_hash,
            csrf_token,
            expires_at,
            owner: record.owner,
        })
    }

    /// Starts an admin session: a random secret for the cookie (its hash
    /// in the store) and the CSRF token derived from it.
    pub async fn start_session(&self, https: bool) -> Result<NewSession, Refusal> {
        if !self.settings.sessions {
            return Err(Refusal::Forbidden(SESSIONS_OFF.into()));
        }
        let owner = SessionOwner {
            user: None,
            admin: true,
            token_id: None,
        };
        // Strict: the admin page is only ever opened from itself.
        self.open_session(&owner, SameSite::Strict, https).await
    }

    /// Starts the session of a user who signed in at the provider. An
    /// admin-group member gets an admin session only where admin sessions
    /// may exist (apps on their own origins). `Lax`, unlike the admin
    /// token's session: the sign-in arrives by a redirect from the
    /// provider's site, and a `Strict` cookie would not be sent on the
    /// rest of that redirect chain.
    pub async fn start_user_session(
        &self,
        mut owner: SessionOwner,
        https: bool,
    ) -> Result<NewSession, Refusal> {
        owner.admin &= self.settings.sessions;
        self.open_session(&owner, SameSite::Lax, https).await
    }

    async fn open_session(
        &self,
        owner: &SessionOwner,
        same_site: SameSite,
        https: bool,
    ) -> Result<NewSession, Refusal> {
        let secret =
            random_token().map_err(|e| Refusal::Store(StoreError::Query(e.to_string())))?;
        let expires_at = self
            .store
            .create_session(
                &TokenHash::of(&secret).to_hex(),
                owner,
                self.settings.session_ttl,
            )
            .await?;
        let max_age = time_secs(self.settings.session_ttl);
        let cookie = Cookie::build((session_cookie_name(https), secret.clone()))
            .path("/")
            .http_only(true)
            .same_site(same_site)
            .secure(https)
            .max_age(max_age)
            .build();
        Ok(NewSession {
            cookie: cookie.to_string(),
            csrf_token: csrf_token_for(&secret),
            expires_at,
        })
    }

    /// Ends `session`; returns the `Set-Cookie` value that deletes it.
    pub async fn end_session(&self, session: &Session, https: bool) -> Result<String, Refusal> {
        self.store.delete_session(&session.secret_hash).await?;
        let mut cookie = Cookie::build((session_cookie_name(https), ""))
            .path("/")
            .http_only(true)
            .secure(https)
            .build();
        cookie.make_removal();
        Ok(cookie.to_string())
    }

    /// Mints a token for `user`. Minted with a user token (`parent`), it
    /// expires no later than that one. `ttl` shortens the configured life.
    pub async fn mint_user_token(
        &self,
        user: &UserId,
        parent: Option<&str>,
        ttl: Option<Duration>,
    ) -> Result<Minted, StoreError> {
        let id = random_id().map_err(|e| StoreError::Query(e.to_string()))?;
        let ttl = ttl.map_or(self.settings.user_token_ttl, |t| {
            t.min(self.settings.user_token_ttl)
        });
        let (token, outcome) = mint_with_id(
            self.store.as_ref(),
            user,
            &id,
            parent,
            ttl,
            self.settings.max_tokens_per_user,
        )
        .await?;
        Ok(match outcome {
            MintOutcome::Minted(record) => Minted::Token { token, record },
            MintOutcome::TooMany { live } => Minted::TooMany { live },
            MintOutcome::ParentGone => Minted::ParentGone,
        })
    }
}

/// The public ids of a sign-in's tokens start with this, so that lists
/// can tell them from tokens minted for scripts.
pub const LOGIN_TOKEN_PREFIX: &str = "login-";

/// Mints a token of a sign-in: its root (`parent` `None`), or an app
/// cookie's token under the root, which the store caps at the root's
/// expiry. Sign-in tokens do not count against the per-user cap (which
/// is for tokens minted on purpose); they end with the sign-in. `None`
/// when the root is gone.
pub async fn mint_login_token(
    store: &dyn AuthStore,
    user: &UserId,
    parent: Option<&str>,
    ttl: Duration,
) -> Result<Option<(String, String)>, StoreError> {
    let id = format!(
        "{LOGIN_TOKEN_PREFIX}{}",
        random_id().map_err(|e| StoreError::Query(e.to_string()))?
    );
    let (token, outcome) = mint_with_id(store, user, &id, parent, ttl, u32::MAX).await?;
    Ok(match outcome {
        MintOutcome::Minted(_) => Some((token, id)),
        MintOutcome::TooMany { .. } | MintOutcome::ParentGone => None,
    })
}

/// Mints a token of `user` with public id `id`: its secret, and what the
/// store made of it.
async fn mint_with_id(
    store: &dyn AuthStore,
    user: &UserId,
    id: &str,
    parent: Option<&str>,
    ttl: Duration,
    max_live: u32,
) -> Result<(String, MintOutcome), StoreError> {
    let token = random_token().map_err(|e| StoreError::Query(e.to_string()))?;
    let outcome = store
        .mint_token(&NewToken {
            id,
            user,
            token_hash: &TokenHash::of(&token).to_hex(),
            ttl,
            parent,
            max_live,
        })
        .await?;
    Ok((token, outcome))
}

/// What a mint produced.
#[derive(Debug)]
pub enum Minted {
    Token { token: String, record: TokenRecord },
    TooMany { live: u32 },
    ParentGone,
}

const SESSIONS_OFF: &str = "admin sessions need every app on its own origin: with path routing \
     on, apps share the API's origin and could use the session. Set [proxy] base_domain (and \
     leave path_routing = \"auto\" or \"off\"), or use Authorization: Bearer";

fn session_cookie_name(https: bool) -> &'static str {
    if https {
        SESSION_COOKIE_HOST
    } else {
        SESSION_COOKIE
    }
}

fn time_secs(d: Duration) -> cookie::time::Duration {
    cookie::time::Duration::seconds(i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// The CSRF token of a session: a one-way function of its secret, so a
/// page that learns it (the admin page keeps it in script) learns nothing
/// that opens the cookie.
pub fn csrf_token_for(session_secret: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"berth-csrf\0");
    h.update(session_secret.as_bytes());
    hex::encode(h.finalize())
}

/// Whether the request's `Origin` names the host it was sent to: `None`
/// without an `Origin`, `Some(false)` for another or an opaque (`null`)
/// origin. Schemes are not compared: berth sees plain HTTP behind a TLS
/// proxy, and no other page can be served from the berth host's name.
pub fn origin_matches_host(headers: &HeaderMap) -> Option<bool> {
    let origin = headers.get(header::ORIGIN)?.to_str().ok();
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let (Some(origin), Some(host)) = (origin, host) else {
        return Some(false);
    };
    let authority = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"));
    Some(authority.is_some_and(|a| !a.is_empty() && a.eq_ignore_ascii_case(host.trim())))
}

/// 32 random bytes, hex-encoded: URL-, header- and cookie-safe.
pub fn random_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no randomness for a token: {e}"))?;
    Ok(hex::encode(bytes))
}

/// A token's public id: 8 random bytes, hex.
fn random_id() -> anyhow::Result<String> {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no randomness for an id: {e}"))?;
    Ok(hex::encode(bytes))
}

/// The admin token: the configured one, else `<data_dir>/admin.token`,
/// created with mode 0600 on first start.
pub fn load_or_create_admin_token(
    configured: Option<&str>,
    data_dir: &Path,
) -> anyhow::Result<String> {
    if let Some(token) = configured.filter(|t| !t.is_empty()) {
        return Ok(token.to_owned());
    }
    let path = admin_token_path(data_dir);
    // A token file others can read (copied in, or restored from a backup
    // with its mode lost) gives any local program the admin's power.
    match crate::config::refuse_readable_by_others(&path, "the admin token") {
        Err(crate::config::ConfigError::SecretFile { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound => {}
        other => other?,
    }
    match std::fs::read_to_string(&path) {
        Ok(existing) if !existing.trim().is_empty() => return Ok(existing.trim().to_owned()),
        Ok(_) => anyhow::bail!("admin token file {} is empty", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
    let token = random_token()?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    writeln!(file, "{token}").with_context(|| format!("cannot write {}", path.display()))?;
    Ok(token)
}

pub fn admin_token_path(data_dir: &Path) -> PathBuf {
    data_dir.join(ADMIN_TOKEN_FILE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn admin_token_file_is_created_once_with_mode_0600() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_create_admin_token(None, dir.path()).unwrap();
        let again = load_or_create_admin_token(None, dir.path()).unwrap();
        assert_eq!(first, again);
        assert_eq!(first.len(), 64);
        let mode = std::fs::metadata(admin_token_path(dir.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(
            load_or_create_admin_token(Some("given"), dir.path()).unwrap(),
            "given"
        );
        std::fs::set_permissions(
            admin_token_path(dir.path()),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        let msg = load_or_create_admin_token(None, dir.path())
            .unwrap_err()
            .to_string();
        assert!(msg.contains("chmod 600"), "{msg}");
    }

    #[test]
    fn origins_must_name_the_host() {
        let judge = |origin: Option<&'static str>, host: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(header::HOST, HeaderValue::from_static(host));
            if let Some(o) = origin {
                h.insert(header::ORIGIN, HeaderValue::from_static(o));
            }
            origin_matches_host(&h)
        };
        assert_eq!(judge(None, "berth.example"), None);
        assert_eq!(
            judge(Some("https://berth.example"), "berth.example"),
            Some(true)
        );
        assert_eq!(
            judge(Some("http://Berth.Example:8000"), "berth.example:8000"),
            Some(true)
        );
        for other in [
            "https://alice.berth.example",
            "https://berth.example.evil",
            "null",
            "https://",
            "berth.example",
            "https://berth.example:8443",
        ] {
            assert_eq!(judge(Some(other), "berth.example"), Some(false), "{other}");
        }
    }

    #[test]
    fn csrf_tokens_are_bound_to_their_session() {
        let a = csrf_token_for("secret-a");
        assert_eq!(a, csrf_token_for("secret-a"));
        assert_ne!(a, csrf_token_for("secret-b"));
        assert!(!a.contains("secret"));
        assert_eq!(a.len(), 64);
    }
}
