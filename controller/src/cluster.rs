//! The controller's view of the Proxmox VE cluster while a plan is resolved: the PVE API of
//! `[pve]`, asked which VMs a `select` names and whether sandbox VMIDs are free.
//!
//! Like the backup catalog (`crate::catalog`), resolution is synchronous, so the cluster keeps a
//! small runtime of its own; the client is built on first use (the token's secret read then),
//! the VM list is asked once per plan, and all calls of one plan share
//! [`crate::catalog::RESOLUTION_BUDGET`]. Without `[pve]` every question is refused saying
//! where to configure it.

use crate::api::https::{ApiError, Limits};
use crate::api::pve::PveClient;
use crate::catalog::RESOLUTION_BUDGET;
use crate::config::PveSettings;
use crate::plan::cluster::{Cluster, ClusterError, ClusterVm, NoCluster};
use crate::plan::sdn::{SdnView, SubnetView};
use certistack_core::untrusted;
use certistack_core::validate::Vmid;
use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// The most VMs a `/cluster/resources` listing may hold before it is refused: a large cluster
/// has a few thousand guests (with the 8 MiB reply cap, this bounds what the API can make the
/// controller hold).
pub const MAX_LISTED_VMS: usize = 20_000;
/// The most members a pool listing may hold.
pub const MAX_POOL_MEMBERS: usize = 20_000;

/// The PVE API as a [`Cluster`].
#[derive(Debug)]
pub struct PveCluster {
    settings: Option<PveSettings>,
    client: OnceLock<Result<(PveClient, tokio::runtime::Runtime), String>>,
    deadline: Instant,
    listed: Mutex<Option<Vec<ClusterVm>>>,
    /// What `/cluster/nextid` said of each VMID asked.
    in_use: Mutex<BTreeMap<u32, bool>>,
    /// Each VNet's SDN configuration, as read.
    sdn: Mutex<BTreeMap<String, SdnView>>,
}

impl PveCluster {
    /// The cluster of `[pve]`; `None` (no `[pve]`) refuses every question as [`NoCluster`].
    pub fn new(settings: Option<&PveSettings>) -> Self {
        Self {
            settings: settings.cloned(),
            client: OnceLock::new(),
            deadline: Instant::now() + RESOLUTION_BUDGET,
            listed: Mutex::new(None),
            in_use: Mutex::new(BTreeMap::new()),
            sdn: Mutex::new(BTreeMap::new()),
        }
    }

    fn client(&self) -> Result<&(PveClient, tokio::runtime::Runtime), ClusterError> {
        let Some(settings) = &self.settings else {
            return Err(NoCluster
                .vms()
                .err()
                .unwrap_or(ClusterError::Refused("[pve] is not configured".into())));
        };
        if let Some(made) = self.client.get() {
            return made
                .as_ref()
                .map_err(|reason| ClusterError::Refused(reason.clone()));
        }
        let made = match PveClient::new(&settings.endpoint(), Limits::default()) {
            Err(crate::api::pve::PveSetupError::Secret(error)) => {
                return Err(ClusterError::Secret(error));
            }
            Err(error) => Err(error.to_string()),
            Ok(client) => tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map(|runtime| (client, runtime))
                .map_err(|error| format!("cannot start a runtime: {error}")),
        };
        self.client
            .get_or_init(|| made)
            .as_ref()
            .map_err(|reason| ClusterError::Refused(reason.clone()))
    }

    /// Runs one call within what is left of the budget.
    fn call<T>(
        &self,
        runtime: &tokio::runtime::Runtime,
        call: impl std::future::Future<Output = Result<T, ApiError>>,
    ) -> Result<T, ClusterError> {
        crate::api::https::within(runtime, self.deadline, call)
            .ok_or_else(|| {
                ClusterError::Unavailable(format!(
                    "resolving the plan has asked the APIs for {} s, its budget; check the PVE API's load and the network",
                    RESOLUTION_BUDGET.as_secs()
                ))
            })?
            .map_err(cluster_error)
    }
}

/// What PVE says of one node (`/cluster/resources?type=node`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeFigure {
    pub online: bool,
    /// Whether PVE showed its figures: it leaves them out without Sys.Audit on `/nodes/NODE`
    /// (pve-manager `PVE/API2Tools.pm`, `extract_node_stats`), and then nothing is known free.
    pub audited: bool,
    /// Its CPUs (`maxcpu`).
    pub cores: u32,
    /// Memory not in use: `maxmem` − `mem`, in MiB.
    pub free_memory_mib: u64,
}

impl PveCluster {
    /// Every node of the cluster, by name.
    pub fn node_figures(&self) -> Result<BTreeMap<String, NodeFigure>, ClusterError> {
        let (client, runtime) = self.client()?;
        let resources = self.call(runtime, client.cluster_resources("node"))?;
        if resources.len() > MAX_LISTED_VMS {
            return Err(ClusterError::Refused(format!(
                "GET /cluster/resources?type=node lists {} nodes, more than the {MAX_LISTED_VMS} read",
                resources.len()
            )));
        }
        Ok(resources
            .into_iter()
            .filter(|r| r.kind == "node")
            .filter_map(|r| {
                let maxcpu = r.maxcpu.unwrap_or(0.0).max(0.0);
                let free_bytes = r
                    .maxmem
                    .unwrap_or(0)
                    .saturating_sub(r.mem.unwrap_or(u64::MAX));
                Some((
                    r.node?,
                    NodeFigure {
                        online: r.status.as_deref() == Some("online"),
                        audited: r.maxmem.is_some() && r.maxcpu.is_some(),
                        cores: if maxcpu >= f64::from(u32::MAX) {
                            u32::MAX
                        } else {
                            maxcpu as u32
                        },
                        free_memory_mib: free_bytes / (1024 * 1024),
                    },
                ))
            })
            .collect())
    }
}

impl crate::plan::needs::Privileges for PveCluster {
    fn privileges(&self, path: &str) -> Result<Option<BTreeMap<String, bool>>, ClusterError> {
        if self.settings.is_none() {
            return Ok(None);
        }
        let (client, runtime) = self.client()?;
        let table = self.call(runtime, client.permissions(Some(path)))?;
        Ok(Some(
            table
                .get(path)
                .map(|privileges| {
                    privileges
                        .iter()
                        .map(|(privilege, propagate)| (privilege.clone(), propagate.0))
                        .collect()
                })
                .unwrap_or_default(),
        ))
    }

    fn token_id(&self) -> Option<String> {
        self.settings.as_ref().map(|s| s.token_id.clone())
    }
}

impl Cluster for PveCluster {
    fn vms(&self) -> Result<Vec<ClusterVm>, ClusterError> {
        if let Some(listed) = self.listed.lock().ok().and_then(|l| l.clone()) {
            return Ok(listed);
        }
        let (client, runtime) = self.client()?;
        let resources = self.call(runtime, client.cluster_resources("vm"))?;
        if resources.len() > MAX_LISTED_VMS {
            return Err(ClusterError::Refused(format!(
                "GET /cluster/resources?type=vm lists {} guests, more than the {MAX_LISTED_VMS} read",
                resources.len()
            )));
        }
        let vms: Vec<ClusterVm> = resources
            .into_iter()
            .filter(|r| r.kind == "qemu")
            .filter_map(|r| {
                Some(ClusterVm {
                    vmid: Vmid::parse("vmid", r.vmid?).ok()?,
                    name: r.name.unwrap_or_default(),
                    node: r.node.unwrap_or_default(),
                    template: r.template.is_some_and(|t| t.0),
                    pool: r.pool.filter(|p| !p.is_empty()),
                    tags: r
                        .tags
                        .unwrap_or_default()
                        .split([';', ',', ' '])
                        .filter(|t| !t.is_empty())
                        .map(str::to_owned)
                        .collect(),
                })
            })
            .collect();
        if let Ok(mut listed) = self.listed.lock() {
            *listed = Some(vms.clone());
        }
        Ok(vms)
    }

    fn pool_members(&self, pool: &str) -> Result<Vec<Vmid>, ClusterError> {
        let (client, runtime) = self.client()?;
        let content = self.call(runtime, client.pool(pool))?;
        if content.members.len() > MAX_POOL_MEMBERS {
            return Err(ClusterError::Refused(format!(
                "pool {pool} lists {} members, more than the {MAX_POOL_MEMBERS} read",
                content.members.len()
            )));
        }
        Ok(content
            .members
            .into_iter()
            .filter(|m| m.kind == "qemu")
            .filter_map(|m| Vmid::parse("vmid", m.vmid?).ok())
            .collect())
    }

    fn vmid_in_use(&self, vmid: Vmid) -> Result<bool, ClusterError> {
        if let Some(known) = self
            .in_use
            .lock()
            .ok()
            .and_then(|m| m.get(&vmid.get()).copied())
        {
            return Ok(known);
        }
        let (client, runtime) = self.client()?;
        let free = self.call(runtime, client.vmid_free(vmid.get()))?;
        if let Ok(mut in_use) = self.in_use.lock() {
            in_use.insert(vmid.get(), !free);
        }
        Ok(!free)
    }

    fn prefetch_vmids(&self, vmids: &[Vmid]) {
        let Ok((client, runtime)) = self.client() else {
            return;
        };
        let known: std::collections::BTreeSet<u32> = self
            .in_use
            .lock()
            .map(|m| m.keys().copied().collect())
            .unwrap_or_default();
        let todo: std::collections::BTreeSet<u32> = vmids
            .iter()
            .map(|vmid| vmid.get())
            .filter(|vmid| !known.contains(vmid))
            .collect();
        if todo.is_empty() {
            return;
        }
        let answers =
            crate::api::https::ask_at_once(runtime, self.deadline, todo, |vmid| async move {
                (vmid, client.vmid_free(vmid).await)
            });
        if let Ok(mut in_use) = self.in_use.lock() {
            for (vmid, answer) in answers {
                if let Ok(free) = answer {
                    in_use.insert(vmid, !free);
                }
            }
        }
    }

    fn sandbox_vmid_range(&self) -> Option<(Vmid, Vmid)> {
        self.settings.as_ref()?.sandbox_vmid_range
    }

    fn configured(&self) -> bool {
        self.settings.is_some()
    }

    fn sdn_vnet(&self, vnet: &str) -> Result<Option<SdnView>, ClusterError> {
        if self.settings.is_none() {
            return Ok(None);
        }
        if let Some(seen) = self.sdn.lock().ok().and_then(|s| s.get(vnet).cloned()) {
            return Ok(Some(seen));
        }
        let (client, runtime) = self.client()?;
        // pve-network `Vnets.pm` `read` dies (HTTP 500) for a VNet that is not configured.
        let found = self.call(runtime, async {
            match client.sdn_vnet(vnet).await {
                Err(error)
                    if error.status() == Some(500)
                        && error.to_string().contains("does not exist") =>
                {
                    Ok(None)
                }
                other => other.map(Some),
            }
        })?;
        let Some(found) = found else {
            return Err(ClusterError::Refused(format!(
                "VNet {vnet} is not in the cluster's SDN configuration (GET /cluster/sdn/vnets/{vnet}): create it in a Simple zone (docs/sandbox-network.md) and apply, or name the VNet the nodes have"
            )));
        };
        let shown = |text: &str| untrusted::printable(text.as_bytes(), untrusted::MAX_VALUE_CHARS);
        let Some(zone_name) = found.zone.clone() else {
            return Err(ClusterError::Refused(format!(
                "VNet {vnet} names no zone in the SDN configuration"
            )));
        };
        let zones = self.call(runtime, client.sdn_zones())?;
        if zones.len() > MAX_SDN_OBJECTS {
            return Err(ClusterError::Refused(format!(
                "GET /cluster/sdn/zones lists {} zones, more than the {MAX_SDN_OBJECTS} read",
                zones.len()
            )));
        }
        let Some(zone) = zones.iter().find(|z| z.zone == zone_name) else {
            return Err(ClusterError::Refused(format!(
                "the zone {} of VNet {vnet} is not listed to the token: grant SDN.Audit on /sdn/zones/{}",
                shown(&zone_name),
                shown(&zone_name)
            )));
        };
        let subnets = self.call(runtime, client.sdn_subnets(vnet))?;
        if subnets.len() > MAX_SDN_OBJECTS {
            return Err(ClusterError::Refused(format!(
                "VNet {vnet} has {} subnets, more than the {MAX_SDN_OBJECTS} read",
                subnets.len()
            )));
        }
        let mut pending = Vec::new();
        let mut note =
            |what: String,
             state: &Option<String>,
             changes: &Option<serde_json::Map<String, serde_json::Value>>| {
                let keys: Vec<String> = changes
                    .iter()
                    .flat_map(|c| c.keys())
                    .map(|k| shown(k))
                    .collect();
                match (state, keys.is_empty()) {
                    (Some(state), true) => pending.push(format!("{what} ({})", shown(state))),
                    (Some(state), false) => {
                        pending.push(format!("{what} ({}: {})", shown(state), keys.join(", ")))
                    }
                    (None, false) => pending.push(format!("{what}: {}", keys.join(", "))),
                    (None, true) => {}
                }
            };
        note(
            format!("zone {}", shown(&zone.zone)),
            &zone.state,
            &zone.pending,
        );
        note(format!("VNet {vnet}"), &found.state, &found.pending);
        let subnets: Vec<SubnetView> = subnets
            .iter()
            .map(|s| {
                let cidr = shown(
                    s.cidr
                        .as_deref()
                        .or(s.subnet.as_deref())
                        .unwrap_or("(unnamed)"),
                );
                note(format!("subnet {cidr}"), &s.state, &s.pending);
                SubnetView {
                    gateway: s.gateway.as_deref().map(shown),
                    snat: s.snat.is_some_and(|b| b.0),
                    dhcp_range: s.dhcp_range.as_ref().is_some_and(|r| {
                        !r.is_null() && r.as_array().is_none_or(|a| !a.is_empty())
                    }),
                    cidr,
                }
            })
            .collect();
        let view = SdnView {
            zone: shown(&zone.zone),
            zone_type: shown(zone.kind.as_deref().unwrap_or("(none)")),
            zone_nodes: zone
                .nodes
                .as_deref()
                .filter(|n| !n.is_empty())
                .map(|n| n.split(',').map(|node| shown(node.trim())).collect()),
            subnets,
            pending,
        };
        if let Ok(mut seen) = self.sdn.lock() {
            seen.insert(vnet.to_owned(), view.clone());
        }
        Ok(Some(view))
    }
}

/// SDN zones, or one VNet's subnets, read at most.
const MAX_SDN_OBJECTS: usize = 10_000;

/// An answer refusing what was asked (403: a privilege; 4xx: a pool that does not exist) is
/// the plan's or the token's to fix; anything else means the API could not be asked.
fn cluster_error(error: ApiError) -> ClusterError {
    match error.status() {
        Some(403) => ClusterError::Refused(format!(
            "{error}; grant the token the privilege named (docs/install.md, section 4)"
        )),
        Some(status) if (400..500).contains(&status) && status != 401 => {
            ClusterError::Refused(error.to_string())
        }
        // pve-manager `PVE/API2/Pool.pm` dies (HTTP 500) for a pool that does not exist.
        Some(500) if error.to_string().contains("does not exist") => ClusterError::Refused(
            format!("{error}; name a pool of the cluster (pveum pool list)"),
        ),
        _ => ClusterError::Unavailable(error.to_string()),
    }
}
