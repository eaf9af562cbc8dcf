//! Which user a request is for, and where that user's instance listens.
//!
//! Two pieces:
//!
//! * [`Router`] reads the target user out of a request: `/u/<user>/…`, or
//!   `<slug>.<base_domain>` when a base domain is configured. Pure and
//!   synchronous.
//! * [`RouteTable`] maps users to their instance's address. It is fed by
//!   the spawner's [`InstanceEvent`]s ([`RouteTable::follow`]), so a lookup
//!   is a hash probe under a read lock and never a store query.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use berth_core::{Endpoint, InstanceEvent, Reach, Role, Slug, Traffic, UserId};
use bytes::Bytes;
use hyper::header::{HOST, HeaderMap};
use hyper::http::uri::{Authority, PathAndQuery};
use hyper::{Request, Uri};
use tokio::sync::broadcast::error::RecvError;
use tokio_util::sync::CancellationToken;

/// The path prefix of per-user routes.
pub const USER_PREFIX: &str = "/u/";

/// A user and, if their instance is running, where it listens.
#[derive(Debug, Clone)]
pub struct Route {
    /// Whose route this is.
    pub user: Arc<UserId>,
    /// Where their instance listens; `None` while it is not running.
    pub upstream: Option<InstanceAddr>,
}

/// Where a running instance listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceAddr {
    /// `host:port`.
    pub authority: Authority,
    /// How the address must be reached: in which network namespace, and
    /// which account must own the socket.
    pub reach: Reach,
}

impl InstanceAddr {
    /// `endpoint` as the proxy dials it; `None` when its host and port make
    /// no URI authority.
    pub fn of(endpoint: &Endpoint) -> Option<Self> {
        let authority = Authority::from_maybe_shared(Bytes::from(endpoint.authority())).ok()?;
        Some(Self {
            authority,
            reach: endpoint.reach.clone(),
        })
    }
}

#[derive(Default)]
struct Tables {
    /// Keyed by the raw user id so a lookup by `&str` allocates nothing.
    users: HashMap<Box<str>, Route>,
    /// Slugs are one-way (hashed ones cannot be inverted), so host routing
    /// needs this map to find the user.
    slugs: HashMap<Box<str>, Arc<UserId>>,
}

/// The in-memory route table: user → upstream, slug → user.
#[derive(Default)]
pub struct RouteTable {
    tables: RwLock<Tables>,
}

impl std::fmt::Debug for RouteTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteTable").finish_non_exhaustive()
    }
}

impl RouteTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// The route of `user` (the raw, decoded id).
    pub fn lookup(&self, user: &str) -> Option<Route> {
        let tables = self.tables.read().unwrap_or_else(|e| e.into_inner());
        tables.users.get(user).cloned()
    }

    /// The user whose slug is `slug`, if berth has seen them.
    pub fn user_for_slug(&self, slug: &str) -> Option<Arc<UserId>> {
        let tables = self.tables.read().unwrap_or_else(|e| e.into_inner());
        tables.slugs.get(slug).cloned()
    }

    /// Records where `user`'s instance listens (`None`: not reachable).
    pub fn set(&self, user: &UserId, endpoint: Option<&Endpoint>) {
        let upstream = endpoint.and_then(InstanceAddr::of);
        let mut tables = self.tables.write().unwrap_or_else(|e| e.into_inner());
        if let Some(route) = tables.users.get_mut(user.as_str()) {
            route.upstream = upstream;
            return;
        }
        let user = Arc::new(user.clone());
        tables
            .slugs
            .insert(user.slug().as_str().into(), user.clone());
        tables
            .users
            .insert(user.as_str().into(), Route { user, upstream });
    }

    /// Applies one spawner event: only a running, ready main is routable.
    pub fn apply(&self, event: &InstanceEvent) {
        if event.role != Role::Main {
            return;
        }
        let routable = event.status.is_routable() && event.ready;
        self.set(&event.user, event.endpoint.as_ref().filter(|_| routable));
    }

    fn known_users(&self) -> Vec<Arc<UserId>> {
        let tables = self.tables.read().unwrap_or_else(|e| e.into_inner());
        tables.users.values().map(|r| r.user.clone()).collect()
    }

    /// Keeps the table in step with `spawner` until `cancel` fires.
    ///
    /// Subscribes first and then seeds from [`Traffic::list`], so no change
    /// falls between the two; events are applied in order after the seed. A
    /// lagging receiver re-reads every known user's endpoint instead of
    /// trusting a table that missed events.
    pub async fn follow(self: Arc<Self>, spawner: Arc<dyn Traffic>, cancel: CancellationToken) {
        let mut events = spawner.subscribe();
        match spawner.list().await {
            Ok(instances) => {
                for instance in instances.iter().filter(|i| i.role == Role::Main) {
                    self.set(
                        &instance.user,
                        spawner.endpoint_for(&instance.user).as_ref(),
                    );
                }
            }
            Err(e) => tracing::warn!("route table: cannot list instances: {e}"),
        }
        loop {
            let event = tokio::select! {
                () = cancel.cancelled() => return,
                event = events.recv() => event,
            };
            match event {
                Ok(event) => self.apply(&event),
                Err(RecvError::Lagged(missed)) => {
                    tracing::warn!(
                        missed,
                        "route table lagged behind instance events; resyncing"
                    );
                    for user in self.known_users() {
                        self.set(&user, spawner.endpoint_for(&user).as_ref());
                    }
                }
                Err(RecvError::Closed) => return,
            }
        }
    }
}

/// Where a request is going.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Class {
    /// To a user's instance.
    Proxy,
    /// To berth itself (API, health, metrics).
    Fallback,
    /// Refused before routing.
    Reject(RouteError),
}

/// Why a request cannot be routed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No `Host` header.
    #[error("the request has no Host header")]
    MissingHost,
    /// The `Host` header is not a valid `host[:port]`.
    #[error("the Host header is not a valid host[:port]")]
    BadHost,
    /// An absolute-form target (`GET http://alice.example/ HTTP/1.1`)
    /// naming another host than `Host`: which one the client meant cannot
    /// be told, and the two must never route differently.
    #[error("the request target's host differs from the Host header")]
    HostMismatch,
    /// The user segment is not a user id; the text says why.
    #[error("the user segment is malformed: {0}")]
    InvalidUser(&'static str),
    /// No user has this host name.
    #[error("no user has this host name")]
    UnknownHost,
    /// `/u/<user>` without the trailing slash: relative links of the app
    /// would resolve against `/u/`, so the client is sent to `/u/<user>/`.
    #[error("the user's base path needs a trailing slash")]
    AddSlash,
}

/// The target of a proxied request, borrowed from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target<'a> {
    /// `/u/<segment>/<rest…>`; `rest` starts with `/`.
    Path {
        /// The decoded user id.
        user: Cow<'a, str>,
        /// The segment as the request spelled it (percent-encoded).
        segment: &'a str,
        /// The rest of the path, from the `/` after the segment.
        rest: &'a str,
    },
    /// `<label>.<base_domain>`, label lowercased.
    Host {
        /// The label in front of the base domain, lowercased.
        label: Cow<'a, str>,
    },
}

/// Reads targets out of requests and turns them into routes.
#[derive(Debug)]
pub struct Router {
    table: Arc<RouteTable>,
    /// Lowercase, without a leading dot; `None`: host routing is off.
    base_domain: Option<Box<str>>,
    strip_prefix: bool,
    /// Route `/u/<user>/` on any host. Off, `/u/…` is berth's own path
    /// (and answers 404): apps live only on their own hosts.
    path_routing: bool,
}

impl Router {
    /// A router over `table`. `base_domain` turns host routing on (dots
    /// around it and case do not matter; empty means off); `strip_prefix`
    /// removes `/u/<user>` from the path sent upstream; `path_routing` routes
    /// `/u/<user>/` on any host.
    pub fn new(
        table: Arc<RouteTable>,
        base_domain: Option<&str>,
        strip_prefix: bool,
        path_routing: bool,
    ) -> Self {
        let base_domain = base_domain
            .map(|d| d.trim().trim_matches('.').to_ascii_lowercase())
            .filter(|d| !d.is_empty())
            .map(String::into_boxed_str);
        Self {
            table,
            base_domain,
            strip_prefix,
            path_routing,
        }
    }

    /// The route table it looks users up in.
    pub fn table(&self) -> &Arc<RouteTable> {
        &self.table
    }

    /// Proxy, fallback, or reject. Allocates nothing.
    pub fn classify<B>(&self, req: &Request<B>) -> Class {
        match self.target(req.headers(), req.uri()) {
            Ok(Some(_)) => Class::Proxy,
            Ok(None) => Class::Fallback,
            Err(e) => Class::Reject(e),
        }
    }

    /// The target user of a request; `None` for berth's own routes.
    pub fn target<'a>(
        &self,
        headers: &'a HeaderMap,
        uri: &'a Uri,
    ) -> Result<Option<Target<'a>>, RouteError> {
        let host = host_name(headers, uri)?;
        if let Some(base) = &self.base_domain
            && let Some(label) = host_label(host, base)
        {
            return Ok(Some(Target::Host { label }));
        }
        if !self.path_routing {
            return Ok(None);
        }
        let Some(rest) = uri.path().strip_prefix(USER_PREFIX) else {
            return Ok(None);
        };
        let (segment, rest) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => return Err(RouteError::AddSlash),
        };
        Ok(Some(Target::Path {
            user: decode_segment(segment)?,
            segment,
            rest,
        }))
    }

    /// The route of a target: the table's entry, or a fresh one for a user
    /// the table has not seen (not running; the wake layer takes over).
    pub fn resolve(&self, target: &Target<'_>) -> Result<Route, RouteError> {
        let user = match target {
            Target::Path { user, .. } => user.as_ref(),
            Target::Host { label } => match self.table.user_for_slug(label) {
                Some(user) => return Ok(self.route_of(user)),
                // A plain DNS label is its own user's slug.
                None if Slug::is_plain(label) => label.as_ref(),
                None => return Err(RouteError::UnknownHost),
            },
        };
        if let Some(route) = self.table.lookup(user) {
            return Ok(route);
        }
        let user =
            UserId::parse(user).map_err(|_| RouteError::InvalidUser("not a valid user id"))?;
        Ok(Route {
            user: Arc::new(user),
            upstream: None,
        })
    }

    fn route_of(&self, user: Arc<UserId>) -> Route {
        self.table.lookup(user.as_str()).unwrap_or(Route {
            user,
            upstream: None,
        })
    }

    /// The path and query sent upstream: unchanged, or without `/u/<user>`
    /// with `strip_prefix`. `query` replaces the request's own query.
    pub fn upstream_path(
        &self,
        target: &Target<'_>,
        uri: &Uri,
        query: Option<&str>,
    ) -> Option<PathAndQuery> {
        let path = match target {
            Target::Path { rest, .. } if self.strip_prefix => rest,
            _ => {
                if query.is_none() {
                    // The common case: share the request's own bytes.
                    return Some(
                        uri.path_and_query()
                            .cloned()
                            .unwrap_or_else(|| PathAndQuery::from_static("/")),
                    );
                }
                uri.path()
            }
        };
        let query = query.or(uri.query()).filter(|q| !q.is_empty());
        let mut text = String::with_capacity(path.len() + query.map_or(0, |q| q.len() + 1));
        text.push_str(path);
        if let Some(q) = query {
            text.push('?');
            text.push_str(q);
        }
        PathAndQuery::from_maybe_shared(Bytes::from(text)).ok()
    }
}

/// The host name of a request (no port), validated. HTTP/1.1 requires
/// exactly one Host; an HTTP/1.0 request without one is refused too, since
/// routing and `X-Forwarded-Host` depend on it. An absolute-form target
/// must name the same authority as `Host`.
pub fn host_name<'a>(headers: &'a HeaderMap, uri: &'a Uri) -> Result<&'a str, RouteError> {
    let mut values = headers.get_all(HOST).iter();
    let host = match (values.next(), values.next()) {
        (Some(v), None) => {
            let host = std::str::from_utf8(v.as_bytes()).map_err(|_| RouteError::BadHost)?;
            if let Some(authority) = uri.authority()
                && !authority.as_str().eq_ignore_ascii_case(host)
            {
                return Err(RouteError::HostMismatch);
            }
            host
        }
        (Some(_), Some(_)) => return Err(RouteError::BadHost),
        (None, _) => match uri.authority() {
            Some(a) => a.as_str(),
            None => return Err(RouteError::MissingHost),
        },
    };
    split_host(host).ok_or(RouteError::BadHost)
}

/// `host[:port]` → `host`, or `None` if it is not a valid authority without
/// userinfo.
fn split_host(value: &str) -> Option<&str> {
    let (host, port) = if value.starts_with('[') {
        let end = value.find(']')?;
        let literal = &value[1..end];
        let ok = !literal.is_empty()
            && literal
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.');
        if !ok {
            return None;
        }
        let after = &value[end + 1..];
        let port = if after.is_empty() {
            None
        } else {
            Some(after.strip_prefix(':')?)
        };
        (&value[..=end], port)
    } else {
        match value.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (value, None),
        }
    };
    if let Some(port) = port {
        if port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        port.parse::<u16>().ok()?;
    }
    let name_ok = host.starts_with('[')
        || (!host.is_empty()
            && host.len() <= 253
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_')));
    name_ok.then_some(host)
}

/// `alice.berth.example` with base `berth.example` → `alice` (lowercased).
fn host_label<'a>(host: &'a str, base: &str) -> Option<Cow<'a, str>> {
    let host = host.strip_suffix('.').unwrap_or(host);
    let cut = host.len().checked_sub(base.len()).filter(|&c| c > 1)?;
    if !host.is_char_boundary(cut) {
        return None;
    }
    let (label, suffix) = host.split_at(cut);
    let label = label.strip_suffix('.')?;
    if !suffix.eq_ignore_ascii_case(base) || label.is_empty() || label.contains('.') {
        return None;
    }
    Some(if label.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(label.to_ascii_lowercase())
    } else {
        Cow::Borrowed(label)
    })
}

/// Percent-decodes a user segment strictly: `%` must start a two-digit hex
/// escape, and the result must be UTF-8. The proxy and the API both use
/// it, so a segment one accepts the other does too.
pub fn decode_segment(raw: &str) -> Result<Cow<'_, str>, RouteError> {
    if raw.is_empty() {
        return Err(RouteError::InvalidUser("empty user"));
    }
    if !raw.contains('%') {
        return Ok(Cow::Borrowed(raw));
    }
    let bytes = raw.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = |j: usize| bytes.get(j).is_some_and(u8::is_ascii_hexdigit);
            if !(hex(i + 1) && hex(i + 2)) {
                return Err(RouteError::InvalidUser("malformed percent-encoding"));
            }
            i += 3;
        } else {
            i += 1;
        }
    }
    percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .map_err(|_| RouteError::InvalidUser("not UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    fn req(host: Option<&str>, uri: &str) -> Request<()> {
        let mut b = Request::builder().uri(uri);
        if let Some(h) = host {
            b = b.header(HOST, h);
        }
        b.body(()).unwrap()
    }

    fn router(base: Option<&str>, strip: bool) -> Router {
        Router::new(Arc::new(RouteTable::new()), base, strip, true)
    }

    fn ep(port: u16) -> Endpoint {
        Endpoint {
            host: "127.0.0.1".into(),
            port,
            reach: berth_core::Reach::default(),
        }
    }

    fn user(s: &str) -> UserId {
        UserId::parse(s).unwrap()
    }

    #[test]
    fn path_routes() {
        let r = router(None, false);
        let q = req(Some("berth.local:8000"), "/u/alice/lab?x=1");
        let t = r.target(q.headers(), q.uri()).unwrap().unwrap();
        assert_eq!(
            t,
            Target::Path {
                user: "alice".into(),
                segment: "alice",
                rest: "/lab"
            }
        );
        assert_eq!(
            r.upstream_path(&t, q.uri(), None).unwrap(),
            "/u/alice/lab?x=1"
        );
        assert_eq!(r.resolve(&t).unwrap().user.as_str(), "alice");
        assert_eq!(
            r.classify(&req(Some("h"), "/api/v1/instances")),
            Class::Fallback
        );
        assert_eq!(r.classify(&req(Some("h"), "/healthz")), Class::Fallback);
        assert_eq!(r.classify(&req(Some("h"), "/u/bob/")), Class::Proxy);
    }

    #[test]
    fn strip_prefix_removes_the_user_base() {
        let r = router(None, true);
        for (uri, want) in [
            ("/u/alice/", "/"),
            ("/u/alice/a/b?c=d", "/a/b?c=d"),
            ("/u/alice/?q", "/?q"),
        ] {
            let q = req(Some("h"), uri);
            let t = r.target(q.headers(), q.uri()).unwrap().unwrap();
            assert_eq!(r.upstream_path(&t, q.uri(), None).unwrap(), want, "{uri}");
        }
        let q = req(Some("h"), "/u/alice/x?berth_token=t&a=1");
        let t = r.target(q.headers(), q.uri()).unwrap().unwrap();
        assert_eq!(r.upstream_path(&t, q.uri(), Some("a=1")).unwrap(), "/x?a=1");
        assert_eq!(r.upstream_path(&t, q.uri(), Some("")).unwrap(), "/x");
    }

    #[test]
    fn user_segments_are_decoded_strictly() {
        let r = router(None, false);
        let q = req(Some("h"), "/u/a%40b.c/");
        let t = r.target(q.headers(), q.uri()).unwrap().unwrap();
        assert_eq!(r.resolve(&t).unwrap().user.as_str(), "a@b.c");
        for bad in ["/u/%zz/", "/u/a%4/", "/u/%/", "/u/%FF/", "/u//x"] {
            let q = req(Some("h"), bad);
            assert!(
                matches!(
                    r.target(q.headers(), q.uri()),
                    Err(RouteError::InvalidUser(_))
                ),
                "{bad}"
            );
        }
        for bad in ["/u/%2E%2E/", "/u/a%00b/", "/u/a%2Fb/"] {
            let q = req(Some("h"), bad);
            let t = r.target(q.headers(), q.uri()).unwrap().unwrap();
            assert!(
                matches!(r.resolve(&t), Err(RouteError::InvalidUser(_))),
                "{bad}"
            );
        }
        let q = req(Some("h"), "/u/alice");
        assert_eq!(r.target(q.headers(), q.uri()), Err(RouteError::AddSlash));
    }

    #[test]
    fn hosts_are_validated() {
        let r = router(None, false);
        for bad in ["exa mple", "a@b", "h:99999", "h:", "[zz]:80", "", "h:80:80"] {
            let q = req(Some(bad), "/u/alice/");
            assert_eq!(
                r.classify(&q),
                Class::Reject(RouteError::BadHost),
                "{bad:?}"
            );
        }
        for good in ["h", "h:80", "[::1]:8000", "[::1]", "127.0.0.1:1", "a.b-c_d"] {
            assert_eq!(
                r.classify(&req(Some(good), "/u/alice/")),
                Class::Proxy,
                "{good}"
            );
        }
        assert_eq!(
            r.classify(&req(None, "/u/alice/")),
            Class::Reject(RouteError::MissingHost)
        );
        let mut two = req(Some("a"), "/");
        two.headers_mut()
            .append(HOST, HeaderValue::from_static("b"));
        assert_eq!(r.classify(&two), Class::Reject(RouteError::BadHost));
    }

    #[test]
    fn path_routing_can_be_off() {
        let r = Router::new(
            Arc::new(RouteTable::new()),
            Some("berth.example"),
            false,
            false,
        );
        assert_eq!(
            r.classify(&req(Some("berth.example"), "/u/bob/")),
            Class::Fallback,
            "/u/ is berth's own path: apps live on their hosts"
        );
        assert_eq!(
            r.classify(&req(Some("bob.berth.example"), "/")),
            Class::Proxy
        );
        assert_eq!(
            r.classify(&req(Some("bob.berth.example"), "/u/alice/")),
            Class::Proxy,
            "on bob's host every path is bob's"
        );
        let q = req(Some("h"), "/u/a%40b/x");
        let on = router(None, false);
        match on.target(q.headers(), q.uri()).unwrap().unwrap() {
            Target::Path { user, segment, .. } => assert_eq!((&*user, segment), ("a@b", "a%40b")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn absolute_form_targets_must_name_the_host() {
        let r = router(Some("berth.example"), false);
        let q = req(Some("bob.berth.example"), "http://alice.berth.example/");
        assert_eq!(r.classify(&q), Class::Reject(RouteError::HostMismatch));
        let q = req(Some("bob.berth.example:80"), "http://bob.berth.example/");
        assert_eq!(
            r.classify(&q),
            Class::Reject(RouteError::HostMismatch),
            "the port is part of the authority"
        );
        let q = req(Some("Bob.Berth.Example"), "http://bob.berth.example/x");
        assert_eq!(r.classify(&q), Class::Proxy);
        let q = req(None, "http://bob.berth.example/x");
        assert_eq!(
            r.classify(&q),
            Class::Proxy,
            "no Host: the target's authority"
        );
    }

    #[test]
    fn host_routes() {
        let r = router(Some("Berth.Example"), false);
        let q = req(Some("Alice.berth.example:8443"), "/lab");
        let t = r.target(q.headers(), q.uri()).unwrap().unwrap();
        assert_eq!(
            t,
            Target::Host {
                label: "alice".into()
            }
        );
        assert_eq!(r.resolve(&t).unwrap().user.as_str(), "alice");
        assert_eq!(r.upstream_path(&t, q.uri(), None).unwrap(), "/lab");
        // The base domain itself and deeper names are berth's own.
        assert_eq!(
            r.classify(&req(Some("berth.example"), "/healthz")),
            Class::Fallback
        );
        assert_eq!(
            r.classify(&req(Some("a.b.berth.example"), "/")),
            Class::Fallback
        );
        assert_eq!(
            r.classify(&req(Some("xberth.example"), "/")),
            Class::Fallback
        );
        // Hashed slugs are found once the table has seen their user.
        let odd = user("A.B@corp.example");
        let slug = odd.slug();
        let host = format!("{slug}.berth.example");
        let q = req(Some(&host), "/");
        let t = r.target(q.headers(), q.uri()).unwrap().unwrap();
        assert_eq!(r.resolve(&t).unwrap_err(), RouteError::UnknownHost);
        r.table().set(&odd, Some(&ep(4000)));
        let route = r.resolve(&t).unwrap();
        assert_eq!(route.user.as_str(), "A.B@corp.example");
        assert_eq!(route.upstream.unwrap().authority, "127.0.0.1:4000");
    }

    #[test]
    fn non_ascii_hosts_never_panic() {
        for host in [
            "é.berth.example",
            "éberth.example",
            "ééééééééééééééé",
            "aé",
            "é",
        ] {
            let label = host_label(host, "berth.example");
            assert!(
                label.as_deref().is_none_or(|l| l == "é"),
                "{host}: {label:?}"
            );
        }
    }

    #[test]
    fn the_table_follows_events() {
        use berth_core::InstanceStatus;
        let table = RouteTable::new();
        let alice = user("alice");
        let event = |status, ready, port: Option<u16>| InstanceEvent {
            user: alice.clone(),
            role: Role::Main,
            status,
            ready,
            endpoint: port.map(ep),
            message: None,
            stage: berth_core::Stage::of(status, ready),
        };
        table.apply(&event(InstanceStatus::Starting, false, Some(1)));
        assert_eq!(table.lookup("alice").unwrap().upstream, None);
        table.apply(&event(InstanceStatus::Running, true, Some(2)));
        assert_eq!(
            table.lookup("alice").unwrap().upstream.unwrap().authority,
            "127.0.0.1:2"
        );
        table.apply(&event(InstanceStatus::Crashed, false, None));
        assert_eq!(table.lookup("alice").unwrap().upstream, None);
        table.apply(&event(InstanceStatus::Running, true, Some(3)));
        assert_eq!(
            table.lookup("alice").unwrap().upstream.unwrap().authority,
            "127.0.0.1:3"
        );
        // A hibernated main keeps its route: the forwarder resumes it.
        table.apply(&event(InstanceStatus::Hibernated, true, Some(3)));
        assert_eq!(
            table.lookup("alice").unwrap().upstream.unwrap().authority,
            "127.0.0.1:3"
        );
        let mut watchdog = event(InstanceStatus::Running, true, Some(9));
        watchdog.role = Role::Watchdog;
        table.apply(&watchdog);
        assert_eq!(
            table.lookup("alice").unwrap().upstream.unwrap().authority,
            "127.0.0.1:3"
        );
        table.apply(&event(InstanceStatus::Stopped, false, None));
        assert_eq!(table.lookup("alice").unwrap().upstream, None);
        assert!(table.lookup("bob").is_none());
        let v6 = Endpoint {
            host: "::1".into(),
            port: 5,
            reach: berth_core::Reach::default(),
        };
        assert_eq!(InstanceAddr::of(&v6).unwrap().authority, "[::1]:5");
        // The account that must own the socket travels with the address.
        let owned = Endpoint {
            reach: Reach {
                owner: Some(61000),
                netns: None,
            },
            ..ep(6)
        };
        table.set(&alice, Some(&owned));
        assert_eq!(
            table.lookup("alice").unwrap().upstream.unwrap().reach.owner,
            Some(61000)
        );
    }
}
