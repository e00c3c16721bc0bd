//! The controller's backup catalog: the PBS API, asked while a plan is resolved
//! (`snapshot: latest`), with the plan's own repository, token and pinned fingerprint.
//!
//! Resolution is synchronous (a plan is read before the run's runtime starts), so the catalog
//! keeps a small runtime of its own for its calls; the client is built on first use, when the
//! plan's secret file is read (owner and mode checked, zeroized), so a plan that asks nothing of
//! the backup never reads it here. A VM's listing is asked once per plan, and all the calls of
//! one plan together get [`RESOLUTION_BUDGET`]: a PBS that answers slowly holds a night's run
//! up for minutes, not hours.

use crate::api::https::{Limits, ask_at_once};
use crate::api::pbs::{PbsClient, PbsEndpoint};
use crate::plan::ResolvedStorage;
use crate::plan::backup::CONFIG_BLOB;
use crate::plan::latest::{BackupCatalog, CatalogError, CatalogFile, CatalogSnapshot};
use certistack_core::files;
use certistack_core::validate::Vmid;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The most snapshots of one VM a listing may hold: a group PBS prunes keeps a few dozen.
/// Each VM's listing is kept for the plan's resolution, so this bounds what a PBS can make the
/// controller hold (with the 8 MiB reply cap).
pub const MAX_LISTED_SNAPSHOTS: usize = 10_000;

/// How long resolving one plan may spend asking the PBS API, all calls together.
pub const RESOLUTION_BUDGET: Duration = Duration::from_secs(300);

/// A client that could not be built: whether the plan is at fault, and why.
type Unbuilt = (bool, String);

/// The PBS API as a [`BackupCatalog`].
#[derive(Debug)]
pub struct PbsCatalog {
    client: OnceLock<Result<(PbsClient, tokio::runtime::Runtime), Unbuilt>>,
    deadline: Instant,
    /// Each VM's listing, asked once.
    listings: Mutex<BTreeMap<u32, Vec<CatalogSnapshot>>>,
    /// Blobs read ahead (`prefetch`), by VM, snapshot time and name; each taken once.
    blobs: Mutex<BTreeMap<(u32, i64, String), Vec<u8>>>,
}

impl Default for PbsCatalog {
    fn default() -> Self {
        Self::new()
    }
}

impl PbsCatalog {
    pub fn new() -> Self {
        Self {
            client: OnceLock::new(),
            deadline: Instant::now() + RESOLUTION_BUDGET,
            listings: Mutex::new(BTreeMap::new()),
            blobs: Mutex::new(BTreeMap::new()),
        }
    }

    /// Runs one call within what is left of the budget.
    fn call<T>(
        &self,
        runtime: &tokio::runtime::Runtime,
        call: impl std::future::Future<Output = Result<T, crate::api::https::ApiError>>,
    ) -> Result<T, CatalogError> {
        crate::api::https::within(runtime, self.deadline, call)
            .ok_or_else(|| {
                CatalogError::Unavailable(format!(
                    "resolving the plan has asked the PBS API for {} s, its budget; check the PBS's load and the network",
                    RESOLUTION_BUDGET.as_secs()
                ))
            })?
            .map_err(catalog_error)
    }

    fn connect(
        storage: &ResolvedStorage,
    ) -> Result<(PbsClient, tokio::runtime::Runtime), CatalogError> {
        // Every key the request is built from is checked as the node's grant checks it
        // before the secret leaves the file: nothing odd is sent along with the token.
        use certistack_core::validate::{
            AuthId, Datastore, Fingerprint, Host, Namespace, Validated,
        };
        let key =
            |name: &str, reason: String| CatalogError::Refused(format!("storage.{name}: {reason}"));
        Host::validate(&storage.server.value).map_err(|reason| key("server", reason))?;
        Datastore::validate(&storage.datastore.value).map_err(|reason| key("datastore", reason))?;
        Namespace::validate(&storage.namespace.value).map_err(|reason| key("namespace", reason))?;
        AuthId::validate(&storage.auth_id.value).map_err(|reason| key("auth_id", reason))?;
        Fingerprint::validate(&storage.fingerprint.value)
            .map_err(|reason| key("fingerprint", reason))?;
        let secret = files::read_secret_line(
            &storage.pbs_password_file.value,
            "the PBS password or API-token secret",
        )
        .map_err(CatalogError::Secret)?;
        let fingerprint = certistack_core::tls::parse_fingerprint(&storage.fingerprint.value)
            .map_err(|reason| CatalogError::Refused(format!("storage.fingerprint: {reason}")))?;
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
        .map_err(|reason| CatalogError::Refused(format!("storage.auth_id: {reason}")))?;
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
                let made = match made {
                    Err(CatalogError::Secret(error)) => return Err(CatalogError::Secret(error)),
                    Err(CatalogError::Refused(reason)) => Err((true, reason)),
                    Err(CatalogError::Unavailable(reason)) => Err((false, reason)),
                    Ok(made) => Ok(made),
                };
                self.client.get_or_init(|| made)
            }
        };
        connected.as_ref().map_err(|(refused, reason)| {
            if *refused {
                CatalogError::Refused(reason.clone())
            } else {
                CatalogError::Unavailable(reason.clone())
            }
        })
    }
}

impl BackupCatalog for PbsCatalog {
    fn vm_snapshots(
        &self,
        storage: &ResolvedStorage,
        vmid: Vmid,
    ) -> Result<Vec<CatalogSnapshot>, CatalogError> {
        if let Some(listed) = self
            .listings
            .lock()
            .ok()
            .and_then(|l| l.get(&vmid.get()).cloned())
        {
            return Ok(listed);
        }
        let (client, runtime) = self.client(storage)?;
        let items = self.call(
            runtime,
            client.vm_snapshots(
                &storage.datastore.value,
                &storage.namespace.value,
                vmid.get(),
            ),
        )?;
        let listed = listing_of(items, vmid)?;
        if let Ok(mut listings) = self.listings.lock() {
            listings.insert(vmid.get(), listed.clone());
        }
        Ok(listed)
    }

    fn blob(
        &self,
        storage: &ResolvedStorage,
        vmid: Vmid,
        backup_time: i64,
        name: &str,
    ) -> Result<Vec<u8>, CatalogError> {
        if let Some(read) = self
            .blobs
            .lock()
            .ok()
            .and_then(|mut b| b.remove(&(vmid.get(), backup_time, name.to_owned())))
        {
            return Ok(read);
        }
        let (client, runtime) = self.client(storage)?;
        self.call(
            runtime,
            client.download_blob(
                &storage.datastore.value,
                &storage.namespace.value,
                vmid.get(),
                backup_time,
                name,
            ),
        )
    }

    fn prefetch(&self, storage: &ResolvedStorage, listed: &[Vmid], configs: &[Vmid]) {
        let Ok((client, runtime)) = self.client(storage) else {
            return;
        };
        let (store, namespace) = (&storage.datastore.value, &storage.namespace.value);
        let known: BTreeSet<u32> = self
            .listings
            .lock()
            .map(|l| l.keys().copied().collect())
            .unwrap_or_default();
        let todo: BTreeSet<Vmid> = listed
            .iter()
            .copied()
            .filter(|vmid| !known.contains(&vmid.get()))
            .collect();
        let answers = ask_at_once(runtime, self.deadline, todo, |vmid| async move {
            (
                vmid,
                client.vm_snapshots(store, namespace, vmid.get()).await,
            )
        });
        for (vmid, answer) in answers {
            if let Ok(items) = answer
                && let Ok(listing) = listing_of(items, vmid)
                && let Ok(mut listings) = self.listings.lock()
            {
                listings.insert(vmid.get(), listing);
            }
        }
        // The config of each newest finished snapshot, where the sizes come from it.
        let wanted: Vec<(u32, i64)> = {
            let listings = self.listings.lock();
            configs
                .iter()
                .filter_map(|vmid| {
                    let listings = listings.as_ref().ok()?;
                    let newest = crate::plan::latest::newest_finished(listings.get(&vmid.get())?)?;
                    newest
                        .files
                        .iter()
                        .any(|f| f.name == CONFIG_BLOB)
                        .then_some((vmid.get(), newest.backup_time))
                })
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect()
        };
        let read = ask_at_once(runtime, self.deadline, wanted, |(vmid, time)| async move {
            let answer = client
                .download_blob(store, namespace, vmid, time, CONFIG_BLOB)
                .await;
            (vmid, time, answer)
        });
        if let Ok(mut blobs) = self.blobs.lock() {
            for (vmid, time, answer) in read {
                if let Ok(bytes) = answer {
                    blobs.insert((vmid, time, CONFIG_BLOB.to_owned()), bytes);
                }
            }
        }
    }
}

/// A VM's listing as the catalog keeps it, refused past [`MAX_LISTED_SNAPSHOTS`].
fn listing_of(
    items: Vec<crate::api::pbs::SnapshotListItem>,
    vmid: Vmid,
) -> Result<Vec<CatalogSnapshot>, CatalogError> {
    if items.len() > MAX_LISTED_SNAPSHOTS {
        return Err(CatalogError::Refused(format!(
            "PBS lists {} snapshots of VM {vmid}, more than the {MAX_LISTED_SNAPSHOTS} read; prune the group (a prune job keeps a few dozen)",
            items.len()
        )));
    }
    let listed: Vec<CatalogSnapshot> = items
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
        .collect();
    Ok(listed)
}

/// An answer refusing what was asked (4xx but for a refused token) is the catalog's refusal;
/// anything else (unreachable, TLS, a refused token, a server error, too slow, too large) means
/// it could not be asked.
fn catalog_error(error: crate::api::https::ApiError) -> CatalogError {
    match error.status() {
        Some(status) if (400..500).contains(&status) && status != 401 && status != 403 => {
            CatalogError::Refused(error.to_string())
        }
        _ => CatalogError::Unavailable(error.to_string()),
    }
}
