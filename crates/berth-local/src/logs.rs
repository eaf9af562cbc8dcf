//! Reading the end of an instance's log without loading the whole file.

use std::io::{Read, Seek, SeekFrom};

const BLOCK: u64 = 8 * 1024;
/// Upper bound of bytes read for one tail, so a log of very long lines
/// cannot make one request read gigabytes.
const MAX_TAIL_BYTES: u64 = 8 * 1024 * 1024;

/// The last `n` lines of `reader`, reading backwards block by block. A
/// final line without a newline counts as a line; invalid UTF-8 is
/// replaced, not refused.
pub(crate) fn tail_lines<R: Read + Seek>(reader: &mut R, n: usize) -> std::io::Result<Vec<String>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let len = reader.seek(SeekFrom::End(0))?;
    let mut start = len;
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let newlines = buf.iter().filter(|&&b| b == b'\n').count();
        // n lines need n+1 newlines in view (or the file start), counting a
        // trailing newline that closes the last line.
        let trailing = usize::from(buf.last() == Some(&b'\n'));
        if start == 0 || newlines >= n + trailing || len - start >= MAX_TAIL_BYTES {
            break;
        }
        let step = BLOCK.min(start);
        start -= step;
        reader.seek(SeekFrom::Start(start))?;
        let mut block = vec![0u8; usize::try_from(step).unwrap_or(0)];
        reader.read_exact(&mut block)?;
        block.extend_from_slice(&buf);
        buf = block;
    }
    let text = String::from_utf8_lossy(&buf);
    let text = text.strip_suffix('\n').unwrap_or(&text);
    if text.is_empty() {
        return Ok(Vec::new());
    }
    let mut lines: Vec<&str> = text.split('\n').collect();
    // The first piece may be a partial line when we stopped mid-file.
    if start > 0 && lines.len() > n {
        lines.remove(0);
    }
    let skip = lines.len().saturating_sub(n);
    Ok(lines[skip..]
        .iter()
        .map(|l| l.trim_end_matches('\r').to_owned())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn tail(text: &str, n: usize) -> Vec<String> {
        tail_lines(&mut Cursor::new(text.as_bytes().to_vec()), n).unwrap()
    }

    #[test]
    fn small_inputs() {
        assert!(tail("", 5).is_empty());
        assert!(tail("a\n", 0).is_empty());
        assert_eq!(tail("a\nb\nc\n", 2), ["b", "c"]);
        assert_eq!(tail("a\nb\nc", 2), ["b", "c"]);
        assert_eq!(tail("a\nb\nc\n", 10), ["a", "b", "c"]);
        assert_eq!(tail("\n\nx\n", 3), ["", "", "x"]);
    }

    #[test]
    fn large_inputs_span_blocks() {
        let text: String = (0..10_000).map(|i| format!("line {i}\n")).collect();
        assert_eq!(tail(&text, 3), ["line 9997", "line 9998", "line 9999"]);
        let lines = tail(&text, 2_000);
        assert_eq!(lines.len(), 2_000);
        assert_eq!(lines[0], "line 8000");
        let long = format!("{}\nlast\n", "x".repeat(20_000));
        assert_eq!(tail(&long, 1), ["last"]);
        assert_eq!(tail(&long, 2)[0].len(), 20_000);
    }
}
