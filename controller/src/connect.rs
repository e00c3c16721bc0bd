//! Connecting to a node: a gRPC channel over mTLS with the client profile of
//! [`certistack_core::tls`], keepalives, and errors that say what to do.

use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;

/// How long the controller waits for a node's TCP connection and TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often an idle or busy client connection pings its peer, and how long a ping may go
/// unanswered before the connection counts as lost.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// Opens a gRPC channel to a node over mTLS; `node_name` is the name its certificate must carry.
pub async fn connect(
    address: String,
    node_name: &str,
    config: Arc<ClientConfig>,
) -> Result<tonic::transport::Channel, ConnectError> {
    let server_name = ServerName::try_from(node_name.to_owned())
        .map_err(|_| ConnectError::Name(node_name.to_owned()))?;
    let connector = tokio_rustls::TlsConnector::from(config);
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .map_err(|e| ConnectError::Address(address.clone(), e.to_string()))?
        .connect_timeout(HANDSHAKE_TIMEOUT)
        // A peer that stops answering (a stopped process, a path that drops packets) is noticed
        // within about 30 s even while a long call is in flight, instead of never.
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true);
    // No per-request timeout here: every node operation has its own deadline on the node,
    // and cutting a call short would only kill the tool mid-way.
    let target = address.clone();
    endpoint
        .connect_with_connector(tower::service_fn(move |_uri| {
            let connector = connector.clone();
            let server_name = server_name.clone();
            let target = target.clone();
            async move {
                let tcp = TcpStream::connect(&target).await?;
                tcp.set_nodelay(true)?;
                let tls = connector.connect(server_name, tcp).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }))
        .await
        .map_err(|e| classify(address, &e))
}

/// Turns a failed connect into an error that says what to do: the node's certificate names
/// another node, comes from another CA, or the network/handshake failed.
fn classify(address: String, error: &(dyn std::error::Error + 'static)) -> ConnectError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(cause) = source {
        let rustls_error = cause.downcast_ref::<rustls::Error>().or_else(|| {
            cause
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|e| e.downcast_ref::<rustls::Error>())
        });
        if let Some(rustls::Error::InvalidCertificate(certificate_error)) = rustls_error {
            use rustls::CertificateError as E;
            return match certificate_error {
                E::NotValidForName | E::NotValidForNameContext { .. } => {
                    ConnectError::WrongNode(address, certificate_error.to_string())
                }
                E::UnknownIssuer | E::BadSignature => ConnectError::UnknownIssuer(address),
                E::Other(_) | E::InvalidPurpose | E::InvalidPurposeContext { .. } => {
                    ConnectError::NotANode(address, certificate_error.to_string())
                }
                _ => ConnectError::Transport(
                    address,
                    rustls_error.map(|e| e.to_string()).unwrap_or_default(),
                ),
            };
        }
        source = cause.source();
    }
    ConnectError::Transport(address, transport_reason(error))
}

/// The innermost cause of a transport error: that is where rustls says what was wrong.
fn transport_reason(error: &(dyn std::error::Error + 'static)) -> String {
    let mut reason = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        reason = cause.to_string();
        source = cause.source();
    }
    reason
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("{0:?} is not a valid node name for TLS verification")]
    Name(String),
    #[error("{0:?} is not a valid address: {1}")]
    Address(String, String),
    #[error("cannot reach the connector at {0} over mTLS: {1}")]
    Transport(String, String),
    #[error("the connector at {0} is not the node asked for: {1}; check --node and --name")]
    WrongNode(String, String),
    #[error(
        "the connector at {0} presents a certificate not issued by this controller's CA; enroll the node with this CA"
    )]
    UnknownIssuer(String),
    #[error("the connector at {0} is refused: {1}")]
    NotANode(String, String),
}
