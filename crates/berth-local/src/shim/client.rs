//! berth's side of the shim: spawning one, attaching to one, talking to it.

use std::path::Path;

use super::protocol::{ShimCommand, ShimEvent, ShimSpec, ShimState};

/// Why talking to a shim failed.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    /// The program could not be started; the message names it.
    #[error("{0}")]
    SpawnFailed(String),
    /// The shim process itself could not be started or misbehaved.
    #[error("shim failed: {0}")]
    Shim(String),
    /// No live shim answers at this state file / socket.
    #[error("no live shim: {0}")]
    Gone(String),
    #[error("shim i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// A connection to one shim: receives its events.
pub struct ShimHandle {
    _private: (),
}

/// Sends commands to one shim. Cheap to clone; usable while another task
/// owns the [`ShimHandle`].
#[derive(Clone)]
pub struct ShimControl {
    _private: (),
}

impl ShimHandle {
    /// Starts `shim_exe shim_args…` (normally berth itself with `["shim"]`),
    /// hands it `spec`, and connects to its socket. Returns once the program
    /// is spawned (not ready).
    pub async fn spawn(
        _shim_exe: &Path,
        _shim_args: &[String],
        _spec: &ShimSpec,
    ) -> Result<(ShimHandle, ShimState), ShimError> {
        todo!()
    }

    /// Connects to the live shim whose state file is `state_path`.
    ///
    /// Fails with [`ShimError::Gone`] when the shim is not running (its
    /// state file may still hold the program's exit: see
    /// [`ShimHandle::read_state`]).
    pub async fn attach(_state_path: &Path) -> Result<(ShimHandle, ShimState), ShimError> {
        todo!()
    }

    /// Reads a state file without connecting.
    pub fn read_state(_state_path: &Path) -> Result<ShimState, ShimError> {
        todo!()
    }

    /// The next event; `None` once the shim has gone away (its connection
    /// closed). After `None`, [`ShimHandle::read_state`] tells how the
    /// program ended, if the shim recorded it.
    pub async fn next_event(&mut self) -> Option<ShimEvent> {
        todo!()
    }

    pub fn control(&self) -> ShimControl {
        todo!()
    }
}

impl ShimControl {
    pub async fn send(&self, _command: ShimCommand) -> Result<(), ShimError> {
        todo!()
    }
}
