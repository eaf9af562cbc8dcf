//! How nodes prove themselves to each other, without the cluster secret
//! ever travelling: on the node-to-node API (`/internal/v1/…`, on its own
//! listener) and on app traffic one node forwards to the node that runs
//! the user's instance.
//!
//! The caller signs each request with HMAC-SHA256, keyed by the secret,
//! over what it is ([`Subject`]), the method, the path and query, the id
//! of the node it is meant for, a timestamp and a random nonce
//! ([`canonical`]). A node-to-node call also covers the SHA-256 of its
//! body; a forwarded request covers the user it acts for instead, since
//! its body streams (as the user's own request does) and cannot be
//! hashed before it is sent. The two kinds start with different tags, so
//! one can never pass for the other.
//! Whoever sees a request on the wire learns neither the secret nor anything
//! to reuse: the callee refuses a timestamp further than [`MAX_SKEW`] from
//! its own clock, and a nonce it has already accepted while that nonce's
//! timestamp is still fresh ([`Nonces`]), so a recorded request cannot be
//! played again; and a request signed for another node fails here, so it
//! cannot be played to a node that never saw its nonce either. The
//! signature is checked on the headers alone; a call's body
//! is read only after that and must match the signed digest.
//!
//! Failed checks are counted per source address ([`Failures`]): past a
//! small burst each further failure is answered `429`, and refusals are
//! logged with the source at a bounded rate ([`PeerAuth::refused`]), so
//! a guesser is both slowed in what it learns and visible.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_core::{ErrorBody, ErrorCode};
use hmac::{Hmac, Mac};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use sha2::{Digest, Sha256};

/// When the caller signed the call: Unix milliseconds, its clock.
pub static TIMESTAMP: HeaderName = HeaderName::from_static("x-berth-cluster-timestamp");
/// 16 random bytes, hex: never the same twice from any node.
pub static NONCE: HeaderName = HeaderName::from_static("x-berth-cluster-nonce");
/// The SHA-256 of the body, hex (of the empty string for no body).
pub static BODY_SHA256: HeaderName = HeaderName::from_static("x-berth-cluster-body-sha256");
/// The HMAC-SHA256 of [`canonical`], hex.
pub static SIGNATURE: HeaderName = HeaderName::from_static("x-berth-cluster-signature");
/// The user a forwarded request acts for (signed with it).
pub static FORWARDED_FOR: HeaderName = HeaderName::from_static("x-berth-forwarded-user");
/// Where the bare cluster secret used to travel. Never accepted: a request
/// that carries it is refused as a node's unsigned one.
pub static BARE_SECRET: HeaderName = HeaderName::from_static("x-berth-cluster-secret");

/// Every header that makes a request claim to come from another node; a
/// request with any of them is decided by its signature alone, and none
/// of them reaches a program.
pub fn node_headers() -> [&'static HeaderName; 6] {
    [
        &TIMESTAMP,
        &NONCE,
        &BODY_SHA256,
        &SIGNATURE,
        &FORWARDED_FOR,
        &BARE_SECRET,
    ]
}

/// Whether `headers` claim that the request comes from another node.
pub fn claims_a_node(headers: &HeaderMap) -> bool {
    node_headers()
        .iter()
        .any(|name| headers.contains_key(*name))
}

/// How far a call's timestamp may be from the callee's clock, either way.
/// Nodes keep their clocks in sync (NTP); this only absorbs what remains,
/// and bounds how long a nonce must be remembered.
pub const MAX_SKEW: Duration = Duration::from_secs(30);
/// Nonces remembered at most: within [`MAX_SKEW`] each way that is
/// thousands of calls a second, far above what a cluster sends. Past it
/// calls are refused (`503`) rather than letting a replay through.
const MAX_NONCES: usize = 1 << 17;
/// Failed calls a source may make at once before it gets `429`…
const FAILURE_BURST: f64 = 10.0;
/// …and how many a second it earns back.
const FAILURES_PER_SECOND: f64 = 1.0;
/// Sources whose failures are counted at once. A new source past this
/// shares one count with every other such source.
const MAX_SOURCES: usize = 4096;
/// At most one log line per source this often; the line says how many
/// refusals it stands for.
const LOG_EVERY: Duration = Duration::from_secs(10);

type HmacSha256 = Hmac<Sha256>;

/// What a signature vouches for besides the request line and the callee.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subject<'a> {
    /// A node-to-node call (`/internal/v1/…`) with this body digest (hex).
    Call {
        /// The SHA-256 of the call's body, in hex.
        body_sha256: &'a str,
    },
    /// App traffic forwarded to the node that runs `user`'s instance.
    Forward {
        /// The id of the user whose app the request is for.
        user: &'a str,
    },
}

/// The string a request's signature covers. Each part is on its own line,
/// and none but the last can hold a newline (an HTTP method and request
/// target cannot, nor a node id, which config validation keeps free of
/// control characters; the others are digits and hex), so no two requests
/// share one. The first line tells the kinds apart.
fn canonical(
    subject: Subject<'_>,
    method: &str,
    target: &str,
    node: &str,
    timestamp: i64,
    nonce: &str,
) -> String {
    match subject {
        Subject::Call { body_sha256 } => format!(
            "berth-internal-v1\n{method}\n{target}\n{node}\n{timestamp}\n{nonce}\n{body_sha256}"
        ),
        Subject::Forward { user } => {
            format!("berth-forward-v1\n{method}\n{target}\n{node}\n{timestamp}\n{nonce}\n{user}")
        }
    }
}

/// The cluster secret, as the key of the calls' signatures.
#[derive(Clone)]
pub struct ClusterKey(Arc<[u8]>);

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(…)")
    }
}

/// A signature's headers, to add to a request.
#[derive(Debug, Clone)]
pub struct Signed {
    /// The headers that carry the signature, to add to the request as they
    /// are.
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

/// Why a request cannot be signed.
#[derive(Debug, thiserror::Error)]
pub enum CannotSign {
    /// The system gave no random bytes for the nonce; the text says why.
    #[error("no randomness for a request's nonce: {0}")]
    NoRandomness(String),
    /// The user id cannot be carried in a header.
    #[error("the user id cannot be sent in an HTTP header")]
    User,
}

impl ClusterKey {
    /// The key made of the cluster secret `secret`; surrounding whitespace
    /// is not part of it.
    pub fn new(secret: &str) -> Self {
        Self(secret.trim().as_bytes().into())
    }

    fn mac(&self, text: &str) -> HmacSha256 {
        // HMAC takes a key of any length; `new_from_slice` cannot fail.
        let mut mac = <HmacSha256 as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
        mac.update(text.as_bytes());
        mac
    }

    /// Signs the call `method target` with `body` for the node `node`,
    /// now, with a fresh nonce.
    pub fn sign(
        &self,
        node: &str,
        method: &str,
        target: &str,
        body: &[u8],
    ) -> Result<Signed, CannotSign> {
        Ok(self.sign_call_with(
            node,
            method,
            target,
            body,
            berth_core::unix_millis_now(),
            &fresh_nonce()?,
        ))
    }

    /// Signs the forwarded request `method target` of `user`'s app for the
    /// node `node` (which runs the instance), now, with a fresh nonce. The
    /// user travels in [`FORWARDED_FOR`], among the returned headers.
    pub fn sign_forward(
        &self,
        node: &str,
        method: &str,
        target: &str,
        user: &str,
    ) -> Result<Signed, CannotSign> {
        self.sign_forward_with(
            node,
            method,
            target,
            user,
            berth_core::unix_millis_now(),
            &fresh_nonce()?,
        )
    }

    fn sign_call_with(
        &self,
        node: &str,
        method: &str,
        target: &str,
        body: &[u8],
        now: i64,
        nonce: &str,
    ) -> Signed {
        let body_sha256 = hex::encode(Sha256::digest(body));
        let subject = Subject::Call {
            body_sha256: &body_sha256,
        };
        let mut signed = self.sign_with(subject, node, method, target, now, nonce);
        signed
            .headers
            .push((BODY_SHA256.clone(), header_value(body_sha256)));
        signed
    }

    fn sign_forward_with(
        &self,
        node: &str,
        method: &str,
        target: &str,
        user: &str,
        now: i64,
        nonce: &str,
    ) -> Result<Signed, CannotSign> {
        let header = HeaderValue::from_bytes(user.as_bytes()).map_err(|_| CannotSign::User)?;
        let mut signed =
            self.sign_with(Subject::Forward { user }, node, method, target, now, nonce);
        signed.headers.push((FORWARDED_FOR.clone(), header));
        Ok(signed)
    }

    fn sign_with(
        &self,
        subject: Subject<'_>,
        node: &str,
        method: &str,
        target: &str,
        now: i64,
        nonce: &str,
    ) -> Signed {
        let text = canonical(subject, method, target, node, now, nonce);
        let signature = hex::encode(self.mac(&text).finalize().into_bytes());
        Signed {
            headers: vec![
                (TIMESTAMP.clone(), header_value(now.to_string())),
                (NONCE.clone(), header_value(nonce.to_owned())),
                (SIGNATURE.clone(), header_value(signature)),
            ],
        }
    }
}

/// 16 random bytes, hex.
fn fresh_nonce() -> Result<String, CannotSign> {
    let mut nonce = [0u8; 16];
    getrandom::fill(&mut nonce).map_err(|e| CannotSign::NoRandomness(e.to_string()))?;
    Ok(hex::encode(nonce))
}

/// Digits and hex: always valid header values.
fn header_value(s: String) -> HeaderValue {
    HeaderValue::try_from(s).unwrap_or(HeaderValue::from_static("-"))
}

/// Why a call was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The request carries no signature.
    #[error(
        "requests from another node must be signed (X-Berth-Cluster-Signature); the cluster \
         secret itself is never accepted"
    )]
    Unsigned,
    /// The signature headers are incomplete, repeated, or not in their
    /// format.
    #[error("the call's signature headers are malformed")]
    Malformed,
    /// The signature does not match: another secret, or a call signed for
    /// another node.
    #[error(
        "the signature does not match: are the cluster secrets the same, and was the call meant \
         for this node?"
    )]
    BadSignature,
    /// Signed too far from this node's clock; the gap in milliseconds.
    #[error(
        "the call was signed {0} ms away from this node's clock (at most {max} ms either way): \
         are the nodes' clocks in sync?",
        max = MAX_SKEW.as_millis()
    )]
    Stale(i64),
    /// The nonce was seen before: the call is a replay.
    #[error("the call was already received once (its nonce is replayed)")]
    Replayed,
    /// The body does not match the digest the signature covers.
    #[error("the body does not match its signed digest")]
    BodyMismatch,
    /// Too many nonces are remembered to take another; the call is refused
    /// rather than risk letting a replay through.
    #[error("too many node-to-node calls at once to remember their nonces")]
    Busy,
}

/// The one header `name` as text, if exactly one is present.
fn one<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Result<Option<&'a str>, Refusal> {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (None, _) => Ok(None),
        (Some(v), None) => v.to_str().map(Some).map_err(|_| Refusal::Malformed),
        (Some(_), Some(_)) => Err(Refusal::Malformed),
    }
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The body digest a call's signature vouches for, to check the body
/// against once it is read ([`PeerAuth::check_body`]).
#[derive(Debug, Clone)]
pub struct SignedBody([u8; 32]);

/// What a failed call earns its source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Past the burst: answer `429`.
    pub limited: bool,
    /// Log this refusal, with this many earlier ones from the same source
    /// that were not logged; `None`: do not log this one.
    pub log: Option<u64>,
}

/// Checks the calls of other nodes.
pub struct PeerAuth {
    key: ClusterKey,
    /// This node's id: a call signed for another node is refused here.
    node_id: String,
    nonces: Mutex<Nonces>,
    failures: Mutex<Failures>,
}

impl std::fmt::Debug for PeerAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerAuth(…)")
    }
}

impl PeerAuth {
    /// Checks calls signed with `key` for the node `node_id` (this one).
    pub fn new(key: ClusterKey, node_id: impl Into<String>) -> Self {
        Self {
            key,
            node_id: node_id.into(),
            nonces: Mutex::new(Nonces::default()),
            failures: Mutex::new(Failures::default()),
        }
    }

    /// The key this node signs its own requests to other nodes with.
    pub fn key(&self) -> &ClusterKey {
        &self.key
    }

    /// Checks the signature of the call `method target` in `headers` at
    /// `now` (Unix milliseconds), and remembers its nonce. The signature is
    /// checked first, so that nothing unsigned fills the nonce cache.
    pub fn check_headers(
        &self,
        method: &str,
        target: &str,
        headers: &HeaderMap,
        now: i64,
    ) -> Result<SignedBody, Refusal> {
        let Some(body_sha256) = one(headers, &BODY_SHA256)? else {
            return Err(if one(headers, &SIGNATURE)?.is_some() {
                Refusal::Malformed
            } else {
                Refusal::Unsigned
            });
        };
        if !is_hex(body_sha256, 64) {
            return Err(Refusal::Malformed);
        }
        self.verify(Subject::Call { body_sha256 }, method, target, headers, now)?;
        let mut digest = [0u8; 32];
        hex::decode_to_slice(body_sha256, &mut digest).map_err(|_| Refusal::Malformed)?;
        Ok(SignedBody(digest))
    }

    /// Checks the signature of the forwarded request `method target` in
    /// `headers` at `now`, and remembers its nonce: `Ok` with the user it
    /// was signed for (its [`FORWARDED_FOR`] header).
    pub fn check_forward<'h>(
        &self,
        method: &str,
        target: &str,
        headers: &'h HeaderMap,
        now: i64,
    ) -> Result<&'h str, Refusal> {
        let mut users = headers.get_all(&FORWARDED_FOR).iter();
        let user = match (users.next(), users.next()) {
            (Some(user), None) => {
                std::str::from_utf8(user.as_bytes()).map_err(|_| Refusal::Malformed)?
            }
            (None, _) if one(headers, &SIGNATURE)?.is_none() => return Err(Refusal::Unsigned),
            _ => return Err(Refusal::Malformed),
        };
        self.verify(Subject::Forward { user }, method, target, headers, now)?;
        Ok(user)
    }

    /// The checks both kinds share: the signature over `subject` and the
    /// request, then the clock, then the nonce.
    fn verify(
        &self,
        subject: Subject<'_>,
        method: &str,
        target: &str,
        headers: &HeaderMap,
        now: i64,
    ) -> Result<(), Refusal> {
        let Some(signature) = one(headers, &SIGNATURE)? else {
            return Err(Refusal::Unsigned);
        };
        let (Some(timestamp), Some(nonce)) = (one(headers, &TIMESTAMP)?, one(headers, &NONCE)?)
        else {
            return Err(Refusal::Malformed);
        };
        let timestamp: i64 = timestamp.parse().map_err(|_| Refusal::Malformed)?;
        if !is_hex(nonce, 32) || !is_hex(signature, 64) {
            return Err(Refusal::Malformed);
        }
        let signature = hex::decode(signature).map_err(|_| Refusal::Malformed)?;
        let text = canonical(subject, method, target, &self.node_id, timestamp, nonce);
        // Constant time: a wrong guess learns nothing from how long it took.
        self.key
            .mac(&text)
            .verify_slice(&signature)
            .map_err(|_| Refusal::BadSignature)?;
        let skew = now.saturating_sub(timestamp);
        let max = i64::try_from(MAX_SKEW.as_millis()).unwrap_or(i64::MAX);
        if skew.saturating_abs() > max {
            return Err(Refusal::Stale(skew));
        }
        let mut nonce_bytes = [0u8; 16];
        hex::decode_to_slice(nonce, &mut nonce_bytes).map_err(|_| Refusal::Malformed)?;
        self.nonces
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .admit(nonce_bytes, timestamp.saturating_add(max), now)
    }

    /// Whether `body` is the one the signature vouched for.
    pub fn check_body(signed: &SignedBody, body: &[u8]) -> Result<(), Refusal> {
        let digest: [u8; 32] = Sha256::digest(body).into();
        if subtle::ConstantTimeEq::ct_eq(&digest[..], &signed.0[..]).into() {
            Ok(())
        } else {
            Err(Refusal::BodyMismatch)
        }
    }

    /// Counts a failed call from `source` at `now`.
    pub fn failed(&self, source: IpAddr, now: Instant) -> Verdict {
        self.failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .record(source, now)
    }

    /// Counts `refusal` of a request from `source`, logs it when due, and
    /// says whether the source is past its burst (answer `429`).
    pub fn refused(&self, source: IpAddr, refusal: &Refusal) -> Verdict {
        let verdict = self.failed(source, Instant::now());
        if let Some(unlogged) = verdict.log {
            tracing::warn!(
                %source,
                reason = %refusal,
                limited = verdict.limited,
                earlier_unlogged = unlogged,
                "refused a node-to-node call"
            );
        }
        verdict
    }

    /// What a refused call from `source` is answered: `429` once its source
    /// is past the burst of failures, `503` when this node has no room for
    /// another nonce, `401` otherwise. The refusal is counted and maybe
    /// logged ([`PeerAuth::refused`]).
    pub fn answer_refusal(&self, source: IpAddr, refusal: &Refusal) -> ErrorBody {
        if self.refused(source, refusal).limited {
            let mut body = ErrorBody::new(
                ErrorCode::TooManyRequests,
                format!("too many refused node-to-node calls from {source}; slow down ({refusal})"),
            );
            body.retry_after_ms = Some(REFUSED_RETRY_MS);
            return body;
        }
        let code = match refusal {
            Refusal::Busy => ErrorCode::CapacityExhausted,
            _ => ErrorCode::Unauthorized,
        };
        ErrorBody::new(code, refusal.to_string())
    }
}

/// How long a source past its burst of refused calls is told to wait.
const REFUSED_RETRY_MS: u64 = 1000;

/// The nonces accepted while their timestamps are fresh, with when each
/// may be forgotten (its timestamp plus [`MAX_SKEW`], after which the call
/// would be refused as stale anyway).
#[derive(Default)]
struct Nonces {
    seen: HashSet<[u8; 16]>,
    /// In arrival order. Expiries are nearly in order (timestamps are
    /// within the skew of each other), so forgetting from the front frees
    /// every expired nonce soon after it expires.
    order: VecDeque<(i64, [u8; 16])>,
}

impl Nonces {
    fn admit(&mut self, nonce: [u8; 16], expires: i64, now: i64) -> Result<(), Refusal> {
        while let Some(&(at, old)) = self.order.front() {
            if at > now {
                break;
            }
            self.order.pop_front();
            self.seen.remove(&old);
        }
        if self.seen.contains(&nonce) {
            return Err(Refusal::Replayed);
        }
        if self.seen.len() >= MAX_NONCES {
            return Err(Refusal::Busy);
        }
        self.seen.insert(nonce);
        self.order.push_back((expires, nonce));
        Ok(())
    }
}

/// Failed calls per source: a token bucket each, and when each was last
/// logged.
#[derive(Default)]
struct Failures {
    sources: HashMap<IpAddr, Bucket>,
}

struct Bucket {
    tokens: f64,
    at: Instant,
    logged: Option<Instant>,
    unlogged: u64,
}

/// The address failures are counted under: an IPv4-mapped address is its
/// IPv4 address, and an IPv6 one its /64 (what one host is usually given).
fn source_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mut segments = v6.segments();
                segments[4..].fill(0);
                IpAddr::V6(segments.into())
            }
        },
        v4 => v4,
    }
}

/// The key shared by new sources once [`MAX_SOURCES`] are counted.
const OVERFLOW: IpAddr = IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED);

impl Bucket {
    fn refill(&mut self, now: Instant) {
        let earned = now.saturating_duration_since(self.at).as_secs_f64() * FAILURES_PER_SECOND;
        self.tokens = (self.tokens + earned).min(FAILURE_BURST);
        self.at = now;
    }

    /// Nothing left to remember: as if it had never failed.
    fn forgotten(&self, now: Instant) -> bool {
        self.tokens >= FAILURE_BURST
            && self
                .logged
                .is_none_or(|at| now.saturating_duration_since(at) >= LOG_EVERY)
    }
}

impl Failures {
    fn record(&mut self, source: IpAddr, now: Instant) -> Verdict {
        let mut key = source_key(source);
        if !self.sources.contains_key(&key) && self.sources.len() >= MAX_SOURCES {
            self.sources.retain(|_, bucket| {
                bucket.refill(now);
                !bucket.forgotten(now)
            });
            if self.sources.len() >= MAX_SOURCES {
                key = OVERFLOW;
            }
        }
        let bucket = self.sources.entry(key).or_insert(Bucket {
            tokens: FAILURE_BURST,
            at: now,
            logged: None,
            unlogged: 0,
        });
        bucket.refill(now);
        let limited = bucket.tokens < 1.0;
        if !limited {
            bucket.tokens -= 1.0;
        }
        let due = bucket
            .logged
            .is_none_or(|at| now.saturating_duration_since(at) >= LOG_EVERY);
        let log = if due {
            bucket.logged = Some(now);
            Some(std::mem::take(&mut bucket.unlogged))
        } else {
            bucket.unlogged += 1;
            None
        };
        Verdict { limited, log }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "5f0c8e1d9a7b3c2e4f6a8b0c1d2e3f405162738495a6b7c8d9eaf0b1c2d3e4f5";

    fn headers(signed: &Signed) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in &signed.headers {
            map.insert(name.clone(), value.clone());
        }
        map
    }

    #[test]
    fn a_signed_call_passes_once_and_only_as_signed() {
        let key = ClusterKey::new(SECRET);
        let auth = PeerAuth::new(key.clone(), "node-a");
        let now = 1_000_000;
        let nonce = "00112233445566778899aabbccddeeff";
        let signed = key.sign_call_with(
            "node-a",
            "POST",
            "/internal/v1/users/alice/fence",
            b"{}",
            now,
            nonce,
        );
        let h = headers(&signed);
        let body = auth
            .check_headers("POST", "/internal/v1/users/alice/fence", &h, now + 5)
            .unwrap();
        PeerAuth::check_body(&body, b"{}").unwrap();
        assert_eq!(
            PeerAuth::check_body(&body, b"{\"epoch\":1}"),
            Err(Refusal::BodyMismatch)
        );
        // The same call again is a replay; another path or method is not
        // what was signed.
        assert_eq!(
            auth.check_headers("POST", "/internal/v1/users/alice/fence", &h, now + 6)
                .unwrap_err(),
            Refusal::Replayed
        );
        for (method, target) in [
            ("POST", "/internal/v1/users/bob/fence"),
            ("GET", "/internal/v1/users/alice/fence"),
            ("POST", "/internal/v1/users/alice/fence?x=1"),
        ] {
            assert_eq!(
                auth.check_headers(method, target, &h, now).unwrap_err(),
                Refusal::BadSignature,
                "{method} {target}"
            );
        }
        // Another key's signature, a stale one, and none at all.
        let other = ClusterKey::new("another-secret-entirely-0123456789abcdef");
        let forged = other.sign_call_with("node-a", "POST", "/p", b"", now, nonce);
        assert_eq!(
            auth.check_headers("POST", "/p", &headers(&forged), now)
                .unwrap_err(),
            Refusal::BadSignature
        );
        let old = key.sign_call_with(
            "node-a",
            "POST",
            "/p",
            b"",
            now - 31_000,
            "ffeeddccbbaa99887766554433221100",
        );
        assert_eq!(
            auth.check_headers("POST", "/p", &headers(&old), now)
                .unwrap_err(),
            Refusal::Stale(31_000)
        );
        // Signed for node-b: refused by node-a, whose nonce cache never saw
        // it.
        let elsewhere = key.sign_call_with(
            "node-b",
            "POST",
            "/p",
            b"",
            now,
            "0123456789abcdef0123456789abcdef",
        );
        assert_eq!(
            auth.check_headers("POST", "/p", &headers(&elsewhere), now)
                .unwrap_err(),
            Refusal::BadSignature
        );
        let mut bare = HeaderMap::new();
        bare.insert(BARE_SECRET.clone(), HeaderValue::from_static(SECRET));
        assert!(claims_a_node(&bare));
        assert_eq!(
            auth.check_headers("POST", "/p", &bare, now).unwrap_err(),
            Refusal::Unsigned
        );
    }

    #[test]
    fn a_forwarded_request_passes_once_for_its_user_and_node_only() {
        let key = ClusterKey::new(SECRET);
        let auth = PeerAuth::new(key.clone(), "node-a");
        let now = 2_000_000;
        let nonce = "0f1e2d3c4b5a69788796a5b4c3d2e1f0";
        let signed = key
            .sign_forward_with("node-a", "GET", "/u/alice/x?y=1", "alice", now, nonce)
            .unwrap();
        let h = headers(&signed);
        assert_eq!(
            auth.check_forward("GET", "/u/alice/x?y=1", &h, now + 1),
            Ok("alice")
        );
        assert_eq!(
            auth.check_forward("GET", "/u/alice/x?y=1", &h, now + 2),
            Err(Refusal::Replayed)
        );
        // Another user in the header, another path or method: not what was
        // signed (checked before the nonce, which is spent already).
        let fresh = |n: &str| {
            headers(
                &key.sign_forward_with("node-a", "GET", "/u/alice/", "alice", now, n)
                    .unwrap(),
            )
        };
        let mut swapped = fresh("11111111111111111111111111111111");
        swapped.insert(FORWARDED_FOR.clone(), HeaderValue::from_static("bob"));
        assert_eq!(
            auth.check_forward("GET", "/u/alice/", &swapped, now),
            Err(Refusal::BadSignature)
        );
        let other = fresh("22222222222222222222222222222222");
        assert_eq!(
            auth.check_forward("POST", "/u/alice/", &other, now),
            Err(Refusal::BadSignature)
        );
        // A forward is no call, and a call no forward, even with the same
        // method, target and nonce.
        assert_eq!(
            auth.check_headers("GET", "/u/alice/", &other, now)
                .unwrap_err(),
            Refusal::Malformed
        );
        let call = headers(&key.sign_call_with(
            "node-a",
            "GET",
            "/u/alice/",
            b"",
            now,
            "33333333333333333333333333333333",
        ));
        let mut as_forward = call.clone();
        as_forward.insert(FORWARDED_FOR.clone(), HeaderValue::from_static("alice"));
        assert_eq!(
            auth.check_forward("GET", "/u/alice/", &as_forward, now),
            Err(Refusal::BadSignature)
        );
        // Signed for node-b; stale; the bare secret.
        let elsewhere = key
            .sign_forward_with(
                "node-b",
                "GET",
                "/u/alice/",
                "alice",
                now,
                "44444444444444444444444444444444",
            )
            .unwrap();
        assert_eq!(
            auth.check_forward("GET", "/u/alice/", &headers(&elsewhere), now),
            Err(Refusal::BadSignature)
        );
        let old = key
            .sign_forward_with(
                "node-a",
                "GET",
                "/u/alice/",
                "alice",
                now - 31_000,
                "55555555555555555555555555555555",
            )
            .unwrap();
        assert_eq!(
            auth.check_forward("GET", "/u/alice/", &headers(&old), now),
            Err(Refusal::Stale(31_000))
        );
        let mut bare = HeaderMap::new();
        bare.insert(BARE_SECRET.clone(), HeaderValue::from_static(SECRET));
        bare.insert(FORWARDED_FOR.clone(), HeaderValue::from_static("alice"));
        assert!(claims_a_node(&bare));
        assert_eq!(
            auth.check_forward("GET", "/u/alice/", &bare, now),
            Err(Refusal::Unsigned)
        );
        // A user id beyond ASCII signs and checks as its bytes.
        let wide = key
            .sign_forward_with(
                "node-a",
                "GET",
                "/u/x/",
                "日本",
                now,
                "66666666666666666666666666666666",
            )
            .unwrap();
        assert_eq!(
            auth.check_forward("GET", "/u/x/", &headers(&wide), now),
            Ok("日本")
        );
    }

    #[test]
    fn nonces_are_forgotten_once_stale_and_bounded() {
        let mut nonces = Nonces::default();
        nonces.admit([1; 16], 100, 0).unwrap();
        assert_eq!(nonces.admit([1; 16], 100, 50), Err(Refusal::Replayed));
        nonces.admit([2; 16], 200, 100).unwrap();
        assert!(!nonces.seen.contains(&[1; 16]));
        for i in 0..MAX_NONCES - 1 {
            let mut n = [0xff; 16];
            n[..8].copy_from_slice(&(i as u64).to_le_bytes());
            nonces.admit(n, 10_000, 150).unwrap();
        }
        assert_eq!(nonces.admit([3; 16], 10_000, 150), Err(Refusal::Busy));
        // Once they expire there is room again.
        nonces.admit([3; 16], 20_000, 10_000).unwrap();
        assert_eq!(nonces.seen.len(), 1);
    }

    #[test]
    fn failures_are_limited_and_logged_per_source() {
        let mut failures = Failures::default();
        let t0 = Instant::now();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "2001:db8::1".parse().unwrap();
        let verdicts: Vec<Verdict> = (0..12).map(|_| failures.record(a, t0)).collect();
        assert!(verdicts[..10].iter().all(|v| !v.limited));
        assert!(verdicts[10..].iter().all(|v| v.limited));
        assert_eq!(verdicts[0].log, Some(0));
        assert!(verdicts[1..].iter().all(|v| v.log.is_none()));
        // Another source is counted apart; one in the same /64 is not.
        assert!(!failures.record(b, t0).limited);
        let b2: IpAddr = "2001:db8::2".parse().unwrap();
        assert_eq!(failures.record(b2, t0).log, None);
        // Time earns failures back, and the next log line counts the rest.
        let later = t0 + LOG_EVERY;
        let v = failures.record(a, later);
        assert!(!v.limited);
        assert_eq!(v.log, Some(11));
        // Bounded: past MAX_SOURCES new sources share one count.
        for i in 0..MAX_SOURCES as u32 {
            failures.record(IpAddr::V4((0x0b00_0000 + i).into()), t0);
        }
        assert!(failures.sources.len() <= MAX_SOURCES + 1);
    }
}
