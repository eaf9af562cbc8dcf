//! Removing what gone shims and gone berths left in the hierarchies: the
//! instance cgroups no live shim owns (their processes killed first when
//! the shim is dead), and a gone berth's parents once they hold nothing.

use std::collections::{BTreeSet, HashSet};
use std::fs;
use std::io;
use std::path::PathBuf;

use super::{InstanceCgroup, Parents, parse_procs};

impl Parents {
    /// Whether any process lives in a cgroup under these parents: an
    /// instance of their berth runs (or is frozen). A directory that
    /// cannot be read counts as holding one.
    pub fn hold_processes(&self) -> bool {
        self.dirs().into_iter().any(|parent| {
            let entries = match fs::read_dir(parent) {
                Ok(entries) => entries,
                Err(e) => return e.kind() != io::ErrorKind::NotFound,
            };
            entries
                .filter_map(Result::ok)
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .any(|leaf| {
                    fs::read_to_string(leaf.path().join("cgroup.procs"))
                        .map_or(true, |procs| !parse_procs(&procs).is_empty())
                })
        })
    }

    /// Removes the parents and the empty instance cgroups under them, once
    /// their berth has no instance left ([`Parents::hold_processes`]).
    /// Returns what could not be removed.
    pub fn remove(&self) -> Vec<(PathBuf, io::Error)> {
        let mut failed = Vec::new();
        for parent in self.dirs() {
            let leaves = fs::read_dir(parent).into_iter().flatten().flatten();
            let leaves = leaves.filter(|e| e.file_type().is_ok_and(|t| t.is_dir()));
            for dir in leaves.map(|e| e.path()).chain([parent.to_owned()]) {
                match fs::remove_dir(&dir) {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => failed.push((dir, e)),
                    _ => {}
                }
            }
        }
        failed
    }
}

/// The shim pid in an instance cgroup's leaf name
/// (`<instance>.<role>.<shim pid>`, see the shim's `start`).
pub fn shim_pid_of_leaf(leaf: &str) -> Option<u32> {
    leaf.rsplit_once('.')?.1.parse().ok()
}

/// Removes the instance cgroups under `parents` that are not in `keep`
/// (leaf names): those of shims killed before they could clean up. The
/// processes of such a leaf whose shim is gone (`shim_alive` says no) are
/// killed first: the shim's death sends its program SIGKILL, but a
/// program frozen in a v1 freezer receives it only once thawed, so it
/// would otherwise stay frozen for ever. A cgroup that still holds
/// processes cannot be removed and is reported.
pub fn remove_stale(
    parents: &Parents,
    keep: &HashSet<String>,
    shim_alive: impl Fn(u32) -> bool,
) -> Vec<(PathBuf, io::Error)> {
    // Sets, not lists: a node of thousands has thousands of leaves under
    // each parent.
    let mut stale: BTreeSet<String> = BTreeSet::new();
    for parent in parents.dirs() {
        let Ok(entries) = fs::read_dir(parent) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if keep.contains(&name)
                || stale.contains(&name)
                || !entry.file_type().is_ok_and(|t| t.is_dir())
            {
                continue;
            }
            stale.insert(name);
        }
    }
    stale
        .iter()
        .flat_map(|leaf| remove_stale_leaf(parents, leaf, &shim_alive))
        .collect()
}

/// Removes one instance cgroup of [`remove_stale`]'s, killing its
/// processes first when its shim is gone.
pub fn remove_stale_leaf(
    parents: &Parents,
    leaf: &str,
    shim_alive: impl Fn(u32) -> bool,
) -> Vec<(PathBuf, io::Error)> {
    let cgroup = InstanceCgroup::new(parents.clone(), leaf.to_owned());
    let orphaned = shim_pid_of_leaf(leaf).is_some_and(|pid| !shim_alive(pid));
    match cgroup.freezer().filter(|f| orphaned && f.dir.is_dir()) {
        Some(freezer) => match freezer.kill_all() {
            // Dying processes keep a cgroup busy for a moment.
            Ok(()) => cgroup.remove(),
            Err(e) => vec![(freezer.dir.clone(), io::Error::other(e.to_string()))],
        },
        None => cgroup
            .dirs()
            .into_iter()
            .filter_map(|dir| match fs::remove_dir(&dir) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Some((dir, e)),
                _ => None,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shim_pid_is_read_from_a_leaf_name() {
        assert_eq!(shim_pid_of_leaf("alice.main.4242"), Some(4242));
        assert_eq!(shim_pid_of_leaf("u.x.main.77"), Some(77));
        assert_eq!(shim_pid_of_leaf("berth-supervisor"), None);
    }
}
