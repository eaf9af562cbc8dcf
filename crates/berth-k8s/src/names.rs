//! Object names, labels and annotations: the only places a user's
//! identity reaches Kubernetes. Names and label values come from the
//! slug, never the raw id; the raw id travels only as an annotation
//! value, which may hold any text.

use std::collections::BTreeMap;

use berth_core::{Role, Slug};

/// Prefix of every label and annotation key berth owns.
pub const PREFIX: &str = "berth.dev";
/// The standard label naming the tool that manages an object.
pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// berth's value of [`MANAGED_BY`], which its one watch selects on.
pub const MANAGED_BY_VALUE: &str = "berth";
/// Label: the user's slug.
pub const SLUG_LABEL: &str = "berth.dev/slug";
/// Label (pods only): `main` or `watchdog`.
pub const ROLE_LABEL: &str = "berth.dev/role";
/// Annotation: the raw user id.
pub const USER_ANNOTATION: &str = "berth.dev/user";
/// Annotation (pods): the instance id the pod runs.
pub const INSTANCE_ANNOTATION: &str = "berth.dev/instance";
/// Annotation (pods): the lease epoch the pod is managed under. Only ever
/// raised, by the replica that holds the lease (see `docs/design.md`,
/// "How fencing maps onto Kubernetes").
pub const EPOCH_ANNOTATION: &str = "berth.dev/epoch";
/// Annotation (pods): the berth node (replica) that manages the pod.
pub const NODE_ANNOTATION: &str = "berth.dev/node";
/// Annotation (pods): a hash of what the pod was made from (its manifest
/// without the annotations above), so a replica can tell whether an
/// existing pod is the one it would create.
pub const TEMPLATE_ANNOTATION: &str = "berth.dev/template";
/// Annotation (pods with berth's shim): a value chosen when the pod was
/// created, never changed; the pod's shim credential is made from it (see
/// `runtime/shim.rs`).
pub const SHIM_NONCE_ANNOTATION: &str = "berth.dev/shim-nonce";
/// Annotation (pods with berth's shim): the fence deadline the shim
/// starts with, in ms from its start. An annotation, not part of the
/// template: it is what is left of the creating replica's lease, which
/// differs from one start to the next.
pub const SHIM_FENCE_ANNOTATION: &str = "berth.dev/shim-fence-ms";
/// Annotation (pods): a hash of the patch the pod was started with.
pub const PATCH_ANNOTATION: &str = "berth.dev/patch";
/// Finalizer on every pod: the pod object (its exit status and its log)
/// stays until berth has read them, and its name stays taken until its
/// containers are dead.
pub const FINALIZER: &str = "berth.dev/collect-exit";

/// The label selector of everything berth manages.
pub fn managed_selector() -> String {
    format!("{MANAGED_BY}={MANAGED_BY_VALUE}")
}

/// The name of the user's main pod, Service, ConfigMap, NetworkPolicy and
/// per-user claim: `berth-<slug>`. Kinds have separate name spaces, so one
/// name serves them all.
pub fn user_object(slug: &(impl std::fmt::Display + ?Sized)) -> String {
    format!("berth-{slug}")
}

/// The pod of `role`: the user object's name, `--wd` for a watchdog. No
/// slug ends in `--wd` (plain slugs never contain `--`; hashed ones end in
/// hash characters), so a watchdog's name is never another user's main's;
/// with slugs of at most 53 characters it stays within 63.
pub fn pod(slug: &Slug, role: Role) -> String {
    match role {
        Role::Main => user_object(slug),
        Role::Watchdog => watchdog_config_map(slug),
    }
}

/// The watchdog's own ConfigMap (its handoff), named like its pod.
pub fn watchdog_config_map(slug: &Slug) -> String {
    format!("berth-{slug}--wd")
}

/// Labels of every object of `slug`'s.
pub fn user_labels(slug: &Slug) -> BTreeMap<String, String> {
    BTreeMap::from([
        (MANAGED_BY.to_owned(), MANAGED_BY_VALUE.to_owned()),
        (SLUG_LABEL.to_owned(), slug.as_str().to_owned()),
    ])
}

/// Labels of a pod: the user's labels and its role.
pub fn pod_labels(slug: &Slug, role: Role) -> BTreeMap<String, String> {
    let mut labels = user_labels(slug);
    labels.insert(ROLE_LABEL.to_owned(), role.as_str().to_owned());
    labels
}

/// Whether `s` is a DNS-1123 label (`[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at
/// most 63 characters): what a namespace, a Service name and a pod's
/// hostname must be.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// Whether `s` is a valid label value: at most 63 characters of
/// `[A-Za-z0-9._-]`, beginning and ending with an alphanumeric (or empty).
pub fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    b.is_empty()
        || (b.len() <= 63
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use berth_core::UserId;

    use super::*;

    /// User ids that are tricky to name objects after, and a few more.
    pub(crate) fn tricky_ids() -> Vec<String> {
        vec![
            "alice".into(),
            "Alice".into(),
            "ALICE".into(),
            "a.b@corp.example".into(),
            "a-b@corp.example".into(),
            "A.B@corp.example".into(),
            "x".repeat(128),
            format!("{}y", "x".repeat(127)),
            "é".repeat(64),
            "--x".into(),
            "-x".into(),
            "x-".into(),
            "_u".into(),
            "__u".into(),
            "7up".into(),
            "日本語のユーザー".into(),
            "用户".into(),
            "🦀".into(),
            "a b".into(),
            "a--b".into(),
            "x---deadbeef".into(),
            "alice-wd".into(),
            "alice--wd".into(),
        ]
    }

    #[test]
    fn tricky_ids_give_valid_unique_names() {
        let mut seen: HashSet<String> = HashSet::new();
        for raw in tricky_ids() {
            let user = UserId::parse(&raw).unwrap();
            let slug = user.slug();
            for role in [Role::Main, Role::Watchdog] {
                let name = pod(&slug, role);
                assert!(is_dns_label(&name), "{raw:?} → {name:?}");
                assert!(name.starts_with("berth-"), "{name}");
                assert!(
                    name.as_bytes()[0].is_ascii_lowercase(),
                    "a Service name starts with a letter: {name}"
                );
                assert!(seen.insert(name.clone()), "{raw:?} → {name} again");
            }
            assert!(is_dns_label(&watchdog_config_map(&slug)));
            for (key, value) in pod_labels(&slug, Role::Main) {
                assert!(is_label_value(&value), "{key}={value:?} for {raw:?}");
            }
        }
    }

    #[test]
    fn the_label_checks_reject_what_kubernetes_rejects() {
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", &"a".repeat(64)] {
            assert!(!is_dns_label(bad), "{bad:?}");
        }
        for bad in ["-a", "a-", "a b", "é", &"a".repeat(64)] {
            assert!(!is_label_value(bad), "{bad:?}");
        }
        assert!(is_label_value("A_b.c-1"));
        assert!(is_dns_label(&format!("berth-{}", "a".repeat(57))));
    }
}
