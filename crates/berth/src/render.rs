//! How the client commands show answers to people: aligned tables and
//! short summaries, coloured on a terminal. `--json` bypasses all of this
//! and prints the API's answer as it is.
//!
//! Everything here is a pure function of the JSON answer, the time and
//! whether to colour, so it is tested without a server or a terminal.

use std::ffi::OsStr;
use std::fmt;
use std::fmt::Write as _;

use anstyle::{AnsiColor, Style};
use serde_json::Value;

/// Whether to colour: only on a terminal, and never with `NO_COLOR` set
/// to anything (no-color.org) or `TERM=dumb`.
pub fn colour_wanted(is_terminal: bool, no_color: Option<&OsStr>, term: Option<&OsStr>) -> bool {
    is_terminal && no_color.is_none_or(OsStr::is_empty) && term.is_none_or(|t| t != "dumb")
}

/// Colours, or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Palette {
    pub colour: bool,
}

impl Palette {
    /// The palette for standard output.
    pub fn for_stdout() -> Self {
        Self {
            colour: colour_wanted(
                std::io::IsTerminal::is_terminal(&std::io::stdout()),
                std::env::var_os("NO_COLOR").as_deref(),
                std::env::var_os("TERM").as_deref(),
            ),
        }
    }

    /// `text` in `style` (plain without colour).
    pub fn paint(self, style: Style, text: &str) -> String {
        if self.colour && style != Style::new() {
            format!("{}{text}{}", style.render(), style.render_reset())
        } else {
            text.to_owned()
        }
    }
}

const HEADER: Style = Style::new().bold();
const GOOD: Style = Style::new().fg_color(Some(anstyle::Color::Ansi(AnsiColor::Green)));
const PENDING: Style = Style::new().fg_color(Some(anstyle::Color::Ansi(AnsiColor::Yellow)));
const BAD: Style = Style::new()
    .fg_color(Some(anstyle::Color::Ansi(AnsiColor::Red)))
    .bold();
const DIM: Style = Style::new().dimmed();

/// The style of a status word: instances, nodes, leases alike.
pub fn status_style(word: &str) -> Style {
    match word {
        "running" | "up" | "held" | "ok" | "true" => GOOD,
        "starting" | "draining" => PENDING,
        "crashed" | "failed" | "down" | "expired" | "error" => BAD,
        "stopped" | "released" | "-" => DIM,
        _ => Style::new(),
    }
}

/// A column: header, JSON field, how to show it.
pub struct Column(pub &'static str, pub &'static str, pub Cell);

/// How a cell is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cell {
    Plain,
    /// Unix milliseconds, shown relative to now.
    Time,
    /// A status word, coloured by [`status_style`].
    Status,
    /// A boolean that is bad news when true (an expired lease).
    Alarm,
}

pub const INSTANCE_COLUMNS: &[Column] = &[
    Column("USER", "user", Cell::Plain),
    Column("ROLE", "role", Cell::Plain),
    Column("STATUS", "status", Cell::Status),
    Column("READY", "ready", Cell::Plain),
    Column("NODE", "node", Cell::Plain),
    Column("PORT", "port", Cell::Plain),
    Column("PID", "pid", Cell::Plain),
    Column("EPOCH", "epoch", Cell::Plain),
    Column("RESTARTS", "restarts", Cell::Plain),
    Column("STARTED", "started_at", Cell::Time),
    Column("ACTIVE", "last_active", Cell::Time),
];

pub const NODE_COLUMNS: &[Column] = &[
    Column("ID", "id", Cell::Plain),
    Column("STATUS", "status", Cell::Status),
    Column("LOAD", "load", Cell::Plain),
    Column("CAPACITY", "capacity", Cell::Plain),
    Column("URL", "advertise_url", Cell::Plain),
    Column("HEARTBEAT", "heartbeat", Cell::Time),
];

pub const TOKEN_COLUMNS: &[Column] = &[
    Column("ID", "id", Cell::Plain),
    Column("CREATED", "created_at", Cell::Time),
    Column("EXPIRES", "expires_at", Cell::Time),
    Column("LAST USED", "last_used_at", Cell::Time),
    Column("MINTED WITH", "parent", Cell::Plain),
];

pub const LEASE_COLUMNS: &[Column] = &[
    Column("USER", "user", Cell::Plain),
    Column("HOLDER", "holder", Cell::Plain),
    Column("EPOCH", "epoch", Cell::Plain),
    Column("UNTIL", "lease_until", Cell::Time),
    Column("RELEASED", "released", Cell::Plain),
    Column("EXPIRED", "expired", Cell::Alarm),
];

pub const RESTART_COLUMNS: &[Column] = &[
    Column("USER", "user", Cell::Plain),
    Column("NODE", "node", Cell::Plain),
    Column("RESULT", "result", Cell::Status),
    Column("ERROR", "error", Cell::Plain),
];

/// `body[field]` (or `body` itself when it is an array) as a table; `None`
/// when the answer is not such a list (then it is shown as JSON, so an
/// unexpected answer is never hidden).
pub fn table(
    body: &Value,
    field: &str,
    columns: &[Column],
    now: i64,
    palette: Palette,
) -> Option<String> {
    let rows = match body {
        Value::Array(rows) => rows,
        Value::Object(map) => map.get(field)?.as_array()?,
        _ => return None,
    };
    if rows.is_empty() {
        return Some(format!("no {field}\n"));
    }
    Some(render_table(rows, columns, now, palette))
}

/// Rows under a header, each column as wide as its widest cell.
pub fn render_table(rows: &[Value], columns: &[Column], now: i64, palette: Palette) -> String {
    let mut cells: Vec<Vec<(String, Style)>> =
        vec![columns.iter().map(|c| (c.0.to_owned(), HEADER)).collect()];
    for row in rows {
        cells.push(
            columns
                .iter()
                .map(|Column(_, field, kind)| render_cell(row.get(*field), *kind, now))
                .collect(),
        );
    }
    let widths: Vec<usize> = (0..columns.len())
        .map(|i| {
            cells
                .iter()
                .map(|r| r[i].0.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in &cells {
        let mut line = String::new();
        for (i, ((text, style), width)) in row.iter().zip(&widths).enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            line.push_str(&palette.paint(*style, text));
            // Padding outside the colour, measured on the plain text; the
            // last column is not padded.
            if i + 1 < row.len() {
                let pad = width - text.chars().count();
                line.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn render_cell(value: Option<&Value>, kind: Cell, now: i64) -> (String, Style) {
    let text = match (value, kind) {
        (None | Some(Value::Null), _) => "-".to_owned(),
        (Some(Value::Number(n)), Cell::Time) => match n.as_i64() {
            Some(ms) => Relative(ms - now).to_string(),
            None => n.to_string(),
        },
        (Some(Value::String(s)), _) => s.clone(),
        (Some(other), _) => other.to_string(),
    };
    let style = match kind {
        Cell::Status => status_style(&text),
        Cell::Alarm if text == "true" => BAD,
        _ => Style::new(),
    };
    (text, style)
}

/// A time difference in milliseconds, as `5s ago` / `in 3m`.
pub struct Relative(pub i64);

impl fmt::Display for Relative {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.0.unsigned_abs() / 1000;
        let amount = match secs {
            0..60 => format!("{secs}s"),
            60..3600 => format!("{}m", secs / 60),
            3600..86400 => format!("{}h", secs / 3600),
            _ => format!("{}d", secs / 86400),
        };
        if self.0 < 0 {
            write!(f, "{amount} ago")
        } else {
            write!(f, "in {amount}")
        }
    }
}

fn text_of(value: Option<&Value>) -> String {
    match value {
        None | Some(Value::Null) => "-".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

fn time_of(value: Option<&Value>, now: i64) -> String {
    match value.and_then(Value::as_i64) {
        Some(ms) => Relative(ms - now).to_string(),
        None => "-".to_owned(),
    }
}

/// `running (ready)`, `starting`, … of an instance record, coloured.
fn status_phrase(instance: &Value, palette: Palette) -> String {
    let status = text_of(instance.get("status"));
    let mut text = palette.paint(status_style(&status), &status);
    if status == "running" && instance.get("ready") == Some(&Value::Bool(false)) {
        text.push_str(" (not ready)");
    }
    text
}

/// One line for a launched or restarted instance (`{instance, url}`): who,
/// what state, where; then the link that opens it.
pub fn launched(answer: &Value, verb: &str, palette: Palette) -> Option<String> {
    let instance = answer.get("instance")?;
    let user = instance.get("user")?.as_str()?;
    let mut out = format!(
        "{user} {verb}: {} on {} (port {}, pid {}, epoch {})\n",
        status_phrase(instance, palette),
        text_of(instance.get("node")),
        text_of(instance.get("port")),
        text_of(instance.get("pid")),
        text_of(instance.get("epoch")),
    );
    if let Some(url) = answer.get("url").and_then(Value::as_str) {
        if answer.get("sign_in") == Some(&Value::Bool(true)) {
            let _ = writeln!(out, "open: {url}");
        } else {
            // Without a sign-in page a browser needs a link that carries a
            // token; the app's bare address would answer 401.
            let _ = writeln!(
                out,
                "open: run `berth open {user}` for a link that signs a browser in (the app is at {url})"
            );
        }
    }
    Some(out)
}

/// A short-lived link (`berth open`): where it leads and how long.
pub fn opened(answer: &Value, now: i64) -> Option<String> {
    let user = answer.get("user")?.as_str()?;
    let url = answer.get("url")?.as_str()?;
    Some(format!(
        "link for {user}, good until {}:\nopen: {url}\n",
        time_of(answer.get("expires_at"), now)
    ))
}

/// A user's status (`{user, main, watchdog, breaker}`) as labelled lines.
pub fn user_status(answer: &Value, now: i64, palette: Palette) -> Option<String> {
    let user = answer.get("user")?.as_str()?;
    let mut lines: Vec<(&str, String)> = vec![("user", user.to_owned())];
    match answer.get("main").filter(|m| !m.is_null()) {
        Some(main) => {
            lines.push(("status", status_phrase(main, palette)));
            for (label, field) in [
                ("node", "node"),
                ("epoch", "epoch"),
                ("port", "port"),
                ("pid", "pid"),
                ("restarts", "restarts"),
            ] {
                lines.push((label, text_of(main.get(field))));
            }
            lines.push(("started", time_of(main.get("started_at"), now)));
            lines.push(("active", time_of(main.get("last_active"), now)));
            let folder = text_of(main.get("folder"));
            lines.push((
                "folder",
                if folder.is_empty() {
                    ".".into()
                } else {
                    folder
                },
            ));
            if let Some(error) = main.get("last_error").and_then(Value::as_str) {
                lines.push(("last error", error.to_owned()));
            }
            if let Some(code) = main.get("exit_code").filter(|c| !c.is_null()) {
                lines.push(("exit code", code.to_string()));
            }
        }
        None => lines.push(("status", palette.paint(DIM, "no instance"))),
    }
    let breaker = match answer.get("breaker").filter(|b| !b.is_null()) {
        Some(b) => palette.paint(
            BAD,
            &format!(
                "open until {} ({} opens)",
                time_of(b.get("cooldown_until"), now),
                text_of(b.get("opens"))
            ),
        ),
        None => "closed".to_owned(),
    };
    lines.push(("breaker", breaker));
    let watchdog = match answer.get("watchdog").filter(|w| !w.is_null()) {
        Some(w) => status_phrase(w, palette),
        None => "none".to_owned(),
    };
    lines.push(("watchdog", watchdog));
    let width = lines.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    let mut out = String::new();
    for (label, value) in lines {
        let _ = writeln!(out, "{label:<width$}  {value}");
    }
    Some(out)
}

/// A probe's report (`{ok, reason}`).
pub fn probe(user: &str, answer: &Value, palette: Palette) -> String {
    let ok = answer.get("ok") == Some(&Value::Bool(true));
    let reason = answer
        .get("reason")
        .and_then(Value::as_str)
        .filter(|r| !r.is_empty());
    let verdict = if ok {
        palette.paint(GOOD, "ok")
    } else {
        palette.paint(BAD, "failed")
    };
    match reason {
        Some(reason) => format!("probe {user}: {verdict}: {reason}\n"),
        None => format!("probe {user}: {verdict}\n"),
    }
}

/// A restart-all's results as a table, with a summary line.
pub fn restart_all(answer: &Value, palette: Palette) -> Option<String> {
    let results = answer.get("results")?.as_array()?;
    if results.is_empty() {
        return Some("no running instances to restart\n".to_owned());
    }
    let rows: Vec<Value> = results
        .iter()
        .map(|r| {
            let mut row = r.clone();
            if let Value::Object(map) = &mut row {
                let ok = map.get("ok") == Some(&Value::Bool(true));
                map.insert(
                    "result".into(),
                    Value::from(if ok { "ok" } else { "failed" }),
                );
            }
            row
        })
        .collect();
    let failed = rows.iter().filter(|r| r["result"] == "failed").count();
    let mut out = render_table(&rows, RESTART_COLUMNS, 0, palette);
    let _ = writeln!(
        out,
        "{} restarted, {} failed",
        rows.len() - failed,
        if failed > 0 {
            palette.paint(BAD, &failed.to_string())
        } else {
            "0".to_owned()
        }
    );
    Some(out)
}

/// A minted token (`{token, id, expires_at, url}`).
pub fn minted(answer: &Value, now: i64) -> Option<String> {
    let user = answer.get("user")?.as_str()?;
    let token = answer.get("token")?.as_str()?;
    let mut out = format!(
        "token {} for {user}, expires {}:\n{token}\n",
        text_of(answer.get("id")),
        time_of(answer.get("expires_at"), now)
    );
    if let Some(url) = answer.get("url").and_then(Value::as_str) {
        let _ = writeln!(out, "open: {url}");
    }
    Some(out)
}

/// A revocation (`{revoked: [ids], unreached_nodes: [ids]}`).
pub fn revoked(answer: &Value, palette: Palette) -> Option<String> {
    let ids = answer.get("revoked")?.as_array()?;
    let ids: Vec<String> = ids.iter().map(|v| text_of(Some(v))).collect();
    let mut out = format!("revoked {}\n", ids.join(", "));
    let unreached: Vec<String> = answer
        .get("unreached_nodes")
        .and_then(Value::as_array)
        .map(|n| n.iter().map(|v| text_of(Some(v))).collect())
        .unwrap_or_default();
    if !unreached.is_empty() {
        let _ = writeln!(
            out,
            "{}: nodes {} could not be told; they drop it within [auth] token_cache_s",
            palette.paint(PENDING, "warning"),
            unreached.join(", ")
        );
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const PLAIN: Palette = Palette { colour: false };
    const COLOUR: Palette = Palette { colour: true };

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        let set = Some(OsStr::new("1"));
        assert!(colour_wanted(true, None, None));
        assert!(!colour_wanted(false, None, None));
        assert!(!colour_wanted(true, set, None));
        // An empty NO_COLOR does not count (no-color.org).
        assert!(colour_wanted(true, Some(OsStr::new("")), None));
        assert!(!colour_wanted(true, None, Some(OsStr::new("dumb"))));
        assert!(colour_wanted(true, None, Some(OsStr::new("xterm"))));
    }

    #[test]
    fn tables_align_and_show_missing_as_dash() {
        let rows = vec![
            json!({"id": "node-a", "status": "up", "load": 3, "capacity": 10, "heartbeat": 9000}),
            json!({"id": "b", "status": "draining", "heartbeat": null}),
        ];
        let out = render_table(&rows, NODE_COLUMNS, 10_000, PLAIN);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "ID      STATUS    LOAD  CAPACITY  URL  HEARTBEAT");
        assert_eq!(lines[1], "node-a  up        3     10        -    1s ago");
        assert_eq!(lines[2], "b       draining  -     -         -    -");
        assert!(!out.contains('\x1b'));
    }

    #[test]
    fn coloured_tables_stay_aligned() {
        let rows = vec![
            json!({"user": "alice", "holder": "a", "epoch": 1, "released": false, "expired": true}),
            json!({"user": "bob", "holder": "bb", "epoch": 2, "released": false, "expired": false}),
        ];
        let out = render_table(&rows, LEASE_COLUMNS, 0, COLOUR);
        assert!(out.contains('\x1b'), "{out:?}");
        // Without the escapes, the same table as uncoloured.
        let stripped: String = {
            let mut s = String::new();
            let mut chars = out.chars();
            while let Some(c) = chars.next() {
                if c == '\x1b' {
                    for c in chars.by_ref() {
                        if c == 'm' {
                            break;
                        }
                    }
                } else {
                    s.push(c);
                }
            }
            s
        };
        assert_eq!(stripped, render_table(&rows, LEASE_COLUMNS, 0, PLAIN));
        // The expired lease's flag is red.
        let red = BAD.render().to_string();
        assert!(out.lines().nth(1).unwrap().contains(&red), "{out:?}");
        assert!(!out.lines().nth(2).unwrap().contains(&red), "{out:?}");
    }

    #[test]
    fn non_lists_are_not_tables() {
        assert_eq!(
            table(&json!({"x": 1}), "nodes", NODE_COLUMNS, 0, PLAIN),
            None
        );
        assert_eq!(
            table(&json!({"nodes": []}), "nodes", NODE_COLUMNS, 0, PLAIN).as_deref(),
            Some("no nodes\n")
        );
    }

    #[test]
    fn summaries_read_well() {
        let answer = json!({
            "instance": {"user": "carol", "status": "running", "ready": true, "node": "n1",
                         "port": 20001, "pid": 42, "epoch": 3},
            "url": "http://127.0.0.1:8000/u/carol/",
            "sign_in": true
        });
        assert_eq!(
            launched(&answer, "started", PLAIN).unwrap(),
            "carol started: running on n1 (port 20001, pid 42, epoch 3)\n\
             open: http://127.0.0.1:8000/u/carol/\n"
        );
        let mut no_sign_in = answer.clone();
        no_sign_in["sign_in"] = json!(false);
        assert!(
            launched(&no_sign_in, "started", PLAIN)
                .unwrap()
                .ends_with("open: run `berth open carol` for a link that signs a browser in (the app is at http://127.0.0.1:8000/u/carol/)\n")
        );
        assert_eq!(
            probe("carol", &json!({"ok": false, "reason": "exited"}), PLAIN),
            "probe carol: failed: exited\n"
        );
        assert_eq!(
            probe("carol", &json!({"ok": true, "reason": ""}), PLAIN),
            "probe carol: ok\n"
        );
        let status = user_status(
            &json!({"user": "carol", "main": answer["instance"], "watchdog": null,
                    "breaker": {"opens": 2, "opened_at": 0, "cooldown_until": 60_000}}),
            0,
            PLAIN,
        )
        .unwrap();
        assert!(
            status.starts_with("user      carol\nstatus    running\n"),
            "{status}"
        );
        assert!(
            status.contains("breaker   open until in 1m (2 opens)\n"),
            "{status}"
        );
        assert!(status.ends_with("watchdog  none\n"), "{status}");
        let all = restart_all(
            &json!({"results": [{"user": "a", "node": "n", "ok": true},
                                {"user": "b", "node": "n", "ok": false, "error": "boom"}]}),
            PLAIN,
        )
        .unwrap();
        assert!(all.contains("b     n     failed  boom"), "{all}");
        assert!(all.ends_with("1 restarted, 1 failed\n"), "{all}");
    }
}
