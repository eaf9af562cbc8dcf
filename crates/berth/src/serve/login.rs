//! Sign-in through an OpenID Connect provider: the protocol, and who it
//! lets in.
//!
//! The flow is the authorization code flow with PKCE, `state` and `nonce`:
//!
//! 1. [`Oidc::begin`] stores a fresh state (by its hash), PKCE verifier and
//!    nonce for ten minutes, and answers the provider's authorization URL.
//! 2. The provider authenticates the user and sends the browser back to
//!    [`CALLBACK_PATH`] with a code and the state.
//! 3. [`Oidc::finish`] takes the state from the store, once: a replayed or
//!    unknown state finds nothing. It exchanges the code with the verifier
//!    (the provider checks PKCE), then the `openidconnect` crate checks the
//!    ID token: signature against the provider's keys, issuer, audience,
//!    expiry (with [`OidcSettings::clock_skew`] of slack) and nonce. A
//!    signature by a key berth has not seen fetches the keys again (at most
//!    every [`REFETCH_AFTER`]): that is how a key rotation is followed.
//! 4. [`admit`] turns the verified claims into a berth user and decides
//!    whether they may sign in, and whether as an admin.
//!
//! Discovery and the key set are fetched on first use and kept; a provider
//! that is down fails new sign-ins only, never a session that exists.

use std::collections::BTreeSet;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use berth_core::UserId;
use berth_proxy::auth::TokenHash;
use berth_store::{AuthStore, LoginAttempt, StoreError};
use openidconnect::core::{
    CoreAuthDisplay, CoreAuthPrompt, CoreAuthenticationFlow, CoreErrorResponseType,
    CoreGenderClaim, CoreJsonWebKey, CoreJweContentEncryptionAlgorithm, CoreJwsSigningAlgorithm,
    CoreProviderMetadata, CoreRevocableToken, CoreRevocationErrorResponse,
    CoreTokenIntrospectionResponse, CoreTokenType,
};
use openidconnect::{
    AdditionalClaims, AuthorizationCode, ClaimsVerificationError, Client, ClientId, ClientSecret,
    CsrfToken, EmptyExtraTokenFields, EndpointMaybeSet, EndpointNotSet, EndpointSet, IdToken,
    IdTokenFields, IssuerUrl, Nonce, PkceCodeChallenge, PkceCodeVerifier, RedirectUrl,
    RequestTokenError, Scope, SignatureVerificationError, StandardErrorResponse,
    StandardTokenResponse, TokenResponse,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::config::CALLBACK_PATH;

/// Where a browser starts signing in.
pub const LOGIN_PATH: &str = "/login";
/// Where a signed-in user signs out (POST).
pub const LOGOUT_PATH: &str = "/logout";
/// How long a sign-in may take at the provider.
const ATTEMPT_TTL: Duration = Duration::from_secs(600);
/// The shortest time between two fetches of the provider's keys for an
/// unknown key id: a token signed by a stranger cannot make berth hammer
/// the provider.
pub const REFETCH_AFTER: Duration = Duration::from_secs(30);
/// How long a call to the provider may take.
const PROVIDER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the check that the provider is up may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Claims outside the standard set, as the provider sent them (groups,
/// and any custom user claim).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(transparent)]
struct ExtraClaims(serde_json::Map<String, Value>);

impl AdditionalClaims for ExtraClaims {}

type IdTokenResponse = StandardTokenResponse<
    IdTokenFields<
        ExtraClaims,
        EmptyExtraTokenFields,
        CoreGenderClaim,
        CoreJweContentEncryptionAlgorithm,
        CoreJwsSigningAlgorithm,
    >,
    CoreTokenType,
>;

type ProviderIdToken = IdToken<
    ExtraClaims,
    CoreGenderClaim,
    CoreJweContentEncryptionAlgorithm,
    CoreJwsSigningAlgorithm,
>;

/// A client configured from the provider's discovery document: the
/// authorization endpoint is set, the token endpoint may be.
type OidcClient = Client<
    ExtraClaims,
    CoreAuthDisplay,
    CoreGenderClaim,
    CoreJweContentEncryptionAlgorithm,
    CoreJsonWebKey,
    CoreAuthPrompt,
    StandardErrorResponse<CoreErrorResponseType>,
    IdTokenResponse,
    CoreTokenIntrospectionResponse,
    CoreRevocableToken,
    CoreRevocationErrorResponse,
    EndpointSet,
    EndpointNotSet,
    EndpointNotSet,
    EndpointNotSet,
    EndpointMaybeSet,
    EndpointMaybeSet,
>;

/// Who may sign in, and how a user is named: plain data, from
/// `[auth.oidc]`.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    pub user_claim: String,
    pub groups_claim: String,
    pub allowed_users: BTreeSet<String>,
    pub allowed_groups: BTreeSet<String>,
    pub allow_any_user: bool,
    pub admin_group: Option<String>,
}

/// What berth reads from a verified ID token.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SignedClaims {
    /// The value of the user claim, if it is a string.
    pub user: Option<String>,
    pub groups: Vec<String>,
}

/// A user let in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    pub user: UserId,
    pub admin: bool,
}

/// Why a verified user is not let in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("the provider's ID token has no {claim:?} claim (a string) to name the user by")]
    NoUserClaim { claim: String },
    #[error("the {claim:?} claim, {value:?}, is not a valid berth user id: {why}")]
    InvalidUserId {
        claim: String,
        value: String,
        why: String,
    },
    #[error(
        "{user:?} may not sign in here: they are neither an allowed user nor in an allowed group"
    )]
    NotAllowed { user: String },
}

/// The one decision on a verified sign-in: the user it names, whether
/// they may come in, and whether as an admin.
pub fn admit(claims: &SignedClaims, policy: &Policy) -> Result<Admitted, Refused> {
    let Some(value) = claims.user.as_deref() else {
        return Err(Refused::NoUserClaim {
            claim: policy.user_claim.clone(),
        });
    };
    let user = UserId::parse(value).map_err(|e| Refused::InvalidUserId {
        claim: policy.user_claim.clone(),
        value: value.to_owned(),
        why: e.to_string(),
    })?;
    let in_group = |group: &String| claims.groups.iter().any(|g| g == group);
    let admin = policy.admin_group.as_ref().is_some_and(in_group);
    let allowed = policy.allow_any_user
        || admin
        || policy.allowed_users.contains(user.as_str())
        || policy.allowed_groups.iter().any(in_group);
    if !allowed {
        return Err(Refused::NotAllowed {
            user: user.as_str().to_owned(),
        });
    }
    Ok(Admitted { user, admin })
}

/// Why a sign-in failed.
#[derive(Debug, thiserror::Error)]
pub enum LoginError {
    #[error("the sign-in service cannot be reached right now ({0}); try again shortly")]
    ProviderDown(String),
    #[error("the sign-in service answered in a way berth cannot use: {0}")]
    ProviderBroken(String),
    #[error("the sign-in service refused: {0}")]
    ProviderRefused(String),
    #[error(
        "this sign-in was already used or has expired (its state is unknown to berth); start again"
    )]
    UnknownState,
    #[error("the callback carries no code and state")]
    Malformed,
    #[error("the ID token is not valid: {0}")]
    BadIdToken(String),
    #[error(transparent)]
    Refused(#[from] Refused),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// `[auth.oidc]`, checked.
#[derive(Debug, Clone)]
pub struct OidcSettings {
    pub issuer: String,
    pub client_id: String,
    pub client_secret: String,
    pub scopes: Vec<String>,
    pub redirect_url: String,
    pub clock_skew: Duration,
    pub policy: Policy,
}

/// [`OidcSettings`] from a validated `[auth.oidc]`; the callback is on
/// `public_url` unless the section names it. The client secret is looked
/// for only here, when berth serves: `berth config check` reads no
/// environment.
pub fn settings(o: &crate::config::OidcSection, public_url: &str) -> anyhow::Result<OidcSettings> {
    let Some(client_secret) = o.client_secret.clone() else {
        anyhow::bail!(
            "[auth.oidc] has no client secret: set BERTH_OIDC_CLIENT_SECRET, or name a file \
             (mode 0600) in client_secret_file (a secret in the config text is refused: it \
             travels with the file)"
        );
    };
    Ok(OidcSettings {
        issuer: o.issuer.clone(),
        client_id: o.client_id.clone(),
        client_secret,
        scopes: o.scopes.clone(),
        redirect_url: o
            .redirect_url
            .clone()
            .unwrap_or_else(|| format!("{}{CALLBACK_PATH}", public_url.trim_end_matches('/'))),
        clock_skew: Duration::from_secs(o.clock_skew_s),
        policy: Policy {
            user_claim: o.user_claim.clone(),
            groups_claim: o.groups_claim.clone(),
            allowed_users: o.allowed_users.iter().cloned().collect(),
            allowed_groups: o.allowed_groups.iter().cloned().collect(),
            allow_any_user: o.allow_any_user,
            admin_group: o.admin_group.clone(),
        },
    })
}

/// What the provider published, fetched once and kept.
struct Provider {
    client: OidcClient,
}

/// The relying party: begins and finishes sign-ins.
pub struct Oidc {
    settings: OidcSettings,
    http: reqwest::Client,
    cached: RwLock<Option<Arc<Provider>>>,
    /// When the keys were last fetched again for an unknown key.
    last_refetch: std::sync::Mutex<Option<Instant>>,
    /// One fetch of the provider's documents at a time; those waiting use
    /// its result. Held across the fetch on purpose: that is its job, and
    /// sign-in is not a hot path.
    fetching: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Oidc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Oidc")
            .field("issuer", &self.settings.issuer)
            .field("client_id", &self.settings.client_id)
            .finish_non_exhaustive()
    }
}

impl Oidc {
    pub fn new(settings: OidcSettings) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            // The provider's answers are followed by hand where needed:
            // following redirects would let a document point berth anywhere.
            .redirect(reqwest::redirect::Policy::none())
            .timeout(PROVIDER_TIMEOUT)
            .build()?;
        Ok(Self {
            settings,
            http,
            cached: RwLock::new(None),
            last_refetch: std::sync::Mutex::new(None),
            fetching: tokio::sync::Mutex::new(()),
        })
    }

    fn cached(&self) -> Option<Arc<Provider>> {
        self.cached
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    async fn provider(&self) -> Result<Arc<Provider>, LoginError> {
        match self.cached() {
            Some(provider) => Ok(provider),
            None => self.fetch(None).await,
        }
    }

    /// Fetches the discovery document and keys: the first time, or again
    /// for a key the copy `stale` lacks, unless another task fetched
    /// meanwhile or the last such refetch was under [`REFETCH_AFTER`] ago.
    async fn fetch(&self, stale: Option<&Arc<Provider>>) -> Result<Arc<Provider>, LoginError> {
        let _turn = self.fetching.lock().await;
        if let Some(current) = self.cached() {
            let Some(stale) = stale.filter(|s| Arc::ptr_eq(s, &current)) else {
                return Ok(current);
            };
            let mut last = self
                .last_refetch
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if last.is_some_and(|at| at.elapsed() < REFETCH_AFTER) {
                return Ok(stale.clone());
            }
            *last = Some(Instant::now());
        }
        let issuer = IssuerUrl::new(self.settings.issuer.clone())
            .map_err(|e| LoginError::ProviderBroken(format!("issuer URL: {e}")))?;
        let metadata = CoreProviderMetadata::discover_async(issuer, &self.http)
            .await
            .map_err(|e| discovery_error(&e))?;
        let redirect = RedirectUrl::new(self.settings.redirect_url.clone())
            .map_err(|e| LoginError::ProviderBroken(format!("redirect URL: {e}")))?;
        let client = OidcClient::from_provider_metadata(
            metadata,
            ClientId::new(self.settings.client_id.clone()),
            Some(ClientSecret::new(self.settings.client_secret.clone())),
        )
        .set_redirect_uri(redirect);
        let provider = Arc::new(Provider { client });
        *self.cached.write().unwrap_or_else(PoisonError::into_inner) = Some(provider.clone());
        Ok(provider)
    }

    /// Whether the provider answers now. Sending a browser to a provider
    /// that is down would leave it on an error of the browser's; asking
    /// first lets berth say so itself. One small request, to the
    /// discovery document, which providers serve from memory.
    async fn reachable(&self) -> Result<(), LoginError> {
        let url = format!(
            "{}/.well-known/openid-configuration",
            self.settings.issuer.trim_end_matches('/')
        );
        let answer = self
            .http
            .get(&url)
            .timeout(PROBE_TIMEOUT)
            .send()
            .await
            .map_err(|e| LoginError::ProviderDown(error_chain(&e)))?;
        if answer.status().is_server_error() {
            return Err(LoginError::ProviderDown(format!(
                "its discovery document answers {}",
                answer.status()
            )));
        }
        Ok(())
    }

    /// Starts a sign-in that ends at `return_to`: records it and answers
    /// the provider's authorization URL.
    pub async fn begin(
        &self,
        store: &dyn AuthStore,
        return_to: &str,
    ) -> Result<String, LoginError> {
        let provider = self.provider().await?;
        self.reachable().await?;
        let (challenge, verifier) = PkceCodeChallenge::new_random_sha256();
        let mut request = provider.client.authorize_url(
            CoreAuthenticationFlow::AuthorizationCode,
            CsrfToken::new_random,
            Nonce::new_random,
        );
        // The crate asks for `openid` itself.
        for scope in self.settings.scopes.iter().filter(|s| *s != "openid") {
            request = request.add_scope(Scope::new(scope.clone()));
        }
        let (url, state, nonce) = request.set_pkce_challenge(challenge).url();
        store
            .create_login_attempt(
                &TokenHash::of(state.secret()).to_hex(),
                &LoginAttempt {
                    pkce_verifier: verifier.secret().clone(),
                    nonce: nonce.secret().clone(),
                    return_to: return_to.to_owned(),
                },
                ATTEMPT_TTL,
            )
            .await?;
        Ok(url.to_string())
    }

    /// Finishes the sign-in of `state` with `code`: the user let in, and
    /// where the sign-in was to end.
    pub async fn finish(
        &self,
        store: &dyn AuthStore,
        code: &str,
        state: &str,
    ) -> Result<(Admitted, String), LoginError> {
        let attempt = store
            .take_login_attempt(&TokenHash::of(state).to_hex())
            .await?
            .ok_or(LoginError::UnknownState)?;
        let provider = self.provider().await?;
        let response = provider
            .client
            .exchange_code(AuthorizationCode::new(code.to_owned()))
            .map_err(|e| LoginError::ProviderBroken(e.to_string()))?
            .set_pkce_verifier(PkceCodeVerifier::new(attempt.pkce_verifier))
            .request_async(&self.http)
            .await
            .map_err(|e| token_error(&e))?;
        let id_token = response
            .id_token()
            .ok_or_else(|| LoginError::BadIdToken("the provider sent no ID token".into()))?;
        let nonce = Nonce::new(attempt.nonce);
        let claims = match self.verify(&provider, id_token, &nonce) {
            Err(ClaimsVerificationError::SignatureVerification(
                SignatureVerificationError::NoMatchingKey,
            )) => {
                // Perhaps a new key: fetch the keys again, once.
                let fresh = self.fetch(Some(&provider)).await?;
                self.verify(&fresh, id_token, &nonce)
            }
            other => other,
        }
        .map_err(|e| LoginError::BadIdToken(e.to_string()))?;
        Ok((admit(&claims, &self.settings.policy)?, attempt.return_to))
    }

    fn verify(
        &self,
        provider: &Provider,
        id_token: &ProviderIdToken,
        nonce: &Nonce,
    ) -> Result<SignedClaims, ClaimsVerificationError> {
        let skew = chrono::Duration::from_std(self.settings.clock_skew)
            .unwrap_or_else(|_| chrono::Duration::zero());
        // An expiry is judged by a clock `skew` behind: a token that
        // expired less than that ago still counts.
        let verifier = provider
            .client
            .id_token_verifier()
            .set_time_fn(move || chrono::Utc::now() - skew);
        let claims = id_token.claims(&verifier, nonce)?;
        let policy = &self.settings.policy;
        let extra = &claims.additional_claims().0;
        let user = match policy.user_claim.as_str() {
            "sub" => Some(claims.subject().as_str().to_owned()),
            "email" => claims.email().map(|e| e.as_str().to_owned()),
            "preferred_username" => claims.preferred_username().map(|u| u.as_str().to_owned()),
            other => extra.get(other).and_then(Value::as_str).map(str::to_owned),
        };
        let groups = match extra.get(&policy.groups_claim) {
            Some(Value::Array(items)) => items
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect(),
            Some(Value::String(one)) => vec![one.clone()],
            _ => Vec::new(),
        };
        Ok(SignedClaims { user, groups })
    }
}

fn discovery_error<E: std::error::Error>(e: &E) -> LoginError {
    let text = error_chain(e);
    // A transport failure (refused, timed out, no route) is the provider
    // being down; anything else is a document berth cannot use.
    if text.contains("error sending request")
        || text.contains("connect")
        || text.contains("timed out")
    {
        LoginError::ProviderDown(text)
    } else {
        LoginError::ProviderBroken(text)
    }
}

fn token_error<RE: std::error::Error + 'static>(
    e: &RequestTokenError<RE, StandardErrorResponse<CoreErrorResponseType>>,
) -> LoginError {
    match e {
        RequestTokenError::ServerResponse(answer) => {
            let mut text = answer.error().as_ref().to_owned();
            if let Some(description) = answer.error_description() {
                text.push_str(": ");
                text.push_str(description);
            }
            LoginError::ProviderRefused(text)
        }
        RequestTokenError::Request(e) => LoginError::ProviderDown(error_chain(e)),
        other => LoginError::ProviderBroken(error_chain(other)),
    }
}

/// `e` and its sources, as one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        Policy {
            user_claim: "preferred_username".into(),
            groups_claim: "groups".into(),
            allowed_users: ["carol".to_owned()].into(),
            allowed_groups: ["staff".to_owned()].into(),
            allow_any_user: false,
            admin_group: Some("admins".into()),
        }
    }

    fn claims(user: Option<&str>, groups: &[&str]) -> SignedClaims {
        SignedClaims {
            user: user.map(str::to_owned),
            groups: groups.iter().map(|g| (*g).to_owned()).collect(),
        }
    }

    #[test]
    fn admission_follows_the_lists_and_the_admin_group() {
        let p = policy();
        let admitted = |c: SignedClaims| admit(&c, &p);
        assert_eq!(
            admitted(claims(Some("carol"), &[])).unwrap(),
            Admitted {
                user: UserId::parse("carol").unwrap(),
                admin: false
            }
        );
        assert!(!admitted(claims(Some("bob"), &["staff"])).unwrap().admin);
        assert!(admitted(claims(Some("root"), &["admins"])).unwrap().admin);
        assert_eq!(
            admitted(claims(Some("mallory"), &["visitors"])),
            Err(Refused::NotAllowed {
                user: "mallory".into()
            })
        );
        assert_eq!(
            admitted(claims(None, &["staff"])),
            Err(Refused::NoUserClaim {
                claim: "preferred_username".into()
            })
        );
        assert!(matches!(
            admitted(claims(Some("../etc"), &["staff"])),
            Err(Refused::InvalidUserId { .. })
        ));
        assert!(matches!(
            admitted(claims(Some("a/b"), &["staff"])),
            Err(Refused::InvalidUserId { .. })
        ));
        let open = Policy {
            allow_any_user: true,
            ..policy()
        };
        assert!(admit(&claims(Some("anyone"), &[]), &open).is_ok());
    }
}
