//! One open run: its grant, its directory and its journal behind the run's operation lock, and
//! the guard through which its operations append to the journal.

use certistack_core::grant::Grant;
use certistack_core::journal::{Journal, JournalError, JournalUsage, Phase, Record};
use certistack_core::journal::{Op, Resource};
use certistack_core::validate::RunId;
use certistack_proto::v1 as pb;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// One open run: its grant, its directory and its journal. Holding the operation lock
/// serializes the run's operations, so journal order is operation order; other runs are not
/// affected.
#[derive(Debug)]
pub struct RunHandle {
    pub run_id: RunId,
    pub grant: Arc<Grant>,
    pub dir: PathBuf,
    operation: tokio::sync::Mutex<()>,
    /// Locked only for an append (on the blocking pool) or a short read of the records.
    pub(super) journal: Arc<Mutex<Journal>>,
    /// Held by an append from before its write is handed to the blocking pool until it is on
    /// disk, also when its caller went away: appends, and the next operation, wait for it, so
    /// records keep the order of the calls that made them.
    writer: Arc<tokio::sync::Mutex<()>>,
    usage: Arc<JournalUsage>,
    pub(super) journal_path: PathBuf,
    /// Set under the operation lock when the run closes, so an operation that waited for the
    /// lock sees it before it acts.
    pub(super) closed: std::sync::atomic::AtomicBool,
}

/// Records of a journal an async worker may go through to find what is open (a validation
/// makes a few dozen).
pub const INLINE_RECORDS: u64 = 256;

/// What `records` leave open on the node, newest first, as `key (op phase)`.
fn describe_open(records: &[Record]) -> Vec<String> {
    crate::resources::open_newest_first(records)
        .into_iter()
        .map(|state| {
            format!(
                "{} ({} {})",
                state.key,
                state.last.entry.op,
                state.last.entry.phase.name()
            )
        })
        .collect()
}

/// The journal's lock if no append holds it (a poisoned lock is taken as [`lock_journal`] does).
fn try_lock_journal(journal: &Mutex<Journal>) -> Option<std::sync::MutexGuard<'_, Journal>> {
    match journal.try_lock() {
        Ok(journal) => Some(journal),
        Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

pub(super) fn lock_journal(journal: &Mutex<Journal>) -> std::sync::MutexGuard<'_, Journal> {
    // A poisoned lock means a panic during an append; the journal's own state (cut back to
    // its last record, or poisoned) is still consistent.
    journal
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl RunHandle {
    /// Locks the run for one operation.
    pub async fn lock(&self) -> RunGuard<'_> {
        let operation = self.operation.lock().await;
        // A write whose caller went away may still be in flight: decide from it, not without.
        drop(self.writer.lock().await);
        RunGuard {
            run: self,
            _operation: operation,
        }
    }

    /// Whether the run was closed (by EndRun or by expiry).
    pub fn is_closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn journal_path(&self) -> &Path {
        &self.journal_path
    }

    /// Records and bytes the journal holds, without waiting for a running operation.
    pub fn journal_usage(&self) -> (u64, u64) {
        self.usage.get()
    }

    /// What the journal says the run still has on the node, as `key (op phase)`. Takes the
    /// journal lock: call it off the async workers.
    pub fn open_resources(&self) -> Vec<String> {
        describe_open(lock_journal(&self.journal).records())
    }

    /// [`Self::open_resources`] without waiting: `None` while an append holds the journal
    /// (it may be syncing) or when the journal is longer than [`INLINE_RECORDS`], so an async
    /// worker may call it.
    pub fn try_open_resources(&self) -> Option<Vec<String>> {
        if self.usage.get().0 > INLINE_RECORDS {
            return None;
        }
        let journal = try_lock_journal(&self.journal)?;
        Some(describe_open(journal.records()))
    }

    /// The journal's records as `ReadJournal` sends them, without waiting: the wire forms the
    /// journal keeps (made as each record was appended once on disk, or from the file when the
    /// journal was opened), so these are the file's records. `None` while an append holds the
    /// journal (it may be syncing), when the journal is larger than
    /// [`certistack_core::journal::WIRE_KEPT_BYTES`] and when it is poisoned: read the file then.
    pub fn try_wire_records(&self) -> Option<Vec<pb::JournalRecord>> {
        try_lock_journal(&self.journal)?
            .wire_records()
            .map(<[_]>::to_vec)
    }

    pub(super) fn new(run_id: RunId, grant: Grant, dir: PathBuf, journal: Journal) -> Self {
        let journal_path = journal.path().to_owned();
        let usage = journal.usage();
        Self {
            run_id,
            grant: Arc::new(grant),
            dir,
            operation: tokio::sync::Mutex::new(()),
            journal: Arc::new(Mutex::new(journal)),
            writer: Arc::default(),
            usage,
            journal_path,
            closed: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

/// A locked run: appends go to its journal, fsync'd before they return.
#[derive(Debug)]
pub struct RunGuard<'a> {
    run: &'a RunHandle,
    _operation: tokio::sync::MutexGuard<'a, ()>,
}

/// A borrowed view of a run's records; holds the journal lock, so keep it short and never
/// across an `.await`.
#[derive(Debug)]
pub struct Records<'a>(std::sync::MutexGuard<'a, Journal>);

impl std::ops::Deref for Records<'_> {
    type Target = [Record];
    fn deref(&self) -> &[Record] {
        self.0.records()
    }
}

impl RunGuard<'_> {
    /// Appends one record; returns once it is on disk. The write and its fsync run on the
    /// blocking pool; if this call is dropped meanwhile, the write still completes and the
    /// record is kept, so the chain never forks.
    pub async fn append(
        &mut self,
        time_ms: i64,
        op: &Op,
        resource: &Resource,
        phase: Phase,
        detail: serde_json::Value,
    ) -> Result<Record, JournalError> {
        self.write(time_ms, op, resource, phase, detail, false)
            .await
            .and_then(|written| {
                written.ok_or_else(|| JournalError::Writer {
                    path: self.run.journal_path.clone(),
                    reason: "the record was not written".into(),
                })
            })
    }

    /// Appends a record unless the journal's last record says exactly the same: a repeated
    /// observation (the same residue found again) is not journaled twice.
    pub async fn append_if_changed(
        &mut self,
        time_ms: i64,
        op: &Op,
        resource: &Resource,
        phase: Phase,
        detail: serde_json::Value,
    ) -> Result<Option<Record>, JournalError> {
        self.write(time_ms, op, resource, phase, detail, true).await
    }

    /// Records that a step on `resource` starts: before its side effect.
    pub async fn intent(
        &mut self,
        time_ms: i64,
        op: &Op,
        resource: &Resource,
        detail: serde_json::Value,
    ) -> Result<Record, JournalError> {
        self.append(time_ms, op, resource, Phase::Intent, detail)
            .await
    }

    /// Records that a step ended with its side effect in place.
    pub async fn done(
        &mut self,
        time_ms: i64,
        op: &Op,
        resource: &Resource,
        detail: serde_json::Value,
    ) -> Result<Record, JournalError> {
        self.append(time_ms, op, resource, Phase::Done, detail)
            .await
    }

    /// Records that a step failed; `detail` says why, and whether its effect is unknown.
    pub async fn failed(
        &mut self,
        time_ms: i64,
        op: &Op,
        resource: &Resource,
        detail: serde_json::Value,
    ) -> Result<Record, JournalError> {
        self.append(time_ms, op, resource, Phase::Failed, detail)
            .await
    }

    /// Records that a step reversed `resource`: it is gone from the node.
    pub async fn undone(
        &mut self,
        time_ms: i64,
        op: &Op,
        resource: &Resource,
        detail: serde_json::Value,
    ) -> Result<Record, JournalError> {
        self.append(time_ms, op, resource, Phase::Undone, detail)
            .await
    }

    async fn write(
        &mut self,
        time_ms: i64,
        op: &Op,
        resource: &Resource,
        phase: Phase,
        detail: serde_json::Value,
        unless_repeated: bool,
    ) -> Result<Option<Record>, JournalError> {
        let journal = self.run.journal.clone();
        let (op, resource) = (op.clone(), resource.clone());
        let writing = self.run.writer.clone().lock_owned().await;
        tokio::task::spawn_blocking(move || {
            let _writing = writing;
            let mut journal = lock_journal(&journal);
            if unless_repeated && journal.last_is(&op, &resource, phase, &detail) {
                return Ok(None);
            }
            journal
                .append(time_ms, &op, &resource, phase, detail)
                .map(Some)
        })
        .await
        .map_err(|error| JournalError::Writer {
            path: self.run.journal_path.clone(),
            reason: error.to_string(),
        })?
    }

    pub fn head_hex(&self) -> String {
        lock_journal(&self.run.journal).head_hex()
    }

    /// The grant of the run this guard holds.
    pub fn grant(&self) -> &Grant {
        &self.run.grant
    }

    /// The run's records as this daemon wrote or loaded them (no file read, no copy).
    pub fn records(&self) -> Records<'_> {
        Records(lock_journal(&self.run.journal))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{hold, registry_with_open_run};
    use super::*;
    use certistack_core::journal;

    /// What ListRuns and ReadJournal read on an async worker never waits: while an append holds the
    /// journal (it may be syncing), the open resources and the records are left to the blocking pool.
    #[tokio::test(flavor = "multi_thread")]
    async fn open_resources_are_read_without_waiting_or_not_at_all() {
        let (dir, registry, run_id) = registry_with_open_run("try-open").await;
        hold(&registry, &run_id, "backup:drive-scsi0.img").await;
        let run = registry.get(&run_id).unwrap();
        let open = run.open_resources();
        assert_eq!(open, ["backup:drive-scsi0.img (backup.map intent)"]);
        assert_eq!(run.try_open_resources(), Some(open));
        // ReadJournal's records from memory are the file's, record for record.
        let on_disk: Vec<pb::JournalRecord> = journal::read(run.journal_path(), run_id.as_str())
            .unwrap()
            .records
            .iter()
            .map(Record::to_wire)
            .collect();
        assert_eq!(on_disk.len(), 2);
        assert_eq!(run.try_wire_records(), Some(on_disk));
        let appending = lock_journal(&run.journal);
        assert_eq!(run.try_open_resources(), None);
        assert_eq!(run.try_wire_records(), None);
        drop(appending);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An async worker goes through a journal of at most `INLINE_RECORDS` records; a longer one is
    /// left to the blocking pool.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_long_journal_is_not_read_on_an_async_worker() {
        let (dir, registry, run_id) = registry_with_open_run("inline-bound").await;
        let run = registry.get(&run_id).unwrap();
        let mut guard = run.lock().await;
        while run.journal_usage().0 < INLINE_RECORDS {
            guard
                .intent(
                    1,
                    &Op::BackupMap,
                    &Resource::parse("backup:drive-scsi0.img"),
                    serde_json::Value::Null,
                )
                .await
                .unwrap();
        }
        drop(guard);
        assert!(run.try_open_resources().is_some(), "at the bound: inline");
        hold(&registry, &run_id, "backup:drive-scsi1.img").await;
        assert_eq!(run.try_open_resources(), None, "past it: not inline");
        assert_eq!(run.open_resources().len(), 2);
        assert!(run.journal_usage().1 > journal::WIRE_KEPT_BYTES);
        assert_eq!(
            run.try_wire_records(),
            None,
            "a journal past the wire forms' bound is streamed"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
