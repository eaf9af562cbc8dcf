//! API errors: an [`ErrorBody`] with its code's status, and the count of
//! every error answered.

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use berth_core::{ErrorBody, ErrorCode, SpawnError, unix_millis_now};

use super::super::auth::Refusal;
use super::super::metrics::ApiLabels;
use super::AppState;

/// An error answered as `{"error": code, "message": …, …}`: an
/// [`ErrorBody`] and the status of its code.
#[derive(Debug)]
pub struct ApiError {
    /// The body's code, which handlers' tests look at.
    pub(super) code: ErrorCode,
    /// Boxed: every handler's `Result` carries an `ApiError`, and the
    /// body is large.
    body: Box<ErrorBody>,
}

pub type ApiResult<T = Response> = Result<T, ApiError>;

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            body: Box::new(ErrorBody::new(code, message)),
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

impl From<ErrorBody> for ApiError {
    fn from(body: ErrorBody) -> Self {
        Self {
            code: body.error,
            body: Box::new(body),
        }
    }
}

impl From<SpawnError> for ApiError {
    fn from(e: SpawnError) -> Self {
        Self {
            code: e.code(),
            body: Box::new(ErrorBody::from_spawn_error(&e, unix_millis_now())),
        }
    }
}

impl From<berth_store::StoreError> for ApiError {
    fn from(e: berth_store::StoreError) -> Self {
        SpawnError::from(e).into()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let retry_after_ms = self.body.retry_after_ms;
        let mut response = (status, axum::Json(*self.body)).into_response();
        if let Some(ms) = retry_after_ms {
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
