//! The controller's key material and what it issues with it.
//!
//! A state directory (0700) holds the CA (ECDSA P-256; issues node and client certificates),
//! the run-authority key (Ed25519; signs run grants) and the report-signing key (Ed25519; signs
//! reports). Private keys are PKCS#8 PEM files of mode 0600 and are refused when group- or
//! world-accessible. The node never receives any of them.
//!
//! Ed25519 keys are written as PKCS#8 v1 (RFC 8410: the private key alone, what `openssl genpkey
//! -algorithm ed25519` writes), which OpenSSL 3 and Python's `cryptography` load; v2 files with
//! an embedded public key, as earlier releases wrote, are still read.

use certistack_core::files::{self, FileError};
use certistack_core::identity::Identity;
use certistack_core::validate::Validated;
use ed25519_dalek::SigningKey;
use ed25519_dalek::pkcs8::{
    DecodePrivateKey, EncodePrivateKey, EncodePublicKey, KeypairBytes, spki::der::pem::LineEnding,
};
use rand_core::{OsRng, RngCore};
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use std::path::{Path, PathBuf};
use time::{Duration, OffsetDateTime};

pub const CA_KEY: &str = "ca.key";
pub const CA_CERT: &str = "ca.crt";
pub const RUN_AUTHORITY_KEY: &str = "run-authority.key";
pub const RUN_AUTHORITY_PUB: &str = "run-authority.pub";
pub const REPORT_KEY: &str = "report-signing.key";
pub const REPORT_PUB: &str = "report-signing.pub";

const CA_LIFETIME: Duration = Duration::days(3650);
pub const NODE_CERT_LIFETIME: Duration = Duration::days(397);
/// Operator certificates minted for one CLI invocation: the whole validity, clock-skew margin
/// included, so that nodes enforcing `limits.max_operator_cert_secs` (default 600) accept it.
pub const OPERATOR_CERT_LIFETIME: Duration = Duration::minutes(10);
/// Tolerated clock difference between controller and node when a certificate starts.
const CLOCK_SKEW: Duration = Duration::seconds(60);

#[derive(Debug, thiserror::Error)]
pub enum AuthorityError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error(
        "{path} already holds a key; refusing to overwrite it (move the state directory away to start over)"
    )]
    Exists { path: PathBuf },
    #[error("{path}: {reason}")]
    Key { path: PathBuf, reason: String },
    #[error("certificate: {0}")]
    Certificate(String),
    #[error("the CSR is not acceptable: {0}")]
    Csr(String),
}

fn cert_err(e: impl std::fmt::Display) -> AuthorityError {
    AuthorityError::Certificate(e.to_string())
}

/// The loaded state directory.
pub struct Authority {
    dir: PathBuf,
    ca_pem: String,
    issuer: Issuer<'static, KeyPair>,
    run_authority: SigningKey,
    report_signing: SigningKey,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

fn random_serial() -> SerialNumber {
    let mut bytes = [0u8; 16];
    OsRng.fill_bytes(&mut bytes);
    // A positive DER integer: clear the top bit, and keep the first byte non-zero.
    if let Some(first) = bytes.first_mut() {
        *first = (*first & 0x7f) | 0x01;
    }
    SerialNumber::from_slice(&bytes)
}

fn ed25519_pem(
    key: &SigningKey,
    path: &Path,
) -> Result<(zeroize::Zeroizing<String>, String), AuthorityError> {
    let err = |reason: String| AuthorityError::Key {
        path: path.to_owned(),
        reason,
    };
    let private = KeypairBytes {
        secret_key: key.to_bytes(),
        public_key: None,
    }
    .to_pkcs8_pem(LineEnding::LF)
    .map_err(|e| err(e.to_string()))?;
    let public = key
        .verifying_key()
        .to_public_key_pem(LineEnding::LF)
        .map_err(|e| err(e.to_string()))?;
    Ok((private, public))
}

/// Creates the state directory with a new CA, run-authority key and report-signing key, and
/// returns the CA fingerprint nodes pin when they enroll.
pub fn init(dir: &Path, now: OffsetDateTime) -> Result<String, AuthorityError> {
    files::create_private_dir(dir)?;
    for name in [
        CA_KEY,
        CA_CERT,
        RUN_AUTHORITY_KEY,
        RUN_AUTHORITY_PUB,
        REPORT_KEY,
        REPORT_PUB,
    ] {
        let path = dir.join(name);
        if path.exists() {
            return Err(AuthorityError::Exists { path });
        }
    }
    let ca_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(cert_err)?;
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, "CertiStack controller CA");
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = now - CLOCK_SKEW;
    params.not_after = now + CA_LIFETIME;
    params.serial_number = Some(random_serial());
    let ca_cert = params.self_signed(&ca_key).map_err(cert_err)?;

    let run_authority = SigningKey::generate(&mut OsRng);
    let report_signing = SigningKey::generate(&mut OsRng);
    let (run_private, run_public) = ed25519_pem(&run_authority, &dir.join(RUN_AUTHORITY_KEY))?;
    let (report_private, report_public) = ed25519_pem(&report_signing, &dir.join(REPORT_KEY))?;

    files::write_new(
        &dir.join(CA_KEY),
        zeroize::Zeroizing::new(ca_key.serialize_pem()).as_bytes(),
        0o600,
    )?;
    files::write_new(&dir.join(CA_CERT), ca_cert.pem().as_bytes(), 0o644)?;
    files::write_new(&dir.join(RUN_AUTHORITY_KEY), run_private.as_bytes(), 0o600)?;
    files::write_new(&dir.join(RUN_AUTHORITY_PUB), run_public.as_bytes(), 0o644)?;
    files::write_new(&dir.join(REPORT_KEY), report_private.as_bytes(), 0o600)?;
    files::write_new(&dir.join(REPORT_PUB), report_public.as_bytes(), 0o644)?;
    Ok(certistack_core::identity::ca_fingerprint(ca_cert.der()))
}

/// `sha256:<hex>` of the DER of the one certificate in `ca_pem`.
pub fn ca_fingerprint_of(ca_pem: &str) -> Result<String, AuthorityError> {
    let certs = certistack_core::tls::parse_certificates(ca_pem, CA_CERT).map_err(cert_err)?;
    match certs.as_slice() {
        [ca] => Ok(certistack_core::identity::ca_fingerprint(ca)),
        _ => Err(AuthorityError::Certificate(format!(
            "{CA_CERT} holds {} certificates, expected the CA alone",
            certs.len()
        ))),
    }
}

fn load_ed25519(path: &Path) -> Result<SigningKey, AuthorityError> {
    let pem = files::read_private(path)?;
    SigningKey::from_pkcs8_pem(&pem).map_err(|e| AuthorityError::Key {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

/// What a client certificate issued here consists of.
pub struct IssuedCertificate {
    pub certificate_pem: String,
    pub key_pem: zeroize::Zeroizing<String>,
}

impl std::fmt::Debug for IssuedCertificate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuedCertificate")
            .field("key_pem", &"<redacted>")
            .finish_non_exhaustive()
    }
}

impl Authority {
    /// Loads the state directory, checking that it and every private key are private.
    pub fn load(dir: &Path) -> Result<Self, AuthorityError> {
        files::check_private(dir)?;
        let ca_key_path = dir.join(CA_KEY);
        let ca_key = KeyPair::from_pem(&files::read_private(&ca_key_path)?).map_err(|e| {
            AuthorityError::Key {
                path: ca_key_path.clone(),
                reason: e.to_string(),
            }
        })?;
        let ca_pem = files::read_trusted(&dir.join(CA_CERT))?;
        let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).map_err(cert_err)?;
        Ok(Self {
            dir: dir.to_owned(),
            ca_pem,
            issuer,
            run_authority: load_ed25519(&dir.join(RUN_AUTHORITY_KEY))?,
            report_signing: load_ed25519(&dir.join(REPORT_KEY))?,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// `sha256:<hex>` of the CA certificate's DER, which `enroll --install --ca-fingerprint`
    /// requires.
    pub fn ca_fingerprint(&self) -> Result<String, AuthorityError> {
        ca_fingerprint_of(&self.ca_pem)
    }

    pub fn run_authority(&self) -> &SigningKey {
        &self.run_authority
    }

    pub fn report_signing(&self) -> &SigningKey {
        &self.report_signing
    }

    /// Signs a node's CSR. The CSR must name exactly `node` (one DNS SAN); the certificate is a
    /// TLS server certificate for that name only, whatever else the CSR asked for.
    pub fn sign_node_csr(
        &self,
        csr_pem: &str,
        node: &str,
        now: OffsetDateTime,
    ) -> Result<String, AuthorityError> {
        <certistack_core::validate::NodeName as Validated>::validate(node)
            .map_err(AuthorityError::Csr)?;
        let mut csr = CertificateSigningRequestParams::from_pem(csr_pem)
            .map_err(|e| AuthorityError::Csr(e.to_string()))?;
        let asked: Vec<String> = csr
            .params
            .subject_alt_names
            .iter()
            .map(|san| match san {
                SanType::DnsName(name) => name.as_str().to_owned(),
                other => format!("{other:?}"),
            })
            .collect();
        if asked != [node] {
            return Err(AuthorityError::Csr(format!(
                "it asks for {asked:?}; a node CSR must name exactly [{node:?}]"
            )));
        }
        let mut params = CertificateParams::new(vec![node.to_owned()]).map_err(cert_err)?;
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, node);
        params.distinguished_name = name;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.not_before = now - CLOCK_SKEW;
        params.not_after = now + NODE_CERT_LIFETIME;
        params.serial_number = Some(random_serial());
        csr.params = params;
        Ok(csr.signed_by(&self.issuer).map_err(cert_err)?.pem())
    }

    /// Issues a client certificate carrying `identity`, valid over `[not_before, not_after]`.
    pub fn issue_client(
        &self,
        identity: &Identity,
        not_before: OffsetDateTime,
        not_after: OffsetDateTime,
    ) -> Result<IssuedCertificate, AuthorityError> {
        let key = ClientKey::generate()?;
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, identity.to_string());
        params.distinguished_name = name;
        params.subject_alt_names = identity
            .uris()
            .into_iter()
            .map(|uri| uri.try_into().map(SanType::URI).map_err(cert_err))
            .collect::<Result<_, _>>()?;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.not_before = not_before;
        params.not_after = not_after;
        params.serial_number = Some(random_serial());
        let cert = params.signed_by(&key, &self.issuer).map_err(cert_err)?;
        Ok(IssuedCertificate {
            certificate_pem: cert.pem(),
            key_pem: key.pem,
        })
    }

    /// A short-lived operator certificate for one CLI invocation.
    pub fn issue_operator(
        &self,
        name: &str,
        now: OffsetDateTime,
    ) -> Result<IssuedCertificate, AuthorityError> {
        certistack_core::identity::check_operator_name(name)
            .map_err(AuthorityError::Certificate)?;
        self.issue_client(
            &Identity::Operator {
                name: name.to_owned(),
            },
            now - CLOCK_SKEW,
            now - CLOCK_SKEW + OPERATOR_CERT_LIFETIME,
        )
    }
}

/// A new client key (ECDSA P-256): its PKCS#8 document as PEM, for rustls to sign the
/// handshake with, and its public key, for the certificate.
///
/// ring writes the public point it computes while generating the key into the document; the
/// public key is read back from there. rcgen's `KeyPair::generate_for` would parse the document
/// into a signing key instead, computing the point a second time (about a third of a run's key
/// and certificate), for a key the controller never signs anything with: rustls parses the PEM
/// when it connects.
struct ClientKey {
    pem: zeroize::Zeroizing<String>,
    public_point: Vec<u8>,
}

impl ClientKey {
    fn generate() -> Result<Self, AuthorityError> {
        let document = ring::signature::EcdsaKeyPair::generate_pkcs8(
            &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING,
            &ring::rand::SystemRandom::new(),
        )
        .map_err(|_| cert_err("the system's random number generator failed"))?;
        let public_point = p256_public_point(document.as_ref())
            .map_err(|e| cert_err(format!("the generated key's PKCS#8 document: {e}")))?;
        let pem = pkcs8::der::pem::encode_string("PRIVATE KEY", LineEnding::LF, document.as_ref())
            .map_err(cert_err)?;
        Ok(Self {
            pem: zeroize::Zeroizing::new(pem),
            public_point,
        })
    }
}

impl rcgen::PublicKeyData for ClientKey {
    fn der_bytes(&self) -> &[u8] {
        &self.public_point
    }

    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        &rcgen::PKCS_ECDSA_P256_SHA256
    }
}

/// The public point (SEC 1, uncompressed) of a P-256 key's PKCS#8 document of the form ring
/// writes: `PrivateKeyInfo` (RFC 5208) with an `ECPrivateKey` (RFC 5915) that carries it.
fn p256_public_point(document: &[u8]) -> Result<Vec<u8>, String> {
    use pkcs8::der::asn1::{BitStringRef, ObjectIdentifier, OctetStringRef};
    use pkcs8::der::{Decode, Reader, SliceReader, TagMode, TagNumber};
    const EC_PUBLIC_KEY: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.2.840.10045.2.1");
    const P256: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.2.840.10045.3.1.7");
    let info = pkcs8::PrivateKeyInfo::from_der(document).map_err(|e| e.to_string())?;
    if info.algorithm.oid != EC_PUBLIC_KEY {
        return Err(format!("algorithm {}, not an EC key", info.algorithm.oid));
    }
    let curve = info.algorithm.parameters_oid().map_err(|e| e.to_string())?;
    if curve != P256 {
        return Err(format!("an EC key on curve {curve}, not on P-256"));
    }
    let mut reader = SliceReader::new(info.private_key).map_err(|e| e.to_string())?;
    let (version, inner_curve, point) = reader
        .sequence(|key| {
            let version = u8::decode(key)?;
            let _scalar = OctetStringRef::decode(key)?;
            let curve =
                key.context_specific::<ObjectIdentifier>(TagNumber::N0, TagMode::Explicit)?;
            let point =
                key.context_specific::<BitStringRef<'_>>(TagNumber::N1, TagMode::Explicit)?;
            Ok((version, curve, point))
        })
        .map_err(|e| e.to_string())?;
    reader.finish(()).map_err(|e| e.to_string())?;
    if version != 1 {
        return Err(format!("an ECPrivateKey of version {version}, not 1"));
    }
    if let Some(inner_curve) = inner_curve.filter(|inner| *inner != P256) {
        return Err(format!(
            "an ECPrivateKey on curve {inner_curve}, its PKCS#8 algorithm on P-256"
        ));
    }
    let point = point
        .and_then(|bits| bits.as_bytes())
        .ok_or("the ECPrivateKey carries no public key")?;
    // 0x04, then X and Y of 32 bytes each: the form a certificate's key must have.
    if point.len() != 65 || point.first() != Some(&0x04) {
        return Err(format!(
            "a public key of {} bytes, not an uncompressed P-256 point",
            point.len()
        ));
    }
    Ok(point.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_keys_public_point_is_the_one_its_private_key_gives() {
        use ring::signature::KeyPair as _;
        let key = ClientKey::generate().unwrap();
        let (label, der) = pkcs8::der::pem::decode_vec(key.pem.as_bytes()).unwrap();
        assert_eq!(label, "PRIVATE KEY");
        // The PEM rcgen wrote before, and what the controller's TLS configuration reads.
        assert_eq!(
            *key.pem,
            KeyPair::try_from(der.as_slice()).unwrap().serialize_pem()
        );
        assert!(matches!(
            certistack_core::tls::parse_private_key(&key.pem, "key").unwrap(),
            rustls::pki_types::PrivateKeyDer::Pkcs8(_)
        ));
        let parsed = ring::signature::EcdsaKeyPair::from_pkcs8(
            &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING,
            &der,
            &ring::rand::SystemRandom::new(),
        )
        .unwrap();
        assert_eq!(parsed.public_key().as_ref(), key.public_point.as_slice());
    }

    #[test]
    fn a_document_that_is_not_a_p256_key_is_refused_with_its_reason() {
        let ed25519 =
            ring::signature::Ed25519KeyPair::generate_pkcs8(&ring::rand::SystemRandom::new())
                .unwrap();
        let refused = p256_public_point(ed25519.as_ref()).unwrap_err();
        assert_eq!(refused, "algorithm 1.3.101.112, not an EC key");
        let key = ring::signature::EcdsaKeyPair::generate_pkcs8(
            &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING,
            &ring::rand::SystemRandom::new(),
        )
        .unwrap();
        let mut cut = key.as_ref().to_vec();
        cut.truncate(cut.len() - 1);
        assert!(p256_public_point(&cut).is_err());
        let p384 = ring::signature::EcdsaKeyPair::generate_pkcs8(
            &ring::signature::ECDSA_P384_SHA384_ASN1_SIGNING,
            &ring::rand::SystemRandom::new(),
        )
        .unwrap();
        let refused = p256_public_point(p384.as_ref()).unwrap_err();
        assert_eq!(refused, "an EC key on curve 1.3.132.0.34, not on P-256");
    }

    /// A DER header: `tag`, then the length of `len` (under 256) in its short or long form.
    fn header(tag: u8, len: usize) -> Vec<u8> {
        let len = u8::try_from(len).unwrap();
        if len < 0x80 {
            vec![tag, len]
        } else {
            vec![tag, 0x81, len]
        }
    }

    /// A P-256 `PrivateKeyInfo` around `ec_private_key` (an `ECPrivateKey` of under 128 bytes).
    fn p256_document(ec_private_key: &[u8]) -> Vec<u8> {
        let algorithm: &[u8] = &[
            0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a,
            0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07,
        ];
        let mut body = vec![0x02, 0x01, 0x00];
        body.extend_from_slice(algorithm);
        body.extend_from_slice(&header(0x04, ec_private_key.len()));
        body.extend_from_slice(ec_private_key);
        let mut document = header(0x30, body.len());
        document.extend_from_slice(&body);
        document
    }

    /// An `ECPrivateKey` of `version` with a made-up scalar, then `rest` (its optional fields).
    fn ec_private_key(version: u8, rest: &[u8]) -> Vec<u8> {
        let mut body = vec![0x02, 0x01, version, 0x04, 0x20];
        body.extend_from_slice(&[0x11; 32]);
        body.extend_from_slice(rest);
        let mut key = header(0x30, body.len());
        key.extend_from_slice(&body);
        key
    }

    #[test]
    fn an_ec_private_key_without_its_point_or_of_another_version_or_curve_is_refused() {
        let mut point = vec![0xa1, 0x44, 0x03, 0x42, 0x00, 0x04];
        point.extend_from_slice(&[0x22; 64]);
        // The document with its point is read: the cases below fail for what they name.
        let mut read = vec![0x04];
        read.extend_from_slice(&[0x22; 64]);
        assert_eq!(
            p256_public_point(&p256_document(&ec_private_key(1, &point))).unwrap(),
            read
        );
        assert_eq!(
            p256_public_point(&p256_document(&ec_private_key(1, &[]))).unwrap_err(),
            "the ECPrivateKey carries no public key"
        );
        assert_eq!(
            p256_public_point(&p256_document(&ec_private_key(2, &point))).unwrap_err(),
            "an ECPrivateKey of version 2, not 1"
        );
        // [0] secp384r1 inside a document whose algorithm says P-256.
        let mut p384_then_point = vec![0xa0, 0x07, 0x06, 0x05, 0x2b, 0x81, 0x04, 0x00, 0x22];
        p384_then_point.extend_from_slice(&point);
        assert_eq!(
            p256_public_point(&p256_document(&ec_private_key(1, &p384_then_point))).unwrap_err(),
            "an ECPrivateKey on curve 1.3.132.0.34, its PKCS#8 algorithm on P-256"
        );
        // A byte after the ECPrivateKey, inside the PKCS#8 document's octet string.
        let mut trailing = ec_private_key(1, &point);
        trailing.push(0x00);
        assert!(p256_public_point(&p256_document(&trailing)).is_err());
    }
}
