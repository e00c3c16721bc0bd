//! A request that never sends its body does not keep a connection open past the idle bound.

use super::connections::*;
use super::*;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A connection whose only stream sent its request headers and never its body is not busy:
/// it must be closed after limits.idle_timeout_secs like a connection with no stream.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_that_never_sends_its_body_does_not_keep_a_connection_forever() {
    let (dir, authority, mut config) = enrolled_node("silent-stream");
    config.limits.idle_timeout_secs = 10;
    let node = TestNode::serve(
        dir.0.join("node"),
        config,
        std::sync::Arc::new(RecordingExecutor::default()),
        std::sync::Arc::new(certistack_connector::clock::SystemClock),
    )
    .await;
    let alice = authority.issue_operator("alice", now()).unwrap();
    let tls_config = raw_client_config(&authority, &[&rustls::version::TLS13], Some(&alice));
    let mut tls = tls_connect(&node.address, tls_config).await.unwrap();
    let literal = |out: &mut Vec<u8>, value: &str| {
        out.push(u8::try_from(value.len()).unwrap());
        out.extend(value.as_bytes());
    };
    let mut block = vec![0x83, 0x86, 0x04];
    literal(&mut block, HELLO_PATH);
    block.push(0x01);
    literal(&mut block, NODE);
    block.extend([0x0f, 0x10]);
    literal(&mut block, "application/grpc");
    block.push(0x00);
    literal(&mut block, "te");
    literal(&mut block, "trailers");
    let mut opening = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0".to_vec();
    // HEADERS on stream 1 with END_HEADERS and without END_STREAM: the body never comes.
    opening.extend(&u32::try_from(block.len()).unwrap().to_be_bytes()[1..]);
    opening.extend([0x1, 0x4, 0, 0, 0, 1]);
    opening.extend(&block);
    tls.write_all(&opening).await.unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    let closed = loop {
        let Some(left) = Duration::from_secs(20).checked_sub(started.elapsed()) else {
            break None;
        };
        match tokio::time::timeout(left, tls.read(&mut buf)).await {
            Err(_) => break None,
            Ok(Ok(0)) | Ok(Err(_)) => break Some(started.elapsed()),
            Ok(Ok(_)) => {}
        }
    };
    assert!(
        closed.is_some(),
        "a connection holding one silent request was still open after 20 s (idle timeout 10 s)"
    );
}
