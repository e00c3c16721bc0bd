//! Assembles the daemon from its config and serves the surface until shutdown.

use crate::call_log::{CallLogLayer, DETAILED_CALL_REFUSALS, REFUSAL_WINDOW, RefusalLog};
use crate::config::Config;
use crate::connection::{self, ConnectionLimits};
use crate::executor::Executor;
use crate::files::{self, FileError};
use crate::policy::{PolicyError, SurfacePolicy};
use crate::runs::{RunError, RunRegistry};
use crate::service::{Clock, ConnectorService};
use crate::tls::{self, TlsError};
use crate::validate::NodeName;
use certistack_proto::v1::connector_server::ConnectorServer;
use ed25519_dalek::VerifyingKey;
use ed25519_dalek::pkcs8::DecodePublicKey;
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
    #[error("the gRPC server stopped: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// A connector ready to serve: keys loaded and checked, run registry open.
#[derive(Debug)]
pub struct Connector {
    config: Config,
    tls: Arc<rustls::ServerConfig>,
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
        let cert_path = &config.tls.certificate;
        let chain = tls::parse_certificates(
            &files::read_trusted(cert_path)?,
            &cert_path.display().to_string(),
        )?;
        let names = chain
            .first()
            .map(|leaf| dns_names(leaf))
            .unwrap_or_default();
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
        let tls = tls::server_config(chain, key, tls::ca_roots(&ca)?)?;
        let authority = load_authority_key(&config.tls.run_authority_public_key)?;
        let gate = SurfacePolicy::compiled()?
            .gate()?
            .with_max_operator_cert_secs(config.limits.max_operator_cert_secs);
        Ok(Self {
            node,
            tls,
            authority,
            gate,
        })
    }
}

impl Connector {
    /// The daemon as shipped: the node executor and the system clock.
    pub fn for_node(config: Config) -> Result<Self, ServeError> {
        let clock: Arc<dyn Clock> = Arc::new(crate::service::SystemClock);
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
            tls,
            service,
        })
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
        served?;
        tracing::info!("stopped");
        Ok(())
    }
}
