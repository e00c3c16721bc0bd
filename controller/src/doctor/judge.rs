//! The judgement of one node's facts: every check of the table in the module doc, in order;
//! the PVE, QEMU and cgroup checks here, the others in their own files.

use super::lvm::judge_lvm_filter;
use super::network::{judge_firewall, judge_forwarding, judge_legacy_nat};
use super::virtualization::{judge_appliance_boot, judge_virtualization};
use super::{Judged, Level, MAX_GRANT_SKEW_MS, MIN_OVERLAY_FREE_BYTES, UPGRADE_CONNECTOR};
use crate::audit::MAX_CLOCK_SKEW_MS;
use certistack_proto::v1 as pb;

/// The leading `major.minor` of a version (`9.0.6`, `1:7.2+dfsg-7`, `10.0.2`).
pub fn major_minor(version: &str) -> Option<(u32, u32)> {
    let version = version.split_once(':').map_or(version, |(_, v)| v);
    let mut numbers = version
        .split(|c: char| !c.is_ascii_digit())
        .map(str::parse::<u32>);
    let major = numbers.next()?.ok()?;
    let minor = numbers.next().and_then(Result::ok).unwrap_or(0);
    Some((major, minor))
}

/// The judgement of a node's facts: (check, level, detail).
pub fn judge(facts: &pb::NodeChecksReply, skew_ms: i64) -> Vec<(&'static str, Level, String)> {
    let mut checks = Vec::new();
    let unreadable = |what: &str, error: &str| format!("{what} not read: {error}");
    checks.push(match major_minor(&facts.pve_manager_version) {
        Some((9, _)) => (
            "pve",
            Level::Ok,
            format!("Proxmox VE {}", facts.pve_manager_version),
        ),
        Some(_) => (
            "pve",
            Level::Fail,
            format!(
                "Proxmox VE {}; CertiStack needs 9.x: upgrade the node",
                facts.pve_manager_version
            ),
        ),
        None => (
            "pve",
            Level::Fail,
            unreadable("pve-manager version", &facts.pve_manager_error)
                + "; is this a Proxmox VE node, and is pve.dpkg_status right?",
        ),
    });
    checks.push(if facts.qemu_server_version.is_empty() {
        (
            "qemu-server",
            Level::Warn,
            unreadable("qemu-server version", &facts.qemu_server_error),
        )
    } else {
        (
            "qemu-server",
            Level::Ok,
            format!("qemu-server {}", facts.qemu_server_version),
        )
    });
    checks.push(match major_minor(&facts.qemu_img_version) {
        Some(version) if version >= (8, 0) => (
            "qemu-img",
            Level::Ok,
            format!("qemu-img {}", facts.qemu_img_version),
        ),
        Some(_) => (
            "qemu-img",
            Level::Warn,
            format!(
                "qemu-img {} is older than the 8.0 this release is meant for (PVE 9 ships 10.x): upgrade pve-qemu-kvm",
                facts.qemu_img_version
            ),
        ),
        None => (
            "qemu-img",
            Level::Fail,
            unreadable("qemu-img version", &facts.qemu_img_error)
                + "; check tools.qemu_img in the connector config",
        ),
    });
    checks.push(match major_minor(&facts.pbs_client_version) {
        Some((4, _)) => (
            "pbs-client",
            Level::Ok,
            format!("proxmox-backup-client {}", facts.pbs_client_version),
        ),
        Some((major, _)) if major > 4 => (
            "pbs-client",
            Level::Warn,
            format!(
                "proxmox-backup-client {}; CertiStack is validated with 4.x: check the release notes",
                facts.pbs_client_version
            ),
        ),
        Some(_) => (
            "pbs-client",
            Level::Fail,
            format!(
                "proxmox-backup-client {}; CertiStack needs 4.x (PVE 9): upgrade proxmox-backup-client",
                facts.pbs_client_version
            ),
        ),
        None => (
            "pbs-client",
            Level::Fail,
            unreadable("proxmox-backup-client version", &facts.pbs_client_error)
                + "; install proxmox-backup-client or fix tools.proxmox_backup_client",
        ),
    });
    for (name, tool, package) in [
        ("nft", &facts.nft, "nftables"),
        ("ip", &facts.ip, "iproute2"),
    ] {
        checks.push(match tool {
            Some(tool) if tool.executable => (name, Level::Ok, format!("{} executable", tool.path)),
            Some(tool) => (
                name,
                Level::Fail,
                format!(
                    "{}; install {package} or fix tools.{name} in the connector config",
                    tool.error
                ),
            ),
            None => (
                name,
                Level::Fail,
                format!("the node did not report {name}; upgrade the connector"),
            ),
        });
    }
    let gb = |bytes: u64| bytes as f64 / 1e9;
    checks.push(if !facts.overlay_error.is_empty() {
        (
            "overlay-space",
            Level::Fail,
            format!(
                "{}; create paths.overlay_root or fix it in the connector config",
                facts.overlay_error
            ),
        )
    } else if facts.overlay_free_bytes < MIN_OVERLAY_FREE_BYTES {
        (
            "overlay-space",
            Level::Warn,
            format!(
                "{:.1} GB free under the overlay root, less than {:.0} GB: a booted guest's writes may fill it; free space or move paths.overlay_root",
                gb(facts.overlay_free_bytes),
                gb(MIN_OVERLAY_FREE_BYTES)
            ),
        )
    } else {
        (
            "overlay-space",
            Level::Ok,
            format!(
                "{:.1} GB free under the overlay root",
                gb(facts.overlay_free_bytes)
            ),
        )
    });
    if facts.overlay_error.is_empty() {
        checks.push(if facts.overlay_shares_pve_cluster_fs {
            (
                "overlay-disk",
                Level::Warn,
                "the overlay root shares a filesystem with /var/lib/pve-cluster: a full overlay disk stops the cluster database; put paths.overlay_root on another disk".to_owned(),
            )
        } else {
            (
                "overlay-disk",
                Level::Ok,
                "the overlay root is not on the cluster database's filesystem".to_owned(),
            )
        });
    }
    checks.push(judge_qemu(facts));
    checks.push(judge_cgroup(facts));
    checks.push(judge_forwarding(facts));
    checks.push(judge_legacy_nat(facts));
    checks.push(judge_lvm_filter(facts.lvm_filter.as_ref()));
    checks.push(judge_firewall(facts.firewall.as_ref()));
    checks.push(judge_virtualization(facts.virtualization.as_ref()));
    // Only when asked (doctor --boot-appliance): a run's doctor step does not boot it.
    if let Some(boot) = &facts.appliance_boot {
        checks.push(judge_appliance_boot(boot));
    }
    checks.push(if skew_ms.abs() > MAX_GRANT_SKEW_MS {
        // A grant is valid from 60 s before the run starts: a node further behind refuses it.
        (
            "clock",
            Level::Fail,
            format!(
                "clock off by {skew_ms} ms: more than the {MAX_GRANT_SKEW_MS} ms a run grant allows, so the node would refuse every run; fix NTP on the node"
            ),
        )
    } else if skew_ms.abs() > MAX_CLOCK_SKEW_MS {
        (
            "clock",
            Level::Warn,
            format!(
                "clock off by {skew_ms} ms (more than {MAX_CLOCK_SKEW_MS} ms); fix NTP on the node"
            ),
        )
    } else {
        ("clock", Level::Ok, format!("clock within {skew_ms} ms"))
    });
    checks
}

/// The QEMU that runs PVE's VMs (`/usr/bin/kvm`), from the `pve-qemu-kvm` package.
pub(super) fn judge_qemu(facts: &pb::NodeChecksReply) -> Judged {
    match major_minor(&facts.qemu_version) {
        Some(version) if version >= (10, 0) => (
            "qemu",
            Level::Ok,
            format!("pve-qemu-kvm {}", facts.qemu_version),
        ),
        Some(_) => (
            "qemu",
            Level::Warn,
            format!(
                "pve-qemu-kvm {} is older than the 10.x PVE 9 ships: upgrade the node (apt full-upgrade)",
                facts.qemu_version
            ),
        ),
        None => (
            "qemu",
            Level::Warn,
            format!(
                "QEMU version not read: {}; PVE runs its VMs with pve-qemu-kvm: is this a Proxmox VE node?",
                facts.qemu_error
            ),
        ),
    }
}

/// The weight PVE 9 gives every VM on cgroup v2 (`cpuunits` default).
pub const PVE_DEFAULT_CPU_WEIGHT: u32 = 100;

pub(super) fn judge_cgroup(facts: &pb::NodeChecksReply) -> Judged {
    let Some(cgroup) = &facts.cgroup else {
        return ("cgroup", Level::Warn, UPGRADE_CONNECTOR.to_owned());
    };
    let units = facts.sandbox_cpu_units;
    match cgroup.sys_fs_cgroup_type.as_str() {
        "cgroup2" if units >= PVE_DEFAULT_CPU_WEIGHT => (
            "cgroup",
            Level::Warn,
            format!(
                "cgroup v2: every VM weighs {PVE_DEFAULT_CPU_WEIGHT} by default (cpuunits), and sandbox VMs weigh {units}, so they do not yield to production VMs; lower limits.sandbox_cpu_units (default 10)"
            ),
        ),
        "cgroup2" => (
            "cgroup",
            Level::Ok,
            format!(
                "cgroup v2: VMs weigh {PVE_DEFAULT_CPU_WEIGHT} by default (cpuunits), sandbox VMs {units}"
            ),
        ),
        "" if !cgroup.error.is_empty() => (
            "cgroup",
            Level::Warn,
            format!(
                "cgroup version not read: {}; check pve.mounts in the connector config",
                cgroup.error
            ),
        ),
        // Nothing on /sys/fs/cgroup in the mount table the connector reads says more about the
        // connector's view (another mount namespace, a pve.mounts pointing elsewhere) than
        // about the node's cgroup version.
        "" => (
            "cgroup",
            Level::Warn,
            "nothing is mounted on /sys/fs/cgroup in the mount table the connector reads (pve.mounts, /proc/self/mounts by default): the connector runs in another mount namespace, or pve.mounts names the wrong file; the cgroup version was not judged".into(),
        ),
        other => (
            "cgroup",
            Level::Fail,
            format!(
                "/sys/fs/cgroup is {other} (cgroup v1 or hybrid): PVE 9 runs on cgroup v2 only and weighs VMs differently on v1; boot the node with the unified hierarchy (remove systemd.unified_cgroup_hierarchy=0 from the kernel command line)"
            ),
        ),
    }
}
