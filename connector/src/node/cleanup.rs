//! Cleanup, recovery of interrupted steps, and residue: what of a run is still on the node.
//!
//! - Recovery: a step whose `intent` has no outcome was interrupted by the daemon's end. The
//!   tools it started (journaled with the intent: pid, start time, process group) are killed
//!   and proven gone, then the step is journaled `failed` with `outcome_unknown`, before any
//!   decision is taken on what it left. This runs when the daemon starts and whenever a run
//!   is locked, so a tool that outlived the daemon can never land after cleanup decided.
//! - Cleanup undoes VMs first, then every other open resource newest first. A VM that cannot
//!   be destroyed keeps everything beneath it: its overlays, the run directory, the backups
//!   those overlays use, the containment table and the probe address.
//! - Residue is read from the node by what names it for the run (the mapping name, the table
//!   name, the probe address, the run directory, the VM marker), not from the journal alone.

use super::context::NodeContext;
use super::sandbox;
use crate::executor::{ExecError, Outcome};
use crate::process::REAP_WITHIN;
use crate::resources::{self, EndState, InterruptedStep, ResourceState, Standing};
use crate::runs::{RunGuard, RunHandle};
use certistack_core::grant::Grant;
use certistack_core::journal::{Op, Resource};
use certistack_core::journal::{Phase, Record};
use certistack_core::validate::{ArchiveName, Vmid};
use certistack_proto::v1 as pb;
use serde_json::json;
use std::collections::BTreeSet;

/// What must stay because a VM of the run could not be destroyed.
#[derive(Debug, Default)]
struct Kept {
    vms: BTreeSet<Vmid>,
    archives: BTreeSet<ArchiveName>,
}

impl Kept {
    fn reason(&self, resource: &Resource) -> Option<String> {
        if self.vms.is_empty() {
            return None;
        }
        let vms = self
            .vms
            .iter()
            .map(|v| format!("VM {v}"))
            .collect::<Vec<_>>()
            .join(", ");
        let beneath = match resource {
            Resource::NftTable(_)
            | Resource::ProbeAddress(_)
            | Resource::Forwarding(_)
            | Resource::OverlayDir => true,
            Resource::Overlay { vmid, .. } => self.vms.contains(vmid),
            Resource::Backup(archive) => self.archives.contains(archive),
            Resource::Vm(_)
            | Resource::Screendump(_)
            | Resource::Run(_)
            | Resource::Journal
            | Resource::SourceConfig
            | Resource::SourceManifest
            | Resource::Probe { .. }
            | Resource::Unrecognized(_) => false,
        };
        beneath.then(|| format!("a VM of the run remains ({vms} could not be destroyed)"))
    }
}

/// The executor of cleanup: undoes what a run left on the node and reads what is still there.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cleanup<'a> {
    ctx: &'a NodeContext,
}

impl NodeContext {
    pub(in crate::node) fn cleanup(&self) -> Cleanup<'_> {
        Cleanup { ctx: self }
    }
}

impl Cleanup<'_> {
    /// Settles steps the daemon was interrupted in: kills and waits for the tools they
    /// started, then journals each step `failed` with `outcome_unknown`. A tool that cannot be
    /// proven gone leaves its step undecided and is reported.
    pub(super) async fn settle_interrupted(
        &self,
        guard: &mut RunGuard<'_>,
    ) -> Result<(), ExecError> {
        let records = guard.records().to_vec();
        // Steps on resources, and side steps (a guest network recovery's appliance holds the
        // overlay open): every tool must be gone before anything decides about the resource.
        let steps: Vec<InterruptedStep> = resources::states(&records)
            .into_values()
            .filter(|s| s.standing() == Standing::Interrupted)
            .map(|s| InterruptedStep {
                tools: s.interrupted_tools(),
                op: s.last.entry.op,
                resource: s.resource,
                units: Vec::new(),
            })
            .chain(resources::interrupted_side_steps(&records))
            .collect();
        let mut problems = Vec::new();
        for step in steps {
            let mut killed = 0usize;
            let mut left = Vec::new();
            for tool in &step.tools {
                match tool.reap(REAP_WITHIN).await {
                    Ok(n) => killed = killed.saturating_add(n),
                    Err(reason) => left.push(reason),
                }
            }
            // A unit outlives the daemon that started it (a guest network recovery's
            // appliance): stopped, after checking it is this run's. Without systemd as init
            // no unit can exist.
            let units: &[(String, String)] = if crate::systemd::booted() {
                &step.units
            } else {
                &[]
            };
            let mut units_stopped = Vec::new();
            let mut units_gone = Vec::new();
            for (unit, description) in units {
                match crate::process::release_transient_unit(
                    &self.ctx.config.process.systemctl,
                    unit,
                    description,
                    self.ctx.tool_timeout(),
                )
                .await
                {
                    Ok(crate::process::UnitRelease::Stopped) => units_stopped.push(unit),
                    Ok(crate::process::UnitRelease::Gone) => units_gone.push(unit),
                    Err(reason) => left.push(reason),
                }
            }
            if !left.is_empty() {
                problems.push(format!(
                    "{} ({}): {}",
                    step.resource,
                    step.op,
                    left.join("; ")
                ));
                continue;
            }
            guard
                .failed(
                    self.ctx.now_ms(),
                    &step.op,
                    &step.resource,
                    json!({
                        "error": "the connector stopped during this step",
                        "outcome_unknown": true,
                        "tools": step.tools,
                        "units_stopped": units_stopped,
                        // Units the step named that had ended by themselves before the settling.
                        "units_gone": units_gone,
                        "processes_killed": killed,
                    }),
                )
                .await?;
            if killed > 0 {
                tracing::warn!(resource = %step.resource, op = %step.op, killed, "killed the tools of a step the connector was interrupted in");
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ExecError::Failed(format!(
                "a tool of an interrupted step is still running and could not be stopped ({}); nothing is decided until it is gone: retry, or stop it by hand",
                problems.join("; ")
            )))
        }
    }

    /// Locks the run, even a closed one, and settles the steps a previous daemon was
    /// interrupted in, so the records read next say what the node was last told.
    async fn lock_settled<'a>(
        &self,
        run: &'a RunHandle,
    ) -> Result<(RunGuard<'a>, Vec<Record>), ExecError> {
        let mut guard = run.lock().await;
        self.settle_interrupted(&mut guard).await?;
        let records = guard.records().to_vec();
        Ok((guard, records))
    }

    /// Undoes every open resource of the run (VMs first, then newest first), sweeps what is
    /// named for the run on the node, then re-reads the node for residue.
    pub(super) async fn cleanup(&self, run: &RunHandle) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let (mut guard, records) = self.lock_settled(run).await?;
        let touched_network = touched_network(&records);
        let mut open = resources::open_newest_first(&records);
        // Stable: VMs first, each group newest first. Everything else may lie beneath a VM.
        open.sort_by_key(|s| !matches!(s.resource, Resource::Vm(_)));
        let mut receipts = Vec::new();
        let mut failed = false;
        let mut kept = Kept::default();
        for state in &open {
            let end_state = match kept.reason(&state.resource) {
                Some(reason) => EndState::Kept(reason),
                None => match self.undo(&mut guard, grant, state).await {
                    Ok(end_state) => end_state,
                    Err(error) => EndState::Failed(error.to_string()),
                },
            };
            if let (Resource::Vm(vmid), true) = (&state.resource, end_state.is_failure()) {
                kept.vms.insert(*vmid);
                for other in &open {
                    if let Resource::Overlay { vmid: v, archive } = &other.resource
                        && v == vmid
                    {
                        kept.archives.insert(archive.clone());
                    }
                }
            }
            failed |= end_state.is_failure();
            receipts.push(end_state.receipt(state.key.clone()));
        }
        if kept.vms.is_empty() {
            for (resource, end_state) in self.sweep_named(&mut guard, grant, touched_network).await
            {
                failed |= end_state.is_failure();
                receipts.push(end_state.receipt(resource));
            }
        }
        let residue = self.residue(grant, touched_network).await;
        if !residue.is_empty() || failed {
            tracing::warn!(run_id = %grant.run_id, ?residue, ?receipts, "cleanup left residue");
        }
        // The same finding again (the expiry reaper retrying) is not journaled again.
        guard.append_if_changed(
            self.ctx.now_ms(),
            &Op::RunCleanup,
            &Resource::Run(grant.run_id.clone()),
            if residue.is_empty() && !failed {
                Phase::Done
            } else {
                Phase::Failed
            },
            json!({ "receipts": receipts.iter().map(|r| json!({"resource": r.resource, "end_state": r.end_state})).collect::<Vec<_>>(), "residue": residue }),
        ).await?;
        Ok(Outcome::Cleanup(pb::CleanupReply {
            resources: receipts,
            residue,
            journal_head: guard.head_hex(),
        }))
    }

    /// Removes what the node still holds under the run's names although the journal has it
    /// closed (a tool that landed after its step was decided): the run's table and probe
    /// address, and mappings carrying the run's mapping name.
    async fn sweep_named(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
        touched_network: bool,
    ) -> Vec<(String, EndState)> {
        let mut receipts = Vec::new();
        let mut receipt =
            |resource: String, end_state: EndState| receipts.push((resource, end_state));
        if touched_network {
            let table = Resource::NftTable(sandbox::table_name(grant));
            if self
                .ctx
                .sandbox()
                .table_present(grant)
                .await
                .unwrap_or(false)
            {
                let end = match self.ctx.sandbox().remove_table(guard, grant).await {
                    Ok(state) => state,
                    Err(error) => EndState::Failed(error.to_string()),
                };
                receipt(table.key(), end);
            }
            let address = Resource::ProbeAddress(grant.vnet.clone());
            if self
                .ctx
                .sandbox()
                .address_present(grant)
                .await
                .unwrap_or(false)
            {
                let end = match self.ctx.sandbox().remove_address(guard, grant).await {
                    Ok(state) => state,
                    Err(error) => EndState::Failed(error.to_string()),
                };
                receipt(address.key(), end);
            }
        }
        for archive in &grant.archives {
            if self.ctx.backups().our_loops(grant, archive).is_empty() {
                continue;
            }
            // Whatever carries the run's mapping name is the run's.
            let end = match self
                .ctx
                .backups()
                .unmap_mappings(guard, grant, archive, Vec::new(), true)
                .await
            {
                Ok((end, _)) => end,
                Err(error) => EndState::Failed(error.to_string()),
            };
            receipt(Resource::Backup(archive.clone()).key(), end);
        }
        receipts
    }

    async fn undo(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
        state: &ResourceState,
    ) -> Result<EndState, ExecError> {
        let key = &state.resource;
        match &state.resource {
            Resource::Overlay { vmid, archive } => {
                self.ctx
                    .guest_network()
                    .release_recovery_unit(grant, *vmid)
                    .await?;
                let path = self.ctx.overlays().overlay_path(grant, *vmid, archive);
                self.ctx
                    .overlays()
                    .remove_path(guard, Op::OverlayDelete, key, &path)
                    .await
            }
            Resource::Backup(archive) => self
                .ctx
                .backups()
                .undo(guard, grant, state, archive)
                .await
                .map(|(end, _)| end),
            Resource::Vm(vmid) => self.ctx.vms().undo(guard, grant, state, *vmid).await,
            // Whatever the install reported, the node is read before anything is recorded:
            // an absent table or address is journaled "already gone", a present one removed.
            Resource::NftTable(_) => self.ctx.sandbox().remove_table(guard, grant).await,
            Resource::ProbeAddress(_) => self.ctx.sandbox().remove_address(guard, grant).await,
            // Written back only while it still holds the value the run set.
            Resource::Forwarding(_) => self
                .ctx
                .sandbox()
                .restore_forwarding(guard, grant)
                .await
                .map(|end| end.unwrap_or(EndState::AlreadyGone)),
            Resource::Screendump(vmid) => {
                let path = self.ctx.overlays().screendump_path(grant, *vmid);
                self.ctx
                    .overlays()
                    .remove_path(guard, Op::FileDelete, key, &path)
                    .await
            }
            Resource::OverlayDir => {
                self.ctx
                    .overlays()
                    .remove_path(
                        guard,
                        Op::OverlayDirDelete,
                        key,
                        &self.ctx.overlays().overlay_dir(grant),
                    )
                    .await
            }
            // Run-level, read-only and probe records are never open resources (`states`).
            Resource::Run(_)
            | Resource::Journal
            | Resource::SourceConfig
            | Resource::SourceManifest
            | Resource::Probe { .. }
            | Resource::Unrecognized(_) => Err(ExecError::Failed(format!(
                "no undo is known for {key}; it was written by another version of the connector"
            ))),
        }
    }

    /// What the node still holds that is named for the run, plus what the journal still has
    /// open: the run may end only when this is empty.
    pub(super) async fn run_residue(&self, run: &RunHandle) -> Result<Vec<String>, ExecError> {
        let (_guard, records) = self.lock_settled(run).await?;
        let touched_network = touched_network(&records);
        let open: Vec<String> = resources::open_newest_first(&records)
            .into_iter()
            .map(|s| s.key)
            .collect();
        let mut residue = Vec::new();
        if !open.is_empty() {
            residue.push(format!("open in its journal: {}", open.join(", ")));
        }
        residue.extend(self.residue(&run.grant, touched_network).await);
        Ok(residue)
    }

    /// What of the run is still on the node, re-read from the node itself.
    pub(super) async fn residue(&self, grant: &Grant, touched_network: bool) -> Vec<String> {
        let mut residue = Vec::new();
        if touched_network {
            match self.ctx.sandbox().table_present(grant).await {
                Ok(true) => residue.push(format!(
                    "nftables table inet {} still exists",
                    sandbox::table_name(grant)
                )),
                Ok(false) => {}
                Err(error) => residue.push(format!("cannot check the nftables table: {error}")),
            }
            match self.ctx.sandbox().address_present(grant).await {
                Ok(true) => residue.push(format!(
                    "{} still carries {}",
                    grant.vnet, grant.probe_source
                )),
                Ok(false) => {}
                Err(error) => residue.push(format!("cannot check the probe address: {error}")),
            }
        }
        for archive in &grant.archives {
            for l in self.ctx.backups().our_loops(grant, archive) {
                residue.push(format!("loop device {} still maps {archive}", l.device));
                let holders = super::loopdev::device_mapper_holders(&self.ctx.sys_block, &l.device);
                if !holders.is_empty() {
                    residue.push(format!(
                        "the host uses the mapping of {archive}: {}",
                        super::backup::describe_holders(&holders)
                    ));
                }
            }
            let backing = self.ctx.backups().expected_backing(grant, archive);
            if backing.exists() {
                residue.push(format!(
                    "the mapping {} of {archive} still exists",
                    backing.display()
                ));
            }
        }
        let dir = self.ctx.overlays().overlay_dir(grant);
        if dir.symlink_metadata().is_ok() {
            residue.push(format!("overlay directory {} still exists", dir.display()));
        }
        for vmid in grant.sandbox_vms.keys() {
            let ownership = self.ctx.vms().ownership(grant, *vmid, None);
            match &ownership {
                super::vm::Ownership::Unknown(reason) => {
                    residue.push(format!("VM {vmid}: {reason}"))
                }
                super::vm::Ownership::Ours => {
                    residue.push(format!("VM {vmid} with this run's marker still exists"))
                }
                super::vm::Ownership::Absent
                | super::vm::Ownership::NotOurs(_)
                | super::vm::Ownership::Claim => {}
            }
            // A QEMU process outliving its config would hold the overlay and the loop device
            // (not reported for a VM that is not this run's: its process is not ours to judge).
            let pid_file = self
                .ctx
                .config
                .pve
                .qemu_server_run_dir
                .join(format!("{vmid}.pid"));
            if let Some(pid) = std::fs::read_to_string(&pid_file)
                .ok()
                .and_then(|p| p.trim().parse::<u32>().ok())
                && std::path::Path::new(&format!("/proc/{pid}")).exists()
                && matches!(
                    ownership,
                    super::vm::Ownership::Ours | super::vm::Ownership::Absent
                )
            {
                residue.push(format!(
                    "the QEMU process {pid} of VM {vmid} is still running"
                ));
            }
        }
        residue
    }
}

/// Whether the run ever journaled a network object: only then are the node's network objects
/// swept and read for residue.
fn touched_network(records: &[Record]) -> bool {
    records.iter().any(|r| r.entry.resource.is_network())
}
