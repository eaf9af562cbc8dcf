//! Where a program may connect, as every runtime's egress rules say it:
//! the public internet, nothing private, and never a cloud's metadata
//! service. The local runtime turns these lists into nftables rules, the
//! Kubernetes runtime into a NetworkPolicy.

/// Cloud metadata services and host agents, which hand out the host's
/// credentials: AWS's, GCP's and Azure's metadata (169.254.169.254), AWS
/// ECS's task credentials, Alibaba's metadata, Azure's wire server.
pub const METADATA_V4: &[&str] = &[
    "169.254.169.254/32",
    "169.254.170.2/32",
    "100.100.100.200/32",
    "168.63.129.16/32",
];
mod credential;

pub use credential::{ProxyCredential, ProxyKey};

/// AWS's IPv6 metadata service.
pub const METADATA_V6: &[&str] = &["fd00:ec2::254/128"];
/// IPv4 ranges no program reaches unless allowed: RFC 1918, shared
/// address space (CGNAT, RFC 6598) and link-local.
pub const PRIVATE_V4: &[&str] = &[
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "169.254.0.0/16",
];
/// IPv6 unique local and link-local ranges.
pub const PRIVATE_V6: &[&str] = &["fc00::/7", "fe80::/10"];

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::{Arc, LazyLock, PoisonError, RwLock};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// What an instance may reach beyond the metadata and host addresses,
/// which it never reaches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EgressMode {
    /// The public internet, and the private networks allowed.
    #[default]
    AllowAll,
    /// Nothing but what is allowed (with nothing allowed: nothing).
    DenyAll,
    /// The same as [`EgressMode::DenyAll`], said for a list that is not
    /// empty.
    Allowlist,
}

impl EgressMode {
    /// Whether only what is allowed is reached.
    pub fn confined(self) -> bool {
        self != EgressMode::AllowAll
    }
}

/// A destination an instance may reach: a network or a domain name,
/// on one port or (for a network) on every port, (for a domain) on 80
/// and 443.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Destination {
    /// Where.
    pub target: Target,
    /// The one port allowed; `None`: see [`Destination::ports`].
    pub port: Option<u16>,
}

/// A network, or a domain name (`pypi.org`) or every name under one
/// (`*.pythonhosted.org`, which does not match `pythonhosted.org` itself).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// Addresses, by CIDR (a single address is a /32 or /128).
    Net(IpNet),
    /// An exact name, lowercase, without a trailing dot.
    Name(String),
    /// Every name ending in `.` and this suffix.
    Suffix(String),
}

/// [`METADATA_V4`] and [`METADATA_V6`] as networks, parsed once: the
/// egress proxy checks every address it connects to against them.
pub fn metadata() -> &'static [IpNet] {
    static NETS: LazyLock<Vec<IpNet>> = LazyLock::new(|| parse(&[METADATA_V4, METADATA_V6]));
    &NETS
}

/// [`PRIVATE_V4`] and [`PRIVATE_V6`] as networks, parsed once.
pub fn private() -> &'static [IpNet] {
    static NETS: LazyLock<Vec<IpNet>> = LazyLock::new(|| parse(&[PRIVATE_V4, PRIVATE_V6]));
    &NETS
}

/// The networks of this module's lists, which are all well formed (a test
/// reads each back).
fn parse(lists: &[&[&str]]) -> Vec<IpNet> {
    lists
        .iter()
        .flat_map(|list| list.iter())
        .filter_map(|n| n.parse().ok())
        .collect()
}

fn within(nets: &[IpNet], addr: IpAddr) -> bool {
    nets.iter().any(|n| n.contains(&addr))
}

/// An address no policy reaches: a metadata service, loopback, or the
/// unspecified address (which reaches loopback).
fn never_reached(addr: IpAddr) -> bool {
    within(metadata(), addr) || addr.is_loopback() || addr.is_unspecified()
}

/// The ports a domain is reached on when its entry names none.
pub const WEB_PORTS: [u16; 2] = [80, 443];

/// Why an `egress_allow` entry cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{entry:?} is not a network, address or domain name with an optional :port ({why})")]
pub struct BadDestination {
    /// The entry as written.
    pub entry: String,
    /// What is wrong with it.
    pub why: &'static str,
}

impl FromStr for Destination {
    type Err = BadDestination;

    /// `10.8.0.0/24`, `10.8.0.5:5432`, `[fd00::/8]:443`, `fd00::5`,
    /// `pypi.org`, `*.github.com:22`.
    fn from_str(entry: &str) -> Result<Self, BadDestination> {
        let bad = |why| BadDestination {
            entry: entry.to_owned(),
            why,
        };
        let (host, port) = split_port(entry).ok_or_else(|| bad("bad port"))?;
        if port == Some(0) {
            return Err(bad("port 0"));
        }
        let target = if let Ok(net) = host.parse::<IpNet>() {
            Target::Net(net.trunc())
        } else if let Ok(addr) = host.parse::<IpAddr>() {
            Target::Net(IpNet::from(addr))
        } else {
            let name = host.trim_end_matches('.').to_ascii_lowercase();
            match name.strip_prefix("*.") {
                Some(suffix) if is_host_name(suffix) => Target::Suffix(suffix.to_owned()),
                None if is_host_name(&name) => Target::Name(name),
                _ => return Err(bad("not a valid host name")),
            }
        };
        Ok(Destination { target, port })
    }
}

/// `host` and its port: `[v6]:port`, `host:port` (one colon), or no port.
fn split_port(entry: &str) -> Option<(&str, Option<u16>)> {
    if let Some(rest) = entry.strip_prefix('[') {
        let (host, tail) = rest.split_once(']')?;
        return match tail.strip_prefix(':') {
            Some(port) => Some((host, Some(port.parse().ok()?))),
            None if tail.is_empty() => Some((host, None)),
            None => None,
        };
    }
    match entry.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => Some((host, Some(port.parse().ok()?))),
        _ => Some((entry, None)),
    }
}

/// Whether `name` is a DNS host name: letters, digits and hyphens in
/// labels of 1 to 63, at most 253 in all, not all digits (an address).
pub fn is_host_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            (1..=63).contains(&label.len())
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
        && !name.bytes().all(|b| b.is_ascii_digit() || b == b'.')
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let host = match &self.target {
            Target::Net(IpNet::V6(net)) if self.port.is_some() => format!("[{net}]"),
            Target::Net(net) => net.to_string(),
            Target::Name(name) => name.clone(),
            Target::Suffix(suffix) => format!("*.{suffix}"),
        };
        match self.port {
            Some(port) => write!(f, "{host}:{port}"),
            None => f.write_str(&host),
        }
    }
}

impl Serialize for Destination {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Destination {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl Destination {
    /// Whether this is a domain name (reached through the egress proxy).
    pub fn is_domain(&self) -> bool {
        !matches!(self.target, Target::Net(_))
    }

    /// The ports it is reached on: its own, else every port for a network
    /// (`None`) and [`WEB_PORTS`] for a domain.
    pub fn ports(&self) -> Option<Vec<u16>> {
        match (self.port, &self.target) {
            (Some(port), _) => Some(vec![port]),
            (None, Target::Net(_)) => None,
            (None, _) => Some(WEB_PORTS.to_vec()),
        }
    }

    fn matches_name(&self, name: &str) -> bool {
        match &self.target {
            Target::Name(allowed) => allowed == name,
            Target::Suffix(suffix) => name
                .strip_suffix(suffix.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            Target::Net(_) => false,
        }
    }

    fn matches_port(&self, port: u16) -> bool {
        self.ports().is_none_or(|ports| ports.contains(&port))
    }
}

/// The variables that point a program at an HTTP proxy at `url`: the
/// upper- and lowercase `HTTP_PROXY`, `HTTPS_PROXY` and `ALL_PROXY` (each
/// tool reads its own), and `NO_PROXY` for loopback.
pub fn proxy_env(url: &str) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ]
    .iter()
    .map(|name| ((*name).to_owned(), url.to_owned()))
    .collect();
    for name in ["NO_PROXY", "no_proxy"] {
        env.push((name.to_owned(), "localhost,127.0.0.1,::1".to_owned()));
    }
    env
}

/// The name servers of a `resolv.conf`: its `nameserver` lines that hold
/// an address (a scope suffix such as `%eth0` is dropped).
pub fn name_servers(resolv_conf: &str) -> Vec<IpAddr> {
    resolv_conf
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("nameserver")).then_some(())?;
            let addr = words.next()?;
            addr.split('%').next()?.parse().ok()
        })
        .collect()
}

/// An egress policy: the mode and what it allows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressPolicy {
    /// See [`EgressMode`].
    pub mode: EgressMode,
    /// Networks and names reached although the mode, or the private
    /// ranges, would refuse them.
    pub allow: Vec<Destination>,
}

impl EgressPolicy {
    /// Whether a connection asking for `name` on `port` may go through
    /// the egress proxy. `name` is lowercase, without a trailing dot.
    pub fn allows_name(&self, name: &str, port: u16) -> bool {
        self.allow
            .iter()
            .any(|d| d.matches_port(port) && d.matches_name(name))
    }

    /// Whether a DNS query for `name` may be answered: it is an allowed
    /// name on any port. `name` is lowercase, without a trailing dot.
    pub fn allows_lookup(&self, name: &str) -> bool {
        self.allow.iter().any(|d| d.matches_name(name))
    }

    /// Whether an address a name resolved to may be connected to on
    /// `port`: never a metadata address; a private one only inside an
    /// allowed network.
    pub fn allows_resolved(&self, addr: IpAddr, port: u16) -> bool {
        let addr = addr.to_canonical();
        !never_reached(addr) && (!within(private(), addr) || self.in_allowed_network(addr, port))
    }

    /// Whether a program may reach `addr` on `port` by that address (a
    /// proxy request that names an address): inside an allowed network,
    /// or under `allow_all` a public address; never a metadata service,
    /// loopback or the unspecified address.
    pub fn allows_address(&self, addr: IpAddr, port: u16) -> bool {
        let addr = addr.to_canonical();
        !never_reached(addr)
            && (self.in_allowed_network(addr, port)
                || (!self.mode.confined() && !within(private(), addr)))
    }

    fn in_allowed_network(&self, addr: IpAddr, port: u16) -> bool {
        self.allow.iter().any(|d| {
            matches!(&d.target, Target::Net(net) if net.contains(&addr)) && d.matches_port(port)
        })
    }

    /// The allowed networks, grouped by their one port (`None`: every
    /// port): a rule per group, in nftables and in a NetworkPolicy.
    pub fn networks_by_port(&self) -> BTreeMap<Option<u16>, Vec<IpNet>> {
        let mut by_port: BTreeMap<Option<u16>, Vec<IpNet>> = BTreeMap::new();
        for d in &self.allow {
            if let Target::Net(net) = d.target {
                by_port.entry(d.port).or_default().push(net);
            }
        }
        by_port
    }

    /// The ports the allowed domains are reached on: the connections the
    /// guard sends to the egress proxy.
    pub fn domain_ports(&self) -> BTreeSet<u16> {
        self.allow
            .iter()
            .filter(|d| d.is_domain())
            .filter_map(Destination::ports)
            .flatten()
            .collect()
    }

    /// Whether connections go through the egress proxy.
    pub fn needs_proxy(&self) -> bool {
        self.mode.confined() && self.allow.iter().any(Destination::is_domain)
    }

    /// Refuses a policy that would not mean what it says: a domain name
    /// with `allow_all`, where every public name is reached anyway and
    /// nothing sends its connections to the egress proxy.
    pub fn check(&self) -> Result<(), MeaninglessPolicy> {
        match self.allow.iter().find(|d| d.is_domain()) {
            Some(name) if !self.mode.confined() => Err(MeaninglessPolicy {
                name: name.to_string(),
            }),
            _ => Ok(()),
        }
    }
}

/// A policy that allows a domain name without confining: see
/// [`EgressPolicy::check`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{name} is a domain name, which only a confining egress (\"deny_all\" or \"allowlist\") \
     can allow: with \"allow_all\" every public name is reached"
)]
pub struct MeaninglessPolicy {
    /// The first domain name of the policy.
    pub name: String,
}

/// Every instance account's egress policy: the node's, or one an operator
/// set for that account's user. The guard's owner (the local runtime)
/// writes it; the egress proxy reads it for every connection and lookup,
/// so a change applies from the next one.
#[derive(Debug, Default)]
pub struct EgressBook {
    default: Arc<EgressPolicy>,
    accounts: RwLock<HashMap<u32, BookEntry>>,
}

/// What the book knows of one account.
#[derive(Debug, Clone)]
struct BookEntry {
    /// The account's user, by slug, for the refusal log.
    user: Arc<str>,
    /// The user's own policy; `None`: the node's.
    policy: Option<Arc<EgressPolicy>>,
}

/// One account's policy as the book gives it.
#[derive(Debug, Clone)]
pub struct AccountEgress {
    /// The account's user (slug), when the book knows the account.
    pub user: Option<Arc<str>>,
    /// The policy its connections are checked against.
    pub policy: Arc<EgressPolicy>,
}

impl EgressBook {
    /// A book in which every account has `default`.
    pub fn new(default: EgressPolicy) -> Self {
        Self {
            default: Arc::new(default),
            accounts: RwLock::new(HashMap::new()),
        }
    }

    /// The policy of account `uid`.
    pub fn of(&self, uid: u32) -> AccountEgress {
        let accounts = self.accounts.read().unwrap_or_else(PoisonError::into_inner);
        let entry = accounts.get(&uid);
        AccountEgress {
            user: entry.map(|e| e.user.clone()),
            policy: entry
                .and_then(|e| e.policy.clone())
                .unwrap_or_else(|| self.default.clone()),
        }
    }

    /// Records whose account `uid` is, keeping its policy: the refusal log
    /// names the user.
    pub fn name(&self, uid: u32, user: &str) {
        let mut accounts = self
            .accounts
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let policy = accounts.get(&uid).and_then(|e| e.policy.clone());
        accounts.insert(
            uid,
            BookEntry {
                user: Arc::from(user),
                policy,
            },
        );
    }

    /// Records account `uid` of `user` with its own `policy` (`None`: the
    /// node's).
    pub fn set(&self, uid: u32, user: &str, policy: Option<EgressPolicy>) {
        let mut accounts = self
            .accounts
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        accounts.insert(
            uid,
            BookEntry {
                user: Arc::from(user),
                policy: policy.map(Arc::new),
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_servers_are_the_addresses_of_nameserver_lines() {
        let conf = "# generated\nsearch example.org\nnameserver 10.0.0.2\n\
                    nameserver fe80::1%eth0\nnameserver bogus\n  nameserver 1.1.1.1 \n\
                    options ndots:2\n";
        let want: Vec<IpAddr> = ["10.0.0.2", "fe80::1", "1.1.1.1"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        assert_eq!(name_servers(conf), want);
    }

    fn policy(allow: &[&str]) -> EgressPolicy {
        EgressPolicy {
            mode: EgressMode::Allowlist,
            allow: allow.iter().map(|d| d.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn every_listed_network_is_well_formed() {
        assert_eq!(metadata().len(), METADATA_V4.len() + METADATA_V6.len());
        assert_eq!(private().len(), PRIVATE_V4.len() + PRIVATE_V6.len());
    }

    #[test]
    fn entries_read_back_as_written() {
        for entry in [
            "10.8.0.0/24",
            "10.8.0.5/32:5432",
            "[fd00::/8]:443",
            "fd00::5/128",
            "pypi.org",
            "*.github.com:22",
        ] {
            let d: Destination = entry.parse().unwrap();
            assert_eq!(d.to_string(), entry);
        }
        let d: Destination = "10.8.0.5:5432".parse().unwrap();
        assert_eq!(d.to_string(), "10.8.0.5/32:5432");
        let d: Destination = "PyPI.org.".parse().unwrap();
        assert_eq!(d.target, Target::Name("pypi.org".into()));
        for bad in [
            "",
            "pypi.org:0",
            "pypi.org:x",
            "a..b",
            "-a.org",
            "*.",
            "*.*.org",
            "10.0.0.0/33",
            "[fd00::/8",
            "ex ample.org",
            "1.2.3",
        ] {
            assert!(bad.parse::<Destination>().is_err(), "{bad:?} was read");
        }
    }

    #[test]
    fn names_match_exactly_or_under_a_suffix_on_their_ports() {
        let p = policy(&["pypi.org", "*.github.com:22", "10.0.0.0/8"]);
        assert!(p.allows_name("pypi.org", 443));
        assert!(p.allows_name("pypi.org", 80));
        assert!(!p.allows_name("pypi.org", 22));
        assert!(!p.allows_name("files.pypi.org", 443));
        assert!(!p.allows_name("evilpypi.org", 443));
        assert!(p.allows_name("api.github.com", 22));
        assert!(!p.allows_name("github.com", 22));
        assert!(!p.allows_name("xgithub.com", 22));
        assert!(!p.allows_name("api.github.com", 443));
        assert!(!p.allows_name("10.1.2.3", 443));
        assert!(p.allows_lookup("api.github.com"));
        assert!(p.allows_lookup("pypi.org"));
        assert!(!p.allows_lookup("exfil.pypi.org"));
        assert!(!p.allows_lookup("10.1.2.3"));
        assert_eq!(p.domain_ports(), BTreeSet::from([22, 80, 443]));
        assert!(p.needs_proxy());
        assert!(!policy(&["10.0.0.0/8"]).needs_proxy());
    }

    #[test]
    fn resolved_addresses_are_public_or_allowed_and_never_metadata() {
        let p = policy(&["169.254.0.0/16", "10.1.0.0/16:5432"]);
        let ok = |a: &str, port| p.allows_resolved(a.parse().unwrap(), port);
        assert!(ok("151.101.0.223", 443));
        assert!(!ok("169.254.169.254", 80));
        assert!(!ok("168.63.129.16", 80));
        assert!(ok("169.254.10.1", 80));
        assert!(!ok("127.0.0.1", 443));
        assert!(!ok("10.2.0.1", 443));
        assert!(ok("10.1.0.9", 5432));
        assert!(!ok("10.1.0.9", 443));
        assert!(!ok("fd00:ec2::254", 80));
        assert!(!ok("fd12::1", 80));
        assert!(!ok("::ffff:169.254.169.254", 80));
        assert!(!ok("::ffff:127.0.0.1", 80));
    }

    #[test]
    fn an_address_asked_for_by_itself_is_reached_only_as_the_mode_says() {
        let confined = policy(&["169.254.0.0/16", "10.1.0.0/16:5432"]);
        let mut open = confined.clone();
        open.mode = EgressMode::AllowAll;
        let ok = |p: &EgressPolicy, a: &str, port| p.allows_address(a.parse().unwrap(), port);
        // Confined: only an allowed network, on its port.
        assert!(!ok(&confined, "151.101.0.223", 443));
        assert!(ok(&confined, "10.1.0.9", 5432));
        assert!(!ok(&confined, "10.1.0.9", 443));
        assert!(ok(&confined, "169.254.10.1", 80));
        // Open: the public internet too, nothing else private.
        assert!(ok(&open, "151.101.0.223", 443));
        assert!(!ok(&open, "10.2.0.1", 443));
        assert!(!ok(&open, "fd12::1", 80));
        for never in [
            "169.254.169.254",
            "::ffff:169.254.169.254",
            "127.0.0.1",
            "::1",
            "0.0.0.0",
        ] {
            assert!(
                !ok(&open, never, 80) && !ok(&confined, never, 80),
                "{never}"
            );
        }
    }

    #[test]
    fn a_domain_needs_a_confining_mode() {
        let mut p = policy(&["10.0.0.0/8", "pypi.org"]);
        p.mode = EgressMode::AllowAll;
        assert_eq!(p.check().map_err(|e| e.name), Err("pypi.org".to_owned()));
        p.mode = EgressMode::DenyAll;
        assert_eq!(p.check(), Ok(()));
        assert_eq!(
            EgressPolicy {
                mode: EgressMode::AllowAll,
                allow: vec!["10.0.0.0/8".parse().unwrap()],
            }
            .check(),
            Ok(())
        );
    }

    #[test]
    fn the_book_gives_each_account_its_own_policy_or_the_nodes() {
        let book = EgressBook::new(EgressPolicy::default());
        let own = policy(&["pypi.org"]);
        book.set(7, "alice", Some(own.clone()));
        book.set(8, "bob", None);
        assert_eq!(*book.of(7).policy, own);
        assert_eq!(book.of(7).user.as_deref(), Some("alice"));
        assert_eq!(*book.of(8).policy, EgressPolicy::default());
        assert_eq!(book.of(9).user, None);
        // Naming an account keeps its policy.
        book.name(7, "alice");
        assert_eq!(*book.of(7).policy, own);
        book.set(7, "alice", None);
        assert_eq!(*book.of(7).policy, EgressPolicy::default());
    }
}
