//! What guest network recovery refuses or cuts short: what it must not touch, a hung appliance
//! killed at its deadline, and a VM that has already started.

use super::*;

#[tokio::test(flavor = "multi_thread")]
async fn guest_network_recovery_refuses_what_it_must_not_touch() {
    if !privileged(
        "guest_network_recovery_refuses_what_it_must_not_touch",
        GUESTFS_TOOLS,
    ) {
        return;
    }
    let images: [(&str, &[Tree]); 2] = [
        (ARCHIVE, &[BASE, BARE]),
        ("drive-scsi1.img", &[BASE, ARCH, HOSTILE_NAME]),
    ];
    let mut run = begin("guestnet-refusals", &images, |_, _| {}).await;

    // No overlay of this run's yet: nothing to write into.
    assert_status(
        run.recover(9100, ARCHIVE, pb::NetworkRecoveryMode::Rewrite)
            .await,
        Code::FailedPrecondition,
        "this run has no overlay of drive-scsi0.img for VM 9100",
    );
    let device = run.map_and_overlay_archive(ARCHIVE, 9100).await;
    let before = sha256_of(&device);

    // A mode the grant does not allow, a VM and an archive outside the grant.
    assert_status(
        run.recover(9100, ARCHIVE, pb::NetworkRecoveryMode::Preserve)
            .await,
        Code::PermissionDenied,
        "network recovery mode preserve",
    );
    assert_status(
        run.recover(9102, ARCHIVE, pb::NetworkRecoveryMode::Rewrite)
            .await,
        Code::PermissionDenied,
        "VMID 9102",
    );

    // An OS whose network stack recovery does not know: the inspection result, `preserve` as
    // the way out, and nothing written into the overlay.
    let overlay = run.overlay(9100, ARCHIVE);
    let allocated = overlay_allocated_bytes(&overlay);
    let refused = run
        .recover(9100, ARCHIVE, pb::NetworkRecoveryMode::Rewrite)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    for part in [
        "distro debian",
        "no network stack found",
        "preserve",
        "nothing was written",
    ] {
        assert!(
            refused.message().contains(part),
            "{part}: {}",
            refused.message()
        );
    }
    assert_eq!(
        overlay_allocated_bytes(&overlay),
        allocated,
        "the overlay was written"
    );
    assert_eq!(sha256_of(&device), before);

    // A file name with a line break in a directory recovery lists: refused, with the name
    // escaped, and nothing written.
    let archive = images[1].0;
    let device = run.map_and_overlay_archive(archive, 9101).await;
    let before = sha256_of(&device);
    let overlay = run.overlay(9101, archive);
    let allocated = overlay_allocated_bytes(&overlay);
    let refused = run
        .recover(9101, archive, pb::NetworkRecoveryMode::Rewrite)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    for part in [
        "distro archlinux",
        "systemd-networkd configuration directory /etc/systemd/network holds a file with a control character",
        "\"/etc/systemd/network/25-lab\\n.network\"",
        "nothing was written",
        "preserve",
    ] {
        assert!(
            refused.message().contains(part),
            "{part}: {}",
            refused.message()
        );
    }
    assert_eq!(
        overlay_allocated_bytes(&overlay),
        allocated,
        "the overlay was written"
    );
    assert_eq!(sha256_of(&device), before);
    let steps = run.journal().await;
    assert!(
        steps
            .iter()
            .any(|s| s.contains("guestnet.recover") && s.contains("failed")),
        "{steps:#?}"
    );
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hung_appliance_is_killed_at_its_deadline() {
    if !privileged(
        "a_hung_appliance_is_killed_at_its_deadline",
        &["losetup", "qemu-img", "mkfs.ext4", "python3"],
    ) {
        return;
    }
    let images: [(&str, &[Tree]); 1] = [(ARCHIVE, &[BASE, DEBIAN])];
    let mut run = begin("guestnet-hang", &images, |lab, config| {
        let double = lab.root.join("bin/guestfish");
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("doubles/guestfish-hang"),
            &double,
        )
        .unwrap();
        config.tools.guestfish = double;
        config.limits.guest_network_timeout_secs = 2;
    })
    .await;
    run.map_and_overlay_archive(ARCHIVE, 9100).await;
    let started = std::time::Instant::now();
    let status = run
        .recover(9100, ARCHIVE, pb::NetworkRecoveryMode::Rewrite)
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        status
            .message()
            .contains("limits.guest_network_timeout_secs"),
        "{status:?}"
    );
    assert!(took < std::time::Duration::from_secs(15), "took {took:?}");
    let pids = std::fs::read_to_string(run.lab.root.join("bin/guestfish.pids")).unwrap();
    for pid in pids.split_whitespace() {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .next();
        assert!(
            stat.is_empty() || state == Some("Z"),
            "process {pid} of the appliance outlived its deadline: {stat}"
        );
    }
    run.stop().await;
}

#[test]
fn guest_network_recovery_is_refused_once_the_vm_has_started() {
    if !privileged(
        "guest_network_recovery_is_refused_once_the_vm_has_started",
        QEMU_TOOLS,
    ) {
        return;
    }
    let netns = Netns::new("gnstart", &["csbox1"]);
    inside(&netns.name, || async {
        let mut run = Run::begin_with("guestnet-started", &[ARCHIVE], |_| {}, sandbox_grant).await;
        run.sandbox_vm(9100).await;
        run.client
            .start_vm(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap();
        assert_status(
            run.recover(9100, ARCHIVE, pb::NetworkRecoveryMode::Rewrite)
                .await,
            Code::FailedPrecondition,
            "VM 9100 has been started",
        );
        run.stop().await;
    });
}
