//! The config parser: `Config::from_toml` (TOML, unknown keys refused, each
//! key's line remembered) and `Config::validate`, the path of
//! `berth config check`, then the settings `berth serve` derives from a
//! valid file.
//!
//! Checks that an error names a line the file has; that a file that
//! passes the check yields the listen address, the lease and the
//! readiness it was checked for (`serve` must not fail on a file `check`
//! passed); and that deriving the rest of the settings does not panic.

#![no_main]

use std::path::Path;

use berth::config::{Config, ConfigError};
use libfuzzer_sys::fuzz_target;

/// The line of the file an error names, read from its message
/// (`config file <path>, line <n>: …`), if it names one.
fn line_of(error: &ConfigError) -> Option<usize> {
    let message = error.to_string();
    let rest = message.strip_prefix("config file fuzz.toml, line ")?;
    let digits = rest.split(':').next()?;
    Some(digits.parse().unwrap())
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let lines = text.split('\n').count();
    let checked = Config::from_toml(text, Path::new("fuzz.toml")).and_then(|config| {
        config.validate()?;
        Ok(config)
    });
    let config = match checked {
        Ok(config) => config,
        Err(error) => {
            if let Some(line) = line_of(&error) {
                assert!(
                    (1..=lines).contains(&line),
                    "line {line} of {lines}: {error}"
                );
            }
            return;
        }
    };
    config.listen_addr().unwrap();
    config.lease_config().unwrap();
    config.readiness().unwrap();
    let _ = config.internal_listen_addr();
    let _ = config.internal_listener_warning();
    let _ = config.crash_policy();
    let _ = config.reap_policy();
    let _ = config.body_pace();
    let _ = config.path_routing();
    let _ = config.port_range_warning(Some((32768, 60999)));
    let _ = config.open_files_warning(false, Some(1 << 20));
    let _ = config.host_limits_warning(Some(1 << 22), Some(1 << 20));
    let _ = config.isolation_level(false);
    let _ = config.runtime_config(vec!["berth".into(), "shim".into()]);
    let _ = config.controller_config("fuzz-node");
});
