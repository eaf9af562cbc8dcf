//! The `berth` binary: `berth serve`, the built-in `demo-app`, the client
//! commands, and the hidden `berth shim`, the zygote that forks the shim
//! supervising each instance.

mod cli;
mod client;
mod config;
mod demo_app;
mod serve;
mod sse;

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;

use crate::cli::{Cli, Command, ConfigCommand, ServeArgs};
use crate::config::Config;

fn main() -> ExitCode {
    // The zygote is dispatched before any argument parsing or runtime setup:
    // it must stay single-threaded, since it forks (see berth_local::shim).
    if std::env::args_os().nth(1).is_some_and(|a| a == "shim") {
        let code = berth_local::shim::run();
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    // Usage errors exit with 2 here, from clap.
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("berth: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve(args) => serve(&args).map(|()| ExitCode::SUCCESS),
        Command::DemoApp(args) => demo_app::run(args).map(|()| ExitCode::SUCCESS),
        Command::Config {
            command: ConfigCommand::Check { file },
        } => {
            let config = Config::from_file(&file)?;
            config.validate()?;
            println!("{}: ok", file.display());
            Ok(ExitCode::SUCCESS)
        }
        command => {
            // Client commands do a few sequential requests: one thread is
            // plenty and starts faster.
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("cannot start the async runtime")?;
            runtime.block_on(client::run(command))
        }
    }
}

fn serve(args: &ServeArgs) -> anyhow::Result<()> {
    let mut config = Config::load(args.config.as_deref())?;
    config.apply_overrides(&args.overrides());
    config.validate()?;
    init_tracing(&config.log_format)?;

    let mut builder = tokio::runtime::Builder::new_multi_thread();
    // Only `#[tokio::main]` reads this variable; the builder does not.
    if let Some(threads) = worker_threads_from_env()? {
        builder.worker_threads(threads);
    }
    let runtime = builder
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve::run(config))
}

fn worker_threads_from_env() -> anyhow::Result<Option<usize>> {
    match std::env::var("TOKIO_WORKER_THREADS") {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => anyhow::bail!("TOKIO_WORKER_THREADS={v:?} is not a positive number"),
        },
        Err(_) => Ok(None),
    }
}

fn init_tracing(log_format: &str) -> anyhow::Result<()> {
    use tracing_subscriber::EnvFilter;
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => EnvFilter::try_new(&spec)
            .with_context(|| format!("RUST_LOG={spec:?} is not a valid filter"))?,
        _ => EnvFilter::new("info"),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = if log_format == "json" {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    result.map_err(|e| anyhow::anyhow!("cannot set up logging: {e}"))
}
