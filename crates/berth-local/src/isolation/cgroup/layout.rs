//! Where the cgroups are: the host's v1 or v2 hierarchy and berth's own
//! place in it, the parents of one berth's instance cgroups, and the
//! directories of each instance's cgroup.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{CgroupError, mkdir, write_file};

/// The controllers berth limits.
pub const CONTROLLERS: [&str; 3] = ["memory", "pids", "cpu"];

/// Where the controllers are on this host, and berth's own place in them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// One directory per controller: the controller's mount point joined
    /// with berth's own cgroup in that hierarchy.
    V1 {
        /// berth's cgroup under the `memory` controller.
        memory: PathBuf,
        /// berth's cgroup under the `pids` controller.
        pids: PathBuf,
        /// berth's cgroup under the `cpu` controller.
        cpu: PathBuf,
        /// The `freezer` controller's directory, when it is mounted.
        freezer: Option<PathBuf>,
    },
    /// The unified hierarchy's mount point and berth's own cgroup in it
    /// (`/` at the root); whether it is mounted with `favordynmods`, which
    /// spares each join the kernel's wait for an RCU grace period.
    V2 {
        /// Where the unified hierarchy is mounted.
        mount: PathBuf,
        /// berth's own cgroup, as a path from the hierarchy's root.
        own: String,
        /// Whether the mount has the `favordynmods` option.
        favordynmods: bool,
    },
}

/// Where one berth's instance cgroups go (the parents), per hierarchy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "version", rename_all = "lowercase")]
pub enum Parents {
    /// A parent per v1 controller, each `berth-<id>` under berth's own
    /// cgroup in that hierarchy.
    V1 {
        /// The parent under the `memory` controller.
        memory: PathBuf,
        /// The parent under the `pids` controller.
        pids: PathBuf,
        /// The parent under the `cpu` controller.
        cpu: PathBuf,
        /// The parent under the `freezer` controller, when it is mounted;
        /// absent from specs written before berth used it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        freezer: Option<PathBuf>,
    },
    /// The one parent in the unified hierarchy.
    V2 {
        /// `berth-<id>` under berth's own cgroup.
        parent: PathBuf,
    },
}

/// One instance's cgroup: a directory per controller (v1) or one (v2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceCgroup {
    /// The parents it lives under, its berth's.
    pub parents: Parents,
    /// Its directory's name under each parent:
    /// `<instance>.<role>.<shim pid>`.
    pub leaf: String,
}

/// A mount from `/proc/self/mountinfo`: mount point, its root inside the
/// filesystem, type and super options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Mount {
    root: String,
    pub(super) point: PathBuf,
    pub(super) fstype: String,
    super_options: String,
}

pub(super) fn parse_mountinfo(text: &str) -> Vec<Mount> {
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

    /// The cgroup version, 1 or 2, for logs.
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
    /// The cgroup named `leaf` under `parents`; nothing is created yet
    /// ([`InstanceCgroup::create`] does that).
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
