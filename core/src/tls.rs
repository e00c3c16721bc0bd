//! The one place where TLS is configured, for both binaries: the connector's server profile
//! and the controller's client profile.
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

const ALPN_H2: &[u8] = b"h2";

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
