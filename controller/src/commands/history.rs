//! `certistack-ctl history`: when each VM was last proven restorable, its streak and its restore
//! time's trend, or one VM's validations page by page; with `--max-age-hours`, the nightly
//! alarm for a cron job or a monitoring check.

use crate::exit::{self, ExitStatus};
use crate::history::bounded;
use crate::history::sqlite::{BUSY, SqliteStore};
use crate::history::{Cursor, FILE_NAME, MAX_PAGE, Page, RunStore, VmSummary};
use certistack_core::untrusted::{MAX_DETAIL_CHARS, MAX_VALUE_CHARS};
use std::fmt::Write;
use std::path::PathBuf;

pub const HISTORY_EXIT_CODES: &str = "Exit codes: 0 printed (and with --max-age-hours, every VM shown \
passed within it); 1 with --max-age-hours, a VM shown has no pass that recent (each is named); 64 usage \
error; 66 the history is not one this controller can read; 71 it is locked or cannot be opened; 78 the \
configuration is refused.";

#[derive(clap::Args, Debug)]
pub struct HistoryArgs {
    /// One VM's validations, newest first, a page at a time (its VMID); without it, one line
    /// per VM.
    pub vmid: Option<u32>,
    /// The controller configuration (its state directory holds the history).
    #[arg(long, default_value = crate::config::DEFAULT_CONFIG)]
    pub config: PathBuf,
    /// One JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Exit 1 when a VM shown has no passed validation newer than this many hours (each such VM
    /// is named on standard error).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=87_600))]
    pub max_age_hours: Option<u32>,
    /// With a VMID: the page after this token (printed at the end of the previous page).
    #[arg(long, requires = "vmid")]
    pub after: Option<String>,
    /// With a VMID: validations per page.
    #[arg(long, default_value_t = crate::history::PAGE as u32, requires = "vmid", value_parser = clap::value_parser!(u32).range(1..=MAX_PAGE as i64))]
    pub limit: u32,
}

pub fn history(args: &HistoryArgs, now_unix_ms: i64) -> Result<(), ExitStatus> {
    let config = super::load_config(&args.config)?;
    let path = config.state_dir.join(FILE_NAME);
    let after = args
        .after
        .as_deref()
        .map(Cursor::parse)
        .transpose()
        .map_err(|reason| ExitStatus::new(exit::USAGE, format!("--after: {reason}")))?;
    // Reading never creates the file: before the first run there is simply no history.
    let store = if path.exists() {
        Some(SqliteStore::open_for_reading(&path, BUSY)?)
    } else {
        None
    };
    let (text, stale) = match args.vmid {
        None => {
            let summaries = match &store {
                Some(store) => store.vm_summaries(now_unix_ms)?,
                None => Vec::new(),
            };
            let mut stale: Vec<String> = stale_vms(&summaries, args.max_age_hours, now_unix_ms);
            // No history at all (a wrong --config, no run yet, a file moved aside) is no pass.
            if summaries.is_empty() && args.max_age_hours.is_some() {
                stale.push(format!("no validation in the history ({})", path.display()));
            }
            let text = if args.json {
                serde_json::to_string_pretty(&serde_json::json!({ "vms": summaries }))
                    .unwrap_or_default()
            } else if summaries.is_empty() {
                format!(
                    "no validation in the history ({}): `certistack-ctl run` writes it",
                    path.display()
                )
            } else {
                vm_table(&summaries, now_unix_ms)
            };
            (text, stale)
        }
        Some(vmid) => {
            let page = match &store {
                Some(store) => {
                    store.validations_of(vmid, after.as_ref(), args.limit as usize, now_unix_ms)?
                }
                None => Page {
                    validations: Vec::new(),
                    next: None,
                },
            };
            let stale = match args.max_age_hours {
                // The VM's own summary decides, not the page shown.
                Some(_) => {
                    let summaries = match &store {
                        Some(store) => store.vm_summaries(now_unix_ms)?,
                        None => Vec::new(),
                    };
                    let mine: Vec<VmSummary> = summaries
                        .into_iter()
                        .filter(|summary| summary.source_vmid == vmid)
                        .collect();
                    if mine.is_empty() {
                        vec![format!("VM {vmid}: no validation in the history")]
                    } else {
                        stale_vms(&mine, args.max_age_hours, now_unix_ms)
                    }
                }
                None => Vec::new(),
            };
            let text = if args.json {
                serde_json::to_string_pretty(&page).unwrap_or_default()
            } else {
                page_table(vmid, &page, after.is_some())
            };
            (text, stale)
        }
    };
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        ExitStatus::of_output(writeln!(out, "{text}").and_then(|()| out.flush()))?;
    }
    if stale.is_empty() {
        return Ok(());
    }
    let hours = args.max_age_hours.unwrap_or_default();
    Err(ExitStatus::new(
        exit::FAILED,
        format!(
            "{} validation(s) with no pass in the last {hours} h: {}",
            stale.len(),
            stale.join("; ")
        ),
    ))
}

/// The VMs among `summaries` with no pass within `max_age_hours`, each saying when it last
/// passed.
fn stale_vms(summaries: &[VmSummary], max_age_hours: Option<u32>, now_unix_ms: i64) -> Vec<String> {
    let Some(hours) = max_age_hours else {
        return Vec::new();
    };
    let oldest = now_unix_ms - i64::from(hours) * 3_600_000;
    summaries
        .iter()
        .filter(|summary| summary.last_passed_unix_ms.is_none_or(|at| at < oldest))
        .map(|summary| match summary.last_passed_unix_ms {
            Some(at) => format!(
                "VM {} ({}) last passed {}",
                summary.source_vmid,
                shown(&summary.validation),
                ago(now_unix_ms, at)
            ),
            None => format!(
                "VM {} ({}) never passed",
                summary.source_vmid,
                shown(&summary.validation)
            ),
        })
        .collect()
}

/// Text from the history as a terminal shows it: escaped once (the store keeps it escaped, and
/// escaping it again would double its backslashes) and bounded.
fn shown(text: &str) -> String {
    bounded(text, MAX_VALUE_CHARS)
}

/// `at` as a time before `now`: `12 min ago`, `5 h 59 min ago`, `2 d 4 h ago`.
fn ago(now_unix_ms: i64, at: i64) -> String {
    let minutes = (now_unix_ms - at).max(0) / 60_000;
    match minutes {
        0..60 => format!("{minutes} min ago"),
        60..2_880 => format!("{} h {} min ago", minutes / 60, minutes % 60),
        _ => format!("{} d {} h ago", minutes / 1_440, minutes % 1_440 / 60),
    }
}

fn seconds(ms: u64) -> String {
    format!("{:.1} s", ms as f64 / 1000.0)
}

fn utc(ms: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(ms.div_euclid(1000))
        .ok()
        .and_then(|at| {
            at.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| ms.to_string())
}

/// Rows under `header`, each column as wide as its widest cell; `right` columns aligned right,
/// the last column not padded.
fn table(header: &[&str], right: &[bool], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|cell| cell.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = header.iter().map(|cell| (*cell).to_owned()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let last = row.len().saturating_sub(1);
        let mut line = String::new();
        for (index, (cell, width)) in row.iter().zip(&widths).enumerate() {
            let pad = width.saturating_sub(cell.chars().count());
            if index > 0 {
                line.push_str("  ");
            }
            if right.get(index).copied().unwrap_or(false) {
                line.push_str(&" ".repeat(pad));
                line.push_str(cell);
            } else {
                line.push_str(cell);
                if index != last {
                    line.push_str(&" ".repeat(pad));
                }
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
    out
}

fn vm_table(summaries: &[VmSummary], now_unix_ms: i64) -> String {
    let rows: Vec<Vec<String>> = summaries
        .iter()
        .map(|summary| {
            vec![
                summary.source_vmid.to_string(),
                shown(&summary.validation),
                summary.last_state.as_str().to_owned(),
                summary
                    .last_passed_unix_ms
                    .map_or("never".into(), |at| ago(now_unix_ms, at)),
                summary
                    .last_failed_unix_ms
                    .map_or("never".into(), |at| ago(now_unix_ms, at)),
                summary.streak.map_or("-".into(), |streak| {
                    format!("{} ×{}", streak.verdict.as_str(), streak.count)
                }),
                summary.last_restore_ms.map_or("-".into(), seconds),
                summary
                    .restore_trend
                    .map_or("-".into(), |ratio| format!("{ratio:.2}×")),
            ]
        })
        .collect();
    let mut out = table(
        &[
            "VMID",
            "VALIDATION",
            "LAST",
            "LAST PASSED",
            "LAST FAILED",
            "STREAK",
            "RESTORE",
            "TREND",
        ],
        &[false, false, false, false, false, false, true, true],
        &rows,
    );
    let _ = write!(
        out,
        "restore: from mapping the backup to the guest's first sign of life; trend: the last over the median of up to {} before it",
        crate::history::TREND_WINDOW
    );
    out
}

fn page_table(vmid: u32, page: &Page, after: bool) -> String {
    let mut out = String::new();
    if page.validations.is_empty() {
        let _ = if after {
            write!(
                out,
                "no validation of VM {vmid} after that token: the history ends before it"
            )
        } else {
            write!(out, "no validation of VM {vmid} in the history")
        };
        return out;
    }
    let rows: Vec<Vec<String>> = page
        .validations
        .iter()
        .map(|row| {
            vec![
                utc(row.started_unix_ms),
                shown(&row.validation),
                row.state.as_str().to_owned(),
                shown(&row.node),
                shown(&row.snapshot),
                row.restore_ms.map_or("-".into(), seconds),
                row.cleanup.as_deref().unwrap_or("-").to_owned(),
                shown(&row.run_id),
                row.reasons
                    .first()
                    .map(|reason| bounded(reason, MAX_DETAIL_CHARS))
                    .unwrap_or_default(),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "STARTED (UTC)",
            "VALIDATION",
            "RESULT",
            "NODE",
            "SNAPSHOT",
            "RESTORE",
            "CLEANUP",
            "RUN",
            "REASON",
        ],
        &[false, false, false, false, false, true],
        &rows,
    ));
    match &page.next {
        Some(token) => {
            let _ = write!(out, "more: certistack-ctl history {vmid} --after {token}");
        }
        None => {
            let _ = write!(out, "(end of VM {vmid}'s history)");
        }
    }
    out
}
