//! Admitting one request: authenticate the connection's identity for the RPC, resolve the
//! caller and authorize its action against the run's grant, then run it within the run's
//! operation budget. A refusal at any step returns before the next.

use super::ConnectorService;
use crate::action::{Action, authorize};
use crate::connection::PeerInfo;
use crate::executor::{Caller, Outcome};
use crate::policy::Rpc;
use crate::runs::RunError;
use certistack_core::identity::{ClientIdentity, Identity};
use certistack_core::validate::FieldError;
use std::net::SocketAddr;
use std::sync::Arc;
use tonic::{Request, Status};

/// The authenticated caller of one request.
pub(super) struct Peer {
    pub(super) client: Arc<ClientIdentity>,
    /// The identity as logs name it, made once for the connection.
    pub(super) identity_text: Arc<str>,
    remote: SocketAddr,
}

impl Peer {
    pub(super) fn label(&self) -> String {
        format!("{} from {}", self.identity_text, self.remote)
    }
}

pub(super) fn run_id_of(identity: &Identity) -> String {
    match identity {
        Identity::Run { run_id, .. } => run_id.to_string(),
        Identity::Operator { .. } => String::new(),
    }
}

pub(super) fn invalid(error: FieldError) -> Status {
    Status::invalid_argument(error.to_string())
}

impl ConnectorService {
    /// A refusal of `rpc`; the call log records it with the peer once the status is sent.
    pub(super) fn refuse(&self, rpc: Rpc, peer: &str, run_id: &str, status: Status) -> Status {
        tracing::debug!(rpc = rpc.name(), peer, run_id, code = ?status.code(), "refusing");
        status
    }

    /// A refusal of `rpc` to `peer`, labelled with its run when it is one.
    pub(super) fn refuse_peer(&self, rpc: Rpc, peer: &Peer, status: Status) -> Status {
        self.refuse(
            rpc,
            &peer.label(),
            &run_id_of(&peer.client.identity),
            status,
        )
    }

    /// Step 1: who is calling, and may that kind of identity call `rpc` here and now.
    pub(super) fn authenticate<T>(&self, request: &Request<T>, rpc: Rpc) -> Result<Peer, Status> {
        let Some(info) = request.extensions().get::<PeerInfo>() else {
            return Err(self.refuse(
                rpc,
                "unknown",
                "",
                Status::unauthenticated("the connection carries no TLS identity"),
            ));
        };
        let client = match &info.identity {
            Ok(client) => client.clone(),
            Err(reason) => {
                return Err(self.refuse(
                    rpc,
                    &info.remote.to_string(),
                    "",
                    Status::unauthenticated(reason.to_string()),
                ));
            }
        };
        let peer = Peer {
            client,
            identity_text: info.identity_text.clone(),
            remote: info.remote,
        };
        let refuse = |status: Status| self.refuse_peer(rpc, &peer, status);
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
    pub(super) fn resolve(&self, peer: &Peer, rpc: Rpc, action: &Action) -> Result<Caller, Status> {
        let refuse = |status: Status| self.refuse_peer(rpc, peer, status);
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
    pub(super) async fn operate<T>(
        &self,
        request: Request<T>,
        rpc: Rpc,
        parse: fn(T) -> Result<Action, FieldError>,
    ) -> Result<Outcome, Status> {
        let peer = self.authenticate(&request, rpc)?;
        let refuse = |status: Status| self.refuse_peer(rpc, &peer, status);
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
