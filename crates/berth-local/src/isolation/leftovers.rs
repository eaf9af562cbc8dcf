//! What a berth leaves in the kernel, and when it goes.
//!
//! A berth at `user` or `sandbox` owns an nftables table (see `guard`)
//! and cgroup parents (see `cgroup`). Both outlive the berth on purpose
//! while any of its instances runs: an instance adopted after a restart
//! is never unguarded. Once none runs they only cost: every packet of the
//! host passes every berth table's output chain. So:
//!
//! * a berth that stops with no instance left removes its own
//!   ([`remove_own`]);
//! * a berth at start removes those of every other berth that is gone
//!   (its data dir no longer exists, or no live process holds its lock)
//!   and left no instance behind ([`sweep`]). A table names its data dir
//!   in its comment; one without (made before berth wrote comments, or for
//!   a path nft cannot quote) is left alone, as are leftovers berth cannot
//!   inspect.

use std::path::{Path, PathBuf};

use super::cgroup::{self, Parents};
use super::guard::{Guard, GuardError};

/// Whether another berth's table and cgroup parents are leftovers: its
/// berth is gone and no instance of it runs.
pub(crate) fn is_leftover(berth_alive: bool, instances_left: bool) -> bool {
    !berth_alive && !instances_left
}

/// Removes this berth's table and cgroup parents when no instance of it
/// runs any more (`runs_left`: the runs it still follows or has found).
pub(crate) async fn remove_own(guard: &Guard, parents: Option<&Parents>, runs_left: usize) {
    let instances_left = runs_left > 0 || parents.is_some_and(Parents::hold_processes);
    if instances_left {
        return;
    }
    match guard.remove().await {
        Ok(()) => {
            tracing::info!(table = %guard.table(), "no instance left: removed the guard's table")
        }
        Err(e) => tracing::warn!(error = %e, "cannot remove the guard's table"),
    }
    if let Some(parents) = parents {
        report(parents.remove());
    }
}

/// Removes the leftovers of other berths on this host (see the module
/// docs). `own_table` is this berth's; `in_use` tells whether a live
/// process holds a data dir's lock. Returns the tables removed.
pub(crate) async fn sweep(
    nft: &Path,
    own_table: &str,
    in_use: &(dyn Fn(&Path) -> bool + Sync),
) -> Result<Vec<String>, GuardError> {
    let layout = cgroup::detect_host().ok();
    let mut removed = Vec::new();
    for table in Guard::list_tables(nft).await? {
        if table == own_table {
            continue;
        }
        // A table another berth removes meanwhile cannot be listed.
        let listed = match Guard::listed(nft, &table).await {
            Ok(Some(listed)) => listed,
            Ok(None) => continue,
            Err(e) => {
                tracing::debug!(%table, error = %e, "cannot read a berth table's data dir");
                continue;
            }
        };
        // Without cgroups there is no telling whether its instances run.
        let Some(parents) = layout
            .as_ref()
            .map(|l| l.parents(table.trim_start_matches("berth_")))
        else {
            continue;
        };
        let data_dir = &listed.data_dir;
        let berth_alive = || data_dir.exists() && in_use(data_dir);
        if !is_leftover(berth_alive(), parents.hold_processes()) {
            continue;
        }
        // A berth starting there now takes the lock, then makes its
        // cgroup parents, then its table again (a new handle): the removal
        // by handle spares that table, and the second look at the lock
        // spares those parents.
        if let Err(e) = Guard::remove_listed(nft, &table, listed.handle).await {
            tracing::debug!(%table, error = %e, "a gone berth's table changed before its removal");
            continue;
        }
        tracing::info!(%table, data_dir = %data_dir.display(), "removed a gone berth's leftover table");
        if !berth_alive() {
            report(parents.remove());
        }
        removed.push(table);
    }
    Ok(removed)
}

fn report(failed: Vec<(PathBuf, std::io::Error)>) {
    for (dir, e) in failed {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot remove a cgroup parent");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_gone_berth_with_no_instance_leaves_leftovers() {
        assert!(is_leftover(false, false));
        assert!(!is_leftover(true, false), "a live berth with no instance");
        assert!(!is_leftover(false, true), "instances wait to be adopted");
        assert!(!is_leftover(true, true));
    }
}
