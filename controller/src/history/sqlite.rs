//! The history in SQLite (`rusqlite`, the library built in): one file, write-ahead logged so
//! `history` reads while a `run` writes, each write one transaction synced to disk, the schema
//! versioned by `PRAGMA user_version` and migrated forward on open.

use super::{
    Cursor, MAX_PAGE, MAX_REASONS, MAX_STEPS, Page, RowState, RunStore, StoreError, Streak,
    TREND_WINDOW, ValidationRow, VmSummary, bounded, trend,
};
use crate::verdict::{
    CleanupState, Delivery, HistoryError, HistoryWriter, Outcome, PlanRunStarted, StepTiming,
    ValidationEnded, ValidationStarted,
};
use certistack_core::untrusted::{MAX_DETAIL_CHARS, MAX_VALUE_CHARS};
use rusqlite::{Connection, ErrorCode, OptionalExtension, params};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

/// The schema, one step per version: a file at version N gets steps N+1.. in order, each in its
/// own transaction with the version it brings.
const MIGRATIONS: &[&str] = &[
    // 1: plan runs, validations, and each (VM, validation) there is one of.
    "CREATE TABLE plan_runs (
        plan_run_id TEXT PRIMARY KEY,
        plan TEXT NOT NULL,
        plan_sha256 TEXT NOT NULL,
        started_unix_ms INTEGER NOT NULL,
        ended_unix_ms INTEGER
    ) STRICT;
    CREATE TABLE validations (
        run_id TEXT PRIMARY KEY,
        plan_run_id TEXT NOT NULL,
        validation TEXT NOT NULL,
        node TEXT NOT NULL,
        source_vmid INTEGER NOT NULL,
        snapshot TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('running', 'passed', 'failed', 'error')),
        started_unix_ms INTEGER NOT NULL,
        deadline_unix_ms INTEGER NOT NULL,
        ended_unix_ms INTEGER,
        cleanup TEXT,
        reasons TEXT NOT NULL DEFAULT '[]',
        steps TEXT NOT NULL DEFAULT '[]',
        restore_ms INTEGER,
        report TEXT,
        report_sha256 TEXT
    ) STRICT;
    CREATE INDEX validations_of_vm ON validations (source_vmid, started_unix_ms, run_id);
    CREATE INDEX newest_of_subject
        ON validations (source_vmid, validation, started_unix_ms, run_id);
    CREATE INDEX verdicts_of_subject
        ON validations (source_vmid, validation, state, started_unix_ms, run_id);
    CREATE TABLE subjects (
        source_vmid INTEGER NOT NULL,
        validation TEXT NOT NULL,
        PRIMARY KEY (source_vmid, validation)
    ) STRICT;",
    // 2: the notifications of each plan run.
    "CREATE TABLE deliveries (
        plan_run_id TEXT NOT NULL,
        channel TEXT NOT NULL,
        kind TEXT NOT NULL,
        attempts INTEGER NOT NULL,
        delivered INTEGER NOT NULL,
        last_error TEXT,
        at_unix_ms INTEGER NOT NULL,
        PRIMARY KEY (plan_run_id, channel, kind)
    ) STRICT;",
];

/// How long a write waits for another process's write to end, unless told otherwise.
pub const BUSY: Duration = Duration::from_secs(10);

/// The history in one SQLite file.
#[derive(Debug)]
pub struct SqliteStore {
    path: PathBuf,
    busy: Duration,
    connection: Mutex<Connection>,
}

impl SqliteStore {
    /// Opens (creating it, mode 0600) the history at `path`, migrated to this version's schema;
    /// a write waits at most `busy` for another process's. A file that is not a history, one
    /// from a newer version, or one locked past `busy` is refused, saying what to do.
    pub fn open(path: &Path, busy: Duration) -> Result<Self, StoreError> {
        let shown = path.display().to_string();
        create_private(path).map_err(|error| StoreError::Io {
            path: shown.clone(),
            reason: format!(
                "cannot create it: {error}; check that the state directory exists and is writable"
            ),
        })?;
        let connection = Connection::open(path).map_err(|error| classify(path, busy, error))?;
        let store = Self {
            path: path.to_owned(),
            busy,
            connection: Mutex::new(connection),
        };
        // Switching a new file to WAL and migrating it take the write lock in steps, and SQLite
        // answers "busy" at once, without waiting, where waiting could deadlock (another
        // process opening the same new file): the whole preparation is tried again, within
        // the same `busy`.
        let began = std::time::Instant::now();
        loop {
            match store.prepare() {
                Err(StoreError::Locked { .. }) if began.elapsed() < busy => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                prepared => return prepared.map(|()| store),
            }
        }
    }

    /// Opens the history at `path` to read it (`history`): read-only, creating and changing
    /// nothing, when its schema is this version's; a file of an older schema is migrated first,
    /// as [`Self::open`] does.
    pub fn open_for_reading(path: &Path, busy: Duration) -> Result<Self, StoreError> {
        use rusqlite::OpenFlags;
        let connection = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|error| classify(path, busy, error))?;
        connection
            .busy_timeout(busy)
            .map_err(|error| classify(path, busy, error))?;
        let found: i64 = connection
            .query_row("PRAGMA user_version", [], |row| row.get(0))
            .map_err(|error| classify(path, busy, error))?;
        let known = MIGRATIONS.len() as i64;
        if found > known {
            return Err(StoreError::Newer {
                path: path.display().to_string(),
                found,
                known,
            });
        }
        if found < known {
            drop(connection);
            return Self::open(path, busy);
        }
        Ok(Self {
            path: path.to_owned(),
            busy,
            connection: Mutex::new(connection),
        })
    }

    fn prepare(&self) -> Result<(), StoreError> {
        let mut connection = self.lock();
        let fail = |error| classify(&self.path, self.busy, error);
        connection.busy_timeout(self.busy).map_err(fail)?;
        // Readers (`history`) never wait for the writer (`run`), nor it for them.
        let mode: String = connection
            .query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))
            .map_err(fail)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Io {
                path: self.path.display().to_string(),
                reason: format!("SQLite kept journal mode {mode:?} instead of wal"),
            });
        }
        connection
            .execute_batch("PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON;")
            .map_err(fail)?;
        let known = MIGRATIONS.len() as i64;
        let version = |connection: &Connection| -> Result<i64, StoreError> {
            let found: i64 = connection
                .query_row("PRAGMA user_version", [], |row| row.get(0))
                .map_err(fail)?;
            if found > known {
                return Err(StoreError::Newer {
                    path: self.path.display().to_string(),
                    found,
                    known,
                });
            }
            Ok(found)
        };
        if version(&connection)? == known {
            return Ok(());
        }
        // Migrated under the write lock, the version read again there: another process may
        // have migrated the file since (two runs started at once on a new file).
        let transaction = connection
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(fail)?;
        let found = version(&transaction)?;
        for (index, step) in MIGRATIONS
            .iter()
            .enumerate()
            .skip(usize::try_from(found).unwrap_or(0))
        {
            transaction.execute_batch(step).map_err(fail)?;
            transaction
                .execute_batch(&format!("PRAGMA user_version = {}", index + 1))
                .map_err(fail)?;
        }
        transaction.commit().map_err(fail)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.connection
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn fail(&self, error: rusqlite::Error) -> StoreError {
        classify(&self.path, self.busy, error)
    }

    fn write(&self, sql: &str, values: impl rusqlite::Params) -> Result<(), HistoryError> {
        self.lock()
            .prepare_cached(sql)
            .and_then(|mut statement| statement.execute(values))
            .map(|_| ())
            .map_err(|error| HistoryError(self.fail(error).to_string()))
    }
}

impl SqliteStore {
    /// A validation's row (`sql` with `values`) and its (VM, validation) in one transaction.
    fn write_validation(
        &self,
        sql: &str,
        values: impl rusqlite::Params,
        source_vmid: u32,
        name: &str,
    ) -> Result<(), HistoryError> {
        let mut connection = self.lock();
        let fail = |error| HistoryError(self.fail(error).to_string());
        let transaction = connection.transaction().map_err(fail)?;
        transaction
            .prepare_cached(sql)
            .and_then(|mut statement| statement.execute(values))
            .map_err(fail)?;
        transaction
            .prepare_cached(UPSERT_VM)
            .and_then(|mut statement| statement.execute(params![source_vmid, name]))
            .map_err(fail)?;
        transaction.commit().map_err(fail)
    }
}

/// Makes `path` a file only its owner reads, creating it empty when it does not exist (SQLite
/// would make it 0644, and gives its -wal and -shm files the database's mode): reasons quote
/// what guests said, and report paths name the reports directory.
fn create_private(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)?;
    file.set_permissions(std::fs::Permissions::from_mode(0o600))
}

fn classify(path: &Path, busy: Duration, error: rusqlite::Error) -> StoreError {
    let shown = path.display().to_string();
    match error.sqlite_error_code() {
        Some(ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt) => StoreError::Corrupt {
            path: shown,
            reason: error.to_string(),
        },
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => StoreError::Locked {
            path: shown,
            seconds: busy.as_secs(),
        },
        _ => StoreError::Io {
            path: shown,
            reason: error.to_string(),
        },
    }
}

/// A run id as the history keys it: what `uuid` prints, or at least nothing else.
fn checked_id(id: &str, what: &str) -> Result<(), HistoryError> {
    if !super::is_key(id) {
        return Err(HistoryError(format!(
            "{what} {:?} is not an id the history keeps (letters, digits and '-', at most 64)",
            bounded(id, MAX_VALUE_CHARS)
        )));
    }
    Ok(())
}

fn outcome_state(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Passed => "passed",
        Outcome::Failed => "failed",
        Outcome::Error => "error",
    }
}

fn cleanup_text(cleanup: CleanupState) -> &'static str {
    match cleanup {
        CleanupState::NotNeeded => "not_needed",
        CleanupState::Complete => "complete",
        CleanupState::Unproven => "unproven",
    }
}

const INSERT_STARTED: &str = "INSERT INTO validations
    (run_id, plan_run_id, validation, node, source_vmid, snapshot, state, started_unix_ms, deadline_unix_ms)
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'running', ?7, ?8)
    ON CONFLICT (run_id) DO NOTHING";

const UPSERT_ENDED: &str = "INSERT INTO validations
    (run_id, plan_run_id, validation, node, source_vmid, snapshot, state, started_unix_ms,
     deadline_unix_ms, ended_unix_ms, cleanup, reasons, steps, restore_ms, report, report_sha256)
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)
    ON CONFLICT (run_id) DO UPDATE SET
        state = excluded.state, ended_unix_ms = excluded.ended_unix_ms,
        cleanup = excluded.cleanup, reasons = excluded.reasons, steps = excluded.steps,
        restore_ms = excluded.restore_ms, report = excluded.report,
        report_sha256 = excluded.report_sha256";

const UPSERT_VM: &str = "INSERT INTO subjects (source_vmid, validation) VALUES (?1, ?2)
    ON CONFLICT (source_vmid, validation) DO NOTHING";

impl HistoryWriter for SqliteStore {
    fn delivery(&self, delivery: &Delivery) -> Result<(), HistoryError> {
        checked_id(&delivery.plan_run_id, "plan run")?;
        self.write(
            "INSERT INTO deliveries
             (plan_run_id, channel, kind, attempts, delivered, last_error, at_unix_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
             ON CONFLICT (plan_run_id, channel, kind) DO UPDATE SET
                attempts = excluded.attempts, delivered = excluded.delivered,
                last_error = excluded.last_error, at_unix_ms = excluded.at_unix_ms",
            params![
                delivery.plan_run_id,
                bounded(&delivery.channel, MAX_VALUE_CHARS),
                bounded(&delivery.kind, MAX_VALUE_CHARS),
                delivery.attempts,
                delivery.delivered,
                delivery
                    .last_error
                    .as_deref()
                    .map(|error| bounded(error, MAX_DETAIL_CHARS)),
                delivery.at_unix_ms
            ],
        )
    }

    fn plan_started(&self, plan: &PlanRunStarted) -> Result<(), HistoryError> {
        checked_id(&plan.plan_run_id, "plan run")?;
        self.write(
            "INSERT INTO plan_runs (plan_run_id, plan, plan_sha256, started_unix_ms)
             VALUES (?1, ?2, ?3, ?4) ON CONFLICT (plan_run_id) DO NOTHING",
            params![
                plan.plan_run_id,
                bounded(&plan.plan, MAX_DETAIL_CHARS),
                bounded(&plan.plan_sha256, MAX_VALUE_CHARS),
                plan.started_unix_ms
            ],
        )
    }

    fn plan_ended(&self, plan_run_id: &str, ended_unix_ms: i64) -> Result<(), HistoryError> {
        checked_id(plan_run_id, "plan run")?;
        self.write(
            "UPDATE plan_runs SET ended_unix_ms = ?2 WHERE plan_run_id = ?1",
            params![plan_run_id, ended_unix_ms],
        )
    }

    fn validation_started(&self, started: &ValidationStarted) -> Result<(), HistoryError> {
        checked_id(&started.run_id, "run")?;
        let name = bounded(&started.validation, MAX_VALUE_CHARS);
        self.write_validation(
            INSERT_STARTED,
            params![
                started.run_id,
                started.plan_run_id,
                name,
                bounded(&started.node, MAX_VALUE_CHARS),
                started.source_vmid,
                bounded(&started.snapshot, MAX_VALUE_CHARS),
                started.started_unix_ms,
                started.deadline_unix_ms
            ],
            started.source_vmid,
            &name,
        )
    }

    fn validation_ended(&self, ended: &ValidationEnded) -> Result<(), HistoryError> {
        let started = &ended.started;
        checked_id(&started.run_id, "run")?;
        let reasons: Vec<String> = ended
            .reasons
            .iter()
            .take(MAX_REASONS)
            .map(|reason| bounded(reason, MAX_DETAIL_CHARS))
            .collect();
        let steps: Vec<StepTiming> = ended
            .steps
            .iter()
            .take(MAX_STEPS)
            .map(|step| StepTiming {
                name: bounded(&step.name, MAX_VALUE_CHARS),
                result: bounded(&step.result, MAX_VALUE_CHARS),
                ..step.clone()
            })
            .collect();
        let restore = crate::verdict::restore_ms(&steps).and_then(|ms| i64::try_from(ms).ok());
        let name = bounded(&started.validation, MAX_VALUE_CHARS);
        self.write_validation(
            UPSERT_ENDED,
            params![
                started.run_id,
                started.plan_run_id,
                name,
                bounded(&started.node, MAX_VALUE_CHARS),
                started.source_vmid,
                bounded(&started.snapshot, MAX_VALUE_CHARS),
                outcome_state(ended.outcome),
                started.started_unix_ms,
                started.deadline_unix_ms,
                ended.ended_unix_ms,
                cleanup_text(ended.cleanup),
                serde_json::to_string(&reasons).unwrap_or_else(|_| "[]".into()),
                serde_json::to_string(&steps).unwrap_or_else(|_| "[]".into()),
                restore,
                ended
                    .report
                    .as_ref()
                    .map(|path| bounded(&path.display().to_string(), MAX_DETAIL_CHARS)),
                ended
                    .report_sha256
                    .as_deref()
                    .map(|digest| bounded(digest, MAX_VALUE_CHARS)),
            ],
            started.source_vmid,
            &name,
        )
    }
}

const ROW_COLUMNS: &str = "run_id, plan_run_id, validation, node, source_vmid, snapshot, state,
    started_unix_ms, deadline_unix_ms, ended_unix_ms, cleanup, reasons, steps, restore_ms,
    report, report_sha256";

/// A stored state as read at `now`: a running row past its deadline is interrupted.
fn read_state(stored: &str, deadline_unix_ms: i64, now_unix_ms: i64) -> RowState {
    match stored {
        "passed" => RowState::Passed,
        "failed" => RowState::Failed,
        "error" => RowState::Error,
        _ if deadline_unix_ms < now_unix_ms => RowState::Interrupted,
        _ => RowState::Running,
    }
}

fn row(row: &rusqlite::Row<'_>, now_unix_ms: i64) -> rusqlite::Result<ValidationRow> {
    let stored: String = row.get(6)?;
    let deadline_unix_ms: i64 = row.get(8)?;
    let reasons: String = row.get(11)?;
    let steps: String = row.get(12)?;
    let restore: Option<i64> = row.get(13)?;
    Ok(ValidationRow {
        run_id: row.get(0)?,
        plan_run_id: row.get(1)?,
        validation: row.get(2)?,
        node: row.get(3)?,
        source_vmid: row.get(4)?,
        snapshot: row.get(5)?,
        state: read_state(&stored, deadline_unix_ms, now_unix_ms),
        started_unix_ms: row.get(7)?,
        deadline_unix_ms,
        ended_unix_ms: row.get(9)?,
        cleanup: row.get(10)?,
        reasons: serde_json::from_str(&reasons).unwrap_or_default(),
        steps: serde_json::from_str(&steps).unwrap_or_default(),
        restore_ms: restore.and_then(|ms| u64::try_from(ms).ok()),
        report: row.get(14)?,
        report_sha256: row.get(15)?,
    })
}

impl RunStore for SqliteStore {
    fn vm_summaries(&self, now_unix_ms: i64) -> Result<Vec<VmSummary>, StoreError> {
        let connection = self.lock();
        let fail = |error| self.fail(error);
        // One indexed look-up each, per VM: the cost grows with the VMs, not the validations.
        let mut subjects = connection
            .prepare_cached(
                "SELECT source_vmid, validation FROM subjects ORDER BY source_vmid, validation",
            )
            .map_err(fail)?;
        let mut newest = connection
            .prepare_cached(
                "SELECT state, started_unix_ms, deadline_unix_ms FROM validations
                 WHERE source_vmid = ?1 AND validation = ?2
                 ORDER BY started_unix_ms DESC, run_id DESC LIMIT 1",
            )
            .map_err(fail)?;
        let mut last_of = connection
            .prepare_cached(
                "SELECT started_unix_ms, run_id, ended_unix_ms FROM validations
                 WHERE source_vmid = ?1 AND validation = ?2 AND state = ?3
                 ORDER BY started_unix_ms DESC, run_id DESC LIMIT 1",
            )
            .map_err(fail)?;
        let mut count_since = connection
            .prepare_cached(
                "SELECT COUNT(*) FROM validations
                 WHERE source_vmid = ?1 AND validation = ?2 AND state = ?3
                 AND (started_unix_ms, run_id) > (?4, ?5)",
            )
            .map_err(fail)?;
        let mut restores = connection
            .prepare_cached(
                "SELECT restore_ms FROM validations
                 WHERE source_vmid = ?1 AND validation = ?2 AND state = 'passed'
                 AND restore_ms IS NOT NULL
                 ORDER BY started_unix_ms DESC, run_id DESC LIMIT ?3",
            )
            .map_err(fail)?;
        let listed: Vec<(u32, String)> = subjects
            .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))
            .and_then(Iterator::collect)
            .map_err(fail)?;
        let mut out = Vec::with_capacity(listed.len());
        for (vmid, validation) in listed {
            let Some((stored, started, deadline)) = newest
                .query_row(params![vmid, validation], |row| {
                    Ok((
                        row.get::<_, String>(0)?,
                        row.get::<_, i64>(1)?,
                        row.get::<_, i64>(2)?,
                    ))
                })
                .optional()
                .map_err(fail)?
            else {
                continue;
            };
            let mut last = |state: &str| {
                last_of
                    .query_row(params![vmid, validation, state], |row| {
                        Ok((
                            (row.get::<_, i64>(0)?, row.get::<_, String>(1)?),
                            row.get::<_, Option<i64>>(2)?,
                        ))
                    })
                    .optional()
                    .map_err(fail)
            };
            let passed = last("passed")?;
            let failed = last("failed")?;
            // Validations are ordered by (start, run id), as pages are: two begun in the same
            // millisecond still have an order.
            let newest_verdict = match (&passed, &failed) {
                // Counted since the other verdict's newest: those in a row.
                (Some((pass, _)), Some((fail, _))) if pass >= fail => {
                    Some(("passed", RowState::Passed, Some(fail.clone())))
                }
                (Some((pass, _)), Some(_)) => {
                    Some(("failed", RowState::Failed, Some(pass.clone())))
                }
                (Some(_), None) => Some(("passed", RowState::Passed, None)),
                (None, Some(_)) => Some(("failed", RowState::Failed, None)),
                (None, None) => None,
            };
            let streak = match newest_verdict {
                Some((stored_state, state, since)) => {
                    let (since_ms, since_run) = since.unwrap_or((i64::MIN, String::new()));
                    let count: i64 = count_since
                        .query_row(
                            params![vmid, validation, stored_state, since_ms, since_run],
                            |row| row.get(0),
                        )
                        .map_err(fail)?;
                    Some(Streak {
                        verdict: state,
                        count: u64::try_from(count).unwrap_or(0),
                    })
                }
                None => None,
            };
            let times: Vec<u64> = restores
                .query_map(params![vmid, validation, TREND_WINDOW as i64 + 1], |row| {
                    row.get::<_, i64>(0)
                })
                .and_then(Iterator::collect::<rusqlite::Result<Vec<i64>>>)
                .map_err(fail)?
                .into_iter()
                .filter_map(|ms| u64::try_from(ms).ok())
                .collect();
            let last_restore_ms = times.first().copied();
            out.push(VmSummary {
                source_vmid: vmid,
                validation,
                last_state: read_state(&stored, deadline, now_unix_ms),
                last_started_unix_ms: started,
                last_passed_unix_ms: passed.map(|((start, _), end)| end.unwrap_or(start)),
                last_failed_unix_ms: failed.map(|((start, _), end)| end.unwrap_or(start)),
                streak,
                last_restore_ms,
                restore_trend: last_restore_ms
                    .and_then(|last| trend(last, times.get(1..).unwrap_or_default())),
            });
        }
        Ok(out)
    }

    fn validations_of_plan_run(
        &self,
        plan_run_id: &str,
        now_unix_ms: i64,
    ) -> Result<Vec<ValidationRow>, StoreError> {
        let connection = self.lock();
        let fail = |error| self.fail(error);
        let sql = format!(
            "SELECT {ROW_COLUMNS} FROM validations WHERE plan_run_id = ?1
             ORDER BY started_unix_ms, run_id LIMIT ?2"
        );
        let mut statement = connection.prepare_cached(&sql).map_err(fail)?;
        statement
            .query_map(
                params![plan_run_id, super::MAX_PLAN_RUN_VALIDATIONS as i64],
                |found| row(found, now_unix_ms),
            )
            .and_then(Iterator::collect)
            .map_err(fail)
    }

    fn deliveries_of(&self, plan_run_id: &str) -> Result<Vec<Delivery>, StoreError> {
        let connection = self.lock();
        let fail = |error| self.fail(error);
        let mut statement = connection
            .prepare_cached(
                "SELECT plan_run_id, channel, kind, attempts, delivered, last_error, at_unix_ms
                 FROM deliveries WHERE plan_run_id = ?1 ORDER BY channel, kind",
            )
            .map_err(fail)?;
        statement
            .query_map([plan_run_id], |row| {
                Ok(Delivery {
                    plan_run_id: row.get(0)?,
                    channel: row.get(1)?,
                    kind: row.get(2)?,
                    attempts: row.get(3)?,
                    delivered: row.get(4)?,
                    last_error: row.get(5)?,
                    at_unix_ms: row.get(6)?,
                })
            })
            .and_then(Iterator::collect)
            .map_err(fail)
    }

    fn validations_of(
        &self,
        source_vmid: u32,
        after: Option<&Cursor>,
        limit: usize,
        now_unix_ms: i64,
    ) -> Result<Page, StoreError> {
        if limit == 0 || limit > MAX_PAGE {
            return Err(StoreError::Refused(format!(
                "a page holds 1 to {MAX_PAGE} validations, not {limit}"
            )));
        }
        let connection = self.lock();
        let fail = |error| self.fail(error);
        let sql = format!(
            "SELECT {ROW_COLUMNS} FROM validations WHERE source_vmid = ?1
             AND (?2 IS NULL OR (started_unix_ms, run_id) < (?2, ?3))
             ORDER BY started_unix_ms DESC, run_id DESC LIMIT ?4"
        );
        let mut statement = connection.prepare_cached(&sql).map_err(fail)?;
        let mut validations: Vec<ValidationRow> = statement
            .query_map(
                params![
                    source_vmid,
                    after.map(|cursor| cursor.started_unix_ms),
                    after.map(|cursor| cursor.run_id.as_str()),
                    limit as i64 + 1
                ],
                |found| row(found, now_unix_ms),
            )
            .and_then(Iterator::collect)
            .map_err(fail)?;
        let next = if validations.len() > limit {
            validations.truncate(limit);
            validations.last().map(|last| {
                Cursor {
                    started_unix_ms: last.started_unix_ms,
                    run_id: last.run_id.clone(),
                }
                .token()
            })
        } else {
            None
        };
        Ok(Page { validations, next })
    }
}
