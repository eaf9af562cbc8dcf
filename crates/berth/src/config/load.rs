//! The layers: the file (or the defaults), then the `BERTH_*`
//! environment, then command-line flags, each remembered in the
//! provenance.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::error::{ConfigError, Location};
use super::provenance::{Origin, Provenance, key_at_line, key_lines, key_on_broken_line, line_of};
use super::sections::Config;

/// Environment variables read by [`Config::load`], by key.
pub const ENV_VARS: &[(&str, &str)] = &[
    ("listen", "BERTH_LISTEN"),
    ("data_dir", "BERTH_DATA_DIR"),
    ("store", "BERTH_STORE"),
    ("store_file", "BERTH_STORE_FILE"),
    ("node_id", "BERTH_NODE_ID"),
    ("advertise_url", "BERTH_ADVERTISE_URL"),
    ("cluster_secret", "BERTH_CLUSTER_SECRET"),
    ("admin_token", "BERTH_ADMIN_TOKEN"),
    ("log_format", "BERTH_LOG_FORMAT"),
    // Each replica of a Deployment has its own: its pod's address.
    ("cluster.internal_listen", "BERTH_INTERNAL_LISTEN"),
];

/// The OpenID client secret, when `[auth.oidc]` does not name a file.
pub const OIDC_CLIENT_SECRET_ENV: &str = "BERTH_OIDC_CLIENT_SECRET";

/// Values given on the command line; `None` leaves the lower layers alone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    pub listen: Option<String>,
    pub data_dir: Option<PathBuf>,
    pub store: Option<String>,
    pub node_id: Option<String>,
    pub advertise_url: Option<String>,
    pub log_format: Option<String>,
}

impl Config {
    /// The file (or the defaults when `file` is `None`), then the `BERTH_*`
    /// environment. Not validated: apply flags, then call
    /// [`Config::validate`].
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        Self::load_with_env(file, |name| std::env::var(name).ok())
    }

    /// [`Config::load`] with an explicit environment, for tests.
    pub fn load_with_env(
        file: Option<&Path>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let mut config = match file {
            Some(path) => Self::from_file(path)?,
            None => Self::default(),
        };
        config.apply_env(env);
        Ok(config)
    }

    /// Only the file: no environment, no validation.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text, path)
    }

    /// Parses `text`; `path` names it in errors.
    pub fn from_toml(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let keys = key_lines(text);
        let mut config: Config = toml::from_str(text).map_err(|e| {
            let line = e.span().map(|span| line_of(text, span.start));
            let key = line.and_then(|line| match keys.is_empty() {
                // A syntax error: no document to take keys from.
                true => key_on_broken_line(text, line),
                false => key_at_line(&keys, line),
            });
            // Syntax errors span lines ("invalid string\nexpected `\"`");
            // one line reads better after the location prefix.
            let reason = e.message().trim().replace('\n', "; ");
            ConfigError::Parse {
                at: Location::File {
                    path: path.to_owned(),
                    line,
                },
                message: match key {
                    Some(key) => format!("{key}: {reason}"),
                    None => reason,
                },
            }
        })?;
        let mut provenance = Provenance {
            file: Some(path.to_owned()),
            keys: BTreeMap::new(),
        };
        for (line, key) in keys {
            provenance.keys.entry(key).or_insert(Origin::File { line });
        }
        config.provenance = provenance;
        Ok(config)
    }

    /// Applies the `BERTH_*` variables of [`ENV_VARS`]; empty ones count as
    /// unset.
    pub fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) {
        for &(key, var) in ENV_VARS {
            let Some(value) = env(var).filter(|v| !v.is_empty()) else {
                continue;
            };
            self.set_key(key, value);
            self.provenance
                .keys
                .insert(key.to_owned(), Origin::Env(var));
        }
        if let Some(oidc) = &mut self.auth.oidc
            && let Some(secret) = env(OIDC_CLIENT_SECRET_ENV).filter(|v| !v.is_empty())
        {
            oidc.client_secret = Some(secret);
            self.provenance.keys.insert(
                "auth.oidc.client_secret".to_owned(),
                Origin::Env(OIDC_CLIENT_SECRET_ENV),
            );
        }
    }

    /// Applies command-line flags, which beat the file and the environment.
    pub fn apply_overrides(&mut self, flags: &Overrides) {
        let pairs = [
            ("listen", "--listen", flags.listen.clone()),
            (
                "data_dir",
                "--data-dir",
                flags
                    .data_dir
                    .as_ref()
                    .map(|p| p.to_string_lossy().into_owned()),
            ),
            ("store", "--store", flags.store.clone()),
            ("node_id", "--node-id", flags.node_id.clone()),
            ("advertise_url", "--advertise", flags.advertise_url.clone()),
            ("log_format", "--log-format", flags.log_format.clone()),
        ];
        for (key, flag, value) in pairs {
            if let Some(value) = value {
                self.set_key(key, value);
                self.provenance
                    .keys
                    .insert(key.to_owned(), Origin::Flag(flag));
            }
        }
        if let Some(dir) = &flags.data_dir {
            // Keep non-UTF-8 paths intact rather than the lossy string above.
            self.data_dir = dir.clone();
        }
    }

    fn set_key(&mut self, key: &str, value: String) {
        match key {
            "listen" => self.listen = value,
            "data_dir" => self.data_dir = PathBuf::from(value),
            "store" => self.store = Some(value),
            "store_file" => self.store_file = Some(PathBuf::from(value)),
            "node_id" => self.node_id = Some(value),
            "advertise_url" => self.advertise_url = Some(value),
            "cluster_secret" => self.cluster_secret = Some(value),
            "admin_token" => self.admin_token = Some(value),
            "log_format" => self.log_format = value,
            "cluster.internal_listen" => self.cluster.internal_listen = value,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::parse;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn precedence_is_flags_then_env_then_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("berth.toml");
        std::fs::write(
            &file,
            "listen = \"127.0.0.1:1000\"\nnode_id = \"from-file\"\nstore = \"sqlite://file.db\"\ndata_dir = \"/file\"\n",
        )
        .unwrap();
        let env = |name: &str| match name {
            "BERTH_LISTEN" => Some("127.0.0.1:2000".to_owned()),
            "BERTH_NODE_ID" => Some("from-env".to_owned()),
            "BERTH_STORE" => Some(String::new()),
            _ => None,
        };
        let mut c = Config::load_with_env(Some(&file), env).unwrap();
        assert_eq!(c.listen, "127.0.0.1:2000");
        assert_eq!(c.node_id.as_deref(), Some("from-env"));
        // An empty variable does not erase the file's value.
        assert_eq!(c.store_url(), "sqlite://file.db");
        assert_eq!(c.data_dir, PathBuf::from("/file"));

        c.apply_overrides(&Overrides {
            listen: Some("127.0.0.1:3000".into()),
            data_dir: Some("/flag".into()),
            ..Overrides::default()
        });
        assert_eq!(c.listen, "127.0.0.1:3000");
        assert_eq!(c.data_dir, PathBuf::from("/flag"));
        assert_eq!(c.node_id.as_deref(), Some("from-env"));
        assert_eq!(c.node_id().unwrap(), "from-env");
    }

    #[test]
    fn a_replica_takes_its_node_to_node_address_from_the_environment() {
        let env =
            |name: &str| (name == "BERTH_INTERNAL_LISTEN").then(|| "10.0.0.5:8001".to_owned());
        let c = Config::load_with_env(None, env).unwrap();
        assert_eq!(c.cluster.internal_listen, "10.0.0.5:8001");
        assert_eq!(
            c.provenance.keys.get("cluster.internal_listen"),
            Some(&Origin::Env("BERTH_INTERNAL_LISTEN"))
        );
    }

    #[test]
    fn default_store_follows_data_dir() {
        let mut c = Config::load_with_env(None, no_env).unwrap();
        c.apply_overrides(&Overrides {
            data_dir: Some("/var/lib/berth".into()),
            ..Overrides::default()
        });
        assert_eq!(c.store_url(), "sqlite:///var/lib/berth/berth.db");
    }

    #[test]
    fn unknown_key_names_file_line_and_key() {
        let err = parse("listen = \"127.0.0.1:8000\"\n\n[instance]\nbogus = 1\n").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("test.toml"), "{msg}");
        assert!(msg.contains("line 4"), "{msg}");
        assert!(msg.contains("bogus"), "{msg}");
    }

    #[test]
    fn bad_enum_value_names_the_key() {
        let err = parse("[lease]\nttl_ms = 30000\ntakeover = \"sometimes\"\n").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("line 3"), "{msg}");
        assert!(msg.contains("lease.takeover"), "{msg}");
    }
}
