//! What placement (`node: auto`, a list of nodes) reads of the nodes while a plan is resolved:
//! each node's figures from the PVE API (`GET /cluster/resources?type=node`: online, cores and
//! memory in use) and, for each VNet the plan's choices attach to, the node's prerequisites as
//! `doctor` judges them (its connector answers Hello with this controller's surface, the VNet is
//! there and isolated). The checks are kept: `run` hands them to the runner, which then does
//! not ask the same node the same questions again.

use crate::authority::Authority;
use crate::cluster::PveCluster;
use crate::config::ControllerConfig;
use crate::doctor::{self, Check, Level};
use crate::plan::placement::{NodeRoom, Rooms, RoomsError};
use certistack_core::validate::{Validated, VnetName};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use time::OffsetDateTime;

/// The operator name of the certificates placement mints to ask the nodes.
const OPERATOR_NAME: &str = "certistack-placement";

/// The nodes' room, read from the PVE API and the nodes themselves.
#[allow(missing_debug_implementations)]
pub struct NodeRooms<'a> {
    config: &'a ControllerConfig,
    cluster: &'a PveCluster,
    per_node: usize,
    /// Each `(node, vnet)`'s prerequisite checks, as asked.
    checked: Mutex<BTreeMap<(String, String), Vec<Check>>>,
}

impl<'a> NodeRooms<'a> {
    pub fn new(config: &'a ControllerConfig, cluster: &'a PveCluster, per_node: usize) -> Self {
        Self {
            config,
            cluster,
            per_node,
            checked: Mutex::new(BTreeMap::new()),
        }
    }

    /// The prerequisite checks asked while placing, for the runner to reuse.
    pub fn into_checks(self) -> BTreeMap<(String, String), Vec<Check>> {
        self.checked.into_inner().unwrap_or_default()
    }
}

impl Rooms for NodeRooms<'_> {
    fn rooms(
        &self,
        nodes: &BTreeSet<String>,
        vnets: &BTreeSet<String>,
    ) -> Result<BTreeMap<(String, String), NodeRoom>, RoomsError> {
        let figures = self.cluster.node_figures().map_err(|error| match error {
            crate::plan::cluster::ClusterError::Unavailable(reason) => {
                RoomsError::Unavailable(reason)
            }
            other => RoomsError::Refused(other.to_string()),
        })?;
        let authority = Authority::load(&self.config.state_dir).map_err(|error| {
            RoomsError::Unavailable(format!(
                "cannot load the controller's keys to ask the nodes: {error}"
            ))
        })?;
        let identity = authority
            .issue_operator(OPERATOR_NAME, OffsetDateTime::now_utc())
            .map_err(|error| {
                RoomsError::Unavailable(format!("cannot mint an operator certificate: {error}"))
            })?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|error| RoomsError::Unavailable(format!("cannot start a runtime: {error}")))?;
        // Only the nodes PVE has online are asked; each (node, VNet) once, all at once.
        let mut asked = Vec::new();
        for node in nodes {
            let Some(inventory) = self
                .config
                .nodes
                .iter()
                .find(|(name, _)| name.as_str() == node)
                .map(|(_, inventory)| inventory.clone())
            else {
                continue;
            };
            if figures.get(node).is_none_or(|f| !f.online || !f.audited) {
                continue;
            }
            for vnet in vnets {
                let Ok(vnet_name) = VnetName::validate(vnet) else {
                    continue;
                };
                asked.push((node.clone(), vnet.clone(), inventory.clone(), vnet_name));
            }
        }
        let identity = std::sync::Arc::new(identity);
        let ca: std::sync::Arc<str> = authority.ca_pem().into();
        let checks: Vec<((String, String), Vec<Check>)> = runtime.block_on(async {
            let mut tasks = tokio::task::JoinSet::new();
            for (node, vnet, inventory, vnet_name) in asked {
                let ca = ca.clone();
                let identity = identity.clone();
                tasks.spawn(async move {
                    let checks = doctor::check_node(
                        &inventory,
                        &ca,
                        &identity,
                        Some(&vnet_name),
                        None,
                        doctor::DEFAULT_NODE_TIMEOUT,
                    )
                    .await;
                    ((node, vnet), checks)
                });
            }
            let mut done = Vec::new();
            while let Some(Ok(one)) = tasks.join_next().await {
                done.push(one);
            }
            done
        });
        let mut rooms = BTreeMap::new();
        for node in nodes {
            for vnet in vnets {
                let figure = figures.get(node);
                let key = (node.clone(), vnet.clone());
                let checked = checks.iter().find(|(k, _)| *k == key).map(|(_, c)| c);
                let ready = if !self.config.nodes.keys().any(|n| n.as_str() == node) {
                    Err("not in the controller's inventory".to_owned())
                } else {
                    match (figure, checked) {
                        (None, _) => Err(
                            "not in the PVE API's node list (a node of another cluster?)"
                                .to_owned(),
                        ),
                        (Some(f), _) if !f.online => Err("offline in PVE".to_owned()),
                        (Some(f), _) if !f.audited => Err(format!(
                            "PVE shows nothing of what it has free: give the token Sys.Audit on /nodes/{node}"
                        )),
                        (_, None) => {
                            Err(format!("its prerequisites with VNet {vnet} were not read"))
                        }
                        (_, Some(checks)) => match checks.iter().find(|c| c.level == Level::Fail) {
                            Some(failing) => Err(format!(
                                "{} fails ({}): see certistack-ctl doctor {node} --vnet {vnet}",
                                failing.check,
                                certistack_core::untrusted::printable(
                                    failing.detail.as_bytes(),
                                    200
                                )
                            )),
                            None => Ok(()),
                        },
                    }
                };
                rooms.insert(
                    key,
                    NodeRoom {
                        name: node.clone(),
                        ready,
                        free_cores: figure.map_or(0, |f| f.free_cores),
                        free_memory_mib: figure.map_or(0, |f| f.free_memory_mib),
                    },
                );
            }
        }
        if let Ok(mut kept) = self.checked.lock() {
            kept.extend(checks);
        }
        Ok(rooms)
    }

    fn per_node(&self) -> usize {
        self.per_node
    }
}
