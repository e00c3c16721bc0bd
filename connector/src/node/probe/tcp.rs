//! The TCP probe: connect, and when the grant expects one, read and judge the banner's first
//! line.

use super::socket::{connect, connect_failed};
use super::{ProbeBounds, ProbeResult, digest};
use certistack_core::grant::Expectation;
use certistack_core::untrusted::{MAX_VALUE_CHARS, printable};
use std::net::{IpAddr, SocketAddr};
use std::time::Instant;
use tokio::io::AsyncReadExt;

/// Bytes of a TCP banner read at most: its first line is what is judged.
const MAX_BANNER_BYTES: usize = 4096;

pub(super) async fn tcp(
    source: IpAddr,
    target: SocketAddr,
    expect: &Expectation,
    bounds: &ProbeBounds,
    started: Instant,
) -> ProbeResult {
    let mut stream = match connect(source, target, &bounds.device).await {
        Ok(stream) => stream,
        Err(error) => return connect_failed(target, &error, started),
    };
    let latency = started.elapsed();
    let Some(prefix) = &expect.banner_prefix else {
        return ProbeResult {
            passed: true,
            detail: format!("connected to {target}"),
            latency,
            ..ProbeResult::failed("", latency)
        };
    };
    // Read until the banner's first line is complete or the prefix can be judged.
    let cap = MAX_BANNER_BYTES.min(bounds.max_bytes);
    let mut received = Vec::new();
    let mut chunk = [0u8; 512];
    while received.len() < cap && !received.contains(&b'\n') {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => received.extend_from_slice(chunk.get(..n).unwrap_or_default()),
        }
    }
    received.truncate(cap);
    let line = received.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let passed = line.starts_with(prefix.as_str().as_bytes());
    let banner = printable(line, MAX_VALUE_CHARS);
    ProbeResult {
        passed,
        detail: if passed {
            format!("banner \"{banner}\"")
        } else {
            format!(
                "banner \"{banner}\" does not start with {:?}",
                prefix.as_str()
            )
        },
        latency,
        received_sha256: digest(&received),
        tls_certificate_sha256: String::new(),
    }
}
