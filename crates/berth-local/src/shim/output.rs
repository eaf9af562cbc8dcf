//! The program's output: copied to the log file piece by piece, scanned for
//! the ready line, and the end of stderr kept for `last_error`.

use std::sync::{Arc, Mutex};

use regex::Regex;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::log_file::LogFile;
use tokio::sync::{mpsc, oneshot};

/// A line longer than this is passed on in pieces of this size, so one
/// endless line cannot make the shim buffer without bound.
pub const MAX_PIECE: usize = 64 * 1024;

/// How many characters of stderr the state keeps.
pub(crate) const TAIL_CHARS: usize = 500;

/// Raw bytes kept to produce [`TAIL_CHARS`] characters: a UTF-8 character
/// is at most 4 bytes, and a little more lets a character cut at the front
/// fall outside the window.
const TAIL_BYTES: usize = TAIL_CHARS * 4 + 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stream {
    Stdout,
    Stderr,
}

/// A line (with its `\n`) or, for over-long lines, part of one.
pub(crate) struct Piece {
    stream: Stream,
    bytes: Vec<u8>,
}

/// Reads `reader` to its end and sends it on in pieces that end at a newline
/// where possible. Ends early if the receiver is gone.
pub(crate) async fn pump<R: AsyncRead + Unpin>(
    stream: Stream,
    mut reader: R,
    tx: mpsc::Sender<Piece>,
) {
    let mut pending: Vec<u8> = Vec::with_capacity(8192);
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        let n = match reader.read(&mut chunk).await {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                diag!("reading program {stream:?}: {e}");
                break;
            }
        };
        pending.extend_from_slice(&chunk[..n]);
        for bytes in take_pieces(&mut pending) {
            if tx.send(Piece { stream, bytes }).await.is_err() {
                return;
            }
        }
    }
    if !pending.is_empty() {
        let _ = tx
            .send(Piece {
                stream,
                bytes: pending,
            })
            .await;
    }
}

/// Removes every complete line, and any run of [`MAX_PIECE`] bytes without
/// a newline, from the front of `pending`.
pub fn take_pieces(pending: &mut Vec<u8>) -> Vec<Vec<u8>> {
    let mut pieces = Vec::new();
    let mut start = 0;
    while start < pending.len() {
        let window = &pending[start..pending.len().min(start + MAX_PIECE)];
        match window.iter().position(|&b| b == b'\n') {
            Some(i) => {
                pieces.push(window[..=i].to_vec());
                start += i + 1;
            }
            None if window.len() == MAX_PIECE => {
                pieces.push(window.to_vec());
                start += MAX_PIECE;
            }
            None => break,
        }
    }
    pending.drain(..start);
    pieces
}

/// The last bytes of stderr, shared between the log writer and the shim's
/// state.
#[derive(Default)]
pub(crate) struct StderrTail {
    bytes: std::collections::VecDeque<u8>,
}

impl StderrTail {
    fn push(&mut self, piece: &[u8]) {
        let piece = &piece[piece.len().saturating_sub(TAIL_BYTES)..];
        let overflow = (self.bytes.len() + piece.len()).saturating_sub(TAIL_BYTES);
        self.bytes.drain(..overflow);
        self.bytes.extend(piece);
    }

    /// The last ≤ [`TAIL_CHARS`] characters; bytes that are not UTF-8 show
    /// as U+FFFD.
    pub(crate) fn text(&self) -> String {
        let (a, b) = self.bytes.as_slices();
        let mut raw = Vec::with_capacity(a.len() + b.len());
        raw.extend_from_slice(a);
        raw.extend_from_slice(b);
        last_chars(&String::from_utf8_lossy(&raw), TAIL_CHARS).to_owned()
    }
}

/// The suffix of `s` holding its last `n` characters.
fn last_chars(s: &str, n: usize) -> &str {
    match s.char_indices().rev().nth(n.saturating_sub(1)) {
        Some((i, _)) if n > 0 => &s[i..],
        Some(_) => "",
        None => s,
    }
}

/// Whether `piece` (a line as [`take_pieces`] cut it, with its line end)
/// is the ready line for `pattern`: `None` when it is not, else the launch
/// token it carries. The line end (`\n` or `\r\n`) is not part of the
/// line, and bytes that are not UTF-8 read as U+FFFD.
pub fn ready_token(pattern: &Regex, piece: &[u8]) -> Option<Option<String>> {
    let line = piece.strip_suffix(b"\n").unwrap_or(piece);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let line = String::from_utf8_lossy(line);
    berth_core::program::ready_line(pattern, &line).map(|token| token.map(str::to_owned))
}

/// Writes every piece to the log file in arrival order and watches for the
/// ready line. Sends the first match's capture (if any) on `ready`. Returns
/// once every pump has finished.
pub(crate) async fn log_writer(
    mut pieces: mpsc::Receiver<Piece>,
    mut log: LogFile,
    ready_regex: Option<Regex>,
    ready: oneshot::Sender<Option<String>>,
    tail: Arc<Mutex<StderrTail>>,
) {
    let mut ready = ready_regex.map(|re| (re, ready));
    let mut log_ok = true;
    while let Some(piece) = pieces.recv().await {
        if log_ok && let Err(e) = log.write(&piece.bytes).await {
            // Losing the log must not take the instance down with it.
            diag!("writing {}: {e}; log disabled", log.path().display());
            log_ok = false;
        }
        if piece.stream == Stream::Stderr
            && let Ok(mut tail) = tail.lock()
        {
            tail.push(&piece.bytes);
        }
        let token = ready
            .as_ref()
            .and_then(|(re, _)| ready_token(re, &piece.bytes));
        if let Some(token) = token
            && let Some((_, tx)) = ready.take()
        {
            // tokio hands writes to a background thread: without a flush,
            // berth could learn of readiness (and read the log) before the
            // ready line is in it.
            if log_ok && log.flush().await.is_err() {
                log_ok = false;
            }
            let _ = tx.send(token);
        }
    }
    if log_ok && let Err(e) = log.flush().await {
        diag!("flushing {}: {e}", log.path().display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_split_at_newlines_and_cap() {
        let mut pending = b"a\nbc\nde".to_vec();
        assert_eq!(
            take_pieces(&mut pending),
            vec![b"a\n".to_vec(), b"bc\n".to_vec()]
        );
        assert_eq!(pending, b"de");

        let mut long = vec![b'x'; MAX_PIECE * 2 + 3];
        long.push(b'\n');
        let pieces = take_pieces(&mut long);
        assert_eq!(pieces.len(), 3);
        assert_eq!(pieces[0].len(), MAX_PIECE);
        assert_eq!(pieces[2].len(), 4);
        assert!(long.is_empty());
    }

    #[test]
    fn tail_keeps_last_chars_on_boundaries() {
        let mut tail = StderrTail::default();
        tail.push(b"start\n");
        assert_eq!(tail.text(), "start\n");
        let many = "é".repeat(TAIL_CHARS * 3);
        tail.push(many.as_bytes());
        tail.push(b"\xff end");
        let text = tail.text();
        assert_eq!(text.chars().count(), TAIL_CHARS);
        assert!(text.ends_with("é\u{fffd} end"));
        assert!(text.starts_with('é'));
    }

    #[test]
    fn last_chars_edges() {
        assert_eq!(last_chars("abc", 0), "");
        assert_eq!(last_chars("abc", 2), "bc");
        assert_eq!(last_chars("abc", 5), "abc");
        assert_eq!(last_chars("", 5), "");
    }
}
