//! A **test double** of the Kubernetes API server (feature `test-double`),
//! for tests on machines where no cluster can run. It is not Kubernetes:
//! it serves the parts berth uses, over real HTTP, to kube's real client.
//!
//! * pods, services, configmaps, persistentvolumeclaims and
//!   networkpolicies: create, get, list, replace, merge patch, delete;
//! * watch streams resumable by `resourceVersion`, with 410 Gone (as an
//!   `ERROR` event) once history is compacted, and label selectors;
//! * 404 `NotFound`, 409 `AlreadyExists` and `Conflict` (preconditions,
//!   stale `resourceVersion`s), graceful pod deletion and finalizers;
//! * pod logs, plain and followed;
//! * a stand-in kubelet (`kubelet.rs`) that runs each pod's `main`
//!   container as a real local process, so the programs, signals, exit
//!   codes and logs a test sees are real;
//! * controls a test uses to do what a cluster does behind berth's back:
//!   force readiness, restart a container, evict a pod, delete an object
//!   outright, cut and compact watches, refuse to schedule, count creates,
//!   and map a Service to the local port its pod listens on
//!   ([`ApiServerDouble::resolver`]);
//! * a record of every kind of request it answered, as RBAC names it
//!   ([`ApiServerDouble::api_use`]), against which a Role is checked.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test double: a panic is the failing test's report"
)]

mod deletion;
mod endpoints;
mod kubelet;
mod server;
mod store;
mod world;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use berth_core::Endpoint;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use endpoints::local_endpoint;
pub use store::Kind;
use store::{Key, Store};
use world::{Shared, World, lock};

use crate::runtime::EndpointResolver;

/// One kind of request, as an RBAC rule grants it: the API group (`""`
/// for the core group), the resource (with its subresource, `pods/log`)
/// and the verb (`get`, `list`, `watch`, `create`, `update`, `patch`,
/// `delete`, `deletecollection`).
pub type ApiUse = (String, String, String);

/// The RBAC rule a request needs, from its method, path and query; `None`
/// for a path that is not a namespaced resource's.
pub fn rbac_of(method: &http::Method, path: &str, query: Option<&str>) -> Option<ApiUse> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", "v1", "namespaces", _, rest @ ..] => ("", rest),
        ["apis", group, _, "namespaces", _, rest @ ..] => (*group, rest),
        _ => return None,
    };
    let watching = query.is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"));
    let (resource, verb) = match (rest, method.as_str()) {
        ([resource], "GET") if watching => (resource.to_string(), "watch"),
        ([resource], "GET") => (resource.to_string(), "list"),
        ([resource], "POST") => (resource.to_string(), "create"),
        ([resource], "DELETE") => (resource.to_string(), "deletecollection"),
        ([resource, _], method) => (
            resource.to_string(),
            match method {
                "GET" => "get",
                "PUT" => "update",
                "PATCH" => "patch",
                "DELETE" => "delete",
                _ => return None,
            },
        ),
        ([resource, _, sub], "GET") => (format!("{resource}/{sub}"), "get"),
        _ => return None,
    };
    Some((group.to_owned(), resource, verb.to_owned()))
}

/// The double. Dropping it kills every program it runs.
pub struct ApiServerDouble {
    shared: Arc<Shared>,
    addr: SocketAddr,
    _root: tempfile::TempDir,
}

impl ApiServerDouble {
    /// Serves on a free local port.
    ///
    /// # Panics
    ///
    /// When no temporary directory or local port can be had: it is test
    /// support, and a test cannot go on without it.
    pub async fn start() -> ApiServerDouble {
        let root = tempfile::tempdir().expect("a temporary directory for the double");
        // Searchable, as a node's volume directories are: a pod's shim
        // runs its program under another uid.
        std::fs::set_permissions(
            root.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .expect("the double's directory made searchable");
        let shared = Arc::new(Shared {
            world: Mutex::new(World {
                store: Store::default(),
                runs: HashMap::new(),
                gone_served: 0,
                unschedulable: false,
                before_delete: None,
            }),
            api_use: std::sync::Mutex::new(std::collections::BTreeSet::new()),
            root: root.path().to_owned(),
            cancel: CancellationToken::new(),
            tasks: TaskTracker::new(),
            gate: watch::Sender::new(false),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a local port for the double");
        let addr = listener.local_addr().expect("the double's address");
        let app = server::router(shared.clone());
        let cancel = shared.cancel.clone();
        shared.tasks.spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { cancel.cancelled().await })
                .await;
        });
        ApiServerDouble {
            shared,
            addr,
            _root: root,
        }
    }

    /// The base URL the double serves on (`http://127.0.0.1:<port>`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig file's content that points a client at the double.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\n\
             clusters:\n- name: double\n  cluster:\n    server: {}\n\
             users:\n- name: double\n  user: {{}}\n\
             contexts:\n- name: double\n  context:\n    cluster: double\n    user: double\n\
             current-context: double\n",
            self.url()
        )
    }

    /// kube's client, pointed at the double.
    pub fn client(&self) -> kube::Client {
        let uri: http::Uri = self.url().parse().expect("the double's URL");
        let config = kube::Config::new(uri);
        kube::Client::try_from(config).expect("a kube client for the double")
    }

    /// Answers a Service's endpoint with the local port of the pod it
    /// selects (`127.0.0.1:<port>`), as cluster DNS would with the pod's
    /// address.
    pub fn resolver(&self) -> Arc<dyn EndpointResolver> {
        Arc::new(DoubleEndpoints {
            shared: self.shared.clone(),
        })
    }

    /// Where a Service's pod listens, if it has a pod with a program.
    pub fn endpoint(&self, namespace: &str, service: &str) -> Option<SocketAddr> {
        local_endpoint(&self.shared, namespace, service, None)
    }

    /// How many create calls of `kind` the double has answered
    /// successfully.
    pub fn creates(&self, kind: Kind) -> usize {
        lock(&self.shared.world)
            .store
            .creates
            .get(&kind)
            .copied()
            .unwrap_or(0)
    }

    /// The stored object `name` of `kind` in `namespace`, as the JSON the
    /// double keeps.
    pub fn object(&self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        let key: Key = (kind, namespace.to_owned(), name.to_owned());
        lock(&self.shared.world).store.objects.get(&key).cloned()
    }

    /// Every stored object of `kind`, in every namespace.
    pub fn objects(&self, kind: Kind) -> Vec<Value> {
        lock(&self.shared.world)
            .store
            .objects
            .iter()
            .filter(|((k, _, _), _)| *k == kind)
            .map(|(_, o)| o.clone())
            .collect()
    }

    /// Whether the program of the pod with `uid` runs.
    pub fn running(&self, uid: &str) -> bool {
        lock(&self.shared.world)
            .runs
            .get(uid)
            .is_some_and(|r| r.pgid.is_some())
    }

    /// The local port the shim of the pod with `uid` listens on, which
    /// the user's EndpointSlice lists as `berth-shim`.
    pub fn shim_port(&self, uid: &str) -> Option<u16> {
        lock(&self.shared.world).runs.get(uid).map(|r| r.shim_port)
    }

    /// The uid a pod's shim runs the program of the pod with `uid` as (one
    /// per pod here, see the kubelet).
    pub fn program_uid(&self, uid: &str) -> Option<u32> {
        lock(&self.shared.world)
            .runs
            .get(uid)
            .map(|r| r.program_uid)
    }

    fn pod_uid(&self, namespace: &str, name: &str) -> Option<(Key, String)> {
        let key: Key = (Kind::Pod, namespace.to_owned(), name.to_owned());
        let uid = lock(&self.shared.world).store.objects.get(&key)?["metadata"]["uid"]
            .as_str()?
            .to_owned();
        Some((key, uid))
    }

    /// Forces pod `name`'s `Ready` condition (`None`: back to its probe).
    pub fn set_ready(&self, namespace: &str, name: &str, ready: Option<bool>) {
        if let Some((_, uid)) = self.pod_uid(namespace, name)
            && let Some(run) = lock(&self.shared.world).runs.get_mut(&uid)
        {
            run.ready_override = ready;
        }
    }

    /// The kubelet restarts pod `name`'s container, as it would under
    /// `restartPolicy: Always`: the program is killed and started again
    /// in the same pod, and the restart count rises.
    pub fn restart_container(&self, namespace: &str, name: &str) {
        let Some((_, uid)) = self.pod_uid(namespace, name) else {
            return;
        };
        let pgid = {
            let mut world = lock(&self.shared.world);
            let Some(run) = world.runs.get_mut(&uid) else {
                return;
            };
            run.restarts += 1;
            run.pgid
        };
        if let Some(pgid) = pgid {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pgid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }

    /// The kubelet evicts pod `name`: its program is killed and the pod
    /// fails with reason `Evicted`.
    pub fn evict(&self, namespace: &str, name: &str) {
        let Some((key, uid)) = self.pod_uid(namespace, name) else {
            return;
        };
        kubelet::terminate(&self.shared, &uid, 0);
        kubelet::update(&self.shared, &key, &uid, |pod| {
            pod["status"]["phase"] = json!("Failed");
            pod["status"]["reason"] = json!("Evicted");
            pod["status"]["message"] = json!("The node was low on resource: memory.");
        });
    }

    /// Every kind of request the double has answered so far, as the RBAC
    /// rule that allows it.
    pub fn api_use(&self) -> std::collections::BTreeSet<ApiUse> {
        self.shared
            .api_use
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Changes a stored object by a JSON merge patch, as another client of
    /// the API server would (watchers see it), without a request of its
    /// own in [`ApiServerDouble::api_use`].
    pub fn patch_behind_back(&self, kind: Kind, namespace: &str, name: &str, patch: &Value) {
        let key: Key = (kind, namespace.to_owned(), name.to_owned());
        let mut world = lock(&self.shared.world);
        let mut object = world.store.objects.get(&key).cloned().expect("the object");
        store::merge_patch(&mut object, patch);
        world.store.put(key, object, "MODIFIED");
    }

    /// Has another client change an object by a JSON merge patch between
    /// a replica's read of it and that replica's next DELETE of it: the
    /// patch is made when the DELETE arrives, before its preconditions are
    /// checked, so a DELETE conditional on what was read finds it changed.
    pub fn patch_before_next_delete(&self, kind: Kind, namespace: &str, name: &str, patch: Value) {
        let key: Key = (kind, namespace.to_owned(), name.to_owned());
        lock(&self.shared.world).before_delete = Some((key, patch));
    }

    /// Removes an object outright, finalizers or not, as an operator's
    /// force delete plus a finalizer removal would; a pod's program is
    /// killed.
    pub fn delete_behind_back(&self, kind: Kind, namespace: &str, name: &str) {
        let key: Key = (kind, namespace.to_owned(), name.to_owned());
        let removed = lock(&self.shared.world).store.remove(&key);
        if let (Kind::Pod, Some(object)) = (kind, removed)
            && let Some(uid) = object["metadata"]["uid"].as_str()
        {
            kubelet::terminate(&self.shared, uid, 0);
        }
    }

    /// New watches wait until [`ApiServerDouble::release_watches`]: once
    /// this returns, every watch is either registered (and ended by
    /// [`ApiServerDouble::close_watches`]) or waiting, including one whose
    /// request was already being answered.
    pub fn hold_watches(&self) {
        let _world = lock(&self.shared.world);
        self.shared.gate.send_replace(true);
    }

    /// Lets the watches held back by [`ApiServerDouble::hold_watches`]
    /// register.
    pub fn release_watches(&self) {
        let _world = lock(&self.shared.world);
        self.shared.gate.send_replace(false);
    }

    /// Ends every open watch stream (clients resume from their last
    /// resourceVersion).
    pub fn close_watches(&self) {
        lock(&self.shared.world).store.close_watches();
    }

    /// Forgets the event history: a watch resuming from before now gets
    /// 410 Gone and must list again.
    pub fn compact(&self) {
        lock(&self.shared.world).store.compact();
    }

    /// How many watches were answered 410 Gone.
    pub fn gone_served(&self) -> usize {
        lock(&self.shared.world).gone_served
    }

    /// New pods stay Pending, unschedulable.
    pub fn set_unschedulable(&self, unschedulable: bool) {
        lock(&self.shared.world).unschedulable = unschedulable;
    }

    /// The directory a claim's data is kept in.
    pub fn claim_dir(&self, claim: &str) -> PathBuf {
        kubelet::claim_dir(&self.shared.root, claim)
    }
}

impl Drop for ApiServerDouble {
    fn drop(&mut self) {
        kubelet::kill_all(&self.shared);
        self.shared.cancel.cancel();
    }
}

struct DoubleEndpoints {
    shared: Arc<Shared>,
}

impl EndpointResolver for DoubleEndpoints {
    fn endpoint(&self, namespace: &str, service: &str, port: u16) -> Endpoint {
        match local_endpoint(&self.shared, namespace, service, Some(port)) {
            Some(addr) => Endpoint {
                host: addr.ip().to_string(),
                port: addr.port(),
                reach: berth_core::Reach::default(),
            },
            None => Endpoint {
                host: format!("{service}.{namespace}.svc.double.invalid"),
                port,
                reach: berth_core::Reach::default(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Method;

    #[test]
    fn a_request_is_named_as_rbac_names_it() {
        let rule = |method: Method, path: &str, query: Option<&str>| {
            rbac_of(&method, path, query).map(|(g, r, v)| format!("{g}/{r}:{v}"))
        };
        let pods = "/api/v1/namespaces/berth/pods";
        assert_eq!(rule(Method::GET, pods, None).as_deref(), Some("/pods:list"));
        assert_eq!(
            rule(Method::GET, pods, Some("labelSelector=a&watch=true")).as_deref(),
            Some("/pods:watch")
        );
        assert_eq!(
            rule(Method::POST, pods, None).as_deref(),
            Some("/pods:create")
        );
        let pod = "/api/v1/namespaces/berth/pods/berth-alice";
        for (method, verb) in [
            (Method::GET, "get"),
            (Method::PUT, "update"),
            (Method::PATCH, "patch"),
            (Method::DELETE, "delete"),
        ] {
            assert_eq!(rule(method, pod, None), Some(format!("/pods:{verb}")));
        }
        assert_eq!(
            rule(Method::GET, &format!("{pod}/log"), Some("follow=true")).as_deref(),
            Some("/pods/log:get")
        );
        assert_eq!(
            rule(
                Method::PUT,
                "/apis/networking.k8s.io/v1/namespaces/berth/networkpolicies/berth-alice",
                None
            )
            .as_deref(),
            Some("networking.k8s.io/networkpolicies:update")
        );
        assert_eq!(rule(Method::GET, "/version", None), None);
    }
}
