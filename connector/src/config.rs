//! The connector's configuration file (`/etc/certistack/connector.toml` by default).
//!
//! Unknown keys are refused (a typo must not silently disable a setting); every path is
//! absolute; the file itself and the trust files it names must not be writable by others and
//! the private key must be readable by nobody else. The daemon refuses to start otherwise,
//! saying which file and what to do.

use certistack_core::files::{self, FileError};
use certistack_core::net::IpNetwork;
use certistack_core::validate::{NodeName, Validated};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub const DEFAULT_PATH: &str = "/etc/certistack/connector.toml";
use certistack_core::limits::MAX_SCREENDUMP_BYTES;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// This node's name; must equal the DNS SAN of its certificate and the grants' `node`.
    pub node_name: String,
    /// Address and port the gRPC server listens on.
    pub listen: SocketAddr,
    pub tls: TlsFiles,
    pub paths: StatePaths,
    #[serde(default)]
    pub tools: ToolPaths,
    #[serde(default)]
    pub pve: PvePaths,
    #[serde(default)]
    pub limits: Limits,
    /// How the sandbox network treats what the node does to its VNets.
    #[serde(default)]
    pub sandbox: SandboxPolicy,
    /// How the tools that must outlive the daemon are started (`[process]`).
    #[serde(default)]
    pub process: ProcessPolicy,
    /// How guest network recovery boots the libguestfs appliance (`[guest_network]`).
    #[serde(default)]
    pub guest_network: GuestNetworkPolicy,
}

/// The accelerator of the libguestfs appliance that guest network recovery boots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ApplianceAccelerator {
    /// libguestfs decides (`-machine accel=kvm:tcg`): KVM where `/dev/kvm` opens, else TCG.
    #[default]
    Auto,
    /// TCG always (`LIBGUESTFS_BACKEND_SETTINGS=force_tcg`): for a node nested under a
    /// hypervisor whose `/dev/kvm` opens and accepts the appliance but never runs it to the end,
    /// where every `rewrite` recovery would otherwise run until its deadline.
    Tcg,
}

impl ApplianceAccelerator {
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Tcg => "tcg",
        }
    }
}

/// The longest `guest_network.appliance_users` list.
pub const MAX_APPLIANCE_USERS: usize = 64;

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct GuestNetworkPolicy {
    /// `"auto"` (the default) or `"tcg"`.
    pub accelerator: ApplianceAccelerator,
    /// The unprivileged system users confined appliances run as, one per appliance running
    /// at once (the package's sysusers.d file creates `certistack-guestnet-1` to `-4`); never
    /// root. Two appliances never share a user, so one cannot reach the other's processes or
    /// files; with all of them busy, a recovery waits for none and is refused.
    pub appliance_users: Vec<String>,
    /// `"auto"` (the default) or `"always"`: when the appliance runs in its confined unit.
    pub confined: ApplianceConfinement,
}

/// When guest network recovery (and NodeChecks' appliance boot) runs the libguestfs
/// appliance in its confined transient unit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ApplianceConfinement {
    /// Whenever the daemon starts tools in transient units (`process.transient_units`);
    /// without systemd the appliance is the daemon's child, unconfined.
    #[default]
    Auto,
    /// Always, through `process.systemd_run`, even when this daemon's own init is not
    /// systemd (a node whose systemd runs in a container beside the daemon): the appliance
    /// never runs unconfined, and a recovery fails where no systemd answers.
    Always,
}

impl Default for GuestNetworkPolicy {
    fn default() -> Self {
        Self {
            accelerator: ApplianceAccelerator::default(),
            appliance_users: (1..=4)
                .map(|n| format!("certistack-guestnet-{n}"))
                .collect(),
            confined: ApplianceConfinement::Auto,
        }
    }
}

/// Where `qm start`, `proxmox-backup-client map` and guest network recovery's guestfish run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TransientUnits {
    /// In transient systemd units of their own when systemd is the init system
    /// (`/run/systemd/system` exists), directly as the daemon's children otherwise.
    #[default]
    Auto,
    /// Always as the daemon's children: a restart of the daemon's unit then unmaps every
    /// backup, and QEMU inherits the daemon's sandbox.
    Never,
}

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProcessPolicy {
    /// `"auto"` (the default) or `"never"`. Under systemd, the mapping holder and QEMU live in
    /// `certistack-map-…`/`certistack-qm-start-…` units outside the connector's cgroup and
    /// sandbox, so restarting or upgrading the connector keeps every run's mappings; a guest
    /// network recovery's guestfish and appliance in a `certistack-guestnet-…` unit.
    pub transient_units: TransientUnits,
    /// `systemd-run`, which starts those units.
    pub systemd_run: PathBuf,
    /// `systemctl`, which stops and resets them at unmap and cleanup.
    pub systemctl: PathBuf,
}

/// What `PrepareSandbox` does with a VNet the node forwards for.
///
/// ifupdown2 writes `forwarding=1` on a bridge unless its stanza has an address method other
/// than `dhcp` or `auto` and no `address` (`ip-forward off` does not prevent it), and SDN
/// writes VNets as bare stanzas, so a node may forward on every VNet it has. The run's table
/// drops all forwarding into and out of the VNet either way; the sysctl is a second layer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ForwardingPolicy {
    /// Refuse a VNet with forwarding on (IPv4 or IPv6): the operator fixes the node.
    #[default]
    Refuse,
    /// Set the VNet's forwarding sysctls to 0 for the run, journaled with their previous
    /// values, and restore them at release or cleanup.
    DisableForRun,
}

#[derive(Debug, Clone, Default, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxPolicy {
    /// `"refuse"` (the default) or `"disable-for-run"`.
    pub forwarding: ForwardingPolicy,
}

/// Where Proxmox keeps what the connector inspects; the defaults are PVE's own paths.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PvePaths {
    /// QMP (`<vmid>.qmp`) and guest-agent (`<vmid>.qga`) sockets.
    pub qemu_server_run_dir: PathBuf,
    /// VM configs (`<vmid>.conf`), read to check a VM's run marker.
    pub vm_config_dir: PathBuf,
    /// Backing files of `proxmox-backup-client map` loop devices.
    pub pbs_loopdev_dir: PathBuf,
    /// The cluster database; overlays on the same filesystem draw a warning.
    pub pve_cluster_dir: PathBuf,
    /// dpkg's status database, read (never executed) for the `pve-manager` and `qemu-server`
    /// package versions that NodeChecks reports.
    pub dpkg_status: PathBuf,
    /// The interfaces file SDN writes its VNets to, read by NodeChecks for the stanza
    /// ifupdown2 applies to a VNet on `ifreload -a` (its forwarding follows from it).
    pub sdn_interfaces: PathBuf,
    /// The host's LVM configuration, read by NodeChecks for whether `global_filter` keeps
    /// LVM off the loop devices of backup mappings.
    pub lvm_conf: PathBuf,
    /// The cluster's per-node directories; NodeChecks reads `<nodes_dir>/<node_name>/host.fw`
    /// for the firewall the node runs (pve-firewall or proxmox-firewall).
    pub nodes_dir: PathBuf,
    /// The mount table NodeChecks reads for the cgroup version (what is mounted on
    /// `/sys/fs/cgroup`).
    pub mounts: PathBuf,
    /// The KVM device NodeChecks opens (read-write, as QEMU does) to see whether guests get KVM.
    pub kvm_device: PathBuf,
    /// The CPU flags NodeChecks reads: `hypervisor` (the node is a virtual machine), `vmx`/`svm`.
    pub cpuinfo: PathBuf,
    /// The accounts the appliance users (`guest_network.appliance_users`) and the loop device's
    /// group `disk` are read from, as systemd, which starts the appliance, resolves them.
    pub passwd: PathBuf,
    pub group: PathBuf,
    /// The machine's DMI names (`sys_vendor`, `product_name`), read by NodeChecks.
    pub dmi_dir: PathBuf,
}

impl Default for PvePaths {
    fn default() -> Self {
        Self {
            qemu_server_run_dir: "/var/run/qemu-server".into(),
            vm_config_dir: "/etc/pve/qemu-server".into(),
            pbs_loopdev_dir: "/run/pbs-loopdev".into(),
            pve_cluster_dir: "/var/lib/pve-cluster".into(),
            dpkg_status: "/var/lib/dpkg/status".into(),
            sdn_interfaces: "/etc/network/interfaces.d/sdn".into(),
            lvm_conf: "/etc/lvm/lvm.conf".into(),
            nodes_dir: "/etc/pve/nodes".into(),
            mounts: "/proc/self/mounts".into(),
            kvm_device: "/dev/kvm".into(),
            passwd: "/etc/passwd".into(),
            group: "/etc/group".into(),
            cpuinfo: "/proc/cpuinfo".into(),
            dmi_dir: "/sys/class/dmi/id".into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// The node certificate issued by the controller CA (PEM).
    pub certificate: PathBuf,
    /// The node's private key, generated on the node by `enroll --csr` (PEM, mode 0600).
    pub private_key: PathBuf,
    /// The controller CA: the only issuer accepted for client certificates (PEM).
    pub controller_ca: PathBuf,
    /// The controller's run-authority Ed25519 public key (PEM), pinned for grant signatures.
    pub run_authority_public_key: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatePaths {
    /// Run registry and journals (created 0700).
    pub state_dir: PathBuf,
    /// Parent of the per-run overlay directories.
    pub overlay_root: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ToolPaths {
    pub proxmox_backup_client: PathBuf,
    pub qm: PathBuf,
    pub qemu_img: PathBuf,
    /// iproute2, for the probe address on the VNet.
    pub ip: PathBuf,
    /// nftables, for the run's containment table.
    pub nft: PathBuf,
    /// Reads the legacy IPv4 NAT table (pve-firewall and SDN SNAT use iptables-legacy, which
    /// `nft list ruleset` does not show). Absent: the check is skipped and the evidence says so.
    pub iptables_legacy_save: PathBuf,
    /// The same for IPv6.
    pub ip6tables_legacy_save: PathBuf,
    /// libguestfs' shell (libguestfs-tools), for guest network recovery on an overlay.
    pub guestfish: PathBuf,
}

impl Default for ProcessPolicy {
    fn default() -> Self {
        Self {
            transient_units: TransientUnits::Auto,
            systemd_run: "/usr/bin/systemd-run".into(),
            systemctl: "/usr/bin/systemctl".into(),
        }
    }
}

impl Config {
    /// Whether the libguestfs appliance runs in its confined transient unit.
    pub fn appliance_confined(&self) -> bool {
        self.guest_network.confined == ApplianceConfinement::Always
            || self.process.use_transient_units()
    }
}

impl ProcessPolicy {
    /// Whether this daemon starts the outliving tools in transient units.
    pub fn use_transient_units(&self) -> bool {
        match self.transient_units {
            TransientUnits::Auto => crate::systemd::booted(),
            TransientUnits::Never => false,
        }
    }
}

impl Default for ToolPaths {
    fn default() -> Self {
        Self {
            proxmox_backup_client: "/usr/bin/proxmox-backup-client".into(),
            qm: "/usr/sbin/qm".into(),
            qemu_img: "/usr/bin/qemu-img".into(),
            ip: "/usr/sbin/ip".into(),
            nft: "/usr/sbin/nft".into(),
            iptables_legacy_save: "/usr/sbin/iptables-legacy-save".into(),
            ip6tables_legacy_save: "/usr/sbin/ip6tables-legacy-save".into(),
            guestfish: "/usr/bin/guestfish".into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Runs that may be open at once.
    pub max_concurrent_runs: usize,
    /// Largest request message accepted, in bytes.
    pub max_request_bytes: usize,
    /// Seconds `proxmox-backup-client map` may take.
    pub map_timeout_secs: u64,
    /// Seconds any other tool call (`qm`, `qemu-img`, `unmap`) may take.
    pub tool_timeout_secs: u64,
    /// Seconds one QMP or guest-agent exchange may take.
    pub guest_timeout_secs: u64,
    /// Seconds after a grant's deadline before the daemon cleans up a run that was not ended.
    pub expiry_grace_secs: u64,
    /// Seconds one probe may take, connection and answer included.
    pub probe_timeout_secs: u64,
    /// Bytes one probe may read from its target (LDAP, DNS, HTTP body, TCP banner together).
    pub max_probe_response_bytes: usize,
    /// Entries or answer records one probe may collect (LDAP entries, DNS answers).
    pub max_probe_entries: usize,
    /// Shortest probe-network prefix (IPv4; IPv6 uses this plus 96) a grant may name: a short
    /// prefix installs a connected route that can beat the node's default route.
    pub min_probe_prefix: u8,
    /// Records one run's journal may hold; operations past it are refused with
    /// RESOURCE_EXHAUSTED while cleanup keeps a reserved budget.
    pub max_journal_records: usize,
    /// Bytes one run's journal may hold (same rule as the record cap).
    pub max_journal_bytes: u64,
    /// Days a closed run stays on disk before it is pruned (never one that holds resources or
    /// is quarantined).
    pub closed_run_retention_days: u64,
    /// vCPUs all open runs' sandbox VMs may ask for together.
    pub max_sandbox_cores: u32,
    /// MiB of memory all open runs' sandbox VMs may ask for together.
    pub max_sandbox_memory_mib: u64,
    /// Longest validity accepted on an operator certificate, in seconds (from not_before to
    /// not_after). Ten minutes by default: operator certificates are minted per CLI invocation
    /// and cannot be revoked.
    pub max_operator_cert_secs: u64,
    /// Milliseconds a peer has to complete its TLS handshake.
    pub handshake_timeout_ms: u64,
    /// Handshakes in progress at once, over all peers.
    pub max_pending_handshakes: usize,
    /// Handshakes in progress at once from one source address.
    pub max_pending_handshakes_per_source: usize,
    /// Established connections at once, over all peers.
    pub max_connections: usize,
    /// Established connections at once for one client identity (certificate).
    pub max_connections_per_identity: usize,
    /// HTTP/2 streams one connection may have open at once.
    pub max_streams_per_connection: u32,
    /// Seconds an established connection may stay without a request before it is closed.
    pub idle_timeout_secs: u64,
    /// File descriptors kept in reserve for the tools and journals: connections are not
    /// accepted when fewer than this remain below RLIMIT_NOFILE.
    pub reserved_fds: usize,
    /// Bytes of one QMP screendump image the node returns; a larger one is removed and the
    /// call refused with RESOURCE_EXHAUSTED.
    pub max_screendump_bytes: usize,
    /// Bytes of a firewall listing (`nft list ruleset`, `iptables-legacy-save -t nat`) the NAT
    /// check reads. A larger listing refuses PrepareSandbox: a rule past the cut could go
    /// unseen. proxmox-firewall's base ruleset alone is about 13 KB; a busy node passes 64 KiB.
    pub max_ruleset_bytes: usize,
    /// CPU weight (`qm create --cpuunits`) of sandbox VMs. PVE 9 runs on cgroup v2 only, where
    /// every VM's default weight is 100: a sandbox must weigh less to yield to production VMs.
    pub sandbox_cpu_units: u32,
    /// Seconds one guest network recovery may take, libguestfs appliance boot included (it
    /// boots under TCG where the node's KVM is busy or absent); at the deadline its process
    /// group is killed and the step fails.
    pub guest_network_timeout_secs: u64,
    /// MiB of memory the libguestfs appliance of a guest network recovery gets.
    pub guest_network_memory_mib: u64,
    /// Networks of the peers that must reach the node during a flood of handshakes: the
    /// controller's management network. Their handshakes keep a reserved share of the
    /// pending-handshake slots and are never evicted for a peer outside them. Empty by default:
    /// every peer is treated alike.
    pub trusted_peer_networks: Vec<TrustedNetwork>,
}

/// A network of `limits.trusted_peer_networks`: `address/prefix` with no host bits set, e.g.
/// `192.0.2.0/24`, `192.0.2.7/32` or `2001:db8:1::/48`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(try_from = "String", into = "String")]
pub struct TrustedNetwork(IpNetwork);

impl TrustedNetwork {
    pub fn network(&self) -> IpNetwork {
        self.0
    }
}

impl TryFrom<String> for TrustedNetwork {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        let example = "write a network as address/prefix, e.g. 192.0.2.0/24, 192.0.2.7/32 for one host, or 2001:db8:1::/48";
        let entry = format!("limits.trusted_peer_networks entry {text:?}");
        let Some((address, prefix)) = text.split_once('/') else {
            return Err(format!("{entry} has no prefix length: {example}"));
        };
        let address: std::net::IpAddr = address.parse().map_err(|_| {
            format!("{entry}: {address:?} is not an IPv4 or IPv6 address: {example}")
        })?;
        let longest = certistack_core::net::max_prefix_len(address);
        let prefix_len = prefix
            .parse::<u8>()
            .ok()
            .filter(|p| *p <= longest)
            .ok_or_else(|| {
                format!("{entry}: the prefix length must be a number from 1 to {longest} for this address: {example}")
            })?;
        if prefix_len == 0 {
            return Err(format!(
                "{entry} trusts every peer, so nothing stays reserved for the controller during a flood: list only the controller's management network"
            ));
        }
        let network =
            IpNetwork::new(address, prefix_len).ok_or_else(|| format!("{entry}: {example}"))?;
        // The network's base is the address with its host bits cleared.
        if network.to_string() != format!("{address}/{prefix_len}") {
            return Err(format!(
                "{entry} has host bits set: write {network} for the network, or {address}/{longest} for that one host"
            ));
        }
        Ok(Self(network))
    }
}

impl From<TrustedNetwork> for String {
    fn from(network: TrustedNetwork) -> String {
        network.0.to_string()
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_concurrent_runs: 4,
            max_request_bytes: 64 * 1024,
            map_timeout_secs: 120,
            tool_timeout_secs: 60,
            guest_timeout_secs: 10,
            expiry_grace_secs: 300,
            probe_timeout_secs: 5,
            max_probe_response_bytes: 256 * 1024,
            max_probe_entries: 64,
            min_probe_prefix: 24,
            max_journal_records: certistack_core::limits::DEFAULT_MAX_JOURNAL_RECORDS,
            max_journal_bytes: certistack_core::limits::DEFAULT_MAX_JOURNAL_BYTES,
            closed_run_retention_days: 90,
            max_sandbox_cores: 16,
            max_sandbox_memory_mib: 32 * 1024,
            max_operator_cert_secs: 600,
            handshake_timeout_ms: 3000,
            max_pending_handshakes: 256,
            max_pending_handshakes_per_source: 16,
            max_connections: 256,
            max_connections_per_identity: 16,
            max_streams_per_connection: 64,
            idle_timeout_secs: 300,
            reserved_fds: 128,
            max_screendump_bytes: 8 * 1024 * 1024,
            max_ruleset_bytes: 16 * 1024 * 1024,
            sandbox_cpu_units: 10,
            guest_network_timeout_secs: 300,
            guest_network_memory_mib: 512,
            trusted_peer_networks: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error("{path}: {reason}")]
    Parse { path: PathBuf, reason: String },
    #[error("{path}: `{key}` = {value:?} is invalid: {reason}")]
    Invalid {
        path: PathBuf,
        key: &'static str,
        value: String,
        reason: String,
    },
}

impl Config {
    /// Reads and checks the config file; the files it names are checked when they are loaded.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = files::read_trusted(path)?;
        let config: Config = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        config.check(path)?;
        Ok(config)
    }

    fn check(&self, path: &Path) -> Result<(), ConfigError> {
        NodeName::validate(&self.node_name).map_err(|reason| ConfigError::Invalid {
            path: path.to_owned(),
            key: "node_name",
            value: self.node_name.clone(),
            reason,
        })?;
        let absolute: [(&'static str, &Path); 30] = [
            ("tls.certificate", &self.tls.certificate),
            ("tls.private_key", &self.tls.private_key),
            ("tls.controller_ca", &self.tls.controller_ca),
            (
                "tls.run_authority_public_key",
                &self.tls.run_authority_public_key,
            ),
            ("paths.state_dir", &self.paths.state_dir),
            ("paths.overlay_root", &self.paths.overlay_root),
            (
                "tools.proxmox_backup_client",
                &self.tools.proxmox_backup_client,
            ),
            ("tools.qm", &self.tools.qm),
            ("tools.qemu_img", &self.tools.qemu_img),
            ("tools.ip", &self.tools.ip),
            ("tools.nft", &self.tools.nft),
            (
                "tools.iptables_legacy_save",
                &self.tools.iptables_legacy_save,
            ),
            (
                "tools.ip6tables_legacy_save",
                &self.tools.ip6tables_legacy_save,
            ),
            ("tools.guestfish", &self.tools.guestfish),
            ("pve.qemu_server_run_dir", &self.pve.qemu_server_run_dir),
            ("pve.vm_config_dir", &self.pve.vm_config_dir),
            ("pve.pbs_loopdev_dir", &self.pve.pbs_loopdev_dir),
            ("pve.pve_cluster_dir", &self.pve.pve_cluster_dir),
            ("pve.dpkg_status", &self.pve.dpkg_status),
            ("pve.sdn_interfaces", &self.pve.sdn_interfaces),
            ("pve.lvm_conf", &self.pve.lvm_conf),
            ("pve.nodes_dir", &self.pve.nodes_dir),
            ("pve.mounts", &self.pve.mounts),
            ("pve.kvm_device", &self.pve.kvm_device),
            ("pve.passwd", &self.pve.passwd),
            ("pve.group", &self.pve.group),
            ("pve.cpuinfo", &self.pve.cpuinfo),
            ("pve.dmi_dir", &self.pve.dmi_dir),
            ("process.systemd_run", &self.process.systemd_run),
            ("process.systemctl", &self.process.systemctl),
        ];
        for (key, value) in absolute {
            if !value.is_absolute() {
                return Err(ConfigError::Invalid {
                    path: path.to_owned(),
                    key,
                    value: value.display().to_string(),
                    reason: "must be an absolute path".into(),
                });
            }
        }
        // Overlay paths reach the appliance unit's BindPaths=, which systemd splits at
        // whitespace and ':' (and unquotes and unescapes).
        let overlay_root = self.paths.overlay_root.display().to_string();
        if overlay_root
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || ":\\\"'".contains(c))
        {
            return Err(ConfigError::Invalid {
                path: path.to_owned(),
                key: "paths.overlay_root",
                value: overlay_root,
                reason: "may not hold whitespace, control characters, ':', '\\', or quotes (systemd's BindPaths= would split or unquote it); choose a plain directory such as /var/lib/certistack-overlays".into(),
            });
        }
        let users = &self.guest_network.appliance_users;
        let distinct: std::collections::BTreeSet<&String> = users.iter().collect();
        let plain = |name: &String| {
            !name.is_empty()
                && name.len() <= 32
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        if users.is_empty()
            || users.len() > MAX_APPLIANCE_USERS
            || distinct.len() != users.len()
            || !users.iter().all(plain)
        {
            return Err(ConfigError::Invalid {
                path: path.to_owned(),
                key: "guest_network.appliance_users",
                value: format!("{users:?}"),
                reason: format!(
                    "must list 1 to {} distinct system user names (letters, digits, '-', '_', '.'; at most 32 characters), one per appliance that may run at once",
                    MAX_APPLIANCE_USERS
                ),
            });
        }
        let limit = |key, value: usize, lo: usize, hi: usize| {
            if (lo..=hi).contains(&value) {
                Ok(())
            } else {
                Err(ConfigError::Invalid {
                    path: path.to_owned(),
                    key,
                    value: value.to_string(),
                    reason: format!("must be {lo}..={hi}"),
                })
            }
        };
        limit(
            "limits.max_concurrent_runs",
            self.limits.max_concurrent_runs,
            1,
            64,
        )?;
        limit(
            "limits.max_request_bytes",
            self.limits.max_request_bytes,
            4096,
            4 * 1024 * 1024,
        )?;
        let secs = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        limit(
            "limits.map_timeout_secs",
            secs(self.limits.map_timeout_secs),
            5,
            3600,
        )?;
        limit(
            "limits.tool_timeout_secs",
            secs(self.limits.tool_timeout_secs),
            5,
            3600,
        )?;
        limit(
            "limits.guest_timeout_secs",
            secs(self.limits.guest_timeout_secs),
            1,
            600,
        )?;
        limit(
            "limits.expiry_grace_secs",
            secs(self.limits.expiry_grace_secs),
            0,
            86_400,
        )?;
        limit(
            "limits.probe_timeout_secs",
            secs(self.limits.probe_timeout_secs),
            1,
            300,
        )?;
        let l = &self.limits;
        limit(
            "limits.max_probe_response_bytes",
            l.max_probe_response_bytes,
            1024,
            16 * 1024 * 1024,
        )?;
        limit("limits.max_probe_entries", l.max_probe_entries, 1, 4096)?;
        limit(
            "limits.min_probe_prefix",
            usize::from(l.min_probe_prefix),
            8,
            30,
        )?;
        limit(
            "limits.max_journal_records",
            l.max_journal_records,
            1000,
            1_000_000,
        )?;
        limit(
            "limits.max_journal_bytes",
            secs(l.max_journal_bytes),
            1024 * 1024,
            1024 * 1024 * 1024,
        )?;
        limit(
            "limits.closed_run_retention_days",
            secs(l.closed_run_retention_days),
            1,
            36_500,
        )?;
        limit(
            "limits.max_sandbox_cores",
            usize::try_from(l.max_sandbox_cores).unwrap_or(usize::MAX),
            1,
            4096,
        )?;
        limit(
            "limits.max_sandbox_memory_mib",
            secs(l.max_sandbox_memory_mib),
            64,
            64 * 1024 * 1024,
        )?;
        limit(
            "limits.max_operator_cert_secs",
            secs(l.max_operator_cert_secs),
            60,
            7 * 86_400,
        )?;
        limit(
            "limits.handshake_timeout_ms",
            secs(l.handshake_timeout_ms),
            100,
            60_000,
        )?;
        limit(
            "limits.max_pending_handshakes",
            l.max_pending_handshakes,
            1,
            65_536,
        )?;
        limit(
            "limits.max_pending_handshakes_per_source",
            l.max_pending_handshakes_per_source,
            1,
            l.max_pending_handshakes,
        )?;
        limit("limits.max_connections", l.max_connections, 1, 65_536)?;
        limit(
            "limits.max_connections_per_identity",
            l.max_connections_per_identity,
            1,
            l.max_connections,
        )?;
        limit(
            "limits.max_streams_per_connection",
            usize::try_from(l.max_streams_per_connection).unwrap_or(usize::MAX),
            1,
            1024,
        )?;
        limit(
            "limits.idle_timeout_secs",
            secs(l.idle_timeout_secs),
            10,
            86_400,
        )?;
        limit("limits.reserved_fds", l.reserved_fds, 16, 65_536)?;
        limit(
            "limits.max_screendump_bytes",
            l.max_screendump_bytes,
            1024,
            MAX_SCREENDUMP_BYTES,
        )?;
        limit(
            "limits.max_ruleset_bytes",
            l.max_ruleset_bytes,
            64 * 1024,
            256 * 1024 * 1024,
        )?;
        // cgroup v2's cpu.weight range; 100 or more would not yield to PVE's default weight.
        limit(
            "limits.sandbox_cpu_units",
            usize::try_from(l.sandbox_cpu_units).unwrap_or(usize::MAX),
            1,
            99,
        )?;
        limit(
            "limits.guest_network_timeout_secs",
            secs(l.guest_network_timeout_secs),
            1,
            3600,
        )?;
        // libguestfs refuses an appliance below 256 MiB; more than 4 GiB is never needed to
        // edit a few configuration files.
        limit(
            "limits.guest_network_memory_mib",
            secs(l.guest_network_memory_mib),
            256,
            4096,
        )?;
        Ok(())
    }

    pub fn node(&self) -> Result<NodeName, String> {
        NodeName::validate(&self.node_name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const GOOD: &str = r#"
node_name = "pve1"
listen = "127.0.0.1:7443"
[tls]
certificate = "/etc/certistack/node.crt"
private_key = "/etc/certistack/node.key"
controller_ca = "/etc/certistack/ca.crt"
run_authority_public_key = "/etc/certistack/run-authority.pub"
[paths]
state_dir = "/var/lib/certistack"
overlay_root = "/var/lib/certistack/overlays"
"#;

    fn write(name: &str, text: &str, mode: u32) -> PathBuf {
        let path = std::env::temp_dir().join(format!(
            "certistack-config-{}-{name}.toml",
            std::process::id()
        ));
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn process_settings_default_to_auto_and_refuse_what_they_do_not_know() {
        let good = write("process-good", GOOD, 0o644);
        let config = Config::load(&good).unwrap();
        assert_eq!(config.process.transient_units, TransientUnits::Auto);
        assert_eq!(
            config.process.use_transient_units(),
            std::path::Path::new("/run/systemd/system").is_dir()
        );
        let never = write(
            "process-never",
            &format!("{GOOD}[process]\ntransient_units = \"never\"\n"),
            0o644,
        );
        let never_config = Config::load(&never).unwrap();
        assert_eq!(never_config.process.transient_units, TransientUnits::Never);
        assert!(!never_config.process.use_transient_units());
        let unknown = write(
            "process-always",
            &format!("{GOOD}[process]\ntransient_units = \"always\"\n"),
            0o644,
        );
        assert!(matches!(
            Config::load(&unknown),
            Err(ConfigError::Parse { .. })
        ));
        let relative = write(
            "process-relative",
            &format!("{GOOD}[process]\nsystemd_run = \"systemd-run\"\n"),
            0o644,
        );
        let err = Config::load(&relative).unwrap_err().to_string();
        assert!(err.contains("process.systemd_run"), "{err}");
        for path in [good, never, unknown, relative] {
            std::fs::remove_file(path).unwrap();
        }
    }

    /// An overlay root systemd's `BindPaths=` would split (a space makes a second bind of
    /// `/`, writable) is refused when the configuration is read.
    #[test]
    fn an_overlay_root_that_bind_paths_would_split_is_refused() {
        for (name, root) in [
            ("space", "/ /x"),
            ("colon", "/var/lib/a:b"),
            ("quote", "/var/lib/\\\"x"),
        ] {
            let text = GOOD.replace(
                "overlay_root = \"/var/lib/certistack/overlays\"",
                &format!("overlay_root = \"{root}\""),
            );
            let file = write(&format!("overlay-root-{name}"), &text, 0o644);
            let err = Config::load(&file).unwrap_err().to_string();
            assert!(
                err.contains("paths.overlay_root") && err.contains("BindPaths"),
                "{err}"
            );
            std::fs::remove_file(file).unwrap();
        }
    }

    #[test]
    fn loads_and_refuses() {
        let good = write("good", GOOD, 0o644);
        let config = Config::load(&good).unwrap();
        assert_eq!(config.limits.max_concurrent_runs, 4);
        assert_eq!(config.tools.qm, PathBuf::from("/usr/sbin/qm"));

        let writable = write("writable", GOOD, 0o666);
        assert!(
            Config::load(&writable)
                .unwrap_err()
                .to_string()
                .contains("chmod")
        );

        let typo = write("typo", &GOOD.replace("node_name", "nodename"), 0o644);
        assert!(matches!(
            Config::load(&typo),
            Err(ConfigError::Parse { .. })
        ));

        let relative = write(
            "relative",
            &GOOD.replace("\"/var/lib/certistack\"", "\"var/lib\""),
            0o644,
        );
        let err = Config::load(&relative).unwrap_err().to_string();
        assert!(
            err.contains("paths.state_dir") && err.contains("absolute"),
            "{err}"
        );

        let bad_node = write("node", &GOOD.replace("pve1", "pve_1"), 0o644);
        assert!(
            Config::load(&bad_node)
                .unwrap_err()
                .to_string()
                .contains("node_name")
        );

        assert_eq!(config.sandbox.forwarding, ForwardingPolicy::Refuse);
        assert_eq!(config.limits.max_ruleset_bytes, 16 * 1024 * 1024);
        let disable = write(
            "forwarding",
            &format!("{GOOD}[sandbox]\nforwarding = \"disable-for-run\"\n"),
            0o644,
        );
        assert_eq!(
            Config::load(&disable).unwrap().sandbox.forwarding,
            ForwardingPolicy::DisableForRun
        );
        let unknown = write(
            "forwarding-off",
            &format!("{GOOD}[sandbox]\nforwarding = \"off\"\n"),
            0o644,
        );
        assert!(matches!(
            Config::load(&unknown),
            Err(ConfigError::Parse { .. })
        ));
        let tiny = write(
            "ruleset",
            &format!("{GOOD}[limits]\nmax_ruleset_bytes = 1024\n"),
            0o644,
        );
        assert!(
            Config::load(&tiny)
                .unwrap_err()
                .to_string()
                .contains("limits.max_ruleset_bytes")
        );
        assert_eq!(config.guest_network.accelerator, ApplianceAccelerator::Auto);
        let tcg = write(
            "accelerator",
            &format!("{GOOD}[guest_network]\naccelerator = \"tcg\"\n"),
            0o644,
        );
        assert_eq!(
            Config::load(&tcg).unwrap().guest_network.accelerator,
            ApplianceAccelerator::Tcg
        );
        let kvm = write(
            "accelerator-kvm",
            &format!("{GOOD}[guest_network]\naccelerator = \"kvm\"\n"),
            0o644,
        );
        let err = Config::load(&kvm).unwrap_err().to_string();
        assert!(err.contains("accelerator") && err.contains("auto"), "{err}");
        assert_eq!(config.guest_network.appliance_users.len(), 4);
        let mut refused = Vec::new();
        for (tag, users) in [
            ("users-empty", "[]"),
            ("users-twice", "[\"a\", \"a\"]"),
            ("users-odd", "[\"a b\"]"),
        ] {
            let path = write(
                tag,
                &format!("{GOOD}[guest_network]\nappliance_users = {users}\n"),
                0o644,
            );
            let err = Config::load(&path).unwrap_err().to_string();
            assert!(
                err.contains("guest_network.appliance_users") && err.contains("distinct"),
                "{users}: {err}"
            );
            refused.push(path);
        }
        for path in [tcg, kvm].into_iter().chain(refused) {
            std::fs::remove_file(path).unwrap();
        }
        for path in [disable, unknown, tiny] {
            std::fs::remove_file(path).unwrap();
        }

        let missing = std::env::temp_dir().join("certistack-config-does-not-exist.toml");
        assert!(
            Config::load(&missing)
                .unwrap_err()
                .to_string()
                .contains("cannot read")
        );
        assert_eq!(config.limits.sandbox_cpu_units, 10);
        let heavy = write(
            "cpuunits",
            &format!("{GOOD}[limits]\nsandbox_cpu_units = 100\n"),
            0o644,
        );
        let err = Config::load(&heavy).unwrap_err().to_string();
        assert!(err.contains("limits.sandbox_cpu_units"), "{err}");

        for path in [good, writable, typo, relative, bad_node, heavy] {
            std::fs::remove_file(path).unwrap();
        }
    }

    #[test]
    fn trusted_peer_networks_are_networks_of_either_family_and_nothing_else() {
        assert!(Limits::default().trusted_peer_networks.is_empty());
        let listed = write(
            "trusted",
            &format!(
                "{GOOD}[limits]\ntrusted_peer_networks = [\"192.0.2.0/24\", \"198.51.100.7/32\", \"2001:db8:1::/48\"]\n"
            ),
            0o644,
        );
        let networks: Vec<String> = Config::load(&listed)
            .unwrap()
            .limits
            .trusted_peer_networks
            .iter()
            .map(|n| n.network().to_string())
            .collect();
        assert_eq!(
            networks,
            ["192.0.2.0/24", "198.51.100.7/32", "2001:db8:1::/48"]
        );
        std::fs::remove_file(listed).unwrap();
        for (entry, expected) in [
            (
                "192.0.2.0",
                "has no prefix length: write a network as address/prefix",
            ),
            (
                "192.0.2.0/33",
                "the prefix length must be a number from 1 to 32",
            ),
            (
                "2001:db8::/129",
                "the prefix length must be a number from 1 to 128",
            ),
            (
                "192.0.2.300/24",
                "\"192.0.2.300\" is not an IPv4 or IPv6 address",
            ),
            ("mgmt/24", "\"mgmt\" is not an IPv4 or IPv6 address"),
            (
                "192.0.2.5/24",
                "has host bits set: write 192.0.2.0/24 for the network, or 192.0.2.5/32 for that one host",
            ),
            ("0.0.0.0/0", "trusts every peer"),
            ("::/0", "trusts every peer"),
        ] {
            let path = write(
                "trusted-bad",
                &format!("{GOOD}[limits]\ntrusted_peer_networks = [\"{entry}\"]\n"),
                0o644,
            );
            let error = Config::load(&path).unwrap_err().to_string();
            assert!(
                error.contains(&format!("limits.trusted_peer_networks entry \"{entry}\""))
                    && error.contains(expected),
                "{entry}: {error}"
            );
            std::fs::remove_file(path).unwrap();
        }
    }
}
