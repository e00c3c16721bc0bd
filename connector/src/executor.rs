//! The executor interface: where an authorized [`Action`] becomes a side effect on the node.
//!
//! The service hands every operation to an [`Executor`] only after authentication, parsing and
//! authorization succeeded. The daemon ships [`crate::node::NodeExecutor`]; `Hello` reports the
//! capabilities an executor implements ([`CAPABILITIES`] for the shipped one).

use crate::action::Action;
use crate::runs::RunHandle;
use certistack_proto::v1 as pb;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// Who an action is executed for.
#[derive(Debug, Clone)]
pub enum Caller {
    /// A run, with its grant and journal.
    Run(Arc<RunHandle>),
    /// An operator (recovery and inspection only), acting on one run.
    Operator { name: String, run: Arc<RunHandle> },
}

/// What an executed action produced; one variant per reply type.
#[derive(Debug, Clone)]
pub enum Outcome {
    MapBackup(pb::MapBackupReply),
    UnmapBackup(pb::UnmapBackupReply),
    CreateOverlay(pb::CreateOverlayReply),
    DeleteOverlay(pb::DeleteOverlayReply),
    CreateVm(pb::CreateVmReply),
    Vm(pb::VmReply),
    Qmp(pb::QmpReply),
    Qga(pb::QgaReply),
    PrepareSandbox(pb::PrepareSandboxReply),
    ReleaseSandbox(pb::ReleaseSandboxReply),
    Probe(pb::ProbeReply),
    Cleanup(pb::CleanupReply),
    ReadSourceConfig(pb::ReadSourceConfigReply),
    RecoverGuestNetwork(pb::RecoverGuestNetworkReply),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExecError {
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    Failed(String),
    /// The node took away something the step needs (a probe address an `ifreload` purged),
    /// or holds it still (a recovery unit that would not stop): an infrastructure failure, not
    /// the caller's and not the backup's. The reason reaches the caller typed, in the status
    /// details ([`pb::ErrorDetail`]), so it decides without reading the message.
    #[error("{1}")]
    Unavailable(pb::ErrorReason, String),
}

impl From<ExecError> for tonic::Status {
    fn from(error: ExecError) -> Self {
        let message = error.to_string();
        match error {
            ExecError::FailedPrecondition(_) => tonic::Status::failed_precondition(message),
            ExecError::NotFound(_) => tonic::Status::not_found(message),
            ExecError::AlreadyExists(_) => tonic::Status::already_exists(message),
            ExecError::DeadlineExceeded(_) => tonic::Status::deadline_exceeded(message),
            ExecError::ResourceExhausted(_) => tonic::Status::resource_exhausted(message),
            ExecError::Failed(_) => tonic::Status::internal(message),
            ExecError::Unavailable(reason, _) => {
                let detail = pb::ErrorDetail {
                    reason: reason as i32,
                };
                tonic::Status::with_details(
                    tonic::Code::Unavailable,
                    message,
                    prost::Message::encode_to_vec(&detail).into(),
                )
            }
        }
    }
}

pub type ExecFuture<'a> = Pin<Box<dyn Future<Output = Result<Outcome, ExecError>> + Send + 'a>>;
pub type ResidueFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<String>, ExecError>> + Send + 'a>>;
pub type RecoverFuture<'a> = Pin<Box<dyn Future<Output = Result<(), ExecError>> + Send + 'a>>;

pub trait Executor: Send + Sync + 'static {
    /// The capabilities (see [`capability`]) this executor implements; reported by `Hello`.
    fn capabilities(&self) -> Vec<&'static str>;
    fn execute<'a>(&'a self, caller: &'a Caller, action: Action) -> ExecFuture<'a>;

    /// What the node still holds for the run (read from the node, not only from the journal);
    /// a run may end only when this is empty. An executor without side effects holds nothing.
    fn residue<'a>(&'a self, _run: &'a RunHandle) -> ResidueFuture<'a> {
        Box::pin(async { Ok(Vec::new()) })
    }

    /// Settles the steps of the run a previous daemon was interrupted in (their tools killed
    /// and proven gone), when the daemon starts.
    fn recover<'a>(&'a self, _run: &'a RunHandle) -> RecoverFuture<'a> {
        Box::pin(async { Ok(()) })
    }
}

/// Every capability, in the order `Hello` reports them.
pub const CAPABILITIES: [&str; 18] = [
    "backup.map",
    "backup.unmap",
    "overlay.create",
    "overlay.delete",
    "vm.create",
    "vm.start",
    "vm.stop",
    "vm.destroy",
    "vm.status",
    "guest.qmp",
    "guest.qga",
    "sandbox.prepare",
    "sandbox.release",
    "sandbox.probe",
    "journal.read",
    "recovery.cleanup",
    "source.config",
    "guest.network",
];

/// The capability an action needs, one of [`CAPABILITIES`].
pub fn capability(action: &Action) -> &'static str {
    match action {
        Action::MapBackup { .. } => "backup.map",
        Action::UnmapBackup { .. } => "backup.unmap",
        Action::CreateOverlay { .. } => "overlay.create",
        Action::DeleteOverlay { .. } => "overlay.delete",
        Action::CreateVm { .. } => "vm.create",
        Action::StartVm { .. } => "vm.start",
        Action::StopVm { .. } => "vm.stop",
        Action::DestroyVm { .. } => "vm.destroy",
        Action::VmStatus { .. } => "vm.status",
        Action::Qmp { .. } => "guest.qmp",
        Action::Qga { .. } => "guest.qga",
        Action::PrepareSandbox { .. } => "sandbox.prepare",
        Action::ReleaseSandbox { .. } => "sandbox.release",
        Action::Probe { .. } => "sandbox.probe",
        Action::ReadJournal { .. } => "journal.read",
        Action::Cleanup { .. } => "recovery.cleanup",
        Action::ReadSourceConfig { .. } => "source.config",
        Action::RecoverGuestNetwork { .. } => "guest.network",
    }
}

impl Caller {
    /// The run the action is for.
    pub fn run(&self) -> &Arc<RunHandle> {
        match self {
            Caller::Run(run) | Caller::Operator { run, .. } => run,
        }
    }
}
