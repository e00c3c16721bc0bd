//! The single-instance lock on the state directory, holding the PID of the connector that
//! holds it (`core::instance_lock`).

use super::RunError;
use certistack_core::files;
use certistack_core::instance_lock::{InstanceLock, LockError};
use std::path::Path;

pub(super) const LOCK_FILE: &str = "lock";
/// The single-instance lock on a state directory: `<state_dir>/lock`, holding the PID of the
/// connector that holds it. Released when dropped (or when the process dies).
#[derive(Debug)]
pub struct StateLock {
    _lock: InstanceLock,
}

impl StateLock {
    /// Takes the lock for a serving connector, creating the state directory (0700) and the
    /// lock file if needed, and writes this process's PID into it.
    pub fn acquire(state_dir: &Path) -> Result<Self, RunError> {
        files::create_private_dir(state_dir)?;
        let lock =
            InstanceLock::acquire(&state_dir.join(LOCK_FILE), &std::process::id().to_string())
                .map_err(|error| locked(state_dir, error))?;
        Ok(Self { _lock: lock })
    }

    /// Takes the lock without writing anything, for a read-only check: `None` when no
    /// connector ever served from `state_dir` (no lock file).
    pub fn probe(state_dir: &Path) -> Result<Option<Self>, RunError> {
        Ok(InstanceLock::probe(&state_dir.join(LOCK_FILE))
            .map_err(|error| locked(state_dir, error))?
            .map(|lock| Self { _lock: lock }))
    }
}

fn locked(state_dir: &Path, error: LockError) -> RunError {
    match error {
        LockError::Held { lock, holder } => RunError::Locked {
            path: state_dir.to_owned(),
            lock,
            holder,
        },
        LockError::File(error) => error.into(),
    }
}
