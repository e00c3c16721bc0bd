//! `node: auto` (or a list of nodes): which node each such validation runs on. A pure
//! function of what the nodes have free and what the validations need, so its choices can be
//! read, tested and explained.
//!
//! A node is a candidate when the inventory has it, PVE says it is online, its connector
//! answers Hello with this controller's surface and its prerequisites pass with the
//! validation's VNet (the facts are gathered by the caller; here they are given). Validations
//! are placed in plan order, each on the candidate with the most memory left after it
//! (then the most cores, then the name): the night's load is spread rather than stacked. A node
//! runs at most `per_node` validations at once, so what must fit in its free cores and memory is
//! the `per_node` largest demands placed on it, not all of them.

use std::collections::{BTreeMap, BTreeSet};

/// Where placement reads what the nodes have: PVE's figures and each node's readiness per VNet.
pub trait Rooms {
    /// Each of `nodes`' room for a validation on each of `vnets`, keyed `(node, vnet)`.
    fn rooms(
        &self,
        nodes: &BTreeSet<String>,
        vnets: &BTreeSet<String>,
    ) -> Result<BTreeMap<(String, String), NodeRoom>, RoomsError>;
    /// Validations at once on one node (`run --per-node`).
    fn per_node(&self) -> usize;
}

/// Why the nodes' room could not be read.
#[derive(Debug, thiserror::Error)]
pub enum RoomsError {
    /// The PVE API or the controller's keys could not be used: the plan may be fine.
    #[error("{0}")]
    Unavailable(String),
    /// Placement cannot be done here (no `[pve]`, no API asked).
    #[error("{0}")]
    Refused(String),
}

/// No placement: `node: auto` and lists are refused, saying what decides them.
#[derive(Debug, Clone, Copy)]
pub struct NoRooms;

impl Rooms for NoRooms {
    fn rooms(
        &self,
        _nodes: &BTreeSet<String>,
        _vnets: &BTreeSet<String>,
    ) -> Result<BTreeMap<(String, String), NodeRoom>, RoomsError> {
        Err(RoomsError::Refused(
            "the node is chosen by asking the PVE API (which nodes are online, what they have free) and each node's connector (Hello, its prerequisites with the VNet): configure [pve] and use certistack-ctl plan check, plan show or run, or name the node".into(),
        ))
    }

    fn per_node(&self) -> usize {
        1
    }
}

/// What a node has for sandbox VMs, or why it takes none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRoom {
    pub name: String,
    /// `Err(why)`: not a candidate (offline in PVE, its connector down or on another surface,
    /// a prerequisite failing for the VNet).
    pub ready: Result<(), String>,
    pub free_cores: u32,
    pub free_memory_mib: u64,
}

/// What one validation needs, and where it may go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Demand {
    /// The nodes it may run on, in the plan's words (`auto`: the whole inventory).
    pub candidates: Vec<String>,
    /// Its sandbox VMs' cores and memory, added up.
    pub cores: u32,
    pub memory_mib: u64,
    /// The VNet it attaches to: a node's readiness is judged per VNet.
    pub vnet: String,
}

/// Where a validation went and why; or why it went nowhere.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placed {
    On { node: String, why: String },
    Nowhere(String),
}

/// Places `demands` in order on `rooms` (each node's readiness for a demand's VNet looked up
/// as `rooms[(node, vnet)]`), at most `per_node` running at once on one node.
pub fn place(
    demands: &[Demand],
    rooms: &BTreeMap<(String, String), NodeRoom>,
    per_node: usize,
) -> Vec<Placed> {
    let per_node = per_node.max(1);
    // The demands placed on each node so far: (cores, memory).
    let mut placed: BTreeMap<String, Vec<(u32, u64)>> = BTreeMap::new();
    demands
        .iter()
        .map(|demand| {
            let mut why_not = Vec::new();
            let mut best: Option<(&NodeRoom, u64, u32)> = None;
            for name in &demand.candidates {
                let Some(room) = rooms.get(&(name.clone(), demand.vnet.clone())) else {
                    why_not.push(format!("{name}: not examined"));
                    continue;
                };
                if let Err(why) = &room.ready {
                    why_not.push(format!("{name}: {why}"));
                    continue;
                }
                let mut load = placed.get(name).cloned().unwrap_or_default();
                load.push((demand.cores, demand.memory_mib));
                let (cores, memory) = busiest(&load, per_node);
                if cores > room.free_cores || memory > room.free_memory_mib {
                    why_not.push(format!(
                        "{name}: {} cores and {} MiB free, {cores} cores and {memory} MiB needed at once",
                        room.free_cores, room.free_memory_mib
                    ));
                    continue;
                }
                let memory_left = room.free_memory_mib - memory;
                let cores_left = room.free_cores - cores;
                let better = match best {
                    None => true,
                    Some((_, best_memory, best_cores)) => {
                        (memory_left, cores_left) > (best_memory, best_cores)
                    }
                };
                if better {
                    best = Some((room, memory_left, cores_left));
                }
            }
            match best {
                Some((room, memory_left, cores_left)) => {
                    placed
                        .entry(room.name.clone())
                        .or_default()
                        .push((demand.cores, demand.memory_mib));
                    let others = demand.candidates.len().saturating_sub(1);
                    let mut why = format!(
                        "{} MiB and {} cores left after it, of {} MiB and {} cores free",
                        memory_left, cores_left, room.free_memory_mib, room.free_cores
                    );
                    if others > 0 {
                        why.push_str(&format!(
                            "; the most room of {} candidate(s)",
                            demand.candidates.len()
                        ));
                    }
                    if !why_not.is_empty() {
                        why.push_str(&format!("; passed over: {}", listed(&why_not)));
                    }
                    Placed::On {
                        node: room.name.clone(),
                        why,
                    }
                }
                None if demand.candidates.is_empty() => {
                    Placed::Nowhere("no candidate node (the inventory is empty)".into())
                }
                None => Placed::Nowhere(format!(
                    "no candidate node can take it ({} cores, {} MiB): {}",
                    demand.cores,
                    demand.memory_mib,
                    listed(&why_not)
                )),
            }
        })
        .collect()
}

/// The candidates' reasons a person reads in `plan show` and the report: the first
/// [`MAX_REASONS_SHOWN`], then how many more (an inventory may hold 1024 nodes).
fn listed(reasons: &[String]) -> String {
    let mut text = reasons
        .iter()
        .take(MAX_REASONS_SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join("; ");
    if reasons.len() > MAX_REASONS_SHOWN {
        text.push_str(&format!("; and {} more", reasons.len() - MAX_REASONS_SHOWN));
    }
    text
}

/// Reasons of passed-over candidates shown per validation.
const MAX_REASONS_SHOWN: usize = 8;

/// The cores and memory of the `per_node` largest demands of `load` (by memory, then cores):
/// what runs at once at worst.
fn busiest(load: &[(u32, u64)], per_node: usize) -> (u32, u64) {
    let mut load = load.to_vec();
    load.sort_by_key(|&(cores, memory)| std::cmp::Reverse((memory, cores)));
    load.iter()
        .take(per_node)
        .fold((0u32, 0u64), |(cores, memory), (c, m)| {
            (cores.saturating_add(*c), memory.saturating_add(*m))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn room(name: &str, cores: u32, memory_mib: u64) -> NodeRoom {
        NodeRoom {
            name: name.into(),
            ready: Ok(()),
            free_cores: cores,
            free_memory_mib: memory_mib,
        }
    }

    fn rooms(list: Vec<NodeRoom>) -> BTreeMap<(String, String), NodeRoom> {
        list.into_iter()
            .map(|room| ((room.name.clone(), "csnet1".to_owned()), room))
            .collect()
    }

    fn demand(candidates: &[&str], cores: u32, memory_mib: u64) -> Demand {
        Demand {
            candidates: candidates.iter().map(|c| (*c).to_owned()).collect(),
            cores,
            memory_mib,
            vnet: "csnet1".into(),
        }
    }

    fn nodes(placed: &[Placed]) -> Vec<String> {
        placed
            .iter()
            .map(|p| match p {
                Placed::On { node, .. } => node.clone(),
                Placed::Nowhere(_) => "-".into(),
            })
            .collect()
    }

    #[test]
    fn the_reasons_of_a_large_inventory_are_bounded() {
        let names: Vec<String> = (1..=20).map(|i| format!("pve{i}")).collect();
        let list = names
            .iter()
            .map(|name| NodeRoom {
                ready: Err("offline in PVE".into()),
                ..room(name, 8, 8192)
            })
            .collect();
        let candidates: Vec<&str> = names.iter().map(String::as_str).collect();
        let placed = place(&[demand(&candidates, 1, 256)], &rooms(list), 2);
        let Placed::Nowhere(why) = &placed[0] else {
            panic!("{placed:?}")
        };
        assert_eq!(
            why.matches("offline in PVE").count(),
            MAX_REASONS_SHOWN,
            "{why}"
        );
        assert!(why.ends_with("; and 12 more"), "{why}");
    }

    #[test]
    fn the_node_with_room_is_preferred_and_the_load_is_spread() {
        let rooms = rooms(vec![room("pve1", 8, 4096), room("pve2", 8, 16384)]);
        let both = ["pve1", "pve2"];
        let placed = place(
            &[
                demand(&both, 2, 4096),
                demand(&both, 2, 4096),
                demand(&both, 2, 4096),
                demand(&both, 2, 4096),
            ],
            &rooms,
            4,
        );
        // pve2 has the room; once it has taken three, pve1 has as much left.
        assert_eq!(nodes(&placed), ["pve2", "pve2", "pve2", "pve1"]);
        let Placed::On { why, .. } = &placed[0] else {
            panic!("{placed:?}")
        };
        assert!(why.contains("12288 MiB and 6 cores left after it"), "{why}");
    }

    #[test]
    fn a_node_not_ready_is_passed_over_saying_why_and_nothing_fitting_errs() {
        let mut down = room("pve1", 64, 65536);
        down.ready = Err("its connector does not answer".into());
        let rooms = rooms(vec![down, room("pve2", 2, 2048)]);
        let placed = place(
            &[
                demand(&["pve1", "pve2"], 2, 2048),
                demand(&["pve1", "pve2"], 2, 2048),
            ],
            &rooms,
            4,
        );
        let Placed::On { node, why } = &placed[0] else {
            panic!("{placed:?}")
        };
        assert_eq!(node, "pve2");
        assert!(
            why.contains("passed over: pve1: its connector does not answer"),
            "{why}"
        );
        let Placed::Nowhere(why) = &placed[1] else {
            panic!("{placed:?}")
        };
        assert!(why.contains("pve1: its connector does not answer"), "{why}");
        assert!(
            why.contains("pve2: 2 cores and 2048 MiB free, 4 cores and 4096 MiB needed at once"),
            "{why}"
        );
    }

    #[test]
    fn only_what_runs_at_once_must_fit_within_the_per_node_limit() {
        let rooms = rooms(vec![room("pve1", 4, 4096)]);
        let demands = vec![demand(&["pve1"], 2, 2048); 5];
        // One at a time: each fits alone, so all five go there and wait their turn.
        assert_eq!(nodes(&place(&demands, &rooms, 1)), ["pve1"; 5]);
        // Three at once would need 6 cores: the third and later do not fit.
        assert_eq!(
            nodes(&place(&demands, &rooms, 3)),
            ["pve1", "pve1", "-", "-", "-"]
        );
    }

    #[test]
    fn a_node_never_examined_or_an_empty_inventory_is_said() {
        let placed = place(&[demand(&["pve9"], 1, 512)], &BTreeMap::new(), 4);
        assert_eq!(
            placed,
            [Placed::Nowhere(
                "no candidate node can take it (1 cores, 512 MiB): pve9: not examined".into()
            )]
        );
        let placed = place(&[demand(&[], 1, 512)], &BTreeMap::new(), 4);
        assert!(matches!(&placed[0], Placed::Nowhere(why) if why.contains("inventory is empty")));
    }
}
