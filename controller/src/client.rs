//! Talking to a node: mTLS with a CA-verified node name, then a `Hello` whose surface digest
//! must equal the controller's own.

use crate::authority::IssuedCertificate;
use crate::connect::{self, ConnectError};
use certistack_core::tls::{self, TlsError};
use certistack_core::untrusted;
use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_client::ConnectorClient;
use tonic::transport::Channel;

/// The largest reply accepted from a node: a screendump image at the node's highest
/// `limits.max_screendump_bytes` plus room for the reply's other fields.
pub const MAX_REPLY_BYTES: usize = certistack_core::limits::MAX_SCREENDUMP_BYTES + 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("the node refused the call: {code:?}: {message}")]
    Status { code: tonic::Code, message: String },
    #[error(
        "the node speaks surface {node}, this controller speaks {controller}; install the same certistack release on both"
    )]
    SurfaceDigest { node: String, controller: String },
    #[error(
        "the node answers as \"{answered}\", expected \"{expected}\"; check the address and the node's config"
    )]
    NodeName { answered: String, expected: String },
}

impl From<tonic::Status> for NodeError {
    /// The node's message is its own text, quoting what it met (a tool's output, a guest's
    /// names): it is kept escaped and bounded, as every place that prints it needs it.
    fn from(status: tonic::Status) -> Self {
        NodeError::Status {
            code: status.code(),
            message: untrusted::printable(status.message().as_bytes(), untrusted::MAX_DETAIL_CHARS),
        }
    }
}

/// Connects to `address` over mTLS, presenting `identity`, trusting only `ca_pem` and expecting
/// the node certificate to name `node_name`.
pub async fn connect(
    address: &str,
    node_name: &str,
    ca_pem: &str,
    identity: &IssuedCertificate,
) -> Result<ConnectorClient<Channel>, NodeError> {
    let ca = tls::parse_certificates(ca_pem, "controller CA")?;
    let chain = tls::parse_certificates(&identity.certificate_pem, "client certificate")?;
    let key = tls::parse_private_key(&identity.key_pem, "client key")?;
    let config = tls::client_config(tls::ca_roots(&ca)?, chain, key)?;
    let channel = connect::connect(address.to_owned(), node_name, config).await?;
    Ok(ConnectorClient::new(channel).max_decoding_message_size(MAX_REPLY_BYTES))
}

/// Says hello and checks the node's name and surface digest.
pub async fn hello(
    client: &mut ConnectorClient<Channel>,
    node_name: &str,
) -> Result<pb::HelloReply, NodeError> {
    let reply = client.hello(pb::HelloRequest {}).await?.into_inner();
    check_hello(&reply, node_name)?;
    Ok(reply)
}

/// The controller's checks of a `Hello` answer.
pub fn check_hello(reply: &pb::HelloReply, node_name: &str) -> Result<(), NodeError> {
    if reply.surface_digest != certistack_proto::SURFACE_DIGEST {
        return Err(NodeError::SurfaceDigest {
            node: untrusted::printable(reply.surface_digest.as_bytes(), untrusted::MAX_VALUE_CHARS),
            controller: certistack_proto::SURFACE_DIGEST.to_owned(),
        });
    }
    if reply.node_name != node_name {
        return Err(NodeError::NodeName {
            answered: untrusted::printable(reply.node_name.as_bytes(), untrusted::MAX_VALUE_CHARS),
            expected: node_name.to_owned(),
        });
    }
    Ok(())
}
