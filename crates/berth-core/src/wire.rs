//! The JSON body of every error answer: `{"error": code, "message": …}`
//! plus the data of the [`SpawnError`] it came from, so that a node (or a
//! client) reads the error back without parsing its message.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::{ErrorCode, InvalidUserId, SpawnError, UnixMillis, UserId};

/// An error answer's body, as the API, the proxy and the node-to-node
/// listener write it and as a node reads a peer's.
///
/// `error` and `message` are always there; every other field is written
/// only when the error carries it. Decoding goes back to the exact
/// [`SpawnError`] when the body holds everything its variant needs
/// ([`ErrorBody::into_spawn_error`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The stable code ([`ErrorCode::as_str`]).
    pub error: ErrorCode,
    /// The error in words, for people: the [`SpawnError`]'s `Display`.
    #[serde(default)]
    pub message: String,
    /// How long to wait before asking again, relative to when the answer
    /// was written (also sent as `Retry-After`, in seconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// How many times the user's crash breaker has opened
    /// (`instance_circuit_open`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opens: Option<u32>,
    /// When the crash breaker's cooldown ends, wall clock
    /// (`instance_circuit_open`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<UnixMillis>,
    /// The node holding the user's lease (`lease_busy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// Whether that lease has expired without evidence that its holder is
    /// gone (`lease_busy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expired: Option<bool>,
    /// The node that did not answer (`node_unreachable`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The user the error is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<UserId>,
    /// What the user has none of (`not_found`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub what: Option<Cow<'static, str>>,
    /// The rejected body's size in bytes (`payload_too_large`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<usize>,
    /// The most allowed, in bytes (`payload_too_large`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
    /// Why the user id is not valid (`invalid_user`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub invalid_user: Option<InvalidUserId>,
    /// The error's own text, without the prefix `message` adds: the reason
    /// of `invalid_request`, `spawn_failed`, `capacity_exhausted`,
    /// `store_unavailable`, `too_many_streams`, `node_unreachable` and
    /// `internal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl ErrorBody {
    /// A body with only a code and a message, for errors that are no
    /// [`SpawnError`] (a refused credential, an unsupported body, …).
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            error: code,
            message: message.into(),
            retry_after_ms: None,
            opens: None,
            retry_at: None,
            holder: None,
            expired: None,
            node: None,
            user: None,
            what: None,
            size: None,
            limit: None,
            invalid_user: None,
            detail: None,
        }
    }

    /// The body of `error`, answered at `now` (which `retry_after_ms` is
    /// counted from).
    pub fn from_spawn_error(error: &SpawnError, now: UnixMillis) -> Self {
        let mut body = Self::new(error.code(), error.to_string());
        body.retry_after_ms = error.retry_after_ms(now);
        match error {
            SpawnError::InvalidUser(why) => body.invalid_user = Some(why.clone()),
            SpawnError::NotFound { user, what } => {
                body.user = Some(user.clone());
                body.what = Some(what.clone());
            }
            SpawnError::AlreadyRunning { user } => body.user = Some(user.clone()),
            SpawnError::CircuitOpen {
                user,
                opens,
                retry_at,
            } => {
                body.user = Some(user.clone());
                body.opens = Some(*opens);
                body.retry_at = Some(*retry_at);
            }
            SpawnError::Starting { user, .. } => body.user = Some(user.clone()),
            SpawnError::LeaseBusy {
                user,
                holder,
                expired,
            } => {
                body.user = Some(user.clone());
                body.holder = Some(holder.clone());
                body.expired = Some(*expired);
            }
            SpawnError::PayloadTooLarge { size, limit } => {
                body.size = Some(*size);
                body.limit = Some(*limit);
            }
            SpawnError::NodeUnreachable { node, reason } => {
                body.node = Some(node.clone());
                body.detail = Some(reason.clone());
            }
            SpawnError::InvalidRequest(detail)
            | SpawnError::SpawnFailed(detail)
            | SpawnError::CapacityExhausted(detail)
            | SpawnError::StoreUnavailable(detail)
            | SpawnError::TooManyStreams(detail)
            | SpawnError::Internal(detail) => body.detail = Some(detail.clone()),
        }
        body
    }

    /// The exact [`SpawnError`] this body was written from, or `None` when
    /// it cannot be rebuilt: a code no [`SpawnError`] has (`unauthorized`,
    /// `forbidden`, …), or a body without the fields its variant needs
    /// (written by [`ErrorBody::new`], or by an older node). The caller
    /// decides what those mean where it reads them.
    pub fn into_spawn_error(self) -> Option<SpawnError> {
        let user = self.user;
        let detail = self.detail;
        Some(match self.error {
            ErrorCode::InvalidUser => SpawnError::InvalidUser(self.invalid_user?),
            ErrorCode::InvalidRequest => SpawnError::InvalidRequest(detail?),
            ErrorCode::NotFound => SpawnError::NotFound {
                user: user?,
                what: self.what?,
            },
            ErrorCode::AlreadyRunning => SpawnError::AlreadyRunning { user: user? },
            ErrorCode::InstanceCircuitOpen => SpawnError::CircuitOpen {
                user: user?,
                opens: self.opens?,
                retry_at: self.retry_at?,
            },
            ErrorCode::InstanceStarting => SpawnError::Starting {
                user: user?,
                retry_after_ms: self.retry_after_ms?,
            },
            ErrorCode::LeaseBusy => SpawnError::LeaseBusy {
                user: user?,
                holder: self.holder?,
                expired: self.expired?,
            },
            ErrorCode::PayloadTooLarge => SpawnError::PayloadTooLarge {
                size: self.size?,
                limit: self.limit?,
            },
            ErrorCode::SpawnFailed => SpawnError::SpawnFailed(detail?),
            ErrorCode::CapacityExhausted => SpawnError::CapacityExhausted(detail?),
            ErrorCode::StoreUnavailable => SpawnError::StoreUnavailable(detail?),
            ErrorCode::TooManyStreams => SpawnError::TooManyStreams(detail?),
            ErrorCode::NodeUnreachable => SpawnError::NodeUnreachable {
                node: self.node?,
                reason: detail?,
            },
            ErrorCode::Internal => SpawnError::Internal(detail?),
            ErrorCode::Unauthorized
            | ErrorCode::Forbidden
            | ErrorCode::TooManyTokens
            | ErrorCode::UnsupportedMediaType
            | ErrorCode::RequestTimeout
            | ErrorCode::BadGateway
            | ErrorCode::TooManyUpgrades
            | ErrorCode::TooManyRequests => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn user() -> impl Strategy<Value = UserId> {
        any::<String>().prop_filter_map("not a valid user id", |s| UserId::parse(&s).ok())
    }

    fn invalid_user() -> impl Strategy<Value = InvalidUserId> {
        prop_oneof![
            Just(InvalidUserId::Empty),
            any::<usize>().prop_map(InvalidUserId::TooLong),
            Just(InvalidUserId::LeadingDot),
            any::<char>().prop_map(InvalidUserId::ForbiddenChar),
        ]
    }

    fn spawn_error() -> impl Strategy<Value = SpawnError> {
        let text = any::<String>;
        prop_oneof![
            invalid_user().prop_map(SpawnError::InvalidUser),
            text().prop_map(SpawnError::InvalidRequest),
            (user(), text()).prop_map(|(user, what)| SpawnError::NotFound {
                user,
                what: what.into()
            }),
            user().prop_map(|user| SpawnError::AlreadyRunning { user }),
            (user(), any::<u32>(), any::<UnixMillis>()).prop_map(|(user, opens, retry_at)| {
                SpawnError::CircuitOpen {
                    user,
                    opens,
                    retry_at,
                }
            }),
            (user(), any::<u64>()).prop_map(|(user, retry_after_ms)| SpawnError::Starting {
                user,
                retry_after_ms
            }),
            (user(), text(), any::<bool>()).prop_map(|(user, holder, expired)| {
                SpawnError::LeaseBusy {
                    user,
                    holder,
                    expired,
                }
            }),
            (any::<usize>(), any::<usize>())
                .prop_map(|(size, limit)| SpawnError::PayloadTooLarge { size, limit }),
            text().prop_map(SpawnError::SpawnFailed),
            text().prop_map(SpawnError::CapacityExhausted),
            text().prop_map(SpawnError::StoreUnavailable),
            text().prop_map(SpawnError::TooManyStreams),
            (text(), text())
                .prop_map(|(node, reason)| SpawnError::NodeUnreachable { node, reason }),
            text().prop_map(SpawnError::Internal),
        ]
    }

    proptest! {
        #[test]
        fn every_spawn_error_survives_the_json_text(
            error in spawn_error(),
            now in any::<UnixMillis>(),
        ) {
            let text = serde_json::to_string(&ErrorBody::from_spawn_error(&error, now)).unwrap();
            let body: ErrorBody = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(body.error, error.code());
            prop_assert_eq!(body.into_spawn_error(), Some(error));
        }
    }

    #[test]
    fn codes_are_written_as_their_strings() {
        for code in ErrorCode::ALL {
            let text = serde_json::to_string(&code).unwrap();
            assert_eq!(text, format!("\"{}\"", code.as_str()));
            assert_eq!(serde_json::from_str::<ErrorCode>(&text).unwrap(), code);
            assert_eq!(ErrorCode::parse(code.as_str()), Some(code));
        }
        assert!(serde_json::from_str::<ErrorCode>(r#""gateway_exploded""#).is_err());
    }

    #[test]
    fn todays_fields_keep_their_names() {
        let user = UserId::parse("alice").unwrap();
        let body =
            |e: &SpawnError| serde_json::to_value(ErrorBody::from_spawn_error(e, 1_000)).unwrap();
        let open = body(&SpawnError::CircuitOpen {
            user: user.clone(),
            opens: 2,
            retry_at: 6_000,
        });
        assert_eq!(open["error"], "instance_circuit_open");
        assert_eq!(open["opens"], 2);
        assert_eq!(open["retry_after_ms"], 5_000);
        let busy = body(&SpawnError::LeaseBusy {
            user: user.clone(),
            holder: "node-b".into(),
            expired: true,
        });
        assert_eq!(busy["holder"], "node-b");
        assert_eq!(busy["expired"], true);
        assert!(busy.get("retry_after_ms").is_none(), "{busy}");
        let gone = body(&SpawnError::NodeUnreachable {
            node: "node-b".into(),
            reason: "refused".into(),
        });
        assert_eq!(gone["node"], "node-b");
        assert_eq!(
            gone["retry_after_ms"],
            crate::error::NODE_UNREACHABLE_RETRY_MS
        );
        assert_eq!(gone["message"], "node node-b did not answer: refused");
        let plain = serde_json::to_string(&ErrorBody::new(ErrorCode::Forbidden, "no")).unwrap();
        assert_eq!(plain, r#"{"error":"forbidden","message":"no"}"#);
    }

    #[test]
    fn bodies_without_the_data_are_not_guessed() {
        // What an older node, or an answer not built from a SpawnError,
        // writes: the reader falls back on its own reading.
        for text in [
            r#"{"error":"not_found","message":"no such token"}"#,
            r#"{"error":"spawn_failed","message":"spawn failed: boom"}"#,
            r#"{"error":"lease_busy","holder":"b","expired":false}"#,
            r#"{"error":"unauthorized","message":"bad signature"}"#,
        ] {
            let body: ErrorBody = serde_json::from_str(text).unwrap();
            assert_eq!(body.into_spawn_error(), None, "{text}");
        }
        // A code this build does not know is not an ErrorBody at all.
        assert!(serde_json::from_str::<ErrorBody>(r#"{"error":"gateway_exploded"}"#).is_err());
    }
}
