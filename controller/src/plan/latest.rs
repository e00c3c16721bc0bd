//! `snapshot: latest`: the newest *finished* snapshot of the VM in the plan's datastore and
//! namespace, as the PBS API lists them. A snapshot still being written (or whose manifest
//! cannot be read) is listed without a size and is never chosen: restoring it would test a
//! backup that does not exist yet.
//!
//! Resolution asks a [`BackupCatalog`]; the controller's is the PBS API (`crate::catalog`), a
//! plan read without one (`Plan::parse`) refuses `latest` saying so.

use super::*;
use certistack_core::files::FileError;

/// One snapshot of a VM as the catalog lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogSnapshot {
    /// `backup-time`, seconds since the epoch.
    pub backup_time: i64,
    /// `None` while the snapshot is being written, or when it is broken.
    pub size: Option<u64>,
    /// Its files (`drive-scsi0.img.fidx`, `qemu-server.conf.blob`, …).
    pub files: Vec<CatalogFile>,
}

/// One file of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogFile {
    pub name: String,
    pub size: Option<u64>,
    /// `none`, `sign-only` or `encrypt`; `None` when the listing does not say.
    pub crypt_mode: Option<String>,
}

/// Why the catalog could not answer.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// The PBS secret file is refused (its mode, its owner) or cannot be read.
    #[error(transparent)]
    Secret(FileError),
    /// The catalog could not be asked: unreachable, its certificate or the token refused, a
    /// server error, too slow.
    #[error("{0}")]
    Unavailable(String),
    /// The catalog answered, and refused what was asked (a file it does not have, or cannot
    /// decode).
    #[error("{0}")]
    Refused(String),
}

/// Where resolution reads which snapshots a VM has.
pub trait BackupCatalog {
    /// Every snapshot of VM `vmid` in `storage`'s datastore and namespace, in no order.
    fn vm_snapshots(
        &self,
        storage: &ResolvedStorage,
        vmid: Vmid,
    ) -> Result<Vec<CatalogSnapshot>, CatalogError>;

    /// The decoded contents of blob `name` (`qemu-server.conf.blob`) of a snapshot.
    fn blob(
        &self,
        storage: &ResolvedStorage,
        vmid: Vmid,
        backup_time: i64,
        name: &str,
    ) -> Result<Vec<u8>, CatalogError>;

    /// Asks at once (within a bound) what resolution will then ask one VM at a time: the
    /// listings of `listed`, and the config of the newest finished snapshot of `configs`. What
    /// fails is left for the call that needs it to say.
    fn prefetch(&self, _storage: &ResolvedStorage, _listed: &[Vmid], _configs: &[Vmid]) {}
}

/// No catalog: `latest` is refused, saying what reads it.
#[derive(Debug, Clone, Copy)]
pub struct NoCatalog;

impl BackupCatalog for NoCatalog {
    fn vm_snapshots(
        &self,
        _storage: &ResolvedStorage,
        _vmid: Vmid,
    ) -> Result<Vec<CatalogSnapshot>, CatalogError> {
        Err(CatalogError::Unavailable(NO_CATALOG.into()))
    }

    fn blob(
        &self,
        _storage: &ResolvedStorage,
        _vmid: Vmid,
        _backup_time: i64,
        _name: &str,
    ) -> Result<Vec<u8>, CatalogError> {
        Err(CatalogError::Unavailable(NO_CATALOG.into()))
    }
}

const NO_CATALOG: &str = "this is read from the PBS API, which this command does not ask; use certistack-ctl plan check or plan show without --offline, or run";

/// The newest snapshot with a size.
pub fn newest_finished(snapshots: &[CatalogSnapshot]) -> Option<&CatalogSnapshot> {
    snapshots
        .iter()
        .filter(|snapshot| snapshot.size.is_some())
        .max_by_key(|snapshot| snapshot.backup_time)
}

/// What resolving `latest` found, for `plan show` and the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LatestFound {
    /// Snapshots the catalog listed for the VM, and how many of them were finished.
    pub listed: usize,
    pub finished: usize,
    /// The chosen snapshot's age when the plan was resolved, and its size in bytes.
    pub age_seconds: i64,
    pub size_bytes: u64,
}

/// `epoch` as a snapshot time, `YYYY-MM-DDTHH:MM:SSZ` (UTC), as PBS names snapshots.
pub fn snapshot_time(epoch: i64) -> Option<String> {
    let at = time::OffsetDateTime::from_unix_timestamp(epoch).ok()?;
    Some(format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second()
    ))
}

/// Why what a validation takes from the backup could not be read: the secret file, or a
/// refusal's key (after `validations[i] (name)`) and reason.
#[derive(Debug)]
pub(super) enum LatestError {
    Secret(FileError),
    /// The PBS API could not be asked: the plan is fine, the infrastructure is not.
    Unavailable(String, String),
    Refused(String, String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_finished_snapshot_wins_and_one_in_progress_is_skipped() {
        let snapshots = [
            CatalogSnapshot {
                backup_time: 100,
                size: Some(1),
                files: Vec::new(),
            },
            CatalogSnapshot {
                backup_time: 300,
                size: None,
                files: Vec::new(),
            },
            CatalogSnapshot {
                backup_time: 200,
                size: Some(2),
                files: Vec::new(),
            },
        ];
        assert_eq!(
            newest_finished(&snapshots).map(|s| s.backup_time),
            Some(200)
        );
        assert_eq!(newest_finished(&snapshots[1..2]), None);
        assert_eq!(newest_finished(&[]), None);
    }

    #[test]
    fn snapshot_times_are_written_as_pbs_names_them() {
        assert_eq!(
            snapshot_time(1_764_554_400).as_deref(),
            Some("2025-12-01T02:00:00Z")
        );
        assert_eq!(snapshot_time(0).as_deref(), Some("1970-01-01T00:00:00Z"));
    }
}
