//! `GET /metrics` and who may read it: the admin, or a Prometheus
//! scraper with the read-only `[metrics] token`, which opens this route
//! and nothing else. `[metrics] listen` serves the same text without
//! authentication on an address of its own ([`router`]), for a scraper
//! that holds no secret at all.

use std::sync::Arc;

use axum::Router;
use axum::extract::{FromRequestParts, State};
use axum::http::header;
use axum::http::request::Parts;
use axum::response::IntoResponse;
use axum::routing::get;
use berth_core::ErrorCode;
use berth_proxy::auth::{Caller, SharedSecret, bearer};

use super::super::metrics::Metrics;
use super::{ApiError, ApiResult, ApiState, AppState};

/// Who may read `/metrics` besides the admin.
#[derive(Debug, Clone, Default)]
pub struct Scrapers {
    token: Option<SharedSecret>,
}

impl Scrapers {
    /// `token`: the `[metrics] token` (already validated).
    pub fn new(token: Option<&str>) -> anyhow::Result<Self> {
        let token = token
            .map(SharedSecret::new)
            .transpose()
            .map_err(|e| anyhow::anyhow!("metrics.token: {e}"))?;
        Ok(Self { token })
    }

    fn admits(&self, parts: &Parts) -> bool {
        match (&self.token, bearer(&parts.headers)) {
            (Some(token), Some(presented)) => token.matches(presented.as_bytes()),
            _ => false,
        }
    }
}

/// The admin, or a scraper with the metrics token.
#[derive(Debug)]
pub struct Scraper;

impl FromRequestParts<Arc<ApiState>> for Scraper {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<ApiState>,
    ) -> Result<Self, ApiError> {
        if state.scrapers.admits(parts) {
            return Ok(Scraper);
        }
        match state.caller(&parts.method, &parts.headers).await? {
            Caller::Admin => Ok(Scraper),
            Caller::User { .. } => Err(ApiError::forbidden()),
        }
    }
}

/// `GET /metrics`.
pub async fn metrics(_: Scraper, State(state): AppState) -> ApiResult {
    render(&state.metrics)
}

/// The Prometheus text of `metrics`.
fn render(metrics: &Metrics) -> ApiResult {
    let text = metrics
        .encode()
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

/// The router of `[metrics] listen`: `GET /metrics`, unauthenticated, and
/// nothing else (404).
pub fn router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(metrics): State<Arc<Metrics>>| async move {
                render(&metrics).unwrap_or_else(IntoResponse::into_response)
            }),
        )
        .fallback(|| async {
            ApiError::new(ErrorCode::NotFound, "this address serves only GET /metrics")
                .into_response()
        })
        .with_state(metrics)
}

/// Serves [`router`] on `listener` until `cancel` fires.
pub async fn serve_unauthenticated(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    cancel: tokio_util::sync::CancellationToken,
) {
    let served = axum::serve(listener, router(metrics))
        .with_graceful_shutdown(async move { cancel.cancelled().await })
        .await;
    if let Err(e) = served {
        tracing::error!(error = %e, "the metrics listener failed");
    }
}
