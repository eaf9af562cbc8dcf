//! Where each value came from (a file line, an environment variable or a
//! flag), and the TOML key written on each line of a file, so that an
//! error names the key and the place that set it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::error::{ConfigError, Location};
use super::sections::Config;

/// Where each key's value came from. Not part of the configuration's value:
/// two configs with equal settings are equal whatever their origins.
#[derive(Debug, Clone, Default)]
pub(crate) struct Provenance {
    pub(super) file: Option<PathBuf>,
    pub(super) keys: BTreeMap<String, Origin>,
}

impl PartialEq for Provenance {
    fn eq(&self, _other: &Self) -> bool {
        true
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Origin {
    File { line: usize },
    Env(&'static str),
    Flag(&'static str),
}

impl Provenance {
    pub(super) fn locate(&self, key: &str) -> Location {
        // `instance.env.FOO` is reported at `instance.env` when only the
        // table's line is known.
        let mut probe = key;
        loop {
            match self.keys.get(probe) {
                Some(Origin::File { line }) => {
                    return Location::File {
                        path: self.file.clone().unwrap_or_default(),
                        line: Some(*line),
                    };
                }
                Some(Origin::Env(var)) => return Location::Env(var),
                Some(Origin::Flag(flag)) => return Location::Flag(flag),
                None => match probe.rsplit_once('.') {
                    Some((parent, _)) => probe = parent,
                    None => break,
                },
            }
        }
        match &self.file {
            Some(path) => Location::File {
                path: path.clone(),
                line: None,
            },
            None => Location::Unknown,
        }
    }
}

impl Config {
    pub(super) fn invalid(&self, key: &str, reason: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            at: self.provenance.locate(key),
            key: key.to_owned(),
            reason: reason.into(),
        }
    }
}

/// The 1-based line of byte `offset` in `text`.
pub(super) fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// Every key of a TOML document, dotted from the root (table headers
/// included), with the 1-based line it is written on, in line order. Empty
/// for a document that does not parse: its syntax error carries its own
/// line.
pub(super) fn key_lines(text: &str) -> Vec<(usize, String)> {
    let Ok(document) = toml_edit::ImDocument::parse(text) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    collect_keys(text, document.as_table(), "", &mut found);
    // Stable: a key and the keys inside it on one line keep that order.
    found.sort_by_key(|(line, _)| *line);
    found
}

fn collect_keys(
    text: &str,
    table: &dyn toml_edit::TableLike,
    prefix: &str,
    found: &mut Vec<(usize, String)>,
) {
    for (name, item) in table.iter() {
        let path = if prefix.is_empty() {
            name.to_owned()
        } else {
            format!("{prefix}.{name}")
        };
        // A `[header]` has the span; a `key = …` its key does. The implicit
        // parent of a header (`a` of `[a.b]`) is written nowhere of its own
        // and is not listed (toml_edit gives it the header's key span).
        let span = match item {
            toml_edit::Item::Table(t) if t.is_implicit() && !t.is_dotted() => None,
            toml_edit::Item::Table(t) => t
                .span()
                .or_else(|| table.key(name).and_then(toml_edit::Key::span)),
            _ => table.key(name).and_then(toml_edit::Key::span),
        };
        if let Some(span) = span {
            found.push((line_of(text, span.start), path.clone()));
        }
        match item {
            toml_edit::Item::Table(t) => collect_keys(text, t, &path, found),
            toml_edit::Item::Value(toml_edit::Value::InlineTable(t)) => {
                collect_keys(text, t, &path, found);
            }
            toml_edit::Item::ArrayOfTables(tables) => {
                for t in tables.iter() {
                    collect_keys(text, t, &path, found);
                }
            }
            _ => {}
        }
    }
}

/// For a document that does not parse (a syntax error, an integer beyond
/// TOML's range): the key written on `line`, found by parsing the document
/// again with that line's value replaced by `0`. `None` when the line is
/// not a `key = value` line or the document has other errors.
pub(super) fn key_on_broken_line(text: &str, line: usize) -> Option<String> {
    let mut lines: Vec<&str> = text.lines().collect();
    let (key, _) = lines.get(line.checked_sub(1)?)?.split_once('=')?;
    let repaired = format!("{key}= 0");
    lines[line - 1] = &repaired;
    key_lines(&lines.join("\n"))
        .into_iter()
        .rev()
        .find(|(l, _)| *l == line)
        .map(|(_, key)| key)
}

/// The key whose definition covers `line`: the closest key or table header
/// at or above it (continuation lines of a multi-line array belong to it).
pub(super) fn key_at_line(keys: &[(usize, String)], line: usize) -> Option<String> {
    keys.iter()
        .rev()
        .find(|(l, _)| *l <= line)
        .map(|(_, key)| key.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_lines_follow_toml_not_line_shapes() {
        let text = "reap.idle_ttl_s = 5\n\
                    [instance]\n\
                    env = { A = \"1\", \"B.C\" = \"2\" }\n\
                    \"port_range\" = [1,\n  2]\n\
                    [lease] # the lease\n\
                    ttl_ms = 1\n";
        let found = key_lines(text);
        let lines: Vec<(usize, &str)> = found
            .iter()
            .map(|(line, key)| (*line, key.as_str()))
            .collect();
        assert_eq!(
            lines,
            [
                (1, "reap"),
                (1, "reap.idle_ttl_s"),
                (2, "instance"),
                (3, "instance.env"),
                (3, "instance.env.A"),
                (3, "instance.env.B.C"),
                (4, "instance.port_range"),
                (6, "lease"),
                (7, "lease.ttl_ms"),
            ]
        );
        // A continuation line belongs to the key above it.
        assert_eq!(
            key_at_line(&key_lines(text), 5).as_deref(),
            Some("instance.port_range")
        );
        assert!(key_lines("[broken\n").is_empty());
        let found = key_lines("[a.b]\nx = 1\n");
        assert_eq!(
            found,
            [(1, "a.b".to_owned()), (2, "a.b.x".to_owned())],
            "an implicit parent table is listed"
        );
    }

    #[test]
    fn a_broken_line_still_names_its_key() {
        let text = "[lease]\nttl_ms = 1\nrenew_ms = \"unterminated\n";
        assert_eq!(
            key_on_broken_line(text, 3).as_deref(),
            Some("lease.renew_ms")
        );
        assert_eq!(key_on_broken_line(text, 1), None, "not a key line");
        assert_eq!(key_on_broken_line(text, 9), None, "past the end");
        assert_eq!(key_on_broken_line(text, 0), None);
    }

    #[test]
    fn multi_line_arrays_belong_to_their_key() {
        let text = "[instance]\ncommand = [\n  \"a\",\n  \"b\",\n]\nready_tcp = true\n";
        let keys = key_lines(text);
        assert_eq!(key_at_line(&keys, 4).as_deref(), Some("instance.command"));
        assert_eq!(key_at_line(&keys, 6).as_deref(), Some("instance.ready_tcp"));
    }
}
