//! [`K8sRuntime`]: the I/O of the Kubernetes runtime.
//!
//! One watch ([`kube::runtime::watcher`] over every pod labelled
//! `app.kubernetes.io/managed-by=berth` in the namespace) keeps an
//! in-memory cache of the pods; each followed run gets the latest
//! [`PodView`] of its pod through a `watch` channel and turns it into
//! events with its [`Tracker`]. Nothing polls the API server per user.
//!
//! Every pod carries berth's finalizer, so its object (exit status, log)
//! stays until berth has read it, and its name stays taken until its
//! containers are dead. The watch loop hands each pod of this node that is
//! being deleted and has ended to a collector task, which keeps its log
//! tail and removes the finalizer.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use berth_core::runtime::{
    Capabilities, Discovered, EVENT_BUFFER, InstanceSpec, Patch, Runtime, RuntimeError,
    RuntimeEvent, RuntimeRef, Started,
};
use berth_core::{Endpoint, Epoch, Role, Slug, UserId};
use futures_util::io::AsyncBufReadExt;
use futures_util::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{
    Api, DeleteParams, ListParams, LogParams, Patch as KubePatch, PatchParams, PostParams,
    Preconditions,
};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::EndpointMode;
use crate::manifest::{self, MAIN_CONTAINER, PodInput};
use crate::names;
use crate::observe::{self, PodView, StartOutcome, Step, Tracker};
use crate::{K8sRuntimeConfig, Readiness};

/// Lines of an ended pod's log the runtime keeps for `logs`.
const KEPT_LINES: usize = 1000;
/// How many times a conflicting write is read and tried again.
const CONFLICT_RETRIES: usize = 8;
/// How long the first list of pods may take before a call that needs it
/// fails (the API server is unreachable, or berth may not list pods).
const SYNC_TIMEOUT: Duration = Duration::from_secs(60);
/// How much of a log adoption reads for the launch token.
const TOKEN_SCAN_BYTES: i64 = 1 << 20;
/// Lines buffered for one `follow_logs` reader.
const FOLLOW_BUFFER: usize = 256;
/// How often a start looks again for its pod in the Service's
/// EndpointSlices (`endpoint = "endpoint_slice"`): the cluster's
/// EndpointSlice controller lists a pod a moment after it has an address.
const SLICE_POLL: Duration = Duration::from_millis(200);
/// The label Kubernetes puts on a Service's EndpointSlices.
const SLICE_SERVICE_LABEL: &str = "kubernetes.io/service-name";

/// Where the proxy reaches a user's Service.
pub trait EndpointResolver: Send + Sync + 'static {
    fn endpoint(&self, namespace: &str, service: &str, port: u16) -> Endpoint;
}

/// The Service's cluster DNS name: `<service>.<namespace>.svc.<domain>`.
#[derive(Debug, Clone)]
pub struct ServiceDns {
    pub cluster_domain: String,
}

impl EndpointResolver for ServiceDns {
    fn endpoint(&self, namespace: &str, service: &str, port: u16) -> Endpoint {
        Endpoint {
            host: format!("{service}.{namespace}.svc.{}", self.cluster_domain),
            port,
            reach: berth_core::Reach::default(),
        }
    }
}

/// The Kubernetes runtime. See the crate docs.
pub struct K8sRuntime {
    inner: Arc<Inner>,
}

struct Inner {
    config: K8sRuntimeConfig,
    resolver: Arc<dyn EndpointResolver>,
    pods: Api<Pod>,
    services: Api<Service>,
    config_maps: Api<ConfigMap>,
    policies: Api<NetworkPolicy>,
    claims: Api<PersistentVolumeClaim>,
    slices: Api<EndpointSlice>,
    state: Mutex<State>,
    /// Bumped after every change of the cache.
    changes: watch::Sender<u64>,
    tasks: TaskTracker,
    cancel: CancellationToken,
}

#[derive(Default)]
struct State {
    /// Every berth pod of the namespace, as the watch last saw it.
    pods: HashMap<String, Pod>,
    /// The watch has listed everything once.
    synced: bool,
    /// The followed runs, by pod name.
    runs: HashMap<String, RunHandle>,
    /// Log tails of ended pods, by pod name.
    kept_logs: HashMap<String, Vec<String>>,
    /// Pods a collector task is working on.
    collecting: HashSet<String>,
}

struct RunHandle {
    uid: String,
    views: watch::Sender<PodView>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

fn failed(what: &str, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Failed(format!("{what}: {e}"))
}

/// Kubernetes grace periods are whole seconds, and 0 would be a force
/// delete, which frees the name before the kubelet has killed the
/// container: the next pod of the user could start while the old one
/// still writes. So at least 1.
fn grace_seconds(grace: Duration) -> u32 {
    let secs = grace.as_secs() + u64::from(grace.subsec_nanos() > 0);
    u32::try_from(secs).unwrap_or(u32::MAX).max(1)
}

/// Whether every field of `want` is in `have` with the same value: berth's
/// fields of an object, ignoring what the API server added.
fn contains(have: &Value, want: &Value) -> bool {
    match (have, want) {
        (Value::Object(h), Value::Object(w)) => w
            .iter()
            .all(|(k, v)| v.is_null() || h.get(k).is_some_and(|hv| contains(hv, v))),
        (Value::Array(h), Value::Array(w)) => {
            h.len() == w.len() && h.iter().zip(w).all(|(h, w)| contains(h, w))
        }
        _ => have == want,
    }
}

/// Whether `existing` already has everything of `desired`: its labels and
/// annotations, and its body — exactly (`whole`), or with what the API
/// server added.
fn owns_all<K: Serialize>(existing: &K, desired: &K, whole: bool) -> bool {
    let (mut have, mut want) = (owned_fields(existing), owned_fields(desired));
    let (have_meta, want_meta) = (have["metadata"].take(), want["metadata"].take());
    contains(&have_meta, &want_meta)
        && if whole {
            have == want
        } else {
            contains(&have, &want)
        }
}

/// The parts of an object berth owns: labels, annotations, and everything
/// but the metadata.
fn owned_fields<K: Serialize>(object: &K) -> Value {
    let mut value = serde_json::to_value(object).unwrap_or(Value::Null);
    if let Value::Object(map) = &mut value {
        let meta = map.remove("metadata").unwrap_or(Value::Null);
        map.insert(
            "metadata".into(),
            json!({ "labels": meta["labels"], "annotations": meta["annotations"] }),
        );
        map.remove("status");
    }
    value
}

/// kube's client for `[kubernetes]`: from `kubeconfig` (and `context`)
/// when set, else as kube infers it (`KUBECONFIG`, `~/.kube/config`, or
/// the service account of the pod berth runs in).
pub async fn connect(config: &crate::KubernetesConfig) -> Result<Client, RuntimeError> {
    use kube::config::{KubeConfigOptions, Kubeconfig};
    let options = KubeConfigOptions {
        context: config.context.clone(),
        ..KubeConfigOptions::default()
    };
    let client_config = match (&config.kubeconfig, &config.context) {
        (Some(path), _) => {
            let file = Kubeconfig::read_from(path).map_err(|e| {
                failed(&format!("cannot read the kubeconfig {}", path.display()), e)
            })?;
            kube::Config::from_custom_kubeconfig(file, &options)
                .await
                .map_err(|e| failed(&format!("kubeconfig {}", path.display()), e))?
        }
        (None, Some(_)) => kube::Config::from_kubeconfig(&options)
            .await
            .map_err(|e| failed("kubeconfig", e))?,
        (None, None) => kube::Config::infer()
            .await
            .map_err(|e| failed("cannot find a Kubernetes configuration", e))?,
    };
    Client::try_from(client_config).map_err(|e| failed("cannot build the Kubernetes client", e))
}

impl K8sRuntime {
    /// A runtime over `client`, answering endpoints with the Service's DNS
    /// name. Starts the watch (so it must be called within a Tokio
    /// runtime); [`Runtime::discover`] and [`Runtime::start`] wait for its
    /// first list.
    pub fn new(client: Client, config: K8sRuntimeConfig) -> Result<Arc<K8sRuntime>, RuntimeError> {
        let resolver = Arc::new(ServiceDns {
            cluster_domain: config.kubernetes.cluster_domain.clone(),
        });
        Self::with_resolver(client, config, resolver)
    }

    /// Like [`K8sRuntime::new`], with another way to reach a Service (a
    /// test double's local endpoints).
    pub fn with_resolver(
        client: Client,
        config: K8sRuntimeConfig,
        resolver: Arc<dyn EndpointResolver>,
    ) -> Result<Arc<K8sRuntime>, RuntimeError> {
        config
            .validate()
            .map_err(|e| RuntimeError::Failed(e.to_string()))?;
        let ns = config.kubernetes.namespace.clone();
        let inner = Arc::new(Inner {
            pods: Api::namespaced(client.clone(), &ns),
            services: Api::namespaced(client.clone(), &ns),
            config_maps: Api::namespaced(client.clone(), &ns),
            policies: Api::namespaced(client.clone(), &ns),
            claims: Api::namespaced(client.clone(), &ns),
            slices: Api::namespaced(client, &ns),
            config,
            resolver,
            state: Mutex::new(State::default()),
            changes: watch::Sender::new(0),
            tasks: TaskTracker::new(),
            cancel: CancellationToken::new(),
        });
        let watching = inner.clone();
        inner
            .tasks
            .spawn(async move { watching.watch_pods().await });
        Ok(Arc::new(K8sRuntime { inner }))
    }
}

impl Inner {
    fn namespace(&self) -> &str {
        &self.config.kubernetes.namespace
    }

    fn needs_token(&self) -> bool {
        matches!(self.config.readiness, Readiness::TokenRegex(_))
    }

    fn memory_limit_mb(&self) -> Option<u64> {
        self.config.kubernetes.memory_limit_mb()
    }

    fn tracker(&self, uid: &str, epoch: Epoch) -> Tracker {
        Tracker::new(uid, epoch, self.needs_token(), self.memory_limit_mb())
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// The one watch: keeps the cache and feeds the followed runs.
    async fn watch_pods(self: Arc<Self>) {
        let config = watcher::Config::default().labels(&names::managed_selector());
        let stream = watcher::watcher(self.pods.clone(), config).default_backoff();
        let mut stream = std::pin::pin!(stream);
        let mut listing: Option<HashMap<String, Pod>> = None;
        loop {
            let event = tokio::select! {
                _ = self.cancel.cancelled() => return,
                event = stream.next() => event,
            };
            let Some(event) = event else { return };
            match event {
                Ok(Event::Init) => listing = Some(HashMap::new()),
                Ok(Event::InitApply(pod)) => {
                    if let Some(listing) = listing.as_mut() {
                        listing.insert(pod.name_any(), pod);
                    }
                }
                Ok(Event::InitDone) => {
                    let listed = listing.take().unwrap_or_default();
                    self.relisted(listed);
                }
                Ok(Event::Apply(pod)) => self.applied(pod),
                Ok(Event::Delete(pod)) => self.deleted(&pod),
                Err(e) => {
                    tracing::warn!(error = %e, "watching pods failed; resuming");
                }
            }
            self.changed();
        }
    }

    fn applied(self: &Arc<Self>, pod: Pod) {
        let name = pod.name_any();
        let view = PodView::of(&pod);
        {
            let mut state = lock(&self.state);
            state.pods.insert(name.clone(), pod);
            if let Some(run) = state.runs.get(&name) {
                run.views.send_replace(view.clone());
            }
        }
        self.collect_if_due(&view);
    }

    fn deleted(&self, pod: &Pod) {
        let name = pod.name_any();
        let mut state = lock(&self.state);
        let still_there = state
            .pods
            .get(&name)
            .is_some_and(|p| p.metadata.uid != pod.metadata.uid);
        if !still_there {
            state.pods.remove(&name);
        }
        if let Some(run) = state.runs.get(&name)
            && pod.metadata.uid.as_deref() == Some(run.uid.as_str())
        {
            let mut view = PodView::of(pod);
            view.gone = true;
            run.views.send_replace(view);
        }
    }

    /// After a (re)list: pods missing from it were deleted meanwhile.
    fn relisted(self: &Arc<Self>, listed: HashMap<String, Pod>) {
        let views: Vec<PodView> = listed.values().map(PodView::of).collect();
        {
            let mut state = lock(&self.state);
            let old = std::mem::replace(&mut state.pods, listed);
            state.synced = true;
            for (name, run) in &state.runs {
                let view = match state.pods.get(name) {
                    Some(pod) => PodView::of(pod),
                    None => {
                        let Some(last) = old.get(name) else { continue };
                        let mut view = PodView::of(last);
                        view.gone = true;
                        view
                    }
                };
                run.views.send_replace(view);
            }
        }
        for view in &views {
            self.collect_if_due(view);
        }
    }

    /// This node's pods that are being deleted and have ended (or never
    /// got a node) lose berth's finalizer, once their log is kept.
    fn collect_if_due(self: &Arc<Self>, view: &PodView) {
        let ours = view.node.as_deref() == Some(self.config.node.as_str());
        if !(ours && view.deleting && view.finalized && (view.ended() || !view.scheduled)) {
            return;
        }
        if !lock(&self.state).collecting.insert(view.name.clone()) {
            return;
        }
        let (inner, name, uid) = (self.clone(), view.name.clone(), view.uid.clone());
        self.tasks.spawn(async move {
            let collect = async {
                inner.keep_log(&name).await;
                if let Err(e) = inner.release_finalizer(&name, &uid).await {
                    tracing::warn!(pod = %name, error = %e, "could not remove berth's finalizer");
                }
            };
            // Cut short by a shutdown, the next berth's relist collects it.
            tokio::select! {
                _ = inner.cancel.cancelled() => {}
                () = collect => {}
            }
            lock(&inner.state).collecting.remove(&name);
        });
    }

    /// Keeps the tail of `name`'s log for after the pod is gone.
    async fn keep_log(&self, name: &str) {
        let params = LogParams {
            container: Some(MAIN_CONTAINER.into()),
            tail_lines: Some(KEPT_LINES as i64),
            ..LogParams::default()
        };
        if let Ok(text) = self.pods.logs(name, &params).await {
            let lines: Vec<String> = text.lines().map(str::to_owned).collect();
            lock(&self.state).kept_logs.insert(name.to_owned(), lines);
        }
    }

    /// Removes berth's finalizer from pod `name` if it is still `uid`.
    async fn release_finalizer(&self, name: &str, uid: &str) -> Result<(), kube::Error> {
        for _ in 0..CONFLICT_RETRIES {
            let pod = match self.pods.get_opt(name).await? {
                Some(pod) if pod.metadata.uid.as_deref() == Some(uid) => pod,
                _ => return Ok(()),
            };
            let finalizers: Vec<String> = pod
                .finalizers()
                .iter()
                .filter(|f| *f != names::FINALIZER)
                .cloned()
                .collect();
            if finalizers.len() == pod.finalizers().len() {
                return Ok(());
            }
            let patch = json!({
                "metadata": {
                    "finalizers": finalizers,
                    "resourceVersion": pod.resource_version(),
                }
            });
            match self
                .pods
                .patch(name, &PatchParams::default(), &KubePatch::Merge(&patch))
                .await
            {
                Ok(_) => return Ok(()),
                Err(e) if matches!(code(&e), Some(409)) => continue,
                Err(e) if matches!(code(&e), Some(404)) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    async fn wait_synced(&self, deadline: tokio::time::Instant) -> Result<(), RuntimeError> {
        let deadline = deadline.min(tokio::time::Instant::now() + SYNC_TIMEOUT);
        let mut changes = self.changes.subscribe();
        loop {
            if lock(&self.state).synced {
                return Ok(());
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                _ => {
                    return Err(RuntimeError::Failed(format!(
                        "no list of pods from the Kubernetes API server in namespace {}",
                        self.namespace()
                    )));
                }
            }
        }
    }

    fn cached_view(&self, name: &str) -> Option<PodView> {
        lock(&self.state).pods.get(name).map(PodView::of)
    }

    /// Waits until the cache's pod `name` (or its absence) passes `check`.
    async fn wait_view(
        &self,
        name: &str,
        deadline: tokio::time::Instant,
        check: impl Fn(Option<&PodView>) -> bool,
    ) -> bool {
        let mut changes = self.changes.subscribe();
        loop {
            if check(self.cached_view(name).as_ref()) {
                return true;
            }
            if !matches!(
                tokio::time::timeout_at(deadline, changes.changed()).await,
                Ok(Ok(()))
            ) {
                return false;
            }
        }
    }

    /// Waits until the cache has no pod `name` with `uid`.
    async fn wait_gone(&self, name: &str, uid: &str, deadline: tokio::time::Instant) -> bool {
        self.wait_view(name, deadline, |v| v.is_none_or(|v| v.uid != uid))
            .await
    }

    /// Creates `desired`, or brings the existing object's berth fields in
    /// line (`replace`: a PUT; otherwise a merge patch, which keeps what
    /// the API server allocated, such as a Service's addresses).
    async fn ensure<K>(&self, api: &Api<K>, desired: &K, replace: bool) -> Result<(), kube::Error>
    where
        K: Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
    {
        let name = desired.meta().name.clone().unwrap_or_default();
        for _ in 0..CONFLICT_RETRIES {
            match api.create(&PostParams::default(), desired).await {
                Ok(_) => return Ok(()),
                Err(e) if code(&e) == Some(409) => {}
                Err(e) => return Err(e),
            }
            let Some(existing) = api.get_opt(&name).await? else {
                continue;
            };
            if owns_all(&existing, desired, replace) {
                return Ok(());
            }
            let result = if replace {
                let mut object = desired.clone();
                object.meta_mut().resource_version = existing.resource_version();
                api.replace(&name, &PostParams::default(), &object)
                    .await
                    .map(drop)
            } else {
                api.patch(&name, &PatchParams::default(), &KubePatch::Merge(desired))
                    .await
                    .map(drop)
            };
            match result {
                Ok(()) => return Ok(()),
                Err(e) if matches!(code(&e), Some(409 | 404)) => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The user's objects besides the pod; the patch's hash.
    async fn ensure_objects(&self, spec: &InstanceSpec) -> Result<String, RuntimeError> {
        let k = &self.config.kubernetes;
        let (user, slug) = (&spec.user, &spec.slug);
        let bad = |e: crate::ConfigError| RuntimeError::SpawnFailed(e.to_string());
        if let Some(claim) = manifest::claim(k, user, slug).map_err(bad)? {
            // A user's claim is never changed or deleted: it holds their data.
            match self.claims.create(&PostParams::default(), &claim).await {
                Ok(_) => {}
                Err(e) if code(&e) == Some(409) => {}
                Err(e) => return Err(failed("cannot create the user's volume claim", e)),
            }
        }
        let patch_hash = match &spec.patch {
            Patch::Set(content) => {
                let map = manifest::patch_config_map(
                    k,
                    user,
                    slug,
                    &self.config.patch_ext,
                    content.as_deref(),
                )
                .map_err(bad)?;
                self.ensure(&self.config_maps, &map, true)
                    .await
                    .map_err(|e| failed("cannot write the patch ConfigMap", e))?;
                manifest::patch_hash(content.as_deref())
            }
            Patch::Unchanged => {
                let name = names::user_object(slug);
                let existing = self
                    .config_maps
                    .get_opt(&name)
                    .await
                    .map_err(|e| failed("cannot read the patch ConfigMap", e))?;
                let file = manifest::patch_file(&self.config.patch_ext);
                let content = existing
                    .as_ref()
                    .and_then(|m| m.data.as_ref())
                    .and_then(|d| d.get(&file))
                    .cloned();
                if existing.is_none() {
                    let map =
                        manifest::patch_config_map(k, user, slug, &self.config.patch_ext, None)
                            .map_err(bad)?;
                    self.ensure(&self.config_maps, &map, true)
                        .await
                        .map_err(|e| failed("cannot write the patch ConfigMap", e))?;
                }
                manifest::patch_hash(content.as_deref())
            }
        };
        if spec.role == Role::Watchdog {
            let handoff = spec.handoff.as_deref().unwrap_or("{}");
            let map = manifest::handoff_config_map(k, user, slug, handoff).map_err(bad)?;
            self.ensure(&self.config_maps, &map, true)
                .await
                .map_err(|e| failed("cannot write the handoff ConfigMap", e))?;
        }
        let service = manifest::service(k, user, slug).map_err(bad)?;
        self.ensure(&self.services, &service, false)
            .await
            .map_err(|e| failed("cannot write the user's Service", e))?;
        let policy = manifest::network_policy(k, user, slug).map_err(bad)?;
        self.ensure(&self.policies, &policy, true)
            .await
            .map_err(|e| failed("cannot write the user's NetworkPolicy", e))?;
        Ok(patch_hash)
    }

    /// Deletes pod `name` if it is still `uid`, with `grace` seconds.
    async fn delete_pod(&self, name: &str, uid: &str, grace: u32) -> Result<(), kube::Error> {
        let params = DeleteParams {
            grace_period_seconds: Some(grace),
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match self.pods.delete(name, &params).await {
            Ok(_) => Ok(()),
            Err(e) if matches!(code(&e), Some(404 | 409)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Ends the run `r` names, if the pod is still that run's: the same UID
    /// and no newer epoch. The check and the delete are one conditional
    /// write (on the resourceVersion read), so a pod another replica has
    /// just taken over is never deleted by the one that lost it.
    async fn end_run(&self, r: &RuntimeRef, grace: u32) -> Result<(), RuntimeError> {
        let (name, uid, epoch) =
            observe::parse_ref(r).ok_or_else(|| RuntimeError::Gone(r.clone()))?;
        for _ in 0..CONFLICT_RETRIES {
            let pod = self
                .pods
                .get_opt(name)
                .await
                .map_err(|e| failed("cannot read the pod", e))?;
            let Some(pod) = pod.filter(|p| p.metadata.uid.as_deref() == Some(uid)) else {
                return Err(RuntimeError::Gone(r.clone()));
            };
            let view = PodView::of(&pod);
            if view.epoch.is_some_and(|e| e > epoch) {
                return Err(RuntimeError::Gone(r.clone()));
            }
            let params = DeleteParams {
                grace_period_seconds: Some(grace),
                preconditions: Some(Preconditions {
                    uid: Some(uid.to_owned()),
                    resource_version: pod.resource_version(),
                }),
                ..DeleteParams::default()
            };
            match self.pods.delete(name, &params).await {
                Ok(_) => return Ok(()),
                Err(e) if code(&e) == Some(409) => continue,
                Err(e) if code(&e) == Some(404) => return Err(RuntimeError::Gone(r.clone())),
                Err(e) => return Err(failed("cannot delete the pod", e)),
            }
        }
        Err(RuntimeError::Failed(format!(
            "the pod of {r} kept changing while berth tried to delete it"
        )))
    }

    /// Takes over a live pod that is the one `pod` would create: raises its
    /// instance, epoch and node annotations (a conditional write).
    async fn take_over(
        &self,
        existing: &Pod,
        spec: &InstanceSpec,
        patch_hash: &str,
    ) -> Result<bool, RuntimeError> {
        let patch = json!({
            "metadata": {
                "resourceVersion": existing.resource_version(),
                "annotations": {
                    names::INSTANCE_ANNOTATION: spec.instance_id,
                    names::EPOCH_ANNOTATION: spec.epoch.to_string(),
                    names::NODE_ANNOTATION: self.config.node,
                    names::PATCH_ANNOTATION: patch_hash,
                },
            }
        });
        match self
            .pods
            .patch(
                &existing.name_any(),
                &PatchParams::default(),
                &KubePatch::Merge(&patch),
            )
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if matches!(code(&e), Some(409 | 404)) => Ok(false),
            Err(e) => Err(failed("cannot take the pod over", e)),
        }
    }

    /// Creates the pod, or settles an existing one of the same name: an
    /// ended one is collected, a deleting one awaited, a live one that is
    /// the same pod taken over in place, any other one replaced. The UID
    /// of the pod the run follows.
    async fn create_pod(
        &self,
        pod: &Pod,
        spec: &InstanceSpec,
        patch_hash: &str,
        deadline: tokio::time::Instant,
    ) -> Result<String, RuntimeError> {
        let name = pod.name_any();
        let template = pod.annotations().get(names::TEMPLATE_ANNOTATION).cloned();
        let grace = grace_seconds(self.config.stop_grace);
        loop {
            if tokio::time::Instant::now() >= deadline {
                return Err(RuntimeError::SpawnFailed(format!(
                    "the pod {name} could not be created: an earlier pod of that name did not go away"
                )));
            }
            match self.pods.create(&PostParams::default(), pod).await {
                Ok(created) => return Ok(created.metadata.uid.unwrap_or_default()),
                Err(e) if code(&e) == Some(409) => {}
                Err(e) => {
                    return Err(RuntimeError::SpawnFailed(format!(
                        "cannot create the pod {name}: {e}"
                    )));
                }
            }
            let existing = self
                .pods
                .get_opt(&name)
                .await
                .map_err(|e| failed("cannot read the existing pod", e))?;
            let Some(existing) = existing else { continue };
            let view = PodView::of(&existing);
            if view.deleting || view.ended() {
                if !view.deleting {
                    self.delete_pod(&name, &view.uid, grace)
                        .await
                        .map_err(|e| failed("cannot delete the ended pod", e))?;
                }
                if view.ended() || !view.scheduled {
                    self.keep_log(&name).await;
                    self.release_finalizer(&name, &view.uid)
                        .await
                        .map_err(|e| failed("cannot release the ended pod", e))?;
                }
                self.wait_gone(&name, &view.uid, deadline).await;
                continue;
            }
            if let Some(epoch) = view.epoch.filter(|e| *e > spec.epoch) {
                return Err(RuntimeError::Failed(format!(
                    "the pod {name} is managed under epoch {epoch}, newer than {}",
                    spec.epoch
                )));
            }
            let same_patch =
                matches!(spec.patch, Patch::Unchanged) || view.patch.as_deref() == Some(patch_hash);
            if view.template == template && same_patch {
                if self.take_over(&existing, spec, patch_hash).await? {
                    tracing::info!(pod = %name, uid = %view.uid, epoch = spec.epoch,
                        "took over the running pod in place");
                    // Until the watch shows it, this replica's own cache
                    // would not know the pod is its own.
                    let epoch = Some(spec.epoch);
                    self.wait_view(&name, deadline, |v| {
                        v.is_some_and(|v| v.uid == view.uid && v.epoch == epoch)
                    })
                    .await;
                    return Ok(view.uid);
                }
                continue;
            }
            tracing::info!(pod = %name, "replacing a pod made from another template or patch");
            self.delete_pod(&name, &view.uid, grace)
                .await
                .map_err(|e| failed("cannot delete the outdated pod", e))?;
            self.wait_gone(&name, &view.uid, deadline).await;
        }
    }

    /// Waits until the pod `uid` runs, or cannot.
    async fn wait_started(
        &self,
        name: &str,
        uid: &str,
        deadline: tokio::time::Instant,
    ) -> Result<(), RuntimeError> {
        let mut changes = self.changes.subscribe();
        let mut last: Option<PodView> = None;
        loop {
            if let Some(view) = self.cached_view(name).filter(|v| v.uid == uid) {
                match observe::start_outcome(&view) {
                    Some(StartOutcome::Runs) => return Ok(()),
                    Some(StartOutcome::Failed(message)) => {
                        self.abandon(name, uid).await;
                        return Err(RuntimeError::SpawnFailed(message));
                    }
                    None => last = Some(view),
                }
            }
            if !matches!(
                tokio::time::timeout_at(deadline, changes.changed()).await,
                Ok(Ok(()))
            ) {
                break;
            }
        }
        self.abandon(name, uid).await;
        let timeout = self.config.kubernetes.start_timeout_s;
        if let Some(why) = last.as_ref().and_then(|v| v.unschedulable.clone()) {
            return Err(RuntimeError::CapacityExhausted(format!(
                "the pod {name} could not be scheduled within {timeout}s: {why}"
            )));
        }
        let waiting = last
            .and_then(|v| v.main.waiting)
            .map(|(reason, message)| format!(": {reason} {message}"))
            .unwrap_or_default();
        Err(RuntimeError::SpawnFailed(format!(
            "the pod {name} did not start within {timeout}s{waiting}"
        )))
    }

    /// Ends a pod whose start failed; the collector releases it.
    async fn abandon(&self, name: &str, uid: &str) {
        if let Err(e) = self.delete_pod(name, uid, 1).await {
            tracing::warn!(pod = %name, error = %e, "could not delete a pod that failed to start");
        }
    }

    /// Follows the pod `name` (`uid`) as a run under `epoch`.
    fn follow(
        self: &Arc<Self>,
        name: &str,
        uid: &str,
        tracker: Tracker,
    ) -> mpsc::Receiver<RuntimeEvent> {
        let (events, receiver) = mpsc::channel(EVENT_BUFFER);
        let views = {
            let mut state = lock(&self.state);
            let mut view = state.pods.get(name).map(PodView::of).unwrap_or_default();
            if view.uid != uid {
                // Not in the cache (yet): its first view is on its way.
                view = PodView {
                    name: name.to_owned(),
                    uid: uid.to_owned(),
                    ..PodView::default()
                };
            }
            let (sender, views) = watch::channel(view);
            state.runs.insert(
                name.to_owned(),
                RunHandle {
                    uid: uid.to_owned(),
                    views: sender,
                },
            );
            views
        };
        let inner = self.clone();
        let (name, uid) = (name.to_owned(), uid.to_owned());
        self.tasks.spawn(async move {
            inner.run(&name, &uid, tracker, views, events).await;
            let mut state = lock(&inner.state);
            if state.runs.get(&name).is_some_and(|r| r.uid == uid) {
                state.runs.remove(&name);
            }
        });
        receiver
    }

    async fn run(
        self: &Arc<Self>,
        name: &str,
        uid: &str,
        mut tracker: Tracker,
        mut views: watch::Receiver<PodView>,
        events: mpsc::Sender<RuntimeEvent>,
    ) {
        let scan_cancel = self.cancel.child_token();
        let _stop_scan = scan_cancel.clone().drop_guard();
        let (tokens, mut found) = mpsc::channel::<String>(1);
        loop {
            let view = views.borrow_and_update().clone();
            for step in tracker.observe(&view) {
                match step {
                    Step::Emit(event) => {
                        if events.send(event).await.is_err() {
                            return;
                        }
                    }
                    Step::ScanLog => {
                        self.scan_for_token(name, tokens.clone(), scan_cancel.clone());
                    }
                    Step::Finish { exit, delete } => {
                        if delete {
                            let _ = self.delete_pod(name, uid, 1).await;
                        }
                        self.keep_log(name).await;
                        let _ = events.send(RuntimeEvent::Exited(exit)).await;
                        return;
                    }
                }
            }
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = events.closed() => return,
                changed = views.changed() => if changed.is_err() { return },
                Some(token) = found.recv() => {
                    let view = views.borrow().clone();
                    for step in tracker.token_found(token, &view) {
                        if let Step::Emit(event) = step
                            && events.send(event).await.is_err()
                        {
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Reads pod `name`'s log from its start until a line matches the
    /// token regex; sends the token.
    fn scan_for_token(
        self: &Arc<Self>,
        name: &str,
        found: mpsc::Sender<String>,
        cancel: CancellationToken,
    ) {
        let Readiness::TokenRegex(regex) = &self.config.readiness else {
            return;
        };
        let (regex, inner, name) = (regex.clone(), self.clone(), name.to_owned());
        self.tasks.spawn(async move {
            let params = LogParams {
                container: Some(MAIN_CONTAINER.into()),
                follow: true,
                ..LogParams::default()
            };
            // Until found or the run ends (which cancels this): a stream
            // that fails or is cut is read again from the start.
            let scan = async {
                loop {
                    let once = async {
                        let stream = inner.pods.log_stream(&name, &params).await?;
                        let mut lines = std::pin::pin!(stream.lines());
                        while let Some(line) = lines.try_next().await? {
                            if let Some(token) = token_of(&regex, &line) {
                                return Ok(Some(token));
                            }
                        }
                        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(None)
                    };
                    match once.await {
                        Ok(Some(token)) => {
                            let _ = found.send(token).await;
                            return;
                        }
                        Ok(None) => {}
                        Err(e) => {
                            tracing::debug!(pod = %name, error = %e, "reading the log for the launch token failed");
                        }
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            };
            tokio::select! {
                _ = cancel.cancelled() => {}
                () = scan => {}
            }
        });
    }

    /// The token in a whole log, for adoption.
    async fn token_in_log(&self, name: &str) -> Option<String> {
        let Readiness::TokenRegex(regex) = &self.config.readiness else {
            return None;
        };
        // The token is printed at start; a long log is not read whole.
        let params = LogParams {
            container: Some(MAIN_CONTAINER.into()),
            limit_bytes: Some(TOKEN_SCAN_BYTES),
            ..LogParams::default()
        };
        let text = self.pods.logs(name, &params).await.ok()?;
        text.lines().find_map(|line| token_of(regex, line))
    }

    fn endpoint(&self, slug: &str) -> Endpoint {
        self.resolver.endpoint(
            self.namespace(),
            &names::user_object(slug),
            self.config.kubernetes.port,
        )
    }

    /// Where the proxy reaches pod `uid` of user `slug`: the Service's DNS
    /// name, or (`endpoint = "endpoint_slice"`) the address and port the
    /// Service's EndpointSlice lists for that very pod, waited for until
    /// `deadline`.
    async fn endpoint_of(
        &self,
        slug: &str,
        uid: &str,
        deadline: tokio::time::Instant,
    ) -> Result<Endpoint, RuntimeError> {
        if self.config.kubernetes.endpoint == EndpointMode::ServiceDns {
            return Ok(self.endpoint(slug));
        }
        let service = names::user_object(slug);
        let params = ListParams::default().labels(&format!("{SLICE_SERVICE_LABEL}={service}"));
        loop {
            let last_error = match self.slices.list(&params).await {
                Ok(list) => match slice_endpoint(&list.items, uid) {
                    Some(endpoint) => return Ok(endpoint),
                    None => None,
                },
                Err(e) => Some(e),
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(match last_error {
                    Some(e) => failed("cannot list the Service's EndpointSlices", e),
                    None => RuntimeError::SpawnFailed(format!(
                        "no EndpointSlice of Service {service} lists pod {uid} with an address"
                    )),
                });
            }
            tokio::select! {
                () = tokio::time::sleep(SLICE_POLL) => {}
                () = self.cancel.cancelled() => {
                    return Err(RuntimeError::Failed("the runtime is shutting down".into()));
                }
            }
        }
    }
}

/// The address and `http` port that `slices` list for pod `uid`.
fn slice_endpoint(slices: &[EndpointSlice], uid: &str) -> Option<Endpoint> {
    slices.iter().find_map(|slice| {
        let port = slice
            .ports
            .as_ref()?
            .iter()
            .find(|p| p.name.as_deref() == Some("http"))?
            .port?;
        let address = slice
            .endpoints
            .iter()
            .find(|e| e.target_ref.as_ref().and_then(|r| r.uid.as_deref()) == Some(uid))?
            .addresses
            .first()?;
        Some(Endpoint {
            host: address.clone(),
            port: u16::try_from(port).ok()?,
            reach: berth_core::Reach::default(),
        })
    })
}

/// The launch token in `line`: the regex's first group, or the match.
fn token_of(regex: &regex::Regex, line: &str) -> Option<String> {
    let captures = regex.captures(line)?;
    captures
        .get(1)
        .or_else(|| captures.get(0))
        .map(|m| m.as_str().to_owned())
}

#[async_trait]
impl Runtime for K8sRuntime {
    fn name(&self) -> &'static str {
        "kubernetes"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            freeze: false,
            fence_deadline: false,
        }
    }

    async fn start(&self, spec: InstanceSpec) -> Result<Started, RuntimeError> {
        let inner = &self.inner;
        let deadline = tokio::time::Instant::now() + inner.config.kubernetes.start_timeout();
        if spec.role == Role::Watchdog && inner.config.watchdog_command.is_none() {
            return Err(RuntimeError::SpawnFailed(
                "no watchdog command is configured".into(),
            ));
        }
        inner.wait_synced(deadline).await?;
        let patch_hash = inner.ensure_objects(&spec).await?;
        let input = PodInput {
            user: &spec.user,
            slug: &spec.slug,
            role: spec.role,
            instance_id: &spec.instance_id,
            epoch: spec.epoch,
            folder: &spec.folder,
            node: &inner.config.node,
            patch_hash: &patch_hash,
            env: &spec.env,
        };
        let pod = manifest::pod(&inner.config, &input)
            .map_err(|e| RuntimeError::SpawnFailed(e.to_string()))?
            .ok_or_else(|| RuntimeError::SpawnFailed("no watchdog command is configured".into()))?;
        let name = pod.name_any();
        let uid = inner.create_pod(&pod, &spec, &patch_hash, deadline).await?;
        inner.wait_started(&name, &uid, deadline).await?;
        let endpoint = match spec.role {
            Role::Main => match inner.endpoint_of(spec.slug.as_str(), &uid, deadline).await {
                Ok(endpoint) => Some(endpoint),
                Err(e) => {
                    inner.abandon(&name, &uid).await;
                    return Err(e);
                }
            },
            Role::Watchdog => None,
        };
        let events = inner.follow(&name, &uid, inner.tracker(&uid, spec.epoch));
        Ok(Started {
            runtime_ref: observe::format_ref(&name, &uid, spec.epoch),
            pid: None,
            endpoint,
            events,
        })
    }

    async fn stop(&self, instance: &RuntimeRef, grace: Duration) -> Result<(), RuntimeError> {
        self.inner.end_run(instance, grace_seconds(grace)).await
    }

    async fn kill(&self, instance: &RuntimeRef) -> Result<(), RuntimeError> {
        self.inner.end_run(instance, 1).await
    }

    async fn release(&self, instance_id: &str) {
        // An ended pod of this instance that nobody deleted (a crash) goes
        // now; the collector keeps its log.
        let ended: Vec<PodView> = lock(&self.inner.state)
            .pods
            .values()
            .map(PodView::of)
            .filter(|v| {
                v.instance.as_deref() == Some(instance_id)
                    && v.node.as_deref() == Some(self.inner.config.node.as_str())
                    && v.ended()
                    && !v.deleting
            })
            .collect();
        for view in ended {
            if let Err(e) = self.inner.delete_pod(&view.name, &view.uid, 1).await {
                tracing::warn!(pod = %view.name, error = %e, "could not delete an ended pod");
            }
        }
    }

    async fn discover(&self) -> Result<Vec<Discovered>, RuntimeError> {
        let inner = &self.inner;
        let deadline = tokio::time::Instant::now() + inner.config.kubernetes.start_timeout();
        inner.wait_synced(deadline).await?;
        let views: Vec<PodView> = lock(&inner.state)
            .pods
            .values()
            .map(PodView::of)
            .filter(|v| v.node.as_deref() == Some(inner.config.node.as_str()))
            .collect();
        let mut found = Vec::with_capacity(views.len());
        for view in views {
            let role = view.role.as_deref().and_then(|r| r.parse::<Role>().ok());
            let user = view
                .user
                .as_deref()
                .and_then(|u| UserId::parse(u).ok())
                .filter(|_| role.is_some());
            let alive = view.alive() && !view.deleting;
            let token = if alive && view.ready {
                inner.token_in_log(&view.name).await
            } else {
                None
            };
            found.push(Discovered {
                user,
                slug: view.slug.clone().unwrap_or_default(),
                role: role.unwrap_or(Role::Main),
                instance_id: view.instance.clone().unwrap_or_default(),
                epoch: view.epoch.unwrap_or(0),
                runtime_ref: view.runtime_ref(),
                alive,
                frozen: false,
                ready: alive && view.ready && (!inner.needs_token() || token.is_some()),
                token,
                exit: view.exit(inner.memory_limit_mb()),
            });
        }
        Ok(found)
    }

    async fn adopt(&self, found: &Discovered) -> Result<Started, RuntimeError> {
        let inner = &self.inner;
        let r = &found.runtime_ref;
        let (name, uid, epoch) =
            observe::parse_ref(r).ok_or_else(|| RuntimeError::Gone(r.clone()))?;
        let view = inner
            .cached_view(name)
            .filter(|v| v.uid == uid)
            .ok_or_else(|| RuntimeError::Gone(r.clone()))?;
        let mut tracker = inner.tracker(uid, epoch);
        if found.ready {
            // Already reported ready to whoever discovered it.
            tracker.observe(&view);
            if let Some(token) = found.token.clone() {
                tracker.token_found(token, &view);
            }
        }
        let endpoint = match found.role {
            Role::Main => {
                let deadline =
                    tokio::time::Instant::now() + inner.config.kubernetes.start_timeout();
                Some(
                    inner
                        .endpoint_of(found.slug.as_str(), uid, deadline)
                        .await?,
                )
            }
            Role::Watchdog => None,
        };
        let events = inner.follow(name, uid, tracker);
        Ok(Started {
            runtime_ref: r.clone(),
            pid: None,
            endpoint,
            events,
        })
    }

    async fn remove(&self, found: &Discovered) -> Result<(), RuntimeError> {
        let inner = &self.inner;
        let r = &found.runtime_ref;
        let Some((name, uid, _)) = observe::parse_ref(r) else {
            return Err(RuntimeError::Gone(r.clone()));
        };
        inner
            .delete_pod(name, uid, 1)
            .await
            .map_err(|e| failed("cannot delete the pod", e))?;
        Ok(())
    }

    async fn logs(
        &self,
        slug: &Slug,
        role: Role,
        tail: usize,
    ) -> Result<Vec<String>, RuntimeError> {
        let inner = &self.inner;
        let name = names::pod(slug, role);
        let exists = inner.cached_view(&name).is_some_and(|v| v.main.started());
        if exists {
            let params = LogParams {
                container: Some(MAIN_CONTAINER.into()),
                tail_lines: Some(i64::try_from(tail).unwrap_or(i64::MAX)),
                ..LogParams::default()
            };
            if let Ok(text) = inner.pods.logs(&name, &params).await {
                return Ok(text.lines().map(str::to_owned).collect());
            }
        }
        let state = lock(&inner.state);
        let kept = state
            .kept_logs
            .get(&name)
            .map(Vec::as_slice)
            .unwrap_or_default();
        Ok(kept[kept.len().saturating_sub(tail)..].to_vec())
    }

    async fn follow_logs(
        &self,
        slug: &Slug,
        role: Role,
        tail: usize,
    ) -> Result<mpsc::Receiver<String>, RuntimeError> {
        let inner = self.inner.clone();
        let name = names::pod(slug, role);
        let (lines, receiver) = mpsc::channel(FOLLOW_BUFFER);
        let running = inner.cached_view(&name).is_some_and(|v| v.main.started());
        if !running {
            let kept: VecDeque<String> = self.logs(slug, role, tail).await?.into();
            inner.tasks.spawn(async move {
                for line in kept {
                    if lines.send(line).await.is_err() {
                        break;
                    }
                }
            });
            return Ok(receiver);
        }
        let params = LogParams {
            container: Some(MAIN_CONTAINER.into()),
            follow: true,
            tail_lines: Some(i64::try_from(tail).unwrap_or(i64::MAX)),
            ..LogParams::default()
        };
        let stream = inner
            .pods
            .log_stream(&name, &params)
            .await
            .map_err(|e| failed("cannot read the pod's log", e))?;
        let cancel = inner.cancel.clone();
        inner.tasks.spawn(async move {
            let mut stream = std::pin::pin!(stream.lines());
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = lines.closed() => return,
                    line = stream.next() => match line {
                        Some(Ok(line)) => {
                            if lines.send(line).await.is_err() {
                                return;
                            }
                        }
                        _ => return,
                    },
                }
            }
        });
        Ok(receiver)
    }

    async fn shutdown(&self) {
        self.inner.cancel.cancel();
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
    }
}

impl Drop for K8sRuntime {
    fn drop(&mut self) {
        self.inner.cancel.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grace_is_whole_seconds_and_never_a_force_delete() {
        assert_eq!(grace_seconds(Duration::ZERO), 1);
        assert_eq!(grace_seconds(Duration::from_millis(300)), 1);
        assert_eq!(grace_seconds(Duration::from_millis(1001)), 2);
        assert_eq!(grace_seconds(Duration::from_secs(20)), 20);
    }

    #[test]
    fn an_object_contains_berths_fields_whatever_the_server_added() {
        let have = json!({ "spec": { "clusterIP": "None", "clusterIPs": ["None"], "ports": [{ "port": 1, "protocol": "TCP" }] } });
        assert!(contains(
            &have,
            &json!({ "spec": { "clusterIP": "None", "ports": [{ "port": 1 }] } })
        ));
        assert!(!contains(
            &have,
            &json!({ "spec": { "ports": [{ "port": 2 }] } })
        ));
        assert!(!contains(&have, &json!({ "spec": { "ports": [] } })));
        assert!(!contains(
            &json!({ "data": {} }),
            &json!({ "data": { "a": "1" } })
        ));
    }

    #[test]
    fn the_token_is_the_first_group_or_the_match() {
        let with_group = regex::Regex::new(r"token=(\w+)").unwrap();
        assert_eq!(
            token_of(&with_group, "x token=abc y").as_deref(),
            Some("abc")
        );
        assert_eq!(token_of(&with_group, "nothing"), None);
        let plain = regex::Regex::new(r"ready").unwrap();
        assert_eq!(token_of(&plain, "is ready").as_deref(), Some("ready"));
    }

    #[test]
    fn a_slice_endpoint_is_the_pods_own_address_on_the_http_port() {
        let slice = |pod_uid: &str, address: &str, port_name: &str| -> EndpointSlice {
            serde_json::from_value(json!({
                "metadata": { "name": "s" },
                "addressType": "IPv4",
                "endpoints": [{
                    "addresses": [address],
                    "targetRef": { "kind": "Pod", "uid": pod_uid },
                }],
                "ports": [{ "name": "files", "port": 8081 }, { "name": port_name, "port": 8080 }],
            }))
            .unwrap()
        };
        let slices = [
            slice("old", "10.0.0.1", "http"),
            slice("new", "10.0.0.2", "http"),
        ];
        assert_eq!(
            slice_endpoint(&slices, "new"),
            Some(Endpoint {
                host: "10.0.0.2".into(),
                port: 8080,
                reach: berth_core::Reach::default(),
            })
        );
        assert_eq!(
            slice_endpoint(&slices, "other"),
            None,
            "another pod's address"
        );
        assert_eq!(
            slice_endpoint(&[slice("new", "10.0.0.2", "web")], "new"),
            None,
            "no http port"
        );
        let v6 = slice_endpoint(&[slice("new", "fd00::2", "http")], "new").unwrap();
        assert_eq!(v6.authority(), "[fd00::2]:8080");
    }
}
