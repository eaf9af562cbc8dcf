//! What the cluster's endpoint machinery would say of a Service: the local
//! address its pod's program listens on, and the EndpointSlices listing it.

use std::net::SocketAddr;

use serde_json::{Value, json};

use super::store::{Key, Kind, Selector};
use super::world::{Shared, lock};

/// The local address of the Service's pod on the Service's port `port`
/// (its program's, or its shim's for the `berth-shim` port); on the
/// program's for `None`.
pub(super) fn local_endpoint(
    shared: &Shared,
    namespace: &str,
    service: &str,
    port: Option<u16>,
) -> Option<SocketAddr> {
    let world = lock(&shared.world);
    let key: Key = (Kind::Service, namespace.to_owned(), service.to_owned());
    let object = world.store.objects.get(&key)?;
    let selector = object["spec"]["selector"]
        .as_object()
        .map(Selector::of_map)?;
    let to_shim = port.is_some_and(|port| {
        object["spec"]["ports"].as_array().is_some_and(|ports| {
            ports
                .iter()
                .any(|p| p["port"] == port && p["name"] == crate::manifest::SHIM_PORT_NAME)
        })
    });
    world
        .store
        .objects
        .iter()
        .filter(|((k, ns, _), pod)| {
            *k == Kind::Pod && ns == namespace && selector.matches(&pod["metadata"]["labels"])
        })
        .filter_map(|(_, pod)| world.runs.get(pod["metadata"]["uid"].as_str()?))
        .map(|run| {
            let port = if to_shim { run.shim_port } else { run.port };
            SocketAddr::from(([127, 0, 0, 1], port))
        })
        .next()
}

/// The EndpointSlices of the Services in `namespace` whose labels match
/// `selector`, as the cluster's EndpointSlice controller would keep them:
/// one per Service and pod it selects, which lists the pod (with its
/// `Ready` condition) at the local address and port its program listens
/// on, under the Service's `http` port name. Made on each read; the
/// double serves them for lists, not watches.
pub(crate) fn endpoint_slices(shared: &Shared, namespace: &str, selector: &Selector) -> Vec<Value> {
    let world = lock(&shared.world);
    let mut slices = Vec::new();
    for ((kind, ns, service), object) in &world.store.objects {
        if *kind != Kind::Service || ns != namespace {
            continue;
        }
        let labels = json!({ "kubernetes.io/service-name": service });
        if !selector.matches(&labels) {
            continue;
        }
        let Some(pod_selector) = object["spec"]["selector"].as_object().map(Selector::of_map)
        else {
            continue;
        };
        for ((k, pod_ns, pod_name), pod) in &world.store.objects {
            if *k != Kind::Pod
                || pod_ns != namespace
                || !pod_selector.matches(&pod["metadata"]["labels"])
            {
                continue;
            }
            let uid = pod["metadata"]["uid"].as_str().unwrap_or_default();
            let Some(run) = world.runs.get(uid) else {
                continue;
            };
            let ready = pod["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            slices.push(json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": format!("{service}-{}", &uid[..uid.len().min(8)]),
                    "namespace": namespace,
                    "labels": labels,
                },
                "addressType": "IPv4",
                "endpoints": [{
                    "addresses": ["127.0.0.1"],
                    "conditions": { "ready": ready },
                    "targetRef": { "kind": "Pod", "namespace": namespace, "name": pod_name, "uid": uid },
                }],
                "ports": [
                    { "name": "http", "port": run.port, "protocol": "TCP" },
                    { "name": crate::manifest::SHIM_PORT_NAME, "port": run.shim_port, "protocol": "TCP" },
                ],
            }));
        }
    }
    slices
}
