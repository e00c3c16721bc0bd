//! The state directory: one connector at a time, a read-only check, bounded runs and journals.

use super::*;
use certistack_connector::config::Config;
use certistack_connector::runs::{RegistryLimits, RunRegistry};
use certistack_connector::server::load_authority_key;
use certistack_controller::authority::Authority;
use certistack_core::journal::{self, Journal, Phase};
use certistack_core::journal::{Op, Resource};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

fn connector(args: &[&str]) -> (i32, String) {
    let out = Command::new(binary("certistack-connector"))
        .args(args)
        .env_remove("CERTISTACK_LOG")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Opens the run registry of `config` in this process and begins `count` runs, ending
/// every one when `end` is set: the on-disk format, written by the connector's own code.
async fn runs_on_disk(
    authority: &Authority,
    config: &Config,
    count: usize,
    end: bool,
) -> Vec<String> {
    let key = load_authority_key(&config.tls.run_authority_public_key).unwrap();
    let now_ms = now().unix_timestamp() * 1000;
    let registry = RunRegistry::open(
        &config.paths.state_dir,
        &key,
        RegistryLimits::from_config(&config.limits),
        now_ms,
    )
    .unwrap();
    let mut ids = Vec::new();
    // Verifying a signature takes milliseconds in a debug build: verify one grant and
    // give each run its own run id and digest of its own signed bytes.
    let template = {
        let signed = sign_grant(authority.run_authority(), &grant(RUN_ID, NODE));
        certistack_core::grant::verify(&signed, &key).unwrap()
    };
    for _ in 0..count {
        let run_id = uuid::Uuid::new_v4().to_string();
        let signed = sign_grant(authority.run_authority(), &grant(&run_id, NODE));
        let mut verified = template.clone();
        verified.run_id = RunId::validate(&run_id).unwrap();
        verified.digest = certistack_core::grant::digest(&signed.grant);
        let id = verified.run_id.clone();
        registry.begin(&signed, verified, now_ms).await.unwrap();
        if end {
            registry.end(&id, now_ms).await.unwrap();
        }
        ids.push(run_id);
    }
    ids
}

fn journal_of(config: &Config, run_id: &str) -> PathBuf {
    config
        .paths
        .state_dir
        .join("runs")
        .join(run_id)
        .join(journal::FILE_NAME)
}

const TORN: &[u8] = b"9f3a 00 {\"seq\":3,\"time_ms\":4,\"op\":\"vm.cre";

#[tokio::test]
async fn check_changes_nothing_and_checks_tools_pve_and_overlay_root() {
    let dir = TempDir::new("check-ro");
    let authority = controller(&dir.0);
    let node_dir = dir.0.join("node");
    let mut config = enroll(&authority, &node_dir, NODE);
    let tools = dir.0.join("tools");
    std::fs::create_dir_all(&tools).unwrap();
    let not_executable = tools.join("qemu-img");
    std::fs::write(&not_executable, "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&not_executable, std::fs::Permissions::from_mode(0o644)).unwrap();
    config.tools.proxmox_backup_client = "/bin/true".into();
    config.tools.qm = tools.join("qm");
    config.tools.qemu_img = not_executable.clone();
    config.tools.ip = "/bin/true".into();
    config.tools.nft = "/bin/true".into();
    let pve = dir.0.join("pve");
    for sub in ["run", "cluster"] {
        std::fs::create_dir_all(pve.join(sub)).unwrap();
    }
    config.pve.qemu_server_run_dir = pve.join("run");
    config.pve.vm_config_dir = pve.join("conf");
    config.pve.pbs_loopdev_dir = pve.join("loopdev");
    config.pve.pve_cluster_dir = pve.join("cluster");
    std::fs::create_dir_all(&config.paths.overlay_root).unwrap();
    std::fs::set_permissions(
        &config.paths.overlay_root,
        std::fs::Permissions::from_mode(0o777),
    )
    .unwrap();
    let config_path = dir.0.join("connector.toml");
    write_config_file(&config_path, &config, free_port());
    let c = config_path.to_str().unwrap();

    let (code, out) = connector(&["--config", c, "check"]);
    assert_eq!(code, 3, "{out}");
    for needle in [
        "tools.qm",
        "No such file",
        "tools.qemu_img",
        "not executable (mode 0644)",
        "pve.vm_config_dir",
        "paths.overlay_root",
        "chmod go-w",
    ] {
        assert!(out.contains(needle), "{needle}: {out}");
    }
    assert!(
        out.contains("ok: pve.pbs_loopdev_dir") && !out.contains("problem: pve.pbs_loopdev_dir"),
        "created by the first map: {out}"
    );
    assert!(
        !config.paths.state_dir.exists(),
        "check created the state directory"
    );

    std::fs::set_permissions(&not_executable, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::copy("/bin/true", tools.join("qm")).unwrap();
    std::fs::create_dir_all(pve.join("conf")).unwrap();
    std::fs::set_permissions(
        &config.paths.overlay_root,
        std::fs::Permissions::from_mode(0o700),
    )
    .unwrap();
    let (code, out) = connector(&["--config", c, "check"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("configuration ok"), "{out}");
    assert!(
        !config.paths.state_dir.exists(),
        "check created the state directory"
    );

    // An open run whose journal has a torn tail: check reports it and repairs nothing.
    let runs = runs_on_disk(&authority, &config, 1, false).await;
    let journal = journal_of(&config, &runs[0]);
    let mut bytes = std::fs::read(&journal).unwrap();
    bytes.extend_from_slice(TORN);
    std::fs::write(&journal, &bytes).unwrap();
    let (code, out) = connector(&["--config", c, "check"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("torn last record after 1 records"), "{out}");
    assert!(out.contains("1 open and 0 closed runs"), "{out}");
    assert_eq!(
        std::fs::read(&journal).unwrap(),
        bytes,
        "check repaired the journal"
    );
    assert!(!journal.with_file_name("journal.torn.1").exists());
    // Nor does it create runs/.
    std::fs::remove_dir_all(config.paths.state_dir.join("runs")).unwrap();
    let (code, out) = connector(&["--config", c, "check"]);
    assert_eq!(code, 0, "{out}");
    assert!(!config.paths.state_dir.join("runs").exists());
}

// Multi-threaded: the test blocks on the daemon's exit, and the client connection from
// `client_when_up` must still be closed by the runtime meanwhile, or the daemon's drain
// waits for it until the HTTP/2 keepalive gives up (40 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_serve_or_check_names_the_pid_holding_the_state_directory() {
    let (dir, authority, config) = enrolled_node("state-lock");
    let runs = runs_on_disk(&authority, &config, 1, false).await;
    let port = free_port();
    let config_path = dir.0.join("connector.toml");
    write_config_file(&config_path, &config, port);
    let c = config_path.to_str().unwrap();
    let mut first = Command::new(binary("certistack-connector"))
        .args(["--config", c, "serve"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let operator = authority.issue_operator("alice", now()).unwrap();
    client_when_up(&authority, &format!("127.0.0.1:{port}"), &operator).await;
    let pid = first.id().to_string();
    assert_eq!(
        std::fs::read_to_string(config.paths.state_dir.join("lock"))
            .unwrap()
            .trim(),
        pid
    );
    // The running connector is in the middle of an append.
    let journal = journal_of(&config, &runs[0]);
    let mut bytes = std::fs::read(&journal).unwrap();
    bytes.extend_from_slice(TORN);
    std::fs::write(&journal, &bytes).unwrap();

    for verb in ["serve", "check"] {
        let (code, out) = connector(&["--config", c, verb]);
        assert_eq!(code, 3, "{verb}: {out}");
        assert!(
            out.contains(&format!("in use by another connector (process {pid}")),
            "{verb}: {out}"
        );
        assert_eq!(
            std::fs::read(&journal).unwrap(),
            bytes,
            "a second {verb} touched the live journal"
        );
    }
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(first.wait().unwrap().success());
    // Once it stopped, the lock is free again.
    let (code, out) = connector(&["--config", c, "check"]);
    assert!(
        !out.contains("in use by another connector"),
        "{code}: {out}"
    );
}

fn descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

async fn begin_and_end(authority: &Authority, address: &str) {
    let mut run = begun_run(
        authority,
        address,
        &grant(&uuid::Uuid::new_v4().to_string(), NODE),
    )
    .await;
    run.end_run(pb::EndRunRequest {}).await.unwrap();
}

/// 5,000 closed runs on disk: the connector starts under a limit of 1,024 descriptors
/// (it used to open every journal), serves new runs, and its descriptors and memory stay
/// flat while it does. The state directory is on tmpfs so writing the runs is quick.
#[tokio::test(flavor = "multi_thread")]
async fn thousands_of_closed_runs_start_under_1024_descriptors_and_stay_flat() {
    const CLOSED: usize = 5000;
    let dir = TempDir::new("closed-runs");
    let shm = TempDirAt::new(Path::new("/dev/shm"), "closed-runs-state");
    let authority = controller(&dir.0);
    let mut config = enroll(&authority, &dir.0.join("node"), NODE);
    config.paths.state_dir = shm.0.join("state");
    let started = std::time::Instant::now();
    let closed = runs_on_disk(&authority, &config, CLOSED, true).await;
    eprintln!("wrote {CLOSED} closed runs in {:?}", started.elapsed());
    let port = free_port();
    let address = format!("127.0.0.1:{port}");
    let config_path = dir.0.join("connector.toml");
    write_config_file(&config_path, &config, port);
    let mut daemon = Command::new("prlimit")
        .args(["--nofile=1024:1024", "--"])
        .arg(binary("certistack-connector"))
        .args(["--config", config_path.to_str().unwrap(), "serve"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    struct Stop(u32);
    impl Drop for Stop {
        fn drop(&mut self) {
            let _ = Command::new("kill")
                .args(["-TERM", &self.0.to_string()])
                .status();
        }
    }
    let pid = daemon.id();
    let _stop = Stop(pid);
    let identity = authority.issue_operator("alice", now()).unwrap();
    let mut operator = client_when_up(&authority, &address, &identity).await;
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    assert!(
        limits
            .lines()
            .any(|l| l.starts_with("Max open files") && l.contains(" 1024 ")),
        "{limits}"
    );
    let at_start = (descriptors(pid), rss_kib(pid));
    for _ in 0..10 {
        begin_and_end(&authority, &address).await;
    }
    let warm = (descriptors(pid), rss_kib(pid));
    for _ in 0..50 {
        begin_and_end(&authority, &address).await;
    }
    let after = (descriptors(pid), rss_kib(pid));
    eprintln!(
        "descriptors / VmRSS KiB: at start {at_start:?}, after 10 runs {warm:?}, after 60 runs {after:?}"
    );
    assert!(at_start.0 < 64, "descriptors at start: {at_start:?}");
    assert!(
        after.0 <= warm.0 + 4,
        "descriptors grew: {warm:?} -> {after:?}"
    );
    assert!(
        after.1 <= warm.1 + 4096,
        "memory grew: {warm:?} -> {after:?}"
    );

    // ListRuns pages the closed runs in run-id order; a closed run's journal still streams.
    let first = operator
        .list_runs(pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.runs.len(), 100, "the default page");
    let (mut listed, mut cursor, mut pages) = (Vec::new(), String::new(), 0);
    loop {
        let reply = operator
            .list_runs(pb::ListRunsRequest {
                closed_page_size: 1000,
                closed_cursor: cursor.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        pages += 1;
        assert!(reply.runs.len() <= 1000);
        assert!(
            reply
                .runs
                .iter()
                .all(|r| r.state == pb::RunState::Closed as i32)
        );
        listed.extend(reply.runs.into_iter().map(|r| r.run_id));
        if reply.next_closed_cursor.is_empty() {
            break;
        }
        assert_eq!(Some(&reply.next_closed_cursor), listed.last());
        cursor = reply.next_closed_cursor;
    }
    assert_eq!(pages, (CLOSED + 60).div_ceil(1000));
    assert_eq!(listed.len(), CLOSED + 60);
    assert!(
        listed.windows(2).all(|w| w[0] < w[1]),
        "pages are in run-id order, none repeated"
    );
    assert_eq!(
        listed[..100],
        first
            .runs
            .iter()
            .map(|r| r.run_id.clone())
            .collect::<Vec<_>>()[..]
    );
    for (size, cursor, what) in [
        (1001, String::new(), "closed_page_size"),
        (10, "not-a-run".to_owned(), "closed_cursor"),
    ] {
        let refused = operator
            .list_runs(pb::ListRunsRequest {
                closed_page_size: size,
                closed_cursor: cursor,
            })
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains(what), "{refused:?}");
    }
    // The controller's `runs` lists every page.
    assert_eq!(
        certistack_controller::operator::list_runs(&mut operator)
            .await
            .unwrap()
            .len(),
        CLOSED + 60
    );
    let mut stream = operator
        .read_journal(pb::ReadJournalRequest {
            run_id: closed[0].clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut ops = Vec::new();
    while let Some(record) = stream.message().await.unwrap() {
        ops.push(record.operation);
    }
    assert_eq!(ops, ["run.begin", "run.end"]);
    assert!(daemon.try_wait().unwrap().is_none(), "the daemon stopped");
}

/// A temporary directory under `parent`, removed on drop.
struct TempDirAt(PathBuf);

impl TempDirAt {
    fn new(parent: &Path, tag: &str) -> Self {
        let path = parent.join(format!("certistack-{tag}-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
}

impl Drop for TempDirAt {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A run whose journal reached its operation budget: operations that add to the node are
/// refused with RESOURCE_EXHAUSTED, naming the numbers; undoing and cleanup still run.
#[tokio::test]
async fn a_full_journal_refuses_new_operations_and_keeps_room_for_cleanup() {
    let dir = TempDir::new("journal-cap");
    let authority = controller(&dir.0);
    let mut node = TestNode::start(&authority, &dir.0.join("node"), NODE).await;
    node.stop().await;
    let mut config = node.config.clone();
    config.limits.max_journal_records = 1000;
    let credentials = mint(&authority, &grant(RUN_ID, NODE));
    let node = TestNode::serve(
        node.dir.clone(),
        config.clone(),
        std::sync::Arc::new(RecordingExecutor::default()),
        std::sync::Arc::new(certistack_connector::clock::SystemClock),
    )
    .await;
    let mut run = run_client(&authority, &node, &credentials).await;
    run.begin_run(begin_request(&credentials)).await.unwrap();
    let mut node = node;
    node.stop().await;
    // 900 records: the budget of a 1,000-record journal, the last 100 kept for cleanup.
    {
        let run_dir = config.paths.state_dir.join("runs").join(RUN_ID);
        let (mut journal, _, _) = Journal::open(&run_dir, RUN_ID, 1).unwrap();
        for n in 0..899 {
            journal
                .append(
                    n,
                    &Op::parse("guest.qmp"),
                    &Resource::parse(&format!("vm:{VMID}")),
                    Phase::Done,
                    serde_json::Value::Null,
                )
                .unwrap();
        }
    }
    let executor = std::sync::Arc::new(RecordingExecutor::default());
    let node = TestNode::serve(
        node.dir.clone(),
        config,
        executor.clone(),
        std::sync::Arc::new(certistack_connector::clock::SystemClock),
    )
    .await;
    let mut run = run_client(&authority, &node, &credentials).await;
    assert_status(
        run.create_overlay(pb::CreateOverlayRequest {
            vmid: VMID,
            archive: ARCHIVE.into(),
        })
        .await,
        Code::ResourceExhausted,
        "journaled 900 records",
    );
    run.unmap_backup(pb::UnmapBackupRequest {
        archive: ARCHIVE.into(),
    })
    .await
    .unwrap();
    let mut operator = operator(&authority, &node).await;
    operator
        .cleanup(pb::CleanupRequest {
            run_id: RUN_ID.into(),
        })
        .await
        .unwrap();
    assert_eq!(executor.rpcs(), ["UnmapBackup", "Cleanup"]);
}

/// What open runs together may ask of the node is bounded at BeginRun.
#[tokio::test]
async fn open_runs_together_may_not_ask_for_more_sandbox_cores_or_memory_than_the_node_allows() {
    let (dir, authority, mut config) = enrolled_node("sandbox-cap");
    // Each test grant asks for one VM of 2 vCPUs and 2048 MiB.
    config.limits.max_sandbox_cores = 3;
    let node = TestNode::serve(
        dir.0.join("node"),
        config,
        std::sync::Arc::new(RecordingExecutor::default()),
        std::sync::Arc::new(certistack_connector::clock::SystemClock),
    )
    .await;
    let first = mint(&authority, &grant(RUN_ID, NODE));
    let mut first_client = run_client(&authority, &node, &first).await;
    first_client.begin_run(begin_request(&first)).await.unwrap();
    let mut wire = grant("11111111-2222-4333-8444-555555555555", NODE);
    wire.vnet = "csbox2".into();
    wire.sandbox_vms[0].vmid = 9200;
    wire.snapshot = "vm/101/2026-11-01T02:00:00Z".into();
    let second = mint(&authority, &wire);
    let mut second_client = run_client(&authority, &node, &second).await;
    assert_status(
        second_client.begin_run(begin_request(&second)).await,
        Code::ResourceExhausted,
        "asks for 2 vCPUs and 2048 MiB for its sandbox VMs; open runs already hold 2 vCPUs and 2048 MiB of the node's 3 vCPUs",
    );
    first_client.end_run(pb::EndRunRequest {}).await.unwrap();
    second_client
        .begin_run(begin_request(&second))
        .await
        .unwrap();
}

/// ListRuns does not read journals (an open run's is answered from memory, a closed run's
/// from its index entry); ReadJournal streams the file and verifies the chain as it goes.
#[tokio::test]
async fn list_runs_reads_no_journal_and_read_journal_verifies_while_streaming() {
    let dir = TempDir::new("list-stream");
    let authority = controller(&dir.0);
    let node = TestNode::start(&authority, &dir.0.join("node"), NODE).await;
    let state = node.config.paths.state_dir.clone();
    let closed = mint(&authority, &grant(RUN_ID, NODE));
    let mut closed_client = run_client(&authority, &node, &closed).await;
    closed_client
        .begin_run(begin_request(&closed))
        .await
        .unwrap();
    closed_client.end_run(pb::EndRunRequest {}).await.unwrap();
    let open_id = "11111111-2222-4333-8444-555555555555";
    let mut wire = grant(open_id, NODE);
    wire.vnet = "csbox2".into();
    wire.sandbox_vms[0].vmid = 9200;
    wire.snapshot = "vm/101/2026-11-01T02:00:00Z".into();
    let open = mint(&authority, &wire);
    run_client(&authority, &node, &open)
        .await
        .begin_run(begin_request(&open))
        .await
        .unwrap();
    // Both journals become unreadable on disk.
    let closed_journal = certistack_connector::runs::closed_run_dir(
        &state,
        &certistack_core::validate::RunId::validate(RUN_ID).unwrap(),
    )
    .join(journal::FILE_NAME);
    let text = std::fs::read_to_string(&closed_journal).unwrap();
    std::fs::write(
        &closed_journal,
        text.replacen("grant_sha256", "grant_sha257", 1),
    )
    .unwrap();
    std::fs::remove_file(state.join("runs").join(open_id).join(journal::FILE_NAME)).unwrap();

    let mut operator = operator(&authority, &node).await;
    let runs = operator
        .list_runs(pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .runs;
    let listed: Vec<(&str, i32, usize)> = runs
        .iter()
        .map(|r| (r.run_id.as_str(), r.state, r.open_resources.len()))
        .collect();
    assert_eq!(
        listed,
        [
            (RUN_ID, pb::RunState::Closed as i32, 0),
            (open_id, pb::RunState::Open as i32, 0)
        ],
        "{runs:?}"
    );

    let mut stream = operator
        .read_journal(pb::ReadJournalRequest {
            run_id: RUN_ID.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let status = stream.message().await.unwrap_err();
    assert_eq!(status.code(), Code::DataLoss, "{status:?}");
    assert!(
        status.message().contains("record 1 is invalid"),
        "{status:?}"
    );
}

/// The service manager's side of `Type=notify`: a datagram socket standing for systemd.
struct NotifySocket {
    socket: std::os::unix::net::UnixDatagram,
    path: PathBuf,
}

impl NotifySocket {
    fn bind(dir: &Path) -> Self {
        let path = dir.join("notify.sock");
        let socket = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        socket
            .set_read_timeout(Some(std::time::Duration::from_millis(200)))
            .unwrap();
        Self { socket, path }
    }

    /// The next message, waiting up to `within`.
    fn next(&self, within: std::time::Duration) -> Option<String> {
        let until = std::time::Instant::now() + within;
        let mut buf = [0u8; 4096];
        while std::time::Instant::now() < until {
            if let Ok(n) = self.socket.recv(&mut buf) {
                return Some(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        }
        None
    }
}

fn start_time_of(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 1..];
    rest.split_whitespace().nth(19).unwrap().parse().unwrap()
}

/// Started with NOTIFY_SOCKET and WATCHDOG_USEC as systemd starts a `Type=notify` unit with
/// `WatchdogSec=`: READY=1 comes only once the step a previous daemon was interrupted in is
/// settled (its tool killed, the journal saying so), WATCHDOG=1 follows at half the
/// interval, and SIGTERM brings STOPPING=1 before the daemon exits cleanly.
#[tokio::test(flavor = "multi_thread")]
async fn notifies_ready_after_recovery_feeds_the_watchdog_and_says_stopping() {
    let (dir, authority, config) = enrolled_node("sd-notify");
    let run_id = runs_on_disk(&authority, &config, 1, false).await.remove(0);
    // A tool of the interrupted step, still running as it would after a crash.
    let mut tool = Command::new("sleep")
        .arg("300")
        .process_group(0)
        .spawn()
        .unwrap();
    // A guest network recovery's appliance, which holds the overlay open, interrupted too.
    let mut appliance = Command::new("sleep")
        .arg("300")
        .process_group(0)
        .spawn()
        .unwrap();
    {
        let key = load_authority_key(&config.tls.run_authority_public_key).unwrap();
        let now_ms = now().unix_timestamp() * 1000;
        let registry = RunRegistry::open(
            &config.paths.state_dir,
            &key,
            RegistryLimits::from_config(&config.limits),
            now_ms,
        )
        .unwrap();
        let run = registry.get(&RunId::validate(&run_id).unwrap()).unwrap();
        let mut guard = run.lock().await;
        for (op, pid) in [
            ("overlay.create", tool.id()),
            ("guestnet.recover", appliance.id()),
        ] {
            guard
                .append(
                    now_ms,
                    &Op::parse(op),
                    &Resource::parse(&format!("overlay:{VMID}:{ARCHIVE}")),
                    Phase::Intent,
                    serde_json::json!({ "tool": {
                        "pid": pid, "start_time": start_time_of(pid), "process_group": pid,
                    }}),
                )
                .await
                .unwrap();
        }
    }
    let notify = NotifySocket::bind(&dir.0);
    let port = free_port();
    let config_path = dir.0.join("connector.toml");
    write_config_file(&config_path, &config, port);
    let mut daemon = Command::new(binary("certistack-connector"))
        .args(["--config", config_path.to_str().unwrap(), "serve"])
        .env("NOTIFY_SOCKET", &notify.path)
        .env("WATCHDOG_USEC", "400000")
        .env_remove("WATCHDOG_PID")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let first = notify.next(std::time::Duration::from_secs(20));
    // Whatever came first, READY=1 must not precede the recovery's effects.
    let mut seen = Vec::new();
    let mut message = first;
    while let Some(m) = message.clone() {
        seen.push(m.clone());
        if m.lines().any(|l| l == "READY=1") {
            break;
        }
        message = notify.next(std::time::Duration::from_secs(20));
    }
    assert!(message.is_some(), "no READY=1 in {seen:?}");
    assert!(
        tool.try_wait().unwrap().is_some(),
        "READY=1 came while the interrupted step's tool was still running"
    );
    let journal = std::fs::read_to_string(journal_of(&config, &run_id)).unwrap();
    assert!(
        journal.contains("outcome_unknown"),
        "READY=1 came before the interrupted step was journaled as settled: {journal}"
    );
    assert!(
        appliance.try_wait().unwrap().is_some(),
        "READY=1 came while an interrupted guest network recovery's appliance still held the overlay"
    );
    assert!(
        journal
            .lines()
            .any(|l| l.contains("guestnet.recover") && l.contains("outcome_unknown")),
        "the interrupted guest network recovery was not journaled as settled: {journal}"
    );
    // The daemon serves once ready.
    let operator = authority.issue_operator("alice", now()).unwrap();
    client_when_up(&authority, &format!("127.0.0.1:{port}"), &operator).await;

    // Pings at half of the 400 ms interval: at least 4 in a second.
    let started = std::time::Instant::now();
    let mut pings = 0;
    while started.elapsed() < std::time::Duration::from_secs(1) {
        if let Some(m) = notify.next(std::time::Duration::from_millis(300))
            && m.lines().any(|l| l == "WATCHDOG=1")
        {
            pings += 1;
        }
    }
    assert!((4..=7).contains(&pings), "{pings} WATCHDOG=1 in one second");

    Command::new("kill")
        .args(["-TERM", &daemon.id().to_string()])
        .status()
        .unwrap();
    let mut stopping = false;
    while let Some(m) = notify.next(std::time::Duration::from_secs(5)) {
        if m.lines().any(|l| l == "STOPPING=1") {
            stopping = true;
            break;
        }
    }
    assert!(stopping, "no STOPPING=1 after SIGTERM");
    assert!(daemon.wait().unwrap().success());
}

/// The daemon's log once `needle` appeared in it `count` times (5 s at most).
async fn log_has(log_path: &Path, needle: &str, count: usize) -> String {
    for _ in 0..100 {
        let log = std::fs::read_to_string(log_path).unwrap();
        if log.matches(needle).count() >= count {
            return log;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!(
        "{needle:?} not logged {count} time(s): {}",
        std::fs::read_to_string(log_path).unwrap()
    );
}

/// The node certificate the connector at `address` presents to a new connection.
async fn presented_certificate(authority: &Authority, address: &str) -> Vec<u8> {
    let operator = authority.issue_operator("alice", now()).unwrap();
    let config = raw_client_config(authority, &[&rustls::version::TLS13], Some(&operator));
    let tcp = tokio::net::TcpStream::connect(address).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(
            rustls_pki_types::ServerName::try_from(NODE.to_owned()).unwrap(),
            tcp,
        )
        .await
        .unwrap();
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

fn pem_to_der(pem: &str) -> Vec<u8> {
    certistack_core::tls::parse_certificates(pem, "certificate").unwrap()[0].to_vec()
}

/// Renewal under a live run: new files and SIGHUP, and the next connection is served with
/// the new certificate while the open run goes on; then each bad set (unparsable, a key
/// that is not the certificate's, expired, issued by another CA) is refused with a log
/// line saying what, and the node keeps serving with the renewed set.
#[tokio::test(flavor = "multi_thread")]
async fn sighup_renews_the_certificate_under_a_live_run_and_refuses_a_bad_set() {
    let (dir, authority, config) = enrolled_node("sighup");
    let port = free_port();
    let address = format!("127.0.0.1:{port}");
    let config_path = dir.0.join("connector.toml");
    write_config_file(&config_path, &config, port);
    let log_path = dir.0.join("connector.log");
    let mut daemon = Command::new(binary("certistack-connector"))
        .args(["--config", config_path.to_str().unwrap(), "serve"])
        .env_remove("CERTISTACK_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    struct Stop(u32);
    impl Drop for Stop {
        fn drop(&mut self) {
            let _ = Command::new("kill")
                .args(["-TERM", &self.0.to_string()])
                .status();
        }
    }
    let _stop = Stop(daemon.id());
    let hangup = || {
        Command::new("kill")
            .args(["-HUP", &daemon.id().to_string()])
            .status()
            .unwrap();
    };
    let credentials = mint(&authority, &grant(RUN_ID, NODE));
    let mut run = client_when_up(&authority, &address, &credentials.certificate).await;
    run.begin_run(begin_request(&credentials)).await.unwrap();
    let original = std::fs::read_to_string(&config.tls.certificate).unwrap();
    assert_eq!(
        presented_certificate(&authority, &address).await,
        pem_to_der(&original)
    );

    // Renewal: the same node key, a new certificate from the same CA.
    let csr = certistack_connector::enroll::certificate_request(&config).unwrap();
    let renewed = authority.sign_node_csr(&csr, NODE, now()).unwrap();
    std::fs::write(&config.tls.certificate, &renewed).unwrap();
    hangup();
    log_has(&log_path, "reloaded node certificate", 1).await;
    assert_eq!(
        presented_certificate(&authority, &address).await,
        pem_to_der(&renewed)
    );
    assert_ne!(pem_to_der(&renewed), pem_to_der(&original));
    // The run opened before the renewal goes on, over a new connection too.
    let mut again = client(&authority, &address, NODE, &credentials.certificate)
        .await
        .unwrap();
    let identity = authority.issue_operator("alice", now()).unwrap();
    let mut operator = client(&authority, &address, NODE, &identity).await.unwrap();
    let listed = operator
        .list_runs(pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .runs;
    assert!(
        listed
            .iter()
            .any(|r| r.run_id == RUN_ID && r.state == pb::RunState::Open as i32),
        "{listed:?}"
    );

    // Bad sets, each refused with what is wrong; the renewed set stays in use.
    let other_dir = TempDir::new("sighup-other-ca");
    let other = controller(&other_dir.0);
    let expired = authority
        .sign_node_csr(&csr, NODE, now() - time::Duration::days(500))
        .unwrap();
    let from_other_ca = other.sign_node_csr(&csr, NODE, now()).unwrap();
    let original_key = std::fs::read(&config.tls.private_key).unwrap();
    let other_key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
        .unwrap()
        .serialize_pem();
    let cases: [(&str, String, Option<String>, &str); 4] = [
        (
            "unparsable",
            "not a certificate".into(),
            None,
            "no PEM certificate",
        ),
        (
            "key of another certificate",
            renewed.clone(),
            Some(other_key),
            "TLS configuration rejected",
        ),
        ("expired", expired, None, "is not valid now"),
        (
            "issued by another CA",
            from_other_ca,
            None,
            "was not issued by the controller CA",
        ),
    ];
    for (refusals, (what, certificate, key, reason)) in cases.into_iter().enumerate() {
        std::fs::write(&config.tls.certificate, &certificate).unwrap();
        std::fs::write(
            &config.tls.private_key,
            key.as_deref().map(str::as_bytes).unwrap_or(&original_key),
        )
        .unwrap();
        hangup();
        let log = log_has(
            &log_path,
            "refused the certificate set on disk",
            refusals + 1,
        )
        .await;
        let last = log
            .lines()
            .rfind(|l| l.contains("refused the certificate set on disk"))
            .unwrap();
        assert!(last.contains(reason), "{what}: {last}");
        assert_eq!(
            presented_certificate(&authority, &address).await,
            pem_to_der(&renewed),
            "{what}: the node stopped serving the renewed set"
        );
        std::fs::write(&config.tls.private_key, &original_key).unwrap();
    }
    // The run's next call works, and ends it.
    again.end_run(pb::EndRunRequest {}).await.unwrap();
    drop(run);
    Command::new("kill")
        .args(["-TERM", &daemon.id().to_string()])
        .status()
        .unwrap();
    assert!(daemon.wait().unwrap().success());
}
