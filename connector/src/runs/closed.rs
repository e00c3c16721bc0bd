//! Closed runs on disk: moved into one of 256 shard directories by their id, with a summary and
//! a marker, listed a page at a time in run-id order, pruned after their retention in batches.

use super::registry::{RegistryLimits, RunRegistry, max_line};
use super::{CLOSED_FILE, RunError, SUMMARY_FILE, load_grant, read_names, sync_dir};
use crate::files::{self, FileError};
use crate::journal;
use crate::validate::{RunId, Validated};
use ed25519_dalek::VerifyingKey;
use std::path::{Path, PathBuf};

/// Under the state directory: closed runs, sharded by the first characters of their id.
pub(super) const CLOSED_ROOT: &str = "closed";
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

pub(super) fn shard_of(run_id: &RunId) -> &str {
    // A run id is a validated UUID, longer than its shard prefix.
    run_id.as_str().get(..SHARD_CHARS).unwrap_or_default()
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

impl RunRegistry {
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

/// Moves closed run `run_dir` into its shard under `closed_dir`, creating the shard if needed.
/// Returns the shard; the caller syncs it, `closed_dir` when a shard was made, and `runs/`.
pub(super) fn move_closed(
    run_dir: &Path,
    closed_dir: &Path,
    run_id: &RunId,
) -> Result<PathBuf, FileError> {
    let shard = closed_dir.join(shard_of(run_id));
    files::create_private_dir(&shard)?;
    let target = shard.join(run_id.as_str());
    std::fs::rename(run_dir, &target).map_err(|error| FileError::Write {
        path: target.clone(),
        error,
    })?;
    Ok(shard)
}

/// The summary of a closed run, rebuilt from its journal (once) when a crash or an older
/// connector left none.
pub(super) fn closed_summary(
    run_dir: &Path,
    run_id: &RunId,
    closed_unix_ms: i64,
    authority: &VerifyingKey,
    limits: &RegistryLimits,
) -> ClosedRun {
    #[cfg(test)]
    super::tests::closed_read(run_dir);
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
pub(super) fn write_closed(run_dir: &Path, summary: &ClosedRun) -> Result<(), FileError> {
    let text = serde_json::to_vec(summary).unwrap_or_default();
    files::replace_without_sync(&run_dir.join(SUMMARY_FILE), &text, 0o600)?;
    files::replace_without_sync(
        &run_dir.join(CLOSED_FILE),
        summary.closed_unix_ms.to_string().as_bytes(),
        0o600,
    )
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

pub(super) fn read_closed(run_dir: &Path) -> Result<Option<i64>, FileError> {
    let path = run_dir.join(CLOSED_FILE);
    match std::fs::read_to_string(&path) {
        // An unreadable timestamp still means closed: refusing is the safe reading.
        Ok(text) => Ok(Some(text.trim().parse().unwrap_or(0))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(FileError::Read { path, error }),
    }
}
