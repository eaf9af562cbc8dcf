//! The failover scan (docs/design.md, "Failover"): every renew
//! interval, each node reads the expired leases and relaunches the users
//! whose holder is gone, with evidence, that placement gives to it; the
//! rest are reported once per epoch for an operator (`berth takeover`).
//!
//! [`plan_failovers`] is the pure decision; [`Failover`] feeds it from the
//! store and acts on it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_core::policy::{NodeView, place};
use berth_core::{Epoch, InstanceStatus, Role, SpawnError, Spawner, UserId};
use berth_store::{Store, TakeoverPolicy};
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

use super::cluster::Cluster;

/// Relaunches of one failover scan run this many at a time.
const FAILOVER_CONCURRENCY: usize = 8;

/// One expired lease, with what the failover scan needs to judge it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired {
    pub user: UserId,
    pub holder: String,
    pub epoch: Epoch,
    /// Whether the holder heartbeat within one TTL (`None`: unknown).
    pub holder_alive: Option<bool>,
    /// The status of the user's main record, if there is one.
    pub main: Option<InstanceStatus>,
}

/// What the failover scan does about one expired lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailoverStep {
    /// Relaunch the user here, then fence the old holder's epoch.
    Relaunch {
        user: UserId,
        old_holder: String,
        old_epoch: Epoch,
    },
    /// Leave it to an operator (`berth takeover`), and say why.
    Report {
        user: UserId,
        holder: String,
        reason: &'static str,
    },
}

/// No silent takeover (docs/design.md, "Failover"): decides, for
/// every expired lease of a main that was live, whether this node
/// relaunches it.
///
/// * holder alive, or liveness unknown → report (no evidence it is gone);
/// * `manual` → report;
/// * otherwise placement among live `up` nodes, sticky to the dead holder
///   (so in effect the most free): only the chosen node relaunches. Each
///   choice counts against the chosen node's room for the rest of the
///   scan, so every node, iterating the same rows in the same order,
///   spreads a dead node's users the same way.
///
/// Leases this node held are not failovers: its own renew tick deals
/// with them.
pub fn plan_failovers(
    me: &str,
    expired: &[Expired],
    nodes: &[NodeView],
    ttl_ms: i64,
    policy: TakeoverPolicy,
) -> Vec<FailoverStep> {
    let mut nodes = nodes.to_vec();
    let mut steps = Vec::new();
    for e in expired {
        if e.holder == me || !e.main.is_some_and(InstanceStatus::is_live) {
            continue;
        }
        let report = |reason| FailoverStep::Report {
            user: e.user.clone(),
            holder: e.holder.clone(),
            reason,
        };
        if e.holder_alive != Some(false) {
            steps.push(report(
                "the holder is still alive (no evidence it is gone): take it over explicitly",
            ));
            continue;
        }
        if policy == TakeoverPolicy::Manual {
            steps.push(report("takeover = \"manual\": take it over explicitly"));
            continue;
        }
        match place(e.user.as_str(), Some(&e.holder), &[], &nodes, ttl_ms) {
            Some(chosen) => {
                if chosen == me {
                    steps.push(FailoverStep::Relaunch {
                        user: e.user.clone(),
                        old_holder: e.holder.clone(),
                        old_epoch: e.epoch,
                    });
                }
                if let Some(n) = nodes.iter_mut().find(|n| n.id == chosen) {
                    n.load = n.load.saturating_add(1);
                }
            }
            None => steps.push(report("no live node has room for it")),
        }
    }
    steps
}

/// The scan of one node.
pub struct Failover {
    store: Arc<dyn Store>,
    spawner: Arc<dyn Spawner>,
    cluster: Arc<Cluster>,
    takeover: TakeoverPolicy,
    /// Reported expired leases, so each is logged once per epoch.
    reported: Mutex<HashSet<(UserId, Epoch)>>,
}

impl Failover {
    pub fn new(
        store: Arc<dyn Store>,
        spawner: Arc<dyn Spawner>,
        cluster: Arc<Cluster>,
        takeover: TakeoverPolicy,
    ) -> Self {
        Self {
            store,
            spawner,
            cluster,
            takeover,
            reported: Mutex::new(HashSet::new()),
        }
    }

    /// Scans for expired leases every `interval` until `cancel` fires.
    pub async fn run(self: Arc<Self>, interval: Duration, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let scan = self.scan();
            tokio::select! {
                () = cancel.cancelled() => return,
                result = scan => if let Err(e) = result {
                    tracing::warn!(error = %e, "failover scan failed");
                },
            }
        }
    }

    /// One scan: read the expired leases, plan, relaunch what falls to this
    /// node, report the rest once.
    pub async fn scan(&self) -> Result<(), SpawnError> {
        let leases = self.store.list_leases(true, self.cluster.ttl()).await?;
        self.cluster
            .metrics
            .expired_leases
            .set(i64::try_from(leases.len()).unwrap_or(i64::MAX));
        let mut expired = Vec::new();
        for lease in leases {
            let Some(holder) = lease.holder.clone() else {
                continue;
            };
            if holder == self.cluster.node_id() {
                continue;
            }
            let main = self
                .store
                .get_instance(&lease.user, Role::Main)
                .await?
                .map(|i| i.status);
            expired.push(Expired {
                user: lease.user,
                holder,
                epoch: lease.epoch,
                holder_alive: lease.holder_alive,
                main,
            });
        }
        // A lease no longer expired (taken over, renewed, released) will
        // not be reported again under that epoch: forget it, so the set
        // stays as small as the current expired set.
        self.reported
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(user, epoch)| expired.iter().any(|e| e.user == *user && e.epoch == *epoch));
        if expired.is_empty() {
            return Ok(());
        }
        // Liveness must be as fresh as the lease rows it is judged with.
        let views = self.cluster.fresh_views().await?;
        let ttl_ms = i64::try_from(self.cluster.ttl().as_millis()).unwrap_or(i64::MAX);
        let steps = plan_failovers(
            self.cluster.node_id(),
            &expired,
            &views,
            ttl_ms,
            self.takeover,
        );
        let mut relaunches = Vec::new();
        for step in steps {
            match step {
                FailoverStep::Report {
                    user,
                    holder,
                    reason,
                } => {
                    let epoch = expired
                        .iter()
                        .find(|e| e.user == user)
                        .map_or(0, |e| e.epoch);
                    let first = self
                        .reported
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert((user.clone(), epoch));
                    if first {
                        tracing::warn!(%user, %holder, epoch, "expired lease not taken over: {reason}");
                    }
                }
                FailoverStep::Relaunch {
                    user,
                    old_holder,
                    old_epoch,
                } => relaunches.push((user, old_holder, old_epoch)),
            }
        }
        futures_util::stream::iter(relaunches)
            .for_each_concurrent(FAILOVER_CONCURRENCY, |(user, holder, epoch)| async move {
                self.fail_over(&user, &holder, epoch).await;
            })
            .await;
        Ok(())
    }

    /// Relaunches `user` here with their launch parameters. The spawner's
    /// claim succeeds only with the store's evidence that the holder is
    /// gone; afterwards the old holder is told to fence the old epoch.
    async fn fail_over(&self, user: &UserId, old_holder: &str, old_epoch: Epoch) {
        tracing::warn!(%user, %old_holder, old_epoch, "lease holder is gone; relaunching here");
        let request = match super::ops::stored_launch_request(self.store.as_ref(), user).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(%user, error = %e, "failover: cannot read the launch parameters");
                return;
            }
        };
        match self.spawner.launch(user, request).await {
            Ok(instance) => {
                self.cluster.metrics.failovers.inc();
                tracing::warn!(%user, %old_holder, epoch = instance.epoch, "failed over to this node");
                self.cluster.fence_remote(old_holder, user, old_epoch).await;
            }
            // Another node was faster, or the user was relaunched already.
            Err(SpawnError::LeaseBusy { holder, .. }) => {
                tracing::info!(%user, %holder, "failover: another node holds the lease now");
            }
            Err(SpawnError::AlreadyRunning { .. }) => {}
            Err(e) => tracing::warn!(%user, error = %e, "failover launch failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::cluster::fixtures::{TTL, dead, up};
    use super::*;

    fn expired(
        user: &str,
        holder: &str,
        alive: Option<bool>,
        main: Option<InstanceStatus>,
    ) -> Expired {
        Expired {
            user: UserId::parse(user).unwrap(),
            holder: holder.into(),
            epoch: 7,
            holder_alive: alive,
            main,
        }
    }

    fn relaunch(user: &str, holder: &str) -> FailoverStep {
        FailoverStep::Relaunch {
            user: UserId::parse(user).unwrap(),
            old_holder: holder.into(),
            old_epoch: 7,
        }
    }

    fn kinds(steps: &[FailoverStep]) -> Vec<String> {
        steps
            .iter()
            .map(|s| match s {
                FailoverStep::Relaunch { user, .. } => format!("relaunch {user}"),
                FailoverStep::Report { user, .. } => format!("report {user}"),
            })
            .collect()
    }

    #[test]
    fn failover_table() {
        use InstanceStatus::{Crashed, Failed, Running, Starting, Stopped};
        let nodes = vec![up("a", 10, 0), up("b", 10, 5), dead("x")];
        type Case<'a> = (&'a str, Expired, TakeoverPolicy, Vec<&'a str>);
        let ev = TakeoverPolicy::Evidence;
        let cases: Vec<Case> = vec![
            (
                "dead holder, running main, evidence: the most free node relaunches",
                expired("u", "x", Some(false), Some(Running)),
                ev,
                vec!["relaunch u"],
            ),
            (
                "starting and crashed mains count as live",
                expired("u", "x", Some(false), Some(Starting)),
                ev,
                vec!["relaunch u"],
            ),
            (
                "crashed",
                expired("u", "x", Some(false), Some(Crashed)),
                ev,
                vec!["relaunch u"],
            ),
            (
                "stopped main: nothing to do",
                expired("u", "x", Some(false), Some(Stopped)),
                ev,
                vec![],
            ),
            (
                "failed main: nothing to do",
                expired("u", "x", Some(false), Some(Failed)),
                ev,
                vec![],
            ),
            (
                "no main record: nothing to do",
                expired("u", "x", Some(false), None),
                ev,
                vec![],
            ),
            (
                "holder alive: no evidence, report",
                expired("u", "b", Some(true), Some(Running)),
                ev,
                vec!["report u"],
            ),
            (
                "liveness unknown: report",
                expired("u", "x", None, Some(Running)),
                ev,
                vec!["report u"],
            ),
            (
                "manual: report even with evidence",
                expired("u", "x", Some(false), Some(Running)),
                TakeoverPolicy::Manual,
                vec!["report u"],
            ),
            (
                "own lease: the renew tick's business",
                expired("u", "a", Some(false), Some(Running)),
                ev,
                vec![],
            ),
        ];
        for (name, e, policy, want) in cases {
            let steps = plan_failovers("a", &[e], &nodes, TTL, policy);
            assert_eq!(kinds(&steps), want, "{name}");
        }
        // Another node is the most free: it relaunches, this node does not.
        let steps = plan_failovers(
            "b",
            &[expired("u", "x", Some(false), Some(Running))],
            &nodes,
            TTL,
            TakeoverPolicy::Evidence,
        );
        assert!(steps.is_empty(), "{steps:?}");
        // Nobody has room: reported.
        let full = vec![up("a", 1, 1), dead("x")];
        let steps = plan_failovers(
            "a",
            &[expired("u", "x", Some(false), Some(Running))],
            &full,
            TTL,
            TakeoverPolicy::Evidence,
        );
        assert_eq!(kinds(&steps), vec!["report u"]);
    }

    #[test]
    fn failovers_spread_over_the_nodes_in_one_scan() {
        let nodes = vec![up("a", 10, 0), up("b", 10, 0), dead("x")];
        let users: Vec<Expired> = ["u1", "u2", "u3", "u4"]
            .iter()
            .map(|u| expired(u, "x", Some(false), Some(InstanceStatus::Running)))
            .collect();
        let on_a = plan_failovers("a", &users, &nodes, TTL, TakeoverPolicy::Evidence);
        let on_b = plan_failovers("b", &users, &nodes, TTL, TakeoverPolicy::Evidence);
        assert_eq!(on_a, vec![relaunch("u1", "x"), relaunch("u3", "x")]);
        assert_eq!(on_b, vec![relaunch("u2", "x"), relaunch("u4", "x")]);
    }
}
