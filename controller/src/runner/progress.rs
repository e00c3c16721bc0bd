//! Terminal progress of a run: live lines, plain lines or JSON events, and the text of a node
//! or a guest made safe for one terminal line.

use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// How progress reaches a person or a program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressMode {
    /// One live line per validation (a terminal).
    Live,
    /// One plain line per step (not a terminal).
    Plain,
    /// One JSON object per step event, one per line.
    Json,
}

/// One step event of one validation.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    pub time_unix_ms: i64,
    pub validation: String,
    pub node: String,
    pub run_id: String,
    pub step: String,
    /// `started`, `ok`, `failed`, `skipped`.
    pub state: &'static str,
    pub elapsed_ms: u64,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

/// Prints step events as the mode says; shared by every validation of a run.
#[allow(missing_debug_implementations)]
pub struct Progress {
    mode: ProgressMode,
    bars: indicatif::MultiProgress,
    lines: std::sync::Mutex<BTreeMap<String, indicatif::ProgressBar>>,
}

impl Progress {
    pub fn new(mode: ProgressMode) -> Self {
        let bars = indicatif::MultiProgress::new();
        if mode != ProgressMode::Live {
            bars.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        Self {
            mode,
            bars,
            lines: std::sync::Mutex::new(BTreeMap::new()),
        }
    }

    fn line(&self, validation: &str) -> Option<indicatif::ProgressBar> {
        let mut lines = self.lines.lock().ok()?;
        Some(
            lines
                .entry(validation.to_owned())
                .or_insert_with(|| {
                    let bar = self.bars.add(indicatif::ProgressBar::new_spinner());
                    if let Ok(style) =
                        indicatif::ProgressStyle::with_template("{spinner} [{elapsed:>4}] {msg}")
                    {
                        bar.set_style(style);
                    }
                    bar.enable_steady_tick(Duration::from_millis(250));
                    bar
                })
                .clone(),
        )
    }

    pub fn emit(&self, event: &Event) {
        match self.mode {
            ProgressMode::Json => {
                if let Some(line) = json_line(event) {
                    write_line(&line);
                }
            }
            ProgressMode::Plain => {
                let detail = if event.detail.is_empty() {
                    String::new()
                } else {
                    format!(": {}", for_terminal(&event.detail))
                };
                write_line(&format!(
                    "{} {} {} {} ({:.1}s){detail}",
                    event.validation,
                    event.node,
                    event.step,
                    event.state,
                    event.elapsed_ms as f64 / 1000.0
                ));
            }
            ProgressMode::Live => {
                if let Some(bar) = self.line(&event.validation) {
                    bar.set_message(format!(
                        "{} on {}: {} {}",
                        event.validation,
                        event.node,
                        for_terminal(&event.step),
                        event.state
                    ));
                }
            }
        }
    }

    /// Ends a validation's live line with its outcome.
    pub fn finish(&self, validation: &str, text: String) {
        if self.mode == ProgressMode::Live
            && let Some(bar) = self.line(validation)
        {
            bar.finish_with_message(text);
        }
    }

    /// Prints a line above the live lines (or plainly when there are none).
    pub fn println(&self, text: &str) {
        match self.mode {
            ProgressMode::Live => {
                let _ = self.bars.println(text);
            }
            ProgressMode::Plain => write_line(text),
            ProgressMode::Json => eprintln!("{text}"),
        }
    }
}

/// The longest node or guest text shown on one line of a terminal; the report keeps it whole.
const MAX_SHOWN_CHARS: usize = 200;

/// Text from a node or a guest (a banner, a tool's message) made safe for one terminal line:
/// control characters escaped, capped. The restored guest is not trusted.
pub(super) fn for_terminal(text: &str) -> String {
    certistack_core::untrusted::printable(text.as_bytes(), MAX_SHOWN_CHARS)
}

/// An event as one JSON line: its detail is a node's or a guest's text, escaped as on a
/// terminal line (JSON escapes C0 controls only; C1 controls and bidirectional overrides would
/// reach a terminal that shows the stream).
fn json_line(event: &Event) -> Option<String> {
    let shown = Event {
        step: for_terminal(&event.step),
        detail: for_terminal(&event.detail),
        ..event.clone()
    };
    serde_json::to_string(&shown).ok()
}

/// One line on standard output; a closed pipe is not the run's failure, so errors are ignored.
pub fn write_line(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    use super::*;
    use certistack_core::fixtures::{TERMINAL_SEQUENCES, acts_on_a_terminal};

    #[test]
    fn a_json_progress_line_carries_no_terminal_sequence_of_the_node() {
        let event = Event {
            time_unix_ms: 1_000,
            validation: "web01".into(),
            node: "pve1".into(),
            run_id: "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f".into(),
            step: "recover".into(),
            state: "failed",
            elapsed_ms: 10,
            detail: format!(
                "FailedPrecondition: {TERMINAL_SEQUENCES}{}",
                "A".repeat(100_000)
            ),
        };
        let line = json_line(&event).unwrap();
        assert!(!acts_on_a_terminal(&line), "{line:?}");
        assert!(line.len() < 4096, "{} bytes", line.len());
        let back: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(back["state"], "failed");
    }
}
