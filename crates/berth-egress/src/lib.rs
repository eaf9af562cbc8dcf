//! berth's egress proxy: the one way out for an instance whose egress
//! policy names domains. The local runtime's guard redirects such an
//! instance's TCP connections to the allowlisted ports here; the proxy
//! reads the name the connection asks for (TLS SNI, or the HTTP `Host`
//! header) from its first bytes, checks it against the policy, resolves
//! it itself and connects. A connection that names nothing, or a name not
//! allowed, is closed. Its name forwarder, on the same port over UDP,
//! answers the instance's DNS queries: forwarded for an allowed name,
//! `REFUSED` for any other, so a query carries nothing out.
//!
//! Pods are no accounts of this host: they reach domain names through
//! the egress proxy for pods ([`PodProxy`]), an explicit HTTP proxy
//! ([`explicit`]) that knows a pod's user by the credential berth put in
//! its proxy variables.

#![forbid(unsafe_code)]

mod dns;
pub mod explicit;
mod metrics;
mod pods;
mod proxy;
pub mod sniff;

pub use metrics::EgressMetrics;
pub use pods::{PodProxy, Policies};
pub use proxy::{EgressError, EgressProxy, Refusal};
