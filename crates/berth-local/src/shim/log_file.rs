//! The program's log file, bounded: the shim writes it as root, so a
//! program printing without end would otherwise fill the disk past the
//! reserve the kernel keeps for root, and a log its user deleted would keep
//! growing where nobody sees it.
//!
//! The rule: the file the shim appends to (`<name>`) never holds more than
//! half of `max_bytes`. Before a piece would pass that, the file is renamed
//! `<name>.1` (replacing the one before) and a new `<name>` begun. The shim
//! keeps the descriptor of the file it renamed, and empties that file at
//! the next rotation wherever it has been moved or linked to meanwhile, so
//! what this shim has written and is still on disk is at most `max_bytes`,
//! whatever the program's user does to the directory.

use std::fs::File;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use tokio::io::AsyncWriteExt;

use super::state_file;
use crate::isolation::fsafe;

/// Whether a piece of `piece` bytes must go to a new file, when the
/// current one holds `held` of at most `file_cap`.
pub(crate) fn must_rotate(held: u64, piece: u64, file_cap: u64) -> bool {
    held > 0 && held.saturating_add(piece) > file_cap
}

/// The name the rotated file takes.
pub(crate) fn rotated_name(name: &str) -> String {
    format!("{name}.1")
}

/// The program's log, as the shim writes it.
pub(crate) struct LogFile {
    path: PathBuf,
    /// Below it (the user's root) nothing is followed through a link.
    user_root: Option<PathBuf>,
    /// Half of the configured bound: the most one file holds.
    file_cap: u64,
    current: tokio::fs::File,
    /// Bytes in `current`.
    held: u64,
    /// The file rotated last, emptied at the next rotation.
    previous: Option<File>,
}

impl LogFile {
    /// Opens (or creates) the log at `path` for appending, bounded to
    /// `max_bytes` on disk.
    pub fn open(path: &Path, user_root: Option<&Path>, max_bytes: u64) -> io::Result<LogFile> {
        let (file, held) = open_current(path, user_root)?;
        Ok(LogFile {
            path: path.to_owned(),
            user_root: user_root.map(Path::to_owned),
            file_cap: (max_bytes / 2).max(1),
            current: tokio::fs::File::from_std(file),
            held,
            previous: None,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `bytes`, rotating first when they would not fit. A piece
    /// larger than a whole file keeps only its end.
    pub async fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        let cap = usize::try_from(self.file_cap).unwrap_or(usize::MAX);
        let bytes = &bytes[bytes.len().saturating_sub(cap)..];
        let len = bytes.len() as u64;
        if must_rotate(self.held, len, self.file_cap) {
            self.rotate().await?;
        }
        // Through tokio's blocking pool, not on the shim's one thread: a
        // log on a hung disk must not stall the fence timer or the control
        // socket.
        self.current.write_all(bytes).await?;
        self.held += len;
        Ok(())
    }

    pub async fn flush(&mut self) -> io::Result<()> {
        self.current.flush().await
    }

    async fn rotate(&mut self) -> io::Result<()> {
        self.current.flush().await?;
        let old_id = file_id(&self.current.metadata().await?);
        let previous = self.previous.take();
        let (path, root) = (self.path.clone(), self.user_root.clone());
        let turned = tokio::task::spawn_blocking(move || -> io::Result<(File, u64)> {
            if let Some(previous) = previous {
                previous.set_len(0)?;
            }
            // A failed rename (the user moved the file, or put a directory
            // in the way) only means the old file is not kept under its
            // name; the bound holds either way.
            let _ = rename_current(&path, root.as_deref());
            let (file, held) = open_current(&path, root.as_deref())?;
            if file_id(&file.metadata()?) == old_id {
                // Still the same file: start it over instead.
                file.set_len(0)?;
                return Ok((file, 0));
            }
            Ok((file, held))
        })
        .await
        .map_err(io::Error::other)?;
        match turned {
            Ok((file, held)) => {
                let old = std::mem::replace(&mut self.current, tokio::fs::File::from_std(file));
                let old = old.into_std().await;
                if file_id(&old.metadata()?) != file_id(&self.current.metadata().await?) {
                    self.previous = Some(old);
                }
                self.held = held;
                Ok(())
            }
            Err(e) => {
                // No new file: empty the current one rather than pass the
                // bound.
                self.current.set_len(0).await?;
                self.held = 0;
                Err(e)
            }
        }
    }
}

fn file_id(meta: &std::fs::Metadata) -> (u64, u64) {
    (meta.dev(), meta.ino())
}

/// The directory of `path` (below `user_root`, never through a link) and
/// the file's name in it.
fn dir_of(path: &Path, user_root: &Path) -> io::Result<(fsafe::Dir, String)> {
    let relative = path
        .strip_prefix(user_root)
        .map_err(|_| io::Error::other("the log lies outside the user's root"))?;
    let root = fsafe::Dir::open(user_root)?;
    let dir = match relative.parent().and_then(Path::to_str) {
        Some(parent) if !parent.is_empty() => root.walk(parent, None, fsafe::OnLink::Replace)?,
        _ => root,
    };
    let name = relative
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| io::Error::other("the log path has no file name"))?;
    Ok((dir, name.to_owned()))
}

/// Opens the log for appending, and how many bytes it holds. Below
/// `user_root` (which the user's programs can change) nothing is followed
/// through a link: the shim runs as root.
fn open_current(path: &Path, user_root: Option<&Path>) -> io::Result<(File, u64)> {
    let file = match user_root.filter(|root| path.starts_with(root)) {
        Some(root) => {
            let (dir, name) = dir_of(path, root)?;
            dir.open_append(&name)?
        }
        None => {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                state_file::create_private_dir(dir)?;
            }
            std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .mode(0o600)
                .open(path)?
        }
    };
    let held = file.metadata()?.len();
    Ok((file, held))
}

fn rename_current(path: &Path, user_root: Option<&Path>) -> io::Result<()> {
    match user_root.filter(|root| path.starts_with(root)) {
        Some(root) => {
            let (dir, name) = dir_of(path, root)?;
            dir.rename(&name, &rotated_name(&name))
        }
        None => {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| io::Error::other("the log path has no file name"))?;
            std::fs::rename(path, path.with_file_name(rotated_name(name)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_that_would_pass_the_cap_starts_a_new_file_unless_the_file_is_empty() {
        assert!(!must_rotate(0, 100, 10), "an empty file takes any piece");
        assert!(!must_rotate(5, 5, 10));
        assert!(must_rotate(5, 6, 10));
        assert!(must_rotate(10, 1, 10));
        assert!(!must_rotate(u64::MAX - 1, 0, u64::MAX));
    }

    fn on_disk(dir: &Path) -> u64 {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum()
    }

    #[tokio::test]
    async fn what_is_on_disk_stays_within_the_bound_whatever_is_done_to_the_files() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("logs")).unwrap();
        let path = root.join("logs/main.log");
        let mut log = LogFile::open(&path, Some(&root), 1000).unwrap();
        let line = |i: usize| format!("line {i:05} {}\n", "x".repeat(30));
        let moved = root.join("kept");
        std::fs::create_dir(&moved).unwrap();
        for i in 0..500 {
            log.write(line(i).as_bytes()).await.unwrap();
            // The program's user moves the rotated file away each time:
            // it is emptied all the same.
            let rotated = root.join("logs/main.log.1");
            if rotated.exists() {
                std::fs::rename(&rotated, moved.join(format!("{i}"))).unwrap();
            }
        }
        log.flush().await.unwrap();
        let total = on_disk(&root.join("logs")) + on_disk(&moved);
        assert!(total <= 1000, "{total} bytes on disk");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.ends_with(&line(499)), "{text}");
        assert!(text.len() <= 500);

        // A deleted log is replaced by a new one at the next rotation, and
        // the deleted one is emptied at the one after.
        std::fs::remove_file(&path).unwrap();
        for i in 0..100 {
            log.write(line(i).as_bytes()).await.unwrap();
        }
        log.flush().await.unwrap();
        assert!(path.exists());
        assert!(on_disk(&root.join("logs")) <= 1000);
    }

    #[tokio::test]
    async fn a_link_in_place_of_the_rotated_file_is_replaced_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("logs")).unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        std::os::unix::fs::symlink(&victim, root.join("logs/main.log.1")).unwrap();
        let path = root.join("logs/main.log");
        let mut log = LogFile::open(&path, Some(&root), 100).unwrap();
        for _ in 0..10 {
            log.write(b"0123456789\n").await.unwrap();
        }
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert!(!root.join("logs/main.log.1").is_symlink());
    }
}
