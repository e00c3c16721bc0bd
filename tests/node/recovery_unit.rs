//! A guest network recovery unit that outlived its step (its stop failed when the step ended)
//! may still write the overlay QEMU is about to read: `StartVm` stops it first, and when it
//! cannot be stopped refuses the start with UNAVAILABLE and `ERROR_REASON_RECOVERY_UNIT_RUNNING`,
//! starting nothing; once the unit is gone, the start goes on to its next check.

use super::*;
use certistack_connector::config::{ApplianceConfinement, Config};
use prost::Message;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// A `systemctl` double for one transient unit that is loaded and refuses to stop until
/// `DIR/stoppable` exists. It answers as systemd 252's `systemctl` does (src/systemctl:
/// `show --property=A,B` prints `A=value` lines, `LoadState=not-found` for a unit that is
/// not loaded; `stop` exits 1 with the failed job on stderr) and logs each call to `DIR/calls`.
fn stuck_unit_systemctl(dir: &Path, description: &str) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("description"), description).unwrap();
    let script = format!(
        r#"#!/bin/sh
dir='{dir}'
echo "$*" >>"$dir/calls"
case "$1" in
  show)
    if [ -e "$dir/stopped" ]; then
      printf 'LoadState=not-found\nDescription=\n'
    else
      printf 'LoadState=loaded\nDescription=%s\n' "$(cat "$dir/description")"
    fi ;;
  stop)
    if [ -e "$dir/stoppable" ]; then : >"$dir/stopped"; exit 0; fi
    echo "Job for $3 failed because the control process exited with error code." >&2
    exit 1 ;;
esac
exit 0
"#,
        dir = dir.display()
    );
    let path = dir.join("systemctl");
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread")]
async fn a_recovery_unit_that_cannot_be_stopped_refuses_the_start() {
    if !privileged(
        "a_recovery_unit_that_cannot_be_stopped_refuses_the_start",
        &["losetup", "python3", "qemu-img"],
    ) {
        return;
    }
    let units = std::sync::Arc::new(std::sync::Mutex::new(std::path::PathBuf::new()));
    let kept = units.clone();
    let mut run = Run::begin_with_config(
        "stuckunit",
        &[ARCHIVE],
        |_| {},
        sandbox_grant,
        move |lab: &Lab, config: &mut Config| {
            let description = certistack_connector::process::transient_unit_description(
                certistack_connector::process::TransientRole::GuestNetwork { memory_max_mib: 0 },
                RUN_ID,
                "9100",
            );
            let dir = lab.root.join("systemctl-double");
            config.process.systemctl = stuck_unit_systemctl(&dir, &description);
            config.guest_network.confined = ApplianceConfinement::Always;
            *kept.lock().unwrap() = dir;
        },
    )
    .await;
    let dir = units.lock().unwrap().clone();
    map_overlay_and_vm(&mut run.client, 9100).await;

    let refused = run
        .client
        .start_vm(pb::VmRequest { vmid: 9100 })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    for part in [
        "guest network recovery unit",
        "of VM 9100 still runs and could not be stopped",
        "Job for",
        "retry then",
    ] {
        assert!(refused.message().contains(part), "{part:?}: {refused:?}");
    }
    let detail = pb::ErrorDetail::decode(refused.details()).unwrap();
    assert_eq!(
        detail.reason,
        pb::ErrorReason::RecoveryUnitRunning as i32,
        "{refused:?}"
    );
    // Nothing was started: the VM is still stopped, and only the unit was asked about.
    let status = run
        .client
        .vm_status(pb::VmRequest { vmid: 9100 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.state, pb::VmState::Stopped as i32, "{status:?}");
    let calls = std::fs::read_to_string(dir.join("calls")).unwrap();
    let lines: Vec<&str> = calls.lines().collect();
    assert_eq!(lines.len(), 2, "{calls}");
    assert!(
        lines[0].starts_with("show --property=LoadState,Description -- "),
        "{calls}"
    );
    assert!(lines[1].starts_with("stop -- "), "{calls}");

    // The unit stops now: the start goes past it, to the sandbox it has not been given.
    std::fs::write(dir.join("stoppable"), "").unwrap();
    assert_status(
        run.client.start_vm(pb::VmRequest { vmid: 9100 }).await,
        Code::FailedPrecondition,
        "may boot only on a prepared sandbox",
    );
    assert!(dir.join("stopped").exists());
    run.stop().await;
}
