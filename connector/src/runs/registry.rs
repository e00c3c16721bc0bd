//! The registry of runs: loading the open runs at start (and removing what a BeginRun that
//! never answered left), BeginRun and EndRun, pages of closed runs in run-id order, and the
//! pruning of closed runs past their retention.

use super::closed::{
    CLOSED_ROOT, ClosedPage, ClosedRun, PRUNE_BATCH, SHARD_CHARS, closed_summary, closed_time,
    move_closed, read_closed, shard_of, write_closed,
};
use super::closed_index::{ClosedIndex, DeadlinePage};
use super::handle::RunHandle;
use super::overlap::overlap;
use super::{GRANT_FILE, RegistryLimits, RunError, load_grant, max_line, read_names, sync_dir};
use certistack_core::files::{self, FileError};
use certistack_core::grant::Grant;
use certistack_core::journal::{self, Journal, JournalLimits, Phase};
use certistack_core::journal::{Op, Resource};
use certistack_core::validate::{RunId, Validated};
use certistack_proto::v1 as pb;
use ed25519_dalek::VerifyingKey;
use prost::Message;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

#[derive(Debug, Default)]
pub(super) struct Inner {
    open: BTreeMap<RunId, Arc<RunHandle>>,
    /// Closed runs whose directory could not be moved out of `runs/` (or whose marker could not
    /// be written): closed all the same, and moved by the next start. Only failures land here.
    pub(super) closing: BTreeMap<RunId, ClosedRun>,
    /// Open runs that could not be loaded (grant or journal unusable), with the reason: listed,
    /// never resumed, left for an operator to inspect.
    quarantined: BTreeMap<RunId, String>,
    /// The grants of quarantined runs whose grant still verifies: what they may have left on
    /// the node, which new runs must not overlap.
    quarantined_grants: Vec<Grant>,
    /// The closed runs' ids and deadlines, once ListRuns listed them.
    pub(super) closed_index: ClosedIndex,
}

impl Inner {
    /// One more than a page of closed runs after `after` from the index, with the runs whose move
    /// failed among them (not yet sorted or cut); `None` while the index is not installed.
    fn indexed_page(
        &self,
        after: Option<&RunId>,
        page_size: usize,
    ) -> Option<Vec<(RunId, Option<i64>)>> {
        if !self.closed_index.is_installed() {
            return None;
        }
        let mut page = self.closed_index.after(after, page_size.saturating_add(1));
        page.extend(
            self.closing
                .iter()
                .filter(|(id, _)| after.is_none_or(|after| *id > after))
                .map(|(id, summary)| (id.clone(), Some(summary.deadline_unix))),
        );
        Some(page)
    }
}

#[derive(Debug)]
pub struct RunRegistry {
    /// `<state>/runs`: open and quarantined runs.
    dir: PathBuf,
    /// `<state>/closed`: closed runs, in shards.
    pub(super) closed_dir: PathBuf,
    /// Verifies a closed run's stored grant when its summary must be rebuilt.
    pub(super) authority: VerifyingKey,
    pub(super) limits: RegistryLimits,
    inner: Mutex<Inner>,
    begin_lock: tokio::sync::Mutex<()>,
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
        let mut inner = Inner {
            closed_index: ClosedIndex::new(limits.max_indexed_closed_runs),
            ..Inner::default()
        };
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
                && last.entry.op.closes_run()
            {
                let summary = ClosedRun {
                    closed_unix_ms: last.entry.time_ms,
                    deadline_unix: grant.deadline_unix,
                    closed_by: last.entry.op.as_str().to_owned(),
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

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
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

    pub(super) fn closed_path(&self, run_id: &RunId) -> PathBuf {
        self.closed_dir.join(shard_of(run_id)).join(run_id.as_str())
    }

    /// The open runs.
    pub fn open_runs(&self) -> Vec<Arc<RunHandle>> {
        self.lock().open.values().cloned().collect()
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
            .then(|| self.closed_journal_path(run_id))
    }

    /// Where the journal of `run_id` is once the run is closed (whether or not it is).
    pub fn closed_journal_path(&self, run_id: &RunId) -> PathBuf {
        self.closed_path(run_id).join(journal::FILE_NAME)
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
        // says it still holds something on the node. Reading that takes the journal locks:
        // here when none is held, else on the blocking pool, where an append's sync may be
        // waited for.
        let inline = others
            .iter()
            .map(|run| counts(run, now_unix, false).map(|counted| counted.then(|| run.clone())))
            .collect::<Option<Vec<_>>>();
        let counted: Vec<Arc<RunHandle>> = match inline {
            Some(counted) => counted.into_iter().flatten().collect(),
            None => tokio::task::spawn_blocking(move || {
                others
                    .into_iter()
                    .filter(|run| counts(run, now_unix, true) == Some(true))
                    .collect()
            })
            .await
            .map_err(|error| RunError::Background(error.to_string()))?,
        };
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
        self.close(run_id, now_ms, &Op::RunEnd).await
    }

    /// Closes a run the daemon cleaned up after its deadline passed.
    pub async fn expire(&self, run_id: &RunId, now_ms: i64) -> Result<i64, RunError> {
        self.close(run_id, now_ms, &Op::RunExpired).await
    }

    async fn close(&self, run_id: &RunId, now_ms: i64, op: &Op) -> Result<i64, RunError> {
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
                &Resource::Run(run_id.clone()),
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
            closed_by: op.as_str().to_owned(),
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
        // Listed as closed from here, wherever its directory is (a failed move leaves it under
        // `closing` too).
        inner
            .closed_index
            .closed(run_id.clone(), handle.grant.deadline_unix);
        if let Err(error) = moved {
            tracing::error!(%run_id, %error, "the run is closed (its journal ends with {op}) but it could not be moved out of runs/; the next start moves it");
            inner.closing.insert(run_id.clone(), summary);
        }
        Ok(now_ms)
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
        super::tests::closed_read(&self.closed_dir);
        Ok(ids)
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
            self.lock().closed_index.removed(&run_id);
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

impl RunRegistry {
    /// A page of closed runs answered from memory, or `None` when the index is not installed
    /// or a run on the page has no known deadline yet (then [`Self::closed_deadlines`] reads
    /// it). Touches no file.
    pub fn closed_deadlines_in_memory(
        &self,
        after: Option<&RunId>,
        page_size: usize,
    ) -> Option<DeadlinePage> {
        let page = self.lock().indexed_page(after, page_size)?;
        let (page, next) = cut(page, page_size);
        let page = page
            .into_iter()
            .map(|(id, deadline)| deadline.map(|deadline| (id, deadline)))
            .collect::<Option<Vec<_>>>()?;
        Some((page, next))
    }

    /// A page of closed runs with their deadlines: from the index (installed by the first call,
    /// which reads every shard's names), reading the summaries of the page's runs not yet
    /// known; from disk page by page while the index cannot be installed (another listing under
    /// way, a node over the bound, a shard that cannot be read). Blocks on the file system.
    pub fn closed_deadlines(
        &self,
        after: Option<&RunId>,
        page_size: usize,
    ) -> Result<DeadlinePage, RunError> {
        self.install_closed_index();
        let indexed = self.lock().indexed_page(after, page_size);
        let Some(indexed) = indexed else {
            let (page, next) = self.closed_page(after, page_size)?;
            let page = page
                .into_iter()
                .map(|(id, summary)| (id, summary.deadline_unix))
                .collect();
            return Ok((page, next));
        };
        let (page, next) = cut(indexed, page_size);
        let mut listed = Vec::with_capacity(page.len());
        for (run_id, deadline) in page {
            if let Some(deadline) = deadline {
                listed.push((run_id, deadline));
                continue;
            }
            let run_dir = self.closed_path(&run_id);
            if std::fs::symlink_metadata(&run_dir).is_err() {
                // Removed by hand since it was indexed.
                self.lock().closed_index.forget(&run_id);
                continue;
            }
            let closed_unix_ms = closed_time(&run_dir).unwrap_or(0);
            let summary = closed_summary(
                &run_dir,
                &run_id,
                closed_unix_ms,
                &self.authority,
                &self.limits,
            );
            // Kept even when it is 0 (neither summary nor grant readable): the rebuilt summary
            // is stored with it, so reading again would find the same.
            self.lock()
                .closed_index
                .learned(&run_id, summary.deadline_unix);
            listed.push((run_id, summary.deadline_unix));
        }
        Ok((listed, next))
    }

    /// Lists every shard's names into the index, unless it is installed already, another
    /// listing is under way, or `closed/` holds more runs than the index keeps (then the
    /// retention sweep must remove an eighth of them before the next try).
    fn install_closed_index(&self) {
        let Some(generation) = self.lock().closed_index.begin_listing() else {
            return;
        };
        // Ends the listing as failed if the walk below unwinds, so the flag is never left set.
        struct Unfinished<'a>(Option<(&'a RunRegistry, u64)>);
        impl Drop for Unfinished<'_> {
            fn drop(&mut self) {
                if let Some((registry, generation)) = self.0.take() {
                    registry.lock().closed_index.end_listing(generation, None);
                }
            }
        }
        let mut unfinished = Unfinished(Some((self, generation)));
        let bound = self.limits.max_indexed_closed_runs;
        #[cfg(test)]
        super::tests::closed_read(&self.closed_dir);
        let listed = (|| -> Result<Option<Vec<RunId>>, RunError> {
            let mut ids = Vec::new();
            for shard in read_names(&self.closed_dir)? {
                if shard.len() != SHARD_CHARS {
                    continue;
                }
                for name in read_names(&self.closed_dir.join(&shard))? {
                    if let Ok(run_id) = RunId::validate(&name) {
                        if ids.len() >= bound {
                            return Ok(None);
                        }
                        ids.push(run_id);
                    }
                }
            }
            Ok(Some(ids))
        })();
        unfinished.0 = None;
        let mut inner = self.lock();
        match listed {
            Ok(Some(ids)) => inner.closed_index.end_listing(generation, Some(ids)),
            Ok(None) => {
                inner.closed_index.over_bound();
                tracing::info!(
                    max = bound,
                    "more closed runs than ListRuns keeps in memory; pages are read from disk until the retention sweep removed an eighth of that (lower limits.closed_run_retention_days to keep fewer)"
                );
            }
            Err(error) => {
                inner.closed_index.end_listing(generation, None);
                tracing::warn!(%error, "cannot list the closed runs into memory; pages are read from disk until a run closes or is pruned");
            }
        }
    }
}

/// The first `page_size` of `page` (sorted and deduplicated here), and the cursor of the next
/// page when more follow.
fn cut<T>(mut page: Vec<(RunId, T)>, page_size: usize) -> (Vec<(RunId, T)>, Option<RunId>) {
    page.sort_by(|a, b| a.0.cmp(&b.0));
    page.dedup_by(|a, b| a.0 == b.0);
    let more = page.len() > page_size;
    page.truncate(page_size);
    let next = if more {
        page.last().map(|(id, _)| id.clone())
    } else {
        None
    };
    (page, next)
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
            &Op::RunBegin,
            &Resource::Run(run_id.clone()),
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
            [only] => !grant_present && only.entry.op == Op::RunBegin,
            _ => false,
        },
        Err(_) => false,
    }
}

/// Whether `run` counts against the node's bounds at `now_unix`: before its deadline, and after
/// it while its journal says it holds something. `None` when finding out would wait for an
/// append and `wait` is false.
fn counts(run: &RunHandle, now_unix: i64, wait: bool) -> Option<bool> {
    if run.grant.deadline_unix > now_unix {
        return Some(true);
    }
    let open = if wait {
        run.open_resources()
    } else {
        run.try_open_resources()?
    };
    Some(!open.is_empty())
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
