//! What resolution asks of the Proxmox VE cluster: which VMs a `select` names (`GET
//! /cluster/resources?type=vm`, and a pool's membership, `GET /pools/{pool}`), and whether a
//! sandbox VMID is free (`GET /cluster/nextid?vmid=N`).
//!
//! `/cluster/resources` lists only the VMs the token may audit (VM.Audit), silently: a
//! selection checks what it got against what it should have got (a pool's membership, the
//! VMIDs written) and refuses to run short, naming the privilege. `/cluster/nextid` reads the
//! cluster's whole VM list whatever the token may audit (pve-manager `PVE/API2/Cluster.pm`,
//! `nextid`, permissions `user => 'all'`), so a VMID held by a VM the token cannot see is
//! still found in use.
//!
//! Resolution asks a [`Cluster`]; the controller's is the PVE API of `[pve]`
//! (`crate::cluster`). Without one (`Plan::parse`, or no `[pve]`), `select` and omitted sandbox
//! VMIDs are refused saying what reads them.

use super::*;
use certistack_core::files::FileError;

/// The most validations one `select` may expand to, and a whole plan after expansion: as many
/// as a plan may have written ([`MAX_VALIDATIONS`]).
pub const MAX_EXPANDED_VALIDATIONS: usize = MAX_VALIDATIONS;

/// One QEMU VM as `/cluster/resources?type=vm` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterVm {
    pub vmid: Vmid,
    pub name: String,
    /// The node it runs on.
    pub node: String,
    pub template: bool,
    pub pool: Option<String>,
    /// Its tags, as PVE stores them split at `;`.
    pub tags: Vec<String>,
}

/// Why the cluster could not answer.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The token's secret file is refused or cannot be read.
    #[error(transparent)]
    Secret(FileError),
    /// The API could not be asked: unreachable, its certificate or the token refused, a
    /// server error, too slow. The plan may be fine.
    #[error("{0}")]
    Unavailable(String),
    /// The API answered and refused what was asked (a privilege the token lacks, a pool that
    /// does not exist): the plan or the token's privileges must change.
    #[error("{0}")]
    Refused(String),
}

/// Where the token's privileges are read: `None` when no PVE API is configured (then nothing
/// is checked here, and what needs the API is refused by resolution, saying so).
pub trait Privileges {
    /// The privileges the token has on exactly `path` (`GET /access/permissions?path=`), each
    /// with whether it propagates below the path.
    fn privileges(&self, path: &str) -> Result<Option<BTreeMap<String, bool>>, ClusterError>;
    /// The token's id, `USER@REALM!TOKEN`, for the lines that grant what is missing.
    fn token_id(&self) -> Option<String>;
}

/// Where resolution reads the cluster's VMs (and, before anything, the token's privileges).
pub trait Cluster: Privileges {
    /// Every QEMU VM the token may audit (`/cluster/resources?type=vm`), templates included.
    fn vms(&self) -> Result<Vec<ClusterVm>, ClusterError>;
    /// The VMIDs of the QEMU VMs in pool `pool` (`/pools/{pool}`), whatever the token may
    /// audit of them.
    fn pool_members(&self, pool: &str) -> Result<Vec<Vmid>, ClusterError>;
    /// Whether any guest of the cluster has `vmid` (`/cluster/nextid?vmid=N`).
    fn vmid_in_use(&self, vmid: Vmid) -> Result<bool, ClusterError>;
    /// `[pve] sandbox_vmid_range`, where omitted sandbox VMIDs are taken from.
    fn sandbox_vmid_range(&self) -> Option<(Vmid, Vmid)>;
    /// Whether the API is there to ask (`[pve]` is configured): written sandbox VMIDs are then
    /// checked free in the cluster.
    fn configured(&self) -> bool {
        true
    }
    /// Asks at once (within a bound) whether each of `vmids` is in use, for
    /// [`Cluster::vmid_in_use`] to answer from; what fails is left for that call to say.
    fn prefetch_vmids(&self, _vmids: &[Vmid]) {}
    /// A preprovisioned VNet as the SDN configuration has it (`plan::sdn`); `None` when no
    /// API is there to ask.
    fn sdn_vnet(&self, _vnet: &str) -> Result<Option<super::sdn::SdnView>, ClusterError> {
        Ok(None)
    }
}

/// No cluster: `select` and omitted sandbox VMIDs are refused, saying what reads them.
#[derive(Debug, Clone, Copy)]
pub struct NoCluster;

const NO_CLUSTER: &str = "this is read from the Proxmox VE API: configure [pve] in the controller configuration (docs/install.md, section 4) and use certistack-ctl plan check or plan show without --offline, or run";

impl Privileges for NoCluster {
    fn privileges(&self, _path: &str) -> Result<Option<BTreeMap<String, bool>>, ClusterError> {
        Ok(None)
    }
    fn token_id(&self) -> Option<String> {
        None
    }
}

impl Cluster for NoCluster {
    fn vms(&self) -> Result<Vec<ClusterVm>, ClusterError> {
        Err(ClusterError::Refused(NO_CLUSTER.into()))
    }

    fn pool_members(&self, _pool: &str) -> Result<Vec<Vmid>, ClusterError> {
        Err(ClusterError::Refused(NO_CLUSTER.into()))
    }

    fn vmid_in_use(&self, _vmid: Vmid) -> Result<bool, ClusterError> {
        Err(ClusterError::Refused(NO_CLUSTER.into()))
    }

    fn sandbox_vmid_range(&self) -> Option<(Vmid, Vmid)> {
        None
    }

    fn configured(&self) -> bool {
        false
    }
}

/// A written validation once its `select` is expanded: one per VM, named `<name>-<vmid>`.
#[derive(Debug, Clone)]
pub(super) struct Expanded {
    /// Where it is written in the plan (`validations[i]`).
    pub(super) plan_index: usize,
    pub(super) file: ValidationFile,
    pub(super) source_vmid: Sourced<Vmid>,
}

/// A refusal of expansion: the key after `validations[i] (name)`, and why; or the cluster's
/// failure to answer.
#[derive(Debug)]
pub(super) enum ExpandError {
    Refused(String, String),
    Unavailable(String, String),
    Secret(FileError),
}

fn failed(key: &str) -> impl Fn(ClusterError) -> ExpandError + '_ {
    move |error| match error {
        ClusterError::Secret(file) => ExpandError::Secret(file),
        ClusterError::Unavailable(reason) => ExpandError::Unavailable(key.to_owned(), reason),
        ClusterError::Refused(reason) => ExpandError::Refused(key.to_owned(), reason),
    }
}

/// Every written validation, each `select` expanded to one validation per selected VM (in
/// VMID order); the cluster's VM list is asked once, and only when a `select` needs it.
pub(super) fn expand(
    validations: &[ValidationFile],
    cluster: &dyn Cluster,
) -> Result<Vec<Expanded>, (usize, ExpandError)> {
    let mut listed: Option<Vec<ClusterVm>> = None;
    let mut out = Vec::new();
    for (plan_index, v) in validations.iter().enumerate() {
        let at = |error| (plan_index, error);
        let key = |name: &str| format!("validations[{plan_index}].{name}");
        match (&v.source_vmid, &v.select) {
            (Some(vmid), None) => out.push(Expanded {
                plan_index,
                file: v.clone(),
                source_vmid: Sourced::plan(vmid.0, key("source_vmid")),
            }),
            (None, Some(select)) => {
                if listed.is_none() {
                    listed = Some(cluster.vms().map_err(|e| at(failed(".select")(e)))?);
                }
                let vms = listed.as_deref().unwrap_or_default();
                let (vmids, by) = select_vms(select, vms, cluster).map_err(at)?;
                // Checked before anything is copied: a selection may name thousands of VMs.
                if out.len() + vmids.len() > MAX_EXPANDED_VALIDATIONS {
                    return Err(at(ExpandError::Refused(
                        ".select".into(),
                        format!(
                            "it selects {} VMs, which would make {} validations, more than the {MAX_EXPANDED_VALIDATIONS} a plan may hold; narrow the selection (a smaller pool, more tags) or split the plan",
                            vmids.len(),
                            out.len() + vmids.len()
                        ),
                    )));
                }
                for vmid in vmids {
                    let mut file = v.clone();
                    file.name = format!("{}-{vmid}", v.name);
                    file.select = None;
                    file.source_vmid = Some(PlanVmid(vmid));
                    out.push(Expanded {
                        plan_index,
                        file,
                        source_vmid: Sourced::new(vmid, Origin::Pve, by.clone()),
                    });
                }
            }
            _ => {
                return Err(at(ExpandError::Refused(
                    String::new(),
                    "write either source_vmid (one VM) or select (vmids, a pool or tags), not both and not neither".into(),
                )));
            }
        }
        if out.len() > MAX_EXPANDED_VALIDATIONS {
            return Err(at(ExpandError::Refused(
                String::new(),
                format!(
                    "the plan would hold {} validations, more than {MAX_EXPANDED_VALIDATIONS}; split the plan",
                    out.len()
                ),
            )));
        }
    }
    Ok(out)
}

/// The VMIDs `select` names among `vms` (the listed QEMU VMs), in VMID order, and the key that
/// says how they were chosen.
fn select_vms(
    select: &SelectFile,
    vms: &[ClusterVm],
    cluster: &dyn Cluster,
) -> Result<(Vec<Vmid>, String), ExpandError> {
    let by_vmid: BTreeMap<Vmid, &ClusterVm> = vms.iter().map(|vm| (vm.vmid, vm)).collect();
    let refused = |key: &str, reason: String| ExpandError::Refused(key.to_owned(), reason);
    match (&select.vmids, &select.pool, &select.tags) {
        (Some(vmids), None, None) => {
            let mut chosen = BTreeSet::new();
            for vmid in vmids {
                match by_vmid.get(&vmid.0) {
                    None => {
                        return Err(refused(
                            ".select.vmids",
                            format!(
                                "VM {} is not among the QEMU VMs the token may see: it does not exist, is a container, or the token lacks VM.Audit on /vms/{}; grant it (or remove the VMID)",
                                vmid.0, vmid.0
                            ),
                        ));
                    }
                    Some(vm) if vm.template => {
                        return Err(refused(
                            ".select.vmids",
                            format!(
                                "VM {} ({}) is a template, which is not validated (a template does not boot as a guest); remove it",
                                vmid.0,
                                untrusted(&vm.name)
                            ),
                        ));
                    }
                    Some(_) => {
                        chosen.insert(vmid.0);
                    }
                }
            }
            if chosen.is_empty() {
                return Err(refused(".select.vmids", "lists no VM".into()));
            }
            Ok((chosen.into_iter().collect(), "select.vmids".into()))
        }
        (None, Some(pool), None) => {
            if !is_pool_name(pool) {
                return Err(refused(
                    ".select.pool",
                    format!(
                        "{:?} is not a pool name this plan may select (letters, digits, `-`, `_`, `.`; nested pools are not selected): name a pool of the cluster (pveum pool list)",
                        untrusted(pool)
                    ),
                ));
            }
            let members: BTreeSet<Vmid> = cluster
                .pool_members(pool)
                .map_err(failed(".select.pool"))?
                .into_iter()
                .collect();
            let seen: BTreeSet<Vmid> = vms
                .iter()
                .filter(|vm| vm.pool.as_deref() == Some(pool.as_str()))
                .map(|vm| vm.vmid)
                .collect();
            let hidden: Vec<String> = members.difference(&seen).map(ToString::to_string).collect();
            if !hidden.is_empty() {
                return Err(refused(
                    ".select.pool",
                    format!(
                        "pool {pool} has {} QEMU VM(s) the token may not audit ({}): /cluster/resources leaves them out, so they would go unvalidated; grant VM.Audit on /pool/{pool} (or on each /vms/<vmid>)",
                        hidden.len(),
                        first_of(&hidden)
                    ),
                ));
            }
            let chosen: Vec<Vmid> = vms
                .iter()
                .filter(|vm| vm.pool.as_deref() == Some(pool.as_str()) && !vm.template)
                .map(|vm| vm.vmid)
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            if chosen.is_empty() {
                return Err(refused(
                    ".select.pool",
                    format!(
                        "pool {pool} has no QEMU VM but templates; add VMs to it or select otherwise"
                    ),
                ));
            }
            Ok((chosen, format!("select.pool ({pool})")))
        }
        (None, None, Some(tags)) => {
            if tags.is_empty() {
                return Err(refused(".select.tags", "lists no tag".into()));
            }
            // pve-common `PVE/JSONSchema.pm` `pve-tag`: `[a-z0-9_][a-z0-9_\-+.]*`, any case.
            if let Some(tag) = tags.iter().find(|tag| {
                tag.is_empty()
                    || tag.len() > 64
                    || tag.starts_with(['-', '+', '.'])
                    || !tag
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_-+.".contains(c))
            }) {
                return Err(refused(
                    ".select.tags",
                    format!(
                        "{:?} is not a Proxmox VE tag (letters, digits, `_`, then also `-`, `+`, `.`)",
                        untrusted(tag)
                    ),
                ));
            }
            let chosen: Vec<Vmid> = vms
                .iter()
                .filter(|vm| !vm.template && tags.iter().all(|tag| vm.tags.contains(tag)))
                .map(|vm| vm.vmid)
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            if chosen.is_empty() {
                return Err(refused(
                    ".select.tags",
                    format!(
                        "no QEMU VM the token may audit carries every tag of {}: /cluster/resources leaves out VMs the token lacks VM.Audit on (/vms/<vmid>), so check the tags and that privilege",
                        tags.join(", ")
                    ),
                ));
            }
            Ok((chosen, format!("select.tags ({})", tags.join(", "))))
        }
        _ => Err(refused(
            ".select",
            "write exactly one of vmids, pool or tags".into(),
        )),
    }
}

/// Text from the API, escaped and bounded for a message.
fn untrusted(text: &str) -> String {
    certistack_core::untrusted::printable(text.as_bytes(), 64)
}

/// One sandbox VM whose VMID the plan leaves out: `validations[validation].sandbox[sandbox]`.
pub(super) type Omitted = (usize, usize);

/// Gives each omitted sandbox VMID one from `[pve] sandbox_vmid_range`, skipping every VMID
/// the plan uses (`taken`) and every one the cluster has, whether the token may see it or not
/// (`/cluster/nextid?vmid=N` for each candidate not known to be taken). Returns the VMIDs in
/// the order of `omitted`.
/// VMIDs named in one message: the first [`MAX_VMIDS_NAMED`], then how many more.
fn first_of(vmids: &[String]) -> String {
    let mut text = vmids
        .iter()
        .take(MAX_VMIDS_NAMED)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if vmids.len() > MAX_VMIDS_NAMED {
        text.push_str(&format!(" and {} more", vmids.len() - MAX_VMIDS_NAMED));
    }
    text
}

/// Candidates of the range asked ahead beyond those still needed.
const VMIDS_ASKED_AHEAD: usize = 8;

/// Whether `pool` is a pool name a plan may select (pve-access-control `PVE/AccessControl.pm`
/// `verify_poolname`, without nesting: a nested pool's `/` would change the API and ACL paths).
pub(super) fn is_pool_name(pool: &str) -> bool {
    !pool.is_empty()
        && pool.len() <= 64
        && pool
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// VMIDs one refusal names.
const MAX_VMIDS_NAMED: usize = 20;

/// VMIDs of the range asked of `/cluster/nextid` for one plan beyond the ones it takes: each
/// is an HTTPS call, and a range that is this full is full of something to clean up.
pub const MAX_VMIDS_IN_USE_SKIPPED: usize = 256;

pub(super) fn assign_sandbox_vmids(
    omitted: &[Omitted],
    taken: &BTreeSet<Vmid>,
    cluster: &dyn Cluster,
) -> Result<Vec<Vmid>, ClusterError> {
    if omitted.is_empty() {
        return Ok(Vec::new());
    }
    let Some((low, high)) = cluster.sandbox_vmid_range() else {
        return Err(ClusterError::Refused(
            "the sandbox VM's vmid is not written and [pve] sandbox_vmid_range is not set in the controller configuration; write a VMID or set the range (docs/plans.md, \"Sandbox VMIDs\")".into(),
        ));
    };
    let mut chosen = Vec::with_capacity(omitted.len());
    let mut candidate = low.get();
    let mut in_use = 0usize;
    // The candidates are asked ahead in batches (a few more than still needed), all at once.
    let mut asked_up_to = candidate;
    while chosen.len() < omitted.len() {
        if candidate >= asked_up_to {
            let wanted = (omitted.len() - chosen.len()).saturating_add(VMIDS_ASKED_AHEAD);
            let batch: Vec<Vmid> = (candidate..=high.get())
                .filter_map(|n| Vmid::parse("sandbox_vmid_range", n).ok())
                .filter(|vmid| !taken.contains(vmid))
                .take(wanted)
                .collect();
            asked_up_to = batch
                .last()
                .map_or(high.get(), |last| last.get())
                .saturating_add(1);
            cluster.prefetch_vmids(&batch);
        }
        if in_use > MAX_VMIDS_IN_USE_SKIPPED {
            return Err(ClusterError::Refused(format!(
                "[pve] sandbox_vmid_range {low}-{high}: more than {MAX_VMIDS_IN_USE_SKIPPED} of its VMIDs below {candidate} are in use in the cluster; sandboxes of interrupted runs? run certistack-ctl cleanup on the nodes (qm list shows them), or move the range to VMIDs no one allocates"
            )));
        }
        if candidate > high.get() {
            return Err(ClusterError::Refused(format!(
                "[pve] sandbox_vmid_range {low}-{high} has {} free VMID(s) for the {} sandbox VM(s) the plan leaves without one; widen the range or free VMIDs in it",
                chosen.len(),
                omitted.len()
            )));
        }
        let vmid = Vmid::parse("sandbox_vmid_range", candidate).map_err(|reason| {
            ClusterError::Refused(format!("[pve] sandbox_vmid_range: {reason}"))
        })?;
        candidate = candidate.saturating_add(1);
        if taken.contains(&vmid) {
            continue;
        }
        if cluster.vmid_in_use(vmid)? {
            in_use += 1;
            continue;
        }
        chosen.push(vmid);
    }
    Ok(chosen)
}

#[cfg(test)]
mod tests;
