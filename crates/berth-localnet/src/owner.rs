//! Which account owns the socket at the other end of a local TCP
//! connection, asked of the kernel.
//!
//! berth reaches each instance at `127.0.0.1:<port>`. Any local account may
//! bind a free port, so a program of one user could bind the port berth
//! gave another user's instance before that instance does, and answer in
//! its place. The kernel records the owner of every socket (the uid that
//! created it; a listener's accepted connections keep it), and tells it
//! through the `sock_diag` netlink interface. [`peer_owner`] asks for the
//! exact connection the caller holds, by its two addresses, so the answer
//! is about the socket the caller's bytes would reach, not about whoever
//! happens to listen on the port a moment later.
//!
//! One query is a netlink socket, one request and one reply, all answered
//! synchronously inside the kernel: a few microseconds, with no blocking.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_sock_diag::SockDiagMessage;
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP, IPPROTO_UDP};
use netlink_packet_sock_diag::inet::{
    ExtensionFlags, InetRequest, InetResponseHeader, SocketId, StateFlags,
};
use netlink_sys::protocols::NETLINK_SOCK_DIAG;
use netlink_sys::{Socket, SocketAddr as NetlinkAddr};

/// Why the owner of a socket could not be told.
#[derive(Debug, thiserror::Error)]
pub enum SockDiagError {
    /// The netlink socket could not be made, or the query sent or its
    /// answer received; also the kernel's own error codes other than "no
    /// such socket".
    #[error("cannot ask the kernel who owns a socket: {0}")]
    Io(#[from] io::Error),
    /// The kernel has no TCP socket at `peer` connected to `local`: the
    /// connection is already gone, or never was.
    #[error("the kernel knows no TCP socket at {peer} connected to {local}")]
    NoSocket {
        /// The caller's own end of the connection.
        local: SocketAddr,
        /// The end whose owner was asked for.
        peer: SocketAddr,
    },
    /// No UDP socket, or sockets of more than one account, are bound
    /// where a datagram came from.
    #[error("no one account's UDP socket is bound at {0}")]
    NoUdpSocket(SocketAddr),
    /// One address is IPv4 and the other IPv6, so no single connection
    /// joins them; nothing was asked of the kernel.
    #[error("{local} and {peer} are of different address families")]
    MixedFamilies {
        /// The caller's own end, as given.
        local: SocketAddr,
        /// The other end, as given.
        peer: SocketAddr,
    },
    /// The kernel answered with something that is not a socket's record.
    #[error("the kernel's answer about a socket could not be read: {0}")]
    Answer(String),
    /// The socket exists but another account owns it: a program other
    /// than the expected one holds the port (see [`check_owner`]).
    #[error("the socket at {peer} belongs to uid {found}, not to the expected account {owner}")]
    Foreign {
        /// The address whose socket was checked.
        peer: SocketAddr,
        /// The uid that should own it.
        owner: u32,
        /// The uid that does.
        found: u32,
    },
}

/// Fails unless the socket at the other end of `stream` (a local TCP
/// connection) belongs to `owner`: [`SockDiagError::Foreign`] when another
/// account's does, another error when the kernel cannot tell.
pub fn check_owner(stream: &tokio::net::TcpStream, owner: u32) -> Result<(), SockDiagError> {
    let peer = stream.peer_addr()?;
    let found = peer_owner(stream.local_addr()?, peer)?;
    if found == owner {
        Ok(())
    } else {
        Err(SockDiagError::Foreign { peer, owner, found })
    }
}

/// The uid owning the socket at `peer` that is connected to `local`: the
/// other end of the caller's own TCP connection from `local` to `peer`.
///
/// A connection the peer has not yet accepted has no owner of its own on
/// kernels before 6.16 (it reads as root's); its listener's owner is
/// given then, which is the account the connection will be handed to.
pub fn peer_owner(local: SocketAddr, peer: SocketAddr) -> Result<u32, SockDiagError> {
    if local.is_ipv4() != peer.is_ipv4() {
        return Err(SockDiagError::MixedFamilies { local, peer });
    }
    // The peer's socket: its own address is the "source" of the query.
    let connection = query(peer, local)?.ok_or(SockDiagError::NoSocket { local, peer })?;
    if connection.inode != 0 {
        return Ok(connection.uid);
    }
    // Not accepted yet: no file, so no owner of its own on older kernels.
    // The listener on the peer's address is the socket that will accept it.
    let unspecified = SocketAddr::new(unspecified_like(peer.ip()), 0);
    let listener = query(peer, unspecified)?.ok_or(SockDiagError::NoSocket { local, peer })?;
    Ok(listener.uid)
}

/// The uid owning the UDP socket bound at `source`, where a datagram the
/// caller received came from: a socket bound to that address or to every
/// address, on that port. The kernel looks a UDP socket up only by both
/// ends, and one connected elsewhere (a resolver connects to the name
/// server it asks) would not be found that way, so every UDP socket of
/// the family is listed and the bound ones picked.
pub fn udp_owner(source: SocketAddr) -> Result<u32, SockDiagError> {
    let unspecified = unspecified_like(source.ip());
    let mut owners: Vec<u32> = udp_sockets(source.is_ipv4())?
        .into_iter()
        .filter(|s| {
            s.socket_id.source_port == source.port()
                && (s.socket_id.source_address == source.ip()
                    || s.socket_id.source_address == unspecified)
        })
        .map(|s| s.uid)
        .collect();
    owners.dedup();
    match owners.as_slice() {
        [uid] => Ok(*uid),
        _ => Err(SockDiagError::NoUdpSocket(source)),
    }
}

/// Every UDP socket of one family, as the kernel lists them.
fn udp_sockets(ipv4: bool) -> Result<Vec<InetResponseHeader>, SockDiagError> {
    let request = InetRequest {
        family: if ipv4 { AF_INET } else { AF_INET6 },
        protocol: IPPROTO_UDP,
        extensions: ExtensionFlags::empty(),
        states: StateFlags::all(),
        socket_id: SocketId::new_v4(),
    };
    // The kernel makes each part of the listing as the one before is
    // read, so none is ever waited for.
    let socket = send(request, NLM_F_REQUEST | NLM_F_DUMP)?;
    let mut found = Vec::new();
    loop {
        let mut answer = Vec::with_capacity(32 * 1024);
        let received = socket.recv(&mut answer, 0)?;
        answer.truncate(received);
        let mut at = 0;
        while at < answer.len() {
            let part = answer.get(at..).unwrap_or_default();
            let reply = NetlinkMessage::<SockDiagMessage>::deserialize(part)
                .map_err(|e| SockDiagError::Answer(e.to_string()))?;
            let length = usize::try_from(reply.header.length).unwrap_or(0);
            match reply.payload {
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(response)) => {
                    found.push(response.header);
                }
                NetlinkPayload::Done(_) => return Ok(found),
                NetlinkPayload::Error(error) => {
                    let code = error.code.map_or(0, |c| -c.get());
                    return Err(SockDiagError::Io(io::Error::from_raw_os_error(code)));
                }
                _ => {}
            }
            if length == 0 {
                return Err(SockDiagError::Answer("a message of no length".into()));
            }
            // Messages are aligned to 4 bytes.
            at += length.next_multiple_of(4);
        }
    }
}

fn unspecified_like(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

/// The kernel's record of the TCP socket whose own address is `own` and
/// whose remote address is `remote` (an unspecified `remote` finds the
/// listener on `own`), or `None` when there is no such socket.
fn query(own: SocketAddr, remote: SocketAddr) -> Result<Option<InetResponseHeader>, SockDiagError> {
    let request = InetRequest {
        family: if own.is_ipv4() { AF_INET } else { AF_INET6 },
        protocol: IPPROTO_TCP,
        extensions: ExtensionFlags::empty(),
        states: StateFlags::all(),
        socket_id: SocketId {
            source_port: own.port(),
            destination_port: remote.port(),
            source_address: own.ip(),
            destination_address: remote.ip(),
            interface_id: 0,
            // All 0xff: "no cookie", the socket is named by its addresses.
            cookie: [0xff; 8],
        },
    };
    // No NLM_F_DUMP: a lookup of one socket by its exact addresses. The
    // kernel answers while the request is being sent; never wait.
    let socket = send(request, NLM_F_REQUEST)?;
    let mut answer = Vec::with_capacity(8192);
    let received = socket.recv(&mut answer, 0)?;
    answer.truncate(received);
    let reply = NetlinkMessage::<SockDiagMessage>::deserialize(&answer)
        .map_err(|e| SockDiagError::Answer(e.to_string()))?;
    match reply.payload {
        NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(response)) => {
            Ok(Some(response.header))
        }
        NetlinkPayload::Error(error) => match error.code {
            Some(code) if -code.get() == ENOENT => Ok(None),
            Some(code) => Err(SockDiagError::Io(io::Error::from_raw_os_error(-code.get()))),
            None => Err(SockDiagError::Answer(
                "an acknowledgement, not a socket".into(),
            )),
        },
        other => Err(SockDiagError::Answer(format!(
            "unexpected answer {other:?}"
        ))),
    }
}

/// Sends `request` with `flags` on a netlink socket of its own, which
/// never blocks, and returns the socket for the answer.
fn send(request: InetRequest, flags: u16) -> Result<Socket, SockDiagError> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    let mut message = NetlinkMessage::new(header, SockDiagMessage::InetRequest(request).into());
    message.finalize();
    let mut out = vec![0; message.buffer_len()];
    message.serialize(&mut out);
    let socket = Socket::new(NETLINK_SOCK_DIAG)?;
    socket.set_non_blocking(true)?;
    socket.connect(&NetlinkAddr::new(0, 0))?;
    socket.send(&out, 0)?;
    Ok(socket)
}

const ENOENT: i32 = 2;

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    fn me() -> u32 {
        nix::unistd::geteuid().as_raw()
    }

    #[test]
    fn an_accepted_connection_is_owned_by_the_listeners_account() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, _) = listener.accept().unwrap();
        let owner = peer_owner(client.local_addr().unwrap(), client.peer_addr().unwrap());
        assert_eq!(owner.unwrap(), me());
    }

    #[test]
    fn a_connection_not_yet_accepted_is_owned_by_its_listeners_account() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let owner = peer_owner(client.local_addr().unwrap(), client.peer_addr().unwrap());
        assert_eq!(owner.unwrap(), me());
        drop(listener);
    }

    #[test]
    fn ipv6_loopback_is_asked_too() {
        let Ok(listener) = TcpListener::bind("[::1]:0") else {
            // A host without IPv6 loopback has nothing to ask.
            assert!(std::env::var_os("CI").is_none(), "CI hosts have ::1");
            return;
        };
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, _) = listener.accept().unwrap();
        let owner = peer_owner(client.local_addr().unwrap(), client.peer_addr().unwrap());
        assert_eq!(owner.unwrap(), me());
    }

    #[test]
    fn a_udp_sockets_owner_is_found_by_where_its_datagrams_come_from() {
        let bound = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let connected = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        connected.connect("127.0.0.1:9").unwrap();
        assert_eq!(udp_owner(bound.local_addr().unwrap()).unwrap(), me());
        let port = connected.local_addr().unwrap().port();
        let seen_from: SocketAddr = (Ipv4Addr::LOCALHOST, port).into();
        assert_eq!(udp_owner(seen_from).unwrap(), me());
        drop(bound);
        let gone = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = gone.local_addr().unwrap();
        drop(gone);
        assert!(matches!(
            udp_owner(addr),
            Err(SockDiagError::NoUdpSocket(_))
        ));
    }

    #[test]
    fn no_such_connection_is_told_apart() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = listener.local_addr().unwrap();
        drop(listener);
        let local: SocketAddr = "127.0.0.1:9".parse().unwrap();
        assert!(matches!(
            peer_owner(local, peer),
            Err(SockDiagError::NoSocket { .. })
        ));
        let v6: SocketAddr = "[::1]:9".parse().unwrap();
        assert!(matches!(
            peer_owner(v6, peer),
            Err(SockDiagError::MixedFamilies { .. })
        ));
    }
}
