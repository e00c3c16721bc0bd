//! Churning handshakes from many sources leave room for a legitimate peer.

use super::connections::{Daemon, raise_descriptor_limit};
use super::*;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;

/// An unauthenticated peer holding many source addresses, each within the per-source limit,
/// opens a new connection whenever one of its stalled ones is evicted. A legitimate
/// controller's new connection must still complete its handshake and Hello.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn churning_handshakes_from_many_sources_leave_room_for_a_legitimate_peer() {
    raise_descriptor_limit();
    let dir = TempDir::new("churn");
    let authority = controller(&dir.0);
    let node_dir = dir.0.join("node");
    let config = enroll(&authority, &node_dir, NODE);
    let daemon = Daemon::start(&node_dir, &config, 4096);
    let address: SocketAddr = daemon.address.parse().unwrap();
    let operator = authority.issue_operator("alice", now()).unwrap();
    client_when_up(&authority, &daemon.address, &operator).await;
    let stop = Arc::new(AtomicBool::new(false));
    let per_source = config.limits.max_pending_handshakes_per_source;
    let churners: Vec<_> = (0..64u8)
        .flat_map(|s| std::iter::repeat_n(s, per_source))
        .map(|s| {
            let stop = stop.clone();
            tokio::spawn(async move {
                let source = IpAddr::from([127, 0, 2, 1 + s]);
                while !stop.load(Ordering::Relaxed) {
                    let socket = TcpSocket::new_v4().unwrap();
                    socket.bind(SocketAddr::new(source, 0)).unwrap();
                    let Ok(mut tcp) = socket.connect(address).await else {
                        continue;
                    };
                    let mut buf = [0u8; 64];
                    // Held, silent, until the node evicts it (or times it out).
                    let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut buf)).await;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut failures = Vec::new();
    // The churn runs in this test's own process on a shared machine: the bound leaves room
    // for the CPU it takes; an evicted handshake fails at once, whatever the bound.
    for _ in 0..5 {
        let attempt = tokio::time::timeout(Duration::from_secs(3), async {
            let mut c = client(&authority, &daemon.address, NODE, &operator)
                .await
                .map_err(|e| format!("{e:?}"))?;
            c.hello(pb::HelloRequest {})
                .await
                .map_err(|e| format!("{e:?}"))
        })
        .await;
        match attempt {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => failures.push(error),
            Err(_) => failures.push("no Hello within 3 s".into()),
        }
    }
    stop.store(true, Ordering::Relaxed);
    for task in churners {
        task.abort();
    }
    assert!(
        failures.is_empty(),
        "{} of 5 new connections + Hello failed under the churn: {failures:?}",
        failures.len()
    );
}

/// A flood from many source addresses, each holding a single pending handshake (silent, or a
/// partial ClientHello), ties every source at one: no source holds the most, so over the total
/// the oldest pending handshake went, and a controller's became the oldest within a few
/// accepts. With the controller's address in `limits.trusted_peer_networks` its handshakes keep
/// their reserved slots and are never evicted for a flooding peer: each of its new connections
/// completes its TLS handshake and a Hello while the flood goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_single_handshakes_from_many_sources_leaves_room_for_a_trusted_controller() {
    raise_descriptor_limit();
    let dir = TempDir::new("flood");
    let authority = controller(&dir.0);
    let node_dir = dir.0.join("node");
    let mut config = enroll(&authority, &node_dir, NODE);
    config.limits.max_pending_handshakes = 8;
    config.limits.max_pending_handshakes_per_source = 4;
    // The controller connects from 127.0.0.1; the flood from 127.0.5.0/24.
    config.limits.trusted_peer_networks = vec!["127.0.0.1/32".to_owned().try_into().unwrap()];
    let daemon = Daemon::start(&node_dir, &config, 4096);
    let address: SocketAddr = daemon.address.parse().unwrap();
    let operator = authority.issue_operator("alice", now()).unwrap();
    client_when_up(&authority, &daemon.address, &operator).await;
    let stop = Arc::new(AtomicBool::new(false));
    let flood: Vec<_> = (1..=128u8)
        .map(|s| {
            let stop = stop.clone();
            tokio::spawn(async move {
                let source = IpAddr::from([127, 0, 5, s]);
                while !stop.load(Ordering::Relaxed) {
                    let socket = TcpSocket::new_v4().unwrap();
                    socket.bind(SocketAddr::new(source, 0)).unwrap();
                    let Ok(mut tcp) = socket.connect(address).await else {
                        continue;
                    };
                    if s % 2 == 0 {
                        // The first bytes of a TLS record carrying a ClientHello, and no more.
                        let _ = tcp.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]).await;
                    }
                    let mut buf = [0u8; 64];
                    // Held until the node evicts it (or times it out).
                    let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut buf)).await;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut failures = Vec::new();
    for _ in 0..5 {
        let attempt = tokio::time::timeout(Duration::from_secs(3), async {
            let mut c = client(&authority, &daemon.address, NODE, &operator)
                .await
                .map_err(|e| format!("{e:?}"))?;
            c.hello(pb::HelloRequest {})
                .await
                .map_err(|e| format!("{e:?}"))
        })
        .await;
        match attempt {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => failures.push(error),
            Err(_) => failures.push("no Hello within 3 s".into()),
        }
    }
    stop.store(true, Ordering::Relaxed);
    for task in flood {
        task.abort();
    }
    let log = daemon.log();
    assert!(
        failures.is_empty(),
        "{} of 5 new connections + Hello from the trusted controller failed under the flood: {failures:?}\n{}",
        failures.len(),
        log.lines()
            .filter(|l| l.contains("127.0.0.1:"))
            .take(5)
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The flood did meet the limits: its handshakes were evicted or refused.
    assert!(
        log.contains("pending handshake evicted") || log.contains("handshakes refused"),
        "{log}"
    );
}
