//! Port blocks for the berths a test process starts: every block is the
//! process's alone, so tests running at once never race for a port, and
//! none lies in the kernel's ephemeral range, where any outgoing
//! connection of the host (a test's client, a database driver) may take
//! a port a berth is about to hand out.

use std::sync::{Mutex, OnceLock};

/// The ports handed out, below and above the default ephemeral range
/// (32768–60999).
const REGIONS: [(u16, u16); 2] = [(20_000, 32_767), (61_000, 65_535)];

/// Names the one region a test process hands out instead of [`REGIONS`],
/// as `<first>-<last>`: a second test process run beside the suite (a
/// mutation run while `scripts/test` runs) takes ports the suite never
/// does, such as `10000-19999`.
pub const PORTS_ENV: &str = "BERTH_TEST_PORTS";

/// [`REGIONS`], or the region [`PORTS_ENV`] names.
///
/// # Panics
///
/// When [`PORTS_ENV`] is set to anything but `<first>-<last>`.
fn regions() -> &'static [(u16, u16)] {
    static CHOSEN: OnceLock<Vec<(u16, u16)>> = OnceLock::new();
    CHOSEN.get_or_init(|| match std::env::var(PORTS_ENV) {
        Ok(value) => vec![parse_region(&value).unwrap_or_else(|| {
            panic!("{PORTS_ENV}={value:?}: expected <first>-<last>, first no more than last")
        })],
        Err(_) => REGIONS.to_vec(),
    })
}

fn parse_region(value: &str) -> Option<(u16, u16)> {
    let (first, last) = value.split_once('-')?;
    let (first, last) = (first.trim().parse().ok()?, last.trim().parse().ok()?);
    (first <= last).then_some((first, last))
}

/// The first port of a block of `len` ports that no other block of this
/// test process shares. Blocks are never handed out twice: a berth's
/// instances may outlive the test that started it for a moment.
///
/// # Panics
///
/// When the process has handed out every port of its regions: a test
/// process that needs more must ask for smaller blocks.
pub fn port_block(len: u16) -> u16 {
    // The region being handed out, and how many of its ports are gone.
    static NEXT: Mutex<(usize, u32)> = Mutex::new((0, 0));
    let regions = regions();
    let mut next = NEXT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    loop {
        let (region, used) = *next;
        let Some(&(first_of, last)) = regions.get(region) else {
            panic!("this test process has used every port block ({regions:?})");
        };
        let first = u32::from(first_of) + used;
        let end = first + u32::from(len) - 1;
        if end <= u32::from(last) {
            *next = (region, used + u32::from(len));
            return u16::try_from(first).expect("a port of its region");
        }
        *next = (region + 1, 0);
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
                regions().iter().any(|&(a, b)| a <= first && last <= b),
                "{first}-{last}"
            );
            assert!(taken.iter().all(|&(a, b)| last < a || b < first));
            taken.push((first, last));
        }
        assert_eq!(port_block_for("a 1", 20), port_block_for("a 1", 20));
        assert_ne!(port_block_for("a 1", 20), port_block_for("a 2", 20));
    }

    #[test]
    fn a_region_is_named_first_to_last() {
        assert_eq!(parse_region("10000-19999"), Some((10_000, 19_999)));
        assert_eq!(parse_region("7-7"), Some((7, 7)));
        assert_eq!(parse_region("19999-10000"), None);
        assert_eq!(parse_region("10000"), None);
        assert_eq!(parse_region("a-b"), None);
        assert_eq!(parse_region("10000-70000"), None);
    }
}
