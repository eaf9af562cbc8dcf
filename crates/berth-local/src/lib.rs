//! berth's local backend: each user's instance is a child process on this
//! host, supervised through a [`shim`] so it outlives berth restarts.
//!
//! [`LocalSpawner`] implements [`berth_core::Spawner`].

mod config;
pub mod shim;
mod spawner;

pub use config::{Isolation, LocalConfig, Readiness};
pub use spawner::{LocalError, LocalSpawner};
