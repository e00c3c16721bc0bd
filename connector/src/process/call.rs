//! One tool call as the daemon describes it (program, argv, environment, secrets, timeout) and
//! what it returns: the captured output or why it did not complete.

use super::secrets::SecretInput;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;
use zeroize::Zeroizing;

/// The `PATH` every tool runs with.
pub const TOOL_PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";
/// Bytes of stdout and of stderr kept per call.
pub const OUTPUT_CAP: usize = 64 * 1024;

#[derive(Debug)]
pub struct ToolCall {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub env: Vec<(&'static str, String)>,
    pub secrets: Vec<SecretInput>,
    pub timeout: Duration,
    /// Bytes of stdout and of stderr kept; [`OUTPUT_CAP`] unless the caller reads more.
    pub output_cap: usize,
    /// A secret written to the child's stdin, which is then closed (instead of /dev/null):
    /// for `systemd-run --pipe`, which hands only stdio to the unit it starts.
    pub stdin_secret: Option<Zeroizing<Vec<u8>>>,
    /// A transient unit whose main process the call waits for instead of the child's exit:
    /// `systemd-run --pipe` stays until the unit is inactive, which a unit that keeps a holder
    /// with `RemainAfterExit=yes` never is; once the unit's main process has exited the
    /// child is stopped (the unit stays) and its output is what the unit printed.
    pub settles_with_unit: Option<UnitWatch>,
    /// Properties of the transient unit the call is started in ([`super::in_transient_unit`]),
    /// beside the ones of its role: what confines a guest network recovery's appliance.
    pub unit_properties: Vec<String>,
}

/// How to watch a transient unit's state.
#[derive(Debug, Clone)]
pub struct UnitWatch {
    pub systemctl: PathBuf,
    pub unit: String,
}

impl ToolCall {
    pub fn new(program: impl Into<PathBuf>, timeout: Duration) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            secrets: Vec::new(),
            timeout,
            output_cap: OUTPUT_CAP,
            stdin_secret: None,
            settles_with_unit: None,
            unit_properties: Vec::new(),
        }
    }

    /// Keeps up to `bytes` of each output stream instead of [`OUTPUT_CAP`].
    pub fn output_cap(mut self, bytes: usize) -> Self {
        self.output_cap = bytes;
        self
    }

    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    pub fn env(mut self, key: &'static str, value: impl Into<String>) -> Self {
        self.env.push((key, value.into()));
        self
    }

    /// A property of the transient unit the call will be started in.
    pub fn unit_property(mut self, property: impl Into<String>) -> Self {
        self.unit_properties.push(property.into());
        self
    }

    pub fn secret(mut self, secret: SecretInput) -> Self {
        self.secrets.push(secret);
        self
    }

    /// The command line for logs and replies: program and arguments (never secrets, which
    /// are not arguments).
    pub fn display(&self) -> String {
        let mut line = self.program.display().to_string();
        for arg in &self.args {
            line.push(' ');
            line.push_str(&arg.to_string_lossy());
        }
        line
    }
}

/// Lines of a tool's stderr kept in its excerpt, and characters kept of each.
pub(super) const STDERR_EXCERPT_LINES: usize = 8;
const STDERR_EXCERPT_LINE_CHARS: usize = 512;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutput {
    /// The exit code, or `None` when a signal ended the child.
    pub exit_code: Option<i32>,
    /// Standard output as text (invalid UTF-8 replaced), for parsing and excerpts.
    pub stdout: String,
    /// Standard output as the tool wrote it, for digests: a hash over the text would name
    /// other bytes wherever the output was not UTF-8.
    pub stdout_bytes: Vec<u8>,
    pub stderr: String,
    pub elapsed: Duration,
    /// Output beyond the call's cap ([`OUTPUT_CAP`] by default) was dropped: a caller that parses all of it must not
    /// trust a partial reading.
    pub truncated: bool,
}

impl ToolOutput {
    pub fn success(&self) -> bool {
        self.exit_code == Some(0)
    }

    /// The last lines of stderr, for replies and logs.
    /// The last lines of the tool's stderr, each escaped and capped like any text the node does
    /// not control: a tool repeats what it was told (a guest's disk label, a server's error),
    /// and the excerpt goes into replies, logs and the journal.
    pub fn stderr_excerpt(&self) -> String {
        let lines: Vec<&str> = self.stderr.lines().collect();
        lines
            .get(lines.len().saturating_sub(STDERR_EXCERPT_LINES)..)
            .unwrap_or_default()
            .iter()
            .map(|line| {
                certistack_core::untrusted::printable(line.as_bytes(), STDERR_EXCERPT_LINE_CHARS)
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("cannot start {program}: {error}; check the tool path in the connector config")]
    Spawn {
        program: String,
        error: std::io::Error,
    },
    #[error("cannot pass a secret to {program}: {error}")]
    Secret {
        program: String,
        error: std::io::Error,
    },
    #[error("{program} did not finish within {timeout:?} and was killed; stderr: {stderr}")]
    Timeout {
        program: String,
        timeout: Duration,
        stderr: String,
    },
    #[error("waiting for {program} failed: {error}")]
    Wait {
        program: String,
        error: std::io::Error,
    },
}
