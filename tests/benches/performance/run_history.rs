//! Section `run-history`: the controller's run history (`history::sqlite::SqliteStore`, what
//! `certistack-ctl history` reads) holding 100,000 validations of 1,000 VMs (100 nights each,
//! one failure in ten): the per-VM summary `history` prints, one VM's first page and a page deep
//! in, and the whole `certistack-ctl history` command; then what the store costs per
//! validation: rows, bytes, and the two synced writes a run makes (its `running` row and its
//! end) on this machine's disk.
//!
//! The 100,000 are written through the store's own writes into a file on tmpfs (where a sync
//! costs nothing), then the file is copied to the disk the reads are timed on.
//!
//! Run: `cargo build --release --bins && cargo bench -p certistack-tests --bench performance -- run-history`

use super::{Samples, Settings, heading, ms, ratio};
use certistack_controller::history::sqlite::SqliteStore;
use certistack_controller::history::{Cursor, RunStore};
use certistack_controller::verdict::{
    CleanupState, HistoryWriter, Outcome, StepTiming, ValidationEnded, ValidationStarted,
};
use certistack_tests::*;
use std::time::{Duration, Instant};

const DAY_MS: i64 = 86_400_000;
const NOW_MS: i64 = 1_796_000_000_000;

fn validation(run: u64, vmid: u32, night: i64) -> ValidationEnded {
    let at = NOW_MS - night * DAY_MS + i64::from(vmid) * 1_000;
    let restore = 20_000 + (run % 7) as i64 * 1_000;
    let step = |name: String, from: i64, to: i64| StepTiming {
        name,
        started_unix_ms: at + from,
        ended_unix_ms: at + to,
        result: "ok".into(),
    };
    let failed = run % 10 == 3;
    ValidationEnded {
        started: ValidationStarted {
            run_id: format!("00000000-0000-4000-8000-{run:012}"),
            plan_run_id: format!("11111111-1111-4111-8111-{night:012}"),
            validation: format!("app-{vmid}"),
            node: format!("pve{}", vmid % 8 + 1),
            source_vmid: vmid,
            snapshot: format!("vm/{vmid}/2026-12-01T02:00:00Z"),
            started_unix_ms: at,
            deadline_unix_ms: at + 3_600_000,
        },
        outcome: if failed {
            Outcome::Failed
        } else {
            Outcome::Passed
        },
        cleanup: CleanupState::Complete,
        reasons: if failed {
            vec![format!(
                "probe tcp://10.99.0.10:22 failed: connect to 10.99.0.10:22 failed: No route to host (os error 113)"
            )]
        } else {
            Vec::new()
        },
        ended_unix_ms: at + restore + 8_000,
        // The steps of a real validation: 16, as the lab's.
        steps: [
            ("doctor", 0, 100),
            ("credentials", 100, 110),
            ("connect", 110, 150),
            ("begin", 150, 160),
            ("map drive-scsi0.img", 1_000, 2_000),
            ("overlay drive-scsi0.img", 2_000, 2_100),
            ("create 9101", 2_100, 2_600),
            ("prepare sandbox", 2_600, 2_700),
            ("start 9101", 2_700, 3_000),
            ("guest agent 9101", 3_000, 1_000 + restore),
            ("qmp status 9101", 1_000 + restore, 1_010 + restore),
            ("probe tcp://10.99.0.10:22", 1_010 + restore, 1_100 + restore),
            ("stop 9101", 1_100 + restore, 2_000 + restore),
            ("destroy 9101", 2_000 + restore, 2_500 + restore),
            ("unmap drive-scsi0.img", 2_500 + restore, 2_600 + restore),
            ("journal", 2_600 + restore, 2_700 + restore),
        ]
        .into_iter()
        .map(|(name, from, to)| step(name.into(), from, to))
        .collect(),
        report: Some(
            format!(
                "/var/lib/certistack/reports/20261201T020000Z-pve1-00000000-0000-4000-8000-{run:012}.json"
            )
            .into(),
        ),
        report_sha256: Some(format!("{:064x}", run)),
    }
}

fn file_bytes(path: &std::path::Path) -> u64 {
    ["", "-wal", "-shm"]
        .iter()
        .filter_map(|suffix| std::fs::metadata(format!("{}{suffix}", path.display())).ok())
        .map(|meta| meta.len())
        .sum()
}

pub async fn run_history(settings: &Settings) {
    let (vms, nights): (u32, i64) = if settings.short {
        (100, 100)
    } else {
        (1_000, 100)
    };
    let total = u64::from(vms) * nights as u64;
    let iterations = if settings.short { 5 } else { 21 };

    // Filled through the store's writes, on tmpfs.
    let shm = std::path::PathBuf::from(format!("/dev/shm/certistack-bench-{}", std::process::id()));
    std::fs::create_dir_all(&shm).unwrap();
    let filled = shm.join("history.sqlite");
    let fill_started = Instant::now();
    {
        let store = SqliteStore::open(&filled, Duration::from_secs(10)).unwrap();
        let mut run = 0u64;
        for night in (1..=nights).rev() {
            for vmid in 0..vms {
                let ended = validation(run, 1_000 + vmid, night);
                store.validation_started(&ended.started).unwrap();
                store.validation_ended(&ended).unwrap();
                run += 1;
            }
        }
    }
    let fill = fill_started.elapsed();
    let dir = TempDir::new("bench-run-history");
    let state = dir.0.join("state");
    std::fs::create_dir_all(&state).unwrap();
    let path = state.join("history.sqlite");
    for suffix in ["", "-wal", "-shm"] {
        let from = format!("{}{suffix}", filled.display());
        if std::path::Path::new(&from).exists() {
            std::fs::copy(&from, format!("{}{suffix}", path.display())).unwrap();
        }
    }
    let _ = std::fs::remove_dir_all(&shm);
    let bytes = file_bytes(&path);

    let store = SqliteStore::open(&path, Duration::from_secs(10)).unwrap();
    let now = NOW_MS + DAY_MS;
    let mut summary = Samples::default();
    let mut first_page = Samples::default();
    let mut deep_page = Samples::default();
    let deep_cursor = Cursor {
        started_unix_ms: NOW_MS - 80 * DAY_MS + 1_000_000,
        run_id: "ffffffff-ffff-4fff-8fff-ffffffffffff".into(),
    };
    let mut vms_seen = 0;
    for _ in 0..iterations {
        let started = Instant::now();
        vms_seen = store.vm_summaries(now).unwrap().len();
        summary.push(started.elapsed());
        let started = Instant::now();
        let page = store.validations_of(1_000, None, 20, now).unwrap();
        first_page.push(started.elapsed());
        assert_eq!(page.validations.len(), 20);
        let started = Instant::now();
        let page = store
            .validations_of(1_000, Some(&deep_cursor), 20, now)
            .unwrap();
        deep_page.push(started.elapsed());
        assert_eq!(page.validations.len(), 20);
    }
    assert_eq!(vms_seen, vms as usize);

    // The whole command, as an operator runs it.
    std::fs::write(
        dir.0.join("controller.toml"),
        format!(
            "state_dir = {:?}\nreports_dir = {:?}\n",
            state,
            dir.0.join("reports")
        ),
    )
    .unwrap();
    let mut command = Samples::default();
    let mut command_json = Samples::default();
    for _ in 0..iterations.min(7) {
        for (json, samples) in [(false, &mut command), (true, &mut command_json)] {
            let started = Instant::now();
            let mut args = vec!["history", "--config", "controller.toml"];
            if json {
                args.push("--json");
            }
            let out = std::process::Command::new(binary("certistack-ctl"))
                .args(&args)
                .current_dir(&dir.0)
                .output()
                .unwrap();
            samples.push(started.elapsed());
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    // The writes of one validation on this disk: its running row, then its end, each synced.
    let writes_dir = TempDir::new("bench-run-history-writes");
    let writes = SqliteStore::open(
        &writes_dir.0.join("history.sqlite"),
        Duration::from_secs(10),
    )
    .unwrap();
    let mut per_validation = Samples::default();
    for run in 0..if settings.short { 20 } else { 200 } {
        let ended = validation(10_000_000 + run, 5_000, 1);
        let started = Instant::now();
        writes.validation_started(&ended.started).unwrap();
        writes.validation_ended(&ended).unwrap();
        per_validation.push(started.elapsed());
    }

    heading(&format!(
        "run-history: {total} validations of {vms} VMs in the run history (SQLite, {iterations} runs each)"
    ));
    println!("| read | median | p99 | vs goal |");
    println!("|---|---|---|---|");
    let goal = Duration::from_millis(100);
    println!(
        "| per-VM summary of {vms} VMs (`history`'s table) | {} | {} | {} of 100 ms |",
        ms(summary.median()),
        ms(summary.p99()),
        ratio(summary.median(), goal)
    );
    println!(
        "| one VM's first page (20, newest first) | {} | {} | |",
        ms(first_page.median()),
        ms(first_page.p99())
    );
    println!(
        "| one VM's page 80 nights back (after a token) | {} | {} | |",
        ms(deep_page.median()),
        ms(deep_page.p99())
    );
    println!(
        "| `certistack-ctl history` (the process, table) | {} | {} | |",
        ms(command.median()),
        ms(command.p99())
    );
    println!(
        "| `certistack-ctl history --json` | {} | {} | |",
        ms(command_json.median()),
        ms(command_json.p99())
    );
    println!("\nWhat the store costs per validation:\n");
    println!("| cost | value |");
    println!("|---|---|");
    println!(
        "| rows | 1 in `validations` (and its VM's one row in `vms`, shared by its validations) |"
    );
    println!(
        "| bytes on disk (16 steps, a report path and digest; file and WAL) | {} ({:.1} MiB for {total}) |",
        bytes / total,
        bytes as f64 / (1024.0 * 1024.0)
    );
    println!(
        "| writes of one validation on this disk (running row, then its end; each a synced transaction) | median {}, p99 {} |",
        ms(per_validation.median()),
        ms(per_validation.p99())
    );
    println!(
        "| filling {total} through the same writes on tmpfs (no sync cost) | {} ({} per validation) |",
        ms(fill),
        ms(fill / u32::try_from(total).unwrap_or(u32::MAX))
    );
}
