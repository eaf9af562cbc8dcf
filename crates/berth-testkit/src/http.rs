//! HTTP exactly as written, for requests a client library would refuse or
//! normalise.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Sends `request_head` (and no body) over a fresh TCP connection exactly as
/// written — no URL normalisation — reads until the server closes, and
/// returns the status (0 if none) and the body.
///
/// # Panics
///
/// When `url` (`http://host:port`) cannot be connected to.
pub async fn raw_request(url: &str, request_head: &str) -> (u16, String) {
    let addr = url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("the server accepts a connection");
    stream
        .write_all(request_head.as_bytes())
        .await
        .expect("the request can be written");
    let mut response = Vec::new();
    // A reset after a complete answer still leaves that answer to read.
    let _ = stream.read_to_end(&mut response).await;
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}
