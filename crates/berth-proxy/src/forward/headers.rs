//! The header rules of a forwarded exchange: which headers are hop-by-hop
//! and never cross the proxy, which `X-Forwarded-*` headers the instance
//! is given, and how an upgrade request is recognised.

use bytes::Bytes;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::conn::ConnInfo;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Hop-by-hop headers (RFC 9110 §7.6.1), besides those `Connection` names.
fn hop_by_hop() -> [&'static HeaderName; 9] {
    [
        &header::CONNECTION,
        &KEEP_ALIVE,
        &PROXY_CONNECTION,
        &header::PROXY_AUTHENTICATE,
        &header::PROXY_AUTHORIZATION,
        &header::TE,
        &header::TRAILER,
        &header::TRANSFER_ENCODING,
        &header::UPGRADE,
    ]
}

/// `Connection: upgrade` together with an `Upgrade` header.
pub fn wants_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE) && lists_token(headers, header::CONNECTION, "upgrade")
}

/// `Upgrade: websocket` (a token of the list, in any case).
pub fn upgrades_to_websocket(headers: &HeaderMap) -> bool {
    lists_token(headers, header::UPGRADE, "websocket")
}

/// Whether any `name` header's comma-separated list holds `token` (in any
/// case).
fn lists_token(headers: &HeaderMap, name: header::HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Removes hop-by-hop headers: the fixed set and every header `Connection`
/// names. With `keep_upgrade`, `Upgrade` survives (the caller sets
/// `Connection: upgrade` again).
pub fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    // Most messages carry none of these: one pass over the names is then
    // all it costs, instead of a lookup per hop-by-hop name.
    if !headers.keys().any(is_hop_by_hop_name) {
        return;
    }
    let upgrade = if keep_upgrade {
        headers.get(header::UPGRADE).cloned()
    } else {
        None
    };
    // Browsers send one `Connection` value on nearly every request; only the
    // rare request with several pays for a list.
    let mut connection = headers.get_all(header::CONNECTION).iter();
    let several = connection.next().is_some() && connection.next().is_some();
    if several {
        let values: Vec<HeaderValue> = headers
            .get_all(header::CONNECTION)
            .iter()
            .cloned()
            .collect();
        for value in &values {
            remove_named(headers, value);
        }
    } else if let Some(value) = headers.remove(header::CONNECTION) {
        remove_named(headers, &value);
        // Usually `Connection: keep-alive` was the only one.
        if !headers.keys().any(is_hop_by_hop_name) {
            if let Some(upgrade) = upgrade {
                headers.insert(header::UPGRADE, upgrade);
            }
            return;
        }
    }
    for name in hop_by_hop() {
        headers.remove(name);
    }
    // Any other `Proxy-*`, and a bare `Proxy` (httpoxy: CGI-style programs
    // would read it as HTTP_PROXY). Rare, so only a hit pays for the list.
    let is_proxy_header = |name: &HeaderName| {
        let name = name.as_str();
        name == "proxy" || name.starts_with("proxy-")
    };
    if headers.keys().any(is_proxy_header) {
        let names: Vec<HeaderName> = headers
            .keys()
            .filter(|n| is_proxy_header(n))
            .cloned()
            .collect();
        for name in names {
            headers.remove(name);
        }
    }
    if let Some(upgrade) = upgrade {
        headers.insert(header::UPGRADE, upgrade);
    }
}

/// A fixed hop-by-hop header, `Proxy`, or any `Proxy-*`.
fn is_hop_by_hop_name(name: &HeaderName) -> bool {
    hop_by_hop().into_iter().any(|h| h == name) || {
        let name = name.as_str();
        name == "proxy" || name.starts_with("proxy-")
    }
}

fn remove_named(headers: &mut HeaderMap, connection: &HeaderValue) {
    let Ok(value) = connection.to_str() else {
        return;
    };
    for token in value.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        // `close`, `keep-alive`, `upgrade` are options, not header names
        // worth a lookup (keep-alive and upgrade are removed anyway).
        if ["close", "keep-alive", "upgrade"]
            .iter()
            .any(|o| token.eq_ignore_ascii_case(o))
        {
            continue;
        }
        headers.remove(token);
    }
}

/// The request headers as the instance sees them.
pub fn rewrite_request_headers(
    headers: &mut HeaderMap,
    conn: &ConnInfo,
    upgrade: bool,
    keep_forwarded_user: bool,
) {
    strip_hop_by_hop(headers, upgrade);
    // Room for the X-Forwarded-* headers: one growth at most.
    headers.reserve(3);
    if upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    // berth already answered `Expect: 100-continue` by reading the body.
    headers.remove(header::EXPECT);
    if !keep_forwarded_user {
        headers.remove(&crate::auth::FORWARDED_USER);
    }
    let forwarded_for = match headers.get(&X_FORWARDED_FOR) {
        None => conn.peer_ip.clone(),
        Some(existing) => {
            let mut joined = Vec::with_capacity(existing.len() + 2 + conn.peer_ip.len());
            joined.extend_from_slice(existing.as_bytes());
            joined.extend_from_slice(b", ");
            joined.extend_from_slice(conn.peer_ip.as_bytes());
            HeaderValue::from_maybe_shared(Bytes::from(joined))
                .unwrap_or_else(|_| conn.peer_ip.clone())
        }
    };
    headers.insert(X_FORWARDED_FOR.clone(), forwarded_for);
    if !(conn.trusted && headers.contains_key(&X_FORWARDED_PROTO)) {
        headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
    }
    if !(conn.trusted && headers.contains_key(&X_FORWARDED_HOST)) {
        match headers.get(header::HOST).cloned() {
            Some(host) => {
                headers.insert(X_FORWARDED_HOST.clone(), host);
            }
            None => {
                headers.remove(&X_FORWARDED_HOST);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(trusted: bool) -> ConnInfo {
        ConnInfo::new("10.1.2.3:5555".parse().unwrap(), trusted)
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut h = headers(&[
            ("connection", "keep-alive, X-Secret"),
            ("connection", "x-other"),
            ("x-secret", "1"),
            ("x-other", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-authorization", "Basic x"),
            ("proxy", "http://evil:3128"),
            ("proxy-whatever", "1"),
            ("te", "trailers"),
            ("trailer", "x"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("host", "berth.test"),
            ("accept", "*/*"),
        ]);
        rewrite_request_headers(&mut h, &conn(false), false, false);
        let mut names: Vec<_> = h.keys().map(|k| k.as_str().to_owned()).collect();
        names.sort();
        assert_eq!(
            names,
            [
                "accept",
                "host",
                "x-forwarded-for",
                "x-forwarded-host",
                "x-forwarded-proto"
            ]
        );
    }

    #[test]
    fn upgrades_keep_upgrade() {
        let mut h = headers(&[
            ("connection", "Upgrade"),
            ("upgrade", "websocket"),
            ("host", "h"),
        ]);
        assert!(wants_upgrade(&h));
        rewrite_request_headers(&mut h, &conn(false), true, false);
        assert_eq!(h[header::UPGRADE], "websocket");
        assert_eq!(h[header::CONNECTION], "upgrade");
        assert!(!wants_upgrade(&headers(&[("upgrade", "websocket")])));
        assert!(!wants_upgrade(&headers(&[("connection", "upgrade")])));
    }

    #[test]
    fn websocket_upgrades_are_told_from_others() {
        assert!(upgrades_to_websocket(&headers(&[("upgrade", "websocket")])));
        assert!(upgrades_to_websocket(&headers(&[("upgrade", "WebSocket")])));
        assert!(upgrades_to_websocket(&headers(&[(
            "upgrade",
            "foo, websocket"
        )])));
        assert!(!upgrades_to_websocket(&headers(&[("upgrade", "h2c")])));
        assert!(!upgrades_to_websocket(&headers(&[(
            "upgrade",
            "websockets"
        )])));
        assert!(!upgrades_to_websocket(&headers(&[])));
    }

    #[test]
    fn forwarded_headers_are_set_or_kept_from_trusted_peers() {
        let spoofed = [
            ("host", "berth.test:8000"),
            ("x-forwarded-for", "1.1.1.1"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "evil"),
            ("x-forwarded-user", "admin"),
        ];
        let mut h = headers(&spoofed);
        rewrite_request_headers(&mut h, &conn(false), false, false);
        assert_eq!(h["x-forwarded-for"], "1.1.1.1, 10.1.2.3");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "berth.test:8000");
        assert!(!h.contains_key("x-forwarded-user"));
        let mut h = headers(&spoofed);
        rewrite_request_headers(&mut h, &conn(true), false, true);
        assert_eq!(h["x-forwarded-proto"], "https");
        assert_eq!(h["x-forwarded-host"], "evil");
        assert_eq!(h["x-forwarded-user"], "admin");
        let mut h = headers(&[("host", "h")]);
        rewrite_request_headers(&mut h, &conn(false), false, false);
        assert_eq!(h["x-forwarded-for"], "10.1.2.3");
    }
}
