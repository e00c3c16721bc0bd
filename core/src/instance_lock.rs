//! One process at a time on a directory: an advisory lock (`flock`) on a file in it that names
//! its holder.
//!
//! The connector holds one on its state directory while it serves; the controller holds one on
//! its state directory while `certistack-ctl run` runs a plan, so a timer's run and an
//! operator's run never pick the same sandbox VMIDs or race on the history. The kernel drops the
//! lock when the process ends, however it ends (`kill -9` included): a stale lock file is never
//! mistaken for a holder.

use crate::files::FileError;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The most of a holder's line that is read back (a PID, or a PID with what it runs).
pub const MAX_HOLDER_BYTES: u64 = 512;

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds the lock; `holder` is what it wrote ("unknown" when nothing).
    #[error("{lock} is held by {holder}")]
    Held { lock: PathBuf, holder: String },
    #[error(transparent)]
    File(#[from] FileError),
}

/// A held lock, released when dropped (or when the process ends).
#[derive(Debug)]
pub struct InstanceLock {
    _file: File,
}

impl InstanceLock {
    /// Takes the lock exclusively without waiting, creating `path` (0600, never through a
    /// symbolic link) if needed, then replaces its content with `holder` and syncs it.
    pub fn acquire(path: &Path, holder: &str) -> Result<Self, LockError> {
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(path)
            .map_err(|error| FileError::Write {
                path: path.to_owned(),
                error,
            })?;
        // A lock file another user left (a run started as root) would refuse every later
        // holder with a write error: say whose it is instead.
        let meta = file.metadata().map_err(|error| FileError::Read {
            path: path.to_owned(),
            error,
        })?;
        let uid = rustix::process::geteuid().as_raw();
        if !meta.is_file() {
            return Err(FileError::Content {
                path: path.to_owned(),
                reason: "is not a regular file; remove it".into(),
            }
            .into());
        }
        if std::os::unix::fs::MetadataExt::uid(&meta) != uid {
            return Err(FileError::WrongOwner {
                path: path.to_owned(),
                owner: std::os::unix::fs::MetadataExt::uid(&meta),
                expected: uid,
            }
            .into());
        }
        take(
            &mut file,
            path,
            rustix::fs::FlockOperation::NonBlockingLockExclusive,
        )?;
        let written = file
            .set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(format!("{holder}\n").as_bytes()))
            .and_then(|()| file.sync_all());
        written.map_err(|error| FileError::Write {
            path: path.to_owned(),
            error,
        })?;
        Ok(Self { _file: file })
    }

    /// Takes the lock shared without waiting and without writing, for a read-only check:
    /// `None` when `path` does not exist (nobody ever held it).
    pub fn probe(path: &Path) -> Result<Option<Self>, LockError> {
        let mut file = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(path)
        {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => {
                return Err(FileError::Read {
                    path: path.to_owned(),
                    error,
                }
                .into());
            }
        };
        take(
            &mut file,
            path,
            rustix::fs::FlockOperation::NonBlockingLockShared,
        )?;
        Ok(Some(Self { _file: file }))
    }
}

fn take(
    file: &mut File,
    path: &Path,
    operation: rustix::fs::FlockOperation,
) -> Result<(), LockError> {
    match rustix::fs::flock(&*file, operation) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::WOULDBLOCK) => {
            // The holder's line is its own words, bounded and escaped before anyone prints it.
            let mut bytes = Vec::new();
            let _ = Read::take(&mut *file, MAX_HOLDER_BYTES).read_to_end(&mut bytes);
            let line = bytes
                .split(|byte| *byte == b'\n')
                .next()
                .unwrap_or_default();
            let holder = crate::untrusted::printable(line, MAX_HOLDER_BYTES as usize);
            Err(LockError::Held {
                lock: path.to_owned(),
                holder: if holder.trim().is_empty() {
                    "unknown".into()
                } else {
                    holder.trim().to_owned()
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "certistack-instance-lock-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("lock")
    }

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_line_until_it_lets_go() {
        let path = scratch("held");
        let held = InstanceLock::acquire(&path, "pid 7, plan nightly.yaml").unwrap();
        match InstanceLock::acquire(&path, "pid 8") {
            Err(LockError::Held { lock, holder }) => {
                assert_eq!(lock, path);
                assert_eq!(holder, "pid 7, plan nightly.yaml");
            }
            other => panic!("a second exclusive holder: {other:?}"),
        }
        assert!(matches!(
            InstanceLock::probe(&path),
            Err(LockError::Held { .. })
        ));
        drop(held);
        assert!(InstanceLock::probe(&path).unwrap().is_some());
        let again = InstanceLock::acquire(&path, "pid 8").unwrap();
        drop(again);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "pid 8\n");
    }

    #[test]
    fn a_holder_line_is_bounded_and_escaped() {
        let path = scratch("escaped");
        let long = format!("\u{1b}[2J{}", "x".repeat(2000));
        let _held = InstanceLock::acquire(&path, &long).unwrap();
        match InstanceLock::acquire(&path, "pid 9") {
            Err(LockError::Held { holder, .. }) => {
                assert!(!holder.contains('\u{1b}'), "{holder:?}");
                // At most the bound's characters, and the marker counting what was left out.
                assert!(
                    holder.chars().count() < MAX_HOLDER_BYTES as usize + 64,
                    "{holder}"
                );
                assert!(holder.contains("x"), "{holder}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn probe_of_a_lock_nobody_took_is_none_and_a_symlink_is_not_followed() {
        let path = scratch("none");
        assert!(InstanceLock::probe(&path).unwrap().is_none());
        let target = path.with_file_name("elsewhere");
        std::fs::write(&target, "keep\n").unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        assert!(matches!(
            InstanceLock::acquire(&path, "pid 1"),
            Err(LockError::File(_))
        ));
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep\n");
    }
}
