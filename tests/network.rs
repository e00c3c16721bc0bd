//! The sandbox network for real, in network namespaces these tests create.
//!
//! Topology (every address is inside namespaces made here):
//!
//! ```text
//!  node ns (connector, client)                          guest ns ("the VM")
//!   csbox1 bridge ── tap9100i0  <── veth ──>  eth0 198.51.100.10/24 (tcp, http, https, dns, ldap)
//!   uplink0 203.0.113.1/24      <── veth ──>  eth0 203.0.113.5/24   other ns ("a second network")
//! ```
//!
//! The whole test body runs on a thread moved into the node namespace, so the in-process
//! connector, its `ip`/`nft` children, its probe sockets and the gRPC client all live there.
//! Needs root; elsewhere each test skips with its reason (a failure under
//! `CERTISTACK_REQUIRE_PRIVILEGED_TESTS=1`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_client::ConnectorClient;
use certistack_tests::*;
use std::process::{Child, Command, Stdio};
use tonic::Code;
use tonic::transport::Channel;

const GUEST: &str = "198.51.100.10";
const TOOLS: &[&str] = &["ip", "nft", "python3", "dnsmasq", "slapd"];

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn sh(args: &[&str]) -> std::process::Output {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The namespaces, links and servers of one test; removed on drop.
struct Topology {
    node: String,
    guest: String,
    other: String,
    servers: Vec<Child>,
    dir: TempDir,
}

impl Topology {
    fn new(tag: &str) -> Self {
        let id = &uuid::Uuid::new_v4().simple().to_string()[..6];
        let (node, guest, other) = (
            format!("csn{tag}{id}"),
            format!("csg{tag}{id}"),
            format!("cso{tag}{id}"),
        );
        for ns in [&node, &guest, &other] {
            sh(&["ip", "netns", "add", ns]);
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        let topology = Self {
            node,
            guest,
            other,
            servers: Vec::new(),
            dir: TempDir::new(&format!("net-{tag}")),
        };
        let (n, g, o) = (
            topology.node.as_str(),
            topology.guest.as_str(),
            topology.other.as_str(),
        );
        sh(&["ip", "-n", n, "link", "add", "csbox1", "type", "bridge"]);
        sh(&["ip", "-n", n, "link", "set", "csbox1", "up"]);
        sh(&[
            "ip",
            "-n",
            n,
            "link",
            "add",
            "tap9100i0",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            g,
        ]);
        sh(&[
            "ip",
            "-n",
            n,
            "link",
            "set",
            "tap9100i0",
            "master",
            "csbox1",
            "up",
        ]);
        sh(&[
            "ip",
            "-n",
            g,
            "address",
            "add",
            "198.51.100.10/24",
            "dev",
            "eth0",
        ]);
        sh(&["ip", "-n", g, "link", "set", "eth0", "up"]);
        // The guest would route everything through the node if the node let it.
        sh(&[
            "ip",
            "-n",
            g,
            "route",
            "add",
            "default",
            "via",
            "198.51.100.2",
        ]);
        sh(&[
            "ip", "-n", n, "link", "add", "uplink0", "type", "veth", "peer", "name", "eth0",
            "netns", o,
        ]);
        sh(&[
            "ip",
            "-n",
            n,
            "address",
            "add",
            "203.0.113.1/24",
            "dev",
            "uplink0",
        ]);
        sh(&["ip", "-n", n, "link", "set", "uplink0", "up"]);
        sh(&[
            "ip",
            "-n",
            o,
            "address",
            "add",
            "203.0.113.5/24",
            "dev",
            "eth0",
        ]);
        sh(&["ip", "-n", o, "link", "set", "eth0", "up"]);
        sh(&[
            "ip",
            "-n",
            o,
            "route",
            "add",
            "default",
            "via",
            "203.0.113.1",
        ]);
        topology
    }

    fn in_ns(&self, ns: &str, args: &[&str]) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", ns]).args(args);
        command
    }

    fn serve(&mut self, ns: &str, args: &[&str]) {
        let child = self
            .in_ns(ns, args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.servers.push(child);
    }

    /// A TCP connection attempt from the guest, with a short bound: true when it connected.
    fn guest_connects(&self, address: &str, port: u16) -> bool {
        let script = format!(
            "import socket,sys\ns=socket.socket();s.settimeout(1.5)\ntry:\n s.connect(('{address}',{port}));sys.exit(0)\nexcept Exception:\n sys.exit(1)"
        );
        self.in_ns(&self.guest, &["python3", "-c", &script])
            .status()
            .unwrap()
            .success()
    }

    fn node_sh(&self, args: &[&str]) -> std::process::Output {
        let out = self.in_ns(&self.node, args).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// Starts the guest's services: an SSH-like banner, HTTP, HTTPS (self-signed), DNS, LDAP.
    fn start_guest_services(&mut self) -> String {
        let dir = self.dir.0.clone();
        std::fs::write(dir.join("index.html"), "restored ok\n").unwrap();
        let banner = "import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind(('198.51.100.10',22));s.listen()\nwhile True:\n c,_=s.accept();c.sendall(b'SSH-2.0-CertiStackTest\\r\\n');c.close()";
        let guest = self.guest.clone();
        self.serve(&guest, &["python3", "-c", banner]);
        self.serve(
            &guest,
            &[
                "python3",
                "-m",
                "http.server",
                "80",
                "--bind",
                GUEST,
                "--directory",
                dir.to_str().unwrap(),
            ],
        );

        let cert = rcgen::generate_simple_self_signed(vec![GUEST.to_owned()]).unwrap();
        std::fs::write(dir.join("tls.crt"), cert.cert.pem()).unwrap();
        std::fs::write(dir.join("tls.key"), cert.signing_key.serialize_pem()).unwrap();
        let fingerprint = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(cert.cert.der()));
        let https = format!(
            "import http.server,ssl,functools\nh=functools.partial(http.server.SimpleHTTPRequestHandler,directory='{d}')\ns=http.server.HTTPServer(('198.51.100.10',443),h)\nc=ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER);c.load_cert_chain('{d}/tls.crt','{d}/tls.key')\ns.socket=c.wrap_socket(s.socket,server_side=True)\ns.serve_forever()",
            d = dir.display()
        );
        self.serve(&guest, &["python3", "-c", &https]);
        self.serve(
            &guest,
            &[
                "dnsmasq",
                "--no-daemon",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
                "--listen-address=198.51.100.10",
                "--port=53",
                "--host-record=www.example.test,198.51.100.10",
                "--user=root",
                &format!("--pid-file={}/dnsmasq.pid", dir.display()),
            ],
        );
        std::fs::create_dir_all(dir.join("ldap")).unwrap();
        let slapd_conf = format!(
            "include /etc/ldap/schema/core.schema\nmodulepath /usr/lib/ldap\nmoduleload back_mdb\npidfile {d}/slapd.pid\n\
             database mdb\nsuffix \"dc=example,dc=test\"\nrootdn \"cn=admin,dc=example,dc=test\"\ndirectory {d}/ldap\nmaxsize 10485760\n",
            d = dir.display()
        );
        std::fs::write(dir.join("slapd.conf"), slapd_conf).unwrap();
        self.serve(
            &guest,
            &[
                "slapd",
                "-d",
                "0",
                "-h",
                "ldap://198.51.100.10:389/",
                "-f",
                dir.join("slapd.conf").to_str().unwrap(),
            ],
        );
        // Wait until every service answers from the guest itself.
        for port in [22, 80, 443, 389] {
            let ready = (0..100).any(|_| {
                let script = format!("import socket\ns=socket.socket();s.settimeout(0.2)\ns.connect(('{GUEST}',{port}))");
                let ok = self.in_ns(&self.guest, &["python3", "-c", &script]).stderr(Stdio::null()).status().unwrap().success();
                if !ok {
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
                ok
            });
            assert!(ready, "guest service on port {port} did not come up");
        }
        fingerprint
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for child in &mut self.servers {
            let _ = child.kill();
            let _ = child.wait();
        }
        // slapd and dnsmasq may fork; their pid files name the survivors.
        for pid_file in ["dnsmasq.pid", "slapd.pid"] {
            if let Ok(pid) = std::fs::read_to_string(self.dir.0.join(pid_file)) {
                let _ = Command::new("kill")
                    .arg(pid.trim())
                    .stderr(Stdio::null())
                    .status();
            }
        }
        for ns in [&self.node, &self.guest, &self.other] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn targets(pass: bool) -> Vec<pb::ProbeTarget> {
    let target = |kind: pb::ProbeKind, address: &str, port: u32, expect: pb::ProbeExpectation| {
        pb::ProbeTarget {
            kind: kind as i32,
            address: address.into(),
            port,
            expect: Some(expect),
        }
    };
    let text = |ok: &str, bad: &str| if pass { ok.to_owned() } else { bad.to_owned() };
    let mut targets = vec![
        target(
            pb::ProbeKind::Tcp,
            GUEST,
            22,
            pb::ProbeExpectation {
                banner_prefix: text("SSH-2.0-", "SMTP"),
                ..Default::default()
            },
        ),
        target(
            pb::ProbeKind::Http,
            GUEST,
            80,
            pb::ProbeExpectation {
                http_path: "/".into(),
                http_status: 200,
                body_contains: text("restored ok", "welcome"),
                // SHA-256 of the served page, "restored ok\n".
                body_sha256: text(
                    "6cf0a0560dae9680b204d7ac4d8f132ddedb50ce9eda26801fac2176f0ff4e5a",
                    "",
                ),
                ..Default::default()
            },
        ),
        target(
            pb::ProbeKind::Https,
            GUEST,
            443,
            pb::ProbeExpectation {
                http_path: if pass { "/".into() } else { "/missing".into() },
                http_status: 200,
                ..Default::default()
            },
        ),
        target(
            pb::ProbeKind::Dns,
            GUEST,
            53,
            pb::ProbeExpectation {
                dns_name: "www.example.test".into(),
                dns_type: pb::DnsRecordType::A as i32,
                dns_answers: vec![text("198.51.100.10", "192.0.2.99")],
                ..Default::default()
            },
        ),
        target(
            pb::ProbeKind::Ldap,
            GUEST,
            389,
            pb::ProbeExpectation {
                ldap_naming_context: text("dc=example,dc=test", "dc=other,dc=test"),
                ..Default::default()
            },
        ),
    ];
    if !pass {
        // Nobody at this address: the probe must end within its bound, as a failed result.
        targets.push(target(
            pb::ProbeKind::Tcp,
            "198.51.100.11",
            22,
            pb::ProbeExpectation::default(),
        ));
        // A port the guest refuses.
        targets.push(target(
            pb::ProbeKind::Tcp,
            GUEST,
            2222,
            pb::ProbeExpectation::default(),
        ));
    }
    targets
}

struct Node {
    authority: certistack_controller::authority::Authority,
    address: String,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    _lab: Lab,
    _authority_dir: TempDir,
}

impl Node {
    async fn start(probe_timeout_secs: u64) -> Self {
        let lab = Lab::new("net");
        let authority_dir = TempDir::new("net-ctl");
        let authority = controller(&authority_dir.0);
        let mut config = lab.node_config(&authority, &lab.root.join("node"));
        config.limits.probe_timeout_secs = probe_timeout_secs;
        let (address, shutdown, task) = serve_node(config).await;
        Self {
            authority,
            address,
            shutdown: Some(shutdown),
            task: Some(task),
            _lab: lab,
            _authority_dir: authority_dir,
        }
    }

    async fn run(&self, run_id: &str, targets: Vec<pb::ProbeTarget>) -> ConnectorClient<Channel> {
        let mut wire = grant(run_id, NODE);
        wire.probe_targets = targets;
        let credentials = mint(&self.authority, &wire);
        let mut c = client(
            &self.authority,
            &self.address,
            NODE,
            &credentials.certificate,
        )
        .await
        .unwrap();
        c.begin_run(begin_request(&credentials)).await.unwrap();
        c
    }

    async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap();
        }
    }
}

fn prepare() -> pb::PrepareSandboxRequest {
    pb::PrepareSandboxRequest {
        vnet: VNET.into(),
        probe_source: PROBE_SOURCE.into(),
    }
}

fn tables(ns_node: &Topology) -> String {
    String::from_utf8(ns_node.node_sh(&["nft", "list", "tables"]).stdout).unwrap()
}

fn bridge_addresses(topology: &Topology) -> String {
    String::from_utf8(
        topology
            .node_sh(&["ip", "-brief", "address", "show", "dev", "csbox1"])
            .stdout,
    )
    .unwrap()
}

#[test]
fn isolation_refusals_name_each_property_and_install_nothing() {
    if !privileged(
        "isolation_refusals_name_each_property_and_install_nothing",
        TOOLS,
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let topology = Topology::new("iso");
    let node_ns = topology.node.clone();
    let t = std::sync::Arc::new(topology);
    let topology = t.clone();
    inside(&node_ns, move || async move {
        let node = Node::start(3).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        type Breach = (
            &'static [&'static str],
            &'static [&'static str],
            &'static str,
        );
        let breaches: [Breach; 4] = [
            (
                &[
                    "sh",
                    "-c",
                    "ip link add eno9 type veth peer name eno9p && ip link set eno9 master csbox1 up",
                ],
                &["ip", "link", "del", "eno9"],
                "port eno9 is not a tap of this run's sandbox VMs",
            ),
            (
                &["sysctl", "-w", "net.ipv4.conf.csbox1.forwarding=1"],
                &["sysctl", "-w", "net.ipv4.conf.csbox1.forwarding=0"],
                "IPv4 forwarding is on for csbox1",
            ),
            (
                &["ip", "address", "add", "198.51.100.1/24", "dev", "csbox1"],
                &["ip", "address", "del", "198.51.100.1/24", "dev", "csbox1"],
                "csbox1 carries address 198.51.100.1/24 (a gateway)",
            ),
            (
                &[
                    "nft",
                    "add table ip snat_test; add chain ip snat_test post { type nat hook postrouting priority 100; }; add rule ip snat_test post ip saddr 198.51.100.0/24 oifname \"uplink0\" masquerade",
                ],
                &["nft", "delete table ip snat_test"],
                "a NAT rule references csbox1",
            ),
        ];
        for (make, undo, reason) in breaches {
            topology.node_sh(make);
            let status = c.prepare_sandbox(prepare()).await.unwrap_err();
            assert_eq!(
                status.code(),
                Code::FailedPrecondition,
                "{}",
                status.message()
            );
            assert!(
                status.message().contains("VNet csbox1 is not isolated"),
                "{}",
                status.message()
            );
            assert!(
                status.message().contains(reason),
                "{:?} lacks {reason:?}",
                status.message()
            );
            assert!(
                !tables(&topology).contains("certistack_"),
                "a table was installed"
            );
            assert!(
                !bridge_addresses(&topology).contains("198.51.100.2"),
                "the probe address was added"
            );
            topology.node_sh(undo);
        }
        // The bridge missing altogether.
        let mut other = pb::PrepareSandboxRequest {
            vnet: VNET.into(),
            probe_source: PROBE_SOURCE.into(),
        };
        other.vnet = VNET.into();
        topology.node_sh(&["ip", "link", "set", "csbox1", "name", "csboxz"]);
        let status = c.prepare_sandbox(other).await.unwrap_err();
        assert!(
            status.message().contains("bridge csbox1 does not exist"),
            "{}",
            status.message()
        );
        topology.node_sh(&["ip", "link", "set", "csboxz", "name", "csbox1"]);
        let reply = c
            .cleanup(pb::CleanupRequest {
                run_id: RUN_ID.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(
            reply.resources.is_empty(),
            "nothing was done, so nothing is undone: {reply:?}"
        );
        node.stop().await;
    });
    drop(t);
}

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
            "net.ipv4.conf.csbox1.forwarding = 0"
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
        let (receipts, residue) = cleanup_receipts(&mut c, second).await;
        assert_eq!(
            receipts,
            [
                "nft:certistack_11111111222243338444555555555555 deleted",
                "addr:csbox1 deleted"
            ]
        );
        assert!(residue.is_empty(), "{residue:?}");
        node.stop().await;
    });
    drop(topology);
}

#[test]
fn crash_after_prepare_sandbox_leaves_nothing_after_recovery() {
    if !privileged(
        "crash_after_prepare_sandbox_leaves_nothing_after_recovery",
        TOOLS,
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let topology = std::sync::Arc::new(Topology::new("crash"));
    let t = topology.clone();
    let node_ns = topology.node.clone();
    inside(&node_ns, move || async move {
        let topology = t;
        let lab = Lab::new("netcrash");
        let authority_dir = TempDir::new("netcrash-ctl");
        let authority = controller(&authority_dir.0);
        let config = lab.node_config(&authority, &lab.root.join("node"));
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config_path = lab.root.join("node/connector.toml");
        write_config_file(&config_path, &config, port);
        let address = format!("127.0.0.1:{port}");
        let spawn = || {
            Command::new(binary("certistack-connector"))
                .args(["--config", config_path.to_str().unwrap()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        };
        let mut wire = grant(RUN_ID, NODE);
        wire.probe_targets = targets(true);
        let credentials = mint(&authority, &wire);
        let operator = authority.issue_operator("recovery", now()).unwrap();

        let mut daemon = spawn();
        let mut c = client_when_up(&authority, &address, &credentials.certificate).await;
        c.begin_run(begin_request(&credentials)).await.unwrap();
        c.prepare_sandbox(prepare()).await.unwrap();
        daemon.kill().unwrap(); // SIGKILL
        daemon.wait().unwrap();
        assert!(tables(&topology).contains("certistack_0f0e1c2d3b4a4c5d8e6f7a8b9c0d1e2f"));
        assert!(bridge_addresses(&topology).contains("198.51.100.2"));

        let mut daemon = spawn();
        let mut op = client_when_up(&authority, &address, &operator).await;
        let runs = op
            .list_runs(pb::ListRunsRequest {})
            .await
            .unwrap()
            .into_inner()
            .runs;
        assert_eq!(
            runs[0].open_resources.len(),
            2,
            "{:?}",
            runs[0].open_resources
        );
        let reply = op
            .cleanup(pb::CleanupRequest {
                run_id: RUN_ID.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(reply.residue.is_empty(), "{:?}", reply.residue);
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
        daemon.kill().unwrap();
        daemon.wait().unwrap();
    });
    drop(topology);
}
