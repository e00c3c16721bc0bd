//! A verified report printed for a person (`certistack-ctl report show`).
//!
//! Much of a report is the node's word, some of it the guest's (its os-release name, its
//! banners, its file names): signed by the controller, it is still text a hostile guest or
//! node chose. Every text of the report is printed escaped and bounded
//! ([`certistack_core::untrusted::printable`]), so none can move the cursor, rewrite the
//! verdict line above it, set the clipboard or hide a link in the operator's terminal.

use super::*;
use certistack_core::untrusted::{MAX_DETAIL_CHARS, MAX_VALUE_CHARS, printable};

/// One value of the report (a name, a version, a status) as it is printed.
fn value(text: &str) -> String {
    printable(text.as_bytes(), MAX_VALUE_CHARS)
}

/// A longer text of the report (a step's detail, a reason, a list) as it is printed.
fn detail(text: &str) -> String {
    printable(text.as_bytes(), MAX_DETAIL_CHARS)
}

/// Reasons of a verdict, each escaped and bounded.
fn reasons_text(reasons: &[String]) -> String {
    reasons
        .iter()
        .map(|reason| detail(reason))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The report for a person: verdict first, then what was validated and how.
pub fn describe(statement: &Statement, report_path: &Path) -> String {
    use std::fmt::Write;
    let p = &statement.predicate;
    let mut out = String::new();
    let verdict = match &p.verdict {
        Verdict::Passed => "passed".to_owned(),
        Verdict::Failed { reasons } => format!("FAILED: {}", reasons_text(reasons)),
        Verdict::Error { reasons } => {
            format!("ERROR (nothing proven): {}", reasons_text(reasons))
        }
    };
    let _ = writeln!(out, "verdict: {verdict}");
    let _ = writeln!(out, "run: {}", value(&p.run_id));
    let _ = writeln!(
        out,
        "node: {} (connector {}, surface {})",
        value(&p.node),
        value(&p.connector.version),
        value(&p.connector.surface_digest)
    );
    if let Some(placement) = &p.placement {
        let _ = writeln!(out, "  placed: {}", value(placement));
    }
    let _ = writeln!(out, "controller: {}", value(&p.controller_version));
    let _ = writeln!(out, "plan: {}", value(&p.plan_digest));
    let _ = writeln!(
        out,
        "snapshot: {} on {}:{} datastore {} namespace \"{}\"",
        value(&p.snapshot.snapshot),
        value(&p.snapshot.server),
        p.snapshot.port,
        value(&p.snapshot.datastore),
        value(&p.snapshot.namespace)
    );
    if let Some(latest) = &p.snapshot.latest {
        let age = latest.age_seconds.map_or_else(
            || "none finished".to_owned(),
            |age| format!("the newest finished {} s old", age.max(0)),
        );
        let max_age = latest
            .max_age_hours
            .map_or_else(String::new, |hours| format!(", max_age_hours {hours}"));
        let _ = writeln!(
            out,
            "  latest: {} of {} listed snapshot(s) finished, {age}{max_age}",
            latest.finished, latest.listed
        );
    }
    // `verify` checked the digests' and the verify state's form before this prints them.
    if let Some(digest) = &p.snapshot.manifest_sha256 {
        let _ = writeln!(out, "  manifest: sha256 {digest}");
    }
    match &p.snapshot.verify_state {
        Some(v) => {
            let _ = writeln!(
                out,
                "  last PBS verify: {} (task started {}, {})",
                v.state,
                OffsetDateTime::from_unix_timestamp(v.started_unix_ms / 1000)
                    .map_or_else(|_| v.started_unix_ms.to_string(), |t| t.to_string()),
                v.upid
            );
        }
        None if p.snapshot.manifest_sha256.is_some() => {
            let _ = writeln!(out, "  last PBS verify: none recorded in the manifest");
        }
        None => {}
    }
    for archive in &p.snapshot.archives {
        let digest = archive.sha256.as_deref().unwrap_or("digest not reported");
        let _ = writeln!(
            out,
            "  archive: {} (sha256 {})",
            value(&archive.name),
            value(digest)
        );
    }
    let _ = writeln!(out, "steps:");
    for step in &p.steps {
        let result = match step.result {
            StepResult::Ok => "ok",
            StepResult::Failed => "FAILED",
            StepResult::Skipped => "skipped",
        };
        let elapsed = step.ended_unix_ms.saturating_sub(step.started_unix_ms);
        let _ = write!(out, "  {:<14} {result:<7} {elapsed} ms", value(&step.name));
        if !step.detail.is_empty() {
            let _ = write!(out, "  {}", detail(&step.detail));
        }
        out.push('\n');
    }
    let _ = writeln!(out, "guest: {}", value(&p.guest.status));
    let _ = writeln!(out, "probes:");
    for probe in &p.probes {
        let _ = writeln!(
            out,
            "  {} {} from {} (expected {}): {}",
            value(&probe.target),
            value(&probe.outcome),
            value(&probe.origin),
            detail(&probe.expected),
            if probe.passed { "ok" } else { "FAILED" }
        );
    }
    let _ = writeln!(out, "assertions:");
    for assertion in &p.assertions {
        let _ = writeln!(
            out,
            "  {} exit {}: {}",
            value(&assertion.name),
            assertion.exit_code,
            if assertion.passed { "ok" } else { "FAILED" }
        );
    }
    if let Some(hw) = &p.hardware {
        let or_default = |v: &str| {
            if v.is_empty() {
                "default".to_owned()
            } else {
                value(v)
            }
        };
        let _ = writeln!(
            out,
            "hardware: cpu {} bios {}{} machine {} ostype {} scsihw {}; disks [{}]; nics [{}]; boot [{}]",
            or_default(&hw.cpu),
            or_default(&hw.bios),
            if hw.efidisk.is_empty() {
                String::new()
            } else {
                format!(" (efidisk {})", value(&hw.efidisk))
            },
            or_default(&hw.machine),
            or_default(&hw.ostype),
            or_default(&hw.scsihw),
            detail(&hw.disks.join(", ")),
            detail(&hw.nics.join(", ")),
            detail(&hw.boot_order.join(", "))
        );
        for changed in &hw.changed {
            let _ = writeln!(out, "  changed {}", detail(changed));
        }
        for omitted in &hw.omitted {
            let _ = writeln!(out, "  omitted {}", detail(omitted));
        }
    }
    let _ = writeln!(
        out,
        "isolation: ruleset {}",
        value(&p.isolation.ruleset_digest)
    );
    let _ = writeln!(
        out,
        "cleanup: {} ({} resources{})",
        if p.cleanup.complete {
            "complete"
        } else {
            "NOT PROVEN COMPLETE"
        },
        p.cleanup.receipts.len(),
        if p.cleanup.residue.is_empty() {
            String::new()
        } else {
            format!("; residue: {}", detail(&p.cleanup.residue.join(", ")))
        }
    );
    let _ = writeln!(
        out,
        "journal: {} records, head {} (recomputed)",
        p.journal.records.len(),
        value(&p.journal.head_sha256)
    );
    match &p.screenshot {
        Some(shot) => {
            let location = report_path
                .parent()
                .unwrap_or(Path::new("."))
                .join(&shot.file);
            let _ = writeln!(
                out,
                "screenshot: {} (sha256 {})",
                detail(&location.display().to_string()),
                value(&shot.sha256)
            );
        }
        None => {
            let _ = writeln!(out, "screenshot: none");
        }
    }
    out
}
