//! The pods: creating one (or settling the one already there), waiting
//! for it to start, and the epoch-fenced deletes.

use berth_core::runtime::{InstanceSpec, Patch, RuntimeError, RuntimeRef};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{DeleteParams, Patch as KubePatch, PatchParams, PostParams, Preconditions};
use serde_json::json;

use super::{CONFLICT_RETRIES, Inner, code, failed, grace_seconds};
use crate::names;
use crate::observe::{self, PodView, StartOutcome};

impl Inner {
    /// Deletes pod `name` if it is still `uid`, with `grace` seconds.
    pub(super) async fn delete_pod(
        &self,
        name: &str,
        uid: &str,
        grace: u32,
    ) -> Result<(), kube::Error> {
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
    pub(super) async fn end_run(&self, r: &RuntimeRef, grace: u32) -> Result<(), RuntimeError> {
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
    pub(super) async fn create_pod(
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
    pub(super) async fn wait_started(
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
    pub(super) async fn abandon(&self, name: &str, uid: &str) {
        if let Err(e) = self.delete_pod(name, uid, 1).await {
            tracing::warn!(pod = %name, error = %e, "could not delete a pod that failed to start");
        }
    }
}
