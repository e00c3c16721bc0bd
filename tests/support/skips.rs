//! Whether a test that needs root, tools or files may run here; a printed skip elsewhere, a
//! failure under `CERTISTACK_REQUIRE_PRIVILEGED_TESTS=1`.

use std::path::Path;

/// Whether tests that need root, loop devices and the lab tools may run here. Elsewhere they
/// skip with a printed reason, except under `CERTISTACK_REQUIRE_PRIVILEGED_TESTS=1` (CI), where
/// a skip is a failure.
pub fn privileged(test: &str, tools: &[&str]) -> bool {
    let mut missing = Vec::new();
    if rustix::process::geteuid().as_raw() != 0 {
        missing.push("root".to_owned());
    }
    if !Path::new("/dev/loop-control").exists() {
        missing.push("/dev/loop-control".to_owned());
    }
    for tool in tools {
        if !tool_installed(tool) {
            missing.push((*tool).to_owned());
        }
    }
    if missing.is_empty() {
        return true;
    }
    skip(test, &missing.join(", "))
}

/// Whether `tool` is on the PATH the connector gives the tools it runs.
pub fn tool_installed(tool: &str) -> bool {
    ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        .iter()
        .any(|dir| Path::new(dir).join(tool).exists())
}

/// Whether the files a test needs, each from the Debian package named beside it, are there;
/// otherwise a skip as [`privileged`] makes it (a failure in CI), naming the packages.
pub fn has_files(test: &str, files: &[(&str, &str)]) -> bool {
    let missing: Vec<String> = files
        .iter()
        .filter(|(path, _)| !Path::new(path).exists())
        .map(|(path, package)| {
            format!("{path} (Debian package {package}; tests/prepare-machine.sh installs it)")
        })
        .collect();
    missing.is_empty() || skip(test, &missing.join(", "))
}

/// Prints why `test` skips and returns `false`, or fails it under
/// `CERTISTACK_REQUIRE_PRIVILEGED_TESTS=1`.
fn skip(test: &str, needs: &str) -> bool {
    let reason = format!("{test}: needs {needs}");
    if std::env::var("CERTISTACK_REQUIRE_PRIVILEGED_TESTS").as_deref() == Ok("1") {
        panic!("{reason}, and CERTISTACK_REQUIRE_PRIVILEGED_TESTS=1 forbids skipping it");
    }
    eprintln!("SKIPPED {reason}");
    false
}
