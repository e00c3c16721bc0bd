//! The node executor: authorized actions become side effects on this Proxmox VE node.
//!
//! Every operation takes the run's lock, journals `intent` before it touches the node and
//! `done`/`failed` after, runs a fixed tool with a fixed argv built from validated, granted
//! values ([`crate::process`]), and re-checks ownership before it undoes anything: a loop
//! device is unmapped only while its backing file is the mapping this run made; an overlay is
//! only ever a path derived from the run id, VMID and archive under the overlay root.

pub mod guest;
pub mod loopdev;
pub mod probe;
pub mod resources;
pub mod sandbox;
pub mod vm;

use crate::action::{Action, EncryptionKey};
use crate::config::Config;
use crate::executor::{Caller, ExecError, ExecFuture, Executor, Outcome};
use crate::grant::{Grant, Repository};
use crate::journal::{JournalError, Phase};
use crate::process::{self, SecretInput, SecretKind, ToolCall, ToolOutput};
use crate::runs::{RunGuard, RunHandle};
use crate::service::Clock;
use crate::validate::{ArchiveName, Host, Secret, Snapshot, Vmid};
use certistack_proto::v1 as pb;
use serde_json::json;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The descriptor `proxmox-backup-client` reads the password from (`PBS_PASSWORD_FD`).
const PASSWORD_FD: i32 = 3;
/// The descriptor the encryption key is passed on (`--keyfile /proc/self/fd/4`).
const KEYFILE_FD: i32 = 4;

#[derive(Debug)]
pub struct NodeExecutor {
    config: Config,
    clock: Arc<dyn Clock>,
    sys_block: PathBuf,
}

impl std::fmt::Debug for dyn Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Clock")
    }
}

impl From<JournalError> for ExecError {
    fn from(error: JournalError) -> Self {
        if let JournalError::Full { .. } = error {
            return ExecError::ResourceExhausted(error.to_string());
        }
        ExecError::Failed(format!(
            "the run's journal failed ({error}); a step it does not record as done may still have happened: read the journal and clean up"
        ))
    }
}

fn tool_result(name: &str, output: &ToolOutput) -> pb::ToolResult {
    pb::ToolResult {
        program: name.to_owned(),
        exit_code: output.exit_code.unwrap_or(-1),
        elapsed_ms: output.elapsed.as_millis() as u64,
        stderr_excerpt: output.stderr_excerpt(),
    }
}

/// What a tool call did, for the journal, plus `extra` fields.
fn tool_detail(output: &ToolOutput, extra: &[(&str, serde_json::Value)]) -> serde_json::Value {
    let mut map = serde_json::Map::new();
    map.insert("exit_code".into(), json!(output.exit_code));
    map.insert(
        "elapsed_ms".into(),
        json!(output.elapsed.as_millis() as u64),
    );
    map.insert("stderr".into(), json!(output.stderr_excerpt()));
    for (key, value) in extra {
        map.insert((*key).to_owned(), value.clone());
    }
    serde_json::Value::Object(map)
}

fn loop_device_of(detail: Option<&serde_json::Value>) -> Option<String> {
    detail?.get("loop_device")?.as_str().map(str::to_owned)
}

/// `[[auth-id@]server[:port]:]datastore`, as `proxmox-backup-client --repository` reads it.
pub fn repository_string(repository: &Repository) -> String {
    let server = match &repository.server {
        Host::Ip(std::net::IpAddr::V6(ip)) => format!("[{ip}]"),
        host => host.to_string(),
    };
    format!(
        "{}@{server}:{}:{}",
        repository.auth_id, repository.port, repository.datastore
    )
}

impl NodeExecutor {
    pub fn new(config: Config, clock: Arc<dyn Clock>) -> Self {
        Self {
            config,
            clock,
            sys_block: PathBuf::from("/sys/block"),
        }
    }

    fn now_ms(&self) -> i64 {
        self.clock.now_unix_ms()
    }

    /// Locks the run for an operation, then re-checks what authorization saw before the wait:
    /// the run may have been closed, or its deadline passed, while another operation held it.
    async fn lock_open<'a>(&self, run: &'a RunHandle) -> Result<RunGuard<'a>, ExecError> {
        let guard = run.lock().await;
        if run.is_closed() {
            return Err(ExecError::FailedPrecondition(format!(
                "run {} was closed while this call waited; nothing was done",
                run.run_id
            )));
        }
        if self.clock.now_unix() >= run.grant.deadline_unix {
            return Err(ExecError::FailedPrecondition(format!(
                "run {} passed its grant deadline while this call waited; nothing was done",
                run.run_id
            )));
        }
        Ok(guard)
    }

    fn tool_timeout(&self) -> Duration {
        Duration::from_secs(self.config.limits.tool_timeout_secs)
    }

    /// `<overlay root>/<run id>`: the only directory overlays are created in.
    fn overlay_dir(&self, grant: &Grant) -> PathBuf {
        self.config.paths.overlay_root.join(grant.run_id.as_str())
    }

    /// The one path an overlay of `archive` for `vmid` can have.
    fn overlay_path(&self, grant: &Grant, vmid: Vmid, archive: &ArchiveName) -> PathBuf {
        self.overlay_dir(grant)
            .join(format!("{vmid}-{}.qcow2", archive.stem()))
    }

    fn expected_backing(&self, grant: &Grant, archive: &ArchiveName) -> PathBuf {
        let name = loopdev::backing_file_name(
            &repository_string(&grant.repository),
            grant.snapshot.as_str(),
            archive.as_str(),
        );
        self.config.pve.pbs_loopdev_dir.join(name)
    }

    /// Ownership re-check before building on or booting from a mapping: `device` must still be
    /// this run's live, read-only mapping of `archive` (a dead mapping's number can be reused).
    fn check_mapping(
        &self,
        grant: &Grant,
        archive: &ArchiveName,
        device: &str,
    ) -> Result<(), ExecError> {
        let expected = self.expected_backing(grant, archive);
        match loopdev::inspect(&self.sys_block, device) {
            Some(l) if l.serves(&expected) => Ok(()),
            _ => Err(ExecError::FailedPrecondition(format!(
                "{device} is no longer this run's read-only mapping of {archive}; clean up and map again"
            ))),
        }
    }

    /// Loop devices currently backed by this run's mapping of `archive`.
    fn our_loops(&self, grant: &Grant, archive: &ArchiveName) -> Vec<loopdev::LoopDevice> {
        let expected = self.expected_backing(grant, archive);
        loopdev::attached(&self.sys_block)
            .into_iter()
            .filter(|l| l.backing_file == expected)
            .collect()
    }

    async fn map_backup(
        &self,
        run: &RunHandle,
        snapshot: Snapshot,
        archive: ArchiveName,
        secret: Secret,
        key: Option<EncryptionKey>,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.lock_open(run).await?;
        let resource = format!("backup:{archive}");
        if let Some(state) = resources::states(&guard.records())
            .get(&resource)
            .filter(|s| s.is_open())
        {
            return Err(ExecError::AlreadyExists(format!(
                "{archive} is already mapped by this run (last step: {} {}); unmap it or clean up first",
                state.last.entry.op,
                state.last.entry.phase.name()
            )));
        }
        let repository = repository_string(&grant.repository);
        let mut call = ToolCall::new(
            &self.config.tools.proxmox_backup_client,
            Duration::from_secs(self.config.limits.map_timeout_secs),
        )
        .arg("map")
        .arg(snapshot.as_str())
        .arg(archive.as_str())
        .arg("--repository")
        .arg(&repository)
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
        guard.append(
            self.now_ms(),
            "backup.map",
            &resource,
            Phase::Intent,
            json!({ "snapshot": snapshot.as_str(), "archive": archive.as_str(), "repository": repository, "command": call.display() }),
        ).await?;
        let output = self
            .run_step(&mut guard, "backup.map", &resource, call)
            .await?;
        // Success is the "mapped on" line: the client exits 0 even when its mapping child fails.
        let Some(device) = loopdev::parse_mapped_on(&output.stderr) else {
            guard
                .append(
                    self.now_ms(),
                    "backup.map",
                    &resource,
                    Phase::Failed,
                    tool_detail(&output, &[]),
                )
                .await?;
            return Err(ExecError::FailedPrecondition(format!(
                "proxmox-backup-client map did not map {archive} (exit {:?}): {}",
                output.exit_code,
                output.stderr_excerpt()
            )));
        };
        let expected = self.expected_backing(grant, &archive);
        let observed = loopdev::inspect(&self.sys_block, &device);
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
                .filter(|b| b.parent() == Some(self.config.pve.pbs_loopdev_dir.as_path()));
            let mut extra = vec![("loop_device", json!(device)), ("reason", json!(reason))];
            if let Some(backing) = pbs_backing {
                extra.push(("backing_file", json!(backing.display().to_string())));
            }
            let detail = tool_detail(&output, &extra);
            guard
                .append(
                    self.now_ms(),
                    "backup.map",
                    &resource,
                    Phase::Failed,
                    detail,
                )
                .await?;
            return Err(ExecError::FailedPrecondition(format!(
                "the mapping of {archive} failed verification: {reason}"
            )));
        }
        let detail = tool_detail(
            &output,
            &[
                ("loop_device", json!(device)),
                ("backing_file", json!(expected.display().to_string())),
            ],
        );
        guard
            .append(self.now_ms(), "backup.map", &resource, Phase::Done, detail)
            .await?;
        Ok(Outcome::MapBackup(pb::MapBackupReply {
            loop_device: device,
            tool: Some(tool_result("proxmox-backup-client map", &output)),
            journal_head: guard.head_hex(),
        }))
    }

    async fn unmap_backup(
        &self,
        run: &RunHandle,
        archive: ArchiveName,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.lock_open(run).await?;
        let states = resources::states(&guard.records());
        let resource = format!("backup:{archive}");
        let Some(state) = states.get(&resource).filter(|s| s.is_open()) else {
            return Err(ExecError::FailedPrecondition(format!(
                "{archive} is not mapped by this run"
            )));
        };
        let prefix = "overlay:";
        if let Some(user) = states.values().find(|s| {
            s.is_open() && s.key.starts_with(prefix) && s.key.ends_with(&format!(":{archive}"))
        }) {
            return Err(ExecError::FailedPrecondition(format!(
                "{} still uses {archive}; delete it first",
                user.key
            )));
        }
        let expected = self.expected_backing(grant, &archive);
        let device = loop_device_of(state.done_detail.as_ref());
        let Some(device) = device else {
            return Err(ExecError::FailedPrecondition(format!(
                "the mapping of {archive} never completed; Cleanup reconciles it"
            )));
        };
        let (output, end_state) = self
            .unmap_if_ours(&mut guard, &archive, &device, &expected)
            .await?;
        Ok(Outcome::UnmapBackup(pb::UnmapBackupReply {
            tool: output
                .as_ref()
                .map(|o| tool_result("proxmox-backup-client unmap", o)),
            journal_head: {
                let _ = end_state;
                guard.head_hex()
            },
        }))
    }

    /// Unmaps `device` only while it is still backed by `expected`, the backing file of the
    /// mapping this run made.
    async fn unmap_if_ours(
        &self,
        guard: &mut RunGuard<'_>,
        archive: &ArchiveName,
        device: &str,
        expected: &Path,
    ) -> Result<(Option<ToolOutput>, &'static str), ExecError> {
        let resource = format!("backup:{archive}");
        match loopdev::inspect(&self.sys_block, device) {
            None => {
                guard
                    .append(
                        self.now_ms(),
                        "backup.unmap",
                        &resource,
                        Phase::Undone,
                        json!({ "loop_device": device, "end_state": "already gone" }),
                    )
                    .await?;
                return Ok((None, "already gone"));
            }
            Some(l) if l.backing_file != expected => {
                // The device was reused for something else: never touch it.
                guard.append(
                    self.now_ms(),
                    "backup.unmap",
                    &resource,
                    Phase::Undone,
                    json!({ "loop_device": device, "end_state": "already gone", "note": format!("{device} now backs {}; left untouched", l.backing_file.display()) }),
                ).await?;
                return Ok((None, "already gone"));
            }
            Some(_) => {}
        }
        guard
            .append(
                self.now_ms(),
                "backup.unmap",
                &resource,
                Phase::Intent,
                json!({ "loop_device": device }),
            )
            .await?;
        let call = ToolCall::new(
            &self.config.tools.proxmox_backup_client,
            self.tool_timeout(),
        )
        .arg("unmap")
        .arg(device);
        let output = self
            .run_step(guard, "backup.unmap", &resource, call)
            .await?;
        let still_ours =
            loopdev::inspect(&self.sys_block, device).is_some_and(|l| l.backing_file == expected);
        if !output.success() || still_ours {
            guard
                .append(
                    self.now_ms(),
                    "backup.unmap",
                    &resource,
                    Phase::Failed,
                    tool_detail(&output, &[]),
                )
                .await?;
            return Err(ExecError::FailedPrecondition(format!(
                "proxmox-backup-client unmap {device} failed (exit {:?}): {}",
                output.exit_code,
                output.stderr_excerpt()
            )));
        }
        let detail = tool_detail(
            &output,
            &[
                ("loop_device", json!(device)),
                ("end_state", json!("unmapped")),
            ],
        );
        guard
            .append(
                self.now_ms(),
                "backup.unmap",
                &resource,
                Phase::Undone,
                detail,
            )
            .await?;
        Ok((Some(output), "unmapped"))
    }

    async fn create_overlay(
        &self,
        run: &RunHandle,
        vmid: Vmid,
        archive: ArchiveName,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.lock_open(run).await?;
        let states = resources::states(&guard.records());
        let backup = format!("backup:{archive}");
        let device = states
            .get(&backup)
            .filter(|s| s.is_open() && s.last.entry.phase == Phase::Done)
            .and_then(|s| loop_device_of(s.done_detail.as_ref()))
            .ok_or_else(|| {
                ExecError::FailedPrecondition(format!(
                    "{archive} is not mapped by this run; call MapBackup first"
                ))
            })?;
        self.check_mapping(grant, &archive, &device)?;
        let resource = format!("overlay:{vmid}:{archive}");
        if states.get(&resource).is_some_and(|s| s.is_open()) {
            return Err(ExecError::AlreadyExists(format!(
                "the overlay of {archive} for VM {vmid} already exists"
            )));
        }
        let dir = self.overlay_dir(grant);
        let path = self.overlay_path(grant, vmid, &archive);
        if states.get("dir:overlays").is_none_or(|s| !s.is_open()) {
            guard
                .append(
                    self.now_ms(),
                    "overlay.dir",
                    "dir:overlays",
                    Phase::Intent,
                    json!({ "path": dir.display().to_string() }),
                )
                .await?;
            let created = std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir);
            if let Err(error) = created {
                guard
                    .append(
                        self.now_ms(),
                        "overlay.dir",
                        "dir:overlays",
                        Phase::Failed,
                        json!({ "error": error.to_string() }),
                    )
                    .await?;
                return Err(ExecError::FailedPrecondition(format!(
                    "cannot create {}: {error}",
                    dir.display()
                )));
            }
            guard
                .append(
                    self.now_ms(),
                    "overlay.dir",
                    "dir:overlays",
                    Phase::Done,
                    json!({ "path": dir.display().to_string() }),
                )
                .await?;
        }
        if path.exists() {
            return Err(ExecError::AlreadyExists(format!(
                "{} already exists; it was not created by this call",
                path.display()
            )));
        }
        let call = ToolCall::new(&self.config.tools.qemu_img, self.tool_timeout())
            .arg("create")
            .arg("-f")
            .arg("qcow2")
            .arg("-b")
            .arg(&device)
            .arg("-F")
            .arg("raw")
            .arg(&path);
        guard.append(self.now_ms(), "overlay.create", &resource, Phase::Intent, json!({ "path": path.display().to_string(), "backing": device, "command": call.display() })).await?;
        let output = self
            .run_step(&mut guard, "overlay.create", &resource, call)
            .await?;
        if !output.success() || !path.is_file() {
            guard
                .append(
                    self.now_ms(),
                    "overlay.create",
                    &resource,
                    Phase::Failed,
                    tool_detail(&output, &[]),
                )
                .await?;
            return Err(ExecError::FailedPrecondition(format!(
                "qemu-img create failed (exit {:?}): {}",
                output.exit_code,
                output.stderr_excerpt()
            )));
        }
        let warnings = self
            .shared_filesystem_warning(&dir)
            .into_iter()
            .collect::<Vec<_>>();
        for warning in &warnings {
            tracing::warn!(run_id = %grant.run_id, "{warning}");
        }
        let detail = tool_detail(
            &output,
            &[
                ("path", json!(path.display().to_string())),
                ("backing", json!(device)),
            ],
        );
        guard
            .append(
                self.now_ms(),
                "overlay.create",
                &resource,
                Phase::Done,
                detail,
            )
            .await?;
        Ok(Outcome::CreateOverlay(pb::CreateOverlayReply {
            tool: Some(tool_result("qemu-img create", &output)),
            warnings,
            journal_head: guard.head_hex(),
        }))
    }

    /// Overlays growing on the filesystem of the cluster database can fill it and stall the
    /// whole cluster.
    fn shared_filesystem_warning(&self, overlay_dir: &Path) -> Option<String> {
        let cluster = &self.config.pve.pve_cluster_dir;
        let overlay_dev = std::fs::metadata(overlay_dir).ok()?.dev();
        let cluster_dev = std::fs::metadata(cluster).ok()?.dev();
        (overlay_dev == cluster_dev).then(|| {
            format!(
                "the overlay root {} is on the same filesystem as {}: a guest filling its overlay can fill the cluster database's disk; move overlay_root",
                self.config.paths.overlay_root.display(),
                cluster.display()
            )
        })
    }

    async fn delete_overlay(
        &self,
        run: &RunHandle,
        vmid: Vmid,
        archive: ArchiveName,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.lock_open(run).await?;
        let resource = format!("overlay:{vmid}:{archive}");
        let states = resources::states(&guard.records());
        if states.get(&resource).is_none_or(|s| !s.is_open()) {
            return Err(ExecError::NotFound(format!(
                "this run has no overlay of {archive} for VM {vmid}"
            )));
        }
        if states
            .get(&format!("vm:{vmid}"))
            .is_some_and(|s| s.is_open())
        {
            return Err(ExecError::FailedPrecondition(format!(
                "VM {vmid} still uses the overlay of {archive}; destroy it first"
            )));
        }
        let path = self.overlay_path(grant, vmid, &archive);
        self.remove_overlay(&mut guard, &resource, &path).await?;
        Ok(Outcome::DeleteOverlay(pb::DeleteOverlayReply {
            journal_head: guard.head_hex(),
        }))
    }

    async fn remove_overlay(
        &self,
        guard: &mut RunGuard<'_>,
        resource: &str,
        path: &Path,
    ) -> Result<&'static str, ExecError> {
        self.remove_path(guard, "overlay.delete", resource, path)
            .await
    }

    /// Removes one run-scoped file (or empty directory), journaled `intent` then `undone` with
    /// its end state, or `failed`. A path that is already gone is recorded as such.
    async fn remove_path(
        &self,
        guard: &mut RunGuard<'_>,
        op: &str,
        resource: &str,
        path: &Path,
    ) -> Result<&'static str, ExecError> {
        let shown = path.display().to_string();
        guard
            .append(
                self.now_ms(),
                op,
                resource,
                Phase::Intent,
                json!({ "path": shown }),
            )
            .await?;
        let removed = if path.is_dir() {
            std::fs::remove_dir(path)
        } else {
            std::fs::remove_file(path)
        };
        let end_state = match removed {
            Ok(()) => "deleted",
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => "already gone",
            Err(error) => {
                guard
                    .append(
                        self.now_ms(),
                        op,
                        resource,
                        Phase::Failed,
                        json!({ "path": shown, "error": error.to_string() }),
                    )
                    .await?;
                return Err(ExecError::Failed(format!("cannot remove {shown}: {error}")));
            }
        };
        guard
            .append(
                self.now_ms(),
                op,
                resource,
                Phase::Undone,
                json!({ "path": shown, "end_state": end_state }),
            )
            .await?;
        Ok(end_state)
    }

    async fn read_journal(&self, run: &RunHandle) -> Result<Outcome, ExecError> {
        let records = run.records().await?;
        Ok(Outcome::Journal(
            records.iter().map(|r| r.to_wire()).collect(),
        ))
    }

    /// Undoes every open resource of the run, newest first, then re-reads the node for residue.
    async fn cleanup(&self, run: &RunHandle) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = run.lock().await;
        let (touched_network, open) = {
            let records = guard.records();
            let touched_network = records.iter().any(|r| {
                r.entry.resource.starts_with("nft:") || r.entry.resource.starts_with("addr:")
            });
            (touched_network, resources::open_newest_first(&records))
        };
        let mut receipts = Vec::new();
        let mut failures = Vec::new();
        for state in open {
            let key = state.key.clone();
            // Containment stays while any VM of the run may still run.
            let vm_left = failures.iter().any(|f: &String| f.starts_with("vm:"));
            if vm_left && (key.starts_with("nft:") || key.starts_with("addr:")) {
                failures.push(format!(
                    "{key}: kept, a VM of the run could not be destroyed"
                ));
                receipts.push(pb::ResourceReceipt {
                    resource: key,
                    end_state: "failed: kept while a VM of the run remains".into(),
                });
                continue;
            }
            let result = self.undo(&mut guard, grant, &state).await;
            match result {
                Ok(end_state) => receipts.push(pb::ResourceReceipt {
                    resource: key,
                    end_state: end_state.to_owned(),
                }),
                Err(error) => {
                    failures.push(format!("{key}: {error}"));
                    receipts.push(pb::ResourceReceipt {
                        resource: key,
                        end_state: format!("failed: {error}"),
                    });
                }
            }
        }
        let residue = self.residue(grant, touched_network).await;
        if !residue.is_empty() || !failures.is_empty() {
            tracing::warn!(run_id = %grant.run_id, ?residue, ?failures, "cleanup left residue");
        }
        // The same residue found again (the expiry reaper retrying) is not journaled again.
        guard.append_if_changed(
            self.now_ms(),
            "run.cleanup",
            &format!("run:{}", grant.run_id),
            if residue.is_empty() && failures.is_empty() { Phase::Done } else { Phase::Failed },
            json!({ "receipts": receipts.iter().map(|r| json!({"resource": r.resource, "end_state": r.end_state})).collect::<Vec<_>>(), "residue": residue }),
        ).await?;
        Ok(Outcome::Cleanup(pb::CleanupReply {
            resources: receipts,
            residue,
            journal_head: guard.head_hex(),
        }))
    }

    async fn undo(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
        state: &resources::ResourceState,
    ) -> Result<&'static str, ExecError> {
        let key = state.key.as_str();
        if let Some(rest) = key.strip_prefix("overlay:") {
            let (vmid, archive) = rest
                .split_once(':')
                .ok_or_else(|| ExecError::Failed(format!("malformed resource {key}")))?;
            let vmid = vmid
                .parse()
                .ok()
                .and_then(|v| Vmid::parse("journal", v).ok())
                .ok_or_else(|| ExecError::Failed(format!("malformed resource {key}")))?;
            let archive = <ArchiveName as crate::validate::Validated>::validate(archive)
                .map_err(ExecError::Failed)?;
            let path = self.overlay_path(grant, vmid, &archive);
            return self.remove_overlay(guard, key, &path).await;
        }
        if let Some(archive) = key.strip_prefix("backup:") {
            let archive = <ArchiveName as crate::validate::Validated>::validate(archive)
                .map_err(ExecError::Failed)?;
            // Every (device, backing file) the journal says this run mapped, and, when the
            // daemon died before it learnt the device, every device backed by exactly this
            // run's mapping name.
            let mut devices: Vec<(String, PathBuf)> = state
                .history
                .iter()
                .filter(|r| r.entry.op == "backup.map" && r.entry.phase == Phase::Done)
                .filter_map(|r| {
                    let device = r.entry.detail.get("loop_device")?.as_str()?;
                    let backing = r.entry.detail.get("backing_file")?.as_str()?;
                    Some((device.to_owned(), PathBuf::from(backing)))
                })
                .collect();
            // Only when a map's outcome is unknown (the daemon died, or the client was killed at
            // its deadline) may a device exist that the journal does not name: then, and only
            // then, look for this run's mapping name (runs on one node never share it, see
            // `runs::overlap`). A map that reported failure mapped nothing of this run's,
            // whatever device the client named.
            let outcome_unknown = state.last.entry.op == "backup.map" && state.outcome_unknown();
            for l in self
                .our_loops(grant, &archive)
                .into_iter()
                .filter(|_| outcome_unknown)
            {
                if !devices
                    .iter()
                    .any(|(d, b)| d == &l.device && b == &l.backing_file)
                {
                    devices.push((l.device, l.backing_file));
                }
            }
            if devices.is_empty() {
                guard
                    .append(
                        self.now_ms(),
                        "backup.unmap",
                        key,
                        Phase::Undone,
                        json!({ "end_state": "already gone" }),
                    )
                    .await?;
                return Ok("already gone");
            }
            let mut end = "already gone";
            for (device, backing) in devices {
                let (_, state) = self
                    .unmap_if_ours(guard, &archive, &device, &backing)
                    .await?;
                if state == "unmapped" {
                    end = "unmapped";
                }
            }
            return Ok(end);
        }
        if let Some(vmid) = key.strip_prefix("vm:") {
            let vmid = vmid
                .parse()
                .ok()
                .and_then(|v| Vmid::parse("journal", v).ok())
                .ok_or_else(|| ExecError::Failed(format!("malformed resource {key}")))?;
            return self.undo_vm(guard, grant, state, vmid).await;
        }
        if (key.starts_with("nft:") || key.starts_with("addr:"))
            && state.last.entry.phase == Phase::Failed
            && !state.outcome_unknown()
            && matches!(
                state.last.entry.op.as_str(),
                "sandbox.nft" | "sandbox.address"
            )
        {
            // The install itself failed (nft -f is all or nothing; ip refused the address):
            // nothing of this run's is there to remove.
            guard
                .append(
                    self.now_ms(),
                    "sandbox.undo",
                    key,
                    Phase::Undone,
                    json!({ "end_state": "never created" }),
                )
                .await?;
            return Ok("never created");
        }
        if key.starts_with("nft:") {
            return self.remove_table(guard, grant).await;
        }
        if key.starts_with("addr:") {
            return self.remove_address(guard, grant).await;
        }
        if let Some(vmid) = key.strip_prefix("file:screendump:") {
            let vmid = vmid
                .parse()
                .ok()
                .and_then(|v| Vmid::parse("journal", v).ok())
                .ok_or_else(|| ExecError::Failed(format!("malformed resource {key}")))?;
            let path = self.overlay_dir(grant).join(format!("{vmid}-screen.ppm"));
            return self.remove_path(guard, "file.delete", key, &path).await;
        }
        if key == "dir:overlays" {
            return self
                .remove_path(guard, "overlay.dir.delete", key, &self.overlay_dir(grant))
                .await;
        }
        Err(ExecError::Failed(format!("no undo is known for {key}")))
    }

    /// What of the run is still on the node, re-read from the node itself.
    async fn residue(&self, grant: &Grant, touched_network: bool) -> Vec<String> {
        let mut residue = Vec::new();
        if touched_network {
            match self.table_present(grant).await {
                Ok(true) => residue.push(format!(
                    "nftables table inet {} still exists",
                    sandbox::table_name(grant)
                )),
                Ok(false) => {}
                Err(error) => residue.push(format!("cannot check the nftables table: {error}")),
            }
            match self.address_present(grant).await {
                Ok(true) => residue.push(format!(
                    "{} still carries {}",
                    grant.vnet, grant.probe_source
                )),
                Ok(false) => {}
                Err(error) => residue.push(format!("cannot check the probe address: {error}")),
            }
        }
        for archive in &grant.archives {
            for l in self.our_loops(grant, archive) {
                residue.push(format!("loop device {} still maps {archive}", l.device));
            }
        }
        let dir = self.overlay_dir(grant);
        if dir.exists() {
            residue.push(format!("overlay directory {} still exists", dir.display()));
        }
        for vmid in grant.sandbox_vms.keys() {
            let ownership = self.ownership(grant, *vmid, None);
            match &ownership {
                vm::Ownership::Unknown(reason) => residue.push(format!("VM {vmid}: {reason}")),
                vm::Ownership::Ours => {
                    residue.push(format!("VM {vmid} with this run's marker still exists"))
                }
                vm::Ownership::Absent | vm::Ownership::NotOurs(_) => {}
            }
            // A QEMU process outliving its config would hold the overlay and the loop device
            // (not reported for a VM that is not this run's: its process is not ours to judge).
            let pid_file = self
                .config
                .pve
                .qemu_server_run_dir
                .join(format!("{vmid}.pid"));
            if let Some(pid) = std::fs::read_to_string(&pid_file)
                .ok()
                .and_then(|p| p.trim().parse::<u32>().ok())
                && std::path::Path::new(&format!("/proc/{pid}")).exists()
                && matches!(ownership, vm::Ownership::Ours | vm::Ownership::Absent)
            {
                residue.push(format!(
                    "the QEMU process {pid} of VM {vmid} is still running"
                ));
            }
        }
        residue
    }
}

impl NodeExecutor {
    /// Runs the tool of a journaled step whose `intent` is already recorded. When the tool does
    /// not finish by itself, the step is recorded `failed`: with `"outcome_unknown": true` when
    /// it was killed at its deadline or lost while running (it may have done its work), without
    /// when it never started. Cleanup reads that flag (see `ResourceState::outcome_unknown`).
    async fn run_step(
        &self,
        guard: &mut RunGuard<'_>,
        op: &str,
        resource: &str,
        call: ToolCall,
    ) -> Result<ToolOutput, ExecError> {
        match process::run(call).await {
            Ok(output) => Ok(output),
            Err(error) => {
                let unknown = matches!(
                    error,
                    process::ToolError::Timeout { .. } | process::ToolError::Wait { .. }
                );
                let detail = json!({ "error": error.to_string(), "outcome_unknown": unknown });
                guard
                    .append(self.now_ms(), op, resource, Phase::Failed, detail)
                    .await?;
                Err(tool_error(error))
            }
        }
    }
}

fn tool_error(error: process::ToolError) -> ExecError {
    match error {
        process::ToolError::Timeout { .. } => ExecError::DeadlineExceeded(error.to_string()),
        _ => ExecError::Failed(error.to_string()),
    }
}

impl Executor for NodeExecutor {
    fn capabilities(&self) -> Vec<&'static str> {
        crate::executor::CAPABILITIES.to_vec()
    }

    fn execute<'a>(&'a self, caller: &'a Caller, action: Action) -> ExecFuture<'a> {
        Box::pin(async move {
            let run = caller.run();
            match action {
                Action::MapBackup {
                    snapshot,
                    archive,
                    secret,
                    encryption_key,
                } => {
                    self.map_backup(run, snapshot, archive, secret, encryption_key)
                        .await
                }
                Action::UnmapBackup { archive } => self.unmap_backup(run, archive).await,
                Action::CreateOverlay { vmid, archive } => {
                    self.create_overlay(run, vmid, archive).await
                }
                Action::DeleteOverlay { vmid, archive } => {
                    self.delete_overlay(run, vmid, archive).await
                }
                Action::CreateVm {
                    vmid,
                    cores,
                    memory_mib,
                    archives,
                } => self.create_vm(run, vmid, cores, memory_mib, archives).await,
                Action::StartVm { vmid } => self.vm_lifecycle(run, vmid, "start", 0).await,
                Action::StopVm { vmid, timeout_secs } => {
                    self.vm_lifecycle(run, vmid, "stop", timeout_secs).await
                }
                Action::DestroyVm { vmid } => self.vm_lifecycle(run, vmid, "destroy", 0).await,
                Action::VmStatus { vmid } => self.vm_status(run, vmid).await,
                Action::Qmp { vmid, command } => self.run_qmp(run, vmid, command).await,
                Action::Qga { vmid, call } => self.run_qga(run, vmid, call).await,
                Action::PrepareSandbox { vnet, probe_source } => {
                    self.prepare_sandbox(run, vnet, probe_source).await
                }
                Action::ReleaseSandbox { vnet } => self.release_sandbox(run, vnet).await,
                Action::Probe {
                    kind,
                    address,
                    port,
                } => self.probe(run, kind, address, port).await,
                Action::ReadJournal { .. } => self.read_journal(run).await,
                Action::Cleanup { .. } => self.cleanup(run).await,
            }
        })
    }
}
