//! Credentials berth makes from the cluster secret, each under a key of
//! its own: an HMAC of a label under the secret, so that no use of the
//! secret ever yields a valid credential of another use. Any replica makes
//! and checks any of them, and nothing is stored.

use data_encoding::HEXLOWER;
use hmac::{Hmac, Mac};
use sha2::Sha256;

pub(crate) type HmacSha256 = Hmac<Sha256>;

/// The key for one use of `cluster_secret`, named by `label`.
pub(crate) fn derived(cluster_secret: &[u8], label: &[u8]) -> HmacSha256 {
    keyed(&tag(&keyed(cluster_secret), label))
}

fn keyed(key: &[u8]) -> HmacSha256 {
    <HmacSha256 as Mac>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"))
}

pub(crate) fn tag(key: &HmacSha256, message: &[u8]) -> Vec<u8> {
    let mut mac = key.clone();
    mac.update(message);
    mac.finalize().into_bytes().to_vec()
}

/// The key a pod's shim credential is made with: what berth shows the
/// shim in a user's pod before it may command it (freeze, thaw, extend
/// the fence deadline, stop, run a hook).
#[derive(Clone)]
pub struct ShimKey(HmacSha256);

impl std::fmt::Debug for ShimKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShimKey(…)")
    }
}

impl ShimKey {
    /// The key for `cluster_secret`.
    pub fn new(cluster_secret: &[u8]) -> Self {
        Self(derived(cluster_secret, b"berth pod shim credential v1"))
    }

    /// The credential of the pod named `pod` that was created with
    /// `nonce` (a value chosen at its creation and never changed, so the
    /// credential holds for the pod's whole life, whichever replica takes
    /// it over), in hex. Another pod, or another pod of the same name, has
    /// another.
    pub fn credential(&self, pod: &str, nonce: &str) -> String {
        let message = format!("{pod}\0{nonce}");
        HEXLOWER.encode(&tag(&self.0, message.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pods_credential_is_its_own_alone() {
        let key = ShimKey::new(b"a cluster secret of enough length");
        let c = key.credential("berth-alice", "n1");
        assert_eq!(c.len(), 64);
        assert_eq!(c, key.credential("berth-alice", "n1"));
        for other in [
            key.credential("berth-bob", "n1"),
            key.credential("berth-alice", "n2"),
            // The separator keeps name and nonce apart.
            key.credential("berth-alicen", "1"),
            ShimKey::new(b"another cluster secret, same size").credential("berth-alice", "n1"),
            // Not the egress proxy's tag for the same text either.
            crate::egress::ProxyKey::new(b"a cluster secret of enough length")
                .credential(&crate::UserId::parse("berth-alice").unwrap())
                .password,
        ] {
            assert_ne!(c, other);
        }
    }
}
