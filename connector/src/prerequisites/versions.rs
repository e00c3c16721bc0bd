//! Versions as the node states them: from dpkg's status database, read not executed, and from
//! a tool's own version line.

use super::{MAX_DPKG_STATUS_BYTES, MAX_VERSION_CHARS, run_successfully};
use crate::process::ToolCall;
use certistack_core::untrusted::printable;
use std::io::BufRead;
use std::path::Path;
use std::time::Duration;

/// A version as the node states it: dpkg's version characters only, bounded.
pub(super) fn version_token(text: &str) -> Option<String> {
    let token = text.split_whitespace().next()?;
    let allowed = |c: char| c.is_ascii_alphanumeric() || ".+~:-_".contains(c);
    (token.chars().all(allowed) && token.chars().count() <= MAX_VERSION_CHARS)
        .then(|| token.to_owned())
}

/// Runs `program args` and takes the version that follows `prefix` on the first line of
/// stdout that starts with it.
pub(super) async fn tool_version(
    program: &Path,
    args: &[&str],
    prefix: &str,
    timeout: Duration,
) -> Result<String, String> {
    let mut call = ToolCall::new(program, timeout);
    for arg in args {
        call = call.arg(*arg);
    }
    let (shown, output) = run_successfully(call).await?;
    output
        .stdout
        .lines()
        .find_map(|line| line.strip_prefix(prefix))
        .and_then(version_token)
        .ok_or_else(|| {
            let first = output.stdout.lines().next().unwrap_or_default();
            format!(
                "{shown} printed no \"{prefix}<version>\" line (first line: {})",
                printable(first.as_bytes(), MAX_VERSION_CHARS * 2)
            )
        })
}

/// The installed versions of `wanted` packages from a dpkg status database: the `Version:` of
/// each paragraph whose `Package:` is wanted and whose `Status:` ends in `installed`.
pub fn installed_versions(path: &Path, wanted: &[&str]) -> Result<Vec<(String, String)>, String> {
    let file = std::fs::File::open(path)
        .map_err(|error| format!("cannot read {}: {error}", path.display()))?;
    let mut reader = std::io::BufReader::new(std::io::Read::take(file, MAX_DPKG_STATUS_BYTES));
    let mut found = Vec::new();
    let mut package: Option<String> = None;
    let mut version: Option<String> = None;
    let mut installed = false;
    let mut line = Vec::new();
    let mut read_total: u64 = 0;
    loop {
        line.clear();
        let read = reader
            .read_until(b'\n', &mut line)
            .map_err(|error| format!("cannot read {}: {error}", path.display()))?;
        read_total += read as u64;
        let text = String::from_utf8_lossy(&line);
        let text = text.trim_end();
        if read == 0 || text.is_empty() {
            if let (Some(name), Some(version), true) = (package.take(), version.take(), installed)
                && wanted.contains(&name.as_str())
            {
                found.push((name, version));
            }
            installed = false;
            if read == 0 {
                break;
            }
            continue;
        }
        if let Some(name) = text.strip_prefix("Package:") {
            package = Some(name.trim().to_owned());
        } else if let Some(status) = text.strip_prefix("Status:") {
            installed = status.split_whitespace().last() == Some("installed");
        } else if let Some(value) = text.strip_prefix("Version:") {
            version = version_token(value.trim());
        }
    }
    if read_total >= MAX_DPKG_STATUS_BYTES {
        return Err(format!(
            "{} is larger than {MAX_DPKG_STATUS_BYTES} bytes; it is not a dpkg status database",
            path.display()
        ));
    }
    Ok(found)
}
