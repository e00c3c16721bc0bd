//! Plans: what an operator asks the controller to validate, written in YAML.
//!
//! A plan is checked completely before any node is contacted, in three steps: the plan as
//! written (`file`), the resolved validations (`resolve`: every value decided, each with where it
//! came from) and the grants (`wire`). Each validation is turned into the
//! `RunGrant` its node will receive, and that grant is put through the connector's own parser
//! (signed with a throwaway key, verified, decoded, every field validated), so a plan the
//! controller accepts is one a node accepts, for the same reasons. What a grant cannot say (the
//! node inventory, secrets kept in files, a sandbox VMID used twice anywhere in the plan) is
//! checked here.
//!
//! YAML is read with `serde-saphyr`: a maintained, panic-free parser (unsafe code forbidden,
//! fuzzed) with input budgets and line/column on every error, including the errors our own
//! field types raise, so a refusal points at the line to change.

pub mod backup;
pub mod cluster;
mod file;
pub mod latest;
pub mod needs;
pub mod placement;
mod resolve;
pub mod sdn;
pub mod show;
#[cfg(test)]
mod tests;
mod wire;

use backup::{BackupFacts, read_backup};
use cluster::{Cluster, ClusterError, ExpandError, NoCluster};
use file::*;
pub use file::{DnsType, NetworkLifecycle, NetworkRecoveryMode, ProbeKind};
use latest::{
    BackupCatalog, CatalogError, LatestError, LatestFound, NoCatalog, newest_finished,
    snapshot_time,
};
pub use resolve::{
    Origin, ResolvedAssertion, ResolvedExpect, ResolvedNetwork, ResolvedNetworkRecovery,
    ResolvedProbe, ResolvedSandboxVm, ResolvedStorage, ResolvedTimeouts, ResolvedValidation,
    Sourced,
};
use wire::*;

use crate::config::ControllerConfig;
use certistack_core::files::{self, FileError};
use certistack_core::grant::{self, Grant, GrantError};
use certistack_core::validate::Vmid;
use certistack_proto::v1 as pb;
use serde::{Deserialize, Deserializer, Serialize};
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
    /// The PBS API could not be asked while the plan was resolved: the plan may be fine.
    #[error("{path}: {at}: {reason}")]
    Unavailable {
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
    /// The PVE API token lacks privileges the plan needs: every one, at once.
    #[error("{path}: {}", privileges_text(.lacking))]
    Privileges {
        path: PathBuf,
        lacking: needs::Lacking,
    },
}

impl PlanError {
    /// What the PVE API's failure to answer means for the plan at `path`, said at `at`: a
    /// secret file refused, the API unavailable (the plan may be fine), or a refusal.
    pub(super) fn of_cluster(path: &Path, at: &str, error: ClusterError) -> Self {
        let (path, at) = (path.to_owned(), at.to_owned());
        match error {
            ClusterError::Secret(error) => Self::Secret {
                path,
                at: "pve.token_secret_file",
                error,
            },
            ClusterError::Unavailable(reason) => Self::Unavailable { path, at, reason },
            ClusterError::Refused(reason) => Self::Refused { path, at, reason },
        }
    }
}

/// What a refusal for missing privileges says: each need, then the lines that grant them all.
fn privileges_text(lacking: &needs::Lacking) -> String {
    let mut text = format!(
        "the PVE API token lacks {} privilege(s) the plan needs; nothing was asked of any node:",
        lacking.required.len()
    );
    for need in &lacking.required {
        text.push_str(&format!(
            "\n  {} on {}: {}",
            need.privilege, need.path, need.why
        ));
    }
    for need in &lacking.worked_around {
        text.push_str(&format!(
            "\n  (worked around) {} on {}: {}",
            need.privilege, need.path, need.why
        ));
    }
    text.push_str("\ngrant them with:");
    for line in &lacking.grant {
        text.push_str(&format!("\n  {line}"));
    }
    text
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
    /// The PBS repository, each value with where it came from.
    pub storage: ResolvedStorage,
    /// The validations that run, in plan order.
    pub validations: Vec<Validation>,
    /// The validations that fail before any node is asked (`latest` found no finished
    /// backup, or one older than `max_age_hours`), in plan order.
    pub failed_before_run: Vec<FailedBeforeRun>,
    /// The validations placement put on no node, in plan order.
    pub unplaced: Vec<Unplaced>,
    /// The nodes placement found room on for fewer than `--per-node` validations at once:
    /// the run keeps to it.
    pub at_once: BTreeMap<String, usize>,
    /// What the plan works around (a privilege a tag selection would use), for the operator.
    pub warnings: Vec<String>,
    /// Whether placement asked any node's connector (Hello, its prerequisites).
    pub asked_nodes: bool,
}

impl Plan {
    /// Every validation's resolved values, the ones that run and the ones that fail before
    /// any node is asked, in plan order.
    pub fn resolved_in_order(&self) -> Vec<&ResolvedValidation> {
        let mut all: Vec<(usize, &ResolvedValidation)> = self
            .validations
            .iter()
            .map(|v| (v.index, &v.resolved))
            .chain(
                self.failed_before_run
                    .iter()
                    .map(|f| (f.index, &f.resolved)),
            )
            .chain(self.unplaced.iter().map(|u| (u.index, &u.resolved)))
            .collect();
        all.sort_by_key(|(index, _)| *index);
        all.into_iter().map(|(_, resolved)| resolved).collect()
    }
}

/// A validation placement could put on no node (`node: auto` or a list): no grant, an error
/// in the run's summary, nothing created anywhere.
#[derive(Debug)]
pub struct Unplaced {
    /// Its place in the plan.
    pub index: usize,
    pub resolved: ResolvedValidation,
    pub why: String,
}

/// A validation that fails before any node is asked: no grant, a signed failed report.
#[derive(Debug)]
pub struct FailedBeforeRun {
    /// Its place in the plan.
    pub index: usize,
    pub resolved: ResolvedValidation,
    pub why: backup::FailsBeforeRun,
}

#[derive(Debug)]
pub struct Validation {
    /// Its place in the plan.
    pub index: usize,
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
    /// Every value the grant was built from, with where it came from (`plan show`).
    pub resolved: ResolvedValidation,
}

/// What resolution may ask beyond the plan and the configuration: the PBS API (`snapshot:
/// latest`, sizes, archives) and the PVE API (`select`, sandbox VMIDs).
#[derive(Clone, Copy)]
pub struct Resolvers<'a> {
    pub catalog: &'a dyn BackupCatalog,
    pub cluster: &'a dyn Cluster,
    pub rooms: &'a dyn placement::Rooms,
}

impl std::fmt::Debug for Resolvers<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Resolvers")
    }
}

impl Resolvers<'static> {
    /// Nothing to ask: what needs an API is refused, saying which.
    pub fn none() -> Self {
        Self {
            catalog: &NoCatalog,
            cluster: &NoCluster,
            rooms: &placement::NoRooms,
        }
    }
}

impl Plan {
    /// Reads and checks the plan at `path` against the controller's inventory. Nothing is
    /// contacted.
    pub fn load(path: &Path, config: &ControllerConfig, now_unix: i64) -> Result<Self, PlanError> {
        Self::load_with(path, config, now_unix, Resolvers::none())
    }

    /// [`Plan::load`], asking `resolvers` what the plan leaves to the APIs.
    pub fn load_with(
        path: &Path,
        config: &ControllerConfig,
        now_unix: i64,
        resolvers: Resolvers<'_>,
    ) -> Result<Self, PlanError> {
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
        let plan = Self::parse_resolving(path, &text, config, now_unix, resolvers)?;
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

    /// Parses and checks plan text in the three steps (as written, resolved, granted), with no
    /// catalog: `snapshot: latest` is refused. Secret files are resolved but not opened.
    pub fn parse(
        path: &Path,
        text: &str,
        config: &ControllerConfig,
        now_unix: i64,
    ) -> Result<Self, PlanError> {
        Self::parse_with(path, text, config, now_unix, &NoCatalog)
    }

    /// [`Plan::parse`], resolving `snapshot: latest` through `catalog` (which may read the PBS
    /// secret file to ask the PBS API).
    pub fn parse_with(
        path: &Path,
        text: &str,
        config: &ControllerConfig,
        now_unix: i64,
        catalog: &dyn BackupCatalog,
    ) -> Result<Self, PlanError> {
        Self::parse_resolving(
            path,
            text,
            config,
            now_unix,
            Resolvers {
                catalog,
                cluster: &NoCluster,
                rooms: &placement::NoRooms,
            },
        )
    }

    /// [`Plan::parse`], asking `resolvers` what the plan leaves to the APIs.
    pub fn parse_resolving(
        path: &Path,
        text: &str,
        config: &ControllerConfig,
        now_unix: i64,
        resolvers: Resolvers<'_>,
    ) -> Result<Self, PlanError> {
        let file = read_written(path, text)?;
        // Before anything else is asked: every privilege the plan needs, every missing one
        // said at once.
        let lacking = needs::lacking(&needs::needs(&file, config), resolvers.cluster)
            .map_err(|error| PlanError::of_cluster(path, "pve (the token's privileges)", error))?;
        if !lacking.required.is_empty() {
            return Err(PlanError::Privileges {
                path: path.to_owned(),
                lacking,
            });
        }
        let warnings: Vec<String> = lacking
            .worked_around
            .iter()
            .map(|need| {
                format!(
                    "the PVE API token lacks {} on {}: {}; grant it with: {}",
                    need.privilege,
                    need.path,
                    need.why,
                    lacking.grant.join("; ")
                )
            })
            .collect();
        let mut resolved = resolve::resolve(
            path,
            &file,
            config,
            resolvers.catalog,
            resolvers.cluster,
            now_unix,
        )?;
        // The VNets as SDN has them, before placement asks any node; then, once each
        // validation has its node, whether the zone is there.
        check_sdn(path, &resolved.validations, resolvers.cluster, false)?;
        let at_once = place_validations(path, &mut resolved.validations, config, resolvers.rooms)?;
        check_sdn(path, &resolved.validations, resolvers.cluster, true)?;
        let mut validations = Vec::with_capacity(resolved.validations.len());
        let mut failed_before_run = Vec::new();
        let mut unplaced = Vec::new();
        for (index, mut validation) in resolved.validations.into_iter().enumerate() {
            if let Some(why) = validation.unplaced.clone() {
                unplaced.push(Unplaced {
                    index,
                    resolved: validation,
                    why,
                });
                continue;
            }
            if let Some(why) = validation.fails_before_run.take() {
                validation.fails_before_run = Some(backup::FailsBeforeRun {
                    manifest: None,
                    ..why.clone()
                });
                failed_before_run.push(FailedBeforeRun {
                    index,
                    resolved: validation,
                    why,
                });
                continue;
            }
            let validation =
                granted(&resolved.storage, validation, index, now_unix).map_err(|error| {
                    PlanError::Refused {
                        path: path.to_owned(),
                        at: format!("validations[{index}] ({})", error.name),
                        reason: grant_refusal(&error.error),
                    }
                })?;
            validations.push(validation);
        }
        Ok(Self {
            path: path.to_owned(),
            digest: crate::report::sha256_text(text.as_bytes()),
            pbs_password_file: resolved.storage.pbs_password_file.value.clone(),
            encryption_key_file: resolved.storage.encryption_key_file.value.clone(),
            storage: resolved.storage,
            validations,
            failed_before_run,
            unplaced,
            at_once,
            warnings,
            asked_nodes: resolvers.rooms.asked_nodes(),
        })
    }
}

/// The (node, VNet) pairs placement may check for one plan.
pub const MAX_PLACEMENT_CHECKS: usize = 1024;

/// Places every validation whose node is a choice (`auto`, a list), in plan order, on the
/// node with the most room of those ready; one no node can take is marked `unplaced`, saying
/// why. A validation that fails before any node is asked needs no node.
fn place_validations(
    path: &Path,
    validations: &mut [ResolvedValidation],
    config: &ControllerConfig,
    rooms: &dyn placement::Rooms,
) -> Result<BTreeMap<String, usize>, PlanError> {
    let choosing: Vec<usize> = validations
        .iter()
        .enumerate()
        .filter(|(_, v)| v.candidates.is_some() && v.fails_before_run.is_none())
        .map(|(i, _)| i)
        .collect();
    let Some(&first) = choosing.first() else {
        return Ok(BTreeMap::new());
    };
    let at = validations
        .get(first)
        .map(|v| format!("{} ({}).node", v.key, v.name))
        .unwrap_or_default();
    // Only what the choices need is asked: each candidate with the VNet of its validation.
    let pairs: BTreeSet<(String, String)> = choosing
        .iter()
        .filter_map(|&i| validations.get(i))
        .flat_map(|v| {
            v.candidates
                .iter()
                .flatten()
                .map(|node| (node.clone(), v.network.vnet.value.clone()))
        })
        .collect();
    // Each pair is one node's checks with one VNet: a plan may make placement ask so many.
    if pairs.len() > MAX_PLACEMENT_CHECKS {
        return Err(PlanError::Refused {
            path: path.to_owned(),
            at,
            reason: format!(
                "placement would check {} (node, VNet) pairs, more than {MAX_PLACEMENT_CHECKS}: name fewer candidate nodes (node: [..]) or use fewer VNets",
                pairs.len()
            ),
        });
    }
    let room = rooms.rooms(&pairs).map_err(|error| match error {
        placement::RoomsError::Unavailable(reason) => PlanError::Unavailable {
            path: path.to_owned(),
            at: at.clone(),
            reason,
        },
        placement::RoomsError::Refused(reason) => PlanError::Refused {
            path: path.to_owned(),
            at: at.clone(),
            reason,
        },
    })?;
    let memory = |v: &ResolvedValidation| -> u64 {
        v.sandbox
            .iter()
            .map(|vm| u64::from(vm.memory_mib.value))
            .sum()
    };
    let demands: Vec<placement::Demand> = choosing
        .iter()
        .filter_map(|&i| {
            let v = validations.get(i)?;
            Some(placement::Demand {
                candidates: v.candidates.clone().unwrap_or_default(),
                vm_cores: v.sandbox.iter().map(|vm| vm.cores.value).max().unwrap_or(0),
                memory_mib: memory(v),
                vnet: v.network.vnet.value.clone(),
            })
        })
        .collect();
    // What the plan runs on a named node is load there too.
    let mut named: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for v in validations
        .iter()
        .filter(|v| v.candidates.is_none() && v.fails_before_run.is_none())
    {
        named
            .entry(v.node.value.clone())
            .or_default()
            .push(memory(v));
    }
    let placement = placement::place(&demands, &named, &room, rooms.per_node());
    for (&i, placed) in choosing.iter().zip(placement.placed) {
        let Some(v) = validations.get_mut(i) else {
            continue;
        };
        let written = v.node.value.clone();
        match placed {
            placement::Placed::On { node, why } => {
                let endpoint = config
                    .nodes
                    .iter()
                    .find(|(name, _)| name.as_str() == node)
                    .map(|(_, inventory)| inventory.endpoint())
                    .unwrap_or_default();
                v.endpoint =
                    Sourced::new(endpoint, Origin::Configuration, format!("nodes ({node})"));
                v.node = Sourced::new(node, Origin::Placement, format!("node {written}: {why}"));
            }
            placement::Placed::Nowhere(why) => {
                v.unplaced = Some(format!("node {written}: {why}"));
            }
        }
    }
    Ok(placement.at_once)
}

/// Every VNet a validation runs on, as the SDN configuration has it (`sdn`): its
/// configuration, or (`on_nodes`, once placed) whether its zone is on the validation's node.
/// Refused before the run asks any node. Without `[pve]` the nodes' checks alone judge it.
fn check_sdn(
    path: &Path,
    validations: &[ResolvedValidation],
    cluster: &dyn Cluster,
    on_nodes: bool,
) -> Result<(), PlanError> {
    if !cluster.configured() {
        return Ok(());
    }
    for v in validations.iter().filter(|v| {
        v.fails_before_run.is_none()
            && (!on_nodes || (v.unplaced.is_none() && !v.node.value.is_empty()))
    }) {
        let at = format!("{} ({}).network.vnet", v.key, v.name);
        let vnet = &v.network.vnet.value;
        // A name that is no VNet id is refused when the grant is built, saying so; it is not
        // put into an API path.
        if <certistack_core::validate::VnetName as certistack_core::validate::Validated>::validate(
            vnet,
        )
        .is_err()
        {
            continue;
        }
        let view = match cluster.sdn_vnet(vnet) {
            Ok(Some(view)) => view,
            Ok(None) => continue,
            Err(error) => return Err(PlanError::of_cluster(path, &at, error)),
        };
        let found = if on_nodes {
            sdn::node_problems(&view, &v.node.value)
        } else {
            sdn::configuration_problems(&view, vnet)
        };
        if !found.is_empty() {
            return Err(PlanError::Refused {
                path: path.to_owned(),
                at,
                reason: if on_nodes {
                    format!(
                        "VNet {vnet} (zone {}) may not hold a sandbox on node {}: {}",
                        view.zone,
                        v.node.value,
                        found.join("; ")
                    )
                } else {
                    format!(
                        "VNet {vnet} (zone {}) may not hold a sandbox: {}",
                        view.zone,
                        found.join("; ")
                    )
                },
            });
        }
    }
    Ok(())
}

/// Step one: the plan as written, every key known and every single value checked as it is read.
pub(in crate::plan) fn read_written(path: &Path, text: &str) -> Result<PlanFile, PlanError> {
    serde_saphyr::from_str(text).map_err(|error| {
        let position = error.location().filter(|at| at.line() > 0).map_or_else(
            || "?".to_owned(),
            |at| format!("{}:{}", at.line(), at.column()),
        );
        PlanError::Syntax {
            path: path.to_owned(),
            position,
            reason: first_line(&error.to_string()),
        }
    })
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
