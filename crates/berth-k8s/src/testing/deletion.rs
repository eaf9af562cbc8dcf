//! The last step of a delete, which both the HTTP API and the kubelet
//! take: a deleted object leaves the store once nothing holds it.

use serde_json::Value;

use super::store::{Key, Kind, Store};

pub(super) fn pod_ended(pod: &Value) -> bool {
    matches!(
        pod["status"]["phase"].as_str(),
        Some("Succeeded" | "Failed")
    )
}

pub(super) fn scheduled(pod: &Value) -> bool {
    pod["spec"]["nodeName"].is_string()
}

/// Removes `key` if it is being deleted, no finalizer holds it, and (a
/// pod) its containers are done or it never had a node.
pub fn remove_if_finished(store: &mut Store, key: &Key) {
    let Some(object) = store.objects.get(key) else {
        return;
    };
    let deleting = object["metadata"]["deletionTimestamp"].is_string();
    let held = object["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|f| !f.is_empty());
    let done = key.0 != Kind::Pod || pod_ended(object) || !scheduled(object);
    if deleting && !held && done {
        store.remove(key);
    }
}
