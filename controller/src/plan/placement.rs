//! `node: auto` (or a list of nodes): which node each such validation runs on. A pure
//! function of what the nodes have and what the validations need, so its choices can be read,
//! tested and explained.
//!
//! A node is a candidate when the inventory has it, PVE says it is online, its connector
//! answers Hello with this controller's surface and its prerequisites pass with the
//! validation's VNet (the facts are gathered by the caller; here they are given), it has as many
//! CPUs as the largest sandbox VM's cores (PVE shares CPUs between VMs, so the cores in use do
//! not count) and the validation's memory fits in what it has free. Validations are placed in
//! plan order: each on the candidate where it would start soonest (the fewest rounds of
//! validations already placed there), then the fewest placed there, then the most memory
//! left, then by name; the
//! night's load is spread rather than stacked. A node runs at most `per_node` validations at
//! once, fewer where its free memory holds fewer of the largest placed there: placement says
//! how many, and the run keeps to it. What the plan places on a named node counts as load too.

use std::collections::{BTreeMap, BTreeSet};

/// Where placement reads what the nodes have: PVE's figures and each node's readiness per VNet.
pub trait Rooms {
    /// Each `(node, vnet)` of `pairs`: the node's room for a validation on that VNet.
    fn rooms(
        &self,
        pairs: &BTreeSet<(String, String)>,
    ) -> Result<BTreeMap<(String, String), NodeRoom>, RoomsError>;
    /// Validations at once on one node (`run --per-node`).
    fn per_node(&self) -> usize;
    /// Whether any node's connector was asked (its prerequisites).
    fn asked_nodes(&self) -> bool {
        false
    }
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
        _pairs: &BTreeSet<(String, String)>,
    ) -> Result<BTreeMap<(String, String), NodeRoom>, RoomsError> {
        Err(RoomsError::Refused(
            "the node is chosen by asking the PVE API (which nodes are online, what they have free) and each node's connector (Hello, its prerequisites with the VNet): configure [pve] and use certistack-ctl plan check or plan show without --offline, or run, or name the node".into(),
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
    /// Its CPUs (PVE's `maxcpu`): no VM may have more cores.
    pub cores: u32,
    pub free_memory_mib: u64,
}

/// What one validation needs, and where it may go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Demand {
    /// The nodes it may run on, in the plan's words (`auto`: the whole inventory).
    pub candidates: Vec<String>,
    /// The cores of its largest sandbox VM.
    pub vm_cores: u32,
    /// Its sandbox VMs' memory, added up.
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

/// What placement decided: each demand's node, in order, and the nodes that may run fewer
/// than `per_node` at once (their free memory holds no more of what was placed there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub placed: Vec<Placed>,
    pub at_once: BTreeMap<String, usize>,
}

/// Places `demands` in order on `rooms` (each node's readiness for a demand's VNet looked up
/// as `rooms[(node, vnet)]`), with `named` (each node's memory demands the plan places there by
/// name) already there, at most `per_node` running at once on one node.
pub fn place(
    demands: &[Demand],
    named: &BTreeMap<String, Vec<u64>>,
    rooms: &BTreeMap<(String, String), NodeRoom>,
    per_node: usize,
) -> Placement {
    let per_node = per_node.max(1);
    // The memory of each validation placed on each node so far.
    let mut load: BTreeMap<String, Vec<u64>> = named.clone();
    let mut at_once: BTreeMap<String, usize> = BTreeMap::new();
    let placed = demands
        .iter()
        .map(|demand| {
            let mut why_not = Vec::new();
            // (room, at once there, memory left at once, its order: the rounds before it
            // starts, the validations there, the most memory left)
            #[allow(clippy::type_complexity)]
            let mut best: Option<(&NodeRoom, usize, u64, (usize, usize, std::cmp::Reverse<u64>))> =
                None;
            let mut ready = 0usize;
            for name in unique(&demand.candidates) {
                let Some(room) = rooms.get(&(name.clone(), demand.vnet.clone())) else {
                    why_not.push(format!("{name}: not examined"));
                    continue;
                };
                if let Err(why) = &room.ready {
                    why_not.push(format!("{name}: {why}"));
                    continue;
                }
                ready += 1;
                if demand.vm_cores > room.cores {
                    why_not.push(format!(
                        "{name}: {} CPUs, fewer than a sandbox VM's {} cores",
                        room.cores, demand.vm_cores
                    ));
                    continue;
                }
                if demand.memory_mib > room.free_memory_mib {
                    why_not.push(format!(
                        "{name}: {} MiB free, {} MiB needed",
                        room.free_memory_mib, demand.memory_mib
                    ));
                    continue;
                }
                let mut there = load.get(name).cloned().unwrap_or_default();
                there.push(demand.memory_mib);
                let fits = fitting(&there, room.free_memory_mib, per_node);
                let rounds = there.len().div_ceil(fits);
                let left = room.free_memory_mib - largest(&there, fits);
                let key = (rounds, there.len(), std::cmp::Reverse(left));
                if best.as_ref().is_none_or(|(.., best_key)| key < *best_key) {
                    best = Some((room, fits, left, key));
                }
            }
            match best {
                Some((room, fits, left, _)) => {
                    let there = load.entry(room.name.clone()).or_default();
                    there.push(demand.memory_mib);
                    let count = there.len();
                    // Memory, not the per-node limit or the count, holds it to fewer at once.
                    if fits < per_node.min(count) {
                        let limit = at_once.entry(room.name.clone()).or_insert(fits);
                        *limit = (*limit).min(fits);
                    }
                    let mut why = format!(
                        "{left} MiB left with {fits} at once, of {} MiB free; validation {count} there",
                        room.free_memory_mib
                    );
                    if ready > 1 {
                        why.push_str(&format!("; the soonest start and most room of {ready} ready"));
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
                    "no candidate node can take it ({} MiB, a VM of {} cores): {}",
                    demand.memory_mib,
                    demand.vm_cores,
                    listed(&why_not)
                )),
            }
        })
        .collect();
    Placement { placed, at_once }
}

/// `names` without repeats, in their order (`node: [pve1, pve1]` is one candidate).
fn unique(names: &[String]) -> Vec<&String> {
    let mut seen = BTreeSet::new();
    names.iter().filter(|name| seen.insert(*name)).collect()
}

/// How many of `load` may run at once within `free` MiB: at most `per_node`, and at least one
/// (each fits alone, or it would not have been placed).
fn fitting(load: &[u64], free: u64, per_node: usize) -> usize {
    (1..=per_node.min(load.len()).max(1))
        .rev()
        .find(|&k| largest(load, k) <= free)
        .unwrap_or(1)
}

/// The memory of the `k` largest of `load`: what runs at once at worst.
fn largest(load: &[u64], k: usize) -> u64 {
    let mut load = load.to_vec();
    load.sort_unstable_by(|a, b| b.cmp(a));
    load.iter()
        .take(k)
        .fold(0u64, |sum, m| sum.saturating_add(*m))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn room(name: &str, cores: u32, memory_mib: u64) -> NodeRoom {
        NodeRoom {
            name: name.into(),
            ready: Ok(()),
            cores,
            free_memory_mib: memory_mib,
        }
    }

    fn rooms(list: Vec<NodeRoom>) -> BTreeMap<(String, String), NodeRoom> {
        list.into_iter()
            .map(|room| ((room.name.clone(), "csnet1".to_owned()), room))
            .collect()
    }

    fn demand(candidates: &[&str], vm_cores: u32, memory_mib: u64) -> Demand {
        Demand {
            candidates: candidates.iter().map(|c| (*c).to_owned()).collect(),
            vm_cores,
            memory_mib,
            vnet: "csnet1".into(),
        }
    }

    fn nodes(placement: &Placement) -> Vec<String> {
        placement
            .placed
            .iter()
            .map(|p| match p {
                Placed::On { node, .. } => node.clone(),
                Placed::Nowhere(_) => "-".into(),
            })
            .collect()
    }

    fn count(placement: &Placement, node: &str) -> usize {
        nodes(placement).iter().filter(|n| *n == node).count()
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
        let placement = place(
            &[demand(&candidates, 1, 256)],
            &BTreeMap::new(),
            &rooms(list),
            2,
        );
        let Placed::Nowhere(why) = &placement.placed[0] else {
            panic!("{placement:?}")
        };
        assert_eq!(
            why.matches("offline in PVE").count(),
            MAX_REASONS_SHOWN,
            "{why}"
        );
        assert!(why.ends_with("; and 12 more"), "{why}");
    }

    #[test]
    fn twenty_validations_on_three_nodes_are_spread_evenly() {
        let rooms = rooms(vec![
            room("pve1", 8, 14336),
            room("pve2", 8, 14336),
            room("pve3", 8, 14336),
        ]);
        let all = ["pve1", "pve2", "pve3"];
        let placement = place(
            &vec![demand(&all, 2, 4096); 20],
            &BTreeMap::new(),
            &rooms,
            2,
        );
        let counts: Vec<usize> = all.iter().map(|n| count(&placement, n)).collect();
        assert_eq!(counts, [7, 7, 6], "{:?}", nodes(&placement));
        assert!(placement.at_once.is_empty(), "{placement:?}");
    }

    #[test]
    fn the_node_with_room_is_preferred() {
        let rooms = rooms(vec![room("pve1", 8, 4096), room("pve2", 8, 16384)]);
        let both = ["pve1", "pve2"];
        let placement = place(
            &vec![demand(&both, 2, 4096); 3],
            &BTreeMap::new(),
            &rooms,
            1,
        );
        // One at a time: pve2 first (more left), then pve1 (it would start a round sooner),
        // then pve2 again.
        assert_eq!(nodes(&placement), ["pve2", "pve1", "pve2"]);
        let Placed::On { why, .. } = &placement.placed[0] else {
            panic!("{placement:?}")
        };
        assert!(
            why.contains("12288 MiB left with 1 at once, of 16384 MiB free; validation 1 there"),
            "{why}"
        );
        assert!(
            why.contains("the soonest start and most room of 2 ready"),
            "{why}"
        );
    }

    #[test]
    fn a_node_not_ready_or_too_small_is_passed_over_saying_why() {
        let mut down = room("pve1", 64, 65536);
        down.ready = Err("its connector does not answer".into());
        let rooms = rooms(vec![down, room("pve2", 2, 2048), room("pve3", 1, 65536)]);
        let three = ["pve1", "pve2", "pve3", "pve2"];
        let placement = place(
            &[demand(&three, 2, 2048), demand(&three, 2, 4096)],
            &BTreeMap::new(),
            &rooms,
            4,
        );
        let Placed::On { node, why } = &placement.placed[0] else {
            panic!("{placement:?}")
        };
        assert_eq!(node, "pve2");
        assert!(
            why.contains("passed over: pve1: its connector does not answer; pve3: 1 CPUs, fewer than a sandbox VM's 2 cores"),
            "{why}"
        );
        let Placed::Nowhere(why) = &placement.placed[1] else {
            panic!("{placement:?}")
        };
        // pve2 is named twice, and judged once.
        assert_eq!(why.matches("pve2:").count(), 1, "{why}");
        assert!(
            why.contains("pve2: 2048 MiB free, 4096 MiB needed"),
            "{why}"
        );
    }

    #[test]
    fn a_node_whose_memory_holds_fewer_runs_fewer_at_once() {
        let rooms = rooms(vec![room("pve1", 4, 5000)]);
        let placement = place(
            &vec![demand(&["pve1"], 2, 2048); 5],
            &BTreeMap::new(),
            &rooms,
            3,
        );
        // Each fits alone; two fit at once, not three: all five go there, two at a time.
        assert_eq!(nodes(&placement), ["pve1"; 5]);
        assert_eq!(placement.at_once.get("pve1"), Some(&2));
    }

    #[test]
    fn what_the_plan_names_counts_as_load() {
        let rooms = rooms(vec![room("pve1", 8, 8192), room("pve2", 8, 8192)]);
        let named = BTreeMap::from([("pve1".to_owned(), vec![2048, 2048])]);
        let placement = place(&[demand(&["pve1", "pve2"], 1, 1024)], &named, &rooms, 2);
        assert_eq!(nodes(&placement), ["pve2"]);
    }

    #[test]
    fn a_node_never_examined_or_an_empty_inventory_is_said() {
        let none = BTreeMap::new();
        let placement = place(&[demand(&["pve9"], 1, 512)], &none, &BTreeMap::new(), 4);
        assert_eq!(
            placement.placed,
            [Placed::Nowhere(
                "no candidate node can take it (512 MiB, a VM of 1 cores): pve9: not examined"
                    .into()
            )]
        );
        let placement = place(&[demand(&[], 1, 512)], &none, &BTreeMap::new(), 4);
        assert!(
            matches!(&placement.placed[0], Placed::Nowhere(why) if why.contains("inventory is empty"))
        );
    }
}
