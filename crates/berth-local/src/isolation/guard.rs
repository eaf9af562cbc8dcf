//! The port and egress guards: nftables rules in a table of berth's own.
//!
//! Construction: owner matching (`meta skuid`) on the `output` hook, in
//! one `inet` table per berth (named after its data dir, so berths on one
//! host never touch each other's rules; the table's comment names the data
//! dir). Every rule applies only to sockets owned by a uid of the
//! configured account range: the output chain's one rule sends those to
//! the chain `instance`, so every other packet of the host (berth's, other
//! users') costs one comparison per berth table.
//!
//! * **port guard**: an instance uid may open a TCP connection to a port
//!   of the instance port range only if the pair `uid . port` is in the
//!   set `own_ports`, which holds each running instance's own port. berth
//!   adds a pair before it starts a program and deletes it when the
//!   instance ends.
//! * **listener cap**: an instance uid may hold at most `per_account`
//!   open connections to berth's own listeners at once (`ct count` per
//!   `meta skuid` in the dynamic set `berth_conns`). berth's proxy caps
//!   connections per client address, but an instance can use every
//!   address of 127.0.0.0/8 as its source; counted by uid, one instance
//!   cannot fill berth's `max_connections` from many addresses.
//! * **egress guard**: instance uids reach the public internet and
//!   nothing private. In order:
//!   - the cloud metadata and host-agent addresses
//!     ([`berth_core::egress`]) and every address of this host but loopback
//!     (`fib daddr type local`, which follows addresses as they come and
//!     go) are refused, whatever else is allowed;
//!   - DNS (port 53) to the host's name servers (`/etc/resolv.conf` at
//!     start), and the operator's `egress_allow` networks, are accepted;
//!   - the private, shared (CGNAT) and link-local ranges are refused.
//!
//! Refused connections are rejected (a TCP reset, or ICMP unreachable),
//! not dropped, so a program learns at once instead of hanging.
//!
//! Why this over a network namespace per instance: it keeps instances on
//! the host's loopback, where berth's proxy reaches them at the address
//! they print, costs a share of one netlink transaction per launch (see
//! [`Guard`]) instead of a veth pair and addresses per instance, and the
//! rules
//! survive berth: an instance
//! adopted after a restart is never unguarded. The table is recreated
//! atomically (one `nft -f` transaction) at start, which drops entries a
//! previous berth left; adopted instances add theirs back.

use std::collections::HashMap;
use std::net::IpAddr;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;

use berth_core::egress::{self, EgressPolicy};
use berth_localnet::{NftSetError, PairChange, PairSet};
use ipnet::IpNet;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};

use super::UidRange;

/// Where instances may go beyond the public internet.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Egress {
    /// The mode and what it allows; never the metadata addresses or this
    /// host's own.
    pub policy: EgressPolicy,
    /// The host's name servers, reached on port 53 wherever they are.
    pub name_servers: Vec<IpAddr>,
    /// The egress proxy's port on loopback, where connections to the
    /// allowed domains' ports go; `None`: no domain is allowed.
    pub proxy_port: Option<u16>,
}

/// `ip daddr { … } verdict` and its `ip6` twin, for the addresses of each
/// family that there are, merged so that nft sees no overlapping
/// intervals.
fn by_family(nets: &[IpNet], tail: &str) -> String {
    let merged = IpNet::aggregate(&nets.to_vec());
    let (v4, v6): (Vec<&IpNet>, Vec<&IpNet>) =
        merged.iter().partition(|n| matches!(n, IpNet::V4(_)));
    let mut rules = String::new();
    for (family, nets) in [("ip", v4), ("ip6", v6)] {
        if nets.is_empty() {
            continue;
        }
        let list: Vec<String> = nets.iter().map(|n| n.trunc().to_string()).collect();
        rules.push_str(&format!(
            "\t\t{family} daddr {{ {} }} {tail}\n",
            list.join(", ")
        ));
    }
    rules
}

/// Why an `nft` run failed.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error("cannot run {nft}: {source}")]
    Spawn {
        nft: PathBuf,
        source: std::io::Error,
    },
    #[error("nft refused the {what} of table inet {table}: {stderr}")]
    Refused {
        what: &'static str,
        table: String,
        stderr: String,
    },
    #[error("the port change in table inet {table} was not made: {source}")]
    PortChange { table: String, source: NftSetError },
}

/// The name of the table of the berth whose data dir is `data_dir`
/// (canonical): `berth_` and 8 hex digits of its SHA-256.
pub fn table_name(data_dir: &Path) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(data_dir.as_os_str().as_encoded_bytes());
    format!("berth_{}", hex::encode(&digest[..4]))
}

/// berth's own listening ports, and how many connections one instance
/// account may hold open to them at once (none: no cap).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListenerCap {
    /// The ports berth listens on (its API and proxy).
    pub ports: Vec<u16>,
    /// Connections one instance account may hold open to them at once;
    /// 0: no cap.
    pub per_account: u32,
}

/// The comment of the table of the berth whose data dir is `data_dir`,
/// which a later berth reads to find that data dir (see
/// [`table_data_dir`]); `None` for a path nft cannot quote or hold.
pub fn table_comment(data_dir: &Path) -> Option<String> {
    let dir = data_dir.to_str()?;
    let fits = COMMENT_PREFIX.len() + dir.len() <= COMMENT_MAX;
    (fits && !dir.contains(['"', '\n', '\\'])).then(|| format!("{COMMENT_PREFIX}{dir}"))
}

/// What a table comment starts with; the data dir follows.
const COMMENT_PREFIX: &str = "berth data dir ";
/// The longest comment nft takes, in bytes.
const COMMENT_MAX: usize = 128;

/// One table as `nft -a -t list table` shows it: the data dir its comment
/// names and its handle, which a table made again in its place does not
/// share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedTable {
    pub data_dir: PathBuf,
    pub handle: u64,
}

/// The table in `listing` (the output of `nft -a -t list table inet
/// <table>`), if its comment is one of berth's.
pub fn parse_listed_table(listing: &str) -> Option<ListedTable> {
    let handle = listing
        .lines()
        .next()?
        .split_once("# handle ")?
        .1
        .trim()
        .parse()
        .ok()?;
    let data_dir = listing.lines().find_map(|line| {
        let quoted = line.trim().strip_prefix("comment \"")?.strip_suffix('"')?;
        Some(PathBuf::from(quoted.strip_prefix(COMMENT_PREFIX)?))
    })?;
    Some(ListedTable { data_dir, handle })
}

/// berth's tables in `listing` (the output of `nft list tables`).
pub fn berth_tables(listing: &str) -> Vec<String> {
    listing
        .lines()
        .filter_map(|line| line.trim().strip_prefix("table inet "))
        .filter(|name| is_table_name(name))
        .map(str::to_owned)
        .collect()
}

/// Whether `name` has the form [`table_name`] gives.
fn is_table_name(name: &str) -> bool {
    name.strip_prefix("berth_")
        .is_some_and(|hex| hex.len() == 8 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The whole table as an `nft -f` script that replaces any table of that
/// name in one transaction. `own_ports` starts empty; `own` are the
/// accounts with an egress policy of their own.
pub fn ruleset(
    table: &str,
    comment: Option<&str>,
    uids: UidRange,
    ports: &RangeInclusive<u16>,
    listeners: &ListenerCap,
    egress: &Egress,
    own: &[(u32, &EgressPolicy)],
) -> String {
    let last = uids.last().unwrap_or(uids.first);
    let who = format!("meta skuid {}-{}", uids.first, last);
    let range = format!("{}-{}", ports.start(), ports.end());
    let metadata = by_family(egress::metadata(), "reject");
    let policy = policy_rules(&egress.policy, &egress.name_servers);
    let (conns_set, conns_rule) = match listeners.ports.as_slice() {
        [] => (String::new(), String::new()),
        _ if listeners.per_account == 0 => (String::new(), String::new()),
        listening => {
            let list: Vec<String> = listening.iter().map(u16::to_string).collect();
            (
                "\tset berth_conns {\n\t\ttype uid\n\t\tsize 65535\n\t\tflags dynamic\n\t}\n"
                    .to_owned(),
                format!(
                    "\t\ttcp dport {{ {} }} fib daddr type local ct state new \
                     add @berth_conns {{ meta skuid ct count over {} }} reject with tcp reset\n",
                    list.join(", "),
                    listeners.per_account
                ),
            )
        }
    };
    let comment = comment
        .map(|c| format!("\tcomment \"{c}\"\n"))
        .unwrap_or_default();
    // What sends connections to the egress proxy: a NAT chain, where a
    // proxy listens, which every account's own policy can add to.
    let redirect = match egress.proxy_port {
        None => String::new(),
        Some(proxy) => format!(
            "\tmap names_of {{\n\t\ttype uid : verdict\n\t}}\n\
             \tchain egress_redirect {{\n\
             \t\ttype nat hook output priority -100; policy accept;\n\
             \t\t{who} meta nfproto ipv4 jump egress_names\n\
             \t}}\n\
             \tchain egress_names {{\n\
             \t\tmeta skuid vmap @names_of\n\
             {}\
             \t}}\n",
            redirect_rules(&egress.policy, proxy)
        ),
    };
    let mut script = format!(
        "table inet {table} {{}}\n\
         delete table inet {table}\n\
         table inet {table} {{\n\
         {comment}\
         \tset own_ports {{\n\
         \t\ttype uid . inet_service\n\
         \t}}\n\
         \tmap egress_of {{\n\
         \t\ttype uid : verdict\n\
         \t}}\n\
         {conns_set}\
         \tchain instance {{\n\
         {conns_rule}\
         \t\ttcp dport {range} meta skuid . tcp dport @own_ports accept\n\
         \t\ttcp dport {range} reject with tcp reset\n\
         {metadata}\
         \t\tfib daddr type local ip daddr != 127.0.0.0/8 reject\n\
         \t\tfib daddr type local ip6 daddr != ::1 reject\n\
         \t\tmeta skuid vmap @egress_of\n\
         {policy}\
         \t}}\n\
         \tchain output {{\n\
         \t\ttype filter hook output priority filter; policy accept;\n\
         \t\t{who} jump instance\n\
         \t}}\n\
         {redirect}\
         }}\n"
    );
    for (uid, policy) in own {
        script.push_str(&own_egress(table, *uid, Some(policy), egress, false));
    }
    script
}

/// What `policy` lets through after the refusals every policy shares (the
/// metadata addresses and this host's): DNS to the name servers unless it
/// confines, its networks, then the rest: nothing when it confines, else
/// everything but the private ranges. The rules do not end in a verdict
/// when it does not confine.
fn policy_rules(policy: &EgressPolicy, name_servers: &[IpAddr]) -> String {
    let servers: Vec<IpNet> = name_servers.iter().map(|a| IpNet::from(*a)).collect();
    // Confined, a program's DNS goes only to berth's filtering forwarder
    // (redirected in NAT), never to a name server itself: queries carry
    // data out as well as names in.
    let mut rules = if policy.mode.confined() {
        "\t\tmeta l4proto { tcp, udp } th dport 53 reject\n".to_owned()
    } else {
        by_family(&servers, "meta l4proto { tcp, udp } th dport 53 accept")
    };
    for (port, nets) in &policy.networks_by_port() {
        let verdict = match port {
            None => "accept".to_owned(),
            Some(port) => format!("meta l4proto {{ tcp, udp }} th dport {port} accept"),
        };
        rules.push_str(&by_family(nets, &verdict));
    }
    // Confined, only what is allowed passes: loopback (the program's own
    // port, berth, and the egress proxy a redirected connection now
    // goes to), then nothing. Else the internet passes, nothing private.
    if policy.mode.confined() {
        rules.push_str("\t\tip daddr 127.0.0.0/8 accept\n\t\tip6 daddr ::1 accept\n\t\treject\n");
    } else {
        rules.push_str(&by_family(egress::private(), "reject"));
    }
    rules
}

/// The NAT rules that send, under `policy`, an instance's IPv4 DNS
/// queries (UDP, to any address, loopback included) to the egress
/// proxy's name forwarder on port `proxy`, and its IPv4 TCP connections
/// on the allowed domains' ports to the proxy, unless they go to
/// loopback, this host, a metadata address (which the filter then
/// refuses) or an allowed network; none when it allows no domain. IPv6
/// connections to those ports, and DNS over TCP or IPv6, are refused by
/// the filter, and a program falls back to IPv4 and UDP.
fn redirect_rules(policy: &EgressPolicy, proxy: u16) -> String {
    let ports = policy.domain_ports();
    if !policy.needs_proxy() || ports.is_empty() {
        return String::new();
    }
    let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
    let v4 = |nets: &[IpNet]| -> Vec<IpNet> {
        nets.iter()
            .filter(|n| matches!(n, IpNet::V4(_)))
            .copied()
            .collect()
    };
    let metadata = v4(egress::metadata());
    let allowed: Vec<IpNet> = policy
        .networks_by_port()
        .values()
        .flat_map(|nets| v4(nets))
        .collect();
    format!(
        "\t\tudp dport 53 redirect to :{proxy}\n\
         \t\tip daddr 127.0.0.0/8 return\n\
         \t\tfib daddr type local return\n\
         {metadata}\
         {allowed}\
         \t\ttcp dport {{ {ports} }} redirect to :{proxy}\n",
        metadata = by_family(&metadata, "return"),
        allowed = by_family(&allowed, "return"),
        ports = ports.join(", "),
    )
}

/// The `nft -f` lines that give account `uid` its own `policy` in
/// `table` (`None`: the node's again). Its chains (`egress_<uid>` in the
/// filter, `names_<uid>` in NAT) replace the node's rules for it through
/// the maps `egress_of` and `names_of`, in one transaction. `existing`:
/// the account has its own policy in the table now.
fn own_egress(
    table: &str,
    uid: u32,
    policy: Option<&EgressPolicy>,
    egress: &Egress,
    existing: bool,
) -> String {
    let chains: Vec<(&str, &str)> = match egress.proxy_port {
        Some(_) => vec![("egress", "egress_of"), ("names", "names_of")],
        None => vec![("egress", "egress_of")],
    };
    let mut script = String::new();
    for (prefix, map) in chains {
        let chain = format!("{prefix}_{uid}");
        let Some(policy) = policy else {
            if existing {
                script.push_str(&format!(
                    "delete element inet {table} {map} {{ {uid} }}\n\
                     delete chain inet {table} {chain}\n"
                ));
            }
            continue;
        };
        let rules = match (prefix, egress.proxy_port) {
            ("names", Some(proxy)) => redirect_rules(policy, proxy),
            _ => policy_rules(policy, &egress.name_servers),
        };
        script.push_str(&format!(
            "add chain inet {table} {chain}\n\
             flush chain inet {table} {chain}\n\
             table inet {table} {{\n\tchain {chain} {{\n{rules}\t}}\n}}\n\
             add element inet {table} {map} {{ {uid} : goto {chain} }}\n"
        ));
    }
    script
}

/// Finds `nft` in `path_var` (a `PATH` value), then /usr/sbin and /sbin
/// (often missing from a non-login `PATH`).
pub fn find_nft(path_var: Option<&str>) -> Option<PathBuf> {
    path_var
        .unwrap_or("")
        .split(':')
        .filter(|d| !d.is_empty())
        .chain(["/usr/sbin", "/sbin"])
        .map(|d| Path::new(d).join("nft"))
        .find(|p| p.is_file())
}

/// Runs `script` through `nft -f -`.
async fn run_nft(
    nft: &Path,
    table: &str,
    what: &'static str,
    script: &str,
) -> Result<(), GuardError> {
    nft_output(nft, &["-f", "-"], Some(script), table, what)
        .await
        .map(drop)
}

/// Runs `nft args`, with `stdin` as its input, and returns what it printed.
async fn nft_output(
    nft: &Path,
    args: &[&str],
    stdin: Option<&str>,
    table: &str,
    what: &'static str,
) -> Result<String, GuardError> {
    let spawn_error = |source| GuardError::Spawn {
        nft: nft.to_owned(),
        source,
    };
    let mut child = tokio::process::Command::new(nft)
        .args(args)
        .env_clear()
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(spawn_error)?;
    if let (Some(mut pipe), Some(script)) = (child.stdin.take(), stdin) {
        pipe.write_all(script.as_bytes())
            .await
            .map_err(spawn_error)?;
    }
    let out = child.wait_with_output().await.map_err(spawn_error)?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(GuardError::Refused {
            what,
            table: table.to_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

/// One change to `own_ports`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    /// Lets `uid` connect to `port`; a pair another uid held on that port
    /// goes in the same transaction.
    Grant { uid: u32, port: u16 },
    /// Takes back the pair on `port`, if any.
    Revoke { port: u16 },
}

/// The element changes that make `changes`, in order, to an `own_ports`
/// that holds `granted` (port → uid), and the entries of `granted` they
/// change (`None`: removed). None: nothing to do.
fn batch(
    granted: &HashMap<u16, u32>,
    changes: &[Change],
) -> (Vec<PairChange>, HashMap<u16, Option<u32>>) {
    let mut elements = Vec::new();
    let mut updates: HashMap<u16, Option<u32>> = HashMap::new();
    for &change in changes {
        let port = match change {
            Change::Grant { port, .. } | Change::Revoke { port } => port,
        };
        let current = updates
            .get(&port)
            .copied()
            .unwrap_or_else(|| granted.get(&port).copied());
        let wanted = match change {
            Change::Grant { uid, .. } => Some(uid),
            Change::Revoke { .. } => None,
        };
        if current == wanted {
            continue;
        }
        if let Some(uid) = current {
            elements.push(PairChange::Delete { uid, port });
        }
        if let Some(uid) = wanted {
            elements.push(PairChange::Add { uid, port });
        }
        updates.insert(port, wanted);
    }
    (elements, updates)
}

/// Changes waiting for the batcher at most; a launch burst beyond it
/// waits to send its own.
const QUEUED_CHANGES: usize = 1024;
/// Changes one transaction takes at most, unless one request alone holds
/// more (see [`Guard::queue_grants`]).
const BATCH_MAX: usize = 512;

/// Changes made together, and where their outcome goes.
#[derive(Debug)]
struct Request {
    changes: Vec<Change>,
    done: oneshot::Sender<Result<(), GuardError>>,
}

/// One berth's guard: its table, and the task that changes `own_ports`.
///
/// Changes go through one task, which makes every change queued by the
/// time it is free in one netlink transaction ([`PairSet`]): a burst of
/// launches (or adoption after a restart) pays a system call per batch,
/// whatever the number of instances running.
#[derive(Debug)]
pub(crate) struct Guard {
    nft: PathBuf,
    table: String,
    /// See [`table_comment`].
    comment: Option<String>,
    uids: UidRange,
    ports: RangeInclusive<u16>,
    listeners: ListenerCap,
    egress: Egress,
    changes: mpsc::Sender<Request>,
    /// The batcher's receiving end until [`Guard::install`] starts it.
    pending: Mutex<Option<mpsc::Receiver<Request>>>,
    /// The accounts with an egress policy of their own in the table. Held
    /// while one is changed: changes are rare (an operator's, or a launch
    /// of a user whose policy another node changed), and one account's
    /// must not overtake another's.
    own_egress: tokio::sync::Mutex<HashMap<u32, EgressPolicy>>,
}

impl Guard {
    pub fn new(
        nft: PathBuf,
        data_dir: &Path,
        uids: UidRange,
        ports: RangeInclusive<u16>,
        listeners: ListenerCap,
        egress: Egress,
    ) -> Guard {
        let (changes, pending) = mpsc::channel(QUEUED_CHANGES);
        Guard {
            nft,
            table: table_name(data_dir),
            comment: table_comment(data_dir),
            uids,
            ports,
            listeners,
            egress,
            changes,
            pending: Mutex::new(Some(pending)),
            own_egress: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    /// (Re)creates the table with an empty `own_ports`, and `own` (the
    /// accounts with an egress policy of their own), in one transaction
    /// (the rules never lapse, and a previous berth's pairs are gone),
    /// then starts the task that changes `own_ports` over a netlink socket
    /// of its own. Call once, at berth's start, in a tokio runtime: the
    /// task and its socket end when the guard is dropped.
    pub async fn install(&self, own: &[(u32, EgressPolicy)]) -> Result<(), GuardError> {
        // Without a proxy, a policy's domains are unreachable but its
        // confinement holds: it fails closed.
        let listed: Vec<(u32, &EgressPolicy)> = own.iter().map(|(u, p)| (*u, p)).collect();
        let script = ruleset(
            &self.table,
            self.comment.as_deref(),
            self.uids,
            &self.ports,
            &self.listeners,
            &self.egress,
            &listed,
        );
        run_nft(&self.nft, &self.table, "creation", &script).await?;
        *self.own_egress.lock().await = own.iter().cloned().collect();
        let pending = self
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(requests) = pending {
            let own_ports =
                PairSet::open(&self.table, OWN_PORTS).map_err(|source| GuardError::PortChange {
                    table: self.table.clone(),
                    source,
                })?;
            tokio::spawn(apply_changes(self.table.clone(), own_ports, requests));
        }
        Ok(())
    }

    /// Lets `uid` connect to `port` (its own instance's). A pair another
    /// uid held on that port is deleted in the same transaction.
    pub async fn grant(&self, uid: u32, port: u16) -> Result<(), GuardError> {
        self.change(Change::Grant { uid, port }).await
    }

    /// Takes back the pair on `port`, if any.
    pub async fn revoke(&self, port: u16) -> Result<(), GuardError> {
        self.change(Change::Revoke { port }).await
    }

    /// Queues a grant of every `(uid, port)` pair, made in one transaction
    /// however many, and returns once it is queued, before it is made: a
    /// change queued after it is made after it. Adoption after a restart
    /// gives thousands of instances their ports back this way, without
    /// waiting on the guard for each; a grant that fails here is reported
    /// by the per-instance grant that follows it.
    pub async fn queue_grants(&self, pairs: &[(u32, u16)]) -> Result<(), GuardError> {
        let changes = pairs
            .iter()
            .map(|&(uid, port)| Change::Grant { uid, port })
            .collect();
        let (done, _unawaited) = oneshot::channel();
        self.changes
            .send(Request { changes, done })
            .await
            .map_err(|_| self.gone())
    }

    async fn change(&self, change: Change) -> Result<(), GuardError> {
        let (done, outcome) = oneshot::channel();
        self.changes
            .send(Request {
                changes: vec![change],
                done,
            })
            .await
            .map_err(|_| self.gone())?;
        outcome.await.map_err(|_| self.gone())?
    }

    /// Gives account `uid` its own egress `policy` (`None`: the node's
    /// again), from its next connection on; its open connections keep
    /// going. Doing nothing when it has that policy already, this costs a
    /// launch nothing unless the user's policy changed.
    pub async fn set_egress(
        &self,
        uid: u32,
        policy: Option<&EgressPolicy>,
    ) -> Result<(), GuardError> {
        if let Some(policy) = policy {
            self.can_apply(policy)?;
        }
        let mut own = self.own_egress.lock().await;
        if own.get(&uid) == policy {
            return Ok(());
        }
        let existing = own.contains_key(&uid);
        let script = own_egress(&self.table, uid, policy, &self.egress, existing);
        run_nft(&self.nft, &self.table, "egress change", &script).await?;
        match policy {
            Some(policy) => own.insert(uid, policy.clone()),
            None => own.remove(&uid),
        };
        Ok(())
    }

    /// Refuses a policy that needs the egress proxy where none listens.
    fn can_apply(&self, policy: &EgressPolicy) -> Result<(), GuardError> {
        if policy.needs_proxy() && self.egress.proxy_port.is_none() {
            return Err(GuardError::Refused {
                what: "egress change",
                table: self.table.clone(),
                stderr: "the policy allows domain names, and no egress proxy listens".to_owned(),
            });
        }
        Ok(())
    }

    fn gone(&self) -> GuardError {
        GuardError::Refused {
            what: "port change",
            table: self.table.clone(),
            stderr: "the guard's task is gone".to_owned(),
        }
    }

    /// Deletes this berth's table.
    pub async fn remove(&self) -> Result<(), GuardError> {
        Self::remove_table(&self.nft, &self.table).await
    }

    /// Deletes the table `table`, if there is one.
    pub async fn remove_table(nft: &Path, table: &str) -> Result<(), GuardError> {
        let script = format!("table inet {table} {{}}\ndelete table inet {table}\n");
        run_nft(nft, table, "removal", &script).await
    }

    /// The names of every berth's table on this host.
    pub async fn list_tables(nft: &Path) -> Result<Vec<String>, GuardError> {
        let listing = nft_output(nft, &["list", "tables", "inet"], None, "*", "listing").await?;
        Ok(berth_tables(&listing))
    }

    /// `table` as listed now, if its comment is one of berth's.
    pub async fn listed(nft: &Path, table: &str) -> Result<Option<ListedTable>, GuardError> {
        let listing = nft_output(
            nft,
            &["-a", "-t", "list", "table", "inet", table],
            None,
            table,
            "listing",
        )
        .await?;
        Ok(parse_listed_table(&listing))
    }

    /// Deletes the table `table` if it is still the one with `handle`: a
    /// berth that made it again meanwhile keeps its own.
    pub async fn remove_listed(nft: &Path, table: &str, handle: u64) -> Result<(), GuardError> {
        let script = format!("delete table inet handle {handle}\n");
        run_nft(nft, table, "removal", &script).await
    }
}

/// The set of `uid . port` pairs in berth's table.
const OWN_PORTS: &str = "own_ports";

/// The task behind [`Guard`]: takes every request queued (while they
/// hold fewer than [`BATCH_MAX`] changes), makes their changes in one
/// transaction, and answers each. When the transaction is refused, each
/// request of it is tried alone, so one bad request fails only itself.
/// Ends when the guard is dropped.
async fn apply_changes(table: String, own_ports: PairSet, mut requests: mpsc::Receiver<Request>) {
    let mut granted: HashMap<u16, u32> = HashMap::new();
    // `None` only while a transaction is under way, or after a panic in
    // one, when the next change opens a socket again.
    let mut own_ports = Some(own_ports);
    // Makes `changes` as one transaction; on success `granted` follows.
    async fn make(
        table: &str,
        own_ports: &mut Option<PairSet>,
        granted: &mut HashMap<u16, u32>,
        changes: &[Change],
    ) -> Result<(), GuardError> {
        let (elements, updates) = batch(granted, changes);
        if !elements.is_empty() {
            transaction(table, own_ports, elements).await?;
        }
        for (port, uid) in updates {
            match uid {
                Some(uid) => granted.insert(port, uid),
                None => granted.remove(&port),
            };
        }
        Ok(())
    }
    while let Some(first) = requests.recv().await {
        let mut count = first.changes.len();
        let mut taken = vec![first];
        while count < BATCH_MAX {
            match requests.try_recv() {
                Ok(request) => {
                    count += request.changes.len();
                    taken.push(request);
                }
                Err(_) => break,
            }
        }
        let changes: Vec<Change> = taken
            .iter()
            .flat_map(|r| r.changes.iter().copied())
            .collect();
        match make(&table, &mut own_ports, &mut granted, &changes).await {
            Ok(()) => {
                for request in taken {
                    let _ = request.done.send(Ok(()));
                }
            }
            Err(e) if taken.len() == 1 => {
                let _ = taken.remove(0).done.send(Err(e));
            }
            Err(_) => {
                for request in taken {
                    let outcome =
                        make(&table, &mut own_ports, &mut granted, &request.changes).await;
                    let _ = request.done.send(outcome);
                }
            }
        }
    }
}

/// Makes `elements` in one transaction on `own_ports`' socket, off the
/// async workers: the system call takes as long as the kernel's changes.
async fn transaction(
    table: &str,
    own_ports: &mut Option<PairSet>,
    elements: Vec<PairChange>,
) -> Result<(), GuardError> {
    let failed = |source| GuardError::PortChange {
        table: table.to_owned(),
        source,
    };
    let mut set = match own_ports.take() {
        Some(set) => set,
        None => PairSet::open(table, OWN_PORTS).map_err(failed)?,
    };
    let made = tokio::task::spawn_blocking(move || {
        let made = set.apply(&elements);
        (set, made)
    })
    .await;
    match made {
        Ok((set, made)) => {
            *own_ports = Some(set);
            made.map_err(failed)
        }
        Err(panicked) => Err(failed(NftSetError::Answer(format!(
            "the transaction's thread failed: {panicked}"
        )))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ruleset_guards_only_the_account_range() {
        let uids = UidRange {
            first: 200_000,
            count: 1000,
        };
        let listeners = ListenerCap {
            ports: vec![8000, 9464],
            per_account: 50,
        };
        let script = ruleset(
            "berth_0a1b2c3d",
            Some("berth data dir /var/lib/berth"),
            uids,
            &(20000..=20099),
            &listeners,
            &Egress {
                policy: EgressPolicy {
                    mode: egress::EgressMode::AllowAll,
                    allow: vec!["10.1.0.0/16".parse().unwrap(), "fd12::/16".parse().unwrap()],
                },
                name_servers: vec!["10.255.255.53".parse().unwrap()],
                proxy_port: None,
            },
            &[],
        );
        assert!(
            script.starts_with("table inet berth_0a1b2c3d {}\ndelete table inet berth_0a1b2c3d\n")
        );
        for rule in [
            "comment \"berth data dir /var/lib/berth\"",
            "tcp dport 20000-20099 meta skuid . tcp dport @own_ports accept",
            "tcp dport 20000-20099 reject with tcp reset",
            "ip daddr { 100.100.100.200/32, 168.63.129.16/32, 169.254.169.254/32, \
             169.254.170.2/32 } reject",
            "ip6 daddr { fd00:ec2::254/128 } reject",
            "ip daddr { 10.255.255.53/32 } meta l4proto { tcp, udp } th dport 53 accept",
            "ip daddr { 10.1.0.0/16 } accept",
            "ip6 daddr { fd12::/16 } accept",
            "ip daddr { 10.0.0.0/8, 100.64.0.0/10, 169.254.0.0/16, 172.16.0.0/12, \
             192.168.0.0/16 } reject",
            "ip6 daddr { fc00::/7, fe80::/10 } reject",
            "fib daddr type local ip daddr != 127.0.0.0/8 reject",
            "tcp dport { 8000, 9464 } fib daddr type local ct state new \
             add @berth_conns { meta skuid ct count over 50 } reject with tcp reset",
            "set berth_conns {\n\t\ttype uid\n\t\tsize 65535\n\t\tflags dynamic\n\t}",
        ] {
            assert!(script.contains(rule), "{rule} missing from\n{script}");
        }
        // Refusals no allowance overrides come first, then what is allowed,
        // then the private ranges.
        let at = |rule: &str| script.find(rule).unwrap();
        assert!(at("169.254.169.254/32") < at("fib daddr type local ip daddr"));
        assert!(at("fib daddr type local ip daddr") < at("th dport 53 accept"));
        assert!(at("th dport 53 accept") < at("{ 10.1.0.0/16 } accept"));
        assert!(at("{ 10.1.0.0/16 } accept") < at("10.0.0.0/8"));
        // Every packet not an instance's costs the output chain one match.
        let output = script.split("chain output").nth(1).unwrap();
        let rules: Vec<&str> = output
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with("type ") && !l.starts_with('}'))
            .filter(|l| *l != "{")
            .collect();
        assert_eq!(
            rules,
            ["meta skuid 200000-200999 jump instance"],
            "{output}"
        );
        // No listener, or no cap: no set and no rule.
        for none in [
            ListenerCap::default(),
            ListenerCap {
                ports: vec![],
                per_account: 50,
            },
            ListenerCap {
                ports: vec![8000],
                per_account: 0,
            },
        ] {
            let script = ruleset(
                "berth_x",
                None,
                uids,
                &(20000..=20099),
                &none,
                &Egress::default(),
                &[],
            );
            assert!(!script.contains("berth_conns"), "{script}");
        }
    }

    #[test]
    fn a_confined_ruleset_allows_only_its_networks_and_sends_names_to_the_proxy() {
        let uids = UidRange {
            first: 200_000,
            count: 1000,
        };
        let egress = Egress {
            policy: EgressPolicy {
                mode: egress::EgressMode::Allowlist,
                allow: [
                    "pypi.org",
                    "*.github.com:22",
                    "10.8.0.0/24:5432",
                    "fd12::/16",
                ]
                .iter()
                .map(|d| d.parse().unwrap())
                .collect(),
            },
            name_servers: vec!["10.255.255.53".parse().unwrap()],
            proxy_port: Some(41234),
        };
        let script = ruleset(
            "t",
            None,
            uids,
            &(20000..=20099),
            &ListenerCap::default(),
            &egress,
            &[],
        );
        let instance = script.split("chain instance").nth(1).unwrap();
        let instance = instance.split("chain output").next().unwrap();
        for rule in [
            "ip daddr { 10.8.0.0/24 } meta l4proto { tcp, udp } th dport 5432 accept",
            "ip6 daddr { fd12::/16 } accept",
            "ip daddr 127.0.0.0/8 accept\n\t\tip6 daddr ::1 accept\n\t\treject\n",
            "meta l4proto { tcp, udp } th dport 53 reject",
        ] {
            assert!(instance.contains(rule), "{rule} missing from\n{instance}");
        }
        // Confined, no name server is reached directly.
        assert!(!instance.contains("10.255.255.53"), "{instance}");
        // Confined: the private ranges need no rule of their own.
        assert!(!instance.contains("192.168.0.0/16"), "{instance}");
        let redirect = script.split("chain egress_names").nth(1).unwrap();
        // An account's own policy first, then DNS: a resolver on loopback
        // is no way around the filter.
        assert!(
            redirect.starts_with(
                " {\n\t\tmeta skuid vmap @names_of\n\t\tudp dport 53 redirect to :41234\n"
            ),
            "{redirect}"
        );
        for rule in [
            "ip daddr { 10.8.0.0/24 } return",
            "ip daddr { 100.100.100.200/32, 168.63.129.16/32, 169.254.169.254/32, \
             169.254.170.2/32 } return",
            "tcp dport { 22, 80, 443 } redirect to :41234",
        ] {
            assert!(redirect.contains(rule), "{rule} missing from\n{redirect}");
        }
        // No proxy, or no domain: no redirection.
        for (proxy_port, allow) in [(None, "pypi.org"), (Some(41234), "10.8.0.0/24")] {
            let egress = Egress {
                policy: EgressPolicy {
                    mode: egress::EgressMode::Allowlist,
                    allow: vec![allow.parse().unwrap()],
                },
                name_servers: Vec::new(),
                proxy_port,
            };
            let script = ruleset(
                "t",
                None,
                uids,
                &(1..=2),
                &ListenerCap::default(),
                &egress,
                &[],
            );
            assert!(!script.contains("redirect to"), "{script}");
        }
    }

    #[test]
    fn an_accounts_own_policy_replaces_the_nodes_for_it_alone() {
        let uids = UidRange {
            first: 200_000,
            count: 1000,
        };
        let egress = Egress {
            policy: EgressPolicy::default(),
            name_servers: vec!["10.255.255.53".parse().unwrap()],
            proxy_port: Some(41234),
        };
        let own = EgressPolicy {
            mode: egress::EgressMode::Allowlist,
            allow: vec!["pypi.org".parse().unwrap()],
        };
        let script = ruleset(
            "t",
            None,
            uids,
            &(1..=2),
            &ListenerCap::default(),
            &egress,
            &[(200_007, &own)],
        );
        let instance = script.split("chain instance").nth(1).unwrap();
        let instance = instance.split("chain output").next().unwrap();
        // After the refusals no policy lifts, before the node's rules.
        let at = |rule: &str| instance.find(rule).unwrap();
        assert!(at("fib daddr type local ip6") < at("meta skuid vmap @egress_of"));
        assert!(at("meta skuid vmap @egress_of") < at("th dport 53 accept"));
        // Its chains hold its own rules, and the maps send it there.
        let filter = script.split("chain egress_200007 {").nth(1).unwrap();
        let filter = filter.split("\n\t}\n").next().unwrap();
        assert!(filter.contains("th dport 53 reject"), "{filter}");
        assert!(filter.ends_with("\t\treject"), "{filter}");
        let names = script.split("chain names_200007 {").nth(1).unwrap();
        assert!(
            names.contains("tcp dport { 80, 443 } redirect to :41234"),
            "{names}"
        );
        for line in [
            "add element inet t egress_of { 200007 : goto egress_200007 }",
            "add element inet t names_of { 200007 : goto names_200007 }",
        ] {
            assert!(script.contains(line), "{line} missing from\n{script}");
        }
        // Back to the node's: the elements go before their chains.
        let back = own_egress("t", 200_007, None, &egress, true);
        assert_eq!(
            back,
            "delete element inet t egress_of { 200007 }\n\
             delete chain inet t egress_200007\n\
             delete element inet t names_of { 200007 }\n\
             delete chain inet t names_200007\n"
        );
        assert_eq!(own_egress("t", 200_007, None, &egress, false), "");
        // An allow_all of its own sends nothing to the proxy, whatever
        // the node's does.
        let open = own_egress("t", 9, Some(&EgressPolicy::default()), &egress, false);
        let names = open.split("chain names_9 {").nth(1).unwrap();
        assert!(names.starts_with("\n\t}"), "{open}");
    }

    #[test]
    fn overlapping_allowances_are_merged_for_nft() {
        let nets: Vec<IpNet> = ["10.1.0.0/16", "10.1.2.0/24", "10.1.2.3/32"]
            .iter()
            .map(|n| n.parse().unwrap())
            .collect();
        assert_eq!(
            by_family(&nets, "accept"),
            "\t\tip daddr { 10.1.0.0/16 } accept\n"
        );
        assert_eq!(by_family(&[], "accept"), "");
    }

    #[test]
    fn table_names_differ_per_data_dir_and_are_nft_identifiers() {
        let a = table_name(Path::new("/var/lib/berth"));
        let b = table_name(Path::new("/var/lib/berth2"));
        assert_ne!(a, b);
        assert_eq!(a, table_name(Path::new("/var/lib/berth")));
        assert_eq!(a.len(), "berth_".len() + 8);
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
        // Only names of that form are taken for berth's in a listing.
        let listing = format!(
            "table inet {a}\ntable inet berth_12ab\ntable inet berth_0123456z\n\
             table ip berth_0a1b2c3d\ntable inet filter\n"
        );
        assert_eq!(berth_tables(&listing), [a]);
    }

    #[test]
    fn a_batch_makes_its_changes_in_order_against_what_is_granted() {
        let granted = HashMap::from([(20001, 200_001), (20002, 200_002)]);
        let (elements, updates) = batch(
            &granted,
            &[
                Change::Grant {
                    uid: 200_001,
                    port: 20001,
                },
                Change::Grant {
                    uid: 200_003,
                    port: 20002,
                },
                Change::Revoke { port: 20009 },
                Change::Grant {
                    uid: 200_004,
                    port: 20004,
                },
                Change::Revoke { port: 20004 },
                Change::Revoke { port: 20001 },
            ],
        );
        assert_eq!(
            elements,
            [
                PairChange::Delete {
                    uid: 200_002,
                    port: 20002
                },
                PairChange::Add {
                    uid: 200_003,
                    port: 20002
                },
                PairChange::Add {
                    uid: 200_004,
                    port: 20004
                },
                PairChange::Delete {
                    uid: 200_004,
                    port: 20004
                },
                PairChange::Delete {
                    uid: 200_001,
                    port: 20001
                },
            ]
        );
        assert_eq!(
            updates,
            HashMap::from([(20002, Some(200_003)), (20004, None), (20001, None)])
        );
        let (elements, updates) = batch(
            &granted,
            &[Change::Grant {
                uid: 200_002,
                port: 20002,
            }],
        );
        assert!(elements.is_empty() && updates.is_empty(), "already granted");
    }

    #[test]
    fn a_tables_comment_names_its_data_dir_for_a_later_berth() {
        let dir = Path::new("/var/lib/berth two");
        let comment = table_comment(dir).unwrap();
        // As `nft -t list table` prints it.
        let listing = format!(
            "table inet berth_0a1b2c3d {{ # handle 4412\n\tcomment \"{comment}\"\n\
             \tset own_ports {{ # handle 2\n\t}}\n}}\n"
        );
        assert_eq!(
            parse_listed_table(&listing),
            Some(ListedTable {
                data_dir: dir.to_owned(),
                handle: 4412
            })
        );
        let no_comment = "table inet berth_0a1b2c3d { # handle 7\n}\n";
        assert_eq!(parse_listed_table(no_comment), None);
        let other = "table inet x { # handle 7\n\tcomment \"other\"\n}\n";
        assert_eq!(parse_listed_table(other), None);
        // Paths nft cannot quote, or too long for a comment: no comment.
        assert_eq!(table_comment(Path::new("/a\"b")), None);
        assert_eq!(table_comment(&Path::new("/").join("d".repeat(120))), None);
        assert_eq!(
            berth_tables(
                "table inet berth_0a1b2c3d\ntable ip nat\ntable inet berth_zz\ntable inet filter\n"
            ),
            ["berth_0a1b2c3d"]
        );
    }

    #[test]
    fn nft_is_found_outside_path_too() {
        // PATH first.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("nft"), "").unwrap();
        let path = format!("/nonexistent::{}", dir.path().display());
        assert_eq!(find_nft(Some(&path)), Some(dir.path().join("nft")));
        let found = find_nft(Some("/nonexistent"));
        if Path::new("/usr/sbin/nft").is_file() {
            assert_eq!(found, Some(PathBuf::from("/usr/sbin/nft")));
        }
        assert_eq!(
            find_nft(Some("")).is_some(),
            ["/usr/sbin/nft", "/sbin/nft"]
                .iter()
                .any(|p| Path::new(p).is_file())
        );
    }

    /// `nft` output for `args`, numeric, as the host's `nft` gives it.
    fn nft_list(args: &[&str]) -> String {
        let out = std::process::Command::new(find_nft(None).unwrap())
            .arg("-nn")
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The guard's whole life against the host's real `nft` and netlink:
    /// the table made, ports granted, moved and revoked, an account's own
    /// egress policy set and dropped, and the table found, listed and
    /// removed. Each step is read back from the kernel.
    #[tokio::test]
    async fn a_guards_table_ports_and_policies_are_made_and_undone_in_the_kernel() {
        let nft = find_nft(Some(""));
        if !crate::test_host::has(
            nix::unistd::geteuid().is_root() && nft.is_some(),
            "root and nft",
        ) {
            return;
        }
        let Some(nft) = nft else { return };
        let data_dir = tempfile::tempdir().unwrap();
        let uids = UidRange {
            first: 4_180_000,
            count: 100,
        };
        let egress = Egress::default();
        let guard = Guard::new(
            nft.clone(),
            data_dir.path(),
            uids,
            20000..=20099,
            ListenerCap::default(),
            egress,
        );
        let table = guard.table().to_owned();
        assert_eq!(table, table_name(data_dir.path()));
        // A failed step leaves no table behind.
        struct Removed<'a>(&'a Path, &'a str);
        impl Drop for Removed<'_> {
            fn drop(&mut self) {
                let _ = std::process::Command::new(self.0)
                    .args(["delete", "table", "inet", self.1])
                    .stderr(Stdio::null())
                    .status();
            }
        }
        let _removed = Removed(&nft, &table);
        guard.install(&[]).await.unwrap();
        assert!(Guard::list_tables(&nft).await.unwrap().contains(&table));
        let listed = Guard::listed(&nft, &table).await.unwrap().unwrap();
        assert_eq!(listed.data_dir, data_dir.path());

        let pairs = || {
            let set = nft_list(&["list", "set", "inet", &table, OWN_PORTS]);
            let mut pairs: Vec<String> = set
                .split(['{', '}', ','])
                .map(str::trim)
                .filter(|e| {
                    e.split_once(" . ").is_some_and(|(uid, port)| {
                        uid.parse::<u32>().is_ok() && port.parse::<u16>().is_ok()
                    })
                })
                .map(str::to_owned)
                .collect();
            pairs.sort();
            pairs
        };
        guard.grant(4_180_001, 20001).await.unwrap();
        guard
            .queue_grants(&[(4_180_002, 20002), (4_180_003, 20003)])
            .await
            .unwrap();
        // Made in order: the grant queued after the batch follows it.
        guard.grant(4_180_004, 20002).await.unwrap();
        assert_eq!(
            pairs(),
            ["4180001 . 20001", "4180003 . 20003", "4180004 . 20002"]
        );
        guard.revoke(20001).await.unwrap();
        guard.revoke(20009).await.unwrap();
        assert_eq!(pairs(), ["4180003 . 20003", "4180004 . 20002"]);
        // A pair deleted behind the guard's back cannot be revoked: the
        // kernel refuses the delete, and with it the whole transaction.
        // Queued together with another account's grant, the revoke fails
        // alone: each request of a refused batch is tried again by itself.
        // (This test's runtime has one thread, so both are queued before
        // the guard's task takes either.)
        let deleted = std::process::Command::new(&nft)
            .args(["delete", "element", "inet", &table, OWN_PORTS])
            .arg("{ 4180003 . 20003 }")
            .status()
            .unwrap();
        assert!(deleted.success());
        let (revoked, granted) = tokio::join!(guard.revoke(20003), guard.grant(4_180_006, 20006));
        assert!(revoked.is_err(), "a missing pair's revoke: {revoked:?}");
        granted.unwrap();
        assert_eq!(pairs(), ["4180004 . 20002", "4180006 . 20006"]);

        // An account's own policy: chains of its own, until it is dropped.
        let own = EgressPolicy {
            mode: egress::EgressMode::Allowlist,
            allow: vec!["192.0.2.0/24".parse().unwrap()],
        };
        let chains = || nft_list(&["list", "table", "inet", &table]);
        guard.set_egress(4_180_003, Some(&own)).await.unwrap();
        assert!(chains().contains("chain egress_4180003"), "{}", chains());
        guard.set_egress(4_180_003, Some(&own)).await.unwrap();
        guard.set_egress(4_180_003, None).await.unwrap();
        assert!(!chains().contains("egress_4180003"), "{}", chains());
        // A policy of names where no egress proxy listens is refused, and
        // changes nothing.
        let names = EgressPolicy {
            mode: egress::EgressMode::Allowlist,
            allow: vec!["example.com".parse().unwrap()],
        };
        assert!(guard.set_egress(4_180_005, Some(&names)).await.is_err());
        assert!(!chains().contains("egress_4180005"), "{}", chains());

        // A removal by an old handle spares a table made again since.
        guard.remove().await.unwrap();
        assert!(!Guard::list_tables(&nft).await.unwrap().contains(&table));
        guard.install(&[]).await.unwrap();
        assert!(
            Guard::remove_listed(&nft, &table, listed.handle)
                .await
                .is_err()
        );
        assert!(Guard::list_tables(&nft).await.unwrap().contains(&table));
        let again = Guard::listed(&nft, &table).await.unwrap().unwrap();
        Guard::remove_listed(&nft, &table, again.handle)
            .await
            .unwrap();
        assert!(!Guard::list_tables(&nft).await.unwrap().contains(&table));
    }
}
