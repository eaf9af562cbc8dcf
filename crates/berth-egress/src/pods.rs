//! The egress proxy for pods: the way to the domain names a user's
//! policy allows, for pods whose NetworkPolicy lets them reach nothing
//! else but berth's pods on this proxy's port.
//!
//! A pod is no account on this host, so the proxy cannot ask the kernel
//! whose a connection is. A pod that may come here carries a credential
//! in its proxy variables ([`ProxyKey`]); the proxy takes explicit
//! requests only ([`crate::explicit`]), each with that credential, and
//! checks what it asks for against its user's policy as the store holds
//! it then, so a change applies from the next request. A name is
//! resolved here, and reached only at an address the policy allows (never
//! a metadata service, loopback or this pod's own addresses); an address
//! asked for by itself only inside an allowed network (or, under
//! `allow_all`, a public one). What the proxy cannot see: what flows
//! inside a tunnel it opened (a proxy or DNS-over-HTTPS service on an
//! allowed name reaches anything it does).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use berth_core::UserId;
use berth_core::egress::{EgressPolicy, ProxyKey};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::explicit::{self, Ask, Unreached, proxy_credentials};
use crate::metrics::{EgressMetrics, Verdict};
use crate::proxy::{self, CONNECT_GRACE, EgressError, MAX_CONNECTIONS, Refusal, RefusalLog};

/// Where the proxy finds a user's policy: their own, else the node's.
#[async_trait]
pub trait Policies: Send + Sync + 'static {
    /// `user`'s policy as it is now.
    async fn policy(&self, user: &UserId) -> Result<EgressPolicy, String>;
}

/// The egress proxy for pods, bound and ready to serve.
pub struct PodProxy {
    listener: TcpListener,
    metrics: EgressMetrics,
}

impl PodProxy {
    /// Binds the proxy's listener on `addr`.
    pub async fn bind(addr: SocketAddr, metrics: EgressMetrics) -> Result<Self, EgressError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| EgressError::Bind { addr, source })?;
        Ok(Self { listener, metrics })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves until `cancel`, then waits for the requests in flight.
    pub async fn serve(
        self,
        key: ProxyKey,
        policies: Arc<dyn Policies>,
        cancel: CancellationToken,
    ) {
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let sources = Sources::new(MAX_PER_SOURCE);
        let tracker = TaskTracker::new();
        let check = Arc::new(Check {
            key,
            policies,
            metrics: self.metrics,
            log: RefusalLog::default(),
        });
        while let Some((client, peer)) =
            proxy::next_client(&self.listener, &cancel, "egress proxy for pods").await
        {
            // One pod cannot hold every slot: past its share its new
            // connections are closed at once.
            let Some(share) = sources.enter(peer.ip()) else {
                continue;
            };
            let Ok(slot) = slots.clone().acquire_owned().await else {
                break;
            };
            let (check, cancel) = (check.clone(), cancel.clone());
            tracker.spawn(async move {
                let (_slot, _share) = (slot, share);
                let reach = async |head: &[u8], ask: &Ask| check.reach(head, ask).await;
                tokio::select! {
                    () = cancel.cancelled() => {}
                    () = explicit::serve_one(client, "berth egress proxy", reach) => {}
                }
            });
        }
        tracker.close();
        tracker.wait().await;
    }
}

/// Connections one source address (a pod) holds at once, at most.
const MAX_PER_SOURCE: usize = 256;

/// How many connections each source address holds, each capped.
#[derive(Clone)]
struct Sources {
    held: Arc<Mutex<HashMap<IpAddr, usize>>>,
    cap: usize,
}

/// One connection's place in its source's count, given back on drop.
struct Share {
    sources: Sources,
    source: IpAddr,
}

impl Sources {
    fn new(cap: usize) -> Self {
        Self {
            held: Arc::new(Mutex::new(HashMap::new())),
            cap,
        }
    }

    /// A place for one more connection from `source`, unless it holds its
    /// cap already.
    fn enter(&self, source: IpAddr) -> Option<Share> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let count = held.entry(source).or_insert(0);
        if *count >= self.cap {
            return None;
        }
        *count += 1;
        Some(Share {
            sources: self.clone(),
            source,
        })
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut held = self
            .sources
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = held.get_mut(&self.source) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.source);
            }
        }
    }
}

/// What every request is checked with.
struct Check {
    key: ProxyKey,
    policies: Arc<dyn Policies>,
    metrics: EgressMetrics,
    log: RefusalLog,
}

impl Check {
    /// The destination of a request whose credential and policy allow
    /// it, connected; else the answer, logged and counted.
    async fn reach(&self, head: &[u8], ask: &Ask) -> Result<TcpStream, Unreached> {
        let destination = ask.destination();
        let user = proxy_credentials(head).and_then(|(name, pw)| self.key.verify(&name, &pw));
        let Some(user) = user else {
            return Err(self.refuse(None, destination, Refusal::Uncredentialed));
        };
        let read = tokio::time::timeout(CONNECT_GRACE, self.policies.policy(&user)).await;
        let policy = read
            .unwrap_or_else(|_| Err("no answer in time".to_owned()))
            .map_err(|e| {
                tracing::warn!(%user, error = %e, "egress proxy for pods: cannot read the policy");
                Unreached::new("503 Service Unavailable", "cannot read the user's policy")
            })?;
        match reach(destination, &policy).await {
            Ok(upstream) => {
                self.metrics.count(Verdict::Allowed);
                Ok(upstream)
            }
            Err(refusal) => Err(self.refuse(Some(&user), destination, refusal)),
        }
    }

    fn refuse(
        &self,
        user: Option<&UserId>,
        destination: (&str, u16),
        refusal: Refusal,
    ) -> Unreached {
        self.metrics.count(Verdict::Refused);
        self.log.refused_pod(user, destination, &refusal);
        let status = match refusal {
            Refusal::Uncredentialed => Unreached::AUTHENTICATE,
            Refusal::Unresolved { .. } => "502 Bad Gateway",
            _ => "403 Forbidden",
        };
        Unreached::new(status, refusal.to_string())
    }
}

/// `host:port` connected, if `policy` allows it: an address by itself
/// ([`EgressPolicy::allows_address`]), a name as the policy allows names
/// (under `allow_all` any), at an address it allows. Never this pod's own
/// addresses, where berth's own listeners are.
async fn reach((host, port): (&str, u16), policy: &EgressPolicy) -> Result<TcpStream, Refusal> {
    let not_allowed = || Refusal::NotAllowed {
        name: host.to_owned(),
        port,
    };
    if let Ok(addr) = host.parse::<IpAddr>() {
        // `::ffff:10.0.0.5` is 10.0.0.5, one of this pod's addresses too.
        let addr = addr.to_canonical();
        if !policy.allows_address(addr, port) || proxy::host_addresses().contains(&addr) {
            return Err(not_allowed());
        }
        let connected = tokio::time::timeout(CONNECT_GRACE, TcpStream::connect((addr, port))).await;
        return match connected {
            Ok(Ok(upstream)) => Ok(upstream),
            _ => Err(Refusal::Unresolved {
                name: host.to_owned(),
            }),
        };
    }
    if policy.mode.confined() && !policy.allows_name(host, port) {
        return Err(not_allowed());
    }
    proxy::connect(host, port, policy)
        .await
        .ok_or_else(|| Refusal::Unresolved {
            name: host.to_owned(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_holds_its_share_of_connections_and_gets_each_back() {
        let sources = Sources::new(2);
        let pod: IpAddr = "10.1.0.7".parse().unwrap();
        let other: IpAddr = "10.1.0.8".parse().unwrap();
        let first = sources.enter(pod).unwrap();
        let second = sources.enter(pod).unwrap();
        assert!(sources.enter(pod).is_none(), "past its share");
        assert!(sources.enter(other).is_some(), "another pod is not held up");
        drop(first);
        let third = sources.enter(pod).unwrap();
        drop((second, third));
        assert!(
            sources.held.lock().unwrap().is_empty(),
            "nothing is kept for a source that holds nothing"
        );
    }
}
