//! Signing node-to-node calls the way a node does, for tests that play
//! another node (or an attacker who knows the wire format but not the
//! secret). Written apart from berth's own signer, from the wire format
//! alone, so a change to either shows.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// Unix milliseconds now.
pub fn unix_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A nonce no other call of this process uses: the process id, a counter
/// and the time, hashed to 16 bytes.
fn fresh_nonce() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let seed = format!(
        "{}:{}:{:?}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        SystemTime::now()
    );
    hex::encode(&Sha256::digest(seed.as_bytes())[..16])
}

/// The headers that sign `method target` with `body` under `secret`, for
/// the node `node`, at `timestamp` (Unix milliseconds).
pub fn signed_headers_at(
    secret: &str,
    node: &str,
    method: &str,
    target: &str,
    body: &[u8],
    timestamp: i64,
) -> Vec<(&'static str, String)> {
    let nonce = fresh_nonce();
    let body_sha256 = hex::encode(Sha256::digest(body));
    let text = format!(
        "berth-internal-v1\n{method}\n{target}\n{node}\n{timestamp}\n{nonce}\n{body_sha256}"
    );
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret.as_bytes())
        .expect("HMAC takes keys of any length");
    mac.update(text.as_bytes());
    vec![
        ("x-berth-cluster-timestamp", timestamp.to_string()),
        ("x-berth-cluster-nonce", nonce),
        ("x-berth-cluster-body-sha256", body_sha256),
        (
            "x-berth-cluster-signature",
            hex::encode(mac.finalize().into_bytes()),
        ),
    ]
}

/// The headers with which a node forwards `method target` of `user`'s app
/// to the node `node`, signed under `secret` at `timestamp`: the user,
/// the timestamp, a fresh nonce and the signature (no body digest: the
/// body streams).
pub fn forward_headers_at(
    secret: &str,
    node: &str,
    method: &str,
    target: &str,
    user: &str,
    timestamp: i64,
) -> Vec<(&'static str, String)> {
    let nonce = fresh_nonce();
    let text =
        format!("berth-forward-v1\n{method}\n{target}\n{node}\n{timestamp}\n{nonce}\n{user}");
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret.as_bytes())
        .expect("HMAC takes keys of any length");
    mac.update(text.as_bytes());
    vec![
        ("x-berth-forwarded-user", user.to_owned()),
        ("x-berth-cluster-timestamp", timestamp.to_string()),
        ("x-berth-cluster-nonce", nonce),
        (
            "x-berth-cluster-signature",
            hex::encode(mac.finalize().into_bytes()),
        ),
    ]
}

/// [`forward_headers_at`] now.
pub fn forward_headers(
    secret: &str,
    node: &str,
    method: &str,
    target: &str,
    user: &str,
) -> Vec<(&'static str, String)> {
    forward_headers_at(secret, node, method, target, user, unix_millis())
}

/// [`signed_headers_at`] now.
pub fn signed_headers(
    secret: &str,
    node: &str,
    method: &str,
    target: &str,
    body: &[u8],
) -> Vec<(&'static str, String)> {
    signed_headers_at(secret, node, method, target, body, unix_millis())
}

/// A `reqwest` request to `url` (whose path and query are signed), for
/// the node `node`, with a JSON `body`, signed like a node's call.
pub fn signed_request(
    http: &reqwest::Client,
    secret: &str,
    node: &str,
    method: reqwest::Method,
    url: &str,
    body: Option<&serde_json::Value>,
) -> reqwest::RequestBuilder {
    let parsed = url::Url::parse(url).expect("a URL");
    let target = match parsed.query() {
        Some(q) => format!("{}?{q}", parsed.path()),
        None => parsed.path().to_owned(),
    };
    let bytes = body
        .map(|b| serde_json::to_vec(b).expect("JSON"))
        .unwrap_or_default();
    let mut request = http.request(method.clone(), url);
    for (name, value) in signed_headers(secret, node, method.as_str(), &target, &bytes) {
        request = request.header(name, value);
    }
    if body.is_some() {
        request = request
            .header("content-type", "application/json")
            .body(bytes);
    }
    request
}
