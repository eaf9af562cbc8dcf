//! The `berth` binary: `berth serve`, the built-in `demo-app`, the client
//! commands, and the hidden `berth shim`, berth's helper processes: the
//! zygote that forks the shim supervising each instance, and the guard's
//! `nft` runner.

mod cli;
mod client;
mod config;
mod demo_app;
mod escape;
mod progress;
mod render;
mod serve;
mod sse;
mod wire;

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
            // Client errors carry the server's messages: made safe to show.
            eprintln!("berth: {}", escape::text(&format!("{e:#}")));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve(args) => serve(&args).map(|()| ExitCode::SUCCESS),
        Command::DemoApp(args) => demo_app::run(args).map(|()| ExitCode::SUCCESS),
        Command::Config {
            command: ConfigCommand::Check { file, json },
        } => {
            let checked = Config::from_file(&file).and_then(|mut config| {
                config.read_secret_files()?;
                config.validate().map(|()| config)
            });
            // A warning is not an error: on stderr, with the answer as usual.
            if let Ok(config) = &checked {
                for warning in startup_warnings(config) {
                    eprintln!("berth: warning: {warning}");
                }
            }
            let checked = checked.map(drop);
            if !json {
                checked?;
                println!("{}: ok", file.display());
                return Ok(ExitCode::SUCCESS);
            }
            let mut answer = serde_json::json!({
                "file": file.to_string_lossy(),
                "ok": checked.is_ok(),
            });
            if let Err(e) = &checked {
                answer["error"] = serde_json::Value::String(e.to_string());
            }
            println!("{answer:#}");
            Ok(if checked.is_ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
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
    // Everything berth creates (database, WAL, token, logs, state files) is
    // its own: 0600 and 0700 unless it says otherwise.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    let mut config = Config::load(args.config.as_deref())?;
    // Read into the config; from here on they need not be in the
    // environment, where /proc/<pid>/environ would show them (the store
    // URL may carry the database's password).
    scrub_secrets_from_environment(&[
        "BERTH_ADMIN_TOKEN",
        "BERTH_CLUSTER_SECRET",
        "BERTH_STORE",
        config::OIDC_CLIENT_SECRET_ENV,
    ]);
    config.apply_overrides(&args.overrides());
    config.read_secret_files()?;
    config.validate()?;
    init_tracing(&config.log_format)?;
    for warning in startup_warnings(&config) {
        tracing::warn!("{warning}");
    }
    raise_open_files_limit();
    serve::heap::tune_allocator();

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

/// Removes `names` from the environment and wipes their values from the
/// memory that `/proc/<pid>/environ` reads (the process's initial
/// environment block, which `unsetenv` only unlinks, never clears): so not
/// even a process allowed to read berth's environ finds the secrets there.
///
/// Must run while the process is single-threaded (before any runtime).
fn scrub_secrets_from_environment(names: &[&str]) {
    use std::ffi::CStr;
    use std::os::raw::c_char;

    unsafe extern "C" {
        static mut environ: *mut *mut c_char;
    }
    for name in names {
        let prefix = format!("{name}=");
        let mut found: Vec<(*mut c_char, usize)> = Vec::new();
        // SAFETY: single-threaded (see above), so nothing changes `environ`
        // while it is walked; it is a null-terminated array of pointers to
        // NUL-terminated strings, as the C runtime maintains it.
        unsafe {
            let mut entry = environ;
            while !entry.is_null() && !(*entry).is_null() {
                let text = CStr::from_ptr(*entry).to_bytes();
                if text.starts_with(prefix.as_bytes()) {
                    found.push((*entry, text.len()));
                }
                entry = entry.add(1);
            }
        }
        // SAFETY: single-threaded (see above), as `remove_var` requires.
        unsafe { std::env::remove_var(name) };
        for (value, len) in found {
            // SAFETY: `value` points at a writable string of `len` bytes
            // (the initial block is on the stack; a later `setenv` copy on
            // the heap) that `unsetenv` left in place but no longer lists;
            // only the bytes after the `=` are overwritten.
            unsafe { std::ptr::write_bytes(value.add(prefix.len()), 0, len - prefix.len()) };
        }
    }
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
    // Colours only for a terminal: a log file or journal gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let result = if log_format == "json" {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    result.map_err(|e| anyhow::anyhow!("cannot set up logging: {e}"))
}

/// berth holds a socket per instance (to its shim) besides its clients'
/// connections and its upstream pool, so the usual soft limit of 1024
/// open files would cap a node at a few hundred users. Like most servers,
/// it raises its soft limit to the hard one (which it cannot exceed).
/// What `config check` and `serve` warn of: settings that work but that
/// this host makes risky.
fn startup_warnings(config: &Config) -> Vec<String> {
    let root = nix::unistd::geteuid().is_root();
    // berth raises its soft limit to the hard one at start.
    let own_open_files = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .ok()
        .map(|(_, hard)| hard);
    [
        config.port_range_warning(crate::config::ephemeral_port_range()),
        config.open_files_warning(root, crate::config::file_max()),
        config.host_limits_warning(crate::config::pid_max(), own_open_files),
    ]
    .into_iter()
    .flatten()
    .collect()
}

fn raise_open_files_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open-files limit");
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read the open-files limit"),
    }
}
