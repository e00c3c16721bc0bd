//! The reviewed RPC surface policy (`policy/rpc-surface.toml`), compiled in.
//!
//! For each RPC it names the group, the identities that may call it and the grant rule that
//! authorizes it. The identity gate reads this data at run time; tests check that it agrees with
//! the proto (every method has exactly one entry) and with the code (each action's rule name).

use certistack_core::identity::{ClientIdentity, IdentityKind};
use std::collections::BTreeMap;

pub const RPC_SURFACE_TOML: &str = include_str!("../../policy/rpc-surface.toml");

/// Every RPC of the surface; `name()` is the proto method name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rpc {
    Hello,
    BeginRun,
    EndRun,
    MapBackup,
    UnmapBackup,
    CreateOverlay,
    DeleteOverlay,
    CreateVm,
    StartVm,
    StopVm,
    DestroyVm,
    VmStatus,
    Qmp,
    Qga,
    PrepareSandbox,
    ReleaseSandbox,
    Probe,
    ReadJournal,
    ListRuns,
    Cleanup,
    NodeChecks,
    ReadSourceConfig,
    RecoverGuestNetwork,
}

impl Rpc {
    pub const ALL: [Rpc; 23] = [
        Rpc::Hello,
        Rpc::BeginRun,
        Rpc::EndRun,
        Rpc::MapBackup,
        Rpc::UnmapBackup,
        Rpc::CreateOverlay,
        Rpc::DeleteOverlay,
        Rpc::CreateVm,
        Rpc::StartVm,
        Rpc::StopVm,
        Rpc::DestroyVm,
        Rpc::VmStatus,
        Rpc::Qmp,
        Rpc::Qga,
        Rpc::PrepareSandbox,
        Rpc::ReleaseSandbox,
        Rpc::Probe,
        Rpc::ReadJournal,
        Rpc::ListRuns,
        Rpc::Cleanup,
        Rpc::NodeChecks,
        Rpc::ReadSourceConfig,
        Rpc::RecoverGuestNetwork,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Rpc::Hello => "Hello",
            Rpc::BeginRun => "BeginRun",
            Rpc::EndRun => "EndRun",
            Rpc::MapBackup => "MapBackup",
            Rpc::UnmapBackup => "UnmapBackup",
            Rpc::CreateOverlay => "CreateOverlay",
            Rpc::DeleteOverlay => "DeleteOverlay",
            Rpc::CreateVm => "CreateVm",
            Rpc::StartVm => "StartVm",
            Rpc::StopVm => "StopVm",
            Rpc::DestroyVm => "DestroyVm",
            Rpc::VmStatus => "VmStatus",
            Rpc::Qmp => "Qmp",
            Rpc::Qga => "Qga",
            Rpc::PrepareSandbox => "PrepareSandbox",
            Rpc::ReleaseSandbox => "ReleaseSandbox",
            Rpc::Probe => "Probe",
            Rpc::ReadJournal => "ReadJournal",
            Rpc::ListRuns => "ListRuns",
            Rpc::Cleanup => "Cleanup",
            Rpc::NodeChecks => "NodeChecks",
            Rpc::ReadSourceConfig => "ReadSourceConfig",
            Rpc::RecoverGuestNetwork => "RecoverGuestNetwork",
        }
    }

    /// The rule the connector applies to this RPC; the policy file must state the same.
    pub fn rule(self) -> &'static str {
        match self {
            Rpc::Hello => "authenticated",
            Rpc::BeginRun => "grant-matches-certificate",
            Rpc::EndRun => "own-open-run",
            Rpc::MapBackup | Rpc::UnmapBackup => "backup-in-grant",
            Rpc::ReadSourceConfig => "snapshot-in-grant",
            Rpc::CreateOverlay | Rpc::DeleteOverlay => "overlay-in-grant",
            Rpc::CreateVm => "vm-within-grant-limits",
            Rpc::StartVm | Rpc::StopVm | Rpc::DestroyVm | Rpc::VmStatus | Rpc::Qmp => {
                "vmid-in-grant"
            }
            Rpc::Qga => "qga-call-in-grant",
            Rpc::PrepareSandbox => "sandbox-matches-grant",
            Rpc::ReleaseSandbox => "vnet-in-grant",
            Rpc::Probe => "probe-target-in-grant",
            Rpc::ReadJournal | Rpc::Cleanup => "own-run-or-operator",
            Rpc::ListRuns | Rpc::NodeChecks => "operator-only",
            Rpc::RecoverGuestNetwork => "guest-network-in-grant",
        }
    }
}

#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RpcEntry {
    pub name: String,
    pub group: String,
    pub callers: Vec<IdentityKind>,
    pub rule: String,
    pub why: String,
}

#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SurfacePolicy {
    pub rpc: Vec<RpcEntry>,
}

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("policy/rpc-surface.toml does not parse: {0}")]
    Parse(#[from] toml::de::Error),
    #[error("policy/rpc-surface.toml: {0}")]
    Inconsistent(String),
}

/// The identity gate built from the policy: which identity kinds may call which RPC, and how
/// long an operator certificate may be valid (`limits.max_operator_cert_secs`).
#[derive(Debug, Clone)]
pub struct Gate {
    callers: BTreeMap<Rpc, Vec<IdentityKind>>,
    max_operator_cert_secs: u64,
}

impl SurfacePolicy {
    pub fn compiled() -> Result<Self, PolicyError> {
        Ok(toml::from_str(RPC_SURFACE_TOML)?)
    }

    /// Builds the gate, refusing a policy that misses an RPC, names an unknown one, lists one
    /// twice, or states a rule other than the one the code applies.
    pub fn gate(&self) -> Result<Gate, PolicyError> {
        let mut callers = BTreeMap::new();
        for entry in &self.rpc {
            let rpc = Rpc::ALL
                .into_iter()
                .find(|r| r.name() == entry.name)
                .ok_or_else(|| {
                    PolicyError::Inconsistent(format!("unknown RPC {:?}", entry.name))
                })?;
            if entry.rule != rpc.rule() {
                return Err(PolicyError::Inconsistent(format!(
                    "{} states rule {:?}, the connector applies {:?}",
                    entry.name,
                    entry.rule,
                    rpc.rule()
                )));
            }
            if entry.why.trim().is_empty() || entry.callers.is_empty() {
                return Err(PolicyError::Inconsistent(format!(
                    "{} needs callers and a reason",
                    entry.name
                )));
            }
            if callers.insert(rpc, entry.callers.clone()).is_some() {
                return Err(PolicyError::Inconsistent(format!(
                    "{} is listed twice",
                    entry.name
                )));
            }
        }
        if let Some(missing) = Rpc::ALL.into_iter().find(|r| !callers.contains_key(r)) {
            return Err(PolicyError::Inconsistent(format!(
                "{} has no entry",
                missing.name()
            )));
        }
        Ok(Gate {
            callers,
            max_operator_cert_secs: crate::config::Limits::default().max_operator_cert_secs,
        })
    }
}

impl Gate {
    /// Operator certificates valid longer than `secs` (from `not_before` to `not_after`) are
    /// refused, however much of that validity is left.
    pub fn with_max_operator_cert_secs(mut self, secs: u64) -> Self {
        self.max_operator_cert_secs = secs;
        self
    }

    /// Refuses a certificate the node must not accept whatever it calls: an operator
    /// certificate valid longer than the limit. Operator certificates cannot be revoked, so
    /// only a short life bounds what a leaked one is worth.
    pub fn admits(&self, client: &ClientIdentity) -> Result<(), String> {
        if client.identity.kind() != IdentityKind::Operator {
            return Ok(());
        }
        let span = client
            .not_after_unix
            .checked_sub(client.not_before_unix)
            .and_then(|span| u64::try_from(span).ok());
        match span {
            Some(span) if span <= self.max_operator_cert_secs => Ok(()),
            _ => Err(format!(
                "the operator certificate (serial {}) is valid from {} to {}, longer than the {} s this node accepts (limits.max_operator_cert_secs); mint a fresh one with certistack-ctl",
                client.serial_hex,
                client.not_before_unix,
                client.not_after_unix,
                self.max_operator_cert_secs
            )),
        }
    }

    pub fn allows(&self, rpc: Rpc, kind: IdentityKind) -> bool {
        self.callers
            .get(&rpc)
            .is_some_and(|kinds| kinds.contains(&kind))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use certistack_core::identity::Identity;

    #[test]
    fn compiled_policy_builds_a_gate() {
        let gate = SurfacePolicy::compiled().unwrap().gate().unwrap();
        assert!(gate.allows(Rpc::Hello, IdentityKind::Operator));
        assert!(gate.allows(Rpc::Hello, IdentityKind::Run));
        assert!(gate.allows(Rpc::ListRuns, IdentityKind::Operator));
        assert!(!gate.allows(Rpc::ListRuns, IdentityKind::Run));
        assert!(!gate.allows(Rpc::MapBackup, IdentityKind::Operator));
        assert!(gate.allows(Rpc::MapBackup, IdentityKind::Run));
        assert!(!gate.allows(Rpc::BeginRun, IdentityKind::Operator));
    }

    #[test]
    fn operator_reaches_only_recovery_and_inspection() {
        let gate = SurfacePolicy::compiled().unwrap().gate().unwrap();
        let operator: Vec<&str> = Rpc::ALL
            .into_iter()
            .filter(|r| gate.allows(*r, IdentityKind::Operator))
            .map(Rpc::name)
            .collect();
        assert_eq!(
            operator,
            ["Hello", "ReadJournal", "ListRuns", "Cleanup", "NodeChecks"]
        );
    }

    #[test]
    fn operator_certificates_longer_than_the_limit_are_refused() {
        let gate = SurfacePolicy::compiled()
            .unwrap()
            .gate()
            .unwrap()
            .with_max_operator_cert_secs(600);
        let operator = |not_before_unix, not_after_unix| ClientIdentity {
            identity: Identity::Operator {
                name: "alice".into(),
            },
            not_before_unix,
            not_after_unix,
            serial_hex: "01".into(),
        };
        assert_eq!(gate.admits(&operator(1_000, 1_600)), Ok(()));
        let refused = gate.admits(&operator(1_000, 1_601)).unwrap_err();
        assert!(refused.contains("max_operator_cert_secs"), "{refused}");
        assert!(gate.admits(&operator(i64::MIN, i64::MAX)).is_err());
        assert!(gate.admits(&operator(1_600, 1_000)).is_err());
        // Run certificates live until their grant's deadline, checked by BeginRun instead.
        let run = ClientIdentity {
            identity: Identity::Run {
                run_id: certistack_core::validate::Validated::validate(
                    certistack_core::fixtures::RUN,
                )
                .unwrap(),
                grant_sha256: [0; 32],
                node: certistack_core::validate::Validated::validate("pve1").unwrap(),
            },
            not_before_unix: 0,
            not_after_unix: 86_400,
            serial_hex: "02".into(),
        };
        assert_eq!(gate.admits(&run), Ok(()));
    }

    #[test]
    fn drifted_policies_are_refused() {
        let mut policy = SurfacePolicy::compiled().unwrap();
        policy.rpc.pop();
        assert!(
            policy
                .gate()
                .unwrap_err()
                .to_string()
                .contains("has no entry")
        );

        let mut policy = SurfacePolicy::compiled().unwrap();
        policy.rpc[3].rule = "anything".into();
        assert!(
            policy
                .gate()
                .unwrap_err()
                .to_string()
                .contains("states rule")
        );

        let mut policy = SurfacePolicy::compiled().unwrap();
        let dup = policy.rpc[0].clone();
        policy.rpc.push(dup);
        assert!(policy.gate().unwrap_err().to_string().contains("twice"));

        let mut policy = SurfacePolicy::compiled().unwrap();
        policy.rpc[0].name = "Shell".into();
        assert!(
            policy
                .gate()
                .unwrap_err()
                .to_string()
                .contains("unknown RPC")
        );
    }
}
