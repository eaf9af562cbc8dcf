//! The local runtime's choices that are also the config file's: how
//! readiness is told, and the isolation level.

/// How berth decides that a starting instance is ready (design §4.2).
#[derive(Debug, Clone)]
pub enum Readiness {
    /// A stdout/stderr line matches; the first capture group is the launch
    /// token.
    TokenRegex(regex::Regex),
    /// `GET <path>` on the instance's port answers below 500.
    Http { path: String },
    /// A TCP connect to the instance's port succeeds.
    Tcp,
}

/// Isolation level (design §6). Only `None` exists so far; `user` and
/// `sandbox` come with the isolation work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Isolation {
    #[default]
    None,
}
