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
//! The run registry answers the rest itself: `ListRuns` from its index and the open runs'
//! records in memory, `ReadJournal` by streaming the journal file, verifying the chain as it
//! goes. Operations that add to the node are refused with `RESOURCE_EXHAUSTED` once the run's
//! journal reaches its operation budget; what undoes or cleans up keeps the reserve.

use crate::action::{Action, authorize, parse};
pub use crate::clock::{Clock, SystemClock};
use crate::executor::{Caller, ExecError, Executor, Outcome};
use crate::grant::{self, GrantError};
use crate::identity::{ClientIdentity, Identity};
use crate::journal::{self, JournalError};
use crate::policy::{Gate, Rpc};
use crate::runs::{RunError, RunRegistry};
use crate::tls::PeerInfo;
use crate::untrusted::printable;
use crate::validate::{FieldError, NodeName, RunId};
use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_server::Connector;
use ed25519_dalek::VerifyingKey;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use tonic::{Request, Response, Status};

/// The expiry reaper's first retry delay for a run it could not clean up, doubled per failed
/// pass up to [`REAP_BACKOFF_MAX_SECS`].
const REAP_BACKOFF_FIRST_SECS: i64 = 60;
const REAP_BACKOFF_MAX_SECS: i64 = 3600;
/// Seconds between two prunes of closed runs past their retention.
const PRUNE_EVERY_SECS: i64 = 3600;
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

    /// Cleans up every open run whose deadline plus the grace has passed, journals it as
    /// expired and closes it. A run whose cleanup leaves residue stays open (and listed) for an
    /// operator and is retried after a delay that doubles up to an hour; its journal records a
    /// cleanup only when what it found changed. Also prunes closed runs past their retention.
    pub async fn reap_expired(&self) {
        let now = self.clock.now_unix();
        self.prune_closed(now).await;
        for run in self.runs.open_runs() {
            let deadline = run.grant.deadline_unix;
            if run.is_closed() || now < deadline.saturating_add(self.expiry_grace_secs) {
                continue;
            }
            let run_id = run.run_id.clone();
            let backoff = self.backoff().get(&run_id).copied();
            if backoff.is_some_and(|(next_at, _)| now < next_at) {
                continue;
            }
            let caller = Caller::Operator {
                name: "expiry".into(),
                run: run.clone(),
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
                Ok(Outcome::Cleanup(_)) => self.executor.residue(&run).await,
                Ok(_) => Err(ExecError::Failed(
                    "the executor answered Cleanup with the wrong reply type".into(),
                )),
                Err(error) => Err(error),
            };
            let clean = match residue {
                Ok(residue) if residue.is_empty() => {
                    match self.runs.expire(&run_id, self.clock.now_unix_ms()).await {
                        Ok(_) => {
                            tracing::warn!(%run_id, deadline, "run passed its deadline without EndRun: cleaned up and closed as expired");
                            true
                        }
                        // EndRun closed it while the cleanup ran.
                        Err(RunError::Closed(_)) => true,
                        Err(error) => {
                            tracing::error!(%run_id, %error, "cannot close the expired run");
                            false
                        }
                    }
                }
                Ok(residue) => {
                    tracing::error!(%run_id, ?residue, "expired run left residue; an operator must look at it");
                    false
                }
                Err(_) if run.is_closed() => true,
                Err(error) => {
                    tracing::error!(%run_id, %error, "cleanup of the expired run failed; retrying later");
                    false
                }
            };
            let mut backoffs = self.backoff();
            if clean {
                backoffs.remove(&run_id);
            } else {
                let delay = backoff.map_or(REAP_BACKOFF_FIRST_SECS, |(_, delay)| {
                    delay.saturating_mul(2).min(REAP_BACKOFF_MAX_SECS)
                });
                backoffs.insert(run_id, (now.saturating_add(delay), delay));
            }
        }
    }

    /// Settles, for every open run, the steps a previous daemon was interrupted in: their
    /// tools are killed and proven gone before anything else is decided.
    pub async fn recover_interrupted(&self) {
        for run in self.runs.open_runs() {
            if run.is_closed() {
                continue;
            }
            if let Err(error) = self.executor.recover(&run).await {
                tracing::error!(run_id = %run.run_id, %error, "cannot settle an interrupted step");
            }
        }
    }

    /// When the reaper retries `run_id` next, if its last cleanup left residue.
    pub fn reap_retry_at(&self, run_id: &RunId) -> Option<i64> {
        self.backoff().get(run_id).map(|(next_at, _)| *next_at)
    }

    fn backoff(&self) -> std::sync::MutexGuard<'_, BTreeMap<RunId, (i64, i64)>> {
        self.reap_backoff
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    async fn prune_closed(&self, now: i64) {
        let last = self
            .last_prune_unix
            .load(std::sync::atomic::Ordering::SeqCst);
        if now.saturating_sub(last) < PRUNE_EVERY_SECS {
            return;
        }
        self.last_prune_unix
            .store(now, std::sync::atomic::Ordering::SeqCst);
        let now_ms = self.clock.now_unix_ms();
        // One bounded batch per trip to the blocking pool, so a long history never holds a
        // blocking thread (or the pass) for long.
        let mut after = None;
        loop {
            let runs = self.runs.clone();
            let from = after.clone();
            let batch = tokio::task::spawn_blocking(move || {
                runs.prune_batch(now_ms, from.as_ref(), crate::runs::PRUNE_BATCH)
            })
            .await;
            match batch {
                Ok(Ok((_, Some(next)))) => after = Some(next),
                Ok(Ok((_, None))) => return,
                Ok(Err(error)) => return tracing::error!(%error, "cannot prune closed runs"),
                Err(error) => return tracing::error!(%error, "pruning closed runs stopped"),
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

    /// Steps 3 and the run lookup: the run `action` is for, if the caller may act on it.
    fn resolve(&self, peer: &Peer, rpc: Rpc, action: &Action) -> Result<Caller, Status> {
        let run_id = run_id_of(&peer.client.identity);
        let refuse = |status: Status| self.refuse(rpc, &peer.label(), &run_id, status);
        match &peer.client.identity {
            Identity::Operator { name } => {
                // Operators act on a named run (ReadJournal, Cleanup): resolve it here so the
                // executor only ever sees runs this node knows.
                let target = match action {
                    Action::ReadJournal { run_id } | Action::Cleanup { run_id } => run_id,
                    _ => {
                        return Err(refuse(Status::internal(
                            "the policy admitted an operator to a run operation",
                        )));
                    }
                };
                let Some(run) = self.runs.get(target) else {
                    return Err(refuse(if self.runs.is_closed(target) {
                        Status::failed_precondition(format!(
                            "run {target} is closed: it left nothing on the node to clean up (ReadJournal still reads its journal)"
                        ))
                    } else if let Some(quarantined) = self.runs.quarantine(target) {
                        Status::failed_precondition(quarantined.to_string())
                    } else {
                        Status::not_found(format!("no run {target} on this node (see ListRuns)"))
                    }));
                };
                Ok(Caller::Operator {
                    name: name.clone(),
                    run,
                })
            }
            Identity::Run {
                run_id: id,
                grant_sha256,
                ..
            } => {
                let run = self.runs.get(id).ok_or_else(|| {
                    if self.runs.is_closed(id) {
                        return refuse(Status::permission_denied(
                            RunError::Closed(id.clone()).to_string(),
                        ));
                    }
                    let refusal = self
                        .runs
                        .quarantine(id)
                        .unwrap_or_else(|| RunError::NotBegun(id.clone()));
                    refuse(Status::failed_precondition(refusal.to_string()))
                })?;
                if &run.grant.digest != grant_sha256 {
                    return Err(refuse(Status::permission_denied(
                        "the certificate's grant digest differs from the grant this run began with",
                    )));
                }
                let now = self.clock.now_unix();
                if now >= run.grant.deadline_unix {
                    return Err(refuse(Status::permission_denied(format!(
                        "run {id} passed its grant deadline {} (node time {now}); an operator Cleanup reclaims what it left",
                        run.grant.deadline_unix
                    ))));
                }
                authorize(&run.grant, action)
                    .map_err(|denial| refuse(Status::permission_denied(denial.to_string())))?;
                Ok(Caller::Run(run))
            }
        }
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
        let caller = self.resolve(&peer, rpc, &action)?;
        if !undoes_or_reads(&action) {
            let (records, bytes) = caller.run().journal_usage();
            let (max_records, max_bytes) = self.runs.limits().journal.operation_budget();
            if records >= max_records || bytes >= max_bytes {
                return Err(refuse(Status::resource_exhausted(format!(
                    "run {} has journaled {records} records and {bytes} bytes; new operations stop at {max_records} records or {max_bytes} bytes (limits.max_journal_records, limits.max_journal_bytes), the rest is kept for cleanup: undo what the run holds and end it",
                    caller.run().run_id
                ))));
            }
        }
        self.executor
            .execute(&caller, action)
            .await
            .map_err(Status::from)
    }
}

/// Whether an action only undoes, inspects or cleans up: those are admitted while the
/// run's journal is past its operation budget, into the reserve kept for them.
fn undoes_or_reads(action: &Action) -> bool {
    match action {
        Action::UnmapBackup { .. }
        | Action::DeleteOverlay { .. }
        | Action::DestroyVm { .. }
        | Action::VmStatus { .. }
        | Action::ReleaseSandbox { .. }
        | Action::ReadJournal { .. }
        | Action::Cleanup { .. } => true,
        // Repeatable and journaled: admitted into the reserve, stops could spend what the
        // destroy and cleanup of the VM need. DestroyVm and Cleanup stop the VM themselves.
        Action::StopVm { .. }
        | Action::MapBackup { .. }
        | Action::CreateOverlay { .. }
        | Action::CreateVm { .. }
        | Action::StartVm { .. }
        | Action::Qmp { .. }
        | Action::Qga { .. }
        | Action::PrepareSandbox { .. }
        | Action::Probe { .. }
        | Action::ReadSourceConfig { .. }
        | Action::RecoverGuestNetwork { .. } => false,
    }
}

/// Streams the journal at `path` into `records`, verifying the chain, one record in memory at
/// a time. Records appended after the call began are left out; so is a torn last record
/// (a write in progress, or the tail of a crash that start-up sets aside). Stops when the
/// reader goes away.
fn stream_journal(
    path: &Path,
    run_id: &str,
    max_line: u64,
    records: &tokio::sync::mpsc::Sender<Result<pb::JournalRecord, Status>>,
) {
    let opened = std::fs::File::open(path).and_then(|file| {
        let len = file.metadata()?.len();
        Ok(std::io::Read::take(file, len))
    });
    let file = match opened {
        Ok(file) => file,
        Err(error) => {
            let _ = records.blocking_send(Err(Status::internal(format!(
                "cannot read the journal {}: {error}",
                path.display()
            ))));
            return;
        }
    };
    let reader = journal::Reader::new(std::io::BufReader::new(file), path, run_id, max_line);
    for record in reader {
        let item = record.map(|r| r.to_wire()).map_err(|error| match error {
            JournalError::Corrupt { .. } => Status::data_loss(error.to_string()),
            _ => Status::internal(error.to_string()),
        });
        let last = item.is_err();
        if records.blocking_send(item).is_err() || last {
            return;
        }
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
        let label = run_id_of(&peer.client.identity);
        let refuse = |status: Status| self.refuse(rpc, &peer.label(), &label, status);
        let action = parse::read_journal(request.into_inner()).map_err(|e| refuse(invalid(e)))?;
        let Action::ReadJournal { run_id: target } = &action else {
            return Err(refuse(Status::internal(
                "ReadJournal parsed into another action",
            )));
        };
        // An operator reads any run this node knows, closed ones included; a run reads its
        // own journal while it is open, as it calls every other operation.
        let path: PathBuf = match &peer.client.identity {
            Identity::Operator { .. } if self.runs.is_closed(target) => {
                self.runs.journal_path(target).ok_or_else(|| {
                    refuse(Status::not_found(format!(
                        "no run {target} on this node (see ListRuns)"
                    )))
                })?
            }
            _ => self
                .resolve(&peer, rpc, &action)?
                .run()
                .journal_path()
                .to_owned(),
        };
        let (sender, receiver) = tokio::sync::mpsc::channel(JOURNAL_STREAM_BUFFER);
        let max_line = self.runs.max_journal_line();
        let run_id = target.to_string();
        tokio::task::spawn_blocking(move || stream_journal(&path, &run_id, max_line, &sender));
        tracing::info!(rpc = rpc.name(), peer = %peer.label(), run_id = %target, "streaming");
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
        // Open runs: what they hold, from the records in memory (which takes each journal's
        // lock, so off the async workers). Closed runs: their index entry.
        let open = self.runs.open_runs();
        let open = tokio::task::spawn_blocking(move || {
            open.into_iter()
                .map(|run| {
                    let resources = run.open_resources();
                    (run, resources)
                })
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|error| Status::internal(format!("listing the open runs stopped: {error}")))?;
        let mut runs: Vec<pb::RunSummary> = open
            .into_iter()
            .map(|(run, open_resources)| pb::RunSummary {
                run_id: run.run_id.to_string(),
                state: if now >= run.grant.deadline_unix {
                    pb::RunState::Expired
                } else {
                    pb::RunState::Open
                } as i32,
                deadline_unix: run.grant.deadline_unix,
                open_resources,
                quarantine_reason: String::new(),
            })
            .collect();
        let registry = self.runs.clone();
        let (closed, next) = tokio::task::spawn_blocking(move || {
            registry.closed_page(page.after.as_ref(), page.page_size)
        })
        .await
        .map_err(|error| Status::internal(format!("listing the closed runs stopped: {error}")))?
        .map_err(|error| Status::unavailable(format!("cannot list the closed runs: {error}")))?;
        runs.extend(closed.into_iter().map(|(run_id, closed)| pb::RunSummary {
            run_id: run_id.to_string(),
            state: pb::RunState::Closed as i32,
            deadline_unix: closed.deadline_unix,
            open_resources: Vec::new(),
            quarantine_reason: String::new(),
        }));
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
mod tests {
    use super::*;
    use crate::executor::ExecFuture;
    use crate::grant::tests::{full_wire_grant, sign};
    use crate::runs::RegistryLimits;
    use crate::validate::Validated;
    use ed25519_dalek::SigningKey;
    use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};

    #[derive(Default)]
    struct TestClock(AtomicI64);

    impl Clock for TestClock {
        fn now_unix_ms(&self) -> i64 {
            self.0.load(Ordering::SeqCst)
        }
    }

    /// Answers Cleanup with residue until told the node is clean.
    #[derive(Default)]
    struct ResidueExecutor {
        cleanups: AtomicUsize,
        clean: std::sync::atomic::AtomicBool,
    }

    impl Executor for ResidueExecutor {
        fn capabilities(&self) -> Vec<&'static str> {
            Vec::new()
        }
        fn execute<'a>(&'a self, _: &'a Caller, _: Action) -> ExecFuture<'a> {
            self.cleanups.fetch_add(1, Ordering::SeqCst);
            let residue = if self.clean.load(Ordering::SeqCst) {
                Vec::new()
            } else {
                vec!["VM 9100 config".to_owned()]
            };
            Box::pin(async move {
                Ok(Outcome::Cleanup(pb::CleanupReply {
                    resources: Vec::new(),
                    residue,
                    journal_head: String::new(),
                }))
            })
        }
        fn residue<'a>(
            &'a self,
            _: &'a crate::runs::RunHandle,
        ) -> crate::executor::ResidueFuture<'a> {
            let clean = self.clean.load(Ordering::SeqCst);
            Box::pin(async move {
                Ok(if clean {
                    Vec::new()
                } else {
                    vec!["VM 9100 config".to_owned()]
                })
            })
        }
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn the_reaper_backs_off_from_a_run_with_residue() {
        let dir = std::env::temp_dir().join(format!("certistack-reaper-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let key = SigningKey::from_bytes(&[1; 32]);
        let runs = Arc::new(
            RunRegistry::open(&dir, &key.verifying_key(), RegistryLimits::default(), 0).unwrap(),
        );
        let signed = sign(&key, &full_wire_grant());
        let grant = crate::grant::verify(&signed, &key.verifying_key()).unwrap();
        let run_id = grant.run_id.clone();
        runs.begin(&signed, grant, 2_000_000).await.unwrap();
        let executor = Arc::new(ResidueExecutor::default());
        let clock = Arc::new(TestClock::default());
        let service = ConnectorService::new(
            NodeName::validate("pve1").unwrap(),
            crate::policy::SurfacePolicy::compiled()
                .unwrap()
                .gate()
                .unwrap(),
            key.verifying_key(),
            runs.clone(),
            executor.clone(),
            clock.clone(),
            0,
        );
        // The grant's deadline is 4_600 s; the reaper passes every 30 s from 5_000 s on.
        let mut attempts_at = Vec::new();
        for pass in 0..16 {
            let now = 5_000 + pass * 30;
            clock.0.store(now * 1000, Ordering::SeqCst);
            let before = executor.cleanups.load(Ordering::SeqCst);
            service.reap_expired().await;
            if executor.cleanups.load(Ordering::SeqCst) > before {
                attempts_at.push(now);
            }
        }
        // Retried after 60, 120 and 240 s, not on every pass.
        assert_eq!(attempts_at, [5_000, 5_060, 5_180, 5_420]);
        assert_eq!(service.reap_retry_at(&run_id), Some(5_420 + 480));
        assert!(!runs.is_closed(&run_id));
        // Once the node is clean, the next attempt closes the run as expired.
        executor.clean.store(true, Ordering::SeqCst);
        clock.0.store(5_900 * 1000, Ordering::SeqCst);
        service.reap_expired().await;
        assert!(runs.is_closed(&run_id));
        assert_eq!(service.reap_retry_at(&run_id), None);
        // The reaper's passes also prune closed runs past their retention (90 days).
        clock
            .0
            .store((5_900 + 91 * 86_400) * 1000, Ordering::SeqCst);
        service.reap_expired().await;
        assert!(runs.closed_page(None, 10).unwrap().0.is_empty());
        assert!(!crate::runs::closed_run_dir(&dir, &run_id).exists());
        assert!(!runs.is_closed(&run_id));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
