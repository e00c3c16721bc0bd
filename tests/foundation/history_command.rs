//! `certistack-ctl run` writes its history, and `certistack-ctl history` reads it: a run against
//! an unreachable node leaves an `error` row (written before the grant, ended after); the per-VM
//! table, one VM's pages, `--json`, and `--max-age-hours` as the nightly alarm with its exit
//! codes; a history file that is not one, or a bad page token, refused saying what to do.

use super::*;
use certistack_controller::history::sqlite::SqliteStore;
use certistack_controller::history::{FILE_NAME, RowState, RunStore};
use certistack_controller::verdict::{
    CleanupState, HistoryWriter, Outcome, StepTiming, ValidationEnded, ValidationStarted,
};
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

/// A controller whose one node listens nowhere, and a plan written out for VM 100 on it.
pub(super) struct Controller {
    pub(super) dir: TempDir,
}

impl Controller {
    pub(super) fn new() -> Self {
        let dir = TempDir::new("history-ctl");
        let closed = free_local_port();
        std::fs::write(
            dir.0.join("controller.toml"),
            format!(
                "state_dir = {:?}\nreports_dir = {:?}\n\n[[nodes]]\nname = \"pve1\"\naddress = \"127.0.0.1\"\nport = {closed}\n",
                dir.0.join("state"),
                dir.0.join("reports")
            ),
        )
        .unwrap();
        let state = dir.0.join("state");
        let (code, _, err) = run_binary(
            "certistack-ctl",
            &["ca", "init", "--state-dir", state.to_str().unwrap()],
        );
        assert_eq!(code, 0, "{err}");
        let secret = dir.0.join("pbs-password");
        std::fs::write(&secret, "s3cret\n").unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(
            dir.0.join("nightly.yaml"),
            format!(
                "storage:\n  server: pbs.example.net\n  datastore: backups\n  auth_id: \"certistack@pbs!restore\"\n  fingerprint: \"{}\"\n  pbs_password_file: pbs-password\nvalidations:\n  - name: web01\n    node: pve1\n    source_vmid: 100\n    snapshot: \"2026-12-01T02:00:00Z\"\n    archives: [drive-scsi0.img]\n    sandbox:\n      - vmid: 9100\n        cores: 1\n        memory_mib: 512\n    network:\n      lifecycle: preprovisioned\n      vnet: csnet1\n      probe_source: 10.99.0.1/24\n    network_recovery:\n      mode: preserve\n",
                ["ab"; 32].join(":")
            ),
        )
        .unwrap();
        Self { dir }
    }

    pub(super) fn ctl(&self, args: &[&str]) -> (i32, String, String) {
        let out = std::process::Command::new(binary("certistack-ctl"))
            .args(args)
            .args(["--config", "controller.toml"])
            .current_dir(&self.dir.0)
            .env_remove("CERTISTACK_LOG")
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    pub(super) fn history_file(&self) -> std::path::PathBuf {
        self.dir.0.join("state").join(FILE_NAME)
    }
}

fn now_ms() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// A passed validation of `vmid`, `hours_ago`, with a restore of `restore_ms`.
fn passed(store: &SqliteStore, run: u32, vmid: u32, hours_ago: i64, restore_ms: i64) {
    let at = now_ms() - hours_ago * 3_600_000;
    let step = |name: &str, from: i64, to: i64| StepTiming {
        name: name.into(),
        started_unix_ms: at + from,
        ended_unix_ms: at + to,
        result: "ok".into(),
    };
    let started = ValidationStarted {
        run_id: format!("00000000-0000-4000-8000-{run:012}"),
        plan_run_id: "22222222-2222-4222-8222-222222222222".into(),
        validation: format!("db{vmid}"),
        node: "pve1".into(),
        source_vmid: vmid,
        snapshot: format!("vm/{vmid}/2026-12-01T02:00:00Z"),
        started_unix_ms: at,
        deadline_unix_ms: at + 3_600_000,
    };
    store
        .validation_ended(&ValidationEnded {
            started,
            outcome: Outcome::Passed,
            cleanup: CleanupState::Complete,
            reasons: Vec::new(),
            ended_unix_ms: at + restore_ms + 5_000,
            steps: vec![
                step("map drive-scsi0.img", 0, 1_000),
                step("guest agent 9100", 1_000, restore_ms),
            ],
            report: None,
            report_sha256: None,
        })
        .unwrap();
}

/// The page token of VM 100's oldest validation: nothing comes after it.
fn rows_token(controller: &Controller) -> String {
    let (_, out, _) = controller.ctl(&["history", "100", "--json"]);
    let page: serde_json::Value = serde_json::from_str(&out).unwrap();
    let oldest = page["validations"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    format!(
        "{}.{}",
        oldest["started_unix_ms"],
        oldest["run_id"].as_str().unwrap()
    )
}

#[test]
fn a_run_writes_its_history_and_history_answers_from_it() {
    let controller = Controller::new();
    // Before any run: nothing, and the alarm rings for a VM with no validation at all.
    let (code, out, err) = controller.ctl(&["history"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("no validation in the history"), "{out}");
    assert!(
        !controller.history_file().exists(),
        "reading creates nothing"
    );
    let (code, _, err) = controller.ctl(&["history", "100", "--max-age-hours", "24"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("VM 100: no validation in the history"),
        "{err}"
    );

    // Two runs against a node that does not answer: an error row each.
    for _ in 0..2 {
        let (code, out, err) = controller.ctl(&["run", "nightly.yaml"]);
        assert_eq!(code, 2, "{out}{err}");
        assert!(!err.contains("history: not written"), "{err}");
    }
    let mode = std::fs::metadata(controller.history_file())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let store = SqliteStore::open(&controller.history_file(), Duration::from_secs(2)).unwrap();
    let page = store.validations_of(100, None, 10, now_ms()).unwrap();
    assert_eq!(page.validations.len(), 2, "{page:?}");
    for row in &page.validations {
        assert_eq!(row.state, RowState::Error, "{row:?}");
        assert_eq!(row.validation, "web01");
        assert_eq!(row.node, "pve1");
        assert_eq!(row.snapshot, "vm/100/2026-12-01T02:00:00Z");
        assert!(row.ended_unix_ms.is_some());
        assert!(row.reasons[0].contains("pve1"), "{:?}", row.reasons);
        assert!(
            row.steps.iter().any(|step| step.name == "doctor"),
            "{row:?}"
        );
        // The deadline a killed controller's row would be judged by is after the run's.
        assert!(row.deadline_unix_ms > row.started_unix_ms + 600_000);
    }

    // VM 200 passed tonight and last night, the second restore slower.
    passed(&store, 1, 200, 30, 20_000);
    passed(&store, 2, 200, 6, 30_000);
    let (code, out, err) = controller.ctl(&["history"]);
    assert_eq!(code, 0, "{out}{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("VMID"), "{out}");
    assert!(
        lines[1].starts_with("100 ") && lines[1].contains("web01") && lines[1].contains("error"),
        "{out}"
    );
    assert!(lines[1].contains("never"), "{out}");
    assert!(
        lines[2].starts_with("200 ")
            && lines[2].contains("5 h 59 min ago")
            && lines[2].contains("passed ×2")
            && lines[2].contains("30.0 s")
            && lines[2].contains("1.50×"),
        "{out}"
    );
    let (code, out, err) = controller.ctl(&["history", "--json"]);
    assert_eq!(code, 0, "{err}");
    let document: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(document["vms"][1]["source_vmid"], 200);
    assert_eq!(document["vms"][1]["last_restore_ms"], 30_000);
    assert_eq!(document["vms"][0]["last_state"], "error");

    // The alarm: VM 100 never passed; VM 200 passed 6 h ago.
    let (code, _, err) = controller.ctl(&["history", "--max-age-hours", "24"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("VM 100 (web01) never passed"), "{err}");
    assert!(!err.contains("VM 200"), "{err}");
    let (code, _, err) = controller.ctl(&["history", "200", "--max-age-hours", "24"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = controller.ctl(&["history", "200", "--max-age-hours", "2"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("VM 200 (db200) last passed 5 h 59 min ago"),
        "{err}"
    );

    // One VM's pages, newest first, followed by their tokens.
    let (code, out, err) = controller.ctl(&["history", "100", "--limit", "1"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.lines().nth(1).unwrap().contains("error"), "{out}");
    let token = out
        .lines()
        .last()
        .unwrap()
        .strip_prefix("more: certistack-ctl history 100 --after ")
        .unwrap_or_else(|| panic!("{out}"))
        .to_owned();
    let (code, out, err) = controller.ctl(&["history", "100", "--limit", "1", "--after", &token]);
    assert_eq!(code, 0, "{err}");
    assert!(out.ends_with("(end of VM 100's history)\n"), "{out}");
    let last = rows_token(&controller);
    let (code, out, err) = controller.ctl(&["history", "100", "--after", &last]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("after that token: the history ends before it"),
        "{out}"
    );
    let (code, out, err) = controller.ctl(&["history", "100", "--json"]);
    assert_eq!(code, 0, "{err}");
    let page: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(page["validations"].as_array().unwrap().len(), 2);
    assert!(page["next"].is_null());

    // Refusals: a bad token (usage), a history that is not one (what to do).
    let (code, _, err) = controller.ctl(&["history", "100", "--after", "yesterday"]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("page token"), "{err}");
    drop(store);
    for suffix in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", controller.history_file().display()));
    }
    std::fs::write(controller.history_file(), vec![0x5a; 4096]).unwrap();
    let (code, _, err) = controller.ctl(&["history"]);
    assert_eq!(code, 66, "{err}");
    assert!(err.contains("move it aside"), "{err}");
    let (code, out, err) = controller.ctl(&["run", "nightly.yaml"]);
    assert_eq!(code, 66, "a run refuses before anything: {out}{err}");
    assert_eq!(
        std::fs::read(controller.history_file()).unwrap(),
        vec![0x5a; 4096]
    );
}

/// `text` read by Prometheus' own parser (`prometheus_client.parser`, Debian's
/// python3-prometheus-client): each sample as `name{labels} value`, labels sorted.
fn parsed_by_prometheus(text: &str) -> Vec<String> {
    let script = r#"
import sys
from prometheus_client.parser import text_string_to_metric_families
for family in text_string_to_metric_families(sys.stdin.read()):
    assert family.type == "gauge", family.name
    assert family.documentation, family.name
    for sample in family.samples:
        labels = ",".join('%s="%s"' % kv for kv in sorted(sample.labels.items()))
        print("%s{%s} %r" % (sample.name, labels, sample.value))
"#;
    let mut child = std::process::Command::new("/usr/bin/python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("/usr/bin/python3 (tests/prepare-machine.sh installs python3-prometheus-client)");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "Prometheus' parser refused the file: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn each_run_replaces_the_metrics_file_node_exporter_reads() {
    if !has_files(
        "each_run_replaces_the_metrics_file_node_exporter_reads",
        &[(
            "/usr/lib/python3/dist-packages/prometheus_client/parser.py",
            "python3-prometheus-client",
        )],
    ) {
        return;
    }
    let controller = Controller::new();
    let config = controller.dir.0.join("controller.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    // Refused with what to do: node_exporter reads only *.prom files.
    std::fs::write(
        &config,
        format!("{text}\n[outputs]\nmetrics_textfile = \"metrics/certistack.txt\"\n"),
    )
    .unwrap();
    let (code, _, err) = controller.ctl(&["run", "nightly.yaml"]);
    assert_eq!(code, 78, "{err}");
    assert!(err.contains("reads only *.prom files"), "{err}");
    std::fs::write(
        &config,
        format!("{text}\n[outputs]\nmetrics_textfile = \"metrics/certistack.prom\"\n"),
    )
    .unwrap();
    let metrics = controller.dir.0.join("metrics");
    std::fs::create_dir(&metrics).unwrap();
    let file = metrics.join("certistack.prom");

    let (code, out, err) = controller.ctl(&["run", "nightly.yaml"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(!err.contains("metrics: not written"), "{err}");
    let first = std::fs::read_to_string(&file).unwrap();
    let samples = parsed_by_prometheus(&first);
    for expected in [
        "certistack_vm_last_pass_timestamp_seconds{validation=\"web01\",vmid=\"100\"} 0.0",
        "certistack_vm_last_state{state=\"error\",validation=\"web01\",vmid=\"100\"} 1.0",
        "certistack_run_validations{verdict=\"error\"} 1.0",
        "certistack_run_validations{verdict=\"passed\"} 0.0",
        "certistack_run_cleanup_unproven{} 0.0",
        "certistack_run_history_write_failures{} 0.0",
        "certistack_metrics_vms_left_out{} 0.0",
    ] {
        assert!(
            samples.iter().any(|s| s == expected),
            "{expected} not in {samples:#?}"
        );
    }
    use std::os::unix::fs::MetadataExt;
    let before = std::fs::metadata(&file).unwrap();
    assert_eq!(before.mode() & 0o777, 0o644);

    // A pass of VM 200 in the history, then the next run: the file is replaced whole.
    let store = SqliteStore::open(&controller.history_file(), Duration::from_secs(2)).unwrap();
    passed(&store, 7, 200, 3, 12_000);
    drop(store);
    let (code, _, err) = controller.ctl(&["run", "nightly.yaml"]);
    assert_eq!(code, 2, "{err}");
    let after = std::fs::metadata(&file).unwrap();
    assert_ne!(
        before.ino(),
        after.ino(),
        "replaced by a rename, not rewritten in place"
    );
    let names: Vec<_> = std::fs::read_dir(&metrics)
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect();
    assert_eq!(names, ["certistack.prom"], "nothing left beside it");
    let samples = parsed_by_prometheus(&std::fs::read_to_string(&file).unwrap());
    let pass = samples
        .iter()
        .find(|s| {
            s.starts_with(
                "certistack_vm_last_pass_timestamp_seconds{validation=\"db200\",vmid=\"200\"}",
            )
        })
        .unwrap_or_else(|| panic!("{samples:#?}"));
    let at: f64 = pass.rsplit_once(' ').unwrap().1.parse().unwrap();
    let hours = (now_ms() as f64 / 1000.0 - at) / 3600.0;
    assert!((2.9..3.1).contains(&hours), "{pass}: {hours} h ago");
    assert!(
        samples
            .iter()
            .any(|s| s == "certistack_vm_restore_seconds{validation=\"db200\",vmid=\"200\"} 12.0"),
        "{samples:#?}"
    );
    assert!(
        samples.iter().any(|s| s
            == "certistack_vm_streak{validation=\"db200\",verdict=\"passed\",vmid=\"200\"} 1.0"),
        "{samples:#?}"
    );
}

/// One `run` at a time per state directory: while another holds the run lock (here this test,
/// as a running `certistack-ctl run` would), a second is refused with exit 75, naming the
/// holder, before it asks anything of anyone (no history is even opened); once the holder is
/// gone (however it ended) the next run proceeds.
#[test]
fn a_second_run_on_one_state_directory_is_refused_while_the_first_holds_the_lock() {
    use certistack_controller::plan_run::{RUN_LOCK_FILE, lock_state_dir};
    let controller = Controller::new();
    let state = controller.dir.0.join("state");
    let held = lock_state_dir(
        &state,
        std::path::Path::new("nightly.yaml"),
        time::OffsetDateTime::now_utc(),
    )
    .unwrap();
    let (code, out, err) = controller.ctl(&["run", "nightly.yaml"]);
    assert_eq!(code, 75, "{out}{err}");
    assert!(
        err.contains("another `certistack-ctl run` is running with this state directory")
            && err.contains(&format!(
                "pid {}, plan nightly.yaml, since ",
                std::process::id()
            ))
            && err.contains(RUN_LOCK_FILE)
            && err.contains("then run again"),
        "{err}"
    );
    assert!(
        !controller.history_file().exists(),
        "a refused run opened the history"
    );
    assert!(
        std::fs::read_dir(controller.dir.0.join("reports")).is_err(),
        "a refused run wrote a report"
    );
    drop(held);
    let (code, out, err) = controller.ctl(&["run", "nightly.yaml"]);
    assert_eq!(
        code, 2,
        "the unreachable node, once the lock is free: {out}{err}"
    );
    assert!(controller.history_file().exists());
    let mode = std::fs::metadata(state.join(RUN_LOCK_FILE))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

/// The packaged controller runs as its own user; a `run` started as root on its state
/// directory is refused before it creates anything there (exit 77, naming the owner and
/// `runuser`), and a lock file another user left is refused saying whose it is, instead of
/// failing every later night with a write error.
#[test]
fn a_run_lock_of_another_user_is_refused_naming_its_owner() {
    if !privileged(
        "a_run_lock_of_another_user_is_refused_naming_its_owner",
        &[],
    ) {
        return;
    }
    use certistack_controller::plan_run::RUN_LOCK_FILE;
    let controller = Controller::new();
    let state = controller.dir.0.join("state");
    let nobody = rustix::process::Uid::from_raw(65534);
    let chown = |path: &std::path::Path, uid| {
        rustix::fs::chown(path, Some(uid), None).unwrap();
    };
    // The state directory is another user's: nothing is created in it.
    chown(&state, nobody);
    let (code, out, err) = controller.ctl(&["run", "nightly.yaml"]);
    assert_eq!(code, 77, "{out}{err}");
    assert!(
        err.contains("is owned by uid 65534") && err.contains("runuser -u"),
        "{err}"
    );
    assert!(!state.join(RUN_LOCK_FILE).exists());
    assert!(!controller.history_file().exists());
    chown(&state, rustix::process::geteuid());
    // A lock file another user left.
    std::fs::write(state.join(RUN_LOCK_FILE), "pid 1\n").unwrap();
    chown(&state.join(RUN_LOCK_FILE), nobody);
    let (code, out, err) = controller.ctl(&["run", "nightly.yaml"]);
    assert_eq!(code, 77, "{out}{err}");
    assert!(
        err.contains(RUN_LOCK_FILE) && err.contains("is owned by uid 65534"),
        "{err}"
    );
    assert!(!controller.history_file().exists());
}
