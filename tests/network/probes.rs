//! Containment and probes against real services: the guest reaches neither the node nor the other
//! network, every probe kind passes and fails as expected, probe networks that would take over
//! the node's routing are refused, a probe never leaves through another interface, IPv6 targets
//! resolve to themselves only, and a probe address the node removed is an infrastructure error.

use super::*;

#[test]
fn containment_and_probes_against_real_services() {
    if !privileged("containment_and_probes_against_real_services", TOOLS) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut topology = Topology::new("probe");
    let fingerprint = topology.start_guest_services();
    // A listener on the node side of the VNet, and one in the second network.
    let node_ns = topology.node.clone();
    let other_ns = topology.other.clone();
    let listener = "import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind(('0.0.0.0',8080));s.listen()\nwhile True:\n c,_=s.accept();c.close()";
    topology.serve(&node_ns, &["python3", "-c", listener]);
    topology.serve(&other_ns, &["python3", "-c", listener]);
    std::thread::sleep(std::time::Duration::from_millis(500));
    let topology = std::sync::Arc::new(topology);
    let t = topology.clone();
    inside(&node_ns, move || async move {
        let topology = t;
        let node = Node::start(3).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        let evidence = c.prepare_sandbox(prepare()).await.unwrap().into_inner();
        assert_eq!(evidence.bridge_ports, ["tap9100i0"]);
        assert!(
            evidence.bridge_addresses.contains(&PROBE_SOURCE.to_owned()),
            "{:?}",
            evidence.bridge_addresses
        );
        assert_eq!(
            evidence.forwarding_sysctl,
            "net.ipv4.conf.csbox1.forwarding = 0\nnet.ipv6.conf.csbox1.forwarding = 0"
        );
        let listed = String::from_utf8(
            topology
                .node_sh(&[
                    "nft",
                    "list",
                    "table",
                    "inet",
                    "certistack_0f0e1c2d3b4a4c5d8e6f7a8b9c0d1e2f",
                ])
                .stdout,
        )
        .unwrap();
        assert_eq!(evidence.ruleset_text, listed);
        assert_eq!(
            evidence.ruleset_sha256,
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(listed.as_bytes()))
        );

        // Containment: the guest reaches neither the node nor, through it, another network,
        // even once someone turns forwarding on behind the connector's back.
        assert!(
            !topology.guest_connects("198.51.100.2", 8080),
            "the guest reached the node"
        );
        topology.node_sh(&["sysctl", "-w", "net.ipv4.ip_forward=1"]);
        assert!(
            !topology.guest_connects("203.0.113.5", 8080),
            "the guest reached the second network"
        );

        // Probes pass against the real services, from the probe address.
        let mut latencies = Vec::new();
        for target in targets(true) {
            let kind = pb::ProbeKind::try_from(target.kind).unwrap();
            let reply = c
                .probe(pb::ProbeRequest {
                    kind: target.kind,
                    address: target.address.clone(),
                    port: target.port,
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(
                reply.outcome,
                pb::ProbeOutcome::Passed as i32,
                "{kind:?}: {}",
                reply.detail
            );
            assert_eq!(reply.origin, "worker_host 198.51.100.2");
            assert_eq!(reply.received_sha256.len(), 64, "{kind:?}");
            if kind == pb::ProbeKind::Https {
                assert_eq!(
                    reply.tls_certificate_sha256, fingerprint,
                    "the guest's certificate is recorded"
                );
            }
            latencies.push(format!(
                "{kind:?} {:.2} ms",
                reply.latency_us as f64 / 1000.0
            ));
        }
        eprintln!("probe latencies (passing): {}", latencies.join(", "));

        c.release_sandbox(pb::ReleaseSandboxRequest { vnet: VNET.into() })
            .await
            .unwrap();
        assert!(
            !tables(&topology).contains("certistack_"),
            "{}",
            tables(&topology)
        );
        assert!(
            !bridge_addresses(&topology).contains("198.51.100.2"),
            "{}",
            bridge_addresses(&topology)
        );
        // Control: without the table, the same paths are open, so the checks above could fail.
        topology.node_sh(&["ip", "address", "add", "198.51.100.2/24", "dev", "csbox1"]);
        assert!(
            topology.guest_connects("198.51.100.2", 8080),
            "control: the node listener is reachable without the table"
        );
        assert!(
            topology.guest_connects("203.0.113.5", 8080),
            "control: forwarding works without the table"
        );
        topology.node_sh(&["ip", "address", "del", "198.51.100.2/24", "dev", "csbox1"]);
        topology.node_sh(&["sysctl", "-w", "net.ipv4.ip_forward=0"]);
        let reply = c
            .cleanup(pb::CleanupRequest {
                run_id: RUN_ID.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(reply.residue.is_empty(), "{:?}", reply.residue);
        c.end_run(pb::EndRunRequest {}).await.unwrap();

        // A second run with failing expectations and a target nobody answers.
        let second = "11111111-2222-4333-8444-555555555555";
        let mut c = node.run(second, targets(false)).await;
        c.prepare_sandbox(prepare()).await.unwrap();
        let mut latencies = Vec::new();
        for target in targets(false) {
            let kind = pb::ProbeKind::try_from(target.kind).unwrap();
            let started = std::time::Instant::now();
            let reply = c
                .probe(pb::ProbeRequest {
                    kind: target.kind,
                    address: target.address.clone(),
                    port: target.port,
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(
                reply.outcome,
                pb::ProbeOutcome::Failed as i32,
                "{kind:?} {}: {}",
                target.address,
                reply.detail
            );
            assert!(
                started.elapsed() < std::time::Duration::from_secs(5),
                "{kind:?} exceeded its bound"
            );
            latencies.push(format!("{kind:?} {} -> {}", target.address, reply.detail));
        }
        eprintln!("failing probes: {}", latencies.join(" | "));
        assert_cleanup_releases_only_the_sandbox(&mut c, second).await;
        node.stop().await;
    });
    drop(topology);
}
/// A grant for `run_id` whose probe source is `probe_source`.
async fn run_with_source(
    node: &Node,
    run_id: &str,
    probe_source: &str,
    targets: Vec<pb::ProbeTarget>,
) -> (
    ConnectorClient<Channel>,
    Result<tonic::Response<pb::BeginRunReply>, tonic::Status>,
) {
    let mut wire = grant(run_id, NODE);
    wire.probe_source = probe_source.into();
    wire.probe_targets = targets;
    // No guest network recovery: its guest address would have to be in this probe network.
    wire.network_recovery_modes.clear();
    wire.guest_address.clear();
    let credentials = mint(&node.authority, &wire);
    let mut c = client(
        &node.authority,
        &node.address,
        NODE,
        &credentials.certificate,
    )
    .await
    .unwrap();
    let begun = c.begin_run(begin_request(&credentials)).await;
    (c, begun)
}

#[test]
fn probe_networks_that_would_take_over_the_nodes_routing_are_refused() {
    if !privileged(
        "probe_networks_that_would_take_over_the_nodes_routing_are_refused",
        TOOLS,
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("route"), |topology| async move {
        let node = Node::start(3).await;
        // A /1 would beat the default route for half the Internet: refused when the run begins.
        let (_, begun) = run_with_source(
            &node,
            "22222222-3333-4444-8555-666666666666",
            "198.51.100.2/1",
            targets(true),
        )
        .await;
        let status = begun.unwrap_err();
        assert_eq!(
            status.code(),
            Code::FailedPrecondition,
            "{}",
            status.message()
        );
        assert!(
            status.message().contains(
                "the probe network 128.0.0.0/1 is wider than this node allows (prefix at least /24"
            ),
            "{}",
            status.message()
        );

        let mut c = node.run(RUN_ID, targets(true)).await;
        type Conflict = (
            &'static [&'static str],
            &'static [&'static str],
            &'static str,
        );
        let conflicts: [Conflict; 3] = [
            (
                &["ip", "route", "add", "198.51.0.0/16", "via", "203.0.113.5"],
                &["ip", "route", "del", "198.51.0.0/16"],
                "the probe network 198.51.100.0/24 overlaps the node's route 198.51.0.0/16 dev uplink0 table main",
            ),
            (
                &["ip", "address", "add", "198.51.100.2/32", "dev", "uplink0"],
                &["ip", "address", "del", "198.51.100.2/32", "dev", "uplink0"],
                "the probe address 198.51.100.2 is already an address of this node (on uplink0)",
            ),
            (
                &["ip", "address", "add", "198.51.100.77/28", "dev", "uplink0"],
                &["ip", "address", "del", "198.51.100.77/28", "dev", "uplink0"],
                "overlaps the node's address 198.51.100.77/28 on uplink0",
            ),
        ];
        for (make, undo, reason) in conflicts {
            topology.node_sh(make);
            let status = c.prepare_sandbox(prepare()).await.unwrap_err();
            assert_refused_with_nothing_installed(
                &status,
                &topology,
                &[
                    "the probe network 198.51.100.2/24 cannot be added to this node",
                    reason,
                ],
            );
            topology.node_sh(undo);
        }

        // Control: without them the same request passes; the table is in place before the
        // probe address is added.
        c.prepare_sandbox(prepare()).await.unwrap();
        let steps = journal_steps(&mut c, RUN_ID).await;
        let at = |step: &str| {
            steps
                .iter()
                .position(|s| s == step)
                .unwrap_or_else(|| panic!("{step:?} not in {steps:?}"))
        };
        assert!(
            at("sandbox.nft nft:certistack_0f0e1c2d3b4a4c5d8e6f7a8b9c0d1e2f done")
                < at("sandbox.address addr:csbox1 intent"),
            "{steps:?}"
        );
        assert_cleanup_releases_only_the_sandbox(&mut c, RUN_ID).await;
        node.stop().await;
    });
}
#[test]
fn a_probe_never_leaves_through_another_interface() {
    if !privileged("a_probe_never_leaves_through_another_interface", TOOLS) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut topology = Topology::new("bind");
    // "Production": the target address exists only in the other network, behind uplink0.
    let other = topology.other.clone();
    sh(&[
        "ip",
        "-n",
        &other,
        "address",
        "add",
        "198.51.100.20/32",
        "dev",
        "eth0",
    ]);
    let log = topology.dir.0.join("accepted.log");
    let listener = format!(
        "import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind(('198.51.100.20',8080));s.listen()\nwhile True:\n c,a=s.accept();open('{}','a').write(a[0]+'\\n');c.close()",
        log.display()
    );
    topology.serve(&other, &["python3", "-c", &listener]);
    std::thread::sleep(std::time::Duration::from_millis(500));
    inside_node(topology, |topology| async move {
        let node = Node::start(3).await;
        let target = pb::ProbeTarget {
            kind: pb::ProbeKind::Tcp as i32,
            address: "198.51.100.20".into(),
            port: 8080,
            expect: Some(pb::ProbeExpectation::default()),
        };
        let mut c = node.run(RUN_ID, vec![target.clone()]).await;
        c.prepare_sandbox(prepare()).await.unwrap();
        // A route added after the checks sends the target's address out of uplink0.
        topology.node_sh(&[
            "ip",
            "route",
            "add",
            "198.51.100.20/32",
            "via",
            "203.0.113.5",
            "dev",
            "uplink0",
        ]);
        // Control: from the probe address, without the device binding, the route reaches it.
        let control = "import socket\ns=socket.socket();s.settimeout(2);s.bind(('198.51.100.2',0));s.connect(('198.51.100.20',8080))";
        assert!(
            topology
                .in_ns(&topology.node, &["python3", "-c", control])
                .status()
                .unwrap()
                .success(),
            "control: the route through uplink0 reaches the target"
        );
        let reply = c
            .probe(pb::ProbeRequest {
                kind: target.kind,
                address: target.address.clone(),
                port: target.port,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            reply.outcome,
            pb::ProbeOutcome::Failed as i32,
            "the probe reached the target through another interface: {}",
            reply.detail
        );
        let accepted = std::fs::read_to_string(&log).unwrap_or_default();
        assert_eq!(
            accepted.lines().count(),
            1,
            "only the control connected: {accepted:?}"
        );
        eprintln!("probe over a foreign route: {}", reply.detail);
        topology.node_sh(&["ip", "route", "del", "198.51.100.20/32"]);
        let (_, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
        node.stop().await;
    });
}
/// Whether an ICMPv6 echo request from `source` to `target`, sent from namespace `ns`, is
/// answered within 1.5 s.
fn echo_answered(topology: &Topology, ns: &str, source: &str, target: &str) -> bool {
    let script = format!(
        "import socket,sys,time\n\
         s=socket.socket(socket.AF_INET6,socket.SOCK_RAW,socket.IPPROTO_ICMPV6)\n\
         s.bind(('{source}',0));s.settimeout(0.3)\n\
         try:\n s.sendto(bytes([128,0,0,0,0x43,0x53,0,1])+b'certistack',('{target}',0))\n\
         except OSError:\n sys.exit(1)\n\
         end=time.time()+1.5\n\
         while time.time()<end:\n\
         \x20try:\n  d,a=s.recvfrom(2048)\n\
         \x20except socket.timeout:\n  continue\n\
         \x20if d[0]==129 and a[0]=='{target}':\n  sys.exit(0)\n\
         sys.exit(1)"
    );
    topology
        .in_ns(ns, &["python3", "-c", &script])
        .status()
        .unwrap()
        .success()
}

#[test]
fn ipv6_probes_resolve_their_target_and_nothing_else() {
    if !privileged("ipv6_probes_resolve_their_target_and_nothing_else", TOOLS) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut topology = Topology::new("six");
    let guest = topology.guest.clone();
    sh(&[
        "ip",
        "-n",
        &guest,
        "address",
        "add",
        "2001:db8:5::10/120",
        "dev",
        "eth0",
        "nodad",
    ]);
    let banner = "import socket\ns=socket.socket(socket.AF_INET6);s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind(('2001:db8:5::10',22));s.listen()\nwhile True:\n c,_=s.accept();c.sendall(b'SSH-2.0-CertiStackTest\\r\\n');c.close()";
    topology.serve(&guest, &["python3", "-c", banner]);
    std::thread::sleep(std::time::Duration::from_millis(500));
    inside_node(topology, |topology| async move {
        const SOURCE: &str = "2001:db8:5::2/120";
        let node = Node::start(3).await;
        let target = pb::ProbeTarget {
            kind: pb::ProbeKind::Tcp as i32,
            address: "2001:db8:5::10".into(),
            port: 22,
            expect: Some(pb::ProbeExpectation {
                banner_prefix: "SSH-2.0-".into(),
                ..Default::default()
            }),
        };
        let (mut c, begun) = run_with_source(&node, RUN_ID, SOURCE, vec![target.clone()]).await;
        begun.unwrap();
        let evidence = c
            .prepare_sandbox(pb::PrepareSandboxRequest {
                vnet: VNET.into(),
                probe_source: SOURCE.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(
            evidence.ruleset_text.contains("nd-neighbor-solicit"),
            "{}",
            evidence.ruleset_text
        );
        let reply = c
            .probe(pb::ProbeRequest {
                kind: target.kind,
                address: target.address.clone(),
                port: target.port,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            reply.outcome,
            pb::ProbeOutcome::Passed as i32,
            "{}",
            reply.detail
        );
        eprintln!("IPv6 TCP probe: {} us", reply.latency_us);
        // The neighbours resolved each other; any other ICMPv6 is still dropped both ways.
        let (node_ns, guest_ns) = (topology.node.clone(), topology.guest.clone());
        assert!(
            !echo_answered(&topology, &guest_ns, "2001:db8:5::10", "2001:db8:5::2"),
            "the guest's echo request reached the probe address"
        );
        assert!(
            !echo_answered(&topology, &node_ns, "2001:db8:5::2", "2001:db8:5::10"),
            "an echo request left the probe address"
        );
        // Control: without the table (the address put back by hand) the same echo is answered,
        // so the drops above were the table's.
        c.release_sandbox(pb::ReleaseSandboxRequest { vnet: VNET.into() })
            .await
            .unwrap();
        topology.node_sh(&["ip", "address", "add", SOURCE, "dev", "csbox1", "nodad"]);
        assert!(
            echo_answered(&topology, &guest_ns, "2001:db8:5::10", "2001:db8:5::2"),
            "control: the echo is answered without the table"
        );
        topology.node_sh(&["ip", "address", "del", SOURCE, "dev", "csbox1"]);
        let (_, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
        node.stop().await;
    });
}
#[test]
fn a_probe_address_removed_by_the_node_is_an_infrastructure_error() {
    if !privileged(
        "a_probe_address_removed_by_the_node_is_an_infrastructure_error",
        TOOLS,
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut topology = Topology::new("purge");
    let guest = topology.guest.clone();
    let banner = "import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind(('198.51.100.10',22));s.listen()\nwhile True:\n c,_=s.accept();c.sendall(b'SSH-2.0-CertiStackTest\\r\\n');c.close()";
    topology.serve(&guest, &["python3", "-c", banner]);
    std::thread::sleep(std::time::Duration::from_millis(500));
    inside_node(topology, |topology| async move {
        let node = Node::start(3).await;
        let target = pb::ProbeTarget {
            kind: pb::ProbeKind::Tcp as i32,
            address: GUEST.into(),
            port: 22,
            expect: Some(pb::ProbeExpectation {
                banner_prefix: "SSH-2.0-".into(),
                ..Default::default()
            }),
        };
        let request = pb::ProbeRequest {
            kind: target.kind,
            address: target.address.clone(),
            port: target.port,
        };
        let mut c = node.run(RUN_ID, vec![target]).await;
        c.prepare_sandbox(prepare()).await.unwrap();
        let reply = c.probe(request.clone()).await.unwrap().into_inner();
        assert_eq!(
            reply.outcome,
            pb::ProbeOutcome::Passed as i32,
            "{}",
            reply.detail
        );
        // What `ifreload -a` does to an address it did not configure.
        topology.node_sh(&["ip", "address", "del", PROBE_SOURCE, "dev", "csbox1"]);
        let status = c.probe(request).await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{}", status.message());
        assert!(
            status
                .message()
                .starts_with("probe address removed by the node (ifreload?): 198.51.100.2/24 is no longer on csbox1"),
            "{}",
            status.message()
        );
        let steps = journal_steps(&mut c, RUN_ID).await;
        assert_eq!(
            steps.last().map(String::as_str),
            Some("probe.run probe:tcp:198.51.100.10:22 failed"),
            "{steps:?}"
        );
        let (receipts, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert_eq!(
            receipts,
            [
                "addr:csbox1 already gone",
                "nft:certistack_0f0e1c2d3b4a4c5d8e6f7a8b9c0d1e2f deleted"
            ]
        );
        assert!(residue.is_empty(), "{residue:?}");
        node.stop().await;
    });
}
