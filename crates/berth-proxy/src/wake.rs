//! Wake on request (design §7.2): a request for a user without a running
//! instance starts one.
//!
//! A browser navigation gets the "starting" page at once (it follows the
//! progress stream and reloads); any other request waits up to
//! `ready_timeout` and is then forwarded, so an API client needs one round
//! trip. A request still waiting after that gets `503 instance_starting`;
//! an open breaker gives `503 instance_circuit_open`.

use std::sync::Arc;
use std::time::Duration;

use berth_core::{InstanceStatus, LaunchRequest, SpawnError, Spawner, UserId};
use hyper::Response;
use hyper::http::uri::Authority;

use crate::respond::{self, ProxyBody};
use crate::route::RouteTable;

/// Where a user's instance should be served from, in a cluster (design
/// §7.3). Asked only when this node has no running instance for the user,
/// so a local hit never pays for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Locate {
    /// Wake the instance here.
    Local,
    /// Another node runs it (or has just started it): forward there.
    Remote {
        /// The owner node's `host:port`.
        endpoint: Authority,
        node: String,
    },
}

/// The cluster's routing decision, implemented by the binary over the
/// store (leases, nodes, placement). `None` in single-node mode.
#[async_trait::async_trait]
pub trait ClusterHook: Send + Sync + 'static {
    /// Where `user`'s instance is or should be; may launch it on another
    /// node first. Errors are answered like a local launch's.
    async fn locate(&self, user: &UserId) -> Result<Locate, SpawnError>;
}

/// What waking produced.
#[derive(Debug)]
pub enum Wake {
    /// The instance is ready here.
    Ready(Authority),
    /// Answer the client with this instead.
    Respond(Response<ProxyBody>),
}

/// The wake layer.
pub struct Waker {
    spawner: Arc<dyn Spawner>,
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

/// How long a client is told to wait when its instance is still starting.
const STARTING_RETRY_MS: u64 = 2000;

impl Waker {
    pub fn new(spawner: Arc<dyn Spawner>, table: Arc<RouteTable>, ready_timeout: Duration) -> Self {
        Self {
            spawner,
            table,
            ready_timeout,
        }
    }

    /// Where `user`'s running instance listens: the route table, else the
    /// spawner (an event may not have reached the table yet).
    pub fn endpoint(&self, user: &UserId, from_table: Option<Authority>) -> Option<Authority> {
        from_table.or_else(|| {
            let endpoint = self.spawner.endpoint_for(user)?;
            Authority::try_from(endpoint.authority()).ok()
        })
    }

    /// Starts `user`'s instance if needed and waits for it (unless the
    /// request is a navigation, which gets the starting page).
    pub async fn wake(&self, user: &UserId, navigation: bool, progress_url: Option<&str>) -> Wake {
        match self.spawner.launch(user, LaunchRequest::default()).await {
            Ok(_) | Err(SpawnError::AlreadyRunning { .. }) => {}
            Err(e) => {
                tracing::info!(%user, error = %e, "wake-on-request could not launch");
                return Wake::Respond(respond::spawn_error(&e));
            }
        }
        if navigation {
            return Wake::Respond(respond::starting_page(user, progress_url));
        }
        let instance = match self.spawner.wait_for_ready(user, self.ready_timeout).await {
            Ok(instance) => instance,
            Err(e) => return Wake::Respond(respond::spawn_error(&e)),
        };
        match instance {
            Some(i) if i.status == InstanceStatus::Running && i.ready => {
                let from_table = self.table.lookup(user.as_str()).and_then(|r| r.upstream);
                match self.endpoint(user, from_table) {
                    Some(authority) => Wake::Ready(authority),
                    None => Wake::Respond(self.starting(user)),
                }
            }
            Some(i) if i.status == InstanceStatus::Failed => {
                match self.spawner.breaker_info(user).await {
                    Ok(Some(open)) => {
                        Wake::Respond(respond::spawn_error(&SpawnError::CircuitOpen {
                            user: user.clone(),
                            opens: open.opens,
                            retry_at: open.cooldown_until,
                        }))
                    }
                    _ => Wake::Respond(respond::spawn_error(&SpawnError::SpawnFailed(
                        i.last_error
                            .unwrap_or_else(|| "the instance failed to start".to_owned()),
                    ))),
                }
            }
            Some(i) if i.status == InstanceStatus::Stopped => Wake::Respond(respond::spawn_error(
                &SpawnError::SpawnFailed("the instance stopped before it was ready".to_owned()),
            )),
            // Starting past the deadline, or crashed with a restart pending.
            _ => Wake::Respond(self.starting(user)),
        }
    }

    fn starting(&self, user: &UserId) -> Response<ProxyBody> {
        respond::spawn_error(&SpawnError::Starting {
            user: user.clone(),
            retry_after_ms: STARTING_RETRY_MS,
        })
    }
}
