//! How the local runtime tells that a starting instance is ready (the
//! isolation level and limits live in [`crate::isolation`]).

/// How berth decides that a starting instance is ready.
#[derive(Debug, Clone)]
pub enum Readiness {
    /// A stdout/stderr line matches; the first capture group is the launch
    /// token.
    TokenRegex(regex::Regex),
    /// `GET <path>` on the instance's port answers below 500.
    Http {
        /// The path requested (a missing leading `/` is added).
        path: String,
    },
    /// A TCP connect to the instance's port succeeds.
    Tcp,
}
