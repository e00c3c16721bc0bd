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
    config.limits.idle_timeout_secs = 20;
    let node = TestNode::serve(
        dir.0.join("node"),
        config,
        std::sync::Arc::new(RecordingExecutor::default()),
        std::sync::Arc::new(certistack_connector::clock::SystemClock),
    )
    .await;
    let alice = authority.issue_operator("alice", now()).unwrap();
    let tls = raw_client_config(&authority, &[&rustls::version::TLS13], Some(&alice));
    let opened = Instant::now();
    // Of three connections of the same identity, one is closed at once (well before the 20 s
    // idle timeout). Which one is the node's order: a client's TLS 1.3 handshake ends before the
    // node has read its Finished, so the node may count the third before the second.
    let mut open: Vec<_> = Vec::new();
    for _ in 0..3 {
        open.push(open_quiet(&node.address, tls.clone()).await);
    }
    let mut refused = None;
    while refused.is_none() && opened.elapsed() < Duration::from_secs(10) {
        for (index, stream) in open.iter_mut().enumerate() {
            if closed_within(stream, Duration::from_millis(100))
                .await
                .is_some()
            {
                refused = Some(index);
                break;
            }
        }
    }
    let refused = refused.expect("none of three connections of alice was closed");
    open.remove(refused);
    let mut second = open.pop().unwrap();
    let mut first = open.pop().unwrap();
    // ... while another identity still gets in, and the other two stay open.
    let bob = authority.issue_operator("bob", now()).unwrap();
    let mut c = client(&authority, &node.address, NODE, &bob).await.unwrap();
    c.hello(pb::HelloRequest {}).await.unwrap();
    assert_eq!(
        closed_within(&mut first, Duration::from_millis(500)).await,
        None
    );

    // With no call for limits.idle_timeout_secs, the node closes them.
    let first_closed = closed_within(&mut first, Duration::from_secs(30)).await;
    let idle = opened.elapsed();
    assert!(
        first_closed.is_some(),
        "an idle connection stayed open for {idle:?}"
    );
    assert!(
        idle >= Duration::from_secs(19),
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
