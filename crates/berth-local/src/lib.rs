//! berth's local backend: each user's instance is a child process on this
//! host, supervised through a [`shim`] so it outlives berth restarts.
//!
//! [`LocalSpawner`] implements [`berth_core::Spawner`].

mod background;
mod config;
mod follow;
mod inner;
pub mod isolation;
mod lifecycle;
mod logs;
mod metrics;
mod paths;
mod ports;
mod process;
mod readiness;
mod reattach;
mod reconcile;
pub mod shim;
mod spawner;
mod supervisor;
mod template;

pub use config::{LocalConfig, Readiness};
pub use isolation::{Isolation, Limits, UidRange};
pub use spawner::{LocalError, LocalSpawner};
