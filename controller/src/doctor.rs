//! `certistack-ctl doctor`: whether a node can run a validation, judged from what its connector
//! reports through the read-only `NodeChecks` call, plus its clock as `Hello` shows it.
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
//!
//! The PBS client is a warning above major 4 rather than a failure: the map/unmap interface the
//! connector drives has been stable across majors, and PVE 9 ships 4.x; below 4 it fails,
//! because 3.x belongs to PVE 8. An older `qemu-img` is a warning, not a failure: PVE 9 ships
//! 10.x, but the only features the connector uses (`create -f qcow2 -b DEV -F raw`, `info`) are
//! much older, and the test suite runs them with Debian 12's 7.2.

use crate::audit::{self, MAX_CLOCK_SKEW_MS};

/// The clock difference past which a node refuses run grants (they are valid from
/// `plan::NOT_BEFORE_SLACK_SECS` before the run starts).
pub const MAX_GRANT_SKEW_MS: i64 = crate::plan::NOT_BEFORE_SLACK_SECS * 1000;
use crate::authority::IssuedCertificate;
use crate::client;
use crate::config::InventoryNode;
use certistack_proto::v1 as pb;
use std::sync::Arc;
use std::time::Duration;

/// Free space under the overlay root below which a run may fill the disk (bytes, 20 GB).
pub const MIN_OVERLAY_FREE_BYTES: u64 = 20_000_000_000;
/// Connecting, Hello and NodeChecks together, per node.
pub const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_secs(30);

/// Exit codes of `certistack-ctl doctor`.
pub const EXIT_OK: u8 = 0;
pub const EXIT_FAILED: u8 = 1;
pub const EXIT_UNREACHABLE: u8 = 2;

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
        format!(
            "{} {} {} {}",
            self.node,
            self.check,
            self.level.as_str(),
            self.detail
        )
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

/// Whether a run may start on the node: no check failed.
pub fn passes(checks: &[Check]) -> bool {
    checks.iter().all(|check| check.level != Level::Fail)
}

/// 2 when a node could not be asked, else 1 when a check failed, else 0 (warnings included).
pub fn exit_code<'a>(checks: impl IntoIterator<Item = &'a Check>) -> u8 {
    let mut code = EXIT_OK;
    for check in checks {
        if check.check == CONNECT && check.level == Level::Fail {
            return EXIT_UNREACHABLE;
        }
        if check.level == Level::Fail {
            code = EXIT_FAILED;
        }
    }
    code
}

/// Connects to `node` as the operator `identity`, checks its Hello and judges what its
/// NodeChecks reports, all within `timeout`. Unreachable: one failed `connect` check.
pub async fn check_node(
    node: &InventoryNode,
    ca_pem: &str,
    identity: &IssuedCertificate,
    timeout: Duration,
) -> Vec<Check> {
    let name = node.name.to_string();
    let endpoint = node.endpoint();
    let asked = tokio::time::timeout(timeout, async {
        let mut connection = client::connect(&endpoint, &name, ca_pem, identity).await?;
        let (hello, skew_ms) = audit::hello_with_skew(&mut connection).await?;
        if let Err(mismatch) = client::check_hello(&hello, &name) {
            return Ok(Err(mismatch.to_string()));
        }
        let facts = connection
            .node_checks(pb::NodeChecksRequest {})
            .await?
            .into_inner();
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

/// Every node concurrently (at most `concurrency` at once); checks in inventory order.
pub async fn check_fleet<'a>(
    nodes: impl IntoIterator<Item = &'a InventoryNode>,
    ca_pem: &str,
    identity: Arc<IssuedCertificate>,
    concurrency: usize,
    timeout: Duration,
) -> Vec<Vec<Check>> {
    let ca_pem: Arc<str> = Arc::from(ca_pem);
    audit::for_each_node(
        nodes,
        concurrency,
        move |node| {
            let (ca_pem, identity) = (ca_pem.clone(), identity.clone());
            async move { check_node(&node, &ca_pem, &identity, timeout).await }
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

/// The leading `major.minor` of a version (`9.0.6`, `1:7.2+dfsg-7`, `10.0.2`).
pub fn major_minor(version: &str) -> Option<(u32, u32)> {
    let version = version.split_once(':').map_or(version, |(_, v)| v);
    let mut numbers = version
        .split(|c: char| !c.is_ascii_digit())
        .map(str::parse::<u32>);
    let major = numbers.next()?.ok()?;
    let minor = numbers.next().and_then(Result::ok).unwrap_or(0);
    Some((major, minor))
}

/// The judgement of a node's facts: (check, level, detail).
pub fn judge(facts: &pb::NodeChecksReply, skew_ms: i64) -> Vec<(&'static str, Level, String)> {
    let mut checks = Vec::new();
    let unreadable = |what: &str, error: &str| format!("{what} not read: {error}");
    checks.push(match major_minor(&facts.pve_manager_version) {
        Some((9, _)) => (
            "pve",
            Level::Ok,
            format!("Proxmox VE {}", facts.pve_manager_version),
        ),
        Some(_) => (
            "pve",
            Level::Fail,
            format!(
                "Proxmox VE {}; CertiStack needs 9.x: upgrade the node",
                facts.pve_manager_version
            ),
        ),
        None => (
            "pve",
            Level::Fail,
            unreadable("pve-manager version", &facts.pve_manager_error)
                + "; is this a Proxmox VE node, and is pve.dpkg_status right?",
        ),
    });
    checks.push(if facts.qemu_server_version.is_empty() {
        (
            "qemu-server",
            Level::Warn,
            unreadable("qemu-server version", &facts.qemu_server_error),
        )
    } else {
        (
            "qemu-server",
            Level::Ok,
            format!("qemu-server {}", facts.qemu_server_version),
        )
    });
    checks.push(match major_minor(&facts.qemu_img_version) {
        Some(version) if version >= (8, 0) => (
            "qemu-img",
            Level::Ok,
            format!("qemu-img {}", facts.qemu_img_version),
        ),
        Some(_) => (
            "qemu-img",
            Level::Warn,
            format!(
                "qemu-img {} is older than the 8.0 this release is meant for (PVE 9 ships 10.x): upgrade pve-qemu-kvm",
                facts.qemu_img_version
            ),
        ),
        None => (
            "qemu-img",
            Level::Fail,
            unreadable("qemu-img version", &facts.qemu_img_error)
                + "; check tools.qemu_img in the connector config",
        ),
    });
    checks.push(match major_minor(&facts.pbs_client_version) {
        Some((4, _)) => (
            "pbs-client",
            Level::Ok,
            format!("proxmox-backup-client {}", facts.pbs_client_version),
        ),
        Some((major, _)) if major > 4 => (
            "pbs-client",
            Level::Warn,
            format!(
                "proxmox-backup-client {}; CertiStack is validated with 4.x: check the release notes",
                facts.pbs_client_version
            ),
        ),
        Some(_) => (
            "pbs-client",
            Level::Fail,
            format!(
                "proxmox-backup-client {}; CertiStack needs 4.x (PVE 9): upgrade proxmox-backup-client",
                facts.pbs_client_version
            ),
        ),
        None => (
            "pbs-client",
            Level::Fail,
            unreadable("proxmox-backup-client version", &facts.pbs_client_error)
                + "; install proxmox-backup-client or fix tools.proxmox_backup_client",
        ),
    });
    for (name, tool, package) in [
        ("nft", &facts.nft, "nftables"),
        ("ip", &facts.ip, "iproute2"),
    ] {
        checks.push(match tool {
            Some(tool) if tool.executable => (name, Level::Ok, format!("{} executable", tool.path)),
            Some(tool) => (
                name,
                Level::Fail,
                format!(
                    "{}; install {package} or fix tools.{name} in the connector config",
                    tool.error
                ),
            ),
            None => (
                name,
                Level::Fail,
                format!("the node did not report {name}; upgrade the connector"),
            ),
        });
    }
    let gb = |bytes: u64| bytes as f64 / 1e9;
    checks.push(if !facts.overlay_error.is_empty() {
        (
            "overlay-space",
            Level::Fail,
            format!(
                "{}; create paths.overlay_root or fix it in the connector config",
                facts.overlay_error
            ),
        )
    } else if facts.overlay_free_bytes < MIN_OVERLAY_FREE_BYTES {
        (
            "overlay-space",
            Level::Warn,
            format!(
                "{:.1} GB free under the overlay root, less than {:.0} GB: a booted guest's writes may fill it; free space or move paths.overlay_root",
                gb(facts.overlay_free_bytes),
                gb(MIN_OVERLAY_FREE_BYTES)
            ),
        )
    } else {
        (
            "overlay-space",
            Level::Ok,
            format!(
                "{:.1} GB free under the overlay root",
                gb(facts.overlay_free_bytes)
            ),
        )
    });
    if facts.overlay_error.is_empty() {
        checks.push(if facts.overlay_shares_pve_cluster_fs {
            (
                "overlay-disk",
                Level::Warn,
                "the overlay root shares a filesystem with /var/lib/pve-cluster: a full overlay disk stops the cluster database; put paths.overlay_root on another disk".to_owned(),
            )
        } else {
            (
                "overlay-disk",
                Level::Ok,
                "the overlay root is not on the cluster database's filesystem".to_owned(),
            )
        });
    }
    checks.push(if skew_ms.abs() > MAX_GRANT_SKEW_MS {
        // A grant is valid from 60 s before the run starts: a node further behind refuses it.
        (
            "clock",
            Level::Fail,
            format!(
                "clock off by {skew_ms} ms: more than the {MAX_GRANT_SKEW_MS} ms a run grant allows, so the node would refuse every run; fix NTP on the node"
            ),
        )
    } else if skew_ms.abs() > MAX_CLOCK_SKEW_MS {
        (
            "clock",
            Level::Warn,
            format!(
                "clock off by {skew_ms} ms (more than {MAX_CLOCK_SKEW_MS} ms); fix NTP on the node"
            ),
        )
    } else {
        ("clock", Level::Ok, format!("clock within {skew_ms} ms"))
    });
    checks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn healthy() -> pb::NodeChecksReply {
        let tool = |path: &str| pb::ToolPresence {
            path: path.into(),
            executable: true,
            error: String::new(),
        };
        pb::NodeChecksReply {
            pve_manager_version: "9.0.6".into(),
            qemu_server_version: "9.0.18".into(),
            qemu_img_version: "10.0.2".into(),
            pbs_client_version: "4.0.14".into(),
            nft: Some(tool("/usr/sbin/nft")),
            ip: Some(tool("/usr/sbin/ip")),
            overlay_free_bytes: 100_000_000_000,
            ..Default::default()
        }
    }

    fn level_of(facts: &pb::NodeChecksReply, skew: i64, name: &str) -> Level {
        judge(facts, skew)
            .into_iter()
            .find(|(check, _, _)| *check == name)
            .map(|(_, level, _)| level)
            .unwrap()
    }

    #[test]
    fn versions_are_read_by_major_and_minor() {
        assert_eq!(major_minor("9.0.6"), Some((9, 0)));
        assert_eq!(major_minor("1:7.2+dfsg-7"), Some((7, 2)));
        assert_eq!(major_minor("10"), Some((10, 0)));
        assert_eq!(major_minor(""), None);
    }

    #[test]
    fn a_healthy_node_passes_every_check() {
        let checks = judge(&healthy(), 120);
        assert!(
            checks.iter().all(|(_, level, _)| *level == Level::Ok),
            "{checks:?}"
        );
    }

    #[test]
    fn each_rule_fails_or_warns_as_documented() {
        let mut facts = healthy();
        facts.pve_manager_version = "8.4.1".into();
        assert_eq!(level_of(&facts, 0, "pve"), Level::Fail);
        let mut facts = healthy();
        facts.qemu_img_version = "7.2.22".into();
        assert_eq!(level_of(&facts, 0, "qemu-img"), Level::Warn);
        assert_eq!(level_of(&facts, 6_000, "clock"), Level::Warn);
        assert_eq!(level_of(&facts, -61_000, "clock"), Level::Fail);
        let mut facts = healthy();
        facts.pbs_client_version = "3.4.1".into();
        assert_eq!(level_of(&facts, 0, "pbs-client"), Level::Fail);
        facts.pbs_client_version = "5.0.0".into();
        assert_eq!(level_of(&facts, 0, "pbs-client"), Level::Warn);
        let mut facts = healthy();
        facts.nft = Some(pb::ToolPresence {
            path: "/usr/sbin/nft".into(),
            executable: false,
            error: "/usr/sbin/nft: No such file or directory".into(),
        });
        assert_eq!(level_of(&facts, 0, "nft"), Level::Fail);
        let mut facts = healthy();
        facts.overlay_free_bytes = 19_999_999_999;
        facts.overlay_shares_pve_cluster_fs = true;
        assert_eq!(level_of(&facts, 0, "overlay-space"), Level::Warn);
        assert_eq!(level_of(&facts, 0, "overlay-disk"), Level::Warn);
        assert_eq!(level_of(&healthy(), 5_001, "clock"), Level::Warn);
        assert_eq!(level_of(&healthy(), -5_000, "clock"), Level::Ok);
    }

    #[test]
    fn exit_codes_rank_unreachable_over_failure_over_warning() {
        let check = |check: &'static str, level| Check {
            node: "pve1".into(),
            check,
            level,
            detail: String::new(),
        };
        assert_eq!(exit_code(&[check("clock", Level::Warn)]), EXIT_OK);
        assert_eq!(
            exit_code(&[check("pve", Level::Fail), check("clock", Level::Warn)]),
            EXIT_FAILED
        );
        assert_eq!(
            exit_code(&[check("pve", Level::Fail), check(CONNECT, Level::Fail)]),
            EXIT_UNREACHABLE
        );
    }
}
