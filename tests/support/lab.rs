//! A simulated Proxmox VE node: the test doubles, their state and a connector config pointing at
//! both; the source VM config a backup carries.

use crate::{NODE, TempDir, controller, enroll, lab_accel, lab_assets_dir};
use certistack_connector::config::Config;
use certistack_controller::authority::Authority;
use std::path::{Path, PathBuf};

/// The blob a PVE VM backup keeps the VM's config in, as the PBS double stores it.
pub const SOURCE_CONFIG_BLOB: &str = "qemu-server.conf.blob";
/// The first line of the config the support writes when a test gives none.
const DEFAULT_SOURCE_CONFIG_MARK: &str = "#certistack test default";

/// A source VM config for the snapshot in `dir` with the sandbox's long-standing shape (q35,
/// virtio-scsi, each `drive-scsiN.img` as scsiN, an empty CD-ROM, a virtio NIC), unless a test
/// stored its own config there.
pub(crate) fn write_default_source_config(dir: &Path) {
    let path = dir.join(SOURCE_CONFIG_BLOB);
    if std::fs::read_to_string(&path).is_ok_and(|t| !t.starts_with(DEFAULT_SOURCE_CONFIG_MARK)) {
        return;
    }
    let mut disks: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| {
            let slot = n.strip_prefix("drive-scsi")?.strip_suffix(".img")?;
            slot.parse::<u8>().ok()?;
            Some(format!("scsi{slot}"))
        })
        .collect();
    disks.sort();
    let mut text = format!(
        "{DEFAULT_SOURCE_CONFIG_MARK}\nboot: order={}\ncores: 1\nide2: none,media=cdrom\nmachine: q35\nmemory: 512\nnet0: virtio=BC:24:11:0A:0B:0C,bridge=vmbr0,firewall=1\nscsihw: virtio-scsi-pci\n",
        disks.first().map_or("net0", String::as_str)
    );
    for disk in &disks {
        text.push_str(&format!("{disk}: local-lvm:vm-100-disk-{disk},size=64M\n"));
    }
    std::fs::write(&path, text).unwrap();
}
/// A simulated Proxmox VE node: the test doubles of `proxmox-backup-client` and `qm` under
/// `<root>/bin`, their state under `<root>`, and a connector config pointing at both.
pub struct Lab {
    pub root: PathBuf,
    pub _dir: TempDir,
}

pub const PBS_PASSWORD: &str = "correct horse battery staple";

impl Lab {
    pub fn new(tag: &str) -> Self {
        let dir = TempDir::new(tag);
        let root = dir.0.join("lab");
        let bin = root.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let doubles = Path::new(env!("CARGO_MANIFEST_DIR")).join("doubles");
        for tool in ["proxmox-backup-client", "qm"] {
            let target = bin.join(tool);
            std::fs::copy(doubles.join(tool), &target).unwrap();
            std::fs::set_permissions(&target, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .unwrap();
        }
        let fingerprint = ["ab"; 32].join(":");
        // One verdict on the QEMU accelerator for all tests of this boot, from booting the
        // lab's guest (`disk-probe.img`) under KVM; CERTISTACK_LAB_ACCEL=kvm|tcg decides
        // instead for people who know better.
        let settings = serde_json::json!({
            "node": NODE,
            "pbs_password": PBS_PASSWORD,
            "pbs_fingerprint": fingerprint,
            // Beside the guest assets, as the lab keeps it: one verdict for both.
            "accel_cache": lab_assets_dir().join("qm-accel.json"),
            "accel_probe_disk": lab_assets_dir().join("current/disk-probe.img"),
            "accel": lab_accel(),
        });
        std::fs::write(root.join("double.json"), settings.to_string()).unwrap();
        // The packages a PVE 9 node has installed, as NodeChecks reads them.
        let dpkg = root.join("var/lib/dpkg");
        std::fs::create_dir_all(&dpkg).unwrap();
        std::fs::write(
            dpkg.join("status"),
            "Package: pve-manager\nStatus: install ok installed\nVersion: 9.0.6\n\n\
             Package: qemu-server\nStatus: install ok installed\nVersion: 9.0.18\n\n\
             Package: pve-qemu-kvm\nStatus: install ok installed\nVersion: 10.0.2-4\n",
        )
        .unwrap();
        Self { root, _dir: dir }
    }

    /// Changes settings of the doubles (`double.json`).
    pub fn settings(&self, patch: serde_json::Value) {
        let path = self.root.join("double.json");
        let mut settings: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for (key, value) in patch.as_object().unwrap() {
            settings[key] = value.clone();
        }
        std::fs::write(path, settings.to_string()).unwrap();
    }

    /// Runs the `qm` double directly, as an administrator of the node would.
    pub fn qm(&self, args: &[&str]) -> std::process::Output {
        std::process::Command::new(self.root.join("bin/qm"))
            .args(args)
            .output()
            .unwrap()
    }

    /// Stores a raw disk image as `<archive>` of `<snapshot>` in datastore `store1`; its first
    /// bytes are `marker`.
    pub fn add_backup(&self, snapshot: &str, archive: &str, marker: &[u8], size: u64) -> PathBuf {
        let dir = self.root.join("pbs/store1").join(snapshot);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(archive);
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(size).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&file, marker, 0).unwrap();
        write_default_source_config(&dir);
        path
    }

    /// Stores `config` as the snapshot's `qemu-server.conf` blob (every PVE VM backup carries
    /// one), replacing the default one.
    pub fn add_source_config(&self, snapshot: &str, config: &str) -> PathBuf {
        let dir = self.root.join("pbs/store1").join(snapshot);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(SOURCE_CONFIG_BLOB);
        std::fs::write(&path, config).unwrap();
        path
    }

    /// A controller in a temporary directory of its own, named by `authority_tag`, and this
    /// lab's connector config in `<root>/node`, enrolled with it: how a test of a simulated node
    /// begins before it edits the config and serves the connector.
    pub fn controller_and_node_config(&self, authority_tag: &str) -> (TempDir, Authority, Config) {
        let authority_dir = TempDir::new(authority_tag);
        let authority = controller(&authority_dir.0);
        let config = self.node_config(&authority, &self.root.join("node"));
        (authority_dir, authority, config)
    }

    /// A connector config for this lab, in `node_dir`, enrolled with `authority`.
    pub fn node_config(&self, authority: &Authority, node_dir: &Path) -> Config {
        let mut config = enroll(authority, node_dir, NODE);
        config.tools.proxmox_backup_client = self.root.join("bin/proxmox-backup-client");
        config.tools.qm = self.root.join("bin/qm");
        config.pve.qemu_server_run_dir = self.root.join("var/run/qemu-server");
        config.pve.vm_config_dir = self.root.join("etc/pve/qemu-server");
        config.pve.pbs_loopdev_dir = self.root.join("run/pbs-loopdev");
        config.pve.pve_cluster_dir = self.root.join("var/lib/pve-cluster");
        config.pve.dpkg_status = self.root.join("var/lib/dpkg/status");
        config.paths.overlay_root = self.root.join("overlays");
        config
    }

    /// Every invocation the doubles logged.
    pub fn calls(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.root.join("calls.log"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

impl Drop for Lab {
    /// A test that failed half-way must not leave loop devices, VMs or agents behind: stop what
    /// the doubles started under this root and detach its loop devices.
    fn drop(&mut self) {
        let conf_dir = self.root.join("etc/pve/qemu-server");
        if let Ok(entries) = std::fs::read_dir(&conf_dir) {
            for entry in entries.flatten() {
                if let Some(vmid) = entry
                    .file_name()
                    .to_str()
                    .and_then(|n| n.strip_suffix(".conf"))
                {
                    let _ = std::process::Command::new(self.root.join("bin/qm"))
                        .args(["stop", vmid])
                        .output();
                }
            }
        }
        for (device, _) in loops_under(&self.root) {
            let _ = std::process::Command::new(self.root.join("bin/proxmox-backup-client"))
                .args(["unmap", &device])
                .output();
            let _ = std::process::Command::new("losetup")
                .args(["-d", &device])
                .output();
        }
    }
}

/// Loop devices whose backing file lies under `dir`.
pub fn loops_under(dir: &Path) -> Vec<(String, PathBuf)> {
    certistack_connector::node::loopdev::attached(Path::new("/sys/block"))
        .into_iter()
        .filter(|l| l.backing_file.starts_with(dir))
        .map(|l| (l.device, l.backing_file))
        .collect()
}
