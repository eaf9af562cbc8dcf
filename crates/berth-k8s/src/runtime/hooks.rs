//! Hooks: a `POST` to the pod, where the proxy reaches it. A command hook
//! runs inside the pod, through berth's shim (`shim.rs`); without the
//! shim the runtime does not declare `Capabilities::exec` (and `config
//! check` refuses one).

use std::time::Duration;

use berth_core::Endpoint;
use berth_core::runtime::{HookOutcome, RuntimeError, RuntimeRef};
use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

use super::Inner;
use crate::observe;

impl Inner {
    /// `POST path` on the pod `r` names, answered within `grace`.
    pub(super) async fn post_hook(
        &self,
        r: &RuntimeRef,
        path: &str,
        grace: Duration,
    ) -> Result<HookOutcome, RuntimeError> {
        let gone = || RuntimeError::Gone(r.clone());
        let (name, uid, _) = observe::parse_ref(r).ok_or_else(gone)?;
        let view = self
            .cached_view(name)
            .filter(|v| v.uid == uid && !v.gone && !v.deleting)
            .ok_or_else(gone)?;
        let slug = view.slug.ok_or_else(gone)?;
        let asked = async {
            let endpoint = self
                .endpoint_of(&slug, uid, tokio::time::Instant::now() + grace)
                .await?;
            Ok::<_, RuntimeError>(post(&endpoint, path).await)
        };
        let answer = tokio::time::timeout(grace, asked).await;
        Ok(HookOutcome::of_post(answer.ok().transpose()?))
    }
}

/// The status `endpoint` answers `POST path` with, if it answers.
async fn post(endpoint: &Endpoint, path: &str) -> Option<u16> {
    let stream = tokio::net::TcpStream::connect((endpoint.host.as_str(), endpoint.port))
        .await
        .ok()?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    let request = hyper::Request::post(path)
        .header(hyper::header::HOST, endpoint.authority())
        .body(Empty::<Bytes>::new())
        .ok()?;
    // The connection is driven while the request is in flight; it ends
    // with the hook, so no task is spawned for it.
    let mut conn = std::pin::pin!(conn);
    let mut response = std::pin::pin!(sender.send_request(request));
    let answer = tokio::select! {
        biased;
        answer = &mut response => answer,
        _ = &mut conn => response.await,
    };
    answer.ok().map(|r| r.status().as_u16())
}
