//! Every route about one user, declared once: its public route
//! (`/api/v1/users/{user}/<path>`), its node-to-node route
//! (`/internal/v1/users/{user}/<name>`), and who may call it. The public
//! router, the node-to-node router, the peer client and the CLI read the
//! declarations, and the permission check ([`user_may`]) reads
//! [`OPERATIONS`], so a new operation is one entry here plus its handlers
//! and its use case. An operation's type says which of the two routes it
//! has ([`Operation`], [`NoRoute`]), so a handler or a call for a route it
//! lacks does not compile.

use std::fmt;

use reqwest::Method;

/// Who may call an operation besides the admin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allowed {
    /// The admin only.
    Admin,
    /// The user a token belongs to, on their own user.
    User,
    /// The user too, when `[auth] users_may_patch` is set.
    UserWhenPatching,
}

/// The methods operations are declared with: a closed set, so the
/// routers and the clients map each to theirs with no case left over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verb {
    Get,
    Post,
    Put,
    Delete,
}

impl Verb {
    pub fn method(self) -> Method {
        match self {
            Verb::Get => Method::GET,
            Verb::Post => Method::POST,
            Verb::Put => Method::PUT,
            Verb::Delete => Method::DELETE,
        }
    }
}

/// A public route about one user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Public {
    pub verb: Verb,
    /// After `/api/v1/users/{user}/`, as axum declares it.
    pub path: &'static str,
    pub allowed: Allowed,
}

impl Public {
    /// `/api/v1/users/{user}/<path>`, the route to declare.
    pub fn route(&self) -> String {
        format!("/api/v1/users/{{user}}/{}", self.path)
    }

    /// The path's segments after the user's, for a client.
    pub fn segments(&self) -> Vec<&'static str> {
        self.path.split('/').collect()
    }
}

/// The node-to-node route of an operation that runs on the node owning
/// the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Internal {
    pub verb: Verb,
    /// After `/internal/v1/users/{user}/`.
    pub name: &'static str,
}

impl Internal {
    /// `/internal/v1/users/{user}/<name>`, the route to declare.
    pub fn route(&self) -> String {
        format!("/internal/v1/users/{{user}}/{}", self.name)
    }
}

/// The half of an operation it does not have: an operation's type says
/// which routes it has, so declaring a handler for a route it lacks, or
/// calling it there, does not compile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoRoute;

/// One operation about a user: public, node-to-node, or both. The
/// router, the peer client and the CLI take the half they need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation<P = Public, I = Internal> {
    pub public: P,
    pub internal: I,
}

/// `R` or [`NoRoute`] in its place.
pub trait MaybeRoute<R> {
    fn declared(&self) -> Option<&R>;
}

impl<R> MaybeRoute<R> for R {
    fn declared(&self) -> Option<&R> {
        Some(self)
    }
}

impl MaybeRoute<Public> for NoRoute {
    fn declared(&self) -> Option<&Public> {
        None
    }
}

impl MaybeRoute<Internal> for NoRoute {
    fn declared(&self) -> Option<&Internal> {
        None
    }
}

/// Any operation, whichever halves it has: what [`OPERATIONS`] lists.
pub trait DeclaredOperation: fmt::Debug + Sync {
    fn public(&self) -> Option<&Public>;
    /// Only the uniqueness test reads the node-to-node routes in a list:
    /// everything else takes them from each operation.
    #[cfg(test)]
    fn internal(&self) -> Option<&Internal>;
}

impl<P, I> DeclaredOperation for Operation<P, I>
where
    P: MaybeRoute<Public> + fmt::Debug + Sync,
    I: MaybeRoute<Internal> + fmt::Debug + Sync,
{
    fn public(&self) -> Option<&Public> {
        self.public.declared()
    }

    #[cfg(test)]
    fn internal(&self) -> Option<&Internal> {
        self.internal.declared()
    }
}

const fn both(
    verb: Verb,
    path: &'static str,
    allowed: Allowed,
    internal_verb: Verb,
    name: &'static str,
) -> Operation {
    Operation {
        public: Public {
            verb,
            path,
            allowed,
        },
        internal: Internal {
            verb: internal_verb,
            name,
        },
    }
}

const fn public_only(
    verb: Verb,
    path: &'static str,
    allowed: Allowed,
) -> Operation<Public, NoRoute> {
    Operation {
        public: Public {
            verb,
            path,
            allowed,
        },
        internal: NoRoute,
    }
}

/// The user's records and open breaker.
pub static STATUS: Operation = both(Verb::Get, "instance", Allowed::User, Verb::Get, "status");
/// Ensure running (a launch).
pub static LAUNCH: Operation = both(Verb::Post, "instance", Allowed::User, Verb::Post, "launch");
/// Stop the main and watchdog. A POST between nodes, as it always was.
pub static STOP: Operation = both(Verb::Delete, "instance", Allowed::User, Verb::Post, "stop");
/// A new process, ready. It relaunches with the parameters of the last
/// launch, so it gives a user nothing a stop and a start would not.
pub static RESTART: Operation = both(
    Verb::Post,
    "instance/restart",
    Allowed::User,
    Verb::Post,
    "restart",
);
/// Freeze the main with its memory intact.
pub static HIBERNATE: Operation = both(
    Verb::Post,
    "instance/hibernate",
    Allowed::User,
    Verb::Post,
    "hibernate",
);
/// Thaw a hibernated main.
pub static RESUME: Operation = both(
    Verb::Post,
    "instance/resume",
    Allowed::User,
    Verb::Post,
    "resume",
);
/// Restart (or force-launch) and report whether it stays up.
pub static PROBE: Operation = both(
    Verb::Post,
    "instance/probe",
    Allowed::Admin,
    Verb::Post,
    "probe",
);
/// The spawn's stages, as Server-Sent Events.
pub static PROGRESS: Operation = both(
    Verb::Get,
    "instance/progress",
    Allowed::User,
    Verb::Get,
    "progress",
);
/// The main's last lines, or followed as Server-Sent Events.
pub static LOGS: Operation = both(Verb::Get, "instance/logs", Allowed::User, Verb::Get, "logs");
/// The one-shot repair job.
pub static WATCHDOG: Operation = both(
    Verb::Post,
    "watchdog",
    Allowed::Admin,
    Verb::Post,
    "watchdog",
);
/// Clear the crash breaker: for a user only where they may patch, since
/// it lets them launch past it.
pub static RESET_BREAKER: Operation = both(
    Verb::Post,
    "breaker/reset",
    Allowed::UserWhenPatching,
    Verb::Post,
    "breaker/reset",
);
/// Give the user an egress policy of their own, in the body; between
/// nodes, the policy or `null` ([`crate::wire::EgressChange`]).
pub static SET_EGRESS: Operation = both(Verb::Put, "egress", Allowed::Admin, Verb::Post, "egress");
/// Give the user the node's egress policy again.
pub static CLEAR_EGRESS: Operation<Public, NoRoute> =
    public_only(Verb::Delete, "egress", Allowed::Admin);
/// Kill the main here if it runs under exactly the given epoch: only
/// between nodes.
pub static FENCE: Operation<NoRoute, Internal> = Operation {
    public: NoRoute,
    internal: Internal {
        verb: Verb::Post,
        name: "fence",
    },
};
/// Mint a user token (served from the store, on any node).
pub static MINT_TOKEN: Operation<Public, NoRoute> =
    public_only(Verb::Post, "tokens", Allowed::User);
/// List a user's tokens.
pub static LIST_TOKENS: Operation<Public, NoRoute> =
    public_only(Verb::Get, "tokens", Allowed::User);
/// Revoke a token and every token minted with it.
pub static REVOKE_TOKEN: Operation<Public, NoRoute> =
    public_only(Verb::Delete, "tokens/{id}", Allowed::User);

/// `/internal/v1/<path>` of the node-to-node calls about no one user:
/// restart every main the callee runs ([`crate::wire::RestartAll`]).
pub const NODE_RESTART_ALL: &str = "instances/restart-all";
/// Forget every cached user token ([`crate::wire::Purged`]).
pub const NODE_PURGE_TOKENS: &str = "tokens/purge";

/// Every operation about one user.
pub static OPERATIONS: &[&dyn DeclaredOperation] = &[
    &STATUS,
    &LAUNCH,
    &STOP,
    &RESTART,
    &HIBERNATE,
    &RESUME,
    &PROBE,
    &PROGRESS,
    &LOGS,
    &WATCHDOG,
    &RESET_BREAKER,
    &SET_EGRESS,
    &CLEAR_EGRESS,
    &FENCE,
    &MINT_TOKEN,
    &LIST_TOKENS,
    &REVOKE_TOKEN,
];

/// What a user token may do on its own user: the public route matched
/// (`method`, and `action`, the route after `{user}/` as declared, e.g.
/// `instance/logs`, `tokens/{id}`) grants it. Anything not declared here
/// is the admin's. `patch`, `folder` and `force` are checked on the
/// launch body itself.
pub fn user_may(method: &Method, action: &str, users_may_patch: bool) -> bool {
    OPERATIONS
        .iter()
        .filter_map(|op| op.public())
        .find(|p| p.verb.method() == method && p.path == action)
        .is_some_and(|p| match p.allowed {
            Allowed::Admin => false,
            Allowed::User => true,
            Allowed::UserWhenPatching => users_may_patch,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn no_route_is_declared_twice() {
        let mut public = HashSet::new();
        let mut internal = HashSet::new();
        for op in OPERATIONS {
            assert!(op.public().is_some() || op.internal().is_some(), "{op:?}");
            if let Some(p) = op.public() {
                assert!(public.insert((p.verb, p.path)), "{op:?}");
            }
            if let Some(i) = op.internal() {
                assert!(internal.insert(i.name), "{op:?}");
            }
        }
    }

    #[test]
    fn routes_are_spelled_from_the_declaration() {
        assert_eq!(
            RESTART.public.route(),
            "/api/v1/users/{user}/instance/restart"
        );
        assert_eq!(
            RESET_BREAKER.internal.route(),
            "/internal/v1/users/{user}/breaker/reset"
        );
        assert_eq!(FENCE.public(), None);
        assert_eq!(MINT_TOKEN.internal(), None);
        assert_eq!(LOGS.public.segments(), ["instance", "logs"]);
    }
}
