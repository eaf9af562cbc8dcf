//! `berth config check` on the shipped examples and on broken files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn berth(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(args)
        // `config check` reads only the file; make sure the test environment
        // could not mask that.
        .env_remove("BERTH_LISTEN")
        .env_remove("BERTH_STORE")
        .output()
        .expect("cannot run berth")
}

fn check(path: &Path) -> Output {
    berth(&["config", "check", path.to_str().expect("UTF-8 path")])
}

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

/// Writes `text` to a temporary file and checks it; returns stderr.
fn check_failing(text: &str) -> (String, PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.toml");
    std::fs::write(&path, text).unwrap();
    let out = check(&path);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "accepted:\n{text}");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.starts_with("berth: "), "{stderr}");
    (stderr, path, dir)
}

/// [`check_failing`] on a file only its owner can read, as a file that
/// holds a secret must be.
fn check_failing_private(text: &str) -> (String, PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("private.toml");
    berth_testkit::write_private(&path, text, None);
    let out = check(&path);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "accepted:\n{text}");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    (stderr, path, dir)
}

/// Whether `config check` accepts `text` in a private file.
fn accepted_private(text: &str) -> bool {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("private.toml");
    berth_testkit::write_private(&path, text, None);
    check(&path).status.success()
}

/// Header mode believes `X-Forwarded-User` from the trusted proxies. Every
/// program berth runs lives on this host and can connect from loopback, so
/// trusting loopback without the SSO proxy's secret lets any of them act
/// as any user: such a config is refused, naming the key, the line and the
/// key that fixes it, however loopback is written.
#[test]
fn header_auth_trusting_loopback_without_a_secret_is_refused() {
    for entries in [
        r#"["127.0.0.1"]"#,
        r#"["10.0.0.0/8", "127.0.0.0/8"]"#,
        r#"["::1"]"#,
        r#"["0.0.0.0/0"]"#,
        r#"["127.0.0.53"]"#,
    ] {
        let text = format!("[proxy]\nauth = \"header\"\ntrusted_proxies = {entries}\n");
        let (stderr, path, _dir) = check_failing(&text);
        let want = format!(
            "berth: config file {}, line 3: proxy.trusted_proxies: ",
            path.display()
        );
        assert!(stderr.starts_with(&want), "{entries}: {stderr}");
        for part in [
            "covers loopback",
            "set proxy.header_secret",
            "X-Forwarded-User",
        ] {
            assert!(
                stderr.contains(part),
                "{entries}: {part:?} missing: {stderr}"
            );
        }
    }
    // With the secret, or trusting only a proxy elsewhere, it is fine.
    assert!(accepted_private(
        "[proxy]\nauth = \"header\"\ntrusted_proxies = [\"127.0.0.1\"]\nheader_secret = \"sso-s3cret\"\n"
    ));
    assert!(accepted_private(
        "[proxy]\nauth = \"header\"\ntrusted_proxies = [\"10.0.0.5\"]\n"
    ));
    // Token mode believes no X-Forwarded-User: loopback may be trusted
    // there (for X-Forwarded-Proto).
    assert!(accepted_private(
        "[proxy]\ntrusted_proxies = [\"127.0.0.1\"]\n"
    ));
}

/// The README's example secret (`change-me`) was accepted, and with it
/// anyone who read the README could be a node. Short or repetitive secrets
/// are refused with the way to make a good one.
#[test]
fn a_weak_cluster_secret_is_refused() {
    for secret in [
        "change-me",
        "cluster-secret-for-tests",
        "change-me-change-me-change-me-change-me",
    ] {
        let text =
            format!("store = \"postgres://berth@db/berth\"\ncluster_secret = \"{secret}\"\n");
        let (stderr, path, _dir) = check_failing_private(&text);
        let want = format!(
            "berth: config file {}, line 2: cluster_secret: ",
            path.display()
        );
        assert!(stderr.starts_with(&want), "{secret}: {stderr}");
        assert!(stderr.contains("openssl rand -hex 32"), "{stderr}");
        assert!(
            stderr.contains("head -c32 /dev/urandom | base64"),
            "{stderr}"
        );
    }
    assert!(accepted_private(&format!(
        "store = \"postgres://berth@db/berth\"\ncluster_secret = \"{}\"\n",
        berth_testkit::TEST_CLUSTER_SECRET
    )));
}

/// Every program berth runs can read a world-readable file. A config file
/// that holds a secret must be private: one others can read is refused,
/// naming the file and the `chmod` that fixes it.
#[test]
fn a_config_file_with_a_secret_that_others_can_read_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let secret = berth_testkit::TEST_CLUSTER_SECRET;
    for (text, what) in [
        (format!("cluster_secret = \"{secret}\"\n"), "cluster_secret"),
        ("admin_token = \"adm1n-t0ken\"\n".to_owned(), "admin_token"),
        (
            "[metrics]\ntoken = \"scrape-me\"\n".to_owned(),
            "metrics.token",
        ),
        (
            format!(
                "store = \"postgres://berth:hunter2@db/berth\"\ncluster_secret = \"{secret}\"\n"
            ),
            "password",
        ),
    ] {
        for mode in [0o644, 0o640] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("berth.toml");
            std::fs::write(&path, &text).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let out = check(&path);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{mode:o} {text}: {stderr}");
            assert!(stderr.contains(what), "{what}: {stderr}");
            assert!(
                stderr.contains(&format!("chmod 600 {}", path.display())),
                "{stderr}"
            );
            assert!(!stderr.contains("hunter2"), "{stderr}");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
            let out = check(&path);
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

#[test]
fn every_example_is_accepted() {
    let mut checked = 0;
    for entry in std::fs::read_dir(examples_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let out = check(&path);
            assert!(
                out.status.success(),
                "{} refused: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert!(checked >= 4, "only {checked} examples found");
}

#[test]
fn the_dsh_preset_is_exact() {
    let text = std::fs::read_to_string(examples_dir().join("dsh.toml")).unwrap();
    let value: toml::Table = toml::from_str(&text).unwrap();
    let instance = value["instance"].as_table().unwrap();
    let command: Vec<&str> = instance["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        command,
        [
            "dsh",
            "--profile",
            "web",
            "--patch",
            "{patch}",
            "--host",
            "127.0.0.1",
            "--port",
            "{port}"
        ]
    );
    let re = regex::Regex::new(instance["ready_token_regex"].as_str().unwrap()).unwrap();
    let caps = re
        .captures("dsh web: http://127.0.0.1:20417/?token=Ab-9_x")
        .unwrap();
    assert_eq!(&caps[1], "Ab-9_x");
}

#[test]
fn the_jupyter_regex_finds_the_token_under_a_base_url() {
    let text = std::fs::read_to_string(examples_dir().join("jupyter.toml")).unwrap();
    let value: toml::Table = toml::from_str(&text).unwrap();
    let pattern = value["instance"]["ready_token_regex"].as_str().unwrap();
    let re = regex::Regex::new(pattern).unwrap();
    for line in [
        "[I 2025-01-01 10:00:00.000 ServerApp]     http://127.0.0.1:20001/u/alice/?token=0123abcd",
        "[I 2025-01-01 10:00:00.000 ServerApp] http://127.0.0.1:20001/u/a.b%40corp/lab?token=0123abcd",
        "        http://127.0.0.1:20001/u/alice/tree?foo=1&token=0123abcd",
    ] {
        let caps = re
            .captures(line)
            .unwrap_or_else(|| panic!("no match: {line}"));
        assert_eq!(&caps[1], "0123abcd", "{line}");
    }
}

#[test]
fn unknown_key_names_file_and_line() {
    let (stderr, path, _dir) = check_failing(
        "listen = \"127.0.0.1:8000\"\n\n[instance]\nready_timeout_s = 5\n\n\nbogus_key = 1\n",
    );
    assert!(stderr.contains(path.to_str().unwrap()), "{stderr}");
    assert!(stderr.contains("line 7"), "{stderr}");
    assert!(stderr.contains("bogus_key"), "{stderr}");
}

#[test]
fn unknown_table_names_file_and_line() {
    let (stderr, path, _dir) = check_failing("listen = \"127.0.0.1:8000\"\n[bogus]\nx = 1\n");
    assert!(stderr.contains(path.to_str().unwrap()), "{stderr}");
    assert!(stderr.contains("line 2"), "{stderr}");
    assert!(stderr.contains("bogus"), "{stderr}");
}

#[test]
fn syntax_error_names_file_and_line() {
    let (stderr, path, _dir) = check_failing("# comment\nlisten = \"127.0.0.1:8000\"\n[instance\n");
    assert!(stderr.contains(path.to_str().unwrap()), "{stderr}");
    assert!(stderr.contains("line 3"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
}

#[test]
fn bad_values_name_the_key() {
    let cases = [
        (
            "[instance]\nport_range = [29999, 20000]\n",
            "instance.port_range",
            "line 2",
        ),
        (
            "\n[lease]\ntakeover = \"whenever\"\n",
            "lease.takeover",
            "line 3",
        ),
        ("listen = \"localhost\"\n", "listen", "line 1"),
        (
            "[instance]\nready_token_regex = 'token=(['\n",
            "instance.ready_token_regex",
            "line 2",
        ),
        (
            "[lease]\nttl_ms = 15000\nrenew_ms = 10000\n",
            "lease.ttl_ms",
            "line 2",
        ),
        ("[proxy]\nauth = \"magic\"\n", "proxy.auth", "line 2"),
        (
            "[instance]\npre_hibernate = \"flush\"\n",
            "instance.pre_hibernate",
            "line 2",
        ),
        ("[instance]\npre_stop = []\n", "instance.pre_stop", "line 2"),
        (
            "[instance]\nhook_grace_s = 0\n",
            "instance.hook_grace_s",
            "line 2",
        ),
        (
            "[reap]\nidle_action = \"nap\"\n",
            "reap.idle_action",
            "line 2",
        ),
        (
            "[instance]\nport_range = [1, \"x\"]\n",
            "instance.port_range",
            "line 2",
        ),
    ];
    for (text, key, line) in cases {
        let (stderr, _path, _dir) = check_failing(text);
        assert!(stderr.contains(key), "{key} not named: {stderr}");
        assert!(stderr.contains(line), "{line} not named: {stderr}");
    }
}

/// The node-to-node listener must be an address of its own that other
/// nodes can be told: each bad value is refused naming its key, its line
/// and what to do instead; a good one passes.
#[test]
fn a_node_to_node_listener_that_cannot_work_is_refused() {
    let cases = [
        (
            "[cluster]\ninternal_listen = \"localhost\"\n",
            "cluster.internal_listen",
            "is not a socket address",
        ),
        (
            "[cluster]\ninternal_listen = \"0.0.0.0:8001\"\n",
            "cluster.internal_listen",
            "name this host's address on the nodes' private network",
        ),
        (
            "[cluster]\ninternal_listen = \"[::]:8001\"\n",
            "cluster.internal_listen",
            "listens on every address",
        ),
        (
            "listen = \"127.0.0.1:8000\"\n[cluster]\ninternal_listen = \"127.0.0.1:8000\"\n",
            "cluster.internal_listen",
            "never the public one",
        ),
        (
            "[metrics]\nlisten = \"127.0.0.1:9464\"\n[cluster]\ninternal_listen = \"127.0.0.1:9464\"\n",
            "cluster.internal_listen",
            "is also metrics.listen",
        ),
        (
            "[cluster]\ninternal_advertise_url = \"ftp://10.0.0.5:8001\"\n",
            "cluster.internal_advertise_url",
            "is not an http://host:port URL",
        ),
        (
            "[cluster]\ninternal_advertise_url = \"http://10.0.0.5:8001/internal\"\n",
            "cluster.internal_advertise_url",
            "without a path",
        ),
    ];
    for (text, key, why) in cases {
        let (stderr, _path, _dir) = check_failing(text);
        let line = format!("line {}", text.lines().count());
        assert!(stderr.contains(key), "{key} not named: {stderr}");
        assert!(stderr.contains(&line), "{line} not named: {stderr}");
        assert!(stderr.contains(why), "{why:?} not said: {stderr}");
    }
    let dir = tempfile::tempdir().unwrap();
    for good in [
        "[cluster]\ninternal_listen = \"10.0.0.5:8001\"\n",
        "[cluster]\ninternal_listen = \"0.0.0.0:8001\"\ninternal_advertise_url = \"http://10.0.0.5:8001\"\n",
        "listen = \"127.0.0.1:0\"\n[cluster]\ninternal_listen = \"127.0.0.1:0\"\n",
    ] {
        let path = dir.path().join("good.toml");
        std::fs::write(&path, good).unwrap();
        let out = check(&path);
        assert!(
            out.status.success(),
            "{good}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The shipped Kubernetes example is a complete `[kubernetes]` table: it
/// names every section the runtime has, so it documents them all.
#[test]
fn the_kubernetes_example_sets_every_section() {
    let text = std::fs::read_to_string(examples_dir().join("kubernetes.toml")).unwrap();
    let value: toml::Table = toml::from_str(&text).unwrap();
    let k8s = value["kubernetes"].as_table().unwrap();
    for key in [
        "namespace",
        "image",
        "command",
        "resources",
        "storage",
        "security",
        "network",
        "node_selector",
        "tolerations",
        "service_account",
        "pod_spec",
        "endpoint",
    ] {
        assert!(
            k8s.contains_key(key),
            "examples/kubernetes.toml lacks {key}"
        );
    }
}

/// Every refusal of a `[kubernetes]` value names the key, the file and the
/// line, with a reason an operator can act on.
#[test]
fn kubernetes_values_are_refused_with_key_and_line() {
    let base = "[kubernetes]\nimage = \"example/app:1\"\ncommand = [\"app\"]\n";
    let cases = [
        (
            format!("{base}\n[kubernetes.storage]\nmode = \"shared\"\n"),
            "line 5: kubernetes.storage.claim: mode = \"shared\" needs a claim name",
        ),
        (
            "[kubernetes]\nimage = \"x\"\n".to_owned(),
            "line 1: kubernetes.command: a pod needs a command: set kubernetes.command (or [instance] command)",
        ),
        (
            format!("{base}imag = \"y\"\n"),
            "line 4: kubernetes.imag: unknown field `imag`",
        ),
        (
            "[kubernetes]\ncommand = [\"app\"]\n".to_owned(),
            "line 1: kubernetes: missing field `image`",
        ),
        (
            format!(
                "{base}tolerations = [\n  {{ key = \"gpu\", operator = \"Exists\", efect = \"NoSchedule\" }},\n]\n"
            ),
            "line 4: kubernetes.tolerations[0].efect: is not a field Kubernetes knows here",
        ),
        (
            format!("{base}endpoint = \"pod_ip\"\n"),
            "line 4: kubernetes.endpoint: unknown variant `pod_ip`, expected `service_dns` or `endpoint_slice`",
        ),
        (
            format!("{base}namespace = \"Berth\"\n"),
            "line 4: kubernetes.namespace: \"Berth\" is not a DNS label",
        ),
        (
            "[kubernetes]\nimage = \"x\"\ncommand = []\n".to_owned(),
            "line 3: kubernetes.command: must name a program (the list is empty)",
        ),
        (
            format!("{base}[kubernetes.resources]\nlimits = {{ memory = \"lots\" }}\n"),
            "line 5: kubernetes.resources.limits.memory: \"lots\" is not a Kubernetes quantity",
        ),
        (
            format!("{base}pod_spec = {{ hostNetwork = true }}\n"),
            "line 4: kubernetes.pod_spec.hostNetwork: berth sets this field itself",
        ),
        (
            format!("{base}[kubernetes.security]\nrun_as_user = 0\n"),
            "line 5: kubernetes.security.run_as_user: 0 is not a non-root id",
        ),
        (
            format!("{base}context = \" \"\n"),
            "line 4: kubernetes.context: must not be empty",
        ),
    ];
    for (text, want) in cases {
        let (stderr, path, _dir) = check_failing(&text);
        assert!(
            stderr.starts_with(&format!("berth: config file {}, {want}", path.display())),
            "want {want:?}, got: {stderr}"
        );
    }
}

#[test]
fn an_unknown_isolation_mode_is_refused_clearly() {
    let (stderr, _path, _dir) = check_failing("[isolation]\nmode = \"jail\"\n");
    assert!(
        stderr.contains(
            "isolation.mode: unknown isolation mode \"jail\" (expected \"none\", \"user\" or \"sandbox\")"
        ),
        "{stderr}"
    );
    assert!(stderr.contains("line 2"), "{stderr}");
}

#[test]
fn missing_file_is_named() {
    let out = berth(&["config", "check", "/nonexistent/berth.toml"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent/berth.toml"), "{stderr}");
}

#[test]
fn usage_errors_exit_2() {
    let out = berth(&["config", "check"]);
    assert_eq!(out.status.code(), Some(2));
    let out = berth(&["no-such-command"]);
    assert_eq!(out.status.code(), Some(2));
}

/// `config check` warns (and still accepts) a port range that overlaps the
/// kernel's ephemeral range, where any outgoing connection may take an
/// instance's port.
#[test]
fn a_port_range_in_the_ephemeral_range_is_warned_about() {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap();
    let low: u16 = text.split_whitespace().next().unwrap().parse().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("berth.toml");
    for (range, warned) in [([low, low + 9], true), ([low - 10, low - 1], false)] {
        std::fs::write(
            &path,
            format!("[instance]\nport_range = [{}, {}]\n", range[0], range[1]),
        )
        .unwrap();
        let out = check(&path);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert_eq!(
            stderr.contains("berth: warning: instance.port_range"),
            warned,
            "{range:?}: {stderr}"
        );
        if warned {
            assert!(stderr.contains("ip_local_port_range"), "{stderr}");
        }
    }
}

/// A command hook runs beside the program: on Kubernetes only through
/// berth's shim in the pod, which needs the cluster secret its credential
/// derives from.
#[test]
fn a_command_hook_on_kubernetes_needs_the_shim_and_the_shim_a_cluster_secret() {
    let base = "[instance]\npre_hibernate = [\"sync\"]\n\
                [kubernetes]\nimage = \"example/app:1\"\ncommand = [\"app\"]\n";
    let (stderr, _, _) = check_failing(base);
    assert!(
        stderr.contains("instance.pre_hibernate") && stderr.contains("[kubernetes.shim]"),
        "{stderr}"
    );
    let shim = "[kubernetes.shim]\npath = \"/usr/local/bin/berth\"\n";
    let (stderr, _, _) = check_failing(&format!("{base}{shim}"));
    assert!(
        stderr.contains("kubernetes.shim") && stderr.contains("cluster_secret"),
        "{stderr}"
    );
    let secret = format!(
        "cluster_secret = \"{}\"\n",
        berth_testkit::TEST_CLUSTER_SECRET
    );
    assert!(accepted_private(&format!("{secret}{base}{shim}")));
    for (bad, key) in [
        ("path = \"berth\"\n", "shim.path"),
        ("path = \"/b\"\nport = 8080\n", "shim.port"),
    ] {
        let text = format!("{secret}{base}[kubernetes.shim]\n{bad}");
        let (stderr, _, _) = check_failing_private(&text);
        assert!(stderr.contains(key), "{key}: {stderr}");
    }
}
