//! Client commands without a server: their errors must say what is wrong.

use std::process::{Command, Output};

fn berth(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(args)
        .env_remove("BERTH_URL")
        .env_remove("BERTH_TOKEN")
        .env_remove("BERTH_DATA_DIR")
        .output()
        .expect("cannot run berth")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn unreachable_server_names_the_url() {
    // Port 1 on loopback: nothing listens there, so the connect is refused.
    let out = berth(&[
        "status",
        "alice",
        "--url",
        "http://127.0.0.1:1",
        "--token",
        "x",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.starts_with("berth: "), "{err}");
    assert!(err.contains("http://127.0.0.1:1"), "{err}");
}

#[test]
fn missing_token_file_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("no-such-data-dir");
    let out = berth(&[
        "ls",
        "--url",
        "http://127.0.0.1:1",
        "--data-dir",
        data_dir.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    let expected = data_dir.join("admin.token");
    assert!(err.contains(expected.to_str().unwrap()), "{err}");
    assert!(err.contains("BERTH_TOKEN"), "{err}");
}

#[test]
fn token_file_is_found_through_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("admin.token"), "secret\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["nodes", "--url", "http://127.0.0.1:1"])
        .env_remove("BERTH_TOKEN")
        .env("BERTH_DATA_DIR", dir.path())
        .output()
        .unwrap();
    // Past the token: the failure is now the connection.
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot reach berth at http://127.0.0.1:1"),
        "{err}"
    );
}

#[test]
fn invalid_user_ids_are_refused_locally() {
    let out = berth(&[
        "start",
        ".hidden",
        "--token",
        "x",
        "--url",
        "http://127.0.0.1:1",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("invalid user id"), "{}", stderr(&out));
}

#[test]
fn bad_url_is_reported() {
    let out = berth(&["ls", "--url", "not a url", "--token", "x"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("not a url"), "{}", stderr(&out));
}
