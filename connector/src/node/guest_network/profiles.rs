//! The files recovery writes for each guest network stack (systemd-networkd, netplan,
//! NetworkManager, ifcfg, ifupdown, firewalld), and how it recognises and sets aside a guest's
//! own profile that would fight the sandbox NIC's. Pure text in, text out.

use super::{COMMENT_PREFIX, IFUPDOWN_NAME, PROFILE_NAME, SandboxNic};
use certistack_core::grant::ProbeKind;
use std::collections::BTreeSet;
use std::net::IpAddr;

/// `/etc/systemd/network/00-certistack-sandbox.network`: first in lexical order, so
/// systemd-networkd applies it to the sandbox NIC before any production file.
pub fn networkd_profile(nic: &SandboxNic) -> String {
    format!(
        "# Written by CertiStack into a disposable sandbox overlay.\n[Match]\nMACAddress={}\n\n[Network]\nAddress={}\nDHCP=no\nIPv6AcceptRA=no\nLinkLocalAddressing=no\n",
        nic.mac, nic.address
    )
}

/// `/etc/systemd/network/10-certistack-sandbox.link`: names the sandbox NIC by its MAC for
/// ifupdown, whose stanzas name interfaces.
pub fn networkd_link(nic: &SandboxNic) -> String {
    format!(
        "# Written by CertiStack into a disposable sandbox overlay.\n[Match]\nMACAddress={}\n\n[Link]\nName={IFUPDOWN_NAME}\n",
        nic.mac
    )
}

/// `/etc/NetworkManager/system-connections/certistack-sandbox.nmconnection` (mode 0600).
pub fn networkmanager_keyfile(nic: &SandboxNic, uuid: &str) -> String {
    let (family, other) = if nic.is_ipv4() {
        ("ipv4", "ipv6")
    } else {
        ("ipv6", "ipv4")
    };
    format!(
        "# Written by CertiStack into a disposable sandbox overlay.\n[connection]\nid={PROFILE_NAME}\nuuid={uuid}\ntype=ethernet\nautoconnect=true\nautoconnect-priority=999\n\n[ethernet]\nmac-address={}\n\n[{family}]\nmethod=manual\naddress1={}\nnever-default=true\nignore-auto-dns=true\nignore-auto-routes=true\n\n[{other}]\nmethod=disabled\n",
        nic.mac.to_uppercase(),
        nic.address
    )
}

/// `/etc/network/interfaces.d/certistack-sandbox`: the NIC named by [`networkd_link`].
pub fn ifupdown_stanza(nic: &SandboxNic) -> String {
    let family = if nic.is_ipv4() { "inet" } else { "inet6" };
    let extra = if nic.is_ipv4() {
        ""
    } else {
        "\n    autoconf 0\n    accept_ra 0"
    };
    // `auto` only: Debian's networking.service runs `ifup -a` after ifupdown-pre.service has
    // waited for udev to settle, and so after the link file's rename. `allow-hotplug` beside it
    // is accepted by Debian's ifupdown, but busybox's (which has no allow-hotplug) refuses it after
    // an `auto` line as a misplaced option, and brings up nothing.
    format!(
        "# Written by CertiStack into a disposable sandbox overlay.\n# The NIC with MAC {} is named {IFUPDOWN_NAME} by /etc/systemd/network/10-{PROFILE_NAME}.link.\nauto {IFUPDOWN_NAME}\niface {IFUPDOWN_NAME} {family} static\n    address {}{extra}\n",
        nic.mac, nic.address
    )
}

/// `/etc/netplan/99-certistack-sandbox.yaml` (mode 0600).
pub fn netplan_yaml(nic: &SandboxNic) -> String {
    format!(
        "# Written by CertiStack into a disposable sandbox overlay.\nnetwork:\n  version: 2\n  ethernets:\n    {PROFILE_NAME}:\n      match:\n        macaddress: \"{}\"\n      dhcp4: false\n      dhcp6: false\n      accept-ra: false\n      link-local: []\n      addresses:\n        - \"{}\"\n",
        nic.mac, nic.address
    )
}

/// `/etc/sysconfig/network-scripts/ifcfg-certistack-sandbox`.
pub fn ifcfg_profile(nic: &SandboxNic) -> String {
    let address = if nic.is_ipv4() {
        format!(
            "IPADDR={}\nPREFIX={}\nIPV6INIT=no\n",
            nic.address.address, nic.address.prefix_len
        )
    } else {
        format!("IPV6INIT=yes\nIPV6_AUTOCONF=no\nIPV6ADDR={}\n", nic.address)
    };
    format!(
        "# Written by CertiStack into a disposable sandbox overlay.\nNAME={PROFILE_NAME}\nTYPE=Ethernet\nHWADDR={}\nBOOTPROTO=none\nONBOOT=yes\n{address}DEFROUTE=no\nPEERDNS=no\n",
        nic.mac.to_uppercase()
    )
}

/// The value of `key=` lines (case-insensitive key), every occurrence.
fn values<'a>(text: &'a str, key: &str) -> Vec<&'a str> {
    text.lines()
        .filter_map(|line| {
            let (k, v) = line.trim().split_once('=')?;
            k.trim()
                .eq_ignore_ascii_case(key)
                .then(|| v.trim().trim_matches('"'))
        })
        .collect()
}

fn same_mac(a: &str, b: &str) -> bool {
    a.trim().eq_ignore_ascii_case(b.trim())
}

/// Whether a profile bound by MAC (`macs`, as its lines name them) would configure the
/// sandbox NIC: bound to nothing, or to the sandbox MAC. A profile bound to other MACs belongs
/// to another NIC and is kept.
fn binds_sandbox_nic(macs: &[&str], nic: &SandboxNic) -> bool {
    macs.is_empty() || macs.iter().any(|m| same_mac(m, &nic.mac))
}

/// Whether a systemd-networkd `.network` file would configure the sandbox NIC.
pub fn networkd_fights(text: &str, nic: &SandboxNic) -> bool {
    let macs: Vec<&str> = values(text, "MACAddress")
        .into_iter()
        .flat_map(str::split_whitespace)
        .collect();
    let loopback =
        values(text, "Name").iter().all(|n| *n == "lo") && !values(text, "Name").is_empty();
    !loopback && binds_sandbox_nic(&macs, nic)
}

/// Whether a netplan file declares ethernets that would configure the sandbox NIC: any
/// `ethernets` entry while none of its `macaddress:` lines names another NIC.
pub fn netplan_fights(text: &str, nic: &SandboxNic) -> bool {
    if !text
        .lines()
        .any(|l| l.trim_start().starts_with("ethernets:"))
    {
        return false;
    }
    let macs: Vec<&str> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("macaddress:"))
        .map(|m| m.trim().trim_matches(|c| c == '"' || c == '\''))
        .collect();
    binds_sandbox_nic(&macs, nic)
}

/// Whether a NetworkManager keyfile is an ethernet profile that would take the sandbox NIC.
pub fn networkmanager_fights(text: &str, nic: &SandboxNic) -> bool {
    let ethernet = values(text, "type")
        .iter()
        .any(|t| *t == "ethernet" || *t == "802-3-ethernet");
    ethernet && binds_sandbox_nic(&values(text, "mac-address"), nic)
}

/// Whether an `ifcfg-*` file would configure the sandbox NIC.
pub fn ifcfg_fights(text: &str, nic: &SandboxNic) -> bool {
    let loopback = values(text, "DEVICE").contains(&"lo");
    !loopback && binds_sandbox_nic(&values(text, "HWADDR"), nic)
}

/// The lines of a guest file, each with its own `\n` (the last may have none) and every
/// other byte as the file has it: edits insert or prefix whole lines and copy the rest, so a
/// file in another encoding, with `\r\n` line ends or without a final newline keeps every
/// byte outside the changed lines.
fn raw_lines(bytes: &[u8]) -> impl Iterator<Item = (&[u8], String)> {
    bytes.split_inclusive(|b| *b == b'\n').map(|line| {
        let content = line.strip_suffix(b"\n").unwrap_or(line);
        (line, String::from_utf8_lossy(content).into_owned())
    })
}

/// Ends `out` with a newline before a line is appended after the file's own last line.
pub(super) fn end_line(out: &mut Vec<u8>) {
    if !out.is_empty() && !out.ends_with(b"\n") {
        out.push(b'\n');
    }
}

/// A NetworkManager keyfile with `autoconnect=false` first in its `[connection]` section (an
/// `autoconnect` line of its own is commented out); every other byte is kept as written.
pub fn networkmanager_disable(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() + 64);
    let mut in_connection = false;
    let mut found = false;
    for (line, text) in raw_lines(bytes) {
        let trimmed = text.trim();
        if trimmed.starts_with('[') {
            in_connection = trimmed == "[connection]";
            out.extend_from_slice(line);
            if in_connection && !found {
                end_line(&mut out);
                out.extend_from_slice(b"autoconnect=false\n");
                found = true;
            }
            continue;
        }
        if in_connection
            && trimmed
                .split_once('=')
                .is_some_and(|(k, _)| k.trim() == "autoconnect")
        {
            out.extend_from_slice(COMMENT_PREFIX.as_bytes());
        }
        out.extend_from_slice(line);
    }
    if !found {
        end_line(&mut out);
        out.extend_from_slice(b"[connection]\nautoconnect=false\n");
    }
    out
}

/// An `ifcfg-*` file that no longer starts at boot (`ONBOOT=no`); every other byte is kept.
pub fn ifcfg_disable(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() + 64);
    for (line, text) in raw_lines(bytes) {
        if text
            .trim()
            .split_once('=')
            .is_some_and(|(k, _)| k.trim().eq_ignore_ascii_case("ONBOOT"))
        {
            out.extend_from_slice(COMMENT_PREFIX.as_bytes());
        }
        out.extend_from_slice(line);
    }
    end_line(&mut out);
    out.extend_from_slice(b"ONBOOT=no\n");
    out
}

/// `/etc/network/interfaces` (or a file it sources) with every stanza of an interface other
/// than `lo` and the sandbox NIC's own commented out; `None` when nothing changes. ifupdown
/// names interfaces, not MACs, and the guest may give the sandbox NIC the name its production
/// NIC had, so every other interface's stanza could configure it.
pub fn ifupdown_disable(bytes: &[u8]) -> Option<Vec<u8>> {
    let keep = |name: &str| name == "lo" || name == IFUPDOWN_NAME;
    let mut out = Vec::with_capacity(bytes.len() + 256);
    let mut changed = false;
    let mut in_disabled_stanza = false;
    for (line, text) in raw_lines(bytes) {
        let words: Vec<&str> = text.split_whitespace().collect();
        let first = words.first().copied().unwrap_or("");
        let starts_stanza = matches!(
            first,
            "iface" | "mapping" | "auto" | "source" | "source-directory" | "rename"
        ) || first.starts_with("allow-");
        if starts_stanza {
            in_disabled_stanza = false;
        }
        let disable = match first {
            "iface" | "mapping" => {
                let name = words.get(1).copied().unwrap_or("");
                if keep(name) {
                    false
                } else {
                    in_disabled_stanza = true;
                    true
                }
            }
            "auto" => words.iter().skip(1).any(|n| !keep(n)),
            f if f.starts_with("allow-") => words.iter().skip(1).any(|n| !keep(n)),
            _ => in_disabled_stanza && !text.trim().is_empty() && !starts_stanza,
        };
        if disable {
            changed = true;
            out.extend_from_slice(COMMENT_PREFIX.as_bytes());
            out.extend_from_slice(line);
            // `auto lo eth0`: lo keeps coming up.
            if matches!(first, "auto") || first.starts_with("allow-") {
                let kept: Vec<&str> = words.iter().skip(1).copied().filter(|n| keep(n)).collect();
                if !kept.is_empty() {
                    end_line(&mut out);
                    out.extend_from_slice(format!("{first} {}\n", kept.join(" ")).as_bytes());
                }
            }
        } else {
            out.extend_from_slice(line);
        }
    }
    changed.then_some(out)
}

/// Whether `/etc/network/interfaces` reads the sandbox stanza's directory.
pub(super) fn ifupdown_sources_directory(text: &str) -> bool {
    text.lines().any(|line| {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["source", path, ..] => {
                path.starts_with("/etc/network/interfaces.d/") || path.starts_with("interfaces.d/")
            }
            ["source-directory", path, ..] => path.trim_end_matches('/').ends_with("interfaces.d"),
            _ => false,
        }
    })
}

/// The default zone a `firewalld.conf` names; firewalld's own default is `public`.
pub fn firewalld_default_zone(conf: &str) -> Result<String, String> {
    let zone = values(conf, "DefaultZone")
        .last()
        .map(|z| z.to_string())
        .unwrap_or_else(|| "public".into());
    let valid = !zone.is_empty()
        && zone.len() <= 17
        && zone
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if valid {
        Ok(zone)
    } else {
        Err(format!(
            "the guest's firewalld.conf names the default zone {:?}, which is not a firewalld zone name",
            zone.chars().take(64).collect::<String>()
        ))
    }
}

/// The ports a probe of `kind` reaches on `port`: (port, protocol).
pub(super) fn probe_ports(kind: ProbeKind, port: u16) -> Vec<(u16, &'static str)> {
    match kind {
        ProbeKind::Dns => vec![(port, "udp"), (port, "tcp")],
        ProbeKind::Tcp | ProbeKind::Http | ProbeKind::Https | ProbeKind::Ldap => {
            vec![(port, "tcp")]
        }
    }
}

/// A firewalld zone file with one rich rule per probe port allowing the probe source, added
/// before `</zone>`; every existing element is kept as written. `None` when every rule is there
/// already.
pub fn firewalld_allow(
    zone_xml: &[u8],
    probe_source: IpAddr,
    ports: &BTreeSet<(u16, &'static str)>,
) -> Result<Option<Vec<u8>>, String> {
    let close = b"</zone>";
    let end = zone_xml
        .windows(close.len())
        .rposition(|w| w == close)
        .ok_or_else(|| "the zone file has no </zone> element".to_owned())?;
    let family = if probe_source.is_ipv4() {
        "ipv4"
    } else {
        "ipv6"
    };
    let mut rules = String::new();
    for (port, protocol) in ports {
        let rule = format!(
            "  <rule family=\"{family}\">\n    <source address=\"{probe_source}\"/>\n    <port port=\"{port}\" protocol=\"{protocol}\"/>\n    <accept/>\n  </rule>\n"
        );
        if !zone_xml.windows(rule.len()).any(|w| w == rule.as_bytes()) {
            rules.push_str(&rule);
        }
    }
    if rules.is_empty() {
        return Ok(None);
    }
    let (head, tail) = zone_xml.split_at(end);
    let mut out = head.to_vec();
    end_line(&mut out);
    out.extend_from_slice(rules.as_bytes());
    out.extend_from_slice(tail);
    Ok(Some(out))
}
