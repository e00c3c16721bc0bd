//! Plans: what an operator asks the controller to validate, written in YAML.
//!
//! A plan is checked completely before any node is contacted. Each validation is turned into the
//! `RunGrant` its node will receive, and that grant is put through the connector's own parser
//! (signed with a throwaway key, verified, decoded, every field validated), so a plan the
//! controller accepts is one a node accepts, for the same reasons. What a grant cannot say (the
//! node inventory, secrets kept in files, a VMID used twice on one node across validations) is
//! checked here.
//!
//! YAML is read with `serde-saphyr`: a maintained, panic-free parser (unsafe code forbidden,
//! fuzzed) with input budgets and line/column on every error, including the errors our own
//! field types raise, so a refusal points at the line to change.

use crate::config::ControllerConfig;
use certistack_core::files::{self, FileError};
use certistack_core::grant::{self, Grant, GrantError};
use certistack_core::validate::Vmid;
use certistack_proto::v1 as pb;
use serde::{Deserialize, Deserializer};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A plan is a few hundred lines; a larger file is refused before it is parsed.
pub const MAX_PLAN_BYTES: u64 = 1024 * 1024;
/// Validations in one plan.
pub const MAX_VALIDATIONS: usize = 256;
/// PBS listens on 8007 unless told otherwise.
pub const DEFAULT_PBS_PORT: u16 = 8007;
/// How long a validation may take from grant to EndRun, unless the plan says.
pub const DEFAULT_RUN_SECONDS: u32 = 3600;
/// How long to wait for the guest agent after start, unless the plan says.
pub const DEFAULT_GUEST_AGENT_SECONDS: u32 = 300;
/// A grant is valid from this long before the run starts, so a node whose clock is a little
/// behind the controller's accepts it.
pub const NOT_BEFORE_SLACK_SECS: i64 = 60;

/// The seconds of a run kept for cleanup after its steps: a quarter of it, at least 30 and at
/// most 600, so cleanup runs with the run's own certificate before the deadline.
pub fn cleanup_reserve_secs(run_seconds: u32) -> u32 {
    (run_seconds / 4).clamp(30, 600)
}
/// Where a refusal tells the operator to read about secrets.
const SECRETS_DOC: &str = "docs/plans.md#secrets";

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("cannot read the plan: {0}")]
    Read(FileError),
    #[error("{path} is {size} bytes; a plan is at most {MAX_PLAN_BYTES}")]
    TooLarge { path: PathBuf, size: u64 },
    #[error("{path}:{position}: {reason}")]
    Syntax {
        path: PathBuf,
        /// `line:column`, or `?` when the parser cannot tell.
        position: String,
        reason: String,
    },
    #[error("{path}: {at}: {reason}")]
    Refused {
        path: PathBuf,
        at: String,
        reason: String,
    },
    #[error("{path}: {at}: {error}")]
    Secret {
        path: PathBuf,
        at: &'static str,
        error: FileError,
    },
}

// ---------------------------------------------------------------------------------------------
// The plan as written.

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanFile {
    storage: StorageFile,
    validations: Vec<ValidationFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StorageFile {
    server: String,
    #[serde(default = "default_pbs_port")]
    port: u16,
    datastore: String,
    #[serde(default)]
    namespace: String,
    auth_id: String,
    fingerprint: String,
    pbs_password_file: PathBuf,
    #[serde(default)]
    encryption_key_file: Option<PathBuf>,
    /// Known only to be refused where it is written, with the way out.
    #[serde(default, rename = "pbs_password")]
    _pbs_password: Option<InlineSecret>,
    #[serde(default, rename = "encryption_key")]
    _encryption_key: Option<InlineSecret>,
}

fn default_pbs_port() -> u16 {
    DEFAULT_PBS_PORT
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ValidationFile {
    name: String,
    node: String,
    source_vmid: PlanVmid,
    snapshot: SnapshotTime,
    archives: Vec<String>,
    sandbox: Vec<SandboxFile>,
    network: NetworkFile,
    #[serde(default)]
    probes: Vec<ProbeFile>,
    #[serde(default)]
    assertions: Vec<AssertionFile>,
    #[serde(default)]
    timeouts: TimeoutsFile,
    #[serde(default)]
    network_recovery: NetworkRecoveryFile,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SandboxFile {
    vmid: PlanVmid,
    cores: u32,
    memory_mib: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NetworkFile {
    lifecycle: NetworkLifecycle,
    vnet: String,
    probe_source: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProbeFile {
    kind: ProbeKindFile,
    address: String,
    port: u16,
    #[serde(default)]
    expect: ExpectFile,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum ProbeKindFile {
    Tcp,
    Http,
    Https,
    Dns,
    Ldap,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExpectFile {
    #[serde(default)]
    banner_prefix: String,
    #[serde(default)]
    http_path: String,
    #[serde(default)]
    http_status: u16,
    #[serde(default)]
    body_contains: String,
    #[serde(default)]
    body_sha256: String,
    #[serde(default)]
    dns_name: String,
    #[serde(default)]
    dns_type: Option<DnsTypeFile>,
    #[serde(default)]
    dns_answers: Vec<String>,
    #[serde(default)]
    ldap_naming_context: String,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
enum DnsTypeFile {
    A,
    Aaaa,
    Cname,
    Mx,
    Txt,
    Srv,
    Ptr,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AssertionFile {
    id: String,
    program: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    exit_code: i32,
    #[serde(default)]
    stdout_contains: String,
    timeout_seconds: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TimeoutsFile {
    #[serde(default = "default_run_seconds")]
    run_seconds: u32,
    #[serde(default = "default_guest_agent_seconds")]
    guest_agent_seconds: u32,
}

impl Default for TimeoutsFile {
    fn default() -> Self {
        Self {
            run_seconds: DEFAULT_RUN_SECONDS,
            guest_agent_seconds: DEFAULT_GUEST_AGENT_SECONDS,
        }
    }
}

fn default_run_seconds() -> u32 {
    DEFAULT_RUN_SECONDS
}

fn default_guest_agent_seconds() -> u32 {
    DEFAULT_GUEST_AGENT_SECONDS
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct NetworkRecoveryFile {
    /// `rewrite` when not written: `preserve` is the explicit opt-out.
    #[serde(default)]
    mode: Option<NetworkRecoveryMode>,
    /// `rewrite`: the sandbox NIC's address/prefix; by default the one address the probes
    /// target, with the probe network's prefix.
    #[serde(default)]
    guest_address: Option<String>,
}

/// How the restored guest finds its network in the sandbox.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkRecoveryMode {
    /// The explicit opt-out: the guest keeps the network configuration it was backed up
    /// with, the VNet is an isolated copy of its subnet, and probes target those addresses.
    /// Nothing in the guest is changed.
    Preserve,
    /// The default: before the sandbox VM first starts, the node writes a MAC-bound,
    /// no-gateway profile for its NIC (and a firewalld allow for the probe source) into the
    /// overlay (docs/guest-network.md).
    #[default]
    Rewrite,
}

impl NetworkRecoveryMode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Preserve => "preserve",
            Self::Rewrite => "rewrite",
        }
    }

    /// The mode the run's grant allows.
    pub fn wire(self) -> pb::NetworkRecoveryMode {
        match self {
            Self::Preserve => pb::NetworkRecoveryMode::Preserve,
            Self::Rewrite => pb::NetworkRecoveryMode::Rewrite,
        }
    }
}

/// A value that must not appear in a plan: deserializing it fails with where the secret goes.
#[derive(Debug)]
struct InlineSecret;

impl<'de> Deserialize<'de> for InlineSecret {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        serde::de::IgnoredAny::deserialize(deserializer)?;
        Err(serde::de::Error::custom(format!(
            "secrets go in files, never in a plan; see {SECRETS_DOC}: write it to a file only you can read (chmod 0600) and name that file with `pbs_password_file` or `encryption_key_file`"
        )))
    }
}

/// A VMID, range-checked with the connector's own rule where it is written.
#[derive(Debug, Clone, Copy)]
struct PlanVmid(Vmid);

impl<'de> Deserialize<'de> for PlanVmid {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = u64::deserialize(deserializer)?;
        u32::try_from(value)
            .ok()
            .and_then(|v| Vmid::parse("vmid", v).ok())
            .map(Self)
            .ok_or_else(|| {
                serde::de::Error::custom(format!(
                    "VMID {value} is outside {}..={}; use a VMID Proxmox VE accepts",
                    Vmid::MIN,
                    Vmid::MAX
                ))
            })
    }
}

/// The exact time of a snapshot; `latest` is refused where it is written.
#[derive(Debug, Clone)]
struct SnapshotTime(String);

impl<'de> Deserialize<'de> for SnapshotTime {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = String::deserialize(deserializer)?;
        if value.eq_ignore_ascii_case("latest") {
            return Err(serde::de::Error::custom(
                "resolving latest comes with PBS API support; give the exact snapshot time, e.g. 2026-11-01T02:00:00Z (`proxmox-backup-client snapshot list` shows them)",
            ));
        }
        Ok(Self(value))
    }
}

/// The sandbox network's lifecycle: who creates the VNet and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetworkLifecycle {
    /// The VNet exists before the run (docs/sandbox-network.md); the run only attaches to it.
    Preprovisioned,
}

impl NetworkLifecycle {
    pub fn name(self) -> &'static str {
        match self {
            Self::Preprovisioned => "preprovisioned",
        }
    }
}

impl<'de> Deserialize<'de> for NetworkLifecycle {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = String::deserialize(deserializer)?;
        match value.as_str() {
            "preprovisioned" => Ok(Self::Preprovisioned),
            "ephemeral" => Err(serde::de::Error::custom(
                "`ephemeral` is not yet supported, use preprovisioned (a VNet set up beforehand as docs/sandbox-network.md describes)",
            )),
            other => Err(serde::de::Error::custom(format!(
                "lifecycle {other:?} is unknown; use preprovisioned"
            ))),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The checked plan.

/// A plan that passed every check: one grant per validation, ready to be signed.
#[derive(Debug)]
pub struct Plan {
    pub path: PathBuf,
    /// `sha256:<hex>` of the plan file's bytes, as the report names the plan.
    pub digest: String,
    /// The files holding the PBS password (or API-token secret) and the optional encryption key,
    /// resolved against the plan's directory and permission-checked.
    pub pbs_password_file: PathBuf,
    pub encryption_key_file: Option<PathBuf>,
    pub validations: Vec<Validation>,
}

#[derive(Debug)]
pub struct Validation {
    pub name: String,
    pub source_vmid: Vmid,
    /// The endpoint of the node in the inventory, `HOST:PORT`.
    pub endpoint: String,
    /// The grant as the node will receive it, except run id and validity window, which are
    /// minted when the run starts.
    pub wire: pb::RunGrant,
    /// The same grant as the node's parser reads it.
    pub grant: Grant,
    pub run_seconds: u32,
    pub guest_agent_seconds: u32,
    pub network_lifecycle: NetworkLifecycle,
    pub network_recovery: NetworkRecoveryMode,
}

impl Plan {
    /// Reads and checks the plan at `path` against the controller's inventory. Nothing is
    /// contacted.
    pub fn load(path: &Path, config: &ControllerConfig, now_unix: i64) -> Result<Self, PlanError> {
        let size = std::fs::metadata(path)
            .map_err(|error| {
                PlanError::Read(FileError::Read {
                    path: path.to_owned(),
                    error,
                })
            })?
            .len();
        if size > MAX_PLAN_BYTES {
            return Err(PlanError::TooLarge {
                path: path.to_owned(),
                size,
            });
        }
        // The plan decides which PBS server the secret is handed to, so it is held to the same
        // rule as every file that steers trust: nobody else may write it.
        let text = files::read_trusted(path).map_err(PlanError::Read)?;
        let plan = Self::parse(path, &text, config, now_unix)?;
        files::check_private(&plan.pbs_password_file).map_err(|error| PlanError::Secret {
            path: path.to_owned(),
            at: "storage.pbs_password_file",
            error,
        })?;
        if let Some(key) = &plan.encryption_key_file {
            files::check_private(key).map_err(|error| PlanError::Secret {
                path: path.to_owned(),
                at: "storage.encryption_key_file",
                error,
            })?;
        }
        Ok(plan)
    }

    /// Parses and checks plan text; secret files are resolved but not opened.
    pub fn parse(
        path: &Path,
        text: &str,
        config: &ControllerConfig,
        now_unix: i64,
    ) -> Result<Self, PlanError> {
        let file: PlanFile = serde_saphyr::from_str(text).map_err(|error| {
            let position = error.location().filter(|at| at.line() > 0).map_or_else(
                || "?".to_owned(),
                |at| format!("{}:{}", at.line(), at.column()),
            );
            PlanError::Syntax {
                path: path.to_owned(),
                position,
                reason: first_line(&error.to_string()),
            }
        })?;
        let refused = |at: String, reason: String| PlanError::Refused {
            path: path.to_owned(),
            at,
            reason,
        };
        if file.validations.is_empty() || file.validations.len() > MAX_VALIDATIONS {
            return Err(refused(
                "validations".into(),
                format!(
                    "a plan has 1..={MAX_VALIDATIONS} validations, this one has {}",
                    file.validations.len()
                ),
            ));
        }
        let base = path.parent().unwrap_or(Path::new("."));
        let storage = &file.storage;
        let repository = pb::PbsRepository {
            server: storage.server.clone(),
            port: u32::from(storage.port),
            datastore: storage.datastore.clone(),
            namespace: storage.namespace.clone(),
            auth_id: storage.auth_id.clone(),
            fingerprint: storage.fingerprint.clone(),
        };

        let mut names = BTreeSet::new();
        let mut vmids_on_node: BTreeMap<String, BTreeMap<u32, String>> = BTreeMap::new();
        let mut validations = Vec::new();
        for (index, v) in file.validations.iter().enumerate() {
            let at = |key: &str| format!("validations[{index}] ({}){key}", v.name);
            check_name(&v.name)
                .map_err(|reason| refused(format!("validations[{index}].name"), reason))?;
            if !names.insert(v.name.clone()) {
                return Err(refused(
                    at(".name"),
                    "another validation has this name; give each a name of its own".into(),
                ));
            }
            let node = config
                .nodes
                .iter()
                .find(|(name, _)| name.as_str() == v.node)
                .map(|(_, node)| node)
                .ok_or_else(|| {
                    refused(
                        at(".node"),
                        format!(
                            "node {:?} is not in the controller's inventory ({}); add it under [[nodes]] in the controller configuration or use one of those",
                            v.node,
                            config
                                .nodes
                                .keys()
                                .map(|n| n.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    )
                })?;
            let used = vmids_on_node.entry(v.node.clone()).or_default();
            for vm in &v.sandbox {
                if let Some(other) = used.insert(vm.vmid.0.get(), v.name.clone()) {
                    return Err(refused(
                        at(".sandbox"),
                        format!(
                            "sandbox VMID {} is also used by validation {other} on node {}; give each sandbox VM on a node its own VMID",
                            vm.vmid.0, v.node
                        ),
                    ));
                }
            }
            if v.timeouts.guest_agent_seconds == 0
                || v.timeouts.guest_agent_seconds >= v.timeouts.run_seconds
            {
                return Err(refused(
                    at(".timeouts.guest_agent_seconds"),
                    format!(
                        "{} must be at least 1 and less than run_seconds ({})",
                        v.timeouts.guest_agent_seconds, v.timeouts.run_seconds
                    ),
                ));
            }
            let run_seconds = i64::from(v.timeouts.run_seconds);
            if run_seconds + NOT_BEFORE_SLACK_SECS > grant::MAX_GRANT_LIFETIME_SECS {
                return Err(refused(
                    at(".timeouts.run_seconds"),
                    format!(
                        "{run_seconds} is longer than a grant may last ({} s, of which {NOT_BEFORE_SLACK_SECS} s are kept for clocks a little apart); split the validation or shorten it",
                        grant::MAX_GRANT_LIFETIME_SECS
                    ),
                ));
            }
            let reserve = cleanup_reserve_secs(v.timeouts.run_seconds);
            if v.timeouts.guest_agent_seconds.saturating_add(reserve) >= v.timeouts.run_seconds {
                return Err(refused(
                    at(".timeouts.guest_agent_seconds"),
                    format!(
                        "{} leaves no time for the steps after it: run_seconds ({}) keeps {reserve} s for cleanup, so the guest agent wait must be shorter than {} s; raise run_seconds or lower guest_agent_seconds",
                        v.timeouts.guest_agent_seconds,
                        v.timeouts.run_seconds,
                        v.timeouts.run_seconds.saturating_sub(reserve)
                    ),
                ));
            }
            let recovery_mode = v.network_recovery.mode.unwrap_or_default();
            let guest_address = match (recovery_mode, &v.network_recovery.guest_address) {
                (_, Some(address)) => address.clone(),
                (NetworkRecoveryMode::Preserve, None) => String::new(),
                (NetworkRecoveryMode::Rewrite, None) => {
                    let addresses: BTreeSet<&str> =
                        v.probes.iter().map(|p| p.address.as_str()).collect();
                    let prefix = v.network.probe_source.rsplit_once('/').map(|(_, p)| p);
                    match (addresses.len(), addresses.first(), prefix) {
                        (1, Some(address), Some(prefix)) => format!("{address}/{prefix}"),
                        _ => {
                            return Err(refused(
                                at(".network_recovery.guest_address"),
                                format!(
                                    "network_recovery.mode is {} and needs the sandbox NIC's address, which is taken from the probes only when they target exactly one address (they target {}): write `network_recovery: {{guest_address: <address>/<prefix>}}` with an address inside network.probe_source {} other than the probe source itself, or `network_recovery: {{mode: preserve}}` to leave the guest's network configuration as it was backed up",
                                    if v.network_recovery.mode.is_some() {
                                        "rewrite"
                                    } else {
                                        "rewrite (the default)"
                                    },
                                    addresses.len(),
                                    v.network.probe_source
                                ),
                            ));
                        }
                    }
                }
            };
            let wire = pb::RunGrant {
                version: grant::GRANT_VERSION,
                run_id: uuid::Uuid::new_v4().hyphenated().to_string(),
                node: v.node.clone(),
                not_before_unix: now_unix - NOT_BEFORE_SLACK_SECS,
                deadline_unix: now_unix.saturating_add(run_seconds),
                repository: Some(repository.clone()),
                snapshot: format!("vm/{}/{}", v.source_vmid.0, v.snapshot.0),
                archives: v.archives.clone(),
                sandbox_vms: v
                    .sandbox
                    .iter()
                    .map(|vm| pb::SandboxVm {
                        vmid: vm.vmid.0.get(),
                        max_cores: vm.cores,
                        max_memory_mib: vm.memory_mib,
                    })
                    .collect(),
                vnet: v.network.vnet.clone(),
                probe_source: v.network.probe_source.clone(),
                probe_targets: v.probes.iter().map(wire_probe).collect(),
                qga_assertions: v
                    .assertions
                    .iter()
                    .map(|a| pb::QgaAssertion {
                        id: a.id.clone(),
                        program: a.program.clone(),
                        args: a.args.clone(),
                        expect_exit_code: a.exit_code,
                        expect_stdout_contains: a.stdout_contains.clone(),
                        timeout_seconds: a.timeout_seconds,
                    })
                    .collect(),
                network_recovery_modes: vec![recovery_mode.wire() as i32],
                guest_address,
            };
            let grant = as_the_node_reads_it(&wire)
                .map_err(|error| refused(at(""), grant_refusal(&error)))?;
            validations.push(Validation {
                name: v.name.clone(),
                source_vmid: v.source_vmid.0,
                endpoint: node.endpoint(),
                wire,
                grant,
                run_seconds: v.timeouts.run_seconds,
                guest_agent_seconds: v.timeouts.guest_agent_seconds,
                network_lifecycle: v.network.lifecycle,
                network_recovery: recovery_mode,
            });
        }
        Ok(Self {
            path: path.to_owned(),
            digest: crate::report::sha256_text(text.as_bytes()),
            pbs_password_file: base.join(&storage.pbs_password_file),
            encryption_key_file: storage.encryption_key_file.as_ref().map(|f| base.join(f)),
            validations,
        })
    }
}

/// The parser's message without its own position prefix and snippet: the position is printed
/// once, in front, as `file:line:column`.
fn first_line(text: &str) -> String {
    let line = text.lines().next().unwrap_or_default();
    let line = line.strip_prefix("error: ").unwrap_or(line);
    let unprefixed = line
        .strip_prefix("line ")
        .and_then(|rest| rest.split_once(": "))
        .filter(|(position, _)| position.contains(" column "))
        .map(|(_, message)| message);
    unprefixed.unwrap_or(line).to_owned()
}

fn check_name(name: &str) -> Result<(), String> {
    let ok = (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a validation name (1 to 63 letters, digits, `-`, `_`, `.`)"
        ))
    }
}

fn wire_probe(probe: &ProbeFile) -> pb::ProbeTarget {
    let kind = match probe.kind {
        ProbeKindFile::Tcp => pb::ProbeKind::Tcp,
        ProbeKindFile::Http => pb::ProbeKind::Http,
        ProbeKindFile::Https => pb::ProbeKind::Https,
        ProbeKindFile::Dns => pb::ProbeKind::Dns,
        ProbeKindFile::Ldap => pb::ProbeKind::Ldap,
    };
    let e = &probe.expect;
    let dns_type = match e.dns_type {
        None => pb::DnsRecordType::Unspecified,
        Some(DnsTypeFile::A) => pb::DnsRecordType::A,
        Some(DnsTypeFile::Aaaa) => pb::DnsRecordType::Aaaa,
        Some(DnsTypeFile::Cname) => pb::DnsRecordType::Cname,
        Some(DnsTypeFile::Mx) => pb::DnsRecordType::Mx,
        Some(DnsTypeFile::Txt) => pb::DnsRecordType::Txt,
        Some(DnsTypeFile::Srv) => pb::DnsRecordType::Srv,
        Some(DnsTypeFile::Ptr) => pb::DnsRecordType::Ptr,
    };
    pb::ProbeTarget {
        kind: kind.into(),
        address: probe.address.clone(),
        port: u32::from(probe.port),
        expect: Some(pb::ProbeExpectation {
            banner_prefix: e.banner_prefix.clone(),
            http_path: e.http_path.clone(),
            http_status: u32::from(e.http_status),
            body_contains: e.body_contains.clone(),
            body_sha256: e.body_sha256.clone(),
            dns_name: e.dns_name.clone(),
            dns_type: dns_type.into(),
            dns_answers: e.dns_answers.clone(),
            ldap_naming_context: e.ldap_naming_context.clone(),
        }),
    }
}

/// Runs `wire` through the connector's verification exactly as a node does: signature, size,
/// unknown fields, every validator and every consistency rule. The key is thrown away; only the
/// parse matters here.
fn as_the_node_reads_it(wire: &pb::RunGrant) -> Result<Grant, GrantError> {
    let key = ed25519_dalek::SigningKey::generate(&mut rand_core::OsRng);
    let signed = crate::run::sign_grant(&key, wire);
    let parsed = grant::verify(&signed, &key.verifying_key())?;
    Ok(parsed)
}

/// The grant's wire field names, in the words of the plan.
const PLAN_KEYS: &[(&str, &str)] = &[
    ("PbsRepository.server", "storage.server"),
    ("PbsRepository.port", "storage.port"),
    ("PbsRepository.datastore", "storage.datastore"),
    ("PbsRepository.namespace", "storage.namespace"),
    ("PbsRepository.auth_id", "storage.auth_id"),
    ("PbsRepository.fingerprint", "storage.fingerprint"),
    ("RunGrant.node", "node"),
    ("RunGrant.snapshot", "source_vmid and snapshot"),
    ("RunGrant.archives", "archives"),
    ("RunGrant.sandbox_vms", "sandbox"),
    ("SandboxVm.vmid", "sandbox[].vmid"),
    ("RunGrant.vnet", "network.vnet"),
    ("RunGrant.probe_source", "network.probe_source"),
    ("RunGrant.guest_address", "network_recovery.guest_address"),
    ("RunGrant.probe_targets", "probes"),
    ("ProbeTarget.kind", "probes[].kind"),
    ("ProbeTarget.address", "probes[].address"),
    ("ProbeTarget.port", "probes[].port"),
    ("RunGrant.qga_assertions", "assertions"),
    ("QgaAssertion.id", "assertions[].id"),
    ("QgaAssertion.program", "assertions[].program"),
    ("QgaAssertion.args", "assertions[].args"),
    (
        "QgaAssertion.expect_stdout_contains",
        "assertions[].stdout_contains",
    ),
];

fn plan_key(wire_field: &str) -> String {
    if let Some((_, key)) = PLAN_KEYS.iter().find(|(wire, _)| *wire == wire_field) {
        return (*key).to_owned();
    }
    match wire_field.strip_prefix("ProbeExpectation.") {
        Some(rest) => format!("probes[].expect.{rest}"),
        None => wire_field.to_owned(),
    }
}

fn grant_refusal(error: &GrantError) -> String {
    match error {
        GrantError::Field(field) => format!(
            "{}: {} (a node would refuse this grant)",
            plan_key(field.field),
            field.reason
        ),
        GrantError::Inconsistent(reason) => format!("{reason} (a node would refuse this grant)"),
        other => format!("a node would refuse this grant: {other}"),
    }
}

/// One line per validation: what would run where.
pub fn describe(validation: &Validation) -> String {
    let grant = &validation.grant;
    let archives: Vec<&str> = grant.archives.iter().map(|a| a.as_str()).collect();
    let sandbox: Vec<String> = grant
        .sandbox_vms
        .iter()
        .map(|(vmid, limits)| {
            format!(
                "{vmid} ({} cores, {} MiB)",
                limits.max_cores, limits.max_memory_mib
            )
        })
        .collect();
    let probes: Vec<String> = grant
        .probe_targets
        .iter()
        .map(|p| format!("{} {}:{}", p.kind.name(), p.address, p.port))
        .collect();
    let assertions: Vec<&str> = grant.qga_assertions.keys().map(|id| id.as_str()).collect();
    let none = |list: String| if list.is_empty() { "none".into() } else { list };
    format!(
        "{name}: node {node} ({endpoint}) source VM {source} snapshot {snapshot} archives {archives} sandbox {sandbox} vnet {vnet} ({lifecycle}) probe source {probe_source} probes {probes} assertions {assertions} run {run}s guest agent {agent}s network recovery {recovery}",
        name = validation.name,
        node = grant.node,
        endpoint = validation.endpoint,
        source = validation.source_vmid,
        snapshot = grant.snapshot,
        archives = archives.join(","),
        sandbox = sandbox.join(", "),
        vnet = grant.vnet,
        lifecycle = validation.network_lifecycle.name(),
        probe_source = grant.probe_source,
        probes = none(probes.join(", ")),
        assertions = none(assertions.join(",")),
        run = validation.run_seconds,
        agent = validation.guest_agent_seconds,
        recovery = validation.network_recovery.name(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) const PLAN: &str = r#"storage:
  server: pbs.example.net
  datastore: backups
  namespace: nightly
  auth_id: certistack@pbs!restore
  fingerprint: "ab:cd:ef:01:23:45:67:89:ab:cd:ef:01:23:45:67:89:ab:cd:ef:01:23:45:67:89:ab:cd:ef:01:23:45:67:89"
  pbs_password_file: secrets/pbs-token
validations:
  - name: web01
    node: pve1
    source_vmid: 100
    snapshot: "2026-11-01T02:00:00Z"
    archives: [drive-scsi0.img]
    sandbox:
      - vmid: 9100
        cores: 2
        memory_mib: 2048
    network:
      lifecycle: preprovisioned
      vnet: csnet1
      probe_source: 10.99.0.1/24
    probes:
      - kind: tcp
        address: 10.99.0.10
        port: 22
        expect:
          banner_prefix: "SSH-2.0-"
    assertions:
      - id: nginx-active
        program: /usr/bin/systemctl
        args: [is-active, nginx]
        stdout_contains: active
        timeout_seconds: 30
  - name: db01
    node: pve1
    source_vmid: 101
    snapshot: "2026-11-01T02:10:00Z"
    archives: [drive-scsi0.img, drive-scsi1.img]
    sandbox:
      - vmid: 9101
        cores: 4
        memory_mib: 8192
    network:
      lifecycle: preprovisioned
      vnet: csnet1
      probe_source: 10.99.0.1/24
    network_recovery:
      mode: preserve
"#;

    fn config() -> ControllerConfig {
        ControllerConfig::parse(
            Path::new("controller.toml"),
            "state_dir = \"/s\"\nreports_dir = \"/r\"\n[[nodes]]\nname = \"pve1\"\naddress = \"192.0.2.11\"\nport = 7443\n",
        )
        .unwrap()
    }

    fn check(text: &str) -> Result<Plan, PlanError> {
        Plan::parse(
            Path::new("/plans/nightly.yaml"),
            text,
            &config(),
            1_800_000_000,
        )
    }

    fn refusal(text: &str) -> String {
        check(text).unwrap_err().to_string()
    }

    #[test]
    fn a_good_plan_maps_onto_grants_the_node_accepts() {
        let plan = check(PLAN).unwrap();
        assert_eq!(
            plan.pbs_password_file,
            Path::new("/plans/secrets/pbs-token")
        );
        assert_eq!(plan.validations.len(), 2);
        let web = &plan.validations[0];
        assert_eq!(web.wire.snapshot, "vm/100/2026-11-01T02:00:00Z");
        assert_eq!(web.wire.repository.as_ref().unwrap().port, 8007);
        assert_eq!(
            web.wire.deadline_unix - web.wire.not_before_unix,
            3600 + NOT_BEFORE_SLACK_SECS
        );
        assert_eq!(web.grant.sandbox_vms.len(), 1);
        assert_eq!(web.endpoint, "192.0.2.11:7443");
        let line = describe(web);
        assert!(line.starts_with("web01: node pve1 (192.0.2.11:7443) source VM 100 snapshot vm/100/2026-11-01T02:00:00Z archives drive-scsi0.img sandbox 9100 (2 cores, 2048 MiB) vnet csnet1 (preprovisioned) probe source 10.99.0.1/24 probes tcp 10.99.0.10:22 assertions nginx-active"), "{line}");
        assert!(describe(&plan.validations[1]).contains("probes none assertions none"));
    }

    #[test]
    fn syntax_errors_and_unknown_keys_carry_line_and_column() {
        let error = refusal(&PLAN.replace("    source_vmid: 101", "    source_vmdi: 101"));
        assert!(error.starts_with("/plans/nightly.yaml:36:5: "), "{error}");
        assert!(
            !error.contains("line 36"),
            "the position is printed once: {error}"
        );
        assert!(error.contains("source_vmdi"), "{error}");
        let error = refusal(&PLAN.replace("  datastore: backups", "  datastore: [backups"));
        assert!(error.starts_with("/plans/nightly.yaml:"), "{error}");
        assert!(!error.starts_with("/plans/nightly.yaml:?"), "{error}");
        let error = refusal(&PLAN.replace(
            "    source_vmid: 101",
            "    source_vmid: 101\n    source_vmid: 102",
        ));
        assert!(error.starts_with("/plans/nightly.yaml:37:"), "{error}");
        assert!(error.contains("source_vmid"), "{error}");
    }

    #[test]
    fn an_inline_secret_is_refused_where_it_is_written() {
        let error = refusal(&PLAN.replace(
            "  pbs_password_file: secrets/pbs-token",
            "  pbs_password_file: secrets/pbs-token\n  pbs_password: hunter2",
        ));
        assert!(error.starts_with("/plans/nightly.yaml:8:"), "{error}");
        assert!(error.contains("secrets go in files"), "{error}");
        assert!(error.contains(SECRETS_DOC), "{error}");
        assert!(!error.contains("hunter2"), "{error}");
    }

    #[test]
    fn latest_is_refused_with_what_to_give_instead() {
        let error = refusal(&PLAN.replace("\"2026-11-01T02:00:00Z\"", "latest"));
        assert!(error.starts_with("/plans/nightly.yaml:12:"), "{error}");
        assert!(
            error.contains(
                "resolving latest comes with PBS API support; give the exact snapshot time"
            ),
            "{error}"
        );
    }

    #[test]
    fn vmids_out_of_range_are_refused() {
        let error = refusal(&PLAN.replace("vmid: 9100", "vmid: 99"));
        assert!(error.starts_with("/plans/nightly.yaml:15:"), "{error}");
        assert!(
            error.contains("VMID 99 is outside 100..=999999999"),
            "{error}"
        );
        let error = refusal(&PLAN.replace("source_vmid: 100", "source_vmid: 1000000000"));
        assert!(error.contains("VMID 1000000000 is outside"), "{error}");
    }

    #[test]
    fn the_same_sandbox_vmid_twice_on_one_node_is_refused() {
        let error = refusal(&PLAN.replace("vmid: 9101", "vmid: 9100"));
        assert!(error.contains("validations[1] (db01).sandbox"), "{error}");
        assert!(
            error.contains("sandbox VMID 9100 is also used by validation web01 on node pve1"),
            "{error}"
        );
    }

    #[test]
    fn rewrite_is_the_default_and_preserve_the_explicit_opt_out() {
        let plan = check(PLAN).unwrap();
        let web = &plan.validations[0];
        assert_eq!(web.network_recovery, NetworkRecoveryMode::Rewrite);
        assert_eq!(
            web.wire.network_recovery_modes,
            [pb::NetworkRecoveryMode::Rewrite as i32],
            "a validation without network_recovery rewrites"
        );
        // The one address the probes target, with the probe network's prefix.
        assert_eq!(web.wire.guest_address, "10.99.0.10/24");
        assert_eq!(
            plan.validations[1].wire.network_recovery_modes,
            [pb::NetworkRecoveryMode::Preserve as i32],
            "preserve, written, is the opt-out"
        );
        assert!(plan.validations[1].wire.guest_address.is_empty());

        // Without probes there is no address to take: the error names the field, says the
        // mode came by default, and what to write instead.
        let preserve = "    network_recovery:\n      mode: preserve\n";
        let error = refusal(&PLAN.replace(preserve, ""));
        for part in [
            "validations[1] (db01).network_recovery.guest_address",
            "network_recovery.mode is rewrite (the default)",
            "they target 0",
            "`network_recovery: {guest_address: <address>/<prefix>}`",
            "inside network.probe_source 10.99.0.1/24",
            "`network_recovery: {mode: preserve}`",
        ] {
            assert!(error.contains(part), "{part}: {error}");
        }
        let error = refusal(&PLAN.replace("mode: preserve", "mode: rewrite"));
        assert!(
            error.contains("network_recovery.mode is rewrite and needs"),
            "{error}"
        );
        let named = check(&PLAN.replace(
            "mode: preserve\n",
            "mode: rewrite\n      guest_address: 10.99.0.20/24\n",
        ))
        .unwrap();
        assert_eq!(named.validations[1].wire.guest_address, "10.99.0.20/24");
        let defaulted =
            check(&PLAN.replace("mode: preserve\n", "guest_address: 10.99.0.20/24\n")).unwrap();
        assert_eq!(
            defaulted.validations[1].network_recovery,
            NetworkRecoveryMode::Rewrite
        );
        // The node's rule, in the plan's words: inside the probe network.
        let error = refusal(&PLAN.replace(
            "mode: preserve\n",
            "mode: rewrite\n      guest_address: 10.98.0.20/24\n",
        ));
        assert!(error.contains("not in the probe network"), "{error}");
    }

    #[test]
    fn a_probe_target_outside_the_probe_network_is_refused() {
        let error = refusal(&PLAN.replace("address: 10.99.0.10", "address: 10.98.0.10"));
        assert!(error.contains("validations[0] (web01)"), "{error}");
        assert!(
            error.contains("outside the probe network 10.99.0.1/24"),
            "{error}"
        );
    }

    #[test]
    fn a_node_not_in_the_inventory_is_refused() {
        let error = refusal(&PLAN.replace(
            "node: pve1\n    source_vmid: 101",
            "node: pve9\n    source_vmid: 101",
        ));
        assert!(error.contains("validations[1] (db01).node"), "{error}");
        assert!(
            error.contains("\"pve9\" is not in the controller's inventory (pve1)"),
            "{error}"
        );
    }

    #[test]
    fn an_ephemeral_network_is_not_yet_supported() {
        let error = refusal(&PLAN.replacen("lifecycle: preprovisioned", "lifecycle: ephemeral", 1));
        assert!(
            error.starts_with("/plans/nightly.yaml:19:18: `ephemeral`"),
            "{error}"
        );
        assert!(
            error.contains("not yet supported, use preprovisioned"),
            "{error}"
        );
    }

    #[test]
    fn what_the_node_validates_is_refused_in_the_plan_words() {
        let error = refusal(&PLAN.replace("vnet: csnet1", "vnet: \"cs net\""));
        assert!(error.contains("network.vnet:"), "{error}");
        assert!(error.contains("a node would refuse this grant"), "{error}");
        let error = refusal(&PLAN.replace("cores: 2", "cores: 65"));
        assert!(error.contains("max_cores must be 1..=64"), "{error}");
        let error = refusal(&PLAN.replace("run_seconds", "x").replace(
            "  - name: db01",
            "    timeouts:\n      run_seconds: 90000\n  - name: db01",
        ));
        assert!(error.contains("timeouts.run_seconds"), "{error}");
    }
}
