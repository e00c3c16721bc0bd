//! Secrets handed to a tool through an inherited descriptor: a pipe the child reads to EOF, or a
//! sealed memfd it opens as a file; checked and created before the fork.

use std::os::fd::{OwnedFd, RawFd};
use zeroize::Zeroizing;

/// Bytes handed to the child through an inherited descriptor, zeroized after use.
pub struct SecretInput {
    /// The descriptor number the child sees.
    pub child_fd: RawFd,
    pub bytes: Zeroizing<Vec<u8>>,
    pub kind: SecretKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretKind {
    /// A pipe the child reads to EOF (a password).
    Pipe,
    /// A sealed anonymous memory file the child opens as `/proc/self/fd/N` (a key file).
    Memfd,
}

impl std::fmt::Debug for SecretInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SecretInput({:?} on fd {}, {} bytes redacted)",
            self.kind,
            self.child_fd,
            self.bytes.len()
        )
    }
}

/// A descriptor prepared for the child: created close-on-exec, moved to `child_fd` between
/// fork and exec.
pub(super) struct Inherited {
    pub(super) fd: OwnedFd,
    pub(super) child_fd: RawFd,
}

/// Secrets one call may pass: the child-side move list is a fixed array, because the code
/// between fork and exec must not allocate.
pub const MAX_SECRETS: usize = 8;

/// Checks the descriptor numbers the child is to receive before anything is created: at most
/// [`MAX_SECRETS`], none of them 0–2 (stdio), no number twice.
fn check_targets(secrets: &[SecretInput]) -> std::io::Result<()> {
    if secrets.len() > MAX_SECRETS {
        return Err(std::io::Error::other(format!(
            "{} secrets for one call; at most {MAX_SECRETS}",
            secrets.len()
        )));
    }
    let mut seen = std::collections::BTreeSet::new();
    for secret in secrets {
        if secret.child_fd < 3 {
            return Err(std::io::Error::other(format!(
                "descriptor {} is stdio; a secret goes on 3 or above",
                secret.child_fd
            )));
        }
        if !seen.insert(secret.child_fd) {
            return Err(std::io::Error::other(format!(
                "two secrets for descriptor {}",
                secret.child_fd
            )));
        }
    }
    Ok(())
}

/// Checks, then creates, the descriptors for every secret of a call.
pub(super) fn prepare_secrets(secrets: &[SecretInput]) -> std::io::Result<Vec<Inherited>> {
    check_targets(secrets)?;
    secrets.iter().map(prepare_secret).collect()
}

/// Writes all of `bytes` into the pipe, or fails: a password cut short would be a wrong
/// password, and the tool would say only that authentication failed.
pub(super) fn fill_pipe(write: &OwnedFd, bytes: &[u8]) -> std::io::Result<()> {
    // Non-blocking: the only reader is a child not started yet, so a pipe that cannot take the
    // whole secret (a pipe shrunk by fs.pipe-user-pages-soft holds one page) must fail, not hang.
    rustix::fs::fcntl_setfl(write, rustix::fs::OFlags::NONBLOCK)?;
    let mut written = 0;
    while let Some(rest) = bytes.get(written..).filter(|rest| !rest.is_empty()) {
        match rustix::io::write(write, rest) {
            Ok(0) => return Err(std::io::Error::from(std::io::ErrorKind::WriteZero)),
            Ok(n) => written += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => {
                return Err(std::io::Error::other(format!(
                    "the pipe took {written} of the secret's {} bytes",
                    bytes.len()
                )));
            }
            Err(error) => return Err(error.into()),
        }
    }
    Ok(())
}

fn prepare_secret(secret: &SecretInput) -> std::io::Result<Inherited> {
    let fd = match secret.kind {
        SecretKind::Pipe => {
            let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
            fill_pipe(&write, &secret.bytes)?;
            // Closed before the child starts, so the child reads to EOF.
            drop(write);
            read
        }
        SecretKind::Memfd => {
            use rustix::fs::{MemfdFlags, SealFlags};
            let fd = rustix::fs::memfd_create(
                "certistack-key",
                MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
            )?;
            let mut written = 0;
            while let Some(rest) = secret.bytes.get(written..).filter(|rest| !rest.is_empty()) {
                match rustix::io::write(&fd, rest) {
                    Ok(0) => return Err(std::io::Error::from(std::io::ErrorKind::WriteZero)),
                    Ok(n) => written += n,
                    Err(rustix::io::Errno::INTR) => {}
                    Err(error) => return Err(error.into()),
                }
            }
            rustix::fs::fcntl_add_seals(
                &fd,
                SealFlags::WRITE | SealFlags::GROW | SealFlags::SHRINK | SealFlags::SEAL,
            )?;
            fd
        }
    };
    Ok(Inherited {
        fd,
        child_fd: secret.child_fd,
    })
}
