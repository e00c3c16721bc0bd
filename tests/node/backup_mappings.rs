//! Backups mapped onto real read-only loop devices and overlays made by the real `qemu-img`:
//! map, overlay and unmap; failures read from the tool's output; only the run's own mappings
//! unmapped (also above loop 255); a mapping whose holder was killed, or whose guest volume the
//! host activated, refused before boot and overlay and reported by cleanup.

use super::*;

#[tokio::test(flavor = "multi_thread")]
async fn map_overlay_unmap_for_real() {
    if !privileged(
        "map_overlay_unmap_for_real",
        &["losetup", "qemu-img", "python3"],
    ) {
        return;
    }
    let mut run = Run::begin("ops", &[ARCHIVE]).await;

    let mapped = run
        .client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap()
        .into_inner();
    let device = mapped.loop_device.clone();
    assert!(device.starts_with("/dev/loop"), "{device}");
    let name = device.trim_start_matches("/dev/");
    assert_eq!(
        std::fs::read_to_string(format!("/sys/block/{name}/ro"))
            .unwrap()
            .trim(),
        "1",
        "mapped read-only"
    );
    let loops = run.loops();
    assert_eq!(loops.len(), 1);
    assert_eq!(loops[0].0, device);
    // The backup's bytes are what the loop device serves.
    let mut head = vec![0u8; MARKER.len()];
    std::io::Read::read_exact(&mut std::fs::File::open(&device).unwrap(), &mut head).unwrap();
    assert_eq!(head, MARKER);
    let tool = mapped.tool.unwrap();
    assert_eq!(
        (tool.program.as_str(), tool.exit_code),
        ("proxmox-backup-client map", 0)
    );

    // The secret reached the client through its descriptor only: not argv, not the
    // environment, not the double's log; and the environment holds exactly what map needs.
    let calls = run.lab.calls();
    assert!(
        !serde_json::to_string(&calls)
            .unwrap()
            .contains(PBS_PASSWORD),
        "the secret leaked: {calls:?}"
    );
    let map_call = calls.iter().find(|c| c["command"] == "map").unwrap();
    assert_eq!(
        map_call["argv"],
        serde_json::json!([
            "map",
            SNAPSHOT,
            ARCHIVE,
            "--repository",
            "certistack@pbs!restore@pbs.lab:8007:store1"
        ])
    );
    let mut env: Vec<String> = serde_json::from_value(map_call["env_names"].clone()).unwrap();
    env.sort();
    assert_eq!(env, ["PATH", "PBS_FINGERPRINT", "PBS_PASSWORD_FD"]);
    assert!(
        calls
            .iter()
            .any(|c| c["password_source"] == "PBS_PASSWORD_FD"),
        "{calls:?}"
    );

    // Mapping the same archive twice is refused by the connector, before the tool runs.
    assert_status(
        run.client
            .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
            .await,
        Code::AlreadyExists,
        "already mapped by this run",
    );

    // The lab's "cluster database" lives on the same filesystem as the overlays: warned.
    std::fs::create_dir_all(run.lab.root.join("var/lib/pve-cluster")).unwrap();
    let overlay = run
        .client
        .create_overlay(pb::CreateOverlayRequest {
            vmid: VMID,
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(overlay.tool.unwrap().exit_code, 0);
    assert_eq!(overlay.warnings.len(), 1, "{:?}", overlay.warnings);
    assert!(
        overlay.warnings[0].contains("same filesystem"),
        "{:?}",
        overlay.warnings
    );
    let path = run
        .lab
        .root
        .join(format!("overlays/{RUN_ID}/{VMID}-drive-scsi0.qcow2"));
    let info = qemu_img_info(path.to_str().unwrap());
    assert_eq!(info["format"], "qcow2");
    assert_eq!(info["backing-filename"], device.as_str());
    assert_eq!(info["backing-filename-format"], "raw");
    let dir_mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions(),
    );
    assert_eq!(dir_mode & 0o777, 0o700);
    assert_status(
        run.client
            .create_overlay(pb::CreateOverlayRequest {
                vmid: VMID,
                archive: ARCHIVE.into(),
            })
            .await,
        Code::AlreadyExists,
        "already exists",
    );

    // The backup cannot be unmapped from under its overlay.
    assert_status(
        run.client
            .unmap_backup(pb::UnmapBackupRequest {
                archive: ARCHIVE.into(),
            })
            .await,
        Code::FailedPrecondition,
        "still uses",
    );
    run.client
        .delete_overlay(pb::DeleteOverlayRequest {
            vmid: VMID,
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
    assert!(!path.exists());
    run.client
        .unmap_backup(pb::UnmapBackupRequest {
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
    assert!(run.loops().is_empty(), "unmapped");

    let steps = run.journal().await;
    let expected = [
        "run.begin run:0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f done",
        "backup.map backup:drive-scsi0.img intent",
        // The second intent names the tool's processes (pid, start time, process group).
        "backup.map backup:drive-scsi0.img intent",
        "backup.map backup:drive-scsi0.img done",
        "overlay.dir dir:overlays intent",
        "overlay.dir dir:overlays done",
        "overlay.create overlay:9100:drive-scsi0.img intent",
        "overlay.create overlay:9100:drive-scsi0.img intent",
        "overlay.create overlay:9100:drive-scsi0.img done",
        "overlay.delete overlay:9100:drive-scsi0.img intent",
        "overlay.delete overlay:9100:drive-scsi0.img undone",
        "backup.unmap backup:drive-scsi0.img intent",
        "backup.unmap backup:drive-scsi0.img intent",
        "backup.unmap backup:drive-scsi0.img undone",
    ];
    assert_eq!(steps, expected);
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn map_failures_are_reported_from_the_output_not_the_exit_code() {
    if !privileged(
        "map_failures_are_reported_from_the_output_not_the_exit_code",
        &["losetup", "python3"],
    ) {
        return;
    }
    let mut run = Run::begin("mapfail", &[ARCHIVE, "drive-scsi1.img"]).await;
    // Wrong password: the client exits 0 and prints an error; nothing is mapped.
    let status = run
        .client
        .map_backup(map_request(ARCHIVE, "wrong password"))
        .await
        .unwrap_err();
    assert_eq!(
        status.code(),
        Code::FailedPrecondition,
        "{}",
        status.message()
    );
    assert!(
        status
            .message()
            .contains("did not map drive-scsi0.img (exit Some(0))"),
        "{}",
        status.message()
    );
    assert!(
        status.message().contains("authentication failed"),
        "{}",
        status.message()
    );
    assert!(!status.message().contains("wrong password"));
    // An archive the snapshot does not have (granted, but absent from the datastore).
    std::fs::remove_file(
        run.lab
            .root
            .join("pbs/store1")
            .join(SNAPSHOT)
            .join("drive-scsi1.img"),
    )
    .unwrap();
    let status = run
        .client
        .map_backup(map_request("drive-scsi1.img", PBS_PASSWORD))
        .await
        .unwrap_err();
    assert!(
        status.message().contains("manifest does not contain file"),
        "{}",
        status.message()
    );
    assert!(run.loops().is_empty());
    let steps = run.journal().await;
    // A map that finished and named no device mapped nothing: the journal closes it at once.
    assert_eq!(
        &steps[1..],
        [
            "backup.map backup:drive-scsi0.img intent",
            "backup.map backup:drive-scsi0.img intent",
            "backup.map backup:drive-scsi0.img failed",
            "backup.map backup:drive-scsi0.img undone",
            "backup.map backup:drive-scsi1.img intent",
            "backup.map backup:drive-scsi1.img intent",
            "backup.map backup:drive-scsi1.img failed",
            "backup.map backup:drive-scsi1.img undone",
        ]
    );
    // So the failed map can be retried, and the retry unmapped: map, fail, map, unmap.
    let device = run
        .client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap()
        .into_inner()
        .loop_device;
    assert_eq!(run.loops().len(), 1, "{device} mapped");
    run.client
        .unmap_backup(pb::UnmapBackupRequest {
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
    assert!(run.loops().is_empty(), "{device} unmapped");
    // Nothing is left for Cleanup.
    let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
    assert!(receipts.is_empty(), "{receipts:?}");
    assert!(residue.is_empty(), "{residue:?}");
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_loop_device_the_run_did_not_map_is_never_unmapped() {
    if !privileged(
        "a_loop_device_the_run_did_not_map_is_never_unmapped",
        &["losetup", "python3"],
    ) {
        return;
    }
    let mut run = Run::begin("foreign", &[ARCHIVE]).await;
    let device = run
        .client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap()
        .into_inner()
        .loop_device;
    // Someone detaches the mapping behind the connector's back and the kernel hands the same
    // device number to an unrelated file.
    let foreign = run.lab.root.join("foreign.img");
    std::fs::File::create(&foreign)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let sh = |args: &[&str]| {
        // A detached device can stay busy for a moment while the kernel releases it.
        for attempt in 0.. {
            let out = std::process::Command::new("losetup")
                .args(args)
                .output()
                .unwrap();
            if out.status.success() {
                return;
            }
            assert!(
                attempt < 40,
                "losetup {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    sh(&["-d", &device]);
    sh(&[&device, foreign.to_str().unwrap()]);

    run.client
        .unmap_backup(pb::UnmapBackupRequest {
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
    let still =
        certistack_connector::node::loopdev::inspect(std::path::Path::new("/sys/block"), &device)
            .unwrap();
    assert_eq!(
        still.backing_file, foreign,
        "the foreign device was left attached"
    );
    let steps = run.journal().await;
    assert_eq!(
        steps.last().unwrap(),
        "backup.unmap backup:drive-scsi0.img undone"
    );
    sh(&["-d", &device]);
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn cleanup_undoes_everything_newest_first_and_is_idempotent() {
    if !privileged(
        "cleanup_undoes_everything_newest_first_and_is_idempotent",
        &["losetup", "qemu-img", "python3"],
    ) {
        return;
    }
    let mut run = Run::begin("cleanup", &[ARCHIVE, "drive-scsi1.img"]).await;
    for archive in [ARCHIVE, "drive-scsi1.img"] {
        run.client
            .map_backup(map_request(archive, PBS_PASSWORD))
            .await
            .unwrap();
        run.client
            .create_overlay(pb::CreateOverlayRequest {
                vmid: VMID,
                archive: archive.into(),
            })
            .await
            .unwrap();
    }
    assert_eq!(run.loops().len(), 2);
    // A run cannot end while it still holds resources on the node.
    assert_status(
        run.client.end_run(pb::EndRunRequest {}).await,
        Code::FailedPrecondition,
        "still holds on this node: open in its journal: overlay:9100:drive-scsi1.img, backup:drive-scsi1.img, overlay:9100:drive-scsi0.img, dir:overlays, backup:drive-scsi0.img; loop device",
    );
    let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
    assert_eq!(
        receipts,
        [
            "overlay:9100:drive-scsi1.img deleted",
            "backup:drive-scsi1.img unmapped",
            "overlay:9100:drive-scsi0.img deleted",
            "dir:overlays deleted",
            "backup:drive-scsi0.img unmapped",
        ]
    );
    assert!(residue.is_empty(), "{residue:?}");
    assert!(run.loops().is_empty());
    assert!(!run.lab.root.join("overlays").join(RUN_ID).exists());
    let again = run
        .client
        .cleanup(pb::CleanupRequest {
            run_id: RUN_ID.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        again.resources.is_empty() && again.residue.is_empty(),
        "{again:?}"
    );
    run.stop().await;
}
#[tokio::test(flavor = "multi_thread")]
async fn a_writable_mapping_of_the_runs_own_name_is_unmapped_by_cleanup() {
    if !privileged(
        "a_writable_mapping_of_the_runs_own_name_is_unmapped_by_cleanup",
        &["losetup", "python3"],
    ) {
        return;
    }
    let mut run = Run::begin_with(
        "writable",
        &[ARCHIVE],
        |lab| lab.settings(serde_json::json!({ "map_writable": true })),
        |_| {},
    )
    .await;
    assert_status(
        run.client
            .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
            .await,
        Code::FailedPrecondition,
        "is writable; a backup must be mapped read-only",
    );
    assert_eq!(run.loops().len(), 1, "the refused mapping is still there");
    let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
    assert_eq!(receipts, ["backup:drive-scsi0.img unmapped"]);
    assert!(residue.is_empty(), "{residue:?}");
    assert!(run.loops().is_empty());
    run.end().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mapping_on_a_loop_device_above_255_is_unmapped_by_name() {
    if !privileged(
        "a_mapping_on_a_loop_device_above_255_is_unmapped_by_name",
        &["losetup", "python3"],
    ) {
        return;
    }
    let first = 300 + std::process::id() % 500;
    let mut run = Run::begin_with(
        "loop256",
        &[ARCHIVE],
        |lab| lab.settings(serde_json::json!({ "loop_device_min": first })),
        |_| {},
    )
    .await;
    let device = run
        .client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap()
        .into_inner()
        .loop_device;
    let number: u32 = device.trim_start_matches("/dev/loop").parse().unwrap();
    assert!(number >= 256, "{device}");
    assert_eq!(run.loops().len(), 1);
    // `unmap /dev/loopN` cannot name it (N is read as a u8); the mapping name can.
    run.client
        .unmap_backup(pb::UnmapBackupRequest {
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
    assert!(run.loops().is_empty(), "{device} unmapped");
    run.end().await;
}
#[tokio::test(flavor = "multi_thread")]
async fn a_mapping_whose_holder_was_killed_is_refused_before_boot_and_overlay() {
    if !privileged(
        "a_mapping_whose_holder_was_killed_is_refused_before_boot_and_overlay",
        &["losetup", "python3", "qemu-img"],
    ) {
        return;
    }
    let mut run = Run::begin_with("deadholder", &[ARCHIVE], |_| {}, sandbox_grant).await;
    map_overlay_and_vm(&mut run.client, 9100).await;
    let pid_files: Vec<std::path::PathBuf> =
        std::fs::read_dir(run.lab.root.join("run/pbs-loopdev"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "pid"))
            .collect();
    assert_eq!(pid_files.len(), 1, "{pid_files:?}");
    let holder: i32 = std::fs::read_to_string(&pid_files[0])
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let before = run.loops();
    // Direct reads from the device, past any cache: the holder serves them.
    let read_device = |device: &str| {
        std::process::Command::new("dd")
            .args([
                &format!("if={device}"),
                "bs=4096",
                "count=1",
                "iflag=direct",
                "status=none",
            ])
            .output()
            .unwrap()
    };
    let served = read_device(&before[0].0);
    assert!(served.status.success() && served.stdout.starts_with(MARKER));
    // SIGKILL: the holder cannot clean up; the kernel keeps the device and its backing path.
    assert!(
        std::process::Command::new("kill")
            .args(["-9", &holder.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::path::Path::new(&format!("/proc/{holder}/cmdline")).exists()
        && std::fs::read_to_string(format!("/proc/{holder}/stat")).is_ok_and(|s| !s.contains(") Z"))
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(
        run.loops(),
        before,
        "the device stays attached, same backing path"
    );
    assert!(!before[0].1.display().to_string().ends_with("(deleted)"));
    let unserved = read_device(&before[0].0);
    assert!(
        !unserved.status.success() && !unserved.stdout.starts_with(MARKER),
        "reads from a dead mapping fail: {unserved:?}"
    );

    for result in [
        ok(run.client.start_vm(pb::VmRequest { vmid: 9100 }).await),
        ok(run
            .client
            .create_overlay(pb::CreateOverlayRequest {
                vmid: 9101,
                archive: ARCHIVE.into(),
            })
            .await),
        // Recovery reads the guest through the mapping: a reused loop number would put
        // another backup's facts into this run's evidence.
        ok(run
            .client
            .recover_guest_network(pb::RecoverGuestNetworkRequest {
                vmid: 9100,
                archive: ARCHIVE.into(),
                mode: pb::NetworkRecoveryMode::Rewrite as i32,
            })
            .await),
    ] {
        assert_status(
            result,
            Code::FailedPrecondition,
            &format!(
                "the mapping of {ARCHIVE} on {} is dead: its holder (process {holder}",
                before[0].0
            ),
        );
    }
    let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
    assert!(residue.is_empty(), "{receipts:?} {residue:?}");
    assert!(
        receipts.contains(&"backup:drive-scsi0.img unmapped".to_owned()),
        "{receipts:?}"
    );
    assert!(run.loops().is_empty());
    run.stop().await;
}

/// Stages in `mirror` a copy of `/sys/block` for loop devices 0..1024 (each `loop` and `ro`
/// links to the kernel's own), where a test adds device-mapper holders: this kernel has no
/// device-mapper to create real ones.
fn sys_block_mirror(mirror: &std::path::Path) {
    for number in 0..1024 {
        let dir = mirror.join(format!("loop{number}"));
        std::fs::create_dir_all(dir.join("holders")).unwrap();
        for attribute in ["loop", "ro"] {
            std::os::unix::fs::symlink(
                format!("/sys/block/loop{number}/{attribute}"),
                dir.join(attribute),
            )
            .unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_guest_volume_the_host_activated_blocks_boot_and_is_reported_by_cleanup() {
    if !privileged(
        "a_guest_volume_the_host_activated_blocks_boot_and_is_reported_by_cleanup",
        &["losetup", "python3", "qemu-img"],
    ) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let lab = Lab::new("dmholder");
    lab.add_backup(SNAPSHOT, ARCHIVE, MARKER, 8 << 20);
    let mirror = lab.root.join("sys-block");
    sys_block_mirror(&mirror);
    let (_authority_dir, authority, config) = lab.controller_and_node_config("dmholder-ctl");
    let clock: std::sync::Arc<dyn certistack_connector::clock::Clock> =
        std::sync::Arc::new(certistack_connector::clock::SystemClock);
    let executor = certistack_connector::node::NodeExecutor::new(config.clone(), clock.clone())
        .with_sys_block(mirror.clone());
    let connector =
        certistack_connector::server::Connector::new(config, std::sync::Arc::new(executor), clock)
            .unwrap();
    let listener = connector.bind().await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        connector
            .serve(listener, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    let mut wire = grant(RUN_ID, NODE);
    sandbox_grant(&mut wire);
    let mut c = begun_run(&authority, &address, &wire).await;
    let device = c
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap()
        .into_inner()
        .loop_device;
    overlay_and_vm(&mut c, 9100).await;

    // The host's LVM found a physical volume on the guest disk's second partition and
    // activated a logical volume of it.
    let loop_name = device.trim_start_matches("/dev/");
    let holder = mirror.join(format!("{loop_name}/{loop_name}p2/holders/dm-250"));
    std::fs::create_dir_all(&holder).unwrap();
    std::fs::create_dir_all(mirror.join("dm-250/dm")).unwrap();
    std::fs::write(mirror.join("dm-250/dm/name"), "guestvg-root\n").unwrap();
    std::fs::write(mirror.join("dm-250/dm/uuid"), "LVM-0123456789abcdef\n").unwrap();
    let described = format!(
        "{device}p2 is held by device-mapper device \"guestvg-root\" (dm-250): run `dmsetup remove /dev/dm-250` (it is a volume of the guest's LVM volume group guestvg: `vgchange -an guestvg` releases them all)"
    );
    assert_status(
        c.start_vm(pb::VmRequest { vmid: 9100 }).await,
        Code::FailedPrecondition,
        &format!("the host uses the mapping of {ARCHIVE}: {described}; then retry"),
    );

    // Cleanup removes everything else, leaves the mapping (unmap could not detach it) and
    // says what holds it and what to run.
    let (receipts, residue) = cleanup_receipts(&mut c, RUN_ID).await;
    assert_eq!(
        receipts.last().unwrap(),
        &format!(
            "backup:{ARCHIVE} failed: the mapping of {ARCHIVE} is left in place because the host uses it: {described}; then run Cleanup again"
        ),
        "{receipts:?}"
    );
    assert!(
        receipts.contains(&"vm:9100 destroyed".to_owned()),
        "{receipts:?}"
    );
    assert!(
        residue.contains(&format!(
            "the host uses the mapping of {ARCHIVE}: {described}"
        )),
        "{residue:?}"
    );
    assert_eq!(loops_under(&lab.root).len(), 1, "the mapping stays");

    // The operator released the volume: Cleanup completes.
    std::fs::remove_dir(&holder).unwrap();
    let (receipts, residue) = cleanup_receipts(&mut c, RUN_ID).await;
    assert!(residue.is_empty(), "{receipts:?} {residue:?}");
    assert!(
        receipts.contains(&format!("backup:{ARCHIVE} unmapped")),
        "{receipts:?}"
    );
    assert!(loops_under(&lab.root).is_empty());
    c.end_run(pb::EndRunRequest {}).await.unwrap();
    let _ = stop.send(());
    server.await.unwrap();
}
