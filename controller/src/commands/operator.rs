//! `runs`, `journal` and `cleanup`: one node's runs, a run's journal verified here, a run cleaned up.

use super::target::{ResolvedNode, with_operator};
use crate::exit::ExitStatus;
use time::OffsetDateTime;

pub fn operator_runs(args: &ResolvedNode, now: OffsetDateTime) -> Result<(), ExitStatus> {
    use crate::operator;
    let runs = with_operator(args, now, async |connection| {
        operator::list_runs(connection).await
    })?;
    for run in &runs {
        println!("{}", operator::describe_run(run));
    }
    println!("{} run(s)", runs.len());
    Ok(())
}

pub fn operator_journal(
    args: &ResolvedNode,
    run_id: &str,
    now: OffsetDateTime,
) -> Result<(), ExitStatus> {
    use crate::operator;
    let records = with_operator(args, now, async |connection| {
        operator::read_journal(connection, run_id, |record| {
            println!("{}", operator::describe_record(record));
        })
        .await
    })?;
    let head = operator::verify_journal(run_id, &records).map_err(|reason| {
        ExitStatus::local(format!(
            "the journal of run {run_id} does not verify: {reason}; keep the node's journal file for inspection"
        ))
    })?;
    println!(
        "journal head {head} ({} records, chain verified here)",
        records.len()
    );
    Ok(())
}

pub fn operator_cleanup(
    args: &ResolvedNode,
    run_id: &str,
    now: OffsetDateTime,
) -> Result<(), ExitStatus> {
    use crate::operator;
    let reply = with_operator(args, now, async |connection| {
        operator::cleanup(connection, run_id).await
    })?;
    for line in operator::describe_cleanup(&reply) {
        println!("{line}");
    }
    operator::cleanup_complete(&reply).map_err(|shortfall| {
        ExitStatus::local(format!(
            "cleanup of run {run_id} is not complete: {shortfall}; see the lines above, fix on the node and run cleanup again"
        ))
    })?;
    println!("cleanup of run {run_id} complete: no residue");
    Ok(())
}
