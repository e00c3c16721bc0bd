//! certistack-ctl: the controller CLI. Every secret stays in its state directory.
#![forbid(unsafe_code)]
#![allow(clippy::print_stdout)]

use certistack_controller::connect::ConnectError;
use certistack_controller::{authority, client, package, report, runner, surface};
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
    /// still clean up.
    #[command(after_help = RUN_EXIT_CODES)]
    Run(RunPlanArgs),
    /// Sign a connector package, or verify one before installing it: its minisign signature,
    /// the package, version and surface the signature names, and that the surface is this
    /// controller's.
    #[command(subcommand, after_help = PACKAGE_EXIT_CODES)]
    Package(PackageCommand),
}

const PACKAGE_EXIT_CODES: &str = "Exit codes: 0 success (verify: the package is signed by the key, \
names itself as its control file does and serves this controller's surface); 1 local failure (a \
key, password or package that cannot be read or written, a key that would be overwritten); 4 the \
package is refused (signature, trusted comment, control file or surface digest): do not install it.";

#[derive(Subcommand, Debug)]
enum PackageCommand {
    /// Create a minisign key pair for signing packages (the secret key 0600; never overwrites).
    #[command(after_help = PACKAGE_EXIT_CODES)]
    Keygen {
        /// Where to write the secret key.
        #[arg(long)]
        secret_key: PathBuf,
        /// Where to write the public key (give it to operators, e.g. beside the repository key).
        #[arg(long)]
        public_key: PathBuf,
        /// Encrypt the secret key with the password on this file's first line (as `minisign
        /// -G`); without it the key is stored unencrypted (as `minisign -G -W`).
        #[arg(long)]
        password_file: Option<PathBuf>,
    },
    /// Sign PKG, writing PKG.minisig with a trusted comment naming package, version and surface.
    #[command(after_help = PACKAGE_EXIT_CODES)]
    Sign {
        /// The minisign secret key.
        #[arg(long)]
        key: PathBuf,
        /// The file holding the secret key's password (first line), if it is encrypted.
        #[arg(long)]
        password_file: Option<PathBuf>,
        /// The connector package (.deb).
        package: PathBuf,
    },
    /// Verify PKG against PKG.minisig and the public key, and that it serves this controller's
    /// surface.
    #[command(after_help = PACKAGE_EXIT_CODES)]
    Verify {
        /// The minisign public key (the file `package keygen` or `minisign -G` wrote, or the
        /// bare base64 key).
        #[arg(long)]
        pubkey: PathBuf,
        /// The connector package (.deb); its signature is PKG.minisig.
        package: PathBuf,
    },
}

const RUN_EXIT_CODES: &str = "Exit codes: 0 every validation passed; 1 a validation failed (the \
backup did not restore: a probe, an assertion or the guest's state says why); 2 infrastructure \
error (a node unreachable or refusing, its surface digest differs, the connection lost, the deadline \
passed, interrupted, or a cleanup not proven complete; takes precedence over 1); 64 the command line \
is wrong; 65 the plan is refused; 66 the plan, the configuration or a secret file cannot be read; \
77 a file's owner or mode is refused (the message gives the chmod to run); 78 the controller \
configuration is refused; 71 the operating system refused to start the runtime.";

#[derive(clap::Args, Debug)]
struct RunPlanArgs {
    /// The plan (YAML; see docs/plans.md).
    plan: PathBuf,
    /// The controller configuration (state directory, reports directory, inventory).
    #[arg(long, default_value = certistack_controller::config::DEFAULT_CONFIG)]
    config: PathBuf,
    /// Validations at once on one node.
    #[arg(long, default_value_t = runner::DEFAULT_PER_NODE as u16, value_parser = clap::value_parser!(u16).range(1..=64))]
    per_node: u16,
    /// Validations at once in total.
    #[arg(long, default_value_t = runner::DEFAULT_TOTAL as u16, value_parser = clap::value_parser!(u16).range(1..=256))]
    max_concurrent: u16,
    /// One JSON object per step event and one per validation summary, one per line, instead of
    /// live lines and the table.
    #[arg(long)]
    json: bool,
}

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

/// A node addressed by its inventory name, or directly by state directory and address.
#[derive(clap::Args, Debug)]
struct NodeTarget {
    /// The controller configuration whose inventory names the node.
    #[arg(long, default_value = certistack_controller::config::DEFAULT_CONFIG)]
    config: PathBuf,
    /// Direct form: the controller's state directory (with --node HOST:PORT).
    #[arg(long, requires = "node")]
    state_dir: Option<PathBuf>,
    /// Direct form: the connector's address, HOST:PORT (with --state-dir).
    #[arg(long, requires = "state_dir")]
    node: Option<String>,
    /// Direct form: the node name its certificate must carry (defaults to HOST).
    #[arg(long, requires = "node")]
    name: Option<String>,
    /// The operator name in the short-lived client certificate minted for this call.
    #[arg(long, default_value = "ctl")]
    operator: String,
}

#[derive(clap::Args, Debug)]
struct OperatorArgs {
    /// The node's inventory name (omit with --node).
    #[arg(required_unless_present = "node", conflicts_with = "node")]
    inventory_node: Option<String>,
    #[command(flatten)]
    target: NodeTarget,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// NODE RUN: the node's inventory name and the run id; RUN alone with --node.
    #[arg(value_names = ["NODE", "RUN"], num_args = 1..=2, required = true)]
    positionals: Vec<String>,
    #[command(flatten)]
    target: NodeTarget,
}

#[derive(clap::Args, Debug)]
struct DoctorArgs {
    /// Inventory names of the nodes to check; every node of the inventory when none is given.
    nodes: Vec<String>,
    /// The controller configuration (its state directory and node inventory).
    #[arg(long, default_value = certistack_controller::config::DEFAULT_CONFIG)]
    config: PathBuf,
    /// One JSON object per check, one per line.
    #[arg(long)]
    json: bool,
    /// The sandbox VNet to check on every node checked (its forwarding, its SDN stanza, the
    /// legacy NAT rules that touch it).
    #[arg(long, conflicts_with = "plan")]
    vnet: Option<String>,
    /// A plan: each node is checked with the VNet of the plan's first validation on it.
    #[arg(long)]
    plan: Option<PathBuf>,
    /// Also boot the libguestfs appliance once on each node, as a guest network recovery
    /// would (its unit, its accelerator), for at most this many seconds (the node's
    /// limits.guest_network_timeout_secs caps it), and report how long it took.
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, require_equals = true,
          default_missing_value = "300", value_parser = clap::value_parser!(u32).range(1..=3600))]
    boot_appliance: Option<u32>,
}

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

const PLAN_EXIT_CODES: &str = "Exit codes: 0 the plan is accepted; 65 the plan is refused (the message names \
file:line:column or the validation and key, and what to change); 66 the plan or the configuration cannot \
be read; 77 a file's owner or mode is refused (the message gives the chmod or chown to run); 78 the \
controller configuration is refused; 64 the command line itself is wrong.";

#[derive(Subcommand, Debug)]
enum PlanCommand {
    /// Check a plan completely without contacting any node, and print what would run where.
    #[command(after_help = PLAN_EXIT_CODES)]
    Check {
        /// The plan (YAML; see docs/plans.md).
        plan: PathBuf,
        /// The controller configuration.
        #[arg(long, default_value = certistack_controller::config::DEFAULT_CONFIG)]
        config: PathBuf,
    },
}

const REPORT_EXIT_CODES: &str = "Exit codes: 0 the report verifies; 1 it does not, or it or the key \
cannot be read (the reason is printed); 64 usage error.";

#[derive(Subcommand, Debug)]
enum ReportCommand {
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
struct ReportArgs {
    /// The report file.
    report: PathBuf,
    /// The report-signing public key (PEM); defaults to the state directory's.
    #[arg(long)]
    key: Option<PathBuf>,
    /// The controller's state directory, whose report-signing public key is used.
    #[arg(long)]
    state_dir: Option<PathBuf>,
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

#[derive(clap::Args, Debug)]
struct HelloArgs {
    #[arg(long)]
    state_dir: PathBuf,
    /// The connector's address, HOST:PORT.
    #[arg(long)]
    node: String,
    /// The node name its certificate must carry (defaults to HOST).
    #[arg(long)]
    name: Option<String>,
    /// The operator name in the short-lived client certificate minted for this call.
    #[arg(long, default_value = "ctl")]
    operator: String,
}

#[derive(Debug)]
enum Failure {
    Local(String),
    Unreachable(String),
    Mismatch(String),
    /// A failure with its own documented exit code (see PLAN_EXIT_CODES).
    Coded(u8, String),
}

/// The exit code of a command line clap refuses (EX_USAGE); help and version exit 0.
const EXIT_USAGE: u8 = 64;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            let _ = error.print();
            return if error.use_stderr() {
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            let (code, message) = match failure {
                Failure::Local(m) => (1, m),
                Failure::Unreachable(m) => (3, m),
                Failure::Mismatch(m) => (4, m),
                Failure::Coded(code, m) => (code, m),
            };
            eprintln!("certistack-ctl: {message}");
            ExitCode::from(code)
        }
    }
}

fn local(error: impl std::fmt::Display) -> Failure {
    Failure::Local(error.to_string())
}

fn run(cli: Cli) -> Result<(), Failure> {
    let now = OffsetDateTime::now_utc();
    match cli.command {
        Command::Ca(CaCommand::Init { state_dir }) => {
            let fingerprint = authority::init(&state_dir, now).map_err(local)?;
            println!(
                "created CA, run-authority and report-signing keys in {}",
                state_dir.display()
            );
            println!("CA fingerprint: {fingerprint}");
            Ok(())
        }
        Command::Node(NodeCommand::Sign {
            state_dir,
            node,
            csr,
            out,
        }) => {
            let authority = authority::Authority::load(&state_dir).map_err(local)?;
            let csr = std::fs::read_to_string(&csr)
                .map_err(|e| local(format!("cannot read {}: {e}", csr.display())))?;
            let certificate = authority.sign_node_csr(&csr, &node, now).map_err(local)?;
            let fingerprint = authority.ca_fingerprint().map_err(local)?;
            match out {
                Some(path) => {
                    std::fs::write(&path, certificate)
                        .map_err(|e| local(format!("cannot write {}: {e}", path.display())))?;
                    println!(
                        "issued {} for node {node}; install it on the node with\n  certistack-connector enroll --install --certificate {} --ca {} --ca-fingerprint {fingerprint} --run-authority {}",
                        path.display(),
                        path.display(),
                        state_dir.join(authority::CA_CERT).display(),
                        state_dir.join(authority::RUN_AUTHORITY_PUB).display()
                    );
                }
                None => {
                    print!("{certificate}");
                    eprintln!("CA fingerprint: {fingerprint}");
                }
            }
            Ok(())
        }
        Command::Surface => {
            print!("{}", surface::describe().map_err(local)?);
            Ok(())
        }
        Command::Hello(args) => hello(args, now),
        Command::Plan(PlanCommand::Check { plan, config }) => plan_check(&plan, &config, now),
        Command::Report(command) => report_command(command),
        Command::Runs(args) => {
            let node = resolve_node(&args.target, args.inventory_node.as_deref())?;
            operator_runs(&node, now)
        }
        Command::Journal(args) => {
            let (node, run) = resolve_run_args(&args)?;
            operator_journal(&node, &run, now)
        }
        Command::Cleanup(args) => {
            let (node, run) = resolve_run_args(&args)?;
            operator_cleanup(&node, &run, now)
        }
        Command::Doctor(args) => doctor(&args, now),
        Command::Package(command) => package_command(command, now),
        Command::Nodes(NodesCommand::Audit { config, json }) => nodes_audit(&config, json, now),
        Command::Run(args) => run_plan(&args, now),
    }
}

/// The exit code when the operating system refuses what the command needs (EX_OSERR).
const EXIT_OS_ERROR: u8 = 71;

/// Loads the controller's state directory (CA and keys), mapping its failures to the documented
/// exit codes: 66 unreadable, 77 owner or mode refused.
fn package_command(command: PackageCommand, now: OffsetDateTime) -> Result<(), Failure> {
    let failure = |error: package::PackageError| {
        if error.is_refusal() {
            Failure::Mismatch(error.to_string())
        } else {
            local(error)
        }
    };
    let password = |file: Option<PathBuf>| {
        file.map(|path| package::read_password(&path))
            .transpose()
            .map_err(failure)
    };
    match command {
        PackageCommand::Keygen {
            secret_key,
            public_key,
            password_file,
        } => {
            let encrypted = password_file.is_some();
            package::generate_key(&secret_key, &public_key, password(password_file)?)
                .map_err(failure)?;
            println!(
                "wrote {} ({}) and {}",
                secret_key.display(),
                if encrypted {
                    "encrypted"
                } else {
                    "unencrypted"
                },
                public_key.display()
            );
            Ok(())
        }
        PackageCommand::Sign {
            key,
            password_file,
            package: path,
        } => {
            let timestamp = u64::try_from(now.unix_timestamp()).unwrap_or_default();
            let (signature, identity) =
                package::sign(&path, &key, password(password_file)?, timestamp).map_err(failure)?;
            println!("signed {identity}: {}", signature.display());
            Ok(())
        }
        PackageCommand::Verify {
            pubkey,
            package: path,
        } => {
            let identity = package::verify(&path, &pubkey, certistack_proto::SURFACE_DIGEST)
                .map_err(failure)?;
            println!(
                "ok: {} is {identity}, signed by the key in {}, and serves this controller's surface",
                path.display(),
                pubkey.display()
            );
            Ok(())
        }
    }
}

fn load_authority(state_dir: &std::path::Path) -> Result<authority::Authority, Failure> {
    authority::Authority::load(state_dir).map_err(|error| {
        let code = match &error {
            authority::AuthorityError::File(file) => file_failure_code(file),
            _ => 66,
        };
        Failure::Coded(code, format!("controller state directory refused: {error}"))
    })
}

/// Loads the controller configuration, mapping its failures to the documented exit codes.
fn load_config(
    config: &std::path::Path,
) -> Result<certistack_controller::config::ControllerConfig, Failure> {
    use certistack_controller::config::{ConfigError, ControllerConfig};
    ControllerConfig::load(config).map_err(|error| {
        let code = match &error {
            ConfigError::File(file) => file_failure_code(file),
            _ => 78,
        };
        Failure::Coded(code, format!("controller configuration refused: {error}"))
    })
}

fn file_failure_code(error: &certistack_core::files::FileError) -> u8 {
    use certistack_core::files::FileError;
    match error {
        FileError::Insecure { .. } | FileError::WrongOwner { .. } => 77,
        _ => 66,
    }
}

/// Loads and checks a plan, mapping its failures to the documented exit codes.
fn load_plan(
    plan: &std::path::Path,
    config: &certistack_controller::config::ControllerConfig,
    now: OffsetDateTime,
) -> Result<certistack_controller::plan::Plan, Failure> {
    use certistack_controller::plan::{Plan, PlanError};
    Plan::load(plan, config, now.unix_timestamp()).map_err(|error| {
        let code = match &error {
            PlanError::Read(file) | PlanError::Secret { error: file, .. } => {
                file_failure_code(file)
            }
            PlanError::TooLarge { .. } | PlanError::Syntax { .. } | PlanError::Refused { .. } => 65,
        };
        Failure::Coded(code, format!("plan refused: {error}"))
    })
}

fn run_plan(args: &RunPlanArgs, now: OffsetDateTime) -> Result<(), Failure> {
    use std::io::IsTerminal;
    use std::sync::Arc;
    let config = load_config(&args.config)?;
    let plan = load_plan(&args.plan, &config, now)?;
    let secrets = runner::Secrets::load(&plan).map_err(|error| {
        let code = match &error {
            runner::SecretError::File(file) => file_failure_code(file),
            runner::SecretError::Invalid(_) => 66,
        };
        Failure::Coded(code, error.to_string())
    })?;
    let authority = load_authority(&config.state_dir)?;
    let mode = if args.json {
        runner::ProgressMode::Json
    } else if std::io::stderr().is_terminal() && std::io::stdout().is_terminal() {
        runner::ProgressMode::Live
    } else {
        runner::ProgressMode::Plain
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Failure::Coded(EXIT_OS_ERROR, format!("cannot start the runtime: {e}")))?;
    let summaries = runtime.block_on(async {
        let (interrupt, interrupts) = tokio::sync::watch::channel(0u8);
        let progress = Arc::new(runner::Progress::new(mode));
        let signals = progress.clone();
        tokio::spawn(async move {
            use tokio::signal::unix::{SignalKind, signal};
            // SIGTERM (a timer or `timeout` stopping the job) and SIGHUP (the operator's
            // session gone) count as Ctrl-C: the run stops and cleans up rather than dying.
            let (Ok(mut term), Ok(mut hup), Ok(mut int)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::hangup()),
                signal(SignalKind::interrupt()),
            ) else {
                return;
            };
            let mut count = 0u8;
            loop {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                    _ = hup.recv() => {}
                }
                count = count.saturating_add(1);
                signals.println(match count {
                    1 => "certistack-ctl: interrupted: stopping after the current step, then cleaning up (interrupt again to abandon the step in progress)",
                    2 => "certistack-ctl: interrupted again: abandoning the step in progress; cleanup still runs (a third interrupt abandons the cleanup)",
                    _ => "certistack-ctl: interrupted a third time: abandoning the cleanup; the summary names the `certistack-ctl cleanup NODE RUN` to run",
                });
                let _ = interrupt.send(count);
            }
        });
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
    match runner::exit_code(&summaries) {
        0 => Ok(()),
        code => Err(Failure::Coded(
            code,
            match code {
                1 => "a validation failed: its backup did not restore (see its report)".into(),
                _ => "a validation could not be completed or its cleanup is unproven (see the table and the reports)".into(),
            },
        )),
    }
}

fn nodes_audit(config: &std::path::Path, json: bool, now: OffsetDateTime) -> Result<(), Failure> {
    use certistack_controller::audit;
    use certistack_controller::config::{ConfigError, ControllerConfig};
    use certistack_core::files::FileError;
    let config = ControllerConfig::load(config).map_err(|error| {
        let code = match &error {
            ConfigError::File(FileError::Insecure { .. } | FileError::WrongOwner { .. }) => 77,
            ConfigError::File(_) => 66,
            _ => 78,
        };
        Failure::Coded(code, format!("controller configuration refused: {error}"))
    })?;
    let authority = load_authority(&config.state_dir)?;
    let identity = authority.issue_operator("audit", now).map_err(local)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(local)?;
    let rows = runtime.block_on(audit::audit_fleet(
        config.nodes.values(),
        authority.ca_pem(),
        std::sync::Arc::new(identity),
        audit::DEFAULT_CONCURRENCY,
        audit::DEFAULT_NODE_TIMEOUT,
    ));
    if json {
        for row in &rows {
            println!("{}", row.to_json());
        }
    } else {
        print!("{}", audit::table(&rows));
    }
    match audit::exit_code(&rows) {
        audit::EXIT_MATCHES => Ok(()),
        audit::EXIT_UNREACHABLE => Err(Failure::Coded(
            audit::EXIT_UNREACHABLE,
            "a node of the inventory is unreachable".to_owned(),
        )),
        code => Err(Failure::Coded(
            code,
            "the fleet does not match: drift or warnings above".to_owned(),
        )),
    }
}

fn plan_check(
    plan: &std::path::Path,
    config: &std::path::Path,
    now: OffsetDateTime,
) -> Result<(), Failure> {
    use certistack_controller::plan;
    let config = load_config(config)?;
    let plan = load_plan(plan, &config, now)?;
    for validation in &plan.validations {
        println!("{}", plan::describe(validation));
    }
    println!(
        "plan {} accepted: {} validation(s); nothing was contacted",
        plan.path.display(),
        plan.validations.len()
    );
    Ok(())
}

fn report_command(command: ReportCommand) -> Result<(), Failure> {
    let (ReportCommand::Verify(args) | ReportCommand::Show(args)) = &command;
    let key_path = match (&args.key, &args.state_dir) {
        (Some(key), _) => key.clone(),
        (None, Some(dir)) => dir.join(authority::REPORT_PUB),
        (None, None) => return Err(local("give --key or --state-dir")),
    };
    let key = report::load_public_key(&key_path).map_err(local)?;
    let bytes = report::read(&args.report).map_err(local)?;
    let statement = report::verify(&bytes, &key)
        .map_err(|e| local(format!("{}: not valid: {e}", args.report.display())))?;
    let screenshot = report::check_screenshot(&statement, &args.report)
        .map_err(|e| local(format!("{}: not valid: {e}", args.report.display())))?;
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
                report::key_id(&key).map_err(local)?,
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

fn hello(args: HelloArgs, now: OffsetDateTime) -> Result<(), Failure> {
    let authority = authority::Authority::load(&args.state_dir).map_err(local)?;
    let identity = authority
        .issue_operator(&args.operator, now)
        .map_err(local)?;
    let host = args
        .node
        .rsplit_once(':')
        .map_or(args.node.as_str(), |(host, _)| host);
    let name = args
        .name
        .unwrap_or_else(|| host.trim_matches(['[', ']']).to_owned());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(local)?;
    let reply = runtime.block_on(async {
        let mut client = client::connect(&args.node, &name, authority.ca_pem(), &identity).await?;
        client::hello(&mut client, &name).await
    });
    let reply = reply.map_err(|error| match error {
        client::NodeError::SurfaceDigest { .. }
        | client::NodeError::NodeName { .. }
        | client::NodeError::Connect(
            ConnectError::WrongNode(..)
            | ConnectError::UnknownIssuer(_)
            | ConnectError::NotANode(..),
        ) => Failure::Mismatch(error.to_string()),
        client::NodeError::Tls(_) => Failure::Local(error.to_string()),
        _ => Failure::Unreachable(error.to_string()),
    })?;
    let skew_ms = reply.node_time_unix_ms - (now.unix_timestamp_nanos() / 1_000_000) as i64;
    println!("node: {}", reply.node_name);
    println!(
        "version: {} (source {}{})",
        reply.daemon_version,
        reply.source_commit,
        if reply.source_tree_dirty {
            ", with uncommitted changes"
        } else {
            ""
        }
    );
    println!("surface: {} (matches)", reply.surface_digest);
    println!("capabilities: {}", reply.capabilities.join(" "));
    println!(
        "node time: {} ms since the epoch ({skew_ms:+} ms from this host)",
        reply.node_time_unix_ms
    );
    println!("seen as: {}", reply.peer_identity);
    Ok(())
}

/// Exit code of an infrastructure failure of an operator command: unreachable, refused, or
/// not the node expected.
const EXIT_INFRASTRUCTURE: u8 = 2;
/// Exit code when the state directory or its keys cannot be used (EX_CONFIG).
const EXIT_LOCAL_CONFIG: u8 = 78;

fn operator_failure(error: certistack_controller::operator::OperatorError) -> Failure {
    use certistack_controller::operator::OperatorError;
    match error {
        OperatorError::Local(message) => Failure::Coded(EXIT_LOCAL_CONFIG, message),
        OperatorError::Node(client::NodeError::Tls(_)) => {
            Failure::Coded(EXIT_LOCAL_CONFIG, error.to_string())
        }
        OperatorError::Node(_) | OperatorError::TooManyRecords(_) => {
            Failure::Coded(EXIT_INFRASTRUCTURE, error.to_string())
        }
    }
}

/// Where an operator command connects: state directory, address and expected node name.
#[derive(Debug)]
struct ResolvedNode {
    state_dir: PathBuf,
    address: String,
    name: String,
    operator: String,
}

/// The node `inventory_node` names in `--config`, or the direct `--state-dir`/`--node` form.
fn resolve_node(
    target: &NodeTarget,
    inventory_node: Option<&str>,
) -> Result<ResolvedNode, Failure> {
    if let (Some(state_dir), Some(address)) = (&target.state_dir, &target.node) {
        let host = address
            .rsplit_once(':')
            .map_or(address.as_str(), |(host, _)| host);
        return Ok(ResolvedNode {
            state_dir: state_dir.clone(),
            address: address.clone(),
            name: target
                .name
                .clone()
                .unwrap_or_else(|| host.trim_matches(['[', ']']).to_owned()),
            operator: target.operator.clone(),
        });
    }
    let Some(wanted) = inventory_node else {
        return Err(Failure::Coded(
            EXIT_USAGE,
            "name an inventory node, or give --state-dir and --node".to_owned(),
        ));
    };
    let config = load_config(&target.config)?;
    let node = inventory_lookup(&config, wanted, &target.config)?;
    Ok(ResolvedNode {
        state_dir: config.state_dir.clone(),
        address: node.endpoint(),
        name: node.name.to_string(),
        operator: target.operator.clone(),
    })
}

fn inventory_lookup<'a>(
    config: &'a certistack_controller::config::ControllerConfig,
    wanted: &str,
    path: &std::path::Path,
) -> Result<&'a certistack_controller::config::InventoryNode, Failure> {
    config
        .nodes
        .values()
        .find(|node| node.name.to_string() == wanted)
        .ok_or_else(|| {
            let names: Vec<String> = config.nodes.keys().map(ToString::to_string).collect();
            Failure::Coded(
                EXIT_USAGE,
                format!(
                    "node {wanted:?} is not in the inventory of {}; it names: {}",
                    path.display(),
                    if names.is_empty() {
                        "no node".to_owned()
                    } else {
                        names.join(", ")
                    }
                ),
            )
        })
}

fn resolve_run_args(args: &RunArgs) -> Result<(ResolvedNode, String), Failure> {
    match (args.positionals.as_slice(), &args.target.node) {
        ([run], Some(_)) => Ok((resolve_node(&args.target, None)?, run.clone())),
        ([node, run], None) => Ok((resolve_node(&args.target, Some(node))?, run.clone())),
        _ => Err(Failure::Coded(
            EXIT_USAGE,
            "give NODE RUN (an inventory name and a run id), or RUN with --state-dir and --node"
                .to_owned(),
        )),
    }
}

/// Runs `call` on a connection to `node`, as an operator.
fn with_operator<T>(
    node: &ResolvedNode,
    now: OffsetDateTime,
    call: impl AsyncFnOnce(
        &mut certistack_proto::v1::connector_client::ConnectorClient<tonic::transport::Channel>,
    ) -> Result<T, certistack_controller::operator::OperatorError>,
) -> Result<T, Failure> {
    let authority = load_authority(&node.state_dir)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(local)?;
    runtime
        .block_on(async {
            let mut connection = certistack_controller::operator::connect(
                &authority,
                &node.address,
                &node.name,
                &node.operator,
                now,
            )
            .await?;
            call(&mut connection).await
        })
        .map_err(operator_failure)
}

fn doctor(args: &DoctorArgs, now: OffsetDateTime) -> Result<(), Failure> {
    use certistack_controller::doctor;
    let config = load_config(&args.config)?;
    let nodes = if args.nodes.is_empty() {
        config.nodes.values().collect::<Vec<_>>()
    } else {
        args.nodes
            .iter()
            .map(|name| inventory_lookup(&config, name, &args.config))
            .collect::<Result<Vec<_>, _>>()?
    };
    let mut vnets = doctor::VnetsByNode::new();
    if let Some(vnet) = &args.vnet {
        use certistack_core::validate::{Validated, VnetName};
        let vnet = VnetName::validate(vnet)
            .map_err(|reason| Failure::Coded(EXIT_USAGE, format!("--vnet {vnet:?}: {reason}")))?;
        for node in &nodes {
            vnets.insert(node.name.to_string(), vnet.clone());
        }
    }
    if let Some(plan) = &args.plan {
        for validation in load_plan(plan, &config, now)?.validations {
            vnets
                .entry(validation.grant.node.to_string())
                .or_insert(validation.grant.vnet);
        }
    }
    let authority = load_authority(&config.state_dir)?;
    let identity = authority
        .issue_operator("doctor", now)
        .map_err(|e| Failure::Coded(EXIT_LOCAL_CONFIG, e.to_string()))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Failure::Coded(EXIT_OS_ERROR, format!("cannot start the runtime: {e}")))?;
    let checks = runtime.block_on(doctor::check_fleet(
        nodes,
        authority.ca_pem(),
        std::sync::Arc::new(identity),
        std::sync::Arc::new(vnets),
        args.boot_appliance
            .map(|secs| std::time::Duration::from_secs(u64::from(secs))),
        certistack_controller::audit::DEFAULT_CONCURRENCY,
        doctor::DEFAULT_NODE_TIMEOUT,
    ));
    for check in checks.iter().flatten() {
        if args.json {
            println!("{}", check.to_json());
        } else {
            println!("{}", check.line());
        }
    }
    match doctor::exit_code(checks.iter().flatten()) {
        doctor::EXIT_OK => Ok(()),
        doctor::EXIT_UNREACHABLE => Err(Failure::Coded(
            doctor::EXIT_UNREACHABLE,
            "a node could not be checked: it is unreachable".to_owned(),
        )),
        code => Err(Failure::Coded(
            code,
            "a prerequisite failed; see the fail lines above".to_owned(),
        )),
    }
}

fn operator_runs(args: &ResolvedNode, now: OffsetDateTime) -> Result<(), Failure> {
    use certistack_controller::operator;
    let runs = with_operator(args, now, async |connection| {
        operator::list_runs(connection).await
    })?;
    for run in &runs {
        println!("{}", operator::describe_run(run));
    }
    println!("{} run(s)", runs.len());
    Ok(())
}

fn operator_journal(args: &ResolvedNode, run_id: &str, now: OffsetDateTime) -> Result<(), Failure> {
    use certistack_controller::operator;
    let records = with_operator(args, now, async |connection| {
        operator::read_journal(connection, run_id, |record| {
            println!("{}", operator::describe_record(record));
        })
        .await
    })?;
    let head = operator::verify_journal(run_id, &records).map_err(|reason| {
        Failure::Local(format!(
            "the journal of run {run_id} does not verify: {reason}; keep the node's journal file for inspection"
        ))
    })?;
    println!(
        "journal head {head} ({} records, chain verified here)",
        records.len()
    );
    Ok(())
}

fn operator_cleanup(args: &ResolvedNode, run_id: &str, now: OffsetDateTime) -> Result<(), Failure> {
    use certistack_controller::operator;
    let reply = with_operator(args, now, async |connection| {
        operator::cleanup(connection, run_id).await
    })?;
    for receipt in &reply.resources {
        println!("receipt {} {}", receipt.resource, receipt.end_state);
    }
    for residue in &reply.residue {
        println!("residue {residue}");
    }
    println!("journal head {}", reply.journal_head);
    operator::cleanup_complete(&reply).map_err(|shortfall| {
        Failure::Local(format!(
            "cleanup of run {run_id} is not complete: {shortfall}; see the lines above, fix on the node and run cleanup again"
        ))
    })?;
    println!("cleanup of run {run_id} complete: no residue");
    Ok(())
}
