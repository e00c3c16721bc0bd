//! Tests of the run registry: BeginRun and EndRun made durable, half-made runs removed, closed
//! runs sharded, paged and pruned, the state-directory lock, grant overlap.

use super::handle::lock_journal;
use super::state_lock::LOCK_FILE;
use super::*;
use certistack_core::fixtures::{full_wire_grant, sign};
use certistack_core::grant::Grant;
use certistack_core::journal::{self, JournalError, Phase, Record};
use certistack_core::journal::{Op, Resource};
use certistack_core::validate::RunId;
use certistack_proto::v1 as pb;
use ed25519_dalek::SigningKey;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

static SYNCED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Every directory fsync'd through [`sync_dir`], so tests can see which were.
pub(crate) fn synced(dir: &Path) {
    SYNCED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(dir.to_owned());
}

pub(super) static CLOSED_READS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Every closed run read and every listing of closed runs, so tests can see that a start
/// reads none.
pub(crate) fn closed_read(path: &Path) {
    CLOSED_READS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(path.to_owned());
}

pub(super) fn closed_reads_under(dir: &Path) -> usize {
    CLOSED_READS
        .lock()
        .unwrap()
        .iter()
        .filter(|path| path.starts_with(dir))
        .count()
}

fn synced_count(dir: &Path) -> usize {
    SYNCED.lock().unwrap().iter().filter(|d| *d == dir).count()
}

/// The closed runs' ids, page by page, and the number of pages.
fn all_closed(registry: &RunRegistry, page_size: usize) -> (Vec<RunId>, usize) {
    let (mut ids, mut pages, mut after) = (Vec::new(), 0, None);
    loop {
        let (page, next) = registry.closed_page(after.as_ref(), page_size).unwrap();
        pages += 1;
        assert!(page.len() <= page_size);
        ids.extend(page.into_iter().map(|(id, _)| id));
        match next {
            Some(next) => after = Some(next),
            None => return (ids, pages),
        }
    }
}

/// `count` runs begun and ended, in a fresh registry; their ids, sorted.
pub(super) async fn closed_runs(tag: &str, count: u32) -> (PathBuf, RunRegistry, Vec<RunId>) {
    let dir = state_dir(tag);
    let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
    let mut ids = Vec::new();
    for n in 0..count {
        let (signed, grant) = nth_grant(n);
        let run_id = grant.run_id.clone();
        registry.begin(&signed, grant, 2_000_000).await.unwrap();
        registry.end(&run_id, 2_000_500).await.unwrap();
        ids.push(run_id);
    }
    ids.sort();
    (dir, registry, ids)
}

#[tokio::test(flavor = "multi_thread")]
async fn closed_runs_page_in_run_id_order_with_a_cursor() {
    let (dir, registry, ids) = closed_runs("page", 7).await;
    // An open run is not a closed run's page.
    let (signed, grant) = nth_grant(20);
    registry.begin(&signed, grant, 2_000_000).await.unwrap();
    let (first, next) = registry.closed_page(None, 3).unwrap();
    let first: Vec<RunId> = first.into_iter().map(|(id, _)| id).collect();
    assert_eq!(first, ids[..3]);
    assert_eq!(
        next.as_ref(),
        Some(&ids[2]),
        "the cursor is the page's last run"
    );
    let (second, _) = registry.closed_page(next.as_ref(), 3).unwrap();
    assert_eq!(second.first().map(|(id, _)| id), Some(&ids[3]));
    assert_eq!(all_closed(&registry, 3), (ids.clone(), 3));
    // A page exactly as long as what is left is the last one: no cursor.
    assert_eq!(all_closed(&registry, 7), (ids.clone(), 1));
    assert_eq!(all_closed(&registry, 1000), (ids.clone(), 1));
    // After the last run: an empty last page.
    let (after_last, next) = registry.closed_page(ids.last(), 3).unwrap();
    assert!(after_last.is_empty() && next.is_none());
    // Each entry is the run's summary.
    let (page, _) = registry.closed_page(None, 1).unwrap();
    assert_eq!(page[0].1.closed_by, "run.end");
    assert_eq!(page[0].1.records, 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A start lists and reads no closed run, even when every closed run's files are garbage;
/// each is still known as closed when asked about by its id, and listed when listed.
#[tokio::test(flavor = "multi_thread")]
async fn a_start_reads_no_closed_run_and_finds_each_when_asked() {
    let (dir, registry, ids) = closed_runs("start-flat", 5).await;
    drop(registry);
    for run_id in &ids {
        let closed = closed_run_dir(&dir, run_id);
        assert!(closed.is_dir(), "closed runs leave runs/");
        assert!(!dir.join("runs").join(run_id.as_str()).exists());
        for file in [SUMMARY_FILE, GRANT_FILE, journal::FILE_NAME] {
            std::fs::write(closed.join(file), b"garbage\n").unwrap();
        }
    }
    let before = closed_reads_under(&dir);
    let reopened = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
    assert_eq!(
        closed_reads_under(&dir),
        before,
        "the start read or listed a closed run"
    );
    assert!(reopened.quarantined().is_empty());
    assert!(reopened.open_runs().is_empty());
    for run_id in &ids {
        assert!(reopened.is_closed(run_id));
        assert_eq!(
            reopened.journal_path(run_id),
            Some(closed_run_dir(&dir, run_id).join(journal::FILE_NAME))
        );
    }
    let (grant_signed, grant) = nth_grant(0);
    assert!(matches!(
        reopened.begin(&grant_signed, grant, 2_000_000).await,
        Err(RunError::Closed(_))
    ));
    assert_eq!(all_closed(&reopened, 2).0, ids);
    assert!(closed_reads_under(&dir) > before);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every state a crash during BeginRun can leave before its last sync: a directory with no
/// grant, no journal, an empty journal, or a first record whose grant entry was lost. The
/// next start removes each; a complete run and a run with more records stay.
#[tokio::test(flavor = "multi_thread")]
async fn a_begin_run_interrupted_before_its_last_sync_is_removed_at_start() {
    let dir = state_dir("half-made");
    let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(8), 0).unwrap();
    let mut made = Vec::new();
    for n in 0..6 {
        let (signed, grant) = nth_grant(n);
        made.push(grant.run_id.clone());
        registry.begin(&signed, grant, 2_000_000).await.unwrap();
    }
    hold(&registry, &made[5], "backup:drive-scsi0.img").await;
    drop(registry);
    let run_dir = |n: usize| dir.join("runs").join(made[n].as_str());
    // 0: only the run directory.
    std::fs::remove_file(run_dir(0).join(GRANT_FILE)).unwrap();
    std::fs::remove_file(run_dir(0).join(journal::FILE_NAME)).unwrap();
    // 1: the grant, no journal.
    std::fs::remove_file(run_dir(1).join(journal::FILE_NAME)).unwrap();
    // 2: the grant and an empty journal (the first record never reached the disk).
    std::fs::write(run_dir(2).join(journal::FILE_NAME), b"").unwrap();
    // 3: the first record, its grant's entry lost.
    std::fs::remove_file(run_dir(3).join(GRANT_FILE)).unwrap();
    // 4: complete (the crash came after the last sync, before the reply): kept, open.
    // 5: its grant lost after an operation: not half-made, quarantined.
    std::fs::remove_file(run_dir(5).join(GRANT_FILE)).unwrap();
    let reopened = RunRegistry::open(&dir, &key().verifying_key(), limits(8), 0).unwrap();
    for (n, run_id) in made.iter().enumerate().take(4) {
        assert!(!run_dir(n).exists(), "half-made run {n} was kept");
        assert!(reopened.get(run_id).is_none());
        assert!(!reopened.is_closed(run_id));
        assert!(reopened.quarantine(run_id).is_none());
    }
    assert!(reopened.get(&made[4]).is_some());
    assert!(reopened.quarantine(&made[5]).is_some());
    assert!(synced_count(&dir.join("runs")) >= 1);
    // The controller's retry of the BeginRun that never answered starts the run afresh.
    let (signed, grant) = nth_grant(0);
    assert!(!reopened.begin(&signed, grant, 2_000_000).await.unwrap());
    assert_eq!(journal_ops(&dir, &made[0]), ["run.begin"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A failed BeginRun leaves nothing behind, so its retry is not refused by its own debris.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_begin_run_leaves_no_directory_and_can_be_retried() {
    let dir = state_dir("begin-fails");
    let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
    let (signed, grant) = nth_grant(0);
    let run_dir = dir.join("runs").join(grant.run_id.as_str());
    // The journal cannot be created: a directory stands where it goes.
    std::fs::create_dir_all(run_dir.join(journal::FILE_NAME)).unwrap();
    assert!(
        registry
            .begin(&signed, grant.clone(), 2_000_000)
            .await
            .is_err()
    );
    assert!(!run_dir.exists());
    assert!(!registry.begin(&signed, grant, 2_000_000).await.unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_retention_sweep_goes_in_bounded_batches() {
    let dir = state_dir("sweep");
    let mut bounded = limits(1);
    bounded.closed_run_retention_days = 1;
    let registry = RunRegistry::open(&dir, &key().verifying_key(), bounded, 0).unwrap();
    let mut ids = Vec::new();
    for n in 0..5 {
        let (signed, grant) = nth_grant(n);
        let run_id = grant.run_id.clone();
        registry.begin(&signed, grant, 2_000_000).await.unwrap();
        // Closed a day apart.
        registry
            .end(&run_id, 2_000_500 + i64::from(n) * 86_400_000)
            .await
            .unwrap();
        ids.push(run_id);
    }
    let now = 2_000_501 + 3 * 86_400_000;
    // Closed on days 0, 1 and 2 are past a day's retention at day 3.
    let mut due = ids[..3].to_vec();
    due.sort();
    let (first, next) = registry.prune_batch(now, None, 2).unwrap();
    let next = next.expect("two of five examined: more follow");
    let (rest, last) = registry.prune_batch(now, Some(&next), 2).unwrap();
    let (tail, end) = registry.prune_batch(now, last.as_ref(), 2).unwrap();
    assert!(end.is_none());
    let mut pruned: Vec<RunId> = [first, rest, tail].concat();
    pruned.sort();
    assert_eq!(pruned, due);
    for run_id in &ids {
        assert_eq!(closed_run_dir(&dir, run_id).exists(), !due.contains(run_id));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

pub(super) fn state_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("certistack-runs-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

pub(super) fn key() -> SigningKey {
    SigningKey::from_bytes(&[1; 32])
}

/// The `n`th of a set of grants that share nothing on the node.
pub(super) fn nth_grant(n: u32) -> (pb::SignedRunGrant, Grant) {
    let mut wire = full_wire_grant();
    if n > 0 {
        wire.run_id = format!("11111111-2222-4333-8444-{n:012}");
        wire.vnet = format!("csbox{}", n + 1);
        wire.sandbox_vms[0].vmid = 9100 + n * 10;
        wire.snapshot = format!("vm/{}/2026-11-01T02:00:00Z", 100 + n);
    }
    let signed = sign(&key(), &wire);
    let grant = certistack_core::grant::verify(&signed, &key().verifying_key()).unwrap();
    (signed, grant)
}

/// A registry in a fresh state directory, holding the first grant's run open.
pub(super) async fn registry_with_open_run(tag: &str) -> (PathBuf, RunRegistry, RunId) {
    let dir = state_dir(tag);
    let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
    let (signed, grant) = nth_grant(0);
    let run_id = grant.run_id.clone();
    registry.begin(&signed, grant, 2_000_000).await.unwrap();
    (dir, registry, run_id)
}

pub(super) fn limits(max_open: usize) -> RegistryLimits {
    RegistryLimits {
        max_open,
        ..RegistryLimits::default()
    }
}

/// The operations in the journal of `run_id`, open or closed.
fn journal_ops(dir: &Path, run_id: &RunId) -> Vec<String> {
    let open = dir.join("runs").join(run_id.as_str());
    let run_dir = if open.exists() {
        open
    } else {
        closed_run_dir(dir, run_id)
    };
    let path = run_dir.join(journal::FILE_NAME);
    journal::read(&path, run_id.as_str())
        .unwrap()
        .records
        .into_iter()
        .map(|r| r.entry.op.as_str().to_owned())
        .collect()
}

pub(super) async fn hold(registry: &RunRegistry, run_id: &RunId, resource: &str) {
    let run = registry.get(run_id).unwrap();
    let mut guard = run.lock().await;
    guard
        .intent(
            1,
            &Op::BackupMap,
            &Resource::parse(resource),
            serde_json::Value::Null,
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn closed_runs_stay_closed_across_reopen() {
    let dir = state_dir("closed");
    let (signed, grant) = nth_grant(0);
    let run_id = grant.run_id.clone();

    let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
    assert!(
        !registry
            .begin(&signed, grant.clone(), 2_000_000)
            .await
            .unwrap()
    );
    assert!(
        registry
            .begin(&signed, grant.clone(), 2_000_000)
            .await
            .unwrap(),
        "same grant resumes"
    );
    let open_journal = registry.journal_path(&run_id).unwrap();
    assert_ne!(open_journal, registry.closed_journal_path(&run_id));
    registry.end(&run_id, 2_000_500).await.unwrap();
    assert!(matches!(
        registry.begin(&signed, grant.clone(), 2_000_000).await,
        Err(RunError::Closed(_))
    ));
    assert!(registry.get(&run_id).is_none(), "a closed run is not held");
    // ReadJournal looks at the closed place when a run closes under it: the journal is there.
    assert_eq!(
        registry.journal_path(&run_id),
        Some(registry.closed_journal_path(&run_id))
    );
    assert!(!open_journal.exists());
    assert!(registry.closed_journal_path(&run_id).is_file());

    let reopened = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
    assert!(reopened.is_closed(&run_id));
    assert!(matches!(
        reopened.begin(&signed, grant.clone(), 2_000_000).await,
        Err(RunError::Closed(_))
    ));
    assert!(matches!(
        reopened.end(&run_id, 1).await,
        Err(RunError::Closed(_))
    ));
    assert_eq!(journal_ops(&dir, &run_id), ["run.begin", "run.end"]);
    let (closed, _) = reopened.closed_page(None, 10).unwrap();
    assert_eq!(closed.len(), 1);
    assert_eq!(
        (
            closed[0].1.records,
            closed[0].1.closed_by.as_str(),
            closed[0].1.deadline_unix
        ),
        (2, "run.end", 4_600)
    );
    // Even with a rotated run-authority key, the closed marker still refuses the run.
    let rotated = RunRegistry::open(
        &dir,
        &SigningKey::from_bytes(&[9; 32]).verifying_key(),
        limits(1),
        0,
    )
    .unwrap();
    assert!(rotated.is_closed(&run_id));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_with_a_corrupt_journal_is_quarantined() {
    let dir = state_dir("corrupt");
    let (signed, grant) = nth_grant(0);
    let run_id = grant.run_id.clone();
    let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(2), 0).unwrap();
    registry
        .begin(&signed, grant.clone(), 2_000_000)
        .await
        .unwrap();
    hold(&registry, &run_id, "backup:a.img").await;
    drop(registry);
    // Alter the first record: the chain breaks before the last record.
    let path = dir
        .join("runs")
        .join(run_id.as_str())
        .join(journal::FILE_NAME);
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replacen("grant_sha256", "grant_sha257", 1);
    std::fs::write(&path, text).unwrap();

    let reopened = RunRegistry::open(&dir, &key().verifying_key(), limits(2), 0).unwrap();
    assert!(reopened.get(&run_id).is_none());
    let quarantined = reopened.quarantined();
    assert_eq!(quarantined.len(), 1);
    assert!(
        quarantined[0].1.contains("record 1 is invalid"),
        "{quarantined:?}"
    );
    assert!(matches!(
        reopened.begin(&signed, grant, 2_000_000).await,
        Err(RunError::Quarantined(..))
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn open_runs_are_bounded() {
    let dir = state_dir("max");
    let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
    let (first, first_grant) = nth_grant(0);
    registry
        .begin(&first, first_grant, 2_000_000)
        .await
        .unwrap();
    let (second, grant) = nth_grant(1);
    assert!(matches!(
        registry.begin(&second, grant.clone(), 2_000_000).await,
        Err(RunError::TooMany { open: 1, max: 1 })
    ));
    // Once the first run's deadline passed it no longer counts.
    assert!(registry.begin(&second, grant, 5_000_000).await.is_ok());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_past_its_deadline_that_holds_resources_still_counts() {
    let dir = state_dir("expired-holding");
    let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
    let (first, first_grant) = nth_grant(0);
    let first_id = first_grant.run_id.clone();
    registry
        .begin(&first, first_grant, 2_000_000)
        .await
        .unwrap();
    hold(&registry, &first_id, "backup:drive-scsi0.img").await;
    let (second, grant) = nth_grant(1);
    // 5_000 s is past the first run's deadline (4_600 s), but its mapping is still open.
    assert!(matches!(
        registry.begin(&second, grant.clone(), 5_000_000).await,
        Err(RunError::TooMany { open: 1, max: 1 })
    ));
    {
        let run = registry.get(&first_id).unwrap();
        let mut guard = run.lock().await;
        guard
            .undone(
                2,
                &Op::BackupUnmap,
                &Resource::parse("backup:drive-scsi0.img"),
                serde_json::Value::Null,
            )
            .await
            .unwrap();
    }
    assert!(registry.begin(&second, grant, 5_000_000).await.is_ok());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn open_runs_together_are_bounded_in_sandbox_cores_and_memory() {
    let dir = state_dir("sandbox");
    let mut bounded = limits(4);
    // Each grant asks for one VM of 2 vCPUs and 2048 MiB.
    bounded.max_sandbox_cores = 3;
    let registry = RunRegistry::open(&dir, &key().verifying_key(), bounded, 0).unwrap();
    let (first, grant) = nth_grant(0);
    registry.begin(&first, grant, 2_000_000).await.unwrap();
    let (second, grant) = nth_grant(1);
    match registry.begin(&second, grant.clone(), 2_000_000).await {
        Err(RunError::SandboxExhausted {
            asked_cores: 2,
            used_cores: 2,
            max_cores: 3,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    drop(registry);
    bounded.max_sandbox_cores = 4;
    bounded.max_sandbox_memory_mib = 3000;
    let registry = RunRegistry::open(&dir, &key().verifying_key(), bounded, 0).unwrap();
    let refusal = registry
        .begin(&second, grant.clone(), 2_000_000)
        .await
        .unwrap_err();
    assert!(
        refusal.to_string().contains("2048 MiB") && refusal.to_string().contains("3000 MiB"),
        "{refusal}"
    );
    bounded.max_sandbox_memory_mib = 4096;
    let registry = RunRegistry::open(&dir, &key().verifying_key(), bounded, 0).unwrap();
    assert!(registry.begin(&second, grant, 2_000_000).await.is_ok());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// EndRun waiting for the run lock while the expiry reaper's cleanup holds it, and the
/// reaper closing the run right after: one closing record, whoever wins.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_end_and_expiry_write_one_closing_record() {
    let dir = state_dir("race");
    let registry = Arc::new(RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap());
    let (signed, grant) = nth_grant(0);
    let run_id = grant.run_id.clone();
    registry.begin(&signed, grant, 2_000_000).await.unwrap();
    let run = registry.get(&run_id).unwrap();
    let cleanup = run.lock().await;
    let end = tokio::spawn({
        let (registry, run_id) = (registry.clone(), run_id.clone());
        async move { registry.end(&run_id, 2_000_100).await }
    });
    let expire = tokio::spawn({
        let (registry, run_id) = (registry.clone(), run_id.clone());
        async move { registry.expire(&run_id, 2_000_200).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    drop(cleanup);
    let results = [end.await.unwrap(), expire.await.unwrap()];
    assert_eq!(
        results.iter().filter(|r| r.is_ok()).count(),
        1,
        "{results:?}"
    );
    assert!(
        results
            .iter()
            .any(|r| matches!(r, Err(RunError::Closed(_)))),
        "{results:?}"
    );
    let closing: Vec<String> = journal_ops(&dir, &run_id)
        .into_iter()
        .filter(|op| Op::parse(op).closes_run())
        .collect();
    assert_eq!(closing.len(), 1, "{closing:?}");
    // Nothing is recorded after the closing record, not even by an operation that held a
    // handle from before.
    let mut late = run.lock().await;
    assert!(matches!(
        late.done(
            3,
            &Op::RunCleanup,
            &Resource::parse("run:x"),
            serde_json::Value::Null
        )
        .await,
        Err(JournalError::Closed(_))
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Proves the directory fsyncs are issued, not that the disk honours them: that would
/// need a power cut.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_run_directory_entry_is_synced() {
    let dir = state_dir("sync");
    let registry = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
    let (signed, grant) = nth_grant(0);
    let run_id = grant.run_id.clone();
    registry.begin(&signed, grant, 2_000_000).await.unwrap();
    let synced = SYNCED.lock().unwrap().clone();
    assert!(
        synced.contains(&dir.join("runs")),
        "runs/ was not fsync'd after the run's directory was created: {synced:?}"
    );
    // Once: after the grant file and the journal with its first record are in it.
    assert_eq!(
        synced_count(&dir.join("runs").join(run_id.as_str())),
        1,
        "{synced:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

fn open_fds_under(dir: &Path) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
        .filter(|target| target.starts_with(dir))
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn closed_runs_hold_no_descriptor_and_are_not_reopened() {
    let (dir, registry, run_id) = registry_with_open_run("fds").await;
    assert_eq!(open_fds_under(&dir), 1, "the open run's journal");
    registry.end(&run_id, 2_000_500).await.unwrap();
    assert_eq!(
        open_fds_under(&dir),
        0,
        "the closed run's journal is closed"
    );
    drop(registry);
    // An unreadable journal would quarantine an open run: a closed one is not even read.
    let journal = closed_run_dir(&dir, &run_id).join(journal::FILE_NAME);
    std::fs::write(&journal, b"not a journal\nat all\n").unwrap();
    let reopened = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
    assert!(reopened.is_closed(&run_id));
    assert!(reopened.quarantined().is_empty());
    assert_eq!(open_fds_under(&dir), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// EndRun's closing record reached the disk but the marker did not (a full disk, no
/// descriptor left): the run is closed in memory, and a restart agrees and writes it.
#[tokio::test(flavor = "multi_thread")]
async fn a_closing_record_without_its_marker_closes_the_run_at_restart() {
    let (dir, registry, run_id) = registry_with_open_run("marker").await;
    let run_dir = dir.join("runs").join(run_id.as_str());
    // The marker cannot be written: a directory stands where its temporary file goes.
    std::fs::create_dir(run_dir.join("summary.tmp")).unwrap();
    assert!(registry.end(&run_id, 2_000_500).await.is_ok());
    assert!(registry.is_closed(&run_id));
    assert!(!run_dir.join(CLOSED_FILE).exists());
    drop(registry);
    std::fs::remove_dir(run_dir.join("summary.tmp")).unwrap();
    let reopened = RunRegistry::open(&dir, &key().verifying_key(), limits(1), 0).unwrap();
    assert!(reopened.is_closed(&run_id));
    assert!(reopened.get(&run_id).is_none());
    assert!(!run_dir.exists(), "the restart moved the run out of runs/");
    assert_eq!(
        std::fs::read_to_string(closed_run_dir(&dir, &run_id).join(CLOSED_FILE)).unwrap(),
        "2000500"
    );
    let journal = closed_run_dir(&dir, &run_id).join(journal::FILE_NAME);
    let ops: Vec<String> = journal::read(&journal, run_id.as_str())
        .unwrap()
        .records
        .into_iter()
        .map(|r| r.entry.op.as_str().to_owned())
        .collect();
    assert_eq!(ops, ["run.begin", "run.end"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn closed_runs_are_pruned_after_their_retention_and_open_ones_never() {
    let dir = state_dir("prune");
    let mut bounded = limits(4);
    bounded.closed_run_retention_days = 1;
    let registry = RunRegistry::open(&dir, &key().verifying_key(), bounded, 0).unwrap();
    let (signed, grant) = nth_grant(0);
    let closed_id = grant.run_id.clone();
    registry.begin(&signed, grant, 2_000_000).await.unwrap();
    registry.end(&closed_id, 2_000_500).await.unwrap();
    let (signed, grant) = nth_grant(1);
    let open_id = grant.run_id.clone();
    registry.begin(&signed, grant, 2_000_000).await.unwrap();
    hold(&registry, &open_id, "backup:drive-scsi0.img").await;
    let day_ms = 86_400_000;
    assert!(registry.prune(2_000_500 + day_ms - 1).unwrap().is_empty());
    assert_eq!(
        registry.prune(2_000_501 + day_ms).unwrap(),
        std::slice::from_ref(&closed_id)
    );
    assert!(!closed_run_dir(&dir, &closed_id).exists());
    assert!(!registry.is_closed(&closed_id));
    assert!(dir.join("runs").join(open_id.as_str()).exists());
    assert!(registry.get(&open_id).is_some());
    let shard = closed_run_dir(&dir, &closed_id)
        .parent()
        .unwrap()
        .to_owned();
    assert!(
        synced_count(&shard) >= 2,
        "the shard is synced after the run moved in and after it was pruned"
    );
    // A start prunes nothing (the daemon's periodic pass does), and never an open run.
    let (signed, grant) = nth_grant(2);
    let later_id = grant.run_id.clone();
    registry.begin(&signed, grant, 2_000_000).await.unwrap();
    registry.end(&later_id, 2_000_500).await.unwrap();
    drop(registry);
    let far = 10 * day_ms;
    let reopened = RunRegistry::open(&dir, &key().verifying_key(), bounded, far).unwrap();
    assert!(reopened.is_closed(&later_id));
    assert_eq!(reopened.prune(far).unwrap(), [later_id]);
    assert!(
        reopened.get(&open_id).is_some(),
        "an open run is never pruned"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_closed_run_whose_marker_lost_its_time_keeps_its_retention() {
    let dir = state_dir("prune-lost-marker");
    let mut bounded = limits(4);
    bounded.closed_run_retention_days = 1;
    let registry = RunRegistry::open(&dir, &key().verifying_key(), bounded, 0).unwrap();
    let (signed, grant) = nth_grant(0);
    let run_id = grant.run_id.clone();
    registry.begin(&signed, grant, 2_000_000).await.unwrap();
    registry.end(&run_id, 2_000_500).await.unwrap();
    // The marker and the summary are written without a sync: a crash can leave the marker
    // empty and the summary gone (the journal's closing record is what is durable).
    std::fs::write(closed_run_dir(&dir, &run_id).join(CLOSED_FILE), b"").unwrap();
    std::fs::remove_file(closed_run_dir(&dir, &run_id).join(SUMMARY_FILE)).unwrap();
    let day_ms = 86_400_000;
    // Read as closed at time 0, the run would be due now; its journal says it closed later.
    assert!(registry.prune(2_000_501 + day_ms).unwrap().is_empty());
    assert!(closed_run_dir(&dir, &run_id).exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_second_holder_of_the_state_lock_learns_the_first_one_s_pid() {
    let dir = state_dir("lock");
    let held = StateLock::acquire(&dir).unwrap();
    let pid = std::process::id().to_string();
    assert_eq!(
        std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap().trim(),
        pid
    );
    match StateLock::acquire(&dir) {
        Err(RunError::Locked { holder, .. }) => assert_eq!(holder, pid),
        other => panic!("{other:?}"),
    }
    match StateLock::probe(&dir) {
        Err(error @ RunError::Locked { .. }) => {
            assert!(error.to_string().contains(&pid), "{error}")
        }
        other => panic!("{other:?}"),
    }
    drop(held);
    assert!(StateLock::probe(&dir).unwrap().is_some());
    assert!(StateLock::acquire(&dir).is_ok());
    assert!(StateLock::probe(&state_dir("lock-none")).unwrap().is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_repeated_observation_is_journaled_once() {
    let (dir, registry, run_id) = registry_with_open_run("repeat").await;
    let run = registry.get(&run_id).unwrap();
    let mut guard = run.lock().await;
    let residue = |what: &str| serde_json::json!({ "residue": [what] });
    let mut written = Vec::new();
    for (time, what) in [(1, "table"), (2, "table"), (3, "table"), (4, "address")] {
        written.push(
            guard
                .append_if_changed(
                    time,
                    &Op::RunCleanup,
                    &Resource::parse("run:x"),
                    Phase::Failed,
                    residue(what),
                )
                .await
                .unwrap()
                .is_some(),
        );
    }
    assert_eq!(written, [true, false, false, true]);
    assert_eq!(guard.records().len(), 3);
    drop(guard);
    assert_eq!(
        journal_ops(&dir, &run_id),
        ["run.begin", "run.cleanup", "run.cleanup"]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An append whose caller went away (the RPC was cancelled) still lands, off the async
/// worker, and the next append continues the same chain.
#[tokio::test(flavor = "current_thread")]
async fn a_dropped_append_completes_and_the_chain_stays_whole() {
    let (dir, registry, run_id) = registry_with_open_run("dropped").await;
    let run = registry.get(&run_id).unwrap();
    for n in 0..20 {
        {
            let mut guard = run.lock().await;
            let resource = Resource::parse("backup:a.img");
            let append = guard.intent(n, &Op::BackupMap, &resource, serde_json::Value::Null);
            // Polled once, then dropped, as when the caller of the RPC goes away.
            let _ = tokio::time::timeout(std::time::Duration::ZERO, append).await;
        }
        let mut guard = run.lock().await;
        guard
            .done(
                n,
                &Op::BackupMap,
                &Resource::parse("backup:a.img"),
                serde_json::Value::Null,
            )
            .await
            .unwrap();
    }
    let in_memory: Vec<Record> = run.lock().await.records().to_vec();
    let path = dir
        .join("runs")
        .join(run_id.as_str())
        .join(journal::FILE_NAME);
    let on_disk = journal::read(&path, run_id.as_str()).unwrap();
    assert!(on_disk.torn.is_none());
    assert_eq!(on_disk.records, in_memory);
    let phases: Vec<Phase> = on_disk
        .records
        .iter()
        .skip(1)
        .map(|r| r.entry.phase)
        .collect();
    assert_eq!(
        phases,
        [Phase::Intent, Phase::Done].repeat(20),
        "order of the calls"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The next operation waits for a write whose caller went away before it decides from
/// the records, so it sees the step that write records.
#[tokio::test(flavor = "current_thread")]
#[allow(clippy::await_holding_lock)] // The held lock is the slow disk this test needs.
async fn the_next_operation_waits_for_an_abandoned_write() {
    let (dir, registry, run_id) = registry_with_open_run("abandoned").await;
    let run = registry.get(&run_id).unwrap();
    // A slow disk: the write cannot finish while this is held.
    let slow_disk = lock_journal(&run.journal);
    {
        let mut guard = run.lock().await;
        let resource = Resource::parse("backup:a.img");
        let append = guard.intent(1, &Op::BackupMap, &resource, serde_json::Value::Null);
        let abandoned = tokio::time::timeout(std::time::Duration::from_millis(20), append).await;
        assert!(
            abandoned.is_err(),
            "the write finished with the disk blocked"
        );
    }
    let next = tokio::time::timeout(std::time::Duration::from_millis(100), run.lock()).await;
    assert!(
        next.is_err(),
        "the next operation started before the abandoned write ended"
    );
    drop(slow_disk);
    let guard = run.lock().await;
    let last = guard
        .records()
        .last()
        .map(|r| (r.entry.op.as_str().to_owned(), r.entry.phase));
    assert_eq!(last, Some(("backup.map".to_owned(), Phase::Intent)));
    drop(guard);
    std::fs::remove_dir_all(&dir).unwrap();
}
