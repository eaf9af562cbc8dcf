//! The user's objects besides the pod (claim, patch and handoff
//! ConfigMaps, Service, NetworkPolicy): created, or brought in line.

use berth_core::egress::EgressPolicy;
use berth_core::runtime::{InstanceSpec, Patch, RuntimeError};
use berth_core::{Role, Slug, UserId};
use kube::api::{Api, Patch as KubePatch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::{CONFLICT_RETRIES, Inner, code, failed};
use crate::{manifest, names};

/// Whether every field of `want` is in `have` with the same value: berth's
/// fields of an object, ignoring what the API server added.
fn contains(have: &Value, want: &Value) -> bool {
    match (have, want) {
        (Value::Object(h), Value::Object(w)) => w
            .iter()
            .all(|(k, v)| v.is_null() || h.get(k).is_some_and(|hv| contains(hv, v))),
        (Value::Array(h), Value::Array(w)) => {
            h.len() == w.len() && h.iter().zip(w).all(|(h, w)| contains(h, w))
        }
        _ => have == want,
    }
}

/// Whether `existing` already has everything of `desired`: its labels and
/// annotations, and its body — exactly (`whole`), or with what the API
/// server added.
fn owns_all<K: Serialize>(existing: &K, desired: &K, whole: bool) -> bool {
    let (mut have, mut want) = (owned_fields(existing), owned_fields(desired));
    let (have_meta, want_meta) = (have["metadata"].take(), want["metadata"].take());
    contains(&have_meta, &want_meta)
        && if whole {
            have == want
        } else {
            contains(&have, &want)
        }
}

/// The parts of an object berth owns: labels, annotations, and everything
/// but the metadata.
fn owned_fields<K: Serialize>(object: &K) -> Value {
    let mut value = serde_json::to_value(object).unwrap_or(Value::Null);
    if let Value::Object(map) = &mut value {
        let meta = map.remove("metadata").unwrap_or(Value::Null);
        map.insert(
            "metadata".into(),
            json!({ "labels": meta["labels"], "annotations": meta["annotations"] }),
        );
        map.remove("status");
    }
    value
}

impl Inner {
    /// Creates `desired`, or brings the existing object's berth fields in
    /// line (`replace`: a PUT; otherwise a merge patch, which keeps what
    /// the API server allocated, such as a Service's addresses).
    async fn ensure<K>(&self, api: &Api<K>, desired: &K, replace: bool) -> Result<(), kube::Error>
    where
        K: Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
    {
        let name = desired.meta().name.clone().unwrap_or_default();
        for _ in 0..CONFLICT_RETRIES {
            match api.create(&PostParams::default(), desired).await {
                Ok(_) => return Ok(()),
                Err(e) if code(&e) == Some(409) => {}
                Err(e) => return Err(e),
            }
            let Some(existing) = api.get_opt(&name).await? else {
                continue;
            };
            if owns_all(&existing, desired, replace) {
                return Ok(());
            }
            let result = if replace {
                let mut object = desired.clone();
                object.meta_mut().resource_version = existing.resource_version();
                api.replace(&name, &PostParams::default(), &object)
                    .await
                    .map(drop)
            } else {
                api.patch(&name, &PatchParams::default(), &KubePatch::Merge(desired))
                    .await
                    .map(drop)
            };
            match result {
                Ok(()) => return Ok(()),
                Err(e) if matches!(code(&e), Some(409 | 404)) => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes a pod's shim Secret: created, or replaced when it holds
    /// another credential.
    pub(super) async fn ensure_secret(
        &self,
        secret: &k8s_openapi::api::core::v1::Secret,
    ) -> Result<(), kube::Error> {
        self.ensure(&self.secrets, secret, true).await
    }

    /// The user's objects besides the pod; the patch's hash.
    pub(super) async fn ensure_objects(&self, spec: &InstanceSpec) -> Result<String, RuntimeError> {
        let k = &self.config.kubernetes;
        let (user, slug) = (&spec.user, &spec.slug);
        let bad = |e: crate::config::ConfigError| RuntimeError::SpawnFailed(e.to_string());
        if let Some(claim) = manifest::claim(k, user, slug).map_err(bad)? {
            // A user's claim is never changed or deleted: it holds their data.
            match self.claims.create(&PostParams::default(), &claim).await {
                Ok(_) => {}
                Err(e) if code(&e) == Some(409) => {}
                Err(e) => return Err(failed("cannot create the user's volume claim", e)),
            }
        }
        let patch_hash = match &spec.patch {
            Patch::Set(content) => {
                let map = manifest::patch_config_map(
                    k,
                    user,
                    slug,
                    &self.config.program.patch_ext,
                    content.as_deref(),
                )
                .map_err(bad)?;
                self.ensure(&self.config_maps, &map, true)
                    .await
                    .map_err(|e| failed("cannot write the patch ConfigMap", e))?;
                manifest::patch_hash(content.as_deref())
            }
            Patch::Unchanged => {
                let name = names::user_object(slug);
                let existing = self
                    .config_maps
                    .get_opt(&name)
                    .await
                    .map_err(|e| failed("cannot read the patch ConfigMap", e))?;
                let file = manifest::patch_file(&self.config.program.patch_ext);
                let content = existing
                    .as_ref()
                    .and_then(|m| m.data.as_ref())
                    .and_then(|d| d.get(&file))
                    .cloned();
                if existing.is_none() {
                    let map = manifest::patch_config_map(
                        k,
                        user,
                        slug,
                        &self.config.program.patch_ext,
                        None,
                    )
                    .map_err(bad)?;
                    self.ensure(&self.config_maps, &map, true)
                        .await
                        .map_err(|e| failed("cannot write the patch ConfigMap", e))?;
                }
                manifest::patch_hash(content.as_deref())
            }
        };
        if spec.role == Role::Watchdog {
            let handoff = spec.handoff.as_deref().unwrap_or("{}");
            let map = manifest::handoff_config_map(k, user, slug, handoff).map_err(bad)?;
            self.ensure(&self.config_maps, &map, true)
                .await
                .map_err(|e| failed("cannot write the handoff ConfigMap", e))?;
        }
        let service = manifest::service(k, user, slug).map_err(bad)?;
        self.ensure(&self.services, &service, false)
            .await
            .map_err(|e| failed("cannot write the user's Service", e))?;
        self.ensure_policy(user, slug, spec.egress.as_ref()).await?;
        Ok(patch_hash)
    }

    /// Brings the user's NetworkPolicy in line with their egress `policy`
    /// (`None`: the node's). The CNI applies it to their pods' new
    /// connections; open ones go on.
    pub(super) async fn ensure_policy(
        &self,
        user: &UserId,
        slug: &Slug,
        policy: Option<&EgressPolicy>,
    ) -> Result<(), RuntimeError> {
        let policy = policy.unwrap_or(&self.config.egress);
        let object = manifest::network_policy(&self.config.kubernetes, user, slug, policy)
            .map_err(|e| RuntimeError::Failed(e.to_string()))?;
        self.ensure(&self.policies, &object, true)
            .await
            .map_err(|e| failed("cannot write the user's NetworkPolicy", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_contains_berths_fields_whatever_the_server_added() {
        let have = json!({ "spec": { "clusterIP": "None", "clusterIPs": ["None"], "ports": [{ "port": 1, "protocol": "TCP" }] } });
        assert!(contains(
            &have,
            &json!({ "spec": { "clusterIP": "None", "ports": [{ "port": 1 }] } })
        ));
        assert!(!contains(
            &have,
            &json!({ "spec": { "ports": [{ "port": 2 }] } })
        ));
        assert!(!contains(&have, &json!({ "spec": { "ports": [] } })));
        assert!(!contains(
            &json!({ "data": {} }),
            &json!({ "data": { "a": "1" } })
        ));
    }
}
