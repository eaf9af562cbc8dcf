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
//!
//! One file per job: `cache` (the watch and the waits on its cache),
//! `follow` (a followed run), `pods` (creating, taking over, epoch-fenced
//! deletes), `objects` (the user's other objects), `collect` (the
//! finalizer's collector), `logs` (kept tails, the launch token) and
//! `endpoints` (where the proxy reaches a run). This file holds the types
//! they share, [`connect`], and the [`Runtime`] impl that puts them
//! together.

mod cache;
mod collect;
mod endpoints;
mod follow;
mod hooks;
mod logs;
mod objects;
mod pods;
mod shim;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use berth_core::egress::EgressPolicy;
use berth_core::runtime::{
    Capabilities, Discovered, HookAction, HookCall, HookOutcome, InstanceSpec, Runtime,
    RuntimeError, RuntimeRef, Started,
};
use berth_core::{Endpoint, Epoch, Role, Slug, UserId};
use futures_util::StreamExt;
use futures_util::io::AsyncBufReadExt;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Client;
use kube::api::{Api, LogParams};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::K8sRuntimeConfig;
use crate::manifest::{self, MAIN_CONTAINER, PodInput, ShimInput};
use crate::names;
use crate::observe::{self, PodView, Tracker};
use berth_core::Readiness;
use berth_core::shim_wire::ShimCommand;

/// How many times a conflicting write is read and tried again.
const CONFLICT_RETRIES: usize = 8;
/// Lines buffered for one `follow_logs` reader.
const FOLLOW_BUFFER: usize = 256;

/// Where the proxy reaches a user's Service.
pub trait EndpointResolver: Send + Sync + 'static {
    /// Where to connect to `service` in `namespace`, whose port is `port`.
    fn endpoint(&self, namespace: &str, service: &str, port: u16) -> Endpoint;
}

/// The Service's cluster DNS name: `<service>.<namespace>.svc.<domain>`.
#[derive(Debug, Clone)]
pub struct ServiceDns {
    /// The cluster's DNS domain (`cluster.local` unless configured).
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
    secrets: Api<Secret>,
    slices: Api<EndpointSlice>,
    /// The id of the next hook asked of a pod's shim.
    next_hook: std::sync::atomic::AtomicU64,
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
    /// The link to the pod's shim, when berth's shim is its entrypoint.
    shim: Option<shim::ShimLink>,
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

/// kube's client for `[kubernetes]`: from `kubeconfig` (and `context`)
/// when set, else as kube infers it (`KUBECONFIG`, `~/.kube/config`, or
/// the service account of the pod berth runs in).
pub async fn connect(config: &crate::config::KubernetesConfig) -> Result<Client, RuntimeError> {
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
    /// `command` to the shim of `instance`'s pod; without the shim, the
    /// runtime cannot do `what`.
    async fn to_shim(
        &self,
        instance: &RuntimeRef,
        command: ShimCommand,
        what: &'static str,
    ) -> Result<(), RuntimeError> {
        if self.inner.config.kubernetes.shim.is_none() {
            return Err(self.unsupported(what));
        }
        self.inner.shim_command(instance, command).await
    }

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
            secrets: Api::namespaced(client.clone(), &ns),
            slices: Api::namespaced(client, &ns),
            next_hook: std::sync::atomic::AtomicU64::new(1),
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

    fn needs_ready_line(&self) -> bool {
        matches!(self.config.program.readiness, Readiness::TokenRegex(_))
    }

    fn memory_limit_mb(&self) -> Option<u64> {
        self.config.kubernetes.memory_limit_mb()
    }

    fn tracker(&self, uid: &str, epoch: Epoch) -> Tracker {
        Tracker::new(uid, epoch, self.needs_ready_line(), self.memory_limit_mb())
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }
}

#[async_trait]
impl Runtime for K8sRuntime {
    fn name(&self) -> &'static str {
        "kubernetes"
    }

    fn capabilities(&self) -> Capabilities {
        let shim = self.inner.config.kubernetes.shim.is_some();
        Capabilities {
            freeze: shim,
            fence_deadline: shim,
            exec: shim,
            egress: true,
            egress_names: self.inner.config.egress_proxy_key.is_some(),
        }
    }

    async fn set_egress(
        &self,
        user: &UserId,
        slug: &Slug,
        policy: Option<&EgressPolicy>,
    ) -> Result<(), RuntimeError> {
        self.inner.ensure_policy(user, slug, policy).await
    }

    async fn start(&self, spec: InstanceSpec) -> Result<Started, RuntimeError> {
        let inner = &self.inner;
        let deadline = tokio::time::Instant::now() + inner.config.kubernetes.start_timeout();
        if spec.role == Role::Watchdog && inner.config.program.watchdog_command.is_none() {
            return Err(RuntimeError::SpawnFailed(
                "no watchdog command is configured".into(),
            ));
        }
        inner.wait_synced(deadline).await?;
        let patch_hash = inner.ensure_objects(&spec).await?;
        let policy = spec.egress.as_ref().unwrap_or(&inner.config.egress);
        let mut env = spec.env.clone();
        env.extend(manifest::egress_proxy_env(
            &inner.config,
            &spec.user,
            policy,
        ));
        let name = names::pod(&spec.slug, spec.role);
        let shim_nonce = inner.shim_nonce(&spec, &name).await?;
        let fence_ms = spec
            .fence
            .map(|fence| u64::try_from(fence.as_millis()).unwrap_or(u64::MAX));
        let input = PodInput {
            user: &spec.user,
            slug: &spec.slug,
            role: spec.role,
            instance_id: &spec.instance_id,
            epoch: spec.epoch,
            folder: &spec.folder,
            node: &inner.config.node,
            patch_hash: &patch_hash,
            has_patch: patch_hash != manifest::patch_hash(None),
            env: &env,
            shim: shim_nonce
                .as_deref()
                .map(|nonce| ShimInput { nonce, fence_ms }),
        };
        let pod = manifest::pod(&inner.config, &input)
            .map_err(|e| RuntimeError::SpawnFailed(e.to_string()))?
            .ok_or_else(|| RuntimeError::SpawnFailed("no watchdog command is configured".into()))?;
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
        let events = inner.follow(&name, &uid, inner.tracker(&uid, spec.epoch), spec.role);
        if let Err(e) = inner.await_shim(&name, &uid, deadline).await {
            inner.abandon(&name, &uid).await;
            return Err(e);
        }
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

    async fn run_hook(
        &self,
        instance: &RuntimeRef,
        hook: &HookCall,
    ) -> Result<HookOutcome, RuntimeError> {
        match &hook.action {
            HookAction::Post(path) => self.inner.post_hook(instance, path, hook.grace).await,
            HookAction::Command(_) if self.inner.config.kubernetes.shim.is_none() => {
                Err(self.unsupported("run a command inside a pod without [kubernetes.shim]"))
            }
            HookAction::Command(argv) => {
                self.inner
                    .shim_hook(instance, hook.name, argv.clone(), hook.grace)
                    .await
            }
        }
    }

    async fn freeze(&self, instance: &RuntimeRef) -> Result<(), RuntimeError> {
        self.to_shim(
            instance,
            ShimCommand::Freeze,
            "freeze a pod without [kubernetes.shim]",
        )
        .await
    }

    async fn thaw(&self, instance: &RuntimeRef) -> Result<(), RuntimeError> {
        self.to_shim(
            instance,
            ShimCommand::Thaw,
            "thaw a pod without [kubernetes.shim]",
        )
        .await
    }

    async fn extend_fence(
        &self,
        instance: &RuntimeRef,
        left: Duration,
    ) -> Result<(), RuntimeError> {
        let ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
        let command = ShimCommand::Extend { ms };
        self.to_shim(
            instance,
            command,
            "keep a pod's fence deadline without [kubernetes.shim]",
        )
        .await
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
            let ready_line = if alive && view.ready {
                inner.ready_line_in_log(&view.name).await
            } else {
                None
            };
            let frozen = alive && inner.shim_says_frozen(&view).await == Some(true);
            found.push(Discovered {
                user,
                slug: view.slug.clone().unwrap_or_default(),
                role: role.unwrap_or(Role::Main),
                instance_id: view.instance.clone().unwrap_or_default(),
                epoch: view.epoch.unwrap_or(0),
                runtime_ref: view.runtime_ref(),
                alive,
                frozen,
                ready: alive && view.ready && (!inner.needs_ready_line() || ready_line.is_some()),
                token: ready_line.flatten(),
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
            tracker.ready_line_found(found.token.clone(), &view);
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
        let events = inner.follow(name, uid, tracker, found.role);
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
}
