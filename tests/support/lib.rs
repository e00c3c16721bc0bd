//! Test support: a PKI made with the controller's own code, connectors served in-process on
#![forbid(unsafe_code)]
//! loopback with a recording executor, and clients with chosen TLS identities.
//!
//! Everything here is a test double and lives only in this crate, which is never packaged.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_debug_implementations
)]

use certistack_connector::action::Action;
use certistack_connector::config::{Config, Limits, PvePaths, StatePaths, TlsFiles, ToolPaths};
use certistack_connector::executor::{Caller, ExecFuture, Executor, Outcome, capability};
use certistack_connector::server::Connector;
use certistack_connector::service::{Clock, SystemClock};
use certistack_controller::authority::{self, Authority, IssuedCertificate};
use certistack_controller::run::{self, RunCredentials};
use certistack_core::tls;
use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_client::ConnectorClient;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use time::OffsetDateTime;
use tonic::transport::Channel;

pub const NODE: &str = "pve1";

/// A fresh temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let path = std::env::temp_dir().join(format!("certistack-{tag}-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn now() -> OffsetDateTime {
    OffsetDateTime::now_utc()
}

/// A controller state directory made by `authority::init`.
pub fn controller(dir: &Path) -> Authority {
    let state = dir.join("ctl");
    authority::init(&state, now()).unwrap();
    Authority::load(&state).unwrap()
}

/// Every action the connector handed over, in order.
#[derive(Default)]
pub struct RecordingExecutor {
    pub actions: Mutex<Vec<Action>>,
}

impl RecordingExecutor {
    pub fn count(&self) -> usize {
        self.actions.lock().unwrap().len()
    }
    pub fn rpcs(&self) -> Vec<&'static str> {
        self.actions
            .lock()
            .unwrap()
            .iter()
            .map(|a| a.rpc().name())
            .collect()
    }
}

impl Executor for RecordingExecutor {
    fn capabilities(&self) -> Vec<&'static str> {
        vec!["test.recording"]
    }

    fn execute<'a>(&'a self, _caller: &'a Caller, action: Action) -> ExecFuture<'a> {
        let head = format!("recorded:{}", capability(&action));
        let outcome = match &action {
            Action::MapBackup { .. } => Outcome::MapBackup(pb::MapBackupReply {
                loop_device: "/dev/loop7".into(),
                journal_head: head,
                ..Default::default()
            }),
            Action::UnmapBackup { .. } => Outcome::UnmapBackup(pb::UnmapBackupReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::CreateOverlay { .. } => Outcome::CreateOverlay(pb::CreateOverlayReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::DeleteOverlay { .. } => {
                Outcome::DeleteOverlay(pb::DeleteOverlayReply { journal_head: head })
            }
            Action::CreateVm { .. } => Outcome::CreateVm(pb::CreateVmReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::StartVm { .. }
            | Action::StopVm { .. }
            | Action::DestroyVm { .. }
            | Action::VmStatus { .. } => Outcome::Vm(pb::VmReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::Qmp { .. } => Outcome::Qmp(pb::QmpReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::Qga { .. } => Outcome::Qga(pb::QgaReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::PrepareSandbox { .. } => Outcome::PrepareSandbox(pb::PrepareSandboxReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::ReleaseSandbox { .. } => {
                Outcome::ReleaseSandbox(pb::ReleaseSandboxReply { journal_head: head })
            }
            Action::Probe { .. } => Outcome::Probe(pb::ProbeReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::ReadJournal { .. } => {
                unreachable!("the service answers ReadJournal from the run registry")
            }
            Action::Cleanup { .. } => Outcome::Cleanup(pb::CleanupReply {
                journal_head: head,
                ..Default::default()
            }),
            Action::ReadSourceConfig { .. } => {
                Outcome::ReadSourceConfig(pb::ReadSourceConfigReply {
                    journal_head: head,
                    ..Default::default()
                })
            }
            Action::RecoverGuestNetwork { .. } => {
                Outcome::RecoverGuestNetwork(pb::RecoverGuestNetworkReply {
                    journal_head: head,
                    ..Default::default()
                })
            }
        };
        self.actions.lock().unwrap().push(action);
        Box::pin(async move { Ok(outcome) })
    }
}

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
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap();
        }
    }
}

pub fn ca_pem(authority: &Authority) -> String {
    authority.ca_pem().to_owned()
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

pub const RUN_ID: &str = "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f";
pub const VMID: u32 = 9100;
pub const ARCHIVE: &str = "drive-scsi0.img";
/// The blob a PVE VM backup keeps the VM's config in, as the PBS double stores it.
pub const SOURCE_CONFIG_BLOB: &str = "qemu-server.conf.blob";
/// The first line of the config the support writes when a test gives none.
const DEFAULT_SOURCE_CONFIG_MARK: &str = "#certistack test default";

/// A source VM config for the snapshot in `dir` with the sandbox's long-standing shape (q35,
/// virtio-scsi, each `drive-scsiN.img` as scsiN, an empty CD-ROM, a virtio NIC), unless a test
/// stored its own config there.
fn write_default_source_config(dir: &Path) {
    let path = dir.join(SOURCE_CONFIG_BLOB);
    if std::fs::read_to_string(&path).is_ok_and(|t| !t.starts_with(DEFAULT_SOURCE_CONFIG_MARK)) {
        return;
    }
    let mut disks: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| {
            let slot = n.strip_prefix("drive-scsi")?.strip_suffix(".img")?;
            slot.parse::<u8>().ok()?;
            Some(format!("scsi{slot}"))
        })
        .collect();
    disks.sort();
    let mut text = format!(
        "{DEFAULT_SOURCE_CONFIG_MARK}\nboot: order={}\ncores: 1\nide2: none,media=cdrom\nmachine: q35\nmemory: 512\nnet0: virtio=BC:24:11:0A:0B:0C,bridge=vmbr0,firewall=1\nscsihw: virtio-scsi-pci\n",
        disks.first().map_or("net0", String::as_str)
    );
    for disk in &disks {
        text.push_str(&format!("{disk}: local-lvm:vm-100-disk-{disk},size=64M\n"));
    }
    std::fs::write(&path, text).unwrap();
}
pub const SNAPSHOT: &str = "vm/100/2026-11-01T02:00:00Z";
pub const VNET: &str = "csbox1";
pub const PROBE_SOURCE: &str = "198.51.100.2/24";
pub const TARGET: &str = "198.51.100.10";

/// A grant for one run on `node`, valid for the next hour.
pub fn grant(run_id: &str, node: &str) -> pb::RunGrant {
    let now = now().unix_timestamp();
    pb::RunGrant {
        version: 1,
        run_id: run_id.into(),
        node: node.into(),
        not_before_unix: now - 60,
        deadline_unix: now + 3600,
        repository: Some(pb::PbsRepository {
            server: "pbs.lab".into(),
            port: 8007,
            datastore: "store1".into(),
            namespace: String::new(),
            auth_id: "certistack@pbs!restore".into(),
            fingerprint: ["ab"; 32].join(":"),
        }),
        snapshot: SNAPSHOT.into(),
        archives: vec![ARCHIVE.into()],
        sandbox_vms: vec![pb::SandboxVm {
            vmid: VMID,
            max_cores: 2,
            max_memory_mib: 2048,
        }],
        vnet: VNET.into(),
        probe_source: PROBE_SOURCE.into(),
        probe_targets: vec![pb::ProbeTarget {
            kind: pb::ProbeKind::Tcp as i32,
            address: TARGET.into(),
            port: 22,
            expect: Some(pb::ProbeExpectation {
                banner_prefix: "SSH-2.0-".into(),
                ..Default::default()
            }),
        }],
        qga_assertions: vec![pb::QgaAssertion {
            id: "nginx-active".into(),
            program: "/usr/bin/systemctl".into(),
            args: vec!["is-active".into(), "nginx".into()],
            expect_exit_code: 0,
            expect_stdout_contains: String::new(),
            timeout_seconds: 30,
        }],
        network_recovery_modes: vec![pb::NetworkRecoveryMode::Rewrite as i32],
        guest_address: format!("{TARGET}/24"),
    }
}

pub fn mint(authority: &Authority, grant: &pb::RunGrant) -> RunCredentials {
    run::mint(authority, grant, now()).unwrap()
}

pub async fn run_client(
    authority: &Authority,
    node: &TestNode,
    credentials: &RunCredentials,
) -> ConnectorClient<Channel> {
    client(authority, &node.address, NODE, &credentials.certificate)
        .await
        .unwrap()
}

pub fn begin_request(credentials: &RunCredentials) -> pb::BeginRunRequest {
    pb::BeginRunRequest {
        grant: Some(credentials.signed_grant.clone()),
    }
}

/// A rustls client config built by hand, for the negative TLS cases the controller's own
/// code cannot produce (no certificate, TLS 1.2 only).
pub fn raw_client_config(
    authority: &Authority,
    versions: &[&'static rustls::SupportedProtocolVersion],
    identity: Option<&IssuedCertificate>,
) -> Arc<rustls::ClientConfig> {
    let ca = tls::parse_certificates(authority.ca_pem(), "ca").unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(tls::provider())
        .with_protocol_versions(versions)
        .unwrap()
        .with_root_certificates(tls::ca_roots(&ca).unwrap());
    let mut config = match identity {
        Some(identity) => builder
            .with_client_auth_cert(
                tls::parse_certificates(&identity.certificate_pem, "client").unwrap(),
                tls::parse_private_key(&identity.key_pem, "key").unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(config)
}

/// Calls Hello over a hand-built TLS config; returns the error text when anything refuses.
pub async fn hello_with(
    address: &str,
    config: Arc<rustls::ClientConfig>,
) -> Result<pb::HelloReply, String> {
    let channel = certistack_controller::connect::connect(address.to_owned(), NODE, config)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut client = ConnectorClient::new(channel);
    client
        .hello(pb::HelloRequest {})
        .await
        .map(|r| r.into_inner())
        .map_err(|status| {
            let mut text = format!("status {:?}: {}", status.code(), status.message());
            let mut source = std::error::Error::source(&status);
            while let Some(cause) = source {
                text.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            text
        })
}

/// The directory holding this workspace's built binaries (`target/<profile>`).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the binaries first (`cargo build --workspace`), as the README's test command does",
        path.display()
    );
    path
}

/// Whether tests that need root, loop devices and the lab tools may run here. Elsewhere they
/// skip with a printed reason, except under `CERTISTACK_REQUIRE_PRIVILEGED_TESTS=1` (CI), where
/// a skip is a failure.
pub fn privileged(test: &str, tools: &[&str]) -> bool {
    let mut missing = Vec::new();
    if rustix::process::geteuid().as_raw() != 0 {
        missing.push("root".to_owned());
    }
    if !Path::new("/dev/loop-control").exists() {
        missing.push("/dev/loop-control".to_owned());
    }
    for tool in tools {
        if !tool_installed(tool) {
            missing.push((*tool).to_owned());
        }
    }
    if missing.is_empty() {
        return true;
    }
    skip(test, &missing.join(", "))
}

/// Whether `tool` is on the PATH the connector gives the tools it runs.
pub fn tool_installed(tool: &str) -> bool {
    ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        .iter()
        .any(|dir| Path::new(dir).join(tool).exists())
}

/// Whether the files a test needs, each from the Debian package named beside it, are there;
/// otherwise a skip as [`privileged`] makes it (a failure in CI), naming the packages.
pub fn has_files(test: &str, files: &[(&str, &str)]) -> bool {
    let missing: Vec<String> = files
        .iter()
        .filter(|(path, _)| !Path::new(path).exists())
        .map(|(path, package)| {
            format!("{path} (Debian package {package}; tests/prepare-machine.sh installs it)")
        })
        .collect();
    missing.is_empty() || skip(test, &missing.join(", "))
}

/// Prints why `test` skips and returns `false`, or fails it under
/// `CERTISTACK_REQUIRE_PRIVILEGED_TESTS=1`.
fn skip(test: &str, needs: &str) -> bool {
    let reason = format!("{test}: needs {needs}");
    if std::env::var("CERTISTACK_REQUIRE_PRIVILEGED_TESTS").as_deref() == Ok("1") {
        panic!("{reason}, and CERTISTACK_REQUIRE_PRIVILEGED_TESTS=1 forbids skipping it");
    }
    eprintln!("SKIPPED {reason}");
    false
}

/// A simulated Proxmox VE node: the test doubles of `proxmox-backup-client` and `qm` under
/// `<root>/bin`, their state under `<root>`, and a connector config pointing at both.
pub struct Lab {
    pub root: PathBuf,
    pub _dir: TempDir,
}

pub const PBS_PASSWORD: &str = "correct horse battery staple";

impl Lab {
    pub fn new(tag: &str) -> Self {
        let dir = TempDir::new(tag);
        let root = dir.0.join("lab");
        let bin = root.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let doubles = Path::new(env!("CARGO_MANIFEST_DIR")).join("doubles");
        for tool in ["proxmox-backup-client", "qm"] {
            let target = bin.join(tool);
            std::fs::copy(doubles.join(tool), &target).unwrap();
            std::fs::set_permissions(&target, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .unwrap();
        }
        let fingerprint = ["ab"; 32].join(":");
        // One verdict on the QEMU accelerator for all tests of this boot, from booting the
        // lab's guest (`disk-probe.img`) under KVM; CERTISTACK_LAB_ACCEL=kvm|tcg decides
        // instead for people who know better.
        let settings = serde_json::json!({
            "node": NODE,
            "pbs_password": PBS_PASSWORD,
            "pbs_fingerprint": fingerprint,
            // Beside the guest assets, as the lab keeps it: one verdict for both.
            "accel_cache": lab_assets_dir().join("qm-accel.json"),
            "accel_probe_disk": lab_assets_dir().join("current/disk-probe.img"),
            "accel": lab_accel(),
        });
        std::fs::write(root.join("double.json"), settings.to_string()).unwrap();
        // The packages a PVE 9 node has installed, as NodeChecks reads them.
        let dpkg = root.join("var/lib/dpkg");
        std::fs::create_dir_all(&dpkg).unwrap();
        std::fs::write(
            dpkg.join("status"),
            "Package: pve-manager\nStatus: install ok installed\nVersion: 9.0.6\n\n\
             Package: qemu-server\nStatus: install ok installed\nVersion: 9.0.18\n\n\
             Package: pve-qemu-kvm\nStatus: install ok installed\nVersion: 10.0.2-4\n",
        )
        .unwrap();
        Self { root, _dir: dir }
    }

    /// Changes settings of the doubles (`double.json`).
    pub fn settings(&self, patch: serde_json::Value) {
        let path = self.root.join("double.json");
        let mut settings: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for (key, value) in patch.as_object().unwrap() {
            settings[key] = value.clone();
        }
        std::fs::write(path, settings.to_string()).unwrap();
    }

    /// Runs the `qm` double directly, as an administrator of the node would.
    pub fn qm(&self, args: &[&str]) -> std::process::Output {
        std::process::Command::new(self.root.join("bin/qm"))
            .args(args)
            .output()
            .unwrap()
    }

    /// Stores a raw disk image as `<archive>` of `<snapshot>` in datastore `store1`; its first
    /// bytes are `marker`.
    pub fn add_backup(&self, snapshot: &str, archive: &str, marker: &[u8], size: u64) -> PathBuf {
        let dir = self.root.join("pbs/store1").join(snapshot);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(archive);
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(size).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&file, marker, 0).unwrap();
        write_default_source_config(&dir);
        path
    }

    /// Stores `config` as the snapshot's `qemu-server.conf` blob (every PVE VM backup carries
    /// one), replacing the default one.
    pub fn add_source_config(&self, snapshot: &str, config: &str) -> PathBuf {
        let dir = self.root.join("pbs/store1").join(snapshot);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(SOURCE_CONFIG_BLOB);
        std::fs::write(&path, config).unwrap();
        path
    }

    /// A connector config for this lab, in `node_dir`, enrolled with `authority`.
    pub fn node_config(&self, authority: &Authority, node_dir: &Path) -> Config {
        let mut config = enroll(authority, node_dir, NODE);
        config.tools.proxmox_backup_client = self.root.join("bin/proxmox-backup-client");
        config.tools.qm = self.root.join("bin/qm");
        config.pve.qemu_server_run_dir = self.root.join("var/run/qemu-server");
        config.pve.vm_config_dir = self.root.join("etc/pve/qemu-server");
        config.pve.pbs_loopdev_dir = self.root.join("run/pbs-loopdev");
        config.pve.pve_cluster_dir = self.root.join("var/lib/pve-cluster");
        config.pve.dpkg_status = self.root.join("var/lib/dpkg/status");
        config.paths.overlay_root = self.root.join("overlays");
        config
    }

    /// Every invocation the doubles logged.
    pub fn calls(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.root.join("calls.log"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

impl Drop for Lab {
    /// A test that failed half-way must not leave loop devices, VMs or agents behind: stop what
    /// the doubles started under this root and detach its loop devices.
    fn drop(&mut self) {
        let conf_dir = self.root.join("etc/pve/qemu-server");
        if let Ok(entries) = std::fs::read_dir(&conf_dir) {
            for entry in entries.flatten() {
                if let Some(vmid) = entry
                    .file_name()
                    .to_str()
                    .and_then(|n| n.strip_suffix(".conf"))
                {
                    let _ = std::process::Command::new(self.root.join("bin/qm"))
                        .args(["stop", vmid])
                        .output();
                }
            }
        }
        for (device, _) in loops_under(&self.root) {
            let _ = std::process::Command::new(self.root.join("bin/proxmox-backup-client"))
                .args(["unmap", &device])
                .output();
            let _ = std::process::Command::new("losetup")
                .args(["-d", &device])
                .output();
        }
    }
}

/// Loop devices whose backing file lies under `dir`.
pub fn loops_under(dir: &Path) -> Vec<(String, PathBuf)> {
    certistack_connector::node::loopdev::attached(Path::new("/sys/block"))
        .into_iter()
        .filter(|l| l.backing_file.starts_with(dir))
        .map(|l| (l.device, l.backing_file))
        .collect()
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

/// Writes `config` as the TOML file the daemon reads, listening on 127.0.0.1:`port`.
/// Runs `ip` with `args` and insists it succeeds.
pub fn run_ip(args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A TCP port on 127.0.0.1 that nothing listens on at this moment, for a daemon to bind.
pub fn free_local_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn write_config_file(path: &Path, config: &Config, port: u16) {
    let p = |p: &Path| p.display().to_string();
    let text = format!(
        "node_name = \"{}\"\nlisten = \"127.0.0.1:{port}\"\n\
         [tls]\ncertificate = \"{}\"\nprivate_key = \"{}\"\ncontroller_ca = \"{}\"\nrun_authority_public_key = \"{}\"\n\
         [paths]\nstate_dir = \"{}\"\noverlay_root = \"{}\"\n\
         [tools]\nproxmox_backup_client = \"{}\"\nqm = \"{}\"\nqemu_img = \"{}\"\nip = \"{}\"\nnft = \"{}\"\n\
         iptables_legacy_save = \"{}\"\nip6tables_legacy_save = \"{}\"\nguestfish = \"{}\"\n\
         [pve]\nqemu_server_run_dir = \"{}\"\nvm_config_dir = \"{}\"\npbs_loopdev_dir = \"{}\"\npve_cluster_dir = \"{}\"\ndpkg_status = \"{}\"\n\
         sdn_interfaces = \"{}\"\nlvm_conf = \"{}\"\nnodes_dir = \"{}\"\nmounts = \"{}\"\n\
         kvm_device = \"{}\"\ncpuinfo = \"{}\"\ndmi_dir = \"{}\"\n\
         [limits]\n{}\n[sandbox]\n{}\n[process]\n{}\n[guest_network]\n{}",
        config.node_name,
        p(&config.tls.certificate),
        p(&config.tls.private_key),
        p(&config.tls.controller_ca),
        p(&config.tls.run_authority_public_key),
        p(&config.paths.state_dir),
        p(&config.paths.overlay_root),
        p(&config.tools.proxmox_backup_client),
        p(&config.tools.qm),
        p(&config.tools.qemu_img),
        p(&config.tools.ip),
        p(&config.tools.nft),
        p(&config.tools.iptables_legacy_save),
        p(&config.tools.ip6tables_legacy_save),
        p(&config.tools.guestfish),
        p(&config.pve.qemu_server_run_dir),
        p(&config.pve.vm_config_dir),
        p(&config.pve.pbs_loopdev_dir),
        p(&config.pve.pve_cluster_dir),
        p(&config.pve.dpkg_status),
        p(&config.pve.sdn_interfaces),
        p(&config.pve.lvm_conf),
        p(&config.pve.nodes_dir),
        p(&config.pve.mounts),
        p(&config.pve.kvm_device),
        p(&config.pve.cpuinfo),
        p(&config.pve.dmi_dir),
        toml::to_string(&config.limits).unwrap(),
        toml::to_string(&config.sandbox).unwrap(),
        toml::to_string(&config.process).unwrap(),
        toml::to_string(&config.guest_network).unwrap(),
    );
    std::fs::write(path, text).unwrap();
}

/// A client to a connector that is still starting: retried until `Hello` answers (10 s).
pub async fn client_when_up(
    authority: &Authority,
    address: &str,
    identity: &IssuedCertificate,
) -> ConnectorClient<Channel> {
    for _ in 0..100 {
        if let Ok(mut c) = client(authority, address, NODE, identity).await
            && c.hello(pb::HelloRequest {}).await.is_ok()
        {
            return c;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("the connector at {address} did not come up");
}

/// A network namespace made for one test, with bridges standing in for sandbox VNets; deleted
/// on drop. Tests that boot VMs or touch the VNet run inside one (see [`inside`]), so the
/// host's own network is never changed.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(tag: &str, bridges: &[&str]) -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let name = format!("cs{tag}{}", id.get(..6).unwrap());
        run_ip(&["netns", "add", &name]);
        run_ip(&["-n", &name, "link", "set", "lo", "up"]);
        for bridge in bridges {
            run_ip(&["-n", &name, "link", "add", bridge, "type", "bridge"]);
            run_ip(&["-n", &name, "link", "set", bridge, "up"]);
        }
        Self { name }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// Runs `body` on a thread moved into network namespace `ns`, on a runtime of that thread
/// alone: the in-process connector, the tools it starts, its sockets and the test's client all
/// live in that namespace.
pub fn inside<F, Fut>(ns: &str, body: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let path = PathBuf::from("/run/netns").join(ns);
    let handle = std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap();
        rustix::thread::move_into_link_name_space(
            std::os::fd::AsFd::as_fd(&file),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(body());
    });
    if let Err(panic) = handle.join() {
        std::panic::resume_unwind(panic);
    }
}

/// The call was refused with `code` and a message containing `needle`.
pub fn assert_status<T: std::fmt::Debug>(
    result: Result<T, tonic::Status>,
    code: tonic::Code,
    needle: &str,
) {
    match result {
        Ok(reply) => panic!("expected {code:?} containing {needle:?}, got {reply:?}"),
        Err(status) => {
            assert_eq!(status.code(), code, "message: {}", status.message());
            assert!(
                status.message().contains(needle),
                "{:?} does not contain {needle:?}",
                status.message()
            );
        }
    }
}

/// A run's journal as `<operation> <resource> <phase>` lines, read through `ReadJournal`.
pub async fn journal_steps(client: &mut ConnectorClient<Channel>, run_id: &str) -> Vec<String> {
    let mut stream = client
        .read_journal(pb::ReadJournalRequest {
            run_id: run_id.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut steps = Vec::new();
    while let Some(record) = stream.message().await.unwrap() {
        steps.push(format!(
            "{} {} {}",
            record.operation, record.resource, record.phase
        ));
    }
    steps
}

/// What `Cleanup` of `run_id` did: each receipt as `<resource> <end state>`, and the residue.
pub async fn cleanup_receipts(
    client: &mut ConnectorClient<Channel>,
    run_id: &str,
) -> (Vec<String>, Vec<String>) {
    let reply = client
        .cleanup(pb::CleanupRequest {
            run_id: run_id.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let receipts = reply
        .resources
        .iter()
        .map(|r| format!("{} {}", r.resource, r.end_state))
        .collect();
    (receipts, reply.residue)
}

/// A connector double whose `Hello` reports another surface digest (a node running another
/// release); every other call is refused as unimplemented.
pub mod drifted {
    use super::*;
    use certistack_proto::v1::connector_server::Connector;
    use tonic::{Request, Response, Status};

    pub struct DriftedNode {
        pub node: String,
    }

    /// Builds the whole impl: `async_trait` must see every method, so the refusing ones are
    /// spelled out by the macro rather than generated inside the impl.
    macro_rules! drifted_impl {
        ($($name:ident($req:ty) -> $reply:ty;)*) => {
            #[tonic::async_trait]
            impl Connector for DriftedNode {
                async fn hello(&self, _: Request<pb::HelloRequest>) -> Result<Response<pb::HelloReply>, Status> {
                    Ok(Response::new(pb::HelloReply {
                        node_name: self.node.clone(),
                        surface_digest: format!("sha256:{}", "0".repeat(64)),
                        ..Default::default()
                    }))
                }
                type ReadJournalStream = tokio_stream::Empty<Result<pb::JournalRecord, Status>>;
                async fn read_journal(&self, _: Request<pb::ReadJournalRequest>) -> Result<Response<Self::ReadJournalStream>, Status> {
                    Err(Status::unimplemented("drifted double"))
                }
                $(async fn $name(&self, _: Request<$req>) -> Result<Response<$reply>, Status> {
                    Err(Status::unimplemented("drifted double"))
                })*
            }
        };
    }

    drifted_impl! {
        begin_run(pb::BeginRunRequest) -> pb::BeginRunReply;
        end_run(pb::EndRunRequest) -> pb::EndRunReply;
        map_backup(pb::MapBackupRequest) -> pb::MapBackupReply;
        unmap_backup(pb::UnmapBackupRequest) -> pb::UnmapBackupReply;
        create_overlay(pb::CreateOverlayRequest) -> pb::CreateOverlayReply;
        delete_overlay(pb::DeleteOverlayRequest) -> pb::DeleteOverlayReply;
        create_vm(pb::CreateVmRequest) -> pb::CreateVmReply;
        start_vm(pb::VmRequest) -> pb::VmReply;
        stop_vm(pb::StopVmRequest) -> pb::VmReply;
        destroy_vm(pb::VmRequest) -> pb::VmReply;
        vm_status(pb::VmRequest) -> pb::VmReply;
        qmp(pb::QmpRequest) -> pb::QmpReply;
        qga(pb::QgaRequest) -> pb::QgaReply;
        prepare_sandbox(pb::PrepareSandboxRequest) -> pb::PrepareSandboxReply;
        release_sandbox(pb::ReleaseSandboxRequest) -> pb::ReleaseSandboxReply;
        probe(pb::ProbeRequest) -> pb::ProbeReply;
        list_runs(pb::ListRunsRequest) -> pb::ListRunsReply;
        cleanup(pb::CleanupRequest) -> pb::CleanupReply;
        node_checks(pb::NodeChecksRequest) -> pb::NodeChecksReply;
        read_source_config(pb::ReadSourceConfigRequest) -> pb::ReadSourceConfigReply;
        recover_guest_network(pb::RecoverGuestNetworkRequest) -> pb::RecoverGuestNetworkReply;
    }
}

/// The connector's own TLS server configuration for the node certificate of `config`,
/// trusting `authority`'s CA for clients.
pub fn node_tls_server_config(
    authority: &Authority,
    config: &certistack_connector::config::Config,
) -> std::sync::Arc<rustls::ServerConfig> {
    use certistack_core::{files, tls};
    let chain = tls::parse_certificates(
        &files::read_trusted(&config.tls.certificate).unwrap(),
        "node",
    )
    .unwrap();
    let key = tls::parse_private_key(
        &files::read_private(&config.tls.private_key).unwrap(),
        "key",
    )
    .unwrap();
    let ca = tls::parse_certificates(authority.ca_pem(), "ca").unwrap();
    tls::server_config(chain, key, tls::ca_roots(&ca).unwrap()).unwrap()
}

/// Serves the drifted double, answering as `node` under a certificate for `node` enrolled in
/// `dir`, on a loopback port of the current network namespace; returns its address.
pub async fn serve_drifted(authority: &Authority, dir: &Path, node: &str) -> String {
    let config = enroll(authority, dir, node);
    let server_config = node_tls_server_config(authority, &config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(
                certistack_proto::v1::connector_server::ConnectorServer::new(
                    drifted::DriftedNode {
                        node: node.to_owned(),
                    },
                ),
            )
            .serve_with_incoming(certistack_connector::tls::incoming(listener, server_config)),
    );
    address
}

/// The lab's guest disks (`tests/lab/build-assets.sh`): raw images that boot like a PVE VM
/// (SeaBIOS, SYSLINUX, a Debian kernel, a busybox init) and serve what their data area says.
pub struct GuestAssets {
    /// Boots; its `/init` reads the data area.
    pub boot: PathBuf,
    /// The same disk whose boot loader names an init that does not exist: the kernel panics.
    pub panic: PathBuf,
    /// The same disk whose init says "certistack-probe: init reached" on the serial console
    /// and powers off: what the qm double boots under KVM to decide the accelerator.
    pub probe: PathBuf,
    /// Where the data area (partition 2) starts in the image.
    pub data_offset: u64,
}

/// Where the lab's guest disks are built, once for the lab and every test.
pub fn lab_assets_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/lab-assets")
}

/// `CERTISTACK_LAB_ACCEL` (`kvm` or `tcg`) when set, else `auto`: the qm double then boots the
/// lab's guest under KVM once to decide.
pub fn lab_accel() -> &'static str {
    match std::env::var("CERTISTACK_LAB_ACCEL").as_deref() {
        Ok("kvm") => "kvm",
        Ok("tcg") => "tcg",
        Ok("") | Ok("auto") | Err(_) => "auto",
        Ok(other) => panic!("CERTISTACK_LAB_ACCEL={other:?}: give kvm, tcg or nothing"),
    }
}

/// The verdict the qm double of `lab` gives (`"kvm"` or `"tcg"`) and why; the connector's
/// libguestfs appliance is configured from the same verdict, as the lab does.
pub fn accel_verdict(lab: &Lab) -> (String, String) {
    let out = lab.qm(&["certistack-accel"]);
    assert!(
        out.status.success(),
        "qm certistack-accel: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let verdict: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    (
        verdict["accel"].as_str().unwrap().to_owned(),
        verdict["why"].as_str().unwrap().to_owned(),
    )
}

/// The connector's `[guest_network] accelerator` for `lab`'s node, from the qm double's verdict
/// (as the lab sets it): `tcg` where the lab's guest does not boot under KVM, `auto` where it
/// does. The verdict boots the lab's probe disk, built here when its tools are present; without
/// it the verdict is TCG, which always works.
pub fn appliance_accelerator(lab: &Lab) -> certistack_connector::config::ApplianceAccelerator {
    use certistack_connector::config::ApplianceAccelerator;
    let buildable = GUEST_ASSET_TOOLS.iter().all(|tool| tool_installed(tool));
    // A disk that cannot be built here (no network for the kernel package, say) leaves the
    // verdict to TCG, which always works, rather than failing a test that needs no lab disk.
    if buildable && std::panic::catch_unwind(guest_assets).is_err() {
        eprintln!("the lab's guest disks could not be built (above): the appliance runs under TCG");
    }
    let (accel, why) = accel_verdict(lab);
    eprintln!("libguestfs appliance accelerator from the qm double's verdict: {accel} ({why})");
    if accel == "kvm" {
        ApplianceAccelerator::Auto
    } else {
        ApplianceAccelerator::Tcg
    }
}

/// Tools the guest disks are built with, besides those of the node.
pub const GUEST_ASSET_TOOLS: &[&str] = &[
    "busybox",
    "cpio",
    "sfdisk",
    "mkfs.vfat",
    "mcopy",
    "syslinux",
    "qemu-ga",
];

/// Builds the guest disks once per machine into `target/lab-assets` (a cached build returns at
/// once) and once per test process.
pub fn guest_assets() -> &'static GuestAssets {
    static ASSETS: std::sync::OnceLock<GuestAssets> = std::sync::OnceLock::new();
    ASSETS.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let dir = lab_assets_dir();
        let out = std::process::Command::new("bash")
            .arg(root.join("tests/lab/build-assets.sh"))
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "building the guest disks failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let current = dir.join("current");
        let layout = std::fs::read_to_string(current.join("layout")).unwrap();
        let data_offset = layout
            .lines()
            .find_map(|l| l.strip_prefix("DATA_OFFSET="))
            .unwrap()
            .parse()
            .unwrap();
        GuestAssets {
            boot: current.join("disk-boot.img"),
            panic: current.join("disk-panic.img"),
            probe: current.join("disk-probe.img"),
            data_offset,
        }
    })
}

/// What a lab guest disk holds: the marker it serves, its address and whether qemu-ga runs.
pub struct GuestDisk<'a> {
    pub marker: &'a str,
    /// `10.77.1.10/24`
    pub address: &'a str,
    pub agent: bool,
    /// `false`: the kernel panics before any of it is read.
    pub boots: bool,
}

impl GuestDisk<'_> {
    /// The body the guest's HTTP server answers `/` with.
    pub fn http_body(&self) -> String {
        format!("certistack lab guest: marker {}\n", self.marker)
    }

    /// The banner its TCP service on port 22 sends.
    pub fn banner(&self) -> String {
        format!("CERTISTACK-LAB {}", self.marker)
    }
}

impl Lab {
    /// Stores a lab guest disk as `<archive>` of `<snapshot>` in datastore `store1`.
    pub fn add_guest_backup(&self, snapshot: &str, archive: &str, disk: &GuestDisk) -> PathBuf {
        let assets = guest_assets();
        let dir = self.root.join("pbs/store1").join(snapshot);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(archive);
        let image = if disk.boots {
            &assets.boot
        } else {
            &assets.panic
        };
        std::fs::copy(image, &path).unwrap();
        let data = format!(
            "certistack-lab-disk v1\nmarker={}\naddress={}\nagent={}\n",
            disk.marker,
            disk.address,
            if disk.agent { "yes" } else { "no" }
        );
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&file, data.as_bytes(), assets.data_offset)
            .unwrap();
        write_default_source_config(&dir);
        path
    }
}
