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

use super::NodeExecutor;
use super::resources::Resource;
use super::tool_result;
use crate::config::ApplianceAccelerator;
use crate::executor::{ExecError, Outcome};
use crate::process::{self, TOOL_PATH, ToolCall, ToolIdentity, ToolOutput, TransientRole};
use crate::runs::RunHandle;
use certistack_core::grant::{NetworkRecoveryMode, ProbeKind};
use certistack_core::journal::Phase;
use certistack_core::validate::{ArchiveName, IpInterface, RunId, Vmid};
use certistack_proto::v1 as pb;
use serde_json::json;
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

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
pub const OP: &str = "guestnet.recover";
/// The name every file the recovery writes carries, and the suffix of the files it sets aside.
const PROFILE_NAME: &str = "certistack-sandbox";
const DISABLED_SUFFIX: &str = ".certistack-disabled";
/// The interface name ifupdown guests give the sandbox NIC (by MAC, through a systemd link
/// file): ifupdown names interfaces, not MACs.
const IFUPDOWN_NAME: &str = "cssandbox0";
/// Lines of ifupdown and ifcfg files the recovery comments out start with this.
const COMMENT_PREFIX: &str = "#certistack-disabled# ";
/// The directories whose listings recovery acts on; each is checked for names with control
/// characters, which guestfish's one-path-a-line listings cannot carry.
const CONFIG_DIRECTORIES: [&str; 5] = [
    "/etc/netplan",
    "/etc/NetworkManager/system-connections",
    "/etc/sysconfig/network-scripts",
    "/etc/network/interfaces.d",
    "/etc/systemd/network",
];
/// Answers of the survey before its checks of [`CONFIG_DIRECTORIES`].
const SURVEY_LISTINGS: usize = 15;

/// Whether `stack`'s recovery lists (and may act on) the files of `dir`.
fn stack_reads(stack: NetworkStack, dir: &str) -> bool {
    match stack {
        NetworkStack::Netplan => dir == "/etc/netplan",
        NetworkStack::NetworkManager => {
            dir == "/etc/NetworkManager/system-connections"
                || dir == "/etc/sysconfig/network-scripts"
        }
        NetworkStack::Ifcfg => dir == "/etc/sysconfig/network-scripts",
        NetworkStack::Ifupdown => dir == "/etc/network/interfaces.d",
        NetworkStack::Networkd => dir == "/etc/systemd/network",
    }
}
/// Characters of stderr kept in an error.
const STDERR_KEPT: usize = 2048;

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

/// `/etc/systemd/network/00-certistack-sandbox.network`: first in lexical order, so
/// systemd-networkd applies it to the sandbox NIC before any production file.
pub fn networkd_profile(nic: &SandboxNic) -> String {
    format!(
        "# Written by CertiStack into a disposable sandbox overlay.\n[Match]\nMACAddress={}\n\n[Network]\nAddress={}\nDHCP=no\nIPv6AcceptRA=no\nLinkLocalAddressing=no\n",
        nic.mac, nic.address
    )
}

/// `/etc/systemd/network/10-certistack-sandbox.link`: names the sandbox NIC by its MAC for
/// ifupdown, whose stanzas name interfaces.
pub fn networkd_link(nic: &SandboxNic) -> String {
    format!(
        "# Written by CertiStack into a disposable sandbox overlay.\n[Match]\nMACAddress={}\n\n[Link]\nName={IFUPDOWN_NAME}\n",
        nic.mac
    )
}

/// `/etc/NetworkManager/system-connections/certistack-sandbox.nmconnection` (mode 0600).
pub fn networkmanager_keyfile(nic: &SandboxNic, uuid: &str) -> String {
    let (family, other) = if nic.is_ipv4() {
        ("ipv4", "ipv6")
    } else {
        ("ipv6", "ipv4")
    };
    format!(
        "# Written by CertiStack into a disposable sandbox overlay.\n[connection]\nid={PROFILE_NAME}\nuuid={uuid}\ntype=ethernet\nautoconnect=true\nautoconnect-priority=999\n\n[ethernet]\nmac-address={}\n\n[{family}]\nmethod=manual\naddress1={}\nnever-default=true\nignore-auto-dns=true\nignore-auto-routes=true\n\n[{other}]\nmethod=disabled\n",
        nic.mac.to_uppercase(),
        nic.address
    )
}

/// `/etc/network/interfaces.d/certistack-sandbox`: the NIC named by [`networkd_link`].
pub fn ifupdown_stanza(nic: &SandboxNic) -> String {
    let family = if nic.is_ipv4() { "inet" } else { "inet6" };
    let extra = if nic.is_ipv4() {
        ""
    } else {
        "\n    autoconf 0\n    accept_ra 0"
    };
    // `auto` only: Debian's networking.service runs `ifup -a` after ifupdown-pre.service has
    // waited for udev to settle, and so after the link file's rename. `allow-hotplug` beside it
    // is accepted by Debian's ifupdown, but busybox's (which has no allow-hotplug) refuses it after
    // an `auto` line as a misplaced option, and brings up nothing.
    format!(
        "# Written by CertiStack into a disposable sandbox overlay.\n# The NIC with MAC {} is named {IFUPDOWN_NAME} by /etc/systemd/network/10-{PROFILE_NAME}.link.\nauto {IFUPDOWN_NAME}\niface {IFUPDOWN_NAME} {family} static\n    address {}{extra}\n",
        nic.mac, nic.address
    )
}

/// `/etc/netplan/99-certistack-sandbox.yaml` (mode 0600).
pub fn netplan_yaml(nic: &SandboxNic) -> String {
    format!(
        "# Written by CertiStack into a disposable sandbox overlay.\nnetwork:\n  version: 2\n  ethernets:\n    {PROFILE_NAME}:\n      match:\n        macaddress: \"{}\"\n      dhcp4: false\n      dhcp6: false\n      accept-ra: false\n      link-local: []\n      addresses:\n        - \"{}\"\n",
        nic.mac, nic.address
    )
}

/// `/etc/sysconfig/network-scripts/ifcfg-certistack-sandbox`.
pub fn ifcfg_profile(nic: &SandboxNic) -> String {
    let address = if nic.is_ipv4() {
        format!(
            "IPADDR={}\nPREFIX={}\nIPV6INIT=no\n",
            nic.address.address, nic.address.prefix_len
        )
    } else {
        format!("IPV6INIT=yes\nIPV6_AUTOCONF=no\nIPV6ADDR={}\n", nic.address)
    };
    format!(
        "# Written by CertiStack into a disposable sandbox overlay.\nNAME={PROFILE_NAME}\nTYPE=Ethernet\nHWADDR={}\nBOOTPROTO=none\nONBOOT=yes\n{address}DEFROUTE=no\nPEERDNS=no\n",
        nic.mac.to_uppercase()
    )
}

/// The value of `key=` lines (case-insensitive key), every occurrence.
fn values<'a>(text: &'a str, key: &str) -> Vec<&'a str> {
    text.lines()
        .filter_map(|line| {
            let (k, v) = line.trim().split_once('=')?;
            k.trim()
                .eq_ignore_ascii_case(key)
                .then(|| v.trim().trim_matches('"'))
        })
        .collect()
}

fn same_mac(a: &str, b: &str) -> bool {
    a.trim().eq_ignore_ascii_case(b.trim())
}

/// Whether a profile bound by MAC (`macs`, as its lines name them) would configure the
/// sandbox NIC: bound to nothing, or to the sandbox MAC. A profile bound to other MACs belongs
/// to another NIC and is kept.
fn binds_sandbox_nic(macs: &[&str], nic: &SandboxNic) -> bool {
    macs.is_empty() || macs.iter().any(|m| same_mac(m, &nic.mac))
}

/// Whether a systemd-networkd `.network` file would configure the sandbox NIC.
pub fn networkd_fights(text: &str, nic: &SandboxNic) -> bool {
    let macs: Vec<&str> = values(text, "MACAddress")
        .into_iter()
        .flat_map(str::split_whitespace)
        .collect();
    let loopback =
        values(text, "Name").iter().all(|n| *n == "lo") && !values(text, "Name").is_empty();
    !loopback && binds_sandbox_nic(&macs, nic)
}

/// Whether a netplan file declares ethernets that would configure the sandbox NIC: any
/// `ethernets` entry while none of its `macaddress:` lines names another NIC.
pub fn netplan_fights(text: &str, nic: &SandboxNic) -> bool {
    if !text
        .lines()
        .any(|l| l.trim_start().starts_with("ethernets:"))
    {
        return false;
    }
    let macs: Vec<&str> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("macaddress:"))
        .map(|m| m.trim().trim_matches(|c| c == '"' || c == '\''))
        .collect();
    binds_sandbox_nic(&macs, nic)
}

/// Whether a NetworkManager keyfile is an ethernet profile that would take the sandbox NIC.
pub fn networkmanager_fights(text: &str, nic: &SandboxNic) -> bool {
    let ethernet = values(text, "type")
        .iter()
        .any(|t| *t == "ethernet" || *t == "802-3-ethernet");
    ethernet && binds_sandbox_nic(&values(text, "mac-address"), nic)
}

/// Whether an `ifcfg-*` file would configure the sandbox NIC.
pub fn ifcfg_fights(text: &str, nic: &SandboxNic) -> bool {
    let loopback = values(text, "DEVICE").contains(&"lo");
    !loopback && binds_sandbox_nic(&values(text, "HWADDR"), nic)
}

/// The lines of a guest file, each with its own `\n` (the last may have none) and every
/// other byte as the file has it: edits insert or prefix whole lines and copy the rest, so a
/// file in another encoding, with `\r\n` line ends or without a final newline keeps every
/// byte outside the changed lines.
fn raw_lines(bytes: &[u8]) -> impl Iterator<Item = (&[u8], String)> {
    bytes.split_inclusive(|b| *b == b'\n').map(|line| {
        let content = line.strip_suffix(b"\n").unwrap_or(line);
        (line, String::from_utf8_lossy(content).into_owned())
    })
}

/// Ends `out` with a newline before a line is appended after the file's own last line.
fn end_line(out: &mut Vec<u8>) {
    if !out.is_empty() && !out.ends_with(b"\n") {
        out.push(b'\n');
    }
}

/// A NetworkManager keyfile with `autoconnect=false` first in its `[connection]` section (an
/// `autoconnect` line of its own is commented out); every other byte is kept as written.
pub fn networkmanager_disable(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() + 64);
    let mut in_connection = false;
    let mut found = false;
    for (line, text) in raw_lines(bytes) {
        let trimmed = text.trim();
        if trimmed.starts_with('[') {
            in_connection = trimmed == "[connection]";
            out.extend_from_slice(line);
            if in_connection && !found {
                end_line(&mut out);
                out.extend_from_slice(b"autoconnect=false\n");
                found = true;
            }
            continue;
        }
        if in_connection
            && trimmed
                .split_once('=')
                .is_some_and(|(k, _)| k.trim() == "autoconnect")
        {
            out.extend_from_slice(COMMENT_PREFIX.as_bytes());
        }
        out.extend_from_slice(line);
    }
    if !found {
        end_line(&mut out);
        out.extend_from_slice(b"[connection]\nautoconnect=false\n");
    }
    out
}

/// An `ifcfg-*` file that no longer starts at boot (`ONBOOT=no`); every other byte is kept.
pub fn ifcfg_disable(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() + 64);
    for (line, text) in raw_lines(bytes) {
        if text
            .trim()
            .split_once('=')
            .is_some_and(|(k, _)| k.trim().eq_ignore_ascii_case("ONBOOT"))
        {
            out.extend_from_slice(COMMENT_PREFIX.as_bytes());
        }
        out.extend_from_slice(line);
    }
    end_line(&mut out);
    out.extend_from_slice(b"ONBOOT=no\n");
    out
}

/// `/etc/network/interfaces` (or a file it sources) with every stanza of an interface other
/// than `lo` and the sandbox NIC's own commented out; `None` when nothing changes. ifupdown
/// names interfaces, not MACs, and the guest may give the sandbox NIC the name its production
/// NIC had, so every other interface's stanza could configure it.
pub fn ifupdown_disable(bytes: &[u8]) -> Option<Vec<u8>> {
    let keep = |name: &str| name == "lo" || name == IFUPDOWN_NAME;
    let mut out = Vec::with_capacity(bytes.len() + 256);
    let mut changed = false;
    let mut in_disabled_stanza = false;
    for (line, text) in raw_lines(bytes) {
        let words: Vec<&str> = text.split_whitespace().collect();
        let first = words.first().copied().unwrap_or("");
        let starts_stanza = matches!(
            first,
            "iface" | "mapping" | "auto" | "source" | "source-directory" | "rename"
        ) || first.starts_with("allow-");
        if starts_stanza {
            in_disabled_stanza = false;
        }
        let disable = match first {
            "iface" | "mapping" => {
                let name = words.get(1).copied().unwrap_or("");
                if keep(name) {
                    false
                } else {
                    in_disabled_stanza = true;
                    true
                }
            }
            "auto" => words.iter().skip(1).any(|n| !keep(n)),
            f if f.starts_with("allow-") => words.iter().skip(1).any(|n| !keep(n)),
            _ => in_disabled_stanza && !text.trim().is_empty() && !starts_stanza,
        };
        if disable {
            changed = true;
            out.extend_from_slice(COMMENT_PREFIX.as_bytes());
            out.extend_from_slice(line);
            // `auto lo eth0`: lo keeps coming up.
            if matches!(first, "auto") || first.starts_with("allow-") {
                let kept: Vec<&str> = words.iter().skip(1).copied().filter(|n| keep(n)).collect();
                if !kept.is_empty() {
                    end_line(&mut out);
                    out.extend_from_slice(format!("{first} {}\n", kept.join(" ")).as_bytes());
                }
            }
        } else {
            out.extend_from_slice(line);
        }
    }
    changed.then_some(out)
}

/// Whether `/etc/network/interfaces` reads the sandbox stanza's directory.
fn ifupdown_sources_directory(text: &str) -> bool {
    text.lines().any(|line| {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["source", path, ..] => {
                path.starts_with("/etc/network/interfaces.d/") || path.starts_with("interfaces.d/")
            }
            ["source-directory", path, ..] => path.trim_end_matches('/').ends_with("interfaces.d"),
            _ => false,
        }
    })
}

/// The default zone a `firewalld.conf` names; firewalld's own default is `public`.
pub fn firewalld_default_zone(conf: &str) -> Result<String, String> {
    let zone = values(conf, "DefaultZone")
        .last()
        .map(|z| z.to_string())
        .unwrap_or_else(|| "public".into());
    let valid = !zone.is_empty()
        && zone.len() <= 17
        && zone
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if valid {
        Ok(zone)
    } else {
        Err(format!(
            "the guest's firewalld.conf names the default zone {:?}, which is not a firewalld zone name",
            zone.chars().take(64).collect::<String>()
        ))
    }
}

/// The ports a probe of `kind` reaches on `port`: (port, protocol).
fn probe_ports(kind: ProbeKind, port: u16) -> Vec<(u16, &'static str)> {
    match kind {
        ProbeKind::Dns => vec![(port, "udp"), (port, "tcp")],
        ProbeKind::Tcp | ProbeKind::Http | ProbeKind::Https | ProbeKind::Ldap => {
            vec![(port, "tcp")]
        }
    }
}

/// A firewalld zone file with one rich rule per probe port allowing the probe source, added
/// before `</zone>`; every existing element is kept as written. `None` when every rule is there
/// already.
pub fn firewalld_allow(
    zone_xml: &[u8],
    probe_source: IpAddr,
    ports: &BTreeSet<(u16, &'static str)>,
) -> Result<Option<Vec<u8>>, String> {
    let close = b"</zone>";
    let end = zone_xml
        .windows(close.len())
        .rposition(|w| w == close)
        .ok_or_else(|| "the zone file has no </zone> element".to_owned())?;
    let family = if probe_source.is_ipv4() {
        "ipv4"
    } else {
        "ipv6"
    };
    let mut rules = String::new();
    for (port, protocol) in ports {
        let rule = format!(
            "  <rule family=\"{family}\">\n    <source address=\"{probe_source}\"/>\n    <port port=\"{port}\" protocol=\"{protocol}\"/>\n    <accept/>\n  </rule>\n"
        );
        if !zone_xml.windows(rule.len()).any(|w| w == rule.as_bytes()) {
            rules.push_str(&rule);
        }
    }
    if rules.is_empty() {
        return Ok(None);
    }
    let (head, tail) = zone_xml.split_at(end);
    let mut out = head.to_vec();
    end_line(&mut out);
    out.extend_from_slice(rules.as_bytes());
    out.extend_from_slice(tail);
    Ok(Some(out))
}

/// A guestfish string argument: double-quoted, every byte that is not plain printable ASCII
/// (and `"`, `\`) escaped, so guest-derived text never ends the argument or the command.
fn quote(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() + 2);
    out.push('"');
    for &byte in bytes {
        match byte {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            b'\n' => out.push_str("\\n"),
            b'\t' => out.push_str("\\t"),
            0x20..=0x7e => out.push(char::from(byte)),
            _ => {
                let _ = write!(out, "\\x{byte:02x}");
            }
        }
    }
    out.push('"');
    out
}

/// Whether a guest path is one recovery will name to guestfish: absolute, made of characters
/// configuration files use. A file with another name is reported, not touched.
fn plain_path(path: &str) -> bool {
    path.starts_with('/')
        && path.len() <= 256
        && !path.contains("/../")
        && path
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-@+:".contains(c))
}

/// Whether a mountable from the guest's inspection (its fstab, so guest-controlled) is one
/// recovery will mount: a short `/dev/` path of plain characters, or a btrfs subvolume of one
/// (`btrfsvol:/dev/sda2/@root`, as libguestfs names a root or a mount on a subvolume) whose
/// name is plain too and climbs nowhere.
fn plain_mountable(mountable: &str) -> bool {
    let plain = |text: &str| {
        text.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._:+-@".contains(c))
    };
    if mountable.len() > 128 {
        return false;
    }
    match mountable.strip_prefix("btrfsvol:") {
        Some(volume) => {
            // `/dev/<device>/<subvolume path>`: every part after `/dev/` named, none `.` or `..`.
            volume.starts_with("/dev/")
                && plain(volume)
                && volume
                    .split('/')
                    .skip(2)
                    .all(|part| !part.is_empty() && part != "." && part != "..")
                && volume.split('/').count() > 3
        }
        None => mountable.starts_with("/dev/") && !mountable.contains('@') && plain(mountable),
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

/// One guestfish process on the overlay, driven batch by batch over its stdin.
struct Session {
    child: tokio::process::Child,
    /// `None` once `finish` closed it.
    stdin: Option<tokio::process::ChildStdin>,
    stdout: tokio::io::BufReader<tokio::process::ChildStdout>,
    stderr: tokio::task::JoinHandle<Vec<u8>>,
    marker: String,
    batches: u64,
    read: usize,
}

impl Session {
    /// Starts `call` (guestfish on the overlay, or `systemd-run` starting it in a transient
    /// unit with `--pipe`, which hands these same pipes to guestfish).
    fn start(call: ToolCall) -> Result<Self, RecoveryError> {
        let mut command = tokio::process::Command::new(&call.program);
        command
            .args(&call.args)
            .env_clear()
            .env("PATH", TOOL_PATH)
            .envs(call.env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut child = command.spawn().map_err(|e| {
            RecoveryError::Tool(format!(
                "cannot start {} (tools.guestfish, process.systemd_run; install libguestfs-tools): {e}",
                call.program.display()
            ))
        })?;
        let missing = || RecoveryError::Tool("guestfish started without its pipes".into());
        let stdin = child.stdin.take().ok_or_else(missing)?;
        let stdout = child.stdout.take().ok_or_else(missing)?;
        let mut stderr_pipe = child.stderr.take().ok_or_else(missing)?;
        let stderr = tokio::spawn(async move {
            let mut kept = Vec::new();
            let mut chunk = [0u8; 4096];
            loop {
                match stderr_pipe.read(&mut chunk).await {
                    Ok(0) | Err(_) => return kept,
                    Ok(n) => {
                        let room = STDERR_KEPT.saturating_sub(kept.len());
                        kept.extend_from_slice(chunk.get(..n.min(room)).unwrap_or_default());
                    }
                }
            }
        });
        Ok(Self {
            child,
            stdin: Some(stdin),
            stdout: tokio::io::BufReader::new(stdout),
            stderr,
            marker: format!("certistack-{}", uuid::Uuid::new_v4().simple()),
            batches: 0,
            read: 0,
        })
    }

    fn identity(&self) -> Option<ToolIdentity> {
        let pid = i32::try_from(self.child.id()?).ok()?;
        Some(ToolIdentity::of(pid).unwrap_or(ToolIdentity {
            pid,
            start_time: 0,
            process_group: pid,
        }))
    }

    /// Sends `commands`, one answer (its output, without the trailing newline) per command.
    async fn ask(&mut self, commands: &[String]) -> Result<Vec<Vec<u8>>, RecoveryError> {
        if let Some(command) = commands
            .iter()
            .find(|c| c.len() > MAX_COMMAND_BYTES || c.contains(['\n', '\r']))
        {
            let shown: String = command.chars().take(120).collect();
            return Err(RecoveryError::Tool(format!(
                "refused to send guestfish a command of {} bytes or with a line break (`{shown}`…): guestfish would split it",
                command.len()
            )));
        }
        let mut script = String::new();
        let first = self.batches;
        for (index, command) in commands.iter().enumerate() {
            let _ = writeln!(
                script,
                "{command}\necho {}-{}",
                self.marker,
                first + index as u64
            );
        }
        self.batches += commands.len() as u64;
        let written = match self.stdin.as_mut() {
            Some(stdin) => match stdin.write_all(script.as_bytes()).await {
                Ok(()) => stdin.flush().await,
                Err(error) => Err(error),
            },
            None => Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe)),
        };
        if let Err(error) = written {
            return Err(self
                .failure(&format!("guestfish stopped reading: {error}"))
                .await);
        }
        let mut answers = Vec::with_capacity(commands.len());
        for index in 0..commands.len() {
            let end = format!("{}-{}\n", self.marker, first + index as u64);
            let mut answer = Vec::new();
            loop {
                let mut line = Vec::new();
                // One line may not exceed what the session may still read.
                let room = (MAX_SESSION_BYTES.saturating_sub(self.read) as u64).saturating_add(1);
                let n = match (&mut self.stdout)
                    .take(room)
                    .read_until(b'\n', &mut line)
                    .await
                {
                    Ok(n) => n,
                    Err(error) => {
                        return Err(self
                            .failure(&format!("cannot read guestfish: {error}"))
                            .await);
                    }
                };
                if n == 0 {
                    let command = commands.get(index).map(String::as_str).unwrap_or("");
                    let shown: String = command.chars().take(120).collect();
                    return Err(self
                        .failure(&format!("guestfish exited during `{shown}`"))
                        .await);
                }
                self.read += n;
                if self.read > MAX_SESSION_BYTES {
                    return Err(RecoveryError::Tool(format!(
                        "guestfish printed more than {MAX_SESSION_BYTES} bytes; the session was abandoned"
                    )));
                }
                if line == end.as_bytes() {
                    break;
                }
                answer.extend_from_slice(&line);
            }
            if answer.last() == Some(&b'\n') {
                answer.pop();
            }
            answers.push(answer);
        }
        Ok(answers)
    }

    async fn ask_text(&mut self, commands: &[String]) -> Result<Vec<String>, RecoveryError> {
        Ok(self
            .ask(commands)
            .await?
            .into_iter()
            .map(|a| String::from_utf8_lossy(&a).into_owned())
            .collect())
    }

    async fn stderr_text(&mut self) -> String {
        let handle = std::mem::replace(&mut self.stderr, tokio::spawn(async { Vec::new() }));
        match tokio::time::timeout(Duration::from_secs(2), handle).await {
            Ok(Ok(bytes)) => String::from_utf8_lossy(&bytes).trim().to_owned(),
            _ => String::new(),
        }
    }

    async fn failure(&mut self, what: &str) -> RecoveryError {
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
        let stderr = self.stderr_text().await;
        RecoveryError::Tool(format!("{what}: {stderr}"))
    }

    /// Ends the session: guestfish shuts the appliance down, which flushes the overlay.
    async fn finish(mut self) -> Result<Option<i32>, RecoveryError> {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.write_all(b"umount-all\nexit\n").await;
        }
        let status = self
            .child
            .wait()
            .await
            .map_err(|e| RecoveryError::Tool(format!("cannot wait for guestfish: {e}")))?;
        if !status.success() {
            let stderr = self.stderr_text().await;
            return Err(RecoveryError::Tool(format!(
                "guestfish failed closing the overlay (exit {:?}): {stderr}",
                status.code()
            )));
        }
        Ok(status.code())
    }
}

impl Drop for Session {
    /// A session dropped before `finish` (a failure, the deadline, the daemon going away) takes
    /// guestfish's whole process group with it: the appliance's QEMU runs in that group.
    fn drop(&mut self) {
        if let Some(pid) = self
            .child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
        }
    }
}

fn truthy(answer: Option<&String>) -> bool {
    answer.is_some_and(|a| a.trim() == "true")
}

/// One guest configuration file read during the survey: its bytes exactly, and as text (any
/// invalid UTF-8 replaced) for the decisions.
struct GuestFile {
    path: String,
    bytes: Vec<u8>,
    text: String,
}

/// What the recovery will write: (path, content, mode).
struct Write {
    path: String,
    content: Vec<u8>,
    mode: Option<&'static str>,
    action: &'static str,
}

struct Plan {
    writes: Vec<Write>,
    renames: Vec<(String, String)>,
    firewalld_zone: String,
    notes: Vec<String>,
}

/// Recovery inside one guestfish session: inspect, survey, write, read back the hashes.
async fn recover(
    session: &mut Session,
    nic: &SandboxNic,
    profile_uuid: &str,
    probe_source: IpAddr,
    ports: &BTreeSet<(u16, &'static str)>,
) -> Result<Evidence, RecoveryError> {
    let started = session
        .ask_text(&["run".into(), "inspect-os".into()])
        .await?;
    let roots: Vec<String> = started
        .get(1)
        .map(|r| {
            r.lines()
                .map(str::to_owned)
                .filter(|l| !l.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let root = match roots.as_slice() {
        [] => {
            return Err(RecoveryError::Unrecognized(
                "libguestfs inspection found no operating system on the disk".into(),
            ));
        }
        [root] if plain_mountable(root) => root.clone(),
        [root] => {
            let shown: String = root.chars().take(120).collect();
            return Err(RecoveryError::Unrecognized(format!(
                "libguestfs inspection named the operating system's root {shown:?}, not a plain device name; recovery does not touch it"
            )));
        }
        more => {
            return Err(RecoveryError::Unrecognized(format!(
                "libguestfs inspection found {} operating systems ({}); recovery cannot tell which one boots",
                more.len(),
                more.join(", ")
            )));
        }
    };
    let quoted_root = quote(root.as_bytes());
    let facts = session
        .ask_text(&[
            format!("inspect-get-type {quoted_root}"),
            format!("inspect-get-distro {quoted_root}"),
            format!("inspect-get-major-version {quoted_root}"),
            format!("inspect-get-minor-version {quoted_root}"),
            format!("inspect-get-product-name {quoted_root}"),
            format!("inspect-get-mountpoints {quoted_root}"),
        ])
        .await?;
    let fact = |i: usize| {
        facts
            .get(i)
            .map(|f| f.trim().to_owned())
            .unwrap_or_default()
    };
    let mut evidence = Evidence {
        os_type: fact(0),
        distro: fact(1),
        version: format!("{}.{}", fact(2), fact(3)),
        product_name: fact(4),
        ..Evidence::default()
    };
    let inspected = format!(
        "libguestfs inspection: type {}, distro {}, version {}, product {:?}",
        evidence.os_type, evidence.distro, evidence.version, evidence.product_name
    );
    if evidence.os_type == "windows" {
        return Err(RecoveryError::Windows(inspected));
    }
    if evidence.os_type != "linux" {
        return Err(RecoveryError::Unrecognized(inspected));
    }
    let mut mounts: Vec<(String, String)> = fact(5)
        .lines()
        .filter_map(|l| l.split_once(": "))
        .map(|(mp, dev)| (mp.trim().to_owned(), dev.trim().to_owned()))
        .filter(|(mp, dev)| plain_path(mp) && plain_mountable(dev))
        .collect();
    mounts.sort_by_key(|(mp, _)| mp.len());
    // Read-only until there is something to write: a guest recovery refuses leaves the
    // overlay as it found it (a read-write mount alone updates the superblock).
    // nodev: a device node in the guest (say /dev/zero named as a netplan file) cannot be
    // opened, so a read cannot stream without end into the host's temporary files.
    let mount_commands = |options: &str| -> Vec<String> {
        mounts
            .iter()
            .map(|(mp, dev)| {
                format!(
                    "-mount-options {} {} {}",
                    quote(options.as_bytes()),
                    quote(dev.as_bytes()),
                    quote(mp.as_bytes())
                )
            })
            .collect()
    };
    session
        .ask(&mount_commands("ro,nodev,nosuid,noexec"))
        .await?;

    // The survey: what each stack leaves on disk.
    let survey = session
        .ask_text(
            &[
                "glob-expand /etc/netplan/*.yaml".into(),
                "is-dir /etc/NetworkManager".into(),
                "exists /usr/sbin/NetworkManager".into(),
                "glob-expand /etc/NetworkManager/system-connections/*".into(),
                "glob-expand /etc/sysconfig/network-scripts/ifcfg-*".into(),
                "is-file /etc/network/interfaces".into(),
                "exists /sbin/ifup".into(),
                "exists /usr/sbin/ifup".into(),
                "glob-expand /etc/network/interfaces.d/*".into(),
                "glob-expand /etc/systemd/network/*.network".into(),
                "is-symlink /etc/systemd/system/multi-user.target.wants/systemd-networkd.service"
                    .into(),
                "is-file /etc/firewalld/firewalld.conf".into(),
                "is-dir /usr/lib/firewalld/zones".into(),
                "is-file /etc/nftables.conf".into(),
                "is-file /etc/sysconfig/iptables".into(),
            ]
            .into_iter()
            .chain(CONFIG_DIRECTORIES.iter().map(|dir| {
                format!(
                    "glob-expand {}",
                    quote(format!("{dir}/*[[:cntrl:]]*").as_bytes())
                )
            }))
            .collect::<Vec<String>>(),
        )
        .await?;
    let list = |i: usize| -> Vec<String> {
        survey
            .get(i)
            .map(|a| {
                a.lines()
                    .filter(|l| !l.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let netplan_files = list(0);
    let nm_present = truthy(survey.get(1)) && truthy(survey.get(2));
    let nm_files = list(3);
    let ifcfg_files: Vec<String> = list(4)
        .into_iter()
        .filter(|p| !p.ends_with("/ifcfg-lo") && !p.contains(PROFILE_NAME))
        .collect();
    let ifupdown = truthy(survey.get(5)) && (truthy(survey.get(6)) || truthy(survey.get(7)));
    let interfaces_d = list(8);
    let networkd_files = list(9);
    let networkd_enabled = truthy(survey.get(10));
    let firewalld = truthy(survey.get(11)) || truthy(survey.get(12));
    if truthy(survey.get(13)) || truthy(survey.get(14)) {
        evidence.notes.push(
            "the guest has an nftables or iptables ruleset (/etc/nftables.conf, /etc/sysconfig/iptables); it is reported, not changed: it may drop the probes".into(),
        );
    }

    let stack = if !netplan_files.is_empty() {
        NetworkStack::Netplan
    } else if nm_present {
        NetworkStack::NetworkManager
    } else if !ifcfg_files.is_empty() {
        NetworkStack::Ifcfg
    } else if ifupdown {
        NetworkStack::Ifupdown
    } else if !networkd_files.is_empty() || networkd_enabled {
        NetworkStack::Networkd
    } else {
        return Err(RecoveryError::Unrecognized(format!(
            "{inspected}; no network stack found (netplan, NetworkManager, ifcfg, ifupdown, systemd-networkd)"
        )));
    };
    evidence.network_stack = stack.name().into();
    // guestfish lists one path a line: a name with a line break in it would read as two
    // paths, the first naming another file of the directory. Such a name is never guessed at.
    for (index, dir) in CONFIG_DIRECTORIES.iter().enumerate() {
        let hostile = survey
            .get(SURVEY_LISTINGS + index)
            .map(|a| a.trim_end_matches('\n'))
            .unwrap_or("");
        if !hostile.is_empty() && stack_reads(stack, dir) {
            return Err(RecoveryError::Refused(format!(
                "{inspected}; {} configuration directory {dir} holds a file with a control character (such as a line break) in its name ({:?}): recovery lists that directory one name a line and will not guess which file is which",
                stack.name(),
                hostile.chars().take(200).collect::<String>()
            )));
        }
    }

    // The files that could fight the profile, read once.
    let mut candidates: Vec<String> = match stack {
        NetworkStack::Netplan => netplan_files,
        NetworkStack::NetworkManager => nm_files.into_iter().chain(ifcfg_files).collect(),
        NetworkStack::Ifcfg => ifcfg_files,
        NetworkStack::Ifupdown => std::iter::once("/etc/network/interfaces".to_owned())
            .chain(interfaces_d)
            .collect(),
        NetworkStack::Networkd => networkd_files,
    };
    candidates.retain(|p| !p.contains(PROFILE_NAME) && !p.ends_with(DISABLED_SUFFIX));
    if candidates.len() > MAX_PROFILES {
        evidence.notes.push(format!(
            "{} configuration files found; only the first {MAX_PROFILES} were considered",
            candidates.len()
        ));
        candidates.truncate(MAX_PROFILES);
    }
    let (plain, odd): (Vec<String>, Vec<String>) =
        candidates.into_iter().partition(|p| plain_path(p));
    for path in odd {
        evidence.notes.push(format!(
            "{:?} has a name recovery does not hand to guestfish; it was left as it is",
            path.chars().take(120).collect::<String>()
        ));
    }
    let firewalld_conf = if firewalld {
        Some("/etc/firewalld/firewalld.conf".to_owned())
    } else {
        None
    };
    let mut to_read: Vec<String> = plain;
    to_read.extend(firewalld_conf.iter().cloned());
    let files = read_files(session, &to_read, &mut evidence.notes).await?;

    let mut plan = Plan {
        writes: Vec::new(),
        renames: Vec::new(),
        firewalld_zone: String::new(),
        notes: Vec::new(),
    };
    let profiles: Vec<&GuestFile> = files
        .iter()
        .filter(|f| Some(&f.path) != firewalld_conf.as_ref())
        .collect();
    plan_stack(stack, nic, profile_uuid, &profiles, &mut plan);

    if firewalld {
        let conf = files
            .iter()
            .find(|f| Some(&f.path) == firewalld_conf.as_ref())
            .map(|f| f.text.as_str())
            .unwrap_or("");
        let zone = firewalld_default_zone(conf).map_err(RecoveryError::Tool)?;
        plan_firewalld(session, &zone, probe_source, ports, &mut plan).await?;
    }
    evidence.firewalld_zone = plan.firewalld_zone.clone();
    evidence.notes.append(&mut plan.notes);

    // The writes, then the read-back of what landed.
    let mut commands = vec!["umount-all".to_owned()];
    commands.extend(mount_commands("nodev,nosuid,noexec"));
    for (from, to) in &plan.renames {
        commands.push(format!(
            "mv {} {}",
            quote(from.as_bytes()),
            quote(to.as_bytes())
        ));
    }
    for write in &plan.writes {
        if let Some((dir, _)) = write.path.rsplit_once('/')
            && !dir.is_empty()
        {
            commands.push(format!("mkdir-p {}", quote(dir.as_bytes())));
        }
        // In chunks: one quoted line per command stays under MAX_COMMAND_BYTES.
        let mut chunks = write.content.chunks(WRITE_CHUNK_BYTES);
        commands.push(format!(
            "write {} {}",
            quote(write.path.as_bytes()),
            quote(chunks.next().unwrap_or_default())
        ));
        for chunk in chunks {
            commands.push(format!(
                "write-append {} {}",
                quote(write.path.as_bytes()),
                quote(chunk)
            ));
        }
        if let Some(mode) = write.mode {
            commands.push(format!("chmod {mode} {}", quote(write.path.as_bytes())));
        }
    }
    session.ask(&commands).await?;
    let landed: Vec<&str> = plan
        .renames
        .iter()
        .map(|(_, to)| to.as_str())
        .chain(plan.writes.iter().map(|w| w.path.as_str()))
        .collect();
    let sums = session
        .ask_text(
            &landed
                .iter()
                .map(|p| format!("checksum sha256 {}", quote(p.as_bytes())))
                .collect::<Vec<_>>(),
        )
        .await?;
    let sum = |i: usize| sums.get(i).map(|s| s.trim().to_owned()).unwrap_or_default();
    for (i, (from, to)) in plan.renames.iter().enumerate() {
        evidence.files.push(FileChange {
            path: from.clone(),
            action: "disabled",
            sha256: sum(i),
            renamed_to: to.clone(),
        });
    }
    for (i, write) in plan.writes.iter().enumerate() {
        let expected = hex::encode(Sha256::digest(&write.content));
        let got = sum(plan.renames.len() + i);
        if got != expected {
            return Err(RecoveryError::Tool(format!(
                "{} reads back with SHA-256 {got:?}, not the {expected} written",
                write.path
            )));
        }
        evidence.files.push(FileChange {
            path: write.path.clone(),
            action: write.action,
            sha256: got,
            renamed_to: String::new(),
        });
    }
    Ok(evidence)
}

/// Reads `paths` (each at most [`MAX_GUEST_FILE_BYTES`]); a larger or unreadable file is noted.
async fn read_files(
    session: &mut Session,
    paths: &[String],
    notes: &mut Vec<String>,
) -> Result<Vec<GuestFile>, RecoveryError> {
    // Regular files only (a FIFO or device node named like a profile is not read).
    let kinds = session
        .ask_text(
            &paths
                .iter()
                .map(|p| format!("-is-file {} followsymlinks:true", quote(p.as_bytes())))
                .collect::<Vec<_>>(),
        )
        .await?;
    let mut files = Vec::new();
    for (path, kind) in paths.iter().zip(&kinds) {
        if kind.trim() == "true" {
            files.push(path.clone());
        } else {
            notes.push(format!(
                "{path} is not a regular file; it was left as it is"
            ));
        }
    }
    let paths = &files;
    let sizes = session
        .ask_text(
            &paths
                .iter()
                .map(|p| format!("-filesize {}", quote(p.as_bytes())))
                .collect::<Vec<_>>(),
        )
        .await?;
    let mut readable = Vec::new();
    for (path, size) in paths.iter().zip(&sizes) {
        match size.trim().parse::<u64>() {
            Ok(size) if size <= MAX_GUEST_FILE_BYTES => readable.push((path.clone(), size)),
            Ok(size) => notes.push(format!(
                "{path} holds {size} bytes, more than {MAX_GUEST_FILE_BYTES}; it was left as it is"
            )),
            Err(_) => notes.push(format!(
                "{path} is not a readable file; it was left as it is"
            )),
        }
    }
    let contents = session
        .ask(
            &readable
                .iter()
                .map(|(p, _)| format!("-cat {}", quote(p.as_bytes())))
                .collect::<Vec<_>>(),
        )
        .await?;
    let mut files = Vec::new();
    for ((path, size), bytes) in readable.into_iter().zip(contents) {
        // guestfish's `cat` ends a file at its first NUL byte: a file that reads back shorter
        // than its size is not text recovery could rewrite without mangling it.
        if bytes.len() as u64 != size {
            notes.push(format!(
                "{path} holds a NUL byte (its {size} bytes read as {} bytes of text); recovery edits text files only, so it was left as it is",
                bytes.len()
            ));
            continue;
        }
        files.push(GuestFile {
            text: String::from_utf8_lossy(&bytes).into_owned(),
            path,
            bytes,
        });
    }
    Ok(files)
}

fn plan_stack(
    stack: NetworkStack,
    nic: &SandboxNic,
    profile_uuid: &str,
    files: &[&GuestFile],
    plan: &mut Plan,
) {
    let new = |path: String, content: String, mode: Option<&'static str>| Write {
        path,
        content: content.into_bytes(),
        mode,
        action: "written",
    };
    let changed = |path: String, content: Vec<u8>, mode: Option<&'static str>| Write {
        path,
        content,
        mode,
        action: "changed",
    };
    match stack {
        NetworkStack::Netplan => {
            for file in files.iter().filter(|f| netplan_fights(&f.text, nic)) {
                plan.renames
                    .push((file.path.clone(), format!("{}{DISABLED_SUFFIX}", file.path)));
            }
            plan.writes.push(new(
                format!("/etc/netplan/99-{PROFILE_NAME}.yaml"),
                netplan_yaml(nic),
                Some("0600"),
            ));
        }
        NetworkStack::Networkd => {
            for file in files.iter().filter(|f| networkd_fights(&f.text, nic)) {
                plan.renames
                    .push((file.path.clone(), format!("{}{DISABLED_SUFFIX}", file.path)));
            }
            plan.writes.push(new(
                format!("/etc/systemd/network/00-{PROFILE_NAME}.network"),
                networkd_profile(nic),
                Some("0644"),
            ));
        }
        NetworkStack::NetworkManager | NetworkStack::Ifcfg => {
            for file in files {
                let name = file.path.rsplit('/').next().unwrap_or("");
                if name.starts_with("ifcfg-") {
                    if ifcfg_fights(&file.text, nic) {
                        plan.writes.push(changed(
                            file.path.clone(),
                            ifcfg_disable(&file.bytes),
                            None,
                        ));
                    }
                } else if networkmanager_fights(&file.text, nic) {
                    plan.writes.push(changed(
                        file.path.clone(),
                        networkmanager_disable(&file.bytes),
                        Some("0600"),
                    ));
                }
            }
            if stack == NetworkStack::NetworkManager {
                plan.writes.push(new(
                    format!("/etc/NetworkManager/system-connections/{PROFILE_NAME}.nmconnection"),
                    networkmanager_keyfile(nic, profile_uuid),
                    Some("0600"),
                ));
            } else {
                plan.writes.push(new(
                    format!("/etc/sysconfig/network-scripts/ifcfg-{PROFILE_NAME}"),
                    ifcfg_profile(nic),
                    Some("0644"),
                ));
            }
        }
        NetworkStack::Ifupdown => {
            for file in files {
                if file.path == "/etc/network/interfaces" {
                    let mut text = ifupdown_disable(&file.bytes);
                    if !ifupdown_sources_directory(&file.text) {
                        let mut base = text.clone().unwrap_or_else(|| file.bytes.clone());
                        end_line(&mut base);
                        base.extend_from_slice(
                            format!("source /etc/network/interfaces.d/{PROFILE_NAME}\n").as_bytes(),
                        );
                        text = Some(base);
                    }
                    if let Some(text) = text {
                        plan.writes
                            .push(changed(file.path.clone(), text, Some("0644")));
                    }
                } else if let Some(text) = ifupdown_disable(&file.bytes) {
                    plan.writes
                        .push(changed(file.path.clone(), text, Some("0644")));
                }
            }
            plan.writes.push(new(
                format!("/etc/systemd/network/10-{PROFILE_NAME}.link"),
                networkd_link(nic),
                Some("0644"),
            ));
            plan.writes.push(new(
                format!("/etc/network/interfaces.d/{PROFILE_NAME}"),
                ifupdown_stanza(nic),
                Some("0644"),
            ));
        }
    }
}

async fn plan_firewalld(
    session: &mut Session,
    zone: &str,
    probe_source: IpAddr,
    ports: &BTreeSet<(u16, &'static str)>,
    plan: &mut Plan,
) -> Result<(), RecoveryError> {
    let own = format!("/etc/firewalld/zones/{zone}.xml");
    let shipped = format!("/usr/lib/firewalld/zones/{zone}.xml");
    if ports.is_empty() {
        plan.notes.push(format!(
            "firewalld's default zone is {zone}; the grant names no probe of the guest address, so no allow rule was added"
        ));
        return Ok(());
    }
    let present = session
        .ask_text(&[
            format!("is-file {}", quote(own.as_bytes())),
            format!("is-file {}", quote(shipped.as_bytes())),
        ])
        .await?;
    let source = if truthy(present.first()) {
        own.clone()
    } else if truthy(present.get(1)) {
        shipped
    } else {
        plan.notes.push(format!(
            "firewalld's default zone {zone} has no zone file ({own}); the guest's firewall was left as it is"
        ));
        return Ok(());
    };
    let mut notes = Vec::new();
    let read = read_files(session, std::slice::from_ref(&source), &mut notes).await?;
    plan.notes.append(&mut notes);
    let Some(file) = read.first() else {
        return Ok(());
    };
    match firewalld_allow(&file.bytes, probe_source, ports) {
        Ok(Some(text)) => {
            plan.writes.push(Write {
                action: if source == own { "changed" } else { "written" },
                path: own,
                content: text,
                mode: Some("0644"),
            });
            plan.firewalld_zone = zone.to_owned();
        }
        Ok(None) => plan.firewalld_zone = zone.to_owned(),
        Err(reason) => plan.notes.push(format!(
            "firewalld zone {zone} ({source}): {reason}; it was left as it is"
        )),
    }
    Ok(())
}

/// The transient unit one recovery's guestfish runs in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestNetworkUnit {
    pub role: TransientRole,
    pub name: String,
    pub description: String,
}

/// What the unit may use beyond the appliance's own memory (`LIBGUESTFS_MEMSIZE`): QEMU
/// itself and its TCG translation cache, guestfish, and the page cache of the appliance
/// supermin builds.
pub const UNIT_MEMORY_OVERHEAD_MIB: u64 = 1024;

/// The unit of run `run_id`'s recovery on VM `vmid` (`certistack-guestnet-<run>-<vmid>`);
/// recoveries of one run are serialised by its lock, so one name per VM is enough.
pub fn guest_network_unit(
    run_id: &RunId,
    vmid: Vmid,
    memory_mib: u64,
) -> Result<GuestNetworkUnit, String> {
    let role = TransientRole::GuestNetwork {
        memory_max_mib: memory_mib.saturating_add(UNIT_MEMORY_OVERHEAD_MIB),
    };
    let object = vmid.to_string();
    Ok(GuestNetworkUnit {
        role,
        name: process::transient_unit_name(role, run_id.as_str(), &object)?,
        description: process::transient_unit_description(role, run_id.as_str(), &object),
    })
}

/// How the libguestfs appliance of a session is booted and bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appliance {
    /// The whole session's deadline, the appliance's boot included.
    pub timeout: Duration,
    /// The appliance's memory (`LIBGUESTFS_MEMSIZE`).
    pub memory_mib: u64,
    pub accelerator: ApplianceAccelerator,
}

impl Appliance {
    pub fn from_config(config: &crate::config::Config) -> Self {
        Self {
            timeout: Duration::from_secs(config.limits.guest_network_timeout_secs),
            memory_mib: config.limits.guest_network_memory_mib,
            accelerator: config.guest_network.accelerator,
        }
    }

    /// guestfish `program` with the appliance's environment: the direct backend (PVE runs no
    /// libvirt: the appliance is a QEMU child of guestfish), its memory, and TCG when the
    /// configuration says KVM cannot be trusted here.
    pub fn session(&self, program: &Path, timeout: Duration) -> ToolCall {
        let call = ToolCall::new(program, timeout)
            .env("LIBGUESTFS_BACKEND", "direct")
            .env("LIBGUESTFS_MEMSIZE", self.memory_mib.to_string());
        match self.accelerator {
            ApplianceAccelerator::Auto => call,
            ApplianceAccelerator::Tcg => call.env("LIBGUESTFS_BACKEND_SETTINGS", "force_tcg"),
        }
    }
}

/// `Ok` when `program` is an executable file; otherwise what to install or configure.
pub fn guestfish_installed(program: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::metadata(program) {
        Ok(meta) if meta.is_file() && meta.permissions().mode() & 0o111 != 0 => Ok(()),
        Ok(_) => Err(format!(
            "{} (tools.guestfish) is not an executable file; install libguestfs-tools or set tools.guestfish, or plan network_recovery.mode preserve; nothing was written",
            program.display()
        )),
        Err(e) => Err(format!(
            "{} (tools.guestfish): {e}; install libguestfs-tools (and a kernel in /boot for its appliance) or set tools.guestfish, or plan network_recovery.mode preserve; nothing was written",
            program.display()
        )),
    }
}

/// The call of one recovery's guestfish session on `overlay`: guestfish itself, or with `unit`
/// `systemd-run` starting it in that unit, outside the daemon's sandbox (which forbids QEMU's
/// TCG and hides /lib/modules) and bounded by the unit even if the daemon dies; `--pipe`
/// hands the session's pipes to guestfish.
pub fn guestfish_call(
    program: &Path,
    overlay: &Path,
    appliance: &Appliance,
    unit: Option<&GuestNetworkUnit>,
    systemd_run: &Path,
    systemctl: &Path,
) -> Result<ToolCall, String> {
    let call = appliance
        .session(program, appliance.timeout)
        .arg("--format=qcow2")
        .arg("-a")
        .arg(overlay);
    match unit {
        None => Ok(call),
        Some(unit) => process::in_transient_unit(
            call,
            unit.role,
            &unit.name,
            &unit.description,
            systemd_run,
            systemctl,
            None,
        ),
    }
}

impl NodeExecutor {
    /// The unit a recovery runs in, when this daemon starts tools in transient units.
    fn guest_network_unit(
        &self,
        grant: &certistack_core::grant::Grant,
        vmid: Vmid,
        memory_mib: u64,
    ) -> Result<Option<GuestNetworkUnit>, ExecError> {
        if !self.config.process.use_transient_units() {
            return Ok(None);
        }
        guest_network_unit(&grant.run_id, vmid, memory_mib)
            .map(Some)
            .map_err(ExecError::Failed)
    }

    /// Stops the recovery unit of `vmid` if one still runs (its stop failed when its step
    /// ended): the overlay it writes is not deleted, nor its backing device unmapped, under it.
    /// Without transient units there is none; a unit already gone costs one `systemctl show`.
    pub(super) async fn release_recovery_unit(
        &self,
        grant: &certistack_core::grant::Grant,
        vmid: Vmid,
    ) -> Result<(), ExecError> {
        let memory_mib = self.config.limits.guest_network_memory_mib;
        let Some(unit) = self.guest_network_unit(grant, vmid, memory_mib)? else {
            return Ok(());
        };
        process::release_transient_unit(
            &self.config.process.systemctl,
            &unit.name,
            &unit.description,
            self.tool_timeout(),
        )
        .await
        .map(|_| ())
        .map_err(|reason| {
            ExecError::Unavailable(pb::ErrorReason::RecoveryUnitRunning, format!(
                "the guest network recovery unit {} of VM {vmid} still runs and could not be stopped ({reason}); its overlay is kept until the unit ends (at most limits.guest_network_timeout_secs + 30 s after it started): retry then",
                unit.name
            ))
        })
    }

    pub(super) async fn recover_guest_network(
        &self,
        run: &RunHandle,
        vmid: Vmid,
        archive: ArchiveName,
        mode: NetworkRecoveryMode,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.lock_open(run).await?;
        let overlay = Resource::Overlay {
            vmid,
            archive: archive.clone(),
        }
        .key();
        let vm = Resource::Vm(vmid).key();
        let (has_overlay, started) = {
            let records = guard.records();
            let states = super::resources::states(&records);
            let has_overlay = states
                .get(&overlay)
                .is_some_and(|s| s.is_open() && s.standing() == super::resources::Standing::Done);
            let start = super::resources::Op::VmStart.as_str();
            let started = records
                .iter()
                .any(|r| r.entry.resource == vm && r.entry.op == start);
            (has_overlay, started)
        };
        if !has_overlay {
            return Err(ExecError::FailedPrecondition(format!(
                "this run has no overlay of {archive} for VM {vmid}; call CreateOverlay first (recovery writes only into an overlay this run created)"
            )));
        }
        if started {
            return Err(ExecError::FailedPrecondition(format!(
                "VM {vmid} has been started: the guest may have written to its overlay, and recovery happens only before the first start (destroy the VM, delete the overlay and create both again)"
            )));
        }
        let path = self.overlay_path(grant, vmid, &archive);
        let mac = sandbox_mac(&grant.run_id, vmid, 0);
        if mode == NetworkRecoveryMode::Preserve {
            let detail = json!({ "mode": mode.name(), "path": path.display().to_string() });
            guard
                .append(self.now_ms(), OP, &overlay, Phase::Intent, detail.clone())
                .await?;
            guard
                .append(self.now_ms(), OP, &overlay, Phase::Done, detail)
                .await?;
            return Ok(Outcome::RecoverGuestNetwork(pb::RecoverGuestNetworkReply {
                evidence: Some(pb::GuestNetworkEvidence {
                    mac_address: mac,
                    notes: vec!["mode preserve: the guest's network configuration was left as the backup has it".into()],
                    ..Default::default()
                }),
                tool: None,
                journal_head: guard.head_hex(),
            }));
        }
        let Some(address) = grant.guest_address else {
            return Err(ExecError::FailedPrecondition(
                "the grant names no guest_address for the sandbox NIC".into(),
            ));
        };
        let nic = SandboxNic { mac, address };
        let ports: BTreeSet<(u16, &'static str)> = grant
            .probe_targets
            .iter()
            .filter(|t| t.address == nic.address.address)
            .flat_map(|t| probe_ports(t.kind, t.port))
            .collect();
        let probe_source = grant.probe_source.address.0;
        let uuid_bytes = Sha256::new()
            .chain_update(b"certistack-sandbox-profile\0")
            .chain_update(nic.mac.as_bytes())
            .chain_update(grant.run_id.as_str().as_bytes())
            .finalize();
        let profile_uuid = uuid::Builder::from_random_bytes(
            uuid_bytes
                .get(..16)
                .and_then(|b| <[u8; 16]>::try_from(b).ok())
                .unwrap_or_default(),
        )
        .into_uuid()
        .hyphenated()
        .to_string();
        let program = self.config.tools.guestfish.clone();
        // Checked here, before anything is journaled: started through systemd-run, a missing
        // guestfish would only show as a unit that failed and was collected.
        guestfish_installed(&program).map_err(ExecError::FailedPrecondition)?;
        let appliance = Appliance::from_config(&self.config);
        let timeout_secs = appliance.timeout.as_secs();
        let memory_mib = appliance.memory_mib;
        let unit = self.guest_network_unit(grant, vmid, memory_mib)?;
        let call = guestfish_call(
            &program,
            &path,
            &appliance,
            unit.as_ref(),
            &self.config.process.systemd_run,
            &self.config.process.systemctl,
        )
        .map_err(ExecError::Failed)?;
        let intent = json!({
            "mode": mode.name(),
            "path": path.display().to_string(),
            "mac": nic.mac,
            "address": nic.address.to_string(),
            "command": call.display(),
            "timeout_secs": timeout_secs,
            "memory_mib": memory_mib,
            "accelerator": appliance.accelerator.name(),
            "unit": unit.as_ref().map(|u| u.name.clone()),
            "unit_description": unit.as_ref().map(|u| u.description.clone()),
        });
        guard
            .append(self.now_ms(), OP, &overlay, Phase::Intent, intent)
            .await?;
        let started = Instant::now();
        let mut session = match Session::start(call) {
            Ok(session) => session,
            Err(error) => {
                return Err(self
                    .journal_step_error(
                        &mut guard,
                        OP,
                        &overlay,
                        ExecError::Failed(error.to_string()),
                    )
                    .await);
            }
        };
        let identity = session.identity();
        if let Some(identity) = identity {
            guard
                .append(
                    self.now_ms(),
                    OP,
                    &overlay,
                    Phase::Intent,
                    json!({ "tool": identity }),
                )
                .await?;
        }
        let deadline = Duration::from_secs(timeout_secs);
        let result = match tokio::time::timeout(deadline, async {
            let evidence = recover(&mut session, &nic, &profile_uuid, probe_source, &ports).await;
            (evidence, session)
        })
        .await
        {
            Ok((Ok(evidence), session)) => {
                let remaining = deadline.saturating_sub(started.elapsed());
                match tokio::time::timeout(remaining, session.finish()).await {
                    Ok(Ok(code)) => Ok((evidence, code)),
                    Ok(Err(error)) => Err(error),
                    Err(_) => Err(RecoveryError::Timeout(timeout_secs)),
                }
            }
            Ok((Err(error), session)) => {
                drop(session);
                Err(error)
            }
            Err(_) => Err(RecoveryError::Timeout(timeout_secs)),
        };
        // Whatever happened, no process of the appliance outlives the step: the session's
        // group is killed on drop, and the tree is reaped here (QEMU included).
        if let Some(identity) = identity {
            let _ = identity.reap(Duration::from_secs(10)).await;
        }
        // Killing systemd-run leaves its unit: the unit itself is stopped (its whole cgroup,
        // the appliance's QEMU included). A unit that ended by itself was collected already.
        // A unit that could not be stopped is named in the step's record; deleting the overlay
        // (DeleteOverlay, Cleanup) stops it first.
        let mut unit_left = None;
        if let Some(unit) = &unit
            && let Err(reason) = process::release_transient_unit(
                &self.config.process.systemctl,
                &unit.name,
                &unit.description,
                self.tool_timeout(),
            )
            .await
        {
            tracing::warn!(run_id = %grant.run_id, %vmid, unit = %unit.name, %reason, "the guest network recovery's unit was not stopped");
            unit_left = Some(unit.name.clone());
        }
        let elapsed = started.elapsed();
        let (evidence, code) = match result {
            Ok(done) => done,
            Err(error) => {
                let exec = match &error {
                    RecoveryError::Windows(_)
                    | RecoveryError::Unrecognized(_)
                    | RecoveryError::Refused(_) => ExecError::FailedPrecondition(error.to_string()),
                    RecoveryError::Timeout(_) => ExecError::DeadlineExceeded(error.to_string()),
                    RecoveryError::Tool(_) => ExecError::Failed(format!(
                        "guest network recovery failed: {error}; what it wrote stays in the overlay until the overlay is deleted"
                    )),
                };
                let detail = json!({
                    "error": exec.to_string(),
                    "elapsed_ms": elapsed.as_millis() as u64,
                    "outcome_unknown": matches!(error, RecoveryError::Timeout(_)) || unit_left.is_some(),
                    "unit_left": unit_left,
                });
                guard
                    .append(self.now_ms(), OP, &overlay, Phase::Failed, detail)
                    .await?;
                return Err(exec);
            }
        };
        let output = ToolOutput {
            exit_code: code,
            stdout: String::new(),
            stderr: String::new(),
            elapsed,
            truncated: false,
        };
        guard
            .append(
                self.now_ms(),
                OP,
                &overlay,
                Phase::Done,
                json!({
                    "mode": mode.name(),
                    "mac": nic.mac,
                    "address": nic.address.to_string(),
                    "elapsed_ms": elapsed.as_millis() as u64,
                    "evidence": evidence,
                    "unit_left": unit_left,
                }),
            )
            .await?;
        Ok(Outcome::RecoverGuestNetwork(pb::RecoverGuestNetworkReply {
            evidence: Some(pb::GuestNetworkEvidence {
                os_type: evidence.os_type,
                distro: evidence.distro,
                version: evidence.version,
                product_name: evidence.product_name,
                network_stack: evidence.network_stack,
                mac_address: nic.mac,
                guest_address: nic.address.to_string(),
                files: evidence
                    .files
                    .into_iter()
                    .map(|f| pb::GuestFileChange {
                        path: f.path,
                        action: f.action.into(),
                        sha256: f.sha256,
                        renamed_to: f.renamed_to,
                    })
                    .collect(),
                firewalld_zone: evidence.firewalld_zone,
                notes: evidence.notes,
            }),
            tool: Some(tool_result("guestfish", &output)),
            journal_head: guard.head_hex(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use certistack_core::validate::Validated;

    fn nic() -> SandboxNic {
        SandboxNic {
            mac: "02:aa:bb:cc:dd:ee".into(),
            address: IpInterface::validate("198.51.100.10/24").unwrap(),
        }
    }

    #[test]
    fn the_sandbox_mac_is_stable_local_and_unicast() {
        let run = RunId::validate("0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f").unwrap();
        let vmid = Vmid::parse("t", 9100).unwrap();
        let mac = sandbox_mac(&run, vmid, 0);
        assert_eq!(mac, sandbox_mac(&run, vmid, 0));
        assert_ne!(mac, sandbox_mac(&run, vmid, 1));
        assert_ne!(mac, sandbox_mac(&run, Vmid::parse("t", 9101).unwrap(), 0));
        assert!(mac.starts_with("02:"), "{mac}");
        assert_eq!(mac.len(), 17);
    }

    #[test]
    fn profiles_bind_the_mac_and_name_no_gateway_or_dns() {
        let nic = nic();
        let profiles = [
            networkd_profile(&nic),
            networkmanager_keyfile(&nic, "00000000-0000-4000-8000-000000000000"),
            ifupdown_stanza(&nic),
            netplan_yaml(&nic),
            ifcfg_profile(&nic),
        ];
        for profile in &profiles {
            assert!(
                profile.to_lowercase().contains("02:aa:bb:cc:dd:ee"),
                "{profile}"
            );
            let lower = profile.to_lowercase();
            for forbidden in ["gateway", "\ndns=", "nameserver", "dhcp=yes", "routes:"] {
                assert!(!lower.contains(forbidden), "{forbidden} in {profile}");
            }
        }
        assert!(profiles[0].contains("[Match]\nMACAddress=02:aa:bb:cc:dd:ee\n"));
        assert!(profiles[0].contains("Address=198.51.100.10/24\n"));
        assert!(profiles[1].contains("mac-address=02:AA:BB:CC:DD:EE\n"));
        assert!(profiles[1].contains("never-default=true\n"));
        assert!(profiles[1].contains("address1=198.51.100.10/24\n"));
        assert!(
            profiles[2].contains("iface cssandbox0 inet static\n    address 198.51.100.10/24\n")
        );
        assert!(
            networkd_link(&nic)
                .contains("MACAddress=02:aa:bb:cc:dd:ee\n\n[Link]\nName=cssandbox0\n")
        );
        assert!(profiles[3].contains("macaddress: \"02:aa:bb:cc:dd:ee\""));
        assert!(profiles[3].contains("- \"198.51.100.10/24\""));
        assert!(profiles[4].contains("HWADDR=02:AA:BB:CC:DD:EE\nBOOTPROTO=none\n"));
        assert!(profiles[4].contains("IPADDR=198.51.100.10\nPREFIX=24\n"));
        assert!(profiles[4].contains("DEFROUTE=no\n"));
        let v6 = SandboxNic {
            mac: nic.mac.clone(),
            address: IpInterface::validate("2001:db8::10/64").unwrap(),
        };
        assert!(
            networkmanager_keyfile(&v6, "u")
                .contains("[ipv6]\nmethod=manual\naddress1=2001:db8::10/64\n")
        );
        assert!(ifupdown_stanza(&v6).contains("inet6 static"));
        // `auto` and nothing else: busybox's ifupdown brings up nothing after an
        // `allow-hotplug` line that follows an `auto` one.
        let stanza = ifupdown_stanza(&v6);
        assert!(
            stanza.contains("\nauto cssandbox0\niface cssandbox0 inet6 static\n"),
            "{stanza}"
        );
        assert!(!stanza.contains("allow-"), "{stanza}");
    }

    #[test]
    fn a_profile_bound_to_another_mac_is_kept() {
        let nic = nic();
        assert!(networkd_fights(
            "[Match]\nName=eth0\n[Network]\nDHCP=yes\n",
            &nic
        ));
        assert!(networkd_fights(
            "[Match]\nMACAddress=02:AA:BB:CC:DD:EE\n",
            &nic
        ));
        assert!(!networkd_fights(
            "[Match]\nMACAddress=52:54:00:00:00:09\n",
            &nic
        ));
        assert!(!networkd_fights("[Match]\nName=lo\n", &nic));
        assert!(netplan_fights(
            "network:\n  ethernets:\n    eth0:\n      dhcp4: true\n",
            &nic
        ));
        assert!(!netplan_fights(
            "network:\n  ethernets:\n    storage:\n      match:\n        macaddress: \"52:54:00:00:00:09\"\n",
            &nic
        ));
        assert!(!netplan_fights("network:\n  bridges: {}\n", &nic));
        assert!(networkmanager_fights(
            "[connection]\ntype=ethernet\ninterface-name=eth0\n",
            &nic
        ));
        assert!(!networkmanager_fights(
            "[connection]\ntype=ethernet\n[ethernet]\nmac-address=52:54:00:00:00:09\n",
            &nic
        ));
        assert!(!networkmanager_fights("[connection]\ntype=wifi\n", &nic));
        assert!(ifcfg_fights("DEVICE=eth0\nONBOOT=yes\n", &nic));
        assert!(!ifcfg_fights(
            "DEVICE=eth1\nHWADDR=52:54:00:00:00:09\n",
            &nic
        ));
        assert!(!ifcfg_fights("DEVICE=lo\n", &nic));
    }

    #[test]
    fn disabling_keeps_the_rest_of_the_file() {
        let text = |bytes: Vec<u8>| String::from_utf8(bytes).unwrap();
        let nm = networkmanager_disable(
            b"[connection]\nid=prod\ntype=ethernet\nautoconnect=true\n\n[ipv4]\nmethod=manual\n",
        );
        assert_eq!(
            text(nm),
            "[connection]\nautoconnect=false\nid=prod\ntype=ethernet\n#certistack-disabled# autoconnect=true\n\n[ipv4]\nmethod=manual\n"
        );
        let nm = networkmanager_disable(b"[ipv4]\nmethod=auto\n");
        assert_eq!(
            text(nm),
            "[ipv4]\nmethod=auto\n[connection]\nautoconnect=false\n"
        );
        let ifcfg = ifcfg_disable(b"DEVICE=eth0\nONBOOT=yes\nIPADDR=10.0.0.5\n");
        assert_eq!(
            text(ifcfg),
            "DEVICE=eth0\n#certistack-disabled# ONBOOT=yes\nIPADDR=10.0.0.5\nONBOOT=no\n"
        );
        let interfaces = "source /etc/network/interfaces.d/*\n\nauto lo eth0\niface lo inet loopback\n\nallow-hotplug eth0\niface eth0 inet static\n    address 10.20.0.5/24\n    gateway 10.20.0.1\n\n";
        let disabled = ifupdown_disable(interfaces.as_bytes()).unwrap();
        assert_eq!(
            text(disabled),
            "source /etc/network/interfaces.d/*\n\n#certistack-disabled# auto lo eth0\nauto lo\niface lo inet loopback\n\n#certistack-disabled# allow-hotplug eth0\n#certistack-disabled# iface eth0 inet static\n#certistack-disabled#     address 10.20.0.5/24\n#certistack-disabled#     gateway 10.20.0.1\n\n"
        );
        assert_eq!(ifupdown_disable(b"auto lo\niface lo inet loopback\n"), None);
        assert!(ifupdown_sources_directory(interfaces));
        assert!(!ifupdown_sources_directory("auto lo\n"));
    }

    #[test]
    fn bytes_that_are_not_utf8_and_crlf_line_ends_survive_an_edit() {
        // A Latin-1 comment (0xfc, invalid UTF-8), CRLF line ends and no final newline.
        let interfaces: &[u8] =
            b"# B\xfcro\r\nauto lo\r\niface lo inet loopback\r\niface eth0 inet dhcp\r\n# \xff\xfe end";
        let disabled = ifupdown_disable(interfaces).unwrap();
        assert_eq!(
            disabled,
            b"# B\xfcro\r\nauto lo\r\niface lo inet loopback\r\n#certistack-disabled# iface eth0 inet dhcp\r\n#certistack-disabled# # \xff\xfe end"
        );
        let ifcfg = ifcfg_disable(b"NAME=\"B\xfcro\"\r\nONBOOT=yes");
        assert_eq!(
            ifcfg,
            b"NAME=\"B\xfcro\"\r\n#certistack-disabled# ONBOOT=yes\nONBOOT=no\n"
        );
        let nm = networkmanager_disable(b"[connection]\nid=B\xfcro\ntype=ethernet");
        assert_eq!(
            nm,
            b"[connection]\nautoconnect=false\nid=B\xfcro\ntype=ethernet"
        );
        let zone: &[u8] = b"<zone>\n  <short>B\xfcro</short>\n</zone>\n";
        let ports = BTreeSet::from([(80, "tcp")]);
        let source: IpAddr = "198.51.100.2".parse().unwrap();
        let out = firewalld_allow(zone, source, &ports).unwrap().unwrap();
        assert!(out.starts_with(b"<zone>\n  <short>B\xfcro</short>\n  <rule family=\"ipv4\">"));
        assert!(out.ends_with(b"  </rule>\n</zone>\n"));
    }

    #[test]
    fn firewalld_gets_one_rich_rule_per_probe_port_and_keeps_its_own() {
        assert_eq!(
            firewalld_default_zone("# x\nDefaultZone=internal\n").unwrap(),
            "internal"
        );
        assert_eq!(firewalld_default_zone("").unwrap(), "public");
        assert!(firewalld_default_zone("DefaultZone=../../etc/passwd\n").is_err());
        let zone = "<?xml version=\"1.0\" encoding=\"utf-8\"?>\n<zone>\n  <short>Public</short>\n  <service name=\"ssh\"/>\n  <rule family=\"ipv4\">\n    <source address=\"10.0.0.0/8\"/>\n    <drop/>\n  </rule>\n</zone>\n";
        let ports = BTreeSet::from([(53, "udp"), (80, "tcp")]);
        let source: IpAddr = "198.51.100.2".parse().unwrap();
        let out = firewalld_allow(zone.as_bytes(), source, &ports)
            .unwrap()
            .unwrap();
        let out = String::from_utf8(out).unwrap();
        assert!(out.starts_with(zone.trim_end_matches("</zone>\n")), "{out}");
        assert!(out.contains("<service name=\"ssh\"/>"));
        assert!(out.contains("<source address=\"10.0.0.0/8\"/>\n    <drop/>"));
        assert!(out.contains("  <rule family=\"ipv4\">\n    <source address=\"198.51.100.2\"/>\n    <port port=\"80\" protocol=\"tcp\"/>\n    <accept/>\n  </rule>\n"));
        assert!(out.contains("<port port=\"53\" protocol=\"udp\"/>"));
        assert!(out.ends_with("</zone>\n"));
        assert_eq!(
            firewalld_allow(out.as_bytes(), source, &ports).unwrap(),
            None,
            "idempotent"
        );
        assert!(firewalld_allow(b"<zone/>", source, &ports).is_err());
    }

    #[test]
    fn guest_device_names_are_plain_and_short() {
        assert!(plain_mountable("/dev/sda1"));
        assert!(plain_mountable("/dev/mapper/vg-root"));
        assert!(plain_mountable("/dev/vg0/lv_root"));
        assert!(!plain_mountable("/dev/sda1!touch${IFS}/x"));
        assert!(!plain_mountable("/dev/a b"));
        assert!(!plain_mountable(&format!("/dev/{}", "A".repeat(8180))));
        // btrfs subvolumes, as libguestfs names them.
        assert!(plain_mountable("btrfsvol:/dev/sda2/root"));
        assert!(plain_mountable("btrfsvol:/dev/sda/@"));
        assert!(plain_mountable("btrfsvol:/dev/sda/@/.snapshots/1/snapshot"));
        assert!(!plain_mountable("btrfsvol:/dev/sda"));
        assert!(!plain_mountable("btrfsvol:/dev/sda/../x"));
        assert!(!plain_mountable("btrfsvol:/dev/../x"));
        assert!(!plain_mountable("btrfsvol:/dev/./sda/@"));
        assert!(!plain_mountable("btrfsvol:/dev/sda/"));
        assert!(!plain_mountable("btrfsvol:/dev/sda//@"));
        assert!(!plain_mountable("btrfsvol:/dev/sda/@ x"));
        assert!(!plain_mountable("btrfsvol:/dev/sda/@\n!touch /x"));
        assert!(!plain_mountable("/dev/sda/@"));
    }

    #[test]
    fn a_missing_or_non_executable_guestfish_is_named_with_what_to_install() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("guestfish-check-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir(&dir).unwrap();
        let missing = dir.join("guestfish");
        let error = guestfish_installed(&missing).unwrap_err();
        assert!(error.contains("install libguestfs-tools"), "{error}");
        assert!(error.contains("nothing was written"), "{error}");
        std::fs::write(&missing, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&missing, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(
            guestfish_installed(&missing)
                .unwrap_err()
                .contains("not an executable file")
        );
        std::fs::set_permissions(&missing, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(guestfish_installed(&missing), Ok(()));
        assert!(guestfish_installed(&dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn no_command_sent_to_guestfish_comes_near_its_line_limit() {
        // The largest guest file recovery writes, of the bytes that quote the longest.
        let content = vec![0xffu8; MAX_GUEST_FILE_BYTES as usize];
        let path = format!("/{}", "a".repeat(255));
        for chunk in content.chunks(WRITE_CHUNK_BYTES) {
            let line = format!("write-append {} {}", quote(path.as_bytes()), quote(chunk));
            assert!(line.len() <= MAX_COMMAND_BYTES, "{}", line.len());
        }
    }

    #[tokio::test]
    async fn a_command_guestfish_would_split_is_never_sent() {
        let mut session =
            Session::start(ToolCall::new("/bin/cat", Duration::from_secs(5))).expect("cat starts");
        for command in [
            format!("-mount-ro \"/dev/{}!touch /x\" \"/srv\"", "A".repeat(8180)),
            "is-file /etc\n!touch /x".to_owned(),
            "is-file /etc\r!touch /x".to_owned(),
        ] {
            match session.ask(&[command]).await {
                Err(RecoveryError::Tool(why)) => assert!(why.contains("would split it"), "{why}"),
                other => panic!("sent: {other:?}"),
            }
        }
    }

    #[test]
    fn guest_text_never_leaves_its_quoted_argument() {
        assert_eq!(
            quote(b"a\"b\\c\nd\te\x01\xff"),
            "\"a\\\"b\\\\c\\nd\\te\\x01\\xff\""
        );
        assert!(plain_path("/etc/netplan/50-cloud-init.yaml"));
        assert!(!plain_path("/etc/netplan/a b.yaml"));
        assert!(!plain_path("/etc/netplan/a\nb.yaml"));
        assert!(!plain_path("etc/x"));
        assert!(!plain_path("/etc/../root"));
    }
}
