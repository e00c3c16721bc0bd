//! Tests of the sandbox network: isolation rules, stacked links, probe network conflicts,
//! the ruleset per family, legacy NAT rules.

use super::*;

use crate::config::ForwardingPolicy;

use certistack_core::grant::Grant;

use certistack_core::validate::{IpInterface, VnetName};

use super::observation::parse_routes;
use super::ruleset::solicited_node;
use certistack_core::fixtures::{full_wire_grant, sign};
use certistack_core::validate::{UnicastIp, Validated};
use ed25519_dalek::SigningKey;
use std::net::Ipv6Addr;

fn grant() -> Grant {
    let key = SigningKey::from_bytes(&[1; 32]);
    certistack_core::grant::verify(&sign(&key, &full_wire_grant()), &key.verifying_key()).unwrap()
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
    assert!(
        found[0].contains(
            "the probe address 198.51.100.2 is already an address of this node (on vmbr0)"
        )
    );
    assert!(found[1].contains("overlaps the node's route 198.51.0.0/16 dev vmbr0 table main"));
    assert!(probe_network_conflicts(&grant, 25, &isolated())[0].contains("prefix at least /25"));
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
