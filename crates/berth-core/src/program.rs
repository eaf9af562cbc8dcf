//! The program contract every runtime keeps: what berth tells a runtime
//! about the program it runs, whatever runs it.

/// How a runtime tells that a starting program is ready, once it runs.
///
/// One type for every runtime; each checks it its own way. The local
/// runtime reads the program's output and asks its port itself; a pod's
/// readiness probe (HTTP, TCP) is the kubelet's, with the kubelet's rules.
#[derive(Debug, Clone)]
pub enum Readiness {
    /// A line of the program's output matches; the first capture group is
    /// the launch token.
    TokenRegex(regex::Regex),
    /// A `GET` of this path on the program's port answers: below 500 when
    /// berth asks (the program answered, even if it refused), below 400
    /// from a pod's probe (the kubelet's rule).
    Http {
        /// The path requested (a missing leading `/` is added).
        path: String,
    },
    /// A TCP connection to the program's port is accepted.
    Tcp,
}
