//! The lab's guest disks, built once per machine, and the accelerator the lab's verdict picks.

use crate::{Lab, tool_installed, write_default_source_config};
use std::path::{Path, PathBuf};

/// The lab's guest disks (`tests/lab/build-assets.sh`): raw images that boot like a PVE VM
/// (SeaBIOS, SYSLINUX, a Debian kernel, a busybox init) and serve what their data area says.
pub struct GuestAssets {
    /// Boots; its `/init` reads the data area.
    pub boot: PathBuf,
    /// The same disk whose boot loader names an init that does not exist: the kernel panics.
    pub panic: PathBuf,
    /// The same disk whose init says "certistack-probe: init reached" on the serial console
    /// and powers off: what the qm double boots under KVM to decide the accelerator.
    pub probe: PathBuf,
    /// Where the data area (partition 2) starts in the image.
    pub data_offset: u64,
}

/// Where the lab's guest disks are built, once for the lab and every test.
pub fn lab_assets_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/lab-assets")
}

/// `CERTISTACK_LAB_ACCEL` (`kvm` or `tcg`) when set, else `auto`: the qm double then boots the
/// lab's guest under KVM once to decide.
pub fn lab_accel() -> &'static str {
    match std::env::var("CERTISTACK_LAB_ACCEL").as_deref() {
        Ok("kvm") => "kvm",
        Ok("tcg") => "tcg",
        Ok("") | Ok("auto") | Err(_) => "auto",
        Ok(other) => panic!("CERTISTACK_LAB_ACCEL={other:?}: give kvm, tcg or nothing"),
    }
}

/// The verdict the qm double of `lab` gives (`"kvm"` or `"tcg"`) and why; the connector's
/// libguestfs appliance is configured from the same verdict, as the lab does.
pub fn accel_verdict(lab: &Lab) -> (String, String) {
    let out = lab.qm(&["certistack-accel"]);
    assert!(
        out.status.success(),
        "qm certistack-accel: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let verdict: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    (
        verdict["accel"].as_str().unwrap().to_owned(),
        verdict["why"].as_str().unwrap().to_owned(),
    )
}

/// The connector's `[guest_network] accelerator` for `lab`'s node, from the qm double's verdict
/// (as the lab sets it): `tcg` where the lab's guest does not boot under KVM, `auto` where it
/// does. The verdict boots the lab's probe disk, built here when its tools are present; without
/// it the verdict is TCG, which always works.
pub fn appliance_accelerator(lab: &Lab) -> certistack_connector::config::ApplianceAccelerator {
    use certistack_connector::config::ApplianceAccelerator;
    let buildable = GUEST_ASSET_TOOLS.iter().all(|tool| tool_installed(tool));
    // A disk that cannot be built here (no network for the kernel package, say) leaves the
    // verdict to TCG, which always works, rather than failing a test that needs no lab disk.
    if buildable && std::panic::catch_unwind(guest_assets).is_err() {
        eprintln!("the lab's guest disks could not be built (above): the appliance runs under TCG");
    }
    let (accel, why) = accel_verdict(lab);
    eprintln!("libguestfs appliance accelerator from the qm double's verdict: {accel} ({why})");
    if accel == "kvm" {
        ApplianceAccelerator::Auto
    } else {
        ApplianceAccelerator::Tcg
    }
}

/// Tools the guest disks are built with, besides those of the node.
pub const GUEST_ASSET_TOOLS: &[&str] = &[
    "busybox",
    "cpio",
    "sfdisk",
    "mkfs.vfat",
    "mcopy",
    "syslinux",
    "qemu-ga",
];

/// Builds the guest disks once per machine into `target/lab-assets` (a cached build returns at
/// once) and once per test process.
pub fn guest_assets() -> &'static GuestAssets {
    static ASSETS: std::sync::OnceLock<GuestAssets> = std::sync::OnceLock::new();
    ASSETS.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let dir = lab_assets_dir();
        let out = std::process::Command::new("bash")
            .arg(root.join("tests/lab/build-assets.sh"))
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "building the guest disks failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let current = dir.join("current");
        let layout = std::fs::read_to_string(current.join("layout")).unwrap();
        let data_offset = layout
            .lines()
            .find_map(|l| l.strip_prefix("DATA_OFFSET="))
            .unwrap()
            .parse()
            .unwrap();
        GuestAssets {
            boot: current.join("disk-boot.img"),
            panic: current.join("disk-panic.img"),
            probe: current.join("disk-probe.img"),
            data_offset,
        }
    })
}

/// What a lab guest disk holds: the marker it serves, its address and whether qemu-ga runs.
pub struct GuestDisk<'a> {
    pub marker: &'a str,
    /// `10.77.1.10/24`
    pub address: &'a str,
    pub agent: bool,
    /// `false`: the kernel panics before any of it is read.
    pub boots: bool,
}

impl GuestDisk<'_> {
    /// The body the guest's HTTP server answers `/` with.
    pub fn http_body(&self) -> String {
        format!("certistack lab guest: marker {}\n", self.marker)
    }

    /// The banner its TCP service on port 22 sends.
    pub fn banner(&self) -> String {
        format!("CERTISTACK-LAB {}", self.marker)
    }
}

impl Lab {
    /// Stores a lab guest disk as `<archive>` of `<snapshot>` in datastore `store1`.
    pub fn add_guest_backup(&self, snapshot: &str, archive: &str, disk: &GuestDisk) -> PathBuf {
        let assets = guest_assets();
        let dir = self.root.join("pbs/store1").join(snapshot);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(archive);
        let image = if disk.boots {
            &assets.boot
        } else {
            &assets.panic
        };
        std::fs::copy(image, &path).unwrap();
        let data = format!(
            "certistack-lab-disk v1\nmarker={}\naddress={}\nagent={}\n",
            disk.marker,
            disk.address,
            if disk.agent { "yes" } else { "no" }
        );
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&file, data.as_bytes(), assets.data_offset)
            .unwrap();
        write_default_source_config(&dir);
        path
    }
}
