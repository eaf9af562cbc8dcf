//! The double's HTTP surface: the parts of the Kubernetes API berth uses,
//! answered the way the API server answers them (status codes, `Status`
//! bodies, watch streams of JSON lines, graceful pod deletion, finalizers,
//! preconditions and optimistic concurrency).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::deletion::{pod_ended, remove_if_finished, scheduled};
use super::endpoints;
use super::kubelet;
use super::store::{Key, Kind, Selector, Watcher, merge_patch, status};
use super::world::{Shared, lock};

type Params = Query<HashMap<String, String>>;

fn answer(code: u16, body: Value) -> Response {
    let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn not_found(kind: Kind, name: &str) -> Response {
    answer(
        404,
        status(
            404,
            "NotFound",
            &format!("{} \"{name}\" not found", kind.resource()),
        ),
    )
}

fn conflict(message: &str) -> Response {
    answer(409, status(409, "Conflict", message))
}

fn bad_request(message: &str) -> Response {
    answer(400, status(400, "BadRequest", message))
}

pub fn router(shared: Arc<Shared>) -> Router {
    let collection = get(list_or_watch).post(create);
    let item = get(read).put(replace).patch(patch).delete(delete);
    Router::new()
        .route("/api/v1/namespaces/{ns}/pods/{name}/log", get(logs))
        .route("/api/v1/namespaces/{ns}/{resource}", collection.clone())
        .route("/api/v1/namespaces/{ns}/{resource}/{name}", item.clone())
        .route(
            "/apis/networking.k8s.io/v1/namespaces/{ns}/{resource}",
            collection,
        )
        .route(
            "/apis/networking.k8s.io/v1/namespaces/{ns}/{resource}/{name}",
            item,
        )
        .route(
            "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
            get(endpoint_slices),
        )
        .layer(axum::middleware::from_fn_with_state(shared.clone(), record))
        .with_state(shared)
}

/// Notes what each request needs of RBAC (see `ApiServerDouble::api_use`).
async fn record(
    State(shared): State<Arc<Shared>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let uri = request.uri();
    if let Some(used) = super::rbac_of(request.method(), uri.path(), uri.query()) {
        shared
            .api_use
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(used);
    }
    next.run(request).await
}

fn unknown(resource: &str) -> Response {
    answer(
        404,
        status(
            404,
            "NotFound",
            &format!("the server could not find the requested resource ({resource})"),
        ),
    )
}

fn parse(body: &Bytes) -> Result<Value, String> {
    if body.is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_slice(body).map_err(|e| format!("invalid body: {e}"))
}

async fn create(
    State(shared): State<Arc<Shared>>,
    Path((ns, resource)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let Some(kind) = Kind::from_resource(&resource) else {
        return unknown(&resource);
    };
    let mut object = match parse(&body) {
        Ok(o) => o,
        Err(e) => return bad_request(&e),
    };
    let Some(name) = object["metadata"]["name"].as_str().map(str::to_owned) else {
        return answer(422, status(422, "Invalid", "metadata.name: Required value"));
    };
    let key: Key = (kind, ns.clone(), name.clone());
    let (created, admit) = {
        let mut world = lock(&shared.world);
        if world.store.objects.contains_key(&key) {
            let mut body = status(
                409,
                "AlreadyExists",
                &format!("{} \"{name}\" already exists", kind.resource()),
            );
            body["details"] = json!({ "name": name, "kind": kind.resource() });
            return answer(409, body);
        }
        let uid = world.store.new_uid();
        object["apiVersion"] = json!(kind.api_version());
        object["kind"] = json!(kind.name());
        let meta = &mut object["metadata"];
        meta["namespace"] = json!(ns);
        meta["uid"] = json!(uid);
        meta["creationTimestamp"] = json!(k8s_openapi::jiff::Timestamp::now().to_string());
        meta["generation"] = json!(1);
        let mut admit = false;
        match kind {
            Kind::Pod => {
                if world.unschedulable {
                    object["status"] = json!({
                        "phase": "Pending",
                        "conditions": [{
                            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                            "message": "0/1 nodes are available: 1 Insufficient memory.",
                        }],
                    });
                } else {
                    object["spec"]["nodeName"] = json!("double-node");
                    object["status"] = json!({
                        "phase": "Pending",
                        "conditions": [{ "type": "PodScheduled", "status": "True" }],
                    });
                    admit = true;
                }
            }
            Kind::Service => {
                let spec = &mut object["spec"];
                if spec["type"].is_null() {
                    spec["type"] = json!("ClusterIP");
                }
                let ip = spec["clusterIP"]
                    .as_str()
                    .unwrap_or("10.96.0.10")
                    .to_owned();
                spec["clusterIP"] = json!(ip);
                spec["clusterIPs"] = json!([ip]);
                spec["sessionAffinity"] = json!("None");
                spec["ipFamilies"] = json!(["IPv4"]);
            }
            Kind::PersistentVolumeClaim => object["status"] = json!({ "phase": "Bound" }),
            _ => {}
        }
        *world.store.creates.entry(kind).or_default() += 1;
        let created = world.store.put(key.clone(), object, "ADDED");
        (created, admit.then_some(uid))
    };
    if let Some(uid) = admit {
        kubelet::admit(&shared, key, uid);
    }
    answer(201, created)
}

async fn read(
    State(shared): State<Arc<Shared>>,
    Path((ns, resource, name)): Path<(String, String, String)>,
) -> Response {
    let Some(kind) = Kind::from_resource(&resource) else {
        return unknown(&resource);
    };
    match lock(&shared.world)
        .store
        .objects
        .get(&(kind, ns, name.clone()))
    {
        Some(object) => answer(200, object.clone()),
        None => not_found(kind, &name),
    }
}

async fn list_or_watch(
    State(shared): State<Arc<Shared>>,
    Path((ns, resource)): Path<(String, String)>,
    Query(params): Params,
) -> Response {
    let Some(kind) = Kind::from_resource(&resource) else {
        return unknown(&resource);
    };
    let selector = match Selector::parse(params.get("labelSelector").map_or("", String::as_str)) {
        Ok(s) => s,
        Err(e) => return bad_request(&e),
    };
    if matches!(params.get("watch").map(String::as_str), Some("true" | "1")) {
        return watch(shared, kind, ns, selector, &params).await;
    }
    let world = lock(&shared.world);
    let items: Vec<Value> = world
        .store
        .objects
        .iter()
        .filter(|((k, n, _), o)| {
            *k == kind && *n == ns && selector.matches(&o["metadata"]["labels"])
        })
        .map(|(_, o)| o.clone())
        .collect();
    answer(
        200,
        json!({
            "kind": format!("{}List", kind.name()),
            "apiVersion": kind.api_version(),
            "metadata": { "resourceVersion": world.store.rv().to_string() },
            "items": items,
        }),
    )
}

/// EndpointSlices, read-only and listed only: the double makes them from
/// its Services and the kubelet's ports (`endpoints::endpoint_slices`).
async fn endpoint_slices(
    State(shared): State<Arc<Shared>>,
    Path(ns): Path<String>,
    Query(params): Params,
) -> Response {
    if matches!(params.get("watch").map(String::as_str), Some("true" | "1")) {
        return bad_request("the double does not watch endpointslices");
    }
    let selector = match Selector::parse(params.get("labelSelector").map_or("", String::as_str)) {
        Ok(s) => s,
        Err(e) => return bad_request(&e),
    };
    let items = endpoints::endpoint_slices(&shared, &ns, &selector);
    let rv = lock(&shared.world).store.rv().to_string();
    answer(
        200,
        json!({
            "kind": "EndpointSliceList",
            "apiVersion": "discovery.k8s.io/v1",
            "metadata": { "resourceVersion": rv },
            "items": items,
        }),
    )
}

async fn watch(
    shared: Arc<Shared>,
    kind: Kind,
    namespace: String,
    selector: Selector,
    params: &HashMap<String, String>,
) -> Response {
    let since = params
        .get("resourceVersion")
        .filter(|rv| !rv.is_empty() && *rv != "0")
        .map(|rv| rv.parse::<u64>());
    let since = match since {
        Some(Ok(rv)) => Some(rv),
        Some(Err(_)) => return bad_request("invalid resourceVersion"),
        None => None,
    };
    let timeout = params
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .map_or(Duration::from_secs(1800), Duration::from_secs);
    let (sender, receiver) = mpsc::unbounded_channel();
    let watcher = Watcher {
        kind,
        namespace,
        selector,
        sender,
    };
    // While a test holds watches, new ones wait. The hold is read under
    // the world's lock, in the same critical section that registers the
    // watch, and `hold_watches` sets it under that lock too: a watch is
    // either registered before the hold (so a `close_watches` after the
    // hold ends it) or sees the hold and waits. Read before taking the
    // lock, a watch could pass an open gate, lose the CPU, and register
    // after the test's hold and close, as a live watch those never cut.
    let mut gate = shared.gate.subscribe();
    let gone = loop {
        {
            let mut world = lock(&shared.world);
            if !*gate.borrow_and_update() {
                break match world.store.watch(watcher, since) {
                    Ok(()) => None,
                    Err(watcher) => {
                        world.gone_served += 1;
                        // As the API server does: 200, then one ERROR event.
                        let event = json!({
                            "type": "ERROR",
                            "object": status(410, "Expired", &format!(
                                "too old resource version: {} ({})",
                                since.unwrap_or(0),
                                world.store.rv()
                            )),
                        });
                        let _ = watcher.sender.send(event.to_string() + "\n");
                        Some(watcher)
                    }
                };
            }
        }
        // The sender lives in `shared`, so this returns once released.
        let _ = gate.wait_for(|held| !*held).await;
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let cancel = shared.cancel.clone();
    let stream = futures_util::stream::unfold((receiver, gone), move |(mut receiver, gone)| {
        let cancel = cancel.clone();
        async move {
            let line = if gone.is_some() {
                // One event, then the end (the sender goes with `gone`).
                receiver.try_recv().ok()
            } else {
                tokio::select! {
                    _ = cancel.cancelled() => None,
                    () = tokio::time::sleep_until(deadline) => None,
                    line = receiver.recv() => line,
                }
            };
            line.map(|l| (Ok::<_, Infallible>(Bytes::from(l)), (receiver, None)))
        }
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(stream),
    )
        .into_response()
}

async fn replace(
    State(shared): State<Arc<Shared>>,
    Path((ns, resource, name)): Path<(String, String, String)>,
    body: Bytes,
) -> Response {
    let Some(kind) = Kind::from_resource(&resource) else {
        return unknown(&resource);
    };
    let mut object = match parse(&body) {
        Ok(o) => o,
        Err(e) => return bad_request(&e),
    };
    let key: Key = (kind, ns, name.clone());
    let mut world = lock(&shared.world);
    let Some(existing) = world.store.objects.get(&key).cloned() else {
        return not_found(kind, &name);
    };
    let given = object["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default();
    if !given.is_empty() && existing["metadata"]["resourceVersion"] != given {
        return conflict(&format!(
            "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
            kind.resource()
        ));
    }
    for field in [
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "namespace",
    ] {
        object["metadata"][field] = existing["metadata"][field].clone();
    }
    object["apiVersion"] = existing["apiVersion"].clone();
    object["kind"] = existing["kind"].clone();
    object["status"] = existing["status"].clone();
    if kind == Kind::Pod {
        object["spec"]["nodeName"] = existing["spec"]["nodeName"].clone();
    }
    let saved = world.store.put(key.clone(), object, "MODIFIED");
    remove_if_finished(&mut world.store, &key);
    answer(200, saved)
}

async fn patch(
    State(shared): State<Arc<Shared>>,
    Path((ns, resource, name)): Path<(String, String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(kind) = Kind::from_resource(&resource) else {
        return unknown(&resource);
    };
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if !content_type.starts_with("application/merge-patch+json")
        && !content_type.starts_with("application/strategic-merge-patch+json")
    {
        return answer(
            415,
            status(
                415,
                "UnsupportedMediaType",
                "the double takes merge patches only",
            ),
        );
    }
    let mut change = match parse(&body) {
        Ok(o) => o,
        Err(e) => return bad_request(&e),
    };
    let key: Key = (kind, ns, name.clone());
    let mut world = lock(&shared.world);
    let Some(mut object) = world.store.objects.get(&key).cloned() else {
        return not_found(kind, &name);
    };
    if let Some(given) = change["metadata"]["resourceVersion"].as_str()
        && object["metadata"]["resourceVersion"] != given
    {
        return conflict(&format!(
            "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
            kind.resource()
        ));
    }
    if let Some(meta) = change.get_mut("metadata").and_then(Value::as_object_mut) {
        for field in [
            "resourceVersion",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "namespace",
            "name",
        ] {
            meta.remove(field);
        }
    }
    if let Some(map) = change.as_object_mut() {
        // The main resource's patches leave the status alone.
        map.remove("status");
    }
    merge_patch(&mut object, &change);
    let saved = world.store.put(key.clone(), object, "MODIFIED");
    remove_if_finished(&mut world.store, &key);
    answer(200, saved)
}

async fn delete(
    State(shared): State<Arc<Shared>>,
    Path((ns, resource, name)): Path<(String, String, String)>,
    Query(params): Params,
    body: Bytes,
) -> Response {
    let Some(kind) = Kind::from_resource(&resource) else {
        return unknown(&resource);
    };
    let options = match parse(&body) {
        Ok(o) => o,
        Err(e) => return bad_request(&e),
    };
    let key: Key = (kind, ns, name.clone());
    let (answer_body, terminate) = {
        let mut world = lock(&shared.world);
        let Some(mut object) = world.store.objects.get(&key).cloned() else {
            return not_found(kind, &name);
        };
        if world.before_delete.as_ref().is_some_and(|(k, _)| *k == key)
            && let Some((_, patch)) = world.before_delete.take()
        {
            merge_patch(&mut object, &patch);
            object = world.store.put(key.clone(), object, "MODIFIED");
        }
        let pre = &options["preconditions"];
        if let Some(uid) = pre["uid"].as_str()
            && object["metadata"]["uid"] != uid
        {
            return conflict(&format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                object["metadata"]["uid"].as_str().unwrap_or_default()
            ));
        }
        if let Some(rv) = pre["resourceVersion"].as_str()
            && object["metadata"]["resourceVersion"] != rv
        {
            return conflict(&format!(
                "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                object["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap_or_default()
            ));
        }
        let held = object["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        let requested = options["gracePeriodSeconds"].as_u64().or_else(|| {
            params
                .get("gracePeriodSeconds")
                .and_then(|g| g.parse().ok())
        });
        let mut terminate = None;
        let graceful = if kind == Kind::Pod {
            let grace = if pod_ended(&object) || !scheduled(&object) {
                0
            } else {
                requested
                    .or_else(|| object["spec"]["terminationGracePeriodSeconds"].as_u64())
                    .unwrap_or(30)
            };
            let current = object["metadata"]["deletionGracePeriodSeconds"].as_u64();
            let grace = current.map_or(grace, |c| c.min(grace));
            if !pod_ended(&object) && scheduled(&object) {
                terminate = object["metadata"]["uid"]
                    .as_str()
                    .map(|u| (u.to_owned(), grace));
            }
            object["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
            grace > 0 || held
        } else {
            held
        };
        if graceful {
            if !object["metadata"]["deletionTimestamp"].is_string() {
                object["metadata"]["deletionTimestamp"] =
                    json!(k8s_openapi::jiff::Timestamp::now().to_string());
            }
            let saved = world.store.put(key.clone(), object, "MODIFIED");
            (saved, terminate)
        } else {
            world.store.remove(&key);
            (status(200, "", "deleted"), terminate)
        }
    };
    if let Some((uid, grace)) = terminate {
        kubelet::terminate(&shared, &uid, grace);
    }
    answer(200, answer_body)
}

async fn logs(
    State(shared): State<Arc<Shared>>,
    Path((ns, name)): Path<(String, String)>,
    Query(params): Params,
) -> Response {
    let key: Key = (Kind::Pod, ns, name.clone());
    let (uid, notify) = {
        let world = lock(&shared.world);
        let Some(pod) = world.store.objects.get(&key) else {
            return not_found(Kind::Pod, &name);
        };
        let uid = pod["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let started = world
            .runs
            .get(&uid)
            .is_some_and(|r| r.pgid.is_some() || r.log_closed || !r.log.is_empty());
        if !started {
            return bad_request(&format!(
                "container \"main\" in pod \"{name}\" is waiting to start: ContainerCreating"
            ));
        }
        let notify = world.runs.get(&uid).map(|r| r.log_changed.clone());
        (uid, notify)
    };
    let tail: Option<usize> = params.get("tailLines").and_then(|t| t.parse().ok());
    let follow = matches!(params.get("follow").map(String::as_str), Some("true" | "1"));
    let start = {
        let world = lock(&shared.world);
        let len = world.runs.get(&uid).map_or(0, |r| r.log.len());
        tail.map_or(0, |t| len.saturating_sub(t))
    };
    if !follow {
        let world = lock(&shared.world);
        let mut text: String = world
            .runs
            .get(&uid)
            .map(|r| {
                r.log[start.min(r.log.len())..]
                    .iter()
                    .map(|l| format!("{l}\n"))
                    .collect()
            })
            .unwrap_or_default();
        if let Some(limit) = params
            .get("limitBytes")
            .and_then(|l| l.parse::<usize>().ok())
        {
            let mut cut = limit.min(text.len());
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
        }
        return (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain")], text).into_response();
    }
    let Some(notify) = notify else {
        return (StatusCode::OK, "").into_response();
    };
    let cancel = shared.cancel.clone();
    let stream = futures_util::stream::unfold(start, move |next| {
        let (shared, notify, uid, cancel) =
            (shared.clone(), notify.clone(), uid.clone(), cancel.clone());
        async move {
            loop {
                let notified = notify.notified();
                let mut notified = std::pin::pin!(notified);
                notified.as_mut().enable();
                let (lines, closed) = {
                    let world = lock(&shared.world);
                    let run = world.runs.get(&uid)?;
                    let lines: String = run.log[next.min(run.log.len())..]
                        .iter()
                        .map(|l| format!("{l}\n"))
                        .collect();
                    ((lines, run.log.len()), run.log_closed)
                };
                if !lines.0.is_empty() {
                    return Some((Ok::<_, Infallible>(Bytes::from(lines.0)), lines.1));
                }
                if closed {
                    return None;
                }
                tokio::select! {
                    _ = cancel.cancelled() => return None,
                    () = notified => {}
                }
            }
        }
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain")],
        Body::from_stream(stream),
    )
        .into_response()
}
