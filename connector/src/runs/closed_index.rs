//! The closed runs' ids and deadlines in memory, once ListRuns has listed them: later pages are
//! answered without the file system and without a hand-off to the blocking pool.
//!
//! The first listing reads the names in every shard directory (never a run's files) and
//! installs the index; each page then reads the summaries of the runs it shows whose deadline
//! is not yet known, once. From then on the registry keeps the index current itself: a close
//! adds its run, the retention sweep removes what it prunes. A listing that raced a close or a
//! prune is not installed (it may miss the run that moved), and one listing runs at a time. A
//! node with more closed runs than [`MAX_INDEXED_CLOSED_RUNS`] is listed from disk, page by
//! page, until the sweep has removed an eighth of that; a listing that failed is tried again
//! only once a run closed or was pruned. `closed/` is the daemon's: a run directory removed by
//! hand is still listed until the next start once its deadline is known, and dropped when a
//! page finds it gone otherwise.

use certistack_core::validate::RunId;
use std::collections::BTreeMap;
use std::ops::Bound;

/// Closed runs whose ids and deadlines are kept in memory, at about 100 bytes each (6.5 MB at
/// most). 90 days of retention at 700 runs a day stays under it; a node with more is listed
/// from disk, page by page.
pub const MAX_INDEXED_CLOSED_RUNS: usize = 65_536;

/// A page of closed runs as ListRuns shows them (id and grant deadline), and the cursor of the
/// next page.
pub type DeadlinePage = (Vec<(RunId, i64)>, Option<RunId>);

#[derive(Debug)]
pub(super) struct ClosedIndex {
    /// Every closed run on disk, with its grant's deadline once its summary was read; `None`
    /// until a listing read every shard.
    runs: Option<BTreeMap<RunId, Option<i64>>>,
    /// Bumped by every close and prune, so a listing that raced one is not installed.
    generation: u64,
    /// The most runs kept ([`MAX_INDEXED_CLOSED_RUNS`] in the daemon).
    bound: usize,
    /// A listing is under way: one at a time, the others read their page from disk meanwhile.
    listing: bool,
    /// Set when a listing found more than `bound` closed runs, or a close reached it: how many
    /// more runs the retention sweep must remove before a listing is tried again, so a node at
    /// its bound lists from disk page by page instead of walking every shard on every call.
    over_bound: Option<usize>,
    /// The generation at which a listing failed (a shard that cannot be read): no listing is
    /// tried again until a close or a prune changes it, so a lasting fault costs one walk per
    /// change, not one per call.
    failed_at: Option<u64>,
}

impl Default for ClosedIndex {
    fn default() -> Self {
        Self::new(MAX_INDEXED_CLOSED_RUNS)
    }
}

impl ClosedIndex {
    pub(super) fn new(bound: usize) -> Self {
        Self {
            runs: None,
            generation: 0,
            bound,
            listing: false,
            over_bound: None,
            failed_at: None,
        }
    }

    /// A run closed (and moved under `closed/`) by this daemon.
    pub(super) fn closed(&mut self, run_id: RunId, deadline_unix: i64) {
        self.generation = self.generation.wrapping_add(1);
        if let Some(runs) = &mut self.runs {
            if runs.len() >= self.bound {
                self.runs = None;
                self.over_bound = Some(self.retry_after());
            } else {
                runs.insert(run_id, Some(deadline_unix));
            }
        }
    }

    /// A closed run removed from disk.
    pub(super) fn removed(&mut self, run_id: &RunId) {
        self.generation = self.generation.wrapping_add(1);
        if let Some(runs) = &mut self.runs {
            runs.remove(run_id);
        }
        self.over_bound = self
            .over_bound
            .and_then(|left| left.checked_sub(1))
            .filter(|left| *left > 0);
    }

    /// Removals after which a node that was over the bound is listed again: an eighth of it.
    fn retry_after(&self) -> usize {
        (self.bound / 8).max(1)
    }

    /// Starts a listing, returning the generation to install it with; `None` when the index
    /// is installed, another listing is under way, or the node is over the bound.
    pub(super) fn begin_listing(&mut self) -> Option<u64> {
        if self.runs.is_some()
            || self.listing
            || self.over_bound.is_some()
            || self.failed_at == Some(self.generation)
        {
            return None;
        }
        self.listing = true;
        Some(self.generation)
    }

    /// Ends a listing begun at `generation`, installing `ids` unless a close or prune raced it
    /// (`None`: the listing failed).
    pub(super) fn end_listing(&mut self, generation: u64, ids: Option<Vec<RunId>>) {
        self.listing = false;
        match ids {
            Some(ids) if self.generation == generation && self.runs.is_none() => {
                self.runs = Some(ids.into_iter().map(|id| (id, None)).collect());
            }
            Some(_) => {}
            None => self.failed_at = Some(generation),
        }
    }

    /// Ends a listing that found more than the bound.
    pub(super) fn over_bound(&mut self) {
        self.listing = false;
        self.over_bound = Some(self.retry_after());
    }

    pub(super) fn is_installed(&self) -> bool {
        self.runs.is_some()
    }

    /// Up to `count` indexed ids after `after`, each with its deadline when known.
    pub(super) fn after(&self, after: Option<&RunId>, count: usize) -> Vec<(RunId, Option<i64>)> {
        let Some(runs) = &self.runs else {
            return Vec::new();
        };
        let start = after.map_or(Bound::Unbounded, Bound::Excluded);
        runs.range((start, Bound::Unbounded))
            .take(count)
            .map(|(id, deadline)| (id.clone(), *deadline))
            .collect()
    }

    pub(super) fn learned(&mut self, run_id: &RunId, deadline_unix: i64) {
        if let Some(deadline) = self.runs.as_mut().and_then(|runs| runs.get_mut(run_id)) {
            *deadline = Some(deadline_unix);
        }
    }

    pub(super) fn forget(&mut self, run_id: &RunId) {
        if let Some(runs) = &mut self.runs {
            runs.remove(run_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::RunRegistry;
    use super::super::tests::{CLOSED_READS, closed_reads_under, closed_runs, key, nth_grant};
    use super::*;
    use certistack_core::validate::Validated;

    fn run_id(n: usize) -> RunId {
        RunId::validate(&format!("{n:08x}-0000-4000-8000-000000000000")).unwrap()
    }

    /// How often `closed_dir` itself was read: once per walk of every shard, once per page read
    /// from disk.
    fn listings_of(closed_dir: &std::path::Path) -> usize {
        CLOSED_READS
            .lock()
            .unwrap()
            .iter()
            .filter(|path| *path == closed_dir)
            .count()
    }

    #[test]
    fn a_listing_that_raced_a_close_or_a_prune_is_not_installed() {
        let mut index = ClosedIndex::new(MAX_INDEXED_CLOSED_RUNS);
        let listed_at = index.begin_listing().unwrap();
        assert_eq!(index.begin_listing(), None, "one listing at a time");
        index.closed(run_id(1), 10);
        index.end_listing(listed_at, Some(vec![run_id(2)]));
        assert!(!index.is_installed(), "the listing may have missed run 1");
        let listed_at = index.begin_listing().unwrap();
        index.removed(&run_id(2));
        index.end_listing(listed_at, Some(vec![run_id(2)]));
        assert!(!index.is_installed(), "the listing may hold a pruned run");
        let listed_at = index.begin_listing().unwrap();
        index.end_listing(listed_at, None);
        assert!(!index.is_installed(), "a failed listing installs nothing");
        assert_eq!(
            index.begin_listing(),
            None,
            "nor is it retried on the next call"
        );
        index.closed(run_id(3), 10);
        let listed_at = index
            .begin_listing()
            .expect("retried after a close or a prune");
        index.end_listing(listed_at, Some(vec![run_id(1), run_id(3)]));
        assert_eq!(
            index.after(None, 10),
            [(run_id(1), None), (run_id(3), None)]
        );
        assert_eq!(index.after(Some(&run_id(1)), 10), [(run_id(3), None)]);
        assert_eq!(
            index.begin_listing(),
            None,
            "installed: nothing more to list"
        );
    }

    #[test]
    fn past_its_bound_the_index_is_dropped_until_the_sweep_removed_an_eighth() {
        let mut index = ClosedIndex::new(16);
        let listed_at = index.begin_listing().unwrap();
        index.end_listing(listed_at, Some((0..16).map(run_id).collect()));
        assert!(index.is_installed());
        index.closed(run_id(16), 10);
        assert!(
            !index.is_installed(),
            "past the bound, pages are read from disk"
        );
        assert_eq!(
            index.begin_listing(),
            None,
            "and no listing is retried at once"
        );
        index.removed(&run_id(0));
        assert_eq!(
            index.begin_listing(),
            None,
            "one removal is not an eighth of 16"
        );
        index.removed(&run_id(1));
        assert!(index.begin_listing().is_some(), "two are");
        index.over_bound();
        assert_eq!(
            index.begin_listing(),
            None,
            "a listing over the bound waits again"
        );
    }

    /// ListRuns' closed pages: the first listing reads every shard's names, each page the
    /// summaries it shows once; then pages come from memory, reading nothing, and stay current as
    /// runs close and are pruned.
    #[tokio::test(flavor = "multi_thread")]
    async fn closed_runs_are_listed_from_memory_once_listed_and_kept_current() {
        let (dir, registry, ids) = closed_runs("index", 7).await;
        let on_disk = |after: Option<&RunId>, size| {
            let (page, next) = registry.closed_page(after, size).unwrap();
            let page: Vec<(RunId, i64)> = page
                .into_iter()
                .map(|(id, summary)| (id, summary.deadline_unix))
                .collect();
            (page, next)
        };
        assert_eq!(
            registry.closed_deadlines_in_memory(None, 3),
            None,
            "nothing is in memory before the first listing"
        );
        assert_eq!(
            registry.closed_deadlines(None, 3).unwrap(),
            on_disk(None, 3)
        );
        let before = closed_reads_under(&dir);
        assert_eq!(
            registry.closed_deadlines_in_memory(None, 3),
            Some(on_disk(None, 3))
        );
        assert_eq!(
            registry.closed_deadlines_in_memory(Some(&ids[2]), 3),
            None,
            "the next page's deadlines are not known yet"
        );
        assert_eq!(
            registry.closed_deadlines(Some(&ids[2]), 1000).unwrap(),
            on_disk(Some(&ids[2]), 1000)
        );
        let reads = closed_reads_under(&dir);
        for size in [1, 3, 7, 1000] {
            let mut after = None;
            loop {
                let from_memory = registry
                    .closed_deadlines_in_memory(after.as_ref(), size)
                    .unwrap();
                assert_eq!(
                    from_memory,
                    on_disk(after.as_ref(), size),
                    "page size {size}"
                );
                match from_memory.1 {
                    Some(next) => after = Some(next),
                    None => break,
                }
            }
        }
        assert!(reads > before, "the second page read its runs' summaries");
        let quiet = closed_reads_under(&dir);
        registry.closed_deadlines_in_memory(None, 1000).unwrap();
        assert_eq!(
            closed_reads_under(&dir),
            quiet,
            "a page from memory read a file"
        );

        // A run closed now is listed at once; a pruned one is gone.
        let (signed, grant) = nth_grant(30);
        let (late, deadline) = (grant.run_id.clone(), grant.deadline_unix);
        registry.begin(&signed, grant, 2_000_000).await.unwrap();
        assert!(
            !registry
                .closed_deadlines_in_memory(None, 1000)
                .unwrap()
                .0
                .iter()
                .any(|(id, _)| *id == late),
            "an open run is not a closed one"
        );
        registry.end(&late, 2_000_600).await.unwrap();
        let listed = registry.closed_deadlines_in_memory(None, 1000).unwrap();
        assert!(listed.0.contains(&(late.clone(), deadline)));
        assert_eq!(listed, on_disk(None, 1000));
        let pruned = registry.prune(i64::MAX / 2).unwrap();
        assert_eq!(pruned.len(), 8);
        assert_eq!(
            registry.closed_deadlines_in_memory(None, 1000),
            Some((Vec::new(), None))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Past the index's bound, pages are read from disk, and the shards are not walked again on
    /// every call: the first try marks the node over the bound until the sweep removed an eighth.
    #[tokio::test(flavor = "multi_thread")]
    async fn past_the_bound_closed_pages_are_read_from_disk_without_listing_every_shard_each_time()
    {
        let (dir, registry, _) = closed_runs("index-bound", 5).await;
        let mut bounded = registry.limits;
        drop(registry);
        bounded.max_indexed_closed_runs = 3;
        let registry = RunRegistry::open(&dir, &key().verifying_key(), bounded, 0).unwrap();
        let listings = || listings_of(&dir.join("closed"));
        let before = listings();
        let (page, next) = registry.closed_deadlines(None, 2).unwrap();
        let on_disk = registry.closed_page(None, 2).unwrap();
        assert_eq!(next, on_disk.1);
        assert_eq!(
            page,
            on_disk
                .0
                .into_iter()
                .map(|(id, summary)| (id, summary.deadline_unix))
                .collect::<Vec<_>>()
        );
        assert_eq!(
            listings() - before,
            3,
            "the first call tried the whole listing once, and each page read its shards"
        );
        let before = listings();
        registry.closed_deadlines(next.as_ref(), 2).unwrap();
        assert_eq!(
            listings() - before,
            1,
            "a later page reads only its own shards"
        );
        assert_eq!(registry.closed_deadlines_in_memory(None, 2), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A shard that cannot be read fails the listing: the page comes from disk, and the walk is
    /// not tried again on every call, only after a run closes or is pruned.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_listing_that_fails_is_not_retried_on_every_call() {
        let (dir, registry, ids) = closed_runs("index-fails", 3).await;
        // Sorts after every hex shard, so the pages before it still read.
        std::fs::write(dir.join("closed").join("zz"), b"not a shard").unwrap();
        let listings = || listings_of(&dir.join("closed"));
        let before = listings();
        let (page, _) = registry.closed_deadlines(None, 2).unwrap();
        assert_eq!(
            page.iter().map(|(id, _)| id).collect::<Vec<_>>(),
            [&ids[0], &ids[1]]
        );
        assert_eq!(
            listings() - before,
            2,
            "the listing was tried, the page read from disk"
        );
        assert_eq!(registry.closed_deadlines_in_memory(None, 2), None);
        let before = listings();
        registry.closed_deadlines(None, 2).unwrap();
        assert_eq!(
            listings() - before,
            1,
            "no second walk before anything changed"
        );
        let (signed, grant) = nth_grant(40);
        let run_id = grant.run_id.clone();
        registry.begin(&signed, grant, 2_000_000).await.unwrap();
        registry.end(&run_id, 2_000_600).await.unwrap();
        let before = listings();
        registry.closed_deadlines(None, 2).unwrap();
        assert_eq!(listings() - before, 2, "a close allows one more try");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
