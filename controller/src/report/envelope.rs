//! The DSSE envelope of a report: its pre-authentication encoding, the report-signing key,
//! signing and verifying, and reading and writing report files.

use super::*;

/// The DSSE pre-authentication encoding: `"DSSEv1" SP len(type) SP type SP len(body) SP body`,
/// lengths as ASCII decimal byte counts. This is what is signed, never the JSON around it.
pub fn pae(payload_type: &str, payload: &[u8]) -> Vec<u8> {
    let mut encoded = Vec::with_capacity(payload_type.len() + payload.len() + 32);
    encoded.extend_from_slice(b"DSSEv1 ");
    encoded.extend_from_slice(payload_type.len().to_string().as_bytes());
    encoded.push(b' ');
    encoded.extend_from_slice(payload_type.as_bytes());
    encoded.push(b' ');
    encoded.extend_from_slice(payload.len().to_string().as_bytes());
    encoded.push(b' ');
    encoded.extend_from_slice(payload);
    encoded
}

/// The key id a signature names: `sha256:` and the hex SHA-256 of the public key's
/// SubjectPublicKeyInfo DER (the bytes of the `.pub` PEM file's body).
pub fn key_id(key: &VerifyingKey) -> Result<String, ReportError> {
    let der = key
        .to_public_key_der()
        .map_err(|e| ReportError::Encode(e.to_string()))?;
    Ok(format!(
        "sha256:{}",
        hex::encode(Sha256::digest(der.as_bytes()))
    ))
}

/// Reads a report-signing public key (PEM SubjectPublicKeyInfo, as `ca init` writes it).
pub fn load_public_key(path: &Path) -> Result<VerifyingKey, ReportError> {
    let pem = files::read_trusted(path)?;
    VerifyingKey::from_public_key_pem(&pem).map_err(|e| ReportError::Key {
        path: path.to_owned(),
        reason: format!("not an Ed25519 public key in PEM: {e}"),
    })
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Envelope {
    /// The statement's JSON, standard base64 with padding.
    pub payload: String,
    #[serde(rename = "payloadType")]
    pub payload_type: String,
    pub signatures: Vec<EnvelopeSignature>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvelopeSignature {
    pub keyid: String,
    /// The Ed25519 signature over [`pae`], standard base64 with padding.
    pub sig: String,
}

/// Signs `statement` with the report-signing key.
pub fn sign(statement: &Statement, key: &SigningKey) -> Result<Envelope, ReportError> {
    let payload = serde_json::to_vec(statement).map_err(|e| ReportError::Encode(e.to_string()))?;
    let signature = key.sign(&pae(PAYLOAD_TYPE, &payload));
    Ok(Envelope {
        payload: BASE64.encode(&payload),
        payload_type: PAYLOAD_TYPE.to_owned(),
        signatures: vec![EnvelopeSignature {
            keyid: key_id(&key.verifying_key())?,
            sig: BASE64.encode(signature.to_bytes()),
        }],
    })
}

/// Verifies a report's bytes with `key`: envelope, key id, signature, statement, journal.
pub fn verify(bytes: &[u8], key: &VerifyingKey) -> Result<Statement, ReportError> {
    let envelope: Envelope =
        serde_json::from_slice(bytes).map_err(|e| ReportError::Envelope(e.to_string()))?;
    if envelope.payload_type != PAYLOAD_TYPE {
        return Err(ReportError::PayloadType(envelope.payload_type));
    }
    let [signature] = envelope.signatures.as_slice() else {
        return Err(ReportError::SignatureCount(envelope.signatures.len()));
    };
    let expected = key_id(key)?;
    if signature.keyid != expected {
        return Err(ReportError::KeyId {
            found: signature.keyid.clone(),
            expected,
        });
    }
    let payload = BASE64
        .decode(&envelope.payload)
        .map_err(|e| ReportError::Envelope(format!("payload: {e}")))?;
    let sig = BASE64
        .decode(&signature.sig)
        .map_err(|e| ReportError::Envelope(format!("sig: {e}")))?;
    let sig = Signature::from_slice(&sig).map_err(|_| ReportError::Signature)?;
    key.verify_strict(&pae(&envelope.payload_type, &payload), &sig)
        .map_err(|_| ReportError::Signature)?;
    let statement: Statement =
        serde_json::from_slice(&payload).map_err(|e| ReportError::Statement(e.to_string()))?;
    statement.check()?;
    Ok(statement)
}

/// Reads a report file, refusing one over [`MAX_REPORT_BYTES`].
pub fn read(path: &Path) -> Result<Vec<u8>, ReportError> {
    use std::io::Read;
    let read_error = |error| FileError::Read {
        path: path.to_owned(),
        error,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let mut bytes = Vec::new();
    file.take(MAX_REPORT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() as u64 > MAX_REPORT_BYTES {
        return Err(ReportError::TooLarge {
            path: path.to_owned(),
            size: bytes.len() as u64,
        });
    }
    Ok(bytes)
}

/// `<UTC time>-<node>-<run id>.json`, the time as `YYYYMMDDTHHMMSSZ`.
pub fn file_name(at: OffsetDateTime, node: &str, run_id: &str) -> Result<String, ReportError> {
    NodeName::validate(node).map_err(|e| ReportError::Name(format!("node {node:?}: {e}")))?;
    RunId::validate(run_id).map_err(|e| ReportError::Name(format!("run id {run_id:?}: {e}")))?;
    let at = at.to_offset(time::UtcOffset::UTC);
    Ok(format!(
        "{:04}{:02}{:02}T{:02}{:02}{:02}Z-{node}-{run_id}.json",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second()
    ))
}

/// Signs `statement` and writes it into `reports_dir` (created 0700 when missing) atomically:
/// temporary file, fsync, rename, fsync of the directory; the report is 0600. Returns its path.
pub fn write(
    reports_dir: &Path,
    statement: &Statement,
    key: &SigningKey,
    at: OffsetDateTime,
) -> Result<PathBuf, ReportError> {
    let predicate = &statement.predicate;
    let path = reports_dir.join(file_name(at, &predicate.node, &predicate.run_id)?);
    let mut bytes = serde_json::to_vec(&sign(statement, key)?)
        .map_err(|e| ReportError::Encode(e.to_string()))?;
    bytes.push(b'\n');
    files::create_private_dir(reports_dir)?;
    files::write_atomic(&path, &bytes, 0o600)?;
    Ok(path)
}
