//! A connector node enrolled through the real enrollment code and served in-process on loopback,
//! the clients that reach it, and a clock the test moves.

use crate::{RecordingExecutor, TempDir, controller, now};
use certistack_connector::clock::{Clock, SystemClock};
use certistack_connector::config::{Config, Limits, PvePaths, StatePaths, TlsFiles, ToolPaths};
use certistack_connector::server::Connector;
use certistack_controller::authority::{self, Authority, IssuedCertificate};
use certistack_proto::v1::connector_client::ConnectorClient;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tonic::transport::Channel;

pub const NODE: &str = "pve1";
/// A connector node: enrolled through the real enrollment code, served in-process.
pub struct TestNode {
    pub dir: PathBuf,
    pub config: Config,
    pub address: String,
    pub executor: Arc<RecordingExecutor>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Files as a Proxmox VE 9 node has them, for the NodeChecks a node config reads.
pub const PVE9_FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/support/pve9");

pub fn node_config(dir: &Path, node: &str) -> Config {
    Config {
        node_name: node.into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        tls: TlsFiles {
            certificate: dir.join("node.crt"),
            private_key: dir.join("node.key"),
            controller_ca: dir.join("ca.crt"),
            run_authority_public_key: dir.join("run-authority.pub"),
        },
        paths: StatePaths {
            state_dir: dir.join("state"),
            overlay_root: dir.join("overlays"),
        },
        tools: ToolPaths::default(),
        pve: PvePaths {
            // A PVE 9 node's mount table and LVM filter, not this machine's.
            mounts: Path::new(PVE9_FIXTURES).join("mounts"),
            lvm_conf: Path::new(PVE9_FIXTURES).join("lvm.conf"),
            // A bare-metal node with VT-x: what KVM gives guests is the simulated node's, not
            // this machine's (which may be nested). Its KVM device is anything that opens
            // read-write, as QEMU opens /dev/kvm.
            cpuinfo: Path::new(PVE9_FIXTURES).join("cpuinfo"),
            dmi_dir: Path::new(PVE9_FIXTURES).join("dmi"),
            kvm_device: "/dev/null".into(),
            ..PvePaths::default()
        },
        limits: Limits::default(),
        sandbox: Default::default(),
        process: Default::default(),
        guest_network: Default::default(),
    }
}

/// Enrolls a node: key and CSR on the node, certificate from the controller, installed.
pub fn enroll(authority: &Authority, dir: &Path, node: &str) -> Config {
    std::fs::create_dir_all(dir).unwrap();
    let config = node_config(dir, node);
    let csr = certistack_connector::enroll::certificate_request(&config).unwrap();
    let cert = authority.sign_node_csr(&csr, node, now()).unwrap();
    let cert_file = dir.join("issued.crt");
    std::fs::write(&cert_file, cert).unwrap();
    certistack_connector::enroll::install(
        &config,
        &cert_file,
        &authority.dir().join(authority::CA_CERT),
        &authority.ca_fingerprint().unwrap().parse().unwrap(),
        &authority.dir().join(authority::RUN_AUTHORITY_PUB),
    )
    .unwrap();
    config
}

impl TestNode {
    pub async fn start(authority: &Authority, dir: &Path, node: &str) -> Self {
        let config = enroll(authority, dir, node);
        Self::serve(
            dir.to_owned(),
            config,
            Arc::new(RecordingExecutor::default()),
            Arc::new(SystemClock),
        )
        .await
    }

    pub async fn serve(
        dir: PathBuf,
        config: Config,
        executor: Arc<RecordingExecutor>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let connector = Connector::new(config.clone(), executor.clone(), clock).unwrap();
        let listener = connector.bind().await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            connector
                .serve(listener, async {
                    let _ = rx.await;
                })
                .await
                .unwrap();
        });
        Self {
            dir,
            config,
            address,
            executor,
            shutdown: Some(tx),
            task: Some(task),
        }
    }

    /// Stops the daemon and starts a new one on the same state directory (a restart).
    pub async fn restart(mut self) -> Self {
        self.stop().await;
        let executor = Arc::new(RecordingExecutor::default());
        Self::serve(
            self.dir.clone(),
            self.config.clone(),
            executor,
            Arc::new(SystemClock),
        )
        .await
    }

    pub async fn stop(&mut self) {
        stop_served(self.shutdown.take(), self.task.take()).await;
    }
}
/// A client presenting `identity` to the node at `address`, expecting node name `name`.
pub async fn client(
    authority: &Authority,
    address: &str,
    name: &str,
    identity: &IssuedCertificate,
) -> Result<ConnectorClient<Channel>, certistack_controller::client::NodeError> {
    certistack_controller::client::connect(address, name, authority.ca_pem(), identity).await
}

pub async fn operator(authority: &Authority, node: &TestNode) -> ConnectorClient<Channel> {
    let identity = authority.issue_operator("alice", now()).unwrap();
    client(authority, &node.address, NODE, &identity)
        .await
        .unwrap()
}
/// The shipped connector (node executor, system clock) on loopback.
pub async fn serve_node(
    config: Config,
) -> (
    String,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let connector = Connector::for_node(config).unwrap();
    let listener = connector.bind().await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        connector
            .serve(listener, async {
                let _ = rx.await;
            })
            .await
            .unwrap();
    });
    (address, tx, task)
}

/// Stops a connector [`serve_node`] served: signals its shutdown, then waits for it to end.
pub async fn stop_served(
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
) {
    if let Some(tx) = shutdown {
        let _ = tx.send(());
    }
    if let Some(task) = task {
        task.await.unwrap();
    }
}

/// A clock that runs with the system clock plus an offset the test moves.
#[derive(Default)]
pub struct ManualClock {
    pub offset_ms: std::sync::atomic::AtomicI64,
}

impl ManualClock {
    pub fn advance(&self, by: time::Duration) {
        let ms = i64::try_from(by.whole_milliseconds()).unwrap();
        self.offset_ms
            .fetch_add(ms, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_unix_ms(&self) -> i64 {
        SystemClock.now_unix_ms() + self.offset_ms.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A temporary directory with a controller state directory in it and a [`TestNode`] named
/// [`NODE`] started beneath it: what most tests of the connector's surface begin with.
pub async fn started_node(tag: &str) -> (TempDir, Authority, TestNode) {
    let dir = TempDir::new(tag);
    let authority = controller(&dir.0);
    let node = TestNode::start(&authority, &dir.0.join("node"), NODE).await;
    (dir, authority, node)
}

/// A temporary directory with a controller state directory in it and the config of a node named
/// [`NODE`] enrolled beneath it, for a test to adjust before it serves or runs the node.
pub fn enrolled_node(tag: &str) -> (TempDir, Authority, Config) {
    let dir = TempDir::new(tag);
    let authority = controller(&dir.0);
    let config = enroll(&authority, &dir.0.join("node"), NODE);
    (dir, authority, config)
}
