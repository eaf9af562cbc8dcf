//! berth is a binary (`src/main.rs`); this library exists for the fuzz
//! targets (`fuzz/` at the repository's root) only. With the `fuzzing`
//! feature, which nothing else enables, it compiles the binary's
//! configuration parser and the API's wire types once more, so that a fuzz
//! target can call them; without it, it is empty. It is no API: nothing
//! may depend on it.

// The binary uses all of these modules; the fuzz targets only a part, and
// their items are documented where the binary's readers look, not as a
// library's API. Their unit tests run with the binary's, not twice.
#[cfg(all(feature = "fuzzing", not(test)))]
#[allow(dead_code, missing_docs)]
pub mod config;

#[cfg(all(feature = "fuzzing", not(test)))]
#[allow(dead_code, missing_docs)]
pub mod wire;
