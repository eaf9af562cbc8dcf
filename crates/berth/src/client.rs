//! The client commands: thin calls to the HTTP API (design §8.4).
//!
//! Responses are printed as pretty JSON, lists as short tables. An API error
//! becomes `berth: <code>: <message>` and exit code 1.

use std::fmt;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use berth_core::UserId;
use futures_util::StreamExt;
use reqwest::{Method, StatusCode, Url};
use serde_json::{Map, Value};

use crate::cli::{ClientArgs, Command};

/// An error answer from the API, displayed as `<code>: <message>`.
#[derive(Debug, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub code: String,
    pub message: String,
}

pub async fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Status { user, client } => {
            let api = Api::new(&client)?;
            match user {
                Some(user) => {
                    let user = parse_user(&user)?;
                    print_json(&api.get(&user_path(&user, &["instance"]), &[]).await?);
                }
                None => {
                    let body = api.get(&["instances"], &[]).await?;
                    print_table(&body, "instances", INSTANCE_COLUMNS);
                }
            }
        }
        Command::Start {
            user,
            folder,
            patch_file,
            force,
            no_wait,
            client,
        } => {
            let user = parse_user(&user)?;
            let mut body = Map::new();
            if let Some(folder) = folder {
                body.insert("folder".into(), Value::String(folder));
            }
            if let Some(file) = patch_file {
                let patch = std::fs::read_to_string(&file)
                    .with_context(|| format!("cannot read patch file {}", file.display()))?;
                body.insert("patch".into(), Value::String(patch));
            }
            if force {
                body.insert("force".into(), Value::Bool(true));
            }
            let query: &[(&str, &str)] = if no_wait { &[("wait", "false")] } else { &[] };
            let api = Api::new(&client)?;
            let answer = api
                .send(
                    Method::POST,
                    &user_path(&user, &["instance"]),
                    query,
                    Some(Value::Object(body)),
                )
                .await?;
            print_json(&answer);
        }
        Command::Stop { user, client } => {
            let user = parse_user(&user)?;
            let api = Api::new(&client)?;
            let answer = api
                .send(Method::DELETE, &user_path(&user, &["instance"]), &[], None)
                .await?;
            if answer.is_null() {
                println!("stopped {}", user.as_str());
            } else {
                print_json(&answer);
            }
        }
        Command::Restart { user, client } => {
            let user = parse_user(&user)?;
            let api = Api::new(&client)?;
            print_json(
                &api.post(&user_path(&user, &["instance", "restart"]))
                    .await?,
            );
        }
        Command::Probe { user, client } => {
            let user = parse_user(&user)?;
            let api = Api::new(&client)?;
            let answer = api.post(&user_path(&user, &["instance", "probe"])).await?;
            print_json(&answer);
            if answer.get("ok") == Some(&Value::Bool(false)) {
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::Logs {
            user,
            follow,
            tail,
            client,
        } => {
            let user = parse_user(&user)?;
            let api = Api::new(&client)?;
            logs(&api, &user, tail, follow).await?;
        }
        Command::Ls {
            status,
            node,
            client,
        } => {
            let api = Api::new(&client)?;
            let mut query = Vec::new();
            if let Some(status) = &status {
                query.push(("status", status.as_str()));
            }
            if let Some(node) = &node {
                query.push(("node", node.as_str()));
            }
            let body = api.get(&["instances"], &query).await?;
            print_table(&body, "instances", INSTANCE_COLUMNS);
        }
        Command::Nodes { client } => {
            let api = Api::new(&client)?;
            let body = api.get(&["nodes"], &[]).await?;
            print_table(&body, "nodes", NODE_COLUMNS);
        }
        Command::Leases { expired, client } => {
            let api = Api::new(&client)?;
            let query: &[(&str, &str)] = if expired { &[("expired", "true")] } else { &[] };
            let body = api.get(&["leases"], query).await?;
            print_table(&body, "leases", LEASE_COLUMNS);
        }
        Command::Takeover { user, client } => {
            let user = parse_user(&user)?;
            let api = Api::new(&client)?;
            print_json(&api.post(&["leases", user.as_str(), "takeover"]).await?);
        }
        Command::RestartAll { client } => {
            let api = Api::new(&client)?;
            let answer = api.post(&["instances", "restart-all"]).await?;
            print_json(&answer);
            let failed = answer
                .get("results")
                .and_then(Value::as_array)
                .is_some_and(|results| {
                    results
                        .iter()
                        .any(|r| r.get("ok") == Some(&Value::Bool(false)))
                });
            if failed {
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::Token {
            user,
            list,
            revoke,
            ttl,
            client,
        } => {
            let user = parse_user(&user)?;
            let api = Api::new(&client)?;
            if list {
                let body = api.get(&user_path(&user, &["tokens"]), &[]).await?;
                print_table(&body, "tokens", TOKEN_COLUMNS);
            } else if let Some(id) = revoke {
                let answer = api
                    .send(
                        Method::DELETE,
                        &user_path(&user, &["tokens", id.as_str()]),
                        &[],
                        None,
                    )
                    .await?;
                print_json(&answer);
            } else {
                let body = ttl.map(|secs| serde_json::json!({ "ttl_s": secs }));
                let mut answer = api
                    .send(Method::POST, &user_path(&user, &["tokens"]), &[], body)
                    .await?;
                let token = answer
                    .get("token")
                    .and_then(Value::as_str)
                    .ok_or_else(|| anyhow!("the API answered without a token: {answer}"))?
                    .to_owned();
                // In path mode the link is this client's URL plus the base
                // path (it may carry a prefix the server cannot know); in
                // host mode only the server knows the user's host name.
                if answer.get("routing").and_then(Value::as_str) != Some("host") {
                    let open = api.open_url(&user, &token);
                    if let Value::Object(map) = &mut answer {
                        map.insert("url".into(), Value::String(open.to_string()));
                    }
                }
                print_json(&answer);
            }
        }
        Command::Serve(_) | Command::DemoApp(_) | Command::Config { .. } => {
            bail!("internal: not a client command")
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn parse_user(raw: &str) -> anyhow::Result<UserId> {
    UserId::parse(raw).map_err(|e| anyhow!("invalid user id {raw:?}: {e}"))
}

fn user_path<'a>(user: &'a UserId, rest: &[&'a str]) -> Vec<&'a str> {
    let mut path = vec!["users", user.as_str()];
    path.extend_from_slice(rest);
    path
}

struct Api {
    http: reqwest::Client,
    base: Url,
    token: String,
}

impl Api {
    fn new(args: &ClientArgs) -> anyhow::Result<Self> {
        let base =
            Url::parse(&args.url).with_context(|| format!("--url {:?} is not a URL", args.url))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
            bail!("--url {:?} is not an http:// or https:// URL", args.url);
        }
        let token = match &args.token {
            Some(token) if !token.trim().is_empty() => token.trim().to_owned(),
            _ => read_token_file(&crate::serve::admin_token_path(&args.data_dir))?,
        };
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .context("cannot set up the HTTP client")?;
        Ok(Self { http, base, token })
    }

    /// `<base>/api/v1/<segments…>`, each segment percent-encoded.
    fn api_url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        url.set_query(None);
        url.set_fragment(None);
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(["api", "v1"]).extend(segments);
        }
        url
    }

    /// `<base>/u/<user>/?berth_token=<token>`: opens the user's instance.
    fn open_url(&self, user: &UserId, token: &str) -> Url {
        let mut url = self.base.clone();
        url.set_query(None);
        url.set_fragment(None);
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(["u", user.as_str(), ""]);
        }
        url.query_pairs_mut().append_pair("berth_token", token);
        url
    }

    async fn get(&self, segments: &[&str], query: &[(&str, &str)]) -> anyhow::Result<Value> {
        self.send(Method::GET, segments, query, None).await
    }

    async fn post(&self, segments: &[&str]) -> anyhow::Result<Value> {
        self.send(Method::POST, segments, &[], None).await
    }

    /// A GET whose answer is read as it arrives (an event stream); an error
    /// answer is the API's error.
    async fn stream(
        &self,
        segments: &[&str],
        query: &[(&str, &str)],
    ) -> anyhow::Result<reqwest::Response> {
        let mut url = self.api_url(segments);
        url.query_pairs_mut().extend_pairs(query);
        let response = self
            .http
            .get(url.clone())
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|e| connection_error(&self.base, e))?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let text = response
            .text()
            .await
            .map_err(|e| connection_error(&self.base, e))?;
        Err(api_error(status, &text, &url))
    }

    /// One request. `Value::Null` for an empty answer (e.g. 204).
    async fn send(
        &self,
        method: Method,
        segments: &[&str],
        query: &[(&str, &str)],
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let mut url = self.api_url(segments);
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(query);
        }
        let mut request = self
            .http
            .request(method, url.clone())
            .bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request
            .send()
            .await
            .map_err(|e| connection_error(&self.base, e))?;
        let status = response.status();
        let text = response
            .text()
            .await
            .map_err(|e| connection_error(&self.base, e))?;
        if status.is_success() {
            if text.trim().is_empty() {
                return Ok(Value::Null);
            }
            return Ok(serde_json::from_str(&text).unwrap_or(Value::String(text)));
        }
        Err(api_error(status, &text, &url))
    }
}

fn connection_error(base: &Url, e: reqwest::Error) -> anyhow::Error {
    // reqwest's own message repeats the full URL; the chain below it holds
    // the cause (refused, timed out, DNS).
    let mut cause = String::new();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        cause = s.to_string();
        source = s.source();
    }
    if cause.is_empty() {
        cause = e.to_string();
    }
    anyhow!("cannot reach berth at {base}: {cause}")
}

fn api_error(status: StatusCode, text: &str, url: &Url) -> anyhow::Error {
    if let Ok(Value::Object(body)) = serde_json::from_str::<Value>(text)
        && let Some(code) = body.get("error").and_then(Value::as_str)
    {
        let message = body
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or_default();
        return ApiError {
            status,
            code: code.to_owned(),
            message: message.to_owned(),
        }
        .into();
    }
    let snippet: String = text.trim().chars().take(200).collect();
    anyhow!("HTTP {status} from {url}: {snippet}")
}

fn read_token_file(path: &std::path::Path) -> anyhow::Result<String> {
    let token = std::fs::read_to_string(path).map_err(|e| {
        anyhow!(
            "no API token: pass --token or set BERTH_TOKEN, or point --data-dir/BERTH_DATA_DIR at the server's data dir (cannot read {}: {e})",
            path.display()
        )
    })?;
    let token = token.trim();
    if token.is_empty() {
        bail!("the token file {} is empty", path.display());
    }
    Ok(token.to_owned())
}

async fn logs(api: &Api, user: &UserId, tail: usize, follow: bool) -> anyhow::Result<()> {
    let tail_text = tail.to_string();
    let path = user_path(user, &["instance", "logs"]);
    if !follow {
        for line in log_lines(&api.get(&path, &[("tail", tail_text.as_str())]).await?) {
            println!("{line}");
        }
        return Ok(());
    }
    // One request, streamed: the server (the node that runs the user)
    // sends the last lines, then each new one as it is written.
    let query = [("tail", tail_text.as_str()), ("follow", "true")];
    let response = api.stream(&path, &query).await?;
    let events = crate::sse::events(response.bytes_stream());
    futures_util::pin_mut!(events);
    while let Some(event) = events.next().await {
        let event = event.map_err(|e| anyhow!("the log stream from {} broke: {e}", api.base))?;
        if event.event != crate::sse::LOG_LINE_EVENT {
            continue;
        }
        match serde_json::from_str::<String>(&event.data) {
            Ok(line) => println!("{line}"),
            Err(_) => println!("{}", event.data),
        }
    }
    Ok(())
}

fn log_lines(body: &Value) -> Vec<String> {
    let lines = match body {
        Value::Object(map) => map.get("lines").and_then(Value::as_array),
        Value::Array(lines) => Some(lines),
        Value::String(text) => return text.lines().map(str::to_owned).collect(),
        _ => None,
    };
    lines
        .map(|lines| {
            lines
                .iter()
                .map(|l| match l {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect()
        })
        .unwrap_or_default()
}

fn print_json(value: &Value) {
    match serde_json::to_string_pretty(value) {
        Ok(text) => println!("{text}"),
        Err(_) => println!("{value}"),
    }
}

/// A column: header, JSON field, how to show it.
struct Column(&'static str, &'static str, Cell);

#[derive(Clone, Copy)]
enum Cell {
    Plain,
    /// Unix milliseconds, shown relative to now.
    Time,
}

const INSTANCE_COLUMNS: &[Column] = &[
    Column("USER", "user", Cell::Plain),
    Column("ROLE", "role", Cell::Plain),
    Column("STATUS", "status", Cell::Plain),
    Column("READY", "ready", Cell::Plain),
    Column("NODE", "node", Cell::Plain),
    Column("PORT", "port", Cell::Plain),
    Column("PID", "pid", Cell::Plain),
    Column("EPOCH", "epoch", Cell::Plain),
    Column("RESTARTS", "restarts", Cell::Plain),
    Column("STARTED", "started_at", Cell::Time),
    Column("ACTIVE", "last_active", Cell::Time),
];

const NODE_COLUMNS: &[Column] = &[
    Column("ID", "id", Cell::Plain),
    Column("STATUS", "status", Cell::Plain),
    Column("LOAD", "load", Cell::Plain),
    Column("CAPACITY", "capacity", Cell::Plain),
    Column("URL", "advertise_url", Cell::Plain),
    Column("HEARTBEAT", "heartbeat", Cell::Time),
];

const TOKEN_COLUMNS: &[Column] = &[
    Column("ID", "id", Cell::Plain),
    Column("CREATED", "created_at", Cell::Time),
    Column("EXPIRES", "expires_at", Cell::Time),
    Column("LAST USED", "last_used_at", Cell::Time),
    Column("MINTED WITH", "parent", Cell::Plain),
];

const LEASE_COLUMNS: &[Column] = &[
    Column("USER", "user", Cell::Plain),
    Column("HOLDER", "holder", Cell::Plain),
    Column("EPOCH", "epoch", Cell::Plain),
    Column("UNTIL", "lease_until", Cell::Time),
    Column("RELEASED", "released", Cell::Plain),
    Column("EXPIRED", "expired", Cell::Plain),
];

/// Prints `body[field]` (or `body` itself when it is an array) as a table;
/// anything else as JSON, so an unexpected answer is never hidden.
fn print_table(body: &Value, field: &str, columns: &[Column]) {
    let rows = match body {
        Value::Array(rows) => rows,
        Value::Object(map) => match map.get(field) {
            Some(Value::Array(rows)) => rows,
            _ => return print_json(body),
        },
        _ => return print_json(body),
    };
    if rows.is_empty() {
        println!("no {field}");
        return;
    }
    let now = berth_core::unix_millis_now();
    print!("{}", render_table(rows, columns, now));
}

fn render_table(rows: &[Value], columns: &[Column], now: i64) -> String {
    let mut cells: Vec<Vec<String>> = vec![columns.iter().map(|c| c.0.to_owned()).collect()];
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
                .map(|r| r[i].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in &cells {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

fn render_cell(value: Option<&Value>, kind: Cell, now: i64) -> String {
    match (value, kind) {
        (None | Some(Value::Null), _) => "-".to_owned(),
        (Some(Value::Number(n)), Cell::Time) => match n.as_i64() {
            Some(ms) => Relative(ms - now).to_string(),
            None => n.to_string(),
        },
        (Some(Value::String(s)), _) => s.clone(),
        (Some(other), _) => other.to_string(),
    }
}

/// A time difference in milliseconds, as `5s ago` / `in 3m`.
struct Relative(i64);

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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::PathBuf;

    fn args(url: &str) -> ClientArgs {
        ClientArgs {
            url: url.to_owned(),
            token: Some("t".to_owned()),
            data_dir: PathBuf::from("/nonexistent"),
        }
    }

    #[test]
    fn user_ids_are_percent_encoded_in_paths() {
        let api = Api::new(&args("http://h:8000/prefix/")).unwrap();
        let user = UserId::parse("a b?#%@x").unwrap();
        let url = api.api_url(&user_path(&user, &["instance"]));
        assert_eq!(
            url.as_str(),
            "http://h:8000/prefix/api/v1/users/a%20b%3F%23%25@x/instance"
        );
        let open = api.open_url(&UserId::parse("alice").unwrap(), "tok");
        assert_eq!(
            open.as_str(),
            "http://h:8000/prefix/u/alice/?berth_token=tok"
        );
    }

    #[test]
    fn tables_align_and_show_missing_as_dash() {
        let rows = vec![
            json!({"id": "node-a", "status": "up", "load": 3, "capacity": 10, "heartbeat": 9000}),
            json!({"id": "b", "status": "draining", "heartbeat": null}),
        ];
        let out = render_table(&rows, NODE_COLUMNS, 10_000);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "ID      STATUS    LOAD  CAPACITY  URL  HEARTBEAT");
        assert_eq!(lines[1], "node-a  up        3     10        -    1s ago");
        assert_eq!(lines[2], "b       draining  -     -         -    -");
    }

    #[test]
    fn api_errors_show_code_and_message() {
        let url = Url::parse("http://h/").unwrap();
        let e = api_error(
            StatusCode::NOT_FOUND,
            r#"{"error":"not_found","message":"no instance for alice"}"#,
            &url,
        );
        assert_eq!(e.to_string(), "not_found: no instance for alice");
        let e = api_error(StatusCode::BAD_GATEWAY, "upstream down", &url);
        assert!(e.to_string().contains("502"), "{e}");
    }
}
