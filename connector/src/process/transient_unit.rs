//! Tools started through `systemd-run` in a transient unit, outside the daemon's cgroup and
//! sandbox: the unit's name, description and properties per role, and its release.

use super::call::{ToolCall, UnitWatch};
use super::secrets::SecretKind;
use super::spawn::run;
use std::path::Path;
use std::time::Duration;

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
    for property in &call.unit_properties {
        wrapped = wrapped.arg("--property").arg(property);
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
