//! The command line.

use std::path::PathBuf;

use berth_core::egress::{Destination, EgressMode};
use clap::{Args, Parser, Subcommand};

use crate::config::Overrides;

#[derive(Debug, Parser)]
#[command(
    name = "berth",
    version,
    about = "Runs exactly one instance of a program per user and proxies each user's traffic to it."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a node: the API, the supervisor and the proxy.
    Serve(ServeArgs),
    /// The built-in sample program (an HTTP page with a WebSocket echo).
    DemoApp(DemoAppArgs),
    /// Show one user's instance, or all instances.
    Status {
        user: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Start a user's instance (waits until it is ready).
    Start {
        user: String,
        /// Working directory, relative to the user's data root.
        #[arg(long)]
        folder: Option<String>,
        /// File whose content is the instance's patch.
        #[arg(long, value_name = "FILE")]
        patch_file: Option<PathBuf>,
        /// Start even if the crash breaker is open.
        #[arg(long)]
        force: bool,
        /// Return as soon as the instance is launched.
        #[arg(long)]
        no_wait: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Stop a user's instance.
    Stop {
        user: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Hibernate a user's running instance: freeze it with its memory intact.
    Hibernate {
        user: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Resume a user's hibernated instance.
    Resume {
        user: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Restart a user's instance.
    Restart {
        user: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Restart a user's instance and check that it stays up (exit 1 if not).
    Probe {
        user: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show the last lines of a user's instance output.
    Logs {
        user: String,
        /// Keep following: print each new line as the instance writes it
        /// (one streamed request to the node that runs the user), until
        /// interrupted.
        #[arg(short, long)]
        follow: bool,
        #[arg(long, default_value_t = 100)]
        tail: usize,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List instances.
    Ls {
        /// Only instances in this status (e.g. running, starting, failed).
        #[arg(long)]
        status: Option<String>,
        /// Only instances on this node.
        #[arg(long)]
        node: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List the cluster's nodes.
    Nodes {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List leases.
    Leases {
        /// Only leases that ran out without being released.
        #[arg(long)]
        expired: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Give a user an egress policy of their own, applied to their running
    /// instance from its next connection on; or, with --clear, the node's
    /// again. Prints the policy the user now has.
    Egress {
        user: String,
        /// `allow_all` (the internet, nothing private), `deny_all` or
        /// `allowlist` (only what --allow names).
        #[arg(long, required_unless_present = "clear", value_parser = parse_egress_mode)]
        mode: Option<EgressMode>,
        /// A network (`10.8.0.0/24`, `10.8.0.5:5432`) or, with a confining
        /// mode, a domain name (`pypi.org`, `*.github.com:22`); repeatable.
        #[arg(long = "allow", value_name = "DESTINATION")]
        allow: Vec<Destination>,
        /// Give the user the node's policy again.
        #[arg(long, conflicts_with_all = ["mode", "allow"])]
        clear: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Take over a user's expired lease onto the node behind --url.
    Takeover {
        user: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Restart every running instance (exit 1 if any failed).
    RestartAll {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Mint a token for a user and print a URL that opens their app (the
    /// way for an admin to open it too); or list or revoke their tokens.
    Token {
        user: String,
        /// List the user's live tokens: id, created, expires, last used.
        #[arg(long, conflicts_with_all = ["revoke", "ttl"])]
        list: bool,
        /// Revoke the token with this id, and every token minted with it.
        #[arg(long, value_name = "ID", conflicts_with = "ttl")]
        revoke: Option<String>,
        /// Let the new token live at most this many seconds (default and
        /// upper bound: the server's [auth] user_token_ttl_s).
        #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
        ttl: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Mint a short-lived link that opens a user's app in a browser, print
    /// it, and open it where there is a desktop browser.
    Open {
        user: String,
        /// How long the link (and the browser session it starts) lives.
        #[arg(long, value_name = "SECS", default_value_t = 3600,
              value_parser = clap::value_parser!(u64).range(1..))]
        ttl: u64,
        /// Only print the link.
        #[arg(long)]
        no_browser: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Configuration tools.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Parse and validate a config file (the environment is not consulted).
    Check {
        file: PathBuf,
        /// Print `{"file", "ok", "error"?}` instead of a sentence.
        #[arg(long)]
        json: bool,
    },
}

/// `berth serve`. The flags' environment variables are read by the config
/// layer, so that the order is flags > environment > file > defaults.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// TOML config file.
    #[arg(long, value_name = "FILE", env = "BERTH_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on [env: BERTH_LISTEN] [default: 127.0.0.1:8000].
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Directory for all state [env: BERTH_DATA_DIR] [default: ./berth-data].
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// sqlite://… or postgres://…, without a password (the command line is
    /// world-readable; use BERTH_STORE or BERTH_STORE_FILE for one) [env:
    /// BERTH_STORE] [default: sqlite://<data-dir>/berth.db].
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// This node's id [env: BERTH_NODE_ID] [default: the host name].
    #[arg(long, value_name = "ID")]
    pub node_id: Option<String>,
    /// How other nodes reach this one [env: BERTH_ADVERTISE_URL].
    #[arg(long, value_name = "URL")]
    pub advertise: Option<String>,
    /// Log lines as text or as JSON objects, one per line
    /// [env: BERTH_LOG_FORMAT] [default: text].
    #[arg(long, value_name = "FORMAT", value_parser = ["text", "json"])]
    pub log_format: Option<String>,
}

impl ServeArgs {
    pub fn overrides(&self) -> Overrides {
        Overrides {
            listen: self.listen.clone(),
            data_dir: self.data_dir.clone(),
            store: self.store.clone(),
            node_id: self.node_id.clone(),
            advertise_url: self.advertise.clone(),
            log_format: self.log_format.clone(),
        }
    }
}

#[derive(Debug, Args)]
pub struct DemoAppArgs {
    /// Port to listen on.
    #[arg(long)]
    pub port: u16,
    /// Address to listen on: loopback on a host (berth proxies from the
    /// same machine), `0.0.0.0` in a pod (berth reaches it over the pod
    /// network).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// Exit after this many milliseconds (for crash tests).
    #[arg(long, value_name = "MS")]
    pub crash_after_ms: Option<u64>,
    /// Exit code used by --crash-after-ms.
    #[arg(long, default_value_t = 1)]
    pub exit_code: u8,
    /// Listen but never print the ready line, and answer 503.
    #[arg(long)]
    pub never_ready: bool,
    /// Append "<BERTH_EPOCH> <counter>" to this file once a second.
    #[arg(long, value_name = "FILE")]
    pub journal: Option<PathBuf>,
    /// Debugging aid: answer `GET …/echo` with the request line, the
    /// request headers and the whole environment as JSON. Shows every
    /// secret the program was given, so it is off unless asked for.
    #[arg(long, env = "BERTH_DEMO_ECHO", value_parser = clap::builder::BoolishValueParser::new())]
    pub echo: bool,
    /// On SIGTERM, append one more journal line before exiting 0: a program
    /// that flushes its state as it stops (for the fencing tests).
    #[arg(long, requires = "journal")]
    pub journal_on_term: bool,
}

/// Where the API is and how to authenticate to it.
#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// berth's base URL.
    #[arg(long, env = "BERTH_URL", default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// API token [default: the content of <data-dir>/admin.token].
    #[arg(long, env = "BERTH_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Where to find admin.token when no token is given.
    #[arg(long, env = "BERTH_DATA_DIR", default_value = "./berth-data")]
    pub data_dir: PathBuf,
    /// Print the API's answer as JSON instead of a table or summary
    /// (`logs -f`: one JSON string per line).
    #[arg(long)]
    pub json: bool,
}

/// An egress mode as the API and the config spell it.
fn parse_egress_mode(text: &str) -> Result<EgressMode, String> {
    serde_json::from_value(serde_json::Value::String(text.to_owned()))
        .map_err(|_| format!("{text:?} is not allow_all, deny_all or allowlist"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    /// Every command that prints an answer takes `--json`: the client
    /// commands and `config check`. (`serve` has `--log-format json`;
    /// `demo-app` prints for its own launcher.)
    #[test]
    fn every_command_takes_json() {
        let cli = Cli::command();
        let mut checked = 0;
        let mut commands: Vec<&clap::Command> = cli.get_subcommands().collect();
        while let Some(command) = commands.pop() {
            if command.has_subcommands() {
                commands.extend(command.get_subcommands());
                continue;
            }
            if matches!(command.get_name(), "serve" | "demo-app") {
                continue;
            }
            assert!(
                command
                    .get_arguments()
                    .any(|a| a.get_long() == Some("json")),
                "berth {} has no --json",
                command.get_name()
            );
            checked += 1;
        }
        assert_eq!(checked, 17, "the sixteen client commands and config check");
        let serve = cli.find_subcommand("serve").unwrap();
        assert!(
            serve
                .get_arguments()
                .any(|a| a.get_long() == Some("log-format"))
        );
    }
}
