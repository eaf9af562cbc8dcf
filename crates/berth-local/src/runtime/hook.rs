//! Hooks through the runtime: a command runs in the instance's shim,
//! beside the program (see `shim::server::hook`); a `POST` goes to the
//! instance's port the way readiness probes and the proxy reach it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use berth_core::runtime::{HookAction, HookCall, HookOutcome, RuntimeError, RuntimeRef};

use super::run::Run;
use crate::readiness::http_status;
use crate::shim::{ShimCommand, ShimEvent, ShimHandle};

/// What the shim may take beyond a hook's grace to start it, kill it and
/// report it.
const SHIM_OVERHEAD: Duration = Duration::from_secs(10);

/// Tells one hook's answer from another's: a shim announces every answer
/// to every connection.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Runs `call` for `run`, the run `instance` names.
pub(super) async fn run_hook(
    instance: &RuntimeRef,
    run: &Run,
    call: &HookCall,
) -> Result<HookOutcome, RuntimeError> {
    match &call.action {
        HookAction::Command(argv) => command(instance, run, call, argv).await,
        HookAction::Post(path) => {
            let Some(port) = run.port else {
                return Err(RuntimeError::Failed(format!(
                    "{instance} has no port to POST {path} to"
                )));
            };
            let status = tokio::time::timeout(
                call.grace,
                http_status(hyper::Method::POST, port, &run.reach, path),
            )
            .await;
            Ok(HookOutcome::of_post(status.ok()))
        }
    }
}

/// Asks the shim of `run` to run `argv` and waits for its answer, on a
/// connection of its own (the run's own connection feeds its event pump).
async fn command(
    instance: &RuntimeRef,
    run: &Run,
    call: &HookCall,
    argv: &[String],
) -> Result<HookOutcome, RuntimeError> {
    let failed = |why: String| RuntimeError::Failed(format!("hook {}: {why}", call.name));
    let (mut handle, state) = ShimHandle::attach(&run.state_path)
        .await
        .map_err(|e| failed(e.to_string()))?;
    if (state.pid, state.pid_start) != (run.pid, run.pid_start) {
        return Err(RuntimeError::Gone(instance.clone()));
    }
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    handle
        .control()
        .send(ShimCommand::Hook {
            id,
            name: call.name.to_owned(),
            argv: argv.to_vec(),
            grace_ms: u64::try_from(call.grace.as_millis()).unwrap_or(u64::MAX),
        })
        .await
        .map_err(|e| failed(e.to_string()))?;
    let answer = async {
        loop {
            match handle.next_event().await {
                Some(ShimEvent::HookDone { id: done, outcome }) if done == id => {
                    return outcome.map_err(failed);
                }
                Some(ShimEvent::Exited { .. }) | None => {
                    return Err(RuntimeError::Gone(instance.clone()));
                }
                Some(_) => {}
            }
        }
    };
    tokio::time::timeout(call.grace + SHIM_OVERHEAD, answer)
        .await
        .unwrap_or_else(|_| Err(failed("the shim did not answer".to_owned())))
}
