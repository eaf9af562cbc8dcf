//! Just enough of `/proc/<pid>/stat` to tell a reused pid apart.

use std::io;

/// The fields of `/proc/<pid>/stat` the shim cares about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcStat {
    /// Field 3: `R`, `S`, `T`, `Z`, …
    pub state: char,
    /// Field 22: start time in clock ticks since boot.
    pub start_time: u64,
}

/// Parses the contents of a `/proc/<pid>/stat` file.
///
/// Field 2 (`comm`) is the executable name in parentheses and may itself
/// contain spaces and parentheses, so the fixed fields are read from after the
/// *last* `)`.
pub(crate) fn parse_stat(content: &str) -> Option<ProcStat> {
    let rest = &content[content.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?;
    let mut state_chars = state.chars();
    let state_char = state_chars.next()?;
    if state_chars.next().is_some() {
        return None;
    }
    // `state` was field 3, so field 22 is 19 further on.
    let start_time = fields.nth(18)?.parse().ok()?;
    Some(ProcStat {
        state: state_char,
        start_time,
    })
}

/// Reads and parses `/proc/<pid>/stat`.
/// Whether a process `pid` exists (a pid reused since counts).
pub(crate) fn exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

pub(crate) fn read_stat(pid: u32) -> io::Result<ProcStat> {
    let content = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat(&content).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("cannot parse /proc/{pid}/stat"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(comm: &str, state: &str, start: &str) -> String {
        // Fields 4..=21 are placeholders; 22 is the start time; more follow.
        let middle: Vec<String> = (4..=21).map(|i| i.to_string()).collect();
        format!(
            "4242 ({comm}) {state} {} {start} 23 24 25\n",
            middle.join(" ")
        )
    }

    #[test]
    fn plain_comm() {
        let stat = parse_stat(&line("sleep", "S", "987654")).unwrap();
        assert_eq!(
            stat,
            ProcStat {
                state: 'S',
                start_time: 987654
            }
        );
    }

    #[test]
    fn comm_with_spaces_and_parentheses() {
        let stat = parse_stat(&line("a) b (c) T 1 2", "T", "77")).unwrap();
        assert_eq!(stat.state, 'T');
        assert_eq!(stat.start_time, 77);
    }

    #[test]
    fn real_example() {
        let real = "1234 (sh) S 1 1234 1234 0 -1 4194560 104 0 0 0 0 0 0 0 20 0 1 0 \
                    5530 2744320 229 18446744073709551615 1 1 0 0 0 0 0 0 65538 0 0 0 17 1 \
                    0 0 0 0 0 0 0 0 0 0 0 0 0";
        assert_eq!(parse_stat(real).unwrap().start_time, 5530);
    }

    #[test]
    fn rejects_garbage() {
        assert_eq!(parse_stat(""), None);
        assert_eq!(parse_stat("1 (x"), None);
        assert_eq!(parse_stat("1 (x) S 2 3"), None);
        assert_eq!(parse_stat(&line("x", "S", "notanumber")), None);
        assert_eq!(parse_stat(&line("x", "SS", "1")), None);
    }

    #[test]
    fn reads_own_stat() {
        let stat = read_stat(std::process::id()).unwrap();
        assert!(stat.start_time > 0);
        assert!(read_stat(u32::MAX).is_err());
    }
}
