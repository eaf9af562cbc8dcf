//! berth's configuration: a TOML file, then environment, then flags.
//! Unknown keys are errors that name the key, the file and the line.
//!
//! Layering: [`Config::load`] reads the file (or starts from the defaults)
//! and applies the `BERTH_*` environment; [`Config::apply_overrides`] applies
//! command-line flags; [`Config::validate`] checks the result. Every key
//! remembers where its value came from, so a bad value is reported against
//! the file line, the environment variable or the flag that set it.
//!
//! One job per file: `sections.rs` (the file format: [`Config`] and its
//! sections, with their defaults), `error.rs` (`ConfigError`, and the
//! `Location` a bad value came from), `provenance.rs` (where each value
//! came from, and which key a file line holds), `load.rs` (file,
//! environment and flags), `validate.rs` ([`Config::validate`]), `oidc.rs`
//! (what the sign-in fixes that the configuration must agree with) and
//! `settings.rs` (what the values mean, and the conversions into each
//! crate's settings), `secrets.rs` (secret files, and no secret on the
//! command line).

mod error;
mod load;
mod oidc;
mod provenance;
mod secrets;
mod sections;
mod settings;
mod validate;

pub use error::ConfigError;
pub use load::{OIDC_CLIENT_SECRET_ENV, Overrides};
pub use oidc::CALLBACK_PATH;
pub use secrets::refuse_readable_by_others;
pub use sections::{Config, OidcSection};

/// The kernel's ephemeral port range (`net.ipv4.ip_local_port_range`),
/// if it can be read.
pub fn ephemeral_port_range() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut parts = text.split_whitespace().map(str::parse::<u16>);
    match (parts.next(), parts.next()) {
        (Some(Ok(low)), Some(Ok(high))) => Some((low, high)),
        _ => None,
    }
}

/// The kernel's `pid_max`, if it can be read.
pub fn pid_max() -> Option<u64> {
    std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The host's `fs.file-max`, if it can be read.
pub fn file_max() -> Option<u64> {
    std::fs::read_to_string("/proc/sys/fs/file-max")
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod test_support {
    use std::path::Path;

    use super::Config;
    use super::error::ConfigError;

    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml(text, Path::new("test.toml"))
    }
}
