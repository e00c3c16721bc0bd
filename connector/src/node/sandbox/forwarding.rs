//! Forwarding on the VNet under `sandbox.forwarding = "disable-for-run"`: turned off for the
//! run with the previous values journaled, restored at release or cleanup.

use super::Sandbox;
use super::observation::Observation;
use crate::executor::ExecError;
use crate::resources;
use crate::resources::EndState;
use crate::runs::RunGuard;
use certistack_core::grant::Grant;
use certistack_core::journal::Op;
use certistack_core::journal::Resource;
use certistack_core::validate::VnetName;
use serde_json::json;

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

impl Sandbox<'_> {
    /// Turns forwarding off on the VNet for the run, for each family where it is on: journals
    /// the previous values (`sandbox.forwarding` intent on `fwd:<vnet>`), writes 0, re-reads.
    /// Returns the families it turned off.
    pub(super) async fn disable_forwarding(
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
        let key = Resource::Forwarding(vnet.clone());
        let previous: serde_json::Map<String, serde_json::Value> = on
            .iter()
            .map(|(family, value)| ((*family).to_owned(), json!(value)))
            .collect();
        guard
            .intent(
                self.ctx.now_ms(),
                &Op::SandboxForwarding,
                &key,
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
                .failed(
                    self.ctx.now_ms(),
                    &Op::SandboxForwarding,
                    &key,
                    json!({ "previous": previous, "error": error }),
                )
                .await?;
            return Err(ExecError::Failed(error));
        }
        guard
            .done(
                self.ctx.now_ms(),
                &Op::SandboxForwarding,
                &key,
                json!({ "previous": previous, "set": "0" }),
            )
            .await?;
        Ok(on.into_iter().map(|(family, _)| family).collect())
    }

    /// Puts back the forwarding values the run changed, when the run's `fwd:<vnet>` resource is
    /// open. A value is written back only while it is still the 0 this run set: a VNet gone, or
    /// a value already back, is `already gone`; a value someone else changed since is left as
    /// it is (`not this run's`). `None` when the run changed nothing.
    pub(in crate::node) async fn restore_forwarding(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
    ) -> Result<Option<EndState>, ExecError> {
        let resource = Resource::Forwarding(grant.vnet.clone());
        let Some(state) = resources::state_of(&guard.records(), &resource).filter(|s| s.is_open())
        else {
            return Ok(None);
        };
        let key = resource.clone();
        let previous = journaled_previous(&state);
        guard
            .intent(
                self.ctx.now_ms(),
                &Op::SandboxForwardingRestore,
                &key,
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
                .failed(
                    self.ctx.now_ms(),
                    &Op::SandboxForwardingRestore,
                    &key,
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
            .undone(
                self.ctx.now_ms(),
                &Op::SandboxForwardingRestore,
                &key,
                json!({ "end_state": end.wire(), "values": outcomes }),
            )
            .await?;
        Ok(Some(end))
    }
}
