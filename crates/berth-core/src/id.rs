use std::fmt;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Longest accepted user id, in bytes.
pub const MAX_USER_ID_BYTES: usize = 128;
/// Longest slug that is used unchanged, and the longest readable prefix of a
/// hashed slug.
const MAX_PLAIN_SLUG: usize = 32;
/// Characters escaped in a path segment: everything but RFC 3986
/// "unreserved", so `@`, `?`, `#`, space and non-ASCII survive a URL.
const PATH_SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Why a string is not a valid [`UserId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidUserId {
    #[error("user id is empty")]
    Empty,
    #[error("user id is {0} bytes long; the limit is {MAX_USER_ID_BYTES}")]
    TooLong(usize),
    #[error("user id starts with '.'")]
    LeadingDot,
    #[error("user id contains the forbidden character {0:?}")]
    ForbiddenChar(char),
}

/// A user id from the operator's identity system, validated (design §9).
///
/// A valid id is 1–128 bytes of UTF-8 with no control characters, no `/`,
/// `\` or NUL, and no leading `.`. The raw id never reaches a path, a shell,
/// SQL text or a Kubernetes name: use [`UserId::slug`] for those.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct UserId(String);

impl UserId {
    /// Validates `raw` as a user id.
    pub fn parse(raw: &str) -> Result<Self, InvalidUserId> {
        if raw.is_empty() {
            return Err(InvalidUserId::Empty);
        }
        if raw.len() > MAX_USER_ID_BYTES {
            return Err(InvalidUserId::TooLong(raw.len()));
        }
        if raw.starts_with('.') {
            return Err(InvalidUserId::LeadingDot);
        }
        if let Some(c) = raw
            .chars()
            .find(|&c| c.is_control() || c == '/' || c == '\\')
        {
            return Err(InvalidUserId::ForbiddenChar(c));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id made safe for file names, DNS labels and Kubernetes names.
    pub fn slug(&self) -> Slug {
        Slug::of(&self.0)
    }

    /// The id percent-encoded as one URL path segment (everything but
    /// unreserved characters escaped). Every URL berth hands out and the
    /// base path its program sees use this one form, so they always agree
    /// with what the proxy receives and forwards.
    pub fn path_segment(&self) -> String {
        utf8_percent_encode(&self.0, PATH_SEGMENT).to_string()
    }

    /// The base path the proxy serves this user under: `/u/<segment>/`,
    /// with the segment encoded by [`UserId::path_segment`].
    pub fn base_path(&self) -> String {
        format!("/u/{}/", utf8_percent_encode(&self.0, PATH_SEGMENT))
    }
}

impl TryFrom<String> for UserId {
    type Error = InvalidUserId;
    fn try_from(raw: String) -> Result<Self, Self::Error> {
        Self::parse(&raw)
    }
}

impl From<UserId> for String {
    fn from(id: UserId) -> Self {
        id.0
    }
}

impl fmt::Display for UserId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for UserId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UserId({:?})", self.0)
    }
}

/// A user id made safe for file names, DNS labels and Kubernetes names.
///
/// An id that already is a plain DNS label (`[a-z0-9]([-a-z0-9]*[a-z0-9])?`,
/// at most 32 characters, no `--`) is its own slug. Any other id becomes a
/// readable prefix followed by `---` and 8 hex digits of its SHA-256. Plain
/// slugs never contain `--` and hashed ones always do, so the two kinds
/// cannot collide.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Slug(String);

impl Slug {
    fn of(id: &str) -> Self {
        if Self::is_plain(id) {
            return Self(id.to_owned());
        }
        let mut prefix = String::with_capacity(MAX_PLAIN_SLUG);
        for c in id.chars().flat_map(char::to_lowercase) {
            if c.is_ascii_lowercase() || c.is_ascii_digit() {
                prefix.push(c);
            } else if !prefix.ends_with('-') {
                prefix.push('-');
            }
        }
        let trimmed = prefix.trim_matches('-');
        let mut prefix = if trimmed.starts_with(|c: char| c.is_ascii_lowercase()) {
            trimmed.to_owned()
        } else if trimmed.is_empty() {
            "x".to_owned()
        } else {
            format!("x-{trimmed}")
        };
        prefix.truncate(MAX_PLAIN_SLUG);
        let prefix = prefix.trim_end_matches('-');
        let digest = Sha256::digest(id.as_bytes());
        Self(format!("{prefix}---{}", hex::encode(&digest[..4])))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `s` is a plain slug: a DNS label
    /// (`[a-z0-9]([-a-z0-9]*[a-z0-9])?`) of at most 32 characters without
    /// `--`. Such an id is its own slug; a hashed slug never passes.
    pub fn is_plain(s: &str) -> bool {
        let bytes = s.as_bytes();
        !bytes.is_empty()
            && bytes.len() <= MAX_PLAIN_SLUG
            && bytes
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
            && bytes[0] != b'-'
            && bytes[bytes.len() - 1] != b'-'
            && !s.contains("--")
    }
}

impl fmt::Display for Slug {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Slug {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Slug({:?})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn is_dns_label(s: &str) -> bool {
        let b = s.as_bytes();
        !b.is_empty()
            && b.len() <= 63
            && b.iter()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
            && b[0] != b'-'
            && b[b.len() - 1] != b'-'
    }

    #[test]
    fn rejects_the_forbidden_ids() {
        let long = "a".repeat(200);
        let cases: [(&str, InvalidUserId); 7] = [
            ("", InvalidUserId::Empty),
            ("..", InvalidUserId::LeadingDot),
            (".hidden", InvalidUserId::LeadingDot),
            (&long, InvalidUserId::TooLong(200)),
            ("a\0b", InvalidUserId::ForbiddenChar('\0')),
            ("a\nb", InvalidUserId::ForbiddenChar('\n')),
            ("a/b", InvalidUserId::ForbiddenChar('/')),
        ];
        for (raw, want) in cases {
            assert_eq!(UserId::parse(raw), Err(want), "{raw:?}");
        }
        assert_eq!(
            UserId::parse("a\\b"),
            Err(InvalidUserId::ForbiddenChar('\\'))
        );
        assert!(UserId::parse(&"a".repeat(128)).is_ok());
    }

    #[test]
    fn plain_labels_are_their_own_slug() {
        for id in ["alice", "bob-2", "a", "0day", &"a".repeat(32)] {
            assert_eq!(UserId::parse(id).unwrap().slug().as_str(), id);
        }
    }

    #[test]
    fn other_ids_get_a_readable_prefix_and_a_hash() {
        let slug = UserId::parse("A.B@corp.example").unwrap().slug();
        assert!(slug.as_str().starts_with("a-b-corp-example---"), "{slug}");
        assert_eq!(slug.as_str().len(), "a-b-corp-example---".len() + 8);
        let slug = UserId::parse("7up").unwrap().slug();
        assert_eq!(slug.as_str(), "7up", "digits may lead a plain label");
        let slug = UserId::parse("_7up").unwrap().slug();
        assert!(slug.as_str().starts_with("x-7up---"), "{slug}");
        let slug = UserId::parse("日本").unwrap().slug();
        assert!(slug.as_str().starts_with("x---"), "{slug}");
        let slug = UserId::parse(&"b".repeat(33)).unwrap().slug();
        assert!(slug.as_str().starts_with(&format!("{}---", "b".repeat(32))));
    }

    #[test]
    fn path_segments_escape_all_but_unreserved() {
        let cases = [
            ("alice", "alice"),
            ("a.b_c~d-e", "a.b_c~d-e"),
            ("a@b.c", "a%40b.c"),
            ("a b", "a%20b"),
            ("a?b#c%d", "a%3Fb%23c%25d"),
            ("日", "%E6%97%A5"),
        ];
        for (raw, want) in cases {
            let id = UserId::parse(raw).unwrap();
            assert_eq!(id.path_segment(), want, "{raw:?}");
            assert_eq!(id.base_path(), format!("/u/{want}/"), "{raw:?}");
        }
    }

    #[test]
    fn plain_is_exactly_the_own_slug_rule() {
        for s in ["alice", "a-1", "0day"] {
            assert!(Slug::is_plain(s), "{s:?}");
        }
        for s in ["", "-a", "a-", "a--b", "Alice", "a.b", &"a".repeat(33)] {
            assert!(!Slug::is_plain(s), "{s:?}");
        }
        let hashed = UserId::parse("A@b").unwrap().slug();
        assert!(!Slug::is_plain(hashed.as_str()));
    }

    proptest! {
        #[test]
        fn every_slug_is_a_dns_label(id in "[^/\\\\\\p{Cc}.][^/\\\\\\p{Cc}]{0,60}") {
            if let Ok(id) = UserId::parse(&id) {
                let slug = id.slug();
                prop_assert!(is_dns_label(slug.as_str()), "{:?} -> {:?}", id, slug);
            }
        }

        #[test]
        fn distinct_ids_never_share_a_slug(
            a in "[a-zA-Z0-9._@+-]{1,40}",
            b in "[a-zA-Z0-9._@+-]{1,40}",
        ) {
            if let (Ok(ua), Ok(ub)) = (UserId::parse(&a), UserId::parse(&b)) {
                if a != b {
                    prop_assert_ne!(ua.slug(), ub.slug());
                }
            }
        }

        #[test]
        fn near_identical_ids_never_share_a_slug(base in "[a-z]{1,20}", suffix in "[A-Z_.@]{1,3}") {
            // The prefixes collapse to the same text; only the hash differs.
            let a = UserId::parse(&format!("{base}{suffix}")).unwrap();
            let b = UserId::parse(&format!("{base}-")).unwrap();
            prop_assert_ne!(a.slug(), b.slug());
        }
    }
}
