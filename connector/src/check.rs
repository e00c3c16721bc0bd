//! `certistack-connector check`: what the daemon needs, checked without changing anything.
//!
//! The node identity (certificate, key, CA, run-authority key, compiled policy) is loaded as
//! `serve` loads it; every `[tools]` entry must be an executable file; the `[pve]` directories
//! must exist (the PBS loop-device directory may not yet: the backup client creates it at its
//! first map); the overlay root must be a directory owned by this user or root and writable by
//! nobody else, or creatable; the state directory, when it exists, must be private and not in
//! use by a running connector. Journals are verified read-only: a torn tail is reported, not
//! repaired, and nothing is created.

use crate::config::Config;
use crate::runs::{RunError, StateLock};
use crate::server::{NodeIdentity, ServeError};
use certistack_core::files;
use certistack_core::journal;
use certistack_core::validate::{RunId, Validated};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

/// What a check found: notes for the operator, and problems that would stop or break `serve`.
#[derive(Debug, Default)]
pub struct Report {
    pub notes: Vec<String>,
    pub problems: Vec<String>,
}

/// Checks `config` and what it names. An identity that does not load is an error, as it is
/// for `serve`; everything else is collected in the report.
pub fn check(config: &Config) -> Result<Report, ServeError> {
    let identity = NodeIdentity::load(config)?;
    let mut report = Report::default();
    report
        .notes
        .push(format!("node identity {} loads", identity.node));
    check_tools(config, &mut report);
    check_guestfish(config, &mut report);
    check_pve(config, &mut report);
    check_overlay_root(&config.paths.overlay_root, &mut report);
    check_state(config, &mut report);
    Ok(report)
}

fn check_tools(config: &Config, report: &mut Report) {
    let tools = &config.tools;
    for (key, path) in [
        ("tools.proxmox_backup_client", &tools.proxmox_backup_client),
        ("tools.qm", &tools.qm),
        ("tools.qemu_img", &tools.qemu_img),
        ("tools.ip", &tools.ip),
        ("tools.nft", &tools.nft),
    ] {
        match std::fs::metadata(path) {
            Ok(meta) if !meta.is_file() => report
                .problems
                .push(format!("{key} = {}: not a regular file", path.display())),
            Ok(meta) if meta.permissions().mode() & 0o111 == 0 => report.problems.push(format!(
                "{key} = {}: not executable (mode {:04o}); install the tool or fix its mode",
                path.display(),
                meta.permissions().mode() & 0o7777
            )),
            Ok(_) => report.notes.push(format!("{key} = {}", path.display())),
            Err(error) => report.problems.push(format!(
                "{key} = {}: {error}; install the tool or set the path in [tools]",
                path.display()
            )),
        }
    }
    // Optional: without them PrepareSandbox skips the legacy NAT table and its evidence says so.
    for (key, path) in [
        ("tools.iptables_legacy_save", &tools.iptables_legacy_save),
        ("tools.ip6tables_legacy_save", &tools.ip6tables_legacy_save),
    ] {
        report.notes.push(if path.exists() {
            format!("{key} = {}", path.display())
        } else {
            format!(
                "{key} = {}: not installed; the legacy NAT check is skipped (install iptables if pve-firewall or SDN SNAT may write legacy rules)",
                path.display()
            )
        });
    }
}

fn check_guestfish(config: &Config, report: &mut Report) {
    // Optional: without it RecoverGuestNetwork fails and says what to install.
    let path = &config.tools.guestfish;
    report.notes.push(if path.is_file() {
        format!("tools.guestfish = {}", path.display())
    } else {
        format!(
            "tools.guestfish = {}: not installed; RecoverGuestNetwork fails until libguestfs-tools is installed (network_recovery.mode preserve does not need it)",
            path.display()
        )
    });
}

fn check_pve(config: &Config, report: &mut Report) {
    let pve = &config.pve;
    for (key, path, must_exist) in [
        ("pve.qemu_server_run_dir", &pve.qemu_server_run_dir, true),
        ("pve.vm_config_dir", &pve.vm_config_dir, true),
        ("pve.pve_cluster_dir", &pve.pve_cluster_dir, true),
        // proxmox-backup-client creates it at its first map.
        ("pve.pbs_loopdev_dir", &pve.pbs_loopdev_dir, false),
    ] {
        match std::fs::metadata(path) {
            Ok(meta) if meta.is_dir() => report.notes.push(format!("{key} = {}", path.display())),
            Ok(_) => report
                .problems
                .push(format!("{key} = {}: not a directory", path.display())),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound && !must_exist => {
                report.notes.push(format!(
                    "{key} = {}: absent until the first map creates it",
                    path.display()
                ))
            }
            Err(error) => report.problems.push(format!(
                "{key} = {}: {error}; is this a Proxmox VE node, and is [pve] right?",
                path.display()
            )),
        }
    }
}

fn check_overlay_root(root: &Path, report: &mut Report) {
    let euid = rustix::process::geteuid().as_raw();
    match std::fs::symlink_metadata(root) {
        Ok(meta) if !meta.is_dir() => report.problems.push(format!(
            "paths.overlay_root = {}: not a directory (a symbolic link is not accepted)",
            root.display()
        )),
        Ok(meta) if meta.uid() != euid && meta.uid() != 0 => report.problems.push(format!(
            "paths.overlay_root = {} is owned by uid {}, not by uid {euid} or root; run `chown {euid} {}`",
            root.display(),
            meta.uid(),
            root.display()
        )),
        Ok(meta) if meta.permissions().mode() & 0o022 != 0 => report.problems.push(format!(
            "paths.overlay_root = {} has mode {:04o}: it must not be writable by group or others; run `chmod go-w {}`",
            root.display(),
            meta.permissions().mode() & 0o7777,
            root.display()
        )),
        Ok(_) => report
            .notes
            .push(format!("paths.overlay_root = {}", root.display())),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            match root.parent().map(std::fs::metadata) {
                Some(Ok(parent)) if parent.is_dir() => report.notes.push(format!(
                    "paths.overlay_root = {}: absent, created at the first overlay",
                    root.display()
                )),
                _ => report.problems.push(format!(
                    "paths.overlay_root = {}: neither it nor its parent directory exists",
                    root.display()
                )),
            }
        }
        Err(error) => report.problems.push(format!(
            "paths.overlay_root = {}: {error}",
            root.display()
        )),
    }
}

fn check_state(config: &Config, report: &mut Report) {
    let state = &config.paths.state_dir;
    if !state.exists() {
        report.notes.push(format!(
            "paths.state_dir = {}: absent, created by the first `serve`",
            state.display()
        ));
        return;
    }
    if let Err(error) = files::check_private(state) {
        report.problems.push(format!("paths.state_dir: {error}"));
        return;
    }
    // Held while the journals are read, so a connector starting meanwhile waits for nothing
    // and repairs nothing under this reader: it refuses to start instead.
    let _lock = match StateLock::probe(state) {
        Ok(lock) => lock,
        Err(error @ RunError::Locked { .. }) => {
            report.problems.push(error.to_string());
            return;
        }
        Err(error) => {
            report.problems.push(format!("paths.state_dir: {error}"));
            return;
        }
    };
    let runs = state.join("runs");
    let Ok(entries) = std::fs::read_dir(&runs) else {
        report.notes.push(format!(
            "paths.state_dir = {}: no runs yet",
            state.display()
        ));
        return;
    };
    let (mut open, mut closed) = (0usize, 0usize);
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(run_id) = name.to_str().and_then(|n| RunId::validate(n).ok()) else {
            continue;
        };
        let dir = entry.path();
        if dir.join("closed").exists() {
            closed += 1;
            continue;
        }
        open += 1;
        let path = dir.join(journal::FILE_NAME);
        if !path.exists() {
            continue;
        }
        let max_line = config.limits.max_journal_bytes;
        match journal::summarize(&path, run_id.as_str(), max_line) {
            Ok(summary) if summary.torn => report.notes.push(format!(
                "run {run_id}: the journal has a torn last record after {} records; `serve` sets it aside and records the repair",
                summary.records
            )),
            Ok(_) => {}
            Err(error) => report.notes.push(format!(
                "run {run_id}: {error}; `serve` will list it as quarantined"
            )),
        }
    }
    // Closed runs are kept in shards under closed/ (see crate::runs).
    closed += std::fs::read_dir(state.join("closed"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|shard| std::fs::read_dir(shard.path()).ok())
        .map(|runs| runs.count())
        .sum::<usize>();
    report.notes.push(format!(
        "paths.state_dir = {}: {open} open and {closed} closed runs",
        state.display()
    ));
}
