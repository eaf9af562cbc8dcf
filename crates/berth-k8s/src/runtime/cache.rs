//! The pod cache: the one watch that keeps it and feeds the followed runs,
//! and the waits on it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use berth_core::runtime::RuntimeError;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};

use super::{Inner, lock};
use crate::names;
use crate::observe::PodView;

/// How long the first list of pods may take before a call that needs it
/// fails (the API server is unreachable, or berth may not list pods).
const SYNC_TIMEOUT: Duration = Duration::from_secs(60);

impl Inner {
    /// The one watch: keeps the cache and feeds the followed runs.
    pub(super) async fn watch_pods(self: Arc<Self>) {
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

    pub(super) async fn wait_synced(
        &self,
        deadline: tokio::time::Instant,
    ) -> Result<(), RuntimeError> {
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

    pub(super) fn cached_view(&self, name: &str) -> Option<PodView> {
        lock(&self.state).pods.get(name).map(PodView::of)
    }

    /// Waits until the cache's pod `name` (or its absence) passes `check`.
    pub(super) async fn wait_view(
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
    pub(super) async fn wait_gone(
        &self,
        name: &str,
        uid: &str,
        deadline: tokio::time::Instant,
    ) -> bool {
        self.wait_view(name, deadline, |v| v.is_none_or(|v| v.uid != uid))
            .await
    }
}
