//! `certistack-ctl doctor`: whether a node can run a validation, judged from what its connector
//! reports through the read-only `NodeChecks` call, plus its clock as `Hello` shows it.
//!
//! The node reports facts; the controller decides here, so every node is held to the same
//! rules by the same release:
//!
//! | check | ok | warn | fail |
//! |---|---|---|---|
//! | `connect` | Hello answered | | unreachable (exit 2) |
//! | `surface` | name and surface digest match | | either differs |
//! | `pve` | `pve-manager` 9.x | | another major or unreadable |
//! | `qemu-server` | version read | unreadable | |
//! | `qemu-img` | ≥ 8.0 | older | unreadable |
//! | `pbs-client` | major 4 | newer major (not yet validated) | older major or unreadable |
//! | `nft`, `ip` | executable | | missing or not executable |
//! | `overlay-space` | ≥ 20 GB free | under 20 GB | overlay root unreadable |
//! | `overlay-disk` | own filesystem | shares `/var/lib/pve-cluster`'s | |
//! | `clock` | within 5 s | further off | more than 60 s off (grants would be refused) |
//! | `qemu` | `pve-qemu-kvm` ≥ 10.0 | older or unreadable | |
//! | `cgroup` | cgroup2 on `/sys/fs/cgroup`, sandbox weight under 100 | sandbox weight ≥ 100, or unreadable | v1 or hybrid |
//! | `vnet-forwarding` | off and stays off, or policy `disable-for-run` | off now, but a bare SDN stanza turns it on at `ifreload` | on now under policy `refuse`, or no such VNet |
//! | `legacy-nat` | no legacy NAT rule touches the VNet | | a rule touches it, or the tables cannot be read |
//! | `lvm-filter` | `global_filter` rejects `/dev/loop*` | it does not (the fixing line is printed), or unreadable | |
//! | `firewall` | pve-firewall, or proxmox-firewall with its tables loaded | host.fw and the loaded tables disagree, or unreadable | |
//! | `kvm` | `/dev/kvm` opens, the CPU has `vmx`/`svm`, not a VM | the same on a node that is itself a VM (hypervisor flag or virtual DMI names: nested), or flags unreadable | no `vmx`/`svm` (qemu-server refuses `kvm: 1` VMs), or `/dev/kvm` does not open |
//! | `appliance` (only with `--boot-appliance`) | booted within half of what a recovery gets | booted, in more than half of it | did not boot within its bound, or guestfish failed |
//!
//! The PBS client is a warning above major 4 rather than a failure: the map/unmap interface the
//! connector drives has been stable across majors, and PVE 9 ships 4.x; below 4 it fails,
//! because 3.x belongs to PVE 8. An older `qemu-img` is a warning, not a failure: PVE 9 ships
//! 10.x, but the only features the connector uses (`create -f qcow2 -b DEV -F raw`, `info`) are
//! much older, and the test suite runs them with Debian 12's 7.2.

use crate::audit::{self, MAX_CLOCK_SKEW_MS};

/// The clock difference past which a node refuses run grants (they are valid from
/// `plan::NOT_BEFORE_SLACK_SECS` before the run starts).
pub const MAX_GRANT_SKEW_MS: i64 = crate::plan::NOT_BEFORE_SLACK_SECS * 1000;
use crate::authority::IssuedCertificate;
use crate::client;
use crate::config::InventoryNode;
use certistack_connector::validate::VnetName;
use certistack_proto::v1 as pb;
use std::sync::Arc;
use std::time::Duration;

/// Free space under the overlay root below which a run may fill the disk (bytes, 20 GB).
pub const MIN_OVERLAY_FREE_BYTES: u64 = 20_000_000_000;
/// Connecting, Hello and NodeChecks together, per node.
pub const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_secs(30);
/// What an appliance boot may take beyond its own bound (killing it, its reply).
pub const APPLIANCE_BOOT_MARGIN: Duration = Duration::from_secs(60);
/// DMI system vendors and product names of virtual machines: a hypervisor may hide the CPU's
/// `hypervisor` flag, not its firmware's names (systemd's `src/basic/virt.c` reads the same).
const VIRTUAL_DMI_NAMES: &[&str] = &[
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

/// The name of the check that fails when a node cannot be asked at all.
pub const CONNECT: &str = "connect";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Ok => "ok",
            Level::Warn => "warn",
            Level::Fail => "fail",
        }
    }
}

/// One judged prerequisite of one node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Check {
    pub node: String,
    pub check: &'static str,
    pub level: Level,
    /// What was found and, unless ok, what to do.
    pub detail: String,
}

impl Check {
    /// `node check ok|warn|fail detail`, as `certistack-ctl doctor` prints it.
    pub fn line(&self) -> String {
        format!(
            "{} {} {} {}",
            self.node,
            self.check,
            self.level.as_str(),
            self.detail
        )
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

/// Whether a run may start on the node: no check failed.
pub fn passes(checks: &[Check]) -> bool {
    checks.iter().all(|check| check.level != Level::Fail)
}

/// Connects to `node` as the operator `identity`, checks its Hello and judges what its
/// NodeChecks reports about it and about the sandbox `vnet`, all within `timeout`.
/// Unreachable: one failed `connect` check.
pub async fn check_node(
    node: &InventoryNode,
    ca_pem: &str,
    identity: &IssuedCertificate,
    vnet: Option<&VnetName>,
    boot_appliance: Option<Duration>,
    timeout: Duration,
) -> Vec<Check> {
    let request = pb::NodeChecksRequest {
        vnet: vnet.map(ToString::to_string).unwrap_or_default(),
        boot_appliance_within_secs: boot_appliance.map_or(0, |within| {
            u32::try_from(within.as_secs().max(1)).unwrap_or(u32::MAX)
        }),
    };
    // The appliance's boot comes on top of the node's other checks, with room for the node to
    // wait for a boot another operator started.
    let timeout = match boot_appliance {
        Some(within) => timeout
            .saturating_add(within)
            .saturating_add(APPLIANCE_BOOT_MARGIN),
        None => timeout,
    };
    let name = node.name.to_string();
    let endpoint = node.endpoint();
    let asked = tokio::time::timeout(timeout, async {
        let mut connection = client::connect(&endpoint, &name, ca_pem, identity).await?;
        let (hello, skew_ms) = audit::hello_with_skew(&mut connection).await?;
        if let Err(mismatch) = client::check_hello(&hello, &name) {
            return Ok(Err(mismatch.to_string()));
        }
        let facts = connection.node_checks(request).await?.into_inner();
        Ok::<_, client::NodeError>(Ok((facts, skew_ms)))
    })
    .await;
    let check = |check: &'static str, level: Level, detail: String| Check {
        node: name.clone(),
        check,
        level,
        detail,
    };
    match asked {
        Err(_) => vec![check(
            CONNECT,
            Level::Fail,
            format!(
                "no answer from {endpoint} within {} s; check the connector runs and the network",
                timeout.as_secs_f64()
            ),
        )],
        Ok(Err(error)) => vec![check(CONNECT, Level::Fail, format!("{endpoint}: {error}"))],
        Ok(Ok(Err(mismatch))) => vec![
            check(CONNECT, Level::Ok, format!("{endpoint} answered")),
            check("surface", Level::Fail, mismatch),
        ],
        Ok(Ok(Ok((facts, skew_ms)))) => {
            let mut checks = vec![
                check(CONNECT, Level::Ok, format!("{endpoint} answered")),
                check(
                    "surface",
                    Level::Ok,
                    "name and surface digest match".to_owned(),
                ),
            ];
            checks.extend(
                judge(&facts, skew_ms)
                    .into_iter()
                    .map(|(name, level, detail)| check(name, level, detail)),
            );
            checks
        }
    }
}

/// The sandbox VNet checked on each node, by node name.
pub type VnetsByNode = std::collections::BTreeMap<String, VnetName>;

/// Every node concurrently (at most `concurrency` at once), each with its VNet from `vnets`;
/// checks in inventory order.
pub async fn check_fleet<'a>(
    nodes: impl IntoIterator<Item = &'a InventoryNode>,
    ca_pem: &str,
    identity: Arc<IssuedCertificate>,
    vnets: Arc<VnetsByNode>,
    boot_appliance: Option<Duration>,
    concurrency: usize,
    timeout: Duration,
) -> Vec<Vec<Check>> {
    let ca_pem: Arc<str> = Arc::from(ca_pem);
    audit::for_each_node(
        nodes,
        concurrency,
        move |node| {
            let (ca_pem, identity, vnets) = (ca_pem.clone(), identity.clone(), vnets.clone());
            async move {
                let vnet = vnets.get(&node.name.to_string());
                check_node(&node, &ca_pem, &identity, vnet, boot_appliance, timeout).await
            }
        },
        |node| {
            vec![Check {
                node: node.name.to_string(),
                check: CONNECT,
                level: Level::Fail,
                detail: "the check was stopped".to_owned(),
            }]
        },
    )
    .await
}

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

type Judged = (&'static str, Level, String);

const UPGRADE_CONNECTOR: &str = "the node did not report it; upgrade the connector";

/// The QEMU that runs PVE's VMs (`/usr/bin/kvm`), from the `pve-qemu-kvm` package.
fn judge_qemu(facts: &pb::NodeChecksReply) -> Judged {
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

fn judge_cgroup(facts: &pb::NodeChecksReply) -> Judged {
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

/// Whether sandbox VMs get KVM. qemu-server starts a VM with `kvm: 1` (the default, which the
/// connector keeps) only when the CPU flags name `vmx` or `svm` (`PVE::QemuServer`
/// `config_to_command`: "KVM virtualisation configured, but not available"), and QEMU needs
/// `/dev/kvm`. A node that is itself a VM gets both from its outer hypervisor, whose nested
/// virtualization may still stop real guests: only a boot shows it.
fn judge_virtualization(facts: Option<&pb::VirtualizationFacts>) -> Judged {
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
fn judge_appliance_boot(boot: &pb::ApplianceBootFacts) -> Judged {
    const NAME: &str = "appliance";
    let seconds = Duration::from_millis(boot.elapsed_ms).as_secs_f64();
    // An older connector does not say: the bound is then the best guess.
    let recovery_secs = match boot.recovery_timeout_secs {
        0 => boot.within_secs,
        secs => secs,
    };
    if !boot.booted {
        let consequence = if boot.error.contains("did not boot within")
            && boot.within_secs >= recovery_secs
        {
            format!(
                ": every network_recovery rewrite on this node would fail at its {recovery_secs} s deadline. If the node is nested, set [guest_network] accelerator = \"tcg\" in the connector config; otherwise raise limits.guest_network_timeout_secs"
            )
        } else if boot.error.contains("did not boot within") {
            format!(
                "; a recovery gets {recovery_secs} s: ask again with --boot-appliance={recovery_secs} for a verdict on that"
            )
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

/// Whether a forwarding sysctl or ifupdown2 attribute value means "on".
fn is_on(value: &str) -> bool {
    matches!(value.trim(), "1" | "on" | "yes")
}

/// Why `ifreload -a` writes forwarding=1 on the VNet's bridge, or `None` when it writes 0.
/// ifupdown2 (`addons/address.py` `_set_bridge_forwarding`) writes 0 only on a bridge with
/// no upper interface, no `address` and an address method other than `dhcp` (and, patched by
/// Proxmox, `auto`); 1 otherwise, for IPv4 and IPv6. `ip-forward off` is no exception: 3.2.0
/// ignores it on bridges and 3.9.0 applies it only after writing 1.
fn reload_turns_forwarding_on(vnet: &pb::VnetFacts) -> Option<String> {
    let name = &vnet.name;
    let stanza = format!("iface {name} in {}", vnet.stanza_file);
    // `inet static`: the family, then the method.
    let method = vnet.address_method.split_whitespace().nth(1).unwrap_or("");
    if vnet.address_present {
        Some(format!("{stanza} has an address"))
    } else if method.is_empty() {
        Some(format!("{stanza} has no address method"))
    } else if matches!(method, "dhcp" | "auto") {
        Some(format!("{stanza} uses the {method} method"))
    } else {
        None
    }
}

fn judge_forwarding(facts: &pb::NodeChecksReply) -> Judged {
    const NAME: &str = "vnet-forwarding";
    let Some(vnet) = &facts.vnet else {
        return (
            NAME,
            Level::Ok,
            "not checked: no VNet named (give --vnet VNET or --plan PLAN)".to_owned(),
        );
    };
    let name = &vnet.name;
    let refuse = facts.forwarding_policy != "disable-for-run";
    if vnet.ipv4_forwarding.is_empty() {
        return (
            NAME,
            Level::Fail,
            format!(
                "VNet {name} does not exist on this node (no /proc/sys/net/ipv4/conf/{name}): PrepareSandbox would refuse it; create it in SDN and apply (pvesh set /cluster/sdn)"
            ),
        );
    }
    let on_now: Vec<String> = [
        ("ipv4", &vnet.ipv4_forwarding),
        ("ipv6", &vnet.ipv6_forwarding),
    ]
    .into_iter()
    .filter(|(_, value)| is_on(value))
    .map(|(family, value)| format!("net.{family}.conf.{name}.forwarding = {value}"))
    .collect();
    if !on_now.is_empty() {
        return if refuse {
            (
                NAME,
                Level::Fail,
                format!(
                    "{} now: with sandbox.forwarding = \"refuse\" PrepareSandbox refuses this VNet; set sandbox.forwarding = \"disable-for-run\" in the connector config, or turn forwarding off on {name}",
                    on_now.join(", ")
                ),
            )
        } else {
            (
                NAME,
                Level::Ok,
                format!(
                    "{} now; sandbox.forwarding = \"disable-for-run\" sets it to 0 for each run and restores it at release",
                    on_now.join(", ")
                ),
            )
        };
    }
    if !vnet.stanza_error.is_empty() {
        return (
            NAME,
            Level::Warn,
            format!(
                "forwarding is off on {name} now, but what ifreload writes is unknown: {}; check pve.sdn_interfaces",
                vnet.stanza_error
            ),
        );
    }
    if !vnet.stanza_found {
        return (
            NAME,
            Level::Ok,
            format!(
                "forwarding is off on {name}; {} has no stanza for it, so ifreload -a leaves it",
                vnet.stanza_file
            ),
        );
    }
    if let Some(stanza) = reload_turns_forwarding_on(vnet) {
        return if refuse {
            (
                NAME,
                Level::Warn,
                format!(
                    "forwarding is off on {name} now, but {stanza}: ifupdown2 sets forwarding=1 on reload; set sandbox.forwarding = \"disable-for-run\""
                ),
            )
        } else {
            (
                NAME,
                Level::Ok,
                format!(
                    "{stanza}, so ifreload -a may turn forwarding on; sandbox.forwarding = \"disable-for-run\" turns it off for each run"
                ),
            )
        };
    }
    (
        NAME,
        Level::Ok,
        format!(
            "forwarding is off on {name} and its stanza keeps it off (iface {name} {} without an address)",
            vnet.address_method
        ),
    )
}

fn judge_legacy_nat(facts: &pb::NodeChecksReply) -> Judged {
    const NAME: &str = "legacy-nat";
    let Some(nat) = &facts.legacy_nat else {
        return (NAME, Level::Warn, UPGRADE_CONNECTOR.to_owned());
    };
    // SDN's SNAT names the subnet and the uplink, never the VNet: its stanza says it is there.
    if let Some(line) = facts.vnet.as_ref().and_then(|vnet| vnet.snat_lines.first()) {
        return (
            NAME,
            Level::Fail,
            format!(
                "SDN SNAT is configured on this VNet's subnet ({line}){}: remove `snat` from the subnet in Datacenter → SDN → VNets, then apply SDN",
                match nat.vnet_rules.first() {
                    Some(rule) => format!(", loaded in iptables-legacy as {rule}"),
                    None => String::new(),
                }
            ),
        );
    }
    if let Some(rule) = nat.vnet_rules.first() {
        let vnet = facts
            .vnet
            .as_ref()
            .map(|v| v.name.as_str())
            .unwrap_or("the VNet");
        return (
            NAME,
            Level::Fail,
            format!(
                "a NAT rule in iptables-legacy touches {vnet}: {rule}{}; PrepareSandbox refuses the VNet: remove SNAT from its SDN subnet (or the rule)",
                match nat.vnet_rules.len() {
                    1 => String::new(),
                    more => format!(" (and {} more)", more - 1),
                }
            ),
        );
    }
    if !nat.error.is_empty() {
        return (
            NAME,
            Level::Fail,
            format!(
                "{}; PrepareSandbox cannot complete its NAT check either: fix tools.iptables_legacy_save / limits.max_ruleset_bytes",
                nat.error
            ),
        );
    }
    let read = nat.sources.join("; ");
    match &facts.vnet {
        Some(vnet) => (
            NAME,
            Level::Ok,
            format!(
                "{} legacy NAT rule(s), none touches {} ({read})",
                nat.rule_count, vnet.name
            ),
        ),
        None => (
            NAME,
            Level::Ok,
            format!(
                "{} legacy NAT rule(s), not checked against a VNet (give --vnet or --plan) ({read})",
                nat.rule_count
            ),
        ),
    }
}

/// The pattern that keeps LVM off every loop device and its partitions.
pub const LOOP_REJECT: &str = "r|/dev/loop.*|";
/// PVE's own `global_filter` (pve-manager's postinst `set_lvm_conf` writes it into lvm.conf's
/// `devices` section): ZFS zvols, Ceph RBDs and network block devices.
pub const PVE_GLOBAL_FILTER: [&str; 3] = ["r|/dev/zd.*|", "r|/dev/rbd.*|", "r|/dev/nbd.*|"];
/// Device names a backup mapping shows to LVM (the loop device and its scanned partitions).
const LOOP_DEVICES: [&str; 3] = ["/dev/loop0", "/dev/loop3p1", "/dev/loop12p2"];

/// What one `global_filter` pattern does to `device`: `Some(true)` rejects, `Some(false)`
/// accepts, `None` does not match. `Err` for a pattern this release cannot read.
fn filter_decision(pattern: &str, device: &str) -> Result<Option<bool>, String> {
    let mut chars = pattern.chars();
    let reject = match chars.next() {
        Some('r') => true,
        Some('a') => false,
        _ => return Err(format!("\"{pattern}\" starts with neither a nor r")),
    };
    let delimiter = chars
        .next()
        .ok_or_else(|| format!("\"{pattern}\" has no expression"))?;
    let body = chars.as_str();
    let expression = body
        .strip_suffix(delimiter)
        .ok_or_else(|| format!("\"{pattern}\" does not end with its delimiter {delimiter}"))?;
    let regex = regex::Regex::new(expression).map_err(|error| {
        format!("\"{pattern}\" is not a regular expression this release reads: {error}")
    })?;
    Ok(regex.is_match(device).then_some(reject))
}

/// Whether `patterns` (first match wins; no match accepts) reject every loop device name.
fn rejects_loop_devices(patterns: &[String]) -> Result<bool, String> {
    for device in LOOP_DEVICES {
        let mut decided = None;
        for pattern in patterns {
            if let Some(reject) = filter_decision(pattern, device)? {
                decided = Some(reject);
                break;
            }
        }
        if decided != Some(true) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The `global_filter` line that keeps `patterns` and rejects loop devices: the loop reject
/// goes before the first pattern that would accept a loop device (first match wins).
pub fn filter_fix(patterns: &[String]) -> String {
    let mut fixed: Vec<String> = if patterns.is_empty() {
        PVE_GLOBAL_FILTER.iter().map(|p| (*p).to_owned()).collect()
    } else {
        patterns.to_vec()
    };
    let at = fixed
        .iter()
        .position(|pattern| {
            LOOP_DEVICES
                .iter()
                .any(|device| filter_decision(pattern, device) == Ok(Some(false)))
        })
        .unwrap_or(fixed.len());
    fixed.insert(at, LOOP_REJECT.to_owned());
    format!(
        "global_filter = [ {} ]",
        fixed
            .iter()
            .map(|p| format!("\"{p}\""))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

fn judge_lvm_filter(lvm: Option<&pb::LvmFilterFacts>) -> Judged {
    const NAME: &str = "lvm-filter";
    let Some(lvm) = lvm else {
        return (NAME, Level::Warn, UPGRADE_CONNECTOR.to_owned());
    };
    let why = "backup mappings are scanned for partitions, so a guest's LVM volumes on /dev/loopNpM become the host's";
    if !lvm.error.is_empty() {
        return (
            NAME,
            Level::Warn,
            format!(
                "{}; {why}: make sure the devices section of lvm.conf has {}",
                lvm.error,
                filter_fix(&[])
            ),
        );
    }
    if !lvm.found {
        return (
            NAME,
            Level::Warn,
            format!(
                "{} sets no devices/global_filter, so LVM scans loop devices: {why}; put this line in its devices section: {}",
                lvm.path,
                filter_fix(&[])
            ),
        );
    }
    match rejects_loop_devices(&lvm.patterns) {
        Ok(true) => (
            NAME,
            Level::Ok,
            format!("{} global_filter rejects loop devices", lvm.path),
        ),
        Ok(false) => (
            NAME,
            Level::Warn,
            format!(
                "{} global_filter does not reject loop devices: {why}; replace it in the devices section with: {}",
                lvm.path,
                filter_fix(&lvm.patterns)
            ),
        ),
        Err(unreadable) => (
            NAME,
            Level::Warn,
            format!(
                "{} global_filter cannot be judged ({unreadable}); make sure it rejects /dev/loop* like: {}",
                lvm.path,
                filter_fix(&lvm.patterns)
            ),
        ),
    }
}

fn judge_firewall(firewall: Option<&pb::FirewallFacts>) -> Judged {
    const NAME: &str = "firewall";
    let Some(fw) = firewall else {
        return (NAME, Level::Warn, UPGRADE_CONNECTOR.to_owned());
    };
    let errors: Vec<&str> = [
        fw.host_fw_error.as_str(),
        fw.cluster_fw_error.as_str(),
        fw.nft_error.as_str(),
    ]
    .into_iter()
    .filter(|e| !e.is_empty())
    .collect();
    if !errors.is_empty() {
        return (
            NAME,
            Level::Warn,
            format!(
                "firewall not determined: {}; check pve.nodes_dir and tools.nft",
                errors.join("; ")
            ),
        );
    }
    // proxmox-firewall keeps its tables only while the datacenter firewall and the host's
    // `nftables` option are both on; otherwise it removes them.
    let datacenter_on = is_on(&fw.datacenter_enable_option);
    let selected = is_on(&fw.nftables_option);
    let loaded = fw.proxmox_firewall_table || fw.proxmox_firewall_guests_table;
    match (datacenter_on && selected, loaded) {
        (true, true) => (
            NAME,
            Level::Ok,
            "proxmox-firewall (nftables): its table inet proxmox-firewall hooks at priorities filter-1, filter and filter+1 and its table bridge proxmox-firewall-guests at 0, and a drop there is final, so a VNet firewall with a DROP policy can drop probe traffic; keep the sandbox VNet's firewall off or allow the probe ports".to_owned(),
        ),
        (true, false) => (
            NAME,
            Level::Warn,
            format!(
                "{} enables the datacenter firewall and {} selects proxmox-firewall (nftables: {}), but its tables are not loaded: check proxmox-firewall.service (systemctl status proxmox-firewall)",
                fw.cluster_fw, fw.host_fw, fw.nftables_option
            ),
        ),
        (false, true) => (
            NAME,
            Level::Warn,
            format!(
                "proxmox-firewall tables are loaded, but {}: proxmox-firewall removes its tables in that case, so these are leftovers or it is not running; restart proxmox-firewall.service (systemctl restart proxmox-firewall) so one firewall remains",
                if selected {
                    format!("the datacenter firewall is off ({} has no enable: 1)", fw.cluster_fw)
                } else {
                    format!("{} does not select nftables", fw.host_fw)
                }
            ),
        ),
        (false, false) if selected => (
            NAME,
            Level::Ok,
            format!(
                "{} selects nftables, but the datacenter firewall is off ({} has no enable: 1), so proxmox-firewall loads no tables and no host firewall filters; SDN's SNAT lives in iptables-legacy, which the legacy-nat check reads",
                fw.host_fw, fw.cluster_fw
            ),
        ),
        (false, false) => (
            NAME,
            Level::Ok,
            "pve-firewall (iptables-legacy) or none: its rules and SDN's SNAT live in iptables-legacy, which the legacy-nat check reads".to_owned(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn healthy() -> pb::NodeChecksReply {
        let tool = |path: &str| pb::ToolPresence {
            path: path.into(),
            executable: true,
            error: String::new(),
        };
        pb::NodeChecksReply {
            pve_manager_version: "9.0.6".into(),
            qemu_server_version: "9.0.18".into(),
            qemu_img_version: "10.0.2".into(),
            pbs_client_version: "4.0.14".into(),
            nft: Some(tool("/usr/sbin/nft")),
            ip: Some(tool("/usr/sbin/ip")),
            overlay_free_bytes: 100_000_000_000,
            qemu_version: "10.0.2-4".into(),
            cgroup: Some(pb::CgroupFacts {
                sys_fs_cgroup_type: "cgroup2".into(),
                error: String::new(),
            }),
            forwarding_policy: "refuse".into(),
            sandbox_cpu_units: 10,
            vnet: Some(pb::VnetFacts {
                name: "csbox1".into(),
                ipv4_forwarding: "0".into(),
                ipv6_forwarding: "0".into(),
                stanza_file: "/etc/network/interfaces.d/sdn".into(),
                ..Default::default()
            }),
            legacy_nat: Some(pb::LegacyNatFacts {
                sources: vec!["/usr/sbin/iptables-legacy-save -t nat: 120 bytes read".into()],
                rule_count: 1,
                ..Default::default()
            }),
            lvm_filter: Some(pb::LvmFilterFacts {
                path: "/etc/lvm/lvm.conf".into(),
                found: true,
                patterns: vec![
                    "r|/dev/zd.*|".into(),
                    "r|/dev/rbd.*|".into(),
                    "r|/dev/loop.*|".into(),
                ],
                error: String::new(),
            }),
            firewall: Some(pb::FirewallFacts::default()),
            virtualization: Some(pb::VirtualizationFacts {
                kvm_device: "/dev/kvm".into(),
                kvm_device_opens: true,
                cpu_virtualization_flag: "vmx".into(),
                dmi_sys_vendor: "Supermicro".into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn kvm_is_judged_as_qemu_server_and_a_nested_node_need_it() {
        let (level, detail) = detail_of(&healthy(), "kvm");
        assert_eq!(level, Level::Ok, "{detail}");
        // A nested node whose outer hypervisor passes vmx through: it may still stop guests.
        let mut facts = healthy();
        let virt = facts.virtualization.as_mut().unwrap();
        virt.cpu_hypervisor_flag = true;
        virt.dmi_sys_vendor = "QEMU".into();
        virt.dmi_product_name = "Standard PC (Q35 + ICH9, 2009)".into();
        let (level, detail) = detail_of(&facts, "kvm");
        assert_eq!(level, Level::Warn, "{detail}");
        assert!(detail.contains("QEMU Standard PC"), "{detail}");
        assert!(
            detail.contains("--boot-appliance") && detail.contains("accelerator = \"tcg\""),
            "{detail}"
        );
        // A /dev/kvm from a paravirtual layer (no vmx/svm): qemu-server refuses kvm: 1.
        facts
            .virtualization
            .as_mut()
            .unwrap()
            .cpu_virtualization_flag = String::new();
        let (level, detail) = detail_of(&facts, "kvm");
        assert_eq!(level, Level::Fail, "{detail}");
        assert!(
            detail.contains("KVM virtualisation configured, but not available"),
            "{detail}"
        );
        assert!(detail.contains("opens all the same"), "{detail}");
        // Hardware virtualization but no device.
        let mut facts = healthy();
        let virt = facts.virtualization.as_mut().unwrap();
        virt.kvm_device_opens = false;
        virt.kvm_device_error = "No such file or directory (os error 2)".into();
        let (level, detail) = detail_of(&facts, "kvm");
        assert_eq!(level, Level::Fail, "{detail}");
        assert!(detail.contains("modprobe"), "{detail}");
        // A hypervisor that hides the CPU flag still names itself in the firmware.
        let mut facts = healthy();
        let virt = facts.virtualization.as_mut().unwrap();
        virt.dmi_sys_vendor = "VMware, Inc.".into();
        virt.dmi_product_name = "VMware7,1".into();
        let (level, detail) = detail_of(&facts, "kvm");
        assert_eq!(level, Level::Warn, "{detail}");
        assert!(
            detail.contains("hides the CPU's hypervisor flag"),
            "{detail}"
        );
        // Already set to TCG: the advice is the validation, not the setting.
        facts.virtualization.as_mut().unwrap().appliance_accelerator = "tcg".into();
        let (_, detail) = detail_of(&facts, "kvm");
        assert!(detail.contains("runs under TCG"), "{detail}");
        assert!(!detail.contains("--boot-appliance"), "{detail}");
        // An older connector reports nothing.
        let mut facts = healthy();
        facts.virtualization = None;
        assert_eq!(detail_of(&facts, "kvm").0, Level::Warn);
    }

    #[test]
    fn the_appliance_boot_is_judged_against_what_a_recovery_gets() {
        assert!(
            judge(&healthy(), 0)
                .iter()
                .all(|(name, _, _)| *name != "appliance"),
            "a boot nobody asked for is no check"
        );
        let boot = |booted: bool, elapsed_ms: u64, within_secs: u32| {
            let mut facts = healthy();
            facts.appliance_boot = Some(pb::ApplianceBootFacts {
                accelerator: "auto".into(),
                within_secs,
                recovery_timeout_secs: 300,
                booted,
                elapsed_ms,
                error: if booted {
                    String::new()
                } else {
                    format!("the appliance did not boot within {within_secs} s and was killed")
                },
            });
            detail_of(&facts, "appliance")
        };
        let (level, detail) = boot(true, 11_900, 300);
        assert_eq!(level, Level::Ok, "{detail}");
        assert!(
            detail.contains("11.9 s") && detail.contains("300 s"),
            "{detail}"
        );
        // Slow against the recovery's 300 s, whatever bound was asked for.
        assert_eq!(boot(true, 150_001, 300).0, Level::Warn);
        assert_eq!(boot(true, 20_000, 30).0, Level::Ok);
        let (level, detail) = boot(false, 300_000, 300);
        assert_eq!(level, Level::Fail);
        assert!(
            detail.contains("would fail at its 300 s deadline")
                && detail.contains("accelerator = \"tcg\""),
            "{detail}"
        );
        // A short bound that passed says nothing about the recovery's.
        let (level, detail) = boot(false, 30_000, 30);
        assert_eq!(level, Level::Fail);
        assert!(!detail.contains("would fail"), "{detail}");
        assert!(detail.contains("--boot-appliance=300"), "{detail}");
    }

    fn detail_of(facts: &pb::NodeChecksReply, name: &str) -> (Level, String) {
        judge(facts, 0)
            .into_iter()
            .find(|(check, _, _)| *check == name)
            .map(|(_, level, detail)| (level, detail))
            .unwrap()
    }

    #[test]
    fn qemu_and_cgroup_are_judged_for_pve_9() {
        let mut facts = healthy();
        facts.qemu_version = "9.2.0-7".into();
        assert_eq!(level_of(&facts, 0, "qemu"), Level::Warn);
        facts.qemu_version = String::new();
        facts.qemu_error = "package pve-qemu-kvm is not installed".into();
        assert_eq!(level_of(&facts, 0, "qemu"), Level::Warn);
        let mut facts = healthy();
        facts.cgroup = Some(pb::CgroupFacts {
            sys_fs_cgroup_type: "tmpfs".into(),
            error: String::new(),
        });
        let (level, detail) = detail_of(&facts, "cgroup");
        assert_eq!(level, Level::Fail);
        assert!(detail.contains("PVE 9 runs on cgroup v2 only"), "{detail}");
        // Nothing mounted there is the connector's view, not the node's cgroup version.
        facts.cgroup = Some(pb::CgroupFacts::default());
        let (level, detail) = detail_of(&facts, "cgroup");
        assert_eq!(level, Level::Warn);
        assert!(detail.contains("another mount namespace"), "{detail}");
        let mut facts = healthy();
        facts.sandbox_cpu_units = 100;
        let (level, detail) = detail_of(&facts, "cgroup");
        assert_eq!(level, Level::Warn);
        assert!(detail.contains("limits.sandbox_cpu_units"), "{detail}");
    }

    #[test]
    fn forwarding_is_judged_now_and_after_ifreload_by_the_policy() {
        let with_vnet = |edit: &dyn Fn(&mut pb::VnetFacts), policy: &str| {
            let mut facts = healthy();
            facts.forwarding_policy = policy.into();
            edit(facts.vnet.as_mut().unwrap());
            detail_of(&facts, "vnet-forwarding")
        };
        // Off, no SDN stanza: nothing will turn it on.
        assert_eq!(with_vnet(&|_| {}, "refuse").0, Level::Ok);
        // Off now, but a bare stanza: ifupdown2 turns it on at the next reload.
        let bare = |v: &mut pb::VnetFacts| v.stanza_found = true;
        let (level, detail) = with_vnet(&bare, "refuse");
        assert_eq!(level, Level::Warn);
        assert!(
            detail.contains(
                "ifupdown2 sets forwarding=1 on reload; set sandbox.forwarding = \"disable-for-run\""
            ),
            "{detail}"
        );
        assert_eq!(with_vnet(&bare, "disable-for-run").0, Level::Ok);
        // ifupdown2's rule for what a reload writes: 0 only with a method other than dhcp or
        // auto and no address; `ip-forward off` does not keep it off on a bridge.
        let stanza = |method: &'static str, address: bool, ip_forward: &'static str| {
            move |v: &mut pb::VnetFacts| {
                v.stanza_found = true;
                v.address_method = method.into();
                v.address_present = address;
                v.ip_forward = ip_forward.into();
                v.ip6_forward = ip_forward.into();
            }
        };
        for (method, address, ip_forward, reason) in [
            ("", false, "off", "has no address method"),
            ("inet static", true, "", "has an address"),
            ("inet manual", true, "off", "has an address"),
            ("inet dhcp", false, "", "uses the dhcp method"),
            ("inet6 auto", false, "off", "uses the auto method"),
        ] {
            let (level, detail) = with_vnet(&stanza(method, address, ip_forward), "refuse");
            assert_eq!(level, Level::Warn, "{method} {address} {detail}");
            assert!(
                detail.contains(&format!(
                    "iface csbox1 in /etc/network/interfaces.d/sdn {reason}: ifupdown2 sets forwarding=1 on reload"
                )),
                "{detail}"
            );
            assert_eq!(
                with_vnet(&stanza(method, address, ip_forward), "disable-for-run").0,
                Level::Ok
            );
        }
        for method in ["inet manual", "inet static", "inet6 manual"] {
            let (level, detail) = with_vnet(&stanza(method, false, ""), "refuse");
            assert_eq!(level, Level::Ok, "{detail}");
            assert_eq!(
                detail,
                format!(
                    "forwarding is off on csbox1 and its stanza keeps it off (iface csbox1 {method} without an address)"
                )
            );
        }
        // On now: refused under "refuse", handled under "disable-for-run".
        let on = |v: &mut pb::VnetFacts| v.ipv6_forwarding = "1".into();
        let (level, detail) = with_vnet(&on, "refuse");
        assert_eq!(level, Level::Fail);
        assert!(
            detail.contains("net.ipv6.conf.csbox1.forwarding = 1"),
            "{detail}"
        );
        assert_eq!(with_vnet(&on, "disable-for-run").0, Level::Ok);
        // No such VNet on the node.
        let absent = |v: &mut pb::VnetFacts| {
            v.ipv4_forwarding.clear();
            v.ipv6_forwarding.clear();
        };
        assert_eq!(with_vnet(&absent, "refuse").0, Level::Fail);
        let unreadable = |v: &mut pb::VnetFacts| v.stanza_error = "cannot read".into();
        assert_eq!(with_vnet(&unreadable, "refuse").0, Level::Warn);
        // Without a VNet the check says how to ask for it.
        let mut facts = healthy();
        facts.vnet = None;
        let (level, detail) = detail_of(&facts, "vnet-forwarding");
        assert_eq!(level, Level::Ok);
        assert!(detail.contains("--vnet"), "{detail}");
    }

    #[test]
    fn a_legacy_nat_rule_on_the_vnet_fails_with_the_rule() {
        let mut facts = healthy();
        facts.legacy_nat.as_mut().unwrap().vnet_rules = vec![
            "-A POSTROUTING -o csbox1 -j MASQUERADE (/usr/sbin/iptables-legacy-save -t nat)".into(),
        ];
        let (level, detail) = detail_of(&facts, "legacy-nat");
        assert_eq!(level, Level::Fail);
        assert!(
            detail.contains("-A POSTROUTING -o csbox1 -j MASQUERADE"),
            "{detail}"
        );
        let mut facts = healthy();
        facts.legacy_nat.as_mut().unwrap().error = "iptables-legacy-save failed".into();
        assert_eq!(level_of(&facts, 0, "legacy-nat"), Level::Fail);
        // SDN's SNAT names the subnet, not the VNet: the stanza's post-up line says so, and the
        // rule found by its subnet is named with it.
        let snat = "iptables -t nat -A POSTROUTING -s '10.7.3.0/24' -o vmbr0 -j SNAT --to-source 192.0.2.10";
        let mut facts = healthy();
        facts.vnet.as_mut().unwrap().snat_lines = vec![snat.into()];
        let (level, detail) = detail_of(&facts, "legacy-nat");
        assert_eq!(level, Level::Fail);
        assert_eq!(
            detail,
            format!(
                "SDN SNAT is configured on this VNet's subnet ({snat}): remove `snat` from the subnet in Datacenter → SDN → VNets, then apply SDN"
            )
        );
        let loaded = "-A POSTROUTING -s 10.7.3.0/24 -o vmbr0 -j SNAT --to-source 192.0.2.10 (/usr/sbin/iptables-legacy-save -t nat)";
        facts.legacy_nat.as_mut().unwrap().vnet_rules = vec![loaded.into()];
        let (level, detail) = detail_of(&facts, "legacy-nat");
        assert_eq!(level, Level::Fail);
        assert!(
            detail.contains(&format!(
                "({snat}), loaded in iptables-legacy as {loaded}: remove"
            )),
            "{detail}"
        );
        let (level, detail) = detail_of(&healthy(), "legacy-nat");
        assert_eq!(level, Level::Ok);
        assert!(
            detail.starts_with("1 legacy NAT rule(s), none touches csbox1"),
            "{detail}"
        );
    }

    #[test]
    fn the_lvm_filter_must_reject_loop_devices_and_the_fix_is_printed() {
        let judged = |patterns: &[&str]| {
            judge_lvm_filter(Some(&pb::LvmFilterFacts {
                path: "/etc/lvm/lvm.conf".into(),
                found: true,
                patterns: patterns.iter().map(|p| (*p).to_owned()).collect(),
                error: String::new(),
            }))
        };
        for rejecting in [
            &["r|/dev/zd.*|", "r|/dev/rbd.*|", "r|/dev/loop.*|"][..],
            &["r|^/dev/loop|"],
            &["r/loop/"],
            &["a|/dev/sda|", "r|.*|"],
        ] {
            assert_eq!(judged(rejecting).1, Level::Ok, "{rejecting:?}");
        }
        // PVE's own filter: loop devices pass; the fix keeps its patterns.
        let (_, level, detail) = judged(&PVE_GLOBAL_FILTER);
        assert_eq!(level, Level::Warn);
        assert!(
            detail.ends_with(
                "global_filter = [ \"r|/dev/zd.*|\", \"r|/dev/rbd.*|\", \"r|/dev/nbd.*|\", \"r|/dev/loop.*|\" ]"
            ),
            "{detail}"
        );
        // An accept-all before the reject wins (first match): the fix goes before it.
        let (_, level, detail) = judged(&["a|.*|", "r|/dev/loop.*|"]);
        assert_eq!(level, Level::Warn);
        assert!(
            detail
                .ends_with("global_filter = [ \"r|/dev/loop.*|\", \"a|.*|\", \"r|/dev/loop.*|\" ]"),
            "{detail}"
        );
        // Only whole loop devices rejected, not their partitions.
        assert_eq!(judged(&["r|/dev/loop[0-9]+$|"]).1, Level::Warn);
        assert_eq!(judged(&["x|foo|"]).1, Level::Warn);
        let (_, level, detail) = judge_lvm_filter(Some(&pb::LvmFilterFacts {
            path: "/etc/lvm/lvm.conf".into(),
            ..Default::default()
        }));
        assert_eq!(level, Level::Warn);
        // Without a filter, the fix is PVE's own filter (with nbd) plus the loop reject.
        assert!(
            detail.ends_with(
                "global_filter = [ \"r|/dev/zd.*|\", \"r|/dev/rbd.*|\", \"r|/dev/nbd.*|\", \"r|/dev/loop.*|\" ]"
            ),
            "{detail}"
        );
    }

    #[test]
    fn the_firewall_in_use_is_named_with_what_it_means_for_probes() {
        let judged_with = |datacenter: &str, option: &str, table: bool| {
            judge_firewall(Some(&pb::FirewallFacts {
                host_fw: "/etc/pve/nodes/pve1/host.fw".into(),
                nftables_option: option.into(),
                proxmox_firewall_table: table,
                proxmox_firewall_guests_table: table,
                cluster_fw: "/etc/pve/firewall/cluster.fw".into(),
                datacenter_enable_option: datacenter.into(),
                ..Default::default()
            }))
        };
        let judged = |option: &str, table: bool| judged_with("1", option, table);
        let (_, level, detail) = judged("1", true);
        assert_eq!(level, Level::Ok);
        assert!(
            detail.starts_with("proxmox-firewall (nftables)")
                && detail.contains(
                    "inet proxmox-firewall hooks at priorities filter-1, filter and filter+1 and its table bridge proxmox-firewall-guests at 0"
                )
                && detail.contains("DROP policy"),
            "{detail}"
        );
        let (_, level, detail) = judged("", false);
        assert_eq!(level, Level::Ok);
        assert!(
            detail.starts_with("pve-firewall (iptables-legacy)"),
            "{detail}"
        );
        let (_, level, detail) = judged("1", false);
        assert_eq!(level, Level::Warn);
        assert!(detail.contains("proxmox-firewall.service"), "{detail}");
        assert_eq!(judged("0", true).1, Level::Warn);
        // With the datacenter firewall off proxmox-firewall removes its tables: none is right.
        for datacenter in ["", "0"] {
            let (_, level, detail) = judged_with(datacenter, "1", false);
            assert_eq!(level, Level::Ok, "{detail}");
            assert!(
                detail.contains("the datacenter firewall is off (/etc/pve/firewall/cluster.fw has no enable: 1), so proxmox-firewall loads no tables"),
                "{detail}"
            );
            let (_, level, detail) = judged_with(datacenter, "1", true);
            assert_eq!(level, Level::Warn);
            assert!(detail.contains("leftovers"), "{detail}");
        }
        let (_, level, _) = judge_firewall(Some(&pb::FirewallFacts {
            cluster_fw_error: "cannot read /etc/pve/firewall/cluster.fw: permission denied".into(),
            ..Default::default()
        }));
        assert_eq!(level, Level::Warn);
        let (_, level, _) = judge_firewall(Some(&pb::FirewallFacts {
            nft_error: "nft: not found".into(),
            ..Default::default()
        }));
        assert_eq!(level, Level::Warn);
    }

    fn level_of(facts: &pb::NodeChecksReply, skew: i64, name: &str) -> Level {
        judge(facts, skew)
            .into_iter()
            .find(|(check, _, _)| *check == name)
            .map(|(_, level, _)| level)
            .unwrap()
    }

    #[test]
    fn versions_are_read_by_major_and_minor() {
        assert_eq!(major_minor("9.0.6"), Some((9, 0)));
        assert_eq!(major_minor("1:7.2+dfsg-7"), Some((7, 2)));
        assert_eq!(major_minor("10"), Some((10, 0)));
        assert_eq!(major_minor(""), None);
    }

    #[test]
    fn a_healthy_node_passes_every_check() {
        let checks = judge(&healthy(), 120);
        assert!(
            checks.iter().all(|(_, level, _)| *level == Level::Ok),
            "{checks:?}"
        );
    }

    #[test]
    fn each_rule_fails_or_warns_as_documented() {
        let mut facts = healthy();
        facts.pve_manager_version = "8.4.1".into();
        assert_eq!(level_of(&facts, 0, "pve"), Level::Fail);
        let mut facts = healthy();
        facts.qemu_img_version = "7.2.22".into();
        assert_eq!(level_of(&facts, 0, "qemu-img"), Level::Warn);
        assert_eq!(level_of(&facts, 6_000, "clock"), Level::Warn);
        assert_eq!(level_of(&facts, -61_000, "clock"), Level::Fail);
        let mut facts = healthy();
        facts.pbs_client_version = "3.4.1".into();
        assert_eq!(level_of(&facts, 0, "pbs-client"), Level::Fail);
        facts.pbs_client_version = "5.0.0".into();
        assert_eq!(level_of(&facts, 0, "pbs-client"), Level::Warn);
        let mut facts = healthy();
        facts.nft = Some(pb::ToolPresence {
            path: "/usr/sbin/nft".into(),
            executable: false,
            error: "/usr/sbin/nft: No such file or directory".into(),
        });
        assert_eq!(level_of(&facts, 0, "nft"), Level::Fail);
        let mut facts = healthy();
        facts.overlay_free_bytes = 19_999_999_999;
        facts.overlay_shares_pve_cluster_fs = true;
        assert_eq!(level_of(&facts, 0, "overlay-space"), Level::Warn);
        assert_eq!(level_of(&facts, 0, "overlay-disk"), Level::Warn);
        assert_eq!(level_of(&healthy(), 5_001, "clock"), Level::Warn);
        assert_eq!(level_of(&healthy(), -5_000, "clock"), Level::Ok);
    }
}
