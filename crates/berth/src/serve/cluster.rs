//! Cluster mode: where a user's instance runs, and where each operation
//! on it goes, when several nodes share a PostgreSQL store.
//!
//! * [`decide`] (pure): where a launch goes. A live lease names the owner;
//!   otherwise placement picks a node (sticky to the last holder).
//! * [`home`] (pure): where every other per-user operation goes: the
//!   lease's holder, else the last holder while it lives, else here.
//! * [`Cluster`] feeds them from the store (the lease row, and the nodes'
//!   rows cached for at most [`NODES_MAX_AGE`]) and holds the client for
//!   node-to-node calls. The use cases (`ops`) act on its answers; the
//!   failover scan (`failover`) uses its views.
//!
//! The lease stays the only guarantee of "one live main per user": every
//! decision here may be stale, and a wrong one ends in a refused claim
//! (`lease_busy`), never in a second instance.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use axum::http::uri::Authority;
use berth_core::policy::{NodeState, NodeView, no_room, place};
use berth_core::{Epoch, SpawnError, UserId};
use berth_proxy::Locate;
use berth_store::{LeaseRecord, NodeRecord, NodeStatus, Store, StoreError};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::peer::{PeerClient, PeerNode};

/// The nodes' rows are read again when older than this: placement and
/// routing tolerate a second of staleness (the lease catches races), and
/// the store is spared one query per request.
pub const NODES_MAX_AGE: Duration = Duration::from_secs(1);
/// How long a place reserved by placement counts against its node when the
/// node never claims the user's lease (a launch that failed before its
/// claim). A claim ends the reservation at once; this only bounds how long
/// a failed launch makes its node look one fuller. Long enough for a busy
/// node to reach the claim of a launch it was sent.
const PLACE_HOLD: Duration = Duration::from_secs(30);
/// How long a remote owner is remembered for the proxy.
const OWNER_MAX_AGE: Duration = Duration::from_secs(1);
/// Bound of the remote-owner cache.
const OWNER_CACHE_ENTRIES: usize = 10_000;

// --- pure decisions ---------------------------------------------------------

/// What a lease row says about ownership, as [`decide`] needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseView {
    pub holder: Option<String>,
    /// Held, not released, and not past its end by the store's clock.
    pub live: bool,
    /// Held and not released: live, or expired while its holder may still
    /// run the instance (fencing itself). Released leases keep their holder
    /// only as a hint.
    pub held: bool,
}

impl LeaseView {
    pub fn of(record: &LeaseRecord) -> Self {
        let held = record.holder.is_some() && !record.released;
        Self {
            holder: record.holder.clone(),
            live: held && record.lease_until.is_some() && !record.expired,
            held,
        }
    }

    /// The node other than `me` that holds this lease (live or expired),
    /// as the `lease_busy` error a call that reached the wrong node
    /// answers with.
    pub fn held_elsewhere(&self, me: &str, user: &UserId) -> Option<SpawnError> {
        let holder = self.holder.as_deref().filter(|h| self.held && *h != me)?;
        Some(SpawnError::LeaseBusy {
            user: user.clone(),
            holder: holder.to_owned(),
            expired: !self.live,
        })
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
    /// No live lease, and no node can take a new instance: why, naming the
    /// capacity left.
    NoCapacity(String),
}

impl Decision {
    /// The node placement chose: `me` for [`Decision::Local`], the other
    /// node for [`Decision::Place`]; `None` otherwise.
    fn placed_on(&self, me: &str) -> Option<String> {
        match self {
            Decision::Local => Some(me.to_owned()),
            Decision::Place(node) => Some(node.clone()),
            Decision::Owner(_) | Decision::NoCapacity(_) => None,
        }
    }
}

/// What a live lease says: this node or another one holds it. `None`
/// without a live lease (none, released, or expired): then the user is
/// placed.
fn owner(me: &str, lease: Option<&LeaseView>) -> Option<Decision> {
    let lease = lease.filter(|l| l.live)?;
    let holder = lease.holder.as_deref()?;
    Some(if holder == me {
        Decision::Local
    } else {
        Decision::Owner(holder.to_owned())
    })
}

/// Where a launch goes once placement chose `chosen` (or nothing) among
/// `nodes`, without the nodes in `refused`.
fn placed(
    me: &str,
    chosen: Option<String>,
    nodes: &[NodeView],
    ttl_ms: i64,
    refused: &[String],
) -> Decision {
    match chosen {
        Some(node) if node == me => Decision::Local,
        Some(node) => Decision::Place(node),
        None => Decision::NoCapacity(no_room(nodes, ttl_ms, refused)),
    }
}

/// Where `user`'s launch goes: a live lease names the owner; with none,
/// placement chooses among `nodes` (sticky to the last holder), passing
/// over the nodes in `refused`.
pub fn decide(
    me: &str,
    user: &UserId,
    lease: Option<&LeaseView>,
    nodes: &[NodeView],
    ttl_ms: i64,
    refused: &[String],
) -> Decision {
    owner(me, lease).unwrap_or_else(|| {
        let sticky = lease.and_then(|l| l.holder.as_deref());
        let chosen = place(user.as_str(), sticky, refused, nodes, ttl_ms);
        placed(me, chosen, nodes, ttl_ms, refused)
    })
}

/// Where a user's operations other than a launch run (stop, restart,
/// logs, watchdog, breaker reset, progress): on the node that holds the
/// lease, live or expired (an expired holder may still run the instance);
/// with a released lease, on its last holder while that node is alive and
/// not `down` (the user's data and logs are on its disk); otherwise here.
/// Never [`Decision::Place`] or [`Decision::NoCapacity`].
pub fn home(me: &str, lease: Option<&LeaseView>, nodes: &[NodeView], ttl_ms: i64) -> Decision {
    let Some(lease) = lease else {
        return Decision::Local;
    };
    let Some(holder) = lease.holder.as_deref().filter(|h| *h != me) else {
        return Decision::Local;
    };
    let last_holder_alive = || {
        nodes
            .iter()
            .any(|n| n.id == holder && n.status != NodeState::Down && n.is_alive(ttl_ms))
    };
    if lease.held || last_holder_alive() {
        Decision::Owner(holder.to_owned())
    } else {
        Decision::Local
    }
}

/// `host:port` of an advertised `http://host:port` URL.
pub fn authority_of_url(url: &str) -> Option<Authority> {
    let parsed = reqwest::Url::parse(url).ok()?;
    let host = parsed.host_str()?;
    let port = parsed.port_or_known_default()?;
    let endpoint = berth_core::Endpoint {
        host: host.to_owned(),
        port,
        reach: berth_core::Reach::default(),
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

    fn peer(&self, node: &str) -> Option<PeerNode> {
        self.nodes
            .iter()
            .find(|n| n.id == node)
            .filter(|n| !n.internal_url.is_empty() && !n.advertise_url.is_empty())
            .map(peer_of)
    }
}

/// This node's view of the cluster: the lease and node rows behind every
/// routing decision, cached where a second of staleness is harmless, and
/// the client that calls other nodes.
pub struct Cluster {
    store: Arc<dyn Store>,
    node_id: String,
    ttl: Duration,
    peers: PeerClient,
    nodes: Mutex<Option<Arc<NodesSnapshot>>>,
    /// One refresh at a time; others wait for it rather than all querying.
    refresh: tokio::sync::Mutex<()>,
    owners: Mutex<HashMap<UserId, (Instant, Locate)>>,
    pub metrics: ClusterMetrics,
}

impl Cluster {
    pub fn new(
        store: Arc<dyn Store>,
        node_id: String,
        ttl: Duration,
        peers: PeerClient,
        metrics: ClusterMetrics,
    ) -> Self {
        Self {
            store,
            node_id,
            ttl,
            peers,
            nodes: Mutex::new(None),
            refresh: tokio::sync::Mutex::new(()),
            owners: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    pub fn peers(&self) -> &PeerClient {
        &self.peers
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

    /// Fresh views of every node (for decisions that must not be stale:
    /// the failover scan, restart-all).
    pub async fn fresh_views(&self) -> Result<Vec<NodeView>, SpawnError> {
        Ok(self.snapshot(Duration::ZERO).await?.views())
    }

    /// `node` and its advertised URLs.
    pub async fn peer(&self, node: &str) -> Result<PeerNode, SpawnError> {
        let snapshot = self.snapshot(NODES_MAX_AGE).await?;
        if let Some(peer) = snapshot.peer(node) {
            return Ok(peer);
        }
        // A node that registered within the last second.
        self.snapshot(Duration::ZERO)
            .await?
            .peer(node)
            .ok_or_else(|| {
                SpawnError::Internal(format!(
                    "node {node} advertises no node-to-node URL in the nodes table (it has not \
                     heartbeaten yet, or runs a berth without a node-to-node listener)"
                ))
            })
    }

    /// `user`'s lease as routing sees it.
    pub async fn lease(&self, user: &UserId) -> Result<Option<LeaseView>, SpawnError> {
        Ok(self
            .store
            .get_lease(user)
            .await?
            .as_ref()
            .map(LeaseView::of))
    }

    /// Where `user`'s main should be launched from, now: the live lease's
    /// holder, else the node placement chooses ([`decide`]'s rule), passing
    /// over the nodes in `refused`. The choice is made inside the store's
    /// placement step, against every node's live count, and a place is
    /// reserved on the chosen node there, so the launches of a burst see
    /// each other's choices instead of all picking the same node.
    pub async fn decide(&self, user: &UserId, refused: &[String]) -> Result<Decision, SpawnError> {
        let lease = self.lease(user).await?;
        if let Some(owner) = owner(&self.node_id, lease.as_ref()) {
            return Ok(owner);
        }
        let (me, ttl_ms) = (self.node_id.as_str(), self.ttl_ms());
        let choose = |nodes: &[NodeView]| {
            decide(me, user, lease.as_ref(), nodes, ttl_ms, refused).placed_on(me)
        };
        let placement = self.store.reserve_place(user, PLACE_HOLD, &choose).await?;
        Ok(placed(
            &self.node_id,
            placement.node,
            &placement.nodes,
            ttl_ms,
            refused,
        ))
    }

    /// Where `user`'s other operations run, now ([`home`]).
    pub async fn home(&self, user: &UserId) -> Result<Decision, SpawnError> {
        let lease = self.lease(user).await?;
        let snapshot = self.snapshot(NODES_MAX_AGE).await?;
        Ok(home(
            &self.node_id,
            lease.as_ref(),
            &snapshot.views(),
            self.ttl_ms(),
        ))
    }

    /// Every node other than this one that may run instances: alive and
    /// not `down`, or holding a lease that is not released. The rest run
    /// nothing a cluster-wide operation could reach.
    pub async fn other_nodes(&self) -> Result<Vec<PeerNode>, SpawnError> {
        let snapshot = self.snapshot(Duration::ZERO).await?;
        let holders: HashSet<String> = self
            .store
            .list_leases(false, self.ttl)
            .await?
            .into_iter()
            .filter(|l| !l.released)
            .filter_map(|l| l.holder)
            .collect();
        let ttl_ms = self.ttl_ms();
        let views = snapshot.views();
        let mut ids: Vec<String> = views
            .iter()
            .filter(|n| n.status != NodeState::Down && n.is_alive(ttl_ms))
            .map(|n| n.id.clone())
            .chain(holders)
            .filter(|id| *id != self.node_id)
            .collect();
        ids.sort();
        ids.dedup();
        Ok(ids
            .into_iter()
            .map(|id| {
                snapshot.peer(&id).unwrap_or(PeerNode {
                    url: String::new(),
                    public_url: String::new(),
                    id,
                })
            })
            .collect())
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
                let peer = peer_of(&n);
                match self.peers.purge_tokens(&peer).await {
                    Ok(()) => None,
                    Err(e) => Some(format!("{} ({e})", peer.id)),
                }
            });
        futures_util::future::join_all(calls)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// Asks `node` to fence `user`'s instance if it still runs under
    /// `epoch` (ARCHITECTURE.md, invariant 7). Best effort: the old
    /// holder is usually gone, and its shim freezes the instance anyway.
    pub async fn fence_remote(&self, node: &str, user: &UserId, epoch: Epoch) {
        if node == self.node_id {
            return;
        }
        let result = match self.peer(node).await {
            Ok(peer) => self.peers.fence(&peer, user, epoch).await,
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

    /// The proxy's remembered answer for `user`, if recent.
    pub fn cached_owner(&self, user: &UserId) -> Option<Locate> {
        let owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        owners
            .get(user)
            .filter(|(at, _)| at.elapsed() <= OWNER_MAX_AGE)
            .map(|(_, l)| l.clone())
    }

    /// Remembers, for a second, that `user` is served elsewhere.
    pub fn remember_owner(&self, user: &UserId, locate: &Locate) {
        let mut owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        if owners.len() >= OWNER_CACHE_ENTRIES {
            owners.retain(|_, (at, _)| at.elapsed() <= OWNER_MAX_AGE);
            if owners.len() >= OWNER_CACHE_ENTRIES {
                owners.clear();
            }
        }
        owners.insert(user.clone(), (Instant::now(), locate.clone()));
    }
}

/// A node's row as the node to call.
fn peer_of(n: &NodeRecord) -> PeerNode {
    PeerNode {
        id: n.id.clone(),
        url: n.internal_url.clone(),
        public_url: n.advertise_url.clone(),
    }
}

/// Where the proxy forwards a request for a user `node` runs: its public
/// listener, which serves the user's app.
pub fn remote_locate(node: &PeerNode) -> Result<Locate, SpawnError> {
    let endpoint = authority_of_url(&node.public_url).ok_or_else(|| {
        SpawnError::Internal(format!(
            "node {} advertises {:?}, which is not an http://host:port URL",
            node.id, node.public_url
        ))
    })?;
    Ok(Locate::Remote {
        endpoint,
        node: node.id.clone(),
    })
}

/// Node views for the decision tables (here and in `failover`).
#[cfg(test)]
pub(super) mod fixtures {
    use berth_core::policy::{NodeState, NodeView};

    pub const TTL: i64 = 3000;

    /// Alive and `up`, with `load` of `capacity` taken.
    pub fn up(id: &str, capacity: u32, load: u32) -> NodeView {
        NodeView {
            id: id.into(),
            status: NodeState::Up,
            capacity,
            load,
            heartbeat_age_ms: 100,
        }
    }

    /// Heartbeat older than the TTL.
    pub fn dead(id: &str) -> NodeView {
        NodeView {
            heartbeat_age_ms: TTL + 1,
            ..up(id, 10, 0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::{TTL, dead, up};
    use super::*;

    fn lease(holder: Option<&str>, live: bool) -> LeaseView {
        LeaseView {
            holder: holder.map(str::to_owned),
            live,
            held: live,
        }
    }

    fn expired(holder: &str) -> LeaseView {
        LeaseView {
            holder: Some(holder.into()),
            live: false,
            held: true,
        }
    }

    #[test]
    fn home_table() {
        let down = NodeView {
            status: NodeState::Down,
            ..up("c", 10, 0)
        };
        let nodes = vec![up("a", 10, 5), up("b", 10, 1), down, dead("d")];
        type Case<'a> = (&'a str, Option<LeaseView>, Decision);
        let cases: &[Case] = &[
            ("no lease: here", None, Decision::Local),
            (
                "live lease here",
                Some(lease(Some("a"), true)),
                Decision::Local,
            ),
            (
                "live lease elsewhere",
                Some(lease(Some("b"), true)),
                Decision::Owner("b".into()),
            ),
            (
                "expired, unreleased: its holder may still run it, even if it looks dead",
                Some(expired("d")),
                Decision::Owner("d".into()),
            ),
            (
                "released: the last holder, alive and up, keeps the user's data",
                Some(lease(Some("b"), false)),
                Decision::Owner("b".into()),
            ),
            (
                "released, last holder down: here",
                Some(lease(Some("c"), false)),
                Decision::Local,
            ),
            (
                "released, last holder dead: here",
                Some(lease(Some("d"), false)),
                Decision::Local,
            ),
            (
                "released, last holder unknown: here",
                Some(lease(Some("zz"), false)),
                Decision::Local,
            ),
            ("never held", Some(lease(None, false)), Decision::Local),
        ];
        for (name, lease, want) in cases {
            assert_eq!(&home("a", lease.as_ref(), &nodes, TTL), want, "{name}");
        }
    }

    #[test]
    fn a_lease_held_elsewhere_is_lease_busy() {
        let alice = UserId::parse("alice").unwrap();
        let busy = |l: LeaseView| l.held_elsewhere("a", &alice).map(|e| e.to_string());
        assert_eq!(busy(lease(Some("a"), true)), None, "mine");
        assert_eq!(busy(lease(Some("b"), false)), None, "released");
        assert_eq!(busy(lease(None, false)), None, "never held");
        assert_eq!(
            lease(Some("b"), true).held_elsewhere("a", &alice),
            Some(SpawnError::LeaseBusy {
                user: alice.clone(),
                holder: "b".into(),
                expired: false
            })
        );
        assert_eq!(
            expired("b").held_elsewhere("a", &alice),
            Some(SpawnError::LeaseBusy {
                user: alice.clone(),
                holder: "b".into(),
                expired: true
            })
        );
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
                "nobody has room: the refusal names the capacity left",
                None,
                &[up("a", 1, 1), up("b", 2, 2)],
                Decision::NoCapacity(
                    "no node of the cluster has room for a new instance: 0 of 3 places left \
                     (a: 1 of 1 taken; b: 2 of 2 taken)"
                        .into(),
                ),
            ),
        ];
        let alice = UserId::parse("alice").unwrap();
        for (name, lease, nodes, want) in cases {
            assert_eq!(
                &decide("a", &alice, lease.as_ref(), nodes, TTL, &[]),
                want,
                "{name}"
            );
        }
        // Nodes that refused the launch are passed over: the next freest,
        // then this node, then none.
        let refused = |ids: &[&str]| ids.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let cases: &[(&[&str], Decision)] = &[
            (&["b"], Decision::Place("c".into())),
            (&["b", "c"], Decision::Local),
            (
                &["a", "b", "c"],
                Decision::NoCapacity(
                    "no node of the cluster has room for a new instance: 0 of 30 places left \
                     (a: 5 of 10 taken, refused; b: 1 of 10 taken, refused; c: 3 of 10 taken, refused)"
                        .into(),
                ),
            ),
        ];
        for (gone, want) in cases {
            assert_eq!(
                &decide("a", &alice, None, &nodes, TTL, &refused(gone)),
                want,
                "refused {gone:?}"
            );
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
        assert!(LeaseView::of(&base).held);
        let expired = LeaseView::of(&LeaseRecord {
            expired: true,
            ..base.clone()
        });
        assert!(expired.held && !expired.live, "{expired:?}");
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
