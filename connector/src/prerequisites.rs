//! `NodeChecks`: what this node offers a validation, read without changing anything.
//!
//! The facts come from the node's own files and tools, never from the caller: the
//! `pve-manager` and `qemu-server` versions from dpkg's status database (`pve.dpkg_status`;
//! read, not executed, so a broken `pveversion` cannot hang the call), `qemu-img --version`
//! and `proxmox-backup-client version` through the tool runner with a short timeout and a
//! cleared environment (so the client never contacts a server), whether `nft` and `ip` are
//! executable, and the overlay root's free space and filesystem. Every text is bounded and
//! escaped ([`crate::untrusted`]) before it leaves the node; the controller judges the facts.
//!
//! Nothing is journaled: nothing changes. One reading runs at a time; concurrent callers wait
//! for the slot, and a caller that goes away drops its reading, which kills the tools it
//! started (the tool runner kills a dropped tool's process group).

use crate::config::Config;
use crate::process::{self, ToolCall};
use crate::untrusted::printable;
use certistack_proto::v1 as pb;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The longest a version tool may take here: a prerequisite check must answer quickly.
const CHECK_TOOL_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes of the dpkg status database read at most (a PVE node's is a few MiB).
pub const MAX_DPKG_STATUS_BYTES: u64 = 64 * 1024 * 1024;
/// Characters kept of a version or of an error text.
const MAX_VERSION_CHARS: usize = 64;
const MAX_ERROR_CHARS: usize = 512;

/// The paths NodeChecks reads, from the connector config.
#[derive(Debug)]
pub struct Prerequisites {
    dpkg_status: PathBuf,
    qemu_img: PathBuf,
    proxmox_backup_client: PathBuf,
    nft: PathBuf,
    ip: PathBuf,
    overlay_root: PathBuf,
    pve_cluster_dir: PathBuf,
    timeout: Duration,
    slot: tokio::sync::Mutex<()>,
}

impl Prerequisites {
    pub fn new(config: &Config) -> Self {
        Self {
            dpkg_status: config.pve.dpkg_status.clone(),
            qemu_img: config.tools.qemu_img.clone(),
            proxmox_backup_client: config.tools.proxmox_backup_client.clone(),
            nft: config.tools.nft.clone(),
            ip: config.tools.ip.clone(),
            overlay_root: config.paths.overlay_root.clone(),
            pve_cluster_dir: config.pve.pve_cluster_dir.clone(),
            timeout: CHECK_TOOL_TIMEOUT.min(Duration::from_secs(config.limits.tool_timeout_secs)),
            slot: tokio::sync::Mutex::new(()),
        }
    }

    /// Reads every fact; `node_time_unix_ms` is left for the caller, who owns the clock.
    pub async fn read(&self) -> pb::NodeChecksReply {
        let _slot = self.slot.lock().await;
        let dpkg_status = self.dpkg_status.clone();
        let packages = tokio::task::spawn_blocking(move || {
            installed_versions(&dpkg_status, &["pve-manager", "qemu-server"])
        });
        let overlay_root = self.overlay_root.clone();
        let cluster = self.pve_cluster_dir.clone();
        let disk = tokio::task::spawn_blocking(move || overlay_disk(&overlay_root, &cluster));
        let (qemu_img, pbs_client) = tokio::join!(
            tool_version(
                &self.qemu_img,
                &["--version"],
                "qemu-img version ",
                self.timeout
            ),
            tool_version(
                &self.proxmox_backup_client,
                &["version"],
                "client version: ",
                self.timeout
            ),
        );
        let packages = packages
            .await
            .map_err(|error| format!("reading the dpkg status stopped: {error}"))
            .and_then(|read| read);
        let package = |name: &str| -> Result<String, String> {
            match &packages {
                Ok(found) => found
                    .iter()
                    .find(|(package, _)| package == name)
                    .map(|(_, version)| version.clone())
                    .ok_or_else(|| {
                        format!(
                            "package {name} is not installed ({} lists it as no installed package)",
                            self.dpkg_status.display()
                        )
                    }),
                Err(error) => Err(error.clone()),
            }
        };
        let disk = disk
            .await
            .map_err(|error| format!("reading the overlay root stopped: {error}"))
            .and_then(|read| read);
        let (pve_manager_version, pve_manager_error) = split(package("pve-manager"));
        let (qemu_server_version, qemu_server_error) = split(package("qemu-server"));
        let (qemu_img_version, qemu_img_error) = split(qemu_img);
        let (pbs_client_version, pbs_client_error) = split(pbs_client);
        let (overlay_free_bytes, overlay_shares_pve_cluster_fs, overlay_error) = match disk {
            Ok((free, shares)) => (free, shares, String::new()),
            Err(error) => (0, false, bounded(&error)),
        };
        pb::NodeChecksReply {
            pve_manager_version,
            pve_manager_error,
            qemu_server_version,
            qemu_server_error,
            qemu_img_version,
            qemu_img_error,
            pbs_client_version,
            pbs_client_error,
            nft: Some(presence(&self.nft)),
            ip: Some(presence(&self.ip)),
            overlay_free_bytes,
            overlay_error,
            overlay_shares_pve_cluster_fs,
            node_time_unix_ms: 0,
        }
    }
}

fn bounded(text: &str) -> String {
    printable(text.as_bytes(), MAX_ERROR_CHARS)
}

fn split(result: Result<String, String>) -> (String, String) {
    match result {
        Ok(version) => (version, String::new()),
        Err(error) => (String::new(), bounded(&error)),
    }
}

/// A version as the node states it: dpkg's version characters only, bounded.
fn version_token(text: &str) -> Option<String> {
    let token = text.split_whitespace().next()?;
    let allowed = |c: char| c.is_ascii_alphanumeric() || ".+~:-_".contains(c);
    (token.chars().all(allowed) && token.chars().count() <= MAX_VERSION_CHARS)
        .then(|| token.to_owned())
}

/// Runs `program args` and takes the version that follows `prefix` on the first line of
/// stdout that starts with it.
async fn tool_version(
    program: &Path,
    args: &[&str],
    prefix: &str,
    timeout: Duration,
) -> Result<String, String> {
    let mut call = ToolCall::new(program, timeout);
    for arg in args {
        call = call.arg(*arg);
    }
    let shown = call.display();
    let output = process::run(call)
        .await
        .map_err(|error| error.to_string())?;
    if !output.success() {
        return Err(format!(
            "{shown} exited with {:?}: {}",
            output.exit_code,
            output.stderr_excerpt()
        ));
    }
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

/// Bytes available to the daemon under `overlay_root`, and whether it shares a filesystem
/// with `pve_cluster_dir` (an absent cluster directory shares nothing). An overlay root not
/// created yet (the first run creates it) is judged by its nearest existing parent, the
/// filesystem it will live on.
fn overlay_disk(overlay_root: &Path, pve_cluster_dir: &Path) -> Result<(u64, bool), String> {
    use std::os::unix::fs::MetadataExt;
    let overlay_root = overlay_root
        .ancestors()
        .find(|dir| dir.exists())
        .unwrap_or(overlay_root);
    let stat = rustix::fs::statvfs(overlay_root)
        .map_err(|error| format!("cannot statvfs {}: {error}", overlay_root.display()))?;
    let free = stat.f_bavail.saturating_mul(stat.f_frsize);
    let overlay_dev = std::fs::metadata(overlay_root)
        .map_err(|error| format!("cannot stat {}: {error}", overlay_root.display()))?
        .dev();
    let shares = std::fs::metadata(pve_cluster_dir).is_ok_and(|m| m.dev() == overlay_dev);
    Ok((free, shares))
}

/// Whether `path` is a regular file (after links) this daemon may execute.
fn presence(path: &Path) -> pb::ToolPresence {
    let shown = path.display().to_string();
    let error = match std::fs::metadata(path) {
        Err(error) => Some(format!("{shown}: {error}")),
        Ok(meta) if !meta.is_file() => Some(format!("{shown} is not a regular file")),
        Ok(_) => rustix::fs::access(path, rustix::fs::Access::EXEC_OK)
            .err()
            .map(|error| format!("{shown} is not executable: {error}")),
    };
    pb::ToolPresence {
        path: bounded(&shown),
        executable: error.is_none(),
        error: error.map(|e| bounded(&e)).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dpkg_status_gives_installed_versions_only() {
        let dir = std::env::temp_dir().join(format!("certistack-dpkg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("status");
        std::fs::write(
            &path,
            "Package: pve-manager\nStatus: install ok installed\nPriority: optional\nVersion: 9.0.6\nDescription: x\n continued\n\n\
             Package: qemu-server\nStatus: deinstall ok config-files\nVersion: 8.0.1\n\n\
             Package: other\nStatus: install ok installed\nVersion: 1.0\n",
        )
        .unwrap();
        let found = installed_versions(&path, &["pve-manager", "qemu-server"]).unwrap();
        assert_eq!(found, [("pve-manager".to_owned(), "9.0.6".to_owned())]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_version_with_foreign_characters_is_not_one() {
        assert_eq!(version_token("9.2.0 (pve)"), Some("9.2.0".into()));
        assert_eq!(version_token("1:7.2+dfsg-7"), Some("1:7.2+dfsg-7".into()));
        assert_eq!(version_token("9.0\u{1b}[31m"), None);
        assert_eq!(version_token(""), None);
    }
}
