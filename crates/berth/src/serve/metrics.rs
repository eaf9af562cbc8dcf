//! The Prometheus registry behind `GET /metrics`.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// Labels of an API request counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct ApiLabels {
    pub code: String,
}

/// The server's metrics: the spawner's, plus API error counts.
pub struct Metrics {
    registry: Registry,
    pub api_errors: Family<ApiLabels, Counter>,
}

impl Metrics {
    /// A registry prefixed `berth_`; `register` adds the backends' metrics.
    pub fn new(register: impl FnOnce(&mut Registry)) -> Self {
        let mut registry = Registry::with_prefix("berth");
        let api_errors = Family::<ApiLabels, Counter>::default();
        registry.register(
            "api_errors",
            "API requests answered with an error, by error code",
            api_errors.clone(),
        );
        register(&mut registry);
        Self {
            registry,
            api_errors,
        }
    }

    /// The registry in the Prometheus text format.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        encode(&mut out, &self.registry)?;
        Ok(out)
    }
}
