//! The host-wide record of instance uid ranges: two berths on one host
//! that give the same uids to different users would let one user's
//! programs signal, read and own the other's. Every berth that runs
//! instances under accounts (levels `user` and `sandbox`) registers its
//! range here before it makes any account, and is refused when the range
//! overlaps a live berth's range on another store. Berths that share a
//! store (nodes of one cluster) share its accounts and may overlap.
//!
//! Construction: a directory `/run/berth/uid-ranges/` holds one file per
//! berth, named after its data dir, with its range, store, data dir and
//! pid. The berth holds an exclusive `flock` on its file for its whole
//! life, so the kernel frees a killed berth's entry the moment it dies:
//! an entry whose lock can be taken is stale and is removed. The check
//! and the registration happen under an exclusive lock on
//! `/run/berth/uid-ranges.lock`, so two berths starting at once cannot
//! both miss each other. `/run` is a tmpfs: nothing survives a reboot,
//! and nothing needs to.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use berth_core::UidRange;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

/// Where the record lives on every host.
pub const RECORD_DIR: &str = "/run/berth";

/// One berth's entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub first: u32,
    pub count: u32,
    /// The store, without its password: berths on one store share
    /// accounts.
    pub store: String,
    pub data_dir: PathBuf,
    pub pid: u32,
}

impl Entry {
    fn last(&self) -> u64 {
        u64::from(self.first) + u64::from(self.count.max(1)) - 1
    }

    fn range_text(&self) -> String {
        format!("{}-{}", self.first, self.last())
    }
}

/// The first live entry of `others` whose range overlaps `mine` on
/// another store.
pub fn conflict<'a>(mine: &Entry, others: &'a [Entry]) -> Option<&'a Entry> {
    others.iter().find(|other| {
        other.store != mine.store
            && u64::from(other.first) <= mine.last()
            && u64::from(mine.first) <= other.last()
    })
}

/// Why a berth may not use its range.
#[derive(Debug, thiserror::Error)]
pub enum RangeError {
    #[error(
        "the instance uid range {mine} ([isolation] base_uid = {first}, uid_count = {count}) \
         overlaps the range {theirs} of the berth with data dir {their_dir} (pid {their_pid}), \
         which uses another store: the two would give the same uids to different users. Give \
         each berth on this host a range of its own (base_uid, uid_count)"
    )]
    Overlap {
        mine: String,
        first: u32,
        count: u32,
        theirs: String,
        their_dir: String,
        their_pid: u32,
    },
    #[error("cannot use the uid range record {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// This berth's entry, held until dropped (or the process dies).
#[derive(Debug)]
pub struct Registration {
    _file: Flock<File>,
    path: PathBuf,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The store's identity in the record: a SQLite file by its canonical
/// path; a cluster's store by its cluster secret (hashed), which every
/// node of the cluster holds whatever URL reaches the database (a proxy
/// or relay per node, say); without a secret, the URL without its
/// password.
pub fn store_identity(url: &str, cluster_secret: Option<&str>) -> String {
    match url.strip_prefix("sqlite://") {
        Some(rest) => {
            let path = Path::new(rest.split('?').next().unwrap_or(rest));
            let canonical = match (path.parent(), path.file_name()) {
                (Some(dir), Some(name)) => std::fs::canonicalize(if dir.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    dir
                })
                .map(|d| d.join(name)),
                _ => std::fs::canonicalize(path),
            };
            format!(
                "sqlite://{}",
                canonical.unwrap_or_else(|_| path.to_owned()).display()
            )
        }
        None => match cluster_secret {
            Some(secret) => {
                use sha2::Digest;
                let digest = sha2::Sha256::digest(format!("berth uid ranges\0{secret}"));
                format!("cluster {}", hex::encode(&digest[..16]))
            }
            None => berth_store::redact_url(url),
        },
    }
}

/// Registers `range` for the berth of `data_dir` (canonical) on `store`
/// in the record under `record_dir`, or refuses an overlap.
pub fn register(
    record_dir: &Path,
    data_dir: &Path,
    range: UidRange,
    store: &str,
) -> Result<Registration, RangeError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| RangeError::Io { path, source }
    };
    let entries = record_dir.join("uid-ranges");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&entries)
        .map_err(io(&entries))?;
    let guard_path = record_dir.join("uid-ranges.lock");
    let guard = open_rw(&guard_path).map_err(io(&guard_path))?;
    // Held only for the check and the registration.
    let _guard = Flock::lock(guard, FlockArg::LockExclusive)
        .map_err(|(_, e)| io(&guard_path)(std::io::Error::from(e)))?;

    let own_name = file_name(data_dir);
    let mut live = Vec::new();
    for item in std::fs::read_dir(&entries).map_err(io(&entries))? {
        let item = item.map_err(io(&entries))?;
        let path = item.path();
        if item.file_name().to_str() == Some(own_name.as_str()) {
            continue;
        }
        let Ok(file) = open_rw(&path) else { continue };
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            // Nobody holds it: its berth is dead.
            Ok(stale) => {
                let _ = std::fs::remove_file(&path);
                drop(stale);
            }
            Err((mut file, Errno::EWOULDBLOCK)) => {
                let mut text = String::new();
                if file.read_to_string(&mut text).is_ok()
                    && let Ok(entry) = serde_json::from_str::<Entry>(&text)
                {
                    live.push(entry);
                }
            }
            Err(_) => {}
        }
    }
    let mine = Entry {
        first: range.first,
        count: range.count,
        store: store.to_owned(),
        data_dir: data_dir.to_owned(),
        pid: std::process::id(),
    };
    if let Some(other) = conflict(&mine, &live) {
        return Err(RangeError::Overlap {
            mine: mine.range_text(),
            first: mine.first,
            count: mine.count,
            theirs: other.range_text(),
            their_dir: other.data_dir.display().to_string(),
            their_pid: other.pid,
        });
    }
    let path = entries.join(own_name);
    let file = open_rw(&path).map_err(io(&path))?;
    let mut file = Flock::lock(file, FlockArg::LockExclusiveNonblock)
        .map_err(|(_, e)| io(&path)(std::io::Error::from(e)))?;
    file.set_len(0).map_err(io(&path))?;
    let text = serde_json::to_string(&mine).map_err(|e| io(&path)(std::io::Error::other(e)))?;
    file.write_all(text.as_bytes()).map_err(io(&path))?;
    file.flush().map_err(io(&path))?;
    Ok(Registration { _file: file, path })
}

/// The entry file of the berth of `data_dir`.
fn file_name(data_dir: &Path) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(data_dir.as_os_str().as_encoded_bytes());
    hex::encode(&digest[..8])
}

/// Opened close-on-exec (std's default): no program berth starts keeps a
/// dead berth's entry alive.
fn open_rw(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(first: u32, count: u32, store: &str) -> Entry {
        Entry {
            first,
            count,
            store: store.to_owned(),
            data_dir: PathBuf::from(format!("/d/{first}")),
            pid: 1,
        }
    }

    #[test]
    fn overlaps_on_another_store_conflict_and_touching_ranges_do_not() {
        let mine = entry(1000, 100, "a");
        let others = [
            entry(1100, 100, "b"),
            entry(900, 100, "b"),
            entry(1050, 10, "a"),
            entry(1099, 1, "c"),
        ];
        assert_eq!(conflict(&mine, &others), Some(&others[3]));
        assert_eq!(conflict(&mine, &others[..3]), None);
        assert_eq!(
            conflict(&entry(0, 5, "a"), &[entry(4, 1, "b")]),
            Some(&entry(4, 1, "b"))
        );
        assert_eq!(
            conflict(&entry(u32::MAX, u32::MAX, "a"), &[entry(0, 1, "b")]),
            None
        );
    }

    #[test]
    fn a_live_entry_refuses_an_overlap_and_a_dropped_one_frees_its_range() {
        let record = tempfile::tempdir().unwrap();
        let range = |first| UidRange { first, count: 10 };
        let held = register(record.path(), Path::new("/a"), range(100), "s1").unwrap();
        let err = register(record.path(), Path::new("/b"), range(105), "s2").unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains("100-109") && message.contains("/a") && message.contains("105-114"),
            "{message}"
        );
        // Another range, or the same store, is fine.
        let other = register(record.path(), Path::new("/c"), range(110), "s2").unwrap();
        let shared = register(record.path(), Path::new("/d"), range(100), "s1").unwrap();
        drop((held, shared));
        let again = register(record.path(), Path::new("/b"), range(105), "s2").unwrap();
        drop((other, again));
    }

    #[test]
    fn sqlite_stores_are_known_by_their_canonical_file() {
        let dir = tempfile::tempdir().unwrap();
        let canonical = dir.path().canonicalize().unwrap();
        let url = format!("sqlite://{}/./berth.db", dir.path().display());
        assert_eq!(
            store_identity(&url, None),
            format!("sqlite://{}/berth.db", canonical.display())
        );
        assert_eq!(
            store_identity("postgres://u:secret@db/b", None),
            "postgres://u:***@db/b"
        );
        // Nodes of one cluster reach its database by URLs of their own.
        let a = store_identity("postgres://u:pw@relay-a:5001/b", Some("s3cret"));
        assert_eq!(
            a,
            store_identity("postgres://u:pw@relay-b:5002/b", Some("s3cret"))
        );
        assert!(!a.contains("s3cret"));
        assert_ne!(a, store_identity("postgres://u:pw@db/b", Some("other")));
    }
}
