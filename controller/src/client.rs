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

/// What `hello` prints of a node's Hello answer, `skew_ms` its clock's difference from this
/// host's. The version, commit and capabilities are the node's text, printed escaped and
/// bounded; the name and surface digest were checked equal to the expected ones.
pub fn describe_hello(reply: &pb::HelloReply, skew_ms: i64) -> String {
    let value = |text: &str| untrusted::printable(text.as_bytes(), untrusted::MAX_VALUE_CHARS);
    let capabilities = reply.capabilities.join(" ");
    [
        format!("node: {}", value(&reply.node_name)),
        format!(
            "version: {} (source {}{})",
            value(&reply.daemon_version),
            value(&reply.source_commit),
            if reply.source_tree_dirty {
                ", with uncommitted changes"
            } else {
                ""
            }
        ),
        format!("surface: {} (matches)", value(&reply.surface_digest)),
        format!(
            "capabilities: {}",
            untrusted::printable(capabilities.as_bytes(), untrusted::MAX_DETAIL_CHARS)
        ),
        format!(
            "node time: {} ms since the epoch ({skew_ms:+} ms from this host)",
            reply.node_time_unix_ms
        ),
        format!("seen as: {}", value(&reply.peer_identity)),
    ]
    .join("\n")
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

#[cfg(test)]
mod tests {
    use super::*;
    use certistack_core::fixtures::{TERMINAL_SEQUENCES, acts_on_a_terminal};

    fn hostile(label: &str) -> String {
        format!("{label}{TERMINAL_SEQUENCES}{}", "A".repeat(100_000))
    }

    #[test]
    fn hello_and_the_nodes_refusals_print_no_terminal_sequence_of_the_node() {
        let reply = pb::HelloReply {
            node_name: "pve1".into(),
            daemon_version: hostile("0.1.0"),
            source_commit: hostile("abc"),
            surface_digest: certistack_proto::SURFACE_DIGEST.into(),
            capabilities: vec![hostile("vm.create"); 64],
            peer_identity: hostile("operator:ctl"),
            ..Default::default()
        };
        let shown = describe_hello(&reply, 0);
        assert_eq!(shown.lines().count(), 6, "{shown}");
        assert!(
            shown.starts_with("node: pve1\nversion: 0.1.0\\u{1b}[1A"),
            "{shown}"
        );
        let refused = NodeError::from(tonic::Status::failed_precondition(hostile(
            "libguestfs inspection: product ",
        )))
        .to_string();
        let drifted = check_hello(
            &pb::HelloReply {
                node_name: hostile("pve1"),
                surface_digest: hostile("sha256:"),
                ..Default::default()
            },
            "pve1",
        )
        .unwrap_err()
        .to_string();
        let misnamed = check_hello(
            &pb::HelloReply {
                surface_digest: certistack_proto::SURFACE_DIGEST.into(),
                node_name: hostile("pve2"),
                ..Default::default()
            },
            "pve1",
        )
        .unwrap_err()
        .to_string();
        for text in [&shown, &refused, &drifted, &misnamed] {
            for line in text.lines() {
                assert!(!acts_on_a_terminal(line), "{line:?}");
            }
            assert!(text.len() < 16 * 1024, "{} bytes", text.len());
        }
    }
}
