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
use std::sync::{Arc, Mutex};
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
        pairs: &BTreeSet<(String, String)>,
    ) -> Result<BTreeMap<(String, String), NodeRoom>, RoomsError> {
        let figures = self.cluster.node_figures().map_err(|error| match error {
            crate::plan::cluster::ClusterError::Unavailable(reason) => {
                RoomsError::Unavailable(reason)
            }
            other => RoomsError::Refused(other.to_string()),
        })?;
        let inventory = |node: &str| {
            self.config
                .nodes
                .iter()
                .find(|(name, _)| name.as_str() == node)
                .map(|(_, inventory)| inventory.clone())
        };
        // Only the inventory's nodes PVE has online, with figures, are asked; each pair once.
        let asked: Vec<_> = pairs
            .iter()
            .filter(|(node, _)| figures.get(node).is_some_and(|f| f.online && f.audited))
            .filter_map(|(node, vnet)| {
                Some((
                    node.clone(),
                    vnet.clone(),
                    inventory(node)?,
                    VnetName::validate(vnet).ok()?,
                ))
            })
            .collect();
        let checks = if asked.is_empty() {
            Vec::new()
        } else {
            self.ask(asked)?
        };
        let mut rooms = BTreeMap::new();
        for (node, vnet) in pairs {
            let figure = figures.get(node);
            let key = (node.clone(), vnet.clone());
            let checked = checks.iter().find(|(k, _)| *k == key).map(|(_, c)| c);
            let ready = if inventory(node).is_none() {
                Err("not in the controller's inventory".to_owned())
            } else {
                match (figure, checked) {
                    (None, _) => Err(
                        "not in the PVE API's node list (a node of another cluster?)".to_owned(),
                    ),
                    (Some(f), _) if !f.online => Err("offline in PVE".to_owned()),
                    (Some(f), _) if !f.audited => Err(format!(
                        "PVE shows nothing of what it has: give the token Sys.Audit on /nodes/{node}"
                    )),
                    (_, None) => Err(format!("its prerequisites with VNet {vnet} were not read")),
                    (_, Some(checks)) => match checks.iter().find(|c| c.level == Level::Fail) {
                        Some(failing) => Err(format!(
                            "{} fails ({}): see certistack-ctl doctor {node} --vnet {vnet}",
                            failing.check,
                            certistack_core::untrusted::printable(failing.detail.as_bytes(), 200)
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
                    cores: figure.map_or(0, |f| f.cores),
                    free_memory_mib: figure.map_or(0, |f| f.free_memory_mib),
                },
            );
        }
        if let Ok(mut kept) = self.checked.lock() {
            kept.extend(checks);
        }
        Ok(rooms)
    }

    fn per_node(&self) -> usize {
        self.per_node
    }

    fn asked_nodes(&self) -> bool {
        self.checked.lock().is_ok_and(|checked| !checked.is_empty())
    }
}

/// Nodes asked at once while placing: each check is a TLS handshake and a few calls.
const NODES_ASKED_AT_ONCE: usize = 16;

impl NodeRooms<'_> {
    /// `doctor`'s checks of each `(node, vnet, inventory entry, VNet)`, at most
    /// [`NODES_ASKED_AT_ONCE`] at a time, as an operator the controller's CA certifies.
    #[allow(clippy::type_complexity)]
    fn ask(
        &self,
        asked: Vec<(String, String, crate::config::InventoryNode, VnetName)>,
    ) -> Result<Vec<((String, String), Vec<Check>)>, RoomsError> {
        let no_keys = |error: &dyn std::fmt::Display| {
            RoomsError::Refused(format!(
                "placement asks the nodes as an operator, with a certificate of the controller's CA, which cannot be had from {}: {error}; run certistack-ctl ca init --state-dir {} (or set state_dir to the controller's), or name the node",
                self.config.state_dir.display(),
                self.config.state_dir.display()
            ))
        };
        let authority = Authority::load(&self.config.state_dir).map_err(|e| no_keys(&e))?;
        let identity = authority
            .issue_operator(OPERATOR_NAME, OffsetDateTime::now_utc())
            .map_err(|e| no_keys(&e))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|error| RoomsError::Unavailable(format!("cannot start a runtime: {error}")))?;
        let identity = Arc::new(identity);
        let ca: Arc<str> = authority.ca_pem().into();
        let limit = Arc::new(tokio::sync::Semaphore::new(NODES_ASKED_AT_ONCE));
        Ok(runtime.block_on(async {
            let mut tasks = tokio::task::JoinSet::new();
            for (node, vnet, inventory, vnet_name) in asked {
                let (ca, identity, limit) = (ca.clone(), identity.clone(), limit.clone());
                tasks.spawn(async move {
                    let _turn = limit.acquire_owned().await;
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
            // A check that panicked leaves its node "not read"; the others still count.
            let mut done = Vec::new();
            while let Some(joined) = tasks.join_next().await {
                if let Ok(one) = joined {
                    done.push(one);
                }
            }
            done
        }))
    }
}
