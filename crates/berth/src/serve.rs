//! `berth serve`: the API, the supervisor and the proxy in one process.
//!
//! Start-up order matters: the data dir and admin token first (a newcomer's
//! first question is "what is my token?"), then the store (migrated), then
//! — in a cluster — the refusal of a node id that is already live, then the
//! listener is bound (so the default advertised URL is the real address),
//! then the spawner (which re-attaches to instances a previous berth left
//! running), one heartbeat, and only then does the listener serve, so no
//! request sees a half-built node. One listener serves both:
//! `berth_proxy`'s server sends user routes (`/u/<user>/…`,
//! `<slug>.<base_domain>`) to the proxy and everything else to the API
//! router. On SIGINT/SIGTERM berth stops listening, drains, stops the
//! cluster tasks, tears the spawner down and marks the node `down`;
//! instances keep running for the next start to adopt.

mod api;
mod auth;
mod cluster;
mod metrics;
mod peer;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use berth_core::Spawner;
use berth_core::policy::duplicate_node;
use berth_local::LocalSpawner;
use berth_store::{NodeStatus, Store};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;

pub use auth::admin_token_path;

/// Runs a node until it is told to stop.
pub async fn run(config: Config) -> anyhow::Result<()> {
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("cannot create data dir {}", config.data_dir.display()))?;
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
        refuse_live_duplicate(store.as_ref(), &node_id, lease_config.ttl()).await?;
    }

    // Bound before the spawner starts: the heartbeat advertises the real
    // address (port 0 included) unless `advertise_url` says otherwise.
    let listener = tokio::net::TcpListener::bind(&config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let addr = listener.local_addr()?;
    let public_url = config
        .advertise_url
        .clone()
        .unwrap_or_else(|| format!("http://{addr}"));

    let shim_command = vec![
        std::env::current_exe()
            .context("cannot locate the berth executable to run shims")?
            .to_string_lossy()
            .into_owned(),
        "shim".to_owned(),
    ];
    let mut local = config.local_config(&node_id, shim_command)?;
    local.advertise_url.clone_from(&public_url);
    let ready_timeout = local.ready_timeout;
    let lease_ttl = local.lease.ttl();
    let renew_every = local.lease.renew();
    let spawner = LocalSpawner::start(local, store.clone())
        .await
        .context("cannot start the local spawner")?;
    spawner.set_capacity(config.capacity());
    // Registered (with capacity and URL) before serving: placement on other
    // nodes may choose this one as soon as it answers.
    spawner
        .heartbeat()
        .await
        .context("cannot register this node (heartbeat)")?;

    let cluster_metrics = cluster::ClusterMetrics::default();
    let metrics = Arc::new(metrics::Metrics::new(|registry| {
        spawner.register_metrics(registry);
        cluster_metrics.register(registry);
    }));

    // Cluster mode: routing across nodes, node-to-node calls, failover.
    let tasks = TaskTracker::new();
    let cancel = CancellationToken::new();
    let (cluster, cluster_secret) = if config.is_postgres() {
        let secret = berth_proxy::auth::ClusterSecret::new(
            config.cluster_secret.as_deref().unwrap_or_default(),
        )
        .context("cluster_secret")?;
        let peers = peer::PeerClient::new(secret.clone(), ready_timeout)
            .context("cannot build the HTTP client for node-to-node calls")?;
        let cluster = Arc::new(cluster::Cluster::new(
            store.clone(),
            spawner.clone() as Arc<dyn Spawner>,
            node_id.clone(),
            lease_ttl,
            lease_config.takeover(),
            peers,
            cluster_metrics,
        ));
        tasks.spawn(
            cluster
                .clone()
                .run_failover(renew_every, cancel.child_token()),
        );
        (Some(cluster), Some(secret))
    } else {
        (None, None)
    };

    let authenticator = auth::Authenticator::new(&admin_token, store.clone());
    let proxy_cluster = match (&cluster, &cluster_secret) {
        (Some(cluster), Some(secret)) => Some(berth_proxy::ProxyCluster {
            hook: cluster.clone() as Arc<dyn berth_proxy::ClusterHook>,
            secret: secret.clone(),
        }),
        _ => None,
    };
    let proxy = berth_proxy::Proxy::start_clustered(
        proxy_config(&config, ready_timeout)?,
        spawner.clone() as Arc<dyn Spawner>,
        authenticator.shared(),
        proxy_cluster,
    );
    let state = Arc::new(api::ApiState {
        spawner: spawner.clone() as Arc<dyn Spawner>,
        store: store.clone(),
        auth: authenticator,
        metrics,
        public_url: public_url.clone(),
        node_id: node_id.clone(),
        ready_timeout,
        lease_ttl,
        cluster,
        cluster_secret,
        node_control: spawner.clone() as Arc<dyn cluster::NodeControl>,
        streams: proxy.streams().clone(),
    });
    let app = api::router(state);

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
        body_pace: body_pace(&config),
    };
    berth_proxy::serve(listener, server, proxy.clone(), app, shutdown_signal())
        .await
        .context("the HTTP server failed")?;
    tracing::info!("shutting down; instances keep running");
    cancel.cancel();
    tasks.close();
    tasks.wait().await;
    proxy.shutdown().await;
    spawner.teardown().await;
    // A node that says `down` may be started again at once under the same
    // id (see `duplicate_node`), and gets no new instances meanwhile.
    spawner.set_node_status(NodeStatus::Down);
    if let Err(e) = spawner.heartbeat().await {
        tracing::warn!(error = %e, "could not mark this node down");
    }
    Ok(())
}

/// Refuses to start a second live node under `node_id`: both would renew,
/// and fence, the same leases. Liveness is the heartbeat's age by the
/// store's clock, within one lease TTL.
async fn refuse_live_duplicate(
    store: &dyn Store,
    node_id: &str,
    ttl: Duration,
) -> anyhow::Result<()> {
    let nodes = store
        .list_nodes()
        .await
        .context("cannot read the nodes table")?;
    let now = store.now().await.context("cannot read the store's clock")?;
    let views: Vec<_> = nodes.iter().map(|n| n.view(now)).collect();
    let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
    if let Some(live) = duplicate_node(node_id, &views, ttl_ms) {
        let url = nodes
            .iter()
            .find(|n| n.id == live.id)
            .map_or("", |n| n.advertise_url.as_str());
        anyhow::bail!(
            "node id {node_id:?} is already in use by a live node: its last heartbeat was {:.1} s ago (advertised at {url}); \
             stop that node, wait {:.1} s for its heartbeat to expire, or start this one with another node_id",
            live.heartbeat_age_ms.max(0) as f64 / 1000.0,
            ttl.as_secs_f64()
        );
    }
    Ok(())
}

/// How long in-flight requests may finish after SIGTERM. Long streams
/// (progress, SSE, downloads) are cut after it.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

fn proxy_config(
    config: &Config,
    ready_timeout: Duration,
) -> anyhow::Result<berth_proxy::ProxyConfig> {
    let p = &config.proxy;
    Ok(berth_proxy::ProxyConfig {
        base_domain: Some(p.base_domain.clone()).filter(|d| !d.is_empty()),
        strip_prefix: p.strip_prefix,
        auth_mode: p.auth.parse().map_err(anyhow::Error::msg)?,
        trusted_proxies: berth_proxy::auth::TrustedProxies::parse(&p.trusted_proxies)?,
        ready_timeout,
        forward: berth_proxy::forward::ForwardConfig {
            max_upgrades: p.max_upgrades,
            max_upgrades_per_user: p.max_upgrades_per_user,
            body_pace: body_pace(config),
            ..Default::default()
        },
    })
}

/// `[proxy] body_min_bytes_per_s` and `body_grace_ms` (0: no bound), for
/// the API's bodies and for the bodies the proxy forwards alike.
fn body_pace(config: &Config) -> Option<berth_proxy::BodyPace> {
    let p = &config.proxy;
    (p.body_grace_ms > 0).then(|| berth_proxy::BodyPace {
        min_bytes_per_s: p.body_min_bytes_per_s,
        grace: Duration::from_millis(p.body_grace_ms),
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
