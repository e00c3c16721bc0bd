//! Requests a run may not make: objects outside its grant, malformed fields, and the shipped
//! executor's precise refusals on a node without the tools.

use super::*;

#[tokio::test]
async fn objects_outside_the_grant_are_refused() {
    let (_dir, authority, node) = started_node("outside").await;
    let mut c = begun_run(&authority, &node.address, &grant(RUN_ID, NODE)).await;
    let pd = Code::PermissionDenied;
    let other_run = "11111111-2222-4333-8444-555555555555";

    let map = |snapshot: &str, archive: &str| pb::MapBackupRequest {
        snapshot: snapshot.into(),
        archive: archive.into(),
        pbs_secret: "s3cret".into(),
        encryption_key: vec![],
    };
    assert_status(
        c.map_backup(map("vm/100/2026-10-01T02:00:00Z", ARCHIVE))
            .await,
        pd,
        "snapshot vm/100/2026-10-01T02:00:00Z is not granted",
    );
    assert_status(
        c.map_backup(map(SNAPSHOT, "drive-scsi1.img")).await,
        pd,
        "archive drive-scsi1.img is not granted",
    );
    assert_status(
        c.unmap_backup(pb::UnmapBackupRequest {
            archive: "drive-scsi1.img".into(),
        })
        .await,
        pd,
        "archive drive-scsi1.img",
    );
    assert_status(
        c.create_overlay(pb::CreateOverlayRequest {
            vmid: 100,
            archive: ARCHIVE.into(),
        })
        .await,
        pd,
        "VMID 100 is not granted",
    );
    assert_status(
        c.delete_overlay(pb::DeleteOverlayRequest {
            vmid: VMID,
            archive: "drive-efidisk0.img".into(),
        })
        .await,
        pd,
        "archive drive-efidisk0.img",
    );
    assert_status(
        c.create_vm(pb::CreateVmRequest {
            vmid: 101,
            cores: 1,
            memory_mib: 512,
            archives: vec![ARCHIVE.into()],
            mirror_source_hardware: false,
        })
        .await,
        pd,
        "VMID 101",
    );
    assert_status(
        c.create_vm(pb::CreateVmRequest {
            vmid: VMID,
            cores: 8,
            memory_mib: 512,
            archives: vec![ARCHIVE.into()],
            mirror_source_hardware: false,
        })
        .await,
        pd,
        "8 cores for VM 9100",
    );
    assert_status(
        c.create_vm(pb::CreateVmRequest {
            vmid: VMID,
            cores: 1,
            memory_mib: 65536,
            archives: vec![ARCHIVE.into()],
            mirror_source_hardware: false,
        })
        .await,
        pd,
        "65536 MiB for VM 9100",
    );
    assert_status(
        c.start_vm(pb::VmRequest { vmid: 102 }).await,
        pd,
        "VMID 102 is not granted",
    );
    assert_status(
        c.stop_vm(pb::StopVmRequest {
            vmid: 103,
            timeout_seconds: 0,
        })
        .await,
        pd,
        "VMID 103",
    );
    assert_status(
        c.destroy_vm(pb::VmRequest { vmid: 104 }).await,
        pd,
        "VMID 104",
    );
    assert_status(
        c.vm_status(pb::VmRequest { vmid: 105 }).await,
        pd,
        "VMID 105",
    );
    assert_status(
        c.qmp(pb::QmpRequest {
            vmid: 106,
            command: pb::QmpCommand::QueryStatus as i32,
        })
        .await,
        pd,
        "VMID 106",
    );
    assert_status(
        c.qga(pb::QgaRequest {
            vmid: 107,
            call: Some(pb::qga_request::Call::Command(1)),
        })
        .await,
        pd,
        "VMID 107",
    );
    assert_status(
        c.qga(pb::QgaRequest {
            vmid: VMID,
            call: Some(pb::qga_request::Call::AssertionId("wipe-disk".into())),
        })
        .await,
        pd,
        "QGA assertion wipe-disk",
    );
    assert_status(
        c.prepare_sandbox(pb::PrepareSandboxRequest {
            vnet: "vmbr0".into(),
            probe_source: PROBE_SOURCE.into(),
        })
        .await,
        pd,
        "VNet vmbr0 is not granted",
    );
    assert_status(
        c.prepare_sandbox(pb::PrepareSandboxRequest {
            vnet: VNET.into(),
            probe_source: "198.51.100.3/24".into(),
        })
        .await,
        pd,
        "probe source 198.51.100.3/24",
    );
    assert_status(
        c.release_sandbox(pb::ReleaseSandboxRequest {
            vnet: "vmbr0".into(),
        })
        .await,
        pd,
        "VNet vmbr0",
    );
    assert_status(
        c.probe(pb::ProbeRequest {
            kind: pb::ProbeKind::Tcp as i32,
            address: "192.0.2.1".into(),
            port: 22,
        })
        .await,
        pd,
        "tcp probe of 192.0.2.1:22",
    );
    assert_status(
        c.probe(pb::ProbeRequest {
            kind: pb::ProbeKind::Http as i32,
            address: TARGET.into(),
            port: 22,
        })
        .await,
        pd,
        "http probe of 198.51.100.10:22",
    );
    assert_status(
        c.read_journal(pb::ReadJournalRequest {
            run_id: other_run.into(),
        })
        .await,
        pd,
        "run 11111111-2222-4333-8444-555555555555",
    );
    assert_status(
        c.cleanup(pb::CleanupRequest {
            run_id: other_run.into(),
        })
        .await,
        pd,
        "rule own-run-or-operator",
    );
    assert_eq!(node.executor.count(), 0);
}

/// MapBackup requests whose fields fail their validators: the case, the snapshot, archive and
/// PBS secret sent, and what the INVALID_ARGUMENT message must contain.
const MALFORMED_MAP_REQUESTS: &[(&str, &str, &str, &str, &str)] = &[
    (
        "snapshot without a time",
        "vm/100",
        ARCHIVE,
        "pw",
        "field `MapBackupRequest.snapshot` is invalid (snapshot)",
    ),
    (
        "snapshot on a day that does not exist",
        "vm/100/2026-02-30T00:00:00Z",
        ARCHIVE,
        "pw",
        "MapBackupRequest.snapshot",
    ),
    (
        "archive climbing out of the snapshot",
        SNAPSHOT,
        "../../etc/shadow.img",
        "pw",
        "field `MapBackupRequest.archive` is invalid",
    ),
    (
        "empty PBS secret",
        SNAPSHOT,
        ARCHIVE,
        "",
        "MapBackupRequest.pbs_secret",
    ),
];

#[tokio::test]
async fn malformed_requests_are_invalid_arguments() {
    let (_dir, authority, node) = started_node("malformed").await;
    let mut c = begun_run(&authority, &node.address, &grant(RUN_ID, NODE)).await;
    let ia = Code::InvalidArgument;
    let map = |snapshot: &str, archive: &str, secret: &str| pb::MapBackupRequest {
        snapshot: snapshot.into(),
        archive: archive.into(),
        pbs_secret: secret.into(),
        encryption_key: vec![],
    };
    for (case, snapshot, archive, secret, needle) in MALFORMED_MAP_REQUESTS {
        assert_case_status(
            case,
            c.map_backup(map(snapshot, archive, secret)).await,
            ia,
            needle,
        );
    }
    let err = c
        .map_backup(map(SNAPSHOT, ARCHIVE, "pass\nword"))
        .await
        .unwrap_err();
    assert!(
        !err.message().contains("pass"),
        "the secret leaked into the error: {}",
        err.message()
    );
    assert_status(
        c.unmap_backup(pb::UnmapBackupRequest {
            archive: "drive/../x.img".into(),
        })
        .await,
        ia,
        "UnmapBackupRequest.archive",
    );
    assert_status(
        c.start_vm(pb::VmRequest { vmid: 0 }).await,
        ia,
        "field `VmRequest.vmid` is invalid (vmid): VMID 0",
    );
    assert_status(
        c.create_overlay(pb::CreateOverlayRequest {
            vmid: 0,
            archive: ARCHIVE.into(),
        })
        .await,
        ia,
        "VMID 0",
    );
    assert_status(
        c.qmp(pb::QmpRequest {
            vmid: VMID,
            command: 0,
        })
        .await,
        ia,
        "QmpRequest.command",
    );
    assert_status(
        c.qga(pb::QgaRequest {
            vmid: VMID,
            call: None,
        })
        .await,
        ia,
        "QgaRequest.call",
    );
    assert_status(
        c.prepare_sandbox(pb::PrepareSandboxRequest {
            vnet: "../x".into(),
            probe_source: PROBE_SOURCE.into(),
        })
        .await,
        ia,
        "PrepareSandboxRequest.vnet",
    );
    assert_status(
        c.probe(pb::ProbeRequest {
            kind: 1,
            address: "127.0.0.1".into(),
            port: 22,
        })
        .await,
        ia,
        "ProbeRequest.address",
    );
    assert_status(
        c.read_journal(pb::ReadJournalRequest {
            run_id: "../../etc".into(),
        })
        .await,
        ia,
        "ReadJournalRequest.run_id",
    );

    // A message over the configured 64 KiB request limit is refused before it is decoded.
    let oversized = pb::MapBackupRequest {
        snapshot: SNAPSHOT.into(),
        archive: ARCHIVE.into(),
        pbs_secret: "pw".into(),
        encryption_key: vec![7; 100 * 1024],
    };
    let status = c.map_backup(oversized).await.unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{}", status.message());
    assert!(
        status.message().contains("message length too large"),
        "{}",
        status.message()
    );
    assert_eq!(node.executor.count(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_shipped_executor_refuses_precisely_on_a_node_without_the_tools() {
    let (dir, authority, mut config) = enrolled_node("shipped");
    // A node without proxmox-backup-client installed.
    config.tools.proxmox_backup_client = dir.0.join("absent/proxmox-backup-client");
    let connector = certistack_connector::server::Connector::for_node(config).unwrap();
    let listener = connector.bind().await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(connector.serve(listener, async {
        let _ = rx.await;
    }));
    let credentials = mint(&authority, &grant(RUN_ID, NODE));
    let mut c = client(&authority, &address, NODE, &credentials.certificate)
        .await
        .unwrap();
    let hello = c.hello(pb::HelloRequest {}).await.unwrap().into_inner();
    assert_eq!(
        hello.capabilities,
        [
            "run.lifecycle",
            "backup.map",
            "backup.unmap",
            "overlay.create",
            "overlay.delete",
            "vm.create",
            "vm.start",
            "vm.stop",
            "vm.destroy",
            "vm.status",
            "guest.qmp",
            "guest.qga",
            "sandbox.prepare",
            "sandbox.release",
            "sandbox.probe",
            "journal.read",
            "recovery.cleanup",
            "source.config",
            "guest.network"
        ]
    );
    c.begin_run(begin_request(&credentials)).await.unwrap();
    let results = call_every_operation(&mut c).await;
    for (result, rpc) in results.into_iter().zip(EVERY_OPERATION) {
        let (code, needle) = match rpc {
            "MapBackup" | "ReadSourceConfig" => (
                Code::Internal,
                "check the tool path in the connector config",
            ),
            "CreateOverlay" => (Code::FailedPrecondition, "not mapped by this run"),
            "CreateVm" => (
                Code::FailedPrecondition,
                "VM 9100 has no overlay of drive-scsi0.img",
            ),
            "StartVm" | "StopVm" | "DestroyVm" | "VmStatus" | "Qmp" | "Qga" => (
                Code::FailedPrecondition,
                "VM 9100 was not created by this run",
            ),
            "PrepareSandbox" => (
                Code::FailedPrecondition,
                "bridge csbox1 does not exist on this node",
            ),
            "ReleaseSandbox" => (Code::NotFound, "this run has no sandbox on csbox1"),
            "Probe" => (Code::FailedPrecondition, "call PrepareSandbox first"),
            // The client never started: nothing was mapped, and the journal says so.
            "UnmapBackup" => (
                Code::FailedPrecondition,
                "drive-scsi0.img is not mapped by this run",
            ),
            "DeleteOverlay" => (Code::NotFound, "has no overlay"),
            "RecoverGuestNetwork" => (
                Code::FailedPrecondition,
                "this run has no overlay of drive-scsi0.img for VM 9100",
            ),
            "ReadJournal" | "Cleanup" => {
                result.unwrap();
                continue;
            }
            other => panic!("unexpected {other}"),
        };
        assert_status(result, code, needle);
    }
    // The failed map is journaled: intent, then failed with the reason, then closed.
    let steps = journal_steps(&mut c, RUN_ID).await;
    assert_eq!(
        &steps[..4],
        [
            "run.begin run:0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f done",
            "backup.map backup:drive-scsi0.img intent",
            "backup.map backup:drive-scsi0.img failed",
            "backup.map backup:drive-scsi0.img undone"
        ]
    );
    c.end_run(pb::EndRunRequest {}).await.unwrap();
    tx.send(()).unwrap();
    task.await.unwrap().unwrap();
}
