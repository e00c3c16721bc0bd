//! Guest services that never stop talking: their answers are bounded, escaped and capped.

use super::*;

/// Guest services that never stop talking: an LDAP server streaming entries (small ones on 389,
/// 10 KiB ones on 3389) mixed with referrals, a DNS server answering with a 64 KiB message of
/// 4,000 records, an HTTP body without end, a banner without a line end. What they send
/// carries terminal escapes and line breaks.
const HOSTILE_GUEST: &str = r#"
import socket, struct, threading
G = '198.51.100.10'
EVIL = b'dc=evil\x1b[31m\nFAKE LOG LINE\x07'
def ln(n):
    if n < 0x80: return bytes([n])
    b = n.to_bytes((n.bit_length() + 7) // 8, 'big'); return bytes([0x80 | len(b)]) + b
def tlv(tag, body): return bytes([tag]) + ln(len(body)) + body
def entry(value):
    attr = tlv(0x30, tlv(0x04, b'namingContexts') + tlv(0x31, tlv(0x04, value)))
    return tlv(0x30, tlv(0x02, b'\x02') + tlv(0x64, tlv(0x04, b'') + tlv(0x30, attr)))
REF = tlv(0x30, tlv(0x02, b'\x02') + tlv(0x73, tlv(0x04, b'ldap://evil/\x1b[0m')))
BIND = tlv(0x30, tlv(0x02, b'\x01') + tlv(0x61, tlv(0x0a, b'\x00') + tlv(0x04, b'') + tlv(0x04, b'')))
def listen(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((G, port)); s.listen(); return s
def forever(port, handle):
    s = listen(port)
    def loop():
        while True:
            c, _ = s.accept()
            threading.Thread(target=guard, args=(handle, c), daemon=True).start()
    threading.Thread(target=loop, daemon=True).start()
def guard(handle, c):
    try: handle(c)
    except OSError: pass
    finally: c.close()
def ldap(value):
    def handle(c):
        c.recv(4096); c.sendall(BIND); c.recv(4096)
        chunk = (entry(value) + REF) * 16
        while True: c.sendall(chunk)
    return handle
def http(c):
    c.recv(4096)
    c.sendall(b'HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n')
    block = EVIL * 4096
    while True: c.sendall(block)
def banner(c):
    while True: c.sendall(b'SSX\x1b[2J\x07' * 1024)
forever(389, ldap(EVIL))
forever(3389, ldap(EVIL * 400))
forever(80, http)
forever(22, banner)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((G, 53))
while True:
    q, a = u.recvfrom(4096)
    qid, qd = q[:2], q[12:]
    count = 4000
    rr = b'\xc0\x0c' + struct.pack('>HHIH', 1, 1, 60, 4) + bytes([198, 51, 100, 10])
    u.sendto(qid + struct.pack('>HHHHH', 0x8180, 1, count, 0, 0) + qd + rr * count, a)
"#;

/// A `/proc/self/status` figure in KiB: `VmRSS` (now) or `VmHWM` (the peak since the last
/// reset by [`reset_peak_rss`]).
fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

fn reset_peak_rss() {
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
}

#[test]
fn hostile_guest_answers_are_bounded_escaped_and_capped() {
    if !privileged(
        "hostile_guest_answers_are_bounded_escaped_and_capped",
        TOOLS,
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut topology = Topology::new("hostile");
    let guest = topology.guest.clone();
    topology.serve(&guest, &["python3", "-c", HOSTILE_GUEST]);
    std::thread::sleep(std::time::Duration::from_millis(800));
    inside_node(topology, |_topology| async move {
        let node = Node::start(5).await;
        let target =
            |kind: pb::ProbeKind, port: u32, expect: pb::ProbeExpectation| pb::ProbeTarget {
                kind: kind as i32,
                address: GUEST.into(),
                port,
                expect: Some(expect),
            };
        let hostile = vec![
            target(
                pb::ProbeKind::Ldap,
                389,
                pb::ProbeExpectation {
                    ldap_naming_context: "dc=example,dc=test".into(),
                    ..Default::default()
                },
            ),
            target(pb::ProbeKind::Ldap, 3389, pb::ProbeExpectation::default()),
            target(
                pb::ProbeKind::Dns,
                53,
                pb::ProbeExpectation {
                    dns_name: "www.example.test".into(),
                    dns_type: pb::DnsRecordType::A as i32,
                    ..Default::default()
                },
            ),
            target(
                pb::ProbeKind::Http,
                80,
                pb::ProbeExpectation {
                    http_path: "/".into(),
                    http_status: 200,
                    ..Default::default()
                },
            ),
            target(
                pb::ProbeKind::Tcp,
                22,
                pb::ProbeExpectation {
                    banner_prefix: "SSH-2.0-".into(),
                    ..Default::default()
                },
            ),
        ];
        let mut c = node.run(RUN_ID, hostile.clone()).await;
        c.prepare_sandbox(prepare()).await.unwrap();
        let expected_reason = [
            "stopped reading: 198.51.100.10:389 sent more than 64 LDAP messages (limits.max_probe_entries)",
            "stopped reading: 198.51.100.10:3389 sent more than 262144 bytes (limits.max_probe_response_bytes)",
            "stopped reading: 198.51.100.10:53 sent more than 64 DNS records (limits.max_probe_entries): the answer announces 4000 records",
            "stopped reading: 198.51.100.10:80 sent more than 262144 bytes (limits.max_probe_response_bytes)",
            "banner \"SSX\\u{1b}[2J\\u{7}SSX\\u{1b}[2J\\u{7}",
        ];
        let mut measured = Vec::new();
        let mut worst = 0;
        for (target, reason) in hostile.iter().zip(expected_reason) {
            let started = std::time::Instant::now();
            let before = status_kib("VmRSS:");
            reset_peak_rss();
            let reply = c
                .probe(pb::ProbeRequest {
                    kind: target.kind,
                    address: target.address.clone(),
                    port: target.port,
                })
                .await
                .unwrap()
                .into_inner();
            let elapsed = started.elapsed();
            // The peak during the probe, over the resident size when it began: the whole
            // process (connector, client, runtime), so an upper bound on what the probe held.
            let growth = status_kib("VmHWM:").saturating_sub(before);
            worst = worst.max(growth);
            assert_eq!(
                reply.outcome,
                pb::ProbeOutcome::Failed as i32,
                "{}",
                reply.detail
            );
            assert!(
                reply.detail.contains(reason),
                "port {}: {:?} lacks {reason:?}",
                target.port,
                reply.detail
            );
            assert!(
                elapsed < std::time::Duration::from_secs(5),
                "port {} took {elapsed:?}, past its timeout",
                target.port
            );
            assert!(
                !reply.detail.chars().any(char::is_control),
                "an unescaped control character: {:?}",
                reply.detail
            );
            assert!(reply.detail.len() <= 2200, "{} bytes", reply.detail.len());
            measured.push(format!(
                "port {}: {elapsed:.2?}, peak RSS +{growth} KiB over {before} KiB, detail {:?}",
                target.port, reply.detail
            ));
        }
        eprintln!("hostile probes: {}", measured.join("; "));
        assert!(
            worst < 16 * 1024,
            "memory grew by {worst} KiB during one probe"
        );

        // The journal holds the same escaped, capped text.
        let mut stream = c
            .read_journal(pb::ReadJournalRequest {
                run_id: RUN_ID.into(),
            })
            .await
            .unwrap()
            .into_inner();
        let mut probe_records = 0;
        while let Some(record) = stream.message().await.unwrap() {
            if record.operation == "probe.run" && record.phase == "done" {
                probe_records += 1;
                let detail: serde_json::Value = serde_json::from_str(&record.detail).unwrap();
                let text = detail["detail"].as_str().unwrap();
                assert!(!text.chars().any(char::is_control), "{text:?}");
                assert!(text.len() <= 2200, "{} bytes", text.len());
                assert!(record.detail.len() <= 4096, "{} bytes", record.detail.len());
            }
        }
        assert_eq!(probe_records, hostile.len());
        let (_, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
        node.stop().await;
    });
}
