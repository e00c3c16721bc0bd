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
        let serial = SERIAL.lock().await;
        let lab = Lab::new(tag);
        for archive in archives {
            lab.add_backup(SNAPSHOT, archive, MARKER, 8 << 20);
        }
        prepare(&lab);
        let authority_dir = TempDir::new(&format!("{tag}-ctl"));
        let authority = controller(&authority_dir.0);
        let mut config = lab.node_config(&authority, &lab.root.join("node"));
        config.limits.guest_timeout_secs = 3;
        limits(&mut config.limits);
        let (address, shutdown, task) = serve_node(config).await;
        let mut wire = grant(RUN_ID, NODE);
        wire.archives = archives.iter().map(|a| (*a).to_owned()).collect();
        edit(&mut wire);
        let credentials = mint(&authority, &wire);
        let mut client = client(&authority, &address, NODE, &credentials.certificate)
            .await
            .unwrap();
        client.begin_run(begin_request(&credentials)).await.unwrap();
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
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap();
        }
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
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap();
        }
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

#[tokio::test(flavor = "multi_thread")]
async fn map_overlay_unmap_for_real() {
    if !privileged(
        "map_overlay_unmap_for_real",
        &["losetup", "qemu-img", "python3"],
    ) {
        return;
    }
    let mut run = Run::begin("ops", &[ARCHIVE]).await;

    let mapped = run
        .client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap()
        .into_inner();
    let device = mapped.loop_device.clone();
    assert!(device.starts_with("/dev/loop"), "{device}");
    let name = device.trim_start_matches("/dev/");
    assert_eq!(
        std::fs::read_to_string(format!("/sys/block/{name}/ro"))
            .unwrap()
            .trim(),
        "1",
        "mapped read-only"
    );
    let loops = run.loops();
    assert_eq!(loops.len(), 1);
    assert_eq!(loops[0].0, device);
    // The backup's bytes are what the loop device serves.
    let mut head = vec![0u8; MARKER.len()];
    std::io::Read::read_exact(&mut std::fs::File::open(&device).unwrap(), &mut head).unwrap();
    assert_eq!(head, MARKER);
    let tool = mapped.tool.unwrap();
    assert_eq!(
        (tool.program.as_str(), tool.exit_code),
        ("proxmox-backup-client map", 0)
    );

    // The secret reached the client through its descriptor only: not argv, not the
    // environment, not the double's log; and the environment holds exactly what map needs.
    let calls = run.lab.calls();
    assert!(
        !serde_json::to_string(&calls)
            .unwrap()
            .contains(PBS_PASSWORD),
        "the secret leaked: {calls:?}"
    );
    let map_call = calls.iter().find(|c| c["command"] == "map").unwrap();
    assert_eq!(
        map_call["argv"],
        serde_json::json!([
            "map",
            SNAPSHOT,
            ARCHIVE,
            "--repository",
            "certistack@pbs!restore@pbs.lab:8007:store1"
        ])
    );
    let mut env: Vec<String> = serde_json::from_value(map_call["env_names"].clone()).unwrap();
    env.sort();
    assert_eq!(env, ["PATH", "PBS_FINGERPRINT", "PBS_PASSWORD_FD"]);
    assert!(
        calls
            .iter()
            .any(|c| c["password_source"] == "PBS_PASSWORD_FD"),
        "{calls:?}"
    );

    // Mapping the same archive twice is refused by the connector, before the tool runs.
    assert_status(
        run.client
            .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
            .await,
        Code::AlreadyExists,
        "already mapped by this run",
    );

    // The lab's "cluster database" lives on the same filesystem as the overlays: warned.
    std::fs::create_dir_all(run.lab.root.join("var/lib/pve-cluster")).unwrap();
    let overlay = run
        .client
        .create_overlay(pb::CreateOverlayRequest {
            vmid: VMID,
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(overlay.tool.unwrap().exit_code, 0);
    assert_eq!(overlay.warnings.len(), 1, "{:?}", overlay.warnings);
    assert!(
        overlay.warnings[0].contains("same filesystem"),
        "{:?}",
        overlay.warnings
    );
    let path = run
        .lab
        .root
        .join(format!("overlays/{RUN_ID}/{VMID}-drive-scsi0.qcow2"));
    let info = qemu_img_info(path.to_str().unwrap());
    assert_eq!(info["format"], "qcow2");
    assert_eq!(info["backing-filename"], device.as_str());
    assert_eq!(info["backing-filename-format"], "raw");
    let dir_mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions(),
    );
    assert_eq!(dir_mode & 0o777, 0o700);
    assert_status(
        run.client
            .create_overlay(pb::CreateOverlayRequest {
                vmid: VMID,
                archive: ARCHIVE.into(),
            })
            .await,
        Code::AlreadyExists,
        "already exists",
    );

    // The backup cannot be unmapped from under its overlay.
    assert_status(
        run.client
            .unmap_backup(pb::UnmapBackupRequest {
                archive: ARCHIVE.into(),
            })
            .await,
        Code::FailedPrecondition,
        "still uses",
    );
    run.client
        .delete_overlay(pb::DeleteOverlayRequest {
            vmid: VMID,
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
    assert!(!path.exists());
    run.client
        .unmap_backup(pb::UnmapBackupRequest {
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
    assert!(run.loops().is_empty(), "unmapped");

    let steps = run.journal().await;
    let expected = [
        "run.begin run:0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f done",
        "backup.map backup:drive-scsi0.img intent",
        // The second intent names the tool's processes (pid, start time, process group).
        "backup.map backup:drive-scsi0.img intent",
        "backup.map backup:drive-scsi0.img done",
        "overlay.dir dir:overlays intent",
        "overlay.dir dir:overlays done",
        "overlay.create overlay:9100:drive-scsi0.img intent",
        "overlay.create overlay:9100:drive-scsi0.img intent",
        "overlay.create overlay:9100:drive-scsi0.img done",
        "overlay.delete overlay:9100:drive-scsi0.img intent",
        "overlay.delete overlay:9100:drive-scsi0.img undone",
        "backup.unmap backup:drive-scsi0.img intent",
        "backup.unmap backup:drive-scsi0.img intent",
        "backup.unmap backup:drive-scsi0.img undone",
    ];
    assert_eq!(steps, expected);
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn map_failures_are_reported_from_the_output_not_the_exit_code() {
    if !privileged(
        "map_failures_are_reported_from_the_output_not_the_exit_code",
        &["losetup", "python3"],
    ) {
        return;
    }
    let mut run = Run::begin("mapfail", &[ARCHIVE, "drive-scsi1.img"]).await;
    // Wrong password: the client exits 0 and prints an error; nothing is mapped.
    let status = run
        .client
        .map_backup(map_request(ARCHIVE, "wrong password"))
        .await
        .unwrap_err();
    assert_eq!(
        status.code(),
        Code::FailedPrecondition,
        "{}",
        status.message()
    );
    assert!(
        status
            .message()
            .contains("did not map drive-scsi0.img (exit Some(0))"),
        "{}",
        status.message()
    );
    assert!(
        status.message().contains("authentication failed"),
        "{}",
        status.message()
    );
    assert!(!status.message().contains("wrong password"));
    // An archive the snapshot does not have (granted, but absent from the datastore).
    std::fs::remove_file(
        run.lab
            .root
            .join("pbs/store1")
            .join(SNAPSHOT)
            .join("drive-scsi1.img"),
    )
    .unwrap();
    let status = run
        .client
        .map_backup(map_request("drive-scsi1.img", PBS_PASSWORD))
        .await
        .unwrap_err();
    assert!(
        status.message().contains("manifest does not contain file"),
        "{}",
        status.message()
    );
    assert!(run.loops().is_empty());
    let steps = run.journal().await;
    // A map that finished and named no device mapped nothing: the journal closes it at once.
    assert_eq!(
        &steps[1..],
        [
            "backup.map backup:drive-scsi0.img intent",
            "backup.map backup:drive-scsi0.img intent",
            "backup.map backup:drive-scsi0.img failed",
            "backup.map backup:drive-scsi0.img undone",
            "backup.map backup:drive-scsi1.img intent",
            "backup.map backup:drive-scsi1.img intent",
            "backup.map backup:drive-scsi1.img failed",
            "backup.map backup:drive-scsi1.img undone",
        ]
    );
    // So the failed map can be retried, and the retry unmapped: map, fail, map, unmap.
    let device = run
        .client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap()
        .into_inner()
        .loop_device;
    assert_eq!(run.loops().len(), 1, "{device} mapped");
    run.client
        .unmap_backup(pb::UnmapBackupRequest {
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
    assert!(run.loops().is_empty(), "{device} unmapped");
    // Nothing is left for Cleanup.
    let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
    assert!(receipts.is_empty(), "{receipts:?}");
    assert!(residue.is_empty(), "{residue:?}");
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_loop_device_the_run_did_not_map_is_never_unmapped() {
    if !privileged(
        "a_loop_device_the_run_did_not_map_is_never_unmapped",
        &["losetup", "python3"],
    ) {
        return;
    }
    let mut run = Run::begin("foreign", &[ARCHIVE]).await;
    let device = run
        .client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap()
        .into_inner()
        .loop_device;
    // Someone detaches the mapping behind the connector's back and the kernel hands the same
    // device number to an unrelated file.
    let foreign = run.lab.root.join("foreign.img");
    std::fs::File::create(&foreign)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let sh = |args: &[&str]| {
        // A detached device can stay busy for a moment while the kernel releases it.
        for attempt in 0.. {
            let out = std::process::Command::new("losetup")
                .args(args)
                .output()
                .unwrap();
            if out.status.success() {
                return;
            }
            assert!(
                attempt < 40,
                "losetup {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    sh(&["-d", &device]);
    sh(&[&device, foreign.to_str().unwrap()]);

    run.client
        .unmap_backup(pb::UnmapBackupRequest {
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
    let still =
        certistack_connector::node::loopdev::inspect(std::path::Path::new("/sys/block"), &device)
            .unwrap();
    assert_eq!(
        still.backing_file, foreign,
        "the foreign device was left attached"
    );
    let steps = run.journal().await;
    assert_eq!(
        steps.last().unwrap(),
        "backup.unmap backup:drive-scsi0.img undone"
    );
    sh(&["-d", &device]);
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn cleanup_undoes_everything_newest_first_and_is_idempotent() {
    if !privileged(
        "cleanup_undoes_everything_newest_first_and_is_idempotent",
        &["losetup", "qemu-img", "python3"],
    ) {
        return;
    }
    let mut run = Run::begin("cleanup", &[ARCHIVE, "drive-scsi1.img"]).await;
    for archive in [ARCHIVE, "drive-scsi1.img"] {
        run.client
            .map_backup(map_request(archive, PBS_PASSWORD))
            .await
            .unwrap();
        run.client
            .create_overlay(pb::CreateOverlayRequest {
                vmid: VMID,
                archive: archive.into(),
            })
            .await
            .unwrap();
    }
    assert_eq!(run.loops().len(), 2);
    // A run cannot end while it still holds resources on the node.
    assert_status(
        run.client.end_run(pb::EndRunRequest {}).await,
        Code::FailedPrecondition,
        "still holds on this node: open in its journal: overlay:9100:drive-scsi1.img, backup:drive-scsi1.img, overlay:9100:drive-scsi0.img, dir:overlays, backup:drive-scsi0.img; loop device",
    );
    let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
    assert_eq!(
        receipts,
        [
            "overlay:9100:drive-scsi1.img deleted",
            "backup:drive-scsi1.img unmapped",
            "overlay:9100:drive-scsi0.img deleted",
            "dir:overlays deleted",
            "backup:drive-scsi0.img unmapped",
        ]
    );
    assert!(residue.is_empty(), "{residue:?}");
    assert!(run.loops().is_empty());
    assert!(!run.lab.root.join("overlays").join(RUN_ID).exists());
    let again = run
        .client
        .cleanup(pb::CleanupRequest {
            run_id: RUN_ID.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        again.resources.is_empty() && again.residue.is_empty(),
        "{again:?}"
    );
    run.stop().await;
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

/// A screendump over `limits.max_screendump_bytes` is removed, journaled and refused with
/// RESOURCE_EXHAUSTED; the run still cleans up to nothing.
#[test]
fn an_oversized_screendump_is_removed_and_refused() {
    if !privileged("an_oversized_screendump_is_removed_and_refused", QEMU_TOOLS) {
        return;
    }
    let netns = Netns::new("shot", &["csbox1", "csbox91", "csbox92"]);
    inside(&netns.name, || async {
        let mut run = Run::begin_configured(
            "shot",
            &[ARCHIVE],
            |_| {},
            sandbox_grant,
            |limits| limits.max_screendump_bytes = 1024,
        )
        .await;
        run.sandbox_vm(9100).await;
        run.client
            .start_vm(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap();
        let refused = run
            .client
            .qmp(pb::QmpRequest {
                vmid: 9100,
                command: pb::QmpCommand::Screendump as i32,
            })
            .await;
        assert_status(
            refused,
            Code::ResourceExhausted,
            "larger than 1024 bytes (limits.max_screendump_bytes); it was removed",
        );
        let screen = run
            .lab
            .root
            .join(format!("overlays/{RUN_ID}/9100-screen.png"));
        assert!(!screen.exists(), "the oversized screendump is gone");
        let journal = run.journal().await;
        for step in [
            "file.screendump file:screendump:9100 failed",
            "file.delete file:screendump:9100 undone",
        ] {
            assert!(
                journal.iter().any(|s| s == step),
                "{step} not in {journal:?}"
            );
        }
        run.end().await;
    });
}

/// Runs one QMP command on `socket` as another QMP client of the node would.
fn qmp_exchange(socket: &std::path::Path, command: &str) {
    use std::io::{BufRead, Write};
    let stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.contains("QMP"), "{line}");
    for execute in ["qmp_capabilities", command] {
        writeln!(writer, "{{\"execute\":\"{execute}\"}}").unwrap();
        loop {
            line.clear();
            reader.read_line(&mut line).unwrap();
            if !line.contains("\"event\"") {
                break;
            }
        }
        assert!(line.contains("\"return\""), "{execute}: {line}");
    }
}

#[test]
fn vm_lifecycle_with_qmp_and_a_real_guest_agent() {
    if !privileged("vm_lifecycle_with_qmp_and_a_real_guest_agent", QEMU_TOOLS) {
        return;
    }
    let netns = Netns::new("vm", &["csbox1", "csbox91", "csbox92"]);
    inside(&netns.name, || async {
        let mut run = Run::begin_with(
            "vm",
            &[ARCHIVE],
            |lab| {
                // The host's qemu-ga answers on the VM's agent socket; it may run exactly the
                // harmless granted program and the read-only calls.
                lab.settings(serde_json::json!({
                    "agent_mode": "host-qemu-ga",
                    "qga_allow_rpcs": ["guest-sync-delimited", "guest-ping", "guest-info", "guest-get-osinfo",
                        "guest-get-host-name", "guest-network-get-interfaces", "guest-get-fsinfo", "guest-exec", "guest-exec-status"],
                }))
            },
            sandbox_grant,
        )
        .await;
        let uuid = run.sandbox_vm(9100).await;

        // The sandbox shape: overlay as qcow2 without backup, empty CD-ROM, agent, isolated NIC,
        // fresh SMBIOS UUID, run marker.
        let conf = run.conf(9100);
        for line in [
            "#certistack-run=0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f",
            "agent: 1",
            "tags: certistack",
            "ide2: none,media=cdrom",
            "cores: 1",
            "cpuunits: 10",
            "memory: 256",
            &format!("smbios1: uuid={uuid}"),
        ] {
            assert!(
                conf.lines().any(|l| l == line),
                "{line:?} missing from\n{conf}"
            );
        }
        let scsi0 = conf.lines().find(|l| l.starts_with("scsi0: ")).unwrap();
        assert!(
            scsi0.contains(&format!("/overlays/{RUN_ID}/9100-drive-scsi0.qcow2,")),
            "{scsi0}"
        );
        for option in ["format=qcow2", "backup=0"] {
            assert!(
                scsi0.split(',').any(|o| o == option),
                "{option} missing: {scsi0}"
            );
        }
        assert!(conf.contains("bridge=csbox1,firewall=0"), "{conf}");

        let started = run
            .client
            .start_vm(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(started.state, pb::VmState::Running as i32);
        assert!(run.qemu_running(9100));
        let status = run
            .client
            .vm_status(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(status.state, pb::VmState::Running as i32);
        assert_eq!(status.qmp_status, "running");

        // qm status prints QEMU's own run state: a guest paused through QMP is reported paused,
        // and one QEMU stopped on an I/O error (set in the double: a disk error cannot be
        // provoked here) is reported as a guest error, which is evidence.
        let qmp_socket = run.lab.root.join("var/run/qemu-server/9100.qmp");
        qmp_exchange(&qmp_socket, "stop");
        let paused = run
            .client
            .vm_status(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(paused.state, pb::VmState::Paused as i32, "{paused:?}");
        assert_eq!(paused.qmp_status, "paused");
        qmp_exchange(&qmp_socket, "cont");
        run.lab
            .settings(serde_json::json!({ "qmp_status": { "9100": "io-error" } }));
        let failed = run
            .client
            .vm_status(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(failed.state, pb::VmState::GuestError as i32, "{failed:?}");
        assert_eq!(failed.qmp_status, "io-error");
        run.lab.settings(serde_json::json!({ "qmp_status": {} }));

        let qmp = |command: pb::QmpCommand| pb::QmpRequest {
            vmid: 9100,
            command: command as i32,
        };
        let reply = run
            .client
            .qmp(qmp(pb::QmpCommand::QueryStatus))
            .await
            .unwrap()
            .into_inner();
        let value: serde_json::Value = serde_json::from_str(&reply.result_json).unwrap();
        assert_eq!(value["status"], "running", "{value}");
        let reply = run
            .client
            .qmp(qmp(pb::QmpCommand::QueryBlock))
            .await
            .unwrap()
            .into_inner();
        assert!(
            reply.result_json.contains("9100-drive-scsi0.qcow2"),
            "the VM runs on the overlay: {}",
            reply.result_json
        );
        // A link planted where the screendump goes is removed, never written through.
        let screen = run
            .lab
            .root
            .join(format!("overlays/{RUN_ID}/9100-screen.png"));
        let victim = run.lab.root.join("screen-victim");
        std::os::unix::fs::symlink(&victim, &screen).unwrap();
        let reply = run
            .client
            .qmp(qmp(pb::QmpCommand::Screendump))
            .await
            .unwrap()
            .into_inner();
        assert!(screen.is_file() && !screen.is_symlink());
        assert!(!victim.exists(), "nothing was written through the link");
        // The reply carries the picture QEMU wrote: a PNG of the console, checked as the
        // controller checks it before it goes beside a report.
        assert_eq!(reply.image_format, "png");
        assert_eq!(reply.image, std::fs::read(&screen).unwrap());
        let shot = certistack_controller::screenshot::screenshot_png(&reply).unwrap();
        assert!(
            shot.width >= 320 && shot.height >= 200,
            "{}x{}",
            shot.width,
            shot.height
        );
        let journal = run.journal().await;
        assert!(
            journal
                .iter()
                .any(|step| step.contains("file.screendump") && step.contains("done")),
            "{journal:?}"
        );

        let qga = |command: pb::QgaCommand| pb::QgaRequest {
            vmid: 9100,
            call: Some(pb::qga_request::Call::Command(command as i32)),
        };
        let reply = run
            .client
            .qga(qga(pb::QgaCommand::Ping))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(reply.result_json, "{}");
        let reply = run
            .client
            .qga(qga(pb::QgaCommand::GetHostName))
            .await
            .unwrap()
            .into_inner();
        assert!(
            reply.result_json.contains("host-name"),
            "{}",
            reply.result_json
        );
        let reply = run
            .client
            .qga(pb::QgaRequest {
                vmid: 9100,
                call: Some(pb::qga_request::Call::AssertionId("restored-echo".into())),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(reply.assertion_passed, "{reply:?}");
        assert_eq!(reply.exit_code, 0);
        assert!(
            reply.result_json.contains("restored ok"),
            "{}",
            reply.result_json
        );

        // While an assertion runs, the agent socket is free between polls: another client (PVE's
        // own agent calls) connects and gets its answer within one poll, not after the program.
        let mut asserting = run.client.clone();
        let slow = tokio::spawn(async move {
            asserting
                .qga(pb::QgaRequest {
                    vmid: 9100,
                    call: Some(pb::qga_request::Call::AssertionId("slow-check".into())),
                })
                .await
        });
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        let qga_socket = run.lab.root.join("var/run/qemu-server/9100.qga");
        let asked = std::time::Instant::now();
        let answered = tokio::task::spawn_blocking(move || {
            agent_answers(&qga_socket, std::time::Duration::from_secs(2))
        })
        .await
        .unwrap();
        let waited = asked.elapsed();
        assert!(
            answered,
            "another agent client got no answer while the assertion ran ({waited:?})"
        );
        assert!(!slow.is_finished(), "the assertion ended before the check");
        let reply = slow.await.unwrap().unwrap().into_inner();
        assert!(reply.assertion_passed, "{reply:?}");

        let stopped = run
            .client
            .stop_vm(pb::StopVmRequest {
                vmid: 9100,
                timeout_seconds: 10,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(stopped.state, pb::VmState::Stopped as i32);
        assert!(!run.qemu_running(9100));
        // The overlay cannot go while its VM exists.
        assert_status(
            run.client
                .delete_overlay(pb::DeleteOverlayRequest {
                    vmid: 9100,
                    archive: ARCHIVE.into(),
                })
                .await,
            Code::FailedPrecondition,
            "still uses",
        );
        let destroyed = run
            .client
            .destroy_vm(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(destroyed.state, pb::VmState::Absent as i32);
        assert!(!run.lab.root.join("etc/pve/qemu-server/9100.conf").exists());
        run.stop().await;
    });
}

#[tokio::test(flavor = "multi_thread")]
async fn vms_the_run_did_not_create_are_never_touched() {
    if !privileged("vms_the_run_did_not_create_are_never_touched", QEMU_TOOLS) {
        return;
    }
    let mut run = Run::begin_with("notours", &[ARCHIVE], |_| {}, sandbox_grant).await;
    // A production VM already uses VMID 9101 (granted by mistake), and 9102 too.
    for vmid in ["9101", "9102"] {
        let out = run.lab.qm(&[
            "create",
            vmid,
            "--name",
            "production",
            "--memory",
            "256",
            "--tags",
            "prod",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let before = run.conf(9101);
    map_and_overlay(&mut run.client, 9101).await;
    assert_status(
        run.client
            .create_vm(pb::CreateVmRequest {
                vmid: 9101,
                cores: 1,
                memory_mib: 256,
                archives: vec![ARCHIVE.into()],
                mirror_source_hardware: false,
            })
            .await,
        Code::AlreadyExists,
        "VM 9101 already exists on this node and is not this run's",
    );
    assert_eq!(
        run.conf(9101),
        before,
        "the existing VM's config is untouched"
    );
    for result in [
        ok(run.client.start_vm(pb::VmRequest { vmid: 9102 }).await),
        ok(run
            .client
            .stop_vm(pb::StopVmRequest {
                vmid: 9102,
                timeout_seconds: 0,
            })
            .await),
        ok(run.client.destroy_vm(pb::VmRequest { vmid: 9102 }).await),
        ok(run
            .client
            .qmp(pb::QmpRequest {
                vmid: 9102,
                command: pb::QmpCommand::QueryStatus as i32,
            })
            .await),
    ] {
        assert_status(
            result,
            Code::FailedPrecondition,
            "VM 9102 was not created by this run",
        );
    }

    // A VM this run created whose marker was removed by someone else is left alone too.
    overlay_and_vm(&mut run.client, 9100).await;
    let conf_path = run.lab.root.join("etc/pve/qemu-server/9100.conf");
    let edited = std::fs::read_to_string(&conf_path)
        .unwrap()
        .replace("#certistack-run=", "#adopted-by-admin=");
    std::fs::write(&conf_path, &edited).unwrap();
    assert_status(
        run.client.destroy_vm(pb::VmRequest { vmid: 9100 }).await,
        Code::FailedPrecondition,
        "is not this run's (its description does not carry this run's marker)",
    );
    let reply = run
        .client
        .cleanup(pb::CleanupRequest {
            run_id: RUN_ID.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let vm = reply
        .resources
        .iter()
        .find(|r| r.resource == "vm:9100")
        .unwrap();
    assert_eq!(vm.end_state, "not this run's, left untouched");
    assert_eq!(std::fs::read_to_string(&conf_path).unwrap(), edited);
    for vmid in ["9100", "9101", "9102"] {
        assert!(
            run.lab
                .root
                .join(format!("etc/pve/qemu-server/{vmid}.conf"))
                .exists(),
            "VM {vmid} was touched"
        );
        run.lab.qm(&["destroy", vmid]);
    }
    run.stop().await;
}

#[test]
fn a_silent_guest_agent_is_a_deadline_not_a_hang() {
    if !privileged("a_silent_guest_agent_is_a_deadline_not_a_hang", QEMU_TOOLS) {
        return;
    }
    let netns = Netns::new("vm", &["csbox1", "csbox91", "csbox92"]);
    inside(&netns.name, || async {
        // QEMU serves the agent socket, but no guest OS runs an agent behind it.
        let mut run = Run::begin_with(
            "silent",
            &[ARCHIVE],
            |lab| lab.settings(serde_json::json!({ "agent_mode": "qemu-chardev" })),
            sandbox_grant,
        )
        .await;
        run.sandbox_vm(9100).await;
        run.client
            .start_vm(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let status = run
            .client
            .qga(pb::QgaRequest {
                vmid: 9100,
                call: Some(pb::qga_request::Call::Command(pb::QgaCommand::Ping as i32)),
            })
            .await
            .unwrap_err();
        let waited = started.elapsed();
        assert_eq!(
            status.code(),
            Code::DeadlineExceeded,
            "{}",
            status.message()
        );
        assert!(
            status.message().contains("the guest agent is not running"),
            "{}",
            status.message()
        );
        assert!(
            waited >= std::time::Duration::from_secs(3)
                && waited < std::time::Duration::from_secs(10),
            "{waited:?}"
        );
        // Cleanup stops and destroys the VM, deletes the overlay and unmaps the backup.
        let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
        assert_eq!(receipts[0], "vm:9100 destroyed", "{receipts:?}");
        assert!(!run.qemu_running(9100));
        // qm's own stop timeout (60 s, then 11 s of SIGTERM/SIGKILL) would outlast the tool
        // timeout (60 s), and qm's worker would outlive a kill at the deadline: the stop
        // always names a timeout that fits.
        let stops: Vec<serde_json::Value> = run
            .lab
            .calls()
            .into_iter()
            .filter(|c| c["argv"][0] == "stop")
            .map(|c| c["argv"].clone())
            .collect();
        assert_eq!(
            stops,
            [serde_json::json!(["stop", "9100", "--timeout", "43"])],
            "{stops:?}"
        );
        run.stop().await;
    });
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

#[tokio::test(flavor = "multi_thread")]
async fn a_step_runs_to_its_end_when_its_caller_goes_away() {
    if !privileged(
        "a_step_runs_to_its_end_when_its_caller_goes_away",
        &["losetup", "python3", "qemu-img"],
    ) {
        return;
    }
    let mut run = Run::begin_with(
        "cut",
        &[ARCHIVE],
        |lab| lab.settings(serde_json::json!({ "delays": { "map": 2.0 } })),
        sandbox_grant,
    )
    .await;
    // The caller gives up after 250 ms; the holder attaches the device about 2 s later.
    assert_cut(
        run.client
            .map_backup(cut(map_request(ARCHIVE, PBS_PASSWORD), 250))
            .await,
    );
    assert!(run.loops().is_empty(), "not attached yet");
    // Cleanup waits for the step, which journals the device it mapped, and unmaps it.
    let started = std::time::Instant::now();
    let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
    assert_eq!(receipts, ["backup:drive-scsi0.img unmapped"]);
    assert!(residue.is_empty(), "{residue:?}");
    assert!(started.elapsed() > std::time::Duration::from_secs(1));
    // Nothing lands after cleanup said it was gone.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert!(run.loops().is_empty(), "{:?}", run.loops());

    // A step retried after a cut finds the recorded outcome.
    assert_cut(
        run.client
            .map_backup(cut(map_request(ARCHIVE, PBS_PASSWORD), 250))
            .await,
    );
    assert_status(
        run.client
            .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
            .await,
        Code::AlreadyExists,
        "already mapped by this run (last step: backup.map done)",
    );
    assert_eq!(run.loops().len(), 1);
    run.client
        .unmap_backup(pb::UnmapBackupRequest {
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
    assert!(run.loops().is_empty());

    // CreateVm cut short: the VM is still created and recorded; StartVm-ready, destroyable.
    run.lab
        .settings(serde_json::json!({ "delays": { "create": 1.5 } }));
    map_and_overlay(&mut run.client, 9100).await;
    let create = || pb::CreateVmRequest {
        vmid: 9100,
        cores: 1,
        memory_mib: 256,
        archives: vec![ARCHIVE.into()],
        mirror_source_hardware: false,
    };
    assert_cut(run.client.create_vm(cut(create(), 250)).await);
    assert_status(
        run.client.create_vm(create()).await,
        Code::AlreadyExists,
        "this run already created VM 9100",
    );
    assert!(run.lab.root.join("etc/pve/qemu-server/9100.conf").exists());
    let destroyed = run
        .client
        .destroy_vm(pb::VmRequest { vmid: 9100 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(destroyed.state, pb::VmState::Absent as i32);
    // Asked again after DestroyVm, the VM is gone, not "not this run's".
    let status = run
        .client
        .vm_status(pb::VmRequest { vmid: 9100 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.state, pb::VmState::Absent as i32);
    assert_status(
        run.client.start_vm(pb::VmRequest { vmid: 9100 }).await,
        Code::NotFound,
        "VM 9100 was destroyed by this run",
    );
    run.end().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_writable_mapping_of_the_runs_own_name_is_unmapped_by_cleanup() {
    if !privileged(
        "a_writable_mapping_of_the_runs_own_name_is_unmapped_by_cleanup",
        &["losetup", "python3"],
    ) {
        return;
    }
    let mut run = Run::begin_with(
        "writable",
        &[ARCHIVE],
        |lab| lab.settings(serde_json::json!({ "map_writable": true })),
        |_| {},
    )
    .await;
    assert_status(
        run.client
            .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
            .await,
        Code::FailedPrecondition,
        "is writable; a backup must be mapped read-only",
    );
    assert_eq!(run.loops().len(), 1, "the refused mapping is still there");
    let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
    assert_eq!(receipts, ["backup:drive-scsi0.img unmapped"]);
    assert!(residue.is_empty(), "{residue:?}");
    assert!(run.loops().is_empty());
    run.end().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mapping_on_a_loop_device_above_255_is_unmapped_by_name() {
    if !privileged(
        "a_mapping_on_a_loop_device_above_255_is_unmapped_by_name",
        &["losetup", "python3"],
    ) {
        return;
    }
    let first = 300 + std::process::id() % 500;
    let mut run = Run::begin_with(
        "loop256",
        &[ARCHIVE],
        |lab| lab.settings(serde_json::json!({ "loop_device_min": first })),
        |_| {},
    )
    .await;
    let device = run
        .client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap()
        .into_inner()
        .loop_device;
    let number: u32 = device.trim_start_matches("/dev/loop").parse().unwrap();
    assert!(number >= 256, "{device}");
    assert_eq!(run.loops().len(), 1);
    // `unmap /dev/loopN` cannot name it (N is read as a u8); the mapping name can.
    run.client
        .unmap_backup(pb::UnmapBackupRequest {
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
    assert!(run.loops().is_empty(), "{device} unmapped");
    run.end().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_vm_that_cannot_be_destroyed_keeps_everything_beneath_it() {
    if !privileged(
        "a_vm_that_cannot_be_destroyed_keeps_everything_beneath_it",
        &["losetup", "python3", "qemu-img"],
    ) {
        return;
    }
    let mut run = Run::begin_with("keep", &[ARCHIVE], |_| {}, sandbox_grant).await;
    map_overlay_and_vm(&mut run.client, 9100).await;
    run.lab
        .settings(serde_json::json!({ "failures": { "destroy": "VM 9100 is locked (backup)" } }));
    let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
    assert!(
        receipts[0].starts_with("vm:9100 failed: qm destroy 9100 failed"),
        "{receipts:?}"
    );
    let kept = "failed: kept while a VM of the run remains (VM 9100 could not be destroyed)";
    assert_eq!(
        &receipts[1..],
        [
            format!("overlay:9100:drive-scsi0.img {kept}"),
            format!("dir:overlays {kept}"),
            format!("backup:drive-scsi0.img {kept}"),
        ]
    );
    assert!(!residue.is_empty());
    let overlay = run
        .lab
        .root
        .join(format!("overlays/{RUN_ID}/9100-drive-scsi0.qcow2"));
    assert!(overlay.exists(), "the overlay beneath the VM stays");
    assert_eq!(
        run.loops().len(),
        1,
        "the mapping beneath the overlay stays"
    );
    // Once the VM can be destroyed, the next Cleanup removes everything.
    run.lab.settings(serde_json::json!({ "failures": {} }));
    run.end().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn run_files_are_created_only_in_checked_directories_and_never_through_links() {
    if !privileged(
        "run_files_are_created_only_in_checked_directories_and_never_through_links",
        &["losetup", "python3", "qemu-img"],
    ) {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let mut run = Run::begin("perm", &[ARCHIVE]).await;
    run.client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap();
    let root = run.lab.root.join("overlays");
    let create = || pb::CreateOverlayRequest {
        vmid: VMID,
        archive: ARCHIVE.into(),
    };
    std::fs::create_dir_all(&root).unwrap();
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o775)).unwrap();
    assert_status(
        run.client.create_overlay(create()).await,
        Code::FailedPrecondition,
        "is writable by its group or others (mode 775); make it a directory owned by root",
    );
    assert!(!root.join(RUN_ID).exists());
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
    // A link planted where the overlay will be: never followed, never written through.
    let dir = root.join(RUN_ID);
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let target = run.lab.root.join("victim");
    let planted = dir.join(format!("{VMID}-drive-scsi0.qcow2"));
    std::os::unix::fs::symlink(&target, &planted).unwrap();
    assert_status(
        run.client.create_overlay(create()).await,
        Code::AlreadyExists,
        "already exists; it was not created by this call",
    );
    assert!(!target.exists(), "nothing was written through the link");
    std::fs::remove_file(&planted).unwrap();
    // A run directory others can write to is refused too.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).unwrap();
    assert_status(
        run.client.create_overlay(create()).await,
        Code::FailedPrecondition,
        "is writable by its group or others (mode 770)",
    );
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    run.client.create_overlay(create()).await.unwrap();
    assert!(planted.is_file() && !planted.is_symlink());
    run.end().await;
}

fn ok<T>(result: Result<T, tonic::Status>) -> Result<(), tonic::Status> {
    result.map(|_| ())
}

// ------------------------------------------------------------------------------------------
// Crash matrix: kill -9 the daemon at each step, restart it, recover, and find zero residue.

mod crash {
    use super::*;
    use std::path::{Path, PathBuf};
    use std::process::{Child, Command, Stdio};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Step {
        AfterMap,
        AfterOverlay,
        AfterCreate,
        AfterStart,
        WhileQgaWaits,
        DuringCleanup,
    }

    struct Daemon {
        child: Child,
    }

    impl Daemon {
        fn start(config: &Path) -> Self {
            let child = Command::new(binary("certistack-connector"))
                .args(["--config", config.to_str().unwrap()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            Self { child }
        }

        fn kill9(&mut self) {
            self.child.kill().unwrap(); // SIGKILL
            self.child.wait().unwrap();
        }
    }

    impl Drop for Daemon {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// Processes whose command line mentions `needle` (QEMU and agents of this lab).
    fn processes_mentioning(needle: &str) -> Vec<String> {
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .filter(|c| c.contains(needle) && !c.contains("certistack-connector"))
            .collect()
    }

    fn files_containing(dir: &Path, needle: &[u8], found: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if kind.is_dir() {
                files_containing(&path, needle, found);
            } else if kind.is_file()
                && let Ok(bytes) = std::fs::read(&path)
                && bytes.windows(needle.len()).any(|w| w == needle)
            {
                found.push(path);
            }
        }
    }

    /// Everything of the run that could be left on the node.
    fn residue(lab: &Lab, state_dir: &Path) -> Vec<String> {
        let mut residue: Vec<String> = loops_under(&lab.root)
            .into_iter()
            .map(|(d, b)| format!("loop {d} -> {}", b.display()))
            .collect();
        // This thread's network namespace: the sandbox table and the probe address.
        let tables = Command::new("nft")
            .args(["list", "tables"])
            .output()
            .unwrap();
        if String::from_utf8_lossy(&tables.stdout).contains("certistack_") {
            residue.push("nftables table".into());
        }
        let addresses = Command::new("ip")
            .args(["-brief", "address", "show", "dev", "csbox1"])
            .output()
            .unwrap();
        if String::from_utf8_lossy(&addresses.stdout).contains("198.51.100.2") {
            residue.push("probe address".into());
        }
        if lab.root.join("overlays").join(RUN_ID).exists() {
            residue.push("overlay directory".into());
        }
        if lab.root.join("etc/pve/qemu-server/9100.conf").exists() {
            residue.push("VM 9100 config".into());
        }
        residue.extend(
            processes_mentioning(lab.root.to_str().unwrap())
                .into_iter()
                .map(|p| format!("process {p}")),
        );
        let mut secrets = Vec::new();
        files_containing(&lab.root, PBS_PASSWORD.as_bytes(), &mut secrets);
        files_containing(state_dir, PBS_PASSWORD.as_bytes(), &mut secrets);
        // The double's own settings hold the expected password, as a PBS server would.
        secrets.retain(|p| !p.ends_with("double.json"));
        residue.extend(
            secrets
                .into_iter()
                .map(|p| format!("secret in {}", p.display())),
        );
        residue
    }

    /// The daemon is killed while PrepareSandbox's `ip address add` / `nft -f` (slowed by a
    /// wrapper that sleeps, then runs the real tool) is still running, and restarted at once.
    pub async fn run_interrupted_network_tool() {
        let lab = Lab::new("slowtool");
        let authority_dir = TempDir::new("slowtool-ctl");
        let authority = controller(&authority_dir.0);
        let mut config = lab.node_config(&authority, &lab.root.join("node"));
        let wrappers = lab.root.join("slow-bin");
        std::fs::create_dir_all(&wrappers).unwrap();
        for (name, real, slow_when) in [
            ("nft", "/usr/sbin/nft", r#"[ "$1" = "-f" ]"#),
            ("ip", "/usr/sbin/ip", r#"[ "$1 $2" = "address add" ]"#),
        ] {
            let path = wrappers.join(name);
            std::fs::write(
                &path,
                format!("#!/bin/sh\nif {slow_when}; then sleep 3; fi\nexec {real} \"$@\"\n"),
            )
            .unwrap();
            std::fs::set_permissions(
                &path,
                <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755),
            )
            .unwrap();
        }
        config.tools.nft = wrappers.join("nft");
        config.tools.ip = wrappers.join("ip");
        let port = free_local_port();
        let config_path = lab.root.join("node/connector.toml");
        write_config_file(&config_path, &config, port);
        let address = format!("127.0.0.1:{port}");
        let mut wire = grant(RUN_ID, NODE);
        sandbox_grant(&mut wire);
        let credentials = mint(&authority, &wire);
        let operator = authority.issue_operator("recovery", now()).unwrap();

        let mut daemon = Daemon::start(&config_path);
        let mut c = client_when_up(&authority, &address, &credentials.certificate).await;
        c.begin_run(begin_request(&credentials)).await.unwrap();
        let prepare = || pb::PrepareSandboxRequest {
            vnet: VNET.into(),
            probe_source: PROBE_SOURCE.into(),
        };
        // A caller that gives up mid-step leaves no unknown outcome: the step completes, and
        // ReleaseSandbox, waiting for it, removes what it installed.
        assert_cut(c.prepare_sandbox(cut(prepare(), 250)).await);
        c.release_sandbox(pb::ReleaseSandboxRequest { vnet: VNET.into() })
            .await
            .unwrap();
        let left = residue(&lab, &config.paths.state_dir);
        assert!(left.is_empty(), "{left:?}");

        let mut preparing = c.clone();
        let call = tokio::spawn(async move { preparing.prepare_sandbox(prepare()).await });
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        daemon.kill9();
        let _ = call.await.unwrap();
        let needle = wrappers.display().to_string();
        assert!(
            !processes_mentioning(&needle).is_empty(),
            "a slowed tool outlived the daemon"
        );

        let _daemon = Daemon::start(&config_path);
        let mut op = client_when_up(&authority, &address, &operator).await;
        let (_, reported) = cleanup_receipts(&mut op, RUN_ID).await;
        assert!(reported.is_empty(), "{reported:?}");
        // Wait past the slowed tool: nothing lands after cleanup said it was gone.
        tokio::time::sleep(std::time::Duration::from_secs(4)).await;
        let left = residue(&lab, &config.paths.state_dir);
        assert!(left.is_empty(), "{left:?}");
        assert!(processes_mentioning(&needle).is_empty());

        // The node holds something named for the run the journal does not know: EndRun
        // refuses until Cleanup removed it.
        let table: String = RUN_ID.chars().filter(char::is_ascii_hexdigit).collect();
        let table = format!("certistack_{table}");
        let added = Command::new("nft")
            .args(["add", "table", "inet", &table])
            .status()
            .unwrap();
        assert!(added.success());
        let mut c = client_when_up(&authority, &address, &credentials.certificate).await;
        assert_status(
            c.end_run(pb::EndRunRequest {}).await,
            Code::FailedPrecondition,
            "run Cleanup first",
        );
        let (receipts, reported) = cleanup_receipts(&mut op, RUN_ID).await;
        assert!(reported.is_empty(), "{reported:?}");
        assert!(
            receipts.contains(&format!("nft:{table} deleted")),
            "{receipts:?}"
        );
        c.end_run(pb::EndRunRequest {}).await.unwrap();
    }

    /// The daemon dies while `qm create`'s worker (slowed in the double) has written only its
    /// `lock: create` claim; the restarted daemon kills qm and its worker, and Cleanup removes
    /// the claim (`qm unlock`, `qm destroy`). A claim on a VMID the run never journaled is
    /// never touched.
    pub async fn run_create_cut_short() {
        let lab = Lab::new("claim");
        lab.add_backup(SNAPSHOT, ARCHIVE, MARKER, 8 << 20);
        lab.settings(serde_json::json!({ "delays": { "create-worker": 30 } }));
        let authority_dir = TempDir::new("claim-ctl");
        let authority = controller(&authority_dir.0);
        let config = lab.node_config(&authority, &lab.root.join("node"));
        let port = free_local_port();
        let config_path = lab.root.join("node/connector.toml");
        write_config_file(&config_path, &config, port);
        let address = format!("127.0.0.1:{port}");
        let mut wire = grant(RUN_ID, NODE);
        sandbox_grant(&mut wire);
        let credentials = mint(&authority, &wire);
        let operator = authority.issue_operator("recovery", now()).unwrap();

        let mut daemon = Daemon::start(&config_path);
        let mut c = client_when_up(&authority, &address, &credentials.certificate).await;
        c.begin_run(begin_request(&credentials)).await.unwrap();
        map_and_overlay(&mut c, 9100).await;
        let mut creating = c.clone();
        let call = tokio::spawn(async move {
            creating
                .create_vm(pb::CreateVmRequest {
                    vmid: 9100,
                    cores: 1,
                    memory_mib: 256,
                    archives: vec![ARCHIVE.into()],
                    mirror_source_hardware: false,
                })
                .await
        });
        let conf = lab.root.join("etc/pve/qemu-server/9100.conf");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::fs::read_to_string(&conf).ok().as_deref() != Some("lock: create\n") {
            assert!(std::time::Instant::now() < deadline, "no claim written");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        daemon.kill9();
        assert!(call.await.unwrap().is_err());
        assert!(
            lab.calls()
                .iter()
                .any(|c| c["event"] == "worker" && c["task"] == "qmcreate"),
            "qm create runs its task in a worker"
        );
        // Someone else's create, cut short the same way, on a VMID the run never used.
        let foreign = lab.root.join("etc/pve/qemu-server/9101.conf");
        std::fs::write(&foreign, "lock: create\n").unwrap();

        let _daemon = Daemon::start(&config_path);
        let mut op = client_when_up(&authority, &address, &operator).await;
        let (receipts, reported) = cleanup_receipts(&mut op, RUN_ID).await;
        assert!(reported.is_empty(), "{receipts:?} {reported:?}");
        assert!(
            receipts.contains(&"vm:9100 destroyed".to_owned()),
            "{receipts:?}"
        );
        assert!(!conf.exists(), "the claim is gone");
        assert_eq!(std::fs::read_to_string(&foreign).unwrap(), "lock: create\n");
        let steps = journal_steps(&mut op, RUN_ID).await;
        for step in ["vm.unlock vm:9100 done", "vm.destroy vm:9100 undone"] {
            assert!(
                steps.iter().any(|s| s.starts_with(step)),
                "{step}: {steps:?}"
            );
        }
        let left = residue(&lab, &config.paths.state_dir);
        assert!(left.is_empty(), "{left:?}");
        std::fs::remove_file(&foreign).unwrap();
    }

    pub async fn run_case(step: Step) {
        let lab = Lab::new("crash");
        lab.add_backup(SNAPSHOT, ARCHIVE, MARKER, 8 << 20);
        lab.settings(serde_json::json!({ "agent_mode": "qemu-chardev" }));
        if step == Step::DuringCleanup {
            // A slow `qm stop`, so the daemon dies with the stop under way.
            lab.settings(serde_json::json!({ "delays": { "stop": 2.0 } }));
        }
        let authority_dir = TempDir::new("crash-ctl");
        let authority = controller(&authority_dir.0);
        let config = lab.node_config(&authority, &lab.root.join("node"));
        let port = free_local_port();
        let config_path = lab.root.join("node/connector.toml");
        let mut config = config;
        config.limits.guest_timeout_secs = 60;
        write_config_file(&config_path, &config, port);
        let address = format!("127.0.0.1:{port}");

        let mut wire = grant(RUN_ID, NODE);
        sandbox_grant(&mut wire);
        let credentials = mint(&authority, &wire);
        let operator = authority.issue_operator("recovery", now()).unwrap();

        let mut daemon = Daemon::start(&config_path);
        let mut c = client_when_up(&authority, &address, &credentials.certificate).await;
        c.begin_run(begin_request(&credentials)).await.unwrap();
        c.map_backup(map_request(ARCHIVE, PBS_PASSWORD))
            .await
            .unwrap();
        if step != Step::AfterMap {
            c.create_overlay(pb::CreateOverlayRequest {
                vmid: 9100,
                archive: ARCHIVE.into(),
            })
            .await
            .unwrap();
        }
        if !matches!(step, Step::AfterMap | Step::AfterOverlay) {
            c.create_vm(pb::CreateVmRequest {
                vmid: 9100,
                cores: 1,
                memory_mib: 256,
                archives: vec![ARCHIVE.into()],
                mirror_source_hardware: false,
            })
            .await
            .unwrap();
        }
        if matches!(
            step,
            Step::AfterStart | Step::WhileQgaWaits | Step::DuringCleanup
        ) {
            c.prepare_sandbox(pb::PrepareSandboxRequest {
                vnet: VNET.into(),
                probe_source: PROBE_SOURCE.into(),
            })
            .await
            .unwrap();
            c.start_vm(pb::VmRequest { vmid: 9100 }).await.unwrap();
        }
        match step {
            Step::WhileQgaWaits => {
                // The agent never answers; the daemon dies while the call waits.
                let mut waiting = c.clone();
                let call = tokio::spawn(async move {
                    waiting
                        .qga(pb::QgaRequest {
                            vmid: 9100,
                            call: Some(pb::qga_request::Call::Command(pb::QgaCommand::Ping as i32)),
                        })
                        .await
                });
                tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
                daemon.kill9();
                assert!(
                    call.await.unwrap().is_err(),
                    "the waiting call ends with the daemon"
                );
            }
            Step::DuringCleanup => {
                let mut cleaning = c.clone();
                let call = tokio::spawn(async move {
                    cleaning
                        .cleanup(pb::CleanupRequest {
                            run_id: RUN_ID.into(),
                        })
                        .await
                });
                // Cleanup stops the VM first: die while `qm stop` runs.
                tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
                daemon.kill9();
                let _ = call.await.unwrap();
            }
            _ => daemon.kill9(),
        }
        let state_dir = config.paths.state_dir.clone();
        assert!(
            !residue(&lab, &state_dir).is_empty(),
            "{step:?}: the step left nothing to recover"
        );
        let journal_path = state_dir.join("runs").join(RUN_ID).join("journal");
        if step == Step::DuringCleanup {
            let journal = std::fs::read_to_string(&journal_path).unwrap();
            assert!(
                journal
                    .lines()
                    .last()
                    .unwrap()
                    .contains("\"op\":\"vm.stop\",\"resource\":\"vm:9100\",\"phase\":\"intent\""),
                "{journal}"
            );
        }
        if step == Step::AfterOverlay {
            // The crash also tore the record being written.
            let mut file = std::fs::OpenOptions::new()
                .append(true)
                .open(&journal_path)
                .unwrap();
            std::io::Write::write_all(
                &mut file,
                b"5d41402abc4b2a76 0000 {\"seq\":9,\"op\":\"vm.cre",
            )
            .unwrap();
        }

        // Restart and recover as an operator would.
        let _daemon = Daemon::start(&config_path);
        let mut op = client_when_up(&authority, &address, &operator).await;
        let runs = op
            .list_runs(pb::ListRunsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .runs;
        assert_eq!(runs.len(), 1, "{step:?}");
        assert_eq!(runs[0].state, pb::RunState::Open as i32, "{step:?}");
        let reply = op
            .cleanup(pb::CleanupRequest {
                run_id: RUN_ID.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(reply.residue.is_empty(), "{step:?}: {:?}", reply.residue);
        assert!(
            reply
                .resources
                .iter()
                .all(|r| !r.end_state.starts_with("failed")),
            "{step:?}: {:?}",
            reply.resources
        );
        let left = residue(&lab, &state_dir);
        assert!(
            left.is_empty(),
            "{step:?}: residue after recovery: {left:?}"
        );
        let runs = op
            .list_runs(pb::ListRunsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .runs;
        assert!(
            runs[0].open_resources.is_empty(),
            "{step:?}: {:?}",
            runs[0].open_resources
        );

        // The journal tells the story: the steps, then the recovery.
        let mut stream = op
            .read_journal(pb::ReadJournalRequest {
                run_id: RUN_ID.into(),
            })
            .await
            .unwrap()
            .into_inner();
        let mut ops = Vec::new();
        while let Some(record) = stream.message().await.unwrap() {
            ops.push(format!("{} {}", record.operation, record.phase));
        }
        assert_eq!(
            ops.last().map(String::as_str),
            Some("run.cleanup done"),
            "{step:?}: {ops:?}"
        );
        assert!(
            ops.contains(&"backup.unmap undone".to_owned()),
            "{step:?}: {ops:?}"
        );
        if step == Step::AfterOverlay {
            assert!(
                ops.contains(&"journal.torn-tail done".to_owned()),
                "{ops:?}"
            );
            let preserved = state_dir.join("runs").join(RUN_ID).join("journal.torn.1");
            assert!(std::fs::read(preserved).unwrap().ends_with(b"vm.cre"));
        }
        eprintln!("crash {step:?}: recovered; journal: {}", ops.join(", "));
    }
}

#[test]
fn crash_matrix_kill_9_restart_recover_zero_residue() {
    if !privileged(
        "crash_matrix_kill_9_restart_recover_zero_residue",
        QEMU_TOOLS,
    ) {
        return;
    }
    let netns = Netns::new("vm", &["csbox1", "csbox91", "csbox92"]);
    inside(&netns.name, || async {
        let _serial = SERIAL.lock().await;
        for step in [
            crash::Step::AfterMap,
            crash::Step::AfterOverlay,
            crash::Step::AfterCreate,
            crash::Step::AfterStart,
            crash::Step::WhileQgaWaits,
            crash::Step::DuringCleanup,
        ] {
            crash::run_case(step).await;
        }
    });
}

#[test]
fn a_qm_create_cut_short_leaves_a_claim_that_cleanup_removes() {
    if !privileged(
        "a_qm_create_cut_short_leaves_a_claim_that_cleanup_removes",
        &["losetup", "python3", "qemu-img"],
    ) {
        return;
    }
    let netns = Netns::new("claim", &["csbox1"]);
    inside(&netns.name, || async {
        let _serial = SERIAL.lock().await;
        crash::run_create_cut_short().await;
    });
}

#[test]
fn a_tool_that_outlives_the_daemon_never_lands_after_cleanup() {
    if !privileged(
        "a_tool_that_outlives_the_daemon_never_lands_after_cleanup",
        &["nft", "ip", "python3"],
    ) {
        return;
    }
    let netns = Netns::new("slow", &["csbox1"]);
    inside(&netns.name, || async {
        let _serial = SERIAL.lock().await;
        crash::run_interrupted_network_tool().await;
    });
}

#[test]
fn one_runs_wait_does_not_block_another_run() {
    if !privileged("one_runs_wait_does_not_block_another_run", QEMU_TOOLS) {
        return;
    }
    let netns = Netns::new("vm", &["csbox1", "csbox91", "csbox92"]);
    inside(&netns.name, || async {
        let _serial = SERIAL.lock().await;
        let lab = Lab::new("concurrent");
        lab.add_backup(SNAPSHOT, ARCHIVE, MARKER, 8 << 20);
        lab.add_backup(SNAPSHOT, "drive-scsi1.img", MARKER, 8 << 20);
        lab.settings(serde_json::json!({ "agent_mode": "qemu-chardev" }));
        let authority_dir = TempDir::new("concurrent-ctl");
        let authority = controller(&authority_dir.0);
        let mut config = lab.node_config(&authority, &lab.root.join("node"));
        config.limits.guest_timeout_secs = 4;
        let (address, shutdown, task) = serve_node(config).await;

        let begin = |run_id: &str, archive: &str, vmid: u32| {
            let mut wire = grant(run_id, NODE);
            wire.archives = vec![archive.to_owned()];
            wire.sandbox_vms = vec![pb::SandboxVm {
                vmid,
                max_cores: 1,
                max_memory_mib: 256,
            }];
            wire.vnet = format!("csbox{}", vmid / 100);
            mint(&authority, &wire)
        };
        let run_a = begin(RUN_ID, ARCHIVE, 9100);
        let run_b = begin(
            "11111111-2222-4333-8444-555555555555",
            "drive-scsi1.img",
            9200,
        );
        let mut a = client(&authority, &address, NODE, &run_a.certificate)
            .await
            .unwrap();
        let mut b = client(&authority, &address, NODE, &run_b.certificate)
            .await
            .unwrap();
        a.begin_run(begin_request(&run_a)).await.unwrap();
        b.begin_run(begin_request(&run_b)).await.unwrap();

        map_overlay_and_vm(&mut a, 9100).await;
        a.prepare_sandbox(pb::PrepareSandboxRequest {
            vnet: "csbox91".into(),
            probe_source: PROBE_SOURCE.into(),
        })
        .await
        .unwrap();
        a.start_vm(pb::VmRequest { vmid: 9100 }).await.unwrap();
        // Run A holds its run lock while its agent call waits for an answer that never comes.
        let mut waiting = a.clone();
        let waiter = tokio::spawn(async move {
            waiting
                .qga(pb::QgaRequest {
                    vmid: 9100,
                    call: Some(pb::qga_request::Call::Command(pb::QgaCommand::Ping as i32)),
                })
                .await
        });
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;

        let started = std::time::Instant::now();
        let mut request = map_request("drive-scsi1.img", PBS_PASSWORD);
        request.snapshot = SNAPSHOT.into();
        b.map_backup(request).await.unwrap();
        b.create_overlay(pb::CreateOverlayRequest {
            vmid: 9200,
            archive: "drive-scsi1.img".into(),
        })
        .await
        .unwrap();
        b.cleanup(pb::CleanupRequest {
            run_id: "11111111-2222-4333-8444-555555555555".into(),
        })
        .await
        .unwrap();
        let b_took = started.elapsed();
        assert!(
            !waiter.is_finished(),
            "run A's call should still be waiting"
        );
        assert!(
            b_took < std::time::Duration::from_secs(3),
            "run B waited for run A: {b_took:?}"
        );

        let status = waiter.await.unwrap().unwrap_err();
        assert_eq!(status.code(), Code::DeadlineExceeded);
        let reply = a
            .cleanup(pb::CleanupRequest {
                run_id: RUN_ID.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(reply.residue.is_empty(), "{:?}", reply.residue);
        a.end_run(pb::EndRunRequest {}).await.unwrap();
        b.end_run(pb::EndRunRequest {}).await.unwrap();
        assert!(loops_under(&lab.root).is_empty());
        let _ = shutdown.send(());
        task.await.unwrap();
        eprintln!(
            "run B's map + overlay + cleanup took {b_took:?} while run A waited on its agent"
        );
    });
}

#[tokio::test(flavor = "multi_thread")]
async fn an_encryption_key_reaches_the_client_without_touching_disk() {
    if !privileged(
        "an_encryption_key_reaches_the_client_without_touching_disk",
        &["losetup", "python3"],
    ) {
        return;
    }
    let mut run = Run::begin("keyfile", &[ARCHIVE]).await;
    let key =
        br#"{"kdf":null,"created":"2026-11-01T02:00:00Z","data":"c2VjcmV0LWtleS1tYXRlcmlhbA=="}"#
            .to_vec();
    let mut request = map_request(ARCHIVE, PBS_PASSWORD);
    request.encryption_key = key.clone();
    run.client.map_backup(request).await.unwrap();
    let calls = run.lab.calls();
    let map_call = calls.iter().find(|c| c["command"] == "map").unwrap();
    let argv: Vec<String> = serde_json::from_value(map_call["argv"].clone()).unwrap();
    assert_eq!(&argv[argv.len() - 2..], ["--keyfile", "/proc/self/fd/4"]);
    let result = calls.iter().find(|c| c.get("keyfile").is_some()).unwrap();
    assert_eq!(result["keyfile"]["size"], key.len(), "{result}");
    // Nothing under the lab or the node's state holds the key material.
    let needle = b"c2VjcmV0LWtleS1tYXRlcmlhbA";
    let mut found = Vec::new();
    for dir in [run.lab.root.clone()] {
        let mut stack = vec![dir];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap().flatten() {
                let path = entry.path();
                if entry.file_type().unwrap().is_dir() {
                    stack.push(path);
                } else if std::fs::read(&path)
                    .is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle))
                {
                    found.push(path);
                }
            }
        }
    }
    assert!(found.is_empty(), "key material on disk: {found:?}");
    run.stop().await;
}

#[test]
fn a_guest_boots_only_on_a_prepared_sandbox() {
    if !privileged("a_guest_boots_only_on_a_prepared_sandbox", QEMU_TOOLS) {
        return;
    }
    let netns = Netns::new("boot", &["csbox1"]);
    inside(&netns.name, || async {
        let mut run = Run::begin_with("boot", &[ARCHIVE], |_| {}, sandbox_grant).await;
        map_overlay_and_vm(&mut run.client, 9100).await;
        assert_status(
            run.client.start_vm(pb::VmRequest { vmid: 9100 }).await,
            Code::FailedPrecondition,
            "VM 9100 may boot only on a prepared sandbox: call PrepareSandbox for csbox1 first",
        );
        assert!(!run.qemu_running(9100));
        let prepare = || pb::PrepareSandboxRequest {
            vnet: VNET.into(),
            probe_source: PROBE_SOURCE.into(),
        };
        run.client.prepare_sandbox(prepare()).await.unwrap();
        assert_status(
            run.client.prepare_sandbox(prepare()).await,
            Code::AlreadyExists,
            "already prepared",
        );
        // A link stacked on the VNet after PrepareSandbox is caught by the re-check before boot.
        run_ip(&[
            "link", "add", "link", "csbox1", "name", "mvl9", "type", "macvlan", "mode", "bridge",
        ]);
        assert_status(
            run.client.start_vm(pb::VmRequest { vmid: 9100 }).await,
            Code::FailedPrecondition,
            "VNet csbox1 is no longer isolated, so no guest may boot on it: link mvl9 (on csbox1) is stacked on the VNet",
        );
        assert!(!run.qemu_running(9100));
        run_ip(&["link", "del", "mvl9"]);
        run.client
            .start_vm(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap();
        assert!(run.qemu_running(9100));
        // The containment cannot be removed from under a guest.
        assert_status(
            run.client
                .release_sandbox(pb::ReleaseSandboxRequest { vnet: VNET.into() })
                .await,
            Code::FailedPrecondition,
            "vm:9100 still exists on the sandbox; destroy it before releasing csbox1",
        );
        let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
        assert_eq!(receipts[0], "vm:9100 destroyed", "{receipts:?}");
        assert!(
            receipts
                .contains(&"nft:certistack_0f0e1c2d3b4a4c5d8e6f7a8b9c0d1e2f deleted".to_owned()),
            "{receipts:?}"
        );
        assert!(
            receipts.contains(&"addr:csbox1 deleted".to_owned()),
            "{receipts:?}"
        );
        assert!(!run.qemu_running(9100));
        run.stop().await;
    });
}

/// Cleanup retried on a run that has nothing left (as the expiry reaper retries a run) does
/// not journal the same finding again: the journal records changes, not a heartbeat.
#[tokio::test(flavor = "multi_thread")]
async fn a_repeated_cleanup_finding_is_journaled_once() {
    if !privileged(
        "a_repeated_cleanup_finding_is_journaled_once",
        &["losetup", "python3"],
    ) {
        return;
    }
    let mut run = Run::begin("cleanup-once", &[ARCHIVE]).await;
    run.client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap();
    for _ in 0..4 {
        let (_, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
    }
    let cleanups: Vec<String> = run
        .journal()
        .await
        .into_iter()
        .filter(|step| step.starts_with("run.cleanup"))
        .collect();
    // The first undid the mapping; the second found nothing; the third and fourth found the
    // same nothing.
    assert_eq!(cleanups.len(), 2, "{cleanups:?}");
    run.stop().await;
}

/// StopVm is admitted into the journal's cleanup reserve, so a run's own certificate can spend
/// that reserve on repeated stops; the VM, its overlay and its mapping must still be removable.
#[tokio::test(flavor = "multi_thread")]
async fn repeated_stops_cannot_spend_the_reserve_cleanup_needs() {
    if !privileged(
        "repeated_stops_cannot_spend_the_reserve_cleanup_needs",
        &["losetup", "python3", "qemu-img"],
    ) {
        return;
    }
    let serial = SERIAL.lock().await;
    let lab = Lab::new("stop-flood");
    lab.add_backup(SNAPSHOT, ARCHIVE, MARKER, 8 << 20);
    let authority_dir = TempDir::new("stop-flood-ctl");
    let authority = controller(&authority_dir.0);
    let mut config = lab.node_config(&authority, &lab.root.join("node"));
    config.limits.max_journal_records = 1000;
    let (address, shutdown, task) = serve_node(config).await;
    let mut wire = grant(RUN_ID, NODE);
    wire.archives = vec![ARCHIVE.into()];
    sandbox_grant(&mut wire);
    let credentials = mint(&authority, &wire);
    let mut client = client(&authority, &address, NODE, &credentials.certificate)
        .await
        .unwrap();
    client.begin_run(begin_request(&credentials)).await.unwrap();
    let mut run = Run {
        lab,
        client,
        address,
        shutdown: Some(shutdown),
        task: Some(task),
        _authority_dir: authority_dir,
        _serial: serial,
    };
    run.client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap();
    run.client
        .create_overlay(pb::CreateOverlayRequest {
            vmid: 9100,
            archive: ARCHIVE.into(),
        })
        .await
        .unwrap();
    run.client
        .create_vm(pb::CreateVmRequest {
            vmid: 9100,
            cores: 1,
            memory_mib: 256,
            archives: vec![ARCHIVE.into()],
            mirror_source_hardware: false,
        })
        .await
        .unwrap();
    let mut refused = None;
    for _ in 0..400 {
        if let Err(status) = run
            .client
            .stop_vm(pb::StopVmRequest {
                vmid: 9100,
                timeout_seconds: 0,
            })
            .await
        {
            refused = Some(status);
            break;
        }
    }
    let refused = refused.expect("repeated StopVm was never refused");
    eprintln!("StopVm refused: {refused:?}");
    // What the run holds must still come off the node.
    run.end().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mapping_whose_holder_was_killed_is_refused_before_boot_and_overlay() {
    if !privileged(
        "a_mapping_whose_holder_was_killed_is_refused_before_boot_and_overlay",
        &["losetup", "python3", "qemu-img"],
    ) {
        return;
    }
    let mut run = Run::begin_with("deadholder", &[ARCHIVE], |_| {}, sandbox_grant).await;
    map_overlay_and_vm(&mut run.client, 9100).await;
    let pid_files: Vec<std::path::PathBuf> =
        std::fs::read_dir(run.lab.root.join("run/pbs-loopdev"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "pid"))
            .collect();
    assert_eq!(pid_files.len(), 1, "{pid_files:?}");
    let holder: i32 = std::fs::read_to_string(&pid_files[0])
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let before = run.loops();
    // Direct reads from the device, past any cache: the holder serves them.
    let read_device = |device: &str| {
        std::process::Command::new("dd")
            .args([
                &format!("if={device}"),
                "bs=4096",
                "count=1",
                "iflag=direct",
                "status=none",
            ])
            .output()
            .unwrap()
    };
    let served = read_device(&before[0].0);
    assert!(served.status.success() && served.stdout.starts_with(MARKER));
    // SIGKILL: the holder cannot clean up; the kernel keeps the device and its backing path.
    assert!(
        std::process::Command::new("kill")
            .args(["-9", &holder.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::path::Path::new(&format!("/proc/{holder}/cmdline")).exists()
        && std::fs::read_to_string(format!("/proc/{holder}/stat")).is_ok_and(|s| !s.contains(") Z"))
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(
        run.loops(),
        before,
        "the device stays attached, same backing path"
    );
    assert!(!before[0].1.display().to_string().ends_with("(deleted)"));
    let unserved = read_device(&before[0].0);
    assert!(
        !unserved.status.success() && !unserved.stdout.starts_with(MARKER),
        "reads from a dead mapping fail: {unserved:?}"
    );

    for result in [
        ok(run.client.start_vm(pb::VmRequest { vmid: 9100 }).await),
        ok(run
            .client
            .create_overlay(pb::CreateOverlayRequest {
                vmid: 9101,
                archive: ARCHIVE.into(),
            })
            .await),
    ] {
        assert_status(
            result,
            Code::FailedPrecondition,
            &format!(
                "the mapping of {ARCHIVE} on {} is dead: its holder (process {holder}",
                before[0].0
            ),
        );
    }
    let (receipts, residue) = cleanup_receipts(&mut run.client, RUN_ID).await;
    assert!(residue.is_empty(), "{receipts:?} {residue:?}");
    assert!(
        receipts.contains(&"backup:drive-scsi0.img unmapped".to_owned()),
        "{receipts:?}"
    );
    assert!(run.loops().is_empty());
    run.stop().await;
}

/// Stages in `mirror` a copy of `/sys/block` for loop devices 0..1024 (each `loop` and `ro`
/// links to the kernel's own), where a test adds device-mapper holders: this kernel has no
/// device-mapper to create real ones.
fn sys_block_mirror(mirror: &std::path::Path) {
    for number in 0..1024 {
        let dir = mirror.join(format!("loop{number}"));
        std::fs::create_dir_all(dir.join("holders")).unwrap();
        for attribute in ["loop", "ro"] {
            std::os::unix::fs::symlink(
                format!("/sys/block/loop{number}/{attribute}"),
                dir.join(attribute),
            )
            .unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_guest_volume_the_host_activated_blocks_boot_and_is_reported_by_cleanup() {
    if !privileged(
        "a_guest_volume_the_host_activated_blocks_boot_and_is_reported_by_cleanup",
        &["losetup", "python3", "qemu-img"],
    ) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let lab = Lab::new("dmholder");
    lab.add_backup(SNAPSHOT, ARCHIVE, MARKER, 8 << 20);
    let mirror = lab.root.join("sys-block");
    sys_block_mirror(&mirror);
    let authority_dir = TempDir::new("dmholder-ctl");
    let authority = controller(&authority_dir.0);
    let config = lab.node_config(&authority, &lab.root.join("node"));
    let clock: std::sync::Arc<dyn certistack_connector::service::Clock> =
        std::sync::Arc::new(certistack_connector::service::SystemClock);
    let executor = certistack_connector::node::NodeExecutor::new(config.clone(), clock.clone())
        .with_sys_block(mirror.clone());
    let connector =
        certistack_connector::server::Connector::new(config, std::sync::Arc::new(executor), clock)
            .unwrap();
    let listener = connector.bind().await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        connector
            .serve(listener, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    let mut wire = grant(RUN_ID, NODE);
    sandbox_grant(&mut wire);
    let credentials = mint(&authority, &wire);
    let mut c = client(&authority, &address, NODE, &credentials.certificate)
        .await
        .unwrap();
    c.begin_run(begin_request(&credentials)).await.unwrap();
    let device = c
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap()
        .into_inner()
        .loop_device;
    overlay_and_vm(&mut c, 9100).await;

    // The host's LVM found a physical volume on the guest disk's second partition and
    // activated a logical volume of it.
    let loop_name = device.trim_start_matches("/dev/");
    let holder = mirror.join(format!("{loop_name}/{loop_name}p2/holders/dm-250"));
    std::fs::create_dir_all(&holder).unwrap();
    std::fs::create_dir_all(mirror.join("dm-250/dm")).unwrap();
    std::fs::write(mirror.join("dm-250/dm/name"), "guestvg-root\n").unwrap();
    std::fs::write(mirror.join("dm-250/dm/uuid"), "LVM-0123456789abcdef\n").unwrap();
    let described = format!(
        "{device}p2 is held by device-mapper device \"guestvg-root\" (dm-250): run `dmsetup remove /dev/dm-250` (it is a volume of the guest's LVM volume group guestvg: `vgchange -an guestvg` releases them all)"
    );
    assert_status(
        c.start_vm(pb::VmRequest { vmid: 9100 }).await,
        Code::FailedPrecondition,
        &format!("the host uses the mapping of {ARCHIVE}: {described}; then retry"),
    );

    // Cleanup removes everything else, leaves the mapping (unmap could not detach it) and
    // says what holds it and what to run.
    let (receipts, residue) = cleanup_receipts(&mut c, RUN_ID).await;
    assert_eq!(
        receipts.last().unwrap(),
        &format!(
            "backup:{ARCHIVE} failed: the mapping of {ARCHIVE} is left in place because the host uses it: {described}; then run Cleanup again"
        ),
        "{receipts:?}"
    );
    assert!(
        receipts.contains(&"vm:9100 destroyed".to_owned()),
        "{receipts:?}"
    );
    assert!(
        residue.contains(&format!(
            "the host uses the mapping of {ARCHIVE}: {described}"
        )),
        "{residue:?}"
    );
    assert_eq!(loops_under(&lab.root).len(), 1, "the mapping stays");

    // The operator released the volume: Cleanup completes.
    std::fs::remove_dir(&holder).unwrap();
    let (receipts, residue) = cleanup_receipts(&mut c, RUN_ID).await;
    assert!(residue.is_empty(), "{receipts:?} {residue:?}");
    assert!(
        receipts.contains(&format!("backup:{ARCHIVE} unmapped")),
        "{receipts:?}"
    );
    assert!(loops_under(&lab.root).is_empty());
    c.end_run(pb::EndRunRequest {}).await.unwrap();
    let _ = stop.send(());
    server.await.unwrap();
}

// ----------------------------------------------------------------------------------------------
// Source hardware: the sandbox VM gets the source VM's shape from the snapshot's config.

const EFI_ARCHIVE: &str = "drive-efidisk0.img";
const VIRTIO_ARCHIVE: &str = "drive-virtio0.img";
const SATA_ARCHIVE: &str = "drive-sata0.img";
const VIRTIO_BOOT_MARKER: &str = "VIRTIO-BLK-BOOT-7f3a";

/// A UEFI guest: OVMF with a 4 MiB EFI vars disk, q35, an x86-64-v2 CPU, a TPM and a NIC on
/// the source's bridge.
const UEFI_SOURCE: &str = "#web server\nbios: ovmf\nboot: order=scsi0;ide2;net0\ncores: 2\ncpu: x86-64-v2-AES\nefidisk0: local-lvm:vm-100-disk-0,efitype=4m,pre-enrolled-keys=1,size=4M\nide2: local:iso/debian-13.iso,media=cdrom,size=700M\nmachine: q35\nmemory: 2048\nname: web\nnet0: virtio=BC:24:11:AA:BB:01,bridge=vmbr0,firewall=1,tag=30\nostype: l26\nscsi0: local-lvm:vm-100-disk-1,iothread=1,size=8M\nscsihw: virtio-scsi-single\ntpmstate0: local-lvm:vm-100-disk-2,size=4M,version=v2.0\n\n[before-upgrade]\ncpu: host\nbios: seabios\n";

/// A SeaBIOS guest on i440fx with its system disk on virtio-blk, a data disk on SATA, an e1000
/// NIC, and host devices passed through.
const VIRTIO_SATA_PASSTHROUGH_SOURCE: &str = "args: -device pci-testdev\nboot: order=virtio0;net0\nhookscript: local:snippets/notify.pl\nhostpci0: 0000:01:00.0,pcie=0\nmachine: pc\nnet0: e1000=BC:24:11:AA:BB:02,bridge=vmbr1\nostype: win10\nsata0: local-lvm:vm-100-disk-3,size=8M\nsata1: none,media=cdrom\nserial0: /dev/ttyS0\nusb0: host=046d:c52b\nvirtio0: local-lvm:vm-100-disk-4,size=8M\n";

impl Run {
    async fn read_source(&mut self) -> Result<pb::ReadSourceConfigReply, tonic::Status> {
        self.client
            .read_source_config(pb::ReadSourceConfigRequest {
                snapshot: SNAPSHOT.into(),
                pbs_secret: PBS_PASSWORD.into(),
                encryption_key: vec![],
            })
            .await
            .map(tonic::Response::into_inner)
    }

    async fn map_and_overlay_all(&mut self, vmid: u32, archives: &[&str]) {
        for archive in archives {
            if !self.loops().iter().any(|(name, _)| name.contains(archive)) {
                self.client
                    .map_backup(map_request(archive, PBS_PASSWORD))
                    .await
                    .unwrap();
            }
            self.client
                .create_overlay(pb::CreateOverlayRequest {
                    vmid,
                    archive: (*archive).into(),
                })
                .await
                .unwrap();
        }
    }

    async fn create_mirrored(
        &mut self,
        vmid: u32,
        archives: &[&str],
    ) -> Result<pb::CreateVmReply, tonic::Status> {
        self.client
            .create_vm(pb::CreateVmRequest {
                vmid,
                cores: 1,
                memory_mib: 256,
                archives: archives.iter().map(|a| (*a).to_owned()).collect(),
                mirror_source_hardware: true,
            })
            .await
            .map(tonic::Response::into_inner)
    }

    /// The QEMU command line the qm double started `vmid` with.
    fn qemu_argv(&self, vmid: u32) -> Vec<String> {
        let pid = format!("{vmid}.pid");
        self.lab
            .calls()
            .into_iter()
            .rev()
            .find(|c| {
                c["event"] == "qemu-start"
                    && c["argv_qemu"]
                        .as_array()
                        .is_some_and(|a| a.iter().any(|v| v.as_str().unwrap().ends_with(&pid)))
            })
            .map(|c| {
                c["argv_qemu"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap().to_owned())
                    .collect()
            })
            .unwrap_or_else(|| panic!("QEMU of VM {vmid} was not started"))
    }

    /// QEMU's own view of the VM's block devices (QMP `query-block` through the connector).
    async fn query_block(&mut self, vmid: u32) -> serde_json::Value {
        let reply = self
            .client
            .qmp(pb::QmpRequest {
                vmid,
                command: pb::QmpCommand::QueryBlock as i32,
            })
            .await
            .unwrap()
            .into_inner();
        serde_json::from_str(&reply.result_json).unwrap()
    }
}

/// `key: value` of a PVE config's top section.
fn conf_value(conf: &str, key: &str) -> Option<String> {
    conf.lines()
        .take_while(|l| !l.starts_with('['))
        .find_map(|l| l.strip_prefix(&format!("{key}: ")))
        .map(str::to_owned)
}

/// Sandbox VMs get the source VM's hardware from the snapshot's `qemu-server.conf`: a UEFI
/// guest its OVMF firmware with an overlay of the backed-up EFI vars, its q35 machine, its
/// x86-64-v2-AES CPU and virtio-scsi-single; a virtio-blk/SATA guest its buses and slots, its
/// i440fx machine and its e1000 NIC. Each NIC is on the sandbox VNet with a fresh MAC and the
/// firewall off; CD-ROM drives are empty; passthrough, hookscript, raw args, the TPM and the
/// source's bridge are reported as omitted and never reach the VM. QEMU itself (its command
/// line and QMP `query-block`) shows the devices.
#[test]
fn sandbox_vms_mirror_the_source_hardware() {
    if !privileged("sandbox_vms_mirror_the_source_hardware", QEMU_TOOLS)
        || !has_files(
            "sandbox_vms_mirror_the_source_hardware",
            &[("/usr/share/OVMF/OVMF_VARS_4M.fd", "ovmf")],
        )
    {
        return;
    }
    let ovmf_vars: &'static std::path::Path =
        std::path::Path::new("/usr/share/OVMF/OVMF_VARS_4M.fd");
    let netns = Netns::new("srchw", &["csbox1", "csbox91", "csbox92"]);
    inside(&netns.name, move || async move {
        let archives = [ARCHIVE, EFI_ARCHIVE, VIRTIO_ARCHIVE, SATA_ARCHIVE];
        let mut run = Run::begin_with(
            "srchw",
            &archives,
            |lab| {
                // The EFI vars archive is a real OVMF vars store, as PVE backs it up.
                let efi = lab.root.join("pbs/store1").join(SNAPSHOT).join(EFI_ARCHIVE);
                std::fs::copy(ovmf_vars, efi).unwrap();
                // The virtio-blk system disk is the lab guest: it boots only if its kernel
                // finds its data partition on the virtio-blk disk.
                lab.add_guest_backup(
                    SNAPSHOT,
                    VIRTIO_ARCHIVE,
                    &GuestDisk {
                        marker: VIRTIO_BOOT_MARKER,
                        address: "10.77.9.10/24",
                        agent: true,
                        boots: true,
                    },
                );
                lab.add_source_config(SNAPSHOT, UEFI_SOURCE);
            },
            |wire| {
                sandbox_grant(wire);
                wire.qga_assertions.push(pb::QgaAssertion {
                    id: "lab-banner".into(),
                    program: "/bin/cat".into(),
                    args: vec!["/run/banner".into()],
                    expect_exit_code: 0,
                    expect_stdout_contains: format!("CERTISTACK-LAB {VIRTIO_BOOT_MARKER}"),
                    timeout_seconds: 20,
                });
            },
        )
        .await;
        run.client
            .prepare_sandbox(pb::PrepareSandboxRequest {
                vnet: VNET.into(),
                probe_source: PROBE_SOURCE.into(),
            })
            .await
            .unwrap();

        // UEFI guest.
        let read = run.read_source().await.unwrap();
        let hw = read.hardware.clone().unwrap();
        assert_eq!(
            (hw.cpu.as_str(), hw.bios.as_str(), hw.machine.as_str()),
            ("x86-64-v2-AES", "ovmf", "q35")
        );
        assert!(hw.efidisk && hw.pre_enrolled_keys && hw.efitype == "4m");
        let omitted: Vec<&str> = hw.omitted.iter().map(|o| o.key.as_str()).collect();
        assert!(omitted.contains(&"tpmstate0") && omitted.contains(&"net0"));
        run.map_and_overlay_all(9100, &[ARCHIVE, EFI_ARCHIVE]).await;
        run.create_mirrored(9100, &[ARCHIVE, EFI_ARCHIVE])
            .await
            .unwrap();
        let conf = run.conf(9100);
        let overlays = run.lab.root.join(format!("overlays/{RUN_ID}"));
        for (key, value) in [
            ("bios", "ovmf".to_owned()),
            ("cpu", "x86-64-v2-AES".into()),
            ("machine", "q35".into()),
            ("ostype", "l26".into()),
            ("scsihw", "virtio-scsi-single".into()),
            ("ide2", "none,media=cdrom".into()),
            ("boot", "order=scsi0;ide2;net0".into()),
        ] {
            assert_eq!(conf_value(&conf, key), Some(value), "{key} in\n{conf}");
        }
        let efidisk = conf_value(&conf, "efidisk0").unwrap();
        assert!(
            efidisk.starts_with(&format!("{}/9100-drive-efidisk0.qcow2", overlays.display()))
                && efidisk.contains("efitype=4m")
                && efidisk.contains("pre-enrolled-keys=1"),
            "{efidisk}"
        );
        let net0 = conf_value(&conf, "net0").unwrap();
        assert!(
            net0.starts_with("virtio=")
                && net0.contains("bridge=csbox1")
                && net0.contains("firewall=0"),
            "{net0}"
        );
        for absent in [
            "vmbr0",
            "BC:24:11:AA:BB:01",
            "tag=",
            "tpmstate0",
            "local-lvm",
        ] {
            assert!(
                !conf.contains(absent),
                "{absent} reached the sandbox:\n{conf}"
            );
        }
        run.client
            .start_vm(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap();
        let argv = run.qemu_argv(9100).join(" ");
        for expected in [
            "if=pflash,unit=0,format=raw,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.fd",
            "if=pflash,unit=1,id=drive-efidisk0,format=qcow2,file=",
            "-cpu qemu64,+aes,+popcnt",
            "-machine q35",
            "virtio-scsi-pci,id=virtioscsi0",
        ] {
            assert!(argv.contains(expected), "{expected} not in {argv}");
        }
        let blocks = run.query_block(9100).await.to_string();
        for device in ["drive-efidisk0", "drive-scsi0", "ide2"] {
            assert!(blocks.contains(device), "{device} not in {blocks}");
        }
        assert!(blocks.contains("9100-drive-efidisk0.qcow2"), "{blocks}");
        // TCG has two cores to share: the firmware of a guest without an OS need not spin on.
        run.client
            .stop_vm(pb::StopVmRequest {
                vmid: 9100,
                timeout_seconds: 5,
            })
            .await
            .unwrap();

        // virtio-blk + SATA guest with passthrough: a config of the same snapshot, read again.
        run.lab
            .add_source_config(SNAPSHOT, VIRTIO_SATA_PASSTHROUGH_SOURCE);
        let read = run.read_source().await.unwrap();
        let hw = read.hardware.unwrap();
        let reasons: std::collections::BTreeMap<&str, &str> = hw
            .omitted
            .iter()
            .map(|o| (o.key.as_str(), o.reason.as_str()))
            .collect();
        for key in ["hostpci0", "usb0", "serial0"] {
            assert!(reasons[key].contains("passthrough"), "{key}: {reasons:?}");
        }
        assert!(reasons["hookscript"].contains("never run"));
        assert!(reasons["args"].contains("never passed"));
        assert!(reasons["net0"].contains("run's VNet"));
        run.map_and_overlay_all(9101, &[VIRTIO_ARCHIVE, SATA_ARCHIVE])
            .await;
        run.create_mirrored(9101, &[VIRTIO_ARCHIVE, SATA_ARCHIVE])
            .await
            .unwrap();
        let conf = run.conf(9101);
        assert!(
            conf_value(&conf, "virtio0")
                .unwrap()
                .starts_with(&format!("{}/9101-drive-virtio0.qcow2,", overlays.display())),
            "{conf}"
        );
        assert!(
            conf_value(&conf, "sata0")
                .unwrap()
                .starts_with(&format!("{}/9101-drive-sata0.qcow2,", overlays.display())),
            "{conf}"
        );
        assert_eq!(
            conf_value(&conf, "sata1").as_deref(),
            Some("none,media=cdrom")
        );
        assert_eq!(conf_value(&conf, "machine").as_deref(), Some("pc"));
        assert_eq!(conf_value(&conf, "ostype").as_deref(), Some("win10"));
        assert_eq!(
            conf_value(&conf, "boot").as_deref(),
            Some("order=virtio0;net0")
        );
        assert!(conf_value(&conf, "net0").unwrap().starts_with("e1000="));
        for absent in [
            "hostpci",
            "usb0",
            "serial0",
            "hookscript",
            "args",
            "vmbr1",
            "scsi0",
        ] {
            assert!(
                !conf.contains(absent),
                "{absent} reached the sandbox:\n{conf}"
            );
        }
        run.client
            .start_vm(pb::VmRequest { vmid: 9101 })
            .await
            .unwrap();
        let argv = run.qemu_argv(9101).join(" ");
        for expected in [
            "-machine pc ",
            "virtio-blk-pci,drive=drive-virtio0,id=virtio0,bootindex=100",
            "ich9-ahci,id=ahci0",
            "ide-hd,bus=ahci0.0,drive=drive-sata0,id=sata0",
            "e1000,netdev=net0",
            "-cpu kvm64",
        ] {
            assert!(argv.contains(expected), "{expected} not in {argv}");
        }
        let blocks = run.query_block(9101).await.to_string();
        for device in ["drive-virtio0", "drive-sata0", "9101-drive-virtio0.qcow2"] {
            assert!(blocks.contains(device), "{device} not in {blocks}");
        }
        // The restored guest boots from its virtio-blk disk (SeaBIOS, SYSLINUX, the kernel, an
        // initramfs reading its data partition on /dev/vda2): the banner it built from the
        // disk's marker is what the guest agent reads back.
        let booted = std::time::Instant::now();
        loop {
            let answer = run
                .client
                .qga(pb::QgaRequest {
                    vmid: 9101,
                    call: Some(pb::qga_request::Call::AssertionId("lab-banner".into())),
                })
                .await;
            if let Ok(reply) = &answer
                && reply.get_ref().assertion_passed
            {
                break;
            }
            assert!(
                booted.elapsed() < std::time::Duration::from_secs(240),
                "the guest did not boot from virtio-blk: {answer:?}"
            );
            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        }
        let journal = run.journal().await;
        assert_eq!(
            journal
                .iter()
                .filter(|s| *s == "source.config source:qemu-server.conf done")
                .count(),
            2,
            "{journal:?}"
        );
        run.end().await;
    });
}

/// What the node never mirrors: a CreateVm asking for the source's shape before the config
/// was read, an archive the source config does not name as a disk, an archive or snapshot
/// outside the grant; and configs that are missing, oversized or not a config at all.
#[tokio::test(flavor = "multi_thread")]
async fn source_configs_and_shapes_outside_the_rules_are_refused() {
    if !privileged(
        "source_configs_and_shapes_outside_the_rules_are_refused",
        &["losetup", "qemu-img", "python3"],
    ) {
        return;
    }
    {
        let mut run = Run::begin_with(
            "srcrefuse",
            &[ARCHIVE, VIRTIO_ARCHIVE],
            |lab| {
                lab.add_source_config(SNAPSHOT, "virtio0: local-lvm:vm-100-disk-0,size=8M\n");
            },
            sandbox_grant,
        )
        .await;
        run.map_and_overlay_all(9100, &[ARCHIVE, VIRTIO_ARCHIVE])
            .await;
        assert_status(
            run.create_mirrored(9100, &[VIRTIO_ARCHIVE]).await,
            Code::FailedPrecondition,
            "this run has not read the source VM's config: call ReadSourceConfig first",
        );
        run.read_source().await.unwrap();
        assert_status(
            run.create_mirrored(9100, &[VIRTIO_ARCHIVE, ARCHIVE]).await,
            Code::FailedPrecondition,
            "VM 9100 cannot mirror the source: drive-scsi0.img is not a disk of the source config (its disks: drive-virtio0.img)",
        );
        assert_status(
            run.create_mirrored(9100, &[SATA_ARCHIVE]).await,
            Code::PermissionDenied,
            "archive drive-sata0.img is not granted",
        );
        let other = run
            .client
            .read_source_config(pb::ReadSourceConfigRequest {
                snapshot: "vm/100/2026-10-01T02:00:00Z".into(),
                pbs_secret: PBS_PASSWORD.into(),
                encryption_key: vec![],
            })
            .await;
        assert_status(
            other,
            Code::PermissionDenied,
            "snapshot vm/100/2026-10-01T02:00:00Z is not granted",
        );
        assert!(!run.lab.root.join("etc/pve/qemu-server/9100.conf").exists());

        for (config, needle) in [
            (
                format!("virtio0: x\ndescription: {}\n", "a".repeat(70 * 1024)),
                "is larger than 65536 bytes; it is refused, not cut",
            ),
            (
                "virtio0: x\nnot a config line\n".to_owned(),
                "line 2 of the source config is not a `key: value` line",
            ),
            (
                "virtio0: x\nvirtio0: y\n".to_owned(),
                "line 2 of the source config repeats the key \"virtio0\"",
            ),
        ] {
            run.lab.add_source_config(SNAPSHOT, &config);
            assert_status(run.read_source().await, Code::FailedPrecondition, needle);
        }
        std::fs::remove_file(
            run.lab
                .root
                .join("pbs/store1")
                .join(SNAPSHOT)
                .join(SOURCE_CONFIG_BLOB),
        )
        .unwrap();
        assert_status(
            run.read_source().await,
            Code::FailedPrecondition,
            "manifest does not contain file 'qemu-server.conf.blob'",
        );
        // A refused config leaves the shape read before it in force, and the secret never
        // reached an argument or the environment.
        run.create_mirrored(9100, &[VIRTIO_ARCHIVE]).await.unwrap();
        let conf = run.conf(9100);
        assert!(conf_value(&conf, "virtio0").is_some(), "{conf}");
        let restores: Vec<_> = run
            .lab
            .calls()
            .into_iter()
            .filter(|c| c["command"] == "restore")
            .collect();
        assert_eq!(restores.len(), 5);
        for call in &restores {
            assert_eq!(call["password_source"], "PBS_PASSWORD_FD", "{call}");
            assert!(!call.to_string().contains(PBS_PASSWORD), "{call}");
        }
        let journal = run.journal().await;
        assert!(
            journal
                .iter()
                .any(|s| s == "source.config source:qemu-server.conf failed"),
            "{journal:?}"
        );
        run.end().await;
    }
}

/// The packaged unit under a real systemd: a Debian root booted with systemd-nspawn (sharing
/// this machine's network, so the test's client reaches the connector on loopback), the
/// connector binary, unit, config and the Proxmox test doubles bound into it.
mod systemd_unit {
    use super::*;
    use std::path::{Path, PathBuf};
    use std::process::{Child, Command, Stdio};

    const UNIT: &str = "certistack-connector.service";

    struct Container {
        nspawn: Child,
        leader: u32,
    }

    impl Container {
        /// Boots `root` (left unchanged: a tmpfs overlay takes every write) with `binds`
        /// (host path, container path; read-write when the paths are equal).
        fn boot(root: &Path, binds: &[(PathBuf, PathBuf)]) -> Self {
            let name = format!("cs-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
            let mut command = Command::new("systemd-nspawn");
            command
                .arg("-D")
                .arg(root)
                .args(["--volatile=overlay", "-b", "--register=no", "--keep-unit"])
                .args(["--console=passive", "-M", &name])
                // FUSE and loop devices for the PBS double's mappings.
                .args(["--bind=/dev/fuse", "--bind=/dev/loop-control"]);
            for (host, inside) in binds {
                let flag = if host == inside {
                    "--bind"
                } else {
                    "--bind-ro"
                };
                command.arg(format!("{flag}={}:{}", host.display(), inside.display()));
            }
            let nspawn = command
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            // The container's PID 1 is the child of systemd-nspawn once it has exec'd systemd.
            let mut leader = None;
            for _ in 0..300 {
                leader = std::fs::read_to_string(format!(
                    "/proc/{}/task/{}/children",
                    nspawn.id(),
                    nspawn.id()
                ))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|pid| pid.parse::<u32>().ok())
                .find(|pid| {
                    std::fs::read_to_string(format!("/proc/{pid}/comm"))
                        .is_ok_and(|comm| comm.trim() == "systemd")
                });
                if leader.is_some() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            let container = Self {
                nspawn,
                leader: leader.expect("systemd-nspawn started no container"),
            };
            // Until systemd has opened its socket, systemctl cannot reach it.
            let mut state = String::new();
            for _ in 0..300 {
                state = container.run(&["systemctl", "is-system-running", "--wait"]);
                if ["running", "degraded"].contains(&state.trim()) {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            assert!(
                ["running", "degraded"].contains(&state.trim()),
                "the container's systemd: {state}"
            );
            // The container's /dev is its own: make the loop nodes the kernel may hand out.
            container.run(&[
                "sh",
                "-c",
                "for i in $(seq 0 511); do [ -e /dev/loop$i ] || mknod -m 0660 /dev/loop$i b 7 $i; done",
            ]);
            container
        }

        /// Runs `argv` inside the container; its stdout (stderr appended when it fails).
        fn run(&self, argv: &[&str]) -> String {
            let output = Command::new("nsenter")
                .args(["-t", &self.leader.to_string(), "-a", "--"])
                .args(argv)
                .output()
                .unwrap();
            let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
            if !output.status.success() {
                text.push_str(&String::from_utf8_lossy(&output.stderr));
            }
            text
        }

        fn property(&self, unit: &str, property: &str) -> String {
            self.run(&["systemctl", "show", "--value", "-p", property, unit])
                .trim()
                .to_owned()
        }

        /// Loop devices backed by files below `dir`, as the container sees them (the FUSE
        /// mount behind a mapping lives in the container's mount namespace).
        fn loops_under(&self, dir: &Path) -> Vec<String> {
            let listing = self.run(&["losetup", "--list", "--noheadings", "-O", "NAME,BACK-FILE"]);
            let mut loops: Vec<String> = listing
                .lines()
                .filter_map(|l| l.split_once(' '))
                .filter(|(_, back)| back.trim().starts_with(dir.to_str().unwrap()))
                .map(|(name, _)| name.to_owned())
                .collect();
            loops.sort();
            loops
        }

        /// SHA-256 of the first MiB of `device`, read with O_DIRECT: every read reaches the
        /// mapping's holder through the loop device, none is served from a cache. Fails (the
        /// error in the text) when the device cannot be read.
        fn device_digest(&self, device: &str) -> String {
            const READ: &str = "import hashlib, mmap, os, sys\n\
                fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)\n\
                buf = mmap.mmap(-1, 1 << 20)\n\
                n = os.readv(fd, [buf])\n\
                assert n == 1 << 20, 'short read: %d bytes' % n\n\
                print(hashlib.sha256(buf).hexdigest())\n";
            self.run(&["python3", "-c", READ, device]).trim().to_owned()
        }

        /// A process of the container as (state, start time): the start time tells a process
        /// from a later one given the same pid.
        fn process(&self, pid: &str) -> (String, String) {
            let stat = self.run(&["cat", &format!("/proc/{pid}/stat")]);
            let fields: Vec<&str> = stat
                .rsplit_once(')')
                .map(|(_, rest)| rest.split_whitespace().collect())
                .unwrap_or_default();
            match (fields.first(), fields.get(19)) {
                (Some(state), Some(start)) => ((*state).to_owned(), (*start).to_owned()),
                _ => (format!("gone: {stat}"), String::new()),
            }
        }

        /// `/proc/<pid>/status` lines and mount namespace of a process in the container.
        fn confinement(&self, pid: &str) -> BTreeMap<String, String> {
            let status = self.run(&["cat", &format!("/proc/{pid}/status")]);
            let mut seen: BTreeMap<String, String> = status
                .lines()
                .filter_map(|l| l.split_once(':'))
                .filter(|(k, _)| ["NoNewPrivs", "Seccomp_filters", "CapBnd"].contains(k))
                .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
                .collect();
            seen.insert(
                "mnt".into(),
                self.run(&["readlink", &format!("/proc/{pid}/ns/mnt")])
                    .trim()
                    .to_owned(),
            );
            seen
        }
    }

    impl Drop for Container {
        fn drop(&mut self) {
            let _ = Command::new("nsenter")
                .args([
                    "-t",
                    &self.leader.to_string(),
                    "-a",
                    "systemctl",
                    "poweroff",
                ])
                .status();
            for _ in 0..100 {
                if matches!(self.nspawn.try_wait(), Ok(Some(_))) {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            let _ = self.nspawn.kill();
            let _ = self.nspawn.wait();
        }
    }

    use std::collections::BTreeMap;

    /// The root, built once per target directory by tests/systemd/container-root.sh.
    fn container_root() -> PathBuf {
        let target = binary("certistack-connector")
            .parent()
            .and_then(Path::parent)
            .unwrap()
            .to_owned();
        let root = target.join("nspawn/systemd-root");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd/container-root.sh");
        let built = Command::new("bash")
            .arg(script)
            .arg(&root)
            .status()
            .unwrap();
        assert!(built.success(), "building the container root failed");
        root
    }

    /// Under the packaged, hardened unit started by systemd (Type=notify: `systemctl start`
    /// returns once the connector is ready): MapBackup's holder runs in a transient unit of its
    /// own, with none of the connector's restrictions (no NoNewPrivs, no seccomp filter beyond
    /// the container's own, the full capability bounding set, the mount namespace of PID 1).
    /// A `systemctl restart` of the connector, and a stop followed by a start (as an upgrade
    /// does), leave the holder (same process), its loop device and the device's data (read
    /// through the holder) as they were, and the run goes on under the new daemon; Cleanup
    /// then removes the mapping and its unit.
    #[tokio::test(flavor = "multi_thread")]
    async fn the_map_holder_runs_outside_the_connectors_sandbox_and_outlives_its_restart() {
        if !privileged(
            "the_map_holder_runs_outside_the_connectors_sandbox_and_outlives_its_restart",
            &[
                "systemd-nspawn",
                "mmdebstrap",
                "nsenter",
                "losetup",
                "python3",
            ],
        ) {
            return;
        }
        let _serial = SERIAL.lock().await;
        let root = container_root();
        let lab = Lab::new("systemd-unit");
        let image = lab.add_backup(SNAPSHOT, ARCHIVE, MARKER, 8 << 20);
        // What the device must read: the backup's first MiB (the marker, then zeros).
        let backup_digest = {
            use sha2::Digest;
            let data = std::fs::read(&image).unwrap();
            hex::encode(sha2::Sha256::digest(&data[..1 << 20]))
        };
        let dir = lab.root.parent().unwrap().to_owned();
        let authority_dir = TempDir::new("systemd-unit-ctl");
        let authority = controller(&authority_dir.0);
        let mut config = lab.node_config(&authority, &lab.root.join("node"));
        config.process.transient_units = certistack_connector::config::TransientUnits::Auto;
        let port = free_local_port();
        let config_path = dir.join("connector.toml");
        write_config_file(&config_path, &config, port);
        // The test's directory sits below /tmp, which the unit's PrivateTmp hides and
        // ProtectSystem makes read-only: this drop-in opens exactly that directory.
        let dropin = dir.join("lab.conf");
        std::fs::write(
            &dropin,
            format!(
                "[Service]\nPrivateTmp=no\nReadWritePaths={}\n",
                dir.display()
            ),
        )
        .unwrap();
        let unit = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../packaging")
            .join(UNIT);
        let container = Container::boot(
            &root,
            &[
                (dir.clone(), dir.clone()),
                (
                    binary("certistack-connector"),
                    "/usr/sbin/certistack-connector".into(),
                ),
                (unit, format!("/etc/systemd/system/{UNIT}").into()),
                (
                    dropin,
                    format!("/etc/systemd/system/{UNIT}.d/lab.conf").into(),
                ),
                (config_path, "/etc/certistack/connector.toml".into()),
                (
                    config.tls.certificate.clone(),
                    "/etc/certistack/node.crt".into(),
                ),
            ],
        );
        container.run(&["systemctl", "daemon-reload"]);
        // Type=notify: start returns once the connector said READY=1.
        let started = container.run(&["systemctl", "start", UNIT]);
        assert_eq!(
            container.property(UNIT, "ActiveState"),
            "active",
            "{started}{}",
            container.run(&["journalctl", "-u", UNIT, "--no-pager", "-n", "30"])
        );
        let address = format!("127.0.0.1:{port}");
        let mut wire = grant(RUN_ID, NODE);
        wire.archives = vec![ARCHIVE.to_owned()];
        let credentials = mint(&authority, &wire);
        let mut run = client_when_up(&authority, &address, &credentials.certificate).await;
        run.begin_run(begin_request(&credentials)).await.unwrap();
        let map_unit = format!("certistack-map-{RUN_ID}-{ARCHIVE}.service");
        let mapped = match run.map_backup(map_request(ARCHIVE, PBS_PASSWORD)).await {
            Ok(reply) => reply.into_inner(),
            Err(status) => panic!(
                "{status:?}\n{}\n{}",
                container.run(&["systemctl", "status", "--no-pager", &map_unit]),
                container.run(&["journalctl", "--no-pager", "-n", "40"])
            ),
        };
        assert_eq!(container.property(&map_unit, "ActiveState"), "active");
        let loopdev_dir = lab.root.join("run/pbs-loopdev");
        let loops = container.loops_under(&loopdev_dir);
        assert_eq!(loops, std::slice::from_ref(&mapped.loop_device));
        // The holder's pid file, as the PBS client writes it (a pid of the container).
        let pid_file = std::fs::read_dir(lab.root.join("run/pbs-loopdev"))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "pid"))
            .expect("no holder pid file");
        let holder_pid = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .to_owned();
        assert!(
            container
                .run(&["systemctl", "status", "--no-pager", &map_unit])
                .contains(&holder_pid),
            "the holder {holder_pid} is not in {map_unit}"
        );

        // The holder is outside the connector's sandbox.
        let connector_pid = container.property(UNIT, "MainPID");
        let connector = container.confinement(&connector_pid);
        let unconfined = container.confinement(&holder_pid);
        let init = container.confinement("1");
        eprintln!("connector {connector:?}\nholder {unconfined:?}");
        assert_eq!(connector["NoNewPrivs"], "1");
        assert_eq!(unconfined["NoNewPrivs"], "0");
        // systemd-nspawn filters system calls for the whole container: the holder has exactly
        // the container's filters, the connector its unit's SystemCallFilter on top.
        let filters =
            |seen: &BTreeMap<String, String>| -> u32 { seen["Seccomp_filters"].parse().unwrap() };
        assert_eq!(filters(&unconfined), filters(&init));
        assert!(
            filters(&connector) > filters(&init),
            "{connector:?} {init:?}"
        );
        assert_eq!(unconfined["CapBnd"], init["CapBnd"]);
        assert_ne!(connector["CapBnd"], init["CapBnd"]);
        assert_eq!(unconfined["mnt"], init["mnt"]);
        assert_ne!(connector["mnt"], init["mnt"]);

        // What a restart or an upgrade must leave alone: the holder (the same process, still
        // in the map unit's cgroup), its loop device, and the data read through it.
        let holder = container.process(&holder_pid);
        assert_ne!(holder.0, "Z", "{holder:?}");
        assert_eq!(
            container.device_digest(&mapped.loop_device),
            backup_digest,
            "the mapped device does not read as the backup"
        );
        let still_held = |when: &str| {
            assert_eq!(
                container.property(&map_unit, "ActiveState"),
                "active",
                "{when}"
            );
            let now = container.process(&holder_pid);
            assert!(
                now.1 == holder.1 && now.0 != "Z",
                "{when}: the holder was {holder:?}, is {now:?}"
            );
            let cgroup = container.run(&["cat", &format!("/proc/{holder_pid}/cgroup")]);
            assert!(cgroup.contains(&map_unit), "{when}: {cgroup}");
            assert_eq!(
                container.loops_under(&loopdev_dir),
                std::slice::from_ref(&mapped.loop_device),
                "{when}"
            );
            assert_eq!(
                container.device_digest(&mapped.loop_device),
                backup_digest,
                "{when}: the device's data"
            );
            eprintln!(
                "{when}: holder {holder_pid} {now:?} in {map_unit}, {} reads sha256 {backup_digest}",
                mapped.loop_device
            );
        };
        let map_step = format!("backup.map backup:{ARCHIVE} done");

        // A restart of the connector's unit; the run goes on under the new daemon, over a new
        // connection.
        drop(run);
        container.run(&["systemctl", "restart", UNIT]);
        assert_eq!(container.property(UNIT, "ActiveState"), "active");
        let restarted_pid = container.property(UNIT, "MainPID");
        assert_ne!(restarted_pid, connector_pid);
        still_held("after systemctl restart");
        let mut run = client_when_up(&authority, &address, &credentials.certificate).await;
        let journal = journal_steps(&mut run, RUN_ID).await;
        assert!(journal.contains(&map_step), "{journal:?}");

        // An upgrade stops the old daemon and starts the new one.
        drop(run);
        container.run(&["systemctl", "stop", UNIT]);
        assert_eq!(container.property(UNIT, "ActiveState"), "inactive");
        still_held("with the connector stopped");
        container.run(&["systemctl", "start", UNIT]);
        assert_eq!(container.property(UNIT, "ActiveState"), "active");
        assert_ne!(container.property(UNIT, "MainPID"), restarted_pid);
        still_held("after systemctl stop and start");
        let mut run = client_when_up(&authority, &address, &credentials.certificate).await;
        let journal = journal_steps(&mut run, RUN_ID).await;
        assert!(journal.contains(&map_step), "{journal:?}");

        // Cleanup unmaps (the holder ends) and removes the map unit.
        let (receipts, residue) = cleanup_receipts(&mut run, RUN_ID).await;
        assert!(residue.is_empty(), "{receipts:?} {residue:?}");
        assert!(container.loops_under(&loopdev_dir).is_empty());
        assert!(
            container.process(&holder_pid).0.starts_with("gone"),
            "the holder {holder_pid} outlived its mapping"
        );
        assert_ne!(container.property(&map_unit, "LoadState"), "loaded");
        let left = container.run(&[
            "systemctl",
            "list-units",
            "--all",
            "--plain",
            "--no-legend",
            "certistack-map-*",
        ]);
        assert_eq!(left.trim(), "", "units left after Cleanup");
        run.end_run(pb::EndRunRequest {}).await.unwrap();
        container.run(&["systemctl", "stop", UNIT]);
    }

    /// A guest network recovery's session under systemd, started as the connector starts it
    /// (`guestfish_call` with its unit), with a stand-in for guestfish: the session's commands
    /// reach it on stdin and its answers come back on stdout (`--pipe`), it runs in
    /// `certistack-guestnet-<run>-<vmid>.service` with the unit's `MemoryMax` and
    /// `RuntimeMaxSec`, its exit status is the call's (`--wait`) and the unit is collected
    /// after it. A session that hangs is ended by systemd at `RuntimeMaxSec`, its cgroup with
    /// it, without anyone killing `systemd-run`. (libguestfs itself is not installed in the
    /// container: its appliance is shown by the guest network tests outside systemd.)
    #[tokio::test(flavor = "multi_thread")]
    async fn a_guest_network_session_runs_in_its_unit_with_the_callers_pipes_and_the_units_bounds()
    {
        if !privileged(
            "a_guest_network_session_runs_in_its_unit_with_the_callers_pipes_and_the_units_bounds",
            &["systemd-nspawn", "mmdebstrap", "nsenter"],
        ) {
            return;
        }
        use certistack_connector::node::guest_network;
        use certistack_core::validate::{RunId, Validated, Vmid};
        use std::io::Write;
        let _serial = SERIAL.lock().await;
        let root = container_root();
        let dir = TempDir::new("guestnet-unit");
        let run_id = RunId::validate(RUN_ID).unwrap();
        let unit = guest_network::guest_network_unit(&run_id, Vmid::parse("t", 9100).unwrap(), 512)
            .unwrap();
        let standin = dir.0.join("guestfish");
        std::fs::write(
            &standin,
            format!(
                "#!/bin/sh\nwhile read -r line; do\n  [ \"$line\" = hang ] && exec sleep 600\n  echo \"answer: $line\"\ndone\necho \"args: $*\"\necho \"env: $LIBGUESTFS_BACKEND $LIBGUESTFS_MEMSIZE\"\necho \"cgroup: $(cat /proc/self/cgroup)\"\nsystemctl show -p MemoryMax -p RuntimeMaxUSec {}\nexit 7\n",
                unit.name
            ),
        )
        .unwrap();
        std::fs::set_permissions(
            &standin,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let container = Container::boot(&root, &[(dir.0.clone(), dir.0.clone())]);
        let session = |timeout: std::time::Duration, commands: &str| {
            let call = guest_network::guestfish_call(
                &standin,
                Path::new("/var/lib/certistack-overlays/9100-drive-scsi0.qcow2"),
                &guest_network::Appliance {
                    timeout,
                    memory_mib: 512,
                    accelerator: certistack_connector::config::ApplianceAccelerator::Auto,
                },
                Some(&unit),
                Path::new("/usr/bin/systemd-run"),
                Path::new("/usr/bin/systemctl"),
            )
            .unwrap();
            let mut child = Command::new("nsenter")
                .args(["-t", &container.leader.to_string(), "-a", "--"])
                .arg(&call.program)
                .args(&call.args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            child
                .stdin
                .take()
                .unwrap()
                .write_all(commands.as_bytes())
                .unwrap();
            let started = std::time::Instant::now();
            let output = child.wait_with_output().unwrap();
            (output, started.elapsed())
        };

        let (output, _) = session(std::time::Duration::from_secs(600), "run\ninspect-os\n");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert_eq!(
            output.status.code(),
            Some(7),
            "{stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        for line in [
            "answer: run\nanswer: inspect-os\n",
            "args: --format=qcow2 -a /var/lib/certistack-overlays/9100-drive-scsi0.qcow2\n",
            "env: direct 512\n",
            // The unit's own cgroup (cgroup v2, or v1's name=systemd hierarchy).
            &format!(":/system.slice/{}\n", unit.name),
            // 512 MiB for the appliance and 1024 MiB around it.
            "MemoryMax=1610612736\n",
            // The daemon's deadline, then the margin after which systemd ends it alone.
            "RuntimeMaxUSec=10min 30s\n",
        ] {
            assert!(stdout.contains(line), "{line:?} missing from {stdout}");
        }
        assert_eq!(container.property(&unit.name, "LoadState"), "not-found");

        // A hung session: systemd stops the unit at RuntimeMaxSec (3 s and the margin), sleep
        // and all.
        let (output, took) = session(std::time::Duration::from_secs(3), "run\nhang\n");
        assert!(!output.status.success(), "{output:?}");
        assert!(
            took < std::time::Duration::from_secs(3)
                + certistack_connector::process::GUEST_NETWORK_UNIT_MARGIN
                + std::time::Duration::from_secs(25),
            "took {took:?}"
        );
        assert_eq!(container.property(&unit.name, "LoadState"), "not-found");
        assert_eq!(
            container.run(&["pgrep", "-f", "sleep 600"]).trim(),
            "",
            "the hung session outlived its unit"
        );
    }
}
