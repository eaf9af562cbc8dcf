//! A model of the lease protocol, searched by proptest.
//!
//! `world.rs` runs three nodes and one store in simulated time, each node's
//! lease bookkeeping being the real [`berth_store::lease::Holdings`]:
//! claims, takeovers (with evidence, and an operator's), renews sent,
//! applied, answered late or lost, release, expiry, the fence timer and the
//! shims' deadlines, freeze and thaw, hibernation, node pauses, cuts from
//! the store and restarts, with each node's clock drifting within a bound.
//! After every step it checks that at most one program per user runs and
//! that none runs under a stale epoch.
//!
//! The search must be able to fail: with fencing off, or with clocks
//! drifting past the bound the timing tolerates, it finds a violation.
//! `replay.rs` runs the store's side of such sequences against the real
//! SQLite and PostgreSQL stores and compares every answer with the twin.

mod replay;
mod table;
mod world;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestError, TestRng, TestRunner};

use world::{NODES, Op, Reached, Setup, World};

/// A clock's rate byte: mostly the bound's two ends, where a protocol that
/// leans on the clocks breaks first.
fn rate() -> impl Strategy<Value = u8> {
    prop_oneof![2 => Just(0), 1 => Just(255), 1 => any::<u8>()]
}

fn op() -> impl Strategy<Value = Op> {
    let node = 0..NODES;
    let user = 0..world::USERS;
    prop_oneof![
        6 => (1..=80u64, prop::array::uniform3(rate())).prop_map(|(dt, rates)| Op::Advance { dt, rates }),
        4 => (node.clone(), user.clone(), prop::bool::weighted(0.3))
            .prop_map(|(node, user, operator)| Op::Launch { node, user, operator }),
        1 => (node.clone(), user.clone()).prop_map(|(node, user)| Op::Stop { node, user }),
        1 => (node.clone(), user.clone()).prop_map(|(node, user)| Op::Crash { node, user }),
        2 => (node.clone(), user.clone()).prop_map(|(node, user)| Op::Respawn { node, user }),
        4 => node.clone().prop_map(|node| Op::RenewSend { node }),
        4 => node.clone().prop_map(|node| Op::RenewApply { node }),
        4 => node.clone().prop_map(|node| Op::RenewAnswer { node }),
        1 => node.clone().prop_map(|node| Op::RenewDrop { node }),
        1 => Just(Op::GhostApply),
        3 => node.clone().prop_map(|node| Op::FenceTick { node }),
        3 => node.clone().prop_map(|node| Op::Heartbeat { node }),
        1 => (node.clone(), user.clone()).prop_map(|(node, user)| Op::Hibernate { node, user }),
        1 => (node.clone(), user).prop_map(|(node, user)| Op::Resume { node, user }),
        1 => (node.clone(), any::<bool>()).prop_map(|(node, paused)| Op::Pause { node, paused }),
        2 => (node.clone(), any::<bool>()).prop_map(|(node, cut)| Op::Cut { node, cut }),
        1 => node.prop_map(|node| Op::Restart { node }),
    ]
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), 1..150)
}

fn run(setup: Setup, ops: &[Op]) -> (Result<(), String>, Reached) {
    let mut world = World::new(setup);
    for (i, op) in ops.iter().enumerate() {
        if let Err(violation) = world.step(op) {
            return (
                Err(format!("step {i} ({op:?}): {violation}")),
                world.reached,
            );
        }
    }
    (Ok(()), world.reached)
}

/// A runner of `cases` sequences from a fixed seed, so that every run of
/// the suite searches the same ones, and nothing is written to disk.
fn fixed_seed_runner(cases: u32) -> TestRunner {
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha))
}

/// Searches `cases` sequences ([`fixed_seed_runner`]); the counts of what
/// was reached, summed.
fn search(setup: Setup, cases: u32) -> (Result<(), TestError<Vec<Op>>>, Reached) {
    let mut runner = fixed_seed_runner(cases);
    let reached = std::cell::Cell::new(Reached::default());
    let result = runner.run(&ops(), |ops| {
        let (outcome, r) = run(setup, &ops);
        let mut sum = reached.get();
        sum.takeovers += r.takeovers;
        sum.late_answers += r.late_answers;
        sum.fence_freezes += r.fence_freezes;
        sum.readoptions += r.readoptions;
        reached.set(sum);
        outcome.map_err(TestCaseError::fail)
    });
    (result, reached.get())
}

#[test]
fn at_most_one_program_per_user_runs_and_none_under_a_stale_epoch() {
    let (result, reached) = search(Setup::WITHIN_BOUND, 4_000);
    if let Err(e) = result {
        panic!("the lease protocol broke: {e}");
    }
    eprintln!("reached over the search: {reached:?}");
    // The search reached the cases that could break it.
    assert!(reached.takeovers > 100, "{reached:?}");
    assert!(reached.late_answers > 100, "{reached:?}");
    assert!(reached.fence_freezes > 100, "{reached:?}");
    assert!(reached.readoptions > 100, "{reached:?}");
}

fn assert_found(setup: Setup) -> String {
    match search(setup, 4_000).0 {
        Err(TestError::Fail(reason, ops)) => {
            eprintln!("found ({} steps): {reason}\n{ops:#?}", ops.len());
            reason.to_string()
        }
        other => panic!("expected the search to find a violation, got {other:?}"),
    }
}

#[test]
fn with_fencing_disabled_the_search_finds_two_writers() {
    let reason = assert_found(Setup {
        fencing: false,
        ..Setup::WITHIN_BOUND
    });
    assert!(reason.contains("runs on two nodes"), "{reason}");
}

#[test]
fn clocks_drifting_past_the_bound_break_it() {
    // A clock running at half the store's rate: `fence_after` (200 ms)
    // then lasts 400 ms, past the 300 ms lease.
    let reason = assert_found(Setup {
        slowest_rate: (1, 2),
        ..Setup::WITHIN_BOUND
    });
    assert!(reason.contains("runs on two nodes"), "{reason}");
}
