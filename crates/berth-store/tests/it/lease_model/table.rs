//! The store's lease statements as an in-memory table with the clock
//! passed in: the twin the model runs on, and the oracle the real stores
//! are compared with in `replay.rs`.
//!
//! Each method is the statement of the same name in `sql/statements.rs`
//! (and the dialects' renew), read as a rule over one row.

use std::collections::{BTreeMap, HashMap};

use berth_core::{Epoch, UserId};
use berth_store::ClaimOutcome;

/// Milliseconds on the store's clock.
pub type StoreMillis = i64;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Row {
    pub holder: Option<String>,
    pub epoch: Epoch,
    pub lease_until: StoreMillis,
    pub released: bool,
}

impl Row {
    fn expired(&self, now: StoreMillis) -> bool {
        self.holder.is_some() && !self.released && self.lease_until < now
    }
}

#[derive(Debug, Clone, Default)]
pub struct Table {
    rows: BTreeMap<UserId, Row>,
    /// Each node's last heartbeat, by the store's clock.
    heartbeats: HashMap<String, StoreMillis>,
}

impl Table {
    pub fn row(&self, user: &UserId) -> Option<&Row> {
        self.rows.get(user)
    }

    pub fn epoch(&self, user: &UserId) -> Epoch {
        self.rows.get(user).map_or(0, |row| row.epoch)
    }

    pub fn heartbeat(&mut self, node: &str, now: StoreMillis) {
        self.heartbeats.insert(node.to_owned(), now);
    }

    fn holder_alive(&self, holder: &str, ttl: i64, now: StoreMillis) -> bool {
        self.heartbeats
            .get(holder)
            .is_some_and(|beat| *beat >= now - ttl)
    }

    /// The claim: free, released, this node's own, or (with `evidence`)
    /// expired under a holder whose heartbeat is older than one TTL.
    pub fn claim(
        &mut self,
        user: &UserId,
        node: &str,
        ttl: i64,
        evidence: bool,
        now: StoreMillis,
    ) -> ClaimOutcome {
        let row = self.rows.entry(user.clone()).or_default().clone();
        let takeable = match &row.holder {
            None => true,
            Some(holder) => {
                holder == node
                    || row.released
                    || (evidence && row.lease_until < now && !self.holder_alive(holder, ttl, now))
            }
        };
        self.settle(user, row, node, ttl, now, takeable)
    }

    /// An operator's takeover: free, released or expired, whoever held it.
    pub fn take_over(
        &mut self,
        user: &UserId,
        node: &str,
        ttl: i64,
        now: StoreMillis,
    ) -> ClaimOutcome {
        let row = self.rows.entry(user.clone()).or_default().clone();
        let takeable = row.holder.is_none() || row.released || row.lease_until < now;
        self.settle(user, row, node, ttl, now, takeable)
    }

    fn settle(
        &mut self,
        user: &UserId,
        row: Row,
        node: &str,
        ttl: i64,
        now: StoreMillis,
        takeable: bool,
    ) -> ClaimOutcome {
        if takeable {
            let epoch = row.epoch + 1;
            self.rows.insert(
                user.clone(),
                Row {
                    holder: Some(node.to_owned()),
                    epoch,
                    lease_until: now + ttl,
                    released: false,
                },
            );
            return ClaimOutcome::Claimed { epoch };
        }
        ClaimOutcome::Busy {
            expired: row.expired(now),
            holder: row.holder.unwrap_or_default(),
        }
    }

    /// Extends each lease `node` holds at the asked epoch and has not
    /// released; the users extended.
    pub fn renew(
        &mut self,
        node: &str,
        asked: &[(UserId, Epoch)],
        ttl: i64,
        now: StoreMillis,
    ) -> Vec<UserId> {
        let mut renewed = Vec::new();
        for (user, epoch) in asked {
            if let Some(row) = self.rows.get_mut(user)
                && row.epoch == *epoch
                && row.holder.as_deref() == Some(node)
                && !row.released
            {
                row.lease_until = now + ttl;
                renewed.push(user.clone());
            }
        }
        renewed
    }

    /// Ends the lease if `node` holds it at `epoch`, keeping the holder.
    pub fn release(&mut self, user: &UserId, node: &str, epoch: Epoch, now: StoreMillis) -> bool {
        match self.rows.get_mut(user) {
            Some(row)
                if row.holder.as_deref() == Some(node) && row.epoch == epoch && !row.released =>
            {
                row.lease_until = now - 1;
                row.released = true;
                true
            }
            _ => false,
        }
    }

    /// The live leases `node` holds.
    pub fn held_by(&self, node: &str, now: StoreMillis) -> HashMap<UserId, Epoch> {
        self.rows
            .iter()
            .filter(|(_, row)| {
                row.holder.as_deref() == Some(node) && !row.released && row.lease_until >= now
            })
            .map(|(user, row)| (user.clone(), row.epoch))
            .collect()
    }
}
