//! The appliance's sandbox: the unit properties that confine guestfish, its QEMU and the
//! appliance kernel (the one place on the node where a hostile filesystem is parsed), the
//! unprivileged user they run as, and the overlay handed to that user for the session.
//!
//! The unit runs as one of `guest_network.appliance_users` (system users the package
//! creates), lent to this appliance alone ([`super::identities`]), with
//! no capabilities, no network, a private `/dev` holding only `/dev/kvm` and the backup's loop
//! device (read-only, through the device cgroup), the whole file system read-only but for the
//! run's overlay (bound in at [`OVERLAY_IN_UNIT`]) and the libguestfs cache, and its temporary
//! files (the appliance's own overlay, its sockets) on a tmpfs of [`APPLIANCE_TMP_MIB`].

use crate::process::ToolCall;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Where the run's overlay appears inside the unit: guestfish opens this path, and nothing
/// else of the node's state directory is visible there.
pub const OVERLAY_IN_UNIT: &str = "/tmp/disk.qcow2";
/// The appliance's temporary files (its root's qcow2 overlay, the daemon socket): a tmpfs of
/// this size, whose pages count against the unit's `MemoryMax`.
pub const APPLIANCE_TMP_MIB: u64 = 512;
/// `/var/tmp` in the unit, which libguestfs does not use once told where its files go.
const VAR_TMP_MIB: u64 = 16;
/// Where each appliance user's libguestfs cache is (supermin's appliance, built once per user
/// from the node's packages and kept between its recoveries): `<this>/<user>`, the unit's
/// `CacheDirectory=`, 0700 and owned by that user alone.
pub const APPLIANCE_CACHE_ROOT: &str = "/var/cache/certistack-appliance";
/// [`APPLIANCE_CACHE_ROOT`] as systemd's `CacheDirectory=` names it (under `/var/cache`).
const APPLIANCE_CACHE_DIRECTORY: &str = "certistack-appliance";
/// The group the appliance user reads the loop device through: udev gives every block
/// device `root:disk 0660` (systemd's `50-udev-default.rules`); the unit's private `/dev`
/// holds no other block device, and its device cgroup allows the loop device read-only.
pub const LOOP_DEVICE_GROUP: &str = "disk";
/// The group `/dev/kvm` belongs to (`50-udev-default.rules`, `KERNEL=="kvm", GROUP="kvm"`).
pub const KVM_GROUP: &str = "kvm";
/// The device QEMU opens for KVM.
pub const KVM_DEVICE: &str = "/dev/kvm";
/// The longest `/etc/passwd` or `/etc/group` read.
const MAX_ACCOUNT_FILE: u64 = 1 << 20;

/// What the unit sets whatever the run: no privilege, no network, no namespace, no device
/// but the two bound in, a read-only system. Its `/tmp` and `/var/tmp` are tmpfs mounts of its
/// own ([`session_properties`]) rather than `PrivateTmp=`, whose directories live on the
/// node's `/tmp` without a bound (and which would hide those mounts). Not here because QEMU
/// needs them:
/// `MemoryDenyWriteExecute` (TCG writes its code), `ProtectKernelModules` (supermin builds the
/// appliance from `/lib/modules`), `PrivateUsers` (`/dev/kvm` is reached through group kvm).
pub const CONFINEMENT: &[&str] = &[
    "NoNewPrivileges=yes",
    "CapabilityBoundingSet=",
    "AmbientCapabilities=",
    "ProtectSystem=strict",
    "ProtectHome=yes",
    "PrivateMounts=yes",
    "PrivateNetwork=yes",
    "IPAddressDeny=any",
    "PrivateDevices=yes",
    "DevicePolicy=closed",
    "ProtectKernelTunables=yes",
    "ProtectKernelLogs=yes",
    "ProtectControlGroups=yes",
    "ProtectClock=yes",
    "ProtectHostname=yes",
    "ProtectProc=invisible",
    "RestrictNamespaces=yes",
    "RestrictRealtime=yes",
    "RestrictSUIDSGID=yes",
    "LockPersonality=yes",
    "SystemCallArchitectures=native",
    "SystemCallFilter=@system-service",
    // The launcher adds its own filter (loop ioctls) with seccomp(2), which only narrows.
    "SystemCallFilter=seccomp",
    "SystemCallErrorNumber=EPERM",
    "RestrictAddressFamilies=AF_UNIX",
    "KeyringMode=private",
    "RemoveIPC=yes",
    "UMask=0077",
];

/// The unprivileged account the appliance runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplianceUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

impl ApplianceUser {
    /// `name` from `passwd` (`/etc/passwd`): a local system account, as `systemd-sysusers`
    /// makes it from the package's `sysusers.d` file. Never root.
    pub fn lookup(passwd: &Path, name: &str) -> Result<Self, String> {
        let text = read_account_file(passwd)?;
        let entry = text
            .lines()
            .map(|line| line.split(':').collect::<Vec<_>>())
            .find(|fields| fields.first() == Some(&name));
        let Some(fields) = entry else {
            return Err(format!(
                "the appliance user {name:?} (guest_network.appliance_user) is not in {}: reinstall the certistack-connector package (its sysusers.d file creates it: systemd-sysusers certistack-connector.conf) or create a system user: useradd --system --no-create-home --shell /usr/sbin/nologin {name}",
                passwd.display()
            ));
        };
        let number = |index: usize, what: &str| {
            fields
                .get(index)
                .and_then(|field| field.parse::<u32>().ok())
                .ok_or_else(|| {
                    format!(
                        "{}: the {what} of {name:?} is not a number",
                        passwd.display()
                    )
                })
        };
        let (uid, gid) = (number(2, "uid")?, number(3, "gid")?);
        if uid == 0 || gid == 0 {
            return Err(format!(
                "the appliance user {name:?} (guest_network.appliance_user) is root (uid {uid}, gid {gid}): the appliance must run unprivileged; name a system user of its own"
            ));
        }
        Ok(Self {
            name: name.to_owned(),
            uid,
            gid,
        })
    }
}

/// The number of group `name` in `group` (`/etc/group`).
pub fn group_id(group: &Path, name: &str) -> Result<u32, String> {
    read_account_file(group)?
        .lines()
        .map(|line| line.split(':').collect::<Vec<_>>())
        .find(|fields| fields.first() == Some(&name))
        .and_then(|fields| fields.get(2).and_then(|gid| gid.parse().ok()))
        .ok_or_else(|| {
            format!(
                "no group {name:?} in {} (pve.group): the confined appliance reads the backup's loop device through group {LOOP_DEVICE_GROUP} and /dev/kvm through group {KVM_GROUP}, as udev sets them up; create the group or set pve.group, or plan network_recovery.mode preserve",
                group.display()
            )
        })
}

fn read_account_file(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|file| file.take(MAX_ACCOUNT_FILE).read_to_string(&mut text))
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok(text)
}

/// The program that starts every confined appliance: this connector's own binary, as its
/// `appliance-exec` launcher ([`super::launcher`]). The unit sees the node's `/usr` (read-only),
/// where the package installs it.
pub fn appliance_launcher() -> Result<PathBuf, String> {
    let exe = std::env::current_exe()
        .map_err(|e| format!("cannot tell where this connector's binary is: {e}"))?;
    match std::fs::metadata(&exe) {
        Ok(meta) if meta.is_file() => Ok(exe),
        _ => Err(format!(
            "this connector's binary {} is gone (replaced by a package upgrade?): it starts every confined appliance; restart certistack-connector",
            exe.display()
        )),
    }
}

/// `call` (guestfish) made to run confined once it is started in a transient unit: through
/// `launcher` (`appliance-exec`, which forbids the loop driver's ioctls), as the appliance
/// user, [`CONFINEMENT`], `/dev/kvm` and, for a recovery, the run's loop device (readable
/// only) and overlay (bound in at [`OVERLAY_IN_UNIT`]); the libguestfs cache and the tmpfs
/// mounts, and the environment that points libguestfs at them.
pub fn confine(
    call: ToolCall,
    user: &ApplianceUser,
    disk: Option<Disk<'_>>,
    kvm_device: &Path,
    launcher: &Path,
) -> ToolCall {
    let mut call = call;
    let program = std::mem::replace(&mut call.program, launcher.to_owned());
    let args = std::mem::take(&mut call.args);
    call.args = [
        super::launcher::APPLIANCE_EXEC.into(),
        program.into_os_string(),
    ]
    .into_iter()
    .chain(args)
    .collect();
    for (key, value) in SESSION_ENVIRONMENT {
        call = call.env(key, *value);
    }
    call = call.env(
        "LIBGUESTFS_CACHEDIR",
        format!("{APPLIANCE_CACHE_ROOT}/{}", user.name),
    );
    for property in CONFINEMENT {
        call = call.unit_property(*property);
    }
    for property in session_properties(user, disk, kvm_device) {
        call = call.unit_property(property);
    }
    call
}

/// The disk a recovery's appliance opens.
#[derive(Debug, Clone, Copy)]
pub struct Disk<'a> {
    /// The run's overlay, on the node.
    pub overlay: &'a Path,
    /// The loop device its backing names.
    pub loop_device: &'a Path,
}

/// The unit properties of one appliance beside [`CONFINEMENT`]: its user, `/dev/kvm`, the
/// disk's loop device (readable only) and overlay, the cache and the tmpfs mounts.
pub fn session_properties(
    user: &ApplianceUser,
    disk: Option<Disk<'_>>,
    kvm_device: &Path,
) -> Vec<String> {
    let mut properties = vec![
        format!("User={}", user.name),
        format!("Group={}", user.gid),
        format!("SupplementaryGroups={KVM_GROUP} {LOOP_DEVICE_GROUP}"),
        format!("DeviceAllow={} rw", kvm_device.display()),
        // `-`: a node without KVM boots the appliance under TCG.
        format!("BindPaths=-{}", kvm_device.display()),
        format!("TemporaryFileSystem=/tmp:size={APPLIANCE_TMP_MIB}M,mode=1777"),
        format!("TemporaryFileSystem=/var/tmp:size={VAR_TMP_MIB}M,mode=1777"),
        format!("CacheDirectory={APPLIANCE_CACHE_DIRECTORY}/{}", user.name),
        "CacheDirectoryMode=0700".to_owned(),
    ];
    if let Some(disk) = disk {
        properties.extend([
            format!("DeviceAllow={} r", disk.loop_device.display()),
            format!("BindReadOnlyPaths={}", disk.loop_device.display()),
            format!("BindPaths={}:{OVERLAY_IN_UNIT}", disk.overlay.display()),
        ]);
    }
    properties
}

/// The environment libguestfs gets in the unit: its temporary files where the unit's sandbox
/// lets the appliance user write (and `LIBGUESTFS_CACHEDIR`, its user's cache, set by
/// [`confine`]).
pub const SESSION_ENVIRONMENT: &[(&str, &str)] = &[
    ("LIBGUESTFS_TMPDIR", "/tmp"),
    ("TMPDIR", "/tmp"),
    ("HOME", "/tmp"),
];

/// Why the appliance user cannot read `device` through [`LOOP_DEVICE_GROUP`], if it cannot.
pub fn loop_device_problem(device: &Path, disk_gid: u32) -> Option<String> {
    match std::fs::metadata(device) {
        Ok(meta) if meta.gid() == disk_gid && meta.mode() & 0o040 != 0 => None,
        Ok(meta) => Some(format!(
            "{} is {}:{} mode {:04o}; the confined appliance reads it as group {LOOP_DEVICE_GROUP} (gid {disk_gid}), as udev leaves block devices (root:disk 0660): restore that (udevadm trigger {}), or plan network_recovery.mode preserve",
            device.display(),
            meta.uid(),
            meta.gid(),
            meta.mode() & 0o7777,
            device.display()
        )),
        Err(e) => Some(format!("cannot read {}: {e}", device.display())),
    }
}

/// The overlay given to the appliance user for one session, and given back to its owner
/// when dropped: the appliance writes it through the bind mount, and nothing else of the
/// state directory is reachable to that user.
#[derive(Debug)]
pub struct OverlayHandover {
    path: PathBuf,
    /// The owner to give the overlay back to; `None` once given back.
    owner: Option<(u32, u32)>,
}

impl OverlayHandover {
    pub fn give(path: &Path, user: &ApplianceUser) -> Result<Self, String> {
        let meta = std::fs::symlink_metadata(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        if !meta.is_file() {
            return Err(format!("{} is not a regular file", path.display()));
        }
        let owner = (meta.uid(), meta.gid());
        std::os::unix::fs::lchown(path, Some(user.uid), Some(user.gid)).map_err(|e| {
            format!(
                "cannot hand {} to the appliance user {}: {e}",
                path.display(),
                user.name
            )
        })?;
        Ok(Self {
            path: path.to_owned(),
            owner: Some(owner),
        })
    }

    /// Gives the overlay back now; what went wrong, if something did.
    pub fn give_back(mut self) -> Result<(), String> {
        self.restore()
    }

    fn restore(&mut self) -> Result<(), String> {
        let Some((uid, gid)) = self.owner.take() else {
            return Ok(());
        };
        std::os::unix::fs::lchown(&self.path, Some(uid), Some(gid)).map_err(|e| {
            format!(
                "cannot give {} back to {uid}:{gid}: {e}",
                self.path.display()
            )
        })
    }
}

impl Drop for OverlayHandover {
    fn drop(&mut self) {
        if let Err(reason) = self.restore() {
            tracing::warn!(%reason, "the overlay stays owned by the appliance user until it is deleted");
        }
    }
}
