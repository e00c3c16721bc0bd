//! Sandbox VMs under real QEMU: the lifecycle with QMP and a real guest agent, screendumps over
//! the limit, a silent agent as a deadline, VMs the run did not create never touched, a VM that
//! cannot be destroyed keeping what is beneath it, and no boot without a prepared sandbox.

use super::*;

/// A screendump over `limits.max_screendump_bytes` is removed, journaled and refused with
/// RESOURCE_EXHAUSTED; the run still cleans up to nothing.
#[test]
fn an_oversized_screendump_is_removed_and_refused() {
    if !privileged("an_oversized_screendump_is_removed_and_refused", QEMU_TOOLS) {
        return;
    }
    let netns = Netns::new("shot", &["csbox1", "csbox91", "csbox92"]);
    inside(&netns.name, || async {
        let mut run = Run::begin_configured(
            "shot",
            &[ARCHIVE],
            |_| {},
            sandbox_grant,
            |limits| limits.max_screendump_bytes = 1024,
        )
        .await;
        run.sandbox_vm(9100).await;
        run.client
            .start_vm(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap();
        // A screen the guest has not drawn on yet (its firmware not started, on a loaded
        // machine) is a blank 720x400 PNG under the limit's 1024-byte floor: ask again until
        // the firmware's text makes it larger, as it does within a second or two of the start.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let refused = loop {
            let answer = run
                .client
                .qmp(pb::QmpRequest {
                    vmid: 9100,
                    command: pb::QmpCommand::Screendump as i32,
                })
                .await;
            match answer {
                Ok(small) if std::time::Instant::now() < deadline => {
                    assert!(small.get_ref().image.len() <= 1024, "kept a larger image");
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                }
                answer => break answer,
            }
        };
        assert_status(
            refused,
            Code::ResourceExhausted,
            "larger than 1024 bytes (limits.max_screendump_bytes); it was removed",
        );
        let screen = run
            .lab
            .root
            .join(format!("overlays/{RUN_ID}/9100-screen.png"));
        assert!(!screen.exists(), "the oversized screendump is gone");
        let journal = run.journal().await;
        for step in [
            "file.screendump file:screendump:9100 failed",
            "file.delete file:screendump:9100 undone",
        ] {
            assert!(
                journal.iter().any(|s| s == step),
                "{step} not in {journal:?}"
            );
        }
        run.end().await;
    });
}

/// Runs one QMP command on `socket` as another QMP client of the node would.
fn qmp_exchange(socket: &std::path::Path, command: &str) {
    use std::io::{BufRead, Write};
    let stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.contains("QMP"), "{line}");
    for execute in ["qmp_capabilities", command] {
        writeln!(writer, "{{\"execute\":\"{execute}\"}}").unwrap();
        loop {
            line.clear();
            reader.read_line(&mut line).unwrap();
            if !line.contains("\"event\"") {
                break;
            }
        }
        assert!(line.contains("\"return\""), "{execute}: {line}");
    }
}

#[test]
fn vm_lifecycle_with_qmp_and_a_real_guest_agent() {
    if !privileged("vm_lifecycle_with_qmp_and_a_real_guest_agent", QEMU_TOOLS) {
        return;
    }
    let netns = Netns::new("vm", &["csbox1", "csbox91", "csbox92"]);
    inside(&netns.name, || async {
        let mut run = Run::begin_with(
            "vm",
            &[ARCHIVE],
            |lab| {
                // The host's qemu-ga answers on the VM's agent socket; it may run exactly the
                // harmless granted program and the read-only calls.
                lab.settings(serde_json::json!({
                    "agent_mode": "host-qemu-ga",
                    "qga_allow_rpcs": ["guest-sync-delimited", "guest-ping", "guest-info", "guest-get-osinfo",
                        "guest-get-host-name", "guest-network-get-interfaces", "guest-get-fsinfo", "guest-exec", "guest-exec-status"],
                }))
            },
            sandbox_grant,
        )
        .await;
        let uuid = run.sandbox_vm(9100).await;

        // The sandbox shape: overlay as qcow2 without backup, empty CD-ROM, agent, isolated NIC,
        // fresh SMBIOS UUID, run marker.
        let conf = run.conf(9100);
        for line in [
            "#certistack-run=0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f",
            "agent: 1",
            "tags: certistack",
            "ide2: none,media=cdrom",
            "cores: 1",
            "cpuunits: 10",
            "memory: 256",
            &format!("smbios1: uuid={uuid}"),
        ] {
            assert!(
                conf.lines().any(|l| l == line),
                "{line:?} missing from\n{conf}"
            );
        }
        let scsi0 = conf.lines().find(|l| l.starts_with("scsi0: ")).unwrap();
        assert!(
            scsi0.contains(&format!("/overlays/{RUN_ID}/9100-drive-scsi0.qcow2,")),
            "{scsi0}"
        );
        for option in ["format=qcow2", "backup=0"] {
            assert!(
                scsi0.split(',').any(|o| o == option),
                "{option} missing: {scsi0}"
            );
        }
        assert!(conf.contains("bridge=csbox1,firewall=0"), "{conf}");

        let started = run
            .client
            .start_vm(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(started.state, pb::VmState::Running as i32);
        assert!(run.qemu_running(9100));
        let status = run
            .client
            .vm_status(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(status.state, pb::VmState::Running as i32);
        assert_eq!(status.qmp_status, "running");

        // qm status prints QEMU's own run state: a guest paused through QMP is reported paused,
        // and one QEMU stopped on an I/O error (set in the double: a disk error cannot be
        // provoked here) is reported as a guest error, which is evidence.
        let qmp_socket = run.lab.root.join("var/run/qemu-server/9100.qmp");
        qmp_exchange(&qmp_socket, "stop");
        let paused = run
            .client
            .vm_status(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(paused.state, pb::VmState::Paused as i32, "{paused:?}");
        assert_eq!(paused.qmp_status, "paused");
        qmp_exchange(&qmp_socket, "cont");
        run.lab
            .settings(serde_json::json!({ "qmp_status": { "9100": "io-error" } }));
        let failed = run
            .client
            .vm_status(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(failed.state, pb::VmState::GuestError as i32, "{failed:?}");
        assert_eq!(failed.qmp_status, "io-error");
        run.lab.settings(serde_json::json!({ "qmp_status": {} }));

        let qmp = |command: pb::QmpCommand| pb::QmpRequest {
            vmid: 9100,
            command: command as i32,
        };
        let reply = run
            .client
            .qmp(qmp(pb::QmpCommand::QueryStatus))
            .await
            .unwrap()
            .into_inner();
        let value: serde_json::Value = serde_json::from_str(&reply.result_json).unwrap();
        assert_eq!(value["status"], "running", "{value}");
        let reply = run
            .client
            .qmp(qmp(pb::QmpCommand::QueryBlock))
            .await
            .unwrap()
            .into_inner();
        assert!(
            reply.result_json.contains("9100-drive-scsi0.qcow2"),
            "the VM runs on the overlay: {}",
            reply.result_json
        );
        // A link planted where the screendump goes is removed, never written through.
        let screen = run
            .lab
            .root
            .join(format!("overlays/{RUN_ID}/9100-screen.png"));
        let victim = run.lab.root.join("screen-victim");
        std::os::unix::fs::symlink(&victim, &screen).unwrap();
        let reply = run
            .client
            .qmp(qmp(pb::QmpCommand::Screendump))
            .await
            .unwrap()
            .into_inner();
        assert!(screen.is_file() && !screen.is_symlink());
        assert!(!victim.exists(), "nothing was written through the link");
        // The reply carries the picture QEMU wrote: a PNG of the console, checked as the
        // controller checks it before it goes beside a report.
        assert_eq!(reply.image_format, "png");
        assert_eq!(reply.image, std::fs::read(&screen).unwrap());
        let shot = certistack_controller::screenshot::screenshot_png(&reply).unwrap();
        assert!(
            shot.width >= 320 && shot.height >= 200,
            "{}x{}",
            shot.width,
            shot.height
        );
        let journal = run.journal().await;
        assert!(
            journal
                .iter()
                .any(|step| step.contains("file.screendump") && step.contains("done")),
            "{journal:?}"
        );

        let qga = |command: pb::QgaCommand| pb::QgaRequest {
            vmid: 9100,
            call: Some(pb::qga_request::Call::Command(command as i32)),
        };
        let reply = run
            .client
            .qga(qga(pb::QgaCommand::Ping))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(reply.result_json, "{}");
        let reply = run
            .client
            .qga(qga(pb::QgaCommand::GetHostName))
            .await
            .unwrap()
            .into_inner();
        assert!(
            reply.result_json.contains("host-name"),
            "{}",
            reply.result_json
        );
        let reply = run
            .client
            .qga(pb::QgaRequest {
                vmid: 9100,
                call: Some(pb::qga_request::Call::AssertionId("restored-echo".into())),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(reply.assertion_passed, "{reply:?}");
        assert_eq!(reply.exit_code, 0);
        assert!(
            reply.result_json.contains("restored ok"),
            "{}",
            reply.result_json
        );

        // While an assertion runs, the agent socket is free between polls: another client (PVE's
        // own agent calls) connects and gets its answer within one poll, not after the program.
        let mut asserting = run.client.clone();
        let slow = tokio::spawn(async move {
            asserting
                .qga(pb::QgaRequest {
                    vmid: 9100,
                    call: Some(pb::qga_request::Call::AssertionId("slow-check".into())),
                })
                .await
        });
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        let qga_socket = run.lab.root.join("var/run/qemu-server/9100.qga");
        let asked = std::time::Instant::now();
        let answered = tokio::task::spawn_blocking(move || {
            agent_answers(&qga_socket, std::time::Duration::from_secs(2))
        })
        .await
        .unwrap();
        let waited = asked.elapsed();
        assert!(
            answered,
            "another agent client got no answer while the assertion ran ({waited:?})"
        );
        assert!(!slow.is_finished(), "the assertion ended before the check");
        let reply = slow.await.unwrap().unwrap().into_inner();
        assert!(reply.assertion_passed, "{reply:?}");

        let stopped = run
            .client
            .stop_vm(pb::StopVmRequest {
                vmid: 9100,
                timeout_seconds: 10,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(stopped.state, pb::VmState::Stopped as i32);
        assert!(!run.qemu_running(9100));
        // The overlay cannot go while its VM exists.
        assert_status(
            run.client
                .delete_overlay(pb::DeleteOverlayRequest {
                    vmid: 9100,
                    archive: ARCHIVE.into(),
                })
                .await,
            Code::FailedPrecondition,
            "still uses",
        );
        let destroyed = run
            .client
            .destroy_vm(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(destroyed.state, pb::VmState::Absent as i32);
        assert!(!run.lab.root.join("etc/pve/qemu-server/9100.conf").exists());
        run.stop().await;
    });
}

#[tokio::test(flavor = "multi_thread")]
async fn vms_the_run_did_not_create_are_never_touched() {
    if !privileged("vms_the_run_did_not_create_are_never_touched", QEMU_TOOLS) {
        return;
    }
    let mut run = Run::begin_with("notours", &[ARCHIVE], |_| {}, sandbox_grant).await;
    // A production VM already uses VMID 9101 (granted by mistake), and 9102 too.
    for vmid in ["9101", "9102"] {
        let out = run.lab.qm(&[
            "create",
            vmid,
            "--name",
            "production",
            "--memory",
            "256",
            "--tags",
            "prod",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let before = run.conf(9101);
    map_and_overlay(&mut run.client, 9101).await;
    assert_status(
        run.client
            .create_vm(pb::CreateVmRequest {
                vmid: 9101,
                cores: 1,
                memory_mib: 256,
                archives: vec![ARCHIVE.into()],
                mirror_source_hardware: false,
            })
            .await,
        Code::AlreadyExists,
        "VM 9101 already exists on this node and is not this run's",
    );
    assert_eq!(
        run.conf(9101),
        before,
        "the existing VM's config is untouched"
    );
    for result in [
        ok(run.client.start_vm(pb::VmRequest { vmid: 9102 }).await),
        ok(run
            .client
            .stop_vm(pb::StopVmRequest {
                vmid: 9102,
                timeout_seconds: 0,
            })
            .await),
        ok(run.client.destroy_vm(pb::VmRequest { vmid: 9102 }).await),
        ok(run
            .client
            .qmp(pb::QmpRequest {
                vmid: 9102,
                command: pb::QmpCommand::QueryStatus as i32,
            })
            .await),
    ] {
        assert_status(
            result,
            Code::FailedPrecondition,
            "VM 9102 was not created by this run",
        );
    }

    // A VM this run created whose marker was removed by someone else is left alone too.
    overlay_and_vm(&mut run.client, 9100).await;
    let conf_path = run.lab.root.join("etc/pve/qemu-server/9100.conf");
    let edited = std::fs::read_to_string(&conf_path)
        .unwrap()
        .replace("#certistack-run=", "#adopted-by-admin=");
    std::fs::write(&conf_path, &edited).unwrap();
    assert_status(
        run.client.destroy_vm(pb::VmRequest { vmid: 9100 }).await,
        Code::FailedPrecondition,
        "is not this run's (its description does not carry this run's marker)",
    );
    let reply = run
        .client
        .cleanup(pb::CleanupRequest {
            run_id: RUN_ID.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let vm = reply
        .resources
        .iter()
        .find(|r| r.resource == "vm:9100")
        .unwrap();
    assert_eq!(vm.end_state, "not this run's, left untouched");
    assert_eq!(std::fs::read_to_string(&conf_path).unwrap(), edited);
    for vmid in ["9100", "9101", "9102"] {
        assert!(
            run.lab
                .root
                .join(format!("etc/pve/qemu-server/{vmid}.conf"))
                .exists(),
            "VM {vmid} was touched"
        );
        run.lab.qm(&["destroy", vmid]);
    }
    run.stop().await;
}

#[test]
fn a_silent_guest_agent_is_a_deadline_not_a_hang() {
    if !privileged("a_silent_guest_agent_is_a_deadline_not_a_hang", QEMU_TOOLS) {
        return;
    }
    let netns = Netns::new("vm", &["csbox1", "csbox91", "csbox92"]);
    inside(&netns.name, || async {
        // QEMU serves the agent socket, but no guest OS runs an agent behind it.
        let mut run = Run::begin_with(
            "silent",
            &[ARCHIVE],
            |lab| lab.settings(serde_json::json!({ "agent_mode": "qemu-chardev" })),
            sandbox_grant,
        )
        .await;
        run.sandbox_vm(9100).await;
        run.client
            .start_vm(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let status = run
            .client
            .qga(pb::QgaRequest {
                vmid: 9100,
                call: Some(pb::qga_request::Call::Command(pb::QgaCommand::Ping as i32)),
            })
            .await
            .unwrap_err();
        let waited = started.elapsed();
        assert_eq!(
            status.code(),
            Code::DeadlineExceeded,
            "{}",
            status.message()
        );
        assert!(
            status.message().contains("the guest agent is not running"),
            "{}",
            status.message()
        );
        assert!(
            waited >= std::time::Duration::from_secs(3)
                && waited < std::time::Duration::from_secs(10),
            "{waited:?}"
        );
        // Cleanup stops and destroys the VM, deletes the overlay and unmaps the backup.
        let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
        assert_eq!(receipts[0], "vm:9100 destroyed", "{receipts:?}");
        assert!(!run.qemu_running(9100));
        // qm's own stop timeout (60 s, then 11 s of SIGTERM/SIGKILL) would outlast the tool
        // timeout (60 s), and qm's worker would outlive a kill at the deadline: the stop
        // always names a timeout that fits.
        let stops: Vec<serde_json::Value> = run
            .lab
            .calls()
            .into_iter()
            .filter(|c| c["argv"][0] == "stop")
            .map(|c| c["argv"].clone())
            .collect();
        assert_eq!(
            stops,
            [serde_json::json!(["stop", "9100", "--timeout", "43"])],
            "{stops:?}"
        );
        run.stop().await;
    });
}
#[tokio::test(flavor = "multi_thread")]
async fn a_vm_that_cannot_be_destroyed_keeps_everything_beneath_it() {
    if !privileged(
        "a_vm_that_cannot_be_destroyed_keeps_everything_beneath_it",
        &["losetup", "python3", "qemu-img"],
    ) {
        return;
    }
    let mut run = Run::begin_with("keep", &[ARCHIVE], |_| {}, sandbox_grant).await;
    map_overlay_and_vm(&mut run.client, 9100).await;
    run.lab
        .settings(serde_json::json!({ "failures": { "destroy": "VM 9100 is locked (backup)" } }));
    let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
    assert!(
        receipts[0].starts_with("vm:9100 failed: qm destroy 9100 failed"),
        "{receipts:?}"
    );
    let kept = "failed: kept while a VM of the run remains (VM 9100 could not be destroyed)";
    assert_eq!(
        &receipts[1..],
        [
            format!("overlay:9100:drive-scsi0.img {kept}"),
            format!("dir:overlays {kept}"),
            format!("backup:drive-scsi0.img {kept}"),
        ]
    );
    assert!(!residue.is_empty());
    let overlay = run
        .lab
        .root
        .join(format!("overlays/{RUN_ID}/9100-drive-scsi0.qcow2"));
    assert!(overlay.exists(), "the overlay beneath the VM stays");
    assert_eq!(
        run.loops().len(),
        1,
        "the mapping beneath the overlay stays"
    );
    // Once the VM can be destroyed, the next Cleanup removes everything.
    run.lab.settings(serde_json::json!({ "failures": {} }));
    run.end().await;
}
#[test]
fn a_guest_boots_only_on_a_prepared_sandbox() {
    if !privileged("a_guest_boots_only_on_a_prepared_sandbox", QEMU_TOOLS) {
        return;
    }
    let netns = Netns::new("boot", &["csbox1"]);
    inside(&netns.name, || async {
        let mut run = Run::begin_with("boot", &[ARCHIVE], |_| {}, sandbox_grant).await;
        map_overlay_and_vm(&mut run.client, 9100).await;
        assert_status(
            run.client.start_vm(pb::VmRequest { vmid: 9100 }).await,
            Code::FailedPrecondition,
            "VM 9100 may boot only on a prepared sandbox: call PrepareSandbox for csbox1 first",
        );
        assert!(!run.qemu_running(9100));
        let prepare = || pb::PrepareSandboxRequest {
            vnet: VNET.into(),
            probe_source: PROBE_SOURCE.into(),
        };
        run.client.prepare_sandbox(prepare()).await.unwrap();
        assert_status(
            run.client.prepare_sandbox(prepare()).await,
            Code::AlreadyExists,
            "already prepared",
        );
        // A link stacked on the VNet after PrepareSandbox is caught by the re-check before boot.
        run_ip(&[
            "link", "add", "link", "csbox1", "name", "mvl9", "type", "macvlan", "mode", "bridge",
        ]);
        assert_status(
            run.client.start_vm(pb::VmRequest { vmid: 9100 }).await,
            Code::FailedPrecondition,
            "VNet csbox1 is no longer isolated, so no guest may boot on it: link mvl9 (on csbox1) is stacked on the VNet",
        );
        assert!(!run.qemu_running(9100));
        run_ip(&["link", "del", "mvl9"]);
        run.client
            .start_vm(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap();
        assert!(run.qemu_running(9100));
        // The containment cannot be removed from under a guest.
        assert_status(
            run.client
                .release_sandbox(pb::ReleaseSandboxRequest { vnet: VNET.into() })
                .await,
            Code::FailedPrecondition,
            "vm:9100 still exists on the sandbox; destroy it before releasing csbox1",
        );
        let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
        assert_eq!(receipts[0], "vm:9100 destroyed", "{receipts:?}");
        assert!(
            receipts
                .contains(&"nft:certistack_0f0e1c2d3b4a4c5d8e6f7a8b9c0d1e2f deleted".to_owned()),
            "{receipts:?}"
        );
        assert!(
            receipts.contains(&"addr:csbox1 deleted".to_owned()),
            "{receipts:?}"
        );
        assert!(!run.qemu_running(9100));
        run.stop().await;
    });
}
