//! The `run` command: the command line into one run of a plan (`plan_run`), and its
//! summaries into the exit status.

use super::{Threads, runtime};
use crate::exit::ExitStatus;
use crate::{plan_run, runner};
use std::path::PathBuf;
use time::OffsetDateTime;

#[derive(clap::Args, Debug)]
pub struct RunPlanArgs {
    /// The plan (YAML; see docs/plans.md).
    pub plan: PathBuf,
    /// The controller configuration (state directory, reports directory, inventory).
    #[arg(long, default_value = crate::config::DEFAULT_CONFIG)]
    pub config: PathBuf,
    /// Validations at once on one node.
    #[arg(long, default_value_t = runner::DEFAULT_PER_NODE as u16, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub per_node: u16,
    /// Validations at once in total.
    #[arg(long, default_value_t = runner::DEFAULT_TOTAL as u16, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub max_concurrent: u16,
    /// One JSON object per step event and one per validation summary, one per line, instead of
    /// live lines and the table.
    #[arg(long)]
    pub json: bool,
}

pub fn run_plan(args: &RunPlanArgs, now: OffsetDateTime) -> Result<(), ExitStatus> {
    use std::io::IsTerminal;
    let output = if args.json {
        runner::ProgressMode::Json
    } else if std::io::stderr().is_terminal() && std::io::stdout().is_terminal() {
        runner::ProgressMode::Live
    } else {
        runner::ProgressMode::Plain
    };
    let options = plan_run::Options {
        plan: args.plan.clone(),
        config: args.config.clone(),
        per_node: usize::from(args.per_node),
        max_concurrent: usize::from(args.max_concurrent),
        output,
    };
    let runtime = runtime(Threads::Two).map_err(ExitStatus::runtime_refused)?;
    let summaries = plan_run::run(&options, now, &runtime)?;
    ExitStatus::of_run(&summaries)
}
