//! What the client commands print never drives the operator's terminal.
//!
//! Log lines, status fields and error messages come from the server, and
//! through it from programs and users berth does not trust. A control
//! character among them (ESC, the one-byte CSI `U+009B`, BEL…) would let
//! them move the cursor, rewrite what was printed before, retitle the
//! window or write the clipboard (OSC 52). Every control character but
//! newline and tab is shown as visible text instead, on a terminal or not
//! (a pipe may end in `less -R` or a terminal later):
//!
//! * for people, as `\x1b` (C0 and DEL) or `\u{9b}` (C1), so the reader
//!   sees what was sent;
//! * in JSON output, as the JSON escape `\u001b` / `\u009b`, which keeps
//!   the JSON valid and the value intact for a program that parses it.

use std::borrow::Cow;
use std::fmt::Write as _;

use serde_json::Value;

/// Whether `c` is shown escaped: every control character (C0, DEL, C1)
/// except newline and tab.
fn escaped(c: char) -> bool {
    c.is_control() && c != '\n' && c != '\t'
}

/// `text` with every control character but newline and tab shown as
/// `\x1b` or `\u{9b}`.
pub fn text(text: &str) -> Cow<'_, str> {
    if !text.chars().any(escaped) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if !escaped(c) {
            out.push(c);
        } else if u32::from(c) < 0x80 {
            let _ = write!(out, "\\x{:02x}", u32::from(c));
        } else {
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        }
    }
    Cow::Owned(out)
}

/// Serialized JSON with the control characters serde_json leaves raw (DEL
/// and C1; it escapes C0 itself) written as `\u00XX` escapes. Only string
/// contents can hold them, where the escape means the same character.
pub fn json(serialized: &str) -> Cow<'_, str> {
    if !serialized.chars().any(escaped) {
        return Cow::Borrowed(serialized);
    }
    let mut out = String::with_capacity(serialized.len() + 8);
    for c in serialized.chars() {
        if escaped(c) {
            let _ = write!(out, "\\u{:04x}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// `value` as pretty JSON, safe to print.
pub fn pretty_json(value: &Value) -> String {
    let serialized = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    json(&serialized).into_owned()
}

/// `value` as one line of JSON, safe to print.
pub fn compact_json(value: &Value) -> String {
    json(&value.to_string()).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn control_characters_become_visible_text() {
        assert_eq!(text("plain\tline\n"), "plain\tline\n");
        assert!(matches!(text("plain"), Cow::Borrowed(_)));
        assert_eq!(
            text("\x1b]52;c;aGk=\x07 \u{9b}31m \r\x7f"),
            "\\x1b]52;c;aGk=\\x07 \\u{9b}31m \\x0d\\x7f"
        );
    }

    #[test]
    fn json_stays_json_with_no_raw_controls() {
        let v = json!({"line\u{9b}": "a\u{1b}[2J\u{9b}\u{7f}", "n": [1, "\u{85}"]});
        let printed = pretty_json(&v);
        assert!(!printed.chars().any(escaped), "{printed:?}");
        let back: Value = serde_json::from_str(&printed).unwrap();
        assert_eq!(back, v, "the same value");
        assert_eq!(compact_json(&json!("\u{9b}")), "\"\\u009b\"");
    }
}
