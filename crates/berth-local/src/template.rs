//! The instance's command line and environment: placeholder substitution
//! per argument (no shell ever sees them) and the environment allowlist.

use std::collections::BTreeMap;

/// The values the placeholders of a command stand for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Vars {
    pub user: String,
    pub slug: String,
    pub port: u16,
    pub home: String,
    pub folder: String,
    pub patch: String,
    pub base_path: String,
}

impl Vars {
    fn lookup(&self, name: &str) -> Option<String> {
        Some(match name {
            "user" => self.user.clone(),
            "slug" => self.slug.clone(),
            "port" => self.port.to_string(),
            "home" => self.home.clone(),
            "folder" => self.folder.clone(),
            "patch" => self.patch.clone(),
            "base_path" => self.base_path.clone(),
            _ => return None,
        })
    }
}

/// Replaces the known `{name}` placeholders of one argument in a single
/// pass, so a substituted value that itself contains `{port}` (a user id
/// may) is never expanded again. Unknown `{…}` text is kept as is.
pub(crate) fn substitute(arg: &str, vars: &Vars) -> String {
    let mut out = String::with_capacity(arg.len());
    let mut rest = arg;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match after
            .find('}')
            .and_then(|close| vars.lookup(&after[..close]).map(|value| (close, value)))
        {
            Some((close, value)) => {
                out.push_str(&value);
                rest = &after[close + 1..];
            }
            None => {
                out.push('{');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

pub(crate) fn render_command(command: &[String], vars: &Vars) -> Vec<String> {
    command.iter().map(|arg| substitute(arg, vars)).collect()
}

/// Builds the program's whole environment: allowlisted variables of berth's
/// own environment, then the configured ones, then berth's (which win, so a
/// configuration cannot spoof `BERTH_USER`).
pub(crate) fn build_env(
    allowlist: &[String],
    own: impl IntoIterator<Item = (String, String)>,
    configured: &BTreeMap<String, String>,
    berth: impl IntoIterator<Item = (String, String)>,
) -> Vec<(String, String)> {
    let mut env: BTreeMap<String, String> = own
        .into_iter()
        .filter(|(k, _)| allowlist.iter().any(|a| a == k))
        .collect();
    env.extend(configured.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.extend(berth);
    env.into_iter().collect()
}

/// Berth's own environment as UTF-8 pairs; variables that are not UTF-8 are
/// skipped rather than mangled.
pub(crate) fn own_env() -> Vec<(String, String)> {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars() -> Vars {
        Vars {
            user: "a{port}b".into(),
            slug: "ab".into(),
            port: 20001,
            home: "/d/users/ab/home".into(),
            folder: "/d/users/ab/ws/p".into(),
            patch: String::new(),
            base_path: "/u/a{port}b/".into(),
        }
    }

    #[test]
    fn substitutes_each_placeholder_once() {
        let v = vars();
        assert_eq!(substitute("--port={port}", &v), "--port=20001");
        assert_eq!(substitute("{home}/x", &v), "/d/users/ab/home/x");
        assert_eq!(
            substitute("{user}", &v),
            "a{port}b",
            "values are not re-expanded"
        );
        assert_eq!(substitute("{patch}", &v), "");
        assert_eq!(substitute("{slug}-{slug}", &v), "ab-ab");
        assert_eq!(substitute("{base_path}", &v), "/u/a{port}b/");
        assert_eq!(substitute("{folder}", &v), "/d/users/ab/ws/p");
    }

    #[test]
    fn unknown_or_broken_braces_are_kept() {
        let v = vars();
        assert_eq!(substitute("{nope}", &v), "{nope}");
        assert_eq!(substitute("a{b", &v), "a{b");
        assert_eq!(substitute("{{port}}", &v), "{20001}");
        assert_eq!(substitute("}{", &v), "}{");
        assert_eq!(substitute("日{port}本", &v), "日20001本");
    }

    #[test]
    fn renders_every_argument() {
        let cmd = vec![
            "sh".to_owned(),
            "-c".to_owned(),
            "echo {port} {slug}".to_owned(),
        ];
        assert_eq!(render_command(&cmd, &vars()), ["sh", "-c", "echo 20001 ab"]);
    }

    #[test]
    fn env_is_allowlist_then_config_then_berth() {
        let own = vec![
            ("PATH".to_owned(), "/bin".to_owned()),
            ("SECRET".to_owned(), "x".to_owned()),
            ("BERTH_USER".to_owned(), "spoof".to_owned()),
        ];
        let configured = BTreeMap::from([
            ("EXAMPLE".to_owned(), "1".to_owned()),
            ("BERTH_USER".to_owned(), "spoof2".to_owned()),
        ]);
        let env = build_env(
            &["PATH".to_owned()],
            own,
            &configured,
            [("BERTH_USER".to_owned(), "alice".to_owned())],
        );
        assert_eq!(
            env,
            [
                ("BERTH_USER".to_owned(), "alice".to_owned()),
                ("EXAMPLE".to_owned(), "1".to_owned()),
                ("PATH".to_owned(), "/bin".to_owned()),
            ]
        );
    }
}
