//! Counted limits on what all clients and users share:
//!
//! * [`ConnLimits`]: open client connections, in all and per client
//!   address, so one address cannot take every connection berth has;
//! * [`StreamLimits`]: long-lived streams (WebSocket tunnels and the API's
//!   progress and followed-log streams), in all and per user, so one user
//!   cannot starve the others.
//!
//! Both hand out permits that give their slot back when dropped. They are
//! touched once per connection and once per stream, never per plain
//! request, so the proxy's hot path does not see them.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use berth_core::UserId;

/// Takes one slot of `counter` unless it already holds `max`.
fn take_slot(counter: &AtomicUsize, max: usize) -> bool {
    counter
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .is_ok()
}

fn give_slot(counter: &AtomicUsize) {
    counter.fetch_sub(1, Ordering::AcqRel);
}

/// What counts as one client address: an IPv4 address, or an IPv6 /64 (one
/// host usually has a whole /64, so counting single IPv6 addresses would
/// not limit it). An IPv4-mapped IPv6 address counts as its IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClientKey {
    /// An IPv4 client, or an IPv4-mapped IPv6 one.
    V4(Ipv4Addr),
    /// An IPv6 client's /64: the upper 64 bits of its address.
    V6Prefix(u64),
}

impl ClientKey {
    /// The key `ip` is counted under.
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => ClientKey::V4(v4),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => ClientKey::V4(v4),
                None => {
                    let bits = u128::from(v6);
                    // The upper 64 bits: the network prefix.
                    ClientKey::V6Prefix((bits >> 64) as u64)
                }
            },
        }
    }
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ConnRefused {
    /// The node is at its cap on client connections (`max_connections`,
    /// whose value this holds).
    #[error("berth has {0} client connections open, its limit (max_connections)")]
    Total(usize),
    /// The client's address is at its own cap (`max_connections_per_ip`,
    /// whose value this holds).
    #[error("this client address has {0} connections open, its limit (max_connections_per_ip)")]
    PerAddress(usize),
}

/// Caps on open client connections.
#[derive(Debug)]
pub struct ConnLimits {
    max_total: usize,
    max_per_client: usize,
    total: AtomicUsize,
    /// Open connections per client; an address leaves the map with its
    /// last connection, so the map is as large as the set of clients
    /// connected now.
    per_client: Mutex<HashMap<ClientKey, usize>>,
}

impl ConnLimits {
    /// Caps of `max_total` connections in all and `max_per_client` per
    /// [`ClientKey`].
    pub fn new(max_total: usize, max_per_client: usize) -> Arc<Self> {
        Arc::new(Self {
            max_total,
            max_per_client,
            total: AtomicUsize::new(0),
            per_client: Mutex::new(HashMap::new()),
        })
    }

    /// Admits a connection from `ip` or says which cap refuses it. A
    /// trusted proxy (`exempt`) speaks for many clients: only the total
    /// counts for it.
    pub fn admit(self: &Arc<Self>, ip: IpAddr, exempt: bool) -> Result<ConnPermit, ConnRefused> {
        if !take_slot(&self.total, self.max_total) {
            return Err(ConnRefused::Total(self.max_total));
        }
        let client = if exempt {
            None
        } else {
            let key = ClientKey::of(ip);
            let mut map = self.per_client.lock().unwrap_or_else(|e| e.into_inner());
            let open = map.entry(key).or_insert(0);
            if *open >= self.max_per_client {
                if *open == 0 {
                    map.remove(&key);
                }
                drop(map);
                give_slot(&self.total);
                return Err(ConnRefused::PerAddress(self.max_per_client));
            }
            *open += 1;
            Some(key)
        };
        Ok(ConnPermit {
            limits: self.clone(),
            client: Mutex::new(client),
        })
    }

    /// Open connections in all.
    pub fn open(&self) -> usize {
        self.total.load(Ordering::Acquire)
    }
}

/// One admitted connection; gives its slots back when dropped.
#[derive(Debug)]
pub struct ConnPermit {
    limits: Arc<ConnLimits>,
    /// The address slot it holds, until [`ConnPermit::exempt`] or drop.
    client: Mutex<Option<ClientKey>>,
}

impl ConnPermit {
    /// Stops counting this connection against its address (it still counts
    /// in all): for a connection that turned out to come from another node
    /// of the cluster, which may hold many connections to this one from a
    /// single address.
    pub fn exempt(&self) {
        let key = self.client.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(key) = key {
            self.limits.release_client(key);
        }
    }
}

impl ConnLimits {
    fn release_client(&self, key: ClientKey) {
        let mut map = self.per_client.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(open) = map.get_mut(&key) {
            *open -= 1;
            if *open == 0 {
                map.remove(&key);
            }
        }
    }
}

impl Drop for ConnPermit {
    fn drop(&mut self) {
        let key = self
            .client
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(key) = key {
            self.limits.release_client(key);
        }
        give_slot(&self.limits.total);
    }
}

/// Why a long-lived stream was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamRefused {
    /// The node is at its cap on long-lived streams (`max_upgrades`, whose
    /// value this holds).
    #[error(
        "too many long-lived streams (WebSockets, progress and log streams) are open on this node ({0}, max_upgrades); try again later"
    )]
    Total(usize),
    /// The user is at their own cap (`max_upgrades_per_user`).
    #[error(
        "{user} has {max} long-lived streams (WebSockets, progress and log streams) open, as many as one user may (max_upgrades_per_user); close one first"
    )]
    PerUser {
        /// The user at their cap.
        user: UserId,
        /// The cap on one user's long-lived streams.
        max: usize,
    },
}

/// Shards of the per-user counts: streams of different users rarely meet
/// on one lock.
const STREAM_SHARDS: usize = 16;

/// Caps on long-lived streams, in all and per user.
#[derive(Debug)]
pub struct StreamLimits {
    max_total: usize,
    max_per_user: usize,
    total: AtomicUsize,
    hasher: std::collections::hash_map::RandomState,
    /// Open streams per user, sharded by the user's hash; a user leaves
    /// the map with their last stream.
    per_user: [Mutex<HashMap<UserId, usize>>; STREAM_SHARDS],
}

impl StreamLimits {
    /// Caps of `max_total` long-lived streams in all and `max_per_user` per
    /// user.
    pub fn new(max_total: usize, max_per_user: usize) -> Arc<Self> {
        Arc::new(Self {
            max_total,
            max_per_user,
            total: AtomicUsize::new(0),
            hasher: std::collections::hash_map::RandomState::new(),
            per_user: std::array::from_fn(|_| Mutex::new(HashMap::new())),
        })
    }

    fn shard(&self, user: &UserId) -> &Mutex<HashMap<UserId, usize>> {
        // The remainder is below STREAM_SHARDS, so the cast cannot truncate.
        let index = (self.hasher.hash_one(user) % STREAM_SHARDS as u64) as usize;
        &self.per_user[index]
    }

    /// A slot for one stream of `user`, or why there is none.
    pub fn acquire(self: &Arc<Self>, user: &UserId) -> Result<StreamPermit, StreamRefused> {
        if !take_slot(&self.total, self.max_total) {
            return Err(StreamRefused::Total(self.max_total));
        }
        let mut map = self.shard(user).lock().unwrap_or_else(|e| e.into_inner());
        let open = map.get(user).copied().unwrap_or(0);
        if open >= self.max_per_user {
            drop(map);
            give_slot(&self.total);
            return Err(StreamRefused::PerUser {
                user: user.clone(),
                max: self.max_per_user,
            });
        }
        match map.get_mut(user) {
            Some(open) => *open += 1,
            None => {
                map.insert(user.clone(), 1);
            }
        }
        drop(map);
        Ok(StreamPermit {
            limits: self.clone(),
            user: user.clone(),
        })
    }

    /// Streams `user` has open now.
    pub fn open_for(&self, user: &UserId) -> usize {
        let map = self.shard(user).lock().unwrap_or_else(|e| e.into_inner());
        map.get(user).copied().unwrap_or(0)
    }

    /// Free slots in all.
    pub fn free(&self) -> usize {
        self.max_total
            .saturating_sub(self.total.load(Ordering::Acquire))
    }
}

/// One open stream; gives its slots back when dropped.
#[derive(Debug)]
pub struct StreamPermit {
    limits: Arc<StreamLimits>,
    user: UserId,
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        let mut map = self
            .limits
            .shard(&self.user)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(open) = map.get_mut(&self.user) {
            *open -= 1;
            if *open == 0 {
                map.remove(&self.user);
            }
        }
        drop(map);
        give_slot(&self.limits.total);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn user(id: &str) -> UserId {
        UserId::parse(id).unwrap()
    }

    #[test]
    fn client_keys_are_ipv4_addresses_or_ipv6_slash_64s() {
        assert_eq!(
            ClientKey::of(ip("10.0.0.1")),
            ClientKey::of(ip("::ffff:10.0.0.1"))
        );
        assert_ne!(ClientKey::of(ip("10.0.0.1")), ClientKey::of(ip("10.0.0.2")));
        assert_eq!(
            ClientKey::of(ip("2001:db8:1:2::1")),
            ClientKey::of(ip("2001:db8:1:2:ffff::9"))
        );
        assert_ne!(
            ClientKey::of(ip("2001:db8:1:2::1")),
            ClientKey::of(ip("2001:db8:1:3::1"))
        );
    }

    #[test]
    fn connections_are_capped_per_address_and_in_all() {
        let limits = ConnLimits::new(5, 2);
        let a1 = limits.admit(ip("10.0.0.1"), false).unwrap();
        let _a2 = limits.admit(ip("10.0.0.1"), false).unwrap();
        assert_eq!(
            limits.admit(ip("10.0.0.1"), false).unwrap_err(),
            ConnRefused::PerAddress(2)
        );
        assert_eq!(limits.open(), 2, "a refusal takes nothing");
        let _b = limits.admit(ip("10.0.0.2"), false).unwrap();
        // A trusted proxy is not capped per address, only in all.
        let _p1 = limits.admit(ip("10.0.0.9"), true).unwrap();
        let _p2 = limits.admit(ip("10.0.0.9"), true).unwrap();
        assert_eq!(limits.open(), 5);
        let err = limits.admit(ip("10.0.0.3"), false).unwrap_err();
        assert_eq!(err, ConnRefused::Total(5));
        assert!(err.to_string().contains("max_connections"), "{err}");
        drop(a1);
        assert_eq!(limits.open(), 4);
        let _a3 = limits.admit(ip("10.0.0.1"), false).unwrap();
        // Every permit dropped: nothing is left behind.
        drop((_a2, _b, _p1, _p2, _a3));
        assert_eq!(limits.open(), 0);
        assert!(limits.per_client.lock().unwrap().is_empty());
    }

    #[test]
    fn an_exempted_connection_frees_its_address_slot_but_not_the_total() {
        let limits = ConnLimits::new(3, 1);
        let peer = limits.admit(ip("10.0.0.5"), false).unwrap();
        assert!(limits.admit(ip("10.0.0.5"), false).is_err());
        peer.exempt();
        peer.exempt(); // twice is once
        let second = limits.admit(ip("10.0.0.5"), false).unwrap();
        assert_eq!(limits.open(), 2);
        drop(peer);
        assert_eq!(limits.open(), 1);
        assert!(
            limits.admit(ip("10.0.0.5"), false).is_err(),
            "the second still holds the address's slot"
        );
        drop(second);
        assert!(limits.per_client.lock().unwrap().is_empty());
        assert_eq!(limits.open(), 0);
    }

    #[test]
    fn streams_are_capped_per_user_and_in_all() {
        let limits = StreamLimits::new(7, 3);
        let (alice, bob) = (user("alice"), user("bob"));
        let alices: Vec<_> = (0..3).map(|_| limits.acquire(&alice).unwrap()).collect();
        let err = limits.acquire(&alice).unwrap_err();
        assert_eq!(
            err,
            StreamRefused::PerUser {
                user: alice.clone(),
                max: 3
            }
        );
        assert!(err.to_string().contains("max_upgrades_per_user"), "{err}");
        // Alice's cap does not touch bob.
        let bobs: Vec<_> = (0..3).map(|_| limits.acquire(&bob).unwrap()).collect();
        assert_eq!((limits.open_for(&alice), limits.open_for(&bob)), (3, 3));
        let _carol = limits.acquire(&user("carol")).unwrap();
        assert_eq!(limits.free(), 0);
        assert_eq!(
            limits.acquire(&user("dave")).unwrap_err(),
            StreamRefused::Total(7)
        );
        assert_eq!(limits.open_for(&user("dave")), 0, "a refusal takes nothing");
        drop(alices);
        assert_eq!((limits.open_for(&alice), limits.free()), (0, 3));
        drop((bobs, _carol));
        assert_eq!(limits.free(), 7);
        assert!(limits.per_user.iter().all(|s| s.lock().unwrap().is_empty()));
        let none = StreamLimits::new(7, 0);
        assert!(matches!(
            none.acquire(&alice),
            Err(StreamRefused::PerUser { max: 0, .. })
        ));
    }
}
