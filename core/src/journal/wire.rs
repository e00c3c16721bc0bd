//! Records on the wire (`ReadJournal`, `protocol.md` "Records on the wire"): each record's line
//! rebuilt exactly as the node wrote it, and a streamed journal's hash chain verified from them
//! by the same [`Reader`] that verifies the file, so the controller checks a node's journal with
//! the node's own rules.

use super::Reader;
use certistack_proto::v1::JournalRecord;
use std::path::Path;

/// The on-disk line of one streamed record: the entry bytes rebuilt as the protocol documents.
pub fn line_of(record: &JournalRecord) -> Result<String, String> {
    let string = |value: &str| {
        serde_json::to_string(value).map_err(|e| format!("record {}: {e}", record.sequence))
    };
    let mut entry = format!(
        "{{\"seq\":{},\"time_ms\":{},\"op\":{},\"resource\":{},\"phase\":{}",
        record.sequence,
        record.time_unix_ms,
        string(&record.operation)?,
        string(&record.resource)?,
        string(&record.phase)?,
    );
    if !record.detail.is_empty() {
        entry.push_str(",\"detail\":");
        entry.push_str(&record.detail);
    }
    entry.push('}');
    Ok(format!(
        "{} {} {entry}\n",
        record.record_sha256, record.previous_sha256
    ))
}

/// Verifies the chain of `run_id`'s journal from its streamed `records`; its head on success,
/// where it broke otherwise.
pub fn verify_streamed(run_id: &str, records: &[JournalRecord]) -> Result<[u8; 32], String> {
    let mut text = String::new();
    for record in records {
        text.push_str(&line_of(record)?);
    }
    let longest = text.lines().map(str::len).max().unwrap_or(0) as u64;
    let mut reader = Reader::new(
        text.as_bytes(),
        // The name errors give the input, as they always have.
        Path::new("report journal"),
        run_id,
        longest + 1,
    );
    for record in reader.by_ref() {
        record.map_err(|e| e.to_string())?;
    }
    if let Some(torn) = reader.torn() {
        return Err(format!(
            "record {} does not verify ({})",
            reader.records_read() + 1,
            torn.reason
        ));
    }
    if reader.records_read() != records.len() as u64 {
        return Err(format!(
            "{} of {} records verify",
            reader.records_read(),
            records.len()
        ));
    }
    Ok(reader.head())
}
