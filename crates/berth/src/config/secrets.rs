//! Where berth's secrets may come from. Every program berth runs is
//! somebody else's, on the same host: it can read world-readable files and
//! `/proc/<berth>/cmdline`. So a secret is taken from the environment
//! (which berth wipes once read) or from a file only berth's user can
//! read, and never from the command line.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::error::ConfigError;
use super::provenance::Origin;
use super::sections::Config;

/// The keys whose values are secrets, where a config file may hold them.
const SECRET_KEYS: &[&str] = &[
    "cluster_secret",
    "admin_token",
    "metrics.token",
    "proxy.header_secret",
];

/// Refuses `path` when its group or other read bit is set: `what` (a
/// secret it holds) would then be readable by other users, the instances'
/// uids among them.
pub fn refuse_readable_by_others(path: &Path, what: &str) -> Result<(), ConfigError> {
    let meta = std::fs::metadata(path).map_err(|source| ConfigError::SecretFile {
        path: path.to_owned(),
        source,
    })?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o044 != 0 {
        return Err(ConfigError::ReadableSecret {
            path: path.to_owned(),
            what: what.to_owned(),
            mode,
        });
    }
    Ok(())
}

/// Whether a store URL carries a password, in its user info or as a
/// `password` query parameter (which PostgreSQL URLs accept too).
pub fn url_has_password(url: &str) -> bool {
    let Ok(url) = reqwest::Url::parse(url) else {
        return false;
    };
    url.password().is_some_and(|p| !p.is_empty())
        || url
            .query_pairs()
            .any(|(key, value)| key == "password" && !value.is_empty())
}

impl Config {
    /// Reads `store_file` into `store`, and refuses a config file or store
    /// file that holds a secret and other users can read. Runs before
    /// [`Config::validate`], which then checks the URL like any other.
    pub fn read_secret_files(&mut self) -> Result<(), ConfigError> {
        if let Some(file) = self.provenance.file.clone() {
            let in_file =
                |key: &str| matches!(self.provenance.keys.get(key), Some(Origin::File { .. }));
            let mut held: Vec<&str> = SECRET_KEYS.iter().copied().filter(|k| in_file(k)).collect();
            if in_file("store") && self.store.as_deref().is_some_and(url_has_password) {
                held.push("the store URL's password");
            }
            if !held.is_empty() {
                refuse_readable_by_others(&file, &held.join(", "))?;
            }
        }
        self.read_oidc_client_secret()?;
        let Some(path) = self.store_file.clone() else {
            return Ok(());
        };
        if self.store.is_some() {
            return Err(self.invalid(
                "store_file",
                "is set together with store; set only one of them",
            ));
        }
        if path.as_os_str().is_empty() {
            return Err(self.invalid("store_file", "must not be empty"));
        }
        refuse_readable_by_others(&path, "the store URL")?;
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::SecretFile {
            path: path.clone(),
            source,
        })?;
        let url = text.trim();
        if url.is_empty() {
            return Err(self.invalid("store_file", format!("{} is empty", path.display())));
        }
        self.store = Some(url.to_owned());
        // A bad URL is reported where the file was named.
        if let Some(origin) = self.provenance.keys.get("store_file").cloned() {
            self.provenance.keys.insert("store".to_owned(), origin);
        }
        Ok(())
    }

    /// The OpenID client secret from `[auth.oidc] client_secret_file`.
    fn read_oidc_client_secret(&mut self) -> Result<(), ConfigError> {
        let Some(path) = self
            .auth
            .oidc
            .as_ref()
            .and_then(|o| o.client_secret_file.clone())
        else {
            return Ok(());
        };
        if self
            .auth
            .oidc
            .as_ref()
            .is_some_and(|o| o.client_secret.is_some())
        {
            return Err(self.invalid(
                "auth.oidc.client_secret_file",
                "is set together with BERTH_OIDC_CLIENT_SECRET; set only one of them",
            ));
        }
        refuse_readable_by_others(&path, "the OpenID client secret")?;
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::SecretFile {
            path: path.clone(),
            source,
        })?;
        let secret = text.trim();
        if secret.is_empty() {
            return Err(self.invalid(
                "auth.oidc.client_secret_file",
                format!("{} is empty", path.display()),
            ));
        }
        if let Some(oidc) = &mut self.auth.oidc {
            oidc.client_secret = Some(secret.to_owned());
        }
        Ok(())
    }

    /// Refuses a store URL with a password given as `--store`: the command
    /// line is world-readable in `/proc/<pid>/cmdline`. Refused rather than
    /// overwritten in berth's memory, because the URL is visible from the
    /// moment berth is started until it gets to overwrite it, and in the
    /// shell's history and `ps` output of whoever started it.
    pub(super) fn refuse_password_on_command_line(&self) -> Result<(), ConfigError> {
        let from_flag = matches!(self.provenance.keys.get("store"), Some(Origin::Flag(_)));
        if from_flag && self.store.as_deref().is_some_and(url_has_password) {
            return Err(self.invalid(
                "store",
                "the URL carries a password, and every user of this host (every program berth runs \
                 included) can read berth's command line in /proc; pass the URL in BERTH_STORE, in \
                 a file named by BERTH_STORE_FILE or the store_file key (mode 0600), or in the \
                 config file (mode 0600)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Overrides;

    #[test]
    fn passwords_are_found_in_user_info_and_query() {
        assert!(url_has_password("postgres://berth:pw@db/berth"));
        assert!(url_has_password("postgres://berth@db/berth?password=pw"));
        assert!(!url_has_password("postgres://berth@db/berth"));
        assert!(!url_has_password("postgres://berth:@db/berth"));
        assert!(!url_has_password("sqlite:///var/lib/berth/berth.db"));
    }

    #[test]
    fn a_password_in_the_store_flag_is_refused_and_not_echoed() {
        let mut c = Config::default();
        c.apply_overrides(&Overrides {
            store: Some("postgres://berth:hunter2@db/berth".into()),
            ..Overrides::default()
        });
        let msg = c.refuse_password_on_command_line().unwrap_err().to_string();
        assert!(
            msg.contains("--store") && msg.contains("BERTH_STORE_FILE"),
            "{msg}"
        );
        assert!(!msg.contains("hunter2"), "{msg}");
        let mut c = Config::default();
        c.apply_env(|name| (name == "BERTH_STORE").then(|| "postgres://berth:pw@db/b".to_owned()));
        c.refuse_password_on_command_line().unwrap();
    }

    #[test]
    fn secret_files_must_not_be_readable_by_others() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.url");
        std::fs::write(&path, "postgres://berth:pw@db/berth\n").unwrap();
        for (mode, ok) in [(0o600, true), (0o400, true), (0o640, false), (0o604, false)] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let mut c = Config {
                store_file: Some(path.clone()),
                ..Config::default()
            };
            let got = c.read_secret_files();
            assert_eq!(got.is_ok(), ok, "{mode:o}: {got:?}");
            if ok {
                assert_eq!(c.store.as_deref(), Some("postgres://berth:pw@db/berth"));
            } else {
                let msg = got.unwrap_err().to_string();
                assert!(
                    msg.contains(&format!("chmod 600 {}", path.display())),
                    "{msg}"
                );
            }
        }
    }
}
