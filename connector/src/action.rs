//! Typed actions: each run RPC's request parsed once into an [`Action`], and the pure function
//! [`authorize`] deciding whether a grant covers it.
//!
//! Parsing checks form (validators; `INVALID_ARGUMENT`); authorization checks scope against the
//! grant (`PERMISSION_DENIED`, naming the object and the rule). Neither has side effects, so a
//! refused request changes nothing.

use crate::policy::Rpc;
use certistack_core::grant::{Grant, NetworkRecoveryMode, ProbeKind, enum_error};
use certistack_core::validate::{
    ArchiveName, AssertionId, FieldError, IpInterface, RunId, Secret, Snapshot, UnicastIp, Vmid,
    VnetName, bounded_count, bytes_field, field, port,
};
use certistack_proto::v1 as pb;
use std::fmt;
use zeroize::Zeroizing;

/// QMP commands the connector may send; `policy/qmp-allowlist.toml` lists the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum QmpCommand {
    QueryStatus,
    QueryBlock,
    SystemPowerdown,
    Screendump,
}

impl QmpCommand {
    pub const ALL: [QmpCommand; 4] = [
        Self::QueryStatus,
        Self::QueryBlock,
        Self::SystemPowerdown,
        Self::Screendump,
    ];

    /// The command name on the QMP wire.
    pub fn wire_name(self) -> &'static str {
        match self {
            Self::QueryStatus => "query-status",
            Self::QueryBlock => "query-block",
            Self::SystemPowerdown => "system_powerdown",
            Self::Screendump => "screendump",
        }
    }

    fn from_wire(value: i32) -> Result<Self, FieldError> {
        match pb::QmpCommand::try_from(value) {
            Ok(pb::QmpCommand::QueryStatus) => Ok(Self::QueryStatus),
            Ok(pb::QmpCommand::QueryBlock) => Ok(Self::QueryBlock),
            Ok(pb::QmpCommand::SystemPowerdown) => Ok(Self::SystemPowerdown),
            Ok(pb::QmpCommand::Screendump) => Ok(Self::Screendump),
            _ => Err(enum_error("QmpRequest.command", "qmp_command", value)),
        }
    }
}

/// Guest-agent commands the connector may send; `policy/qga-allowlist.toml` lists the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum QgaCommand {
    Ping,
    Info,
    GetOsinfo,
    GetHostName,
    NetworkGetInterfaces,
    GetFsinfo,
}

impl QgaCommand {
    pub const ALL: [QgaCommand; 6] = [
        Self::Ping,
        Self::Info,
        Self::GetOsinfo,
        Self::GetHostName,
        Self::NetworkGetInterfaces,
        Self::GetFsinfo,
    ];

    pub fn wire_name(self) -> &'static str {
        match self {
            Self::Ping => "guest-ping",
            Self::Info => "guest-info",
            Self::GetOsinfo => "guest-get-osinfo",
            Self::GetHostName => "guest-get-host-name",
            Self::NetworkGetInterfaces => "guest-network-get-interfaces",
            Self::GetFsinfo => "guest-get-fsinfo",
        }
    }

    fn from_wire(value: i32) -> Result<Self, FieldError> {
        match pb::QgaCommand::try_from(value) {
            Ok(pb::QgaCommand::Ping) => Ok(Self::Ping),
            Ok(pb::QgaCommand::Info) => Ok(Self::Info),
            Ok(pb::QgaCommand::GetOsinfo) => Ok(Self::GetOsinfo),
            Ok(pb::QgaCommand::GetHostName) => Ok(Self::GetHostName),
            Ok(pb::QgaCommand::NetworkGetInterfaces) => Ok(Self::NetworkGetInterfaces),
            Ok(pb::QgaCommand::GetFsinfo) => Ok(Self::GetFsinfo),
            _ => Err(enum_error("QgaRequest.command", "qga_command", value)),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QgaCall {
    Command(QgaCommand),
    Assertion(AssertionId),
}

/// An optional encryption key: never on disk, zeroized on drop, never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct EncryptionKey(pub Zeroizing<Vec<u8>>);

impl fmt::Debug for EncryptionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EncryptionKey(<{} bytes redacted>)", self.0.len())
    }
}

pub const MAX_VM_DISKS: usize = 8;
pub const MAX_STOP_TIMEOUT_SECS: u32 = 600;

/// One validated request of a run (or an operator's journal/cleanup request).
#[derive(Debug, Clone)]
pub enum Action {
    MapBackup {
        snapshot: Snapshot,
        archive: ArchiveName,
        secret: Secret,
        encryption_key: Option<EncryptionKey>,
    },
    UnmapBackup {
        archive: ArchiveName,
    },
    CreateOverlay {
        vmid: Vmid,
        archive: ArchiveName,
    },
    DeleteOverlay {
        vmid: Vmid,
        archive: ArchiveName,
    },
    CreateVm {
        vmid: Vmid,
        cores: u32,
        memory_mib: u32,
        archives: Vec<ArchiveName>,
        /// Attach the archives at their source slots and mirror the source's hardware.
        mirror_source: bool,
    },
    StartVm {
        vmid: Vmid,
    },
    StopVm {
        vmid: Vmid,
        timeout_secs: u32,
    },
    DestroyVm {
        vmid: Vmid,
    },
    VmStatus {
        vmid: Vmid,
    },
    Qmp {
        vmid: Vmid,
        command: QmpCommand,
    },
    Qga {
        vmid: Vmid,
        call: QgaCall,
    },
    PrepareSandbox {
        vnet: VnetName,
        probe_source: IpInterface,
    },
    ReleaseSandbox {
        vnet: VnetName,
    },
    Probe {
        kind: ProbeKind,
        address: UnicastIp,
        port: u16,
    },
    ReadJournal {
        run_id: RunId,
    },
    Cleanup {
        run_id: RunId,
    },
    ReadSourceConfig {
        snapshot: Snapshot,
        secret: Secret,
        encryption_key: Option<EncryptionKey>,
    },
    RecoverGuestNetwork {
        vmid: Vmid,
        archive: ArchiveName,
        mode: NetworkRecoveryMode,
    },
}

impl Action {
    pub fn rpc(&self) -> Rpc {
        match self {
            Action::MapBackup { .. } => Rpc::MapBackup,
            Action::UnmapBackup { .. } => Rpc::UnmapBackup,
            Action::CreateOverlay { .. } => Rpc::CreateOverlay,
            Action::DeleteOverlay { .. } => Rpc::DeleteOverlay,
            Action::CreateVm { .. } => Rpc::CreateVm,
            Action::StartVm { .. } => Rpc::StartVm,
            Action::StopVm { .. } => Rpc::StopVm,
            Action::DestroyVm { .. } => Rpc::DestroyVm,
            Action::VmStatus { .. } => Rpc::VmStatus,
            Action::Qmp { .. } => Rpc::Qmp,
            Action::Qga { .. } => Rpc::Qga,
            Action::PrepareSandbox { .. } => Rpc::PrepareSandbox,
            Action::ReleaseSandbox { .. } => Rpc::ReleaseSandbox,
            Action::Probe { .. } => Rpc::Probe,
            Action::ReadJournal { .. } => Rpc::ReadJournal,
            Action::Cleanup { .. } => Rpc::Cleanup,
            Action::ReadSourceConfig { .. } => Rpc::ReadSourceConfig,
            Action::RecoverGuestNetwork { .. } => Rpc::RecoverGuestNetwork,
        }
    }
}

/// The page of closed runs a ListRuns request asks for: up to `page_size` after `after`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClosedRunsPage {
    pub after: Option<RunId>,
    pub page_size: usize,
}

/// Request → action, one function per RPC.
pub mod parse {
    use super::*;

    fn vmid(name: &'static str, value: u32) -> Result<Vmid, FieldError> {
        Vmid::parse(name, value)
    }

    /// The optional PBS encryption key of a request that reads the backup: at most 16 KiB,
    /// zeroized on drop.
    fn encryption_key(name: &'static str, raw: &[u8]) -> Result<Option<EncryptionKey>, FieldError> {
        let key = bytes_field(name, "encryption_key", raw, 0, 16 * 1024)?;
        Ok((!key.is_empty()).then(|| EncryptionKey(Zeroizing::new(key.to_vec()))))
    }

    pub fn map_backup(req: pb::MapBackupRequest) -> Result<Action, FieldError> {
        Ok(Action::MapBackup {
            snapshot: field("MapBackupRequest.snapshot", &req.snapshot)?,
            archive: field("MapBackupRequest.archive", &req.archive)?,
            secret: field("MapBackupRequest.pbs_secret", &req.pbs_secret)?,
            encryption_key: encryption_key("MapBackupRequest.encryption_key", &req.encryption_key)?,
        })
    }

    pub fn read_source_config(req: pb::ReadSourceConfigRequest) -> Result<Action, FieldError> {
        Ok(Action::ReadSourceConfig {
            snapshot: field("ReadSourceConfigRequest.snapshot", &req.snapshot)?,
            secret: field("ReadSourceConfigRequest.pbs_secret", &req.pbs_secret)?,
            encryption_key: encryption_key(
                "ReadSourceConfigRequest.encryption_key",
                &req.encryption_key,
            )?,
        })
    }

    pub fn unmap_backup(req: pb::UnmapBackupRequest) -> Result<Action, FieldError> {
        Ok(Action::UnmapBackup {
            archive: field("UnmapBackupRequest.archive", &req.archive)?,
        })
    }

    pub fn create_overlay(req: pb::CreateOverlayRequest) -> Result<Action, FieldError> {
        Ok(Action::CreateOverlay {
            vmid: vmid("CreateOverlayRequest.vmid", req.vmid)?,
            archive: field("CreateOverlayRequest.archive", &req.archive)?,
        })
    }

    pub fn delete_overlay(req: pb::DeleteOverlayRequest) -> Result<Action, FieldError> {
        Ok(Action::DeleteOverlay {
            vmid: vmid("DeleteOverlayRequest.vmid", req.vmid)?,
            archive: field("DeleteOverlayRequest.archive", &req.archive)?,
        })
    }

    pub fn create_vm(req: pb::CreateVmRequest) -> Result<Action, FieldError> {
        bounded_count("CreateVmRequest.archives", &req.archives, MAX_VM_DISKS)?;
        let range = |name: &'static str, value: u32, lo: u32, hi: u32| {
            if (lo..=hi).contains(&value) {
                Ok(value)
            } else {
                Err(FieldError {
                    field: name,
                    validator: "range",
                    reason: format!("{value} is outside {lo}..={hi}"),
                })
            }
        };
        let archives: Vec<ArchiveName> = req
            .archives
            .iter()
            .map(|a| field("CreateVmRequest.archives", a))
            .collect::<Result<_, _>>()?;
        if archives.is_empty() {
            return Err(FieldError {
                field: "CreateVmRequest.archives",
                validator: "count",
                reason: "a sandbox VM needs at least one overlay disk".into(),
            });
        }
        Ok(Action::CreateVm {
            vmid: vmid("CreateVmRequest.vmid", req.vmid)?,
            cores: range("CreateVmRequest.cores", req.cores, 1, 64)?,
            memory_mib: range("CreateVmRequest.memory_mib", req.memory_mib, 64, 262_144)?,
            archives,
            mirror_source: req.mirror_source_hardware,
        })
    }

    pub fn start_vm(req: pb::VmRequest) -> Result<Action, FieldError> {
        Ok(Action::StartVm {
            vmid: vmid("VmRequest.vmid", req.vmid)?,
        })
    }

    pub fn destroy_vm(req: pb::VmRequest) -> Result<Action, FieldError> {
        Ok(Action::DestroyVm {
            vmid: vmid("VmRequest.vmid", req.vmid)?,
        })
    }

    pub fn vm_status(req: pb::VmRequest) -> Result<Action, FieldError> {
        Ok(Action::VmStatus {
            vmid: vmid("VmRequest.vmid", req.vmid)?,
        })
    }

    pub fn stop_vm(req: pb::StopVmRequest) -> Result<Action, FieldError> {
        if req.timeout_seconds > MAX_STOP_TIMEOUT_SECS {
            return Err(FieldError {
                field: "StopVmRequest.timeout_seconds",
                validator: "range",
                reason: format!("{} is above {MAX_STOP_TIMEOUT_SECS}", req.timeout_seconds),
            });
        }
        Ok(Action::StopVm {
            vmid: vmid("StopVmRequest.vmid", req.vmid)?,
            timeout_secs: req.timeout_seconds,
        })
    }

    pub fn qmp(req: pb::QmpRequest) -> Result<Action, FieldError> {
        Ok(Action::Qmp {
            vmid: vmid("QmpRequest.vmid", req.vmid)?,
            command: QmpCommand::from_wire(req.command)?,
        })
    }

    pub fn qga(req: pb::QgaRequest) -> Result<Action, FieldError> {
        let call = match req.call {
            Some(pb::qga_request::Call::Command(command)) => {
                QgaCall::Command(QgaCommand::from_wire(command)?)
            }
            Some(pb::qga_request::Call::AssertionId(id)) => {
                QgaCall::Assertion(field("QgaRequest.assertion_id", &id)?)
            }
            None => {
                return Err(FieldError {
                    field: "QgaRequest.call",
                    validator: "oneof",
                    reason: "set either `command` or `assertion_id`".into(),
                });
            }
        };
        Ok(Action::Qga {
            vmid: vmid("QgaRequest.vmid", req.vmid)?,
            call,
        })
    }

    pub fn prepare_sandbox(req: pb::PrepareSandboxRequest) -> Result<Action, FieldError> {
        Ok(Action::PrepareSandbox {
            vnet: field("PrepareSandboxRequest.vnet", &req.vnet)?,
            probe_source: field("PrepareSandboxRequest.probe_source", &req.probe_source)?,
        })
    }

    pub fn release_sandbox(req: pb::ReleaseSandboxRequest) -> Result<Action, FieldError> {
        Ok(Action::ReleaseSandbox {
            vnet: field("ReleaseSandboxRequest.vnet", &req.vnet)?,
        })
    }

    pub fn probe(req: pb::ProbeRequest) -> Result<Action, FieldError> {
        Ok(Action::Probe {
            kind: ProbeKind::from_wire("ProbeRequest.kind", req.kind)?,
            address: field("ProbeRequest.address", &req.address)?,
            port: port("ProbeRequest.port", req.port)?,
        })
    }

    pub fn read_journal(req: pb::ReadJournalRequest) -> Result<Action, FieldError> {
        Ok(Action::ReadJournal {
            run_id: field("ReadJournalRequest.run_id", &req.run_id)?,
        })
    }

    /// Which page of closed runs ListRuns returns.
    pub fn list_runs(req: &pb::ListRunsRequest) -> Result<ClosedRunsPage, FieldError> {
        let page_size = match usize::try_from(req.closed_page_size) {
            Ok(0) => crate::runs::DEFAULT_CLOSED_PAGE,
            Ok(size) if size <= crate::runs::MAX_CLOSED_PAGE => size,
            _ => {
                return Err(FieldError {
                    field: "ListRunsRequest.closed_page_size",
                    validator: "count",
                    reason: format!(
                        "{} closed runs per page, at most {} are allowed (0 asks for {})",
                        req.closed_page_size,
                        crate::runs::MAX_CLOSED_PAGE,
                        crate::runs::DEFAULT_CLOSED_PAGE
                    ),
                });
            }
        };
        // The cursor is the last run id of the previous page: anything else was not returned
        // by ListRuns.
        let after = if req.closed_cursor.is_empty() {
            None
        } else {
            Some(
                field("ListRunsRequest.closed_cursor", &req.closed_cursor).map_err(|error| {
                    FieldError {
                        reason: format!(
                            "is not a cursor ListRuns returned ({}); pass next_closed_cursor as it is, or leave it empty for the first page",
                            error.reason
                        ),
                        ..error
                    }
                })?,
            )
        };
        Ok(ClosedRunsPage { after, page_size })
    }

    pub fn cleanup(req: pb::CleanupRequest) -> Result<Action, FieldError> {
        Ok(Action::Cleanup {
            run_id: field("CleanupRequest.run_id", &req.run_id)?,
        })
    }

    pub fn recover_guest_network(
        req: pb::RecoverGuestNetworkRequest,
    ) -> Result<Action, FieldError> {
        Ok(Action::RecoverGuestNetwork {
            vmid: vmid("RecoverGuestNetworkRequest.vmid", req.vmid)?,
            archive: field("RecoverGuestNetworkRequest.archive", &req.archive)?,
            mode: NetworkRecoveryMode::from_wire("RecoverGuestNetworkRequest.mode", req.mode)?,
        })
    }

    /// The VNet NodeChecks is asked about, if any: an empty name asks only node-wide facts.
    pub fn node_checks(req: &pb::NodeChecksRequest) -> Result<Option<VnetName>, FieldError> {
        if req.vnet.is_empty() {
            return Ok(None);
        }
        field("NodeChecksRequest.vnet", &req.vnet).map(Some)
    }

    /// The appliance boot NodeChecks is asked for, if any: zero asks for none.
    pub fn appliance_boot(req: &pb::NodeChecksRequest) -> Option<std::time::Duration> {
        (req.boot_appliance_within_secs > 0)
            .then(|| std::time::Duration::from_secs(u64::from(req.boot_appliance_within_secs)))
    }
}

/// Why a grant does not cover an action: the object and the rule, for the caller and the log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{object} is not granted to run {run_id} (rule {rule}: {explanation})")]
pub struct Denial {
    pub run_id: String,
    pub object: String,
    pub rule: &'static str,
    pub explanation: String,
}

/// Decides whether `grant` covers `action`. Pure: no I/O, no clock, no state.
pub fn authorize(grant: &Grant, action: &Action) -> Result<(), Denial> {
    let rule = action.rpc().rule();
    let deny = |object: String, explanation: &str| Denial {
        run_id: grant.run_id.to_string(),
        object,
        rule,
        explanation: explanation.to_owned(),
    };
    let archive_ok = |archive: &ArchiveName| {
        if grant.archives.contains(archive) {
            Ok(())
        } else {
            Err(deny(
                format!("archive {archive}"),
                "the run may touch only the grant's archives",
            ))
        }
    };
    let vmid_ok = |vmid: &Vmid| {
        if grant.sandbox_vms.contains_key(vmid) {
            Ok(())
        } else {
            Err(deny(
                format!("VMID {vmid}"),
                "the run may touch only the grant's sandbox VMIDs",
            ))
        }
    };
    let vnet_ok = |vnet: &VnetName| {
        if vnet == &grant.vnet {
            Ok(())
        } else {
            Err(deny(
                format!("VNet {vnet}"),
                "the run may use only the grant's VNet",
            ))
        }
    };
    match action {
        Action::MapBackup {
            snapshot, archive, ..
        } => {
            if snapshot != &grant.snapshot {
                return Err(deny(
                    format!("snapshot {snapshot}"),
                    "the run may map only the grant's snapshot",
                ));
            }
            archive_ok(archive)
        }
        Action::ReadSourceConfig { snapshot, .. } => {
            if snapshot != &grant.snapshot {
                return Err(deny(
                    format!("snapshot {snapshot}"),
                    "the run may read only the grant's snapshot",
                ));
            }
            Ok(())
        }
        Action::UnmapBackup { archive } => archive_ok(archive),
        Action::CreateOverlay { vmid, archive } | Action::DeleteOverlay { vmid, archive } => {
            vmid_ok(vmid)?;
            archive_ok(archive)
        }
        Action::CreateVm {
            vmid,
            cores,
            memory_mib,
            archives,
            ..
        } => {
            vmid_ok(vmid)?;
            let limits = grant
                .sandbox_vms
                .get(vmid)
                .copied()
                .ok_or_else(|| deny(format!("VMID {vmid}"), "no limits"))?;
            if *cores > limits.max_cores {
                return Err(deny(
                    format!("{cores} cores for VM {vmid}"),
                    &format!("the grant allows at most {}", limits.max_cores),
                ));
            }
            if *memory_mib > limits.max_memory_mib {
                return Err(deny(
                    format!("{memory_mib} MiB for VM {vmid}"),
                    &format!("the grant allows at most {} MiB", limits.max_memory_mib),
                ));
            }
            archives.iter().try_for_each(archive_ok)
        }
        Action::StartVm { vmid }
        | Action::StopVm { vmid, .. }
        | Action::DestroyVm { vmid }
        | Action::VmStatus { vmid }
        | Action::Qmp { vmid, .. } => vmid_ok(vmid),
        Action::Qga { vmid, call } => {
            vmid_ok(vmid)?;
            match call {
                QgaCall::Command(_) => Ok(()),
                QgaCall::Assertion(id) if grant.qga_assertions.contains_key(id) => Ok(()),
                QgaCall::Assertion(id) => Err(deny(
                    format!("QGA assertion {id}"),
                    "the run may execute only the grant's assertions",
                )),
            }
        }
        Action::PrepareSandbox { vnet, probe_source } => {
            vnet_ok(vnet)?;
            if probe_source != &grant.probe_source {
                return Err(deny(
                    format!("probe source {probe_source}"),
                    "the run may add only the grant's probe address",
                ));
            }
            Ok(())
        }
        Action::ReleaseSandbox { vnet } => vnet_ok(vnet),
        Action::Probe {
            kind,
            address,
            port,
        } => {
            if grant
                .probe_targets
                .iter()
                .any(|t| t.kind == *kind && t.address == *address && t.port == *port)
            {
                Ok(())
            } else {
                Err(deny(
                    format!("{} probe of {address}:{port}", kind.name()),
                    "the run may probe only the grant's targets",
                ))
            }
        }
        Action::RecoverGuestNetwork {
            vmid,
            archive,
            mode,
        } => {
            vmid_ok(vmid)?;
            archive_ok(archive)?;
            if grant.network_recovery_modes.contains(mode) {
                Ok(())
            } else {
                Err(deny(
                    format!("network recovery mode {}", mode.name()),
                    "the run may recover a guest's network only in a mode the grant allows",
                ))
            }
        }
        Action::ReadJournal { run_id } | Action::Cleanup { run_id } => {
            if run_id == &grant.run_id {
                Ok(())
            } else {
                Err(deny(
                    format!("run {run_id}"),
                    "a run may read and clean up only itself",
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use certistack_core::fixtures::{RUN, full_wire_grant, sign};
    use certistack_core::validate::Validated;
    use ed25519_dalek::SigningKey;

    fn grant() -> Grant {
        let key = SigningKey::from_bytes(&[1; 32]);
        certistack_core::grant::verify(&sign(&key, &full_wire_grant()), &key.verifying_key())
            .unwrap()
    }

    fn v<T: Validated>(s: &str) -> T {
        T::validate(s).unwrap()
    }

    fn vm(id: u32) -> Vmid {
        Vmid::parse("t", id).unwrap()
    }

    const OTHER_RUN: &str = "11111111-2222-4333-8444-555555555555";

    /// For every action: one request inside the grant, and every way of stepping outside it.
    fn cases() -> Vec<(Action, Option<&'static str>)> {
        let secret: Secret = v("pw");
        let in_archive: ArchiveName = v("drive-scsi0.img");
        let out_archive: ArchiveName = v("drive-scsi9.img");
        let snap: Snapshot = v("vm/100/2026-11-01T02:00:00Z");
        let other_snap: Snapshot = v("vm/100/2026-10-01T02:00:00Z");
        vec![
            (
                Action::MapBackup {
                    snapshot: snap.clone(),
                    archive: in_archive.clone(),
                    secret: secret.clone(),
                    encryption_key: None,
                },
                None,
            ),
            (
                Action::MapBackup {
                    snapshot: other_snap,
                    archive: in_archive.clone(),
                    secret: secret.clone(),
                    encryption_key: None,
                },
                Some("snapshot vm/100/2026-10-01T02:00:00Z"),
            ),
            (
                Action::MapBackup {
                    snapshot: snap,
                    archive: out_archive.clone(),
                    secret,
                    encryption_key: None,
                },
                Some("archive drive-scsi9.img"),
            ),
            (
                Action::ReadSourceConfig {
                    snapshot: v("vm/100/2026-11-01T02:00:00Z"),
                    secret: v("pw"),
                    encryption_key: None,
                },
                None,
            ),
            (
                Action::ReadSourceConfig {
                    snapshot: v("vm/100/2026-10-01T02:00:00Z"),
                    secret: v("pw"),
                    encryption_key: None,
                },
                Some("snapshot vm/100/2026-10-01T02:00:00Z"),
            ),
            (
                Action::UnmapBackup {
                    archive: in_archive.clone(),
                },
                None,
            ),
            (
                Action::UnmapBackup {
                    archive: out_archive.clone(),
                },
                Some("archive drive-scsi9.img"),
            ),
            (
                Action::CreateOverlay {
                    vmid: vm(9100),
                    archive: in_archive.clone(),
                },
                None,
            ),
            (
                Action::CreateOverlay {
                    vmid: vm(100),
                    archive: in_archive.clone(),
                },
                Some("VMID 100"),
            ),
            (
                Action::CreateOverlay {
                    vmid: vm(9100),
                    archive: out_archive.clone(),
                },
                Some("archive drive-scsi9.img"),
            ),
            (
                Action::DeleteOverlay {
                    vmid: vm(9100),
                    archive: in_archive.clone(),
                },
                None,
            ),
            (
                Action::DeleteOverlay {
                    vmid: vm(9101),
                    archive: in_archive.clone(),
                },
                Some("VMID 9101"),
            ),
            (
                Action::CreateVm {
                    vmid: vm(9100),
                    cores: 2,
                    memory_mib: 2048,
                    archives: vec![in_archive.clone()],
                    mirror_source: false,
                },
                None,
            ),
            (
                Action::CreateVm {
                    vmid: vm(100),
                    cores: 1,
                    memory_mib: 512,
                    archives: vec![in_archive.clone()],
                    mirror_source: false,
                },
                Some("VMID 100"),
            ),
            (
                Action::CreateVm {
                    vmid: vm(9100),
                    cores: 3,
                    memory_mib: 512,
                    archives: vec![in_archive.clone()],
                    mirror_source: false,
                },
                Some("3 cores for VM 9100"),
            ),
            (
                Action::CreateVm {
                    vmid: vm(9100),
                    cores: 1,
                    memory_mib: 4096,
                    archives: vec![in_archive.clone()],
                    mirror_source: false,
                },
                Some("4096 MiB for VM 9100"),
            ),
            (
                Action::CreateVm {
                    vmid: vm(9100),
                    cores: 1,
                    memory_mib: 512,
                    archives: vec![in_archive, out_archive],
                    mirror_source: false,
                },
                Some("archive drive-scsi9.img"),
            ),
            (Action::StartVm { vmid: vm(9100) }, None),
            (Action::StartVm { vmid: vm(100) }, Some("VMID 100")),
            (
                Action::StopVm {
                    vmid: vm(9100),
                    timeout_secs: 0,
                },
                None,
            ),
            (
                Action::StopVm {
                    vmid: vm(100),
                    timeout_secs: 0,
                },
                Some("VMID 100"),
            ),
            (Action::DestroyVm { vmid: vm(9100) }, None),
            (Action::DestroyVm { vmid: vm(101) }, Some("VMID 101")),
            (Action::VmStatus { vmid: vm(9100) }, None),
            (Action::VmStatus { vmid: vm(102) }, Some("VMID 102")),
            (
                Action::Qmp {
                    vmid: vm(9100),
                    command: QmpCommand::QueryStatus,
                },
                None,
            ),
            (
                Action::Qmp {
                    vmid: vm(103),
                    command: QmpCommand::QueryStatus,
                },
                Some("VMID 103"),
            ),
            (
                Action::Qga {
                    vmid: vm(9100),
                    call: QgaCall::Command(QgaCommand::Ping),
                },
                None,
            ),
            (
                Action::Qga {
                    vmid: vm(9100),
                    call: QgaCall::Assertion(v("nginx-active")),
                },
                None,
            ),
            (
                Action::Qga {
                    vmid: vm(9100),
                    call: QgaCall::Assertion(v("rm-rf")),
                },
                Some("QGA assertion rm-rf"),
            ),
            (
                Action::Qga {
                    vmid: vm(104),
                    call: QgaCall::Command(QgaCommand::Ping),
                },
                Some("VMID 104"),
            ),
            (
                Action::PrepareSandbox {
                    vnet: v("csbox1"),
                    probe_source: v("198.51.100.2/24"),
                },
                None,
            ),
            (
                Action::PrepareSandbox {
                    vnet: v("vmbr0"),
                    probe_source: v("198.51.100.2/24"),
                },
                Some("VNet vmbr0"),
            ),
            (
                Action::PrepareSandbox {
                    vnet: v("csbox1"),
                    probe_source: v("198.51.100.3/24"),
                },
                Some("probe source 198.51.100.3/24"),
            ),
            (Action::ReleaseSandbox { vnet: v("csbox1") }, None),
            (
                Action::ReleaseSandbox { vnet: v("vmbr0") },
                Some("VNet vmbr0"),
            ),
            (
                Action::Probe {
                    kind: ProbeKind::Http,
                    address: v("198.51.100.10"),
                    port: 80,
                },
                None,
            ),
            (
                Action::Probe {
                    kind: ProbeKind::Tcp,
                    address: v("198.51.100.10"),
                    port: 80,
                },
                Some("tcp probe of 198.51.100.10:80"),
            ),
            (
                Action::Probe {
                    kind: ProbeKind::Http,
                    address: v("198.51.100.11"),
                    port: 80,
                },
                Some("http probe of 198.51.100.11:80"),
            ),
            (
                Action::Probe {
                    kind: ProbeKind::Http,
                    address: v("198.51.100.10"),
                    port: 8080,
                },
                Some("http probe of 198.51.100.10:8080"),
            ),
            (
                Action::RecoverGuestNetwork {
                    vmid: vm(9100),
                    archive: v("drive-scsi0.img"),
                    mode: NetworkRecoveryMode::Rewrite,
                },
                None,
            ),
            (
                Action::RecoverGuestNetwork {
                    vmid: vm(9100),
                    archive: v("drive-scsi0.img"),
                    mode: NetworkRecoveryMode::Preserve,
                },
                Some("network recovery mode preserve"),
            ),
            (
                Action::RecoverGuestNetwork {
                    vmid: vm(9101),
                    archive: v("drive-scsi0.img"),
                    mode: NetworkRecoveryMode::Rewrite,
                },
                Some("VMID 9101"),
            ),
            (
                Action::RecoverGuestNetwork {
                    vmid: vm(9100),
                    archive: v("drive-scsi9.img"),
                    mode: NetworkRecoveryMode::Rewrite,
                },
                Some("archive drive-scsi9.img"),
            ),
            (Action::ReadJournal { run_id: v(RUN) }, None),
            (
                Action::ReadJournal {
                    run_id: v(OTHER_RUN),
                },
                Some("run 11111111-2222-4333-8444-555555555555"),
            ),
            (Action::Cleanup { run_id: v(RUN) }, None),
            (
                Action::Cleanup {
                    run_id: v(OTHER_RUN),
                },
                Some("run 11111111-2222-4333-8444-555555555555"),
            ),
        ]
    }

    #[test]
    fn authorize_is_exact() {
        let grant = grant();
        let mut covered = std::collections::BTreeSet::new();
        for (action, denied_object) in cases() {
            covered.insert(action.rpc());
            match (authorize(&grant, &action), denied_object) {
                (Ok(()), None) => {}
                (Err(denial), Some(object)) => {
                    assert_eq!(denial.object, object, "{action:?}");
                    assert_eq!(denial.rule, action.rpc().rule());
                    assert_eq!(denial.run_id, RUN);
                    let message = denial.to_string();
                    assert!(
                        message.contains(object) && message.contains(denial.rule),
                        "{message}"
                    );
                }
                (result, expected) => {
                    panic!("{action:?}: got {result:?}, expected denial of {expected:?}")
                }
            }
        }
        // Every run RPC with an action has at least one allowed and one denied case above.
        let actionable = Rpc::ALL.len()
            - [
                Rpc::Hello,
                Rpc::BeginRun,
                Rpc::EndRun,
                Rpc::ListRuns,
                Rpc::NodeChecks,
            ]
            .len();
        assert_eq!(covered.len(), actionable);
    }

    #[test]
    fn every_action_names_one_of_the_reported_capabilities() {
        use crate::executor::{CAPABILITIES, capability};
        let named: std::collections::BTreeSet<&str> =
            cases().iter().map(|(a, _)| capability(a)).collect();
        let reported: std::collections::BTreeSet<&str> = CAPABILITIES.into_iter().collect();
        assert_eq!(named, reported);
    }

    /// Requests that set every field, so the validator-usage test sees them all.
    fn full_requests() -> Vec<Result<Action, FieldError>> {
        vec![
            parse::map_backup(pb::MapBackupRequest {
                snapshot: "vm/100/2026-11-01T02:00:00Z".into(),
                archive: "drive-scsi0.img".into(),
                pbs_secret: "pw".into(),
                encryption_key: b"{}".to_vec(),
            }),
            parse::unmap_backup(pb::UnmapBackupRequest {
                archive: "drive-scsi0.img".into(),
            }),
            parse::create_overlay(pb::CreateOverlayRequest {
                vmid: 9100,
                archive: "drive-scsi0.img".into(),
            }),
            parse::delete_overlay(pb::DeleteOverlayRequest {
                vmid: 9100,
                archive: "drive-scsi0.img".into(),
            }),
            parse::create_vm(pb::CreateVmRequest {
                vmid: 9100,
                cores: 1,
                memory_mib: 512,
                archives: vec!["drive-scsi0.img".into()],
                mirror_source_hardware: true,
            }),
            parse::read_source_config(pb::ReadSourceConfigRequest {
                snapshot: "vm/100/2026-11-01T02:00:00Z".into(),
                pbs_secret: "pw".into(),
                encryption_key: b"{}".to_vec(),
            }),
            parse::start_vm(pb::VmRequest { vmid: 9100 }),
            parse::stop_vm(pb::StopVmRequest {
                vmid: 9100,
                timeout_seconds: 30,
            }),
            parse::destroy_vm(pb::VmRequest { vmid: 9100 }),
            parse::vm_status(pb::VmRequest { vmid: 9100 }),
            parse::qmp(pb::QmpRequest {
                vmid: 9100,
                command: pb::QmpCommand::QueryStatus as i32,
            }),
            parse::qga(pb::QgaRequest {
                vmid: 9100,
                call: Some(pb::qga_request::Call::AssertionId("nginx-active".into())),
            }),
            parse::prepare_sandbox(pb::PrepareSandboxRequest {
                vnet: "csbox1".into(),
                probe_source: "198.51.100.2/24".into(),
            }),
            parse::release_sandbox(pb::ReleaseSandboxRequest {
                vnet: "csbox1".into(),
            }),
            parse::probe(pb::ProbeRequest {
                kind: pb::ProbeKind::Tcp as i32,
                address: "198.51.100.10".into(),
                port: 22,
            }),
            parse::read_journal(pb::ReadJournalRequest { run_id: RUN.into() }),
            parse::cleanup(pb::CleanupRequest { run_id: RUN.into() }),
            parse::recover_guest_network(pb::RecoverGuestNetworkRequest {
                vmid: 9100,
                archive: "drive-scsi0.img".into(),
                mode: pb::NetworkRecoveryMode::Rewrite as i32,
            }),
        ]
    }

    #[derive(serde::Deserialize)]
    struct FieldPolicy {
        fields: std::collections::BTreeMap<String, String>,
    }

    /// The parse layer applies exactly the validators `policy/field-validators.toml` declares.
    #[test]
    fn parse_layer_applies_the_declared_validators() {
        certistack_core::validate::usage::take();
        for request in full_requests() {
            request.unwrap();
        }
        parse::node_checks(&pb::NodeChecksRequest {
            vnet: "csbox1".into(),
            ..Default::default()
        })
        .unwrap();
        parse::list_runs(&pb::ListRunsRequest {
            closed_page_size: 10,
            closed_cursor: RUN.into(),
        })
        .unwrap();
        let key = SigningKey::from_bytes(&[1; 32]);
        certistack_core::grant::verify(&sign(&key, &full_wire_grant()), &key.verifying_key())
            .unwrap();
        let used: std::collections::BTreeMap<String, String> =
            certistack_core::validate::usage::take()
                .into_iter()
                .map(|(f, v)| (format!("certistack.connector.v1.{f}"), v.to_owned()))
                .collect();
        let declared: FieldPolicy =
            toml::from_str(include_str!("../../policy/field-validators.toml")).unwrap();
        assert_eq!(used, declared.fields);
    }

    #[test]
    fn a_list_runs_page_is_bounded_and_its_cursor_is_a_run_id() {
        let page = |closed_page_size: u32, cursor: &str| {
            parse::list_runs(&pb::ListRunsRequest {
                closed_page_size,
                closed_cursor: cursor.into(),
            })
        };
        assert_eq!(
            page(0, "").unwrap(),
            ClosedRunsPage {
                after: None,
                page_size: crate::runs::DEFAULT_CLOSED_PAGE
            }
        );
        let last = page(1000, RUN).unwrap();
        assert_eq!((last.after.unwrap().as_str(), last.page_size), (RUN, 1000));
        let too_many = page(1001, "").unwrap_err();
        assert_eq!(too_many.field, "ListRunsRequest.closed_page_size");
        assert!(too_many.to_string().contains("at most 1000"), "{too_many}");
        let not_a_cursor = page(10, "../../etc").unwrap_err();
        assert_eq!(not_a_cursor.field, "ListRunsRequest.closed_cursor");
        assert!(
            not_a_cursor
                .to_string()
                .contains("not a cursor ListRuns returned"),
            "{not_a_cursor}"
        );
    }

    #[test]
    fn malformed_requests_name_the_field() {
        let err = parse::map_backup(pb::MapBackupRequest {
            snapshot: "vm/100".into(),
            archive: "drive-scsi0.img".into(),
            pbs_secret: "pw".into(),
            encryption_key: vec![],
        })
        .unwrap_err();
        assert_eq!(err.field, "MapBackupRequest.snapshot");
        let err = parse::unmap_backup(pb::UnmapBackupRequest {
            archive: "../../etc/passwd.img".into(),
        })
        .unwrap_err();
        assert_eq!(err.field, "UnmapBackupRequest.archive");
        let err = parse::start_vm(pb::VmRequest { vmid: 0 }).unwrap_err();
        assert_eq!((err.field, err.validator), ("VmRequest.vmid", "vmid"));
        let err = parse::qmp(pb::QmpRequest {
            vmid: 9100,
            command: 0,
        })
        .unwrap_err();
        assert_eq!(err.field, "QmpRequest.command");
        let err = parse::qmp(pb::QmpRequest {
            vmid: 9100,
            command: 99,
        })
        .unwrap_err();
        assert_eq!(err.field, "QmpRequest.command");
        let err = parse::qga(pb::QgaRequest {
            vmid: 9100,
            call: None,
        })
        .unwrap_err();
        assert_eq!(err.field, "QgaRequest.call");
        let err = parse::create_vm(pb::CreateVmRequest {
            vmid: 9100,
            cores: 1,
            memory_mib: 512,
            archives: vec!["d.img".into(); 9],
            mirror_source_hardware: false,
        })
        .unwrap_err();
        assert_eq!(err.validator, "count");
        let err = parse::stop_vm(pb::StopVmRequest {
            vmid: 9100,
            timeout_seconds: 601,
        })
        .unwrap_err();
        assert_eq!(err.field, "StopVmRequest.timeout_seconds");
        let err = parse::probe(pb::ProbeRequest {
            kind: 1,
            address: "198.51.100.10".into(),
            port: 70000,
        })
        .unwrap_err();
        assert_eq!(err.field, "ProbeRequest.port");
        let err = parse::node_checks(&pb::NodeChecksRequest {
            vnet: "../eth0".into(),
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(
            (err.field, err.validator),
            ("NodeChecksRequest.vnet", "vnet")
        );
        assert_eq!(
            parse::node_checks(&pb::NodeChecksRequest::default()).unwrap(),
            None
        );
        assert_eq!(
            parse::appliance_boot(&pb::NodeChecksRequest::default()),
            None
        );
        assert_eq!(
            parse::appliance_boot(&pb::NodeChecksRequest {
                boot_appliance_within_secs: 90,
                ..Default::default()
            }),
            Some(std::time::Duration::from_secs(90))
        );
    }

    #[test]
    fn allowlists_match_policy() {
        #[derive(serde::Deserialize)]
        struct Entry {
            command: String,
            why: String,
        }
        #[derive(serde::Deserialize)]
        struct Allowlist {
            allow: Vec<Entry>,
        }
        let qmp: Allowlist =
            toml::from_str(include_str!("../../policy/qmp-allowlist.toml")).unwrap();
        let qga: Allowlist =
            toml::from_str(include_str!("../../policy/qga-allowlist.toml")).unwrap();
        assert!(
            qmp.allow
                .iter()
                .chain(&qga.allow)
                .all(|e| !e.why.trim().is_empty())
        );
        let names = |list: &Allowlist| {
            list.allow
                .iter()
                .map(|e| e.command.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            names(&qmp),
            QmpCommand::ALL.map(|c| c.wire_name().to_owned())
        );
        assert_eq!(
            names(&qga),
            QgaCommand::ALL.map(|c| c.wire_name().to_owned())
        );
    }
}
