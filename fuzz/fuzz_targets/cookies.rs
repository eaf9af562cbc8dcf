//! Cookie parsing: `auth::berth_cookies` (berth's cookies among a
//! request's `Cookie` headers), `auth::strip_credentials` (what goes on to
//! the program) and `auth::sets_berth_cookie` (a program's `Set-Cookie`
//! that `shield` drops), over lines of the input as header values.
//!
//! Checks that every cookie value found is non-empty and was sent; that
//! after stripping, no cookie of berth's is left for the program; and
//! that a `Set-Cookie` berth lets a program send cannot make a browser
//! send back a cookie berth would read as its own.

#![no_main]

use berth_proxy::auth::{Credential, berth_cookies, sets_berth_cookie, strip_credentials};
use hyper::HeaderMap;
use hyper::header::{COOKIE, HeaderValue};
use libfuzzer_sys::fuzz_target;

/// What a browser sends back for a `Set-Cookie` value: its name-value
/// pair (before the first `;`), both halves trimmed, and without a name
/// just the value.
fn sent_back(set_cookie: &str) -> String {
    let pair = set_cookie.split(';').next().unwrap_or_default();
    match pair.split_once('=') {
        Some((name, value)) if !name.trim().is_empty() => {
            format!("{}={}", name.trim(), value.trim())
        }
        Some((_, value)) => value.trim().to_owned(),
        None => pair.trim().to_owned(),
    }
}

fuzz_target!(|data: &[u8]| {
    let lines: Vec<HeaderValue> = data
        .split(|&b| b == b'\n')
        .filter_map(|line| HeaderValue::from_bytes(line).ok())
        .collect();
    let mut headers = HeaderMap::new();
    for line in &lines {
        headers.append(COOKIE, line.clone());
    }

    let found = berth_cookies(&headers);
    for value in found
        .user
        .iter()
        .chain(&found.user_host)
        .chain(&found.session)
        .chain(&found.session_host)
    {
        assert!(!value.is_empty());
        assert!(
            lines
                .iter()
                .any(|l| l.to_str().is_ok_and(|l| l.contains(value))),
            "{value:?} was not sent"
        );
    }

    for used in [Credential::Bearer, Credential::Cookie] {
        let mut stripped = headers.clone();
        strip_credentials(&mut stripped, used);
        let left = berth_cookies(&stripped);
        assert_eq!(
            left,
            Default::default(),
            "berth's cookies reach the program"
        );
    }

    for line in &lines {
        let allowed = !sets_berth_cookie(line.as_bytes());
        let Ok(text) = std::str::from_utf8(line.as_bytes()) else {
            assert!(!allowed, "a Set-Cookie that is not UTF-8 passes");
            continue;
        };
        if allowed && let Ok(back) = HeaderValue::from_str(&sent_back(text)) {
            let mut request = HeaderMap::new();
            request.insert(COOKIE, back);
            assert_eq!(
                berth_cookies(&request),
                Default::default(),
                "a program's Set-Cookie {text:?} plants a cookie of berth's"
            );
        }
    }
});
