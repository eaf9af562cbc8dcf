//! Hooks: an operator's command run beside the program, inside everything
//! the program runs in (its account, cgroup, sandbox, working directory
//! and environment), so that it can do what the program could and nothing
//! more. A hook is one-shot: when it ends, or its grace runs out, its
//! whole process group is killed, and whatever it moved out of the group
//! is still in the instance's cgroup and account, so it ends with the
//! instance.

use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::time::Duration;

use berth_core::program::Variable;
use berth_core::runtime::HookOutcome;
use nix::sys::signal::{self, Signal};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Child;

use super::pid_of;
use super::start::{describe, die_with_shim, hidden_in_sandbox, resolve};
use crate::isolation::cgroup::InstanceCgroup;
use crate::isolation::child::{self, ChildPlan, ShimEnds};
use crate::shim::protocol::ShimSpec;

/// The most output of a hook kept for its outcome, in characters.
const OUTPUT_TAIL_CHARS: usize = 500;

/// How long the output of a finished hook is still read: what its killed
/// group wrote is in the pipe by then, unless a process it moved out of
/// its group holds the pipe open.
const OUTPUT_DRAIN: Duration = Duration::from_millis(200);

/// A started hook and what must stay open while it runs.
pub(super) struct Hook {
    child: Child,
    /// Its process group, which is its own.
    pub(super) pgid: u32,
    /// The shim's ends of the isolation setup's pipes.
    _ends: Option<ShimEnds>,
}

/// Starts `argv` as hook `name` beside the program, whose process in the
/// shim's namespaces is `program_pid`. Call it on the shim's main thread:
/// a sandbox's network and pid namespaces are that thread's.
pub(super) fn spawn(
    spec: &ShimSpec,
    cgroup: Option<&InstanceCgroup>,
    program_pid: u32,
    name: &str,
    argv: &[String],
) -> Result<Hook, String> {
    let Some(argv0) = argv.first().filter(|a| !a.is_empty()) else {
        return Err(format!("hook {name}: the command is empty"));
    };
    let program = resolve(argv0, spec).map_err(|e| format!("hook {name}: {e}"))?;
    let isolation = spec.isolation.as_ref();
    if let Some(sandbox) = isolation.and_then(|i| i.sandbox.as_ref())
        && let Some(hidden) = hidden_in_sandbox(&program, &sandbox.data_dir, &sandbox.user_root)
    {
        return Err(format!(
            "hook {name}: {} lies under {}, which the sandbox hides",
            program.display(),
            hidden.display()
        ));
    }
    let mut command = tokio::process::Command::new(&program);
    command
        .arg0(argv0)
        .args(&argv[1..])
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .env(Variable::Hook.name(), name)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut ends = None;
    match isolation {
        Some(isolation) => {
            let (plan, plan_ends) = ChildPlan::beside(isolation, &spec.cwd, cgroup, program_pid)
                .map_err(|e| format!("hook {name}: {e}"))?;
            ends = Some(plan_ends);
            // SAFETY: `enter` runs between fork and exec and is written
            // for exactly that (see `isolation::child`); a plan made by
            // `beside` makes no sandbox and never forks. The closure owns
            // the plan, so its strings and descriptors live until exec.
            unsafe {
                command.pre_exec(move || plan.enter());
            }
        }
        None => {
            command.current_dir(&spec.cwd);
            die_with_shim(&mut command);
        }
    }
    let spawned = command.spawn();
    if let Some(ends) = ends.as_mut() {
        ends.child_only.clear();
    }
    let child = spawned.map_err(|e| {
        let step = ends
            .as_ref()
            .map(|ends| String::from_utf8_lossy(&child::read_pipe(&ends.diag)).into_owned())
            .filter(|s| !s.is_empty());
        match step {
            Some(step) => format!(
                "hook {name}: isolation setup failed ({step}): {}",
                describe(&e)
            ),
            None => format!("hook {name}: cannot execute {program:?}: {}", describe(&e)),
        }
    })?;
    let pgid = child
        .id()
        .ok_or_else(|| format!("hook {name} vanished right after it started"))?;
    Ok(Hook {
        child,
        pgid,
        _ends: ends,
    })
}

/// Waits for `hook` until `grace`, kills its process group either way,
/// and reports how it ended with the tail of its output.
pub(super) async fn finish(mut hook: Hook, grace: Duration) -> HookOutcome {
    let mut stdout = hook.child.stdout.take();
    let mut stderr = hook.child.stderr.take();
    let mut output = Vec::new();
    let cut_off = tokio::time::sleep(grace);
    tokio::pin!(cut_off);
    let waited = loop {
        tokio::select! {
            status = hook.child.wait() => break Some(status),
            () = &mut cut_off => break None,
            more = read_some(&mut stdout) => keep(&mut output, more),
            more = read_some(&mut stderr) => keep(&mut output, more),
        }
    };
    let _ = signal::killpg(pid_of(hook.pgid), Signal::SIGKILL);
    let timed_out = waited.is_none();
    let status = match waited {
        Some(status) => status,
        None => hook.child.wait().await,
    };
    let drain = async {
        while stdout.is_some() || stderr.is_some() {
            tokio::select! {
                more = read_some(&mut stdout) => keep(&mut output, more),
                more = read_some(&mut stderr) => keep(&mut output, more),
            }
        }
    };
    let _ = tokio::time::timeout(OUTPUT_DRAIN, drain).await;
    let text = String::from_utf8_lossy(&output);
    let skip = text.chars().count().saturating_sub(OUTPUT_TAIL_CHARS);
    HookOutcome {
        code: status.as_ref().ok().and_then(|s| s.code()),
        signal: status.as_ref().ok().and_then(|s| s.signal()),
        timed_out,
        output_tail: text.chars().skip(skip).collect(),
    }
}

/// The next piece `pipe` gives, empty at its end; pending forever once it
/// has ended (so a `select!` stops asking it).
async fn read_some<R: AsyncRead + Unpin>(pipe: &mut Option<R>) -> Vec<u8> {
    let Some(reader) = pipe.as_mut() else {
        return std::future::pending().await;
    };
    let mut buf = vec![0; 1024];
    match reader.read(&mut buf).await {
        Ok(n) if n > 0 => {
            buf.truncate(n);
            buf
        }
        Ok(_) | Err(_) => {
            *pipe = None;
            Vec::new()
        }
    }
}

/// Appends a piece to `output`, keeping only as many bytes as the tail
/// could need (four per character at most).
fn keep(output: &mut Vec<u8>, piece: Vec<u8>) {
    output.extend_from_slice(&piece);
    let most = OUTPUT_TAIL_CHARS * 4;
    if output.len() > most {
        output.drain(..output.len() - most);
    }
}
