//! Why a configuration was refused, and where the bad value came from.

use std::fmt;
use std::path::PathBuf;

/// Where a bad value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    File {
        path: PathBuf,
        line: Option<usize>,
    },
    Env(&'static str),
    Flag(&'static str),
    /// A default, or a combination of values with no single origin.
    Unknown,
}

impl fmt::Display for Location {
    /// Renders as a prefix for the reason (ends with `": "` when non-empty).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::File {
                path,
                line: Some(line),
            } => write!(f, "config file {}, line {line}: ", path.display()),
            Location::File { path, line: None } => write!(f, "config file {}: ", path.display()),
            Location::Env(var) => write!(f, "environment variable {var}: "),
            Location::Flag(flag) => write!(f, "flag {flag}: "),
            Location::Unknown => write!(f, "config: "),
        }
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// TOML syntax, unknown keys and values of the wrong type.
    #[error("{at}{message}")]
    Parse { at: Location, message: String },
    /// A well-formed value that berth cannot use.
    #[error("{at}{key}: {reason}")]
    Invalid {
        at: Location,
        key: String,
        reason: String,
    },
    /// A file holding a secret that other users can read.
    #[error(
        "{} holds {what} and is readable by other users (mode {mode:03o}), the accounts \
         of the programs berth runs among them; make it private with `chmod 600 {}`",
        path.display(),
        path.display()
    )]
    ReadableSecret {
        path: PathBuf,
        what: String,
        mode: u32,
    },
    #[error("cannot read the secret file {}", path.display())]
    SecretFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cannot use the host name as node id ({0}); set node_id in the config or BERTH_NODE_ID"
    )]
    Hostname(String),
    #[error("cannot locate the berth executable for the default instance command: {0}")]
    CurrentExe(String),
}
