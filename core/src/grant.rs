//! Run grants: what one run may touch on one node, until its deadline.
//!
//! A grant travels as the exact bytes of an encoded `RunGrant` plus an Ed25519 signature by the
//! controller's run-authority key over `certistack-run-grant-v1\0 || bytes`. The connector
//! verifies the signature against its pinned public key before decoding anything, then parses
//! every field with its validator into [`Grant`]. The run certificate carries SHA-256(bytes),
//! binding the TLS identity to exactly this grant.

use crate::net::IpNetwork;
use crate::validate::{
    self, ArchiveName, AssertionId, AuthId, Datastore, ExpectedText, Fingerprint, GuestArgument,
    GuestProgram, Host, HttpPath, IpInterface, Namespace, NodeName, RunId, Sha256Hex, Snapshot,
    UnicastIp, Validated, Vmid, VnetName, bounded_count, bytes_field, field,
};
use certistack_proto::GRANT_SIGNATURE_CONTEXT;
use certistack_proto::v1 as pb;
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use prost::Message;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};

pub const GRANT_VERSION: u32 = 1;
/// The surface message a signed grant's bytes encode.
const RUN_GRANT_MESSAGE: &str = ".certistack.connector.v1.RunGrant";
pub const MAX_GRANT_BYTES: usize = 32 * 1024;
/// The longest window a grant may span; a run that needs longer gets a new grant.
pub const MAX_GRANT_LIFETIME_SECS: i64 = 24 * 3600;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repository {
    pub server: Host,
    pub port: u16,
    pub datastore: Datastore,
    pub namespace: Namespace,
    pub auth_id: AuthId,
    pub fingerprint: Fingerprint,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmLimits {
    pub max_cores: u32,
    pub max_memory_mib: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ProbeKind {
    Tcp,
    Http,
    Https,
    Dns,
    Ldap,
}

impl ProbeKind {
    pub fn from_wire(field: &'static str, value: i32) -> Result<Self, validate::FieldError> {
        match pb::ProbeKind::try_from(value) {
            Ok(pb::ProbeKind::Tcp) => Ok(Self::Tcp),
            Ok(pb::ProbeKind::Http) => Ok(Self::Http),
            Ok(pb::ProbeKind::Https) => Ok(Self::Https),
            Ok(pb::ProbeKind::Dns) => Ok(Self::Dns),
            Ok(pb::ProbeKind::Ldap) => Ok(Self::Ldap),
            _ => Err(enum_error(field, "probe_kind", value)),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Http => "http",
            Self::Https => "https",
            Self::Dns => "dns",
            Self::Ldap => "ldap",
        }
    }
}

/// The error for a wire enum value outside the defined ones.
pub fn enum_error(
    field: &'static str,
    validator: &'static str,
    value: i32,
) -> validate::FieldError {
    validate::FieldError {
        field,
        validator,
        reason: format!("{value} is not one of the defined values (0 means unset)"),
    }
}

/// What guest network recovery does to the guest's own network configuration on the overlay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NetworkRecoveryMode {
    /// Nothing is written: the guest boots with its configuration as the backup has it.
    Preserve,
    /// The sandbox profile is written and the profiles fighting it for the NIC are disabled.
    Rewrite,
}

impl NetworkRecoveryMode {
    pub fn from_wire(field: &'static str, value: i32) -> Result<Self, validate::FieldError> {
        match pb::NetworkRecoveryMode::try_from(value) {
            Ok(pb::NetworkRecoveryMode::Preserve) => Ok(Self::Preserve),
            Ok(pb::NetworkRecoveryMode::Rewrite) => Ok(Self::Rewrite),
            _ => Err(enum_error(field, "network_recovery_mode", value)),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Preserve => "preserve",
            Self::Rewrite => "rewrite",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Expectation {
    pub banner_prefix: Option<ExpectedText>,
    pub http_path: Option<HttpPath>,
    pub http_status: Option<u16>,
    pub body_contains: Option<ExpectedText>,
    pub body_sha256: Option<Sha256Hex>,
    pub dns_name: Option<validate::DnsName>,
    pub dns_type: Option<pb::DnsRecordType>,
    pub dns_answers: Vec<ExpectedText>,
    pub ldap_naming_context: Option<ExpectedText>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeTarget {
    pub kind: ProbeKind,
    pub address: UnicastIp,
    pub port: u16,
    pub expect: Expectation,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QgaAssertion {
    pub program: GuestProgram,
    pub args: Vec<GuestArgument>,
    pub expect_exit_code: i32,
    pub expect_stdout_contains: Option<ExpectedText>,
    pub timeout_secs: u32,
}

/// A verified, fully validated run grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub run_id: RunId,
    pub node: NodeName,
    pub not_before_unix: i64,
    pub deadline_unix: i64,
    pub repository: Repository,
    pub snapshot: Snapshot,
    pub archives: BTreeSet<ArchiveName>,
    pub sandbox_vms: BTreeMap<Vmid, VmLimits>,
    pub vnet: VnetName,
    pub probe_source: IpInterface,
    pub probe_targets: Vec<ProbeTarget>,
    pub qga_assertions: BTreeMap<AssertionId, QgaAssertion>,
    /// The guest network recovery modes the run may use.
    pub network_recovery_modes: BTreeSet<NetworkRecoveryMode>,
    /// The sandbox NIC's address in a recovered guest: inside the probe network, not the probe
    /// source. Present whenever `Rewrite` is granted.
    pub guest_address: Option<IpInterface>,
    /// SHA-256 of the signed grant bytes; the run certificate must carry the same.
    pub digest: [u8; 32],
}

#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    #[error("the grant is missing from the request")]
    Missing,
    #[error(transparent)]
    Field(#[from] validate::FieldError),
    #[error(
        "the grant's signature does not verify against the pinned run-authority key; was it signed by this controller's run authority?"
    )]
    BadSignature,
    #[error("the grant cannot be decoded: {0}")]
    Decode(String),
    #[error(transparent)]
    UnknownField(#[from] crate::known_fields::UnknownFieldError),
    #[error("grant version {0} is not supported (this connector accepts {GRANT_VERSION})")]
    Version(u32),
    #[error("the grant is inconsistent: {0}")]
    Inconsistent(String),
}

pub fn digest(grant_bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(grant_bytes).into()
}

/// The message a run authority signs for `grant_bytes`.
pub fn signing_input(grant_bytes: &[u8]) -> Vec<u8> {
    [GRANT_SIGNATURE_CONTEXT, grant_bytes].concat()
}

/// Verifies the signature, then decodes and validates the grant. Time and node checks are the
/// caller's, because they depend on the node and the clock (see [`Grant::check_applicable`]).
pub fn verify(signed: &pb::SignedRunGrant, authority: &VerifyingKey) -> Result<Grant, GrantError> {
    let bytes = grant_bytes(signed)?;
    let signature = bytes_field(
        "SignedRunGrant.signature",
        "ed25519_signature",
        &signed.signature,
        64,
        64,
    )?;
    let signature = Signature::from_slice(signature).map_err(|_| GrantError::BadSignature)?;
    authority
        .verify_strict(&signing_input(bytes), &signature)
        .map_err(|_| GrantError::BadSignature)?;
    decode_checked(bytes)
}

/// Signs `grant` with the run authority's `key`, as [`verify`] checks it.
pub fn sign(key: &SigningKey, grant: &pb::RunGrant) -> pb::SignedRunGrant {
    let bytes = grant.encode_to_vec();
    let signature = key.sign(&signing_input(&bytes)).to_bytes().to_vec();
    pb::SignedRunGrant {
        grant: bytes,
        signature,
    }
}

/// [`sign`], then the grant's form checked exactly as [`verify`] checks it once the signature
/// holds: what the signer calls before it mints credentials, so it never mints for a grant a
/// node would refuse. The bytes decoded are the ones it has just signed, so the signature needs
/// no verifying; nothing else decodes a grant without [`verify`].
pub fn sign_checked(
    key: &SigningKey,
    grant: &pb::RunGrant,
) -> Result<(pb::SignedRunGrant, Grant), GrantError> {
    let signed = sign(key, grant);
    let checked = decode_checked(grant_bytes(&signed)?)?;
    Ok((signed, checked))
}

/// The signed grant's encoded bytes, within their bounds.
fn grant_bytes(signed: &pb::SignedRunGrant) -> Result<&[u8], GrantError> {
    bytes_field(
        "SignedRunGrant.grant",
        "encoded_grant",
        &signed.grant,
        1,
        MAX_GRANT_BYTES,
    )
    .map_err(GrantError::from)
}

fn decode_checked(bytes: &[u8]) -> Result<Grant, GrantError> {
    crate::known_fields::check(RUN_GRANT_MESSAGE, bytes)?;
    let wire = pb::RunGrant::decode(bytes).map_err(|e| GrantError::Decode(e.to_string()))?;
    parse(&wire, digest(bytes))
}

fn opt<T: Validated>(name: &'static str, value: &str) -> Result<Option<T>, validate::FieldError> {
    if value.is_empty() {
        Ok(None)
    } else {
        field(name, value).map(Some)
    }
}

fn parse(wire: &pb::RunGrant, digest: [u8; 32]) -> Result<Grant, GrantError> {
    if wire.version != GRANT_VERSION {
        return Err(GrantError::Version(wire.version));
    }
    let inconsistent = |s: String| GrantError::Inconsistent(s);
    let run_id = field("RunGrant.run_id", &wire.run_id)?;
    let node = field("RunGrant.node", &wire.node)?;
    if wire.deadline_unix <= wire.not_before_unix {
        return Err(inconsistent("the deadline is not after not_before".into()));
    }
    // Both ends come from the wire: the span of i64::MIN..i64::MAX does not fit an i64.
    match wire.deadline_unix.checked_sub(wire.not_before_unix) {
        Some(span) if span <= MAX_GRANT_LIFETIME_SECS => {}
        _ => {
            return Err(inconsistent(format!(
                "the grant spans more than {MAX_GRANT_LIFETIME_SECS} s"
            )));
        }
    }
    let repo = wire
        .repository
        .as_ref()
        .ok_or_else(|| inconsistent("the PBS repository is missing".into()))?;
    let repository = Repository {
        server: field("PbsRepository.server", &repo.server)?,
        port: validate::port("PbsRepository.port", repo.port)?,
        datastore: field("PbsRepository.datastore", &repo.datastore)?,
        namespace: field("PbsRepository.namespace", &repo.namespace)?,
        auth_id: field("PbsRepository.auth_id", &repo.auth_id)?,
        fingerprint: field("PbsRepository.fingerprint", &repo.fingerprint)?,
    };
    let snapshot = field("RunGrant.snapshot", &wire.snapshot)?;

    bounded_count("RunGrant.archives", &wire.archives, 16)?;
    let mut archives = BTreeSet::new();
    for archive in &wire.archives {
        if !archives.insert(field::<ArchiveName>("RunGrant.archives", archive)?) {
            return Err(inconsistent(format!("archive {archive:?} is listed twice")));
        }
    }
    if archives.is_empty() {
        return Err(inconsistent("the grant names no archive".into()));
    }

    bounded_count("RunGrant.sandbox_vms", &wire.sandbox_vms, 8)?;
    let mut sandbox_vms = BTreeMap::new();
    for vm in &wire.sandbox_vms {
        let vmid = Vmid::parse("SandboxVm.vmid", vm.vmid)?;
        if !(1..=64).contains(&vm.max_cores) || !(64..=262_144).contains(&vm.max_memory_mib) {
            return Err(inconsistent(format!(
                "VM {vmid}: max_cores must be 1..=64 and max_memory_mib 64..=262144, got {} and {}",
                vm.max_cores, vm.max_memory_mib
            )));
        }
        let limits = VmLimits {
            max_cores: vm.max_cores,
            max_memory_mib: vm.max_memory_mib,
        };
        if sandbox_vms.insert(vmid, limits).is_some() {
            return Err(inconsistent(format!("VMID {vmid} is listed twice")));
        }
    }
    if sandbox_vms.is_empty() {
        return Err(inconsistent("the grant names no sandbox VM".into()));
    }

    let vnet = field("RunGrant.vnet", &wire.vnet)?;
    let probe_source: IpInterface = field("RunGrant.probe_source", &wire.probe_source)?;

    bounded_count("RunGrant.probe_targets", &wire.probe_targets, 64)?;
    let mut probe_targets = Vec::new();
    let mut seen_targets = BTreeSet::new();
    for target in &wire.probe_targets {
        let parsed = parse_target(target)?;
        if !IpNetwork::of(&probe_source).contains(parsed.address.0) {
            return Err(inconsistent(format!(
                "probe target {} is outside the probe network {probe_source}: probes leave only through the sandbox VNet",
                parsed.address
            )));
        }
        if parsed.address == probe_source.address {
            return Err(inconsistent(format!(
                "probe target {} is the probe source itself",
                parsed.address
            )));
        }
        if !seen_targets.insert((parsed.kind, parsed.address, parsed.port)) {
            return Err(inconsistent(format!(
                "probe target {} {}:{} is listed twice",
                parsed.kind.name(),
                parsed.address,
                parsed.port
            )));
        }
        probe_targets.push(parsed);
    }

    bounded_count("RunGrant.qga_assertions", &wire.qga_assertions, 32)?;
    let mut qga_assertions = BTreeMap::new();
    for assertion in &wire.qga_assertions {
        let id: AssertionId = field("QgaAssertion.id", &assertion.id)?;
        bounded_count("QgaAssertion.args", &assertion.args, 32)?;
        let parsed = QgaAssertion {
            program: field("QgaAssertion.program", &assertion.program)?,
            args: assertion
                .args
                .iter()
                .map(|a| field("QgaAssertion.args", a))
                .collect::<Result<_, _>>()?,
            expect_exit_code: assertion.expect_exit_code,
            expect_stdout_contains: opt(
                "QgaAssertion.expect_stdout_contains",
                &assertion.expect_stdout_contains,
            )?,
            timeout_secs: match assertion.timeout_seconds {
                t @ 1..=600 => t,
                t => {
                    return Err(inconsistent(format!(
                        "assertion {id}: timeout_seconds {t} must be 1..=600"
                    )));
                }
            },
        };
        if qga_assertions.insert(id.clone(), parsed).is_some() {
            return Err(inconsistent(format!("assertion {id} is listed twice")));
        }
    }

    bounded_count(
        "RunGrant.network_recovery_modes",
        &wire.network_recovery_modes,
        2,
    )?;
    let mut network_recovery_modes = BTreeSet::new();
    for mode in &wire.network_recovery_modes {
        let mode = NetworkRecoveryMode::from_wire("RunGrant.network_recovery_modes", *mode)?;
        if !network_recovery_modes.insert(mode) {
            return Err(inconsistent(format!(
                "network recovery mode {} is listed twice",
                mode.name()
            )));
        }
    }
    let guest_address: Option<IpInterface> = opt("RunGrant.guest_address", &wire.guest_address)?;
    if let Some(guest) = &guest_address {
        let probe_network = IpNetwork::of(&probe_source);
        if IpNetwork::of(guest) != probe_network {
            return Err(inconsistent(format!(
                "the guest address {guest} is not in the probe network {probe_network}: the sandbox NIC must be reachable from the probe source without a gateway"
            )));
        }
        if guest.address == probe_source.address {
            return Err(inconsistent(format!(
                "the guest address {guest} is the probe source itself"
            )));
        }
    } else if network_recovery_modes.contains(&NetworkRecoveryMode::Rewrite) {
        return Err(inconsistent(
            "the grant allows network recovery mode rewrite but names no guest_address".into(),
        ));
    }

    Ok(Grant {
        run_id,
        node,
        not_before_unix: wire.not_before_unix,
        deadline_unix: wire.deadline_unix,
        repository,
        snapshot,
        archives,
        sandbox_vms,
        vnet,
        probe_source,
        probe_targets,
        qga_assertions,
        network_recovery_modes,
        guest_address,
        digest,
    })
}

fn parse_target(target: &pb::ProbeTarget) -> Result<ProbeTarget, GrantError> {
    let kind = ProbeKind::from_wire("ProbeTarget.kind", target.kind)?;
    let default_expect = pb::ProbeExpectation::default();
    let e = target.expect.as_ref().unwrap_or(&default_expect);
    bounded_count("ProbeExpectation.dns_answers", &e.dns_answers, 32)?;
    let expect = Expectation {
        banner_prefix: opt("ProbeExpectation.banner_prefix", &e.banner_prefix)?,
        http_path: opt("ProbeExpectation.http_path", &e.http_path)?,
        http_status: match e.http_status {
            0 => None,
            s @ 100..=599 => u16::try_from(s).ok(),
            s => {
                return Err(validate::FieldError {
                    field: "ProbeExpectation.http_status",
                    validator: "http_status",
                    reason: format!("{s} is not an HTTP status (100..=599)"),
                }
                .into());
            }
        },
        body_contains: opt("ProbeExpectation.body_contains", &e.body_contains)?,
        body_sha256: opt("ProbeExpectation.body_sha256", &e.body_sha256)?,
        dns_name: opt("ProbeExpectation.dns_name", &e.dns_name)?,
        dns_type: match pb::DnsRecordType::try_from(e.dns_type) {
            Ok(pb::DnsRecordType::Unspecified) => None,
            Ok(t) => Some(t),
            Err(_) => {
                return Err(
                    enum_error("ProbeExpectation.dns_type", "dns_record_type", e.dns_type).into(),
                );
            }
        },
        dns_answers: e
            .dns_answers
            .iter()
            .map(|a| field("ProbeExpectation.dns_answers", a))
            .collect::<Result<_, _>>()?,
        ldap_naming_context: opt(
            "ProbeExpectation.ldap_naming_context",
            &e.ldap_naming_context,
        )?,
    };
    Ok(ProbeTarget {
        kind,
        address: field("ProbeTarget.address", &target.address)?,
        port: validate::port("ProbeTarget.port", target.port)?,
        expect,
    })
}

/// Why a verified grant does not apply here and now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrantScopeError {
    #[error("the grant is for node {granted}, this is node {local}")]
    OtherNode { granted: String, local: String },
    #[error("the grant is not valid before {not_before} (node time {now}); check the clocks")]
    NotYetValid { not_before: i64, now: i64 },
    #[error("the grant's deadline {deadline} has passed (node time {now})")]
    Expired { deadline: i64, now: i64 },
}

impl Grant {
    pub fn check_applicable(&self, local: &NodeName, now_unix: i64) -> Result<(), GrantScopeError> {
        if &self.node != local {
            return Err(GrantScopeError::OtherNode {
                granted: self.node.to_string(),
                local: local.to_string(),
            });
        }
        if now_unix < self.not_before_unix {
            return Err(GrantScopeError::NotYetValid {
                not_before: self.not_before_unix,
                now: now_unix,
            });
        }
        if now_unix >= self.deadline_unix {
            return Err(GrantScopeError::Expired {
                deadline: self.deadline_unix,
                now: now_unix,
            });
        }
        Ok(())
    }

    /// Refuses a probe network wider than this node allows: its connected route could beat a
    /// route the node depends on (a `/1` beats the default route). `min_ipv4_prefix` is
    /// `limits.min_probe_prefix`; IPv6 networks must be [`crate::net::IPV6_PREFIX_OFFSET`]
    /// bits longer.
    pub fn check_probe_prefix(&self, min_ipv4_prefix: u8) -> Result<(), String> {
        let shortest =
            crate::net::min_probe_prefix_len(self.probe_source.address.0, min_ipv4_prefix);
        if self.probe_source.prefix_len < shortest {
            return Err(format!(
                "the probe network {} is wider than this node allows (prefix at least /{shortest}, limits.min_probe_prefix): its route could take over the node's own traffic; grant a narrower probe network",
                IpNetwork::of(&self.probe_source)
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::{Signer, SigningKey};

    use crate::fixtures::{RUN, full_wire_grant, sign};

    #[test]
    fn verifies_and_parses_a_full_grant() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let signed = sign(&key, &full_wire_grant());
        let grant = verify(&signed, &key.verifying_key()).unwrap();
        assert_eq!(grant.run_id.as_str(), RUN);
        assert_eq!(grant.archives.len(), 2);
        assert_eq!(grant.digest, digest(&signed.grant));
        assert_eq!(grant.qga_assertions.len(), 1);
    }

    #[test]
    fn the_signer_s_check_holds_a_grant_to_the_form_verify_holds_it_to() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let (signed, checked) = sign_checked(&key, &full_wire_grant()).unwrap();
        assert_eq!(signed, sign(&key, &full_wire_grant()));
        assert_eq!(checked, verify(&signed, &key.verifying_key()).unwrap());
        let mut wire = full_wire_grant();
        wire.version += 1;
        assert_eq!(
            sign_checked(&key, &wire).unwrap_err().to_string(),
            verify(&sign(&key, &wire), &key.verifying_key())
                .unwrap_err()
                .to_string()
        );
    }

    #[test]
    fn refuses_other_keys_and_tampering() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let other = SigningKey::from_bytes(&[2; 32]);
        let signed = sign(&other, &full_wire_grant());
        assert!(matches!(
            verify(&signed, &key.verifying_key()),
            Err(GrantError::BadSignature)
        ));
        let mut tampered = sign(&key, &full_wire_grant());
        if let Some(last) = tampered.grant.last_mut() {
            *last ^= 1;
        }
        assert!(matches!(
            verify(&tampered, &key.verifying_key()),
            Err(GrantError::BadSignature)
        ));
        // A signature without the domain prefix is not a grant signature.
        let mut raw = sign(&key, &full_wire_grant());
        raw.signature = key.sign(&raw.grant).to_bytes().to_vec();
        assert!(matches!(
            verify(&raw, &key.verifying_key()),
            Err(GrantError::BadSignature)
        ));
    }

    #[test]
    fn refuses_inconsistent_grants() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let check = |edit: &dyn Fn(&mut pb::RunGrant)| {
            let mut wire = full_wire_grant();
            edit(&mut wire);
            verify(&sign(&key, &wire), &key.verifying_key())
        };
        assert!(matches!(
            check(&|g| g.version = 2),
            Err(GrantError::Version(2))
        ));
        assert!(matches!(
            check(&|g| g.deadline_unix = g.not_before_unix),
            Err(GrantError::Inconsistent(_))
        ));
        assert!(matches!(
            check(&|g| g.deadline_unix = g.not_before_unix + 90_000),
            Err(GrantError::Inconsistent(_))
        ));
        // A span that does not fit an i64 is refused, not wrapped into a short one.
        assert!(matches!(
            check(&|g| {
                g.not_before_unix = i64::MIN;
                g.deadline_unix = i64::MAX;
            }),
            Err(GrantError::Inconsistent(m)) if m.contains("spans more than")
        ));
        assert!(matches!(
            check(&|g| {
                g.not_before_unix = -1;
                g.deadline_unix = i64::MAX;
            }),
            Err(GrantError::Inconsistent(m)) if m.contains("spans more than")
        ));
        assert!(matches!(
            check(&|g| g.snapshot = "vm/100".into()),
            Err(GrantError::Field(_))
        ));
        assert!(matches!(
            check(&|g| g.archives.push("drive-scsi0.img".into())),
            Err(GrantError::Inconsistent(_))
        ));
        assert!(matches!(
            check(&|g| g.archives.clear()),
            Err(GrantError::Inconsistent(_))
        ));
        assert!(matches!(
            check(&|g| g.sandbox_vms[0].vmid = 0),
            Err(GrantError::Field(_))
        ));
        assert!(matches!(
            check(&|g| g.sandbox_vms[0].max_cores = 0),
            Err(GrantError::Inconsistent(_))
        ));
        assert!(matches!(
            check(&|g| g.probe_targets[0].address = "198.51.100.2".into()),
            Err(GrantError::Inconsistent(_))
        ));
        // A target outside the probe network would be probed through another interface.
        assert!(matches!(
            check(&|g| g.probe_targets[0].address = "192.0.2.10".into()),
            Err(GrantError::Inconsistent(m)) if m.contains("outside the probe network")
        ));
        assert!(matches!(
            check(&|g| g.probe_targets[0].kind = 0),
            Err(GrantError::Field(_))
        ));
        assert!(matches!(
            check(&|g| g.qga_assertions[0].timeout_seconds = 0),
            Err(GrantError::Inconsistent(_))
        ));
        assert!(matches!(
            check(&|g| g.repository = None),
            Err(GrantError::Inconsistent(_))
        ));
    }

    #[test]
    fn the_guest_address_is_inside_the_probe_network_and_not_the_probe_source() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let check = |edit: &dyn Fn(&mut pb::RunGrant)| {
            let mut wire = full_wire_grant();
            edit(&mut wire);
            verify(&sign(&key, &wire), &key.verifying_key())
        };
        let granted = check(&|_| {}).unwrap();
        assert_eq!(
            granted.network_recovery_modes,
            BTreeSet::from([NetworkRecoveryMode::Rewrite])
        );
        assert_eq!(
            granted.guest_address.map(|a| a.to_string()).as_deref(),
            Some("198.51.100.10/24")
        );
        assert!(matches!(
            check(&|g| g.guest_address = "192.0.2.10/24".into()),
            Err(GrantError::Inconsistent(m)) if m.contains("not in the probe network")
        ));
        assert!(matches!(
            check(&|g| g.guest_address = "198.51.100.10/25".into()),
            Err(GrantError::Inconsistent(m)) if m.contains("not in the probe network")
        ));
        assert!(matches!(
            check(&|g| g.guest_address = "198.51.100.2/24".into()),
            Err(GrantError::Inconsistent(m)) if m.contains("probe source itself")
        ));
        assert!(matches!(
            check(&|g| g.guest_address.clear()),
            Err(GrantError::Inconsistent(m)) if m.contains("names no guest_address")
        ));
        assert!(
            check(&|g| {
                g.guest_address.clear();
                g.network_recovery_modes = vec![pb::NetworkRecoveryMode::Preserve as i32];
            })
            .is_ok()
        );
        assert!(matches!(
            check(&|g| g.network_recovery_modes.push(pb::NetworkRecoveryMode::Rewrite as i32)),
            Err(GrantError::Inconsistent(m)) if m.contains("listed twice")
        ));
        assert!(matches!(
            check(&|g| g.network_recovery_modes = vec![0]),
            Err(GrantError::Field(_))
        ));
    }

    #[test]
    fn probe_prefix_minimum() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let mut wire = full_wire_grant();
        let grant = verify(&sign(&key, &wire), &key.verifying_key()).unwrap();
        assert_eq!(grant.check_probe_prefix(24), Ok(()));
        assert!(
            grant
                .check_probe_prefix(25)
                .unwrap_err()
                .contains("prefix at least /25"),
            "a /24 is refused under a /25 minimum"
        );
        wire.probe_source = "128.0.0.2/1".into();
        wire.probe_targets.clear();
        wire.network_recovery_modes.clear();
        wire.guest_address.clear();
        let wide = verify(&sign(&key, &wire), &key.verifying_key()).unwrap();
        assert!(
            wide.check_probe_prefix(24)
                .unwrap_err()
                .contains("128.0.0.0/1")
        );
        wire.probe_source = "2001:db8::2/64".into();
        let v6 = verify(&sign(&key, &wire), &key.verifying_key()).unwrap();
        assert!(v6.check_probe_prefix(24).unwrap_err().contains("/120"));
        wire.probe_source = "2001:db8::2/120".into();
        let v6 = verify(&sign(&key, &wire), &key.verifying_key()).unwrap();
        assert_eq!(v6.check_probe_prefix(24), Ok(()));
    }

    #[test]
    fn a_signed_field_this_connector_does_not_know_is_refused() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let mut grant = full_wire_grant().encode_to_vec();
        // Field 16 of RunGrant, length-delimited: what a newer controller's restriction
        // (say, "no probes before 06:00") would look like to this connector.
        // The key (16 << 3 | 2 = 130) is a two-byte varint.
        grant.extend([0x82, 0x01, 3, b'x', b'y', b'z']);
        let signature = key.sign(&signing_input(&grant)).to_bytes().to_vec();
        let signed = pb::SignedRunGrant { grant, signature };
        // prost alone would accept it and drop the field.
        assert!(pb::RunGrant::decode(signed.grant.as_slice()).is_ok());
        let error = verify(&signed, &key.verifying_key()).unwrap_err();
        assert!(
            matches!(error, GrantError::UnknownField(_))
                && error.to_string().contains("field number 16"),
            "{error}"
        );
    }

    #[test]
    fn applicability() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let grant = verify(&sign(&key, &full_wire_grant()), &key.verifying_key()).unwrap();
        let pve1 = NodeName::validate("pve1").unwrap();
        let pve2 = NodeName::validate("pve2").unwrap();
        assert_eq!(grant.check_applicable(&pve1, 2_000), Ok(()));
        assert!(matches!(
            grant.check_applicable(&pve2, 2_000),
            Err(GrantScopeError::OtherNode { .. })
        ));
        assert!(matches!(
            grant.check_applicable(&pve1, 999),
            Err(GrantScopeError::NotYetValid { .. })
        ));
        assert!(matches!(
            grant.check_applicable(&pve1, 4_600),
            Err(GrantScopeError::Expired { .. })
        ));
    }
}
