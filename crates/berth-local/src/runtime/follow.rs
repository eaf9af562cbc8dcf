//! Reading an instance's log: its last lines, and following it as it grows
//! (`logs -f`). The shim appends to the file; this side only reads.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::time::Duration;

use berth_core::runtime::RuntimeError;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::logs::tail_lines;

/// Lines a follower may be behind before the reader waits for it.
pub(super) const LINE_BUFFER: usize = 256;
/// How often a followed log is looked at for new output.
const POLL: Duration = Duration::from_millis(100);
/// A line longer than this is passed on in pieces, so one endless line
/// cannot make the follower buffer without bound.
const MAX_LINE: usize = 64 * 1024;

fn read_error(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Failed(format!("cannot read the log: {e}"))
}

/// The last `n` lines of the log at `path` (none if it does not exist).
pub(super) async fn tail(path: PathBuf, n: usize) -> Result<Vec<String>, RuntimeError> {
    tokio::task::spawn_blocking(move || match File::open(&path) {
        Ok(mut file) => tail_lines(&mut file, n).map_err(read_error),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(read_error(e)),
    })
    .await
    .map_err(read_error)?
}

/// A file seen as if it ended at `len`: the snapshot a tail is taken of,
/// so that what is appended meanwhile is followed, not read twice.
struct Upto {
    file: File,
    len: u64,
}

impl Read for Upto {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let pos = self.file.stream_position()?;
        let left = usize::try_from(self.len.saturating_sub(pos)).unwrap_or(usize::MAX);
        let n = buf.len().min(left);
        self.file.read(&mut buf[..n])
    }
}

impl Seek for Upto {
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        match pos {
            SeekFrom::End(d) => {
                let at = self.len.checked_add_signed(d).ok_or_else(|| {
                    std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek before start")
                })?;
                self.file.seek(SeekFrom::Start(at))
            }
            other => self.file.seek(other),
        }
    }
}

/// The last `n` complete lines of `file` and the offset after them: the
/// end of the last complete line, so a line being written is followed
/// whole rather than cut in two.
fn snapshot(mut file: File, n: usize) -> std::io::Result<(Vec<String>, u64)> {
    let len = file.seek(SeekFrom::End(0))?;
    let look = len.min(MAX_LINE as u64);
    file.seek(SeekFrom::Start(len - look))?;
    let mut end = vec![0u8; usize::try_from(look).unwrap_or(0)];
    file.read_exact(&mut end)?;
    let complete = match end.iter().rposition(|&b| b == b'\n') {
        Some(i) => len - look + i as u64 + 1,
        // No newline in view: a very long line, or none yet. Take it all.
        None if look == MAX_LINE as u64 => len,
        None => len - look,
    };
    let mut upto = Upto {
        file,
        len: complete,
    };
    Ok((tail_lines(&mut upto, n)?, complete))
}

/// New complete lines of `file` from `*offset` on; moves `*offset` past
/// them. A file that shrank (truncated, replaced) is read from its start.
fn read_new(
    path: &PathBuf,
    offset: &mut u64,
    pending: &mut Vec<u8>,
) -> std::io::Result<Vec<String>> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let len = file.seek(SeekFrom::End(0))?;
    if len < *offset {
        *offset = 0;
        pending.clear();
    }
    if len == *offset {
        return Ok(Vec::new());
    }
    file.seek(SeekFrom::Start(*offset))?;
    let mut chunk = Vec::new();
    file.take(len - *offset).read_to_end(&mut chunk)?;
    *offset += chunk.len() as u64;
    pending.extend_from_slice(&chunk);
    let mut lines = Vec::new();
    let mut start = 0;
    while let Some(i) = pending[start..].iter().position(|&b| b == b'\n') {
        lines.push(line_text(&pending[start..start + i]));
        start += i + 1;
    }
    pending.drain(..start);
    while pending.len() >= MAX_LINE {
        lines.push(line_text(&pending[..MAX_LINE]));
        pending.drain(..MAX_LINE);
    }
    Ok(lines)
}

fn line_text(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    text.strip_suffix('\r').unwrap_or(&text).to_owned()
}

/// Sends the last `tail` lines of `path`, then every line appended to it,
/// until the receiver is dropped or the runtime shuts down. A log that does
/// not exist yet is waited for.
pub(super) async fn follow(
    path: PathBuf,
    tail: usize,
    tx: mpsc::Sender<String>,
    cancel: CancellationToken,
) {
    let first = {
        let path = path.clone();
        tokio::task::spawn_blocking(move || match File::open(&path) {
            Ok(file) => snapshot(file, tail),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((Vec::new(), 0)),
            Err(e) => Err(e),
        })
        .await
    };
    let (lines, mut offset) = match first {
        Ok(Ok(first)) => first,
        Ok(Err(e)) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot follow the log");
            return;
        }
        Err(_) => return,
    };
    for line in lines {
        if tx.send(line).await.is_err() {
            return;
        }
    }
    let mut pending = Vec::new();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tx.closed() => return,
            _ = tokio::time::sleep(POLL) => {}
        }
        let read = {
            let path = path.clone();
            let mut state = (offset, std::mem::take(&mut pending));
            tokio::task::spawn_blocking(move || {
                let lines = read_new(&path, &mut state.0, &mut state.1);
                (lines, state)
            })
            .await
        };
        let Ok((lines, state)) = read else { return };
        (offset, pending) = state;
        match lines {
            Ok(lines) => {
                for line in lines {
                    if tx.send(line).await.is_err() {
                        return;
                    }
                }
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot follow the log");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn a_snapshot_stops_at_the_last_complete_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        std::fs::write(&path, "a\nb\nc\npart").unwrap();
        let (lines, offset) = snapshot(File::open(&path).unwrap(), 2).unwrap();
        assert_eq!(lines, ["b", "c"]);
        assert_eq!(offset, 6);
        let mut pending = Vec::new();
        let mut at = offset;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        file.write_all(b"ial\nnext\nhalf").unwrap();
        assert_eq!(
            read_new(&path, &mut at, &mut pending).unwrap(),
            ["partial", "next"]
        );
        assert_eq!(pending, b"half");
        // Truncated: read again from the start.
        std::fs::write(&path, "new\n").unwrap();
        assert_eq!(read_new(&path, &mut at, &mut pending).unwrap(), ["new"]);
    }
}
