//! The shim's control connections: who may connect (berth's uid on the
//! local socket; in a pod, a client that shows the pod's credential), and
//! one connection's life (the `Hello` snapshot, every event after it,
//! commands passed on).

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{broadcast, mpsc};

use crate::shim::protocol::ShimCommand;

/// Whether the peer of a control connection runs as the shim's own uid
/// (berth's), by its kernel-given credentials (`SO_PEERCRED`).
pub(super) fn from_own_uid(stream: &UnixStream) -> bool {
    match stream.peer_cred() {
        Ok(cred) if cred.uid() == nix::unistd::geteuid().as_raw() => true,
        Ok(cred) => {
            diag!(
                "refused a control connection from uid {} (pid {:?})",
                cred.uid(),
                cred.pid()
            );
            false
        }
        Err(e) => {
            diag!("refused a control connection with unknown credentials: {e}");
            false
        }
    }
}

/// How long a client of the pod's control port has to show the
/// credential.
const CREDENTIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest credential line read; a longer one is refused.
const CREDENTIAL_MAX: u64 = 256;

/// Reads the first line of a connection to the pod's control port and
/// whether it is `credential`. The connection, past that line, is returned
/// for [`serve_client`] when it is.
pub(super) async fn credential_shown(
    stream: TcpStream,
    credential: &str,
) -> Option<(BufReader<OwnedReadHalf>, OwnedWriteHalf)> {
    let peer = stream.peer_addr().ok();
    let (read, write) = stream.into_split();
    let mut reader = BufReader::new(read);
    let mut line = Vec::new();
    let mut limited = (&mut reader).take(CREDENTIAL_MAX);
    let read = limited.read_until(b'\n', &mut line);
    let shown = matches!(
        tokio::time::timeout(CREDENTIAL_TIMEOUT, read).await,
        Ok(Ok(_)) if same_bytes(line.strip_suffix(b"\n").unwrap_or(&[]), credential.as_bytes())
    );
    if !shown {
        diag!("refused a control connection from {peer:?}: no valid credential");
        return None;
    }
    Some((reader, write))
}

/// Whether `a` and `b` are equal, in a time that depends on their lengths
/// only: a credential must not be guessable a byte at a time by timing.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

/// One client connection: `hello`, then every event; commands it sends are
/// passed to the main loop.
pub(super) async fn serve_client<R, W>(
    read: BufReader<R>,
    mut write: W,
    hello: Arc<str>,
    mut events: broadcast::Receiver<Arc<str>>,
    commands: mpsc::Sender<ShimCommand>,
) where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    if write.write_all(hello.as_bytes()).await.is_err() {
        return;
    }
    let mut lines = read.lines();
    // A client that has shut down its sending side (e.g. dropped every
    // `ShimControl`) may still be listening for events.
    let mut reading = true;
    loop {
        tokio::select! {
            event = events.recv() => match event {
                Ok(line) => {
                    if write.write_all(line.as_bytes()).await.is_err() {
                        return;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    // Closing tells the client it missed something; it can
                    // re-attach and get a fresh Hello.
                    diag!("client fell {n} events behind; disconnecting it");
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => {
                    let _ = write.shutdown().await;
                    return;
                }
            },
            line = lines.next_line(), if reading => match line {
                Ok(Some(line)) if line.trim().is_empty() => {}
                Ok(Some(line)) => match serde_json::from_str::<ShimCommand>(&line) {
                    Ok(command) => {
                        if commands.send(command).await.is_err() {
                            reading = false;
                        }
                    }
                    Err(e) => diag!("ignoring bad command {line:?}: {e}"),
                },
                Ok(None) | Err(_) => reading = false,
            },
        }
    }
}
