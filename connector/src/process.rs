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

use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;
use zeroize::Zeroizing;

/// The `PATH` every tool runs with.
pub const TOOL_PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";
/// Bytes of stdout and of stderr kept per call.
pub const OUTPUT_CAP: usize = 64 * 1024;
/// How long to wait for output after the child exited.
const OUTPUT_GRACE: Duration = Duration::from_millis(300);

/// Bytes handed to the child through an inherited descriptor, zeroized after use.
pub struct SecretInput {
    /// The descriptor number the child sees.
    pub child_fd: RawFd,
    pub bytes: Zeroizing<Vec<u8>>,
    pub kind: SecretKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretKind {
    /// A pipe the child reads to EOF (a password).
    Pipe,
    /// A sealed anonymous memory file the child opens as `/proc/self/fd/N` (a key file).
    Memfd,
}

impl std::fmt::Debug for SecretInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SecretInput({:?} on fd {}, {} bytes redacted)",
            self.kind,
            self.child_fd,
            self.bytes.len()
        )
    }
}

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
const STDERR_EXCERPT_LINES: usize = 8;
const STDERR_EXCERPT_LINE_CHARS: usize = 512;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutput {
    /// The exit code, or `None` when a signal ended the child.
    pub exit_code: Option<i32>,
    pub stdout: String,
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

/// A descriptor prepared for the child: created close-on-exec, moved to `child_fd` between
/// fork and exec.
struct Inherited {
    fd: OwnedFd,
    child_fd: RawFd,
}

/// Secrets one call may pass: the child-side move list is a fixed array, because the code
/// between fork and exec must not allocate.
pub const MAX_SECRETS: usize = 8;

/// Checks the descriptor numbers the child is to receive before anything is created: at most
/// [`MAX_SECRETS`], none of them 0–2 (stdio), no number twice.
fn check_targets(secrets: &[SecretInput]) -> std::io::Result<()> {
    if secrets.len() > MAX_SECRETS {
        return Err(std::io::Error::other(format!(
            "{} secrets for one call; at most {MAX_SECRETS}",
            secrets.len()
        )));
    }
    let mut seen = std::collections::BTreeSet::new();
    for secret in secrets {
        if secret.child_fd < 3 {
            return Err(std::io::Error::other(format!(
                "descriptor {} is stdio; a secret goes on 3 or above",
                secret.child_fd
            )));
        }
        if !seen.insert(secret.child_fd) {
            return Err(std::io::Error::other(format!(
                "two secrets for descriptor {}",
                secret.child_fd
            )));
        }
    }
    Ok(())
}

/// Checks, then creates, the descriptors for every secret of a call.
fn prepare_secrets(secrets: &[SecretInput]) -> std::io::Result<Vec<Inherited>> {
    check_targets(secrets)?;
    secrets.iter().map(prepare_secret).collect()
}

/// Writes all of `bytes` into the pipe, or fails: a password cut short would be a wrong
/// password, and the tool would say only that authentication failed.
fn fill_pipe(write: &OwnedFd, bytes: &[u8]) -> std::io::Result<()> {
    // Non-blocking: the only reader is a child not started yet, so a pipe that cannot take the
    // whole secret (a pipe shrunk by fs.pipe-user-pages-soft holds one page) must fail, not hang.
    rustix::fs::fcntl_setfl(write, rustix::fs::OFlags::NONBLOCK)?;
    let mut written = 0;
    while let Some(rest) = bytes.get(written..).filter(|rest| !rest.is_empty()) {
        match rustix::io::write(write, rest) {
            Ok(0) => return Err(std::io::Error::from(std::io::ErrorKind::WriteZero)),
            Ok(n) => written += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => {
                return Err(std::io::Error::other(format!(
                    "the pipe took {written} of the secret's {} bytes",
                    bytes.len()
                )));
            }
            Err(error) => return Err(error.into()),
        }
    }
    Ok(())
}

fn prepare_secret(secret: &SecretInput) -> std::io::Result<Inherited> {
    let fd = match secret.kind {
        SecretKind::Pipe => {
            let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
            fill_pipe(&write, &secret.bytes)?;
            // Closed before the child starts, so the child reads to EOF.
            drop(write);
            read
        }
        SecretKind::Memfd => {
            use rustix::fs::{MemfdFlags, SealFlags};
            let fd = rustix::fs::memfd_create(
                "certistack-key",
                MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
            )?;
            let mut written = 0;
            while let Some(rest) = secret.bytes.get(written..).filter(|rest| !rest.is_empty()) {
                match rustix::io::write(&fd, rest) {
                    Ok(0) => return Err(std::io::Error::from(std::io::ErrorKind::WriteZero)),
                    Ok(n) => written += n,
                    Err(rustix::io::Errno::INTR) => {}
                    Err(error) => return Err(error.into()),
                }
            }
            rustix::fs::fcntl_add_seals(
                &fd,
                SealFlags::WRITE | SealFlags::GROW | SealFlags::SHRINK | SealFlags::SEAL,
            )?;
            fd
        }
    };
    Ok(Inherited {
        fd,
        child_fd: secret.child_fd,
    })
}

/// What identifies a started tool's processes on this node, across a restart of the daemon:
/// the leader's pid with its start time (`/proc/<pid>/stat` field 22, clock ticks since boot),
/// so a reused pid is never mistaken for it, and its process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ToolIdentity {
    pub pid: i32,
    pub start_time: u64,
    pub process_group: i32,
}

/// One process as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProcStat {
    pid: i32,
    parent: i32,
    process_group: i32,
    start_time: u64,
    /// A zombie (or dead) process can no longer act: it counts as gone.
    exited: bool,
}

fn proc_stat(pid: i32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may itself contain ") ": the fields
    // after it start at the last ')'.
    let rest = text.get(text.rfind(')')?.saturating_add(1)..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): field N is at index N - 3.
    let state = fields.first()?;
    Some(ProcStat {
        pid,
        parent: fields.get(1)?.parse().ok()?,
        process_group: fields.get(2)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
        exited: matches!(*state, "Z" | "X" | "x"),
    })
}

fn all_processes() -> Vec<ProcStat> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(proc_stat)
        .collect()
}

impl ToolIdentity {
    pub(crate) fn of(pid: i32) -> Option<Self> {
        let stat = proc_stat(pid)?;
        Some(Self {
            pid,
            start_time: stat.start_time,
            process_group: stat.process_group,
        })
    }

    /// The live processes that belong to this tool: its leader while it is still the same
    /// process, the leader's descendants (a child that left the group with `setsid`, as a
    /// map's holder does, is still a descendant while the leader lives), and every member of
    /// its process group that started no earlier than the leader. A process group id cannot be
    /// reused while any member lives, so members are the tool's unless the leader's pid now
    /// names a different process.
    fn survivors(&self) -> Vec<(i32, u64)> {
        let processes = all_processes();
        let leader = processes.iter().find(|p| p.pid == self.pid);
        if leader.is_some_and(|l| l.start_time != self.start_time) {
            return Vec::new();
        }
        let mut ours: Vec<ProcStat> = processes
            .iter()
            .filter(|p| p.process_group == self.process_group && p.start_time >= self.start_time)
            .copied()
            .collect();
        if leader.is_some() {
            let mut frontier = vec![self.pid];
            while let Some(parent) = frontier.pop() {
                for child in processes.iter().filter(|p| p.parent == parent) {
                    if !ours.iter().any(|o| o.pid == child.pid) {
                        ours.push(*child);
                    }
                    if ours.len() < 4096 {
                        frontier.push(child.pid);
                    }
                }
            }
        }
        ours.iter()
            .filter(|p| !p.exited)
            .map(|p| (p.pid, p.start_time))
            .collect()
    }

    /// Kills every surviving process of the tool and waits until none is left, for at most
    /// `within`. Returns how many processes were killed, or what is still running.
    pub async fn reap(&self, within: Duration) -> Result<usize, String> {
        let started = Instant::now();
        let mut killed = 0usize;
        loop {
            let survivors = self.survivors();
            if survivors.is_empty() {
                return Ok(killed);
            }
            if started.elapsed() >= within {
                return Err(format!(
                    "processes {:?} of the tool started as pid {} (group {}) are still running {:?} after SIGKILL",
                    survivors.iter().map(|(pid, _)| pid).collect::<Vec<_>>(),
                    self.pid,
                    self.process_group,
                    within
                ));
            }
            for (pid, start_time) in survivors {
                // Re-check just before the signal: the pid must still be the same process.
                if proc_stat(pid).is_some_and(|p| p.start_time == start_time)
                    && let Some(pid) = rustix::process::Pid::from_raw(pid)
                    && rustix::process::kill_process(pid, rustix::process::Signal::KILL).is_ok()
                {
                    killed = killed.saturating_add(1);
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// How long a killed tool's processes get to disappear before the kill is reported as failed.
pub const REAP_WITHIN: Duration = Duration::from_secs(10);

/// A started tool: its identity can be journaled before waiting for it.
pub struct RunningTool {
    child: tokio::process::Child,
    identity: Option<ToolIdentity>,
    group: GroupGuard,
    program: String,
    timeout: Duration,
    settles_with_unit: Option<UnitWatch>,
    started: Instant,
    stdout: Arc<Mutex<Vec<u8>>>,
    stderr: Arc<Mutex<Vec<u8>>>,
    truncated: Arc<std::sync::atomic::AtomicBool>,
    readers: [Option<tokio::task::JoinHandle<()>>; 2],
}

impl std::fmt::Debug for RunningTool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningTool")
            .field("program", &self.program)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

/// Runs the call to completion or timeout.
pub async fn run(call: ToolCall) -> Result<ToolOutput, ToolError> {
    start(call)?.wait().await
}

/// Starts the call's program in a process group of its own.
pub fn start(call: ToolCall) -> Result<RunningTool, ToolError> {
    let program = call.display();
    let name = call.program.display().to_string();
    let cap = call.output_cap;
    let mut command = tokio::process::Command::new(&call.program);
    command
        .args(&call.args)
        .env_clear()
        .env("PATH", TOOL_PATH)
        .envs(call.env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(if call.stdin_secret.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let inherited = prepare_secrets(&call.secrets).map_err(|error| ToolError::Secret {
        program: name.clone(),
        error,
    })?;
    install_descriptors(&mut command, &inherited).map_err(|error| ToolError::Secret {
        program: name.clone(),
        error,
    })?;
    let started = Instant::now();
    let mut child = command.spawn().map_err(|error| ToolError::Spawn {
        program: name.clone(),
        error,
    })?;
    // The child has its copies; ours close now so only the child holds the secret.
    drop(inherited);
    drop(call.secrets);
    if let (Some(secret), Some(mut stdin)) = (call.stdin_secret, child.stdin.take()) {
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            // A child that exits without reading fails on its own; the write error adds nothing.
            let _ = stdin.write_all(&secret).await;
            drop(stdin);
        });
    }
    let pid = child.id().and_then(|id| i32::try_from(id).ok());
    // If the running tool is dropped (the daemon shuts down mid-step), the whole process group
    // goes with it.
    let group = GroupGuard(pid.and_then(rustix::process::Pid::from_raw));
    // The child is its own group leader (process_group(0)), so its pid is the group id even
    // when /proc cannot be read.
    let identity = pid.map(|pid| {
        ToolIdentity::of(pid).unwrap_or(ToolIdentity {
            pid,
            start_time: 0,
            process_group: pid,
        })
    });

    let stdout = Arc::new(Mutex::new(Vec::new()));
    let stderr = Arc::new(Mutex::new(Vec::new()));
    let truncated = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers = [
        child
            .stdout
            .take()
            .map(|pipe| tokio::spawn(capture(pipe, stdout.clone(), cap, truncated.clone()))),
        child
            .stderr
            .take()
            .map(|pipe| tokio::spawn(capture(pipe, stderr.clone(), cap, truncated.clone()))),
    ];
    Ok(RunningTool {
        child,
        identity,
        group,
        program,
        timeout: call.timeout,
        settles_with_unit: call.settles_with_unit,
        started,
        stdout,
        stderr,
        truncated,
        readers,
    })
}

impl RunningTool {
    /// What identifies the tool's processes, to journal before waiting.
    pub fn identity(&self) -> Option<ToolIdentity> {
        self.identity
    }

    /// Waits for the tool to exit. At the timeout every process of the tool (its group and
    /// the leader's descendants) is killed and proven gone before this returns.
    pub async fn wait(mut self) -> Result<ToolOutput, ToolError> {
        let text = |buffer: &Arc<Mutex<Vec<u8>>>| {
            String::from_utf8_lossy(&buffer.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
        };
        let exited = async {
            match self.settles_with_unit.clone() {
                None => self.child.wait().await,
                Some(watch) => {
                    tokio::select! {
                        status = self.child.wait() => status,
                        () = main_process_exited(&watch) => {
                            // systemd-run only relays now; the unit and its holder stay.
                            if let Some(pid) = self.child.id().and_then(|id| i32::try_from(id).ok()).and_then(rustix::process::Pid::from_raw) {
                                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
                            }
                            self.child.wait().await
                        }
                    }
                }
            }
        };
        let status = match tokio::time::timeout(self.timeout, exited).await {
            Ok(status) => status.map_err(|error| ToolError::Wait {
                program: self.program.clone(),
                error,
            })?,
            Err(_) => {
                // Collect the tree while the leader still lives: a child that left the group
                // is found only as the leader's descendant.
                let reaped = match self.identity {
                    Some(identity) => {
                        let reaped = identity.reap(REAP_WITHIN).await;
                        self.group.kill();
                        let _ = self.child.kill().await;
                        reaped
                    }
                    None => {
                        self.group.kill();
                        let _ = self.child.kill().await;
                        Ok(0)
                    }
                };
                for reader in self.readers.iter().flatten() {
                    reader.abort();
                }
                return Err(ToolError::Timeout {
                    program: self.program.clone(),
                    timeout: self.timeout,
                    stderr: match reaped {
                        Ok(_) => text(&self.stderr),
                        Err(left) => format!("{}; {left}", text(&self.stderr)),
                    },
                });
            }
        };
        // The tool exited by itself: what it left running (a map's holder) is meant to stay.
        self.group.0 = None;
        for reader in std::mem::take(&mut self.readers).into_iter().flatten() {
            if tokio::time::timeout(OUTPUT_GRACE, reader).await.is_err() {
                // A daemon the tool forked still holds the pipe: keep what arrived.
            }
        }
        Ok(ToolOutput {
            exit_code: status.code(),
            stdout: text(&self.stdout),
            stderr: text(&self.stderr),
            elapsed: self.started.elapsed(),
            truncated: self.truncated.load(std::sync::atomic::Ordering::SeqCst),
        })
    }
}

/// Completes once `watch.unit` exists and its main process has exited (`SubState` `exited`,
/// `failed` or `dead` after having run).
async fn main_process_exited(watch: &UnitWatch) {
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let shown = tokio::process::Command::new(&watch.systemctl)
            .args([
                "show",
                "--property=SubState,ExecMainPID,ExecMainExitTimestampMonotonic",
                "--",
            ])
            .arg(&watch.unit)
            .env_clear()
            .env("PATH", TOOL_PATH)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .await;
        let Ok(shown) = shown else { continue };
        let text = String::from_utf8_lossy(&shown.stdout);
        let value = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
                .unwrap_or_default()
                .to_owned()
        };
        let ran = value("ExecMainExitTimestampMonotonic") != "0"
            && !value("ExecMainExitTimestampMonotonic").is_empty();
        if ran && matches!(value("SubState").as_str(), "exited" | "failed" | "dead") {
            return;
        }
    }
}

/// Kills a tool's process group when dropped while armed.
struct GroupGuard(Option<rustix::process::Pid>);

impl GroupGuard {
    fn kill(&mut self) {
        if let Some(pid) = self.0.take() {
            let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
        }
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn capture(
    mut pipe: impl tokio::io::AsyncRead + Unpin,
    buffer: Arc<Mutex<Vec<u8>>>,
    cap: usize,
    truncated: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut chunk = [0u8; 8192];
    loop {
        match pipe.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let mut buffer = buffer.lock().unwrap_or_else(|p| p.into_inner());
                let room = cap.saturating_sub(buffer.len());
                if n > room {
                    truncated.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                buffer.extend_from_slice(chunk.get(..n.min(room)).unwrap_or_default());
            }
        }
    }
}

/// Moves each prepared descriptor to the number the child expects, between fork and exec, so the
/// child inherits exactly 0, 1, 2 and the secrets' descriptors: every other descriptor from 3
/// up — below, between and above the targets, whatever the daemon itself inherited (a
/// jobserver pipe, a descriptor a library opened without close-on-exec) — is marked
/// close-on-exec first.
#[allow(unsafe_code)]
fn install_descriptors(
    command: &mut tokio::process::Command,
    inherited: &[Inherited],
) -> std::io::Result<()> {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // A fixed array: the child must not allocate. `prepare_secrets` already refused more.
    let mut moves = [(-1 as libc::c_int, -1 as libc::c_int); MAX_SECRETS];
    if inherited.len() > moves.len() {
        return Err(std::io::Error::other(format!(
            "{} descriptors for one call; at most {MAX_SECRETS}",
            inherited.len()
        )));
    }
    for (slot, descriptor) in moves.iter_mut().zip(inherited) {
        *slot = (descriptor.fd.as_raw_fd(), descriptor.child_fd);
    }
    let count = inherited.len();
    // Sources are parked at or above this, above every target, so no move overwrites a source
    // still to be moved. F_DUPFD takes the lowest free number from here: under a low
    // RLIMIT_NOFILE a fixed high floor (say 1000) would fail with EINVAL.
    let park_floor = inherited
        .iter()
        .map(|descriptor| descriptor.child_fd)
        .max()
        .map_or(3, |highest| highest.saturating_add(1));
    // SAFETY: the closure runs in the forked child before exec, where only async-signal-safe
    // functions may be called. It calls only fcntl(2), dup2(2), close(2) and close_range(2)
    // (Linux 5.11+), which are; it touches no allocator or lock (`moves` is a copied array);
    // it reports failure through the returned io::Error, which the standard library forwards to
    // the parent.
    unsafe {
        command.pre_exec(move || {
            let moves = moves.get(..count).unwrap_or_default();
            // Everything from 3 up becomes close-on-exec (not closed: the standard library
            // reports a failed exec through a close-on-exec pipe that must stay open until
            // exec). dup2 below clears the flag on exactly the targets.
            if libc::syscall(
                libc::SYS_close_range,
                3 as libc::c_uint,
                libc::c_uint::MAX,
                CLOSE_RANGE_CLOEXEC,
            ) == -1
            {
                return Err(std::io::Error::last_os_error());
            }
            let mut parked = [-1 as libc::c_int; MAX_SECRETS];
            for (slot, &(fd, _)) in parked.iter_mut().zip(moves) {
                let high = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, park_floor);
                if high == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                *slot = high;
            }
            for (&high, &(_, target)) in parked.iter().zip(moves) {
                // dup2 clears close-on-exec on the new descriptor.
                if libc::dup2(high, target) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(high);
            }
            Ok(())
        });
    }
    Ok(())
}

/// What a transient unit started for a tool is for; each kind has its own properties.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransientRole {
    /// `proxmox-backup-client map`: its forked holder must outlive the call and the daemon.
    /// `Type=oneshot` + `RemainAfterExit=yes` keeps the unit (and the holder in its cgroup)
    /// after the client exits; `KillSignal=SIGINT` is how `unmap` ends a holder cleanly.
    MapHolder,
    /// `qm start`: qemu-server moves QEMU into its own `<vmid>.scope`; the unit only keeps qm
    /// itself outside the daemon's sandbox and ends when qm does.
    QmStart,
    /// guestfish and the libguestfs appliance it boots (supermin builds it from the node's
    /// `/lib/modules`, QEMU runs it, under TCG with writable executable memory): none of it
    /// works inside the daemon's sandbox. The unit ends when guestfish does; `RuntimeMaxSec`
    /// (the step's deadline) and `MemoryMax` bound it even when the daemon is gone.
    GuestNetwork {
        /// The unit's `MemoryMax`, in MiB: the appliance's memory and what QEMU, guestfish
        /// and supermin need around it.
        memory_max_mib: u64,
    },
}

impl TransientRole {
    fn prefix(self) -> &'static str {
        match self {
            TransientRole::MapHolder => "certistack-map",
            TransientRole::QmStart => "certistack-qm-start",
            TransientRole::GuestNetwork { .. } => "certistack-guestnet",
        }
    }

    fn properties(self) -> &'static [&'static str] {
        match self {
            TransientRole::MapHolder => &[
                "Type=oneshot",
                "RemainAfterExit=yes",
                "KillSignal=SIGINT",
                "TimeoutStopSec=15s",
                "SendSIGKILL=yes",
            ],
            TransientRole::QmStart => &["Type=oneshot"],
            // At stop (the step's deadline, a leftover of an interrupted step) guestfish gets
            // SIGTERM, then the whole cgroup (QEMU included) SIGKILL.
            TransientRole::GuestNetwork { .. } => {
                &["Type=exec", "TimeoutStopSec=15s", "SendSIGKILL=yes"]
            }
        }
    }
}

/// The descriptor a transient unit's tool reads its secret from: never stdio (see
/// [`in_transient_unit`]), and the one the daemon's own children use.
pub const SECRET_FD_IN_UNIT: i32 = 3;
/// Moves the secret from the unit's stdin to [`SECRET_FD_IN_UNIT`] before the tool starts
/// (systemd-run hands a unit nothing but stdio). Debian's essential `/bin/sh`.
const UNIT_SHELL: &str = "/bin/sh";

/// How long after the daemon's deadline systemd ends a guest network unit on its own.
pub const GUEST_NETWORK_UNIT_MARGIN: Duration = Duration::from_secs(30);

/// Longest unit name systemd accepts.
const MAX_UNIT_NAME: usize = 255;

/// The unit name for `role` of run `run_id` on `object` (an archive name or a VMID):
/// `certistack-map-<run id>-<archive>.service`. Both parts come validated; this checks again
/// that only the characters systemd allows in a unit name, and nothing that would make it a
/// template or a path, are used.
pub fn transient_unit_name(
    role: TransientRole,
    run_id: &str,
    object: &str,
) -> Result<String, String> {
    let name = format!("{}-{run_id}-{object}.service", role.prefix());
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':');
    if run_id.is_empty() || object.is_empty() || !name.chars().all(allowed) {
        return Err(format!("{name:?} is not a unit name this connector makes"));
    }
    if name.len() > MAX_UNIT_NAME {
        return Err(format!(
            "{name:?} is longer than {MAX_UNIT_NAME} characters"
        ));
    }
    Ok(name)
}

/// The description a transient unit carries; the daemon checks it before it stops a unit, so
/// it never stops a unit it did not start for that run.
pub fn transient_unit_description(role: TransientRole, run_id: &str, object: &str) -> String {
    let what = match role {
        TransientRole::MapHolder => "backup mapping",
        TransientRole::QmStart => "qm start",
        TransientRole::GuestNetwork { .. } => "guest network recovery of",
    };
    format!("CertiStack run {run_id}: {what} {object}")
}

/// `call` started through `systemd-run` in the transient unit `unit`, outside the daemon's
/// cgroup and sandbox. Its environment goes in as `--setenv`, a pipe secret (a password) moves
/// to the unit's stdin (`systemd-run --pipe`), so it never reaches argv, environment or disk;
/// in the unit a shell moves it to [`SECRET_FD_IN_UNIT`] and `rename_fd_env`, the variable
/// that carried the secret's descriptor, names that descriptor. A call
/// with a memfd secret (a key file opened as `/proc/self/fd/N`) cannot cross: refused.
pub fn in_transient_unit(
    call: ToolCall,
    role: TransientRole,
    unit: &str,
    description: &str,
    systemd_run: &Path,
    systemctl: &Path,
    rename_fd_env: Option<&'static str>,
) -> Result<ToolCall, String> {
    if call.secrets.iter().any(|s| s.kind == SecretKind::Memfd) || call.secrets.len() > 1 {
        return Err("a key file cannot be handed to a transient unit".into());
    }
    let mut wrapped = ToolCall::new(systemd_run, call.timeout).output_cap(call.output_cap);
    wrapped = wrapped
        .arg(format!("--unit={unit}"))
        .arg(format!("--description={description}"))
        .arg("--quiet")
        .arg("--collect")
        .arg("--pipe");
    if matches!(
        role,
        TransientRole::QmStart | TransientRole::GuestNetwork { .. }
    ) {
        wrapped = wrapped.arg("--wait");
    }
    for property in role.properties() {
        wrapped = wrapped.arg("--property").arg(*property);
    }
    if let TransientRole::GuestNetwork { memory_max_mib } = role {
        // The session's deadline holds even without the daemon: systemd stops the unit then.
        // It is the backstop, a margin after the daemon's own deadline, so that the daemon's
        // deadline decides and the step reports DEADLINE_EXCEEDED rather than a closed pipe.
        wrapped = wrapped
            .arg("--property")
            .arg(format!(
                "RuntimeMaxSec={}ms",
                call.timeout
                    .saturating_add(GUEST_NETWORK_UNIT_MARGIN)
                    .as_millis()
                    .max(1)
            ))
            .arg("--property")
            .arg(format!("MemoryMax={memory_max_mib}M"));
    }
    // A oneshot unit's start has no time limit by default, and at the call's timeout only
    // systemd-run is killed: the unit itself must give up at the same bound, or `qm start` (or
    // the map) would go on after the step reported its deadline.
    wrapped = wrapped.arg("--property").arg(format!(
        "TimeoutStartSec={}ms",
        call.timeout.as_millis().max(1)
    ));
    let moves_secret = rename_fd_env.is_some() && !call.secrets.is_empty();
    for (key, value) in &call.env {
        let value = if Some(*key) == rename_fd_env && moves_secret {
            SECRET_FD_IN_UNIT.to_string()
        } else {
            value.clone()
        };
        wrapped = wrapped.arg(format!("--setenv={key}={value}"));
    }
    wrapped = wrapped.arg("--");
    if moves_secret {
        // A tool that reads its secret from a descriptor closes it, and the next file it
        // opens takes that number. Were it stdin, the daemonizing holder's later
        // `dup2(/dev/null, 0)` would swap whatever took descriptor 0 (the PBS connection, an
        // image) for /dev/null, and the mapped device would read EOF or fail. The secret
        // therefore moves from the unit's stdin to SECRET_FD_IN_UNIT, and stdin is /dev/null.
        wrapped = wrapped
            .arg(UNIT_SHELL)
            .arg("-c")
            .arg(format!(
                "exec {SECRET_FD_IN_UNIT}<&0 </dev/null && exec \"$@\""
            ))
            .arg(role.prefix());
    }
    wrapped = wrapped.arg(call.program.as_os_str().to_owned());
    for arg in call.args {
        wrapped = wrapped.arg(arg);
    }
    if let Some(secret) = call.secrets.into_iter().next() {
        wrapped.stdin_secret = Some(secret.bytes);
    }
    if role == TransientRole::MapHolder {
        wrapped.settles_with_unit = Some(UnitWatch {
            systemctl: systemctl.to_owned(),
            unit: unit.to_owned(),
        });
    }
    Ok(wrapped)
}

/// Stops and forgets the transient unit `unit` if it is the one described by `description`
/// (started by this daemon for that run); a unit that is not loaded is already gone.
/// What [`release_transient_unit`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitRelease {
    /// The unit was loaded and this run's: it was stopped.
    Stopped,
    /// No such unit was loaded (it ended and was collected, or never started).
    Gone,
}

pub async fn release_transient_unit(
    systemctl: &Path,
    unit: &str,
    description: &str,
    timeout: Duration,
) -> Result<UnitRelease, String> {
    let show = run(ToolCall::new(systemctl, timeout)
        .arg("show")
        .arg("--property=LoadState,Description")
        .arg("--")
        .arg(unit))
    .await
    .map_err(|e| e.to_string())?;
    let value = |key: &str| {
        show.stdout
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
            .unwrap_or_default()
            .to_owned()
    };
    if value("LoadState") != "loaded" {
        return Ok(UnitRelease::Gone);
    }
    if value("Description") != description {
        return Err(format!(
            "{unit} is described as {:?}, not as this run's {description:?}; left alone",
            value("Description")
        ));
    }
    for verb in ["stop", "reset-failed"] {
        let output = run(ToolCall::new(systemctl, timeout)
            .arg(verb)
            .arg("--")
            .arg(unit))
        .await
        .map_err(|e| e.to_string())?;
        // reset-failed refuses a unit already collected: that is the state wanted.
        if verb == "stop" && !output.success() {
            return Err(format!(
                "systemctl stop {unit}: {}",
                output.stderr_excerpt()
            ));
        }
    }
    Ok(UnitRelease::Stopped)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map_call() -> ToolCall {
        ToolCall::new("/usr/bin/proxmox-backup-client", Duration::from_secs(5))
            .arg("map")
            .arg("vm/100/2026-01-01T00:00:00Z")
            .arg("drive-scsi0.img")
            .env("PBS_PASSWORD_FD", "3")
            .env("PBS_FINGERPRINT", "aa:bb")
            .secret(pipe_secret(3, b"hunter2-secret"))
    }

    #[test]
    fn a_map_in_a_transient_unit_reads_its_secret_from_descriptor_3_never_stdin_argv_or_env() {
        let unit = transient_unit_name(
            TransientRole::MapHolder,
            "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f",
            "drive-scsi0.img",
        )
        .unwrap();
        assert_eq!(
            unit,
            "certistack-map-0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f-drive-scsi0.img.service"
        );
        let wrapped = in_transient_unit(
            map_call(),
            TransientRole::MapHolder,
            &unit,
            "CertiStack run x: backup mapping drive-scsi0.img",
            Path::new("/usr/bin/systemd-run"),
            Path::new("/usr/bin/systemctl"),
            Some("PBS_PASSWORD_FD"),
        )
        .unwrap();
        let argv: Vec<String> = wrapped
            .args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(wrapped.program, Path::new("/usr/bin/systemd-run"));
        for expected in [
            format!("--unit={unit}"),
            "--pipe".into(),
            "--collect".into(),
            "Type=oneshot".into(),
            "RemainAfterExit=yes".into(),
            "KillSignal=SIGINT".into(),
            "--setenv=PBS_PASSWORD_FD=3".into(),
            "--setenv=PBS_FINGERPRINT=aa:bb".into(),
        ] {
            assert!(argv.contains(&expected), "{expected} missing from {argv:?}");
        }
        assert!(
            argv.iter()
                .any(|a| a.starts_with("TimeoutStartSec=") && a.ends_with("ms")),
            "the unit's start is not bounded: {argv:?}"
        );
        // The holder must stay: systemd-run is not asked to wait for the unit to end.
        assert!(!argv.contains(&"--wait".to_owned()), "{argv:?}");
        let tool_at = argv.iter().position(|a| a == "--").unwrap();
        assert_eq!(argv[tool_at + 1..tool_at + 3], ["/bin/sh", "-c"]);
        assert_eq!(
            argv[tool_at + 4..],
            [
                "certistack-map",
                "/usr/bin/proxmox-backup-client",
                "map",
                "vm/100/2026-01-01T00:00:00Z",
                "drive-scsi0.img"
            ]
        );
        // What the unit runs, with systemd-run's stdin pipe: the tool finds the secret on
        // descriptor 3 and /dev/null on stdin, so a descriptor it opens after closing the
        // secret's never becomes stdin (which a daemonizing holder points at /dev/null).
        let probe = "read -r secret <&3; printf '%s|' \"$secret\"; readlink /proc/self/fd/0";
        let mut shell = std::process::Command::new(&argv[tool_at + 1])
            .args(&argv[tool_at + 2..tool_at + 5])
            .args(["/bin/sh", "-c", probe])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(&mut shell.stdin.take().unwrap(), b"hunter2-secret\n").unwrap();
        let seen = shell.wait_with_output().unwrap();
        assert_eq!(
            String::from_utf8_lossy(&seen.stdout).trim(),
            "hunter2-secret|/dev/null"
        );
        assert!(!wrapped.display().contains("hunter2"));
        assert!(wrapped.env.is_empty() && wrapped.secrets.is_empty());
        assert_eq!(
            wrapped.stdin_secret.as_deref().map(Vec::as_slice),
            Some(&b"hunter2-secret"[..])
        );
        assert_eq!(wrapped.settles_with_unit.unwrap().unit, unit);

        // A key file cannot cross into a unit.
        let keyed = map_call().secret(SecretInput {
            child_fd: 4,
            bytes: Zeroizing::new(b"key".to_vec()),
            kind: SecretKind::Memfd,
        });
        assert!(
            in_transient_unit(
                keyed,
                TransientRole::MapHolder,
                &unit,
                "d",
                Path::new("/usr/bin/systemd-run"),
                Path::new("/usr/bin/systemctl"),
                Some("PBS_PASSWORD_FD"),
            )
            .is_err()
        );
    }

    #[test]
    fn qm_start_in_a_transient_unit_waits_for_qm_and_unit_names_are_checked() {
        let unit = transient_unit_name(TransientRole::QmStart, "run", "9100").unwrap();
        assert_eq!(unit, "certistack-qm-start-run-9100.service");
        let wrapped = in_transient_unit(
            ToolCall::new("/usr/sbin/qm", Duration::from_secs(5))
                .arg("start")
                .arg("9100"),
            TransientRole::QmStart,
            &unit,
            "d",
            Path::new("/usr/bin/systemd-run"),
            Path::new("/usr/bin/systemctl"),
            None,
        )
        .unwrap();
        let argv = wrapped.display();
        assert!(argv.contains(" --wait "), "{argv}");
        assert!(argv.ends_with(" -- /usr/sbin/qm start 9100"), "{argv}");
        assert!(wrapped.settles_with_unit.is_none() && wrapped.stdin_secret.is_none());
        for (run, object) in [
            ("run", "../x"),
            ("run", "a@b"),
            ("run", "a b"),
            ("", "9100"),
            ("run", ""),
        ] {
            assert!(
                transient_unit_name(TransientRole::MapHolder, run, object).is_err(),
                "{run:?} {object:?}"
            );
        }
        let long = "a".repeat(250);
        assert!(transient_unit_name(TransientRole::QmStart, "run", &long).is_err());
    }

    #[test]
    fn a_guestfish_session_in_a_transient_unit_keeps_its_pipes_and_is_bounded_by_the_unit() {
        let run = "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f";
        let role = TransientRole::GuestNetwork {
            memory_max_mib: 1536,
        };
        let unit = transient_unit_name(role, run, "9100").unwrap();
        assert_eq!(unit, format!("certistack-guestnet-{run}-9100.service"));
        let description = transient_unit_description(role, run, "9100");
        assert_eq!(
            description,
            format!("CertiStack run {run}: guest network recovery of 9100")
        );
        let wrapped = in_transient_unit(
            ToolCall::new("/usr/bin/guestfish", Duration::from_secs(300))
                .arg("--format=qcow2")
                .arg("-a")
                .arg("/var/lib/certistack-overlays/run/9100-drive-scsi0.qcow2")
                .env("LIBGUESTFS_BACKEND", "direct")
                .env("LIBGUESTFS_MEMSIZE", "512"),
            role,
            &unit,
            &description,
            Path::new("/usr/bin/systemd-run"),
            Path::new("/usr/bin/systemctl"),
            None,
        )
        .unwrap();
        let argv: Vec<String> = wrapped
            .args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let properties: Vec<&str> = argv
            .windows(2)
            .filter(|w| w[0] == "--property")
            .map(|w| w[1].as_str())
            .collect();
        assert_eq!(
            properties,
            [
                "Type=exec",
                "TimeoutStopSec=15s",
                "SendSIGKILL=yes",
                "RuntimeMaxSec=330000ms",
                "MemoryMax=1536M",
                "TimeoutStartSec=300000ms",
            ],
            "{argv:?}"
        );
        let tool_at = argv.iter().position(|a| a == "--").unwrap();
        // guestfish's commands and answers flow over the daemon's pipes (--pipe), and
        // systemd-run returns with guestfish's exit status once the unit is gone (--wait).
        assert_eq!(
            argv[..tool_at]
                .iter()
                .filter(|a| !a.starts_with("--property") && !a.contains('='))
                .collect::<Vec<_>>(),
            ["--quiet", "--collect", "--pipe", "--wait"],
            "{argv:?}"
        );
        assert!(argv.contains(&format!("--unit={unit}")));
        assert!(argv.contains(&format!("--description={description}")));
        assert!(argv.contains(&"--setenv=LIBGUESTFS_BACKEND=direct".to_owned()));
        assert!(argv.contains(&"--setenv=LIBGUESTFS_MEMSIZE=512".to_owned()));
        assert_eq!(
            argv[tool_at + 1..],
            [
                "/usr/bin/guestfish",
                "--format=qcow2",
                "-a",
                "/var/lib/certistack-overlays/run/9100-drive-scsi0.qcow2"
            ]
        );
        assert!(wrapped.settles_with_unit.is_none() && wrapped.env.is_empty());
    }

    #[test]
    fn stderr_excerpts_keep_the_last_lines_escaped_and_capped() {
        let mut stderr = String::new();
        for n in 0..20 {
            stderr.push_str(&format!("line {n}\n"));
        }
        stderr.push_str("forged\u{1b}[31m \u{202e}");
        stderr.push('\n');
        stderr.push_str(&"x".repeat(4096));
        let output = ToolOutput {
            exit_code: Some(1),
            stdout: String::new(),
            stderr,
            elapsed: std::time::Duration::ZERO,
            truncated: false,
        };
        let excerpt = output.stderr_excerpt();
        let lines: Vec<&str> = excerpt.lines().collect();
        assert_eq!(lines.len(), STDERR_EXCERPT_LINES, "{excerpt}");
        assert_eq!(lines.first(), Some(&"line 14"));
        assert!(excerpt.contains("forged\\u{1b}[31m \\u{202e}"), "{excerpt}");
        assert!(!excerpt.contains('\u{1b}'));
        assert!(
            lines.last().unwrap().ends_with("…[3584 more bytes]"),
            "{excerpt}"
        );
    }

    fn sh(script: &str) -> ToolCall {
        ToolCall::new("/bin/sh", Duration::from_secs(5))
            .arg("-c")
            .arg(script)
    }

    /// A stand-in `systemctl` answering `show` from `$STATE` (`gone`, `ours`, `theirs`) and
    /// logging every verb to `calls`.
    fn fake_systemctl(dir: &Path, state: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(format!("systemctl-{state}"));
        let script = format!(
            "#!/bin/sh\necho \"$1\" >>{calls}\ncase \"$1:{state}\" in\n  show:gone) echo LoadState=not-found; echo Description= ;;\n  show:ours) echo LoadState=loaded; echo 'Description=CertiStack run r1: guest network recovery of 9100' ;;\n  show:theirs) echo LoadState=loaded; echo 'Description=someone else' ;;\nesac\n",
            calls = dir.join("calls").display()
        );
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[tokio::test]
    async fn releasing_a_unit_says_whether_it_stopped_one_and_leaves_anothers_alone() {
        let dir = std::env::temp_dir().join(format!("release-unit-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir(&dir).unwrap();
        let ours = "CertiStack run r1: guest network recovery of 9100";
        let release = |state: &'static str| {
            let systemctl = fake_systemctl(&dir, state);
            async move {
                release_transient_unit(
                    &systemctl,
                    "certistack-guestnet-r1-9100.service",
                    ours,
                    Duration::from_secs(5),
                )
                .await
            }
        };
        let calls = || std::fs::read_to_string(dir.join("calls")).unwrap_or_default();
        assert_eq!(release("gone").await, Ok(UnitRelease::Gone));
        assert_eq!(calls(), "show\n", "a unit that is gone is not stopped");
        std::fs::remove_file(dir.join("calls")).unwrap();
        assert_eq!(release("ours").await, Ok(UnitRelease::Stopped));
        assert_eq!(calls(), "show\nstop\nreset-failed\n");
        std::fs::remove_file(dir.join("calls")).unwrap();
        let refused = release("theirs").await.unwrap_err();
        assert!(refused.contains("left alone"), "{refused}");
        assert_eq!(calls(), "show\n", "another's unit is never stopped");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn environment_is_cleared() {
        let out = run(sh("env").env("PBS_FINGERPRINT", "ab")).await.unwrap();
        let mut lines: Vec<&str> = out
            .stdout
            .lines()
            .filter(|l| !l.starts_with("PWD=") && !l.starts_with("SHLVL=") && !l.starts_with("_="))
            .collect();
        lines.sort();
        assert_eq!(
            lines,
            ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "PBS_FINGERPRINT=ab"]
        );
    }

    #[tokio::test]
    async fn secrets_arrive_on_the_named_descriptors_only() {
        let call = sh("ls -l /proc/$$/fd; printf '|'; cat <&3; printf '|'; cat /proc/self/fd/4")
            .secret(SecretInput {
                child_fd: 3,
                bytes: Zeroizing::new(b"hunter2".to_vec()),
                kind: SecretKind::Pipe,
            })
            .secret(SecretInput {
                child_fd: 4,
                bytes: Zeroizing::new(b"{\"kdf\":null}".to_vec()),
                kind: SecretKind::Memfd,
            });
        let shown = call.display();
        assert!(!shown.contains("hunter2"));
        let out = run(call).await.unwrap();
        let parts: Vec<&str> = out.stdout.trim().split('|').collect();
        assert_eq!(parts[1], "hunter2");
        assert_eq!(parts[2], "{\"kdf\":null}");
        // The shell holds stdin, stdout, stderr and fds 3 and 4, and nothing else leaked in.
        let fds: Vec<&str> = parts[0].lines().filter(|l| l.contains(" -> ")).collect();
        let numbers: Vec<&str> = fds
            .iter()
            .filter_map(|l| l.split(" -> ").next()?.rsplit(' ').next())
            .collect();
        assert_eq!(
            numbers,
            ["0", "1", "2", "3", "4"],
            "descriptors in the child: {fds:?}"
        );
    }

    fn pipe_secret(child_fd: RawFd, bytes: &[u8]) -> SecretInput {
        SecretInput {
            child_fd,
            bytes: Zeroizing::new(bytes.to_vec()),
            kind: SecretKind::Pipe,
        }
    }

    /// The shell's descriptors (`ls /proc/$$/fd`), sorted numerically.
    fn listed_fds(listing: &str) -> Vec<RawFd> {
        let mut fds: Vec<RawFd> = listing
            .split_whitespace()
            .map(|n| n.parse().unwrap())
            .collect();
        fds.sort_unstable();
        fds
    }

    #[tokio::test]
    async fn inheritable_descriptors_below_the_highest_target_do_not_leak() {
        // Descriptors the daemon holds without close-on-exec, as a library or an inherited
        // jobserver might leave them. Their numbers lie below the highest target.
        let null = std::fs::File::open("/dev/null").unwrap();
        let leaky_a = rustix::io::dup(&null).unwrap();
        let leaky_b = rustix::io::dup(&null).unwrap();
        let highest_leaky = leaky_a.as_raw_fd().max(leaky_b.as_raw_fd());
        let (first, second) = (highest_leaky + 1, highest_leaky + 3);
        let call = sh(&format!(
            "ls /proc/$$/fd; printf '|'; cat /proc/self/fd/{first}; printf '|'; cat /proc/self/fd/{second}"
        ))
        .secret(pipe_secret(first, b"hunter2"))
        .secret(SecretInput {
            child_fd: second,
            bytes: Zeroizing::new(b"key".to_vec()),
            kind: SecretKind::Memfd,
        });
        let out = run(call).await.unwrap();
        let parts: Vec<&str> = out.stdout.split('|').collect();
        assert_eq!(parts[1], "hunter2", "{}", out.stderr);
        assert_eq!(parts[2], "key");
        assert_eq!(
            listed_fds(parts[0]),
            [0, 1, 2, first, second],
            "{} and {} were open in the parent without close-on-exec",
            leaky_a.as_raw_fd(),
            leaky_b.as_raw_fd()
        );
    }

    #[tokio::test]
    #[allow(unsafe_code)]
    async fn descriptors_are_placed_under_a_low_open_file_limit() {
        let secrets = [pipe_secret(3, b"hunter2"), pipe_secret(5, b"second")];
        let inherited = prepare_secrets(&secrets).unwrap();
        let mut command = tokio::process::Command::new("/bin/sh");
        command
            .arg("-c")
            .arg("ls /proc/$$/fd; printf '|'; cat <&3; printf '|'; cat <&5")
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: setrlimit(2) is async-signal-safe and the closure allocates nothing. It runs
        // before the descriptor moves registered below, so they happen under a limit of 64
        // open files, as in a daemon started with `LimitNOFILE=64`.
        unsafe {
            command.pre_exec(|| {
                let limit = libc::rlimit {
                    rlim_cur: 64,
                    rlim_max: 64,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        install_descriptors(&mut command, &inherited).unwrap();
        let out = command.output().await.unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).unwrap();
        let parts: Vec<&str> = stdout.split('|').collect();
        assert_eq!(listed_fds(parts[0]), [0, 1, 2, 3, 5]);
        assert_eq!((parts[1], parts[2]), ("hunter2", "second"));
    }

    #[test]
    fn targets_are_checked_before_any_descriptor_is_made() {
        let nine: Vec<SecretInput> = (3..12).map(|fd| pipe_secret(fd, b"x")).collect();
        let error = prepare_secrets(&nine).err().unwrap();
        assert!(error.to_string().contains("at most 8"), "{error}");
        let error = prepare_secrets(&[pipe_secret(1, b"x")]).err().unwrap();
        assert!(error.to_string().contains("stdio"), "{error}");
        let error = prepare_secrets(&[pipe_secret(3, b"x"), pipe_secret(3, b"y")])
            .err()
            .unwrap();
        assert!(error.to_string().contains("two secrets"), "{error}");
        // The move list itself refuses a ninth descriptor instead of dropping it.
        let inherited: Vec<Inherited> = (3..12)
            .map(|child_fd| Inherited {
                fd: rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                    .unwrap()
                    .0,
                child_fd,
            })
            .collect();
        let mut command = tokio::process::Command::new("/bin/true");
        assert!(install_descriptors(&mut command, &inherited).is_err());
    }

    #[test]
    fn a_secret_the_pipe_cannot_hold_is_an_error_not_a_short_write() {
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        // The smallest pipe the kernel makes: one page, as under fs.pipe-user-pages-soft.
        rustix::pipe::fcntl_setpipe_size(&write, 4096).unwrap();
        let capacity = rustix::pipe::fcntl_getpipe_size(&write).unwrap();
        let error = fill_pipe(&write, &vec![b'x'; capacity + 1]).unwrap_err();
        assert!(
            error.to_string().contains(&format!(
                "took {capacity} of the secret's {} bytes",
                capacity + 1
            )),
            "{error}"
        );
        drop(read);
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        fill_pipe(&write, b"hunter2").unwrap();
        drop(write);
        let mut buffer = [0u8; 16];
        let n = rustix::io::read(&read, &mut buffer).unwrap();
        assert_eq!(&buffer[..n], b"hunter2");
    }

    #[tokio::test]
    async fn without_secrets_only_stdio_is_inherited() {
        let out = run(sh("ls /proc/$$/fd")).await.unwrap();
        let mut fds: Vec<&str> = out.stdout.split_whitespace().collect();
        fds.sort();
        assert_eq!(fds, ["0", "1", "2"]);
    }

    #[tokio::test]
    async fn exit_codes_and_capped_output() {
        let out = run(sh("echo out; echo err >&2; exit 7")).await.unwrap();
        assert_eq!(
            (out.exit_code, out.stdout.as_str(), out.stderr.as_str()),
            (Some(7), "out\n", "err\n")
        );
        let out = run(sh("head -c 200000 /dev/zero")).await.unwrap();
        assert_eq!(out.stdout.len(), OUTPUT_CAP);
        assert!(out.truncated);
        assert!(out.success());
        // A caller that reads more sets its own cap, still a bound.
        let wide = sh("head -c 200000 /dev/zero").output_cap(300_000);
        let out = run(wide).await.unwrap();
        assert_eq!((out.stdout.len(), out.truncated), (200_000, false));
        let out = run(sh("head -c 200000 /dev/zero").output_cap(100_000))
            .await
            .unwrap();
        assert_eq!((out.stdout.len(), out.truncated), (100_000, true));
    }

    #[tokio::test]
    async fn timeout_kills_the_process_group() {
        let marker =
            std::env::temp_dir().join(format!("certistack-timeout-{}", std::process::id()));
        let script = format!("(sleep 30; touch {}) & sleep 30", marker.display());
        let call = ToolCall::new("/bin/sh", Duration::from_millis(300))
            .arg("-c")
            .arg(script);
        let started = Instant::now();
        assert!(matches!(run(call).await, Err(ToolError::Timeout { .. })));
        assert!(started.elapsed() < Duration::from_secs(5));
        // The grandchild was in the same process group and died with it.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let needle = marker.display().to_string();
        let survivors: Vec<String> = std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .filter(|c| c.contains(&needle))
            .collect();
        assert!(survivors.is_empty(), "left behind: {survivors:?}");
        assert!(!marker.exists());
    }

    fn processes_mentioning(needle: &str) -> Vec<String> {
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .filter(|c| c.contains(needle))
            .collect()
    }

    #[tokio::test]
    async fn a_tools_processes_are_killed_even_after_they_left_its_group() {
        // Like a map's holder: a child that starts a session of its own.
        let needle = format!("certistack-reap-{}", std::process::id());
        let script = format!("setsid sh -c 'sleep 30; : {needle}' & sleep 30");
        let call = ToolCall::new("/bin/sh", Duration::from_millis(500))
            .arg("-c")
            .arg(&script);
        let tool = start(call).unwrap();
        let identity = tool.identity().unwrap();
        assert_eq!(identity.process_group, identity.pid);
        assert!(identity.start_time > 0);
        assert!(matches!(tool.wait().await, Err(ToolError::Timeout { .. })));
        let left = processes_mentioning(&needle);
        assert!(left.is_empty(), "left behind at the timeout: {left:?}");

        // The same, from the journaled identity alone (a daemon that restarted mid-step).
        let call = ToolCall::new("/bin/sh", Duration::from_secs(60))
            .arg("-c")
            .arg(&script);
        let tool = start(call).unwrap();
        let identity = tool.identity().unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            processes_mentioning(&needle).len(),
            2,
            "sh -c and its setsid child"
        );
        let killed = identity.reap(Duration::from_secs(5)).await.unwrap();
        assert!(killed >= 2, "{killed}");
        let left = processes_mentioning(&needle);
        assert!(left.is_empty(), "left behind by reap: {left:?}");
        drop(tool);
        // A pid that is now another process (different start time) is never touched.
        let stranger = ToolIdentity {
            start_time: identity.start_time.saturating_add(1),
            ..ToolIdentity::of(std::process::id() as i32).unwrap()
        };
        assert_eq!(stranger.reap(Duration::from_secs(1)).await, Ok(0));
    }

    #[tokio::test]
    async fn a_daemon_holding_the_pipes_does_not_hang_the_call() {
        // Like `proxmox-backup-client map`: the parent prints and exits, a forked child keeps
        // stderr open.
        let call = sh("echo mapped >&2; (sleep 3) & exit 0");
        let started = Instant::now();
        let out = run(call).await.unwrap();
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(out.stderr, "mapped\n");
    }

    #[tokio::test]
    async fn missing_program_is_a_spawn_error() {
        let err = run(ToolCall::new("/nonexistent/qm", Duration::from_secs(1)))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("check the tool path"), "{err}");
    }
}
