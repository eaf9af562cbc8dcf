//! The HTTP API's success answers, one named type each: what the server
//! serializes (`serve::api`, its node-to-node routes) and what the peer
//! client and the CLI read back. Errors have their own one form,
//! [`berth_core::ErrorBody`].
//!
//! The JSON of each type is the API's contract (README.md, "HTTP API"):
//! field names, their order and whether an absent value is `null` or left
//! out are exactly what the API has always answered. A record that is
//! already its own wire shape (an [`Instance`], a [`ProbeReport`]) travels
//! as it is; these types name the envelope around it.
//!
//! The per-user operations themselves (path, method, who may call them)
//! are declared once in [`operation`].

pub mod operation;

use berth_core::egress::EgressPolicy;
use berth_core::{BreakerInfo, Epoch, Instance, UnixMillis, UserId};
use berth_store::{LeaseRecord, NodeRecord, NodeStatus, TokenRecord};
use serde::{Deserialize, Serialize};

// --- one user ---------------------------------------------------------------------

/// `GET /api/v1/users/{user}/instance`: a user's records and open breaker,
/// as the node that runs the user knows them. Absent records are `null`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserStatus {
    pub user: UserId,
    pub main: Option<Instance>,
    pub watchdog: Option<Instance>,
    pub breaker: Option<BreakerInfo>,
    /// `hibernate` or `stop`: what the owner node does when it idles.
    #[serde(default)]
    pub idle_action: Option<String>,
    /// Where the owner node's instances may connect: its `[isolation]
    /// egress` and `egress_allow`; absent where berth does not guard it
    /// (level `none`, or pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<EgressPolicy>,
}

/// `POST …/instance`, `…/instance/restart`, `/api/v1/leases/{user}/takeover`:
/// the instance and the URL of the user's app. The launch token is the
/// program's secret and is never part of it (the proxy presents it; see
/// `berth_proxy::credential`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchAnswer {
    pub instance: Instance,
    pub url: String,
    /// Whether a browser that opens `url` can sign in there.
    pub sign_in: bool,
}

/// `POST …/instance/hibernate` and `…/instance/resume`: the instance as the
/// change left it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceAnswer {
    pub instance: Instance,
}

/// `GET …/instance/logs?tail=N` (and its node-to-node form): the last
/// lines of the user's main output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogLines {
    pub user: UserId,
    pub lines: Vec<String>,
}

/// One report of `GET …/instance/progress` (an `event: status`): an
/// [`berth_core::InstanceEvent`] of the main, or `{"status": "none"}`
/// when there is no main. Only what a reader needs is named; an older
/// node's report has no `stage`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageReport {
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl StageReport {
    /// The status of a stream that found no main.
    pub const NONE: &'static str = "none";
}

// --- credentials ------------------------------------------------------------------

/// How a user's app is reached: `<slug>.<base_domain>`, or a base path on
/// the berth host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Routing {
    Host,
    Path,
}

/// The body of `POST /api/v1/users/{user}/tokens` (none at all is the
/// default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MintRequest {
    /// A shorter life than `[auth] user_token_ttl_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_s: Option<u64>,
}

/// `POST /api/v1/users/{user}/tokens` (201): the token (shown once), its
/// record, and the link that opens the user's app with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MintedToken {
    pub user: UserId,
    pub token: String,
    pub id: String,
    pub created_at: UnixMillis,
    pub expires_at: UnixMillis,
    /// The token it was minted with; `null` when the admin minted it.
    pub parent: Option<String>,
    pub url: String,
    pub routing: Routing,
}

/// `GET /api/v1/users/{user}/tokens`: every live token, never a secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenList {
    pub user: UserId,
    pub tokens: Vec<TokenRecord>,
}

/// `DELETE /api/v1/users/{user}/tokens/{id}`: the ids deleted (the token
/// and every token minted with it), and the nodes that could not be told.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Revoked {
    pub user: UserId,
    pub revoked: Vec<String>,
    pub unreached_nodes: Vec<String>,
}

/// `POST /api/v1/session` (201): the session's CSRF token; the session
/// itself is the cookie.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionStarted {
    pub csrf_token: String,
    pub expires_at: UnixMillis,
}

/// `GET /api/v1/session`: the current session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionInfo {
    pub csrf_token: String,
    pub expires_at: UnixMillis,
    /// A signed-in user's session; `null` for the admin token's.
    pub user: Option<UserId>,
    pub admin: bool,
    /// Where the signed-in user's app opens; `null` for the admin's.
    pub app_url: Option<String>,
}

// --- the admin's ------------------------------------------------------------------

/// `GET /api/v1/instances`. Serialized straight from the records: a node
/// of thousands would otherwise build a JSON tree of every record first,
/// the largest thing berth allocates, and glibc keeps its freed memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceList {
    pub instances: Vec<Instance>,
}

/// `GET /api/v1/nodes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeList {
    pub nodes: Vec<NodeRecord>,
}

/// `GET /api/v1/leases`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseList {
    pub leases: Vec<LeaseRecord>,
}

/// `POST /api/v1/node/drain` and `…/undrain`: the node and its status now
/// (`draining` or `up`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeChanged {
    pub node: String,
    pub status: NodeStatus,
}

/// One user's outcome of a restart-all, with the node that ran it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRestart {
    pub user: UserId,
    pub node: String,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `POST /api/v1/instances/restart-all` (cluster-wide) and
/// `/internal/v1/instances/restart-all` (one node's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartAll {
    pub results: Vec<NodeRestart>,
}

impl RestartAll {
    /// Whether any restart failed.
    pub fn any_failed(&self) -> bool {
        self.results.iter().any(|r| !r.ok)
    }
}

// --- node to node -----------------------------------------------------------------

/// `/internal/v1/users/{user}/launch` and `…/restart`: what the callee's
/// launch produced. The caller adds the app's URL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launched {
    /// A new instance (201), or the one already running (200).
    pub created: bool,
    pub instance: Instance,
}

/// `/internal/v1/users/{user}/status`: the user's records as the callee
/// knows them (the public answer adds the user).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserState {
    pub main: Option<Instance>,
    pub watchdog: Option<Instance>,
    pub breaker: Option<BreakerInfo>,
    /// `hibernate` or `stop`: what the owner node does when it idles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_action: Option<String>,
    /// Where the owner node's instances may connect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<EgressPolicy>,
}

/// The body of `POST /internal/v1/users/{user}/egress`: the user's own
/// egress policy, or `null` for the node's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressChange {
    pub policy: Option<EgressPolicy>,
}

/// A user's egress policy once changed: the one their instances now
/// have, and whether it is their own or the node's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserEgress {
    pub user: UserId,
    pub egress: EgressPolicy,
    pub own: bool,
}

/// The answer of a node-to-node call that has nothing to say (a stop, a
/// breaker reset): `{}`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {}

/// The body of `POST /internal/v1/users/{user}/fence`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FenceRequest {
    pub epoch: Epoch,
}

/// The answer of a fence: whether a main under exactly `epoch` was killed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fenced {
    pub user: UserId,
    pub epoch: Epoch,
    pub fenced: bool,
}

/// The answer of `POST /internal/v1/tokens/purge`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Purged {
    pub purged: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_core::{InstanceStatus, Role};
    use serde::de::DeserializeOwned;
    use serde_json::{Value, json};

    /// `value` serialized is `want`, and reads back as itself.
    fn round_trip<T>(value: &T, want: &Value)
    where
        T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug,
    {
        let text = serde_json::to_string(value).unwrap();
        let json: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(&json, want, "{text}");
        let back: T = serde_json::from_str(&text).unwrap();
        assert_eq!(&back, value, "{text}");
    }

    fn alice() -> UserId {
        UserId::parse("alice").unwrap()
    }

    fn instance() -> Instance {
        Instance {
            id: "alice-1".into(),
            user: alice(),
            role: Role::Main,
            status: InstanceStatus::Running,
            node: "node-a".into(),
            epoch: 3,
            port: Some(9000),
            pid: Some(42),
            runtime_ref: None,
            folder: String::new(),
            started_at: 1_000,
            ready: true,
            restarts: 0,
            last_error: None,
            exit_code: None,
            last_active: 2_000,
            hibernated_at: None,
        }
    }

    #[test]
    fn answers_keep_their_shapes_and_read_back() {
        let inst = serde_json::to_value(instance()).unwrap();
        round_trip(
            &UserStatus {
                user: alice(),
                main: Some(instance()),
                watchdog: None,
                breaker: None,
                idle_action: None,
                egress: None,
            },
            &json!({"user": "alice", "main": inst, "watchdog": null, "breaker": null,
                    "idle_action": null}),
        );
        round_trip(
            &LaunchAnswer {
                instance: instance(),
                url: "http://h/u/alice/".into(),
                sign_in: false,
            },
            &json!({"instance": inst, "url": "http://h/u/alice/", "sign_in": false}),
        );
        round_trip(
            &InstanceAnswer {
                instance: instance(),
            },
            &json!({ "instance": inst }),
        );
        round_trip(
            &LogLines {
                user: alice(),
                lines: vec!["a".into(), "\u{1b}b".into()],
            },
            &json!({"user": "alice", "lines": ["a", "\u{1b}b"]}),
        );
        round_trip(
            &MintedToken {
                user: alice(),
                token: "secret".into(),
                id: "t1".into(),
                created_at: 1,
                expires_at: 2,
                parent: None,
                url: "http://h/u/alice/?berth_token=secret".into(),
                routing: Routing::Path,
            },
            &json!({"user": "alice", "token": "secret", "id": "t1", "created_at": 1,
                    "expires_at": 2, "parent": null,
                    "url": "http://h/u/alice/?berth_token=secret", "routing": "path"}),
        );
        round_trip(&MintRequest { ttl_s: Some(60) }, &json!({"ttl_s": 60}));
        round_trip(&MintRequest::default(), &json!({}));
        round_trip(
            &Revoked {
                user: alice(),
                revoked: vec!["t1".into()],
                unreached_nodes: vec![],
            },
            &json!({"user": "alice", "revoked": ["t1"], "unreached_nodes": []}),
        );
        round_trip(
            &SessionInfo {
                csrf_token: "c".into(),
                expires_at: 5,
                user: None,
                admin: true,
                app_url: None,
            },
            &json!({"csrf_token": "c", "expires_at": 5, "user": null, "admin": true,
                    "app_url": null}),
        );
        round_trip(
            &NodeChanged {
                node: "node-a".into(),
                status: NodeStatus::Draining,
            },
            &json!({"node": "node-a", "status": "draining"}),
        );
        round_trip(
            &RestartAll {
                results: vec![
                    NodeRestart {
                        user: alice(),
                        node: "node-a".into(),
                        ok: true,
                        error: None,
                    },
                    NodeRestart {
                        user: alice(),
                        node: "node-b".into(),
                        ok: false,
                        error: Some("boom".into()),
                    },
                ],
            },
            &json!({"results": [
                {"user": "alice", "node": "node-a", "ok": true},
                {"user": "alice", "node": "node-b", "ok": false, "error": "boom"},
            ]}),
        );
        round_trip(
            &StageReport {
                status: "none".into(),
                stage: None,
                message: None,
            },
            &json!({"status": "none"}),
        );
    }

    #[test]
    fn node_to_node_answers_keep_their_shapes_and_read_back() {
        let inst = serde_json::to_value(instance()).unwrap();
        round_trip(
            &Launched {
                created: true,
                instance: instance(),
            },
            &json!({"created": true, "instance": inst}),
        );
        round_trip(
            &UserState {
                main: None,
                watchdog: None,
                breaker: None,
                idle_action: Some("hibernate".into()),
                egress: Some(EgressPolicy {
                    mode: berth_core::egress::EgressMode::Allowlist,
                    allow: vec![
                        "pypi.org".parse().unwrap(),
                        "10.8.0.0/24:5432".parse().unwrap(),
                    ],
                }),
            },
            &json!({"main": null, "watchdog": null, "breaker": null,
                    "idle_action": "hibernate",
                    "egress": {"mode": "allowlist", "allow": ["pypi.org", "10.8.0.0/24:5432"]}}),
        );
        round_trip(&Done {}, &json!({}));
        round_trip(&FenceRequest { epoch: 7 }, &json!({"epoch": 7}));
        round_trip(
            &Fenced {
                user: alice(),
                epoch: 7,
                fenced: true,
            },
            &json!({"user": "alice", "epoch": 7, "fenced": true}),
        );
        round_trip(&Purged { purged: true }, &json!({"purged": true}));
    }

    #[test]
    fn a_stage_report_reads_an_instance_event() {
        let event = berth_core::InstanceEvent {
            user: alice(),
            role: Role::Main,
            status: InstanceStatus::Starting,
            ready: false,
            endpoint: None,
            message: Some("queued behind 2".into()),
            stage: berth_core::Stage::Queued,
        };
        let report: StageReport =
            serde_json::from_value(serde_json::to_value(&event).unwrap()).unwrap();
        assert_eq!(report.status, "starting");
        assert_eq!(report.stage.as_deref(), Some("queued"));
        assert_eq!(report.message.as_deref(), Some("queued behind 2"));
    }
}
