//! What a validation gathers for its report: its steps and events, the guest's facts, probes
//! and assertions, the console picture, and the run's journal read back and checked here.

use super::session::{OPERATOR_CALL_TIMEOUT, Session, within};
use super::{Event, OPERATOR_NAME, RunContext};
use crate::interrupt::{ABANDON_CLEANUP, Interrupts};
use crate::operator;
use crate::report::{self, StepResult};
use crate::screenshot;
use certistack_core::files;
use certistack_core::grant::Grant;
use std::time::Instant;
use time::OffsetDateTime;

/// Collects what one validation did, for its events and its report.
pub(super) struct Recorder<'a> {
    pub(super) context: &'a RunContext,
    pub(super) validation: String,
    pub(super) node: String,
    pub(super) run_id: String,
    pub(super) started: Instant,
    pub(super) steps: Vec<report::Step>,
}

impl Recorder<'_> {
    pub(super) fn event(&self, step: &str, state: &'static str, detail: &str) {
        self.context.progress.emit(&Event {
            time_unix_ms: now_ms(),
            validation: self.validation.clone(),
            node: self.node.clone(),
            run_id: self.run_id.clone(),
            step: step.to_owned(),
            state,
            elapsed_ms: elapsed_ms(self.started),
            detail: detail.to_owned(),
        });
    }

    pub(super) fn begin(&self, step: &str) -> i64 {
        self.event(step, "started", "");
        now_ms()
    }

    pub(super) fn end(
        &mut self,
        step: &str,
        started_unix_ms: i64,
        result: StepResult,
        detail: String,
    ) {
        let state = match result {
            StepResult::Ok => "ok",
            StepResult::Failed => "failed",
            StepResult::Skipped => "skipped",
        };
        self.event(step, state, &detail);
        self.steps.push(report::Step {
            name: step.to_owned(),
            started_unix_ms,
            ended_unix_ms: now_ms(),
            result,
            detail,
        });
    }
}

fn now_ms() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis(),
    )
    .unwrap_or(i64::MAX)
}

pub(super) fn elapsed_ms(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Evidence gathered on the way, for the report.
#[derive(Default)]
pub(super) struct Evidence {
    pub(super) connector: report::ConnectorVersion,
    pub(super) guest: Option<report::GuestFacts>,
    pub(super) agent_answered: bool,
    pub(super) probes: Vec<report::ProbeResult>,
    pub(super) isolation: Option<report::Isolation>,
    pub(super) assertions: Vec<report::AssertionResult>,
    pub(super) failures: Vec<String>,
    /// Evidence that contradicts the sandbox's isolation: nothing is proven then.
    pub(super) isolation_failures: Vec<String>,
    /// Every probe and assertion ran: an interrupt after this point keeps the verdict.
    pub(super) checks_complete: bool,
    /// The console at verdict time.
    pub(super) screenshot: Option<screenshot::Screenshot>,
    /// Each step's name and the journal head its reply named.
    pub(super) heads: Vec<(String, String)>,
    /// The source hardware the sandbox VMs mirror, as the node read it.
    pub(super) hardware: Option<report::SandboxHardware>,
    /// The snapshot with its archives' digests and verify state, once the node read its manifest.
    pub(super) snapshot: Option<report::Snapshot>,
}

/// The snapshot the grant names, as a report's subjects name it; its digests come from the
/// manifest ([`report::Snapshot::take_manifest`]).
pub(super) fn granted_snapshot(grant: &Grant) -> report::Snapshot {
    report::Snapshot {
        server: grant.repository.server.to_string(),
        port: grant.repository.port,
        datastore: grant.repository.datastore.to_string(),
        namespace: grant.repository.namespace.to_string(),
        snapshot: grant.snapshot.to_string(),
        archives: grant
            .archives
            .iter()
            .map(|a| report::Archive {
                name: a.to_string(),
                sha256: None,
                size: None,
                crypt_mode: None,
            })
            .collect(),
        manifest_sha256: None,
        verify_state: None,
        latest: None,
    }
}

/// Signs and writes the report of `statement`; when it cannot be written, the validation's
/// outcome becomes an error and its reasons say why.
pub(super) fn write_report(
    context: &RunContext,
    statement: &report::Statement,
    at: time::OffsetDateTime,
    reasons: &mut Vec<String>,
    outcome: &mut super::Outcome,
) -> Option<std::path::PathBuf> {
    match report::write(
        &context.reports_dir,
        statement,
        context.authority.report_signing(),
        at,
    ) {
        Ok(path) => Some(path),
        Err(error) => {
            reasons.push(format!("the report could not be written: {error}"));
            *outcome = super::Outcome::Error;
            None
        }
    }
}

/// The isolation evidence of a run that never prepared a sandbox: nothing, and the digest of
/// the empty ruleset.
pub(super) fn no_isolation() -> report::Isolation {
    report::Isolation {
        bridge_ports: Vec::new(),
        bridge_addresses: Vec::new(),
        forwarding: std::collections::BTreeMap::new(),
        ruleset: String::new(),
        ruleset_digest: report::sha256_text(b""),
        nat_sources: Vec::new(),
    }
}

/// What a report says of a guest that never started.
pub(super) fn guest_not_started() -> report::GuestFacts {
    report::GuestFacts {
        status: "not started".into(),
        os_info: serde_json::Value::Null,
        interfaces: serde_json::Value::Null,
    }
}

/// `snapshot: latest` as the plan resolved it, for the report; `None` for a named snapshot.
pub(super) fn latest_evidence(
    resolved: &crate::plan::ResolvedValidation,
    failed: Option<&crate::plan::backup::FailsBeforeRun>,
) -> Option<report::LatestEvidence> {
    let max_age_hours = resolved.max_age_hours.value;
    match (&resolved.latest, failed) {
        (Some(found), _) => Some(report::LatestEvidence {
            listed: found.listed as u64,
            finished: found.finished as u64,
            age_seconds: Some(found.age_seconds),
            max_age_hours,
        }),
        (None, Some(failed)) => Some(report::LatestEvidence {
            listed: failed.listed as u64,
            finished: failed.finished as u64,
            age_seconds: None,
            max_age_hours,
        }),
        (None, None) => None,
    }
}

/// The most of a run's journal the controller puts into a report: the report must stay under
/// `report::MAX_REPORT_BYTES`; a node's default caps (10,000 records, 16 MiB) are below.
const RUN_JOURNAL_BOUNDS: operator::JournalBounds = operator::JournalBounds {
    records: 100_000,
    bytes: 32 * 1024 * 1024,
};

/// Checks that the journal heads the node answered step by step are records of the journal it
/// streamed at the end, in order: a node that kept one journal for its answers and streams
/// another is caught here.
pub(super) fn heads_in_journal(
    heads: &[(String, String)],
    records: &[report::JournalRecord],
) -> Result<(), String> {
    let mut from = 0usize;
    for (step, head) in heads {
        let found = records
            .iter()
            .enumerate()
            .skip(from)
            .find(|(_, record)| record.record_sha256 == *head);
        match found {
            Some((index, _)) => from = index,
            None => {
                return Err(format!(
                    "the node's journal does not hold, in order, the head {head} it answered at step {step}"
                ));
            }
        }
    }
    Ok(())
}

/// Writes the console picture beside the report it belongs to (the report's name with `.png`),
/// atomically and 0600, and returns what the report signs of it.
pub(super) fn save_screenshot(
    context: &RunContext,
    shot: &screenshot::Screenshot,
    at: OffsetDateTime,
    node: &str,
    run_id: &str,
) -> Result<report::Screenshot, String> {
    let name = report::file_name(at, node, run_id).map_err(|e| e.to_string())?;
    let file = format!("{}.png", name.trim_end_matches(".json"));
    files::create_private_dir(&context.reports_dir).map_err(|e| e.to_string())?;
    files::write_atomic(&context.reports_dir.join(&file), &shot.png, 0o600)
        .map_err(|e| e.to_string())?;
    Ok(report::Screenshot {
        file,
        sha256: shot.sha256.clone(),
    })
}

pub(super) fn empty_journal(run_id: &str) -> report::JournalEvidence {
    report::JournalEvidence {
        head_sha256: hex::encode(certistack_core::journal::genesis(run_id)),
        records: Vec::new(),
    }
}

/// Streams the run's journal as an operator, bounded in records, bytes and time, and
/// recomputes its hash chain here.
pub(super) async fn read_journal(
    context: &RunContext,
    session: &Session,
    run_id: &str,
    interrupts: &mut Interrupts,
) -> Result<report::JournalEvidence, String> {
    let work = async {
        let mut connection = operator::connect(
            &context.authority,
            &session.endpoint,
            &session.node,
            OPERATOR_NAME,
            OffsetDateTime::now_utc(),
        )
        .await?;
        operator::read_journal_within(&mut connection, run_id, RUN_JOURNAL_BOUNDS, |_| {}).await
    };
    let records = within(
        interrupts,
        ABANDON_CLEANUP,
        OPERATOR_CALL_TIMEOUT,
        work,
        |_| false,
    )
    .await
    .map_err(|e| format!("the journal could not be read: {e}"))?;
    let head = operator::verify_journal(run_id, &records)
        .map_err(|e| format!("the node's journal does not verify here: {e}"))?;
    Ok(report::JournalEvidence {
        head_sha256: head,
        records,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(sequence: u64, hash: &str) -> report::JournalRecord {
        report::JournalRecord {
            sequence,
            time_unix_ms: 0,
            operation: "op".into(),
            resource: "r".into(),
            phase: "done".into(),
            previous_sha256: String::new(),
            record_sha256: hash.into(),
            detail: String::new(),
        }
    }

    #[test]
    fn the_heads_a_node_answered_must_be_in_the_journal_it_streams_in_order() {
        let records = [record(1, "aa"), record(2, "bb"), record(3, "cc")];
        let heads = |list: &[&str]| -> Vec<(String, String)> {
            list.iter()
                .map(|h| (format!("step {h}"), (*h).to_owned()))
                .collect()
        };
        heads_in_journal(&heads(&["aa", "cc"]), &records).unwrap();
        heads_in_journal(&heads(&["bb", "bb", "cc"]), &records).unwrap();
        let error = heads_in_journal(&heads(&["aa", "dd"]), &records).unwrap_err();
        assert!(
            error.contains("head dd it answered at step step dd"),
            "{error}"
        );
        assert!(heads_in_journal(&heads(&["cc", "aa"]), &records).is_err());
    }
}
