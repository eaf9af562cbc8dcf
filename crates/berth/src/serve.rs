//! `berth serve`: the API, the supervisor and the proxy in one process.
//!
//! Start-up order matters: the data dir and admin token first (a newcomer's
//! first question is "what is my token?"), then the store (migrated), then
//! — in a cluster — the refusal of a node id that is already live, then the
//! listener is bound (so the default advertised URL is the real address),
//! then the runtime the config chooses and the controller over it (which
//! plans the adoption of the instances a previous berth left running, and
//! adopts them while berth serves), one heartbeat, and only then does the
//! listener serve, so no request sees a half-built node. The public
//! listener serves both:
//! `berth_proxy`'s server sends user routes (`/u/<user>/…`,
//! `<slug>.<base_domain>`) to the proxy and everything else to the API
//! router. In a cluster a second listener (`[cluster] internal_listen`,
//! advertised with the heartbeat) serves the node-to-node API and nothing
//! else; the public one answers 404 there. On SIGINT/SIGTERM berth stops
//! listening, drains, stops the cluster tasks, tears the controller down
//! and marks the node `down`; instances keep running for the next start
//! to adopt.

mod admin;
mod api;
mod auth;
mod cluster;
mod data_lock;
mod failover;
pub(crate) mod heap;
mod home;
pub(crate) mod login;
mod metrics;
mod ops;
mod peer;
mod uid_ranges;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use async_trait::async_trait;
use berth_controller::Controller;
use berth_core::egress::{EgressBook, EgressPolicy};
use berth_core::runtime::Runtime;
use berth_core::{Spawner, UidRange};
use berth_local::{Accounts, Isolation, LocalRuntime};
use berth_proxy::peer_auth::{ClusterKey, PeerAuth};
use berth_store::{NodeClaim, NodeStatus, NodeStore, Store, UserStore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;

pub use auth::admin_token_path;

/// Runs a node until it is told to stop.
pub async fn run(config: Config) -> anyhow::Result<()> {
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("cannot create data dir {}", config.data_dir.display()))?;
    // Held until this process ends: no other live process uses this data
    // dir, and in a cluster it proves that whoever last claimed this node
    // id from here is dead.
    let data_lock = data_lock::DataDirLock::acquire(&config.data_dir)?;
    let _uid_range = register_uid_range(&config)?;
    let admin_token =
        auth::load_or_create_admin_token(config.admin_token.as_deref(), &config.data_dir)?;

    let store_url = config.store_url();
    let store = berth_store::open(&store_url).await.with_context(|| {
        format!(
            "cannot open the store {}",
            berth_store::redact_url(&store_url)
        )
    })?;

    let node_id = config.node_id()?;
    let lease_config = config.lease_config()?;
    if config.is_postgres() {
        claim_node_id(
            store.as_ref(),
            &node_id,
            data_lock.identity(),
            lease_config.ttl(),
        )
        .await?;
    }

    // Bound before the controller starts: the heartbeat advertises the real
    // address (port 0 included) unless `advertise_url` says otherwise.
    let listener = tokio::net::TcpListener::bind(&config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let addr = listener.local_addr()?;
    let metrics_listener = match &config.metrics.listen {
        Some(listen) => {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("cannot listen on {listen} ([metrics] listen)"))?;
            tracing::info!(addr = %listener.local_addr()?, "serving /metrics without authentication");
            Some(listener)
        }
        None => None,
    };
    let public_url = config
        .advertise_url
        .clone()
        .unwrap_or_else(|| format!("http://{addr}"));
    // Cluster mode only: a single node takes no node-to-node calls.
    let internal_listener = if config.is_postgres() {
        let listen = config.internal_listen_addr()?;
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("cannot listen on {listen} ([cluster] internal_listen)"))?;
        if let Some(warning) = config.internal_listener_warning() {
            tracing::warn!("{warning}");
        }
        Some(listener)
    } else {
        None
    };
    let internal_url = match &internal_listener {
        Some(listener) => Some(
            config
                .cluster
                .internal_advertise_url
                .clone()
                .unwrap_or(format!("http://{}", listener.local_addr()?)),
        ),
        None => None,
    };

    // Read once, for the guard and the egress proxy: a name server added
    // later is reached after a restart.
    let resolv_conf = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    let name_servers = berth_core::egress::name_servers(&resolv_conf);
    let egress_metrics = berth_egress::EgressMetrics::default();
    let egress_proxy = egress_proxy(&config, egress_metrics.clone(), &name_servers).await?;
    let egress_port = egress_proxy
        .as_ref()
        .and_then(berth_egress::EgressProxy::port);
    // Instances may hold only so many connections to these at once.
    let mut listening = vec![addr.port()];
    for listener in metrics_listener.iter().chain(internal_listener.iter()) {
        listening.push(listener.local_addr()?.port());
    }
    listening.extend(egress_port);
    let egress = RuntimeEgress {
        proxy_port: egress_port,
        name_servers,
    };
    let (runtime, egress_book) =
        runtime(&config, &node_id, store.clone(), listening, egress).await?;
    let mut controller_config = config.controller_config(&node_id)?;
    controller_config.advertise_url.clone_from(&public_url);
    controller_config.internal_url = internal_url.clone().unwrap_or_default();
    let ready_timeout = controller_config.ready_timeout;
    let lease_ttl = controller_config.lease.ttl();
    let renew_every = controller_config.lease.renew();
    let spawner = Controller::start(runtime, store.clone(), controller_config)
        .await
        .context("cannot start the controller")?;
    // Registered (with capacity and URL) before serving: placement on other
    // nodes may choose this one as soon as it answers.
    spawner
        .heartbeat()
        .await
        .context("cannot register this node (heartbeat)")?;

    let cluster_metrics = cluster::ClusterMetrics::default();
    let proxy_metrics = berth_proxy::ProxyMetrics::default();
    let metrics = Arc::new(metrics::Metrics::new(|registry| {
        spawner.register_metrics(registry);
        cluster_metrics.register(registry);
        proxy_metrics.register(registry);
        egress_metrics.register(registry);
    }));

    // Cluster mode: routing across nodes, node-to-node calls, failover.
    let tasks = TaskTracker::new();
    let cancel = CancellationToken::new();
    let spawner_dyn = spawner.clone() as Arc<dyn Spawner>;
    if let (Some(egress_proxy), Some(book)) = (egress_proxy, egress_book) {
        tasks.spawn(egress_proxy.serve(book, cancel.child_token()));
    }
    if let Some((pod_proxy, key)) = pod_egress_proxy(&config, egress_metrics.clone()).await? {
        let policies = Arc::new(StorePolicies {
            store: store.clone(),
            node: config.isolation.egress_policy(),
        });
        tasks.spawn(pod_proxy.serve(key, policies, cancel.child_token()));
    }
    {
        let (controller, cancel) = (spawner.clone(), cancel.clone());
        tasks.spawn(async move {
            heap::give_back_freed_while_serving(controller.adopted(), cancel).await;
        });
    }
    let (cluster, peer_auth) = if config.is_postgres() {
        let key = ClusterKey::new(config.cluster_secret.as_deref().unwrap_or_default());
        // One nonce cache for both kinds of signed request this node takes.
        let peer_auth = Arc::new(PeerAuth::new(key.clone(), node_id.clone()));
        let peers = peer::PeerClient::new(key)
            .context("cannot build the HTTP client for node-to-node calls")?;
        let cluster = Arc::new(cluster::Cluster::new(
            store.clone(),
            node_id.clone(),
            lease_ttl,
            peers,
            cluster_metrics,
        ));
        let failover = Arc::new(failover::Failover::new(
            store.clone(),
            spawner_dyn.clone(),
            cluster.clone(),
            lease_config.takeover(),
        ));
        tasks.spawn(failover.run(renew_every, cancel.child_token()));
        (Some(cluster), Some(peer_auth))
    } else {
        (None, None)
    };
    // The use cases, for the API, the proxy and other nodes alike.
    let ops = Arc::new(ops::Ops::new(
        spawner_dyn.clone(),
        store.clone(),
        cluster.clone(),
        node_id.clone(),
        ops::Budgets {
            ready_timeout,
            stop_grace: Duration::from_secs(config.instance.stop_grace_s),
            hook_grace: Duration::from_secs(config.instance.hook_grace_s),
        },
        match config.readiness()? {
            berth_core::Readiness::TokenRegex(pattern) => Some(pattern),
            _ => None,
        },
        guarded_egress(&config)?,
    ));

    let path_routing = config.path_routing();
    let authenticator = auth::Authenticator::new(
        &admin_token,
        store.clone(),
        auth::AuthSettings {
            user_token_ttl: Duration::from_secs(config.auth.user_token_ttl_s),
            max_tokens_per_user: config.auth.max_tokens_per_user,
            token_cache: Duration::from_secs(config.auth.token_cache_s),
            session_ttl: Duration::from_secs(config.auth.session_ttl_s),
            users_may_patch: config.auth.users_may_patch,
            // A session cookie is only as safe as the API's origin is the
            // admin page's alone.
            sessions: !path_routing,
        },
    );
    if path_routing {
        tracing::warn!(
            "path routing is on: every user's app is served under /u/<user>/ on the same origin as \
             the API, so one user's app can act in another user's browser session. This suits \
             only users who trust each other, or development; set [proxy] base_domain to give each \
             app its own origin"
        );
    }
    let proxy_cluster = match (&cluster, &peer_auth) {
        (Some(_), Some(auth)) => Some(berth_proxy::ProxyCluster {
            hook: ops.clone() as Arc<dyn berth_proxy::ClusterHook>,
            auth: auth.clone(),
        }),
        _ => None,
    };
    let login = config
        .auth
        .oidc
        .as_ref()
        .map(|o| login::settings(o, &public_url).and_then(login::Oidc::new))
        .transpose()?
        .map(Arc::new);
    let proxy = berth_proxy::Proxy::start_clustered(
        proxy_config(&config, ready_timeout, proxy_metrics)?,
        spawner_dyn,
        authenticator.shared(),
        proxy_cluster,
    );
    let state = Arc::new(api::ApiState {
        ops,
        store: store.clone(),
        auth: authenticator,
        metrics,
        public_url: public_url.clone(),
        node_id: node_id.clone(),
        lease_ttl,
        cluster,
        peer_auth,
        node_control: spawner.clone() as Arc<dyn cluster::NodeControl>,
        base_domain: Some(config.proxy.base_domain.clone()).filter(|d| !d.is_empty()),
        path_routing,
        event_streams: api::events::EventStreams::default(),
        scrapers: api::scrape::Scrapers::new(config.metrics.token.as_deref())?,
        streams: proxy.streams().clone(),
        login,
    });
    if let Some(listener) = metrics_listener {
        tasks.spawn(api::scrape::serve_unauthenticated(
            listener,
            state.metrics.clone(),
            cancel.child_token(),
        ));
    }
    let app = api::router(state.clone());
    let internal_app = api::internal_router(state);

    if let Some(internal_url) = &internal_url {
        tracing::info!(%internal_url, "serving node-to-node calls");
        // Before the line below, which scripts (and tests) wait for.
        println!("berth: node-to-node calls on {internal_url}");
    }
    tracing::info!(%addr, node = %node_id, data_dir = %config.data_dir.display(), "berth listening");
    // One plain line on stdout for people and scripts (e.g. with port 0).
    println!("berth: listening on {public_url}");

    let p = &config.proxy;
    let server = berth_proxy::ServerConfig {
        header_read_timeout: Duration::from_millis(p.header_timeout_ms.max(1)),
        max_header_bytes: p.max_header_bytes,
        shutdown_grace: SHUTDOWN_GRACE,
        max_connections: p.max_connections,
        max_connections_per_ip: p.max_connections_per_ip,
        body_pace: config.body_pace(),
    };
    // Both listeners stop together: on a signal, or when either fails.
    let stop = CancellationToken::new();
    let until_stopped = |stop: CancellationToken| async move {
        tokio::select! {
            () = shutdown_signal() => {}
            () = stop.cancelled() => {}
        }
        stop.cancel();
    };
    let public = async {
        let served = berth_proxy::serve(
            listener,
            server.clone(),
            proxy.clone(),
            app,
            until_stopped(stop.clone()),
        )
        .await;
        stop.cancel();
        served.context("the HTTP server failed")
    };
    let internal = async {
        let Some(listener) = internal_listener else {
            return Ok(());
        };
        let served = berth_proxy::server::serve_plain(
            listener,
            server.clone(),
            internal_app,
            until_stopped(stop.clone()),
        )
        .await;
        stop.cancel();
        served.context("the node-to-node listener failed")
    };
    let (public, internal) = tokio::join!(public, internal);
    public?;
    internal?;
    tracing::info!("shutting down; instances keep running");
    cancel.cancel();
    tasks.close();
    tasks.wait().await;
    proxy.shutdown().await;
    spawner.teardown().await;
    // A node that says `down` may be started again at once under the same
    // id (see `NodeStore::claim_node`), and gets no new instances meanwhile.
    spawner.set_node_status(NodeStatus::Down);
    if let Err(e) = spawner.heartbeat().await {
        tracing::warn!(error = %e, "could not mark this node down");
    }
    Ok(())
}

/// The runtime this node runs programs with: the one place the config
/// chooses it. A `[kubernetes]` table selects the Kubernetes runtime (a
/// pod per user); otherwise programs run on this host under shims, and
/// where berth guards their egress, the book of each account's policy
/// comes with it, for the egress proxy.
#[cfg_attr(
    not(feature = "kubernetes"),
    allow(unused_variables, reason = "only a pod is named after its node")
)]
async fn runtime(
    config: &Config,
    node_id: &str,
    store: Arc<dyn Store>,
    listening: Vec<u16>,
    egress: RuntimeEgress,
) -> anyhow::Result<(Arc<dyn Runtime>, Option<Arc<EgressBook>>)> {
    #[cfg(feature = "kubernetes")]
    if let Some(k8s) = config.k8s_runtime_config(node_id)? {
        let client = berth_k8s::connect(&k8s.kubernetes)
            .await
            .context("cannot connect to Kubernetes ([kubernetes])")?;
        tracing::info!(
            namespace = %k8s.kubernetes.namespace,
            image = %k8s.kubernetes.image,
            endpoint = ?k8s.kubernetes.endpoint,
            "instances run as Kubernetes pods"
        );
        let runtime = berth_k8s::K8sRuntime::new(client, k8s)
            .context("cannot start the Kubernetes runtime")?;
        return Ok((runtime, None));
    }
    let shim_command = vec![
        std::env::current_exe()
            .context("cannot locate the berth executable to run shims")?
            .to_string_lossy()
            .into_owned(),
        "shim".to_owned(),
    ];
    let mut local = config.runtime_config(shim_command)?;
    local.listeners.ports = listening;
    local.egress_proxy = egress.proxy_port;
    local.name_servers = egress.name_servers;
    if local.isolation == Isolation::None {
        tracing::warn!(
            as_root = nix::unistd::geteuid().is_root(),
            "isolation mode \"none\": instances run as berth's own user and are NOT isolated \
             from berth or from each other (a program can read berth's files and signal its \
             processes); use mode \"user\" or \"sandbox\" for users who do not trust each other"
        );
    } else {
        tracing::info!(mode = %local.isolation, uids = ?local.uids, "instance isolation");
    }
    let accounts = Arc::new(StoreAccounts(store)) as Arc<dyn Accounts>;
    let local = LocalRuntime::new(local, Some(accounts))
        .await
        .context("cannot start the local runtime")?;
    // Others' leftovers cost every packet of the host; failing to remove
    // them costs this berth nothing.
    if let Err(e) = local.sweep_leftovers(&data_lock::in_use).await {
        tracing::warn!(error = %e, "cannot remove the leftovers of gone berths");
    }
    let book = local.egress_book();
    Ok((local, book))
}

/// What the local runtime's egress guard takes from the binary: where the
/// egress proxy listens, and the host's name servers.
struct RuntimeEgress {
    proxy_port: Option<u16>,
    name_servers: Vec<std::net::IpAddr>,
}

/// This node's egress policy, where berth guards its instances' egress:
/// pods by their NetworkPolicy, and on this host at a level with
/// accounts.
fn guarded_egress(config: &Config) -> anyhow::Result<Option<berth_core::egress::EgressPolicy>> {
    let level = config.isolation_level(nix::unistd::geteuid().is_root())?;
    Ok((config.kubernetes.is_some() || level != Isolation::None)
        .then(|| config.isolation.egress_policy()))
}

/// The egress proxy, bound on loopback, wherever berth guards its
/// instances' egress: the guard sends there the connections to the ports
/// of the domain names a policy allows, the node's or a user's own, which
/// an operator may set at any time.
async fn egress_proxy(
    config: &Config,
    metrics: berth_egress::EgressMetrics,
    name_servers: &[std::net::IpAddr],
) -> anyhow::Result<Option<berth_egress::EgressProxy>> {
    let on_this_host = config.kubernetes.is_none() && guarded_egress(config)?.is_some();
    if !on_this_host || !nix::unistd::geteuid().is_root() {
        return Ok(None);
    }
    let loopback = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, 0));
    let proxy = berth_egress::EgressProxy::bind(loopback, metrics, name_servers).await?;
    tracing::info!(port = ?proxy.port(), "egress proxy: instances reach allowed domains through it");
    Ok(Some(proxy))
}

/// The egress proxy for pods, where `[kubernetes.network] egress_proxy`
/// names it: bound on its port on every address (pods reach it through
/// a Service), with the key of the pods' credentials.
#[cfg(feature = "kubernetes")]
async fn pod_egress_proxy(
    config: &Config,
    metrics: berth_egress::EgressMetrics,
) -> anyhow::Result<Option<(berth_egress::PodProxy, berth_core::egress::ProxyKey)>> {
    let Some(k8s) = &config.kubernetes else {
        return Ok(None);
    };
    let (Some((_, port)), Some(secret)) = (k8s.network.egress_proxy(), &config.cluster_secret)
    else {
        // Validation refuses a proxy without the secret.
        return Ok(None);
    };
    let any = std::net::SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, port));
    let proxy = berth_egress::PodProxy::bind(any, metrics).await?;
    tracing::info!(%any, "egress proxy for pods: confined pods reach allowed domains through it");
    Ok(Some((
        proxy,
        berth_core::egress::ProxyKey::new(secret.as_bytes()),
    )))
}

#[cfg(not(feature = "kubernetes"))]
async fn pod_egress_proxy(
    _config: &Config,
    _metrics: berth_egress::EgressMetrics,
) -> anyhow::Result<Option<(berth_egress::PodProxy, berth_core::egress::ProxyKey)>> {
    Ok(None)
}

/// Users' egress policies as the store holds them, for the egress proxy
/// for pods: their own, else the node's.
struct StorePolicies {
    store: Arc<dyn Store>,
    node: EgressPolicy,
}

#[async_trait]
impl berth_egress::Policies for StorePolicies {
    async fn policy(&self, user: &berth_core::UserId) -> Result<EgressPolicy, String> {
        let own = self
            .store
            .user_egress(user)
            .await
            .map_err(|e| e.to_string())?;
        Ok(own.unwrap_or_else(|| self.node.clone()))
    }
}

/// Records this berth's instance uid range host-wide, or refuses to start
/// when a live berth on another store holds an overlapping one. Only
/// levels that run programs under accounts take a range.
fn register_uid_range(config: &Config) -> anyhow::Result<Option<uid_ranges::Registration>> {
    let root = nix::unistd::geteuid().is_root();
    let level = config.isolation_level(root)?;
    // Without root no level with accounts starts (the runtime says so).
    if !root || config.kubernetes.is_some() || level == Isolation::None {
        return Ok(None);
    }
    let data_dir = std::fs::canonicalize(&config.data_dir)
        .with_context(|| format!("cannot resolve data dir {}", config.data_dir.display()))?;
    let registration = uid_ranges::register(
        std::path::Path::new(uid_ranges::RECORD_DIR),
        &data_dir,
        config.isolation.uids(),
        &uid_ranges::store_identity(&config.store_url(), config.cluster_secret.as_deref()),
    )?;
    Ok(Some(registration))
}

/// Users' accounts (their host uids) as the store allocates them: once per
/// user, the same on every node.
struct StoreAccounts(Arc<dyn UserStore>);

#[async_trait]
impl Accounts for StoreAccounts {
    async fn all(&self) -> Result<Vec<(String, u32)>, String> {
        self.0.list_accounts().await.map_err(|e| e.to_string())
    }

    async fn uid(&self, slug: &str, range: UidRange) -> Result<u32, String> {
        self.0
            .account_uid(slug, range)
            .await
            .map_err(|e| e.to_string())
    }

    async fn all_egress(&self) -> Result<Vec<(u32, String, EgressPolicy)>, String> {
        self.0.account_egress().await.map_err(|e| e.to_string())
    }
}

/// Claims `node_id` for this process, or refuses to start a second live
/// node under it: both would renew, and fence, the same leases. The store
/// grants the claim when the id's row is `down`, has not heartbeaten
/// within one lease TTL (by the store's clock), or was last claimed from
/// this very data dir, whose lock this process holds: then the process
/// that claimed it before is dead, and a node restarted after a crash
/// starts at once and adopts its instances.
async fn claim_node_id(
    store: &dyn NodeStore,
    node_id: &str,
    data_dir_id: &str,
    ttl: Duration,
) -> anyhow::Result<()> {
    let claim = store
        .claim_node(node_id, data_dir_id, ttl)
        .await
        .context("cannot claim this node's id in the nodes table")?;
    let live = match claim {
        NodeClaim::Claimed => return Ok(()),
        NodeClaim::Live(live) => live,
    };
    let now = store.now().await.context("cannot read the store's clock")?;
    anyhow::bail!(
        "node id {node_id:?} is already in use by a live node from another data dir or host: its \
         last heartbeat was {:.1} s ago (advertised at {}); stop that node, wait {:.1} s for its \
         heartbeat to expire, or start this one with another node_id",
        now.saturating_sub(live.heartbeat).max(0) as f64 / 1000.0,
        live.advertise_url,
        ttl.as_secs_f64()
    );
}

/// How long in-flight requests may finish after SIGTERM. Long streams
/// (progress, SSE, downloads) are cut after it.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

fn proxy_config(
    config: &Config,
    ready_timeout: Duration,
    metrics: berth_proxy::ProxyMetrics,
) -> anyhow::Result<berth_proxy::ProxyConfig> {
    let p = &config.proxy;
    Ok(berth_proxy::ProxyConfig {
        base_domain: Some(p.base_domain.clone()).filter(|d| !d.is_empty()),
        path_routing: config.path_routing(),
        strip_prefix: p.strip_prefix,
        auth_mode: p.auth.parse().map_err(anyhow::Error::msg)?,
        trusted_proxies: berth_proxy::auth::TrustedProxies::parse(&p.trusted_proxies)?,
        header_secret: p
            .header_secret
            .as_deref()
            .map(berth_proxy::auth::SharedSecret::new)
            .transpose()
            .context("proxy.header_secret")?,
        ready_timeout,
        forward: berth_proxy::forward::ForwardConfig {
            max_upgrades: p.max_upgrades,
            max_upgrades_per_user: p.max_upgrades_per_user,
            body_pace: config.body_pace(),
            server_traffic_is_activity: config.reap.server_traffic_is_activity,
            credential: config
                .instance
                .credential_header
                .as_deref()
                .map(berth_proxy::credential::CredentialHeader::parse)
                .transpose()
                .context("instance.credential_header")?,
            ..Default::default()
        },
        allow_cross_origin_requests: config.instance.allow_cross_origin_requests,
        metrics,
        sign_in: config.auth.oidc.is_some(),
    })
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("cannot watch SIGTERM: {e}");
            std::future::pending::<()>().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
