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
