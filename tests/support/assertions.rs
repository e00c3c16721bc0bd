//! Assertions on refusals, and a run's journal and cleanup read back as text.

use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_client::ConnectorClient;
use tonic::transport::Channel;

/// The call was refused with `code` and a message containing `needle`.
pub fn assert_status<T: std::fmt::Debug>(
    result: Result<T, tonic::Status>,
    code: tonic::Code,
    needle: &str,
) {
    match result {
        Ok(reply) => panic!("expected {code:?} containing {needle:?}, got {reply:?}"),
        Err(status) => {
            assert_eq!(status.code(), code, "message: {}", status.message());
            assert!(
                status.message().contains(needle),
                "{:?} does not contain {needle:?}",
                status.message()
            );
        }
    }
}

/// As [`assert_status`], for one case of a table: every failure names `case`.
pub fn assert_case_status<T: std::fmt::Debug>(
    case: &str,
    result: Result<T, tonic::Status>,
    code: tonic::Code,
    needle: &str,
) {
    match result {
        Ok(reply) => panic!("{case}: expected {code:?} containing {needle:?}, got {reply:?}"),
        Err(status) => {
            assert_eq!(status.code(), code, "{case}: message: {}", status.message());
            assert!(
                status.message().contains(needle),
                "{case}: {:?} does not contain {needle:?}",
                status.message()
            );
        }
    }
}

/// A run's journal, every record `ReadJournal` streams.
pub async fn journal_records(
    client: &mut ConnectorClient<Channel>,
    run_id: &str,
) -> Vec<pb::JournalRecord> {
    let mut stream = client
        .read_journal(pb::ReadJournalRequest {
            run_id: run_id.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut records = Vec::new();
    while let Some(record) = stream.message().await.unwrap() {
        records.push(record);
    }
    records
}

/// A run's journal as `<operation> <resource> <phase>` lines, read through `ReadJournal`.
pub async fn journal_steps(client: &mut ConnectorClient<Channel>, run_id: &str) -> Vec<String> {
    journal_records(client, run_id)
        .await
        .into_iter()
        .map(|record| format!("{} {} {}", record.operation, record.resource, record.phase))
        .collect()
}

/// What `Cleanup` of `run_id` did: each receipt as `<resource> <end state>`, and the residue.
pub async fn cleanup_receipts(
    client: &mut ConnectorClient<Channel>,
    run_id: &str,
) -> (Vec<String>, Vec<String>) {
    let reply = client
        .cleanup(pb::CleanupRequest {
            run_id: run_id.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let receipts = reply
        .resources
        .iter()
        .map(|r| format!("{} {}", r.resource, r.end_state))
        .collect();
    (receipts, reply.residue)
}

/// A call's outcome without its reply, so outcomes of different RPCs compare as one type.
pub fn ok<T>(result: Result<T, tonic::Status>) -> Result<(), tonic::Status> {
    result.map(|_| ())
}
