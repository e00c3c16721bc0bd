//! The resolved validation: every value one validation runs with, each carrying where it came
//! from and the key that says so. A plan is read in three steps: the plan as written (`file`,
//! checked while it is read) → the resolved plan (here: each value decided, the rules that span
//! several keys or validations checked) → the grants (`wire`). Today every value is decided by
//! the plan itself (written, one of its documented defaults, or worked out from other keys) or
//! by the controller configuration; resolvers that decide what a plan does not spell out
//! (`snapshot: latest`, `select`, `node: auto`, VMIDs from a range, ephemeral VNets) add their
//! own [`Origin`] and run here, before any grant exists.

use super::*;

/// Where a resolved value came from. Printed by `plan show` in lower case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// Written in the plan, at the key.
    Plan,
    /// Not written in the plan: the key's documented default (docs/plans.md).
    Default,
    /// Not written in the plan: worked out from the plan keys named.
    Derived,
    /// Asked of the PBS API (`snapshot: latest`).
    Pbs,
    /// Asked of the PVE API (`select`, sandbox VMIDs from `[pve] sandbox_vmid_range`).
    Pve,
    /// Chosen by placement (`node: auto` or a list): the node with the most room of those
    /// ready, the key saying why.
    Placement,
    /// The controller configuration (its node inventory), at the key.
    Configuration,
}

impl Origin {
    pub fn name(self) -> &'static str {
        match self {
            Self::Plan => "plan",
            Self::Default => "default",
            Self::Derived => "derived",
            Self::Pbs => "pbs",
            Self::Pve => "pve",
            Self::Placement => "placement",
            Self::Configuration => "configuration",
        }
    }
}

/// A value and where it came from.
#[derive(Debug, Clone, Serialize)]
pub struct Sourced<T> {
    pub value: T,
    pub source: Origin,
    /// The key the value was read from (or, for a default, the key that would set it).
    pub key: String,
}

impl<T> Sourced<T> {
    pub(super) fn new(value: T, source: Origin, key: String) -> Self {
        Self { value, source, key }
    }

    pub(super) fn plan(value: T, key: String) -> Self {
        Self::new(value, Origin::Plan, key)
    }

    /// The written value, or the default when the key is absent.
    fn written_or(written: Option<T>, default: T, key: String) -> Self {
        match written {
            Some(value) => Self::plan(value, key),
            None => Self::new(default, Origin::Default, key),
        }
    }
}

/// The PBS repository every validation of the plan reads from.
#[derive(Debug, Clone, Serialize)]
pub struct ResolvedStorage {
    pub server: Sourced<String>,
    pub port: Sourced<u16>,
    pub datastore: Sourced<String>,
    pub namespace: Sourced<String>,
    pub auth_id: Sourced<String>,
    pub fingerprint: Sourced<String>,
    /// Resolved against the plan's directory; the file is named, never read, by resolution.
    pub pbs_password_file: Sourced<PathBuf>,
    /// `None` (by default) when the backups are not encrypted.
    pub encryption_key_file: Sourced<Option<PathBuf>>,
}

impl ResolvedStorage {
    pub fn wire(&self) -> pb::PbsRepository {
        pb::PbsRepository {
            server: self.server.value.clone(),
            port: u32::from(self.port.value),
            datastore: self.datastore.value.clone(),
            namespace: self.namespace.value.clone(),
            auth_id: self.auth_id.value.clone(),
            fingerprint: self.fingerprint.value.clone(),
        }
    }
}

/// One validation with every value decided.
#[derive(Debug, Clone, Serialize)]
pub struct ResolvedValidation {
    pub name: String,
    /// `validations[i]`: where the validation is written in the plan.
    #[serde(skip)]
    pub key: String,
    pub node: Sourced<String>,
    /// Where the node's connector listens, `HOST:PORT`.
    pub endpoint: Sourced<String>,
    /// With `node: auto` or a list: the nodes placement chose among; `None` for a named node.
    #[serde(skip)]
    pub candidates: Option<Vec<String>>,
    /// With `node: auto` or a list, why no node could take it; `None` once placed (or for a
    /// named node).
    pub unplaced: Option<String>,
    pub source_vmid: Sourced<Vmid>,
    /// The snapshot's time, `YYYY-MM-DDTHH:MM:SSZ`.
    pub snapshot: Sourced<String>,
    /// With `snapshot: latest`, what the PBS listing showed; `None` for an exact time.
    pub latest: Option<LatestFound>,
    /// With `snapshot: latest`: the oldest its newest finished backup may be.
    pub max_age_hours: Sourced<Option<u32>>,
    /// Why the validation fails before any node is asked (no finished backup, or one older
    /// than `max_age_hours`); `None` for one that runs.
    pub fails_before_run: Option<backup::FailsBeforeRun>,
    pub archives: Sourced<Vec<String>>,
    /// Each archive's size in bytes, when the snapshot's listing was read.
    pub archive_sizes: BTreeMap<String, u64>,
    pub sandbox: Vec<ResolvedSandboxVm>,
    pub network: ResolvedNetwork,
    pub probes: Vec<ResolvedProbe>,
    pub assertions: Vec<ResolvedAssertion>,
    pub timeouts: ResolvedTimeouts,
    pub network_recovery: ResolvedNetworkRecovery,
}

/// A probe, each key with where it came from.
#[derive(Debug, Clone, Serialize)]
pub struct ResolvedProbe {
    pub kind: Sourced<ProbeKind>,
    pub address: Sourced<String>,
    pub port: Sourced<u16>,
    pub expect: ResolvedExpect,
}

/// What a probe expects; an empty string, `0`, `[]` or `null` checks nothing.
#[derive(Debug, Clone, Serialize)]
pub struct ResolvedExpect {
    pub banner_prefix: Sourced<String>,
    pub http_path: Sourced<String>,
    pub http_status: Sourced<u16>,
    pub body_contains: Sourced<String>,
    pub body_sha256: Sourced<String>,
    pub dns_name: Sourced<String>,
    pub dns_type: Sourced<Option<DnsType>>,
    pub dns_answers: Sourced<Vec<String>>,
    pub ldap_naming_context: Sourced<String>,
}

/// An assertion, each key with where it came from.
#[derive(Debug, Clone, Serialize)]
pub struct ResolvedAssertion {
    pub id: Sourced<String>,
    pub program: Sourced<String>,
    pub args: Sourced<Vec<String>>,
    pub exit_code: Sourced<i32>,
    pub stdout_contains: Sourced<String>,
    pub timeout_seconds: Sourced<u32>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ResolvedSandboxVm {
    pub vmid: Sourced<Vmid>,
    pub cores: Sourced<u32>,
    pub memory_mib: Sourced<u32>,
    /// The caps on cores and memory taken from the backup.
    pub max_cores: Sourced<u32>,
    pub max_memory_mib: Sourced<u32>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ResolvedNetwork {
    pub lifecycle: Sourced<NetworkLifecycle>,
    pub vnet: Sourced<String>,
    pub probe_source: Sourced<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ResolvedTimeouts {
    pub run_seconds: Sourced<u32>,
    pub guest_agent_seconds: Sourced<u32>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ResolvedNetworkRecovery {
    pub mode: Sourced<NetworkRecoveryMode>,
    /// The sandbox NIC's address/prefix in the guest; empty with `preserve`.
    pub guest_address: Sourced<String>,
}

/// The plan with every value of every validation decided, before any grant is built.
#[derive(Debug, Clone)]
pub(super) struct ResolvedPlan {
    pub(super) storage: ResolvedStorage,
    pub(super) validations: Vec<ResolvedValidation>,
}

/// Step two, for a plan whose values all come from the plan and the configuration: nothing is
/// contacted. Checks what spans several keys or validations; what a single key or the grant
/// checks is checked where it is read and where the grant is built.
pub(super) fn resolve(
    path: &Path,
    file: &PlanFile,
    config: &ControllerConfig,
    catalog: &dyn BackupCatalog,
    cluster: &dyn Cluster,
    now_unix: i64,
) -> Result<ResolvedPlan, PlanError> {
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
    let storage = resolve_storage(path, &file.storage);
    let expanded = cluster::expand(&file.validations, cluster).map_err(|(index, error)| {
        let name = file.validations.get(index).map_or("", |v| v.name.as_str());
        let at = |key: String| format!("validations[{index}] ({name}){key}");
        match error {
            ExpandError::Refused(key, reason) => refused(at(key), reason),
            ExpandError::Unavailable(key, reason) => PlanError::Unavailable {
                path: path.to_owned(),
                at: at(key),
                reason,
            },
            ExpandError::Secret(error) => PlanError::Secret {
                path: path.to_owned(),
                at: "pve.token_secret_file",
                error,
            },
        }
    })?;
    let mut names = BTreeSet::new();
    // Each sandbox VMID the plan writes: the validation and node that use it.
    let mut sandbox_vmids: BTreeMap<Vmid, (String, String)> = BTreeMap::new();
    // Each sandbox VM the plan leaves without a VMID, and each that has one (with its key).
    let mut omitted: Vec<cluster::Omitted> = Vec::new();
    let mut written: Vec<(usize, Vmid)> = Vec::new();
    let mut validations = Vec::with_capacity(expanded.len());
    // What `latest` and the sizes will ask one VM at a time is asked at once first.
    let latest: Vec<Vmid> = expanded
        .iter()
        .filter(|e| matches!(e.file.snapshot, SnapshotFile::Latest))
        .map(|e| e.source_vmid.value)
        .collect();
    let configs: Vec<Vmid> = expanded
        .iter()
        .filter(|e| {
            matches!(e.file.snapshot, SnapshotFile::Latest)
                && e.file
                    .sandbox
                    .iter()
                    .any(|vm| vm.cores.is_none() || vm.memory_mib.is_none())
        })
        .map(|e| e.source_vmid.value)
        .collect();
    if !latest.is_empty() {
        catalog.prefetch(&storage, &latest, &configs);
    }
    for expansion in &expanded {
        let (index, v) = (expansion.plan_index, &expansion.file);
        let at = |key: &str| format!("validations[{index}] ({}){key}", v.name);
        check_name(&v.name)
            .map_err(|reason| refused(format!("validations[{index}].name"), reason))?;
        if !names.insert(v.name.clone()) {
            return Err(refused(
                at(".name"),
                "another validation has this name; give each a name of its own".into(),
            ));
        }
        let source = expansion.source_vmid.clone();
        let mut resolved = resolve_validation(index, v, source.clone(), config)
            .map_err(|(key, reason)| refused(at(&key), reason))?;
        let backup = read_backup(v, source.value, &storage, catalog, now_unix).map_err(
            |error| match error {
                LatestError::Secret(error) => PlanError::Secret {
                    path: path.to_owned(),
                    at: "storage.pbs_password_file",
                    error,
                },
                LatestError::Refused(key, reason) => refused(at(&key), reason),
                LatestError::Unavailable(key, reason) => PlanError::Unavailable {
                    path: path.to_owned(),
                    at: at(&key),
                    reason,
                },
            },
        )?;
        if let Some(backup) = backup {
            take_from_backup(&mut resolved, v, backup, index);
        }
        // PVE's VMIDs are unique across the cluster, not per node: a VMID on two nodes passes
        // each node's grant check and fails the second `qm create`.
        for (i, (vm, as_written)) in resolved.sandbox.iter().zip(&v.sandbox).enumerate() {
            if as_written.vmid.is_none() {
                omitted.push((validations.len(), i));
                continue;
            }
            written.push((validations.len(), vm.vmid.value));
            let this = (v.name.clone(), v.node.written());
            if let Some((other, other_node)) = sandbox_vmids.insert(vm.vmid.value, this) {
                let reason = if other == v.name {
                    format!(
                        "sandbox VMID {} is written twice in this validation; give each sandbox VM its own VMID",
                        vm.vmid.value
                    )
                } else if expansion.source_vmid.source == Origin::Pve {
                    format!(
                        "sandbox VMID {} is written in a validation that `select` expands to several ({other} has it too); leave the sandbox vmid out and set [pve] sandbox_vmid_range, so each gets its own",
                        vm.vmid.value
                    )
                } else {
                    format!(
                        "sandbox VMID {} is also used by validation {other} on node {other_node}; VMIDs are unique across a Proxmox VE cluster, so give each sandbox VM in the plan its own VMID",
                        vm.vmid.value
                    )
                };
                return Err(refused(at(".sandbox"), reason));
            }
        }
        validations.push(resolved);
    }
    // A sandbox VM must not take the VMID of a VM the plan backs up: that VM most likely
    // still exists in the cluster, and `qm create` would fail mid-run.
    let sources: BTreeMap<Vmid, &str> = validations
        .iter()
        .map(|v| (v.source_vmid.value, v.name.as_str()))
        .collect();
    for &(at, vmid) in &written {
        let Some(v) = validations.get(at) else {
            continue;
        };
        if let Some(source_of) = sources.get(&vmid) {
            return Err(refused(
                format!("{} ({}).sandbox", v.key, v.name),
                format!(
                    "sandbox VMID {vmid} is the source VM of validation {source_of}, which is likely still in the cluster; give the sandbox VM a VMID of its own"
                ),
            ));
        }
    }
    let cluster_failed =
        |at: String| move |error: ClusterError| PlanError::of_cluster(path, &at, error);
    // A written VMID the cluster already has fails `qm create` mid-run: refused before any
    // node is asked (the API sees every guest, whatever the token may audit).
    if cluster.configured() {
        cluster.prefetch_vmids(&written.iter().map(|&(_, vmid)| vmid).collect::<Vec<_>>());
        for &(at, vmid) in &written {
            let Some(v) = validations.get(at) else {
                continue;
            };
            let key = format!("{} ({}).sandbox", v.key, v.name);
            if cluster
                .vmid_in_use(vmid)
                .map_err(cluster_failed(key.clone()))?
            {
                return Err(refused(
                    key,
                    format!(
                        "sandbox VMID {vmid} is already used in the cluster (GET /cluster/nextid?vmid={vmid}: VM {vmid} already exists), perhaps by a guest the token cannot see or a leftover of an earlier run (certistack-ctl cleanup); choose another VMID, or leave it out to take one from [pve] sandbox_vmid_range"
                    ),
                ));
            }
        }
    }
    let taken: BTreeSet<Vmid> = sandbox_vmids
        .keys()
        .chain(sources.keys())
        .copied()
        .collect();
    let first_omitted = omitted
        .first()
        .and_then(|(at, i)| {
            validations
                .get(*at)
                .map(|v| format!("{} ({}).sandbox[{i}].vmid", v.key, v.name))
        })
        .unwrap_or_default();
    let assigned = cluster::assign_sandbox_vmids(&omitted, &taken, cluster)
        .map_err(cluster_failed(first_omitted))?;
    if let Some((low, high)) = cluster.sandbox_vmid_range() {
        for (&(at, i), vmid) in omitted.iter().zip(assigned) {
            if let Some(vm) = validations.get_mut(at).and_then(|v| v.sandbox.get_mut(i)) {
                vm.vmid = Sourced::new(
                    vmid,
                    Origin::Pve,
                    format!("pve.sandbox_vmid_range {low}-{high}, free in the cluster"),
                );
            }
        }
    }
    Ok(ResolvedPlan {
        storage,
        validations,
    })
}

/// Puts what was read of the backup where the plan left a value out: the snapshot for
/// `latest`, the archives, the sizes (the source's, capped).
fn take_from_backup(
    resolved: &mut ResolvedValidation,
    v: &ValidationFile,
    backup: BackupFacts,
    index: usize,
) {
    resolved.fails_before_run = backup.fails_before_run;
    if let Some((time, found)) = backup.latest {
        resolved.snapshot = Sourced::new(time, Origin::Pbs, key_of(index, "snapshot"));
        resolved.latest = Some(found);
    }
    if v.archives.is_none() {
        resolved.archives = Sourced::new(
            backup
                .archives
                .iter()
                .map(|(name, _)| name.clone())
                .collect(),
            Origin::Pbs,
            "the snapshot's disk archives".into(),
        );
    }
    let restored: BTreeSet<&String> = resolved.archives.value.iter().collect();
    resolved.archive_sizes = backup
        .archives
        .iter()
        .filter(|(name, _)| restored.contains(name))
        .filter_map(|(name, size)| Some((name.clone(), (*size)?)))
        .collect();
    if let Some(sizes) = backup.sizes {
        for (vm, written) in resolved.sandbox.iter_mut().zip(&v.sandbox) {
            if written.cores.is_none() {
                let source = sizes.cores.saturating_mul(sizes.sockets);
                vm.cores = Sourced::new(
                    source.min(vm.max_cores.value),
                    Origin::Pbs,
                    format!(
                        "qemu-server.conf: cores {} × sockets {}, at most max_cores {}",
                        sizes.cores, sizes.sockets, vm.max_cores.value
                    ),
                );
            }
            if written.memory_mib.is_none() {
                vm.memory_mib = Sourced::new(
                    sizes.memory_mib.min(vm.max_memory_mib.value),
                    Origin::Pbs,
                    format!(
                        "qemu-server.conf: memory {}, at most max_memory_mib {}",
                        sizes.memory_mib, vm.max_memory_mib.value
                    ),
                );
            }
        }
    }
}

/// `validations[i].name`.
fn key_of(index: usize, name: &str) -> String {
    format!("validations[{index}].{name}")
}

fn resolve_storage(path: &Path, storage: &StorageFile) -> ResolvedStorage {
    let base = path.parent().unwrap_or(Path::new("."));
    let key = |name: &str| format!("storage.{name}");
    ResolvedStorage {
        server: Sourced::plan(storage.server.clone(), key("server")),
        port: Sourced::written_or(storage.port, DEFAULT_PBS_PORT, key("port")),
        datastore: Sourced::plan(storage.datastore.clone(), key("datastore")),
        namespace: Sourced::written_or(storage.namespace.clone(), String::new(), key("namespace")),
        auth_id: Sourced::plan(storage.auth_id.clone(), key("auth_id")),
        fingerprint: Sourced::plan(storage.fingerprint.clone(), key("fingerprint")),
        pbs_password_file: Sourced::plan(
            base.join(&storage.pbs_password_file),
            key("pbs_password_file"),
        ),
        encryption_key_file: Sourced::written_or(
            storage
                .encryption_key_file
                .as_ref()
                .map(|file| Some(base.join(file))),
            None,
            key("encryption_key_file"),
        ),
    }
}

/// One validation's values; a refusal is the key (after `validations[i] (name)`) and why.
fn resolve_validation(
    index: usize,
    v: &ValidationFile,
    source_vmid: Sourced<Vmid>,
    config: &ControllerConfig,
) -> Result<ResolvedValidation, (String, String)> {
    let key = |name: &str| format!("validations[{index}].{name}");
    let inventory = || {
        config
            .nodes
            .keys()
            .map(|n| n.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let known = |name: &str| {
        config
            .nodes
            .iter()
            .find(|(known, _)| known.as_str() == name)
            .map(|(_, node)| node)
            .ok_or_else(|| {
                (
                    ".node".to_owned(),
                    format!(
                        "node {name:?} is not in the controller's inventory ({}); add it under [[nodes]] in the controller configuration or use one of those",
                        inventory()
                    ),
                )
            })
    };
    // A choice (`auto`, a list) is placed once the whole plan is resolved.
    let (node, endpoint, candidates) = match &v.node {
        NodeFile::Named(name) => {
            let node = known(name)?;
            (
                Sourced::plan(name.clone(), key("node")),
                Sourced::new(
                    node.endpoint(),
                    Origin::Configuration,
                    format!("nodes ({name})"),
                ),
                None,
            )
        }
        choice => {
            let candidates: Vec<String> = match choice {
                NodeFile::Among(names) => {
                    for name in names {
                        known(name)?;
                    }
                    names.clone()
                }
                _ => config.nodes.keys().map(|n| n.to_string()).collect(),
            };
            (
                Sourced::new(choice.written(), Origin::Plan, key("node")),
                Sourced::new(String::new(), Origin::Placement, key("node")),
                Some(candidates),
            )
        }
    };
    // Replaced before the plan is resolved (or the plan is refused): never reaches a grant.
    let unassigned =
        Vmid::parse("vmid", Vmid::MIN).map_err(|e| (".sandbox".to_owned(), e.to_string()))?;
    let timeouts = ResolvedTimeouts {
        run_seconds: Sourced::written_or(
            v.timeouts.run_seconds,
            DEFAULT_RUN_SECONDS,
            key("timeouts.run_seconds"),
        ),
        guest_agent_seconds: Sourced::written_or(
            v.timeouts.guest_agent_seconds,
            DEFAULT_GUEST_AGENT_SECONDS,
            key("timeouts.guest_agent_seconds"),
        ),
    };
    check_timeouts(
        timeouts.run_seconds.value,
        timeouts.guest_agent_seconds.value,
    )?;
    let network_recovery = resolve_network_recovery(index, v)?;
    for (i, vm) in v.sandbox.iter().enumerate() {
        if vm
            .max_cores
            .is_some_and(|n| !(1..=backup::MAX_CORES).contains(&n))
        {
            return Err((
                format!(".sandbox[{i}].max_cores"),
                format!("must be 1..={}", backup::MAX_CORES),
            ));
        }
        if vm
            .max_memory_mib
            .is_some_and(|n| !(backup::MIN_MEMORY_MIB..=backup::MAX_MEMORY_MIB).contains(&n))
        {
            return Err((
                format!(".sandbox[{i}].max_memory_mib"),
                format!(
                    "must be {}..={}",
                    backup::MIN_MEMORY_MIB,
                    backup::MAX_MEMORY_MIB
                ),
            ));
        }
    }
    if let Some(hours) = v.max_age_hours {
        if !matches!(v.snapshot, SnapshotFile::Latest) {
            return Err((
                ".max_age_hours".into(),
                "max_age_hours checks the newest backup, so it needs snapshot: latest; remove it or write snapshot: latest".into(),
            ));
        }
        if !(1..=backup::MAX_AGE_HOURS).contains(&hours) {
            return Err((
                ".max_age_hours".into(),
                format!("{hours} is outside 1..={} (hours)", backup::MAX_AGE_HOURS),
            ));
        }
    }
    Ok(ResolvedValidation {
        name: v.name.clone(),
        key: format!("validations[{index}]"),
        node,
        endpoint,
        candidates,
        unplaced: None,
        source_vmid,
        // `latest` is resolved by the caller, which has the catalog.
        snapshot: match &v.snapshot {
            SnapshotFile::Exact(time) => Sourced::plan(time.clone(), key("snapshot")),
            SnapshotFile::Latest => Sourced::plan("latest".to_owned(), key("snapshot")),
        },
        latest: None,
        max_age_hours: Sourced::written_or(v.max_age_hours.map(Some), None, key("max_age_hours")),
        fails_before_run: None,
        // Left out: every disk archive of the snapshot, by `take_from_backup`.
        archives: Sourced::written_or(v.archives.clone(), Vec::new(), key("archives")),
        archive_sizes: BTreeMap::new(),
        sandbox: v
            .sandbox
            .iter()
            .enumerate()
            .map(|(i, vm)| ResolvedSandboxVm {
                // Left out: taken from `[pve] sandbox_vmid_range` once the whole plan is read.
                vmid: match vm.vmid {
                    Some(vmid) => Sourced::plan(vmid.0, key(&format!("sandbox[{i}].vmid"))),
                    None => {
                        Sourced::new(unassigned, Origin::Pve, key(&format!("sandbox[{i}].vmid")))
                    }
                },
                // Left out: taken from the backup's config by `take_from_backup`.
                cores: Sourced::written_or(vm.cores, 0, key(&format!("sandbox[{i}].cores"))),
                memory_mib: Sourced::written_or(
                    vm.memory_mib,
                    0,
                    key(&format!("sandbox[{i}].memory_mib")),
                ),
                max_cores: Sourced::written_or(
                    vm.max_cores,
                    backup::DEFAULT_MAX_CORES,
                    key(&format!("sandbox[{i}].max_cores")),
                ),
                max_memory_mib: Sourced::written_or(
                    vm.max_memory_mib,
                    backup::DEFAULT_MAX_MEMORY_MIB,
                    key(&format!("sandbox[{i}].max_memory_mib")),
                ),
            })
            .collect(),
        network: ResolvedNetwork {
            lifecycle: Sourced::plan(v.network.lifecycle, key("network.lifecycle")),
            vnet: Sourced::plan(v.network.vnet.clone(), key("network.vnet")),
            probe_source: Sourced::plan(
                v.network.probe_source.clone(),
                key("network.probe_source"),
            ),
        },
        probes: v
            .probes
            .iter()
            .enumerate()
            .map(|(i, probe)| resolve_probe(&key(&format!("probes[{i}]")), probe))
            .collect(),
        assertions: v
            .assertions
            .iter()
            .enumerate()
            .map(|(i, assertion)| resolve_assertion(&key(&format!("assertions[{i}]")), assertion))
            .collect(),
        timeouts,
        network_recovery,
    })
}

/// A probe's keys below `at` (`validations[i].probes[j]`).
fn resolve_probe(at: &str, probe: &ProbeFile) -> ResolvedProbe {
    let key = |name: &str| format!("{at}.{name}");
    let e = &probe.expect;
    let text = |value: &Option<String>, name: &str| {
        Sourced::written_or(value.clone(), String::new(), key(&format!("expect.{name}")))
    };
    ResolvedProbe {
        kind: Sourced::plan(probe.kind, key("kind")),
        address: Sourced::plan(probe.address.clone(), key("address")),
        port: Sourced::plan(probe.port, key("port")),
        expect: ResolvedExpect {
            banner_prefix: text(&e.banner_prefix, "banner_prefix"),
            http_path: text(&e.http_path, "http_path"),
            http_status: Sourced::written_or(e.http_status, 0, key("expect.http_status")),
            body_contains: text(&e.body_contains, "body_contains"),
            body_sha256: text(&e.body_sha256, "body_sha256"),
            dns_name: text(&e.dns_name, "dns_name"),
            dns_type: Sourced::written_or(e.dns_type.map(Some), None, key("expect.dns_type")),
            dns_answers: Sourced::written_or(
                e.dns_answers.clone(),
                Vec::new(),
                key("expect.dns_answers"),
            ),
            ldap_naming_context: text(&e.ldap_naming_context, "ldap_naming_context"),
        },
    }
}

/// An assertion's keys below `at` (`validations[i].assertions[j]`).
fn resolve_assertion(at: &str, assertion: &AssertionFile) -> ResolvedAssertion {
    let key = |name: &str| format!("{at}.{name}");
    ResolvedAssertion {
        id: Sourced::plan(assertion.id.clone(), key("id")),
        program: Sourced::plan(assertion.program.clone(), key("program")),
        args: Sourced::written_or(assertion.args.clone(), Vec::new(), key("args")),
        exit_code: Sourced::written_or(assertion.exit_code, 0, key("exit_code")),
        stdout_contains: Sourced::written_or(
            assertion.stdout_contains.clone(),
            String::new(),
            key("stdout_contains"),
        ),
        timeout_seconds: Sourced::plan(assertion.timeout_seconds, key("timeout_seconds")),
    }
}

/// The guest agent wait fits in the run with its cleanup reserve, and the run in one grant.
fn check_timeouts(run_seconds: u32, guest_agent_seconds: u32) -> Result<(), (String, String)> {
    if guest_agent_seconds == 0 || guest_agent_seconds >= run_seconds {
        return Err((
            ".timeouts.guest_agent_seconds".into(),
            format!(
                "{guest_agent_seconds} must be at least 1 and less than run_seconds ({run_seconds})"
            ),
        ));
    }
    if i64::from(run_seconds) + NOT_BEFORE_SLACK_SECS > grant::MAX_GRANT_LIFETIME_SECS {
        return Err((
            ".timeouts.run_seconds".into(),
            format!(
                "{run_seconds} is longer than a grant may last ({} s, of which {NOT_BEFORE_SLACK_SECS} s are kept for clocks a little apart); split the validation or shorten it",
                grant::MAX_GRANT_LIFETIME_SECS
            ),
        ));
    }
    let reserve = cleanup_reserve_secs(run_seconds);
    if guest_agent_seconds.saturating_add(reserve) >= run_seconds {
        return Err((
            ".timeouts.guest_agent_seconds".into(),
            format!(
                "{guest_agent_seconds} leaves no time for the steps after it: run_seconds ({run_seconds}) keeps {reserve} s for cleanup, so the guest agent wait must be shorter than {} s; raise run_seconds or lower guest_agent_seconds",
                run_seconds.saturating_sub(reserve)
            ),
        ));
    }
    Ok(())
}

/// The recovery mode (`rewrite` unless written) and the sandbox NIC's address: written, or the
/// one address the probes target with the probe network's prefix.
fn resolve_network_recovery(
    index: usize,
    v: &ValidationFile,
) -> Result<ResolvedNetworkRecovery, (String, String)> {
    let key = |name: &str| format!("validations[{index}].{name}");
    let mode = Sourced::written_or(
        v.network_recovery.mode,
        NetworkRecoveryMode::default(),
        key("network_recovery.mode"),
    );
    let guest_address_key = key("network_recovery.guest_address");
    let guest_address = match (mode.value, &v.network_recovery.guest_address) {
        (_, Some(address)) => Sourced::plan(address.clone(), guest_address_key),
        (NetworkRecoveryMode::Preserve, None) => {
            Sourced::new(String::new(), Origin::Default, guest_address_key)
        }
        (NetworkRecoveryMode::Rewrite, None) => {
            let addresses: BTreeSet<&str> = v.probes.iter().map(|p| p.address.as_str()).collect();
            let prefix = v.network.probe_source.rsplit_once('/').map(|(_, p)| p);
            match (addresses.len(), addresses.first(), prefix) {
                (1, Some(address), Some(prefix)) => Sourced::new(
                    format!("{address}/{prefix}"),
                    Origin::Derived,
                    format!(
                        "{}, {}",
                        key("probes[].address"),
                        key("network.probe_source")
                    ),
                ),
                _ => {
                    return Err((
                        ".network_recovery.guest_address".into(),
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
    Ok(ResolvedNetworkRecovery {
        mode,
        guest_address,
    })
}
