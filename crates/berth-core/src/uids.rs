//! The host uids instance accounts are allocated from: plain data shared
//! by the store, which allocates them, and the local runtime, which runs
//! programs under them.

/// The host uids instance accounts are allocated from: `first`, `first +
/// 1`, … `first + count - 1`. The gid of an account is its uid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidRange {
    /// The lowest uid of the range.
    pub first: u32,
    /// How many uids it holds.
    pub count: u32,
}

impl UidRange {
    /// The last uid of the range; `None` when the range is empty or runs
    /// past the largest valid uid (`u32::MAX - 1`; `-1` means "no uid").
    pub fn last(&self) -> Option<u32> {
        let last = self.first.checked_add(self.count.checked_sub(1)?)?;
        (last < u32::MAX).then_some(last)
    }

    /// Whether `uid` is in the range; never, when [`UidRange::last`] is
    /// `None`.
    pub fn contains(&self, uid: u32) -> bool {
        self.last()
            .is_some_and(|last| (self.first..=last).contains(&uid))
    }
}
