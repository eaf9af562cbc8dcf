//! Isolation of instances from berth and from each other.
//!
//! Three levels:
//!
//! * `none`: the program runs as berth's own user. For development only.
//! * `user`: every user's instances run under a uid and gid of their own
//!   (allocated once, recorded in the store's `accounts`), with no
//!   supplementary groups, every capability dropped, `no_new_privs` and
//!   rlimits; the data root belongs to that uid. Every process of an
//!   instance lives in a cgroup of its own ([`cgroup`], v1 or v2, with
//!   limits on memory, pids and CPU), which no process can leave: freeze,
//!   stop and kill reach all of them, whatever their session or group.
//!   nftables rules in berth's own table (`guard`) keep instance uids off
//!   other instances' ports and off cloud metadata and the host's own
//!   addresses.
//! * `sandbox`: `user`, plus a mount namespace (system read-only, private
//!   `/tmp`, a minimal `/etc` with a passwd and group entry for the user,
//!   berth's data dir hidden but for the user's own root) and a pid
//!   namespace.
//!
//! berth decides (this module, on plain data); the shim carries it out
//! just before it executes the program (`child`), so the privileged work
//! happens in one small process per instance and never in berth's async
//! code. `fsafe` is how berth and the shim touch a user's root without
//! ever following a symbolic link the user planted there.

pub(crate) mod access;
pub mod cgroup;
pub(crate) mod child;
pub(crate) mod etc;
pub(crate) mod fsafe;
pub(crate) mod guard;
pub(crate) mod leftovers;
pub(crate) mod relay;
pub mod sweep;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use berth_core::UidRange;
pub use guard::ListenerCap;
pub use guard::table_name as nft_table_name;

/// Isolation level.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    /// Instances run as berth's own user: not isolated from berth or from
    /// each other.
    #[default]
    None,
    /// A uid and a cgroup per instance, no capabilities, port and egress
    /// guards.
    User,
    /// `user` plus mount and pid namespaces.
    Sandbox,
}

impl Isolation {
    /// The level's name as configured and logged (`none`, `user`,
    /// `sandbox`).
    pub fn as_str(self) -> &'static str {
        match self {
            Isolation::None => "none",
            Isolation::User => "user",
            Isolation::Sandbox => "sandbox",
        }
    }

    /// Whether instances run under their users' own uids.
    pub fn per_user_uid(self) -> bool {
        self != Isolation::None
    }
}

impl std::fmt::Display for Isolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Isolation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Isolation::None),
            "user" => Ok(Isolation::User),
            "sandbox" => Ok(Isolation::Sandbox),
            other => Err(format!(
                "unknown isolation mode {other:?} (expected \"none\", \"user\" or \"sandbox\")"
            )),
        }
    }
}

/// Resource limits of one instance, applied through its cgroup at levels
/// `user` and `sandbox`. `pids_max` also caps the uid's processes
/// (`RLIMIT_NPROC`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Memory (and, where the kernel accounts it, memory plus swap) in MiB.
    pub memory_max_mb: u64,
    /// Processes and threads.
    pub pids_max: u64,
    /// CPU time as a percentage of one CPU (200 = two CPUs); 0 = no limit.
    pub cpu_max_percent: u32,
    /// Open files of each process (`RLIMIT_NOFILE`, soft and hard). No
    /// cgroup bounds descriptors, so capacity × this can pass the host's
    /// `fs.file-max`: see [`open_files_warning`].
    #[serde(default = "default_open_files_max")]
    pub open_files_max: u64,
}

/// The open-files limit of a program when none is configured.
pub const DEFAULT_OPEN_FILES_MAX: u64 = 65_536;

fn default_open_files_max() -> u64 {
    DEFAULT_OPEN_FILES_MAX
}

/// The warning due when `capacity` instances of `open_files_max` files
/// each could hold more than the host's `fs.file-max`: the kernel then
/// refuses files to every unprivileged process of the host (every other
/// user's instance among them), though not to berth, which runs as root.
pub fn open_files_warning(open_files_max: u64, capacity: u64, file_max: u64) -> Option<String> {
    let total = open_files_max.saturating_mul(capacity);
    (total > file_max).then(|| {
        format!(
            "instances may open {open_files_max} files each ([isolation] open_files_max) and \
             {capacity} may run ([cluster] capacity, or the size of port_range): {total} in all, \
             more than this host's fs.file-max ({file_max}); a few users' programs could take \
             every open file of the host from the others. Lower open_files_max or capacity, or \
             raise fs.file-max (sysctl)"
        )
    })
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_max_mb: 1024,
            pids_max: 256,
            cpu_max_percent: 100,
            open_files_max: default_open_files_max(),
        }
    }
}

/// The account a user's instances run under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Account {
    pub uid: u32,
    /// The same number as the uid: every account has its own group.
    pub gid: u32,
    /// `USER`, `LOGNAME` and the passwd entry's name: the slug.
    pub name: String,
}

impl Account {
    /// The account of the user filed under `slug`, whose host uid is `uid`.
    pub fn of(slug: String, uid: u32) -> Account {
        Account {
            uid,
            gid: uid,
            name: slug,
        }
    }
}

/// The isolation part of a shim spec: what the shim sets up before it
/// executes the program.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IsolationSpec {
    /// The account's uid, which the program runs as.
    pub uid: u32,
    /// The account's gid, its only group.
    pub gid: u32,
    /// The account name (passwd entry, `USER`, `LOGNAME`).
    pub name: String,
    /// The rlimits the child sets before it executes the program.
    pub limits: Limits,
    /// Where the instance's cgroup goes, and its limits: at levels `user`
    /// and `sandbox`, on every host where berth could set up the cgroup
    /// parents at start.
    pub cgroup: Option<cgroup::CgroupSpec>,
    /// Present at level `sandbox`.
    pub sandbox: Option<SandboxSpec>,
}

/// What `sandbox` adds to `user`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxSpec {
    /// berth's data dir: covered by an empty tmpfs in the sandbox...
    pub data_dir: PathBuf,
    /// ...into which only the user's own root is mounted back, at its
    /// usual path, writable.
    pub user_root: PathBuf,
    /// The user's home (the passwd entry's).
    pub home: PathBuf,
}

/// berth's side of isolation at levels `user` and `sandbox`, made at start
/// by [`Isolator::prepare`].
pub(crate) struct Isolator {
    pub level: Isolation,
    /// The port and egress guards.
    pub guard: guard::Guard,
    /// Where instance cgroups go (levels `user` and `sandbox`).
    pub cgroups: Option<cgroup::Parents>,
}

impl Isolator {
    /// Checks that this host can isolate at `level` and sets it up: the
    /// guard's table (made afresh) and, for a sandbox, the cgroup parents.
    /// `config.data_dir` is canonical. At level `none` it returns `None`,
    /// after removing a table an earlier run at another level may have
    /// left.
    pub async fn prepare(
        config: &crate::LocalRuntimeConfig,
        own_egress: &[(u32, berth_core::egress::EgressPolicy)],
    ) -> Result<Option<Isolator>, HostError> {
        let (level, data_dir, uids) = (config.isolation, config.data_dir.as_path(), config.uids);
        let nft = config.nft.as_deref();
        let looked = match nft {
            Some(path) => format!("at {}", path.display()),
            None => "in PATH, /usr/sbin and /sbin".to_owned(),
        };
        let nft = resolve_nft(nft);
        let table = guard::table_name(data_dir);
        if level == Isolation::None {
            if let Some(nft) = nft.filter(|_| nix::unistd::geteuid().is_root()) {
                // Usually there is none: refused quietly.
                let _ = guard::Guard::remove_table(&nft, &table).await;
            }
            return Ok(None);
        }
        if !nix::unistd::geteuid().is_root() {
            return Err(HostError::NotRoot(level));
        }
        if uids.last().is_none() || uids.first == 0 {
            return Err(HostError::Config(format!(
                "the account uid range {}+{} is empty, passes the largest uid or includes root",
                uids.first, uids.count
            )));
        }
        let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
        let clashes = host_accounts_in(&passwd, uids);
        if !clashes.is_empty() {
            let names: Vec<String> = clashes.iter().map(|(n, u)| format!("{n} ({u})")).collect();
            return Err(HostError::Config(format!(
                "the account uid range {}-{} includes accounts of this host: {}; instances must \
                 never share a uid with them; choose another [isolation] base_uid",
                uids.first,
                uids.last().unwrap_or(uids.first),
                names.join(", ")
            )));
        }
        if let Some(parent) = data_dir.parent() {
            let mode_of = |p: &Path| {
                use std::os::unix::fs::MetadataExt;
                std::fs::metadata(p).map(|m| m.mode())
            };
            let blocked =
                unsearchable_ancestor(parent, mode_of).map_err(|source| HostError::Io {
                    what: "cannot inspect",
                    path: parent.to_owned(),
                    source,
                })?;
            if let Some((blocker, mode)) = blocked {
                return Err(HostError::DataDirUnreachable {
                    level,
                    data_dir: data_dir.to_owned(),
                    blocker,
                    mode,
                });
            }
        }
        if level == Isolation::Sandbox {
            check_mount_setattr()?;
        }
        // Every level that runs programs under their own uids gives each
        // instance a cgroup where the host allows: the one handle on all
        // of its processes that none of them can drop (`setsid` leaves a
        // process group, never a cgroup). A sandbox needs one for its
        // limits; at `user` the instance's uid is the handle without one.
        // Checked before anything is made: a start that fails leaves nothing.
        let nft = nft.ok_or(HostError::NoNft { level, looked })?;
        let cgroups = match prepare_cgroups(&table) {
            Ok(parents) => Some(parents),
            Err(e) if level == Isolation::Sandbox => return Err(e),
            Err(e) => {
                tracing::warn!(
                    "instances get no cgroup ({e}): no memory or CPU limits; hibernation, \
                     fencing and stop reach every process of an instance through its uid"
                );
                None
            }
        };
        let egress = guard::Egress {
            policy: config.egress.clone(),
            proxy_port: config.egress_proxy,
            name_servers: config.name_servers.clone(),
        };
        let guard = guard::Guard::new(
            nft,
            data_dir,
            uids,
            config.port_range.clone(),
            config.listeners.clone(),
            egress,
        );
        guard.install(own_egress).await?;
        Ok(Some(Isolator {
            level,
            guard,
            cgroups,
        }))
    }
}

/// The `nft` program: the configured one if it exists, else the one found
/// in `PATH`, /usr/sbin or /sbin.
pub(crate) fn resolve_nft(configured: Option<&Path>) -> Option<PathBuf> {
    match configured {
        Some(path) => path.is_file().then(|| path.to_owned()),
        None => guard::find_nft(std::env::var("PATH").ok().as_deref()),
    }
}

/// The parents of this berth's instance cgroups, made at start. A host
/// whose cgroups cannot freeze (v1 without the `freezer` controller) has
/// none to offer: freezing by uid is then the stronger mechanism.
fn prepare_cgroups(table: &str) -> Result<cgroup::Parents, HostError> {
    let layout = cgroup::detect_host()?;
    if !layout.can_freeze() {
        return Err(HostError::Cgroup(cgroup::CgroupError::NoFreezer));
    }
    let parents = layout.parents(table.trim_start_matches("berth_"));
    cgroup::prepare_parents(&layout, &parents, std::process::id())?;
    tracing::info!(version = layout.version(), parents = ?parents.dirs(), "instance cgroups");
    if layout.join_waits_for_grace_period() {
        tracing::info!(
            "each launch waits ~10-20 ms for the kernel to let its program join its cgroup; \
             mounting cgroup2 with the option favordynmods (Linux 6.0+) removes the wait"
        );
    }
    Ok(parents)
}

/// The sandbox makes the system read-only with mount_setattr(2) (Linux
/// 5.12): a kernel without it is named at start, not at the first launch.
fn check_mount_setattr() -> Result<(), HostError> {
    // SAFETY: an invalid descriptor and a null attribute pointer make the
    // call fail without touching memory; only ENOSYS matters here.
    let ret = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_mount_setattr,
            -1,
            c"".as_ptr(),
            0,
            std::ptr::null::<u8>(),
            0usize,
        )
    };
    if ret < 0 && std::io::Error::last_os_error().raw_os_error() == Some(nix::libc::ENOSYS) {
        return Err(HostError::Kernel(
            "the kernel lacks mount_setattr(2), which isolation mode \"sandbox\" needs \
             (Linux 5.12 or later)"
                .to_owned(),
        ));
    }
    Ok(())
}

/// Why the host cannot isolate instances at the configured level: each
/// names what is missing.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// `user` and `sandbox` need root, and berth runs as another user.
    #[error(
        "isolation mode \"{0}\" needs berth to run as root: it runs every user's instances under \
         a uid of their own; run berth as root, or set [isolation] mode = \"none\" (instances \
         are then not isolated)"
    )]
    NotRoot(Isolation),
    /// No `nft` program was found for the guards.
    #[error(
        "isolation mode \"{level}\" needs nftables for its port and egress guards, but the `nft` \
         program was not found (looked {looked}); install the nftables package"
    )]
    NoNft {
        /// The level that needs it.
        level: Isolation,
        /// Where berth looked, as the message shows it.
        looked: String,
    },
    /// The guards' nftables table could not be set up.
    #[error("{0}")]
    Guard(#[from] guard::GuardError),
    /// The instances' cgroups cannot be set up on this host.
    #[error("{0}")]
    Cgroup(#[from] cgroup::CgroupError),
    /// The kernel lacks something the level needs; the message names it.
    #[error("{0}")]
    Kernel(String),
    /// The isolation settings cannot work on this host (an empty uid
    /// range, or one that holds the host's own accounts).
    #[error("{0}")]
    Config(String),
    /// Instance accounts could not get through a parent of the data dir
    /// to their own roots.
    #[error(
        "isolation mode \"{level}\": instances could not reach their data under {data_dir}: \
         {blocker} is not searchable by other users (mode {mode:04o}); make it searchable \
         (chmod o+x {blocker}) or choose a data_dir elsewhere"
    )]
    DataDirUnreachable {
        /// The configured level.
        level: Isolation,
        /// berth's data dir.
        data_dir: PathBuf,
        /// The first ancestor that other users cannot search.
        blocker: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A file the checks needed could not be read.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done, as the message's first words.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What the file system said.
        source: std::io::Error,
    },
}

/// The first ancestor of `dir` (itself included) that other users cannot
/// search, with its mode: an instance uid could not get through it to its
/// root. `mode_of` is `std::fs::metadata` in production.
pub(crate) fn unsearchable_ancestor(
    dir: &Path,
    mode_of: impl Fn(&Path) -> std::io::Result<u32>,
) -> std::io::Result<Option<(PathBuf, u32)>> {
    for ancestor in dir.ancestors() {
        if ancestor.as_os_str().is_empty() {
            continue;
        }
        let mode = mode_of(ancestor)?;
        if mode & 0o001 == 0 {
            return Ok(Some((ancestor.to_owned(), mode & 0o7777)));
        }
    }
    Ok(None)
}

/// Whether `uid` lies in no account range but is a real account of the
/// host (`/etc/passwd`), as `(name, uid)`: instances must never share a
/// uid with a real account.
pub(crate) fn host_accounts_in(passwd: &str, range: UidRange) -> Vec<(String, u32)> {
    passwd
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(':');
            let name = fields.next()?;
            let uid: u32 = fields.nth(1)?.parse().ok()?;
            range.contains(uid).then(|| (name.to_owned(), uid))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_and_print() {
        for level in [Isolation::None, Isolation::User, Isolation::Sandbox] {
            assert_eq!(level.as_str().parse::<Isolation>(), Ok(level));
        }
        let err = "jail".parse::<Isolation>().unwrap_err();
        assert!(err.contains("unknown isolation mode \"jail\""), "{err}");
        assert!(!Isolation::None.per_user_uid());
        assert!(Isolation::Sandbox.per_user_uid());
    }

    #[test]
    fn the_first_private_ancestor_is_named() {
        let modes = |p: &Path| -> std::io::Result<u32> {
            Ok(match p.to_str().unwrap() {
                "/tmp/.tmpX" => 0o40700,
                "/tmp" => 0o41777,
                _ => 0o40755,
            })
        };
        assert_eq!(
            unsearchable_ancestor(Path::new("/tmp/.tmpX/data"), modes).unwrap(),
            Some((PathBuf::from("/tmp/.tmpX"), 0o700))
        );
        assert_eq!(
            unsearchable_ancestor(Path::new("/var/lib/berth"), modes).unwrap(),
            None
        );
    }

    #[test]
    fn real_accounts_inside_the_range_are_found() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\n\
                      svc:x:200005:200005::/srv:/bin/false\n\
                      broken line\n\
                      nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";
        let range = UidRange {
            first: 200_000,
            count: 100,
        };
        assert_eq!(
            host_accounts_in(passwd, range),
            vec![("svc".to_owned(), 200_005)]
        );
    }
}
