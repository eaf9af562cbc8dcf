//! `berth demo-app`: the built-in sample program that `berth serve` runs
//! when no command is configured, and the test subject of the proxy tests.
//!
//! Every route matches on the path's *suffix*, so the app works under its
//! base path (`/u/<user>/`) whether or not the proxy strips that prefix:
//! `…/ws` echoes WebSocket messages, `…/sse?n=N` streams N events,
//! `…/bytes?n=N` streams N zero bytes, `POST …/upload` counts the body,
//! `…/headers` echoes the request's headers (what berth passed on),
//! `…/set-cookie` plays a hostile app that tries to set berth's own cookies
//! next to one of its own, `…/counter` counts the requests it has
//! answered in memory (`{"count": N, "pid": P}`: state that a hibernation
//! keeps and a restart loses), `…/ticks` is a WebSocket on which the app
//! sends a message every 200 ms (a tab that only receives; with
//! `?ping_ms=M` it also pings every M ms, as Jupyter Server does, and each
//! tick says how many pongs came back: `tick N pongs P`), and any other
//! GET is the HTML page.
//!
//! With `--echo` (or `BERTH_DEMO_ECHO=1` in its environment, which an
//! `[instance] env` entry can set), `GET …/echo` answers with what the
//! program actually received: the request line, every request header in
//! order, and its whole environment, as JSON. It is a debugging aid, and
//! the evidence berth's tests use to show that berth's credentials and the
//! cluster secret never reach a program. It shows every secret the
//! program holds, so it is off by default (`…/echo` is then the page).

use std::convert::Infallible;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::FromRequestParts;
use axum::extract::Request;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::http::{Method, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use berth_proxy::respond::html_escape;
use futures_util::StreamExt;

use crate::cli::DemoAppArgs;

/// Biggest chunk of `…/bytes`.
const CHUNK: usize = 64 * 1024;
/// SSE streams are capped so that a typo cannot keep a connection for days.
const MAX_SSE_EVENTS: u64 = 100_000;

struct Page {
    user: String,
    role: String,
    epoch: String,
    base_path: String,
    never_ready: bool,
    echo: bool,
    /// Requests to `…/counter` so far, in memory only.
    counter: std::sync::atomic::AtomicU64,
}

pub fn run(args: DemoAppArgs) -> anyhow::Result<()> {
    // One thread: the app serves one user, and must start fast.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(args))
}

async fn serve(args: DemoAppArgs) -> anyhow::Result<()> {
    let env = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let mut base_path = env("BERTH_BASE_PATH", "/");
    if !base_path.ends_with('/') {
        base_path.push('/');
    }
    let page = Arc::new(Page {
        user: env("BERTH_USER", "anonymous"),
        role: env("BERTH_ROLE", "main"),
        epoch: env("BERTH_EPOCH", "0"),
        base_path,
        never_ready: args.never_ready,
        echo: args.echo,
        counter: std::sync::atomic::AtomicU64::new(0),
    });

    let listener = tokio::net::TcpListener::bind((args.host, args.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let port = listener.local_addr()?.port();
    let host = match args.host {
        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        v4 => v4.to_string(),
    };

    if let Some(path) = &args.journal {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open journal {}", path.display()))?;
        let journal = Arc::new(std::sync::Mutex::new(Journal {
            file,
            epoch: page.epoch.clone(),
            counter: 0,
        }));
        if args.journal_on_term {
            // Installed before the first line, so a SIGTERM never finds the
            // default action (death without the last line) in place.
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .context("cannot watch SIGTERM")?;
            let journal = journal.clone();
            tokio::spawn(async move {
                term.recv().await;
                journal
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .append();
                std::process::exit(0);
            });
        }
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                journal
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .append();
            }
        });
    }

    if let Some(ms) = args.crash_after_ms {
        let code = i32::from(args.exit_code);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            eprintln!("berth-demo: crashing on purpose with exit code {code}");
            std::process::exit(code);
        });
    }

    if !args.never_ready {
        let token = random_token()?;
        let mut stdout = std::io::stdout().lock();
        // Readiness is judged on this exact line, so it must leave the pipe
        // now rather than when a buffer fills.
        writeln!(stdout, "berth-demo: http://{host}:{port}/?token={token}")
            .and_then(|()| stdout.flush())
            .context("cannot write the ready line")?;
    }

    let app = Router::new().fallback(move |req: Request| handle(page.clone(), req));
    axum::serve(listener, app)
        .await
        .context("the demo app's server failed")
}

/// The `--journal` file: `<epoch> <counter>` lines, the counter going up
/// by one per line.
struct Journal {
    file: std::fs::File,
    epoch: String,
    counter: u64,
}

impl Journal {
    /// Appends the next line, in one write so that a reader never sees half
    /// of one; a journal that cannot be written ends the program.
    fn append(&mut self) {
        self.counter += 1;
        let line = format!("{} {}\n", self.epoch, self.counter);
        if self
            .file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .is_err()
        {
            eprintln!("berth-demo: cannot write the journal");
            std::process::exit(1);
        }
    }
}

fn random_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
    Ok(hex::encode(bytes))
}

async fn handle(page: Arc<Page>, req: Request) -> Response {
    if page.never_ready {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response();
    }
    let n = query_u64(req.uri().query(), "n");
    let last = last_segment(req.uri().path(), &page.base_path).to_owned();
    match (req.method().clone(), last.as_str()) {
        (Method::GET, "ws") => websocket(req, echo).await,
        (Method::GET, "ticks") => {
            let ping_every =
                query_u64(req.uri().query(), "ping_ms").map(|ms| Duration::from_millis(ms.max(1)));
            websocket(req, move |socket| ticks(socket, ping_every)).await
        }
        (Method::GET | Method::POST, "counter") => {
            let count = page
                .counter
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1;
            let body = format!("{{\"count\":{count},\"pid\":{}}}\n", std::process::id());
            ([(header::CONTENT_TYPE, "application/json")], body).into_response()
        }
        (Method::GET, "sse") => sse(n.unwrap_or(10).min(MAX_SSE_EVENTS)),
        (Method::GET, "bytes") => zeros(n.unwrap_or(0)),
        (Method::POST, "upload") => upload(req).await,
        (Method::GET, "echo") if page.echo => echo_request(&req),
        (Method::GET, "headers") => echo_headers(&req),
        (Method::GET, "set-cookie") => set_cookies(),
        (Method::GET | Method::HEAD, _) => Html(render_page(&page)).into_response(),
        _ => StatusCode::METHOD_NOT_ALLOWED.into_response(),
    }
}

/// The route name: the path's last segment below the base path (so that a
/// user called `ws` still gets the page at `/u/ws/`).
fn last_segment<'a>(path: &'a str, base_path: &str) -> &'a str {
    if path == base_path.trim_end_matches('/') {
        return "";
    }
    let relative = path
        .strip_prefix(base_path)
        .or_else(|| path.strip_prefix('/'))
        .unwrap_or(path);
    relative.rsplit('/').next().unwrap_or_default()
}

/// The query parameter `name` as a number.
fn query_u64(query: Option<&str>, name: &str) -> Option<u64> {
    query?
        .split('&')
        .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

async fn websocket<F, Fut>(req: Request, serve: F) -> Response
where
    F: FnOnce(WebSocket) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (mut parts, _body) = req.into_parts();
    match WebSocketUpgrade::from_request_parts(&mut parts, &()).await {
        Ok(upgrade) => upgrade.on_upgrade(serve),
        Err(rejection) => rejection.into_response(),
    }
}

/// Sends `tick N` every 200 ms until the client goes away. With
/// `ping_every`, also pings at that pace and counts the pongs that come
/// back (`tick N pongs P`): the proof that a client answered them.
async fn ticks(mut socket: WebSocket, ping_every: Option<Duration>) {
    let mut every = tokio::time::interval(Duration::from_millis(200));
    // Without pings, a timer whose branch is off.
    let mut pings = tokio::time::interval(ping_every.unwrap_or(Duration::from_secs(3600)));
    pings.reset();
    let mut pongs = 0u64;
    let mut n = 0u64;
    loop {
        let sent = tokio::select! {
            received = socket.recv() => match received {
                Some(Ok(Message::Pong(_))) => {
                    pongs += 1;
                    Ok(())
                }
                Some(Ok(_)) => Ok(()),
                // Gone.
                None | Some(Err(_)) => break,
            },
            _ = every.tick() => {
                let text = match ping_every {
                    Some(_) => format!("tick {n} pongs {pongs}"),
                    None => format!("tick {n}"),
                };
                n += 1;
                socket.send(Message::Text(text.into())).await
            }
            _ = pings.tick(), if ping_every.is_some() => {
                socket.send(Message::Ping(Bytes::from_static(b"demo"))).await
            }
        };
        if sent.is_err() {
            break;
        }
    }
}

async fn echo(mut socket: WebSocket) {
    while let Some(Ok(message)) = socket.recv().await {
        let reply = match message {
            Message::Text(_) | Message::Binary(_) => message,
            Message::Close(_) => break,
            // Pings are answered by the library.
            Message::Ping(_) | Message::Pong(_) => continue,
        };
        if socket.send(reply).await.is_err() {
            break;
        }
    }
}

fn sse(n: u64) -> Response {
    let events = futures_util::stream::unfold(0u64, move |i| async move {
        if i >= n {
            return None;
        }
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let event = format!("id: {i}\ndata: event {i}\n\n");
        Some((Ok::<_, Infallible>(Bytes::from(event)), i + 1))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(events))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn zeros(n: u64) -> Response {
    let chunk = Bytes::from(vec![0u8; CHUNK]);
    let chunks = futures_util::stream::unfold(n, move |left| {
        let chunk = chunk.clone();
        async move {
            if left == 0 {
                return None;
            }
            let size = usize::try_from(left).map_or(CHUNK, |l| l.min(CHUNK));
            Some((Ok::<_, Infallible>(chunk.slice(..size)), left - size as u64))
        }
    });
    // A streamed body has no length, so hyper sends it chunked.
    Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .body(Body::from_stream(chunks))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// What the program received: the request line, the headers (in order,
/// repeats kept, values lossily decoded) and the environment.
fn echo_request(req: &Request) -> Response {
    let headers: Vec<[String; 2]> = req
        .headers()
        .iter()
        .map(|(name, value)| {
            [
                name.as_str().to_owned(),
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            ]
        })
        .collect();
    let env: std::collections::BTreeMap<String, String> = std::env::vars_os()
        .map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                v.to_string_lossy().into_owned(),
            )
        })
        .collect();
    axum::Json(serde_json::json!({
        "method": req.method().as_str(),
        "uri": req.uri().to_string(),
        "headers": headers,
        "env": env,
    }))
    .into_response()
}

fn echo_headers(req: &Request) -> Response {
    let mut text = String::new();
    for (name, value) in req.headers() {
        text.push_str(&format!(
            "{name}: {}\n",
            String::from_utf8_lossy(value.as_bytes())
        ));
    }
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response()
}

/// What an app that wants its user's berth cookie might send: berth drops
/// every one of these but `demo=1`.
fn set_cookies() -> Response {
    let mut response = "cookies set\n".into_response();
    for cookie in [
        "berth_token=planted-by-the-app; Path=/u/",
        "berth_token=planted-by-the-app; Path=/; Domain=example.test",
        "__Host-berth_token=planted-by-the-app; Path=/; Secure",
        "berth_session=planted-by-the-app; Path=/",
        "=berth_token=planted-by-the-app",
        "demo=1; Path=/",
    ] {
        response
            .headers_mut()
            .append(header::SET_COOKIE, header::HeaderValue::from_static(cookie));
    }
    response
}

async fn upload(req: Request) -> Response {
    let mut stream = req.into_body().into_data_stream();
    let mut total: u64 = 0;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(data) => total += data.len() as u64,
            Err(e) => {
                return (StatusCode::BAD_REQUEST, format!("upload failed: {e}\n")).into_response();
            }
        }
    }
    axum::Json(serde_json::json!({ "bytes": total })).into_response()
}

fn render_page(page: &Page) -> String {
    let user = html_escape(&page.user);
    let role = html_escape(&page.role);
    let epoch = html_escape(&page.epoch);
    let base = html_escape(&page.base_path);
    format!(
        r#"<!doctype html>
<html>
<head>
<meta charset="utf-8">
<title>berth demo — {user}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 40rem; margin: 2rem auto; }}
#log {{ background: #f4f4f4; padding: .5rem; min-height: 6rem; white-space: pre-wrap; }}
</style>
</head>
<body data-base="{base}">
<h1>berth demo app</h1>
<p>user <b id="user">{user}</b>, role <b>{role}</b>, epoch <b>{epoch}</b></p>
<form id="f"><input id="msg" value="hello" autocomplete="off"> <button>send over WebSocket</button></form>
<div id="log"></div>
<script>
const log = (s) => {{ document.getElementById('log').textContent += s + '\n'; }};
const url = new URL(document.body.dataset.base + 'ws', location.href);
url.protocol = location.protocol === 'https:' ? 'wss:' : 'ws:';
const ws = new WebSocket(url);
ws.onopen = () => log('connected to ' + url);
ws.onmessage = (e) => log('echo: ' + e.data);
ws.onclose = () => log('closed');
document.getElementById('f').onsubmit = (e) => {{
  e.preventDefault();
  ws.send(document.getElementById('msg').value);
}};
</script>
</body>
</html>
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_escapes_the_user() {
        let page = Page {
            user: "<b>&\"x'".into(),
            role: "main".into(),
            epoch: "3".into(),
            base_path: "/u/x/".into(),
            never_ready: false,
            echo: false,
            counter: std::sync::atomic::AtomicU64::new(0),
        };
        let html = render_page(&page);
        assert!(html.contains("&lt;b&gt;&amp;&quot;x&#39;"));
        assert!(!html.contains("<b>&"));
    }

    #[test]
    fn routes_work_with_and_without_the_prefix() {
        assert_eq!(last_segment("/u/ws/", "/u/ws/"), "");
        assert_eq!(last_segment("/u/ws", "/u/ws/"), "");
        assert_eq!(last_segment("/u/ws/ws", "/u/ws/"), "ws");
        assert_eq!(last_segment("/ws", "/u/ws/"), "ws");
        assert_eq!(last_segment("/", "/u/a/"), "");
        assert_eq!(last_segment("/u/a/x/sse", "/u/a/"), "sse");
        assert_eq!(last_segment("/ws", "/"), "ws");
    }

    #[test]
    fn n_is_read_from_the_query() {
        assert_eq!(query_u64(Some("a=1&n=42"), "n"), Some(42));
        assert_eq!(query_u64(Some("n=x"), "n"), None);
        assert_eq!(query_u64(None, "n"), None);
        assert_eq!(query_u64(Some("nn=3&ping_ms=200"), "n"), None);
        assert_eq!(query_u64(Some("nn=3&ping_ms=200"), "ping_ms"), Some(200));
    }
}
