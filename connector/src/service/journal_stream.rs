//! `ReadJournal`'s stream: the journal file read one record at a time, its chain verified as
//! it goes.

use certistack_core::journal::{self, JournalError};
use certistack_proto::v1 as pb;
use std::io::Read;
use std::path::PathBuf;
use tonic::Status;

/// Streams the journal at the first of `places` that exists into `records`, verifying the
/// chain, one record in memory at a time: a run's directory moves (one rename) from `runs/` to
/// `closed/` when the run closes, so a journal looked up while its run was open may be found
/// only at its closed place by the time it is opened. `closed`: whether the run was closed when
/// it was looked up, which tells what a journal found at no place means. Records appended after
/// the call began are left out; so is a torn last record (a write in progress, or the tail of a
/// crash that start-up sets aside). Stops when the reader goes away.
pub(super) fn stream_journal(
    places: &[PathBuf],
    run_id: &str,
    closed: bool,
    max_line: u64,
    records: &tokio::sync::mpsc::Sender<Result<pb::JournalRecord, Status>>,
) {
    let (path, file) = match open_first(places, closed) {
        Ok(opened) => opened,
        Err(status) => {
            let _ = records.blocking_send(Err(status));
            return;
        }
    };
    let path = path.as_path();
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

/// The first of `places` that opens, read up to its length at the time.
fn open_first(
    places: &[PathBuf],
    closed: bool,
) -> Result<(&PathBuf, std::io::Take<std::fs::File>), Status> {
    for path in places {
        let opened = std::fs::File::open(path).and_then(|file| {
            let len = file.metadata()?.len();
            Ok(file.take(len))
        });
        match opened {
            Ok(file) => return Ok((path, file)),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(error) => {
                return Err(Status::internal(format!(
                    "cannot read the journal {}: {error}",
                    path.display()
                )));
            }
        }
    }
    let tried: Vec<String> = places.iter().map(|p| p.display().to_string()).collect();
    let tried = tried.join(" and ");
    Err(if closed {
        Status::not_found(format!(
            "the closed run's journal is no longer on this node (looked at {tried}): the retention sweep removes closed runs after limits.closed_run_retention_days; see ListRuns"
        ))
    } else {
        Status::internal(format!(
            "the open run's journal is missing (looked at {tried}): it was removed from under the connector; the run cannot be verified, see the daemon's log and clean it up by hand"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn journal_in(dir: &std::path::Path, run_id: &str) -> PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        let mut journal = journal::Journal::create(dir, run_id).unwrap();
        journal
            .append(
                1,
                &journal::Op::RunBegin,
                &journal::Resource::parse(&format!("run:{run_id}")),
                journal::Phase::Done,
                serde_json::Value::Null,
            )
            .unwrap();
        dir.join(journal::FILE_NAME)
    }

    fn streamed(
        places: &[PathBuf],
        run_id: &str,
        closed: bool,
    ) -> Vec<Result<pb::JournalRecord, Status>> {
        let (sender, mut receiver) = tokio::sync::mpsc::channel(16);
        stream_journal(places, run_id, closed, 1 << 20, &sender);
        drop(sender);
        std::iter::from_fn(|| receiver.try_recv().ok()).collect()
    }

    /// A journal looked up while its run was open and moved to `closed/` before it was
    /// opened is read from its closed place. One at neither place is NOT_FOUND for a run closed
    /// when it was looked up (the retention sweep removed it) and INTERNAL for an open one (its
    /// file was removed from under the connector), saying where it was looked for.
    #[test]
    fn a_journal_moved_by_its_run_closing_is_read_from_its_closed_place() {
        let run_id = "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f";
        let root = std::env::temp_dir().join(format!("certistack-stream-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let open = root.join("runs").join(run_id);
        let closed = root.join("closed").join("0f").join(run_id);
        let on_disk = journal_in(&open, run_id);
        let places = [on_disk, closed.join(journal::FILE_NAME)];
        let before: Vec<_> = streamed(&places, run_id, false)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(before.len(), 1);
        std::fs::create_dir_all(closed.parent().unwrap()).unwrap();
        std::fs::rename(&open, &closed).unwrap();
        let after: Vec<_> = streamed(&places, run_id, false)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(after, before);
        std::fs::remove_dir_all(&closed).unwrap();
        let cases = [
            (true, tonic::Code::NotFound),
            (false, tonic::Code::Internal),
        ];
        for (closed_when_asked, code) in cases {
            let gone = streamed(&places, run_id, closed_when_asked);
            let [Err(status)] = gone.as_slice() else {
                panic!("one error expected, got {gone:?}");
            };
            assert_eq!(status.code(), code);
            assert!(
                status.message().contains(&closed.display().to_string()),
                "{status:?}"
            );
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}
