//! Connections made inside another network namespace.
//!
//! A sandboxed instance has a network namespace of its own with nothing in
//! it but its own loopback: its program listens on `127.0.0.1:<port>`
//! there, where no program of another account can bind or connect, and
//! from berth's own namespace that address leads elsewhere. A socket
//! belongs to the namespace it was created in, so [`connect_in`] creates
//! and connects it on a thread of its own that has entered the instance's
//! namespace, and hands it back: the thread ends right after, so nothing
//! else ever runs in the instance's namespace.

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::libc;
use nix::sched::CloneFlags;

/// A TCP connection to `addr` as seen inside the network namespace named
/// by `netns` (a namespace file, such as `/proc/<pid>/ns/net`). Errors are
/// those of `connect(2)` (a refusal is `ConnectionRefused`), or of opening
/// and entering the namespace.
pub async fn connect_in(
    netns: &Path,
    addr: SocketAddr,
    timeout: Duration,
) -> io::Result<tokio::net::TcpStream> {
    let netns: PathBuf = netns.to_owned();
    let (answer, answered) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("berth-netns".into())
        .spawn(move || {
            // The receiver is gone only if the caller gave up waiting.
            let _ = answer.send(connect_blocking(&netns, addr, timeout));
        })?;
    let stream = answered
        .await
        .map_err(|_| io::Error::other("the namespace thread ended without an answer"))??;
    stream.set_nonblocking(true)?;
    tokio::net::TcpStream::from_std(stream)
}

/// On a thread that is about to end: enter `netns`, then connect.
fn connect_blocking(
    netns: &Path,
    addr: SocketAddr,
    timeout: Duration,
) -> io::Result<std::net::TcpStream> {
    let namespace = std::fs::File::open(netns)?;
    nix::sched::setns(&namespace, CloneFlags::CLONE_NEWNET)?;
    std::net::TcpStream::connect_timeout(&addr, timeout)
}

/// Brings up the loopback interface of the calling thread's network
/// namespace: a new namespace starts with `lo` down, and its programs
/// could not even reach themselves.
pub fn loopback_up() -> io::Result<()> {
    let socket = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Inet,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    // SAFETY: `ifreq` is a plain C struct (a name and a union of plain
    // integers and addresses); all zeroes is a valid value of it.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (slot, byte) in request.ifr_name.iter_mut().zip(b"lo\0") {
        *slot = *byte as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the name from, and writes the flags into,
    // the `ifreq` we own, which outlives the call; the descriptor is open.
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFFLAGS, &mut request) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFFLAGS filled the `ifru_flags` member of the union.
    let flags = unsafe { request.ifr_ifru.ifru_flags };
    request.ifr_ifru.ifru_flags = flags | libc::IFF_UP as libc::c_short;
    // SAFETY: as above; SIOCSIFFLAGS only reads the `ifreq`.
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCSIFFLAGS, &request) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener in a network namespace of its own (made on a thread that
    /// stays there), a port bound there that nobody listens on, and that
    /// namespace's file. The unlistened port stays bound, so the kernel
    /// never hands it to a connect as its source port: a connect to a port
    /// that was just freed may be given that very port, and connect to
    /// itself.
    fn listener_in_a_namespace_of_its_own()
    -> Option<(std::net::TcpListener, std::net::SocketAddr, PathBuf)> {
        if !nix::unistd::geteuid().is_root() {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI runs as root, where network namespaces can be made"
            );
            return None;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            nix::sched::unshare(CloneFlags::CLONE_NEWNET).unwrap();
            loopback_up().unwrap();
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let unlistened = unlistened_port().unwrap();
            let tid = nix::unistd::gettid();
            let path = PathBuf::from(format!("/proc/self/task/{tid}/ns/net"));
            // Pinned by an open descriptor: the thread may end.
            let pinned = std::fs::File::open(&path).unwrap();
            let fd_path = PathBuf::from(format!("/proc/self/fd/{}", pinned.as_raw_fd()));
            std::mem::forget(pinned);
            tx.send((listener, unlistened, fd_path)).unwrap();
        });
        Some(rx.recv().unwrap())
    }

    /// Binds a TCP socket to a free loopback port without listening, and
    /// keeps it open for the rest of the test process.
    fn unlistened_port() -> io::Result<std::net::SocketAddr> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind("127.0.0.1:0".parse().expect("an address"))?;
        let bound = socket.local_addr()?;
        std::mem::forget(socket);
        Ok(bound)
    }

    #[tokio::test]
    async fn a_connection_is_made_inside_the_namespace_named() {
        let Some((listener, unlistened, netns)) = listener_in_a_namespace_of_its_own() else {
            return;
        };
        let addr = listener.local_addr().unwrap();
        let stream = connect_in(&netns, addr, Duration::from_secs(5))
            .await
            .unwrap();
        let (accepted, _) = listener.accept().unwrap();
        assert_eq!(accepted.peer_addr().unwrap(), stream.local_addr().unwrap());
        // And a port nobody listens on in there is refused, as a refusal.
        let refused = connect_in(&netns, unlistened, Duration::from_secs(5)).await;
        assert_eq!(
            refused.unwrap_err().kind(),
            io::ErrorKind::ConnectionRefused
        );
    }
}
