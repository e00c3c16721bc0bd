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

use super::resources::{EndState, Resource};
use super::{NodeExecutor, resources, tool_error};
use crate::config::ForwardingPolicy;
use crate::executor::{ExecError, Outcome};
use crate::process::{self, SecretInput, SecretKind, ToolCall, ToolOutput};
use crate::runs::{RunGuard, RunHandle};
use certistack_core::grant::{Grant, ProbeKind};
use certistack_core::journal::Phase;
use certistack_core::net::IpNetwork;
use certistack_core::validate::{IpInterface, VnetName};
use certistack_proto::v1 as pb;
use serde_json::json;
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv6Addr};

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

/// When the VNet is checked: before the probe address exists, or before a guest boots (when it
/// must be there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Prepare,
    Boot,
}

/// The table name of a run: `certistack_` and the run id's 32 hex digits, so no two runs can
/// ever share (and merge into, or delete) one table.
pub fn table_name(grant: &Grant) -> String {
    let id: String = grant
        .run_id
        .as_str()
        .chars()
        .filter(char::is_ascii_hexdigit)
        .collect();
    format!("certistack_{id}")
}

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

/// Conflicts (and NAT rules) at most listed in one refusal; the rest are counted.
const MAX_LISTED_CONFLICTS: usize = 8;

/// Characters of one legacy NAT rule kept in a refusal.
const MAX_RULE_CHARS: usize = 512;

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
fn parse_routes(parsed: &serde_json::Value) -> Vec<NodeRoute> {
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

/// The containment table for a run, in `nft -f` syntax.
pub fn ruleset(grant: &Grant, vnet: &VnetName) -> String {
    let table = table_name(grant);
    let probe = grant.probe_source.address;
    let family = if probe.0.is_ipv4() { "ip" } else { "ip6" };
    let mut allow = String::new();
    for target in &grant.probe_targets {
        let protocols: &[&str] = match target.kind {
            ProbeKind::Dns => &["udp", "tcp"],
            _ => &["tcp"],
        };
        for protocol in protocols {
            allow.push_str(&format!(
                "    oifname \"{vnet}\" {family} saddr {probe} {family} daddr {} {protocol} dport {} accept\n",
                target.address, target.port
            ));
        }
    }
    let (ndp_in, ndp_out) = match probe.0 {
        IpAddr::V6(source) => neighbour_discovery(grant, vnet, source),
        IpAddr::V4(_) => (String::new(), String::new()),
    };
    allow.push_str(&ndp_out);
    format!(
        "table inet {table} {{\n\
         \x20 chain input {{\n\
         \x20   type filter hook input priority filter - 10; policy accept;\n\
         \x20   iifname \"{vnet}\" {family} daddr {probe} ct state established,related accept\n\
         {ndp_in}\
         \x20   iifname \"{vnet}\" counter drop\n\
         \x20 }}\n\
         \x20 chain forward {{\n\
         \x20   type filter hook forward priority filter - 10; policy accept;\n\
         \x20   iifname \"{vnet}\" counter drop\n\
         \x20   oifname \"{vnet}\" counter drop\n\
         \x20 }}\n\
         \x20 chain output {{\n\
         \x20   type filter hook output priority filter - 10; policy accept;\n\
         {allow}\
         \x20   oifname \"{vnet}\" counter drop\n\
         \x20 }}\n\
         }}\n"
    )
}

/// The solicited-node multicast address of `address` (RFC 4291 2.7.1): where a neighbour
/// solicitation for it is sent.
fn solicited_node(address: Ipv6Addr) -> Ipv6Addr {
    let [.., a, b, c] = address.octets();
    Ipv6Addr::new(
        0xff02,
        0,
        0,
        0,
        0,
        1,
        0xff00 | u16::from(a),
        u16::from(b) << 8 | u16::from(c),
    )
}

/// The IPv6 rules that let the probe address and the granted targets resolve each other and
/// nothing else: neighbour solicitations (to the unicast or solicited-node address) and
/// advertisements (to the unicast address), ICMPv6 types 135 and 136, with the hop limit 255
/// every valid NDP message has (RFC 4861 7.1). Without them the output chain drops the
/// solicitation and the input chain the advertisement (neither is `established`), and an IPv6
/// probe never reaches its target. Returns the input and the output rules.
fn neighbour_discovery(grant: &Grant, vnet: &VnetName, probe: Ipv6Addr) -> (String, String) {
    let targets: BTreeSet<Ipv6Addr> = grant
        .probe_targets
        .iter()
        .filter_map(|t| match t.address.0 {
            IpAddr::V6(address) => Some(address),
            IpAddr::V4(_) => None,
        })
        .collect();
    if targets.is_empty() {
        return (String::new(), String::new());
    }
    let set = |addresses: &mut dyn Iterator<Item = Ipv6Addr>| {
        let listed: BTreeSet<String> = addresses.map(|a| a.to_string()).collect();
        format!(
            "{{ {} }}",
            listed.into_iter().collect::<Vec<_>>().join(", ")
        )
    };
    let unicast = set(&mut targets.iter().copied());
    let solicited = set(&mut targets.iter().flat_map(|t| [*t, solicited_node(*t)]));
    let probe_solicited = solicited_node(probe);
    let input = format!(
        "    iifname \"{vnet}\" ip6 saddr {unicast} ip6 daddr {{ {probe}, {probe_solicited} }} icmpv6 type nd-neighbor-solicit ip6 hoplimit 255 accept\n\
         \x20   iifname \"{vnet}\" ip6 saddr {unicast} ip6 daddr {probe} icmpv6 type nd-neighbor-advert ip6 hoplimit 255 accept\n"
    );
    let output = format!(
        "    oifname \"{vnet}\" ip6 saddr {probe} ip6 daddr {solicited} icmpv6 type nd-neighbor-solicit ip6 hoplimit 255 accept\n\
         \x20   oifname \"{vnet}\" ip6 saddr {probe} ip6 daddr {unicast} icmpv6 type nd-neighbor-advert ip6 hoplimit 255 accept\n"
    );
    (input, output)
}

/// Runs a tool that lists firewall rules, keeping up to `cap` bytes. A failed or cut listing is
/// an error: a NAT rule past the cut could go unseen, so the VNet is never called isolated on
/// a partial reading.
pub(crate) async fn read_ruleset(
    program: &std::path::Path,
    args: &[&str],
    what: &str,
    cap: usize,
    timeout: std::time::Duration,
) -> Result<String, ExecError> {
    let mut call = ToolCall::new(program, timeout).output_cap(cap);
    for arg in args {
        call = call.arg(*arg);
    }
    let out = process::run(call).await.map_err(tool_error)?;
    let command = format!("{} {}", program.display(), args.join(" "));
    if !out.success() {
        return Err(ExecError::Failed(format!(
            "{command} failed: {}",
            out.stderr_excerpt()
        )));
    }
    if out.truncated {
        return Err(ExecError::FailedPrecondition(format!(
            "the node's {what} is larger than the connector reads ({cap} bytes, limits.max_ruleset_bytes), so the NAT check cannot be completed; raise limits.max_ruleset_bytes"
        )));
    }
    Ok(out.stdout)
}

/// What one family's legacy NAT table held.
pub(crate) enum LegacyNat {
    /// The `*-legacy-save` tool is not installed.
    NotInstalled,
    /// This namespace has no legacy nat table (its module may not even be loaded).
    NoTable,
    /// `-t nat` as listed.
    Read(String),
}

impl LegacyNat {
    /// The line the evidence (and NodeChecks) keeps about this reading.
    pub(crate) fn source(&self, tool: &std::path::Path, tables_file: &str) -> String {
        let name = tool.display();
        match self {
            LegacyNat::NotInstalled => format!("{name}: not installed"),
            LegacyNat::NoTable => {
                format!("{name} -t nat: no legacy nat table on this node (/proc/net/{tables_file})")
            }
            LegacyNat::Read(listing) => format!("{name} -t nat: {} bytes read", listing.len()),
        }
    }
}

/// Reads the legacy NAT table of one family: pve-firewall switches `iptables` to
/// iptables-legacy and SDN's SNAT rules land there, where `nft list ruleset` never shows
/// them. The table is read only when this namespace has one (`/proc/thread-self/net/
/// ip_tables_names`, `ip6_tables_names`): listing it through the tool would otherwise load
/// its module and create an empty NAT table on the node.
pub(crate) async fn read_legacy_nat(
    tool: &std::path::Path,
    tables_file: &str,
    cap: usize,
    timeout: std::time::Duration,
) -> Result<LegacyNat, ExecError> {
    if !tool.exists() {
        return Ok(LegacyNat::NotInstalled);
    }
    let names_path = format!("/proc/thread-self/net/{tables_file}");
    let tables = match std::fs::read_to_string(&names_path) {
        Ok(tables) => tables,
        // No legacy table module loaded at all.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(error) => {
            return Err(ExecError::Failed(format!(
                "cannot read {names_path} to find the legacy NAT table: {error}"
            )));
        }
    };
    if !tables.lines().any(|table| table.trim() == "nat") {
        return Ok(LegacyNat::NoTable);
    }
    read_ruleset(tool, &["-t", "nat"], "legacy NAT table", cap, timeout)
        .await
        .map(LegacyNat::Read)
}

/// NAT rules of an `iptables-save -t nat` listing that involve the VNet (as an interface, an
/// `iface+` wildcard matching it included) or, when given, the probe network (textually, like
/// the nftables check).
pub fn legacy_nat_rules(listing: &str, vnet: &VnetName, subnet: Option<&str>) -> Vec<String> {
    listing
        .lines()
        .map(str::trim)
        .filter(|line| line.starts_with("-A "))
        .filter(|line| {
            subnet.is_some_and(|subnet| line.contains(subnet))
                || line
                    .split_whitespace()
                    .map(|token| token.trim_matches(|c| c == '"' || c == '\''))
                    .any(|token| {
                        token == vnet.as_str()
                            || token
                                .strip_suffix('+')
                                .is_some_and(|prefix| vnet.as_str().starts_with(prefix))
                    })
        })
        // A rule's comment is free text: escaped and cut like any text the node repeats.
        .map(|line| certistack_core::untrusted::printable(line.as_bytes(), MAX_RULE_CHARS))
        .collect()
}

/// The forwarding sysctl of one family (`ipv4`, `ipv6`) on the VNet.
fn forwarding_path(family: &str, vnet: &VnetName) -> String {
    format!("/proc/sys/net/{family}/conf/{vnet}/forwarding")
}

fn read_sysctl(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|v| v.trim().to_owned())
}

/// The sysctls' values before the run, as the `sandbox.forwarding` intent journaled them.
fn journaled_previous(state: &resources::ResourceState) -> Vec<(String, String)> {
    state
        .history
        .iter()
        .find_map(|r| r.entry.detail.get("previous")?.as_object().cloned())
        .into_iter()
        .flatten()
        .filter_map(|(family, value)| Some((family, value.as_str()?.to_owned())))
        .filter(|(family, _)| family == "ipv4" || family == "ipv6")
        .collect()
}

/// What the sandbox adds to the node's network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NetworkObject {
    Table,
    Address,
}

impl NodeExecutor {
    async fn tool(
        &self,
        program: &std::path::Path,
        args: &[&str],
    ) -> Result<ToolOutput, ExecError> {
        let mut call = ToolCall::new(program, self.tool_timeout());
        for arg in args {
            call = call.arg(*arg);
        }
        process::run(call).await.map_err(tool_error)
    }

    /// Runs `ip` for JSON; a failure or an answer cut at the output cap is an error, since a
    /// check that saw only part of the node must not pass.
    async fn ip_json(&self, args: &[&str]) -> Result<serde_json::Value, ExecError> {
        let out = self.tool(&self.config.tools.ip, args).await?;
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
    pub(super) async fn observe(
        &self,
        grant: &Grant,
        vnet: &VnetName,
        stage: Stage,
    ) -> Result<Observation, ExecError> {
        let mut seen = Observation::default();
        let link = self
            .tool(
                &self.config.tools.ip,
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
                &self.config.tools.nft,
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
            (&self.config.tools.iptables_legacy_save, "ip_tables_names"),
            (&self.config.tools.ip6tables_legacy_save, "ip6_tables_names"),
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
            self.config.limits.max_ruleset_bytes,
            self.tool_timeout(),
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
            self.config.limits.max_ruleset_bytes,
            self.tool_timeout(),
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

    /// The re-check before a guest boots: the VNet must still be what PrepareSandbox found,
    /// with the probe address and the run's table on it, and nothing stacked on it since.
    pub(super) async fn recheck_sandbox(&self, grant: &Grant) -> Result<(), ExecError> {
        let seen = self.observe(grant, &grant.vnet, Stage::Boot).await?;
        let violations = violations(
            grant,
            &grant.vnet,
            &seen,
            Stage::Boot,
            self.config.sandbox.forwarding,
        );
        if !violations.is_empty() {
            return Err(ExecError::FailedPrecondition(format!(
                "VNet {} is no longer isolated, so no guest may boot on it: {}",
                grant.vnet,
                violations.join("; ")
            )));
        }
        Ok(())
    }

    pub(super) async fn prepare_sandbox(
        &self,
        run: &RunHandle,
        vnet: VnetName,
        probe_source: IpInterface,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.lock_open(run).await?;
        let states = resources::states(&guard.records());
        let table = table_name(grant);
        if states
            .get(&format!("nft:{table}"))
            .is_some_and(|s| s.is_open())
        {
            return Err(ExecError::AlreadyExists(format!(
                "the sandbox on {vnet} is already prepared for this run"
            )));
        }
        let seen = self.observe(grant, &vnet, Stage::Prepare).await?;
        let violations = violations(
            grant,
            &vnet,
            &seen,
            Stage::Prepare,
            self.config.sandbox.forwarding,
        );
        if !violations.is_empty() {
            return Err(ExecError::FailedPrecondition(format!(
                "VNet {vnet} is not isolated, so no guest may boot on it: {}",
                violations.join("; ")
            )));
        }
        let conflicts = probe_network_conflicts(grant, self.config.limits.min_probe_prefix, &seen);
        if !conflicts.is_empty() {
            return Err(ExecError::FailedPrecondition(format!(
                "the probe network {} cannot be added to this node: {}",
                grant.probe_source,
                conflicts.join("; ")
            )));
        }
        if self.table_present(grant).await? {
            return Err(ExecError::FailedPrecondition(format!(
                "a table inet {table} already exists on this node but this run did not install it; inspect it before preparing"
            )));
        }

        // The table first: the probe address never exists on the VNet without the rules that
        // keep the guest from using it.
        let rules = ruleset(grant, &vnet);
        let nft_key = format!("nft:{table}");
        guard
            .append(
                self.now_ms(),
                "sandbox.nft",
                &nft_key,
                Phase::Intent,
                json!({ "table": table, "ruleset": rules }),
            )
            .await?;
        // One `nft -f` transaction: the whole table or nothing. The ruleset travels on a pipe.
        let call = ToolCall::new(&self.config.tools.nft, self.tool_timeout())
            .arg("-f")
            .arg("/dev/fd/3")
            .secret(SecretInput {
                child_fd: 3,
                bytes: zeroize::Zeroizing::new(rules.clone().into_bytes()),
                kind: SecretKind::Pipe,
            });
        let out = self
            .run_step(&mut guard, "sandbox.nft", &nft_key, call)
            .await?;
        if !out.success() {
            self.journal_tool_failed(&mut guard, "sandbox.nft", &nft_key, &out, &[])
                .await?;
            return Err(ExecError::FailedPrecondition(format!(
                "nft -f refused the containment table: {}",
                out.stderr_excerpt()
            )));
        }
        let listed = self
            .tool(&self.config.tools.nft, &["list", "table", "inet", &table])
            .await?;
        if !listed.success() || listed.truncated {
            // The table is installed but its evidence cannot be produced: no run proceeds
            // without the evidence. Record it as installed so Cleanup removes it, and try now.
            guard
                .append(
                    self.now_ms(),
                    "sandbox.nft",
                    &nft_key,
                    Phase::Done,
                    json!({ "table": table, "ruleset_sha256": null, "evidence": "unavailable" }),
                )
                .await?;
            let reason = if listed.truncated {
                "the listing is larger than the connector reads (64 KiB)".to_owned()
            } else {
                listed.stderr_excerpt()
            };
            let removal = match self.remove_table(&mut guard, grant).await {
                Ok(end_state) => format!("the table was removed ({end_state})"),
                Err(error) => format!("the table is still installed ({error}); call Cleanup"),
            };
            return Err(ExecError::Failed(format!(
                "nft list table inet {table} failed, so the containment evidence cannot be produced: {reason}; {removal}"
            )));
        }
        let sha256 = hex::encode(Sha256::digest(listed.stdout.as_bytes()));
        guard
            .append(
                self.now_ms(),
                "sandbox.nft",
                &nft_key,
                Phase::Done,
                json!({ "table": table, "ruleset_sha256": sha256 }),
            )
            .await?;

        let address = probe_source.to_string();
        let addr_key = format!("addr:{vnet}");
        guard
            .append(
                self.now_ms(),
                "sandbox.address",
                &addr_key,
                Phase::Intent,
                json!({ "address": address }),
            )
            .await?;
        let mut call = ToolCall::new(&self.config.tools.ip, self.tool_timeout())
            .arg("address")
            .arg("add")
            .arg(&address)
            .arg("dev")
            .arg(vnet.as_str());
        if probe_source.address.0.is_ipv6() {
            // Without it the address stays tentative for a second of duplicate address
            // detection, whose solicitations the table drops anyway, and a probe cannot bind it.
            // The VNet carries only this run's guests and the address was checked unused.
            call = call.arg("nodad");
        }
        let out = self
            .run_step(&mut guard, "sandbox.address", &addr_key, call)
            .await?;
        if !out.success() {
            self.journal_tool_failed(&mut guard, "sandbox.address", &addr_key, &out, &[])
                .await?;
            let removal = match self.remove_table(&mut guard, grant).await {
                Ok(end_state) => format!("the containment table was removed ({end_state})"),
                Err(error) => {
                    format!("the containment table is still installed ({error}); call Cleanup")
                }
            };
            return Err(ExecError::FailedPrecondition(format!(
                "ip address add {address} dev {vnet} failed: {}; {removal}",
                out.stderr_excerpt()
            )));
        }
        guard
            .append(
                self.now_ms(),
                "sandbox.address",
                &addr_key,
                Phase::Done,
                json!({ "address": address }),
            )
            .await?;
        let disabled = if self.config.sandbox.forwarding == ForwardingPolicy::DisableForRun {
            match self.disable_forwarding(&mut guard, &vnet, &seen).await {
                Ok(disabled) => disabled,
                Err(error) => {
                    let undo = self.undo_sandbox(&mut guard, grant).await;
                    return Err(ExecError::Failed(format!("{error}; {undo}")));
                }
            }
        } else {
            Vec::new()
        };
        let mut forwarding_sysctl = Vec::new();
        for (family, value) in [("ipv4", &seen.forwarding), ("ipv6", &seen.forwarding_v6)] {
            let Some(value) = value else { continue };
            forwarding_sysctl.push(if disabled.contains(&family) {
                format!(
                    "net.{family}.conf.{vnet}.forwarding = 0 (was {value}; set to 0 for this run by sandbox.forwarding = \"disable-for-run\", restored when the sandbox is released)"
                )
            } else {
                format!("net.{family}.conf.{vnet}.forwarding = {value}")
            });
        }
        let bridge_port_owners = seen.ports.iter().map(|name| bridge_port(name)).collect();
        Ok(Outcome::PrepareSandbox(pb::PrepareSandboxReply {
            bridge_port_owners,
            bridge_ports: seen.ports,
            bridge_addresses: seen
                .addresses
                .into_iter()
                .chain(std::iter::once(address))
                .collect(),
            forwarding_sysctl: forwarding_sysctl.join("\n"),
            ruleset_text: listed.stdout,
            ruleset_sha256: sha256,
            journal_head: guard.head_hex(),
            nat_sources: seen.nat_sources,
        }))
    }

    /// Removes what a failed `PrepareSandbox` installed, newest first, and says how it went.
    async fn undo_sandbox(&self, guard: &mut RunGuard<'_>, grant: &Grant) -> String {
        let mut said = Vec::new();
        let mut left = false;
        match self.restore_forwarding(guard, grant).await {
            Ok(Some(end)) => said.push(format!("forwarding {}", end.wire())),
            Ok(None) => {}
            Err(error) => {
                left = true;
                said.push(format!("forwarding is still 0 ({error})"));
            }
        }
        match self.remove_address(guard, grant).await {
            Ok(end) => {
                said.push(format!("the probe address was removed ({end})"));
                match self.remove_table(guard, grant).await {
                    Ok(end) => said.push(format!("the containment table was removed ({end})")),
                    Err(error) => {
                        left = true;
                        said.push(format!(
                            "the containment table is still installed ({error})"
                        ));
                    }
                }
            }
            // The table stays while the address does: the address never exists without it.
            Err(error) => {
                left = true;
                said.push(format!(
                    "the probe address and the containment table are still installed ({error})"
                ));
            }
        }
        if left {
            format!("{}; call Cleanup", said.join(", "))
        } else {
            said.join(", ")
        }
    }

    /// Turns forwarding off on the VNet for the run, for each family where it is on: journals
    /// the previous values (`sandbox.forwarding` intent on `fwd:<vnet>`), writes 0, re-reads.
    /// Returns the families it turned off.
    async fn disable_forwarding(
        &self,
        guard: &mut RunGuard<'_>,
        vnet: &VnetName,
        seen: &Observation,
    ) -> Result<Vec<&'static str>, ExecError> {
        let on: Vec<(&'static str, &String)> =
            [("ipv4", &seen.forwarding), ("ipv6", &seen.forwarding_v6)]
                .into_iter()
                .filter_map(|(family, value)| Some((family, value.as_ref()?)))
                .filter(|(_, value)| value.as_str() != "0")
                .collect();
        if on.is_empty() {
            return Ok(Vec::new());
        }
        let key = Resource::Forwarding(vnet.clone()).key();
        let previous: serde_json::Map<String, serde_json::Value> = on
            .iter()
            .map(|(family, value)| ((*family).to_owned(), json!(value)))
            .collect();
        guard
            .append(
                self.now_ms(),
                "sandbox.forwarding",
                &key,
                Phase::Intent,
                json!({ "previous": previous, "set": "0" }),
            )
            .await?;
        let mut failures = Vec::new();
        for (family, _) in &on {
            let path = forwarding_path(family, vnet);
            if let Err(error) = std::fs::write(&path, "0\n") {
                failures.push(format!("writing 0 to {path} failed: {error}"));
            } else if let Some(value) = read_sysctl(&path).filter(|v| v != "0") {
                failures.push(format!("{path} reads {value} after 0 was written"));
            }
        }
        if !failures.is_empty() {
            let error = format!(
                "cannot turn forwarding off on {vnet} for the run: {}",
                failures.join("; ")
            );
            guard
                .append(
                    self.now_ms(),
                    "sandbox.forwarding",
                    &key,
                    Phase::Failed,
                    json!({ "previous": previous, "error": error }),
                )
                .await?;
            return Err(ExecError::Failed(error));
        }
        guard
            .append(
                self.now_ms(),
                "sandbox.forwarding",
                &key,
                Phase::Done,
                json!({ "previous": previous, "set": "0" }),
            )
            .await?;
        Ok(on.into_iter().map(|(family, _)| family).collect())
    }

    /// Puts back the forwarding values the run changed, when the run's `fwd:<vnet>` resource is
    /// open. A value is written back only while it is still the 0 this run set: a VNet gone, or
    /// a value already back, is `already gone`; a value someone else changed since is left as
    /// it is (`not this run's`). `None` when the run changed nothing.
    pub(super) async fn restore_forwarding(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
    ) -> Result<Option<EndState>, ExecError> {
        let resource = Resource::Forwarding(grant.vnet.clone());
        let Some(state) = resources::state_of(&guard.records(), &resource).filter(|s| s.is_open())
        else {
            return Ok(None);
        };
        let key = resource.key();
        let previous = journaled_previous(&state);
        guard
            .append(
                self.now_ms(),
                "sandbox.forwarding.restore",
                &key,
                Phase::Intent,
                json!({ "previous": previous
                    .iter()
                    .map(|(family, value)| (family.clone(), json!(value)))
                    .collect::<serde_json::Map<_, _>>() }),
            )
            .await?;
        let mut outcomes = serde_json::Map::new();
        let mut ends = Vec::new();
        let mut failures = Vec::new();
        for (family, value) in &previous {
            let path = forwarding_path(family, &grant.vnet);
            let (end, said) = match read_sysctl(&path) {
                None => (
                    EndState::AlreadyGone,
                    "the VNet no longer exists".to_owned(),
                ),
                Some(now) if now == "0" && value != "0" => {
                    match std::fs::write(&path, format!("{value}\n")) {
                        Ok(()) if read_sysctl(&path).as_deref() == Some(value.as_str()) => {
                            (EndState::Restored, format!("0 -> {value}"))
                        }
                        Ok(()) => {
                            failures
                                .push(format!("{path} does not read {value} after it was written"));
                            continue;
                        }
                        Err(error) => {
                            failures.push(format!("writing {value} to {path} failed: {error}"));
                            continue;
                        }
                    }
                }
                Some(now) if &now == value => (EndState::AlreadyGone, format!("already {value}")),
                Some(now) => (
                    EndState::NotOurs,
                    format!("{now}, changed by someone else since the run set 0: left as it is"),
                ),
            };
            outcomes.insert(family.clone(), json!(said));
            ends.push(end);
        }
        if !failures.is_empty() {
            let error = format!(
                "cannot restore forwarding on {}: {}",
                grant.vnet,
                failures.join("; ")
            );
            guard
                .append(
                    self.now_ms(),
                    "sandbox.forwarding.restore",
                    &key,
                    Phase::Failed,
                    json!({ "error": error, "values": outcomes }),
                )
                .await?;
            return Err(ExecError::Failed(error));
        }
        let end = if ends.contains(&EndState::Restored) {
            EndState::Restored
        } else if ends.contains(&EndState::NotOurs) {
            EndState::NotOurs
        } else {
            EndState::AlreadyGone
        };
        guard
            .append(
                self.now_ms(),
                "sandbox.forwarding.restore",
                &key,
                Phase::Undone,
                json!({ "end_state": end.wire(), "values": outcomes }),
            )
            .await?;
        Ok(Some(end))
    }

    pub(super) async fn release_sandbox(
        &self,
        run: &RunHandle,
        vnet: VnetName,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.lock_open(run).await?;
        let states = resources::states(&guard.records());
        let nft_key = format!("nft:{}", table_name(grant));
        let addr_key = format!("addr:{vnet}");
        let fwd_key = Resource::Forwarding(vnet.clone()).key();
        if ![&nft_key, &addr_key, &fwd_key]
            .iter()
            .any(|key| states.get(*key).is_some_and(|s| s.is_open()))
        {
            return Err(ExecError::NotFound(format!(
                "this run has no sandbox on {vnet}"
            )));
        }
        if let Some(vm) = states
            .values()
            .find(|s| s.is_open() && s.key.starts_with("vm:"))
        {
            return Err(ExecError::FailedPrecondition(format!(
                "{} still exists on the sandbox; destroy it before releasing {vnet}",
                vm.key
            )));
        }
        // The reverse of PrepareSandbox: forwarding back, then the address (it never stays on
        // the VNet without the table), then the table.
        self.restore_forwarding(&mut guard, grant).await?;
        self.remove_address(&mut guard, grant).await?;
        self.remove_table(&mut guard, grant).await?;
        Ok(Outcome::ReleaseSandbox(pb::ReleaseSandboxReply {
            journal_head: guard.head_hex(),
        }))
    }

    /// Deletes the run's table if it exists, and checks that it is gone.
    pub(super) async fn remove_table(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
    ) -> Result<&'static str, ExecError> {
        self.remove_network_object(guard, grant, NetworkObject::Table)
            .await
    }

    /// Removes the probe address from the VNet if it is there, and checks that it is gone.
    pub(super) async fn remove_address(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
    ) -> Result<&'static str, ExecError> {
        self.remove_network_object(guard, grant, NetworkObject::Address)
            .await
    }

    async fn present(&self, grant: &Grant, object: NetworkObject) -> Result<bool, ExecError> {
        match object {
            NetworkObject::Table => self.table_present(grant).await,
            NetworkObject::Address => self.address_present(grant).await,
        }
    }

    /// Journaled removal: `undone` ("already gone") when absent; otherwise `intent`, the tool,
    /// a re-read, then `undone` ("deleted") or `failed`.
    async fn remove_network_object(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
        object: NetworkObject,
    ) -> Result<&'static str, ExecError> {
        let table = table_name(grant);
        let address = grant.probe_source.to_string();
        let (op, key, program, args): (&str, String, &std::path::Path, Vec<&str>) = match object {
            NetworkObject::Table => (
                "sandbox.nft.delete",
                format!("nft:{table}"),
                &self.config.tools.nft,
                vec!["delete", "table", "inet", &table],
            ),
            NetworkObject::Address => (
                "sandbox.address.delete",
                format!("addr:{}", grant.vnet),
                &self.config.tools.ip,
                vec!["address", "del", &address, "dev", grant.vnet.as_str()],
            ),
        };
        if !self.present(grant, object).await? {
            self.journal_end_state(guard, op, &key, &EndState::AlreadyGone)
                .await?;
            return Ok("already gone");
        }
        guard
            .append(
                self.now_ms(),
                op,
                &key,
                Phase::Intent,
                json!({ "argv": args }),
            )
            .await?;
        let out = self.tool(program, &args).await?;
        if !out.success() || self.present(grant, object).await? {
            self.journal_tool_failed(guard, op, &key, &out, &[]).await?;
            return Err(ExecError::Failed(format!(
                "{} {} failed: {}",
                program.display(),
                args.join(" "),
                out.stderr_excerpt()
            )));
        }
        self.journal_end_state(guard, op, &key, &EndState::Deleted)
            .await?;
        Ok("deleted")
    }

    pub(super) async fn address_present(&self, grant: &Grant) -> Result<bool, ExecError> {
        let seen = self
            .tool(
                &self.config.tools.ip,
                &["-j", "address", "show", "dev", grant.vnet.as_str()],
            )
            .await?;
        if !seen.success() {
            if seen.stderr.contains("does not exist") {
                // No such VNet: nothing can carry the address.
                return Ok(false);
            }
            return Err(ExecError::Failed(format!(
                "ip address show dev {} failed: {}",
                grant.vnet,
                seen.stderr_excerpt()
            )));
        }
        let probe = grant.probe_source.address.to_string();
        Ok(seen.stdout.contains(&format!("\"local\":\"{probe}\"")))
    }

    pub(super) async fn table_present(&self, grant: &Grant) -> Result<bool, ExecError> {
        let table = table_name(grant);
        let out = self
            .tool(&self.config.tools.nft, &["list", "table", "inet", &table])
            .await?;
        if out.success() {
            return Ok(true);
        }
        if out.stderr.contains("No such file or directory") {
            return Ok(false);
        }
        // Neither present nor absent: a failure must never be read as "already gone".
        Err(ExecError::Failed(format!(
            "nft list table inet {table} failed: {}",
            out.stderr_excerpt()
        )))
    }
}

/// A port on the VNet's bridge, with the VM and NIC PVE's name gives a tap.
fn bridge_port(name: &str) -> pb::BridgePort {
    let (vmid, nic) = certistack_core::net::pve_tap(name).unwrap_or((0, 0));
    pb::BridgePort {
        name: name.to_owned(),
        vmid,
        nic,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use certistack_core::fixtures::{full_wire_grant, sign};
    use certistack_core::validate::{UnicastIp, Validated};
    use ed25519_dalek::SigningKey;

    fn grant() -> Grant {
        let key = SigningKey::from_bytes(&[1; 32]);
        certistack_core::grant::verify(&sign(&key, &full_wire_grant()), &key.verifying_key())
            .unwrap()
    }

    fn isolated() -> Observation {
        Observation {
            is_bridge: true,
            ports: vec!["tap9100i0".into(), "tap9100i1".into()],
            forwarding: Some("0".into()),
            forwarding_v6: Some("0".into()),
            addresses: vec!["fe80::1/64".into()],
            ..Observation::default()
        }
    }

    #[test]
    fn an_isolated_vnet_passes() {
        let vnet = VnetName::validate("csbox1").unwrap();
        assert!(
            violations(
                &grant(),
                &vnet,
                &isolated(),
                Stage::Prepare,
                ForwardingPolicy::Refuse
            )
            .is_empty()
        );
        let mut with_probe = isolated();
        with_probe.addresses.push("198.51.100.2/24".into());
        assert!(
            violations(
                &grant(),
                &vnet,
                &with_probe,
                Stage::Prepare,
                ForwardingPolicy::Refuse
            )[0]
            .contains("already carries the probe address")
        );
        let mut v6 = isolated();
        v6.forwarding_v6 = Some("1".into());
        assert!(
            violations(
                &grant(),
                &vnet,
                &v6,
                Stage::Prepare,
                ForwardingPolicy::Refuse
            )[0]
            .contains("IPv6 forwarding is on")
        );
    }

    #[test]
    fn each_violation_is_named() {
        let vnet = VnetName::validate("csbox1").unwrap();
        let grant = grant();
        let check = |edit: &dyn Fn(&mut Observation), needle: &str| {
            let mut seen = isolated();
            edit(&mut seen);
            let found = violations(
                &grant,
                &vnet,
                &seen,
                Stage::Prepare,
                ForwardingPolicy::Refuse,
            );
            assert!(
                found.len() == 1 && found[0].contains(needle),
                "{found:?} lacks {needle:?}"
            );
        };
        check(&|s| s.is_bridge = false, "bridge csbox1 does not exist");
        check(&|s| s.ports.push("eno1".into()), "port eno1 is not a tap");
        check(&|s| s.ports.push("bond0.100".into()), "port bond0.100");
        check(&|s| s.ports.push("tap9200i0".into()), "port tap9200i0");
        check(&|s| s.ports.push("tap9100ix".into()), "port tap9100ix");
        check(
            &|s| s.forwarding = Some("1".into()),
            "IPv4 forwarding is on",
        );
        check(
            &|s| s.addresses.push("198.51.100.1/24".into()),
            "carries address 198.51.100.1/24 (a gateway)",
        );
        check(
            &|s| s.nat_rules.push("oifname \"csbox1\" masquerade".into()),
            "a NAT rule references csbox1",
        );
        check(
            &|s| s.upper_devices.push("csbox1.50 (on csbox1)".into()),
            "link csbox1.50 (on csbox1) is stacked on the VNet",
        );
    }

    #[test]
    fn the_probe_address_is_expected_only_before_boot() {
        let vnet = VnetName::validate("csbox1").unwrap();
        let mut prepared = isolated();
        prepared.addresses.push("198.51.100.2/24".into());
        assert!(
            violations(
                &grant(),
                &vnet,
                &prepared,
                Stage::Boot,
                ForwardingPolicy::Refuse
            )
            .is_empty()
        );
        prepared.addresses.push("198.51.100.1/24".into());
        assert_eq!(
            violations(
                &grant(),
                &vnet,
                &prepared,
                Stage::Boot,
                ForwardingPolicy::Refuse
            )
            .len(),
            1
        );
    }

    #[test]
    fn links_stacked_on_the_vnet_or_its_ports_are_found_by_their_lower_device() {
        let vnet = VnetName::validate("csbox1").unwrap();
        // As `ip -j -br link show` prints them; a lower device in another namespace appears
        // only as `link_index`.
        let links: serde_json::Value = serde_json::from_str(
            r#"[{"ifname":"lo"},{"ifname":"csbox1"},
                {"link_index":2,"ifname":"tap9100i0"},
                {"link":"csbox1","ifname":"csbox1.50"},
                {"link":"csbox1","ifname":"mv0"},
                {"link":"tap9100i0","ifname":"tap9100i0.7"},
                {"link":"eno1","ifname":"eno1.100"}]"#,
        )
        .unwrap();
        assert_eq!(
            stacked_links(&links, &vnet, &["tap9100i0".into()]),
            [
                "csbox1.50 (on csbox1)",
                "mv0 (on csbox1)",
                "tap9100i0.7 (on tap9100i0)"
            ]
        );
    }

    #[test]
    fn probe_network_conflicts_name_the_address_or_route() {
        let grant = grant();
        let mut seen = isolated();
        assert!(probe_network_conflicts(&grant, 24, &seen).is_empty());
        seen.node_addresses.push(NodeAddress {
            device: "vmbr0".into(),
            address: "198.51.100.2".parse().unwrap(),
            prefix_len: 32,
        });
        seen.node_routes = parse_routes(
            &serde_json::from_str(
                r#"[{"dst":"default","gateway":"203.0.113.1","dev":"vmbr0"},
                    {"dst":"198.51.0.0/16","gateway":"203.0.113.1","dev":"vmbr0"},
                    {"type":"local","dst":"203.0.113.2","dev":"vmbr0","table":"local"},
                    {"dst":"203.0.113.0/24","dev":"vmbr0"}]"#,
            )
            .unwrap(),
        );
        let found = probe_network_conflicts(&grant, 24, &seen);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].contains(
            "the probe address 198.51.100.2 is already an address of this node (on vmbr0)"
        ));
        assert!(found[1].contains("overlaps the node's route 198.51.0.0/16 dev vmbr0 table main"));
        assert!(
            probe_network_conflicts(&grant, 25, &isolated())[0].contains("prefix at least /25")
        );
    }

    #[test]
    fn ruleset_contains_only_the_granted_targets() {
        let vnet = VnetName::validate("csbox1").unwrap();
        let text = ruleset(&grant(), &vnet);
        assert!(text.starts_with("table inet certistack_0f0e1c2d3b4a4c5d8e6f7a8b9c0d1e2f {"));
        assert!(text.contains(
            "oifname \"csbox1\" ip saddr 198.51.100.2 ip daddr 198.51.100.10 tcp dport 80 accept"
        ));
        assert_eq!(
            text.matches(" accept\n").count(),
            2,
            "one input reply rule, one target:\n{text}"
        );
        assert!(text.contains("iifname \"csbox1\" counter drop"));
        assert!(text.contains("oifname \"csbox1\" counter drop"));
    }

    #[test]
    fn forwarding_is_tolerated_at_prepare_only_when_disabled_for_the_run() {
        let vnet = VnetName::validate("csbox1").unwrap();
        let mut forwarding = isolated();
        forwarding.forwarding = Some("1".into());
        forwarding.forwarding_v6 = Some("1".into());
        let refused = violations(
            &grant(),
            &vnet,
            &forwarding,
            Stage::Prepare,
            ForwardingPolicy::Refuse,
        );
        assert_eq!(refused.len(), 2, "{refused:?}");
        assert!(refused[0].contains("sandbox.forwarding = \"disable-for-run\""));
        let policy = ForwardingPolicy::DisableForRun;
        assert!(violations(&grant(), &vnet, &forwarding, Stage::Prepare, policy).is_empty());
        // Before a boot the run's own 0 must be there, whatever the policy.
        let mut at_boot = forwarding.clone();
        at_boot.addresses.push("198.51.100.2/24".into());
        assert_eq!(
            violations(&grant(), &vnet, &at_boot, Stage::Boot, policy).len(),
            2
        );
        // An unreadable IPv4 value is never tolerated.
        forwarding.forwarding = None;
        assert!(
            violations(&grant(), &vnet, &forwarding, Stage::Prepare, policy)[0]
                .contains("cannot be read")
        );
    }

    #[test]
    fn legacy_nat_rules_are_found_by_interface_wildcard_or_subnet() {
        let vnet = VnetName::validate("csbox1").unwrap();
        // As iptables-legacy-save -t nat prints them (SDN's SNAT is by subnet).
        let listing = "# Generated by iptables-save v1.8.9\n*nat\n:POSTROUTING ACCEPT [0:0]\n\
            -A POSTROUTING -s 10.9.0.0/24 -o vmbr0 -j SNAT --to-source 203.0.113.2\n\
            -A POSTROUTING -s 198.51.100.0/24 -o vmbr0 -j SNAT --to-source 203.0.113.2\n\
            -A POSTROUTING -o csbox1 -j MASQUERADE\n\
            -A PREROUTING -i csbox+ -j DNAT --to-destination 203.0.113.9\n\
            -A PREROUTING -i csbox10 -j ACCEPT\n\
            -A POSTROUTING -o \"csbox1\" -j MASQUERADE\nCOMMIT\n";
        assert_eq!(
            legacy_nat_rules(listing, &vnet, Some("198.51.100.0/24")),
            [
                "-A POSTROUTING -s 198.51.100.0/24 -o vmbr0 -j SNAT --to-source 203.0.113.2",
                "-A POSTROUTING -o csbox1 -j MASQUERADE",
                "-A PREROUTING -i csbox+ -j DNAT --to-destination 203.0.113.9",
                "-A POSTROUTING -o \"csbox1\" -j MASQUERADE",
            ]
        );
    }

    #[test]
    fn nat_rules_listed_in_a_refusal_are_bounded() {
        let vnet = VnetName::validate("csbox1").unwrap();
        let mut seen = isolated();
        seen.nat_rules = (0..10)
            .map(|n| format!("-A POSTROUTING -o csbox1 -m comment --comment r{n} -j MASQUERADE"))
            .collect();
        let found = violations(
            &grant(),
            &vnet,
            &seen,
            Stage::Prepare,
            ForwardingPolicy::Refuse,
        );
        assert_eq!(found.len(), 9, "{found:?}");
        assert_eq!(found[8], "and 2 more NAT rules that reference csbox1");
        let long = format!(
            "-A POSTROUTING -o csbox1 -m comment --comment \"{}\u{1b}\"",
            "x".repeat(600)
        );
        let listed = legacy_nat_rules(&long, &vnet, Some("198.51.100.0/24"));
        assert!(
            listed[0].ends_with("more bytes]") && !listed[0].contains('\u{1b}'),
            "{listed:?}"
        );
    }

    #[test]
    fn an_ipv6_ruleset_admits_exactly_neighbour_discovery_with_the_targets() {
        assert_eq!(
            solicited_node("2001:db8:5::10".parse().unwrap()),
            "ff02::1:ff00:10".parse::<Ipv6Addr>().unwrap()
        );
        assert_eq!(
            solicited_node("2001:db8::abcd:ef12:3456".parse().unwrap()),
            "ff02::1:ff12:3456".parse::<Ipv6Addr>().unwrap()
        );
        let mut grant = grant();
        grant.probe_source = IpInterface::validate("2001:db8:5::2/120").unwrap();
        for target in &mut grant.probe_targets {
            target.address = UnicastIp::validate("2001:db8:5::10").unwrap();
        }
        let vnet = VnetName::validate("csbox1").unwrap();
        let text = ruleset(&grant, &vnet);
        assert!(text.contains(
            "iifname \"csbox1\" ip6 saddr { 2001:db8:5::10 } ip6 daddr { 2001:db8:5::2, ff02::1:ff00:2 } icmpv6 type nd-neighbor-solicit ip6 hoplimit 255 accept\n"
        ), "{text}");
        assert!(text.contains(
            "iifname \"csbox1\" ip6 saddr { 2001:db8:5::10 } ip6 daddr 2001:db8:5::2 icmpv6 type nd-neighbor-advert ip6 hoplimit 255 accept\n"
        ), "{text}");
        assert!(text.contains(
            "oifname \"csbox1\" ip6 saddr 2001:db8:5::2 ip6 daddr { 2001:db8:5::10, ff02::1:ff00:10 } icmpv6 type nd-neighbor-solicit ip6 hoplimit 255 accept\n"
        ), "{text}");
        assert!(text.contains(
            "oifname \"csbox1\" ip6 saddr 2001:db8:5::2 ip6 daddr { 2001:db8:5::10 } icmpv6 type nd-neighbor-advert ip6 hoplimit 255 accept\n"
        ), "{text}");
        // The neighbour rules come before each chain's drop, and nothing else ICMPv6 is allowed.
        let input_drop = text.find("iifname \"csbox1\" counter drop").unwrap();
        assert!(text.find("nd-neighbor-advert").unwrap() < input_drop);
        assert_eq!(text.matches("icmpv6").count(), 4, "{text}");
    }
}
