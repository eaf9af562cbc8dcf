//! The shim's control socket: who may connect, and one connection's
//! life (the `Hello` snapshot, every event after it, commands passed on).

use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
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

/// One client connection: `hello`, then every event; commands it sends are
/// passed to the main loop.
pub(super) async fn serve_client(
    stream: UnixStream,
    hello: Arc<str>,
    mut events: broadcast::Receiver<Arc<str>>,
    commands: mpsc::Sender<ShimCommand>,
) {
    let (read, mut write) = stream.into_split();
    if write.write_all(hello.as_bytes()).await.is_err() {
        return;
    }
    let mut lines = BufReader::new(read).lines();
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
