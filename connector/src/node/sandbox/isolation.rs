//! The isolation rules: every way an observed VNet breaks isolation, and every way a probe
//! network would change how the node routes its own traffic.

use super::MAX_LISTED_CONFLICTS;
use super::Stage;
use super::observation::Observation;
use crate::config::ForwardingPolicy;
use certistack_core::grant::Grant;
use certistack_core::net::IpNetwork;
use certistack_core::validate::VnetName;

/// Every way the observed VNet breaks isolation, each naming the property. Under
/// `sandbox.forwarding = "disable-for-run"`, forwarding found on at `PrepareSandbox` is not a
/// violation: the step turns it off before any guest boots (and `StartVm` checks it is off).
pub fn violations(
    grant: &Grant,
    vnet: &VnetName,
    seen: &Observation,
    stage: Stage,
    forwarding: ForwardingPolicy,
) -> Vec<String> {
    let disabled_for_run = stage == Stage::Prepare && forwarding == ForwardingPolicy::DisableForRun;
    let mut violations = Vec::new();
    if !seen.is_bridge {
        violations.push(format!("bridge {vnet} does not exist on this node"));
        return violations;
    }
    for port in &seen.ports {
        let ours = port
            .strip_prefix("tap")
            .and_then(|rest| rest.split_once('i'))
            .and_then(|(vmid, n)| Some((vmid.parse::<u32>().ok()?, n)))
            .is_some_and(|(vmid, n)| {
                !n.is_empty()
                    && n.bytes().all(|b| b.is_ascii_digit())
                    && grant.sandbox_vms.keys().any(|v| v.get() == vmid)
            });
        if !ours {
            violations.push(format!(
                "port {port} is not a tap of this run's sandbox VMs (an uplink or another VM)"
            ));
        }
    }
    match seen.forwarding.as_deref() {
        Some("0") => {}
        Some(_) if disabled_for_run => {}
        Some(value) => violations.push(format!(
            "IPv4 forwarding is on for {vnet} (net.ipv4.conf.{vnet}.forwarding = {value}; turn it off, or set sandbox.forwarding = \"disable-for-run\")"
        )),
        None => violations.push(format!("net.ipv4.conf.{vnet}.forwarding cannot be read")),
    }
    if let Some(value) = seen
        .forwarding_v6
        .as_deref()
        .filter(|v| *v != "0" && !disabled_for_run)
    {
        violations.push(format!(
            "IPv6 forwarding is on for {vnet} (net.ipv6.conf.{vnet}.forwarding = {value}; turn it off, or set sandbox.forwarding = \"disable-for-run\")"
        ));
    }
    let probe = grant.probe_source.to_string();
    for address in &seen.addresses {
        // Link-local IPv6 is every up interface's own; the containment table covers it.
        if address == &probe && stage == Stage::Boot {
            // This run added it at PrepareSandbox.
        } else if address == &probe {
            // Somebody else added it: this run must not take it over or remove it later.
            violations.push(format!(
                "{vnet} already carries the probe address {address} (another run or an administrator added it)"
            ));
        } else if !address.starts_with("fe80:") {
            violations.push(format!(
                "{vnet} carries address {address} (a gateway): the guest could be routed out"
            ));
        }
    }
    for rule in seen.nat_rules.iter().take(MAX_LISTED_CONFLICTS) {
        violations.push(format!("a NAT rule references {vnet}: {rule}"));
    }
    if let Some(more) = seen
        .nat_rules
        .len()
        .checked_sub(MAX_LISTED_CONFLICTS)
        .filter(|n| *n > 0)
    {
        violations.push(format!("and {more} more NAT rules that reference {vnet}"));
    }
    for upper in &seen.upper_devices {
        violations.push(format!(
            "link {upper} is stacked on the VNet (a VLAN, macvlan or similar upper device): its frames bypass the containment table"
        ));
    }
    violations
}

/// Every way the probe network would change how the node routes its own traffic: a prefix
/// wider than `limits.min_probe_prefix`, a probe address the node already has, a network that
/// overlaps an address or a route of the node (its connected route would take that traffic).
pub fn probe_network_conflicts(
    grant: &Grant,
    min_probe_prefix: u8,
    seen: &Observation,
) -> Vec<String> {
    let mut conflicts = Vec::new();
    if let Err(wide) = grant.check_probe_prefix(min_probe_prefix) {
        conflicts.push(wide);
    }
    let probe = grant.probe_source.address.0;
    let network = IpNetwork::of(&grant.probe_source);
    for node in &seen.node_addresses {
        if node.address == probe {
            conflicts.push(format!(
                "the probe address {probe} is already an address of this node (on {}): guest packets could pass as replies to the node",
                node.device
            ));
        } else if node.device != grant.vnet.as_str()
            && IpNetwork::new(node.address, node.prefix_len)
                .is_some_and(|theirs| theirs.overlaps(&network))
        {
            conflicts.push(format!(
                "the probe network {network} overlaps the node's address {}/{} on {}",
                node.address, node.prefix_len, node.device
            ));
        }
    }
    for route in &seen.node_routes {
        if route.destination.overlaps(&network) {
            conflicts.push(format!(
                "the probe network {network} overlaps the node's route {} dev {} table {}",
                route.destination, route.device, route.table
            ));
        }
    }
    if conflicts.len() > MAX_LISTED_CONFLICTS {
        let more = conflicts.len() - MAX_LISTED_CONFLICTS;
        conflicts.truncate(MAX_LISTED_CONFLICTS);
        conflicts.push(format!("and {more} more"));
    }
    conflicts
}
