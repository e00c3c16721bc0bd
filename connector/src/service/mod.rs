//! The gRPC service: authenticate, parse, authorize, execute, in that order, for every call.
//!
//! 1. authenticate: the TLS identity of the connection (operator or run), still within its
//!    validity window, allowed to call this RPC by `policy/rpc-surface.toml`; a run certificate
//!    must be bound to this node and its run must not be closed;
//! 2. parse: the request into a typed [`Action`] (`INVALID_ARGUMENT` naming the field);
//! 3. authorize: a run's action against its open run's grant (`PERMISSION_DENIED` naming the
//!    object and the rule);
//! 4. execute: hand the action to the [`Executor`].
//!
//! A refusal at any step returns before the next, so it changes nothing. Calls are logged
//! where their outcome is known, by [`crate::call_log`]: every call once, refusals
//! rate-limited, including those tonic answers before the service sees the request
//! (oversized, undecodable, compressed).
//!
//! The run registry answers the rest itself: `ListRuns` from the open runs' records and the
//! closed runs' ids and deadlines in memory (read from disk once), `ReadJournal` from an
//! open run's records' wire forms in memory while its journal is small
//! (`journal::WIRE_KEPT_BYTES`), else by streaming the journal file and
//! verifying the chain as it goes. Operations that add to the node are refused with
//! `RESOURCE_EXHAUSTED` once the run's journal reaches its operation budget; what undoes or
//! cleans up keeps the reserve.

mod admission;
mod journal_stream;
mod reaper;

use admission::invalid;
use journal_stream::stream_journal;

use crate::action::{Action, parse};
use crate::clock::Clock;
use crate::executor::{Executor, Outcome};
use crate::policy::{Gate, Rpc};
use crate::runs::{RunError, RunRegistry};
use certistack_core::grant::{self, GrantError};
use certistack_core::identity::Identity;
use certistack_core::journal::JournalError;
use certistack_core::untrusted::printable;
use certistack_core::validate::{NodeName, RunId};
use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_server::Connector;
use ed25519_dalek::VerifyingKey;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use tonic::{Request, Response, Status};

/// Characters of a quarantine reason ListRuns returns (it may quote a journal line).
const MAX_QUARANTINE_REASON_CHARS: usize = 1024;
/// Records a `ReadJournal` stream buffers ahead of a slow reader.
const JOURNAL_STREAM_BUFFER: usize = 16;

pub struct ConnectorService {
    node: NodeName,
    gate: Gate,
    authority: VerifyingKey,
    runs: Arc<RunRegistry>,
    executor: Arc<dyn Executor>,
    clock: Arc<dyn Clock>,
    /// Seconds after a grant's deadline before the daemon cleans up a run nobody ended.
    expiry_grace_secs: i64,
    /// `limits.min_probe_prefix`: grants with a wider probe network are refused at BeginRun.
    min_probe_prefix: u8,
    /// When the reaper may next retry a run whose cleanup left residue, and its current delay.
    reap_backoff: Mutex<BTreeMap<RunId, (i64, i64)>>,
    /// When closed runs were last pruned (unix seconds).
    last_prune_unix: std::sync::atomic::AtomicI64,
    /// What NodeChecks reads; absent in a service built without a node config.
    prerequisites: Option<Arc<crate::prerequisites::Prerequisites>>,
}

impl std::fmt::Debug for ConnectorService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectorService")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl ConnectorService {
    pub fn new(
        node: NodeName,
        gate: Gate,
        authority: VerifyingKey,
        runs: Arc<RunRegistry>,
        executor: Arc<dyn Executor>,
        clock: Arc<dyn Clock>,
        expiry_grace_secs: u64,
    ) -> Self {
        Self {
            expiry_grace_secs: i64::try_from(expiry_grace_secs).unwrap_or(i64::MAX),
            node,
            gate,
            authority,
            last_prune_unix: std::sync::atomic::AtomicI64::new(clock.now_unix()),
            runs,
            executor,
            clock,
            min_probe_prefix: crate::config::Limits::default().min_probe_prefix,
            reap_backoff: Mutex::default(),
            prerequisites: None,
        }
    }

    /// Answers NodeChecks from the node's files and tools as `prerequisites` names them.
    pub fn with_prerequisites(
        mut self,
        prerequisites: crate::prerequisites::Prerequisites,
    ) -> Self {
        self.prerequisites = Some(Arc::new(prerequisites));
        self
    }

    /// Sets the shortest probe-network prefix a grant may name (`limits.min_probe_prefix`).
    pub fn with_min_probe_prefix(mut self, min_probe_prefix: u8) -> Self {
        self.min_probe_prefix = min_probe_prefix;
        self
    }
}

fn unexpected(rpc: Rpc) -> Status {
    Status::internal(format!(
        "the executor answered {} with the wrong reply type",
        rpc.name()
    ))
}

macro_rules! operation {
    ($self:ident, $request:ident, $rpc:expr, $parse:expr, $variant:ident) => {{
        match $self.operate($request, $rpc, $parse).await? {
            Outcome::$variant(reply) => Ok(Response::new(reply)),
            _ => Err(unexpected($rpc)),
        }
    }};
}

type JournalStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::JournalRecord, Status>> + Send>>;

#[tonic::async_trait]
impl Connector for ConnectorService {
    async fn hello(
        &self,
        request: Request<pb::HelloRequest>,
    ) -> Result<Response<pb::HelloReply>, Status> {
        let peer = self.authenticate(&request, Rpc::Hello)?;
        let mut capabilities = vec!["run.lifecycle"];
        capabilities.extend(self.executor.capabilities());
        Ok(Response::new(pb::HelloReply {
            daemon_version: env!("CARGO_PKG_VERSION").to_owned(),
            node_name: self.node.to_string(),
            surface_digest: certistack_proto::SURFACE_DIGEST.to_owned(),
            capabilities: capabilities.into_iter().map(str::to_owned).collect(),
            node_time_unix_ms: self.clock.now_unix_ms(),
            peer_identity: peer.identity_text.to_string(),
            source_commit: certistack_proto::SOURCE_COMMIT.to_owned(),
            source_tree_dirty: certistack_proto::SOURCE_TREE_DIRTY,
        }))
    }

    async fn begin_run(
        &self,
        request: Request<pb::BeginRunRequest>,
    ) -> Result<Response<pb::BeginRunReply>, Status> {
        let rpc = Rpc::BeginRun;
        let peer = self.authenticate(&request, rpc)?;
        let Identity::Run {
            run_id,
            grant_sha256,
            ..
        } = &peer.client.identity
        else {
            return Err(Status::internal(
                "the policy admitted a non-run identity to BeginRun",
            ));
        };
        let refuse = |status: Status| self.refuse(rpc, &peer.label(), run_id.as_str(), status);
        let signed = request
            .into_inner()
            .grant
            .ok_or_else(|| refuse(Status::invalid_argument(GrantError::Missing.to_string())))?;
        let grant = grant::verify(&signed, &self.authority).map_err(|error| {
            refuse(match error {
                GrantError::BadSignature => Status::permission_denied(error.to_string()),
                _ => Status::invalid_argument(error.to_string()),
            })
        })?;
        if &grant.digest != grant_sha256 {
            return Err(refuse(Status::permission_denied(format!(
                "the grant's digest {} differs from the digest {} in the run certificate",
                hex::encode(grant.digest),
                hex::encode(grant_sha256)
            ))));
        }
        if &grant.run_id != run_id {
            return Err(refuse(Status::permission_denied(format!(
                "the grant is for run {}, the certificate for run {run_id}",
                grant.run_id
            ))));
        }
        let now = self.clock.now_unix();
        grant
            .check_applicable(&self.node, now)
            .map_err(|e| refuse(Status::permission_denied(e.to_string())))?;
        grant
            .check_probe_prefix(self.min_probe_prefix)
            .map_err(|e| refuse(Status::failed_precondition(e)))?;
        if peer.client.not_after_unix > grant.deadline_unix {
            return Err(refuse(Status::permission_denied(format!(
                "the run certificate is valid until {}, after the grant's deadline {}; a run certificate must not outlive its grant",
                peer.client.not_after_unix, grant.deadline_unix
            ))));
        }
        let deadline_unix = grant.deadline_unix;
        let resumed = self
            .runs
            .begin(&signed, grant, self.clock.now_unix_ms())
            .await
            .map_err(|error| {
                refuse(match error {
                    RunError::TooMany { .. } | RunError::SandboxExhausted { .. } => {
                        Status::resource_exhausted(error.to_string())
                    }
                    RunError::Store(_)
                    | RunError::Journal(_)
                    | RunError::Background(_)
                    | RunError::Locked { .. } => Status::internal(error.to_string()),
                    RunError::Overlap { .. } | RunError::Quarantined(..) => {
                        Status::failed_precondition(error.to_string())
                    }
                    _ => Status::permission_denied(error.to_string()),
                })
            })?;
        tracing::info!(rpc = rpc.name(), peer = %peer.label(), run_id = %run_id, resumed, "run open");
        Ok(Response::new(pb::BeginRunReply {
            run_id: run_id.to_string(),
            deadline_unix,
            resumed,
        }))
    }

    async fn end_run(
        &self,
        request: Request<pb::EndRunRequest>,
    ) -> Result<Response<pb::EndRunReply>, Status> {
        let rpc = Rpc::EndRun;
        let peer = self.authenticate(&request, rpc)?;
        let Identity::Run {
            run_id,
            grant_sha256,
            ..
        } = &peer.client.identity
        else {
            return Err(Status::internal(
                "the policy admitted a non-run identity to EndRun",
            ));
        };
        // Only the certificate of the grant the run began with may end it.
        if let Some(run) = self.runs.get(run_id)
            && &run.grant.digest != grant_sha256
        {
            return Err(self.refuse(
                rpc,
                &peer.label(),
                run_id.as_str(),
                Status::permission_denied(
                    "the certificate's grant digest differs from the grant this run began with",
                ),
            ));
        }
        // A run ends clean: what the node still holds under the run's names (not only what
        // its journal has open) must be cleaned up first.
        if let Some(run) = self.runs.get(run_id)
            && !run.is_closed()
        {
            let residue =
                self.executor.residue(&run).await.map_err(|error| {
                    self.refuse(rpc, &peer.label(), run_id.as_str(), error.into())
                })?;
            if !residue.is_empty() {
                return Err(self.refuse(
                    rpc,
                    &peer.label(),
                    run_id.as_str(),
                    Status::failed_precondition(format!(
                        "run {run_id} still holds on this node: {}; run Cleanup first",
                        residue.join("; ")
                    )),
                ));
            }
        }
        let closed_unix_ms = self
            .runs
            .end(run_id, self.clock.now_unix_ms())
            .await
            .map_err(|error| {
                self.refuse(
                    rpc,
                    &peer.label(),
                    run_id.as_str(),
                    match error {
                        RunError::NotBegun(_) | RunError::OpenResources(..) => {
                            Status::failed_precondition(error.to_string())
                        }
                        RunError::Journal(JournalError::Full { .. }) => {
                            Status::resource_exhausted(error.to_string())
                        }
                        RunError::Store(_)
                        | RunError::Journal(_)
                        | RunError::Background(_)
                        | RunError::Locked { .. } => Status::internal(error.to_string()),
                        _ => Status::permission_denied(error.to_string()),
                    },
                )
            })?;
        tracing::info!(rpc = rpc.name(), peer = %peer.label(), run_id = %run_id, "run closed");
        Ok(Response::new(pb::EndRunReply {
            run_id: run_id.to_string(),
            closed_unix_ms,
        }))
    }

    async fn map_backup(
        &self,
        request: Request<pb::MapBackupRequest>,
    ) -> Result<Response<pb::MapBackupReply>, Status> {
        operation!(self, request, Rpc::MapBackup, parse::map_backup, MapBackup)
    }

    async fn unmap_backup(
        &self,
        request: Request<pb::UnmapBackupRequest>,
    ) -> Result<Response<pb::UnmapBackupReply>, Status> {
        operation!(
            self,
            request,
            Rpc::UnmapBackup,
            parse::unmap_backup,
            UnmapBackup
        )
    }

    async fn create_overlay(
        &self,
        request: Request<pb::CreateOverlayRequest>,
    ) -> Result<Response<pb::CreateOverlayReply>, Status> {
        operation!(
            self,
            request,
            Rpc::CreateOverlay,
            parse::create_overlay,
            CreateOverlay
        )
    }

    async fn delete_overlay(
        &self,
        request: Request<pb::DeleteOverlayRequest>,
    ) -> Result<Response<pb::DeleteOverlayReply>, Status> {
        operation!(
            self,
            request,
            Rpc::DeleteOverlay,
            parse::delete_overlay,
            DeleteOverlay
        )
    }

    async fn create_vm(
        &self,
        request: Request<pb::CreateVmRequest>,
    ) -> Result<Response<pb::CreateVmReply>, Status> {
        operation!(self, request, Rpc::CreateVm, parse::create_vm, CreateVm)
    }

    async fn read_source_config(
        &self,
        request: Request<pb::ReadSourceConfigRequest>,
    ) -> Result<Response<pb::ReadSourceConfigReply>, Status> {
        operation!(
            self,
            request,
            Rpc::ReadSourceConfig,
            parse::read_source_config,
            ReadSourceConfig
        )
    }

    async fn recover_guest_network(
        &self,
        request: Request<pb::RecoverGuestNetworkRequest>,
    ) -> Result<Response<pb::RecoverGuestNetworkReply>, Status> {
        operation!(
            self,
            request,
            Rpc::RecoverGuestNetwork,
            parse::recover_guest_network,
            RecoverGuestNetwork
        )
    }

    async fn start_vm(
        &self,
        request: Request<pb::VmRequest>,
    ) -> Result<Response<pb::VmReply>, Status> {
        operation!(self, request, Rpc::StartVm, parse::start_vm, Vm)
    }

    async fn stop_vm(
        &self,
        request: Request<pb::StopVmRequest>,
    ) -> Result<Response<pb::VmReply>, Status> {
        operation!(self, request, Rpc::StopVm, parse::stop_vm, Vm)
    }

    async fn destroy_vm(
        &self,
        request: Request<pb::VmRequest>,
    ) -> Result<Response<pb::VmReply>, Status> {
        operation!(self, request, Rpc::DestroyVm, parse::destroy_vm, Vm)
    }

    async fn vm_status(
        &self,
        request: Request<pb::VmRequest>,
    ) -> Result<Response<pb::VmReply>, Status> {
        operation!(self, request, Rpc::VmStatus, parse::vm_status, Vm)
    }

    async fn qmp(
        &self,
        request: Request<pb::QmpRequest>,
    ) -> Result<Response<pb::QmpReply>, Status> {
        operation!(self, request, Rpc::Qmp, parse::qmp, Qmp)
    }

    async fn qga(
        &self,
        request: Request<pb::QgaRequest>,
    ) -> Result<Response<pb::QgaReply>, Status> {
        operation!(self, request, Rpc::Qga, parse::qga, Qga)
    }

    async fn prepare_sandbox(
        &self,
        request: Request<pb::PrepareSandboxRequest>,
    ) -> Result<Response<pb::PrepareSandboxReply>, Status> {
        operation!(
            self,
            request,
            Rpc::PrepareSandbox,
            parse::prepare_sandbox,
            PrepareSandbox
        )
    }

    async fn release_sandbox(
        &self,
        request: Request<pb::ReleaseSandboxRequest>,
    ) -> Result<Response<pb::ReleaseSandboxReply>, Status> {
        operation!(
            self,
            request,
            Rpc::ReleaseSandbox,
            parse::release_sandbox,
            ReleaseSandbox
        )
    }

    async fn probe(
        &self,
        request: Request<pb::ProbeRequest>,
    ) -> Result<Response<pb::ProbeReply>, Status> {
        operation!(self, request, Rpc::Probe, parse::probe, Probe)
    }

    type ReadJournalStream = JournalStream;

    async fn read_journal(
        &self,
        request: Request<pb::ReadJournalRequest>,
    ) -> Result<Response<Self::ReadJournalStream>, Status> {
        let rpc = Rpc::ReadJournal;
        let peer = self.authenticate(&request, rpc)?;
        let refuse = |status: Status| self.refuse_peer(rpc, &peer, status);
        let action = parse::read_journal(request.into_inner()).map_err(|e| refuse(invalid(e)))?;
        let Action::ReadJournal { run_id: target } = &action else {
            return Err(refuse(Status::internal(
                "ReadJournal parsed into another action",
            )));
        };
        // The call log names the caller; a run reads only its own journal, so the run read is
        // worth a line of its own only when an operator reads one.
        let announce = || {
            if matches!(peer.client.identity, Identity::Operator { .. }) {
                tracing::info!(rpc = rpc.name(), peer = %peer.label(), run_id = %target, "streaming");
            }
        };
        // An operator reads any run this node knows, closed ones included; a run reads its
        // own journal while it is open, as it calls every other operation.
        // `closed`: whether the run was closed when looked up, which tells what a journal found
        // at neither of its places means.
        let (path, closed): (PathBuf, bool) = match &peer.client.identity {
            Identity::Operator { .. } if self.runs.is_closed(target) => {
                let path = self.runs.journal_path(target).ok_or_else(|| {
                    refuse(Status::not_found(format!(
                        "no run {target} on this node (see ListRuns)"
                    )))
                })?;
                (path, true)
            }
            _ => {
                let resolved = self.resolve(&peer, rpc, &action)?;
                let run = resolved.run();
                // An open run's small journal from its records' wire forms in memory: no file
                // to read, no hand-off, no record turned into its wire form again.
                if let Some(records) = run.try_wire_records() {
                    announce();
                    let stream: JournalStream =
                        Box::pin(tokio_stream::iter(records.into_iter().map(Ok::<_, Status>)));
                    return Ok(Response::new(stream));
                }
                (run.journal_path().to_owned(), false)
            }
        };
        announce();
        let max_line = self.runs.max_journal_line();
        let run_id = target.to_string();
        // A run that closes after this lookup has its directory moved to `closed/` before the
        // file is opened: the stream looks there next.
        let closed_place = self.runs.closed_journal_path(target);
        let places = if path == closed_place {
            vec![path]
        } else {
            vec![path, closed_place]
        };
        let (sender, receiver) = tokio::sync::mpsc::channel(JOURNAL_STREAM_BUFFER);
        tokio::task::spawn_blocking(move || {
            stream_journal(&places, &run_id, closed, max_line, &sender)
        });
        let stream: JournalStream = Box::pin(tokio_stream::wrappers::ReceiverStream::new(receiver));
        Ok(Response::new(stream))
    }

    async fn list_runs(
        &self,
        request: Request<pb::ListRunsRequest>,
    ) -> Result<Response<pb::ListRunsReply>, Status> {
        let peer = self.authenticate(&request, Rpc::ListRuns)?;
        let page = parse::list_runs(request.get_ref())
            .map_err(|error| self.refuse(Rpc::ListRuns, &peer.label(), "", invalid(error)))?;
        let now = self.clock.now_unix();
        // Open runs: what they hold, from the records in memory; closed runs: their ids and
        // deadlines, from memory once listed. Answered on the async worker when nothing has to
        // wait (no append holds a journal, the closed runs listed and every deadline on the
        // page known); otherwise in one hand-off to a blocking thread, where a journal's lock
        // or the closed runs' files may be waited for. A hand-off parks the worker, and waking
        // it costs more than the call's own work (docs/performance.md, section 1).
        let open = self.runs.open_runs();
        let inline = open
            .iter()
            .map(|run| {
                run.try_open_resources()
                    .map(|resources| (run.clone(), resources))
            })
            .collect::<Option<Vec<_>>>()
            .zip(
                self.runs
                    .closed_deadlines_in_memory(page.after.as_ref(), page.page_size),
            );
        let (open, closed) = match inline {
            Some((open, closed)) => (open, Ok(closed)),
            None => {
                let registry = self.runs.clone();
                tokio::task::spawn_blocking(move || {
                    let open = open
                        .into_iter()
                        .map(|run| {
                            let resources = run.open_resources();
                            (run, resources)
                        })
                        .collect::<Vec<_>>();
                    (
                        open,
                        registry.closed_deadlines(page.after.as_ref(), page.page_size),
                    )
                })
                .await
                .map_err(|error| Status::internal(format!("listing the runs stopped: {error}")))?
            }
        };
        let (mut closed, next) = closed.map_err(|error| {
            Status::unavailable(format!("cannot list the closed runs: {error}"))
        })?;
        // A run closing while this call lists may be found on both sides: it is listed once,
        // from its handle (closed once its closing record is on disk).
        closed.retain(|(id, _)| !open.iter().any(|(run, _)| &run.run_id == id));
        let mut runs: Vec<pb::RunSummary> = open
            .into_iter()
            .map(|(run, open_resources)| pb::RunSummary {
                run_id: run.run_id.to_string(),
                // Closed once its closing record is on disk, though not yet moved.
                state: if run.is_closed() {
                    pb::RunState::Closed
                } else if now >= run.grant.deadline_unix {
                    pb::RunState::Expired
                } else {
                    pb::RunState::Open
                } as i32,
                deadline_unix: run.grant.deadline_unix,
                open_resources,
                quarantine_reason: String::new(),
            })
            .collect();
        runs.extend(
            closed
                .into_iter()
                .map(|(run_id, deadline_unix)| pb::RunSummary {
                    run_id: run_id.to_string(),
                    state: pb::RunState::Closed as i32,
                    deadline_unix,
                    open_resources: Vec::new(),
                    quarantine_reason: String::new(),
                }),
        );
        runs.sort_by(|a, b| a.run_id.cmp(&b.run_id));
        for (run_id, reason) in self.runs.quarantined() {
            // Its grant could not be read back, so neither its deadline nor what it holds is
            // known; an operator reads its journal and cleans up by hand.
            runs.push(pb::RunSummary {
                run_id: run_id.to_string(),
                state: pb::RunState::Quarantined as i32,
                deadline_unix: 0,
                open_resources: Vec::new(),
                quarantine_reason: printable(reason.as_bytes(), MAX_QUARANTINE_REASON_CHARS),
            });
        }
        Ok(Response::new(pb::ListRunsReply {
            runs,
            next_closed_cursor: next.map(|id| id.to_string()).unwrap_or_default(),
        }))
    }

    async fn cleanup(
        &self,
        request: Request<pb::CleanupRequest>,
    ) -> Result<Response<pb::CleanupReply>, Status> {
        operation!(self, request, Rpc::Cleanup, parse::cleanup, Cleanup)
    }

    async fn node_checks(
        &self,
        request: Request<pb::NodeChecksRequest>,
    ) -> Result<Response<pb::NodeChecksReply>, Status> {
        let peer = self.authenticate(&request, Rpc::NodeChecks)?;
        let vnet = crate::action::parse::node_checks(request.get_ref())
            .map_err(|error| self.refuse(Rpc::NodeChecks, &peer.label(), "", invalid(error)))?;
        let Some(prerequisites) = &self.prerequisites else {
            return Err(Status::unimplemented(
                "this connector was started without a node configuration to check",
            ));
        };
        let mut reply = prerequisites.read(vnet.as_ref()).await;
        if let Some(within) = crate::action::parse::appliance_boot(request.get_ref()) {
            reply.appliance_boot = Some(prerequisites.boot_appliance(within).await);
        }
        reply.node_time_unix_ms = self.clock.now_unix_ms();
        Ok(Response::new(reply))
    }
}

#[cfg(test)]
mod tests;
