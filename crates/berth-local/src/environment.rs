//! The instance's whole environment: what berth passes on from its own,
//! the configured variables, and the program contract's (see
//! `berth_core::program`), in that order of precedence.

use std::collections::BTreeMap;

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
