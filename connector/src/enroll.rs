//! Node enrollment: the node's private key is generated here and never leaves the node.
//!
//! `enroll --csr` creates the key (0600; an existing key is reused, never replaced) and prints
//! a CSR whose only SAN is the node name. The controller signs it (`certistack-ctl node sign`);
//! `enroll --install` checks that the CA file is the one the operator read off the controller
//! (`--ca-fingerprint sha256:<hex>`, the SHA-256 of the CA certificate's DER, as `ca init` and
//! `node sign` print it and `openssl x509 -noout -fingerprint -sha256` shows it), that the
//! certificate fits the node profile, matches the key, names this node and chains to that CA,
//! then installs certificate, CA and run-authority public key. The fingerprint is what makes
//! the CA file trustworthy: it may have come over any channel.

use crate::config::Config;
use certistack_core::files::{self, FileError};
use certistack_core::identity::ca_fingerprint;
use certistack_core::tls::{self, TlsError};
use ed25519_dalek::VerifyingKey;
use ed25519_dalek::pkcs8::DecodePublicKey;
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("the node key {path} cannot be used: {reason}")]
    Key { path: String, reason: String },
    #[error("cannot build the CSR: {0}")]
    Csr(String),
    #[error("the certificate does not fit this node: {0}")]
    Mismatch(String),
    #[error("{path}: not an Ed25519 public key in PEM: {reason}")]
    Authority { path: String, reason: String },
    #[error(
        "--ca-fingerprint {0:?} is not sha256:<64 hex digits> (colons allowed, as openssl prints it)"
    )]
    FingerprintSyntax(String),
    #[error(
        "{path} must hold exactly the controller CA certificate, it holds {count}; copy ca.crt from the controller's state directory"
    )]
    CaCount { path: String, count: usize },
    #[error(
        "{path} has fingerprint {actual}, not the {expected} given; this is not the controller's CA, do not install it"
    )]
    FingerprintMismatch {
        path: String,
        actual: String,
        expected: String,
    },
}

/// A CA fingerprint as an operator types it: `sha256:` and 64 hex digits, either case, with or
/// without the colons OpenSSL puts between bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaFingerprint([u8; 32]);

impl std::str::FromStr for CaFingerprint {
    type Err = EnrollError;
    fn from_str(text: &str) -> Result<Self, EnrollError> {
        let syntax = || EnrollError::FingerprintSyntax(text.to_owned());
        let digits: String = text
            .strip_prefix("sha256:")
            .or_else(|| text.strip_prefix("SHA256:"))
            .ok_or_else(syntax)?
            .chars()
            .filter(|c| *c != ':')
            .collect();
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(&digits, &mut bytes).map_err(|_| syntax())?;
        Ok(Self(bytes))
    }
}

impl std::fmt::Display for CaFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sha256:{}", hex::encode(self.0))
    }
}

/// Creates the node key if absent and returns a PEM CSR for `config.node_name`.
pub fn certificate_request(config: &Config) -> Result<String, EnrollError> {
    let key_path = &config.tls.private_key;
    let key_err = |reason: String| EnrollError::Key {
        path: key_path.display().to_string(),
        reason,
    };
    let key = if key_path.exists() {
        KeyPair::from_pem(&files::read_private(key_path)?).map_err(|e| key_err(e.to_string()))?
    } else {
        if let Some(parent) = key_path.parent() {
            std::fs::create_dir_all(parent).map_err(|error| FileError::Write {
                path: parent.to_owned(),
                error,
            })?;
        }
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .map_err(|e| key_err(e.to_string()))?;
        files::write_new(
            key_path,
            zeroize::Zeroizing::new(key.serialize_pem()).as_bytes(),
            0o600,
        )?;
        key
    };
    let mut params = CertificateParams::new(vec![config.node_name.clone()])
        .map_err(|e| EnrollError::Csr(e.to_string()))?;
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, config.node_name.clone());
    params.distinguished_name = name;
    let csr = params
        .serialize_request(&key)
        .map_err(|e| EnrollError::Csr(e.to_string()))?;
    csr.pem().map_err(|e| EnrollError::Csr(e.to_string()))
}

/// Checks and installs the signed certificate, the CA and the run-authority public key.
pub fn install(
    config: &Config,
    certificate: &Path,
    ca: &Path,
    expected_ca: &CaFingerprint,
    authority: &Path,
) -> Result<(), EnrollError> {
    let cert_pem = std::fs::read_to_string(certificate).map_err(|error| FileError::Read {
        path: certificate.to_owned(),
        error,
    })?;
    let ca_pem = std::fs::read_to_string(ca).map_err(|error| FileError::Read {
        path: ca.to_owned(),
        error,
    })?;
    let authority_pem = std::fs::read_to_string(authority).map_err(|error| FileError::Read {
        path: authority.to_owned(),
        error,
    })?;
    VerifyingKey::from_public_key_pem(&authority_pem).map_err(|e| EnrollError::Authority {
        path: authority.display().to_string(),
        reason: e.to_string(),
    })?;

    let chain = tls::parse_certificates(&cert_pem, &certificate.display().to_string())?;
    let ca_certs = tls::parse_certificates(&ca_pem, &ca.display().to_string())?;
    let [ca_cert] = ca_certs.as_slice() else {
        return Err(EnrollError::CaCount {
            path: ca.display().to_string(),
            count: ca_certs.len(),
        });
    };
    let actual = ca_fingerprint(ca_cert);
    if actual != expected_ca.to_string() {
        return Err(EnrollError::FingerprintMismatch {
            path: ca.display().to_string(),
            actual,
            expected: expected_ca.to_string(),
        });
    }
    if let Some(leaf) = chain.first() {
        certistack_core::identity::check_node_certificate(leaf)
            .map_err(|e| EnrollError::Mismatch(e.to_string()))?;
    }
    let names = chain
        .first()
        .map(|leaf| crate::server::dns_names(leaf))
        .unwrap_or_default();
    if !names.iter().any(|n| n == &config.node_name) {
        return Err(EnrollError::Mismatch(format!(
            "it names {names:?}, this node is {:?}",
            config.node_name
        )));
    }
    // Building a server config proves the certificate matches the node key; a handshake-free
    // chain check proves it was issued by the CA we are about to trust.
    let key = tls::parse_private_key(&files::read_private(&config.tls.private_key)?, "node key")?;
    tls::server_config(chain.clone(), key, tls::ca_roots(&ca_certs)?).map_err(|e| {
        EnrollError::Mismatch(format!("certificate and node key do not match: {e}"))
    })?;
    verify_issued_by(&chain, &ca_certs)?;

    files::write_atomic(&config.tls.certificate, cert_pem.as_bytes(), 0o644)?;
    files::write_atomic(&config.tls.controller_ca, ca_pem.as_bytes(), 0o644)?;
    files::write_atomic(
        &config.tls.run_authority_public_key,
        authority_pem.as_bytes(),
        0o644,
    )?;
    Ok(())
}

fn verify_issued_by(
    chain: &[rustls::pki_types::CertificateDer<'static>],
    ca: &[rustls::pki_types::CertificateDer<'static>],
) -> Result<(), EnrollError> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let leaf = chain
        .first()
        .ok_or_else(|| EnrollError::Mismatch("empty certificate file".into()))?;
    let (_, leaf) =
        X509Certificate::from_der(leaf).map_err(|e| EnrollError::Mismatch(e.to_string()))?;
    for issuer in ca {
        let (_, issuer) =
            X509Certificate::from_der(issuer).map_err(|e| EnrollError::Mismatch(e.to_string()))?;
        if leaf.verify_signature(Some(issuer.public_key())).is_ok() {
            return Ok(());
        }
    }
    Err(EnrollError::Mismatch(
        "it was not issued by the given CA".into(),
    ))
}
