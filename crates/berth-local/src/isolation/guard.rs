//! The port and egress guards: nftables rules in a table of berth's own.
//!
//! Construction: owner matching (`meta skuid`) on the `output` hook, in
//! one `inet` table per berth (named after its data dir, so berths on one
//! host never touch each other's rules). Every rule applies only to
//! sockets owned by a uid of the configured account range; berth (root)
//! and every other local user are untouched.
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
//! * **egress guard**: instance uids may not reach 169.254.169.254 and
//!   fd00:ec2::254 (cloud metadata), 100.100.100.200 (Alibaba's metadata),
//!   nor any address of this host but loopback (`fib daddr type local`,
//!   which follows addresses as they come and go).
//!
//! Refused connections are rejected (a TCP reset, or ICMP unreachable),
//! not dropped, so a program learns at once instead of hanging.
//!
//! Why this over a network namespace per instance: it keeps instances on
//! the host's loopback, where berth's proxy reaches them at the address
//! they print, costs one `nft` run per launch instead of a veth pair and
//! addresses per instance, and the rules survive berth: an instance
//! adopted after a restart is never unguarded. The table is recreated
//! atomically (one `nft -f` transaction) at start, which drops entries a
//! previous berth left; adopted instances add theirs back.

use std::collections::HashMap;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;

use tokio::io::AsyncWriteExt;

use super::UidRange;

/// Addresses of cloud metadata services.
const METADATA_V4: [&str; 2] = ["169.254.169.254", "100.100.100.200"];
const METADATA_V6: [&str; 1] = ["fd00:ec2::254"];

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
    pub ports: Vec<u16>,
    pub per_account: u32,
}

/// The whole table as an `nft -f` script that replaces any table of that
/// name in one transaction. `own_ports` starts empty.
pub fn ruleset(
    table: &str,
    uids: UidRange,
    ports: &RangeInclusive<u16>,
    listeners: &ListenerCap,
) -> String {
    let last = uids.last().unwrap_or(uids.first);
    let who = format!("meta skuid {}-{}", uids.first, last);
    let range = format!("{}-{}", ports.start(), ports.end());
    let v4 = METADATA_V4.join(", ");
    let v6 = METADATA_V6.join(", ");
    let (conns_set, conns_rule) = match listeners.ports.as_slice() {
        [] => (String::new(), String::new()),
        _ if listeners.per_account == 0 => (String::new(), String::new()),
        listening => {
            let list: Vec<String> = listening.iter().map(u16::to_string).collect();
            (
                "\tset berth_conns {\n\t\ttype uid\n\t\tsize 65535\n\t\tflags dynamic\n\t}\n"
                    .to_owned(),
                format!(
                    "\t\t{who} tcp dport {{ {} }} fib daddr type local ct state new \
                     add @berth_conns {{ meta skuid ct count over {} }} reject with tcp reset\n",
                    list.join(", "),
                    listeners.per_account
                ),
            )
        }
    };
    format!(
        "table inet {table} {{}}\n\
         delete table inet {table}\n\
         table inet {table} {{\n\
         \tset own_ports {{\n\
         \t\ttype uid . inet_service\n\
         \t}}\n\
         {conns_set}\
         \tchain output {{\n\
         \t\ttype filter hook output priority filter; policy accept;\n\
         {conns_rule}\
         \t\t{who} tcp dport {range} meta skuid . tcp dport @own_ports accept\n\
         \t\t{who} tcp dport {range} reject with tcp reset\n\
         \t\t{who} ip daddr {{ {v4} }} reject\n\
         \t\t{who} ip6 daddr {{ {v6} }} reject\n\
         \t\t{who} fib daddr type local ip daddr != 127.0.0.0/8 reject\n\
         \t\t{who} fib daddr type local ip6 daddr != ::1 reject\n\
         \t}}\n\
         }}\n"
    )
}

/// `add element` / `delete element` lines for `own_ports`.
pub fn element(table: &str, verb: &str, uid: u32, port: u16) -> String {
    format!("{verb} element inet {table} own_ports {{ {uid} . {port} }}\n")
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
    let spawn_error = |source| GuardError::Spawn {
        nft: nft.to_owned(),
        source,
    };
    let mut child = tokio::process::Command::new(nft)
        .args(["-f", "-"])
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(spawn_error)?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .await
            .map_err(spawn_error)?;
    }
    let out = child.wait_with_output().await.map_err(spawn_error)?;
    if out.status.success() {
        Ok(())
    } else {
        Err(GuardError::Refused {
            what,
            table: table.to_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

/// One berth's guard: its table, and the `own_ports` pairs it added.
#[derive(Debug)]
pub(crate) struct Guard {
    nft: PathBuf,
    table: String,
    uids: UidRange,
    ports: RangeInclusive<u16>,
    listeners: ListenerCap,
    /// port → uid of every pair in `own_ports`.
    granted: Mutex<HashMap<u16, u32>>,
}

impl Guard {
    pub fn new(
        nft: PathBuf,
        table: String,
        uids: UidRange,
        ports: RangeInclusive<u16>,
        listeners: ListenerCap,
    ) -> Guard {
        Guard {
            nft,
            table,
            uids,
            ports,
            listeners,
            granted: Mutex::new(HashMap::new()),
        }
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    /// (Re)creates the table with an empty `own_ports`, in one
    /// transaction: the rules never lapse, and a previous berth's pairs are
    /// gone.
    pub async fn install(&self) -> Result<(), GuardError> {
        let script = ruleset(&self.table, self.uids, &self.ports, &self.listeners);
        run_nft(&self.nft, &self.table, "creation", &script).await?;
        self.granted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        Ok(())
    }

    /// Lets `uid` connect to `port` (its own instance's). A pair another
    /// uid held on that port is deleted in the same transaction.
    pub async fn grant(&self, uid: u32, port: u16) -> Result<(), GuardError> {
        let previous = {
            let granted = self.granted.lock().unwrap_or_else(|e| e.into_inner());
            granted.get(&port).copied()
        };
        if previous == Some(uid) {
            return Ok(());
        }
        let mut script = String::new();
        if let Some(old) = previous {
            script.push_str(&element(&self.table, "delete", old, port));
        }
        script.push_str(&element(&self.table, "add", uid, port));
        run_nft(&self.nft, &self.table, "port grant", &script).await?;
        self.granted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(port, uid);
        Ok(())
    }

    /// Takes back the pair on `port`, if any.
    pub async fn revoke(&self, port: u16) -> Result<(), GuardError> {
        let Some(uid) = ({
            let mut granted = self.granted.lock().unwrap_or_else(|e| e.into_inner());
            granted.remove(&port)
        }) else {
            return Ok(());
        };
        run_nft(
            &self.nft,
            &self.table,
            "port revocation",
            &element(&self.table, "delete", uid, port),
        )
        .await
    }

    /// Deletes this berth's table, if there is one (at level `none`, so a
    /// table left by an earlier run at another level does not linger).
    pub async fn remove_table(nft: &Path, table: &str) -> Result<(), GuardError> {
        let script = format!("table inet {table} {{}}\ndelete table inet {table}\n");
        run_nft(nft, table, "removal", &script).await
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
        let script = ruleset("berth_0a1b2c3d", uids, &(20000..=20099), &listeners);
        assert!(
            script.starts_with("table inet berth_0a1b2c3d {}\ndelete table inet berth_0a1b2c3d\n")
        );
        for rule in [
            "meta skuid 200000-200999 tcp dport 20000-20099 meta skuid . tcp dport @own_ports accept",
            "meta skuid 200000-200999 tcp dport 20000-20099 reject with tcp reset",
            "meta skuid 200000-200999 ip daddr { 169.254.169.254, 100.100.100.200 } reject",
            "meta skuid 200000-200999 fib daddr type local ip daddr != 127.0.0.0/8 reject",
            "meta skuid 200000-200999 tcp dport { 8000, 9464 } fib daddr type local ct state new \
             add @berth_conns { meta skuid ct count over 50 } reject with tcp reset",
            "set berth_conns {\n\t\ttype uid\n\t\tsize 65535\n\t\tflags dynamic\n\t}",
        ] {
            assert!(script.contains(rule), "{rule} missing from\n{script}");
        }
        // No listener, or no cap: no set and no rule.
        for none in [
            ListenerCap::default(),
            ListenerCap {
                ports: vec![8000],
                per_account: 0,
            },
        ] {
            let script = ruleset("berth_x", uids, &(20000..=20099), &none);
            assert!(!script.contains("berth_conns"), "{script}");
        }
        assert_eq!(
            element("berth_x", "add", 200_001, 20005),
            "add element inet berth_x own_ports { 200001 . 20005 }\n"
        );
    }

    #[test]
    fn table_names_differ_per_data_dir_and_are_nft_identifiers() {
        let a = table_name(Path::new("/var/lib/berth"));
        let b = table_name(Path::new("/var/lib/berth2"));
        assert_ne!(a, b);
        assert_eq!(a, table_name(Path::new("/var/lib/berth")));
        assert_eq!(a.len(), "berth_".len() + 8);
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
    }

    #[test]
    fn nft_is_found_outside_path_too() {
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
}
