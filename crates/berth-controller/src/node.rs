//! This node as the cluster sees it: its status (`up`, `draining`,
//! `down`), its capacity, enforced here on every launch, and the row its
//! heartbeat writes.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, PoisonError};

use berth_core::SpawnError;
use berth_store::{NodeRecord, NodeStatus};

pub(crate) struct NodeState {
    id: String,
    advertise_url: String,
    internal_url: String,
    /// What the heartbeat says: `up`, or `draining` when an operator asked
    /// the node to take nothing new.
    status: Mutex<NodeStatus>,
    /// How many mains this node runs at most.
    capacity: AtomicU32,
    /// Where that number comes from, for the refusal's message.
    capacity_reason: Mutex<String>,
    /// Launches admitted and not yet live (or given up), counted against
    /// the capacity with the live mains. Changed only under the mutex, so
    /// two launches cannot both take the last place.
    launching: Mutex<u32>,
    /// One heartbeat at a time, each reading the status when it writes: a
    /// tick's row built before a drain must not land after the drain's.
    pub heartbeat_lock: tokio::sync::Mutex<()>,
}

/// A place among the node's capacity, held by a launch until its instance
/// is live (and counted as such) or the launch failed.
pub(crate) struct Place<'a> {
    node: &'a NodeState,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut launching = self
            .node
            .launching
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *launching = launching.saturating_sub(1);
    }
}

impl NodeState {
    /// A node that runs at most `capacity` mains, for `reason`.
    pub fn new(
        id: String,
        advertise_url: String,
        internal_url: String,
        capacity: u32,
        reason: String,
    ) -> Self {
        Self {
            id,
            advertise_url,
            internal_url,
            status: Mutex::new(NodeStatus::Up),
            capacity: AtomicU32::new(capacity),
            capacity_reason: Mutex::new(reason),
            launching: Mutex::new(0),
            heartbeat_lock: tokio::sync::Mutex::new(()),
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn capacity(&self) -> u32 {
        self.capacity.load(Ordering::Relaxed)
    }

    pub fn set_capacity(&self, capacity: u32, reason: String) {
        let mut current = self
            .capacity_reason
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.capacity.store(capacity, Ordering::Relaxed);
        *current = reason;
    }

    pub fn status(&self) -> NodeStatus {
        *self.status.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn set_status(&self, status: NodeStatus) {
        *self.status.lock().unwrap_or_else(PoisonError::into_inner) = status;
    }

    /// A place for one more main, with `live` mains running: refused with
    /// `capacity_exhausted` when the node is full, so nothing is claimed,
    /// written or started.
    pub fn admit(&self, live: u32) -> Result<Place<'_>, SpawnError> {
        let mut launching = self
            .launching
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let capacity = self.capacity();
        let taken = live.saturating_add(*launching);
        if taken >= capacity {
            let reason = self
                .capacity_reason
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            return Err(SpawnError::CapacityExhausted(format!(
                "node {} runs or starts {taken} instances, its capacity ({reason})",
                self.id
            )));
        }
        *launching += 1;
        Ok(Place { node: self })
    }

    /// This node's row as the heartbeat writes it, with `load` live mains.
    pub fn record(&self, load: u32) -> NodeRecord {
        NodeRecord {
            id: self.id.clone(),
            advertise_url: self.advertise_url.clone(),
            internal_url: self.internal_url.clone(),
            capacity: self.capacity(),
            load,
            status: self.status(),
            heartbeat: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_counted_with_live_mains_and_given_back() {
        let node = NodeState::new(
            "n1".into(),
            String::new(),
            String::new(),
            2,
            "a test's".into(),
        );
        let a = node.admit(0).unwrap();
        let b = node.admit(0).unwrap();
        let full = node.admit(0).err().unwrap();
        assert_eq!(
            full,
            SpawnError::CapacityExhausted(
                "node n1 runs or starts 2 instances, its capacity (a test's)".into()
            )
        );
        drop(a);
        assert!(node.admit(1).is_err(), "one live and one launching");
        drop(b);
        assert!(node.admit(1).is_ok());
        node.set_capacity(0, "none".into());
        assert!(node.admit(0).is_err());
    }
}
