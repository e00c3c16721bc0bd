//! The closed runs' ids and deadlines in memory, once ListRuns has listed them: later pages are
//! answered without the file system and without a hand-off to the blocking pool.
//!
//! The first listing reads the names in every shard directory (never a run's files) and
//! installs the index; each page then reads the summaries of the runs it shows whose deadline
//! is not yet known, once. From then on the registry keeps the index current itself: a close
//! adds its run, the retention sweep removes what it prunes. A listing that raced a close or a
//! prune is not installed (it may miss the run that moved), and a node with more closed runs
//! than [`MAX_INDEXED_CLOSED_RUNS`] is listed from disk as before, page by page. `closed/` is
//! the daemon's: a run directory removed by hand is still listed until the next start.

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

#[derive(Debug, Default)]
pub(super) struct ClosedIndex {
    /// Every closed run on disk, with its grant's deadline once its summary was read; `None`
    /// until a listing read every shard.
    runs: Option<BTreeMap<RunId, Option<i64>>>,
    /// Bumped by every close and prune, so a listing that raced one is not installed.
    generation: u64,
}

impl ClosedIndex {
    /// A run closed (and moved under `closed/`) by this daemon.
    pub(super) fn closed(&mut self, run_id: RunId, deadline_unix: i64) {
        self.generation = self.generation.wrapping_add(1);
        if let Some(runs) = &mut self.runs {
            if runs.len() >= MAX_INDEXED_CLOSED_RUNS {
                self.runs = None;
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
    }

    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    /// Installs a listing of every closed run made while the generation was `generation`.
    pub(super) fn install(&mut self, generation: u64, ids: Vec<RunId>) {
        if self.generation == generation && self.runs.is_none() {
            self.runs = Some(ids.into_iter().map(|id| (id, None)).collect());
        }
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
    use super::*;
    use certistack_core::validate::Validated;

    fn run_id(n: usize) -> RunId {
        RunId::validate(&format!("{n:08x}-0000-4000-8000-000000000000")).unwrap()
    }

    #[test]
    fn a_listing_that_raced_a_close_or_a_prune_is_not_installed() {
        let mut index = ClosedIndex::default();
        let listed_at = index.generation();
        index.closed(run_id(1), 10);
        index.install(listed_at, vec![run_id(2)]);
        assert!(!index.is_installed(), "the listing may have missed run 1");
        let listed_at = index.generation();
        index.removed(&run_id(2));
        index.install(listed_at, vec![run_id(2)]);
        assert!(!index.is_installed(), "the listing may hold a pruned run");
        let listed_at = index.generation();
        index.install(listed_at, vec![run_id(1), run_id(2)]);
        assert_eq!(
            index.after(None, 10),
            [(run_id(1), None), (run_id(2), None)]
        );
        assert_eq!(index.after(Some(&run_id(1)), 10), [(run_id(2), None)]);
    }

    #[test]
    fn the_index_is_dropped_rather_than_grow_past_its_bound() {
        let mut index = ClosedIndex::default();
        let listed_at = index.generation();
        index.install(
            listed_at,
            (0..MAX_INDEXED_CLOSED_RUNS).map(run_id).collect(),
        );
        assert!(index.is_installed());
        index.closed(run_id(MAX_INDEXED_CLOSED_RUNS), 10);
        assert!(
            !index.is_installed(),
            "past the bound, pages are read from disk"
        );
    }
}
