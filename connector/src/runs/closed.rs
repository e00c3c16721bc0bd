//! Closed runs on disk: where each is kept (one of 256 shard directories, by its id), its
//! summary and marker, and how a closing run is moved there, read back and dated.

use super::{CLOSED_FILE, SUMMARY_FILE, load_grant};
use super::{RegistryLimits, max_line};
use certistack_core::files::{self, FileError};
use certistack_core::journal;
use certistack_core::validate::RunId;
use ed25519_dalek::VerifyingKey;
use std::path::{Path, PathBuf};

/// Under the state directory: closed runs, sharded by the first characters of their id.
pub(super) const CLOSED_ROOT: &str = "closed";
/// Characters of a run id naming its shard: 256 directories of hex pairs.
pub(super) const SHARD_CHARS: usize = 2;
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
            closed_by: found
                .last_op
                .map(|op| op.as_str().to_owned())
                .unwrap_or_default(),
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
pub(super) fn closed_time(run_dir: &Path) -> Option<i64> {
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
