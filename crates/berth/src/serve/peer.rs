//! Calls from one node to another: the transport of the use cases that run
//! on the node owning a user (`ops`), the fence of an old holder, and the
//! token-cache purge, sent to the callee's node-to-node listener. Every
//! call is signed with the cluster secret ([`berth_proxy::peer_auth`]),
//! which itself never travels; an error answer's JSON maps back to the
//! [`SpawnError`] it came from, so an error keeps its code and HTTP
//! meaning across nodes (a `lease_busy` from the callee is followed by the
//! caller's hop loop).

use std::time::Duration;

use berth_core::{Epoch, ErrorBody, SpawnError, UserId, unix_millis_now};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use reqwest::Method;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::sse::{self, SseEvent};
use crate::wire::operation::{self, Internal};
use crate::wire::{FenceRequest, Fenced, Purged};
use berth_proxy::peer_auth::ClusterKey;

/// How long a peer may take to accept a connection. Peers are in the same
/// network; a node that does not answer this fast is as good as gone.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Budget of a fence call: the callee kills at once and waits for the exit.
const FENCE_TIMEOUT: Duration = Duration::from_secs(5);
/// Budget of a token purge: the callee clears a map and answers.
const PURGE_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a relayed event stream may stay silent: three of the API's
/// keep-alive intervals (15 s). A stream from a node that went away
/// without closing its connections ends after this.
const STREAM_SILENCE: Duration = Duration::from_secs(45);
/// Keep-alive probes on idle connections to peers, so a peer that
/// vanished is noticed by the kernel too.
const TCP_KEEPALIVE: Duration = Duration::from_secs(30);

/// A node to call: its id (for messages and signatures), the URL of its
/// node-to-node listener (for calls), and its public URL (for the app
/// traffic the proxy forwards there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerNode {
    pub id: String,
    /// `[cluster] internal_advertise_url`, as the node's heartbeat wrote it.
    pub url: String,
    /// `advertise_url`.
    pub public_url: String,
}

/// One call about a user: an operation's node-to-node route,
/// `<method> /internal/v1/users/<user>/<name>?<query>`, with an optional
/// JSON body, within `budget`.
#[derive(Debug, Clone)]
pub struct UserCall<'a> {
    pub operation: &'a Internal,
    pub query: Vec<(&'static str, String)>,
    pub body: Option<Value>,
    pub budget: Duration,
}

impl<'a> UserCall<'a> {
    pub fn new(operation: &'a Internal, budget: Duration) -> Self {
        Self {
            operation,
            query: Vec::new(),
            body: None,
            budget,
        }
    }

    #[must_use]
    pub fn query(mut self, key: &'static str, value: impl ToString) -> Self {
        self.query.push((key, value.to_string()));
        self
    }

    #[must_use]
    pub fn body(mut self, body: Value) -> Self {
        self.body = Some(body);
        self
    }
}

/// An HTTP client for node-to-node calls.
#[derive(Clone)]
pub struct PeerClient {
    /// Calls with an answer: each has its own budget.
    http: reqwest::Client,
    /// Event streams: no budget in all, but a bound on silence.
    streams: reqwest::Client,
    key: ClusterKey,
}

/// A peer's answer, as it came.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerAnswer {
    pub status: u16,
    pub body: Value,
}

impl PeerAnswer {
    /// `Ok(body)` for a 2xx answer, else the error it stands for.
    pub fn into_result(self, user: &UserId) -> Result<Value, SpawnError> {
        if (200..300).contains(&self.status) {
            Ok(self.body)
        } else {
            Err(error_from_json(user, self.status, &self.body))
        }
    }
}

impl PeerClient {
    pub fn new(key: ClusterKey) -> Result<Self, reqwest::Error> {
        let builder = || {
            reqwest::Client::builder()
                .connect_timeout(CONNECT_TIMEOUT)
                .tcp_keepalive(TCP_KEEPALIVE)
                // Peers may be many; idle connections to each are kept
                // briefly.
                .pool_idle_timeout(Duration::from_secs(30))
        };
        Ok(Self {
            http: builder().build()?,
            streams: builder().read_timeout(STREAM_SILENCE).build()?,
            key,
        })
    }

    /// `operation`'s node-to-node route on `node`,
    /// `<url>/internal/v1/users/<user>/<name>`, and its method.
    fn user_route(node: &PeerNode, user: &UserId, operation: &Internal) -> (Method, String) {
        let url = format!(
            "{}/internal/v1/users/{}/{}",
            node.url.trim_end_matches('/'),
            user.path_segment(),
            operation.name
        );
        (operation.verb.method(), url)
    }

    /// Builds `request` and signs it as it will be sent, for `node`:
    /// method, path and query, body.
    fn signed(
        node: &PeerNode,
        key: &ClusterKey,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Request, SpawnError> {
        let mut request = request
            .build()
            .map_err(|e| unreachable_peer(&node.id, &node.url, &e))?;
        let url = request.url();
        let target = match url.query() {
            Some(query) => format!("{}?{query}", url.path()),
            None => url.path().to_owned(),
        };
        let body = request
            .body()
            .and_then(reqwest::Body::as_bytes)
            .unwrap_or_default();
        let signed = key
            .sign(&node.id, request.method().as_str(), &target, body)
            .map_err(|e| SpawnError::Internal(e.to_string()))?;
        for (name, value) in signed.headers {
            request.headers_mut().insert(name, value);
        }
        Ok(request)
    }

    /// Sends `request` (signed) and reads its JSON answer (any status). A
    /// transport failure is an error naming the node.
    async fn answer(
        &self,
        node: &PeerNode,
        request: reqwest::RequestBuilder,
    ) -> Result<PeerAnswer, SpawnError> {
        let request = Self::signed(node, &self.key, request)?;
        let response = self
            .http
            .execute(request)
            .await
            .map_err(|e| unreachable_peer(&node.id, &node.url, &e))?;
        let status = response.status().as_u16();
        let text = response
            .text()
            .await
            .map_err(|e| unreachable_peer(&node.id, &node.url, &e))?;
        // An empty answer (e.g. 204) is `null`.
        let body = serde_json::from_str(&text).unwrap_or(Value::Null);
        Ok(PeerAnswer { status, body })
    }

    /// `call` about `user` on `node`: the answer's JSON as `T`, or the
    /// error the callee answered with.
    pub async fn user_call<T: DeserializeOwned>(
        &self,
        node: &PeerNode,
        user: &UserId,
        call: UserCall<'_>,
    ) -> Result<T, SpawnError> {
        let (method, url) = Self::user_route(node, user, call.operation);
        let mut request = self
            .http
            .request(method, url)
            .query(&call.query)
            .timeout(call.budget);
        if let Some(body) = call.body {
            request = request.json(&body);
        }
        let value = self.answer(node, request).await?.into_result(user)?;
        serde_json::from_value(value).map_err(|e| {
            SpawnError::Internal(format!(
                "node {} answered {} for {user} with something unexpected: {e}",
                node.id, call.operation.name
            ))
        })
    }

    /// `operation`'s node-to-node route with `query`, an event stream: its
    /// events until the callee ends it (or the connection breaks, which
    /// ends it here too). An error answer is the error it stands for.
    pub async fn user_events(
        &self,
        node: &PeerNode,
        user: &UserId,
        operation: &Internal,
        query: &[(&str, String)],
    ) -> Result<BoxStream<'static, SseEvent>, SpawnError> {
        let (method, url) = Self::user_route(node, user, operation);
        let request = self.streams.request(method, url).query(query);
        let response = self
            .streams
            .execute(Self::signed(node, &self.key, request)?)
            .await
            .map_err(|e| unreachable_peer(&node.id, &node.url, &e))?;
        let status = response.status().as_u16();
        if !(200..300).contains(&status) {
            let body = response.json::<Value>().await.unwrap_or(Value::Null);
            return Err(error_from_json(user, status, &body));
        }
        let node_id = node.id.clone();
        let events = sse::events(response.bytes_stream()).filter_map(move |event| {
            let event = match event {
                Ok(event) => Some(event),
                Err(e) => {
                    tracing::info!(node = %node_id, error = %e, "a relayed stream ended");
                    None
                }
            };
            std::future::ready(event)
        });
        Ok(events.boxed())
    }

    /// `POST /internal/v1/<path>` (not about one user) within `timeout`:
    /// the 2xx answer's JSON as `T`.
    pub async fn node_call<T: DeserializeOwned>(
        &self,
        node: &PeerNode,
        path: &str,
        timeout: Duration,
    ) -> Result<T, SpawnError> {
        let url = format!("{}/internal/v1/{path}", node.url.trim_end_matches('/'));
        let answer = self
            .answer(node, self.http.post(url).timeout(timeout))
            .await?;
        if !(200..300).contains(&answer.status) {
            return Err(SpawnError::Internal(format!(
                "node {} at {} answered {} to {path}: {}",
                node.id, node.url, answer.status, answer.body
            )));
        }
        serde_json::from_value(answer.body).map_err(|e| {
            SpawnError::Internal(format!(
                "node {} answered {path} with something unexpected: {e}",
                node.id
            ))
        })
    }

    /// `POST /internal/v1/tokens/purge` on `node`: it forgets its cached
    /// user tokens.
    pub async fn purge_tokens(&self, node: &PeerNode) -> Result<(), SpawnError> {
        self.node_call::<Purged>(node, operation::NODE_PURGE_TOKENS, PURGE_TIMEOUT)
            .await
            .map(drop)
    }

    /// `POST /internal/v1/users/{user}/fence` with `{"epoch": epoch}`:
    /// whether `node` fenced an instance of `user` running under exactly
    /// that epoch.
    pub async fn fence(
        &self,
        node: &PeerNode,
        user: &UserId,
        epoch: Epoch,
    ) -> Result<bool, SpawnError> {
        let body = serde_json::to_value(FenceRequest { epoch })
            .map_err(|e| SpawnError::Internal(format!("cannot encode a fence: {e}")))?;
        let call = UserCall::new(&operation::FENCE.internal, FENCE_TIMEOUT).body(body);
        let answer: Fenced = self.user_call(node, user, call).await?;
        Ok(answer.fenced)
    }
}

fn unreachable_peer(node: &str, base: &str, e: &reqwest::Error) -> SpawnError {
    // reqwest's own message ("error sending request") hides the cause:
    // a refused connection, a timeout, a connection the peer closed.
    let mut reason = format!("{base}: {e}");
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        reason.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    SpawnError::NodeUnreachable {
        node: node.to_owned(),
        reason,
    }
}

/// The [`SpawnError`] an API error answer stands for, so that it is
/// answered again with the same code and status: the exact one when the
/// body is an [`ErrorBody`] with its variant's data, else (an older node,
/// an error that is no [`SpawnError`]) the best reading of its `error`
/// code, as [`error_from_code`] makes it.
pub fn error_from_json(user: &UserId, status: u16, body: &Value) -> SpawnError {
    ErrorBody::deserialize(body)
        .ok()
        .and_then(ErrorBody::into_spawn_error)
        .unwrap_or_else(|| error_from_code(user, status, body))
}

/// The [`SpawnError`] of a body without its variant's data, by its
/// `error` code and what the message says. Codes only a peer's own auth
/// can produce (`unauthorized`, `forbidden`) mean this node's cluster
/// secret is wrong: an internal error here, not the caller's fault.
fn error_from_code(user: &UserId, status: u16, body: &Value) -> SpawnError {
    let code = body["error"].as_str().unwrap_or("");
    let message = body["message"].as_str().unwrap_or("").to_owned();
    let retry_after_ms = body["retry_after_ms"].as_u64();
    match code {
        "invalid_request" => SpawnError::InvalidRequest(message),
        "invalid_user" => SpawnError::InvalidRequest(message),
        "not_found" => SpawnError::NotFound {
            user: user.clone(),
            what: "instance".into(),
        },
        "already_running" => SpawnError::AlreadyRunning { user: user.clone() },
        "instance_circuit_open" => SpawnError::CircuitOpen {
            user: user.clone(),
            opens: body["opens"]
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(1),
            retry_at: unix_millis_now()
                .saturating_add(i64::try_from(retry_after_ms.unwrap_or(0)).unwrap_or(i64::MAX)),
        },
        "instance_starting" => SpawnError::Starting {
            user: user.clone(),
            retry_after_ms: retry_after_ms.unwrap_or(2000),
        },
        "lease_busy" => SpawnError::LeaseBusy {
            user: user.clone(),
            holder: body["holder"].as_str().unwrap_or("").to_owned(),
            expired: body["expired"].as_bool().unwrap_or(false),
        },
        "payload_too_large" => SpawnError::PayloadTooLarge {
            size: body["size"]
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(0),
            limit: berth_core::MAX_PATCH_BYTES,
        },
        "spawn_failed" => SpawnError::SpawnFailed(strip_prefix(&message, "spawn failed: ")),
        "capacity_exhausted" => {
            SpawnError::CapacityExhausted(strip_prefix(&message, "capacity exhausted: "))
        }
        "store_unavailable" => {
            SpawnError::StoreUnavailable(strip_prefix(&message, "store unavailable: "))
        }
        "too_many_streams" => {
            SpawnError::TooManyStreams(strip_prefix(&message, "too many streams: "))
        }
        // The callee could not reach the node it asked in turn.
        "node_unreachable" => {
            let node = body["node"].as_str().unwrap_or("").to_owned();
            let reason = strip_prefix(&message, &format!("node {node} did not answer: "));
            SpawnError::NodeUnreachable { node, reason }
        }
        "unauthorized" | "forbidden" => SpawnError::Internal(format!(
            "another node refused this node's cluster call ({code}): are the cluster secrets the same?"
        )),
        _ => SpawnError::Internal(if message.is_empty() {
            format!("another node answered HTTP {status}")
        } else {
            strip_prefix(&message, "internal error: ")
        }),
    }
}

/// The message without the prefix its `Display` adds, so that it is not
/// doubled when the error is displayed again.
fn strip_prefix(message: &str, prefix: &str) -> String {
    message.strip_prefix(prefix).unwrap_or(message).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_core::ErrorCode;
    use serde_json::json;

    fn alice() -> UserId {
        UserId::parse("alice").unwrap()
    }

    #[test]
    fn error_codes_survive_the_trip() {
        let cases: &[(u16, Value, ErrorCode)] = &[
            (
                400,
                json!({"error": "invalid_request", "message": "x"}),
                ErrorCode::InvalidRequest,
            ),
            (404, json!({"error": "not_found"}), ErrorCode::NotFound),
            (
                409,
                json!({"error": "already_running"}),
                ErrorCode::AlreadyRunning,
            ),
            (
                503,
                json!({"error": "instance_circuit_open", "opens": 2, "retry_after_ms": 5000}),
                ErrorCode::InstanceCircuitOpen,
            ),
            (
                503,
                json!({"error": "instance_starting", "retry_after_ms": 2000}),
                ErrorCode::InstanceStarting,
            ),
            (
                409,
                json!({"error": "lease_busy", "holder": "b", "expired": true}),
                ErrorCode::LeaseBusy,
            ),
            (
                413,
                json!({"error": "payload_too_large"}),
                ErrorCode::PayloadTooLarge,
            ),
            (
                500,
                json!({"error": "spawn_failed", "message": "spawn failed: boom"}),
                ErrorCode::SpawnFailed,
            ),
            (
                503,
                json!({"error": "capacity_exhausted", "message": "capacity exhausted: full"}),
                ErrorCode::CapacityExhausted,
            ),
            (
                503,
                json!({"error": "store_unavailable", "message": "store unavailable: down"}),
                ErrorCode::StoreUnavailable,
            ),
            (
                429,
                json!({"error": "too_many_streams", "message": "too many streams: alice has 5"}),
                ErrorCode::TooManyStreams,
            ),
            (
                503,
                json!({"error": "node_unreachable", "node": "node-b", "message": "node node-b did not answer: refused"}),
                ErrorCode::NodeUnreachable,
            ),
            (401, json!({"error": "unauthorized"}), ErrorCode::Internal),
            (502, json!({"error": "bad_gateway"}), ErrorCode::Internal),
            (500, Value::Null, ErrorCode::Internal),
        ];
        for (status, body, want) in cases {
            let e = error_from_json(&alice(), *status, body);
            assert_eq!(e.code(), *want, "{body}");
            if e.code() != ErrorCode::Internal {
                assert_eq!(want.http_status(), *status, "{body}");
            }
        }
    }

    #[test]
    fn details_survive_the_trip() {
        let e = error_from_json(
            &alice(),
            503,
            &json!({"error": "instance_circuit_open", "opens": 3, "retry_after_ms": 60_000}),
        );
        let SpawnError::CircuitOpen { opens, .. } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(*opens, 3);
        let left = e.retry_after_ms(unix_millis_now()).unwrap();
        assert!((55_000..=60_000).contains(&left), "{left}");
        assert_eq!(
            error_from_json(
                &alice(),
                409,
                &json!({"error": "lease_busy", "holder": "node-b", "expired": false})
            ),
            SpawnError::LeaseBusy {
                user: alice(),
                holder: "node-b".into(),
                expired: false
            }
        );
        assert_eq!(
            error_from_json(
                &alice(),
                500,
                &json!({"error": "spawn_failed", "message": "spawn failed: no such file"})
            )
            .to_string(),
            "spawn failed: no such file"
        );
        let unreachable = SpawnError::NodeUnreachable {
            node: "node-b".into(),
            reason: "http://127.0.0.1:1: connection refused".into(),
        };
        assert_eq!(
            error_from_json(
                &alice(),
                503,
                &json!({"error": "node_unreachable", "node": "node-b", "message": unreachable.to_string()})
            ),
            unreachable
        );
    }

    #[test]
    fn a_full_body_gives_back_the_exact_error() {
        let errors = [
            SpawnError::InvalidUser(berth_core::InvalidUserId::LeadingDot),
            SpawnError::InvalidRequest("bad folder".into()),
            SpawnError::NotFound {
                user: alice(),
                what: "live main instance".into(),
            },
            SpawnError::CircuitOpen {
                user: alice(),
                opens: 3,
                retry_at: 1_234,
            },
            SpawnError::PayloadTooLarge { size: 10, limit: 5 },
            SpawnError::SpawnFailed("spawn failed: said the program".into()),
            SpawnError::Internal(String::new()),
        ];
        for e in errors {
            let body = serde_json::to_value(ErrorBody::from_spawn_error(&e, 0)).unwrap();
            let status = e.code().http_status();
            assert_eq!(error_from_json(&alice(), status, &body), e, "{body}");
        }
    }

    #[test]
    fn bodies_without_the_data_are_read_as_before() {
        // From an older node, or an error that was no SpawnError: the code
        // and the message's text.
        assert_eq!(
            error_from_json(
                &alice(),
                404,
                &serde_json::to_value(ErrorBody::new(ErrorCode::NotFound, "no such token"))
                    .unwrap()
            ),
            SpawnError::NotFound {
                user: alice(),
                what: "instance".into()
            }
        );
        assert_eq!(
            error_from_json(
                &alice(),
                400,
                &json!({"error": "invalid_user", "message": "invalid user id: user id is empty"})
            ),
            SpawnError::InvalidRequest("invalid user id: user id is empty".into())
        );
        assert_eq!(
            error_from_json(
                &alice(),
                500,
                &json!({"error": "internal", "message": "internal error: oops"})
            ),
            SpawnError::Internal("oops".into())
        );
    }

    #[test]
    fn unknown_and_peer_only_codes_are_internal() {
        assert_eq!(
            error_from_json(
                &alice(),
                418,
                &json!({"error": "teapot", "message": "short"})
            ),
            SpawnError::Internal("short".into())
        );
        assert_eq!(
            error_from_json(&alice(), 502, &json!({"error": "bad_gateway"})),
            SpawnError::Internal("another node answered HTTP 502".into())
        );
        for code in [ErrorCode::Unauthorized, ErrorCode::Forbidden] {
            let body = serde_json::to_value(ErrorBody::new(code, "bad signature")).unwrap();
            let e = error_from_json(&alice(), code.http_status(), &body);
            assert_eq!(e.code(), ErrorCode::Internal, "{body}");
            assert!(e.to_string().contains("cluster secrets"), "{e}");
        }
    }

    #[test]
    fn answers_split_into_ok_and_errors() {
        let ok = PeerAnswer {
            status: 201,
            body: json!({"instance": {}}),
        };
        assert!(ok.into_result(&alice()).is_ok());
        let busy = PeerAnswer {
            status: 409,
            body: json!({"error": "lease_busy", "holder": "c", "expired": false}),
        };
        assert_eq!(
            busy.into_result(&alice()).map_err(|e| e.code()),
            Err(ErrorCode::LeaseBusy)
        );
    }
}
