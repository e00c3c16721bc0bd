//! Crash matrix: kill -9 the daemon at each step, restart it, recover, and find zero residue.

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
    let (_authority_dir, authority, mut config) = lab.controller_and_node_config("slowtool-ctl");
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
    let (_authority_dir, authority, config) = lab.controller_and_node_config("claim-ctl");
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
    let (_authority_dir, authority, config) = lab.controller_and_node_config("crash-ctl");
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
