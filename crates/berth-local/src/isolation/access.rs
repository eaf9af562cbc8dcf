//! Whether an instance's uid may execute a file, judged by the shim (which
//! runs as root) from the permission bits: so that a program on `PATH` the
//! instance could never run (under a private home, say) is skipped the way
//! `execvp` would skip it, and a failure names the directory in the way.
//!
//! Only the classic owner/group/other bits are read; the account has no
//! supplementary groups. The kernel has the last word when the program is
//! executed; this check exists for the choice and the message.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Permission bits, owner and group of one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Perm {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

impl Perm {
    fn of(meta: &std::fs::Metadata) -> Perm {
        Perm {
            mode: meta.mode(),
            uid: meta.uid(),
            gid: meta.gid(),
        }
    }

    /// Whether `uid`/`gid` get `want` (a combination of 4 = read, 2 =
    /// write, 1 = execute/search) on this file.
    pub fn allows(&self, uid: u32, gid: u32, want: u32) -> bool {
        let bits = if self.uid == uid {
            self.mode >> 6
        } else if self.gid == gid {
            self.mode >> 3
        } else {
            self.mode
        } & 0o7;
        bits & want == want
    }
}

/// Why `uid` cannot execute a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Denied {
    /// A directory on the way cannot be searched.
    Dir {
        dir: PathBuf,
        perm: Perm,
    },
    /// The file itself is not executable (or, for a script, readable).
    File {
        file: PathBuf,
        perm: Perm,
    },
    Missing(String),
}

impl std::fmt::Display for Denied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Denied::Dir { dir, perm } => write!(
                f,
                "{} is not searchable by it (mode {:04o}, owner {}:{})",
                dir.display(),
                perm.mode & 0o7777,
                perm.uid,
                perm.gid
            ),
            Denied::File { file, perm } => write!(
                f,
                "{} is not executable by it (mode {:04o}, owner {}:{})",
                file.display(),
                perm.mode & 0o7777,
                perm.uid,
                perm.gid
            ),
            Denied::Missing(why) => f.write_str(why),
        }
    }
}

/// Checks that `uid`/`gid` may search every directory down to `path` (its
/// canonical form: symbolic links resolved) and execute it.
pub(crate) fn may_execute(path: &Path, uid: u32, gid: u32) -> Result<(), Denied> {
    check_with(path, uid, gid, |p| {
        std::fs::metadata(p)
            .map(|m| Perm::of(&m))
            .map_err(|e| e.to_string())
    })
}

/// [`may_execute`] with the metadata lookup given (for tests).
fn check_with(
    path: &Path,
    uid: u32,
    gid: u32,
    perm_of: impl Fn(&Path) -> Result<Perm, String>,
) -> Result<(), Denied> {
    let real = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    let mut dirs: Vec<&Path> = real.ancestors().skip(1).collect();
    dirs.reverse();
    for dir in dirs {
        let perm = perm_of(dir).map_err(|e| Denied::Missing(format!("{}: {e}", dir.display())))?;
        if !perm.allows(uid, gid, 1) {
            return Err(Denied::Dir {
                dir: dir.to_owned(),
                perm,
            });
        }
    }
    let perm = perm_of(&real).map_err(|e| Denied::Missing(format!("{}: {e}", real.display())))?;
    if !perm.allows(uid, gid, 1) {
        return Err(Denied::File { file: real, perm });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn perm(mode: u32, uid: u32, gid: u32) -> Perm {
        Perm { mode, uid, gid }
    }

    #[test]
    fn owner_group_and_other_bits_are_read_in_that_order() {
        // Owner bits win even when they allow less than "other".
        assert!(!perm(0o007, 5, 5).allows(5, 9, 1));
        assert!(perm(0o100, 5, 5).allows(5, 9, 1));
        assert!(perm(0o010, 1, 7).allows(5, 7, 1));
        assert!(!perm(0o750, 1, 7).allows(5, 8, 1));
        assert!(perm(0o755, 0, 0).allows(200_000, 200_000, 5));
        assert!(!perm(0o711, 0, 0).allows(200_000, 200_000, 4));
    }

    #[test]
    fn a_private_directory_on_the_way_is_named() {
        let perms = |p: &Path| -> Result<Perm, String> {
            Ok(match p.to_str().unwrap() {
                "/root" => perm(0o40700, 0, 0),
                "/root/bin/tool" => perm(0o100755, 0, 0),
                "/usr/bin/noexec" => perm(0o100644, 0, 0),
                _ => perm(0o40755, 0, 0),
            })
        };
        let err = check_with(Path::new("/root/bin/tool"), 200_000, 200_000, perms).unwrap_err();
        assert_eq!(
            err.to_string(),
            "/root is not searchable by it (mode 0700, owner 0:0)"
        );
        let err = check_with(Path::new("/usr/bin/noexec"), 200_000, 200_000, perms).unwrap_err();
        assert!(matches!(err, Denied::File { .. }), "{err}");
        assert!(check_with(Path::new("/usr/bin/ok"), 200_000, 200_000, perms).is_ok());
    }

    #[test]
    fn the_real_filesystem() {
        // /bin/sh (or what it links to) is executable by anyone.
        assert!(may_execute(Path::new("/bin/sh"), 65_534, 65_534).is_ok());
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tool");
        std::fs::write(&file, "#!/bin/sh\n").unwrap();
        // tempdir() makes the directory 0700 and owned by the caller.
        assert!(matches!(
            may_execute(&file, 65_534, 65_534),
            Err(Denied::Dir { .. }) | Err(Denied::File { .. })
        ));
    }
}
