//! The cluster's lines of `doctor`, when the configuration has `[pve]`: the Proxmox VE API
//! reached, its TLS verified (and by what), the token accepted, the PVE release, the cluster's
//! quorum. One `GET /version` answers the first four: each stage it passed is a line `ok`, the
//! stage it stopped at is the line that fails and says what to do, and the lines after it are
//! not printed (they were not tried).

use super::{Check, Level};
use crate::api::https::{ApiError, Limits};
use crate::api::pve::PveClient;
use crate::config::PveSettings;

/// The name the cluster's lines carry where a node's name stands.
pub const CLUSTER: &str = "cluster";
/// The PVE major release the connector and the controller are validated against.
pub const SUPPORTED_PVE_MAJOR: &str = "9";

/// The cluster's checks against its API.
pub async fn check_cluster(settings: &PveSettings, limits: Limits) -> Vec<Check> {
    let check = |name: &'static str, level: Level, detail: String| Check {
        node: CLUSTER.to_owned(),
        check: name,
        level,
        detail,
    };
    let endpoint = settings.endpoint();
    let client = match PveClient::new(&endpoint, limits) {
        Ok(client) => client,
        Err(error) => return vec![check("pve-api", Level::Fail, error.to_string())],
    };
    let url = client.url();
    let reached = check("pve-api", Level::Ok, format!("{url} reached"));
    let verified = check(
        "pve-tls",
        Level::Ok,
        format!("{url}'s certificate verified by {}", client.trust()),
    );
    let accepted = check(
        "pve-token",
        Level::Ok,
        format!("token {} accepted", client.token_id()),
    );
    let version = match client.version().await {
        Ok(version) => version,
        Err(error) if !error.reached() => {
            return vec![check("pve-api", Level::Fail, error.to_string())];
        }
        Err(error) if !error.tls_verified() => {
            return vec![reached, check("pve-tls", Level::Fail, error.to_string())];
        }
        Err(error @ ApiError::Status { status: 401, .. }) => {
            return vec![
                reached,
                verified,
                check(
                    "pve-token",
                    Level::Fail,
                    format!(
                        "{error}; the API refused token {}: check pve.token_id, and that pve.token_secret_file holds the secret `pveum user token add` printed (PVE shows it only then: if it is lost, remove the token, add it again and grant its ACLs again); a deleted or expired token, or a disabled user, is refused the same way",
                        client.token_id()
                    ),
                ),
            ];
        }
        Err(error @ ApiError::Status { status: 403, .. }) => {
            return vec![
                reached,
                verified,
                check("pve-token", Level::Fail, error.to_string()),
            ];
        }
        // The token was not refused, but the answer was not one: a server error, a reply too
        // large or too slow, or not PVE's.
        Err(error) => {
            return vec![
                reached,
                verified,
                check(
                    "pve-version",
                    Level::Fail,
                    format!(
                        "{error}; check that api_url names a Proxmox VE API (pveproxy, port 8006)"
                    ),
                ),
            ];
        }
    };
    let major = version.version.split('.').next().unwrap_or_default();
    let release = if major == SUPPORTED_PVE_MAJOR {
        check(
            "pve-version",
            Level::Ok,
            format!("Proxmox VE {}", version.version),
        )
    } else {
        check(
            "pve-version",
            Level::Warn,
            format!(
                "Proxmox VE {}; CertiStack is validated against Proxmox VE {SUPPORTED_PVE_MAJOR}",
                version.version
            ),
        )
    };
    let quorum = match client.cluster_status().await {
        Ok(entries) => {
            let cluster = entries.iter().find(|entry| entry.kind == "cluster");
            let nodes = entries.iter().filter(|entry| entry.kind == "node").count();
            let online = entries
                .iter()
                .filter(|entry| entry.kind == "node" && entry.online.is_some_and(|o| o.0))
                .count();
            match cluster {
                // A single node that was never joined to a cluster has no cluster entry.
                None => check(
                    "pve-cluster",
                    Level::Ok,
                    format!("a standalone node ({online} of {nodes} online)"),
                ),
                Some(cluster) if cluster.quorate.is_some_and(|q| q.0) => check(
                    "pve-cluster",
                    Level::Ok,
                    format!(
                        "cluster {} quorate, {online} of {nodes} node(s) online",
                        cluster.name
                    ),
                ),
                Some(cluster) => check(
                    "pve-cluster",
                    Level::Fail,
                    format!(
                        "cluster {} is not quorate ({online} of {nodes} node(s) online): /etc/pve is read-only, nothing can be created; restore quorum first (`pvecm status`)",
                        cluster.name
                    ),
                ),
            }
        }
        Err(error @ ApiError::Status { status: 403, .. }) => {
            let user = client.token_id().split('!').next().unwrap_or_default();
            check(
                "pve-cluster",
                Level::Warn,
                format!(
                    "{error}; the token (and, with privilege separation, its user) needs Sys.Audit on /: `pveum acl modify / --users '{user}' --roles PVEAuditor` and `pveum acl modify / --tokens '{}' --roles PVEAuditor`",
                    client.token_id()
                ),
            )
        }
        Err(error) => check("pve-cluster", Level::Warn, error.to_string()),
    };
    vec![reached, verified, accepted, release, quorum]
}
