//! What every resource's executor shares: the daemon's configuration and clock, where block
//! devices are read, and the steps common to all of them (locking a run, running a journaled
//! tool, journaling a step's end). Locking a run first settles the steps a previous daemon
//! was interrupted in, which [`super::cleanup`] does.
//!
//! Each resource kind has an executor of its own over this context, and its module adds the
//! accessor that builds it (`ctx.sandbox()`): one resource reaches another through the
//! context, so neither names the other's module, and the context names none of them.

use super::{tool_detail, tool_error};
use crate::clock::Clock;
use crate::config::Config;
use crate::executor::ExecError;
use crate::process::{self, ToolCall, ToolOutput};
use crate::resources;
use crate::runs::{RunGuard, RunHandle};
use certistack_core::journal::{Op, Resource};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Cheap to clone: a step that leaves the async context (a blocking read) takes a clone.
#[derive(Debug, Clone)]
pub(crate) struct NodeContext {
    pub(in crate::node) config: Arc<Config>,
    pub(in crate::node) clock: Arc<dyn Clock>,
    pub(in crate::node) sys_block: Arc<PathBuf>,
}

impl NodeContext {
    pub(in crate::node) fn new(config: Config, clock: Arc<dyn Clock>, sys_block: PathBuf) -> Self {
        Self {
            config: Arc::new(config),
            clock,
            sys_block: Arc::new(sys_block),
        }
    }

    pub(in crate::node) fn now_ms(&self) -> i64 {
        self.clock.now_unix_ms()
    }

    /// Locks the run for an operation, then re-checks what authorization saw before the wait:
    /// the run may have been closed, or its deadline passed, while another operation held it.
    /// Steps a previous daemon was interrupted in are settled first.
    pub(in crate::node) async fn lock_open<'a>(
        &self,
        run: &'a RunHandle,
    ) -> Result<RunGuard<'a>, ExecError> {
        let mut guard = run.lock().await;
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
        self.cleanup().settle_interrupted(&mut guard).await?;
        Ok(guard)
    }

    pub(in crate::node) fn tool_timeout(&self) -> Duration {
        Duration::from_secs(self.config.limits.tool_timeout_secs)
    }

    /// Runs the tool of a journaled step whose `intent` is already recorded. Once the tool
    /// started, a second `intent` record names its processes (pid, start time, process group),
    /// so a daemon that restarts mid-step can kill them and prove them gone before it decides
    /// anything. When the tool does not finish by itself, the step is recorded `failed`: with
    /// `"outcome_unknown": true` when it was killed at its deadline or lost while running (it
    /// may have done its work), without when it never started.
    pub(in crate::node) async fn run_step(
        &self,
        guard: &mut RunGuard<'_>,
        op: &Op,
        resource: &Resource,
        call: ToolCall,
    ) -> Result<ToolOutput, ExecError> {
        let started = process::start(call);
        let result = match started {
            Ok(tool) => {
                if let Some(identity) = tool.identity() {
                    // Should this append fail, dropping `tool` kills its process group.
                    guard
                        .intent(self.now_ms(), op, resource, json!({ "tool": identity }))
                        .await?;
                }
                tool.wait().await
            }
            Err(error) => Err(error),
        };
        match result {
            Ok(output) => Ok(output),
            Err(error) => {
                let unknown = matches!(
                    error,
                    process::ToolError::Timeout { .. } | process::ToolError::Wait { .. }
                );
                let detail = json!({ "error": error.to_string(), "outcome_unknown": unknown });
                guard.failed(self.now_ms(), op, resource, detail).await?;
                Err(tool_error(error))
            }
        }
    }
    /// Closes a step that left nothing on the node: an `undone` record with its end state.
    pub(in crate::node) async fn journal_end_state(
        &self,
        guard: &mut RunGuard<'_>,
        op: &Op,
        resource: &Resource,
        end_state: &resources::EndState,
    ) -> Result<(), ExecError> {
        guard
            .undone(
                self.now_ms(),
                op,
                resource,
                json!({ "end_state": end_state.wire() }),
            )
            .await?;
        Ok(())
    }

    /// Journals a step that failed before its tool ran (or without one) and hands back its
    /// error for the caller; should the journal itself fail, that failure is returned instead.
    pub(in crate::node) async fn journal_step_error(
        &self,
        guard: &mut RunGuard<'_>,
        op: &Op,
        resource: &Resource,
        error: ExecError,
    ) -> ExecError {
        let detail = json!({ "error": error.to_string() });
        match guard.failed(self.now_ms(), op, resource, detail).await {
            Ok(_) => error,
            Err(journal) => journal.into(),
        }
    }

    /// Journals a tool that ran and failed: its exit code, time and stderr, plus `extra`.
    pub(in crate::node) async fn journal_tool_failed(
        &self,
        guard: &mut RunGuard<'_>,
        op: &Op,
        resource: &Resource,
        output: &ToolOutput,
        extra: &[(&str, serde_json::Value)],
    ) -> Result<(), ExecError> {
        guard
            .failed(self.now_ms(), op, resource, tool_detail(output, extra))
            .await?;
        Ok(())
    }
}
