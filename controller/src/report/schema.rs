//! What a report says: the in-toto Statement and its predicate, one type per part (steps, guest
//! facts, probes, isolation, assertions, cleanup, journal, verdict, screenshot, hardware).

use super::*;

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
    /// With `node: auto` or a list of nodes: how the node was chosen (what it had free, the
    /// candidates passed over and why); absent for a node the plan names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<String>,
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
    /// Every model the node's hardware policy replaced, `<key>: <original> -> <replacement>
    /// (<reason>)`; the values above are the replacements. Absent when nothing was replaced.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changed: Vec<String>,
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
            changed: hardware
                .changed
                .iter()
                .map(|c| {
                    format!(
                        "{}: {} -> {} ({})",
                        c.key, c.original, c.replacement, c.reason
                    )
                })
                .collect(),
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
    /// Lower-case hex SHA-256 of the snapshot's manifest (`index.json.blob`) as the node read it;
    /// absent when the run stopped before reading it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_sha256: Option<String>,
    /// PBS's last verify job on the snapshot, from the manifest; absent when none ran (or the
    /// manifest was not read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify_state: Option<VerifyState>,
    /// With `snapshot: latest`: what the PBS listing showed when the plan was resolved; absent
    /// for a snapshot the plan named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latest: Option<LatestEvidence>,
}

/// `snapshot: latest` as it was resolved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatestEvidence {
    /// The VM's snapshots PBS listed, and how many of them were finished. With none finished
    /// there is no backup to name: `snapshot` is then the VM's group (`vm/100`), and the
    /// failed verdict carries no digest.
    pub listed: u64,
    pub finished: u64,
    /// The chosen snapshot's age in seconds when the plan was resolved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub age_seconds: Option<i64>,
    /// The plan's `max_age_hours`, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_age_hours: Option<u32>,
}

impl LatestEvidence {
    /// No finished backup: the verdict is about its absence, not about bytes.
    pub fn found_none(&self) -> bool {
        self.finished == 0
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Archive {
    pub name: String,
    /// The manifest's `csum` of the archive's index (`<name>.fidx`): SHA-256 over its chunk
    /// digests, which name the archive's bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// The archive's size in bytes, from the manifest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// `none`, `encrypt` or `sign-only`, from the manifest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crypt_mode: Option<String>,
}

/// A verify job's result as PBS keeps it in the manifest (`unprotected.verify_state`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyState {
    /// `ok` or `failed`.
    pub state: String,
    /// The verify task's UPID.
    pub upid: String,
    /// When that task started.
    pub started_unix_ms: i64,
}

/// The file PBS keeps a disk archive's index in: the client appends `.fidx` to `<name>.img`.
pub fn index_file_name(archive: &str) -> String {
    format!("{archive}.fidx")
}

impl Snapshot {
    /// The manifest's digests and verify state given to this snapshot's archives. Every archive
    /// must be in the manifest, and every value must have the form the report promises, since
    /// the manifest is the node's word.
    pub fn take_manifest(&mut self, manifest: &pb::SnapshotManifest) -> Result<(), String> {
        if !is_sha256_hex(&manifest.sha256) {
            return Err("the node's manifest digest is not 64 lower-case hex digits".into());
        }
        for archive in &mut self.archives {
            let index = index_file_name(&archive.name);
            let Some(file) = manifest.files.iter().find(|f| f.filename == index) else {
                return Err(format!(
                    "the snapshot's manifest does not list {index}, so the report cannot name the bytes of {}",
                    archive.name
                ));
            };
            if !is_sha256_hex(&file.csum) {
                return Err(format!(
                    "the manifest's csum of {index} is not 64 lower-case hex digits"
                ));
            }
            if !matches!(file.crypt_mode.as_str(), "none" | "encrypt" | "sign-only") {
                return Err(format!(
                    "the manifest's crypt-mode of {index} is not none, encrypt or sign-only"
                ));
            }
            archive.sha256 = Some(file.csum.clone());
            archive.size = Some(file.size);
            archive.crypt_mode = Some(file.crypt_mode.clone());
        }
        self.verify_state = match &manifest.verify_state {
            None => None,
            Some(v) => {
                let state = VerifyState {
                    state: v.state.clone(),
                    upid: v.upid.clone(),
                    started_unix_ms: v.started_unix.saturating_mul(1000),
                };
                state.check()?;
                Some(state)
            }
        };
        self.manifest_sha256 = Some(manifest.sha256.clone());
        Ok(())
    }
}

impl VerifyState {
    /// The longest UPID a report carries.
    pub const MAX_UPID_CHARS: usize = 512;

    /// A state PBS writes, and a UPID of printable ASCII: what a report may show as it is.
    pub fn check(&self) -> Result<(), String> {
        if !matches!(self.state.as_str(), "ok" | "failed") {
            return Err("verify_state.state is not ok or failed".into());
        }
        if !self.upid.starts_with("UPID:")
            || self.upid.len() > Self::MAX_UPID_CHARS
            || !self.upid.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(format!(
                "verify_state.upid is not a UPID of at most {} printable characters",
                Self::MAX_UPID_CHARS
            ));
        }
        Ok(())
    }
}

/// 64 lower-case hex digits: the SHA-256 digests a report carries.
pub fn is_sha256_hex(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
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

impl JournalRecord {
    /// The record as the wire carries it, for the journal's own verification.
    pub fn to_wire(&self) -> certistack_proto::v1::JournalRecord {
        certistack_proto::v1::JournalRecord {
            sequence: self.sequence,
            time_unix_ms: self.time_unix_ms,
            operation: self.operation.clone(),
            resource: self.resource.clone(),
            phase: self.phase.clone(),
            previous_sha256: self.previous_sha256.clone(),
            record_sha256: self.record_sha256.clone(),
            detail: self.detail.clone(),
        }
    }
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
