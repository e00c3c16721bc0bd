//! Calls the grant and the identity allow: a run's own operations, and the operator's `Hello`,
//! `ListRuns`, `ReadJournal` and `Cleanup`.

use super::*;

#[tokio::test]
async fn matching_run_calls_its_own_operations() {
    let (_dir, authority, node) = started_node("accept").await;
    let credentials = mint(&authority, &grant(RUN_ID, NODE));
    let mut client = run_client(&authority, &node, &credentials).await;

    let hello = client
        .hello(pb::HelloRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(hello.peer_identity, format!("run:{RUN_ID}"));
    let begun = client
        .begin_run(begin_request(&credentials))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((begun.run_id.as_str(), begun.resumed), (RUN_ID, false));
    let again = client
        .begin_run(begin_request(&credentials))
        .await
        .unwrap()
        .into_inner();
    assert!(again.resumed, "the same grant resumes the open run");

    for result in call_every_operation(&mut client).await {
        result.unwrap();
    }
    // ReadJournal is answered from the journal file, not by the executor.
    let executed: Vec<&str> = EVERY_OPERATION
        .into_iter()
        .filter(|rpc| *rpc != "ReadJournal")
        .collect();
    assert_eq!(node.executor.rpcs(), executed);

    let journal: Vec<pb::JournalRecord> = {
        let mut stream = client
            .read_journal(pb::ReadJournalRequest {
                run_id: RUN_ID.into(),
            })
            .await
            .unwrap()
            .into_inner();
        let mut records = Vec::new();
        while let Some(record) = stream.message().await.unwrap() {
            records.push(record);
        }
        records
    };
    assert_eq!(journal.len(), 1, "the recording executor journals nothing");
    assert_eq!(
        (journal[0].operation.as_str(), journal[0].sequence),
        ("run.begin", 1)
    );
    client.end_run(pb::EndRunRequest {}).await.unwrap();
}

#[tokio::test]
async fn operator_reaches_hello_list_journal_and_cleanup() {
    let (_dir, authority, node) = started_node("operator").await;
    let credentials = mint(&authority, &grant(RUN_ID, NODE));
    run_client(&authority, &node, &credentials)
        .await
        .begin_run(begin_request(&credentials))
        .await
        .unwrap();

    let mut operator = operator(&authority, &node).await;
    let hello = operator
        .hello(pb::HelloRequest {})
        .await
        .unwrap()
        .into_inner();
    check_hello(&hello, NODE).unwrap();
    assert_eq!(hello.peer_identity, "operator:alice");
    assert_eq!(hello.capabilities, ["run.lifecycle", "test.recording"]);
    let runs = operator
        .list_runs(pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .runs;
    assert_eq!(runs.len(), 1);
    assert_eq!(
        (runs[0].run_id.as_str(), runs[0].state),
        (RUN_ID, pb::RunState::Open as i32)
    );
    operator
        .read_journal(pb::ReadJournalRequest {
            run_id: RUN_ID.into(),
        })
        .await
        .unwrap();
    operator
        .cleanup(pb::CleanupRequest {
            run_id: RUN_ID.into(),
        })
        .await
        .unwrap();
    assert_eq!(node.executor.rpcs(), ["Cleanup"]);
}
