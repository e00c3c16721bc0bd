//! Runs the node tools: a fixed program with an argv built from validated values.
//!
//! - no shell: the program path comes from the config, every argument from a typed value;
//! - the environment is cleared, then exactly `PATH` and the variables the tool needs are set;
//! - secrets never reach argv, the environment or a file: they are written into a pipe (or a
//!   sealed memfd) whose read end the child inherits at a fixed descriptor number, and the
//!   tool is told that number (`PBS_PASSWORD_FD=3`, `--keyfile /proc/self/fd/4`);
//! - stdout and stderr are captured up to a cap, the rest is drained and dropped;
//! - every call has a timeout; on expiry the child's whole process group is killed.
//!
//! The child's output is taken when the child exits, not at EOF: a tool that forks a daemon
//! (`proxmox-backup-client map`) may leave its output pipes open in that daemon.

mod call;
mod secrets;
mod spawn;
mod tool_identity;
mod transient_unit;

pub use call::{OUTPUT_CAP, TOOL_PATH, ToolCall, ToolError, ToolOutput, UnitWatch};
pub use secrets::{MAX_SECRETS, SecretInput, SecretKind};
pub use spawn::{RunningTool, run, start, start_interactive};
pub use tool_identity::{REAP_WITHIN, ToolIdentity};
pub use transient_unit::{
    GUEST_NETWORK_UNIT_MARGIN, SECRET_FD_IN_UNIT, TransientRole, UnitRelease, in_transient_unit,
    release_transient_unit, transient_unit_description, transient_unit_name,
};

#[cfg(test)]
mod tests;
