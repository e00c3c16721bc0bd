//! The bodies of the `certistack-ctl` commands: what each one reads, asks and prints. The
//! binary parses the command line and dispatches here.
#![allow(clippy::print_stdout)]

pub mod audit;
pub mod doctor;
pub mod hello;
pub mod operator;
pub mod package;
pub mod plan;
pub mod report;
pub mod run;
pub mod target;

use crate::authority;
use time::OffsetDateTime;

#[derive(Debug)]
pub enum Failure {
    Local(String),
    Unreachable(String),
    Mismatch(String),
    /// A failure with its own documented exit code (see PLAN_EXIT_CODES).
    Coded(u8, String),
}

/// The exit code of a command line clap refuses (EX_USAGE); help and version exit 0.
pub const EXIT_USAGE: u8 = 64;

pub fn local(error: impl std::fmt::Display) -> Failure {
    Failure::Local(error.to_string())
}

/// The exit code when the operating system refuses what the command needs (EX_OSERR).
pub const EXIT_OS_ERROR: u8 = 71;

/// Loads the controller's state directory (CA and keys), mapping its failures to the documented
/// exit codes: 66 unreadable, 77 owner or mode refused.
pub fn load_authority(state_dir: &std::path::Path) -> Result<authority::Authority, Failure> {
    authority::Authority::load(state_dir).map_err(|error| {
        let code = match &error {
            authority::AuthorityError::File(file) => file_failure_code(file),
            _ => 66,
        };
        Failure::Coded(code, format!("controller state directory refused: {error}"))
    })
}

/// Loads the controller configuration, mapping its failures to the documented exit codes.
pub fn load_config(config: &std::path::Path) -> Result<crate::config::ControllerConfig, Failure> {
    use crate::config::{ConfigError, ControllerConfig};
    ControllerConfig::load(config).map_err(|error| {
        let code = match &error {
            ConfigError::File(file) => file_failure_code(file),
            _ => 78,
        };
        Failure::Coded(code, format!("controller configuration refused: {error}"))
    })
}

pub fn file_failure_code(error: &certistack_connector::files::FileError) -> u8 {
    use certistack_connector::files::FileError;
    match error {
        FileError::Insecure { .. } | FileError::WrongOwner { .. } => 77,
        _ => 66,
    }
}

/// Loads and checks a plan, mapping its failures to the documented exit codes.
pub fn load_plan(
    plan: &std::path::Path,
    config: &crate::config::ControllerConfig,
    now: OffsetDateTime,
) -> Result<crate::plan::Plan, Failure> {
    use crate::plan::{Plan, PlanError};
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

/// Exit code of an infrastructure failure of an operator command: unreachable, refused, or
/// not the node expected.
pub const EXIT_INFRASTRUCTURE: u8 = 2;

/// Exit code when the state directory or its keys cannot be used (EX_CONFIG).
pub const EXIT_LOCAL_CONFIG: u8 = 78;
