//! Refusals of one kind (TLS handshakes, calls) logged without letting a peer fill the log:
//! the first few refusals of each window one by one, with the peer and the reason, then only
//! counted, with one summary per window: "N refused from M sources (reasons: …)". Refused
//! handshakes need no certificate, so this is what bounds the log an unauthenticated peer can
//! cause.

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long one refusal window lasts.
pub const REFUSAL_WINDOW: Duration = Duration::from_secs(10);
/// Distinct reasons a summary names; the rest are counted as "other".
const MAX_REASONS: usize = 16;
/// Distinct sources counted per window; beyond this the summary says "at least".
const MAX_SOURCES: usize = 4096;
/// Characters of a peer-derived reason kept in a log line.
const MAX_REASON_CHARS: usize = 240;

/// Refusals of one kind (handshakes, calls), logged one by one up to a budget per window and
/// summarized beyond it.
#[derive(Debug)]
pub struct RefusalLog {
    what: &'static str,
    detailed_per_window: u32,
    window: Mutex<Window>,
}

#[derive(Debug)]
struct Window {
    started: Instant,
    total: u64,
    detailed: u32,
    sources: HashSet<IpAddr>,
    reasons: BTreeMap<String, u64>,
}

impl Window {
    fn new(now: Instant) -> Self {
        Self {
            started: now,
            total: 0,
            detailed: 0,
            sources: HashSet::new(),
            reasons: BTreeMap::new(),
        }
    }
}

/// One closed window with refusals that were not logged one by one.
#[derive(Debug, PartialEq, Eq)]
pub struct Summary {
    pub total: u64,
    pub logged: u32,
    pub sources: usize,
    pub reasons: String,
}

impl RefusalLog {
    /// `what` names the refused thing in the summary ("handshakes", "calls").
    pub fn new(what: &'static str, detailed_per_window: u32) -> Self {
        Self {
            what,
            detailed_per_window,
            window: Mutex::new(Window::new(Instant::now())),
        }
    }

    /// Counts one refusal from `source` for `reason`; true when the caller should log this
    /// one in detail (it is within the window's budget).
    pub fn record(&self, source: IpAddr, reason: &str) -> bool {
        self.record_at(Instant::now(), source, reason)
    }

    fn record_at(&self, now: Instant, source: IpAddr, reason: &str) -> bool {
        let (detailed, closed) = {
            let mut window = self.window.lock().unwrap_or_else(|e| e.into_inner());
            let closed = Self::roll(&mut window, now);
            window.total = window.total.saturating_add(1);
            if window.sources.len() < MAX_SOURCES {
                window.sources.insert(source);
            }
            let reason = printable(reason);
            let known = window.reasons.contains_key(&reason);
            let key = if known || window.reasons.len() < MAX_REASONS {
                reason
            } else {
                "other".to_owned()
            };
            let count = window.reasons.entry(key).or_insert(0);
            *count = count.saturating_add(1);
            let detailed = window.detailed < self.detailed_per_window;
            if detailed {
                window.detailed = window.detailed.saturating_add(1);
            }
            (detailed, closed)
        };
        if let Some(summary) = closed {
            self.emit(&summary);
        }
        detailed
    }

    /// Logs the summary of the current window when it has ended; called periodically so a
    /// window's summary appears even when no further refusal arrives.
    pub fn flush(&self) {
        let closed = {
            let mut window = self.window.lock().unwrap_or_else(|e| e.into_inner());
            Self::roll(&mut window, Instant::now())
        };
        if let Some(summary) = closed {
            self.emit(&summary);
        }
    }

    /// Starts a new window when the current one has ended; returns the ended window's summary
    /// when some of its refusals were not logged one by one.
    fn roll(window: &mut Window, now: Instant) -> Option<Summary> {
        if now.saturating_duration_since(window.started) < REFUSAL_WINDOW {
            return None;
        }
        let ended = std::mem::replace(window, Window::new(now));
        if ended.total <= u64::from(ended.detailed) {
            return None;
        }
        let reasons = ended
            .reasons
            .iter()
            .map(|(reason, count)| format!("{reason} ×{count}"))
            .collect::<Vec<_>>()
            .join(", ");
        Some(Summary {
            total: ended.total,
            logged: ended.detailed,
            sources: ended.sources.len(),
            reasons,
        })
    }

    fn emit(&self, summary: &Summary) {
        let at_least = if summary.sources >= MAX_SOURCES {
            "at least "
        } else {
            ""
        };
        tracing::warn!(
            "{} {} refused in {} s from {at_least}{} sources, the first {} logged one by one (reasons: {})",
            summary.total,
            self.what,
            REFUSAL_WINDOW.as_secs(),
            summary.sources,
            summary.logged,
            summary.reasons
        );
    }
}

/// A peer-derived text made safe for one log line: escaped by the one escaping function of
/// both programs ([`certistack_core::untrusted::printable`]), capped for a log field.
pub fn printable(text: &str) -> String {
    certistack_core::untrusted::printable(text.as_bytes(), MAX_REASON_CHARS)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn a_window_logs_its_budget_then_summarizes_the_rest() {
        let log = RefusalLog::new("handshakes", 3);
        let start = Instant::now();
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let detailed: Vec<bool> = (0..10)
            .map(|i| log.record_at(start, if i % 2 == 0 { a } else { b }, "timed out"))
            .collect();
        assert_eq!(
            detailed,
            [
                true, true, true, false, false, false, false, false, false, false
            ]
        );
        let mut window = log.window.lock().unwrap();
        let summary = RefusalLog::roll(&mut window, start + REFUSAL_WINDOW).unwrap();
        assert_eq!(
            summary,
            Summary {
                total: 10,
                logged: 3,
                sources: 2,
                reasons: "timed out ×10".into()
            }
        );
        // The new window starts with a fresh budget and nothing to summarize.
        assert!(RefusalLog::roll(&mut window, start + REFUSAL_WINDOW * 2).is_none());
    }

    #[test]
    fn reasons_are_bounded_and_escaped() {
        let log = RefusalLog::new("calls", 0);
        let start = Instant::now();
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        for i in 0..100 {
            log.record_at(start, ip, &format!("reason {i}\n"));
        }
        let mut window = log.window.lock().unwrap();
        assert_eq!(window.reasons.len(), MAX_REASONS + 1);
        assert_eq!(window.reasons["other"], 100 - MAX_REASONS as u64);
        assert!(window.reasons.contains_key("reason 0\\n"));
        let summary = RefusalLog::roll(&mut window, start + REFUSAL_WINDOW).unwrap();
        assert_eq!(summary.total, 100);
        assert_eq!(
            printable(&"x".repeat(500)),
            format!("{}…[260 more bytes]", "x".repeat(MAX_REASON_CHARS))
        );
        // Escaped as every untrusted text is: line breaks, terminal sequences, bidi overrides.
        assert_eq!(
            printable("a\nFAKE\u{1b}[31m\u{202e}"),
            "a\\nFAKE\\u{1b}[31m\\u{202e}"
        );
    }
}
