//! Telling someone after a run: a signed webhook on a failure or an error, and a summary of
//! every run when asked. Each delivery is tried a bounded number of times with back-off and
//! recorded in the history; it never changes a verdict or the exit code, and never carries a
//! secret. Node and guest text reaches it escaped and bounded, as the history keeps it.

pub mod email;
pub mod settings;
pub mod webhook;

use crate::history::{RowState, ValidationRow};
use crate::verdict::Delivery;
use serde::Serialize;
use settings::Triggers;
use std::time::Duration;

/// Tries of one delivery.
pub const ATTEMPTS: u32 = 3;
/// The wait before the second and the third try.
pub const BACKOFF: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(3)];
/// The longest one try may take, whatever the server does (an SMTP server that greets and then
/// says nothing would otherwise hold the run forever).
pub const TRY_TIMEOUT: Duration = Duration::from_secs(30);
/// Validations named in one message at most; the rest are counted in `left_out`.
pub const MAX_ENTRIES: usize = 1_000;

/// The plan run a message is about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlanRunFacts {
    pub plan_run_id: String,
    pub plan: String,
    pub plan_sha256: String,
    pub started_unix_ms: i64,
    pub ended_unix_ms: i64,
}

#[derive(Debug, Serialize)]
struct Counts {
    passed: usize,
    failed: usize,
    error: usize,
}

#[derive(Debug, Serialize)]
struct Entry<'a> {
    validation: &'a str,
    source_vmid: u32,
    node: &'a str,
    verdict: RowState,
    /// The step that failed, if one did.
    step: Option<&'a str>,
    reasons: Vec<String>,
    run_id: &'a str,
    report: Option<&'a str>,
    report_sha256: Option<&'a str>,
}

#[derive(Debug, Serialize)]
struct Body<'a> {
    /// `certistack.run.failure` or `certistack.run.summary`.
    #[serde(rename = "type")]
    kind: String,
    #[serde(flatten)]
    run: &'a PlanRunFacts,
    counts: Counts,
    validations: Vec<Entry<'a>>,
    left_out: usize,
}

/// A message to send: `failure` or `summary`, and its JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub kind: &'static str,
    pub body: String,
}

/// A validation as a message names it when the history could not give its row (a write or the
/// read back failed): what the run's summary knows, its VM unknown (0).
pub fn row_of_summary(summary: &crate::verdict::Summary, plan_run_id: &str) -> ValidationRow {
    ValidationRow {
        run_id: summary.run_id.clone(),
        plan_run_id: plan_run_id.to_owned(),
        validation: summary.validation.clone(),
        node: summary.node.clone(),
        source_vmid: 0,
        snapshot: String::new(),
        state: match summary.outcome {
            crate::verdict::Outcome::Passed => RowState::Passed,
            crate::verdict::Outcome::Failed => RowState::Failed,
            crate::verdict::Outcome::Error => RowState::Error,
        },
        started_unix_ms: 0,
        deadline_unix_ms: 0,
        ended_unix_ms: None,
        cleanup: None,
        reasons: summary.reasons.clone(),
        restore_ms: None,
        report: summary
            .report
            .as_ref()
            .map(|path| path.display().to_string()),
        report_sha256: None,
        steps: summary.steps.clone(),
    }
}

fn entry(row: &ValidationRow) -> Entry<'_> {
    // A step that failed; none when every step ran and a check (a probe, an assertion) said no:
    // the reasons say which.
    let step = row
        .steps
        .iter()
        .find(|step| step.result == "failed")
        .map(|step| step.name.as_str());
    Entry {
        validation: &row.validation,
        source_vmid: row.source_vmid,
        node: &row.node,
        verdict: row.state,
        step,
        // As the history keeps them, and escaped again should a row not have been (the
        // function leaves escaped text as it is).
        reasons: row
            .reasons
            .iter()
            .take(crate::history::MAX_REASONS)
            .map(|reason| {
                crate::history::bounded(reason, certistack_core::untrusted::MAX_DETAIL_CHARS)
            })
            .collect(),
        run_id: &row.run_id,
        report: row.report.as_deref(),
        report_sha256: row.report_sha256.as_deref(),
    }
}

/// The messages a run sends under `on`: one `failure` naming each validation that failed
/// (with `failure`) or erred, or never ended (with `error`), when there is one; and a `summary`
/// of every validation (with `summary`).
pub fn messages(on: Triggers, run: &PlanRunFacts, rows: &[ValidationRow]) -> Vec<Message> {
    let counts = || Counts {
        passed: rows.iter().filter(|r| r.state == RowState::Passed).count(),
        failed: rows.iter().filter(|r| r.state == RowState::Failed).count(),
        error: rows
            .iter()
            .filter(|r| !matches!(r.state, RowState::Passed | RowState::Failed))
            .count(),
    };
    let body = |kind: &'static str, chosen: Vec<&ValidationRow>| {
        let left_out = chosen.len().saturating_sub(MAX_ENTRIES);
        let body = Body {
            kind: format!("certistack.run.{kind}"),
            run,
            counts: counts(),
            validations: chosen.into_iter().take(MAX_ENTRIES).map(entry).collect(),
            left_out,
        };
        Message {
            kind,
            body: serde_json::to_string(&body).unwrap_or_default(),
        }
    };
    let mut out = Vec::new();
    let told: Vec<&ValidationRow> = rows
        .iter()
        .filter(|row| match row.state {
            RowState::Passed => false,
            RowState::Failed => on.failure,
            RowState::Error | RowState::Running | RowState::Interrupted => on.error,
        })
        .collect();
    if !told.is_empty() {
        out.push(body("failure", told));
    }
    if on.summary {
        out.push(body("summary", rows.iter().collect()));
    }
    out
}

/// Where a message goes.
#[derive(Debug)]
pub enum Channel {
    Webhook(webhook::Webhook),
    Email(email::Email),
}

impl Channel {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Webhook(_) => "webhook",
            Self::Email(_) => "email",
        }
    }

    /// Where, for a person: the webhook's URL or the SMTP server.
    pub fn target(&self) -> &str {
        match self {
            Self::Webhook(webhook) => &webhook.url,
            Self::Email(email) => &email.server,
        }
    }

    async fn send(&self, message: &Message, now_unix: i64) -> Result<(), String> {
        match self {
            Self::Webhook(webhook) => webhook.send(&message.body, now_unix).await,
            Self::Email(email) => email.send(message).await,
        }
    }
}

/// Delivers `message` through `channel`: up to [`ATTEMPTS`] tries, [`BACKOFF`] apart; what
/// happened, for the history.
pub async fn deliver(
    channel: &Channel,
    message: &Message,
    plan_run_id: &str,
    now_unix: impl Fn() -> i64,
    stopped: impl Fn() -> bool,
) -> Delivery {
    let mut last_error = None;
    let mut attempts = 0;
    for attempt in 0..ATTEMPTS {
        if let Some(wait) = attempt
            .checked_sub(1)
            .and_then(|index| BACKOFF.get(index as usize))
        {
            tokio::time::sleep(*wait).await;
        }
        // The operator's interrupt ends the tries: the run is over, only telling is left.
        if stopped() {
            last_error = Some("not tried again: interrupted by the operator".to_owned());
            break;
        }
        attempts = attempt + 1;
        let tried = tokio::time::timeout(TRY_TIMEOUT, channel.send(message, now_unix()))
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {} s", TRY_TIMEOUT.as_secs())));
        match tried {
            Ok(()) => {
                last_error = None;
                break;
            }
            Err(error) => {
                last_error = Some(crate::history::bounded(
                    &error,
                    certistack_core::untrusted::MAX_DETAIL_CHARS,
                ));
            }
        }
    }
    Delivery {
        plan_run_id: plan_run_id.to_owned(),
        channel: channel.name().into(),
        kind: message.kind.into(),
        attempts,
        delivered: last_error.is_none(),
        last_error,
        at_unix_ms: now_unix() * 1000,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(validation: &str, state: RowState) -> ValidationRow {
        ValidationRow {
            run_id: format!("run-{validation}"),
            plan_run_id: "p".into(),
            validation: validation.into(),
            node: "pve1".into(),
            source_vmid: 100,
            snapshot: "vm/100/2026-12-01T02:00:00Z".into(),
            state,
            started_unix_ms: 1,
            deadline_unix_ms: 2,
            ended_unix_ms: Some(2),
            cleanup: Some("complete".into()),
            reasons: vec![],
            restore_ms: None,
            report: None,
            report_sha256: None,
            steps: vec![],
        }
    }

    fn facts() -> PlanRunFacts {
        PlanRunFacts {
            plan_run_id: "p".into(),
            plan: "nightly.yaml".into(),
            plan_sha256: "ab".into(),
            started_unix_ms: 1,
            ended_unix_ms: 2,
        }
    }

    #[test]
    fn a_failure_message_names_what_failed_or_erred_and_a_summary_everything() {
        let run = facts();
        let rows = [
            row("web", RowState::Passed),
            row("db", RowState::Failed),
            row("ldap", RowState::Error),
        ];
        let every = Triggers {
            failure: true,
            error: true,
            summary: true,
        };
        let sent = messages(every, &run, &rows);
        assert_eq!(sent.len(), 2);
        let failure: serde_json::Value = serde_json::from_str(&sent[0].body).unwrap();
        assert_eq!(failure["type"], "certistack.run.failure");
        assert_eq!(failure["plan_run_id"], "p");
        assert_eq!(failure["validations"].as_array().unwrap().len(), 2);
        assert_eq!(failure["counts"]["failed"], 1);
        let summary: serde_json::Value = serde_json::from_str(&sent[1].body).unwrap();
        assert_eq!(summary["validations"].as_array().unwrap().len(), 3);
        // Only failures asked: the erred validation is not named, and a run that only erred
        // sends nothing.
        let failures = Triggers {
            failure: true,
            error: false,
            summary: false,
        };
        let sent = messages(failures, &run, &rows);
        let failure: serde_json::Value = serde_json::from_str(&sent[0].body).unwrap();
        assert_eq!(failure["validations"][0]["validation"], "db");
        assert_eq!(failure["validations"].as_array().unwrap().len(), 1);
        assert!(messages(failures, &run, &[row("ldap", RowState::Error)]).is_empty());
    }

    #[test]
    fn guest_text_reaches_a_message_escaped_and_bounded() {
        let run = facts();
        let mut hostile = row("db", RowState::Failed);
        hostile.reasons = vec![format!(
            "banner \u{1b}]52;c;aGk=\u{7}\u{1b}[2J\u{202e}{}",
            "x".repeat(10_000)
        )];
        let on = Triggers {
            failure: true,
            error: true,
            summary: false,
        };
        let sent = messages(on, &run, &[hostile]);
        let body: serde_json::Value = serde_json::from_str(&sent[0].body).unwrap();
        let reason = body["validations"][0]["reasons"][0].as_str().unwrap();
        assert!(
            !reason
                .chars()
                .any(|c| c.is_control() || ('\u{202a}'..='\u{202e}').contains(&c)),
            "{reason}"
        );
        assert!(reason.chars().count() < 2_100, "{}", reason.len());
        let (_, text) = email::render(&sent[0]);
        assert!(!text.contains('\u{1b}'), "{text}");
    }
}
