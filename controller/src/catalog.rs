//! The controller's backup catalog: the PBS API, asked while a plan is resolved
//! (`snapshot: latest`), with the plan's own repository, token and pinned fingerprint.
//!
//! Resolution is synchronous (a plan is read before the run's runtime starts), so the catalog
//! keeps a small runtime of its own for its calls; the client is built on first use, when the
//! plan's secret file is read (owner and mode checked, zeroized), so a plan that never asks for
//! `latest` never reads it here.

use crate::api::https::Limits;
use crate::api::pbs::{PbsClient, PbsEndpoint};
use crate::plan::ResolvedStorage;
use crate::plan::latest::{BackupCatalog, CatalogError, CatalogFile, CatalogSnapshot};
use certistack_core::files;
use certistack_core::validate::Vmid;
use std::sync::OnceLock;

/// The PBS API as a [`BackupCatalog`].
#[derive(Debug, Default)]
pub struct PbsCatalog {
    client: OnceLock<Result<(PbsClient, tokio::runtime::Runtime), String>>,
}

impl PbsCatalog {
    pub fn new() -> Self {
        Self::default()
    }

    fn connect(
        storage: &ResolvedStorage,
    ) -> Result<(PbsClient, tokio::runtime::Runtime), CatalogError> {
        let secret = files::read_secret_line(
            &storage.pbs_password_file.value,
            "the PBS password or API-token secret",
        )
        .map_err(CatalogError::Secret)?;
        let fingerprint = certistack_core::tls::parse_fingerprint(&storage.fingerprint.value)
            .map_err(|reason| {
                CatalogError::Unavailable(format!("storage.fingerprint: {reason}"))
            })?;
        let client = PbsClient::new(
            PbsEndpoint {
                host: &storage.server.value,
                port: storage.port.value,
                auth_id: &storage.auth_id.value,
                secret,
                fingerprint,
            },
            Limits::default(),
        )
        .map_err(|reason| CatalogError::Unavailable(format!("storage.auth_id: {reason}")))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|error| {
                CatalogError::Unavailable(format!("cannot start a runtime: {error}"))
            })?;
        Ok((client, runtime))
    }
}

impl PbsCatalog {
    /// The client, built on first use from `storage`; a refused secret file is reported as
    /// such every time it is asked, any other failure to build the client is kept as text.
    fn client(
        &self,
        storage: &ResolvedStorage,
    ) -> Result<&(PbsClient, tokio::runtime::Runtime), CatalogError> {
        let connected = match self.client.get() {
            Some(connected) => connected,
            None => {
                let made = Self::connect(storage);
                if let Err(CatalogError::Secret(error)) = made {
                    return Err(CatalogError::Secret(error));
                }
                self.client
                    .get_or_init(|| made.map_err(|error| error.to_string()))
            }
        };
        connected
            .as_ref()
            .map_err(|reason| CatalogError::Unavailable(reason.clone()))
    }
}

impl BackupCatalog for PbsCatalog {
    fn vm_snapshots(
        &self,
        storage: &ResolvedStorage,
        vmid: Vmid,
    ) -> Result<Vec<CatalogSnapshot>, CatalogError> {
        let (client, runtime) = self.client(storage)?;
        let items = runtime
            .block_on(client.vm_snapshots(
                &storage.datastore.value,
                &storage.namespace.value,
                vmid.get(),
            ))
            .map_err(|error| CatalogError::Unavailable(error.to_string()))?;
        Ok(items
            .into_iter()
            .filter(|item| item.backup_type == "vm" && item.backup_id == vmid.to_string())
            .map(|item| CatalogSnapshot {
                backup_time: item.backup_time,
                size: item.size,
                files: item
                    .files
                    .into_iter()
                    .map(|file| CatalogFile {
                        name: file.filename,
                        size: file.size,
                        crypt_mode: file.crypt_mode,
                    })
                    .collect(),
            })
            .collect())
    }

    fn blob(
        &self,
        storage: &ResolvedStorage,
        vmid: Vmid,
        backup_time: i64,
        name: &str,
    ) -> Result<Vec<u8>, CatalogError> {
        let (client, runtime) = self.client(storage)?;
        runtime
            .block_on(client.download_blob(
                &storage.datastore.value,
                &storage.namespace.value,
                vmid.get(),
                backup_time,
                name,
            ))
            .map_err(|error| CatalogError::Unavailable(error.to_string()))
    }
}
