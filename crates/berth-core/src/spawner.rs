use std::time::Duration;

use async_trait::async_trait;

use crate::{
    BreakerInfo, Endpoint, Instance, LaunchRequest, ProbeReport, RestartResult, SpawnError, UserId,
    UserStatus,
};

/// The lifecycle seam between the API/proxy and a backend (design §5).
///
/// Backends: local processes (`berth-local`) and, later, Kubernetes pods.
/// The API and the proxy depend on this trait only.
///
/// Implementations keep the hot-path queries ([`Spawner::endpoint_for`],
/// [`Spawner::touch`]) in memory: they take no lock across an `.await` and
/// never query the store.
#[async_trait]
pub trait Spawner: Send + Sync + 'static {
    /// Starts the user's main instance.
    ///
    /// Fails with [`SpawnError::AlreadyRunning`] if one is live and with
    /// [`SpawnError::CircuitOpen`] during a breaker cooldown unless
    /// `request.force` is set. Returns once the process is spawned; use
    /// [`Spawner::wait_for_ready`] to wait for readiness.
    async fn launch(&self, user: &UserId, request: LaunchRequest) -> Result<Instance, SpawnError>;

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
            what: "lease takeover",
        })
    }

    /// Restarts the live main instance and resets its crash budget.
    async fn restart_main(&self, user: &UserId) -> Result<Instance, SpawnError>;

    /// The open breaker of `user`, if any.
    async fn breaker_info(&self, user: &UserId) -> Result<Option<BreakerInfo>, SpawnError>;

    /// Clears the user's breaker and crash counters.
    async fn reset_breaker(&self, user: &UserId) -> Result<(), SpawnError>;

    /// Restarts every main this node owns, with bounded concurrency, and
    /// reports one result per user (design §4.6).
    async fn restart_all_mains(&self) -> Vec<RestartResult>;

    /// Starts the one-shot repair job for `user` (design §4.4).
    async fn spawn_watchdog(&self, user: &UserId) -> Result<Instance, SpawnError>;

    /// The user's main and watchdog records.
    async fn status(&self, user: &UserId) -> Result<UserStatus, SpawnError>;

    /// Every instance this backend knows of.
    async fn list(&self) -> Result<Vec<Instance>, SpawnError>;

    /// Where the proxy sends traffic; `None` unless the main is running.
    fn endpoint_for(&self, user: &UserId) -> Option<Endpoint>;

    /// The launch token captured from the program's output, if any.
    fn launch_token(&self, user: &UserId) -> Option<String>;

    /// Stops the main (and watchdog): SIGTERM to the process group, SIGKILL
    /// after the grace period. Stopping a user with no instance succeeds.
    async fn stop(&self, user: &UserId) -> Result<(), SpawnError>;

    /// Releases berth's own resources. Instances keep running.
    async fn teardown(&self);

    /// Waits until the main is ready and returns it. Returns at once with
    /// the current record (or `None`) if there is no live instance.
    async fn wait_for_ready(
        &self,
        user: &UserId,
        timeout: Duration,
    ) -> Result<Option<Instance>, SpawnError>;

    /// Restart (or force-launch) the main, wait for ready, wait a settle
    /// time, and report whether it is still running.
    async fn restart_and_probe(&self, user: &UserId) -> ProbeReport;

    /// Records activity. Cheap: an in-memory timestamp, flushed periodically.
    fn touch(&self, user: &UserId);

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
            what: "log stream",
        })
    }

    /// Fences the user's main on this node if, and only if, it runs under
    /// lease `epoch`: kills it at once, records it stopped, and forgets the
    /// lease (design §3 "Fence the right node": the message names the old
    /// holder's epoch, so it can never hit a newer instance). Returns
    /// whether an instance was fenced. Backends without leases fence
    /// nothing.
    async fn fence(&self, _user: &UserId, _epoch: crate::Epoch) -> Result<bool, SpawnError> {
        Ok(false)
    }

    /// Subscribes to instance changes (status, readiness, endpoint).
    fn subscribe(&self) -> tokio::sync::broadcast::Receiver<crate::InstanceEvent>;
}
