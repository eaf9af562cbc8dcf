//! Secrets kept as their SHA-256 and compared in constant time: the
//! token hash berth stores, and the secrets shared with peers that send
//! them in a header (the SSO proxy, a metrics scraper). Other nodes never
//! send theirs: they sign ([`crate::peer_auth`]).

use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// A secret shared with a peer (the SSO proxy, a scraper) and sent in
/// a header. Kept as its SHA-256 so a presented value is compared in
/// constant time whatever its length.
#[derive(Clone)]
pub struct SharedSecret {
    hash: TokenHash,
    header: HeaderValue,
}

impl std::fmt::Debug for SharedSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedSecret(…)")
    }
}

/// A secret that cannot be sent in an HTTP header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a shared secret must be visible ASCII without spaces (it is sent as an HTTP header)")]
pub struct InvalidSecret;

impl SharedSecret {
    /// The secret `secret`, trimmed; refused when it is empty or holds
    /// anything but visible ASCII, which a header could not carry.
    pub fn new(secret: &str) -> Result<Self, InvalidSecret> {
        let secret = secret.trim();
        if secret.is_empty() || !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(InvalidSecret);
        }
        let mut header = HeaderValue::from_str(secret).map_err(|_| InvalidSecret)?;
        header.set_sensitive(true);
        Ok(Self {
            hash: TokenHash::of(secret),
            header,
        })
    }

    /// Whether `presented` is the secret (constant time).
    pub fn matches(&self, presented: &[u8]) -> bool {
        TokenHash(Sha256::digest(presented).into()).ct_eq(&self.hash)
    }

    /// Whether `headers` carry exactly one `name` header, holding the
    /// secret.
    pub fn verify_in(&self, headers: &HeaderMap, name: &HeaderName) -> bool {
        let mut values = headers.get_all(name).iter();
        match (values.next(), values.next()) {
            (Some(value), None) => self.matches(value.as_bytes()),
            _ => false,
        }
    }

    /// The value to send in the header.
    pub fn header_value(&self) -> &HeaderValue {
        &self.header
    }
}

/// The SHA-256 of a token: what berth stores and compares.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenHash([u8; 32]);

impl TokenHash {
    /// The hash of `token`.
    pub fn of(token: &str) -> Self {
        Self(Sha256::digest(token.as_bytes()).into())
    }

    /// Lowercase hex, the store's representation.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Constant-time equality.
    pub fn ct_eq(&self, other: &TokenHash) -> bool {
        self.0.ct_eq(&other.0).into()
    }
}

impl std::fmt::Debug for TokenHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Short on purpose: a hash in a log line is enough to correlate.
        write!(f, "TokenHash({}…)", hex::encode(&self.0[..4]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_secrets_match_exactly() {
        assert!(SharedSecret::new("").is_err());
        assert!(SharedSecret::new("has space").is_err());
        assert!(SharedSecret::new("tab\tin").is_err());
        let secret = SharedSecret::new("s3cret").unwrap();
        assert!(secret.matches(b"s3cret"));
        for wrong in [
            &b""[..],
            b"s3cre",
            b"s3cret ",
            b"S3CRET",
            b"s3cret-and-more",
        ] {
            assert!(!secret.matches(wrong), "{wrong:?}");
        }
        assert!(!format!("{secret:?}").contains("s3cret"));
        let name = HeaderName::from_static("x-test-secret");
        let mut headers = HeaderMap::new();
        assert!(!secret.verify_in(&headers, &name));
        headers.insert(name.clone(), secret.header_value().clone());
        assert!(secret.verify_in(&headers, &name));
        headers.append(name.clone(), secret.header_value().clone());
        assert!(
            !secret.verify_in(&headers, &name),
            "two secret headers are refused"
        );
    }
}
