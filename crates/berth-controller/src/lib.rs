//! berth's controller: everything that does not depend on where a
//! program runs, written once for every runtime.
//!
//! A [`Controller`] runs one node. It drives a [`Runtime`] (local shims,
//! Kubernetes pods) and keeps its state in a [`Store`]:
//!
//! * the lease: claims, renew-all in one statement per tick, self-fencing
//!   (freeze at the fence deadline, kill when lost, thaw after a good
//!   renew, extend the runtime's own deadline), takeover (`fencer.rs`,
//!   `background.rs`);
//! * supervision: one driver task per instance performing the actions of
//!   the pure state machine `berth_core::policy::supervision`
//!   (`driver.rs`); the crash policy and breaker through the store
//!   (`breaker.rs`); the watchdog;
//! * idle reaping and activity, heartbeat, drain and capacity
//!   (`background.rs`, `node.rs`);
//! * the route table and event feed the proxy reads, and waiting for ready
//!   (`publisher.rs`);
//! * launch, stop, restart, `restart_and_probe`, `restart_all_mains`
//!   (`lifecycle.rs`, `spawner.rs`), offered as the node-local
//!   [`berth_core::Spawner`] surface;
//! * adoption after a restart of berth: a pure plan over what the runtime
//!   discovers and what the store records (`adopt.rs`);
//! * the metrics of all this (`metrics.rs`).
//!
//! It depends on `berth-core` and `berth-store` only: no runtime is named
//! here.

#![forbid(unsafe_code)]

mod adopt;
mod background;
mod breaker;
mod config;
mod driver;
mod fencer;
mod hibernation;
mod lifecycle;
mod metrics;
mod node;
mod publisher;
mod slugs;
mod spawner;
mod users;

use std::sync::Arc;

use berth_core::policy::supervision::{FENCED_ERROR, Finish, LeaseEnd, SupervisionConfig};
use berth_core::runtime::{Capabilities, Runtime};
use berth_core::{Instance, Role, UserId};
use berth_store::{NodeRecord, NodeStatus, Store, StoreError};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::{BreakerHook, ControllerConfig};

use crate::breaker::Breaker;
use crate::fencer::Fencer;
use crate::metrics::Metrics;
use crate::node::NodeState;
use crate::publisher::Publisher;
use crate::users::{Entry, Slot, Users};

/// Why a controller could not start.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// The [`ControllerConfig`] is unusable (an empty node id or hook
    /// command); the message says which setting.
    #[error("{0}")]
    Config(String),
    /// The store could not list this node's records or leases, which the
    /// adoption at start is planned from.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The runtime could not say what it still runs, so nothing can be
    /// adopted safely.
    #[error("the {runtime} runtime cannot list its instances: {message}")]
    Discover {
        /// The runtime's name, as it gives it.
        runtime: &'static str,
        /// The runtime's own error.
        message: String,
    },
}

/// One node's controller. Implements [`berth_core::Spawner`], the
/// node-local surface the API and the proxy use.
pub struct Controller {
    shared: Arc<Shared>,
}

/// The controller's parts, shared with its tasks. Each part keeps its own
/// fields private; this only puts them together.
pub(crate) struct Shared {
    config: ControllerConfig,
    supervision: SupervisionConfig,
    runtime: Arc<dyn Runtime>,
    capabilities: Capabilities,
    store: Arc<dyn Store>,
    users: Users,
    publisher: Publisher,
    fencer: Fencer,
    breaker: Breaker,
    node: NodeState,
    metrics: Metrics,
    tasks: TaskTracker,
    cancel: CancellationToken,
    /// Becomes true when the adoption begun at start has ended.
    adopted: tokio::sync::watch::Sender<bool>,
}

impl Controller {
    /// Plans the adoption of what `runtime` still runs for this node
    /// (checking each instance against the store), starts the background
    /// work (lease renewal with fencing and the heartbeat, the reaper, the
    /// activity flush), and returns while the adoption goes on: a user it
    /// has not reached yet is told "starting" (see `adopt.rs`).
    pub async fn start(
        runtime: Arc<dyn Runtime>,
        store: Arc<dyn Store>,
        config: ControllerConfig,
    ) -> Result<Arc<Controller>, ControllerError> {
        config.check()?;
        let metrics = Metrics::new(&config.node_id);
        let (capacity, reason) = match (config.capacity, runtime.capacity()) {
            (Some(n), _) => (n, "as configured".to_owned()),
            (None, Some(c)) => (
                c.instances,
                format!("the {} runtime's: {}", runtime.name(), c.reason),
            ),
            (None, None) => (u32::MAX, "unlimited".to_owned()),
        };
        let shared = Arc::new(Shared {
            supervision: config.supervision(),
            capabilities: runtime.capabilities(),
            publisher: Publisher::new(store.clone(), metrics.clone()),
            fencer: Fencer::new(
                store.clone(),
                config.node_id.clone(),
                config.lease.clone(),
                config.fencing,
            ),
            breaker: Breaker::new(
                store.clone(),
                config.crash.clone(),
                config.on_breaker_open.clone(),
                metrics.clone(),
            ),
            node: NodeState::new(
                config.node_id.clone(),
                config.advertise_url.clone(),
                config.internal_url.clone(),
                capacity,
                reason,
            ),
            users: Users::default(),
            metrics,
            runtime,
            store,
            config,
            tasks: TaskTracker::new(),
            cancel: CancellationToken::new(),
            adopted: tokio::sync::watch::Sender::new(false),
        });
        shared.keep_earlier_data().await;
        let adoption = shared.plan_adoption().await?;
        shared.start_background();
        // Adopted while berth serves: /healthz and the users adopted so far
        // need not wait for the last of thousands.
        let adopting = Arc::clone(&shared);
        shared
            .tasks
            .spawn(async move { adopting.adopt_all(adoption).await });
        Ok(Arc::new(Controller { shared }))
    }

    /// Resolves once the adoption [`Controller::start`] began has ended:
    /// every user it planned is adopted, or the controller stopped first.
    pub async fn adopted(&self) {
        let mut ended = self.shared.adopted.subscribe();
        // The sender lives as long as `self`, so this cannot fail.
        let _ = ended.wait_for(|ended| *ended).await;
    }

    /// Prometheus metrics of this controller.
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        self.shared.metrics.register(registry);
    }

    /// Sets how many mains this node runs at most; launches past it are
    /// refused with `capacity_exhausted`, and the heartbeat reports it.
    /// Call [`Controller::heartbeat`] to publish it at once.
    pub fn set_capacity(&self, capacity: u32) {
        self.shared
            .node
            .set_capacity(capacity, "as set by the operator".to_owned());
    }

    /// Sets this node's status (`up`, `draining`, `down`); the heartbeat
    /// carries it, and placement sends no new instances to a draining node.
    pub fn set_node_status(&self, status: NodeStatus) {
        self.shared.node.set_status(status);
    }

    /// This node's row as the next heartbeat will write it.
    pub fn node_record(&self) -> NodeRecord {
        self.shared.node_record()
    }

    /// Heartbeats now, outside the renew tick (at start, and right after a
    /// status change so the cluster sees it without waiting a tick).
    pub async fn heartbeat(&self) -> Result<(), StoreError> {
        self.shared.heartbeat().await
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        // Background tasks hold the shared state; without this they would
        // keep running after the last handle is gone.
        self.shared.cancel.cancel();
    }
}

impl Shared {
    fn node_id(&self) -> &str {
        self.node.id()
    }

    fn node_record(&self) -> NodeRecord {
        self.node.record(self.publisher.live_mains())
    }

    /// Writes this node's row, stamped with the store's clock.
    async fn heartbeat(&self) -> Result<(), StoreError> {
        let _one_at_a_time = self.node.heartbeat_lock.lock().await;
        let result = self.store.heartbeat(&self.node_record()).await;
        if result.is_err() {
            self.metrics.store_errors.inc();
        }
        result
    }

    /// Changes the current entry of `role` if it is still instance `id`,
    /// and publishes the result. A record refused because another node
    /// wrote it under a newer lease means this node's lease is lost,
    /// whatever the renew tick has seen so far: fence now. (Refused though
    /// written by this node, it was a stale write of its own, rightly
    /// dropped.)
    async fn modify(
        &self,
        slot: &Slot,
        role: Role,
        id: &str,
        message: Option<String>,
        change: impl FnOnce(&mut Entry),
    ) -> Option<Instance> {
        let (instance, stored) = self
            .publisher
            .modify(slot, role, id, message, change)
            .await?;
        self.on_store_refusal(&instance.user, &stored);
        Some(instance)
    }

    fn on_store_refusal(&self, user: &UserId, stored: &Result<(), StoreError>) {
        if let Err(StoreError::Fenced { current_node, .. }) = stored
            && current_node != self.node_id()
        {
            self.fence_lost(user);
        }
    }

    /// Kills the main whose lease is lost; its driver records it stopped
    /// ("lease lost: fenced") and forgets the lease.
    fn fence_lost(&self, user: &UserId) {
        let live = self
            .users
            .existing(user)
            .is_some_and(|slot| slot.request_fence(None));
        if !live {
            self.fencer.forget(user);
        }
    }

    async fn release_lease(&self, user: &UserId) {
        if let Err(e) = self.fencer.release(user).await {
            self.metrics.store_errors.inc();
            tracing::warn!(%user, error = %e, "could not release the lease");
        }
    }

    /// Makes main `id` terminal. What it held (its runtime's resources, its
    /// lease) is given up *before* the record turns terminal: once it does,
    /// a new launch may claim the lease again and must not lose it to this
    /// release.
    async fn finish(&self, slot: &Slot, id: &str, finish: &Finish) {
        let user = &slot.user;
        self.runtime.release(id).await;
        self.fencer.forget_frozen(user);
        slot.set_hibernated(false);
        match finish.lease {
            LeaseEnd::Release => self.release_lease(user).await,
            LeaseEnd::Forget => self.fencer.forget(user),
        }
        if finish.last_error.as_deref() == Some(FENCED_ERROR) {
            tracing::warn!(%user, "lease lost: instance fenced");
            self.metrics.fenced.inc();
        }
        self.modify(
            slot,
            Role::Main,
            id,
            Some(finish.message.clone()),
            |entry| {
                let i = &mut entry.instance;
                i.status = finish.status;
                i.ready = false;
                if finish.exit_code.is_some() {
                    i.exit_code = finish.exit_code;
                }
                if finish.last_error.is_some() {
                    i.last_error.clone_from(&finish.last_error);
                }
            },
        )
        .await;
    }
}
