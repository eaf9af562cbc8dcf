//! The data dir's lock: proof that no other live process uses this data
//! dir, and the data dir's identity that a node records in its row
//! (docs/design.md, "Node identity across restarts").
//!
//! `berth serve` takes an exclusive `flock` on `<data_dir>/node.lock` before
//! anything else and holds it for its whole life. The kernel drops the lock
//! when the process dies, however it dies, and never earlier: a paused
//! (SIGSTOP) process still holds it. The descriptor is close-on-exec, so no
//! program berth starts inherits it (and the zygote closes every stray
//! descriptor anyway): a shim or a user's program that outlives berth
//! never keeps a dead berth's lock.
//!
//! The file also holds the data dir's identity, a random id made once, and
//! the pid of the holder (for the refusal message). The identity is
//! prefixed with the host name, so a data dir copied to another host is
//! another data dir.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

/// The lock file's name inside the data dir.
pub const LOCK_FILE: &str = "node.lock";

/// The held lock. Dropping it (or dying) releases it.
#[derive(Debug)]
pub struct DataDirLock {
    _file: Flock<File>,
    identity: String,
}

/// Why the data dir could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "the data dir {dir} is in use by another berth process{holder}: it holds the lock \
         {lock}. One data dir (and one node id) belongs to one live process; a paused process \
         still counts. Stop that process first, or start this one with its own data_dir"
    )]
    Busy {
        dir: PathBuf,
        lock: PathBuf,
        /// ` (pid N)` when the file names it.
        holder: String,
    },
    #[error("cannot use the lock file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl DataDirLock {
    /// Locks `data_dir` (which must exist) for this process, without
    /// waiting: a lock another process holds is [`LockError::Busy`].
    pub fn acquire(data_dir: &Path) -> Result<Self, LockError> {
        let path = data_dir.join(LOCK_FILE);
        let io = |source| LockError::Io {
            path: path.clone(),
            source,
        };
        // std opens every file close-on-exec.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(io)?;
        let mut file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(locked) => locked,
            Err((mut file, Errno::EWOULDBLOCK)) => {
                let holder = read_contents(&mut file)
                    .ok()
                    .and_then(|(_, pid)| pid)
                    .map(|pid| format!(" (pid {pid})"))
                    .unwrap_or_default();
                return Err(LockError::Busy {
                    dir: data_dir.to_owned(),
                    lock: path,
                    holder,
                });
            }
            Err((_, errno)) => return Err(io(std::io::Error::from(errno))),
        };
        let (id, _) = read_contents(&mut file).map_err(io)?;
        let id = match id {
            Some(id) => id,
            None => new_id().map_err(io)?,
        };
        // Rewritten under the lock: the id stays, the pid is ours.
        file.set_len(0).map_err(io)?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        write!(file, "{id}\n{}\n", std::process::id()).map_err(io)?;
        file.flush().map_err(io)?;
        let host = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_default();
        Ok(Self {
            _file: file,
            identity: format!("{host}/{id}"),
        })
    }

    /// The data dir's identity on this host: what a node records in its
    /// row when it claims its id.
    pub fn identity(&self) -> &str {
        &self.identity
    }
}

/// Whether a live process holds `data_dir`'s lock, read from the kernel
/// without taking the lock: taking it, even for a moment, could make a
/// berth starting there refuse. A data dir that cannot be checked counts
/// as in use.
///
/// The holder named in the file is asked: the lock is held when one of its
/// descriptors is the lock file and the kernel lists a `flock` on it in
/// that descriptor's `fdinfo`. The host's table of locks, `/proc/locks`,
/// would not do: it is read a page at a time by position, so a lock
/// released meanwhile ahead of ours shifts ours out of sight.
pub fn in_use(data_dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let path = data_dir.join(LOCK_FILE);
    let (lock_file, holder) = match std::fs::File::open(&path) {
        Ok(mut file) => match (file.metadata(), read_contents(&mut file)) {
            (Ok(meta), Ok((_, pid))) => ((meta.dev(), meta.ino()), pid),
            _ => return true,
        },
        // No lock file: no berth serves from here.
        Err(e) => return e.kind() != std::io::ErrorKind::NotFound,
    };
    // The holder writes its pid as soon as it holds the lock; a file
    // without one was never finished, and its berth holds nothing yet
    // that the caller could take from it.
    let Some(pid) = holder else { return false };
    let descriptors = match std::fs::read_dir(format!("/proc/{pid}/fd")) {
        Ok(descriptors) => descriptors,
        Err(e) => return e.kind() != std::io::ErrorKind::NotFound,
    };
    descriptors.flatten().any(|fd| {
        let is_lock_file =
            std::fs::metadata(fd.path()).is_ok_and(|meta| (meta.dev(), meta.ino()) == lock_file);
        is_lock_file
            && std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.file_name().display()))
                .is_ok_and(|fdinfo| holds_flock(&fdinfo))
    })
}

/// Whether a descriptor's `fdinfo` text lists a `flock` held through it.
/// The kernel prints each as, e.g.,
/// `lock:\t1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF`; a lock the
/// descriptor waits for is listed with `->` and is not held.
fn holds_flock(fdinfo: &str) -> bool {
    fdinfo.lines().any(|line| {
        line.strip_prefix("lock:").is_some_and(|lock| {
            let fields: Vec<&str> = lock.split_whitespace().collect();
            fields.get(1) == Some(&"FLOCK")
        })
    })
}

/// The id (first line, 32 hex digits) and the pid (second line) in the
/// file, each if well-formed.
fn read_contents(file: &mut File) -> std::io::Result<(Option<String>, Option<u32>)> {
    let mut text = String::new();
    file.seek(SeekFrom::Start(0))?;
    file.take(4096).read_to_string(&mut text)?;
    let mut lines = text.lines();
    let id = lines
        .next()
        .map(str::trim)
        .filter(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()))
        .map(str::to_owned);
    let pid = lines.next().and_then(|p| p.trim().parse().ok());
    Ok((id, pid))
}

fn new_id() -> std::io::Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(hex::encode(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_holder_at_a_time_and_the_identity_stays() {
        let dir = tempfile::tempdir().unwrap();
        let first = DataDirLock::acquire(dir.path()).unwrap();
        let identity = first.identity().to_owned();
        // A second open file description is refused, naming the holder,
        // even within one process.
        let err = DataDirLock::acquire(dir.path()).unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, LockError::Busy { .. }), "{message}");
        assert!(
            message.contains(&format!("(pid {})", std::process::id())),
            "{message}"
        );
        assert!(message.contains("node.lock"), "{message}");
        drop(first);
        let again = DataDirLock::acquire(dir.path()).unwrap();
        assert_eq!(again.identity(), identity, "the data dir keeps its id");

        // Another data dir is another identity.
        let other = tempfile::tempdir().unwrap();
        let other = DataDirLock::acquire(other.path()).unwrap();
        assert_ne!(other.identity(), identity);
    }

    #[test]
    fn in_use_reads_the_kernels_locks_without_taking_them() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!in_use(dir.path()), "never served from");
        let lock = DataDirLock::acquire(dir.path()).unwrap();
        assert!(in_use(dir.path()));
        // Still held afterwards: nothing was taken or given up.
        assert!(DataDirLock::acquire(dir.path()).is_err());
        drop(lock);
        assert!(!in_use(dir.path()), "the lock file stays, the lock is gone");

        let fdinfo = "pos:\t0\nflags:\t02100002\nmnt_id:\t27\nino:\t5678\n";
        assert!(holds_flock(&format!(
            "{fdinfo}lock:\t1: FLOCK  ADVISORY  WRITE 77 fd:01:5678 0 EOF\n"
        )));
        assert!(!holds_flock(fdinfo), "no lock");
        assert!(
            !holds_flock(&format!(
                "{fdinfo}lock:\t1: POSIX  ADVISORY  WRITE 78 fd:01:5678 0 EOF\n\
                 lock:\t2: -> FLOCK  ADVISORY  WRITE 79 fd:01:5678 0 EOF\n"
            )),
            "a POSIX lock, and a waiter"
        );
    }

    /// Other files' locks come and go all the time on a busy host; the
    /// answer for a held lock must not depend on them.
    #[test]
    fn a_held_lock_is_seen_while_other_locks_come_and_go() {
        let dir = tempfile::tempdir().unwrap();
        let _lock = DataDirLock::acquire(dir.path()).unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|threads| {
            for worker in 0..4 {
                let (others, stop) = (dir.path().join(format!("other-{worker}")), &stop);
                threads.spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let files: Vec<_> = (0..16)
                            .map(|i| {
                                let file =
                                    File::create(others.with_extension(i.to_string())).unwrap();
                                Flock::lock(file, FlockArg::LockExclusive).unwrap()
                            })
                            .collect();
                        drop(files);
                    }
                });
            }
            let missed = (0..2000).filter(|_| !in_use(dir.path())).count();
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            assert_eq!(missed, 0, "checks that did not see the held lock");
        });
    }

    #[test]
    fn a_holder_that_is_gone_holds_nothing() {
        let dir = tempfile::tempdir().unwrap();
        // A pid no process has: above the kernel's largest.
        std::fs::write(
            dir.path().join(LOCK_FILE),
            format!("{}\n{}\n", "0".repeat(32), u32::MAX),
        )
        .unwrap();
        assert!(!in_use(dir.path()));
        // Ours, but without the lock: another descriptor of the file is not it.
        let _open = File::open(dir.path().join(LOCK_FILE)).unwrap();
        std::fs::write(
            dir.path().join(LOCK_FILE),
            format!("{}\n{}\n", "0".repeat(32), std::process::id()),
        )
        .unwrap();
        assert!(!in_use(dir.path()));
    }

    #[test]
    fn a_damaged_file_gets_a_new_identity() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(LOCK_FILE), "not an id\n").unwrap();
        let lock = DataDirLock::acquire(dir.path()).unwrap();
        let (_, id) = lock.identity().split_once('/').unwrap();
        assert_eq!(id.len(), 32, "{}", lock.identity());
        let text = std::fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap();
        assert_eq!(text, format!("{id}\n{}\n", std::process::id()));
    }
}
