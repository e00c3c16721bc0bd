//! The plan as written: the YAML's shape, field by field, and the field types that refuse a
//! value while it is read (with its line and column).

use super::*;

// The plan as written.

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PlanFile {
    pub(super) storage: StorageFile,
    pub(super) validations: Vec<ValidationFile>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct StorageFile {
    pub(super) server: String,
    /// [`DEFAULT_PBS_PORT`] when not written.
    #[serde(default)]
    pub(super) port: Option<u16>,
    pub(super) datastore: String,
    /// The datastore's root namespace when not written.
    #[serde(default)]
    pub(super) namespace: Option<String>,
    pub(super) auth_id: String,
    pub(super) fingerprint: String,
    pub(super) pbs_password_file: PathBuf,
    #[serde(default)]
    pub(super) encryption_key_file: Option<PathBuf>,
    /// Known only to be refused where it is written, with the way out.
    #[serde(default, rename = "pbs_password")]
    pub(super) _pbs_password: Option<InlineSecret>,
    #[serde(default, rename = "encryption_key")]
    pub(super) _encryption_key: Option<InlineSecret>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ValidationFile {
    pub(super) name: String,
    pub(super) node: NodeFile,
    /// The VM whose backup is restored; or `select`, which names several.
    #[serde(default)]
    pub(super) source_vmid: Option<PlanVmid>,
    /// VMs asked of the PVE API: one validation per VM, named `<name>-<vmid>`.
    #[serde(default)]
    pub(super) select: Option<SelectFile>,
    pub(super) snapshot: SnapshotFile,
    /// With `snapshot: latest`: the oldest the newest finished backup may be.
    #[serde(default)]
    pub(super) max_age_hours: Option<u32>,
    /// Every disk archive of the snapshot when not written.
    #[serde(default)]
    pub(super) archives: Option<Vec<String>>,
    pub(super) sandbox: Vec<SandboxFile>,
    pub(super) network: NetworkFile,
    #[serde(default)]
    pub(super) probes: Vec<ProbeFile>,
    #[serde(default)]
    pub(super) assertions: Vec<AssertionFile>,
    #[serde(default)]
    pub(super) timeouts: TimeoutsFile,
    #[serde(default)]
    pub(super) network_recovery: NetworkRecoveryFile,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SandboxFile {
    /// Taken from `[pve] sandbox_vmid_range` when not written.
    #[serde(default)]
    pub(super) vmid: Option<PlanVmid>,
    /// The source's (`cores` × `sockets` of its backed-up config) when not written, capped
    /// by `max_cores`.
    #[serde(default)]
    pub(super) cores: Option<u32>,
    /// The source's (`memory`) when not written, capped by `max_memory_mib`.
    #[serde(default)]
    pub(super) memory_mib: Option<u32>,
    #[serde(default)]
    pub(super) max_cores: Option<u32>,
    #[serde(default)]
    pub(super) max_memory_mib: Option<u32>,
}

/// Where a validation runs: a node of the inventory, `auto` (any of them) or a list to
/// choose from; a choice is made by placement (`plan::placement`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum NodeFile {
    Named(String),
    Auto,
    Among(Vec<String>),
}

impl NodeFile {
    /// As the plan writes it.
    pub(super) fn written(&self) -> String {
        match self {
            Self::Named(name) => name.clone(),
            Self::Auto => "auto".into(),
            Self::Among(names) => format!("[{}]", names.join(", ")),
        }
    }
}

impl<'de> Deserialize<'de> for NodeFile {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            One(String),
            Many(Vec<String>),
        }
        match Written::deserialize(deserializer)? {
            Written::One(name) if name == "auto" => Ok(Self::Auto),
            Written::One(name) => Ok(Self::Named(name)),
            Written::Many(names) if names.is_empty() => Err(serde::de::Error::custom(
                "an empty list of nodes: name the nodes to choose from, or write auto",
            )),
            Written::Many(names) => Ok(Self::Among(names)),
        }
    }
}

/// Which VMs a validation covers, asked of the PVE API; exactly one key.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SelectFile {
    /// These VMs.
    #[serde(default)]
    pub(super) vmids: Option<Vec<PlanVmid>>,
    /// Every QEMU VM of this pool (templates skipped).
    #[serde(default)]
    pub(super) pool: Option<String>,
    /// Every QEMU VM carrying all of these tags (templates skipped).
    #[serde(default)]
    pub(super) tags: Option<Vec<String>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct NetworkFile {
    pub(super) lifecycle: NetworkLifecycle,
    pub(super) vnet: String,
    pub(super) probe_source: String,
}

/// A probe as written. Optional keys are `None` when not written: resolution puts in their
/// defaults and says so.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ProbeFile {
    pub(super) kind: ProbeKind,
    pub(super) address: String,
    pub(super) port: u16,
    #[serde(default)]
    pub(super) expect: ExpectFile,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeKind {
    Tcp,
    Http,
    Https,
    Dns,
    Ldap,
}

impl ProbeKind {
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

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ExpectFile {
    #[serde(default)]
    pub(super) banner_prefix: Option<String>,
    #[serde(default)]
    pub(super) http_path: Option<String>,
    #[serde(default)]
    pub(super) http_status: Option<u16>,
    #[serde(default)]
    pub(super) body_contains: Option<String>,
    #[serde(default)]
    pub(super) body_sha256: Option<String>,
    #[serde(default)]
    pub(super) dns_name: Option<String>,
    #[serde(default)]
    pub(super) dns_type: Option<DnsType>,
    #[serde(default)]
    pub(super) dns_answers: Option<Vec<String>>,
    #[serde(default)]
    pub(super) ldap_naming_context: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum DnsType {
    A,
    Aaaa,
    Cname,
    Mx,
    Txt,
    Srv,
    Ptr,
}

impl DnsType {
    /// As a plan writes it and DNS names it.
    pub fn name(self) -> &'static str {
        match self {
            Self::A => "A",
            Self::Aaaa => "AAAA",
            Self::Cname => "CNAME",
            Self::Mx => "MX",
            Self::Txt => "TXT",
            Self::Srv => "SRV",
            Self::Ptr => "PTR",
        }
    }
}

/// An assertion as written; optional keys are `None` when not written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AssertionFile {
    pub(super) id: String,
    pub(super) program: String,
    #[serde(default)]
    pub(super) args: Option<Vec<String>>,
    #[serde(default)]
    pub(super) exit_code: Option<i32>,
    #[serde(default)]
    pub(super) stdout_contains: Option<String>,
    pub(super) timeout_seconds: u32,
}

/// Each timeout is `None` when not written: resolution puts in the default and says so.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TimeoutsFile {
    #[serde(default)]
    pub(super) run_seconds: Option<u32>,
    #[serde(default)]
    pub(super) guest_agent_seconds: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct NetworkRecoveryFile {
    /// `rewrite` when not written: `preserve` is the explicit opt-out.
    #[serde(default)]
    pub(super) mode: Option<NetworkRecoveryMode>,
    /// `rewrite`: the sandbox NIC's address/prefix; by default the one address the probes
    /// target, with the probe network's prefix.
    #[serde(default)]
    pub(super) guest_address: Option<String>,
}

/// How the restored guest finds its network in the sandbox.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkRecoveryMode {
    /// The explicit opt-out: the guest keeps the network configuration it was backed up
    /// with, the VNet is an isolated copy of its subnet, and probes target those addresses.
    /// Nothing in the guest is changed.
    Preserve,
    /// The default: before the sandbox VM first starts, the node writes a MAC-bound,
    /// no-gateway profile for its NIC (and a firewalld allow for the probe source) into the
    /// overlay (docs/guest-network.md).
    #[default]
    Rewrite,
}

impl NetworkRecoveryMode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Preserve => "preserve",
            Self::Rewrite => "rewrite",
        }
    }

    /// The mode the run's grant allows.
    pub fn wire(self) -> pb::NetworkRecoveryMode {
        match self {
            Self::Preserve => pb::NetworkRecoveryMode::Preserve,
            Self::Rewrite => pb::NetworkRecoveryMode::Rewrite,
        }
    }
}

/// A value that must not appear in a plan: deserializing it fails with where the secret goes.
#[derive(Debug, Clone)]
pub(super) struct InlineSecret;

impl<'de> Deserialize<'de> for InlineSecret {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        serde::de::IgnoredAny::deserialize(deserializer)?;
        Err(serde::de::Error::custom(format!(
            "secrets go in files, never in a plan; see {SECRETS_DOC}: write it to a file only you can read (chmod 0600) and name that file with `pbs_password_file` or `encryption_key_file`"
        )))
    }
}

/// A VMID, range-checked with the connector's own rule where it is written.
#[derive(Debug, Clone, Copy)]
pub(super) struct PlanVmid(pub(super) Vmid);

impl<'de> Deserialize<'de> for PlanVmid {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = u64::deserialize(deserializer)?;
        u32::try_from(value)
            .ok()
            .and_then(|v| Vmid::parse("vmid", v).ok())
            .map(Self)
            .ok_or_else(|| {
                serde::de::Error::custom(format!(
                    "VMID {value} is outside {}..={}; use a VMID Proxmox VE accepts",
                    Vmid::MIN,
                    Vmid::MAX
                ))
            })
    }
}

/// The snapshot a validation restores: an exact time, or `latest` (the newest finished one,
/// which resolution asks the PBS API for).
#[derive(Debug, Clone)]
pub(super) enum SnapshotFile {
    Exact(String),
    Latest,
}

impl<'de> Deserialize<'de> for SnapshotFile {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = String::deserialize(deserializer)?;
        if value.eq_ignore_ascii_case("latest") {
            return Ok(Self::Latest);
        }
        Ok(Self::Exact(value))
    }
}

/// The sandbox network's lifecycle: who creates the VNet and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkLifecycle {
    /// The VNet exists before the run (docs/sandbox-network.md); the run only attaches to it.
    Preprovisioned,
}

impl NetworkLifecycle {
    pub fn name(self) -> &'static str {
        match self {
            Self::Preprovisioned => "preprovisioned",
        }
    }
}

impl<'de> Deserialize<'de> for NetworkLifecycle {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = String::deserialize(deserializer)?;
        match value.as_str() {
            "preprovisioned" => Ok(Self::Preprovisioned),
            "ephemeral" => Err(serde::de::Error::custom(
                "`ephemeral` is not yet supported, use preprovisioned (a VNet set up beforehand as docs/sandbox-network.md describes)",
            )),
            other => Err(serde::de::Error::custom(format!(
                "lifecycle {other:?} is unknown; use preprovisioned"
            ))),
        }
    }
}
