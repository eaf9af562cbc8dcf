//! Node liveness and placement.
//!
//! The caller builds a [`NodeView`] per node from the store, measuring the
//! heartbeat's age with the *store's* clock (`store.now() - heartbeat`),
//! never a node's wall clock: node clocks are not compared with each
//! other. Its `load` is the node's live count at the moment of the
//! decision (the leases it holds and the places reserved for it, counted
//! by the store in the same transaction that records the choice), not the
//! number its last heartbeat reported: with heartbeat numbers, every
//! launch of a burst sees the same loads and picks the same node.
//! Everything below is then a pure function of those views and a TTL.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Whether a node takes new instances.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    /// Running and taking new instances.
    #[default]
    Up,
    /// Keeps what it runs, takes nothing new.
    Draining,
    /// Shut down on purpose; takes nothing new.
    Down,
}

/// One node as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeView {
    /// The node's id.
    pub id: String,
    /// Whether it takes new instances, by its own account.
    pub status: NodeState,
    /// How many mains it is willing to run.
    pub capacity: u32,
    /// How many mains it runs or is about to start.
    pub load: u32,
    /// How long ago its last heartbeat was, by the store's clock.
    pub heartbeat_age_ms: i64,
}

impl NodeView {
    /// Whether the node has heartbeaten within `ttl_ms`.
    ///
    /// A heartbeat exactly `ttl_ms` old still counts: this is the store's
    /// own rule for takeover evidence (a holder is gone only when its
    /// heartbeat is *older* than one TTL), so a node placement calls dead is
    /// exactly one whose leases another node may claim.
    pub fn is_alive(&self, ttl_ms: i64) -> bool {
        self.heartbeat_age_ms <= ttl_ms
    }

    /// Capacity left for new mains; zero when full or over-committed.
    pub fn free(&self) -> u32 {
        self.capacity.saturating_sub(self.load)
    }

    /// Alive and `up`: the only nodes that may get new instances.
    fn open(&self, ttl_ms: i64) -> bool {
        self.status == NodeState::Up && self.is_alive(ttl_ms)
    }

    /// Open, not full, and not among the nodes that refused this launch.
    fn can_take(&self, ttl_ms: i64, refused: &[String]) -> bool {
        self.open(ttl_ms) && self.free() > 0 && !refused.contains(&self.id)
    }
}

/// Chooses the node to run `user`'s main.
///
/// Sticky first: the node that last owned the user (`sticky`, the lease's
/// holder hint), since the user's data may live on its disk, if it can take
/// the instance. Otherwise the node with the most free capacity. Ties go to
/// the node that ranks highest for this user by a hash of the user and the
/// node's id (rendezvous hashing): every node that asks reaches the same
/// answer for one user, while different users spread over the tied nodes
/// instead of all landing on the same one.
///
/// Draining, down, dead and full nodes never get new instances, nor do the
/// nodes in `refused` (those that refused this launch for capacity, though
/// the store's count said they had room); `None` when no node can take it.
pub fn place(
    user: &str,
    sticky: Option<&str>,
    refused: &[String],
    nodes: &[NodeView],
    ttl_ms: i64,
) -> Option<String> {
    if let Some(node) = sticky.and_then(|id| nodes.iter().find(|n| n.id == id))
        && node.can_take(ttl_ms, refused)
    {
        return Some(node.id.clone());
    }
    nodes
        .iter()
        .filter(|n| n.can_take(ttl_ms, refused))
        .max_by_key(|n| (n.free(), rank(user, &n.id)))
        .map(|n| n.id.clone())
}

/// How high `node` ranks for `user` among tied nodes: the first 8 bytes of
/// SHA-256 over both, so the order is the same on every node and in every
/// version (unlike std's randomly keyed hasher), and independent between
/// users.
fn rank(user: &str, node: &str) -> u64 {
    let mut hash = Sha256::new();
    hash.update(user.as_bytes());
    // A separator no id contains, so ("ab", "c") and ("a", "bc") differ.
    hash.update([0]);
    hash.update(node.as_bytes());
    let digest = hash.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// The places left for new instances on the nodes that may take them:
/// alive, `up`, and not among `refused` (whose count the store had wrong).
pub fn places_left(nodes: &[NodeView], ttl_ms: i64, refused: &[String]) -> u64 {
    nodes
        .iter()
        .filter(|n| n.open(ttl_ms) && !refused.contains(&n.id))
        .map(|n| u64::from(n.free()))
        .sum()
}

/// Why no node can take a new instance, naming the capacity left: the
/// places left of the open nodes' total, then each node with its count
/// (or why it takes nothing).
pub fn no_room(nodes: &[NodeView], ttl_ms: i64, refused: &[String]) -> String {
    let total: u64 = nodes
        .iter()
        .filter(|n| n.open(ttl_ms))
        .map(|n| u64::from(n.capacity))
        .sum();
    let left = places_left(nodes, ttl_ms, refused);
    let each: Vec<String> = nodes
        .iter()
        .map(|n| {
            let state = if !n.is_alive(ttl_ms) {
                "not heartbeating".to_owned()
            } else if n.status != NodeState::Up {
                format!("{:?}", n.status).to_lowercase()
            } else if refused.contains(&n.id) {
                format!("{} of {} taken, refused", n.load, n.capacity)
            } else {
                format!("{} of {} taken", n.load, n.capacity)
            };
            format!("{}: {state}", n.id)
        })
        .collect();
    format!(
        "no node of the cluster has room for a new instance: {left} of {total} places left ({})",
        if each.is_empty() {
            "no nodes".to_owned()
        } else {
            each.join("; ")
        }
    )
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    const TTL: i64 = 30_000;

    fn node(id: &str, status: NodeState, capacity: u32, load: u32, age: i64) -> NodeView {
        NodeView {
            id: id.to_owned(),
            status,
            capacity,
            load,
            heartbeat_age_ms: age,
        }
    }

    fn up(id: &str, capacity: u32, load: u32) -> NodeView {
        node(id, NodeState::Up, capacity, load, 1_000)
    }

    #[test]
    fn liveness_is_judged_against_the_ttl_inclusively() {
        for (age, alive) in [
            (-5, true), // the store clock stepped back: still fresh
            (0, true),
            (TTL - 1, true),
            (TTL, true),
            (TTL + 1, false),
            (10 * TTL, false),
        ] {
            let n = node("a", NodeState::Up, 1, 0, age);
            assert_eq!(n.is_alive(TTL), alive, "age {age}");
        }
    }

    #[test]
    fn free_capacity_never_underflows() {
        assert_eq!(up("a", 10, 3).free(), 7);
        assert_eq!(up("a", 10, 10).free(), 0);
        assert_eq!(up("a", 2, 5).free(), 0);
    }

    #[test]
    fn placement_table() {
        use NodeState::{Down, Draining, Up};
        let dead = TTL + 1;
        /// Name, sticky hint, refused, nodes, expected choice.
        type Case<'a> = (
            &'a str,
            Option<&'a str>,
            &'a [&'a str],
            Vec<NodeView>,
            Option<&'a str>,
        );
        let cases: &[Case] = &[
            (
                "sticky wins over more free capacity",
                Some("b"),
                &[],
                vec![up("a", 10, 0), up("b", 10, 9)],
                Some("b"),
            ),
            (
                "no sticky: most free",
                None,
                &[],
                vec![up("a", 10, 5), up("b", 10, 2), up("c", 4, 0)],
                Some("b"),
            ),
            (
                "sticky draining: most free",
                Some("b"),
                &[],
                vec![
                    up("a", 10, 5),
                    node("b", Draining, 10, 0, 0),
                    up("c", 10, 1),
                ],
                Some("c"),
            ),
            (
                "sticky down: most free",
                Some("b"),
                &[],
                vec![up("a", 10, 5), node("b", Down, 10, 0, 0)],
                Some("a"),
            ),
            (
                "sticky dead: most free",
                Some("b"),
                &[],
                vec![up("a", 10, 5), node("b", Up, 10, 0, dead)],
                Some("a"),
            ),
            (
                "sticky full: most free",
                Some("b"),
                &[],
                vec![up("a", 10, 5), up("b", 10, 10)],
                Some("a"),
            ),
            (
                "sticky refused: most free",
                Some("b"),
                &["b"],
                vec![up("a", 10, 5), up("b", 10, 0)],
                Some("a"),
            ),
            (
                "sticky unknown: most free",
                Some("gone"),
                &[],
                vec![up("a", 10, 5), up("b", 10, 1)],
                Some("b"),
            ),
            (
                "a refusing node is passed over though it looks freest",
                None,
                &["b"],
                vec![up("a", 10, 5), up("b", 10, 0), up("c", 10, 7)],
                Some("a"),
            ),
            (
                "every open node refused: nobody",
                None,
                &["a", "b"],
                vec![up("a", 10, 0), up("b", 10, 0)],
                None,
            ),
            (
                "all full: nobody",
                None,
                &[],
                vec![up("a", 10, 10), up("b", 3, 7)],
                None,
            ),
            (
                "draining, down and dead never take new instances",
                Some("a"),
                &[],
                vec![
                    node("a", Draining, 10, 0, 0),
                    node("b", Down, 10, 0, 0),
                    node("c", Up, 10, 0, dead),
                ],
                None,
            ),
            (
                "a dead node with more room loses to a live one",
                None,
                &[],
                vec![node("a", Up, 100, 0, dead), up("b", 2, 1)],
                Some("b"),
            ),
            ("no nodes at all", Some("a"), &[], vec![], None),
        ];
        for (name, sticky, refused, nodes, want) in cases {
            let refused: Vec<String> = refused.iter().map(|s| (*s).to_owned()).collect();
            assert_eq!(
                place("alice", *sticky, &refused, nodes, TTL).as_deref(),
                *want,
                "{name}: {nodes:?}"
            );
        }
    }

    #[test]
    fn ties_do_not_depend_on_input_order() {
        let mut nodes = vec![
            up("n3", 8, 4),
            up("n1", 8, 4),
            up("n2", 6, 2),
            up("n0", 5, 2),
        ];
        for user in ["alice", "bob", "carol", "dave"] {
            let first = place(user, None, &[], &nodes, TTL).unwrap();
            assert!(["n1", "n2", "n3"].contains(&first.as_str()), "{first}");
            for _ in 0..nodes.len() {
                nodes.rotate_left(1);
                assert_eq!(place(user, None, &[], &nodes, TTL), Some(first.clone()));
                let mut reversed = nodes.clone();
                reversed.reverse();
                assert_eq!(place(user, None, &[], &reversed, TTL), Some(first.clone()));
            }
        }
    }

    /// With equal room, users spread over the tied nodes by their hash
    /// rather than all going to the smallest id.
    #[test]
    fn ties_spread_users_over_the_tied_nodes() {
        let nodes = [
            up("node-a", 40, 0),
            up("node-b", 40, 0),
            up("node-c", 40, 0),
        ];
        let mut chosen = BTreeMap::<String, usize>::new();
        for i in 0..300 {
            let node = place(&format!("user{i}"), None, &[], &nodes, TTL).unwrap();
            *chosen.entry(node).or_default() += 1;
        }
        assert_eq!(chosen.len(), 3, "{chosen:?}");
        for (node, n) in &chosen {
            assert!((60..=140).contains(n), "{node} got {n} of 300: {chosen:?}");
        }
    }

    /// A burst placed one at a time against the live counts, each choice
    /// counted before the next (what the store's reservation does): the
    /// nodes fill evenly, a full node gets nothing, and the last place of
    /// the cluster is the last one given.
    #[test]
    fn a_burst_placed_against_live_counts_fills_the_nodes_evenly() {
        for capacity in [40, 1_000] {
            let mut nodes = vec![
                up("node-a", capacity, 0),
                up("node-b", capacity, 0),
                up("node-c", capacity, 0),
            ];
            for i in 0..90 {
                let chosen = place(&format!("user{i}"), None, &[], &nodes, TTL).unwrap();
                let n = nodes.iter_mut().find(|n| n.id == chosen).unwrap();
                n.load += 1;
                let (min, max) = nodes.iter().fold((u32::MAX, 0), |(lo, hi), n| {
                    (lo.min(n.load), hi.max(n.load))
                });
                assert!(max - min <= 1, "after {} launches: {nodes:?}", i + 1);
            }
        }
        let mut nodes = vec![up("a", 2, 0), up("b", 1, 0)];
        for i in 0..3 {
            let chosen = place(&format!("u{i}"), None, &[], &nodes, TTL).unwrap();
            nodes.iter_mut().find(|n| n.id == chosen).unwrap().load += 1;
        }
        assert_eq!(place("u3", None, &[], &nodes, TTL), None, "{nodes:?}");
    }

    #[test]
    fn ranks_are_stable_and_depend_on_both_ids() {
        assert_eq!(rank("alice", "node-a"), rank("alice", "node-a"));
        assert_ne!(rank("alice", "node-a"), rank("alice", "node-b"));
        assert_ne!(rank("alice", "node-a"), rank("bob", "node-a"));
        assert_ne!(rank("ab", "c"), rank("a", "bc"));
    }

    #[test]
    fn the_refusal_names_the_capacity_left() {
        use NodeState::Draining;
        let refused = vec!["b".to_owned()];
        let nodes = [
            up("a", 40, 40),
            up("b", 40, 39),
            node("c", Draining, 40, 0, 0),
            node("d", NodeState::Up, 40, 0, TTL + 1),
        ];
        assert_eq!(places_left(&nodes, TTL, &refused), 0);
        assert_eq!(places_left(&nodes, TTL, &[]), 1);
        assert_eq!(
            no_room(&nodes, TTL, &refused),
            "no node of the cluster has room for a new instance: 0 of 80 places left \
             (a: 40 of 40 taken; b: 39 of 40 taken, refused; c: draining; d: not heartbeating)"
        );
        assert_eq!(
            no_room(&[], TTL, &[]),
            "no node of the cluster has room for a new instance: 0 of 0 places left (no nodes)"
        );
    }
}
