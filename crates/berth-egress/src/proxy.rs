//! The egress proxy's listener: each connection the guard redirected here
//! is read until it names its destination ([`crate::sniff`]), checked
//! against the policy of the account that made it (asked of the kernel,
//! and looked up in the [`EgressBook`]), and joined to that name, which
//! the proxy resolves itself. A program cannot pick the address: a raw IP, another name
//! for the same host, or a name that resolves somewhere private are all
//! refused.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use berth_core::UserId;
use berth_core::egress::{AccountEgress, EgressBook, EgressPolicy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::dns;
use crate::metrics::{EgressMetrics, Verdict};
use crate::sniff::{MAX_SNIFF_BYTES, Sniffed, sniff};

/// How long a connection may take to name its destination.
const SNIFF_GRACE: Duration = Duration::from_secs(10);
/// How long connecting to the destination may take.
pub(crate) const CONNECT_GRACE: Duration = Duration::from_secs(10);
/// Connections joined at once; more wait for a slot. The guard's
/// listener cap bounds each instance's share.
pub(crate) const MAX_CONNECTIONS: usize = 4096;
/// Refusals logged per second at most; the rest are counted.
const LOGGED_PER_SECOND: u64 = 10;
/// How long a name server may take to answer a forwarded query.
const LOOKUP_GRACE: Duration = Duration::from_secs(5);
/// The largest DNS message read or relayed (EDNS answers stay well
/// under it on the wire a stub resolver uses).
const MAX_DNS_MESSAGE: usize = 4096;

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
    /// The kernel could not say whose connection or query it is, so no
    /// policy can be checked.
    #[error("its account is unknown")]
    Unowned,
    /// A pod's request carried no credential berth made, so no user's
    /// policy can be checked.
    #[error("it showed no valid credential")]
    Uncredentialed,
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
    /// A DNS query for a name not allowed: answered `REFUSED`, never
    /// forwarded, so a query carries nothing out.
    #[error("lookup of {name} is not allowed")]
    Lookup {
        /// The name asked for.
        name: String,
    },
}

/// The egress proxy, bound and ready to serve: TCP connections and DNS
/// queries, on one port of loopback.
pub struct EgressProxy {
    listener: TcpListener,
    names: Arc<UdpSocket>,
    /// Where allowed queries are forwarded: the host's name servers.
    upstream: Vec<SocketAddr>,
    metrics: EgressMetrics,
}

impl EgressProxy {
    /// Binds the proxy's listener on `addr` (loopback, port 0 for any) and
    /// its name forwarder on the same port over UDP, which forwards the
    /// allowed queries to `name_servers`.
    pub async fn bind(
        addr: SocketAddr,
        metrics: EgressMetrics,
        name_servers: &[IpAddr],
    ) -> Result<Self, EgressError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| EgressError::Bind { addr, source })?;
        let bound = listener
            .local_addr()
            .map_err(|source| EgressError::Bind { addr, source })?;
        let names = UdpSocket::bind(bound)
            .await
            .map_err(|source| EgressError::Bind {
                addr: bound,
                source,
            })?;
        Ok(Self {
            listener,
            names: Arc::new(names),
            upstream: name_servers
                .iter()
                .map(|ip| SocketAddr::new(*ip, 53))
                .collect(),
            metrics,
        })
    }

    /// The port the guard redirects to.
    pub fn port(&self) -> Option<u16> {
        self.listener.local_addr().ok().map(|a| a.port())
    }

    /// Serves until `cancel`, then waits for the connections in flight.
    /// Each connection and lookup is checked against its account's policy
    /// in `book` as it is then: a change applies from the next one.
    pub async fn serve(self, book: Arc<EgressBook>, cancel: CancellationToken) {
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let tracker = TaskTracker::new();
        let log = Arc::new(RefusalLog::default());
        tracker.spawn(serve_names(Names {
            socket: self.names.clone(),
            upstream: self.upstream.clone(),
            book: book.clone(),
            metrics: self.metrics.clone(),
            log: log.clone(),
            slots: slots.clone(),
            tracker: tracker.clone(),
            cancel: cancel.clone(),
        }));
        while let Some((client, peer)) = next_client(&self.listener, &cancel, "egress proxy").await
        {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                break;
            };
            let book = book.clone();
            let metrics = self.metrics.clone();
            let log = log.clone();
            let cancel = cancel.clone();
            tracker.spawn(async move {
                let _slot = slot;
                let mut client = client;
                let destination = original_destination(&client);
                // The program's socket is connected to where it aimed,
                // not to the proxy the guard sent it to.
                let uid =
                    destination.and_then(|aimed| berth_localnet::peer_owner(aimed, peer).ok());
                let account = uid.map(|uid| book.of(uid));
                tokio::select! {
                    () = cancel.cancelled() => {}
                    outcome = join(&mut client, destination, account.as_ref()) => match outcome {
                        Ok(()) => metrics.count(Verdict::Allowed),
                        Err(refusal) => {
                            metrics.count(Verdict::Refused);
                            log.refused(uid, account.as_ref(), destination, &refusal);
                        }
                    },
                }
            });
        }
        tracker.close();
        tracker.wait().await;
    }
}

/// The next connection `listener` accepts, or `None` once `cancel` is
/// set. A failed accept (out of descriptors, say) is logged, and the
/// next one waits a little rather than spin.
pub(crate) async fn next_client(
    listener: &TcpListener,
    cancel: &CancellationToken,
    who: &str,
) -> Option<(TcpStream, SocketAddr)> {
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => return None,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok(accepted) => return Some(accepted),
            Err(e) => {
                tracing::warn!(error = %e, "{who}: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// What the name forwarder serves with.
struct Names {
    socket: Arc<UdpSocket>,
    upstream: Vec<SocketAddr>,
    book: Arc<EgressBook>,
    metrics: EgressMetrics,
    log: Arc<RefusalLog>,
    slots: Arc<Semaphore>,
    tracker: TaskTracker,
    cancel: CancellationToken,
}

/// Answers the DNS queries the guard redirects here: a query for an
/// allowed name is forwarded to the host's name servers and their answer
/// relayed; any other is answered `REFUSED` here. A message that is not
/// one plain query is dropped.
async fn serve_names(names: Names) {
    let mut buf = vec![0u8; MAX_DNS_MESSAGE];
    loop {
        let received = tokio::select! {
            () = names.cancel.cancelled() => break,
            received = names.socket.recv_from(&mut buf) => received,
        };
        let Ok((n, client)) = received else {
            continue;
        };
        let query = buf.get(..n).unwrap_or_default().to_vec();
        let Some((name, end)) = dns::question(&query) else {
            continue;
        };
        let uid = berth_localnet::udp_owner(client).ok();
        let account = uid.map(|uid| names.book.of(uid));
        let allowed = account
            .as_ref()
            .is_some_and(|a| a.policy.allows_lookup(&name));
        if !allowed {
            names.metrics.count(Verdict::Refused);
            let refusal = match account {
                Some(_) => Refusal::Lookup { name },
                None => Refusal::Unowned,
            };
            names.log.refused(uid, account.as_ref(), None, &refusal);
            if let Some(answer) = dns::refused(&query, end) {
                let _ = names.socket.send_to(&answer, client).await;
            }
            continue;
        }
        // Overloaded, a query is dropped: the resolver asks again.
        let Ok(slot) = names.slots.clone().try_acquire_owned() else {
            continue;
        };
        let (socket, upstream, metrics) = (
            names.socket.clone(),
            names.upstream.clone(),
            names.metrics.clone(),
        );
        names.tracker.spawn(async move {
            let _slot = slot;
            if let Some(answer) = forward(&query, &upstream).await {
                metrics.count(Verdict::Allowed);
                let _ = socket.send_to(&answer, client).await;
            }
        });
    }
}

/// The first answer a name server of `upstream` gives to `query`.
async fn forward(query: &[u8], upstream: &[SocketAddr]) -> Option<Vec<u8>> {
    for server in upstream {
        let any = match server {
            SocketAddr::V4(_) => SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, 0)),
            SocketAddr::V6(_) => SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0)),
        };
        let Ok(socket) = UdpSocket::bind(any).await else {
            continue;
        };
        if socket.connect(server).await.is_err() || socket.send(query).await.is_err() {
            continue;
        }
        let mut answer = vec![0u8; MAX_DNS_MESSAGE];
        if let Ok(Ok(n)) = tokio::time::timeout(LOOKUP_GRACE, socket.recv(&mut answer)).await {
            answer.truncate(n);
            return Some(answer);
        }
    }
    None
}

/// Reads what `client` asks for, checks it, connects and copies both
/// ways until either side closes. An I/O error after the check ends the
/// connection as the program's own network would.
async fn join(
    client: &mut TcpStream,
    destination: Option<SocketAddr>,
    account: Option<&AccountEgress>,
) -> Result<(), Refusal> {
    let port = destination.map(|d| d.port()).ok_or(Refusal::Unnamed)?;
    let policy = &account.ok_or(Refusal::Unowned)?.policy;
    let (name, prefix) = tokio::time::timeout(SNIFF_GRACE, read_name(client))
        .await
        .ok()
        .flatten()
        .ok_or(Refusal::Unnamed)?;
    if !policy.allows_name(&name, port) {
        return Err(Refusal::NotAllowed { name, port });
    }
    let mut upstream = connect(&name, port, policy)
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
pub(crate) async fn connect(name: &str, port: u16, policy: &EgressPolicy) -> Option<TcpStream> {
    let resolved = tokio::time::timeout(CONNECT_GRACE, tokio::net::lookup_host((name, port)))
        .await
        .ok()?
        .ok()?;
    let own = host_addresses();
    // `::ffff:10.0.0.5` is 10.0.0.5: checked, and connected to, as that.
    let allowed: Vec<SocketAddr> = resolved
        .map(|a| SocketAddr::new(a.ip().to_canonical(), a.port()))
        .filter(|a| policy.allows_resolved(a.ip(), port) && !own.contains(&a.ip()))
        .collect();
    for addr in allowed {
        if let Ok(Ok(stream)) = tokio::time::timeout(CONNECT_GRACE, TcpStream::connect(addr)).await
        {
            return Some(stream);
        }
    }
    None
}

/// This host's own addresses, as they are now: the guard never lets an
/// instance reach them, and the proxy does not either.
pub(crate) fn host_addresses() -> Vec<IpAddr> {
    nix::ifaddrs::getifaddrs()
        .map(|addrs| {
            addrs
                .filter_map(|ifa| ifa.address)
                .filter_map(|a| {
                    a.as_sockaddr_in()
                        .map(|s| IpAddr::V4(s.ip()))
                        .or_else(|| a.as_sockaddr_in6().map(|s| IpAddr::V6(s.ip())))
                })
                .collect()
        })
        .unwrap_or_default()
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
pub(crate) struct RefusalLog {
    window: std::sync::Mutex<Option<(Instant, u64)>>,
    unlogged: AtomicU64,
}

impl RefusalLog {
    /// A refusal of a local account's connection or query.
    fn refused(
        &self,
        uid: Option<u32>,
        account: Option<&AccountEgress>,
        destination: Option<SocketAddr>,
        refusal: &Refusal,
    ) {
        let Some(earlier_unlogged) = self.admit(Instant::now()) else {
            return;
        };
        tracing::warn!(
            user = %account.and_then(|a| a.user.as_deref()).unwrap_or("unknown"),
            uid = %uid.map_or_else(|| "unknown".to_owned(), |u| u.to_string()),
            destination = %destination.map(|d| d.to_string()).unwrap_or_default(),
            reason = %refusal,
            earlier_unlogged,
            "egress refused"
        );
    }

    /// A refusal of a pod's request, by its user (when its credential
    /// said whose it is).
    pub(crate) fn refused_pod(
        &self,
        user: Option<&UserId>,
        destination: (&str, u16),
        refusal: &Refusal,
    ) {
        let Some(earlier_unlogged) = self.admit(Instant::now()) else {
            return;
        };
        tracing::warn!(
            user = %user.map_or("unknown", UserId::as_str),
            destination = %format_args!("{}:{}", destination.0, destination.1),
            reason = %refusal,
            earlier_unlogged,
            "egress refused (pod)"
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
