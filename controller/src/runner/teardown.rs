//! How every validation ends, whatever happened: the node's Cleanup (reconnecting, or as an
//! operator after the deadline), EndRun, the journal read back, the report signed and written.

use super::evidence::{
    Evidence, Recorder, elapsed_ms, empty_journal, granted_snapshot, guest_not_started,
    heads_in_journal, latest_evidence, no_isolation, read_journal, save_screenshot, write_report,
};
use super::session::{
    CONNECT_TIMEOUT, CallError, OPERATOR_CALL_TIMEOUT, RECONNECT_PAUSE_MAX, RUN_CALL_TIMEOUT,
    Session, connection_lost, node_error_lost, pause_before_retry, within,
};
use super::{CleanupState, OPERATOR_NAME, Outcome, RunContext, Stop, Summary};
use crate::interrupt::{ABANDON_CLEANUP, ABANDON_STEP, Interrupts};
use crate::operator;
use crate::plan::Validation;
use crate::report::{self, StepResult, Verdict};
use certistack_proto::v1 as pb;
use std::time::{Duration, Instant};
use time::OffsetDateTime;

/// Ends a validation whatever happened: cleanup (reconnecting when the connection was lost),
/// EndRun, the journal read back and verified, the report signed and written.
pub(super) async fn finish(
    mut recorder: Recorder<'_>,
    evidence: Evidence,
    validation: &Validation,
    stop: Option<Stop>,
    session: Option<Session>,
) -> Summary {
    let context = recorder.context;
    let mut reasons: Vec<String> = Vec::new();
    let mut outcome = Outcome::Passed;
    match &stop {
        None => {}
        // Interrupted during teardown: every check had run; the verdict stands on them and
        // cleanup still decides whether the run is proven clean.
        Some(Stop::Interrupted(_)) if evidence.checks_complete => {}
        Some(stop) => {
            outcome = Outcome::Error;
            reasons.push(stop.reason().to_owned());
        }
    }
    if !evidence.isolation_failures.is_empty() {
        outcome = Outcome::Error;
        reasons.extend(evidence.isolation_failures.iter().cloned());
    }
    if !evidence.failures.is_empty() {
        if outcome == Outcome::Passed {
            outcome = Outcome::Failed;
        }
        reasons.extend(evidence.failures.iter().cloned());
    }

    let cleaned = match session {
        None => CleanedUp {
            state: CleanupState::NotNeeded,
            evidence: report::CleanupEvidence {
                receipts: Vec::new(),
                residue: Vec::new(),
                complete: true,
            },
            journal: empty_journal(&recorder.run_id),
            journal_problem: None,
            closed_by_reaper: false,
        },
        Some(session) => {
            let lost = matches!(stop, Some(Stop::Lost(_)));
            clean_up(&mut recorder, session, lost).await
        }
    };
    let cleanup_state = cleaned.state;
    let (cleanup, journal) = (cleaned.evidence, cleaned.journal);
    if cleanup_state == CleanupState::Unproven {
        reasons.push(format!(
            "cleanup could not be proven complete; run `certistack-ctl cleanup {} {}`, then `certistack-ctl runs {}`",
            recorder.node, recorder.run_id, recorder.node
        ));
        if outcome == Outcome::Passed {
            outcome = Outcome::Error;
        }
    }
    if cleaned.closed_by_reaper {
        reasons.push(
            "cleaned up as an operator after the deadline; the node's reaper closes the run".into(),
        );
    }
    let journal_problem = cleaned
        .journal_problem
        .or_else(|| heads_in_journal(&evidence.heads, &journal.records).err());
    if let Some(problem) = journal_problem {
        // The report would vouch for a journal the controller did not verify.
        reasons.push(problem);
        outcome = Outcome::Error;
    }

    // The picture is saved before the report is signed, so a failure to save it is a step of
    // the signed report too.
    let at = OffsetDateTime::now_utc();
    let saved_screenshot = match &evidence.screenshot {
        None => None,
        Some(shot) => {
            let started = recorder.begin("save screenshot");
            match save_screenshot(context, shot, at, &recorder.node, &recorder.run_id) {
                Ok(saved) => {
                    recorder.end(
                        "save screenshot",
                        started,
                        StepResult::Ok,
                        saved.file.clone(),
                    );
                    Some(saved)
                }
                Err(error) => {
                    recorder.end(
                        "save screenshot",
                        started,
                        StepResult::Failed,
                        error.clone(),
                    );
                    reasons.push(format!("the screenshot could not be saved: {error}"));
                    None
                }
            }
        }
    };
    let verdict = match outcome {
        Outcome::Passed => Verdict::Passed,
        Outcome::Failed => Verdict::Failed {
            reasons: reasons.clone(),
        },
        Outcome::Error => Verdict::Error {
            reasons: reasons.clone(),
        },
    };
    let grant = &validation.grant;
    // The steps' times, for the history, before the report takes the steps.
    let timings: Vec<crate::verdict::StepTiming> = recorder
        .steps
        .iter()
        .map(|step| crate::verdict::StepTiming {
            name: step.name.clone(),
            started_unix_ms: step.started_unix_ms,
            ended_unix_ms: step.ended_unix_ms,
            result: match step.result {
                StepResult::Ok => "ok",
                StepResult::Failed => "failed",
                StepResult::Skipped => "skipped",
            }
            .into(),
        })
        .collect();
    let predicate = report::Validation {
        run_id: recorder.run_id.clone(),
        name: validation.name.clone(),
        plan_digest: context.plan_digest.clone(),
        node: recorder.node.clone(),
        connector: evidence.connector.clone(),
        controller_version: env!("CARGO_PKG_VERSION").to_owned(),
        snapshot: report::Snapshot {
            latest: latest_evidence(&validation.resolved, None),
            ..evidence
                .snapshot
                .clone()
                .unwrap_or_else(|| granted_snapshot(grant))
        },
        steps: std::mem::take(&mut recorder.steps),
        guest: evidence.guest.clone().unwrap_or_else(guest_not_started),
        probes: evidence.probes.clone(),
        isolation: evidence.isolation.clone().unwrap_or_else(no_isolation),
        assertions: evidence.assertions.clone(),
        cleanup,
        journal,
        verdict,
        screenshot: saved_screenshot,
        hardware: evidence.hardware.clone(),
        placement: placement_of(&validation.resolved),
    };
    let statement = report::Statement::new(predicate);
    let report_path = write_report(context, &statement, at, &mut reasons, &mut outcome);
    let summary = Summary {
        validation: recorder.validation.clone(),
        node: recorder.node.clone(),
        run_id: recorder.run_id.clone(),
        outcome,
        cleanup: cleanup_state,
        reasons,
        elapsed_ms: elapsed_ms(recorder.started),
        report: report_path,
        steps: timings,
    };
    context.progress.finish(
        &summary.validation,
        format!(
            "{} on {}: {:?}, cleanup {:?}",
            summary.validation, summary.node, summary.outcome, summary.cleanup
        ),
    );
    summary
}

/// What cleanup proved, for the summary and the report.
struct CleanedUp {
    state: CleanupState,
    evidence: report::CleanupEvidence,
    journal: report::JournalEvidence,
    /// Why the report's journal is not the verified record of the run, when it is not.
    journal_problem: Option<String>,
    /// Cleanup was asked as an operator after the deadline: the node's reaper closes the run.
    closed_by_reaper: bool,
}

/// Cleanup, EndRun and the journal. Reconnects (until the run's deadline) when the connection
/// was lost; past the deadline the run's certificate is void, so Cleanup is asked as an
/// operator. The journal is read as an operator, so the closed run's last record is included.
/// Every wait is bounded; the third interrupt abandons them (cleanup is then unproven).
async fn clean_up(recorder: &mut Recorder<'_>, mut session: Session, mut lost: bool) -> CleanedUp {
    let context = recorder.context;
    let run_id = recorder.run_id.clone();
    let mut interrupts = context.interrupts.clone();
    let mut evidence = report::CleanupEvidence {
        receipts: Vec::new(),
        residue: Vec::new(),
        complete: false,
    };
    let at = recorder.begin("cleanup");
    let mut reply = None;
    let mut as_run = true;
    let mut abandoned = false;
    let mut last_error = String::new();
    let mut pause = Duration::from_millis(500);
    // As the run, while its certificate is valid; reconnecting when the node went away (it may
    // be restarting: its journal keeps the run open).
    while reply.is_none() && Instant::now() < session.deadline {
        let level = *interrupts.borrow_and_update();
        if level >= ABANDON_CLEANUP || (level >= ABANDON_STEP && lost) {
            last_error = format!("the operator stopped waiting for the node ({last_error})");
            abandoned = true;
            break;
        }
        if lost || session.client.is_none() {
            match within(
                &mut interrupts,
                ABANDON_STEP,
                CONNECT_TIMEOUT * 3,
                session.reconnect(),
                node_error_lost,
            )
            .await
            {
                Ok(()) => lost = false,
                Err(error) => {
                    last_error = error.to_string();
                    recorder.event("cleanup", "started", &format!("reconnecting: {error}"));
                    pause_before_retry(&mut interrupts, pause, session.deadline).await;
                    pause = (pause * 2).min(RECONNECT_PAUSE_MAX);
                    continue;
                }
            }
        }
        let Some(client) = session.client.as_mut() else {
            break;
        };
        let remaining = session.deadline.saturating_duration_since(Instant::now());
        match within(
            &mut interrupts,
            ABANDON_CLEANUP,
            remaining,
            client.cleanup(pb::CleanupRequest {
                run_id: run_id.clone(),
            }),
            connection_lost,
        )
        .await
        {
            Ok(answer) => reply = Some(answer.into_inner()),
            Err(CallError::Lost(text)) => {
                last_error = text;
                lost = true;
                // A node that drops every Cleanup is not hammered: the pause grows each time.
                pause_before_retry(&mut interrupts, pause, session.deadline).await;
                pause = (pause * 2).min(RECONNECT_PAUSE_MAX);
            }
            Err(CallError::Abandoned) => {
                last_error = "the operator abandoned the cleanup".into();
                abandoned = true;
                break;
            }
            Err(error) => {
                last_error = error.to_string();
                break;
            }
        }
    }
    // Past the deadline: as an operator, once.
    if reply.is_none() && !abandoned && Instant::now() >= session.deadline {
        as_run = false;
        match operator_cleanup(context, &session, &run_id, &mut interrupts).await {
            Ok(answer) => reply = Some(answer),
            Err(error) => last_error = error,
        }
    }
    let mut state = CleanupState::Unproven;
    let mut ended = false;
    match reply {
        None => recorder.end("cleanup", at, StepResult::Failed, last_error),
        Some(reply) => {
            evidence.receipts = reply
                .resources
                .iter()
                .map(|r| report::Receipt {
                    resource: r.resource.clone(),
                    end_state: r.end_state.clone(),
                })
                .collect();
            evidence.residue = reply.residue.clone();
            match operator::cleanup_complete(&reply) {
                Err(reason) => recorder.end("cleanup", at, StepResult::Failed, reason),
                Ok(()) => {
                    recorder.end(
                        "cleanup",
                        at,
                        StepResult::Ok,
                        format!("{} receipts, no residue", reply.resources.len()),
                    );
                    if as_run {
                        let at = recorder.begin("end");
                        let answer = match session.client.as_mut() {
                            Some(client) => within(
                                &mut interrupts,
                                ABANDON_CLEANUP,
                                RUN_CALL_TIMEOUT,
                                client.end_run(pb::EndRunRequest {}),
                                connection_lost,
                            )
                            .await
                            .map(|_| ())
                            .map_err(|e| e.to_string()),
                            None => Err("no connection".to_owned()),
                        };
                        match answer {
                            Ok(()) => {
                                evidence.complete = true;
                                state = CleanupState::Complete;
                                ended = true;
                                recorder.end("end", at, StepResult::Ok, String::new());
                            }
                            Err(reason) => recorder.end("end", at, StepResult::Failed, reason),
                        }
                    } else {
                        evidence.complete = true;
                        state = CleanupState::Complete;
                    }
                }
            }
        }
    }

    let at = recorder.begin("journal");
    let read = read_journal(context, &session, &run_id, &mut interrupts).await;
    let checked = read.and_then(|journal| {
        // An empty journal "verifies" to the genesis: a run that began has records, and one
        // that ended has `run.end` last.
        match journal.records.last() {
            None => Err("the node returned no journal record for a run it began".to_owned()),
            Some(last)
                if ended
                    && certistack_core::journal::Op::parse(&last.operation)
                        != certistack_core::journal::Op::RunEnd =>
            {
                Err(format!(
                    "the run was ended but its journal's last record is {} {}",
                    last.operation, last.phase
                ))
            }
            Some(_) => Ok(journal),
        }
    });
    let (journal, journal_problem) = match checked {
        Ok(journal) => {
            recorder.end(
                "journal",
                at,
                StepResult::Ok,
                format!(
                    "{} records verified here, head {}",
                    journal.records.len(),
                    journal.head_sha256
                ),
            );
            (journal, None)
        }
        Err(reason) => {
            recorder.end("journal", at, StepResult::Failed, reason.clone());
            (empty_journal(&run_id), Some(reason))
        }
    };
    CleanedUp {
        state,
        evidence,
        journal,
        journal_problem,
        closed_by_reaper: state == CleanupState::Complete && !as_run,
    }
}

async fn operator_cleanup(
    context: &RunContext,
    session: &Session,
    run_id: &str,
    interrupts: &mut Interrupts,
) -> Result<pb::CleanupReply, String> {
    let work = async {
        let mut connection = operator::connect(
            &context.authority,
            &session.endpoint,
            &session.node,
            OPERATOR_NAME,
            OffsetDateTime::now_utc(),
        )
        .await?;
        operator::cleanup(&mut connection, run_id).await
    };
    within(
        interrupts,
        ABANDON_CLEANUP,
        OPERATOR_CALL_TIMEOUT,
        work,
        |_| false,
    )
    .await
    .map_err(|e| format!("Cleanup as an operator after the deadline: {e}"))
}

/// How placement chose the node, for the report: `None` for a node the plan names.
fn placement_of(resolved: &crate::plan::ResolvedValidation) -> Option<String> {
    (resolved.node.source == crate::plan::Origin::Placement).then(|| resolved.node.key.clone())
}
