//! The HTTP(S) probe: one request over a bounded connection; the guest's certificate is
//! recorded, never trusted.

use super::socket::{Bounded, connect, connect_failed};
use super::{ProbeBounds, ProbeResult, digest};
use certistack_core::grant::Expectation;
use certistack_core::untrusted::{MAX_VALUE_CHARS, printable};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

pub(super) async fn http(
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
