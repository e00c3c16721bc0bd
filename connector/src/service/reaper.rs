//! The periodic pass: runs past their deadline cleaned up and journaled as expired, retried
//! with a doubling delay when cleanup fails, interrupted steps recovered at start, closed runs
//! pruned after their retention.

use super::ConnectorService;
use crate::action::Action;
use crate::executor::{Caller, ExecError, Outcome};
use crate::runs::RunError;
use certistack_core::validate::RunId;
use std::collections::BTreeMap;

/// The expiry reaper's first retry delay for a run it could not clean up, doubled per failed
/// pass up to [`REAP_BACKOFF_MAX_SECS`].
const REAP_BACKOFF_FIRST_SECS: i64 = 60;
const REAP_BACKOFF_MAX_SECS: i64 = 3600;
/// Seconds between two prunes of closed runs past their retention.
const PRUNE_EVERY_SECS: i64 = 3600;

impl ConnectorService {
    /// Cleans up every open run whose deadline plus the grace has passed, journals it as
    /// expired and closes it. A run whose cleanup leaves residue stays open (and listed) for an
    /// operator and is retried after a delay that doubles up to an hour; its journal records a
    /// cleanup only when what it found changed. Also prunes closed runs past their retention.
    pub async fn reap_expired(&self) {
        let now = self.clock.now_unix();
        self.prune_closed(now).await;
        for run in self.runs.open_runs() {
            let deadline = run.grant.deadline_unix;
            if run.is_closed() || now < deadline.saturating_add(self.expiry_grace_secs) {
                continue;
            }
            let run_id = run.run_id.clone();
            let backoff = self.backoff().get(&run_id).copied();
            if backoff.is_some_and(|(next_at, _)| now < next_at) {
                continue;
            }
            let caller = Caller::Operator {
                name: "expiry".into(),
                run: run.clone(),
            };
            let result = self
                .executor
                .execute(
                    &caller,
                    Action::Cleanup {
                        run_id: run_id.clone(),
                    },
                )
                .await;
            // The run closes only when the node holds nothing named for it any more.
            let residue = match result {
                Ok(Outcome::Cleanup(_)) => self.executor.residue(&run).await,
                Ok(_) => Err(ExecError::Failed(
                    "the executor answered Cleanup with the wrong reply type".into(),
                )),
                Err(error) => Err(error),
            };
            let clean = match residue {
                Ok(residue) if residue.is_empty() => {
                    match self.runs.expire(&run_id, self.clock.now_unix_ms()).await {
                        Ok(_) => {
                            tracing::warn!(%run_id, deadline, "run passed its deadline without EndRun: cleaned up and closed as expired");
                            true
                        }
                        // EndRun closed it while the cleanup ran.
                        Err(RunError::Closed(_)) => true,
                        Err(error) => {
                            tracing::error!(%run_id, %error, "cannot close the expired run");
                            false
                        }
                    }
                }
                Ok(residue) => {
                    tracing::error!(%run_id, ?residue, "expired run left residue; an operator must look at it");
                    false
                }
                Err(_) if run.is_closed() => true,
                Err(error) => {
                    tracing::error!(%run_id, %error, "cleanup of the expired run failed; retrying later");
                    false
                }
            };
            let mut backoffs = self.backoff();
            if clean {
                backoffs.remove(&run_id);
            } else {
                let delay = backoff.map_or(REAP_BACKOFF_FIRST_SECS, |(_, delay)| {
                    delay.saturating_mul(2).min(REAP_BACKOFF_MAX_SECS)
                });
                backoffs.insert(run_id, (now.saturating_add(delay), delay));
            }
        }
    }

    /// Settles, for every open run, the steps a previous daemon was interrupted in: their
    /// tools are killed and proven gone before anything else is decided.
    pub async fn recover_interrupted(&self) {
        for run in self.runs.open_runs() {
            if run.is_closed() {
                continue;
            }
            if let Err(error) = self.executor.recover(&run).await {
                tracing::error!(run_id = %run.run_id, %error, "cannot settle an interrupted step");
            }
        }
    }

    /// When the reaper retries `run_id` next, if its last cleanup left residue.
    pub fn reap_retry_at(&self, run_id: &RunId) -> Option<i64> {
        self.backoff().get(run_id).map(|(next_at, _)| *next_at)
    }

    fn backoff(&self) -> std::sync::MutexGuard<'_, BTreeMap<RunId, (i64, i64)>> {
        self.reap_backoff
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    async fn prune_closed(&self, now: i64) {
        let last = self
            .last_prune_unix
            .load(std::sync::atomic::Ordering::SeqCst);
        if now.saturating_sub(last) < PRUNE_EVERY_SECS {
            return;
        }
        self.last_prune_unix
            .store(now, std::sync::atomic::Ordering::SeqCst);
        let now_ms = self.clock.now_unix_ms();
        // One bounded batch per trip to the blocking pool, so a long history never holds a
        // blocking thread (or the pass) for long.
        let mut after = None;
        loop {
            let runs = self.runs.clone();
            let from = after.clone();
            let batch = tokio::task::spawn_blocking(move || {
                runs.prune_batch(now_ms, from.as_ref(), crate::runs::PRUNE_BATCH)
            })
            .await;
            match batch {
                Ok(Ok((_, Some(next)))) => after = Some(next),
                Ok(Ok((_, None))) => return,
                Ok(Err(error)) => return tracing::error!(%error, "cannot prune closed runs"),
                Err(error) => return tracing::error!(%error, "pruning closed runs stopped"),
            }
        }
    }
}
