//! The proxy's metrics: how long proxied requests take to be answered,
//! by status class only (no per-user labels: a series per user would
//! grow with the users).

use std::time::Duration;

use hyper::StatusCode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

/// Upper bounds of the duration buckets, in seconds: from a request to a
/// running instance (milliseconds) to one that woke it (seconds).
const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The labels of one duration series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AnswerLabels {
    /// `1xx` … `5xx`.
    pub class: &'static str,
}

fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// The proxy's series; cheap to clone (the clones share the series).
#[derive(Clone)]
pub struct ProxyMetrics {
    request_duration: Family<AnswerLabels, Histogram, fn() -> Histogram>,
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        Self {
            request_duration: Family::new_with_constructor(histogram),
        }
    }
}

impl std::fmt::Debug for ProxyMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyMetrics").finish_non_exhaustive()
    }
}

impl ProxyMetrics {
    /// Adds the series to `registry`: `proxy_request_duration_seconds`
    /// (with the registry's prefix).
    pub fn register(&self, registry: &mut Registry) {
        registry.register_with_unit(
            "proxy_request_duration",
            "Time from a proxied request's arrival to its answer's head (a woken instance's \
             start included; streamed bodies and WebSocket tunnels not), by status class",
            Unit::Seconds,
            self.request_duration.clone(),
        );
    }

    /// Records one answered request.
    pub fn observe(&self, status: StatusCode, elapsed: Duration) {
        self.request_duration
            .get_or_create(&AnswerLabels {
                class: status_class(status),
            })
            .observe(elapsed.as_secs_f64());
    }
}

fn status_class(status: StatusCode) -> &'static str {
    match status.as_u16() {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_counted_by_class_under_one_name() {
        let metrics = ProxyMetrics::default();
        let mut registry = Registry::with_prefix("berth");
        metrics.register(&mut registry);
        metrics.observe(StatusCode::OK, Duration::from_millis(3));
        metrics.observe(StatusCode::NO_CONTENT, Duration::from_millis(30));
        metrics.observe(StatusCode::BAD_GATEWAY, Duration::from_secs(2));
        metrics.observe(StatusCode::SWITCHING_PROTOCOLS, Duration::ZERO);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("# TYPE berth_proxy_request_duration_seconds histogram"),
            "{text}"
        );
        assert!(
            text.contains("berth_proxy_request_duration_seconds_count{class=\"2xx\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("berth_proxy_request_duration_seconds_count{class=\"5xx\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "berth_proxy_request_duration_seconds_bucket{le=\"0.005\",class=\"2xx\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("class=\"1xx\""), "{text}");
    }
}
