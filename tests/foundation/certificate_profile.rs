//! The certificate profile: client certificates outside it, operator certificates valid longer
//! than the limit, and node certificates outside the node profile the controller checks.

use super::*;

/// A subject alternative name of a certificate a profile case issues.
enum San {
    Uri(&'static str),
    Dns(&'static str),
}

/// Client certificates from the controller CA that step outside the certificate profile, each
/// refused as unauthenticated: the case, its subject alternative names, whether it carries the
/// clientAuth extended key usage, and what the refusal names.
const OUTSIDE_THE_PROFILE: &[(&str, &[San], bool, &str)] = &[
    // webpki accepts a certificate without extended key usages for any purpose, the profile
    // does not.
    (
        "no extended key usage at all",
        &[San::Uri("urn:certistack:operator:alice")],
        false,
        "clientAuth",
    ),
    (
        "a DNS name next to the identity",
        &[San::Uri("urn:certistack:operator:alice"), San::Dns("pve1")],
        true,
        "subject alternative name",
    ),
    (
        "a URI that is no part of an identity",
        &[
            San::Uri("urn:certistack:operator:alice"),
            San::Uri("https://example.org/"),
        ],
        true,
        "not part of a CertiStack identity",
    ),
    (
        "a run identity whose grant digest is upper-case hex",
        &[
            San::Uri("urn:certistack:run:0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f"),
            San::Uri(
                "urn:certistack:grant:sha256:ABABABABABABABABABABABABABABABABABABABABABABABABABABABABABABABAB",
            ),
            San::Uri("urn:certistack:node:pve1"),
        ],
        true,
        "lower-case hex",
    ),
];

#[tokio::test]
async fn client_certificates_outside_the_profile_are_unauthenticated() {
    use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, CodeSigning};
    let (_dir, authority, node) = started_node("profile").await;
    let ten_minutes = time::Duration::minutes(10);
    let alice = "urn:certistack:operator:alice";
    let hello = |certificate| {
        let config = raw_client_config(&authority, &[&rustls::version::TLS13], Some(&certificate));
        let address = node.address.clone();
        async move { hello_with(&address, config).await }
    };
    // An extended key usage without clientAuth: webpki already refuses it in the handshake.
    let error = hello(issue_with_profile(
        &authority,
        vec![uri(alice)],
        vec![CodeSigning],
        ten_minutes,
    ))
    .await
    .unwrap_err();
    assert!(error.contains("UnsupportedCertificate"), "{error}");
    for (case, sans, client_auth, needle) in OUTSIDE_THE_PROFILE {
        let sans = sans
            .iter()
            .map(|san| match san {
                San::Uri(text) => uri(text),
                San::Dns(text) => dns(text),
            })
            .collect();
        let usages = if *client_auth {
            vec![ClientAuth]
        } else {
            vec![]
        };
        let error = hello(issue_with_profile(&authority, sans, usages, ten_minutes))
            .await
            .unwrap_err();
        assert!(
            error.contains("Unauthenticated") && error.contains(needle),
            "{case}: {error:?} does not mention {needle:?}"
        );
    }
    assert_eq!(node.executor.count(), 0);

    // The same construction inside the profile is accepted.
    let reply = hello(issue_with_profile(
        &authority,
        vec![uri(alice)],
        vec![ClientAuth],
        ten_minutes,
    ))
    .await
    .unwrap();
    assert_eq!(reply.peer_identity, "operator:alice");
}

#[tokio::test]
async fn operator_certificates_valid_longer_than_the_limit_are_refused() {
    use rcgen::ExtendedKeyUsagePurpose::ClientAuth;
    let (_dir, authority, node) = started_node("oplife").await;
    let limit = certistack_connector::config::Limits::default().max_operator_cert_secs;
    assert_eq!(limit, 600, "the documented ten minutes");
    let alice = || vec![uri("urn:certistack:operator:alice")];
    let hello = |certificate| {
        let config = raw_client_config(&authority, &[&rustls::version::TLS13], Some(&certificate));
        let address = node.address.clone();
        async move { hello_with(&address, config).await }
    };
    let over = time::Duration::seconds(i64::try_from(limit).unwrap() + 1);
    let error = hello(issue_with_profile(
        &authority,
        alice(),
        vec![ClientAuth],
        over,
    ))
    .await
    .unwrap_err();
    assert!(
        error.contains("Unauthenticated") && error.contains("limits.max_operator_cert_secs"),
        "{error}"
    );
    let day = hello(issue_with_profile(
        &authority,
        alice(),
        vec![ClientAuth],
        time::Duration::days(1),
    ))
    .await
    .unwrap_err();
    assert!(day.contains("longer than the 600 s"), "{day}");
    assert_eq!(node.executor.count(), 0);

    let at_limit = time::Duration::seconds(i64::try_from(limit).unwrap());
    hello(issue_with_profile(
        &authority,
        alice(),
        vec![ClientAuth],
        at_limit,
    ))
    .await
    .unwrap();
    // What the controller mints for an invocation is within the limit.
    let minted = authority.issue_operator("alice", now()).unwrap();
    hello(minted).await.unwrap();
}

/// A TLS server presenting `certificate` (issued by the controller CA) that completes
/// handshakes and nothing else: enough for the controller's verifier to judge it.
async fn tls_server_presenting(
    authority: &certistack_controller::authority::Authority,
    certificate: &certistack_controller::authority::IssuedCertificate,
) -> String {
    use certistack_core::tls;
    let chain = tls::parse_certificates(&certificate.certificate_pem, "node").unwrap();
    let key = tls::parse_private_key(&certificate.key_pem, "key").unwrap();
    let ca = tls::parse_certificates(authority.ca_pem(), "ca").unwrap();
    let config = tls::server_config(chain, key, tls::ca_roots(&ca).unwrap()).unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let _ = acceptor.accept(tcp).await;
            });
        }
    });
    address
}

#[tokio::test]
async fn controller_refuses_node_certificates_outside_the_node_profile() {
    use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
    let dir = TempDir::new("nodeprofile");
    let authority = controller(&dir.0);
    let identity = authority.issue_operator("alice", now()).unwrap();
    let year = time::Duration::days(365);
    let cases = [
        (vec![dns(NODE)], vec![], "no extended key usage"),
        (vec![dns(NODE)], vec![ClientAuth], "server authentication"),
        (
            vec![dns(NODE), dns("pbs.lab")],
            vec![ServerAuth],
            "2 subject alternative names",
        ),
        (
            vec![dns(NODE), uri("urn:certistack:operator:alice")],
            vec![ServerAuth],
            "2 subject alternative names",
        ),
    ];
    for (names, usages, needle) in cases {
        let certificate = issue_with_profile(&authority, names, usages, year);
        let address = tls_server_presenting(&authority, &certificate).await;
        let error = client(&authority, &address, NODE, &identity)
            .await
            .unwrap_err();
        assert!(
            matches!(
                &error,
                NodeError::Connect(certistack_controller::connect::ConnectError::NotANode(..))
            ) && error.to_string().contains(needle),
            "{needle}: {error}"
        );
    }
    // A certificate the way `node sign` issues it passes the verifier.
    let good = issue_with_profile(&authority, vec![dns(NODE)], vec![ServerAuth], year);
    let address = tls_server_presenting(&authority, &good).await;
    let connected = client(&authority, &address, NODE, &identity).await;
    assert!(
        !matches!(
            &connected,
            Err(NodeError::Connect(
                certistack_controller::connect::ConnectError::NotANode(..)
            ))
        ),
        "{:?}",
        connected.err()
    );
}
