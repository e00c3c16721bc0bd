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

use crate::config::{Config, ForwardingPolicy};
use crate::node::sandbox::{self, LegacyNat};
use crate::process::{self, ToolCall};
use crate::virtualization::{self, ApplianceSettings, VirtualizationPaths};
use certistack_core::untrusted::printable;
use certistack_core::validate::VnetName;
use certistack_proto::v1 as pb;
use std::io::BufRead;
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

fn vnet_facts(vnet: &VnetName, sdn_interfaces: &Path) -> pb::VnetFacts {
    let sysctl = |family: &str| {
        read_config_file(Path::new(&format!(
            "/proc/sys/net/{family}/conf/{vnet}/forwarding"
        )))
        .map(|value| printable(value.trim().as_bytes(), MAX_VERSION_CHARS))
        .unwrap_or_default()
    };
    let mut facts = pb::VnetFacts {
        name: vnet.to_string(),
        ipv4_forwarding: sysctl("ipv4"),
        ipv6_forwarding: sysctl("ipv6"),
        stanza_file: bounded(&sdn_interfaces.display().to_string()),
        ..Default::default()
    };
    match read_config_file(sdn_interfaces) {
        Ok(text) => {
            if let Some(stanza) = interface_stanza(&text, vnet.as_str()) {
                facts.stanza_found = true;
                facts.address_method = item(&stanza.address_method);
                facts.ip_forward = item(&stanza.ip_forward);
                facts.ip6_forward = item(&stanza.ip6_forward);
                facts.address_present = stanza.address_present;
                facts.snat_lines = stanza
                    .snat_lines
                    .iter()
                    .take(MAX_LISTED_RULES)
                    .map(|line| item(line))
                    .collect();
            }
        }
        // No SDN file: SDN was never applied on this node, so ifreload writes no VNet.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => {
            facts.stanza_error = bounded(&format!(
                "cannot read {}: {error}",
                sdn_interfaces.display()
            ));
        }
    }
    facts
}

fn item(text: &str) -> String {
    printable(text.as_bytes(), MAX_ITEM_CHARS)
}

/// What ifupdown2 reads for one interface: its address method and forwarding attributes.
#[derive(Debug, Default, PartialEq, Eq)]
struct Stanza {
    /// `inet static`, `inet6 manual`, ...; empty for a bare `iface <name>`.
    address_method: String,
    ip_forward: String,
    ip6_forward: String,
    /// An `address` attribute is set.
    address_present: bool,
    /// `post-up` commands that add an iptables NAT rule (SDN's subnet SNAT), as written.
    snat_lines: Vec<String>,
}

/// Whether an `up`/`post-up` command adds a rule to an iptables `nat` table.
fn adds_nat_rule(command: &str) -> bool {
    let words: Vec<&str> = command.split_whitespace().collect();
    words
        .first()
        .is_some_and(|tool| tool.ends_with("iptables") || tool.ends_with("ip6tables"))
        && words.windows(2).any(|pair| pair == ["-t", "nat"])
        && words
            .iter()
            .any(|word| matches!(*word, "-A" | "-I" | "--append" | "--insert"))
}

/// The source (`-s`) of a NAT command, unquoted: the subnet SDN's SNAT names.
fn snat_source(command: &str) -> Option<String> {
    let mut words = command.split_whitespace();
    words.find(|word| matches!(*word, "-s" | "--source"))?;
    let source = words.next()?.trim_matches(|c| c == '\'' || c == '"');
    (!source.is_empty()).then(|| source.to_owned())
}

/// The stanza of `name` in an ifupdown2 interfaces file. ifupdown2 merges the stanzas of one
/// interface, so every `iface name` block counts: a method from any, attributes from the last.
fn interface_stanza(text: &str, name: &str) -> Option<Stanza> {
    const STANZA_KEYWORDS: [&str; 5] = ["iface", "auto", "source", "mapping", "source-directory"];
    let mut found: Option<Stanza> = None;
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if STANZA_KEYWORDS.contains(&first) || first.starts_with("allow-") {
            inside = first == "iface" && words.next() == Some(name);
            if inside {
                let method = words.collect::<Vec<_>>().join(" ");
                let stanza = found.get_or_insert_with(Stanza::default);
                if !method.is_empty() {
                    stanza.address_method = method;
                }
            }
            continue;
        }
        if let (true, Some(stanza)) = (inside, found.as_mut()) {
            let value = words.collect::<Vec<_>>().join(" ");
            match first {
                "ip-forward" => stanza.ip_forward = value,
                "ip6-forward" => stanza.ip6_forward = value,
                "address" => stanza.address_present = true,
                "post-up" | "up" if adds_nat_rule(&value) => stanza.snat_lines.push(value),
                _ => {}
            }
        }
    }
    found
}

fn lvm_filter_facts(lvm_conf: &Path) -> pb::LvmFilterFacts {
    let mut facts = pb::LvmFilterFacts {
        path: bounded(&lvm_conf.display().to_string()),
        ..Default::default()
    };
    match read_config_file(lvm_conf) {
        Ok(text) => {
            if let Some(patterns) = lvm_global_filter(&text) {
                facts.found = true;
                facts.patterns = patterns
                    .iter()
                    .take(MAX_FILTER_PATTERNS)
                    .map(|p| item(p))
                    .collect();
            }
        }
        Err(error) => {
            facts.error = bounded(&format!("cannot read {}: {error}", lvm_conf.display()));
        }
    }
    facts
}

/// A token of LVM's configuration syntax.
#[derive(Debug, PartialEq, Eq)]
enum LvmToken {
    Word(String),
    Text(String),
    Punct(char),
}

/// LVM's configuration tokens, `#` comments dropped (a `#` inside a string is text).
fn lvm_tokens(text: &str) -> Vec<LvmToken> {
    let mut tokens = Vec::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '#' => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        break;
                    }
                }
            }
            '"' => {
                let mut value = String::new();
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => value.extend(chars.next()),
                        c => value.push(c),
                    }
                }
                tokens.push(LvmToken::Text(value));
            }
            '{' | '}' | '[' | ']' | '=' | ',' => tokens.push(LvmToken::Punct(c)),
            c if c.is_whitespace() => {}
            c => {
                let mut word = String::from(c);
                while let Some(&next) = chars.peek() {
                    if next.is_whitespace() || "{}[]=,#\"".contains(next) {
                        break;
                    }
                    word.push(next);
                    chars.next();
                }
                tokens.push(LvmToken::Word(word));
            }
        }
    }
    tokens
}

/// The patterns of `devices { global_filter = [ ... ] }` (the last setting wins, as in LVM),
/// or `None` when no devices section sets it. Commented-out lines do not count.
fn lvm_global_filter(text: &str) -> Option<Vec<String>> {
    let tokens = lvm_tokens(text);
    let mut sections: Vec<String> = Vec::new();
    let mut found = None;
    let mut at = 0;
    while let Some(token) = tokens.get(at) {
        at += 1;
        match token {
            LvmToken::Word(word) if tokens.get(at) == Some(&LvmToken::Punct('{')) => {
                sections.push(word.clone());
                at += 1;
            }
            LvmToken::Punct('}') => {
                sections.pop();
            }
            LvmToken::Word(word)
                if word == "global_filter"
                    && sections.len() == 1
                    && sections.first().is_some_and(|s| s == "devices")
                    && tokens.get(at) == Some(&LvmToken::Punct('=')) =>
            {
                at += 1;
                let mut patterns = Vec::new();
                match tokens.get(at) {
                    Some(LvmToken::Text(single)) => {
                        patterns.push(single.clone());
                        at += 1;
                    }
                    Some(LvmToken::Punct('[')) => {
                        at += 1;
                        while let Some(token) = tokens.get(at) {
                            at += 1;
                            match token {
                                LvmToken::Text(pattern) => patterns.push(pattern.clone()),
                                LvmToken::Punct(']') => break,
                                _ => {}
                            }
                        }
                    }
                    _ => {}
                }
                found = Some(patterns);
            }
            _ => {}
        }
    }
    found
}

fn firewall_file_facts(host_fw: &Path, cluster_fw: &Path) -> pb::FirewallFacts {
    let mut facts = pb::FirewallFacts {
        host_fw: bounded(&host_fw.display().to_string()),
        cluster_fw: bounded(&cluster_fw.display().to_string()),
        ..Default::default()
    };
    match read_config_file(cluster_fw) {
        Ok(text) => {
            facts.datacenter_enable_option =
                item(&host_fw_option(&text, "enable").unwrap_or_default());
        }
        // No cluster.fw: the datacenter firewall is off.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => {
            facts.cluster_fw_error =
                bounded(&format!("cannot read {}: {error}", cluster_fw.display()));
        }
    }
    match read_config_file(host_fw) {
        Ok(text) => {
            facts.nftables_option = item(&host_fw_option(&text, "nftables").unwrap_or_default())
        }
        // No host.fw: every option has its default, and `nftables` defaults to off.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => {
            facts.host_fw_error = bounded(&format!("cannot read {}: {error}", host_fw.display()));
        }
    }
    facts
}

/// The value of `key:` in the `[OPTIONS]` section of a pve-firewall file (`host.fw`,
/// `cluster.fw`).
fn host_fw_option(text: &str, key: &str) -> Option<String> {
    let mut in_options = false;
    let mut value = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if line.starts_with('[') {
            in_options = line.eq_ignore_ascii_case("[options]");
            continue;
        }
        if in_options
            && let Some((name, found)) = line.split_once(':')
            && name.trim().eq_ignore_ascii_case(key)
        {
            value = Some(found.trim().to_owned());
        }
    }
    value
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

/// A version as the node states it: dpkg's version characters only, bounded.
fn version_token(text: &str) -> Option<String> {
    let token = text.split_whitespace().next()?;
    let allowed = |c: char| c.is_ascii_alphanumeric() || ".+~:-_".contains(c);
    (token.chars().all(allowed) && token.chars().count() <= MAX_VERSION_CHARS)
        .then(|| token.to_owned())
}

/// Runs `program args` and takes the version that follows `prefix` on the first line of
/// stdout that starts with it.
async fn tool_version(
    program: &Path,
    args: &[&str],
    prefix: &str,
    timeout: Duration,
) -> Result<String, String> {
    let mut call = ToolCall::new(program, timeout);
    for arg in args {
        call = call.arg(*arg);
    }
    let (shown, output) = run_successfully(call).await?;
    output
        .stdout
        .lines()
        .find_map(|line| line.strip_prefix(prefix))
        .and_then(version_token)
        .ok_or_else(|| {
            let first = output.stdout.lines().next().unwrap_or_default();
            format!(
                "{shown} printed no \"{prefix}<version>\" line (first line: {})",
                printable(first.as_bytes(), MAX_VERSION_CHARS * 2)
            )
        })
}

/// The installed versions of `wanted` packages from a dpkg status database: the `Version:` of
/// each paragraph whose `Package:` is wanted and whose `Status:` ends in `installed`.
pub fn installed_versions(path: &Path, wanted: &[&str]) -> Result<Vec<(String, String)>, String> {
    let file = std::fs::File::open(path)
        .map_err(|error| format!("cannot read {}: {error}", path.display()))?;
    let mut reader = std::io::BufReader::new(std::io::Read::take(file, MAX_DPKG_STATUS_BYTES));
    let mut found = Vec::new();
    let mut package: Option<String> = None;
    let mut version: Option<String> = None;
    let mut installed = false;
    let mut line = Vec::new();
    let mut read_total: u64 = 0;
    loop {
        line.clear();
        let read = reader
            .read_until(b'\n', &mut line)
            .map_err(|error| format!("cannot read {}: {error}", path.display()))?;
        read_total += read as u64;
        let text = String::from_utf8_lossy(&line);
        let text = text.trim_end();
        if read == 0 || text.is_empty() {
            if let (Some(name), Some(version), true) = (package.take(), version.take(), installed)
                && wanted.contains(&name.as_str())
            {
                found.push((name, version));
            }
            installed = false;
            if read == 0 {
                break;
            }
            continue;
        }
        if let Some(name) = text.strip_prefix("Package:") {
            package = Some(name.trim().to_owned());
        } else if let Some(status) = text.strip_prefix("Status:") {
            installed = status.split_whitespace().last() == Some("installed");
        } else if let Some(value) = text.strip_prefix("Version:") {
            version = version_token(value.trim());
        }
    }
    if read_total >= MAX_DPKG_STATUS_BYTES {
        return Err(format!(
            "{} is larger than {MAX_DPKG_STATUS_BYTES} bytes; it is not a dpkg status database",
            path.display()
        ));
    }
    Ok(found)
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
mod tests {
    use super::*;

    #[test]
    fn dpkg_status_gives_installed_versions_only() {
        let dir = std::env::temp_dir().join(format!("certistack-dpkg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("status");
        std::fs::write(
            &path,
            "Package: pve-manager\nStatus: install ok installed\nPriority: optional\nVersion: 9.0.6\nDescription: x\n continued\n\n\
             Package: qemu-server\nStatus: deinstall ok config-files\nVersion: 8.0.1\n\n\
             Package: other\nStatus: install ok installed\nVersion: 1.0\n",
        )
        .unwrap();
        let found = installed_versions(&path, &["pve-manager", "qemu-server"]).unwrap();
        assert_eq!(found, [("pve-manager".to_owned(), "9.0.6".to_owned())]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_cgroup_version_is_what_is_mounted_on_sys_fs_cgroup() {
        let v2 = "sysfs /sys sysfs rw 0 0\ncgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n";
        assert_eq!(sys_fs_cgroup_type(v2), Some("cgroup2"));
        // Hybrid: a tmpfs with v1 controllers below it and v2 only at .../unified.
        let hybrid = "tmpfs /sys/fs/cgroup tmpfs rw,mode=755 0 0\n\
                      cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
        assert_eq!(sys_fs_cgroup_type(hybrid), Some("tmpfs"));
        // A later mount covers an earlier one.
        let stacked = format!("{hybrid}cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n");
        assert_eq!(sys_fs_cgroup_type(&stacked), Some("cgroup2"));
        assert_eq!(sys_fs_cgroup_type("proc /proc proc rw 0 0\n"), None);
    }

    /// SDN writes VNets as bare stanzas; a gateway or an address method changes what
    /// ifupdown2 does with forwarding.
    #[test]
    fn the_vnet_stanza_gives_its_address_method_and_forwarding_attributes() {
        let sdn = "#version:7\n\n\
                   auto csbox1\n\
                   iface csbox1\n\
                   \tbridge_ports none\n\
                   \tbridge_stp off\n\
                   \tbridge_fd 0\n\
                   \tmtu 1500\n\n\
                   auto csnet2\n\
                   iface csnet2 inet static\n\
                   \taddress 10.0.0.1/24\n\
                   \tip-forward on\n\n\
                   auto csnet3\n\
                   iface csnet3\n\
                   \tbridge_ports none\n\
                   \tip-forward off\n\
                   \t# ip6-forward on\n\
                   \tip6-forward off\n";
        assert_eq!(
            interface_stanza(sdn, "csbox1"),
            Some(Stanza::default()),
            "a bare stanza has no method"
        );
        assert_eq!(
            interface_stanza(sdn, "csnet2"),
            Some(Stanza {
                address_method: "inet static".into(),
                ip_forward: "on".into(),
                address_present: true,
                ..Default::default()
            })
        );
        assert_eq!(
            interface_stanza(sdn, "csnet3"),
            Some(Stanza {
                ip_forward: "off".into(),
                ip6_forward: "off".into(),
                ..Default::default()
            })
        );
        // A name that only prefixes another, or appears in an attribute, is no stanza.
        assert_eq!(interface_stanza(sdn, "csbox"), None);
        assert_eq!(interface_stanza("#iface csbox1\n", "csbox1"), None);
        // The attributes of the next interface do not leak into the previous one.
        let two = "iface a\nauto b\niface b\n ip-forward on\n";
        assert_eq!(interface_stanza(two, "a"), Some(Stanza::default()));
    }

    /// pve-network's Simple zone writes a subnet's `snat` into the VNet's stanza; the rule names
    /// the subnet and the uplink, never the VNet.
    #[test]
    fn the_snat_sdn_writes_into_a_vnet_stanza_is_found_with_its_subnet() {
        let sdn = "auto csbox1\n\
                   iface csbox1\n\
                   \taddress 10.7.3.1/24\n\
                   \tpost-up iptables -t nat -A POSTROUTING -s '10.7.3.0/24' -o vmbr0 -j SNAT --to-source 192.0.2.10\n\
                   \tpost-down iptables -t nat -D POSTROUTING -s '10.7.3.0/24' -o vmbr0 -j SNAT --to-source 192.0.2.10\n\
                   \tpost-up iptables -t raw -I PREROUTING -i fwbr+ -j CT --zone 1\n\
                   \tpost-down iptables -t raw -D PREROUTING -i fwbr+ -j CT --zone 1\n\
                   \tbridge_ports none\n";
        let stanza = interface_stanza(sdn, "csbox1").unwrap();
        assert!(stanza.address_present);
        assert_eq!(
            stanza.snat_lines,
            [
                "iptables -t nat -A POSTROUTING -s '10.7.3.0/24' -o vmbr0 -j SNAT --to-source 192.0.2.10"
            ]
        );
        assert_eq!(
            snat_source(&stanza.snat_lines[0]).as_deref(),
            Some("10.7.3.0/24")
        );
        assert_eq!(
            snat_source("iptables -t nat -A POSTROUTING -o vmbr0 -j MASQUERADE"),
            None
        );
        let listing = "*nat\n\
                       -A POSTROUTING -s 10.7.3.0/24 -o vmbr0 -j SNAT --to-source 192.0.2.10\n\
                       -A POSTROUTING -s 10.9.0.0/24 -o vmbr0 -j MASQUERADE\nCOMMIT\n";
        let vnet = <VnetName as certistack_core::validate::Validated>::validate("csbox1").unwrap();
        assert_eq!(
            sandbox::legacy_nat_rules(listing, &vnet, Some("10.7.3.0/24")),
            ["-A POSTROUTING -s 10.7.3.0/24 -o vmbr0 -j SNAT --to-source 192.0.2.10"]
        );
    }

    #[test]
    fn the_datacenter_firewall_switch_is_read_from_cluster_fw() {
        let dir = std::env::temp_dir().join(format!("certistack-fw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (host_fw, cluster_fw) = (dir.join("host.fw"), dir.join("cluster.fw"));
        std::fs::write(&host_fw, "[OPTIONS]\nnftables: 1\n").unwrap();
        let facts = firewall_file_facts(&host_fw, &cluster_fw);
        assert_eq!(facts.nftables_option, "1");
        assert_eq!(facts.datacenter_enable_option, "");
        assert!(facts.cluster_fw_error.is_empty(), "{facts:?}");
        std::fs::write(
            &cluster_fw,
            "[OPTIONS]\n\nenable: 1\n\n[RULES]\nIN ACCEPT\n",
        )
        .unwrap();
        let facts = firewall_file_facts(&host_fw, &cluster_fw);
        assert_eq!(facts.datacenter_enable_option, "1");
        assert_eq!(facts.cluster_fw, cluster_fw.display().to_string());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_lvm_global_filter_is_read_from_the_devices_section_only() {
        let pve = "# This is an example configuration file for the LVM2 system.\n\
                   config {\n  checks = 1\n}\n\
                   devices {\n\
                   \t# global_filter = [ \"a|.*|\" ]\n\
                   \tdir = \"/dev\"\n\
                   \t# added by pve-manager to avoid scanning ZFS zvols and Ceph rbds\n\
                   \tglobal_filter=[\"r|/dev/zd.*|\",\"r|/dev/rbd.*|\"]\n\
                   }\n";
        assert_eq!(
            lvm_global_filter(pve),
            Some(vec!["r|/dev/zd.*|".to_owned(), "r|/dev/rbd.*|".to_owned()])
        );
        // Over several lines, a `#` inside a pattern is not a comment, the last setting wins.
        let multi = "devices {\n global_filter = [ \"a|/dev/sda#1|\" ]\n global_filter = [\n   \"r|/dev/loop.*|\", # loops\n   \"a|.*|\"\n ]\n}\n";
        assert_eq!(
            lvm_global_filter(multi),
            Some(vec!["r|/dev/loop.*|".to_owned(), "a|.*|".to_owned()])
        );
        // Commented out, or in another section: not set.
        assert_eq!(
            lvm_global_filter("devices {\n# global_filter = [ \"r|/dev/loop.*|\" ]\n}\n"),
            None
        );
        assert_eq!(
            lvm_global_filter("activation {\n global_filter = [ \"r|.*|\" ]\n}\n"),
            None
        );
        assert_eq!(
            lvm_global_filter("devices {\n filter = [ \"r|/dev/loop.*|\" ]\n}\n"),
            None
        );
    }

    #[test]
    fn host_fw_options_select_the_firewall() {
        let host_fw = "[OPTIONS]\n\n# nftables: 0\nnftables: 1\nenable: 1\n\n[RULES]\n\nIN ACCEPT -p tcp -dport 22\n";
        assert_eq!(host_fw_option(host_fw, "nftables").as_deref(), Some("1"));
        assert_eq!(host_fw_option(host_fw, "enable").as_deref(), Some("1"));
        // An option in another section, or commented out, is not set.
        assert_eq!(
            host_fw_option(
                "[RULES]\nnftables: 1\n[options]\n#nftables: 1\n",
                "nftables"
            ),
            None
        );
        assert_eq!(
            parse_nft_tables(
                "table inet filter\ntable inet proxmox-firewall\ntable bridge proxmox-firewall-guests\n"
            ),
            [
                "inet filter",
                "inet proxmox-firewall",
                "bridge proxmox-firewall-guests"
            ]
        );
    }

    #[test]
    fn a_config_file_past_its_bound_is_refused_not_cut() {
        let dir = std::env::temp_dir().join(format!("certistack-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lvm.conf");
        std::fs::write(&path, vec![b' '; MAX_CONFIG_FILE_BYTES as usize + 1]).unwrap();
        let facts = lvm_filter_facts(&path);
        assert!(!facts.found);
        assert!(facts.error.contains("larger than"), "{facts:?}");
        std::fs::write(&path, "devices { global_filter = [ \"r|.*|\" ] }").unwrap();
        assert_eq!(lvm_filter_facts(&path).patterns, ["r|.*|"]);
        assert!(
            firewall_file_facts(&dir.join("absent.fw"), &dir.join("absent-cluster.fw"))
                .host_fw_error
                .is_empty()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_version_with_foreign_characters_is_not_one() {
        assert_eq!(version_token("9.2.0 (pve)"), Some("9.2.0".into()));
        assert_eq!(version_token("1:7.2+dfsg-7"), Some("1:7.2+dfsg-7".into()));
        assert_eq!(version_token("9.0\u{1b}[31m"), None);
        assert_eq!(version_token(""), None);
    }

    #[tokio::test]
    async fn a_hung_file_read_is_bounded_and_strands_one_thread_at_most() {
        // A FIFO without a writer blocks its reader in open(2), as a hung pmxcfs would.
        let dir = std::env::temp_dir().join(format!("certistack-hung-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("host.fw");
        let _ = std::fs::remove_file(&fifo);
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        let in_flight = Arc::new(AtomicBool::new(false));
        let bound = Duration::from_millis(300);
        let read = |in_flight: Arc<AtomicBool>, fifo: PathBuf, cluster: PathBuf| async move {
            bounded_read(&in_flight, "host.fw", bound, move || {
                firewall_file_facts(&fifo, &cluster)
            })
            .await
        };
        let started = std::time::Instant::now();
        let first = read(in_flight.clone(), fifo.clone(), dir.join("cluster.fw")).await;
        assert!(started.elapsed() < Duration::from_secs(5));
        let error = first.unwrap_err();
        assert!(error.contains("did not finish within 0.3 s"), "{error}");
        // The stranded reader is still in open(2): no second thread joins it.
        let second = read(in_flight.clone(), fifo.clone(), dir.join("cluster.fw")).await;
        assert!(second.unwrap_err().contains("has not returned yet"));
        // A writer releases it; reads work again once it has returned.
        let writer = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
        drop(writer);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while in_flight.load(Ordering::Acquire) && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        std::fs::remove_file(&fifo).unwrap();
        std::fs::write(&fifo, "[OPTIONS]\nnftables: 1\n").unwrap();
        let third = read(in_flight, fifo, dir.join("cluster.fw")).await.unwrap();
        assert!(third.host_fw_error.is_empty(), "{third:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
