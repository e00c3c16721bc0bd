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
}
