//! Where a user's files live: the user-owned data root and berth's own run
//! directory, plus the validation of the requested working folder.
//!
//! Paths are built from the slug only, never from the raw user id.

use std::fs::DirBuilder;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use berth_core::{MAX_SLUG_LEN, Role, Slug};

use crate::isolation::fsafe::{Dir, OnLink, Owner};

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
    /// The working directory of an instance started in `folder` (already
    /// normalised: see [`berth_core::normalize_folder`]).
    pub fn workdir(&self, folder: &str) -> PathBuf {
        if folder.is_empty() {
            self.ws()
        } else {
            self.ws().join(folder)
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

    /// The names of the directories of berth's layout inside the root.
    pub const LAYOUT: [&'static str; 5] = ["home", "ws", "tmp", "patches", "logs"];

    /// Creates the data root with its subdirectories, the working folder
    /// `folder` (normalised, relative to `ws`) and the run directory, all
    /// mode 0700; the root and everything in it belong to `owner` (the
    /// user's account) when there is one. Below the root nothing is
    /// followed through a symbolic link (see `isolation::fsafe`): a link
    /// the user put in place of a directory of the layout is replaced, one
    /// on the way to the folder is refused. Returns the working folder.
    pub fn prepare(&self, folder: &str, owner: Option<Owner>) -> std::io::Result<PathBuf> {
        create_private_dir(&self.run)?;
        let users = self.root.parent().ok_or_else(|| {
            std::io::Error::other(format!("{} has no parent", self.root.display()))
        })?;
        create_private_dir_keeping_mode(users)?;
        let users = Dir::open(users)?;
        let slug = self
            .root
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| std::io::Error::other("the data root has no name"))?;
        let root = users.child(slug, owner, OnLink::Refuse)?;
        root.set_private(owner)?;
        for name in Self::LAYOUT {
            root.child(name, owner, OnLink::Replace)?
                .set_private(owner)?;
        }
        let ws = root.child("ws", owner, OnLink::Replace)?;
        let cwd = ws.walk(folder, owner, OnLink::Refuse)?;
        Ok(cwd.path().to_owned())
    }

    /// Opens the log of `role` for reading, never through a link, and only
    /// if it is a regular file (not a FIFO that would block the reader).
    pub fn open_log(&self, role: Role) -> std::io::Result<std::fs::File> {
        let logs = Dir::open(&self.root)?.child_existing("logs")?;
        logs.open_regular(&format!("{}.log", role.as_str()))
    }

    /// The same for the file the log was last rotated to (`<role>.log.1`).
    pub fn open_rotated_log(&self, role: Role) -> std::io::Result<std::fs::File> {
        let logs = Dir::open(&self.root)?.child_existing("logs")?;
        logs.open_regular(&format!("{}.log.1", role.as_str()))
    }

    /// Writes `bytes` as the file `name` of the layout directory `dir`
    /// (e.g. `patches`), never through a link, owned by `owner`.
    pub fn write_file(
        &self,
        dir: Option<&str>,
        name: &str,
        bytes: &[u8],
        owner: Option<Owner>,
    ) -> std::io::Result<()> {
        let root = Dir::open(&self.root)?;
        match dir {
            Some(dir) => root
                .child(dir, owner, OnLink::Replace)?
                .write_file(name, bytes, owner),
            None => root.write_file(name, bytes, owner),
        }
    }
}

/// Creates `dir` (and parents) with mode 0700 where missing, leaving an
/// existing one as it is (the spawner sets `users/` to its mode at start).
fn create_private_dir_keeping_mode(dir: &Path) -> std::io::Result<()> {
    DirBuilder::new().recursive(true).mode(0o700).create(dir)
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

#[cfg(test)]
mod tests {
    use super::*;
    use berth_core::UserId;

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
        let cwd = paths.prepare("a/b", None).unwrap();
        assert_eq!(cwd, paths.ws().join("a/b"));
        for dir in [
            paths.root.clone(),
            paths.ws(),
            paths.logs(),
            paths.run.clone(),
            cwd,
        ] {
            let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", dir.display());
        }
        // A link planted in place of `tmp` is replaced, its target untouched.
        let victim = tmp.path().join("victim");
        std::fs::create_dir(&victim).unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::remove_dir(paths.tmp()).unwrap();
        std::os::unix::fs::symlink(&victim, paths.tmp()).unwrap();
        paths.prepare("", None).unwrap();
        assert!(!std::fs::symlink_metadata(paths.tmp()).unwrap().is_symlink());
        let mode = std::fs::metadata(&victim).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o755);
        paths
            .write_file(Some("patches"), "main.yaml", b"x: 1", None)
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(paths.patch_file("yaml")).unwrap(),
            "x: 1"
        );
    }
}
