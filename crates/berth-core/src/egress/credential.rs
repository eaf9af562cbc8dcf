//! What a pod shows berth's egress proxy to say whose it is. A pod has no
//! account on berth's host, so the proxy cannot ask the kernel; and a
//! pod's address is the CNI's to give, reused once the pod is gone.
//! Instead every pod that may go through the proxy carries, in its proxy
//! variables, its user's id and a tag only berth can make: the
//! HMAC-SHA256 of that id under a key derived from the cluster secret,
//! which every replica shares. So any replica checks any pod, nothing is
//! stored, and a program learns nothing that would pass for another
//! user. A user's credential never changes; it is only ever good for
//! that user's own policy.

use data_encoding::{BASE64URL_NOPAD, HEXLOWER};
use hmac::Mac;

use crate::UserId;
use crate::credential::{HmacSha256, derived, tag};

/// The key the proxy's credentials are made and checked with.
#[derive(Clone)]
pub struct ProxyKey(HmacSha256);

impl std::fmt::Debug for ProxyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProxyKey(…)")
    }
}

/// The name and password a pod's proxy URL carries, both safe in a URL's
/// user-info as they are (base64url and hex).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyCredential {
    /// The user's id, base64url without padding.
    pub name: String,
    /// The tag, hex.
    pub password: String,
}

impl ProxyKey {
    /// The key for `cluster_secret`: an HMAC of a label of its own under
    /// the secret, so that no other use of the secret ever yields a
    /// valid credential, nor a credential anything else.
    pub fn new(cluster_secret: &[u8]) -> Self {
        Self(derived(cluster_secret, b"berth egress proxy credential v1"))
    }

    /// `user`'s credential.
    pub fn credential(&self, user: &UserId) -> ProxyCredential {
        ProxyCredential {
            name: BASE64URL_NOPAD.encode(user.as_str().as_bytes()),
            password: HEXLOWER.encode(&tag(&self.0, user.as_str().as_bytes())),
        }
    }

    /// The user whose credential `name` and `password` are, or `None`:
    /// the tag is compared in constant time.
    pub fn verify(&self, name: &str, password: &str) -> Option<UserId> {
        let id = BASE64URL_NOPAD.decode(name.as_bytes()).ok()?;
        let claimed = HEXLOWER.decode(password.as_bytes()).ok()?;
        let mut mac = self.0.clone();
        mac.update(&id);
        mac.verify_slice(&claimed).ok()?;
        UserId::parse(std::str::from_utf8(&id).ok()?).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_credential_is_its_users_alone_and_the_keys() {
        let key = ProxyKey::new(b"a cluster secret of enough length");
        let alice = UserId::parse("a.b@corp.example").unwrap();
        let bob = UserId::parse("bob").unwrap();
        let c = key.credential(&alice);
        assert_eq!(key.verify(&c.name, &c.password), Some(alice.clone()));
        assert!(
            c.name
                .bytes()
                .chain(c.password.bytes())
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
            "{c:?}"
        );
        // Another user's name with this tag, this name with another's tag,
        // another key, a cut or altered tag: none passes.
        let b = key.credential(&bob);
        assert_eq!(key.verify(&b.name, &c.password), None);
        assert_eq!(key.verify(&c.name, &b.password), None);
        let other = ProxyKey::new(b"another cluster secret, same size");
        assert_eq!(other.verify(&c.name, &c.password), None);
        assert_eq!(key.verify(&c.name, &c.password[..62]), None);
        let mut flipped = c.password.clone().into_bytes();
        flipped[0] = if flipped[0] == b'0' { b'1' } else { b'0' };
        assert_eq!(
            key.verify(&c.name, std::str::from_utf8(&flipped).unwrap()),
            None
        );
        assert_eq!(key.verify("", ""), None);
        assert_eq!(key.verify("!!", &c.password), None);
    }
}
