//! The evidence report: what one validation did, signed by the controller.
//!
//! A report is a DSSE envelope (`payloadType` `application/vnd.in-toto+json`) whose payload is an
//! in-toto Statement v1. Its subjects are the snapshot and its archives; its predicate
//! ([`Validation`], type [`PREDICATE_TYPE`]) holds the run's steps, guest facts, probes,
//! isolation evidence, assertions, cleanup, the node's journal records and the verdict. The
//! signature is Ed25519 by the report-signing key over the DSSE pre-authentication encoding
//! ([`pae`]), so anyone holding the public key verifies a report with standard tools.
//!
//! The node's evidence is unsigned; the controller vouches for it by signing, and for the
//! journal it vouches only for what it recomputed: [`verify`] rebuilds the hash chain from the
//! records inside the report and requires its head to be the one recorded.

mod describe;
mod envelope;
mod schema;
mod statement;
#[cfg(test)]
mod tests;

pub use describe::describe;
pub use envelope::*;
pub use schema::*;
pub use statement::*;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use certistack_core::files::{self, FileError};
use certistack_core::journal;
use certistack_core::validate::{NodeName, RunId, Validated};
use certistack_proto::v1 as pb;
use ed25519_dalek::pkcs8::{DecodePublicKey, EncodePublicKey};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use time::OffsetDateTime;

pub const PAYLOAD_TYPE: &str = "application/vnd.in-toto+json";
pub const STATEMENT_TYPE: &str = "https://in-toto.io/Statement/v1";
pub const PREDICATE_TYPE: &str = "https://certistack.dev/validation/v1";
/// A report larger than this is refused unread: a real one is a few hundred KiB at most
/// (the journal is capped by the node's `limits.max_journal_bytes`).
pub const MAX_REPORT_BYTES: u64 = 64 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error("{path} is {size} bytes; a report is at most {MAX_REPORT_BYTES} bytes")]
    TooLarge { path: PathBuf, size: u64 },
    #[error("the report is not a DSSE envelope: {0}")]
    Envelope(String),
    #[error("the envelope's payloadType is {0:?}; a report's is {PAYLOAD_TYPE:?}")]
    PayloadType(String),
    #[error("the envelope carries {0} signatures; a report carries exactly one")]
    SignatureCount(usize),
    #[error(
        "the signature's keyid is {found:?} but the key given is {expected:?}: verify with the report-signing key of the controller that wrote it"
    )]
    KeyId { found: String, expected: String },
    #[error("the signature does not verify with the report-signing key: the report was altered")]
    Signature,
    #[error("the payload is not an in-toto Statement v1 of this predicate: {0}")]
    Statement(String),
    #[error("the journal inside the report does not verify: {0}")]
    Journal(String),
    #[error("the public key {path}: {reason}")]
    Key { path: PathBuf, reason: String },
    #[error("cannot encode the report: {0}")]
    Encode(String),
    #[error(
        "the screenshot {path} has SHA-256 {found}; the report signed {expected}: the image was replaced"
    )]
    Screenshot {
        path: PathBuf,
        found: String,
        expected: String,
    },
    #[error("cannot name the report file: {0}")]
    Name(String),
}
