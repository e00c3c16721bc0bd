//! The daemon's side of systemd's service protocol (`sd_notify(3)`, `sd_watchdog_enabled(3)`,
//! `systemd.exec(5)` on `JOURNAL_STREAM`).
//!
//! - `READY=1` once interrupted steps have been settled and the listener is bound, so
//!   `systemctl start` (and an upgrade's restart) returns only when the daemon serves with a
//!   consistent journal;
//! - `WATCHDOG=1` from a task of the async runtime at half the watchdog interval: a runtime that
//!   stops scheduling stops the pings and systemd restarts the daemon;
//! - `RELOADING=1` … `READY=1` around a SIGHUP reload, `STOPPING=1` while draining.
//!
//! Without `NOTIFY_SOCKET` (started by hand, by tests, by another supervisor) every message is
//! skipped.

use std::time::Duration;

/// Tells the service manager the daemon serves. Failures are logged, never fatal: a daemon
/// that serves is more useful than one that exits because its supervisor went away.
pub fn notify_ready() {
    send(&[sd_notify::NotifyState::Ready], "READY=1");
}

/// Tells the service manager the daemon drains and stops.
pub fn notify_stopping() {
    send(&[sd_notify::NotifyState::Stopping], "STOPPING=1");
}

/// Tells the service manager a reload began; [`notify_ready`] ends it.
pub fn notify_reloading() {
    let now = sd_notify::NotifyState::monotonic_usec_now();
    match now {
        Ok(now) => send(&[sd_notify::NotifyState::Reloading, now], "RELOADING=1"),
        Err(_) => send(&[sd_notify::NotifyState::Reloading], "RELOADING=1"),
    }
}

fn send(states: &[sd_notify::NotifyState<'_>], what: &str) {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return;
    }
    if let Err(error) = sd_notify::notify(false, states) {
        tracing::warn!(%error, message = what, "cannot notify the service manager");
    }
}

/// How often to ping the watchdog: half of `WATCHDOG_USEC`, when it is set for this process
/// (`WATCHDOG_PID` absent or ours, as `sd_watchdog_enabled(3)` reads them).
pub fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID")
        && pid.parse::<u32>().ok() != Some(std::process::id())
    {
        return None;
    }
    if usec == 0 {
        return None;
    }
    Some(Duration::from_micros(usec / 2).max(Duration::from_millis(1)))
}

/// Pings the watchdog every `interval`, forever; run it as a task of the serving runtime.
pub async fn keep_watchdog_fed(interval: Duration) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        send(&[sd_notify::NotifyState::Watchdog], "WATCHDOG=1");
    }
}

/// Whether stderr is connected to the journal: `JOURNAL_STREAM` names the device and inode of
/// the stream systemd connected, and stderr still is that stream (a redirect in between makes
/// it another file).
pub fn stderr_is_journal() -> bool {
    let Some(named) = std::env::var("JOURNAL_STREAM").ok() else {
        return false;
    };
    let Some((device, inode)) = named.split_once(':') else {
        return false;
    };
    let (Ok(device), Ok(inode)) = (device.parse::<u64>(), inode.parse::<u64>()) else {
        return false;
    };
    match rustix::fs::fstat(std::io::stderr()) {
        Ok(stat) => stat.st_dev == device && stat.st_ino == inode,
        Err(_) => false,
    }
}

/// Whether systemd is the init system here (`sd_booted(3)`: `/run/systemd/system` exists).
pub fn booted() -> bool {
    std::path::Path::new("/run/systemd/system").is_dir()
}
