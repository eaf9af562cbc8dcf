//! The OpenID Provider the login tests run (`support/oidc.rs`), on its
//! own, driven by a plain HTTP client: discovery and JWKS; the
//! authorization-code flow with PKCE, which gives a code for the right
//! password only and an ID token with the user's claims; every tamper
//! mode; key rotation; stop and restart. No berth here: these prove the
//! harness the login tests stand on.
//!
//! Needs Node.js and npm's oidc-provider (`scripts/test` installs them);
//! without them these tests fail, saying so.

use crate::support::oidc;

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use data_encoding::BASE64URL_NOPAD;
use oidc::{Agent, OidcClient, OidcProvider, OidcUser, TAMPER_MODES, form_action, location};
use reqwest::{StatusCode, Url};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// Where the provider sends the browser back; never contacted (the
/// client here reads the code off the redirect).
const REDIRECT: &str = "http://127.0.0.1:9/callback";
const CLIENT_ID: &str = "berth";
const SECRET: &str = "client-secret";
const POST_CLIENT_ID: &str = "berth-post";
const PASSWORD: &str = "correct horse battery staple";

fn clients() -> [OidcClient; 2] {
    [
        OidcClient::new(CLIENT_ID, SECRET, &[REDIRECT]),
        OidcClient::new(POST_CLIENT_ID, SECRET, &[REDIRECT])
            .with("token_endpoint_auth_method", json!("client_secret_post")),
    ]
}

fn alice(groups: &[&str]) -> OidcUser {
    OidcUser::new("alice", PASSWORD)
        .email("alice@example.test")
        .preferred_username("alice")
        .groups(groups)
}

async fn provider() -> OidcProvider {
    OidcProvider::start(&clients(), &[alice(&["staff", "admins"])]).await
}

fn random_token() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("randomness");
    BASE64URL_NOPAD.encode(&bytes)
}

fn now() -> i64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    i64::try_from(since.as_secs()).unwrap()
}

/// One authorization request's secrets.
struct Authorization {
    client_id: &'static str,
    verifier: String,
    nonce: String,
    state: String,
}

impl Authorization {
    fn new(client_id: &'static str) -> Authorization {
        Authorization {
            client_id,
            verifier: random_token(),
            nonce: random_token(),
            state: random_token(),
        }
    }

    fn challenge(&self) -> String {
        BASE64URL_NOPAD.encode(&Sha256::digest(self.verifier.as_bytes()))
    }

    fn url(&self, idp: &OidcProvider) -> String {
        let challenge = self.challenge();
        Url::parse_with_params(
            &idp.url("/auth"),
            [
                ("client_id", self.client_id),
                ("redirect_uri", REDIRECT),
                ("response_type", "code"),
                ("scope", "openid email profile groups"),
                ("state", &self.state),
                ("nonce", &self.nonce),
                ("code_challenge", &challenge),
                ("code_challenge_method", "S256"),
            ],
        )
        .unwrap()
        .to_string()
    }
}

/// How a sign-in ended.
#[derive(Debug)]
enum SignIn {
    /// Back at the client with this code.
    Code(String),
    /// The login form refused the credentials: its answer.
    Refused { status: StatusCode, page: String },
}

/// Runs `auth` through the provider as a browser would, filling its login
/// form with `credentials` when it shows it; with none, a login form
/// fails the test (the agent's session should have signed it in).
async fn sign_in(
    agent: &mut Agent,
    idp: &OidcProvider,
    auth: &Authorization,
    credentials: Option<(&str, &str)>,
) -> SignIn {
    let mut url = auth.url(idp);
    for _ in 0..10 {
        let response = agent.get(&url).await;
        if response.status().is_redirection() {
            url = location(&response, &url);
            if url.starts_with(REDIRECT) {
                return SignIn::Code(code_from(&url, auth, idp));
            }
            continue;
        }
        let status = response.status();
        let page = response.text().await.unwrap();
        assert_eq!(status, StatusCode::OK, "{url}: {page}");
        assert!(
            page.contains(r#"id="password""#),
            "not the login form: {page}"
        );
        let (username, password) =
            credentials.expect("the session signs in, yet the provider asks to log in");
        for id in ["username", "password", "submit"] {
            assert!(page.contains(&format!(r#"id="{id}""#)), "#{id} on {page}");
        }
        let action = idp.url(form_action(&page));
        let response = agent
            .post_form(&action, &[("username", username), ("password", password)])
            .await;
        if !response.status().is_redirection() {
            let status = response.status();
            let page = response.text().await.unwrap();
            return SignIn::Refused { status, page };
        }
        url = location(&response, &action);
    }
    panic!("more than ten redirects from {}", auth.url(idp));
}

/// The code of a redirect back to the client, whose `state` and `iss`
/// must be right.
fn code_from(url: &str, auth: &Authorization, idp: &OidcProvider) -> String {
    let query: BTreeMap<String, String> = Url::parse(url)
        .unwrap()
        .query_pairs()
        .into_owned()
        .collect();
    assert_eq!(query.get("error"), None, "{url}");
    assert_eq!(query.get("state"), Some(&auth.state), "{url}");
    assert_eq!(
        query.get("iss").map(String::as_str),
        Some(idp.issuer()),
        "{url}"
    );
    query.get("code").expect("a code").clone()
}

/// A sign-in that must succeed: its code.
async fn code_for(
    agent: &mut Agent,
    idp: &OidcProvider,
    auth: &Authorization,
    credentials: Option<(&str, &str)>,
) -> String {
    match sign_in(agent, idp, auth, credentials).await {
        SignIn::Code(code) => code,
        refused => panic!("no code: {refused:?}"),
    }
}

/// The token endpoint's answer to `code`, the client authenticating as
/// its registration says.
async fn exchange(idp: &OidcProvider, auth: &Authorization, code: &str) -> (StatusCode, Value) {
    let mut form = vec![
        ("grant_type", "authorization_code"),
        ("code", code),
        ("redirect_uri", REDIRECT),
        ("code_verifier", &auth.verifier),
    ];
    let mut request = reqwest::Client::new().post(idp.url("/token"));
    if auth.client_id == POST_CLIENT_ID {
        form.extend([("client_id", POST_CLIENT_ID), ("client_secret", SECRET)]);
    } else {
        request = request.basic_auth(auth.client_id, Some(SECRET));
    }
    let response = request.form(&form).send().await.unwrap();
    (response.status(), response.json().await.unwrap())
}

/// A fresh sign-in (right password) and its token answer, which must be
/// a success: the ID token.
async fn id_token(agent: &mut Agent, idp: &OidcProvider, auth: &Authorization) -> String {
    let code = code_for(agent, idp, auth, Some(("alice", PASSWORD))).await;
    let (status, body) = exchange(idp, auth, &code).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body["id_token"].as_str().expect("an id_token").to_owned()
}

/// A JWT's header and claims, unverified, and its signature's bytes.
fn decode(jwt: &str) -> (Value, Value, Vec<u8>) {
    let parts: Vec<&str> = jwt.split('.').collect();
    assert_eq!(parts.len(), 3, "{jwt}");
    let json = |part: &str| -> Value {
        serde_json::from_slice(&BASE64URL_NOPAD.decode(part.as_bytes()).unwrap()).unwrap()
    };
    let signature = BASE64URL_NOPAD.decode(parts[2].as_bytes()).unwrap();
    (json(parts[0]), json(parts[1]), signature)
}

/// Which of `iss`, `aud`, `nonce` and `exp` are not what a client that
/// sent `auth` accepts.
fn wrong_claims(claims: &Value, idp: &OidcProvider, auth: &Authorization) -> Vec<&'static str> {
    let mut wrong = Vec::new();
    if claims["iss"] != idp.issuer() {
        wrong.push("iss");
    }
    if claims["aud"] != auth.client_id && claims["aud"] != json!([auth.client_id]) {
        wrong.push("aud");
    }
    if claims["nonce"] != auth.nonce.as_str() {
        wrong.push("nonce");
    }
    if claims["exp"].as_i64().is_none_or(|exp| exp <= now()) {
        wrong.push("exp");
    }
    wrong
}

async fn get_json(url: &str) -> Value {
    let response = reqwest::get(url)
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    assert_eq!(response.status(), StatusCode::OK, "GET {url}");
    response.json().await.unwrap()
}

async fn published_kids(idp: &OidcProvider) -> Vec<String> {
    let jwks = get_json(&idp.url("/jwks")).await;
    let keys = jwks["keys"].as_array().expect("keys");
    keys.iter()
        .map(|key| {
            // Public halves only.
            for private in ["d", "p", "q", "dp", "dq", "qi"] {
                assert!(key.get(private).is_none(), "{private} published: {key}");
            }
            assert_eq!(key["kty"], "RSA");
            assert_eq!(key["alg"], "RS256");
            assert_eq!(key["use"], "sig");
            key["kid"].as_str().expect("a kid").to_owned()
        })
        .collect()
}

async fn signed_validly(idp: &OidcProvider, jwt: &str) -> bool {
    idp.verify_signature(jwt).await["valid"]
        .as_bool()
        .expect("an answer")
}

#[tokio::test]
async fn discovery_and_jwks_describe_the_provider() {
    let idp = provider().await;
    let discovery = get_json(&idp.discovery_url()).await;
    assert_eq!(discovery["issuer"], idp.issuer());
    for (endpoint, path) in [
        ("authorization_endpoint", "/auth"),
        ("token_endpoint", "/token"),
        ("jwks_uri", "/jwks"),
        ("userinfo_endpoint", "/me"),
        ("end_session_endpoint", "/session/end"),
    ] {
        assert_eq!(discovery[endpoint], idp.url(path), "{endpoint}");
    }
    assert_eq!(
        discovery["code_challenge_methods_supported"],
        json!(["S256"])
    );
    assert_eq!(
        discovery["id_token_signing_alg_values_supported"],
        json!(["RS256"])
    );
    let listed = |field: &str, value: &str| {
        discovery[field]
            .as_array()
            .is_some_and(|values| values.contains(&json!(value)))
    };
    for scope in ["openid", "email", "profile", "groups"] {
        assert!(
            listed("scopes_supported", scope),
            "scope {scope}: {discovery}"
        );
    }
    for claim in ["sub", "email", "preferred_username", "groups"] {
        assert!(
            listed("claims_supported", claim),
            "claim {claim}: {discovery}"
        );
    }
    for method in ["client_secret_basic", "client_secret_post"] {
        assert!(listed("token_endpoint_auth_methods_supported", method));
    }
    assert_eq!(published_kids(&idp).await.len(), 1);
}

#[tokio::test]
async fn code_flow_gives_a_code_for_the_right_password_only() {
    let idp = provider().await;

    // A wrong password, and an unknown user: the form again, with an
    // error, and no code.
    for (username, password) in [("alice", "not her password"), ("mallory", PASSWORD)] {
        let auth = Authorization::new(CLIENT_ID);
        match sign_in(&mut Agent::new(), &idp, &auth, Some((username, password))).await {
            SignIn::Refused { status, page } => {
                assert_eq!(status, StatusCode::UNAUTHORIZED);
                assert!(page.contains(r#"id="error""#), "{page}");
                assert!(page.contains(r#"id="password""#), "{page}");
            }
            code => panic!("{username} with {password:?} got {code:?}"),
        }
    }

    // The right one: a code, and for it an ID token with the user's
    // claims and the client's nonce.
    let auth = Authorization::new(CLIENT_ID);
    let code = code_for(&mut Agent::new(), &idp, &auth, Some(("alice", PASSWORD))).await;
    let (status, body) = exchange(&idp, &auth, &code).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["token_type"], "Bearer");
    let jwt = body["id_token"].as_str().expect("an id_token");
    let (header, claims, _) = decode(jwt);
    assert_eq!(
        wrong_claims(&claims, &idp, &auth),
        Vec::<&str>::new(),
        "{claims}"
    );
    assert_eq!(claims["sub"], "alice");
    assert_eq!(claims["email"], "alice@example.test");
    assert_eq!(claims["preferred_username"], "alice");
    assert_eq!(claims["groups"], json!(["staff", "admins"]));
    assert_eq!(claims.get("password"), None);
    assert_eq!(header["alg"], "RS256");
    assert_eq!(
        published_kids(&idp).await,
        [header["kid"].as_str().unwrap()]
    );
    assert!(signed_validly(&idp, jwt).await);

    // A code is good once.
    let (status, body) = exchange(&idp, &auth, &code).await;
    assert_eq!(
        (status, &body["error"]),
        (StatusCode::BAD_REQUEST, &json!("invalid_grant"))
    );

    // A client registered for client_secret_post authenticates so.
    let auth = Authorization::new(POST_CLIENT_ID);
    let code = code_for(&mut Agent::new(), &idp, &auth, Some(("alice", PASSWORD))).await;
    let (status, body) = exchange(&idp, &auth, &code).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        decode(body["id_token"].as_str().unwrap()).1["aud"],
        POST_CLIENT_ID
    );

    // A wrong client secret gets nothing.
    let auth = Authorization::new(CLIENT_ID);
    let code = code_for(&mut Agent::new(), &idp, &auth, Some(("alice", PASSWORD))).await;
    let response = reqwest::Client::new()
        .post(idp.url("/token"))
        .basic_auth(CLIENT_ID, Some("not the secret"))
        .form(&[
            ("grant_type", "authorization_code"),
            ("code", &code),
            ("redirect_uri", REDIRECT),
            ("code_verifier", &auth.verifier),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"], "invalid_client");
}

#[tokio::test]
async fn pkce_is_required() {
    let idp = provider().await;
    let auth = Authorization::new(CLIENT_ID);
    let url = Url::parse_with_params(
        &idp.url("/auth"),
        [
            ("client_id", CLIENT_ID),
            ("redirect_uri", REDIRECT),
            ("response_type", "code"),
            ("scope", "openid"),
            ("state", &auth.state),
            ("nonce", &auth.nonce),
        ],
    )
    .unwrap();
    let response = Agent::new().get(url.as_str()).await;
    assert!(response.status().is_redirection());
    let back = location(&response, url.as_str());
    assert!(back.starts_with(REDIRECT), "{back}");
    let query: BTreeMap<String, String> = Url::parse(&back)
        .unwrap()
        .query_pairs()
        .into_owned()
        .collect();
    assert_eq!(
        query.get("error").map(String::as_str),
        Some("invalid_request"),
        "{back}"
    );
    assert_eq!(query.get("code"), None);
}

#[tokio::test]
async fn each_tamper_mode_changes_the_token_answer() {
    let idp = provider().await;
    let kid = published_kids(&idp).await.remove(0);
    // Mode, the claims it makes wrong, whether the provider's published
    // key still verifies the ID token.
    let cases: [(&str, &[&str], bool); 9] = [
        ("none", &[], true),
        ("bad_signature", &[], false),
        ("wrong_audience", &["aud"], true),
        ("wrong_issuer", &["iss"], true),
        ("expired", &["exp"], true),
        ("wrong_nonce", &["nonce"], true),
        ("missing_nonce", &["nonce"], true),
        ("alg_none", &[], false),
        ("foreign_key", &[], false),
    ];
    let mut covered: Vec<&str> = cases.iter().map(|case| case.0).collect();
    covered.push("pkce_mismatch");
    covered.sort_unstable();
    let mut modes = TAMPER_MODES.to_vec();
    modes.sort_unstable();
    assert_eq!(covered, modes, "every mode is tried");

    // One agent throughout: after the first sign-in its session signs in.
    let mut agent = Agent::new();
    let _ = id_token(&mut agent, &idp, &Authorization::new(CLIENT_ID)).await;
    for (mode, wrong, signed) in cases {
        idp.set_mode(mode).await;
        assert_eq!(idp.mode().await, mode);
        let auth = Authorization::new(CLIENT_ID);
        let code = code_for(&mut agent, &idp, &auth, None).await;
        let (status, body) = exchange(&idp, &auth, &code).await;
        assert_eq!(status, StatusCode::OK, "{mode}: {body}");
        // The rest of the answer is untouched.
        assert!(body["access_token"].is_string(), "{mode}: {body}");
        let jwt = body["id_token"].as_str().unwrap();
        let (header, claims, signature) = decode(jwt);
        assert_eq!(
            wrong_claims(&claims, &idp, &auth),
            wrong,
            "{mode}: {claims}"
        );
        assert_eq!(signed_validly(&idp, jwt).await, signed, "{mode}: {jwt}");
        assert_eq!(claims["groups"], json!(["staff", "admins"]), "{mode}");
        match mode {
            "missing_nonce" => assert_eq!(claims.get("nonce"), None),
            "wrong_nonce" => assert!(claims["nonce"].is_string()),
            "expired" => {
                let (iat, exp) = (
                    claims["iat"].as_i64().unwrap(),
                    claims["exp"].as_i64().unwrap(),
                );
                assert!(exp <= now() - 3600 && iat < exp, "{claims}");
            }
            "alg_none" => {
                assert_eq!(header["alg"], "none");
                assert!(signature.is_empty());
            }
            "foreign_key" => {
                assert_eq!(header["alg"], "RS256");
                assert_ne!(header["kid"], kid.as_str());
            }
            _ => {
                assert_eq!(header["alg"], "RS256", "{mode}");
                assert_eq!(header["kid"], kid.as_str(), "{mode}");
            }
        }
    }

    // pkce_mismatch: the provider itself refuses the code.
    idp.set_mode("pkce_mismatch").await;
    let auth = Authorization::new(CLIENT_ID);
    let code = code_for(&mut agent, &idp, &auth, None).await;
    let (status, body) = exchange(&idp, &auth, &code).await;
    assert_eq!(
        (status, &body["error"]),
        (StatusCode::BAD_REQUEST, &json!("invalid_grant"))
    );
    assert_eq!(body.get("id_token"), None);

    // Back to none: right again.
    idp.set_mode("none").await;
    let auth = Authorization::new(CLIENT_ID);
    let jwt = id_token(&mut agent, &idp, &auth).await;
    assert_eq!(
        wrong_claims(&decode(&jwt).1, &idp, &auth),
        Vec::<&str>::new()
    );
    assert!(signed_validly(&idp, &jwt).await);

    // A mode it does not know is refused, and changes nothing.
    let response = reqwest::Client::new()
        .post(idp.url("/__test/mode"))
        .json(&json!({ "mode": "sloppy" }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(idp.mode().await, "none");
}

#[tokio::test]
async fn rotated_keys_sign_from_then_on() {
    let idp = provider().await;
    let mut agent = Agent::new();
    let first_kid = published_kids(&idp).await.remove(0);
    let first = id_token(&mut agent, &idp, &Authorization::new(CLIENT_ID)).await;
    assert_eq!(decode(&first).0["kid"], first_kid.as_str());

    // A new key signs; the old one stays published; the session carries
    // over (no login form).
    let second_kid = idp.rotate_keys().await;
    assert_ne!(second_kid, first_kid);
    assert_eq!(
        published_kids(&idp).await,
        [second_kid.clone(), first_kid.clone()]
    );
    let auth = Authorization::new(CLIENT_ID);
    let code = code_for(&mut agent, &idp, &auth, None).await;
    let (status, body) = exchange(&idp, &auth, &code).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let second = body["id_token"].as_str().unwrap().to_owned();
    assert_eq!(decode(&second).0["kid"], second_kid.as_str());
    assert!(signed_validly(&idp, &second).await);
    assert!(signed_validly(&idp, &first).await);

    // Retiring the old keys: only the newest is published, and what the
    // others signed no longer verifies.
    let third_kid = idp.rotate_keys_retiring_old().await;
    assert_eq!(published_kids(&idp).await, [third_kid.as_str()]);
    assert!(!signed_validly(&idp, &first).await);
    assert!(!signed_validly(&idp, &second).await);
    let third = id_token(&mut agent, &idp, &Authorization::new(CLIENT_ID)).await;
    assert_eq!(decode(&third).0["kid"], third_kid.as_str());
    assert!(signed_validly(&idp, &third).await);
}

#[tokio::test]
async fn restart_keeps_issuer_keys_and_users() {
    let mut idp = provider().await;
    let issuer = idp.issuer().to_owned();
    idp.rotate_keys().await;
    let kids = published_kids(&idp).await;
    assert_eq!(kids.len(), 2);
    idp.set_users(&[alice(&["staff"])]).await;
    idp.set_mode("wrong_issuer").await;
    let jwt = id_token(&mut Agent::new(), &idp, &Authorization::new(CLIENT_ID)).await;
    assert_eq!(decode(&jwt).1["groups"], json!(["staff"]));

    // Down: nothing answers on its port.
    idp.stop().await;
    assert!(!idp.is_running());
    let refused = reqwest::get(idp.discovery_url()).await;
    assert!(
        refused.is_err_and(|e| e.is_connect()),
        "the provider still answers"
    );

    // Up again: same issuer, same keys (the rotated one signing), the
    // users it had, mode none.
    idp.restart().await;
    assert!(idp.is_running());
    assert_eq!(idp.issuer(), issuer);
    assert_eq!(
        get_json(&idp.discovery_url()).await["issuer"],
        issuer.as_str()
    );
    assert_eq!(published_kids(&idp).await, kids);
    assert_eq!(idp.mode().await, "none");
    let auth = Authorization::new(CLIENT_ID);
    let jwt = id_token(&mut Agent::new(), &idp, &auth).await;
    let (header, claims, _) = decode(&jwt);
    assert_eq!(header["kid"], kids[0].as_str());
    assert_eq!(wrong_claims(&claims, &idp, &auth), Vec::<&str>::new());
    assert_eq!(claims["groups"], json!(["staff"]));
    assert!(signed_validly(&idp, &jwt).await);
}
