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

mod file;
#[cfg(test)]
mod tests;
mod wire;

use file::*;
pub use file::{NetworkLifecycle, NetworkRecoveryMode};
use wire::*;

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
