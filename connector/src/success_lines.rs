//! A call's success line, held until its connection next flushes to the socket, which is after
//! the call's reply has been handed to the connection: the call log ([`crate::call_log`]) hands
//! each success's line to its connection's [`PendingLines`] when the reply's trailers are
//! taken, and the connection ([`crate::connection`]) writes them after each flush.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A success's line: written once the reply is in the socket, so that formatting it does not
/// delay the reply (about 3 % of a call on an open connection; docs/performance.md, section 1,
/// "The fifth pass").
#[derive(Debug)]
pub struct SuccessLine {
    rpc: Cow<'static, str>,
    ms: u64,
}

impl SuccessLine {
    /// The line of a call of `rpc` that took `ms` milliseconds.
    pub fn new(rpc: Cow<'static, str>, ms: u64) -> Self {
        Self { rpc, ms }
    }

    /// Writes the line now, for the client `id` from `from`.
    pub fn write(&self, id: &str, from: &str) {
        // Under the call log's target, where its other lines are and where a filter names it;
        // outside any span: it is written from within the connection's (h2's at debug level),
        // whose fields are not the call's.
        tracing::info!(target: CALL_LOG_TARGET, parent: None, rpc = %self.rpc, %id, from = %from, ms = self.ms, "ok");
    }
}

/// The call log's target (`crate::call_log`'s module path, which a test checks): its lines
/// are filtered and found under one name.
pub const CALL_LOG_TARGET: &str = "certistack_connector::call_log";

/// A connection holds at most this many lines, and none longer than [`MAX_HOLD`]: the call
/// that would hold more, or hold one longer, writes every line held and its own. A client that
/// stops reading its replies neither makes the connection keep lines nor delays them long.
const MAX_PENDING_LINES: usize = 32;
const MAX_HOLD: Duration = Duration::from_secs(1);

/// The success lines of one connection's calls whose replies may not have been flushed to its
/// socket yet. The connection writes them at its next flush ([`PendingLines::write`]); what is
/// left when the connection and its last call are gone is written then.
#[derive(Debug)]
pub struct PendingLines {
    /// Who the connection's client is, as its lines name it: the identity and the address.
    id: Arc<str>,
    from: Arc<str>,
    /// Whether `lines` may hold any: a flush with none to write takes no lock.
    waiting: AtomicBool,
    lines: Mutex<PendingState>,
}

#[derive(Debug, Default)]
struct PendingState {
    lines: Vec<SuccessLine>,
    /// When the first of `lines` was held.
    oldest: Option<Instant>,
}

impl PendingLines {
    /// The lines of a connection of the client `id` from `from`.
    pub fn new(id: Arc<str>, from: Arc<str>) -> Self {
        Self {
            id,
            from,
            waiting: AtomicBool::new(false),
            lines: Mutex::default(),
        }
    }

    /// Holds `line` of a call that ended at `now` until the next flush; writes it and those held
    /// before it at once when they are too many or too old.
    pub fn push(&self, line: SuccessLine, now: Instant) {
        let mut state = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        let oldest = *state.oldest.get_or_insert(now);
        state.lines.push(line);
        if state.lines.len() <= MAX_PENDING_LINES
            && now.saturating_duration_since(oldest) < MAX_HOLD
        {
            self.waiting.store(true, Ordering::Release);
            return;
        }
        let lines = std::mem::take(&mut *state).lines;
        drop(state);
        self.write_all(lines);
    }

    /// Writes the lines held, in the order their calls ended.
    pub fn write(&self) {
        // A load first: most flushes find nothing, and a load does not take the cache line.
        if !self.waiting.load(Ordering::Relaxed) || !self.waiting.swap(false, Ordering::Acquire) {
            return;
        }
        let lines =
            std::mem::take(&mut *self.lines.lock().unwrap_or_else(|e| e.into_inner())).lines;
        self.write_all(lines);
    }

    fn write_all(&self, lines: Vec<SuccessLine>) {
        for line in lines {
            line.write(&self.id, &self.from);
        }
    }
}

impl Drop for PendingLines {
    /// The connection closed (or its last call ended after it did) before a flush wrote them.
    fn drop(&mut self) {
        self.write();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log_line::capture::Captured;

    fn success(rpc: &'static str, ms: u64) -> SuccessLine {
        SuccessLine::new(Cow::Borrowed(rpc), ms)
    }

    /// A success's line waits for the flush, and each is written once, in order; a call that
    /// would hold more than the bound, or hold one too long, writes those held and its own at
    /// once; what no flush wrote is written when the connection's lines are dropped.
    #[test]
    fn success_lines_wait_for_the_flush() {
        let captured = Captured::default();
        let subscriber = crate::log_line::plain_subscriber(
            tracing_subscriber::EnvFilter::new("info"),
            captured.clone(),
        );
        let (id, from): (Arc<str>, Arc<str>) = ("run r1".into(), "192.0.2.7".into());
        let start = Instant::now();
        let ms = |lines: &[String]| -> Vec<u64> {
            lines
                .iter()
                .map(|line| line.rsplit_once("ms=").unwrap().1.parse().unwrap())
                .collect()
        };
        tracing::subscriber::with_default(subscriber, || {
            let pending = PendingLines::new(id.clone(), from.clone());
            pending.write();
            pending.push(success("Hello", 1), start);
            pending.push(success("VmStatus", 2), start);
            assert!(captured.lines().is_empty(), "{:?}", captured.lines());
            pending.write();
            pending.write();
            let lines = captured.lines();
            assert_eq!(lines.len(), 2, "{lines:#?}");
            assert!(
                lines[0].ends_with(
                    "  INFO certistack_connector::call_log: ok rpc=Hello id=run r1 from=192.0.2.7 ms=1"
                ),
                "{}",
                lines[0]
            );
            assert!(lines[1].ends_with(" ok rpc=VmStatus id=run r1 from=192.0.2.7 ms=2"));

            // The bound: the 33rd call writes all 33, in order.
            for n in 0..=MAX_PENDING_LINES as u64 {
                pending.push(success("ListRuns", 100 + n), start);
            }
            let expected: Vec<u64> = (100..=100 + MAX_PENDING_LINES as u64).collect();
            assert_eq!(ms(&captured.lines()[2..]), expected);

            // The age: a call a second after the oldest held writes both.
            pending.push(success("Hello", 200), start);
            pending.push(success("Hello", 201), start + MAX_HOLD / 2);
            assert_eq!(captured.lines().len(), 2 + expected.len());
            pending.push(success("Hello", 202), start + MAX_HOLD);
            assert_eq!(ms(&captured.lines()[2 + expected.len()..]), [200, 201, 202]);

            // Held at the end: written on drop, once.
            pending.push(success("Hello", 300), start + MAX_HOLD);
            drop(pending);
            let lines = captured.lines();
            assert_eq!(ms(&lines[lines.len() - 1..]), [300]);
            assert_eq!(lines.len(), 2 + expected.len() + 3 + 1, "{lines:#?}");
        });
    }

    /// Written from within a span (as h2's connection span at debug level), the line is
    /// outside it.
    #[test]
    fn a_success_line_is_in_no_span() {
        let captured = Captured::default();
        let subscriber = crate::log_line::plain_subscriber(
            tracing_subscriber::EnvFilter::new("debug"),
            captured.clone(),
        );
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::debug_span!("Connection", peer = "Server");
            let _entered = span.enter();
            success("Hello", 1).write("operator:alice", "192.0.2.7");
        });
        let lines = captured.lines();
        assert_eq!(lines.len(), 1, "{lines:#?}");
        assert!(
            lines[0].contains("  INFO certistack_connector::call_log: ok rpc=Hello"),
            "{}",
            lines[0]
        );
    }
}
