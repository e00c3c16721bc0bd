//! `ReadJournal`'s stream: the journal file read one record at a time, its chain verified as
//! it goes.

use certistack_core::journal::{self, JournalError};
use certistack_proto::v1 as pb;
use std::path::Path;
use tonic::Status;

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
    let opened = std::fs::File::open(path).and_then(|file| {
        let len = file.metadata()?.len();
        Ok(std::io::Read::take(file, len))
    });
    let file = match opened {
        Ok(file) => file,
        Err(error) => {
            let _ = records.blocking_send(Err(Status::internal(format!(
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
        if records.blocking_send(item).is_err() || last {
            return;
        }
    }
}
