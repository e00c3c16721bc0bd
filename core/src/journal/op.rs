//! What a journal record is about: the operation ([`Op`]) and its class ([`OpClass`]), and the
//! resource it names ([`Resource`]). Both are parsed once, here, from the strings the journal
//! stores; the strings stay the journal's wire format (`protocol.md`, "Journal"), so a journal
//! written by another version still reads: what this version does not know is kept as
//! [`Op::Unrecognized`] or [`Resource::Unrecognized`], never dropped.

use crate::grant::ProbeKind;
use crate::validate::{ArchiveName, RunId, Validated, Vmid, VnetName};
use std::fmt;
use std::net::IpAddr;

/// Defines [`Op`] with its wire names and classes in one table, so the three cannot drift.
macro_rules! ops {
    ($($(#[$doc:meta])* $name:ident = $wire:literal, $class:ident;)*) => {
        /// Every operation the connector journals.
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Op {
            $($(#[$doc])* $name,)*
            /// An operation this version does not know (a journal written by a newer one).
            Unrecognized(String),
        }

        impl Op {
            /// Every operation this version journals.
            pub const ALL: &'static [Op] = &[$(Op::$name),*];

            /// The `op` string of the journal.
            pub fn as_str(&self) -> &str {
                match self {
                    $(Op::$name => $wire,)*
                    Op::Unrecognized(op) => op,
                }
            }

            /// Parses a journal `op`; an unknown one stays [`Op::Unrecognized`].
            pub fn parse(op: &str) -> Self {
                match op {
                    $($wire => Op::$name,)*
                    other => Op::Unrecognized(other.to_owned()),
                }
            }

            /// Whether a record of this operation closes the run: nothing is appended after it.
            pub fn closes_run(&self) -> bool {
                matches!(self, Op::RunEnd | Op::RunExpired)
            }

            /// What records of this operation mean to recovery and to the residue check.
            pub fn class(&self) -> OpClass {
                match self {
                    $(Op::$name => OpClass::$class,)*
                    // Unknown: treated as leaving something, so nothing is closed over it.
                    Op::Unrecognized(_) => OpClass::Creates,
                }
            }
        }
    };
}

ops! {
    /// The run's first record.
    RunBegin = "run.begin", Run;
    /// The run ended by `EndRun`; nothing is appended after it.
    RunEnd = "run.end", Run;
    /// The run's deadline passed and the reaper closed it; nothing is appended after it.
    RunExpired = "run.expired", Run;
    /// A cleanup pass over the run: its receipts and residue.
    RunCleanup = "run.cleanup", Run;
    /// A torn tail set aside when the journal was reopened.
    JournalTornTail = "journal.torn-tail", Journal;
    BackupMap = "backup.map", Creates;
    BackupUnmap = "backup.unmap", Undoes;
    OverlayDir = "overlay.dir", Creates;
    OverlayDirDelete = "overlay.dir.delete", Undoes;
    OverlayCreate = "overlay.create", Creates;
    OverlayDelete = "overlay.delete", Undoes;
    FileScreendump = "file.screendump", Creates;
    FileDelete = "file.delete", Undoes;
    VmCreate = "vm.create", Creates;
    VmStart = "vm.start", Acts;
    VmStop = "vm.stop", Acts;
    VmDestroy = "vm.destroy", Undoes;
    /// `qm unlock`: drops the `lock: create` a `qm create` cut short left behind.
    VmUnlock = "vm.unlock", Acts;
    GuestQmp = "guest.qmp", Acts;
    GuestQga = "guest.qga", Acts;
    GuestExec = "guest.exec", Acts;
    /// Guest network recovery: writes only inside an overlay of the run.
    GuestNetworkRecover = "guestnet.recover", WritesInside;
    /// The source VM's configuration, read for the sandbox VM.
    SourceConfig = "source.config", Observes;
    /// The snapshot's manifest (`index.json.blob`), read for the report's subjects.
    SourceManifest = "source.manifest", Observes;
    SandboxNft = "sandbox.nft", Creates;
    SandboxNftDelete = "sandbox.nft.delete", Undoes;
    SandboxAddress = "sandbox.address", Creates;
    SandboxAddressDelete = "sandbox.address.delete", Undoes;
    /// The VNet's forwarding sysctls set to 0 for the run.
    SandboxForwarding = "sandbox.forwarding", Creates;
    SandboxForwardingRestore = "sandbox.forwarding.restore", Undoes;
    ProbeRun = "probe.run", Observes;
}

/// What the records of an operation mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpClass {
    /// About the run itself (begin, end, expiry, cleanup passes): leaves nothing on the node.
    Run,
    /// The journal's own housekeeping: leaves nothing on the node.
    Journal,
    /// Makes something on the node that cleanup must undo; its resource is open until undone.
    Creates,
    /// Undoes what a [`OpClass::Creates`] operation made.
    Undoes,
    /// Acts on something the run made (starts it, stops it, talks to it) without making more.
    Acts,
    /// Writes only inside something the run made: deleting that undoes it, but an interrupted
    /// one may leave its tool running.
    WritesInside,
    /// Reads or measures; leaves nothing on the node.
    Observes,
}

impl OpClass {
    /// Whether records of this class can leave something on the node to undo, so that the
    /// resource they name is tracked.
    pub fn tracks_a_resource(self) -> bool {
        matches!(self, OpClass::Creates | OpClass::Undoes | OpClass::Acts)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for Op {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for Op {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        Ok(Op::parse(&text))
    }
}

impl PartialEq<&Op> for Op {
    fn eq(&self, other: &&Op) -> bool {
        self == *other
    }
}

impl PartialEq<&str> for Op {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// One thing a run's journal names, as its journal key names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Resource {
    /// `run:<run id>`: the run itself.
    Run(RunId),
    /// `journal`: the journal's own file.
    Journal,
    /// `backup:<archive>`: a read-only loop device mapped by `proxmox-backup-client map`.
    Backup(ArchiveName),
    /// `dir:overlays`: the run's directory under the overlay root.
    OverlayDir,
    /// `overlay:<vmid>:<archive>`: a qcow2 overlay on a mapping.
    Overlay { vmid: Vmid, archive: ArchiveName },
    /// `vm:<vmid>`: a sandbox VM.
    Vm(Vmid),
    /// `nft:<table>`: the run's nftables table.
    NftTable(String),
    /// `addr:<vnet>`: the probe address on the VNet.
    ProbeAddress(VnetName),
    /// `fwd:<vnet>`: the VNet's forwarding sysctls, set to 0 for the run
    /// (`sandbox.forwarding = "disable-for-run"`).
    Forwarding(VnetName),
    /// `file:screendump:<vmid>`: a screendump in the run's directory.
    Screendump(Vmid),
    /// `source:qemu-server.conf`: the source VM's configuration in the snapshot, read only.
    SourceConfig,
    /// `source:index.json.blob`: the snapshot's manifest, read only.
    SourceManifest,
    /// `probe:<kind>:<address>:<port>`: a probe of a target; leaves nothing on the node.
    Probe {
        kind: ProbeKind,
        address: IpAddr,
        port: u16,
    },
    /// A key this version does not know (a journal written by a newer one), or a malformed one.
    Unrecognized(String),
}

fn vmid(text: &str) -> Option<Vmid> {
    Vmid::parse("journal", text.parse().ok()?).ok()
}

/// `<kind>:<address>:<port>` of a probe key; an IPv6 address has colons of its own, so the
/// port is what follows the last one.
fn probe(text: &str) -> Option<Resource> {
    let (kind, target) = text.split_once(':')?;
    let (address, port) = target.rsplit_once(':')?;
    let kind = [
        ProbeKind::Tcp,
        ProbeKind::Http,
        ProbeKind::Https,
        ProbeKind::Dns,
        ProbeKind::Ldap,
    ]
    .into_iter()
    .find(|k| k.name() == kind)?;
    Some(Resource::Probe {
        kind,
        address: address.parse().ok()?,
        port: port.parse().ok()?,
    })
}

impl Resource {
    /// Parses a journal key; unknown or malformed keys stay [`Resource::Unrecognized`].
    pub fn parse(key: &str) -> Self {
        let parsed = if let Some(run) = key.strip_prefix("run:") {
            RunId::validate(run).ok().map(Resource::Run)
        } else if key == "journal" {
            Some(Resource::Journal)
        } else if let Some(archive) = key.strip_prefix("backup:") {
            ArchiveName::validate(archive).ok().map(Resource::Backup)
        } else if key == "source:qemu-server.conf" {
            Some(Resource::SourceConfig)
        } else if key == "source:index.json.blob" {
            Some(Resource::SourceManifest)
        } else if key == "dir:overlays" {
            Some(Resource::OverlayDir)
        } else if let Some(rest) = key.strip_prefix("overlay:") {
            rest.split_once(':').and_then(|(v, a)| {
                Some(Resource::Overlay {
                    vmid: vmid(v)?,
                    archive: ArchiveName::validate(a).ok()?,
                })
            })
        } else if let Some(v) = key.strip_prefix("vm:") {
            vmid(v).map(Resource::Vm)
        } else if let Some(table) = key.strip_prefix("nft:") {
            Some(Resource::NftTable(table.to_owned()))
        } else if let Some(vnet) = key.strip_prefix("addr:") {
            VnetName::validate(vnet).ok().map(Resource::ProbeAddress)
        } else if let Some(vnet) = key.strip_prefix("fwd:") {
            VnetName::validate(vnet).ok().map(Resource::Forwarding)
        } else if let Some(v) = key.strip_prefix("file:screendump:") {
            vmid(v).map(Resource::Screendump)
        } else if let Some(rest) = key.strip_prefix("probe:") {
            probe(rest)
        } else {
            None
        };
        // Only a key in the one spelling this version writes is typed: another spelling
        // (`vm:09100`) stays as it was written, so it is carried and compared verbatim.
        parsed
            .filter(|resource| resource.to_string() == key)
            .unwrap_or_else(|| Resource::Unrecognized(key.to_owned()))
    }

    /// The journal key.
    pub fn key(&self) -> String {
        self.to_string()
    }

    /// Whether the resource is something on the node a run can leave behind; the run itself,
    /// its journal, the source config and manifest it read and its probes are not.
    pub fn is_on_the_node(&self) -> bool {
        !matches!(
            self,
            Resource::Run(_)
                | Resource::Journal
                | Resource::SourceConfig
                | Resource::SourceManifest
                | Resource::Probe { .. }
        )
    }

    /// Whether undoing this resource touches the sandbox network.
    pub fn is_network(&self) -> bool {
        matches!(
            self,
            Resource::NftTable(_) | Resource::ProbeAddress(_) | Resource::Forwarding(_)
        )
    }
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Resource::Run(run) => write!(f, "run:{run}"),
            Resource::Journal => f.write_str("journal"),
            Resource::Backup(archive) => write!(f, "backup:{archive}"),
            Resource::OverlayDir => f.write_str("dir:overlays"),
            Resource::SourceConfig => f.write_str("source:qemu-server.conf"),
            Resource::SourceManifest => f.write_str("source:index.json.blob"),
            Resource::Overlay { vmid, archive } => write!(f, "overlay:{vmid}:{archive}"),
            Resource::Vm(vmid) => write!(f, "vm:{vmid}"),
            Resource::NftTable(table) => write!(f, "nft:{table}"),
            Resource::ProbeAddress(vnet) => write!(f, "addr:{vnet}"),
            Resource::Forwarding(vnet) => write!(f, "fwd:{vnet}"),
            Resource::Screendump(vmid) => write!(f, "file:screendump:{vmid}"),
            Resource::Probe {
                kind,
                address,
                port,
            } => write!(f, "probe:{}:{address}:{port}", kind.name()),
            Resource::Unrecognized(key) => f.write_str(key),
        }
    }
}

impl serde::Serialize for Resource {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Resource {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        Ok(Resource::parse(&text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_op_reads_back_as_itself_and_unknown_ones_are_kept() {
        for op in Op::ALL {
            assert_eq!(&Op::parse(op.as_str()), op);
        }
        let names: std::collections::BTreeSet<&str> = Op::ALL.iter().map(Op::as_str).collect();
        assert_eq!(names.len(), Op::ALL.len(), "two operations share a name");
        let newer = Op::parse("vm.snapshot");
        assert_eq!(newer, Op::Unrecognized("vm.snapshot".into()));
        assert_eq!(newer.as_str(), "vm.snapshot");
        assert_eq!(newer.class(), OpClass::Creates);
    }

    #[test]
    fn every_resource_key_reads_back_as_itself() {
        for key in [
            "run:0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f",
            "journal",
            "backup:drive-scsi0.img",
            "dir:overlays",
            "source:qemu-server.conf",
            "source:index.json.blob",
            "overlay:9100:drive-scsi0.img",
            "vm:9100",
            "nft:certistack_0f0e1c2d",
            "addr:csbox1",
            "fwd:csbox1",
            "file:screendump:9100",
            "probe:http:198.51.100.10:80",
            "probe:dns:2001:db8::53:53",
        ] {
            let resource = Resource::parse(key);
            assert!(
                !matches!(resource, Resource::Unrecognized(_)),
                "{key} is not recognized"
            );
            assert_eq!(resource.key(), key);
        }
        for odd in [
            "vm:x",
            "overlay:9100",
            "run:not-a-uuid",
            "addr:",
            "vm",
            "",
            "vm:09100",
            "vm:+9100",
            "probe:http:198.51.100.10:080",
            "probe:dns:2001:DB8:0:0::53:53",
        ] {
            assert_eq!(Resource::parse(odd), Resource::Unrecognized(odd.into()));
            assert_eq!(Resource::parse(odd).key(), odd);
        }
    }
}
