//! berth's reverse proxy: one address in front of every user's instance.
//!
//! A request for `/u/<user>/…` (or `<slug>.<base_domain>`) passes through
//! small layers, each usable and tested on its own:
//!
//! 1. [`route`] reads the target user from the request and looks up where
//!    the user's instance listens, in an in-memory table fed by spawner
//!    events;
//! 2. [`auth`] lets through the user themself (a user token as Bearer, as
//!    the user cookie, or once as a query parameter that becomes the
//!    cookie; or a trusted SSO header) or the admin (Bearer only);
//! 3. [`wake`] starts a missing instance and waits for it (or shows a
//!    browser the "starting" page);
//! 4. [`forward`] streams the request to the instance and the answer back,
//!    tunnelling WebSockets (of which only the client's data frames are
//!    activity: [`ws_activity`]).
//!
//! [`shield`] holds the rules against hostile apps: which browser requests
//! from other origins are refused before step 2, and what an app's
//! response headers may do to the origin (or site) it shares.
//!
//! [`server::serve`] accepts connections, applies connection-level limits
//! ([`limits`]: connections per client address and in all; [`pace`]: how
//! fast request bodies must arrive), and hands every other request to a
//! fallback service (berth's API). Long-lived streams (WebSockets, and the
//! API's progress and log streams through [`Proxy::streams`]) are counted
//! per user and in all by [`limits::StreamLimits`]. [`metrics`] times
//! every answer.
//!
//! [`peer_auth`] signs and checks what nodes of a cluster send each other
//! (berth's node-to-node API, and app traffic forwarded to the node that
//! runs the user's instance), so that the cluster secret never travels.
//!
//! ```no_run
//! use std::sync::Arc;
//! use berth_proxy::{Proxy, ProxyConfig, ServerConfig, auth::Authenticator};
//!
//! # async fn run(
//! #     spawner: Arc<dyn berth_core::Traffic>,
//! #     tokens: Arc<dyn berth_proxy::auth::TokenStore>,
//! #     api: NotFound,
//! # ) -> std::io::Result<()> {
//! // `api` is any `tower_service::Service<Request<berth_proxy::RequestBody>>`,
//! // e.g. an axum Router.
//! let auth = Authenticator::new("admin-token", tokens);
//! let proxy = Proxy::start(ProxyConfig::default(), spawner, auth);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8000").await?;
//! berth_proxy::serve(listener, ServerConfig::default(), proxy.clone(), api, async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await?;
//! proxy.shutdown().await;
//! # Ok(())
//! # }
//! # #[derive(Clone)]
//! # struct NotFound;
//! # impl tower_service::Service<hyper::Request<berth_proxy::RequestBody>> for NotFound {
//! #     type Response = hyper::Response<http_body_util::Full<bytes::Bytes>>;
//! #     type Error = std::convert::Infallible;
//! #     type Future = std::future::Ready<Result<Self::Response, Self::Error>>;
//! #     fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
//! #         std::task::Poll::Ready(Ok(()))
//! #     }
//! #     fn call(&mut self, _: hyper::Request<berth_proxy::RequestBody>) -> Self::Future {
//! #         std::future::ready(Ok(hyper::Response::default()))
//! #     }
//! # }
//! ```

#![forbid(unsafe_code)]

pub mod auth;
mod conn;
pub mod credential;
pub mod forward;
pub mod limits;
pub mod metrics;
pub mod pace;
pub mod peer_auth;
mod pool;
mod proxy;
pub mod respond;
pub mod route;
pub mod server;
pub mod shield;
mod upstream_body;
pub mod wake;
pub mod ws_activity;

pub use metrics::ProxyMetrics;
pub use pace::{BodyPace, BodyTooSlow, PacedBody};
pub use pool::ForwardedBody;

pub use proxy::{Proxy, ProxyCluster, ProxyConfig, route_error};
pub use server::{RequestBody, ServerConfig, serve};
pub use wake::{ClusterHook, Locate};
