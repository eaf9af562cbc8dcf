//! The type of a request body sent to an instance, shared by the forward
//! layer (which builds it) and the connection pool (whose connections carry
//! it). A leaf: it uses no module that uses it.

use bytes::Bytes;
use http_body_util::{Either, Empty};
use hyper::body::Incoming;

use crate::pace::PacedBody;

/// The body sent upstream: the client's as it is (no body to read, as for
/// a GET), the client's paced ([`crate::pace`]; boxed, so that the common
/// bodiless request does not carry the pacer's state through every move),
/// or nothing (a retry).
pub type UpstreamBody = Either<Incoming, Either<Box<PacedBody<Incoming>>, Empty<Bytes>>>;
