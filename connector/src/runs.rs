//! The durable registry of runs on this node, and each run's journal.
//!
//! An open run lives in `<state>/runs/<run id>/`: `BeginRun` writes the signed grant there
//! (`grant.pb`), creates the run's journal and appends its first record, then syncs the run's
//! directory and `runs/` once each, so everything BeginRun made is durable before it answers.
//! A start that finds a run directory without its grant or without a first record finds a
//! BeginRun that never answered: nothing was done for that run, and the directory is removed.
//!
//! `EndRun` journals the end, writes `summary.json` (the closed run's index entry) and the
//! `closed` marker, and moves the directory to `<state>/closed/<first two characters of the run
//! id>/<run id>/`. A run is closed once its journal's last record closes it (`run.end`,
//! `run.expired`); a start that finds a closing record or a marker under `runs/` finishes the
//! move. So a start reads `runs/` only, the open runs, however many closed runs are kept, and a
//! closed run is looked up by its id on disk when it is asked about: its certificate and grant
//! are refused, its journal read, a page of closed runs listed in run-id order from a few of the
//! 256 shard directories. Closed runs hold no file open and nothing in memory. At start the
//! registry reopens the journals of open runs (setting a torn tail aside, see
//! [`certistack_core::journal`]) so recovery knows what each run left on the node. Closed runs are pruned
//! after `limits.closed_run_retention_days` once their grant expired, in bounded batches by the
//! daemon's periodic pass, never on the start path. The registry never holds a secret.
//!
//! Journal appends run on the blocking pool, never on an async worker; the run's operation lock
//! orders them, and a write whose caller went away still completes and is kept in memory.

use crate::config::Limits;
use certistack_core::files::{self, FileError};
use certistack_core::grant::{self, Grant};
use certistack_core::journal::{
    self, Journal, JournalError, JournalLimits, JournalUsage, Phase, Record,
};
use certistack_core::validate::{RunId, Validated};
use certistack_proto::v1 as pb;
use ed25519_dalek::VerifyingKey;
use prost::Message;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

const GRANT_FILE: &str = "grant.pb";
const CLOSED_FILE: &str = "closed";
const SUMMARY_FILE: &str = "summary.json";
const LOCK_FILE: &str = "lock";
/// Under the state directory: closed runs, sharded by the first characters of their id.
const CLOSED_ROOT: &str = "closed";
/// Characters of a run id naming its shard: 256 directories of hex pairs.
const SHARD_CHARS: usize = 2;
/// Closed runs a ListRuns page holds when the request names no page size.
pub const DEFAULT_CLOSED_PAGE: usize = 100;
/// The largest page of closed runs a ListRuns request may ask for.
pub const MAX_CLOSED_PAGE: usize = 1000;
/// Closed runs the retention sweep examines in one batch (one trip to the blocking pool).
pub const PRUNE_BATCH: usize = 256;

/// Where closed run `run_id` is kept under `state_dir`.
pub fn closed_run_dir(state_dir: &Path, run_id: &RunId) -> PathBuf {
    state_dir
        .join(CLOSED_ROOT)
        .join(shard_of(run_id))
        .join(run_id.as_str())
}

fn shard_of(run_id: &RunId) -> &str {
    // A run id is a validated UUID, longer than its shard prefix.
    run_id.as_str().get(..SHARD_CHARS).unwrap_or_default()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    Open,
    Closed { at_unix_ms: i64 },
}

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
    journal: Arc<Mutex<Journal>>,
    /// Held by an append from before its write is handed to the blocking pool until it is on
    /// disk, also when its caller went away: appends, and the next operation, wait for it, so
    /// records keep the order of the calls that made them.
    writer: Arc<tokio::sync::Mutex<()>>,
    usage: Arc<JournalUsage>,
    journal_path: PathBuf,
    /// Set under the operation lock when the run closes, so an operation that waited for the
    /// lock sees it before it acts.
    closed: std::sync::atomic::AtomicBool,
}

fn lock_journal(journal: &Mutex<Journal>) -> std::sync::MutexGuard<'_, Journal> {
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
        let journal = lock_journal(&self.journal);
        crate::resources::open_newest_first(journal.records())
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

    fn new(run_id: RunId, grant: Grant, dir: PathBuf, journal: Journal) -> Self {
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
        op: &str,
        resource: &str,
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
        op: &str,
        resource: &str,
        phase: Phase,
        detail: serde_json::Value,
    ) -> Result<Option<Record>, JournalError> {
        self.write(time_ms, op, resource, phase, detail, true).await
    }

    async fn write(
        &mut self,
        time_ms: i64,
        op: &str,
        resource: &str,
        phase: Phase,
        detail: serde_json::Value,
        unless_repeated: bool,
    ) -> Result<Option<Record>, JournalError> {
        let journal = self.run.journal.clone();
        let (op, resource) = (op.to_owned(), resource.to_owned());
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

/// A page of closed runs with their index entries, and the cursor of the next page.
pub type ClosedPage = (Vec<(RunId, ClosedRun)>, Option<RunId>);

/// The index entry of a closed run: what is listed and checked without reading its journal.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClosedRun {
    pub closed_unix_ms: i64,
    pub deadline_unix: i64,
    /// The closing operation (`run.end` or `run.expired`).
    pub closed_by: String,
    pub records: u64,
    pub bytes: u64,
    pub head_sha256: String,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(
        "run {0} was closed by EndRun; its certificate and grant are no longer accepted: mint a new run"
    )]
    Closed(RunId),
    #[error("run {0} is already open with a different grant")]
    OtherGrant(RunId),
    #[error("run {0} has not begun on this node; call BeginRun with its grant first")]
    NotBegun(RunId),
    #[error("run {0} still has {1} on this node; call Cleanup first")]
    OpenResources(RunId, String),
    #[error(
        "run {run} would share {shared} with open run {other} on this node; runs on one node must not overlap (end or clean up {other} first)"
    )]
    Overlap {
        run: RunId,
        other: RunId,
        shared: String,
    },
    #[error(
        "run {0} has a journal that cannot be used ({1}); inspect it before doing anything else with this run"
    )]
    Quarantined(RunId, String),
    #[error(
        "{open} runs are open or still hold resources past their deadline, the configured maximum is {max} (limits.max_concurrent_runs); end or clean up a run first"
    )]
    TooMany { open: usize, max: usize },
    #[error(
        "run {run} asks for {asked_cores} vCPUs and {asked_memory_mib} MiB for its sandbox VMs; open runs already hold {used_cores} vCPUs and {used_memory_mib} MiB of the node's {max_cores} vCPUs and {max_memory_mib} MiB (limits.max_sandbox_cores, limits.max_sandbox_memory_mib): end a run first"
    )]
    SandboxExhausted {
        run: RunId,
        asked_cores: u64,
        asked_memory_mib: u64,
        used_cores: u64,
        used_memory_mib: u64,
        max_cores: u64,
        max_memory_mib: u64,
    },
    #[error(
        "the state directory {path} is in use by another connector (process {holder}, lock file {lock}); stop it first"
    )]
    Locked {
        path: PathBuf,
        lock: PathBuf,
        holder: String,
    },
    #[error("the run registry's background work stopped: {0}")]
    Background(String),
    #[error(transparent)]
    Store(#[from] FileError),
    #[error(transparent)]
    Journal(#[from] JournalError),
}

/// What the registry bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegistryLimits {
    pub max_open: usize,
    pub journal: JournalLimits,
    pub max_sandbox_cores: u64,
    pub max_sandbox_memory_mib: u64,
    pub closed_run_retention_days: u64,
}

impl RegistryLimits {
    pub fn from_config(limits: &Limits) -> Self {
        Self {
            max_open: limits.max_concurrent_runs,
            journal: JournalLimits::new(limits.max_journal_records, limits.max_journal_bytes),
            max_sandbox_cores: u64::from(limits.max_sandbox_cores),
            max_sandbox_memory_mib: limits.max_sandbox_memory_mib,
            closed_run_retention_days: limits.closed_run_retention_days,
        }
    }
}

impl Default for RegistryLimits {
    fn default() -> Self {
        Self::from_config(&Limits::default())
    }
}

#[derive(Debug, Default)]
struct Inner {
    open: BTreeMap<RunId, Arc<RunHandle>>,
    /// Closed runs whose directory could not be moved out of `runs/` (or whose marker could not
    /// be written): closed all the same, and moved by the next start. Only failures land here.
    closing: BTreeMap<RunId, ClosedRun>,
    /// Open runs that could not be loaded (grant or journal unusable), with the reason: listed,
    /// never resumed, left for an operator to inspect.
    quarantined: BTreeMap<RunId, String>,
    /// The grants of quarantined runs whose grant still verifies: what they may have left on
    /// the node, which new runs must not overlap.
    quarantined_grants: Vec<Grant>,
}

#[derive(Debug)]
pub struct RunRegistry {
    /// `<state>/runs`: open and quarantined runs.
    dir: PathBuf,
    /// `<state>/closed`: closed runs, in shards.
    closed_dir: PathBuf,
    /// Verifies a closed run's stored grant when its summary must be rebuilt.
    authority: VerifyingKey,
    limits: RegistryLimits,
    inner: Mutex<Inner>,
    begin_lock: tokio::sync::Mutex<()>,
}

/// The longest journal line read back: one record can never be longer than the journal.
fn max_line(limits: &JournalLimits) -> u64 {
    limits.max_bytes
}

impl RunRegistry {
    /// Loads the open runs from `<state_dir>/runs`, creating it and `<state_dir>/closed` (0700)
    /// if needed. Closed runs are not read. Take the [`StateLock`] first: opening repairs torn
    /// journals, finishes the move of closed runs and removes half-made ones.
    pub fn open(
        state_dir: &Path,
        authority: &VerifyingKey,
        limits: RegistryLimits,
        now_ms: i64,
    ) -> Result<Self, RunError> {
        let dir = state_dir.join("runs");
        let closed_dir = state_dir.join(CLOSED_ROOT);
        files::create_private_dir(&dir)?;
        files::create_private_dir(&closed_dir)?;
        let mut inner = Inner::default();
        let entries = std::fs::read_dir(&dir).map_err(|error| FileError::Read {
            path: dir.clone(),
            error,
        })?;
        // Directory changes made here (closed runs moved, half-made runs removed), synced once
        // at the end rather than once per run.
        let mut moved = Vec::new();
        let mut removed = false;
        for entry in entries {
            let entry = entry.map_err(|error| FileError::Read {
                path: dir.clone(),
                error,
            })?;
            let name = entry.file_name();
            let Some(run_id) = name.to_str().and_then(|n| RunId::validate(n).ok()) else {
                tracing::warn!(path = %entry.path().display(), "ignoring an entry that is not a run directory");
                continue;
            };
            let run_dir = entry.path();
            if let Some(closed_unix_ms) = read_closed(&run_dir)? {
                // Closed, but the move into closed/ did not happen (a crash, or a connector
                // that kept closed runs in runs/): finish it.
                match move_closed(&run_dir, &closed_dir, &run_id) {
                    Ok(shard) => moved.push(shard),
                    Err(error) => {
                        tracing::error!(%run_id, %error, "cannot move the closed run out of runs/; it stays closed where it is");
                        let summary =
                            closed_summary(&run_dir, &run_id, closed_unix_ms, authority, &limits);
                        inner.closing.insert(run_id, summary);
                    }
                }
                continue;
            }
            if half_made(&run_dir, &run_id) {
                // BeginRun did not answer, so no operation was ever made for this run: what
                // it left is the start of its own bookkeeping, nothing on the node.
                tracing::warn!(%run_id, "removing a run directory BeginRun did not finish (no grant or no first record)");
                std::fs::remove_dir_all(&run_dir).map_err(|error| FileError::Write {
                    path: run_dir.clone(),
                    error,
                })?;
                removed = true;
                continue;
            }
            let grant = match load_grant(&run_dir, authority) {
                Ok(grant) if grant.run_id == run_id => grant,
                Ok(_) => {
                    tracing::error!(%run_id, "stored grant names another run; the run is not loaded");
                    inner
                        .quarantined
                        .insert(run_id, "its stored grant names another run".into());
                    continue;
                }
                Err(reason) => {
                    tracing::error!(%run_id, %reason, "stored grant does not verify; the run is not loaded");
                    inner.quarantined.insert(
                        run_id,
                        format!("its stored grant does not verify: {reason}"),
                    );
                    continue;
                }
            };
            let journal = match Journal::open(&run_dir, run_id.as_str(), now_ms) {
                Ok((journal, _, torn)) => {
                    if let Some(torn) = torn {
                        tracing::warn!(%run_id, bytes = torn.bytes.len(), reason = %torn.reason, "journal had a torn last record; preserved it and journaled the repair");
                    }
                    journal
                }
                Err(error) => {
                    tracing::error!(%run_id, %error, "journal cannot be used; the run is not loaded");
                    inner.quarantined.insert(run_id, error.to_string());
                    inner.quarantined_grants.push(grant);
                    continue;
                }
            };
            let journal = journal.with_limits(limits.journal);
            // A crash (or a failed write) after the closing record but before the marker: the
            // journal says closed, so the run is closed; finish writing what says so.
            if let Some(last) = journal.records().last()
                && journal::CLOSING_OPS.contains(&last.entry.op.as_str())
            {
                let summary = ClosedRun {
                    closed_unix_ms: last.entry.time_ms,
                    deadline_unix: grant.deadline_unix,
                    closed_by: last.entry.op.clone(),
                    records: journal.usage().get().0,
                    bytes: journal.usage().get().1,
                    head_sha256: journal.head_hex(),
                };
                drop(journal);
                tracing::warn!(%run_id, "the run's journal ends with {} but it was not closed on disk; closing it", summary.closed_by);
                match write_closed(&run_dir, &summary)
                    .and_then(|()| move_closed(&run_dir, &closed_dir, &run_id))
                {
                    Ok(shard) => moved.push(shard),
                    Err(error) => {
                        tracing::error!(%run_id, %error, "cannot close the run on disk; it stays closed where it is");
                        inner.closing.insert(run_id, summary);
                    }
                }
                continue;
            }
            let handle = Arc::new(RunHandle::new(run_id.clone(), grant, run_dir, journal));
            inner.open.insert(run_id, handle);
        }
        let moved_runs = moved.len();
        moved.sort();
        moved.dedup();
        for shard in &moved {
            sync_dir(shard)?;
        }
        if !moved.is_empty() {
            sync_dir(&closed_dir)?;
            tracing::info!(count = moved_runs, "moved closed runs out of runs/");
        }
        if removed || !moved.is_empty() {
            sync_dir(&dir)?;
        }
        Ok(Self {
            dir,
            closed_dir,
            authority: *authority,
            limits,
            inner: Mutex::new(inner),
            begin_lock: tokio::sync::Mutex::new(()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A poisoned lock only means another request panicked; the maps stay consistent
        // because every update is a single insert or remove.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn limits(&self) -> &RegistryLimits {
        &self.limits
    }

    /// An open run.
    pub fn get(&self, run_id: &RunId) -> Option<Arc<RunHandle>> {
        self.lock().open.get(run_id).cloned()
    }

    /// Why `run_id` is quarantined, as a refusal, if it is.
    pub fn quarantine(&self, run_id: &RunId) -> Option<RunError> {
        let reason = self.lock().quarantined.get(run_id).cloned()?;
        Some(RunError::Quarantined(run_id.clone(), reason))
    }

    /// Runs that could not be loaded at start, with the reason.
    pub fn quarantined(&self) -> Vec<(RunId, String)> {
        self.lock()
            .quarantined
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Whether `run_id` is closed on this node: a stat on disk unless the run is open.
    pub fn is_closed(&self, run_id: &RunId) -> bool {
        {
            let inner = self.lock();
            if let Some(open) = inner.open.get(run_id) {
                return open.is_closed();
            }
            if inner.closing.contains_key(run_id) {
                return true;
            }
        }
        self.closed_on_disk(run_id)
    }

    fn closed_on_disk(&self, run_id: &RunId) -> bool {
        std::fs::symlink_metadata(self.closed_path(run_id)).is_ok()
    }

    fn closed_path(&self, run_id: &RunId) -> PathBuf {
        self.closed_dir.join(shard_of(run_id)).join(run_id.as_str())
    }

    /// The open runs.
    pub fn open_runs(&self) -> Vec<Arc<RunHandle>> {
        self.lock().open.values().cloned().collect()
    }

    /// Up to `page_size` closed runs whose id sorts after `after`, in run-id order, with the
    /// cursor of the next page (the last id returned) when more may follow. Reads the shard
    /// directories the page spans and each listed run's summary, nothing else: the cost is
    /// that of the page, not of the history. Blocks on the file system.
    pub fn closed_page(
        &self,
        after: Option<&RunId>,
        page_size: usize,
    ) -> Result<ClosedPage, RunError> {
        let mut ids = self.closed_ids_after(after, page_size.saturating_add(1))?;
        {
            // Runs whose move failed are closed too; they sort in among the others.
            let inner = self.lock();
            ids.extend(
                inner
                    .closing
                    .keys()
                    .filter(|id| after.is_none_or(|after| *id > after))
                    .cloned(),
            );
        }
        ids.sort();
        ids.dedup();
        let more = ids.len() > page_size;
        ids.truncate(page_size);
        let next = if more { ids.last().cloned() } else { None };
        let page = ids
            .into_iter()
            .filter_map(|run_id| {
                let closing = self.lock().closing.get(&run_id).cloned();
                let summary = match closing {
                    Some(summary) => summary,
                    None => {
                        let run_dir = self.closed_path(&run_id);
                        // Pruned since the directory was listed.
                        if std::fs::symlink_metadata(&run_dir).is_err() {
                            return None;
                        }
                        let closed_unix_ms = closed_time(&run_dir).unwrap_or(0);
                        closed_summary(
                            &run_dir,
                            &run_id,
                            closed_unix_ms,
                            &self.authority,
                            &self.limits,
                        )
                    }
                };
                Some((run_id, summary))
            })
            .collect();
        Ok((page, next))
    }

    /// Up to `count` ids of closed runs on disk after `after`, in order: the shards are the
    /// ids' first characters, so they are read in order and only as far as `count` reaches.
    fn closed_ids_after(
        &self,
        after: Option<&RunId>,
        count: usize,
    ) -> Result<Vec<RunId>, RunError> {
        let mut shards: Vec<String> = read_names(&self.closed_dir)?
            .into_iter()
            .filter(|name| {
                name.len() == SHARD_CHARS
                    && after.is_none_or(|after| name.as_str() >= shard_of(after))
            })
            .collect();
        shards.sort();
        let mut ids = Vec::new();
        for shard in shards {
            if ids.len() >= count {
                break;
            }
            let mut in_shard: Vec<RunId> = read_names(&self.closed_dir.join(&shard))?
                .into_iter()
                .filter_map(|name| RunId::validate(&name).ok())
                .filter(|id| after.is_none_or(|after| id > after))
                .collect();
            in_shard.sort();
            ids.extend(in_shard);
        }
        ids.truncate(count);
        #[cfg(test)]
        tests::closed_read(&self.closed_dir);
        Ok(ids)
    }

    /// The journal file of an open or closed run.
    pub fn journal_path(&self, run_id: &RunId) -> Option<PathBuf> {
        {
            let inner = self.lock();
            if let Some(handle) = inner.open.get(run_id) {
                return Some(handle.journal_path.clone());
            }
            if inner.closing.contains_key(run_id) {
                return Some(self.dir.join(run_id.as_str()).join(journal::FILE_NAME));
            }
        }
        self.closed_on_disk(run_id)
            .then(|| self.closed_path(run_id).join(journal::FILE_NAME))
    }

    /// The longest journal line a reader accepts.
    pub fn max_journal_line(&self) -> u64 {
        max_line(&self.limits.journal)
    }

    /// Opens a run, or resumes it when it is already open with the same grant. Returns whether
    /// it resumed.
    pub async fn begin(
        &self,
        signed: &pb::SignedRunGrant,
        grant: Grant,
        now_ms: i64,
    ) -> Result<bool, RunError> {
        // One BeginRun at a time, so the checks below and the insert at the end see the same
        // set of runs.
        let _begin = self.begin_lock.lock().await;
        let run_id = grant.run_id.clone();
        let now_unix = now_ms.div_euclid(1000);
        if self.is_closed(&run_id) {
            return Err(RunError::Closed(run_id));
        }
        let others = {
            let inner = self.lock();
            if let Some(reason) = inner.quarantined.get(&run_id) {
                return Err(RunError::Quarantined(run_id, reason.clone()));
            }
            if let Some(existing) = inner.open.get(&run_id) {
                return if existing.grant.digest == grant.digest {
                    Ok(true)
                } else {
                    Err(RunError::OtherGrant(run_id))
                };
            }
            // Runs on one node never share what they touch: two runs mapping the same archive,
            // using the same VMID or the same VNet could undo or watch each other's resources.
            for other in &inner.quarantined_grants {
                if let Some(shared) = overlap(&grant, other) {
                    return Err(RunError::Overlap {
                        run: run_id,
                        other: other.run_id.clone(),
                        shared,
                    });
                }
            }
            for other in inner.open.values() {
                if let Some(shared) = overlap(&grant, &other.grant) {
                    return Err(RunError::Overlap {
                        run: run_id,
                        other: other.grant.run_id.clone(),
                        shared,
                    });
                }
            }
            inner.open.values().cloned().collect::<Vec<_>>()
        };
        // A run counts while its deadline has not passed, and after it as long as its journal
        // says it still holds something on the node (reading that takes the journal locks).
        let counted = tokio::task::spawn_blocking(move || {
            others
                .into_iter()
                .filter(|run| {
                    run.grant.deadline_unix > now_unix || !run.open_resources().is_empty()
                })
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|error| RunError::Background(error.to_string()))?;
        if counted.len() >= self.limits.max_open {
            return Err(RunError::TooMany {
                open: counted.len(),
                max: self.limits.max_open,
            });
        }
        let (used_cores, used_memory_mib) = counted
            .iter()
            .map(|run| sandbox_demand(&run.grant))
            .fold((0u64, 0u64), |(c, m), (dc, dm)| {
                (c.saturating_add(dc), m.saturating_add(dm))
            });
        let (asked_cores, asked_memory_mib) = sandbox_demand(&grant);
        if used_cores.saturating_add(asked_cores) > self.limits.max_sandbox_cores
            || used_memory_mib.saturating_add(asked_memory_mib) > self.limits.max_sandbox_memory_mib
        {
            return Err(RunError::SandboxExhausted {
                run: run_id,
                asked_cores,
                asked_memory_mib,
                used_cores,
                used_memory_mib,
                max_cores: self.limits.max_sandbox_cores,
                max_memory_mib: self.limits.max_sandbox_memory_mib,
            });
        }
        let run_dir = self.dir.join(run_id.as_str());
        let runs_dir = self.dir.clone();
        let grant_bytes = signed.encode_to_vec();
        let detail = serde_json::json!({ "grant_sha256": hex::encode(grant.digest), "deadline_unix": grant.deadline_unix });
        let journal_limits = self.limits.journal;
        let (id, dir) = (run_id.clone(), run_dir.clone());
        let journal = tokio::task::spawn_blocking(move || -> Result<Journal, RunError> {
            create_run(
                &runs_dir,
                &dir,
                &id,
                &grant_bytes,
                now_ms,
                detail,
                journal_limits,
            )
        })
        .await
        .map_err(|error| RunError::Background(error.to_string()))??;
        let handle = Arc::new(RunHandle::new(run_id.clone(), grant, run_dir, journal));
        Ok(self.lock().open.insert(run_id, handle).is_some())
    }

    /// Closes a run durably; refused for a run that is not open.
    pub async fn end(&self, run_id: &RunId, now_ms: i64) -> Result<i64, RunError> {
        self.close(run_id, now_ms, "run.end").await
    }

    /// Closes a run the daemon cleaned up after its deadline passed.
    pub async fn expire(&self, run_id: &RunId, now_ms: i64) -> Result<i64, RunError> {
        self.close(run_id, now_ms, "run.expired").await
    }

    async fn close(&self, run_id: &RunId, now_ms: i64, op: &str) -> Result<i64, RunError> {
        let Some(handle) = self.get(run_id) else {
            return Err(if self.is_closed(run_id) {
                RunError::Closed(run_id.clone())
            } else {
                RunError::NotBegun(run_id.clone())
            });
        };
        let mut run = handle.lock().await;
        // Another close (EndRun, or the expiry reaper) may have held the lock first.
        if handle.is_closed() {
            return Err(RunError::Closed(run_id.clone()));
        }
        // A run ends clean: what it still has on the node must be cleaned up first, or it
        // would outlive the run that owns it.
        let open: Vec<String> = crate::resources::open_newest_first(&run.records())
            .into_iter()
            .map(|state| state.key)
            .collect();
        if !open.is_empty() {
            return Err(RunError::OpenResources(run_id.clone(), open.join(", ")));
        }
        // If this fails, the journal is cut back (or refuses every further record) and the run
        // stays open, in memory as on disk.
        let record = run
            .append(
                now_ms,
                op,
                &format!("run:{run_id}"),
                Phase::Done,
                serde_json::Value::Null,
            )
            .await?;
        // From here the run is closed: its journal says so, and a restart reads it that way.
        handle
            .closed
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let (records, bytes) = handle.journal_usage();
        let summary = ClosedRun {
            closed_unix_ms: now_ms,
            deadline_unix: handle.grant.deadline_unix,
            closed_by: op.to_owned(),
            records,
            bytes,
            head_sha256: hex::encode(record.hash),
        };
        let (run_dir, runs_dir, closed_dir) = (
            handle.dir.clone(),
            self.dir.clone(),
            self.closed_dir.clone(),
        );
        let (id, marker) = (run_id.clone(), summary.clone());
        let moved = tokio::task::spawn_blocking(move || {
            write_closed(&run_dir, &marker)?;
            let made_shard = !closed_dir.join(shard_of(&id)).exists();
            let shard = move_closed(&run_dir, &closed_dir, &id)?;
            sync_dir(&shard)?;
            if made_shard {
                sync_dir(&closed_dir)?;
            }
            sync_dir(&runs_dir)
        })
        .await
        .map_err(|error| RunError::Background(error.to_string()))
        .and_then(|moved| moved.map_err(RunError::from));
        let mut inner = self.lock();
        inner.open.remove(run_id);
        if let Err(error) = moved {
            tracing::error!(%run_id, %error, "the run is closed (its journal ends with {op}) but it could not be moved out of runs/; the next start moves it");
            inner.closing.insert(run_id.clone(), summary);
        }
        Ok(now_ms)
    }

    /// Removes closed runs older than the retention whose grant has expired, in batches of
    /// [`PRUNE_BATCH`]. Open and quarantined runs are not under `closed/`, so they are never
    /// pruned. Blocks on the file system: call it off the async workers (the daemon's
    /// periodic pass calls [`RunRegistry::prune_batch`] once per trip to the blocking pool).
    pub fn prune(&self, now_ms: i64) -> Result<Vec<RunId>, RunError> {
        let mut pruned = Vec::new();
        let mut after = None;
        loop {
            let (batch, next) = self.prune_batch(now_ms, after.as_ref(), PRUNE_BATCH)?;
            pruned.extend(batch);
            match next {
                Some(next) => after = Some(next),
                None => return Ok(pruned),
            }
        }
    }

    /// Examines up to `batch` closed runs after `after` (in run-id order) and removes those
    /// past their retention whose grant has expired. Returns them, and where the next batch
    /// starts (`None` once the sweep reached the last closed run).
    pub fn prune_batch(
        &self,
        now_ms: i64,
        after: Option<&RunId>,
        batch: usize,
    ) -> Result<(Vec<RunId>, Option<RunId>), RunError> {
        let retention_ms = i64::try_from(self.limits.closed_run_retention_days)
            .unwrap_or(i64::MAX)
            .saturating_mul(86_400_000);
        let ids = self.closed_ids_after(after, batch.max(1))?;
        let next = (ids.len() >= batch.max(1))
            .then(|| ids.last().cloned())
            .flatten();
        let mut pruned = Vec::new();
        let mut shards = Vec::new();
        for run_id in ids {
            let run_dir = self.closed_path(&run_id);
            let Some(closed_unix_ms) = closed_time(&run_dir) else {
                tracing::warn!(%run_id, "the closed run's close time cannot be read (no marker, no journal); it is kept");
                continue;
            };
            let run = closed_summary(
                &run_dir,
                &run_id,
                closed_unix_ms,
                &self.authority,
                &self.limits,
            );
            let due = run.closed_unix_ms.saturating_add(retention_ms) < now_ms
                && run.deadline_unix.saturating_mul(1000) < now_ms;
            if !due {
                continue;
            }
            match std::fs::remove_dir_all(&run_dir) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => {
                    tracing::error!(%run_id, %error, "cannot prune the closed run's directory");
                    continue;
                }
            }
            shards.push(self.closed_dir.join(shard_of(&run_id)));
            pruned.push(run_id);
        }
        shards.dedup();
        for shard in &shards {
            sync_dir(shard)?;
        }
        if !pruned.is_empty() {
            tracing::info!(
                count = pruned.len(),
                retention_days = self.limits.closed_run_retention_days,
                "pruned closed runs past their retention"
            );
        }
        Ok((pruned, next))
    }
}

/// Makes a new run's directory with its grant, its journal and the journal's first record, in
/// four syncs: the grant file, the first record, the run directory, then `runs/`. Everything
/// is durable before BeginRun answers. A crash before the last sync can leave a run directory
/// without its grant or without its first record, which the next start removes
/// ([`half_made`]). A failure removes what was made, so the controller's retry of BeginRun
/// starts clean.
fn create_run(
    runs_dir: &Path,
    dir: &Path,
    run_id: &RunId,
    grant_bytes: &[u8],
    now_ms: i64,
    detail: serde_json::Value,
    limits: JournalLimits,
) -> Result<Journal, RunError> {
    let made = (|| -> Result<Journal, RunError> {
        files::create_private_dir(dir)?;
        files::write_new_without_dir_sync(&dir.join(GRANT_FILE), grant_bytes, 0o600)?;
        let mut journal = Journal::create(dir, run_id.as_str())?.with_limits(limits);
        journal.append(
            now_ms,
            "run.begin",
            &format!("run:{run_id}"),
            Phase::Done,
            detail,
        )?;
        // The grant file's and the journal's entries, then the run's entry in runs/: the
        // resources the run creates are found through them after a power loss.
        sync_dir(dir)?;
        sync_dir(runs_dir)?;
        Ok(journal)
    })();
    if made.is_err()
        && let Err(error) = std::fs::remove_dir_all(dir)
        && error.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(%run_id, %error, "cannot remove the run directory a failed BeginRun left; the next start removes it");
    }
    made
}

/// Whether `run_dir` (not closed) is what a BeginRun that never answered leaves: no grant, or no
/// journal record, or only its first record without the grant. No operation can have been made
/// for such a run. A journal that cannot be read is not half-made: it is quarantined.
fn half_made(run_dir: &Path, run_id: &RunId) -> bool {
    let grant_present = run_dir.join(GRANT_FILE).exists();
    let journal_path = run_dir.join(journal::FILE_NAME);
    if !journal_path.exists() {
        return true;
    }
    match journal::read(&journal_path, run_id.as_str()) {
        Ok(loaded) => match loaded.records.as_slice() {
            [] => true,
            [only] => !grant_present && only.entry.op == "run.begin",
            _ => false,
        },
        Err(_) => false,
    }
}

/// Moves closed run `run_dir` into its shard under `closed_dir`, creating the shard if needed.
/// Returns the shard; the caller syncs it, `closed_dir` when a shard was made, and `runs/`.
fn move_closed(run_dir: &Path, closed_dir: &Path, run_id: &RunId) -> Result<PathBuf, FileError> {
    let shard = closed_dir.join(shard_of(run_id));
    files::create_private_dir(&shard)?;
    let target = shard.join(run_id.as_str());
    std::fs::rename(run_dir, &target).map_err(|error| FileError::Write {
        path: target.clone(),
        error,
    })?;
    Ok(shard)
}

/// The names in `dir`; none when it does not exist.
fn read_names(dir: &Path) -> Result<Vec<String>, FileError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => {
            return Err(FileError::Read {
                path: dir.to_owned(),
                error,
            });
        }
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|error| FileError::Read {
            path: dir.to_owned(),
            error,
        })?;
        if let Ok(name) = entry.file_name().into_string() {
            names.push(name);
        }
    }
    Ok(names)
}

/// vCPUs and MiB the grant's sandbox VMs may ask for together.
fn sandbox_demand(grant: &Grant) -> (u64, u64) {
    grant
        .sandbox_vms
        .values()
        .fold((0u64, 0u64), |(cores, memory), vm| {
            (
                cores.saturating_add(u64::from(vm.max_cores)),
                memory.saturating_add(u64::from(vm.max_memory_mib)),
            )
        })
}

/// The summary of a closed run, rebuilt from its journal (once) when a crash or an older
/// connector left none.
fn closed_summary(
    run_dir: &Path,
    run_id: &RunId,
    closed_unix_ms: i64,
    authority: &VerifyingKey,
    limits: &RegistryLimits,
) -> ClosedRun {
    #[cfg(test)]
    tests::closed_read(run_dir);
    if let Ok(text) = std::fs::read(run_dir.join(SUMMARY_FILE))
        && let Ok(summary) = serde_json::from_slice::<ClosedRun>(&text)
    {
        return summary;
    }
    let deadline_unix = load_grant(run_dir, authority).map_or(0, |g| g.deadline_unix);
    let journal_path = run_dir.join(journal::FILE_NAME);
    let summary = match journal::summarize(
        &journal_path,
        run_id.as_str(),
        max_line(&limits.journal),
    ) {
        Ok(found) => ClosedRun {
            closed_unix_ms,
            deadline_unix,
            closed_by: found.last_op.unwrap_or_default(),
            records: found.records,
            bytes: found.bytes,
            head_sha256: hex::encode(found.head),
        },
        Err(error) => {
            tracing::warn!(%run_id, %error, "the closed run's journal does not verify; it stays closed");
            ClosedRun {
                closed_unix_ms,
                deadline_unix,
                closed_by: String::new(),
                records: 0,
                bytes: 0,
                head_sha256: String::new(),
            }
        }
    };
    if let Ok(text) = serde_json::to_vec(&summary)
        && let Err(error) = files::write_atomic(&run_dir.join(SUMMARY_FILE), &text, 0o600)
    {
        tracing::warn!(%run_id, %error, "cannot store the closed run's summary; it is rebuilt at the next start");
    }
    summary
}

/// Writes a closed run's summary, then its marker, each replaced atomically but not synced:
/// the journal's closing record (synced) is what makes the run closed, and a summary or marker
/// a crash loses is rebuilt from it, so a close costs no sync for them.
fn write_closed(run_dir: &Path, summary: &ClosedRun) -> Result<(), FileError> {
    let text = serde_json::to_vec(summary).unwrap_or_default();
    files::replace_without_sync(&run_dir.join(SUMMARY_FILE), &text, 0o600)?;
    files::replace_without_sync(
        &run_dir.join(CLOSED_FILE),
        summary.closed_unix_ms.to_string().as_bytes(),
        0o600,
    )
}

/// Makes the entries of `dir` (a created or removed run directory) durable.
fn sync_dir(dir: &Path) -> Result<(), FileError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|error| FileError::Write {
            path: dir.to_owned(),
            error,
        })?;
    #[cfg(test)]
    tests::synced(dir);
    Ok(())
}

/// The single-instance lock on a state directory: `<state_dir>/lock`, holding the PID of the
/// connector that holds it. Released when dropped (or when the process dies).
#[derive(Debug)]
pub struct StateLock {
    _file: File,
}

impl StateLock {
    /// Takes the lock for a serving connector, creating the state directory (0700) and the
    /// lock file if needed, and writes this process's PID into it.
    pub fn acquire(state_dir: &Path) -> Result<Self, RunError> {
        files::create_private_dir(state_dir)?;
        let path = state_dir.join(LOCK_FILE);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|error| FileError::Write {
                path: path.clone(),
                error,
            })?;
        take_lock(
            &mut file,
            state_dir,
            &path,
            rustix::fs::FlockOperation::NonBlockingLockExclusive,
        )?;
        let written = file
            .set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(format!("{}\n", std::process::id()).as_bytes()))
            .and_then(|()| file.sync_all());
        written.map_err(|error| FileError::Write { path, error })?;
        Ok(Self { _file: file })
    }

    /// Takes the lock without writing anything, for a read-only check: `None` when no
    /// connector ever served from `state_dir` (no lock file).
    pub fn probe(state_dir: &Path) -> Result<Option<Self>, RunError> {
        let path = state_dir.join(LOCK_FILE);
        let mut file = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(FileError::Read { path, error }.into()),
        };
        take_lock(
            &mut file,
            state_dir,
            &path,
            rustix::fs::FlockOperation::NonBlockingLockShared,
        )?;
        Ok(Some(Self { _file: file }))
    }
}

fn take_lock(
    file: &mut File,
    state_dir: &Path,
    path: &Path,
    operation: rustix::fs::FlockOperation,
) -> Result<(), RunError> {
    match rustix::fs::flock(&*file, operation) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::WOULDBLOCK) => {
            let mut holder = String::new();
            let _ = Read::take(&mut *file, 32).read_to_string(&mut holder);
            let holder = holder.trim();
            Err(RunError::Locked {
                path: state_dir.to_owned(),
                lock: path.to_owned(),
                holder: if holder.is_empty() {
                    "unknown".into()
                } else {
                    holder.to_owned()
                },
            })
        }
        Err(error) => Err(FileError::Write {
            path: path.to_owned(),
            error: error.into(),
        }
        .into()),
    }
}

/// What two grants would share on one node, if anything.
pub fn overlap(a: &Grant, b: &Grant) -> Option<String> {
    if let Some(vmid) = a.sandbox_vms.keys().find(|v| b.sandbox_vms.contains_key(v)) {
        return Some(format!("VMID {vmid}"));
    }
    if a.vnet == b.vnet {
        return Some(format!("VNet {}", a.vnet));
    }
    let (ra, rb) = (&a.repository, &b.repository);
    let same_snapshot = a.snapshot == b.snapshot
        && ra.server == rb.server
        && ra.port == rb.port
        && ra.datastore == rb.datastore;
    // The namespace is deliberately not compared: the client's mapping name leaves it out, so
    // the same snapshot and archive in two namespaces would map under one name.
    if same_snapshot && let Some(archive) = a.archives.intersection(&b.archives).next() {
        return Some(format!("archive {archive} of {}", a.snapshot));
    }
    None
}

/// When a closed run closed, for its retention: the marker's time, or, when a crash lost the
/// marker's content (it is written without a sync: the journal's closing record is what is
/// durable), the time of the journal's last write. Never 0, which would make a run whose
/// marker was lost due for pruning at once; `None` when neither can be read.
fn closed_time(run_dir: &Path) -> Option<i64> {
    if let Ok(Some(time)) = read_closed(run_dir)
        && time > 0
    {
        return Some(time);
    }
    let modified = std::fs::metadata(run_dir.join(journal::FILE_NAME))
        .ok()?
        .modified()
        .ok()?;
    let ms = modified
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_millis();
    i64::try_from(ms).ok().filter(|ms| *ms > 0)
}

fn read_closed(run_dir: &Path) -> Result<Option<i64>, FileError> {
    let path = run_dir.join(CLOSED_FILE);
    match std::fs::read_to_string(&path) {
        // An unreadable timestamp still means closed: refusing is the safe reading.
        Ok(text) => Ok(Some(text.trim().parse().unwrap_or(0))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(FileError::Read { path, error }),
    }
}

fn load_grant(run_dir: &Path, authority: &VerifyingKey) -> Result<Grant, String> {
    let bytes = std::fs::read(run_dir.join(GRANT_FILE)).map_err(|e| e.to_string())?;
    let signed = pb::SignedRunGrant::decode(bytes.as_slice()).map_err(|e| e.to_string())?;
    grant::verify(&signed, authority).map_err(|e| e.to_string())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use certistack_core::fixtures::{full_wire_grant, sign};
    use ed25519_dalek::SigningKey;

    static SYNCED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

    /// Every directory fsync'd through [`sync_dir`], so tests can see which were.
    pub(crate) fn synced(dir: &Path) {
        SYNCED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(dir.to_owned());
    }

    static CLOSED_READS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

    /// Every closed run read and every listing of closed runs, so tests can see that a start
    /// reads none.
    pub(crate) fn closed_read(path: &Path) {
        CLOSED_READS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(path.to_owned());
    }

    fn closed_reads_under(dir: &Path) -> usize {
        CLOSED_READS
            .lock()
            .unwrap()
            .iter()
            .filter(|path| path.starts_with(dir))
            .count()
    }

    fn synced_count(dir: &Path) -> usize {
        SYNCED.lock().unwrap().iter().filter(|d| *d == dir).count()
    }

    /// The closed runs' ids, page by page, and the number of pages.
    fn all_closed(registry: &RunRegistry, page_size: usize) -> (Vec<RunId>, usize) {
        let (mut ids, mut pages, mut after) = (Vec::new(), 0, None);
        loop {
            let (page, next) = registry.closed_page(after.as_ref(), page_size).unwrap();
            pages += 1;
            assert!(page.len() <= page_size);
            ids.extend(page.into_iter().map(|(id, _)| id));
            match next {
                Some(next) => after = Some(next),
                None => return (ids, pages),
            }
        }
    }

    /// `count` runs begun and ended, in a fresh registry; their ids, sorted.
    async fn closed_runs(tag: &str, count: u32) -> (PathBuf, RunRegistry, Vec<RunId>) {
        let dir = state_dir(tag);
        let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
        let mut ids = Vec::new();
        for n in 0..count {
            let (signed, grant) = nth_grant(n);
            let run_id = grant.run_id.clone();
            registry.begin(&signed, grant, 2_000_000).await.unwrap();
            registry.end(&run_id, 2_000_500).await.unwrap();
            ids.push(run_id);
        }
        ids.sort();
        (dir, registry, ids)
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn closed_runs_page_in_run_id_order_with_a_cursor() {
        let (dir, registry, ids) = closed_runs("page", 7).await;
        // An open run is not a closed run's page.
        let (signed, grant) = nth_grant(20);
        registry.begin(&signed, grant, 2_000_000).await.unwrap();
        let (first, next) = registry.closed_page(None, 3).unwrap();
        let first: Vec<RunId> = first.into_iter().map(|(id, _)| id).collect();
        assert_eq!(first, ids[..3]);
        assert_eq!(
            next.as_ref(),
            Some(&ids[2]),
            "the cursor is the page's last run"
        );
        let (second, _) = registry.closed_page(next.as_ref(), 3).unwrap();
        assert_eq!(second.first().map(|(id, _)| id), Some(&ids[3]));
        assert_eq!(all_closed(&registry, 3), (ids.clone(), 3));
        // A page exactly as long as what is left is the last one: no cursor.
        assert_eq!(all_closed(&registry, 7), (ids.clone(), 1));
        assert_eq!(all_closed(&registry, 1000), (ids.clone(), 1));
        // After the last run: an empty last page.
        let (after_last, next) = registry.closed_page(ids.last(), 3).unwrap();
        assert!(after_last.is_empty() && next.is_none());
        // Each entry is the run's summary.
        let (page, _) = registry.closed_page(None, 1).unwrap();
        assert_eq!(page[0].1.closed_by, "run.end");
        assert_eq!(page[0].1.records, 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A start lists and reads no closed run, even when every closed run's files are garbage;
    /// each is still known as closed when asked about by its id, and listed when listed.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_start_reads_no_closed_run_and_finds_each_when_asked() {
        let (dir, registry, ids) = closed_runs("start-flat", 5).await;
        drop(registry);
        for run_id in &ids {
            let closed = closed_run_dir(&dir, run_id);
            assert!(closed.is_dir(), "closed runs leave runs/");
            assert!(!dir.join("runs").join(run_id.as_str()).exists());
            for file in [SUMMARY_FILE, GRANT_FILE, journal::FILE_NAME] {
                std::fs::write(closed.join(file), b"garbage\n").unwrap();
            }
        }
        let before = closed_reads_under(&dir);
        let reopened = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
        assert_eq!(
            closed_reads_under(&dir),
            before,
            "the start read or listed a closed run"
        );
        assert!(reopened.quarantined().is_empty());
        assert!(reopened.open_runs().is_empty());
        for run_id in &ids {
            assert!(reopened.is_closed(run_id));
            assert_eq!(
                reopened.journal_path(run_id),
                Some(closed_run_dir(&dir, run_id).join(journal::FILE_NAME))
            );
        }
        let (grant_signed, grant) = nth_grant(0);
        assert!(matches!(
            reopened.begin(&grant_signed, grant, 2_000_000).await,
            Err(RunError::Closed(_))
        ));
        assert_eq!(all_closed(&reopened, 2).0, ids);
        assert!(closed_reads_under(&dir) > before);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Every state a crash during BeginRun can leave before its last sync: a directory with no
    /// grant, no journal, an empty journal, or a first record whose grant entry was lost. The
    /// next start removes each; a complete run and a run with more records stay.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_begin_run_interrupted_before_its_last_sync_is_removed_at_start() {
        let dir = state_dir("half-made");
        let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(8), 0).unwrap();
        let mut made = Vec::new();
        for n in 0..6 {
            let (signed, grant) = nth_grant(n);
            made.push(grant.run_id.clone());
            registry.begin(&signed, grant, 2_000_000).await.unwrap();
        }
        hold(&registry, &made[5], "backup:drive-scsi0.img").await;
        drop(registry);
        let run_dir = |n: usize| dir.join("runs").join(made[n].as_str());
        // 0: only the run directory.
        std::fs::remove_file(run_dir(0).join(GRANT_FILE)).unwrap();
        std::fs::remove_file(run_dir(0).join(journal::FILE_NAME)).unwrap();
        // 1: the grant, no journal.
        std::fs::remove_file(run_dir(1).join(journal::FILE_NAME)).unwrap();
        // 2: the grant and an empty journal (the first record never reached the disk).
        std::fs::write(run_dir(2).join(journal::FILE_NAME), b"").unwrap();
        // 3: the first record, its grant's entry lost.
        std::fs::remove_file(run_dir(3).join(GRANT_FILE)).unwrap();
        // 4: complete (the crash came after the last sync, before the reply): kept, open.
        // 5: its grant lost after an operation: not half-made, quarantined.
        std::fs::remove_file(run_dir(5).join(GRANT_FILE)).unwrap();
        let reopened = RunRegistry::open(&dir, &key().verifying_key(), limits(8), 0).unwrap();
        for (n, run_id) in made.iter().enumerate().take(4) {
            assert!(!run_dir(n).exists(), "half-made run {n} was kept");
            assert!(reopened.get(run_id).is_none());
            assert!(!reopened.is_closed(run_id));
            assert!(reopened.quarantine(run_id).is_none());
        }
        assert!(reopened.get(&made[4]).is_some());
        assert!(reopened.quarantine(&made[5]).is_some());
        assert!(synced_count(&dir.join("runs")) >= 1);
        // The controller's retry of the BeginRun that never answered starts the run afresh.
        let (signed, grant) = nth_grant(0);
        assert!(!reopened.begin(&signed, grant, 2_000_000).await.unwrap());
        assert_eq!(journal_ops(&dir, &made[0]), ["run.begin"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A failed BeginRun leaves nothing behind, so its retry is not refused by its own debris.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_failed_begin_run_leaves_no_directory_and_can_be_retried() {
        let dir = state_dir("begin-fails");
        let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
        let (signed, grant) = nth_grant(0);
        let run_dir = dir.join("runs").join(grant.run_id.as_str());
        // The journal cannot be created: a directory stands where it goes.
        std::fs::create_dir_all(run_dir.join(journal::FILE_NAME)).unwrap();
        assert!(
            registry
                .begin(&signed, grant.clone(), 2_000_000)
                .await
                .is_err()
        );
        assert!(!run_dir.exists());
        assert!(!registry.begin(&signed, grant, 2_000_000).await.unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn the_retention_sweep_goes_in_bounded_batches() {
        let dir = state_dir("sweep");
        let mut bounded = limits(1);
        bounded.closed_run_retention_days = 1;
        let registry = RunRegistry::open(&dir, &key().verifying_key(), bounded, 0).unwrap();
        let mut ids = Vec::new();
        for n in 0..5 {
            let (signed, grant) = nth_grant(n);
            let run_id = grant.run_id.clone();
            registry.begin(&signed, grant, 2_000_000).await.unwrap();
            // Closed a day apart.
            registry
                .end(&run_id, 2_000_500 + i64::from(n) * 86_400_000)
                .await
                .unwrap();
            ids.push(run_id);
        }
        let now = 2_000_501 + 3 * 86_400_000;
        // Closed on days 0, 1 and 2 are past a day's retention at day 3.
        let mut due = ids[..3].to_vec();
        due.sort();
        let (first, next) = registry.prune_batch(now, None, 2).unwrap();
        let next = next.expect("two of five examined: more follow");
        let (rest, last) = registry.prune_batch(now, Some(&next), 2).unwrap();
        let (tail, end) = registry.prune_batch(now, last.as_ref(), 2).unwrap();
        assert!(end.is_none());
        let mut pruned: Vec<RunId> = [first, rest, tail].concat();
        pruned.sort();
        assert_eq!(pruned, due);
        for run_id in &ids {
            assert_eq!(closed_run_dir(&dir, run_id).exists(), !due.contains(run_id));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn state_dir(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("certistack-runs-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn key() -> SigningKey {
        SigningKey::from_bytes(&[1; 32])
    }

    /// The `n`th of a set of grants that share nothing on the node.
    fn nth_grant(n: u32) -> (pb::SignedRunGrant, Grant) {
        let mut wire = full_wire_grant();
        if n > 0 {
            wire.run_id = format!("11111111-2222-4333-8444-{n:012}");
            wire.vnet = format!("csbox{}", n + 1);
            wire.sandbox_vms[0].vmid = 9100 + n * 10;
            wire.snapshot = format!("vm/{}/2026-11-01T02:00:00Z", 100 + n);
        }
        let signed = sign(&key(), &wire);
        let grant = certistack_core::grant::verify(&signed, &key().verifying_key()).unwrap();
        (signed, grant)
    }

    /// A registry in a fresh state directory, holding the first grant's run open.
    async fn registry_with_open_run(tag: &str) -> (PathBuf, RunRegistry, RunId) {
        let dir = state_dir(tag);
        let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
        let (signed, grant) = nth_grant(0);
        let run_id = grant.run_id.clone();
        registry.begin(&signed, grant, 2_000_000).await.unwrap();
        (dir, registry, run_id)
    }

    fn limits(max_open: usize) -> RegistryLimits {
        RegistryLimits {
            max_open,
            ..RegistryLimits::default()
        }
    }

    /// The operations in the journal of `run_id`, open or closed.
    fn journal_ops(dir: &Path, run_id: &RunId) -> Vec<String> {
        let open = dir.join("runs").join(run_id.as_str());
        let run_dir = if open.exists() {
            open
        } else {
            closed_run_dir(dir, run_id)
        };
        let path = run_dir.join(journal::FILE_NAME);
        journal::read(&path, run_id.as_str())
            .unwrap()
            .records
            .into_iter()
            .map(|r| r.entry.op)
            .collect()
    }

    async fn hold(registry: &RunRegistry, run_id: &RunId, resource: &str) {
        let run = registry.get(run_id).unwrap();
        let mut guard = run.lock().await;
        guard
            .append(
                1,
                "backup.map",
                resource,
                Phase::Intent,
                serde_json::Value::Null,
            )
            .await
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn closed_runs_stay_closed_across_reopen() {
        let dir = state_dir("closed");
        let (signed, grant) = nth_grant(0);
        let run_id = grant.run_id.clone();

        let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
        assert!(
            !registry
                .begin(&signed, grant.clone(), 2_000_000)
                .await
                .unwrap()
        );
        assert!(
            registry
                .begin(&signed, grant.clone(), 2_000_000)
                .await
                .unwrap(),
            "same grant resumes"
        );
        registry.end(&run_id, 2_000_500).await.unwrap();
        assert!(matches!(
            registry.begin(&signed, grant.clone(), 2_000_000).await,
            Err(RunError::Closed(_))
        ));
        assert!(registry.get(&run_id).is_none(), "a closed run is not held");

        let reopened = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
        assert!(reopened.is_closed(&run_id));
        assert!(matches!(
            reopened.begin(&signed, grant.clone(), 2_000_000).await,
            Err(RunError::Closed(_))
        ));
        assert!(matches!(
            reopened.end(&run_id, 1).await,
            Err(RunError::Closed(_))
        ));
        assert_eq!(journal_ops(&dir, &run_id), ["run.begin", "run.end"]);
        let (closed, _) = reopened.closed_page(None, 10).unwrap();
        assert_eq!(closed.len(), 1);
        assert_eq!(
            (
                closed[0].1.records,
                closed[0].1.closed_by.as_str(),
                closed[0].1.deadline_unix
            ),
            (2, "run.end", 4_600)
        );
        // Even with a rotated run-authority key, the closed marker still refuses the run.
        let rotated = RunRegistry::open(
            &dir,
            &SigningKey::from_bytes(&[9; 32]).verifying_key(),
            limits(1),
            0,
        )
        .unwrap();
        assert!(rotated.is_closed(&run_id));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_run_with_a_corrupt_journal_is_quarantined() {
        let dir = state_dir("corrupt");
        let (signed, grant) = nth_grant(0);
        let run_id = grant.run_id.clone();
        let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(2), 0).unwrap();
        registry
            .begin(&signed, grant.clone(), 2_000_000)
            .await
            .unwrap();
        hold(&registry, &run_id, "backup:a.img").await;
        drop(registry);
        // Alter the first record: the chain breaks before the last record.
        let path = dir
            .join("runs")
            .join(run_id.as_str())
            .join(journal::FILE_NAME);
        let text =
            std::fs::read_to_string(&path)
                .unwrap()
                .replacen("grant_sha256", "grant_sha257", 1);
        std::fs::write(&path, text).unwrap();

        let reopened = RunRegistry::open(&dir, &key().verifying_key(), limits(2), 0).unwrap();
        assert!(reopened.get(&run_id).is_none());
        let quarantined = reopened.quarantined();
        assert_eq!(quarantined.len(), 1);
        assert!(
            quarantined[0].1.contains("record 1 is invalid"),
            "{quarantined:?}"
        );
        assert!(matches!(
            reopened.begin(&signed, grant, 2_000_000).await,
            Err(RunError::Quarantined(..))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn open_runs_are_bounded() {
        let dir = state_dir("max");
        let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
        let (first, first_grant) = nth_grant(0);
        registry
            .begin(&first, first_grant, 2_000_000)
            .await
            .unwrap();
        let (second, grant) = nth_grant(1);
        assert!(matches!(
            registry.begin(&second, grant.clone(), 2_000_000).await,
            Err(RunError::TooMany { open: 1, max: 1 })
        ));
        // Once the first run's deadline passed it no longer counts.
        assert!(registry.begin(&second, grant, 5_000_000).await.is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_run_past_its_deadline_that_holds_resources_still_counts() {
        let dir = state_dir("expired-holding");
        let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
        let (first, first_grant) = nth_grant(0);
        let first_id = first_grant.run_id.clone();
        registry
            .begin(&first, first_grant, 2_000_000)
            .await
            .unwrap();
        hold(&registry, &first_id, "backup:drive-scsi0.img").await;
        let (second, grant) = nth_grant(1);
        // 5_000 s is past the first run's deadline (4_600 s), but its mapping is still open.
        assert!(matches!(
            registry.begin(&second, grant.clone(), 5_000_000).await,
            Err(RunError::TooMany { open: 1, max: 1 })
        ));
        {
            let run = registry.get(&first_id).unwrap();
            let mut guard = run.lock().await;
            guard
                .append(
                    2,
                    "backup.unmap",
                    "backup:drive-scsi0.img",
                    Phase::Undone,
                    serde_json::Value::Null,
                )
                .await
                .unwrap();
        }
        assert!(registry.begin(&second, grant, 5_000_000).await.is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn open_runs_together_are_bounded_in_sandbox_cores_and_memory() {
        let dir = state_dir("sandbox");
        let mut bounded = limits(4);
        // Each grant asks for one VM of 2 vCPUs and 2048 MiB.
        bounded.max_sandbox_cores = 3;
        let registry = RunRegistry::open(&dir, &key().verifying_key(), bounded, 0).unwrap();
        let (first, grant) = nth_grant(0);
        registry.begin(&first, grant, 2_000_000).await.unwrap();
        let (second, grant) = nth_grant(1);
        match registry.begin(&second, grant.clone(), 2_000_000).await {
            Err(RunError::SandboxExhausted {
                asked_cores: 2,
                used_cores: 2,
                max_cores: 3,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        drop(registry);
        bounded.max_sandbox_cores = 4;
        bounded.max_sandbox_memory_mib = 3000;
        let registry = RunRegistry::open(&dir, &key().verifying_key(), bounded, 0).unwrap();
        let refusal = registry
            .begin(&second, grant.clone(), 2_000_000)
            .await
            .unwrap_err();
        assert!(
            refusal.to_string().contains("2048 MiB") && refusal.to_string().contains("3000 MiB"),
            "{refusal}"
        );
        bounded.max_sandbox_memory_mib = 4096;
        let registry = RunRegistry::open(&dir, &key().verifying_key(), bounded, 0).unwrap();
        assert!(registry.begin(&second, grant, 2_000_000).await.is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// EndRun waiting for the run lock while the expiry reaper's cleanup holds it, and the
    /// reaper closing the run right after: one closing record, whoever wins.
    #[tokio::test(flavor = "multi_thread")]
    async fn concurrent_end_and_expiry_write_one_closing_record() {
        let dir = state_dir("race");
        let registry =
            Arc::new(RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap());
        let (signed, grant) = nth_grant(0);
        let run_id = grant.run_id.clone();
        registry.begin(&signed, grant, 2_000_000).await.unwrap();
        let run = registry.get(&run_id).unwrap();
        let cleanup = run.lock().await;
        let end = tokio::spawn({
            let (registry, run_id) = (registry.clone(), run_id.clone());
            async move { registry.end(&run_id, 2_000_100).await }
        });
        let expire = tokio::spawn({
            let (registry, run_id) = (registry.clone(), run_id.clone());
            async move { registry.expire(&run_id, 2_000_200).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        drop(cleanup);
        let results = [end.await.unwrap(), expire.await.unwrap()];
        assert_eq!(
            results.iter().filter(|r| r.is_ok()).count(),
            1,
            "{results:?}"
        );
        assert!(
            results
                .iter()
                .any(|r| matches!(r, Err(RunError::Closed(_)))),
            "{results:?}"
        );
        let closing: Vec<String> = journal_ops(&dir, &run_id)
            .into_iter()
            .filter(|op| journal::CLOSING_OPS.contains(&op.as_str()))
            .collect();
        assert_eq!(closing.len(), 1, "{closing:?}");
        // Nothing is recorded after the closing record, not even by an operation that held a
        // handle from before.
        let mut late = run.lock().await;
        assert!(matches!(
            late.append(
                3,
                "run.cleanup",
                "run:x",
                Phase::Done,
                serde_json::Value::Null
            )
            .await,
            Err(JournalError::Closed(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Proves the directory fsyncs are issued, not that the disk honours them: that would
    /// need a power cut.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_new_run_directory_entry_is_synced() {
        let dir = state_dir("sync");
        let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
        let (signed, grant) = nth_grant(0);
        let run_id = grant.run_id.clone();
        registry.begin(&signed, grant, 2_000_000).await.unwrap();
        let synced = SYNCED.lock().unwrap().clone();
        assert!(
            synced.contains(&dir.join("runs")),
            "runs/ was not fsync'd after the run's directory was created: {synced:?}"
        );
        // Once: after the grant file and the journal with its first record are in it.
        assert_eq!(
            synced_count(&dir.join("runs").join(run_id.as_str())),
            1,
            "{synced:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn open_fds_under(dir: &Path) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
            .filter(|target| target.starts_with(dir))
            .count()
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn closed_runs_hold_no_descriptor_and_are_not_reopened() {
        let (dir, registry, run_id) = registry_with_open_run("fds").await;
        assert_eq!(open_fds_under(&dir), 1, "the open run's journal");
        registry.end(&run_id, 2_000_500).await.unwrap();
        assert_eq!(
            open_fds_under(&dir),
            0,
            "the closed run's journal is closed"
        );
        drop(registry);
        // An unreadable journal would quarantine an open run: a closed one is not even read.
        let journal = closed_run_dir(&dir, &run_id).join(journal::FILE_NAME);
        std::fs::write(&journal, b"not a journal\nat all\n").unwrap();
        let reopened = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
        assert!(reopened.is_closed(&run_id));
        assert!(reopened.quarantined().is_empty());
        assert_eq!(open_fds_under(&dir), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// EndRun's closing record reached the disk but the marker did not (a full disk, no
    /// descriptor left): the run is closed in memory, and a restart agrees and writes it.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_closing_record_without_its_marker_closes_the_run_at_restart() {
        let (dir, registry, run_id) = registry_with_open_run("marker").await;
        let run_dir = dir.join("runs").join(run_id.as_str());
        // The marker cannot be written: a directory stands where its temporary file goes.
        std::fs::create_dir(run_dir.join("summary.tmp")).unwrap();
        assert!(registry.end(&run_id, 2_000_500).await.is_ok());
        assert!(registry.is_closed(&run_id));
        assert!(!run_dir.join(CLOSED_FILE).exists());
        drop(registry);
        std::fs::remove_dir(run_dir.join("summary.tmp")).unwrap();
        let reopened = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
        assert!(reopened.is_closed(&run_id));
        assert!(reopened.get(&run_id).is_none());
        assert!(!run_dir.exists(), "the restart moved the run out of runs/");
        assert_eq!(
            std::fs::read_to_string(closed_run_dir(&dir, &run_id).join(CLOSED_FILE)).unwrap(),
            "2000500"
        );
        let journal = closed_run_dir(&dir, &run_id).join(journal::FILE_NAME);
        let ops: Vec<String> = journal::read(&journal, run_id.as_str())
            .unwrap()
            .records
            .into_iter()
            .map(|r| r.entry.op)
            .collect();
        assert_eq!(ops, ["run.begin", "run.end"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn closed_runs_are_pruned_after_their_retention_and_open_ones_never() {
        let dir = state_dir("prune");
        let mut bounded = limits(4);
        bounded.closed_run_retention_days = 1;
        let registry = RunRegistry::open(&dir, &key().verifying_key(), bounded, 0).unwrap();
        let (signed, grant) = nth_grant(0);
        let closed_id = grant.run_id.clone();
        registry.begin(&signed, grant, 2_000_000).await.unwrap();
        registry.end(&closed_id, 2_000_500).await.unwrap();
        let (signed, grant) = nth_grant(1);
        let open_id = grant.run_id.clone();
        registry.begin(&signed, grant, 2_000_000).await.unwrap();
        hold(&registry, &open_id, "backup:drive-scsi0.img").await;
        let day_ms = 86_400_000;
        assert!(registry.prune(2_000_500 + day_ms - 1).unwrap().is_empty());
        assert_eq!(
            registry.prune(2_000_501 + day_ms).unwrap(),
            std::slice::from_ref(&closed_id)
        );
        assert!(!closed_run_dir(&dir, &closed_id).exists());
        assert!(!registry.is_closed(&closed_id));
        assert!(dir.join("runs").join(open_id.as_str()).exists());
        assert!(registry.get(&open_id).is_some());
        let shard = closed_run_dir(&dir, &closed_id)
            .parent()
            .unwrap()
            .to_owned();
        assert!(
            synced_count(&shard) >= 2,
            "the shard is synced after the run moved in and after it was pruned"
        );
        // A start prunes nothing (the daemon's periodic pass does), and never an open run.
        let (signed, grant) = nth_grant(2);
        let later_id = grant.run_id.clone();
        registry.begin(&signed, grant, 2_000_000).await.unwrap();
        registry.end(&later_id, 2_000_500).await.unwrap();
        drop(registry);
        let far = 10 * day_ms;
        let reopened = RunRegistry::open(&dir, &key().verifying_key(), bounded, far).unwrap();
        assert!(reopened.is_closed(&later_id));
        assert_eq!(reopened.prune(far).unwrap(), [later_id]);
        assert!(
            reopened.get(&open_id).is_some(),
            "an open run is never pruned"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_closed_run_whose_marker_lost_its_time_keeps_its_retention() {
        let dir = state_dir("prune-lost-marker");
        let mut bounded = limits(4);
        bounded.closed_run_retention_days = 1;
        let registry = RunRegistry::open(&dir, &key().verifying_key(), bounded, 0).unwrap();
        let (signed, grant) = nth_grant(0);
        let run_id = grant.run_id.clone();
        registry.begin(&signed, grant, 2_000_000).await.unwrap();
        registry.end(&run_id, 2_000_500).await.unwrap();
        // The marker and the summary are written without a sync: a crash can leave the marker
        // empty and the summary gone (the journal's closing record is what is durable).
        std::fs::write(closed_run_dir(&dir, &run_id).join(CLOSED_FILE), b"").unwrap();
        std::fs::remove_file(closed_run_dir(&dir, &run_id).join(SUMMARY_FILE)).unwrap();
        let day_ms = 86_400_000;
        // Read as closed at time 0, the run would be due now; its journal says it closed later.
        assert!(registry.prune(2_000_501 + day_ms).unwrap().is_empty());
        assert!(closed_run_dir(&dir, &run_id).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_second_holder_of_the_state_lock_learns_the_first_one_s_pid() {
        let dir = state_dir("lock");
        let held = StateLock::acquire(&dir).unwrap();
        let pid = std::process::id().to_string();
        assert_eq!(
            std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap().trim(),
            pid
        );
        match StateLock::acquire(&dir) {
            Err(RunError::Locked { holder, .. }) => assert_eq!(holder, pid),
            other => panic!("{other:?}"),
        }
        match StateLock::probe(&dir) {
            Err(error @ RunError::Locked { .. }) => {
                assert!(error.to_string().contains(&pid), "{error}")
            }
            other => panic!("{other:?}"),
        }
        drop(held);
        assert!(StateLock::probe(&dir).unwrap().is_some());
        assert!(StateLock::acquire(&dir).is_ok());
        assert!(StateLock::probe(&state_dir("lock-none")).unwrap().is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_repeated_observation_is_journaled_once() {
        let (dir, registry, run_id) = registry_with_open_run("repeat").await;
        let run = registry.get(&run_id).unwrap();
        let mut guard = run.lock().await;
        let residue = |what: &str| serde_json::json!({ "residue": [what] });
        let mut written = Vec::new();
        for (time, what) in [(1, "table"), (2, "table"), (3, "table"), (4, "address")] {
            written.push(
                guard
                    .append_if_changed(time, "run.cleanup", "run:x", Phase::Failed, residue(what))
                    .await
                    .unwrap()
                    .is_some(),
            );
        }
        assert_eq!(written, [true, false, false, true]);
        assert_eq!(guard.records().len(), 3);
        drop(guard);
        assert_eq!(
            journal_ops(&dir, &run_id),
            ["run.begin", "run.cleanup", "run.cleanup"]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An append whose caller went away (the RPC was cancelled) still lands, off the async
    /// worker, and the next append continues the same chain.
    #[tokio::test(flavor = "current_thread")]
    async fn a_dropped_append_completes_and_the_chain_stays_whole() {
        let (dir, registry, run_id) = registry_with_open_run("dropped").await;
        let run = registry.get(&run_id).unwrap();
        for n in 0..20 {
            {
                let mut guard = run.lock().await;
                let append = guard.append(
                    n,
                    "backup.map",
                    "backup:a.img",
                    Phase::Intent,
                    serde_json::Value::Null,
                );
                // Polled once, then dropped, as when the caller of the RPC goes away.
                let _ = tokio::time::timeout(std::time::Duration::ZERO, append).await;
            }
            let mut guard = run.lock().await;
            guard
                .append(
                    n,
                    "backup.map",
                    "backup:a.img",
                    Phase::Done,
                    serde_json::Value::Null,
                )
                .await
                .unwrap();
        }
        let in_memory: Vec<Record> = run.lock().await.records().to_vec();
        let path = dir
            .join("runs")
            .join(run_id.as_str())
            .join(journal::FILE_NAME);
        let on_disk = journal::read(&path, run_id.as_str()).unwrap();
        assert!(on_disk.torn.is_none());
        assert_eq!(on_disk.records, in_memory);
        let phases: Vec<Phase> = on_disk
            .records
            .iter()
            .skip(1)
            .map(|r| r.entry.phase)
            .collect();
        assert_eq!(
            phases,
            [Phase::Intent, Phase::Done].repeat(20),
            "order of the calls"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The next operation waits for a write whose caller went away before it decides from
    /// the records, so it sees the step that write records.
    #[tokio::test(flavor = "current_thread")]
    #[allow(clippy::await_holding_lock)] // The held lock is the slow disk this test needs.
    async fn the_next_operation_waits_for_an_abandoned_write() {
        let (dir, registry, run_id) = registry_with_open_run("abandoned").await;
        let run = registry.get(&run_id).unwrap();
        // A slow disk: the write cannot finish while this is held.
        let slow_disk = lock_journal(&run.journal);
        {
            let mut guard = run.lock().await;
            let append = guard.append(
                1,
                "backup.map",
                "backup:a.img",
                Phase::Intent,
                serde_json::Value::Null,
            );
            let abandoned =
                tokio::time::timeout(std::time::Duration::from_millis(20), append).await;
            assert!(
                abandoned.is_err(),
                "the write finished with the disk blocked"
            );
        }
        let next = tokio::time::timeout(std::time::Duration::from_millis(100), run.lock()).await;
        assert!(
            next.is_err(),
            "the next operation started before the abandoned write ended"
        );
        drop(slow_disk);
        let guard = run.lock().await;
        let last = guard
            .records()
            .last()
            .map(|r| (r.entry.op.clone(), r.entry.phase));
        assert_eq!(last, Some(("backup.map".to_owned(), Phase::Intent)));
        drop(guard);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
