//! What a validation proved, as the run's summary, its exit status and its history read it:
//! types neither the validation driver nor the history store owns, so each uses them without
//! importing the other.

use serde::Serialize;
use std::path::PathBuf;

/// What a validation proved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// The backup restored: every check held.
    Passed,
    /// The backup did not restore: a probe, an assertion or the guest said so.
    Failed,
    /// Nothing was proven about the backup: the node, the connection or the operator stopped it.
    Error,
}

/// Whether the node is proven to hold nothing of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CleanupState {
    /// The run never began on the node: nothing to clean.
    NotNeeded,
    /// Cleanup found nothing left and the run was ended.
    Complete,
    /// The node could not prove it holds nothing of the run; see the report and `runs NODE`.
    Unproven,
}

/// One validation's line in the closing summary.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub validation: String,
    pub node: String,
    pub run_id: String,
    pub outcome: Outcome,
    pub cleanup: CleanupState,
    pub reasons: Vec<String>,
    pub elapsed_ms: u64,
    pub report: Option<PathBuf>,
    /// Its steps and when they ran, for the history (not part of `run --json`).
    #[serde(skip)]
    pub steps: Vec<StepTiming>,
}

/// One step of a validation and when it ran, as the history keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct StepTiming {
    pub name: String,
    pub started_unix_ms: i64,
    pub ended_unix_ms: i64,
    /// `ok`, `failed` or `skipped`.
    pub result: String,
}

/// The restore time, defined once: from the start of the first `map` step (the backup mapped
/// onto the node) to the end of the first proof that the restored guest booted (its guest agent
/// answering, else a probe passing). `None` when there is no such proof: the restore did not
/// boot, or nothing was mapped.
pub fn restore_ms(steps: &[StepTiming]) -> Option<u64> {
    let map = steps.iter().find(|step| step.name.starts_with("map "))?;
    let proof = |prefix: &str| {
        steps
            .iter()
            .find(|step| step.name.starts_with(prefix) && step.result == "ok")
    };
    let booted = proof("guest agent ").or_else(|| proof("probe "))?;
    u64::try_from(booted.ended_unix_ms - map.started_unix_ms).ok()
}

/// One `certistack-ctl run` of a plan, when it began.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanRunStarted {
    pub plan_run_id: String,
    /// The plan's path as given.
    pub plan: String,
    pub plan_sha256: String,
    pub started_unix_ms: i64,
}

/// A validation about to be authorized: written before its grant is minted, so a controller
/// killed from then on leaves a row that reads `interrupted` once `deadline_unix_ms` passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidationStarted {
    pub run_id: String,
    pub plan_run_id: String,
    pub validation: String,
    pub node: String,
    pub source_vmid: u32,
    /// `vm/ID/TIME`, or the VM's group when no finished backup was found.
    pub snapshot: String,
    pub started_unix_ms: i64,
    /// After this the run cannot still be going: its grant has expired.
    pub deadline_unix_ms: i64,
}

/// A validation's end: its verdict and what it is made of.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidationEnded {
    pub started: ValidationStarted,
    pub outcome: Outcome,
    pub cleanup: CleanupState,
    pub reasons: Vec<String>,
    pub ended_unix_ms: i64,
    pub steps: Vec<StepTiming>,
    pub report: Option<PathBuf>,
    pub report_sha256: Option<String>,
}

/// A notification of a plan run (a webhook, an e-mail): delivered or not, after how many tries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Delivery {
    pub plan_run_id: String,
    /// `webhook` or `email`.
    pub channel: String,
    /// `failure` or `summary`.
    pub kind: String,
    pub attempts: u32,
    pub delivered: bool,
    /// Why the last attempt failed, when it did.
    pub last_error: Option<String>,
    pub at_unix_ms: i64,
}

/// Why the history could not be written, saying what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct HistoryError(pub String);

/// Where a run writes its history: handed to the runner, which never names the store behind
/// it. Every write is idempotent (keyed by its id), so writing one again changes nothing, and a
/// `validation_started` after its `validation_ended` keeps the end. Calls block: the runner
/// makes them off its async threads.
pub trait HistoryWriter: Send + Sync {
    fn plan_started(&self, plan: &PlanRunStarted) -> Result<(), HistoryError>;
    fn plan_ended(&self, plan_run_id: &str, ended_unix_ms: i64) -> Result<(), HistoryError>;
    fn validation_started(&self, started: &ValidationStarted) -> Result<(), HistoryError>;
    fn validation_ended(&self, ended: &ValidationEnded) -> Result<(), HistoryError>;
    fn delivery(&self, delivery: &Delivery) -> Result<(), HistoryError>;
}
