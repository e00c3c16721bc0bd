//! The PBS secrets of a run: read once from their permission-checked files, held only in
//! memory, zeroized when dropped.

use crate::plan::Plan;
use certistack_core::files;
use zeroize::Zeroizing;

/// The most an encryption key file may hold (PBS key files are a few hundred bytes of JSON).
const MAX_KEY_BYTES: usize = 64 * 1024;

/// The PBS credential and optional encryption key, read from their permission-checked files and
/// held only in memory; each reaches a node only inside the `MapBackup` that needs it.
pub struct Secrets {
    pub(super) pbs_secret: Zeroizing<String>,
    pub(super) encryption_key: Option<Zeroizing<Vec<u8>>>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secrets { .. }")
    }
}

/// Why the secret files cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error(transparent)]
    File(#[from] files::FileError),
    #[error("{0}")]
    Invalid(String),
}

impl Secrets {
    /// Reads the plan's secret files. The password is the file's first line, as
    /// `PBS_PASSWORD_FILE` reads it.
    pub fn load(plan: &Plan) -> Result<Self, SecretError> {
        let pbs_secret = files::read_secret_line(
            &plan.pbs_password_file,
            "the PBS password or API-token secret",
        )?;
        let encryption_key = match &plan.encryption_key_file {
            None => None,
            Some(path) => {
                let key = files::read_private(path)?;
                if key.len() > MAX_KEY_BYTES {
                    return Err(SecretError::Invalid(format!(
                        "{} holds {} bytes; a PBS encryption key file is at most {MAX_KEY_BYTES}",
                        path.display(),
                        key.len()
                    )));
                }
                Some(Zeroizing::new(key.as_bytes().to_vec()))
            }
        };
        Ok(Self {
            pbs_secret,
            encryption_key,
        })
    }
}
