//! `certistack-ctl runs`, `journal` and `cleanup` against an in-process node, as an operator.

use super::*;
use certistack_controller::operator;

async fn ctl(args: Vec<String>) -> (i32, String, String) {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_binary("certistack-ctl", &args)
    })
    .await
    .unwrap()
}

fn node_args(verb: &str, dir: &TempDir, node: &TestNode) -> Vec<String> {
    vec![
        verb.into(),
        "--state-dir".into(),
        dir.0.join("ctl").to_str().unwrap().into(),
        "--node".into(),
        node.address.clone(),
        "--name".into(),
        NODE.into(),
    ]
}

/// A run begun on the node, and ended when `end` says so (two journal records then); its
/// grant's deadline.
async fn begin_run(
    authority: &certistack_controller::authority::Authority,
    node: &TestNode,
    end: bool,
) -> i64 {
    let wire = grant(RUN_ID, NODE);
    let mut client = begun_run(authority, &node.address, &wire).await;
    if end {
        client.end_run(pb::EndRunRequest {}).await.unwrap();
    }
    wire.deadline_unix
}

#[tokio::test(flavor = "multi_thread")]
async fn ctl_runs_lists_open_runs_with_resources() {
    let (dir, authority, node) = started_node("ctl-runs").await;
    let (code, out, err) = ctl(node_args("runs", &dir, &node)).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "0 run(s)\n");

    let deadline = begin_run(&authority, &node, false).await;
    let (code, out, err) = ctl(node_args("runs", &dir, &node)).await;
    assert_eq!(code, 0, "{err}");
    let deadline = time::OffsetDateTime::from_unix_timestamp(deadline)
        .unwrap()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap();
    assert_eq!(
        out,
        format!("{RUN_ID} open deadline {deadline} open -\n1 run(s)\n")
    );

    // Another node name than the certificate carries: refused as a mismatch.
    let mut args = node_args("runs", &dir, &node);
    args[6] = "pve9".into();
    let (code, _, err) = ctl(args).await;
    assert_eq!(code, 2, "{err}");
}

/// `runs NODE`, `journal NODE RUN` and `cleanup NODE RUN` with NODE from the inventory of
/// `--config`; a name not in it is a usage error naming the known ones, a node that does
/// not answer is an infrastructure failure.
#[tokio::test(flavor = "multi_thread")]
async fn ctl_operator_commands_address_nodes_by_inventory_name() {
    let (dir, _authority, node) = started_node("ctl-inventory").await;
    let down = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().to_string()
    };
    let mut text = format!(
        "state_dir = {:?}\nreports_dir = {:?}\n",
        dir.0.join("ctl"),
        dir.0.join("reports")
    );
    for (name, address) in [(NODE, node.address.as_str()), ("pve3", down.as_str())] {
        let (host, port) = address.rsplit_once(':').unwrap();
        text.push_str(&format!(
            "[[nodes]]\nname = {name:?}\naddress = {host:?}\nport = {port}\n"
        ));
    }
    let config = dir.0.join("controller.toml");
    std::fs::write(&config, text).unwrap();
    let c = config.to_str().unwrap().to_owned();
    let args = |words: &[&str]| {
        let mut args: Vec<String> = words.iter().map(|w| (*w).to_owned()).collect();
        args.extend(["--config".to_owned(), c.clone()]);
        args
    };

    begin_run(&_authority, &node, false).await;
    let (code, out, err) = ctl(args(&["runs", NODE])).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with(&format!("{RUN_ID} open deadline ")),
        "{out}"
    );
    let (code, out, err) = ctl(args(&["journal", NODE, RUN_ID])).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("(1 records, chain verified here)"), "{out}");
    let (code, out, err) = ctl(args(&["cleanup", NODE, RUN_ID])).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.ends_with("complete: no residue\n"), "{out}");

    let (code, _, err) = ctl(args(&["runs", "pve7"])).await;
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("node \"pve7\" is not in the inventory") && err.contains("pve1, pve3"),
        "{err}"
    );
    let (code, _, err) = ctl(args(&["runs"])).await;
    assert_eq!(code, 64, "{err}");
    let (code, _, err) = ctl(args(&["journal", "pve3", RUN_ID])).await;
    assert_eq!(code, 2, "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn ctl_journal_prints_records_and_the_verified_head() {
    let (dir, authority, node) = started_node("ctl-journal").await;
    begin_run(&authority, &node, true).await;
    let mut args = node_args("journal", &dir, &node);
    args.push(RUN_ID.into());
    let (code, out, err) = ctl(args).await;
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("1 20"), "{out}");
    assert!(
        lines[0].contains(&format!(" run.begin run:{RUN_ID} done {{")),
        "{out}"
    );
    assert!(lines[1].starts_with("2 20"), "{out}");

    // The head printed is the one recomputed from the streamed records, and equals the
    // last record's hash.
    let mut client = operator(&authority, &node).await;
    let records = operator::read_journal(&mut client, RUN_ID, |_| {})
        .await
        .unwrap();
    let head = operator::verify_journal(RUN_ID, &records).unwrap();
    assert_eq!(head, records.last().unwrap().record_sha256);
    assert!(
        lines
            .last()
            .unwrap()
            .starts_with(&format!("journal head {head} (")),
        "{out}"
    );
    assert_eq!(lines.len(), records.len() + 1, "{out}");

    // A journal larger than the reader's bounds is refused, not held.
    let all = records.len();
    for bounds in [
        operator::JournalBounds {
            records: all - 1,
            bytes: usize::MAX,
        },
        operator::JournalBounds {
            records: usize::MAX,
            bytes: 64,
        },
    ] {
        let refused = operator::read_journal_within(&mut client, RUN_ID, bounds, |_| {}).await;
        assert!(
            matches!(refused, Err(operator::OperatorError::TooManyRecords(b)) if b == bounds),
            "{refused:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn ctl_journal_detects_a_changed_record() {
    let (_dir, authority, node) = started_node("ctl-journal-tamper").await;
    begin_run(&authority, &node, true).await;
    let mut client = operator(&authority, &node).await;
    let records = operator::read_journal(&mut client, RUN_ID, |_| {})
        .await
        .unwrap();
    operator::verify_journal(RUN_ID, &records).unwrap();
    assert_eq!(records.len(), 2, "{records:?}");

    // One changed field in the second record: the chain breaks there.
    let mut changed = records.clone();
    changed[1].resource.push('x');
    let error = operator::verify_journal(RUN_ID, &changed).unwrap_err();
    assert!(error.contains("record 2 does not verify"), "{error}");

    // A record left out: the next one no longer links.
    let gap = vec![records[1].clone()];
    let error = operator::verify_journal(RUN_ID, &gap).unwrap_err();
    assert!(error.contains("record 1"), "{error}");

    // Another run's id: the chain is bound to the run.
    assert!(operator::verify_journal("aaaaaaaa-3b4a-4c5d-8e6f-7a8b9c0d1e2f", &records).is_err());
}

#[tokio::test(flavor = "multi_thread")]
async fn ctl_cleanup_prints_receipts_and_exits_by_residue() {
    let (dir, authority, node) = started_node("ctl-cleanup").await;
    begin_run(&authority, &node, false).await;
    let mut args = node_args("cleanup", &dir, &node);
    args.push(RUN_ID.into());
    let (code, out, err) = ctl(args).await;
    eprintln!("{out}{err}");
    assert!(
        node.executor.rpcs().contains(&"Cleanup"),
        "{:?}",
        node.executor.rpcs()
    );
    assert!(out.contains("journal head "), "{out}");
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.ends_with(&format!("cleanup of run {RUN_ID} complete: no residue\n")),
        "{out}"
    );
}

/// A run whose journal no longer verifies is set aside at start-up; ListRuns names it
/// quarantined with the reason, and `certistack-ctl runs` and the fleet audit say so.
#[tokio::test(flavor = "multi_thread")]
async fn a_quarantined_run_is_listed_as_such_with_its_reason() {
    let dir = TempDir::new("ctl-quarantine");
    let authority = controller(&dir.0);
    let node = TestNode::start(&authority, &dir.0.join("node"), NODE).await;
    begin_run(&authority, &node, false).await;
    let mut node = node;
    node.stop().await;
    let journal = node
        .config
        .paths
        .state_dir
        .join("runs")
        .join(RUN_ID)
        .join(certistack_core::journal::FILE_NAME);
    let text = std::fs::read_to_string(&journal).unwrap();
    // Record 1 altered, with a record after it: a broken chain, not a torn last record.
    let altered = text.replacen("grant_sha256", "grant_sha257", 1);
    std::fs::write(&journal, format!("{altered}{text}")).unwrap();
    let node = node.restart().await;

    let mut connection = operator(&authority, &node).await;
    let runs = operator::list_runs(&mut connection).await.unwrap();
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0].state, pb::RunState::Quarantined as i32);
    assert!(
        runs[0].quarantine_reason.contains("record 1 is invalid"),
        "{runs:?}"
    );
    assert!(runs[0].open_resources.is_empty(), "{runs:?}");
    assert_eq!(
        operator::describe_run(&runs[0]),
        format!("{RUN_ID} quarantined: {}", runs[0].quarantine_reason)
    );

    let (code, out, err) = ctl(node_args("runs", &dir, &node)).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!("{RUN_ID} quarantined: ")) && out.contains("record 1 is invalid"),
        "{out}"
    );

    let port = node.address.rsplit_once(':').unwrap().1;
    let config = certistack_controller::config::ControllerConfig::parse(
        std::path::Path::new("controller.toml"),
        &format!(
            "state_dir = \"/s\"\nreports_dir = \"/r\"\n[[nodes]]\nname = \"{NODE}\"\naddress = \"127.0.0.1\"\nport = {port}\n"
        ),
    )
    .unwrap();
    let inventory = config.nodes.values().next().unwrap();
    let identity = authority.issue_operator("audit", now()).unwrap();
    let row = certistack_controller::audit::audit_node(
        inventory,
        authority.ca_pem(),
        &identity,
        std::time::Duration::from_secs(10),
    )
    .await;
    let answer = row.answer.as_ref().unwrap();
    assert_eq!(
        (answer.open_runs, answer.quarantined_runs),
        (Some(0), Some(1))
    );
}

#[test]
fn an_open_run_is_described_with_its_deadline_and_resources() {
    let open = pb::RunSummary {
        run_id: RUN_ID.into(),
        state: pb::RunState::Open as i32,
        deadline_unix: 1_796_084_905,
        open_resources: vec!["backup:drive-scsi0.img".into(), "overlay:9100".into()],
        quarantine_reason: String::new(),
    };
    assert_eq!(
        operator::describe_run(&open),
        format!(
            "{RUN_ID} open deadline 2026-12-01T00:28:25Z open backup:drive-scsi0.img,overlay:9100"
        )
    );
}

#[test]
fn a_failed_receipt_is_recognised() {
    use pb::EndState as State;
    let receipt = |end_state: &str, state: State| pb::ResourceReceipt {
        resource: "overlay:9100".into(),
        end_state: end_state.into(),
        state: state as i32,
    };
    // Decided by the typed state alone: the text is for a person.
    for (text, state, failed) in [
        ("failed: qemu-img exited 1", State::Failed, true),
        ("failed: kept while vm 9100 runs", State::Kept, true),
        ("deleted", State::Deleted, false),
        ("already gone", State::AlreadyGone, false),
        ("never created", State::NeverCreated, false),
        ("not this run's, left untouched", State::NotOurs, false),
        ("restored", State::Restored, false),
        ("deleted", State::Unspecified, true),
    ] {
        assert_eq!(
            operator::receipt_failed(&receipt(text, state)),
            failed,
            "{text:?} {state:?}"
        );
    }
    let mut unknown = receipt("deleted", State::Deleted);
    unknown.state = 99;
    assert!(
        operator::receipt_failed(&unknown),
        "an unknown state is no success"
    );

    // The exit status of `cleanup`: complete only with no failed receipt and no residue.
    let reply = |last: pb::ResourceReceipt, residue: &[&str]| pb::CleanupReply {
        resources: vec![receipt("deleted", State::Deleted), last],
        residue: residue.iter().map(|r| (*r).to_owned()).collect(),
        journal_head: String::new(),
    };
    assert_eq!(
        operator::cleanup_complete(&reply(receipt("destroyed", State::Destroyed), &[])),
        Ok(())
    );
    assert_eq!(
        operator::cleanup_complete(&reply(receipt("failed: qm exited 2", State::Failed), &[])),
        Err("1 failed receipt(s), 0 residue".to_owned())
    );
    assert_eq!(
        operator::cleanup_complete(&reply(
            receipt("destroyed", State::Destroyed),
            &["/dev/loop7"]
        )),
        Err("0 failed receipt(s), 1 residue".to_owned())
    );
}
