//! The controller's checks of a node: its certificate's name, its CA and its surface digest.

use super::*;

#[tokio::test]
async fn controller_refuses_a_node_certificate_with_another_name() {
    let (_dir, authority, node) = started_node("nodename").await;
    let identity = authority.issue_operator("alice", now()).unwrap();
    let error = client(&authority, &node.address, "pve2", &identity)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &error,
            NodeError::Connect(certistack_controller::connect::ConnectError::WrongNode(..))
        ),
        "{error}"
    );
    assert!(
        error.to_string().contains("not valid for name \"pve2\""),
        "{error}"
    );
}

#[tokio::test]
async fn controller_refuses_a_node_of_another_ca() {
    let (dir, _authority, node) = started_node("nodeca").await;
    let other = controller(&dir.0.join("other"));
    let identity = other.issue_operator("alice", now()).unwrap();
    let error = client(&other, &node.address, NODE, &identity)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &error,
            NodeError::Connect(certistack_controller::connect::ConnectError::UnknownIssuer(
                _
            ))
        ),
        "{error}"
    );
}

#[tokio::test]
async fn controller_refuses_a_node_whose_surface_digest_differs() {
    let dir = TempDir::new("drift");
    let authority = controller(&dir.0);
    let address = serve_drifted(&authority, &dir.0.join("node"), NODE).await;
    let identity = authority.issue_operator("alice", now()).unwrap();
    let mut c = client(&authority, &address, NODE, &identity).await.unwrap();
    let error = certistack_controller::client::hello(&mut c, NODE)
        .await
        .unwrap_err();
    assert!(matches!(error, NodeError::SurfaceDigest { .. }), "{error}");
    assert!(
        error
            .to_string()
            .contains("install the same certistack release"),
        "{error}"
    );

    // The pure check, on both fields.
    let good = pb::HelloReply {
        node_name: NODE.into(),
        surface_digest: certistack_proto::SURFACE_DIGEST.into(),
        ..Default::default()
    };
    check_hello(&good, NODE).unwrap();
    assert!(matches!(
        check_hello(&good, "pve2"),
        Err(NodeError::NodeName { .. })
    ));
}
