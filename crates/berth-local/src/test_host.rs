//! What a unit test needs of the host it runs on.

/// Whether the host has what a test `needs` (`has`). Without it the test
/// reports itself skipped, except under `CI`: CI runs as root with every
/// feature the tests use, so a skip there would hide a test.
pub(crate) fn has(has: bool, needs: &str) -> bool {
    if !has {
        assert!(std::env::var_os("CI").is_none(), "needs {needs}");
        println!("SKIPPED: needs {needs}");
    }
    has
}
