//! Writing a journal: appends fsync'd one by one, a torn tail set aside on reopening, the caps
//! that keep room for outcomes and the closing record.

use super::*;
use crate::files::{self, FileError};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// An open journal, appending.
#[derive(Debug)]
pub struct Journal {
    pub(super) path: PathBuf,
    pub(super) run_id: String,
    pub(super) file: File,
    pub(super) next_seq: u64,
    pub(super) head: [u8; 32],
    /// Length of the valid, synced journal; a failed append is cut back to it.
    pub(super) len: u64,
    /// Set when a failed append could not be cut back: nothing more may be appended.
    pub(super) poisoned: bool,
    /// Every record, as written: operations decide from these without re-reading the file.
    pub(super) records: Vec<Record>,
    /// Each record's wire form while the journal holds at most [`WIRE_KEPT_BYTES`]; `None`
    /// once it outgrew them or was poisoned.
    pub(super) wire_forms: Option<Vec<certistack_proto::v1::JournalRecord>>,
    pub(super) limits: JournalLimits,
    pub(super) usage: Arc<JournalUsage>,
}

impl Journal {
    /// Creates the journal of a new run in `dir` (which must exist). Nothing is synced here:
    /// the first append's `fdatasync` makes the file's contents durable, and the caller syncs
    /// `dir` once after it, so that a new run costs one sync of its directory, not two.
    pub fn create(dir: &Path, run_id: &str) -> Result<Self, JournalError> {
        let path = dir.join(FILE_NAME);
        let file = OpenOptions::new()
            .append(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|error| {
                if error.kind() == std::io::ErrorKind::AlreadyExists {
                    JournalError::Exists(path.clone())
                } else {
                    FileError::Write {
                        path: path.clone(),
                        error,
                    }
                    .into()
                }
            })?;
        Ok(Self {
            path,
            run_id: run_id.to_owned(),
            file,
            next_seq: 1,
            head: genesis(run_id),
            len: 0,
            poisoned: false,
            records: Vec::new(),
            wire_forms: Some(Vec::new()),
            limits: JournalLimits::default(),
            usage: Arc::default(),
        })
    }

    /// The same journal, bounded by `limits`.
    pub fn with_limits(mut self, limits: JournalLimits) -> Self {
        self.limits = limits;
        self
    }

    /// What the journal holds, readable without its lock.
    pub fn usage(&self) -> Arc<JournalUsage> {
        self.usage.clone()
    }

    /// Opens an existing journal for appending, repairing a torn tail as described above.
    /// Returns the journal, its records, and the torn tail that was set aside, if any.
    pub fn open(
        dir: &Path,
        run_id: &str,
        time_ms: i64,
    ) -> Result<(Self, Vec<Record>, Option<TornTail>), JournalError> {
        let path = dir.join(FILE_NAME);
        let loaded = read(&path, run_id)?;
        let file = OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|error| FileError::Write {
                path: path.clone(),
                error,
            })?;
        let mut journal = Self {
            path: path.clone(),
            run_id: run_id.to_owned(),
            file,
            next_seq: loaded.records.len() as u64 + 1,
            head: loaded.head(run_id),
            len: loaded.valid_len,
            poisoned: false,
            wire_forms: (loaded.valid_len <= WIRE_KEPT_BYTES)
                .then(|| loaded.records.iter().map(Record::to_wire).collect()),
            records: loaded.records,
            limits: JournalLimits::default(),
            usage: Arc::default(),
        };
        journal.usage.set(journal.next_seq - 1, journal.len);
        if let Some(torn) = &loaded.torn {
            let preserved = journal.preserve_torn(dir, torn)?;
            journal
                .file
                .set_len(loaded.valid_len)
                .and_then(|()| journal.file.sync_all())
                .map_err(|error| FileError::Write {
                    path: path.clone(),
                    error,
                })?;
            let detail = serde_json::json!({
                "torn_bytes": torn.bytes.len(),
                "torn_sha256": hex::encode(Sha256::digest(&torn.bytes)),
                "reason": torn.reason,
                "preserved_as": preserved,
            });
            journal.append(
                time_ms,
                &Op::JournalTornTail,
                &Resource::Journal,
                Phase::Done,
                detail,
            )?;
        }
        let records = journal.records.clone();
        Ok((journal, records, loaded.torn))
    }

    fn preserve_torn(&self, dir: &Path, torn: &TornTail) -> Result<String, JournalError> {
        for n in 1..1000 {
            let name = format!("{FILE_NAME}.torn.{n}");
            match files::write_new(&dir.join(&name), &torn.bytes, 0o600) {
                Ok(()) => return Ok(name),
                Err(FileError::Exists { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(FileError::Exists {
            path: dir.join(format!("{FILE_NAME}.torn.*")),
        }
        .into())
    }

    pub fn head(&self) -> [u8; 32] {
        self.head
    }

    pub fn head_hex(&self) -> String {
        digest_hex(&self.head)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one record and fsyncs it before returning.
    pub fn append(
        &mut self,
        time_ms: i64,
        op: &Op,
        resource: &Resource,
        phase: Phase,
        detail: serde_json::Value,
    ) -> Result<Record, JournalError> {
        let entry = Entry {
            seq: self.next_seq,
            time_ms,
            op: op.clone(),
            resource: resource.clone(),
            phase,
            detail,
        };
        let json =
            serde_json::to_string(&entry).map_err(|e| JournalError::Encode(e.to_string()))?;
        let hash = record_hash(&self.head, json.as_bytes());
        let line = format!("{} {} {json}\n", digest_hex(&hash), digest_hex(&self.head));
        if self.poisoned {
            return Err(JournalError::Poisoned(self.path.clone()));
        }
        self.admit(&entry, line.len() as u64)?;
        let record = Record {
            entry,
            previous: self.head,
            hash,
        };
        // Made before the write, so nothing that could fail stands between the record reaching
        // the disk and memory taking it.
        let len = self.len + line.len() as u64;
        let wire_form =
            (len <= WIRE_KEPT_BYTES && self.wire_forms.is_some()).then(|| record.to_wire());
        let written = self
            .file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.sync_data());
        if let Err(error) = written {
            // Cut the partial or unsynced record off, so the chain stays whole; if even that
            // fails, refuse every further append rather than fork the chain.
            if self
                .file
                .set_len(self.len)
                .and_then(|()| self.file.sync_all())
                .is_err()
            {
                self.poisoned = true;
                // The file may hold a record memory lacks: it alone tells the records now.
                self.wire_forms = None;
            }
            return Err(FileError::Write {
                path: self.path.clone(),
                error,
            }
            .into());
        }
        self.len = len;
        self.head = hash;
        self.next_seq += 1;
        match (wire_form, &mut self.wire_forms) {
            (Some(wire_form), Some(wire_forms)) => wire_forms.push(wire_form),
            _ => self.wire_forms = None,
        }
        self.records.push(record.clone());
        self.usage.set(self.next_seq - 1, self.len);
        Ok(record)
    }

    /// Refuses a record the cap has no room for: an intent must leave room for outcomes and
    /// the closing record, an outcome for the closing record.
    fn admit(&self, entry: &Entry, line_len: u64) -> Result<(), JournalError> {
        if self.records.last().is_some_and(|r| r.entry.op.closes_run()) {
            return Err(JournalError::Closed(self.path.clone()));
        }
        let (mut keep_records, mut keep_bytes) = (0, 0);
        if !entry.op.closes_run() {
            (keep_records, keep_bytes) = CLOSE_RESERVE;
            if entry.phase == Phase::Intent {
                keep_records += OUTCOME_RESERVE.0;
                keep_bytes += OUTCOME_RESERVE.1;
            }
        }
        let records = self.next_seq - 1;
        let fits = records.saturating_add(1).saturating_add(keep_records)
            <= self.limits.max_records
            && self.len.saturating_add(line_len).saturating_add(keep_bytes)
                <= self.limits.max_bytes;
        if fits {
            Ok(())
        } else {
            Err(JournalError::Full {
                path: self.path.clone(),
                records,
                bytes: self.len,
                max_records: self.limits.max_records,
                max_bytes: self.limits.max_bytes,
            })
        }
    }

    /// Whether the journal's last record says exactly this.
    pub fn last_is(
        &self,
        op: &Op,
        resource: &Resource,
        phase: Phase,
        detail: &serde_json::Value,
    ) -> bool {
        self.records.last().is_some_and(|r| {
            r.entry.op == op
                && &r.entry.resource == resource
                && r.entry.phase == phase
                && &r.entry.detail == detail
        })
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Every record of the journal, oldest first.
    pub fn records(&self) -> &[Record] {
        &self.records
    }

    /// Every record's wire form ([`Record::to_wire`]), oldest first, while the journal holds
    /// at most [`WIRE_KEPT_BYTES`]: made as each record was appended, or from the file when the
    /// journal was opened. `None` for a larger journal, and for a poisoned one (its file may
    /// hold a record memory lacks): read the file then.
    pub fn wire_records(&self) -> Option<&[certistack_proto::v1::JournalRecord]> {
        self.wire_forms.as_deref()
    }
}
