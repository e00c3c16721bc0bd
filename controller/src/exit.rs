//! How a `certistack-ctl` command ends: its exit code and the message printed with it. Every
//! command returns `Result<(), ExitStatus>`; the codes (documented in each command's `--help`,
//! the README and docs/plans.md) are decided here and nowhere else.

use crate::audit::NodeAudit;
use crate::authority::AuthorityError;
use crate::client::NodeError;
use crate::config::ConfigError;
use crate::connect::ConnectError;
use crate::doctor::{self, Check, Level};
use crate::operator::OperatorError;
use crate::package::PackageError;
use crate::plan::PlanError;
use crate::runner::SecretError;
use crate::verdict::{CleanupState, Outcome, Summary};
use certistack_core::files::FileError;

/// Everything the command was asked to do was done (also `--help` and `--version`).
pub const SUCCESS: u8 = 0;
/// A local failure (a state directory, key or file) of `ca`, `node`, `surface`, `hello`,
/// `report` and `package`; a failure found by `runs`, `journal`, `cleanup`, `run`, `doctor` and
/// `nodes audit` (a journal that does not verify, residue, a failed backup, a failed check,
/// drift or a warning).
pub const FAILED: u8 = 1;
/// Infrastructure: a node unreachable, refusing or not the one expected (`runs`, `journal`,
/// `cleanup`, `run`, `doctor`, `nodes audit`).
pub const INFRASTRUCTURE: u8 = 2;
/// `hello`: the node could not be reached, or refused TLS or the call.
pub const UNREACHABLE: u8 = 3;
/// `hello` and `package`: the node or the package is not what was expected.
pub const MISMATCH: u8 = 4;
/// The command line is wrong (EX_USAGE); also a node that is not in the inventory.
pub const USAGE: u8 = 64;
/// The plan is refused (EX_DATAERR).
pub const REFUSED_PLAN: u8 = 65;
/// A file cannot be read (EX_NOINPUT).
pub const UNREADABLE: u8 = 66;
/// The operating system refused to start the runtime (EX_OSERR).
pub const OS_ERROR: u8 = 71;
/// The output could not be written (EX_IOERR): a full disk, a failing device.
pub const OUTPUT_FAILED: u8 = 74;
/// Another `run` holds the state directory's run lock (EX_TEMPFAIL): nothing was done; run again
/// once it has ended.
pub const BUSY: u8 = 75;
/// A file's owner or mode is refused, or the PVE API token lacks a privilege the plan needs
/// (EX_NOPERM).
pub const INSECURE_FILE: u8 = 77;
/// The controller configuration, or a key of its state directory, is refused (EX_CONFIG).
pub const REFUSED_CONFIG: u8 = 78;

/// Exit codes of `certistack-ctl nodes audit`.
pub const AUDIT_MATCHES: u8 = SUCCESS;
pub const AUDIT_DRIFT_OR_WARNING: u8 = FAILED;
pub const AUDIT_UNREACHABLE: u8 = INFRASTRUCTURE;

/// Exit codes of `certistack-ctl doctor`.
pub const DOCTOR_OK: u8 = SUCCESS;
pub const DOCTOR_FAILED: u8 = FAILED;
pub const DOCTOR_UNREACHABLE: u8 = INFRASTRUCTURE;

/// The longest message printed with an exit code.
pub const MAX_MESSAGE_CHARS: usize = 4 * certistack_core::untrusted::MAX_DETAIL_CHARS;

/// A command's exit code with the message it prints on standard error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitStatus {
    code: u8,
    message: String,
}

impl ExitStatus {
    pub fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// A local failure: exit 1 with the error as its message.
    pub fn local(error: impl std::fmt::Display) -> Self {
        Self::new(FAILED, error.to_string())
    }

    /// A command line the commands themselves refuse: exit 64.
    pub fn usage(message: impl Into<String>) -> Self {
        Self::new(USAGE, message)
    }

    /// The operating system refused to start the runtime: exit 71.
    pub fn runtime_refused(error: std::io::Error) -> Self {
        Self::new(OS_ERROR, format!("cannot start the runtime: {error}"))
    }

    /// Standard output refused what was written: exit 74, unless the reader is gone (a closed
    /// pipe, `… | head`), which is no failure of the command.
    pub fn of_output(written: std::io::Result<()>) -> Result<(), Self> {
        match written {
            Err(error) if error.kind() != std::io::ErrorKind::BrokenPipe => Err(Self::new(
                OUTPUT_FAILED,
                format!("cannot write the output: {error}"),
            )),
            _ => Ok(()),
        }
    }

    pub fn code(&self) -> u8 {
        self.code
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The message as `certistack-ctl` prints it on standard error: an error may quote what a
    /// node or a guest said (a refusal, a cursor, a file name), so it is escaped and bounded.
    pub fn printed_message(&self) -> String {
        certistack_core::untrusted::printable(self.message.as_bytes(), MAX_MESSAGE_CHARS)
    }

    /// Exit 0 when every validation passed; 2 when any ended in an infrastructure error, an
    /// interruption or an unproven cleanup; otherwise 1 when a validation failed.
    pub fn of_run(summaries: &[Summary]) -> Result<(), Self> {
        match run_exit_code(summaries) {
            SUCCESS => Ok(()),
            FAILED => Err(Self::new(
                FAILED,
                "a validation failed: its backup did not restore (see its report)",
            )),
            code => Err(Self::new(
                code,
                "a validation could not be completed or its cleanup is unproven (see the table and the reports)",
            )),
        }
    }

    /// The fleet audit's verdict: see [`audit_exit_code`].
    pub fn of_audit(rows: &[NodeAudit]) -> Result<(), Self> {
        match audit_exit_code(rows) {
            AUDIT_MATCHES => Ok(()),
            AUDIT_UNREACHABLE => Err(Self::new(
                AUDIT_UNREACHABLE,
                "a node of the inventory is unreachable",
            )),
            code => Err(Self::new(
                code,
                "the fleet does not match: drift or warnings above",
            )),
        }
    }

    /// The doctor's verdict: see [`doctor_exit_code`].
    pub fn of_doctor<'a>(checks: impl IntoIterator<Item = &'a Check>) -> Result<(), Self> {
        match doctor_exit_code(checks) {
            DOCTOR_OK => Ok(()),
            DOCTOR_UNREACHABLE => Err(Self::new(
                DOCTOR_UNREACHABLE,
                "a node could not be checked: it is unreachable",
            )),
            code => Err(Self::new(
                code,
                "a prerequisite failed; see the fail lines above",
            )),
        }
    }
}

/// The exit code of a run: 0 every validation passed; 2 any infrastructure error, interruption
/// or unproven cleanup; otherwise 1 when a validation failed.
pub fn run_exit_code(summaries: &[Summary]) -> u8 {
    if summaries
        .iter()
        .any(|s| s.outcome == Outcome::Error || s.cleanup == CleanupState::Unproven)
    {
        INFRASTRUCTURE
    } else if summaries.iter().any(|s| s.outcome == Outcome::Failed) {
        FAILED
    } else {
        SUCCESS
    }
}

/// 2 when a node is unreachable, else 1 on drift or a warning, else 0.
pub fn audit_exit_code(rows: &[NodeAudit]) -> u8 {
    if rows.iter().any(|row| row.answer.is_none()) {
        AUDIT_UNREACHABLE
    } else if rows.iter().any(|row| row.status() != "ok") {
        AUDIT_DRIFT_OR_WARNING
    } else {
        AUDIT_MATCHES
    }
}

/// 2 when a node could not be asked, else 1 when a check failed, else 0 (warnings included).
pub fn doctor_exit_code<'a>(checks: impl IntoIterator<Item = &'a Check>) -> u8 {
    let mut code = DOCTOR_OK;
    for check in checks {
        if check.check == doctor::CONNECT && check.level == Level::Fail {
            return DOCTOR_UNREACHABLE;
        }
        if check.level == Level::Fail {
            code = DOCTOR_FAILED;
        }
    }
    code
}

/// 77 for a file whose owner or mode is refused, 66 for one that cannot be read.
pub fn file_exit_code(error: &FileError) -> u8 {
    match error {
        FileError::Insecure { .. } | FileError::WrongOwner { .. } => INSECURE_FILE,
        _ => UNREADABLE,
    }
}

/// The controller's state directory (CA and keys): 66 unreadable, 77 owner or mode refused.
impl From<AuthorityError> for ExitStatus {
    fn from(error: AuthorityError) -> Self {
        let code = match &error {
            AuthorityError::File(file) => file_exit_code(file),
            _ => UNREADABLE,
        };
        Self::new(code, format!("controller state directory refused: {error}"))
    }
}

/// The controller configuration: 66 unreadable, 77 owner or mode refused, 78 refused.
impl From<ConfigError> for ExitStatus {
    fn from(error: ConfigError) -> Self {
        let code = match &error {
            ConfigError::File(file) => file_exit_code(file),
            _ => REFUSED_CONFIG,
        };
        Self::new(code, format!("controller configuration refused: {error}"))
    }
}

/// A plan: 65 refused, and its files (the plan, its secrets) 66 or 77.
impl From<PlanError> for ExitStatus {
    fn from(error: PlanError) -> Self {
        let code = match &error {
            PlanError::Read(file) | PlanError::Secret { error: file, .. } => file_exit_code(file),
            PlanError::TooLarge { .. } | PlanError::Syntax { .. } | PlanError::Refused { .. } => {
                REFUSED_PLAN
            }
            // Permission denied, as for a file's mode: the operator grants, then retries.
            PlanError::Privileges { .. } => INSECURE_FILE,
            // Not the plan's fault: the nightly monitor should see an infrastructure failure.
            PlanError::Unavailable { .. } => {
                return Self::new(
                    INFRASTRUCTURE,
                    format!("the plan could not be resolved: {error}"),
                );
            }
        };
        Self::new(code, format!("plan refused: {error}"))
    }
}

/// A refused plan's exit status. Missing privileges are listed first on standard error, one
/// line each (every need, then the `pveum` lines to paste), each line escaped on its own.
pub fn plan_refused(error: crate::plan::PlanError) -> ExitStatus {
    if let crate::plan::PlanError::Privileges { lacking, .. } = &error {
        let line = |text: &str| {
            certistack_core::untrusted::printable(
                text.as_bytes(),
                certistack_core::untrusted::MAX_DETAIL_CHARS,
            )
        };
        for need in &lacking.required {
            eprintln!(
                "missing {} on {}: {}",
                need.privilege,
                line(&need.path),
                line(&need.why)
            );
        }
        for need in &lacking.worked_around {
            eprintln!(
                "missing (worked around) {} on {}: {}",
                need.privilege,
                line(&need.path),
                line(&need.why)
            );
        }
        eprintln!(
            "grant them with (a role that exists already makes its `role add` fail: skip that line; the user is granted too, as privilege separation needs, so give the token a user of its own: an entry on a path replaces what the user inherited there):"
        );
        for grant in &lacking.grant {
            eprintln!("  {}", line(grant));
        }
        return ExitStatus::new(
            INSECURE_FILE,
            format!(
                "plan refused: the PVE API token lacks {} privilege(s) the plan needs (above); nothing was asked of any node",
                lacking.required.len()
            ),
        );
    }
    error.into()
}

/// What the plan works around, on standard error (escaped: it quotes the plan).
pub fn print_plan_warnings(plan: &crate::plan::Plan) {
    for warning in &plan.warnings {
        eprintln!(
            "certistack-ctl: warning: {}",
            certistack_core::untrusted::printable(
                warning.as_bytes(),
                certistack_core::untrusted::MAX_DETAIL_CHARS
            )
        );
    }
}

/// The plan's secret files: 66 or 77.
impl From<crate::history::StoreError> for ExitStatus {
    fn from(error: crate::history::StoreError) -> Self {
        use crate::history::StoreError as E;
        let code = match &error {
            E::Corrupt { .. } | E::Newer { .. } => UNREADABLE,
            E::Locked { .. } | E::Io { .. } => OS_ERROR,
            E::Refused(_) => USAGE,
        };
        Self::new(code, format!("the run history: {error}"))
    }
}

impl From<SecretError> for ExitStatus {
    fn from(error: SecretError) -> Self {
        let code = match &error {
            SecretError::File(file) => file_exit_code(file),
            SecretError::Invalid(_) => UNREADABLE,
        };
        Self::new(code, error.to_string())
    }
}

/// An operator command's connection or call: 78 when this side's keys or TLS configuration
/// cannot be used, 2 when the node is unreachable, refuses or is not the one expected.
impl From<OperatorError> for ExitStatus {
    fn from(error: OperatorError) -> Self {
        match error {
            OperatorError::Local(message) => Self::new(REFUSED_CONFIG, message),
            OperatorError::Node(NodeError::Tls(_)) => Self::new(REFUSED_CONFIG, error.to_string()),
            OperatorError::Node(_) | OperatorError::TooManyRecords(_) => {
                Self::new(INFRASTRUCTURE, error.to_string())
            }
        }
    }
}

/// `hello`: 4 when the node is not the one expected, 1 when this side's TLS configuration
/// cannot be used, 3 when the node could not be reached or refused.
impl From<NodeError> for ExitStatus {
    fn from(error: NodeError) -> Self {
        let code = match &error {
            NodeError::SurfaceDigest { .. }
            | NodeError::NodeName { .. }
            | NodeError::Connect(
                ConnectError::WrongNode(..)
                | ConnectError::UnknownIssuer(_)
                | ConnectError::NotANode(..),
            ) => MISMATCH,
            NodeError::Tls(_) => FAILED,
            _ => UNREACHABLE,
        };
        Self::new(code, error.to_string())
    }
}

/// `package`: 4 when the package or its signature is refused, 1 for a local failure.
impl From<PackageError> for ExitStatus {
    fn from(error: PackageError) -> Self {
        if error.is_refusal() {
            Self::new(MISMATCH, error.to_string())
        } else {
            Self::local(error)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn summary(outcome: Outcome, cleanup: CleanupState) -> Summary {
        Summary {
            validation: "web01".into(),
            node: "pve1".into(),
            run_id: "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f".into(),
            outcome,
            cleanup,
            reasons: Vec::new(),
            elapsed_ms: 61_500,
            report: Some(PathBuf::from("/var/lib/certistack/reports/r.json")),
            steps: Vec::new(),
        }
    }

    #[test]
    fn the_exit_code_puts_infrastructure_before_a_failed_backup() {
        use CleanupState::{Complete, NotNeeded, Unproven};
        assert_eq!(run_exit_code(&[summary(Outcome::Passed, Complete)]), 0);
        assert_eq!(
            run_exit_code(&[
                summary(Outcome::Passed, Complete),
                summary(Outcome::Failed, Complete)
            ]),
            1
        );
        assert_eq!(
            run_exit_code(&[
                summary(Outcome::Failed, Complete),
                summary(Outcome::Error, NotNeeded)
            ]),
            2
        );
        // A passed backup whose cleanup is unproven still needs an operator.
        assert_eq!(run_exit_code(&[summary(Outcome::Passed, Unproven)]), 2);
    }

    #[test]
    fn exit_codes_rank_unreachable_over_failure_over_warning() {
        let check = |check: &'static str, level| Check {
            node: "pve1".into(),
            check,
            level,
            detail: String::new(),
        };
        assert_eq!(doctor_exit_code(&[check("clock", Level::Warn)]), DOCTOR_OK);
        assert_eq!(
            doctor_exit_code(&[check("pve", Level::Fail), check("clock", Level::Warn)]),
            DOCTOR_FAILED
        );
        assert_eq!(
            doctor_exit_code(&[
                check("pve", Level::Fail),
                check(doctor::CONNECT, Level::Fail)
            ]),
            DOCTOR_UNREACHABLE
        );
    }

    #[test]
    fn a_message_quoting_a_node_is_printed_escaped_and_bounded() {
        use certistack_core::fixtures::{TERMINAL_SEQUENCES, acts_on_a_terminal};
        let status = ExitStatus::local(format!(
            "the node's ListRuns cursor went from a back to {TERMINAL_SEQUENCES}{}",
            "A".repeat(100_000)
        ));
        let printed = status.printed_message();
        assert!(!acts_on_a_terminal(&printed), "{printed:?}");
        assert!(printed.starts_with("the node's ListRuns cursor went from a back to \\u{1b}[1A"));
        assert!(
            printed.len() < MAX_MESSAGE_CHARS + 64,
            "{} bytes",
            printed.len()
        );
        assert_eq!(ExitStatus::local("plain").printed_message(), "plain");
    }
}
