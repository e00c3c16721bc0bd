//! Backups mapped read-only by `proxmox-backup-client map`, the run's `backup:<archive>`.
//!
//! A mapping is named by PBS `<repository>:<snapshot>/<archive>`; its backing file under the
//! PBS loop-device directory carries that name, escaped. Runs on one node never share a
//! mapping name (see `runs::overlap`), so the name identifies the run's mapping even when the
//! journal does not know the device: after a step whose outcome is unknown, cleanup finds the
//! mapping by name. Unmapping goes by name whenever the name matches exactly one mapping
//! (the client matches names by suffix), which needs no read-then-unmap of a device number
//! and works for loop devices the client cannot name by number (>= 256); otherwise by device,
//! only while the device is still backed by this run's mapping.

use super::{context::NodeContext, loopdev, repository_string, tool_detail, tool_result};
use crate::action::EncryptionKey;
use crate::executor::{ExecError, Outcome};
use crate::process::{self, SecretInput, SecretKind, ToolCall, ToolOutput, TransientRole};
use crate::resources::{EndState, ResourceState, Standing};
use crate::runs::{RunGuard, RunHandle};
use crate::source_hardware::{MAX_CONFIG_BYTES, SourceConfigError, SourceHardware};
use certistack_core::grant::Grant;
use certistack_core::journal::{Op, Resource};
use certistack_core::journal::{Phase, Record};
use certistack_core::validate::{ArchiveName, Secret, Snapshot};
use certistack_proto::v1 as pb;
use serde_json::json;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The blob every PVE VM backup carries the VM's config in.
const SOURCE_CONFIG_ARCHIVE: &str = "qemu-server.conf";
/// Journal op and key of the source config read: nothing on the node to undo.
pub(super) const SOURCE_CONFIG_OP: &Op = &Op::SourceConfig;
const SOURCE_CONFIG_RESOURCE: &Resource = &Resource::SourceConfig;

/// The descriptor `proxmox-backup-client` reads the password from (`PBS_PASSWORD_FD`).
const PASSWORD_FD: i32 = 3;
/// The descriptor the encryption key is passed on (`--keyfile /proc/self/fd/4`).
const KEYFILE_FD: i32 = 4;

fn loop_device_of(detail: Option<&serde_json::Value>) -> Option<String> {
    detail?.get("loop_device")?.as_str().map(str::to_owned)
}

/// The records since the resource was last undone: the current life of the mapping.
fn current_life(state: &ResourceState) -> &[Record] {
    let start = state
        .history
        .iter()
        .rposition(|r| r.entry.phase == Phase::Undone)
        .map_or(0, |i| i.saturating_add(1));
    state.history.get(start..).unwrap_or_default()
}

/// Every holder, described with the command that releases it.
pub(super) fn describe_holders(holders: &[loopdev::DmHolder]) -> String {
    holders
        .iter()
        .map(loopdev::DmHolder::describe)
        .collect::<Vec<_>>()
        .join("; ")
}

/// The executor of backups: maps a PBS backup's archive to a loop device, reads a snapshot's
/// source configuration, and unmaps what the run mapped.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Backups<'a> {
    ctx: &'a NodeContext,
}

impl NodeContext {
    pub(in crate::node) fn backups(&self) -> Backups<'_> {
        Backups { ctx: self }
    }
}

impl Backups<'_> {
    /// The mapping name PBS gives this run's mapping of `archive`, unescaped, as `unmap` takes it.
    fn mapping_name(&self, grant: &Grant, archive: &ArchiveName) -> String {
        format!(
            "{}:{}/{}",
            repository_string(&grant.repository),
            grant.snapshot.as_str(),
            archive.as_str()
        )
    }

    pub(super) fn expected_backing(&self, grant: &Grant, archive: &ArchiveName) -> PathBuf {
        let name = loopdev::backing_file_name(
            &repository_string(&grant.repository),
            grant.snapshot.as_str(),
            archive.as_str(),
        );
        self.ctx.config.pve.pbs_loopdev_dir.join(name)
    }

    /// The device of the run's live, completed mapping of `archive`, from the journal.
    pub(in crate::node) fn mapped_device(state: Option<&ResourceState>) -> Option<String> {
        state
            .filter(|s| s.is_open() && s.standing() == Standing::Done)
            .and_then(|s| loop_device_of(s.done_detail.as_ref()))
    }

    /// Ownership re-check before building on or booting from a mapping: `device` must still be
    /// this run's live, read-only mapping of `archive` (a dead mapping's number can be reused),
    /// and the process serving its data must still be alive.
    pub(in crate::node) fn check_mapping(
        &self,
        grant: &Grant,
        archive: &ArchiveName,
        device: &str,
    ) -> Result<(), ExecError> {
        let expected = self.expected_backing(grant, archive);
        match loopdev::inspect(&self.ctx.sys_block, device) {
            Some(l) if l.serves(&expected) => {}
            _ => {
                return Err(ExecError::FailedPrecondition(format!(
                    "{device} is no longer this run's read-only mapping of {archive}; clean up and map again"
                )));
            }
        }
        if let Some(problem) = loopdev::holder_problem(
            &expected,
            &self.ctx.config.tools.proxmox_backup_client,
            archive.as_str(),
        ) {
            return Err(ExecError::FailedPrecondition(format!(
                "the mapping of {archive} on {device} is dead: {problem}; call Cleanup (or UnmapBackup) and map it again"
            )));
        }
        // The path sysfs shows is a name: the file the driver reads must be the one at that
        // name. A descriptor holder with LOOP_CHANGE_FD could have swapped it (the confined
        // appliance cannot: its launcher forbids loop ioctls).
        let held = loopdev::backing_identity(Path::new(device));
        let named = loopdev::BackingIdentity::of_file(&expected);
        match (held, named) {
            (Ok(held), Ok(named)) if held == named => {}
            (Ok(held), Ok(named)) => {
                return Err(ExecError::FailedPrecondition(format!(
                    "{device} reads another file ({held}) than this run's mapping of {archive} at {} ({named}): its backing was swapped; call Cleanup and map it again",
                    expected.display()
                )));
            }
            (Err(error), _) => {
                return Err(ExecError::FailedPrecondition(format!(
                    "cannot read which file {device} reads (LOOP_GET_STATUS64: {error}); call Cleanup and map {archive} again"
                )));
            }
            (_, Err(error)) => {
                return Err(ExecError::FailedPrecondition(format!(
                    "cannot read this run's mapping of {archive} at {} ({error}); call Cleanup and map it again",
                    expected.display()
                )));
            }
        }
        // The host's LVM activated a volume of the guest: the host reads (and may write
        // metadata of) the disk under test, and the mapping cannot be undone while it does.
        let holders = loopdev::device_mapper_holders(&self.ctx.sys_block, device);
        if !holders.is_empty() {
            return Err(ExecError::FailedPrecondition(format!(
                "the host uses the mapping of {archive}: {}; then retry",
                describe_holders(&holders)
            )));
        }
        Ok(())
    }

    /// Loop devices currently backed by this run's mapping of `archive`, read-only or not.
    pub(super) fn our_loops(
        &self,
        grant: &Grant,
        archive: &ArchiveName,
    ) -> Vec<loopdev::LoopDevice> {
        let expected = self.expected_backing(grant, archive);
        loopdev::attached(&self.ctx.sys_block)
            .into_iter()
            .filter(|l| l.backing_file == expected)
            .collect()
    }

    /// Whether `unmap <name>` would pick exactly this run's mapping: the client takes the first
    /// mapping whose escaped name ends with the escaped name given.
    fn name_is_unique(&self, grant: &Grant, archive: &ArchiveName) -> bool {
        let expected = self.expected_backing(grant, archive);
        let Some(ours) = expected.file_name().and_then(|n| n.to_str()) else {
            return false;
        };
        let Ok(entries) = std::fs::read_dir(&self.ctx.config.pve.pbs_loopdev_dir) else {
            return false;
        };
        let matching: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| !n.ends_with(".pid") && n.ends_with(ours))
            .collect();
        matching == [ours]
    }

    /// The transient unit (name, description) a mapping of `archive` for this run lives in,
    /// when this daemon starts holders in units.
    fn map_unit(&self, grant: &Grant, archive: &ArchiveName) -> Option<(String, String)> {
        if !self.ctx.config.process.use_transient_units() {
            return None;
        }
        let run_id = grant.run_id.as_str();
        let unit = process::transient_unit_name(TransientRole::MapHolder, run_id, archive.as_str())
            .ok()?;
        let description =
            process::transient_unit_description(TransientRole::MapHolder, run_id, archive.as_str());
        Some((unit, description))
    }

    /// Stops and forgets the mapping's unit once its holder is gone (unmap, cleanup,
    /// recovery), after checking the unit is this run's.
    async fn release_map_unit(&self, grant: &Grant, archive: &ArchiveName) {
        let Some((unit, description)) = self.map_unit(grant, archive) else {
            return;
        };
        if let Err(reason) = process::release_transient_unit(
            &self.ctx.config.process.systemctl,
            &unit,
            &description,
            self.ctx.tool_timeout(),
        )
        .await
        {
            tracing::warn!(run_id = %grant.run_id, %archive, unit, %reason, "the mapping's unit was not released");
        }
    }

    /// A `proxmox-backup-client` call on the grant's repository: the PBS secret goes through a
    /// pipe (`PBS_PASSWORD_FD`), the encryption key through a memfd, never argv or environment.
    pub(super) fn pbs_call(
        &self,
        grant: &Grant,
        args: &[&str],
        timeout: Duration,
        secret: Secret,
        key: Option<EncryptionKey>,
    ) -> ToolCall {
        let mut call = args.iter().fold(
            ToolCall::new(&self.ctx.config.tools.proxmox_backup_client, timeout),
            |call, arg| call.arg(arg),
        );
        call = call
            .arg("--repository")
            .arg(repository_string(&grant.repository))
            .env("PBS_PASSWORD_FD", PASSWORD_FD.to_string())
            .env("PBS_FINGERPRINT", grant.repository.fingerprint.to_string())
            .secret(SecretInput {
                child_fd: PASSWORD_FD,
                bytes: zeroize::Zeroizing::new(secret.expose().as_bytes().to_vec()),
                kind: SecretKind::Pipe,
            });
        drop(secret);
        if !grant.repository.namespace.as_str().is_empty() {
            call = call.arg("--ns").arg(grant.repository.namespace.as_str());
        }
        if let Some(key) = key {
            call = call
                .arg("--keyfile")
                .arg(format!("/proc/self/fd/{KEYFILE_FD}"))
                .secret(SecretInput {
                    child_fd: KEYFILE_FD,
                    bytes: key.0,
                    kind: SecretKind::Memfd,
                });
        }
        call
    }

    /// The snapshot's manifest (`manifest::read_manifest`), then `proxmox-backup-client restore
    /// <snapshot> qemu-server.conf -`: the source VM's config, parsed into the hardware shape the
    /// run's sandbox VMs may mirror. Journaled with the shape, so `CreateVm` (and a restarted
    /// daemon) uses exactly what was read here.
    pub(super) async fn read_source_config(
        &self,
        run: &RunHandle,
        snapshot: Snapshot,
        secret: Secret,
        key: Option<EncryptionKey>,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.ctx.lock_open(run).await?;
        // The manifest first: the report names the backup by its checksums, so a snapshot whose
        // manifest is refused is not used.
        let manifest = self
            .ctx
            .read_manifest(&mut guard, grant, &snapshot, secret.clone(), key.clone())
            .await?;
        let call = self
            .pbs_call(
                grant,
                &["restore", snapshot.as_str(), SOURCE_CONFIG_ARCHIVE, "-"],
                self.ctx.tool_timeout(),
                secret,
                key,
            )
            // One byte over the limit tells an oversized config from one that fits.
            .output_cap(MAX_CONFIG_BYTES.saturating_add(1));
        guard
            .intent(
                self.ctx.now_ms(),
                SOURCE_CONFIG_OP,
                SOURCE_CONFIG_RESOURCE,
                json!({ "snapshot": snapshot.as_str(), "command": call.display() }),
            )
            .await?;
        let output = self
            .ctx
            .run_step(&mut guard, SOURCE_CONFIG_OP, SOURCE_CONFIG_RESOURCE, call)
            .await?;
        if !output.success() {
            self.ctx
                .journal_tool_failed(
                    &mut guard,
                    SOURCE_CONFIG_OP,
                    SOURCE_CONFIG_RESOURCE,
                    &output,
                    &[],
                )
                .await?;
            return Err(ExecError::FailedPrecondition(format!(
                "proxmox-backup-client could not read {SOURCE_CONFIG_ARCHIVE} of {snapshot} (exit {:?}): {}",
                output.exit_code,
                output.stderr_excerpt()
            )));
        }
        let parsed = if output.truncated {
            Err(SourceConfigError::TooLarge)
        } else {
            SourceHardware::parse(output.stdout.as_bytes())
        };
        let config_sha256 = hex::encode(Sha256::digest(output.stdout.as_bytes()));
        let hardware = match parsed {
            Ok(hardware) => hardware,
            Err(error) => {
                let reason = error.to_string();
                self.ctx
                    .journal_tool_failed(
                        &mut guard,
                        SOURCE_CONFIG_OP,
                        SOURCE_CONFIG_RESOURCE,
                        &output,
                        &[
                            ("reason", json!(reason)),
                            ("config_sha256", json!(config_sha256)),
                        ],
                    )
                    .await?;
                return Err(ExecError::FailedPrecondition(format!(
                    "the VM config in {snapshot} cannot be mirrored: {reason}; the sandbox is not created from it"
                )));
            }
        };
        let journaled = serde_json::to_value(&hardware).map_err(|e| {
            ExecError::Failed(format!("the source hardware cannot be journaled: {e}"))
        })?;
        guard
            .done(
                self.ctx.now_ms(),
                SOURCE_CONFIG_OP,
                SOURCE_CONFIG_RESOURCE,
                tool_detail(
                    &output,
                    &[
                        ("config_sha256", json!(config_sha256)),
                        ("hardware", journaled),
                    ],
                ),
            )
            .await?;
        Ok(Outcome::ReadSourceConfig(pb::ReadSourceConfigReply {
            hardware: Some(hardware.to_wire()),
            tool: Some(tool_result("proxmox-backup-client restore", &output)),
            journal_head: guard.head_hex(),
            config_sha256,
            manifest: Some(manifest),
        }))
    }

    pub(super) async fn map(
        &self,
        run: &RunHandle,
        snapshot: Snapshot,
        archive: ArchiveName,
        secret: Secret,
        key: Option<EncryptionKey>,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.ctx.lock_open(run).await?;
        let resource = Resource::Backup(archive.clone());
        if let Some(state) = crate::resources::states(&guard.records())
            .get(&resource.key())
            .filter(|s| s.is_open())
        {
            return Err(ExecError::AlreadyExists(format!(
                "{archive} is already mapped by this run (last step: {} {}); unmap it or clean up first",
                state.last.entry.op,
                state.last.entry.phase.name()
            )));
        }
        let op = &Op::BackupMap;
        let repository = repository_string(&grant.repository);
        let encrypted = key.is_some();
        let mut call = self.pbs_call(
            grant,
            &["map", snapshot.as_str(), archive.as_str()],
            Duration::from_secs(self.ctx.config.limits.map_timeout_secs),
            secret,
            key,
        );
        // Under systemd the holder lives in a unit of its own, so restarting or upgrading the
        // daemon keeps the mapping. A key file cannot cross into a unit (systemd-run hands on
        // stdio only): an encrypted backup's holder stays the daemon's child.
        let unit = match self.map_unit(grant, &archive) {
            Some((unit, description)) if !encrypted => {
                call = process::in_transient_unit(
                    call,
                    TransientRole::MapHolder,
                    &unit,
                    &description,
                    &self.ctx.config.process.systemd_run,
                    &self.ctx.config.process.systemctl,
                    Some("PBS_PASSWORD_FD"),
                )
                .map_err(ExecError::Failed)?;
                Some(unit)
            }
            Some((unit, _)) => {
                tracing::warn!(run_id = %grant.run_id, %archive, unit, "an encrypted backup's mapping holder runs as the daemon's child: a restart of the daemon unmaps it");
                None
            }
            None => None,
        };
        guard.intent(
            self.ctx.now_ms(),
            op,
            &resource,
            json!({ "snapshot": snapshot.as_str(), "archive": archive.as_str(), "repository": repository, "command": call.display(), "unit": unit }),
        ).await?;
        let output = match self.ctx.run_step(&mut guard, op, &resource, call).await {
            Ok(output) => output,
            Err(error) => {
                // A client that never started mapped nothing: close the resource, so the map
                // may be retried. (A client killed at its deadline leaves the outcome unknown.)
                let never_started = crate::resources::state_of(
                    &guard.records(),
                    &Resource::Backup(archive.clone()),
                )
                .is_some_and(|s| s.standing() == Standing::Failed);
                if never_started {
                    self.ctx
                        .journal_end_state(&mut guard, op, &resource, &EndState::NeverCreated)
                        .await?;
                }
                return Err(error);
            }
        };
        // Success is the "mapped on" line: the client exits 0 even when its mapping child fails.
        let Some(device) = loopdev::parse_mapped_on(&output.stderr) else {
            self.ctx
                .journal_tool_failed(&mut guard, op, &resource, &output, &[])
                .await?;
            // The client finished and named no device: this call mapped nothing, so the
            // resource is closed and the map may be retried.
            self.ctx
                .journal_end_state(&mut guard, op, &resource, &EndState::NeverCreated)
                .await?;
            return Err(ExecError::FailedPrecondition(format!(
                "proxmox-backup-client map did not map {archive} (exit {:?}): {}; nothing is left mapped, the map may be retried",
                output.exit_code,
                output.stderr_excerpt()
            )));
        };
        let expected = self.expected_backing(grant, &archive);
        let observed = loopdev::inspect(&self.ctx.sys_block, &device);
        let problem = match &observed {
            None => Some(format!("{device} is not attached")),
            Some(l) if l.backing_file != expected => Some(format!(
                "{device} is backed by {}, not by {}",
                l.backing_file.display(),
                expected.display()
            )),
            Some(l) if !l.read_only => Some(format!(
                "{device} is writable; a backup must be mapped read-only"
            )),
            Some(_) => None,
        };
        if let Some(reason) = problem {
            // The client said it mapped this device for this call: record what backs it, so
            // cleanup can undo exactly that mapping (and nothing else) later.
            let pbs_backing = observed
                .map(|l| l.backing_file)
                .filter(|b| b.parent() == Some(self.ctx.config.pve.pbs_loopdev_dir.as_path()));
            let mut extra = vec![("loop_device", json!(device)), ("reason", json!(reason))];
            if let Some(backing) = pbs_backing {
                extra.push(("backing_file", json!(backing.display().to_string())));
            }
            self.ctx
                .journal_tool_failed(&mut guard, op, &resource, &output, &extra)
                .await?;
            return Err(ExecError::FailedPrecondition(format!(
                "the mapping of {archive} failed verification: {reason}; call Cleanup to remove it"
            )));
        }
        let detail = tool_detail(
            &output,
            &[
                ("loop_device", json!(device)),
                ("backing_file", json!(expected.display().to_string())),
                ("unit", json!(unit)),
            ],
        );
        guard.done(self.ctx.now_ms(), op, &resource, detail).await?;
        Ok(Outcome::MapBackup(pb::MapBackupReply {
            loop_device: device,
            tool: Some(tool_result("proxmox-backup-client map", &output)),
            journal_head: guard.head_hex(),
        }))
    }

    pub(super) async fn unmap(
        &self,
        run: &RunHandle,
        archive: ArchiveName,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.ctx.lock_open(run).await?;
        let states = crate::resources::states(&guard.records());
        let resource = Resource::Backup(archive.clone());
        let Some(state) = states.get(&resource.key()).filter(|s| s.is_open()) else {
            return Err(ExecError::FailedPrecondition(format!(
                "{archive} is not mapped by this run"
            )));
        };
        if let Some(user) = states.values().find(|s| {
            s.is_open()
                && matches!(&s.resource, Resource::Overlay { archive: a, .. } if a == &archive)
        }) {
            return Err(ExecError::FailedPrecondition(format!(
                "{} still uses {archive}; delete it first",
                user.key
            )));
        }
        let state = state.clone();
        let (end_state, output) = self.undo(&mut guard, grant, &state, &archive).await?;
        if let EndState::Failed(reason) = end_state {
            return Err(ExecError::FailedPrecondition(reason));
        }
        Ok(Outcome::UnmapBackup(pb::UnmapBackupReply {
            tool: output
                .as_ref()
                .map(|o| tool_result("proxmox-backup-client unmap", o)),
            journal_head: guard.head_hex(),
        }))
    }

    /// Removes every mapping of `archive` this run made: the devices its map calls reported
    /// (completed, or refused after the client mapped them), and, when a map's outcome is
    /// unknown, whatever carries the run's mapping name. Journals `undone` with the end state.
    pub(super) async fn undo(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
        state: &ResourceState,
        archive: &ArchiveName,
    ) -> Result<(EndState, Option<ToolOutput>), ExecError> {
        let expected_text = self.expected_backing(grant, archive).display().to_string();
        let life = current_life(state);
        let maps = || life.iter().filter(|r| r.entry.op == Op::BackupMap);
        // Devices a map call of this run reported and that were backed by the run's own
        // mapping name when it reported them (a refused writable mapping included).
        let devices: Vec<String> = maps()
            .filter(|r| matches!(r.entry.phase, Phase::Done | Phase::Failed))
            .filter(|r| {
                r.entry.detail.get("backing_file").and_then(|b| b.as_str())
                    == Some(expected_text.as_str())
            })
            .filter_map(|r| loop_device_of(Some(&r.entry.detail)))
            .collect();
        // Only when a map's outcome is unknown may something exist that the journal does not
        // name; a map that reported failure without naming a device mapped nothing of this
        // run's (another holder of the same name, if any, is not this run's).
        let outcome_unknown = maps().any(|r| {
            r.entry.phase == Phase::Intent
                || r.entry
                    .detail
                    .get("outcome_unknown")
                    .and_then(|u| u.as_bool())
                    == Some(true)
        }) || state.standing() == Standing::Interrupted;
        self.unmap_mappings(guard, grant, archive, devices, outcome_unknown)
            .await
    }

    /// Unmaps `devices` (each only while still backed by the run's mapping) and, with
    /// `search`, every mapping carrying the run's mapping name, attached or not yet.
    pub(super) async fn unmap_mappings(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
        archive: &ArchiveName,
        mut devices: Vec<String>,
        search: bool,
    ) -> Result<(EndState, Option<ToolOutput>), ExecError> {
        let resource = Resource::Backup(archive.clone());
        let op = &Op::BackupUnmap;
        let expected = self.expected_backing(grant, archive);
        let dangling = search && expected.exists();
        if search {
            for l in self.our_loops(grant, archive) {
                if !devices.contains(&l.device) {
                    devices.push(l.device);
                }
            }
        }
        devices.retain(|d| {
            loopdev::inspect(&self.ctx.sys_block, d).is_some_and(|l| l.backing_file == expected)
        });
        devices.dedup();
        if devices.is_empty() && !dangling {
            self.release_map_unit(grant, archive).await;
            self.ctx
                .journal_end_state(guard, op, &resource, &EndState::AlreadyGone)
                .await?;
            return Ok((EndState::AlreadyGone, None));
        }
        // A device-mapper device on the mapping keeps it busy: unmapping would stop the holder
        // and leave the device attached until the host lets go. The operator releases it first.
        let holders: Vec<loopdev::DmHolder> = devices
            .iter()
            .flat_map(|d| loopdev::device_mapper_holders(&self.ctx.sys_block, d))
            .collect();
        if !holders.is_empty() {
            return Ok((
                EndState::Failed(format!(
                    "the mapping of {archive} is left in place because the host uses it: {}; then run Cleanup again",
                    describe_holders(&holders)
                )),
                None,
            ));
        }
        let by_name = self.name_is_unique(grant, archive);
        let targets: Vec<String> = if by_name {
            vec![self.mapping_name(grant, archive)]
        } else {
            devices.clone()
        };
        guard
            .intent(
                self.ctx.now_ms(),
                op,
                &resource,
                json!({ "loop_devices": devices, "unmap": targets }),
            )
            .await?;
        let mut last_output = None;
        for target in &targets {
            if !by_name {
                // By number: only while the device is still this run's mapping.
                let still_ours = loopdev::inspect(&self.ctx.sys_block, target)
                    .is_some_and(|l| l.backing_file == expected);
                if !still_ours {
                    continue;
                }
            }
            let call = ToolCall::new(
                &self.ctx.config.tools.proxmox_backup_client,
                self.ctx.tool_timeout(),
            )
            .arg("unmap")
            .arg(target);
            let output = self.ctx.run_step(guard, op, &resource, call).await?;
            let failed = !output.success();
            last_output = Some(output);
            if failed {
                break;
            }
        }
        let left: Vec<String> = self
            .our_loops(grant, archive)
            .into_iter()
            .map(|l| l.device)
            .collect();
        let holder_left = expected.exists();
        let failed = last_output.as_ref().is_some_and(|o| !o.success());
        if !left.is_empty() || holder_left || failed {
            let mut detail = last_output
                .as_ref()
                .map(|o| tool_detail(o, &[]))
                .unwrap_or_else(|| json!({}));
            if let Some(map) = detail.as_object_mut() {
                map.insert("loop_devices_left".into(), json!(left));
                map.insert("backing_file_left".into(), json!(holder_left));
            }
            guard
                .failed(self.ctx.now_ms(), op, &resource, detail)
                .await?;
            let reason = format!(
                "proxmox-backup-client unmap did not remove the mapping of {archive} (devices left: {left:?}; backing file left: {holder_left}): {}",
                last_output
                    .as_ref()
                    .map(ToolOutput::stderr_excerpt)
                    .unwrap_or_default()
            );
            return Ok((EndState::Failed(reason), last_output));
        }
        let mut extra = vec![
            ("loop_devices", json!(devices)),
            ("end_state", json!(EndState::Unmapped.wire())),
        ];
        if by_name {
            extra.push(("by_name", json!(true)));
        }
        let detail = match &last_output {
            Some(output) => tool_detail(output, &extra),
            None => json!({ "loop_devices": devices, "end_state": EndState::Unmapped.wire() }),
        };
        self.release_map_unit(grant, archive).await;
        guard
            .undone(self.ctx.now_ms(), op, &resource, detail)
            .await?;
        Ok((EndState::Unmapped, last_output))
    }
}
