//! The one place an instance's record is changed and made known: the
//! store first (so whoever is woken by a change finds it recorded), then
//! the proxy's route table, the ready watch, the event feed and the
//! by-status metrics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use berth_core::{Endpoint, Instance, InstanceEvent, InstanceStatus, Role, Stage, UserId};
use berth_store::{InstanceStore, StoreError};
use tokio::sync::broadcast;

use crate::metrics::Metrics;
use crate::users::{Entry, Slot};

/// Capacity of the instance-event broadcast; slow subscribers lag rather
/// than hold up the controller.
const EVENT_CAPACITY: usize = 1024;

pub(crate) struct Publisher {
    store: Arc<dyn InstanceStore>,
    metrics: Metrics,
    /// The proxy's route table: only running, ready mains.
    routes: RwLock<HashMap<UserId, Endpoint>>,
    /// Launch tokens of live mains.
    tokens: RwLock<HashMap<UserId, String>>,
    events: broadcast::Sender<InstanceEvent>,
    /// Live mains on this node (for capacity and the heartbeat's load).
    /// Mains awaiting adoption (`metrics.awaiting_adoption`) are live
    /// here too, though not installed yet.
    live_mains: AtomicU32,
}

impl Publisher {
    pub fn new(store: Arc<dyn InstanceStore>, metrics: Metrics) -> Self {
        Self {
            store,
            metrics,
            routes: RwLock::new(HashMap::new()),
            tokens: RwLock::new(HashMap::new()),
            events: broadcast::channel(EVENT_CAPACITY).0,
            live_mains: AtomicU32::new(0),
        }
    }

    pub fn endpoint_for(&self, user: &UserId) -> Option<Endpoint> {
        let routes = self.routes.read().unwrap_or_else(PoisonError::into_inner);
        routes.get(user).cloned()
    }

    pub fn token(&self, user: &UserId) -> Option<String> {
        let tokens = self.tokens.read().unwrap_or_else(PoisonError::into_inner);
        tokens.get(user).cloned()
    }

    pub fn set_token(&self, user: &UserId, token: Option<String>) {
        let mut tokens = self.tokens.write().unwrap_or_else(PoisonError::into_inner);
        match token {
            Some(t) => tokens.insert(user.clone(), t),
            None => tokens.remove(user),
        };
    }

    pub fn subscribe(&self) -> broadcast::Receiver<InstanceEvent> {
        self.events.subscribe()
    }

    /// Live mains, counting those still awaiting adoption. While a user's
    /// adoption is ending its main may be counted twice, which errs on
    /// the side of refusing a launch at the capacity's edge.
    pub fn live_mains(&self) -> u32 {
        self.live_mains
            .load(Ordering::Relaxed)
            .saturating_add(self.awaiting_adoption())
    }

    pub fn awaiting_adoption(&self) -> u32 {
        u32::try_from(self.metrics.awaiting_adoption.get()).unwrap_or(0)
    }

    /// `n` more users await adoption.
    pub fn adoption_pending(&self, n: usize) {
        self.metrics
            .awaiting_adoption
            .inc_by(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// One user's adoption ended (adopted, recovered, or given up).
    pub fn adoption_ended(&self) {
        self.metrics.awaiting_adoption.dec();
    }

    /// Keeps the by-status gauge and the live-main count in step with one
    /// instance moving from `old` to `new` (`None`: not tracked).
    fn transition(&self, role: Role, old: Option<InstanceStatus>, new: Option<InstanceStatus>) {
        self.metrics.transition(role, old, new);
        if role != Role::Main {
            return;
        }
        let was = old.is_some_and(InstanceStatus::is_live);
        let is = new.is_some_and(InstanceStatus::is_live);
        if is && !was {
            self.live_mains.fetch_add(1, Ordering::Relaxed);
        } else if was && !is {
            let _ = self
                .live_mains
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    Some(n.saturating_sub(1))
                });
        }
    }

    /// Puts `entry` in the slot as the current instance of its role.
    pub fn install(&self, slot: &Slot, entry: Entry) {
        let role = entry.instance.role;
        let new = entry.instance.status;
        let old = {
            let mut state = slot.lock();
            let old = state.get(role).map(|e| e.instance.status);
            *state.get_mut(role) = Some(entry);
            old
        };
        self.transition(role, old, Some(new));
    }

    /// Takes the entry of `role` out of the slot if it is still `id`.
    pub fn remove(&self, slot: &Slot, role: Role, id: &str) {
        let removed = {
            let mut state = slot.lock();
            match state.get(role) {
                Some(e) if e.instance.id == id => state.get_mut(role).take(),
                _ => None,
            }
        };
        if let Some(entry) = removed {
            self.transition(role, Some(entry.instance.status), None);
        }
    }

    /// Applies `change` to the current entry of `role` if it is still
    /// instance `id`, then persists and publishes the result. Returns the
    /// record and what the store said.
    pub async fn modify(
        &self,
        slot: &Slot,
        role: Role,
        id: &str,
        message: Option<String>,
        change: impl FnOnce(&mut Entry),
    ) -> Option<(Instance, Result<(), StoreError>)> {
        let (old, instance, endpoint) = {
            let mut state = slot.lock();
            let entry = state.current(role, id)?;
            let old = entry.instance.status;
            change(entry);
            if entry.instance.status != InstanceStatus::Hibernated {
                entry.instance.hibernated_at = None;
            }
            (old, entry.instance.clone(), entry.endpoint.clone())
        };
        self.transition(role, Some(old), Some(instance.status));
        let stored = self.publish(slot, &instance, endpoint, message).await;
        Some((instance, stored))
    }

    /// Mirrors `instance` everywhere, the store first. A store failure is
    /// logged and returned: memory stays this node's truth.
    pub async fn publish(
        &self,
        slot: &Slot,
        instance: &Instance,
        endpoint: Option<Endpoint>,
        message: Option<String>,
    ) -> Result<(), StoreError> {
        let stored = self.store_record(instance).await;
        if let Err(e) = &stored {
            if matches!(e, StoreError::Fenced { .. }) {
                tracing::warn!(user = %instance.user, error = %e, "instance record refused");
            } else {
                self.metrics.store_errors.inc();
                tracing::warn!(user = %instance.user, role = %instance.role, error = %e,
                    "could not save the instance record");
            }
        }
        self.announce(slot, instance, endpoint, message);
        stored
    }

    /// Writes `instance` to the store (a terminal watchdog's record is
    /// deleted: a watchdog is a one-shot job).
    pub async fn store_record(&self, instance: &Instance) -> Result<(), StoreError> {
        if instance.role == Role::Watchdog && instance.status.is_terminal() {
            self.store
                .delete_instance(&instance.user, Role::Watchdog)
                .await
        } else {
            self.store.put_instance(instance).await
        }
    }

    /// Everything but the store: the route table, the ready watch and the
    /// event feed.
    pub fn announce(
        &self,
        slot: &Slot,
        instance: &Instance,
        endpoint: Option<Endpoint>,
        message: Option<String>,
    ) {
        let endpoint = self.refresh_route(instance, endpoint);
        if instance.role == Role::Main {
            slot.main_watch.send_replace(Some(instance.clone()));
        }
        self.send(
            slot,
            InstanceEvent {
                user: instance.user.clone(),
                role: instance.role,
                status: instance.status,
                ready: instance.ready,
                endpoint,
                message,
                stage: Stage::of(instance.status, instance.ready),
            },
        );
    }

    /// Announces a stage of a main's spawn that changes no record: `queued`
    /// and `spawning` (as `starting`, unreachable), or a launch `failed`
    /// before it made a record (refused for capacity, the breaker or the
    /// lease), with `reason`. Only a main that is not reachable (none,
    /// ended, or crashed) is announced so: the route table, which drops
    /// the route of an unreachable main, loses nothing.
    pub fn announce_stage(&self, slot: &Slot, stage: Stage, reason: Option<String>) {
        let status = match stage {
            Stage::Failed => InstanceStatus::Failed,
            _ => InstanceStatus::Starting,
        };
        self.send(
            slot,
            InstanceEvent {
                user: slot.user.clone(),
                role: Role::Main,
                status,
                ready: false,
                endpoint: None,
                message: reason,
                stage,
            },
        );
    }

    fn send(&self, slot: &Slot, event: InstanceEvent) {
        if event.role == Role::Main {
            slot.set_last_main_event(event.clone());
        }
        let _ = self.events.send(event);
    }

    /// Updates the route table for a main and returns its endpoint, if it
    /// is reachable.
    fn refresh_route(&self, instance: &Instance, endpoint: Option<Endpoint>) -> Option<Endpoint> {
        if instance.role != Role::Main {
            return None;
        }
        let endpoint = endpoint.filter(|_| instance.status.is_routable() && instance.ready);
        {
            let mut routes = self.routes.write().unwrap_or_else(PoisonError::into_inner);
            match &endpoint {
                Some(e) => routes.insert(instance.user.clone(), e.clone()),
                None => routes.remove(&instance.user),
            };
        }
        if instance.status.is_terminal() {
            self.set_token(&instance.user, None);
        }
        endpoint
    }
}
