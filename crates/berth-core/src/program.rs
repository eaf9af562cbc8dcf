//! The program contract every runtime keeps: what berth tells a program
//! about itself (its environment, the placeholders of its command line),
//! how berth tells that it is ready, and where its launch token is, the
//! same whatever runs it.
//!
//! A runtime supplies the facts of one start ([`ProgramFacts`]) and
//! delivers them its own way: the local runtime writes the values into the
//! environment and the command line; a pod's manifest names the variables
//! and lets the kubelet fill them in. The names, the vocabulary and the
//! meaning of each value are decided here, once.

use crate::{Epoch, Role, Slug, UserId};

/// How a runtime tells that a starting program is ready, once it runs.
///
/// One type for every runtime; each checks it its own way. The local
/// runtime reads the program's output and asks its port itself; a pod's
/// readiness probe (HTTP, TCP) is the kubelet's, with the kubelet's rules.
#[derive(Debug, Clone)]
pub enum Readiness {
    /// A line of the program's output matches; see [`ready_line`] for the
    /// launch token it carries.
    TokenRegex(regex::Regex),
    /// A `GET` of this path on the program's port answers: below 500 when
    /// berth asks (the program answered, even if it refused), below 400
    /// from a pod's probe (the kubelet's rule).
    Http {
        /// The path requested (a missing leading `/` is added).
        path: String,
    },
    /// A TCP connection to the program's port is accepted.
    Tcp,
}

/// Whether `line` (one line of output, without its line end) is the
/// program's ready line for `pattern`: `None` when it is not, else the
/// launch token it carries.
///
/// The token is the pattern's first capture group, when the pattern has
/// one and the group took part in the match. A pattern without a group
/// announces readiness and no token: the whole match (`listening`, say)
/// is no secret, and the proxy would blank every copy of a token in the
/// answers it passes back.
pub fn ready_line<'l>(pattern: &regex::Regex, line: &'l str) -> Option<Option<&'l str>> {
    let captures = pattern.captures(line)?;
    Some(captures.get(1).map(|token| token.as_str()))
}

/// A variable berth sets in the environment of every program it runs.
/// berth's value always wins over a configured variable of the same name,
/// so a configuration cannot spoof one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Variable {
    /// The user's id.
    User,
    /// The user's slug: the file- and DNS-safe form of the id that names
    /// the user's directory, account and objects.
    Slug,
    /// The port the program must listen on (a watchdog gets its main's).
    Port,
    /// Where the proxy serves the program under path routing, `/u/<id>/`
    /// with the id percent-encoded.
    BasePath,
    /// `main` or `watchdog`.
    Role,
    /// The program's working directory, absolute: the folder the launch
    /// asked for, inside the user's workspace.
    Folder,
    /// The path of the user's patch file, or empty when the user has no
    /// patch.
    Patch,
    /// The user's home directory, absolute.
    Home,
    /// The lease epoch the program runs under.
    Epoch,
    /// The id of this run of the program.
    InstanceId,
    /// For a watchdog only: the file its main left for it.
    Handoff,
    /// For a hook only (a command run beside the program): the hook's
    /// name, such as `pre_hibernate`.
    Hook,
}

impl Variable {
    /// Every variable.
    pub const ALL: [Variable; 12] = [
        Variable::User,
        Variable::Slug,
        Variable::Port,
        Variable::BasePath,
        Variable::Role,
        Variable::Folder,
        Variable::Patch,
        Variable::Home,
        Variable::Epoch,
        Variable::InstanceId,
        Variable::Handoff,
        Variable::Hook,
    ];

    /// The variable's name in the environment.
    pub const fn name(self) -> &'static str {
        match self {
            Variable::User => "BERTH_USER",
            Variable::Slug => "BERTH_SLUG",
            Variable::Port => "BERTH_PORT",
            Variable::BasePath => "BERTH_BASE_PATH",
            Variable::Role => "BERTH_ROLE",
            Variable::Folder => "BERTH_FOLDER",
            Variable::Patch => "BERTH_PATCH",
            Variable::Home => "HOME",
            Variable::Epoch => "BERTH_EPOCH",
            Variable::InstanceId => "BERTH_INSTANCE_ID",
            Variable::Handoff => "BERTH_HANDOFF",
            Variable::Hook => "BERTH_HOOK",
        }
    }
}

/// A `{name}` placeholder of a configured command line. Each stands for
/// the value of one [`Variable`], so `{folder}` and `$BERTH_FOLDER` never
/// differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Placeholder {
    /// `{user}`
    User,
    /// `{slug}`
    Slug,
    /// `{port}`
    Port,
    /// `{home}`
    Home,
    /// `{folder}`
    Folder,
    /// `{patch}`
    Patch,
    /// `{base_path}`
    BasePath,
}

impl Placeholder {
    /// Every placeholder.
    pub const ALL: [Placeholder; 7] = [
        Placeholder::User,
        Placeholder::Slug,
        Placeholder::Port,
        Placeholder::Home,
        Placeholder::Folder,
        Placeholder::Patch,
        Placeholder::BasePath,
    ];

    /// The name between the braces.
    pub const fn name(self) -> &'static str {
        match self {
            Placeholder::User => "user",
            Placeholder::Slug => "slug",
            Placeholder::Port => "port",
            Placeholder::Home => "home",
            Placeholder::Folder => "folder",
            Placeholder::Patch => "patch",
            Placeholder::BasePath => "base_path",
        }
    }

    /// The variable whose value the placeholder stands for.
    pub const fn variable(self) -> Variable {
        match self {
            Placeholder::User => Variable::User,
            Placeholder::Slug => Variable::Slug,
            Placeholder::Port => Variable::Port,
            Placeholder::Home => Variable::Home,
            Placeholder::Folder => Variable::Folder,
            Placeholder::Patch => Variable::Patch,
            Placeholder::BasePath => Variable::BasePath,
        }
    }

    fn parse(name: &str) -> Option<Placeholder> {
        Placeholder::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// Replaces each known `{name}` placeholder of one argument by
/// `value(placeholder)`, in a single pass: a value that itself contains
/// `{port}` (a user id may) is never expanded again. Unknown `{…}` text
/// is kept as is. No shell ever sees the result.
pub fn substitute(arg: &str, mut value: impl FnMut(Placeholder) -> String) -> String {
    let mut out = String::with_capacity(arg.len());
    let mut rest = arg;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match after
            .find('}')
            .and_then(|close| Placeholder::parse(&after[..close]).map(|p| (close, p)))
        {
            Some((close, placeholder)) => {
                out.push_str(&value(placeholder));
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

/// The program every user runs, as the operator configured it
/// (`[instance]`'s program keys), whatever runtime runs it. Each runtime's
/// config embeds it, so no runtime restates these settings.
#[derive(Debug, Clone)]
pub struct ProgramSettings {
    /// The program and its arguments, with [`Placeholder`]s.
    pub command: Vec<String>,
    /// Extra environment for the program; berth's variables win over it.
    pub env: std::collections::BTreeMap<String, String>,
    /// How a starting instance is found ready.
    pub readiness: Readiness,
    /// The watchdog program, with the same placeholders; `None`: no
    /// watchdog can start.
    pub watchdog_command: Option<Vec<String>>,
    /// The extension of the user's patch file (`main.<ext>`).
    pub patch_ext: String,
}

/// What one start of a program is told about itself. The runtime decides
/// where things are (`port`, `home`, `folder`, `patch`, `handoff`); the
/// rest comes from the launch.
#[derive(Debug, Clone, Copy)]
pub struct ProgramFacts<'a> {
    /// The user.
    pub user: &'a UserId,
    /// The user's slug.
    pub slug: &'a Slug,
    /// The program or its watchdog.
    pub role: Role,
    /// The port the program listens on.
    pub port: u16,
    /// The user's home directory, absolute.
    pub home: &'a str,
    /// The working directory, absolute.
    pub folder: &'a str,
    /// The user's patch file, if the user has a patch.
    pub patch: Option<&'a str>,
    /// The lease epoch.
    pub epoch: Epoch,
    /// The run's id.
    pub instance_id: &'a str,
    /// A watchdog's handoff file.
    pub handoff: Option<&'a str>,
}

impl ProgramFacts<'_> {
    /// The value of `variable`; `None` for [`Variable::Handoff`] outside a
    /// watchdog and for [`Variable::Hook`] (a program is no hook), which
    /// are then not set at all.
    pub fn value(&self, variable: Variable) -> Option<String> {
        Some(match variable {
            Variable::User => self.user.as_str().to_owned(),
            Variable::Slug => self.slug.as_str().to_owned(),
            Variable::Port => self.port.to_string(),
            Variable::BasePath => self.user.base_path(),
            Variable::Role => self.role.as_str().to_owned(),
            Variable::Folder => self.folder.to_owned(),
            Variable::Patch => self.patch.unwrap_or_default().to_owned(),
            Variable::Home => self.home.to_owned(),
            Variable::Epoch => self.epoch.to_string(),
            Variable::InstanceId => self.instance_id.to_owned(),
            Variable::Handoff => match self.role {
                Role::Watchdog => self.handoff?.to_owned(),
                Role::Main => return None,
            },
            Variable::Hook => return None,
        })
    }

    /// berth's part of the program's environment: every variable that
    /// applies to this start, with its value.
    pub fn environment(&self) -> Vec<(Variable, String)> {
        Variable::ALL
            .into_iter()
            .filter_map(|v| Some((v, self.value(v)?)))
            .collect()
    }

    /// `command` with its placeholders replaced by these facts' values.
    pub fn render(&self, command: &[String]) -> Vec<String> {
        command
            .iter()
            .map(|arg| substitute(arg, |p| self.value(p.variable()).unwrap_or_default()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts<'a>(user: &'a UserId, slug: &'a Slug, role: Role) -> ProgramFacts<'a> {
        ProgramFacts {
            user,
            slug,
            role,
            port: 20001,
            home: "/d/users/ab/home",
            folder: "/d/users/ab/ws/p",
            patch: None,
            epoch: 7,
            instance_id: "i-1",
            handoff: Some("/d/users/ab/handoff.json"),
        }
    }

    #[test]
    fn placeholders_are_replaced_once_and_unknown_text_is_kept() {
        let user = UserId::parse("a{port}b").unwrap();
        let slug = Slug::parse("ab").unwrap();
        let f = facts(&user, &slug, Role::Main);
        let one = |arg: &str| f.render(&[arg.to_owned()]).remove(0);
        assert_eq!(one("--port={port}"), "--port=20001");
        assert_eq!(one("{home}/x"), "/d/users/ab/home/x");
        // A value is never expanded again, even when it looks like one.
        assert_eq!(one("{user}"), "a{port}b");
        assert_eq!(one("{patch}"), "");
        assert_eq!(one("{slug}-{slug}"), "ab-ab");
        assert_eq!(one("{base_path}"), "/u/a%7Bport%7Db/");
        assert_eq!(one("{folder}"), "/d/users/ab/ws/p");
        assert_eq!(one("{nope} {port"), "{nope} {port");
        assert_eq!(one("{{port}}"), "{20001}");
        assert_eq!(one("日{port}本"), "日20001本");
    }

    #[test]
    fn every_placeholder_is_its_variable() {
        let user = UserId::parse("alice").unwrap();
        let slug = user.slug();
        let f = facts(&user, &slug, Role::Main);
        let env = f.environment();
        for p in Placeholder::ALL {
            let arg = format!("{{{}}}", p.name());
            let value = env.iter().find(|(v, _)| *v == p.variable()).map(|(_, s)| s);
            assert_eq!(f.render(&[arg]).first(), value, "{p:?}");
        }
    }

    #[test]
    fn a_main_gets_no_handoff_and_a_watchdog_gets_its_file() {
        let user = UserId::parse("alice").unwrap();
        let slug = user.slug();
        let names = |role| -> Vec<&str> {
            facts(&user, &slug, role)
                .environment()
                .into_iter()
                .map(|(v, _)| v.name())
                .collect()
        };
        let main = names(Role::Main);
        assert!(!main.contains(&"BERTH_HANDOFF"), "{main:?}");
        assert_eq!(main.len(), Variable::ALL.len() - 2);
        assert!(!main.contains(&"BERTH_HOOK"), "{main:?}");
        assert!(names(Role::Watchdog).contains(&"BERTH_HANDOFF"));
    }

    #[test]
    fn the_launch_token_is_the_first_group_only() {
        let with_group = regex::Regex::new(r"token=(\w+)").unwrap();
        assert_eq!(ready_line(&with_group, "x token=abc y"), Some(Some("abc")));
        assert_eq!(ready_line(&with_group, "nothing"), None);
        let plain = regex::Regex::new(r"ready").unwrap();
        assert_eq!(ready_line(&plain, "is ready"), Some(None));
        let optional = regex::Regex::new(r"ready( token=\w+)?").unwrap();
        assert_eq!(ready_line(&optional, "ready"), Some(None));
    }
}
