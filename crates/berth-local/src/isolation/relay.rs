//! A sandbox's way out: an HTTP proxy that listens inside the sandbox's
//! network namespace and connects from the host's, as the instance's own
//! account.
//!
//! A sandboxed program has no network beyond its own loopback. The shim
//! binds this relay's listener on that loopback and starts the relay
//! (`berth shim relay`, the listener as its stdin) in the host's network
//! namespace, under the instance's account, rlimits and cgroup. Each
//! connection it makes out is therefore the account's, in the host's
//! namespace: the egress guard (and through it the egress proxy) checks
//! it exactly as it checks a program at level `user`, by the account's
//! uid, under the user's policy as it is at that moment. The relay
//! decides one thing itself: it never connects to loopback. The guard
//! lets an account reach the host's loopback (at `user` that is where its
//! own port is); a sandbox, whose own port is inside it, must see no
//! service of the host's or of another tenant's there.
//!
//! The program finds it through `HTTP_PROXY`, `HTTPS_PROXY` (and their
//! lowercase forms, and `ALL_PROXY`), which the shim sets. The requests
//! it takes are `berth_egress::explicit`'s. A destination that cannot be
//! reached is answered `502`, with the reason. A program that ignores the
//! variables reaches nothing.

use std::net::TcpListener as StdListener;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use berth_core::egress;
use berth_egress::explicit::{self, Ask, Unreached};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// The argument after `shim` that makes berth's helper process a relay
/// (see [`crate::shim::run`]).
pub const RELAY_ARG: &str = "relay";

/// Connections relayed at once; more wait for a slot.
const MAX_CONNECTIONS: usize = 256;
/// How long connecting to the destination may take.
const CONNECT_GRACE: Duration = Duration::from_secs(15);

/// The proxy variables a sandboxed program gets for a relay on `port` of
/// its loopback.
pub fn proxy_env(port: u16) -> Vec<(String, String)> {
    egress::proxy_env(&format!("http://127.0.0.1:{port}"))
}

/// The relay's process: serves the listener it was given as its stdin
/// until it is killed. Returns the exit code.
pub fn serve() -> i32 {
    let listener = match std::io::stdin().as_fd().try_clone_to_owned() {
        Ok(fd) => StdListener::from(fd),
        Err(e) => {
            eprintln!("berth relay: no listener on stdin: {e}");
            return 2;
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("berth relay: cannot start: {e}");
            return 1;
        }
    };
    runtime.block_on(async move {
        let listener = match listener
            .set_nonblocking(true)
            .and_then(|()| TcpListener::from_std(listener))
        {
            Ok(listener) => listener,
            Err(e) => {
                eprintln!("berth relay: stdin is not a listening socket: {e}");
                return 2;
            }
        };
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return 1;
            };
            let client = match listener.accept().await {
                Ok((client, _)) => client,
                Err(e) => {
                    // E.g. out of descriptors: do not spin.
                    eprintln!("berth relay: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            tokio::spawn(async move {
                let _slot = slot;
                relay(client).await;
            });
        }
    })
}

/// One client, whose destination the relay connects to unless it is
/// loopback.
async fn relay(client: TcpStream) {
    explicit::serve_one(client, "berth relay", async |_head: &[u8], ask: &Ask| {
        let (host, port) = ask.destination();
        match tokio::time::timeout(CONNECT_GRACE, connect_outside(host, port)).await {
            Ok(Ok(upstream)) => Ok(upstream),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                Err(Unreached::new("403 Forbidden", e.to_string()))
            }
            Ok(Err(e)) => Err(Unreached::new(
                "502 Bad Gateway",
                format!("cannot reach {host}:{port}: {e}"),
            )),
            Err(_) => Err(Unreached::new(
                "504 Gateway Timeout",
                format!("cannot reach {host}:{port}: no answer in time"),
            )),
        }
    })
    .await;
}

/// A connection to the first address `host` resolves to that is not
/// loopback (nor unspecified, which reaches it too); `PermissionDenied`
/// when it resolves to such addresses only.
async fn connect_outside(host: &str, port: u16) -> std::io::Result<TcpStream> {
    let resolved: Vec<std::net::SocketAddr> =
        tokio::net::lookup_host((host, port)).await?.collect();
    let outside: Vec<std::net::SocketAddr> = resolved
        .iter()
        .filter(|a| reaches_outside(a.ip()))
        .copied()
        .collect();
    if outside.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("{host} is this host's loopback, which a sandbox does not reach"),
        ));
    }
    let mut last = None;
    for addr in outside {
        match TcpStream::connect(addr).await {
            Ok(stream) => return Ok(stream),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no address")))
}

/// Whether a connection to `ip` leaves the host's loopback.
fn reaches_outside(ip: std::net::IpAddr) -> bool {
    let ip = ip.to_canonical();
    !ip.is_loopback() && !ip.is_unspecified()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_in_any_spelling_is_not_outside() {
        for inside in [
            "127.0.0.1",
            "127.8.9.10",
            "::1",
            "0.0.0.0",
            "::",
            "::ffff:127.0.0.1",
        ] {
            assert!(!reaches_outside(inside.parse().unwrap()), "{inside}");
        }
        for outside in ["198.51.100.7", "10.0.0.1", "fd00::1", "::ffff:198.51.100.7"] {
            assert!(reaches_outside(outside.parse().unwrap()), "{outside}");
        }
    }

    #[test]
    fn the_program_is_pointed_at_the_relay_on_its_loopback() {
        let env = proxy_env(3128);
        let get = |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
        assert_eq!(get("HTTPS_PROXY"), Some("http://127.0.0.1:3128"));
        assert_eq!(get("http_proxy"), Some("http://127.0.0.1:3128"));
        assert_eq!(get("NO_PROXY"), Some("localhost,127.0.0.1,::1"));
    }
}
