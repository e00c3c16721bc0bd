//! The run history: every plan run and validation `run` made, behind one small interface
//! ([`RunStore`]) that each backend implements and a conformance suite checks
//! (`tests/foundation/history_store.rs`). SQLite, built in, is the default
//! (`state_dir/history.sqlite`, [`sqlite::SqliteStore`]).
//!
//! What it answers: when was each VM last proven restorable, did it fail since, how long did
//! its restore take (`verdict::restore_ms`) and is that getting slower. Text from a node or a
//! guest (reasons) is escaped and bounded before it is stored, as for a terminal.

pub mod sqlite;

use crate::verdict::{HistoryWriter, StepTiming};
use serde::Serialize;

/// The history's file in the state directory.
pub const FILE_NAME: &str = "history.sqlite";
/// Validations in one page of `history VM`, unless asked for fewer.
pub const PAGE: usize = 20;
/// The most a page may hold.
pub const MAX_PAGE: usize = 500;
/// Reasons kept of one validation, each at most [`certistack_core::untrusted::MAX_DETAIL_CHARS`].
pub const MAX_REASONS: usize = 16;
/// Steps kept of one validation.
pub const MAX_STEPS: usize = 256;
/// The validations of one plan run read back at most (a plan's validations are bounded below
/// this).
pub const MAX_PLAN_RUN_VALIDATIONS: usize = 10_000;
/// Earlier restore times the trend compares the last one with (their median).
pub const TREND_WINDOW: usize = 7;

/// Why the history cannot be read or written, saying what to do.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "{path}: not a history this controller can read ({reason}); move it aside (the history starts anew) or restore it from a backup"
    )]
    Corrupt { path: String, reason: String },
    #[error(
        "{path}: locked by another process for over {seconds} s (another certistack-ctl run writing, or a tool holding it); wait for it to end, then try again"
    )]
    Locked { path: String, seconds: u64 },
    #[error(
        "{path}: written by a newer certistack-ctl (schema {found}, this one knows up to {known}); use that version, or move the file aside"
    )]
    Newer {
        path: String,
        found: i64,
        known: i64,
    },
    #[error("{path}: {reason}")]
    Io { path: String, reason: String },
    #[error("{0}")]
    Refused(String),
}

/// A validation's state as the history reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RowState {
    /// Begun and not ended, its deadline not passed yet.
    Running,
    /// Begun, never ended, and past its deadline: the controller was killed or lost the run.
    Interrupted,
    Passed,
    Failed,
    Error,
}

impl RowState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Interrupted => "interrupted",
            Self::Passed => "passed",
            Self::Failed => "failed",
            Self::Error => "error",
        }
    }
}

/// One validation as the history holds it.
#[derive(Debug, Clone, Serialize)]
pub struct ValidationRow {
    pub run_id: String,
    pub plan_run_id: String,
    pub validation: String,
    pub node: String,
    pub source_vmid: u32,
    pub snapshot: String,
    pub state: RowState,
    pub started_unix_ms: i64,
    pub deadline_unix_ms: i64,
    pub ended_unix_ms: Option<i64>,
    /// `not_needed`, `complete` or `unproven` once ended.
    pub cleanup: Option<String>,
    pub reasons: Vec<String>,
    pub restore_ms: Option<u64>,
    pub report: Option<String>,
    pub report_sha256: Option<String>,
    pub steps: Vec<StepTiming>,
}

/// Where the next page of a VM's validations starts: after this (start, run id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    pub started_unix_ms: i64,
    pub run_id: String,
}

impl Cursor {
    /// As `history VM --after` takes it: `START_MS.RUN_ID`.
    pub fn token(&self) -> String {
        format!("{}.{}", self.started_unix_ms, self.run_id)
    }

    pub fn parse(token: &str) -> Result<Self, String> {
        let (started, run_id) = token.split_once('.').ok_or_else(|| {
            format!(
                "{token:?} is not a page token (START_MS.RUN_ID, as the previous page printed it)"
            )
        })?;
        let started_unix_ms = started.parse().map_err(|_| {
            format!("{token:?} is not a page token: {started:?} is not a time in ms")
        })?;
        if !is_key(run_id) {
            return Err(format!(
                "{token:?} is not a page token: the run id is not one"
            ));
        }
        Ok(Self {
            started_unix_ms,
            run_id: run_id.to_owned(),
        })
    }
}

/// One page of a VM's validations, newest first.
#[derive(Debug, Clone, Serialize)]
pub struct Page {
    pub validations: Vec<ValidationRow>,
    /// The token of the next page, when there may be one.
    pub next: Option<String>,
}

/// One validation of a VM (a VM may have several, each with its own checks): when it last
/// proved the VM restorable, and how its restores go. One validation's pass never hides
/// another's failure.
#[derive(Debug, Clone, Serialize)]
pub struct VmSummary {
    pub source_vmid: u32,
    /// The validation's name in the plan.
    pub validation: String,
    /// Its newest validation: state and start.
    pub last_state: RowState,
    pub last_started_unix_ms: i64,
    /// When it last passed and last failed (the validations' ends).
    pub last_passed_unix_ms: Option<i64>,
    pub last_failed_unix_ms: Option<i64>,
    /// Its newest verdicts (passed or failed; errors prove nothing either way) in a row: which,
    /// and how many.
    pub streak: Option<Streak>,
    /// The restore time of its newest pass, and that over the median of up to
    /// [`TREND_WINDOW`] passes before it (above 1: slower).
    pub last_restore_ms: Option<u64>,
    pub restore_trend: Option<f64>,
}

/// A backend of the history: the writes the runner makes ([`HistoryWriter`]) and the reads
/// `history` makes. Every backend passes the conformance suite.
pub trait RunStore: HistoryWriter {
    /// Every (VM, validation) with a validation in the history, by VMID then name.
    fn vm_summaries(&self, now_unix_ms: i64) -> Result<Vec<VmSummary>, StoreError>;
    /// One VM's validations, newest first, `limit` (at most [`MAX_PAGE`]) after `after`.
    fn validations_of(
        &self,
        source_vmid: u32,
        after: Option<&Cursor>,
        limit: usize,
        now_unix_ms: i64,
    ) -> Result<Page, StoreError>;
    /// The validations of one plan run, in the order they began (at most
    /// [`MAX_PLAN_RUN_VALIDATIONS`]).
    fn validations_of_plan_run(
        &self,
        plan_run_id: &str,
        now_unix_ms: i64,
    ) -> Result<Vec<ValidationRow>, StoreError>;
    /// The notifications of one plan run.
    fn deliveries_of(&self, plan_run_id: &str)
    -> Result<Vec<crate::verdict::Delivery>, StoreError>;
}

/// The restore trend: `last` over the median of `before` (newest first), when there is one.
pub fn trend(last: u64, before: &[u64]) -> Option<f64> {
    if before.is_empty() {
        return None;
    }
    let mut sorted = before.to_vec();
    sorted.sort_unstable();
    let middle = sorted.len() / 2;
    let upper = sorted.get(middle).copied()? as f64;
    let median = if sorted.len().is_multiple_of(2) {
        (sorted.get(middle - 1).copied()? as f64 + upper) / 2.0
    } else {
        upper
    };
    (median > 0.0).then(|| last as f64 / median)
}

/// `text` as the history keeps and shows a node's or a guest's words: escaped once
/// ([`certistack_core::untrusted::printable_again`]) and cut to `max_chars` characters.
pub fn bounded(text: &str, max_chars: usize) -> String {
    certistack_core::untrusted::printable_again(text, max_chars)
}

/// Whether `id` is a key the history keeps (a run or plan run id, as `uuid` prints them):
/// letters, digits and `-`, at most 64.
pub fn is_key(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// A run of the same verdict: which, and how many.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Streak {
    pub verdict: RowState,
    pub count: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_once_however_often_it_is_bounded() {
        let hostile = "banner \u{1b}[2J\u{202e} C:\\path";
        let once = bounded(hostile, 256);
        assert_eq!(once, "banner \\u{1b}[2J\\u{202e} C:\\path");
        assert_eq!(bounded(&once, 256), once);
        assert_eq!(bounded("abcdef", 3), "abc…[3 more bytes]");
    }

    #[test]
    fn the_trend_compares_the_last_restore_with_the_median_before_it() {
        assert_eq!(trend(100, &[]), None);
        assert_eq!(trend(150, &[100]), Some(1.5));
        assert_eq!(trend(100, &[50, 100, 1000]), Some(1.0));
        assert_eq!(trend(100, &[100, 300]), Some(0.5));
    }

    #[test]
    fn a_page_token_reads_back_and_a_bad_one_says_what_it_is() {
        let cursor = Cursor {
            started_unix_ms: 1_796_000_000_000,
            run_id: "0b1e5c1e-1111-4222-8333-944445555666".into(),
        };
        assert_eq!(Cursor::parse(&cursor.token()).unwrap(), cursor);
        for bad in ["", "12", "x.abc", "12.", "12.a b", "12.a;b"] {
            assert!(
                Cursor::parse(bad).unwrap_err().contains("page token"),
                "{bad}"
            );
        }
    }
}
