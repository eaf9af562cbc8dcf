//! The egress proxy's listener: each connection the guard redirected here
//! is read until it names its destination ([`crate::sniff`]), checked
//! against the policy, and joined to that name, which the proxy resolves
//! itself. A program cannot pick the address: a raw IP, another name
//! for the same host, or a name that resolves somewhere private are all
//! refused.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use berth_core::egress::EgressPolicy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::metrics::{EgressMetrics, Verdict};
use crate::sniff::{MAX_SNIFF_BYTES, Sniffed, sniff};

/// How long a connection may take to name its destination.
const SNIFF_GRACE: Duration = Duration::from_secs(10);
/// How long connecting to the destination may take.
const CONNECT_GRACE: Duration = Duration::from_secs(10);
/// Connections joined at once; more wait for a slot. The guard's
/// listener cap bounds each instance's share.
const MAX_CONNECTIONS: usize = 4096;
/// Refusals logged per second at most; the rest are counted.
const LOGGED_PER_SECOND: u64 = 10;

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// The listener could not be bound.
    #[error("cannot listen for the egress proxy on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// What the system said.
        source: std::io::Error,
    },
}

/// Why one connection was refused; logged and counted, never sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// It named no host in time (a raw IP, no SNI, not TLS or HTTP).
    #[error("named no host")]
    Unnamed,
    /// The name is not allowed on that port.
    #[error("{name}:{port} is not allowed")]
    NotAllowed {
        /// The name asked for.
        name: String,
        /// The port the program connected to.
        port: u16,
    },
    /// The name resolved to no address the policy allows.
    #[error("{name} resolved to no allowed address")]
    Unresolved {
        /// The name asked for.
        name: String,
    },
}

/// The egress proxy, bound and ready to serve.
pub struct EgressProxy {
    listener: TcpListener,
    policy: Arc<RwLock<EgressPolicy>>,
    metrics: EgressMetrics,
}

impl EgressProxy {
    /// Binds the proxy's listener on `addr` (loopback, port 0 for any).
    pub async fn bind(
        addr: SocketAddr,
        policy: EgressPolicy,
        metrics: EgressMetrics,
    ) -> Result<Self, EgressError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| EgressError::Bind { addr, source })?;
        Ok(Self {
            listener,
            policy: Arc::new(RwLock::new(policy)),
            metrics,
        })
    }

    /// The policy the proxy checks, to be changed while it serves: a
    /// change applies from the next connection.
    pub fn policy(&self) -> Arc<RwLock<EgressPolicy>> {
        self.policy.clone()
    }

    /// The port the guard redirects to.
    pub fn port(&self) -> Option<u16> {
        self.listener.local_addr().ok().map(|a| a.port())
    }

    /// Serves until `cancel`, then waits for the connections in flight.
    pub async fn serve(self, cancel: CancellationToken) {
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let tracker = TaskTracker::new();
        let log = Arc::new(RefusalLog::default());
        loop {
            let accepted = tokio::select! {
                () = cancel.cancelled() => break,
                accepted = self.listener.accept() => accepted,
            };
            let (client, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "egress proxy: accept failed");
                    continue;
                }
            };
            let Ok(slot) = slots.clone().acquire_owned().await else {
                break;
            };
            let policy = self.policy.clone();
            let metrics = self.metrics.clone();
            let log = log.clone();
            let cancel = cancel.clone();
            tracker.spawn(async move {
                let _slot = slot;
                let mut client = client;
                let destination = original_destination(&client);
                tokio::select! {
                    () = cancel.cancelled() => {}
                    outcome = join(&mut client, destination, &policy) => match outcome {
                        Ok(()) => metrics.count(Verdict::Allowed),
                        Err(refusal) => {
                            metrics.count(Verdict::Refused);
                            // Asked of the kernel while the connection is
                            // still open, and only for a refusal's log. The
                            // program's socket is connected to where it
                            // aimed, not to the proxy the guard sent it to.
                            let uid = destination
                                .and_then(|aimed| berth_localnet::peer_owner(aimed, peer).ok());
                            log.refused(uid, destination, &refusal);
                        }
                    },
                }
            });
        }
        tracker.close();
        tracker.wait().await;
    }
}

/// Reads what `client` asks for, checks it, connects and copies both
/// ways until either side closes. An I/O error after the check ends the
/// connection as the program's own network would.
async fn join(
    client: &mut TcpStream,
    destination: Option<SocketAddr>,
    policy: &RwLock<EgressPolicy>,
) -> Result<(), Refusal> {
    let port = destination.map(|d| d.port()).ok_or(Refusal::Unnamed)?;
    let (name, prefix) = tokio::time::timeout(SNIFF_GRACE, read_name(client))
        .await
        .ok()
        .flatten()
        .ok_or(Refusal::Unnamed)?;
    // The policy as it is now: a change applies to the next connection.
    let policy = policy
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    if !policy.allows_name(&name, port) {
        return Err(Refusal::NotAllowed { name, port });
    }
    let mut upstream = connect(&name, port, &policy)
        .await
        .ok_or_else(|| Refusal::Unresolved { name: name.clone() })?;
    if upstream.write_all(&prefix).await.is_ok() {
        let _ = tokio::io::copy_bidirectional(client, &mut upstream).await;
    }
    Ok(())
}

/// Reads until the bytes name a host: that name and every byte read.
async fn read_name(client: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut prefix = Vec::with_capacity(1024);
    loop {
        match sniff(&prefix) {
            Sniffed::Name { name, .. } => return Some((name, prefix)),
            Sniffed::Nothing => return None,
            Sniffed::NeedMore if prefix.len() >= MAX_SNIFF_BYTES => return None,
            Sniffed::NeedMore => {}
        }
        let mut chunk = [0u8; 4096];
        let room = MAX_SNIFF_BYTES
            .saturating_sub(prefix.len())
            .min(chunk.len());
        let n = client.read(&mut chunk[..room]).await.ok()?;
        if n == 0 {
            return None;
        }
        prefix.extend_from_slice(&chunk[..n]);
    }
}

/// A connection to `name:port` at the first address it resolves to that
/// the policy allows.
async fn connect(name: &str, port: u16, policy: &EgressPolicy) -> Option<TcpStream> {
    let resolved = tokio::net::lookup_host((name, port)).await.ok()?;
    let allowed: Vec<SocketAddr> = resolved
        .filter(|a| policy.allows_resolved(a.ip(), port) && !is_this_host(a.ip()))
        .collect();
    for addr in allowed {
        if let Ok(Ok(stream)) = tokio::time::timeout(CONNECT_GRACE, TcpStream::connect(addr)).await
        {
            return Some(stream);
        }
    }
    None
}

/// Whether `addr` is one of this host's own: the guard never lets an
/// instance reach them, and the proxy does not either.
fn is_this_host(addr: IpAddr) -> bool {
    nix::ifaddrs::getifaddrs().is_ok_and(|mut addrs| {
        addrs.any(|ifa| {
            ifa.address.is_some_and(|a| {
                a.as_sockaddr_in().map(|s| IpAddr::V4(s.ip())) == Some(addr)
                    || a.as_sockaddr_in6().map(|s| IpAddr::V6(s.ip())) == Some(addr)
            })
        })
    })
}

/// Where the program connected before the guard redirected it here.
fn original_destination(client: &TcpStream) -> Option<SocketAddr> {
    let addr = nix::sys::socket::getsockopt(client, nix::sys::socket::sockopt::OriginalDst).ok()?;
    let ip = std::net::Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr));
    Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(addr.sin_port)))
}

/// Logs refusals, at most [`LOGGED_PER_SECOND`] a second; the others are
/// counted and reported with the next line logged.
#[derive(Default)]
struct RefusalLog {
    window: std::sync::Mutex<Option<(Instant, u64)>>,
    unlogged: AtomicU64,
}

impl RefusalLog {
    fn refused(&self, uid: Option<u32>, destination: Option<SocketAddr>, refusal: &Refusal) {
        let Some(earlier_unlogged) = self.admit(Instant::now()) else {
            return;
        };
        tracing::warn!(
            uid = %uid.map_or_else(|| "unknown".to_owned(), |u| u.to_string()),
            destination = %destination.map(|d| d.to_string()).unwrap_or_default(),
            reason = %refusal,
            earlier_unlogged,
            "egress refused"
        );
    }

    /// Whether a refusal at `now` is logged: with how many before it were
    /// not, or `None` (it is counted instead).
    fn admit(&self, now: Instant) -> Option<u64> {
        let log = {
            let mut window = self.window.lock().unwrap_or_else(PoisonError::into_inner);
            match &mut *window {
                Some((start, n)) if now.duration_since(*start) < Duration::from_secs(1) => {
                    *n += 1;
                    *n <= LOGGED_PER_SECOND
                }
                _ => {
                    *window = Some((now, 1));
                    true
                }
            }
        };
        if !log {
            self.unlogged.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.unlogged.swap(0, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_logged_ten_a_second_and_the_rest_counted() {
        let log = RefusalLog::default();
        let t0 = Instant::now();
        let first: Vec<Option<u64>> = (0..25).map(|_| log.admit(t0)).collect();
        assert_eq!(first.iter().filter(|l| l.is_some()).count(), 10);
        assert!(first[10..].iter().all(Option::is_none));
        // The next second's first line says how many were not logged.
        assert_eq!(log.admit(t0 + Duration::from_millis(1001)), Some(15));
        assert_eq!(log.admit(t0 + Duration::from_millis(1002)), Some(0));
    }
}
