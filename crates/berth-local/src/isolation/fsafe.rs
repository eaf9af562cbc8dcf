//! Touching a user's root without ever following a symbolic link in it.
//!
//! berth (and the shim) run as root and create, chmod, chown and write
//! inside each user's data root, which the user's own programs can change
//! at will. A program that replaces `patches/` with a link to `/etc` must
//! not get berth to write there. So every path below a user's root is
//! walked one component at a time from a directory descriptor, each opened
//! with `O_NOFOLLOW | O_DIRECTORY`, and everything is done through
//! descriptors (`fchmod`, `fchown`, `openat`, `renameat`), never by path.
//!
//! The directories of berth's own layout (`home`, `ws`, `tmp`, `patches`,
//! `logs`) are repaired: a link found in their place is removed (the link,
//! never what it points to) and the directory made again. Inside the
//! workspace, a link on the way to the requested folder is the user's and
//! is refused instead.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat, renameat};
use nix::sys::stat::{Mode, SFlag, fchmod, fstat, fstatat, mkdirat};
use nix::unistd::{Gid, Uid, UnlinkatFlags, fchown, unlinkat};

/// Who owns what berth creates in a user's root: the account at levels
/// `user` and `sandbox`, berth itself (`None`) at `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Owner {
    pub uid: u32,
    pub gid: u32,
}

/// What to do with a symbolic link (or another non-directory) found where
/// a directory should be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnLink {
    /// Remove the link and make the directory (berth's own layout).
    Replace,
    /// Refuse, naming the path (the user's own tree).
    Refuse,
}

/// An open directory, with its path for messages.
#[derive(Debug)]
pub(crate) struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

/// Attempts to replace a link that keeps coming back (a program racing
/// berth) before giving up.
const REPAIR_ATTEMPTS: usize = 3;

fn own(fd: i32) -> OwnedFd {
    // SAFETY: every caller passes a descriptor a successful open(2) family
    // call has just returned; nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn context(path: &Path, what: &str, e: impl Into<io::Error>) -> io::Error {
    let e: io::Error = e.into();
    io::Error::new(e.kind(), format!("cannot {what} {}: {e}", path.display()))
}

fn is_link_or_not_dir(e: Errno) -> bool {
    matches!(e, Errno::ELOOP | Errno::ENOTDIR)
}

impl Dir {
    /// Opens a directory berth trusts: its own data dir and `users/`, whose
    /// path is the operator's (links in it are followed).
    pub fn open(path: &Path) -> io::Result<Dir> {
        let fd = nix::fcntl::open(
            path,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| context(path, "open", e))?;
        Ok(Dir {
            fd: own(fd),
            path: path.to_owned(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn raw(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// The subdirectory `name` (a single component), never through a
    /// link; created (mode 0700, owned by `owner`) when missing.
    pub fn child(&self, name: &str, owner: Option<Owner>, on_link: OnLink) -> io::Result<Dir> {
        let path = self.path.join(name);
        if name.is_empty() || name == "." || name == ".." || name.contains('/') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a single path component", path.display()),
            ));
        }
        for _ in 0..REPAIR_ATTEMPTS {
            let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            match openat(Some(self.raw()), name, flags, Mode::empty()) {
                Ok(fd) => return Ok(Dir { fd: own(fd), path }),
                Err(Errno::ENOENT) => {
                    match mkdirat(Some(self.raw()), name, Mode::from_bits_truncate(0o700)) {
                        // Made by someone else meanwhile: open it next time.
                        Ok(()) | Err(Errno::EEXIST) => {}
                        Err(e) => return Err(context(&path, "create", e)),
                    }
                    let dir = self.child_created(name, &path)?;
                    dir.set_private(owner)?;
                    return Ok(dir);
                }
                Err(e) if is_link_or_not_dir(e) => {
                    let stat = fstatat(Some(self.raw()), name, AtFlags::AT_SYMLINK_NOFOLLOW)
                        .map_err(|e| context(&path, "inspect", e))?;
                    let is_link =
                        SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT == SFlag::S_IFLNK;
                    if on_link == OnLink::Refuse || !is_link {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidInput,
                            format!(
                                "{} is {}; refusing to follow it",
                                path.display(),
                                if is_link {
                                    "a symbolic link"
                                } else {
                                    "not a directory"
                                }
                            ),
                        ));
                    }
                    tracing::warn!(path = %path.display(),
                        "a symbolic link stood in place of a directory of the user's root; replacing it");
                    match unlinkat(Some(self.raw()), name, UnlinkatFlags::NoRemoveDir) {
                        Ok(()) | Err(Errno::ENOENT) => {}
                        Err(e) => return Err(context(&path, "remove the link", e)),
                    }
                }
                Err(e) => return Err(context(&path, "open", e)),
            }
        }
        Err(io::Error::other(format!(
            "{} keeps being replaced by a link; giving up",
            path.display()
        )))
    }

    fn child_created(&self, name: &str, path: &Path) -> io::Result<Dir> {
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let fd = openat(Some(self.raw()), name, flags, Mode::empty())
            .map_err(|e| context(path, "open", e))?;
        Ok(Dir {
            fd: own(fd),
            path: path.to_owned(),
        })
    }

    /// Mode 0700 and, when given, the owner: set through the descriptor,
    /// and only when they differ (a chown clears nothing else).
    pub fn set_private(&self, owner: Option<Owner>) -> io::Result<()> {
        let stat = fstat(self.raw()).map_err(|e| context(&self.path, "inspect", e))?;
        if let Some(owner) = owner
            && (stat.st_uid != owner.uid || stat.st_gid != owner.gid)
        {
            fchown(
                self.raw(),
                Some(Uid::from_raw(owner.uid)),
                Some(Gid::from_raw(owner.gid)),
            )
            .map_err(|e| context(&self.path, "chown", e))?;
        }
        if stat.st_mode & 0o7777 != 0o700 {
            fchmod(self.raw(), Mode::from_bits_truncate(0o700))
                .map_err(|e| context(&self.path, "chmod", e))?;
        }
        Ok(())
    }

    /// The directory `rel` (`a/b`, already normalised: no `..`, no leading
    /// `/`) below this one, created as needed, never through a link.
    pub fn walk(&self, rel: &str, owner: Option<Owner>, on_link: OnLink) -> io::Result<Dir> {
        let mut parts = rel.split('/').filter(|p| !p.is_empty() && *p != ".");
        let Some(first) = parts.next() else {
            return self.reopen();
        };
        let mut dir = self.child(first, owner, on_link)?;
        for part in parts {
            dir = dir.child(part, owner, on_link)?;
        }
        Ok(dir)
    }

    fn reopen(&self) -> io::Result<Dir> {
        let fd = self
            .fd
            .try_clone()
            .map_err(|e| context(&self.path, "reopen", e))?;
        Ok(Dir {
            fd,
            path: self.path.clone(),
        })
    }

    /// Replaces the file `name` with `bytes` (mode 0600, owned by `owner`):
    /// written to a fresh file, then renamed over the name, so a link in
    /// its place is replaced, never written through.
    pub fn write_file(&self, name: &str, bytes: &[u8], owner: Option<Owner>) -> io::Result<()> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let path = self.path.join(name);
        let tmp = format!(
            ".{name}.berth-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let flags =
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let fd = openat(
            Some(self.raw()),
            tmp.as_str(),
            flags,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(|e| context(&path, "create", e))?;
        let mut file = File::from(own(fd));
        let written = (|| {
            file.write_all(bytes)?;
            if let Some(owner) = owner {
                fchown(
                    file.as_raw_fd(),
                    Some(Uid::from_raw(owner.uid)),
                    Some(Gid::from_raw(owner.gid)),
                )?;
            }
            renameat(Some(self.raw()), tmp.as_str(), Some(self.raw()), name)?;
            Ok::<(), io::Error>(())
        })();
        if let Err(e) = written {
            let _ = unlinkat(Some(self.raw()), tmp.as_str(), UnlinkatFlags::NoRemoveDir);
            return Err(context(&path, "write", e));
        }
        Ok(())
    }

    /// The existing subdirectory `name`, never through a link (ENOENT when
    /// it is missing; a link is an error, not followed).
    pub fn child_existing(&self, name: &str) -> io::Result<Dir> {
        let path = self.path.join(name);
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let fd = openat(Some(self.raw()), name, flags, Mode::empty())
            .map_err(|e| context(&path, "open", e))?;
        Ok(Dir { fd: own(fd), path })
    }

    /// Opens the regular file `name` for reading, never through a link,
    /// and never blocking on a FIFO put in its place.
    pub fn open_regular(&self, name: &str) -> io::Result<File> {
        let path = self.path.join(name);
        let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
        let fd = openat(Some(self.raw()), name, flags, Mode::empty())
            .map_err(|e| context(&path, "open", e))?;
        let file = File::from(own(fd));
        let stat = fstat(file.as_raw_fd()).map_err(|e| context(&path, "inspect", e))?;
        if SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} is not a regular file", path.display()),
            ));
        }
        Ok(file)
    }

    /// Renames the entry `from` to `to`, both in this directory (a link
    /// is moved as a link, never followed).
    pub fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        nix::fcntl::renameat(Some(self.raw()), from, Some(self.raw()), to)
            .map_err(|e| context(&self.path.join(from), "rename", e))
    }

    /// Opens `name` for appending (created 0600), never through a link: a
    /// link in its place is removed and a new file made.
    pub fn open_append(&self, name: &str) -> io::Result<File> {
        let path = self.path.join(name);
        let flags = OFlag::O_WRONLY
            | OFlag::O_APPEND
            | OFlag::O_CREAT
            | OFlag::O_NOFOLLOW
            | OFlag::O_CLOEXEC;
        for _ in 0..REPAIR_ATTEMPTS {
            match openat(
                Some(self.raw()),
                name,
                flags,
                Mode::from_bits_truncate(0o600),
            ) {
                Ok(fd) => return Ok(File::from(own(fd))),
                Err(Errno::ELOOP) => {
                    match unlinkat(Some(self.raw()), name, UnlinkatFlags::NoRemoveDir) {
                        Ok(()) | Err(Errno::ENOENT) => {}
                        Err(e) => return Err(context(&path, "remove the link", e)),
                    }
                }
                Err(e) => return Err(context(&path, "open", e)),
            }
        }
        Err(io::Error::other(format!(
            "{} keeps being replaced by a link; giving up",
            path.display()
        )))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};

    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn layout_links_are_replaced_and_their_targets_untouched() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let victim = tmp.path().join("victim");
        std::fs::create_dir(&root).unwrap();
        std::fs::create_dir(&victim).unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(victim.join("keep"), "original").unwrap();
        symlink(&victim, root.join("patches")).unwrap();

        let root_dir = Dir::open(&root).unwrap();
        let patches = root_dir.child("patches", None, OnLink::Replace).unwrap();
        patches.write_file("main.yaml", b"patched", None).unwrap();
        assert!(root.join("patches").is_dir());
        assert!(
            !std::fs::symlink_metadata(root.join("patches"))
                .unwrap()
                .is_symlink()
        );
        assert_eq!(
            std::fs::read_to_string(root.join("patches/main.yaml")).unwrap(),
            "patched"
        );
        assert_eq!(mode(&root.join("patches/main.yaml")), 0o600);
        assert_eq!(mode(&root.join("patches")), 0o700);
        // The target is as it was.
        assert_eq!(mode(&victim), 0o755);
        assert_eq!(
            std::fs::read_dir(&victim).unwrap().count(),
            1,
            "nothing written into the target"
        );
        assert_eq!(
            std::fs::read_to_string(victim.join("keep")).unwrap(),
            "original"
        );
    }

    #[test]
    fn links_in_the_users_own_tree_are_refused_with_the_path() {
        let tmp = tempfile::tempdir().unwrap();
        let ws = tmp.path().join("ws");
        std::fs::create_dir(&ws).unwrap();
        symlink("/etc", ws.join("proj")).unwrap();
        let dir = Dir::open(&ws).unwrap();
        let err = dir.walk("proj/sub", None, OnLink::Refuse).unwrap_err();
        assert!(
            err.to_string()
                .ends_with("proj is a symbolic link; refusing to follow it"),
            "{err}"
        );
        assert!(!Path::new("/etc/sub").exists());
        // A plain path is made, private, component by component.
        let made = dir.walk("a/./b", None, OnLink::Refuse).unwrap();
        assert_eq!(made.path(), ws.join("a/b"));
        assert_eq!(mode(&ws.join("a")), 0o700);
        assert_eq!(mode(&ws.join("a/b")), 0o700);
        assert_eq!(dir.walk("", None, OnLink::Refuse).unwrap().path(), ws);
        assert!(dir.child("..", None, OnLink::Replace).is_err());
    }

    #[test]
    fn files_written_over_links_replace_the_link() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("target");
        std::fs::write(&target, "secret").unwrap();
        let dir_path = tmp.path().join("d");
        std::fs::create_dir(&dir_path).unwrap();
        symlink(&target, dir_path.join("handoff.json")).unwrap();
        symlink(&target, dir_path.join("main.log")).unwrap();
        let dir = Dir::open(&dir_path).unwrap();
        dir.write_file("handoff.json", b"{}", None).unwrap();
        let mut log = dir.open_append("main.log").unwrap();
        log.write_all(b"line\n").unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "secret");
        assert_eq!(
            std::fs::read_to_string(dir_path.join("main.log")).unwrap(),
            "line\n"
        );
        assert!(
            !std::fs::symlink_metadata(dir_path.join("handoff.json"))
                .unwrap()
                .is_symlink()
        );
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(&dir_path).unwrap().count(), 2);
    }

    #[test]
    fn reads_never_follow_a_link_nor_block_on_a_fifo() {
        let tmp = tempfile::tempdir().unwrap();
        let secret = tmp.path().join("secret");
        std::fs::write(&secret, "shadow").unwrap();
        let dir_path = tmp.path().join("logs");
        std::fs::create_dir(&dir_path).unwrap();
        symlink(&secret, dir_path.join("main.log")).unwrap();
        nix::unistd::mkfifo(&dir_path.join("fifo.log"), Mode::from_bits_truncate(0o600)).unwrap();
        std::fs::write(dir_path.join("ok.log"), "line\n").unwrap();
        let dir = Dir::open(tmp.path())
            .unwrap()
            .child_existing("logs")
            .unwrap();
        let err = dir.open_regular("main.log").unwrap_err();
        assert!(err.to_string().contains("symbolic links"), "{err}");
        let err = dir.open_regular("fifo.log").unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        let mut text = String::new();
        std::io::Read::read_to_string(&mut dir.open_regular("ok.log").unwrap(), &mut text).unwrap();
        assert_eq!(text, "line\n");
        symlink("/etc", tmp.path().join("linked")).unwrap();
        assert!(
            Dir::open(tmp.path())
                .unwrap()
                .child_existing("linked")
                .is_err()
        );
    }

    #[test]
    fn owners_are_set_through_the_descriptor() {
        if !crate::test_host::has(nix::unistd::geteuid().is_root(), "root") {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let owner = Owner {
            uid: 65_534,
            gid: 65_534,
        };
        let dir = Dir::open(tmp.path()).unwrap();
        let home = dir.child("home", Some(owner), OnLink::Replace).unwrap();
        home.write_file("f", b"x", Some(owner)).unwrap();
        let meta = std::fs::metadata(tmp.path().join("home")).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (65_534, 65_534));
        let meta = std::fs::metadata(tmp.path().join("home/f")).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (65_534, 65_534));
    }
}
