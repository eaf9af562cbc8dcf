//! Changes to an nftables set of `uid . inet_service` pairs (the port
//! guard's `own_ports`), made over one netlink socket that stays open.
//!
//! Why not `nft`: before an `nft` run changes anything, it reads the
//! kernel's ruleset into a cache of its own, the elements of its sets
//! among it, so each run cost more with every instance running; and it
//! is a process started per batch. Here a batch of changes is one
//! `sendmsg` of an nfnetlink transaction (batch begin, one message per
//! change, batch end), which the kernel makes, all or nothing, before the
//! call returns: its cost is that of the changes alone.
//!
//! How the outcome is known: the kernel answers a message flagged for
//! acknowledgement with an acknowledgement, and any message it refuses
//! with an error, all queued on the socket before `sendmsg` returns, even
//! when the transaction is aborted. Only the batch's last message asks
//! for an acknowledgement, so a batch of any size is answered with at most
//! one message per refusal and one more: the transaction was made when
//! that acknowledgement is there and no refusal is.

use std::io;

use netlink_packet_core::{DefaultNla, Emitable, NLA_F_NESTED, NetlinkBuffer, NetlinkHeader};
use netlink_sys::Socket;
use netlink_sys::protocols::NETLINK_NETFILTER;

/// nfnetlink's subsystem of nf_tables.
const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// The messages that open and close a transaction.
const NFNL_MSG_BATCH_BEGIN: u16 = 16;
const NFNL_MSG_BATCH_END: u16 = 17;
/// nf_tables' message types for set elements.
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;
/// The `inet` family, of berth's tables.
const NFPROTO_INET: u8 = 1;
/// Attributes of a set-element message.
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_DATA_VALUE: u16 = 1;
/// Netlink's message flags and types.
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 2;
/// The size of a netlink message header, and of nfnetlink's own after it.
const NLMSG_HEADER_LEN: usize = 16;
const NFGENMSG_LEN: usize = 4;

/// One change to a set of `uid . port` pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairChange {
    /// Adds the pair; adding a pair the set holds changes nothing.
    Add {
        /// The socket owner's uid.
        uid: u32,
        /// The TCP port.
        port: u16,
    },
    /// Deletes the pair; the whole transaction is refused when the set
    /// does not hold it.
    Delete {
        /// The socket owner's uid.
        uid: u32,
        /// The TCP port.
        port: u16,
    },
}

/// Why a batch of changes was not made.
#[derive(Debug, thiserror::Error)]
pub enum NftSetError {
    /// The netlink socket could not be made, or the batch sent, or its
    /// answer read; whether the batch was made is not known.
    #[error("cannot talk to nf_tables over netlink: {0}")]
    Io(#[from] io::Error),
    /// nf_tables refused a change, so it made none of the batch.
    #[error("nf_tables refused a change to set {set} of table inet {table}: {source}")]
    Refused {
        /// The table.
        table: String,
        /// The set.
        set: String,
        /// The first refusal's error code, as the kernel gave it.
        source: io::Error,
    },
    /// The kernel's answer does not say whether the batch was made.
    #[error("nf_tables' answer to a batch cannot be read: {0}")]
    Answer(String),
}

/// An open netlink socket to nf_tables, for changes to one set.
#[derive(Debug)]
pub struct PairSet {
    socket: Socket,
    table: String,
    set: String,
    /// The sequence number of the next message sent.
    next_seq: u32,
}

impl PairSet {
    /// Opens a socket for changes to set `set` of table `inet table`.
    /// Neither needs to exist yet: each batch names them.
    pub fn open(table: &str, set: &str) -> Result<PairSet, NftSetError> {
        let mut socket = Socket::new(NETLINK_NETFILTER)?;
        socket.bind_auto()?;
        Ok(PairSet {
            socket,
            table: table.to_owned(),
            set: set.to_owned(),
            next_seq: 1,
        })
    }

    /// Makes `changes`, in order, in one transaction: all of them or,
    /// when nf_tables refuses one, none. Blocks for as long as the kernel
    /// takes to make them (microseconds a change), never on anything else.
    pub fn apply(&mut self, changes: &[PairChange]) -> Result<(), NftSetError> {
        if changes.is_empty() {
            return Ok(());
        }
        // An answer left from a batch whose reading failed must not be
        // taken for this batch's.
        self.drain()?;
        let first = self.next_seq;
        let batch = encode_batch(&self.table, &self.set, changes, first);
        let messages = u32::try_from(changes.len() + 2).unwrap_or(u32::MAX);
        self.next_seq = first.wrapping_add(messages);
        self.fit_send_buffer(batch.len())?;
        let sent = self.socket.send(&batch, 0)?;
        if sent != batch.len() {
            return Err(NftSetError::Answer(format!(
                "sent {sent} of the batch's {} bytes",
                batch.len()
            )));
        }
        let last = first.wrapping_add(messages - 2);
        let answers = self.read_queued()?;
        match outcome(&answers, first..=last, last) {
            Ok(()) => Ok(()),
            Err(Outcome::Refused(errno)) => Err(NftSetError::Refused {
                table: self.table.clone(),
                set: self.set.clone(),
                source: io::Error::from_raw_os_error(errno),
            }),
            Err(Outcome::Unknown(why)) => Err(NftSetError::Answer(why)),
        }
    }

    /// Lets the socket send a batch of `len` bytes: the kernel takes a
    /// transaction in one message, no larger than the send buffer. Adoption
    /// after a restart grants every instance's pair in one batch.
    fn fit_send_buffer(&mut self, len: usize) -> Result<(), NftSetError> {
        use nix::sys::socket::{getsockopt, setsockopt, sockopt};
        // The kernel keeps some of the buffer for its own bookkeeping.
        let wanted = len.saturating_add(64 * 1024);
        let current = getsockopt(&self.socket, sockopt::SndBuf).map_err(io::Error::from)?;
        if current < wanted {
            // `SndBufForce` passes the host's `wmem_max`; the guard holds
            // the privilege it needs, as it changes nf_tables.
            setsockopt(&self.socket, sockopt::SndBufForce, &wanted).map_err(io::Error::from)?;
        }
        Ok(())
    }

    /// Every answer queued on the socket now, each as the bytes of one
    /// datagram; a full queue that dropped some is a refusal (only
    /// refusals come in numbers).
    fn read_queued(&self) -> Result<Vec<Vec<u8>>, NftSetError> {
        let mut answers = Vec::new();
        loop {
            let mut datagram = Vec::with_capacity(64 * 1024);
            match self.socket.recv(&mut datagram, libc_flags::MSG_DONTWAIT) {
                Ok(_) => answers.push(datagram),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(answers),
                Err(e) if e.raw_os_error() == Some(libc_flags::ENOBUFS) => {
                    return Err(NftSetError::Refused {
                        table: self.table.clone(),
                        set: self.set.clone(),
                        source: e,
                    });
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Throws away whatever is queued on the socket.
    fn drain(&self) -> Result<(), NftSetError> {
        match self.read_queued() {
            Ok(_) | Err(NftSetError::Refused { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// The two constants of libc's this module needs, without a dependency
/// on libc for them.
mod libc_flags {
    pub const MSG_DONTWAIT: i32 = nix::sys::socket::MsgFlags::MSG_DONTWAIT.bits();
    pub const ENOBUFS: i32 = nix::errno::Errno::ENOBUFS as i32;
}

/// Why a batch's answers do not show it made.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// The first refusal of a message of the batch, as a positive errno.
    Refused(i32),
    /// Neither a refusal nor the last message's acknowledgement is there.
    Unknown(String),
}

/// What `answers` (datagrams of netlink messages) say of the batch whose
/// messages have sequence numbers in `batch`, whose message `last` asked
/// for an acknowledgement. Answers to other sequence numbers are ignored.
fn outcome(
    answers: &[Vec<u8>],
    batch: std::ops::RangeInclusive<u32>,
    last: u32,
) -> Result<(), Outcome> {
    let mut acknowledged = false;
    for datagram in answers {
        let mut rest = datagram.as_slice();
        while !rest.is_empty() {
            let message = NetlinkBuffer::new_checked(rest)
                .map_err(|e| Outcome::Unknown(format!("a malformed answer: {e}")))?;
            let length = (message.length() as usize).next_multiple_of(4);
            let seq = message.sequence_number();
            if message.message_type() == NLMSG_ERROR && batch.contains(&seq) {
                let code = message
                    .payload()
                    .get(..4)
                    .and_then(|b| b.try_into().ok())
                    .map(i32::from_ne_bytes)
                    .ok_or_else(|| Outcome::Unknown("an error answer too short".to_owned()))?;
                match code {
                    0 if seq == last => acknowledged = true,
                    0 => {}
                    refused => return Err(Outcome::Refused(refused.saturating_neg())),
                }
            }
            rest = rest.get(length..).unwrap_or(&[]);
        }
    }
    if acknowledged {
        Ok(())
    } else {
        Err(Outcome::Unknown(
            "no acknowledgement of the batch's last change".to_owned(),
        ))
    }
}

/// The bytes of one transaction making `changes` to set `set` of table
/// `inet table`, its messages numbered from `first`; only the last change
/// asks for an acknowledgement.
fn encode_batch(table: &str, set: &str, changes: &[PairChange], first: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let mut seq = first;
    // nfnetlink's batch messages carry the subsystem in the resource id,
    // in network byte order.
    push_message(
        &mut out,
        NFNL_MSG_BATCH_BEGIN,
        NLM_F_REQUEST,
        seq,
        0,
        NFNL_SUBSYS_NFTABLES,
        &[],
    );
    for (i, change) in changes.iter().enumerate() {
        seq = seq.wrapping_add(1);
        let (kind, uid, port, create) = match *change {
            PairChange::Add { uid, port } => (NFT_MSG_NEWSETELEM, uid, port, NLM_F_CREATE),
            PairChange::Delete { uid, port } => (NFT_MSG_DELSETELEM, uid, port, 0),
        };
        let ack = if i + 1 == changes.len() { NLM_F_ACK } else { 0 };
        let element = nested(
            NFTA_LIST_ELEM,
            &[nested(
                NFTA_SET_ELEM_KEY,
                &[DefaultNla::new(
                    NFTA_DATA_VALUE,
                    pair_key(uid, port).to_vec(),
                )],
            )],
        );
        let attributes = [
            DefaultNla::new(NFTA_SET_ELEM_LIST_TABLE, c_string(table)),
            DefaultNla::new(NFTA_SET_ELEM_LIST_SET, c_string(set)),
            nested(NFTA_SET_ELEM_LIST_ELEMENTS, &[element]),
        ];
        push_message(
            &mut out,
            (NFNL_SUBSYS_NFTABLES << 8) | kind,
            NLM_F_REQUEST | create | ack,
            seq,
            NFPROTO_INET,
            0,
            &attributes,
        );
    }
    push_message(
        &mut out,
        NFNL_MSG_BATCH_END,
        NLM_F_REQUEST,
        seq.wrapping_add(1),
        0,
        NFNL_SUBSYS_NFTABLES,
        &[],
    );
    out
}

/// The key of `uid . port` in a set of type `uid . inet_service`: each
/// part in a 4-byte register, the uid in host byte order (as `meta skuid`
/// loads it), the port in network byte order, then padding.
fn pair_key(uid: u32, port: u16) -> [u8; 8] {
    let mut key = [0u8; 8];
    key[..4].copy_from_slice(&uid.to_ne_bytes());
    key[4..6].copy_from_slice(&port.to_be_bytes());
    key
}

/// `value` as the NUL-terminated string nf_tables expects.
fn c_string(value: &str) -> Vec<u8> {
    let mut bytes = value.as_bytes().to_vec();
    bytes.push(0);
    bytes
}

/// An attribute holding `inner`.
fn nested(kind: u16, inner: &[DefaultNla]) -> DefaultNla {
    let mut value = vec![0u8; inner.buffer_len()];
    inner.emit(&mut value);
    DefaultNla::new(kind | NLA_F_NESTED, value)
}

/// Appends one netlink message: its header, nfnetlink's header (family,
/// version 0, resource id) and `attributes`.
fn push_message(
    out: &mut Vec<u8>,
    message_type: u16,
    flags: u16,
    seq: u32,
    family: u8,
    resource: u16,
    attributes: &[DefaultNla],
) {
    let length = NLMSG_HEADER_LEN + NFGENMSG_LEN + attributes.buffer_len();
    let mut header = NetlinkHeader::default();
    header.length = u32::try_from(length).unwrap_or(u32::MAX);
    header.message_type = message_type;
    header.flags = flags;
    header.sequence_number = seq;
    let start = out.len();
    out.resize(start + length, 0);
    header.emit(&mut out[start..start + NLMSG_HEADER_LEN]);
    let body = start + NLMSG_HEADER_LEN;
    out[body] = family;
    out[body + 1] = 0;
    out[body + 2..body + 4].copy_from_slice(&resource.to_be_bytes());
    attributes.emit(&mut out[body + NFGENMSG_LEN..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pairs `nft` lists in set `own_ports` of table `inet table`.
    fn listed(nft: &str, table: &str) -> Vec<String> {
        let out = std::process::Command::new(nft)
            .args(["list", "set", "inet", table, "own_ports"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        let Some((_, elements)) = text.split_once("elements = {") else {
            return Vec::new();
        };
        let elements = elements.split_once('}').unwrap().0;
        let mut pairs: Vec<String> = elements
            .split(',')
            .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|p| !p.is_empty())
            .collect();
        pairs.sort();
        pairs
    }

    #[test]
    fn changes_reach_the_kernels_set_all_of_a_batch_or_none() {
        let nft = ["/usr/sbin/nft", "/sbin/nft"]
            .into_iter()
            .find(|p| std::path::Path::new(p).is_file());
        let Some(nft) = nft.filter(|_| nix::unistd::geteuid().is_root()) else {
            // CI runs as root, with nftables: a skip there would hide this.
            assert!(std::env::var_os("CI").is_none(), "needs root and nft");
            println!("SKIPPED: needs root and nft");
            return;
        };
        let table = format!("berth_nftsettest_{}", std::process::id());
        let run = |script: String| {
            let mut child = std::process::Command::new(nft)
                .args(["-f", "-"])
                .stdin(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            use std::io::Write;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(script.as_bytes())
                .unwrap();
            assert!(child.wait().unwrap().success());
        };
        run(format!(
            "table inet {table} {{\n\tset own_ports {{\n\t\ttype uid . inet_service\n\t}}\n}}\n"
        ));
        // uids with no account, which nft lists as numbers.
        let add = |uid, port| PairChange::Add { uid, port };
        let delete = |uid, port| PairChange::Delete { uid, port };
        let mut set = PairSet::open(&table, "own_ports").unwrap();
        set.apply(&[add(900_001, 20005), add(900_002, 20006)])
            .unwrap();
        assert_eq!(listed(nft, &table), ["900001 . 20005", "900002 . 20006"]);
        // A delete of a pair the set does not hold is refused, and the
        // add before it in the same batch is not made either.
        let refused = set
            .apply(&[add(900_003, 20007), delete(900_009, 20009)])
            .unwrap_err();
        assert!(
            matches!(&refused, NftSetError::Refused { source, .. }
                if source.raw_os_error() == Some(nix::errno::Errno::ENOENT as i32)),
            "{refused}"
        );
        assert_eq!(listed(nft, &table), ["900001 . 20005", "900002 . 20006"]);
        // A batch far larger than the socket's default buffer (adoption
        // of thousands) is one transaction too.
        let many: Vec<PairChange> = (0..20_000u32)
            .map(|i| add(910_000 + i, 1 + i as u16))
            .collect();
        set.apply(&many).unwrap();
        assert_eq!(listed(nft, &table).len(), 20_002);
        let back: Vec<PairChange> = (0..20_000u32)
            .map(|i| delete(910_000 + i, 1 + i as u16))
            .collect();
        set.apply(&back).unwrap();
        // The socket goes on after a refusal; a grant moving a port to
        // another uid is one delete and one add.
        set.apply(&[delete(900_001, 20005), add(900_004, 20005)])
            .unwrap();
        assert_eq!(listed(nft, &table), ["900002 . 20006", "900004 . 20005"]);
        run(format!("delete table inet {table}\n"));
        // A table that is gone refuses every change.
        assert!(matches!(
            set.apply(&[add(900_005, 20010)]),
            Err(NftSetError::Refused { .. })
        ));
    }

    /// Each message of `batch`: (type, flags, seq, the bytes after the
    /// netlink header).
    fn messages(batch: &[u8]) -> Vec<(u16, u16, u32, Vec<u8>)> {
        let mut out = Vec::new();
        let mut rest = batch;
        while !rest.is_empty() {
            let m = NetlinkBuffer::new_checked(rest).unwrap();
            out.push((
                m.message_type(),
                m.flags(),
                m.sequence_number(),
                m.payload().to_vec(),
            ));
            rest = &rest[m.length() as usize..];
        }
        out
    }

    #[test]
    fn a_batch_is_framed_by_begin_and_end_and_only_its_last_change_asks_for_an_ack() {
        let changes = [
            PairChange::Delete {
                uid: 200_001,
                port: 20005,
            },
            PairChange::Add {
                uid: 200_002,
                port: 20005,
            },
        ];
        let batch = encode_batch("berth_0a1b2c3d", "own_ports", &changes, 7);
        let messages = messages(&batch);
        assert_eq!(messages.len(), 4);
        assert_eq!(
            messages[0],
            (NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 7, vec![0, 0, 0, 10])
        );
        assert_eq!(
            (messages[3].0, messages[3].2, &messages[3].3),
            (NFNL_MSG_BATCH_END, 10, &vec![0, 0, 0, 10])
        );
        assert_eq!(
            (messages[1].0, messages[1].1, messages[1].2),
            (0x0a0e, NLM_F_REQUEST, 8)
        );
        assert_eq!(
            (messages[2].0, messages[2].1, messages[2].2),
            (0x0a0c, NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK, 9)
        );
        // The inet family, then the table, the set and the key, as `nft`
        // itself encodes `add element inet berth_0a1b2c3d own_ports
        // { 200002 . 20005 }`.
        let add = &messages[2].3;
        assert_eq!(&add[..4], &[NFPROTO_INET, 0, 0, 0]);
        let text = add[4..].to_vec();
        let find = |needle: &[u8]| text.windows(needle.len()).any(|w| w == needle);
        assert!(find(b"berth_0a1b2c3d\0"));
        assert!(find(b"own_ports\0"));
        let mut key = 200_002u32.to_ne_bytes().to_vec();
        key.extend_from_slice(&[0x4e, 0x25, 0, 0]);
        assert!(find(&key));
    }

    /// An answer to message `seq`: an `NLMSG_ERROR` with `code`.
    fn answer(seq: u32, code: i32) -> Vec<u8> {
        let mut out = Vec::new();
        let mut header = NetlinkHeader::default();
        header.length = 36;
        header.message_type = NLMSG_ERROR;
        header.sequence_number = seq;
        out.resize(36, 0);
        header.emit(&mut out[..16]);
        out[16..20].copy_from_slice(&code.to_ne_bytes());
        out
    }

    #[test]
    fn a_batch_is_made_only_when_its_last_change_is_acknowledged_and_none_refused() {
        assert_eq!(outcome(&[answer(12, 0)], 10..=12, 12), Ok(()));
        assert_eq!(
            outcome(&[answer(11, -2), answer(12, 0)], 10..=12, 12),
            Err(Outcome::Refused(2))
        );
        assert!(matches!(
            outcome(&[], 10..=12, 12),
            Err(Outcome::Unknown(_))
        ));
        // An answer to another batch says nothing of this one.
        assert!(matches!(
            outcome(&[answer(5, 0), answer(4, -2)], 10..=12, 12),
            Err(Outcome::Unknown(_))
        ));
        // Two answers in one datagram are both read.
        let mut both = answer(11, -17);
        both.extend(answer(12, 0));
        assert_eq!(outcome(&[both], 10..=12, 12), Err(Outcome::Refused(17)));
    }
}
