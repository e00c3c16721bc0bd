//! Sandbox VMs through `qm`, and the run marker that proves a VM is this run's.
//!
//! `CreateVm` refuses a VMID that already has a config (and treats qm's "already exists" as a
//! refusal, never as success), and creates the VM with tag `certistack`, description
//! `certistack-run=<run id>` and a fresh SMBIOS UUID that the journal records. Before start,
//! stop and destroy, and before cleanup undoes anything, the VM config is re-read: only a VM
//! carrying this run's description, tag and journaled SMBIOS UUID is ever touched.

use super::{NodeExecutor, resources, tool_detail, tool_error, tool_result};
use crate::executor::{ExecError, Outcome};
use crate::grant::Grant;
use crate::journal::Phase;
use crate::process::{self, ToolCall};
use crate::runs::{RunGuard, RunHandle};
use crate::validate::{ArchiveName, Vmid};
use certistack_proto::v1 as pb;
use serde_json::json;
use std::collections::BTreeMap;

pub const TAG: &str = "certistack";
/// Shares below the default (1024), so sandboxes yield to production VMs under contention.
const CPU_UNITS: u32 = 100;

pub fn marker(run_id: &str) -> String {
    format!("certistack-run={run_id}")
}

/// What the node's VM config says about a VMID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ownership {
    Absent,
    Ours,
    NotOurs(String),
    /// The config could not be read: neither ours nor gone, so nothing may be decided.
    Unknown(String),
}

/// PVE's config: `#` lines (percent-encoded) are the description, then `key: value` lines;
/// sections (`[snapshot]`) end the main part.
pub fn parse_config(text: &str) -> (String, BTreeMap<String, String>) {
    let mut description = Vec::new();
    let mut keys = BTreeMap::new();
    for line in text.lines() {
        if line.starts_with('[') {
            break;
        }
        if let Some(comment) = line.strip_prefix('#') {
            description.push(percent_decode(comment));
        } else if let Some((key, value)) = line.split_once(':') {
            keys.insert(key.trim().to_owned(), value.trim().to_owned());
        }
    }
    (description.join("\n"), keys)
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%'
            && let Some(hex) = text.get(i + 1..i + 3)
            && let Ok(value) = u8::from_str_radix(hex, 16)
        {
            out.push(value);
            i += 3;
            continue;
        }
        out.push(b);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl NodeExecutor {
    fn vm_config_path(&self, vmid: Vmid) -> std::path::PathBuf {
        self.config.pve.vm_config_dir.join(format!("{vmid}.conf"))
    }

    /// Reads the VM's config and decides whether it is the VM this run created.
    pub(super) fn ownership(
        &self,
        grant: &Grant,
        vmid: Vmid,
        smbios_uuid: Option<&str>,
    ) -> Ownership {
        let text = match std::fs::read_to_string(self.vm_config_path(vmid)) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ownership::Absent,
            Err(e) => return Ownership::Unknown(format!("its config cannot be read: {e}")),
        };
        let (description, keys) = parse_config(&text);
        if !description
            .lines()
            .any(|l| l.trim() == marker(grant.run_id.as_str()))
        {
            return Ownership::NotOurs("its description does not carry this run's marker".into());
        }
        if !keys
            .get("tags")
            .is_some_and(|t| t.split([';', ',', ' ']).any(|tag| tag == TAG))
        {
            return Ownership::NotOurs(format!("it is not tagged {TAG}"));
        }
        if let Some(expected) = smbios_uuid {
            let uuid = keys
                .get("smbios1")
                .and_then(|s| s.split(',').find_map(|p| p.strip_prefix("uuid=")))
                .unwrap_or_default();
            if !uuid.eq_ignore_ascii_case(expected) {
                return Ownership::NotOurs(format!(
                    "its SMBIOS UUID {uuid:?} is not the {expected} this run created"
                ));
            }
        }
        Ownership::Ours
    }

    fn created_uuid(state: Option<&resources::ResourceState>) -> Option<String> {
        state?
            .history
            .iter()
            .rev()
            .find(|r| r.entry.op == "vm.create")?
            .entry
            .detail
            .get("smbios_uuid")?
            .as_str()
            .map(str::to_owned)
    }

    /// The VM must be one this run created and still carry its marker.
    pub(super) fn require_ours(
        &self,
        guard: &RunGuard<'_>,
        grant: &Grant,
        vmid: Vmid,
    ) -> Result<String, ExecError> {
        let states = resources::states(&guard.records());
        let state = states.get(&format!("vm:{vmid}")).filter(|s| s.is_open());
        let Some(uuid) = Self::created_uuid(state) else {
            return Err(ExecError::FailedPrecondition(format!(
                "VM {vmid} was not created by this run"
            )));
        };
        match self.ownership(grant, vmid, Some(&uuid)) {
            Ownership::Ours => Ok(uuid),
            Ownership::Absent => Err(ExecError::NotFound(format!("VM {vmid} no longer exists"))),
            Ownership::Unknown(reason) => Err(ExecError::Failed(format!("VM {vmid}: {reason}"))),
            Ownership::NotOurs(reason) => Err(ExecError::FailedPrecondition(format!(
                "VM {vmid} is not this run's ({reason}); it is never touched"
            ))),
        }
    }

    /// A `qm` call. `qm stop --timeout N` may legitimately take N seconds before it kills the
    /// guest, so it gets that much more than the tool timeout.
    fn qm_call(&self, args: &[String]) -> ToolCall {
        let stop_secs = args
            .iter()
            .position(|a| a == "--timeout")
            .and_then(|i| args.get(i + 1))
            .and_then(|t| t.parse::<u64>().ok())
            .unwrap_or(0);
        let timeout = self
            .tool_timeout()
            .max(std::time::Duration::from_secs(stop_secs + 30));
        args.iter().fold(
            ToolCall::new(&self.config.tools.qm, timeout),
            |call, arg| call.arg(arg),
        )
    }

    /// A `qm` call that is not a journaled step (reading the status).
    async fn qm(&self, args: &[String]) -> Result<process::ToolOutput, ExecError> {
        process::run(self.qm_call(args)).await.map_err(tool_error)
    }

    /// `qm start|stop|destroy <vmid>`, journaled: `intent`, then `failed`, or `done` (`undone`
    /// for destroy, which ends the VM resource).
    async fn journaled_qm(
        &self,
        guard: &mut RunGuard<'_>,
        vmid: Vmid,
        verb: &'static str,
        timeout_secs: u32,
    ) -> Result<process::ToolOutput, ExecError> {
        let resource = format!("vm:{vmid}");
        let mut args = vec![verb.to_owned(), vmid.to_string()];
        match verb {
            "stop" if timeout_secs > 0 => {
                args.extend(["--timeout".into(), timeout_secs.to_string()])
            }
            "destroy" => args.extend(["--purge".into(), "1".into()]),
            _ => {}
        }
        let op = format!("vm.{verb}");
        guard
            .append(
                self.now_ms(),
                &op,
                &resource,
                Phase::Intent,
                json!({ "argv": args }),
            )
            .await?;
        let output = self
            .run_step(guard, &op, &resource, self.qm_call(&args))
            .await?;
        if !output.success() {
            guard
                .append(
                    self.now_ms(),
                    &op,
                    &resource,
                    Phase::Failed,
                    tool_detail(&output, &[]),
                )
                .await?;
            return Err(ExecError::FailedPrecondition(format!(
                "qm {verb} {vmid} failed (exit {:?}): {}",
                output.exit_code,
                output.stderr_excerpt()
            )));
        }
        let phase = if verb == "destroy" {
            Phase::Undone
        } else {
            Phase::Done
        };
        guard
            .append(
                self.now_ms(),
                &op,
                &resource,
                phase,
                tool_detail(&output, &[]),
            )
            .await?;
        Ok(output)
    }

    pub(super) async fn create_vm(
        &self,
        run: &RunHandle,
        vmid: Vmid,
        cores: u32,
        memory_mib: u32,
        archives: Vec<ArchiveName>,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.lock_open(run).await?;
        let states = resources::states(&guard.records());
        let resource = format!("vm:{vmid}");
        if states.get(&resource).is_some_and(|s| s.is_open()) {
            return Err(ExecError::AlreadyExists(format!(
                "this run already created VM {vmid}"
            )));
        }
        if self.vm_config_path(vmid).exists() {
            return Err(ExecError::AlreadyExists(format!(
                "VM {vmid} already exists on this node and is not this run's; it is left untouched (grant another VMID)"
            )));
        }
        let mut disks = Vec::new();
        for (slot, archive) in archives.iter().enumerate() {
            let key = format!("overlay:{vmid}:{archive}");
            if !states
                .get(&key)
                .is_some_and(|s| s.is_open() && s.last.entry.phase == Phase::Done)
            {
                return Err(ExecError::FailedPrecondition(format!(
                    "VM {vmid} has no overlay of {archive}; call CreateOverlay first"
                )));
            }
            let path = self.overlay_path(grant, vmid, archive);
            disks.push((
                format!("--scsi{slot}"),
                format!("{},format=qcow2,backup=0", path.display()),
            ));
        }
        let smbios_uuid = uuid::Uuid::new_v4().to_string();
        let mut args: Vec<String> = vec!["create".into(), vmid.to_string()];
        let mut push = |k: &str, v: String| {
            args.push(k.to_owned());
            args.push(v);
        };
        push("--name", format!("certistack-{vmid}"));
        push("--memory", memory_mib.to_string());
        push("--cores", cores.to_string());
        push("--scsihw", "virtio-scsi-pci".into());
        for (key, value) in disks {
            push(&key, value);
        }
        push("--ide2", "none,media=cdrom".into());
        push("--agent", "1".into());
        push("--net0", format!("virtio,bridge={},firewall=0", grant.vnet));
        push("--smbios1", format!("uuid={smbios_uuid}"));
        push("--machine", "q35".into());
        push("--cpuunits", CPU_UNITS.to_string());
        push("--boot", "order=scsi0".into());
        push("--tags", TAG.into());
        push("--description", marker(grant.run_id.as_str()));
        guard
            .append(
                self.now_ms(),
                "vm.create",
                &resource,
                Phase::Intent,
                json!({ "smbios_uuid": smbios_uuid, "argv": args }),
            )
            .await?;
        let output = self
            .run_step(&mut guard, "vm.create", &resource, self.qm_call(&args))
            .await?;
        if !output.success() {
            guard
                .append(
                    self.now_ms(),
                    "vm.create",
                    &resource,
                    Phase::Failed,
                    tool_detail(&output, &[("smbios_uuid", json!(smbios_uuid))]),
                )
                .await?;
            if output.stderr.contains("already exists") {
                return Err(ExecError::AlreadyExists(format!(
                    "qm refused: {}; the existing VM is left untouched",
                    output.stderr_excerpt()
                )));
            }
            return Err(ExecError::FailedPrecondition(format!(
                "qm create {vmid} failed (exit {:?}): {}",
                output.exit_code,
                output.stderr_excerpt()
            )));
        }
        guard
            .append(
                self.now_ms(),
                "vm.create",
                &resource,
                Phase::Done,
                tool_detail(&output, &[("smbios_uuid", json!(smbios_uuid))]),
            )
            .await?;
        Ok(Outcome::CreateVm(pb::CreateVmReply {
            smbios_uuid,
            tool: Some(tool_result("qm create", &output)),
            journal_head: guard.head_hex(),
        }))
    }

    /// `qm start|stop|destroy` on a VM of this run.
    pub(super) async fn vm_lifecycle(
        &self,
        run: &RunHandle,
        vmid: Vmid,
        verb: &'static str,
        timeout_secs: u32,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.lock_open(run).await?;
        self.require_ours(&guard, grant, vmid)?;
        if verb == "start" {
            // A restored guest boots only on a VNet that was checked and contained for this run.
            let table = super::sandbox::table_name(grant);
            let prepared = resources::states(&guard.records())
                .get(&format!("nft:{table}"))
                .is_some_and(|s| s.is_open() && s.last.entry.phase == Phase::Done);
            // And it boots only from this run's live mappings: re-check every disk's loop device.
            let states = resources::states(&guard.records());
            let prefix = format!("overlay:{vmid}:");
            for key in states
                .iter()
                .filter(|(k, s)| k.starts_with(&prefix) && s.is_open())
                .map(|(k, _)| k)
            {
                let archive = key.rsplit(':').next().unwrap_or_default();
                let archive = <ArchiveName as crate::validate::Validated>::validate(archive)
                    .map_err(ExecError::Failed)?;
                let device = states
                    .get(&format!("backup:{archive}"))
                    .and_then(|s| super::loop_device_of(s.done_detail.as_ref()))
                    .ok_or_else(|| {
                        ExecError::FailedPrecondition(format!(
                            "{archive} is no longer mapped by this run"
                        ))
                    })?;
                self.check_mapping(grant, &archive, &device)?;
            }
            if !prepared
                || !self.table_present(grant).await?
                || !self.address_present(grant).await?
            {
                return Err(ExecError::FailedPrecondition(format!(
                    "VM {vmid} may boot only on a prepared sandbox: call PrepareSandbox for {} first",
                    grant.vnet
                )));
            }
        }
        let output = self
            .journaled_qm(&mut guard, vmid, verb, timeout_secs)
            .await?;
        // qm reports success only once the VM reached the state; VmStatus re-reads it on demand.
        let state = match verb {
            "destroy" => pb::VmState::Absent,
            "start" => pb::VmState::Running,
            _ => pb::VmState::Stopped,
        };
        Ok(Outcome::Vm(pb::VmReply {
            state: state as i32,
            tool: Some(tool_result(&format!("qm {verb}"), &output)),
            journal_head: guard.head_hex(),
        }))
    }

    async fn status(
        &self,
        vmid: Vmid,
    ) -> Result<(pb::VmState, Option<process::ToolOutput>), ExecError> {
        if !self.vm_config_path(vmid).exists() {
            return Ok((pb::VmState::Absent, None));
        }
        let output = self.qm(&["status".into(), vmid.to_string()]).await?;
        let state = match output
            .stdout
            .lines()
            .find_map(|l| l.trim().strip_prefix("status: "))
        {
            Some("running") => pb::VmState::Running,
            Some("stopped") => pb::VmState::Stopped,
            _ if !self.vm_config_path(vmid).exists() => pb::VmState::Absent,
            _ => {
                return Err(ExecError::Failed(format!(
                    "qm status {vmid} gave no status (exit {:?}): {}",
                    output.exit_code,
                    output.stderr_excerpt()
                )));
            }
        };
        Ok((state, Some(output)))
    }

    pub(super) async fn vm_status(
        &self,
        run: &RunHandle,
        vmid: Vmid,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let guard = self.lock_open(run).await?;
        self.require_ours(&guard, grant, vmid)?;
        let (state, output) = self.status(vmid).await?;
        Ok(Outcome::Vm(pb::VmReply {
            state: state as i32,
            tool: output.as_ref().map(|o| tool_result("qm status", o)),
            journal_head: guard.head_hex(),
        }))
    }

    /// Cleanup of `vm:<vmid>`: stop and destroy it if, and only if, it is this run's.
    pub(super) async fn undo_vm(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
        state: &resources::ResourceState,
        vmid: Vmid,
    ) -> Result<&'static str, ExecError> {
        let resource = format!("vm:{vmid}");
        let uuid = Self::created_uuid(Some(state));
        let ownership = match &uuid {
            Some(uuid) => self.ownership(grant, vmid, Some(uuid)),
            // The daemon died before it recorded the create: the marker alone must match.
            None => self.ownership(grant, vmid, None),
        };
        match ownership {
            Ownership::Absent => {
                guard
                    .append(
                        self.now_ms(),
                        "vm.destroy",
                        &resource,
                        Phase::Undone,
                        json!({ "end_state": "already gone" }),
                    )
                    .await?;
                Ok("already gone")
            }
            Ownership::Unknown(reason) => Err(ExecError::Failed(format!(
                "VM {vmid}: {reason}; it stays recorded as open until its config can be read"
            ))),
            Ownership::NotOurs(reason) => {
                guard
                    .append(
                        self.now_ms(),
                        "vm.destroy",
                        &resource,
                        Phase::Undone,
                        json!({ "end_state": "not this run's, left untouched", "reason": reason }),
                    )
                    .await?;
                Ok("not this run's, left untouched")
            }
            Ownership::Ours => {
                for verb in ["stop", "destroy"] {
                    self.journaled_qm(guard, vmid, verb, 0).await?;
                }
                Ok("destroyed")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pve_configs() {
        let text = "#certistack-run%3D0f0e1c2d\n#second line\nagent: 1\ntags: certistack;other\nsmbios1: uuid=ABC\n[snap1]\nagent: 0\n";
        let (description, keys) = parse_config(text);
        assert_eq!(description, "certistack-run=0f0e1c2d\nsecond line");
        assert_eq!(keys.get("agent").map(String::as_str), Some("1"));
        assert_eq!(keys.get("smbios1").map(String::as_str), Some("uuid=ABC"));
        assert_eq!(percent_decode("a%3Ab%ZZ%4"), "a:b%ZZ%4");
    }
}
