//! What every resource's executor shares: the daemon's configuration and clock, where block
//! devices are read, and the steps common to all of them (locking a run, running a journaled
//! tool, journaling a step's end, settling the steps a previous daemon was interrupted in).
//!
//! Each resource kind has an executor of its own over this context, and its module adds the
//! accessor that builds it (`ctx.sandbox()`): one resource reaches another through the
//! context, so neither names the other's module, and the context names none of them.

use super::resources::{self, InterruptedStep, Standing};
use super::{tool_detail, tool_error};
use crate::clock::Clock;
use crate::config::Config;
use crate::executor::ExecError;
use crate::process::{self, REAP_WITHIN, ToolCall, ToolOutput};
use crate::runs::{RunGuard, RunHandle};
use certistack_core::journal::{Op, Record, Resource};
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
        self.settle_interrupted(&mut guard).await?;
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

    /// Settles steps the daemon was interrupted in: kills and waits for the tools they
    /// started, then journals each step `failed` with `outcome_unknown`. A tool that cannot be
    /// proven gone leaves its step undecided and is reported.
    pub(in crate::node) async fn settle_interrupted(
        &self,
        guard: &mut RunGuard<'_>,
    ) -> Result<(), ExecError> {
        let records = guard.records().to_vec();
        // Steps on resources, and side steps (a guest network recovery's appliance holds the
        // overlay open): every tool must be gone before anything decides about the resource.
        let steps: Vec<InterruptedStep> = resources::states(&records)
            .into_values()
            .filter(|s| s.standing() == Standing::Interrupted)
            .map(|s| InterruptedStep {
                tools: s.interrupted_tools(),
                op: s.last.entry.op,
                resource: s.resource,
                units: Vec::new(),
            })
            .chain(resources::interrupted_side_steps(&records))
            .collect();
        let mut problems = Vec::new();
        for step in steps {
            let mut killed = 0usize;
            let mut left = Vec::new();
            for tool in &step.tools {
                match tool.reap(REAP_WITHIN).await {
                    Ok(n) => killed = killed.saturating_add(n),
                    Err(reason) => left.push(reason),
                }
            }
            // A unit outlives the daemon that started it (a guest network recovery's
            // appliance): stopped, after checking it is this run's. Without systemd as init
            // no unit can exist.
            let units: &[(String, String)] = if crate::systemd::booted() {
                &step.units
            } else {
                &[]
            };
            let mut units_stopped = Vec::new();
            let mut units_gone = Vec::new();
            for (unit, description) in units {
                match crate::process::release_transient_unit(
                    &self.config.process.systemctl,
                    unit,
                    description,
                    self.tool_timeout(),
                )
                .await
                {
                    Ok(crate::process::UnitRelease::Stopped) => units_stopped.push(unit),
                    Ok(crate::process::UnitRelease::Gone) => units_gone.push(unit),
                    Err(reason) => left.push(reason),
                }
            }
            if !left.is_empty() {
                problems.push(format!(
                    "{} ({}): {}",
                    step.resource,
                    step.op,
                    left.join("; ")
                ));
                continue;
            }
            guard
                .failed(
                    self.now_ms(),
                    &step.op,
                    &step.resource,
                    json!({
                        "error": "the connector stopped during this step",
                        "outcome_unknown": true,
                        "tools": step.tools,
                        "units_stopped": units_stopped,
                        // Units the step named that had ended by themselves before the settling.
                        "units_gone": units_gone,
                        "processes_killed": killed,
                    }),
                )
                .await?;
            if killed > 0 {
                tracing::warn!(resource = %step.resource, op = %step.op, killed, "killed the tools of a step the connector was interrupted in");
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ExecError::Failed(format!(
                "a tool of an interrupted step is still running and could not be stopped ({}); nothing is decided until it is gone: retry, or stop it by hand",
                problems.join("; ")
            )))
        }
    }

    /// Locks the run, even a closed one, and settles the steps a previous daemon was
    /// interrupted in, so the records read next say what the node was last told.
    pub(in crate::node) async fn lock_settled<'a>(
        &self,
        run: &'a RunHandle,
    ) -> Result<(RunGuard<'a>, Vec<Record>), ExecError> {
        let mut guard = run.lock().await;
        self.settle_interrupted(&mut guard).await?;
        let records = guard.records().to_vec();
        Ok((guard, records))
    }
}
