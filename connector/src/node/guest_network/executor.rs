//! `RecoverGuestNetwork` on the node: the run's checks, whether the session runs in a
//! transient unit, the journal records around the recovery.

use super::confinement::{
    KVM_DEVICE, KVM_GROUP, LOOP_DEVICE_GROUP, OverlayHandover, appliance_launcher, group_id,
    loop_device_problem,
};
use super::identities::{APPLIANCE_UNITS, IdentityLease, UnitLease, lease, users_of_loaded_units};
use super::plan::recover;
use super::profiles::probe_ports;
use super::session::{
    Appliance, Confinement, GuestNetworkUnit, Session, guest_network_unit, guestfish_call,
    guestfish_installed,
};
use super::{OP, RecoveryError, SandboxNic, sandbox_mac};
use crate::executor::{ExecError, Outcome};
use crate::node::backup::Backups;
use crate::node::context::NodeContext;
use crate::node::tool_result;
use crate::process::{self, ToolOutput};
use crate::runs::RunHandle;
use certistack_core::grant::NetworkRecoveryMode;
use certistack_core::journal::{Op, Resource};
use certistack_core::validate::{ArchiveName, Vmid};
use certistack_proto::v1 as pb;
use serde_json::json;
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The executor of guest network recovery: rewrites a restored guest's network configuration
/// in its overlay, offline, through an appliance run as a transient unit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GuestNetwork<'a> {
    ctx: &'a NodeContext,
}

impl NodeContext {
    pub(in crate::node) fn guest_network(&self) -> GuestNetwork<'_> {
        GuestNetwork { ctx: self }
    }
}

impl GuestNetwork<'_> {
    /// The unit a recovery runs in, when this daemon starts tools in transient units.
    fn guest_network_unit(
        &self,
        grant: &certistack_core::grant::Grant,
        vmid: Vmid,
        memory_mib: u64,
    ) -> Result<Option<GuestNetworkUnit>, ExecError> {
        if !self.ctx.config.appliance_confined() {
            return Ok(None);
        }
        guest_network_unit(&grant.run_id, vmid, memory_mib)
            .map(Some)
            .map_err(ExecError::Failed)
    }

    /// Stops the recovery unit of `vmid` if one still runs (its stop failed when its step
    /// ended): the overlay it writes is not deleted, nor its backing device unmapped, under it.
    /// Without transient units there is none; a unit already gone costs one `systemctl show`.
    pub(in crate::node) async fn release_recovery_unit(
        &self,
        grant: &certistack_core::grant::Grant,
        vmid: Vmid,
    ) -> Result<(), ExecError> {
        let memory_mib = self.ctx.config.limits.guest_network_memory_mib;
        let Some(unit) = self.guest_network_unit(grant, vmid, memory_mib)? else {
            return Ok(());
        };
        process::release_transient_unit(
            &self.ctx.config.process.systemctl,
            &unit.name,
            &unit.description,
            self.ctx.tool_timeout(),
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

    /// What confines the appliance of a recovery on `device`: a user lent to it alone (the
    /// lease, held until its unit has ended), and the loop device readable to it through its
    /// group (as udev leaves block devices).
    async fn confinement(&self, device: &str) -> Result<(Confinement, IdentityLease), ExecError> {
        let running = users_of_loaded_units(
            &self.ctx.config.process.systemctl,
            APPLIANCE_UNITS,
            self.ctx.tool_timeout(),
        )
        .await
        .map_err(ExecError::Failed)?;
        let lease = lease(
            &self.ctx.config.guest_network.appliance_users,
            &self.ctx.config.pve.passwd,
            &running,
        )
        .map_err(ExecError::ResourceExhausted)?;
        let user = lease.user.clone();
        let disk = group_id(&self.ctx.config.pve.group, LOOP_DEVICE_GROUP)
            .map_err(|e| ExecError::FailedPrecondition(format!("{e}; nothing was written")))?;
        // systemd refuses to start a unit whose SupplementaryGroups= names a missing group
        // (status 216/GROUP): said here instead.
        group_id(&self.ctx.config.pve.group, KVM_GROUP)
            .map_err(|e| ExecError::FailedPrecondition(format!("{e}; nothing was written")))?;
        let loop_device = PathBuf::from(device);
        if let Some(problem) = loop_device_problem(&loop_device, disk) {
            return Err(ExecError::FailedPrecondition(format!(
                "{problem}; nothing was written"
            )));
        }
        let launcher = appliance_launcher().map_err(ExecError::FailedPrecondition)?;
        Ok((
            Confinement {
                user,
                loop_device,
                kvm_device: KVM_DEVICE.into(),
                launcher,
            },
            lease,
        ))
    }

    pub(in crate::node) async fn recover(
        &self,
        run: &RunHandle,
        vmid: Vmid,
        archive: ArchiveName,
        mode: NetworkRecoveryMode,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.ctx.lock_open(run).await?;
        let overlay = Resource::Overlay {
            vmid,
            archive: archive.clone(),
        };
        let vm = Resource::Vm(vmid);
        let (has_overlay, started) = {
            let records = guard.records();
            let states = crate::resources::states(&records);
            let has_overlay = states
                .get(&overlay.key())
                .is_some_and(|s| s.is_open() && s.standing() == crate::resources::Standing::Done);
            let start = &Op::VmStart;
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
        // The overlay's backing must still be this run's mapping of the archive: a loop number
        // reused by another mapping would put another backup's facts into this evidence.
        let device = {
            let records = guard.records();
            let states = crate::resources::states(&records);
            Backups::mapped_device(states.get(&Resource::Backup(archive.clone()).key()))
        }
        .ok_or_else(|| {
            ExecError::FailedPrecondition(format!(
                "{archive} is no longer mapped by this run; clean up and map it again"
            ))
        })?;
        self.ctx.backups().check_mapping(grant, &archive, &device)?;
        let path = self.ctx.overlays().overlay_path(grant, vmid, &archive);
        let mac = sandbox_mac(&grant.run_id, vmid, 0);
        if mode == NetworkRecoveryMode::Preserve {
            let detail = json!({ "mode": mode.name(), "path": path.display().to_string() });
            guard
                .intent(self.ctx.now_ms(), OP, &overlay, detail.clone())
                .await?;
            guard.done(self.ctx.now_ms(), OP, &overlay, detail).await?;
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
        let program = self.ctx.config.tools.guestfish.clone();
        // Checked here, before anything is journaled: started through systemd-run, a missing
        // guestfish would only show as a unit that failed and was collected.
        guestfish_installed(&program).map_err(ExecError::FailedPrecondition)?;
        let appliance = Appliance::from_config(&self.ctx.config);
        let timeout_secs = appliance.timeout.as_secs();
        let memory_mib = appliance.memory_mib;
        let unit = self.guest_network_unit(grant, vmid, memory_mib)?;
        // The user stays lent until the unit is known to have ended, on every path.
        let (confinement, lease) = match &unit {
            Some(unit) => {
                let (confinement, lease) = self.confinement(&device).await?;
                let lease = UnitLease::new(
                    lease,
                    &self.ctx.config.process.systemctl,
                    &unit.name,
                    &unit.description,
                    self.ctx.tool_timeout(),
                );
                (Some(confinement), Some(lease))
            }
            None => (None, None),
        };
        let call = guestfish_call(
            &program,
            &path,
            &appliance,
            unit.as_ref().zip(confinement.as_ref()),
            &self.ctx.config.process.systemd_run,
            &self.ctx.config.process.systemctl,
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
            "appliance_user": confinement.as_ref().map(|c| c.user.name.clone()),
        });
        guard
            .intent(self.ctx.now_ms(), OP, &overlay, intent)
            .await?;
        // The confined appliance writes the overlay as its own user; the overlay goes back to
        // its owner when the session is over (or, if the daemon dies first, is deleted with
        // the run: no one but the run ever reads it).
        let handover = match &confinement {
            Some(confined) => match OverlayHandover::give(&path, &confined.user) {
                Ok(handover) => Some(handover),
                Err(reason) => {
                    return Err(self
                        .ctx
                        .journal_step_error(&mut guard, OP, &overlay, ExecError::Failed(reason))
                        .await);
                }
            },
            None => None,
        };
        let started = Instant::now();
        let mut session = match Session::start(call) {
            Ok(session) => session,
            Err(error) => {
                return Err(self
                    .ctx
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
                .intent(self.ctx.now_ms(), OP, &overlay, json!({ "tool": identity }))
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
        let mut lease = lease;
        if let (Some(unit), Some(lease)) = (&unit, lease.as_mut())
            && let Err(reason) = lease.stop().await
        {
            tracing::warn!(run_id = %grant.run_id, %vmid, unit = %unit.name, %reason, "the guest network recovery's unit was not stopped");
            unit_left = Some(unit.name.clone());
        }
        let given_back = handover.map(OverlayHandover::give_back);
        // The user is free for another appliance once its unit has ended and the overlay is
        // its owner's again; a unit that would not stop keeps it lent.
        if let Some(lease) = lease {
            lease.give_back();
        }
        if let Some(Err(reason)) = &given_back {
            tracing::warn!(run_id = %grant.run_id, %vmid, %reason, "the overlay was not given back after recovery");
        }
        // A unit that survived its stop may still be writing the overlay: the recovery has
        // failed, whatever the appliance said (StartVm stops the unit before it checks).
        let result = match (result, &unit_left) {
            (Ok(_), Some(name)) => Err(RecoveryError::Tool(format!(
                "the recovery unit {name} still runs and could not be stopped, so the overlay may still change; delete the overlay (or clean up the run) and try again"
            ))),
            (result, _) => result,
        };
        // The appliance user could write every byte of the overlay, its header included: a
        // recovery whose overlay no longer names only this run's mapping has failed (StartVm
        // checks again before QEMU opens it).
        let result = match (result, &confinement) {
            (Ok(done), Some(_)) => {
                match crate::node::qcow2_header::check_overlay_header(&path, &device) {
                    Ok(()) => Ok(done),
                    Err(reason) => Err(RecoveryError::Tool(reason)),
                }
            }
            (result, _) => result,
        };
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
                    .failed(self.ctx.now_ms(), OP, &overlay, detail)
                    .await?;
                return Err(exec);
            }
        };
        let output = ToolOutput {
            exit_code: code,
            stdout: String::new(),
            stdout_bytes: Vec::new(),
            stderr: String::new(),
            elapsed,
            truncated: false,
        };
        guard
            .done(
                self.ctx.now_ms(),
                OP,
                &overlay,
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
