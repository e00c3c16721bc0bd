//! What a validation takes from the backup itself when the plan leaves it out: the snapshot
//! (`snapshot: latest`, in `latest`), its disk archives, and the sandbox's cores and memory from
//! the backed-up `qemu-server.conf`. Read through the [`BackupCatalog`] once per validation, and
//! only when the plan leaves one of them out: a plan that spells everything out is resolved
//! without asking anything.

use super::*;
use latest::{CatalogFile, CatalogSnapshot};

/// The sandbox's cores when the plan writes neither `cores` nor `max_cores`.
pub const DEFAULT_MAX_CORES: u32 = 4;
/// The sandbox's memory cap when the plan writes neither `memory_mib` nor `max_memory_mib`.
pub const DEFAULT_MAX_MEMORY_MIB: u32 = 8192;
/// qemu-server's defaults for a config that does not set them (`qm` manual: `cores`, `sockets`
/// default 1; `memory` default 512).
const PVE_DEFAULT_CORES: u32 = 1;
const PVE_DEFAULT_SOCKETS: u32 = 1;
const PVE_DEFAULT_MEMORY_MIB: u32 = 512;
/// The blob every PVE VM backup carries its config in.
pub const CONFIG_BLOB: &str = "qemu-server.conf.blob";
/// A snapshot's manifest.
pub const MANIFEST_BLOB: &str = "index.json.blob";
/// The most archives a grant names.
pub const MAX_ARCHIVES: usize = 16;
/// The least memory a sandbox VM gets (the grant's bound).
pub const MIN_MEMORY_MIB: u32 = 64;
/// The most cores and memory a sandbox VM may be given (the grant's bounds).
pub const MAX_CORES: u32 = 64;
pub const MAX_MEMORY_MIB: u32 = 262_144;

/// A validation that fails before any node is asked, and what the listing showed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FailsBeforeRun {
    pub reason: String,
    pub listed: usize,
    pub finished: usize,
    /// The stale snapshot's manifest as PBS decodes it, for the report's digests; `None` when
    /// there is no finished snapshot.
    #[serde(skip)]
    pub manifest: Option<Vec<u8>>,
}

/// `5 h 12 min`, `3 d 2 h`: an age as an operator reads it.
pub fn age_text(seconds: i64) -> String {
    let minutes = seconds.max(0) / 60;
    let (days, hours, minutes) = (minutes / 1440, minutes / 60 % 24, minutes % 60);
    match (days, hours) {
        (0, 0) => format!("{minutes} min"),
        (0, _) => format!("{hours} h {minutes} min"),
        _ => format!("{days} d {hours} h"),
    }
}

/// A disk archive's index file as the listing names it.
fn index_name(archive: &str) -> String {
    format!("{archive}.fidx")
}

/// The disk archives of a snapshot (`drive-*.img`, the EFI vars and TPM state included), with
/// their sizes, in name order.
pub fn disk_archives(snapshot: &CatalogSnapshot) -> Vec<(String, Option<u64>)> {
    let mut archives: Vec<(String, Option<u64>)> = snapshot
        .files
        .iter()
        .filter_map(|file| {
            let archive = file.name.strip_suffix(".fidx")?;
            (archive.starts_with("drive-") && archive.ends_with(".img"))
                .then(|| (archive.to_owned(), file.size))
        })
        .collect();
    archives.sort();
    archives
}

/// `YYYY-MM-DDTHH:MM:SSZ` as seconds since the epoch.
pub fn parse_snapshot_time(text: &str) -> Option<i64> {
    let bytes = text.as_bytes();
    if bytes.len() != 20
        || bytes.get(4) != Some(&b'-')
        || bytes.get(7) != Some(&b'-')
        || bytes.get(10) != Some(&b'T')
        || bytes.get(13) != Some(&b':')
        || bytes.get(16) != Some(&b':')
        || bytes.get(19) != Some(&b'Z')
    {
        return None;
    }
    let number = |range: std::ops::Range<usize>| text.get(range)?.parse::<u32>().ok();
    let month = time::Month::try_from(u8::try_from(number(5..7)?).ok()?).ok()?;
    let date = time::Date::from_calendar_date(
        i32::try_from(number(0..4)?).ok()?,
        month,
        u8::try_from(number(8..10)?).ok()?,
    )
    .ok()?;
    let at = date
        .with_hms(
            u8::try_from(number(11..13)?).ok()?,
            u8::try_from(number(14..16)?).ok()?,
            u8::try_from(number(17..19)?).ok()?,
        )
        .ok()?;
    Some(at.assume_utc().unix_timestamp())
}

/// The sizes a backed-up VM had: `cores` × `sockets` and `memory` (MiB) of the config's main
/// section (snapshots and pending changes follow it in `[…]` sections and are not the VM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceSizes {
    pub cores: u32,
    pub sockets: u32,
    pub memory_mib: u32,
}

pub fn source_sizes(config: &str) -> Result<SourceSizes, String> {
    let mut sizes = SourceSizes {
        cores: PVE_DEFAULT_CORES,
        sockets: PVE_DEFAULT_SOCKETS,
        memory_mib: PVE_DEFAULT_MEMORY_MIB,
    };
    for line in config.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            break;
        }
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        let number = |text: &str| {
            text.parse::<u32>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("{key}: {text:?} is not a positive number"))
        };
        match key.trim() {
            "cores" => sizes.cores = number(value)?,
            "sockets" => sizes.sockets = number(value)?,
            // `memory: 4096` or, since PVE 8, `memory: current=4096[,…]`.
            "memory" => {
                let current = value
                    .split(',')
                    .map(|part| part.strip_prefix("current=").unwrap_or(part))
                    .next()
                    .unwrap_or(value);
                sizes.memory_mib = number(current)?;
            }
            _ => {}
        }
    }
    Ok(sizes)
}

/// The most `max_age_hours` may say: a year.
pub const MAX_AGE_HOURS: u32 = 8760;

/// What resolution read of the backup for one validation.
#[derive(Debug, Clone, Default)]
pub(super) struct BackupFacts {
    /// Why the validation fails before any node is asked: `latest` found no finished backup,
    /// or one older than `max_age_hours`.
    pub(super) fails_before_run: Option<FailsBeforeRun>,
    /// The snapshot's time and, with `latest`, what the listing showed.
    pub(super) latest: Option<(String, LatestFound)>,
    /// The snapshot's disk archives and their sizes.
    pub(super) archives: Vec<(String, Option<u64>)>,
    /// The source's sizes, read only when a sandbox VM leaves cores or memory out.
    pub(super) sizes: Option<SourceSizes>,
}

/// Reads what validation `v` leaves to the backup, or `None` when it leaves nothing. A refusal
/// is the key (after `validations[i] (name)`) and why.
pub(super) fn read_backup(
    v: &ValidationFile,
    vmid: Vmid,
    storage: &ResolvedStorage,
    catalog: &dyn BackupCatalog,
    now_unix: i64,
) -> Result<Option<BackupFacts>, LatestError> {
    let sizes_needed = v
        .sandbox
        .iter()
        .any(|vm| vm.cores.is_none() || vm.memory_mib.is_none());
    let latest = matches!(v.snapshot, SnapshotFile::Latest);
    if !latest && v.archives.is_some() && !sizes_needed {
        return Ok(None);
    }
    let refused = |key: &str, reason: String| LatestError::Refused(key.to_owned(), reason);
    // What the catalog could not answer is the infrastructure's failure; what it refused is
    // the plan's (`then` says what to write instead).
    let failed = |key: &'static str, what: &'static str, then: &'static str| {
        move |error: CatalogError| match error {
            CatalogError::Secret(file) => LatestError::Secret(file),
            CatalogError::Unavailable(reason) => {
                LatestError::Unavailable(key.to_owned(), format!("{what}: {reason}"))
            }
            CatalogError::Refused(reason) => {
                LatestError::Refused(key.to_owned(), format!("{what}: {reason}{then}"))
            }
        }
    };
    let snapshots = catalog.vm_snapshots(storage, vmid).map_err(failed(
        ".snapshot",
        "listing the VM's backups",
        "",
    ))?;
    let mut fails_before_run = None;
    // A backup-time PBS cannot have written (before 1970, or more than a day ahead of this
    // clock) is never the newest backup: it would win every night and never grow stale.
    let plausible: Vec<CatalogSnapshot> = snapshots
        .iter()
        .filter(|s| s.backup_time >= 1 && s.backup_time <= now_unix.saturating_add(86_400))
        .cloned()
        .collect();
    let (chosen, latest) = match &v.snapshot {
        SnapshotFile::Latest => {
            let Some(chosen) = newest_finished(&plausible) else {
                // No backup to restore is the nightly check's finding, not the plan's error.
                return Ok(Some(BackupFacts {
                    fails_before_run: Some(FailsBeforeRun {
                        reason: format!(
                            "VM {vmid} has no finished backup in {} ({} snapshot(s) listed, none finished): check its backup job",
                            where_(storage),
                            snapshots.len()
                        ),
                        listed: snapshots.len(),
                        finished: 0,
                        manifest: None,
                    }),
                    ..BackupFacts::default()
                }));
            };
            let (time, found) = choose_latest(&plausible, storage, vmid, now_unix)?;
            let found = LatestFound {
                listed: snapshots.len(),
                ..found
            };
            if let Some(hours) = v.max_age_hours
                && found.age_seconds > i64::from(hours) * 3600
            {
                fails_before_run = Some(FailsBeforeRun {
                    reason: format!(
                        "the newest finished backup of VM {vmid} ({time}) is {} old, older than max_age_hours {hours}: check its backup job",
                        age_text(found.age_seconds)
                    ),
                    listed: found.listed,
                    finished: found.finished,
                    manifest: None,
                });
            }
            (chosen, Some((time, found)))
        }
        SnapshotFile::Exact(time) => {
            let at = parse_snapshot_time(time).ok_or_else(|| {
                refused(
                    ".snapshot",
                    format!("{time:?} is not a snapshot time (YYYY-MM-DDTHH:MM:SSZ)"),
                )
            })?;
            // PBS lists a time once; a listing with it twice gets its finished entry chosen.
            let chosen = snapshots
                .iter()
                .filter(|snapshot| snapshot.backup_time == at)
                .max_by_key(|snapshot| snapshot.size.is_some())
                .ok_or_else(|| {
                    refused(
                        ".snapshot",
                        format!(
                            "VM {vmid} has no snapshot {time} in {} ({} listed); `proxmox-backup-client snapshot list` shows them, or write snapshot: latest",
                            where_(storage),
                            snapshots.len()
                        ),
                    )
                })?;
            if chosen.size.is_none() {
                return Err(refused(
                    ".snapshot",
                    format!(
                        "snapshot {time} of VM {vmid} is not finished (PBS lists it without a size)"
                    ),
                ));
            }
            (chosen, None)
        }
    };
    let archives = disk_archives(chosen);
    if let Some(written) = &v.archives {
        for archive in written {
            if !chosen
                .files
                .iter()
                .any(|file| file.name == index_name(archive))
            {
                return Err(refused(
                    ".archives",
                    format!(
                        "the snapshot has no archive {archive}; its disk archives are {}",
                        archives
                            .iter()
                            .map(|(name, _)| name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
        }
    } else if archives.is_empty() {
        return Err(refused(
            ".archives",
            "the snapshot has no disk archive (drive-*.img); write archives".into(),
        ));
    } else if archives.len() > MAX_ARCHIVES {
        return Err(refused(
            ".archives",
            format!(
                "the snapshot has {} disk archives and a validation restores at most {MAX_ARCHIVES}: write archives, the ones the guest needs",
                archives.len()
            ),
        ));
    }
    // An encrypted disk cannot be mapped without the key: the node would fail at its first
    // step, after the run began. Said here, before anything is asked of a node.
    if storage.encryption_key_file.value.is_none() {
        let restored: Vec<&str> = match &v.archives {
            Some(written) => written.iter().map(String::as_str).collect(),
            None => archives.iter().map(|(name, _)| name.as_str()).collect(),
        };
        if let Some(encrypted) = restored.iter().find(|archive| {
            chosen.files.iter().any(|file| {
                file.name == index_name(archive) && file.crypt_mode.as_deref() == Some("encrypt")
            })
        }) {
            return Err(refused(
                ".archives",
                format!(
                    "{encrypted} of the snapshot is encrypted and the plan names no key: write storage.encryption_key_file (the backup's key file, chmod 0600)"
                ),
            ));
        }
    }
    if let Some(stale) = &mut fails_before_run {
        // No run: the report names the stale backup by its manifest's digests, read here.
        let manifest = catalog
            .blob(storage, vmid, chosen.backup_time, MANIFEST_BLOB)
            .map_err(failed(".snapshot", "reading the backup's manifest", ""))?;
        stale.manifest = Some(manifest);
        return Ok(Some(BackupFacts {
            fails_before_run,
            latest,
            archives,
            sizes: None,
        }));
    }
    let sizes = if sizes_needed {
        let config: Option<&CatalogFile> =
            chosen.files.iter().find(|file| file.name == CONFIG_BLOB);
        if config.is_none() {
            return Err(refused(
                ".sandbox",
                "the backup carries no qemu-server.conf, so the controller cannot read the VM's cores and memory: write cores and memory_mib for each sandbox VM".into(),
            ));
        }
        if config.is_some_and(|file| file.crypt_mode.as_deref() == Some("encrypt")) {
            return Err(refused(
                ".sandbox",
                "the backup's qemu-server.conf is encrypted, so the controller cannot read the VM's cores and memory: write cores and memory_mib for each sandbox VM".into(),
            ));
        }
        let bytes = catalog
            .blob(storage, vmid, chosen.backup_time, CONFIG_BLOB)
            .map_err(failed(
                ".sandbox",
                "reading the backup's qemu-server.conf",
                "; write cores and memory_mib for each sandbox VM",
            ))?;
        let text = String::from_utf8_lossy(&bytes);
        let sizes = source_sizes(&text).map_err(|reason| {
            refused(
                ".sandbox",
                format!("the backup's qemu-server.conf: {reason}; write cores and memory_mib"),
            )
        })?;
        if sizes.memory_mib < MIN_MEMORY_MIB && v.sandbox.iter().any(|vm| vm.memory_mib.is_none()) {
            return Err(refused(
                ".sandbox",
                format!(
                    "the backup's qemu-server.conf gives the VM {} MiB, less than the {MIN_MEMORY_MIB} MiB a sandbox VM gets: write memory_mib",
                    sizes.memory_mib
                ),
            ));
        }
        Some(sizes)
    } else {
        None
    };
    Ok(Some(BackupFacts {
        fails_before_run: None,
        latest,
        archives,
        sizes,
    }))
}

fn where_(storage: &ResolvedStorage) -> String {
    if storage.namespace.value.is_empty() {
        format!("datastore {}", storage.datastore.value)
    } else {
        format!(
            "datastore {}, namespace {}",
            storage.datastore.value, storage.namespace.value
        )
    }
}

/// The newest finished snapshot's time and what the listing showed.
fn choose_latest(
    snapshots: &[CatalogSnapshot],
    storage: &ResolvedStorage,
    vmid: Vmid,
    now_unix: i64,
) -> Result<(String, LatestFound), LatestError> {
    let newest = newest_finished(snapshots).ok_or_else(|| {
        LatestError::Refused(
            ".snapshot".into(),
            format!(
                "snapshot: latest: VM {vmid} has no finished backup in {} ({} snapshot(s) listed, none finished); check its backup job, or name an existing snapshot",
                where_(storage),
                snapshots.len()
            ),
        )
    })?;
    let time = snapshot_time(newest.backup_time).ok_or_else(|| {
        LatestError::Refused(
            ".snapshot".into(),
            format!(
                "snapshot: latest: PBS lists a backup-time {} that is no time",
                newest.backup_time
            ),
        )
    })?;
    Ok((
        time,
        LatestFound {
            listed: snapshots.len(),
            finished: snapshots.iter().filter(|s| s.size.is_some()).count(),
            age_seconds: now_unix.saturating_sub(newest.backup_time),
            size_bytes: newest.size.unwrap_or_default(),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_come_from_the_main_section_of_the_config() {
        let config = "boot: order=scsi0\ncores: 2\nsockets: 2\nmemory: 4096\nscsi0: local:100/vm-100-disk-0.raw,size=4M\n\n[before-upgrade]\ncores: 16\nmemory: 65536\n";
        assert_eq!(
            source_sizes(config).unwrap(),
            SourceSizes {
                cores: 2,
                sockets: 2,
                memory_mib: 4096
            }
        );
        assert_eq!(
            source_sizes("memory: current=2048,hotplug=1\n").unwrap(),
            SourceSizes {
                cores: 1,
                sockets: 1,
                memory_mib: 2048
            }
        );
        assert_eq!(
            source_sizes("ostype: l26\n").unwrap(),
            SourceSizes {
                cores: 1,
                sockets: 1,
                memory_mib: 512
            },
            "qemu-server's defaults"
        );
        assert!(source_sizes("cores: many\n").unwrap_err().contains("cores"));
        assert!(source_sizes("memory: 0\n").is_err());
    }

    #[test]
    fn disk_archives_are_the_drive_images_the_efi_and_tpm_state_included() {
        let file = |name: &str, size: u64| CatalogFile {
            name: name.into(),
            size: Some(size),
            crypt_mode: Some("none".into()),
        };
        let snapshot = CatalogSnapshot {
            backup_time: 0,
            size: Some(1),
            files: vec![
                file("qemu-server.conf.blob", 300),
                file("drive-scsi0.img.fidx", 4096),
                file("index.json.blob", 500),
                file("drive-efidisk0.img.fidx", 528),
                file("drive-tpmstate0-backup.img.fidx", 4),
                file("fw.conf.blob", 10),
            ],
        };
        let names: Vec<String> = disk_archives(&snapshot)
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        assert_eq!(
            names,
            [
                "drive-efidisk0.img",
                "drive-scsi0.img",
                "drive-tpmstate0-backup.img"
            ]
        );
    }

    #[test]
    fn snapshot_times_read_back() {
        assert_eq!(
            parse_snapshot_time("2025-12-01T02:00:00Z"),
            Some(1_764_554_400)
        );
        assert_eq!(
            parse_snapshot_time("2025-12-01T02:00:00Z")
                .and_then(snapshot_time)
                .as_deref(),
            Some("2025-12-01T02:00:00Z")
        );
        for wrong in [
            "2025-12-01 02:00:00Z",
            "2025-13-01T02:00:00Z",
            "latest",
            "2025-12-01T02:00:00",
        ] {
            assert_eq!(parse_snapshot_time(wrong), None, "{wrong}");
        }
    }
}
