//! The controller's Prometheus metrics.
//!
//! Names are registered without the `berth_` prefix: the binary's registry
//! adds it (`Registry::with_prefix("berth")`), so `instances` is served as
//! `berth_instances`. Counters get their `_total` suffix from the encoder.
//! No label names a user: every label takes a handful of values.

use berth_core::{InstanceStatus, Role};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct InstanceLabels {
    pub status: String,
    pub role: String,
    pub node: String,
}

/// Cheap to clone: every metric is an `Arc` inside.
#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    node: String,
    pub instances: Family<InstanceLabels, Gauge>,
    pub spawn_to_ready: Histogram,
    pub restarts: Counter,
    pub breaker_opens: Counter,
    pub lease_renew_failures: Counter,
    pub fenced: Counter,
    pub store_errors: Counter,
    /// Users found running at start whose adoption has not ended.
    pub awaiting_adoption: Gauge,
    pub hibernation: HibernationMetrics,
}

/// Hibernation's series, registered next to the rest.
#[derive(Debug, Clone)]
pub(crate) struct HibernationMetrics {
    /// Mains hibernated on this node now.
    pub hibernated: Gauge,
    pub hibernations: Counter,
    pub resumes: Counter,
    /// From a resume being asked to the thaw being sent.
    pub resume_latency: Histogram,
}

impl HibernationMetrics {
    fn new() -> Self {
        Self {
            hibernated: Gauge::default(),
            hibernations: Counter::default(),
            resumes: Counter::default(),
            // 10 µs … ~80 ms.
            resume_latency: Histogram::new(exponential_buckets(0.000_01, 2.0, 14)),
        }
    }

    fn register(&self, registry: &mut Registry) {
        registry.register(
            "hibernated_instances",
            "Mains hibernated (frozen while idle) on this node",
            self.hibernated.clone(),
        );
        registry.register(
            "hibernations",
            "Mains hibernated",
            self.hibernations.clone(),
        );
        registry.register("resumes", "Hibernated mains resumed", self.resumes.clone());
        registry.register_with_unit(
            "resume_latency",
            "Time to resume a hibernated main, from the request to the thaw",
            Unit::Seconds,
            self.resume_latency.clone(),
        );
    }
}

impl Metrics {
    pub fn new(node: &str) -> Self {
        Self {
            node: node.to_owned(),
            instances: Family::default(),
            // 50 ms … ~100 s.
            spawn_to_ready: Histogram::new(exponential_buckets(0.05, 2.0, 12)),
            restarts: Counter::default(),
            breaker_opens: Counter::default(),
            lease_renew_failures: Counter::default(),
            fenced: Counter::default(),
            store_errors: Counter::default(),
            awaiting_adoption: Gauge::default(),
            hibernation: HibernationMetrics::new(),
        }
    }

    fn gauge(&self, role: Role, status: InstanceStatus) -> InstanceLabels {
        InstanceLabels {
            status: status.as_str().to_owned(),
            role: role.as_str().to_owned(),
            node: self.node.clone(),
        }
    }

    /// Moves one instance from `old` to `new` in the by-status gauge;
    /// `None` is "not tracked in memory".
    pub fn transition(&self, role: Role, old: Option<InstanceStatus>, new: Option<InstanceStatus>) {
        if old == new {
            return;
        }
        if role == Role::Main {
            if old == Some(InstanceStatus::Hibernated) {
                self.hibernation.hibernated.dec();
            }
            if new == Some(InstanceStatus::Hibernated) {
                self.hibernation.hibernated.inc();
            }
        }
        if let Some(old) = old {
            self.instances.get_or_create(&self.gauge(role, old)).dec();
        }
        if let Some(new) = new {
            self.instances.get_or_create(&self.gauge(role, new)).inc();
        }
    }

    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "instances",
            "Instances known to this node, by status and role",
            self.instances.clone(),
        );
        registry.register_with_unit(
            "spawn_to_ready",
            "Time from spawning an instance to its readiness",
            Unit::Seconds,
            self.spawn_to_ready.clone(),
        );
        registry.register("restarts", "Crash restarts", self.restarts.clone());
        registry.register(
            "breaker_opens",
            "Crash breakers opened",
            self.breaker_opens.clone(),
        );
        registry.register(
            "lease_renew_failures",
            "Lease renew ticks that failed",
            self.lease_renew_failures.clone(),
        );
        registry.register(
            "fenced_instances",
            "Instances frozen or killed by fencing",
            self.fenced.clone(),
        );
        registry.register(
            "controller_store_errors",
            "Store errors met by the controller's background work",
            self.store_errors.clone(),
        );
        registry.register(
            "instances_awaiting_adoption",
            "Users whose instance was found running at start and is not adopted yet",
            self.awaiting_adoption.clone(),
        );
        self.hibernation.register(registry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The binary serves these under `Registry::with_prefix("berth")`:
    /// each family once, with the prefix once.
    #[test]
    fn names_take_the_registry_prefix_once() {
        let metrics = Metrics::new("node-a");
        let mut registry = Registry::with_prefix("berth");
        metrics.register(&mut registry);
        metrics.transition(Role::Main, None, Some(InstanceStatus::Running));
        metrics.restarts.inc();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .collect();
        assert_eq!(
            families,
            [
                "berth_instances gauge",
                "berth_spawn_to_ready_seconds histogram",
                "berth_restarts counter",
                "berth_breaker_opens counter",
                "berth_lease_renew_failures counter",
                "berth_fenced_instances counter",
                "berth_controller_store_errors counter",
                "berth_instances_awaiting_adoption gauge",
                "berth_hibernated_instances gauge",
                "berth_hibernations counter",
                "berth_resumes counter",
                "berth_resume_latency_seconds histogram",
            ],
            "{text}"
        );
        assert!(
            text.contains("berth_instances{status=\"running\",role=\"main\",node=\"node-a\"} 1"),
            "{text}"
        );
        assert!(text.contains("berth_restarts_total 1"), "{text}");
        assert!(!text.contains("berth_berth"), "{text}");
    }
}
