//! The privileged setup the shim does in the forked child, just before it
//! executes the program.
//!
//! The shim builds a [`ChildPlan`] first, in ordinary code: every path as a
//! C string, every file it needs open, every byte it will write. The child
//! then runs [`ChildPlan::enter`] between `fork` and `exec` (a `pre_exec`
//! hook), where another thread of the shim may have held a lock (the
//! allocator's, say) at fork time: so `enter` only makes system calls on
//! that prepared data. It allocates nothing, takes no lock and calls
//! nothing but async-signal-safe functions and raw system calls; the
//! glibc wrappers of `setresuid` and friends are avoided (they signal
//! every thread the parent had), and so is `fork` (its at-fork handlers
//! take locks): the sandbox's second process comes from a raw `clone`.
//!
//! Level `user`: rlimits, no supplementary groups, the account's gid and
//! uid, an empty capability bounding set and no capabilities at all,
//! `no_new_privs`, the working directory entered as the account (so a
//! link in the user's folder is followed with the user's rights, not
//! root's), and the parent-death signal (set last: a change of
//! credentials clears it).
//!
//! Both levels first join the instance's cgroup, where it has one, still
//! as root. Level `sandbox` then makes a private mount namespace (the pid
//! namespace was made by the shim, so this child is its pid 1), a tmpfs
//! `/etc` with only allowed host entries and the user's passwd and group,
//! the whole tree read-only and `nosuid`, then fresh writable mounts: a private `/tmp` and `/dev/shm`,
//! an empty tmpfs over berth's data dir with only the user's root bound
//! back in, and a `/proc` of the new pid namespace. After the privileges
//! are dropped it forks: the child goes on to execute the program, and
//! this process stays as the namespace's init (`init_loop`), which reaps
//! orphans (a program as pid 1 would not) and reports the program's exit
//! status to the shim through a pipe. When the program exits, init exits,
//! and the kernel kills whatever is left in the namespace.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::libc;

use super::IsolationSpec;
use super::cgroup::InstanceCgroup;
use super::etc::{self, Entry};

const MOUNT_ATTR_RDONLY: u64 = 0x0000_0001;
const MOUNT_ATTR_NOSUID: u64 = 0x0000_0002;

/// `struct mount_attr` of mount_setattr(2).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// `_LINUX_CAPABILITY_VERSION_3`.
const CAP_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// One entry of the sandbox's `/etc`.
struct EtcMount {
    target: CString,
    kind: EtcKind,
}

enum EtcKind {
    /// Bound from `source` (a path through the host `/etc` descriptor).
    Dir {
        source: CString,
    },
    File {
        source: CString,
    },
    Link {
        to: CString,
    },
}

/// How the child makes sure the shim still lives once its parent-death
/// signal is set (a shim that died before would never send it).
enum ParentCheck {
    /// `getppid()` must still be the shim.
    Pid(libc::pid_t),
    /// In a new pid namespace the parent is outside it and `getppid()` is
    /// 0 either way: the shim holds the write end of this pipe, so the
    /// read end hangs up once the shim is gone.
    Pipe { read: RawFd, write: RawFd },
}

struct SandboxPlan {
    /// Descriptor numbers reserved for the host's `/etc` and the user's
    /// root, opened in the child once it has its own mount namespace (a
    /// mount seen through a descriptor opened before belongs to the old
    /// namespace, and cannot be bound from).
    etc_slot: RawFd,
    root_slot: RawFd,
    etc: Vec<EtcMount>,
    passwd: Vec<u8>,
    group: Vec<u8>,
    /// `data_dir` and each of its ancestors, outermost first (to recreate
    /// the path below a private `/tmp`).
    data_dir_chain: Vec<CString>,
    data_dir: CString,
    users_dir: CString,
    user_root: CString,
    /// `/proc/self/fd/<n>` of a descriptor on the user's real root.
    user_root_source: CString,
    /// Where init writes the program's wait status.
    status: RawFd,
}

/// Everything the child needs, prepared by the shim.
pub(crate) struct ChildPlan {
    uid: libc::uid_t,
    gid: libc::gid_t,
    cap_last: libc::c_ulong,
    /// `(resource, limit)`, each set as both soft and hard limit.
    rlimits: [(libc::__rlimit_resource_t, u64); 3],
    cwd: CString,
    parent: ParentCheck,
    /// Where a failing step writes its name (close-on-exec).
    diag: RawFd,
    /// The join file of each of the instance's cgroup directories, written
    /// first, as root: every process the program starts is born inside.
    cgroup_join: Vec<RawFd>,
    /// A hook's: the program's mount namespace, joined (a sandbox).
    join_mount_ns: Option<RawFd>,
    sandbox: Option<SandboxPlan>,
}

/// What the shim keeps of a plan: the descriptors the child uses must stay
/// open until the program is spawned, and the shim reads the diagnostics
/// and (sandbox) the exit status from its ends of the pipes.
pub(crate) struct ShimEnds {
    /// Read end of the diagnostics pipe.
    pub diag: OwnedFd,
    /// Read end of the status pipe (sandbox).
    pub status: Option<OwnedFd>,
    /// Held, never read, while the program runs (sandbox): see
    /// [`ParentCheck::Pipe`].
    pub _alive: Option<OwnedFd>,
    /// Descriptors only the child needs; closed once it has been spawned.
    pub child_only: Vec<OwnedFd>,
}

/// prctl(2) with every argument a full `unsigned long`: the call is
/// variadic, and an `int` passed for an unused argument may leave garbage
/// in the upper half of its register, which some options refuse.
///
/// # Safety
///
/// `option` must be one that takes integer arguments only.
unsafe fn prctl(option: libc::c_int, arg2: libc::c_ulong) -> libc::c_long {
    let zero: libc::c_ulong = 0;
    // SAFETY: by the caller's promise, no argument is a pointer.
    unsafe { libc::prctl(option, arg2, zero, zero, zero) }.into()
}

fn cstring(s: impl AsRef<[u8]>, what: &str) -> Result<CString, String> {
    CString::new(s.as_ref().to_vec()).map_err(|_| format!("{what} contains a NUL byte"))
}

fn cpath(p: &Path, what: &str) -> Result<CString, String> {
    cstring(p.as_os_str().as_bytes(), what)
}

fn pipe() -> Result<(OwnedFd, OwnedFd), String> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("cannot make a pipe: {e}"))
}

pub(crate) fn open_fd(path: &Path, flags: libc::c_int, what: &str) -> Result<OwnedFd, String> {
    let c = cpath(path, what)?;
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call;
    // open(2) does not keep the pointer.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(format!(
            "cannot open {what} {}: {}",
            path.display(),
            io::Error::last_os_error()
        ));
    }
    // SAFETY: open(2) has just returned this descriptor; it is ours alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `wanted`, or the current hard limit of `resource` if that is lower:
/// raising a hard limit needs CAP_SYS_RESOURCE, which root may lack (in a
/// container, say), and lowering is always allowed.
fn within_hard_limit(resource: libc::__rlimit_resource_t, wanted: u64) -> u64 {
    let mut current = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) fills the struct, which lives for the call.
    if unsafe { libc::getrlimit(resource, &mut current) } != 0 {
        return wanted;
    }
    wanted.min(current.rlim_max)
}

/// The rlimits every process of the instance gets, each set as both soft
/// and hard limit.
fn rlimits(isolation: &IsolationSpec) -> [(libc::__rlimit_resource_t, u64); 3] {
    [
        (
            libc::RLIMIT_NPROC,
            within_hard_limit(libc::RLIMIT_NPROC, isolation.limits.pids_max),
        ),
        (
            libc::RLIMIT_NOFILE,
            within_hard_limit(libc::RLIMIT_NOFILE, isolation.limits.open_files_max),
        ),
        (libc::RLIMIT_CORE, 0),
    ]
}

/// The highest capability number this kernel knows.
fn cap_last() -> libc::c_ulong {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        // CAP_CHECKPOINT_RESTORE, the last of Linux 6.x; dropping numbers
        // the kernel does not know fails harmlessly (EINVAL, ignored).
        .unwrap_or(40)
}

impl ChildPlan {
    /// Prepares the setup of `isolation` for a program whose working
    /// directory is `cwd`. For a sandbox, `cgroup` is the instance's
    /// cgroup, already created with its limits.
    pub(crate) fn build(
        isolation: &IsolationSpec,
        cwd: &Path,
        cgroup: Option<&InstanceCgroup>,
    ) -> Result<(ChildPlan, ShimEnds), String> {
        let (diag_read, diag_write) = pipe()?;
        let mut child_only = vec![diag_write];
        let cwd = cpath(cwd, "the working directory")?;
        let mut status_read = None;
        let mut alive = None;
        let mut cgroup_join = Vec::new();
        for file in cgroup.map(InstanceCgroup::join_files).unwrap_or_default() {
            let fd = open_fd(&file, libc::O_WRONLY, "cgroup file")?;
            cgroup_join.push(fd.as_raw_fd());
            child_only.push(fd);
        }
        let (parent, sandbox) = match (&isolation.sandbox, cgroup) {
            (None, _) => (ParentCheck::Pid(nix::unistd::getpid().as_raw()), None),
            (Some(_), None) => return Err("a sandbox needs its cgroup".to_owned()),
            (Some(sandbox), Some(_)) => {
                let reserve = || open_fd(Path::new("/dev/null"), libc::O_RDONLY, "device");
                let etc_slot = reserve()?;
                let host_etc_fd = etc_slot.as_raw_fd();
                child_only.push(etc_slot);
                let mut etc_mounts = Vec::new();
                for (name, entry) in etc::host_entries(Path::new("/etc")) {
                    let target = cstring(format!("/etc/{name}"), "an /etc entry")?;
                    let source = || cstring(format!("/proc/self/fd/{host_etc_fd}/{name}"), "");
                    let kind = match entry {
                        Entry::Dir => EtcKind::Dir { source: source()? },
                        Entry::File => EtcKind::File { source: source()? },
                        Entry::Link(to) => EtcKind::Link {
                            to: cpath(&to, "a link target")?,
                        },
                    };
                    etc_mounts.push(EtcMount { target, kind });
                }
                if !etc::valid_name(&isolation.name) {
                    return Err(format!(
                        "account name {:?} cannot stand in /etc/passwd",
                        isolation.name
                    ));
                }
                let root_slot = reserve()?;
                let root_slot_fd = root_slot.as_raw_fd();
                let user_root_source = cstring(format!("/proc/self/fd/{root_slot_fd}"), "")?;
                child_only.push(root_slot);
                let (status_r, status_w) = pipe()?;
                status_read = Some(status_r);
                let status = status_w.as_raw_fd();
                child_only.push(status_w);
                let (alive_r, alive_w) = pipe()?;
                let parent = ParentCheck::Pipe {
                    read: alive_r.as_raw_fd(),
                    write: alive_w.as_raw_fd(),
                };
                child_only.push(alive_r);
                alive = Some(alive_w);
                let mut chain: Vec<PathBuf> = sandbox
                    .data_dir
                    .ancestors()
                    .filter(|a| a.parent().is_some())
                    .map(Path::to_owned)
                    .collect();
                chain.reverse();
                let users_dir = sandbox.data_dir.join("users");
                let plan = SandboxPlan {
                    etc_slot: host_etc_fd,
                    root_slot: root_slot_fd,
                    etc: etc_mounts,
                    passwd: etc::passwd(
                        &isolation.name,
                        isolation.uid,
                        isolation.gid,
                        &sandbox.home,
                    )
                    .into_bytes(),
                    group: etc::group(&isolation.name, isolation.gid).into_bytes(),
                    data_dir_chain: chain
                        .iter()
                        .map(|p| cpath(p, "the data dir"))
                        .collect::<Result<_, _>>()?,
                    data_dir: cpath(&sandbox.data_dir, "the data dir")?,
                    users_dir: cpath(&users_dir, "the data dir")?,
                    user_root: cpath(&sandbox.user_root, "the user's root")?,
                    user_root_source,
                    status,
                };
                (parent, Some(plan))
            }
        };
        let plan = ChildPlan {
            uid: isolation.uid,
            gid: isolation.gid,
            cap_last: cap_last(),
            rlimits: rlimits(isolation),
            cwd,
            parent,
            diag: child_only[0].as_raw_fd(),
            cgroup_join,
            join_mount_ns: None,
            sandbox,
        };
        Ok((
            plan,
            ShimEnds {
                diag: diag_read,
                status: status_read,
                _alive: alive,
                child_only,
            },
        ))
    }

    /// Prepares a hook run beside the program whose process in the shim's
    /// namespace is `program_pid` (in a sandbox, its namespace's init):
    /// the same account, rlimits and cgroup, the working directory `cwd`,
    /// and in a sandbox the program's own mount namespace, joined rather
    /// than made. The sandbox's network and pid namespaces need no joining:
    /// they are the shim's, and its children's, already.
    pub(crate) fn beside(
        isolation: &IsolationSpec,
        cwd: &Path,
        cgroup: Option<&InstanceCgroup>,
        program_pid: u32,
    ) -> Result<(ChildPlan, ShimEnds), String> {
        let (diag_read, diag_write) = pipe()?;
        let mut child_only = vec![diag_write];
        let mut cgroup_join = Vec::new();
        for file in cgroup.map(InstanceCgroup::join_files).unwrap_or_default() {
            let fd = open_fd(&file, libc::O_WRONLY, "cgroup file")?;
            cgroup_join.push(fd.as_raw_fd());
            child_only.push(fd);
        }
        let (parent, join_mount_ns, alive) = if isolation.sandbox.is_some() {
            let ns = Path::new("/proc")
                .join(program_pid.to_string())
                .join("ns/mnt");
            let ns = open_fd(&ns, libc::O_RDONLY, "the program's mount namespace")?;
            let join = ns.as_raw_fd();
            child_only.push(ns);
            let (alive_r, alive_w) = pipe()?;
            let parent = ParentCheck::Pipe {
                read: alive_r.as_raw_fd(),
                write: alive_w.as_raw_fd(),
            };
            child_only.push(alive_r);
            (parent, Some(join), Some(alive_w))
        } else {
            (ParentCheck::Pid(nix::unistd::getpid().as_raw()), None, None)
        };
        let plan = ChildPlan {
            uid: isolation.uid,
            gid: isolation.gid,
            cap_last: cap_last(),
            rlimits: rlimits(isolation),
            cwd: cpath(cwd, "the working directory")?,
            parent,
            diag: child_only[0].as_raw_fd(),
            cgroup_join,
            join_mount_ns,
            sandbox: None,
        };
        let ends = ShimEnds {
            diag: diag_read,
            status: None,
            _alive: alive,
            child_only,
        };
        Ok((plan, ends))
    }

    /// Runs in the forked child, before `exec`.
    ///
    /// # Safety
    ///
    /// Call only in a child just forked from the shim (a `pre_exec` hook),
    /// with every descriptor of the plan still open. In a sandbox this
    /// forks: the calling process never returns but becomes the pid
    /// namespace's init; the new child returns and executes the program.
    pub(crate) unsafe fn enter(&self) -> io::Result<()> {
        // berth's own umask (077) is for berth's files; programs get the
        // usual one, and the sandbox's mount points must be searchable.
        // SAFETY: umask(2) takes and returns a mode.
        unsafe { libc::umask(0o022) };
        if let ParentCheck::Pipe { write, .. } = self.parent {
            // Only the shim's copy may keep the pipe open.
            // SAFETY: closing a descriptor number is async-signal-safe.
            unsafe { libc::close(write) };
        }
        for &fd in &self.cgroup_join {
            self.check(sys::write(fd, b"0"), "join the instance's cgroup")?;
        }
        if let Some(ns) = self.join_mount_ns {
            // SAFETY: setns(2) on a descriptor the plan keeps open; the
            // child is single-threaded, as joining a mount namespace needs.
            let ret = unsafe { libc::setns(ns, libc::CLONE_NEWNS) };
            self.check(ret.into(), "join the program's mount namespace")?;
        }
        if let Some(sandbox) = &self.sandbox {
            // SAFETY: same contract as this function.
            unsafe { self.enter_sandbox(sandbox) }?;
        }
        // SAFETY: same contract as this function.
        unsafe { self.drop_privileges() }?;
        // As the account, so the path is resolved with its rights.
        // SAFETY: `cwd` is a valid C string owned by the plan.
        self.check(unsafe { libc::chdir(self.cwd.as_ptr()) }.into(), "chdir")?;
        // SAFETY: same contract as this function.
        unsafe { self.check_parent() }?;
        // The shim ignores SIGHUP, and an ignored signal survives exec.
        // SAFETY: SIG_DFL installs no handler.
        unsafe { libc::signal(libc::SIGHUP, libc::SIG_DFL) };
        if let Some(sandbox) = &self.sandbox {
            // SAFETY: the process is single-threaded (a forked child); a
            // raw clone with only SIGCHLD behaves as fork(2) without
            // running at-fork handlers; the child gets a copy of this
            // stack and returns 0.
            let pid = unsafe {
                libc::syscall(
                    libc::SYS_clone,
                    libc::SIGCHLD as libc::c_ulong,
                    0usize,
                    0usize,
                    0usize,
                    0usize,
                )
            };
            if pid < 0 {
                return Err(self.fail("fork the program"));
            }
            if pid > 0 {
                // SAFETY: same contract as this function.
                unsafe { init_loop(pid as libc::pid_t, sandbox.status) };
            }
        }
        Ok(())
    }

    fn fail(&self, step: &'static str) -> io::Error {
        let err = io::Error::last_os_error();
        // SAFETY: write(2) of a static string to a descriptor of the plan
        // (close-on-exec, so gone once the program runs).
        unsafe { libc::write(self.diag, step.as_ptr().cast(), step.len()) };
        err
    }

    fn check(&self, ret: libc::c_long, step: &'static str) -> io::Result<()> {
        if ret < 0 {
            Err(self.fail(step))
        } else {
            Ok(())
        }
    }

    /// # Safety
    ///
    /// As [`ChildPlan::enter`].
    unsafe fn enter_sandbox(&self, sb: &SandboxPlan) -> io::Result<()> {
        // SAFETY: unshare(2) takes flags only.
        let ret = unsafe { libc::unshare(libc::CLONE_NEWNS) };
        self.check(ret.into(), "create a mount namespace")?;
        self.check(
            sys::mount(None, c"/", None, libc::MS_REC | libc::MS_PRIVATE, None),
            "make the mounts private",
        )?;
        for (path, flags, slot, step) in [
            (
                c"/etc",
                libc::O_PATH | libc::O_DIRECTORY,
                sb.etc_slot,
                "open the host's /etc",
            ),
            (
                sb.user_root.as_c_str(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                sb.root_slot,
                "open the user's root",
            ),
        ] {
            let fd = sys::open(path, flags, 0);
            self.check(fd, step)?;
            let moved = sys::dup3(fd as RawFd, slot);
            sys::close(fd as RawFd);
            self.check(moved, step)?;
        }
        let tmpfs = Some(c"tmpfs");
        let private = libc::MS_NOSUID | libc::MS_NODEV;
        self.check(
            sys::mount(tmpfs, c"/etc", tmpfs, private, Some(c"mode=0755,size=1m")),
            "mount a tmpfs on /etc",
        )?;
        for entry in &sb.etc {
            let target = entry.target.as_c_str();
            match &entry.kind {
                EtcKind::Dir { source } => {
                    self.check(sys::mkdir(target, 0o755), "make a mount point in /etc")?;
                    self.bind(source, target)?;
                }
                EtcKind::File { source } => {
                    let fd = sys::open(target, libc::O_CREAT | libc::O_WRONLY, 0o644);
                    self.check(fd, "make a mount point in /etc")?;
                    sys::close(fd as RawFd);
                    self.bind(source, target)?;
                }
                EtcKind::Link { to } => {
                    self.check(sys::symlink(to, target), "link an /etc entry")?;
                }
            }
        }
        for (path, bytes) in [(c"/etc/passwd", &sb.passwd), (c"/etc/group", &sb.group)] {
            let fd = sys::open(path, libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC, 0o644);
            self.check(fd, "write /etc/passwd or /etc/group")?;
            let written = sys::write(fd as RawFd, bytes);
            sys::close(fd as RawFd);
            self.check(written, "write /etc/passwd or /etc/group")?;
        }
        // The system, read-only and without set-uid, in one call for the
        // whole tree (mount_setattr, Linux 5.12).
        self.check(
            sys::mount_setattr(c"/", true, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0),
            "make the system read-only",
        )?;
        for target in [c"/tmp", c"/dev/shm"] {
            let ret = sys::mount(tmpfs, target, tmpfs, private, Some(c"mode=1777"));
            // A host without /dev/shm has none in the sandbox either.
            if ret < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::ENOENT) {
                return Err(self.fail("mount a private /tmp or /dev/shm"));
            }
        }
        // The data dir's path, recreated where a private /tmp hid it.
        for dir in &sb.data_dir_chain {
            let ret = sys::mkdir(dir, 0o755);
            if ret < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
                return Err(self.fail("recreate the data dir's path"));
            }
        }
        self.check(
            sys::mount(
                tmpfs,
                &sb.data_dir,
                tmpfs,
                private,
                Some(c"mode=0711,size=1m"),
            ),
            "hide berth's data dir",
        )?;
        self.check(sys::mkdir(&sb.users_dir, 0o711), "make the users dir")?;
        self.check(sys::mkdir(&sb.user_root, 0o700), "make the user's root")?;
        self.check(
            sys::mount(
                Some(&sb.user_root_source),
                &sb.user_root,
                None,
                libc::MS_BIND,
                None,
            ),
            "bind the user's root",
        )?;
        // A bind copies the read-only flag of the mount it comes from.
        self.check(
            sys::mount_setattr(&sb.user_root, false, 0, MOUNT_ATTR_RDONLY),
            "make the user's root writable",
        )?;
        self.check(
            sys::mount(
                Some(c"proc"),
                c"/proc",
                Some(c"proc"),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                None,
            ),
            "mount /proc of the pid namespace",
        )
    }

    fn bind(&self, source: &CStr, target: &CStr) -> io::Result<()> {
        self.check(
            sys::mount(
                Some(source),
                target,
                None,
                libc::MS_BIND | libc::MS_REC,
                None,
            ),
            "bind a host /etc entry",
        )
    }

    /// # Safety
    ///
    /// As [`ChildPlan::enter`].
    unsafe fn drop_privileges(&self) -> io::Result<()> {
        // Set while still root (raising a soft limit up to the hard one).
        for (resource, value) in self.rlimits {
            let limit = libc::rlimit {
                rlim_cur: value,
                rlim_max: value,
            };
            // SAFETY: setrlimit(2) reads the struct and keeps no pointer.
            let ret = unsafe { libc::setrlimit(resource, &limit) };
            self.check(ret.into(), "set rlimits")?;
        }
        // Raw system calls, not glibc's wrappers (which would signal every
        // thread the shim had): each changes the credentials of this thread
        // only, which in a single-threaded child is the whole process.
        // SAFETY: setgroups(2) with a null list of length 0.
        let ret =
            unsafe { libc::syscall(libc::SYS_setgroups, 0usize, std::ptr::null::<libc::gid_t>()) };
        self.check(ret, "drop supplementary groups")?;
        // SAFETY: setresgid(2) with plain ids.
        let ret = unsafe { libc::syscall(libc::SYS_setresgid, self.gid, self.gid, self.gid) };
        self.check(ret, "set the gid")?;
        // The bounding set can only be emptied with CAP_SETPCAP, so before
        // the uid changes.
        for cap in 0..=self.cap_last {
            // SAFETY: PR_CAPBSET_DROP takes a capability number.
            let ret = unsafe { prctl(libc::PR_CAPBSET_DROP, cap) };
            if ret < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
                return Err(self.fail("empty the capability bounding set"));
            }
        }
        // SAFETY: PR_CAP_AMBIENT takes integer arguments.
        let ret = unsafe {
            prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            )
        };
        self.check(ret, "clear ambient capabilities")?;
        // SAFETY: setresuid(2) with plain ids.
        let ret = unsafe { libc::syscall(libc::SYS_setresuid, self.uid, self.uid, self.uid) };
        self.check(ret, "set the uid")?;
        // Leaving root cleared the effective and permitted sets; this
        // clears the inheritable one too.
        let header = CapHeader {
            version: CAP_VERSION_3,
            pid: 0,
        };
        let data = [CapData {
            effective: 0,
            permitted: 0,
            inheritable: 0,
        }; 2];
        // SAFETY: capset(2) reads a header and two data structs, both
        // alive for the call.
        let ret =
            unsafe { libc::syscall(libc::SYS_capset, &header as *const CapHeader, data.as_ptr()) };
        self.check(ret, "drop capabilities")?;
        // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments.
        let ret = unsafe { prctl(libc::PR_SET_NO_NEW_PRIVS, 1) };
        self.check(ret, "set no_new_privs")
    }

    /// Sets the parent-death signal and makes sure the shim did not die
    /// before it was set.
    ///
    /// # Safety
    ///
    /// As [`ChildPlan::enter`].
    unsafe fn check_parent(&self) -> io::Result<()> {
        // SAFETY: PR_SET_PDEATHSIG takes a signal number.
        let ret = unsafe { prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) };
        self.check(ret, "set the parent-death signal")?;
        let gone = match self.parent {
            // SAFETY: getppid(2) takes nothing.
            ParentCheck::Pid(shim) => (unsafe { libc::getppid() }) != shim,
            ParentCheck::Pipe { read, .. } => {
                let mut fds = [libc::pollfd {
                    fd: read,
                    events: libc::POLLIN,
                    revents: 0,
                }];
                // SAFETY: poll(2) on one pollfd that lives for the call,
                // with no wait.
                let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) };
                n > 0 && fds[0].revents & libc::POLLHUP != 0
            }
        };
        if gone {
            // An error here makes std `_exit` the child before exec.
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(())
    }
}

/// Thin wrappers of the system calls the sandbox's setup makes, each a
/// single call on C strings and buffers that outlive it: safe to call, and
/// async-signal-safe (no allocation, no lock). Each returns the call's raw
/// result (negative on error, with `errno` set).
mod sys {
    use std::ffi::CStr;
    use std::os::fd::RawFd;

    use nix::libc;

    use super::MountAttr;

    fn ptr(s: Option<&CStr>) -> *const libc::c_char {
        s.map_or(std::ptr::null(), CStr::as_ptr)
    }

    pub fn mount(
        source: Option<&CStr>,
        target: &CStr,
        fstype: Option<&CStr>,
        flags: libc::c_ulong,
        data: Option<&CStr>,
    ) -> libc::c_long {
        // SAFETY: every pointer is null or a NUL-terminated string that
        // lives for the call; mount(2) keeps none of them.
        unsafe {
            libc::mount(
                ptr(source),
                target.as_ptr(),
                ptr(fstype),
                flags,
                ptr(data).cast(),
            )
        }
        .into()
    }

    /// mount_setattr(2) on `path` (its whole tree when `recursive`).
    pub fn mount_setattr(path: &CStr, recursive: bool, set: u64, clear: u64) -> libc::c_long {
        let attr = MountAttr {
            attr_set: set,
            attr_clr: clear,
            propagation: 0,
            userns_fd: 0,
        };
        let flags = if recursive { libc::AT_RECURSIVE } else { 0 } as libc::c_uint;
        // SAFETY: a path string and an attribute struct that live for the
        // call, with the struct's true size.
        unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                libc::AT_FDCWD,
                path.as_ptr(),
                flags,
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            )
        }
    }

    pub fn mkdir(path: &CStr, mode: libc::mode_t) -> libc::c_long {
        // SAFETY: a NUL-terminated path that lives for the call.
        unsafe { libc::mkdir(path.as_ptr(), mode) }.into()
    }

    /// open(2), always close-on-exec.
    pub fn open(path: &CStr, flags: libc::c_int, mode: libc::c_uint) -> libc::c_long {
        // SAFETY: a NUL-terminated path that lives for the call.
        unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC, mode) }.into()
    }

    pub fn close(fd: RawFd) {
        // SAFETY: closes a descriptor number this setup opened; an error
        // (EBADF) changes nothing.
        unsafe { libc::close(fd) };
    }

    pub fn dup3(fd: RawFd, onto: RawFd) -> libc::c_long {
        // SAFETY: plain descriptor numbers; `onto` is a slot the plan
        // reserved for exactly this.
        unsafe { libc::dup3(fd, onto, libc::O_CLOEXEC) }.into()
    }

    pub fn write(fd: RawFd, bytes: &[u8]) -> libc::c_long {
        // SAFETY: a buffer of `bytes.len()` bytes that lives for the call.
        unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) as libc::c_long }
    }

    pub fn symlink(to: &CStr, at: &CStr) -> libc::c_long {
        // SAFETY: two NUL-terminated strings that live for the call.
        unsafe { libc::symlink(to.as_ptr(), at.as_ptr()) }.into()
    }
}

/// The sandbox's init: reaps every child until the program (`program`)
/// exits, then writes its wait status to `status` and exits, which ends
/// the pid namespace.
///
/// # Safety
///
/// Call only in the forked child of [`ChildPlan::enter`]; never returns.
unsafe fn init_loop(program: libc::pid_t, status: RawFd) -> ! {
    // Nothing of the shim's but the status pipe: std's exec-error pipe in
    // particular must close, or the shim would wait on it forever.
    for fd in 0..status {
        // SAFETY: close(2) of descriptor numbers; EBADF is harmless.
        unsafe { libc::close(fd) };
    }
    // SAFETY: close_range(2) with plain numbers; on kernels without it the
    // loop below does the same.
    let ranged = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            (status + 1) as libc::c_uint,
            libc::c_uint::MAX,
            0 as libc::c_uint,
        )
    };
    if ranged < 0 {
        for fd in (status + 1)..4096 {
            // SAFETY: as above.
            unsafe { libc::close(fd) };
        }
    }
    // SAFETY: SIG_DFL installs no handler (the shim's runtime had one).
    unsafe { libc::signal(libc::SIGCHLD, libc::SIG_DFL) };
    loop {
        let mut wstatus: libc::c_int = 0;
        // SAFETY: waitpid(2) writes one int that lives for the call.
        let pid = unsafe { libc::waitpid(-1, &mut wstatus, 0) };
        if pid == program {
            let bytes = wstatus.to_ne_bytes();
            // SAFETY: write(2) of a local buffer; _exit(2) ends the process
            // without running anything of the shim's.
            unsafe {
                libc::write(status, bytes.as_ptr().cast(), bytes.len());
                libc::_exit(0);
            }
        }
        if pid < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            // SAFETY: as above.
            unsafe { libc::_exit(1) };
        }
    }
}

/// The program's exit as init reported it: `(code, signal)` from a wait
/// status read from the status pipe.
pub(crate) fn decode_status(bytes: &[u8]) -> Option<(Option<i32>, Option<i32>)> {
    let raw = i32::from_ne_bytes(bytes.get(..4)?.try_into().ok()?);
    if libc::WIFEXITED(raw) {
        Some((Some(libc::WEXITSTATUS(raw)), None))
    } else if libc::WIFSIGNALED(raw) {
        Some((None, Some(libc::WTERMSIG(raw))))
    } else {
        None
    }
}

/// Reads whatever is in a pipe's read end without blocking.
pub(crate) fn read_pipe(fd: &OwnedFd) -> Vec<u8> {
    let _ = nix::fcntl::fcntl(
        fd.as_raw_fd(),
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
    );
    let mut out = Vec::new();
    let mut buf = [0u8; 256];
    while let Ok(n) = nix::unistd::read(fd.as_raw_fd(), &mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_statuses_decode() {
        // Exited with 3: status 3 << 8; killed by SIGKILL: 9.
        assert_eq!(
            decode_status(&(3i32 << 8).to_ne_bytes()),
            Some((Some(3), None))
        );
        assert_eq!(decode_status(&9i32.to_ne_bytes()), Some((None, Some(9))));
        assert_eq!(decode_status(&[1, 2]), None);
    }
}
