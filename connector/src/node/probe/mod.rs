//! Probes from the run's probe address to the grant's targets: TCP, HTTP(S), DNS, LDAP.
//!
//! Every probe binds its socket to the probe address and to the VNet device (so it leaves
//! through the sandbox, under the run's containment table, whatever the node's routes say),
//! runs under one deadline, and reports a result: a refused or silent target is a `failed`
//! outcome with a reason, not an RPC error. Targets and expectations come only from the grant.
//! What was received is digested (SHA-256) so a report can show what answered without storing
//! it.
//!
//! The guest is hostile until shown otherwise: every probe reads at most
//! `limits.max_probe_response_bytes` and takes at most `limits.max_probe_entries` LDAP messages
//! or DNS records, and every string it keeps passes through [`certistack_core::untrusted::printable`].
//!
//! HTTPS: the restored guest is untrusted, so its certificate is not verified against any
//! root; it is recorded (SHA-256 of the DER) instead. Nothing the probe learns is trusted or
//! used for anything else.

mod dns;
mod executor;
mod http;
mod ldap;
mod socket;
mod tcp;

use dns::dns;
use http::http;
use ldap::ldap;
use tcp::tcp;

use certistack_core::grant::{ProbeKind, ProbeTarget};
use certistack_core::untrusted::MAX_DETAIL_CHARS;
use sha2::{Digest, Sha256};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// Where a probe leaves and how much it may take in from a guest that is not trusted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeBounds {
    /// The VNet. Every probe socket is bound to it (`SO_BINDTODEVICE`) as well as to the probe
    /// address, so a route through another interface can never carry a probe elsewhere.
    pub device: String,
    /// The whole probe, connection and answer included (`limits.probe_timeout_secs`).
    pub timeout: Duration,
    /// Bytes read from the target at most (`limits.max_probe_response_bytes`).
    pub max_bytes: usize,
    /// LDAP messages or DNS answer records taken at most (`limits.max_probe_entries`).
    pub max_entries: usize,
}

impl ProbeBounds {
    fn bytes_exceeded(&self, target: SocketAddr) -> String {
        format!(
            "stopped reading: {target} sent more than {} bytes (limits.max_probe_response_bytes)",
            self.max_bytes
        )
    }

    fn entries_exceeded(&self, target: SocketAddr, what: &str) -> String {
        format!(
            "stopped reading: {target} sent more than {} {what} (limits.max_probe_entries)",
            self.max_entries
        )
    }
}

/// What one probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeResult {
    pub passed: bool,
    pub detail: String,
    pub latency: Duration,
    pub received_sha256: String,
    pub tls_certificate_sha256: String,
}

impl ProbeResult {
    fn failed(detail: impl Into<String>, latency: Duration) -> Self {
        Self {
            passed: false,
            detail: detail.into(),
            latency,
            received_sha256: String::new(),
            tls_certificate_sha256: String::new(),
        }
    }
}

fn digest(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The detail as it goes to the reply and the journal: each guest value was escaped where it
/// was read; this bounds the whole.
fn capped(mut result: ProbeResult) -> ProbeResult {
    if result.detail.chars().count() > MAX_DETAIL_CHARS {
        let cut: String = result.detail.chars().take(MAX_DETAIL_CHARS).collect();
        let left = result.detail.len() - cut.len();
        result.detail = format!("{cut}…[{left} more bytes]");
    }
    result
}

/// Runs one probe from `source` to `target` within `bounds`.
pub async fn probe_target(
    source: IpAddr,
    target: &ProbeTarget,
    bounds: &ProbeBounds,
) -> ProbeResult {
    let started = Instant::now();
    let address = SocketAddr::new(target.address.0, target.port);
    let expect = &target.expect;
    let work = async {
        match target.kind {
            ProbeKind::Tcp => tcp(source, address, expect, bounds, started).await,
            ProbeKind::Http => http(source, address, false, expect, bounds, started).await,
            ProbeKind::Https => http(source, address, true, expect, bounds, started).await,
            ProbeKind::Dns => dns(source, address, expect, bounds, started).await,
            ProbeKind::Ldap => ldap(source, address, expect, bounds, started).await,
        }
    };
    match tokio::time::timeout(bounds.timeout, work).await {
        Ok(result) => capped(result),
        Err(_) => ProbeResult::failed(
            format!("no answer from {address} within {:?}", bounds.timeout),
            started.elapsed(),
        ),
    }
}

#[cfg(test)]
mod tests;
