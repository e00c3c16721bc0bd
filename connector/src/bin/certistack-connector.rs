//! certistack-connector: reads its config, sets up logging and TLS, serves, reloads its TLS
//! files on SIGHUP, drains on SIGTERM.
#![forbid(unsafe_code)]
#![allow(clippy::print_stdout)]

use anyhow::Context;
use certistack_connector::config::{self, Config};
use certistack_connector::runs::StateLock;
use certistack_connector::server::{self, Connector};
use certistack_connector::{check, enroll};
use certistack_core::tls;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

const EXIT_CODES: &str = "Exit codes: 0 success; 1 the daemon failed while running; \
2 usage error; 3 refused to start (config, key or certificate missing, insecure or inconsistent; \
state directory in use by another connector) or `check` found a problem.";

#[derive(Parser, Debug)]
#[command(name = "certistack-connector", version, about = "CertiStack node connector", after_help = EXIT_CODES)]
struct Cli {
    /// Configuration file.
    #[arg(long, global = true, default_value = config::DEFAULT_PATH)]
    config: PathBuf,
    /// Log as JSON lines instead of text.
    #[arg(long, global = true)]
    log_json: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the connector surface (the default).
    Serve,
    /// Check the config and every file, tool and directory it names, changing nothing, then
    /// exit (3 when anything would stop or break `serve`).
    Check,
    /// Enroll this node with a controller.
    Enroll(EnrollArgs),
    /// The first program of a guest network recovery's confined unit (started by the daemon,
    /// never by hand): forbids the loop driver's ioctls to itself and what it starts, then
    /// executes PROGRAM (guestfish). Reads no configuration.
    #[command(name = "appliance-exec", hide = true)]
    ApplianceExec {
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<std::ffi::OsString>,
    },
}

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("mode").required(true).args(["csr", "install"])))]
struct EnrollArgs {
    /// Create the node key (if absent) and print a certificate signing request on stdout.
    #[arg(long)]
    csr: bool,
    /// Install the certificate signed by `certistack-ctl node sign`, the CA and the run-authority key.
    #[arg(long, requires_all = ["certificate", "ca", "ca_fingerprint", "run_authority"])]
    install: bool,
    #[arg(long, requires = "install")]
    certificate: Option<PathBuf>,
    #[arg(long, requires = "install")]
    ca: Option<PathBuf>,
    /// The CA certificate's fingerprint as `certistack-ctl ca init` printed it (sha256:<hex>);
    /// the CA file is installed only if it matches.
    #[arg(long, requires = "install")]
    ca_fingerprint: Option<enroll::CaFingerprint>,
    #[arg(long, requires = "install")]
    run_authority: Option<PathBuf>,
}

enum Failure {
    Refused(anyhow::Error),
    /// `check` found problems; it printed each one.
    CheckFailed(usize),
    Runtime(anyhow::Error),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Before logging or configuration: the launcher runs as the appliance user, in its unit.
    if let Some(Command::ApplianceExec { command }) = &cli.command {
        let Some((program, args)) = command.split_first() else {
            return ExitCode::from(2);
        };
        let reason = certistack_connector::node::guest_network::exec_without_loop_ioctls(
            std::path::Path::new(program),
            args,
        );
        eprintln!("certistack-connector appliance-exec: {reason}");
        return ExitCode::from(1);
    }
    init_logging(cli.log_json);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Refused(error)) => {
            tracing::error!("refusing to start: {error:#}");
            ExitCode::from(3)
        }
        Err(Failure::CheckFailed(problems)) => {
            tracing::error!("check found {problems} problem(s); `serve` would refuse or fail");
            ExitCode::from(3)
        }
        Err(Failure::Runtime(error)) => {
            tracing::error!("{error:#}");
            ExitCode::from(1)
        }
    }
}

fn init_logging(json: bool) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_env("CERTISTACK_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
    };
    // Started by systemd: records go to the journal with their fields as journal fields
    // (RUN_ID, RPC, PEER, …), so `journalctl RUN_ID=…` finds a run's lines.
    if certistack_connector::systemd::stderr_is_journal() {
        match tracing_journald::layer() {
            Ok(journald) => {
                tracing_subscriber::registry()
                    .with(filter())
                    .with(journald.with_field_prefix(None))
                    .init();
                return;
            }
            Err(error) => eprintln!("cannot reach journald ({error}); logging to stderr"),
        }
    }
    let builder = || {
        tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
    };
    if json {
        builder().with_ansi(false).json().init();
    } else if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        // Colour only on a terminal.
        builder().with_ansi(true).init();
    } else {
        certistack_connector::log_line::plain_subscriber(filter(), std::io::stderr).init();
    }
}

fn run(cli: Cli) -> Result<(), Failure> {
    let config = Config::load(&cli.config)
        .with_context(|| format!("loading {}", cli.config.display()))
        .map_err(Failure::Refused)?;
    tls::provider();
    match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => serve(config),
        Command::Check => {
            let report = check::check(&config).map_err(|e| Failure::Refused(e.into()))?;
            for note in &report.notes {
                println!("ok: {note}");
            }
            if report.problems.is_empty() {
                println!("configuration ok");
                return Ok(());
            }
            for problem in &report.problems {
                println!("problem: {problem}");
            }
            Err(Failure::CheckFailed(report.problems.len()))
        }
        Command::Enroll(args) if args.csr => {
            let csr =
                enroll::certificate_request(&config).map_err(|e| Failure::Refused(e.into()))?;
            print!("{csr}");
            Ok(())
        }
        Command::Enroll(args) => {
            let (Some(certificate), Some(ca), Some(fingerprint), Some(authority)) = (
                args.certificate,
                args.ca,
                args.ca_fingerprint,
                args.run_authority,
            ) else {
                return Err(Failure::Refused(anyhow::anyhow!(
                    "--install needs --certificate, --ca, --ca-fingerprint and --run-authority"
                )));
            };
            enroll::install(&config, &certificate, &ca, &fingerprint, &authority)
                .map_err(|e| Failure::Refused(e.into()))?;
            println!(
                "installed {}, {} and {}",
                config.tls.certificate.display(),
                config.tls.controller_ca.display(),
                config.tls.run_authority_public_key.display()
            );
            Ok(())
        }
        // Handled in `main`, before the configuration is read.
        Command::ApplianceExec { .. } => Ok(()),
    }
}

fn serve(config: Config) -> Result<(), Failure> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
        .map_err(Failure::Runtime)?;
    // One connector per state directory, before any journal is opened (opening repairs them).
    let _lock = StateLock::acquire(&config.paths.state_dir)
        .context("locking the state directory")
        .map_err(Failure::Refused)?;
    runtime.block_on(async {
        let connector = Connector::for_node(config).map_err(|e| Failure::Refused(e.into()))?;
        let listener = connector
            .bind()
            .await
            .map_err(|e| Failure::Refused(e.into()))?;
        tokio::spawn(server::reload_on_hangup(connector.tls_reload()));
        connector
            .serve(listener, shutdown_signal())
            .await
            .map_err(|e| Failure::Runtime(e.into()))
    })
}

/// Completes on SIGTERM (systemd stop) or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; stop the daemon with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: draining"),
        _ = int.recv() => tracing::info!("SIGINT: draining"),
    }
}
