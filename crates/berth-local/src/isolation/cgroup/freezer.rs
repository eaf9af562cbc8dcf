//! Freezing, thawing and killing every process of an instance through its
//! cgroup's freezer (v1 `freezer.state` or v2 `cgroup.freeze`), and the
//! choice of that handle over the signal fallbacks.

use std::fs;
use std::io::{self, Write};
use std::path::PathBuf;

use super::{InstanceCgroup, Parents};

impl InstanceCgroup {
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
}

/// How an instance is frozen, stopped and killed: through the handle that
/// holds every one of its processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FreezeMechanism {
    /// Through its cgroup: every process in it, whatever its session.
    Cgroup(CgroupFreezer),
    /// Through its account (level `user` on a host that gives instances no
    /// cgroup): every process of the uid, by sweeps of SIGSTOP, SIGCONT
    /// and SIGKILL ([`crate::isolation::sweep`]).
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
    /// A freeze or thaw request could not be written.
    #[error("cannot write {value:?} to the cgroup freezer {path}: {source}")]
    Write {
        /// The request file.
        path: PathBuf,
        /// The value that was to be written.
        value: &'static str,
        /// What the kernel said.
        source: io::Error,
    },
    /// The freezer's state or the cgroup's task list could not be read.
    #[error("cannot read the cgroup freezer {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the kernel said.
        source: io::Error,
    },
}

/// The freezer of one instance's cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupFreezer {
    /// Which interface its files follow, v1's or v2's.
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
    use crate::isolation::cgroup::layout::parse_mountinfo;

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
        let root = nix::unistd::geteuid().is_root();
        if !crate::test_host::has(root && v2.is_some(), "root and a cgroup2 mount") {
            return;
        }
        let Some(v2) = v2 else { return };
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
}
