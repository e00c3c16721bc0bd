//! `NodeChecks`: what this node offers a validation, read without changing anything.
//!
//! The facts come from the node's own files and tools, never from the caller: the
//! `pve-manager` and `qemu-server` versions from dpkg's status database (`pve.dpkg_status`;
//! read, not executed, so a broken `pveversion` cannot hang the call), `qemu-img --version`
//! and `proxmox-backup-client version` through the tool runner with a short timeout and a
//! cleared environment (so the client never contacts a server), whether `nft` and `ip` are
//! executable, and the overlay root's free space and filesystem. Then what decides how a real
//! Proxmox VE 9 node treats a sandbox: the `pve-qemu-kvm` version (dpkg), the cgroup version
//! (the mount table), the firewall in use (`host.fw` and `nft list tables`), the LVM
//! `global_filter` (`lvm.conf`), the NAT rules in the iptables-legacy tables (through the same
//! reader `PrepareSandbox` uses) and, for a VNet the caller names, its forwarding now and the
//! stanza ifupdown2 applies to it on the next `ifreload -a`. Every file is read up to a bound,
//! every tool runs with a timeout and an output cap. Every text is bounded and escaped
//! ([`certistack_core::untrusted`]) before it leaves the node; the controller judges the facts.
//!
//! On request it also boots the libguestfs appliance once ([`crate::virtualization`]), in a
//! unit of its own when the daemon uses units; it reads nothing of the node's disks.
//!
//! Nothing is journaled: nothing changes. One reading runs at a time; concurrent callers wait
//! for the slot, and a caller that goes away drops its reading, which kills the tools it
//! started (the tool runner kills a dropped tool's process group).

mod firewall;
mod lvm;
mod versions;
mod vnet;

use firewall::firewall_file_facts;
use lvm::lvm_filter_facts;
pub use versions::installed_versions;
use versions::tool_version;
use vnet::{snat_source, vnet_facts};

use crate::config::{Config, ForwardingPolicy};
use crate::node::sandbox::{self, LegacyNat};
use crate::process::{self, ToolCall};
use crate::virtualization::{self, ApplianceSettings, VirtualizationPaths};
use certistack_core::untrusted::printable;
use certistack_core::validate::VnetName;
use certistack_proto::v1 as pb;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The longest a version tool may take here: a prerequisite check must answer quickly.
const CHECK_TOOL_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes of the dpkg status database read at most (a PVE node's is a few MiB).
pub const MAX_DPKG_STATUS_BYTES: u64 = 64 * 1024 * 1024;
/// Characters kept of a version or of an error text.
const MAX_VERSION_CHARS: usize = 64;
const MAX_ERROR_CHARS: usize = 512;
/// Bytes read at most of a configuration file (interfaces, lvm.conf, host.fw) or of the mount
/// table: each is a few KiB on a node.
const MAX_CONFIG_FILE_BYTES: u64 = 1024 * 1024;
/// Bytes of `nft list tables` kept: one short line per table.
const MAX_TABLE_LIST_BYTES: usize = 64 * 1024;
/// LVM filter patterns and VNet NAT rules reported at most.
const MAX_FILTER_PATTERNS: usize = 64;
const MAX_LISTED_RULES: usize = 8;
/// Characters kept of one filter pattern, stanza value or NAT rule.
const MAX_ITEM_CHARS: usize = 512;
/// The tables proxmox-firewall creates (its `nftables` backend of the host firewall).
const PROXMOX_FIREWALL_TABLE: &str = "inet proxmox-firewall";
const PROXMOX_FIREWALL_GUESTS_TABLE: &str = "bridge proxmox-firewall-guests";

/// The paths NodeChecks reads, from the connector config.
#[derive(Debug)]
pub struct Prerequisites {
    dpkg_status: PathBuf,
    qemu_img: PathBuf,
    proxmox_backup_client: PathBuf,
    nft: PathBuf,
    ip: PathBuf,
    overlay_root: PathBuf,
    pve_cluster_dir: PathBuf,
    timeout: Duration,
    slot: tokio::sync::Mutex<()>,
    sdn_interfaces: PathBuf,
    lvm_conf: PathBuf,
    host_fw: PathBuf,
    cluster_fw: PathBuf,
    mounts: PathBuf,
    iptables_legacy_save: PathBuf,
    ip6tables_legacy_save: PathBuf,
    max_ruleset_bytes: usize,
    forwarding_policy: ForwardingPolicy,
    sandbox_cpu_units: u32,
    virtualization: VirtualizationPaths,
    appliance: ApplianceSettings,
    appliance_slot: virtualization::ApplianceSlot,
    /// One flag per kind of file read, set while a read is on the blocking pool (see
    /// [`bounded_read`]).
    reading_packages: Arc<AtomicBool>,
    reading_files: Arc<AtomicBool>,
    reading_stanza: Arc<AtomicBool>,
    reading_overlay_root: Arc<AtomicBool>,
}

/// Runs `read` on the blocking pool and waits at most `timeout` for it. The node's files can
/// hang a reader: `/etc/pve` is pmxcfs (FUSE), the overlay root may be a network filesystem. A
/// thread stuck in such a read cannot be cancelled, so while one has not returned, the next
/// call of the same kind reports it instead of stranding another thread.
async fn bounded_read<T: Send + 'static>(
    in_flight: &Arc<AtomicBool>,
    what: &str,
    timeout: Duration,
    read: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    if in_flight.swap(true, Ordering::AcqRel) {
        return Err(format!(
            "an earlier read of {what} has not returned yet (a hung /etc/pve or disk?); not read again until it does"
        ));
    }
    let done = in_flight.clone();
    let handle = tokio::task::spawn_blocking(move || {
        let out = read();
        done.store(false, Ordering::Release);
        out
    });
    match tokio::time::timeout(timeout, handle).await {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(error)) => {
            in_flight.store(false, Ordering::Release);
            Err(format!("reading {what} stopped: {error}"))
        }
        Err(_) => Err(format!(
            "reading {what} did not finish within {:.1} s (a hung /etc/pve or disk?)",
            timeout.as_secs_f64()
        )),
    }
}

impl Prerequisites {
    pub fn new(config: &Config) -> Self {
        Self {
            dpkg_status: config.pve.dpkg_status.clone(),
            qemu_img: config.tools.qemu_img.clone(),
            proxmox_backup_client: config.tools.proxmox_backup_client.clone(),
            nft: config.tools.nft.clone(),
            ip: config.tools.ip.clone(),
            overlay_root: config.paths.overlay_root.clone(),
            pve_cluster_dir: config.pve.pve_cluster_dir.clone(),
            timeout: CHECK_TOOL_TIMEOUT.min(Duration::from_secs(config.limits.tool_timeout_secs)),
            slot: tokio::sync::Mutex::new(()),
            sdn_interfaces: config.pve.sdn_interfaces.clone(),
            lvm_conf: config.pve.lvm_conf.clone(),
            host_fw: config.pve.nodes_dir.join(&config.node_name).join("host.fw"),
            // pmxcfs keeps the datacenter's firewall next to the nodes: /etc/pve/firewall.
            cluster_fw: config
                .pve
                .nodes_dir
                .parent()
                .unwrap_or(&config.pve.nodes_dir)
                .join("firewall")
                .join("cluster.fw"),
            mounts: config.pve.mounts.clone(),
            iptables_legacy_save: config.tools.iptables_legacy_save.clone(),
            ip6tables_legacy_save: config.tools.ip6tables_legacy_save.clone(),
            max_ruleset_bytes: config.limits.max_ruleset_bytes,
            forwarding_policy: config.sandbox.forwarding,
            sandbox_cpu_units: config.limits.sandbox_cpu_units,
            virtualization: VirtualizationPaths::from_config(config),
            appliance: ApplianceSettings::from_config(config),
            appliance_slot: Arc::default(),
            reading_packages: Arc::default(),
            reading_files: Arc::default(),
            reading_stanza: Arc::default(),
            reading_overlay_root: Arc::default(),
        }
    }

    /// Boots the appliance as `NodeChecks` was asked to, bounded by `within` (and the limits).
    /// One boot at a time (each takes the appliance's memory): a second caller is told so at
    /// once; a caller that goes away drops the boot, which kills it and stops its unit.
    pub async fn boot_appliance(&self, within: Duration) -> pb::ApplianceBootFacts {
        virtualization::boot_appliance(&self.appliance, &self.appliance_slot, within).await
    }

    /// Reads every fact, those of `vnet` too when one is named; `node_time_unix_ms` is left
    /// for the caller, who owns the clock.
    pub async fn read(&self, vnet: Option<&VnetName>) -> pb::NodeChecksReply {
        let _slot = self.slot.lock().await;
        let dpkg_status = self.dpkg_status.clone();
        let packages = bounded_read(
            &self.reading_packages,
            "the dpkg status",
            self.timeout,
            move || {
                installed_versions(
                    &dpkg_status,
                    &["pve-manager", "qemu-server", "pve-qemu-kvm"],
                )
            },
        );
        let files = {
            let (mounts, lvm_conf, host_fw, cluster_fw, virtualization) = (
                self.mounts.clone(),
                self.lvm_conf.clone(),
                self.host_fw.clone(),
                self.cluster_fw.clone(),
                self.virtualization.clone(),
            );
            bounded_read(
                &self.reading_files,
                "the node's files (mounts, lvm.conf, host.fw, cluster.fw, cpuinfo, DMI, KVM device)",
                self.timeout,
                move || {
                    (
                        cgroup_facts(&mounts),
                        lvm_filter_facts(&lvm_conf),
                        firewall_file_facts(&host_fw, &cluster_fw),
                        virtualization::facts(&virtualization),
                    )
                },
            )
        };
        // The legacy NAT check needs the subnets the VNet's stanza SNATs, so it waits for it.
        let vnet_and_nat = async {
            let sdn_interfaces = self.sdn_interfaces.clone();
            let owned = vnet.cloned();
            let read = bounded_read(
                &self.reading_stanza,
                "the SDN interfaces",
                self.timeout,
                move || owned.map(|vnet| vnet_facts(&vnet, &sdn_interfaces)),
            )
            .await;
            let snat_subnets: Vec<String> = match &read {
                Ok(Some(facts)) => facts
                    .snat_lines
                    .iter()
                    .filter_map(|line| snat_source(line))
                    .collect(),
                _ => Vec::new(),
            };
            (read, self.legacy_nat(vnet, &snat_subnets).await)
        };
        let overlay_root = self.overlay_root.clone();
        let cluster = self.pve_cluster_dir.clone();
        let disk = bounded_read(
            &self.reading_overlay_root,
            "the overlay root",
            self.timeout,
            move || overlay_disk(&overlay_root, &cluster),
        );
        let (qemu_img, pbs_client, (vnet_read, legacy_nat), tables, packages, disk, files) = tokio::join!(
            tool_version(
                &self.qemu_img,
                &["--version"],
                "qemu-img version ",
                self.timeout
            ),
            tool_version(
                &self.proxmox_backup_client,
                &["version"],
                "client version: ",
                self.timeout
            ),
            vnet_and_nat,
            self.nft_tables(),
            packages,
            disk,
            files,
        );
        let packages = packages.and_then(|read| read);
        let package = |name: &str| -> Result<String, String> {
            match &packages {
                Ok(found) => found
                    .iter()
                    .find(|(package, _)| package == name)
                    .map(|(_, version)| version.clone())
                    .ok_or_else(|| {
                        format!(
                            "package {name} is not installed ({} lists it as no installed package)",
                            self.dpkg_status.display()
                        )
                    }),
                Err(error) => Err(error.clone()),
            }
        };
        let disk = disk.and_then(|read| read);
        let (pve_manager_version, pve_manager_error) = split(package("pve-manager"));
        let (qemu_server_version, qemu_server_error) = split(package("qemu-server"));
        let (qemu_img_version, qemu_img_error) = split(qemu_img);
        let (pbs_client_version, pbs_client_error) = split(pbs_client);
        let (qemu_version, qemu_error) = split(package("pve-qemu-kvm"));
        let vnet = match vnet_read {
            Ok(read) => read,
            Err(error) => vnet.map(|vnet| pb::VnetFacts {
                name: vnet.to_string(),
                stanza_error: bounded(&error),
                ..Default::default()
            }),
        };
        let (cgroup, lvm_filter, mut firewall, virtualization) = match files {
            Ok(read) => read,
            Err(error) => {
                let error = bounded(&error);
                (
                    pb::CgroupFacts {
                        error: error.clone(),
                        ..Default::default()
                    },
                    pb::LvmFilterFacts {
                        error: error.clone(),
                        ..Default::default()
                    },
                    pb::FirewallFacts {
                        host_fw_error: error.clone(),
                        ..Default::default()
                    },
                    pb::VirtualizationFacts {
                        cpuinfo_error: error,
                        ..Default::default()
                    },
                )
            }
        };
        match tables {
            Ok(tables) => {
                firewall.proxmox_firewall_table =
                    tables.iter().any(|t| t == PROXMOX_FIREWALL_TABLE);
                firewall.proxmox_firewall_guests_table =
                    tables.iter().any(|t| t == PROXMOX_FIREWALL_GUESTS_TABLE);
            }
            Err(error) => firewall.nft_error = bounded(&error),
        }
        let (overlay_free_bytes, overlay_shares_pve_cluster_fs, overlay_error) = match disk {
            Ok((free, shares)) => (free, shares, String::new()),
            Err(error) => (0, false, bounded(&error)),
        };
        pb::NodeChecksReply {
            pve_manager_version,
            pve_manager_error,
            qemu_server_version,
            qemu_server_error,
            qemu_img_version,
            qemu_img_error,
            pbs_client_version,
            pbs_client_error,
            nft: Some(presence(&self.nft)),
            ip: Some(presence(&self.ip)),
            overlay_free_bytes,
            overlay_error,
            overlay_shares_pve_cluster_fs,
            node_time_unix_ms: 0,
            qemu_version,
            qemu_error,
            cgroup: Some(cgroup),
            forwarding_policy: match self.forwarding_policy {
                ForwardingPolicy::Refuse => "refuse",
                ForwardingPolicy::DisableForRun => "disable-for-run",
            }
            .to_owned(),
            sandbox_cpu_units: self.sandbox_cpu_units,
            vnet,
            legacy_nat: Some(legacy_nat),
            lvm_filter: Some(lvm_filter),
            firewall: Some(firewall),
            virtualization: Some(pb::VirtualizationFacts {
                appliance_accelerator: self.appliance.appliance.accelerator.name().to_owned(),
                ..virtualization
            }),
            appliance_boot: None,
        }
    }

    /// The iptables-legacy NAT tables of both families, read as `PrepareSandbox` reads them
    /// (never creating a table that is not there), and the rules that involve `vnet` or that
    /// name one of `snat_subnets` (the sources of the SNAT lines in its SDN stanza: SDN's rule
    /// names the subnet and the uplink, never the VNet).
    async fn legacy_nat(
        &self,
        vnet: Option<&VnetName>,
        snat_subnets: &[String],
    ) -> pb::LegacyNatFacts {
        let mut facts = pb::LegacyNatFacts::default();
        let mut errors = Vec::new();
        for (tool, tables_file) in [
            (&self.iptables_legacy_save, "ip_tables_names"),
            (&self.ip6tables_legacy_save, "ip6_tables_names"),
        ] {
            match sandbox::read_legacy_nat(tool, tables_file, self.max_ruleset_bytes, self.timeout)
                .await
            {
                Ok(listing) => {
                    facts
                        .sources
                        .push(bounded(&listing.source(tool, tables_file)));
                    if let LegacyNat::Read(listing) = &listing {
                        let rules = listing
                            .lines()
                            .filter(|line| line.trim_start().starts_with("-A "))
                            .count();
                        facts.rule_count = facts
                            .rule_count
                            .saturating_add(u32::try_from(rules).unwrap_or(u32::MAX));
                        if let Some(vnet) = vnet {
                            let subnets = std::iter::once(None)
                                .chain(snat_subnets.iter().map(|subnet| Some(subnet.as_str())));
                            for subnet in subnets {
                                for rule in sandbox::legacy_nat_rules(listing, vnet, subnet) {
                                    let rule = format!("{rule} ({} -t nat)", tool.display());
                                    if !facts.vnet_rules.contains(&rule) {
                                        facts.vnet_rules.push(rule);
                                    }
                                }
                            }
                        }
                    }
                }
                Err(error) => errors.push(error.to_string()),
            }
        }
        facts.vnet_rules.truncate(MAX_LISTED_RULES);
        facts.error = bounded(&errors.join("; "));
        facts
    }

    /// The names (`family name`) of the nftables tables on the node.
    async fn nft_tables(&self) -> Result<Vec<String>, String> {
        let call = ToolCall::new(&self.nft, self.timeout)
            .output_cap(MAX_TABLE_LIST_BYTES)
            .arg("list")
            .arg("tables");
        let (shown, output) = run_successfully(call).await?;
        if output.truncated {
            return Err(format!(
                "{shown} printed more than {MAX_TABLE_LIST_BYTES} bytes"
            ));
        }
        Ok(parse_nft_tables(&output.stdout))
    }
}

/// Runs a check's tool; its output when it exited 0, else what it said. Returns how the call is
/// shown, for the messages that follow.
async fn run_successfully(call: ToolCall) -> Result<(String, process::ToolOutput), String> {
    let shown = call.display();
    let output = process::run(call)
        .await
        .map_err(|error| error.to_string())?;
    if !output.success() {
        return Err(format!(
            "{shown} exited with {:?}: {}",
            output.exit_code,
            output.stderr_excerpt()
        ));
    }
    Ok((shown, output))
}

/// `table <family> <name>` lines of `nft list tables`, as `family name`.
fn parse_nft_tables(listing: &str) -> Vec<String> {
    listing
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("table")).then_some(())?;
            let (family, name) = (words.next()?, words.next()?);
            Some(format!("{family} {name}"))
        })
        .collect()
}

/// Up to [`MAX_CONFIG_FILE_BYTES`] of a text file; a larger file is refused, since a cut
/// configuration could hide the line that matters.
fn read_config_file(path: &Path) -> Result<String, std::io::Error> {
    use std::io::Read;
    let file = std::fs::File::open(path)?;
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_FILE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_CONFIG_FILE_BYTES {
        return Err(std::io::Error::other(format!(
            "larger than {MAX_CONFIG_FILE_BYTES} bytes"
        )));
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

fn cgroup_facts(mounts: &Path) -> pb::CgroupFacts {
    match read_config_file(mounts) {
        Ok(table) => pb::CgroupFacts {
            sys_fs_cgroup_type: sys_fs_cgroup_type(&table)
                .map(|kind| printable(kind.as_bytes(), MAX_VERSION_CHARS))
                .unwrap_or_default(),
            error: String::new(),
        },
        Err(error) => pb::CgroupFacts {
            sys_fs_cgroup_type: String::new(),
            error: bounded(&format!("cannot read {}: {error}", mounts.display())),
        },
    }
}

/// The filesystem type mounted on `/sys/fs/cgroup` in a mount table (`/proc/self/mounts`
/// format): the last entry wins, as later mounts cover earlier ones.
fn sys_fs_cgroup_type(table: &str) -> Option<&str> {
    table.lines().rev().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_source, target, kind) = (fields.next()?, fields.next()?, fields.next()?);
        (target == "/sys/fs/cgroup").then_some(kind)
    })
}

fn item(text: &str) -> String {
    printable(text.as_bytes(), MAX_ITEM_CHARS)
}

fn bounded(text: &str) -> String {
    printable(text.as_bytes(), MAX_ERROR_CHARS)
}

fn split(result: Result<String, String>) -> (String, String) {
    match result {
        Ok(version) => (version, String::new()),
        Err(error) => (String::new(), bounded(&error)),
    }
}

/// Bytes available to the daemon under `overlay_root`, and whether it shares a filesystem
/// with `pve_cluster_dir` (an absent cluster directory shares nothing). An overlay root not
/// created yet (the first run creates it) is judged by its nearest existing parent, the
/// filesystem it will live on.
fn overlay_disk(overlay_root: &Path, pve_cluster_dir: &Path) -> Result<(u64, bool), String> {
    use std::os::unix::fs::MetadataExt;
    let overlay_root = overlay_root
        .ancestors()
        .find(|dir| dir.exists())
        .unwrap_or(overlay_root);
    let stat = rustix::fs::statvfs(overlay_root)
        .map_err(|error| format!("cannot statvfs {}: {error}", overlay_root.display()))?;
    let free = stat.f_bavail.saturating_mul(stat.f_frsize);
    let overlay_dev = std::fs::metadata(overlay_root)
        .map_err(|error| format!("cannot stat {}: {error}", overlay_root.display()))?
        .dev();
    let shares = std::fs::metadata(pve_cluster_dir).is_ok_and(|m| m.dev() == overlay_dev);
    Ok((free, shares))
}

/// Whether `path` is a regular file (after links) this daemon may execute.
fn presence(path: &Path) -> pb::ToolPresence {
    let shown = path.display().to_string();
    let error = match std::fs::metadata(path) {
        Err(error) => Some(format!("{shown}: {error}")),
        Ok(meta) if !meta.is_file() => Some(format!("{shown} is not a regular file")),
        Ok(_) => rustix::fs::access(path, rustix::fs::Access::EXEC_OK)
            .err()
            .map(|error| format!("{shown} is not executable: {error}")),
    };
    pb::ToolPresence {
        path: bounded(&shown),
        executable: error.is_none(),
        error: error.map(|e| bounded(&e)).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests;
