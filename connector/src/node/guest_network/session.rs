//! The guestfish session: one libguestfs appliance process on the run's overlay, driven
//! batch by batch over its stdin, with guest-derived text quoted or refused before it is sent;
//! how the appliance is booted, and the transient unit it runs in.

use super::confinement::{self, ApplianceUser};
use super::{MAX_COMMAND_BYTES, MAX_SESSION_BYTES, RecoveryError};
use crate::config::ApplianceAccelerator;
use crate::process::{self, ToolCall, ToolIdentity, TransientRole};
use certistack_core::validate::{RunId, Vmid};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

/// Characters of stderr kept in an error.
const STDERR_KEPT: usize = 2048;

/// A guestfish string argument: double-quoted, every byte that is not plain printable ASCII
/// (and `"`, `\`) escaped, so guest-derived text never ends the argument or the command.
pub(super) fn quote(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() + 2);
    out.push('"');
    for &byte in bytes {
        match byte {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            b'\n' => out.push_str("\\n"),
            b'\t' => out.push_str("\\t"),
            0x20..=0x7e => out.push(char::from(byte)),
            _ => {
                let _ = write!(out, "\\x{byte:02x}");
            }
        }
    }
    out.push('"');
    out
}

/// Whether a guest path is one recovery will name to guestfish: absolute, made of characters
/// configuration files use, no component `.` or `..` (`/etc/..` is `/`). A file with another
/// name is reported, not touched.
pub(super) fn plain_path(path: &str) -> bool {
    path.starts_with('/')
        && path.len() <= 256
        && path.split('/').all(|part| part != "." && part != "..")
        && path
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-@+:".contains(c))
}

/// Whether a mountable from the guest's inspection (its fstab, so guest-controlled) is one
/// recovery will mount: a short `/dev/` path of plain characters, or a btrfs subvolume of one
/// (`btrfsvol:/dev/sda2/@root`, as libguestfs names a root or a mount on a subvolume) whose
/// name is plain too and climbs nowhere.
pub(super) fn plain_mountable(mountable: &str) -> bool {
    let plain = |text: &str| {
        text.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._:+-@".contains(c))
    };
    if mountable.len() > 128 {
        return false;
    }
    match mountable.strip_prefix("btrfsvol:") {
        Some(volume) => {
            // `/dev/<device>/<subvolume path>`: every part after `/dev/` named, none `.` or `..`.
            volume.starts_with("/dev/")
                && plain(volume)
                && volume
                    .split('/')
                    .skip(2)
                    .all(|part| !part.is_empty() && part != "." && part != "..")
                && volume.split('/').count() > 3
        }
        None => mountable.starts_with("/dev/") && !mountable.contains('@') && plain(mountable),
    }
}

/// One guestfish process on the overlay, driven batch by batch over its stdin.
pub(super) struct Session {
    child: tokio::process::Child,
    /// `None` once `finish` closed it.
    stdin: Option<tokio::process::ChildStdin>,
    stdout: tokio::io::BufReader<tokio::process::ChildStdout>,
    stderr: tokio::task::JoinHandle<Vec<u8>>,
    marker: String,
    batches: u64,
    read: usize,
}

impl Session {
    /// Starts `call` (guestfish on the overlay, or `systemd-run` starting it in a transient
    /// unit with `--pipe`, which hands these same pipes to guestfish).
    pub(super) fn start(call: ToolCall) -> Result<Self, RecoveryError> {
        // Through the one spawn path of every tool: a cleared environment, a process group of
        // its own, and no descriptor of the daemon's but stdio (guestfish's QEMU inherits
        // what guestfish has).
        let mut child = process::start_interactive(&call).map_err(|e| {
            RecoveryError::Tool(format!(
                "cannot start {} (tools.guestfish, process.systemd_run; install libguestfs-tools): {e}",
                call.program.display()
            ))
        })?;
        let missing = || RecoveryError::Tool("guestfish started without its pipes".into());
        let stdin = child.stdin.take().ok_or_else(missing)?;
        let stdout = child.stdout.take().ok_or_else(missing)?;
        let mut stderr_pipe = child.stderr.take().ok_or_else(missing)?;
        let stderr = tokio::spawn(async move {
            let mut kept = Vec::new();
            let mut chunk = [0u8; 4096];
            loop {
                match stderr_pipe.read(&mut chunk).await {
                    Ok(0) | Err(_) => return kept,
                    Ok(n) => {
                        let room = STDERR_KEPT.saturating_sub(kept.len());
                        kept.extend_from_slice(chunk.get(..n.min(room)).unwrap_or_default());
                    }
                }
            }
        });
        Ok(Self {
            child,
            stdin: Some(stdin),
            stdout: tokio::io::BufReader::new(stdout),
            stderr,
            marker: format!("certistack-{}", uuid::Uuid::new_v4().simple()),
            batches: 0,
            read: 0,
        })
    }

    pub(super) fn identity(&self) -> Option<ToolIdentity> {
        let pid = i32::try_from(self.child.id()?).ok()?;
        Some(ToolIdentity::of(pid).unwrap_or(ToolIdentity {
            pid,
            start_time: 0,
            process_group: pid,
        }))
    }

    /// Sends `commands`, one answer (its output, without the trailing newline) per command.
    pub(super) async fn ask(&mut self, commands: &[String]) -> Result<Vec<Vec<u8>>, RecoveryError> {
        if let Some(command) = commands
            .iter()
            .find(|c| c.len() > MAX_COMMAND_BYTES || c.contains(['\n', '\r']))
        {
            let shown: String = command.chars().take(120).collect();
            return Err(RecoveryError::Tool(format!(
                "refused to send guestfish a command of {} bytes or with a line break (`{shown}`…): guestfish would split it",
                command.len()
            )));
        }
        let mut script = String::new();
        let first = self.batches;
        for (index, command) in commands.iter().enumerate() {
            let _ = writeln!(
                script,
                "{command}\necho {}-{}",
                self.marker,
                first + index as u64
            );
        }
        self.batches += commands.len() as u64;
        let written = match self.stdin.as_mut() {
            Some(stdin) => match stdin.write_all(script.as_bytes()).await {
                Ok(()) => stdin.flush().await,
                Err(error) => Err(error),
            },
            None => Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe)),
        };
        if let Err(error) = written {
            return Err(self
                .failure(&format!("guestfish stopped reading: {error}"))
                .await);
        }
        let mut answers = Vec::with_capacity(commands.len());
        for index in 0..commands.len() {
            let end = format!("{}-{}\n", self.marker, first + index as u64);
            let mut answer = Vec::new();
            loop {
                let mut line = Vec::new();
                // One line may not exceed what the session may still read.
                let room = (MAX_SESSION_BYTES.saturating_sub(self.read) as u64).saturating_add(1);
                let n = match (&mut self.stdout)
                    .take(room)
                    .read_until(b'\n', &mut line)
                    .await
                {
                    Ok(n) => n,
                    Err(error) => {
                        return Err(self
                            .failure(&format!("cannot read guestfish: {error}"))
                            .await);
                    }
                };
                if n == 0 {
                    let command = commands.get(index).map(String::as_str).unwrap_or("");
                    let shown: String = command.chars().take(120).collect();
                    return Err(self
                        .failure(&format!("guestfish exited during `{shown}`"))
                        .await);
                }
                self.read += n;
                if self.read > MAX_SESSION_BYTES {
                    return Err(RecoveryError::Tool(format!(
                        "guestfish printed more than {MAX_SESSION_BYTES} bytes; the session was abandoned"
                    )));
                }
                if line == end.as_bytes() {
                    break;
                }
                answer.extend_from_slice(&line);
            }
            if answer.last() == Some(&b'\n') {
                answer.pop();
            }
            answers.push(answer);
        }
        Ok(answers)
    }

    pub(super) async fn ask_text(
        &mut self,
        commands: &[String],
    ) -> Result<Vec<String>, RecoveryError> {
        Ok(self
            .ask(commands)
            .await?
            .into_iter()
            .map(|a| String::from_utf8_lossy(&a).into_owned())
            .collect())
    }

    async fn stderr_text(&mut self) -> String {
        let handle = std::mem::replace(&mut self.stderr, tokio::spawn(async { Vec::new() }));
        match tokio::time::timeout(Duration::from_secs(2), handle).await {
            Ok(Ok(bytes)) => String::from_utf8_lossy(&bytes).trim().to_owned(),
            _ => String::new(),
        }
    }

    async fn failure(&mut self, what: &str) -> RecoveryError {
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
        let stderr = self.stderr_text().await;
        RecoveryError::Tool(format!("{what}: {stderr}"))
    }

    /// Ends the session: guestfish shuts the appliance down, which flushes the overlay.
    pub(super) async fn finish(mut self) -> Result<Option<i32>, RecoveryError> {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.write_all(b"umount-all\nexit\n").await;
        }
        let status = self
            .child
            .wait()
            .await
            .map_err(|e| RecoveryError::Tool(format!("cannot wait for guestfish: {e}")))?;
        if !status.success() {
            let stderr = self.stderr_text().await;
            return Err(RecoveryError::Tool(format!(
                "guestfish failed closing the overlay (exit {:?}): {stderr}",
                status.code()
            )));
        }
        Ok(status.code())
    }
}

impl Drop for Session {
    /// A session dropped before `finish` (a failure, the deadline, the daemon going away) takes
    /// guestfish's whole process group with it: the appliance's QEMU runs in that group.
    fn drop(&mut self) {
        if let Some(pid) = self
            .child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
        }
    }
}

pub(super) fn truthy(answer: Option<&String>) -> bool {
    answer.is_some_and(|a| a.trim() == "true")
}

/// The transient unit one recovery's guestfish runs in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestNetworkUnit {
    pub role: TransientRole,
    pub name: String,
    pub description: String,
}

/// What the unit may use beyond the appliance's own memory (`LIBGUESTFS_MEMSIZE`): QEMU
/// itself and its TCG translation cache, guestfish, the page cache of the appliance supermin
/// builds, and the tmpfs of the appliance's temporary files.
pub const UNIT_MEMORY_OVERHEAD_MIB: u64 = 1024 + confinement::APPLIANCE_TMP_MIB;

/// The unit of run `run_id`'s recovery on VM `vmid` (`certistack-guestnet-<run>-<vmid>`);
/// recoveries of one run are serialised by its lock, so one name per VM is enough.
pub fn guest_network_unit(
    run_id: &RunId,
    vmid: Vmid,
    memory_mib: u64,
) -> Result<GuestNetworkUnit, String> {
    let role = TransientRole::GuestNetwork {
        memory_max_mib: memory_mib.saturating_add(UNIT_MEMORY_OVERHEAD_MIB),
    };
    let object = vmid.to_string();
    Ok(GuestNetworkUnit {
        role,
        name: process::transient_unit_name(role, run_id.as_str(), &object)?,
        description: process::transient_unit_description(role, run_id.as_str(), &object),
    })
}

/// How the libguestfs appliance of a session is booted and bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appliance {
    /// The whole session's deadline, the appliance's boot included.
    pub timeout: Duration,
    /// The appliance's memory (`LIBGUESTFS_MEMSIZE`).
    pub memory_mib: u64,
    pub accelerator: ApplianceAccelerator,
}

impl Appliance {
    pub fn from_config(config: &crate::config::Config) -> Self {
        Self {
            timeout: Duration::from_secs(config.limits.guest_network_timeout_secs),
            memory_mib: config.limits.guest_network_memory_mib,
            accelerator: config.guest_network.accelerator,
        }
    }

    /// guestfish `program` with the appliance's environment: the direct backend (PVE runs no
    /// libvirt: the appliance is a QEMU child of guestfish), its memory, and TCG when the
    /// configuration says KVM cannot be trusted here.
    pub fn session(&self, program: &Path, timeout: Duration) -> ToolCall {
        let call = ToolCall::new(program, timeout)
            .env("LIBGUESTFS_BACKEND", "direct")
            .env("LIBGUESTFS_MEMSIZE", self.memory_mib.to_string());
        match self.accelerator {
            ApplianceAccelerator::Auto => call,
            ApplianceAccelerator::Tcg => call.env("LIBGUESTFS_BACKEND_SETTINGS", "force_tcg"),
        }
    }
}

/// `Ok` when `program` is an executable file; otherwise what to install or configure.
pub fn guestfish_installed(program: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::metadata(program) {
        Ok(meta) if meta.is_file() && meta.permissions().mode() & 0o111 != 0 => Ok(()),
        Ok(_) => Err(format!(
            "{} (tools.guestfish) is not an executable file; install libguestfs-tools or set tools.guestfish, or plan network_recovery.mode preserve; nothing was written",
            program.display()
        )),
        Err(e) => Err(format!(
            "{} (tools.guestfish): {e}; install libguestfs-tools (and a kernel in /boot for its appliance) or set tools.guestfish, or plan network_recovery.mode preserve; nothing was written",
            program.display()
        )),
    }
}

/// What confines one session's appliance besides the unit's fixed properties: the user it
/// runs as and the devices it may open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confinement {
    pub user: ApplianceUser,
    /// The run's loop device the overlay's backing names: readable only.
    pub loop_device: PathBuf,
    /// `/dev/kvm`, which QEMU opens.
    pub kvm_device: PathBuf,
    /// The connector's binary, whose `appliance-exec` starts guestfish in the unit.
    pub launcher: PathBuf,
}

/// The call of one recovery's guestfish session on `overlay`: guestfish itself, or with `unit`
/// `systemd-run` starting it in that unit, confined ([`confinement`]): outside the daemon's
/// sandbox (which forbids QEMU's TCG and hides /lib/modules) in one of its own, as the
/// appliance user, bounded by the unit even if the daemon dies; `--pipe` hands the session's
/// pipes to guestfish.
pub fn guestfish_call(
    program: &Path,
    overlay: &Path,
    appliance: &Appliance,
    unit: Option<(&GuestNetworkUnit, &Confinement)>,
    systemd_run: &Path,
    systemctl: &Path,
) -> Result<ToolCall, String> {
    let Some((unit, confined)) = unit else {
        return Ok(appliance
            .session(program, appliance.timeout)
            .arg("--format=qcow2")
            .arg("-a")
            .arg(overlay));
    };
    let call = confinement::confine(
        appliance
            .session(program, appliance.timeout)
            .arg("--format=qcow2")
            .arg("-a")
            .arg(confinement::OVERLAY_IN_UNIT),
        &confined.user,
        Some(confinement::Disk {
            overlay,
            loop_device: &confined.loop_device,
        }),
        &confined.kvm_device,
        &confined.launcher,
    );
    process::in_transient_unit(
        call,
        unit.role,
        &unit.name,
        &unit.description,
        systemd_run,
        systemctl,
        None,
    )
}
