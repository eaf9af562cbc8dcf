//! The vocabulary of berth, shared by every other crate.
//!
//! This crate holds what the rest of the system agrees on and nothing that
//! does I/O:
//!
//! * [`UserId`] and [`Slug`]: validated user ids and their file/DNS-safe form;
//! * the instance model ([`Instance`], [`Role`], [`InstanceStatus`], …);
//! * [`SpawnError`] and the stable [`ErrorCode`]s the HTTP API exposes, and
//!   [`ErrorBody`], the JSON of every error answer;
//! * the [`Spawner`] trait, the node-local surface the API uses (the
//!   controller implements it), and [`Traffic`], the part of it the proxy
//!   uses;
//! * [`runtime`]: the [`runtime::Runtime`] trait, how a program is run (local
//!   shims, Kubernetes pods), and, with feature `runtime-contract`, the
//!   `runtime_contract` suite every runtime passes;
//! * [`program`]: the program contract every runtime keeps: its
//!   environment, the placeholders of its command, readiness and the launch
//!   token;
//! * [`policy`]: crash backoff, the circuit breaker, idle reaping, node
//!   liveness and placement as pure functions over plain data, so they are
//!   tested without processes or a cluster.
//!
//! ```
//! use berth_core::UserId;
//!
//! let alice = UserId::parse("alice").unwrap();
//! assert_eq!(alice.slug().as_str(), "alice");
//! assert!(UserId::parse("..").is_err());
//! ```

#![forbid(unsafe_code)]

pub mod credential;
pub mod egress;
mod error;
mod folder;
mod id;
mod model;
pub mod policy;
pub mod program;
pub mod runtime;
#[cfg(feature = "runtime-contract")]
pub mod runtime_contract;
pub mod shim_wire;
mod spawner;
mod time;
mod uids;
mod wire;

pub use error::{ErrorCode, SpawnError};
pub use folder::normalize_folder;
pub use id::{InvalidSlug, InvalidUserId, MAX_SLUG_LEN, Slug, UserId};
pub use model::{
    BreakerInfo, Endpoint, Epoch, Instance, InstanceEvent, InstanceStatus, LaunchRequest,
    MAX_PATCH_BYTES, ProbeReport, Reach, RestartResult, Role, Stage, UserStatus,
};
pub use program::Readiness;
pub use spawner::{STARTING_RETRY_MS, Spawner, Traffic, readiness_answer, wait_ready};
pub use time::{UnixMillis, unix_millis_now};
pub use uids::UidRange;
pub use wire::ErrorBody;
