//! QEMU's run states (`query-status`, as `qm status` prints them), read once for both programs:
//! the node reports a VM's state from them, the controller judges a restored guest by them.

use certistack_proto::v1 as pb;

/// The state a `qm status` value reports. qm prints QEMU's `query-status` value while QEMU
/// answers (qemu-server `vmstatus`), else `running` or `stopped`.
pub fn vm_state(status: &str) -> pb::VmState {
    match status {
        "running" => pb::VmState::Running,
        "stopped" => pb::VmState::Stopped,
        "paused" | "debug" | "inmigrate" | "postmigrate" | "finish-migrate" | "save-vm"
        | "restore-vm" | "colo" => pb::VmState::Paused,
        "io-error" | "internal-error" | "guest-panicked" | "watchdog" => pb::VmState::GuestError,
        "shutdown" => pb::VmState::GuestShutdown,
        "suspended" => pb::VmState::Suspended,
        "prelaunch" => pb::VmState::Prelaunch,
        _ => pb::VmState::Unrecognized,
    }
}
