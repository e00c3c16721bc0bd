//! A validation as the grant its node receives: probes on the wire, the grant read back as the
//! node reads it, and a grant's refusal named by the plan key that causes it.

use super::*;

/// A grant the node would refuse, with the validation it was built for.
pub(super) struct GrantRefused {
    pub(super) name: String,
    pub(super) error: GrantError,
}

/// Step three: the validation's grant, built from its resolved values and read back as its node
/// reads it. The run id and the validity window are placeholders until the run starts.
pub(super) fn granted(
    storage: &ResolvedStorage,
    resolved: ResolvedValidation,
    index: usize,
    now_unix: i64,
) -> Result<Validation, GrantRefused> {
    let v = &resolved;
    let wire = pb::RunGrant {
        version: grant::GRANT_VERSION,
        run_id: uuid::Uuid::new_v4().hyphenated().to_string(),
        node: v.node.value.clone(),
        not_before_unix: now_unix - NOT_BEFORE_SLACK_SECS,
        deadline_unix: now_unix.saturating_add(i64::from(v.timeouts.run_seconds.value)),
        repository: Some(storage.wire()),
        snapshot: format!("vm/{}/{}", v.source_vmid.value, v.snapshot.value),
        archives: v.archives.value.clone(),
        sandbox_vms: v
            .sandbox
            .iter()
            .map(|vm| pb::SandboxVm {
                vmid: vm.vmid.value.get(),
                max_cores: vm.cores.value,
                max_memory_mib: vm.memory_mib.value,
            })
            .collect(),
        vnet: v.network.vnet.value.clone(),
        probe_source: v.network.probe_source.value.clone(),
        probe_targets: v.probes.iter().map(wire_probe).collect(),
        qga_assertions: v
            .assertions
            .iter()
            .map(|a| pb::QgaAssertion {
                id: a.id.value.clone(),
                program: a.program.value.clone(),
                args: a.args.value.clone(),
                expect_exit_code: a.exit_code.value,
                expect_stdout_contains: a.stdout_contains.value.clone(),
                timeout_seconds: a.timeout_seconds.value,
            })
            .collect(),
        network_recovery_modes: vec![v.network_recovery.mode.value.wire() as i32],
        guest_address: v.network_recovery.guest_address.value.clone(),
    };
    let grant = as_the_node_reads_it(&wire).map_err(|error| GrantRefused {
        name: v.name.clone(),
        error,
    })?;
    Ok(Validation {
        index,
        name: v.name.clone(),
        source_vmid: v.source_vmid.value,
        endpoint: v.endpoint.value.clone(),
        wire,
        grant,
        run_seconds: v.timeouts.run_seconds.value,
        guest_agent_seconds: v.timeouts.guest_agent_seconds.value,
        network_lifecycle: v.network.lifecycle.value,
        network_recovery: v.network_recovery.mode.value,
        resolved,
    })
}

pub(super) fn wire_probe(probe: &ResolvedProbe) -> pb::ProbeTarget {
    let kind = match probe.kind.value {
        ProbeKind::Tcp => pb::ProbeKind::Tcp,
        ProbeKind::Http => pb::ProbeKind::Http,
        ProbeKind::Https => pb::ProbeKind::Https,
        ProbeKind::Dns => pb::ProbeKind::Dns,
        ProbeKind::Ldap => pb::ProbeKind::Ldap,
    };
    let e = &probe.expect;
    let dns_type = match e.dns_type.value {
        None => pb::DnsRecordType::Unspecified,
        Some(DnsType::A) => pb::DnsRecordType::A,
        Some(DnsType::Aaaa) => pb::DnsRecordType::Aaaa,
        Some(DnsType::Cname) => pb::DnsRecordType::Cname,
        Some(DnsType::Mx) => pb::DnsRecordType::Mx,
        Some(DnsType::Txt) => pb::DnsRecordType::Txt,
        Some(DnsType::Srv) => pb::DnsRecordType::Srv,
        Some(DnsType::Ptr) => pb::DnsRecordType::Ptr,
    };
    pb::ProbeTarget {
        kind: kind.into(),
        address: probe.address.value.clone(),
        port: u32::from(probe.port.value),
        expect: Some(pb::ProbeExpectation {
            banner_prefix: e.banner_prefix.value.clone(),
            http_path: e.http_path.value.clone(),
            http_status: u32::from(e.http_status.value),
            body_contains: e.body_contains.value.clone(),
            body_sha256: e.body_sha256.value.clone(),
            dns_name: e.dns_name.value.clone(),
            dns_type: dns_type.into(),
            dns_answers: e.dns_answers.value.clone(),
            ldap_naming_context: e.ldap_naming_context.value.clone(),
        }),
    }
}

/// Runs `wire` through the connector's verification exactly as a node does: signature, size,
/// unknown fields, every validator and every consistency rule. The key is thrown away; only the
/// parse matters here.
pub(super) fn as_the_node_reads_it(wire: &pb::RunGrant) -> Result<Grant, GrantError> {
    let key = ed25519_dalek::SigningKey::generate(&mut rand_core::OsRng);
    let signed = certistack_core::grant::sign(&key, wire);
    let parsed = grant::verify(&signed, &key.verifying_key())?;
    Ok(parsed)
}

/// The grant's wire field names, in the words of the plan.
pub(super) const PLAN_KEYS: &[(&str, &str)] = &[
    ("PbsRepository.server", "storage.server"),
    ("PbsRepository.port", "storage.port"),
    ("PbsRepository.datastore", "storage.datastore"),
    ("PbsRepository.namespace", "storage.namespace"),
    ("PbsRepository.auth_id", "storage.auth_id"),
    ("PbsRepository.fingerprint", "storage.fingerprint"),
    ("RunGrant.node", "node"),
    ("RunGrant.snapshot", "source_vmid and snapshot"),
    ("RunGrant.archives", "archives"),
    ("RunGrant.sandbox_vms", "sandbox"),
    ("SandboxVm.vmid", "sandbox[].vmid"),
    ("RunGrant.vnet", "network.vnet"),
    ("RunGrant.probe_source", "network.probe_source"),
    ("RunGrant.guest_address", "network_recovery.guest_address"),
    ("RunGrant.probe_targets", "probes"),
    ("ProbeTarget.kind", "probes[].kind"),
    ("ProbeTarget.address", "probes[].address"),
    ("ProbeTarget.port", "probes[].port"),
    ("RunGrant.qga_assertions", "assertions"),
    ("QgaAssertion.id", "assertions[].id"),
    ("QgaAssertion.program", "assertions[].program"),
    ("QgaAssertion.args", "assertions[].args"),
    (
        "QgaAssertion.expect_stdout_contains",
        "assertions[].stdout_contains",
    ),
];

pub(super) fn plan_key(wire_field: &str) -> String {
    if let Some((_, key)) = PLAN_KEYS.iter().find(|(wire, _)| *wire == wire_field) {
        return (*key).to_owned();
    }
    match wire_field.strip_prefix("ProbeExpectation.") {
        Some(rest) => format!("probes[].expect.{rest}"),
        None => wire_field.to_owned(),
    }
}

pub(super) fn grant_refusal(error: &GrantError) -> String {
    match error {
        GrantError::Field(field) => format!(
            "{}: {} (a node would refuse this grant)",
            plan_key(field.field),
            field.reason
        ),
        GrantError::Inconsistent(reason) => format!("{reason} (a node would refuse this grant)"),
        other => format!("a node would refuse this grant: {other}"),
    }
}
