//! Client identities, encoded as URI SANs of certificates issued by the controller CA.
//!
//! - operator: `urn:certistack:operator:<name>`: recovery and inspection only;
//! - run: `urn:certistack:run:<uuid>` + `urn:certistack:grant:sha256:<hex>` +
//!   `urn:certistack:node:<node>`: one run's operations on one node, within one grant.
//!
//! The certificate profile, enforced on every client certificate after the handshake:
//!
//! - the extended key usage extension is present and lists `clientAuth` (webpki alone accepts a
//!   certificate without the extension for any purpose);
//! - the subject alternative names are URIs only, and exactly the identity's: one operator URI,
//!   or exactly the run, grant and node URIs, with the grant digest in lower-case hex. A DNS,
//!   IP or e-mail name, or any other URI, is refused.
//!
//! Node certificates ([`check_node_certificate`], checked by the controller when it connects and
//! by `enroll --install`) list `serverAuth` and carry exactly one DNS name, the node's.
//!
//! The chain and the validity window are checked by rustls during the handshake; the validity
//! window is checked again on every call, because a connection can outlive its certificate.

use crate::validate::{NodeName, RunId, Validated};
use std::fmt;
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

pub const OPERATOR_PREFIX: &str = "urn:certistack:operator:";
pub const RUN_PREFIX: &str = "urn:certistack:run:";
pub const GRANT_PREFIX: &str = "urn:certistack:grant:sha256:";
pub const NODE_PREFIX: &str = "urn:certistack:node:";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    Operator {
        name: String,
    },
    Run {
        run_id: RunId,
        grant_sha256: [u8; 32],
        node: NodeName,
    },
}

impl Identity {
    pub fn kind(&self) -> IdentityKind {
        match self {
            Identity::Operator { .. } => IdentityKind::Operator,
            Identity::Run { .. } => IdentityKind::Run,
        }
    }

    /// The URI SANs a certificate for this identity carries.
    pub fn uris(&self) -> Vec<String> {
        match self {
            Identity::Operator { name } => vec![format!("{OPERATOR_PREFIX}{name}")],
            Identity::Run {
                run_id,
                grant_sha256,
                node,
            } => vec![
                format!("{RUN_PREFIX}{run_id}"),
                format!("{GRANT_PREFIX}{}", hex::encode(grant_sha256)),
                format!("{NODE_PREFIX}{node}"),
            ],
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Operator { name } => write!(f, "operator:{name}"),
            Identity::Run { run_id, .. } => write!(f, "run:{run_id}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IdentityKind {
    Operator,
    Run,
}

/// What the connector knows about the client of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    pub identity: Identity,
    pub not_before_unix: i64,
    pub not_after_unix: i64,
    pub serial_hex: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("the client certificate cannot be parsed: {0}")]
    Unparsable(String),
    #[error(
        "the client certificate carries no CertiStack identity (a urn:certistack:operator: or urn:certistack:run: URI SAN)"
    )]
    Missing,
    #[error("the client certificate carries {0}; exactly one identity is allowed")]
    Ambiguous(String),
    #[error("the client certificate's identity is malformed: {0}")]
    Malformed(String),
    #[error(
        "the client certificate is not a CertiStack client certificate: {0}; issue it with certistack-ctl"
    )]
    Profile(String),
}

/// Why a node certificate does not fit the node profile.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the node certificate is not a CertiStack node certificate: {0}; sign the node's CSR with certistack-ctl node sign"
)]
pub struct NodeProfileError(pub String);

/// Operator names: `[a-z0-9][a-z0-9._-]{0,63}`.
pub fn check_operator_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let lower_digit = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    if name.len() <= 64
        && matches!(chars.next(), Some(c) if lower_digit(c))
        && chars.all(|c| lower_digit(c) || matches!(c, '.' | '_' | '-'))
    {
        Ok(())
    } else {
        Err(format!(
            "operator name {name:?} must be lower-case letters, digits, `.`, `_`, `-` (at most 64)"
        ))
    }
}

/// Reads the identity of a client certificate (DER).
pub fn parse_client_certificate(der: &[u8]) -> Result<ClientIdentity, IdentityError> {
    let (_, cert) =
        X509Certificate::from_der(der).map_err(|e| IdentityError::Unparsable(e.to_string()))?;
    let profile = |reason: &str| IdentityError::Profile(reason.to_owned());
    let usage = cert
        .extended_key_usage()
        .map_err(|e| IdentityError::Unparsable(e.to_string()))?
        .ok_or_else(|| profile("it has no extended key usage (clientAuth is required)"))?;
    if !usage.value.client_auth {
        return Err(profile("its extended key usage does not list clientAuth"));
    }
    let names = cert
        .subject_alternative_name()
        .map_err(|e| IdentityError::Unparsable(e.to_string()))?
        .map(|san| san.value.general_names.as_slice())
        .unwrap_or_default();
    let mut uris = Vec::new();
    for name in names {
        match name {
            GeneralName::URI(uri) => uris.push(*uri),
            other => {
                return Err(IdentityError::Profile(format!(
                    "it carries the subject alternative name {other}; only the identity's URIs are allowed"
                )));
            }
        }
    }
    if let Some(other) = uris.iter().find(|uri| {
        ![OPERATOR_PREFIX, RUN_PREFIX, GRANT_PREFIX, NODE_PREFIX]
            .iter()
            .any(|prefix| uri.starts_with(prefix))
    }) {
        return Err(IdentityError::Profile(format!(
            "it carries the URI {other:?}, which is not part of a CertiStack identity"
        )));
    }
    let identity = identity_from_uris(&uris)?;
    Ok(ClientIdentity {
        identity,
        not_before_unix: cert.validity().not_before.timestamp(),
        not_after_unix: cert.validity().not_after.timestamp(),
        serial_hex: hex::encode(cert.raw_serial()),
    })
}

/// Checks a node certificate (DER) against the node profile: `serverAuth` listed, and exactly one
/// subject alternative name, a DNS name. That it is the expected node's name is the TLS server
/// name check's business.
pub fn check_node_certificate(der: &[u8]) -> Result<(), NodeProfileError> {
    let fail = |reason: String| NodeProfileError(reason);
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| fail(e.to_string()))?;
    let usage = cert
        .extended_key_usage()
        .map_err(|e| fail(e.to_string()))?
        .ok_or_else(|| fail("it has no extended key usage (serverAuth is required)".into()))?;
    if !usage.value.server_auth {
        return Err(fail(
            "its extended key usage does not list serverAuth".into(),
        ));
    }
    let names = cert
        .subject_alternative_name()
        .map_err(|e| fail(e.to_string()))?
        .map(|san| san.value.general_names.as_slice())
        .unwrap_or_default();
    match names {
        [GeneralName::DNSName(_)] => Ok(()),
        _ => Err(fail(format!(
            "it carries {} subject alternative names ({}); a node certificate carries exactly its node name",
            names.len(),
            names
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

fn single<'a>(
    uris: &[&'a str],
    prefix: &str,
    what: &str,
) -> Result<Option<&'a str>, IdentityError> {
    let found: Vec<&str> = uris.iter().filter_map(|u| u.strip_prefix(prefix)).collect();
    match found.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(one)),
        _ => Err(IdentityError::Ambiguous(format!(
            "{} {what} URIs",
            found.len()
        ))),
    }
}

fn identity_from_uris(uris: &[&str]) -> Result<Identity, IdentityError> {
    let operator = single(uris, OPERATOR_PREFIX, "operator")?;
    let run = single(uris, RUN_PREFIX, "run")?;
    let grant = single(uris, GRANT_PREFIX, "grant")?;
    let node = single(uris, NODE_PREFIX, "node")?;
    match (operator, run) {
        (Some(_), Some(_)) => Err(IdentityError::Ambiguous(
            "both an operator and a run identity".into(),
        )),
        (None, None) => Err(IdentityError::Missing),
        (Some(name), None) => {
            if grant.is_some() || node.is_some() {
                return Err(IdentityError::Malformed(
                    "an operator certificate must not name a grant or a node".into(),
                ));
            }
            check_operator_name(name).map_err(IdentityError::Malformed)?;
            Ok(Identity::Operator {
                name: name.to_owned(),
            })
        }
        (None, Some(run)) => {
            let run_id = RunId::validate(run).map_err(IdentityError::Malformed)?;
            let grant = grant.ok_or_else(|| {
                IdentityError::Malformed("a run certificate must carry its grant digest".into())
            })?;
            let node = node.ok_or_else(|| {
                IdentityError::Malformed("a run certificate must name its node".into())
            })?;
            let mut grant_sha256 = [0u8; 32];
            let lower_hex = grant
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
            if !lower_hex {
                return Err(IdentityError::Malformed(format!(
                    "grant digest {grant:?} is not 64 lower-case hex characters"
                )));
            }
            hex::decode_to_slice(grant, &mut grant_sha256).map_err(|_| {
                IdentityError::Malformed(format!(
                    "grant digest {grant:?} is not 64 lower-case hex characters"
                ))
            })?;
            let node = NodeName::validate(node).map_err(IdentityError::Malformed)?;
            Ok(Identity::Run {
                run_id,
                grant_sha256,
                node,
            })
        }
    }
}

/// `sha256:<hex>` of a certificate's DER: the CA fingerprint `enroll --install` requires.
pub fn ca_fingerprint(der: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    format!("sha256:{}", hex::encode(Sha256::digest(der)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const RUN: &str = "urn:certistack:run:0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f";
    const NODE: &str = "urn:certistack:node:pve1";

    fn grant_uri() -> String {
        format!("{GRANT_PREFIX}{}", "ab".repeat(32))
    }

    #[test]
    fn run_identity_needs_all_three_uris() {
        let grant = grant_uri();
        assert!(matches!(
            identity_from_uris(&[RUN, &grant, NODE]),
            Ok(Identity::Run { .. })
        ));
        assert!(matches!(
            identity_from_uris(&[RUN, NODE]),
            Err(IdentityError::Malformed(_))
        ));
        assert!(matches!(
            identity_from_uris(&[RUN, &grant]),
            Err(IdentityError::Malformed(_))
        ));
        assert!(matches!(
            identity_from_uris(&[RUN, RUN, &grant, NODE]),
            Err(IdentityError::Ambiguous(_))
        ));
        let upper = format!("{GRANT_PREFIX}{}", "AB".repeat(32));
        assert!(matches!(
            identity_from_uris(&[RUN, &upper, NODE]),
            Err(IdentityError::Malformed(m)) if m.contains("lower-case")
        ));
        let short = format!("{GRANT_PREFIX}abcd");
        assert!(matches!(
            identity_from_uris(&[RUN, &short, NODE]),
            Err(IdentityError::Malformed(_))
        ));
    }

    #[test]
    fn operator_identity_is_exclusive() {
        assert_eq!(
            identity_from_uris(&["urn:certistack:operator:alice"]),
            Ok(Identity::Operator {
                name: "alice".into()
            })
        );
        assert!(matches!(
            identity_from_uris(&["urn:certistack:operator:alice", RUN]),
            Err(IdentityError::Ambiguous(_))
        ));
        assert!(matches!(
            identity_from_uris(&["urn:certistack:operator:alice", NODE]),
            Err(IdentityError::Malformed(_))
        ));
        assert!(matches!(
            identity_from_uris(&["urn:certistack:operator:Al ice"]),
            Err(IdentityError::Malformed(_))
        ));
        assert_eq!(
            identity_from_uris(&["https://example.org"]),
            Err(IdentityError::Missing)
        );
        assert_eq!(identity_from_uris(&[]), Err(IdentityError::Missing));
    }

    #[test]
    fn uris_round_trip() {
        let identity = Identity::Run {
            run_id: RunId::validate("0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f").unwrap(),
            grant_sha256: [7; 32],
            node: NodeName::validate("pve1").unwrap(),
        };
        let uris = identity.uris();
        let refs: Vec<&str> = uris.iter().map(String::as_str).collect();
        assert_eq!(identity_from_uris(&refs), Ok(identity));
    }
}
