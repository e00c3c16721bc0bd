//! The node's clock: a parameter of the service and the executor, so tests can move it.

/// The node's clock, a parameter so tests can move it.
pub trait Clock: Send + Sync + 'static {
    fn now_unix_ms(&self) -> i64;
    fn now_unix(&self) -> i64 {
        self.now_unix_ms().div_euclid(1000)
    }
}

impl std::fmt::Debug for dyn Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Clock")
    }
}

#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_unix_ms(&self) -> i64 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        i64::try_from(now.as_millis()).unwrap_or(i64::MAX)
    }
}
