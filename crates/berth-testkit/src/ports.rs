//! Port blocks for the berths a test process starts: every block is the
//! process's alone, so tests running at once never race for a port, and
//! none lies in the kernel's ephemeral range, where any outgoing
//! connection of the host (a test's client, a database driver) may take
//! a port a berth is about to hand out.

use std::sync::Mutex;

/// The ports handed out, below and above the default ephemeral range
/// (32768–60999).
const REGIONS: [(u16, u16); 2] = [(20_000, 32_767), (61_000, 65_535)];

/// The first port of a block of `len` ports that no other block of this
/// test process shares. Blocks are never handed out twice: a berth's
/// instances may outlive the test that started it for a moment.
///
/// # Panics
///
/// When the process has handed out every port of [`REGIONS`]: a test
/// process that needs more must ask for smaller blocks.
pub fn port_block(len: u16) -> u16 {
    static NEXT: Mutex<(usize, u16)> = Mutex::new((0, REGIONS[0].0));
    let mut next = NEXT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    loop {
        let (region, first) = *next;
        let Some(&(_, last)) = REGIONS.get(region) else {
            panic!("this test process has used every port block ({REGIONS:?})");
        };
        match first.checked_add(len - 1).filter(|end| *end <= last) {
            Some(end) => {
                *next = match end.checked_add(1) {
                    Some(after) if after <= last => (region, after),
                    _ => (region + 1, REGIONS.get(region + 1).map_or(0, |r| r.0)),
                };
                return first;
            }
            None => *next = (region + 1, REGIONS.get(region + 1).map_or(0, |r| r.0)),
        }
    }
}

/// The block of `len` ports for `key`: the same key gets the same block
/// again (a node restarted with the same config keeps its ports), any
/// other key a block of its own from [`port_block`].
pub fn port_block_for(key: &str, len: u16) -> u16 {
    static KEYS: Mutex<Vec<(String, u16)>> = Mutex::new(Vec::new());
    let mut keys = KEYS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, first)) = keys.iter().find(|(k, _)| k == key) {
        return *first;
    }
    let first = port_block(len);
    keys.push((key.to_owned(), first));
    first
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_never_overlap_and_skip_the_ephemeral_range() {
        let mut taken: Vec<(u16, u16)> = Vec::new();
        for len in [20, 40, 150, 10, 20] {
            let first = port_block(len);
            let last = first + (len - 1);
            assert!(
                REGIONS.iter().any(|&(a, b)| a <= first && last <= b),
                "{first}-{last}"
            );
            assert!(taken.iter().all(|&(a, b)| last < a || b < first));
            taken.push((first, last));
        }
        assert_eq!(port_block_for("a 1", 20), port_block_for("a 1", 20));
        assert_ne!(port_block_for("a 1", 20), port_block_for("a 2", 20));
    }
}
