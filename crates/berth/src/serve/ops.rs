//! The use cases: every per-user operation, written once, for every caller
//! (ARCHITECTURE.md, invariant 9: every per-user operation runs on the
//! node that owns the user).
//!
//! The public API, the node-to-node API, the proxy (through its cluster
//! hook) and the failover scan all call [`Ops`]: [`Ops::ensure_running`],
//! [`Ops::stop`], [`Ops::restart`], [`Ops::probe`], [`Ops::logs`] and
//! [`Ops::follow_logs`], [`Ops::watchdog`], [`Ops::reset_breaker`],
//! [`Ops::progress`], and the cluster-wide [`Ops::restart_all`]. Each is a
//! [`UserOp`]: what it does on this node (over the node-local surface, the
//! `Spawner`) and how it is asked of another node (`/internal/v1/users/
//! {user}/<op>` with the cluster secret, through [`PeerClient`]).
//!
//! They share one hop loop ([`Ops::hop`]): decide the node from the lease
//! (a launch or probe by [`decide`], which may place a new instance; the
//! rest by [`home`]); run here, or call that node; a `lease_busy` answer
//! names the holder, which is followed, at most [`MAX_HOPS`] times; a node
//! that refuses a launch for capacity is passed over and the user placed
//! again, until a node takes it or none has room.
//! A call that arrived from another node ([`Via::Peer`]) is never
//! forwarded again: it runs here, after checking that no other node holds
//! the lease (else it answers `lease_busy`, and the caller follows). So a
//! stop that reaches a node which does not run the user never answers
//! "done" while the instance lives on elsewhere.
//!
//! The readiness of a launched or restarted instance maps to errors in one
//! place, [`berth_core::wait_ready`], which the proxy's wake uses too.
//!
//! [`decide`]: super::cluster::decide
//! [`home`]: super::cluster::home

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use berth_core::egress::EgressPolicy;
use berth_core::{
    Instance, InstanceEvent, LaunchRequest, ProbeReport, Role, SpawnError, Spawner, Stage, UserId,
    UserStatus,
};
use berth_proxy::{ClusterHook, Locate};
use berth_store::{LaunchStore, Store};
use futures_util::StreamExt;
use futures_util::stream::{self, BoxStream};
use serde_json::Value;

use super::cluster::{Cluster, Decision, remote_locate};
use super::peer::{PeerClient, PeerNode, UserCall};
use crate::sse::{LOG_LINE_EVENT, STAGE_EVENT};
use crate::wire::operation as op;
use crate::wire::{Done, EgressChange, StageReport, UserEgress};
pub use crate::wire::{Launched, LogLines, NodeRestart, RestartAll, UserState};

/// Calls per operation answered `lease_busy`: such an answer is followed
/// to the holder it names, twice at most (nodes' views differ for a
/// moment; they never loop long). Refusals for capacity are not counted:
/// each passes over one node, so they end with the nodes.
pub const MAX_HOPS: usize = 3;
/// Added to a remote call's budget for the network and the callee's own
/// bookkeeping.
const MARGIN: Duration = Duration::from_secs(10);
/// What a probe may take on the node that runs it: its restart budget
/// and settle time.
const PROBE_BUDGET: Duration = Duration::from_millis(62_500);
/// What a remote restart-all may take: every main of a node, restarted a
/// few at a time.
const RESTART_ALL_BUDGET: Duration = Duration::from_secs(600);
/// How soon a client retries when the hops ran out.
const HOPS_EXHAUSTED_RETRY_MS: u64 = 1000;

/// Where a call comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// A client of this node (the public API, the proxy): may be sent on to
    /// the node that owns the user.
    Client,
    /// Another node, which decided this node should act: acts here, never
    /// forwards again.
    Peer,
}

/// Which rule decides the node an operation runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// [`decide`](super::cluster::decide): the live lease's holder, else
    /// placement. For what may start an instance.
    Launch,
    /// [`home`](super::cluster::home): the lease's holder, else the last
    /// one while it lives, else here.
    Home,
}

/// Where an operation is sent: its node, and whether placement just chose
/// it (no instance runs there yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub node: PeerNode,
    pub placed: bool,
}

/// One per-user operation: how it runs here, and how it is asked of the
/// node that owns the user.
#[async_trait]
pub trait UserOp: Sync {
    type Output: Send;
    const ROUTE: Route;
    /// Whether a call that arrived from another node first checks that no
    /// other node holds the lease. Not for a launch, whose lease claim is
    /// that check (and whose evidence rules decide about expired leases).
    const GUARDED: bool = true;
    async fn local(&self, ops: &Ops, user: &UserId) -> Result<Self::Output, SpawnError>;
    async fn remote(
        &self,
        ops: &Ops,
        target: &Target,
        user: &UserId,
    ) -> Result<Self::Output, SpawnError>;
}

/// How long a call to another node may take.
#[derive(Debug, Clone, Copy)]
pub struct Budgets {
    pub ready_timeout: Duration,
    pub stop_grace: Duration,
    /// How long a `pre_hibernate` or `pre_stop` hook may run.
    pub hook_grace: Duration,
}

/// The use cases of one node.
pub struct Ops {
    spawner: Arc<dyn Spawner>,
    store: Arc<dyn Store>,
    cluster: Option<Arc<Cluster>>,
    node_id: String,
    budgets: Budgets,
    /// The program's ready line, whose capture is its launch token (see
    /// [`scrubbed`]); `None` when readiness is not a token line.
    token_line: Option<regex::Regex>,
    /// Where this node's instances may connect; `None` where berth does
    /// not guard it (level `none`, or pods).
    egress: Option<EgressPolicy>,
}

impl Ops {
    /// `cluster` is `None` on a single node: everything runs here.
    pub fn new(
        spawner: Arc<dyn Spawner>,
        store: Arc<dyn Store>,
        cluster: Option<Arc<Cluster>>,
        node_id: String,
        budgets: Budgets,
        token_line: Option<regex::Regex>,
        egress: Option<EgressPolicy>,
    ) -> Self {
        Self {
            spawner,
            store,
            cluster,
            node_id,
            budgets,
            token_line,
            egress,
        }
    }

    /// This node's instance changes, as they happen (the admin page's
    /// live view).
    pub fn instance_events(&self) -> tokio::sync::broadcast::Receiver<InstanceEvent> {
        self.spawner.subscribe()
    }

    fn peers(&self) -> Result<&PeerClient, SpawnError> {
        self.cluster
            .as_deref()
            .map(Cluster::peers)
            .ok_or_else(|| SpawnError::Internal("a node-to-node call on a single node".into()))
    }

    /// The hop loop every per-user operation goes through (module docs).
    pub async fn hop<O: UserOp>(
        &self,
        user: &UserId,
        via: Via,
        op: &O,
    ) -> Result<O::Output, SpawnError> {
        let Some(cluster) = self.cluster.as_deref() else {
            return op.local(self, user).await;
        };
        if via == Via::Peer {
            if O::GUARDED
                && let Some(busy) = cluster
                    .lease(user)
                    .await?
                    .and_then(|l| l.held_elsewhere(cluster.node_id(), user))
            {
                return Err(busy);
            }
            return op.local(self, user).await;
        }
        let me = cluster.node_id();
        // Nodes that refused this launch for capacity: placed again
        // without them, so a user is refused only when no node has room.
        let mut refused: Vec<String> = Vec::new();
        let mut decision = match O::ROUTE {
            Route::Launch => cluster.decide(user, &refused).await?,
            Route::Home => cluster.home(user).await?,
        };
        let mut calls = 0;
        while calls < MAX_HOPS {
            let (result, tried) = match &decision {
                Decision::Local => (op.local(self, user).await, me.to_owned()),
                Decision::NoCapacity(why) => {
                    return Err(SpawnError::CapacityExhausted(why.clone()));
                }
                Decision::Owner(node) | Decision::Place(node) => {
                    let target = Target {
                        node: cluster.peer(node).await?,
                        placed: matches!(decision, Decision::Place(_)),
                    };
                    (op.remote(self, &target, user).await, node.clone())
                }
            };
            match result {
                // Another node won the claim, or holds the lease by now:
                // follow it.
                Err(SpawnError::LeaseBusy {
                    holder,
                    expired: false,
                    ..
                }) if !holder.is_empty() && holder != tried => {
                    calls += 1;
                    decision = if holder == me {
                        Decision::Local
                    } else {
                        Decision::Owner(holder)
                    };
                }
                // The node chosen for a new instance is full by its own
                // count (the store's differed): place the user again
                // without it. Each node is passed over once, so this ends.
                Err(SpawnError::CapacityExhausted(why))
                    if O::ROUTE == Route::Launch && !refused.contains(&tried) =>
                {
                    tracing::info!(%user, node = %tried, %why, "the node refused a launch for capacity; placing it elsewhere");
                    refused.push(tried);
                    decision = cluster.decide(user, &refused).await?;
                }
                other => return other,
            }
        }
        Err(SpawnError::Starting {
            user: user.clone(),
            retry_after_ms: HOPS_EXHAUSTED_RETRY_MS,
        })
    }

    // --- the use cases ------------------------------------------------------

    /// Starts `user`'s main where the lease and placement say (or finds
    /// the running one), waiting for ready with `wait`.
    pub async fn ensure_running(
        &self,
        user: &UserId,
        request: LaunchRequest,
        wait: bool,
        via: Via,
    ) -> Result<Launched, SpawnError> {
        self.hop(user, via, &Launch { request, wait }).await
    }

    /// Stops `user`'s main and watchdog where they run; returns once they
    /// are gone.
    ///
    /// A node cut off from the store cannot ask it who owns the user, but
    /// if it runs the user's main itself, it stops it here: ending what
    /// runs here needs no lease to be safe, and a node whose instance is
    /// frozen for want of the database must still be able to end it (it is
    /// killed while frozen, never thawed: ARCHITECTURE.md, invariant 4).
    pub async fn stop(&self, user: &UserId, via: Via) -> Result<(), SpawnError> {
        match self.hop(user, via, &Stop).await {
            Err(SpawnError::StoreUnavailable(why)) if self.runs_here(user).await => {
                tracing::warn!(%user, %why, "the store is unavailable; stopping the instance this node runs");
                Stop.local(self, user).await
            }
            other => other,
        }
    }

    /// Hibernates `user`'s main where it runs: frozen with its memory
    /// intact, its lease kept.
    pub async fn hibernate(&self, user: &UserId, via: Via) -> Result<Instance, SpawnError> {
        self.hop(user, via, &Hibernation::Hibernate).await
    }

    /// Resumes `user`'s hibernated main where it runs.
    pub async fn resume(&self, user: &UserId, via: Via) -> Result<Instance, SpawnError> {
        self.hop(user, via, &Hibernation::Resume).await
    }

    /// Whether this node runs a live main of `user`, as far as it knows
    /// without the store.
    async fn runs_here(&self, user: &UserId) -> bool {
        self.spawner
            .status(user)
            .await
            .ok()
            .and_then(|s| s.main)
            .is_some_and(|m| m.status.is_live() && m.node == self.node_id)
    }

    /// Restarts `user`'s live main (resetting its crash budget) and waits
    /// for it to be ready.
    pub async fn restart(&self, user: &UserId, via: Via) -> Result<Launched, SpawnError> {
        self.hop(user, via, &Restart).await
    }

    /// Restarts (or force-launches) `user`'s main and reports whether it
    /// stays up.
    pub async fn probe(&self, user: &UserId, via: Via) -> Result<ProbeReport, SpawnError> {
        self.hop(user, via, &Probe).await
    }

    /// The last `tail` lines of `user`'s main output.
    pub async fn logs(
        &self,
        user: &UserId,
        tail: usize,
        via: Via,
    ) -> Result<Vec<String>, SpawnError> {
        self.hop(user, via, &Logs { tail }).await
    }

    /// The last `tail` lines of `user`'s main output, then each new line as
    /// it is written, until the stream is dropped.
    pub async fn follow_logs(
        &self,
        user: &UserId,
        tail: usize,
        via: Via,
    ) -> Result<BoxStream<'static, String>, SpawnError> {
        self.hop(user, via, &FollowLogs { tail }).await
    }

    /// Starts `user`'s one-shot repair job where the user lives.
    pub async fn watchdog(&self, user: &UserId, via: Via) -> Result<Instance, SpawnError> {
        self.hop(user, via, &Watchdog).await
    }

    /// Gives `user` their own egress `policy` (`None`: the node's again),
    /// recorded and applied where the user runs, from their instances'
    /// next connection on. A policy that would not mean what it says is
    /// refused before anything changes.
    pub async fn set_egress(
        &self,
        user: &UserId,
        policy: Option<EgressPolicy>,
        via: Via,
    ) -> Result<UserEgress, SpawnError> {
        if self.egress.is_none() {
            return Err(SpawnError::InvalidRequest(
                "this node does not guard its instances' egress (isolation level none)".into(),
            ));
        }
        if let Some(policy) = &policy {
            policy
                .check()
                .map_err(|e| SpawnError::InvalidRequest(format!("egress policy: {e}")))?;
        }
        self.hop(user, via, &SetEgress { policy }).await
    }

    /// Clears `user`'s breaker and crash counters.
    pub async fn reset_breaker(&self, user: &UserId, via: Via) -> Result<(), SpawnError> {
        self.hop(user, via, &ResetBreaker).await
    }

    /// `user`'s stages (each a JSON status object with its `stage`) from
    /// now until the main is ready or has ended, from the node that runs
    /// it. With `next`, a stream that finds no spawn under way waits for
    /// the next one instead of reporting the state it found and ending.
    pub async fn progress(
        &self,
        user: &UserId,
        next: bool,
        via: Via,
    ) -> Result<BoxStream<'static, Value>, SpawnError> {
        self.hop(user, via, &Progress { next }).await
    }

    /// `user`'s records and open breaker, as the node that runs the user
    /// knows them. A read: when that node cannot be asked, this node
    /// answers from what it knows (the store's records, which every
    /// node writes through).
    pub async fn status(&self, user: &UserId, via: Via) -> Result<UserState, SpawnError> {
        match self.hop(user, via, &Status).await {
            Err(e @ SpawnError::NodeUnreachable { .. }) if via == Via::Client => {
                tracing::info!(%user, error = %e, "status: the owner did not answer; reading here");
                Status.local(self, user).await
            }
            other => other,
        }
    }

    /// Kills `user`'s main here if it runs under exactly `epoch` (a fence
    /// from the node that took the lease over).
    pub async fn fence(&self, user: &UserId, epoch: berth_core::Epoch) -> Result<bool, SpawnError> {
        self.spawner.fence(user, epoch).await
    }

    /// An operator's takeover onto this node: claims `user`'s expired
    /// lease, relaunches with the stored launch parameters, and fences the
    /// old holder's epoch.
    pub async fn take_over(&self, user: &UserId) -> Result<Launched, SpawnError> {
        // Read before the claim: the fence must name the old holder and the
        // old epoch, never whoever holds the row afterwards.
        let before = self.store.get_lease(user).await?;
        let request = stored_launch_request(self.store.as_ref(), user).await?;
        // The spawner claims and launches as one step under the user's
        // lifecycle lock, through its lease keeper: claiming here directly
        // would leave the keeper unaware of the new epoch. A lease that is
        // not expired comes back as `lease_busy`.
        let instance = match self.spawner.take_over(user, request).await {
            Ok(instance) => instance,
            // Nothing was claimed: a main already runs here, so the old
            // holder is not fenced on its account.
            Err(SpawnError::AlreadyRunning { .. }) => {
                return Ok(Launched {
                    created: false,
                    instance: self.current_main(user).await?,
                });
            }
            Err(e) => return Err(e),
        };
        // The lease has moved past the old epoch: tell the old holder to
        // stop whatever still runs under exactly that epoch (best effort;
        // its next renew would find the lease lost anyway).
        if let (Some(cluster), Some(old)) = (&self.cluster, &before)
            && let Some(holder) = old.holder.as_deref()
        {
            cluster.fence_remote(holder, user, old.epoch).await;
        }
        Ok(Launched {
            created: false,
            instance,
        })
    }

    /// Restarts every running main: this node's, and with [`Via::Client`]
    /// in a cluster every other node's (asked all at once). One result per
    /// user with its node; a node that cannot be asked is reported against
    /// each user whose lease it holds, so no failure is silent.
    pub async fn restart_all(&self, via: Via) -> Result<Vec<NodeRestart>, SpawnError> {
        let here = async {
            self.spawner
                .restart_all_mains()
                .await
                .into_iter()
                .map(|r| NodeRestart {
                    user: r.user,
                    node: self.node_id.clone(),
                    ok: r.ok,
                    error: r.error,
                })
                .collect::<Vec<_>>()
        };
        let Some(cluster) = self.cluster.as_deref().filter(|_| via == Via::Client) else {
            return Ok(here.await);
        };
        let others = cluster.other_nodes().await?;
        let there = others.iter().map(|node| async move {
            let call = cluster.peers().node_call::<RestartAll>(
                node,
                op::NODE_RESTART_ALL,
                RESTART_ALL_BUDGET,
            );
            match call.await {
                Ok(answer) => Ok(answer.results),
                Err(e) => self.unreached(cluster, node, &e).await,
            }
        });
        let (mut results, there) = futures_util::join!(here, futures_util::future::join_all(there));
        for answer in there {
            results.extend(answer?);
        }
        results.sort_by(|a, b| (&a.node, &a.user).cmp(&(&b.node, &b.user)));
        Ok(results)
    }

    /// A failed result for every user whose unreleased lease `node` holds.
    async fn unreached(
        &self,
        cluster: &Cluster,
        node: &PeerNode,
        error: &SpawnError,
    ) -> Result<Vec<NodeRestart>, SpawnError> {
        tracing::warn!(node = %node.id, %error, "restart-all: a node could not be asked");
        Ok(self
            .store
            .list_leases(false, cluster.ttl())
            .await?
            .into_iter()
            .filter(|l| !l.released && l.holder.as_deref() == Some(node.id.as_str()))
            .map(|l| NodeRestart {
                user: l.user,
                node: node.id.clone(),
                ok: false,
                error: Some(format!("node {} was not restarted: {error}", node.id)),
            })
            .collect())
    }

    async fn current_main(&self, user: &UserId) -> Result<Instance, SpawnError> {
        self.spawner
            .status(user)
            .await?
            .main
            .ok_or_else(|| SpawnError::Internal("instance vanished during launch".into()))
    }

    /// `instance`, or once ready ([`berth_core::wait_ready`]) with `wait`.
    async fn ready(
        &self,
        user: &UserId,
        instance: Instance,
        wait: bool,
    ) -> Result<Instance, SpawnError> {
        if !wait || instance.ready {
            return Ok(instance);
        }
        berth_core::wait_ready(self.spawner.as_ref(), user, self.budgets.ready_timeout).await
    }
}

/// `line` of `user`'s log without a launch token: the program's secret,
/// which berth never shows (see `berth_proxy::credential`). The token
/// recorded for the running program is blanked wherever it appears, and
/// so is the one a ready line carries, recorded or not: a followed log
/// can read the ready line before the program's readiness reaches the
/// controller, and older lines carry earlier runs' tokens.
fn scrubbed(
    spawner: &dyn Spawner,
    token_line: Option<&regex::Regex>,
    user: &UserId,
    line: String,
) -> String {
    without_token(line, spawner.launch_token(user), token_line)
}

/// [`scrubbed`]'s rule over plain data: `line` without `recorded` (the
/// running program's token), or else without the token it announces.
fn without_token(
    line: String,
    recorded: Option<String>,
    token_line: Option<&regex::Regex>,
) -> String {
    let recorded = recorded.filter(|token| line.contains(token.as_str()));
    let announced = || {
        token_line
            .and_then(|pattern| berth_core::program::ready_line(pattern, &line))
            .flatten()
            .map(str::to_owned)
    };
    match recorded.or_else(announced) {
        Some(token) if !token.is_empty() => berth_proxy::credential::scrub_text(&line, &token),
        _ => line,
    }
}

/// The request that relaunches `user` as they were last launched (folder
/// and patch kept in the store), e.g. on another node after a failover.
pub(crate) async fn stored_launch_request(
    store: &dyn LaunchStore,
    user: &UserId,
) -> Result<LaunchRequest, SpawnError> {
    Ok(match store.get_launch_params(user).await? {
        Some(p) => LaunchRequest {
            folder: Some(p.folder).filter(|f| !f.is_empty()),
            patch: p.patch,
            force: false,
        },
        None => LaunchRequest::default(),
    })
}

// --- the operations -----------------------------------------------------------

struct Launch {
    request: LaunchRequest,
    wait: bool,
}

#[async_trait]
impl UserOp for Launch {
    type Output = Launched;
    const ROUTE: Route = Route::Launch;
    const GUARDED: bool = false;

    async fn local(&self, ops: &Ops, user: &UserId) -> Result<Launched, SpawnError> {
        let (created, instance) = match ops.spawner.launch(user, self.request.clone()).await {
            Ok(instance) => (true, instance),
            Err(SpawnError::AlreadyRunning { .. }) => (false, ops.current_main(user).await?),
            Err(e) => return Err(e),
        };
        let instance = ops.ready(user, instance, self.wait).await?;
        Ok(Launched { created, instance })
    }

    async fn remote(&self, ops: &Ops, to: &Target, user: &UserId) -> Result<Launched, SpawnError> {
        // Even without waiting for readiness, the callee starts the
        // program before it answers, and a login storm queues starts on
        // every node: a slow answer is a busy node, not a lost one, so
        // either way the call may take as long as a start may.
        let budget = ops.budgets.ready_timeout + MARGIN;
        let body = serde_json::to_value(&self.request)
            .map_err(|e| SpawnError::Internal(format!("cannot encode a launch: {e}")))?;
        let call = UserCall::new(&op::LAUNCH.internal, budget)
            .query("wait", self.wait)
            .body(body);
        ops.peers()?.user_call(&to.node, user, call).await
    }
}

struct Status;

#[async_trait]
impl UserOp for Status {
    type Output = UserState;
    const ROUTE: Route = Route::Home;

    async fn local(&self, ops: &Ops, user: &UserId) -> Result<UserState, SpawnError> {
        let UserStatus {
            main,
            watchdog,
            idle_action,
        } = ops.spawner.status(user).await?;
        let breaker = ops.spawner.breaker_info(user).await?;
        let egress = match &ops.egress {
            Some(node) => Some(
                ops.store
                    .user_egress(user)
                    .await?
                    .unwrap_or_else(|| node.clone()),
            ),
            None => None,
        };
        Ok(UserState {
            main,
            watchdog,
            breaker,
            idle_action,
            egress,
        })
    }

    async fn remote(&self, ops: &Ops, to: &Target, user: &UserId) -> Result<UserState, SpawnError> {
        ops.peers()?
            .user_call(&to.node, user, UserCall::new(&op::STATUS.internal, MARGIN))
            .await
    }
}

/// `hibernate` and `resume`: the same shape, one verb each.
enum Hibernation {
    Hibernate,
    Resume,
}

impl Hibernation {
    fn operation(&self) -> &'static op::Internal {
        match self {
            Hibernation::Hibernate => &op::HIBERNATE.internal,
            Hibernation::Resume => &op::RESUME.internal,
        }
    }
}

#[async_trait]
impl UserOp for Hibernation {
    type Output = Instance;
    const ROUTE: Route = Route::Home;

    async fn local(&self, ops: &Ops, user: &UserId) -> Result<Instance, SpawnError> {
        match self {
            Hibernation::Hibernate => ops.spawner.hibernate(user).await,
            Hibernation::Resume => ops.spawner.resume(user).await,
        }
    }

    async fn remote(&self, ops: &Ops, to: &Target, user: &UserId) -> Result<Instance, SpawnError> {
        // A hibernation runs its hook first, cut off at its grace.
        let budget = ops.budgets.stop_grace + ops.budgets.hook_grace + MARGIN;
        ops.peers()?
            .user_call(&to.node, user, UserCall::new(self.operation(), budget))
            .await
    }
}

struct Stop;

#[async_trait]
impl UserOp for Stop {
    type Output = ();
    const ROUTE: Route = Route::Home;

    async fn local(&self, ops: &Ops, user: &UserId) -> Result<(), SpawnError> {
        ops.spawner.stop(user).await
    }

    async fn remote(&self, ops: &Ops, to: &Target, user: &UserId) -> Result<(), SpawnError> {
        let budget = ops.budgets.stop_grace + ops.budgets.hook_grace + MARGIN;
        ops.peers()?
            .user_call::<Done>(&to.node, user, UserCall::new(&op::STOP.internal, budget))
            .await
            .map(drop)
    }
}

struct Restart;

#[async_trait]
impl UserOp for Restart {
    type Output = Launched;
    const ROUTE: Route = Route::Home;

    async fn local(&self, ops: &Ops, user: &UserId) -> Result<Launched, SpawnError> {
        let instance = ops.spawner.restart_main(user).await?;
        let instance = ops.ready(user, instance, true).await?;
        Ok(Launched {
            created: false,
            instance,
        })
    }

    async fn remote(&self, ops: &Ops, to: &Target, user: &UserId) -> Result<Launched, SpawnError> {
        let budget = ops.budgets.stop_grace + ops.budgets.ready_timeout + MARGIN;
        ops.peers()?
            .user_call(&to.node, user, UserCall::new(&op::RESTART.internal, budget))
            .await
    }
}

struct Probe;

#[async_trait]
impl UserOp for Probe {
    type Output = ProbeReport;
    // A probe may launch the user: where a launch would go.
    const ROUTE: Route = Route::Launch;

    async fn local(&self, ops: &Ops, user: &UserId) -> Result<ProbeReport, SpawnError> {
        Ok(ops.spawner.restart_and_probe(user).await)
    }

    async fn remote(
        &self,
        ops: &Ops,
        to: &Target,
        user: &UserId,
    ) -> Result<ProbeReport, SpawnError> {
        let budget = ops.budgets.stop_grace + PROBE_BUDGET + MARGIN;
        ops.peers()?
            .user_call(&to.node, user, UserCall::new(&op::PROBE.internal, budget))
            .await
    }
}

struct Logs {
    tail: usize,
}

#[async_trait]
impl UserOp for Logs {
    type Output = Vec<String>;
    const ROUTE: Route = Route::Home;

    async fn local(&self, ops: &Ops, user: &UserId) -> Result<Vec<String>, SpawnError> {
        let lines = ops.spawner.logs(user, self.tail).await?;
        Ok(lines
            .into_iter()
            .map(|line| scrubbed(ops.spawner.as_ref(), ops.token_line.as_ref(), user, line))
            .collect())
    }

    async fn remote(
        &self,
        ops: &Ops,
        to: &Target,
        user: &UserId,
    ) -> Result<Vec<String>, SpawnError> {
        let call = UserCall::new(&op::LOGS.internal, MARGIN).query("tail", self.tail);
        let answer: LogLines = ops.peers()?.user_call(&to.node, user, call).await?;
        Ok(answer.lines)
    }
}

struct FollowLogs {
    tail: usize,
}

#[async_trait]
impl UserOp for FollowLogs {
    type Output = BoxStream<'static, String>;
    const ROUTE: Route = Route::Home;

    async fn local(
        &self,
        ops: &Ops,
        user: &UserId,
    ) -> Result<BoxStream<'static, String>, SpawnError> {
        let lines = ops.spawner.follow_logs(user, self.tail).await?;
        let (spawner, user) = (ops.spawner.clone(), user.clone());
        let token_line = ops.token_line.clone();
        Ok(stream::unfold(lines, move |mut lines| {
            let (spawner, user, token_line) = (spawner.clone(), user.clone(), token_line.clone());
            async move {
                let line = lines.recv().await?;
                Some((
                    scrubbed(spawner.as_ref(), token_line.as_ref(), &user, line),
                    lines,
                ))
            }
        })
        .boxed())
    }

    async fn remote(
        &self,
        ops: &Ops,
        to: &Target,
        user: &UserId,
    ) -> Result<BoxStream<'static, String>, SpawnError> {
        let query = [
            ("tail", self.tail.to_string()),
            ("follow", "true".to_owned()),
        ];
        let events = ops
            .peers()?
            .user_events(&to.node, user, &op::LOGS.internal, &query)
            .await?;
        Ok(events
            .filter_map(|e| {
                let line = (e.event == LOG_LINE_EVENT)
                    .then(|| serde_json::from_str::<String>(&e.data).ok())
                    .flatten();
                std::future::ready(line)
            })
            .boxed())
    }
}

struct Watchdog;

#[async_trait]
impl UserOp for Watchdog {
    type Output = Instance;
    const ROUTE: Route = Route::Home;

    async fn local(&self, ops: &Ops, user: &UserId) -> Result<Instance, SpawnError> {
        ops.spawner.spawn_watchdog(user).await
    }

    async fn remote(&self, ops: &Ops, to: &Target, user: &UserId) -> Result<Instance, SpawnError> {
        ops.peers()?
            .user_call(
                &to.node,
                user,
                UserCall::new(&op::WATCHDOG.internal, MARGIN),
            )
            .await
    }
}

struct SetEgress {
    policy: Option<EgressPolicy>,
}

#[async_trait]
impl UserOp for SetEgress {
    type Output = UserEgress;
    const ROUTE: Route = Route::Home;

    async fn local(&self, ops: &Ops, user: &UserId) -> Result<UserEgress, SpawnError> {
        ops.spawner.set_egress(user, self.policy.as_ref()).await?;
        Ok(UserEgress {
            user: user.clone(),
            egress: self
                .policy
                .clone()
                .or_else(|| ops.egress.clone())
                .unwrap_or_default(),
            own: self.policy.is_some(),
        })
    }

    async fn remote(
        &self,
        ops: &Ops,
        to: &Target,
        user: &UserId,
    ) -> Result<UserEgress, SpawnError> {
        let body = serde_json::to_value(EgressChange {
            policy: self.policy.clone(),
        })
        .map_err(|e| SpawnError::Internal(format!("cannot encode an egress change: {e}")))?;
        let call = UserCall::new(&op::SET_EGRESS.internal, MARGIN).body(body);
        ops.peers()?.user_call(&to.node, user, call).await
    }
}

struct ResetBreaker;

#[async_trait]
impl UserOp for ResetBreaker {
    type Output = ();
    const ROUTE: Route = Route::Home;

    async fn local(&self, ops: &Ops, user: &UserId) -> Result<(), SpawnError> {
        ops.spawner.reset_breaker(user).await
    }

    async fn remote(&self, ops: &Ops, to: &Target, user: &UserId) -> Result<(), SpawnError> {
        ops.peers()?
            .user_call::<Done>(
                &to.node,
                user,
                UserCall::new(&op::RESET_BREAKER.internal, MARGIN),
            )
            .await
            .map(drop)
    }
}

/// `user`'s spawn stages; with `next`, a final state at the start (none,
/// ready, failed, stopped) is not reported: the stream waits for the next
/// spawn instead.
struct Progress {
    next: bool,
}

#[async_trait]
impl UserOp for Progress {
    type Output = BoxStream<'static, Value>;
    const ROUTE: Route = Route::Home;

    async fn local(
        &self,
        ops: &Ops,
        user: &UserId,
    ) -> Result<BoxStream<'static, Value>, SpawnError> {
        // Subscribe before reading the state so no change falls in
        // between; one seen both ways is sent once.
        let events = ops.spawner.subscribe();
        let main = ops.spawner.status(user).await?.main;
        // Another node's record (no one holds the lease, so it was routed
        // here): its events are not published here, so only its state now.
        let foreign = main.as_ref().is_some_and(|m| m.node != ops.node_id);
        let record = main.map(|m| InstanceEvent {
            user: user.clone(),
            role: m.role,
            status: m.status,
            ready: m.ready,
            endpoint: None,
            stage: Stage::of(m.status, m.ready),
            message: m.last_error,
        });
        // This node's last word on the main is at least as new as its
        // record, and also knows a launch's `queued` and `spawning`.
        let now = if foreign {
            record
        } else {
            ops.spawner.last_main_event(user).or(record)
        };
        let at_end = now.as_ref().is_none_or(|e| e.stage.is_final());
        let (first, done) = match now {
            Some(e) if !at_end => (Some(e), foreign),
            _ if self.next => (None, false),
            now => (now, true),
        };
        struct Follow {
            events: tokio::sync::broadcast::Receiver<InstanceEvent>,
            user: UserId,
            last: Option<InstanceEvent>,
            done: bool,
        }
        let follow = stream::unfold(
            Follow {
                events,
                user: user.clone(),
                last: first.clone(),
                done,
            },
            |mut f| async move {
                loop {
                    if f.done {
                        return None;
                    }
                    match f.events.recv().await {
                        Ok(e) if e.user == f.user && e.role == Role::Main => {
                            if f.last.as_ref() == Some(&e) {
                                continue;
                            }
                            f.done = e.stage.is_final();
                            f.last = Some(e.clone());
                            return Some((stage(&e), f));
                        }
                        Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
                    }
                }
            },
        );
        let first = match (first, self.next) {
            (Some(e), _) => Some(stage(&e)),
            (None, false) => Some(no_main()),
            (None, true) => None,
        };
        Ok(stream::iter(first).chain(follow).boxed())
    }

    async fn remote(
        &self,
        ops: &Ops,
        to: &Target,
        user: &UserId,
    ) -> Result<BoxStream<'static, Value>, SpawnError> {
        let query = if self.next {
            vec![("next", "true".to_owned())]
        } else {
            Vec::new()
        };
        let events = ops
            .peers()?
            .user_events(&to.node, user, &op::PROGRESS.internal, &query)
            .await?;
        Ok(events
            .filter_map(|e| {
                let stage = (e.event == STAGE_EVENT)
                    .then(|| serde_json::from_str::<Value>(&e.data).ok())
                    .flatten();
                std::future::ready(stage)
            })
            .boxed())
    }
}

/// A stage report: the event itself, which is its own wire shape.
fn stage(e: &InstanceEvent) -> Value {
    serde_json::to_value(e).unwrap_or_else(|_| {
        report(StageReport {
            status: e.status.to_string(),
            stage: Some(e.stage.to_string()),
            message: e.message.clone(),
        })
    })
}

/// The report of a stream that found no main.
fn no_main() -> Value {
    report(StageReport {
        status: StageReport::NONE.to_owned(),
        stage: None,
        message: None,
    })
}

fn report(report: StageReport) -> Value {
    serde_json::to_value(&report).unwrap_or(Value::Null)
}

/// The proxy's question on a local route miss: serve here, or forward to
/// which node? A node placement chose is asked to launch first, and
/// waited on only with `wait` (a browser's navigation is not: the owner
/// shows it the starting page).
struct LocateOp {
    wait: bool,
}

#[async_trait]
impl UserOp for LocateOp {
    type Output = Locate;
    const ROUTE: Route = Route::Launch;

    async fn local(&self, _ops: &Ops, _user: &UserId) -> Result<Locate, SpawnError> {
        // The proxy's own wake launches here.
        Ok(Locate::Local)
    }

    async fn remote(&self, ops: &Ops, to: &Target, user: &UserId) -> Result<Locate, SpawnError> {
        if to.placed {
            let launch = Launch {
                request: LaunchRequest::default(),
                wait: self.wait,
            };
            launch.remote(ops, to, user).await?;
        }
        remote_locate(&to.node)
    }
}

#[async_trait]
impl ClusterHook for Ops {
    async fn locate(&self, user: &UserId, wait_for_ready: bool) -> Result<Locate, SpawnError> {
        let Some(cluster) = self.cluster.as_deref() else {
            return Ok(Locate::Local);
        };
        if let Some(cached) = cluster.cached_owner(user) {
            return Ok(cached);
        }
        let locate = self
            .hop(
                user,
                Via::Client,
                &LocateOp {
                    wait: wait_for_ready,
                },
            )
            .await?;
        if matches!(locate, Locate::Remote { .. }) {
            cluster.remember_owner(user, &locate);
        }
        Ok(locate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ready_lines_token_is_blanked_whether_recorded_or_not() {
        let pattern = regex::Regex::new(r"token=([a-z0-9]+)").unwrap();
        let line = || "serving at http://127.0.0.1:9/?token=abc123".to_owned();
        let blanked = "serving at http://127.0.0.1:9/?token=*";
        // Recorded: blanked even without a pattern.
        assert_eq!(without_token(line(), Some("abc123".into()), None), blanked);
        // Not recorded yet, or an earlier run's: the line's own token goes.
        assert_eq!(without_token(line(), None, Some(&pattern)), blanked);
        assert_eq!(
            without_token(line(), Some("older".into()), Some(&pattern)),
            blanked
        );
        // Any other line stays as it is.
        let other = "GET /api 200".to_owned();
        assert_eq!(
            without_token(other.clone(), Some("abc123".into()), Some(&pattern)),
            other
        );
        assert_eq!(without_token(line(), None, None), line());
    }
}
