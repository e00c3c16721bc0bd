//! Starting a tool in a process group of its own, capturing its output up to the cap, waiting
//! for it within its timeout and killing the whole group on expiry; the descriptors the child
//! inherits are installed between fork and exec.

use super::call::{TOOL_PATH, ToolCall, ToolError, ToolOutput, UnitWatch};
use super::secrets::{Inherited, MAX_SECRETS, prepare_secrets};
use super::tool_identity::{REAP_WITHIN, ToolIdentity};
use std::os::fd::AsRawFd;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

/// How long to wait for output after the child exited.
const OUTPUT_GRACE: Duration = Duration::from_millis(300);
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

/// The command of `call`: its program and argv, a cleared environment with `PATH` and the
/// call's variables, stdout and stderr piped, a process group of its own, killed on drop.
fn command_of(call: &ToolCall) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(&call.program);
    command
        .args(&call.args)
        .env_clear()
        .env("PATH", TOOL_PATH)
        .envs(call.env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    command
}

/// Starts `call` (which carries no secret) with all three of stdin, stdout and stderr piped to
/// the caller, which drives the tool over them (guestfish): the same environment, process
/// group and inherited descriptors (0, 1, 2 only) as every other tool.
pub fn start_interactive(call: &ToolCall) -> Result<tokio::process::Child, ToolError> {
    let name = call.program.display().to_string();
    if !call.secrets.is_empty() || call.stdin_secret.is_some() {
        return Err(ToolError::Secret {
            program: name,
            error: std::io::Error::other("an interactive tool gets no secret"),
        });
    }
    let mut command = command_of(call);
    command.stdin(Stdio::piped());
    install_descriptors(&mut command, &[]).map_err(|error| ToolError::Secret {
        program: name.clone(),
        error,
    })?;
    command.spawn().map_err(|error| ToolError::Spawn {
        program: name,
        error,
    })
}

/// Starts the call's program in a process group of its own.
pub fn start(call: ToolCall) -> Result<RunningTool, ToolError> {
    let program = call.display();
    let name = call.program.display().to_string();
    let cap = call.output_cap;
    let mut command = command_of(&call);
    command.stdin(if call.stdin_secret.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
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
            stdout_bytes: self
                .stdout
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
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
pub(super) fn install_descriptors(
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
