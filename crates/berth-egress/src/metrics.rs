//! The egress proxy's series: connections and name lookups allowed and
//! refused, without per-user labels (a series per user would grow with
//! the users; the log names the account).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// What became of one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Its name was allowed and it was joined.
    Allowed,
    /// It was closed unjoined.
    Refused,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerdictLabels {
    verdict: &'static str,
}

/// The proxy's series; cheap to clone (the clones share them).
#[derive(Clone, Default)]
pub struct EgressMetrics {
    connections: Family<VerdictLabels, Counter>,
}

impl EgressMetrics {
    /// Adds the series to `registry` (`berth_egress_connections_total`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "egress_connections",
            "Connections and DNS queries through the egress proxy, by verdict (allowed, refused)",
            self.connections.clone(),
        );
    }

    pub(crate) fn count(&self, verdict: Verdict) {
        let verdict = match verdict {
            Verdict::Allowed => "allowed",
            Verdict::Refused => "refused",
        };
        self.connections
            .get_or_create(&VerdictLabels { verdict })
            .inc();
    }
}
