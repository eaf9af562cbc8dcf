//! berth's egress proxy: the one way out for an instance whose egress
//! policy names domains. The local runtime's guard redirects such an
//! instance's TCP connections to the allowlisted ports here; the proxy
//! reads the name the connection asks for (TLS SNI, or the HTTP `Host`
//! header) from its first bytes, checks it against the policy, resolves
//! it itself and connects. A connection that names nothing, or a name not
//! allowed, is closed. Its name forwarder, on the same port over UDP,
//! answers the instance's DNS queries: forwarded for an allowed name,
//! `REFUSED` for any other, so a query carries nothing out.

#![forbid(unsafe_code)]

mod dns;
mod metrics;
mod proxy;
pub mod sniff;

pub use metrics::EgressMetrics;
pub use proxy::{EgressError, EgressProxy, Refusal};
