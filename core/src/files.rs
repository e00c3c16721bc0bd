//! Permission checks and crash-safe writes for the files both binaries keep.
//!
//! A private key must be owned by the user running the program and readable by nobody else;
//! a file that steers trust (a CA certificate, a pinned public key, the config) must not be
//! writable by anybody else. Writes that must survive a crash go to a temporary file that is
//! fsync'd, renamed into place, and followed by an fsync of the directory.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("cannot read {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("cannot write {path}: {error}")]
    Write {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path} has mode {mode:04o}: {what} must not be {who}; run `chmod {fix:04o} {path}`")]
    Insecure {
        path: PathBuf,
        mode: u32,
        what: &'static str,
        who: &'static str,
        fix: u32,
    },
    #[error(
        "{path} is owned by uid {owner}, not by uid {expected} that runs this program; run this program as the user that owns it (runuser -u <that user> -- ...), or, if it should be this user's, run `chown {expected} {path}`"
    )]
    WrongOwner {
        path: PathBuf,
        owner: u32,
        expected: u32,
    },
    #[error("{path} already exists; refusing to overwrite it")]
    Exists { path: PathBuf },
    #[error("{path}: {reason}")]
    Content { path: PathBuf, reason: String },
}

fn metadata(path: &Path) -> Result<fs::Metadata, FileError> {
    fs::metadata(path).map_err(|error| FileError::Read {
        path: path.to_owned(),
        error,
    })
}

fn effective_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// A private key (or a directory of them): owned by us, no access for group or others.
pub fn check_private(path: &Path) -> Result<(), FileError> {
    check_private_metadata(path, &metadata(path)?)
}

/// [`check_private`] on metadata already read (of an open file: no second lookup of the path).
fn check_private_metadata(path: &Path, meta: &fs::Metadata) -> Result<(), FileError> {
    let mode = meta.permissions().mode() & 0o7777;
    if meta.uid() != effective_uid() {
        return Err(FileError::WrongOwner {
            path: path.to_owned(),
            owner: meta.uid(),
            expected: effective_uid(),
        });
    }
    if mode & 0o077 != 0 {
        let fix = if meta.is_dir() { 0o700 } else { 0o600 };
        return Err(FileError::Insecure {
            path: path.to_owned(),
            mode,
            what: "a private key",
            who: "accessible by group or others",
            fix,
        });
    }
    Ok(())
}

/// A file that steers trust: owned by us or root, not writable by group or others.
pub fn check_trusted(path: &Path) -> Result<(), FileError> {
    let meta = metadata(path)?;
    let mode = meta.permissions().mode() & 0o7777;
    if meta.uid() != effective_uid() && meta.uid() != 0 {
        return Err(FileError::WrongOwner {
            path: path.to_owned(),
            owner: meta.uid(),
            expected: effective_uid(),
        });
    }
    if mode & 0o022 != 0 {
        return Err(FileError::Insecure {
            path: path.to_owned(),
            mode,
            what: "a trusted file",
            who: "writable by group or others",
            fix: mode & !0o022,
        });
    }
    Ok(())
}

/// Reads a private key after [`check_private`].
pub fn read_private(path: &Path) -> Result<zeroize::Zeroizing<String>, FileError> {
    check_private(path)?;
    fs::read_to_string(path)
        .map(zeroize::Zeroizing::new)
        .map_err(|error| FileError::Read {
            path: path.to_owned(),
            error,
        })
}

/// The most a secret file may hold: a password or an API token's secret is one short line.
pub const MAX_SECRET_LINE_BYTES: usize = 4096;

/// Reads a secret kept in a file: opened once (without waiting on a FIFO), then, on what was
/// opened, checked as [`check_private`] checks a path (owned by us, closed to group and others)
/// and to be a regular file; at most [`MAX_SECRET_LINE_BYTES`] are read, and the first line
/// (as `PBS_PASSWORD_FILE` is read) must not be empty. `what` names the secret in refusals
/// ("the PBS password or API-token secret"). Everything read is zeroized when dropped; the
/// line is handed over zeroizing.
pub fn read_secret_line(path: &Path, what: &str) -> Result<zeroize::Zeroizing<String>, FileError> {
    use std::io::Read;
    let read_error = |error| FileError::Read {
        path: path.to_owned(),
        error,
    };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)
        .map_err(read_error)?;
    let meta = file.metadata().map_err(read_error)?;
    if !meta.is_file() {
        return Err(FileError::Content {
            path: path.to_owned(),
            reason: format!("is not a regular file; write {what} in a file"),
        });
    }
    check_private_metadata(path, &meta)?;
    let mut bytes = zeroize::Zeroizing::new(Vec::with_capacity(MAX_SECRET_LINE_BYTES + 1));
    file.take(MAX_SECRET_LINE_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() > MAX_SECRET_LINE_BYTES {
        return Err(FileError::Content {
            path: path.to_owned(),
            reason: format!(
                "holds more than {MAX_SECRET_LINE_BYTES} bytes; {what} is one line of at most {MAX_SECRET_LINE_BYTES} bytes"
            ),
        });
    }
    let text = std::str::from_utf8(&bytes).map_err(|_| FileError::Content {
        path: path.to_owned(),
        reason: format!("is not UTF-8 text; write {what} as text"),
    })?;
    let first = text.lines().next().unwrap_or_default();
    if first.is_empty() {
        return Err(FileError::Content {
            path: path.to_owned(),
            reason: format!("is empty; write {what} on its first line"),
        });
    }
    Ok(zeroize::Zeroizing::new(first.to_owned()))
}

/// Reads a trusted file after [`check_trusted`].
pub fn read_trusted(path: &Path) -> Result<String, FileError> {
    check_trusted(path)?;
    fs::read_to_string(path).map_err(|error| FileError::Read {
        path: path.to_owned(),
        error,
    })
}

/// Creates a directory (and missing parents) with mode 0700; an existing one must be private.
pub fn create_private_dir(path: &Path) -> Result<(), FileError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .map_err(|error| FileError::Write {
            path: path.to_owned(),
            error,
        })?;
    check_private(path)
}

/// Writes a new file with `mode`, refusing to replace an existing one, and syncs it and its directory.
pub fn write_new(path: &Path, contents: &[u8], mode: u32) -> Result<(), FileError> {
    write_new_without_dir_sync(path, contents, mode)?;
    sync_parent(path)
}

/// [`write_new`] without the sync of the directory: for a caller that creates several entries
/// in one directory and syncs it once after the last.
pub fn write_new_without_dir_sync(
    path: &Path,
    contents: &[u8],
    mode: u32,
) -> Result<(), FileError> {
    let err = |error: std::io::Error| {
        if error.kind() == std::io::ErrorKind::AlreadyExists {
            FileError::Exists {
                path: path.to_owned(),
            }
        } else {
            FileError::Write {
                path: path.to_owned(),
                error,
            }
        }
    };
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(err)?;
    file.write_all(contents).map_err(err)?;
    file.sync_all().map_err(err)
}

/// Replaces `path` atomically: temporary file, fsync, rename, fsync of the directory.
pub fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> Result<(), FileError> {
    replace(path, contents, mode, true)?;
    sync_parent(path)
}

/// Replaces `path` atomically for readers (temporary file, rename) without syncing anything:
/// for files rebuilt from a synced source after a crash.
pub fn replace_without_sync(path: &Path, contents: &[u8], mode: u32) -> Result<(), FileError> {
    replace(path, contents, mode, false)
}

/// Writes `contents` to `<path>.tmp` (fsync'd when `sync`) and renames it over `path`.
fn replace(path: &Path, contents: &[u8], mode: u32, sync: bool) -> Result<(), FileError> {
    let err = |error| FileError::Write {
        path: path.to_owned(),
        error,
    };
    let tmp = path.with_extension("tmp");
    let _ = fs::remove_file(&tmp);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    file.write_all(contents).map_err(err)?;
    if sync {
        file.sync_all().map_err(err)?;
    }
    fs::rename(&tmp, path).map_err(err)
}

/// Makes a directory entry change (create, rename) durable.
pub fn sync_parent(path: &Path) -> Result<(), FileError> {
    let parent = path.parent().unwrap_or(Path::new("."));
    File::open(parent)
        .and_then(|dir| dir.sync_all())
        .map_err(|error| FileError::Write {
            path: parent.to_owned(),
            error,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_and_trusted_modes() {
        let dir = std::env::temp_dir().join(format!("certistack-files-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        create_private_dir(&dir).unwrap();
        let key = dir.join("key.pem");
        write_new(&key, b"secret", 0o600).unwrap();
        assert!(check_private(&key).is_ok());
        assert!(matches!(
            write_new(&key, b"again", 0o600),
            Err(FileError::Exists { .. })
        ));
        fs::set_permissions(&key, fs::Permissions::from_mode(0o640)).unwrap();
        let err = check_private(&key).unwrap_err().to_string();
        assert!(err.contains("chmod 0600"), "{err}");
        let ca = dir.join("ca.pem");
        write_atomic(&ca, b"cert", 0o644).unwrap();
        assert!(check_trusted(&ca).is_ok());
        fs::set_permissions(&ca, fs::Permissions::from_mode(0o666)).unwrap();
        assert!(check_trusted(&ca).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_secret_is_the_first_line_of_a_small_private_regular_file() {
        let dir = std::env::temp_dir().join(format!("certistack-secret-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        create_private_dir(&dir).unwrap();
        let secret = dir.join("secret");
        write_new(&secret, b"0b1e5c1e\r\nsecond line\n", 0o600).unwrap();
        assert_eq!(
            read_secret_line(&secret, "the secret").unwrap().as_str(),
            "0b1e5c1e"
        );
        fs::set_permissions(&secret, fs::Permissions::from_mode(0o644)).unwrap();
        let error = read_secret_line(&secret, "the secret")
            .unwrap_err()
            .to_string();
        assert!(error.contains("chmod 0600"), "{error}");
        // Too large: refused after reading no more than the bound.
        let large = dir.join("large");
        write_new(&large, &vec![b'x'; MAX_SECRET_LINE_BYTES + 1], 0o600).unwrap();
        let error = read_secret_line(&large, "the secret")
            .unwrap_err()
            .to_string();
        assert!(error.contains("more than 4096 bytes"), "{error}");
        let empty = dir.join("empty");
        write_new(&empty, b"\n", 0o600).unwrap();
        let error = read_secret_line(&empty, "the secret")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("is empty; write the secret on its first line"),
            "{error}"
        );
        // A FIFO is refused at once instead of waiting for a writer.
        let fifo = dir.join("fifo");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        let error = read_secret_line(&fifo, "the secret")
            .unwrap_err()
            .to_string();
        assert!(error.contains("is not a regular file"), "{error}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
