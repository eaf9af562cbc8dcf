//! `berth serve`: the API, the supervisor and the proxy in one process.
//!
//! Start-up order matters: the data dir and admin token first (a newcomer's
//! first question is "what is my token?"), then the store (migrated), then
//! the spawner (which re-attaches to instances a previous berth left
//! running), and only then the listener, so no request sees a half-built
//! node. One listener serves both: `berth_proxy`'s server sends user routes
//! (`/u/<user>/…`, `<slug>.<base_domain>`) to the proxy and everything else
//! to the API router. On SIGINT/SIGTERM berth stops listening, drains, and
//! tears the spawner down; instances keep running for the next start to
//! adopt.

mod api;
mod auth;
mod metrics;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use berth_core::Spawner;
use berth_local::LocalSpawner;

use crate::config::Config;

pub use auth::admin_token_path;

/// Runs a node until it is told to stop.
pub async fn run(config: Config) -> anyhow::Result<()> {
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("cannot create data dir {}", config.data_dir.display()))?;
    let admin_token =
        auth::load_or_create_admin_token(config.admin_token.as_deref(), &config.data_dir)?;

    let store_url = config.store_url();
    let store = berth_store::open(&store_url)
        .await
        .with_context(|| format!("cannot open the store {}", redact_url(&store_url)))?;

    let node_id = config.node_id()?;
    let shim_command = vec![
        std::env::current_exe()
            .context("cannot locate the berth executable to run shims")?
            .to_string_lossy()
            .into_owned(),
        "shim".to_owned(),
    ];
    let local = config.local_config(&node_id, shim_command)?;
    let ready_timeout = local.ready_timeout;
    let lease_ttl = local.lease.ttl();
    let spawner = LocalSpawner::start(local, store.clone())
        .await
        .context("cannot start the local spawner")?;
    let metrics = Arc::new(metrics::Metrics::new(|registry| {
        spawner.register_metrics(registry)
    }));

    let listener = tokio::net::TcpListener::bind(&config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let addr = listener.local_addr()?;
    let public_url = config
        .advertise_url
        .clone()
        .unwrap_or_else(|| format!("http://{addr}"));

    let authenticator = auth::Authenticator::new(&admin_token, store.clone());
    let proxy = berth_proxy::Proxy::start(
        proxy_config(&config, ready_timeout)?,
        spawner.clone() as Arc<dyn Spawner>,
        authenticator.shared(),
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
    });
    let app = api::router(state);

    tracing::info!(%addr, node = %node_id, data_dir = %config.data_dir.display(), "berth listening");
    // One plain line on stdout for people and scripts (e.g. with port 0).
    println!("berth: listening on {public_url}");

    let server = berth_proxy::ServerConfig {
        header_read_timeout: Duration::from_millis(config.proxy.header_timeout_ms.max(1)),
        max_header_bytes: config.proxy.max_header_bytes,
        shutdown_grace: SHUTDOWN_GRACE,
    };
    berth_proxy::serve(listener, server, proxy.clone(), app, shutdown_signal())
        .await
        .context("the HTTP server failed")?;
    tracing::info!("shutting down; instances keep running");
    proxy.shutdown().await;
    spawner.teardown().await;
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
            ..Default::default()
        },
    })
}

/// Hides the password of a `postgres://user:pass@host/db` URL in messages.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &url[scheme_end + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme_end + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("postgres://berth:s3cret@db:5432/berth"),
            "postgres://berth:***@db:5432/berth"
        );
        assert_eq!(
            redact_url("sqlite://./berth-data/berth.db"),
            "sqlite://./berth-data/berth.db"
        );
        assert_eq!(
            redact_url("postgres://berth@db/berth"),
            "postgres://berth@db/berth"
        );
    }
}
