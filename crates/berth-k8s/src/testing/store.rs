//! The double's object store: JSON objects by kind, namespace and name,
//! one resourceVersion counter, a bounded event history for watches (with
//! compaction, so an old resourceVersion gets 410 Gone), label selectors,
//! and JSON merge patches.

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

/// The kinds the double serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// Pods, which the stand-in kubelet runs.
    Pod,
    /// Services.
    Service,
    /// ConfigMaps (a user's patch, a watchdog's hand-off).
    ConfigMap,
    /// PersistentVolumeClaims.
    PersistentVolumeClaim,
    /// NetworkPolicies (`networking.k8s.io`).
    NetworkPolicy,
    /// Secrets.
    Secret,
}

impl Kind {
    /// From the URL's resource name.
    pub fn from_resource(resource: &str) -> Option<Kind> {
        Some(match resource {
            "pods" => Kind::Pod,
            "services" => Kind::Service,
            "configmaps" => Kind::ConfigMap,
            "persistentvolumeclaims" => Kind::PersistentVolumeClaim,
            "networkpolicies" => Kind::NetworkPolicy,
            "secrets" => Kind::Secret,
            _ => return None,
        })
    }

    /// Its resource name in URLs (`pods`).
    pub fn resource(self) -> &'static str {
        match self {
            Kind::Pod => "pods",
            Kind::Service => "services",
            Kind::ConfigMap => "configmaps",
            Kind::PersistentVolumeClaim => "persistentvolumeclaims",
            Kind::NetworkPolicy => "networkpolicies",
            Kind::Secret => "secrets",
        }
    }

    /// Its objects' `kind` (`Pod`).
    pub fn name(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Service => "Service",
            Kind::ConfigMap => "ConfigMap",
            Kind::PersistentVolumeClaim => "PersistentVolumeClaim",
            Kind::NetworkPolicy => "NetworkPolicy",
            Kind::Secret => "Secret",
        }
    }

    /// Its objects' `apiVersion`.
    pub fn api_version(self) -> &'static str {
        match self {
            Kind::NetworkPolicy => "networking.k8s.io/v1",
            _ => "v1",
        }
    }
}

pub type Key = (Kind, String, String);

/// A Kubernetes `Status` answer.
pub fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": if code < 400 { "Success" } else { "Failure" },
        "message": message,
        "reason": reason,
        "code": code,
    })
}

/// One label-selector requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed label selector (`a=b,c!=d,e,!f,g in (h,i),j notin (k)`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector(Vec<Requirement>);

impl Selector {
    pub fn parse(text: &str) -> Result<Selector, String> {
        let mut parts = Vec::new();
        let (mut depth, mut start) = (0, 0);
        for (i, c) in text.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&text[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&text[start..]);
        let mut requirements = Vec::new();
        for part in parts.into_iter().map(str::trim).filter(|p| !p.is_empty()) {
            let set = |rest: &str| -> Vec<String> {
                rest.trim()
                    .trim_start_matches('(')
                    .trim_end_matches(')')
                    .split(',')
                    .map(|v| v.trim().to_owned())
                    .collect()
            };
            let requirement = if let Some((k, v)) = part.split_once("!=") {
                Requirement::NotEquals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
                Requirement::Equals(k.trim().into(), v.trim().into())
            } else if let Some((k, rest)) = part.split_once(" notin ") {
                Requirement::NotIn(k.trim().into(), set(rest))
            } else if let Some((k, rest)) = part.split_once(" in ") {
                Requirement::In(k.trim().into(), set(rest))
            } else if let Some(k) = part.strip_prefix('!') {
                Requirement::NotExists(k.trim().into())
            } else if part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
            {
                Requirement::Exists(part.into())
            } else {
                return Err(format!("unable to parse requirement: {part:?}"));
            };
            requirements.push(requirement);
        }
        Ok(Selector(requirements))
    }

    pub fn matches(&self, labels: &Value) -> bool {
        let get = |k: &str| labels.get(k).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Equals(k, v) => get(k) == Some(v.as_str()),
            Requirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            Requirement::In(k, vs) => get(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            Requirement::NotIn(k, vs) => !get(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
        })
    }

    /// A selector from a map (a Service's `spec.selector`).
    pub fn of_map(map: &Map<String, Value>) -> Selector {
        Selector(
            map.iter()
                .map(|(k, v)| Requirement::Equals(k.clone(), v.as_str().unwrap_or_default().into()))
                .collect(),
        )
    }
}

/// RFC 7386: `patch` merged into `target`.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    if let Value::Object(map) = target {
        for (key, value) in patch {
            if value.is_null() {
                map.remove(key);
            } else {
                merge_patch(map.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}

/// One event as a watch sends it.
#[derive(Debug, Clone)]
pub struct WatchEvent {
    pub rv: u64,
    pub kind: Kind,
    pub namespace: String,
    pub kind_of_event: &'static str,
    pub object: Value,
}

impl WatchEvent {
    pub fn line(&self) -> String {
        let mut text = json!({ "type": self.kind_of_event, "object": self.object }).to_string();
        text.push('\n');
        text
    }
}

/// An open watch.
pub struct Watcher {
    pub kind: Kind,
    pub namespace: String,
    pub selector: Selector,
    pub sender: mpsc::UnboundedSender<String>,
}

impl Watcher {
    pub fn wants(&self, event: &WatchEvent) -> bool {
        event.kind == self.kind
            && event.namespace == self.namespace
            && self.selector.matches(&event.object["metadata"]["labels"])
    }
}

/// Events kept for resuming watches.
const HISTORY: usize = 100_000;

#[derive(Default)]
pub struct Store {
    rv: u64,
    pub objects: BTreeMap<Key, Value>,
    history: VecDeque<WatchEvent>,
    /// The oldest resourceVersion a watch may resume after.
    oldest: u64,
    pub watchers: Vec<Watcher>,
    pub creates: HashMap<Kind, usize>,
    next_uid: u64,
}

impl Store {
    pub fn rv(&self) -> u64 {
        self.rv
    }

    pub fn new_uid(&mut self) -> String {
        self.next_uid += 1;
        let n = self.next_uid;
        format!("{:08x}-d0b1-4e00-8000-{:012x}", std::process::id(), n)
    }

    /// Gives `object` the next resourceVersion and records the event.
    pub fn record(&mut self, kind: Kind, kind_of_event: &'static str, object: &mut Value) {
        self.rv += 1;
        object["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let event = WatchEvent {
            rv: self.rv,
            kind,
            namespace: object["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            kind_of_event,
            object: object.clone(),
        };
        self.watchers
            .retain(|w| !w.wants(&event) || w.sender.send(event.line()).is_ok());
        self.history.push_back(event);
        while self.history.len() > HISTORY {
            if let Some(old) = self.history.pop_front() {
                self.oldest = old.rv + 1;
            }
        }
    }

    pub fn put(&mut self, key: Key, mut object: Value, kind_of_event: &'static str) -> Value {
        self.record(key.0, kind_of_event, &mut object);
        self.objects.insert(key, object.clone());
        object
    }

    pub fn remove(&mut self, key: &Key) -> Option<Value> {
        let mut object = self.objects.remove(key)?;
        self.record(key.0, "DELETED", &mut object);
        Some(object)
    }

    /// Starts a watch after `since`; `Err` when that history is gone.
    pub fn watch(&mut self, watcher: Watcher, since: Option<u64>) -> Result<(), Watcher> {
        match since {
            None => {
                let now: Vec<String> = self
                    .objects
                    .iter()
                    .filter(|((kind, ns, _), object)| {
                        *kind == watcher.kind
                            && *ns == watcher.namespace
                            && watcher.selector.matches(&object["metadata"]["labels"])
                    })
                    .map(|(_, object)| {
                        json!({ "type": "ADDED", "object": object }).to_string() + "\n"
                    })
                    .collect();
                for line in now {
                    let _ = watcher.sender.send(line);
                }
            }
            Some(since) if since + 1 < self.oldest => return Err(watcher),
            Some(since) => {
                for event in self
                    .history
                    .iter()
                    .filter(|e| e.rv > since && watcher.wants(e))
                {
                    let _ = watcher.sender.send(event.line());
                }
            }
        }
        self.watchers.push(watcher);
        Ok(())
    }

    /// Forgets the history up to now: a watch resuming from before now
    /// gets 410 Gone.
    pub fn compact(&mut self) {
        self.history.clear();
        self.oldest = self.rv + 1;
    }

    pub fn close_watches(&mut self) {
        self.watchers.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_match_like_kubernetes() {
        let labels = json!({ "a": "1", "b": "2" });
        for (text, want) in [
            ("a=1", true),
            ("a==1,b=2", true),
            ("a=2", false),
            ("a!=2", true),
            ("c!=2", true),
            ("a", true),
            ("!a", false),
            ("!c", true),
            ("a in (1,3)", true),
            ("a notin (1,3)", false),
            ("", true),
        ] {
            assert_eq!(
                Selector::parse(text).unwrap().matches(&labels),
                want,
                "{text}"
            );
        }
        assert!(Selector::parse("a b c").is_err());
    }

    #[test]
    fn merge_patches_follow_rfc_7386() {
        let mut target = json!({ "a": { "b": 1, "c": [1, 2] }, "d": 1 });
        merge_patch(
            &mut target,
            &json!({ "a": { "b": null, "c": [3] }, "e": "x" }),
        );
        assert_eq!(target, json!({ "a": { "c": [3] }, "d": 1, "e": "x" }));
    }

    #[test]
    fn a_watch_resumes_from_history_or_is_told_it_is_gone() {
        let mut store = Store::default();
        let key = (Kind::ConfigMap, "ns".to_owned(), "a".to_owned());
        let object = json!({ "metadata": { "name": "a", "namespace": "ns", "labels": {} } });
        store.put(key.clone(), object.clone(), "ADDED");
        store.put(key.clone(), object.clone(), "MODIFIED");
        let watcher = || {
            let (sender, receiver) = mpsc::unbounded_channel();
            (
                Watcher {
                    kind: Kind::ConfigMap,
                    namespace: "ns".into(),
                    selector: Selector::default(),
                    sender,
                },
                receiver,
            )
        };
        let (w, mut r) = watcher();
        assert!(store.watch(w, Some(1)).is_ok());
        assert!(r.try_recv().unwrap().contains("MODIFIED"));
        store.compact();
        let (w, _) = watcher();
        assert!(store.watch(w, Some(1)).is_err(), "history before 2 is gone");
        let (w, _) = watcher();
        assert!(store.watch(w, Some(2)).is_ok(), "nothing after 2 was lost");
    }
}
