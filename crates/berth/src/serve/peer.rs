//! Calls from one node to another (design §7.3, §8.2): launch a user's
//! instance on the node placement chose, and fence a user's instance on its
//! old holder. Every call carries the cluster secret in
//! `X-Berth-Cluster-Secret`; the answer is the callee's API answer, whose
//! error JSON maps back to the [`SpawnError`] it came from, so an error
//! keeps its code and HTTP meaning across nodes.

use std::time::Duration;

use berth_core::{Epoch, LaunchRequest, SpawnError, UserId, unix_millis_now};
use berth_proxy::auth::{CLUSTER_SECRET, ClusterSecret};
use serde_json::{Value, json};

/// How long a peer may take to accept a connection. Peers are in the same
/// network; a node that does not answer this fast is as good as gone.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Budget of a fence call: the callee kills at once and waits for the exit.
const FENCE_TIMEOUT: Duration = Duration::from_secs(5);
/// Budget of a token purge: the callee clears a map and answers.
const PURGE_TIMEOUT: Duration = Duration::from_secs(3);
/// Added to the callee's ready timeout for a launch that waits for ready.
const LAUNCH_MARGIN: Duration = Duration::from_secs(5);

/// An HTTP client for node-to-node calls.
#[derive(Clone)]
pub struct PeerClient {
    http: reqwest::Client,
    secret: ClusterSecret,
    /// How long a launch waits on the callee (its `ready_timeout`).
    ready_timeout: Duration,
}

/// A peer's answer to a launch, as it came: passed through verbatim by the
/// API, turned back into an error by the proxy.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerAnswer {
    pub status: u16,
    pub body: Value,
    /// The `Retry-After` header, seconds.
    pub retry_after: Option<String>,
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

    /// The error this answer stands for, if it is one.
    pub fn error(&self, user: &UserId) -> Option<SpawnError> {
        (!(200..300).contains(&self.status)).then(|| error_from_json(user, self.status, &self.body))
    }
}

impl PeerClient {
    pub fn new(secret: ClusterSecret, ready_timeout: Duration) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            // Peers may be many; idle connections to each are kept briefly.
            .pool_idle_timeout(Duration::from_secs(30))
            .build()?;
        Ok(Self {
            http,
            secret,
            ready_timeout,
        })
    }

    fn url(base: &str, user: &UserId, action: &str) -> String {
        format!(
            "{}/internal/v1/users/{}/{action}",
            base.trim_end_matches('/'),
            user.path_segment()
        )
    }

    /// `POST /internal/v1/users/{user}/launch` on the node at `base`: a
    /// local launch there (waiting for ready with `wait`). A transport
    /// failure is an error; any HTTP answer is returned as it came.
    pub async fn launch(
        &self,
        base: &str,
        node: &str,
        user: &UserId,
        request: &LaunchRequest,
        wait: bool,
    ) -> Result<PeerAnswer, SpawnError> {
        let url = format!("{}?wait={wait}", Self::url(base, user, "launch"));
        let timeout = if wait {
            self.ready_timeout + LAUNCH_MARGIN
        } else {
            LAUNCH_MARGIN * 2
        };
        let response = self
            .http
            .post(&url)
            .header(&CLUSTER_SECRET, self.secret.header_value().clone())
            .json(request)
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| unreachable_peer(node, base, &e))?;
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = response
            .json::<Value>()
            .await
            .map_err(|e| unreachable_peer(node, base, &e))?;
        Ok(PeerAnswer {
            status,
            body,
            retry_after,
        })
    }

    /// `POST /internal/v1/tokens/purge` on the node at `base`: it forgets
    /// its cached user tokens. Ok only for a 2xx answer.
    pub async fn purge_tokens(&self, base: &str, node: &str) -> Result<(), SpawnError> {
        let response = self
            .http
            .post(format!(
                "{}/internal/v1/tokens/purge",
                base.trim_end_matches('/')
            ))
            .header(&CLUSTER_SECRET, self.secret.header_value().clone())
            .timeout(PURGE_TIMEOUT)
            .send()
            .await
            .map_err(|e| unreachable_peer(node, base, &e))?;
        if response.status().is_success() {
            Ok(())
        } else {
            Err(SpawnError::Internal(format!(
                "node {node} at {base} answered {} to a token purge",
                response.status()
            )))
        }
    }

    /// `POST /internal/v1/users/{user}/fence` with `{"epoch": epoch}`:
    /// whether the node at `base` fenced an instance of `user` running under
    /// exactly that epoch.
    pub async fn fence(
        &self,
        base: &str,
        node: &str,
        user: &UserId,
        epoch: Epoch,
    ) -> Result<bool, SpawnError> {
        let response = self
            .http
            .post(Self::url(base, user, "fence"))
            .header(&CLUSTER_SECRET, self.secret.header_value().clone())
            .json(&json!({ "epoch": epoch }))
            .timeout(FENCE_TIMEOUT)
            .send()
            .await
            .map_err(|e| unreachable_peer(node, base, &e))?;
        let status = response.status().as_u16();
        let body = response
            .json::<Value>()
            .await
            .map_err(|e| unreachable_peer(node, base, &e))?;
        let answer = PeerAnswer {
            status,
            body,
            retry_after: None,
        };
        let body = answer.into_result(user)?;
        Ok(body["fenced"].as_bool().unwrap_or(false))
    }
}

fn unreachable_peer(node: &str, base: &str, e: &reqwest::Error) -> SpawnError {
    SpawnError::Internal(format!("node {node} ({base}) did not answer: {e}"))
}

/// The [`SpawnError`] an API error answer stands for, by its `error` code
/// (design §8.4), so that it is answered again with the same code and
/// status. Codes only a peer's own auth can produce (`unauthorized`,
/// `forbidden`) mean this node's cluster secret is wrong: an internal
/// error here, not the caller's fault.
pub fn error_from_json(user: &UserId, status: u16, body: &Value) -> SpawnError {
    let code = body["error"].as_str().unwrap_or("");
    let message = body["message"].as_str().unwrap_or("").to_owned();
    let retry_after_ms = body["retry_after_ms"].as_u64();
    match code {
        "invalid_request" => SpawnError::InvalidRequest(message),
        "invalid_user" => SpawnError::InvalidRequest(message),
        "not_found" => SpawnError::NotFound {
            user: user.clone(),
            what: "instance",
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
    }

    #[test]
    fn answers_split_into_ok_and_errors() {
        let ok = PeerAnswer {
            status: 201,
            body: json!({"instance": {}}),
            retry_after: None,
        };
        assert!(ok.error(&alice()).is_none());
        assert!(ok.into_result(&alice()).is_ok());
        let busy = PeerAnswer {
            status: 409,
            body: json!({"error": "lease_busy", "holder": "c", "expired": false}),
            retry_after: None,
        };
        assert_eq!(
            busy.error(&alice()).map(|e| e.code()),
            Some(ErrorCode::LeaseBusy)
        );
    }
}
