//! One open run: its grant, its directory and its journal behind the run's operation lock, and
//! the guard through which its operations append to the journal.

use certistack_core::grant::Grant;
use certistack_core::journal::{Journal, JournalError, JournalUsage, Phase, Record};
use certistack_core::journal::{Op, Resource};
use certistack_core::validate::RunId;
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
        let journal = match self.journal.try_lock() {
            Ok(journal) => journal,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(describe_open(journal.records()))
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
