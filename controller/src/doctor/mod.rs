//! Judging a node's prerequisites (for `certistack-ctl doctor`): whether a node can run a
//! validation, judged from what its connector reports through the read-only `NodeChecks` call, plus its clock as `Hello` shows it.
//!
//! The node reports facts; the controller decides here, so every node is held to the same
//! rules by the same release:
//!
//! | check | ok | warn | fail |
//! |---|---|---|---|
//! | `connect` | Hello answered | | unreachable (exit 2) |
//! | `surface` | name and surface digest match | | either differs |
//! | `pve` | `pve-manager` 9.x | | another major or unreadable |
//! | `qemu-server` | version read | unreadable | |
//! | `qemu-img` | ≥ 8.0 | older | unreadable |
//! | `pbs-client` | major 4 | newer major (not yet validated) | older major or unreadable |
//! | `nft`, `ip` | executable | | missing or not executable |
//! | `overlay-space` | ≥ 20 GB free | under 20 GB | overlay root unreadable |
//! | `overlay-disk` | own filesystem | shares `/var/lib/pve-cluster`'s | |
//! | `clock` | within 5 s | further off | more than 60 s off (grants would be refused) |
//! | `qemu` | `pve-qemu-kvm` ≥ 10.0 | older or unreadable | |
//! | `cgroup` | cgroup2 on `/sys/fs/cgroup`, sandbox weight under 100 | sandbox weight ≥ 100, or unreadable | v1 or hybrid |
//! | `vnet-forwarding` | off and stays off, or policy `disable-for-run` | off now, but a bare SDN stanza turns it on at `ifreload` | on now under policy `refuse`, or no such VNet |
//! | `legacy-nat` | no legacy NAT rule touches the VNet | | a rule touches it, or the tables cannot be read |
//! | `lvm-filter` | `global_filter` rejects `/dev/loop*` | it does not (the fixing line is printed), or unreadable | |
//! | `firewall` | pve-firewall, or proxmox-firewall with its tables loaded | host.fw and the loaded tables disagree, or unreadable | |
//! | `kvm` | `/dev/kvm` opens, the CPU has `vmx`/`svm`, not a VM | the same on a node that is itself a VM (hypervisor flag or virtual DMI names: nested), or flags unreadable | no `vmx`/`svm` (qemu-server refuses `kvm: 1` VMs), or `/dev/kvm` does not open |
//! | `appliance` (only with `--boot-appliance`) | booted within half of what a recovery gets | booted, in more than half of it | did not boot within its bound, or guestfish failed |
//!
//! With `[pve]` in the configuration, the lines of `cluster` come first (`cluster`):
//!
//! | check | ok | warn | fail |
//! |---|---|---|---|
//! | `pve-api` | the API answered over TCP | | the client cannot be built (secret file, CA file) or the API is unreachable |
//! | `pve-tls` | the certificate verified (by the CA file, the pin, or both) | | another CA, another name, another fingerprint |
//! | `pve-token` | the token accepted | | refused (401, 403) |
//! | `pve-version` | Proxmox VE 9 | another major | any other failed answer (a server error, too large, too slow) |
//! | `pve-cluster` | quorate, or a standalone node | `/cluster/status` not readable (403: the `pveum` lines that grant Sys.Audit) | not quorate |
//!
//! The PBS client is a warning above major 4 rather than a failure: the map/unmap interface the
//! connector drives has been stable across majors, and PVE 9 ships 4.x; below 4 it fails,
//! because 3.x belongs to PVE 8. An older `qemu-img` is a warning, not a failure: PVE 9 ships
//! 10.x, but the only features the connector uses (`create -f qcow2 -b DEV -F raw`, `info`) are
//! much older, and the test suite runs them with Debian 12's 7.2.

mod cluster;
mod judge;
mod lvm;
mod network;
#[cfg(test)]
mod tests;
mod virtualization;

pub use cluster::{CLUSTER, check_cluster};
pub use judge::{PVE_DEFAULT_CPU_WEIGHT, judge, major_minor};
pub use lvm::{LOOP_REJECT, PVE_GLOBAL_FILTER, filter_fix};

use crate::audit;

/// The clock difference past which a node refuses run grants (they are valid from
/// `plan::NOT_BEFORE_SLACK_SECS` before the run starts).
pub const MAX_GRANT_SKEW_MS: i64 = crate::plan::NOT_BEFORE_SLACK_SECS * 1000;
use crate::authority::IssuedCertificate;
use crate::client;
use crate::config::InventoryNode;
use certistack_core::validate::VnetName;
use certistack_proto::v1 as pb;
use std::sync::Arc;
use std::time::Duration;

/// One judged check: its name, its level and what it found.
pub(super) type Judged = (&'static str, Level, String);

/// What a check says when the node's reply lacks the fact it judges.
pub(super) const UPGRADE_CONNECTOR: &str = "the node did not report it; upgrade the connector";

/// Free space under the overlay root below which a run may fill the disk (bytes, 20 GB).
pub const MIN_OVERLAY_FREE_BYTES: u64 = 20_000_000_000;
/// Connecting, Hello and NodeChecks together, per node.
pub const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_secs(30);
/// What an appliance boot may take beyond its own bound (killing it, its reply).
pub const APPLIANCE_BOOT_MARGIN: Duration = Duration::from_secs(60);

/// The name of the check that fails when a node cannot be asked at all.
pub const CONNECT: &str = "connect";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Ok => "ok",
            Level::Warn => "warn",
            Level::Fail => "fail",
        }
    }
}

/// One judged prerequisite of one node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Check {
    pub node: String,
    pub check: &'static str,
    pub level: Level,
    /// What was found and, unless ok, what to do.
    pub detail: String,
}

impl Check {
    /// `node check ok|warn|fail detail`, as `certistack-ctl doctor` prints it.
    pub fn line(&self) -> String {
        let shown = self.shown();
        format!(
            "{} {} {} {}",
            shown.node,
            shown.check,
            shown.level.as_str(),
            shown.detail
        )
    }

    /// The check as one JSON object, as `certistack-ctl doctor --json` prints it.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self.shown()).unwrap_or(serde_json::Value::Null)
    }

    /// The check as it is printed: its detail quotes what the node reported (versions, tool
    /// errors, file names, the machine's names), text the node chose, so it is escaped and
    /// bounded, and can neither move the cursor over another line nor reach the clipboard.
    fn shown(&self) -> Self {
        use certistack_core::untrusted::{MAX_DETAIL_CHARS, MAX_VALUE_CHARS, printable};
        Self {
            node: printable(self.node.as_bytes(), MAX_VALUE_CHARS),
            check: self.check,
            level: self.level,
            detail: printable(self.detail.as_bytes(), MAX_DETAIL_CHARS),
        }
    }
}

/// Whether a run may start on the node: no check failed.
pub fn passes(checks: &[Check]) -> bool {
    checks.iter().all(|check| check.level != Level::Fail)
}

/// Connects to `node` as the operator `identity`, checks its Hello and judges what its
/// NodeChecks reports about it and about the sandbox `vnet`, all within `timeout`.
/// Unreachable: one failed `connect` check.
pub async fn check_node(
    node: &InventoryNode,
    ca_pem: &str,
    identity: &IssuedCertificate,
    vnet: Option<&VnetName>,
    boot_appliance: Option<Duration>,
    timeout: Duration,
) -> Vec<Check> {
    let request = pb::NodeChecksRequest {
        vnet: vnet.map(ToString::to_string).unwrap_or_default(),
        boot_appliance_within_secs: boot_appliance.map_or(0, |within| {
            u32::try_from(within.as_secs().max(1)).unwrap_or(u32::MAX)
        }),
    };
    // The appliance's boot comes on top of the node's other checks, with room for the node to
    // wait for a boot another operator started.
    let timeout = match boot_appliance {
        Some(within) => timeout
            .saturating_add(within)
            .saturating_add(APPLIANCE_BOOT_MARGIN),
        None => timeout,
    };
    let name = node.name.to_string();
    let endpoint = node.endpoint();
    let asked = tokio::time::timeout(timeout, async {
        let mut connection = client::connect(&endpoint, &name, ca_pem, identity).await?;
        let (hello, skew_ms) = audit::hello_with_skew(&mut connection).await?;
        if let Err(mismatch) = client::check_hello(&hello, &name) {
            return Ok(Err(mismatch.to_string()));
        }
        let facts = connection.node_checks(request).await?.into_inner();
        Ok::<_, client::NodeError>(Ok((facts, skew_ms)))
    })
    .await;
    let check = |check: &'static str, level: Level, detail: String| Check {
        node: name.clone(),
        check,
        level,
        detail,
    };
    match asked {
        Err(_) => vec![check(
            CONNECT,
            Level::Fail,
            format!(
                "no answer from {endpoint} within {} s; check the connector runs and the network",
                timeout.as_secs_f64()
            ),
        )],
        Ok(Err(error)) => vec![check(CONNECT, Level::Fail, format!("{endpoint}: {error}"))],
        Ok(Ok(Err(mismatch))) => vec![
            check(CONNECT, Level::Ok, format!("{endpoint} answered")),
            check("surface", Level::Fail, mismatch),
        ],
        Ok(Ok(Ok((facts, skew_ms)))) => {
            let mut checks = vec![
                check(CONNECT, Level::Ok, format!("{endpoint} answered")),
                check(
                    "surface",
                    Level::Ok,
                    "name and surface digest match".to_owned(),
                ),
            ];
            checks.extend(
                judge(&facts, skew_ms)
                    .into_iter()
                    .map(|(name, level, detail)| check(name, level, detail)),
            );
            checks
        }
    }
}

/// The sandbox VNet checked on each node, by node name.
pub type VnetsByNode = std::collections::BTreeMap<String, VnetName>;

/// Every node concurrently (at most `concurrency` at once), each with its VNet from `vnets`;
/// checks in inventory order.
pub async fn check_fleet<'a>(
    nodes: impl IntoIterator<Item = &'a InventoryNode>,
    ca_pem: &str,
    identity: Arc<IssuedCertificate>,
    vnets: Arc<VnetsByNode>,
    boot_appliance: Option<Duration>,
    concurrency: usize,
    timeout: Duration,
) -> Vec<Vec<Check>> {
    let ca_pem: Arc<str> = Arc::from(ca_pem);
    audit::for_each_node(
        nodes,
        concurrency,
        move |node| {
            let (ca_pem, identity, vnets) = (ca_pem.clone(), identity.clone(), vnets.clone());
            async move {
                let vnet = vnets.get(&node.name.to_string());
                check_node(&node, &ca_pem, &identity, vnet, boot_appliance, timeout).await
            }
        },
        |node| {
            vec![Check {
                node: node.name.to_string(),
                check: CONNECT,
                level: Level::Fail,
                detail: "the check was stopped".to_owned(),
            }]
        },
    )
    .await
}
