//! Probes that tell whether a starting instance is ready: an HTTP GET
//! answering below 500, or a TCP connect. The token-regex signal comes from
//! the shim instead.
//!
//! When the instance runs under an account of its own, a connection counts
//! only if the socket that took it belongs to that account: a program of
//! another account that bound the port first is not the instance, however
//! well it answers.

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use berth_core::Reach;

use berth_core::Readiness;

/// How long one probe may take before it counts as "not yet".
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// Pause between probes.
pub(crate) const PROBE_INTERVAL: Duration = Duration::from_millis(50);

/// One probe of `readiness` against `127.0.0.1:port`, reached as `reach`
/// says (a socket of its owner's, in its network namespace). `None` when
/// the readiness kind is not probed (the shim reports it).
pub(crate) async fn probe(readiness: &Readiness, port: u16, reach: &Reach) -> Option<bool> {
    let attempt = async {
        match readiness {
            Readiness::TokenRegex(_) => None,
            Readiness::Tcp => Some(connect(port, reach).await.is_some()),
            Readiness::Http { path } => Some(http_ok(port, reach, path).await),
        }
    };
    match tokio::time::timeout(PROBE_TIMEOUT, attempt).await {
        Ok(result) => result,
        Err(_) => Some(false),
    }
}

/// A connection to `127.0.0.1:port` (in `reach.netns`, if given) that
/// reached a socket of `reach.owner`'s.
async fn connect(port: u16, reach: &Reach) -> Option<TcpStream> {
    if let Some(netns) = &reach.netns {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        return berth_localnet::connect_in(netns, addr, PROBE_TIMEOUT)
            .await
            .ok();
    }
    let stream = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    let Some(owner) = reach.owner else {
        return Some(stream);
    };
    match berth_localnet::check_owner(&stream, owner) {
        Ok(()) => Some(stream),
        Err(e) => {
            tracing::warn!(port, error = %e, "the instance's port is not its own");
            None
        }
    }
}

async fn http_ok(port: u16, reach: &Reach, path: &str) -> bool {
    http_status(hyper::Method::GET, port, reach, path)
        .await
        .is_some_and(|status| status < 500)
}

/// The status the instance at `127.0.0.1:port` (reached as `reach` says)
/// answers `method path` with, if it answers at all. The readiness probe
/// asks with `GET`, a hook with `POST`; neither sends a body.
pub(crate) async fn http_status(
    method: hyper::Method,
    port: u16,
    reach: &Reach,
    path: &str,
) -> Option<u16> {
    let stream = connect(port, reach).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    let path = if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("/{path}")
    };
    let request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, format!("127.0.0.1:{port}"))
        .body(Empty::<Bytes>::new())
        .ok()?;
    // The connection future must be driven while the request is in flight;
    // it ends with the request, so no task is spawned for it.
    let mut conn = std::pin::pin!(conn);
    let mut response = std::pin::pin!(sender.send_request(request));
    let answer = tokio::select! {
        biased;
        response = &mut response => response,
        // The connection may close right after delivering the answer; the
        // response future resolves either way once the connection is done.
        _ = &mut conn => response.await,
    };
    answer.ok().map(|r| r.status().as_u16())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn serve_once(status: &'static str) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            let reply = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n");
            s.write_all(reply.as_bytes()).await.unwrap();
        });
        port
    }

    #[tokio::test]
    async fn http_readiness_wants_an_answer_below_500() {
        let http = Readiness::Http { path: "/".into() };
        let port = serve_once("404 Not Found").await;
        assert_eq!(probe(&http, port, &Reach::default()).await, Some(true));
        let port = serve_once("503 Service Unavailable").await;
        assert_eq!(probe(&http, port, &Reach::default()).await, Some(false));
    }

    fn owned_by(uid: u32) -> Reach {
        Reach {
            owner: Some(uid),
            netns: None,
        }
    }

    #[tokio::test]
    async fn tcp_readiness_wants_a_listener() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert_eq!(
            probe(&Readiness::Tcp, port, &Reach::default()).await,
            Some(true)
        );
        let me = nix::unistd::geteuid().as_raw();
        assert_eq!(
            probe(&Readiness::Tcp, port, &owned_by(me)).await,
            Some(true)
        );
        assert_eq!(
            probe(&Readiness::Tcp, port, &owned_by(me.wrapping_add(1))).await,
            Some(false),
            "a listener of another account is not the instance"
        );
        drop(listener);
        assert_eq!(
            probe(&Readiness::Tcp, port, &Reach::default()).await,
            Some(false)
        );
        assert_eq!(
            probe(
                &Readiness::Http { path: "/".into() },
                port,
                &Reach::default()
            )
            .await,
            Some(false)
        );
    }
}
