//! Lifecycle decisions as pure functions over plain data.
//!
//! Nothing here reads a clock, spawns a process or touches the store: the
//! caller passes `now` and the state in, and acts on the decision that comes
//! out. That keeps every number of the crash policy and the idle
//! reaper, and the placement rules, testable in a table.

mod crash;
mod placement;
mod reap;
pub mod supervision;

pub use crash::{CrashDecision, CrashPolicy, CrashState, LaunchKind};
pub use placement::{NodeState, NodeView, no_room, place, places_left};
pub use reap::{IdleAction, ReapCandidate, ReapPlan, ReapPolicy, plan_reaping, select_for_reaping};
