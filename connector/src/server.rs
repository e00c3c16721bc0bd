//! Assembles the daemon from its config and serves the surface until shutdown.

use crate::call_log::{CallLogLayer, DETAILED_CALL_REFUSALS};
use crate::clock::{Clock, SystemClock};
use crate::config::Config;
use crate::connection::{self, ConnectionLimits};
use crate::executor::Executor;
use crate::policy::{PolicyError, SurfacePolicy};
use crate::refusal_log::{REFUSAL_WINDOW, RefusalLog};
use crate::runs::{RunError, RunRegistry};
use crate::service::ConnectorService;
use crate::tls::SharedServerConfig;
use certistack_core::files::{self, FileError};
use certistack_core::tls::{self, TlsError};
use certistack_core::validate::NodeName;
use certistack_proto::v1::connector_server::ConnectorServer;
use ed25519_dalek::VerifyingKey;
use ed25519_dalek::pkcs8::DecodePublicKey;
use rustls::pki_types::CertificateDer;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use x509_parser::prelude::{FromDer, GeneralName, ParsedExtension, X509Certificate};

/// Connections the kernel completes and queues before the daemon accepts them (capped by
/// `net.core.somaxconn`). A burst that overflows the queue has the kernel drop new SYNs, and a
/// legitimate client's dropped SYN is retried only after a second: the queue is sized to absorb
/// bursts of thousands while the accept loop drains it.
const LISTEN_BACKLOG: u32 = 4096;

/// Streams of one connection the client may reset before they were accepted, and streams the
/// server may reset for a client's protocol errors, before the connection is closed with
/// GOAWAY: hyper's guards against reset floods (tonic leaves the second unset, disabling it).
const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error("{0}; this build of the connector is broken: reinstall its package")]
    HardwarePolicy(String),
    #[error(transparent)]
    Runs(#[from] RunError),
    #[error("the config's node_name is invalid: {0}")]
    NodeName(String),
    #[error("{path}: not an Ed25519 public key in PEM (SPKI): {reason}")]
    AuthorityKey { path: String, reason: String },
    #[error(
        "the node certificate {path} does not name this node {node:?} (it names {names:?}); re-enroll the node"
    )]
    CertificateName {
        path: String,
        node: String,
        names: Vec<String>,
    },
    #[error("cannot listen on {address}: {source}")]
    Listen {
        address: String,
        source: std::io::Error,
    },
    #[error(
        "the node certificate {path} is not valid now (valid from {not_before} to {not_after}); renew it with `certistack-ctl node sign` and `enroll --install`"
    )]
    CertificateNotValidNow {
        path: String,
        not_before: String,
        not_after: String,
    },
    #[error(
        "the node certificate {path} was not issued by the controller CA in {ca}; install the certificate and the CA of the same controller"
    )]
    NotIssuedByCa { path: String, ca: String },
    #[error("the node certificate {path} cannot be read as X.509: {reason}")]
    CertificateUnreadable { path: String, reason: String },
    #[error("the gRPC server stopped: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// A connector ready to serve: keys loaded and checked, run registry open.
#[derive(Debug)]
pub struct Connector {
    config: Config,
    tls: SharedServerConfig,
    service: ConnectorService,
}

pub fn load_authority_key(path: &std::path::Path) -> Result<VerifyingKey, ServeError> {
    let pem = files::read_trusted(path)?;
    VerifyingKey::from_public_key_pem(&pem).map_err(|e| ServeError::AuthorityKey {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// The DNS SANs of a certificate.
pub fn dns_names(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        return Vec::new();
    };
    let mut names = Vec::new();
    for ext in cert.extensions() {
        if let ParsedExtension::SubjectAlternativeName(san) = ext.parsed_extension() {
            for name in &san.general_names {
                if let GeneralName::DNSName(dns) = name {
                    names.push((*dns).to_owned());
                }
            }
        }
    }
    names
}

/// What the daemon serves with, loaded and checked from the files the config names; reading
/// it changes nothing on disk.
pub struct NodeIdentity {
    pub node: NodeName,
    pub tls: Arc<rustls::ServerConfig>,
    pub authority: VerifyingKey,
    pub gate: crate::policy::Gate,
}

impl std::fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeIdentity")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl NodeIdentity {
    pub fn load(config: &Config) -> Result<Self, ServeError> {
        let node: NodeName = config.node().map_err(ServeError::NodeName)?;
        let tls = node_tls(config, &node)?.config;
        let authority = load_authority_key(&config.tls.run_authority_public_key)?;
        let gate = SurfacePolicy::compiled()?
            .gate()?
            .with_max_operator_cert_secs(config.limits.max_operator_cert_secs);
        // Checked before serving, so a ReadSourceConfig never meets a broken policy.
        crate::source_hardware::compiled_policy().map_err(ServeError::HardwarePolicy)?;
        Ok(Self {
            node,
            tls,
            authority,
            gate,
        })
    }
}

/// The TLS server configuration built from the certificate, key and CA files, with what was
/// read to build it.
struct NodeTls {
    config: Arc<rustls::ServerConfig>,
    leaf: Vec<u8>,
    ca: Vec<CertificateDer<'static>>,
}

fn node_tls(config: &Config, node: &NodeName) -> Result<NodeTls, ServeError> {
    let cert_path = &config.tls.certificate;
    let chain = tls::parse_certificates(
        &files::read_trusted(cert_path)?,
        &cert_path.display().to_string(),
    )?;
    let leaf = chain.first().map(|leaf| leaf.to_vec()).unwrap_or_default();
    let names = dns_names(&leaf);
    if !names.iter().any(|n| n == node.as_str()) {
        return Err(ServeError::CertificateName {
            path: cert_path.display().to_string(),
            node: node.to_string(),
            names,
        });
    }
    let key_path = &config.tls.private_key;
    let key = tls::parse_private_key(
        &files::read_private(key_path)?,
        &key_path.display().to_string(),
    )?;
    let ca_path = &config.tls.controller_ca;
    let ca = tls::parse_certificates(
        &files::read_trusted(ca_path)?,
        &ca_path.display().to_string(),
    )?;
    // rustls refuses a key that does not belong to the certificate here.
    let server = tls::server_config(chain, key, tls::ca_roots(&ca)?)?;
    Ok(NodeTls {
        config: server,
        leaf,
        ca,
    })
}

/// Reloads the node's certificate, key and controller CA into the running listener (SIGHUP,
/// `systemctl reload`). A set that would not serve is refused whole and the current one kept:
/// unreadable or insecure files, a key that is not the certificate's, a certificate for
/// another node, not valid now, or not issued by the CA in the set.
#[derive(Debug, Clone)]
pub struct TlsReload {
    config: Config,
    shared: SharedServerConfig,
}

/// What a reload installed, for the log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReloadedCertificate {
    pub serial: String,
    pub not_after: String,
}

impl TlsReload {
    pub fn reload(&self, now_unix: i64) -> Result<ReloadedCertificate, ServeError> {
        let node: NodeName = self.config.node().map_err(ServeError::NodeName)?;
        let loaded = node_tls(&self.config, &node)?;
        let path = self.config.tls.certificate.display().to_string();
        let unreadable = |reason: String| ServeError::CertificateUnreadable {
            path: path.clone(),
            reason,
        };
        let (_, leaf) =
            X509Certificate::from_der(&loaded.leaf).map_err(|e| unreadable(e.to_string()))?;
        let validity = leaf.validity();
        if now_unix < validity.not_before.timestamp() || now_unix > validity.not_after.timestamp() {
            return Err(ServeError::CertificateNotValidNow {
                path,
                not_before: validity.not_before.to_string(),
                not_after: validity.not_after.to_string(),
            });
        }
        let issued_by_ca = loaded.ca.iter().any(|ca| {
            X509Certificate::from_der(ca)
                .is_ok_and(|(_, ca)| leaf.verify_signature(Some(ca.public_key())).is_ok())
        });
        if !issued_by_ca {
            return Err(ServeError::NotIssuedByCa {
                path,
                ca: self.config.tls.controller_ca.display().to_string(),
            });
        }
        let installed = ReloadedCertificate {
            serial: leaf.raw_serial_as_string(),
            not_after: validity.not_after.to_string(),
        };
        self.shared.replace(loaded.config);
        Ok(installed)
    }
}

/// Reloads the TLS files on every SIGHUP until the process ends, telling the service
/// manager around each reload. A refused set is logged with its reason; serving goes on with
/// the set in use.
pub async fn reload_on_hangup(reload: TlsReload) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hangups) = signal(SignalKind::hangup()) else {
        tracing::error!(
            "cannot install the SIGHUP handler; restart the daemon to renew its certificate"
        );
        return;
    };
    while hangups.recv().await.is_some() {
        crate::systemd::notify_reloading();
        let reloading = reload.clone();
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        match tokio::task::spawn_blocking(move || reloading.reload(now)).await {
            Ok(Ok(installed)) => tracing::info!(
                serial = %installed.serial,
                not_after = %installed.not_after,
                "SIGHUP: new connections use the reloaded node certificate, key and controller CA"
            ),
            Ok(Err(error)) => tracing::error!(
                %error,
                "SIGHUP: refused the certificate set on disk; new connections keep using the current one"
            ),
            Err(error) => {
                tracing::error!(%error, "SIGHUP: the reload stopped; the current certificate set stays")
            }
        }
        crate::systemd::notify_ready();
    }
}

impl Connector {
    /// The daemon as shipped: the node executor and the system clock.
    pub fn for_node(config: Config) -> Result<Self, ServeError> {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let executor = Arc::new(crate::node::NodeExecutor::new(
            config.clone(),
            clock.clone(),
        ));
        Self::new(config, executor, clock)
    }

    pub fn new(
        config: Config,
        executor: Arc<dyn Executor>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, ServeError> {
        let NodeIdentity {
            node,
            tls,
            authority,
            gate,
        } = NodeIdentity::load(&config)?;
        files::create_private_dir(&config.paths.state_dir)?;
        let runs = Arc::new(RunRegistry::open(
            &config.paths.state_dir,
            &authority,
            crate::runs::RegistryLimits::from_config(&config.limits),
            clock.now_unix_ms(),
        )?);
        let service = ConnectorService::new(
            node,
            gate,
            authority,
            runs,
            executor,
            clock,
            config.limits.expiry_grace_secs,
        )
        .with_min_probe_prefix(config.limits.min_probe_prefix)
        .with_prerequisites(crate::prerequisites::Prerequisites::new(&config));
        Ok(Self {
            config,
            tls: SharedServerConfig::new(tls),
            service,
        })
    }

    /// The handle that reloads this connector's TLS files while it serves.
    pub fn tls_reload(&self) -> TlsReload {
        TlsReload {
            config: self.config.clone(),
            shared: self.tls.clone(),
        }
    }

    /// Binds the configured address.
    pub async fn bind(&self) -> Result<TcpListener, ServeError> {
        let address = self.config.listen;
        let listen = || {
            let socket = if address.is_ipv4() {
                tokio::net::TcpSocket::new_v4()?
            } else {
                tokio::net::TcpSocket::new_v6()?
            };
            socket.set_reuseaddr(true)?;
            socket.bind(address)?;
            socket.listen(LISTEN_BACKLOG)
        };
        listen().map_err(|source| ServeError::Listen {
            address: address.to_string(),
            source,
        })
    }

    /// Serves on `listener` until `shutdown` completes, then drains in-flight calls.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        let address = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        tracing::info!(%address, node = %self.config.node_name, digest = certistack_proto::SURFACE_DIGEST, "serving");
        let limit = self.config.limits.max_request_bytes;
        let service = Arc::new(self.service);
        // Runs nobody ended are reclaimed after their deadline plus the grace.
        let reaper = {
            let service = service.clone();
            let every =
                Duration::from_secs((self.config.limits.expiry_grace_secs / 2).clamp(1, 30));
            tokio::spawn(async move {
                // First, before any run is cleaned up: tools a previous daemon left running.
                service.recover_interrupted().await;
                // Only now is the journal consistent: a start or an upgrade's restart waits
                // for this.
                crate::systemd::notify_ready();
                tracing::info!("ready: interrupted steps settled");
                let mut ticks = tokio::time::interval(every);
                loop {
                    ticks.tick().await;
                    service.reap_expired().await;
                }
            })
        };
        let service = ConnectorServer::from_arc(service)
            .max_decoding_message_size(limit)
            // A screendump reply carries the image: room for the largest the limits allow.
            .max_encoding_message_size(
                self.config
                    .limits
                    .max_screendump_bytes
                    .saturating_add(1024 * 1024)
                    .max(4 * 1024 * 1024),
            );
        let limits = &self.config.limits;
        let handshake_refusals = Arc::new(RefusalLog::new(
            "handshakes",
            connection::DETAILED_HANDSHAKE_REFUSALS,
        ));
        let call_refusals = Arc::new(RefusalLog::new("calls", DETAILED_CALL_REFUSALS));
        // Summaries of the refusal windows appear even when no further refusal arrives.
        let summaries = {
            let (handshakes, calls) = (handshake_refusals.clone(), call_refusals.clone());
            tokio::spawn(async move {
                let mut ticks = tokio::time::interval(REFUSAL_WINDOW);
                loop {
                    ticks.tick().await;
                    handshakes.flush();
                    calls.flush();
                }
            })
        };
        let watchdog = crate::systemd::watchdog_interval()
            .map(|every| tokio::spawn(crate::systemd::keep_watchdog_fed(every)));
        let shutdown = async {
            shutdown.await;
            crate::systemd::notify_stopping();
        };
        let incoming = connection::incoming(
            listener,
            self.tls,
            ConnectionLimits::from(limits),
            handshake_refusals,
        );
        let served = tonic::transport::Server::builder()
            .concurrency_limit_per_connection(32)
            .max_concurrent_streams(limits.max_streams_per_connection)
            .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESET_STREAMS))
            .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS))
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(Duration::from_secs(10)))
            .layer(CallLogLayer::new(call_refusals))
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await;
        summaries.abort();
        reaper.abort();
        if let Some(watchdog) = watchdog {
            watchdog.abort();
        }
        served?;
        tracing::info!("stopped");
        Ok(())
    }
}
