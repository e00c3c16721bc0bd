//! `Probe` on the node: the run's checks, the probes of the granted targets, the journal
//! records.

use super::{ProbeBounds, probe_target};
use crate::executor::{ExecError, Outcome};
use crate::node::context::NodeContext;
use crate::resources::{self, Standing};
use crate::runs::RunHandle;
use certistack_core::grant::ProbeKind;
use certistack_core::journal::Op;
use certistack_core::journal::Resource;
use certistack_core::validate::UnicastIp;
use certistack_proto::v1 as pb;
use serde_json::json;
use std::time::Duration;

/// The executor of probes: checks that the run's probe address and containment table are in
/// place, then connects from the probe address to a granted target and journals what it saw.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Probes<'a> {
    ctx: &'a NodeContext,
}

impl NodeContext {
    pub(in crate::node) fn probes(&self) -> Probes<'_> {
        Probes { ctx: self }
    }
}

impl Probes<'_> {
    pub(in crate::node) async fn probe(
        &self,
        run: &RunHandle,
        kind: ProbeKind,
        address: UnicastIp,
        port: u16,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.ctx.lock_open(run).await?;
        let target = grant
            .probe_targets
            .iter()
            .find(|t| t.kind == kind && t.address == address && t.port == port)
            .ok_or_else(|| {
                ExecError::FailedPrecondition(format!(
                    "{address}:{port} is not a probe target of this run"
                ))
            })?;
        let source = grant.probe_source.address.0;
        let resource = Resource::Probe {
            kind,
            address: address.0,
            port,
        };
        let address_added = resources::state_of(
            &guard.records(),
            &Resource::ProbeAddress(grant.vnet.clone()),
        )
        .is_some_and(|s| s.is_open() && s.standing() == Standing::Done);
        let address_present = self.ctx.sandbox().address_present(grant).await?;
        if address_added && !address_present {
            // ifupdown2's `ifreload -a` (every SDN "Apply" runs it) purges addresses it did not
            // configure: the node took the address, the guest and the backup did nothing wrong.
            let error = format!(
                "probe address removed by the node (ifreload?): {} is no longer on {} although this run added it; the probe did not run. This is a failure of the node's network, not of the backup: release or clean up the sandbox and prepare it again",
                grant.probe_source, grant.vnet
            );
            guard
                .failed(
                    self.ctx.now_ms(),
                    &Op::ProbeRun,
                    &resource,
                    json!({ "source": source.to_string(), "error": error, "infrastructure": true }),
                )
                .await?;
            return Err(ExecError::Unavailable(
                pb::ErrorReason::ProbeAddressRemoved,
                error,
            ));
        }
        if !address_present || !self.ctx.sandbox().table_present(grant).await? {
            return Err(ExecError::FailedPrecondition(format!(
                "the probe address {} or the run's containment table is not on {}; call PrepareSandbox first",
                grant.probe_source, grant.vnet
            )));
        }
        guard
            .intent(
                self.ctx.now_ms(),
                &Op::ProbeRun,
                &resource,
                json!({ "source": source.to_string() }),
            )
            .await?;
        let bounds = ProbeBounds {
            device: grant.vnet.to_string(),
            timeout: Duration::from_secs(self.ctx.config.limits.probe_timeout_secs),
            max_bytes: self.ctx.config.limits.max_probe_response_bytes,
            max_entries: self.ctx.config.limits.max_probe_entries,
        };
        let result = probe_target(source, target, &bounds).await;
        guard
            .done(
                self.ctx.now_ms(),
                &Op::ProbeRun,
                &resource,
                json!({
                    "passed": result.passed,
                    "detail": result.detail,
                    "latency_us": result.latency.as_micros() as u64,
                    "received_sha256": result.received_sha256,
                    "tls_certificate_sha256": result.tls_certificate_sha256,
                }),
            )
            .await?;
        Ok(Outcome::Probe(pb::ProbeReply {
            outcome: if result.passed {
                pb::ProbeOutcome::Passed
            } else {
                pb::ProbeOutcome::Failed
            } as i32,
            detail: result.detail,
            origin: format!("worker_host {source}"),
            latency_us: result.latency.as_micros() as u64,
            received_sha256: result.received_sha256,
            tls_certificate_sha256: result.tls_certificate_sha256,
            journal_head: guard.head_hex(),
        }))
    }
}
