//! The durable registry of runs on this node, and each run's journal.
//!
//! `BeginRun` stores the signed grant under `<state>/runs/<run id>/grant.pb` and creates the
//! run's journal there; `EndRun` journals the end and writes `<state>/runs/<run id>/closed`.
//! Everything is written atomically or appended and fsync'd before the reply, so a closed run
//! stays closed across a crash or restart: its certificate and grant are refused even before
//! they expire. At start the registry reopens every run's journal (setting a torn tail aside,
//! see [`crate::journal`]) so recovery knows what each run left on the node. The registry
//! never holds a secret.

use crate::files::{self, FileError};
use crate::grant::{self, Grant};
use crate::journal::{self, Journal, JournalError, Phase, Record};
use crate::validate::{RunId, Validated};
use certistack_proto::v1 as pb;
use ed25519_dalek::VerifyingKey;
use prost::Message;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

const GRANT_FILE: &str = "grant.pb";
const CLOSED_FILE: &str = "closed";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    Open,
    Closed { at_unix_ms: i64 },
}

/// One run: its grant, its directory and its journal. Holding the journal lock serializes the
/// run's operations, so journal order is operation order; other runs are not affected.
#[derive(Debug)]
pub struct RunHandle {
    pub run_id: RunId,
    pub grant: Arc<Grant>,
    pub dir: PathBuf,
    journal: tokio::sync::Mutex<Journal>,
    journal_path: PathBuf,
    /// Set under the run lock when the run closes, so an operation that waited for the lock
    /// sees it before it acts.
    closed: std::sync::atomic::AtomicBool,
}

impl RunHandle {
    /// Locks the run for one operation.
    pub async fn lock(&self) -> RunGuard<'_> {
        RunGuard {
            journal: self.journal.lock().await,
        }
    }

    /// Reads the journal as it is on disk, without waiting for a running operation: appends are
    /// whole lines, so a concurrent reader sees at worst a torn tail, which it leaves out.
    pub async fn records(&self) -> Result<Vec<Record>, JournalError> {
        let path = self.journal_path.clone();
        let run_id = self.run_id.to_string();
        Ok(journal::read(&path, &run_id)?.records)
    }

    /// Whether the run was closed (by EndRun or by expiry).
    pub fn is_closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn new(run_id: RunId, grant: Grant, dir: PathBuf, journal: Journal, closed: bool) -> Self {
        let journal_path = journal.path().to_owned();
        Self {
            run_id,
            grant: Arc::new(grant),
            dir,
            journal: tokio::sync::Mutex::new(journal),
            journal_path,
            closed: std::sync::atomic::AtomicBool::new(closed),
        }
    }
}

/// A locked run: appends go to its journal, fsync'd before they return.
#[derive(Debug)]
pub struct RunGuard<'a> {
    journal: tokio::sync::MutexGuard<'a, Journal>,
}

impl RunGuard<'_> {
    pub fn append(
        &mut self,
        time_ms: i64,
        op: &str,
        resource: &str,
        phase: Phase,
        detail: serde_json::Value,
    ) -> Result<Record, JournalError> {
        // fsync blocks: on the daemon's multi-threaded runtime, tell it so other tasks move to
        // another worker meanwhile.
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if multi_thread {
            tokio::task::block_in_place(|| {
                self.journal.append(time_ms, op, resource, phase, detail)
            })
        } else {
            self.journal.append(time_ms, op, resource, phase, detail)
        }
    }

    pub fn head_hex(&self) -> String {
        self.journal.head_hex()
    }

    /// The run's records as this daemon wrote or loaded them (no file read).
    pub fn records(&self) -> Vec<Record> {
        self.journal.records().to_vec()
    }
}

#[derive(Debug, Clone)]
pub struct RunRecord {
    pub handle: Arc<RunHandle>,
    pub state: RunState,
}

impl RunRecord {
    pub fn grant(&self) -> &Arc<Grant> {
        &self.handle.grant
    }
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
    #[error("{open} runs are open, the configured maximum is {max}; end or clean up a run first")]
    TooMany { open: usize, max: usize },
    #[error(transparent)]
    Store(#[from] FileError),
    #[error(transparent)]
    Journal(#[from] JournalError),
}

#[derive(Debug, Default)]
struct Inner {
    runs: BTreeMap<RunId, RunRecord>,
    /// Closed runs, also those whose grant no longer verifies (e.g. after a key rotation).
    closed: BTreeSet<RunId>,
    /// Open runs that could not be loaded (grant or journal unusable), with the reason: listed,
    /// never resumed, left for an operator to inspect.
    quarantined: BTreeMap<RunId, String>,
    /// The grants of quarantined runs whose grant still verifies: what they may have left on
    /// the node, which new runs must not overlap.
    quarantined_grants: Vec<Grant>,
}

#[derive(Debug)]
pub struct RunRegistry {
    dir: PathBuf,
    max_open: usize,
    inner: Mutex<Inner>,
    begin_lock: Mutex<()>,
}

impl RunRegistry {
    /// Loads the registry from `<state_dir>/runs`, creating it (0700) if needed.
    pub fn open(
        state_dir: &Path,
        authority: &VerifyingKey,
        max_open: usize,
        now_ms: i64,
    ) -> Result<Self, RunError> {
        let dir = state_dir.join("runs");
        files::create_private_dir(&dir)?;
        let mut inner = Inner::default();
        let entries = std::fs::read_dir(&dir).map_err(|error| FileError::Read {
            path: dir.clone(),
            error,
        })?;
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
            let closed = read_closed(&run_dir)?;
            if closed.is_some() {
                inner.closed.insert(run_id.clone());
            }
            let grant = match load_grant(&run_dir, authority) {
                Ok(grant) if grant.run_id == run_id => grant,
                Ok(_) => {
                    tracing::error!(%run_id, "stored grant names another run; the run is not loaded");
                    if closed.is_none() {
                        inner
                            .quarantined
                            .insert(run_id, "its stored grant names another run".into());
                    }
                    continue;
                }
                Err(reason) => {
                    tracing::error!(%run_id, %reason, "stored grant does not verify; the run is not loaded");
                    if closed.is_none() {
                        inner.quarantined.insert(
                            run_id,
                            format!("its stored grant does not verify: {reason}"),
                        );
                    }
                    continue;
                }
            };
            let journal = if run_dir.join(journal::FILE_NAME).exists() {
                match Journal::open(&run_dir, run_id.as_str(), now_ms) {
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
                }
            } else {
                // A crash between storing the grant and creating the journal: nothing was done yet.
                Journal::create(&run_dir, run_id.as_str())?
            };
            let state = closed.map_or(RunState::Open, |at_unix_ms| RunState::Closed { at_unix_ms });
            let closed = state != RunState::Open;
            let handle = Arc::new(RunHandle::new(
                run_id.clone(),
                grant,
                run_dir,
                journal,
                closed,
            ));
            inner.runs.insert(run_id, RunRecord { handle, state });
        }
        Ok(Self {
            dir,
            max_open,
            inner: Mutex::new(inner),
            begin_lock: Mutex::new(()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A poisoned lock only means another request panicked; the map itself stays consistent
        // because every update is a single insert.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn get(&self, run_id: &RunId) -> Option<RunRecord> {
        self.lock().runs.get(run_id).cloned()
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

    pub fn is_closed(&self, run_id: &RunId) -> bool {
        self.lock().closed.contains(run_id)
    }

    pub fn list(&self) -> Vec<RunRecord> {
        self.lock().runs.values().cloned().collect()
    }

    /// Opens a run, or resumes it when it is already open with the same grant. Returns whether
    /// it resumed.
    pub fn begin(
        &self,
        signed: &pb::SignedRunGrant,
        grant: Grant,
        now_ms: i64,
    ) -> Result<bool, RunError> {
        // One BeginRun at a time, so the checks below and the insert at the end see the same
        // set of runs (the work in between is a few small fsync'd writes).
        let _begin = self.begin_lock.lock().unwrap_or_else(|p| p.into_inner());
        let run_id = grant.run_id.clone();
        let now_unix = now_ms.div_euclid(1000);
        {
            let inner = self.lock();
            if inner.closed.contains(&run_id) {
                return Err(RunError::Closed(run_id));
            }
            if let Some(reason) = inner.quarantined.get(&run_id) {
                return Err(RunError::Quarantined(run_id, reason.clone()));
            }
            if let Some(existing) = inner.runs.get(&run_id) {
                return if existing.grant().digest == grant.digest {
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
            for other in inner.runs.values().filter(|r| r.state == RunState::Open) {
                if let Some(shared) = overlap(&grant, other.grant()) {
                    return Err(RunError::Overlap {
                        run: run_id,
                        other: other.grant().run_id.clone(),
                        shared,
                    });
                }
            }
            let open = inner
                .runs
                .values()
                .filter(|r| r.state == RunState::Open && r.grant().deadline_unix > now_unix)
                .count();
            if open >= self.max_open {
                return Err(RunError::TooMany {
                    open,
                    max: self.max_open,
                });
            }
        }
        let run_dir = self.dir.join(run_id.as_str());
        files::create_private_dir(&run_dir)?;
        files::write_atomic(&run_dir.join(GRANT_FILE), &signed.encode_to_vec(), 0o600)?;
        let mut journal = match Journal::create(&run_dir, run_id.as_str()) {
            Ok(journal) => journal,
            // A concurrent BeginRun of the same run created it first.
            Err(JournalError::Exists(_)) => return Ok(true),
            Err(e) => return Err(e.into()),
        };
        let detail = serde_json::json!({ "grant_sha256": hex::encode(grant.digest), "deadline_unix": grant.deadline_unix });
        journal.append(
            now_ms,
            "run.begin",
            &format!("run:{run_id}"),
            Phase::Done,
            detail,
        )?;
        let handle = Arc::new(RunHandle::new(
            run_id.clone(),
            grant,
            run_dir,
            journal,
            false,
        ));
        let mut inner = self.lock();
        if inner.closed.contains(&run_id) {
            return Err(RunError::Closed(run_id));
        }
        Ok(inner
            .runs
            .insert(
                run_id,
                RunRecord {
                    handle,
                    state: RunState::Open,
                },
            )
            .is_some())
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
        let record = self
            .get(run_id)
            .ok_or_else(|| RunError::NotBegun(run_id.clone()))?;
        if let RunState::Closed { .. } = record.state {
            return Err(RunError::Closed(run_id.clone()));
        }
        {
            let mut run = record.handle.lock().await;
            // A run ends clean: what it still has on the node must be cleaned up first, or it
            // would outlive the run that owns it.
            let open = crate::node::resources::open_newest_first(&run.records());
            if !open.is_empty() {
                let keys: Vec<&str> = open.iter().map(|s| s.key.as_str()).collect();
                return Err(RunError::OpenResources(run_id.clone(), keys.join(", ")));
            }
            run.append(
                now_ms,
                op,
                &format!("run:{run_id}"),
                Phase::Done,
                serde_json::Value::Null,
            )?;
            // Still under the run lock: an operation waiting for it must find the run closed.
            let path = self.dir.join(run_id.as_str()).join(CLOSED_FILE);
            files::write_atomic(&path, now_ms.to_string().as_bytes(), 0o600)?;
            record
                .handle
                .closed
                .store(true, std::sync::atomic::Ordering::SeqCst);
            let mut inner = self.lock();
            inner.closed.insert(run_id.clone());
            if let Some(record) = inner.runs.get_mut(run_id) {
                record.state = RunState::Closed { at_unix_ms: now_ms };
            }
        }
        Ok(now_ms)
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
mod tests {
    use super::*;
    use crate::grant::tests::{full_wire_grant, sign};
    use ed25519_dalek::SigningKey;

    #[tokio::test(flavor = "multi_thread")]
    async fn closed_runs_stay_closed_across_reopen() {
        let dir = std::env::temp_dir().join(format!("certistack-runs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let key = SigningKey::from_bytes(&[1; 32]);
        let signed = sign(&key, &full_wire_grant());
        let grant = crate::grant::verify(&signed, &key.verifying_key()).unwrap();
        let run_id = grant.run_id.clone();

        let registry = RunRegistry::open(&dir, &key.verifying_key(), 1, 0).unwrap();
        assert!(!registry.begin(&signed, grant.clone(), 2_000_000).unwrap());
        assert!(
            registry.begin(&signed, grant.clone(), 2_000_000).unwrap(),
            "same grant resumes"
        );
        registry.end(&run_id, 2_000_500).await.unwrap();
        assert!(matches!(
            registry.begin(&signed, grant.clone(), 2_000_000),
            Err(RunError::Closed(_))
        ));

        let reopened = RunRegistry::open(&dir, &key.verifying_key(), 1, 0).unwrap();
        assert!(reopened.is_closed(&run_id));
        assert!(matches!(
            reopened.begin(&signed, grant.clone(), 2_000_000),
            Err(RunError::Closed(_))
        ));
        assert!(matches!(
            reopened.end(&run_id, 1).await,
            Err(RunError::Closed(_))
        ));
        let ops: Vec<String> = reopened
            .get(&run_id)
            .unwrap()
            .handle
            .records()
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.entry.op)
            .collect();
        assert_eq!(ops, ["run.begin", "run.end"]);
        // Even with a rotated run-authority key, the closed marker still refuses the run.
        let rotated = RunRegistry::open(
            &dir,
            &SigningKey::from_bytes(&[9; 32]).verifying_key(),
            1,
            0,
        )
        .unwrap();
        assert!(rotated.is_closed(&run_id));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_run_with_a_corrupt_journal_is_quarantined() {
        let dir =
            std::env::temp_dir().join(format!("certistack-runs-corrupt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let key = SigningKey::from_bytes(&[1; 32]);
        let signed = sign(&key, &full_wire_grant());
        let grant = crate::grant::verify(&signed, &key.verifying_key()).unwrap();
        let run_id = grant.run_id.clone();
        let registry = RunRegistry::open(&dir, &key.verifying_key(), 2, 0).unwrap();
        registry.begin(&signed, grant.clone(), 2_000_000).unwrap();
        {
            let record = registry.get(&run_id).unwrap();
            let mut run = record.handle.lock().await;
            run.append(
                1,
                "backup.map",
                "backup:a.img",
                Phase::Intent,
                serde_json::Value::Null,
            )
            .unwrap();
        }
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

        let reopened = RunRegistry::open(&dir, &key.verifying_key(), 2, 0).unwrap();
        assert!(reopened.get(&run_id).is_none());
        let quarantined = reopened.quarantined();
        assert_eq!(quarantined.len(), 1);
        assert!(
            quarantined[0].1.contains("record 1 is invalid"),
            "{quarantined:?}"
        );
        assert!(matches!(
            reopened.begin(&signed, grant, 2_000_000),
            Err(RunError::Quarantined(..))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn open_runs_are_bounded() {
        let dir = std::env::temp_dir().join(format!("certistack-runs-max-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let key = SigningKey::from_bytes(&[1; 32]);
        let registry = RunRegistry::open(&dir, &key.verifying_key(), 1, 0).unwrap();
        let first = sign(&key, &full_wire_grant());
        registry
            .begin(
                &first,
                crate::grant::verify(&first, &key.verifying_key()).unwrap(),
                2_000_000,
            )
            .unwrap();
        let mut wire = full_wire_grant();
        wire.run_id = "11111111-2222-4333-8444-555555555555".into();
        wire.vnet = "csbox2".into();
        wire.sandbox_vms[0].vmid = 9200;
        wire.snapshot = "vm/101/2026-11-01T02:00:00Z".into();
        let second = sign(&key, &wire);
        let grant = crate::grant::verify(&second, &key.verifying_key()).unwrap();
        assert!(matches!(
            registry.begin(&second, grant.clone(), 2_000_000),
            Err(RunError::TooMany { open: 1, max: 1 })
        ));
        // Once the first run's deadline passed it no longer counts.
        assert!(registry.begin(&second, grant, 5_000_000).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
