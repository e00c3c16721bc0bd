//! The rows a run writes to its history, through the [`HistoryWriter`] it was handed and off
//! its async threads: a validation's `running` row before its grant is minted, its end with the
//! report's digest. A write that fails is said on the progress stream and counted; it never
//! fails the validation (`history --max-age-hours` still finds no pass for it).

use super::RunContext;
use crate::verdict::{HistoryError, HistoryWriter, Summary, ValidationEnded, ValidationStarted};
use sha2::{Digest, Sha256};
use std::sync::atomic::Ordering;

/// Beyond `run_seconds`, how long a validation may take before its grant is minted (its
/// prerequisites checked): a `running` row past both was interrupted.
const BEFORE_GRANT_MS: i64 = 10 * 60 * 1000;

/// Writes with `write` off the async threads.
pub async fn write(
    context: &RunContext,
    write: impl FnOnce(&dyn HistoryWriter) -> Result<(), HistoryError> + Send + 'static,
) {
    let history = context.history.clone();
    let written = tokio::task::spawn_blocking(move || write(history.as_ref()))
        .await
        .unwrap_or_else(|error| Err(HistoryError(format!("the write stopped: {error}"))));
    if let Err(error) = written {
        context.history_failures.fetch_add(1, Ordering::Relaxed);
        context.progress.println(&format!(
            "history: not written: {}",
            certistack_core::untrusted::printable(
                error.0.as_bytes(),
                certistack_core::untrusted::MAX_DETAIL_CHARS
            )
        ));
    }
}

/// A validation's `running` row, begun now.
pub fn started(
    context: &RunContext,
    run_id: &str,
    (validation, node): (&str, &str),
    (source_vmid, snapshot): (u32, String),
    run_seconds: u32,
) -> ValidationStarted {
    let now = now_ms();
    ValidationStarted {
        run_id: run_id.to_owned(),
        plan_run_id: context.plan_run_id.clone(),
        validation: validation.to_owned(),
        node: node.to_owned(),
        source_vmid,
        snapshot,
        started_unix_ms: now,
        deadline_unix_ms: now + i64::from(run_seconds) * 1000 + BEFORE_GRANT_MS,
    }
}

/// The end of `started` as `summary` says, with the SHA-256 of its report's file.
pub fn ended(started: ValidationStarted, summary: &Summary) -> ValidationEnded {
    let report_sha256 = summary
        .report
        .as_ref()
        .and_then(|path| std::fs::read(path).ok())
        .map(|bytes| hex::encode(Sha256::digest(bytes)));
    ValidationEnded {
        started,
        outcome: summary.outcome,
        cleanup: summary.cleanup,
        reasons: summary.reasons.clone(),
        ended_unix_ms: now_ms(),
        steps: summary.steps.clone(),
        report: summary.report.clone(),
        report_sha256,
    }
}

/// A validation that ended before any node was asked (no finished backup, too old, placed
/// nowhere): its whole row at once.
pub async fn ended_before_run(
    context: &RunContext,
    summary: &Summary,
    source_vmid: u32,
    snapshot: String,
) {
    // A validation placed nowhere has no run id: the history keys it by one of its own.
    let run_id = if summary.run_id.is_empty() {
        uuid::Uuid::new_v4().hyphenated().to_string()
    } else {
        summary.run_id.clone()
    };
    let begun = started(
        context,
        &run_id,
        (&summary.validation, &summary.node),
        (source_vmid, snapshot),
        0,
    );
    let summary = summary.clone();
    write(context, move |history| {
        history.validation_ended(&ended(begun, &summary))
    })
    .await;
}

pub fn now_ms() -> i64 {
    i64::try_from(time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000)
        .unwrap_or(i64::MAX)
}
