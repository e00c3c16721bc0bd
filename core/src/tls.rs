//! The one place where TLS is configured, for both binaries: the connector's server profile,
//! the controller's client profile, and the controller's API profile (for the Proxmox VE API).
//!
//! - TLS 1.3 only, the ring provider only, installed once per process;
//! - the connector requires a client certificate chaining to the controller CA (no anonymous
//!   clients, no other roots) and reads the client's identity from it after the handshake;
//! - the controller verifies the node's chain against the same CA and the node's name, and that
//!   the certificate fits the node profile (`serverAuth`, exactly one DNS name; see
//!   [`crate::identity`]).
//!
//! - towards an API server, the controller verifies the certificate by a CA file, a pinned
//!   SHA-256 fingerprint of the leaf, or both (both must then match); TLS 1.2 is accepted there
//!   because pveproxy serves it and the server is not ours to change.
//!
//! There is no option to skip verification, in any build. (The connector's probe client, which
//! accepts any certificate of a restored guest on purpose, lives in the connector and is never
//! used for an API.)

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

// ---------------------------------------------------------------------------------------------
// The API profile: the controller as a client of the Proxmox VE (and Proxmox Backup Server) API.

/// How the controller trusts an API server's certificate: a CA (chain and host name checked by
/// webpki), a pinned SHA-256 fingerprint of the leaf, or both, in which case both must match.
/// There is no third way: an `ApiTrust` with neither cannot be built.
#[derive(Debug, Clone)]
pub struct ApiTrust {
    ca: Option<Arc<RootCertStore>>,
    fingerprint: Option<[u8; 32]>,
}

impl ApiTrust {
    /// `None` when neither a CA nor a fingerprint is given.
    pub fn new(ca: Option<Arc<RootCertStore>>, fingerprint: Option<[u8; 32]>) -> Option<Self> {
        (ca.is_some() || fingerprint.is_some()).then_some(Self { ca, fingerprint })
    }

    /// What the trust checks, for a person: `CA file`, `pinned fingerprint` or both.
    pub fn describe(&self) -> &'static str {
        match (&self.ca, &self.fingerprint) {
            (Some(_), Some(_)) => "the CA file and the pinned fingerprint",
            (Some(_), None) => "the CA file",
            _ => "the pinned fingerprint",
        }
    }
}

/// Parses a SHA-256 certificate fingerprint as `openssl x509 -fingerprint -sha256` and
/// `pvenode cert info` print it (`AB:CD:…`), or as bare hex, in any case.
pub fn parse_fingerprint(text: &str) -> Result<[u8; 32], String> {
    let trimmed = text.trim();
    let trimmed = trimmed
        .strip_prefix("sha256 Fingerprint=")
        .or_else(|| trimmed.strip_prefix("SHA256 Fingerprint="))
        .unwrap_or(trimmed);
    let hex_digits: String = if trimmed.contains(':') {
        let groups: Vec<&str> = trimmed.split(':').collect();
        if groups.len() != 32 || groups.iter().any(|group| group.len() != 2) {
            return Err(format!(
                "{trimmed:?} is not a SHA-256 fingerprint: write 32 bytes as hex pairs separated by `:` (AB:CD:…) or 64 hex digits"
            ));
        }
        groups.concat()
    } else {
        trimmed.to_owned()
    };
    let mut fingerprint = [0u8; 32];
    hex::decode_to_slice(&hex_digits, &mut fingerprint).map_err(|_| {
        format!(
            "{trimmed:?} is not a SHA-256 fingerprint: write 32 bytes as hex pairs separated by `:` (AB:CD:…) or 64 hex digits"
        )
    })?;
    Ok(fingerprint)
}

/// `AB:CD:…`, as `openssl x509 -fingerprint -sha256` prints a fingerprint.
pub fn format_fingerprint(fingerprint: &[u8; 32]) -> String {
    fingerprint
        .iter()
        .map(|byte| format!("{byte:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The SHA-256 fingerprint of a DER certificate.
pub fn certificate_fingerprint(certificate: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(certificate).into()
}

/// The server's leaf does not carry the pinned fingerprint.
#[derive(Debug, thiserror::Error)]
#[error("the server's certificate has SHA-256 fingerprint {presented}, not the pinned {pinned}")]
pub struct FingerprintMismatch {
    pub presented: String,
    pub pinned: String,
}

/// The controller's client config for an API server: TLS 1.3 or 1.2 (pveproxy and PBS's proxy
/// serve both; the server is not ours to move to 1.3 only), the ring provider, no client
/// certificate, the server verified by `trust`.
pub fn api_client_config(trust: &ApiTrust) -> Result<Arc<ClientConfig>, TlsError> {
    let chain_check = match &trust.ca {
        Some(ca) => Some(
            rustls::client::WebPkiServerVerifier::builder_with_provider(ca.clone(), provider())
                .build()
                .map_err(|e| TlsError::Verifier(e.to_string()))?,
        ),
        None => None,
    };
    let verifier = ApiCertificateVerifier {
        chain_check,
        fingerprint: trust.fingerprint,
        algorithms: provider().signature_verification_algorithms,
    };
    let config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// The API profile's verifier: webpki's chain, validity and name checks when a CA is given, the
/// leaf's fingerprint when one is pinned; both when both are. With a pin alone, the pinned
/// certificate is the whole trust: its name, issuer and dates are not looked at, as
/// `proxmox-backup-client` treats a fingerprint.
#[derive(Debug)]
struct ApiCertificateVerifier {
    chain_check: Option<Arc<rustls::client::WebPkiServerVerifier>>,
    fingerprint: Option<[u8; 32]>,
    algorithms: rustls::crypto::WebPkiSupportedAlgorithms,
}

impl rustls::client::danger::ServerCertVerifier for ApiCertificateVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        if let Some(chain_check) = &self.chain_check {
            chain_check.verify_server_cert(
                end_entity,
                intermediates,
                server_name,
                ocsp_response,
                now,
            )?;
        }
        if let Some(pinned) = &self.fingerprint {
            let presented = certificate_fingerprint(end_entity);
            if presented != *pinned {
                return Err(rustls::Error::InvalidCertificate(
                    rustls::CertificateError::Other(rustls::OtherError(Arc::new(
                        FingerprintMismatch {
                            presented: format_fingerprint(&presented),
                            pinned: format_fingerprint(pinned),
                        },
                    ))),
                ));
            }
        }
        // `ApiTrust` holds a CA or a pin: one of the two checks above ran.
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fingerprint_is_read_in_either_spelling_and_any_case() {
        let colons = (0u8..32)
            .map(|i| format!("{:02X}", i * 7))
            .collect::<Vec<_>>()
            .join(":");
        let expected = parse_fingerprint(&colons).unwrap();
        assert_eq!(expected[1], 7);
        assert_eq!(format_fingerprint(&expected), colons);
        for spelling in [
            colons.to_lowercase(),
            colons.replace(':', ""),
            colons.replace(':', "").to_lowercase(),
            format!("sha256 Fingerprint={colons}"),
        ] {
            assert_eq!(
                parse_fingerprint(&spelling).unwrap(),
                expected,
                "{spelling}"
            );
        }
        for wrong in [
            "",
            "AB:CD",
            &colons[3..],
            &format!("{colons}:00"),
            &colons.replace(':', "-"),
            &colons.replace('0', "g"),
            "A:BC:DE:F0:12:34:56:78:9A:BC:DE:F0:12:34:56:78:9A:BC:DE:F0:12:34:56:78:9A:BC:DE:F0:12:34:56:789",
        ] {
            let error = parse_fingerprint(wrong).unwrap_err();
            assert!(error.contains("AB:CD:…"), "{wrong}: {error}");
        }
    }

    #[test]
    fn there_is_no_api_trust_without_a_ca_or_a_pin() {
        assert!(ApiTrust::new(None, None).is_none());
        let pinned = ApiTrust::new(None, Some([0; 32])).unwrap();
        assert_eq!(pinned.describe(), "the pinned fingerprint");
        assert!(api_client_config(&pinned).is_ok());
    }
}
