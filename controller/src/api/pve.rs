//! The Proxmox VE API, as the controller's token sees it.
//!
//! Every call carries `Authorization: PVEAPIToken=USER@REALM!TOKENID=SECRET` (pve-access-control
//! reads tokens this way, with no CSRF token); every reply is `{"data": …}` and is unwrapped
//! here; PVE writes booleans as 0 and 1. A refusal's message comes from the reason phrase, where
//! pve-http-server puts it, and from the body's `errors` (parameter errors), escaped and bounded.
//!
//! The token's secret is read from its file when the client is built (owner and mode checked,
//! the first line, zeroized when the client is dropped) and never printed: `Debug` shows the
//! token's id only. The copy put into each request's header is encoded by hyper and freed, not
//! wiped: the secret lives in the controller's memory while it talks to the API, as it must.

use super::https::{ApiError, HttpsClient, Limits, query_escape};
use certistack_core::files::{self, FileError};
use certistack_core::tls::{self, ApiTrust};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use zeroize::Zeroizing;

/// The JSON API's prefix, as pveproxy serves it.
pub const API_PREFIX: &str = "/api2/json";

/// Why a client cannot be built from its configuration.
#[derive(Debug, thiserror::Error)]
pub enum PveSetupError {
    #[error("pve.token_secret_file: {0}")]
    Secret(FileError),
    #[error("pve.ca_file: {0}")]
    CaFile(FileError),
    #[error("pve.ca_file {path}: {reason}")]
    Ca { path: PathBuf, reason: String },
    #[error("[pve]: {0}")]
    Client(String),
}

/// An API token: its id, and its secret held zeroizing.
pub struct PveToken {
    id: String,
    secret: Zeroizing<String>,
}

impl std::fmt::Debug for PveToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PveToken")
            .field("id", &self.id)
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl PveToken {
    /// The token `id` with its secret read from `secret_file`.
    pub fn read(id: &str, secret_file: &Path) -> Result<Self, PveSetupError> {
        let line = files::read_secret_line(secret_file, "the PVE API token's secret")
            .map_err(PveSetupError::Secret)?;
        // A token's secret is a UUID: blanks around it (a paste, a CR) are no part of it.
        let secret = Zeroizing::new(line.trim().to_owned());
        Ok(Self {
            id: id.to_owned(),
            secret,
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    fn header(&self) -> Zeroizing<Vec<u8>> {
        Zeroizing::new(format!("PVEAPIToken={}={}", self.id, self.secret.as_str()).into_bytes())
    }
}

/// What a client of the PVE API is built from (the configuration's `[pve]`).
#[derive(Debug, Clone)]
pub struct PveEndpoint<'a> {
    pub host: &'a str,
    pub port: u16,
    pub token_id: &'a str,
    pub token_secret_file: &'a Path,
    pub ca_file: Option<&'a Path>,
    pub fingerprint: Option<[u8; 32]>,
}

/// A client of one PVE cluster's API.
#[derive(Debug)]
pub struct PveClient {
    https: HttpsClient,
    token: PveToken,
    trust: &'static str,
}

impl PveClient {
    /// Reads the CA file and the token's secret and builds the client; contacts nothing.
    pub fn new(endpoint: &PveEndpoint<'_>, limits: Limits) -> Result<Self, PveSetupError> {
        let ca = match endpoint.ca_file {
            None => None,
            Some(path) => {
                let pem = files::read_trusted(path).map_err(PveSetupError::CaFile)?;
                let ca = |reason: String| PveSetupError::Ca {
                    path: path.to_owned(),
                    reason,
                };
                let certificates = tls::parse_certificates(&pem, "the CA file")
                    .map_err(|error| ca(error.to_string()))?;
                Some(tls::ca_roots(&certificates).map_err(|error| ca(error.to_string()))?)
            }
        };
        let trust = ApiTrust::new(ca, endpoint.fingerprint).ok_or_else(|| {
            PveSetupError::Client("neither ca_file nor fingerprint is set".into())
        })?;
        let token = PveToken::read(endpoint.token_id, endpoint.token_secret_file)?;
        let https = HttpsClient::new(endpoint.host, endpoint.port, &trust, limits)
            .map_err(PveSetupError::Client)?;
        Ok(Self {
            https,
            token,
            trust: trust.describe(),
        })
    }

    /// `https://host:port`.
    pub fn url(&self) -> String {
        self.https.url()
    }

    /// What verifies the server: the CA file, the pinned fingerprint, or both.
    pub fn trust(&self) -> &'static str {
        self.trust
    }

    pub fn token_id(&self) -> &str {
        self.token.id()
    }

    /// `GET /version`: the API's release.
    pub async fn version(&self) -> Result<PveVersion, ApiError> {
        self.get("/version").await
    }

    /// `GET /access/permissions[?path=…]`: the token's own privileges, by path. With privilege
    /// separation a token has what both it and its user are granted.
    pub async fn permissions(&self, path: Option<&str>) -> Result<Permissions, ApiError> {
        match path {
            None => self.get("/access/permissions").await,
            Some(path) => {
                self.get(&format!("/access/permissions?path={}", query_escape(path)))
                    .await
            }
        }
    }

    /// `GET /cluster/status`: the cluster and its nodes, as corosync sees them.
    pub async fn cluster_status(&self) -> Result<Vec<ClusterStatusEntry>, ApiError> {
        self.get("/cluster/status").await
    }

    /// `GET /cluster/resources?type=KIND`: what the token may audit (pve-manager
    /// `PVE/API2/Cluster.pm`, `resources`: a VM without VM.Audit is left out, silently).
    pub async fn cluster_resources(&self, kind: &str) -> Result<Vec<ClusterResource>, ApiError> {
        self.get(&format!("/cluster/resources?type={}", query_escape(kind)))
            .await
    }

    /// `GET /pools/{pool}`: the pool's members (Pool.Audit on `/pool/{pool}`).
    pub async fn pool(&self, pool: &str) -> Result<PoolContent, ApiError> {
        self.get(&format!("/pools/{}", segment_escape(pool))).await
    }

    /// `GET /cluster/sdn/zones?pending=1`: the SDN zones the token may audit (pve-network
    /// `PVE/API2/Network/SDN/Zones.pm`, `index`: filtered by SDN.Audit on `/sdn/zones/<zone>`),
    /// each with its running values and, under `pending`, what an apply would change.
    pub async fn sdn_zones(&self) -> Result<Vec<SdnZone>, ApiError> {
        self.get("/cluster/sdn/zones?pending=1").await
    }

    /// `GET /cluster/sdn/vnets/{vnet}?pending=1` (SDN.Audit on `/sdn/zones/<zone>/<vnet>`).
    pub async fn sdn_vnet(&self, vnet: &str) -> Result<SdnVnet, ApiError> {
        self.get(&format!(
            "/cluster/sdn/vnets/{}?pending=1",
            segment_escape(vnet)
        ))
        .await
    }

    /// `GET /cluster/sdn/vnets/{vnet}/subnets?pending=1`: the VNet's subnets.
    pub async fn sdn_subnets(&self, vnet: &str) -> Result<Vec<SdnSubnet>, ApiError> {
        self.get(&format!(
            "/cluster/sdn/vnets/{}/subnets?pending=1",
            segment_escape(vnet)
        ))
        .await
    }

    /// `GET /cluster/nextid?vmid=N`: whether no guest of the cluster has VMID `vmid`. The
    /// method reads the cluster's whole VM list (permissions `user => 'all'`), so it answers for
    /// guests the token cannot see too; a VMID in use is refused with a parameter error (pve-manager
    /// `PVE/API2/Cluster.pm`, `nextid`: `raise_param_exc({ vmid => "VM $vmid already exists" })`).
    pub async fn vmid_free(&self, vmid: u32) -> Result<bool, ApiError> {
        match self
            .get::<serde_json::Value>(&format!("/cluster/nextid?vmid={vmid}"))
            .await
        {
            Ok(_) => Ok(true),
            Err(ApiError::Status {
                status: 400,
                message,
                ..
            }) if message.contains("already exists") => Ok(false),
            Err(error) => Err(error),
        }
    }

    async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, ApiError> {
        let header = self.token.header();
        let path = format!("{API_PREFIX}{path}");
        let reply = self
            .https
            .request(
                hyper::Method::GET,
                &path,
                &[("authorization", header.as_slice())],
                describe_refusal,
                &self.token.secret,
            )
            .await?;
        let envelope: Envelope<T> =
            serde_json::from_slice(&reply.body).map_err(|error| ApiError::Decode {
                call: format!("GET {path}"),
                reason: error.to_string(),
            })?;
        Ok(envelope.data)
    }
}

#[derive(Deserialize)]
struct Envelope<T> {
    data: T,
}

/// A refusal's message: pve-http-server puts the error in the reason phrase and, for a
/// parameter error, the parameters in the body's `errors`.
fn describe_refusal(reason: &str, body: &[u8]) -> String {
    super::https::describe_refusal(reason, body, false)
}

/// `GET /version`.
#[derive(Debug, Clone, Deserialize)]
pub struct PveVersion {
    pub version: String,
    #[serde(default)]
    pub release: String,
    #[serde(default)]
    pub repoid: String,
}

/// The token's privileges: path → privilege → whether it propagates to the path's children.
pub type Permissions = BTreeMap<String, BTreeMap<String, PveBool>>;

/// One entry of `GET /cluster/status`: the cluster itself (`type` = `cluster`) or a node.
#[derive(Debug, Clone, Deserialize)]
pub struct ClusterStatusEntry {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub online: Option<PveBool>,
    #[serde(default)]
    pub quorate: Option<PveBool>,
    #[serde(default)]
    pub nodes: Option<u32>,
}

/// One entry of `GET /cluster/resources`: a guest (`type` `qemu` or `lxc`), a node, a storage.
#[derive(Debug, Clone, Deserialize)]
pub struct ClusterResource {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub vmid: Option<u32>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub node: Option<String>,
    #[serde(default)]
    pub status: Option<String>,
    #[serde(default)]
    pub template: Option<PveBool>,
    #[serde(default)]
    pub pool: Option<String>,
    /// `;`-separated, as PVE stores them.
    #[serde(default)]
    pub tags: Option<String>,
    #[serde(default)]
    pub maxcpu: Option<f64>,
    /// A fraction of `maxcpu`.
    #[serde(default)]
    pub cpu: Option<f64>,
    #[serde(default)]
    pub maxmem: Option<u64>,
    #[serde(default)]
    pub mem: Option<u64>,
}

/// An SDN zone as `?pending=1` shows it: the running values, `pending` what an apply would
/// change, `state` `new`, `changed` or `deleted` when anything is pending.
#[derive(Debug, Clone, Deserialize)]
pub struct SdnZone {
    pub zone: String,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    /// `,`-separated; absent: every node.
    #[serde(default)]
    pub nodes: Option<String>,
    #[serde(default)]
    pub state: Option<String>,
    #[serde(default)]
    pub pending: Option<serde_json::Map<String, serde_json::Value>>,
}

/// An SDN VNet.
#[derive(Debug, Clone, Deserialize)]
pub struct SdnVnet {
    #[serde(default)]
    pub zone: Option<String>,
    #[serde(default)]
    pub state: Option<String>,
    #[serde(default)]
    pub pending: Option<serde_json::Map<String, serde_json::Value>>,
}

/// An SDN subnet of a VNet.
#[derive(Debug, Clone, Deserialize)]
pub struct SdnSubnet {
    #[serde(default)]
    pub subnet: Option<String>,
    #[serde(default)]
    pub cidr: Option<String>,
    #[serde(default)]
    pub gateway: Option<String>,
    #[serde(default)]
    pub snat: Option<PveBool>,
    #[serde(rename = "dhcp-range", default)]
    pub dhcp_range: Option<serde_json::Value>,
    #[serde(default)]
    pub state: Option<String>,
    #[serde(default)]
    pub pending: Option<serde_json::Map<String, serde_json::Value>>,
}

/// `GET /pools/{pool}`.
#[derive(Debug, Clone, Deserialize)]
pub struct PoolContent {
    #[serde(default)]
    pub members: Vec<PoolMember>,
}

/// A member of a pool: a guest or a storage.
#[derive(Debug, Clone, Deserialize)]
pub struct PoolMember {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub vmid: Option<u32>,
}

/// A boolean as PVE writes it: 0 or 1 (and, from some endpoints, `true`/`false`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PveBool(pub bool);

impl<'de> Deserialize<'de> for PveBool {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match serde_json::Value::deserialize(deserializer)? {
            serde_json::Value::Bool(value) => Ok(Self(value)),
            serde_json::Value::Number(number) => match number.as_u64() {
                Some(0) => Ok(Self(false)),
                Some(1) => Ok(Self(true)),
                _ => Err(serde::de::Error::custom(format!(
                    "{number} is not a PVE boolean (0 or 1)"
                ))),
            },
            other => Err(serde::de::Error::custom(format!(
                "{other} is not a PVE boolean (0 or 1)"
            ))),
        }
    }
}

/// `value` as one path segment of a URL: [`query_escape`], with `/` escaped too, so a name
/// cannot reach another route.
fn segment_escape(value: &str) -> String {
    query_escape(value).replace('/', "%2F")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn booleans_are_zero_or_one() {
        let entry: ClusterStatusEntry =
            serde_json::from_str(r#"{"type":"cluster","name":"lab","quorate":1,"nodes":3}"#)
                .unwrap();
        assert_eq!(entry.quorate, Some(PveBool(true)));
        let entry: ClusterStatusEntry =
            serde_json::from_str(r#"{"type":"node","name":"pve1","online":0}"#).unwrap();
        assert_eq!(entry.online, Some(PveBool(false)));
        assert!(serde_json::from_str::<PveBool>("2").is_err());
        assert!(serde_json::from_str::<PveBool>("\"1\"").is_err());
    }

    #[test]
    fn a_refusal_says_the_reason_phrase_and_the_parameters() {
        assert_eq!(
            describe_refusal(
                "Parameter verification failed.",
                br#"{"data":null,"errors":{"vmid":"invalid format - value does not look like a valid VM ID"}}"#
            ),
            "Parameter verification failed.; vmid: invalid format - value does not look like a valid VM ID"
        );
        assert_eq!(
            describe_refusal("authentication failure", b"not json"),
            "authentication failure"
        );
    }

    #[test]
    fn the_token_secret_is_never_in_debug_output() {
        let token = PveToken {
            id: "certistack@pve!ctl".into(),
            secret: Zeroizing::new("0b1e5c1e-secret".into()),
        };
        let shown = format!("{token:?}");
        assert!(shown.contains("certistack@pve!ctl"), "{shown}");
        assert!(!shown.contains("0b1e5c1e"), "{shown}");
        assert_eq!(
            token.header().as_slice(),
            b"PVEAPIToken=certistack@pve!ctl=0b1e5c1e-secret"
        );
    }
}
