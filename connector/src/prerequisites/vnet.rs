//! What a VNet the caller names looks like now and on the next `ifreload -a`: its forwarding,
//! and the stanza ifupdown2 applies to it from the SDN interfaces file (address method,
//! forwarding attributes, NAT commands).

use super::{MAX_LISTED_RULES, MAX_VERSION_CHARS, bounded, item, read_config_file};
use certistack_core::untrusted::printable;
use certistack_core::validate::VnetName;
use certistack_proto::v1 as pb;
use std::path::Path;

pub(super) fn vnet_facts(vnet: &VnetName, sdn_interfaces: &Path) -> pb::VnetFacts {
    let sysctl = |family: &str| {
        read_config_file(Path::new(&format!(
            "/proc/sys/net/{family}/conf/{vnet}/forwarding"
        )))
        .map(|value| printable(value.trim().as_bytes(), MAX_VERSION_CHARS))
        .unwrap_or_default()
    };
    let mut facts = pb::VnetFacts {
        name: vnet.to_string(),
        ipv4_forwarding: sysctl("ipv4"),
        ipv6_forwarding: sysctl("ipv6"),
        stanza_file: bounded(&sdn_interfaces.display().to_string()),
        ..Default::default()
    };
    match read_config_file(sdn_interfaces) {
        Ok(text) => {
            if let Some(stanza) = interface_stanza(&text, vnet.as_str()) {
                facts.stanza_found = true;
                facts.address_method = item(&stanza.address_method);
                facts.ip_forward = item(&stanza.ip_forward);
                facts.ip6_forward = item(&stanza.ip6_forward);
                facts.address_present = stanza.address_present;
                facts.snat_lines = stanza
                    .snat_lines
                    .iter()
                    .take(MAX_LISTED_RULES)
                    .map(|line| item(line))
                    .collect();
            }
        }
        // No SDN file: SDN was never applied on this node, so ifreload writes no VNet.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => {
            facts.stanza_error = bounded(&format!(
                "cannot read {}: {error}",
                sdn_interfaces.display()
            ));
        }
    }
    facts
}

/// What ifupdown2 reads for one interface: its address method and forwarding attributes.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Stanza {
    /// `inet static`, `inet6 manual`, ...; empty for a bare `iface <name>`.
    pub(super) address_method: String,
    pub(super) ip_forward: String,
    pub(super) ip6_forward: String,
    /// An `address` attribute is set.
    pub(super) address_present: bool,
    /// `post-up` commands that add an iptables NAT rule (SDN's subnet SNAT), as written.
    pub(super) snat_lines: Vec<String>,
}

/// Whether an `up`/`post-up` command adds a rule to an iptables `nat` table.
fn adds_nat_rule(command: &str) -> bool {
    let words: Vec<&str> = command.split_whitespace().collect();
    words
        .first()
        .is_some_and(|tool| tool.ends_with("iptables") || tool.ends_with("ip6tables"))
        && words.windows(2).any(|pair| pair == ["-t", "nat"])
        && words
            .iter()
            .any(|word| matches!(*word, "-A" | "-I" | "--append" | "--insert"))
}

/// The source (`-s`) of a NAT command, unquoted: the subnet SDN's SNAT names.
pub(super) fn snat_source(command: &str) -> Option<String> {
    let mut words = command.split_whitespace();
    words.find(|word| matches!(*word, "-s" | "--source"))?;
    let source = words.next()?.trim_matches(|c| c == '\'' || c == '"');
    (!source.is_empty()).then(|| source.to_owned())
}

/// The stanza of `name` in an ifupdown2 interfaces file. ifupdown2 merges the stanzas of one
/// interface, so every `iface name` block counts: a method from any, attributes from the last.
pub(super) fn interface_stanza(text: &str, name: &str) -> Option<Stanza> {
    const STANZA_KEYWORDS: [&str; 5] = ["iface", "auto", "source", "mapping", "source-directory"];
    let mut found: Option<Stanza> = None;
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if STANZA_KEYWORDS.contains(&first) || first.starts_with("allow-") {
            inside = first == "iface" && words.next() == Some(name);
            if inside {
                let method = words.collect::<Vec<_>>().join(" ");
                let stanza = found.get_or_insert_with(Stanza::default);
                if !method.is_empty() {
                    stanza.address_method = method;
                }
            }
            continue;
        }
        if let (true, Some(stanza)) = (inside, found.as_mut()) {
            let value = words.collect::<Vec<_>>().join(" ");
            match first {
                "ip-forward" => stanza.ip_forward = value,
                "ip6-forward" => stanza.ip6_forward = value,
                "address" => stanza.address_present = true,
                "post-up" | "up" if adds_nat_rule(&value) => stanza.snat_lines.push(value),
                _ => {}
            }
        }
    }
    found
}
