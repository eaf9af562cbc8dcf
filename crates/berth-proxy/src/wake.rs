//! Wake on request: a request for a user without a running instance
//! starts one.
//!
//! A browser navigation gets the "starting" page at once (it follows the
//! progress stream and reloads); any other request waits up to
//! `ready_timeout` and is then forwarded, so an API client needs one round
//! trip. A request still waiting after that gets `503 instance_starting`;
//! an open breaker gives `503 instance_circuit_open` (one mapping for the
//! proxy and the API: [`berth_core::readiness_answer`]).
//!
//! A navigation also gets the starting page when this node cannot claim the
//! user because another node holds the lease (`lease_busy`): in a cluster
//! that is a request another node forwarded here on a view a moment stale,
//! and the page's reload goes through the cluster's routing again.

use std::sync::Arc;
use std::time::Duration;

use berth_core::{LaunchRequest, SpawnError, Traffic, UserId};
use hyper::Response;
use hyper::http::uri::Authority;

use crate::respond::{self, ProxyBody};
use crate::route::{InstanceAddr, RouteTable};

/// Where a user's instance should be served from, in a cluster. Asked
/// only when this node has no running instance for the user, so a local
/// hit never pays for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Locate {
    /// Wake the instance here.
    Local,
    /// Another node runs it (or has just started it): forward there.
    Remote {
        /// The owner node's `host:port`.
        endpoint: Authority,
        /// The owner node's id, which the forwarded request is signed for.
        node: String,
    },
}

/// The cluster's routing decision, implemented by the binary over the
/// store (leases, nodes, placement). `None` in single-node mode.
#[async_trait::async_trait]
pub trait ClusterHook: Send + Sync + 'static {
    /// Where `user`'s instance is or should be; may launch it on another
    /// node first, waiting there for it to be ready only with
    /// `wait_for_ready` (a browser's navigation does not wait: it gets the
    /// starting page from the node that runs the user). Errors are answered
    /// like a local launch's.
    async fn locate(&self, user: &UserId, wait_for_ready: bool) -> Result<Locate, SpawnError>;
}

/// What waking produced.
#[derive(Debug)]
pub enum Wake {
    /// The instance is ready here.
    Ready(InstanceAddr),
    /// Answer the client with this instead.
    Respond(Response<ProxyBody>),
}

/// The wake layer.
pub struct Waker {
    spawner: Arc<dyn Traffic>,
    table: Arc<RouteTable>,
    ready_timeout: Duration,
}

impl std::fmt::Debug for Waker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waker")
            .field("ready_timeout", &self.ready_timeout)
            .finish_non_exhaustive()
    }
}

impl Waker {
    /// Wakes instances through `spawner`, looking in `table` first, and
    /// waits at most `ready_timeout` for one to be ready.
    pub fn new(spawner: Arc<dyn Traffic>, table: Arc<RouteTable>, ready_timeout: Duration) -> Self {
        Self {
            spawner,
            table,
            ready_timeout,
        }
    }

    /// Where `user`'s running instance listens: the route table, else the
    /// spawner (an event may not have reached the table yet).
    pub fn endpoint(
        &self,
        user: &UserId,
        from_table: Option<InstanceAddr>,
    ) -> Option<InstanceAddr> {
        from_table.or_else(|| InstanceAddr::of(&self.spawner.endpoint_for(user)?))
    }

    /// Starts `user`'s instance if needed and waits for it (unless the
    /// request is a navigation, which gets the starting page).
    pub async fn wake(&self, user: &UserId, navigation: bool, progress_url: Option<&str>) -> Wake {
        match self.spawner.launch(user, LaunchRequest::default()).await {
            Ok(_) | Err(SpawnError::AlreadyRunning { .. }) => {}
            // Another node holds the lease (a browser is shown the starting
            // page, whose reload is routed afresh), or the instance runs
            // and berth, just restarted, has not adopted it yet.
            Err(SpawnError::LeaseBusy { .. } | SpawnError::Starting { .. }) if navigation => {
                return Wake::Respond(respond::starting_page(user, progress_url));
            }
            Err(e) => {
                tracing::info!(%user, error = %e, "wake-on-request could not launch");
                return Wake::Respond(respond::spawn_error(&e));
            }
        }
        if navigation {
            return Wake::Respond(respond::starting_page(user, progress_url));
        }
        match berth_core::wait_ready(self.spawner.as_ref(), user, self.ready_timeout).await {
            Ok(_) => {
                let from_table = self.table.lookup(user.as_str()).and_then(|r| r.upstream);
                match self.endpoint(user, from_table) {
                    Some(addr) => Wake::Ready(addr),
                    // Ready, yet not routable: the event is on its way.
                    None => Wake::Respond(respond::spawn_error(&SpawnError::Starting {
                        user: user.clone(),
                        retry_after_ms: berth_core::STARTING_RETRY_MS,
                    })),
                }
            }
            Err(e) => Wake::Respond(respond::spawn_error(&e)),
        }
    }
}
