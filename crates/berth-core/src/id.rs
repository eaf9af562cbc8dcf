use std::fmt;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Longest accepted user id, in bytes.
pub const MAX_USER_ID_BYTES: usize = 128;
/// Longest slug that is used unchanged.
const MAX_PLAIN_SLUG: usize = 32;
/// Longest readable prefix of a hashed slug. Short enough that a hashed
/// slug is no longer than the 8-hex-digit slugs of earlier berth versions
/// (32 + 3 + 8 = 43 characters): a data dir whose shim socket paths fit
/// before still fits (see `berth-local`'s socket-path check).
const MAX_HASHED_PREFIX: usize = 14;
/// Characters of SHA-256 in a hashed slug: 26 base32 characters carry 130
/// bits, so two distinct ids share a slug only by a SHA-256 collision.
const HASH_CHARS: usize = 26;
/// Longest slug of either kind (within 53, so `berth-<slug>` fits a
/// 63-character Kubernetes name; 43 here, see [`MAX_HASHED_PREFIX`]).
pub const MAX_SLUG_LEN: usize = MAX_HASHED_PREFIX + 3 + HASH_CHARS;
/// The readable prefix of the slugs of berth before slugs were recorded, which ended in
/// 8 hex digits (32 bits) of SHA-256.
const LEGACY_PREFIX: usize = 32;
/// Characters escaped in a path segment: everything but RFC 3986
/// "unreserved", so `@`, `?`, `#`, space and non-ASCII survive a URL.
const PATH_SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Why a string is not a valid [`UserId`]. It travels in an error
/// answer's JSON ([`crate::ErrorBody`]) in `snake_case`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InvalidUserId {
    /// The id is the empty string.
    #[error("user id is empty")]
    Empty,
    /// The id is longer than 128 bytes; its length in bytes.
    #[error("user id is {0} bytes long; the limit is {MAX_USER_ID_BYTES}")]
    TooLong(usize),
    /// The id starts with `.`, so it could read as `.`, `..` or a hidden
    /// file.
    #[error("user id starts with '.'")]
    LeadingDot,
    /// The id holds a control character, `/` or `\`; the first one found.
    #[error("user id contains the forbidden character {0:?}")]
    ForbiddenChar(char),
}

/// A user id from the operator's identity system, validated.
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

    /// The id as given. Never use it in a path, a shell command, SQL text
    /// or a Kubernetes name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id made safe for file names, DNS labels and Kubernetes names.
    ///
    /// This is the slug a new user gets. berth uses the slug the store
    /// *recorded* for a user (which may be a [`UserId::legacy_slug`] of an
    /// older data root): ask the store, not this function, where a user's
    /// files live.
    pub fn slug(&self) -> Slug {
        Slug::of(&self.0)
    }

    /// The slug an earlier berth (before slugs were recorded) gave this id: the same
    /// readable prefix, up to 32 characters, then `---` and only 8 hex
    /// digits of SHA-256, so distinct ids could share it. Used only to find
    /// a data root such a berth created; never recorded for a new user.
    pub fn legacy_slug(&self) -> Slug {
        if Slug::is_plain(&self.0) {
            return Slug(self.0.clone());
        }
        let prefix = readable_prefix(&self.0, LEGACY_PREFIX);
        let digest = Sha256::digest(self.0.as_bytes());
        Slug(format!("{prefix}---{}", hex::encode(&digest[..4])))
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
/// readable prefix (at most 14 characters) followed by `---` and 26
/// characters of its SHA-256 in DNSSEC base32 (`0-9a-v`, 130 bits). Plain
/// slugs never contain `--` and hashed ones always do, so the two kinds
/// cannot collide; every slug is a DNS label of at most [`MAX_SLUG_LEN`]
/// characters.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Slug(String);

/// Why a stored string is not a [`Slug`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a slug (a DNS label of at most {MAX_SLUG_LEN} characters)")]
pub struct InvalidSlug(pub String);

impl Slug {
    fn of(id: &str) -> Self {
        if Self::is_plain(id) {
            return Self(id.to_owned());
        }
        let prefix = readable_prefix(id, MAX_HASHED_PREFIX);
        let digest = Sha256::digest(id.as_bytes());
        let mut hash = data_encoding::BASE32_DNSSEC.encode(&digest);
        hash.truncate(HASH_CHARS);
        Self(format!("{prefix}---{hash}"))
    }

    /// A slug read back from where berth recorded it (the store). Accepts
    /// any DNS label of at most [`MAX_SLUG_LEN`] characters, so slugs of
    /// earlier versions ([`UserId::legacy_slug`]) read back too; nothing
    /// else, so a stored value can never put `/` or `..` into a path.
    pub fn parse(s: &str) -> Result<Self, InvalidSlug> {
        let b = s.as_bytes();
        let label = !b.is_empty()
            && b.len() <= MAX_SLUG_LEN
            && b.iter()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
            && b[0] != b'-'
            && b[b.len() - 1] != b'-';
        if label {
            Ok(Self(s.to_owned()))
        } else {
            Err(InvalidSlug(s.to_owned()))
        }
    }

    /// The slug's text: a DNS label, safe in a file name.
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

/// The readable part of a hashed slug: `id` lowercased, runs of anything
/// but `[a-z0-9]` turned into one `-`, trimmed, prefixed `x-` unless it
/// starts with a letter (`x` if nothing is left), cut to `max` characters
/// and trimmed again. Never contains `--`.
fn readable_prefix(id: &str, max: usize) -> String {
    let mut prefix = String::with_capacity(max);
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
    prefix.truncate(max);
    let kept = prefix.trim_end_matches('-').len();
    prefix.truncate(kept);
    prefix
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
        let hash_len = 3 + HASH_CHARS;
        let slug = UserId::parse("A.B@corp.example").unwrap().slug();
        assert!(slug.as_str().starts_with("a-b-corp-examp---"), "{slug}");
        assert_eq!(slug.as_str().len(), "a-b-corp-examp".len() + hash_len);
        let hash = &slug.as_str()["a-b-corp-examp---".len()..];
        assert!(
            hash.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'v').contains(&b)),
            "DNSSEC base32: {hash}"
        );
        let slug = UserId::parse("7up").unwrap().slug();
        assert_eq!(slug.as_str(), "7up", "digits may lead a plain label");
        let slug = UserId::parse("_7up").unwrap().slug();
        assert!(slug.as_str().starts_with("x-7up---"), "{slug}");
        let slug = UserId::parse("日本").unwrap().slug();
        assert!(slug.as_str().starts_with("x---"), "{slug}");
        let slug = UserId::parse(&"b".repeat(33)).unwrap().slug();
        assert_eq!(slug.as_str().len(), MAX_SLUG_LEN);
        assert!(slug.as_str().starts_with(&format!("{}---", "b".repeat(14))));
        // A cut that ends on a separator does not leave `----`.
        let slug = UserId::parse("abcdefghijklm.nopq").unwrap().slug();
        assert!(slug.as_str().starts_with("abcdefghijklm---"), "{slug}");
        assert!(!slug.as_str().contains("----"), "{slug}");
    }

    /// A pair that shared one 32-bit slug under earlier versions, so
    /// the second user got the first one's data root.
    #[test]
    fn the_colliding_pair_of_issue_9_gets_two_slugs() {
        let a = UserId::parse("alice*{@(.:$*corp").unwrap();
        let b = UserId::parse("alice<;|<@(:{corp").unwrap();
        assert_eq!(a.legacy_slug().as_str(), "alice-corp---eb9ba467");
        assert_eq!(a.legacy_slug(), b.legacy_slug());
        assert_ne!(a.slug(), b.slug());
        for id in [&a, &b] {
            assert!(id.slug().as_str().starts_with("alice-corp---"));
            assert_eq!(Slug::parse(id.slug().as_str()), Ok(id.slug()));
        }
    }

    #[test]
    fn legacy_slugs_are_plain_ids_or_eight_hex_digits() {
        assert_eq!(
            UserId::parse("alice").unwrap().legacy_slug().as_str(),
            "alice"
        );
        let legacy = UserId::parse("A.B@corp.example").unwrap().legacy_slug();
        assert!(
            legacy.as_str().starts_with("a-b-corp-example---"),
            "{legacy}"
        );
        assert_eq!(legacy.as_str().len(), "a-b-corp-example---".len() + 8);
        let longest = UserId::parse(&"Z".repeat(100)).unwrap().legacy_slug();
        assert_eq!(longest.as_str().len(), MAX_SLUG_LEN);
        assert!(
            Slug::parse(longest.as_str()).is_ok(),
            "legacy slugs read back"
        );
    }

    #[test]
    fn stored_slugs_must_be_dns_labels() {
        for good in ["alice", "a-b---0123456789abcdefghijklmnop", "x", "0"] {
            assert_eq!(Slug::parse(good).unwrap().as_str(), good);
        }
        let too_long = "a".repeat(MAX_SLUG_LEN + 1);
        for bad in [
            "",
            "-a",
            "a-",
            "A",
            "a/b",
            "..",
            "a.b",
            "a b",
            too_long.as_str(),
        ] {
            let err = Slug::parse(bad).unwrap_err();
            assert_eq!(err, InvalidSlug(bad.to_owned()));
            assert!(err.to_string().contains("is not a slug"), "{err}");
        }
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
                prop_assert!(slug.as_str().len() <= MAX_SLUG_LEN && MAX_SLUG_LEN <= 53);
                prop_assert_eq!(Slug::parse(slug.as_str()), Ok(slug.clone()));
                let legacy = id.legacy_slug();
                prop_assert!(is_dns_label(legacy.as_str()), "{:?} -> {:?}", id, legacy);
            }
        }

        /// Ids that differ only in the characters the readable prefix
        /// folds away (case, punctuation, non-ASCII) and are long enough
        /// for it to be cut: only the hash can tell them apart.
        #[test]
        fn ids_that_fold_to_one_prefix_never_share_a_slug(
            ids in proptest::collection::hash_set("[a-c][a-cA-C*{@(.:$<;|_ é-]{0,40}", 2..64),
        ) {
            let mut seen = std::collections::HashMap::new();
            for id in &ids {
                let Ok(user) = UserId::parse(id) else { continue };
                let slug = user.slug();
                prop_assert!(is_dns_label(slug.as_str()) && slug.as_str().len() <= MAX_SLUG_LEN);
                if let Some(other) = seen.insert(slug.clone(), id.clone()) {
                    prop_assert!(false, "{:?} and {:?} share {:?}", other, id, slug);
                }
            }
        }

        #[test]
        fn distinct_ids_never_share_a_slug(
            a in "[a-zA-Z0-9._@+-]{1,40}",
            b in "[a-zA-Z0-9._@+-]{1,40}",
        ) {
            if let (Ok(ua), Ok(ub)) = (UserId::parse(&a), UserId::parse(&b))
                && a != b {
                    prop_assert_ne!(ua.slug(), ub.slug());
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
