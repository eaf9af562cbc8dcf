//! Per-user state on this node: one [`Slot`] per user, created on first use
//! and kept, holding the user's main and watchdog [`Entry`] and the
//! per-user locks. The hot path (`endpoint_for`, `touch`) never takes the
//! async locks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use berth_core::policy::supervision::StopKind;
use berth_core::{Endpoint, Epoch, Instance, InstanceEvent, Role, Slug, UserId};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// One instance this node supervises (or last supervised, once terminal).
pub(crate) struct Entry {
    pub instance: Instance,
    /// Where it listens, as its runtime said (the route once running).
    pub endpoint: Option<Endpoint>,
    /// Asks its driver to stop it; a fence replaces a requested stop.
    stop: watch::Sender<Option<StopKind>>,
    /// Its driver; taken by whoever waits for a stop.
    pub task: Option<JoinHandle<()>>,
}

impl Entry {
    /// A new entry, and the receiving end of its stop requests (for its
    /// driver).
    pub fn new(
        instance: Instance,
        endpoint: Option<Endpoint>,
    ) -> (Entry, watch::Receiver<Option<StopKind>>) {
        let (stop, requests) = watch::channel(None);
        (
            Entry {
                instance,
                endpoint,
                stop,
                task: None,
            },
            requests,
        )
    }

    /// Asks the driver to stop the instance. A fence overrides a stop
    /// already asked for; otherwise the first reason stays.
    pub fn request_stop(&self, kind: StopKind) {
        self.stop.send_if_modified(|current| match current {
            Some(StopKind::Fenced) => false,
            Some(_) if kind != StopKind::Fenced => false,
            _ => {
                *current = Some(kind);
                true
            }
        });
    }
}

#[derive(Default)]
pub(crate) struct SlotState {
    pub main: Option<Entry>,
    pub watchdog: Option<Entry>,
}

impl SlotState {
    pub fn get(&self, role: Role) -> Option<&Entry> {
        match role {
            Role::Main => self.main.as_ref(),
            Role::Watchdog => self.watchdog.as_ref(),
        }
    }
    pub fn get_mut(&mut self, role: Role) -> &mut Option<Entry> {
        match role {
            Role::Main => &mut self.main,
            Role::Watchdog => &mut self.watchdog,
        }
    }
    /// The entry of `role` if it is still instance `id`.
    pub fn current(&mut self, role: Role, id: &str) -> Option<&mut Entry> {
        self.get_mut(role).as_mut().filter(|e| e.instance.id == id)
    }
}

/// Everything about one user on this node.
pub(crate) struct Slot {
    pub user: UserId,
    pub slug: Slug,
    /// Serialises lifecycle operations (launch, stop, restart) of this user.
    /// Never taken on the proxy's hot path. Shared so that adoption can
    /// hold it from before berth serves until the user is adopted.
    pub lifecycle: Arc<tokio::sync::Mutex<()>>,
    /// Keeps two watchdog starts (explicit and after a crash) apart.
    pub watchdog_lock: tokio::sync::Mutex<()>,
    state: Mutex<SlotState>,
    /// Last activity, written by `touch` without any lock.
    last_active: AtomicI64,
    /// The last activity time already written to the store.
    flushed_active: AtomicI64,
    /// The main is frozen for hibernation (one of the two reasons to be
    /// frozen; the fencer keeps the other). Read on the hot path with
    /// `last_active`, both `SeqCst`: a request touches, then reads this;
    /// the hibernator sets this, then reads `last_active`. So either the
    /// request sees it and resumes, or the hibernator sees the request and
    /// backs off; a request can never reach a program frozen under it.
    hibernated: AtomicBool,
    /// Found running at start and not adopted yet: adoption holds the
    /// lifecycle lock, and a launch answers "starting" instead of waiting
    /// for it.
    awaiting_adoption: AtomicBool,
    /// The main's current record, for `wait_for_ready`.
    pub main_watch: watch::Sender<Option<Instance>>,
    /// The last event published about the main, a launch's `queued` and
    /// `spawning` included: where a progress stream opened now begins.
    last_main_event: Mutex<Option<InstanceEvent>>,
}

impl Slot {
    pub fn lock(&self) -> MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Asks the live main's driver to fence it (kill it, frozen or not,
    /// record "lease lost: fenced", forget the lease without releasing
    /// it), if it runs `epoch` (any epoch when `None`). Whether it asked.
    pub fn request_fence(&self, epoch: Option<Epoch>) -> bool {
        let state = self.lock();
        match state.main.as_ref() {
            Some(entry)
                if entry.instance.status.is_live()
                    && epoch.is_none_or(|e| entry.instance.epoch == e) =>
            {
                entry.request_stop(StopKind::Fenced);
                true
            }
            _ => false,
        }
    }

    pub fn record(&self, role: Role) -> Option<Instance> {
        self.lock().get(role).map(|e| e.instance.clone())
    }

    pub fn live_record(&self, role: Role) -> Option<Instance> {
        self.record(role).filter(|i| i.status.is_live())
    }

    pub fn touch(&self, at: i64) {
        self.last_active.fetch_max(at, Ordering::SeqCst);
    }

    pub fn last_active(&self) -> i64 {
        self.last_active.load(Ordering::SeqCst)
    }

    pub fn is_hibernated(&self) -> bool {
        self.hibernated.load(Ordering::SeqCst)
    }

    pub fn set_hibernated(&self, hibernated: bool) {
        self.hibernated.store(hibernated, Ordering::SeqCst);
    }

    pub fn awaits_adoption(&self) -> bool {
        self.awaiting_adoption.load(Ordering::SeqCst)
    }

    pub fn set_awaiting_adoption(&self, awaiting: bool) {
        self.awaiting_adoption.store(awaiting, Ordering::SeqCst);
    }

    /// Activity newer than the last flush, if any.
    pub fn unflushed(&self) -> Option<i64> {
        let t = self.last_active();
        (t > self.flushed_active.load(Ordering::Relaxed)).then_some(t)
    }

    pub fn flushed(&self, at: i64) {
        self.flushed_active.fetch_max(at, Ordering::Relaxed);
    }

    pub fn last_main_event(&self) -> Option<InstanceEvent> {
        let last = self
            .last_main_event
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        last.clone()
    }

    pub fn set_last_main_event(&self, event: InstanceEvent) {
        let mut last = self
            .last_main_event
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *last = Some(event);
    }
}

/// Every user this node has seen.
#[derive(Default)]
pub(crate) struct Users {
    slots: RwLock<HashMap<UserId, Arc<Slot>>>,
}

impl Users {
    /// The slot of `user`, made with `slug` (the recorded one) unless it
    /// exists already.
    pub fn insert(&self, user: &UserId, slug: Slug) -> Arc<Slot> {
        let mut slots = self.slots.write().unwrap_or_else(PoisonError::into_inner);
        slots
            .entry(user.clone())
            .or_insert_with(|| {
                Arc::new(Slot {
                    user: user.clone(),
                    slug,
                    lifecycle: Arc::new(tokio::sync::Mutex::new(())),
                    watchdog_lock: tokio::sync::Mutex::new(()),
                    state: Mutex::new(SlotState::default()),
                    last_active: AtomicI64::new(0),
                    flushed_active: AtomicI64::new(0),
                    hibernated: AtomicBool::new(false),
                    awaiting_adoption: AtomicBool::new(false),
                    main_watch: watch::channel(None).0,
                    last_main_event: Mutex::new(None),
                })
            })
            .clone()
    }

    pub fn existing(&self, user: &UserId) -> Option<Arc<Slot>> {
        let slots = self.slots.read().unwrap_or_else(PoisonError::into_inner);
        slots.get(user).cloned()
    }

    pub fn all(&self) -> Vec<Arc<Slot>> {
        let slots = self.slots.read().unwrap_or_else(PoisonError::into_inner);
        slots.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fence_overrides_a_requested_stop_and_nothing_overrides_a_fence() {
        let instance: Instance = serde_json::from_value(serde_json::json!({
            "id": "i", "user": "alice", "role": "main", "status": "running",
            "node": "n", "epoch": 1, "port": null, "pid": null,
            "folder": "", "started_at": 0, "ready": true, "restarts": 0,
            "last_error": null, "exit_code": null, "last_active": 0
        }))
        .unwrap();
        let (entry, mut requests) = Entry::new(instance, None);
        entry.request_stop(StopKind::Requested("stop"));
        entry.request_stop(StopKind::Requested("idle"));
        assert_eq!(
            *requests.borrow_and_update(),
            Some(StopKind::Requested("stop"))
        );
        entry.request_stop(StopKind::Fenced);
        assert_eq!(*requests.borrow_and_update(), Some(StopKind::Fenced));
        entry.request_stop(StopKind::Requested("stop"));
        assert!(!requests.has_changed().unwrap());
    }
}
