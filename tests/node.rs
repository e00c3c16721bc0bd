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
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    _authority_dir: TempDir,
    _serial: tokio::sync::MutexGuard<'static, ()>,
}

impl Run {
    async fn begin(tag: &str, archives: &[&str]) -> Self {
        let serial = SERIAL.lock().await;
        let lab = Lab::new(tag);
        for archive in archives {
            lab.add_backup(SNAPSHOT, archive, MARKER, 8 << 20);
        }
        let authority_dir = TempDir::new(&format!("{tag}-ctl"));
        let authority = controller(&authority_dir.0);
        let config = lab.node_config(&authority, &lab.root.join("node"));
        let (address, shutdown, task) = serve_node(config).await;
        let mut wire = grant(RUN_ID, NODE);
        wire.archives = archives.iter().map(|a| (*a).to_owned()).collect();
        let credentials = mint(&authority, &wire);
        let mut client = client(&authority, &address, NODE, &credentials.certificate)
            .await
            .unwrap();
        client.begin_run(begin_request(&credentials)).await.unwrap();
        Self {
            lab,
            client,
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
        let mut stream = self
            .client
            .read_journal(pb::ReadJournalRequest {
                run_id: RUN_ID.into(),
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
        "backup.map backup:drive-scsi0.img done",
        "overlay.dir dir:overlays intent",
        "overlay.dir dir:overlays done",
        "overlay.create overlay:9100:drive-scsi0.img intent",
        "overlay.create overlay:9100:drive-scsi0.img done",
        "overlay.delete overlay:9100:drive-scsi0.img intent",
        "overlay.delete overlay:9100:drive-scsi0.img undone",
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
    assert_eq!(
        &steps[1..],
        [
            "backup.map backup:drive-scsi0.img intent",
            "backup.map backup:drive-scsi0.img failed",
            "backup.map backup:drive-scsi1.img intent",
            "backup.map backup:drive-scsi1.img failed",
        ]
    );
    // Cleanup reconciles the failed attempts: nothing was left, each is recorded as gone.
    let reply = run
        .client
        .cleanup(pb::CleanupRequest {
            run_id: RUN_ID.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let receipts: Vec<(String, String)> = reply
        .resources
        .into_iter()
        .map(|r| (r.resource, r.end_state))
        .collect();
    assert_eq!(
        receipts,
        [
            (
                "backup:drive-scsi1.img".to_owned(),
                "already gone".to_owned()
            ),
            (
                "backup:drive-scsi0.img".to_owned(),
                "already gone".to_owned()
            )
        ]
    );
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
    let reply = run
        .client
        .cleanup(pb::CleanupRequest {
            run_id: RUN_ID.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let receipts: Vec<String> = reply
        .resources
        .iter()
        .map(|r| format!("{} {}", r.resource, r.end_state))
        .collect();
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
    assert!(reply.residue.is_empty(), "{:?}", reply.residue);
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

fn assert_status<T: std::fmt::Debug>(result: Result<T, tonic::Status>, code: Code, needle: &str) {
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
