//! cgroup limits of sandboxed instances, on either hierarchy.
//!
//! * **v1** (one mount per controller, as on this project's CI machines):
//!   the `memory`, `pids` and `cpu` controllers each get a directory
//!   `<mount><berth's own cgroup>/berth-<id>/<instance>`.
//! * **v2** (the unified hierarchy of most production hosts): one directory
//!   `<mount><berth's own cgroup>/berth-<id>/<instance>`. v2 lets only
//!   leaves hold processes, so berth first moves itself into
//!   `<own>/berth-supervisor` (the way a systemd unit with `Delegate=yes`
//!   is meant to be used), then enables the controllers below `<own>`.
//!
//! Which one is used is decided at start from `/proc/self/mountinfo`,
//! `/proc/self/cgroup` and the v2 root's `cgroup.controllers`: v1 when the
//! memory controller is mounted as v1, else v2 when its root offers all
//! three controllers. A missing controller is an error that names it.
//!
//! Everything that decides (parsing, paths, the values written) is pure
//! and tested without I/O; the writers take the directories to write in,
//! so the v2 one is tested against a fake tree where no real v2 controllers
//! exist.
//!
//! **Freezing.** An instance with a cgroup is frozen through it
//! ([`CgroupFreezer`]): v2's `cgroup.freeze` in its own directory, or, on
//! v1, `freezer.state` in a directory of its own under the `freezer`
//! controller (optional: a v1 host without it freezes by signal, and berth
//! says so at start). The cgroup holds every process of the instance
//! whatever its session or process group, so a program that calls `setsid`
//! cannot escape the freeze the way it escapes a SIGSTOP to its group.

use std::collections::{BTreeSet, HashSet};
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::Limits;

/// The CFS period berth uses for CPU limits, in microseconds.
const CPU_PERIOD_US: u64 = 100_000;

/// Why cgroups cannot be used; every message names what is missing.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error(
        "cgroup {0} controller not mounted (neither as cgroup v1 nor in the cgroup v2 \
         hierarchy); instance cgroups need the memory, pids and cpu controllers"
    )]
    ControllerMissing(&'static str),
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("cgroup {what} {path}: {source}")]
    Write {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error(
        "cannot enable the memory, pids and cpu controllers below {path}: {source}; in cgroup v2 \
         berth needs a cgroup of its own that holds no other processes (systemd: run it as a \
         service with Delegate=yes)"
    )]
    Delegation { path: PathBuf, source: io::Error },
    #[error(
        "the cgroup v1 freezer controller is not mounted: instances could not be frozen through \
         their cgroups (mount it, or use cgroup v2)"
    )]
    NoFreezer,
    #[error("berth's own cgroup is not listed in /proc/self/cgroup for {0}")]
    OwnUnknown(&'static str),
}

/// The controllers berth limits.
pub const CONTROLLERS: [&str; 3] = ["memory", "pids", "cpu"];

/// Where the controllers are on this host, and berth's own place in them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// One directory per controller: the controller's mount point joined
    /// with berth's own cgroup in that hierarchy.
    V1 {
        memory: PathBuf,
        pids: PathBuf,
        cpu: PathBuf,
        /// The `freezer` controller's directory, when it is mounted.
        freezer: Option<PathBuf>,
    },
    /// The unified hierarchy's mount point and berth's own cgroup in it
    /// (`/` at the root); whether it is mounted with `favordynmods`, which
    /// spares each join the kernel's wait for an RCU grace period.
    V2 {
        mount: PathBuf,
        own: String,
        favordynmods: bool,
    },
}

/// Where one berth's instance cgroups go (the parents), per hierarchy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "version", rename_all = "lowercase")]
pub enum Parents {
    V1 {
        memory: PathBuf,
        pids: PathBuf,
        cpu: PathBuf,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        freezer: Option<PathBuf>,
    },
    V2 {
        parent: PathBuf,
    },
}

/// What the shim needs to give one instance its cgroup.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupSpec {
    pub parents: Parents,
    pub limits: Limits,
}

/// One instance's cgroup: a directory per controller (v1) or one (v2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceCgroup {
    pub parents: Parents,
    pub leaf: String,
}

/// A mount from `/proc/self/mountinfo`: mount point, its root inside the
/// filesystem, type and super options.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    root: String,
    point: PathBuf,
    fstype: String,
    super_options: String,
}

fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let (head, tail) = line.split_once(" - ")?;
            let head: Vec<&str> = head.split(' ').collect();
            let mut tail = tail.split(' ');
            let fstype = tail.next()?.to_owned();
            let _source = tail.next()?;
            let super_options = tail.next().unwrap_or("").to_owned();
            Some(Mount {
                root: unescape_mountinfo(head.get(3)?),
                point: PathBuf::from(unescape_mountinfo(head.get(4)?)),
                fstype,
                super_options,
            })
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            let octal = std::str::from_utf8(&bytes[i + 1..i + 4]).ok();
            if let Some(b) = octal.and_then(|o| u8::from_str_radix(o, 8).ok()) {
                out.push(b);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// berth's own cgroup per v1 controller and in v2, from
/// `/proc/self/cgroup` (`id:controllers:path`).
fn own_paths(self_cgroup: &str) -> (Vec<(Vec<String>, String)>, Option<String>) {
    let mut v1 = Vec::new();
    let mut v2 = None;
    for line in self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            v2 = Some(path.to_owned());
        } else {
            v1.push((
                controllers.split(',').map(str::to_owned).collect(),
                path.to_owned(),
            ));
        }
    }
    (v1, v2)
}

/// `mount point + own path`, with the mount's own root taken off the path
/// (a cgroup namespace or a bind mount shows a subtree).
fn join_own(point: &Path, mount_root: &str, own: &str) -> PathBuf {
    let relative = own
        .strip_prefix(mount_root)
        .filter(|_| mount_root != "/")
        .unwrap_or(own);
    let relative = relative.trim_start_matches('/');
    if relative.is_empty() {
        point.to_owned()
    } else {
        point.join(relative)
    }
}

/// Decides the layout from `/proc/self/mountinfo`, `/proc/self/cgroup`
/// and `v2_controllers` (the v2 root's `cgroup.controllers`, given its
/// mount point).
pub fn detect(
    mountinfo: &str,
    self_cgroup: &str,
    v2_controllers: impl Fn(&Path) -> Option<String>,
) -> Result<Layout, CgroupError> {
    let mounts = parse_mountinfo(mountinfo);
    let (v1_own, v2_own) = own_paths(self_cgroup);
    let v1_mount = |controller: &str| {
        mounts
            .iter()
            .find(|m| m.fstype == "cgroup" && m.super_options.split(',').any(|o| o == controller))
    };
    if v1_mount("memory").is_some() {
        let mut dirs = Vec::new();
        for controller in CONTROLLERS {
            let mount = v1_mount(controller).ok_or(CgroupError::ControllerMissing(controller))?;
            let own = v1_own
                .iter()
                .find(|(names, _)| names.iter().any(|n| n == controller))
                .map(|(_, path)| path.as_str())
                .ok_or(CgroupError::OwnUnknown(controller))?;
            dirs.push(join_own(&mount.point, &mount.root, own));
        }
        let [memory, pids, cpu]: [PathBuf; 3] = dirs
            .try_into()
            .map_err(|_| CgroupError::ControllerMissing("memory"))?;
        // Optional: without it instances are frozen by signal.
        let freezer = v1_mount("freezer").and_then(|mount| {
            let own = v1_own
                .iter()
                .find(|(names, _)| names.iter().any(|n| n == "freezer"))?;
            Some(join_own(&mount.point, &mount.root, &own.1))
        });
        return Ok(Layout::V1 {
            memory,
            pids,
            cpu,
            freezer,
        });
    }
    let v2 = mounts
        .iter()
        .find(|m| m.fstype == "cgroup2")
        .ok_or(CgroupError::ControllerMissing("memory"))?;
    let available = v2_controllers(&v2.point).unwrap_or_default();
    for controller in CONTROLLERS {
        if !available.split_whitespace().any(|c| c == controller) {
            return Err(CgroupError::ControllerMissing(controller));
        }
    }
    let own = v2_own.ok_or(CgroupError::OwnUnknown("the unified hierarchy"))?;
    let own = join_own(Path::new("/"), &v2.root, &own);
    Ok(Layout::V2 {
        mount: v2.point.clone(),
        own: own.to_string_lossy().into_owned(),
        favordynmods: v2.super_options.split(',').any(|o| o == "favordynmods"),
    })
}

/// Reads the real layout of this host.
pub fn detect_host() -> Result<Layout, CgroupError> {
    let read = |path: &str| {
        fs::read_to_string(path).map_err(|source| CgroupError::Read {
            path: path.into(),
            source,
        })
    };
    let mountinfo = read("/proc/self/mountinfo")?;
    let self_cgroup = read("/proc/self/cgroup")?;
    detect(&mountinfo, &self_cgroup, |mount| {
        fs::read_to_string(mount.join("cgroup.controllers")).ok()
    })
}

impl Layout {
    /// The parents of this berth's instance cgroups; `id` tells berths on
    /// one host apart (their data dirs differ).
    pub fn parents(&self, id: &str) -> Parents {
        let dir = format!("berth-{id}");
        match self {
            Layout::V1 {
                memory,
                pids,
                cpu,
                freezer,
            } => Parents::V1 {
                memory: memory.join(&dir),
                pids: pids.join(&dir),
                cpu: cpu.join(&dir),
                freezer: freezer.as_ref().map(|f| f.join(&dir)),
            },
            Layout::V2 { mount, own, .. } => Parents::V2 {
                parent: join_own(mount, "/", own).join(dir),
            },
        }
    }

    pub fn version(&self) -> u8 {
        match self {
            Layout::V1 { .. } => 1,
            Layout::V2 { .. } => 2,
        }
    }

    /// Whether instances can be frozen through their cgroups (v2 always;
    /// v1 when the `freezer` controller is mounted).
    pub fn can_freeze(&self) -> bool {
        !matches!(self, Layout::V1 { freezer: None, .. })
    }

    /// Whether each launch waits for an RCU grace period (~10–20 ms) to
    /// join its cgroup: on v2 without `favordynmods` (see
    /// [`InstanceCgroup::join_files`]).
    pub fn join_waits_for_grace_period(&self) -> bool {
        matches!(
            self,
            Layout::V2 {
                favordynmods: false,
                ..
            }
        )
    }
}

impl Parents {
    /// Every parent directory.
    pub fn dirs(&self) -> Vec<&Path> {
        match self {
            Parents::V1 {
                memory,
                pids,
                cpu,
                freezer,
            } => {
                let mut dirs: Vec<&Path> = vec![memory, pids, cpu];
                dirs.extend(freezer.as_deref());
                dirs
            }
            Parents::V2 { parent } => vec![parent],
        }
    }

    /// Whether any process lives in a cgroup under these parents: an
    /// instance of their berth runs (or is frozen). A directory that
    /// cannot be read counts as holding one.
    pub fn hold_processes(&self) -> bool {
        self.dirs().into_iter().any(|parent| {
            let entries = match fs::read_dir(parent) {
                Ok(entries) => entries,
                Err(e) => return e.kind() != io::ErrorKind::NotFound,
            };
            entries
                .filter_map(Result::ok)
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .any(|leaf| {
                    fs::read_to_string(leaf.path().join("cgroup.procs"))
                        .map_or(true, |procs| !parse_procs(&procs).is_empty())
                })
        })
    }

    /// Removes the parents and the empty instance cgroups under them, once
    /// their berth has no instance left ([`Parents::hold_processes`]).
    /// Returns what could not be removed.
    pub fn remove(&self) -> Vec<(PathBuf, io::Error)> {
        let mut failed = Vec::new();
        for parent in self.dirs() {
            let leaves = fs::read_dir(parent).into_iter().flatten().flatten();
            let leaves = leaves.filter(|e| e.file_type().is_ok_and(|t| t.is_dir()));
            for dir in leaves.map(|e| e.path()).chain([parent.to_owned()]) {
                match fs::remove_dir(&dir) {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => failed.push((dir, e)),
                    _ => {}
                }
            }
        }
        failed
    }
}

/// The files and values that give a v1 cgroup `limits`, per controller
/// directory (`memory`, `pids`, `cpu`), in the order they must be written.
/// `optional` files may be absent (swap accounting is a boot option).
///
/// `cpu.cfs_period_us` is left at the kernel's default, which is
/// [`CPU_PERIOD_US`]: each write of a CFS bandwidth file makes the kernel
/// check every CPU cgroup on the host, so a second write would add a cost
/// that grows with the number of instances to every launch.
pub fn v1_limit_files(limits: &Limits) -> Vec<(&'static str, &'static str, String, bool)> {
    let bytes = limits.memory_max_mb.saturating_mul(1024 * 1024).to_string();
    vec![
        ("memory", "memory.limit_in_bytes", bytes.clone(), false),
        // Must not be below the memory limit, so it comes second.
        ("memory", "memory.memsw.limit_in_bytes", bytes, true),
        ("pids", "pids.max", limits.pids_max.to_string(), false),
        (
            "cpu",
            "cpu.cfs_quota_us",
            v1_quota(limits.cpu_max_percent),
            false,
        ),
    ]
}

fn v1_quota(percent: u32) -> String {
    if percent == 0 {
        "-1".to_owned()
    } else {
        (u64::from(percent) * CPU_PERIOD_US / 100).to_string()
    }
}

/// The files and values that give a v2 cgroup `limits`, in order.
pub fn v2_limit_files(limits: &Limits) -> Vec<(&'static str, String, bool)> {
    let quota = if limits.cpu_max_percent == 0 {
        "max".to_owned()
    } else {
        (u64::from(limits.cpu_max_percent) * CPU_PERIOD_US / 100).to_string()
    };
    vec![
        (
            "memory.max",
            limits.memory_max_mb.saturating_mul(1024 * 1024).to_string(),
            false,
        ),
        // No swapping past the limit; absent without swap accounting.
        ("memory.swap.max", "0".to_owned(), true),
        // An OOM kill takes the whole instance, not one of its processes.
        ("memory.oom.group", "1".to_owned(), true),
        ("pids.max", limits.pids_max.to_string(), false),
        ("cpu.max", format!("{quota} {CPU_PERIOD_US}"), false),
    ]
}

/// The `oom_kill` counter of a v1 `memory.oom_control` or a v2
/// `memory.events` file.
pub fn oom_kills(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
}

fn write_file(path: &Path, value: &str, what: &'static str) -> Result<(), CgroupError> {
    let mut file = fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|source| CgroupError::Write {
            what,
            path: path.to_owned(),
            source,
        })?;
    file.write_all(value.as_bytes())
        .map_err(|source| CgroupError::Write {
            what,
            path: path.to_owned(),
            source,
        })
}

fn mkdir(path: &Path) -> Result<(), CgroupError> {
    match fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(CgroupError::Write {
            what: "directory",
            path: path.to_owned(),
            source,
        }),
    }
}

/// Makes the parents exist, once at start. On v2 this also moves berth
/// (`pid`) into `<own>/berth-supervisor` unless it sits at the root, and
/// enables the three controllers down to the parent. The layout's mount
/// is the real one in production, a fake tree in tests.
pub fn prepare_parents(layout: &Layout, parents: &Parents, pid: u32) -> Result<(), CgroupError> {
    match (layout, parents) {
        (Layout::V1 { .. }, Parents::V1 { .. }) => {
            for dir in parents.dirs() {
                mkdir(dir)?;
            }
            Ok(())
        }
        (Layout::V2 { mount, own, .. }, Parents::V2 { parent }) => {
            let own_dir = join_own(mount, "/", own);
            if own_dir != *mount {
                let supervisor = own_dir.join("berth-supervisor");
                mkdir(&supervisor)?;
                write_file(
                    &supervisor.join("cgroup.procs"),
                    &pid.to_string(),
                    "cgroup.procs",
                )?;
            }
            let enable = CONTROLLERS.map(|c| format!("+{c}")).join(" ");
            write_file(
                &own_dir.join("cgroup.subtree_control"),
                &enable,
                "cgroup.subtree_control",
            )
            .map_err(|e| match e {
                CgroupError::Write { path, source, .. } => CgroupError::Delegation {
                    path: path.parent().map(Path::to_owned).unwrap_or(path),
                    source,
                },
                other => other,
            })?;
            mkdir(parent)?;
            write_file(
                &parent.join("cgroup.subtree_control"),
                &enable,
                "cgroup.subtree_control",
            )
        }
        _ => Err(CgroupError::ControllerMissing("memory")),
    }
}

impl InstanceCgroup {
    pub fn new(parents: Parents, leaf: String) -> InstanceCgroup {
        InstanceCgroup { parents, leaf }
    }

    /// The instance's directories, one per v1 controller or one in v2.
    pub fn dirs(&self) -> Vec<PathBuf> {
        self.parents
            .dirs()
            .into_iter()
            .map(|p| p.join(&self.leaf))
            .collect()
    }

    /// The files a freshly forked, single-threaded process writes `0` to,
    /// to join.
    ///
    /// On v1 that is `tasks`, which moves the calling thread alone: the
    /// kernel then takes no global lock, where `cgroup.procs` write-locks
    /// every thread group on the host and waits an RCU grace period for
    /// it (about 10 ms a launch, measured in BENCHMARKS.md). For a process
    /// of one thread the two are the same move. v2 has no such file across
    /// cgroups, so it joins by `cgroup.procs` and pays that wait unless
    /// the hierarchy is mounted with `favordynmods`.
    pub fn join_files(&self) -> Vec<PathBuf> {
        let file = match self.parents {
            Parents::V1 { .. } => "tasks",
            Parents::V2 { .. } => "cgroup.procs",
        };
        self.dirs().into_iter().map(|d| d.join(file)).collect()
    }

    /// Creates the directories and writes the limits.
    pub fn create(&self, limits: &Limits) -> Result<(), CgroupError> {
        let created = self.create_unchecked(limits);
        if created.is_err() {
            self.remove();
        }
        created
    }

    fn create_unchecked(&self, limits: &Limits) -> Result<(), CgroupError> {
        for dir in self.dirs() {
            mkdir(&dir)?;
        }
        match &self.parents {
            Parents::V1 {
                memory, pids, cpu, ..
            } => {
                for (controller, file, value, optional) in v1_limit_files(limits) {
                    let parent = match controller {
                        "memory" => memory,
                        "pids" => pids,
                        _ => cpu,
                    };
                    let path = parent.join(&self.leaf).join(file);
                    if optional && !path.exists() {
                        continue;
                    }
                    write_file(&path, &value, file)?;
                }
            }
            Parents::V2 { parent } => {
                for (file, value, optional) in v2_limit_files(limits) {
                    let path = parent.join(&self.leaf).join(file);
                    if optional && !path.exists() {
                        continue;
                    }
                    write_file(&path, &value, file)?;
                }
            }
        }
        Ok(())
    }

    /// The instance's freezer: its own v2 directory, or its directory
    /// under the v1 `freezer` controller when that is mounted.
    pub fn freezer(&self) -> Option<CgroupFreezer> {
        match &self.parents {
            Parents::V1 {
                freezer: Some(freezer),
                ..
            } => Some(CgroupFreezer {
                kind: FreezerKind::V1,
                dir: freezer.join(&self.leaf),
            }),
            Parents::V1 { freezer: None, .. } => None,
            Parents::V2 { parent } => Some(CgroupFreezer {
                kind: FreezerKind::V2,
                dir: parent.join(&self.leaf),
            }),
        }
    }

    /// The OOM kills counted in the cgroup so far (`None`: unreadable).
    pub fn oom_kills(&self) -> Option<u64> {
        let path = match &self.parents {
            Parents::V1 { memory, .. } => memory.join(&self.leaf).join("memory.oom_control"),
            Parents::V2 { parent } => parent.join(&self.leaf).join("memory.events"),
        };
        oom_kills(&fs::read_to_string(path).ok()?)
    }

    /// Removes the directories. A cgroup whose last process has just died
    /// may stay busy for a moment, so each removal is retried briefly.
    /// Returns the ones that could not be removed.
    pub fn remove(&self) -> Vec<(PathBuf, io::Error)> {
        let mut failed = Vec::new();
        for dir in self.dirs() {
            let mut attempt = 0;
            loop {
                match fs::remove_dir(&dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    Err(e) if e.raw_os_error() == Some(nix::libc::EBUSY) && attempt < 100 => {
                        attempt += 1;
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                    Err(e) => {
                        failed.push((dir.clone(), e));
                        break;
                    }
                }
            }
        }
        failed
    }
}

/// The shim pid in an instance cgroup's leaf name
/// (`<instance>.<role>.<shim pid>`, see the shim's `start`).
pub fn shim_pid_of_leaf(leaf: &str) -> Option<u32> {
    leaf.rsplit_once('.')?.1.parse().ok()
}

/// Removes the instance cgroups under `parents` that are not in `keep`
/// (leaf names): those of shims killed before they could clean up. The
/// processes of such a leaf whose shim is gone (`shim_alive` says no) are
/// killed first: the shim's death sends its program SIGKILL, but a
/// program frozen in a v1 freezer receives it only once thawed, so it
/// would otherwise stay frozen for ever. A cgroup that still holds
/// processes cannot be removed and is reported.
pub fn remove_stale(
    parents: &Parents,
    keep: &HashSet<String>,
    shim_alive: impl Fn(u32) -> bool,
) -> Vec<(PathBuf, io::Error)> {
    // Sets, not lists: a node of thousands has thousands of leaves under
    // each parent.
    let mut stale: BTreeSet<String> = BTreeSet::new();
    for parent in parents.dirs() {
        let Ok(entries) = fs::read_dir(parent) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if keep.contains(&name)
                || stale.contains(&name)
                || !entry.file_type().is_ok_and(|t| t.is_dir())
            {
                continue;
            }
            stale.insert(name);
        }
    }
    stale
        .iter()
        .flat_map(|leaf| remove_stale_leaf(parents, leaf, &shim_alive))
        .collect()
}

/// Removes one instance cgroup of [`remove_stale`]'s, killing its
/// processes first when its shim is gone.
pub fn remove_stale_leaf(
    parents: &Parents,
    leaf: &str,
    shim_alive: impl Fn(u32) -> bool,
) -> Vec<(PathBuf, io::Error)> {
    let cgroup = InstanceCgroup::new(parents.clone(), leaf.to_owned());
    let orphaned = shim_pid_of_leaf(leaf).is_some_and(|pid| !shim_alive(pid));
    match cgroup.freezer().filter(|f| orphaned && f.dir.is_dir()) {
        Some(freezer) => match freezer.kill_all() {
            // Dying processes keep a cgroup busy for a moment.
            Ok(()) => cgroup.remove(),
            Err(e) => vec![(freezer.dir.clone(), io::Error::other(e.to_string()))],
        },
        None => cgroup
            .dirs()
            .into_iter()
            .filter_map(|dir| match fs::remove_dir(&dir) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Some((dir, e)),
                _ => None,
            })
            .collect(),
    }
}

/// How an instance is frozen, stopped and killed: through the handle that
/// holds every one of its processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FreezeMechanism {
    /// Through its cgroup: every process in it, whatever its session.
    Cgroup(CgroupFreezer),
    /// Through its account (level `user` on a host that gives instances no
    /// cgroup): every process of the uid, by sweeps of SIGSTOP, SIGCONT
    /// and SIGKILL ([`super::sweep`]).
    Uid(u32),
    /// SIGSTOP and SIGCONT to the program's process group: level `none`
    /// only, where the program runs as berth's own user. A process that
    /// left the group (`setsid`, `setpgid`) is not frozen.
    ProcessGroupSignal,
}

impl FreezeMechanism {
    /// The mechanism for an instance with `cgroup`, running as `uid`
    /// (levels `user` and `sandbox`) or as berth (`None`).
    pub fn for_instance(cgroup: Option<&InstanceCgroup>, uid: Option<u32>) -> FreezeMechanism {
        match (cgroup.and_then(InstanceCgroup::freezer), uid) {
            (Some(freezer), _) => FreezeMechanism::Cgroup(freezer),
            (None, Some(uid)) => FreezeMechanism::Uid(uid),
            (None, None) => FreezeMechanism::ProcessGroupSignal,
        }
    }
}

/// Which cgroup freezer interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreezerKind {
    /// v1 `freezer.state`: `FROZEN`/`THAWED`, reads `FREEZING` until every
    /// task is frozen. A frozen task takes no signal, SIGKILL included,
    /// until it is thawed.
    V1,
    /// v2 `cgroup.freeze`: `1`/`0`, confirmed by `frozen 1` in
    /// `cgroup.events`. A fatal signal reaches a frozen task.
    V2,
}

impl FreezerKind {
    /// The file a request is written to, and the value that asks for
    /// `frozen`.
    pub fn request(self, frozen: bool) -> (&'static str, &'static str) {
        match (self, frozen) {
            (FreezerKind::V1, true) => ("freezer.state", "FROZEN"),
            (FreezerKind::V1, false) => ("freezer.state", "THAWED"),
            (FreezerKind::V2, true) => ("cgroup.freeze", "1"),
            (FreezerKind::V2, false) => ("cgroup.freeze", "0"),
        }
    }

    /// The file that says whether the cgroup is frozen.
    pub fn status_file(self) -> &'static str {
        match self {
            FreezerKind::V1 => "freezer.state",
            FreezerKind::V2 => "cgroup.events",
        }
    }

    /// Whether `text`, read from [`FreezerKind::status_file`], says that
    /// every task of the cgroup is frozen.
    pub fn says_frozen(self, text: &str) -> bool {
        match self {
            FreezerKind::V1 => text.trim() == "FROZEN",
            FreezerKind::V2 => text.lines().any(|l| l.trim() == "frozen 1"),
        }
    }

    /// Whether a SIGKILL reaches a frozen task only once it is thawed.
    pub fn kill_needs_thaw(self) -> bool {
        self == FreezerKind::V1
    }
}

/// A freezer file could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum FreezeError {
    #[error("cannot write {value:?} to the cgroup freezer {path}: {source}")]
    Write {
        path: PathBuf,
        value: &'static str,
        source: io::Error,
    },
    #[error("cannot read the cgroup freezer {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
}

/// The freezer of one instance's cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupFreezer {
    pub kind: FreezerKind,
    /// The instance's directory in the hierarchy that freezes.
    pub dir: PathBuf,
}

/// The pids listed in a `cgroup.procs` file.
pub fn parse_procs(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

impl CgroupFreezer {
    /// Asks the kernel to freeze (`true`) or thaw the cgroup. Freezing is
    /// asynchronous: [`CgroupFreezer::is_frozen`] says when it is done.
    pub fn request(&self, frozen: bool) -> Result<(), FreezeError> {
        let (file, value) = self.kind.request(frozen);
        let path = self.dir.join(file);
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut f| f.write_all(value.as_bytes()))
            .map_err(|source| FreezeError::Write {
                path,
                value,
                source,
            })
    }

    /// Whether every task of the cgroup is frozen now.
    pub fn is_frozen(&self) -> Result<bool, FreezeError> {
        let path = self.dir.join(self.kind.status_file());
        let text =
            fs::read_to_string(&path).map_err(|source| FreezeError::Read { path, source })?;
        Ok(self.kind.says_frozen(&text))
    }

    /// The processes in the cgroup.
    pub fn tasks(&self) -> Result<Vec<u32>, FreezeError> {
        let path = self.dir.join("cgroup.procs");
        let text =
            fs::read_to_string(&path).map_err(|source| FreezeError::Read { path, source })?;
        Ok(parse_procs(&text))
    }

    /// SIGKILLs every process in the cgroup, frozen or not, so that none
    /// runs another instruction of its own. Where the kernel has
    /// `cgroup.kill` (v2, Linux 5.14) one write kills them all at once,
    /// forks in flight included. Otherwise each listed task is sent
    /// SIGKILL; on v2 a fatal signal reaches a frozen task, on v1 it is
    /// held until the task is thawed, so the cgroup is thawed *after*
    /// every task has its SIGKILL pending: a task leaves the freezer
    /// inside the kernel, and a pending SIGKILL is acted on before any
    /// return to user space, so it dies without running. A task that was
    /// still freezing (v1 `FREEZING`) may have forked after the list was
    /// read: the list is read and killed again until the cgroup is empty.
    pub fn kill_all(&self) -> Result<(), FreezeError> {
        if self.kind == FreezerKind::V2 {
            let kill = self.dir.join("cgroup.kill");
            if fs::OpenOptions::new()
                .write(true)
                .open(&kill)
                .and_then(|mut f| f.write_all(b"1"))
                .is_ok()
            {
                return Ok(());
            }
        }
        let mut thawed = false;
        for _ in 0..KILL_ROUNDS {
            let tasks = self.tasks()?;
            let living: Vec<u32> = tasks.into_iter().filter(|p| !is_zombie(*p)).collect();
            if living.is_empty() {
                break;
            }
            for pid in living {
                if let Ok(pid) = i32::try_from(pid) {
                    // Gone already is fine.
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
            if self.kind.kill_needs_thaw() && !thawed {
                self.request(false)?;
                thawed = true;
            }
            std::thread::sleep(KILL_PAUSE);
        }
        if self.kind.kill_needs_thaw() && !thawed {
            self.request(false)?;
        }
        Ok(())
    }
}

/// How many times [`CgroupFreezer::kill_all`] reads and kills the cgroup's
/// tasks at most; each round leaves fewer (a killed task forks no more).
const KILL_ROUNDS: usize = 200;

/// The pause between two rounds, for the kills to take effect.
const KILL_PAUSE: std::time::Duration = std::time::Duration::from_millis(1);

/// Whether `pid` is dead and waiting to be reaped (or gone).
fn is_zombie(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X"),
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1_MOUNTINFO: &str = "\
22 1 0:21 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
30 22 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw
33 30 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
34 30 0:30 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
35 30 0:31 / /sys/fs/cgroup/pids rw,nosuid - cgroup cgroup rw,pids
";
    const V1_SELF: &str = "\
9:name=systemd:/
8:pids:/
4:memory:/process_api/abc
1:cpu,cpuacct:/
0::/
";

    #[test]
    fn v1_is_chosen_when_memory_is_a_v1_controller() {
        let layout = detect(V1_MOUNTINFO, V1_SELF, |_| Some(String::new())).unwrap();
        assert_eq!(
            layout,
            Layout::V1 {
                memory: "/sys/fs/cgroup/memory/process_api/abc".into(),
                pids: "/sys/fs/cgroup/pids".into(),
                cpu: "/sys/fs/cgroup/cpu,cpuacct".into(),
                freezer: None,
            }
        );
        assert!(!layout.can_freeze(), "no v1 freezer mounted");
        assert_eq!(
            layout.parents("0123abcd"),
            Parents::V1 {
                memory: "/sys/fs/cgroup/memory/process_api/abc/berth-0123abcd".into(),
                pids: "/sys/fs/cgroup/pids/berth-0123abcd".into(),
                cpu: "/sys/fs/cgroup/cpu,cpuacct/berth-0123abcd".into(),
                freezer: None,
            }
        );
    }

    #[test]
    fn the_v1_freezer_is_used_when_mounted() {
        let mountinfo = format!(
            "{V1_MOUNTINFO}36 30 0:32 / /sys/fs/cgroup/freezer rw,nosuid - cgroup cgroup rw,freezer\n"
        );
        let own = format!("6:freezer:/ci\n{V1_SELF}");
        let layout = detect(&mountinfo, &own, |_| None).unwrap();
        assert!(layout.can_freeze());
        let parents = layout.parents("id");
        let Parents::V1 { freezer, .. } = &parents else {
            panic!("{parents:?}")
        };
        assert_eq!(
            freezer.as_deref(),
            Some(Path::new("/sys/fs/cgroup/freezer/ci/berth-id"))
        );
        // The instance joins the freezer too, and leaves it on removal.
        let cgroup = InstanceCgroup::new(parents.clone(), "alice.main.9".into());
        assert_eq!(cgroup.dirs().len(), 4);
        assert!(
            cgroup
                .join_files()
                .contains(&"/sys/fs/cgroup/freezer/ci/berth-id/alice.main.9/tasks".into())
        );
        // Specs written before the freezer existed still read.
        let old: Parents =
            serde_json::from_str(r#"{"version":"v1","memory":"/m","pids":"/p","cpu":"/c"}"#)
                .unwrap();
        assert_eq!(old.dirs().len(), 3);
    }

    #[test]
    fn the_freeze_mechanism_follows_the_cgroup_then_the_uid() {
        // Level none: the process group, the only handle berth has.
        assert_eq!(
            FreezeMechanism::for_instance(None, None),
            FreezeMechanism::ProcessGroupSignal
        );
        // An account but no cgroup: every process of the uid.
        assert_eq!(
            FreezeMechanism::for_instance(None, Some(400_001)),
            FreezeMechanism::Uid(400_001)
        );
        let v1 = |freezer: Option<&str>| Parents::V1 {
            memory: "/m".into(),
            pids: "/p".into(),
            cpu: "/c".into(),
            freezer: freezer.map(PathBuf::from),
        };
        let leaf = |parents| InstanceCgroup::new(parents, "a.main.1".into());
        assert_eq!(
            FreezeMechanism::for_instance(Some(&leaf(v1(None))), Some(400_001)),
            FreezeMechanism::Uid(400_001),
            "a v1 host without the freezer controller"
        );
        assert_eq!(
            FreezeMechanism::for_instance(Some(&leaf(v1(Some("/f")))), Some(400_001)),
            FreezeMechanism::Cgroup(CgroupFreezer {
                kind: FreezerKind::V1,
                dir: "/f/a.main.1".into()
            })
        );
        assert_eq!(
            FreezeMechanism::for_instance(
                Some(&leaf(Parents::V2 {
                    parent: "/u/berth-x".into()
                })),
                Some(400_001)
            ),
            FreezeMechanism::Cgroup(CgroupFreezer {
                kind: FreezerKind::V2,
                dir: "/u/berth-x/a.main.1".into()
            })
        );
    }

    #[test]
    fn freezer_files_and_states_per_version() {
        use FreezerKind::{V1, V2};
        assert_eq!(V1.request(true), ("freezer.state", "FROZEN"));
        assert_eq!(V1.request(false), ("freezer.state", "THAWED"));
        assert_eq!(V2.request(true), ("cgroup.freeze", "1"));
        assert_eq!(V2.request(false), ("cgroup.freeze", "0"));
        assert!(V1.says_frozen("FROZEN\n"));
        assert!(!V1.says_frozen("FREEZING\n"), "some tasks still run");
        assert!(!V1.says_frozen("THAWED\n"));
        assert!(V2.says_frozen("populated 1\nfrozen 1\n"));
        assert!(!V2.says_frozen("populated 1\nfrozen 0\n"));
        assert!(V1.kill_needs_thaw() && !V2.kill_needs_thaw());
        assert_eq!(parse_procs("12\n345\n\n"), vec![12, 345]);
        assert_eq!(shim_pid_of_leaf("alice.main.4242"), Some(4242));
        assert_eq!(shim_pid_of_leaf("u.x.main.77"), Some(77));
        assert_eq!(shim_pid_of_leaf("berth-supervisor"), None);
    }

    /// The real v2 freezer, where this host has one (root, a cgroup2
    /// mount): a frozen task is confirmed frozen, and `kill_all` ends it
    /// without a thaw.
    #[test]
    fn the_real_v2_freezer_freezes_and_kills_a_frozen_task() {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let v2 = parse_mountinfo(&mountinfo)
            .into_iter()
            .find(|m| m.fstype == "cgroup2");
        let Some(v2) = v2.filter(|_| nix::unistd::geteuid().is_root()) else {
            println!("SKIPPED: needs root and a cgroup2 mount");
            return;
        };
        let dir = v2
            .point
            .join(format!("berth-freezer-test-{}", std::process::id()));
        fs::create_dir(&dir).unwrap();
        let freezer = CgroupFreezer {
            kind: FreezerKind::V2,
            dir: dir.clone(),
        };
        let mut child = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .unwrap();
        fs::write(dir.join("cgroup.procs"), child.id().to_string()).unwrap();
        assert_eq!(freezer.tasks().unwrap(), vec![child.id()]);
        freezer.request(true).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !freezer.is_frozen().unwrap() {
            assert!(std::time::Instant::now() < deadline, "never frozen");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        freezer.kill_all().unwrap();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "a frozen task outlived SIGKILL"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(nix::libc::SIGKILL));
        assert_eq!(
            fs::read_to_string(dir.join("cgroup.freeze"))
                .unwrap()
                .trim(),
            "1",
            "killed, never thawed"
        );
        let failed = InstanceCgroup::new(
            Parents::V2 {
                parent: v2.point.clone(),
            },
            dir.file_name().unwrap().to_string_lossy().into_owned(),
        )
        .remove();
        assert!(failed.is_empty(), "{failed:?}");
    }

    /// The v2 freezer against a fake tree: the files it writes and reads,
    /// and the typed error when the freezer file cannot be written.
    #[test]
    fn the_v2_freezer_against_a_fake_tree() {
        let tmp = tempfile::tempdir().unwrap();
        let freezer = CgroupFreezer {
            kind: FreezerKind::V2,
            dir: tmp.path().join("leaf"),
        };
        let err = freezer.request(true).unwrap_err();
        assert!(matches!(err, FreezeError::Write { .. }));
        assert!(
            err.to_string().starts_with(&format!(
                "cannot write \"1\" to the cgroup freezer {}/cgroup.freeze: ",
                freezer.dir.display()
            )),
            "{err}"
        );
        fs::create_dir(&freezer.dir).unwrap();
        fs::write(freezer.dir.join("cgroup.freeze"), "0").unwrap();
        fs::write(freezer.dir.join("cgroup.events"), "populated 1\nfrozen 0\n").unwrap();
        freezer.request(true).unwrap();
        assert_eq!(
            fs::read_to_string(freezer.dir.join("cgroup.freeze")).unwrap(),
            "1"
        );
        assert!(!freezer.is_frozen().unwrap());
        fs::write(freezer.dir.join("cgroup.events"), "populated 1\nfrozen 1\n").unwrap();
        assert!(freezer.is_frozen().unwrap());
        freezer.request(false).unwrap();
        assert_eq!(
            fs::read_to_string(freezer.dir.join("cgroup.freeze")).unwrap(),
            "0"
        );
    }

    #[test]
    fn v2_is_chosen_on_a_unified_host_with_its_controllers() {
        let mountinfo = "\
25 1 0:23 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate
";
        let own = "0::/system.slice/berth.service\n";
        let controllers = |p: &Path| {
            assert_eq!(p, Path::new("/sys/fs/cgroup"));
            Some("cpuset cpu io memory hugetlb pids rdma misc\n".to_owned())
        };
        let layout = detect(mountinfo, own, controllers).unwrap();
        assert_eq!(
            layout,
            Layout::V2 {
                mount: "/sys/fs/cgroup".into(),
                own: "/system.slice/berth.service".into(),
                favordynmods: false,
            }
        );
        assert!(layout.join_waits_for_grace_period());
        let favoured = mountinfo.replace("rw,nsdelegate\n", "rw,nsdelegate,favordynmods\n");
        let layout_favoured = detect(&favoured, own, controllers).unwrap();
        assert!(!layout_favoured.join_waits_for_grace_period());
        assert_eq!(
            layout.parents("x"),
            Parents::V2 {
                parent: "/sys/fs/cgroup/system.slice/berth.service/berth-x".into()
            }
        );
        // Inside a cgroup namespace the mount's root is a subtree.
        let nsed = "25 1 0:23 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let layout = detect(nsed, "0::/kubepods/pod1/c1\n", |_| {
            Some("memory pids cpu".into())
        })
        .unwrap();
        assert_eq!(
            layout.parents("x"),
            Parents::V2 {
                parent: "/sys/fs/cgroup/c1/berth-x".into()
            }
        );
    }

    #[test]
    fn a_missing_controller_is_named() {
        // The hybrid layout of the CI machines, without a v1 pids mount.
        let no_pids: String = V1_MOUNTINFO
            .lines()
            .filter(|l| !l.contains("pids"))
            .map(|l| format!("{l}\n"))
            .collect();
        let err = detect(&no_pids, V1_SELF, |_| None).unwrap_err();
        assert_eq!(
            err.to_string().split(" (").next().unwrap(),
            "cgroup pids controller not mounted"
        );
        // A v2 host whose memory controller is not offered.
        let v2 = "25 1 0:23 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let err = detect(v2, "0::/\n", |_| Some("cpu pids io".into())).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("cgroup memory controller not mounted"),
            "{err}"
        );
        // No cgroup file system at all.
        let err = detect("", "", |_| None).unwrap_err();
        assert!(err.to_string().contains("memory controller not mounted"));
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        let mounts = parse_mountinfo(
            "40 30 0:30 / /mnt/with\\040space rw - cgroup cgroup rw,memory\nnot a mount line\n",
        );
        assert_eq!(mounts.len(), 1);
        assert_eq!(mounts[0].point, Path::new("/mnt/with space"));
    }

    #[test]
    fn limit_values_for_both_hierarchies() {
        let limits = Limits {
            memory_max_mb: 64,
            pids_max: 32,
            cpu_max_percent: 150,
            ..Limits::default()
        };
        let v1 = v1_limit_files(&limits);
        assert_eq!(
            v1[0],
            (
                "memory",
                "memory.limit_in_bytes",
                "67108864".to_owned(),
                false
            )
        );
        assert_eq!(v1[1].1, "memory.memsw.limit_in_bytes");
        assert!(v1[1].3, "memsw is optional");
        assert_eq!(v1[2], ("pids", "pids.max", "32".to_owned(), false));
        assert_eq!(
            v1[3],
            ("cpu", "cpu.cfs_quota_us", "150000".to_owned(), false)
        );
        assert_eq!(v1.len(), 4, "the period stays the kernel's default");
        let v2 = v2_limit_files(&limits);
        assert_eq!(v2[0], ("memory.max", "67108864".to_owned(), false));
        assert_eq!(v2[3], ("pids.max", "32".to_owned(), false));
        assert_eq!(v2[4], ("cpu.max", "150000 100000".to_owned(), false));
        let unlimited_cpu = Limits {
            cpu_max_percent: 0,
            ..limits
        };
        assert_eq!(v1_limit_files(&unlimited_cpu)[3].2, "-1");
        assert_eq!(v2_limit_files(&unlimited_cpu)[4].1, "max 100000");
    }

    #[test]
    fn oom_counters_parse() {
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n";
        assert_eq!(oom_kills(v1), Some(2));
        let v2 = "low 0\nhigh 0\nmax 17\noom 1\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(oom_kills(v2), Some(1));
        assert_eq!(oom_kills("under_oom 0\n"), None);
    }

    /// A fake cgroup v2 tree: what the kernel would put in each directory
    /// is created by hand, then the writers run against it.
    #[test]
    fn the_v2_writer_against_a_fake_tree() {
        let tmp = tempfile::tempdir().unwrap();
        let mount = tmp.path().join("cgroup");
        let own_dir = mount.join("system.slice/berth.service");
        fs::create_dir_all(&own_dir).unwrap();
        for file in ["cgroup.subtree_control", "cgroup.procs"] {
            fs::write(own_dir.join(file), "").unwrap();
        }
        let layout = Layout::V2 {
            mount: mount.clone(),
            own: "/system.slice/berth.service".into(),
            favordynmods: false,
        };
        let parents = layout.parents("id1");
        let Parents::V2 { parent } = &parents else {
            panic!("{parents:?}")
        };
        // The kernel creates these in every new directory.
        let kernel_files = |dir: &Path| {
            fs::create_dir_all(dir).unwrap();
            for file in [
                "cgroup.subtree_control",
                "cgroup.procs",
                "memory.max",
                "memory.oom.group",
                "pids.max",
                "cpu.max",
                "memory.events",
            ] {
                fs::write(dir.join(file), "").unwrap();
            }
        };
        kernel_files(&own_dir.join("berth-supervisor"));
        kernel_files(parent);
        prepare_parents(&layout, &parents, 4242).unwrap();
        let read = |p: PathBuf| fs::read_to_string(p).unwrap();
        assert_eq!(read(own_dir.join("berth-supervisor/cgroup.procs")), "4242");
        assert_eq!(
            read(own_dir.join("cgroup.subtree_control")),
            "+memory +pids +cpu"
        );
        assert_eq!(
            read(parent.join("cgroup.subtree_control")),
            "+memory +pids +cpu"
        );

        let cgroup = InstanceCgroup::new(parents.clone(), "alice.main.77".into());
        let leaf = parent.join("alice.main.77");
        kernel_files(&leaf);
        let limits = Limits {
            memory_max_mb: 16,
            pids_max: 8,
            cpu_max_percent: 50,
            ..Limits::default()
        };
        cgroup.create(&limits).unwrap();
        assert_eq!(read(leaf.join("memory.max")), "16777216");
        assert_eq!(read(leaf.join("memory.oom.group")), "1");
        assert_eq!(read(leaf.join("pids.max")), "8");
        assert_eq!(read(leaf.join("cpu.max")), "50000 100000");
        assert!(!leaf.join("memory.swap.max").exists(), "optional, skipped");
        assert_eq!(cgroup.join_files(), vec![leaf.join("cgroup.procs")]);
        fs::write(leaf.join("memory.events"), "oom 1\noom_kill 1\n").unwrap();
        assert_eq!(cgroup.oom_kills(), Some(1));

        // A real cgroup directory is removable once empty; the fake one has
        // files, so removal reports it instead of deleting anything.
        let failed = cgroup.remove();
        assert_eq!(failed.len(), 1);
        assert!(leaf.join("memory.max").exists());
    }

    #[test]
    fn a_v2_host_without_delegation_gets_a_named_error() {
        let tmp = tempfile::tempdir().unwrap();
        let mount = tmp.path().to_owned();
        // No cgroup.subtree_control under the own cgroup: not delegated.
        fs::create_dir_all(mount.join("user.slice/berth-supervisor")).unwrap();
        fs::write(mount.join("user.slice/berth-supervisor/cgroup.procs"), "").unwrap();
        let layout = Layout::V2 {
            mount,
            own: "/user.slice".into(),
            favordynmods: false,
        };
        let err = prepare_parents(&layout, &layout.parents("i"), 1).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("cannot enable the memory, pids and cpu controllers"),
            "{msg}"
        );
        assert!(msg.contains("Delegate=yes"), "{msg}");
    }
}
