//! Loop devices as the kernel reports them (`/sys/block/loopN`), and the names
//! `proxmox-backup-client map` gives its backing files.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopDevice {
    /// `/dev/loopN`
    pub device: String,
    pub read_only: bool,
    pub backing_file: PathBuf,
    /// The kernel reports the backing file as deleted: the mapping's process is gone.
    pub backing_deleted: bool,
}

impl LoopDevice {
    /// A live, read-only mapping backed by exactly `expected`: safe to build on or boot from.
    pub fn serves(&self, expected: &Path) -> bool {
        self.read_only && !self.backing_deleted && self.backing_file == expected
    }
}

/// The pid file of the process holding a mapping: `proxmox-backup-client` derives it from the
/// backing file with Rust's `set_extension("pid")` (`…drive\x2dscsi0.img` → `…drive\x2dscsi0.pid`).
pub fn holder_pid_file(backing: &Path) -> PathBuf {
    backing.with_extension("pid")
}

/// Why the process holding a mapping is not serving it, if it is not.
///
/// The holder serves the loop device's data (FUSE). Killed with SIGKILL, it leaves the loop
/// device attached with the same backing path, and reads from it fail: only its pid file and
/// the process itself tell a live mapping from a dead one. The holder is a forked
/// `proxmox-backup-client map … <archive>`, so its command line names the client, `map` and
/// the archive.
pub fn holder_problem(backing: &Path, client: &Path, archive: &str) -> Option<String> {
    let pid_file = holder_pid_file(backing);
    let mut text = String::new();
    let read = std::fs::File::open(&pid_file)
        .and_then(|f| std::io::Read::read_to_string(&mut std::io::Read::take(f, 32), &mut text));
    if let Err(error) = read {
        return Some(format!(
            "its holder's pid file {} cannot be read ({error})",
            pid_file.display()
        ));
    }
    let Ok(pid) = text.trim().parse::<u32>() else {
        return Some(format!(
            "its holder's pid file {} holds no pid",
            pid_file.display()
        ));
    };
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    let alive = std::fs::read_to_string(proc_dir.join("stat"))
        .ok()
        .and_then(|stat| {
            let state = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .next()?
                .to_owned();
            Some(state != "Z" && state != "X")
        })
        .unwrap_or(false);
    if !alive {
        return Some(format!(
            "its holder (process {pid}, from {}) is dead: the device stays attached but its reads fail",
            pid_file.display()
        ));
    }
    let mut cmdline = Vec::new();
    let _ = std::fs::File::open(proc_dir.join("cmdline")).and_then(|f| {
        std::io::Read::read_to_end(&mut std::io::Read::take(f, 64 * 1024), &mut cmdline)
    });
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let client_name = client.file_name().map(|n| n.as_encoded_bytes());
    let names_client = args.iter().any(|a| {
        Path::new(std::ffi::OsStr::from_bytes(a))
            .file_name()
            .map(|n| n.as_encoded_bytes())
            == client_name
    });
    let is_holder =
        names_client && args.contains(&b"map".as_slice()) && args.contains(&archive.as_bytes());
    (!is_holder).then(|| {
        format!(
            "process {pid} named by {} is not a proxmox-backup-client map of {archive}: the holder is gone and its pid was reused",
            pid_file.display()
        )
    })
}

/// Most partitions and holders read per loop device: a mapped guest disk has a handful.
const MAX_SYSFS_ENTRIES: usize = 256;

/// A device-mapper device the host stacked on a loop device or one of its partitions: with
/// partition scanning, and PVE's LVM filter not excluding `/dev/loop*`, the host's LVM sees a
/// guest's physical volumes and may activate its volumes. It keeps the device busy (unmap
/// cannot detach it) and reads the guest's disk behind the sandbox's back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DmHolder {
    /// `/dev/loopN` or `/dev/loopNpM`.
    pub held: String,
    /// `dm-K`, the kernel's name.
    pub kernel: String,
    /// The device-mapper name, printable (it may come from the guest's LVM metadata).
    pub name: String,
    /// The volume group, when the device is an LVM volume with a name LVM would accept.
    pub volume_group: Option<String>,
}

impl DmHolder {
    /// What holds the device and what an operator runs to release it.
    pub fn describe(&self) -> String {
        let mut text = format!(
            "{} is held by device-mapper device {:?} ({}): run `dmsetup remove /dev/{}`",
            self.held, self.name, self.kernel, self.kernel
        );
        if let Some(vg) = &self.volume_group {
            text.push_str(&format!(
                " (it is a volume of the guest's LVM volume group {vg}: `vgchange -an {vg}` releases them all)"
            ));
        }
        text
    }
}

/// Device-mapper devices holding `device` or any of its partitions (`/sys/block/loopN/holders`,
/// `/sys/block/loopN/loopNpM/holders`).
pub fn device_mapper_holders(sys_block: &Path, device: &str) -> Vec<DmHolder> {
    let Some(name) = kernel_name(device) else {
        return Vec::new();
    };
    let dir = sys_block.join(name);
    let mut held = vec![(device.to_owned(), dir.join("holders"))];
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for entry in entries.take(MAX_SYSFS_ENTRIES).flatten() {
            let Ok(part) = entry.file_name().into_string() else {
                continue;
            };
            let is_partition = part
                .strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('p'))
                .is_some_and(|n| {
                    !n.is_empty() && n.len() <= 3 && n.bytes().all(|b| b.is_ascii_digit())
                });
            if is_partition {
                held.push((format!("/dev/{part}"), entry.path().join("holders")));
            }
        }
    }
    let mut holders = Vec::new();
    for (held, holders_dir) in held {
        let Ok(entries) = std::fs::read_dir(&holders_dir) else {
            continue;
        };
        for entry in entries.take(MAX_SYSFS_ENTRIES).flatten() {
            let Ok(kernel) = entry.file_name().into_string() else {
                continue;
            };
            let Some(number) = kernel.strip_prefix("dm-") else {
                continue;
            };
            if number.is_empty() || number.len() > 6 || !number.bytes().all(|b| b.is_ascii_digit())
            {
                continue;
            }
            let read = |attribute: &str| -> String {
                let mut text = String::new();
                let _ = std::fs::File::open(sys_block.join(&kernel).join("dm").join(attribute))
                    .and_then(|f| {
                        std::io::Read::read_to_string(&mut std::io::Read::take(f, 256), &mut text)
                    });
                text.trim_end().to_owned()
            };
            let raw_name = read("name");
            let name: String = raw_name
                .chars()
                .map(|c| if c.is_ascii_graphic() { c } else { '?' })
                .take(128)
                .collect();
            let volume_group = read("uuid")
                .starts_with("LVM-")
                .then(|| lvm_volume_group(&raw_name))
                .flatten();
            holders.push(DmHolder {
                held: held.clone(),
                kernel,
                name,
                volume_group,
            });
        }
    }
    holders.sort_by(|a, b| (&a.held, &a.kernel).cmp(&(&b.held, &b.kernel)));
    holders
}

/// The volume group of an LVM device-mapper name `<vg>-<lv>` (a `-` inside either is doubled),
/// when it is a name LVM accepts (letters, digits, `+_.-`): the only text put into a command.
fn lvm_volume_group(dm_name: &str) -> Option<String> {
    let bytes = dm_name.as_bytes();
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'-' {
            if bytes.get(i + 1) == Some(&b'-') {
                i += 2;
                continue;
            }
            let vg = dm_name.get(..i)?.replace("--", "-");
            let valid = !vg.is_empty()
                && !vg.starts_with('-')
                && vg.len() <= 127
                && vg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'_' | b'.' | b'-'));
            return valid.then_some(vg);
        }
        i += 1;
    }
    None
}

/// `/dev/loopN` → `loopN`, refusing anything else.
pub fn kernel_name(device: &str) -> Option<&str> {
    let name = device.strip_prefix("/dev/")?;
    let number = name.strip_prefix("loop")?;
    (!number.is_empty() && number.len() <= 6 && number.bytes().all(|b| b.is_ascii_digit()))
        .then_some(name)
}

/// Reads one loop device's state; `None` when it is not attached.
pub fn inspect(sys_block: &Path, device: &str) -> Option<LoopDevice> {
    let name = kernel_name(device)?;
    let dir = sys_block.join(name);
    let backing = std::fs::read_to_string(dir.join("loop/backing_file")).ok()?;
    let backing = backing.trim_end_matches('\n');
    let backing_deleted = backing.ends_with(" (deleted)");
    let backing = backing.strip_suffix(" (deleted)").unwrap_or(backing);
    let read_only = std::fs::read_to_string(dir.join("ro"))
        .map(|s| s.trim() == "1")
        .unwrap_or(false);
    Some(LoopDevice {
        device: device.to_owned(),
        read_only,
        backing_file: PathBuf::from(backing),
        backing_deleted,
    })
}

/// The file a loop device reads, named by what the kernel holds rather than by path: the
/// device number and inode of its backing file, and the window of it the device shows (a PBS
/// mapping shows the whole file: offset 0, no size limit; `LOOP_SET_STATUS64` could move it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackingIdentity {
    pub device: u64,
    pub inode: u64,
    pub offset: u64,
    pub size_limit: u64,
}

impl BackingIdentity {
    /// The identity of the file at `path` (its `stat`).
    pub fn of_file(path: &Path) -> std::io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path)?;
        Ok(Self {
            device: meta.dev(),
            inode: meta.ino(),
            offset: 0,
            size_limit: 0,
        })
    }
}

impl std::fmt::Display for BackingIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "device {:#x} inode {}", self.device, self.inode)?;
        if self.offset != 0 || self.size_limit != 0 {
            write!(
                f,
                " from byte {} (size limit {})",
                self.offset, self.size_limit
            )?;
        }
        Ok(())
    }
}

/// `struct loop_info64` (`include/uapi/linux/loop.h`), which `LOOP_GET_STATUS64` fills.
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}
const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);

/// `LOOP_GET_STATUS64` (`include/uapi/linux/loop.h`).
const LOOP_GET_STATUS64: libc::c_ulong = 0x4C05;

/// The backing file `device` reads now (`LOOP_GET_STATUS64`: the `stat` of the file the
/// driver holds, `huge_encode_dev`, the same encoding `stat(2)` gives). Unlike sysfs'
/// `backing_file`, a path, this cannot be matched by another file given the same name.
pub fn backing_identity(device: &Path) -> std::io::Result<BackingIdentity> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(device)?;
    let mut info = LoopInfo64 {
        lo_device: 0,
        lo_inode: 0,
        lo_rdevice: 0,
        lo_offset: 0,
        lo_sizelimit: 0,
        lo_number: 0,
        lo_encrypt_type: 0,
        lo_encrypt_key_size: 0,
        lo_flags: 0,
        lo_file_name: [0; 64],
        lo_crypt_name: [0; 64],
        lo_encrypt_key: [0; 32],
        lo_init: [0; 2],
    };
    // SAFETY: `file` is an open descriptor for the call's duration; LOOP_GET_STATUS64 writes
    // exactly one `struct loop_info64` (232 bytes, checked above) through the pointer, which
    // points at `info`, a live value of that layout. On a device that is not a loop device
    // the call fails without writing.
    #[allow(unsafe_code)]
    let result = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            LOOP_GET_STATUS64,
            std::ptr::from_mut(&mut info),
        )
    };
    if result != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(BackingIdentity {
        device: info.lo_device,
        inode: info.lo_inode,
        offset: info.lo_offset,
        size_limit: info.lo_sizelimit,
    })
}

/// Every attached loop device.
pub fn attached(sys_block: &Path) -> Vec<LoopDevice> {
    let Ok(entries) = std::fs::read_dir(sys_block) else {
        return Vec::new();
    };
    let mut devices: Vec<LoopDevice> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|name| name.starts_with("loop"))
        .filter_map(|name| inspect(sys_block, &format!("/dev/{name}")))
        .collect();
    devices.sort_by(|a, b| a.device.cmp(&b.device));
    devices
}

/// The unit-name escaping `proxmox-backup-client` applies to the name of a mapping
/// (`proxmox_sys::systemd::escape_unit(name, false)`): `/` → `-`; ASCII letters, digits, `_` and
/// a non-leading `.` stay; every other byte, `:` and `-` included, becomes `\xNN`. (Unlike
/// `systemd-escape`, it escapes `:`.)
pub fn escape_unit(name: &str) -> String {
    let mut out = String::with_capacity(name.len() * 2);
    for (i, byte) in name.bytes().enumerate() {
        match byte {
            b'/' => out.push('-'),
            b'.' if i > 0 => out.push('.'),
            b if b.is_ascii_alphanumeric() || b == b'_' => out.push(char::from(b)),
            b => out.push_str(&format!("\\x{b:02x}")),
        }
    }
    out
}

/// The backing file a mapping of `archive` of `snapshot` from `repository` gets.
pub fn backing_file_name(repository: &str, snapshot: &str, archive: &str) -> String {
    escape_unit(&format!("{repository}:{snapshot}/{archive}"))
}

/// The `/dev/loopN` of a `… mapped on /dev/loopN` line, if the output has exactly one.
pub fn parse_mapped_on(stderr: &str) -> Option<String> {
    let mut found = stderr.lines().filter_map(|line| {
        let device = line.trim_end().rsplit_once(" mapped on ")?.1;
        kernel_name(device).map(|_| device.to_owned())
    });
    let first = found.next()?;
    found.next().is_none().then_some(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_matches_proxmox_escape_unit() {
        assert_eq!(
            backing_file_name(
                "certistack@pbs!restore@pbs.lab:8007:store1",
                "vm/100/2026-11-01T02:00:00Z",
                "drive-scsi0.img"
            ),
            "certistack\\x40pbs\\x21restore\\x40pbs.lab\\x3a8007\\x3astore1\\x3avm-100-2026\\x2d11\\x2d01T02\\x3a00\\x3a00Z-drive\\x2dscsi0.img"
        );
        assert_eq!(escape_unit(".hidden"), "\\x2ehidden");
        assert_eq!(
            holder_pid_file(Path::new(
                "/run/pbs-loopdev/s\\x3avm-100-drive\\x2dscsi0.img"
            )),
            Path::new("/run/pbs-loopdev/s\\x3avm-100-drive\\x2dscsi0.pid")
        );
    }

    #[test]
    fn device_mapper_holders_of_a_loop_device_and_its_partitions() {
        let sys = std::env::temp_dir().join(format!("certistack-sysblock-{}", std::process::id()));
        let write = |path: &str, text: &str| {
            let path = sys.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        std::fs::create_dir_all(sys.join("loop7/holders")).unwrap();
        std::fs::create_dir_all(sys.join("loop7/loop7p2/holders/dm-3")).unwrap();
        std::fs::create_dir_all(sys.join("loop7/loop7p1/holders")).unwrap();
        std::fs::create_dir_all(sys.join("loop7/holders/dm-9")).unwrap();
        // Not partitions or not device-mapper: ignored.
        std::fs::create_dir_all(sys.join("loop7/power/holders/dm-4")).unwrap();
        std::fs::create_dir_all(sys.join("loop7/loop7p1/holders/md0")).unwrap();
        write("dm-3/dm/name", "guest--vg-root\n");
        write("dm-3/dm/uuid", "LVM-abcdef\n");
        write("dm-9/dm/name", "odd\u{1b}name\n");
        write("dm-9/dm/uuid", "CRYPT-x\n");
        let holders = device_mapper_holders(&sys, "/dev/loop7");
        assert_eq!(
            holders,
            [
                DmHolder {
                    held: "/dev/loop7".into(),
                    kernel: "dm-9".into(),
                    name: "odd?name".into(),
                    volume_group: None,
                },
                DmHolder {
                    held: "/dev/loop7p2".into(),
                    kernel: "dm-3".into(),
                    name: "guest--vg-root".into(),
                    volume_group: Some("guest-vg".into()),
                },
            ]
        );
        assert!(
            holders[1]
                .describe()
                .contains("`dmsetup remove /dev/dm-3` (it is a volume of the guest's LVM volume group guest-vg: `vgchange -an guest-vg`"),
            "{}",
            holders[1].describe()
        );
        assert!(device_mapper_holders(&sys, "/dev/loop8").is_empty());
        assert_eq!(lvm_volume_group("vg;rm-x"), None);
        assert_eq!(lvm_volume_group("novg"), None);
        std::fs::remove_dir_all(&sys).unwrap();
    }

    #[test]
    fn a_holder_is_a_live_map_process_named_by_its_pid_file() {
        let dir = std::env::temp_dir().join(format!("certistack-holder-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let backing = dir.join("x-drive\\x2dscsi0.img");
        let client = Path::new("/usr/bin/proxmox-backup-client");
        let problem = holder_problem(&backing, client, "drive-scsi0.img").unwrap();
        assert!(problem.contains("cannot be read"), "{problem}");
        std::fs::write(holder_pid_file(&backing), "junk").unwrap();
        let problem = holder_problem(&backing, client, "drive-scsi0.img").unwrap();
        assert!(problem.contains("holds no pid"), "{problem}");
        // This test process is alive but is not a map of the archive.
        std::fs::write(holder_pid_file(&backing), std::process::id().to_string()).unwrap();
        let problem = holder_problem(&backing, client, "drive-scsi0.img").unwrap();
        assert!(problem.contains("pid was reused"), "{problem}");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        std::fs::write(holder_pid_file(&backing), dead.to_string()).unwrap();
        let problem = holder_problem(&backing, client, "drive-scsi0.img").unwrap();
        assert!(problem.contains("is dead"), "{problem}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn mapped_on_lines() {
        let out = "some progress\nImage 'r:vm/100/2026-11-01T02:00:00Z/drive-scsi0.img' mapped on /dev/loop7\n";
        assert_eq!(parse_mapped_on(out), Some("/dev/loop7".into()));
        assert_eq!(
            parse_mapped_on("Error: manifest does not contain file 'x.img.fidx'\n"),
            None
        );
        assert_eq!(parse_mapped_on("x mapped on /dev/sda\n"), None);
        assert_eq!(
            parse_mapped_on("a mapped on /dev/loop1\nb mapped on /dev/loop2\n"),
            None
        );
        assert_eq!(kernel_name("/dev/loop12"), Some("loop12"));
        assert_eq!(kernel_name("/dev/loop1/../sda"), None);
        assert_eq!(kernel_name("/dev/loop"), None);
    }
}
