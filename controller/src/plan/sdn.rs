//! A preprovisioned sandbox VNet as Proxmox VE's SDN configuration says it is, read through the
//! API and never written: a Simple zone (a bridge on each node, no uplink: VLAN, QinQ, VXLAN
//! and EVPN zones carry the VNet off the node), present on the node the validation runs on,
//! and subnets without a gateway, SNAT or a DHCP range; no change pending. The node's own
//! checks (`doctor`, the run's prerequisites) stay: the API says what PVE intends, the node
//! what is.

/// The VNet, its zone and its subnets, with what an SDN apply would change.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SdnView {
    pub zone: String,
    /// `simple`, `vlan`, `qinq`, `vxlan`, `evpn`, ...
    pub zone_type: String,
    /// The nodes the zone is on; `None`: every node.
    pub zone_nodes: Option<Vec<String>>,
    pub subnets: Vec<SubnetView>,
    /// What is pending on the zone, the VNet or a subnet, said for a person.
    pub pending: Vec<String>,
}

/// One subnet of the VNet.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SubnetView {
    pub cidr: String,
    pub gateway: Option<String>,
    pub snat: bool,
    pub dhcp_range: bool,
}

/// Why `vnet`, as `view` shows it, may not carry a sandbox on `node`; empty when it may.
pub fn problems(view: &SdnView, vnet: &str, node: &str) -> Vec<String> {
    let mut out = configuration_problems(view, vnet);
    out.extend(node_problems(view, node));
    out
}

/// Why `node` may not carry a sandbox on the VNet `view` shows: its zone is not there.
pub fn node_problems(view: &SdnView, node: &str) -> Vec<String> {
    match &view.zone_nodes {
        Some(nodes) if !nodes.iter().any(|n| n == node) => vec![format!(
            "its zone {} is not on node {node} (nodes {}): add the node to the zone, or run the validation elsewhere",
            view.zone,
            nodes.join(",")
        )],
        _ => Vec::new(),
    }
}

/// Why `vnet`, as `view` shows it, may carry no sandbox on any node.
pub fn configuration_problems(view: &SdnView, vnet: &str) -> Vec<String> {
    let mut out = Vec::new();
    if view.zone_type != "simple" {
        out.push(format!(
            "its zone {} is of type {}, which carries the VNet off the node; a sandbox VNet belongs to a Simple zone (docs/sandbox-network.md)",
            view.zone, view.zone_type
        ));
    }
    for subnet in &view.subnets {
        if let Some(gateway) = &subnet.gateway {
            out.push(format!(
                "its subnet {} has gateway {gateway}: a sandbox subnet has none (remove it in Datacenter > SDN > VNets > {vnet} > Subnets)",
                subnet.cidr
            ));
        }
        if subnet.snat {
            out.push(format!(
                "its subnet {} has SNAT on, a way out of the sandbox: turn it off",
                subnet.cidr
            ));
        }
        if subnet.dhcp_range {
            out.push(format!(
                "its subnet {} has a DHCP range: PVE's DHCP would answer the restored guest; remove it",
                subnet.cidr
            ));
        }
    }
    for pending in &view.pending {
        out.push(format!(
            "{pending} is pending (an SDN apply would change it): apply or revert the SDN changes first"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn simple() -> SdnView {
        SdnView {
            zone: "csbox".into(),
            zone_type: "simple".into(),
            zone_nodes: None,
            subnets: vec![SubnetView {
                cidr: "10.99.0.0/24".into(),
                ..SubnetView::default()
            }],
            pending: Vec::new(),
        }
    }

    #[test]
    fn a_simple_zone_on_the_node_without_gateway_snat_or_dhcp_passes() {
        assert!(problems(&simple(), "csnet1", "pve1").is_empty());
        let on_pve1 = SdnView {
            zone_nodes: Some(vec!["pve1".into(), "pve2".into()]),
            ..simple()
        };
        assert!(problems(&on_pve1, "csnet1", "pve1").is_empty());
    }

    #[test]
    fn each_way_out_is_named() {
        let mut view = simple();
        view.zone_type = "vlan".into();
        view.zone_nodes = Some(vec!["pve2".into()]);
        view.subnets[0].gateway = Some("10.99.0.1".into());
        view.subnets[0].snat = true;
        view.subnets[0].dhcp_range = true;
        view.pending = vec!["subnet 10.99.0.0/24: gateway".into()];
        let found = problems(&view, "csnet1", "pve1");
        for part in [
            "of type vlan",
            "not on node pve1 (nodes pve2)",
            "has gateway 10.99.0.1",
            "has SNAT on",
            "has a DHCP range",
            "subnet 10.99.0.0/24: gateway is pending",
        ] {
            assert!(found.iter().any(|p| p.contains(part)), "{part}: {found:?}");
        }
        assert_eq!(found.len(), 6, "{found:?}");
    }
}
