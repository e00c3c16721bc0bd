//! Under a low descriptor limit the daemon keeps descriptors in reserve and a legitimate peer
//! still gets through.

use super::connections::*;
use super::*;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    // utime and stime: fields 14 and 15 of stat, 12 and 13 after the command name.
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// Under a descriptor limit the connection limits alone would exceed, the daemon keeps
/// `limits.reserved_fds` free, gives up pending handshakes rather than spinning, and a
/// legitimate peer still gets through.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_daemon_keeps_descriptors_in_reserve_under_a_low_limit() {
    raise_descriptor_limit();
    let dir = TempDir::new("reserve");
    let authority = controller(&dir.0);
    let node_dir = dir.0.join("node");
    let config = enroll(&authority, &node_dir, NODE);
    const NOFILE: usize = 200;
    let daemon = Daemon::start(&node_dir, &config, NOFILE as u64);
    let address: SocketAddr = daemon.address.parse().unwrap();
    let operator = authority.issue_operator("alice", now()).unwrap();
    client_when_up(&authority, &daemon.address, &operator).await;
    let idle_fds = daemon.fds();
    let cpu_before = cpu_ticks(daemon.pid());

    let flood = connections_from(5, 600, address, b"").await;
    let mut peak = 0;
    for _ in 0..10 {
        peak = peak.max(daemon.fds());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let started = Instant::now();
    let mut c = client(&authority, &daemon.address, NODE, &operator)
        .await
        .unwrap();
    c.hello(pb::HelloRequest {}).await.unwrap();
    let latency = started.elapsed();
    peak = peak.max(daemon.fds());
    let cpu = cpu_ticks(daemon.pid()) - cpu_before;
    eprintln!(
        "RLIMIT_NOFILE {NOFILE}, reserve {}: idle {idle_fds} descriptors, peak {peak} under 600 idle connections; Hello {latency:?}; daemon CPU {cpu} ticks",
        config.limits.reserved_fds
    );
    assert!(
        peak + config.limits.reserved_fds <= NOFILE + 4,
        "{peak} descriptors open under a limit of {NOFILE} with {} reserved",
        config.limits.reserved_fds
    );
    assert!(latency < Duration::from_secs(5), "Hello took {latency:?}");
    drop(flood);
    drop(c);
    let log = daemon.log();
    assert!(log.contains("RLIMIT_NOFILE is below"), "{log}");
    assert!(log.contains("within limits.reserved_fds"), "{log}");
    assert!(!log.contains("accept failed"), "{log}");
}
