//! Re-attachment at start (design §4.7): finds the shims a previous berth
//! left running, checks each against the store and acts on the plan made
//! by `reconcile`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use berth_core::{Epoch, Instance, InstanceStatus, Role, Slug, UserId};
use berth_store::{ClaimOutcome, InstanceFilter};

use crate::inner::{Inner, Live, UserSlot};
use crate::reconcile::{self, Action, Found};
use crate::shim::{ShimCommand, ShimHandle};
use crate::spawner::LocalError;
use crate::supervisor::{self, FENCED_ERROR, Start};

/// Shim state files under `<data_dir>/run/*/`, attached to when alive.
async fn scan(run_dir: &Path) -> (Vec<Found>, Vec<Option<ShimHandle>>) {
    let mut found = Vec::new();
    let mut handles = Vec::new();
    let Ok(entries) = std::fs::read_dir(run_dir) else {
        return (found, handles);
    };
    let mut dirs: Vec<(String, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| Some((e.file_name().into_string().ok()?, e.path())))
        .collect();
    dirs.sort();
    for (slug, dir) in dirs {
        for role in [Role::Main, Role::Watchdog] {
            let path = dir.join(format!("{}.json", role.as_str()));
            if !path.exists() {
                continue;
            }
            let (alive, state, handle) = match ShimHandle::attach(&path).await {
                Ok((handle, state)) => (true, Some(state), Some(handle)),
                Err(_) => (false, ShimHandle::read_state(&path).ok(), None),
            };
            found.push(Found {
                dir_slug: slug.clone(),
                role,
                alive,
                state,
            });
            handles.push(handle);
        }
    }
    (found, handles)
}

impl Inner {
    /// Removes instance cgroups that no adopted instance uses (their shims
    /// were killed before they could remove them). Called once re-attached.
    pub(crate) fn remove_stale_cgroups(&self) {
        let Some(parents) = self.isolator.as_ref().and_then(|i| i.cgroups.as_ref()) else {
            return;
        };
        let mut keep = Vec::new();
        for slot in self.all_slots() {
            for role in [Role::Main, Role::Watchdog] {
                if slot.live_record(role).is_none() {
                    continue;
                }
                if let Ok(state) = ShimHandle::read_state(&slot.paths.state_file(role)) {
                    keep.extend(
                        state
                            .cgroup
                            .iter()
                            .filter_map(|d| Some(d.file_name()?.to_string_lossy().into_owned())),
                    );
                }
            }
        }
        for (dir, e) in crate::isolation::cgroup::remove_stale(parents, &keep) {
            tracing::warn!(dir = %dir.display(), error = %e, "a stale instance cgroup remains");
        }
    }

    pub(crate) async fn reattach(self: &Arc<Self>) -> Result<(), LocalError> {
        let filter = InstanceFilter {
            node: Some(self.node().to_owned()),
            ..InstanceFilter::default()
        };
        let records = self.store.list_instances(&filter).await?;
        let held: HashMap<UserId, Epoch> = self
            .store
            .leases_held_by(self.node())
            .await?
            .into_iter()
            .map(|l| (l.user, l.epoch))
            .collect();
        // A live instance's shim is in the run directory of its user's
        // recorded slug; a user recorded by no earlier berth gets one now
        // (keeping an earlier slug's data root, see `recorded_slug`).
        let mut slugs: HashMap<UserId, Slug> = HashMap::new();
        for record in records.iter().filter(|r| r.status.is_live()) {
            if !slugs.contains_key(&record.user) {
                let slug = self.recorded_slug(&record.user).await?;
                slugs.insert(record.user.clone(), slug);
            }
        }
        let run_dir = self.config.data_dir.join("run");
        let (found, mut handles) = scan(&run_dir).await;
        for action in reconcile::plan(&found, &records, &slugs) {
            match action {
                Action::Adopt { found: i, record } => {
                    let Some(handle) = handles.get_mut(i).and_then(Option::take) else {
                        continue;
                    };
                    let state = found[i].state.clone();
                    let token = state.as_ref().and_then(|s| s.token.clone());
                    let shim_ready = state.as_ref().is_some_and(|s| s.ready);
                    let shim_pid = state.as_ref().map(|s| s.shim_pid);
                    tracing::info!(user = %record.user, role = %record.role, pid = ?record.pid,
                        "re-attached to a running instance");
                    self.adopt(record, handle, shim_pid, token, shim_ready, &held)
                        .await;
                }
                Action::KillOrphan { found: i, reason } => {
                    let f = &found[i];
                    tracing::warn!(dir = %f.dir_slug, role = %f.role, %reason,
                        "stopping a shim with no matching instance record");
                    if let Some(handle) = handles.get_mut(i).and_then(Option::take) {
                        if let Err(e) = handle.control().send(ShimCommand::Kill).await {
                            tracing::warn!(dir = %f.dir_slug, error = %e, "could not stop the orphan shim");
                        }
                    }
                }
                Action::CrashedWhileAway {
                    record,
                    exit,
                    stderr_tail,
                } => {
                    tracing::warn!(user = %record.user, role = %record.role,
                        "instance ended while berth was away");
                    self.recover_crashed(record, exit, stderr_tail, &held).await;
                }
                Action::RemoveStale { found: i } => {
                    let f = &found[i];
                    let dir = run_dir.join(&f.dir_slug);
                    let _ = std::fs::remove_file(dir.join(format!("{}.json", f.role.as_str())));
                    let _ = std::fs::remove_file(dir.join(format!("{}.sock", f.role.as_str())));
                }
            }
        }
        Ok(())
    }

    /// Makes sure this node holds the main lease of `record`, adopting the
    /// held one or claiming it again (a lease that ran out while berth was
    /// away and nobody took). `None`: another node holds it.
    async fn regain_lease(
        &self,
        record: &Instance,
        held: &HashMap<UserId, Epoch>,
    ) -> Option<Epoch> {
        if held.get(&record.user) == Some(&record.epoch) {
            self.lease.adopt(record.user.clone(), record.epoch);
            return Some(record.epoch);
        }
        match self.lease.acquire(&record.user).await {
            Ok(ClaimOutcome::Claimed { epoch }) => Some(epoch),
            Ok(ClaimOutcome::Busy { holder, .. }) => {
                tracing::warn!(user = %record.user, %holder, "the lease moved to another node while berth was away");
                None
            }
            Err(e) => {
                tracing::warn!(user = %record.user, error = %e, "could not re-claim the lease");
                None
            }
        }
    }

    /// The slot of a live record's user (its slug was recorded before the
    /// plan was made, so this asks the store nothing new) and its patch.
    async fn prepare_slot(&self, record: &Instance) -> Option<(Arc<UserSlot>, Option<PathBuf>)> {
        let slot = match self.slot(&record.user).await {
            Ok(slot) => slot,
            Err(e) => {
                tracing::warn!(user = %record.user, error = %e, "cannot prepare the user's slot");
                return None;
            }
        };
        slot.touch(record.last_active);
        slot.flushed_active
            .fetch_max(record.last_active, Ordering::Relaxed);
        let patch = slot.paths.patch_file(&self.config.patch_ext);
        let patch = patch.exists().then_some(patch);
        Some((slot, patch))
    }

    /// At start, records the earlier slug of every user whose lease this
    /// node holds or held last (the sticky holder hint) and whose data root
    /// is still here under that slug, before any node can give them a new
    /// one. Users recorded already are left alone. Best effort: the first
    /// launch of such a user makes the same choice (`recorded_slug`).
    pub(crate) async fn keep_earlier_data_roots(&self) {
        let leases = match self.store.list_leases(false, self.config.lease.ttl()).await {
            Ok(leases) => leases,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list leases to find data roots of earlier slugs");
                return;
            }
        };
        for lease in leases {
            let user = lease.user;
            let legacy = user.legacy_slug();
            if lease.holder.as_deref() != Some(self.node())
                || legacy == user.slug()
                || !self.has_data_root(&legacy).await
            {
                continue;
            }
            if let Err(e) = self.recorded_slug(&user).await {
                tracing::warn!(%user, error = %e, "cannot record the user's slug");
            }
        }
    }

    async fn adopt(
        self: &Arc<Self>,
        mut record: Instance,
        handle: ShimHandle,
        shim_pid: Option<u32>,
        token: Option<String>,
        shim_ready: bool,
        held: &HashMap<UserId, Epoch>,
    ) {
        let Some((slot, patch)) = self.prepare_slot(&record).await else {
            return;
        };
        if record.role == Role::Main {
            let Some(epoch) = self.regain_lease(&record, held).await else {
                if let Err(e) = handle.control().send(ShimCommand::Kill).await {
                    tracing::warn!(user = %record.user, error = %e, "could not fence the instance");
                }
                record.status = InstanceStatus::Stopped;
                record.ready = false;
                record.last_error = Some(FENCED_ERROR.into());
                self.install(&slot, Live::new(record.clone(), patch));
                self.publish(&slot, &record, Some(FENCED_ERROR.into()))
                    .await;
                return;
            };
            record.epoch = epoch;
            if let Some(port) = record.port {
                self.ports.reserve(port);
                // The table was made afresh at start: the instance gets its
                // own port back.
                match self.account(&slot).await {
                    Ok(account) => {
                        if let Err(e) = self.grant_port(account.as_ref(), port).await {
                            tracing::warn!(user = %record.user, error = %e,
                                "could not give an adopted instance its port back");
                        }
                    }
                    Err(e) => tracing::warn!(user = %record.user, error = %e,
                        "could not read the account of an adopted instance"),
                }
            }
        }
        if token.is_some() {
            // Before `start` returns, so the open URL can be built at once.
            self.set_token(&record.user, token.clone());
        }
        let mut live = Live::new(record.clone(), patch);
        live.control = Some(handle.control());
        live.shim_pid = shim_pid;
        let stop = live.stop.clone();
        self.install(&slot, live);
        self.publish(&slot, &record, Some("re-attached".into()))
            .await;
        match record.role {
            Role::Main => supervisor::start_main(
                self,
                &slot,
                &record.id,
                stop,
                Start::Attached {
                    handle,
                    spawned_at: None,
                    token,
                    shim_ready,
                },
            ),
            Role::Watchdog => supervisor::start_watchdog(self, &slot, &record.id, stop, handle),
        }
    }

    async fn recover_crashed(
        self: &Arc<Self>,
        mut record: Instance,
        exit: Option<crate::shim::ExitInfo>,
        stderr_tail: String,
        held: &HashMap<UserId, Epoch>,
    ) {
        if record.role == Role::Watchdog {
            // Watchdogs are never restarted: forget the record.
            if let Err(e) = self
                .store
                .delete_instance(&record.user, Role::Watchdog)
                .await
            {
                tracing::warn!(user = %record.user, error = %e, "could not delete the watchdog record");
            }
            return;
        }
        let Some((slot, patch)) = self.prepare_slot(&record).await else {
            return;
        };
        let Some(epoch) = self.regain_lease(&record, held).await else {
            record.status = InstanceStatus::Stopped;
            record.ready = false;
            record.last_error = Some(FENCED_ERROR.into());
            self.install(&slot, Live::new(record.clone(), patch));
            self.publish(&slot, &record, Some(FENCED_ERROR.into()))
                .await;
            return;
        };
        record.epoch = epoch;
        if let Some(port) = record.port {
            self.ports.reserve(port);
        }
        let already_counted = record.status == InstanceStatus::Crashed;
        record.ready = false;
        let live = Live::new(record.clone(), patch);
        let stop = live.stop.clone();
        self.install(&slot, live);
        self.refresh_route(&record);
        slot.main_watch.send_replace(Some(record.clone()));
        let start = if already_counted {
            Start::Respawn
        } else {
            Start::Crashed {
                exit,
                stderr_tail,
                note: Some("ended while berth was away".into()),
            }
        };
        supervisor::start_main(self, &slot, &record.id, stop, start);
    }
}
