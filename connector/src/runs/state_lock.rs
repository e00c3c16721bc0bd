//! The single-instance lock on the state directory, holding the PID of the connector that
//! holds it.

use super::RunError;
use certistack_core::files::{self, FileError};
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

pub(super) const LOCK_FILE: &str = "lock";
/// The single-instance lock on a state directory: `<state_dir>/lock`, holding the PID of the
/// connector that holds it. Released when dropped (or when the process dies).
#[derive(Debug)]
pub struct StateLock {
    _file: File,
}

impl StateLock {
    /// Takes the lock for a serving connector, creating the state directory (0700) and the
    /// lock file if needed, and writes this process's PID into it.
    pub fn acquire(state_dir: &Path) -> Result<Self, RunError> {
        files::create_private_dir(state_dir)?;
        let path = state_dir.join(LOCK_FILE);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|error| FileError::Write {
                path: path.clone(),
                error,
            })?;
        take_lock(
            &mut file,
            state_dir,
            &path,
            rustix::fs::FlockOperation::NonBlockingLockExclusive,
        )?;
        let written = file
            .set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(format!("{}\n", std::process::id()).as_bytes()))
            .and_then(|()| file.sync_all());
        written.map_err(|error| FileError::Write { path, error })?;
        Ok(Self { _file: file })
    }

    /// Takes the lock without writing anything, for a read-only check: `None` when no
    /// connector ever served from `state_dir` (no lock file).
    pub fn probe(state_dir: &Path) -> Result<Option<Self>, RunError> {
        let path = state_dir.join(LOCK_FILE);
        let mut file = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(FileError::Read { path, error }.into()),
        };
        take_lock(
            &mut file,
            state_dir,
            &path,
            rustix::fs::FlockOperation::NonBlockingLockShared,
        )?;
        Ok(Some(Self { _file: file }))
    }
}

fn take_lock(
    file: &mut File,
    state_dir: &Path,
    path: &Path,
    operation: rustix::fs::FlockOperation,
) -> Result<(), RunError> {
    match rustix::fs::flock(&*file, operation) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::WOULDBLOCK) => {
            let mut holder = String::new();
            let _ = Read::take(&mut *file, 32).read_to_string(&mut holder);
            let holder = holder.trim();
            Err(RunError::Locked {
                path: state_dir.to_owned(),
                lock: path.to_owned(),
                holder: if holder.is_empty() {
                    "unknown".into()
                } else {
                    holder.to_owned()
                },
            })
        }
        Err(error) => Err(FileError::Write {
            path: path.to_owned(),
            error: error.into(),
        }
        .into()),
    }
}
