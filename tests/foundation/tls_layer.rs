//! Refused at the TLS layer: no client certificate, TLS 1.2 only, another CA, expired or not yet
//! valid, a server certificate as a client's, a certificate without an identity; nothing reaches
//! the service.

use super::*;

/// A call that TLS refuses: the error says so and nothing reached the service.
async fn assert_tls_refused(
    node: &TestNode,
    config: std::sync::Arc<rustls::ClientConfig>,
    needle: &str,
) {
    let error = hello_with(&node.address, config).await.unwrap_err();
    eprintln!("refused as expected: {error}");
    assert!(
        error.contains(needle),
        "{error:?} does not mention {needle:?}"
    );
    assert_eq!(node.executor.count(), 0);
}

#[tokio::test]
async fn tls_refusals() {
    let (dir, authority, node) = started_node("tls").await;

    // No client certificate: the server requires one (TLS 1.3 reports it after the client's
    // side of the handshake, on the first request).
    let none = raw_client_config(&authority, &[&rustls::version::TLS13], None);
    assert_tls_refused(&node, none, "received fatal alert: CertificateRequired").await;

    // A client offering only TLS 1.2.
    let identity = authority.issue_operator("alice", now()).unwrap();
    let tls12 = raw_client_config(&authority, &[&rustls::version::TLS12], Some(&identity));
    assert_tls_refused(&node, tls12, "received fatal alert: ProtocolVersion").await;

    // A certificate from another CA (same CA name, other key: the signature does not verify).
    let other = controller(&dir.0.join("other"));
    let foreign = other.issue_operator("mallory", now()).unwrap();
    let config = raw_client_config(&authority, &[&rustls::version::TLS13], Some(&foreign));
    assert_tls_refused(&node, config, "received fatal alert: DecryptError").await;

    // Expired and not yet valid certificates from the right CA.
    let operator = Identity::Operator {
        name: "alice".into(),
    };
    let hour = time::Duration::hours(1);
    let expired = authority
        .issue_client(&operator, now() - 2 * hour, now() - hour)
        .unwrap();
    let config = raw_client_config(&authority, &[&rustls::version::TLS13], Some(&expired));
    assert_tls_refused(&node, config, "received fatal alert: CertificateExpired").await;
    let future = authority
        .issue_client(&operator, now() + hour, now() + 2 * hour)
        .unwrap();
    let config = raw_client_config(&authority, &[&rustls::version::TLS13], Some(&future));
    assert_tls_refused(&node, config, "received fatal alert: CertificateExpired").await;

    // The node's own certificate: issued by the right CA, but for server authentication only.
    let node_as_client = certistack_controller::authority::IssuedCertificate {
        certificate_pem: std::fs::read_to_string(&node.config.tls.certificate).unwrap(),
        key_pem: zeroize::Zeroizing::new(
            std::fs::read_to_string(&node.config.tls.private_key).unwrap(),
        ),
    };
    let config = raw_client_config(
        &authority,
        &[&rustls::version::TLS13],
        Some(&node_as_client),
    );
    assert_tls_refused(
        &node,
        config,
        "received fatal alert: UnsupportedCertificate",
    )
    .await;

    // Sanity: the same hand-built path succeeds with a valid identity.
    let config = raw_client_config(&authority, &[&rustls::version::TLS13], Some(&identity));
    hello_with(&node.address, config).await.unwrap();
}

#[tokio::test]
async fn certificate_without_identity_is_unauthenticated() {
    let (_dir, authority, node) = started_node("noidentity").await;
    // Right CA, right usage, but the URI SANs are not a CertiStack identity.
    let run = RunId::validate(RUN_ID).unwrap();
    let mut uris = Identity::Run {
        run_id: run,
        grant_sha256: [1; 32],
        node: NodeName::validate(NODE).unwrap(),
    }
    .uris();
    uris.pop(); // drop the node binding
    let config = raw_client_config(
        &authority,
        &[&rustls::version::TLS13],
        Some(&issue_with_uris(&authority, &uris)),
    );
    let error = hello_with(&node.address, config).await.unwrap_err();
    assert!(
        error.contains("Unauthenticated") && error.contains("must name its node"),
        "{error}"
    );
    assert_eq!(node.executor.count(), 0);
}

/// Issues a client certificate with arbitrary URI SANs (the controller API only issues
/// well-formed identities).
fn issue_with_uris(
    authority: &certistack_controller::authority::Authority,
    uris: &[String],
) -> certistack_controller::authority::IssuedCertificate {
    issue_with_profile(
        authority,
        uris.iter().map(|u| uri(u)).collect(),
        vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth],
        time::Duration::minutes(11),
    )
}
