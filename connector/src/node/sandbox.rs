//! The run's sandbox network: isolation checks, the probe address, and a containment table.
//!
//! `PrepareSandbox` first reads the VNet's state and refuses the run when it is not isolated:
//! the bridge must exist; its only ports may be taps of this run's sandbox VMs
//! (`tap<vmid>i<N>`); IPv4 forwarding must be off on it; it must carry no address but the
//! probe address (a gateway would route the guest out); no NAT rule may mention it. The
//! connector never creates or changes SDN configuration. Only then it adds the probe address
//! and installs one nftables table per run, atomically (`nft -f`), that
//! - drops every packet from the VNet to the node but replies to the connector's own probes,
//! - drops all forwarding into and out of the VNet,
//! - lets the probe address send only to the grant's probe targets.
//!
//! The reply carries the evidence: the ports, addresses and sysctl observed and the installed
//! ruleset with its SHA-256, so a report can show what protected the network during the run.

use super::{NodeExecutor, resources, tool_detail, tool_error};
use crate::executor::{ExecError, Outcome};
use crate::grant::{Grant, ProbeKind};
use crate::journal::Phase;
use crate::process::{self, SecretInput, SecretKind, ToolCall, ToolOutput};
use crate::runs::{RunGuard, RunHandle};
use crate::validate::{IpInterface, VnetName};
use certistack_proto::v1 as pb;
use serde_json::json;
use sha2::{Digest, Sha256};
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

/// The network an interface address lies in, e.g. `198.51.100.0/24`.
pub fn network(interface: &IpInterface) -> String {
    match interface.address.0 {
        IpAddr::V4(v4) => {
            let mask = u32::MAX
                .checked_shl(32 - u32::from(interface.prefix_len))
                .unwrap_or(0);
            format!(
                "{}/{}",
                std::net::Ipv4Addr::from(u32::from(v4) & mask),
                interface.prefix_len
            )
        }
        IpAddr::V6(v6) => {
            let mask = u128::MAX
                .checked_shl(128 - u32::from(interface.prefix_len))
                .unwrap_or(0);
            format!(
                "{}/{}",
                std::net::Ipv6Addr::from(u128::from(v6) & mask),
                interface.prefix_len
            )
        }
    }
}

/// Every way the observed VNet breaks isolation, each naming the property.
pub fn violations(grant: &Grant, vnet: &VnetName, seen: &Observation) -> Vec<String> {
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
        Some(value) => violations.push(format!(
            "IPv4 forwarding is on for {vnet} (net.ipv4.conf.{vnet}.forwarding = {value})"
        )),
        None => violations.push(format!("net.ipv4.conf.{vnet}.forwarding cannot be read")),
    }
    if let Some(value) = seen.forwarding_v6.as_deref().filter(|v| *v != "0") {
        violations.push(format!(
            "IPv6 forwarding is on for {vnet} (net.ipv6.conf.{vnet}.forwarding = {value})"
        ));
    }
    let probe = grant.probe_source.to_string();
    for address in &seen.addresses {
        // Link-local IPv6 is every up interface's own; the containment table covers it.
        if address == &probe {
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
    for rule in &seen.nat_rules {
        violations.push(format!("a NAT rule references {vnet}: {rule}"));
    }
    violations
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
    format!(
        "table inet {table} {{\n\
         \x20 chain input {{\n\
         \x20   type filter hook input priority filter - 10; policy accept;\n\
         \x20   iifname \"{vnet}\" {family} daddr {probe} ct state established,related accept\n\
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

    /// Reads the VNet's isolation-relevant state. Links are read through netlink (`ip`), not
    /// sysfs: sysfs shows the namespace it was mounted in, netlink the caller's.
    pub(super) async fn observe(
        &self,
        grant: &Grant,
        vnet: &VnetName,
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
            .tool(
                &self.config.tools.ip,
                &["-j", "link", "show", "master", vnet.as_str()],
            )
            .await?;
        let ports: serde_json::Value = serde_json::from_str(&ports.stdout).map_err(|e| {
            ExecError::Failed(format!("ip -j link show master {vnet} gave no JSON: {e}"))
        })?;
        seen.ports = ports
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p.get("ifname")?.as_str().map(str::to_owned))
            .collect();
        seen.ports.sort();
        seen.forwarding =
            std::fs::read_to_string(format!("/proc/sys/net/ipv4/conf/{vnet}/forwarding"))
                .ok()
                .map(|v| v.trim().to_owned());
        seen.forwarding_v6 =
            std::fs::read_to_string(format!("/proc/sys/net/ipv6/conf/{vnet}/forwarding"))
                .ok()
                .map(|v| v.trim().to_owned());
        let out = self
            .tool(
                &self.config.tools.ip,
                &["-j", "address", "show", "dev", vnet.as_str()],
            )
            .await?;
        let parsed: serde_json::Value = serde_json::from_str(&out.stdout).map_err(|e| {
            ExecError::Failed(format!("ip -j address show dev {vnet} gave no JSON: {e}"))
        })?;
        for link in parsed.as_array().into_iter().flatten() {
            for info in link
                .get("addr_info")
                .and_then(|a| a.as_array())
                .into_iter()
                .flatten()
            {
                if let (Some(local), Some(prefix)) = (
                    info.get("local").and_then(|l| l.as_str()),
                    info.get("prefixlen").and_then(|p| p.as_u64()),
                ) {
                    seen.addresses.push(format!("{local}/{prefix}"));
                }
            }
        }
        let out = self
            .tool(&self.config.tools.nft, &["list", "ruleset"])
            .await?;
        if !out.success() {
            return Err(ExecError::Failed(format!(
                "nft list ruleset failed: {}",
                out.stderr_excerpt()
            )));
        }
        if out.truncated {
            // A NAT rule past the cut could go unseen: refuse rather than call the VNet isolated.
            return Err(ExecError::FailedPrecondition(
                "the node's nftables ruleset is larger than the connector reads (64 KiB), so the NAT check cannot be completed".into(),
            ));
        }
        let subnet = network(&grant.probe_source);
        let quoted = format!("\"{vnet}\"");
        let mut in_nat_chain = false;
        for line in out.stdout.lines() {
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
        Ok(seen)
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
        let seen = self.observe(grant, &vnet).await?;
        let violations = violations(grant, &vnet, &seen);
        if !violations.is_empty() {
            return Err(ExecError::FailedPrecondition(format!(
                "VNet {vnet} is not isolated, so no guest may boot on it: {}",
                violations.join("; ")
            )));
        }
        if self.table_present(grant).await? {
            return Err(ExecError::FailedPrecondition(format!(
                "a table inet {table} already exists on this node but this run did not install it; inspect it before preparing"
            )));
        }
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
        let call = ToolCall::new(&self.config.tools.ip, self.tool_timeout())
            .arg("address")
            .arg("add")
            .arg(&address)
            .arg("dev")
            .arg(vnet.as_str());
        let out = self
            .run_step(&mut guard, "sandbox.address", &addr_key, call)
            .await?;
        if !out.success() {
            guard
                .append(
                    self.now_ms(),
                    "sandbox.address",
                    &addr_key,
                    Phase::Failed,
                    tool_detail(&out, &[]),
                )
                .await?;
            return Err(ExecError::FailedPrecondition(format!(
                "ip address add {address} dev {vnet} failed: {}",
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
            guard
                .append(
                    self.now_ms(),
                    "sandbox.nft",
                    &nft_key,
                    Phase::Failed,
                    tool_detail(&out, &[]),
                )
                .await?;
            return Err(ExecError::FailedPrecondition(format!(
                "nft -f refused the containment table: {}",
                out.stderr_excerpt()
            )));
        }
        let listed = self
            .tool(&self.config.tools.nft, &["list", "table", "inet", &table])
            .await?;
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
        Ok(Outcome::PrepareSandbox(pb::PrepareSandboxReply {
            bridge_ports: seen.ports,
            bridge_addresses: seen
                .addresses
                .into_iter()
                .chain(std::iter::once(address))
                .collect(),
            forwarding_sysctl: format!(
                "net.ipv4.conf.{vnet}.forwarding = {}",
                seen.forwarding.unwrap_or_default()
            ),
            ruleset_text: listed.stdout,
            ruleset_sha256: sha256,
            journal_head: guard.head_hex(),
        }))
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
        if !states.get(&nft_key).is_some_and(|s| s.is_open())
            && !states.get(&addr_key).is_some_and(|s| s.is_open())
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
        self.remove_table(&mut guard, grant).await?;
        self.remove_address(&mut guard, grant).await?;
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
            guard
                .append(
                    self.now_ms(),
                    op,
                    &key,
                    Phase::Undone,
                    json!({ "end_state": "already gone" }),
                )
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
            guard
                .append(
                    self.now_ms(),
                    op,
                    &key,
                    Phase::Failed,
                    tool_detail(&out, &[]),
                )
                .await?;
            return Err(ExecError::Failed(format!(
                "{} {} failed: {}",
                program.display(),
                args.join(" "),
                out.stderr_excerpt()
            )));
        }
        guard
            .append(
                self.now_ms(),
                op,
                &key,
                Phase::Undone,
                json!({ "end_state": "deleted" }),
            )
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grant::tests::{full_wire_grant, sign};
    use crate::validate::Validated;
    use ed25519_dalek::SigningKey;

    fn grant() -> Grant {
        let key = SigningKey::from_bytes(&[1; 32]);
        crate::grant::verify(&sign(&key, &full_wire_grant()), &key.verifying_key()).unwrap()
    }

    fn isolated() -> Observation {
        Observation {
            is_bridge: true,
            ports: vec!["tap9100i0".into(), "tap9100i1".into()],
            forwarding: Some("0".into()),
            forwarding_v6: Some("0".into()),
            addresses: vec!["fe80::1/64".into()],
            nat_rules: vec![],
        }
    }

    #[test]
    fn an_isolated_vnet_passes() {
        let vnet = VnetName::validate("csbox1").unwrap();
        assert!(violations(&grant(), &vnet, &isolated()).is_empty());
        let mut with_probe = isolated();
        with_probe.addresses.push("198.51.100.2/24".into());
        assert!(
            violations(&grant(), &vnet, &with_probe)[0]
                .contains("already carries the probe address")
        );
        let mut v6 = isolated();
        v6.forwarding_v6 = Some("1".into());
        assert!(violations(&grant(), &vnet, &v6)[0].contains("IPv6 forwarding is on"));
    }

    #[test]
    fn each_violation_is_named() {
        let vnet = VnetName::validate("csbox1").unwrap();
        let grant = grant();
        let check = |edit: &dyn Fn(&mut Observation), needle: &str| {
            let mut seen = isolated();
            edit(&mut seen);
            let found = violations(&grant, &vnet, &seen);
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
        assert_eq!(
            network(&IpInterface::validate("198.51.100.2/24").unwrap()),
            "198.51.100.0/24"
        );
        assert_eq!(
            network(&IpInterface::validate("2001:db8::2/64").unwrap()),
            "2001:db8::/64"
        );
    }
}
