//! The front of an explicit HTTP proxy, which a program finds in its
//! `HTTP_PROXY` and `HTTPS_PROXY`: `CONNECT host:port` (a tunnel for TLS,
//! or any TCP) and absolute-form requests (`GET http://host/path`, plain
//! HTTP); anything else is answered `400`. Two proxies share it: a
//! sandbox's relay, which connects as the instance's account, and the
//! egress proxy for pods, which checks a pod's credential and its user's
//! policy first. Each says how it reaches a destination
//! ([`serve_one`]'s `reach`); this module reads the request, answers, and
//! copies the bytes.

use std::time::Duration;

use data_encoding::BASE64;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The longest request head read, in bytes.
const MAX_HEAD: usize = 16 * 1024;
/// How long a client may take to send its request head.
const HEAD_GRACE: Duration = Duration::from_secs(10);

/// What a request head asks the proxy for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ask {
    /// `CONNECT host:port`: a tunnel, answered `200` once connected.
    Tunnel {
        /// The host, lowercase (an address without brackets).
        host: String,
        /// The port.
        port: u16,
    },
    /// An absolute-form request: `head` (in origin form, `Proxy-*` and
    /// hop-by-hop headers dropped, `Connection: close` added) goes to
    /// `host:port` as the request's start.
    Forward {
        /// The host, lowercase.
        host: String,
        /// The port (80 when the URL names none).
        port: u16,
        /// The request head to send on.
        head: Vec<u8>,
    },
}

impl Ask {
    /// Where it goes.
    pub fn destination(&self) -> (&str, u16) {
        match self {
            Ask::Tunnel { host, port } | Ask::Forward { host, port, .. } => (host, *port),
        }
    }
}

/// Why a request head is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadAsk {
    /// Not a complete HTTP request head.
    #[error("not an HTTP request")]
    NotHttp,
    /// A target that names no `host:port` or `http://host[:port]/…`.
    #[error("the request names no destination this proxy takes: {0}")]
    Target(String),
}

/// Why a destination is not reached: the answer the client gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreached {
    /// The status line's code and reason (`"403 Forbidden"`).
    pub status: &'static str,
    /// Why, in the answer's body.
    pub why: String,
}

impl Unreached {
    /// `407`: the proxy needs a credential it did not get.
    pub const AUTHENTICATE: &'static str = "407 Proxy Authentication Required";

    /// An answer of `status`, saying `why`.
    pub fn new(status: &'static str, why: impl Into<String>) -> Self {
        Self {
            status,
            why: why.into(),
        }
    }
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
        let name = header.name.to_ascii_lowercase();
        if name.starts_with("proxy-") || name == "connection" || name == "keep-alive" {
            continue;
        }
        out.extend_from_slice(header.name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(header.value);
        out.extend_from_slice(b"\r\n");
    }
    // One request per connection: the bytes after it are copied, not
    // read, so a client's next request (with its proxy credential) must
    // not reach this upstream.
    out.extend_from_slice(b"Connection: close\r\n\r\n");
    Ok(Ask::Forward {
        host,
        port,
        head: out,
    })
}

/// The name and password of the head's `Proxy-Authorization: Basic`
/// header, if it has one that decodes.
pub fn proxy_credentials(head: &[u8]) -> Option<(String, String)> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut request = httparse::Request::new(&mut headers);
    request.parse(head).ok()?;
    let value = request
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("proxy-authorization"))?
        .value;
    let value = std::str::from_utf8(value).ok()?.trim();
    let (scheme, encoded) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = String::from_utf8(BASE64.decode(encoded.trim().as_bytes()).ok()?).ok()?;
    let (name, password) = decoded.split_once(':')?;
    Some((name.to_owned(), password.to_owned()))
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

/// One client of a proxy named `who`: its request head read, checked and
/// connected by `reach` (given the head and what it asks), then bytes
/// copied both ways until either side closes.
pub async fn serve_one(
    mut client: TcpStream,
    who: &str,
    reach: impl AsyncFnOnce(&[u8], &Ask) -> Result<TcpStream, Unreached>,
) {
    let (head, rest) = match tokio::time::timeout(HEAD_GRACE, read_head(&mut client)).await {
        Ok(Ok(Some(read))) => read,
        _ => return,
    };
    let ask = match parse_ask(&head) {
        Ok(ask) => ask,
        Err(e) => {
            let _ = answer(&mut client, who, "400 Bad Request", &e.to_string()).await;
            return;
        }
    };
    let mut upstream = match reach(&head, &ask).await {
        Ok(upstream) => upstream,
        Err(unreached) => {
            let _ = answer(&mut client, who, unreached.status, &unreached.why).await;
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

/// Reads until the end of a request head: the head, and whatever came
/// after it; `None` when the client ends first or sends too much.
async fn read_head(client: &mut TcpStream) -> std::io::Result<Option<(Vec<u8>, Vec<u8>)>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    // Where the search for the blank line goes on: a head sent a byte at a
    // time is scanned once, not once per byte.
    let mut searched = 0;
    loop {
        if let Some(end) = buf[searched..].windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(searched + end + 4);
            return Ok(Some((buf, rest)));
        }
        searched = buf.len().saturating_sub(3);
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

/// A short answer of the proxy's own, then the end of the connection. A
/// `407` asks for Basic credentials.
async fn answer(client: &mut TcpStream, who: &str, status: &str, why: &str) -> std::io::Result<()> {
    let body = format!("{who}: {why}\n");
    let challenge = if status == Unreached::AUTHENTICATE {
        "Proxy-Authenticate: Basic realm=\"berth\"\r\n"
    } else {
        ""
    };
    let text = format!(
        "HTTP/1.1 {status}\r\n{challenge}Content-Type: text/plain\r\nContent-Length: {}\r\n\
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
              Proxy-Authorization: Basic x\r\nProxy-Connection: keep-alive\r\nAccept: */*\r\n\
              Connection: keep-alive\r\nKeep-Alive: timeout=5\r\n\r\n",
        );
        assert_eq!(
            ask,
            Ok(Ask::Forward {
                host: "example.test".into(),
                port: 8080,
                head: b"GET /a/b?c=1 HTTP/1.1\r\nHost: example.test:8080\r\nAccept: */*\r\n\
                        Connection: close\r\n\r\n"
                    .to_vec(),
            })
        );
        let bare = parse_ask(b"GET http://example.test HTTP/1.0\r\n\r\n");
        assert_eq!(
            bare,
            Ok(Ask::Forward {
                host: "example.test".into(),
                port: 80,
                head: b"GET / HTTP/1.0\r\nConnection: close\r\n\r\n".to_vec(),
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
    fn basic_proxy_credentials_are_read_and_anything_else_is_none() {
        // "YWxpY2U6czNjcmV0" is base64 of "alice:s3cret".
        let head =
            b"CONNECT a.test:443 HTTP/1.1\r\nproxy-authorization: Basic YWxpY2U6czNjcmV0\r\n\r\n";
        assert_eq!(
            proxy_credentials(head),
            Some(("alice".into(), "s3cret".into()))
        );
        for head in [
            &b"CONNECT a.test:443 HTTP/1.1\r\n\r\n"[..],
            b"CONNECT a.test:443 HTTP/1.1\r\nProxy-Authorization: Bearer YWxpY2U6czNjcmV0\r\n\r\n",
            b"CONNECT a.test:443 HTTP/1.1\r\nProxy-Authorization: Basic !!!\r\n\r\n",
            // "YWxpY2U=" is "alice", with no password.
            b"CONNECT a.test:443 HTTP/1.1\r\nProxy-Authorization: Basic YWxpY2U=\r\n\r\n",
            b"CONNECT a.test:443 HTTP/1.1\r\nAuthorization: Basic YWxpY2U6czNjcmV0\r\n\r\n",
        ] {
            assert_eq!(
                proxy_credentials(head),
                None,
                "{}",
                String::from_utf8_lossy(head)
            );
        }
    }
}
