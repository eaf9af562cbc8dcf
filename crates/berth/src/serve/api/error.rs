//! API errors: `{"error": code, "message": …, …}` with the code's
//! status, and the count of every error answered.

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use berth_core::{ErrorCode, SpawnError, unix_millis_now};
use serde_json::{Value, json};

use super::super::auth::Refusal;
use super::super::metrics::ApiLabels;
use super::AppState;

/// An error answered as `{"error": code, "message": …, …}`.
#[derive(Debug)]
pub struct ApiError {
    pub(super) code: ErrorCode,
    message: String,
    extra: Vec<(&'static str, Value)>,
    retry_after_ms: Option<u64>,
}

pub type ApiResult<T = Response> = Result<T, ApiError>;

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            extra: Vec::new(),
            retry_after_ms: None,
        }
    }

    pub fn forbidden() -> Self {
        Self::new(ErrorCode::Forbidden, "this token may not do that")
    }
}

impl From<Refusal> for ApiError {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::Unauthenticated(m) => ApiError::new(ErrorCode::Unauthorized, m),
            Refusal::Forbidden(m) => ApiError::new(ErrorCode::Forbidden, m),
            Refusal::Store(e) => e.into(),
        }
    }
}

impl From<SpawnError> for ApiError {
    fn from(e: SpawnError) -> Self {
        let retry_after_ms = e.retry_after_ms(unix_millis_now());
        let mut err = ApiError::new(e.code(), e.to_string());
        err.retry_after_ms = retry_after_ms;
        match &e {
            SpawnError::CircuitOpen { opens, .. } => {
                err.extra.push(("opens", json!(opens)));
                err.extra.push(("retry_after_ms", json!(retry_after_ms)));
            }
            SpawnError::Starting { retry_after_ms, .. } => {
                err.extra.push(("retry_after_ms", json!(retry_after_ms)));
            }
            SpawnError::LeaseBusy {
                holder, expired, ..
            } => {
                err.extra.push(("holder", json!(holder)));
                err.extra.push(("expired", json!(expired)));
            }
            SpawnError::NodeUnreachable { node, .. } => {
                err.extra.push(("node", json!(node)));
                err.extra.push(("retry_after_ms", json!(retry_after_ms)));
            }
            _ => {}
        }
        err
    }
}

impl From<berth_store::StoreError> for ApiError {
    fn from(e: berth_store::StoreError) -> Self {
        SpawnError::from(e).into()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = serde_json::Map::new();
        body.insert("error".into(), json!(self.code.as_str()));
        body.insert("message".into(), json!(self.message));
        for (k, v) in self.extra {
            body.insert(k.into(), v);
        }
        let status = StatusCode::from_u16(self.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, axum::Json(Value::Object(body))).into_response();
        if let Some(ms) = self.retry_after_ms {
            let secs = ms.div_ceil(1000).max(1);
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        if self.code == ErrorCode::Unauthorized {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        // For `count_errors`, whichever handler or extractor answered.
        response.extensions_mut().insert(self.code);
        response
    }
}

/// Counts every error the API answers, by code.
pub async fn count_errors(
    State(state): AppState,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let response = next.run(request).await;
    if let Some(code) = response.extensions().get::<ErrorCode>() {
        state
            .metrics
            .api_errors
            .get_or_create(&ApiLabels {
                code: code.as_str().to_owned(),
            })
            .inc();
    }
    response
}
