use std::borrow::Cow;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{InvalidUserId, UnixMillis, UserId};

/// The stable error codes of the HTTP API (a contract).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The user id in the request is not a valid [`UserId`].
    InvalidUser,
    /// The request is malformed or asks for something its target cannot
    /// do (a bad folder, a missing field, an action not allowed now).
    InvalidRequest,
    /// The user, instance, token or route asked for does not exist.
    NotFound,
    /// The user already has a live instance of the role asked for.
    AlreadyRunning,
    /// The user's crash breaker is open: no launch until its cooldown ends,
    /// unless forced.
    InstanceCircuitOpen,
    /// The instance is on its way up (or being adopted); ask again soon.
    InstanceStarting,
    /// Another node holds the user's lease; the answer names it.
    LeaseBusy,
    /// No credential, or one that is not valid.
    Unauthorized,
    /// A valid credential that may not do this.
    Forbidden,
    /// The request body (a patch, say) is over its limit.
    PayloadTooLarge,
    /// The runtime could not start the program, or it never became ready.
    SpawnFailed,
    /// The node (or the runtime) has no room for another instance.
    CapacityExhausted,
    /// The store cannot be reached.
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
    /// The user's instance did not answer the proxy, or answered with
    /// something that is not HTTP.
    BadGateway,
    /// The node holds as many long-lived streams as it allows in all
    /// (`[proxy] max_upgrades`).
    TooManyUpgrades,
    /// Too many refused node-to-node calls from one address: it is slowed
    /// down before it can guess a signature.
    TooManyRequests,
    /// Anything else: a fault of berth's, not of the request.
    Internal,
}

impl ErrorCode {
    /// Every code, for parsing one back from its string.
    pub(crate) const ALL: [ErrorCode; 22] = [
        ErrorCode::InvalidUser,
        ErrorCode::InvalidRequest,
        ErrorCode::NotFound,
        ErrorCode::AlreadyRunning,
        ErrorCode::InstanceCircuitOpen,
        ErrorCode::InstanceStarting,
        ErrorCode::LeaseBusy,
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::PayloadTooLarge,
        ErrorCode::SpawnFailed,
        ErrorCode::CapacityExhausted,
        ErrorCode::StoreUnavailable,
        ErrorCode::TooManyTokens,
        ErrorCode::UnsupportedMediaType,
        ErrorCode::TooManyStreams,
        ErrorCode::RequestTimeout,
        ErrorCode::NodeUnreachable,
        ErrorCode::BadGateway,
        ErrorCode::TooManyUpgrades,
        ErrorCode::TooManyRequests,
        ErrorCode::Internal,
    ];

    /// The code whose [`as_str`](Self::as_str) is `s`, if there is one.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|code| code.as_str() == s)
    }

    /// The code as the API writes it in an error's JSON (`snake_case`).
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
            ErrorCode::BadGateway => "bad_gateway",
            ErrorCode::TooManyUpgrades => "too_many_upgrades",
            ErrorCode::TooManyRequests => "too_many_requests",
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
            ErrorCode::TooManyStreams | ErrorCode::TooManyRequests => 429,
            ErrorCode::SpawnFailed | ErrorCode::Internal => 500,
            ErrorCode::BadGateway => 502,
            ErrorCode::InstanceCircuitOpen
            | ErrorCode::InstanceStarting
            | ErrorCode::CapacityExhausted
            | ErrorCode::StoreUnavailable
            | ErrorCode::NodeUnreachable
            | ErrorCode::TooManyUpgrades => 503,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Written as its [`as_str`](ErrorCode::as_str) string, the form the API's
/// error answers carry.
impl Serialize for ErrorCode {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// Read from its [`as_str`](ErrorCode::as_str) string; any other string is
/// an error (a code this build does not know).
impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = Cow::<'de, str>::deserialize(deserializer)?;
        ErrorCode::parse(&s)
            .ok_or_else(|| serde::de::Error::custom(format_args!("unknown error code {s:?}")))
    }
}

/// When to retry after [`SpawnError::NodeUnreachable`]: a node that does not
/// answer is back, or has lost its users' leases to a node that does, within
/// about one lease TTL; a client asking again every second sees either soon.
pub const NODE_UNREACHABLE_RETRY_MS: u64 = 1000;

/// Why a lifecycle operation failed. Every variant maps to one [`ErrorCode`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpawnError {
    /// The user id given is not a valid one.
    #[error("invalid user id: {0}")]
    InvalidUser(#[from] InvalidUserId),
    /// The request cannot be carried out as given; the message says why.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The user has no such thing to act on (a live main, a watchdog
    /// command, …).
    #[error("user {user} has no {what}")]
    NotFound {
        /// Whose it would be.
        user: UserId,
        /// What is missing, in words (borrowed when it is a constant, as
        /// it is where this node raises it; owned when it came from a peer).
        what: Cow<'static, str>,
    },
    /// The user already has a live instance of that role.
    #[error("user {user} already has a live instance")]
    AlreadyRunning {
        /// Whose instance it is.
        user: UserId,
    },
    /// The user's crash breaker is open: launches are refused until the
    /// cooldown ends.
    #[error(
        "the crash breaker is open for user {user} after {opens} open(s); retry after {retry_at} (unix ms)"
    )]
    CircuitOpen {
        /// Whose breaker it is.
        user: UserId,
        /// How many times it has opened; each opening doubles the cooldown,
        /// up to a limit.
        opens: u32,
        /// When the cooldown ends, wall clock.
        retry_at: UnixMillis,
    },
    /// The user's instance is starting, or awaiting adoption: the answer
    /// comes once it is up.
    #[error("the instance of user {user} is still starting")]
    Starting {
        /// Whose instance it is.
        user: UserId,
        /// When the client should ask again.
        retry_after_ms: u64,
    },
    /// Another node holds the user's lease: the operation belongs there.
    #[error("the lease of user {user} is held by node {holder}")]
    LeaseBusy {
        /// Whose lease it is.
        user: UserId,
        /// The node that holds it.
        holder: String,
        /// True when the holder's lease has expired but there is no evidence
        /// that the holder is gone: an operator must take it over.
        expired: bool,
    },
    /// A launch's patch is larger than [`crate::MAX_PATCH_BYTES`].
    #[error("patch is {size} bytes; the limit is {limit}")]
    PayloadTooLarge {
        /// The patch's size, in bytes.
        size: usize,
        /// The most allowed, in bytes.
        limit: usize,
    },
    /// The runtime could not start the program, or it was not ready in
    /// time; the runtime's message.
    #[error("spawn failed: {0}")]
    SpawnFailed(String),
    /// No room for another instance on this node or in its runtime; the
    /// message says whose limit.
    #[error("capacity exhausted: {0}")]
    CapacityExhausted(String),
    /// The store could not be reached.
    #[error("store unavailable: {0}")]
    StoreUnavailable(String),
    /// A user's long-lived streams are at their cap (on the node that
    /// refused, perhaps another one that relayed the stream).
    #[error("too many streams: {0}")]
    TooManyStreams(String),
    /// Another node, asked to act for a user, did not answer.
    #[error("node {node} did not answer: {reason}")]
    NodeUnreachable {
        /// The node that was asked.
        node: String,
        /// What went wrong with the call.
        reason: String,
    },
    /// Any other failure; a fault of berth's, not of the request.
    #[error("internal error: {0}")]
    Internal(String),
}

impl SpawnError {
    /// The stable code this error is answered with.
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
