//! The guard's `nft` runner: a small process berth starts once, when the
//! guard is installed, which runs `nft -f -` for each batch of port
//! changes.
//!
//! Why a process of its own: a process berth starts copies berth's
//! descriptor table when it is forked and closes every entry again when it
//! executes `nft`. berth holds about two descriptors per running instance
//! (a shim's socket, a pidfd), so with berth as its parent each `nft` run
//! cost more with every instance running: at 9,000 instances, 3.7% of the
//! machine's CPU went to `nft` copying and closing berth's descriptors
//! (BENCHMARKS.md). The runner is started while berth holds a handful, and
//! holds three.
//!
//! Protocol, over the runner's stdin and stdout (pipes), one request at a
//! time:
//! - request: the script's length (4 bytes, little-endian), then the
//!   script;
//! - answer: one byte ([`MADE`], [`REFUSED`] or [`NOT_RUN`]), a length
//!   (4 bytes, little-endian), then that many bytes of message: `nft`'s
//!   stderr when it refused, why `nft` could not be run otherwise.
//!
//! The runner ends at the end of its input: when berth drops the guard, or
//! dies.

use std::io::{self, Read, Write};
use std::path::Path;
use std::process::Stdio;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The argument after `shim` that makes berth's helper process the runner
/// (see [`crate::shim::run`]).
pub const NFT_RUNNER_ARG: &str = "nft-runner";

/// `nft` made the script's changes.
const MADE: u8 = 0;
/// `nft` refused the script; the message is its stderr.
const REFUSED: u8 = 1;
/// `nft` could not be run; the message says why.
const NOT_RUN: u8 = 2;

/// The largest script the runner takes: a grant of every port of the
/// largest port range is about 4 MiB.
const MAX_SCRIPT_BYTES: usize = 64 * 1024 * 1024;

/// Serves requests on stdin, answering on stdout, until stdin ends. Returns
/// the exit code.
pub(crate) fn serve(nft: &Path) -> i32 {
    // A descriptor berth's own parent left open would otherwise reach
    // every `nft` run.
    crate::shim::close_stray_descriptors();
    match serve_on(nft, io::stdin().lock(), io::stdout().lock()) {
        Ok(()) => 0,
        Err(e) => {
            let _ = writeln!(io::stderr(), "berth nft runner: {e}");
            1
        }
    }
}

/// [`serve`] over any pipe pair.
fn serve_on(nft: &Path, mut requests: impl Read, mut answers: impl Write) -> io::Result<()> {
    let mut len = [0u8; 4];
    loop {
        match requests.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_SCRIPT_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a script of {len} bytes is over {MAX_SCRIPT_BYTES}"),
            ));
        }
        let mut script = vec![0u8; len];
        requests.read_exact(&mut script)?;
        let (outcome, message) = match run_once(nft, &script) {
            Ok(out) if out.status.success() => (MADE, Vec::new()),
            Ok(out) => (REFUSED, out.stderr),
            Err(e) => (NOT_RUN, e.to_string().into_bytes()),
        };
        let message_len = u32::try_from(message.len()).unwrap_or(u32::MAX);
        answers.write_all(&[outcome])?;
        answers.write_all(&message_len.to_le_bytes())?;
        answers.write_all(&message[..message_len as usize])?;
        answers.flush()?;
    }
}

/// One `nft -f -` run of `script`.
fn run_once(nft: &Path, script: &[u8]) -> io::Result<std::process::Output> {
    let mut child = std::process::Command::new(nft)
        .args(["-f", "-"])
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    // `nft` reads all of its input before it writes anything, so writing
    // it whole first cannot block on a full stderr pipe.
    if let Some(mut input) = child.stdin.take() {
        input.write_all(script)?;
    }
    child.wait_with_output()
}

/// What became of a script sent to the runner.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Ran {
    /// `nft` made its changes.
    Made,
    /// `nft` refused it, with this on its stderr.
    Refused(String),
}

/// berth's end of a running runner.
#[derive(Debug)]
pub(crate) struct NftRunner {
    /// Held so that dropping the runner kills it.
    _process: tokio::process::Child,
    requests: tokio::process::ChildStdin,
    answers: tokio::process::ChildStdout,
}

impl NftRunner {
    /// Starts the runner: `helper` (berth's helper-process command, normally
    /// berth and `shim`) with `nft-runner` and `nft`.
    pub async fn start(helper: &[String], nft: &Path) -> io::Result<NftRunner> {
        let (exe, args) = helper
            .split_first()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no helper command"))?;
        let mut process = tokio::process::Command::new(exe)
            .args(args)
            .arg(NFT_RUNNER_ARG)
            .arg(nft)
            // As with the zygote: none of berth's environment (its secrets
            // among it) reaches the runner or `nft`.
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            // Its own process group: a Ctrl-C at berth's terminal stops
            // berth, which still has port changes to make as it stops.
            .process_group(0)
            .kill_on_drop(true)
            .spawn()?;
        let missing = || io::Error::other("the runner's pipes are missing");
        let requests = process.stdin.take().ok_or_else(missing)?;
        let answers = process.stdout.take().ok_or_else(missing)?;
        Ok(NftRunner {
            _process: process,
            requests,
            answers,
        })
    }

    /// Has the runner run `script` through `nft -f -`. An error: the runner
    /// is gone or broke the protocol, and whether the script was made is
    /// unknown.
    pub async fn run(&mut self, script: &str) -> io::Result<Ran> {
        let len = u32::try_from(script.len())
            .ok()
            .filter(|&len| len as usize <= MAX_SCRIPT_BYTES)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "script too long for the runner",
                )
            })?;
        let mut request = Vec::with_capacity(4 + script.len());
        request.extend_from_slice(&len.to_le_bytes());
        request.extend_from_slice(script.as_bytes());
        self.requests.write_all(&request).await?;
        self.requests.flush().await?;
        let outcome = self.answers.read_u8().await?;
        let message_len = self.answers.read_u32_le().await? as usize;
        let mut message = vec![0u8; message_len];
        self.answers.read_exact(&mut message).await?;
        let message = String::from_utf8_lossy(&message).trim().to_owned();
        match outcome {
            MADE => Ok(Ran::Made),
            REFUSED => Ok(Ran::Refused(message)),
            NOT_RUN => Err(io::Error::other(format!(
                "the runner cannot run nft: {message}"
            ))),
            other => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the runner answered {other}"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frames `scripts` as berth sends them.
    fn requests(scripts: &[&str]) -> Vec<u8> {
        let mut out = Vec::new();
        for script in scripts {
            out.extend_from_slice(&(script.len() as u32).to_le_bytes());
            out.extend_from_slice(script.as_bytes());
        }
        out
    }

    /// Each answer in `answers`: its outcome byte and message.
    fn answers(mut answers: &[u8]) -> Vec<(u8, String)> {
        let mut out = Vec::new();
        while !answers.is_empty() {
            let len = u32::from_le_bytes(answers[1..5].try_into().unwrap()) as usize;
            out.push((
                answers[0],
                String::from_utf8_lossy(&answers[5..5 + len]).into_owned(),
            ));
            answers = &answers[5 + len..];
        }
        out
    }

    #[test]
    fn each_script_is_answered_in_order_with_what_nft_made_of_it() {
        let nft = crate::isolation::resolve_nft(None);
        let Some(nft) = nft.filter(|_| nix::unistd::geteuid().is_root()) else {
            // CI runs as root, with nftables: a skip there would hide this.
            assert!(std::env::var_os("CI").is_none(), "needs root and nft");
            println!("SKIPPED: needs root and nft");
            return;
        };
        let table = format!("berth_runnertest_{}", std::process::id());
        let make = format!("table inet {table} {{}}\n");
        let bad = format!("add element inet {table} no_such_set {{ 1 . 2 }}\n");
        let remove = format!("delete table inet {table}\n");
        let mut out = Vec::new();
        serve_on(&nft, requests(&[&make, &bad, &remove]).as_slice(), &mut out).unwrap();
        let answers = answers(&out);
        assert_eq!(answers.len(), 3, "{answers:?}");
        assert_eq!(answers[0], (MADE, String::new()));
        assert_eq!(answers[1].0, REFUSED, "{answers:?}");
        assert!(answers[1].1.contains("no_such_set"), "{answers:?}");
        // The table was made, so its deletion is made too.
        assert_eq!(answers[2], (MADE, String::new()));
    }

    #[test]
    fn an_nft_that_cannot_run_is_answered_not_run() {
        let mut out = Vec::new();
        serve_on(
            Path::new("/nonexistent/nft"),
            requests(&["list tables\n"]).as_slice(),
            &mut out,
        )
        .unwrap();
        let answers = answers(&out);
        assert_eq!(answers.len(), 1);
        assert_eq!(answers[0].0, NOT_RUN, "{answers:?}");
    }

    #[test]
    fn an_oversized_request_ends_the_runner_unanswered() {
        let mut request = ((MAX_SCRIPT_BYTES + 1) as u32).to_le_bytes().to_vec();
        request.extend_from_slice(b"x");
        let mut out = Vec::new();
        let ended = serve_on(Path::new("/nonexistent/nft"), request.as_slice(), &mut out);
        assert!(ended.is_err());
        assert!(out.is_empty());
    }
}
