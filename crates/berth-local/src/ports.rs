//! Instance ports: the choice among the configured range (pure), the
//! in-memory reservations that keep two live instances off one port, and
//! who holds the range's ports (an instance may hold only so many).

use std::collections::{BTreeMap, BTreeSet};
use std::ops::RangeInclusive;
use std::sync::Mutex;

/// Picks a port from `range`: `preferred` first when it is in range and not
/// taken, then the others starting after `cursor` (so a port just given up
/// is not handed out again at once). `is_free` is asked only about ports
/// that are neither reserved nor recorded as used (`taken`), which is asked
/// port by port: a launch costs no copy of every reservation.
pub(crate) fn choose_port(
    range: &RangeInclusive<u16>,
    taken: impl Fn(u16) -> bool,
    preferred: Option<u16>,
    cursor: u16,
    mut is_free: impl FnMut(u16) -> bool,
) -> Option<u16> {
    if let Some(port) = preferred
        && range.contains(&port)
        && !taken(port)
        && is_free(port)
    {
        return Some(port);
    }
    let start = if range.contains(&cursor) {
        cursor
    } else {
        *range.start()
    };
    let after = (u32::from(start) + 1)..=u32::from(*range.end());
    let before = u32::from(*range.start())..=u32::from(start);
    after
        .chain(before)
        .filter_map(|p| u16::try_from(p).ok())
        .filter(|p| Some(*p) != preferred)
        .find(|p| !taken(*p) && is_free(*p))
}

/// The ports of `range` that sockets of each account of `uids` hold
/// (bound, listening or connected), from the text of `/proc/net/tcp` and
/// `/proc/net/tcp6`. The kernel lists each socket with its owner's uid.
pub(crate) fn held_ports(
    tables: &[String],
    range: &RangeInclusive<u16>,
    uids: berth_core::UidRange,
) -> BTreeMap<u32, BTreeSet<u16>> {
    let mut held: BTreeMap<u32, BTreeSet<u16>> = BTreeMap::new();
    for line in tables.iter().flat_map(|t| t.lines()) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(local), Some(uid)) = (fields.get(1), fields.get(7)) else {
            continue;
        };
        let port = local
            .rsplit_once(':')
            .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
        let (Some(port), Ok(uid)) = (port, uid.parse::<u32>()) else {
            continue;
        };
        if range.contains(&port) && uids.contains(uid) {
            held.entry(uid).or_default().insert(port);
        }
    }
    held
}

/// The accounts holding more than `cap` ports, with how many they hold.
pub(crate) fn over_cap(held: &BTreeMap<u32, BTreeSet<u16>>, cap: usize) -> Vec<(u32, usize)> {
    held.iter()
        .filter(|(_, ports)| ports.len() > cap)
        .map(|(uid, ports)| (*uid, ports.len()))
        .collect()
}

/// The accounts of `uids` that hold more than `cap` ports of `range` now.
pub(crate) fn port_hogs(
    range: &RangeInclusive<u16>,
    uids: berth_core::UidRange,
    cap: usize,
) -> Vec<(u32, usize)> {
    let tables: Vec<String> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .collect();
    over_cap(&held_ports(&tables, range, uids), cap)
}

/// True when nothing listens on `127.0.0.1:port` (the bind succeeds).
pub(crate) fn bind_free(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// The ports reserved by this node's live instances.
#[derive(Debug)]
pub(crate) struct PortPool {
    range: RangeInclusive<u16>,
    state: Mutex<PoolState>,
    /// Whether the OS would let a program listen on a port: [`bind_free`]
    /// in production; tests of the reservation logic pass their own.
    is_free: fn(u16) -> bool,
}

#[derive(Debug, Default)]
struct PoolState {
    reserved: BTreeSet<u16>,
    cursor: u16,
}

impl PortPool {
    pub fn new(range: RangeInclusive<u16>) -> Self {
        Self::with_probe(range, bind_free)
    }

    fn with_probe(range: RangeInclusive<u16>, is_free: fn(u16) -> bool) -> Self {
        let cursor = range.end().to_owned();
        Self {
            range,
            is_free,
            state: Mutex::new(PoolState {
                reserved: BTreeSet::new(),
                cursor,
            }),
        }
    }

    pub fn range(&self) -> &RangeInclusive<u16> {
        &self.range
    }

    /// Reserves a free port.
    pub fn allocate(&self, preferred: Option<u16>) -> Option<u16> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let reserved = &state.reserved;
        let port = choose_port(
            &self.range,
            |p| reserved.contains(&p),
            preferred,
            state.cursor,
            self.is_free,
        )?;
        state.reserved.insert(port);
        state.cursor = port;
        Some(port)
    }

    /// Marks `port` as in use by an instance found running (re-attach).
    pub fn reserve(&self, port: u16) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.reserved.insert(port);
    }

    pub fn release(&self, port: u16) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.reserved.remove(&port);
    }

    pub fn capacity(&self) -> u32 {
        u32::from(*self.range.end()).saturating_sub(u32::from(*self.range.start())) + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ports: &[u16]) -> BTreeSet<u16> {
        ports.iter().copied().collect()
    }

    #[test]
    fn prefers_the_previous_port_when_it_is_free() {
        let r = 100..=105;
        assert_eq!(
            choose_port(&r, |p| set(&[]).contains(&p), Some(103), 100, |_| true),
            Some(103)
        );
        assert_eq!(
            choose_port(&r, |p| set(&[103]).contains(&p), Some(103), 100, |_| true),
            Some(101)
        );
        assert_eq!(
            choose_port(&r, |p| set(&[]).contains(&p), Some(103), 100, |p| p != 103),
            Some(101)
        );
        assert_eq!(
            choose_port(&r, |p| set(&[]).contains(&p), Some(7), 100, |_| true),
            Some(101)
        );
    }

    #[test]
    fn round_robins_from_the_cursor_and_wraps() {
        let r = 100..=103;
        assert_eq!(
            choose_port(&r, |p| set(&[]).contains(&p), None, 101, |_| true),
            Some(102)
        );
        assert_eq!(
            choose_port(&r, |p| set(&[]).contains(&p), None, 103, |_| true),
            Some(100)
        );
        assert_eq!(
            choose_port(&r, |p| set(&[100]).contains(&p), None, 103, |_| true),
            Some(101)
        );
        assert_eq!(
            choose_port(&r, |p| set(&[]).contains(&p), None, 9, |_| true),
            Some(101)
        );
    }

    #[test]
    fn none_when_every_port_is_taken_or_busy() {
        let r = 100..=101;
        assert_eq!(
            choose_port(&r, |p| set(&[100]).contains(&p), None, 100, |p| p != 101),
            None
        );
        assert_eq!(
            choose_port(&r, |p| set(&[100, 101]).contains(&p), None, 100, |_| true),
            None
        );
        let single = 65535..=65535;
        assert_eq!(
            choose_port(&single, |_| false, None, 65535, |_| true),
            Some(65535)
        );
    }

    #[test]
    fn ports_of_the_range_are_counted_per_account_of_the_range() {
        let tcp = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:4E20 00000000:0000 0A 00000000:00000000 00:00000000 00000000 200001        0 1 1 0000000000000000 100 0 0 10 0
   1: 0100007F:4E21 00000000:0000 0A 00000000:00000000 00:00000000 00000000 200001        0 2 1 0000000000000000 100 0 0 10 0
   2: 0100007F:4E21 0100007F:9C40 01 00000000:00000000 00:00000000 00000000 200001        0 3 1 0000000000000000 100 0 0 10 0
   3: 0100007F:4E22 00000000:0000 0A 00000000:00000000 00:00000000 00000000 200002        0 4 1 0000000000000000 100 0 0 10 0
   4: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000 200001        0 5 1 0000000000000000 100 0 0 10 0
   5: 0100007F:4E23 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 6 1 0000000000000000 100 0 0 10 0
".to_owned();
        let tcp6 = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:4E24 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000 200001        0 7 1 0000000000000000 100 0 0 10 0
".to_owned();
        let uids = berth_core::UidRange {
            first: 200_000,
            count: 100,
        };
        let held = held_ports(&[tcp, tcp6], &(20000..=20099), uids);
        // 20000 and 20001 (twice: listening and connected) and 20004 over
        // IPv6; 8000 lies outside the range; root is not an account.
        assert_eq!(held[&200_001], set(&[20000, 20001, 20004]));
        assert_eq!(held[&200_002], set(&[20002]));
        assert_eq!(held.len(), 2);
        assert_eq!(over_cap(&held, 2), vec![(200_001, 3)]);
        assert!(over_cap(&held, 3).is_empty());
        assert!(held_ports(&["garbage\n\n".to_owned()], &(0..=65535), uids).is_empty());
    }

    #[test]
    fn a_port_with_a_listener_is_not_free() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(!bind_free(port));
    }

    #[test]
    fn the_pool_never_hands_out_a_port_twice() {
        // Real ports here could be taken by any other process's outgoing
        // connection; the reservation logic is what is under test.
        let pool = PortPool::with_probe(40000..=40001, |_| true);
        let a = pool.allocate(None);
        let b = pool.allocate(None);
        assert!(a.is_some() && b.is_some() && a != b);
        assert_eq!(pool.allocate(None), None);
        pool.release(a.unwrap());
        assert_eq!(pool.allocate(None), a);
        assert_eq!(pool.capacity(), 2);
    }
}
