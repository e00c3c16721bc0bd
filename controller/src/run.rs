//! Per-run credentials: a signed grant and a client certificate bound to it.
//!
//! The certificate names the run, the node and SHA-256 of the grant bytes, and expires no later
//! than the grant's deadline, so a stolen certificate is useless for another run, another node,
//! another grant or after the deadline.

use crate::authority::{Authority, AuthorityError, IssuedCertificate};
use certistack_core::grant::{self, GrantError};
use certistack_core::identity::Identity;
use certistack_proto::v1 as pb;
use time::OffsetDateTime;

#[derive(Debug, thiserror::Error)]
pub enum MintError {
    #[error("the grant would be refused by the connector: {0}")]
    Grant(#[from] GrantError),
    #[error(transparent)]
    Authority(#[from] AuthorityError),
    #[error("the grant's deadline {0} is not a valid time")]
    Deadline(i64),
}

#[derive(Debug)]
pub struct RunCredentials {
    pub signed_grant: pb::SignedRunGrant,
    pub grant_sha256: [u8; 32],
    pub certificate: IssuedCertificate,
}

/// Signs `grant` and issues the run certificate for it, valid from `now` (less the tolerated
/// skew) until the grant's deadline. The grant is checked with the connector's own parser as it
/// is signed (`grant::sign_checked`), so the controller never mints credentials a node would
/// refuse for their form.
pub fn mint(
    authority: &Authority,
    grant: &pb::RunGrant,
    now: OffsetDateTime,
) -> Result<RunCredentials, MintError> {
    let (signed_grant, parsed) = grant::sign_checked(authority.run_authority(), grant)?;
    let not_after = OffsetDateTime::from_unix_timestamp(parsed.deadline_unix)
        .map_err(|_| MintError::Deadline(parsed.deadline_unix))?;
    let identity = Identity::Run {
        run_id: parsed.run_id.clone(),
        grant_sha256: parsed.digest,
        node: parsed.node.clone(),
    };
    let certificate =
        authority.issue_client(&identity, now - time::Duration::seconds(60), not_after)?;
    Ok(RunCredentials {
        signed_grant,
        grant_sha256: parsed.digest,
        certificate,
    })
}
