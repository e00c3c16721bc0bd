//! The validation script: the happy path from mapping the backup to unmapping it, as a list of
//! steps the driver walks; how the node's answers are read as evidence is in `readings`.

use super::evidence::{Evidence, Recorder, granted_snapshot};
use super::readings::{
    GuestState, check_isolation, expectation_text, guest_network_detail, guest_state, isolation,
    probe_label,
};
use super::session::{Session, guarded};
use super::{RunContext, Stop};
use crate::interrupt::{Interrupts, STOP_AFTER_STEP};
use crate::plan::Validation;
use crate::report::{self, StepResult};
use crate::screenshot;
use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_client::ConnectorClient;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// Between two guest-agent pings while waiting for the guest.
const AGENT_POLL: Duration = Duration::from_secs(2);
/// How long a sandbox VM may take to stop before QEMU is killed.
const STOP_TIMEOUT_SECONDS: u32 = 30;

/// The steps of the validation script, in the order the driver walks them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Each archive of the snapshot mapped read-only.
    MapBackups,
    /// A copy-on-write overlay per sandbox VM and archive.
    CreateOverlays,
    /// The source VM's hardware, for the sandbox VMs to mirror.
    ReadSourceConfig,
    /// The sandbox VMs created.
    CreateVms,
    /// The guest network given a sandbox profile (`rewrite`).
    RecoverGuestNetworks,
    /// The sandbox VNet isolated, and its isolation checked against the grant.
    PrepareSandbox,
    /// The sandbox VMs started.
    StartVms,
    /// Each guest's agent waited for, its run state and facts read.
    GuestAgents,
    /// The probes, from the probe address on the VNet.
    Probes,
    /// The QGA assertions; after them every check has run.
    Assertions,
    /// A picture of the guest's console.
    Screenshot,
    /// Something shows the guest booted: its agent answered or a probe was planned.
    BootShown,
    /// The sandbox VMs stopped and destroyed.
    StopVms,
    /// The sandbox VNet released.
    ReleaseSandbox,
    /// The overlays deleted.
    DeleteOverlays,
    /// The archives unmapped.
    UnmapBackups,
}

/// The happy path: map, overlay, create, recover the network, prepare the sandbox, start, the
/// guest's agent and facts, probes, assertions, the picture, then the happy path's own teardown.
const SCRIPT: [Step; 16] = [
    Step::MapBackups,
    Step::CreateOverlays,
    Step::ReadSourceConfig,
    Step::CreateVms,
    Step::RecoverGuestNetworks,
    Step::PrepareSandbox,
    Step::StartVms,
    Step::GuestAgents,
    Step::Probes,
    Step::Assertions,
    Step::Screenshot,
    Step::BootShown,
    Step::StopVms,
    Step::ReleaseSandbox,
    Step::DeleteOverlays,
    Step::UnmapBackups,
];

impl Step {
    async fn run(self, run: &mut Script<'_, '_>) -> Result<(), Stop> {
        match self {
            Step::MapBackups => map_backups(run).await,
            Step::CreateOverlays => create_overlays(run).await,
            Step::ReadSourceConfig => read_source_config(run).await,
            Step::CreateVms => create_vms(run).await,
            Step::RecoverGuestNetworks => recover_guest_networks(run).await,
            Step::PrepareSandbox => prepare_sandbox(run).await,
            Step::StartVms => start_vms(run).await,
            Step::GuestAgents => guest_agents(run).await,
            Step::Probes => probes(run).await,
            Step::Assertions => assertions(run).await,
            Step::Screenshot => take_screenshot(run).await,
            Step::BootShown => boot_shown(run).await,
            Step::StopVms => stop_vms(run).await,
            Step::ReleaseSandbox => release_sandbox(run).await,
            Step::DeleteOverlays => delete_overlays(run).await,
            Step::UnmapBackups => unmap_backups(run).await,
        }
    }
}

/// What every step of one validation's script works with.
struct Script<'a, 'r> {
    context: &'a RunContext,
    recorder: &'a mut Recorder<'r>,
    evidence: &'a mut Evidence,
    validation: &'a Validation,
    client: ConnectorClient<Channel>,
    interrupts: Interrupts,
    /// When the steps stop, early enough for cleanup to run with the run's own certificate.
    deadline: Instant,
}

/// One node call of the script: not made once the operator interrupted; recorded as a step, its
/// reply's journal head kept to check against the journal the node streams at the end.
macro_rules! step {
    ($run:ident, $name:expr, $detail:expr, $call:expr) => {{
        if *$run.interrupts.borrow() >= STOP_AFTER_STEP {
            return Err(Stop::Interrupted(format!(
                "interrupted by the operator before step {}",
                $name
            )));
        }
        let at = $run.recorder.begin($name);
        match guarded(&mut $run.interrupts, $run.deadline, $call).await {
            Ok(reply) => {
                $run.recorder
                    .end($name, at, StepResult::Ok, $detail(&reply));
                // Kept to check against the journal the node streams at the end.
                $run.evidence
                    .heads
                    .push(($name.to_string(), reply.journal_head.clone()));
                reply
            }
            Err(stop) => {
                $run.recorder
                    .end($name, at, StepResult::Failed, stop.reason().to_owned());
                return Err(match stop {
                    Stop::Refused(t) => Stop::Refused(format!("step {}: {t}", $name)),
                    other => other,
                });
            }
        }
    }};
}

/// The happy path, step by step; `None` when it ran to the end (checks that failed are in
/// `evidence.failures`), otherwise why it stopped early.
pub(super) async fn steps(
    context: &RunContext,
    recorder: &mut Recorder<'_>,
    evidence: &mut Evidence,
    session: &mut Session,
    validation: &Validation,
    deadline: Instant,
) -> Option<Stop> {
    let Some(client) = session.client.clone() else {
        return Some(Stop::Lost("no connection".into()));
    };
    let mut run = Script {
        context,
        recorder,
        evidence,
        validation,
        client,
        interrupts: context.interrupts.clone(),
        deadline,
    };
    for step in SCRIPT {
        if let Err(stop) = step.run(&mut run).await {
            return Some(stop);
        }
    }
    None
}

/// Each archive of the snapshot mapped read-only.
async fn map_backups(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let context = run.context;
    let grant = &run.validation.grant;
    let snapshot = grant.snapshot.to_string();
    for archive in &grant.archives {
        let name = format!("map {archive}");
        step!(
            run,
            name.as_str(),
            |r: &pb::MapBackupReply| format!("{} read-only", r.loop_device),
            run.client.map_backup(pb::MapBackupRequest {
                snapshot: snapshot.clone(),
                archive: archive.to_string(),
                pbs_secret: context.secrets.pbs_secret.to_string(),
                encryption_key: context
                    .secrets
                    .encryption_key
                    .as_ref()
                    .map(|k| k.to_vec())
                    .unwrap_or_default(),
            })
        );
    }
    Ok(())
}

/// A copy-on-write overlay per sandbox VM and archive.
async fn create_overlays(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let grant = &run.validation.grant;
    for vmid in grant.sandbox_vms.keys() {
        for archive in &grant.archives {
            let name = format!("overlay {vmid} {archive}");
            step!(
                run,
                name.as_str(),
                |r: &pb::CreateOverlayReply| r.warnings.join("; "),
                run.client.create_overlay(pb::CreateOverlayRequest {
                    vmid: vmid.get(),
                    archive: archive.to_string(),
                })
            );
        }
    }
    Ok(())
}

/// The source VM's hardware, for the sandbox VMs to mirror.
async fn read_source_config(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let context = run.context;
    let grant = &run.validation.grant;
    let snapshot = run.validation.grant.snapshot.to_string();
    // The sandbox gets the source VM's hardware: its CPU, firmware, disk buses and NIC models.
    // Passthrough and whatever reaches outside the sandbox are left out and reported.
    let source = step!(
        run,
        "read source config",
        |r: &pb::ReadSourceConfigReply| {
            let omitted = r.hardware.as_ref().map_or(0, |h| h.omitted.len());
            // The node's word: shown only in the form it must have.
            let manifest = r
                .manifest
                .as_ref()
                .map(|m| m.sha256.as_str())
                .filter(|d| report::is_sha256_hex(d))
                .unwrap_or("(none or malformed)");
            format!(
                "manifest sha256 {manifest}; config sha256 {}; {omitted} parts omitted",
                r.config_sha256
            )
        },
        run.client.read_source_config(pb::ReadSourceConfigRequest {
            snapshot: snapshot.clone(),
            pbs_secret: context.secrets.pbs_secret.to_string(),
            encryption_key: context
                .secrets
                .encryption_key
                .as_ref()
                .map(|k| k.to_vec())
                .unwrap_or_default(),
        })
    );
    // The report names the backup by the manifest's digests; a manifest that does not name
    // every archive of the run leaves nothing to name them by.
    let mut snapshot = granted_snapshot(grant);
    snapshot
        .take_manifest(&source.manifest.clone().unwrap_or_default())
        .map_err(|reason| Stop::Refused(format!("step read source config: {reason}")))?;
    run.evidence.snapshot = Some(snapshot);
    run.evidence.hardware = source.hardware.as_ref().map(|h| {
        let archives: Vec<String> = grant.archives.iter().map(ToString::to_string).collect();
        report::SandboxHardware::from_wire(h, &source.config_sha256, &archives)
    });
    Ok(())
}

/// The sandbox VMs created.
async fn create_vms(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let grant = &run.validation.grant;
    for (vmid, limits) in &grant.sandbox_vms {
        let name = format!("create {vmid}");
        step!(
            run,
            name.as_str(),
            |r: &pb::CreateVmReply| format!("smbios uuid {}", r.smbios_uuid),
            run.client.create_vm(pb::CreateVmRequest {
                vmid: vmid.get(),
                cores: limits.max_cores,
                memory_mib: limits.max_memory_mib,
                archives: grant.archives.iter().map(ToString::to_string).collect(),
                mirror_source_hardware: true,
            })
        );
    }
    Ok(())
}

/// The guest network given a sandbox profile (`rewrite`).
async fn recover_guest_networks(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let validation = run.validation;
    let grant = &validation.grant;
    // A guest whose own configuration names a production network gets a sandbox profile in
    // its overlay before its first start (docs/guest-network.md); `preserve` leaves it as is.
    if validation.network_recovery == crate::plan::NetworkRecoveryMode::Rewrite {
        // The guest's root filesystem is on a disk, not on its EFI vars or TPM state.
        let boot = grant.archives.iter().find(|a| !a.holds_firmware_state());
        if let Some(boot) = boot {
            for vmid in grant.sandbox_vms.keys() {
                let name = format!("recover network {vmid}");
                step!(
                    run,
                    name.as_str(),
                    |r: &pb::RecoverGuestNetworkReply| guest_network_detail(r),
                    run.client
                        .recover_guest_network(pb::RecoverGuestNetworkRequest {
                            vmid: vmid.get(),
                            archive: boot.to_string(),
                            mode: pb::NetworkRecoveryMode::Rewrite.into(),
                        })
                );
            }
        }
    }
    Ok(())
}

/// The sandbox VNet isolated, and its isolation checked against the grant.
async fn prepare_sandbox(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let grant = &run.validation.grant;
    let sandbox = step!(
        run,
        "prepare sandbox",
        |r: &pb::PrepareSandboxReply| format!(
            "ports [{}] forwarding [{}]",
            r.bridge_ports.join(", "),
            r.forwarding_sysctl.replace('\n', ", ")
        ),
        run.client.prepare_sandbox(pb::PrepareSandboxRequest {
            vnet: grant.vnet.to_string(),
            probe_source: grant.probe_source.to_string(),
        })
    );
    let observed = isolation(&sandbox);
    let proven = check_isolation(&observed, &sandbox.bridge_port_owners, grant);
    run.evidence.isolation = Some(observed);
    if let Err(reason) = proven {
        // The controller does not sign a restore whose containment it cannot show.
        return Err(Stop::Refused(format!(
            "isolation not proven by the node's evidence: {reason}"
        )));
    }
    Ok(())
}

/// The sandbox VMs started.
async fn start_vms(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let grant = &run.validation.grant;
    for vmid in grant.sandbox_vms.keys() {
        let name = format!("start {vmid}");
        step!(
            run,
            name.as_str(),
            |_: &pb::VmReply| String::new(),
            run.client.start_vm(pb::VmRequest { vmid: vmid.get() })
        );
    }
    Ok(())
}

/// Each guest's agent waited for, its run state and facts read.
async fn guest_agents(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let validation = run.validation;
    let grant = &validation.grant;
    let deadline = run.deadline;
    // Guest agent: bounded wait, then facts. A guest without an agent is reported, not failed:
    // probes still decide.
    for vmid in grant.sandbox_vms.keys() {
        let name = format!("guest agent {vmid}");
        let at = run.recorder.begin(&name);
        let wait = Duration::from_secs(u64::from(validation.guest_agent_seconds));
        let until = (Instant::now() + wait).min(deadline);
        let mut answered = false;
        let mut last = String::new();
        while Instant::now() < until {
            if *run.interrupts.borrow() >= STOP_AFTER_STEP {
                run.recorder
                    .end(&name, at, StepResult::Failed, "interrupted".into());
                return Err(Stop::Interrupted(format!(
                    "interrupted by the operator while waiting for the guest agent of {vmid}"
                )));
            }
            match guarded(
                &mut run.interrupts,
                until,
                run.client.qga(pb::QgaRequest {
                    vmid: vmid.get(),
                    call: Some(pb::qga_request::Call::Command(pb::QgaCommand::Ping.into())),
                }),
            )
            .await
            {
                Ok(_) => {
                    answered = true;
                    break;
                }
                Err(Stop::Refused(text)) => last = text,
                Err(Stop::Deadline(_)) => break,
                Err(stop) => {
                    run.recorder
                        .end(&name, at, StepResult::Failed, format!("{stop:?}"));
                    return Err(stop);
                }
            }
            let pause = tokio::time::sleep(AGENT_POLL);
            let mut abandon = run.interrupts.clone();
            tokio::select! {
                () = pause => {}
                _ = abandon.changed() => {}
            }
        }
        let detail = if answered {
            "answered".to_owned()
        } else {
            format!(
                "no answer within {} s ({last})",
                validation.guest_agent_seconds
            )
        };
        run.recorder.end(
            &name,
            at,
            if answered {
                StepResult::Ok
            } else {
                StepResult::Failed
            },
            detail,
        );
        run.evidence.agent_answered |= answered;
        let status = step!(
            run,
            format!("qmp status {vmid}").as_str(),
            |r: &pb::QmpReply| r.result_json.clone(),
            run.client.qmp(pb::QmpRequest {
                vmid: vmid.get(),
                command: pb::QmpCommand::QueryStatus.into(),
            })
        );
        let status = serde_json::from_str::<serde_json::Value>(&status.result_json)
            .ok()
            .and_then(|v| v.get("status").and_then(|s| s.as_str()).map(str::to_owned))
            .unwrap_or_else(|| "unknown".into());
        match guest_state(&status) {
            GuestState::Running => {}
            // The guest itself stopped on an error or shut down: run.evidence about the backup.
            GuestState::Stopped => run.evidence.failures.push(format!(
                "VM {vmid} is {status:?} after start: the restored guest stopped"
            )),
            // Paused, still launching, migrating: the node's state, not the backup's.
            GuestState::NotJudged => {
                return Err(Stop::Refused(format!(
                    "VM {vmid} is {status:?} after start: the node holds it, so the guest cannot be judged"
                )));
            }
        }
        let mut facts = report::GuestFacts {
            status,
            os_info: serde_json::Value::Null,
            interfaces: serde_json::Value::Null,
        };
        if answered {
            for (command, label, slot) in [
                (pb::QgaCommand::GetOsinfo, "guest-get-osinfo", 0),
                (
                    pb::QgaCommand::NetworkGetInterfaces,
                    "guest-network-get-interfaces",
                    1,
                ),
            ] {
                let name = format!("qga {label} {vmid}");
                let at = run.recorder.begin(&name);
                match guarded(
                    &mut run.interrupts,
                    deadline,
                    run.client.qga(pb::QgaRequest {
                        vmid: vmid.get(),
                        call: Some(pb::qga_request::Call::Command(command.into())),
                    }),
                )
                .await
                {
                    Ok(reply) => {
                        let value = serde_json::from_str(&reply.result_json)
                            .unwrap_or(serde_json::Value::String(reply.result_json));
                        if slot == 0 {
                            facts.os_info = value;
                        } else {
                            facts.interfaces = value;
                        }
                        run.recorder.end(&name, at, StepResult::Ok, String::new());
                    }
                    Err(Stop::Refused(text)) => {
                        run.recorder.end(&name, at, StepResult::Failed, text);
                    }
                    Err(stop) => {
                        run.recorder
                            .end(&name, at, StepResult::Failed, format!("{stop:?}"));
                        return Err(stop);
                    }
                }
            }
        }
        if run.evidence.guest.is_none() {
            run.evidence.guest = Some(facts);
        }
    }
    Ok(())
}

/// The probes, from the probe address on the VNet.
async fn probes(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let validation = run.validation;
    let grant = &validation.grant;
    // Probes, from the probe address on the VNet.
    for target in &validation.wire.probe_targets {
        let kind = pb::ProbeKind::try_from(target.kind).unwrap_or(pb::ProbeKind::Unspecified);
        let label = probe_label(kind, &target.address, target.port);
        let name = format!("probe {label}");
        let reply = step!(
            run,
            name.as_str(),
            |r: &pb::ProbeReply| r.detail.clone(),
            run.client.probe(pb::ProbeRequest {
                kind: target.kind,
                address: target.address.clone(),
                port: target.port,
            })
        );
        let passed = reply.outcome == i32::from(pb::ProbeOutcome::Passed);
        let expected_origin = format!("worker_host {}", grant.probe_source.address);
        if reply.origin != expected_origin {
            run.evidence.isolation_failures.push(format!(
                "probe {label} ran from {:?}, not from the probe address ({expected_origin})",
                reply.origin
            ));
        }
        if !passed {
            run.evidence
                .failures
                .push(format!("probe {label} failed: {}", reply.detail));
        }
        run.evidence.probes.push(report::ProbeResult {
            target: label,
            expected: target
                .expect
                .as_ref()
                .map(expectation_text)
                .unwrap_or_default(),
            outcome: pb::ProbeOutcome::try_from(reply.outcome)
                .map(|o| {
                    o.as_str_name()
                        .trim_start_matches("PROBE_OUTCOME_")
                        .to_owned()
                })
                .unwrap_or_else(|_| reply.outcome.to_string()),
            origin: reply.origin.clone(),
            passed,
            latency_us: reply.latency_us,
            detail: reply.detail.clone(),
            received_sha256: reply.received_sha256.clone(),
            tls_certificate_sha256: reply.tls_certificate_sha256.clone(),
        });
    }
    Ok(())
}

/// The QGA assertions; after them every check has run.
async fn assertions(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let grant = &run.validation.grant;
    // QGA assertions, on the first sandbox VM (the grant names programs, not VMs).
    if let Some(vmid) = grant.sandbox_vms.keys().next() {
        for id in grant.qga_assertions.keys() {
            let name = format!("assertion {id}");
            let reply = step!(
                run,
                name.as_str(),
                |r: &pb::QgaReply| format!("exit {}", r.exit_code),
                run.client.qga(pb::QgaRequest {
                    vmid: vmid.get(),
                    call: Some(pb::qga_request::Call::AssertionId(id.to_string())),
                })
            );
            if !reply.assertion_passed {
                run.evidence.failures.push(format!(
                    "assertion {id} failed (exit code {})",
                    reply.exit_code
                ));
            }
            run.evidence.assertions.push(report::AssertionResult {
                name: id.to_string(),
                exit_code: reply.exit_code,
                passed: reply.assertion_passed,
                detail: reply.result_json.clone(),
            });
        }
    }
    run.evidence.checks_complete = true;
    Ok(())
}

/// A picture of the guest's console.
async fn take_screenshot(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let grant = &run.validation.grant;
    let deadline = run.deadline;
    // A picture of the guest's console at verdict time, for the person reading the report.
    if let Some(vmid) = grant.sandbox_vms.keys().next() {
        let name = format!("screenshot {vmid}");
        let at = run.recorder.begin(&name);
        match guarded(
            &mut run.interrupts,
            deadline,
            run.client.qmp(pb::QmpRequest {
                vmid: vmid.get(),
                command: pb::QmpCommand::Screendump.into(),
            }),
        )
        .await
        {
            Ok(reply) => match screenshot::screenshot_png(&reply) {
                Ok(shot) => {
                    run.recorder.end(
                        &name,
                        at,
                        StepResult::Ok,
                        format!(
                            "{}x{} PNG, {} bytes",
                            shot.width,
                            shot.height,
                            shot.png.len()
                        ),
                    );
                    run.evidence.screenshot = Some(shot);
                }
                Err(error) => run
                    .recorder
                    .end(&name, at, StepResult::Failed, error.to_string()),
            },
            Err(Stop::Refused(text)) => run.recorder.end(&name, at, StepResult::Failed, text),
            Err(stop) => {
                run.recorder
                    .end(&name, at, StepResult::Failed, format!("{stop:?}"));
                return Err(stop);
            }
        }
    }
    Ok(())
}

/// Something shows the guest booted: its agent answered or a probe was planned.
async fn boot_shown(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let validation = run.validation;
    let grant = &validation.grant;
    if !run.evidence.agent_answered && grant.probe_targets.is_empty() {
        run.evidence.failures.push(format!(
            "the guest agent did not answer within {} s and no probe was planned: nothing shows the guest booted",
            validation.guest_agent_seconds
        ));
    }
    Ok(())
}

/// The sandbox VMs stopped and destroyed.
async fn stop_vms(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let grant = &run.validation.grant;
    // Teardown of the happy path, newest first; anything it leaves, Cleanup finds.
    for vmid in grant.sandbox_vms.keys() {
        step!(
            run,
            format!("stop {vmid}").as_str(),
            |_: &pb::VmReply| String::new(),
            run.client.stop_vm(pb::StopVmRequest {
                vmid: vmid.get(),
                timeout_seconds: STOP_TIMEOUT_SECONDS,
            })
        );
        step!(
            run,
            format!("destroy {vmid}").as_str(),
            |_: &pb::VmReply| String::new(),
            run.client.destroy_vm(pb::VmRequest { vmid: vmid.get() })
        );
    }
    Ok(())
}

/// The sandbox VNet released.
async fn release_sandbox(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let grant = &run.validation.grant;
    step!(
        run,
        "release sandbox",
        |_: &pb::ReleaseSandboxReply| String::new(),
        run.client.release_sandbox(pb::ReleaseSandboxRequest {
            vnet: grant.vnet.to_string(),
        })
    );
    Ok(())
}

/// The overlays deleted.
async fn delete_overlays(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let grant = &run.validation.grant;
    for vmid in grant.sandbox_vms.keys() {
        for archive in &grant.archives {
            step!(
                run,
                format!("delete overlay {vmid} {archive}").as_str(),
                |_: &pb::DeleteOverlayReply| String::new(),
                run.client.delete_overlay(pb::DeleteOverlayRequest {
                    vmid: vmid.get(),
                    archive: archive.to_string(),
                })
            );
        }
    }
    Ok(())
}

/// The archives unmapped.
async fn unmap_backups(run: &mut Script<'_, '_>) -> Result<(), Stop> {
    let grant = &run.validation.grant;
    for archive in &grant.archives {
        step!(
            run,
            format!("unmap {archive}").as_str(),
            |_: &pb::UnmapBackupReply| String::new(),
            run.client.unmap_backup(pb::UnmapBackupRequest {
                archive: archive.to_string(),
            })
        );
    }
    Ok(())
}
