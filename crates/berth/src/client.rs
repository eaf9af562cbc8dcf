//! The client commands: thin calls to the HTTP API.
//!
//! Answers are shown for people ([`render`]: lists as aligned tables,
//! coloured on a terminal; records as short summaries), or with `--json`
//! as the API's JSON, unchanged. Long waits show their progress on a
//! terminal ([`progress`]). An API error becomes `berth: <code>:
//! <message>` and exit code 1.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use berth_core::egress::EgressPolicy;
use berth_core::{InstanceStatus, LaunchRequest, ProbeReport, Role, UserId};
use futures_util::{Stream, StreamExt};
use reqwest::{Method, StatusCode, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::cli::{ClientArgs, Command};
use crate::escape;
use crate::progress;
use crate::render::{self, Palette};
use crate::sse::STAGE_EVENT;
use crate::wire::operation::{self as op, Operation, Public};
use crate::wire::{
    InstanceAnswer, InstanceList, LaunchAnswer, LeaseList, LogLines, MintRequest, MintedToken,
    NodeList, RestartAll, Routing, StageReport, TokenList, UserEgress, UserStatus,
};

/// An error answer from the API, displayed as `<code>: <message>`.
#[derive(Debug, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub code: String,
    pub message: String,
}

/// Runs one client command; its exit code says whether it did what it
/// was asked (a probe that failed, a restart-all with a failure: 1).
pub async fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Status { user, client } => status(user.as_deref(), &client).await?,
        Command::Start {
            user,
            folder,
            patch_file,
            force,
            no_wait,
            client,
        } => {
            let launch = Launch {
                folder,
                patch_file,
                force,
                no_wait,
            };
            start(&user, launch, &client).await?;
        }
        Command::Stop { user, client } => stop(&user, &client).await?,
        Command::Hibernate { user, client } => hibernation(&user, &client, &op::HIBERNATE).await?,
        Command::Resume { user, client } => hibernation(&user, &client, &op::RESUME).await?,
        Command::Restart { user, client } => restart(&user, &client).await?,
        Command::Probe { user, client } => return probe(&user, &client).await,
        Command::Logs {
            user,
            follow,
            tail,
            client,
        } => {
            let user = parse_user(&user)?;
            let (api, out) = Api::with_output(&client)?;
            logs(&api, &user, tail, follow, out.json).await?;
        }
        Command::Ls {
            status,
            node,
            client,
        } => list(status.as_deref(), node.as_deref(), &client).await?,
        Command::Nodes { client } => table::<NodeList>(&client, &["nodes"], &[]).await?,
        Command::Leases { expired, client } => {
            let query: &[(&str, &str)] = if expired { &[("expired", "true")] } else { &[] };
            table::<LeaseList>(&client, &["leases"], query).await?;
        }
        Command::Takeover { user, client } => takeover(&user, &client).await?,
        Command::Egress {
            user,
            mode,
            allow,
            clear: _,
            client,
        } => {
            let policy = mode.map(|mode| EgressPolicy { mode, allow });
            egress(&user, policy, &client).await?;
        }
        Command::RestartAll { client } => return restart_all(&client).await,
        Command::Token {
            user,
            list,
            revoke,
            ttl,
            client,
        } => {
            let action = match (list, revoke) {
                (true, _) => TokenAction::List,
                (false, Some(id)) => TokenAction::Revoke(id),
                (false, None) => TokenAction::Mint(ttl),
            };
            token(&user, action, &client).await?;
        }
        Command::Open {
            user,
            ttl,
            no_browser,
            client,
        } => open(&user, ttl, no_browser, &client).await?,
        Command::Serve(_) | Command::DemoApp(_) | Command::Config { .. } => {
            bail!("internal: not a client command")
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `berth status [USER]`: one user's record, or every instance.
async fn status(user: Option<&str>, client: &ClientArgs) -> anyhow::Result<()> {
    let (api, out) = Api::with_output(client)?;
    match user {
        Some(user) => {
            let user = parse_user(user)?;
            let answer = api.call(&op::STATUS, &user, &[], None).await?;
            out.show(&answer, |status: &UserStatus, p| {
                render::user_status(status, berth_core::unix_millis_now(), p)
            });
        }
        None => {
            let body = api.get(&["instances"], &[]).await?;
            out.table::<InstanceList>(&body);
        }
    }
    Ok(())
}

/// What `berth start` asks of a launch.
struct Launch {
    folder: Option<String>,
    patch_file: Option<std::path::PathBuf>,
    force: bool,
    no_wait: bool,
}

/// `berth start USER`: launches, showing the launch's stages while it
/// waits (unless `--no-wait`).
async fn start(user: &str, launch: Launch, client: &ClientArgs) -> anyhow::Result<()> {
    let user = parse_user(user)?;
    let patch = launch
        .patch_file
        .map(|file| {
            std::fs::read_to_string(&file)
                .with_context(|| format!("cannot read patch file {}", file.display()))
        })
        .transpose()?;
    let body = serde_json::to_value(LaunchRequest {
        folder: launch.folder,
        patch,
        force: launch.force,
    })?;
    let query: &[(&str, &str)] = if launch.no_wait {
        &[("wait", "false")]
    } else {
        &[]
    };
    let (api, out) = Api::with_output(client)?;
    let request = api.call(&op::LAUNCH, &user, query, Some(body));
    let label = format!("starting {}", user.as_str());
    let show = !launch.no_wait && progress::wanted();
    let answer = progress::while_waiting(show, &label, request, stages(&api, &user)).await?;
    out.show(&answer, |a: &LaunchAnswer, p| {
        render::launched(a, "started", p)
    });
    Ok(())
}

/// What `berth stop --json` prints: the API answers a stop with no body,
/// and README documents this in its place.
#[derive(Debug, Serialize)]
struct Stopped<'a> {
    user: &'a UserId,
    stopped: bool,
}

/// `berth stop USER`.
async fn stop(user: &str, client: &ClientArgs) -> anyhow::Result<()> {
    let user = parse_user(user)?;
    let (api, out) = Api::with_output(client)?;
    api.call(&op::STOP, &user, &[], None).await?;
    let answer = serde_json::to_value(Stopped {
        user: &user,
        stopped: true,
    })?;
    out.show_read(&answer, &user, |user, _| {
        format!("stopped {}\n", user.as_str())
    });
    Ok(())
}

/// `berth restart USER`, showing the new start's stages.
async fn restart(user: &str, client: &ClientArgs) -> anyhow::Result<()> {
    let user = parse_user(user)?;
    let (api, out) = Api::with_output(client)?;
    let answer = instance_action(&api, &user, &op::RESTART, "restarting").await?;
    out.show(&answer, |a: &LaunchAnswer, p| {
        render::launched(a, "restarted", p)
    });
    Ok(())
}

/// `berth probe USER`: exit code 1 when the instance did not stay up.
async fn probe(user: &str, client: &ClientArgs) -> anyhow::Result<ExitCode> {
    let user = parse_user(user)?;
    let (api, out) = Api::with_output(client)?;
    let answer = instance_action(&api, &user, &op::PROBE, "probing").await?;
    let report: ProbeReport = typed(&answer)?;
    out.show_read(&answer, &report, |r, p| render::probe(user.as_str(), r, p));
    Ok(if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Calls `operation` on `user` and waits for the answer, showing the
/// instance's stages on a terminal as `<doing> <user>`.
async fn instance_action<I>(
    api: &Api,
    user: &UserId,
    operation: &Operation<Public, I>,
    doing: &str,
) -> anyhow::Result<Value> {
    let label = format!("{doing} {}", user.as_str());
    progress::while_waiting(
        progress::wanted(),
        &label,
        api.call(operation, user, &[], None),
        stages(api, user),
    )
    .await
}

/// `berth ls`: every instance, filtered by status and node.
async fn list(status: Option<&str>, node: Option<&str>, client: &ClientArgs) -> anyhow::Result<()> {
    let mut query = Vec::new();
    if let Some(status) = status {
        query.push(("status", status));
    }
    if let Some(node) = node {
        query.push(("node", node));
    }
    table::<InstanceList>(client, &["instances"], &query).await
}

/// Shows the answer to `GET path`, a list `L`, as a table.
async fn table<L: render::Listing + DeserializeOwned>(
    client: &ClientArgs,
    path: &[&str],
    query: &[(&str, &str)],
) -> anyhow::Result<()> {
    let (api, out) = Api::with_output(client)?;
    let body = api.get(path, query).await?;
    out.table::<L>(&body);
    Ok(())
}

/// `berth takeover USER`: an expired lease, claimed for this node.
async fn takeover(user: &str, client: &ClientArgs) -> anyhow::Result<()> {
    let user = parse_user(user)?;
    let (api, out) = Api::with_output(client)?;
    let answer = api.post(&["leases", user.as_str(), "takeover"]).await?;
    out.show(&answer, |a: &LaunchAnswer, p| {
        render::launched(a, "taken over", p)
    });
    Ok(())
}

/// `berth restart-all`: exit code 1 when any restart failed.
async fn restart_all(client: &ClientArgs) -> anyhow::Result<ExitCode> {
    let (api, out) = Api::with_output(client)?;
    let request = api.post(&["instances", "restart-all"]);
    let answer = progress::while_waiting(
        progress::wanted(),
        "restarting every instance",
        request,
        cluster_counts(&api),
    )
    .await?;
    let results: RestartAll = typed(&answer)?;
    out.show_read(&answer, &results, render::restart_all);
    Ok(if results.any_failed() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// What `berth token` does.
enum TokenAction {
    List,
    Revoke(String),
    Mint(Option<u64>),
}

/// `berth token USER`: lists, revokes or mints a user's API tokens.
async fn token(user: &str, action: TokenAction, client: &ClientArgs) -> anyhow::Result<()> {
    let user = parse_user(user)?;
    let (api, out) = Api::with_output(client)?;
    match action {
        TokenAction::List => {
            let body = api.call(&op::LIST_TOKENS, &user, &[], None).await?;
            out.table::<TokenList>(&body);
        }
        TokenAction::Revoke(id) => {
            let answer = api.revoke_token(&user, &id).await?;
            out.show(&answer, render::revoked);
        }
        TokenAction::Mint(ttl) => {
            let (answer, minted) = mint_link(&api, &user, ttl).await?;
            out.show_read(&answer, &minted, |m, _| {
                render::minted(m, berth_core::unix_millis_now())
            });
        }
    }
    Ok(())
}

/// `berth open USER`: a sign-in link to the user's app, opened in a
/// browser unless `--no-browser` or `--json`.
async fn open(user: &str, ttl: u64, no_browser: bool, client: &ClientArgs) -> anyhow::Result<()> {
    let user = parse_user(user)?;
    let (api, out) = Api::with_output(client)?;
    let (answer, minted) = mint_link(&api, &user, Some(ttl)).await?;
    out.show_read(&answer, &minted, |m, _| {
        render::opened(m, berth_core::unix_millis_now())
    });
    if !no_browser && !client.json {
        open_in_browser(&minted.url);
    }
    Ok(())
}

/// Mints a token for `user`: the API's answer with `url` the link that
/// opens their app once with it, as shown and as read.
async fn mint_link(
    api: &Api,
    user: &UserId,
    ttl: Option<u64>,
) -> anyhow::Result<(Value, MintedToken)> {
    let body = ttl
        .map(|secs| serde_json::to_value(MintRequest { ttl_s: Some(secs) }))
        .transpose()?;
    let mut answer = api.call(&op::MINT_TOKEN, user, &[], body).await?;
    let mut minted: MintedToken = typed(&answer)?;
    // In path mode the link is this client's URL plus the base path (it
    // may carry a prefix the server cannot know); in host mode only the
    // server knows the user's host name.
    if minted.routing != Routing::Host {
        minted.url = api.open_url(user, &minted.token).to_string();
        if let Value::Object(map) = &mut answer {
            map.insert("url".into(), Value::String(minted.url.clone()));
        }
    }
    Ok((answer, minted))
}

/// Opens `url` in the desktop's browser, where there is a desktop (a
/// display to show it on); elsewhere printing the link was all there was
/// to do. A browser that fails to start is reported, not fatal: the link
/// is printed already.
fn open_in_browser(url: &str) {
    let desktop = ["DISPLAY", "WAYLAND_DISPLAY"]
        .iter()
        .any(|var| std::env::var_os(var).is_some_and(|v| !v.is_empty()));
    let opener = if cfg!(target_os = "macos") {
        "open"
    } else if desktop {
        "xdg-open"
    } else {
        return;
    };
    let started = std::process::Command::new(opener)
        .arg(url)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
    if let Err(e) = started {
        eprintln!("berth: could not start {opener} to open the link: {e}");
    }
}

/// How answers are printed: the API's JSON (`--json`), or for people.
#[derive(Debug, Clone, Copy)]
struct Output {
    json: bool,
    palette: Palette,
}

impl Output {
    fn new(args: &ClientArgs) -> Self {
        Self {
            json: args.json,
            palette: Palette::for_stdout(),
        }
    }

    /// `answer` as JSON, or read as its type `T` and rendered by `human`.
    fn show<T: DeserializeOwned>(self, answer: &Value, human: impl FnOnce(&T, Palette) -> String) {
        print!("{}", self.render(answer, human));
    }

    /// What [`Self::show`] prints. An answer that does not read as `T` (a
    /// newer or older server's) is shown as its JSON rather than not at
    /// all.
    fn render<T: DeserializeOwned>(
        self,
        answer: &Value,
        human: impl FnOnce(&T, Palette) -> String,
    ) -> String {
        if self.json {
            return json_text(answer);
        }
        match T::deserialize(answer) {
            Ok(read) => human(&read, self.palette),
            Err(_) => json_text(answer),
        }
    }

    /// `answer` as JSON, or `read` (what the caller read from it) as
    /// `human` renders it.
    fn show_read<T>(self, answer: &Value, read: &T, human: impl FnOnce(&T, Palette) -> String) {
        if self.json {
            print_json(answer);
        } else {
            print!("{}", human(read, self.palette));
        }
    }

    /// A list answer as a table (or JSON).
    fn table<L: render::Listing + DeserializeOwned>(self, body: &Value) {
        self.show(body, |list: &L, p| {
            render::table(list, berth_core::unix_millis_now(), p)
        });
    }
}

/// The stages of `user`'s instance as the progress stream reports them,
/// as words for the progress line. The stream is asked for the next spawn
/// (`?next=true`), so one opened before the launch begins waits for it;
/// it is opened again when it ends early (a restart's stop ends it).
fn stages<'a>(api: &'a Api, user: &'a UserId) -> impl Stream<Item = String> + 'a {
    let path = user_path(user, &op::PROGRESS.public.segments());
    futures_util::stream::unfold(None, move |events| {
        let path = path.clone();
        async move {
            let mut events: Option<futures_util::stream::BoxStream<'static, _>> = events;
            loop {
                if let Some(stream) = events.as_mut() {
                    match stream.next().await {
                        Some(Ok(crate::sse::SseEvent { event, data })) if event == STAGE_EVENT => {
                            // A report this client cannot read says nothing.
                            let Ok(stage) = serde_json::from_str::<StageReport>(&data) else {
                                continue;
                            };
                            if stage.status != StageReport::NONE {
                                return Some((stage_words(&stage), events));
                            }
                        }
                        Some(Ok(_)) => continue,
                        Some(Err(_)) | None => events = None,
                    }
                }
                // Not yet launched, or the stream ended: look again shortly.
                tokio::time::sleep(Duration::from_millis(300)).await;
                if let Ok(response) = api.stream(&path, &[("next", "true")]).await {
                    events = Some(crate::sse::events(response.bytes_stream()).boxed());
                }
            }
        }
    })
}

/// `queued`, `spawning`, `waiting for ready`, `ready`, `failed: <reason>`
/// (an older node's stream without stages: its status).
fn stage_words(stage: &StageReport) -> String {
    let mut words = match &stage.stage {
        Some(name) => name.replace('_', " "),
        None => stage.status.clone(),
    };
    if let Some(message) = stage.message.as_deref().filter(|m| !m.is_empty()) {
        words.push_str(": ");
        words.push_str(message);
    }
    words
}

/// How many mains of the cluster run and how many start, from the admin
/// event stream (`/api/v1/events`), for restart-all's progress line. No
/// news when the stream cannot be had.
fn cluster_counts(api: &Api) -> impl Stream<Item = String> + '_ {
    futures_util::stream::once(api.stream(&["events"], &[]))
        .filter_map(|response| async move { response.ok() })
        .flat_map(|response| crate::sse::events(response.bytes_stream()))
        .filter_map(|event| async move {
            let event = event.ok()?;
            if event.event != "snapshot" {
                return None;
            }
            // A snapshot carries the instances as `GET /instances` does.
            let snapshot: InstanceList = serde_json::from_str(&event.data).ok()?;
            let mains = snapshot.instances.iter().filter(|i| i.role == Role::Main);
            let (mut ready, mut starting) = (0, 0);
            for main in mains {
                match (main.status, main.ready) {
                    (InstanceStatus::Running, true) => ready += 1,
                    (
                        InstanceStatus::Starting
                        | InstanceStatus::Running
                        | InstanceStatus::Crashed,
                        _,
                    ) => {
                        starting += 1;
                    }
                    _ => {}
                }
            }
            Some(format!("{ready} running, {starting} starting"))
        })
}

fn parse_user(raw: &str) -> anyhow::Result<UserId> {
    UserId::parse(raw).map_err(|e| anyhow!("invalid user id {raw:?}: {e}"))
}

/// `hibernate` or `resume` (`operation`) of `user`; shows the status it
/// left.
async fn hibernation<I>(
    user: &str,
    client: &ClientArgs,
    operation: &Operation<Public, I>,
) -> anyhow::Result<()> {
    let user = parse_user(user)?;
    let (api, out) = Api::with_output(client)?;
    let answer = api.call(operation, &user, &[], None).await?;
    out.show(&answer, |changed: &InstanceAnswer, _| {
        format!("{} is {}\n", user.as_str(), changed.instance.status)
    });
    Ok(())
}

/// `berth egress USER`: sets the user's own policy, or (`None`) gives
/// back the node's, and prints what they now have.
async fn egress(
    user: &str,
    policy: Option<EgressPolicy>,
    client: &ClientArgs,
) -> anyhow::Result<()> {
    let user = parse_user(user)?;
    let (api, out) = Api::with_output(client)?;
    let answer = match policy {
        Some(policy) => {
            let body = serde_json::to_value(&policy).context("cannot encode the policy")?;
            api.call(&op::SET_EGRESS, &user, &[], Some(body)).await?
        }
        None => api.call(&op::CLEAR_EGRESS, &user, &[], None).await?,
    };
    out.show(&answer, |changed: &UserEgress, _| {
        render::user_egress(changed)
    });
    Ok(())
}

/// An answer read as the API's type for it.
fn typed<T: DeserializeOwned>(answer: &Value) -> anyhow::Result<T> {
    T::deserialize(answer).map_err(|e| {
        let snippet: String = answer.to_string().chars().take(200).collect();
        anyhow!(
            "the API answered something this client cannot read ({e}): {}",
            escape::text(&snippet)
        )
    })
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
    /// The client of `args`, and how to print its answers.
    fn with_output(args: &ClientArgs) -> anyhow::Result<(Self, Output)> {
        Ok((Self::new(args)?, Output::new(args)))
    }

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

    /// `operation`'s public route about `user`, with its method.
    async fn call<I>(
        &self,
        operation: &Operation<Public, I>,
        user: &UserId,
        query: &[(&str, &str)],
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let public = &operation.public;
        let path = user_path(user, &public.segments());
        self.send(public.verb.method(), &path, query, body).await
    }

    /// `DELETE …/tokens/{id}`: the declared route with the id in its place.
    async fn revoke_token(&self, user: &UserId, id: &str) -> anyhow::Result<Value> {
        let public = &op::REVOKE_TOKEN.public;
        let segments: Vec<&str> = public
            .segments()
            .into_iter()
            .map(|segment| if segment == "{id}" { id } else { segment })
            .collect();
        let path = user_path(user, &segments);
        self.send(public.verb.method(), &path, &[], None).await
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

async fn logs(
    api: &Api,
    user: &UserId,
    tail: usize,
    follow: bool,
    json: bool,
) -> anyhow::Result<()> {
    let tail_text = tail.to_string();
    let path = user_path(user, &op::LOGS.public.segments());
    if !follow {
        let answer = api
            .call(&op::LOGS, user, &[("tail", tail_text.as_str())], None)
            .await?;
        if json {
            print_json(&answer);
        } else {
            for line in typed::<LogLines>(&answer)?.lines {
                println!("{}", escape::text(&line));
            }
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
        // Each line is one JSON string; a line that is not is shown as it
        // came, made safe like any other.
        let line = serde_json::from_str::<String>(&event.data).unwrap_or(event.data);
        if json {
            println!("{}", escape::compact_json(&Value::String(line)));
        } else {
            println!("{}", escape::text(&line));
        }
    }
    Ok(())
}

fn print_json(value: &Value) {
    print!("{}", json_text(value));
}

/// `value` as pretty JSON on its own line, safe to print.
fn json_text(value: &Value) -> String {
    format!("{}\n", escape::pretty_json(value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn args(url: &str) -> ClientArgs {
        ClientArgs {
            url: url.to_owned(),
            token: Some("t".to_owned()),
            data_dir: PathBuf::from("/nonexistent"),
            json: false,
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
    fn answers_are_read_for_people_and_passed_through_as_json() {
        let people = Output {
            json: false,
            palette: Palette { colour: false },
        };
        let script = Output {
            json: true,
            ..people
        };
        let probe = |r: &ProbeReport, p| render::probe("carol", r, p);
        // A field this client does not know rides along in --json.
        let answer = serde_json::json!({"ok": true, "reason": "", "new": "\u{9b}"});
        assert_eq!(people.render(&answer, probe), "probe carol: ok\n");
        assert_eq!(script.render(&answer, probe), json_text(&answer));
        assert!(json_text(&answer).contains("\"new\": \"\\u009b\""));
        // One it cannot read is shown as it came (made safe), not refused.
        let unreadable = serde_json::json!({"ok": "maybe", "reason": "\u{1b}[2J"});
        let shown = people.render(&unreadable, probe);
        assert_eq!(shown, json_text(&unreadable));
        assert!(shown.contains("\\u001b[2J"), "{shown}");
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
