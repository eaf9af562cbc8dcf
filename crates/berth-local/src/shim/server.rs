//! The shim process itself (`berth shim`).

/// Runs a shim: reads its [`super::ShimSpec`] from stdin and never returns
/// until the program has exited. The caller exits with the returned code.
pub fn run() -> i32 {
    todo!()
}
