//! The API's JSON request bodies, read as the API reads them
//! (`serde_json::from_slice` into the request types): a launch
//! (`LaunchRequest`), an egress policy (`EgressPolicy`, whose destinations
//! have a parser of their own), a token mint (`MintRequest`), and the
//! node-to-node egress change and fence (`EgressChange`, `FenceRequest`).
//!
//! Checks that whatever is accepted reads back equal from the JSON berth
//! writes of it (a policy is stored, and sent between nodes, that way);
//! that each destination reads back from its own text; and that a launch's
//! folder, once normalised, stays inside the workspace.

#![no_main]

use std::fmt::Debug;

use berth::wire::{EgressChange, FenceRequest, MintRequest};
use berth_core::egress::{Destination, EgressPolicy};
use berth_core::{LaunchRequest, normalize_folder};
use libfuzzer_sys::fuzz_target;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// `body` as a `T`, if the API would take it; then written and read back.
fn read<T: DeserializeOwned + Serialize + PartialEq + Debug>(body: &[u8]) -> Option<T> {
    let value: T = serde_json::from_slice(body).ok()?;
    let written = serde_json::to_vec(&value).unwrap();
    let back: T = serde_json::from_slice(&written)
        .unwrap_or_else(|e| panic!("{value:?} does not read back from its JSON: {e}"));
    assert_eq!(back, value);
    Some(value)
}

fn check_policy(policy: &EgressPolicy) {
    let _ = policy.check();
    let _ = policy.networks_by_port();
    let _ = policy.domain_ports();
    for destination in &policy.allow {
        let text = destination.to_string();
        let back: Destination = text
            .parse()
            .unwrap_or_else(|e| panic!("{destination:?} as {text:?}: {e}"));
        assert_eq!(&back, destination, "{text:?}");
    }
}

fuzz_target!(|body: &[u8]| {
    if let Some(launch) = read::<LaunchRequest>(body)
        && let Ok(folder) = normalize_folder(launch.folder.as_deref())
    {
        assert!(!folder.starts_with('/'), "{folder:?}");
        assert!(
            folder.split('/').all(|part| part != ".." && part != "."),
            "{folder:?}"
        );
        assert_eq!(
            normalize_folder(Some(&folder)).as_deref(),
            Ok(folder.as_str())
        );
    }
    if let Some(policy) = read::<EgressPolicy>(body) {
        check_policy(&policy);
    }
    if let Some(change) = read::<EgressChange>(body)
        && let Some(policy) = &change.policy
    {
        check_policy(policy);
    }
    let _ = read::<MintRequest>(body);
    let _ = read::<FenceRequest>(body);
});
