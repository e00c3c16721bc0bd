//! The source VM's hardware, read from the `qemu-server.conf` every PVE VM backup carries, and
//! the `qm create` options that give a sandbox VM the same shape.
//!
//! A restore boots only on the hardware it was installed for: PVE's defaults (`kvm64`, SeaBIOS,
//! every disk on virtio-scsi) make RHEL 9 guests panic, UEFI guests find nothing to boot and
//! guests without the right storage driver miss their root disk. So the sandbox mirrors the
//! source's `cpu`, `bios` (with its EFI vars disk), `machine`, `ostype`, `scsihw`, each disk's bus
//! and slot, CD-ROM drives (empty), NIC models and boot order.
//!
//! The config is untrusted input: only the top section is read (snapshot sections are other
//! states of the VM), every mirrored value passes a strict grammar or an allowlist, and every
//! other key is reported as omitted with the reason, never passed on. Nothing that reaches
//! outside the sandbox is ever mirrored: network bridges, VLANs and MAC addresses, device
//! passthrough (`hostpci`, `usb`, `serial`, `parallel`), hookscripts, raw QEMU `args`, shared
//! directories. A config that is oversized, not UTF-8, or not made of `key: value` lines is
//! refused as a whole.
//!
//! Mirrored does not mean as the source has it: the node's hardware policy
//! (`policy/source-hardware.toml`, [`policy`]) replaces CPU models that pass the node's own CPU
//! through (`host`, `max`) with a named model, and legacy NIC and SCSI controller models with
//! virtio, e1000 or virtio-scsi; each replacement is reported as changed, with the original.

pub mod policy;

use certistack_core::validate::ArchiveName;
#[cfg(test)]
use certistack_core::validate::Validated;
use certistack_proto::v1 as pb;
use policy::{HardwarePolicy, Verdict};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Largest config read from the backup; PVE configs are a few KiB (a busy VM with snapshots
/// sections stays far below). Longer output is refused, never cut.
pub const MAX_CONFIG_BYTES: usize = 64 * 1024;
/// Omitted parts listed one by one; the rest are counted in one last entry.
const MAX_OMITTED: usize = 64;
/// Longest value a key may carry to be mirrored; a longer one is omitted.
const MAX_VALUE_CHARS: usize = 4096;

/// The archive PVE's backup stores the EFI vars disk in.
pub const EFIDISK_ARCHIVE: &str = "drive-efidisk0.img";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceConfigError {
    #[error("the source config is larger than {MAX_CONFIG_BYTES} bytes; it is refused, not cut")]
    TooLarge,
    #[error("the source config is not UTF-8 text")]
    NotText,
    #[error("line {line} of the source config is not a `key: value` line")]
    Garbled { line: usize },
    #[error("line {line} of the source config repeats the key {key:?}")]
    DuplicateKey { line: usize, key: String },
    #[error("{0}; this build of the connector is broken: reinstall its package")]
    Policy(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Bus {
    Scsi,
    Virtio,
    Sata,
    Ide,
}

impl Bus {
    fn name(self) -> &'static str {
        match self {
            Bus::Scsi => "scsi",
            Bus::Virtio => "virtio",
            Bus::Sata => "sata",
            Bus::Ide => "ide",
        }
    }

    /// qemu-server's slot counts (`$MAX_SCSI_DISKS` 31, virtio 16, sata 6, ide 4).
    fn slots(self) -> u8 {
        match self {
            Bus::Scsi => 31,
            Bus::Virtio => 16,
            Bus::Sata => 6,
            Bus::Ide => 4,
        }
    }
}

/// A disk bus and slot that exists in PVE, e.g. `virtio1`; deserializing (from the journal)
/// checks the slot exists again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "SlotFields")]
pub struct Slot {
    pub bus: Bus,
    pub index: u8,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SlotFields {
    bus: Bus,
    index: u8,
}

impl TryFrom<SlotFields> for Slot {
    type Error = String;
    fn try_from(fields: SlotFields) -> Result<Self, String> {
        if fields.index < fields.bus.slots() {
            Ok(Slot {
                bus: fields.bus,
                index: fields.index,
            })
        } else {
            Err(format!(
                "{}{} is not a disk slot PVE has",
                fields.bus.name(),
                fields.index
            ))
        }
    }
}

impl Slot {
    pub fn parse(key: &str) -> Option<Slot> {
        for bus in [Bus::Scsi, Bus::Virtio, Bus::Sata, Bus::Ide] {
            if let Some(digits) = key.strip_prefix(bus.name())
                && !digits.is_empty()
                && digits.bytes().all(|b| b.is_ascii_digit())
                && (digits == "0" || !digits.starts_with('0'))
                && let Ok(index) = digits.parse::<u8>()
                && index < bus.slots()
            {
                return Some(Slot { bus, index });
            }
        }
        None
    }

    pub fn key(self) -> String {
        format!("{}{}", self.bus.name(), self.index)
    }

    /// The archive a PVE backup stores this disk in.
    pub fn archive(self) -> String {
        format!("drive-{}.img", self.key())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Disk {
    pub slot: Slot,
    pub cdrom: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Bios {
    Seabios,
    Ovmf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EfiType {
    #[serde(rename = "2m")]
    TwoMb,
    #[serde(rename = "4m")]
    FourMb,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EfiDisk {
    pub efitype: EfiType,
    pub pre_enrolled_keys: bool,
}

/// NIC models a sandbox may get: every model qemu-server accepts (`$nic_model_list`), all
/// emulated by QEMU itself, so none reaches outside the sandbox; a guest keeps the driver it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NicModel {
    Virtio,
    E1000,
    #[serde(rename = "e1000-82540em")]
    E1000_82540em,
    #[serde(rename = "e1000-82544gc")]
    E1000_82544gc,
    #[serde(rename = "e1000-82545em")]
    E1000_82545em,
    E1000e,
    I82551,
    I82557b,
    I82559er,
    #[serde(rename = "ne2k_isa")]
    Ne2kIsa,
    #[serde(rename = "ne2k_pci")]
    Ne2kPci,
    Pcnet,
    Rtl8139,
    Vmxnet3,
}

impl NicModel {
    const ALL: [NicModel; 14] = [
        NicModel::Virtio,
        NicModel::E1000,
        NicModel::E1000_82540em,
        NicModel::E1000_82544gc,
        NicModel::E1000_82545em,
        NicModel::E1000e,
        NicModel::I82551,
        NicModel::I82557b,
        NicModel::I82559er,
        NicModel::Ne2kIsa,
        NicModel::Ne2kPci,
        NicModel::Pcnet,
        NicModel::Rtl8139,
        NicModel::Vmxnet3,
    ];

    pub fn name(self) -> &'static str {
        match self {
            NicModel::Virtio => "virtio",
            NicModel::E1000 => "e1000",
            NicModel::E1000_82540em => "e1000-82540em",
            NicModel::E1000_82544gc => "e1000-82544gc",
            NicModel::E1000_82545em => "e1000-82545em",
            NicModel::E1000e => "e1000e",
            NicModel::I82551 => "i82551",
            NicModel::I82557b => "i82557b",
            NicModel::I82559er => "i82559er",
            NicModel::Ne2kIsa => "ne2k_isa",
            NicModel::Ne2kPci => "ne2k_pci",
            NicModel::Pcnet => "pcnet",
            NicModel::Rtl8139 => "rtl8139",
            NicModel::Vmxnet3 => "vmxnet3",
        }
    }
}

const NOT_A_QEMU_SERVER_NIC: &str = "its NIC model is not one qemu-server accepts";

/// qemu-server's `$MAX_NETS`: `net0` to `net31`.
const MAX_NICS: u8 = 32;

/// A NIC slot and model; deserializing (from the journal) checks the slot exists again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "NicFields")]
pub struct Nic {
    pub index: u8,
    pub model: NicModel,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NicFields {
    index: u8,
    model: NicModel,
}

impl TryFrom<NicFields> for Nic {
    type Error = String;
    fn try_from(fields: NicFields) -> Result<Self, String> {
        if fields.index < MAX_NICS {
            Ok(Nic {
                index: fields.index,
                model: fields.model,
            })
        } else {
            Err(format!("net{} is not a NIC slot PVE has", fields.index))
        }
    }
}

/// qemu-server's `ostype` enumeration.
const OSTYPES: [&str; 13] = [
    "other", "wxp", "w2k", "w2k3", "w2k8", "wvista", "win7", "win8", "win10", "win11", "l24",
    "l26", "solaris",
];
/// qemu-server's `scsihw` enumeration.
const SCSIHW: [&str; 6] = [
    "lsi",
    "lsi53c810",
    "virtio-scsi-pci",
    "virtio-scsi-single",
    "megasas",
    "pvscsi",
];

/// A value that passed its grammar; deserializing (from the journal) checks it again.
macro_rules! checked_text {
    ($(#[$meta:meta])* $name:ident, $check:path) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = String;
            fn try_from(value: String) -> Result<Self, String> {
                if $check(&value) {
                    Ok(Self(value))
                } else {
                    Err(format!("{:?} is not a valid {}", value, stringify!($name)))
                }
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.0
            }
        }
    };
}

checked_text!(
    /// `<model>` or `<model>,flags=+a;-b`.
    Cpu,
    cpu_ok
);
checked_text!(
    /// `pc`, `q35`, `pc-i440fx-<version>`, `pc-q35-<version>`, each with an optional `+pveN`.
    MachineType,
    machine_ok
);
checked_text!(
    /// One of qemu-server's `ostype` values.
    OsType,
    ostype_ok
);
checked_text!(
    /// One of qemu-server's `scsihw` values.
    ScsiHw,
    scsihw_ok
);

fn cpu_model_ok(model: &str) -> bool {
    let mut chars = model.chars();
    (1..=64).contains(&model.len())
        && chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '+'))
        && !model.starts_with("custom-")
}

fn cpu_flags_ok(flags: &str) -> bool {
    let list: Vec<&str> = flags.split(';').collect();
    list.len() <= 32
        && list.iter().all(|f| {
            f.strip_prefix(['+', '-']).is_some_and(|name| {
                (1..=32).contains(&name.len())
                    && name
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-_.".contains(c))
            })
        })
}

fn cpu_ok(value: &str) -> bool {
    match value.split_once(",flags=") {
        Some((model, flags)) => cpu_model_ok(model) && cpu_flags_ok(flags),
        None => cpu_model_ok(value),
    }
}

fn version_ok(version: &str) -> bool {
    let (numbers, pve) = match version.split_once("+pve") {
        Some((numbers, pve)) => (numbers, Some(pve)),
        None => (version, None),
    };
    let parts: Vec<&str> = numbers.split('.').collect();
    (2..=3).contains(&parts.len())
        && parts
            .iter()
            .all(|p| (1..=3).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit()))
        && pve.is_none_or(|n| (1..=3).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_digit()))
}

fn machine_ok(value: &str) -> bool {
    matches!(value, "pc" | "q35")
        || value.strip_prefix("pc-i440fx-").is_some_and(version_ok)
        || value.strip_prefix("pc-q35-").is_some_and(version_ok)
}

fn ostype_ok(value: &str) -> bool {
    OSTYPES.contains(&value)
}

fn scsihw_ok(value: &str) -> bool {
    SCSIHW.contains(&value)
}

/// The `scsihw` qemu-server gives a VM whose config sets none (`scsihw` in
/// `PVE::QemuServer`'s `$confdesc`: `default => 'lsi'`).
const QEMU_SERVER_DEFAULT_SCSIHW: &str = "lsi";
const REFUSED_BY_POLICY: &str = "its model is neither allowed nor replaced by the node's hardware policy (policy/source-hardware.toml)";

/// The hardware policy compiled into this build, checked against qemu-server's model lists.
pub fn compiled_policy() -> Result<&'static HardwarePolicy, String> {
    HardwarePolicy::compiled(&NicModel::ALL.map(NicModel::name), &SCSIHW, cpu_model_ok)
}

/// What the sandbox does not get, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Omitted {
    pub key: String,
    pub reason: String,
}

/// What the sandbox gets in place of the source's model, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Changed {
    pub key: String,
    pub original: String,
    pub replacement: String,
    pub reason: String,
}

/// The source VM's hardware, as far as a sandbox may have it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceHardware {
    pub cpu: Option<Cpu>,
    pub bios: Option<Bios>,
    pub machine: Option<MachineType>,
    pub ostype: Option<OsType>,
    pub scsihw: Option<ScsiHw>,
    pub disks: Vec<Disk>,
    pub efidisk: Option<EfiDisk>,
    pub nics: Vec<Nic>,
    /// Device keys (disk slots, `netN`) in boot order, each one of the devices above.
    pub boot_order: Vec<String>,
    pub omitted: Vec<Omitted>,
    /// Models the node's hardware policy replaced; absent in journals of older connectors.
    #[serde(default)]
    pub changed: Vec<Changed>,
}

/// Why a key of the source config is not mirrored, by its name.
fn omission_reason(key: &str) -> &'static str {
    let family = key.trim_end_matches(|c: char| c.is_ascii_digit());
    match family {
        "hostpci" | "usb" | "serial" | "parallel" => {
            "passthrough of a device of the source's node: a sandbox never gets node hardware"
        }
        "hookscript" => "a script on the node: never run for a sandbox",
        "args" => "raw QEMU arguments: never passed to a sandbox",
        "virtiofs" | "ivshmem" => {
            "shares memory or a directory of the node: never given to a sandbox"
        }
        "tpmstate" => {
            "TPM state is not mirrored: the sandbox has no TPM, so a guest that seals secrets to its TPM asks for its recovery key"
        }
        "unused" => "a detached volume: not part of the backup",
        "name" | "memory" | "cores" | "sockets" | "vcpus" | "agent" | "smbios1" | "vmgenid"
        | "description" | "tags" | "cpuunits" | "onboot" | "startup" | "protection" => {
            "set by the run for its sandbox VM"
        }
        "meta" | "digest" | "lock" | "parent" | "snaptime" | "vmstate" | "runningmachine"
        | "runningcpu" => "state of the source VM, not hardware",
        _ => "not mirrored: the sandbox keeps PVE's default",
    }
}

fn is_config_key(key: &str) -> bool {
    (1..=32).contains(&key.len())
        && key.starts_with(|c: char| c.is_ascii_lowercase())
        && key
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
}

/// `<key>.<option>` for an omitted option; an option name outside the key grammar is not
/// echoed (it is text of the source config, passed on to the report).
fn option_key(key: &str, option: &str) -> String {
    if is_config_key(option) {
        format!("{key}.{option}")
    } else {
        format!("{key}.<unnamed option>")
    }
}

/// `key=value` options of a property string, the first part possibly without a key.
fn options(value: &str) -> (Option<&str>, BTreeMap<&str, &str>) {
    let mut first = None;
    let mut map = BTreeMap::new();
    for (i, part) in value.split(',').enumerate() {
        match part.split_once('=') {
            Some((k, v)) => {
                map.insert(k.trim(), v.trim());
            }
            None if i == 0 => first = Some(part.trim()),
            None => {}
        }
    }
    (first, map)
}

/// The top section of a PVE VM config as `key → value`, refusing what is not a config.
fn top_section(bytes: &[u8]) -> Result<Vec<(String, String)>, SourceConfigError> {
    if bytes.len() > MAX_CONFIG_BYTES {
        return Err(SourceConfigError::TooLarge);
    }
    let text = std::str::from_utf8(bytes).map_err(|_| SourceConfigError::NotText)?;
    let mut keys: Vec<(String, String)> = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line_no = number.saturating_add(1);
        if line.starts_with('[') {
            break;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let Some((key, value)) = line.split_once(':') else {
            return Err(SourceConfigError::Garbled { line: line_no });
        };
        let key = key.trim();
        let value = value.trim();
        if !is_config_key(key)
            || value
                .chars()
                .any(|c| c.is_control() || c == char::REPLACEMENT_CHARACTER)
        {
            return Err(SourceConfigError::Garbled { line: line_no });
        }
        if keys.iter().any(|(k, _)| k == key) {
            return Err(SourceConfigError::DuplicateKey {
                line: line_no,
                key: key.to_owned(),
            });
        }
        keys.push((key.to_owned(), value.to_owned()));
    }
    Ok(keys)
}

impl SourceHardware {
    /// Parses a VM config as `proxmox-backup-client restore <snapshot> qemu-server.conf -`
    /// prints it.
    pub fn parse(bytes: &[u8]) -> Result<SourceHardware, SourceConfigError> {
        Self::parse_under(bytes, compiled_policy().map_err(SourceConfigError::Policy)?)
    }

    /// Parses a VM config and conforms it to `policy`.
    fn parse_under(
        bytes: &[u8],
        policy: &HardwarePolicy,
    ) -> Result<SourceHardware, SourceConfigError> {
        let keys = top_section(bytes)?;
        let mut hw = SourceHardware::default();
        let mut omitted: Vec<Omitted> = Vec::new();
        let mut omit = |key: &str, reason: &str| {
            omitted.push(Omitted {
                key: key.to_owned(),
                reason: reason.to_owned(),
            })
        };
        let mut boot = None;
        let mut bootdisk = None;
        for (key, value) in &keys {
            let key = key.as_str();
            // The config as a whole is bounded; one long value (a cloud-init VM's `sshkeys`)
            // is left out, not a reason to refuse the rest.
            if value.chars().count() > MAX_VALUE_CHARS {
                omit(
                    key,
                    &format!(
                        "its value is longer than {MAX_VALUE_CHARS} characters: never mirrored"
                    ),
                );
                continue;
            }
            let (first, opts) = options(value);
            if let Some(slot) = Slot::parse(key) {
                if opts.get("media") == Some(&"cdrom") {
                    hw.disks.push(Disk { slot, cdrom: true });
                } else if opts.get("backup") == Some(&"0") {
                    omit(
                        key,
                        "excluded from the backup (backup=0): there is nothing to restore",
                    );
                } else {
                    hw.disks.push(Disk { slot, cdrom: false });
                }
                continue;
            }
            if let Some(index) = key.strip_prefix("net").and_then(|n| n.parse::<u8>().ok())
                && index < MAX_NICS
                && key == format!("net{index}")
            {
                let model = first
                    .map(|f| f.split_once('=').map_or(f, |(m, _)| m))
                    .or_else(|| opts.get("model").copied())
                    .or_else(|| {
                        NicModel::ALL
                            .iter()
                            .map(|m| m.name())
                            .find(|m| opts.contains_key(m))
                    });
                match NicModel::ALL.into_iter().find(|m| Some(m.name()) == model) {
                    Some(model) => {
                        hw.nics.push(Nic { index, model });
                        omit(
                            key,
                            "bridge, VLAN tag, MAC address and firewall are the source's: the sandbox NIC is on the run's VNet with a fresh MAC and the firewall off",
                        );
                    }
                    None => omit(key, NOT_A_QEMU_SERVER_NIC),
                }
                continue;
            }
            match key {
                "cpu" => {
                    let model = first.or_else(|| opts.get("cputype").copied());
                    let mirrored = model.map(|model| match opts.get("flags") {
                        Some(flags) => format!("{model},flags={flags}"),
                        None => model.to_owned(),
                    });
                    match mirrored.and_then(|m| Cpu::try_from(m).ok()) {
                        Some(cpu) => hw.cpu = Some(cpu),
                        None => omit(
                            key,
                            "the CPU model or its flags are not ones a sandbox may have (custom models live on the source's node)",
                        ),
                    }
                    for sub in opts.keys().filter(|k| !matches!(**k, "cputype" | "flags")) {
                        omit(
                            &option_key(key, sub),
                            "not mirrored: the sandbox keeps PVE's default",
                        );
                    }
                }
                "bios" => match value.as_str() {
                    "seabios" => hw.bios = Some(Bios::Seabios),
                    "ovmf" => hw.bios = Some(Bios::Ovmf),
                    _ => omit(key, "not a firmware PVE offers (seabios, ovmf)"),
                },
                "machine" => {
                    match first
                        .or_else(|| opts.get("type").copied())
                        .and_then(|t| MachineType::try_from(t.to_owned()).ok())
                    {
                        Some(machine) => hw.machine = Some(machine),
                        None => omit(key, "not an x86 machine type PVE offers"),
                    }
                    for sub in opts.keys().filter(|k| **k != "type") {
                        omit(
                            &option_key(key, sub),
                            "not mirrored: the sandbox keeps PVE's default (no vIOMMU)",
                        );
                    }
                }
                "ostype" => match OsType::try_from(value.clone()) {
                    Ok(ostype) => hw.ostype = Some(ostype),
                    Err(_) => omit(key, "not one of qemu-server's ostype values"),
                },
                "scsihw" => match ScsiHw::try_from(value.clone()) {
                    Ok(scsihw) => hw.scsihw = Some(scsihw),
                    Err(_) => omit(key, "not one of qemu-server's scsihw values"),
                },
                "efidisk0" => {
                    let efitype = match opts.get("efitype") {
                        None | Some(&"2m") => Some(EfiType::TwoMb),
                        Some(&"4m") => Some(EfiType::FourMb),
                        Some(_) => None,
                    };
                    match efitype {
                        Some(efitype) => {
                            hw.efidisk = Some(EfiDisk {
                                efitype,
                                pre_enrolled_keys: opts.get("pre-enrolled-keys") == Some(&"1"),
                            })
                        }
                        None => omit(key, "its efitype is neither 2m nor 4m"),
                    }
                }
                "boot" => boot = Some(value.clone()),
                "bootdisk" => bootdisk = Slot::parse(value),
                _ => omit(key, omission_reason(key)),
            }
        }
        hw.omitted = omitted;
        hw.conform(policy);
        hw.boot_order = hw.boot_devices(boot.as_deref(), bootdisk);
        let mut omitted = std::mem::take(&mut hw.omitted);
        if omitted.len() > MAX_OMITTED {
            let more = omitted.len().saturating_sub(MAX_OMITTED.saturating_sub(1));
            omitted.truncate(MAX_OMITTED.saturating_sub(1));
            omitted.push(Omitted {
                key: "...".into(),
                reason: format!("{more} more keys not mirrored"),
            });
        }
        hw.omitted = omitted;
        Ok(hw)
    }

    /// Applies the node's hardware policy: a replaced model gives way to its replacement and
    /// is listed as changed, a refused one is left out and listed as omitted. A source with
    /// SCSI disks and no `scsihw` has qemu-server's default, `lsi`, and is ruled as naming it.
    fn conform(&mut self, policy: &HardwarePolicy) {
        let change = |key: &str, original: &str, replacement: &str, reason: &str| Changed {
            key: key.to_owned(),
            original: original.to_owned(),
            replacement: replacement.to_owned(),
            reason: reason.to_owned(),
        };
        let mut changed = Vec::new();
        if let Some(cpu) = self.cpu.take() {
            let (model, flags) = match cpu.as_str().split_once(",flags=") {
                Some((model, flags)) => (model.to_owned(), Some(flags.to_owned())),
                None => (cpu.as_str().to_owned(), None),
            };
            self.cpu = match policy.cpu(&model) {
                Verdict::Keep => Some(cpu),
                Verdict::Replace { with, why } => {
                    let replaced = match &flags {
                        Some(flags) => format!("{with},flags={flags}"),
                        None => with.to_owned(),
                    };
                    match Cpu::try_from(replaced) {
                        Ok(replacement) => {
                            changed.push(change("cpu", &model, with, why));
                            Some(replacement)
                        }
                        Err(_) => {
                            self.omitted.push(Omitted {
                                key: "cpu".into(),
                                reason: format!("{REFUSED_BY_POLICY}: its replacement {with:?} is not a CPU model a sandbox may have"),
                            });
                            None
                        }
                    }
                }
                Verdict::Refuse => {
                    self.omitted.push(Omitted {
                        key: "cpu".into(),
                        reason: REFUSED_BY_POLICY.into(),
                    });
                    None
                }
            };
        }
        let mut nics = Vec::with_capacity(self.nics.len());
        for nic in self.nics.drain(..) {
            let key = format!("net{}", nic.index);
            match policy.nic(nic.model.name()) {
                Verdict::Keep => nics.push(nic),
                Verdict::Replace { with, why } => {
                    match NicModel::ALL.into_iter().find(|m| m.name() == with) {
                        Some(model) => {
                            changed.push(change(&key, nic.model.name(), with, why));
                            nics.push(Nic { model, ..nic });
                        }
                        None => self.omitted.push(Omitted {
                            key,
                            reason: NOT_A_QEMU_SERVER_NIC.into(),
                        }),
                    }
                }
                Verdict::Refuse => self.omitted.push(Omitted {
                    key,
                    reason: REFUSED_BY_POLICY.into(),
                }),
            }
        }
        self.nics = nics;
        let scsi_disks = self.disks.iter().any(|d| d.slot.bus == Bus::Scsi);
        let (scsihw, implied) = match self.scsihw.take() {
            Some(scsihw) => (Some(scsihw.as_str().to_owned()), false),
            None if scsi_disks => (Some(QEMU_SERVER_DEFAULT_SCSIHW.to_owned()), true),
            None => (None, false),
        };
        if let Some(scsihw) = scsihw {
            self.scsihw = match policy.scsihw(&scsihw) {
                Verdict::Keep if implied => None,
                Verdict::Keep => ScsiHw::try_from(scsihw).ok(),
                Verdict::Replace { with, why } => match ScsiHw::try_from(with.to_owned()) {
                    Ok(replacement) => {
                        let original = if implied {
                            format!("{scsihw} (qemu-server's default: the source sets no scsihw)")
                        } else {
                            scsihw
                        };
                        changed.push(change("scsihw", &original, with, why));
                        Some(replacement)
                    }
                    Err(_) => None,
                },
                Verdict::Refuse => {
                    self.omitted.push(Omitted {
                        key: "scsihw".into(),
                        reason: REFUSED_BY_POLICY.into(),
                    });
                    None
                }
            };
        }
        self.changed = changed;
    }

    /// The boot order restricted to devices of this shape: `order=a;b` (PVE 6.2+), or the
    /// legacy `boot: cdn` + `bootdisk`.
    fn boot_devices(&self, boot: Option<&str>, bootdisk: Option<Slot>) -> Vec<String> {
        let known = |key: &str| {
            self.disks.iter().any(|d| d.slot.key() == key)
                || self.nics.iter().any(|n| format!("net{}", n.index) == key)
        };
        let mut order: Vec<String> = Vec::new();
        match boot {
            Some(boot) if options(boot).1.contains_key("order") => {
                if let Some(list) = options(boot).1.get("order") {
                    order = list
                        .split(';')
                        .filter(|k| known(k))
                        .map(str::to_owned)
                        .collect();
                }
            }
            legacy => {
                for letter in legacy.unwrap_or("cdn").chars() {
                    match letter {
                        'c' => order.extend(bootdisk.map(Slot::key)),
                        'd' => order.extend(
                            self.disks
                                .iter()
                                .filter(|d| d.cdrom)
                                .map(|d| d.slot.key())
                                .take(1),
                        ),
                        'n' => order.extend(self.nics.iter().map(|n| format!("net{}", n.index))),
                        _ => {}
                    }
                }
                order.retain(|k| known(k));
            }
        }
        order.dedup();
        order
    }

    /// The archives of this shape's disks (and EFI vars disk) a run may attach.
    pub fn archives(&self) -> Vec<String> {
        let mut archives: Vec<String> = self
            .disks
            .iter()
            .filter(|d| !d.cdrom)
            .map(|d| d.slot.archive())
            .collect();
        if self.efidisk.is_some() {
            archives.push(EFIDISK_ARCHIVE.to_owned());
        }
        archives
    }

    /// The `qm create` options giving a sandbox this shape, for the overlays given by archive:
    /// each at its source slot, the EFI vars disk as `efidisk0`; CD-ROM drives empty; NICs on
    /// `vnet` with the firewall off and a MAC PVE picks; the boot order restricted to the
    /// devices the sandbox has.
    pub fn qm_options(
        &self,
        overlays: &[(ArchiveName, String)],
        vnet: &str,
    ) -> Result<Vec<(String, String)>, String> {
        // A shape journaled by a connector without the hardware policy (or under an older
        // one) is not booted as it is: the policy of this build would change it.
        let mut conformed = self.clone();
        conformed.conform(compiled_policy()?);
        if !conformed.changed.is_empty() || conformed.omitted.len() != self.omitted.len() {
            return Err("the source hardware this run read has models the node's hardware policy (policy/source-hardware.toml) does not allow as they are; read the source config again in a new run".into());
        }
        let mut args: Vec<(String, String)> = Vec::new();
        let mut push = |k: &str, v: String| args.push((format!("--{k}"), v));
        if let Some(cpu) = &self.cpu {
            push("cpu", cpu.as_str().to_owned());
        }
        if let Some(bios) = self.bios {
            push(
                "bios",
                match bios {
                    Bios::Seabios => "seabios",
                    Bios::Ovmf => "ovmf",
                }
                .into(),
            );
        }
        if let Some(machine) = &self.machine {
            push("machine", machine.as_str().to_owned());
        }
        if let Some(ostype) = &self.ostype {
            push("ostype", ostype.as_str().to_owned());
        }
        if let Some(scsihw) = &self.scsihw {
            push("scsihw", scsihw.as_str().to_owned());
        }
        let mut present: Vec<String> = Vec::new();
        for (archive, path) in overlays {
            if archive.as_str() == EFIDISK_ARCHIVE {
                let Some(efi) = self.efidisk else {
                    return Err(format!(
                        "{archive} is not a disk of the source config (it has no efidisk0)"
                    ));
                };
                let efitype = match efi.efitype {
                    EfiType::TwoMb => "2m",
                    EfiType::FourMb => "4m",
                };
                push(
                    "efidisk0",
                    format!(
                        "{path},format=qcow2,efitype={efitype},pre-enrolled-keys={}",
                        u8::from(efi.pre_enrolled_keys)
                    ),
                );
                continue;
            }
            let Some(disk) = self
                .disks
                .iter()
                .find(|d| !d.cdrom && d.slot.archive() == archive.as_str())
            else {
                return Err(format!(
                    "{archive} is not a disk of the source config (its disks: {})",
                    self.archives().join(", ")
                ));
            };
            push(&disk.slot.key(), format!("{path},format=qcow2,backup=0"));
            present.push(disk.slot.key());
        }
        for disk in self.disks.iter().filter(|d| d.cdrom) {
            push(&disk.slot.key(), "none,media=cdrom".into());
            present.push(disk.slot.key());
        }
        for nic in &self.nics {
            push(
                &format!("net{}", nic.index),
                format!("{},bridge={vnet},firewall=0", nic.model.name()),
            );
            present.push(format!("net{}", nic.index));
        }
        let order: Vec<&str> = self
            .boot_order
            .iter()
            .filter(|k| present.contains(k))
            .map(String::as_str)
            .collect();
        if !order.is_empty() {
            push("boot", format!("order={}", order.join(";")));
        }
        Ok(args)
    }

    pub fn to_wire(&self) -> pb::SourceHardware {
        pb::SourceHardware {
            cpu: self
                .cpu
                .as_ref()
                .map(|c| c.as_str().to_owned())
                .unwrap_or_default(),
            bios: match self.bios {
                Some(Bios::Seabios) => "seabios".into(),
                Some(Bios::Ovmf) => "ovmf".into(),
                None => String::new(),
            },
            machine: self
                .machine
                .as_ref()
                .map(|m| m.as_str().to_owned())
                .unwrap_or_default(),
            ostype: self
                .ostype
                .as_ref()
                .map(|o| o.as_str().to_owned())
                .unwrap_or_default(),
            scsihw: self
                .scsihw
                .as_ref()
                .map(|s| s.as_str().to_owned())
                .unwrap_or_default(),
            disks: self
                .disks
                .iter()
                .map(|d| pb::SourceDisk {
                    slot: d.slot.key(),
                    archive: if d.cdrom {
                        String::new()
                    } else {
                        d.slot.archive()
                    },
                    cdrom: d.cdrom,
                })
                .collect(),
            efidisk: self.efidisk.is_some(),
            efitype: match self.efidisk.map(|e| e.efitype) {
                Some(EfiType::TwoMb) => "2m".into(),
                Some(EfiType::FourMb) => "4m".into(),
                None => String::new(),
            },
            pre_enrolled_keys: self.efidisk.is_some_and(|e| e.pre_enrolled_keys),
            nics: self
                .nics
                .iter()
                .map(|n| pb::SourceNic {
                    index: u32::from(n.index),
                    model: n.model.name().to_owned(),
                })
                .collect(),
            boot_order: self.boot_order.clone(),
            omitted: self
                .omitted
                .iter()
                .map(|o| pb::OmittedPart {
                    key: o.key.clone(),
                    reason: o.reason.clone(),
                })
                .collect(),
            changed: self
                .changed
                .iter()
                .map(|c| pb::ChangedPart {
                    key: c.key.clone(),
                    original: c.original.clone(),
                    replacement: c.replacement.clone(),
                    reason: c.reason.clone(),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UEFI: &str = "#Web server%3A UEFI\nbios: ovmf\nboot: order=scsi0;ide2;net0\ncores: 2\ncpu: x86-64-v2-AES\nefidisk0: local-lvm:vm-101-disk-0,efitype=4m,pre-enrolled-keys=1,size=4M\nide2: local:iso/debian.iso,media=cdrom,size=600M\nmachine: q35\nmemory: 2048\nname: web\nnet0: virtio=BC:24:11:00:00:01,bridge=vmbr0,firewall=1\nostype: l26\nscsi0: local-lvm:vm-101-disk-1,iothread=1,size=32G\nscsihw: virtio-scsi-single\ntpmstate0: local-lvm:vm-101-disk-2,size=4M,version=v2.0\n\n[before-upgrade]\ncpu: host\nscsi1: local-lvm:vm-101-disk-3\n";

    fn overlay(archive: &str) -> (ArchiveName, String) {
        (
            ArchiveName::validate(archive).unwrap(),
            format!("/ov/{archive}.qcow2"),
        )
    }

    #[test]
    fn a_uefi_guest_keeps_its_firmware_cpu_and_efi_disk() {
        let hw = SourceHardware::parse(UEFI.as_bytes()).unwrap();
        assert_eq!(hw.cpu.as_ref().unwrap().as_str(), "x86-64-v2-AES");
        assert_eq!(hw.bios, Some(Bios::Ovmf));
        assert_eq!(hw.machine.as_ref().unwrap().as_str(), "q35");
        assert_eq!(
            hw.efidisk,
            Some(EfiDisk {
                efitype: EfiType::FourMb,
                pre_enrolled_keys: true
            })
        );
        // The snapshot section's scsi1 and cpu: host are another state of the VM.
        assert_eq!(hw.archives(), ["drive-scsi0.img", EFIDISK_ARCHIVE]);
        assert_eq!(hw.boot_order, ["scsi0", "ide2", "net0"]);
        let omitted: Vec<&str> = hw.omitted.iter().map(|o| o.key.as_str()).collect();
        assert!(omitted.contains(&"tpmstate0"), "{omitted:?}");
        assert!(omitted.contains(&"net0"), "{omitted:?}");
        let args = hw
            .qm_options(
                &[overlay("drive-scsi0.img"), overlay(EFIDISK_ARCHIVE)],
                "csbox1",
            )
            .unwrap();
        let get = |k: &str| {
            args.iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("--cpu"), Some("x86-64-v2-AES"));
        assert_eq!(get("--bios"), Some("ovmf"));
        assert_eq!(
            get("--efidisk0"),
            Some("/ov/drive-efidisk0.img.qcow2,format=qcow2,efitype=4m,pre-enrolled-keys=1")
        );
        assert_eq!(
            get("--scsi0"),
            Some("/ov/drive-scsi0.img.qcow2,format=qcow2,backup=0")
        );
        assert_eq!(get("--scsihw"), Some("virtio-scsi-single"));
        assert_eq!(get("--ide2"), Some("none,media=cdrom"));
        assert_eq!(get("--net0"), Some("virtio,bridge=csbox1,firewall=0"));
        assert_eq!(get("--boot"), Some("order=scsi0;ide2;net0"));
        assert_eq!(get("--ostype"), Some("l26"));
        // Nothing of the source's network or TPM reaches the sandbox.
        let all = format!("{args:?}");
        for absent in ["vmbr0", "BC:24:11", "tpmstate", "local-lvm"] {
            assert!(!all.contains(absent), "{absent} in {all}");
        }
    }

    #[test]
    fn virtio_and_sata_disks_keep_their_bus_and_slot() {
        let virtio = "boot: order=virtio0\nnet0: e1000=BC:24:11:00:00:02,bridge=vmbr1,tag=20\nvirtio0: local-lvm:vm-102-disk-0,size=8G\nvirtio1: local-lvm:vm-102-disk-1,backup=0\n";
        let hw = SourceHardware::parse(virtio.as_bytes()).unwrap();
        assert_eq!(hw.archives(), ["drive-virtio0.img"]);
        assert!(hw.omitted.iter().any(|o| o.key == "virtio1"));
        let args = hw
            .qm_options(&[overlay("drive-virtio0.img")], "csbox1")
            .unwrap();
        assert!(args.contains(&(
            "--virtio0".into(),
            "/ov/drive-virtio0.img.qcow2,format=qcow2,backup=0".into()
        )));
        assert!(args.contains(&("--net0".into(), "e1000,bridge=csbox1,firewall=0".into())));
        assert!(!format!("{args:?}").contains("tag"));

        let sata = "boot: cdn\nbootdisk: sata0\nsata0: local:100/vm-103-disk-0.qcow2\nsata1: none,media=cdrom\nmachine: pc-i440fx-9.2+pve1\n";
        let hw = SourceHardware::parse(sata.as_bytes()).unwrap();
        assert_eq!(hw.boot_order, ["sata0", "sata1"]);
        let args = hw
            .qm_options(&[overlay("drive-sata0.img")], "csbox1")
            .unwrap();
        assert!(args.contains(&("--machine".into(), "pc-i440fx-9.2+pve1".into())));
        assert!(args.contains(&("--sata1".into(), "none,media=cdrom".into())));
        assert!(args.contains(&("--boot".into(), "order=sata0;sata1".into())));
    }

    #[test]
    fn every_nic_model_qemu_server_accepts_is_mirrored_or_replaced_and_no_other() {
        let config = "net0: pcnet=BC:24:11:00:00:01,bridge=vmbr0\nnet1: e1000-82545em=BC:24:11:00:00:02,bridge=vmbr0\nnet2: ne2k_pci=BC:24:11:00:00:03,bridge=vmbr0\nnet3: tulip=BC:24:11:00:00:04,bridge=vmbr0\n";
        let hw = SourceHardware::parse(config.as_bytes()).unwrap();
        let models: Vec<(u8, &str)> = hw.nics.iter().map(|n| (n.index, n.model.name())).collect();
        // The legacy models give way to the policy's e1000; the e1000 variant is kept.
        assert_eq!(models, [(0, "e1000"), (1, "e1000-82545em"), (2, "e1000")]);
        assert!(
            hw.omitted
                .iter()
                .any(|o| o.key == "net3" && o.reason.contains("not one qemu-server accepts"))
        );
        let args = hw.qm_options(&[], "csbox1").unwrap();
        assert!(args.contains(&(
            "--net1".into(),
            "e1000-82545em,bridge=csbox1,firewall=0".into()
        )));
        // The journal keeps the model by its PVE name and reads it back.
        let journaled = serde_json::to_string(&hw).unwrap();
        assert!(journaled.contains("\"e1000-82545em\""), "{journaled}");
        assert_eq!(
            serde_json::from_str::<SourceHardware>(&journaled).unwrap(),
            hw
        );
    }

    fn changes(hw: &SourceHardware) -> Vec<(&str, &str, &str)> {
        hw.changed
            .iter()
            .map(|c| (c.key.as_str(), c.original.as_str(), c.replacement.as_str()))
            .collect()
    }

    #[test]
    fn the_nodes_cpu_and_legacy_device_models_give_way_to_the_policy_and_are_reported() {
        let config = "cpu: host,flags=+aes\nnet0: rtl8139=BC:24:11:00:00:01,bridge=vmbr0\nnet1: virtio=BC:24:11:00:00:02,bridge=vmbr0\nnet2: vmxnet3=BC:24:11:00:00:03,bridge=vmbr0\nscsihw: megasas\nscsi0: local-lvm:vm-1-disk-0\nboot: order=scsi0;net0\n";
        let hw = SourceHardware::parse(config.as_bytes()).unwrap();
        assert_eq!(
            hw.cpu.as_ref().unwrap().as_str(),
            "x86-64-v2-AES,flags=+aes"
        );
        assert_eq!(hw.scsihw.as_ref().unwrap().as_str(), "virtio-scsi-pci");
        assert_eq!(
            changes(&hw),
            [
                ("cpu", "host", "x86-64-v2-AES"),
                ("net0", "rtl8139", "e1000"),
                ("scsihw", "megasas", "virtio-scsi-pci"),
            ]
        );
        assert!(hw.changed.iter().all(|c| !c.reason.is_empty()));
        assert!(hw.changed[0].reason.contains("vmx or svm"));
        // The replaced NIC keeps its slot and its place in the boot order.
        assert_eq!(hw.boot_order, ["scsi0", "net0"]);
        let args = hw
            .qm_options(&[overlay("drive-scsi0.img")], "csbox1")
            .unwrap();
        assert!(args.contains(&("--cpu".into(), "x86-64-v2-AES,flags=+aes".into())));
        assert!(args.contains(&("--net0".into(), "e1000,bridge=csbox1,firewall=0".into())));
        assert!(args.contains(&("--net1".into(), "virtio,bridge=csbox1,firewall=0".into())));
        assert!(args.contains(&("--net2".into(), "vmxnet3,bridge=csbox1,firewall=0".into())));
        assert!(args.contains(&("--scsihw".into(), "virtio-scsi-pci".into())));
        let all = format!("{args:?}");
        for absent in ["host", "rtl8139", "megasas"] {
            assert!(!all.contains(absent), "{absent} in {all}");
        }
        // On the wire, with the original.
        let wire = hw.to_wire();
        assert_eq!(wire.changed.len(), 3);
        assert_eq!(wire.changed[1].key, "net0");
        assert_eq!(wire.changed[1].original, "rtl8139");
        assert_eq!(wire.changed[1].replacement, "e1000");
        assert_eq!(wire.nics[0].model, "e1000");

        let max = SourceHardware::parse(b"cpu: max\n").unwrap();
        assert_eq!(max.cpu.unwrap().as_str(), "x86-64-v2-AES");
        let named = SourceHardware::parse(b"cpu: Skylake-Server-v4\n").unwrap();
        assert_eq!(named.cpu.unwrap().as_str(), "Skylake-Server-v4");
        assert!(named.changed.is_empty());
        for kept in ["virtio-scsi-pci", "virtio-scsi-single"] {
            let hw =
                SourceHardware::parse(format!("scsihw: {kept}\nscsi0: a\n").as_bytes()).unwrap();
            assert_eq!(hw.scsihw.unwrap().as_str(), kept);
            assert!(hw.changed.is_empty());
        }
    }

    /// Without `scsihw` qemu-server puts SCSI disks on an emulated LSI controller.
    #[test]
    fn scsi_disks_without_a_scsihw_are_put_on_virtio_scsi() {
        let hw = SourceHardware::parse(b"scsi0: local-lvm:vm-1-disk-0\n").unwrap();
        assert_eq!(hw.scsihw.as_ref().unwrap().as_str(), "virtio-scsi-pci");
        assert_eq!(hw.changed.len(), 1);
        assert!(
            hw.changed[0]
                .original
                .starts_with("lsi (qemu-server's default"),
            "{:?}",
            hw.changed
        );
        let virtio_only = SourceHardware::parse(b"virtio0: local-lvm:vm-1-disk-0\n").unwrap();
        assert_eq!(virtio_only.scsihw, None);
        assert!(virtio_only.changed.is_empty());
    }

    #[test]
    fn the_compiled_policy_rules_every_model_qemu_server_accepts() {
        let policy = compiled_policy().unwrap();
        for model in NicModel::ALL {
            match policy.nic(model.name()) {
                Verdict::Keep => {}
                Verdict::Replace { with, .. } => assert_eq!(policy.nic(with), Verdict::Keep),
                Verdict::Refuse => panic!("{} is not ruled", model.name()),
            }
        }
        for model in SCSIHW {
            match policy.scsihw(model) {
                Verdict::Keep => assert!(model.starts_with("virtio-scsi"), "{model}"),
                Verdict::Replace { with, .. } => assert_eq!(policy.scsihw(with), Verdict::Keep),
                Verdict::Refuse => panic!("{model} is not ruled"),
            }
        }
        for legacy in [
            "pcnet", "ne2k_isa", "ne2k_pci", "rtl8139", "i82551", "i82557b", "i82559er",
        ] {
            assert!(
                matches!(policy.nic(legacy), Verdict::Replace { with: "e1000", .. }),
                "{legacy}"
            );
        }
        for passthrough in ["host", "max"] {
            assert!(matches!(
                policy.cpu(passthrough),
                Verdict::Replace {
                    with: "x86-64-v2-AES",
                    ..
                }
            ));
        }
    }

    /// A shape journaled before the policy (or by an older connector) is not booted as it is.
    #[test]
    fn a_journaled_shape_the_policy_would_change_is_not_booted() {
        let mut hw = SourceHardware::parse(b"scsi0: a\nscsihw: virtio-scsi-pci\n").unwrap();
        assert!(
            hw.qm_options(&[overlay("drive-scsi0.img")], "csbox1")
                .is_ok()
        );
        hw.cpu = Some(Cpu::try_from("host".to_owned()).unwrap());
        let error = hw
            .qm_options(&[overlay("drive-scsi0.img")], "csbox1")
            .unwrap_err();
        assert!(error.contains("policy/source-hardware.toml"), "{error}");
        assert!(error.contains("read the source config again"), "{error}");
    }

    #[test]
    fn passthrough_and_node_reaching_keys_are_omitted_with_a_reason() {
        let text = "args: -device foo\nhookscript: local:snippets/hook.pl\nhostpci0: 0000:01:00.0,pcie=1\nusb0: host=1234:5678\nserial0: /dev/ttyS0\nparallel0: /dev/parport0\nvirtiofs0: share1\nmachine: q35,viommu=intel\ncpu: custom-mine\nnet1: virtio,bridge=vmbr0\nnet2: tulip,bridge=vmbr0\nscsi0: local-lvm:vm-104-disk-0\n";
        let hw = SourceHardware::parse(text.as_bytes()).unwrap();
        let reasons: BTreeMap<&str, &str> = hw
            .omitted
            .iter()
            .map(|o| (o.key.as_str(), o.reason.as_str()))
            .collect();
        for key in ["hostpci0", "usb0", "serial0", "parallel0"] {
            assert!(reasons[key].contains("passthrough"), "{key}");
        }
        assert!(reasons["hookscript"].contains("never run"));
        assert!(reasons["args"].contains("never passed"));
        assert!(reasons["virtiofs0"].contains("never given"));
        assert!(reasons.contains_key("machine.viommu"));
        let odd = SourceHardware::parse("cpu: host,<b>x</b>=1\n".as_bytes()).unwrap();
        assert_eq!(odd.omitted[0].key, "cpu.<unnamed option>");
        assert!(reasons.contains_key("cpu"));
        assert!(reasons["net2"].contains("NIC model"));
        assert_eq!(hw.machine.unwrap().as_str(), "q35");
        assert_eq!(hw.cpu, None);
        assert_eq!(hw.nics.len(), 1);
        // The legacy default boot order is disk, CD-ROM, network: only the NIC is known here.
        assert_eq!(hw.boot_order, ["net1"]);
    }

    #[test]
    fn oversized_garbled_and_repeated_configs_are_refused() {
        let big = format!("scsi0: x\ndescription: {}\n", "a".repeat(MAX_CONFIG_BYTES));
        assert_eq!(
            SourceHardware::parse(big.as_bytes()),
            Err(SourceConfigError::TooLarge)
        );
        assert_eq!(
            SourceHardware::parse(b"scsi0: x\n\xff\xfe\n"),
            Err(SourceConfigError::NotText)
        );
        assert_eq!(
            SourceHardware::parse(b"scsi0: x\nthis is not a config\n"),
            Err(SourceConfigError::Garbled { line: 2 })
        );
        assert_eq!(
            SourceHardware::parse(b"Scsi0: x\n"),
            Err(SourceConfigError::Garbled { line: 1 })
        );
        assert_eq!(
            SourceHardware::parse(b"cpu: host\ncpu: kvm64\n"),
            Err(SourceConfigError::DuplicateKey {
                line: 2,
                key: "cpu".into()
            })
        );
    }

    #[test]
    fn values_outside_the_grammar_are_never_mirrored() {
        for cpu in [
            "host,flags=+aes;rm -rf",
            "kvm64,flags=aes",
            "-x",
            "a b",
            "custom-x",
        ] {
            assert!(!cpu_ok(cpu), "{cpu}");
        }
        for cpu in [
            "x86-64-v2-AES",
            "host",
            "Skylake-Server-v4,flags=+pcid;-spec-ctrl",
        ] {
            assert!(cpu_ok(cpu), "{cpu}");
        }
        for machine in ["pc-q35-9.2+pve1", "pc-i440fx-8.1", "q35", "pc"] {
            assert!(machine_ok(machine), "{machine}");
        }
        for machine in [
            "virt",
            "pc-q35-",
            "q35,viommu=intel",
            "pc-q35-9.2+pvex",
            "microvm",
        ] {
            assert!(!machine_ok(machine), "{machine}");
        }
        assert_eq!(Slot::parse("scsi31"), None);
        assert_eq!(Slot::parse("virtio01"), None);
        assert_eq!(Slot::parse("ide4"), None);
        assert_eq!(
            Slot::parse("sata5"),
            Some(Slot {
                bus: Bus::Sata,
                index: 5
            })
        );
        // A shape read back from the journal is checked again.
        let tampered = serde_json::json!({
            "cpu": "host,flags=+x;$(id)", "bios": null, "machine": null, "ostype": null,
            "scsihw": null, "disks": [], "efidisk": null, "nics": [], "boot_order": [], "omitted": []
        });
        assert!(serde_json::from_value::<SourceHardware>(tampered).is_err());
    }

    #[test]
    fn an_archive_the_source_does_not_name_is_refused() {
        let hw = SourceHardware::parse(b"scsi0: local-lvm:vm-1-disk-0\n").unwrap();
        let err = hw
            .qm_options(&[overlay("drive-scsi1.img")], "csbox1")
            .unwrap_err();
        assert!(err.contains("drive-scsi1.img is not a disk of the source config"));
        let err = hw
            .qm_options(&[overlay(EFIDISK_ARCHIVE)], "csbox1")
            .unwrap_err();
        assert!(err.contains("no efidisk0"));
    }

    /// A real cloud-init VM carries its admin keys URL-encoded in `sshkeys`; a handful of RSA
    /// keys pass 4096 characters. The key is never mirrored, so its length must not make the
    /// whole config unreadable.
    #[test]
    fn a_long_value_of_a_key_that_is_not_mirrored_does_not_refuse_the_config() {
        let key = format!("ssh-rsa%20{}%20admin%40example", "A".repeat(720));
        let sshkeys = vec![key; 6].join("%0A");
        assert!(sshkeys.len() > MAX_VALUE_CHARS);
        let config =
            format!("cpu: x86-64-v2-AES\nscsi0: local-lvm:vm-1-disk-0\nsshkeys: {sshkeys}\n");
        let hw = SourceHardware::parse(config.as_bytes()).unwrap();
        assert_eq!(hw.cpu.unwrap().as_str(), "x86-64-v2-AES");
        assert!(hw.omitted.iter().any(|o| o.key == "sshkeys"));
    }

    /// Slots and NIC indexes read back from the journal are checked again, like the CPU: a
    /// shape no parse could produce never reaches `qm create`.
    #[test]
    fn a_journaled_shape_with_a_slot_or_nic_pve_lacks_is_refused() {
        let shape = |disks: serde_json::Value, nics: serde_json::Value| {
            serde_json::json!({
                "cpu": null, "bios": null, "machine": null, "ostype": null, "scsihw": null,
                "disks": disks, "efidisk": null, "nics": nics, "boot_order": [], "omitted": []
            })
        };
        let good = shape(
            serde_json::json!([{ "slot": { "bus": "scsi", "index": 30 }, "cdrom": false }]),
            serde_json::json!([{ "index": 31, "model": "virtio" }]),
        );
        assert!(serde_json::from_value::<SourceHardware>(good).is_ok());
        for tampered in [
            shape(
                serde_json::json!([{ "slot": { "bus": "scsi", "index": 200 }, "cdrom": false }]),
                serde_json::json!([]),
            ),
            shape(
                serde_json::json!([{ "slot": { "bus": "ide", "index": 4 }, "cdrom": true }]),
                serde_json::json!([]),
            ),
            shape(
                serde_json::json!([]),
                serde_json::json!([{ "index": 99, "model": "virtio" }]),
            ),
        ] {
            assert!(
                serde_json::from_value::<SourceHardware>(tampered.clone()).is_err(),
                "{tampered}"
            );
        }
    }
}
