//! What the proxy knows about a client connection, for every layer that
//! looks at it (the server, auth, the forward layer). A leaf: it uses no
//! module that uses it.

use std::net::SocketAddr;
use std::sync::Arc;

use hyper::header::HeaderValue;

use crate::limits::ConnPermit;

/// What the proxy knows about the client connection.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    /// The client's address as the socket sees it: a trusted proxy's, when
    /// one is in front.
    pub peer: SocketAddr,
    /// The peer's IP as a header value, rendered once per connection.
    pub(crate) peer_ip: HeaderValue,
    /// The peer is a trusted proxy: its `X-Forwarded-*` headers stand.
    pub trusted: bool,
    /// The connection's slots under the server's caps, if it has any.
    permit: Option<Arc<ConnPermit>>,
}

impl ConnInfo {
    /// The facts of a connection from `peer`; `trusted` when `peer` is a
    /// trusted proxy. It holds no permit until [`Self::with_permit`].
    pub fn new(peer: SocketAddr, trusted: bool) -> Self {
        let peer_ip = HeaderValue::from_str(&peer.ip().to_string())
            .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        Self {
            peer,
            peer_ip,
            trusted,
            permit: None,
        }
    }

    /// The connection holds `permit` (the server's caps).
    #[must_use]
    pub fn with_permit(mut self, permit: Arc<ConnPermit>) -> Self {
        self.permit = Some(permit);
        self
    }

    /// Stops counting the connection against its address, once a request
    /// on it proved (by a valid signature) that another node sent it: a
    /// node may hold many connections to this one from a single address,
    /// and nodes on one host share it with every program there.
    pub fn exempt_from_address_cap(&self) {
        if let Some(permit) = &self.permit {
            permit.exempt();
        }
    }
}
