//! Probes from the run's probe address to the grant's targets: TCP, HTTP(S), DNS, LDAP.
//!
//! Every probe binds its socket to the probe address on the VNet (so it leaves through the
//! sandbox, under the run's containment table), runs under one deadline, and reports a
//! result: a refused or silent target is a `failed` outcome with a reason, not an RPC error.
//! Targets and expectations come only from the grant. What was received is digested
//! (SHA-256) so a report can show what answered without storing it.
//!
//! HTTPS: the restored guest is untrusted, so its certificate is not verified against any
//! root; it is recorded (SHA-256 of the DER) instead. Nothing the probe learns is trusted or
//! used for anything else.

use super::NodeExecutor;
use crate::executor::{ExecError, Outcome};
use crate::grant::{Expectation, ProbeKind, ProbeTarget};
use crate::journal::Phase;
use crate::runs::RunHandle;
use crate::validate::UnicastIp;
use certistack_proto::v1 as pb;
use serde_json::json;
use sha2::{Digest, Sha256};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpSocket, TcpStream, UdpSocket};

/// Bytes of an answer read at most (banner, HTTP body, DNS or LDAP messages).
const MAX_RECEIVED: usize = 1024 * 1024;

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

async fn connect(source: IpAddr, target: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = if source.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.bind(SocketAddr::new(source, 0))?;
    socket.connect(target).await
}

async fn tcp(
    source: IpAddr,
    target: SocketAddr,
    expect: &Expectation,
    started: Instant,
) -> ProbeResult {
    let mut stream = match connect(source, target).await {
        Ok(stream) => stream,
        Err(error) => {
            return ProbeResult::failed(
                format!("connect to {target} failed: {error}"),
                started.elapsed(),
            );
        }
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
    let mut received = Vec::new();
    let mut chunk = [0u8; 512];
    while received.len() < 4096 && !received.contains(&b'\n') {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => received.extend_from_slice(chunk.get(..n).unwrap_or_default()),
        }
    }
    let banner = String::from_utf8_lossy(&received)
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned();
    let passed = banner.starts_with(prefix.as_str());
    ProbeResult {
        passed,
        detail: if passed {
            format!("banner {banner:?}")
        } else {
            format!(
                "banner {banner:?} does not start with {:?}",
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
    started: Instant,
) -> ProbeResult {
    use http_body_util::BodyExt;
    let stream = match connect(source, target).await {
        Ok(stream) => stream,
        Err(error) => {
            return ProbeResult::failed(
                format!("connect to {target} failed: {error}"),
                started.elapsed(),
            );
        }
    };
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
        let provider = crate::tls::provider();
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
                return ProbeResult::failed(
                    format!("TLS handshake with {target} failed: {error}"),
                    started.elapsed(),
                );
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
    let response = match response {
        Ok(response) => response,
        Err(error) => {
            let mut result = ProbeResult::failed(
                format!("HTTP exchange with {target} failed: {error}"),
                started.elapsed(),
            );
            result.tls_certificate_sha256 = certificate;
            return result;
        }
    };
    let latency = started.elapsed();
    let status = response.status().as_u16();
    let body = match http_body_util::Limited::new(response.into_body(), MAX_RECEIVED)
        .collect()
        .await
    {
        Ok(body) => body.to_bytes(),
        Err(error) => {
            let mut result =
                ProbeResult::failed(format!("reading the body failed: {error}"), latency);
            result.tls_certificate_sha256 = certificate;
            return result;
        }
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

async fn send<T>(
    io: hyper_util::rt::TokioIo<T>,
    request: hyper::Request<http_body_util::Empty<bytes::Bytes>>,
) -> Result<hyper::Response<hyper::body::Incoming>, hyper::Error>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io).await?;
    let driver = tokio::spawn(connection);
    let response = sender.send_request(request).await;
    if response.is_err() {
        driver.abort();
    }
    response
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
    if let Err(error) = socket.send_to(&bytes, target).await {
        return ProbeResult::failed(
            format!("sending to {target} failed: {error}"),
            started.elapsed(),
        );
    }
    let mut buffer = vec![0u8; 65_535];
    let received = loop {
        match socket.recv_from(&mut buffer).await {
            Ok((n, from)) if from == target => break buffer.get(..n).unwrap_or_default().to_vec(),
            Ok(_) => continue,
            Err(error) => {
                return ProbeResult::failed(
                    format!("receiving from {target} failed: {error}"),
                    started.elapsed(),
                );
            }
        }
    };
    let latency = started.elapsed();
    let answer = match Message::from_vec(&received) {
        Ok(answer) if answer.metadata.id == id => answer,
        Ok(_) => return ProbeResult::failed("the answer's id does not match the query", latency),
        Err(error) => {
            return ProbeResult::failed(format!("the answer does not decode: {error}"), latency);
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
    ProbeResult {
        passed,
        detail: format!(
            "{code} {record_type} {name}: {answers:?}{}",
            if passed || expected.is_empty() {
                String::new()
            } else {
                format!(", expected {expected:?}")
            }
        ),
        latency,
        received_sha256: digest(&received),
        tls_certificate_sha256: String::new(),
    }
}

async fn ldap(
    source: IpAddr,
    target: SocketAddr,
    expect: &Expectation,
    started: Instant,
) -> ProbeResult {
    use futures_util::{SinkExt, StreamExt};
    use ldap3_proto::proto::{
        LdapBindCred, LdapBindRequest, LdapDerefAliases, LdapFilter, LdapMsg, LdapOp,
        LdapResultCode, LdapSearchRequest, LdapSearchScope,
    };
    let stream = match connect(source, target).await {
        Ok(stream) => stream,
        Err(error) => {
            return ProbeResult::failed(
                format!("connect to {target} failed: {error}"),
                started.elapsed(),
            );
        }
    };
    let mut framed = tokio_util::codec::Framed::new(
        stream,
        ldap3_proto::LdapCodec::new(Some(MAX_RECEIVED), None),
    );
    let mut received = Sha256::new();
    let bind = LdapMsg::new(
        1,
        LdapOp::BindRequest(LdapBindRequest {
            version: 3,
            dn: String::new(),
            cred: LdapBindCred::Simple(String::new()),
        }),
    );
    if let Err(error) = framed.send(bind).await {
        return ProbeResult::failed(
            format!("sending the bind failed: {error}"),
            started.elapsed(),
        );
    }
    match framed.next().await {
        Some(Ok(LdapMsg {
            op: LdapOp::BindResponse(response),
            ..
        })) if response.res.code == LdapResultCode::Success => {
            received.update(b"bind:success");
        }
        Some(Ok(LdapMsg {
            op: LdapOp::BindResponse(response),
            ..
        })) => {
            return ProbeResult::failed(
                format!(
                    "anonymous bind refused: {:?} {}",
                    response.res.code, response.res.message
                ),
                started.elapsed(),
            );
        }
        Some(Ok(other)) => {
            return ProbeResult::failed(
                format!("unexpected answer to the bind: {:?}", other.op),
                started.elapsed(),
            );
        }
        Some(Err(error)) => {
            return ProbeResult::failed(
                format!("the bind answer does not decode: {error}"),
                started.elapsed(),
            );
        }
        None => return ProbeResult::failed("the server closed the connection", started.elapsed()),
    }
    let latency = started.elapsed();
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
    if let Err(error) = framed.send(search).await {
        return ProbeResult::failed(
            format!("sending the root DSE search failed: {error}"),
            latency,
        );
    }
    let mut contexts = Vec::new();
    loop {
        match framed.next().await {
            Some(Ok(LdapMsg {
                op: LdapOp::SearchResultEntry(entry),
                ..
            })) => {
                for attribute in entry
                    .attributes
                    .iter()
                    .filter(|a| a.atype.eq_ignore_ascii_case("namingContexts"))
                {
                    for value in &attribute.vals {
                        received.update(value);
                        contexts.push(String::from_utf8_lossy(value).into_owned());
                    }
                }
            }
            Some(Ok(LdapMsg {
                op: LdapOp::SearchResultDone(done),
                ..
            })) => {
                if done.code != LdapResultCode::Success {
                    return ProbeResult::failed(
                        format!("root DSE search failed: {:?} {}", done.code, done.message),
                        latency,
                    );
                }
                break;
            }
            Some(Ok(_)) => continue,
            Some(Err(error)) => {
                return ProbeResult::failed(
                    format!("the search answer does not decode: {error}"),
                    latency,
                );
            }
            None => {
                return ProbeResult::failed(
                    "the server closed the connection during the search",
                    latency,
                );
            }
        }
    }
    let _ = framed.send(LdapMsg::new(3, LdapOp::UnbindRequest)).await;
    let passed = match &expect.ldap_naming_context {
        Some(expected) => contexts
            .iter()
            .any(|c| c.eq_ignore_ascii_case(expected.as_str())),
        None => !contexts.is_empty(),
    };
    ProbeResult {
        passed,
        detail: match (&expect.ldap_naming_context, passed) {
            (Some(expected), false) => {
                format!("namingContexts {contexts:?} lack {:?}", expected.as_str())
            }
            _ => format!("namingContexts {contexts:?}"),
        },
        latency,
        received_sha256: hex::encode(received.finalize()),
        tls_certificate_sha256: String::new(),
    }
}

/// Runs one probe from `source` to `target` under `timeout`.
pub async fn probe_target(source: IpAddr, target: &ProbeTarget, timeout: Duration) -> ProbeResult {
    let started = Instant::now();
    let address = SocketAddr::new(target.address.0, target.port);
    let work = async {
        match target.kind {
            ProbeKind::Tcp => tcp(source, address, &target.expect, started).await,
            ProbeKind::Http => http(source, address, false, &target.expect, started).await,
            ProbeKind::Https => http(source, address, true, &target.expect, started).await,
            ProbeKind::Dns => dns(source, address, &target.expect, started).await,
            ProbeKind::Ldap => ldap(source, address, &target.expect, started).await,
        }
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(result) => result,
        Err(_) => ProbeResult::failed(
            format!("no answer from {address} within {timeout:?}"),
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
        if !self.address_present(grant).await? || !self.table_present(grant).await? {
            return Err(ExecError::FailedPrecondition(format!(
                "the probe address {} or the run's containment table is not on {}; call PrepareSandbox first",
                grant.probe_source, grant.vnet
            )));
        }
        let resource = format!("probe:{}:{address}:{port}", kind.name());
        guard
            .append(
                self.now_ms(),
                "probe.run",
                &resource,
                Phase::Intent,
                json!({ "source": source.to_string() }),
            )
            .await?;
        let timeout = Duration::from_secs(self.config.limits.probe_timeout_secs);
        let result = probe_target(source, target, timeout).await;
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
