//! `ReadJournal`'s answer: the journal file read one record at a time, its chain verified as
//! it goes; a small journal of an open run read whole before the call answers.

use certistack_core::journal::{self, JournalError};
use certistack_proto::v1 as pb;
use std::path::Path;
use tonic::Status;

/// Journals of open runs up to this size are read on the async worker, before the call
/// answers: a few dozen records, just written, so in the page cache; reading them costs less
/// than a hand-off to the blocking pool, and the whole answer (headers, records, trailers)
/// leaves in one write. Larger journals, and closed runs', are streamed from a blocking thread.
pub(super) const INLINE_JOURNAL_BYTES: u64 = 16 * 1024;

/// Streams the journal at `path` into `records`, verifying the chain, one record in memory at
/// a time. Records appended after the call began are left out; so is a torn last record
/// (a write in progress, or the tail of a crash that start-up sets aside). Stops when the
/// reader goes away.
pub(super) fn stream_journal(
    path: &Path,
    run_id: &str,
    max_line: u64,
    records: &tokio::sync::mpsc::Sender<Result<pb::JournalRecord, Status>>,
) {
    read_journal(path, run_id, max_line, |item| {
        records.blocking_send(item).is_ok()
    });
}

/// The journal at `path`, read whole and verified, as [`stream_journal`] would send it. For
/// journals up to [`INLINE_JOURNAL_BYTES`].
pub(super) fn journal_records(
    path: &Path,
    run_id: &str,
    max_line: u64,
) -> Vec<Result<pb::JournalRecord, Status>> {
    let mut records = Vec::new();
    read_journal(path, run_id, max_line, |item| {
        records.push(item);
        true
    });
    records
}

/// Hands each record (or the error that ends the journal) to `each` until it returns false.
fn read_journal(
    path: &Path,
    run_id: &str,
    max_line: u64,
    mut each: impl FnMut(Result<pb::JournalRecord, Status>) -> bool,
) {
    let opened = std::fs::File::open(path).and_then(|file| {
        let len = file.metadata()?.len();
        Ok(std::io::Read::take(file, len))
    });
    let file = match opened {
        Ok(file) => file,
        Err(error) => {
            each(Err(Status::internal(format!(
                "cannot read the journal {}: {error}",
                path.display()
            ))));
            return;
        }
    };
    let reader = journal::Reader::new(std::io::BufReader::new(file), path, run_id, max_line);
    for record in reader {
        let item = record.map(|r| r.to_wire()).map_err(|error| match error {
            JournalError::Corrupt { .. } => Status::data_loss(error.to_string()),
            _ => Status::internal(error.to_string()),
        });
        let last = item.is_err();
        if !each(item) || last {
            return;
        }
    }
}
