//! The `run` command: loads the plan, the configuration and the keys, starts the driver
//! (`runner`) and turns its summary into the exit status.

use super::{Threads, load_authority, load_config, load_plan, runtime};
use crate::exit::ExitStatus;
use crate::{interrupt, runner};
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
    use std::sync::Arc;
    let config = load_config(&args.config)?;
    let plan = load_plan(&args.plan, &config, now)?;
    let secrets = runner::Secrets::load(&plan)?;
    let authority = load_authority(&config.state_dir)?;
    let mode = if args.json {
        runner::ProgressMode::Json
    } else if std::io::stderr().is_terminal() && std::io::stdout().is_terminal() {
        runner::ProgressMode::Live
    } else {
        runner::ProgressMode::Plain
    };
    let runtime = runtime(Threads::Two).map_err(ExitStatus::runtime_refused)?;
    let summaries = runtime.block_on(async {
        let progress = Arc::new(runner::Progress::new(mode));
        let announced = progress.clone();
        let interrupts = interrupt::listen(move |line| announced.println(line));
        let context = Arc::new(runner::RunContext {
            authority: Arc::new(authority),
            nodes: config
                .nodes
                .iter()
                .map(|(name, node)| (name.to_string(), node.clone()))
                .collect(),
            reports_dir: config.reports_dir.clone(),
            plan_digest: plan.digest.clone(),
            secrets: Arc::new(secrets),
            progress,
            interrupts,
        });
        runner::run_plan(
            context,
            plan,
            usize::from(args.per_node),
            usize::from(args.max_concurrent),
        )
        .await
    });
    // Written without panicking on a closed pipe (`run ... | head`): the exit code still says
    // how the run went.
    if args.json {
        for summary in &summaries {
            if let Ok(line) = serde_json::to_string(&serde_json::json!({ "summary": summary })) {
                runner::write_line(&line);
            }
        }
    } else {
        runner::write_line(runner::summary_table(&summaries).trim_end());
    }
    ExitStatus::of_run(&summaries)
}
