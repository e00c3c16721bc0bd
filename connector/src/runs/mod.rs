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
//! are refused, its journal read, a page of closed runs listed in run-id order. Closed runs hold
//! no file open, and nothing in memory until ListRuns lists them: the first listing reads the
//! names in the 256 shard directories once, and from then on their ids and deadlines are kept
//! in memory (`closed_index`). At start the registry reopens the journals of open runs (setting a torn tail aside, see
//! [`certistack_core::journal`]) so recovery knows what each run left on the node. Closed runs are pruned
//! after `limits.closed_run_retention_days` once their grant expired, in bounded batches by the
//! daemon's periodic pass, never on the start path. The registry never holds a secret.
//!
//! Journal appends run on the blocking pool, never on an async worker; the run's operation lock
//! orders them, and a write whose caller went away still completes and is kept in memory.

mod closed;
mod closed_index;
mod handle;
mod overlap;
mod registry;
mod state_lock;

pub use closed::{
    ClosedPage, ClosedRun, DEFAULT_CLOSED_PAGE, MAX_CLOSED_PAGE, PRUNE_BATCH, closed_run_dir,
};
pub use closed_index::{DeadlinePage, MAX_INDEXED_CLOSED_RUNS};
pub use handle::{Records, RunGuard, RunHandle};
pub use overlap::overlap;
pub use registry::RunRegistry;

pub use state_lock::StateLock;

use crate::config::Limits;
use certistack_core::files::FileError;
use certistack_core::grant::{self, Grant};
use certistack_core::journal::{JournalError, JournalLimits};
use certistack_core::validate::RunId;
use certistack_proto::v1 as pb;
use ed25519_dalek::VerifyingKey;
use prost::Message;
use std::fs::File;
use std::path::{Path, PathBuf};

/// What the registry bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegistryLimits {
    pub max_open: usize,
    pub journal: JournalLimits,
    pub max_sandbox_cores: u64,
    pub max_sandbox_memory_mib: u64,
    pub closed_run_retention_days: u64,
    /// Closed runs whose ids and deadlines ListRuns keeps in memory.
    pub max_indexed_closed_runs: usize,
}

impl RegistryLimits {
    pub fn from_config(limits: &Limits) -> Self {
        Self {
            max_open: limits.max_concurrent_runs,
            journal: JournalLimits::new(limits.max_journal_records, limits.max_journal_bytes),
            max_sandbox_cores: u64::from(limits.max_sandbox_cores),
            max_sandbox_memory_mib: limits.max_sandbox_memory_mib,
            closed_run_retention_days: limits.closed_run_retention_days,
            max_indexed_closed_runs: MAX_INDEXED_CLOSED_RUNS,
        }
    }
}

impl Default for RegistryLimits {
    fn default() -> Self {
        Self::from_config(&Limits::default())
    }
}

/// The longest journal line read back: one record can never be longer than the journal.
pub(super) fn max_line(limits: &JournalLimits) -> u64 {
    limits.max_bytes
}

const GRANT_FILE: &str = "grant.pb";
const CLOSED_FILE: &str = "closed";
const SUMMARY_FILE: &str = "summary.json";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    Open,
    Closed { at_unix_ms: i64 },
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

fn load_grant(run_dir: &Path, authority: &VerifyingKey) -> Result<Grant, String> {
    let bytes = std::fs::read(run_dir.join(GRANT_FILE)).map_err(|e| e.to_string())?;
    let signed = pb::SignedRunGrant::decode(bytes.as_slice()).map_err(|e| e.to_string())?;
    grant::verify(&signed, authority).map_err(|e| e.to_string())
}

#[cfg(test)]
pub(crate) mod tests;
