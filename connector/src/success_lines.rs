//! A call's success line, held until its connection has flushed the reply to the socket: the
//! call log ([`crate::call_log`]) hands each success's line to its connection's
//! [`PendingLines`], and the connection ([`crate::connection`]) writes them after each flush.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

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
        // Under the call log's target, where its other lines are and where a filter names it.
        tracing::info!(target: CALL_LOG_TARGET, rpc = %self.rpc, %id, from = %from, ms = self.ms, "ok");
    }
}

/// The call log's target (`crate::call_log`'s module path, which a test checks): its lines
/// are filtered and found under one name.
pub const CALL_LOG_TARGET: &str = "certistack_connector::call_log";

/// Success lines held beyond this on one connection are written at once: a client that stops
/// reading its replies does not make the connection keep lines.
const MAX_PENDING_LINES: usize = 32;

/// The success lines of one connection's calls whose replies have not been flushed to its
/// socket yet. The connection writes them after each flush ([`PendingLines::write`]); what is
/// left when the connection and its calls are gone is written then.
#[derive(Debug, Default)]
pub struct PendingLines {
    /// Whether `lines` may hold any: a flush with none to write takes no lock.
    waiting: AtomicBool,
    lines: Mutex<PendingState>,
}

#[derive(Debug, Default)]
struct PendingState {
    /// Who the connection's client is, as its lines name it (the same for all its calls).
    peer: Option<(Arc<str>, Arc<str>)>,
    lines: Vec<SuccessLine>,
}

impl PendingLines {
    /// Holds `line` of a call of the client `id` from `from` until the next flush.
    pub fn push(&self, line: SuccessLine, id: &Arc<str>, from: &Arc<str>) {
        let mut state = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        if state.lines.len() >= MAX_PENDING_LINES {
            drop(state);
            line.write(id, from);
            return;
        }
        state.peer.get_or_insert_with(|| (id.clone(), from.clone()));
        state.lines.push(line);
        self.waiting.store(true, Ordering::Release);
    }

    /// Writes the lines held, in the order their calls ended.
    pub fn write(&self) {
        if !self.waiting.swap(false, Ordering::Acquire) {
            return;
        }
        let (peer, lines) = {
            let mut state = self.lines.lock().unwrap_or_else(|e| e.into_inner());
            (state.peer.clone(), std::mem::take(&mut state.lines))
        };
        if let Some((id, from)) = peer {
            for line in lines {
                line.write(&id, &from);
            }
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

    /// A success's line waits for the flush, and each is written once, in order; what no flush
    /// wrote is written when the connection's lines are dropped; beyond the bound, at once.
    #[test]
    fn success_lines_wait_for_the_flush() {
        let captured = Captured::default();
        let subscriber = crate::log_line::plain_subscriber(
            tracing_subscriber::EnvFilter::new("info"),
            captured.clone(),
        );
        let (id, from): (Arc<str>, Arc<str>) = ("run r1".into(), "192.0.2.7".into());
        tracing::subscriber::with_default(subscriber, || {
            let pending = PendingLines::default();
            pending.write();
            pending.push(success("Hello", 1), &id, &from);
            pending.push(success("VmStatus", 2), &id, &from);
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

            for n in 0..MAX_PENDING_LINES as u64 + 3 {
                pending.push(success("ListRuns", n), &id, &from);
            }
            // The three beyond the bound, at once.
            assert_eq!(captured.lines().len(), 2 + 3);
            drop(pending);
            let lines = captured.lines();
            assert_eq!(lines.len(), 2 + 3 + MAX_PENDING_LINES, "{lines:#?}");
            assert!(lines[2].ends_with(&format!("ms={MAX_PENDING_LINES}")));
            assert!(lines[5].ends_with(" ms=0"), "{}", lines[5]);
            assert!(
                lines
                    .last()
                    .unwrap()
                    .ends_with(&format!("ms={}", MAX_PENDING_LINES - 1))
            );
        });
    }
}
