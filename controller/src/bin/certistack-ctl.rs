//! certistack-ctl: the controller CLI. This file parses the command line and dispatches; each
//! command's body is in `certistack_controller::commands`, its exit status in
//! `certistack_controller::exit`. Every secret stays in its state directory.
#![forbid(unsafe_code)]
#![allow(clippy::print_stdout)]

use certistack_controller::commands;
use certistack_controller::commands::doctor::DoctorArgs;
use certistack_controller::commands::hello::HelloArgs;
use certistack_controller::commands::history::{HISTORY_EXIT_CODES, HistoryArgs};
use certistack_controller::commands::package::{PACKAGE_EXIT_CODES, PackageCommand};
use certistack_controller::commands::report::{REPORT_EXIT_CODES, ReportCommand};
use certistack_controller::commands::run::RunPlanArgs;
use certistack_controller::commands::target::{OperatorArgs, RunArgs};
use certistack_controller::exit::{self, ExitStatus};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use time::OffsetDateTime;

const EXIT_CODES: &str = "Exit codes: they differ per command (see COMMAND --help). Every command answers \
64 for a wrong command line. ca, node, surface, hello: 0 success; 1 local failure (state directory, \
key, file); 3 the node could not be reached or refused TLS or the call; 4 the node is not what was \
expected (node name or surface digest differs).";

#[derive(Parser, Debug)]
#[command(name = "certistack-ctl", version, about = "CertiStack controller", after_help = EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The certificate authority and signing keys.
    #[command(subcommand, after_help = EXIT_CODES)]
    Ca(CaCommand),
    /// Node enrollment.
    #[command(subcommand, after_help = EXIT_CODES)]
    Node(NodeCommand),
    /// Print each RPC of the compiled surface, then its digest.
    #[command(after_help = EXIT_CODES)]
    Surface,
    /// Connect to a node as an operator and print its Hello answer.
    #[command(after_help = EXIT_CODES)]
    Hello(HelloArgs),
    /// Plans: the validations an operator asks for.
    #[command(subcommand)]
    Plan(PlanCommand),
    /// Evidence reports: verify one, or print it for a person.
    #[command(subcommand, after_help = REPORT_EXIT_CODES)]
    Report(ReportCommand),
    /// List a node's runs: id, state (open, expired, closed, quarantined), deadline and open
    /// resources.
    #[command(after_help = OPERATOR_EXIT_CODES)]
    Runs(OperatorArgs),
    /// Stream a run's journal from a node, verify its hash chain here and print each record.
    #[command(after_help = OPERATOR_EXIT_CODES)]
    Journal(RunArgs),
    /// Ask a node to clean a run up; print each resource's receipt and any residue.
    #[command(after_help = OPERATOR_EXIT_CODES)]
    Cleanup(RunArgs),
    /// Check the prerequisites of inventory nodes (all when none is named), concurrently: PVE
    /// 9.x, qemu-img >= 8.0, PBS client 4.x, QEMU, nft and ip, overlay free space and disk,
    /// clock, cgroup v2, the firewall in use, the LVM filter, legacy NAT rules and, for the
    /// sandbox VNet (--vnet, or each node's from --plan), its forwarding now and after ifreload.
    #[command(after_help = DOCTOR_EXIT_CODES)]
    Doctor(DoctorArgs),
    /// The fleet of the inventory.
    #[command(subcommand, after_help = AUDIT_EXIT_CODES)]
    Nodes(NodesCommand),
    /// Run a plan: every validation on its node (different nodes concurrently), each with its own
    /// grant, run certificate and signed report; a summary table closes the run. Ctrl-C once:
    /// stop after the current step and clean up; twice: abandon the step or wait in progress,
    /// still clean up; three times: abandon the cleanup too (the summary names the cleanup
    /// command to run).
    #[command(after_help = RUN_EXIT_CODES)]
    Run(RunPlanArgs),
    /// The run history: per VM, when it last passed and failed, its streak, its last restore
    /// time and that time's trend; with a VMID, its validations, newest first, a page at a time.
    #[command(after_help = HISTORY_EXIT_CODES)]
    History(HistoryArgs),
    /// Sign a connector package, or verify one before installing it: its minisign signature,
    /// the package, version and surface the signature names, and that the surface is this
    /// controller's.
    #[command(subcommand, after_help = PACKAGE_EXIT_CODES)]
    Package(PackageCommand),
}

const RUN_EXIT_CODES: &str = "Exit codes: 0 every validation passed; 1 a validation failed (the \
backup did not restore: a probe, an assertion or the guest's state says why); 2 infrastructure \
error (a node unreachable or refusing, its surface digest differs, the connection lost, the deadline \
passed, interrupted, or a cleanup not proven complete; takes precedence over 1); 64 the command line \
is wrong; 65 the plan is refused; 66 the plan, the configuration or a secret file cannot be read; \
77 a file's owner or mode is refused (the message gives the chmod to run); 78 the controller \
configuration is refused; 71 the operating system refused to start the runtime; 75 another run holds \
the state directory's run lock (run.lock names its PID and plan): nothing was asked of anyone.";

const OPERATOR_EXIT_CODES: &str = "NODE is a node name of the controller configuration's inventory \
(--config); --state-dir with --node HOST:PORT addresses a node directly instead. Exit codes: 0 success; \
1 a failure was found: the journal chain does not verify, or cleanup left residue or a failed receipt; \
2 infrastructure: the node could not be reached, refused TLS or the call, or is not what was expected \
(node name or surface digest differs); 64 usage error (also a NODE not in the inventory); 66, 77, 78 \
the configuration (or the state directory's keys: 66, 77) cannot be read, may be written by others, or \
is refused; 78 also a key that cannot be used for the certificate.";

const DOCTOR_EXIT_CODES: &str = "One line per check: NODE CHECK ok|warn|fail WHAT-TO-DO (--json: one \
object per check). Exit codes: 0 every check ok or warn; 1 a check failed; 2 a node could not be \
reached; 64 usage error (also a NODE not in the inventory, or a --vnet that is no VNet name); 65 the \
--plan is refused; 66, 77, 78 the configuration (or the state directory's keys, or the plan's \
files: 66, 77) cannot be read, may be written by others, or is refused.";

const AUDIT_EXIT_CODES: &str = "Exit codes: 0 every node serves the controller's surface with no warning; \
1 a node's surface digest or name differs (DRIFT) or a node has a warning (clock skew over 5 s, node \
certificate expiring within 30 days, quarantined \
runs, runs not listed); 2 a node is unreachable; 66, 77, 78 the configuration cannot be read or is refused \
(as for plan check).";

#[derive(Subcommand, Debug)]
enum NodesCommand {
    /// Say Hello to every node of the inventory concurrently and print node, reachable, version,
    /// surface digest (or DRIFT), capabilities, clock skew and open and quarantined runs.
    #[command(after_help = AUDIT_EXIT_CODES)]
    Audit {
        /// The controller configuration (its state directory and node inventory).
        #[arg(long, default_value = certistack_controller::config::DEFAULT_CONFIG)]
        config: PathBuf,
        /// One JSON object per node, one per line, instead of the table.
        #[arg(long)]
        json: bool,
    },
}

const PLAN_EXIT_CODES: &str = "Exit codes: 0 the plan is accepted; 2 the PBS API could not be asked \
while the plan was resolved (unreachable, refused, too slow); 65 the plan is refused (the message names \
file:line:column or the validation and key, and what to change); 66 the plan, the configuration or a secret \
file cannot be read; 74 the output cannot be written (a full disk, not a closed pipe); 77 a file's owner or mode is refused (the message gives the chmod or chown to run); 78 the \
controller configuration is refused; 64 the command line itself is wrong.";

/// Whether `plan check` and `plan show` ask the APIs and, for placement, the nodes.
#[derive(clap::Args, Debug)]
struct Reach {
    /// Ask the PBS and PVE APIs what the plan leaves to them (`snapshot: latest`, `select`,
    /// sandbox VMIDs, the VNet's SDN view) after the token's privileges, and the nodes what
    /// `node: auto` needs: the default, as `run` does.
    #[arg(long)]
    online: bool,
    /// Ask nothing of any API or node: a plan that leaves something to them is refused, saying
    /// which key needs which.
    #[arg(long, conflicts_with = "online")]
    offline: bool,
    /// Validations at once on one node, as `run --per-node` will run them: `node: auto` places
    /// by it.
    #[arg(long, default_value_t = certistack_controller::runner::DEFAULT_PER_NODE as u16, value_parser = clap::value_parser!(u16).range(1..=64))]
    per_node: u16,
}

impl From<Reach> for commands::plan::Reach {
    fn from(reach: Reach) -> Self {
        Self {
            online: !reach.offline,
            per_node: usize::from(reach.per_node),
        }
    }
}

#[derive(Subcommand, Debug)]
enum PlanCommand {
    /// Check a plan completely, creating nothing, and print what would run where: online (the
    /// default) it asks the APIs what the plan leaves to them, after the token's privileges.
    #[command(after_help = PLAN_EXIT_CODES)]
    Check {
        /// The plan (YAML; see docs/plans.md).
        plan: PathBuf,
        /// The controller configuration.
        #[arg(long, default_value = certistack_controller::config::DEFAULT_CONFIG)]
        config: PathBuf,
        #[command(flatten)]
        reach: Reach,
    },
    /// Check a plan as `plan check` does, then print every validation spelled out, each value
    /// with where it came from: what tonight's run would do, creating nothing.
    #[command(after_help = PLAN_EXIT_CODES)]
    Show {
        /// The plan (YAML; see docs/plans.md).
        plan: PathBuf,
        /// The controller configuration.
        #[arg(long, default_value = certistack_controller::config::DEFAULT_CONFIG)]
        config: PathBuf,
        /// One JSON document with stable keys (docs/plans.md, "plan show") instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        reach: Reach,
    },
}

#[derive(Subcommand, Debug)]
enum CaCommand {
    /// Create the CA, the run-authority key and the report-signing key (directory 0700, keys 0600).
    #[command(after_help = EXIT_CODES)]
    Init {
        #[arg(long)]
        state_dir: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum NodeCommand {
    /// Issue a node certificate for a CSR made by `certistack-connector enroll --csr`.
    #[command(after_help = EXIT_CODES)]
    Sign {
        #[arg(long)]
        state_dir: PathBuf,
        /// The node name; the CSR must name exactly this.
        #[arg(long)]
        node: String,
        /// The CSR file (PEM).
        #[arg(long)]
        csr: PathBuf,
        /// Where to write the certificate (PEM); stdout when absent.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            let _ = error.print();
            return if error.use_stderr() {
                ExitCode::from(exit::USAGE)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(status) => {
            eprintln!("certistack-ctl: {}", status.printed_message());
            ExitCode::from(status.code())
        }
    }
}

fn run(cli: Cli) -> Result<(), ExitStatus> {
    let now = OffsetDateTime::now_utc();
    match cli.command {
        Command::Ca(CaCommand::Init { state_dir }) => commands::ca::ca_init(&state_dir, now),
        Command::Node(NodeCommand::Sign {
            state_dir,
            node,
            csr,
            out,
        }) => commands::ca::node_sign(&state_dir, &node, &csr, out, now),
        Command::Surface => commands::surface::surface(),
        Command::Hello(args) => commands::hello::hello(args, now),
        Command::Plan(PlanCommand::Check {
            plan,
            config,
            reach,
        }) => commands::plan::plan_check(&plan, &config, reach.into(), now),
        Command::Plan(PlanCommand::Show {
            plan,
            config,
            json,
            reach,
        }) => commands::plan::plan_show(&plan, &config, json, reach.into(), now),
        Command::Report(command) => commands::report::report_command(command),
        Command::Runs(args) => {
            let node =
                commands::target::resolve_node(&args.target, args.inventory_node.as_deref())?;
            commands::operator::operator_runs(&node, now)
        }
        Command::Journal(args) => {
            let (node, run) = commands::target::resolve_run_args(&args)?;
            commands::operator::operator_journal(&node, &run, now)
        }
        Command::Cleanup(args) => {
            let (node, run) = commands::target::resolve_run_args(&args)?;
            commands::operator::operator_cleanup(&node, &run, now)
        }
        Command::Doctor(args) => commands::doctor::doctor(&args, now),
        Command::Package(command) => commands::package::package_command(command, now),
        Command::Nodes(NodesCommand::Audit { config, json }) => {
            commands::audit::nodes_audit(&config, json, now)
        }
        Command::Run(args) => commands::run::run_plan(&args, now),
        Command::History(args) => commands::history::history(
            &args,
            i64::try_from(now.unix_timestamp_nanos() / 1_000_000).unwrap_or(i64::MAX),
        ),
    }
}
