//! An executor that records every action the connector hands over and changes nothing.

use certistack_connector::action::Action;
use certistack_connector::executor::{Caller, ExecFuture, Executor, Outcome, capability};
use certistack_proto::v1 as pb;
use std::sync::Mutex;

/// Every action the connector handed over, in order.
#[derive(Default)]
pub struct RecordingExecutor {
    pub actions: Mutex<Vec<Action>>,
}

impl RecordingExecutor {
    pub fn count(&self) -> usize {
        self.actions.lock().unwrap().len()
    }
    pub fn rpcs(&self) -> Vec<&'static str> {
        self.actions
            .lock()
            .unwrap()
            .iter()
            .map(|a| a.rpc().name())
            .collect()
    }
}

impl Executor for RecordingExecutor {
    fn capabilities(&self) -> Vec<&'static str> {
        vec!["test.recording"]
    }

    fn execute<'a>(&'a self, _caller: &'a Caller, action: Action) -> ExecFuture<'a> {
        let head = format!("recorded:{}", capability(&action));
        let outcome = match &action {
            Action::MapBackup { .. } => Outcome::MapBackup(pb::MapBackupReply {
                loop_device: "/dev/loop7".into(),
                journal_head: head,
                ..Default::default()
            }),
            Action::UnmapBackup { .. } => Outcome::UnmapBackup(pb::UnmapBackupReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::CreateOverlay { .. } => Outcome::CreateOverlay(pb::CreateOverlayReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::DeleteOverlay { .. } => {
                Outcome::DeleteOverlay(pb::DeleteOverlayReply { journal_head: head })
            }
            Action::CreateVm { .. } => Outcome::CreateVm(pb::CreateVmReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::StartVm { .. }
            | Action::StopVm { .. }
            | Action::DestroyVm { .. }
            | Action::VmStatus { .. } => Outcome::Vm(pb::VmReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::Qmp { .. } => Outcome::Qmp(pb::QmpReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::Qga { .. } => Outcome::Qga(pb::QgaReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::PrepareSandbox { .. } => Outcome::PrepareSandbox(pb::PrepareSandboxReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::ReleaseSandbox { .. } => {
                Outcome::ReleaseSandbox(pb::ReleaseSandboxReply { journal_head: head })
            }
            Action::Probe { .. } => Outcome::Probe(pb::ProbeReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::ReadJournal { .. } => {
                unreachable!("the service answers ReadJournal from the run registry")
            }
            Action::Cleanup { .. } => Outcome::Cleanup(pb::CleanupReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::ReadSourceConfig { .. } => {
                Outcome::ReadSourceConfig(pb::ReadSourceConfigReply {
                    journal_head: head,
                    ..Default::default()
                })
            }
            Action::RecoverGuestNetwork { .. } => {
                Outcome::RecoverGuestNetwork(pb::RecoverGuestNetworkReply {
                    journal_head: head,
                    ..Default::default()
                })
            }
        };
        self.actions.lock().unwrap().push(action);
        Box::pin(async move { Ok(outcome) })
    }
}
