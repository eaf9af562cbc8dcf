//! The sandbox's minimal `/etc`: a fresh tmpfs holding a passwd and a group
//! file made for the user, and, bound read-only from the host, only what
//! programs need to run and to reach the network (the dynamic linker's
//! cache, name resolution, TLS roots, time zone, the `alternatives`
//! links). Everything else of the host's `/etc` (configuration files with
//! credentials, ssh host keys, shadow files, berth's own config) is not
//! there at all.

use std::path::Path;

/// Host `/etc` entries a sandbox sees, when the host has them.
pub(crate) const ALLOWED: &[&str] = &[
    "alternatives",
    "bash.bashrc",
    "ca-certificates",
    "ca-certificates.conf",
    "crypto-policies",
    "debian_version",
    "fonts",
    "gai.conf",
    "host.conf",
    "hostname",
    "hosts",
    "inputrc",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "lsb-release",
    "mime.types",
    "nsswitch.conf",
    "os-release",
    "pki",
    "profile",
    "protocols",
    "resolv.conf",
    "services",
    "ssl",
    "terminfo",
    "timezone",
];

/// What one allowed entry is on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Entry {
    Dir,
    File,
    /// A symbolic link, recreated with the same target (which then
    /// resolves inside the sandbox's own view).
    Link(std::path::PathBuf),
}

/// The allowed entries present under `etc` (the host's `/etc`), by name.
pub(crate) fn host_entries(etc: &Path) -> Vec<(&'static str, Entry)> {
    ALLOWED
        .iter()
        .filter_map(|&name| {
            let path = etc.join(name);
            let meta = std::fs::symlink_metadata(&path).ok()?;
            let kind = meta.file_type();
            let entry = if kind.is_symlink() {
                Entry::Link(std::fs::read_link(&path).ok()?)
            } else if kind.is_dir() {
                Entry::Dir
            } else if kind.is_file() {
                Entry::File
            } else {
                return None;
            };
            Some((name, entry))
        })
        .collect()
}

/// `/etc/passwd` of a sandbox: root, the user, nobody.
pub(crate) fn passwd(name: &str, uid: u32, gid: u32, home: &Path) -> String {
    format!(
        "root:x:0:0:root:/root:/bin/sh\n\
         {name}:x:{uid}:{gid}:{name}:{}:/bin/sh\n\
         nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        home.display()
    )
}

/// `/etc/group` of a sandbox: root, the user's own group, nogroup.
pub(crate) fn group(name: &str, gid: u32) -> String {
    format!("root:x:0:\n{name}:x:{gid}:\nnogroup:x:65534:\n")
}

/// Whether `name` can stand in a passwd line as is (the slug always can;
/// this guards the format against a future change of slugs).
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_users_entries() {
        let home = Path::new("/var/lib/berth/users/alice/home");
        let passwd = passwd("alice", 200_001, 200_001, home);
        assert!(
            passwd.contains(
                "\nalice:x:200001:200001:alice:/var/lib/berth/users/alice/home:/bin/sh\n"
            )
        );
        assert!(passwd.starts_with("root:x:0:0:"));
        assert_eq!(passwd.lines().count(), 3);
        assert_eq!(
            group("alice", 200_001),
            "root:x:0:\nalice:x:200001:\nnogroup:x:65534:\n"
        );
        assert!(valid_name("x-ab---3fz"));
        assert!(!valid_name("a:b"));
        assert!(!valid_name("a\nroot:x:0:0::/:/bin/sh"));
        assert!(!valid_name(""));
    }

    #[test]
    fn secrets_of_the_host_are_not_on_the_list() {
        for secret in [
            "shadow", "gshadow", "ssh", "sudoers", "berth", "passwd", "group",
        ] {
            assert!(!ALLOWED.contains(&secret), "{secret}");
        }
        let entries = host_entries(Path::new("/etc"));
        assert!(
            entries
                .iter()
                .any(|(n, _)| *n == "ld.so.cache" || *n == "hosts"),
            "{entries:?}"
        );
    }
}
