//! The operator's interrupts during `certistack-ctl run`, in three levels. The first Ctrl-C (or
//! SIGTERM, or SIGHUP) stops the run after the current step and cleans up; the second abandons
//! the step or wait in progress, cleanup still runs; the third abandons the cleanup too, and the
//! summary names the `certistack-ctl cleanup NODE RUN` to run.

/// Operator interruptions: 0 none, then the levels below.
pub type Interrupts = tokio::sync::watch::Receiver<u8>;

/// The first interrupt: stop after the current step and clean up.
pub const STOP_AFTER_STEP: u8 = 1;
/// The second: also abandon the step or wait in progress (cleanup still runs), and reconnecting
/// to a node that is gone.
pub const ABANDON_STEP: u8 = 2;
/// The interrupt level that abandons waits in cleanup: the third Ctrl-C. (The second abandons
/// only reconnecting to a node that is gone: cleanup needs the node.)
pub const ABANDON_CLEANUP: u8 = 3;

/// What the operator is told when the interrupts reach `level`.
pub fn announcement(level: u8) -> &'static str {
    match level {
        STOP_AFTER_STEP => {
            "certistack-ctl: interrupted: stopping after the current step, then cleaning up (interrupt again to abandon the step in progress)"
        }
        ABANDON_STEP => {
            "certistack-ctl: interrupted again: abandoning the step in progress; cleanup still runs (a third interrupt abandons the cleanup)"
        }
        _ => {
            "certistack-ctl: interrupted a third time: abandoning the cleanup; the summary names the `certistack-ctl cleanup NODE RUN` to run"
        }
    }
}

/// Counts the operator's interrupts from now on, saying through `announce` (the run's progress
/// output) what each one does. Call inside the runtime.
pub fn listen(announce: impl Fn(&'static str) + Send + 'static) -> Interrupts {
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
            announce(announcement(count));
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn each_interrupt_says_what_it_abandons() {
        assert!(announcement(STOP_AFTER_STEP).contains("stopping after the current step"));
        assert!(announcement(ABANDON_STEP).contains("abandoning the step in progress"));
        assert!(announcement(ABANDON_STEP).contains("cleanup still runs"));
        for level in [ABANDON_CLEANUP, ABANDON_CLEANUP + 1, u8::MAX] {
            assert!(
                announcement(level).contains("certistack-ctl cleanup NODE RUN"),
                "{level}"
            );
        }
    }

    #[tokio::test]
    async fn a_wait_ends_when_the_interrupts_reach_its_level_and_not_before() {
        let (interrupt, mut interrupts) = tokio::sync::watch::channel(0u8);
        interrupt.send(STOP_AFTER_STEP).unwrap();
        let early = tokio::time::timeout(
            Duration::from_millis(50),
            interrupted_to(&mut interrupts, ABANDON_STEP),
        );
        assert!(early.await.is_err(), "returned at the first interrupt");
        let waiting = tokio::spawn(async move {
            interrupted_to(&mut interrupts, ABANDON_STEP).await;
        });
        interrupt.send(ABANDON_STEP).unwrap();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn a_wait_whose_sender_is_gone_never_ends() {
        let (interrupt, mut interrupts) = tokio::sync::watch::channel(0u8);
        drop(interrupt);
        let wait = tokio::time::timeout(
            Duration::from_millis(50),
            interrupted_to(&mut interrupts, STOP_AFTER_STEP),
        );
        assert!(wait.await.is_err());
    }
}
