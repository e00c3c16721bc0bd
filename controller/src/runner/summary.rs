//! The closing summary table of a run, and each summary as `run --json` prints it.

use super::progress::for_terminal;
use crate::verdict::{CleanupState, Outcome, Summary};

/// The summary as `run --json` prints it: its reasons quote what a node or a guest said (a
/// probe's detail, a refusal), so each is escaped and bounded as on a terminal line (JSON
/// escapes C0 controls only; C1 controls and bidirectional overrides would reach a terminal
/// that shows the stream).
pub fn json_line(summary: &Summary) -> Option<String> {
    let shown = Summary {
        reasons: summary
            .reasons
            .iter()
            .map(|reason| for_terminal(reason))
            .collect(),
        validation: for_terminal(&summary.validation),
        node: for_terminal(&summary.node),
        ..summary.clone()
    };
    serde_json::to_string(&serde_json::json!({ "summary": shown })).ok()
}

/// The closing table: one row per validation.
pub fn summary_table(summaries: &[Summary]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<20} {:<12} {:<36} {:<7} {:<10} {:>8}  REASON / REPORT",
        "VALIDATION", "NODE", "RUN", "RESULT", "CLEANUP", "TIME"
    );
    for s in summaries {
        let outcome = match s.outcome {
            Outcome::Passed => "passed",
            Outcome::Failed => "FAILED",
            Outcome::Error => "ERROR",
        };
        let cleanup = match s.cleanup {
            CleanupState::NotNeeded => "none",
            CleanupState::Complete => "complete",
            CleanupState::Unproven => "UNPROVEN",
        };
        let tail = match (s.reasons.first(), &s.report) {
            (Some(reason), _) => for_terminal(reason),
            (None, Some(path)) => path.display().to_string(),
            (None, None) => String::new(),
        };
        let _ = writeln!(
            out,
            "{:<20} {:<12} {:<36} {:<7} {:<10} {:>7.1}s  {tail}",
            s.validation,
            s.node,
            s.run_id,
            outcome,
            cleanup,
            s.elapsed_ms as f64 / 1000.0
        );
        for reason in s.reasons.iter().skip(1) {
            let _ = writeln!(out, "{:<100}{}", "", for_terminal(reason));
        }
        if !s.reasons.is_empty()
            && let Some(path) = &s.report
        {
            let _ = writeln!(out, "{:<100}report {}", "", path.display());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn summary(outcome: Outcome, cleanup: CleanupState) -> Summary {
        Summary {
            validation: "web01".into(),
            node: "pve1".into(),
            run_id: "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f".into(),
            outcome,
            cleanup,
            reasons: Vec::new(),
            elapsed_ms: 61_500,
            report: Some(PathBuf::from("/var/lib/certistack/reports/r.json")),
            steps: Vec::new(),
        }
    }

    #[test]
    fn the_summary_table_has_a_row_per_validation_with_its_reason_or_report() {
        let mut failed = summary(Outcome::Failed, CleanupState::Complete);
        failed.validation = "db01".into();
        failed.reasons = vec![
            "probe tcp://10.99.0.10:5432 failed: connection refused".into(),
            "assertion pg-ready failed (exit code 2)".into(),
        ];
        let table = summary_table(&[summary(Outcome::Passed, CleanupState::Complete), failed]);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("VALIDATION"), "{table}");
        assert!(
            lines[1].contains("web01")
                && lines[1].contains("passed")
                && lines[1].contains("complete")
                && lines[1].contains("61.5s")
                && lines[1].ends_with("/var/lib/certistack/reports/r.json"),
            "{table}"
        );
        assert!(
            lines[2].contains("FAILED") && lines[2].ends_with("connection refused"),
            "{table}"
        );
        assert!(
            lines[3].trim_start() == "assertion pg-ready failed (exit code 2)",
            "{table}"
        );
        assert!(
            lines[4].trim_start().starts_with("report /var/lib"),
            "{table}"
        );
    }

    #[test]
    fn a_json_summary_carries_no_terminal_sequence() {
        use certistack_core::fixtures::{TERMINAL_SEQUENCES, acts_on_a_terminal};
        let summary = Summary {
            validation: "web01".into(),
            node: "pve1".into(),
            run_id: "0b1e5c1e-1111-4222-8333-944445555666".into(),
            outcome: Outcome::Failed,
            cleanup: CleanupState::Complete,
            reasons: vec![format!(
                "probe tcp://10.99.0.10:22: banner {TERMINAL_SEQUENCES}"
            )],
            elapsed_ms: 1,
            report: None,
            steps: Vec::new(),
        };
        let line = json_line(&summary).unwrap();
        assert!(!acts_on_a_terminal(&line), "{line}");
        let read: serde_json::Value = serde_json::from_str(&line).unwrap();
        let reason = read["summary"]["reasons"][0].as_str().unwrap();
        assert!(!acts_on_a_terminal(reason), "{reason}");
        assert!(reason.contains("verdict: passed"), "{reason}");
    }
}
