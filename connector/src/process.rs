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
use std::path::PathBuf;
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
}

impl ToolCall {
    pub fn new(program: impl Into<PathBuf>, timeout: Duration) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            secrets: Vec::new(),
            timeout,
        }
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

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutput {
    /// The exit code, or `None` when a signal ended the child.
    pub exit_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    /// Output beyond [`OUTPUT_CAP`] was dropped: a caller that parses all of it must not
    /// trust a partial reading.
    pub truncated: bool,
}

impl ToolOutput {
    pub fn success(&self) -> bool {
        self.exit_code == Some(0)
    }

    /// The last lines of stderr, for replies and logs.
    pub fn stderr_excerpt(&self) -> String {
        let lines: Vec<&str> = self.stderr.lines().collect();
        lines
            .get(lines.len().saturating_sub(8)..)
            .unwrap_or_default()
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

fn prepare_secret(secret: &SecretInput) -> std::io::Result<Inherited> {
    let fd = match secret.kind {
        SecretKind::Pipe => {
            let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
            // A password is far below the pipe buffer (64 KiB), so this never blocks; the
            // write end is closed before the child starts, so the child reads to EOF.
            if secret.bytes.len() >= 64 * 1024 {
                return Err(std::io::Error::other("secret larger than a pipe buffer"));
            }
            rustix::io::write(&write, &secret.bytes)?;
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
            while written < secret.bytes.len() {
                written += rustix::io::write(&fd, secret.bytes.get(written..).unwrap_or_default())?;
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
    fn of(pid: i32) -> Option<Self> {
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
    let mut command = tokio::process::Command::new(&call.program);
    command
        .args(&call.args)
        .env_clear()
        .env("PATH", TOOL_PATH)
        .envs(call.env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let inherited = call
        .secrets
        .iter()
        .map(prepare_secret)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| ToolError::Secret {
            program: name.clone(),
            error,
        })?;
    if inherited.len() > 8 {
        return Err(ToolError::Secret {
            program: name,
            error: std::io::Error::other("at most 8 secrets per call"),
        });
    }
    let moves: Vec<(RawFd, RawFd)> = inherited
        .iter()
        .map(|i| (i.fd.as_raw_fd(), i.child_fd))
        .collect();
    install_descriptors(&mut command, moves);
    let started = Instant::now();
    let mut child = command.spawn().map_err(|error| ToolError::Spawn {
        program: name.clone(),
        error,
    })?;
    // The child has its copies; ours close now so only the child holds the secret.
    drop(inherited);
    drop(call.secrets);
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
            .map(|pipe| tokio::spawn(capture(pipe, stdout.clone(), truncated.clone()))),
        child
            .stderr
            .take()
            .map(|pipe| tokio::spawn(capture(pipe, stderr.clone(), truncated.clone()))),
    ];
    Ok(RunningTool {
        child,
        identity,
        group,
        program,
        timeout: call.timeout,
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
        let status = match tokio::time::timeout(self.timeout, self.child.wait()).await {
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
    truncated: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut chunk = [0u8; 8192];
    loop {
        match pipe.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let mut buffer = buffer.lock().unwrap_or_else(|p| p.into_inner());
                let room = OUTPUT_CAP.saturating_sub(buffer.len());
                if n > room {
                    truncated.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                buffer.extend_from_slice(chunk.get(..n.min(room)).unwrap_or_default());
            }
        }
    }
}

/// Moves each prepared descriptor to the number the child expects, between fork and exec,
/// and marks every other descriptor above them close-on-exec, so the child inherits exactly
/// 0, 1, 2 and the secrets (whatever the daemon itself inherited, e.g. a jobserver pipe).
#[allow(unsafe_code)]
fn install_descriptors(command: &mut tokio::process::Command, moves: Vec<(RawFd, RawFd)>) {
    const PARKING: libc::c_int = 1000;
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    let first_free = moves
        .iter()
        .map(|&(_, target)| target + 1)
        .max()
        .unwrap_or(3)
        .max(3);
    // SAFETY: the closure runs in the forked child before exec, where only async-signal-safe
    // functions may be called. It calls only fcntl(2), dup2(2), close(2) and close_range(2) (Linux 5.11+),
    // which are; it touches no allocator or lock (`moves` was allocated before the fork and
    // is only read); it reports failure through the returned io::Error, which the standard
    // library forwards to the parent.
    unsafe {
        command.pre_exec(move || {
            // Park every source above the targets first, so a move cannot overwrite a source
            // that is still to be moved.
            let mut parked = [0 as libc::c_int; 8];
            for (slot, &(fd, _)) in parked.iter_mut().zip(&moves) {
                let high = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, PARKING);
                if high == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                *slot = high;
            }
            for (&high, &(_, target)) in parked.iter().zip(&moves) {
                // dup2 clears close-on-exec on the new descriptor.
                if libc::dup2(high, target) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(high);
            }
            // Mark the rest close-on-exec rather than closing it: the standard library reports
            // a failed exec through a close-on-exec pipe that must stay open until exec.
            if libc::syscall(
                libc::SYS_close_range,
                first_free as libc::c_uint,
                libc::c_uint::MAX,
                CLOSE_RANGE_CLOEXEC,
            ) == -1
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> ToolCall {
        ToolCall::new("/bin/sh", Duration::from_secs(5))
            .arg("-c")
            .arg(script)
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
