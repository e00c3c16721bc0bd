//! Node operations for real: the `proxmox-backup-client` double attaches real read-only loop
//! devices, overlays are made by the real `qemu-img`, and every check re-reads the kernel.
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
use tonic::Code;
use tonic::transport::Channel;

#[path = "node/runs.rs"]
mod runs;

#[path = "node/lab.rs"]
mod lab;

#[path = "node/guest_network.rs"]
mod guest_network;

#[path = "node/backup_manifest.rs"]
mod backup_manifest;
#[path = "node/backup_mappings.rs"]
mod backup_mappings;
#[path = "node/cleanup_journal.rs"]
mod cleanup_journal;
#[path = "node/crash.rs"]
mod crash;
#[path = "node/loop_ioctls.rs"]
mod loop_ioctls;
#[path = "node/recovery_unit.rs"]
mod recovery_unit;
#[path = "node/run_files.rs"]
mod run_files;
#[path = "node/source_hardware.rs"]
mod source_hardware;
#[path = "node/step_completion.rs"]
mod step_completion;
#[path = "node/systemd_unit.rs"]
mod systemd_unit;
#[path = "node/vm_lifecycle.rs"]
mod vm_lifecycle;

const MARKER: &[u8] = b"CERTISTACK-RESTORE-MARKER";

/// Loop device numbers, QEMU and the lab tools are shared by the whole machine: these tests
/// run one at a time so each can reason about the devices it sees.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn map_request(archive: &str, secret: &str) -> pb::MapBackupRequest {
    pb::MapBackupRequest {
        snapshot: SNAPSHOT.into(),
        archive: archive.into(),
        pbs_secret: secret.into(),
        encryption_key: vec![],
    }
}

struct Run {
    lab: Lab,
    client: ConnectorClient<Channel>,
    /// Where the node listens, for a second client (an operator's).
    address: String,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    _authority_dir: TempDir,
    _serial: tokio::sync::MutexGuard<'static, ()>,
}

impl Run {
    async fn begin(tag: &str, archives: &[&str]) -> Self {
        Self::begin_with(tag, archives, |_| {}, |_| {}).await
    }

    /// A run whose lab and grant the test adjusts before the connector starts.
    async fn begin_with(
        tag: &str,
        archives: &[&str],
        prepare: impl FnOnce(&Lab),
        edit: impl FnOnce(&mut pb::RunGrant),
    ) -> Self {
        Self::begin_configured(tag, archives, prepare, edit, |_| {}).await
    }

    /// As `begin_with`, with the connector's limits adjusted too.
    async fn begin_configured(
        tag: &str,
        archives: &[&str],
        prepare: impl FnOnce(&Lab),
        edit: impl FnOnce(&mut pb::RunGrant),
        limits: impl FnOnce(&mut certistack_connector::config::Limits),
    ) -> Self {
        Self::begin_with_config(
            tag,
            archives,
            prepare,
            edit,
            |_, config: &mut certistack_connector::config::Config| limits(&mut config.limits),
        )
        .await
    }

    /// As `begin_with`, with the connector's whole configuration adjusted (paths in the lab).
    async fn begin_with_config(
        tag: &str,
        archives: &[&str],
        prepare: impl FnOnce(&Lab),
        edit: impl FnOnce(&mut pb::RunGrant),
        configure: impl FnOnce(&Lab, &mut certistack_connector::config::Config),
    ) -> Self {
        let serial = SERIAL.lock().await;
        let lab = Lab::new(tag);
        for archive in archives {
            lab.add_backup(SNAPSHOT, archive, MARKER, 8 << 20);
        }
        prepare(&lab);
        let (authority_dir, authority, mut config) =
            lab.controller_and_node_config(&format!("{tag}-ctl"));
        config.limits.guest_timeout_secs = 3;
        configure(&lab, &mut config);
        let (address, shutdown, task) = serve_node(config).await;
        let mut wire = grant(RUN_ID, NODE);
        wire.archives = archives.iter().map(|a| (*a).to_owned()).collect();
        edit(&mut wire);
        let client = begun_run(&authority, &address, &wire).await;
        Self {
            lab,
            client,
            address,
            shutdown: Some(shutdown),
            task: Some(task),
            _authority_dir: authority_dir,
            _serial: serial,
        }
    }

    fn loops(&self) -> Vec<(String, std::path::PathBuf)> {
        loops_under(&self.lab.root.join("run/pbs-loopdev"))
    }

    async fn journal(&mut self) -> Vec<String> {
        journal_steps(&mut self.client, RUN_ID).await
    }

    /// Cleans up, checks that nothing is left, then ends the run (which must now succeed).
    async fn end(mut self) {
        let (receipts, residue) = cleanup_receipts(&mut self.client, RUN_ID).await;
        assert!(residue.is_empty(), "{receipts:?} {residue:?}");
        assert!(self.loops().is_empty());
        self.client.end_run(pb::EndRunRequest {}).await.unwrap();
        stop_served(self.shutdown.take(), self.task.take()).await;
    }

    async fn stop(mut self) {
        // Whatever a test left mapped is cleaned up by the run itself, then checked.
        let reply = self
            .client
            .cleanup(pb::CleanupRequest {
                run_id: RUN_ID.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(reply.residue.is_empty(), "{:?}", reply.residue);
        assert!(self.loops().is_empty());
        stop_served(self.shutdown.take(), self.task.take()).await;
    }
}

fn qemu_img_info(path: &str) -> serde_json::Value {
    let out = std::process::Command::new("qemu-img")
        .args(["info", "--output=json", "-U", path])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

const QEMU_TOOLS: &[&str] = &[
    "losetup",
    "qemu-img",
    "qemu-system-x86_64",
    "qemu-ga",
    "python3",
    "ip",
    "nft",
];

fn sandbox_grant(wire: &mut pb::RunGrant) {
    wire.sandbox_vms = [9100, 9101, 9102]
        .into_iter()
        .map(|vmid| pb::SandboxVm {
            vmid,
            max_cores: 2,
            max_memory_mib: 512,
        })
        .collect();
    wire.qga_assertions = vec![
        pb::QgaAssertion {
            id: "restored-echo".into(),
            program: "/bin/echo".into(),
            args: vec!["restored".into(), "ok".into()],
            expect_exit_code: 0,
            expect_stdout_contains: "restored ok".into(),
            timeout_seconds: 20,
        },
        pb::QgaAssertion {
            id: "slow-check".into(),
            program: "/bin/sleep".into(),
            args: vec!["4".into()],
            expect_exit_code: 0,
            expect_stdout_contains: String::new(),
            timeout_seconds: 20,
        },
    ];
}

/// Asks the agent on `socket` for `guest-sync-delimited` as PVE's own agent calls do, within
/// `timeout`; true when it answered.
fn agent_answers(socket: &std::path::Path, timeout: std::time::Duration) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::os::unix::net::UnixStream::connect(socket) else {
        return false;
    };
    stream.set_read_timeout(Some(timeout)).unwrap();
    stream
        .write_all(b"{\"execute\":\"guest-sync-delimited\",\"arguments\":{\"id\":4242}}\n")
        .unwrap();
    let mut answer = Vec::new();
    let mut byte = [0u8; 1];
    while !answer.ends_with(b"\n") || !answer.contains(&0xFF) {
        match stream.read(&mut byte) {
            Ok(1) => answer.push(byte[0]),
            _ => return false,
        }
    }
    String::from_utf8_lossy(&answer).contains("4242")
}

/// Maps ARCHIVE, then creates its overlay for `vmid` and a VM booting it; returns the VM's
/// SMBIOS UUID.
async fn map_overlay_and_vm(client: &mut ConnectorClient<Channel>, vmid: u32) -> String {
    client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap();
    overlay_and_vm(client, vmid).await
}

/// Maps ARCHIVE and creates its overlay for `vmid`.
async fn map_and_overlay(client: &mut ConnectorClient<Channel>, vmid: u32) {
    client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap();
    client
        .create_overlay(pb::CreateOverlayRequest {
            vmid,
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
}

/// Creates the overlay of the mapped ARCHIVE for `vmid` and a one-core VM booting it; returns
/// the VM's SMBIOS UUID.
async fn overlay_and_vm(client: &mut ConnectorClient<Channel>, vmid: u32) -> String {
    client
        .create_overlay(pb::CreateOverlayRequest {
            vmid,
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
    client
        .create_vm(pb::CreateVmRequest {
            vmid,
            cores: 1,
            memory_mib: 256,
            archives: vec![ARCHIVE.into()],
            mirror_source_hardware: false,
        })
        .await
        .unwrap()
        .into_inner()
        .smbios_uuid
}

impl Run {
    async fn sandbox_vm(&mut self, vmid: u32) -> String {
        self.client
            .prepare_sandbox(pb::PrepareSandboxRequest {
                vnet: VNET.into(),
                probe_source: PROBE_SOURCE.into(),
            })
            .await
            .unwrap();
        map_overlay_and_vm(&mut self.client, vmid).await
    }

    fn conf(&self, vmid: u32) -> String {
        std::fs::read_to_string(
            self.lab
                .root
                .join(format!("etc/pve/qemu-server/{vmid}.conf")),
        )
        .unwrap()
    }

    fn qemu_running(&self, vmid: u32) -> bool {
        let pid = self
            .lab
            .root
            .join(format!("var/run/qemu-server/{vmid}.pid"));
        std::fs::read_to_string(pid)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
            .is_some_and(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
    }
}

/// A map request the caller gives up on after `ms` milliseconds.
fn cut<T>(message: T, ms: u64) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(std::time::Duration::from_millis(ms));
    request
}

fn assert_cut<T: std::fmt::Debug>(result: Result<T, tonic::Status>) {
    let status = result.unwrap_err();
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );
}

fn ok<T>(result: Result<T, tonic::Status>) -> Result<(), tonic::Status> {
    result.map(|_| ())
}
