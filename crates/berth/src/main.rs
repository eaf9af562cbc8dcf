//! The `berth` binary: `berth serve`, the built-in `demo-app`, the client
//! commands, and the hidden `berth shim` that supervises one instance.

use std::process::ExitCode;

fn main() -> ExitCode {
    // The shim is dispatched before any argument parsing or runtime setup:
    // it must start fast and run single-threaded (see berth_local::shim).
    if std::env::args_os().nth(1).is_some_and(|a| a == "shim") {
        let code = berth_local::shim::run();
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    eprintln!("berth: command line not implemented yet");
    ExitCode::FAILURE
}
