//! HTTPS requests to an API server, verified by an [`ApiTrust`], with a deadline on each stage
//! (TCP and TLS, then the whole reply) and a cap on the reply's size, a bound on requests at
//! once, and errors that name the call and say what to do.
//!
//! A connection the server keeps open after a reply serves the next request for a few seconds
//! ([`IdleConnections`]); a request that changes something always opens its own. Text the
//! server chose (its reason phrase, its error messages) is escaped and bounded before it is
//! put in an error, since it reaches a terminal and the logs.

use certistack_core::tls::{self, ApiTrust, FingerprintMismatch};
use certistack_core::untrusted;
use http_body_util::BodyExt;
use hyper::Method;
use rustls::pki_types::ServerName;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

/// The deadlines and bounds of one client.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// TCP connect and TLS handshake together.
    pub connect: Duration,
    /// From the request sent to the last byte of the reply.
    pub response: Duration,
    /// The largest reply body accepted.
    pub max_reply_bytes: usize,
    /// Requests in flight at once; more wait their turn.
    pub concurrency: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(10),
            response: Duration::from_secs(30),
            // `/cluster/resources` of a large cluster is a few hundred KiB.
            max_reply_bytes: 8 * 1024 * 1024,
            concurrency: 4,
        }
    }
}

/// The longest piece of server text (reason phrase, message) kept in an error.
const MAX_SERVER_TEXT: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(
        "{call}: cannot reach {url}: {reason}; check the server's address and port (pve.api_url, or the plan's storage.server and storage.port) and that its API service runs there"
    )]
    Connect {
        call: String,
        url: String,
        reason: String,
    },
    #[error(
        "{call}: {url} presents a certificate that does not chain to the CA in ca_file; give the CA that signed it (a PVE cluster's is /etc/pve/pve-root-ca.pem) or pin its fingerprint"
    )]
    UnknownIssuer { call: String, url: String },
    #[error(
        "{call}: the certificate of {url} is not valid for {host} ({reason}); write in api_url a name the certificate carries"
    )]
    WrongName {
        call: String,
        url: String,
        host: String,
        reason: String,
    },
    #[error(
        "{call}: {mismatch}; if the server's certificate was renewed, read its fingerprint on the server (Proxmox VE: `pvenode cert info`, the pveproxy-ssl.pem entry if there is one, else pve-ssl.pem, never pve-root-ca.pem; Proxmox Backup Server: `proxmox-backup-manager cert info`) and pin it only if it is the one presented here"
    )]
    Fingerprint {
        call: String,
        mismatch: FingerprintMismatch,
    },
    #[error("{call}: TLS with {url} failed: {reason}")]
    Tls {
        call: String,
        url: String,
        reason: String,
    },
    #[error(
        "{call}: no answer from {url} within {seconds} s ({stage}); check the network path and the server's load"
    )]
    Timeout {
        call: String,
        url: String,
        stage: &'static str,
        seconds: u64,
    },
    #[error("{call}: HTTP {status} {message}")]
    Status {
        call: String,
        status: u16,
        /// The server's reason phrase and error messages, escaped and bounded.
        message: String,
    },
    #[error("{call}: the reply is larger than {max} bytes; refused")]
    TooLarge { call: String, max: usize },
    #[error("{call}: the reply is not what the API sends: {reason}")]
    Decode { call: String, reason: String },
    #[error("{call}: {reason}")]
    Request { call: String, reason: String },
}

impl ApiError {
    /// The HTTP status, when the server answered with one.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether the server was reached over TCP (every error but `Connect` and a connect
    /// timeout).
    pub fn reached(&self) -> bool {
        !matches!(
            self,
            Self::Connect { .. }
                | Self::Timeout {
                    stage: STAGE_CONNECT,
                    ..
                }
        )
    }

    /// Whether TLS verified the server (the server was reached and answered over TLS).
    pub fn tls_verified(&self) -> bool {
        self.reached()
            && !matches!(
                self,
                Self::UnknownIssuer { .. }
                    | Self::WrongName { .. }
                    | Self::Fingerprint { .. }
                    | Self::Tls { .. }
            )
    }
}

const STAGE_CONNECT: &str = "connect and TLS handshake";
const STAGE_REPLY: &str = "reply";

/// A successful (2xx) reply.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
}

/// An open HTTP/1.1 connection to the server and the task that drives it.
struct Connection {
    sender: hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>>,
    driver: tokio::task::JoinHandle<hyper::Result<()>>,
}

/// How a request on a connection failed: the connection ended before any answer came (a kept
/// connection the server had closed meanwhile: pveproxy drops an idle one without a word), or
/// otherwise.
enum Exchange {
    Unanswered(ApiError),
    Failed(ApiError),
}

/// How long a connection is kept unused before it is closed: below the 5 s after which
/// pveproxy (pve-http-server `PVE::APIServer::AnyEvent`, its `timeout`) and
/// proxmox-backup-proxy drop an idle client, so a kept connection is seldom found closed.
const IDLE_KEPT: Duration = Duration::from_secs(3);

/// Connections the server kept open after a reply, for the next requests: at most one per
/// request in flight, each for at most [`IDLE_KEPT`]. A night's run, seconds between calls,
/// finds them gone and opens anew; plan resolution, hundreds of calls in a second, reuses them
/// instead of paying a TLS handshake per call.
#[derive(Clone)]
struct IdleConnections {
    kept: Arc<std::sync::Mutex<Vec<(Connection, std::time::Instant)>>>,
    most: usize,
}

impl IdleConnections {
    fn new(most: usize) -> Self {
        Self {
            kept: Arc::default(),
            most,
        }
    }

    /// The most recently kept connection still open and young enough; older ones are closed.
    fn take(&self) -> Option<Connection> {
        let mut kept = self
            .kept
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        while let Some((connection, since)) = kept.pop() {
            if since.elapsed() < IDLE_KEPT && !connection.sender.is_closed() {
                return Some(connection);
            }
        }
        None
    }

    fn keep(&self, connection: Connection) {
        let mut kept = self
            .kept
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // Those too old or closed make room first.
        kept.retain(|(connection, since)| {
            since.elapsed() < IDLE_KEPT && !connection.sender.is_closed()
        });
        if kept.len() < self.most && !connection.sender.is_closed() {
            kept.push((connection, std::time::Instant::now()));
        }
    }
}

/// A connection dropped is closed: its driver stops with it.
impl Drop for Connection {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// An HTTPS client of one API server.
#[derive(Clone)]
pub struct HttpsClient {
    host: String,
    port: u16,
    server_name: ServerName<'static>,
    connector: tokio_rustls::TlsConnector,
    limits: Limits,
    in_flight: Arc<Semaphore>,
    idle: IdleConnections,
}

impl std::fmt::Debug for HttpsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpsClient")
            .field("url", &self.url())
            .finish_non_exhaustive()
    }
}

impl HttpsClient {
    /// A client of `https://host:port`, verifying the server by `trust`.
    pub fn new(host: &str, port: u16, trust: &ApiTrust, limits: Limits) -> Result<Self, String> {
        let config = tls::api_client_config(trust).map_err(|error| error.to_string())?;
        let server_name = ServerName::try_from(host.to_owned())
            .map_err(|error| format!("{host:?} is not a host name TLS can verify: {error}"))?;
        Ok(Self {
            host: host.to_owned(),
            port,
            server_name,
            connector: tokio_rustls::TlsConnector::from(config),
            limits,
            in_flight: Arc::new(Semaphore::new(limits.concurrency.max(1))),
            idle: IdleConnections::new(limits.concurrency.max(1)),
        })
    }

    /// `https://host:port`.
    pub fn url(&self) -> String {
        match self.host.parse::<std::net::Ipv6Addr>() {
            Ok(_) => format!("https://[{}]:{}", self.host, self.port),
            Err(_) => format!("https://{}:{}", self.host, self.port),
        }
    }

    /// Sends one request and reads its reply within the limits. `headers` are added as given
    /// and marked sensitive (hyper keeps them out of its debug output). A reply outside 2xx is
    /// an [`ApiError::Status`] whose message `describe_error` makes from the reason phrase and
    /// the body.
    pub async fn request(
        &self,
        method: Method,
        path_and_query: &str,
        headers: &[(&'static str, &[u8])],
        describe_error: fn(&str, &[u8]) -> String,
        secret: &str,
    ) -> Result<Reply, ApiError> {
        self.send(
            method,
            path_and_query,
            headers,
            None,
            describe_error,
            secret,
        )
        .await
    }

    /// [`Self::request`] with a body of `content_type` (a webhook's JSON). A request with a
    /// body is never sent twice: it goes on a connection of its own.
    pub async fn send(
        &self,
        method: Method,
        path_and_query: &str,
        headers: &[(&'static str, &[u8])],
        body: Option<(&'static str, bytes::Bytes)>,
        describe_error: fn(&str, &[u8]) -> String,
        secret: &str,
    ) -> Result<Reply, ApiError> {
        let call = format!(
            "{method} {}",
            untrusted::printable(path_and_query.as_bytes(), MAX_SERVER_TEXT)
        );
        let url = self.url();
        let _turn = self
            .in_flight
            .acquire()
            .await
            .map_err(|_| ApiError::Request {
                call: call.clone(),
                reason: "the client is shutting down".into(),
            })?;
        let make_request = || {
            let mut request = http::Request::builder()
                .method(method.clone())
                .uri(path_and_query)
                .header(http::header::HOST, self.host_header())
                .header(http::header::ACCEPT, "application/json")
                .header(http::header::USER_AGENT, "certistack-ctl");
            for (name, value) in headers {
                let mut value =
                    http::HeaderValue::from_bytes(value).map_err(|_| ApiError::Request {
                        call: call.clone(),
                        reason: format!("the {name} header holds a character HTTP does not allow"),
                    })?;
                value.set_sensitive(true);
                request = request.header(*name, value);
            }
            if let Some((content_type, _)) = &body {
                request = request.header(http::header::CONTENT_TYPE, *content_type);
            }
            request
                .body(http_body_util::Full::new(
                    body.as_ref()
                        .map(|(_, bytes)| bytes.clone())
                        .unwrap_or_default(),
                ))
                .map_err(|error| ApiError::Request {
                    call: call.clone(),
                    reason: error.to_string(),
                })
        };
        // Only a request that changes nothing goes on a kept connection, and is sent again on a
        // new one when the kept one ended without an answer: the server may have timed it out
        // while nothing drove the connection.
        let repeatable = (method == Method::GET || method == Method::HEAD) && body.is_none();
        let kept = match repeatable.then(|| self.idle.take()).flatten() {
            // The server may have closed it since; then hyper says so here, within the time a
            // new connection would be given.
            Some(mut connection) => {
                tokio::time::timeout(self.limits.connect, connection.sender.ready())
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .map(|()| connection)
            }
            None => None,
        };
        let reused = kept.is_some();
        let connection = match kept {
            Some(connection) => connection,
            None => self.open(&call, &url).await?,
        };
        let exchanged = self
            .exchange(&call, &url, connection, make_request()?)
            .await;
        let (status, reason, body) = match exchanged {
            Err(Exchange::Unanswered(_)) if reused => {
                let connection = self.open(&call, &url).await?;
                match self
                    .exchange(&call, &url, connection, make_request()?)
                    .await
                {
                    Ok(answer) => answer,
                    Err(Exchange::Unanswered(error) | Exchange::Failed(error)) => {
                        return Err(error);
                    }
                }
            }
            Err(Exchange::Unanswered(error) | Exchange::Failed(error)) => return Err(error),
            Ok(answer) => answer,
        };
        if !(200..300).contains(&status) {
            // The secret is taken out before the text is cut, so no part of it survives.
            let reason = redact_text(&reason, secret);
            let body = redact_body(body, secret.as_bytes());
            let message = redact_text(&describe_error(&reason, &body), secret);
            return Err(ApiError::Status {
                call,
                status,
                message: untrusted::printable(message.as_bytes(), MAX_SERVER_TEXT),
            });
        }
        Ok(Reply {
            status,
            body: redact_body(body, secret.as_bytes()),
        })
    }

    /// A new connection: TCP, TLS verified by the client's trust, and HTTP/1.1 over them,
    /// within the connect deadline.
    async fn open(&self, call: &str, url: &str) -> Result<Connection, ApiError> {
        let timed_out = || ApiError::Timeout {
            call: call.to_owned(),
            url: url.to_owned(),
            stage: STAGE_CONNECT,
            seconds: self.limits.connect.as_secs(),
        };
        let stream = tokio::time::timeout(self.limits.connect, self.connect())
            .await
            .map_err(|_| timed_out())?
            .map_err(|error| self.classify(call, error))?;
        let (sender, connection) = tokio::time::timeout(
            self.limits.connect,
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)),
        )
        .await
        .map_err(|_| timed_out())?
        .map_err(|error| ApiError::Request {
            call: call.to_owned(),
            reason: error.to_string(),
        })?;
        Ok(Connection {
            sender,
            // The connection is driven beside its requests and stopped with its last one.
            driver: tokio::spawn(connection),
        })
    }

    /// One request on `connection` and its whole reply, within the reply deadline. The
    /// connection is kept for the next request when the server keeps it open and the reply
    /// was read to its end.
    async fn exchange(
        &self,
        call: &str,
        url: &str,
        mut connection: Connection,
        request: http::Request<http_body_util::Full<bytes::Bytes>>,
    ) -> Result<(u16, String, Vec<u8>), Exchange> {
        let max = self.limits.max_reply_bytes;
        let failed = |reason: String| {
            Exchange::Failed(ApiError::Request {
                call: call.to_owned(),
                reason,
            })
        };
        let exchange = async {
            let response = match connection.sender.send_request(request).await {
                Ok(response) => response,
                Err(error) => {
                    return Err(Exchange::Unanswered(ApiError::Request {
                        call: call.to_owned(),
                        reason: format!("the server closed the connection: {error}"),
                    }));
                }
            };
            let status = response.status().as_u16();
            let reason = response
                .extensions()
                .get::<hyper::ext::ReasonPhrase>()
                .map(|phrase| String::from_utf8_lossy(phrase.as_bytes()).into_owned())
                .or_else(|| response.status().canonical_reason().map(str::to_owned))
                .unwrap_or_default();
            let declared = response
                .headers()
                .get(http::header::CONTENT_LENGTH)
                .and_then(|value| value.to_str().ok())
                .and_then(|value| value.parse::<u64>().ok());
            if declared.is_some_and(|length| length > max as u64) {
                return Err(Exchange::Failed(ApiError::TooLarge {
                    call: call.to_owned(),
                    max,
                }));
            }
            let closes = response
                .headers()
                .get_all(http::header::CONNECTION)
                .iter()
                .any(|value| {
                    value.to_str().is_ok_and(|value| {
                        value
                            .split(',')
                            .any(|token| token.trim().eq_ignore_ascii_case("close"))
                    })
                });
            let body = http_body_util::Limited::new(response.into_body(), max)
                .collect()
                .await
                .map_err(|error| {
                    if error.is::<http_body_util::LengthLimitError>() {
                        Exchange::Failed(ApiError::TooLarge {
                            call: call.to_owned(),
                            max,
                        })
                    } else {
                        failed(format!("reading the reply: {error}"))
                    }
                })?
                .to_bytes()
                .to_vec();
            Ok((status, reason, body, closes))
        };
        let answer = tokio::time::timeout(self.limits.response, exchange).await;
        let (status, reason, body, closes) = match answer {
            Ok(Ok(answer)) => answer,
            Ok(Err(error)) => return Err(error),
            Err(_) => {
                return Err(Exchange::Failed(ApiError::Timeout {
                    call: call.to_owned(),
                    url: url.to_owned(),
                    stage: STAGE_REPLY,
                    seconds: self.limits.response.as_secs(),
                }));
            }
        };
        if !closes {
            self.idle.keep(connection);
        }
        Ok((status, reason, body))
    }

    fn host_header(&self) -> String {
        self.url().trim_start_matches("https://").to_owned()
    }

    async fn connect(&self) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|error| std::io::Error::new(error.kind(), TcpError(error)))?;
        tcp.set_nodelay(true)?;
        self.connector.connect(self.server_name.clone(), tcp).await
    }

    /// A failed connect as what to do: the certificate's issuer, name or pin, or the network.
    fn classify(&self, call: &str, error: std::io::Error) -> ApiError {
        let call = call.to_owned();
        let url = self.url();
        if let Some(tcp) = error.get_ref().and_then(|e| e.downcast_ref::<TcpError>()) {
            return ApiError::Connect {
                call,
                url,
                reason: tcp.0.to_string(),
            };
        }
        let rustls_error = error
            .get_ref()
            .and_then(|e| e.downcast_ref::<rustls::Error>());
        match rustls_error {
            Some(rustls::Error::InvalidCertificate(certificate)) => {
                use rustls::CertificateError as E;
                match certificate {
                    E::UnknownIssuer | E::BadSignature => ApiError::UnknownIssuer { call, url },
                    E::NotValidForName | E::NotValidForNameContext { .. } => ApiError::WrongName {
                        call,
                        url,
                        host: self.host.clone(),
                        reason: certificate.to_string(),
                    },
                    E::Other(other) => match other.0.downcast_ref::<FingerprintMismatch>() {
                        Some(mismatch) => ApiError::Fingerprint {
                            call,
                            mismatch: FingerprintMismatch {
                                presented: mismatch.presented.clone(),
                                pinned: mismatch.pinned.clone(),
                            },
                        },
                        None => ApiError::Tls {
                            call,
                            url,
                            reason: certificate.to_string(),
                        },
                    },
                    _ => ApiError::Tls {
                        call,
                        url,
                        reason: certificate.to_string(),
                    },
                }
            }
            Some(other) => ApiError::Tls {
                call,
                url,
                reason: other.to_string(),
            },
            None => ApiError::Tls {
                call,
                url,
                reason: error.to_string(),
            },
        }
    }
}

/// A refusal's message: the reason phrase, then the body's `errors` (a parameter and what is
/// wrong with it) and `message` when the body is JSON with them; with `plain_text`, a body that
/// is not is taken as the message itself.
pub fn describe_refusal(reason: &str, body: &[u8], plain_text: bool) -> String {
    #[derive(serde::Deserialize)]
    struct Refusal {
        #[serde(default)]
        errors: Option<std::collections::BTreeMap<String, serde_json::Value>>,
        #[serde(default)]
        message: Option<String>,
    }
    let mut message = reason.trim().to_owned();
    match serde_json::from_slice::<Refusal>(body) {
        Ok(refusal) => {
            for (parameter, error) in refusal.errors.unwrap_or_default() {
                let error = error
                    .as_str()
                    .map_or_else(|| error.to_string(), str::to_owned);
                message.push_str(&format!("; {parameter}: {}", error.trim()));
            }
            if let Some(text) = refusal.message.filter(|text| text.trim() != message) {
                message.push_str(&format!("; {}", text.trim()));
            }
        }
        Err(_) if plain_text => {
            let text = String::from_utf8_lossy(body);
            let text = text.trim();
            if !text.is_empty() {
                message.push_str(&format!(": {text}"));
            }
        }
        Err(_) => {}
    }
    message
}

/// What stands where a secret the server sent back stood.
pub const REDACTED: &str = "<redacted>";

/// `text` with every occurrence of `secret` replaced.
fn redact_text(text: &str, secret: &str) -> String {
    if secret.is_empty() {
        text.to_owned()
    } else {
        text.replace(secret, REDACTED)
    }
}

/// `body` with every occurrence of `secret` replaced: a server (or something in front of it)
/// that echoes the Authorization header must not get the secret printed.
fn redact_body(body: Vec<u8>, secret: &[u8]) -> Vec<u8> {
    if secret.is_empty() || !body.windows(secret.len()).any(|window| window == secret) {
        return body;
    }
    let mut out = Vec::with_capacity(body.len());
    let mut rest = body.as_slice();
    while let Some(at) = rest
        .windows(secret.len())
        .position(|window| window == secret)
    {
        out.extend_from_slice(rest.get(..at).unwrap_or_default());
        out.extend_from_slice(REDACTED.as_bytes());
        rest = rest.get(at + secret.len()..).unwrap_or_default();
    }
    out.extend_from_slice(rest);
    out
}

/// Calls to one API at once when answers are read ahead: each is a request (and, to a server
/// that closes the connection after each reply, a TLS handshake).
pub const CALLS_AT_ONCE: usize = 16;

/// Runs `call` on `runtime` (a caller that is not async: plan resolution) within what is left
/// until `deadline`; `None` once that has run out.
pub fn within<T>(
    runtime: &tokio::runtime::Runtime,
    deadline: std::time::Instant,
    call: impl std::future::Future<Output = T>,
) -> Option<T> {
    let left = deadline.saturating_duration_since(std::time::Instant::now());
    if left.is_zero() {
        return None;
    }
    runtime
        // The deadline's timer is made inside the runtime that drives it.
        .block_on(async move { tokio::time::timeout(left, call).await })
        .ok()
}

/// `ask` of each of `items`, at most [`CALLS_AT_ONCE`] at a time, within `deadline`: the
/// answers in the order they came, none once the deadline has passed.
pub fn ask_at_once<I, F, Fut>(
    runtime: &tokio::runtime::Runtime,
    deadline: std::time::Instant,
    items: I,
    ask: F,
) -> Vec<Fut::Output>
where
    I: IntoIterator,
    F: FnMut(I::Item) -> Fut,
    Fut: std::future::Future,
{
    use futures_util::StreamExt;
    within(
        runtime,
        deadline,
        futures_util::stream::iter(items)
            .map(ask)
            .buffer_unordered(CALLS_AT_ONCE)
            .collect::<Vec<_>>(),
    )
    .unwrap_or_default()
}

/// `value` as a query value: the unreserved characters and `/` (PVE paths, PBS namespaces)
/// as they are, anything else percent-encoded.
pub fn query_escape(value: &str) -> String {
    value
        .bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                (byte as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}

/// A TCP connect error, told apart from a TLS one by its type.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct TcpError(std::io::Error);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_the_server_echoes_is_redacted() {
        assert_eq!(
            redact_body(
                b"{\"data\":{\"version\":\"s3cr3t and s3cr3t\"}}".to_vec(),
                b"s3cr3t"
            ),
            b"{\"data\":{\"version\":\"<redacted> and <redacted>\"}}"
        );
        assert_eq!(redact_body(b"plain".to_vec(), b"s3cr3t"), b"plain");
        assert_eq!(
            redact_text("bad PVEAPIToken=a@b!c=s3cr3t", "s3cr3t"),
            "bad PVEAPIToken=a@b!c=<redacted>"
        );
    }

    #[test]
    fn values_are_escaped_in_a_query() {
        assert_eq!(query_escape("/vms/100"), "/vms/100");
        assert_eq!(query_escape("/pool/a b&c=d"), "/pool/a%20b%26c%3Dd");
        assert_eq!(query_escape("nightly/web"), "nightly/web");
    }
}
