//! Guest network recovery (`RecoverGuestNetwork`): before a sandbox VM first starts, its
//! overlay gets a network profile bound to the sandbox NIC's MAC, with the granted address and
//! no gateway, so probes reach a restored guest whose own configuration names a production
//! network.
//!
//! The guest's filesystems are only ever opened inside a libguestfs appliance (guestfish, a
//! small VM with its own kernel): a hostile filesystem image never meets the node's kernel.
//! The appliance gets the run's qcow2 overlay, opened as qcow2, whose backing (the read-only
//! loop device of the backup) QEMU opens read-only: every write lands in the overlay, and is
//! undone by deleting it. One guestfish process per recovery, driven over its stdin: each
//! batch of commands ends with an `echo` of a random marker, so the connector reads exactly
//! the answers of that batch (guestfish answers line by line on a pipe). Nothing of the guest
//! reaches guestfish unquoted: paths are checked against a conservative character set, file
//! contents are written as escaped strings.
//!
//! Bounds: one deadline over the whole session (`limits.guest_network_timeout_secs`), after
//! which the appliance's process group and every descendant are killed; the appliance's
//! memory (`limits.guest_network_memory_mib`, `LIBGUESTFS_MEMSIZE`); the bytes read from
//! guestfish ([`MAX_SESSION_BYTES`]), each guest file read ([`MAX_GUEST_FILE_BYTES`]) and the
//! files considered per directory ([`MAX_PROFILES`]).

mod confinement;
mod executor;
mod identities;
mod launcher;
mod plan;
mod profiles;
mod session;

pub use confinement::{
    APPLIANCE_TMP_MIB, ApplianceUser, CONFINEMENT, KVM_DEVICE, LOOP_DEVICE_GROUP, OVERLAY_IN_UNIT,
    appliance_launcher, confine,
};
pub use identities::{
    APPLIANCE_UNITS, IdentityLease, MAX_APPLIANCE_USERS, UnitLease, lease, running_users,
    users_of_loaded_units,
};
pub use launcher::{
    APPLIANCE_EXEC, LOOP_IOCTL_BASE, LOOP_IOCTL_MASK, exec_without_loop_ioctls, loop_ioctl_filter,
};
pub use profiles::{
    firewalld_allow, firewalld_default_zone, ifcfg_disable, ifcfg_fights, ifcfg_profile,
    ifupdown_disable, ifupdown_stanza, netplan_fights, netplan_yaml, networkd_fights,
    networkd_link, networkd_profile, networkmanager_disable, networkmanager_fights,
    networkmanager_keyfile,
};
pub use session::{
    Appliance, Confinement, GuestNetworkUnit, UNIT_MEMORY_OVERHEAD_MIB, guest_network_unit,
    guestfish_call, guestfish_installed,
};

use certistack_core::journal::Op;
use certistack_core::validate::{IpInterface, RunId, Vmid};
use sha2::{Digest, Sha256};
use std::fmt::Write as _;

/// Bytes guestfish may print over one recovery; past it the session is abandoned.
pub const MAX_SESSION_BYTES: usize = 4 * 1024 * 1024;
/// Bytes of one guest configuration file read; a larger file is not edited (and reported).
pub const MAX_GUEST_FILE_BYTES: u64 = 64 * 1024;
/// The longest command line sent to guestfish. guestfish reads its script with an 8 KiB
/// `fgets`, so a longer line would reach its parser as two commands, the second starting with
/// guest-controlled text (a leading `!` is a host shell command): no line may come near it.
pub const MAX_COMMAND_BYTES: usize = 4096;
/// The raw bytes of a guest file written per `write`/`write-append` command: quoted, a byte
/// takes at most 4 characters, so a chunk stays far below [`MAX_COMMAND_BYTES`] with its path.
const WRITE_CHUNK_BYTES: usize = 768;
// guestfish's `fgets` reads at most 8191 bytes of a line.
const _: () = assert!(MAX_COMMAND_BYTES < 8191);
/// Files of one configuration directory considered; more are reported, not read.
pub const MAX_PROFILES: usize = 64;
/// The journal's `op` of a recovery. Its records do not open a resource of their own: what it
/// writes lives in the overlay and goes with it.
pub const OP: &Op = &Op::GuestNetworkRecover;
/// The name every file the recovery writes carries, and the suffix of the files it sets aside.
const PROFILE_NAME: &str = "certistack-sandbox";
const DISABLED_SUFFIX: &str = ".certistack-disabled";
/// The interface name ifupdown guests give the sandbox NIC (by MAC, through a systemd link
/// file): ifupdown names interfaces, not MACs.
const IFUPDOWN_NAME: &str = "cssandbox0";
/// Lines of ifupdown and ifcfg files the recovery comments out start with this.
const COMMENT_PREFIX: &str = "#certistack-disabled# ";

/// The MAC address the connector gives a sandbox VM's NIC `nic` (its position among the VM's
/// NICs): derived from the run and the VMID, so `CreateVm` and `RecoverGuestNetwork` agree
/// without state, locally administered and unicast (first octet `0x02`), unlikely to collide
/// on the run's VNet.
pub fn sandbox_mac(run_id: &RunId, vmid: Vmid, nic: u32) -> String {
    let digest = Sha256::new()
        .chain_update(b"certistack-sandbox-mac\0")
        .chain_update(run_id.as_str().as_bytes())
        .chain_update(format!("\0{vmid}\0{nic}").as_bytes())
        .finalize();
    let mut mac = String::from("02");
    for byte in digest.iter().take(5) {
        let _ = write!(mac, ":{byte:02x}");
    }
    mac
}

/// The network stacks recovery writes a profile for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetworkStack {
    Ifupdown,
    Netplan,
    NetworkManager,
    Ifcfg,
    Networkd,
}

impl NetworkStack {
    pub fn name(self) -> &'static str {
        match self {
            Self::Ifupdown => "ifupdown",
            Self::Netplan => "netplan",
            Self::NetworkManager => "networkmanager",
            Self::Ifcfg => "ifcfg",
            Self::Networkd => "systemd-networkd",
        }
    }
}

/// What the sandbox NIC gets: its MAC and the granted address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxNic {
    /// Lower-case, colon-separated.
    pub mac: String,
    pub address: IpInterface,
}

impl SandboxNic {
    fn is_ipv4(&self) -> bool {
        self.address.address.0.is_ipv4()
    }
}

/// Why a recovery did not complete.
#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    #[error(
        "{0}: guest network recovery does not support Windows guests yet; nothing was written (use network_recovery.mode preserve)"
    )]
    Windows(String),
    #[error(
        "{0}; nothing was written: the guest's network configuration is not one recovery knows (use network_recovery.mode preserve)"
    )]
    Unrecognized(String),
    #[error(
        "the libguestfs appliance did not finish within {0} s (limits.guest_network_timeout_secs); it was killed, and what it wrote stays in the overlay until the overlay is deleted"
    )]
    Timeout(u64),
    #[error("{0}")]
    Tool(String),
    #[error(
        "{0}; nothing was written (use network_recovery.mode preserve, or fix it in the source VM)"
    )]
    Refused(String),
}

/// A file recovery wrote, changed or set aside.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FileChange {
    pub path: String,
    pub action: &'static str,
    pub sha256: String,
    pub renamed_to: String,
}

/// What one recovery found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Evidence {
    pub os_type: String,
    pub distro: String,
    pub version: String,
    pub product_name: String,
    pub network_stack: String,
    pub files: Vec<FileChange>,
    pub firewalld_zone: String,
    pub notes: Vec<String>,
}

#[cfg(test)]
mod tests;
