//! `report verify` and `report show`: a report's envelope, signature, statement and journal checked.

use crate::exit::ExitStatus;
use crate::{authority, report};
use clap::Subcommand;
use std::path::PathBuf;

pub const REPORT_EXIT_CODES: &str = "Exit codes: 0 the report verifies; 1 it does not, or it or the key \
cannot be read (the reason is printed); 64 usage error.";

#[derive(Subcommand, Debug)]
pub enum ReportCommand {
    /// Check a report's envelope, signature, statement and the journal chain inside it.
    #[command(after_help = REPORT_EXIT_CODES)]
    Verify(ReportArgs),
    /// Verify a report, then print its verdict, node, snapshot, steps, probes, cleanup, journal
    /// head and screenshot location.
    #[command(after_help = REPORT_EXIT_CODES)]
    Show(ReportArgs),
}

#[derive(clap::Args, Debug)]
#[command(group(
    clap::ArgGroup::new("signing_key").required(true).args(["key", "state_dir"])
))]
pub struct ReportArgs {
    /// The report file.
    pub report: PathBuf,
    /// The report-signing public key (PEM); defaults to the state directory's.
    #[arg(long)]
    pub key: Option<PathBuf>,
    /// The controller's state directory, whose report-signing public key is used.
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
}

pub fn report_command(command: ReportCommand) -> Result<(), ExitStatus> {
    let (ReportCommand::Verify(args) | ReportCommand::Show(args)) = &command;
    let key_path = match (&args.key, &args.state_dir) {
        (Some(key), _) => key.clone(),
        (None, Some(dir)) => dir.join(authority::REPORT_PUB),
        (None, None) => return Err(ExitStatus::local("give --key or --state-dir")),
    };
    let key = report::load_public_key(&key_path).map_err(ExitStatus::local)?;
    let bytes = report::read(&args.report).map_err(ExitStatus::local)?;
    let statement = report::verify(&bytes, &key)
        .map_err(|e| ExitStatus::local(format!("{}: not valid: {e}", args.report.display())))?;
    let screenshot = report::check_screenshot(&statement, &args.report)
        .map_err(|e| ExitStatus::local(format!("{}: not valid: {e}", args.report.display())))?;
    match command {
        ReportCommand::Verify(_) => {
            let predicate = &statement.predicate;
            let verdict = match &predicate.verdict {
                report::Verdict::Passed => "passed",
                report::Verdict::Failed { .. } => "failed",
                report::Verdict::Error { .. } => "error (nothing proven)",
            };
            println!(
                "{}: valid; signed by {}; run {} on {}; verdict {verdict}; journal head {} ({} records, recomputed)",
                args.report.display(),
                report::key_id(&key).map_err(ExitStatus::local)?,
                predicate.run_id,
                predicate.node,
                predicate.journal.head_sha256,
                predicate.journal.records.len()
            );
            match screenshot {
                report::ScreenshotCheck::NotTaken => {}
                report::ScreenshotCheck::Matches(path) => {
                    println!("screenshot {}: matches the signed digest", path.display());
                }
                report::ScreenshotCheck::Absent(path) => println!(
                    "screenshot {}: absent, not checked (keep it beside the report)",
                    path.display()
                ),
            }
        }
        ReportCommand::Show(_) => print!("{}", report::describe(&statement, &args.report)),
    }
    Ok(())
}
