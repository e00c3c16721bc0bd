//! The one place where TLS is configured, for both binaries.
//!
//! - TLS 1.3 only, the ring provider only, installed once per process;
//! - the connector requires a client certificate chaining to the controller CA (no anonymous
//!   clients, no other roots) and reads the client's identity from it after the handshake;
//! - the controller verifies the node's chain against the same CA and the node's name, and that
//!   the certificate fits the node profile (`serverAuth`, exactly one DNS name; see
//!   [`crate::identity`]).
//!
//! There is no option to skip verification, in any build.

use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::net::TcpStream;

const ALPN_H2: &[u8] = b"h2";
/// How long the controller waits for a node's TCP connection and TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what}: no PEM certificate found")]
    NoCertificate { what: String },
    #[error("{what}: {reason}")]
    Pem { what: String, reason: String },
    #[error("TLS configuration rejected: {0}")]
    Config(#[from] rustls::Error),
    #[error("client certificate verifier: {0}")]
    Verifier(String),
}

static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();

/// The process's crypto provider: ring, installed as the rustls default on first use.
pub fn provider() -> Arc<CryptoProvider> {
    PROVIDER
        .get_or_init(|| {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            // Another copy may already be installed (tests start several endpoints); ours is the
            // one every config below names explicitly, so the global default is only a fallback.
            let _ = CryptoProvider::install_default((*provider).clone());
            provider
        })
        .clone()
}

/// Parses every certificate in a PEM document.
pub fn parse_certificates(pem: &str, what: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            what: what.to_owned(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            what: what.to_owned(),
        });
    }
    Ok(certs)
}

/// Parses one PKCS#8 / SEC1 private key from PEM.
pub fn parse_private_key(pem: &str, what: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem.as_bytes()).map_err(|e| TlsError::Pem {
        what: what.to_owned(),
        reason: e.to_string(),
    })
}

/// A root store holding exactly the controller CA.
pub fn ca_roots(ca: &[CertificateDer<'static>]) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in ca {
        roots.add(cert.clone())?;
    }
    Ok(Arc::new(roots))
}

/// The connector's server config: TLS 1.3, client certificate required and verified against `ca`.
pub fn server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    ca: Arc<RootCertStore>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let verifier = WebPkiClientVerifier::builder_with_provider(ca, provider())
        .build()
        .map_err(|e| TlsError::Verifier(e.to_string()))?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(Arc::new(config))
}

/// The controller's client config: TLS 1.3, the node verified against `ca` and the node
/// profile, our identity presented.
pub fn client_config(
    ca: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<ClientConfig>, TlsError> {
    let chain_check = rustls::client::WebPkiServerVerifier::builder_with_provider(ca, provider())
        .build()
        .map_err(|e| TlsError::Verifier(e.to_string()))?;
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(NodeCertificateVerifier { chain_check }))
        .with_client_auth_cert(chain, key)?;
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(Arc::new(config))
}

/// The controller's view of a node certificate: webpki's chain, validity and name checks, then
/// the node profile, which webpki does not enforce (it accepts a certificate without an
/// extended key usage for any purpose).
#[derive(Debug)]
struct NodeCertificateVerifier {
    chain_check: Arc<rustls::client::WebPkiServerVerifier>,
}

impl rustls::client::danger::ServerCertVerifier for NodeCertificateVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let verified = self.chain_check.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        crate::identity::check_node_certificate(end_entity).map_err(|error| {
            rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
                Arc::new(error),
            )))
        })?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.chain_check.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.chain_check.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.chain_check.supported_verify_schemes()
    }
}

/// The server configuration new handshakes use. A reload replaces it whole; handshakes that
/// already started, and connections already made, keep the configuration they started with.
#[derive(Debug, Clone)]
pub struct SharedServerConfig(Arc<std::sync::RwLock<Arc<ServerConfig>>>);

impl SharedServerConfig {
    pub fn new(config: Arc<ServerConfig>) -> Self {
        Self(Arc::new(std::sync::RwLock::new(config)))
    }

    /// The configuration for the next handshake.
    pub fn current(&self) -> Arc<ServerConfig> {
        // A writer cannot leave the lock inconsistent (it swaps one Arc): a poisoned lock
        // still holds a whole configuration.
        self.0
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    pub fn replace(&self, config: Arc<ServerConfig>) {
        *self
            .0
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = config;
    }
}

impl From<Arc<ServerConfig>> for SharedServerConfig {
    fn from(config: Arc<ServerConfig>) -> Self {
        Self::new(config)
    }
}

// The connections the server accepts, their limits and their handshakes live in
// `connection`; the types are named here too, where the rest of TLS is.
pub use crate::connection::{PeerInfo, PeerStream};

/// The connections a server on `listener` accepts, with the default `[limits]`.
pub fn incoming(
    listener: tokio::net::TcpListener,
    config: Arc<ServerConfig>,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<PeerStream>> {
    crate::connection::incoming(
        listener,
        config.into(),
        crate::connection::ConnectionLimits::from(&crate::config::Limits::default()),
        Arc::new(crate::call_log::RefusalLog::new(
            "handshakes",
            crate::connection::DETAILED_HANDSHAKE_REFUSALS,
        )),
    )
}

/// How often an idle or busy client connection pings its peer, and how long a ping may go
/// unanswered before the connection counts as lost.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// Opens a gRPC channel to a node over mTLS; `node_name` is the name its certificate must carry.
pub async fn connect(
    address: String,
    node_name: &str,
    config: Arc<ClientConfig>,
) -> Result<tonic::transport::Channel, ConnectError> {
    let server_name = ServerName::try_from(node_name.to_owned())
        .map_err(|_| ConnectError::Name(node_name.to_owned()))?;
    let connector = tokio_rustls::TlsConnector::from(config);
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .map_err(|e| ConnectError::Address(address.clone(), e.to_string()))?
        .connect_timeout(HANDSHAKE_TIMEOUT)
        // A peer that stops answering (a stopped process, a path that drops packets) is noticed
        // within about 30 s even while a long call is in flight, instead of never.
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true);
    // No per-request timeout here: every node operation has its own deadline on the node,
    // and cutting a call short would only kill the tool mid-way.
    let target = address.clone();
    endpoint
        .connect_with_connector(tower::service_fn(move |_uri| {
            let connector = connector.clone();
            let server_name = server_name.clone();
            let target = target.clone();
            async move {
                let tcp = TcpStream::connect(&target).await?;
                tcp.set_nodelay(true)?;
                let tls = connector.connect(server_name, tcp).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }))
        .await
        .map_err(|e| classify(address, &e))
}

/// Turns a failed connect into an error that says what to do: the node's certificate names
/// another node, comes from another CA, or the network/handshake failed.
fn classify(address: String, error: &(dyn std::error::Error + 'static)) -> ConnectError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(cause) = source {
        let rustls_error = cause.downcast_ref::<rustls::Error>().or_else(|| {
            cause
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|e| e.downcast_ref::<rustls::Error>())
        });
        if let Some(rustls::Error::InvalidCertificate(certificate_error)) = rustls_error {
            use rustls::CertificateError as E;
            return match certificate_error {
                E::NotValidForName | E::NotValidForNameContext { .. } => {
                    ConnectError::WrongNode(address, certificate_error.to_string())
                }
                E::UnknownIssuer | E::BadSignature => ConnectError::UnknownIssuer(address),
                E::Other(_) | E::InvalidPurpose | E::InvalidPurposeContext { .. } => {
                    ConnectError::NotANode(address, certificate_error.to_string())
                }
                _ => ConnectError::Transport(
                    address,
                    rustls_error.map(|e| e.to_string()).unwrap_or_default(),
                ),
            };
        }
        source = cause.source();
    }
    ConnectError::Transport(address, transport_reason(error))
}

/// The innermost cause of a transport error: that is where rustls says what was wrong.
fn transport_reason(error: &(dyn std::error::Error + 'static)) -> String {
    let mut reason = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        reason = cause.to_string();
        source = cause.source();
    }
    reason
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("{0:?} is not a valid node name for TLS verification")]
    Name(String),
    #[error("{0:?} is not a valid address: {1}")]
    Address(String, String),
    #[error("cannot reach the connector at {0} over mTLS: {1}")]
    Transport(String, String),
    #[error("the connector at {0} is not the node asked for: {1}; check --node and --name")]
    WrongNode(String, String),
    #[error(
        "the connector at {0} presents a certificate not issued by this controller's CA; enroll the node with this CA"
    )]
    UnknownIssuer(String),
    #[error("the connector at {0} is refused: {1}")]
    NotANode(String, String),
}
