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
        Self::start_with(|config| config.limits.probe_timeout_secs = probe_timeout_secs).await
    }

    /// A node whose config `edit` changed first.
    async fn start_with(edit: impl FnOnce(&mut certistack_connector::config::Config)) -> Self {
        let lab = Lab::new("net");
        let authority_dir = TempDir::new("net-ctl");
        let authority = controller(&authority_dir.0);
        let mut config = lab.node_config(&authority, &lab.root.join("node"));
        edit(&mut config);
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

/// PrepareSandbox was refused (FAILED_PRECONDITION, its message naming every one of `needles`)
/// before it changed the node: no containment table, no probe address.
fn assert_refused_with_nothing_installed(
    status: &tonic::Status,
    topology: &Topology,
    needles: &[&str],
) {
    assert_eq!(
        status.code(),
        Code::FailedPrecondition,
        "{}",
        status.message()
    );
    for needle in needles {
        assert!(
            status.message().contains(needle),
            "{:?} lacks {needle:?}",
            status.message()
        );
    }
    assert!(
        !tables(topology).contains("certistack_"),
        "a table was installed"
    );
    assert!(
        !bridge_addresses(topology).contains("198.51.100.2"),
        "the probe address was added"
    );
}

/// Cleanup of a run that holds only its sandbox deletes the probe address, then the run's
/// table, and leaves nothing behind.
async fn assert_cleanup_releases_only_the_sandbox(
    client: &mut ConnectorClient<Channel>,
    run_id: &str,
) {
    let (receipts, residue) = cleanup_receipts(client, run_id).await;
    let table = format!("nft:certistack_{} deleted", run_id.replace('-', ""));
    assert_eq!(receipts, ["addr:csbox1 deleted", table.as_str()]);
    assert!(residue.is_empty(), "{residue:?}");
}

/// Runs `body` in the node namespace of `topology`; the topology stays up until `body` is
/// done and is torn down afterwards.
fn inside_node<F, Fut>(topology: Topology, body: F)
where
    F: FnOnce(std::sync::Arc<Topology>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let topology = std::sync::Arc::new(topology);
    let node_ns = topology.node.clone();
    let shared = topology.clone();
    inside(&node_ns, move || body(shared));
    drop(topology);
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
            assert_refused_with_nothing_installed(
                &status,
                &topology,
                &["VNet csbox1 is not isolated", reason],
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

#[test]
fn crash_after_prepare_sandbox_leaves_nothing_after_recovery() {
    if !privileged(
        "crash_after_prepare_sandbox_leaves_nothing_after_recovery",
        TOOLS,
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("crash"), |topology| async move {
        let lab = Lab::new("netcrash");
        let authority_dir = TempDir::new("netcrash-ctl");
        let authority = controller(&authority_dir.0);
        let config = lab.node_config(&authority, &lab.root.join("node"));
        let port = free_local_port();
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
            .list_runs(pb::ListRunsRequest::default())
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
}

/// Creates `name` stacked on `lower` in the node namespace: a VLAN where the kernel has 802.1Q,
/// else a macvtap (the check reads the lower device, which every stacked kind reports).
fn add_vlan_upper(topology: &Topology, lower: &str, name: &str) -> &'static str {
    let vlan = topology
        .in_ns(
            &topology.node,
            &[
                "ip", "link", "add", "link", lower, "name", name, "type", "vlan", "id", "50",
            ],
        )
        .output()
        .unwrap();
    if vlan.status.success() {
        return "vlan";
    }
    let reason = String::from_utf8_lossy(&vlan.stderr);
    assert!(
        reason.contains("Unknown device type"),
        "ip link add type vlan: {reason}"
    );
    eprintln!(
        "NOTE: this kernel has no 802.1Q (CONFIG_VLAN_8021Q); {name} is a macvtap on {lower} instead"
    );
    topology.node_sh(&[
        "ip", "link", "add", "link", lower, "name", name, "type", "macvtap",
    ]);
    "macvtap"
}

#[test]
fn links_stacked_on_the_vnet_are_refused_by_name() {
    if !privileged("links_stacked_on_the_vnet_are_refused_by_name", TOOLS) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("upper"), |topology| async move {
        let node = Node::start(3).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        let kind = add_vlan_upper(&topology, "csbox1", "csbox1.50");
        topology.node_sh(&["ip", "address", "add", "192.0.2.50/24", "dev", "csbox1.50"]);
        topology.node_sh(&["ip", "link", "set", "csbox1.50", "up"]);
        let stacked: [(&str, &[&str]); 2] = [
            ("csbox1.50", &[]),
            (
                "mvl0",
                &[
                    "ip", "link", "add", "link", "csbox1", "name", "mvl0", "type", "macvlan",
                    "mode", "bridge",
                ],
            ),
        ];
        for (name, make) in stacked {
            if !make.is_empty() {
                topology.node_sh(make);
            }
            let status = c.prepare_sandbox(prepare()).await.unwrap_err();
            let needle = format!("link {name} (on csbox1) is stacked on the VNet");
            assert!(
                status.message().contains(&needle),
                "{name} ({kind}): {:?} lacks {needle:?}",
                status.message()
            );
            assert_refused_with_nothing_installed(&status, &topology, &[]);
            topology.node_sh(&["ip", "link", "del", name]);
        }
        // Control: with both gone the same VNet passes.
        c.prepare_sandbox(prepare()).await.unwrap();
        let (_, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
        node.stop().await;
    });
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

#[test]
fn prepare_sandbox_fails_without_the_table_listing() {
    if !privileged("prepare_sandbox_fails_without_the_table_listing", TOOLS) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("list"), |topology| async move {
        let real_nft = String::from_utf8(sh(&["sh", "-c", "command -v nft"]).stdout).unwrap();
        let flag = topology.dir.0.join("fail-list");
        let wrapper = topology.dir.0.join("nft");
        // Fails `nft list table` of a table that exists while the flag file is there.
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\nif [ \"$1\" = list ] && [ \"$2\" = table ] && [ -e {flag} ] && {nft} list table \"$3\" \"$4\" >/dev/null 2>&1; then\n echo 'Error: cannot list (simulated)' >&2; exit 1\nfi\nexec {nft} \"$@\"\n",
                flag = flag.display(),
                nft = real_nft.trim()
            ),
        )
        .unwrap();
        sh(&["chmod", "755", wrapper.to_str().unwrap()]);
        std::fs::write(&flag, "").unwrap();

        let lab = Lab::new("netlist");
        let authority_dir = TempDir::new("netlist-ctl");
        let authority = controller(&authority_dir.0);
        let mut config = lab.node_config(&authority, &lab.root.join("node"));
        config.tools.nft = wrapper.clone();
        let (address, shutdown, task) = serve_node(config).await;
        let mut wire = grant(RUN_ID, NODE);
        wire.probe_targets = targets(true);
        let credentials = mint(&authority, &wire);
        let mut c = client(&authority, &address, NODE, &credentials.certificate)
            .await
            .unwrap();
        c.begin_run(begin_request(&credentials)).await.unwrap();

        let status = c.prepare_sandbox(prepare()).await.unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{}", status.message());
        assert!(
            status.message().contains(
                "nft list table inet certistack_0f0e1c2d3b4a4c5d8e6f7a8b9c0d1e2f failed, so the containment evidence cannot be produced: Error: cannot list (simulated)"
            ),
            "{}",
            status.message()
        );
        // The probe address was never added: the table comes first and the step failed there.
        assert!(
            !bridge_addresses(&topology).contains("198.51.100.2"),
            "{}",
            bridge_addresses(&topology)
        );
        let steps = journal_steps(&mut c, RUN_ID).await;
        assert!(
            !steps.iter().any(|s| s.starts_with("sandbox.address ")),
            "{steps:?}"
        );
        // The listing works again: Cleanup removes the table the failed step left.
        std::fs::remove_file(&flag).unwrap();
        let (receipts, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert_eq!(
            receipts,
            ["nft:certistack_0f0e1c2d3b4a4c5d8e6f7a8b9c0d1e2f deleted"]
        );
        assert!(residue.is_empty(), "{residue:?}");
        assert!(
            !tables(&topology).contains("certistack_"),
            "{}",
            tables(&topology)
        );
        let _ = shutdown.send(());
        task.await.unwrap();
    });
}

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

/// The VNet's forwarding sysctls in the node namespace: (IPv4, IPv6).
fn vnet_forwarding(topology: &Topology) -> (String, String) {
    let read = |name: &str| {
        String::from_utf8(topology.node_sh(&["sysctl", "-n", name]).stdout)
            .unwrap()
            .trim()
            .to_owned()
    };
    (
        read("net.ipv4.conf.csbox1.forwarding"),
        read("net.ipv6.conf.csbox1.forwarding"),
    )
}

fn forwarding_on(topology: &Topology) {
    topology.node_sh(&[
        "sysctl",
        "-w",
        "net.ipv4.conf.csbox1.forwarding=1",
        "net.ipv6.conf.csbox1.forwarding=1",
    ]);
}

fn disable_for_run(config: &mut certistack_connector::config::Config) {
    config.sandbox.forwarding = certistack_connector::config::ForwardingPolicy::DisableForRun;
}

const FORWARDING_SET_FOR_RUN: &str = "net.ipv4.conf.csbox1.forwarding = 0 (was 1; set to 0 for this run by sandbox.forwarding = \"disable-for-run\", restored when the sandbox is released)\nnet.ipv6.conf.csbox1.forwarding = 0 (was 1; set to 0 for this run by sandbox.forwarding = \"disable-for-run\", restored when the sandbox is released)";

#[test]
fn forwarding_on_the_vnet_is_refused_or_turned_off_for_the_run() {
    if !privileged(
        "forwarding_on_the_vnet_is_refused_or_turned_off_for_the_run",
        TOOLS,
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("fwd"), |topology| async move {
        // ifupdown2 leaves a bare VNet stanza forwarding.
        forwarding_on(&topology);

        // The default policy refuses the VNet and changes nothing.
        let node = Node::start(3).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        let status = c.prepare_sandbox(prepare()).await.unwrap_err();
        assert_refused_with_nothing_installed(
            &status,
            &topology,
            &[
                "IPv4 forwarding is on for csbox1",
                "IPv6 forwarding is on for csbox1",
                "or set sandbox.forwarding = \"disable-for-run\"",
            ],
        );
        assert_eq!(vnet_forwarding(&topology), ("1".into(), "1".into()));
        node.stop().await;

        // "disable-for-run": 0 while the run holds the sandbox, the old value after release.
        let node = Node::start_with(disable_for_run).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        let evidence = c.prepare_sandbox(prepare()).await.unwrap().into_inner();
        assert_eq!(evidence.forwarding_sysctl, FORWARDING_SET_FOR_RUN);
        assert_eq!(vnet_forwarding(&topology), ("0".into(), "0".into()));
        let steps = journal_steps(&mut c, RUN_ID).await;
        for step in [
            "sandbox.forwarding fwd:csbox1 intent",
            "sandbox.forwarding fwd:csbox1 done",
        ] {
            assert!(steps.contains(&step.to_owned()), "{step} not in {steps:?}");
        }
        // A guest booting now is checked against the 0 the run set.
        c.release_sandbox(pb::ReleaseSandboxRequest { vnet: VNET.into() })
            .await
            .unwrap();
        assert_eq!(vnet_forwarding(&topology), ("1".into(), "1".into()));
        let steps = journal_steps(&mut c, RUN_ID).await;
        assert!(
            steps.contains(&"sandbox.forwarding.restore fwd:csbox1 undone".to_owned()),
            "{steps:?}"
        );
        // Restored once: Cleanup finds nothing of the run's left to put back.
        let (receipts, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert!(receipts.is_empty(), "{receipts:?}");
        assert!(residue.is_empty(), "{residue:?}");
        assert_eq!(vnet_forwarding(&topology), ("1".into(), "1".into()));
        node.stop().await;

        // A value someone else changed after the run set 0 is theirs: Cleanup leaves it.
        let node = Node::start_with(disable_for_run).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        c.prepare_sandbox(prepare()).await.unwrap();
        topology.node_sh(&["sysctl", "-w", "net.ipv4.conf.csbox1.forwarding=1"]);
        topology.node_sh(&["sysctl", "-w", "net.ipv6.conf.csbox1.forwarding=1"]);
        topology.node_sh(&["sysctl", "-w", "net.ipv4.conf.csbox1.forwarding=0"]);
        let (receipts, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert_eq!(receipts[0], "fwd:csbox1 restored", "{receipts:?}");
        assert!(residue.is_empty(), "{residue:?}");
        // IPv4 was still the run's 0 and went back to 1; IPv6 was already 1 again.
        assert_eq!(vnet_forwarding(&topology), ("1".into(), "1".into()));
        node.stop().await;
    });
}

#[test]
fn crash_after_prepare_sandbox_restores_forwarding_after_recovery() {
    if !privileged(
        "crash_after_prepare_sandbox_restores_forwarding_after_recovery",
        TOOLS,
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("fwdcrash"), |topology| async move {
        forwarding_on(&topology);
        let lab = Lab::new("netfwdcrash");
        let authority_dir = TempDir::new("netfwdcrash-ctl");
        let authority = controller(&authority_dir.0);
        let mut config = lab.node_config(&authority, &lab.root.join("node"));
        disable_for_run(&mut config);
        let port = free_local_port();
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
        let evidence = c.prepare_sandbox(prepare()).await.unwrap().into_inner();
        assert_eq!(evidence.forwarding_sysctl, FORWARDING_SET_FOR_RUN);
        daemon.kill().unwrap(); // SIGKILL
        daemon.wait().unwrap();
        assert_eq!(vnet_forwarding(&topology), ("0".into(), "0".into()));

        let mut daemon = spawn();
        let mut op = client_when_up(&authority, &address, &operator).await;
        let runs = op
            .list_runs(pb::ListRunsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .runs;
        assert!(
            runs[0]
                .open_resources
                .iter()
                .any(|r| r.contains("fwd:csbox1")),
            "{:?}",
            runs[0].open_resources
        );
        let (receipts, residue) = cleanup_receipts(&mut op, RUN_ID).await;
        assert_eq!(
            receipts,
            [
                "fwd:csbox1 restored",
                "addr:csbox1 deleted",
                "nft:certistack_0f0e1c2d3b4a4c5d8e6f7a8b9c0d1e2f deleted"
            ]
        );
        assert!(residue.is_empty(), "{residue:?}");
        assert_eq!(vnet_forwarding(&topology), ("1".into(), "1".into()));
        // Idempotent: a second Cleanup restores nothing again.
        let (receipts, _) = cleanup_receipts(&mut op, RUN_ID).await;
        assert!(receipts.is_empty(), "{receipts:?}");
        daemon.kill().unwrap();
        daemon.wait().unwrap();
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
fn legacy_nat_rules_refuse_the_vnet_and_missing_tools_are_named() {
    if !privileged(
        "legacy_nat_rules_refuse_the_vnet_and_missing_tools_are_named",
        &[
            "ip",
            "nft",
            "python3",
            "iptables-legacy",
            "ip6tables-legacy",
        ],
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("legacy"), |topology| async move {
        let node = Node::start(3).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        // SDN's SNAT (by subnet, through iptables-legacy) and a masquerade out of the VNet.
        let rules: [(&str, &[&str]); 2] = [
            (
                "iptables-legacy",
                &[
                    "POSTROUTING",
                    "-s",
                    "198.51.100.0/24",
                    "-o",
                    "uplink0",
                    "-j",
                    "SNAT",
                    "--to-source",
                    "203.0.113.1",
                ],
            ),
            (
                "ip6tables-legacy",
                &["POSTROUTING", "-o", "csbox1", "-j", "MASQUERADE"],
            ),
        ];
        for (tool, rule) in rules {
            let mut add = vec![tool, "-t", "nat", "-A"];
            add.extend_from_slice(rule);
            topology.node_sh(&add);
            let status = c.prepare_sandbox(prepare()).await.unwrap_err();
            let named = format!(
                "a NAT rule references csbox1: -A {} (/usr/sbin/{tool}-save -t nat)",
                rule.join(" ")
            );
            assert_refused_with_nothing_installed(
                &status,
                &topology,
                &["VNet csbox1 is not isolated", &named],
            );
            // The same rule is invisible to nftables.
            let ruleset =
                String::from_utf8(topology.node_sh(&["nft", "list", "ruleset"]).stdout).unwrap();
            assert!(!ruleset.contains("csbox1") && !ruleset.contains("198.51.100.0/24"));
            add[3] = "-D";
            topology.node_sh(&add);
        }
        // Without them the VNet passes, and the evidence names every source read.
        let evidence = c.prepare_sandbox(prepare()).await.unwrap().into_inner();
        assert_eq!(evidence.nat_sources.len(), 3, "{:?}", evidence.nat_sources);
        assert!(evidence.nat_sources[0].starts_with("nft list ruleset: "));
        for (source, tool) in evidence.nat_sources[1..]
            .iter()
            .zip(["iptables", "ip6tables"])
        {
            assert!(
                source.starts_with(&format!("/usr/sbin/{tool}-legacy-save -t nat: "))
                    && source.ends_with(" bytes read"),
                "{source}"
            );
        }
        let (_, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
        node.stop().await;

        // Where the legacy tools are not installed, the check is skipped and says so.
        let node = Node::start_with(|config| {
            config.tools.iptables_legacy_save = "/nonexistent/iptables-legacy-save".into();
            config.tools.ip6tables_legacy_save = "/nonexistent/ip6tables-legacy-save".into();
        })
        .await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        let evidence = c.prepare_sandbox(prepare()).await.unwrap().into_inner();
        assert_eq!(
            evidence.nat_sources[1..],
            [
                "/nonexistent/iptables-legacy-save: not installed",
                "/nonexistent/ip6tables-legacy-save: not installed"
            ]
        );
        let (_, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
        node.stop().await;
    });
}

#[test]
fn rulesets_past_64_kib_are_read_up_to_the_configured_limit() {
    if !privileged(
        "rulesets_past_64_kib_are_read_up_to_the_configured_limit",
        TOOLS,
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("big"), |topology| async move {
        // A busy node: a table of its own with 3,000 rules in a chain no hook reaches.
        let mut script =
            String::from("add table inet bulk_test\nadd chain inet bulk_test filler\n");
        for n in 0..3000 {
            script.push_str(&format!(
                "add rule inet bulk_test filler ip saddr 10.{}.{}.1 tcp dport {} counter accept\n",
                n / 256,
                n % 256,
                1000 + n
            ));
        }
        let file = topology.dir.0.join("bulk.nft");
        std::fs::write(&file, script).unwrap();
        topology.node_sh(&["nft", "-f", file.to_str().unwrap()]);
        let size = topology.node_sh(&["nft", "list", "ruleset"]).stdout.len();
        assert!(size > 64 * 1024, "{size}");

        let node = Node::start(3).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        let started = std::time::Instant::now();
        let evidence = c.prepare_sandbox(prepare()).await.unwrap().into_inner();
        eprintln!(
            "PrepareSandbox with a {size}-byte ruleset: {} ms; {:?}",
            started.elapsed().as_millis(),
            evidence.nat_sources
        );
        let (_, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
        node.stop().await;

        // Past the configured limit the check cannot be completed: refused, saying why.
        let node = Node::start_with(|config| config.limits.max_ruleset_bytes = 64 * 1024).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        let status = c.prepare_sandbox(prepare()).await.unwrap_err();
        assert_refused_with_nothing_installed(
            &status,
            &topology,
            &[
                "the node's nftables ruleset is larger than the connector reads (65536 bytes, limits.max_ruleset_bytes), so the NAT check cannot be completed",
            ],
        );
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

/// `certistack-ctl doctor --vnet csbox1` on a node namespace with a real bridge, real
/// iptables-legacy and nftables, and the node's files as fixtures: warnings for what the next
/// `ifreload -a`, the LVM filter and the firewall will do (exit 0), failures for forwarding on
/// and a legacy NAT rule on the VNet (exit 1), and every new check ok once the node is fixed.
#[test]
fn doctor_judges_a_vnet_its_legacy_nat_the_lvm_filter_and_the_firewall() {
    if !privileged(
        "doctor_judges_a_vnet_its_legacy_nat_the_lvm_filter_and_the_firewall",
        &["ip", "nft", "iptables-legacy", "sysctl"],
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("doctor"), |topology| async move {
        let files = topology.dir.0.join("node-files");
        let sdn = files.join("interfaces.d/sdn");
        let lvm_conf = files.join("lvm.conf");
        let host_fw = files.join("nodes").join(NODE).join("host.fw");
        std::fs::create_dir_all(sdn.parent().unwrap()).unwrap();
        std::fs::create_dir_all(host_fw.parent().unwrap()).unwrap();
        // As SDN writes a Simple zone's VNet, and as PVE installs lvm.conf's filter.
        std::fs::write(
            &sdn,
            "#version:3\n\nauto csbox1\niface csbox1\n\tbridge_ports none\n\tbridge_stp off\n\tbridge_fd 0\n",
        )
        .unwrap();
        std::fs::write(
            &lvm_conf,
            "devices {\n\t# global_filter = [ \"r|/dev/loop.*|\" ]\n}\ndevices {\n\tglobal_filter=[\"r|/dev/zd.*|\",\"r|/dev/rbd.*|\",\"r|/dev/nbd.*|\"]\n}\n",
        )
        .unwrap();
        std::fs::write(&host_fw, "[OPTIONS]\n\nnftables: 1\n").unwrap();
        let node = Node::start_with(|config| {
            config.pve.sdn_interfaces = sdn.clone();
            config.pve.lvm_conf = lvm_conf.clone();
            config.pve.nodes_dir = files.join("nodes");
        })
        .await;
        let (host, port) = node.address.rsplit_once(':').unwrap();
        let controller_config = topology.dir.0.join("controller.toml");
        std::fs::write(
            &controller_config,
            format!(
                "state_dir = {:?}\nreports_dir = {:?}\n[[nodes]]\nname = \"{NODE}\"\naddress = {host:?}\nport = {port}\n",
                node.authority.dir(),
                topology.dir.0.join("reports")
            ),
        )
        .unwrap();
        // The server runs on this thread's runtime: the CLI is awaited, never waited for.
        let ctl = binary("certistack-ctl");
        let doctor_with = |args: &[&str]| {
            let mut command = tokio::process::Command::new("ip");
            command
                .args(["netns", "exec", &topology.node])
                .arg(&ctl)
                .arg("doctor")
                .args(args)
                .args(["--config", controller_config.to_str().unwrap()]);
            async move {
                let out = command.output().await.unwrap();
                (
                    out.status.code().unwrap(),
                    String::from_utf8(out.stdout).unwrap(),
                )
            }
        };
        let doctor = || doctor_with(&[NODE, "--vnet", VNET]);
        let line = |out: &str, check: &str| -> String {
            out.lines()
                .find(|l| l.starts_with(&format!("{NODE} {check} ")))
                .unwrap_or_else(|| panic!("no {check} line in {out}"))
                .to_owned()
        };

        // Forwarding is off now, but the bare stanza turns it on at the next reload; the
        // loop devices pass PVE's filter; host.fw selects proxmox-firewall, but without
        // cluster.fw the datacenter firewall is off, so no tables is right. Warnings only: exit 0.
        let (code, out) = doctor().await;
        assert_eq!(code, 0, "{out}");
        assert!(
            line(&out, "vnet-forwarding").starts_with("pve1 vnet-forwarding warn ")
                && line(&out, "vnet-forwarding").ends_with(
                    "ifupdown2 sets forwarding=1 on reload; set sandbox.forwarding = \"disable-for-run\""
                ),
            "{out}"
        );
        assert!(
            line(&out, "lvm-filter").starts_with("pve1 lvm-filter warn ")
                && line(&out, "lvm-filter").ends_with(
                    "global_filter = [ \"r|/dev/zd.*|\", \"r|/dev/rbd.*|\", \"r|/dev/nbd.*|\", \"r|/dev/loop.*|\" ]"
                ),
            "{out}"
        );
        assert!(
            line(&out, "firewall").starts_with("pve1 firewall ok ")
                && line(&out, "firewall").contains("the datacenter firewall is off"),
            "{out}"
        );
        assert!(
            line(&out, "legacy-nat").starts_with("pve1 legacy-nat ok "),
            "{out}"
        );
        assert!(
            line(&out, "cgroup").starts_with("pve1 cgroup ok cgroup v2"),
            "{out}"
        );
        assert_eq!(
            line(&out, "qemu"),
            "pve1 qemu ok pve-qemu-kvm 10.0.2-4",
            "{out}"
        );

        // Forwarding on now, and SNAT on the VNet's subnet as SDN's Simple zone writes it: a
        // post-up line in the VNet's stanza, and a rule in iptables-legacy (where nftables does
        // not show it) that names the subnet and the uplink, never the VNet. Both fail, the
        // line and the rule are named. With the datacenter firewall on, proxmox-firewall's
        // missing tables are a warning. Exit 1.
        let snat_line = "iptables -t nat -A POSTROUTING -s '10.77.3.0/24' -o csup0 -j SNAT --to-source 192.0.2.10";
        std::fs::write(
            &sdn,
            format!(
                "#version:4\n\nauto csbox1\niface csbox1\n\taddress 10.77.3.1/24\n\tpost-up {snat_line}\n\tpost-down iptables -t nat -D POSTROUTING -s '10.77.3.0/24' -o csup0 -j SNAT --to-source 192.0.2.10\n\tpost-up iptables -t raw -I PREROUTING -i fwbr+ -j CT --zone 1\n\tpost-down iptables -t raw -D PREROUTING -i fwbr+ -j CT --zone 1\n\tbridge_ports none\n\tbridge_stp off\n\tbridge_fd 0\n"
            ),
        )
        .unwrap();
        let cluster_fw = files.join("firewall").join("cluster.fw");
        std::fs::create_dir_all(cluster_fw.parent().unwrap()).unwrap();
        std::fs::write(&cluster_fw, "[OPTIONS]\n\nenable: 1\n").unwrap();
        let snat = [
            "POSTROUTING",
            "-s",
            "10.77.3.0/24",
            "-o",
            "csup0",
            "-j",
            "SNAT",
            "--to-source",
            "192.0.2.10",
        ];
        let rule = |op: &'static str| {
            let mut args = vec!["iptables-legacy", "-t", "nat", op];
            args.extend_from_slice(&snat);
            args
        };
        topology.node_sh(&rule("-A"));
        topology.node_sh(&["sysctl", "-qw", "net.ipv4.conf.csbox1.forwarding=1"]);
        let (code, out) = doctor().await;
        topology.node_sh(&rule("-D"));
        topology.node_sh(&["sysctl", "-qw", "net.ipv4.conf.csbox1.forwarding=0"]);
        assert_eq!(code, 1, "{out}");
        assert_eq!(
            line(&out, "legacy-nat"),
            format!(
                "pve1 legacy-nat fail SDN SNAT is configured on this VNet's subnet ({snat_line}), loaded in iptables-legacy as -A POSTROUTING -s 10.77.3.0/24 -o csup0 -j SNAT --to-source 192.0.2.10 (/usr/sbin/iptables-legacy-save -t nat): remove `snat` from the subnet in Datacenter → SDN → VNets, then apply SDN"
            ),
            "{out}"
        );
        assert!(
            line(&out, "firewall").starts_with("pve1 firewall warn ")
                && line(&out, "firewall").contains("proxmox-firewall.service"),
            "{out}"
        );
        assert!(
            line(&out, "vnet-forwarding")
                .starts_with("pve1 vnet-forwarding fail net.ipv4.conf.csbox1.forwarding = 1 now"),
            "{out}"
        );

        // The node fixed: no SNAT, a stanza that keeps forwarding off (a method other than
        // dhcp or auto, no address), loop devices rejected, and proxmox-firewall's tables
        // loaded as cluster.fw and host.fw ask.
        std::fs::write(
            &sdn,
            "auto csbox1\niface csbox1 inet manual\n\tbridge_ports none\n\tbridge_stp off\n\tbridge_fd 0\n",
        )
        .unwrap();
        std::fs::write(
            &lvm_conf,
            "devices {\n\tglobal_filter=[\"r|/dev/zd.*|\",\"r|/dev/rbd.*|\",\"r|/dev/nbd.*|\",\"r|/dev/loop.*|\"]\n}\n",
        )
        .unwrap();
        topology.node_sh(&["nft", "add", "table", "inet", "proxmox-firewall"]);
        topology.node_sh(&["nft", "add", "table", "bridge", "proxmox-firewall-guests"]);
        let (code, out) = doctor().await;
        assert_eq!(code, 0, "{out}");
        for check in ["vnet-forwarding", "legacy-nat", "lvm-filter", "firewall"] {
            assert!(
                line(&out, check).starts_with(&format!("pve1 {check} ok ")),
                "{out}"
            );
        }
        assert!(
            line(&out, "firewall").contains("proxmox-firewall (nftables)")
                && line(&out, "firewall").contains("DROP policy"),
            "{out}"
        );
        assert!(
            line(&out, "legacy-nat").contains("0 legacy NAT rule(s), none touches csbox1"),
            "{out}"
        );

        // With a plan instead of --vnet, each node is checked with its validation's VNet.
        let secret = topology.dir.0.join("pbs-password");
        std::fs::write(&secret, "secret\n").unwrap();
        std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let plan = topology.dir.0.join("plan.yaml");
        std::fs::write(
            &plan,
            format!(
                "storage:\n  server: pbs.lab\n  datastore: store1\n  auth_id: certistack@pbs!restore\n  fingerprint: \"{}\"\n  pbs_password_file: pbs-password\nvalidations:\n  - name: web1\n    node: {NODE}\n    source_vmid: 100\n    snapshot: \"2026-11-01T02:00:00Z\"\n    archives: [{ARCHIVE}]\n    sandbox:\n      - vmid: 9101\n        cores: 1\n        memory_mib: 256\n    network:\n      lifecycle: preprovisioned\n      vnet: {VNET}\n      probe_source: {PROBE_SOURCE}\n    timeouts:\n      run_seconds: 600\n      guest_agent_seconds: 60\n    network_recovery:\n      mode: preserve\n",
                ["ab"; 32].join(":")
            ),
        )
        .unwrap();
        let (code, out) = doctor_with(&["--plan", plan.to_str().unwrap()]).await;
        assert_eq!(code, 0, "{out}");
        assert_eq!(
            line(&out, "vnet-forwarding"),
            "pve1 vnet-forwarding ok forwarding is off on csbox1 and its stanza keeps it off (iface csbox1 inet manual without an address)",
            "{out}"
        );
        node.stop().await;
    });
}
