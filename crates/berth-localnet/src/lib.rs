//! How berth reaches a program on this host.
//!
//! * [`peer_owner`]: which account owns the socket at the other end of a
//!   local TCP connection, asked of the kernel, so that berth sends nothing
//!   to a program that bound an instance's port before the instance did;
//!   [`udp_owner`], the account of a local UDP socket.
//! * [`PairSet`]: the port guard's set of `uid . port` pairs, changed in
//!   nf_tables over one netlink socket, a batch per transaction.
//! * [`connect_in`]: a connection made inside a sandboxed instance's own
//!   network namespace, and [`loopback_up`] for the namespace's maker.

#![warn(missing_docs)]

mod netns;
mod nft_set;
mod owner;

pub use netns::{connect_in, loopback_up};
pub use nft_set::{NftSetError, PairChange, PairSet};
pub use owner::{SockDiagError, check_owner, peer_owner, udp_owner};
