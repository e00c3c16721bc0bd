//! Sandbox VMs through `qm`, and the run marker that proves a VM is this run's.
//!
//! `CreateVm` refuses a VMID that already has a config (and treats qm's "already exists" as a
//! refusal, never as success), and creates the VM with tag `certistack`, description
//! `certistack-run=<run id>` and a fresh SMBIOS UUID that the journal records. Before start,
//! stop and destroy, and before cleanup undoes anything, the VM config is re-read: only a VM
//! carrying this run's description, tag and journaled SMBIOS UUID is ever touched.

use super::backup::Backups;
use super::backup::SOURCE_CONFIG_OP;
use super::{context::NodeContext, tool_detail, tool_error, tool_result};
use crate::executor::{ExecError, Outcome};
use crate::process::{self, ToolCall, TransientRole};
use crate::resources::{self, EndState, ResourceState, Standing};
use crate::runs::{RunGuard, RunHandle};
use crate::source_hardware::SourceHardware;
use certistack_core::grant::Grant;
use certistack_core::journal::{Op, Resource};
use certistack_core::journal::{Phase, Record};
use certistack_core::qemu::vm_state;
use certistack_core::validate::{ArchiveName, Vmid};
use certistack_proto::v1 as pb;
use serde_json::json;
use std::collections::BTreeMap;

pub const TAG: &str = "certistack";

/// A `qm` lifecycle step on a VM of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Start,
    /// `qm stop`, with `--timeout` when not zero.
    Stop {
        timeout_secs: u32,
    },
    /// `qm destroy --purge 1`: ends the VM resource.
    Destroy,
    /// `qm unlock`: only for a config this run's cut-short `qm create` left locked.
    Unlock,
}

/// What `qm stop` may take beyond its `--timeout`: SIGTERM, 10 s, SIGKILL, 1 s
/// (qemu-server `_do_vm_stop`), plus a margin for qm's own start and the config lock.
const STOP_ESCALATION_SECS: u64 = 17;
/// qemu-server's own `qm stop` timeout when none is given.
const QM_DEFAULT_STOP_SECS: u64 = 60;

/// The `--timeout` a stop passes: the caller's, or, when it gave none, the longest that lets
/// `qm stop` finish inside the tool timeout. Without `--timeout` qm waits 60 s after `quit`
/// and up to 11 s more, longer than the tool timeout; and qm's task runs in a worker of its
/// own session, which killing qm at the deadline would leave running.
pub fn stop_timeout_secs(requested: u32, tool_timeout_secs: u64) -> u32 {
    if requested > 0 {
        return requested;
    }
    let fitting = tool_timeout_secs
        .saturating_sub(STOP_ESCALATION_SECS)
        .clamp(1, QM_DEFAULT_STOP_SECS);
    u32::try_from(fitting).unwrap_or(1)
}

impl Verb {
    fn name(self) -> &'static str {
        match self {
            Verb::Start => "start",
            Verb::Stop { .. } => "stop",
            Verb::Destroy => "destroy",
            Verb::Unlock => "unlock",
        }
    }

    fn op(self) -> Op {
        match self {
            Verb::Start => Op::VmStart,
            Verb::Stop { .. } => Op::VmStop,
            Verb::Destroy => Op::VmDestroy,
            Verb::Unlock => Op::VmUnlock,
        }
    }

    /// How long the guest may legitimately take beyond the tool timeout: `qm stop --timeout N`
    /// waits N seconds before it kills the guest, then up to 11 s more.
    fn grace(self, tool_timeout: std::time::Duration) -> std::time::Duration {
        match self {
            Verb::Stop { timeout_secs } if timeout_secs > 0 => {
                std::time::Duration::from_secs(u64::from(timeout_secs).saturating_add(30))
            }
            Verb::Stop { .. } => {
                let needed = u64::from(stop_timeout_secs(0, tool_timeout.as_secs()))
                    .saturating_add(STOP_ESCALATION_SECS);
                std::time::Duration::from_secs(needed).saturating_sub(tool_timeout)
            }
            _ => std::time::Duration::ZERO,
        }
    }
}

/// Longest status kept from `qm status` (QEMU's run states are short words).
const MAX_STATUS_CHARS: usize = 32;

const MARKER_PREFIX: &str = "certistack-run=";

pub fn marker(run_id: &str) -> String {
    format!("{MARKER_PREFIX}{run_id}")
}

/// What the node's VM config says about a VMID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ownership {
    Absent,
    Ours,
    NotOurs(String),
    /// A claim `qm create` writes before it creates anything (`lock: create`, no marker of
    /// another run; or, once unlocked, nothing at all): whose it is, only the journal can say.
    Claim,
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

/// The executor of VMs: creates a run's VM on its overlays, starts, stops, destroys and reads
/// it, each only while the VM is the one this run created.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Vms<'a> {
    ctx: &'a NodeContext,
}

impl NodeContext {
    pub(in crate::node) fn vms(&self) -> Vms<'_> {
        Vms { ctx: self }
    }
}

impl Vms<'_> {
    fn vm_config_path(&self, vmid: Vmid) -> std::path::PathBuf {
        self.ctx
            .config
            .pve
            .vm_config_dir
            .join(format!("{vmid}.conf"))
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
        let ours = marker(grant.run_id.as_str());
        let foreign_marker = description.lines().any(|l| {
            let l = l.trim();
            l.starts_with(MARKER_PREFIX) && l != ours
        });
        let claim_only = keys.is_empty()
            || (keys.get("lock").map(String::as_str) == Some("create")
                && !keys.contains_key("tags"));
        if claim_only && !foreign_marker {
            return Ownership::Claim;
        }
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

    fn created_uuid(state: Option<&ResourceState>) -> Option<String> {
        state?
            .history
            .iter()
            .rev()
            .find(|r| r.entry.op == Op::VmCreate)?
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
        let state = resources::state_of(&guard.records(), &Resource::Vm(vmid));
        if state
            .as_ref()
            .is_some_and(|s| s.standing() == Standing::Undone && s.last.entry.op == Op::VmDestroy)
        {
            return Err(ExecError::NotFound(format!(
                "VM {vmid} was destroyed by this run"
            )));
        }
        let Some(uuid) = Self::created_uuid(state.as_ref().filter(|s| s.is_open())) else {
            return Err(ExecError::FailedPrecondition(format!(
                "VM {vmid} was not created by this run"
            )));
        };
        match self.ownership(grant, vmid, Some(&uuid)) {
            Ownership::Ours => Ok(uuid),
            Ownership::Absent => Err(ExecError::NotFound(format!("VM {vmid} no longer exists"))),
            Ownership::Claim => Err(ExecError::FailedPrecondition(format!(
                "VM {vmid} is only a claim (lock: create) left by a qm create that did not finish; call Cleanup to remove it"
            ))),
            Ownership::Unknown(reason) => Err(ExecError::Failed(format!("VM {vmid}: {reason}"))),
            Ownership::NotOurs(reason) => Err(ExecError::FailedPrecondition(format!(
                "VM {vmid} is not this run's ({reason}); it is never touched"
            ))),
        }
    }

    /// A `qm` call, given `grace` beyond the tool timeout.
    fn qm_call(&self, args: &[String], grace: std::time::Duration) -> ToolCall {
        let timeout = self.ctx.tool_timeout().saturating_add(grace);
        args.iter().fold(
            ToolCall::new(&self.ctx.config.tools.qm, timeout),
            |call, arg| call.arg(arg),
        )
    }

    /// A `qm` call that is not a journaled step (reading the status).
    async fn qm(&self, args: &[String]) -> Result<process::ToolOutput, ExecError> {
        process::run(self.qm_call(args, std::time::Duration::ZERO))
            .await
            .map_err(tool_error)
    }

    /// `qm start|stop|destroy <vmid>`, journaled: `intent`, then `failed`, or `done` (`undone`
    /// for destroy, which ends the VM resource).
    async fn journaled_qm(
        &self,
        guard: &mut RunGuard<'_>,
        vmid: Vmid,
        verb: Verb,
    ) -> Result<process::ToolOutput, ExecError> {
        let resource = Resource::Vm(vmid);
        let mut args = vec![verb.name().to_owned(), vmid.to_string()];
        match verb {
            // Always explicit: qm's own default outlasts the tool timeout. No `--skiplock`: a
            // lock on the VM means a PVE task (backup, migration, snapshot) is working on it.
            Verb::Stop { timeout_secs } => args.extend([
                "--timeout".into(),
                stop_timeout_secs(timeout_secs, self.ctx.config.limits.tool_timeout_secs)
                    .to_string(),
            ]),
            Verb::Destroy => args.extend(["--purge".into(), "1".into()]),
            Verb::Start | Verb::Unlock => {}
        }
        let op = &verb.op();
        let mut call = self.qm_call(&args, verb.grace(self.ctx.tool_timeout()));
        // Under systemd, qm start (and the QEMU it execs before qemu-server moves it to the
        // VM's scope) runs in a unit of its own: the VM never inherits the daemon's sandbox.
        let mut unit = None;
        if verb == Verb::Start && self.ctx.config.process.use_transient_units() {
            let run_id = guard.grant().run_id.as_str().to_owned();
            let vm = vmid.to_string();
            let name = process::transient_unit_name(TransientRole::QmStart, &run_id, &vm)
                .map_err(ExecError::Failed)?;
            let description =
                process::transient_unit_description(TransientRole::QmStart, &run_id, &vm);
            call = process::in_transient_unit(
                call,
                TransientRole::QmStart,
                &name,
                &description,
                &self.ctx.config.process.systemd_run,
                &self.ctx.config.process.systemctl,
                None,
            )
            .map_err(ExecError::Failed)?;
            unit = Some(name);
        }
        guard
            .intent(
                self.ctx.now_ms(),
                op,
                &resource,
                json!({ "argv": args, "unit": unit }),
            )
            .await?;
        let output = self.ctx.run_step(guard, op, &resource, call).await?;
        if !output.success() {
            self.ctx
                .journal_tool_failed(guard, op, &resource, &output, &[])
                .await?;
            return Err(ExecError::FailedPrecondition(format!(
                "qm {} {vmid} failed (exit {:?}): {}",
                verb.name(),
                output.exit_code,
                output.stderr_excerpt()
            )));
        }
        let phase = if verb == Verb::Destroy {
            Phase::Undone
        } else {
            Phase::Done
        };
        guard
            .append(
                self.ctx.now_ms(),
                op,
                &resource,
                phase,
                tool_detail(&output, &[]),
            )
            .await?;
        Ok(output)
    }

    pub(super) async fn create(
        &self,
        run: &RunHandle,
        vmid: Vmid,
        cores: u32,
        memory_mib: u32,
        archives: Vec<ArchiveName>,
        mirror_source: bool,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.ctx.lock_open(run).await?;
        let source = if mirror_source {
            Some(source_hardware(&guard.records())?)
        } else {
            None
        };
        let states = resources::states(&guard.records());
        let resource = Resource::Vm(vmid);
        if let Some(state) = states.get(&resource.key()).filter(|s| s.is_open()) {
            let uuid = Self::created_uuid(Some(state)).unwrap_or_default();
            return Err(ExecError::AlreadyExists(match state.standing() {
                Standing::Done => format!(
                    "this run already created VM {vmid} (SMBIOS UUID {uuid}); it is ready for StartVm"
                ),
                _ => format!(
                    "this run already tried to create VM {vmid} and its last step ({} {}) did not complete; destroy it or clean up first",
                    state.last.entry.op,
                    state.last.entry.phase.name()
                ),
            }));
        }
        if self.vm_config_path(vmid).exists() {
            return Err(ExecError::AlreadyExists(format!(
                "VM {vmid} already exists on this node and is not this run's; it is left untouched (grant another VMID)"
            )));
        }
        let mut disks = Vec::new();
        for (slot, archive) in archives.iter().enumerate() {
            let key = Resource::Overlay {
                vmid,
                archive: archive.clone(),
            };
            if !states
                .get(&key.key())
                .is_some_and(|s| s.is_open() && s.standing() == Standing::Done)
            {
                return Err(ExecError::FailedPrecondition(format!(
                    "VM {vmid} has no overlay of {archive}; call CreateOverlay first"
                )));
            }
            let path = self.ctx.overlays().overlay_path(grant, vmid, archive);
            disks.push((archive.clone(), slot, path.display().to_string()));
        }
        // The source's shape, or the connector's own: q35, virtio-scsi, scsiN in order.
        let hardware = match &source {
            Some(source) => {
                let overlays: Vec<(ArchiveName, String)> =
                    disks.into_iter().map(|(a, _, path)| (a, path)).collect();
                source
                    .qm_options(&overlays, grant.vnet.as_str())
                    .map_err(|reason| {
                        ExecError::FailedPrecondition(format!(
                            "VM {vmid} cannot mirror the source: {reason}"
                        ))
                    })?
            }
            None => {
                let mut own: Vec<(String, String)> =
                    vec![("--scsihw".into(), "virtio-scsi-pci".into())];
                own.extend(disks.into_iter().map(|(_, slot, path)| {
                    (
                        format!("--scsi{slot}"),
                        format!("{path},format=qcow2,backup=0"),
                    )
                }));
                own.extend([
                    ("--ide2".into(), "none,media=cdrom".into()),
                    (
                        "--net0".into(),
                        format!("virtio,bridge={},firewall=0", grant.vnet),
                    ),
                    ("--machine".into(), "q35".into()),
                    ("--boot".into(), "order=scsi0".into()),
                ]);
                own
            }
        };
        // Every NIC gets the MAC derived from the run and VMID, so guest network recovery can
        // bind its profile to the NIC the VM really has; the first NIC is the sandbox NIC.
        let mut ordinal = 0u32;
        let hardware: Vec<(String, String)> = hardware
            .into_iter()
            .map(|(key, value)| {
                let is_nic = key
                    .strip_prefix("--net")
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
                match value.split_once(',') {
                    Some((model, rest)) if is_nic && !model.contains('=') => {
                        let mac = super::guest_network::sandbox_mac(&grant.run_id, vmid, ordinal);
                        ordinal += 1;
                        (key, format!("{model}={},{rest}", mac.to_uppercase()))
                    }
                    _ => (key, value),
                }
            })
            .collect();
        let smbios_uuid = uuid::Uuid::new_v4().to_string();
        let mut args: Vec<String> = vec!["create".into(), vmid.to_string()];
        let mut push = |k: &str, v: String| {
            args.push(k.to_owned());
            args.push(v);
        };
        push("--name", format!("certistack-{vmid}"));
        push("--memory", memory_mib.to_string());
        push("--cores", cores.to_string());
        for (key, value) in hardware {
            push(&key, value);
        }
        push("--agent", "1".into());
        push("--smbios1", format!("uuid={smbios_uuid}"));
        push(
            "--cpuunits",
            self.ctx.config.limits.sandbox_cpu_units.to_string(),
        );
        push("--tags", TAG.into());
        push("--description", marker(grant.run_id.as_str()));
        let op = &Op::VmCreate;
        guard
            .intent(
                self.ctx.now_ms(),
                op,
                &resource,
                json!({ "smbios_uuid": smbios_uuid, "argv": args }),
            )
            .await?;
        let output = self
            .ctx
            .run_step(
                &mut guard,
                op,
                &resource,
                self.qm_call(&args, std::time::Duration::ZERO),
            )
            .await?;
        let journaled = [("smbios_uuid", json!(smbios_uuid))];
        if !output.success() {
            self.ctx
                .journal_tool_failed(&mut guard, op, &resource, &output, &journaled)
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
            .done(
                self.ctx.now_ms(),
                op,
                &resource,
                tool_detail(&output, &journaled),
            )
            .await?;
        Ok(Outcome::CreateVm(pb::CreateVmReply {
            smbios_uuid,
            tool: Some(tool_result("qm create", &output)),
            journal_head: guard.head_hex(),
        }))
    }

    /// `qm start|stop|destroy` on a VM of this run.
    pub(super) async fn lifecycle(
        &self,
        run: &RunHandle,
        vmid: Vmid,
        verb: Verb,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.ctx.lock_open(run).await?;
        self.require_ours(&guard, grant, vmid)?;
        if verb == Verb::Start {
            // A restored guest boots only on a VNet that was checked and contained for this run.
            let states = resources::states(&guard.records());
            let table = Resource::NftTable(super::sandbox::table_name(grant));
            let prepared = states
                .get(&table.key())
                .is_some_and(|s| s.is_open() && s.standing() == Standing::Done);
            // No recovery unit may still write an overlay while QEMU reads it: one that survived
            // its stop is stopped now, or the start is refused.
            self.ctx
                .guest_network()
                .release_recovery_unit(grant, vmid)
                .await?;
            // And it boots only from this run's live mappings: re-check every disk's loop device.
            let archives =
                states
                    .values()
                    .filter(|s| s.is_open())
                    .filter_map(|s| match &s.resource {
                        Resource::Overlay { vmid: v, archive } if *v == vmid => Some(archive),
                        _ => None,
                    });
            for archive in archives {
                let backup = Resource::Backup(archive.clone());
                let device =
                    Backups::mapped_device(states.get(&backup.key())).ok_or_else(|| {
                        ExecError::FailedPrecondition(format!(
                            "{archive} is no longer mapped by this run"
                        ))
                    })?;
                self.ctx.backups().check_mapping(grant, archive, &device)?;
                // QEMU, as root, follows what the overlay's header names: after the confined
                // appliance held it, it must still name only this mapping, raw.
                let overlay = self.ctx.overlays().overlay_path(grant, vmid, archive);
                super::qcow2_header::check_overlay_header(&overlay, &device)
                    .map_err(ExecError::FailedPrecondition)?;
            }
            if !prepared
                || !self.ctx.sandbox().table_present(grant).await?
                || !self.ctx.sandbox().address_present(grant).await?
            {
                return Err(ExecError::FailedPrecondition(format!(
                    "VM {vmid} may boot only on a prepared sandbox: call PrepareSandbox for {} first",
                    grant.vnet
                )));
            }
            self.ctx.sandbox().recheck(grant).await?;
        }
        let output = self.journaled_qm(&mut guard, vmid, verb).await?;
        // qm reports success only once the VM reached the state; VmStatus re-reads it on demand.
        let state = match verb {
            Verb::Destroy => pb::VmState::Absent,
            Verb::Start => pb::VmState::Running,
            // Unlock is a cleanup step only; it never reaches here.
            Verb::Stop { .. } | Verb::Unlock => pb::VmState::Stopped,
        };
        Ok(Outcome::Vm(pb::VmReply {
            state: state as i32,
            tool: Some(tool_result(&format!("qm {}", verb.name()), &output)),
            journal_head: guard.head_hex(),
            qmp_status: String::new(),
        }))
    }

    async fn read_status(
        &self,
        vmid: Vmid,
    ) -> Result<(pb::VmState, String, Option<process::ToolOutput>), ExecError> {
        if !self.vm_config_path(vmid).exists() {
            return Ok((pb::VmState::Absent, String::new(), None));
        }
        let output = self.qm(&["status".into(), vmid.to_string()]).await?;
        let printed = output
            .stdout
            .lines()
            .find_map(|l| l.trim().strip_prefix("status: "))
            .map(str::trim)
            .filter(|s| !s.is_empty());
        let Some(printed) = printed else {
            if !self.vm_config_path(vmid).exists() {
                return Ok((pb::VmState::Absent, String::new(), Some(output)));
            }
            return Err(ExecError::Failed(format!(
                "qm status {vmid} gave no status (exit {:?}): {}",
                output.exit_code,
                output.stderr_excerpt()
            )));
        };
        // Bounded and printable: the value is passed on to the controller as is.
        let qmp_status: String = printed
            .chars()
            .filter(|c| c.is_ascii_graphic())
            .take(MAX_STATUS_CHARS)
            .collect();
        Ok((vm_state(&qmp_status), qmp_status, Some(output)))
    }

    pub(super) async fn status(&self, run: &RunHandle, vmid: Vmid) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let guard = self.ctx.lock_open(run).await?;
        match self.require_ours(&guard, grant, vmid) {
            Ok(_) => {}
            // Destroyed by this run: the answer is that it is gone.
            Err(ExecError::NotFound(_)) => {
                return Ok(Outcome::Vm(pb::VmReply {
                    state: pb::VmState::Absent as i32,
                    tool: None,
                    journal_head: guard.head_hex(),
                    qmp_status: String::new(),
                }));
            }
            Err(error) => return Err(error),
        }
        let (state, qmp_status, output) = self.read_status(vmid).await?;
        Ok(Outcome::Vm(pb::VmReply {
            state: state as i32,
            tool: output.as_ref().map(|o| tool_result("qm status", o)),
            journal_head: guard.head_hex(),
            qmp_status,
        }))
    }

    async fn journal_not_ours(
        &self,
        guard: &mut RunGuard<'_>,
        resource: &Resource,
        reason: String,
    ) -> Result<EndState, ExecError> {
        guard
            .undone(
                self.ctx.now_ms(),
                &Op::VmDestroy,
                resource,
                json!({ "end_state": EndState::NotOurs.wire(), "reason": reason }),
            )
            .await?;
        Ok(EndState::NotOurs)
    }

    /// Cleanup of `vm:<vmid>`: stop and destroy it if, and only if, it is this run's.
    pub(super) async fn undo(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
        state: &ResourceState,
        vmid: Vmid,
    ) -> Result<EndState, ExecError> {
        let resource = Resource::Vm(vmid);
        let op = &Op::VmDestroy;
        let uuid = Self::created_uuid(Some(state));
        let ownership = match &uuid {
            Some(uuid) => self.ownership(grant, vmid, Some(uuid)),
            // The daemon died before it recorded the create: the marker alone must match.
            None => self.ownership(grant, vmid, None),
        };
        match ownership {
            Ownership::Absent => {
                self.ctx.journal_end_state(guard, op, &resource, &EndState::AlreadyGone)
                    .await?;
                Ok(EndState::AlreadyGone)
            }
            Ownership::Unknown(reason) => Err(ExecError::Failed(format!(
                "VM {vmid}: {reason}; it stays recorded as open until its config can be read"
            ))),
            Ownership::Claim if create_cut_short(state) => {
                // This run journaled the VMID before its `qm create`, which never reported:
                // the claim is what that create left. qm destroy refuses a locked config.
                for verb in [Verb::Unlock, Verb::Destroy] {
                    self.journaled_qm(guard, vmid, verb).await?;
                }
                Ok(EndState::Destroyed)
            }
            Ownership::Claim => {
                self.journal_not_ours(
                    guard,
                    &resource,
                    "it is a lock: create claim, and this run's qm create did not leave one unfinished".into(),
                )
                .await
            }
            Ownership::NotOurs(reason) => self.journal_not_ours(guard, &resource, reason).await,
            Ownership::Ours => {
                for verb in [Verb::Stop { timeout_secs: 0 }, Verb::Destroy] {
                    self.journaled_qm(guard, vmid, verb).await?;
                }
                Ok(EndState::Destroyed)
            }
        }
    }
}

/// The source hardware this run's last successful `ReadSourceConfig` journaled.
fn source_hardware(records: &[Record]) -> Result<SourceHardware, ExecError> {
    let detail = records
        .iter()
        .rev()
        .find(|r| r.entry.op == SOURCE_CONFIG_OP && r.entry.phase == Phase::Done)
        .and_then(|r| r.entry.detail.get("hardware"))
        .ok_or_else(|| {
            ExecError::FailedPrecondition(
                "this run has not read the source VM's config: call ReadSourceConfig first".into(),
            )
        })?;
    serde_json::from_value(detail.clone()).map_err(|e| {
        ExecError::Failed(format!(
            "the source hardware this run journaled does not read back: {e}"
        ))
    })
}

/// Whether this run's last `qm create` of the VM never reported its outcome (the daemon died,
/// or qm was killed at its deadline) and no create of it completed: then a claim config is
/// what that create left, and only then.
fn create_cut_short(state: &ResourceState) -> bool {
    let creates: Vec<_> = state
        .history
        .iter()
        .filter(|r| r.entry.op == Op::VmCreate)
        .collect();
    let completed = creates.iter().any(|r| r.entry.phase == Phase::Done);
    let last_unknown = creates.last().is_some_and(|r| match r.entry.phase {
        Phase::Intent => true,
        Phase::Failed => {
            r.entry
                .detail
                .get("outcome_unknown")
                .and_then(|u| u.as_bool())
                == Some(true)
        }
        Phase::Done | Phase::Undone => false,
    });
    !completed && last_unknown
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

    /// The shape `CreateVm` mirrors is the last one a completed `ReadSourceConfig` journaled,
    /// read back from the journal file as a restarted daemon reads it; a failed read after it
    /// changes nothing, and a run without one is refused.
    #[test]
    fn the_mirrored_shape_comes_from_the_journal_file() {
        let dir = std::env::temp_dir().join(format!("certistack-srchw-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let run = "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f";
        let mut journal = certistack_core::journal::Journal::create(&dir, run).unwrap();
        let first = SourceHardware::parse(b"scsi0: a\n").unwrap();
        let second = SourceHardware::parse(b"virtio0: a\nbios: ovmf\n").unwrap();
        let op = SOURCE_CONFIG_OP;
        let key = &Resource::parse("source:qemu-server.conf");
        journal
            .append(
                0,
                &Op::RunBegin,
                &Resource::parse("run:x"),
                Phase::Done,
                json!(null),
            )
            .unwrap();
        let before = certistack_core::journal::read(journal.path(), run)
            .unwrap()
            .records;
        assert!(matches!(
            source_hardware(&before),
            Err(ExecError::FailedPrecondition(m)) if m.contains("call ReadSourceConfig first")
        ));
        for (phase, hardware) in [
            (Phase::Done, Some(&first)),
            (Phase::Done, Some(&second)),
            (Phase::Failed, None),
        ] {
            let detail = match hardware {
                Some(h) => json!({ "hardware": h }),
                None => json!({ "reason": "garbled" }),
            };
            journal
                .append(0, op, key, Phase::Intent, json!(null))
                .unwrap();
            journal.append(0, op, key, phase, detail).unwrap();
        }
        let records = certistack_core::journal::read(journal.path(), run)
            .unwrap()
            .records;
        assert_eq!(source_hardware(&records).unwrap(), second);
        // Source reads leave nothing on the node: no resource for cleanup.
        assert!(!resources::states(&records).contains_key(&key.key()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_stop_always_fits_inside_the_tool_timeout() {
        // qm waits --timeout, then SIGTERM, 10 s, SIGKILL, 1 s.
        assert_eq!(stop_timeout_secs(0, 60), 43);
        assert_eq!(stop_timeout_secs(0, 3600), 60);
        assert_eq!(stop_timeout_secs(0, 5), 1);
        assert_eq!(stop_timeout_secs(25, 60), 25);
        let tool = std::time::Duration::from_secs(60);
        assert_eq!(
            Verb::Stop { timeout_secs: 0 }.grace(tool),
            std::time::Duration::ZERO
        );
        // A tool timeout too short for qm's escalation is stretched to fit it.
        let short = std::time::Duration::from_secs(5);
        assert_eq!(
            Verb::Stop { timeout_secs: 0 }.grace(short),
            std::time::Duration::from_secs(13)
        );
    }

    #[test]
    fn every_qemu_run_state_has_a_vm_state() {
        for (status, state) in [
            ("running", pb::VmState::Running),
            ("stopped", pb::VmState::Stopped),
            ("paused", pb::VmState::Paused),
            ("io-error", pb::VmState::GuestError),
            ("internal-error", pb::VmState::GuestError),
            ("guest-panicked", pb::VmState::GuestError),
            ("shutdown", pb::VmState::GuestShutdown),
            ("suspended", pb::VmState::Suspended),
            ("prelaunch", pb::VmState::Prelaunch),
            ("something-new", pb::VmState::Unrecognized),
        ] {
            assert_eq!(vm_state(status), state, "{status}");
        }
    }
}
