//! Whether a node can run KVM guests (and whether it is itself a VM), and how long the
//! libguestfs appliance took to boot there.

use super::{Judged, Level, UPGRADE_CONNECTOR};
use certistack_proto::v1 as pb;
use std::time::Duration;

/// DMI system vendors and product names of virtual machines: a hypervisor may hide the CPU's
/// `hypervisor` flag, not its firmware's names (systemd's `src/basic/virt.c` reads the same).
pub(super) const VIRTUAL_DMI_NAMES: &[&str] = &[
    "QEMU",
    "KVM",
    "VMware",
    "VirtualBox",
    "innotek GmbH",
    "Xen",
    "HVM domU",
    "Amazon EC2",
    "Google Compute Engine",
    "Virtual Machine",
    "OpenStack",
    "Parallels",
    "Bochs",
    "BHYVE",
];

/// Whether sandbox VMs get KVM. qemu-server starts a VM with `kvm: 1` (the default, which the
/// connector keeps) only when the CPU flags name `vmx` or `svm` (`PVE::QemuServer`
/// `config_to_command`: "KVM virtualisation configured, but not available"), and QEMU needs
/// `/dev/kvm`. A node that is itself a VM gets both from its outer hypervisor, whose nested
/// virtualization may still stop real guests: only a boot shows it.
pub(super) fn judge_virtualization(facts: Option<&pb::VirtualizationFacts>) -> Judged {
    const NAME: &str = "kvm";
    let Some(facts) = facts else {
        return (NAME, Level::Warn, UPGRADE_CONNECTOR.to_owned());
    };
    let machine = [
        facts.dmi_sys_vendor.as_str(),
        facts.dmi_product_name.as_str(),
    ]
    .into_iter()
    .filter(|name| !name.is_empty())
    .collect::<Vec<_>>()
    .join(" ");
    let virtual_firmware = VIRTUAL_DMI_NAMES.iter().any(|name| {
        machine
            .to_ascii_lowercase()
            .contains(&name.to_ascii_lowercase())
    });
    let nested = match (facts.cpu_hypervisor_flag, virtual_firmware) {
        (true, _) if machine.is_empty() => {
            " The node runs under a hypervisor (the CPU's hypervisor flag).".to_owned()
        }
        (true, _) => format!(
            " The node runs under a hypervisor (the CPU's hypervisor flag; DMI: {machine})."
        ),
        (false, true) => format!(
            " The node runs under a hypervisor (DMI: {machine}), which hides the CPU's hypervisor flag."
        ),
        (false, false) => String::new(),
    };
    let device = &facts.kvm_device;
    if !facts.cpuinfo_error.is_empty() {
        return (
            NAME,
            Level::Warn,
            format!(
                "the CPU flags were not read ({}); KVM was not judged; check pve.cpuinfo in the connector config",
                facts.cpuinfo_error
            ),
        );
    }
    if facts.cpu_virtualization_flag.is_empty() {
        let device_note = if facts.kvm_device_opens {
            format!(
                " {device} opens all the same: a paravirtual layer of the outer hypervisor serves it, under which small guests may run and real ones stop with internal-error."
            )
        } else {
            String::new()
        };
        return (
            NAME,
            Level::Fail,
            format!(
                "the CPU flags name neither vmx nor svm, so qemu-server refuses every sandbox VM (kvm: 1, the default) with \"KVM virtualisation configured, but not available\".{nested}{device_note} Enable VT-x/AMD-V in the firmware, or nested virtualization on the outer hypervisor (a CPU type that passes vmx/svm through)"
            ),
        );
    }
    if !facts.kvm_device_opens {
        return (
            NAME,
            Level::Fail,
            format!(
                "{device} does not open ({}): QEMU cannot run sandbox VMs under KVM.{nested} Load the kvm_intel or kvm_amd module (modprobe), or check the device's permissions",
                facts.kvm_device_error
            ),
        );
    }
    let appliance = if facts.appliance_accelerator == "tcg" {
        "the libguestfs appliance runs under TCG ([guest_network] accelerator = \"tcg\")"
    } else {
        "the libguestfs appliance runs under KVM too"
    };
    if !nested.is_empty() {
        let advice = if facts.appliance_accelerator == "tcg" {
            "Nested KVM may accept guests and still stop them (internal-error): prove the node with one validation of a known-good backup"
        } else {
            "Nested KVM may accept guests and still stop them (internal-error), sandbox VMs and the appliance alike: check once with doctor --boot-appliance, set [guest_network] accelerator = \"tcg\" in the connector config if the appliance does not boot, and prove the node with one validation of a known-good backup"
        };
        return (
            NAME,
            Level::Warn,
            format!(
                "{device} opens and the CPU has {}, from the outer hypervisor's nested virtualization; {appliance}.{nested} {advice}",
                facts.cpu_virtualization_flag
            ),
        );
    }
    (
        NAME,
        Level::Ok,
        format!(
            "{device} opens and the CPU has {}: sandbox VMs run under KVM; {appliance}",
            facts.cpu_virtualization_flag
        ),
    )
}

/// The appliance boot `doctor --boot-appliance` asked for. Judged against what a recovery gets
/// (`limits.guest_network_timeout_secs`, the boot included), not only the bound asked for: a
/// node where it cannot boot within that fails every `network_recovery: rewrite` validation at
/// its deadline.
pub(super) fn judge_appliance_boot(boot: &pb::ApplianceBootFacts) -> Judged {
    const NAME: &str = "appliance";
    let seconds = Duration::from_millis(boot.elapsed_ms).as_secs_f64();
    // An older connector does not say: the bound is then the best guess.
    let recovery_secs = match boot.recovery_timeout_secs {
        0 => boot.within_secs,
        secs => secs,
    };
    if !boot.booted {
        let timed_out = boot.outcome == pb::ApplianceBootOutcome::TimedOut as i32;
        let consequence = if timed_out && boot.within_secs >= recovery_secs {
            format!(
                ": every network_recovery rewrite on this node would fail at its {recovery_secs} s deadline. If the node is nested, set [guest_network] accelerator = \"tcg\" in the connector config; otherwise raise limits.guest_network_timeout_secs"
            )
        } else if timed_out {
            format!(
                "; a recovery gets {recovery_secs} s: ask again with --boot-appliance={recovery_secs} for a verdict on that"
            )
        } else if boot.outcome == pb::ApplianceBootOutcome::Busy as i32 {
            "; ask again once that boot has ended".to_owned()
        } else {
            "; install libguestfs-tools and a kernel in /boot, or fix tools.guestfish in the connector config".to_owned()
        };
        return (
            NAME,
            Level::Fail,
            format!(
                "the libguestfs appliance (accelerator {}) did not boot: {} ({seconds:.1} s){consequence}",
                boot.accelerator, boot.error
            ),
        );
    }
    // Under half of what a recovery gets leaves the recovery itself (inspection, edits) room
    // before its deadline.
    if boot.elapsed_ms.saturating_mul(2) > u64::from(recovery_secs).saturating_mul(1000) {
        return (
            NAME,
            Level::Warn,
            format!(
                "the libguestfs appliance (accelerator {}) booted in {seconds:.1} s, more than half of the {recovery_secs} s a recovery gets: raise limits.guest_network_timeout_secs in the connector config",
                boot.accelerator
            ),
        );
    }
    (
        NAME,
        Level::Ok,
        format!(
            "the libguestfs appliance (accelerator {}) booted in {seconds:.1} s (a recovery gets {recovery_secs} s)",
            boot.accelerator
        ),
    )
}
