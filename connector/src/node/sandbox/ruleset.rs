//! The run's containment table in nftables syntax: its name, its rules, the IPv6 neighbour
//! discovery it lets through.

use certistack_core::grant::{Grant, ProbeKind};
use certistack_core::validate::VnetName;
use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv6Addr};

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
pub(super) fn solicited_node(address: Ipv6Addr) -> Ipv6Addr {
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
