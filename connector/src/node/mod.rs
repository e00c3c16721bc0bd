//! The node executor: authorized actions become side effects on this Proxmox VE node.
//!
//! Every operation takes the run's lock, journals `intent` before it touches the node and
//! `done`/`failed` after, runs a fixed tool with a fixed argv built from validated, granted
//! values ([`crate::process`]), and re-checks ownership before it undoes anything: a loop
//! device is unmapped only while its backing file is the mapping this run made; an overlay is
//! only ever a path derived from the run id, VMID and archive under the overlay root.
//!
//! A step runs in a task of its own, holding the run's lock, so a caller that goes away (a
//! cancelled gRPC call drops the handler's future) never cuts a step short: the step runs to
//! its end, bounded by its tool's timeout, and journals its real outcome; a retry then finds
//! that outcome. Each resource kind has an executor of its own in its module: [`backup`],
//! [`overlay`], [`vm`], [`guest`], [`sandbox`], [`probe`], [`guest_network`]; [`cleanup`]
//! undoes them and reads residue. They share one context (`context`: configuration, clock,
//! the run lock and the journaled step) and reach each other only through it;
//! [`NodeExecutor`] only dispatches each action to its resource's executor.

pub mod backup;
pub mod cleanup;
mod context;
pub mod guest;
pub mod guest_network;
pub mod loopdev;
pub mod manifest;
pub mod overlay;
pub mod probe;
pub mod qcow2_header;
// What a run holds, as its journal says: shared with the run registry, which decides from it
// whether a run may close or still counts against the node's limits.
pub mod sandbox;
pub mod vm;

use crate::action::Action;
use crate::clock::Clock;
use crate::config::Config;
use crate::executor::{
    Caller, ExecError, ExecFuture, Executor, Outcome, RecoverFuture, ResidueFuture,
};
use crate::process::{self, ToolOutput};
use crate::runs::RunHandle;
use certistack_core::grant::Repository;
use certistack_core::journal::JournalError;
use certistack_core::validate::Host;
use certistack_proto::v1 as pb;
use context::NodeContext;
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;

/// Cheap to clone: every step runs in a task of its own that holds a clone.
#[derive(Debug, Clone)]
pub struct NodeExecutor {
    ctx: Arc<NodeContext>,
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
            ctx: Arc::new(NodeContext::new(config, clock, PathBuf::from("/sys/block"))),
        }
    }

    /// Reads block devices (loop devices, their partitions and holders) from `sys_block`
    /// instead of `/sys/block`: a mirror of it, where device-mapper holders can be staged on
    /// a kernel without device-mapper.
    pub fn with_sys_block(mut self, sys_block: PathBuf) -> Self {
        let ctx = NodeContext {
            sys_block: Arc::new(sys_block),
            ..(*self.ctx).clone()
        };
        self.ctx = Arc::new(ctx);
        self
    }

    async fn dispatch(&self, run: &RunHandle, action: Action) -> Result<Outcome, ExecError> {
        match action {
            Action::MapBackup {
                snapshot,
                archive,
                secret,
                encryption_key,
            } => {
                self.ctx
                    .backups()
                    .map(run, snapshot, archive, secret, encryption_key)
                    .await
            }
            Action::UnmapBackup { archive } => self.ctx.backups().unmap(run, archive).await,
            Action::CreateOverlay { vmid, archive } => {
                self.ctx.overlays().create(run, vmid, archive).await
            }
            Action::DeleteOverlay { vmid, archive } => {
                self.ctx.overlays().delete(run, vmid, archive).await
            }
            Action::CreateVm {
                vmid,
                cores,
                memory_mib,
                archives,
                mirror_source,
            } => {
                self.ctx
                    .vms()
                    .create(run, vmid, cores, memory_mib, archives, mirror_source)
                    .await
            }
            Action::ReadSourceConfig {
                snapshot,
                secret,
                encryption_key,
            } => {
                self.ctx
                    .backups()
                    .read_source_config(run, snapshot, secret, encryption_key)
                    .await
            }
            Action::StartVm { vmid } => self.ctx.vms().lifecycle(run, vmid, vm::Verb::Start).await,
            Action::StopVm { vmid, timeout_secs } => {
                self.ctx
                    .vms()
                    .lifecycle(run, vmid, vm::Verb::Stop { timeout_secs })
                    .await
            }
            Action::DestroyVm { vmid } => {
                self.ctx.vms().lifecycle(run, vmid, vm::Verb::Destroy).await
            }
            Action::VmStatus { vmid } => self.ctx.vms().status(run, vmid).await,
            Action::Qmp { vmid, command } => self.ctx.guests().qmp(run, vmid, command).await,
            Action::Qga { vmid, call } => self.ctx.guests().qga(run, vmid, call).await,
            Action::PrepareSandbox { vnet, probe_source } => {
                self.ctx.sandbox().prepare(run, vnet, probe_source).await
            }
            Action::ReleaseSandbox { vnet } => self.ctx.sandbox().release(run, vnet).await,
            Action::Probe {
                kind,
                address,
                port,
            } => self.ctx.probes().probe(run, kind, address, port).await,
            // The service answers ReadJournal itself, streaming the journal file.
            Action::ReadJournal { .. } => Err(ExecError::Failed(
                "ReadJournal is answered by the run registry, never by the executor".into(),
            )),
            Action::Cleanup { .. } => self.ctx.cleanup().cleanup(run).await,
            Action::RecoverGuestNetwork {
                vmid,
                archive,
                mode,
            } => {
                self.ctx
                    .guest_network()
                    .recover(run, vmid, archive, mode)
                    .await
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
        let executor = self.clone();
        let run = caller.run().clone();
        Box::pin(async move {
            // The step runs in a task of its own: the caller going away drops only this
            // future, and the step still runs to its end and journals its outcome.
            tokio::spawn(async move { executor.dispatch(&run, action).await })
                .await
                .map_err(|error| {
                    ExecError::Failed(format!(
                        "the step ended abnormally ({error}); read the journal and clean up"
                    ))
                })?
        })
    }

    fn residue<'a>(&'a self, run: &'a RunHandle) -> ResidueFuture<'a> {
        Box::pin(async move { self.ctx.cleanup().run_residue(run).await })
    }

    fn recover<'a>(&'a self, run: &'a RunHandle) -> RecoverFuture<'a> {
        Box::pin(async move {
            let mut guard = run.lock().await;
            self.ctx.cleanup().settle_interrupted(&mut guard).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_journal_inside_a_step_is_resource_exhausted() {
        let full = JournalError::Full {
            path: PathBuf::from("/var/lib/certistack/runs/x/journal"),
            records: 10_000,
            bytes: 1,
            max_records: 10_000,
            max_bytes: 16 << 20,
        };
        let status = tonic::Status::from(ExecError::from(full));
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        assert!(status.message().contains("limits.max_journal_records"));
        let poisoned = JournalError::Poisoned(PathBuf::from("/x"));
        assert_eq!(
            tonic::Status::from(ExecError::from(poisoned)).code(),
            tonic::Code::Internal
        );
    }
}
