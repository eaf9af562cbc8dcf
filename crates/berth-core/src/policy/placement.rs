//! Node liveness and placement (design §8.1, §8.3).
//!
//! The caller reads the `nodes` table and turns each row into a
//! [`NodeView`], measuring the heartbeat's age with the *store's* clock
//! (`store.now() - heartbeat`), never a node's wall clock: node clocks are
//! not compared with each other (design §3). Everything below is then a
//! pure function of those views and a TTL.

use serde::{Deserialize, Serialize};

/// Whether a node takes new instances (design §8.1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    #[default]
    Up,
    /// Keeps what it runs, takes nothing new.
    Draining,
    Down,
}

/// One node as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeView {
    pub id: String,
    pub status: NodeState,
    /// How many mains it is willing to run.
    pub capacity: u32,
    /// How many mains it runs now, as it last reported.
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

    /// Alive, `up` and not full: the only nodes that get new instances.
    fn can_take(&self, ttl_ms: i64) -> bool {
        self.status == NodeState::Up && self.is_alive(ttl_ms) && self.free() > 0
    }
}

/// Chooses the node to run a user's main (design §8.3).
///
/// Sticky first: the node that last owned the user (`sticky`, the lease's
/// holder hint), since the user's data may live on its disk, if it can take
/// the instance. Otherwise the node with the most free capacity, ties broken
/// by the smallest id so every node that asks reaches the same answer.
/// Draining, down, dead and full nodes never get new instances; `None` when
/// no node can take it.
pub fn place(sticky: Option<&str>, nodes: &[NodeView], ttl_ms: i64) -> Option<String> {
    if let Some(node) = sticky.and_then(|id| nodes.iter().find(|n| n.id == id))
        && node.can_take(ttl_ms)
    {
        return Some(node.id.clone());
    }
    nodes
        .iter()
        .filter(|n| n.can_take(ttl_ms))
        // Most free wins; on a tie the smaller id compares greater under
        // `Reverse`, so `max_by` picks it whatever the input order.
        .max_by(|a, b| a.free().cmp(&b.free()).then_with(|| b.id.cmp(&a.id)))
        .map(|n| n.id.clone())
}

#[cfg(test)]
mod tests {
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
        /// Name, sticky hint, nodes, expected choice.
        type Case<'a> = (&'a str, Option<&'a str>, Vec<NodeView>, Option<&'a str>);
        let cases: &[Case] = &[
            (
                "sticky wins over more free capacity",
                Some("b"),
                vec![up("a", 10, 0), up("b", 10, 9)],
                Some("b"),
            ),
            (
                "no sticky: most free",
                None,
                vec![up("a", 10, 5), up("b", 10, 2), up("c", 4, 0)],
                Some("b"),
            ),
            (
                "sticky draining: most free",
                Some("b"),
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
                vec![up("a", 10, 5), node("b", Down, 10, 0, 0)],
                Some("a"),
            ),
            (
                "sticky dead: most free",
                Some("b"),
                vec![up("a", 10, 5), node("b", Up, 10, 0, dead)],
                Some("a"),
            ),
            (
                "sticky full: most free",
                Some("b"),
                vec![up("a", 10, 5), up("b", 10, 10)],
                Some("a"),
            ),
            (
                "sticky unknown: most free",
                Some("gone"),
                vec![up("a", 10, 5), up("b", 10, 1)],
                Some("b"),
            ),
            (
                "all full: nobody",
                None,
                vec![up("a", 10, 10), up("b", 3, 7)],
                None,
            ),
            (
                "draining, down and dead never take new instances",
                Some("a"),
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
                vec![node("a", Up, 100, 0, dead), up("b", 2, 1)],
                Some("b"),
            ),
            ("no nodes at all", Some("a"), vec![], None),
            (
                "ties go to the smallest id",
                None,
                vec![up("c", 10, 5), up("a", 10, 5), up("b", 10, 5)],
                Some("a"),
            ),
        ];
        for (name, sticky, nodes, want) in cases {
            assert_eq!(
                place(*sticky, nodes, TTL).as_deref(),
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
        for _ in 0..nodes.len() {
            nodes.rotate_left(1);
            assert_eq!(place(None, &nodes, TTL).as_deref(), Some("n1"));
            let mut reversed = nodes.clone();
            reversed.reverse();
            assert_eq!(place(None, &reversed, TTL).as_deref(), Some("n1"));
        }
    }
}
