//! Cluster mode at runtime (design §3, §7.3, §8.1, §8.3): the one place
//! that decides where a user's instance runs when several nodes share a
//! PostgreSQL store.
//!
//! * [`decide`] (pure): a live lease names the owner; otherwise placement
//!   picks a node (sticky to the last holder).
//! * [`Cluster`] feeds it from the store (the lease row, and the nodes'
//!   rows cached for at most [`NODES_MAX_AGE`]) and acts on it for the
//!   proxy ([`berth_proxy::ClusterHook`]) and the API (launch anywhere).
//! * [`plan_failovers`] (pure) and [`Cluster::run_failover`]: the scan of
//!   expired leases that relaunches users whose holder is gone (with
//!   evidence), or reports them for an operator.
//!
//! The lease stays the only guarantee of "one live main per user": every
//! decision here may be stale, and a wrong one ends in a refused claim
//! (`lease_busy`), never in a second instance.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use axum::http::uri::Authority;
use berth_core::policy::{NodeView, place};
use berth_core::{Epoch, InstanceStatus, LaunchRequest, Role, SpawnError, Spawner, UserId};
use berth_proxy::{ClusterHook, Locate};
use berth_store::{LeaseRecord, NodeRecord, NodeStatus, Store, StoreError, TakeoverPolicy};
use futures_util::StreamExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use super::peer::{PeerAnswer, PeerClient};

/// The nodes' rows are read again when older than this: placement and
/// routing tolerate a second of staleness (the lease catches races), and
/// the store is spared one query per request.
pub const NODES_MAX_AGE: Duration = Duration::from_secs(1);
/// How long a remote owner is remembered for the proxy.
const OWNER_MAX_AGE: Duration = Duration::from_secs(1);
/// Bound of the remote-owner cache.
const OWNER_CACHE_ENTRIES: usize = 10_000;
/// A launch that meets `lease_busy` follows the named holder this many
/// times at most (nodes' views differ for a moment; they never loop long).
const MAX_HOPS: usize = 3;
/// Relaunches of one failover scan run this many at a time.
const FAILOVER_CONCURRENCY: usize = 8;

// --- pure decisions ---------------------------------------------------------

/// What a lease row says about ownership, as [`decide`] needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseView {
    pub holder: Option<String>,
    /// Held, not released, and not past its end by the store's clock.
    pub live: bool,
}

impl LeaseView {
    pub fn of(record: &LeaseRecord) -> Self {
        Self {
            holder: record.holder.clone(),
            live: record.holder.is_some()
                && record.lease_until.is_some()
                && !record.released
                && !record.expired,
        }
    }
}

/// Where a user's main should be served from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// This node: it holds the live lease, or placement chose it.
    Local,
    /// Another node holds the live lease: send the user there.
    Owner(String),
    /// No live lease, and placement chose another node: ask it to launch.
    Place(String),
    /// No live lease, and no node can take a new instance.
    NoCapacity,
}

/// Design §7.3: a live lease held elsewhere names the owner; with none,
/// place the instance (§8.3), sticky to the last holder.
pub fn decide(me: &str, lease: Option<&LeaseView>, nodes: &[NodeView], ttl_ms: i64) -> Decision {
    let holder = lease.and_then(|l| l.holder.as_deref());
    if let (Some(holder), true) = (holder, lease.is_some_and(|l| l.live)) {
        return if holder == me {
            Decision::Local
        } else {
            Decision::Owner(holder.to_owned())
        };
    }
    match place(holder, nodes, ttl_ms) {
        Some(node) if node == me => Decision::Local,
        Some(node) => Decision::Place(node),
        None => Decision::NoCapacity,
    }
}

/// One expired lease, with what the failover scan needs to judge it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired {
    pub user: UserId,
    pub holder: String,
    pub epoch: Epoch,
    /// Whether the holder heartbeat within one TTL (`None`: unknown).
    pub holder_alive: Option<bool>,
    /// The status of the user's main record, if there is one.
    pub main: Option<InstanceStatus>,
}

/// What the failover scan does about one expired lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailoverStep {
    /// Relaunch the user here, then fence the old holder's epoch.
    Relaunch {
        user: UserId,
        old_holder: String,
        old_epoch: Epoch,
    },
    /// Leave it to an operator (`berth takeover`), and say why.
    Report {
        user: UserId,
        holder: String,
        reason: &'static str,
    },
}

/// Design §3 "No silent takeover": decides, for every expired lease of a
/// main that was live, whether this node relaunches it.
///
/// * holder alive, or liveness unknown → report (no evidence it is gone);
/// * `manual` → report;
/// * otherwise placement among live `up` nodes, sticky to the dead holder
///   (so in effect the most free): only the chosen node relaunches. Each
///   choice counts against the chosen node's room for the rest of the
///   scan, so every node, iterating the same rows in the same order,
///   spreads a dead node's users the same way.
///
/// Leases this node held are not failovers: its own renew tick deals
/// with them.
pub fn plan_failovers(
    me: &str,
    expired: &[Expired],
    nodes: &[NodeView],
    ttl_ms: i64,
    policy: TakeoverPolicy,
) -> Vec<FailoverStep> {
    let mut nodes = nodes.to_vec();
    let mut steps = Vec::new();
    for e in expired {
        if e.holder == me || !e.main.is_some_and(InstanceStatus::is_live) {
            continue;
        }
        let report = |reason| FailoverStep::Report {
            user: e.user.clone(),
            holder: e.holder.clone(),
            reason,
        };
        if e.holder_alive != Some(false) {
            steps.push(report(
                "the holder is still alive (no evidence it is gone): take it over explicitly",
            ));
            continue;
        }
        if policy == TakeoverPolicy::Manual {
            steps.push(report("takeover = \"manual\": take it over explicitly"));
            continue;
        }
        match place(Some(&e.holder), &nodes, ttl_ms) {
            Some(chosen) => {
                if chosen == me {
                    steps.push(FailoverStep::Relaunch {
                        user: e.user.clone(),
                        old_holder: e.holder.clone(),
                        old_epoch: e.epoch,
                    });
                }
                if let Some(n) = nodes.iter_mut().find(|n| n.id == chosen) {
                    n.load = n.load.saturating_add(1);
                }
            }
            None => steps.push(report("no live node has room for it")),
        }
    }
    steps
}

/// `host:port` of an advertised `http://host:port` URL.
pub fn authority_of_url(url: &str) -> Option<Authority> {
    let parsed = reqwest::Url::parse(url).ok()?;
    let host = parsed.host_str()?;
    let port = parsed.port_or_known_default()?;
    let endpoint = berth_core::Endpoint {
        host: host.to_owned(),
        port,
    };
    Authority::try_from(endpoint.authority()).ok()
}

// --- the node's own status --------------------------------------------------

/// The node-level controls the API needs (drain/undrain), implemented by
/// the backend that heartbeats.
#[async_trait]
pub trait NodeControl: Send + Sync + 'static {
    fn set_draining(&self, draining: bool);
    /// Heartbeats now so the cluster sees a change without waiting a tick.
    async fn heartbeat_now(&self) -> Result<(), StoreError>;
}

#[async_trait]
impl NodeControl for berth_controller::Controller {
    fn set_draining(&self, draining: bool) {
        self.set_node_status(if draining {
            berth_store::NodeStatus::Draining
        } else {
            berth_store::NodeStatus::Up
        });
    }

    async fn heartbeat_now(&self) -> Result<(), StoreError> {
        self.heartbeat().await
    }
}

// --- metrics ----------------------------------------------------------------

/// The cluster's metrics.
#[derive(Clone, Default)]
pub struct ClusterMetrics {
    /// Expired leases found by the last failover scan.
    pub expired_leases: Gauge,
    /// Users this node relaunched after their holder was gone.
    pub failovers: Counter,
}

impl ClusterMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "expired_leases",
            "Expired leases of live mains seen by the last failover scan",
            self.expired_leases.clone(),
        );
        registry.register(
            "failovers",
            "Users this node relaunched after their lease holder was gone",
            self.failovers.clone(),
        );
    }
}

// --- the runtime side -------------------------------------------------------

/// The nodes' rows as last read, with the store's clock at that moment.
struct NodesSnapshot {
    read_at: Instant,
    store_now: i64,
    nodes: Vec<NodeRecord>,
}

impl NodesSnapshot {
    /// Views with heartbeat ages advanced by the time since the read.
    fn views(&self) -> Vec<NodeView> {
        let elapsed = i64::try_from(self.read_at.elapsed().as_millis()).unwrap_or(i64::MAX);
        let now = self.store_now.saturating_add(elapsed);
        self.nodes.iter().map(|n| n.view(now)).collect()
    }

    fn url_of(&self, node: &str) -> Option<String> {
        self.nodes
            .iter()
            .find(|n| n.id == node)
            .map(|n| n.advertise_url.clone())
            .filter(|u| !u.is_empty())
    }
}

/// Cluster routing, remote launches and failover for one node.
pub struct Cluster {
    store: Arc<dyn Store>,
    spawner: Arc<dyn Spawner>,
    node_id: String,
    ttl: Duration,
    takeover: TakeoverPolicy,
    peers: PeerClient,
    nodes: Mutex<Option<Arc<NodesSnapshot>>>,
    /// One refresh at a time; others wait for it rather than all querying.
    refresh: tokio::sync::Mutex<()>,
    owners: Mutex<HashMap<UserId, (Instant, Locate)>>,
    /// Reported expired leases, so each is logged once per epoch.
    reported: Mutex<HashSet<(UserId, Epoch)>>,
    pub metrics: ClusterMetrics,
}

impl Cluster {
    pub fn new(
        store: Arc<dyn Store>,
        spawner: Arc<dyn Spawner>,
        node_id: String,
        ttl: Duration,
        takeover: TakeoverPolicy,
        peers: PeerClient,
        metrics: ClusterMetrics,
    ) -> Self {
        Self {
            store,
            spawner,
            node_id,
            ttl,
            takeover,
            peers,
            nodes: Mutex::new(None),
            refresh: tokio::sync::Mutex::new(()),
            owners: Mutex::new(HashMap::new()),
            reported: Mutex::new(HashSet::new()),
            metrics,
        }
    }

    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    fn ttl_ms(&self) -> i64 {
        i64::try_from(self.ttl.as_millis()).unwrap_or(i64::MAX)
    }

    /// The nodes' rows, read again when older than `max_age`.
    async fn snapshot(&self, max_age: Duration) -> Result<Arc<NodesSnapshot>, StoreError> {
        let fresh = |s: &Option<Arc<NodesSnapshot>>| {
            s.as_ref()
                .filter(|s| s.read_at.elapsed() <= max_age)
                .cloned()
        };
        if let Some(s) = fresh(&self.nodes.lock().unwrap_or_else(|e| e.into_inner())) {
            return Ok(s);
        }
        let _refreshing = self.refresh.lock().await;
        if let Some(s) = fresh(&self.nodes.lock().unwrap_or_else(|e| e.into_inner())) {
            return Ok(s);
        }
        let read_at = Instant::now();
        let nodes = self.store.list_nodes().await?;
        let store_now = self.store.now().await?;
        let snapshot = Arc::new(NodesSnapshot {
            read_at,
            store_now,
            nodes,
        });
        *self.nodes.lock().unwrap_or_else(|e| e.into_inner()) = Some(snapshot.clone());
        Ok(snapshot)
    }

    /// Forgets the cached nodes (after this node changed its own status).
    pub fn invalidate_nodes(&self) {
        *self.nodes.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// The advertised URL of `node`.
    async fn url_of(&self, node: &str) -> Result<String, SpawnError> {
        let snapshot = self.snapshot(NODES_MAX_AGE).await?;
        if let Some(url) = snapshot.url_of(node) {
            return Ok(url);
        }
        // A node that registered within the last second.
        self.snapshot(Duration::ZERO)
            .await?
            .url_of(node)
            .ok_or_else(|| {
                SpawnError::Internal(format!(
                    "node {node} has no advertised URL in the nodes table"
                ))
            })
    }

    /// Where `user`'s main should be served from, now.
    pub async fn decide(&self, user: &UserId) -> Result<Decision, SpawnError> {
        let lease = self.store.get_lease(user).await?;
        let snapshot = self.snapshot(NODES_MAX_AGE).await?;
        Ok(decide(
            &self.node_id,
            lease.as_ref().map(LeaseView::of).as_ref(),
            &snapshot.views(),
            self.ttl_ms(),
        ))
    }

    /// Launches on `node` through its internal API.
    pub async fn launch_on(
        &self,
        node: &str,
        user: &UserId,
        request: &LaunchRequest,
        wait: bool,
    ) -> Result<PeerAnswer, SpawnError> {
        let url = self.url_of(node).await?;
        self.peers.launch(&url, node, user, request, wait).await
    }

    /// Tells every other node that is not `down` to forget its cached user
    /// tokens (after a revocation), all at once, and waits for the answers.
    /// Returns the nodes that could not be told, with why; they drop the
    /// token when their cache entries expire (`[auth] token_cache_s`).
    pub async fn purge_token_caches(&self) -> Vec<String> {
        let nodes = match self.store.list_nodes().await {
            Ok(nodes) => nodes,
            Err(e) => return vec![format!("every node (cannot list them: {e})")],
        };
        let calls = nodes
            .into_iter()
            .filter(|n| n.id != self.node_id && n.status != NodeStatus::Down)
            .map(|n| async move {
                match self.peers.purge_tokens(&n.advertise_url, &n.id).await {
                    Ok(()) => None,
                    Err(e) => Some(format!("{} ({e})", n.id)),
                }
            });
        futures_util::future::join_all(calls)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// Asks `node` to fence `user`'s instance if it still runs under
    /// `epoch` (design §3 "Fence the right node"). Best effort: the old
    /// holder is usually gone, and its shim freezes the instance anyway.
    pub async fn fence_remote(&self, node: &str, user: &UserId, epoch: Epoch) {
        if node == self.node_id {
            return;
        }
        let result = match self.url_of(node).await {
            Ok(url) => self.peers.fence(&url, node, user, epoch).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(fenced) => {
                tracing::info!(%user, %node, epoch, fenced, "fence sent to the old holder")
            }
            Err(e) => {
                tracing::info!(%user, %node, epoch, error = %e, "could not fence the old holder (it is probably gone)")
            }
        }
    }

    fn cached_owner(&self, user: &UserId) -> Option<Locate> {
        let owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        owners
            .get(user)
            .filter(|(at, _)| at.elapsed() <= OWNER_MAX_AGE)
            .map(|(_, l)| l.clone())
    }

    fn remember_owner(&self, user: &UserId, locate: &Locate) {
        let mut owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        if owners.len() >= OWNER_CACHE_ENTRIES {
            owners.retain(|_, (at, _)| at.elapsed() <= OWNER_MAX_AGE);
            if owners.len() >= OWNER_CACHE_ENTRIES {
                owners.clear();
            }
        }
        owners.insert(user.clone(), (Instant::now(), locate.clone()));
    }

    async fn remote(&self, node: String) -> Result<Locate, SpawnError> {
        let url = self.url_of(&node).await?;
        let endpoint = authority_of_url(&url).ok_or_else(|| {
            SpawnError::Internal(format!(
                "node {node} advertises {url:?}, which is not an http://host:port URL"
            ))
        })?;
        Ok(Locate::Remote { endpoint, node })
    }

    /// The proxy's question: serve `user` here, or forward to which node?
    /// A node placement chose is asked to launch (and waited for) first.
    async fn locate_uncached(&self, user: &UserId) -> Result<Locate, SpawnError> {
        let mut decision = self.decide(user).await?;
        for _ in 0..MAX_HOPS {
            let node = match decision {
                Decision::Local => return Ok(Locate::Local),
                Decision::Owner(node) => return self.remote(node).await,
                Decision::NoCapacity => return Err(no_capacity()),
                Decision::Place(node) => node,
            };
            let answer = self
                .launch_on(&node, user, &LaunchRequest::default(), true)
                .await?;
            match answer.error(user) {
                None => return self.remote(node).await,
                // Somebody else won the claim meanwhile: go to them.
                Some(SpawnError::LeaseBusy {
                    holder,
                    expired: false,
                    ..
                }) if !holder.is_empty() => {
                    decision = if holder == self.node_id {
                        Decision::Local
                    } else {
                        Decision::Owner(holder)
                    };
                }
                Some(e) => return Err(e),
            }
        }
        Err(SpawnError::Starting {
            user: user.clone(),
            retry_after_ms: 1000,
        })
    }

    // --- failover -----------------------------------------------------------

    /// Scans for expired leases every `interval` until `cancel` fires.
    pub async fn run_failover(self: Arc<Self>, interval: Duration, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let scan = self.failover_scan();
            tokio::select! {
                () = cancel.cancelled() => return,
                result = scan => if let Err(e) = result {
                    tracing::warn!(error = %e, "failover scan failed");
                },
            }
        }
    }

    /// One scan: read the expired leases, plan, relaunch what falls to this
    /// node, report the rest once.
    pub async fn failover_scan(&self) -> Result<(), SpawnError> {
        let leases = self.store.list_leases(true, self.ttl).await?;
        self.metrics
            .expired_leases
            .set(i64::try_from(leases.len()).unwrap_or(i64::MAX));
        let mut expired = Vec::new();
        for lease in leases {
            let Some(holder) = lease.holder.clone() else {
                continue;
            };
            if holder == self.node_id {
                continue;
            }
            let main = self
                .store
                .get_instance(&lease.user, Role::Main)
                .await?
                .map(|i| i.status);
            expired.push(Expired {
                user: lease.user,
                holder,
                epoch: lease.epoch,
                holder_alive: lease.holder_alive,
                main,
            });
        }
        // A lease no longer expired (taken over, renewed, released) will
        // not be reported again under that epoch: forget it, so the set
        // stays as small as the current expired set.
        self.reported
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(user, epoch)| expired.iter().any(|e| e.user == *user && e.epoch == *epoch));
        if expired.is_empty() {
            return Ok(());
        }
        // Liveness must be as fresh as the lease rows it is judged with.
        let snapshot = self.snapshot(Duration::ZERO).await?;
        let steps = plan_failovers(
            &self.node_id,
            &expired,
            &snapshot.views(),
            self.ttl_ms(),
            self.takeover,
        );
        let mut relaunches = Vec::new();
        for step in steps {
            match step {
                FailoverStep::Report {
                    user,
                    holder,
                    reason,
                } => {
                    let epoch = expired
                        .iter()
                        .find(|e| e.user == user)
                        .map_or(0, |e| e.epoch);
                    let first = self
                        .reported
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert((user.clone(), epoch));
                    if first {
                        tracing::warn!(%user, %holder, epoch, "expired lease not taken over: {reason}");
                    }
                }
                FailoverStep::Relaunch {
                    user,
                    old_holder,
                    old_epoch,
                } => relaunches.push((user, old_holder, old_epoch)),
            }
        }
        futures_util::stream::iter(relaunches)
            .for_each_concurrent(FAILOVER_CONCURRENCY, |(user, holder, epoch)| async move {
                self.fail_over(&user, &holder, epoch).await;
            })
            .await;
        Ok(())
    }

    /// Relaunches `user` here with their launch parameters. The spawner's
    /// claim succeeds only with the store's evidence that the holder is
    /// gone; afterwards the old holder is told to fence the old epoch.
    async fn fail_over(&self, user: &UserId, old_holder: &str, old_epoch: Epoch) {
        tracing::warn!(%user, %old_holder, old_epoch, "lease holder is gone; relaunching here");
        let request = match super::api::launch_request_from_store(self.store.as_ref(), user).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(%user, error = %e, "failover: cannot read the launch parameters");
                return;
            }
        };
        match self.spawner.launch(user, request).await {
            Ok(instance) => {
                self.metrics.failovers.inc();
                tracing::warn!(%user, %old_holder, epoch = instance.epoch, "failed over to this node");
                self.fence_remote(old_holder, user, old_epoch).await;
            }
            // Another node was faster, or the user was relaunched already.
            Err(SpawnError::LeaseBusy { holder, .. }) => {
                tracing::info!(%user, %holder, "failover: another node holds the lease now");
            }
            Err(SpawnError::AlreadyRunning { .. }) => {}
            Err(e) => tracing::warn!(%user, error = %e, "failover launch failed"),
        }
    }
}

/// The error a [`Decision::NoCapacity`] is answered with.
pub(crate) fn no_capacity() -> SpawnError {
    SpawnError::CapacityExhausted(
        "no live, up node of the cluster has room for a new instance".to_owned(),
    )
}

#[async_trait]
impl ClusterHook for Cluster {
    async fn locate(&self, user: &UserId) -> Result<Locate, SpawnError> {
        if let Some(cached) = self.cached_owner(user) {
            return Ok(cached);
        }
        let locate = self.locate_uncached(user).await?;
        if matches!(locate, Locate::Remote { .. }) {
            self.remember_owner(user, &locate);
        }
        Ok(locate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_core::policy::NodeState;

    const TTL: i64 = 3000;

    fn up(id: &str, capacity: u32, load: u32) -> NodeView {
        NodeView {
            id: id.into(),
            status: NodeState::Up,
            capacity,
            load,
            heartbeat_age_ms: 100,
        }
    }

    fn dead(id: &str) -> NodeView {
        NodeView {
            heartbeat_age_ms: TTL + 1,
            ..up(id, 10, 0)
        }
    }

    fn lease(holder: Option<&str>, live: bool) -> LeaseView {
        LeaseView {
            holder: holder.map(str::to_owned),
            live,
        }
    }

    #[test]
    fn decide_table() {
        let nodes = vec![up("a", 10, 5), up("b", 10, 1), up("c", 10, 3)];
        let draining_b = vec![
            up("a", 10, 5),
            NodeView {
                status: NodeState::Draining,
                ..up("b", 10, 0)
            },
        ];
        type Case<'a> = (&'a str, Option<LeaseView>, &'a [NodeView], Decision);
        let cases: &[Case] = &[
            (
                "live lease held here",
                Some(lease(Some("a"), true)),
                &nodes,
                Decision::Local,
            ),
            (
                "live lease held elsewhere, even by a full node",
                Some(lease(Some("c"), true)),
                &[up("a", 10, 0), up("c", 1, 1)],
                Decision::Owner("c".into()),
            ),
            (
                "live lease of a draining node still routes there",
                Some(lease(Some("b"), true)),
                &draining_b,
                Decision::Owner("b".into()),
            ),
            (
                "no lease: most free",
                None,
                &nodes,
                Decision::Place("b".into()),
            ),
            (
                "released lease: sticky to its last holder",
                Some(lease(Some("c"), false)),
                &nodes,
                Decision::Place("c".into()),
            ),
            (
                "released lease of this node: here",
                Some(lease(Some("a"), false)),
                &nodes,
                Decision::Local,
            ),
            (
                "expired lease of a dead node: most free",
                Some(lease(Some("d"), false)),
                &[up("a", 10, 0), dead("d")],
                Decision::Local,
            ),
            (
                "draining nodes get nothing new",
                None,
                &draining_b,
                Decision::Local,
            ),
            (
                "nobody has room",
                None,
                &[up("a", 1, 1), up("b", 2, 2)],
                Decision::NoCapacity,
            ),
        ];
        for (name, lease, nodes, want) in cases {
            assert_eq!(&decide("a", lease.as_ref(), nodes, TTL), want, "{name}");
        }
    }

    #[test]
    fn lease_views_are_live_only_when_held_unreleased_and_unexpired() {
        let user = UserId::parse("alice").unwrap();
        let base = LeaseRecord {
            user,
            holder: Some("a".into()),
            epoch: 3,
            lease_until: Some(1),
            released: false,
            expired: false,
            holder_alive: None,
        };
        assert!(LeaseView::of(&base).live);
        for record in [
            LeaseRecord {
                released: true,
                ..base.clone()
            },
            LeaseRecord {
                expired: true,
                ..base.clone()
            },
            LeaseRecord {
                holder: None,
                ..base.clone()
            },
            LeaseRecord {
                lease_until: None,
                ..base.clone()
            },
        ] {
            assert!(!LeaseView::of(&record).live, "{record:?}");
        }
    }

    fn expired(
        user: &str,
        holder: &str,
        alive: Option<bool>,
        main: Option<InstanceStatus>,
    ) -> Expired {
        Expired {
            user: UserId::parse(user).unwrap(),
            holder: holder.into(),
            epoch: 7,
            holder_alive: alive,
            main,
        }
    }

    fn relaunch(user: &str, holder: &str) -> FailoverStep {
        FailoverStep::Relaunch {
            user: UserId::parse(user).unwrap(),
            old_holder: holder.into(),
            old_epoch: 7,
        }
    }

    fn kinds(steps: &[FailoverStep]) -> Vec<String> {
        steps
            .iter()
            .map(|s| match s {
                FailoverStep::Relaunch { user, .. } => format!("relaunch {user}"),
                FailoverStep::Report { user, .. } => format!("report {user}"),
            })
            .collect()
    }

    #[test]
    fn failover_table() {
        use InstanceStatus::{Crashed, Failed, Running, Starting, Stopped};
        let nodes = vec![up("a", 10, 0), up("b", 10, 5), dead("x")];
        type Case<'a> = (&'a str, Expired, TakeoverPolicy, Vec<&'a str>);
        let ev = TakeoverPolicy::Evidence;
        let cases: Vec<Case> = vec![
            (
                "dead holder, running main, evidence: the most free node relaunches",
                expired("u", "x", Some(false), Some(Running)),
                ev,
                vec!["relaunch u"],
            ),
            (
                "starting and crashed mains count as live",
                expired("u", "x", Some(false), Some(Starting)),
                ev,
                vec!["relaunch u"],
            ),
            (
                "crashed",
                expired("u", "x", Some(false), Some(Crashed)),
                ev,
                vec!["relaunch u"],
            ),
            (
                "stopped main: nothing to do",
                expired("u", "x", Some(false), Some(Stopped)),
                ev,
                vec![],
            ),
            (
                "failed main: nothing to do",
                expired("u", "x", Some(false), Some(Failed)),
                ev,
                vec![],
            ),
            (
                "no main record: nothing to do",
                expired("u", "x", Some(false), None),
                ev,
                vec![],
            ),
            (
                "holder alive: no evidence, report",
                expired("u", "b", Some(true), Some(Running)),
                ev,
                vec!["report u"],
            ),
            (
                "liveness unknown: report",
                expired("u", "x", None, Some(Running)),
                ev,
                vec!["report u"],
            ),
            (
                "manual: report even with evidence",
                expired("u", "x", Some(false), Some(Running)),
                TakeoverPolicy::Manual,
                vec!["report u"],
            ),
            (
                "own lease: the renew tick's business",
                expired("u", "a", Some(false), Some(Running)),
                ev,
                vec![],
            ),
        ];
        for (name, e, policy, want) in cases {
            let steps = plan_failovers("a", &[e], &nodes, TTL, policy);
            assert_eq!(kinds(&steps), want, "{name}");
        }
        // Another node is the most free: it relaunches, this node does not.
        let steps = plan_failovers(
            "b",
            &[expired("u", "x", Some(false), Some(Running))],
            &nodes,
            TTL,
            TakeoverPolicy::Evidence,
        );
        assert!(steps.is_empty(), "{steps:?}");
        // Nobody has room: reported.
        let full = vec![up("a", 1, 1), dead("x")];
        let steps = plan_failovers(
            "a",
            &[expired("u", "x", Some(false), Some(Running))],
            &full,
            TTL,
            TakeoverPolicy::Evidence,
        );
        assert_eq!(kinds(&steps), vec!["report u"]);
    }

    #[test]
    fn failovers_spread_over_the_nodes_in_one_scan() {
        let nodes = vec![up("a", 10, 0), up("b", 10, 0), dead("x")];
        let users: Vec<Expired> = ["u1", "u2", "u3", "u4"]
            .iter()
            .map(|u| expired(u, "x", Some(false), Some(InstanceStatus::Running)))
            .collect();
        let on_a = plan_failovers("a", &users, &nodes, TTL, TakeoverPolicy::Evidence);
        let on_b = plan_failovers("b", &users, &nodes, TTL, TakeoverPolicy::Evidence);
        assert_eq!(on_a, vec![relaunch("u1", "x"), relaunch("u3", "x")]);
        assert_eq!(on_b, vec![relaunch("u2", "x"), relaunch("u4", "x")]);
    }

    #[test]
    fn advertised_urls_become_authorities() {
        let cases = [
            ("http://127.0.0.1:8000", Some("127.0.0.1:8000")),
            ("http://10.0.0.5:8000/", Some("10.0.0.5:8000")),
            ("http://node-a", Some("node-a:80")),
            ("http://[::1]:9000", Some("[::1]:9000")),
            ("not a url", None),
            ("", None),
        ];
        for (url, want) in cases {
            assert_eq!(
                authority_of_url(url).map(|a| a.to_string()).as_deref(),
                want,
                "{url}"
            );
        }
    }
}
