//! berth's local runtime: each user's instance is a program on this host,
//! supervised through a [`shim`] so it outlives berth restarts.
//!
//! [`LocalRuntime`] implements [`berth_core::runtime::Runtime`]: it runs
//! programs and reports what happens to them. What to run when, and for
//! how long (the lease, fencing, crash policy, reaping), is the
//! controller's (`berth-controller`); this crate knows nothing of the
//! store.

mod config;
mod environment;
mod follow;
pub mod isolation;
mod logs;
mod paths;
mod ports;
mod process;
mod readiness;
mod runtime;
pub mod shim;
#[cfg(test)]
mod test_host;

/// The default number of ports of the instance range one instance may
/// hold, its own included.
pub const DEFAULT_MAX_PORTS: usize = 16;

/// The default bound of an instance's log on disk: 64 MiB.
pub const DEFAULT_LOG_MAX_BYTES: u64 = 64 * 1024 * 1024;
/// The least bound: two files each able to hold the longest piece the
/// shim writes at once (64 KiB).
pub const MIN_LOG_MAX_BYTES: u64 = 128 * 1024;
pub use config::{ConfigError, IsolationTable};
pub use isolation::{Isolation, Limits, ListenerCap, UidRange, open_files_warning};
pub use runtime::{Accounts, LocalRuntime, LocalRuntimeConfig};

/// The shim's scanner of a program's output for its ready line and launch
/// token, for the fuzz targets (`fuzz/` at the repository's root) only: it
/// exists with the `fuzzing` feature, which nothing else enables, and is
/// no API.
#[cfg(feature = "fuzzing")]
pub mod fuzzing {
    pub use crate::shim::output::{MAX_PIECE, ready_token, take_pieces};
}

/// Why the local runtime could not start.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    /// The configuration cannot work as given (an empty command, no room
    /// for socket paths, isolation without accounts); the message says why.
    #[error("{0}")]
    Config(String),
    /// A directory berth needs (the data dir) could not be made or
    /// resolved.
    #[error("cannot prepare {path}: {source}")]
    Io {
        /// The directory.
        path: std::path::PathBuf,
        /// What the file system said.
        source: std::io::Error,
    },
    /// The host cannot isolate instances at the configured level.
    #[error(transparent)]
    Host(#[from] crate::isolation::HostError),
}
