//! The cluster the model runs: three nodes, each with its own drifting
//! clock, berth process (its [`Holdings`], the fencer's frozen set, one
//! renew in flight) and instances under shims; and one store, the
//! [`Table`], on the store's clock.
//!
//! Time is simulated. An instance's program runs while it is alive, not
//! frozen (by the fence or by hibernation) and, with fencing on, before
//! its shim's deadline on its node's clock. A running program writes all
//! the time, so the checks after every step are the two that matter: at
//! most one running program per user, and none under a stale epoch.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use berth_core::{Epoch, UserId};
use berth_store::ClaimOutcome;
use berth_store::lease::{Holdings, NodeInstant};

use super::table::{StoreMillis, Table};

pub const NODES: usize = 3;
pub const USERS: usize = 2;
/// The lease timing the model runs with: the defaults' proportions
/// (`ttl` 3 × `renew`, `fence_after` 2 × `renew`), in milliseconds.
pub const TTL: i64 = 300;
pub const FENCE_AFTER: u64 = 200;

/// A node's monotonic clock, in simulated milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Local(pub u64);

impl NodeInstant for Local {
    fn checked_after(self, d: Duration) -> Option<Self> {
        u64::try_from(d.as_millis())
            .ok()
            .and_then(|ms| self.0.checked_add(ms))
            .map(Local)
    }
}

/// What the model varies: whether nodes fence, and how far their clocks
/// may drift from the store's.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    pub fencing: bool,
    /// The slowest a node's clock may run against the store's, as a
    /// fraction `(num, den)`; it may run as much faster.
    pub slowest_rate: (u64, u64),
}

impl Setup {
    /// The bound the lease timing tolerates: a holder's `fence_after` on a
    /// clock running at `fence_after / ttl` of the store's rate still ends
    /// by the lease's end.
    pub const WITHIN_BOUND: Setup = Setup {
        fencing: true,
        slowest_rate: (FENCE_AFTER, TTL as u64),
    };
}

/// One step of the world. Node and user indices are taken modulo the
/// world's sizes.
#[derive(Debug, Clone)]
pub enum Op {
    /// Time passes: `dt` ms on the store's clock; each node's clock moves
    /// by an amount within the drift bound, picked by its `rate` byte.
    Advance {
        dt: u64,
        rates: [u8; NODES],
    },
    /// A launch: claim (or an operator's takeover), then start the program.
    Launch {
        node: usize,
        user: usize,
        operator: bool,
    },
    /// A stop: kill the program, then release the lease.
    Stop {
        node: usize,
        user: usize,
    },
    /// The program dies.
    Crash {
        node: usize,
        user: usize,
    },
    /// The supervisor restarts a dead program if its lease is proven.
    Respawn {
        node: usize,
        user: usize,
    },
    /// The renew tick sends a renew of every held lease.
    RenewSend {
        node: usize,
    },
    /// The store applies the node's renew in flight.
    RenewApply {
        node: usize,
    },
    /// The node reads the renew's answer.
    RenewAnswer {
        node: usize,
    },
    /// The node's renew fails on its side; the statement may still land.
    RenewDrop {
        node: usize,
    },
    /// A renew the node gave up on (or one of a berth that restarted)
    /// lands in the store after all.
    GhostApply,
    /// The fence timer fires.
    FenceTick {
        node: usize,
    },
    Heartbeat {
        node: usize,
    },
    Hibernate {
        node: usize,
        user: usize,
    },
    /// A request resumes a hibernated program.
    Resume {
        node: usize,
        user: usize,
    },
    /// berth's process is stopped (SIGSTOP) or continued; its shims run on.
    Pause {
        node: usize,
        paused: bool,
    },
    /// The node's link to the store is cut or healed.
    Cut {
        node: usize,
        cut: bool,
    },
    /// berth's process restarts and re-adopts its instances.
    Restart {
        node: usize,
    },
}

#[derive(Debug, Clone)]
struct Renew {
    asked: Vec<(UserId, Epoch)>,
    sent: Local,
    answer: Option<HashSet<UserId>>,
}

#[derive(Debug, Clone)]
struct Instance {
    user: UserId,
    epoch: Epoch,
    /// The shim's fence deadline on its node's clock; `None` without fencing.
    deadline: Option<Local>,
    frozen: bool,
    hibernated: bool,
    alive: bool,
}

#[derive(Debug, Clone)]
struct Node {
    name: String,
    clock: Local,
    paused: bool,
    cut: bool,
    holdings: Holdings<Local>,
    /// The fencer's frozen mains, with the epoch they were frozen under.
    fenced: HashMap<UserId, Epoch>,
    renew: Option<Renew>,
    /// At most one instance per user on a node (the lifecycle lock).
    instances: HashMap<UserId, Instance>,
}

impl Node {
    fn new(index: usize) -> Self {
        Self {
            name: format!("node-{index}"),
            clock: Local(1_000 * index as u64),
            paused: false,
            cut: false,
            holdings: Holdings::new(fence_after()),
            fenced: HashMap::new(),
            renew: None,
            instances: HashMap::new(),
        }
    }

    fn running(&self, instance: &Instance) -> bool {
        instance.alive
            && !instance.frozen
            && !instance.hibernated
            && instance
                .deadline
                .is_none_or(|deadline| self.clock < deadline)
    }

    /// Starts `user`'s program under `epoch`, running and unfenced, with
    /// the holdings' fence deadline (now, when nothing is proven).
    fn start_run(&mut self, user: UserId, epoch: Epoch, fencing: bool) {
        let deadline = fencing.then(|| self.holdings.fence_deadline().unwrap_or(self.clock));
        self.fenced.remove(&user);
        self.instances.insert(
            user.clone(),
            Instance {
                user,
                epoch,
                deadline,
                frozen: false,
                hibernated: false,
                alive: true,
            },
        );
    }
}

fn fence_after() -> Duration {
    Duration::from_millis(FENCE_AFTER)
}

/// What the model counts, to show the runs reach the cases that matter.
#[derive(Debug, Default, Clone, Copy)]
pub struct Reached {
    /// Claims that took a lease another node held.
    pub takeovers: usize,
    /// Renews answered after `fence_after`.
    pub late_answers: usize,
    /// Programs frozen by a passed fence deadline.
    pub fence_freezes: usize,
    /// Restarts that re-adopted a running program.
    pub readoptions: usize,
}

pub struct World {
    setup: Setup,
    now: StoreMillis,
    table: Table,
    nodes: Vec<Node>,
    ghosts: Vec<(String, Vec<(UserId, Epoch)>)>,
    pub reached: Reached,
}

impl World {
    pub fn new(setup: Setup) -> Self {
        Self {
            setup,
            now: 10_000,
            table: Table::default(),
            nodes: (0..NODES).map(Node::new).collect(),
            ghosts: Vec::new(),
            reached: Reached::default(),
        }
    }

    fn user(index: usize) -> UserId {
        #[allow(clippy::unwrap_used, reason = "a fixed, valid id")]
        UserId::parse(&format!("user-{}", index % USERS)).unwrap()
    }

    /// Applies `op`, then checks the invariants.
    pub fn step(&mut self, op: &Op) -> Result<(), String> {
        self.apply(op);
        self.shims_act();
        self.check()
    }

    fn apply(&mut self, op: &Op) {
        let fencing = self.setup.fencing;
        let now = self.now;
        match *op {
            Op::Advance { dt, rates } => {
                self.now += dt as i64;
                let (num, den) = self.setup.slowest_rate;
                let slowest = (dt * num).div_ceil(den);
                let fastest = dt * (2 * den - num) / den;
                for (node, rate) in self.nodes.iter_mut().zip(rates) {
                    let span = fastest.saturating_sub(slowest);
                    node.clock.0 += slowest + span * u64::from(rate) / 255;
                }
            }
            Op::Launch {
                node,
                user,
                operator,
            } => {
                let user = Self::user(user);
                let n = &mut self.nodes[node % NODES];
                if n.paused || n.cut || n.instances.get(&user).is_some_and(|i| i.alive) {
                    return;
                }
                let sent = n.clock;
                let previous = self.table.row(&user).and_then(|row| row.holder.clone());
                let outcome = if operator {
                    self.table.take_over(&user, &n.name, TTL, now)
                } else {
                    self.table.claim(&user, &n.name, TTL, true, now)
                };
                if let ClaimOutcome::Claimed { epoch } = outcome {
                    if previous.is_some_and(|holder| holder != n.name) {
                        self.reached.takeovers += 1;
                    }
                    n.holdings.claimed(&user, epoch, sent);
                    n.start_run(user, epoch, fencing);
                }
            }
            Op::Stop { node, user } => {
                let user = Self::user(user);
                let n = &mut self.nodes[node % NODES];
                if n.paused {
                    return;
                }
                // Ending what runs here needs no lease; the release does.
                if let Some(instance) = n.instances.get_mut(&user) {
                    instance.alive = false;
                }
                n.fenced.remove(&user);
                if let Some(epoch) = n.holdings.epoch_of(&user)
                    && !n.cut
                {
                    self.table.release(&user, &n.name, epoch, now);
                    n.holdings.forget_at(&user, epoch);
                }
            }
            Op::Crash { node, user } => {
                let user = Self::user(user);
                if let Some(instance) = self.nodes[node % NODES].instances.get_mut(&user) {
                    instance.alive = false;
                }
            }
            Op::Respawn { node, user } => {
                let user = Self::user(user);
                let n = &mut self.nodes[node % NODES];
                let Some(instance) = n.instances.get(&user) else {
                    return;
                };
                // The supervision's lease check: held under the same epoch,
                // and proven.
                let proven = n.holdings.epoch_of(&user) == Some(instance.epoch)
                    && !(fencing && n.holdings.fence_due(n.clock));
                if n.paused || instance.alive || !proven {
                    return;
                }
                let epoch = instance.epoch;
                n.start_run(user, epoch, fencing);
            }
            Op::RenewSend { node } => {
                let n = &mut self.nodes[node % NODES];
                if n.paused || n.renew.is_some() {
                    return;
                }
                let sent = n.clock;
                let asked = n.holdings.held();
                if asked.is_empty() {
                    // Nothing to ask: the keeper moves its clock and asks
                    // the store nothing.
                    n.holdings.renewed(asked, &HashSet::new(), sent);
                } else if !n.cut {
                    n.renew = Some(Renew {
                        asked,
                        sent,
                        answer: None,
                    });
                }
            }
            Op::RenewApply { node } => {
                let n = &mut self.nodes[node % NODES];
                if let Some(renew) = n.renew.as_mut()
                    && renew.answer.is_none()
                {
                    let renewed = self.table.renew(&n.name, &renew.asked, TTL, now);
                    renew.answer = Some(renewed.into_iter().collect());
                }
            }
            Op::RenewDrop { node } => {
                let n = &mut self.nodes[node % NODES];
                if let Some(renew) = n.renew.take()
                    && renew.answer.is_none()
                {
                    self.ghosts.push((n.name.clone(), renew.asked));
                }
            }
            Op::GhostApply => {
                if !self.ghosts.is_empty() {
                    let (name, asked) = self.ghosts.remove(0);
                    self.table.renew(&name, &asked, TTL, now);
                }
            }
            Op::RenewAnswer { node } => self.renew_answer(node % NODES),
            Op::FenceTick { node } => {
                let n = &mut self.nodes[node % NODES];
                if n.paused || !fencing || !n.holdings.fence_due(n.clock) {
                    return;
                }
                for instance in n.instances.values_mut().filter(|i| i.alive) {
                    if let Some(epoch) = n.holdings.epoch_of(&instance.user) {
                        n.fenced.insert(instance.user.clone(), epoch);
                        instance.frozen = true;
                    }
                }
            }
            Op::Heartbeat { node } => {
                let n = &self.nodes[node % NODES];
                if !n.paused && !n.cut {
                    self.table.heartbeat(&n.name, now);
                }
            }
            Op::Hibernate { node, user } => {
                let user = Self::user(user);
                let n = &mut self.nodes[node % NODES];
                if let Some(instance) = n.instances.get_mut(&user)
                    && !n.paused
                    && instance.alive
                {
                    instance.hibernated = true;
                    instance.frozen = true;
                }
            }
            Op::Resume { node, user } => {
                let user = Self::user(user);
                let n = &mut self.nodes[node % NODES];
                let fenced = n.fenced.contains_key(&user);
                if let Some(instance) = n.instances.get_mut(&user)
                    && !n.paused
                    && instance.hibernated
                {
                    // A request never thaws a fenced program.
                    instance.hibernated = false;
                    instance.frozen = fenced;
                }
            }
            Op::Pause { node, paused } => self.nodes[node % NODES].paused = paused,
            Op::Cut { node, cut } => self.nodes[node % NODES].cut = cut,
            Op::Restart { node } => self.restart(node % NODES),
        }
    }

    fn renew_answer(&mut self, node: usize) {
        let n = &mut self.nodes[node];
        if n.paused {
            return;
        }
        let Some(Renew {
            asked,
            sent,
            answer: Some(renewed),
        }) = n.renew.take()
        else {
            return;
        };
        for (user, epoch) in n.holdings.renewed(asked, &renewed, sent) {
            // Lost: kill it.
            if let Some(instance) = n.instances.get_mut(&user)
                && instance.epoch == epoch
            {
                instance.alive = false;
            }
            n.fenced.remove(&user);
        }
        let Some(deadline) = sent.checked_after(fence_after()) else {
            return;
        };
        if n.clock >= deadline {
            // A late answer neither extends nor thaws.
            self.reached.late_answers += 1;
            return;
        }
        if self.setup.fencing {
            for instance in n.instances.values_mut().filter(|i| i.alive) {
                instance.deadline = Some(deadline);
            }
        }
        let thawable: Vec<UserId> = n
            .fenced
            .iter()
            .filter(|(user, epoch)| n.holdings.epoch_of(user) == Some(**epoch))
            .map(|(user, _)| user.clone())
            .collect();
        for user in thawable {
            n.fenced.remove(&user);
            if let Some(instance) = n.instances.get_mut(&user)
                && !instance.hibernated
            {
                instance.frozen = false;
            }
        }
    }

    /// berth restarts on `node`: a new keeper, the node's heartbeat, the
    /// leases the store says it holds, and each instance re-adopted under
    /// its lease or ended. The shims, and their deadlines, carry on.
    fn restart(&mut self, node: usize) {
        let now = self.now;
        let n = &mut self.nodes[node];
        if n.cut {
            return;
        }
        n.paused = false;
        if let Some(renew) = n.renew.take()
            && renew.answer.is_none()
        {
            self.ghosts.push((n.name.clone(), renew.asked));
        }
        n.holdings = Holdings::new(fence_after());
        n.fenced.clear();
        self.table.heartbeat(&n.name, now);
        let held = self.table.held_by(&n.name, now);
        let sent = n.clock;
        for instance in n.instances.values_mut().filter(|i| i.alive) {
            if held.get(&instance.user) == Some(&instance.epoch) {
                n.holdings.adopt(instance.user.clone(), instance.epoch);
            } else {
                match self.table.claim(&instance.user, &n.name, TTL, true, now) {
                    ClaimOutcome::Claimed { epoch } => {
                        n.holdings.claimed(&instance.user, epoch, sent);
                        instance.epoch = epoch;
                    }
                    ClaimOutcome::Busy { .. } => {
                        instance.alive = false;
                        continue;
                    }
                }
            }
            self.reached.readoptions += 1;
            if instance.frozen && !instance.hibernated {
                n.fenced.insert(instance.user.clone(), instance.epoch);
            }
        }
    }

    /// A shim whose deadline passed freezes its program and says so; the
    /// controller notes it as fenced.
    fn shims_act(&mut self) {
        for n in &mut self.nodes {
            let clock = n.clock;
            for instance in n.instances.values_mut() {
                let passed = instance.deadline.is_some_and(|deadline| clock >= deadline);
                if instance.alive && passed && !instance.frozen {
                    instance.frozen = true;
                    self.reached.fence_freezes += 1;
                    if !instance.hibernated {
                        n.fenced.insert(instance.user.clone(), instance.epoch);
                    }
                }
            }
        }
    }

    /// At most one running program per user, and none under an epoch the
    /// store has moved past.
    fn check(&self) -> Result<(), String> {
        let mut running: HashMap<&UserId, Vec<(&str, Epoch)>> = HashMap::new();
        for n in &self.nodes {
            for instance in n.instances.values().filter(|i| n.running(i)) {
                running
                    .entry(&instance.user)
                    .or_default()
                    .push((&n.name, instance.epoch));
            }
        }
        for (user, runs) in running {
            let current = self.table.epoch(user);
            if runs.len() > 1 {
                return Err(format!(
                    "{user} runs on two nodes at store time {}: {runs:?}",
                    self.now
                ));
            }
            if let Some((node, epoch)) = runs.iter().find(|(_, epoch)| *epoch != current) {
                return Err(format!(
                    "{user} runs on {node} under epoch {epoch}, but the store's epoch is {current}"
                ));
            }
        }
        Ok(())
    }
}
