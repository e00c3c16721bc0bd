//! The sandbox VNet's forwarding now and after `ifreload`, legacy NAT rules that touch it, and
//! the firewall the node runs.

use super::{Judged, Level, UPGRADE_CONNECTOR};
use certistack_proto::v1 as pb;

/// Whether a forwarding sysctl or ifupdown2 attribute value means "on".
pub(super) fn is_on(value: &str) -> bool {
    matches!(value.trim(), "1" | "on" | "yes")
}

/// Why `ifreload -a` writes forwarding=1 on the VNet's bridge, or `None` when it writes 0.
/// ifupdown2 (`addons/address.py` `_set_bridge_forwarding`) writes 0 only on a bridge with
/// no upper interface, no `address` and an address method other than `dhcp` (and, patched by
/// Proxmox, `auto`); 1 otherwise, for IPv4 and IPv6. `ip-forward off` is no exception: 3.2.0
/// ignores it on bridges and 3.9.0 applies it only after writing 1.
pub(super) fn reload_turns_forwarding_on(vnet: &pb::VnetFacts) -> Option<String> {
    let name = &vnet.name;
    let stanza = format!("iface {name} in {}", vnet.stanza_file);
    // `inet static`: the family, then the method.
    let method = vnet.address_method.split_whitespace().nth(1).unwrap_or("");
    if vnet.address_present {
        Some(format!("{stanza} has an address"))
    } else if method.is_empty() {
        Some(format!("{stanza} has no address method"))
    } else if matches!(method, "dhcp" | "auto") {
        Some(format!("{stanza} uses the {method} method"))
    } else {
        None
    }
}

pub(super) fn judge_forwarding(facts: &pb::NodeChecksReply) -> Judged {
    const NAME: &str = "vnet-forwarding";
    let Some(vnet) = &facts.vnet else {
        return (
            NAME,
            Level::Ok,
            "not checked: no VNet named (give --vnet VNET or --plan PLAN)".to_owned(),
        );
    };
    let name = &vnet.name;
    let refuse = facts.forwarding_policy != "disable-for-run";
    if vnet.ipv4_forwarding.is_empty() {
        return (
            NAME,
            Level::Fail,
            format!(
                "VNet {name} does not exist on this node (no /proc/sys/net/ipv4/conf/{name}): PrepareSandbox would refuse it; create it in SDN and apply (pvesh set /cluster/sdn)"
            ),
        );
    }
    let on_now: Vec<String> = [
        ("ipv4", &vnet.ipv4_forwarding),
        ("ipv6", &vnet.ipv6_forwarding),
    ]
    .into_iter()
    .filter(|(_, value)| is_on(value))
    .map(|(family, value)| format!("net.{family}.conf.{name}.forwarding = {value}"))
    .collect();
    if !on_now.is_empty() {
        return if refuse {
            (
                NAME,
                Level::Fail,
                format!(
                    "{} now: with sandbox.forwarding = \"refuse\" PrepareSandbox refuses this VNet; set sandbox.forwarding = \"disable-for-run\" in the connector config, or turn forwarding off on {name}",
                    on_now.join(", ")
                ),
            )
        } else {
            (
                NAME,
                Level::Ok,
                format!(
                    "{} now; sandbox.forwarding = \"disable-for-run\" sets it to 0 for each run and restores it at release",
                    on_now.join(", ")
                ),
            )
        };
    }
    if !vnet.stanza_error.is_empty() {
        return (
            NAME,
            Level::Warn,
            format!(
                "forwarding is off on {name} now, but what ifreload writes is unknown: {}; check pve.sdn_interfaces",
                vnet.stanza_error
            ),
        );
    }
    if !vnet.stanza_found {
        return (
            NAME,
            Level::Ok,
            format!(
                "forwarding is off on {name}; {} has no stanza for it, so ifreload -a leaves it",
                vnet.stanza_file
            ),
        );
    }
    if let Some(stanza) = reload_turns_forwarding_on(vnet) {
        return if refuse {
            (
                NAME,
                Level::Warn,
                format!(
                    "forwarding is off on {name} now, but {stanza}: ifupdown2 sets forwarding=1 on reload; set sandbox.forwarding = \"disable-for-run\""
                ),
            )
        } else {
            (
                NAME,
                Level::Ok,
                format!(
                    "{stanza}, so ifreload -a may turn forwarding on; sandbox.forwarding = \"disable-for-run\" turns it off for each run"
                ),
            )
        };
    }
    (
        NAME,
        Level::Ok,
        format!(
            "forwarding is off on {name} and its stanza keeps it off (iface {name} {} without an address)",
            vnet.address_method
        ),
    )
}

pub(super) fn judge_legacy_nat(facts: &pb::NodeChecksReply) -> Judged {
    const NAME: &str = "legacy-nat";
    let Some(nat) = &facts.legacy_nat else {
        return (NAME, Level::Warn, UPGRADE_CONNECTOR.to_owned());
    };
    // SDN's SNAT names the subnet and the uplink, never the VNet: its stanza says it is there.
    if let Some(line) = facts.vnet.as_ref().and_then(|vnet| vnet.snat_lines.first()) {
        return (
            NAME,
            Level::Fail,
            format!(
                "SDN SNAT is configured on this VNet's subnet ({line}){}: remove `snat` from the subnet in Datacenter → SDN → VNets, then apply SDN",
                match nat.vnet_rules.first() {
                    Some(rule) => format!(", loaded in iptables-legacy as {rule}"),
                    None => String::new(),
                }
            ),
        );
    }
    if let Some(rule) = nat.vnet_rules.first() {
        let vnet = facts
            .vnet
            .as_ref()
            .map(|v| v.name.as_str())
            .unwrap_or("the VNet");
        return (
            NAME,
            Level::Fail,
            format!(
                "a NAT rule in iptables-legacy touches {vnet}: {rule}{}; PrepareSandbox refuses the VNet: remove SNAT from its SDN subnet (or the rule)",
                match nat.vnet_rules.len() {
                    1 => String::new(),
                    more => format!(" (and {} more)", more - 1),
                }
            ),
        );
    }
    if !nat.error.is_empty() {
        return (
            NAME,
            Level::Fail,
            format!(
                "{}; PrepareSandbox cannot complete its NAT check either: fix tools.iptables_legacy_save / limits.max_ruleset_bytes",
                nat.error
            ),
        );
    }
    let read = nat.sources.join("; ");
    match &facts.vnet {
        Some(vnet) => (
            NAME,
            Level::Ok,
            format!(
                "{} legacy NAT rule(s), none touches {} ({read})",
                nat.rule_count, vnet.name
            ),
        ),
        None => (
            NAME,
            Level::Ok,
            format!(
                "{} legacy NAT rule(s), not checked against a VNet (give --vnet or --plan) ({read})",
                nat.rule_count
            ),
        ),
    }
}

pub(super) fn judge_firewall(firewall: Option<&pb::FirewallFacts>) -> Judged {
    const NAME: &str = "firewall";
    let Some(fw) = firewall else {
        return (NAME, Level::Warn, UPGRADE_CONNECTOR.to_owned());
    };
    let errors: Vec<&str> = [
        fw.host_fw_error.as_str(),
        fw.cluster_fw_error.as_str(),
        fw.nft_error.as_str(),
    ]
    .into_iter()
    .filter(|e| !e.is_empty())
    .collect();
    if !errors.is_empty() {
        return (
            NAME,
            Level::Warn,
            format!(
                "firewall not determined: {}; check pve.nodes_dir and tools.nft",
                errors.join("; ")
            ),
        );
    }
    // proxmox-firewall keeps its tables only while the datacenter firewall and the host's
    // `nftables` option are both on; otherwise it removes them.
    let datacenter_on = is_on(&fw.datacenter_enable_option);
    let selected = is_on(&fw.nftables_option);
    let loaded = fw.proxmox_firewall_table || fw.proxmox_firewall_guests_table;
    match (datacenter_on && selected, loaded) {
        (true, true) => (
            NAME,
            Level::Ok,
            "proxmox-firewall (nftables): its table inet proxmox-firewall hooks at priorities filter-1, filter and filter+1 and its table bridge proxmox-firewall-guests at 0, and a drop there is final, so a VNet firewall with a DROP policy can drop probe traffic; keep the sandbox VNet's firewall off or allow the probe ports".to_owned(),
        ),
        (true, false) => (
            NAME,
            Level::Warn,
            format!(
                "{} enables the datacenter firewall and {} selects proxmox-firewall (nftables: {}), but its tables are not loaded: check proxmox-firewall.service (systemctl status proxmox-firewall)",
                fw.cluster_fw, fw.host_fw, fw.nftables_option
            ),
        ),
        (false, true) => (
            NAME,
            Level::Warn,
            format!(
                "proxmox-firewall tables are loaded, but {}: proxmox-firewall removes its tables in that case, so these are leftovers or it is not running; restart proxmox-firewall.service (systemctl restart proxmox-firewall) so one firewall remains",
                if selected {
                    format!("the datacenter firewall is off ({} has no enable: 1)", fw.cluster_fw)
                } else {
                    format!("{} does not select nftables", fw.host_fw)
                }
            ),
        ),
        (false, false) if selected => (
            NAME,
            Level::Ok,
            format!(
                "{} selects nftables, but the datacenter firewall is off ({} has no enable: 1), so proxmox-firewall loads no tables and no host firewall filters; SDN's SNAT lives in iptables-legacy, which the legacy-nat check reads",
                fw.host_fw, fw.cluster_fw
            ),
        ),
        (false, false) => (
            NAME,
            Level::Ok,
            "pve-firewall (iptables-legacy) or none: its rules and SDN's SNAT live in iptables-legacy, which the legacy-nat check reads".to_owned(),
        ),
    }
}
