//! `GET /api/v1/events`: the cluster as the admin page shows it, live.
//!
//! A Server-Sent Events stream of `snapshot` events, each the whole view:
//! every node, every instance, every lease and the open breakers
//! ([`View`]), with this node's clock (`now`) so a page can count uptimes
//! and idle times on. The view comes from the store, so it is the
//! cluster's, whichever node serves the stream. It is read again when an
//! instance of this node changes (after [`SETTLE`], so a burst of changes
//! is one read) and every [`REFRESH`] for what other nodes change; a view
//! equal to the last one sent is not sent again.
//!
//! Admin only (Bearer, or the admin session cookie), and at most
//! [`MAX_EVENT_STREAMS`] at once on a node: each holds a store read every
//! [`REFRESH`], so an unbounded number could keep the store busy.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::IntoResponse;
use axum::response::sse::{Event, KeepAlive, Sse};
use berth_core::{
    BreakerInfo, ErrorBody, ErrorCode, Instance, InstanceStatus, Role, SpawnError, UnixMillis,
    UserId,
};
use berth_store::{InstanceFilter, LeaseRecord, NodeRecord, StoreError};
use futures_util::StreamExt;
use futures_util::stream::{self, Stream};
use serde::Serialize;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::extract::Admin;
use super::{ApiError, ApiResult, ApiState, AppState};

/// Event streams one node serves at once.
pub const MAX_EVENT_STREAMS: usize = 8;
/// How often the view is read again without a local change: other nodes'
/// changes, heartbeats and lease expiry show within this.
pub const REFRESH: Duration = Duration::from_secs(2);
/// How long after a local change the view is read, so that the changes of
/// one operation (stopping, stopped) make one event.
pub const SETTLE: Duration = Duration::from_millis(100);
/// The event name of a snapshot.
pub const SNAPSHOT_EVENT: &str = "snapshot";
/// The event name of a failed read (an [`ErrorBody`]); the stream goes on.
pub const ERROR_EVENT: &str = "error";
/// Crash states read per view: the breakers of at most this many failed
/// or crashed mains are shown.
const MAX_BREAKER_READS: usize = 200;

/// The slots of open event streams.
#[derive(Debug, Clone)]
pub struct EventStreams {
    slots: Arc<Semaphore>,
    max: usize,
}

impl Default for EventStreams {
    fn default() -> Self {
        Self::new(MAX_EVENT_STREAMS)
    }
}

impl EventStreams {
    pub fn new(max: usize) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// A slot for one stream, held until it is dropped.
    fn open(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        self.slots.clone().try_acquire_owned().map_err(|_| {
            ApiError::new(
                ErrorCode::CapacityExhausted,
                format!(
                    "this node already serves {} event streams, the most it serves at once; \
                     close one (an admin page) or use another node",
                    self.max
                ),
            )
        })
    }
}

/// What the admin page shows: the cluster's nodes, instances, leases and
/// open breakers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct View {
    /// The node that serves this stream.
    pub node: String,
    /// The lease TTL: a node whose heartbeat is older is presumed dead.
    pub lease_ttl_ms: u64,
    pub nodes: Vec<NodeRecord>,
    pub instances: Vec<Instance>,
    pub leases: Vec<LeaseRecord>,
    /// Open breakers, by user.
    pub breakers: BTreeMap<UserId, BreakerInfo>,
}

/// One `snapshot` event.
#[derive(Debug, Serialize)]
pub struct Snapshot<'a> {
    /// This node's clock when the view was read (Unix milliseconds).
    pub now: UnixMillis,
    #[serde(flatten)]
    pub view: &'a View,
}

/// Reads the view from the store.
async fn read_view(state: &ApiState, now: UnixMillis) -> Result<View, StoreError> {
    let store = &state.store;
    let every = InstanceFilter::default();
    let (nodes, instances, leases) = futures_util::try_join!(
        store.list_nodes(),
        store.list_instances(&every),
        store.list_leases(false, state.lease_ttl),
    )?;
    let mut breakers = BTreeMap::new();
    // A breaker holds back only a main that failed or is crashing.
    for user in held_back(&instances).take(MAX_BREAKER_READS) {
        if let Some(breaker) = store.load_crash_state(user).await?.breaker_at(now) {
            breakers.insert(user.clone(), breaker);
        }
    }
    Ok(View {
        node: state.node_id.clone(),
        lease_ttl_ms: u64::try_from(state.lease_ttl.as_millis()).unwrap_or(u64::MAX),
        nodes,
        instances,
        leases,
        breakers,
    })
}

/// The users whose breaker may be open: failed or crashed mains.
fn held_back(instances: &[Instance]) -> impl Iterator<Item = &UserId> {
    instances
        .iter()
        .filter(|i| {
            i.role == Role::Main
                && matches!(i.status, InstanceStatus::Failed | InstanceStatus::Crashed)
        })
        .map(|i| &i.user)
}

/// `GET /api/v1/events`: `snapshot` events until the client leaves.
pub async fn events(_: Admin, State(state): AppState) -> ApiResult {
    let permit = state.event_streams.open()?;
    // Subscribed before the first read, so no change falls in between.
    let changes = state.ops.instance_events();
    let now = berth_core::unix_millis_now();
    // A store that cannot be read answers an error, not an empty stream.
    let first = read_view(&state, now).await?;
    let first_event = snapshot_event(now, &first);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + REFRESH, REFRESH);
    // A slow store read delays the next one; reads never pile up.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let follow = Follow {
        state,
        changes: Some(changes),
        last: first,
        tick,
        _permit: permit,
    };
    let events = stream::once(async move { Ok(first_event) }).chain(follow.into_stream());
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// The state of one stream after its first event.
struct Follow {
    state: Arc<ApiState>,
    /// `None` once the spawner's channel closed (shutdown): the ticks go on.
    changes: Option<tokio::sync::broadcast::Receiver<berth_core::InstanceEvent>>,
    last: View,
    tick: tokio::time::Interval,
    /// Held for as long as the stream lives.
    _permit: OwnedSemaphorePermit,
}

impl Follow {
    fn into_stream(self) -> impl Stream<Item = Result<Event, Infallible>> {
        stream::unfold(self, |mut f| async move {
            loop {
                f.wait().await;
                let now = berth_core::unix_millis_now();
                match read_view(&f.state, now).await {
                    Ok(view) if view == f.last => {}
                    Ok(view) => {
                        let event = snapshot_event(now, &view);
                        f.last = view;
                        return Some((Ok(event), f));
                    }
                    Err(e) => {
                        let body = ErrorBody::from_spawn_error(&SpawnError::from(e), now);
                        return Some((Ok(json_event(ERROR_EVENT, &body)), f));
                    }
                }
            }
        })
    }

    /// Until the next tick, or a local change has settled.
    async fn wait(&mut self) {
        let change = async {
            match &mut self.changes {
                Some(rx) => rx.recv().await,
                None => std::future::pending().await,
            }
        };
        let changed = tokio::select! {
            _ = self.tick.tick() => return,
            changed = change => changed,
        };
        if let Err(RecvError::Closed) = changed {
            self.changes = None;
            return;
        }
        tokio::time::sleep(SETTLE).await;
        if let Some(rx) = &mut self.changes {
            // What arrived while settling is in the view about to be read.
            while !matches!(
                rx.try_recv(),
                Err(tokio::sync::broadcast::error::TryRecvError::Empty
                    | tokio::sync::broadcast::error::TryRecvError::Closed)
            ) {}
        }
        // A change resets the refresh: the view is read now.
        self.tick.reset();
    }
}

fn snapshot_event(now: UnixMillis, view: &View) -> Event {
    json_event(SNAPSHOT_EVENT, &Snapshot { now, view })
}

/// An event named `name` carrying `data` as JSON, or an `error` event when
/// `data` cannot be written.
fn json_event(name: &str, data: &impl Serialize) -> Event {
    match serde_json::to_string(data) {
        Ok(text) => Event::default().event(name).data(text),
        Err(e) => Event::default().event(ERROR_EVENT).data(
            serde_json::to_string(&ErrorBody::new(ErrorCode::Internal, e.to_string()))
                .unwrap_or_default(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance(user: &str, role: Role, status: InstanceStatus) -> Instance {
        Instance {
            id: format!("{user}-1"),
            user: UserId::parse(user).unwrap(),
            role,
            status,
            node: "n".into(),
            epoch: 1,
            port: None,
            pid: None,
            runtime_ref: None,
            folder: String::new(),
            started_at: 0,
            ready: false,
            restarts: 0,
            last_error: None,
            exit_code: None,
            last_active: 0,
            hibernated_at: None,
        }
    }

    #[test]
    fn breakers_are_read_only_for_held_back_mains() {
        let all = [
            instance("a", Role::Main, InstanceStatus::Running),
            instance("b", Role::Main, InstanceStatus::Failed),
            instance("c", Role::Main, InstanceStatus::Crashed),
            instance("d", Role::Main, InstanceStatus::Stopped),
            instance("e", Role::Watchdog, InstanceStatus::Failed),
            instance("f", Role::Main, InstanceStatus::Starting),
        ];
        let users: Vec<&str> = held_back(&all).map(UserId::as_str).collect();
        assert_eq!(users, ["b", "c"]);
    }

    #[test]
    fn a_snapshot_is_the_view_with_the_time() {
        let view = View {
            node: "n".into(),
            lease_ttl_ms: 3000,
            nodes: vec![],
            instances: vec![instance("a", Role::Main, InstanceStatus::Running)],
            leases: vec![],
            breakers: BTreeMap::from([(
                UserId::parse("a").unwrap(),
                BreakerInfo {
                    opens: 1,
                    opened_at: 5,
                    cooldown_until: 9,
                },
            )]),
        };
        let json = serde_json::to_value(Snapshot {
            now: 7,
            view: &view,
        })
        .unwrap();
        assert_eq!(json["now"], 7);
        assert_eq!(json["node"], "n");
        assert_eq!(json["instances"][0]["user"], "a");
        assert_eq!(json["breakers"]["a"]["cooldown_until"], 9);
        assert!(json["leases"].as_array().unwrap().is_empty());
    }

    #[test]
    fn streams_are_bounded() {
        let streams = EventStreams::new(2);
        let a = streams.open().unwrap();
        let _b = streams.open().unwrap();
        let refused = streams.open().unwrap_err();
        assert_eq!(refused.code, ErrorCode::CapacityExhausted);
        drop(a);
        assert!(streams.open().is_ok(), "a closed stream frees its slot");
    }
}
