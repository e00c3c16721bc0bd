//! The run history's conformance suite, which every backend of `history::RunStore` passes
//! (each check on a fresh, empty store), run here on SQLite; then what only a file has: an
//! empty file migrated, a file that is not a history, one from a newer version and one locked
//! by another process refused, saying what to do, and the file private to its owner.

use super::*;
use certistack_controller::history::sqlite::SqliteStore;
use certistack_controller::history::{Cursor, RowState, RunStore, StoreError, Streak};
use certistack_controller::verdict::HistoryWriter;
use certistack_controller::verdict::{
    CleanupState, Outcome, PlanRunStarted, StepTiming, ValidationEnded, ValidationStarted,
};
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

const DAY_MS: i64 = 86_400_000;
const NOW_MS: i64 = 1_796_000_000_000;

fn started(run: u32, vmid: u32, at: i64) -> ValidationStarted {
    ValidationStarted {
        run_id: format!("00000000-0000-4000-8000-{run:012}"),
        plan_run_id: "11111111-1111-4111-8111-111111111111".into(),
        validation: format!("app-{vmid}"),
        node: "pve1".into(),
        source_vmid: vmid,
        snapshot: format!("vm/{vmid}/2026-12-01T02:00:00Z"),
        started_unix_ms: at,
        deadline_unix_ms: at + 3_600_000,
    }
}

/// Steps whose restore time (map start to the guest agent's answer) is `restore_ms`.
fn steps(at: i64, restore_ms: i64) -> Vec<StepTiming> {
    let step = |name: &str, from: i64, to: i64| StepTiming {
        name: name.into(),
        started_unix_ms: at + from,
        ended_unix_ms: at + to,
        result: "ok".into(),
    };
    vec![
        step("doctor", 0, 100),
        step("map drive-scsi0.img", 1_000, 2_000),
        step("start 9101", 2_000, 3_000),
        step("guest agent 9101", 3_000, 1_000 + restore_ms),
        step(
            "probe tcp://10.99.0.10:22",
            1_000 + restore_ms,
            2_000 + restore_ms,
        ),
    ]
}

fn ended(start: &ValidationStarted, outcome: Outcome, restore_ms: i64) -> ValidationEnded {
    ValidationEnded {
        started: start.clone(),
        outcome,
        cleanup: CleanupState::Complete,
        reasons: match outcome {
            Outcome::Passed => vec![],
            _ => vec!["probe tcp://10.99.0.10:22 failed: connection refused".into()],
        },
        ended_unix_ms: start.started_unix_ms + restore_ms + 5_000,
        steps: steps(start.started_unix_ms, restore_ms),
        report: Some(format!("/var/lib/certistack/reports/{}.json", start.run_id).into()),
        report_sha256: Some("ab".repeat(32)),
    }
}

/// The suite: every backend passes each check, on a fresh store.
mod suite {
    use super::*;

    pub type Check = fn(&dyn RunStore);

    pub const ALL: &[(&str, Check)] = &[
        ("idempotent writes", idempotent_writes),
        ("pages", pages),
        ("interrupted rows", interrupted_rows),
        ("per-VM summary", per_vm_summary),
        ("bounded text", bounded_text),
    ];

    fn idempotent_writes(store: &dyn RunStore) {
        let plan = PlanRunStarted {
            plan_run_id: "11111111-1111-4111-8111-111111111111".into(),
            plan: "nightly.yaml".into(),
            plan_sha256: "cd".repeat(32),
            started_unix_ms: NOW_MS - DAY_MS,
        };
        store.plan_started(&plan).unwrap();
        store.plan_started(&plan).unwrap();
        let start = started(1, 110, NOW_MS - DAY_MS);
        store.validation_started(&start).unwrap();
        store.validation_started(&start).unwrap();
        let page = store
            .validations_of(110, None, 10, NOW_MS - DAY_MS)
            .unwrap();
        assert_eq!(page.validations.len(), 1);
        assert_eq!(page.validations[0].state, RowState::Running);
        let end = ended(&start, Outcome::Passed, 30_000);
        store.validation_ended(&end).unwrap();
        store.validation_ended(&end).unwrap();
        // A start written again after the end (a retried write) keeps the end.
        store.validation_started(&start).unwrap();
        store.plan_ended(&plan.plan_run_id, NOW_MS).unwrap();
        let page = store.validations_of(110, None, 10, NOW_MS).unwrap();
        assert_eq!(page.validations.len(), 1, "{page:?}");
        let row = &page.validations[0];
        assert_eq!(row.state, RowState::Passed);
        assert_eq!(row.restore_ms, Some(30_000));
        assert_eq!(row.cleanup.as_deref(), Some("complete"));
        assert_eq!(row.report_sha256.as_deref(), Some("ab".repeat(32).as_str()));
        assert_eq!(row.steps.len(), 5);
        // An end without a start (a validation that failed before any node) is a whole row.
        let lone = started(2, 111, NOW_MS - 1_000);
        store
            .validation_ended(&ended(&lone, Outcome::Failed, 0))
            .unwrap();
        let page = store.validations_of(111, None, 10, NOW_MS).unwrap();
        assert_eq!(page.validations[0].state, RowState::Failed);
        // An id the history does not key by is refused, and nothing is written.
        let mut bad = started(3, 112, NOW_MS);
        bad.run_id = "../../etc".into();
        assert!(store.validation_started(&bad).is_err());
        assert!(
            store
                .validations_of(112, None, 10, NOW_MS)
                .unwrap()
                .validations
                .is_empty()
        );
    }

    fn pages(store: &dyn RunStore) {
        // 45 validations of one VM, two of them started in the same millisecond.
        for night in 0..45u32 {
            let at = NOW_MS - i64::from(45 - night) * DAY_MS;
            let start = started(night, 120, if night == 44 { at - DAY_MS } else { at });
            store
                .validation_ended(&ended(&start, Outcome::Passed, 20_000))
                .unwrap();
        }
        store
            .validation_ended(&ended(&started(99, 121, NOW_MS), Outcome::Passed, 1))
            .unwrap();
        let mut seen = Vec::new();
        let mut after: Option<Cursor> = None;
        let mut pages = 0;
        loop {
            let page = store
                .validations_of(120, after.as_ref(), 20, NOW_MS)
                .unwrap();
            pages += 1;
            assert!(page.validations.len() <= 20);
            seen.extend(page.validations.iter().map(|row| {
                assert_eq!(row.source_vmid, 120);
                (row.started_unix_ms, row.run_id.clone())
            }));
            match page.next {
                Some(token) => after = Some(Cursor::parse(&token).unwrap()),
                None => break,
            }
        }
        assert_eq!(pages, 3);
        assert_eq!(seen.len(), 45, "every validation once");
        let mut sorted = seen.clone();
        sorted.sort_by(|a, b| b.cmp(a));
        assert_eq!(seen, sorted, "newest first, ties by run id");
        assert!(store.validations_of(120, None, 0, NOW_MS).is_err());
        assert!(store.validations_of(120, None, 100_000, NOW_MS).is_err());
    }

    fn interrupted_rows(store: &dyn RunStore) {
        // A controller killed mid-validation: the row stays running until its deadline, then
        // reads interrupted.
        let start = started(1, 130, NOW_MS - 7_200_000);
        store.validation_started(&start).unwrap();
        let before = store
            .validations_of(130, None, 10, start.deadline_unix_ms - 1)
            .unwrap();
        assert_eq!(before.validations[0].state, RowState::Running);
        let after = store.validations_of(130, None, 10, NOW_MS).unwrap();
        assert_eq!(after.validations[0].state, RowState::Interrupted);
        let summary = store.vm_summaries(NOW_MS).unwrap();
        assert_eq!(summary[0].last_state, RowState::Interrupted);
        assert_eq!(summary[0].streak, None);
    }

    fn per_vm_summary(store: &dyn RunStore) {
        // VM 140: passes with restores of 20 s, then a failure, then three passes, the last
        // one slower (40 s over a median of 20 s).
        let nights = [
            (Outcome::Passed, 20_000),
            (Outcome::Passed, 20_000),
            (Outcome::Failed, 0),
            (Outcome::Error, 0),
            (Outcome::Passed, 19_000),
            (Outcome::Passed, 21_000),
            (Outcome::Passed, 40_000),
        ];
        for (night, (outcome, restore)) in nights.iter().enumerate() {
            let at = NOW_MS - (7 - night as i64) * DAY_MS;
            let start = started(night as u32, 140, at);
            store
                .validation_ended(&ended(&start, *outcome, *restore))
                .unwrap();
        }
        // VM 141: only failures.
        for night in 0..2 {
            let start = started(100 + night, 141, NOW_MS - DAY_MS * i64::from(2 - night));
            store
                .validation_ended(&ended(&start, Outcome::Failed, 0))
                .unwrap();
        }
        let summaries = store.vm_summaries(NOW_MS).unwrap();
        let vmids: Vec<u32> = summaries.iter().map(|s| s.source_vmid).collect();
        assert_eq!(vmids, [140, 141]);
        let vm = &summaries[0];
        assert_eq!(vm.validation, "app-140");
        assert_eq!(vm.last_state, RowState::Passed);
        assert_eq!(
            vm.streak,
            Some(Streak {
                verdict: RowState::Passed,
                count: 3
            })
        );
        assert_eq!(vm.last_restore_ms, Some(40_000));
        // The median of the four passes before it: 19, 20, 20, 21 s.
        assert_eq!(vm.restore_trend, Some(2.0));
        assert_eq!(
            vm.last_passed_unix_ms,
            Some(NOW_MS - DAY_MS + 40_000 + 5_000)
        );
        assert_eq!(vm.last_failed_unix_ms, Some(NOW_MS - 5 * DAY_MS + 5_000));
        let failing = &summaries[1];
        assert_eq!(
            failing.streak,
            Some(Streak {
                verdict: RowState::Failed,
                count: 2
            })
        );
        // Two validations of one VM begun in the same millisecond (two validations of a plan,
        // at once): ordered by run id, as pages are; the newer one's streak is one.
        let at = NOW_MS - 1_000;
        store
            .validation_ended(&ended(&started(200, 142, at), Outcome::Failed, 0))
            .unwrap();
        store
            .validation_ended(&ended(&started(201, 142, at), Outcome::Passed, 9_000))
            .unwrap();
        let tied = &store.vm_summaries(NOW_MS).unwrap()[2];
        assert_eq!(
            tied.streak,
            Some(Streak {
                verdict: RowState::Passed,
                count: 1
            }),
            "{tied:?}"
        );
        // Two validations of one VM (each with its own checks): one's pass does not hide the
        // other's failure.
        let mut other = started(300, 142, at + 10);
        other.validation = "app-142-ldap".into();
        store
            .validation_ended(&ended(&other, Outcome::Failed, 0))
            .unwrap();
        let summaries = store.vm_summaries(NOW_MS).unwrap();
        let of_142: Vec<(&str, Option<i64>)> = summaries
            .iter()
            .filter(|s| s.source_vmid == 142)
            .map(|s| (s.validation.as_str(), s.last_passed_unix_ms))
            .collect();
        assert_eq!(of_142.len(), 2, "{summaries:?}");
        assert_eq!(of_142[0].0, "app-142");
        assert!(of_142[0].1.is_some());
        assert_eq!(of_142[1], ("app-142-ldap", None));
        assert_eq!(failing.last_passed_unix_ms, None);
        assert_eq!(failing.last_restore_ms, None);
        assert_eq!(failing.restore_trend, None);
    }

    fn bounded_text(store: &dyn RunStore) {
        // A cursor move, an erase, OSC 52 (clipboard), a hyperlink, CSI in C1 and a
        // right-to-left override.
        const TERMINAL_SEQUENCES: &str = "\x1b[1A\x1b[2Kverdict: passed\x1b]52;c;aGk=\x07\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\\u{9b}2J\u{202e}";
        let acts_on_a_terminal = |text: &str| {
            text.chars().any(|c| {
                c.is_control()
                    || ('\u{202a}'..='\u{202e}').contains(&c)
                    || ('\u{2066}'..='\u{2069}').contains(&c)
            })
        };
        let start = started(1, 150, NOW_MS - 1_000);
        let mut end = ended(&start, Outcome::Failed, 0);
        end.reasons = (0..100)
            .map(|_| format!("banner {TERMINAL_SEQUENCES}{}", "x".repeat(100_000)))
            .collect();
        end.started.validation = format!("app{TERMINAL_SEQUENCES}");
        store.validation_ended(&end).unwrap();
        let row = &store
            .validations_of(150, None, 1, NOW_MS)
            .unwrap()
            .validations[0];
        assert!(row.reasons.len() <= certistack_controller::history::MAX_REASONS);
        for reason in &row.reasons {
            assert!(!acts_on_a_terminal(reason), "{reason}");
            assert!(reason.chars().count() < 4_096, "{}", reason.len());
        }
        assert!(!acts_on_a_terminal(&row.validation), "{}", row.validation);
    }
}

fn sqlite(dir: &TempDir) -> SqliteStore {
    SqliteStore::open(&dir.0.join("history.sqlite"), Duration::from_secs(2)).unwrap()
}

#[test]
fn sqlite_passes_the_run_store_conformance_suite() {
    for (name, check) in suite::ALL {
        let dir = TempDir::new("history");
        let store = sqlite(&dir);
        eprintln!("conformance: {name}");
        check(&store);
    }
}

#[test]
fn an_empty_file_is_migrated_and_the_history_is_private_to_its_owner() {
    let dir = TempDir::new("history");
    let path = dir.0.join("history.sqlite");
    std::fs::write(&path, b"").unwrap();
    let store = SqliteStore::open(&path, Duration::from_secs(2)).unwrap();
    store.validation_started(&started(1, 160, NOW_MS)).unwrap();
    drop(store);
    // Opened again, the same history: nothing migrated twice, nothing lost.
    let store = SqliteStore::open(&path, Duration::from_secs(2)).unwrap();
    assert_eq!(
        store
            .validations_of(160, None, 10, NOW_MS)
            .unwrap()
            .validations
            .len(),
        1
    );
    let fresh = dir.0.join("fresh.sqlite");
    let _made = SqliteStore::open(&fresh, Duration::from_secs(2)).unwrap();
    for file in [&fresh, &path] {
        let mode = std::fs::metadata(file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", file.display());
    }
}

#[test]
fn a_file_that_is_not_a_history_a_newer_one_and_a_locked_one_are_refused_saying_what_to_do() {
    let dir = TempDir::new("history");
    // Not a database.
    let corrupt = dir.0.join("corrupt.sqlite");
    std::fs::write(&corrupt, vec![0x5a; 8192]).unwrap();
    let error = SqliteStore::open(&corrupt, Duration::from_secs(1)).unwrap_err();
    assert!(matches!(error, StoreError::Corrupt { .. }), "{error}");
    assert!(error.to_string().contains("move it aside"), "{error}");
    // Unchanged by the attempt.
    assert_eq!(std::fs::read(&corrupt).unwrap(), vec![0x5a; 8192]);

    // A newer schema.
    let newer = dir.0.join("newer.sqlite");
    drop(SqliteStore::open(&newer, Duration::from_secs(1)).unwrap());
    let other = rusqlite::Connection::open(&newer).unwrap();
    other.execute_batch("PRAGMA user_version = 99").unwrap();
    drop(other);
    let error = SqliteStore::open(&newer, Duration::from_secs(1)).unwrap_err();
    assert!(
        matches!(error, StoreError::Newer { found: 99, .. }),
        "{error}"
    );
    assert!(
        error.to_string().contains("newer certistack-ctl"),
        "{error}"
    );

    // Locked by another process's write: a write waits, then is refused.
    let locked = dir.0.join("locked.sqlite");
    let store = SqliteStore::open(&locked, Duration::from_millis(300)).unwrap();
    let holder = rusqlite::Connection::open(&locked).unwrap();
    holder.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let error = store
        .validation_started(&started(1, 170, NOW_MS))
        .unwrap_err();
    assert!(error.0.contains("locked by another process"), "{error}");
    // Reading goes on meanwhile (`history` while a `run` writes).
    let reader = SqliteStore::open(&locked, Duration::from_millis(300)).unwrap();
    assert!(
        reader
            .validations_of(170, None, 10, NOW_MS)
            .unwrap()
            .validations
            .is_empty()
    );
    holder.execute_batch("ROLLBACK").unwrap();
    store.validation_started(&started(1, 170, NOW_MS)).unwrap();
}

#[test]
fn two_processes_opening_a_new_history_at_once_both_succeed_and_reading_changes_nothing() {
    for round in 0..20 {
        let dir = TempDir::new("history-race");
        let path = dir.0.join("history.sqlite");
        let openers: Vec<_> = (0..2)
            .map(|_| {
                let path = path.clone();
                std::thread::spawn(move || {
                    SqliteStore::open(&path, Duration::from_secs(5)).map(drop)
                })
            })
            .collect();
        for opener in openers {
            opener
                .join()
                .unwrap()
                .unwrap_or_else(|error| panic!("round {round}: {error}"));
        }
        // Read: the database and its log stay as they were (the log may hold the migration:
        // when both openers close at once, neither may find itself the last connection that
        // folds the log into the database; the next writer does).
        let wal = format!("{}-wal", path.display());
        // SQLite may lay an empty log beside the database: absent and empty are alike.
        let digest = |file: &str| {
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
                std::fs::read(file).unwrap_or_default(),
            ))
        };
        let database = path.display().to_string();
        let before = (digest(&database), digest(&wal));
        let reader = SqliteStore::open_for_reading(&path, Duration::from_secs(1)).unwrap();
        assert!(reader.vm_summaries(NOW_MS).unwrap().is_empty());
        drop(reader);
        assert_eq!(
            before,
            (digest(&database), digest(&wal)),
            "round {round}: reading changed the database or its log"
        );
    }
}
