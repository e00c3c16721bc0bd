//! `PrepareSandbox`, the re-check before a boot, and the release of the table and the probe
//! address, journaled.

use super::Sandbox;
use super::Stage;
use super::isolation::{probe_network_conflicts, violations};
use super::ruleset::{ruleset, table_name};
use crate::config::ForwardingPolicy;
use crate::executor::{ExecError, Outcome};
use crate::process::{SecretInput, SecretKind, ToolCall};
use crate::resources;
use crate::resources::EndState;
use crate::runs::{RunGuard, RunHandle};
use certistack_core::grant::Grant;
use certistack_core::journal::Op;
use certistack_core::journal::Resource;
use certistack_core::validate::{IpInterface, VnetName};
use certistack_proto::v1 as pb;
use serde_json::json;
use sha2::{Digest, Sha256};

/// What the sandbox adds to the node's network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NetworkObject {
    Table,
    Address,
}

impl Sandbox<'_> {
    /// The re-check before a guest boots: the VNet must still be what PrepareSandbox found,
    /// with the probe address and the run's table on it, and nothing stacked on it since.
    pub(in crate::node) async fn recheck(&self, grant: &Grant) -> Result<(), ExecError> {
        let seen = self.observe(grant, &grant.vnet, Stage::Boot).await?;
        let violations = violations(
            grant,
            &grant.vnet,
            &seen,
            Stage::Boot,
            self.ctx.config.sandbox.forwarding,
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

    pub(in crate::node) async fn prepare(
        &self,
        run: &RunHandle,
        vnet: VnetName,
        probe_source: IpInterface,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.ctx.lock_open(run).await?;
        let states = resources::states(&guard.records());
        let table = table_name(grant);
        if states
            .get(&Resource::NftTable(table.clone()).key())
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
            self.ctx.config.sandbox.forwarding,
        );
        if !violations.is_empty() {
            return Err(ExecError::FailedPrecondition(format!(
                "VNet {vnet} is not isolated, so no guest may boot on it: {}",
                violations.join("; ")
            )));
        }
        let conflicts =
            probe_network_conflicts(grant, self.ctx.config.limits.min_probe_prefix, &seen);
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
        let nft_key = Resource::NftTable(table.clone());
        guard
            .intent(
                self.ctx.now_ms(),
                &Op::SandboxNft,
                &nft_key,
                json!({ "table": table, "ruleset": rules }),
            )
            .await?;
        // One `nft -f` transaction: the whole table or nothing. The ruleset travels on a pipe.
        let call = ToolCall::new(&self.ctx.config.tools.nft, self.ctx.tool_timeout())
            .arg("-f")
            .arg("/dev/fd/3")
            .secret(SecretInput {
                child_fd: 3,
                bytes: zeroize::Zeroizing::new(rules.clone().into_bytes()),
                kind: SecretKind::Pipe,
            });
        let out = self
            .ctx
            .run_step(&mut guard, &Op::SandboxNft, &nft_key, call)
            .await?;
        if !out.success() {
            self.ctx
                .journal_tool_failed(&mut guard, &Op::SandboxNft, &nft_key, &out, &[])
                .await?;
            return Err(ExecError::FailedPrecondition(format!(
                "nft -f refused the containment table: {}",
                out.stderr_excerpt()
            )));
        }
        let listed = self
            .tool(
                &self.ctx.config.tools.nft,
                &["list", "table", "inet", &table],
            )
            .await?;
        if !listed.success() || listed.truncated {
            // The table is installed but its evidence cannot be produced: no run proceeds
            // without the evidence. Record it as installed so Cleanup removes it, and try now.
            guard
                .done(
                    self.ctx.now_ms(),
                    &Op::SandboxNft,
                    &nft_key,
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
            .done(
                self.ctx.now_ms(),
                &Op::SandboxNft,
                &nft_key,
                json!({ "table": table, "ruleset_sha256": sha256 }),
            )
            .await?;

        let address = probe_source.to_string();
        let addr_key = Resource::ProbeAddress(vnet.clone());
        guard
            .intent(
                self.ctx.now_ms(),
                &Op::SandboxAddress,
                &addr_key,
                json!({ "address": address }),
            )
            .await?;
        let mut call = ToolCall::new(&self.ctx.config.tools.ip, self.ctx.tool_timeout())
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
            .ctx
            .run_step(&mut guard, &Op::SandboxAddress, &addr_key, call)
            .await?;
        if !out.success() {
            self.ctx
                .journal_tool_failed(&mut guard, &Op::SandboxAddress, &addr_key, &out, &[])
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
            .done(
                self.ctx.now_ms(),
                &Op::SandboxAddress,
                &addr_key,
                json!({ "address": address }),
            )
            .await?;
        let disabled = if self.ctx.config.sandbox.forwarding == ForwardingPolicy::DisableForRun {
            match self.disable_forwarding(&mut guard, &vnet, &seen).await {
                Ok(disabled) => disabled,
                Err(error) => {
                    let undo = self.undo(&mut guard, grant).await;
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
    async fn undo(&self, guard: &mut RunGuard<'_>, grant: &Grant) -> String {
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

    pub(in crate::node) async fn release(
        &self,
        run: &RunHandle,
        vnet: VnetName,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.ctx.lock_open(run).await?;
        let states = resources::states(&guard.records());
        let nft_key = Resource::NftTable(table_name(grant));
        let addr_key = Resource::ProbeAddress(vnet.clone());
        let fwd_key = Resource::Forwarding(vnet.clone());
        if ![&nft_key, &addr_key, &fwd_key]
            .iter()
            .any(|key| states.get(&key.key()).is_some_and(|s| s.is_open()))
        {
            return Err(ExecError::NotFound(format!(
                "this run has no sandbox on {vnet}"
            )));
        }
        if let Some(vm) = states
            .values()
            .find(|s| s.is_open() && matches!(s.resource, Resource::Vm(_)))
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
    pub(in crate::node) async fn remove_table(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
    ) -> Result<EndState, ExecError> {
        self.remove_network_object(guard, grant, NetworkObject::Table)
            .await
    }

    /// Removes the probe address from the VNet if it is there, and checks that it is gone.
    pub(in crate::node) async fn remove_address(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
    ) -> Result<EndState, ExecError> {
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
    ) -> Result<EndState, ExecError> {
        let table = table_name(grant);
        let address = grant.probe_source.to_string();
        let (op, key, program, args): (Op, Resource, &std::path::Path, Vec<&str>) = match object {
            NetworkObject::Table => (
                Op::SandboxNftDelete,
                Resource::NftTable(table.clone()),
                &self.ctx.config.tools.nft,
                vec!["delete", "table", "inet", &table],
            ),
            NetworkObject::Address => (
                Op::SandboxAddressDelete,
                Resource::ProbeAddress(grant.vnet.clone()),
                &self.ctx.config.tools.ip,
                vec!["address", "del", &address, "dev", grant.vnet.as_str()],
            ),
        };
        let op = &op;
        if !self.present(grant, object).await? {
            self.ctx
                .journal_end_state(guard, op, &key, &EndState::AlreadyGone)
                .await?;
            return Ok(EndState::AlreadyGone);
        }
        guard
            .intent(self.ctx.now_ms(), op, &key, json!({ "argv": args }))
            .await?;
        let out = self.tool(program, &args).await?;
        if !out.success() || self.present(grant, object).await? {
            self.ctx
                .journal_tool_failed(guard, op, &key, &out, &[])
                .await?;
            return Err(ExecError::Failed(format!(
                "{} {} failed: {}",
                program.display(),
                args.join(" "),
                out.stderr_excerpt()
            )));
        }
        self.ctx
            .journal_end_state(guard, op, &key, &EndState::Deleted)
            .await?;
        Ok(EndState::Deleted)
    }

    pub(in crate::node) async fn address_present(&self, grant: &Grant) -> Result<bool, ExecError> {
        let seen = self
            .tool(
                &self.ctx.config.tools.ip,
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

    pub(in crate::node) async fn table_present(&self, grant: &Grant) -> Result<bool, ExecError> {
        let table = table_name(grant);
        let out = self
            .tool(
                &self.ctx.config.tools.nft,
                &["list", "table", "inet", &table],
            )
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
