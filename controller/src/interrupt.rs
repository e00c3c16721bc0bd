//! The operator's interrupts during `certistack-ctl run`, in three levels. The first Ctrl-C (or
//! SIGTERM, or SIGHUP) stops the run after the current step and cleans up; the second abandons
//! the step or wait in progress, cleanup still runs; the third abandons the cleanup too, and the
//! summary names the `certistack-ctl cleanup NODE RUN` to run.

use crate::runner::Progress;
use std::sync::Arc;

/// Operator interruptions: 0 none, 1 stop after the current step and clean up, 2 also abandon
/// the step or wait in progress (cleanup still runs).
pub type Interrupts = tokio::sync::watch::Receiver<u8>;

/// The interrupt level that abandons waits in cleanup: the third Ctrl-C. (The second abandons
/// only reconnecting to a node that is gone: cleanup needs the node.)
pub const ABANDON_CLEANUP: u8 = 3;

/// Counts the operator's interrupts from now on, saying on `progress` what each one does.
/// Call inside the runtime.
pub fn listen(progress: Arc<Progress>) -> Interrupts {
    let (interrupt, interrupts) = tokio::sync::watch::channel(0u8);
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        // SIGTERM (a timer or `timeout` stopping the job) and SIGHUP (the operator's
        // session gone) count as Ctrl-C: the run stops and cleans up rather than dying.
        let (Ok(mut term), Ok(mut hup), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::hangup()),
            signal(SignalKind::interrupt()),
        ) else {
            return;
        };
        let mut count = 0u8;
        loop {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
                _ = hup.recv() => {}
            }
            count = count.saturating_add(1);
            progress.println(match count {
                1 => "certistack-ctl: interrupted: stopping after the current step, then cleaning up (interrupt again to abandon the step in progress)",
                2 => "certistack-ctl: interrupted again: abandoning the step in progress; cleanup still runs (a third interrupt abandons the cleanup)",
                _ => "certistack-ctl: interrupted a third time: abandoning the cleanup; the summary names the `certistack-ctl cleanup NODE RUN` to run",
            });
            let _ = interrupt.send(count);
        }
    });
    interrupts
}

/// Returns once the operator's interrupts reach `level` (never, if the sender is gone).
pub async fn interrupted_to(interrupts: &mut Interrupts, level: u8) {
    loop {
        if *interrupts.borrow_and_update() >= level {
            return;
        }
        if interrupts.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
