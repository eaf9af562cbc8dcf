//! Following an instance's log as it grows (`logs -f`): its last lines,
//! then every new complete line. The shim appends to the file; this side
//! only reads it, on a short poll, and opens it afresh each time through
//! the caller's opener (which never follows a link a program planted in
//! its root).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::logs::tail_lines;

/// Lines a follower may be behind before the reader waits for it.
const LINE_BUFFER: usize = 256;
/// How often a followed log is looked at for new output.
const POLL: Duration = Duration::from_millis(100);
/// A line longer than this is passed on in pieces, so one endless line
/// cannot make the follower buffer without bound.
const MAX_LINE: usize = 64 * 1024;

/// What opens the followed log each time it is read.
pub(crate) type Opener = std::sync::Arc<dyn Fn() -> std::io::Result<File> + Send + Sync>;

/// Starts following the log `open` opens on `tracker`: the last `tail`
/// complete lines, then new ones, until the receiver is dropped or
/// `cancel` fires.
pub(crate) async fn follow(
    open: Opener,
    tail: usize,
    tracker: &TaskTracker,
    cancel: CancellationToken,
) -> std::io::Result<mpsc::Receiver<String>> {
    let snapshot_open = open.clone();
    let (lines, mut offset) = tokio::task::spawn_blocking(move || snapshot(&*snapshot_open, tail))
        .await
        .map_err(std::io::Error::other)??;
    let (tx, rx) = mpsc::channel(LINE_BUFFER);
    tracker.spawn(async move {
        for line in lines {
            if tx.send(line).await.is_err() {
                return;
            }
        }
        let mut pending = Vec::new();
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tx.closed() => return,
                () = tokio::time::sleep(POLL) => {}
            }
            let open = open.clone();
            let read = tokio::task::spawn_blocking(move || {
                let lines = read_new(&*open, &mut offset, &mut pending);
                (lines, offset, pending)
            })
            .await;
            let Ok((lines, new_offset, new_pending)) = read else {
                return;
            };
            (offset, pending) = (new_offset, new_pending);
            let Ok(lines) = lines else { return };
            for line in lines {
                if tx.send(line).await.is_err() {
                    return;
                }
            }
        }
    });
    Ok(rx)
}

/// The last `n` complete lines of the log and the offset after them (the
/// end of the last complete line, so that a line being written is
/// followed whole). No file yet: nothing, from offset 0.
fn snapshot(
    open: &dyn Fn() -> std::io::Result<File>,
    n: usize,
) -> std::io::Result<(Vec<String>, u64)> {
    let mut file = match open() {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(e),
    };
    let len = file.seek(SeekFrom::End(0))?;
    let look = len.min(MAX_LINE as u64);
    file.seek(SeekFrom::Start(len - look))?;
    let mut end = vec![0u8; usize::try_from(look).unwrap_or(0)];
    file.read_exact(&mut end)?;
    let complete = match end.iter().rposition(|&b| b == b'\n') {
        Some(i) => len - look + i as u64 + 1,
        // No newline in view: one very long line (take it), or none yet.
        None if look == MAX_LINE as u64 => len,
        None => len - look,
    };
    let mut upto = Upto {
        file,
        len: complete,
    };
    Ok((tail_lines(&mut upto, n)?, complete))
}

/// A file seen as if it ended at `len`.
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

/// New complete lines from `*offset` on; moves `*offset` past what was
/// read. A file that shrank (truncated, replaced) is read from its start.
fn read_new(
    open: &dyn Fn() -> std::io::Result<File>,
    offset: &mut u64,
    pending: &mut Vec<u8>,
) -> std::io::Result<Vec<String>> {
    let mut file = match open() {
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
        lines.push(text(&pending[start..start + i]));
        start += i + 1;
    }
    pending.drain(..start);
    while pending.len() >= MAX_LINE {
        let piece: Vec<u8> = pending.drain(..MAX_LINE).collect();
        lines.push(text(&piece));
    }
    Ok(lines)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .trim_end_matches('\r')
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[tokio::test]
    async fn tail_then_new_complete_lines_and_a_truncated_file_from_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("main.log");
        let mut log = File::create(&path).unwrap();
        write!(log, "one\ntwo\nthree\npart").unwrap();
        let tracker = TaskTracker::new();
        let cancel = CancellationToken::new();
        let at = path.clone();
        let open: Opener = std::sync::Arc::new(move || File::open(&at));
        let mut rx = follow(open, 2, &tracker, cancel.clone()).await.unwrap();
        assert_eq!(rx.recv().await.unwrap(), "two");
        assert_eq!(rx.recv().await.unwrap(), "three");
        // The line being written comes whole, once finished.
        write!(log, "ial\nfour\n").unwrap();
        assert_eq!(rx.recv().await.unwrap(), "partial");
        assert_eq!(rx.recv().await.unwrap(), "four");
        // Truncated (a new file of the same name): read from the start.
        drop(log);
        std::fs::write(&path, "fresh\n").unwrap();
        assert_eq!(rx.recv().await.unwrap(), "fresh");
        // Dropping the receiver ends the follower.
        drop(rx);
        tracker.close();
        tokio::time::timeout(Duration::from_secs(10), tracker.wait())
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_missing_log_is_followed_once_it_appears() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("main.log");
        let tracker = TaskTracker::new();
        let cancel = CancellationToken::new();
        let at = path.clone();
        let open: Opener = std::sync::Arc::new(move || File::open(&at));
        let mut rx = follow(open, 10, &tracker, cancel.clone()).await.unwrap();
        std::fs::write(&path, "hello\n").unwrap();
        assert_eq!(rx.recv().await.unwrap(), "hello");
        cancel.cancel();
        assert!(rx.recv().await.is_none(), "cancel ends the stream");
    }
}
