//! Operator calls on one node: list its runs, read a run's journal with the chain verified here,
//! and clean a run up. Each call presents a short-lived operator certificate from the state
//! directory's CA and checks the node's name and surface digest first.

use crate::authority::Authority;
use crate::client::{self, NodeError};
use crate::report::{self, JournalRecord};
use certistack_core::untrusted::{MAX_DETAIL_CHARS, MAX_VALUE_CHARS, printable};
use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_client::ConnectorClient;
use time::OffsetDateTime;
use tonic::transport::Channel;

/// How much of one run's journal the controller takes before refusing the stream rather than
/// holding it in memory without end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalBounds {
    pub records: usize,
    /// Encoded bytes of the streamed records, together.
    pub bytes: usize,
}

/// The largest journal a node may keep (`limits.max_journal_records` and
/// `limits.max_journal_bytes` at their highest): what an operator reading a journal accepts.
pub const NODE_JOURNAL_BOUNDS: JournalBounds = JournalBounds {
    records: 1_000_000,
    bytes: 1024 * 1024 * 1024,
};

/// Connects to the node at `address` (whose certificate must name `node_name`) as `operator`,
/// and checks its `Hello`.
pub async fn connect(
    authority: &Authority,
    address: &str,
    node_name: &str,
    operator: &str,
    now: OffsetDateTime,
) -> Result<ConnectorClient<Channel>, OperatorError> {
    let identity = authority
        .issue_operator(operator, now)
        .map_err(|e| OperatorError::Local(e.to_string()))?;
    let mut connection = client::connect(address, node_name, authority.ca_pem(), &identity).await?;
    client::hello(&mut connection, node_name).await?;
    Ok(connection)
}

#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("{0}")]
    Local(String),
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error(
        "the node streamed more than {} journal records or {} bytes; read the journal file on the node",
        .0.records,
        .0.bytes
    )]
    TooManyRecords(JournalBounds),
}

impl From<tonic::Status> for OperatorError {
    fn from(status: tonic::Status) -> Self {
        OperatorError::Node(status.into())
    }
}

/// One line per run: id, state, deadline (UTC) and open resources; a quarantined run as
/// `quarantined: REASON` (the node could not read its grant back, so it has neither).
///
/// Every text of it is the node's: printed escaped and bounded, as in [`describe_record`].
pub fn describe_run(run: &pb::RunSummary) -> String {
    let value = |text: &str| printable(text.as_bytes(), MAX_VALUE_CHARS);
    let state = match pb::RunState::try_from(run.state) {
        Ok(pb::RunState::Quarantined) => {
            return format!(
                "{} quarantined: {}",
                value(&run.run_id),
                printable(run.quarantine_reason.as_bytes(), MAX_DETAIL_CHARS)
            );
        }
        Ok(pb::RunState::Open) => "open",
        Ok(pb::RunState::Closed) => "closed",
        Ok(pb::RunState::Expired) => "expired",
        Ok(pb::RunState::Unspecified) | Err(_) => "unknown",
    };
    let deadline = OffsetDateTime::from_unix_timestamp(run.deadline_unix)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| run.deadline_unix.to_string());
    let resources = if run.open_resources.is_empty() {
        "-".to_owned()
    } else {
        printable(run.open_resources.join(",").as_bytes(), MAX_DETAIL_CHARS)
    };
    format!(
        "{} {state} deadline {deadline} open {resources}",
        value(&run.run_id)
    )
}

/// Closed runs asked for per ListRuns call: the node's largest page.
pub const CLOSED_RUNS_PER_PAGE: u32 = 1000;

/// Pages of closed runs taken before refusing to go on: a million closed runs, far beyond what
/// a node's retention keeps, so a node that never ends its pages cannot keep the controller.
pub const MAX_CLOSED_RUN_PAGES: usize = 1000;

/// The node's runs: every open and quarantined run, then every closed run, page by page in
/// run-id order.
pub async fn list_runs(
    connection: &mut ConnectorClient<Channel>,
) -> Result<Vec<pb::RunSummary>, OperatorError> {
    let page = |closed_cursor: String| pb::ListRunsRequest {
        closed_page_size: CLOSED_RUNS_PER_PAGE,
        closed_cursor,
    };
    let first = connection
        .list_runs(page(String::new()))
        .await?
        .into_inner();
    let mut runs = first.runs;
    let mut cursor = first.next_closed_cursor;
    let mut pages = 1;
    while !cursor.is_empty() {
        if pages >= MAX_CLOSED_RUN_PAGES {
            return Err(OperatorError::Local(format!(
                "the node listed more than {MAX_CLOSED_RUN_PAGES} pages of {CLOSED_RUNS_PER_PAGE} closed runs; list them on the node"
            )));
        }
        let reply = connection
            .list_runs(page(cursor.clone()))
            .await?
            .into_inner();
        pages += 1;
        // Every page repeats the open and quarantined runs; the first one has them.
        runs.extend(
            reply
                .runs
                .into_iter()
                .filter(|run| run.state == pb::RunState::Closed as i32),
        );
        // Run ids only grow from page to page: a cursor that does not would never end.
        if !reply.next_closed_cursor.is_empty() && reply.next_closed_cursor <= cursor {
            return Err(OperatorError::Local(format!(
                "the node's ListRuns cursor went from {cursor} back to {}; its closed runs cannot be listed",
                reply.next_closed_cursor
            )));
        }
        cursor = reply.next_closed_cursor;
    }
    Ok(runs)
}

/// One line per journal record: sequence, time, operation, resource, phase, detail. The
/// record is the node's text, its detail quoting what tools and guests answered: each part is
/// printed escaped and bounded, so no record can rewrite the lines above it on a terminal (the
/// record itself, whose hashes `journal` verifies, is kept as the node sent it).
pub fn describe_record(record: &JournalRecord) -> String {
    let value = |text: &str| printable(text.as_bytes(), MAX_VALUE_CHARS);
    let time =
        OffsetDateTime::from_unix_timestamp_nanos(i128::from(record.time_unix_ms) * 1_000_000)
            .ok()
            .and_then(|t| {
                t.format(&time::format_description::well_known::Rfc3339)
                    .ok()
            })
            .unwrap_or_else(|| record.time_unix_ms.to_string());
    let mut line = format!(
        "{} {time} {} {} {}",
        record.sequence,
        value(&record.operation),
        value(&record.resource),
        value(&record.phase)
    );
    if !record.detail.is_empty() {
        line.push(' ');
        line.push_str(&printable(record.detail.as_bytes(), MAX_DETAIL_CHARS));
    }
    line
}

/// Streams the journal of `run_id`, handing each record to `each` as it arrives, and returns
/// the records for verification; at most the largest journal a node may keep.
pub async fn read_journal(
    connection: &mut ConnectorClient<Channel>,
    run_id: &str,
    each: impl FnMut(&JournalRecord),
) -> Result<Vec<JournalRecord>, OperatorError> {
    read_journal_within(connection, run_id, NODE_JOURNAL_BOUNDS, each).await
}

/// [`read_journal`] within `bounds`.
pub async fn read_journal_within(
    connection: &mut ConnectorClient<Channel>,
    run_id: &str,
    bounds: JournalBounds,
    mut each: impl FnMut(&JournalRecord),
) -> Result<Vec<JournalRecord>, OperatorError> {
    let mut stream = connection
        .read_journal(pb::ReadJournalRequest {
            run_id: run_id.to_owned(),
        })
        .await?
        .into_inner();
    let mut records = Vec::new();
    let mut bytes = 0usize;
    while let Some(record) = stream.message().await? {
        bytes = bytes.saturating_add(prost::Message::encoded_len(&record));
        if records.len() >= bounds.records || bytes > bounds.bytes {
            return Err(OperatorError::TooManyRecords(bounds));
        }
        let record = JournalRecord::from(&record);
        each(&record);
        records.push(record);
    }
    Ok(records)
}

/// Recomputes the chain of `records` the way the connector writes it; the head (hex) on
/// success, where it broke otherwise.
pub fn verify_journal(run_id: &str, records: &[JournalRecord]) -> Result<String, String> {
    report::recompute_journal_head(run_id, records)
}

/// The node's Cleanup of `run_id`.
pub async fn cleanup(
    connection: &mut ConnectorClient<Channel>,
    run_id: &str,
) -> Result<pb::CleanupReply, OperatorError> {
    Ok(connection
        .cleanup(pb::CleanupRequest {
            run_id: run_id.to_owned(),
        })
        .await?
        .into_inner())
}

/// Whether a receipt says cleanup failed for its resource, also for a resource kept because
/// something above it could not be undone. A state this controller does not know counts as a
/// failure: nothing unknown is called clean.
pub fn receipt_failed(receipt: &pb::ResourceReceipt) -> bool {
    use pb::EndState as State;
    match State::try_from(receipt.state) {
        Ok(
            State::Unmapped
            | State::Deleted
            | State::Destroyed
            | State::Restored
            | State::AlreadyGone
            | State::NeverCreated
            | State::NotOurs,
        ) => false,
        Ok(State::Kept | State::Failed | State::Unspecified) | Err(_) => true,
    }
}

/// Whether a Cleanup reply proves the run clean: `Err` says how many receipts failed and how
/// much residue is left.
pub fn cleanup_complete(reply: &pb::CleanupReply) -> Result<(), String> {
    let failed = reply
        .resources
        .iter()
        .filter(|receipt| receipt_failed(receipt))
        .count();
    if failed > 0 || !reply.residue.is_empty() {
        return Err(format!(
            "{failed} failed receipt(s), {} residue",
            reply.residue.len()
        ));
    }
    Ok(())
}

/// The lines `cleanup` prints of a Cleanup reply: each receipt, each residue, the journal head,
/// all the node's text, escaped and bounded.
pub fn describe_cleanup(reply: &pb::CleanupReply) -> Vec<String> {
    let value = |text: &str| printable(text.as_bytes(), MAX_VALUE_CHARS);
    let detail = |text: &str| printable(text.as_bytes(), MAX_DETAIL_CHARS);
    let receipts = reply.resources.iter().map(|receipt| {
        format!(
            "receipt {} {}",
            value(&receipt.resource),
            detail(&receipt.end_state)
        )
    });
    let residue = reply
        .residue
        .iter()
        .map(|residue| format!("residue {}", detail(residue)));
    receipts
        .chain(residue)
        .chain(std::iter::once(format!(
            "journal head {}",
            value(&reply.journal_head)
        )))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use certistack_core::fixtures::{TERMINAL_SEQUENCES, acts_on_a_terminal};

    fn hostile(label: &str) -> String {
        format!("{label}{TERMINAL_SEQUENCES}{}", "A".repeat(100_000))
    }

    fn assert_shown_safely(lines: &[String]) {
        for line in lines {
            assert!(!acts_on_a_terminal(line), "{line:?}");
            assert!(line.len() < 16 * 1024, "{} bytes", line.len());
        }
    }

    #[test]
    fn runs_journal_and_cleanup_print_no_terminal_sequence_of_the_node() {
        let open = pb::RunSummary {
            run_id: hostile("0f0e1c2d"),
            state: pb::RunState::Open as i32,
            open_resources: vec![hostile("vm:9100"), hostile("backup:")],
            ..Default::default()
        };
        let quarantined = pb::RunSummary {
            state: pb::RunState::Quarantined as i32,
            quarantine_reason: hostile("the grant does not read back: "),
            ..open.clone()
        };
        let record = JournalRecord {
            sequence: 1,
            time_unix_ms: 1_000,
            operation: hostile("guestnet.recover"),
            resource: hostile("overlay:"),
            phase: hostile("done"),
            previous_sha256: String::new(),
            record_sha256: String::new(),
            detail: hostile("{\"product_name\":\""),
        };
        let cleanup = pb::CleanupReply {
            resources: vec![pb::ResourceReceipt {
                resource: hostile("vm:9100"),
                end_state: hostile("failed: "),
                state: 0,
            }],
            residue: vec![hostile("vm:9100 ")],
            journal_head: hostile(""),
        };
        let mut lines = vec![
            describe_run(&open),
            describe_run(&quarantined),
            describe_record(&record),
        ];
        lines.extend(describe_cleanup(&cleanup));
        assert_shown_safely(&lines);
    }
}
