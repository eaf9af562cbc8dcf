//! Reading pods' logs: the tail an ended pod leaves behind, and the
//! launch token.

use std::sync::Arc;
use std::time::Duration;

use futures_util::TryStreamExt;
use futures_util::io::AsyncBufReadExt;
use kube::api::LogParams;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Inner, lock};
use crate::manifest::MAIN_CONTAINER;
use berth_core::Readiness;
use berth_core::program;

/// Lines of an ended pod's log the runtime keeps for `logs`.
const KEPT_LINES: usize = 1000;
/// How much of a log adoption reads for the launch token.
const TOKEN_SCAN_BYTES: i64 = 1 << 20;

impl Inner {
    /// Keeps the tail of `name`'s log for after the pod is gone.
    pub(super) async fn keep_log(&self, name: &str) {
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

    /// Reads pod `name`'s log from its start until its ready line; sends
    /// the launch token the line carried, if any.
    pub(super) fn scan_for_token(
        self: &Arc<Self>,
        name: &str,
        found: mpsc::Sender<Option<String>>,
        cancel: CancellationToken,
    ) {
        let Readiness::TokenRegex(regex) = &self.config.program.readiness else {
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
                            if let Some(token) = program::ready_line(&regex, &line) {
                                return Ok(Some(token.map(str::to_owned)));
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

    /// The ready line in a whole log, for adoption: `None` when there is
    /// none, else the token it carried.
    pub(super) async fn ready_line_in_log(&self, name: &str) -> Option<Option<String>> {
        let Readiness::TokenRegex(regex) = &self.config.program.readiness else {
            return None;
        };
        // The token is printed at start; a long log is not read whole.
        let params = LogParams {
            container: Some(MAIN_CONTAINER.into()),
            limit_bytes: Some(TOKEN_SCAN_BYTES),
            ..LogParams::default()
        };
        let text = self.pods.logs(name, &params).await.ok()?;
        text.lines()
            .find_map(|line| program::ready_line(regex, line).map(|token| token.map(str::to_owned)))
    }
}
