//! The run's sandbox network: isolation checks, the probe address, and a containment table.
//!
//! `PrepareSandbox` first reads the VNet's state and refuses the run when it is not isolated:
//! the bridge must exist; its only ports may be taps of this run's sandbox VMs
//! (`tap<vmid>i<N>`); no link may be stacked on it or on a port (a VLAN or macvlan takes frames
//! the table never sees); forwarding must be off on it (or, under `sandbox.forwarding =
//! "disable-for-run"`, the step turns it off for the run, journaled with the previous values
//! and restored at release or cleanup); it must carry no address but the probe address (a
//! gateway would route the guest out); no NAT rule may mention it, in nftables or in the legacy
//! iptables NAT tables that pve-firewall and SDN's SNAT use. It then
//! refuses a probe network that would change how the node routes its own traffic: wider than
//! `limits.min_probe_prefix`, overlapping an address or route of the node, or a probe address
//! the node already has. The connector never creates or changes SDN configuration. Only then
//! it installs one nftables table per run, atomically (`nft -f`), that
//! - drops every packet from the VNet to the node but replies to the connector's own probes,
//! - drops all forwarding into and out of the VNet,
//! - lets the probe address send only to the grant's probe targets (and, for IPv6, exchange
//!   neighbour discovery with them and nothing else),
//!
//! and after it the probe address, so the address never exists without the table. `StartVm`
//! repeats the isolation checks before every boot.
//!
//! The reply carries the evidence: the ports, addresses and sysctl observed and the installed
//! ruleset with its SHA-256, so a report can show what protected the network during the run.
//! Without that listing the step fails.

mod executor;
mod forwarding;
mod isolation;
mod nat;
mod observation;
mod ruleset;

pub use isolation::{probe_network_conflicts, violations};
pub use nat::legacy_nat_rules;
pub(crate) use nat::{LegacyNat, read_legacy_nat};
pub use observation::{NodeAddress, NodeRoute, Observation, stacked_links};
pub use ruleset::{ruleset, table_name};

use crate::node::context::NodeContext;

/// When the VNet is checked: before the probe address exists, or before a guest boots (when it
/// must be there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Prepare,
    Boot,
}

/// The sandbox's executor: prepares, re-checks and releases a run's containment table and
/// probe address (`executor`), reads the node's network to decide whether it may
/// (`observation`), and sets the VNet's forwarding (`forwarding`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sandbox<'a> {
    ctx: &'a NodeContext,
}

impl NodeContext {
    pub(in crate::node) fn sandbox(&self) -> Sandbox<'_> {
        Sandbox { ctx: self }
    }
}

/// Conflicts (and NAT rules) at most listed in one refusal; the rest are counted.
const MAX_LISTED_CONFLICTS: usize = 8;

#[cfg(test)]
mod tests;
