//! The per-run journal: append-only, hash-chained, fsync'd.
//!
//! One line per record: `<record sha256> <previous sha256> <entry JSON>\n`, where
//! `record = SHA-256(previous || entry JSON bytes)` and the first record's `previous` is
//! SHA-256(`certistack-journal-v1:` || run id), so a journal cannot be moved to another run.
//! The hash covers the exact bytes on disk, so verification never depends on re-serializing.
//!
//! Every side effect is written as an `intent` record before it starts and a `done`/`failed`
//! record after it ends (`undone` when cleanup reverses it); each append is fsync'd before the
//! call returns, and the directory is fsync'd when the file is created.
//!
//! A crash can leave a torn last record. Reading reports it ([`TornTail`]) with every valid
//! record before it. Reopening for append preserves the torn bytes in `journal.torn.<n>`,
//! truncates the journal to its last valid record and appends a record saying so; nothing is
//! dropped silently. A bad record that is not the last one means tampering or disk corruption:
//! the journal is refused ([`JournalError::Corrupt`]) and an operator must look at it.
//!
//! A journal is bounded ([`JournalLimits`]): an `intent` is refused once the journal is close to
//! its cap, so the outcome of a step that started can still be written, and the record that
//! closes the run (`run.end`, `run.expired`) always fits. The service refuses new operations
//! earlier still ([`JournalLimits::operation_budget`]), keeping room for cleanup.
//!
//! [`Reader`] verifies a journal record by record from any reader, so a journal is streamed or
//! summarized in bounded memory.

use crate::files::FileError;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

mod op;
mod reader;
mod wire;
mod writer;

pub use op::{Op, OpClass, Resource};
pub use reader::{Loaded, Reader, Summary, read, summarize};
pub use wire::{line_of, verify_streamed};
pub use writer::Journal;

pub const FILE_NAME: &str = "journal";
/// A journal up to this size keeps each record's wire form, made as the record is appended, so
/// reading it back (`ReadJournal` of an open run) only copies them: a validation's few dozen
/// records. A larger journal keeps none ([`Journal::wire_records`]).
pub const WIRE_KEPT_BYTES: u64 = 16 * 1024;
const GENESIS_CONTEXT: &[u8] = b"certistack-journal-v1:";
/// Kept below the cap for the record that closes the run.
const CLOSE_RESERVE: (u64, u64) = (1, 4096);
/// Kept below the close reserve for the outcomes of steps whose intent was written.
const OUTCOME_RESERVE: (u64, u64) = (16, 64 * 1024);

/// How much one run's journal may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalLimits {
    pub max_records: u64,
    pub max_bytes: u64,
}

impl Default for JournalLimits {
    fn default() -> Self {
        Self::new(
            crate::limits::DEFAULT_MAX_JOURNAL_RECORDS,
            crate::limits::DEFAULT_MAX_JOURNAL_BYTES,
        )
    }
}

impl JournalLimits {
    pub fn new(max_records: usize, max_bytes: u64) -> Self {
        Self {
            max_records: u64::try_from(max_records).unwrap_or(u64::MAX),
            max_bytes,
        }
    }

    /// Records and bytes up to which operations that add to the node are admitted; the rest
    /// (a tenth, at least 100 records and 256 KiB) is kept for undoing, cleanup and closing.
    pub fn operation_budget(&self) -> (u64, u64) {
        let records = (self.max_records / 10).max(100);
        let bytes = (self.max_bytes / 10).max(256 * 1024);
        (
            self.max_records.saturating_sub(records),
            self.max_bytes.saturating_sub(bytes),
        )
    }
}

/// What a journal holds, readable without its lock.
#[derive(Debug, Default)]
pub struct JournalUsage {
    records: AtomicU64,
    bytes: AtomicU64,
}

impl JournalUsage {
    /// Records and bytes of the journal's valid prefix.
    pub fn get(&self) -> (u64, u64) {
        (
            self.records.load(Ordering::SeqCst),
            self.bytes.load(Ordering::SeqCst),
        )
    }

    fn set(&self, records: u64, bytes: u64) {
        self.records.store(records, Ordering::SeqCst);
        self.bytes.store(bytes, Ordering::SeqCst);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Intent,
    Done,
    Failed,
    Undone,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Intent => "intent",
            Phase::Done => "done",
            Phase::Failed => "failed",
            Phase::Undone => "undone",
        }
    }
}

/// What a record says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub seq: u64,
    pub time_ms: i64,
    pub op: Op,
    pub resource: Resource,
    pub phase: Phase,
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub detail: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub entry: Entry,
    pub previous: [u8; 32],
    pub hash: [u8; 32],
}

/// Bytes after the last valid record that do not form a valid record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    pub offset: u64,
    pub bytes: Vec<u8>,
    pub reason: String,
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error(
        "journal {path}: record {line} is invalid ({reason}) and records follow it; the journal was altered or the disk is corrupt: inspect it before cleaning up by hand"
    )]
    Corrupt {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("journal {0} already exists")]
    Exists(PathBuf),
    #[error(
        "journal {0} could not be repaired after a failed write and accepts no more records; free space on the state disk and restart the connector"
    )]
    Poisoned(PathBuf),
    #[error("cannot encode a journal entry: {0}")]
    Encode(String),
    #[error(
        "journal {path} holds {records} records and {bytes} bytes; its cap is {max_records} records and {max_bytes} bytes (limits.max_journal_records, limits.max_journal_bytes): clean up and end the run"
    )]
    Full {
        path: PathBuf,
        records: u64,
        bytes: u64,
        max_records: u64,
        max_bytes: u64,
    },
    #[error("the run of journal {0} is closed; nothing more is recorded for it")]
    Closed(PathBuf),
    #[error("the journal writer of {path} stopped: {reason}")]
    Writer { path: PathBuf, reason: String },
}

pub fn genesis(run_id: &str) -> [u8; 32] {
    Sha256::new()
        .chain_update(GENESIS_CONTEXT)
        .chain_update(run_id.as_bytes())
        .finalize()
        .into()
}

fn record_hash(previous: &[u8; 32], entry_json: &[u8]) -> [u8; 32] {
    Sha256::new()
        .chain_update(previous)
        .chain_update(entry_json)
        .finalize()
        .into()
}

/// A SHA-256 digest in lower-case hex, written by `hex::encode_to_slice` into a buffer of its
/// size and checked once: `hex::encode` collects the characters through an iterator, 1,400
/// instructions a digest (docs/performance.md, section 1, "The third pass").
fn digest_hex(digest: &[u8; 32]) -> String {
    let mut text = [0u8; 64];
    hex::encode_to_slice(digest, &mut text)
        .ok()
        .and_then(|()| String::from_utf8(text.to_vec()).ok())
        // Neither fails (64 is twice 32, hex is ASCII); were one to, the slower way says the same.
        .unwrap_or_else(|| hex::encode(digest))
}

impl Record {
    pub fn to_wire(&self) -> certistack_proto::v1::JournalRecord {
        certistack_proto::v1::JournalRecord {
            sequence: self.entry.seq,
            time_unix_ms: self.entry.time_ms,
            operation: self.entry.op.as_str().to_owned(),
            resource: self.entry.resource.key(),
            phase: self.entry.phase.name().to_owned(),
            previous_sha256: digest_hex(&self.previous),
            record_sha256: digest_hex(&self.hash),
            detail: if self.entry.detail.is_null() {
                String::new()
            } else {
                // Written straight into the string's bytes: `Value`'s `Display` goes through the
                // formatter piece by piece. A `Value` always serializes (its map keys are
                // strings); were it not to, `Display` writes the same text.
                serde_json::to_string(&self.entry.detail)
                    .unwrap_or_else(|_| self.entry.detail.to_string())
            },
        }
    }
}

#[cfg(test)]
mod tests;
