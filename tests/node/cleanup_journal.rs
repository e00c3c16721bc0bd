//! Cleanup's journal: a repeated finding is journaled once, and repeated stops cannot spend the
//! reserve cleanup needs.

use super::*;

/// Cleanup retried on a run that has nothing left (as the expiry reaper retries a run) does
/// not journal the same finding again: the journal records changes, not a heartbeat.
#[tokio::test(flavor = "multi_thread")]
async fn a_repeated_cleanup_finding_is_journaled_once() {
    if !privileged(
        "a_repeated_cleanup_finding_is_journaled_once",
        &["losetup", "python3"],
    ) {
        return;
    }
    let mut run = Run::begin("cleanup-once", &[ARCHIVE]).await;
    run.client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap();
    for _ in 0..4 {
        let (_, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
    }
    let cleanups: Vec<String> = run
        .journal()
        .await
        .into_iter()
        .filter(|step| step.starts_with("run.cleanup"))
        .collect();
    // The first undid the mapping; the second found nothing; the third and fourth found the
    // same nothing.
    assert_eq!(cleanups.len(), 2, "{cleanups:?}");
    run.stop().await;
}

/// StopVm is admitted into the journal's cleanup reserve, so a run's own certificate can spend
/// that reserve on repeated stops; the VM, its overlay and its mapping must still be removable.
#[tokio::test(flavor = "multi_thread")]
async fn repeated_stops_cannot_spend_the_reserve_cleanup_needs() {
    if !privileged(
        "repeated_stops_cannot_spend_the_reserve_cleanup_needs",
        &["losetup", "python3", "qemu-img"],
    ) {
        return;
    }
    let serial = SERIAL.lock().await;
    let lab = Lab::new("stop-flood");
    lab.add_backup(SNAPSHOT, ARCHIVE, MARKER, 8 << 20);
    let (authority_dir, authority, mut config) = lab.controller_and_node_config("stop-flood-ctl");
    config.limits.max_journal_records = 1000;
    let (address, shutdown, task) = serve_node(config).await;
    let mut wire = grant(RUN_ID, NODE);
    wire.archives = vec![ARCHIVE.into()];
    sandbox_grant(&mut wire);
    let client = begun_run(&authority, &address, &wire).await;
    let mut run = Run {
        lab,
        client,
        address,
        shutdown: Some(shutdown),
        task: Some(task),
        _authority_dir: authority_dir,
        _serial: serial,
    };
    run.client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap();
    run.client
        .create_overlay(pb::CreateOverlayRequest {
            vmid: 9100,
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
    run.client
        .create_vm(pb::CreateVmRequest {
            vmid: 9100,
            cores: 1,
            memory_mib: 256,
            archives: vec![ARCHIVE.into()],
            mirror_source_hardware: false,
        })
        .await
        .unwrap();
    let mut refused = None;
    for _ in 0..400 {
        if let Err(status) = run
            .client
            .stop_vm(pb::StopVmRequest {
                vmid: 9100,
                timeout_seconds: 0,
            })
            .await
        {
            refused = Some(status);
            break;
        }
    }
    let refused = refused.expect("repeated StopVm was never refused");
    eprintln!("StopVm refused: {refused:?}");
    // What the run holds must still come off the node.
    run.end().await;
}
