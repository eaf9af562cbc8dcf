//! How the client commands show answers to people: aligned tables and
//! short summaries, coloured on a terminal. `--json` bypasses all of this
//! and prints the API's answer as it is.
//!
//! Everything here is a pure function of the API's answer as its type in
//! [`crate::wire`], the time and whether to colour, so it is tested
//! without a server or a terminal. Every string the server sent passes
//! through [`escape::text`] where it is printed, so the colours added here
//! are the only escape sequences in what is shown.

use std::ffi::OsStr;
use std::fmt;
use std::fmt::Write as _;

use anstyle::{AnsiColor, Style};
use berth_core::egress::EgressPolicy;
use berth_core::{Instance, InstanceStatus, ProbeReport, UnixMillis};
use berth_store::{LeaseRecord, NodeRecord, TokenRecord};

use crate::escape;
use crate::wire::{
    InstanceList, LaunchAnswer, LeaseList, MintedToken, NodeList, NodeRestart, RestartAll, Revoked,
    TokenList, UserEgress, UserStatus,
};

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

/// A column of a table of `R`s: its header, how its cells are styled,
/// and what a row shows in it.
pub struct Column<R>(pub &'static str, pub Cell, pub fn(&R) -> Field<'_>);

/// How a column's cells are styled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cell {
    Plain,
    /// A status word, coloured by [`status_style`].
    Status,
    /// A flag that is bad news when true (an expired lease).
    Alarm,
}

/// What a cell shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Field<'a> {
    /// Nothing (the answer's `null`): `-`.
    Absent,
    /// Text as the server sent it, shown with its control characters made
    /// visible.
    Text(&'a str),
    /// A number, a flag or one of berth's own names.
    Word(String),
    /// Unix milliseconds, shown relative to now.
    Time(UnixMillis),
}

impl Field<'_> {
    fn word(value: impl fmt::Display) -> Self {
        Field::Word(value.to_string())
    }
}

/// `value` as its field, or `-` without one.
fn optional<'a, T>(value: Option<T>, field: impl FnOnce(T) -> Field<'a>) -> Field<'a> {
    value.map_or(Field::Absent, field)
}

pub const INSTANCE_COLUMNS: &[Column<Instance>] = &[
    Column("USER", Cell::Plain, |i| Field::Text(i.user.as_str())),
    Column("ROLE", Cell::Plain, |i| Field::word(i.role)),
    Column("STATUS", Cell::Status, |i| Field::word(i.status)),
    Column("READY", Cell::Plain, |i| Field::word(i.ready)),
    Column("NODE", Cell::Plain, |i| Field::Text(&i.node)),
    Column("PORT", Cell::Plain, |i| optional(i.port, Field::word)),
    Column("PID", Cell::Plain, |i| optional(i.pid, Field::word)),
    Column("EPOCH", Cell::Plain, |i| Field::word(i.epoch)),
    Column("RESTARTS", Cell::Plain, |i| Field::word(i.restarts)),
    Column("STARTED", Cell::Plain, |i| Field::Time(i.started_at)),
    Column("ACTIVE", Cell::Plain, |i| Field::Time(i.last_active)),
];

pub const NODE_COLUMNS: &[Column<NodeRecord>] = &[
    Column("ID", Cell::Plain, |n| Field::Text(&n.id)),
    Column("STATUS", Cell::Status, |n| Field::word(n.status)),
    Column("LOAD", Cell::Plain, |n| Field::word(n.load)),
    Column("CAPACITY", Cell::Plain, |n| Field::word(n.capacity)),
    Column("URL", Cell::Plain, |n| Field::Text(&n.advertise_url)),
    Column("HEARTBEAT", Cell::Plain, |n| Field::Time(n.heartbeat)),
];

pub const TOKEN_COLUMNS: &[Column<TokenRecord>] = &[
    Column("ID", Cell::Plain, |t| Field::Text(&t.id)),
    Column("CREATED", Cell::Plain, |t| Field::Time(t.created_at)),
    Column("EXPIRES", Cell::Plain, |t| Field::Time(t.expires_at)),
    Column("LAST USED", Cell::Plain, |t| {
        optional(t.last_used_at, Field::Time)
    }),
    Column("MINTED WITH", Cell::Plain, |t| {
        optional(t.parent.as_deref(), Field::Text)
    }),
];

pub const LEASE_COLUMNS: &[Column<LeaseRecord>] = &[
    Column("USER", Cell::Plain, |l| Field::Text(l.user.as_str())),
    Column("HOLDER", Cell::Plain, |l| {
        optional(l.holder.as_deref(), Field::Text)
    }),
    Column("EPOCH", Cell::Plain, |l| Field::word(l.epoch)),
    Column("UNTIL", Cell::Plain, |l| {
        optional(l.lease_until, Field::Time)
    }),
    Column("RELEASED", Cell::Plain, |l| Field::word(l.released)),
    Column("EXPIRED", Cell::Alarm, |l| Field::word(l.expired)),
];

pub const RESTART_COLUMNS: &[Column<NodeRestart>] = &[
    Column("USER", Cell::Plain, |r| Field::Text(r.user.as_str())),
    Column("NODE", Cell::Plain, |r| Field::Text(&r.node)),
    Column("RESULT", Cell::Status, |r| {
        Field::word(if r.ok { "ok" } else { "failed" })
    }),
    Column("ERROR", Cell::Plain, |r| {
        optional(r.error.as_deref(), Field::Text)
    }),
];

/// A list answer the client shows as a table.
pub trait Listing {
    type Row: 'static;
    /// What the rows are, as in `no instances`.
    const WHAT: &'static str;
    const COLUMNS: &'static [Column<Self::Row>];
    fn rows(&self) -> &[Self::Row];
}

impl Listing for InstanceList {
    type Row = Instance;
    const WHAT: &'static str = "instances";
    const COLUMNS: &'static [Column<Instance>] = INSTANCE_COLUMNS;
    fn rows(&self) -> &[Instance] {
        &self.instances
    }
}

impl Listing for NodeList {
    type Row = NodeRecord;
    const WHAT: &'static str = "nodes";
    const COLUMNS: &'static [Column<NodeRecord>] = NODE_COLUMNS;
    fn rows(&self) -> &[NodeRecord] {
        &self.nodes
    }
}

impl Listing for LeaseList {
    type Row = LeaseRecord;
    const WHAT: &'static str = "leases";
    const COLUMNS: &'static [Column<LeaseRecord>] = LEASE_COLUMNS;
    fn rows(&self) -> &[LeaseRecord] {
        &self.leases
    }
}

impl Listing for TokenList {
    type Row = TokenRecord;
    const WHAT: &'static str = "tokens";
    const COLUMNS: &'static [Column<TokenRecord>] = TOKEN_COLUMNS;
    fn rows(&self) -> &[TokenRecord] {
        &self.tokens
    }
}

/// A list answer as a table, or `no <what>` when it is empty.
pub fn table<L: Listing>(list: &L, now: UnixMillis, palette: Palette) -> String {
    let rows = list.rows();
    if rows.is_empty() {
        return format!("no {}\n", L::WHAT);
    }
    render_table(rows, L::COLUMNS, now, palette)
}

/// Rows under a header, each column as wide as its widest cell.
pub fn render_table<R>(
    rows: &[R],
    columns: &[Column<R>],
    now: UnixMillis,
    palette: Palette,
) -> String {
    let mut cells: Vec<Vec<(String, Style)>> =
        vec![columns.iter().map(|c| (c.0.to_owned(), HEADER)).collect()];
    for row in rows {
        cells.push(
            columns
                .iter()
                .map(|Column(_, kind, field)| render_cell(field(row), *kind, now))
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

fn render_cell(field: Field<'_>, kind: Cell, now: UnixMillis) -> (String, Style) {
    let text = match field {
        Field::Absent => "-".to_owned(),
        Field::Text(text) => escape::text(text).into_owned(),
        Field::Word(word) => word,
        Field::Time(ms) => relative(ms, now),
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

/// `at` relative to `now`. Saturating: the time came from the server.
fn relative(at: UnixMillis, now: UnixMillis) -> String {
    Relative(at.saturating_sub(now)).to_string()
}

/// `value`, or `-` without one.
fn or_dash(value: Option<impl fmt::Display>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// `running (ready)`, `starting`, … of an instance record, coloured.
fn status_phrase(instance: &Instance, palette: Palette) -> String {
    let status = instance.status.as_str();
    let mut text = palette.paint(status_style(status), status);
    if instance.status == InstanceStatus::Running && !instance.ready {
        text.push_str(" (not ready)");
    }
    text
}

/// One line for a launched or restarted instance: who, what state, where;
/// then the link that opens it.
pub fn launched(answer: &LaunchAnswer, verb: &str, palette: Palette) -> String {
    let instance = &answer.instance;
    let user = escape::text(instance.user.as_str());
    let url = escape::text(&answer.url);
    let mut out = format!(
        "{user} {verb}: {} on {} (port {}, pid {}, epoch {})\n",
        status_phrase(instance, palette),
        escape::text(&instance.node),
        or_dash(instance.port),
        or_dash(instance.pid),
        instance.epoch,
    );
    if answer.sign_in {
        let _ = writeln!(out, "open: {url}");
    } else {
        // Without a sign-in page a browser needs a link that carries a
        // token; the app's bare address would answer 401.
        let _ = writeln!(
            out,
            "open: run `berth open {user}` for a link that signs a browser in (the app is at {url})"
        );
    }
    out
}

/// A short-lived link (`berth open`): where it leads and how long.
pub fn opened(minted: &MintedToken, now: UnixMillis) -> String {
    format!(
        "link for {}, good until {}:\nopen: {}\n",
        escape::text(minted.user.as_str()),
        relative(minted.expires_at, now),
        escape::text(&minted.url),
    )
}

/// A user's status as labelled lines.
/// Where an instance may connect, in words: `internet, nothing private`
/// (and what is allowed besides), or `only …` when confined.
fn egress_phrase(egress: &EgressPolicy) -> String {
    let allowed: Vec<String> = egress.allow.iter().map(ToString::to_string).collect();
    match (egress.mode.confined(), allowed.is_empty()) {
        (false, true) => "internet, nothing private".to_owned(),
        (false, false) => format!("internet, nothing private but {}", allowed.join(", ")),
        (true, true) => "nothing".to_owned(),
        (true, false) => format!("only {}", allowed.join(", ")),
    }
}

/// `berth egress`'s answer: whose policy, what it lets through, and
/// whether it is the user's own.
pub fn user_egress(answer: &UserEgress) -> String {
    let whose = if answer.own { "own" } else { "the node's" };
    format!(
        "{}: {} ({whose})\n",
        escape::text(answer.user.as_str()),
        escape::text(&egress_phrase(&answer.egress))
    )
}

pub fn user_status(answer: &UserStatus, now: UnixMillis, palette: Palette) -> String {
    let mut lines: Vec<(&str, String)> =
        vec![("user", escape::text(answer.user.as_str()).into_owned())];
    match &answer.main {
        Some(main) => {
            lines.push(("status", status_phrase(main, palette)));
            lines.push(("node", escape::text(&main.node).into_owned()));
            lines.push(("epoch", main.epoch.to_string()));
            lines.push(("port", or_dash(main.port)));
            lines.push(("pid", or_dash(main.pid)));
            lines.push(("restarts", main.restarts.to_string()));
            lines.push(("started", relative(main.started_at, now)));
            lines.push(("active", relative(main.last_active, now)));
            let folder = if main.folder.is_empty() {
                ".".to_owned()
            } else {
                escape::text(&main.folder).into_owned()
            };
            lines.push(("folder", folder));
            if let Some(error) = &main.last_error {
                lines.push(("last error", escape::text(error).into_owned()));
            }
            if let Some(code) = main.exit_code {
                lines.push(("exit code", code.to_string()));
            }
        }
        None => lines.push(("status", palette.paint(DIM, "no instance"))),
    }
    let breaker = match &answer.breaker {
        Some(b) => palette.paint(
            BAD,
            &format!(
                "open until {} ({} opens)",
                relative(b.cooldown_until, now),
                b.opens
            ),
        ),
        None => "closed".to_owned(),
    };
    lines.push(("breaker", breaker));
    let watchdog = match &answer.watchdog {
        Some(w) => status_phrase(w, palette),
        None => "none".to_owned(),
    };
    lines.push(("watchdog", watchdog));
    if let Some(egress) = &answer.egress {
        lines.push(("egress", escape::text(&egress_phrase(egress)).into_owned()));
    }
    let width = lines.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    let mut out = String::new();
    for (label, value) in lines {
        let _ = writeln!(out, "{label:<width$}  {value}");
    }
    out
}

/// A probe's report of `user`'s instance.
pub fn probe(user: &str, report: &ProbeReport, palette: Palette) -> String {
    let verdict = if report.ok {
        palette.paint(GOOD, "ok")
    } else {
        palette.paint(BAD, "failed")
    };
    if report.reason.is_empty() {
        format!("probe {user}: {verdict}\n")
    } else {
        format!(
            "probe {user}: {verdict}: {}\n",
            escape::text(&report.reason)
        )
    }
}

/// A restart-all's results as a table, with a summary line.
pub fn restart_all(answer: &RestartAll, palette: Palette) -> String {
    let results = &answer.results;
    if results.is_empty() {
        return "no running instances to restart\n".to_owned();
    }
    let failed = results.iter().filter(|r| !r.ok).count();
    let mut out = render_table(results, RESTART_COLUMNS, 0, palette);
    let _ = writeln!(
        out,
        "{} restarted, {} failed",
        results.len() - failed,
        if failed > 0 {
            palette.paint(BAD, &failed.to_string())
        } else {
            "0".to_owned()
        }
    );
    out
}

/// A minted token: its id, whose, how long; the token; the link.
pub fn minted(minted: &MintedToken, now: UnixMillis) -> String {
    format!(
        "token {} for {}, expires {}:\n{}\nopen: {}\n",
        escape::text(&minted.id),
        escape::text(minted.user.as_str()),
        relative(minted.expires_at, now),
        escape::text(&minted.token),
        escape::text(&minted.url),
    )
}

/// A revocation: the ids deleted, and the nodes that could not be told.
pub fn revoked(answer: &Revoked, palette: Palette) -> String {
    let ids: Vec<_> = answer.revoked.iter().map(|id| escape::text(id)).collect();
    let mut out = format!("revoked {}\n", ids.join(", "));
    if !answer.unreached_nodes.is_empty() {
        let nodes: Vec<_> = answer
            .unreached_nodes
            .iter()
            .map(|node| escape::text(node))
            .collect();
        let _ = writeln!(
            out,
            "{}: nodes {} could not be told; they drop it within [auth] token_cache_s",
            palette.paint(PENDING, "warning"),
            nodes.join(", ")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_core::{BreakerInfo, Role, UserId};
    use berth_store::NodeStatus;

    const PLAIN: Palette = Palette { colour: false };
    const COLOUR: Palette = Palette { colour: true };

    fn user(name: &str) -> UserId {
        UserId::parse(name).unwrap()
    }

    fn carol() -> Instance {
        Instance {
            id: "carol-1".into(),
            user: user("carol"),
            role: Role::Main,
            status: InstanceStatus::Running,
            node: "n1".into(),
            epoch: 3,
            port: Some(20001),
            pid: Some(42),
            runtime_ref: None,
            folder: String::new(),
            started_at: 0,
            ready: true,
            restarts: 0,
            last_error: None,
            exit_code: None,
            last_active: 0,
            hibernated_at: None,
        }
    }

    fn node(id: &str, status: NodeStatus, load: u32, heartbeat: UnixMillis) -> NodeRecord {
        NodeRecord {
            id: id.into(),
            advertise_url: format!("http://{id}"),
            internal_url: String::new(),
            capacity: 10,
            load,
            status,
            heartbeat,
        }
    }

    fn lease(name: &str, holder: Option<&str>, expired: bool) -> LeaseRecord {
        LeaseRecord {
            user: user(name),
            holder: holder.map(str::to_owned),
            epoch: 1,
            lease_until: None,
            released: false,
            expired,
            holder_alive: None,
        }
    }

    fn minted_token(url: &str) -> MintedToken {
        MintedToken {
            user: user("carol"),
            token: "secret".into(),
            id: "t1".into(),
            created_at: 0,
            expires_at: 120_000,
            parent: None,
            url: url.into(),
            routing: crate::wire::Routing::Path,
        }
    }

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
        let nodes = NodeList {
            nodes: vec![
                node("node-a", NodeStatus::Up, 3, 9000),
                node("b", NodeStatus::Draining, 0, 130_000),
            ],
        };
        let out = table(&nodes, 10_000, PLAIN);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[0],
            "ID      STATUS    LOAD  CAPACITY  URL            HEARTBEAT"
        );
        assert_eq!(
            lines[1],
            "node-a  up        3     10        http://node-a  1s ago"
        );
        assert_eq!(
            lines[2],
            "b       draining  0     10        http://b       in 2m"
        );
        assert!(!out.contains('\x1b'));
        let tokens = TokenList {
            user: user("carol"),
            tokens: vec![TokenRecord {
                id: "t1".into(),
                user: user("carol"),
                created_at: 0,
                expires_at: 60_000,
                last_used_at: None,
                parent: None,
            }],
        };
        assert_eq!(
            table(&tokens, 0, PLAIN),
            "ID  CREATED  EXPIRES  LAST USED  MINTED WITH\n\
             t1  in 0s    in 1m    -          -\n"
        );
    }

    #[test]
    fn coloured_tables_stay_aligned() {
        let leases = LeaseList {
            leases: vec![
                lease("alice", Some("a"), true),
                lease("bob", Some("bb"), false),
            ],
        };
        let out = table(&leases, 0, COLOUR);
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
        assert_eq!(stripped, table(&leases, 0, PLAIN));
        // The expired lease's flag is red.
        let red = BAD.render().to_string();
        assert!(out.lines().nth(1).unwrap().contains(&red), "{out:?}");
        assert!(!out.lines().nth(2).unwrap().contains(&red), "{out:?}");
    }

    #[test]
    fn empty_lists_say_so() {
        assert_eq!(table(&NodeList { nodes: vec![] }, 0, PLAIN), "no nodes\n");
        assert_eq!(
            table(&InstanceList { instances: vec![] }, 0, PLAIN),
            "no instances\n"
        );
    }

    #[test]
    fn summaries_read_well() {
        let answer = LaunchAnswer {
            instance: carol(),
            url: "http://127.0.0.1:8000/u/carol/".into(),
            sign_in: true,
        };
        assert_eq!(
            launched(&answer, "started", PLAIN),
            "carol started: running on n1 (port 20001, pid 42, epoch 3)\n\
             open: http://127.0.0.1:8000/u/carol/\n"
        );
        let no_sign_in = LaunchAnswer {
            sign_in: false,
            ..answer.clone()
        };
        assert!(
            launched(&no_sign_in, "started", PLAIN)
                .ends_with("open: run `berth open carol` for a link that signs a browser in (the app is at http://127.0.0.1:8000/u/carol/)\n")
        );
        let report = |ok, reason: &str| ProbeReport {
            ok,
            reason: reason.into(),
        };
        assert_eq!(
            probe("carol", &report(false, "exited"), PLAIN),
            "probe carol: failed: exited\n"
        );
        assert_eq!(
            probe("carol", &report(true, ""), PLAIN),
            "probe carol: ok\n"
        );
        let status = user_status(
            &UserStatus {
                user: user("carol"),
                main: Some(carol()),
                watchdog: None,
                breaker: Some(BreakerInfo {
                    opens: 2,
                    opened_at: 0,
                    cooldown_until: 60_000,
                }),
                idle_action: None,
                egress: Some(EgressPolicy {
                    mode: berth_core::egress::EgressMode::Allowlist,
                    allow: vec![
                        "pypi.org".parse().unwrap(),
                        "10.8.0.0/24:5432".parse().unwrap(),
                    ],
                }),
            },
            0,
            PLAIN,
        );
        assert_eq!(
            status,
            "user      carol\n\
             status    running\n\
             node      n1\n\
             epoch     3\n\
             port      20001\n\
             pid       42\n\
             restarts  0\n\
             started   in 0s\n\
             active    in 0s\n\
             folder    .\n\
             breaker   open until in 1m (2 opens)\n\
             watchdog  none\n\
             egress    only pypi.org, 10.8.0.0/24:5432\n"
        );
        let open = |allow: &[&str]| EgressPolicy {
            mode: berth_core::egress::EgressMode::AllowAll,
            allow: allow.iter().map(|d| d.parse().unwrap()).collect(),
        };
        assert_eq!(egress_phrase(&open(&[])), "internet, nothing private");
        assert_eq!(
            egress_phrase(&open(&["10.8.0.0/24"])),
            "internet, nothing private but 10.8.0.0/24"
        );
        let all = restart_all(
            &RestartAll {
                results: vec![
                    NodeRestart {
                        user: user("a"),
                        node: "n".into(),
                        ok: true,
                        error: None,
                    },
                    NodeRestart {
                        user: user("b"),
                        node: "n".into(),
                        ok: false,
                        error: Some("boom".into()),
                    },
                ],
            },
            PLAIN,
        );
        assert_eq!(
            all,
            "USER  NODE  RESULT  ERROR\n\
             a     n     ok      -\n\
             b     n     failed  boom\n\
             1 restarted, 1 failed\n"
        );
        let link = minted_token("http://h/u/carol/?berth_token=secret");
        assert_eq!(
            minted(&link, 0),
            "token t1 for carol, expires in 2m:\nsecret\n\
             open: http://h/u/carol/?berth_token=secret\n"
        );
        assert_eq!(
            opened(&link, 0),
            "link for carol, good until in 2m:\n\
             open: http://h/u/carol/?berth_token=secret\n"
        );
        let gone = Revoked {
            user: user("carol"),
            revoked: vec!["t1".into(), "t2".into()],
            unreached_nodes: vec!["n2".into()],
        };
        assert_eq!(
            revoked(&gone, PLAIN),
            "revoked t1, t2\n\
             warning: nodes n2 could not be told; they drop it within [auth] token_cache_s\n"
        );
    }

    /// What a server or a program may send: an OSC 52 clipboard write and
    /// a one-byte CSI.
    const HOSTILE: &str = "x\u{1b}]52;c;aGk=\u{7}\u{9b}2J";
    const SHOWN: &str = "x\\x1b]52;c;aGk=\\x07\\u{9b}2J";

    /// `out` shows `HOSTILE` as text, and holds no control character but
    /// newline (and the colours, when asked for).
    fn shows_it_as_text(out: &str, what: &str) {
        assert!(out.contains(SHOWN), "{what}: {out:?}");
        assert!(
            !out.chars().any(|c| c.is_control() && c != '\n'),
            "{what}: {out:?}"
        );
    }

    #[test]
    fn every_string_from_the_server_is_shown_as_text() {
        let hostile = Instance {
            node: HOSTILE.into(),
            folder: HOSTILE.into(),
            last_error: Some(HOSTILE.into()),
            ..carol()
        };
        let status = user_status(
            &UserStatus {
                user: user("carol"),
                main: Some(hostile.clone()),
                watchdog: None,
                breaker: None,
                idle_action: None,
                egress: None,
            },
            0,
            PLAIN,
        );
        shows_it_as_text(&status, "status");
        assert!(
            status.contains(&format!("node        {SHOWN}\n")),
            "{status}"
        );
        assert!(
            status.contains(&format!("folder      {SHOWN}\n")),
            "{status}"
        );
        assert!(
            status.contains(&format!("last error  {SHOWN}\n")),
            "{status}"
        );

        for sign_in in [true, false] {
            let answer = LaunchAnswer {
                instance: hostile.clone(),
                url: HOSTILE.into(),
                sign_in,
            };
            let out = launched(&answer, "started", PLAIN);
            shows_it_as_text(&out, "launched");
            assert_eq!(out.matches(SHOWN).count(), 2, "node and url: {out}");
        }

        let link = minted_token(HOSTILE);
        shows_it_as_text(&opened(&link, 0), "opened");
        let mint = minted(
            &MintedToken {
                id: HOSTILE.into(),
                token: HOSTILE.into(),
                ..link
            },
            0,
        );
        shows_it_as_text(&mint, "minted");
        assert_eq!(mint.matches(SHOWN).count(), 3, "id, token, url: {mint}");

        let gone = revoked(
            &Revoked {
                user: user("carol"),
                revoked: vec![HOSTILE.into()],
                unreached_nodes: vec![HOSTILE.into()],
            },
            PLAIN,
        );
        shows_it_as_text(&gone, "revoked");
        assert_eq!(gone.matches(SHOWN).count(), 2, "{gone}");

        let report = ProbeReport {
            ok: false,
            reason: HOSTILE.into(),
        };
        shows_it_as_text(&probe("carol", &report, PLAIN), "probe");

        let all = restart_all(
            &RestartAll {
                results: vec![NodeRestart {
                    user: user("carol"),
                    node: HOSTILE.into(),
                    ok: false,
                    error: Some(HOSTILE.into()),
                }],
            },
            PLAIN,
        );
        shows_it_as_text(&all, "restart-all");
        assert_eq!(all.matches(SHOWN).count(), 2, "{all}");

        let instances = table(
            &InstanceList {
                instances: vec![hostile],
            },
            0,
            PLAIN,
        );
        shows_it_as_text(&instances, "instances");
        let mut hostile_node = node("n1", NodeStatus::Up, 0, 0);
        hostile_node.id = HOSTILE.into();
        hostile_node.advertise_url = HOSTILE.into();
        let nodes = table(
            &NodeList {
                nodes: vec![hostile_node],
            },
            0,
            PLAIN,
        );
        shows_it_as_text(&nodes, "nodes");
        assert_eq!(nodes.matches(SHOWN).count(), 2, "{nodes}");
        let leases = table(
            &LeaseList {
                leases: vec![lease("carol", Some(HOSTILE), false)],
            },
            0,
            PLAIN,
        );
        shows_it_as_text(&leases, "leases");
        let tokens = table(
            &TokenList {
                user: user("carol"),
                tokens: vec![TokenRecord {
                    id: HOSTILE.into(),
                    user: user("carol"),
                    created_at: 0,
                    expires_at: 0,
                    last_used_at: None,
                    parent: Some(HOSTILE.into()),
                }],
            },
            0,
            PLAIN,
        );
        shows_it_as_text(&tokens, "tokens");
        assert_eq!(tokens.matches(SHOWN).count(), 2, "{tokens}");
    }
}
