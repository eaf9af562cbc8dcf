//! Where the proxy reaches a run: the Service's DNS name, or its pod's own
//! address from the Service's EndpointSlices.

use std::time::Duration;

use berth_core::Endpoint;
use berth_core::runtime::RuntimeError;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::ListParams;

use super::{Inner, failed};
use crate::config::EndpointMode;
use crate::names;

/// How often a start looks again for its pod in the Service's
/// EndpointSlices (`endpoint = "endpoint_slice"`): the cluster's
/// EndpointSlice controller lists a pod a moment after it has an address.
const SLICE_POLL: Duration = Duration::from_millis(200);
/// The label Kubernetes puts on a Service's EndpointSlices.
const SLICE_SERVICE_LABEL: &str = "kubernetes.io/service-name";

impl Inner {
    /// Where the proxy reaches pod `uid` of user `slug`: the Service's DNS
    /// name, or (`endpoint = "endpoint_slice"`) the address and port the
    /// Service's EndpointSlice lists for that very pod, waited for until
    /// `deadline`.
    pub(super) async fn endpoint_of(
        &self,
        slug: &str,
        uid: &str,
        deadline: tokio::time::Instant,
    ) -> Result<Endpoint, RuntimeError> {
        self.endpoint_on(slug, uid, "http", deadline).await
    }

    /// Where pod `uid` of user `slug` listens on its Service's port
    /// `port_name`, found as [`Inner::endpoint_of`] finds `http`.
    pub(super) async fn endpoint_on(
        &self,
        slug: &str,
        uid: &str,
        port_name: &str,
        deadline: tokio::time::Instant,
    ) -> Result<Endpoint, RuntimeError> {
        if self.config.kubernetes.endpoint == EndpointMode::ServiceDns {
            let k = &self.config.kubernetes;
            let port = match (port_name, &k.shim) {
                (crate::manifest::SHIM_PORT_NAME, Some(shim)) => shim.port,
                _ => k.port,
            };
            return Ok(self
                .resolver
                .endpoint(self.namespace(), &names::user_object(slug), port));
        }
        let service = names::user_object(slug);
        let params = ListParams::default().labels(&format!("{SLICE_SERVICE_LABEL}={service}"));
        loop {
            let last_error = match self.slices.list(&params).await {
                Ok(list) => match slice_endpoint(&list.items, uid, port_name) {
                    Some(endpoint) => return Ok(endpoint),
                    None => None,
                },
                Err(e) => Some(e),
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(match last_error {
                    Some(e) => failed("cannot list the Service's EndpointSlices", e),
                    None => RuntimeError::SpawnFailed(format!(
                        "no EndpointSlice of Service {service} lists pod {uid} with an address"
                    )),
                });
            }
            tokio::select! {
                () = tokio::time::sleep(SLICE_POLL) => {}
                () = self.cancel.cancelled() => {
                    return Err(RuntimeError::Failed("the runtime is shutting down".into()));
                }
            }
        }
    }
}

/// The address and port `port_name` that `slices` list for pod `uid`.
fn slice_endpoint(slices: &[EndpointSlice], uid: &str, port_name: &str) -> Option<Endpoint> {
    slices.iter().find_map(|slice| {
        let port = slice
            .ports
            .as_ref()?
            .iter()
            .find(|p| p.name.as_deref() == Some(port_name))?
            .port?;
        let address = slice
            .endpoints
            .iter()
            .find(|e| e.target_ref.as_ref().and_then(|r| r.uid.as_deref()) == Some(uid))?
            .addresses
            .first()?;
        Some(Endpoint {
            host: address.clone(),
            port: u16::try_from(port).ok()?,
            reach: berth_core::Reach::default(),
        })
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_slice_endpoint_is_the_pods_own_address_on_the_http_port() {
        let slice = |pod_uid: &str, address: &str, port_name: &str| -> EndpointSlice {
            serde_json::from_value(json!({
                "metadata": { "name": "s" },
                "addressType": "IPv4",
                "endpoints": [{
                    "addresses": [address],
                    "targetRef": { "kind": "Pod", "uid": pod_uid },
                }],
                "ports": [{ "name": "files", "port": 8081 }, { "name": port_name, "port": 8080 }],
            }))
            .unwrap()
        };
        let slices = [
            slice("old", "10.0.0.1", "http"),
            slice("new", "10.0.0.2", "http"),
        ];
        assert_eq!(
            slice_endpoint(&slices, "new", "http"),
            Some(Endpoint {
                host: "10.0.0.2".into(),
                port: 8080,
                reach: berth_core::Reach::default(),
            })
        );
        assert_eq!(
            slice_endpoint(&slices, "other", "http"),
            None,
            "another pod's address"
        );
        assert_eq!(
            slice_endpoint(&[slice("new", "10.0.0.2", "web")], "new", "http"),
            None,
            "no http port"
        );
        let v6 = slice_endpoint(&[slice("new", "fd00::2", "http")], "new", "http").unwrap();
        assert_eq!(v6.authority(), "[fd00::2]:8080");
    }
}
