//! User ids and slugs: `UserId::parse`, `Slug::parse`, and what a valid id
//! becomes (its slug, its legacy slug, its URL path segment).
//!
//! Checks that a valid id reads back unchanged (as text and through
//! JSON); that every slug made of an id is itself a valid slug, and a
//! plain id is its own slug while any other id's slug is hashed; and that
//! the path segment and base path berth hands out decode, with the proxy's
//! strict rules, back to the id, and route to it.

#![no_main]

use std::sync::Arc;

use berth_core::{MAX_SLUG_LEN, Slug, UserId};
use berth_proxy::route::{RouteTable, Router, Target, decode_segment};
use hyper::Request;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(raw) = std::str::from_utf8(data) else {
        return;
    };

    if let Ok(slug) = Slug::parse(raw) {
        assert_eq!(slug.as_str(), raw);
        assert!(raw.len() <= MAX_SLUG_LEN, "{raw:?}");
    }
    if Slug::is_plain(raw) {
        assert!(Slug::parse(raw).is_ok(), "a plain slug is a slug: {raw:?}");
        assert!(!raw.contains("--"), "{raw:?}");
    }

    let Ok(id) = UserId::parse(raw) else {
        return;
    };
    assert_eq!(id.to_string(), raw);
    assert_eq!(id.as_str(), raw);
    let json = serde_json::to_string(&id).unwrap();
    let back: UserId = serde_json::from_str(&json).unwrap();
    assert_eq!(back, id);

    let slug = id.slug();
    let reread = Slug::parse(slug.as_str()).unwrap_or_else(|e| panic!("{raw:?}: {e}"));
    assert_eq!(reread, slug);
    if Slug::is_plain(raw) {
        assert_eq!(slug.as_str(), raw);
    } else {
        assert!(slug.as_str().contains("---"), "{raw:?} → {slug:?}");
        assert!(!Slug::is_plain(slug.as_str()), "{raw:?} → {slug:?}");
    }
    let legacy = id.legacy_slug();
    assert!(Slug::parse(legacy.as_str()).is_ok(), "{raw:?} → {legacy:?}");

    let segment = id.path_segment();
    assert_eq!(decode_segment(&segment).unwrap(), raw);
    let base = id.base_path();
    assert_eq!(base, format!("/u/{segment}/"));
    let request = Request::builder()
        .uri(&base)
        .header(hyper::header::HOST, "berth.example")
        .body(())
        .unwrap_or_else(|e| panic!("{base:?} is no request target: {e}"));
    let router = Router::new(Arc::new(RouteTable::new()), None, true, true);
    match router.target(request.headers(), request.uri()) {
        Ok(Some(Target::Path { user, rest, .. })) => {
            assert_eq!(user, raw);
            assert_eq!(rest, "/");
        }
        other => panic!("{base:?} routed as {other:?}"),
    }
});
