//! A step runs to its end when its caller goes away, and one run's wait does not block another.

use super::*;

#[tokio::test(flavor = "multi_thread")]
async fn a_step_runs_to_its_end_when_its_caller_goes_away() {
    if !privileged(
        "a_step_runs_to_its_end_when_its_caller_goes_away",
        &["losetup", "python3", "qemu-img"],
    ) {
        return;
    }
    let mut run = Run::begin_with(
        "cut",
        &[ARCHIVE],
        |lab| lab.settings(serde_json::json!({ "delays": { "map": 2.0 } })),
        sandbox_grant,
    )
    .await;
    // The caller gives up after 250 ms; the holder attaches the device about 2 s later.
    assert_cut(
        run.client
            .map_backup(cut(map_request(ARCHIVE, PBS_PASSWORD), 250))
            .await,
    );
    assert!(run.loops().is_empty(), "not attached yet");
    // Cleanup waits for the step, which journals the device it mapped, and unmaps it.
    let started = std::time::Instant::now();
    let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
    assert_eq!(receipts, ["backup:drive-scsi0.img unmapped"]);
    assert!(residue.is_empty(), "{residue:?}");
    assert!(started.elapsed() > std::time::Duration::from_secs(1));
    // Nothing lands after cleanup said it was gone.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert!(run.loops().is_empty(), "{:?}", run.loops());

    // A step retried after a cut finds the recorded outcome.
    assert_cut(
        run.client
            .map_backup(cut(map_request(ARCHIVE, PBS_PASSWORD), 250))
            .await,
    );
    assert_status(
        run.client
            .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
            .await,
        Code::AlreadyExists,
        "already mapped by this run (last step: backup.map done)",
    );
    assert_eq!(run.loops().len(), 1);
    run.client
        .unmap_backup(pb::UnmapBackupRequest {
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
    assert!(run.loops().is_empty());

    // CreateVm cut short: the VM is still created and recorded; StartVm-ready, destroyable.
    run.lab
        .settings(serde_json::json!({ "delays": { "create": 1.5 } }));
    map_and_overlay(&mut run.client, 9100).await;
    let create = || pb::CreateVmRequest {
        vmid: 9100,
        cores: 1,
        memory_mib: 256,
        archives: vec![ARCHIVE.into()],
        mirror_source_hardware: false,
    };
    assert_cut(run.client.create_vm(cut(create(), 250)).await);
    assert_status(
        run.client.create_vm(create()).await,
        Code::AlreadyExists,
        "this run already created VM 9100",
    );
    assert!(run.lab.root.join("etc/pve/qemu-server/9100.conf").exists());
    let destroyed = run
        .client
        .destroy_vm(pb::VmRequest { vmid: 9100 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(destroyed.state, pb::VmState::Absent as i32);
    // Asked again after DestroyVm, the VM is gone, not "not this run's".
    let status = run
        .client
        .vm_status(pb::VmRequest { vmid: 9100 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.state, pb::VmState::Absent as i32);
    assert_status(
        run.client.start_vm(pb::VmRequest { vmid: 9100 }).await,
        Code::NotFound,
        "VM 9100 was destroyed by this run",
    );
    run.end().await;
}
#[test]
fn one_runs_wait_does_not_block_another_run() {
    if !privileged("one_runs_wait_does_not_block_another_run", QEMU_TOOLS) {
        return;
    }
    let netns = Netns::new("vm", &["csbox1", "csbox91", "csbox92"]);
    inside(&netns.name, || async {
        let _serial = SERIAL.lock().await;
        let lab = Lab::new("concurrent");
        lab.add_backup(SNAPSHOT, ARCHIVE, MARKER, 8 << 20);
        lab.add_backup(SNAPSHOT, "drive-scsi1.img", MARKER, 8 << 20);
        lab.settings(serde_json::json!({ "agent_mode": "qemu-chardev" }));
        let (_authority_dir, authority, mut config) =
            lab.controller_and_node_config("concurrent-ctl");
        config.limits.guest_timeout_secs = 4;
        let (address, shutdown, task) = serve_node(config).await;

        let begin = |run_id: &str, archive: &str, vmid: u32| {
            let mut wire = grant(run_id, NODE);
            wire.archives = vec![archive.to_owned()];
            wire.sandbox_vms = vec![pb::SandboxVm {
                vmid,
                max_cores: 1,
                max_memory_mib: 256,
            }];
            wire.vnet = format!("csbox{}", vmid / 100);
            mint(&authority, &wire)
        };
        let run_a = begin(RUN_ID, ARCHIVE, 9100);
        let run_b = begin(
            "11111111-2222-4333-8444-555555555555",
            "drive-scsi1.img",
            9200,
        );
        let mut a = client(&authority, &address, NODE, &run_a.certificate)
            .await
            .unwrap();
        let mut b = client(&authority, &address, NODE, &run_b.certificate)
            .await
            .unwrap();
        a.begin_run(begin_request(&run_a)).await.unwrap();
        b.begin_run(begin_request(&run_b)).await.unwrap();

        map_overlay_and_vm(&mut a, 9100).await;
        a.prepare_sandbox(pb::PrepareSandboxRequest {
            vnet: "csbox91".into(),
            probe_source: PROBE_SOURCE.into(),
        })
        .await
        .unwrap();
        a.start_vm(pb::VmRequest { vmid: 9100 }).await.unwrap();
        // Run A holds its run lock while its agent call waits for an answer that never comes.
        let mut waiting = a.clone();
        let waiter = tokio::spawn(async move {
            waiting
                .qga(pb::QgaRequest {
                    vmid: 9100,
                    call: Some(pb::qga_request::Call::Command(pb::QgaCommand::Ping as i32)),
                })
                .await
        });
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;

        let started = std::time::Instant::now();
        let mut request = map_request("drive-scsi1.img", PBS_PASSWORD);
        request.snapshot = SNAPSHOT.into();
        b.map_backup(request).await.unwrap();
        b.create_overlay(pb::CreateOverlayRequest {
            vmid: 9200,
            archive: "drive-scsi1.img".into(),
        })
        .await
        .unwrap();
        b.cleanup(pb::CleanupRequest {
            run_id: "11111111-2222-4333-8444-555555555555".into(),
        })
        .await
        .unwrap();
        let b_took = started.elapsed();
        assert!(
            !waiter.is_finished(),
            "run A's call should still be waiting"
        );
        assert!(
            b_took < std::time::Duration::from_secs(3),
            "run B waited for run A: {b_took:?}"
        );

        let status = waiter.await.unwrap().unwrap_err();
        assert_eq!(status.code(), Code::DeadlineExceeded);
        let reply = a
            .cleanup(pb::CleanupRequest {
                run_id: RUN_ID.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(reply.residue.is_empty(), "{:?}", reply.residue);
        a.end_run(pb::EndRunRequest {}).await.unwrap();
        b.end_run(pb::EndRunRequest {}).await.unwrap();
        assert!(loops_under(&lab.root).is_empty());
        let _ = shutdown.send(());
        task.await.unwrap();
        eprintln!(
            "run B's map + overlay + cleanup took {b_took:?} while run A waited on its agent"
        );
    });
}
