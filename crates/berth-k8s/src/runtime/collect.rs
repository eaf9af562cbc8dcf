//! The collector: a pod of this node that is being deleted and has ended
//! keeps its log tail and loses berth's finalizer.

use std::sync::Arc;

use kube::ResourceExt;
use kube::api::{Patch as KubePatch, PatchParams};
use serde_json::json;

use super::{CONFLICT_RETRIES, Inner, code, lock};
use crate::names;
use crate::observe::PodView;

impl Inner {
    /// This node's pods that are being deleted and have ended (or never
    /// got a node) lose berth's finalizer, once their log is kept.
    pub(super) fn collect_if_due(self: &Arc<Self>, view: &PodView) {
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

    /// Removes berth's finalizer from pod `name` if it is still `uid`.
    pub(super) async fn release_finalizer(&self, name: &str, uid: &str) -> Result<(), kube::Error> {
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
}
