//! What KVM gives this node's guests, and one bounded boot of the libguestfs appliance.
//!
//! A node that is itself a virtual machine (a nested Proxmox VE in a cloud VM, a lab, an
//! operator's CI) may have a `/dev/kvm` served by the outer hypervisor that opens, runs a tiny
//! guest, and still stops a real one (SeaBIOS, a boot loader, a kernel) with `internal-error`,
//! while the libguestfs appliance, which picks KVM by itself, never finishes. The facts here
//! let `doctor` say what such a node means: whether the device opens, whether the CPU says it
//! runs under a hypervisor (the `hypervisor` flag of `/proc/cpuinfo`), whether it exposes
//! hardware virtualization (`vmx`/`svm`), and the machine DMI names. The appliance boot is
//! the only conclusive test, so `NodeChecks` offers it on request: `guestfish -a /dev/null
//! run`, as guest network recovery runs it (its unit, its accelerator, its memory), bounded,
//! one at a time.

use crate::config::{Config, ProcessPolicy};
use crate::node::guest_network::{self, Appliance};
use crate::process::{self, TransientRole};
use certistack_core::untrusted::printable;
use certistack_proto::v1 as pb;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes of `/proc/cpuinfo` read at most before the first `flags` line (one CPU's block is
/// about 1.5 KiB; the flags come in the first block).
const MAX_CPUINFO_BYTES: u64 = 256 * 1024;
/// Bytes read of one DMI name, and characters kept of it.
const MAX_DMI_BYTES: u64 = 256;
const MAX_DMI_CHARS: usize = 128;
const MAX_ERROR_CHARS: usize = 512;
/// The longest appliance boot an operator may ask for, whatever the limits say.
pub const MAX_APPLIANCE_BOOT: Duration = Duration::from_secs(3600);

/// Where the facts are read; the defaults are the kernel's own files.
#[derive(Debug, Clone)]
pub struct VirtualizationPaths {
    pub kvm_device: PathBuf,
    pub cpuinfo: PathBuf,
    pub dmi_dir: PathBuf,
}

impl VirtualizationPaths {
    pub fn from_config(config: &Config) -> Self {
        Self {
            kvm_device: config.pve.kvm_device.clone(),
            cpuinfo: config.pve.cpuinfo.clone(),
            dmi_dir: config.pve.dmi_dir.clone(),
        }
    }
}

/// Reads the facts; blocking (files only), each read bounded in size.
pub fn facts(paths: &VirtualizationPaths) -> pb::VirtualizationFacts {
    let (kvm_device_opens, kvm_device_error) = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&paths.kvm_device)
        .and_then(|file| file.metadata())
    {
        Ok(meta) if std::os::unix::fs::FileTypeExt::is_char_device(&meta.file_type()) => {
            (true, String::new())
        }
        Ok(_) => (false, "not a character device".to_owned()),
        Err(error) => (
            false,
            printable(error.to_string().as_bytes(), MAX_ERROR_CHARS),
        ),
    };
    let (flags, cpuinfo_error) = match cpu_flags(&paths.cpuinfo) {
        Ok(flags) => (flags, String::new()),
        Err(error) => (
            Vec::new(),
            printable(
                format!("{}: {error}", paths.cpuinfo.display()).as_bytes(),
                MAX_ERROR_CHARS,
            ),
        ),
    };
    let has = |flag: &str| flags.iter().any(|f| f == flag);
    let cpu_virtualization_flag = ["vmx", "svm"]
        .into_iter()
        .find(|flag| has(flag))
        .unwrap_or_default()
        .to_owned();
    pb::VirtualizationFacts {
        kvm_device: printable(
            paths.kvm_device.display().to_string().as_bytes(),
            MAX_ERROR_CHARS,
        ),
        kvm_device_opens,
        kvm_device_error,
        cpu_hypervisor_flag: has("hypervisor"),
        cpu_virtualization_flag,
        dmi_sys_vendor: dmi_name(&paths.dmi_dir.join("sys_vendor")),
        dmi_product_name: dmi_name(&paths.dmi_dir.join("product_name")),
        cpuinfo_error,
        appliance_accelerator: String::new(),
    }
}

/// The flags of the first CPU that lists them (`flags : fpu vme …`).
fn cpu_flags(cpuinfo: &Path) -> Result<Vec<String>, std::io::Error> {
    let file = std::fs::File::open(cpuinfo)?;
    let reader = std::io::BufReader::new(std::io::Read::take(file, MAX_CPUINFO_BYTES));
    for line in reader.split(b'\n') {
        let line = line?;
        let text = String::from_utf8_lossy(&line);
        if let Some((key, value)) = text.split_once(':')
            && key.trim() == "flags"
        {
            return Ok(value.split_whitespace().map(str::to_owned).collect());
        }
    }
    Ok(Vec::new())
}

fn dmi_name(path: &Path) -> String {
    let Ok(file) = std::fs::File::open(path) else {
        return String::new();
    };
    let mut bytes = Vec::new();
    if std::io::Read::read_to_end(&mut std::io::Read::take(file, MAX_DMI_BYTES), &mut bytes)
        .is_err()
    {
        return String::new();
    }
    printable(
        String::from_utf8_lossy(&bytes).trim().as_bytes(),
        MAX_DMI_CHARS,
    )
}

/// How long stopping a boot's unit may take.
const UNIT_STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Characters of guestfish's stderr kept in an error: its last lines say why.
const MAX_STDERR_TAIL_CHARS: usize = 400;

/// The one appliance boot a node runs at a time: each takes the appliance's memory.
pub type ApplianceSlot = Arc<tokio::sync::Mutex<()>>;

/// What an appliance boot takes from the connector's configuration.
#[derive(Debug, Clone)]
pub struct ApplianceSettings {
    pub guestfish: PathBuf,
    pub appliance: Appliance,
    pub process: ProcessPolicy,
    /// Whether the boot runs in the appliance's confined unit ([`Config::appliance_confined`]).
    pub confined: bool,
    /// `guest_network.appliance_users`, one of which the confined boot runs as (one no other
    /// appliance runs as), from `pve.passwd`.
    pub appliance_users: Vec<String>,
    pub passwd: PathBuf,
}

impl ApplianceSettings {
    pub fn from_config(config: &Config) -> Self {
        Self {
            guestfish: config.tools.guestfish.clone(),
            appliance: Appliance::from_config(config),
            process: config.process.clone(),
            confined: config.appliance_confined(),
            appliance_users: config.guest_network.appliance_users.clone(),
            passwd: config.pve.passwd.clone(),
        }
    }
}

/// Holds the slot for a boot and, while armed, stops the boot's unit when dropped: the boot
/// ended in error, or its caller went away (the tool runner has then killed `systemd-run`, not
/// the unit it started). The slot is given back only once the unit is stopped, so that a next
/// boot never overlaps one still ending.
#[derive(Debug)]
struct BootGuard {
    unit: Option<(String, String)>,
    systemctl: PathBuf,
    slot: Option<tokio::sync::OwnedMutexGuard<()>>,
    /// The appliance user the boot runs as, given back with the slot.
    lease: Option<guest_network::IdentityLease>,
}

impl Drop for BootGuard {
    fn drop(&mut self) {
        let Some((unit, description)) = self.unit.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Without a runtime the unit cannot be stopped here: its user stays lent.
            if let Some(lease) = self.lease.take() {
                lease.keep();
            }
            return;
        };
        let systemctl = self.systemctl.clone();
        let slot = self.slot.take();
        let lease = self.lease.take();
        runtime.spawn(async move {
            if let Err(reason) =
                process::release_transient_unit(&systemctl, &unit, &description, UNIT_STOP_TIMEOUT)
                    .await
            {
                tracing::warn!(%unit, %reason, "the appliance boot's unit could not be stopped; its RuntimeMaxSec ends it, and its user stays lent until the connector restarts");
                if let Some(lease) = lease {
                    lease.keep();
                }
            } else {
                drop(lease);
            }
            drop(slot);
        });
    }
}

/// Boots the appliance once as guest network recovery would (`guestfish -a /dev/null run`,
/// its environment, its unit), bounded by `within` and by the recovery's own limit. Every way
/// it can fail is a fact of the reply, not an error of the call: the node's other facts still
/// reach the operator.
pub async fn boot_appliance(
    settings: &ApplianceSettings,
    slot: &ApplianceSlot,
    within: Duration,
) -> pb::ApplianceBootFacts {
    let appliance = settings.appliance;
    let within = within.min(appliance.timeout).min(MAX_APPLIANCE_BOOT);
    let mut facts = pb::ApplianceBootFacts {
        accelerator: appliance.accelerator.name().to_owned(),
        within_secs: u32::try_from(within.as_secs()).unwrap_or(u32::MAX),
        recovery_timeout_secs: u32::try_from(appliance.timeout.as_secs()).unwrap_or(u32::MAX),
        ..Default::default()
    };
    let fail =
        |mut facts: pb::ApplianceBootFacts, outcome: pb::ApplianceBootOutcome, error: String| {
            facts.outcome = outcome as i32;
            facts.error = printable(error.as_bytes(), MAX_ERROR_CHARS);
            facts
        };
    use pb::ApplianceBootOutcome as Boot;
    if let Err(reason) = crate::node::guest_network::guestfish_installed(&settings.guestfish) {
        return fail(facts, Boot::Failed, reason);
    }
    let Ok(held) = slot.clone().try_lock_owned() else {
        return fail(
            facts,
            Boot::Busy,
            "another appliance boot is running on this node (one at a time); ask again when it has ended".to_owned(),
        );
    };
    let call = appliance
        .session(&settings.guestfish, within)
        .arg("-a")
        .arg("/dev/null")
        .arg("run");
    let process = &settings.process;
    let mut lease = None;
    let (call, unit) = if settings.confined {
        // Booted as a recovery's appliance is, confined: a boot that works here works there.
        let running = match guest_network::users_of_loaded_units(
            &process.systemctl,
            guest_network::APPLIANCE_UNITS,
            UNIT_STOP_TIMEOUT,
        )
        .await
        {
            Ok(running) => running,
            Err(reason) => return fail(facts, Boot::Failed, reason),
        };
        let leased =
            match guest_network::lease(&settings.appliance_users, &settings.passwd, &running) {
                Ok(leased) => leased,
                Err(reason) => return fail(facts, Boot::Busy, reason),
            };
        let user = leased.user.clone();
        lease = Some(leased);
        let launcher = match guest_network::appliance_launcher() {
            Ok(launcher) => launcher,
            Err(reason) => return fail(facts, Boot::Failed, reason),
        };
        let call = guest_network::confine(
            call,
            &user,
            None,
            Path::new(guest_network::KVM_DEVICE),
            &launcher,
        );
        let id = uuid::Uuid::new_v4().simple().to_string();
        let role = TransientRole::GuestNetwork {
            memory_max_mib: appliance
                .memory_mib
                .saturating_add(crate::node::guest_network::UNIT_MEMORY_OVERHEAD_MIB),
        };
        let description = format!("CertiStack node check {id}: libguestfs appliance boot");
        let wrapped = process::transient_unit_name(role, "check", &id).and_then(|name| {
            process::in_transient_unit(
                call,
                role,
                &name,
                &description,
                &process.systemd_run,
                &process.systemctl,
                None,
            )
            .map(|call| (call, name))
        });
        match wrapped {
            Ok((call, name)) => (call, Some((name, description))),
            Err(reason) => return fail(facts, Boot::Failed, reason),
        }
    } else {
        (call, None)
    };
    let mut guard = BootGuard {
        unit,
        systemctl: process.systemctl.clone(),
        slot: Some(held),
        lease,
    };
    let started = Instant::now();
    let outcome = process::run(call).await;
    facts.elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let error = match outcome {
        Ok(output) if output.exit_code == Some(0) => None,
        Ok(output) => Some((
            Boot::Failed,
            format!(
                "guestfish -a /dev/null run exited {}: {}",
                output
                    .exit_code
                    .map_or_else(|| "on a signal".to_owned(), |code| code.to_string()),
                tail(output.stderr.trim(), MAX_STDERR_TAIL_CHARS)
            ),
        )),
        Err(process::ToolError::Timeout { .. }) => Some((
            Boot::TimedOut,
            format!(
                "the appliance did not boot within {} s and was killed",
                within.as_secs()
            ),
        )),
        Err(error) => Some((Boot::Failed, error.to_string())),
    };
    match error {
        None => {
            // Ended by itself: nothing to stop.
            guard.unit = None;
            facts.booted = true;
            facts.outcome = Boot::Booted as i32;
            facts
        }
        // The guard, dropped armed, stops the unit in the background and keeps the slot until
        // then; the reply does not wait for it.
        Some((outcome, error)) => fail(facts, outcome, error),
    }
}

/// The last `max` characters of `text`.
fn tail(text: &str, max: usize) -> &str {
    let count = text.chars().count();
    match text.char_indices().nth(count.saturating_sub(max)) {
        Some((at, _)) if count > max => text.get(at..).unwrap_or(text),
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "certistack-virt-{tag}-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_nested_node_without_hardware_virtualization_is_told_apart() {
        let root = dir("nested");
        std::fs::write(
            root.join("cpuinfo"),
            "processor\t: 0\nflags\t\t: fpu vme de pse hypervisor lahf_lm\n\nprocessor\t: 1\nflags\t\t: fpu vmx\n",
        )
        .unwrap();
        std::fs::create_dir_all(root.join("dmi")).unwrap();
        std::fs::write(root.join("dmi/sys_vendor"), "QEMU\n").unwrap();
        std::fs::write(
            root.join("dmi/product_name"),
            "Standard PC\x1b[2J (Q35 + ICH9, 2009)\n",
        )
        .unwrap();
        let facts = facts(&VirtualizationPaths {
            kvm_device: root.join("no-kvm"),
            cpuinfo: root.join("cpuinfo"),
            dmi_dir: root.join("dmi"),
        });
        assert!(!facts.kvm_device_opens);
        assert!(facts.kvm_device_error.contains("No such file"), "{facts:?}");
        assert!(facts.cpu_hypervisor_flag);
        // The first CPU's flags decide: the second block's vmx is not read.
        assert_eq!(facts.cpu_virtualization_flag, "");
        assert_eq!(facts.dmi_sys_vendor, "QEMU");
        // A terminal escape from the node's firmware strings is escaped, not passed on.
        assert!(!facts.dmi_product_name.contains('\x1b'), "{facts:?}");
        assert!(facts.dmi_product_name.contains("Q35"), "{facts:?}");
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn bare_metal_with_vmx_and_an_openable_device() {
        let root = dir("metal");
        std::fs::write(root.join("cpuinfo"), "flags\t: fpu vmx sse2\n").unwrap();
        // Any character device that opens read-write stands in for the device; a plain file
        // does not.
        std::fs::write(root.join("kvm"), "").unwrap();
        let plain = facts(&VirtualizationPaths {
            kvm_device: root.join("kvm"),
            cpuinfo: root.join("cpuinfo"),
            dmi_dir: root.join("no-dmi"),
        });
        assert!(!plain.kvm_device_opens);
        assert_eq!(plain.kvm_device_error, "not a character device");
        let facts = facts(&VirtualizationPaths {
            kvm_device: "/dev/null".into(),
            cpuinfo: root.join("cpuinfo"),
            dmi_dir: root.join("no-dmi"),
        });
        assert!(facts.kvm_device_opens, "{facts:?}");
        assert!(!facts.cpu_hypervisor_flag);
        assert_eq!(facts.cpu_virtualization_flag, "vmx");
        assert_eq!(facts.dmi_sys_vendor, "");
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_cpuinfo_without_flags_in_its_bound_reads_as_no_flags() {
        let root = dir("bound");
        let padding = "model name\t: x\n".repeat(20_000);
        std::fs::write(
            root.join("cpuinfo"),
            format!("{padding}flags\t: hypervisor\n"),
        )
        .unwrap();
        let facts = facts(&VirtualizationPaths {
            kvm_device: root.join("kvm"),
            cpuinfo: root.join("cpuinfo"),
            dmi_dir: root.join("dmi"),
        });
        assert!(!facts.cpu_hypervisor_flag);
        assert_eq!(facts.cpuinfo_error, "");
        std::fs::remove_dir_all(root).unwrap();
    }
}
