//! Reading firewall listings in full, and the NAT rules of the legacy iptables tables
//! (pve-firewall, SDN's SNAT) that `nft list ruleset` never shows.

use crate::executor::ExecError;
use crate::node::tool_error;
use crate::process::{self, ToolCall};
use certistack_core::validate::VnetName;

/// Characters of one legacy NAT rule kept in a refusal.
const MAX_RULE_CHARS: usize = 512;
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
