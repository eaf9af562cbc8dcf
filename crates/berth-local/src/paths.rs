//! Where a user's files live: the user-owned data root and berth's own run
//! directory, plus the validation of the requested working folder.
//!
//! Paths are built from the slug only, never from the raw user id (design §9).

use std::fs::DirBuilder;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use berth_core::{MAX_SLUG_LEN, Role, Slug};

/// The longest a unix socket path may be (`sun_path` is 108 bytes with NUL).
pub(crate) const MAX_SOCKET_PATH: usize = 107;

/// Every path that belongs to one user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UserPaths {
    /// `<data_dir>/users/<slug>`: the user's data, kept across instances.
    pub root: PathBuf,
    /// `<data_dir>/run/<slug>`: shim state files and sockets, owned by berth.
    pub run: PathBuf,
}

impl UserPaths {
    pub fn new(data_dir: &Path, slug: &Slug) -> Self {
        Self {
            root: data_dir.join("users").join(slug.as_str()),
            run: data_dir.join("run").join(slug.as_str()),
        }
    }

    pub fn home(&self) -> PathBuf {
        self.root.join("home")
    }
    pub fn ws(&self) -> PathBuf {
        self.root.join("ws")
    }
    pub fn tmp(&self) -> PathBuf {
        self.root.join("tmp")
    }
    pub fn patches(&self) -> PathBuf {
        self.root.join("patches")
    }
    pub fn logs(&self) -> PathBuf {
        self.root.join("logs")
    }
    pub fn log(&self, role: Role) -> PathBuf {
        self.logs().join(format!("{}.log", role.as_str()))
    }
    pub fn patch_file(&self, ext: &str) -> PathBuf {
        let ext = ext.trim_start_matches('.');
        if ext.is_empty() {
            self.patches().join("main")
        } else {
            self.patches().join(format!("main.{ext}"))
        }
    }
    pub fn handoff(&self) -> PathBuf {
        self.root.join("handoff.json")
    }
    pub fn state_file(&self, role: Role) -> PathBuf {
        self.run.join(format!("{}.json", role.as_str()))
    }
    pub fn socket(&self, role: Role) -> PathBuf {
        self.run.join(format!("{}.sock", role.as_str()))
    }

    /// Creates the data root with its subdirectories and the run directory,
    /// all mode 0700: other local users must not read a user's workspace.
    pub fn prepare(&self) -> std::io::Result<()> {
        for dir in [
            self.root.clone(),
            self.home(),
            self.ws(),
            self.tmp(),
            self.patches(),
            self.logs(),
            self.run.clone(),
        ] {
            create_private_dir(&dir)?;
        }
        Ok(())
    }
}

/// Creates `dir` (and parents) and forces mode 0700 on `dir` itself, also
/// when it already existed with looser permissions.
pub(crate) fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Fails when the longest socket path this data dir can produce would not
/// fit in a unix socket address.
pub(crate) fn check_socket_room(data_dir: &Path) -> Result<(), String> {
    let longest = data_dir.as_os_str().len()
        + "/run/".len()
        + MAX_SLUG_LEN
        + "/".len()
        + "watchdog.sock".len();
    if longest > MAX_SOCKET_PATH {
        return Err(format!(
            "data_dir {} is too long: shim socket paths under it can reach {longest} bytes, \
             more than the {MAX_SOCKET_PATH} a unix socket allows; use a shorter data_dir \
             (at most {} bytes)",
            data_dir.display(),
            data_dir.as_os_str().len() - (longest - MAX_SOCKET_PATH),
        ));
    }
    Ok(())
}

/// Validates a requested folder (relative to the workspace) and returns its
/// normalised form: `""` for the workspace root, else `a/b` without `.`
/// components. Absolute paths and `..` are refused so that an instance can
/// never start outside its user's workspace.
pub(crate) fn normalize_folder(folder: Option<&str>) -> Result<String, String> {
    let Some(raw) = folder else {
        return Ok(String::new());
    };
    if raw.contains('\0') {
        return Err("folder contains a NUL byte".into());
    }
    let path = Path::new(raw);
    let mut parts = Vec::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => match part.to_str() {
                Some(s) => parts.push(s),
                None => return Err("folder is not valid UTF-8".into()),
            },
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => {
                return Err(format!("folder {raw:?} must be relative to the workspace"));
            }
            Component::ParentDir => {
                return Err(format!("folder {raw:?} must not contain '..'"));
            }
        }
    }
    Ok(parts.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_core::UserId;

    #[test]
    fn folders_stay_inside_the_workspace() {
        assert_eq!(normalize_folder(None).unwrap(), "");
        assert_eq!(normalize_folder(Some("")).unwrap(), "");
        assert_eq!(normalize_folder(Some(".")).unwrap(), "");
        assert_eq!(normalize_folder(Some("a/./b/")).unwrap(), "a/b");
        assert_eq!(normalize_folder(Some("proj x")).unwrap(), "proj x");
        for bad in ["/etc", "..", "a/../../b", "a/..", "a\0b"] {
            assert!(normalize_folder(Some(bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn paths_use_the_slug_never_the_raw_id() {
        let user = UserId::parse("A.B@corp.example").unwrap();
        let paths = UserPaths::new(Path::new("/d"), &user.slug());
        let slug = user.slug();
        assert_eq!(paths.root, Path::new("/d/users").join(slug.as_str()));
        assert_eq!(
            paths.socket(Role::Watchdog),
            Path::new("/d/run")
                .join(slug.as_str())
                .join("watchdog.sock")
        );
        assert_eq!(paths.log(Role::Main), paths.root.join("logs/main.log"));
        assert_eq!(
            paths.patch_file(".toml"),
            paths.root.join("patches/main.toml")
        );
        assert!(!paths.root.to_string_lossy().contains('@'));
    }

    #[test]
    fn long_data_dirs_are_refused() {
        assert!(check_socket_room(Path::new("/var/lib/berth")).is_ok());
        let long = format!("/{}", "d".repeat(60));
        let err = check_socket_room(Path::new(&long)).unwrap_err();
        assert!(err.contains("too long"), "{err}");
        // The longest accepted dir fits exactly.
        let max = 107 - "/run/".len() - MAX_SLUG_LEN - "/watchdog.sock".len();
        let fits = format!("/{}", "d".repeat(max - 1));
        assert!(check_socket_room(Path::new(&fits)).is_ok());
        let slug = UserId::parse(&"Z".repeat(100)).unwrap().slug();
        assert_eq!(slug.as_str().len(), MAX_SLUG_LEN);
    }

    #[test]
    fn prepared_dirs_are_private() {
        let tmp = tempfile::tempdir().unwrap();
        let user = UserId::parse("alice").unwrap();
        let paths = UserPaths::new(tmp.path(), &user.slug());
        paths.prepare().unwrap();
        for dir in [
            paths.root.clone(),
            paths.ws(),
            paths.logs(),
            paths.run.clone(),
        ] {
            let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", dir.display());
        }
    }
}
