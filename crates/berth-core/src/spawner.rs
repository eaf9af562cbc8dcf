use std::time::Duration;

use async_trait::async_trait;

use crate::{
    BreakerInfo, Endpoint, Instance, InstanceStatus, LaunchRequest, ProbeReport, RestartResult,
    SpawnError, UserId, UserStatus,
};

/// How long a client is told to wait when an instance is still starting.
pub const STARTING_RETRY_MS: u64 = 2000;

/// What the traffic path (the proxy) needs of a node: where each user's
/// instance listens, and waking it. A small part of [`Spawner`], so that
/// the proxy depends on no more than it uses.
///
/// Implementations keep the hot-path queries ([`Traffic::endpoint_for`],
/// [`Traffic::touch`]) in memory: they take no lock across an `.await` and
/// never query the store.
#[async_trait]
pub trait Traffic: Send + Sync + 'static {
    /// Starts the user's main instance.
    ///
    /// Fails with [`SpawnError::AlreadyRunning`] if one is live and with
    /// [`SpawnError::CircuitOpen`] during a breaker cooldown unless
    /// `request.force` is set. Returns once the process is spawned; use
    /// [`Traffic::wait_for_ready`] to wait for readiness.
    async fn launch(&self, user: &UserId, request: LaunchRequest) -> Result<Instance, SpawnError>;

    /// The open breaker of `user`, if any.
    async fn breaker_info(&self, user: &UserId) -> Result<Option<BreakerInfo>, SpawnError>;

    /// Every instance this backend knows of.
    async fn list(&self) -> Result<Vec<Instance>, SpawnError>;

    /// Where the proxy sends traffic; `None` unless the main is running.
    fn endpoint_for(&self, user: &UserId) -> Option<Endpoint>;

    /// The launch token captured from the program's output, if any.
    fn launch_token(&self, user: &UserId) -> Option<String>;

    /// Waits until the main is ready and returns it. Returns at once with
    /// the current record (or `None`) if there is no live instance.
    async fn wait_for_ready(
        &self,
        user: &UserId,
        timeout: Duration,
    ) -> Result<Option<Instance>, SpawnError>;

    /// Records activity and answers whether the user's main here is
    /// hibernated, so a request must [`Traffic::resume`] it before it is
    /// forwarded. Cheap and in memory: a timestamp, flushed periodically,
    /// and a flag read *after* it (a hibernation under way sees the touch
    /// and backs off); one lookup, as the proxy asks on every request.
    fn touch(&self, user: &UserId) -> bool;

    /// Resumes the user's hibernated main: thaws it at once (unless it is
    /// frozen for fencing too, which only a renew lifts) and records it
    /// running. A running main is left as it is; `not_found` without a
    /// live one.
    async fn resume(&self, user: &UserId) -> Result<Instance, SpawnError> {
        Err(SpawnError::InvalidRequest(format!(
            "this backend cannot resume the instance of {user}"
        )))
    }

    /// Subscribes to instance changes (status, readiness, endpoint, the
    /// stage of a spawn).
    fn subscribe(&self) -> tokio::sync::broadcast::Receiver<crate::InstanceEvent>;
}

/// The lifecycle seam between the API and a backend: everything an
/// operator or a user can do to an instance, on top of [`Traffic`].
///
/// The controller implements it; the API depends on this trait, the proxy
/// on [`Traffic`] only.
#[async_trait]
pub trait Spawner: Traffic {
    /// An operator's takeover: claims `user`'s expired lease whatever the
    /// takeover policy and launches under the new epoch, as one step under
    /// the user's lifecycle lock, so the backend's lease holder knows (and
    /// renews) that epoch from the start.
    ///
    /// Fails with [`SpawnError::LeaseBusy`] when the lease is not expired.
    /// Backends without leases answer [`SpawnError::NotFound`].
    async fn take_over(
        &self,
        user: &UserId,
        request: LaunchRequest,
    ) -> Result<Instance, SpawnError> {
        let _ = request;
        Err(SpawnError::NotFound {
            user: user.clone(),
            what: "lease takeover".into(),
        })
    }

    /// Restarts the live main instance and resets its crash budget.
    async fn restart_main(&self, user: &UserId) -> Result<Instance, SpawnError>;

    /// Clears the user's breaker and crash counters.
    async fn reset_breaker(&self, user: &UserId) -> Result<(), SpawnError>;

    /// Records `user`'s own egress `policy` (`None`: the node's again)
    /// and gives it to their instances here from their next connection
    /// on; an instance started later, on any node, starts with it.
    async fn set_egress(
        &self,
        user: &UserId,
        policy: Option<&crate::egress::EgressPolicy>,
    ) -> Result<(), SpawnError> {
        let _ = (user, policy);
        Err(SpawnError::InvalidRequest(
            "this node does not guard its instances' egress".into(),
        ))
    }

    /// Restarts every main this node owns, with bounded concurrency, and
    /// reports one result per user.
    async fn restart_all_mains(&self) -> Vec<RestartResult>;

    /// Starts the one-shot repair job for `user`.
    async fn spawn_watchdog(&self, user: &UserId) -> Result<Instance, SpawnError>;

    /// The user's main and watchdog records.
    async fn status(&self, user: &UserId) -> Result<UserStatus, SpawnError>;

    /// Stops the main (and watchdog): SIGTERM to the process group, SIGKILL
    /// after the grace period. Stopping a user with no instance succeeds.
    async fn stop(&self, user: &UserId) -> Result<(), SpawnError>;

    /// Releases berth's own resources. Instances keep running.
    async fn teardown(&self);

    /// Restart (or force-launch) the main, wait for ready, wait a settle
    /// time, and report whether it is still running.
    async fn restart_and_probe(&self, user: &UserId) -> ProbeReport;

    /// Freezes the user's running main with its memory intact, after its
    /// `pre_hibernate` hook; its lease stays held. A hibernated main is
    /// left as it is. Fails with `not_found` without a running main, and
    /// with `invalid_request` where the runtime cannot freeze.
    async fn hibernate(&self, user: &UserId) -> Result<Instance, SpawnError> {
        Err(SpawnError::InvalidRequest(format!(
            "this backend cannot hibernate the instance of {user}"
        )))
    }

    /// The last `tail` lines of the main instance's output.
    async fn logs(&self, user: &UserId, tail: usize) -> Result<Vec<String>, SpawnError>;

    /// The last `tail` lines of the main instance's output, then every new
    /// line until the receiver is dropped (`logs -f`). A backend that
    /// cannot follow its logs says so rather than pretending.
    async fn follow_logs(
        &self,
        user: &UserId,
        tail: usize,
    ) -> Result<tokio::sync::mpsc::Receiver<String>, SpawnError> {
        let _ = tail;
        Err(SpawnError::NotFound {
            user: user.clone(),
            what: "log stream".into(),
        })
    }

    /// Fences the user's main on this node if, and only if, it runs under
    /// lease `epoch`: kills it at once, records it stopped, and forgets the
    /// lease (ARCHITECTURE.md, invariant 7: the message names the old
    /// holder's epoch, so it can never hit a newer instance). Returns
    /// whether an instance was fenced. Backends without leases fence
    /// nothing.
    async fn fence(&self, _user: &UserId, _epoch: crate::Epoch) -> Result<bool, SpawnError> {
        Ok(false)
    }

    /// The last change of `user`'s main this node published, the `queued`
    /// and `spawning` stages of a launch included, if any: where a
    /// progress stream opened now begins. A backend that publishes no
    /// stages of its own answers `None`, and progress begins from the
    /// record.
    fn last_main_event(&self, _user: &UserId) -> Option<crate::InstanceEvent> {
        None
    }
}

/// Waits up to `timeout` for `user`'s main to be ready, and says what a
/// client gets ([`readiness_answer`]). Reads the breaker only for a failed
/// instance.
pub async fn wait_ready(
    spawner: &dyn Traffic,
    user: &UserId,
    timeout: Duration,
) -> Result<Instance, SpawnError> {
    let current = spawner.wait_for_ready(user, timeout).await?;
    let breaker = match &current {
        Some(i) if i.status == InstanceStatus::Failed => spawner.breaker_info(user).await?,
        _ => None,
    };
    readiness_answer(user, current, breaker)
}

/// What a client gets for an instance it waited on: the one mapping
/// from readiness to errors, for the API and the proxy alike.
///
/// * ready and running → the instance;
/// * failed → `instance_circuit_open` while the breaker is open, else
///   `spawn_failed` with the instance's last error;
/// * stopped before it was ready → `spawn_failed`;
/// * still starting (or crashed, a restart pending, or no record) →
///   `instance_starting`, to retry after [`STARTING_RETRY_MS`].
pub fn readiness_answer(
    user: &UserId,
    current: Option<Instance>,
    breaker: Option<BreakerInfo>,
) -> Result<Instance, SpawnError> {
    match current {
        Some(i) if i.status.is_routable() && i.ready => Ok(i),
        Some(i) if i.status == InstanceStatus::Failed => match breaker {
            Some(open) => Err(SpawnError::CircuitOpen {
                user: user.clone(),
                opens: open.opens,
                retry_at: open.cooldown_until,
            }),
            None => {
                Err(SpawnError::SpawnFailed(i.last_error.unwrap_or_else(|| {
                    "the instance failed to start".to_owned()
                })))
            }
        },
        Some(i) if i.status == InstanceStatus::Stopped => Err(SpawnError::SpawnFailed(format!(
            "the instance stopped before it was ready{}",
            i.last_error.map(|e| format!(": {e}")).unwrap_or_default()
        ))),
        _ => Err(SpawnError::Starting {
            user: user.clone(),
            retry_after_ms: STARTING_RETRY_MS,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ErrorCode, Role};

    fn instance(status: InstanceStatus, ready: bool, last_error: Option<&str>) -> Instance {
        Instance {
            id: "i".into(),
            user: UserId::parse("alice").unwrap(),
            role: Role::Main,
            status,
            node: "n".into(),
            epoch: 1,
            port: Some(1),
            pid: Some(1),
            runtime_ref: None,
            folder: String::new(),
            started_at: 0,
            ready,
            restarts: 0,
            last_error: last_error.map(str::to_owned),
            exit_code: None,
            last_active: 0,
            hibernated_at: None,
        }
    }

    #[test]
    fn readiness_table() {
        use InstanceStatus::{Crashed, Failed, Running, Starting, Stopped};
        let alice = UserId::parse("alice").unwrap();
        let open = BreakerInfo {
            opens: 2,
            opened_at: 1,
            cooldown_until: 99,
        };
        type Case = (
            &'static str,
            Option<Instance>,
            Option<BreakerInfo>,
            Result<(), ErrorCode>,
            &'static str,
        );
        let cases: Vec<Case> = vec![
            (
                "ready",
                Some(instance(Running, true, None)),
                None,
                Ok(()),
                "",
            ),
            (
                "running, not ready yet",
                Some(instance(Running, false, None)),
                None,
                Err(ErrorCode::InstanceStarting),
                "",
            ),
            (
                "starting",
                Some(instance(Starting, false, None)),
                None,
                Err(ErrorCode::InstanceStarting),
                "",
            ),
            (
                "crashed, restart pending",
                Some(instance(Crashed, false, None)),
                None,
                Err(ErrorCode::InstanceStarting),
                "",
            ),
            (
                "no record",
                None,
                None,
                Err(ErrorCode::InstanceStarting),
                "",
            ),
            (
                "failed, breaker open",
                Some(instance(Failed, false, Some("boom"))),
                Some(open),
                Err(ErrorCode::InstanceCircuitOpen),
                "after 2 open",
            ),
            (
                "failed to spawn",
                Some(instance(Failed, false, Some("no such file"))),
                None,
                Err(ErrorCode::SpawnFailed),
                "no such file",
            ),
            (
                "failed, no message",
                Some(instance(Failed, false, None)),
                None,
                Err(ErrorCode::SpawnFailed),
                "failed to start",
            ),
            (
                "stopped first",
                Some(instance(Stopped, false, Some("fenced"))),
                None,
                Err(ErrorCode::SpawnFailed),
                "stopped before it was ready: fenced",
            ),
        ];
        for (name, current, breaker, want, message) in cases {
            let got = readiness_answer(&alice, current, breaker);
            assert_eq!(
                got.as_ref().map(drop).map_err(SpawnError::code),
                want,
                "{name}"
            );
            if let Err(e) = got {
                assert!(e.to_string().contains(message), "{name}: {e}");
            }
        }
    }
}
