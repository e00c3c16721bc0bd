//! What the node shows about a VNet and its own network, read without changing anything:
//! `ip -json` listings of links, addresses and routes, the forwarding sysctls, the NAT rules.

use super::Sandbox;
use super::Stage;
use super::nat::{LegacyNat, legacy_nat_rules, read_legacy_nat, read_ruleset};
use crate::executor::ExecError;
use crate::node::tool_error;
use crate::process::{self, ToolCall, ToolOutput};
use certistack_core::grant::Grant;
use certistack_core::net::IpNetwork;
use certistack_core::validate::VnetName;
use std::net::IpAddr;

/// What the node shows about a VNet, read without changing anything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observation {
    pub is_bridge: bool,
    pub ports: Vec<String>,
    /// `net.ipv4.conf.<vnet>.forwarding`, as read.
    pub forwarding: Option<String>,
    /// `net.ipv6.conf.<vnet>.forwarding`, when IPv6 is enabled on the node.
    pub forwarding_v6: Option<String>,
    /// Addresses with prefix length, e.g. `198.51.100.2/24`.
    pub addresses: Vec<String>,
    /// NAT rules that mention the VNet or its subnet.
    pub nat_rules: Vec<String>,
    /// Each NAT source read and what it gave (bytes read, not installed, no table).
    pub nat_sources: Vec<String>,
    /// Links stacked on the VNet or on one of its ports (VLAN, macvlan, macvtap, a veth
    /// peer): frames they take never reach the VNet's rules.
    pub upper_devices: Vec<String>,
    /// Every address of the node, on any device, with the device it is on.
    pub node_addresses: Vec<NodeAddress>,
    /// Every route of the node (all tables, both families) but default routes.
    pub node_routes: Vec<NodeRoute>,
}

/// One address the node carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAddress {
    pub device: String,
    pub address: IpAddr,
    pub prefix_len: u8,
}

/// One route the node has, with what `ip -j route` said about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRoute {
    pub destination: IpNetwork,
    pub device: String,
    pub table: String,
}

/// Links whose lower device (`link` in `ip -j -br link`) is the VNet or one of its ports. A
/// lower device in another namespace is printed as `link_index` instead and is not ours.
pub fn stacked_links(links: &serde_json::Value, vnet: &VnetName, ports: &[String]) -> Vec<String> {
    links
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|link| {
            let name = link.get("ifname")?.as_str()?;
            let lower = link.get("link")?.as_str()?;
            let stacked = lower == vnet.as_str() || ports.iter().any(|p| p == lower);
            (stacked && name != vnet.as_str()).then(|| format!("{name} (on {lower})"))
        })
        .collect()
}

/// The node's addresses as `ip -j address show` prints them.
fn parse_addresses(parsed: &serde_json::Value) -> Vec<NodeAddress> {
    let mut addresses = Vec::new();
    for link in parsed.as_array().into_iter().flatten() {
        let device = link
            .get("ifname")
            .and_then(|n| n.as_str())
            .unwrap_or_default();
        for info in link
            .get("addr_info")
            .and_then(|a| a.as_array())
            .into_iter()
            .flatten()
        {
            let address = info
                .get("local")
                .and_then(|l| l.as_str())
                .and_then(|l| l.parse::<IpAddr>().ok());
            let prefix_len = info
                .get("prefixlen")
                .and_then(|p| p.as_u64())
                .and_then(|p| u8::try_from(p).ok());
            if let (Some(address), Some(prefix_len)) = (address, prefix_len) {
                addresses.push(NodeAddress {
                    device: device.to_owned(),
                    address,
                    prefix_len,
                });
            }
        }
    }
    addresses
}

/// The node's routes as `ip -j route show table all` prints them; default routes are left out
/// (every network overlaps them, and a connected route is meant to beat them within itself).
pub(super) fn parse_routes(parsed: &serde_json::Value) -> Vec<NodeRoute> {
    parsed
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|route| {
            let destination = IpNetwork::parse(route.get("dst")?.as_str()?)?;
            if destination.prefix_len() == 0 {
                return None;
            }
            let text = |field: &str| {
                route
                    .get(field)
                    .and_then(|v| {
                        v.as_str()
                            .map(str::to_owned)
                            .or_else(|| Some(v.to_string()))
                    })
                    .unwrap_or_else(|| "main".into())
            };
            Some(NodeRoute {
                destination,
                device: route
                    .get("dev")
                    .and_then(|d| d.as_str())
                    .unwrap_or("-")
                    .to_owned(),
                table: text("table"),
            })
        })
        .collect()
}

impl Sandbox<'_> {
    pub(super) async fn tool(
        &self,
        program: &std::path::Path,
        args: &[&str],
    ) -> Result<ToolOutput, ExecError> {
        let mut call = ToolCall::new(program, self.ctx.tool_timeout());
        for arg in args {
            call = call.arg(*arg);
        }
        process::run(call).await.map_err(tool_error)
    }

    /// Runs `ip` for JSON; a failure or an answer cut at the output cap is an error, since a
    /// check that saw only part of the node must not pass.
    async fn ip_json(&self, args: &[&str]) -> Result<serde_json::Value, ExecError> {
        let out = self.tool(&self.ctx.config.tools.ip, args).await?;
        let command = format!("ip {}", args.join(" "));
        if !out.success() {
            return Err(ExecError::Failed(format!(
                "{command} failed: {}",
                out.stderr_excerpt()
            )));
        }
        if out.truncated {
            return Err(ExecError::FailedPrecondition(format!(
                "{command} printed more than the connector reads (64 KiB), so the isolation check cannot be completed"
            )));
        }
        serde_json::from_str(&out.stdout)
            .map_err(|e| ExecError::Failed(format!("{command} gave no JSON: {e}")))
    }

    /// Reads the VNet's isolation-relevant state (and, before the probe address is added, the
    /// node's addresses and routes). Links are read through netlink (`ip`), not sysfs: sysfs
    /// shows the namespace it was mounted in, netlink the caller's.
    pub(in crate::node) async fn observe(
        &self,
        grant: &Grant,
        vnet: &VnetName,
        stage: Stage,
    ) -> Result<Observation, ExecError> {
        let mut seen = Observation::default();
        let link = self
            .tool(
                &self.ctx.config.tools.ip,
                &["-j", "-d", "link", "show", "dev", vnet.as_str()],
            )
            .await?;
        if !link.success() {
            return Ok(seen);
        }
        let link: serde_json::Value = serde_json::from_str(&link.stdout).map_err(|e| {
            ExecError::Failed(format!("ip -j -d link show dev {vnet} gave no JSON: {e}"))
        })?;
        seen.is_bridge = link
            .as_array()
            .and_then(|links| links.first())
            .and_then(|l| l.get("linkinfo")?.get("info_kind")?.as_str())
            == Some("bridge");
        if !seen.is_bridge {
            return Ok(seen);
        }
        let ports = self
            .ip_json(&["-j", "link", "show", "master", vnet.as_str()])
            .await?;
        seen.ports = ports
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p.get("ifname")?.as_str().map(str::to_owned))
            .collect();
        seen.ports.sort();
        let links = self.ip_json(&["-j", "-br", "link", "show"]).await?;
        seen.upper_devices = stacked_links(&links, vnet, &seen.ports);
        seen.forwarding =
            std::fs::read_to_string(format!("/proc/sys/net/ipv4/conf/{vnet}/forwarding"))
                .ok()
                .map(|v| v.trim().to_owned());
        seen.forwarding_v6 =
            std::fs::read_to_string(format!("/proc/sys/net/ipv6/conf/{vnet}/forwarding"))
                .ok()
                .map(|v| v.trim().to_owned());
        let parsed = self
            .ip_json(&["-j", "address", "show", "dev", vnet.as_str()])
            .await?;
        seen.addresses = parse_addresses(&parsed)
            .into_iter()
            .map(|a| format!("{}/{}", a.address, a.prefix_len))
            .collect();
        if stage == Stage::Prepare {
            seen.node_addresses = parse_addresses(&self.ip_json(&["-j", "address", "show"]).await?);
            for family in ["-4", "-6"] {
                let routes = self
                    .ip_json(&["-j", family, "route", "show", "table", "all"])
                    .await?;
                seen.node_routes.extend(parse_routes(&routes));
            }
        }
        let out = self
            .read_ruleset(
                &self.ctx.config.tools.nft,
                &["list", "ruleset"],
                "nftables ruleset",
            )
            .await?;
        seen.nat_sources
            .push(format!("nft list ruleset: {} bytes read", out.len()));
        let subnet = IpNetwork::of(&grant.probe_source).to_string();
        let quoted = format!("\"{vnet}\"");
        let mut in_nat_chain = false;
        for line in out.lines() {
            let line = line.trim();
            if line.starts_with("chain ") {
                in_nat_chain = false;
            }
            if line.starts_with("type nat ") {
                in_nat_chain = true;
            }
            if in_nat_chain && (line.contains(&quoted) || line.contains(&subnet)) {
                seen.nat_rules.push(line.to_owned());
            }
        }
        for (tool, tables) in [
            (
                &self.ctx.config.tools.iptables_legacy_save,
                "ip_tables_names",
            ),
            (
                &self.ctx.config.tools.ip6tables_legacy_save,
                "ip6_tables_names",
            ),
        ] {
            self.read_legacy_nat(tool, tables, vnet, &subnet, &mut seen)
                .await?;
        }
        Ok(seen)
    }

    /// Runs a tool that lists firewall rules, keeping up to `limits.max_ruleset_bytes`.
    async fn read_ruleset(
        &self,
        program: &std::path::Path,
        args: &[&str],
        what: &str,
    ) -> Result<String, ExecError> {
        read_ruleset(
            program,
            args,
            what,
            self.ctx.config.limits.max_ruleset_bytes,
            self.ctx.tool_timeout(),
        )
        .await
    }

    /// Reads the legacy NAT table of one family into the observation.
    async fn read_legacy_nat(
        &self,
        tool: &std::path::Path,
        tables_file: &str,
        vnet: &VnetName,
        subnet: &str,
        seen: &mut Observation,
    ) -> Result<(), ExecError> {
        let name = tool.display();
        let listing = read_legacy_nat(
            tool,
            tables_file,
            self.ctx.config.limits.max_ruleset_bytes,
            self.ctx.tool_timeout(),
        )
        .await?;
        seen.nat_sources.push(listing.source(tool, tables_file));
        if let LegacyNat::Read(listing) = listing {
            seen.nat_rules.extend(
                legacy_nat_rules(&listing, vnet, Some(subnet))
                    .into_iter()
                    .map(|rule| format!("{rule} ({name} -t nat)")),
            );
        }
        Ok(())
    }
}
