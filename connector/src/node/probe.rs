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

use super::NodeExecutor;
use super::resources::{self, Resource, Standing};
use crate::executor::{ExecError, Outcome};
use crate::runs::RunHandle;
use certistack_core::grant::{Expectation, ProbeKind, ProbeTarget};
use certistack_core::journal::Phase;
use certistack_core::untrusted::{MAX_DETAIL_CHARS, MAX_VALUE_CHARS, printable};
use certistack_core::validate::UnicastIp;
use certistack_proto::v1 as pb;
use serde_json::json;
use sha2::{Digest, Sha256};
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpSocket, TcpStream, UdpSocket};

/// Bytes of a TCP banner read at most: its first line is what is judged.
const MAX_BANNER_BYTES: usize = 4096;

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

/// A stream that refuses to read more than its budget: past it, reads fail and `exceeded` is
/// set, so the probe reports the cap rather than whatever error the protocol layer makes of it.
struct Bounded<S> {
    inner: S,
    remaining: usize,
    exceeded: Arc<AtomicBool>,
}

impl<S> Bounded<S> {
    fn new(inner: S, budget: usize) -> Self {
        Self {
            inner,
            remaining: budget,
            exceeded: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Bounded<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        if this.remaining == 0 {
            this.exceeded.store(true, Ordering::SeqCst);
            return Poll::Ready(Err(std::io::Error::other(
                "the probe's read budget is spent",
            )));
        }
        let mut chunk = [0u8; 8192];
        let want = buf.remaining().min(this.remaining).min(chunk.len());
        let Some(window) = chunk.get_mut(..want) else {
            return Poll::Ready(Ok(()));
        };
        let mut limited = ReadBuf::new(window);
        match Pin::new(&mut this.inner).poll_read(cx, &mut limited) {
            Poll::Ready(Ok(())) => {
                let got = limited.filled();
                this.remaining = this.remaining.saturating_sub(got.len());
                buf.put_slice(got);
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Bounded<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A TCP connection from `source` on `device` only.
async fn connect(source: IpAddr, target: SocketAddr, device: &str) -> std::io::Result<TcpStream> {
    let socket = if source.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.bind_device(Some(device.as_bytes()))?;
    socket.bind(SocketAddr::new(source, 0))?;
    socket.connect(target).await
}

fn connect_failed(target: SocketAddr, error: &std::io::Error, started: Instant) -> ProbeResult {
    ProbeResult::failed(
        format!("connect to {target} failed: {error}"),
        started.elapsed(),
    )
}

async fn tcp(
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

/// Accepts whatever certificate the guest presents and records it: the guest is probed, not
/// trusted. Signatures are still checked to be well-formed by the provider.
#[derive(Debug)]
struct RecordingVerifier {
    presented: Mutex<Option<Vec<u8>>>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl rustls::client::danger::ServerCertVerifier for RecordingVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        if let Ok(mut presented) = self.presented.lock() {
            *presented = Some(end_entity.to_vec());
        }
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

async fn http(
    source: IpAddr,
    target: SocketAddr,
    tls: bool,
    expect: &Expectation,
    bounds: &ProbeBounds,
    started: Instant,
) -> ProbeResult {
    use http_body_util::BodyExt;
    let stream = match connect(source, target, &bounds.device).await {
        Ok(stream) => Bounded::new(stream, bounds.max_bytes),
        Err(error) => return connect_failed(target, &error, started),
    };
    let exceeded = stream.exceeded.clone();
    let path = expect.http_path.as_ref().map_or("/", |p| p.as_str());
    let request = match hyper::Request::get(path)
        .header(hyper::header::HOST, target.ip().to_string())
        .header(hyper::header::USER_AGENT, "certistack-probe")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
    {
        Ok(request) => request,
        Err(error) => {
            return ProbeResult::failed(
                format!("cannot build the request: {error}"),
                started.elapsed(),
            );
        }
    };
    let mut certificate = String::new();
    let response = if tls {
        let provider = certistack_core::tls::provider();
        let verifier = Arc::new(RecordingVerifier {
            presented: Mutex::new(None),
            provider: provider.clone(),
        });
        let config = match rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
        {
            Ok(builder) => builder
                .dangerous()
                .with_custom_certificate_verifier(verifier.clone())
                .with_no_client_auth(),
            Err(error) => {
                return ProbeResult::failed(format!("TLS setup: {error}"), started.elapsed());
            }
        };
        let name = rustls::pki_types::ServerName::IpAddress(target.ip().into());
        let stream = match tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, stream)
            .await
        {
            Ok(stream) => stream,
            Err(error) => {
                let reason = if exceeded.load(Ordering::SeqCst) {
                    bounds.bytes_exceeded(target)
                } else {
                    format!(
                        "TLS handshake with {target} failed: {}",
                        printable(error.to_string().as_bytes(), MAX_VALUE_CHARS)
                    )
                };
                return ProbeResult::failed(reason, started.elapsed());
            }
        };
        certificate = verifier
            .presented
            .lock()
            .ok()
            .and_then(|p| p.as_deref().map(digest))
            .unwrap_or_default();
        send(hyper_util::rt::TokioIo::new(stream), request).await
    } else {
        send(hyper_util::rt::TokioIo::new(stream), request).await
    };
    let failed = |what: &str, error: &dyn std::fmt::Display, latency: Duration| {
        let reason = if exceeded.load(Ordering::SeqCst) {
            bounds.bytes_exceeded(target)
        } else {
            format!(
                "{what}: {}",
                printable(error.to_string().as_bytes(), MAX_VALUE_CHARS)
            )
        };
        let mut result = ProbeResult::failed(reason, latency);
        result.tls_certificate_sha256 = certificate.clone();
        result
    };
    let (response, _connection) = match response {
        Ok(exchange) => exchange,
        Err(error) => {
            return failed(
                &format!("HTTP exchange with {target} failed"),
                &error,
                started.elapsed(),
            );
        }
    };
    let latency = started.elapsed();
    let status = response.status().as_u16();
    let body = match http_body_util::Limited::new(response.into_body(), bounds.max_bytes)
        .collect()
        .await
    {
        Ok(body) => body.to_bytes(),
        Err(error) => return failed("reading the body failed", &error, latency),
    };
    let body_sha256 = digest(&body);
    let mut problems = Vec::new();
    let expected_status = expect.http_status.unwrap_or(200);
    if status != expected_status {
        problems.push(format!("status {status}, expected {expected_status}"));
    }
    if let Some(needle) = &expect.body_contains
        && !String::from_utf8_lossy(&body).contains(needle.as_str())
    {
        problems.push(format!("body does not contain {:?}", needle.as_str()));
    }
    if let Some(sha) = &expect.body_sha256
        && sha.as_str() != body_sha256
    {
        problems.push(format!("body SHA-256 {body_sha256} is not {sha}"));
    }
    ProbeResult {
        passed: problems.is_empty(),
        detail: if problems.is_empty() {
            format!("status {status}, {} body bytes", body.len())
        } else {
            problems.join("; ")
        },
        latency,
        received_sha256: body_sha256,
        tls_certificate_sha256: certificate,
    }
}

/// Aborts the connection task when the probe is done or dropped (its timeout), so no task
/// keeps reading from the guest after the probe has reported.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

type HttpExchange = (
    hyper::Response<hyper::body::Incoming>,
    AbortOnDrop<Result<(), hyper::Error>>,
);

async fn send<T>(
    io: hyper_util::rt::TokioIo<T>,
    request: hyper::Request<http_body_util::Empty<bytes::Bytes>>,
) -> Result<HttpExchange, hyper::Error>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io).await?;
    let driver = AbortOnDrop(tokio::spawn(connection));
    let response = sender.send_request(request).await?;
    Ok((response, driver))
}

fn dns_type(kind: certistack_proto::v1::DnsRecordType) -> hickory_proto::rr::RecordType {
    use certistack_proto::v1::DnsRecordType as T;
    use hickory_proto::rr::RecordType;
    match kind {
        T::Aaaa => RecordType::AAAA,
        T::Cname => RecordType::CNAME,
        T::Mx => RecordType::MX,
        T::Txt => RecordType::TXT,
        T::Srv => RecordType::SRV,
        T::Ptr => RecordType::PTR,
        T::A | T::Unspecified => RecordType::A,
    }
}

async fn dns(
    source: IpAddr,
    target: SocketAddr,
    expect: &Expectation,
    bounds: &ProbeBounds,
    started: Instant,
) -> ProbeResult {
    use hickory_proto::op::{Message, Query};
    use hickory_proto::rr::Name;
    let Some(name) = &expect.dns_name else {
        return ProbeResult::failed(
            "the grant names no DNS query for this target",
            started.elapsed(),
        );
    };
    let record_type = dns_type(
        expect
            .dns_type
            .unwrap_or(certistack_proto::v1::DnsRecordType::A),
    );
    let query_name = match Name::from_ascii(name.as_str()) {
        Ok(n) => n,
        Err(error) => {
            return ProbeResult::failed(format!("query name {name}: {error}"), started.elapsed());
        }
    };
    let mut message = Message::query();
    message.add_query(Query::query(query_name, record_type));
    message.metadata.recursion_desired = true;
    let id = message.metadata.id;
    let bytes = match message.to_vec() {
        Ok(bytes) => bytes,
        Err(error) => {
            return ProbeResult::failed(
                format!("cannot encode the query: {error}"),
                started.elapsed(),
            );
        }
    };
    let socket = match UdpSocket::bind(SocketAddr::new(source, 0)).await {
        Ok(socket) => socket,
        Err(error) => {
            return ProbeResult::failed(
                format!("cannot bind {source}: {error}"),
                started.elapsed(),
            );
        }
    };
    if let Err(error) = socket.bind_device(Some(bounds.device.as_bytes())) {
        return ProbeResult::failed(
            format!("cannot bind the probe socket to {}: {error}", bounds.device),
            started.elapsed(),
        );
    }
    if let Err(error) = socket.send_to(&bytes, target).await {
        return ProbeResult::failed(
            format!("sending to {target} failed: {error}"),
            started.elapsed(),
        );
    }
    // One datagram is at most 64 KiB; every datagram that arrives, the target's or a spoofer's,
    // counts against the probe's byte budget.
    let mut buffer = vec![0u8; 65_535];
    let mut read_total = 0usize;
    let received = loop {
        match socket.recv_from(&mut buffer).await {
            Ok((n, from)) => {
                read_total = read_total.saturating_add(n);
                if read_total > bounds.max_bytes {
                    return ProbeResult::failed(bounds.bytes_exceeded(target), started.elapsed());
                }
                if from == target {
                    break buffer.get(..n).unwrap_or_default();
                }
            }
            Err(error) => {
                return ProbeResult::failed(
                    format!("receiving from {target} failed: {error}"),
                    started.elapsed(),
                );
            }
        }
    };
    let latency = started.elapsed();
    // The header announces how many records follow; refuse to decode more than the cap.
    let announced = |at: usize| match (received.get(at), received.get(at + 1)) {
        (Some(high), Some(low)) => usize::from(u16::from_be_bytes([*high, *low])),
        _ => 0,
    };
    let records = announced(6) + announced(8) + announced(10);
    if records > bounds.max_entries {
        let mut result = ProbeResult::failed(
            format!(
                "{}: the answer announces {records} records",
                bounds.entries_exceeded(target, "DNS records")
            ),
            latency,
        );
        result.received_sha256 = digest(received);
        return result;
    }
    let answer = match Message::from_vec(received) {
        Ok(answer) if answer.metadata.id == id => answer,
        Ok(_) => return ProbeResult::failed("the answer's id does not match the query", latency),
        Err(error) => {
            return ProbeResult::failed(
                format!(
                    "the answer does not decode: {}",
                    printable(error.to_string().as_bytes(), MAX_VALUE_CHARS)
                ),
                latency,
            );
        }
    };
    let mut answers: Vec<String> = answer
        .answers
        .iter()
        .filter(|r| r.record_type() == record_type)
        .map(|r| r.data.to_string())
        .collect();
    answers.sort();
    let mut expected: Vec<String> = expect
        .dns_answers
        .iter()
        .map(|a| a.as_str().to_owned())
        .collect();
    expected.sort();
    let code = answer.metadata.response_code;
    let passed = if expected.is_empty() {
        !answers.is_empty()
    } else {
        answers == expected
    };
    let shown: Vec<String> = answers
        .iter()
        .map(|a| format!("\"{}\"", printable(a.as_bytes(), MAX_VALUE_CHARS)))
        .collect();
    ProbeResult {
        passed,
        detail: format!(
            "{code} {record_type} {name}: [{}]{}",
            shown.join(", "),
            if passed || expected.is_empty() {
                String::new()
            } else {
                format!(", expected {expected:?}")
            }
        ),
        latency,
        received_sha256: digest(received),
        tls_certificate_sha256: String::new(),
    }
}

/// One BER element (definite length, low tag numbers: all LDAP needs): its tag and contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ber<'a> {
    tag: u8,
    body: &'a [u8],
}

/// The length that follows a tag: `(length, bytes it took)`, or `None` when it is indefinite,
/// longer than four bytes or not all there.
fn ber_length(input: &[u8]) -> Option<(usize, usize)> {
    let first = *input.first()?;
    if first < 0x80 {
        return Some((usize::from(first), 1));
    }
    let count = usize::from(first & 0x7f);
    if count == 0 || count > 4 {
        return None;
    }
    let bytes = input.get(1..=count)?;
    let length = bytes
        .iter()
        .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
    Some((length, 1 + count))
}

/// Splits one element off the front of `input`.
fn ber(input: &[u8]) -> Option<(Ber<'_>, &[u8])> {
    let tag = *input.first()?;
    if tag & 0x1f == 0x1f {
        return None;
    }
    let (length, taken) = ber_length(input.get(1..)?)?;
    let start = 1 + taken;
    let body = input.get(start..start.checked_add(length)?)?;
    let rest = input.get(start + length..)?;
    Some((Ber { tag, body }, rest))
}

/// Every element inside a constructed element, in order; `None` if one is malformed.
fn ber_children(mut body: &[u8]) -> Option<Vec<Ber<'_>>> {
    let mut children = Vec::new();
    while !body.is_empty() {
        let (child, rest) = ber(body)?;
        children.push(child);
        body = rest;
    }
    Some(children)
}

fn ber_uint(body: &[u8]) -> Option<u64> {
    if body.is_empty() || body.len() > 8 {
        return None;
    }
    Some(body.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
}

/// The parts of an LDAP answer the probe looks at (RFC 4511 section 4).
#[derive(Debug, Clone, PartialEq, Eq)]
enum LdapAnswer<'a> {
    /// BindResponse or SearchResultDone: the result code and the diagnostic message.
    Result { code: u64, message: &'a [u8] },
    /// SearchResultEntry: the values of `namingContexts`.
    Entry { naming_contexts: Vec<&'a [u8]> },
    /// Any other operation, by its tag.
    Other(u8),
}

const LDAP_BIND_RESPONSE: u8 = 0x61;
const LDAP_SEARCH_RESULT_ENTRY: u8 = 0x64;
const LDAP_SEARCH_RESULT_DONE: u8 = 0x65;

/// Decodes one LDAPMessage's contents: `(messageID, operation)`.
fn ldap_answer(message: &[u8]) -> Option<(u64, LdapAnswer<'_>)> {
    let children = ber_children(message)?;
    let id = children.first().filter(|c| c.tag == 0x02)?;
    let id = ber_uint(id.body)?;
    let op = children.get(1)?;
    let answer = match op.tag {
        LDAP_BIND_RESPONSE | LDAP_SEARCH_RESULT_DONE => {
            let parts = ber_children(op.body)?;
            let code = ber_uint(parts.first().filter(|p| p.tag == 0x0a)?.body)?;
            let message = parts.get(2).filter(|p| p.tag == 0x04)?.body;
            LdapAnswer::Result { code, message }
        }
        LDAP_SEARCH_RESULT_ENTRY => {
            let parts = ber_children(op.body)?;
            let attributes = parts.get(1).filter(|p| p.tag == 0x30)?;
            let mut naming_contexts = Vec::new();
            for attribute in ber_children(attributes.body)? {
                let fields = ber_children(attribute.body)?;
                let name = fields.first().filter(|f| f.tag == 0x04)?.body;
                if !name.eq_ignore_ascii_case(b"namingContexts") {
                    continue;
                }
                let values = fields.get(1).filter(|f| f.tag == 0x31)?;
                for value in ber_children(values.body)? {
                    naming_contexts.push(value.body);
                }
            }
            LdapAnswer::Entry { naming_contexts }
        }
        other => LdapAnswer::Other(other),
    };
    Some((id, answer))
}

/// Reads one whole LDAPMessage (its SEQUENCE contents); the length it announces is checked
/// against the budget before anything is allocated for it.
async fn read_ldap_message<S: AsyncRead + Unpin>(
    stream: &mut Bounded<S>,
    max_bytes: usize,
) -> Result<Vec<u8>, String> {
    let mut head = [0u8; 2];
    stream
        .read_exact(&mut head)
        .await
        .map_err(|e| format!("reading an LDAP message failed: {e}"))?;
    let [tag, first] = head;
    if tag != 0x30 {
        return Err(format!(
            "the answer is not an LDAP message (tag {tag:#04x})"
        ));
    }
    let mut length_bytes = vec![first];
    if first >= 0x80 {
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 {
            return Err("the answer uses a BER length LDAP does not allow".into());
        }
        let mut rest = vec![0u8; count];
        stream
            .read_exact(&mut rest)
            .await
            .map_err(|e| format!("reading an LDAP message failed: {e}"))?;
        length_bytes.extend_from_slice(&rest);
    }
    let (length, _) = ber_length(&length_bytes).ok_or("the answer's BER length is malformed")?;
    if length > stream.remaining.min(max_bytes) {
        stream.exceeded.store(true, Ordering::SeqCst);
        return Err(format!("an LDAP message announces {length} bytes"));
    }
    let mut body = vec![0u8; length];
    stream
        .read_exact(&mut body)
        .await
        .map_err(|e| format!("reading an LDAP message failed: {e}"))?;
    Ok(body)
}

fn ldap_result_code(code: u64) -> String {
    match code {
        0 => "success".into(),
        49 => "invalidCredentials (49)".into(),
        50 => "insufficientAccessRights (50)".into(),
        other => format!("result code {other}"),
    }
}

async fn ldap(
    source: IpAddr,
    target: SocketAddr,
    expect: &Expectation,
    bounds: &ProbeBounds,
    started: Instant,
) -> ProbeResult {
    use ldap3_proto::proto::{
        LdapBindCred, LdapBindRequest, LdapDerefAliases, LdapFilter, LdapMsg, LdapOp,
        LdapSearchRequest, LdapSearchScope,
    };
    use tokio_util::codec::Encoder;
    let mut stream = match connect(source, target, &bounds.device).await {
        Ok(stream) => Bounded::new(stream, bounds.max_bytes),
        Err(error) => return connect_failed(target, &error, started),
    };
    let exceeded = stream.exceeded.clone();
    // Requests are encoded with ldap3_proto; answers are decoded here, under the probe's byte
    // and entry budget, without logging anything the guest sent.
    let mut codec = ldap3_proto::LdapCodec::new(None, None);
    let mut requests = bytes::BytesMut::new();
    let bind = LdapMsg::new(
        1,
        LdapOp::BindRequest(LdapBindRequest {
            version: 3,
            dn: String::new(),
            cred: LdapBindCred::Simple(String::new()),
        }),
    );
    let search = LdapMsg::new(
        2,
        LdapOp::SearchRequest(LdapSearchRequest {
            base: String::new(),
            scope: LdapSearchScope::Base,
            aliases: LdapDerefAliases::Never,
            sizelimit: 1,
            timelimit: 0,
            typesonly: false,
            filter: LdapFilter::Present("objectClass".into()),
            attrs: vec!["namingContexts".into()],
        }),
    );
    let fail = |reason: String, latency: Duration| {
        if exceeded.load(Ordering::SeqCst) {
            ProbeResult::failed(
                format!("{}: {reason}", bounds.bytes_exceeded(target)),
                latency,
            )
        } else {
            ProbeResult::failed(reason, latency)
        }
    };
    if let Err(error) = codec.encode(bind, &mut requests) {
        return fail(
            format!("cannot encode the bind: {error}"),
            started.elapsed(),
        );
    }
    if let Err(error) = stream.inner.write_all(&requests).await {
        return fail(
            format!("sending the bind failed: {error}"),
            started.elapsed(),
        );
    }
    let mut received = Sha256::new();
    let answer = match read_ldap_message(&mut stream, bounds.max_bytes).await {
        Ok(answer) => answer,
        Err(reason) => return fail(reason, started.elapsed()),
    };
    match ldap_answer(&answer) {
        Some((1, LdapAnswer::Result { code: 0, .. })) => received.update(b"bind:success"),
        Some((1, LdapAnswer::Result { code, message })) => {
            return fail(
                format!(
                    "anonymous bind refused: {} \"{}\"",
                    ldap_result_code(code),
                    printable(message, MAX_VALUE_CHARS)
                ),
                started.elapsed(),
            );
        }
        Some((id, other)) => {
            let what = match other {
                LdapAnswer::Other(tag) => format!("operation tag {tag:#04x}"),
                LdapAnswer::Entry { .. } => "a search result entry".into(),
                LdapAnswer::Result { .. } => "a result".into(),
            };
            return fail(
                format!("unexpected answer to the bind: {what} for message {id}"),
                started.elapsed(),
            );
        }
        None => return fail("the bind answer does not decode".into(), started.elapsed()),
    }
    let latency = started.elapsed();
    requests.clear();
    if let Err(error) = codec.encode(search, &mut requests) {
        return fail(
            format!("cannot encode the root DSE search: {error}"),
            latency,
        );
    }
    if let Err(error) = stream.inner.write_all(&requests).await {
        return fail(
            format!("sending the root DSE search failed: {error}"),
            latency,
        );
    }
    let wanted = expect
        .ldap_naming_context
        .as_ref()
        .map(|e| e.as_str().as_bytes());
    let mut contexts: Vec<String> = Vec::new();
    let mut matched = false;
    let mut any = false;
    let mut messages = 0usize;
    loop {
        messages += 1;
        if messages > bounds.max_entries {
            return fail(bounds.entries_exceeded(target, "LDAP messages"), latency);
        }
        let message = match read_ldap_message(&mut stream, bounds.max_bytes).await {
            Ok(message) => message,
            Err(reason) => return fail(reason, latency),
        };
        match ldap_answer(&message) {
            Some((2, LdapAnswer::Entry { naming_contexts })) => {
                for value in naming_contexts {
                    received.update(value);
                    any = true;
                    matched |= wanted.is_some_and(|w| w.eq_ignore_ascii_case(value));
                    contexts.push(format!("\"{}\"", printable(value, MAX_VALUE_CHARS)));
                }
            }
            Some((2, LdapAnswer::Result { code: 0, .. })) => break,
            Some((2, LdapAnswer::Result { code, message })) => {
                return fail(
                    format!(
                        "root DSE search failed: {} \"{}\"",
                        ldap_result_code(code),
                        printable(message, MAX_VALUE_CHARS)
                    ),
                    latency,
                );
            }
            // Referrals, intermediate responses, notices: counted, not kept.
            Some(_) => {}
            None => return fail("the search answer does not decode".into(), latency),
        }
    }
    let _ = stream
        .inner
        .write_all(&[0x30, 0x05, 0x02, 0x01, 0x03, 0x42, 0x00])
        .await;
    let passed = match wanted {
        Some(_) => matched,
        None => any,
    };
    let listed = contexts.join(", ");
    ProbeResult {
        passed,
        detail: match (&expect.ldap_naming_context, passed) {
            (Some(expected), false) => {
                format!("namingContexts [{listed}] lack {:?}", expected.as_str())
            }
            _ => format!("namingContexts [{listed}]"),
        },
        latency,
        received_sha256: hex::encode(received.finalize()),
        tls_certificate_sha256: String::new(),
    }
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

impl NodeExecutor {
    pub(super) async fn probe(
        &self,
        run: &RunHandle,
        kind: ProbeKind,
        address: UnicastIp,
        port: u16,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.lock_open(run).await?;
        let target = grant
            .probe_targets
            .iter()
            .find(|t| t.kind == kind && t.address == address && t.port == port)
            .ok_or_else(|| {
                ExecError::FailedPrecondition(format!(
                    "{address}:{port} is not a probe target of this run"
                ))
            })?;
        let source = grant.probe_source.address.0;
        let resource = format!("probe:{}:{address}:{port}", kind.name());
        let address_added = resources::state_of(
            &guard.records(),
            &Resource::ProbeAddress(grant.vnet.clone()),
        )
        .is_some_and(|s| s.is_open() && s.standing() == Standing::Done);
        let address_present = self.address_present(grant).await?;
        if address_added && !address_present {
            // ifupdown2's `ifreload -a` (every SDN "Apply" runs it) purges addresses it did not
            // configure: the node took the address, the guest and the backup did nothing wrong.
            let error = format!(
                "probe address removed by the node (ifreload?): {} is no longer on {} although this run added it; the probe did not run. This is a failure of the node's network, not of the backup: release or clean up the sandbox and prepare it again",
                grant.probe_source, grant.vnet
            );
            guard
                .append(
                    self.now_ms(),
                    "probe.run",
                    &resource,
                    Phase::Failed,
                    json!({ "source": source.to_string(), "error": error, "infrastructure": true }),
                )
                .await?;
            return Err(ExecError::Unavailable(
                pb::ErrorReason::ProbeAddressRemoved,
                error,
            ));
        }
        if !address_present || !self.table_present(grant).await? {
            return Err(ExecError::FailedPrecondition(format!(
                "the probe address {} or the run's containment table is not on {}; call PrepareSandbox first",
                grant.probe_source, grant.vnet
            )));
        }
        guard
            .append(
                self.now_ms(),
                "probe.run",
                &resource,
                Phase::Intent,
                json!({ "source": source.to_string() }),
            )
            .await?;
        let bounds = ProbeBounds {
            device: grant.vnet.to_string(),
            timeout: Duration::from_secs(self.config.limits.probe_timeout_secs),
            max_bytes: self.config.limits.max_probe_response_bytes,
            max_entries: self.config.limits.max_probe_entries,
        };
        let result = probe_target(source, target, &bounds).await;
        guard
            .append(
                self.now_ms(),
                "probe.run",
                &resource,
                Phase::Done,
                json!({
                    "passed": result.passed,
                    "detail": result.detail,
                    "latency_us": result.latency.as_micros() as u64,
                    "received_sha256": result.received_sha256,
                    "tls_certificate_sha256": result.tls_certificate_sha256,
                }),
            )
            .await?;
        Ok(Outcome::Probe(pb::ProbeReply {
            outcome: if result.passed {
                pb::ProbeOutcome::Passed
            } else {
                pb::ProbeOutcome::Failed
            } as i32,
            detail: result.detail,
            origin: format!("worker_host {source}"),
            latency_us: result.latency.as_micros() as u64,
            received_sha256: result.received_sha256,
            tls_certificate_sha256: result.tls_certificate_sha256,
            journal_head: guard.head_hex(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ldap3_proto::proto::{
        LdapMsg, LdapOp, LdapPartialAttribute, LdapResult, LdapResultCode, LdapSearchResultEntry,
    };
    use tokio_util::codec::Encoder;

    fn encoded(message: LdapMsg) -> Vec<u8> {
        let mut out = bytes::BytesMut::new();
        ldap3_proto::LdapCodec::new(None, None)
            .encode(message, &mut out)
            .unwrap();
        out.to_vec()
    }

    #[test]
    fn ldap_answers_decode_from_what_a_server_encodes() {
        let entry = encoded(LdapMsg::new(
            2,
            LdapOp::SearchResultEntry(LdapSearchResultEntry {
                dn: String::new(),
                attributes: vec![
                    LdapPartialAttribute {
                        atype: "objectClass".into(),
                        vals: vec![b"top".to_vec()],
                    },
                    LdapPartialAttribute {
                        atype: "namingContexts".into(),
                        vals: vec![b"dc=example,dc=test".to_vec(), vec![0x1b, b'x']],
                    },
                ],
            }),
        ));
        let (message, rest) = ber(&entry).unwrap();
        assert!(rest.is_empty());
        assert_eq!(message.tag, 0x30);
        assert_eq!(
            ldap_answer(message.body),
            Some((
                2,
                LdapAnswer::Entry {
                    naming_contexts: vec![b"dc=example,dc=test".as_slice(), &[0x1b, b'x']]
                }
            ))
        );
        let done = encoded(LdapMsg::new(
            2,
            LdapOp::SearchResultDone(LdapResult {
                code: LdapResultCode::InsufficentAccessRights,
                matcheddn: String::new(),
                message: "no".into(),
                referral: vec![],
            }),
        ));
        let (message, _) = ber(&done).unwrap();
        assert_eq!(
            ldap_answer(message.body),
            Some((
                2,
                LdapAnswer::Result {
                    code: 50,
                    message: b"no"
                }
            ))
        );
        // Lengths past the input, indefinite or over four bytes are refused, not guessed.
        assert_eq!(ber(&[0x30, 0x05, 0x02]), None);
        assert_eq!(ber(&[0x30, 0x80, 0x00, 0x00]), None);
        assert_eq!(ber(&[0x30, 0x85, 1, 1, 1, 1, 1]), None);
    }

    #[tokio::test]
    async fn a_bounded_stream_stops_at_its_budget() {
        let (mut writer, reader) = tokio::io::duplex(64 * 1024);
        writer.write_all(&[7u8; 5000]).await.unwrap();
        let mut bounded = Bounded::new(reader, 4096);
        let mut sink = Vec::new();
        let error = bounded.read_to_end(&mut sink).await.unwrap_err();
        assert_eq!(sink.len(), 4096);
        assert!(error.to_string().contains("budget"));
        assert!(bounded.exceeded.load(Ordering::SeqCst));
    }
}
