//! The Proxmox Backup Server API, as the plan's API token sees it: a datastore's snapshots of
//! one VM and a snapshot's blobs (the VM's `qemu-server.conf`), read-only.
//!
//! Every call carries `Authorization: PBSAPIToken=USER@REALM!TOKEN:SECRET` (a colon, where PVE
//! writes `=`); a password login (an auth id without `!TOKEN`) is refused before anything is
//! sent, since it would need a ticket and a CSRF token. The server is trusted by the plan's
//! pinned fingerprint, as `proxmox-backup-client` trusts it on the node. The secret is held
//! zeroizing and never printed; `Debug` shows the auth id only.

use super::https::{ApiError, HttpsClient, Limits, query_escape};
use certistack_core::tls::ApiTrust;
use serde::Deserialize;
use zeroize::Zeroizing;

/// The JSON API's prefix, as the PBS proxy serves it.
pub const API_PREFIX: &str = "/api2/json";
/// The largest blob read through `download-decoded` (a `qemu-server.conf` is a few KiB).
pub const MAX_BLOB_BYTES: usize = 64 * 1024;

/// What a client of one PBS is built from.
#[allow(missing_debug_implementations)] // holds the secret; never printed
pub struct PbsEndpoint<'a> {
    pub host: &'a str,
    pub port: u16,
    /// `USER@REALM!TOKEN`.
    pub auth_id: &'a str,
    pub secret: Zeroizing<String>,
    /// SHA-256 of the server's certificate.
    pub fingerprint: [u8; 32],
}

/// A client of one PBS.
pub struct PbsClient {
    https: HttpsClient,
    blobs: HttpsClient,
    auth_id: String,
    secret: Zeroizing<String>,
}

impl std::fmt::Debug for PbsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PbsClient")
            .field("url", &self.https.url())
            .field("auth_id", &self.auth_id)
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl PbsClient {
    /// A client of `endpoint`; contacts nothing. Refuses an auth id that is not a token.
    pub fn new(endpoint: PbsEndpoint<'_>, limits: Limits) -> Result<Self, String> {
        if !endpoint.auth_id.contains('!') {
            return Err(format!(
                "{:?} is a user, and the controller reads the PBS API with an API token only: make one (`proxmox-backup-manager user generate-token USER@REALM NAME`), give it and its user DatastoreReader on the datastore (docs/install.md, \"The PBS API token\"), and write auth_id: USER@REALM!NAME with its secret in pbs_password_file",
                endpoint.auth_id
            ));
        }
        let trust = ApiTrust::new(None, Some(endpoint.fingerprint))
            .ok_or_else(|| "no fingerprint to trust the PBS by".to_owned())?;
        let https = HttpsClient::new(endpoint.host, endpoint.port, &trust, limits)?;
        let blobs = HttpsClient::new(
            endpoint.host,
            endpoint.port,
            &trust,
            Limits {
                max_reply_bytes: MAX_BLOB_BYTES,
                ..limits
            },
        )?;
        Ok(Self {
            https,
            blobs,
            auth_id: endpoint.auth_id.to_owned(),
            secret: endpoint.secret,
        })
    }

    pub fn url(&self) -> String {
        self.https.url()
    }

    /// `GET /admin/datastore/{store}/snapshots?backup-type=vm&backup-id={vmid}[&ns={ns}]`: every
    /// snapshot of the VM, in no promised order. One still being written (or broken) has no
    /// `size`.
    pub async fn vm_snapshots(
        &self,
        store: &str,
        namespace: &str,
        vmid: u32,
    ) -> Result<Vec<SnapshotListItem>, ApiError> {
        let mut path = format!(
            "{API_PREFIX}/admin/datastore/{}/snapshots?backup-type=vm&backup-id={vmid}",
            query_escape(store)
        );
        if !namespace.is_empty() {
            path.push_str(&format!("&ns={}", query_escape(namespace)));
        }
        let body = self.get(&self.https, &path).await?;
        let envelope: Envelope<Vec<SnapshotListItem>> =
            serde_json::from_slice(&body).map_err(|error| ApiError::Decode {
                call: format!("GET {path}"),
                reason: error.to_string(),
            })?;
        Ok(envelope.data)
    }

    /// `GET /admin/datastore/{store}/download-decoded?…&file-name={name}`: a blob's contents,
    /// at most [`MAX_BLOB_BYTES`]. PBS refuses an encrypted blob.
    pub async fn download_blob(
        &self,
        store: &str,
        namespace: &str,
        vmid: u32,
        backup_time: i64,
        file_name: &str,
    ) -> Result<Vec<u8>, ApiError> {
        let mut path = format!(
            "{API_PREFIX}/admin/datastore/{}/download-decoded?backup-type=vm&backup-id={vmid}&backup-time={backup_time}&file-name={}",
            query_escape(store),
            query_escape(file_name)
        );
        if !namespace.is_empty() {
            path.push_str(&format!("&ns={}", query_escape(namespace)));
        }
        self.get(&self.blobs, &path).await
    }

    async fn get(&self, client: &HttpsClient, path: &str) -> Result<Vec<u8>, ApiError> {
        let header = Zeroizing::new(
            format!("PBSAPIToken={}:{}", self.auth_id, self.secret.as_str()).into_bytes(),
        );
        let reply = client
            .request(
                hyper::Method::GET,
                path,
                &[("authorization", header.as_slice())],
                describe_refusal,
                &self.secret,
            )
            .await?;
        Ok(reply.body)
    }
}

#[derive(Deserialize)]
struct Envelope<T> {
    data: T,
}

/// A refusal's message: proxmox-rest-server writes an API error as a plain-text body under
/// the standard reason phrase (`400 Bad Request`, `no such datastore 'x'`;
/// `error_to_response`), labelled JSON.
fn describe_refusal(reason: &str, body: &[u8]) -> String {
    super::https::describe_refusal(reason, body, true)
}

/// One snapshot as `GET …/snapshots` lists it (pbs-api-types `SnapshotListItem`).
#[derive(Debug, Clone, Deserialize)]
pub struct SnapshotListItem {
    #[serde(rename = "backup-type")]
    pub backup_type: String,
    #[serde(rename = "backup-id")]
    pub backup_id: String,
    #[serde(rename = "backup-time")]
    pub backup_time: i64,
    #[serde(default)]
    pub files: Vec<BackupContent>,
    /// Absent while the snapshot is being written, or when its manifest cannot be read.
    #[serde(default)]
    pub size: Option<u64>,
}

/// One file of a snapshot (pbs-api-types `BackupContent`).
#[derive(Debug, Clone, Deserialize)]
pub struct BackupContent {
    pub filename: String,
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default, rename = "crypt-mode")]
    pub crypt_mode: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_login_is_refused_saying_what_to_write() {
        let error = PbsClient::new(
            PbsEndpoint {
                host: "pbs.example.net",
                port: 8007,
                auth_id: "certistack@pbs",
                secret: Zeroizing::new("s".into()),
                fingerprint: [0; 32],
            },
            Limits::default(),
        )
        .unwrap_err();
        assert!(error.contains("API token only"), "{error}");
        assert!(error.contains("auth_id: USER@REALM!NAME"), "{error}");
    }

    #[test]
    fn a_plain_text_error_body_is_the_message() {
        assert_eq!(
            describe_refusal("Bad Request", b"no such datastore 'nostore'\n"),
            "Bad Request: no such datastore 'nostore'"
        );
        assert_eq!(describe_refusal("Unauthorized", b""), "Unauthorized");
    }

    #[test]
    fn an_unfinished_snapshot_is_listed_without_a_size() {
        let items: Vec<SnapshotListItem> = serde_json::from_str(
            r#"[{"backup-type":"vm","backup-id":"100","backup-time":1796100000,"files":[{"filename":"drive-scsi0.img.fidx","size":4194304,"crypt-mode":"none"}],"size":4194800},
               {"backup-type":"vm","backup-id":"100","backup-time":1796190000,"files":[{"filename":"drive-scsi0.img.fidx"}]}]"#,
        )
        .unwrap();
        assert_eq!(items[0].size, Some(4194800));
        assert_eq!(items[1].size, None);
        assert_eq!(items[1].files[0].size, None);
    }

    #[test]
    fn the_secret_is_never_in_debug_output() {
        let client = PbsClient::new(
            PbsEndpoint {
                host: "pbs.example.net",
                port: 8007,
                auth_id: "certistack@pbs!restore",
                secret: Zeroizing::new("pbs-secret-value".into()),
                fingerprint: [0; 32],
            },
            Limits::default(),
        )
        .unwrap();
        let shown = format!("{client:?}");
        assert!(shown.contains("certistack@pbs!restore"), "{shown}");
        assert!(!shown.contains("pbs-secret-value"), "{shown}");
    }
}
