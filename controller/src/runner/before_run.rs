//! Validations that fail before any node is asked: `snapshot: latest` found no finished backup
//! of the VM, or only one older than `max_age_hours`. That is the nightly check's finding (a
//! backup job that stopped), so it is reported like any failed validation: a signed report, the
//! exit status 1. Nothing was created anywhere, so there is nothing to clean and no journal.

use super::evidence::{
    empty_journal, guest_not_started, latest_evidence, no_isolation, write_report,
};
use super::{CleanupState, Outcome, RunContext, Summary};
use crate::plan::{FailedBeforeRun, ResolvedStorage, Unplaced};
use crate::report::{self, StepResult, Verdict};
use certistack_proto::v1 as pb;
use sha2::{Digest, Sha256};
use time::OffsetDateTime;

/// The step a report of a validation that failed before any node names.
pub const RESOLVE_STEP: &str = "resolve backup";

/// Writes the signed failed report of `failed` and returns its summary.
pub fn report_failed_before_run(
    context: &RunContext,
    storage: &ResolvedStorage,
    failed: &FailedBeforeRun,
    now: OffsetDateTime,
) -> Summary {
    let resolved = &failed.resolved;
    let run_id = uuid::Uuid::new_v4().hyphenated().to_string();
    let at_ms = i64::try_from(now.unix_timestamp_nanos() / 1_000_000).unwrap_or(i64::MAX);
    let mut reasons = vec![failed.why.reason.clone()];
    let mut snapshot = report::Snapshot {
        server: storage.server.value.clone(),
        port: storage.port.value,
        datastore: storage.datastore.value.clone(),
        namespace: storage.namespace.value.clone(),
        // Without a finished backup, the VM's group is what the report is about.
        snapshot: match &resolved.latest {
            Some(_) => format!(
                "vm/{}/{}",
                resolved.source_vmid.value, resolved.snapshot.value
            ),
            None => format!("vm/{}", resolved.source_vmid.value),
        },
        archives: match &resolved.latest {
            Some(_) => resolved
                .archives
                .value
                .iter()
                .map(|name| report::Archive {
                    name: name.clone(),
                    sha256: None,
                    size: None,
                    crypt_mode: None,
                })
                .collect(),
            None => Vec::new(),
        },
        manifest_sha256: None,
        verify_state: None,
        latest: latest_evidence(resolved, Some(&failed.why)),
    };
    // The stale backup is named by its manifest's digests, as a run would name it.
    let mut outcome = Outcome::Failed;
    if let Some(bytes) = &failed.why.manifest
        && let Err(reason) = manifest_of(bytes).and_then(|m| snapshot.take_manifest(&m))
    {
        reasons.push(format!("the backup's manifest cannot name it: {reason}"));
        outcome = Outcome::Error;
    }
    let verdict = match outcome {
        Outcome::Failed => Verdict::Failed {
            reasons: reasons.clone(),
        },
        _ => Verdict::Error {
            reasons: reasons.clone(),
        },
    };
    let predicate = report::Validation {
        run_id: run_id.clone(),
        name: resolved.name.clone(),
        plan_digest: context.plan_digest.clone(),
        node: resolved.node.value.clone(),
        connector: report::ConnectorVersion {
            version: "not contacted".into(),
            surface_digest: "none".into(),
        },
        controller_version: env!("CARGO_PKG_VERSION").to_owned(),
        snapshot,
        steps: vec![report::Step {
            name: RESOLVE_STEP.into(),
            started_unix_ms: at_ms,
            ended_unix_ms: at_ms,
            result: StepResult::Failed,
            detail: failed.why.reason.clone(),
        }],
        guest: guest_not_started(),
        probes: Vec::new(),
        isolation: no_isolation(),
        assertions: Vec::new(),
        cleanup: report::CleanupEvidence {
            receipts: Vec::new(),
            residue: Vec::new(),
            complete: true,
        },
        journal: empty_journal(&run_id),
        verdict,
        screenshot: None,
        hardware: None,
        placement: None,
    };
    let statement = report::Statement::new(predicate);
    let report_path = write_report(context, &statement, now, &mut reasons, &mut outcome);
    let summary = Summary {
        validation: resolved.name.clone(),
        node: resolved.node.value.clone(),
        run_id,
        outcome,
        cleanup: CleanupState::NotNeeded,
        reasons,
        elapsed_ms: 0,
        report: report_path,
        steps: Vec::new(),
    };
    context.progress.finish(
        &summary.validation,
        format!(
            "{}: {:?} before any node was asked: {}",
            summary.validation, summary.outcome, failed.why.reason
        ),
    );
    summary
}

/// The summary of a validation placement put on no node (`node: auto` or a list, and no
/// candidate ready with room): an error of the run, not a finding about the backup, so no
/// report is signed; nothing was created anywhere.
pub fn summarize_unplaced(context: &RunContext, unplaced: &Unplaced) -> Summary {
    let summary = Summary {
        validation: unplaced.resolved.name.clone(),
        node: unplaced.resolved.node.value.clone(),
        run_id: String::new(),
        outcome: Outcome::Error,
        cleanup: CleanupState::NotNeeded,
        reasons: vec![format!("placed on no node: {}", unplaced.why)],
        elapsed_ms: 0,
        report: None,
        steps: Vec::new(),
    };
    context.progress.finish(
        &summary.validation,
        format!(
            "{}: not run: placed on no node: {}",
            summary.validation, unplaced.why
        ),
    );
    summary
}

/// The manifest as PBS decodes it, in the form the node reports it (`SnapshotManifest`).
fn manifest_of(bytes: &[u8]) -> Result<pb::SnapshotManifest, String> {
    #[derive(serde::Deserialize)]
    struct Manifest {
        files: Vec<File>,
    }
    #[derive(serde::Deserialize)]
    struct File {
        filename: String,
        csum: String,
        size: u64,
        #[serde(rename = "crypt-mode")]
        crypt_mode: String,
    }
    let manifest: Manifest =
        serde_json::from_slice(bytes).map_err(|error| format!("not a manifest: {error}"))?;
    Ok(pb::SnapshotManifest {
        sha256: hex::encode(Sha256::digest(bytes)),
        files: manifest
            .files
            .into_iter()
            .map(|file| pb::ManifestFile {
                filename: file.filename,
                csum: file.csum,
                size: file.size,
                crypt_mode: file.crypt_mode,
            })
            .collect(),
        verify_state: None,
    })
}
