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

/// The DSSE pre-authentication encoding: `"DSSEv1" SP len(type) SP type SP len(body) SP body`,
/// lengths as ASCII decimal byte counts. This is what is signed, never the JSON around it.
pub fn pae(payload_type: &str, payload: &[u8]) -> Vec<u8> {
    let mut encoded = Vec::with_capacity(payload_type.len() + payload.len() + 32);
    encoded.extend_from_slice(b"DSSEv1 ");
    encoded.extend_from_slice(payload_type.len().to_string().as_bytes());
    encoded.push(b' ');
    encoded.extend_from_slice(payload_type.as_bytes());
    encoded.push(b' ');
    encoded.extend_from_slice(payload.len().to_string().as_bytes());
    encoded.push(b' ');
    encoded.extend_from_slice(payload);
    encoded
}

/// The key id a signature names: `sha256:` and the hex SHA-256 of the public key's
/// SubjectPublicKeyInfo DER (the bytes of the `.pub` PEM file's body).
pub fn key_id(key: &VerifyingKey) -> Result<String, ReportError> {
    let der = key
        .to_public_key_der()
        .map_err(|e| ReportError::Encode(e.to_string()))?;
    Ok(format!(
        "sha256:{}",
        hex::encode(Sha256::digest(der.as_bytes()))
    ))
}

/// Reads a report-signing public key (PEM SubjectPublicKeyInfo, as `ca init` writes it).
pub fn load_public_key(path: &Path) -> Result<VerifyingKey, ReportError> {
    let pem = files::read_trusted(path)?;
    VerifyingKey::from_public_key_pem(&pem).map_err(|e| ReportError::Key {
        path: path.to_owned(),
        reason: format!("not an Ed25519 public key in PEM: {e}"),
    })
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Envelope {
    /// The statement's JSON, standard base64 with padding.
    pub payload: String,
    #[serde(rename = "payloadType")]
    pub payload_type: String,
    pub signatures: Vec<EnvelopeSignature>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvelopeSignature {
    pub keyid: String,
    /// The Ed25519 signature over [`pae`], standard base64 with padding.
    pub sig: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Statement {
    #[serde(rename = "_type")]
    pub statement_type: String,
    pub subject: Vec<Subject>,
    #[serde(rename = "predicateType")]
    pub predicate_type: String,
    pub predicate: Validation,
}

/// An in-toto ResourceDescriptor: the snapshot or one archive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Subject {
    pub name: String,
    /// Where it lives: `pbs://<server>:<port>/<datastore>[/<namespace>]/<snapshot>[/<archive>]`.
    pub uri: String,
    /// Algorithm → lower-case hex; empty while the node does not report the digest.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub digest: BTreeMap<String, String>,
}

/// The predicate: everything the controller observed of one validation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Validation {
    pub run_id: String,
    /// The validation's name in the plan.
    pub name: String,
    /// `sha256:<hex>` of the plan file's bytes.
    pub plan_digest: String,
    pub node: String,
    pub connector: ConnectorVersion,
    pub controller_version: String,
    pub snapshot: Snapshot,
    pub steps: Vec<Step>,
    pub guest: GuestFacts,
    pub probes: Vec<ProbeResult>,
    pub isolation: Isolation,
    pub assertions: Vec<AssertionResult>,
    pub cleanup: CleanupEvidence,
    pub journal: JournalEvidence,
    pub verdict: Verdict,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub screenshot: Option<Screenshot>,
    /// The source VM's hardware the sandbox mirrored, as the node read it from the snapshot's
    /// `qemu-server.conf`, and what it left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<SandboxHardware>,
}

/// The sandbox VM's hardware, mirrored from the source VM's config.
/// The archive PVE's backup gives a VM's EFI vars disk (`efidisk0`).
pub const EFIDISK_ARCHIVE: &str = "drive-efidisk0.img";

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxHardware {
    /// Lower-case hex SHA-256 of the config as the node read it.
    pub config_sha256: String,
    /// Empty where the source sets nothing (PVE's default applies to both).
    pub cpu: String,
    pub bios: String,
    pub machine: String,
    pub ostype: String,
    pub scsihw: String,
    /// `<slot>=<archive>` for disks, `<slot>=cdrom (empty)` for CD-ROM drives.
    pub disks: Vec<String>,
    /// `efitype=4m,pre-enrolled-keys=1`, or empty without an EFI vars disk.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub efidisk: String,
    /// `net<N>=<model>`: on the run's VNet, fresh MAC, firewall off.
    pub nics: Vec<String>,
    pub boot_order: Vec<String>,
    /// Every part of the source config the sandbox did not get, `<key>: <reason>`.
    pub omitted: Vec<String>,
}

impl SandboxHardware {
    /// What the sandbox got of the source's hardware when created with the overlays of
    /// `archives`: the source's disks and EFI vars disk whose archives the run does not
    /// restore are not attached, so they are listed as omitted (with what to change), and the
    /// boot order keeps only devices the sandbox has, as the node builds it.
    pub fn from_wire(
        hardware: &pb::SourceHardware,
        config_sha256: &str,
        archives: &[String],
    ) -> Self {
        let restored = |archive: &str| archives.iter().any(|a| a == archive);
        let mut omitted: Vec<String> = hardware
            .omitted
            .iter()
            .map(|o| format!("{}: {}", o.key, o.reason))
            .collect();
        let mut present: Vec<&str> = Vec::new();
        let mut disks = Vec::new();
        for disk in &hardware.disks {
            if disk.cdrom {
                disks.push(format!("{}=cdrom (empty)", disk.slot));
            } else if restored(&disk.archive) {
                disks.push(format!("{}={}", disk.slot, disk.archive));
            } else {
                omitted.push(format!(
                    "{}: its archive {} is not among the plan's archives; add it to restore this disk",
                    disk.slot, disk.archive
                ));
                continue;
            }
            present.push(&disk.slot);
        }
        let efidisk_restored = restored(EFIDISK_ARCHIVE);
        if hardware.efidisk && !efidisk_restored {
            omitted.push(format!(
                "efidisk0: its archive {EFIDISK_ARCHIVE} is not among the plan's archives, so the \
                 firmware starts with empty EFI variables (boot entries and Secure Boot keys of \
                 the source are missing); add it to the plan's archives"
            ));
        }
        let nics: Vec<String> = hardware
            .nics
            .iter()
            .map(|n| format!("net{}={}", n.index, n.model))
            .collect();
        let nic_keys: Vec<String> = hardware
            .nics
            .iter()
            .map(|n| format!("net{}", n.index))
            .collect();
        SandboxHardware {
            config_sha256: config_sha256.to_owned(),
            cpu: hardware.cpu.clone(),
            bios: hardware.bios.clone(),
            machine: hardware.machine.clone(),
            ostype: hardware.ostype.clone(),
            scsihw: hardware.scsihw.clone(),
            disks,
            efidisk: if hardware.efidisk && efidisk_restored {
                format!(
                    "efitype={},pre-enrolled-keys={}",
                    hardware.efitype,
                    u8::from(hardware.pre_enrolled_keys)
                )
            } else {
                String::new()
            },
            nics,
            boot_order: hardware
                .boot_order
                .iter()
                .filter(|key| present.contains(&key.as_str()) || nic_keys.contains(key))
                .cloned()
                .collect(),
            omitted,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectorVersion {
    pub version: String,
    pub surface_digest: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// The PBS server's host name or address.
    pub server: String,
    pub port: u16,
    pub datastore: String,
    /// Empty for the datastore's root namespace.
    pub namespace: String,
    /// `<type>/<id>/<time>`, e.g. `vm/100/2026-11-30T01:00:00Z`.
    pub snapshot: String,
    pub archives: Vec<Archive>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Archive {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepResult {
    Ok,
    Failed,
    Skipped,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    /// e.g. `map`, `overlay`, `create`, `start`, `guest-agent`, `probes`, `cleanup`.
    pub name: String,
    pub started_unix_ms: i64,
    pub ended_unix_ms: i64,
    pub result: StepResult,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

/// What QMP and the guest agent said about the guest, as they said it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestFacts {
    /// QMP `query-status` `status`, e.g. `running`.
    pub status: String,
    /// QGA `guest-get-osinfo` result.
    pub os_info: serde_json::Value,
    /// QGA `guest-network-get-interfaces` result.
    pub interfaces: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeResult {
    /// `tcp://10.0.0.5:22`, `https://10.0.0.5/`.
    pub target: String,
    pub expected: String,
    /// The node's outcome, e.g. `CONNECTED`, `REFUSED`, `TIMEOUT`.
    pub outcome: String,
    /// Where the probe ran from, e.g. `worker_host` on the VNet.
    pub origin: String,
    pub passed: bool,
    pub latency_us: u64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// Lower-case hex SHA-256 of what the target sent (a banner, an HTTP body), when the node
    /// reported it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub received_sha256: String,
    /// The SHA-256 of the certificate an HTTPS target presented, when it did.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tls_certificate_sha256: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Isolation {
    /// The interfaces enslaved to the VNet bridge when the sandbox was prepared (only taps of
    /// the run's sandbox VMs are admitted).
    pub bridge_ports: Vec<String>,
    /// The addresses on the VNet bridge: only the run's probe address.
    pub bridge_addresses: Vec<String>,
    /// `net.ipv4.ip_forward` and the bridge's forwarding sysctls as read on the node.
    pub forwarding: BTreeMap<String, String>,
    /// The sandbox's nftables ruleset as listed on the node.
    pub ruleset: String,
    /// `sha256:<hex>` of `ruleset`.
    pub ruleset_digest: String,
    /// Which firewall listings the node's NAT check read (nftables, iptables-legacy), or why
    /// one was skipped (`... not installed`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nat_sources: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AssertionResult {
    pub name: String,
    pub exit_code: i32,
    pub passed: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CleanupEvidence {
    pub receipts: Vec<Receipt>,
    /// What the node still held for the run after cleanup; empty when nothing was left.
    pub residue: Vec<String>,
    /// Whether cleanup was proven complete (every receipt closed, no residue).
    pub complete: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Receipt {
    pub resource: String,
    pub end_state: String,
}

/// The node's journal for the run, as streamed by `ReadJournal`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JournalEvidence {
    /// The head the controller computed from `records` (the genesis when there are none).
    pub head_sha256: String,
    pub records: Vec<JournalRecord>,
}

/// One `JournalRecord` exactly as the wire carries it (see the protocol's "Records on the wire").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JournalRecord {
    pub sequence: u64,
    pub time_unix_ms: i64,
    pub operation: String,
    pub resource: String,
    pub phase: String,
    pub previous_sha256: String,
    pub record_sha256: String,
    /// The entry's `detail` as canonical compact JSON; empty when it has none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

impl From<&certistack_proto::v1::JournalRecord> for JournalRecord {
    fn from(record: &certistack_proto::v1::JournalRecord) -> Self {
        Self {
            sequence: record.sequence,
            time_unix_ms: record.time_unix_ms,
            operation: record.operation.clone(),
            resource: record.resource.clone(),
            phase: record.phase.clone(),
            previous_sha256: record.previous_sha256.clone(),
            record_sha256: record.record_sha256.clone(),
            detail: record.detail.clone(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "lowercase", deny_unknown_fields)]
pub enum Verdict {
    /// The backup restored: every check held.
    Passed,
    /// The backup did not restore: a probe, an assertion or the guest's state says why.
    Failed { reasons: Vec<String> },
    /// Nothing was proven about the backup: the node, the connection, the deadline or the
    /// operator (an interruption) stopped the validation, or its cleanup is unproven.
    Error { reasons: Vec<String> },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Screenshot {
    /// The PNG's file name, in the reports directory beside the report.
    pub file: String,
    pub sha256: String,
}

/// The on-disk line of one streamed record: the entry bytes rebuilt as the protocol documents.
fn journal_line(record: &JournalRecord) -> Result<String, String> {
    let string = |value: &str| {
        serde_json::to_string(value).map_err(|e| format!("record {}: {e}", record.sequence))
    };
    let mut entry = format!(
        "{{\"seq\":{},\"time_ms\":{},\"op\":{},\"resource\":{},\"phase\":{}",
        record.sequence,
        record.time_unix_ms,
        string(&record.operation)?,
        string(&record.resource)?,
        string(&record.phase)?,
    );
    if !record.detail.is_empty() {
        entry.push_str(",\"detail\":");
        entry.push_str(&record.detail);
    }
    entry.push('}');
    Ok(format!(
        "{} {} {entry}\n",
        record.record_sha256, record.previous_sha256
    ))
}

/// Recomputes the journal chain of `run_id` from `records` with the connector's own reader and
/// returns its head (hex).
pub fn recompute_journal_head(run_id: &str, records: &[JournalRecord]) -> Result<String, String> {
    let mut text = String::new();
    for record in records {
        text.push_str(&journal_line(record)?);
    }
    let longest = text.lines().map(str::len).max().unwrap_or(0) as u64;
    let mut reader = journal::Reader::new(
        text.as_bytes(),
        Path::new("report journal"),
        run_id,
        longest + 1,
    );
    for record in reader.by_ref() {
        record.map_err(|e| e.to_string())?;
    }
    if let Some(torn) = reader.torn() {
        return Err(format!(
            "record {} does not verify ({})",
            reader.records_read() + 1,
            torn.reason
        ));
    }
    if reader.records_read() != records.len() as u64 {
        return Err(format!(
            "{} of {} records verify",
            reader.records_read(),
            records.len()
        ));
    }
    Ok(hex::encode(reader.head()))
}

impl Statement {
    /// A statement for `validation`, naming its snapshot and archives as subjects.
    pub fn new(validation: Validation) -> Self {
        Self {
            statement_type: STATEMENT_TYPE.to_owned(),
            subject: subjects(&validation.snapshot),
            predicate_type: PREDICATE_TYPE.to_owned(),
            predicate: validation,
        }
    }

    /// Checks what the signature alone does not: the statement's shape, that its subjects are
    /// its snapshot, that the verdict is well-formed, and that the journal recomputes.
    pub fn check(&self) -> Result<(), ReportError> {
        let shape = |m: String| Err(ReportError::Statement(m));
        if self.statement_type != STATEMENT_TYPE {
            return shape(format!(
                "_type is {:?}, expected {STATEMENT_TYPE:?}",
                self.statement_type
            ));
        }
        if self.predicate_type != PREDICATE_TYPE {
            return shape(format!(
                "predicateType is {:?}, expected {PREDICATE_TYPE:?}",
                self.predicate_type
            ));
        }
        let predicate = &self.predicate;
        if self.subject != subjects(&predicate.snapshot) {
            return shape("the subjects are not the predicate's snapshot and archives".into());
        }
        if let Err(reason) = RunId::validate(&predicate.run_id) {
            return shape(format!("run_id: {reason}"));
        }
        if let Verdict::Failed { reasons } | Verdict::Error { reasons } = &predicate.verdict
            && reasons.is_empty()
        {
            return shape("a failed or error verdict gives no reason".into());
        }
        if predicate.verdict == Verdict::Passed && predicate.journal.records.is_empty() {
            return shape(
                "a passed verdict carries no journal record: nothing shows what the node did"
                    .into(),
            );
        }
        if predicate.isolation.ruleset_digest != sha256_text(predicate.isolation.ruleset.as_bytes())
        {
            return shape("isolation.ruleset_digest is not the digest of isolation.ruleset".into());
        }
        if let Some(shot) = &predicate.screenshot
            && (shot.file.is_empty() || shot.file.contains('/') || shot.file.starts_with('.'))
        {
            return shape(format!(
                "screenshot.file {:?} is not a file name beside the report",
                shot.file
            ));
        }
        let head = recompute_journal_head(&predicate.run_id, &predicate.journal.records)
            .map_err(ReportError::Journal)?;
        if head != predicate.journal.head_sha256 {
            return Err(ReportError::Journal(format!(
                "the records end at {head}, the report says {}",
                predicate.journal.head_sha256
            )));
        }
        Ok(())
    }
}

/// `sha256:<hex>`, the form digests of texts take in the predicate.
pub fn sha256_text(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// What the screenshot beside a report says about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScreenshotCheck {
    /// The report names none.
    NotTaken,
    /// The file is not beside the report (it may have been sent without it).
    Absent(PathBuf),
    Matches(PathBuf),
}

/// Checks the screenshot a verified report names against the file beside `report_path`: a file
/// whose SHA-256 differs makes the report invalid.
pub fn check_screenshot(
    statement: &Statement,
    report_path: &Path,
) -> Result<ScreenshotCheck, ReportError> {
    let Some(shot) = &statement.predicate.screenshot else {
        return Ok(ScreenshotCheck::NotTaken);
    };
    let path = report_path
        .parent()
        .unwrap_or(Path::new("."))
        .join(&shot.file);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Ok(ScreenshotCheck::Absent(path));
        }
        Err(error) => return Err(FileError::Read { path, error }.into()),
    };
    let found = hex::encode(Sha256::digest(&bytes));
    if found != shot.sha256 {
        return Err(ReportError::Screenshot {
            path,
            found,
            expected: shot.sha256.clone(),
        });
    }
    Ok(ScreenshotCheck::Matches(path))
}

fn subjects(snapshot: &Snapshot) -> Vec<Subject> {
    let mut base = format!(
        "pbs://{}:{}/{}",
        snapshot.server, snapshot.port, snapshot.datastore
    );
    if !snapshot.namespace.is_empty() {
        base = format!("{base}/{}", snapshot.namespace);
    }
    base = format!("{base}/{}", snapshot.snapshot);
    let mut subjects = vec![Subject {
        name: snapshot.snapshot.clone(),
        uri: base.clone(),
        digest: BTreeMap::new(),
    }];
    subjects.extend(snapshot.archives.iter().map(|archive| {
        Subject {
            name: archive.name.clone(),
            uri: format!("{base}/{}", archive.name),
            digest: archive
                .sha256
                .iter()
                .map(|digest| ("sha256".to_owned(), digest.clone()))
                .collect(),
        }
    }));
    subjects
}

/// Signs `statement` with the report-signing key.
pub fn sign(statement: &Statement, key: &SigningKey) -> Result<Envelope, ReportError> {
    let payload = serde_json::to_vec(statement).map_err(|e| ReportError::Encode(e.to_string()))?;
    let signature = key.sign(&pae(PAYLOAD_TYPE, &payload));
    Ok(Envelope {
        payload: BASE64.encode(&payload),
        payload_type: PAYLOAD_TYPE.to_owned(),
        signatures: vec![EnvelopeSignature {
            keyid: key_id(&key.verifying_key())?,
            sig: BASE64.encode(signature.to_bytes()),
        }],
    })
}

/// Verifies a report's bytes with `key`: envelope, key id, signature, statement, journal.
pub fn verify(bytes: &[u8], key: &VerifyingKey) -> Result<Statement, ReportError> {
    let envelope: Envelope =
        serde_json::from_slice(bytes).map_err(|e| ReportError::Envelope(e.to_string()))?;
    if envelope.payload_type != PAYLOAD_TYPE {
        return Err(ReportError::PayloadType(envelope.payload_type));
    }
    let [signature] = envelope.signatures.as_slice() else {
        return Err(ReportError::SignatureCount(envelope.signatures.len()));
    };
    let expected = key_id(key)?;
    if signature.keyid != expected {
        return Err(ReportError::KeyId {
            found: signature.keyid.clone(),
            expected,
        });
    }
    let payload = BASE64
        .decode(&envelope.payload)
        .map_err(|e| ReportError::Envelope(format!("payload: {e}")))?;
    let sig = BASE64
        .decode(&signature.sig)
        .map_err(|e| ReportError::Envelope(format!("sig: {e}")))?;
    let sig = Signature::from_slice(&sig).map_err(|_| ReportError::Signature)?;
    key.verify_strict(&pae(&envelope.payload_type, &payload), &sig)
        .map_err(|_| ReportError::Signature)?;
    let statement: Statement =
        serde_json::from_slice(&payload).map_err(|e| ReportError::Statement(e.to_string()))?;
    statement.check()?;
    Ok(statement)
}

/// Reads a report file, refusing one over [`MAX_REPORT_BYTES`].
pub fn read(path: &Path) -> Result<Vec<u8>, ReportError> {
    use std::io::Read;
    let read_error = |error| FileError::Read {
        path: path.to_owned(),
        error,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let mut bytes = Vec::new();
    file.take(MAX_REPORT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() as u64 > MAX_REPORT_BYTES {
        return Err(ReportError::TooLarge {
            path: path.to_owned(),
            size: bytes.len() as u64,
        });
    }
    Ok(bytes)
}

/// `<UTC time>-<node>-<run id>.json`, the time as `YYYYMMDDTHHMMSSZ`.
pub fn file_name(at: OffsetDateTime, node: &str, run_id: &str) -> Result<String, ReportError> {
    NodeName::validate(node).map_err(|e| ReportError::Name(format!("node {node:?}: {e}")))?;
    RunId::validate(run_id).map_err(|e| ReportError::Name(format!("run id {run_id:?}: {e}")))?;
    let at = at.to_offset(time::UtcOffset::UTC);
    Ok(format!(
        "{:04}{:02}{:02}T{:02}{:02}{:02}Z-{node}-{run_id}.json",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second()
    ))
}

/// Signs `statement` and writes it into `reports_dir` (created 0700 when missing) atomically:
/// temporary file, fsync, rename, fsync of the directory; the report is 0600. Returns its path.
pub fn write(
    reports_dir: &Path,
    statement: &Statement,
    key: &SigningKey,
    at: OffsetDateTime,
) -> Result<PathBuf, ReportError> {
    let predicate = &statement.predicate;
    let path = reports_dir.join(file_name(at, &predicate.node, &predicate.run_id)?);
    let mut bytes = serde_json::to_vec(&sign(statement, key)?)
        .map_err(|e| ReportError::Encode(e.to_string()))?;
    bytes.push(b'\n');
    files::create_private_dir(reports_dir)?;
    files::write_atomic(&path, &bytes, 0o600)?;
    Ok(path)
}

/// The report for a person: verdict first, then what was validated and how.
pub fn describe(statement: &Statement, report_path: &Path) -> String {
    use std::fmt::Write;
    let p = &statement.predicate;
    let mut out = String::new();
    let verdict = match &p.verdict {
        Verdict::Passed => "passed".to_owned(),
        Verdict::Failed { reasons } => format!("FAILED: {}", reasons.join("; ")),
        Verdict::Error { reasons } => format!("ERROR (nothing proven): {}", reasons.join("; ")),
    };
    let _ = writeln!(out, "verdict: {verdict}");
    let _ = writeln!(out, "run: {}", p.run_id);
    let _ = writeln!(
        out,
        "node: {} (connector {}, surface {})",
        p.node, p.connector.version, p.connector.surface_digest
    );
    let _ = writeln!(out, "controller: {}", p.controller_version);
    let _ = writeln!(out, "plan: {}", p.plan_digest);
    let _ = writeln!(
        out,
        "snapshot: {} on {}:{} datastore {} namespace {:?}",
        p.snapshot.snapshot,
        p.snapshot.server,
        p.snapshot.port,
        p.snapshot.datastore,
        p.snapshot.namespace
    );
    for archive in &p.snapshot.archives {
        let digest = archive.sha256.as_deref().unwrap_or("digest not reported");
        let _ = writeln!(out, "  archive: {} ({digest})", archive.name);
    }
    let _ = writeln!(out, "steps:");
    for step in &p.steps {
        let result = match step.result {
            StepResult::Ok => "ok",
            StepResult::Failed => "FAILED",
            StepResult::Skipped => "skipped",
        };
        let elapsed = step.ended_unix_ms.saturating_sub(step.started_unix_ms);
        let _ = write!(out, "  {:<14} {result:<7} {elapsed} ms", step.name);
        if !step.detail.is_empty() {
            let _ = write!(out, "  {}", step.detail);
        }
        out.push('\n');
    }
    let _ = writeln!(out, "guest: {}", p.guest.status);
    let _ = writeln!(out, "probes:");
    for probe in &p.probes {
        let _ = writeln!(
            out,
            "  {} {} from {} (expected {}): {}",
            probe.target,
            probe.outcome,
            probe.origin,
            probe.expected,
            if probe.passed { "ok" } else { "FAILED" }
        );
    }
    let _ = writeln!(out, "assertions:");
    for assertion in &p.assertions {
        let _ = writeln!(
            out,
            "  {} exit {}: {}",
            assertion.name,
            assertion.exit_code,
            if assertion.passed { "ok" } else { "FAILED" }
        );
    }
    if let Some(hw) = &p.hardware {
        let or_default = |v: &str| {
            if v.is_empty() {
                "default".to_owned()
            } else {
                v.to_owned()
            }
        };
        let _ = writeln!(
            out,
            "hardware: cpu {} bios {}{} machine {} ostype {} scsihw {}; disks [{}]; nics [{}]; boot [{}]",
            or_default(&hw.cpu),
            or_default(&hw.bios),
            if hw.efidisk.is_empty() {
                String::new()
            } else {
                format!(" (efidisk {})", hw.efidisk)
            },
            or_default(&hw.machine),
            or_default(&hw.ostype),
            or_default(&hw.scsihw),
            hw.disks.join(", "),
            hw.nics.join(", "),
            hw.boot_order.join(", ")
        );
        for omitted in &hw.omitted {
            let _ = writeln!(out, "  omitted {omitted}");
        }
    }
    let _ = writeln!(out, "isolation: ruleset {}", p.isolation.ruleset_digest);
    let _ = writeln!(
        out,
        "cleanup: {} ({} resources{})",
        if p.cleanup.complete {
            "complete"
        } else {
            "NOT PROVEN COMPLETE"
        },
        p.cleanup.receipts.len(),
        if p.cleanup.residue.is_empty() {
            String::new()
        } else {
            format!("; residue: {}", p.cleanup.residue.join(", "))
        }
    );
    let _ = writeln!(
        out,
        "journal: {} records, head {} (recomputed)",
        p.journal.records.len(),
        p.journal.head_sha256
    );
    match &p.screenshot {
        Some(shot) => {
            let location = report_path
                .parent()
                .unwrap_or(Path::new("."))
                .join(&shot.file);
            let _ = writeln!(
                out,
                "screenshot: {} (sha256 {})",
                location.display(),
                shot.sha256
            );
        }
        None => {
            let _ = writeln!(out, "screenshot: none");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_core::OsRng;

    const RUN: &str = "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f";

    fn temp_dir(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("certistack-report-{tag}-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Journal records as the node writes and streams them.
    fn journal_records() -> Vec<JournalRecord> {
        let dir = temp_dir("journal");
        let mut journal = journal::Journal::create(&dir, RUN).unwrap();
        journal
            .append(
                1_000,
                "run.begin",
                &format!("run:{RUN}"),
                journal::Phase::Done,
                serde_json::Value::Null,
            )
            .unwrap();
        journal
            .append(
                2_000,
                "vm.start",
                "vm:9100",
                journal::Phase::Failed,
                serde_json::json!({"exit_code": 255, "error": "naïve \"quote\"\n"}),
            )
            .unwrap();
        let records = journal
            .records()
            .iter()
            .map(|r| JournalRecord::from(&r.to_wire()))
            .collect();
        std::fs::remove_dir_all(&dir).unwrap();
        records
    }

    fn validation() -> Validation {
        let records = journal_records();
        Validation {
            run_id: RUN.into(),
            name: "web".into(),
            plan_digest: format!("sha256:{}", "ab".repeat(32)),
            node: "pve1".into(),
            connector: ConnectorVersion {
                version: "0.1.0".into(),
                surface_digest: format!("sha256:{}", "cd".repeat(32)),
            },
            controller_version: "0.1.0".into(),
            snapshot: Snapshot {
                server: "pbs.example".into(),
                port: 8007,
                datastore: "store1".into(),
                namespace: "prod".into(),
                snapshot: "vm/100/2026-11-30T01:00:00Z".into(),
                archives: vec![
                    Archive {
                        name: "drive-scsi0.img.fidx".into(),
                        sha256: Some("ef".repeat(32)),
                    },
                    Archive {
                        name: "drive-scsi1.img.fidx".into(),
                        sha256: None,
                    },
                ],
            },
            steps: vec![Step {
                name: "start".into(),
                started_unix_ms: 1_000,
                ended_unix_ms: 2_500,
                result: StepResult::Ok,
                detail: String::new(),
            }],
            guest: GuestFacts {
                status: "running".into(),
                os_info: serde_json::json!({"id": "debian"}),
                interfaces: serde_json::json!([{"name": "eth0"}]),
            },
            probes: vec![ProbeResult {
                target: "tcp://10.99.0.10:22".into(),
                expected: "open".into(),
                outcome: "CONNECTED".into(),
                origin: "worker_host".into(),
                passed: true,
                latency_us: 420,
                detail: String::new(),
                received_sha256: String::new(),
                tls_certificate_sha256: String::new(),
            }],
            isolation: Isolation {
                bridge_ports: vec!["tap9100i0".into()],
                bridge_addresses: vec!["10.99.0.2/24".into()],
                forwarding: BTreeMap::from([("net.ipv4.ip_forward".into(), "0".into())]),
                ruleset: "table inet certistack {}".into(),
                ruleset_digest: sha256_text(b"table inet certistack {}"),
                nat_sources: Vec::new(),
            },
            assertions: vec![AssertionResult {
                name: "systemd running".into(),
                exit_code: 0,
                passed: true,
                detail: String::new(),
            }],
            cleanup: CleanupEvidence {
                receipts: vec![Receipt {
                    resource: "vm:9100".into(),
                    end_state: "destroyed".into(),
                }],
                residue: vec![],
                complete: true,
            },
            journal: JournalEvidence {
                head_sha256: recompute_journal_head(RUN, &records).unwrap(),
                records,
            },
            verdict: Verdict::Passed,
            screenshot: Some(Screenshot {
                file: "shot.png".into(),
                sha256: "12".repeat(32),
            }),
            hardware: Some(SandboxHardware {
                config_sha256: "ab".repeat(32),
                cpu: "x86-64-v2-AES".into(),
                bios: "ovmf".into(),
                machine: "q35".into(),
                disks: vec![
                    "virtio0=drive-virtio0.img".into(),
                    "ide2=cdrom (empty)".into(),
                ],
                efidisk: "efitype=4m,pre-enrolled-keys=1".into(),
                nics: vec!["net0=e1000".into()],
                boot_order: vec!["virtio0".into()],
                omitted: vec!["hostpci0: passthrough of a device".into()],
                ..SandboxHardware::default()
            }),
        }
    }

    fn signed(key: &SigningKey) -> Vec<u8> {
        serde_json::to_vec(&sign(&Statement::new(validation()), key).unwrap()).unwrap()
    }

    #[test]
    fn the_hardware_shows_what_the_sandbox_got_of_the_source() {
        let disk = |slot: &str, cdrom: bool| pb::SourceDisk {
            slot: slot.into(),
            archive: if cdrom {
                String::new()
            } else {
                format!("drive-{slot}.img")
            },
            cdrom,
        };
        let source = pb::SourceHardware {
            bios: "ovmf".into(),
            disks: vec![
                disk("scsi0", false),
                disk("scsi1", false),
                disk("ide2", true),
            ],
            efidisk: true,
            efitype: "4m".into(),
            pre_enrolled_keys: true,
            nics: vec![pb::SourceNic {
                index: 0,
                model: "virtio".into(),
            }],
            boot_order: vec!["scsi1".into(), "scsi0".into(), "ide2".into(), "net0".into()],
            ..pb::SourceHardware::default()
        };
        let all = SandboxHardware::from_wire(
            &source,
            "ab",
            &[
                "drive-scsi0.img".into(),
                "drive-scsi1.img".into(),
                EFIDISK_ARCHIVE.into(),
            ],
        );
        assert_eq!(all.efidisk, "efitype=4m,pre-enrolled-keys=1");
        assert_eq!(all.boot_order, ["scsi1", "scsi0", "ide2", "net0"]);
        assert!(all.omitted.is_empty(), "{:?}", all.omitted);

        let some = SandboxHardware::from_wire(&source, "ab", &["drive-scsi0.img".into()]);
        assert_eq!(some.disks, ["scsi0=drive-scsi0.img", "ide2=cdrom (empty)"]);
        assert_eq!(
            some.efidisk, "",
            "an EFI disk the run does not restore is not the sandbox's"
        );
        assert_eq!(some.boot_order, ["scsi0", "ide2", "net0"]);
        assert!(
            some.omitted
                .iter()
                .any(|o| o.starts_with("scsi1: its archive drive-scsi1.img"))
        );
        assert!(
            some.omitted.iter().any(
                |o| o.starts_with("efidisk0: its archive drive-efidisk0.img")
                    && o.contains("empty EFI variables")
            ),
            "{:?}",
            some.omitted
        );
    }

    #[test]
    fn pae_matches_the_dsse_specification_example() {
        assert_eq!(
            pae("http://example.com/HelloWorld", b"hello world"),
            b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
        );
        assert_eq!(pae("", b""), b"DSSEv1 0  0 ");
    }

    #[test]
    fn a_signed_report_verifies_and_keeps_its_content() {
        let key = SigningKey::generate(&mut OsRng);
        let statement = verify(&signed(&key), &key.verifying_key()).unwrap();
        assert_eq!(statement, Statement::new(validation()));
        assert_eq!(statement.subject.len(), 3);
        assert_eq!(
            statement.subject[0].uri,
            "pbs://pbs.example:8007/store1/prod/vm/100/2026-11-30T01:00:00Z"
        );
        assert!(statement.subject[2].digest.is_empty());
    }

    #[test]
    fn every_changed_byte_fails_verification() {
        let key = SigningKey::generate(&mut OsRng);
        let bytes = signed(&key);
        let text = std::str::from_utf8(&bytes).unwrap();
        let payload_start = text.find(r#""payload":""#).unwrap() + 11;
        let payload_end = payload_start + text[payload_start..].find('"').unwrap();
        // Inside the payload every change reaches the signature the same way, and a debug build
        // verifies slowly: its edges and every 16th byte stand for the rest.
        let inside_payload = |at: usize| {
            (payload_start + 8..payload_end.saturating_sub(8)).contains(&at)
                && !(at - payload_start).is_multiple_of(16)
        };
        for at in (0..bytes.len()).filter(|&at| !inside_payload(at)) {
            let mut changed = bytes.clone();
            changed[at] ^= 0x01;
            assert!(
                verify(&changed, &key.verifying_key()).is_err(),
                "byte {at} ({:?}) changed and the report still verifies",
                bytes[at] as char
            );
        }
    }

    #[test]
    fn another_key_is_refused_by_key_id() {
        let key = SigningKey::generate(&mut OsRng);
        let other = SigningKey::generate(&mut OsRng);
        let error = verify(&signed(&key), &other.verifying_key()).unwrap_err();
        assert!(matches!(error, ReportError::KeyId { .. }), "{error}");
    }

    /// The statement is re-signed after each change, so only the statement checks can catch it.
    fn signed_with(key: &SigningKey, change: impl FnOnce(&mut Statement)) -> ReportError {
        let mut statement = Statement::new(validation());
        change(&mut statement);
        let bytes = serde_json::to_vec(&sign(&statement, key).unwrap()).unwrap();
        verify(&bytes, &key.verifying_key()).unwrap_err()
    }

    #[test]
    fn a_journal_that_does_not_recompute_is_refused_even_when_signed() {
        let key = SigningKey::generate(&mut OsRng);
        let error = signed_with(&key, |s| {
            s.predicate.journal.records[1].detail = r#"{"exit_code":0}"#.into()
        });
        assert!(
            matches!(&error, ReportError::Journal(m) if m.contains("record 2")),
            "{error}"
        );
        let error = signed_with(&key, |s| {
            s.predicate.journal.records.pop();
        });
        assert!(
            matches!(&error, ReportError::Journal(m) if m.contains("the records end at")),
            "{error}"
        );
        let error = signed_with(&key, |s| {
            s.predicate.run_id = "1f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f".into()
        });
        assert!(matches!(error, ReportError::Journal(_)), "{error}");
        let error = signed_with(&key, |s| s.predicate.journal.records.swap(0, 1));
        assert!(matches!(error, ReportError::Journal(_)), "{error}");
    }

    #[test]
    fn statement_shape_is_checked_even_when_signed() {
        let key = SigningKey::generate(&mut OsRng);
        let error = signed_with(&key, |s| {
            s.predicate_type = "https://slsa.dev/provenance/v1".into()
        });
        assert!(
            matches!(&error, ReportError::Statement(m) if m.contains("predicateType")),
            "{error}"
        );
        let error = signed_with(&key, |s| {
            s.statement_type = "https://in-toto.io/Statement/v0.1".into()
        });
        assert!(
            matches!(&error, ReportError::Statement(m) if m.contains("_type")),
            "{error}"
        );
        let error = signed_with(&key, |s| s.subject.truncate(1));
        assert!(
            matches!(&error, ReportError::Statement(m) if m.contains("subjects")),
            "{error}"
        );
        let error = signed_with(&key, |s| {
            s.predicate.verdict = Verdict::Failed { reasons: vec![] }
        });
        assert!(
            matches!(&error, ReportError::Statement(m) if m.contains("reason")),
            "{error}"
        );
        let error = signed_with(&key, |s| s.predicate.isolation.ruleset.push(' '));
        assert!(
            matches!(&error, ReportError::Statement(m) if m.contains("ruleset_digest")),
            "{error}"
        );
        let error = signed_with(&key, |s| {
            if let Some(shot) = &mut s.predicate.screenshot {
                shot.file = "../../etc/passwd".into();
            }
        });
        assert!(
            matches!(&error, ReportError::Statement(m) if m.contains("screenshot.file")),
            "{error}"
        );
    }

    #[test]
    fn the_screenshot_beside_a_report_must_be_the_one_signed() {
        let dir = temp_dir("screenshot");
        let report_path = dir.join("report.json");
        let mut statement = Statement::new(validation());
        let png = b"\x89PNG\r\n\x1a\n the guest's console";
        statement.predicate.screenshot = Some(Screenshot {
            file: "shot.png".into(),
            sha256: hex::encode(Sha256::digest(png)),
        });
        assert_eq!(
            check_screenshot(&statement, &report_path).unwrap(),
            ScreenshotCheck::Absent(dir.join("shot.png"))
        );
        std::fs::write(dir.join("shot.png"), png).unwrap();
        assert_eq!(
            check_screenshot(&statement, &report_path).unwrap(),
            ScreenshotCheck::Matches(dir.join("shot.png"))
        );
        std::fs::write(dir.join("shot.png"), b"another image").unwrap();
        let error = check_screenshot(&statement, &report_path).unwrap_err();
        assert!(matches!(error, ReportError::Screenshot { .. }), "{error}");
        statement.predicate.screenshot = None;
        assert_eq!(
            check_screenshot(&statement, &report_path).unwrap(),
            ScreenshotCheck::NotTaken
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reports_are_written_atomically_private_and_named_by_time_node_and_run() {
        let key = SigningKey::generate(&mut OsRng);
        let dir = temp_dir("write").join("reports");
        let at = OffsetDateTime::from_unix_timestamp(1_796_070_000).unwrap();
        let path = write(&dir, &Statement::new(validation()), &key, at).unwrap();
        assert_eq!(
            path.file_name().unwrap().to_str().unwrap(),
            format!("20261130T202000Z-pve1-{RUN}.json")
        );
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "no temporary file is left"
        );
        verify(&read(&path).unwrap(), &key.verifying_key()).unwrap();
        let shown = describe(
            &verify(&read(&path).unwrap(), &key.verifying_key()).unwrap(),
            &path,
        );
        assert!(shown.starts_with("verdict: passed\n"), "{shown}");
        assert!(
            shown.contains("hardware: cpu x86-64-v2-AES bios ovmf (efidisk efitype=4m,pre-enrolled-keys=1) machine q35 ostype default scsihw default; disks [virtio0=drive-virtio0.img, ide2=cdrom (empty)]; nics [net0=e1000]; boot [virtio0]\n  omitted hostpci0: passthrough of a device\n"),
            "{shown}"
        );
        assert!(
            shown.contains(&format!("screenshot: {}", dir.join("shot.png").display())),
            "{shown}"
        );
        let error = file_name(at, "../etc", RUN).unwrap_err();
        assert!(matches!(error, ReportError::Name(_)), "{error}");
        std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
    }
}
