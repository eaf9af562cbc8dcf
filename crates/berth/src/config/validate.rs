//! Everything parsing cannot check: addresses, ranges, choices and
//! combinations, each refusal naming its key and where it was set.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::error::ConfigError;
use super::sections::{Config, HookConfig};

impl Config {
    /// Whether pods run a command beside the program: with berth's shim
    /// as their entrypoint (`[kubernetes.shim]`).
    fn pods_run_commands(&self) -> bool {
        #[cfg(feature = "kubernetes")]
        {
            self.kubernetes.as_ref().is_some_and(|k| k.shim.is_some())
        }
        #[cfg(not(feature = "kubernetes"))]
        {
            false
        }
    }

    /// Checks everything that parsing cannot: addresses, ranges, choices and
    /// combinations. Reports the first problem.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.listen_addr()?;
        if self.data_dir.as_os_str().is_empty() {
            return Err(self.invalid("data_dir", "must not be empty"));
        }
        if let Some(store) = &self.store
            && !(store.starts_with("sqlite:")
                || store.starts_with("postgres://")
                || store.starts_with("postgresql://"))
        {
            // The value is not echoed: it may carry a password.
            return Err(self.invalid("store", "must be a sqlite:// or postgres:// URL"));
        }
        self.refuse_password_on_command_line()?;
        if let Some(id) = &self.node_id
            && (id.is_empty() || id.chars().any(|c| c.is_whitespace() || c.is_control()))
        {
            return Err(self.invalid(
                "node_id",
                format!("{id:?} must be non-empty, without spaces or control characters"),
            ));
        }
        if let Some(url) = &self.advertise_url {
            let ok = reqwest::Url::parse(url)
                .is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some());
            if !ok {
                return Err(self.invalid(
                    "advertise_url",
                    format!("{url:?} is not an http:// or https:// URL"),
                ));
            }
        }
        if let Some(secret) = &self.cluster_secret
            && let Err(why) = check_cluster_secret(secret)
        {
            return Err(self.invalid("cluster_secret", why));
        }
        if self.is_postgres() && self.cluster_secret.is_none() {
            return Err(self.invalid(
                "cluster_secret",
                "required when the store is PostgreSQL (cluster mode): nodes authenticate each other with it; set cluster_secret or BERTH_CLUSTER_SECRET",
            ));
        }
        if let Some(token) = &self.admin_token
            && (token.is_empty() || token.chars().any(|c| c.is_whitespace() || c.is_control()))
        {
            return Err(self.invalid(
                "admin_token",
                "must be non-empty, without spaces or control characters",
            ));
        }
        if !matches!(self.log_format.as_str(), "text" | "json") {
            return Err(self.invalid(
                "log_format",
                format!(
                    "{:?} is not a log format (expected \"text\" or \"json\")",
                    self.log_format
                ),
            ));
        }
        self.validate_instance()?;
        if let Some(command) = &self.watchdog.command {
            self.check_command("watchdog.command", command)?;
        }
        self.validate_policies()?;
        self.validate_proxy()?;
        self.validate_metrics()?;
        self.validate_cluster()?;
        // The local runtime's table is checked on every host, so that a
        // config that later loses its `[kubernetes]` table still works.
        self.runtime_config(vec!["berth".to_owned(), "shim".to_owned()])?;
        if let Some(_k8s) = &self.kubernetes {
            #[cfg(feature = "kubernetes")]
            {
                // A pod's NetworkPolicy knows addresses, not names: names
                // need the egress proxy for pods.
                if let Some(name) = self.isolation.egress_allow.iter().find(|d| d.is_domain())
                    && _k8s.network.egress_proxy.is_none()
                {
                    return Err(self.invalid(
                        "isolation.egress_allow",
                        format!(
                            "{name} is a domain name: pods reach one only through berth's egress \
                             proxy, so set kubernetes.network.egress_proxy (their NetworkPolicy \
                             knows addresses, not names)"
                        ),
                    ));
                }
                // Needs no node id: a placeholder stands in for the host name.
                self.k8s_runtime_config("node")?;
            }
            #[cfg(not(feature = "kubernetes"))]
            return Err(self.invalid(
                "kubernetes",
                "this berth was built without Kubernetes support (cargo feature `kubernetes`)",
            ));
        }
        // Last: the store crate's own checks of the lease timing.
        self.lease_config()?;
        Ok(())
    }

    /// The node-to-node listener: an address of its own, which other nodes
    /// can be told.
    fn validate_cluster(&self) -> Result<(), ConfigError> {
        let addr = self.internal_listen_addr()?;
        if let Some(url) = &self.cluster.internal_advertise_url {
            let ok = reqwest::Url::parse(url).is_ok_and(|u| {
                u.scheme() == "http" && u.host().is_some() && matches!(u.path(), "" | "/")
            });
            if !ok {
                return Err(self.invalid(
                    "cluster.internal_advertise_url",
                    format!("{url:?} is not an http://host:port URL without a path"),
                ));
            }
        } else if addr.ip().is_unspecified() {
            return Err(self.invalid(
                "cluster.internal_listen",
                format!(
                    "{addr} listens on every address, so other nodes cannot be told which one \
                     reaches this node: name this host's address on the nodes' private network \
                     (e.g. \"10.0.0.5:8001\"), or set cluster.internal_advertise_url"
                ),
            ));
        }
        let clash = |key: &str, other: std::net::SocketAddr| {
            (addr.port() != 0 && addr == other).then(|| {
                self.invalid(
                    "cluster.internal_listen",
                    format!(
                        "{addr} is also {key}: node-to-node calls get a listener of their own, \
                         never the public one"
                    ),
                )
            })
        };
        if let Some(e) = clash("listen", self.listen_addr()?) {
            return Err(e);
        }
        if let Some(other) = self.metrics.listen.as_deref().and_then(|l| l.parse().ok())
            && let Some(e) = clash("metrics.listen", other)
        {
            return Err(e);
        }
        Ok(())
    }

    fn validate_metrics(&self) -> Result<(), ConfigError> {
        let m = &self.metrics;
        if let Some(token) = &m.token {
            if berth_proxy::auth::SharedSecret::new(token).is_err() {
                return Err(self.invalid(
                    "metrics.token",
                    "must be visible ASCII without spaces (it is sent as a Bearer token)",
                ));
            }
            if self.admin_token.as_deref() == Some(token.trim()) {
                return Err(self.invalid(
                    "metrics.token",
                    "must differ from the admin token: it is the scraper's, and opens only /metrics",
                ));
            }
        }
        if let Some(listen) = &m.listen {
            let Ok(addr) = listen.parse::<std::net::SocketAddr>() else {
                return Err(self.invalid(
                    "metrics.listen",
                    format!(
                        "{listen:?} is not a socket address (expected e.g. \"127.0.0.1:9464\")"
                    ),
                ));
            };
            if addr.port() != 0 && self.listen_addr().is_ok_and(|main| main == addr) {
                return Err(self.invalid(
                    "metrics.listen",
                    format!("{listen:?} is the main listen address; give /metrics its own"),
                ));
            }
        }
        Ok(())
    }

    fn validate_instance(&self) -> Result<(), ConfigError> {
        let i = &self.instance;
        if let Some(command) = &i.command {
            self.check_command("instance.command", command)?;
        }
        if let Some(command) = &i.on_breaker_open {
            self.check_command("instance.on_breaker_open", command)?;
        }
        for (key, hook) in [
            ("instance.pre_hibernate", &i.pre_hibernate),
            ("instance.pre_stop", &i.pre_stop),
        ] {
            match hook {
                Some(HookConfig::Command(_))
                    if self.kubernetes.is_some() && !self.pods_run_commands() =>
                {
                    return Err(self.invalid(
                        key,
                        "a command hook runs beside the program, which the kubernetes runtime \
                         can do only with [kubernetes.shim]; set it, or give a path on the \
                         instance (an HTTP hook) instead",
                    ));
                }
                Some(HookConfig::Command(command)) => self.check_command(key, command)?,
                Some(HookConfig::Http(path))
                    if !path.starts_with('/') || path.contains(['\r', '\n', ' ']) =>
                {
                    return Err(self.invalid(
                        key,
                        format!("{path:?} is neither a command (a list) nor a path on the instance (starting with /)"),
                    ));
                }
                _ => {}
            }
        }
        if i.hook_grace_s == 0 {
            return Err(self.invalid("instance.hook_grace_s", "must be at least 1"));
        }
        for (name, value) in &i.env {
            if name.is_empty() || name.contains('=') || name.contains('\0') {
                return Err(self.invalid(
                    &format!("instance.env.{name}"),
                    format!("{name:?} is not a valid environment variable name"),
                ));
            }
            if value.contains('\0') {
                return Err(self.invalid(
                    &format!("instance.env.{name}"),
                    "the value contains a NUL byte",
                ));
            }
        }
        if let Some(name) = i
            .env_allowlist
            .iter()
            .find(|n| n.is_empty() || n.contains('=') || n.contains('\0'))
        {
            return Err(self.invalid(
                "instance.env_allowlist",
                format!("{name:?} is not a valid environment variable name"),
            ));
        }
        let readiness_given = [
            i.ready_token_regex.is_some(),
            i.ready_http_path.is_some(),
            i.ready_tcp,
        ];
        if readiness_given.iter().filter(|&&b| b).count() > 1 {
            let key = if i.ready_token_regex.is_some() {
                "instance.ready_token_regex"
            } else {
                "instance.ready_http_path"
            };
            return Err(self.invalid(
                key,
                "set at most one of ready_token_regex, ready_http_path and ready_tcp",
            ));
        }
        let ready_regex = match &i.ready_token_regex {
            Some(pattern) => Some(self.compile_ready_regex(pattern)?),
            None => None,
        };
        if let Some(text) = &i.credential_header {
            berth_proxy::credential::CredentialHeader::parse(text)
                .map_err(|e| self.invalid("instance.credential_header", e.to_string()))?;
            match ready_regex {
                None => {
                    return Err(self.invalid(
                        "instance.credential_header",
                        "needs instance.ready_token_regex: the launch token it presents is the \
                         one that regex captures",
                    ));
                }
                // The token is the first group (berth_core::program).
                Some(regex) if regex.captures_len() < 2 => {
                    return Err(self.invalid(
                        "instance.ready_token_regex",
                        "captures no launch token for instance.credential_header: put the \
                         token in a group, as in 'token=([A-Za-z0-9_-]+)'",
                    ));
                }
                Some(_) => {}
            }
        }
        if let Some(path) = &i.ready_http_path
            && !path.starts_with('/')
        {
            return Err(self.invalid(
                "instance.ready_http_path",
                format!("{path:?} must start with '/'"),
            ));
        }
        if i.ready_timeout_s == 0 {
            return Err(self.invalid("instance.ready_timeout_s", "must be at least 1"));
        }
        if i.patch_ext.is_empty()
            || i.patch_ext.starts_with('.')
            || !i
                .patch_ext
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
        {
            return Err(self.invalid(
                "instance.patch_ext",
                format!(
                    "{:?} is not a file extension (letters, digits, '.', '-', '_'; no leading dot)",
                    i.patch_ext
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn check_command(&self, key: &str, command: &[String]) -> Result<(), ConfigError> {
        match command.first() {
            None => Err(self.invalid(key, "must name a program (the list is empty)")),
            Some(program) if program.is_empty() => {
                Err(self.invalid(key, "the program name is empty"))
            }
            Some(_) if command.iter().any(|a| a.contains('\0')) => {
                Err(self.invalid(key, "an argument contains a NUL byte"))
            }
            Some(_) => Ok(()),
        }
    }

    fn validate_policies(&self) -> Result<(), ConfigError> {
        let c = &self.crash;
        if c.backoff_base_ms > c.backoff_max_ms {
            return Err(self.invalid(
                "crash.backoff_base_ms",
                format!(
                    "{} exceeds crash.backoff_max_ms ({})",
                    c.backoff_base_ms, c.backoff_max_ms
                ),
            ));
        }
        if c.window_s == 0 {
            return Err(self.invalid("crash.window_s", "must be at least 1"));
        }
        if c.cooldown_s > c.max_cooldown_s {
            return Err(self.invalid(
                "crash.cooldown_s",
                format!(
                    "{} exceeds crash.max_cooldown_s ({})",
                    c.cooldown_s, c.max_cooldown_s
                ),
            ));
        }
        if self.reap.interval_s == 0 {
            return Err(self.invalid("reap.interval_s", "must be at least 1"));
        }
        self.check_lease_numbers()
    }

    /// The lease invariants ([`Config::lease_config`]), refused naming
    /// the key and its line.
    pub(super) fn check_lease_numbers(&self) -> Result<(), ConfigError> {
        self.lease_config().map(drop)
    }

    fn validate_proxy(&self) -> Result<(), ConfigError> {
        let p = &self.proxy;
        let domain = &p.base_domain;
        if !domain.is_empty()
            && (domain.starts_with('.')
                || domain.ends_with('.')
                || !domain
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-')))
        {
            return Err(self.invalid(
                "proxy.base_domain",
                format!("{domain:?} is not a DNS name (e.g. \"berth.example.com\")"),
            ));
        }
        match p.auth.as_str() {
            "token" => {}
            "header" if p.trusted_proxies.is_empty() => {
                return Err(self.invalid(
                    "proxy.trusted_proxies",
                    "auth = \"header\" needs the addresses of the trusted proxies, or every request is refused",
                ));
            }
            "header" => {}
            other => {
                return Err(self.invalid(
                    "proxy.auth",
                    format!("{other:?} is not an auth mode (expected \"token\" or \"header\")"),
                ));
            }
        }
        if let Some(bad) = p.trusted_proxies.iter().find(|a| !is_ip_or_cidr(a)) {
            return Err(self.invalid(
                "proxy.trusted_proxies",
                format!("{bad:?} is not an IP address or CIDR block"),
            ));
        }
        // Every instance berth runs on this host can connect from loopback:
        // trusting it without the SSO proxy's secret lets any of them name
        // any user.
        if p.auth == "header"
            && p.header_secret.is_none()
            && let Some(entry) = p.trusted_proxies.iter().find(|a| covers_loopback(a))
        {
            return Err(self.invalid(
                "proxy.trusted_proxies",
                format!(
                    "{entry:?} covers loopback, from where every program berth runs can connect: \
                     with auth = \"header\" and no proxy.header_secret, any of them could name any \
                     user in X-Forwarded-User; set proxy.header_secret (your SSO proxy sends it as \
                     X-Berth-Proxy-Secret), or trust only the proxy's own non-loopback address"
                ),
            ));
        }
        match p.path_routing.as_str() {
            "auto" | "on" => {}
            "off" if domain.is_empty() => {
                return Err(self.invalid(
                    "proxy.path_routing",
                    "\"off\" needs a base_domain: without one, no app could be reached",
                ));
            }
            "off" => {}
            other => {
                return Err(self.invalid(
                    "proxy.path_routing",
                    format!("{other:?} is not a choice (expected \"auto\", \"on\" or \"off\")"),
                ));
            }
        }
        for (key, value) in [
            ("proxy.max_connections", p.max_connections),
            ("proxy.max_connections_per_ip", p.max_connections_per_ip),
            ("proxy.max_upgrades", p.max_upgrades),
            ("proxy.max_upgrades_per_user", p.max_upgrades_per_user),
        ] {
            if value == 0 {
                return Err(self.invalid(key, "must be at least 1 (0 would refuse everything)"));
            }
        }
        if p.max_connections_per_ip > p.max_connections {
            return Err(self.invalid(
                "proxy.max_connections_per_ip",
                format!(
                    "{} is more than max_connections ({})",
                    p.max_connections_per_ip, p.max_connections
                ),
            ));
        }
        if let Some(secret) = &p.header_secret {
            if p.auth != "header" {
                return Err(
                    self.invalid("proxy.header_secret", "is used only with auth = \"header\"")
                );
            }
            if berth_proxy::auth::SharedSecret::new(secret).is_err() {
                return Err(self.invalid(
                    "proxy.header_secret",
                    "must be visible ASCII without spaces (it is sent as an HTTP header)",
                ));
            }
        }
        self.validate_auth()
    }

    fn validate_auth(&self) -> Result<(), ConfigError> {
        let a = &self.auth;
        if a.user_token_ttl_s == 0 {
            return Err(self.invalid("auth.user_token_ttl_s", "must be at least 1"));
        }
        // The store caps every TTL at ten years.
        if a.user_token_ttl_s > 10 * 365 * 24 * 3600 {
            return Err(self.invalid("auth.user_token_ttl_s", "must be at most ten years"));
        }
        if a.max_tokens_per_user == 0 {
            return Err(self.invalid("auth.max_tokens_per_user", "must be at least 1"));
        }
        if a.token_cache_s > 3600 {
            return Err(self.invalid(
                "auth.token_cache_s",
                "must be at most 3600: it bounds how long a revoked token may still work on a node the revocation could not reach",
            ));
        }
        if a.session_ttl_s == 0 || a.session_ttl_s > 30 * 24 * 3600 {
            return Err(self.invalid(
                "auth.session_ttl_s",
                "must be between 1 and 2592000 (30 days)",
            ));
        }
        if let Some(oidc) = &a.oidc {
            self.validate_oidc(oidc)?;
        }
        Ok(())
    }

    fn validate_oidc(&self, o: &super::sections::OidcSection) -> Result<(), ConfigError> {
        let web_url = |key: &str, text: &str| -> Result<reqwest::Url, ConfigError> {
            let url = reqwest::Url::parse(text)
                .map_err(|e| self.invalid(key, format!("{text:?} is not a URL: {e}")))?;
            if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
                return Err(self.invalid(key, format!("{text:?} must be an http(s) URL")));
            }
            Ok(url)
        };
        web_url("auth.oidc.issuer", &o.issuer)?;
        if o.client_id.is_empty() {
            return Err(self.invalid("auth.oidc.client_id", "must be set"));
        }
        if !o.scopes.iter().any(|s| s == "openid") {
            return Err(self.invalid("auth.oidc.scopes", "must include \"openid\""));
        }
        if !super::oidc::user_claim_supported(&o.user_claim) {
            return Err(self.invalid(
                "auth.oidc.user_claim",
                format!(
                    "{:?} is a standard claim berth does not read as a user id; use sub, email, \
                     preferred_username, or a claim of your provider's own",
                    o.user_claim
                ),
            ));
        }
        if o.allowed_users.is_empty() && o.allowed_groups.is_empty() && !o.allow_any_user {
            return Err(self.invalid(
                "auth.oidc.allowed_users",
                "nobody may sign in: list allowed_users or allowed_groups, or set \
                 allow_any_user = true to let everyone the provider knows in",
            ));
        }
        if let Some(bad) = o
            .allowed_users
            .iter()
            .find(|u| berth_core::UserId::parse(u).is_err())
        {
            return Err(self.invalid(
                "auth.oidc.allowed_users",
                format!("{bad:?} is not a valid user id"),
            ));
        }
        if let Some(url) = &o.redirect_url {
            let url = web_url("auth.oidc.redirect_url", url)?;
            if url.path() != super::oidc::CALLBACK_PATH {
                return Err(self.invalid(
                    "auth.oidc.redirect_url",
                    format!(
                        "must be the berth host's {} (the path berth serves the callback on)",
                        super::oidc::CALLBACK_PATH
                    ),
                ));
            }
        }
        if o.clock_skew_s > 600 {
            return Err(self.invalid("auth.oidc.clock_skew_s", "must be at most 600"));
        }
        Ok(())
    }
}

/// The shortest cluster secret accepted, in characters.
pub const MIN_CLUSTER_SECRET_CHARS: usize = 32;
/// The fewest distinct characters a cluster secret may have: a word
/// repeated to length (`change-me-change-me-…`) has few.
const MIN_CLUSTER_SECRET_DISTINCT: usize = 12;
/// The least entropy (bits) a cluster secret may show, estimated as its
/// length times the Shannon entropy of its characters' frequencies. A
/// generated one is well above it: 32 hex digits show about 110 bits, 64
/// about 240, 44 base64 characters about 210.
const MIN_CLUSTER_SECRET_BITS: f64 = 96.0;

/// Why `secret` is too weak to guard the node-to-node API, which can run
/// and stop any user's instance: anyone who guesses it is a node.
fn check_cluster_secret(secret: &str) -> Result<(), String> {
    const HOW: &str = "make one with `openssl rand -hex 32` or `head -c32 /dev/urandom | base64`";
    let secret = secret.trim();
    if berth_proxy::auth::SharedSecret::new(secret).is_err() {
        return Err(format!(
            "must be visible ASCII without spaces (it is sent as an HTTP header); {HOW}"
        ));
    }
    let chars = secret.chars().count();
    if chars < MIN_CLUSTER_SECRET_CHARS {
        return Err(format!(
            "is {chars} characters long; a cluster secret needs at least \
             {MIN_CLUSTER_SECRET_CHARS}: {HOW}"
        ));
    }
    let mut counts = std::collections::BTreeMap::<char, usize>::new();
    for c in secret.chars() {
        *counts.entry(c).or_default() += 1;
    }
    let len = chars as f64;
    let bits: f64 = counts
        .values()
        .map(|&n| {
            let p = n as f64 / len;
            -p * p.log2() * len
        })
        .sum();
    if counts.len() < MIN_CLUSTER_SECRET_DISTINCT || bits < MIN_CLUSTER_SECRET_BITS {
        return Err(format!(
            "is too predictable ({} distinct characters, about {bits:.0} bits); a cluster \
             secret needs at least {MIN_CLUSTER_SECRET_DISTINCT} distinct characters and \
             {MIN_CLUSTER_SECRET_BITS:.0} bits: {HOW}",
            counts.len()
        ));
    }
    Ok(())
}

/// The proxy's own parser (`ipnet`), so that config check and start-up
/// agree on what a `trusted_proxies` entry is.
fn is_ip_or_cidr(s: &str) -> bool {
    berth_proxy::auth::TrustedProxies::parse(&[s]).is_ok()
}

/// Whether a `trusted_proxies` entry (already checked by
/// [`is_ip_or_cidr`]) shares any address with loopback: `127.0.0.0/8`,
/// `::1`, or IPv4-mapped loopback. Any overlap counts, since a local
/// program may bind any loopback address as its source.
fn covers_loopback(entry: &str) -> bool {
    let entry = entry.trim();
    let Some(net) = entry
        .parse::<ipnet::IpNet>()
        .ok()
        .or_else(|| entry.parse::<IpAddr>().ok().map(ipnet::IpNet::from))
    else {
        return false;
    };
    // Constants: `new_assert` cannot fail on these prefix lengths.
    const LOOPBACK: [ipnet::IpNet; 3] = [
        ipnet::IpNet::V4(ipnet::Ipv4Net::new_assert(Ipv4Addr::LOCALHOST, 8)),
        ipnet::IpNet::V6(ipnet::Ipv6Net::new_assert(Ipv6Addr::LOCALHOST, 128)),
        ipnet::IpNet::V6(ipnet::Ipv6Net::new_assert(
            Ipv4Addr::LOCALHOST.to_ipv6_mapped(),
            104,
        )),
    ];
    LOOPBACK
        .iter()
        .any(|lo| net.contains(&lo.network()) || lo.contains(&net.network()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Overrides;
    use crate::config::test_support::parse;

    #[test]
    fn a_loopback_node_to_node_listener_is_warned_about_only_when_other_hosts_need_it() {
        let warned = |text: &str| parse(text).unwrap().internal_listener_warning();
        // The default, on one host: nothing to say.
        assert_eq!(warned(""), None);
        assert_eq!(warned("advertise_url = \"http://127.0.0.1:8000\"\n"), None);
        assert_eq!(warned("advertise_url = \"http://localhost:8000\"\n"), None);
        assert_eq!(warned("advertise_url = \"http://[::1]:8000\"\n"), None);
        // Advertised to other hosts, but node-to-node calls on loopback.
        let why = warned("advertise_url = \"http://10.0.0.5:8000\"\n").unwrap();
        assert!(why.contains("[cluster] internal_listen"), "{why}");
        assert!(why.contains("127.0.0.1:0"), "{why}");
        // Either a private address or an advertised one settles it.
        for text in [
            "advertise_url = \"http://10.0.0.5:8000\"\n[cluster]\ninternal_listen = \"10.0.0.5:8001\"\n",
            "advertise_url = \"http://10.0.0.5:8000\"\n[cluster]\ninternal_advertise_url = \"http://10.0.0.5:9001\"\n",
        ] {
            assert_eq!(warned(text), None, "{text}");
        }
    }

    #[test]
    fn validate_names_key_and_line() {
        let c = parse("[instance]\nlog_max_bytes = 1000\n").unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(
            msg.contains("instance.log_max_bytes") && msg.contains("131072"),
            "{msg}"
        );
        let c = parse("# x\n[instance]\nport_range = [30000, 20000]\n").unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("instance.port_range"), "{msg}");
        assert!(msg.contains("line 3"), "{msg}");

        let c = parse("listen = \"nowhere\"\n").unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("listen") && msg.contains("line 1"), "{msg}");
    }

    #[test]
    fn validate_names_the_flag_that_set_a_value() {
        let mut c = parse("listen = \"127.0.0.1:1\"\n").unwrap();
        c.apply_overrides(&Overrides {
            listen: Some("bad".into()),
            ..Overrides::default()
        });
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("--listen"), "{msg}");
        assert!(!msg.contains("line 1"), "{msg}");
    }

    #[test]
    fn readiness_settings_are_exclusive() {
        let c =
            parse("[instance]\nready_token_regex = 'x(.*)'\nready_http_path = \"/\"\n").unwrap();
        assert!(c.validate().is_err());
        let c = parse("[instance]\nready_token_regex = 'x(('\n").unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("ready_token_regex"), "{msg}");
    }

    #[cfg(not(feature = "kubernetes"))]
    #[test]
    fn without_kubernetes_support_a_kubernetes_table_is_refused_by_name() {
        let c = parse("[kubernetes]\nimage = \"app:1\"\n").unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("kubernetes"), "{msg}");
        assert!(msg.contains("built without Kubernetes support"), "{msg}");
        parse("").unwrap().validate().unwrap();
    }

    #[cfg(feature = "kubernetes")]
    #[test]
    fn pods_take_an_egress_policy_of_networks_and_refuse_a_domain_name() {
        let pods = "[kubernetes]\nimage = \"app:1\"\ncommand = [\"app\"]\n";
        // At level `none` too: berth in a pod runs as no root, and the
        // policy is the pods', not this host's.
        for isolation in [
            "egress = \"deny_all\"",
            "mode = \"none\"\negress = \"deny_all\"",
            "egress = \"allowlist\"\negress_allow = [\"10.8.0.0/24\", \"10.9.0.5:5432\"]",
        ] {
            let c = parse(&format!("[isolation]\n{isolation}\n{pods}")).unwrap();
            c.validate().unwrap();
        }
        let named = "egress = \"allowlist\"\negress_allow = [\"10.8.0.0/24\", \"pypi.org\"]";
        let c = parse(&format!("[isolation]\n{named}\n{pods}")).unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(
            msg.contains("isolation.egress_allow") && msg.contains("pypi.org is a domain name"),
            "{msg}"
        );
        // Through the egress proxy for pods, which needs the cluster secret.
        let proxy = "[kubernetes.network]\negress_proxy = \"berth-egress.berth.svc:3128\"\n";
        let c = parse(&format!("[isolation]\n{named}\n{pods}{proxy}")).unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(
            msg.contains("kubernetes.network.egress_proxy") && msg.contains("cluster_secret"),
            "{msg}"
        );
        let secret = "cluster_secret = \"9f2c4e8a1b7d3f6e0a5c9b2d8e4f1a7c\"\n";
        let c = parse(&format!("{secret}[isolation]\n{named}\n{pods}{proxy}")).unwrap();
        c.validate().unwrap();
        let bad = proxy.replace(":3128", "");
        let c = parse(&format!("{secret}[isolation]\n{named}\n{pods}{bad}")).unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("is not host:port"), "{msg}");
    }

    #[cfg(feature = "kubernetes")]
    #[test]
    fn a_command_hook_is_refused_where_pods_run_the_program() {
        let pods = "[kubernetes]\nimage = \"app:1\"\n";
        let c = parse(&format!("[instance]\npre_stop = [\"flush\"]\n{pods}")).unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("instance.pre_stop"), "{msg}");
        assert!(msg.contains("HTTP hook"), "{msg}");
        parse("[instance]\npre_stop = [\"flush\"]\n")
            .unwrap()
            .validate()
            .unwrap();
    }

    #[test]
    fn a_presented_token_needs_a_group_to_capture_it() {
        let header = "credential_header = \"Authorization: token {launch_token}\"\n";
        let c = parse(&format!(
            "[instance]\nready_token_regex = 'ready'\n{header}"
        ))
        .unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("captures no launch token"), "{msg}");
        let c = parse(&format!(
            "[instance]\nready_token_regex = 'token=(\\w+)'\n{header}"
        ))
        .unwrap();
        c.validate().unwrap();
    }

    #[test]
    fn isolation_modes_and_numbers_are_checked() {
        for mode in ["none", "user", "sandbox"] {
            let c = parse(&format!("[isolation]\nmode = \"{mode}\"\n")).unwrap();
            c.validate().unwrap();
            // A configured mode wins over the default of either user.
            assert_eq!(c.isolation_level(false).unwrap().as_str(), mode);
            assert_eq!(c.isolation_level(true).unwrap().as_str(), mode);
        }
        let c = parse("[isolation]\nmode = \"jail\"\n").unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("unknown isolation mode \"jail\""), "{msg}");
        assert!(msg.contains("line 2"), "{msg}");
        for (text, key) in [
            ("base_uid = 0", "isolation.base_uid"),
            (
                "base_uid = 4294967000\nuid_count = 1000",
                "isolation.uid_count",
            ),
            ("uid_count = 0", "isolation.uid_count"),
            ("memory_max_mb = 0", "isolation.memory_max_mb"),
            ("pids_max = 0", "isolation.pids_max"),
            ("open_files_max = 10", "isolation.open_files_max"),
            ("max_ports = 0", "isolation.max_ports"),
        ] {
            let c = parse(&format!("[isolation]\n{text}\n")).unwrap();
            let msg = c.validate().unwrap_err().to_string();
            assert!(msg.contains(key), "{text}: {msg}");
        }
    }

    #[test]
    fn egress_allowances_are_networks_or_addresses() {
        let c = parse("[isolation]\negress_allow = [\"10.1.0.0/16\", \"fd00::5\"]\n").unwrap();
        let nets: Vec<String> = c
            .isolation
            .egress_allow
            .iter()
            .map(|n| n.to_string())
            .collect();
        assert_eq!(nets, ["10.1.0.0/16", "fd00::5/128"]);
        let msg = parse("# x\n[isolation]\negress_allow = [\"10.0.0.0/33\"]\n")
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("isolation.egress_allow") && msg.contains("line 3"),
            "{msg}"
        );
    }

    #[test]
    fn lease_numbers_are_checked() {
        let c = parse("[lease]\nttl_ms = 15000\nrenew_ms = 10000\n").unwrap();
        let msg = c.check_lease_numbers().unwrap_err().to_string();
        assert!(
            msg.contains("lease.ttl_ms") && msg.contains("line 2"),
            "{msg}"
        );
        let c = parse("[lease]\nfence_after_ms = 30000\n").unwrap();
        assert!(c.check_lease_numbers().is_err());
        let c = parse("[lease]\nrenew_ms = 0\n").unwrap();
        assert!(c.check_lease_numbers().is_err());
        assert!(Config::default().check_lease_numbers().is_ok());
    }

    #[test]
    fn a_huge_lease_ttl_is_refused_naming_the_key() {
        // Beyond TOML's i64: refused while parsing, naming key and line.
        let msg = parse("[lease]\nttl_ms = 18446744073709551615\n")
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("lease.ttl_ms") && msg.contains("line 2"),
            "{msg}"
        );
        // The largest TOML integer parses, and LeaseConfig's bound refuses it
        // (instead of an Instant overflow panicking the renew task later).
        let c = parse("[lease]\nttl_ms = 9223372036854775807\n").unwrap();
        let msg = c.check_lease_numbers().unwrap_err().to_string();
        assert!(
            msg.contains("lease.ttl_ms") && msg.contains("line 2") && msg.contains("at most"),
            "{msg}"
        );
        assert!(c.lease_config().is_err());
    }

    #[test]
    fn weak_cluster_secrets_are_refused() {
        for weak in [
            "change-me",
            "",
            "   ",
            "0123456789abcdef0123456789abcde",
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "change-me-change-me-change-me-change-me",
            "abcabcabcabcabcabcabcabcabcabcabcabcabcabcabc",
            "has a space in it 0123456789abcdefghijkl",
        ] {
            let why = check_cluster_secret(weak).unwrap_err();
            assert!(why.contains("openssl rand -hex 32"), "{weak:?}: {why}");
        }
        for strong in [
            // `openssl rand -hex 32`, `head -c32 /dev/urandom | base64`,
            // `openssl rand -hex 16`.
            "5f0c8e1d9a7b3c2e4f6a8b0c1d2e3f405162738495a6b7c8d9eaf0b1c2d3e4f5",
            "q3v9K2pX+7mN1bR8/tY4wE6uI0oA5sD2fG7hJ9kL3zc=",
            "9b1e4f7a2c8d0e3f6a9b2c5d8e1f4a7b",
        ] {
            check_cluster_secret(strong).unwrap_or_else(|why| panic!("{strong}: {why}"));
        }
    }

    #[test]
    fn postgres_needs_a_cluster_secret() {
        let c = Config {
            store: Some("postgres://db/berth".into()),
            ..Config::default()
        };
        assert!(c.is_postgres());
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("cluster_secret"), "{msg}");
    }

    #[test]
    fn auth_settings_are_checked() {
        for (text, key) in [
            ("[auth]\nuser_token_ttl_s = 0\n", "auth.user_token_ttl_s"),
            (
                "[auth]\nmax_tokens_per_user = 0\n",
                "auth.max_tokens_per_user",
            ),
            ("[auth]\ntoken_cache_s = 86400\n", "auth.token_cache_s"),
            ("[auth]\nsession_ttl_s = 0\n", "auth.session_ttl_s"),
            ("[proxy]\nheader_secret = \"s\"\n", "proxy.header_secret"),
            (
                "[proxy]\nauth = \"header\"\ntrusted_proxies = [\"127.0.0.1\"]\nheader_secret = \"a b\"\n",
                "proxy.header_secret",
            ),
        ] {
            let err = parse(text).unwrap().validate().unwrap_err().to_string();
            assert!(err.contains(key), "{text}: {err}");
        }
        let ok = "[auth]\nuser_token_ttl_s = 60\nusers_may_patch = true\ntoken_cache_s = 0\n\
                  [proxy]\nauth = \"header\"\ntrusted_proxies = [\"127.0.0.1\"]\nheader_secret = \"s3\"\n";
        parse(ok).unwrap().validate().unwrap();
    }

    #[test]
    fn metrics_settings_are_checked() {
        for (text, key, why) in [
            (
                "[metrics]\ntoken = \"a b\"\n",
                "metrics.token",
                "visible ASCII",
            ),
            (
                "admin_token = \"same\"\n[metrics]\ntoken = \"same\"\n",
                "metrics.token",
                "differ from the admin token",
            ),
            (
                "[metrics]\nlisten = \"localhost\"\n",
                "metrics.listen",
                "not a socket address",
            ),
            (
                "listen = \"127.0.0.1:8000\"\n[metrics]\nlisten = \"127.0.0.1:8000\"\n",
                "metrics.listen",
                "main listen address",
            ),
        ] {
            let err = parse(text).unwrap().validate().unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(why), "{text}: {err}");
        }
        let ok = "[metrics]\ntoken = \"scrape-me\"\nlisten = \"127.0.0.1:9464\"\n";
        parse(ok).unwrap().validate().unwrap();
    }

    #[test]
    fn exhaustion_limits_are_read_and_checked_naming_key_and_line() {
        let c = parse(
            "[proxy]
max_connections = 100
max_connections_per_ip = 10
             max_upgrades_per_user = 5
body_min_bytes_per_s = 100
body_grace_ms = 3000
",
        )
        .unwrap();
        assert!(c.validate_proxy().is_ok());
        let p = &c.proxy;
        assert_eq!(
            (
                p.max_connections,
                p.max_connections_per_ip,
                p.max_upgrades_per_user,
                p.body_min_bytes_per_s,
                p.body_grace_ms
            ),
            (100, 10, 5, 100, 3000)
        );
        let d = Config::default().proxy;
        assert_eq!(
            (
                d.max_connections,
                d.max_connections_per_ip,
                d.max_upgrades_per_user
            ),
            (10_000, 1000, 100)
        );
        assert_eq!((d.body_min_bytes_per_s, d.body_grace_ms), (1024, 10_000));
        for (text, key) in [
            (
                "[proxy]
max_connections_per_ip = 0
",
                "proxy.max_connections_per_ip",
            ),
            (
                "[proxy]
max_upgrades_per_user = 0
",
                "proxy.max_upgrades_per_user",
            ),
            (
                "[proxy]
max_connections = 0
",
                "proxy.max_connections",
            ),
        ] {
            let msg = parse(text)
                .unwrap()
                .validate_proxy()
                .unwrap_err()
                .to_string();
            assert!(
                msg.contains(key) && msg.contains("line 2") && msg.contains("at least 1"),
                "{msg}"
            );
        }
        let msg = parse(
            "[proxy]
max_connections = 10
max_connections_per_ip = 20
",
        )
        .unwrap()
        .validate_proxy()
        .unwrap_err()
        .to_string();
        assert!(
            msg.contains("proxy.max_connections_per_ip")
                && msg.contains("more than max_connections"),
            "{msg}"
        );
        let msg = parse(
            "[proxy]
max_upgrades_per_user = -1
",
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("proxy.max_upgrades_per_user"), "{msg}");
    }

    #[test]
    fn loopback_entries_are_found_however_written() {
        for entry in [
            "127.0.0.1",
            "127.0.0.2",
            "127.0.0.0/8",
            "127.1.0.0/16",
            "0.0.0.0/0",
            "::1",
            "::/0",
            "::ffff:127.0.0.1",
            " 127.0.0.1 ",
        ] {
            assert!(covers_loopback(entry), "{entry}");
        }
        for entry in [
            "10.0.0.0/8",
            "128.0.0.0/1",
            "192.168.1.1",
            "fd00::/8",
            "::2",
        ] {
            assert!(!covers_loopback(entry), "{entry}");
        }
    }

    #[test]
    fn header_auth_needs_trusted_proxies() {
        let c = parse("[proxy]\nauth = \"header\"\n").unwrap();
        assert!(c.validate_proxy().is_err());
        let c =
            parse("[proxy]\nauth = \"header\"\ntrusted_proxies = [\"10.0.0.0/8\", \"fd00::1\"]\n")
                .unwrap();
        assert!(c.validate_proxy().is_ok());
        let c = parse("[proxy]\ntrusted_proxies = [\"10.0.0.0/33\"]\n").unwrap();
        assert!(c.validate_proxy().is_err());
    }
}
