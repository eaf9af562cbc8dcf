use std::fmt;

use crate::{InvalidUserId, UnixMillis, UserId};

/// The stable error codes of the HTTP API (a contract).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    InvalidUser,
    InvalidRequest,
    NotFound,
    AlreadyRunning,
    InstanceCircuitOpen,
    InstanceStarting,
    LeaseBusy,
    Unauthorized,
    Forbidden,
    PayloadTooLarge,
    SpawnFailed,
    CapacityExhausted,
    StoreUnavailable,
    /// A user already has as many live tokens as `[auth]
    /// max_tokens_per_user` allows.
    TooManyTokens,
    /// A request body that is not JSON: form and text bodies are what a
    /// cross-site form can send, so the API refuses them.
    UnsupportedMediaType,
    /// A user holds as many long-lived streams (WebSockets, progress
    /// streams) as one user may (`[proxy] max_upgrades_per_user`).
    TooManyStreams,
    /// The request body arrived too slowly (`[proxy] body_min_bytes_per_s`,
    /// `body_grace_ms`).
    RequestTimeout,
    /// The node that runs the user (or was asked to) did not answer: it is
    /// down, paused or cut off, and either comes back or loses the lease
    /// to another node. A moment's condition, not berth's fault.
    NodeUnreachable,
    Internal,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidUser => "invalid_user",
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::NotFound => "not_found",
            ErrorCode::AlreadyRunning => "already_running",
            ErrorCode::InstanceCircuitOpen => "instance_circuit_open",
            ErrorCode::InstanceStarting => "instance_starting",
            ErrorCode::LeaseBusy => "lease_busy",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::SpawnFailed => "spawn_failed",
            ErrorCode::CapacityExhausted => "capacity_exhausted",
            ErrorCode::StoreUnavailable => "store_unavailable",
            ErrorCode::TooManyTokens => "too_many_tokens",
            ErrorCode::UnsupportedMediaType => "unsupported_media_type",
            ErrorCode::TooManyStreams => "too_many_streams",
            ErrorCode::RequestTimeout => "request_timeout",
            ErrorCode::NodeUnreachable => "node_unreachable",
            ErrorCode::Internal => "internal",
        }
    }

    /// The HTTP status this code is answered with.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidUser | ErrorCode::InvalidRequest => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::RequestTimeout => 408,
            ErrorCode::AlreadyRunning | ErrorCode::LeaseBusy | ErrorCode::TooManyTokens => 409,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::UnsupportedMediaType => 415,
            ErrorCode::TooManyStreams => 429,
            ErrorCode::SpawnFailed | ErrorCode::Internal => 500,
            ErrorCode::InstanceCircuitOpen
            | ErrorCode::InstanceStarting
            | ErrorCode::CapacityExhausted
            | ErrorCode::StoreUnavailable
            | ErrorCode::NodeUnreachable => 503,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// When to retry after [`SpawnError::NodeUnreachable`]: a node that does not
/// answer is back, or has lost its users' leases to a node that does, within
/// about one lease TTL; a client asking again every second sees either soon.
pub const NODE_UNREACHABLE_RETRY_MS: u64 = 1000;

/// Why a lifecycle operation failed. Every variant maps to one [`ErrorCode`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpawnError {
    #[error("invalid user id: {0}")]
    InvalidUser(#[from] InvalidUserId),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("user {user} has no {what}")]
    NotFound { user: UserId, what: &'static str },
    #[error("user {user} already has a live instance")]
    AlreadyRunning { user: UserId },
    #[error(
        "the crash breaker is open for user {user} after {opens} open(s); retry after {retry_at} (unix ms)"
    )]
    CircuitOpen {
        user: UserId,
        opens: u32,
        /// When the cooldown ends, wall clock.
        retry_at: UnixMillis,
    },
    #[error("the instance of user {user} is still starting")]
    Starting { user: UserId, retry_after_ms: u64 },
    #[error("the lease of user {user} is held by node {holder}")]
    LeaseBusy {
        user: UserId,
        holder: String,
        /// True when the holder's lease has expired but there is no evidence
        /// that the holder is gone: an operator must take it over.
        expired: bool,
    },
    #[error("patch is {size} bytes; the limit is {limit}")]
    PayloadTooLarge { size: usize, limit: usize },
    #[error("spawn failed: {0}")]
    SpawnFailed(String),
    #[error("capacity exhausted: {0}")]
    CapacityExhausted(String),
    #[error("store unavailable: {0}")]
    StoreUnavailable(String),
    /// A user's long-lived streams are at their cap (on the node that
    /// refused, perhaps another one that relayed the stream).
    #[error("too many streams: {0}")]
    TooManyStreams(String),
    /// Another node, asked to act for a user, did not answer.
    #[error("node {node} did not answer: {reason}")]
    NodeUnreachable { node: String, reason: String },
    #[error("internal error: {0}")]
    Internal(String),
}

impl SpawnError {
    pub fn code(&self) -> ErrorCode {
        match self {
            SpawnError::InvalidUser(_) => ErrorCode::InvalidUser,
            SpawnError::InvalidRequest(_) => ErrorCode::InvalidRequest,
            SpawnError::NotFound { .. } => ErrorCode::NotFound,
            SpawnError::AlreadyRunning { .. } => ErrorCode::AlreadyRunning,
            SpawnError::CircuitOpen { .. } => ErrorCode::InstanceCircuitOpen,
            SpawnError::Starting { .. } => ErrorCode::InstanceStarting,
            SpawnError::LeaseBusy { .. } => ErrorCode::LeaseBusy,
            SpawnError::PayloadTooLarge { .. } => ErrorCode::PayloadTooLarge,
            SpawnError::SpawnFailed(_) => ErrorCode::SpawnFailed,
            SpawnError::CapacityExhausted(_) => ErrorCode::CapacityExhausted,
            SpawnError::StoreUnavailable(_) => ErrorCode::StoreUnavailable,
            SpawnError::TooManyStreams(_) => ErrorCode::TooManyStreams,
            SpawnError::NodeUnreachable { .. } => ErrorCode::NodeUnreachable,
            SpawnError::Internal(_) => ErrorCode::Internal,
        }
    }

    /// How long a client should wait before retrying, when that is known.
    pub fn retry_after_ms(&self, now: UnixMillis) -> Option<u64> {
        match self {
            SpawnError::CircuitOpen { retry_at, .. } => {
                Some(u64::try_from(retry_at.saturating_sub(now)).unwrap_or(0))
            }
            SpawnError::Starting { retry_after_ms, .. } => Some(*retry_after_ms),
            SpawnError::NodeUnreachable { .. } => Some(NODE_UNREACHABLE_RETRY_MS),
            _ => None,
        }
    }
}
