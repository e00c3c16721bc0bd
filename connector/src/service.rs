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

use crate::action::{Action, authorize, parse};
use crate::executor::{Caller, ExecError, Executor, Outcome};
use crate::grant::{self, GrantError};
use crate::identity::{ClientIdentity, Identity};
use crate::policy::{Gate, Rpc};
use crate::runs::{RunError, RunRegistry, RunState};
use crate::tls::PeerInfo;
use crate::validate::{FieldError, NodeName};
use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_server::Connector;
use ed25519_dalek::VerifyingKey;
use std::pin::Pin;
use std::sync::Arc;
use tonic::{Request, Response, Status};

/// The node's clock, a parameter so tests can move it.
pub trait Clock: Send + Sync + 'static {
    fn now_unix_ms(&self) -> i64;
    fn now_unix(&self) -> i64 {
        self.now_unix_ms().div_euclid(1000)
    }
}

#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_unix_ms(&self) -> i64 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        i64::try_from(now.as_millis()).unwrap_or(i64::MAX)
    }
}

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
}

impl std::fmt::Debug for ConnectorService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectorService")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

/// The authenticated caller of one request.
struct Peer {
    client: ClientIdentity,
    remote: String,
}

impl Peer {
    fn label(&self) -> String {
        format!("{} from {}", self.client.identity, self.remote)
    }
}

fn run_id_of(identity: &Identity) -> String {
    match identity {
        Identity::Run { run_id, .. } => run_id.to_string(),
        Identity::Operator { .. } => String::new(),
    }
}

fn invalid(error: FieldError) -> Status {
    Status::invalid_argument(error.to_string())
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
            runs,
            executor,
            clock,
            min_probe_prefix: crate::config::Limits::default().min_probe_prefix,
        }
    }

    /// Sets the shortest probe-network prefix a grant may name (`limits.min_probe_prefix`).
    pub fn with_min_probe_prefix(mut self, min_probe_prefix: u8) -> Self {
        self.min_probe_prefix = min_probe_prefix;
        self
    }

    /// Cleans up every open run whose deadline plus the grace has passed, journals it as
    /// expired and closes it. A run whose cleanup leaves residue stays open (and listed) for an
    /// operator, and is retried on the next pass.
    pub async fn reap_expired(&self) {
        let now = self.clock.now_unix();
        for record in self.runs.list() {
            let deadline = record.grant().deadline_unix;
            if record.state != RunState::Open
                || now < deadline.saturating_add(self.expiry_grace_secs)
            {
                continue;
            }
            let run_id = record.grant().run_id.clone();
            let caller = Caller::Operator {
                name: "expiry".into(),
                run: record.handle.clone(),
            };
            let result = self
                .executor
                .execute(
                    &caller,
                    Action::Cleanup {
                        run_id: run_id.clone(),
                    },
                )
                .await;
            // The run closes only when the node holds nothing named for it any more.
            let residue = match result {
                Ok(Outcome::Cleanup(_)) => self.executor.residue(&record.handle).await,
                Ok(_) => Err(ExecError::Failed(
                    "the executor answered Cleanup with the wrong reply type".into(),
                )),
                Err(error) => Err(error),
            };
            match residue {
                Ok(residue) if residue.is_empty() => {
                    match self.runs.expire(&run_id, self.clock.now_unix_ms()).await {
                        Ok(_) => {
                            tracing::warn!(%run_id, deadline, "run passed its deadline without EndRun: cleaned up and closed as expired")
                        }
                        Err(error) => {
                            tracing::error!(%run_id, %error, "cannot close the expired run")
                        }
                    }
                }
                Ok(residue) => {
                    tracing::error!(%run_id, ?residue, "expired run left residue; an operator must look at it")
                }
                Err(error) => {
                    tracing::error!(%run_id, %error, "cleanup of the expired run failed; retrying on the next pass")
                }
            }
        }
    }

    /// Settles, for every open run, the steps a previous daemon was interrupted in: their
    /// tools are killed and proven gone before anything else is decided.
    pub async fn recover_interrupted(&self) {
        for record in self.runs.list() {
            if record.state != RunState::Open {
                continue;
            }
            if let Err(error) = self.executor.recover(&record.handle).await {
                tracing::error!(run_id = %record.grant().run_id, %error, "cannot settle an interrupted step");
            }
        }
    }

    /// A refusal of `rpc`; the call log records it with the peer once the status is sent.
    fn refuse(&self, rpc: Rpc, peer: &str, run_id: &str, status: Status) -> Status {
        tracing::debug!(rpc = rpc.name(), peer, run_id, code = ?status.code(), "refusing");
        status
    }

    /// Step 1: who is calling, and may that kind of identity call `rpc` here and now.
    fn authenticate<T>(&self, request: &Request<T>, rpc: Rpc) -> Result<Peer, Status> {
        let Some(info) = request.extensions().get::<PeerInfo>() else {
            return Err(self.refuse(
                rpc,
                "unknown",
                "",
                Status::unauthenticated("the connection carries no TLS identity"),
            ));
        };
        let remote = info.remote.to_string();
        let client = match &info.identity {
            Ok(client) => client.clone(),
            Err(reason) => {
                return Err(self.refuse(
                    rpc,
                    &remote,
                    "",
                    Status::unauthenticated(reason.to_string()),
                ));
            }
        };
        let peer = Peer { client, remote };
        let run_id = run_id_of(&peer.client.identity);
        let refuse = |status: Status| self.refuse(rpc, &peer.label(), &run_id, status);
        let now = self.clock.now_unix();
        if now < peer.client.not_before_unix || now > peer.client.not_after_unix {
            return Err(refuse(Status::unauthenticated(format!(
                "the client certificate (serial {}) is valid from {} to {}, node time is {now}; obtain a fresh one",
                peer.client.serial_hex, peer.client.not_before_unix, peer.client.not_after_unix
            ))));
        }
        self.gate
            .admits(&peer.client)
            .map_err(|reason| refuse(Status::unauthenticated(reason)))?;
        let kind = peer.client.identity.kind();
        if !self.gate.allows(rpc, kind) {
            return Err(refuse(Status::permission_denied(format!(
                "a {kind:?} identity may not call {} (policy/rpc-surface.toml)",
                rpc.name()
            ))));
        }
        if let Identity::Run {
            run_id: id, node, ..
        } = &peer.client.identity
        {
            if node != &self.node {
                return Err(refuse(Status::permission_denied(format!(
                    "the run certificate is bound to node {node}, this is node {}",
                    self.node
                ))));
            }
            if self.runs.is_closed(id) {
                return Err(refuse(Status::permission_denied(
                    RunError::Closed(id.clone()).to_string(),
                )));
            }
        }
        Ok(peer)
    }

    /// Steps 1–4 for an operation RPC.
    async fn operate<T>(
        &self,
        request: Request<T>,
        rpc: Rpc,
        parse: fn(T) -> Result<Action, FieldError>,
    ) -> Result<Outcome, Status> {
        let peer = self.authenticate(&request, rpc)?;
        let run_id = run_id_of(&peer.client.identity);
        let refuse = |status: Status| self.refuse(rpc, &peer.label(), &run_id, status);
        let action = parse(request.into_inner()).map_err(|e| refuse(invalid(e)))?;
        let caller = match &peer.client.identity {
            Identity::Operator { name } => {
                // Operators act on a named run (ReadJournal, Cleanup): resolve it here so the
                // executor only ever sees runs this node knows.
                let target = match &action {
                    Action::ReadJournal { run_id } | Action::Cleanup { run_id } => run_id,
                    _ => {
                        return Err(refuse(Status::internal(
                            "the policy admitted an operator to a run operation",
                        )));
                    }
                };
                let record = match self.runs.get(target) {
                    Some(record) => record,
                    None => {
                        return Err(refuse(match self.runs.quarantine(target) {
                            Some(quarantined) => {
                                Status::failed_precondition(quarantined.to_string())
                            }
                            None => Status::not_found(format!(
                                "no run {target} on this node (see ListRuns)"
                            )),
                        }));
                    }
                };
                Caller::Operator {
                    name: name.clone(),
                    run: record.handle,
                }
            }
            Identity::Run {
                run_id: id,
                grant_sha256,
                ..
            } => {
                let record = self.runs.get(id).ok_or_else(|| {
                    let refusal = self
                        .runs
                        .quarantine(id)
                        .unwrap_or_else(|| RunError::NotBegun(id.clone()));
                    refuse(Status::failed_precondition(refusal.to_string()))
                })?;
                if record.state != RunState::Open {
                    return Err(refuse(Status::permission_denied(
                        RunError::Closed(id.clone()).to_string(),
                    )));
                }
                if &record.grant().digest != grant_sha256 {
                    return Err(refuse(Status::permission_denied(
                        "the certificate's grant digest differs from the grant this run began with",
                    )));
                }
                let now = self.clock.now_unix();
                if now >= record.grant().deadline_unix {
                    return Err(refuse(Status::permission_denied(format!(
                        "run {id} passed its grant deadline {} (node time {now}); an operator Cleanup reclaims what it left",
                        record.grant().deadline_unix
                    ))));
                }
                authorize(record.grant(), &action)
                    .map_err(|denial| refuse(Status::permission_denied(denial.to_string())))?;
                Caller::Run(record.handle.clone())
            }
        };
        self.executor
            .execute(&caller, action)
            .await
            .map_err(Status::from)
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
            peer_identity: peer.client.identity.to_string(),
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
            .map_err(|error| {
                refuse(match error {
                    RunError::TooMany { .. } => Status::resource_exhausted(error.to_string()),
                    RunError::Store(_) | RunError::Journal(_) => {
                        Status::internal(error.to_string())
                    }
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
        if let Some(record) = self.runs.get(run_id)
            && &record.grant().digest != grant_sha256
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
        if let Some(record) = self.runs.get(run_id)
            && record.state == RunState::Open
        {
            let residue = self
                .executor
                .residue(&record.handle)
                .await
                .map_err(|error| self.refuse(rpc, &peer.label(), run_id.as_str(), error.into()))?;
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
                        RunError::Store(_) | RunError::Journal(_) => {
                            Status::internal(error.to_string())
                        }
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
        match self
            .operate(request, Rpc::ReadJournal, parse::read_journal)
            .await?
        {
            Outcome::Journal(records) => {
                let stream: JournalStream =
                    Box::pin(tokio_stream::iter(records.into_iter().map(Ok)));
                Ok(Response::new(stream))
            }
            _ => Err(unexpected(Rpc::ReadJournal)),
        }
    }

    async fn list_runs(
        &self,
        request: Request<pb::ListRunsRequest>,
    ) -> Result<Response<pb::ListRunsReply>, Status> {
        self.authenticate(&request, Rpc::ListRuns)?;
        let now = self.clock.now_unix();
        let mut runs = Vec::new();
        for record in self.runs.list() {
            // What the run still has on the node, as its journal says.
            let open_resources = match record.handle.records().await {
                Ok(records) => crate::node::resources::open_newest_first(&records)
                    .into_iter()
                    .map(|state| {
                        format!(
                            "{} ({} {})",
                            state.key,
                            state.last.entry.op,
                            state.last.entry.phase.name()
                        )
                    })
                    .collect(),
                Err(error) => vec![format!("journal unreadable: {error}")],
            };
            runs.push(pb::RunSummary {
                run_id: record.grant().run_id.to_string(),
                state: match record.state {
                    RunState::Closed { .. } => pb::RunState::Closed,
                    RunState::Open if now >= record.grant().deadline_unix => pb::RunState::Expired,
                    RunState::Open => pb::RunState::Open,
                } as i32,
                deadline_unix: record.grant().deadline_unix,
                open_resources,
            });
        }
        for (run_id, reason) in self.runs.quarantined() {
            runs.push(pb::RunSummary {
                run_id: run_id.to_string(),
                state: pb::RunState::Open as i32,
                deadline_unix: 0,
                open_resources: vec![format!("unknown: {reason}")],
            });
        }
        Ok(Response::new(pb::ListRunsReply { runs }))
    }

    async fn cleanup(
        &self,
        request: Request<pb::CleanupRequest>,
    ) -> Result<Response<pb::CleanupReply>, Status> {
        operation!(self, request, Rpc::Cleanup, parse::cleanup, Cleanup)
    }
}
