//! Every route about one user, declared once: its public route
//! (`/api/v1/users/{user}/<path>`), its node-to-node route
//! (`/internal/v1/users/{user}/<name>`), and who may call it. The public
//! router, the node-to-node router, the peer client, the CLI and the
//! permission check ([`user_may`]) all read [`OPERATIONS`], so a new
//! operation is one entry here plus its handlers and its use case.

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

/// A public route about one user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Public {
    pub method: Method,
    /// After `/api/v1/users/{user}/`, as axum declares it.
    pub path: &'static str,
    pub allowed: Allowed,
}

/// The node-to-node route of an operation that runs on the node owning
/// the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Internal {
    pub method: Method,
    /// After `/internal/v1/users/{user}/`.
    pub name: &'static str,
}

/// One operation about a user: public, node-to-node, or both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation {
    pub public: Option<Public>,
    pub internal: Option<Internal>,
}

impl Operation {
    /// `/api/v1/users/{user}/<path>`, the route to declare.
    pub fn public_route(&self) -> Option<String> {
        self.public
            .as_ref()
            .map(|p| format!("/api/v1/users/{{user}}/{}", p.path))
    }

    /// `/internal/v1/users/{user}/<name>`, the route to declare.
    pub fn internal_route(&self) -> Option<String> {
        self.internal
            .as_ref()
            .map(|i| format!("/internal/v1/users/{{user}}/{}", i.name))
    }

    /// The public path's segments after the user's, for a client.
    pub fn public_segments(&self) -> Vec<&'static str> {
        self.public
            .as_ref()
            .map(|p| p.path.split('/').collect())
            .unwrap_or_default()
    }
}

const fn both(
    method: Method,
    path: &'static str,
    allowed: Allowed,
    internal_method: Method,
    name: &'static str,
) -> Operation {
    Operation {
        public: Some(Public {
            method,
            path,
            allowed,
        }),
        internal: Some(Internal {
            method: internal_method,
            name,
        }),
    }
}

const fn public_only(method: Method, path: &'static str, allowed: Allowed) -> Operation {
    Operation {
        public: Some(Public {
            method,
            path,
            allowed,
        }),
        internal: None,
    }
}

/// The user's records and open breaker.
pub static STATUS: Operation = both(
    Method::GET,
    "instance",
    Allowed::User,
    Method::GET,
    "status",
);
/// Ensure running (a launch).
pub static LAUNCH: Operation = both(
    Method::POST,
    "instance",
    Allowed::User,
    Method::POST,
    "launch",
);
/// Stop the main and watchdog. A POST between nodes, as it always was.
pub static STOP: Operation = both(
    Method::DELETE,
    "instance",
    Allowed::User,
    Method::POST,
    "stop",
);
/// A new process, ready. It relaunches with the parameters of the last
/// launch, so it gives a user nothing a stop and a start would not.
pub static RESTART: Operation = both(
    Method::POST,
    "instance/restart",
    Allowed::User,
    Method::POST,
    "restart",
);
/// Freeze the main with its memory intact.
pub static HIBERNATE: Operation = both(
    Method::POST,
    "instance/hibernate",
    Allowed::User,
    Method::POST,
    "hibernate",
);
/// Thaw a hibernated main.
pub static RESUME: Operation = both(
    Method::POST,
    "instance/resume",
    Allowed::User,
    Method::POST,
    "resume",
);
/// Restart (or force-launch) and report whether it stays up.
pub static PROBE: Operation = both(
    Method::POST,
    "instance/probe",
    Allowed::Admin,
    Method::POST,
    "probe",
);
/// The spawn's stages, as Server-Sent Events.
pub static PROGRESS: Operation = both(
    Method::GET,
    "instance/progress",
    Allowed::User,
    Method::GET,
    "progress",
);
/// The main's last lines, or followed as Server-Sent Events.
pub static LOGS: Operation = both(
    Method::GET,
    "instance/logs",
    Allowed::User,
    Method::GET,
    "logs",
);
/// The one-shot repair job.
pub static WATCHDOG: Operation = both(
    Method::POST,
    "watchdog",
    Allowed::Admin,
    Method::POST,
    "watchdog",
);
/// Clear the crash breaker: for a user only where they may patch, since
/// it lets them launch past it.
pub static RESET_BREAKER: Operation = both(
    Method::POST,
    "breaker/reset",
    Allowed::UserWhenPatching,
    Method::POST,
    "breaker/reset",
);
/// Kill the main here if it runs under exactly the given epoch: only
/// between nodes.
pub static FENCE: Operation = Operation {
    public: None,
    internal: Some(Internal {
        method: Method::POST,
        name: "fence",
    }),
};
/// Mint a user token (served from the store, on any node).
pub static MINT_TOKEN: Operation = public_only(Method::POST, "tokens", Allowed::User);
/// List a user's tokens.
pub static LIST_TOKENS: Operation = public_only(Method::GET, "tokens", Allowed::User);
/// Revoke a token and every token minted with it.
pub static REVOKE_TOKEN: Operation = public_only(Method::DELETE, "tokens/{id}", Allowed::User);

/// `/internal/v1/<path>` of the node-to-node calls about no one user:
/// restart every main the callee runs ([`crate::wire::RestartAll`]).
pub const NODE_RESTART_ALL: &str = "instances/restart-all";
/// Forget every cached user token ([`crate::wire::Purged`]).
pub const NODE_PURGE_TOKENS: &str = "tokens/purge";

/// Every operation about one user.
pub static OPERATIONS: &[&Operation] = &[
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
        .filter_map(|op| op.public.as_ref())
        .find(|p| p.method == method && p.path == action)
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
            assert!(op.public.is_some() || op.internal.is_some(), "{op:?}");
            if let Some(p) = &op.public {
                assert!(public.insert((p.method.clone(), p.path)), "{op:?}");
            }
            if let Some(i) = &op.internal {
                assert!(internal.insert(i.name), "{op:?}");
            }
        }
    }

    #[test]
    fn routes_are_spelled_from_the_declaration() {
        assert_eq!(
            RESTART.public_route().as_deref(),
            Some("/api/v1/users/{user}/instance/restart")
        );
        assert_eq!(
            RESET_BREAKER.internal_route().as_deref(),
            Some("/internal/v1/users/{user}/breaker/reset")
        );
        assert_eq!(FENCE.public_route(), None);
        assert_eq!(MINT_TOKEN.internal_route(), None);
        assert_eq!(LOGS.public_segments(), ["instance", "logs"]);
    }
}
