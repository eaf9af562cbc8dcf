//! The proxy's reading of a request head: routing (`Router::target`,
//! `resolve`, `upstream_path`, `host_name`), the cross-origin rule
//! (`shield::foreign_request`) and the credentials it looks for (`bearer`,
//! `berth_cookies`), over a head parsed as hyper parses one (httparse, then
//! `http` types).
//!
//! Checks that a path target splits the path into `/u/<segment><rest>`
//! exactly, with `rest` starting at a `/` and the user being the strictly
//! decoded segment; that a host target's label is one lowercase DNS-ish
//! label; that a route found for a path target is that user's; and that
//! the path sent upstream is the request's own, or with `strip_prefix`
//! `rest` and the query.

#![no_main]

use std::sync::Arc;

use berth_proxy::auth::{bearer, berth_cookies};
use berth_proxy::route::{RouteTable, Router, Target, decode_segment, host_name};
use berth_proxy::shield::{RequestSite, foreign_request};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Method, Request};
use libfuzzer_sys::fuzz_target;

const BASE_DOMAIN: &str = "berth.example";

/// The request hyper would hand the proxy for `head`, if it would.
fn request(head: &[u8]) -> Option<Request<()>> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut parsed = httparse::Request::new(&mut headers);
    parsed.parse(head).ok()?;
    let mut builder = Request::builder()
        .method(Method::from_bytes(parsed.method?.as_bytes()).ok()?)
        .uri(parsed.path?);
    for header in parsed.headers.iter() {
        let name = HeaderName::from_bytes(header.name.as_bytes()).ok()?;
        let value = HeaderValue::from_bytes(header.value).ok()?;
        builder = builder.header(name, value);
    }
    builder.body(()).ok()
}

fuzz_target!(|data: &[u8]| {
    let Some(request) = request(data) else {
        return;
    };
    let (headers, uri) = (request.headers(), request.uri());
    let table = Arc::new(RouteTable::new());
    let routers = [
        (
            Router::new(table.clone(), Some(BASE_DOMAIN), true, true),
            true,
        ),
        (Router::new(table.clone(), None, false, true), false),
        (Router::new(table, Some(BASE_DOMAIN), false, false), false),
    ];

    if let Ok(host) = host_name(headers, uri) {
        assert!(!host.is_empty());
        assert!(!host.contains(':') || host.starts_with('['), "{host:?}");
    }
    for (router, strip) in &routers {
        let _ = router.classify(&request);
        let Ok(Some(target)) = router.target(headers, uri) else {
            continue;
        };
        match &target {
            Target::Path {
                user,
                segment,
                rest,
            } => {
                assert_eq!(uri.path(), format!("/u/{segment}{rest}"));
                assert!(rest.starts_with('/'), "{rest:?}");
                assert!(!segment.contains('/'), "{segment:?}");
                assert_eq!(decode_segment(segment).as_ref(), Ok(user));
                if let Ok(route) = router.resolve(&target) {
                    assert_eq!(route.user.as_str(), user.as_ref());
                }
            }
            Target::Host { label } => {
                assert!(!label.is_empty());
                assert!(!label.contains('.'), "{label:?}");
                assert!(!label.bytes().any(|b| b.is_ascii_uppercase()), "{label:?}");
                let _ = router.resolve(&target);
            }
        }
        let upstream = router.upstream_path(&target, uri, None);
        let upstream = upstream.unwrap_or_else(|| panic!("no upstream path for {uri}"));
        match &target {
            Target::Path { rest, .. } if *strip => {
                assert_eq!(upstream.path(), *rest);
                assert_eq!(upstream.query(), uri.query().filter(|q| !q.is_empty()));
            }
            // An authority-form target (CONNECT) has no path: `/` goes.
            _ => assert_eq!(
                upstream.path(),
                uri.path_and_query().map_or("/", |p| p.path())
            ),
        }
        if let Some(replaced) = router.upstream_path(&target, uri, Some("token=x")) {
            assert_eq!(replaced.query(), Some("token=x"));
        }
    }

    let upgrade = headers.contains_key(hyper::header::UPGRADE);
    let site = RequestSite::of(request.method(), uri, headers, upgrade);
    if let Some(why) = foreign_request(&site) {
        assert!(!why.is_empty());
    }
    if let Some(token) = bearer(headers) {
        assert!(!token.is_empty() && token.trim() == token, "{token:?}");
    }
    let cookies = berth_cookies(headers);
    for token in cookies.user_tokens().chain(cookies.session_tokens()) {
        assert!(!token.is_empty());
    }
});
