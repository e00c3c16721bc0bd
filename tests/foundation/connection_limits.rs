//! Connections are bounded per identity and closed when idle.

use super::connections::*;
use super::*;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A TLS connection that sends the HTTP/2 preface and empty SETTINGS, then nothing.
async fn open_quiet(
    address: &str,
    config: std::sync::Arc<rustls::ClientConfig>,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let mut tls = tls_connect(address, config).await.unwrap();
    tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    tls
}

/// Reads (and discards) until the node closes the connection; how long that took, or
/// `None` when it was still open after `wait`.
async fn closed_within(
    tls: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    wait: Duration,
) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        let left = wait.checked_sub(started.elapsed())?;
        match tokio::time::timeout(left, tls.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(started.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn connections_are_bounded_per_identity_and_closed_when_idle() {
    let (dir, authority, mut config) = enrolled_node("conn-limits");
    config.limits.max_connections_per_identity = 2;
    config.limits.idle_timeout_secs = 10;
    let node = TestNode::serve(
        dir.0.join("node"),
        config,
        std::sync::Arc::new(RecordingExecutor::default()),
        std::sync::Arc::new(certistack_connector::clock::SystemClock),
    )
    .await;
    let alice = authority.issue_operator("alice", now()).unwrap();
    let tls = raw_client_config(&authority, &[&rustls::version::TLS13], Some(&alice));
    let mut first = open_quiet(&node.address, tls.clone()).await;
    let mut second = open_quiet(&node.address, tls.clone()).await;
    let opened = Instant::now();
    // A third connection of the same identity is closed at once (within 5 s: well before the
    // 10 s idle timeout, with room for a loaded 2-core machine) ...
    let mut third = open_quiet(&node.address, tls.clone()).await;
    let closed = closed_within(&mut third, Duration::from_secs(5)).await;
    assert!(closed.is_some(), "a third connection of alice stayed open");
    // ... while another identity still gets in, and the first two stay open.
    let bob = authority.issue_operator("bob", now()).unwrap();
    let mut c = client(&authority, &node.address, NODE, &bob).await.unwrap();
    c.hello(pb::HelloRequest {}).await.unwrap();
    assert_eq!(
        closed_within(&mut first, Duration::from_millis(500)).await,
        None
    );

    // With no call for limits.idle_timeout_secs, the node closes them.
    let first_closed = closed_within(&mut first, Duration::from_secs(15)).await;
    let idle = opened.elapsed();
    assert!(
        first_closed.is_some(),
        "an idle connection stayed open for {idle:?}"
    );
    assert!(
        idle >= Duration::from_secs(9),
        "closed after {idle:?}, before the idle timeout"
    );
    assert!(
        closed_within(&mut second, Duration::from_secs(2))
            .await
            .is_some()
    );
    // Their slots are free again.
    let mut fresh = open_quiet(&node.address, tls).await;
    assert_eq!(
        closed_within(&mut fresh, Duration::from_millis(500)).await,
        None
    );
}
