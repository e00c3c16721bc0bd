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

#[path = "network/doctor_vnet.rs"]
mod doctor_vnet;
#[path = "network/forwarding.rs"]
mod forwarding;
#[path = "network/hostile_guest.rs"]
mod hostile_guest;
#[path = "network/isolation.rs"]
mod isolation;
#[path = "network/probes.rs"]
mod probes;
#[path = "network/recovery.rs"]
mod recovery;

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
        let (authority_dir, authority, mut config) = lab.controller_and_node_config("net-ctl");
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
        begun_run(&self.authority, &self.address, &wire).await
    }

    async fn stop(mut self) {
        stop_served(self.shutdown.take(), self.task.take()).await;
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
