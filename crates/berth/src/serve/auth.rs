//! Who is calling (design §8.2).
//!
//! Tokens are secrets the caller shows as `Authorization: Bearer …` or as
//! the `berth_token` cookie. berth keeps only their SHA-256: the admin
//! token's in memory, user tokens' in the store. Comparisons of the admin
//! hash are constant-time; user tokens are looked up by hash, so the secret
//! itself never meets a timing-dependent comparison. The checking itself is
//! `berth_proxy::auth`, shared with the proxy (same rules, same cache); this
//! module adds what only the binary knows: the store and the admin token
//! file.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use async_trait::async_trait;
use axum::http::HeaderMap;
use berth_core::UserId;
use berth_proxy::auth::{AuthError, TokenHash, TokenStore};
use berth_store::{Store, StoreError};

// One implementation for API and proxy: token extraction, the constant-time
// admin compare and the cached user-token lookup live in berth_proxy.
pub use berth_proxy::auth::Caller;

/// The name of the admin token file inside the data dir.
pub const ADMIN_TOKEN_FILE: &str = "admin.token";

/// User token hashes, looked up in the store (only on a cache miss).
struct StoreTokens(Arc<dyn Store>);

#[async_trait]
impl TokenStore for StoreTokens {
    async fn user_for_token_hash(&self, hash_hex: &str) -> Result<Option<UserId>, AuthError> {
        self.0
            .user_for_token(hash_hex)
            .await
            .map_err(|e| AuthError::Store(e.to_string()))
    }
}

/// Checks presented tokens and mints user tokens.
#[derive(Clone)]
pub struct Authenticator {
    shared: berth_proxy::auth::Authenticator,
    store: Arc<dyn Store>,
}

impl Authenticator {
    pub fn new(admin_token: &str, store: Arc<dyn Store>) -> Self {
        Self {
            shared: berth_proxy::auth::Authenticator::new(
                admin_token,
                Arc::new(StoreTokens(store.clone())),
            ),
            store,
        }
    }

    /// The shared checker (and its cache), for the proxy.
    pub fn shared(&self) -> berth_proxy::auth::Authenticator {
        self.shared.clone()
    }

    /// Identifies the caller from its headers; `None` if no valid token.
    pub async fn identify(&self, headers: &HeaderMap) -> Result<Option<Caller>, StoreError> {
        self.shared
            .identify_headers(headers)
            .await
            .map_err(|AuthError::Store(message)| StoreError::Unavailable(message))
    }

    /// Mints a new token for `user` and stores its hash.
    pub async fn mint_user_token(&self, user: &UserId) -> anyhow::Result<String> {
        let token = random_token()?;
        self.store
            .put_token(user, &TokenHash::of(&token).to_hex())
            .await?;
        Ok(token)
    }
}

/// 32 random bytes, hex-encoded: URL-, header- and cookie-safe.
pub fn random_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no randomness for a token: {e}"))?;
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
    }
}
