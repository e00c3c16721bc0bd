//! Which firewall the node's pve-firewall files enable (`host.fw`, `cluster.fw`).

use super::{bounded, item, read_config_file};
use certistack_proto::v1 as pb;
use std::path::Path;

pub(super) fn firewall_file_facts(host_fw: &Path, cluster_fw: &Path) -> pb::FirewallFacts {
    let mut facts = pb::FirewallFacts {
        host_fw: bounded(&host_fw.display().to_string()),
        cluster_fw: bounded(&cluster_fw.display().to_string()),
        ..Default::default()
    };
    match read_config_file(cluster_fw) {
        Ok(text) => {
            facts.datacenter_enable_option =
                item(&host_fw_option(&text, "enable").unwrap_or_default());
        }
        // No cluster.fw: the datacenter firewall is off.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => {
            facts.cluster_fw_error =
                bounded(&format!("cannot read {}: {error}", cluster_fw.display()));
        }
    }
    match read_config_file(host_fw) {
        Ok(text) => {
            facts.nftables_option = item(&host_fw_option(&text, "nftables").unwrap_or_default())
        }
        // No host.fw: every option has its default, and `nftables` defaults to off.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => {
            facts.host_fw_error = bounded(&format!("cannot read {}: {error}", host_fw.display()));
        }
    }
    facts
}

/// The value of `key:` in the `[OPTIONS]` section of a pve-firewall file (`host.fw`,
/// `cluster.fw`).
pub(super) fn host_fw_option(text: &str, key: &str) -> Option<String> {
    let mut in_options = false;
    let mut value = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if line.starts_with('[') {
            in_options = line.eq_ignore_ascii_case("[options]");
            continue;
        }
        if in_options
            && let Some((name, found)) = line.split_once(':')
            && name.trim().eq_ignore_ascii_case(key)
        {
            value = Some(found.trim().to_owned());
        }
    }
    value
}
