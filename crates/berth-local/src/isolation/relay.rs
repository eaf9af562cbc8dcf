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
//! lowercase forms, and `ALL_PROXY`), which the shim sets. It takes
//! `CONNECT host:port` (HTTPS, or any TCP) and absolute-form requests
//! (`GET http://host/path`, plain HTTP); anything else is answered `400`.
//! A destination that cannot be reached is answered `502`, with the
//! reason. A program that ignores the variables reaches nothing.

use std::net::TcpListener as StdListener;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// The argument after `shim` that makes berth's helper process a relay
/// (see [`crate::shim::run`]).
pub const RELAY_ARG: &str = "relay";

/// The longest request head read, in bytes.
const MAX_HEAD: usize = 16 * 1024;
/// Connections relayed at once; more wait for a slot.
const MAX_CONNECTIONS: usize = 256;
/// How long a client may take to send its request head.
const HEAD_GRACE: Duration = Duration::from_secs(10);
/// How long connecting to the destination may take.
const CONNECT_GRACE: Duration = Duration::from_secs(15);

/// The proxy variables a sandboxed program gets for a relay on `port` of
/// its loopback.
pub fn proxy_env(port: u16) -> Vec<(String, String)> {
    let url = format!("http://127.0.0.1:{port}");
    let mut env: Vec<(String, String)> = [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ]
    .iter()
    .map(|name| ((*name).to_owned(), url.clone()))
    .collect();
    for name in ["NO_PROXY", "no_proxy"] {
        env.push((name.to_owned(), "localhost,127.0.0.1,::1".to_owned()));
    }
    env
}

/// What a request head asks the relay for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ask {
    /// `CONNECT host:port`: a tunnel, answered `200` once connected.
    Tunnel { host: String, port: u16 },
    /// An absolute-form request: `head` (in origin form, `Proxy-*`
    /// headers dropped) goes to `host:port` as the request's start.
    Forward {
        host: String,
        port: u16,
        head: Vec<u8>,
    },
}

/// Why a request head is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadAsk {
    /// Not a complete HTTP request head.
    #[error("not an HTTP request")]
    NotHttp,
    /// A target that names no `host:port` or `http://host[:port]/…`.
    #[error("the request names no destination the relay takes: {0}")]
    Target(String),
}

/// Reads what `head` (a complete request head, through its blank line)
/// asks for.
pub fn parse_ask(head: &[u8]) -> Result<Ask, BadAsk> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        _ => return Err(BadAsk::NotHttp),
    }
    let (Some(method), Some(target), Some(version)) =
        (request.method, request.path, request.version)
    else {
        return Err(BadAsk::NotHttp);
    };
    if method == "CONNECT" {
        let (host, port) = host_port(target, None).ok_or_else(|| BadAsk::Target(target.into()))?;
        return Ok(Ask::Tunnel { host, port });
    }
    let rest = target
        .strip_prefix("http://")
        .ok_or_else(|| BadAsk::Target(target.into()))?;
    let (authority, path) = match rest.find('/') {
        Some(at) => rest.split_at(at),
        None => (rest, "/"),
    };
    let (host, port) =
        host_port(authority, Some(80)).ok_or_else(|| BadAsk::Target(target.into()))?;
    let mut out = format!("{method} {path} HTTP/1.{version}\r\n").into_bytes();
    for header in request.headers.iter() {
        if header.name.to_ascii_lowercase().starts_with("proxy-") {
            continue;
        }
        out.extend_from_slice(header.name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(header.value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    Ok(Ask::Forward {
        host,
        port,
        head: out,
    })
}

/// `host:port` (or `[v6]:port`), the port `default` when absent.
fn host_port(authority: &str, default: Option<u16>) -> Option<(String, u16)> {
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => (host, Some(port.parse().ok()?)),
        _ => (authority, None),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = port.or(default)?;
    let fine = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '_'));
    fine.then(|| (host.to_ascii_lowercase(), port))
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

/// One client: its request head read, its destination connected, then
/// bytes copied both ways until either side closes.
async fn relay(mut client: TcpStream) {
    let (head, rest) = match tokio::time::timeout(HEAD_GRACE, read_head(&mut client)).await {
        Ok(Ok(Some(read))) => read,
        _ => return,
    };
    let ask = match parse_ask(&head) {
        Ok(ask) => ask,
        Err(e) => {
            let _ = answer(&mut client, "400 Bad Request", &e.to_string()).await;
            return;
        }
    };
    let (host, port) = match &ask {
        Ask::Tunnel { host, port } | Ask::Forward { host, port, .. } => (host.clone(), *port),
    };
    let connected = tokio::time::timeout(CONNECT_GRACE, connect_outside(&host, port)).await;
    let mut upstream = match connected {
        Ok(Ok(upstream)) => upstream,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            let _ = answer(&mut client, "403 Forbidden", &e.to_string()).await;
            return;
        }
        Ok(Err(e)) => {
            let why = format!("cannot reach {host}:{port}: {e}");
            let _ = answer(&mut client, "502 Bad Gateway", &why).await;
            return;
        }
        Err(_) => {
            let why = format!("cannot reach {host}:{port}: no answer in time");
            let _ = answer(&mut client, "504 Gateway Timeout", &why).await;
            return;
        }
    };
    let sent = match &ask {
        Ask::Tunnel { .. } => client
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await
            .is_ok(),
        Ask::Forward { head, .. } => upstream.write_all(head).await.is_ok(),
    };
    if sent && upstream.write_all(&rest).await.is_ok() {
        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
    }
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

/// Reads until the end of a request head: the head, and whatever came
/// after it; `None` when the client ends first or sends too much.
async fn read_head(client: &mut TcpStream) -> std::io::Result<Option<(Vec<u8>, Vec<u8>)>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(end + 4);
            return Ok(Some((buf, rest)));
        }
        if buf.len() >= MAX_HEAD {
            return Ok(None);
        }
        let n = client.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// A short answer of the relay's own, then the end of the connection.
async fn answer(client: &mut TcpStream, status: &str, why: &str) -> std::io::Result<()> {
    let body = format!("berth relay: {why}\n");
    let text = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    client.write_all(text.as_bytes()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connect_names_its_tunnel() {
        let ask = parse_ask(b"CONNECT PyPI.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n");
        assert_eq!(
            ask,
            Ok(Ask::Tunnel {
                host: "pypi.org".into(),
                port: 443
            })
        );
        let v6 = parse_ask(b"CONNECT [fd00::1]:22 HTTP/1.1\r\n\r\n");
        assert_eq!(
            v6,
            Ok(Ask::Tunnel {
                host: "fd00::1".into(),
                port: 22
            })
        );
        for bad in [
            &b"CONNECT pypi.org HTTP/1.1\r\n\r\n"[..],
            b"CONNECT :443 HTTP/1.1\r\n\r\n",
            b"CONNECT a b:443 HTTP/1.1\r\n\r\n",
            b"CONNECT evil/../x:443 HTTP/1.1\r\n\r\n",
        ] {
            assert!(parse_ask(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        assert_eq!(
            parse_ask(b"CONNECT pypi.org:443 HTTP/1.1\r\n"),
            Err(BadAsk::NotHttp)
        );
        assert_eq!(parse_ask(b"\x16\x03\x01 hello"), Err(BadAsk::NotHttp));
    }

    #[test]
    fn an_absolute_request_goes_on_in_origin_form_without_proxy_headers() {
        let ask = parse_ask(
            b"GET http://example.test:8080/a/b?c=1 HTTP/1.1\r\nHost: example.test:8080\r\n\
              Proxy-Authorization: Basic x\r\nProxy-Connection: keep-alive\r\nAccept: */*\r\n\r\n",
        );
        assert_eq!(
            ask,
            Ok(Ask::Forward {
                host: "example.test".into(),
                port: 8080,
                head: b"GET /a/b?c=1 HTTP/1.1\r\nHost: example.test:8080\r\nAccept: */*\r\n\r\n"
                    .to_vec(),
            })
        );
        let bare = parse_ask(b"GET http://example.test HTTP/1.0\r\n\r\n");
        assert_eq!(
            bare,
            Ok(Ask::Forward {
                host: "example.test".into(),
                port: 80,
                head: b"GET / HTTP/1.0\r\n\r\n".to_vec(),
            })
        );
        for bad in [
            &b"GET /local HTTP/1.1\r\n\r\n"[..],
            b"GET https://example.test/ HTTP/1.1\r\n\r\n",
            b"GET ftp://example.test/ HTTP/1.1\r\n\r\n",
        ] {
            assert!(
                matches!(parse_ask(bad), Err(BadAsk::Target(_))),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

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
